"""Named models and machines, as plain mappings that a scenario can start from and override.

Model shapes are from the models' public config.json. GPU peaks are datasheet figures
(docs/design.md §3.2); efficiencies are starting points, not measurements: pinned PCIe copies reach
about 80% of the theoretical rate, and host figures follow the MoE-Lightning artifact's optimizer
profiles (T4 host 0.8 TFLOPS achieved, L4 host 1.6, host memory ~100 GiB/s, L4 CPU->GPU ~16 GiB/s).
`tg calibrate` replaces them with measured ones.
"""

from __future__ import annotations

from typing import Any

# gpt-oss's two sizes share everything but their depth and experts: sliding-window attention
# (128 tokens) on every other layer from the first, sinks, experts in MXFP4.
_GPT_OSS = dict(architecture="gpt_oss", h=2880, h_i=2880, n_q=64, n_kv=8, head_dim=64, k=4,
                V=201088, sliding_window=128, attention_sinks=True, rope_theta=150000.0,
                precision=dict(experts="mxfp4"))

MODELS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(name="mixtral-8x7b", h=4096, h_i=14336, L=32, n_q=32, n_kv=8, E=8, k=2,
                         V=32000),
    "mixtral-8x22b": dict(name="mixtral-8x22b", h=6144, h_i=16384, L=56, n_q=48, n_kv=8, E=8, k=2,
                          V=32768),
    "dbrx": dict(name="dbrx", h=6144, h_i=10752, L=40, n_q=48, n_kv=8, E=16, k=4, V=100352,
                 rope_theta=500000.0, architecture="dbrx"),
    # Small enough for tests and the CPU executor, which computes in fp32 (4-byte weights).
    "tiny": dict(name="tiny", h=256, h_i=512, L=4, n_q=8, n_kv=2, E=8, k=2, V=1024,
                 dtype_bytes=4),
    # The MoEs offloaded today, from their public config.json (docs/models.md), stored as their
    # makers publish them: bf16; DeepSeek-V3's linear layers in FP8 with a scale per 128 x 128
    # block; gpt-oss's experts in MXFP4. A quantized copy is `--set model.precision.experts=q4_k`
    # (and the other classes), or the GGUF file itself (model: x.gguf).
    "qwen3-30b-a3b": dict(name="qwen3-30b-a3b", architecture="qwen3_moe", h=2048, h_i=768,
                          L=48, n_q=32, n_kv=4, head_dim=128, E=128, k=8, V=151936,
                          renormalize=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3-235b-a22b": dict(name="qwen3-235b-a22b", architecture="qwen3_moe", h=4096, h_i=1536,
                            L=94, n_q=64, n_kv=4, head_dim=128, E=128, k=8, V=151936,
                            renormalize=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen2-57b-a14b": dict(name="qwen2-57b-a14b", architecture="qwen2_moe", h=3584, h_i=2560,
                           L=28, n_q=28, n_kv=4, E=64, k=8, V=151936, shared_experts=1,
                           h_shared=20480, shared_gate=True, renormalize=False, rope_theta=1e6,
                           rms_norm_eps=1e-6),
    "deepseek-v3": dict(name="deepseek-v3", architecture="deepseek_v3", h=7168, h_i=2048, L=61,
                        n_q=128, n_kv=128, E=256, k=8, V=129280, dense_layers=(0, 1, 2),
                        h_dense=18432, shared_experts=1, h_shared=2048, router="sigmoid",
                        renormalize=True, expert_groups=8, topk_groups=4, routed_scaling=2.5,
                        attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        rope_theta=10000.0, rms_norm_eps=1e-6,
                        precision=dict.fromkeys(("attention", "experts", "shared", "dense"),
                                                "fp8-block128")),
    "deepseek-v2-lite": dict(name="deepseek-v2-lite", architecture="deepseek_v2", h=2048,
                             h_i=1408, L=27, n_q=16, n_kv=16, E=64, k=6, V=102400,
                             dense_layers=(0,), h_dense=10944, shared_experts=2, h_shared=1408,
                             renormalize=False, attention="mla", kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             rope_theta=10000.0, rms_norm_eps=1e-6),
    "gpt-oss-20b": dict(_GPT_OSS, name="gpt-oss-20b", L=24, E=32,
                        sliding_layers=tuple(range(0, 24, 2))),
    "gpt-oss-120b": dict(_GPT_OSS, name="gpt-oss-120b", L=36, E=128,
                         sliding_layers=tuple(range(0, 36, 2))),
    "olmoe-1b-7b": dict(name="olmoe-1b-7b", architecture="olmoe", h=2048, h_i=1024, L=16,
                        n_q=16, n_kv=16, E=64, k=8, V=50304, renormalize=False,
                        rope_theta=10000.0),
    "phi-3.5-moe": dict(name="phi-3.5-moe", architecture="phimoe", h=4096, h_i=6400, L=32,
                        n_q=32, n_kv=8, E=16, k=2, V=32064, rope_theta=10000.0,
                        attention_bias=True, lm_head_bias=True),
    "glm-4.5-air": dict(name="glm-4.5-air", architecture="glm4_moe", h=4096, h_i=1408, L=46,
                        n_q=96, n_kv=8, head_dim=128, E=128, k=8, V=151552, dense_layers=(0,),
                        h_dense=10944, shared_experts=1, h_shared=1408, router="sigmoid",
                        renormalize=True, rope_theta=1e6, attention_bias=True,
                        rope_partial=0.5),
}

# Provenance of the figures fitted by `tg fit` (taskgraph.study.fit) to the MoE-Lightning paper's
# Table 4: 12 end-to-end throughputs, Mixtral 8x7B on its T4 and L4 machines
# (shared/measurements/moe-lightning-table4.yaml). Refit with
# `tg fit ../shared/measurements/moe-lightning-table4.yaml --out fit/`.
FITTED = ("tg fit on MoE-Lightning (ASPLOS 2025) Table 4, 12 cells, 2026-12-06: median "
          "|error| 6.1%, leave-one-out median 8.1% (max 48.7%, FlexGen(c) on the L4)")
# The same for the paper's multi-GPU machines, fitted to its Fig. 7 S6 and S7 cells: Mixtral
# 8x22B on 2xT4 and 4xT4 (one 32-core host), MoE-Lightning(p) and DeepSpeed
# (shared/measurements/moe-lightning-multi-gpu.yaml). Refit with
# `tg fit scenarios/measurements/moe-lightning-multi-gpu.yaml --out fit/`.
FITTED_MULTI = ("tg fit on MoE-Lightning (ASPLOS 2025) Fig. 7 S6/S7, 16 cells, 2026-11-24: "
                "median |error| 4.3%, leave-one-out median 5.3% (max 27.2%, DeepSpeed on 4xT4 "
                "at 32 tokens)")
FITTED_SMALL = ("tg fit on the Fiddler authors' small-batch artifact (efeslab/fiddler, "
                "batched_baseline), 16 cells, 2026-12-06: median |error| 2.0%, leave-one-out "
                "median 2.5% (max 23.2%, DeepSpeed on the RTX A6000, its machine's one "
                "DeepSpeed cell)")

_GPUS: dict[str, dict[str, Any]] = {
    # flops_eff of the T4 and L4 is fitted (FITTED): the fp16 rate their prefill sustains, MoE
    # dispatch and unfused prompt attention included. The T4's 5.5 TFLOPS agrees with
    # FlexGen's own profiler on that machine (3.5 TFLOPS for its prefill matmuls,
    # shared/reference/flexgen-cost-model.yaml); a 70 W T4 throttles far below its 65 TFLOPS.
    "T4": dict(memory_gb=16, mem_gbps=320, tflops=65, flops_eff=0.0839, mem_eff=0.85),
    "L4": dict(memory_gb=24, mem_gbps=300, tflops=121, flops_eff=0.166, mem_eff=0.85),
    "A100-80G": dict(memory_gb=80, mem_gbps=2039, tflops=312, flops_eff=0.7, mem_eff=0.85),
    "H100-SXM": dict(memory_gb=80, mem_gbps=3350, tflops=989, flops_eff=0.6, mem_eff=0.85),
    "H200": dict(memory_gb=141, mem_gbps=4800, tflops=989, flops_eff=0.6, mem_eff=0.85),
    # Consumer and workstation cards (datasheet figures, not fitted): dense fp16 tensor rate
    # with fp32 accumulation, as PyTorch's GEMMs run it.
    "RTX4090": dict(memory_gb=24, mem_gbps=1008, tflops=165, flops_eff=0.5, mem_eff=0.85),
    "RTXA5000": dict(memory_gb=24, mem_gbps=768, tflops=111, flops_eff=0.5, mem_eff=0.85),
    # The cards people offload on (NVIDIA's Ampere, Ada and Blackwell whitepapers and
    # datasheets: memory bandwidth, dense fp16 tensor rate with fp32 accumulation; GeForce
    # cards run that at half their fp16-accumulate rate). Not fitted.
    "RTX3090": dict(memory_gb=24, mem_gbps=936, tflops=71, flops_eff=0.5, mem_eff=0.85),
    "RTX5090": dict(memory_gb=32, mem_gbps=1792, tflops=209.5, flops_eff=0.5, mem_eff=0.85),
    "RTX6000-Ada": dict(memory_gb=48, mem_gbps=960, tflops=364.2, flops_eff=0.5, mem_eff=0.85),
    "RTXPRO6000": dict(memory_gb=96, mem_gbps=1792, tflops=503.8, flops_eff=0.5, mem_eff=0.85),
    "RTX4090D": dict(memory_gb=24, mem_gbps=1008, tflops=147, flops_eff=0.5, mem_eff=0.85),
    "RTX3090Ti": dict(memory_gb=24, mem_gbps=1008, tflops=80, flops_eff=0.5, mem_eff=0.85),
    "RTXA6000": dict(memory_gb=48, mem_gbps=768, tflops=154.8, flops_eff=0.5, mem_eff=0.85),
    "RTX2080": dict(memory_gb=8, mem_gbps=448, tflops=40.3, flops_eff=0.5, mem_eff=0.85),
}

_LINKS: dict[str, dict[str, Any]] = {
    "pcie3": dict(h2d_gbps=15.75, d2h_gbps=15.75, h2d_eff=0.8, d2h_eff=0.8, latency_us=10),
    # The L4 machines of the paper reach ~16 GiB/s host->device, about 55% of PCIe 4.0 x16.
    "pcie4-l4": dict(h2d_gbps=31.5, d2h_gbps=31.5, h2d_eff=0.55, d2h_eff=0.55, latency_us=10),
    # The paper's T4 and L4 hosts as FlexGen's profiler measured them
    # (shared/reference/flexgen-cost-model.yaml): weights from pageable memory cross at
    # 5.43 GiB/s on both, the driver's staging copy being the limit.
    "pcie3-paper": dict(h2d_gbps=15.75, d2h_gbps=15.75, h2d_eff=0.8, d2h_eff=0.8, latency_us=10,
                        pageable_h2d_gbps=5.83),
    "pcie4-l4-paper": dict(h2d_gbps=31.5, d2h_gbps=31.5, h2d_eff=0.55, d2h_eff=0.55,
                           latency_us=10, pageable_h2d_gbps=5.85),
    "pcie4": dict(h2d_gbps=31.5, d2h_gbps=31.5, h2d_eff=0.8, d2h_eff=0.8, latency_us=10),
    "pcie5": dict(h2d_gbps=63.0, d2h_gbps=63.0, h2d_eff=0.8, d2h_eff=0.8, latency_us=8),
}

# Between the GPUs of one machine, for tensor parallelism's all-reduces (reasoned, not measured
# here; `gbps` is what one GPU sends at in a ring, nccl-tests' "bus bandwidth").
_INTERCONNECTS: dict[str, dict[str, Any]] = {
    # T4s have no NVLink, and cloud VMs rarely allow PCIe peer-to-peer: NCCL's ring goes through
    # host memory, every hop crossing PCIe 3.0 twice (~12.6 GB/s achieved, halved).
    "pcie3-host": dict(name="PCIe 3.0 through host memory", gbps=12.6, eff=0.5, latency_us=20,
                       through_host=True),
    # A100 SXM NVLink 3: 300 GB/s each way; NCCL reaches ~230 GB/s bus bandwidth.
    "nvlink3": dict(name="NVLink 3", gbps=300, eff=0.77, latency_us=8),
}

# One core's memory traffic on the paper's Xeon hosts: FlexGen's profiler moved weights from
# pageable memory at 5.43 GiB/s on both (shared/reference/flexgen-cost-model.yaml), a copy the
# CUDA driver makes on one thread into its pinned buffer, reading and writing each byte:
# 2 x 5.83 GB/s.
_XEON_CORE_GBPS = 11.66

_HOSTS: dict[str, dict[str, Any]] = {
    # The paper's 1xT4 / 1xL4 host: 24-core Xeon @2.2-2.3 GHz, 192 GB.
    "xeon-24c": dict(name="Xeon 24-core 2.3 GHz", cores=24, memory_gb=192, mem_gbps=140,
                     tflops=1.6, flops_eff=0.5, mem_eff=0.75, memcpy_gbps=20,
                     core_gbps=_XEON_CORE_GBPS),
    # The same host class at 2.2 GHz (FlexGen's profiler found the two hosts within 16% of
    # each other), so the same figures scaled by clock.
    "xeon-24c-l4": dict(name="Xeon 24-core 2.2 GHz", cores=24, memory_gb=192, mem_gbps=140,
                        tflops=1.53, flops_eff=0.5, mem_eff=0.75, memcpy_gbps=20,
                        core_gbps=_XEON_CORE_GBPS),
    # The paper's 2x/4xT4 host: 32 cores, 416 GB (the memory of a GCP n1-highmem-64: 64
    # hyperthreads on two sockets, 136 GB/s of DDR4-2133 channels in all).
    "xeon-32c": dict(name="Xeon 32-core 2.3 GHz", cores=32, memory_gb=416, mem_gbps=140,
                     tflops=2.4, flops_eff=0.5, mem_eff=0.75, memcpy_gbps=20,
                     core_gbps=_XEON_CORE_GBPS),
    "epyc-64c": dict(name="EPYC 64-core", cores=64, memory_gb=1024, mem_gbps=300,
                     tflops=4.0, flops_eff=0.5, mem_eff=0.75, memcpy_gbps=40),
    "xeon-112c": dict(name="2x Xeon 56-core", cores=112, memory_gb=2048, mem_gbps=600,
                      tflops=8.0, flops_eff=0.5, mem_eff=0.75, memcpy_gbps=50),
    # A desktop (Ryzen 9 7950X class): 16 cores, dual-channel DDR5-5600 (89.6 GB/s), 192 GB
    # (four 48 GB modules: Mixtral 8x7B's 93 GB of fp16 weights and a KV cache); fp32 AVX-512
    # at ~4.5 GHz. Datasheet figures, not measured.
    "desktop-16c": dict(name="desktop 16-core, DDR5-5600 x2", cores=16, memory_gb=192,
                        mem_gbps=89.6, tflops=2.3, flops_eff=0.5, mem_eff=0.75,
                        memcpy_gbps=25),
    # Hosts people offload onto (datasheet figures, not measured): memory bandwidth is channels
    # x transfer rate x 8 bytes; fp32 rate is cores x all-core clock x FLOPs a cycle (Zen 3:
    # 2 x 256-bit FMA, 32; Zen 5 desktop: 2 x 512-bit, 64; Zen 4: 32; Golden Cove AVX-512: 64).
    "desktop-ddr4": dict(name="desktop 16-core, DDR4-3200 x2", cores=16, memory_gb=128,
                         mem_gbps=51.2, tflops=2.0, flops_eff=0.5, mem_eff=0.75,
                         memcpy_gbps=16),
    "desktop-ddr5": dict(name="desktop 16-core, DDR5-6000 x2", cores=16, memory_gb=192,
                         mem_gbps=96.0, tflops=4.6, flops_eff=0.5, mem_eff=0.75,
                         memcpy_gbps=25),
    "xeon-w-8ch": dict(name="Xeon w9-3495X 56-core, DDR5-4800 x8", cores=56, memory_gb=512,
                       mem_gbps=307.2, tflops=9.0, flops_eff=0.5, mem_eff=0.75,
                       memcpy_gbps=40),
    "epyc-12ch": dict(name="EPYC 9654 96-core, DDR5-4800 x12", cores=96, memory_gb=768,
                      mem_gbps=460.8, tflops=7.4, flops_eff=0.5, mem_eff=0.75, memcpy_gbps=50),
    # An H100 cloud slice with few host cores: the "weak CPU" case the reviewers asked about.
    # A host the source does not state (the Fiddler authors' RTX 6000 Ada and RTX A6000): a
    # two-socket-class server as such cards sit in, assumed, not known. One GPU's expert copies
    # and ZeRO-3 gathers cross its link, so none of these figures decides those runs; they
    # only have to hold Mixtral's 93 GB.
    "server-unstated": dict(name="server (unstated; assumed 32 cores, 256 GB, 8 x DDR4-3200)",
                            cores=32, memory_gb=256, mem_gbps=204.8, tflops=2.4,
                            flops_eff=0.5, mem_eff=0.75, memcpy_gbps=20),
    "weak-16c": dict(name="16 vCPU", cores=16, memory_gb=512, mem_gbps=100,
                     tflops=0.8, flops_eff=0.5, mem_eff=0.7, memcpy_gbps=15),
}


def _machine(name: str, gpu: str, count: int, link: str, host: str,
             interconnect: str | None = None, gpu_fitted: dict[str, Any] | None = None,
             link_fitted: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    out = dict(
        name=name,
        gpu=dict(name=gpu, count=count, **{**_GPUS[gpu], **(gpu_fitted or {})}),
        cpu=dict(_HOSTS[host]),
        link={**_LINKS[link], **(link_fitted or {})},
        **extra,
    )
    if interconnect:
        out["interconnect"] = dict(_INTERCONNECTS[interconnect])
    return out


_T4_SEVERAL = dict(flops_eff=0.0975)
_XEON_32C_SHARED_GBPS = 59.21

HARDWARE: dict[str, dict[str, Any]] = {
    "t4": _machine("1xT4", "T4", 1, "pcie3-paper", "xeon-24c",
                   fitted=f"gpu.flops_eff: {FITTED}"),
    # The paper's multi-GPU host. Fitted (FITTED_MULTI): the T4s' prefill rate (9.7% of peak;
    # the one-GPU fit, on other cells and another host, found 8.4%) and the host memory
    # bandwidth that its GPUs' DMA, its processes' copies into pinned memory and CPU attention
    # share (59 GB/s, 43% of what its DDR4-2133 channels carry: two sockets, and processes
    # and pinned buffers with no regard to which socket their memory is on). Whether the T4s
    # share PCIe lanes upstream is not published: not modelled (shared.pcie_gbps absent).
    # Pageable copies as FlexGen's profiler measured them on the one-GPU hosts of the same
    # Xeon generation: one core's copy.
    "2xt4": _machine("2xT4", "T4", 2, "pcie3-paper", "xeon-32c", "pcie3-host",
                     gpu_fitted=_T4_SEVERAL, shared=dict(memory_gbps=_XEON_32C_SHARED_GBPS),
                     fitted=f"gpu.flops_eff, shared.memory_gbps: {FITTED_MULTI}"),
    "4xt4": _machine("4xT4", "T4", 4, "pcie3-paper", "xeon-32c", "pcie3-host",
                     gpu_fitted=_T4_SEVERAL, shared=dict(memory_gbps=_XEON_32C_SHARED_GBPS),
                     fitted=f"gpu.flops_eff, shared.memory_gbps: {FITTED_MULTI}"),
    "l4": _machine("1xL4", "L4", 1, "pcie4-l4-paper", "xeon-24c-l4",
                   fitted=f"gpu.flops_eff: {FITTED}"),
    "a100-80g": _machine("1xA100-80G", "A100-80G", 1, "pcie4", "epyc-64c"),
    "2xa100-80g": _machine("2xA100-80G", "A100-80G", 2, "pcie4", "epyc-64c", "nvlink3"),
    "h100": _machine("1xH100", "H100-SXM", 1, "pcie5", "xeon-112c"),
    # Small-batch machines (docs/experts.md): a gaming PC, and the workstation card
    # MoE-Infinity's README measured on (PCIe 4.0 at ~24 GB/s, as its paper states).
    "rtx4090": _machine("1xRTX4090", "RTX4090", 1, "pcie4", "desktop-16c"),
    "a5000": _machine("1xRTXA5000", "RTXA5000", 1, "pcie4", "xeon-24c"),
    "h100-weak-host": _machine("1xH100, weak host", "H100-SXM", 1, "pcie5", "weak-16c"),
    "h200": _machine("1xH200", "H200", 1, "pcie5", "xeon-112c"),
    # The machines people offload today's MoEs on (datasheet figures, labelled as such): gaming
    # PCs with dual-channel memory, and workstations with 8 or 12 channels (kTransformers' and
    # llama.cpp's --n-cpu-moe users' machines).
    "rtx3090": _machine("1xRTX3090", "RTX3090", 1, "pcie4", "desktop-ddr4"),
    "rtx5090": _machine("1xRTX5090", "RTX5090", 1, "pcie5", "desktop-ddr5"),
    "rtx4090-epyc": _machine("1xRTX4090, EPYC 12-channel", "RTX4090", 1, "pcie4", "epyc-12ch"),
    "rtx6000ada-xeon": _machine("1xRTX6000-Ada, Xeon W 8-channel", "RTX6000-Ada", 1, "pcie4",
                                "xeon-w-8ch"),
    # The Fiddler authors' small-batch artifact's machines (scenarios/measurements/
    # small-batch-fiddler-artifact.yaml names them by its folders; its L4 is the l4 preset,
    # whose link the MoE-Lightning artifact measured, though DeepSpeed moved weights across it
    # at 0.6 of that rate: docs/accuracy.md): datasheet GPUs and PCIe 4.0 x16, hosts unstated,
    # each link's rate fitted (FITTED_SMALL) to DeepSpeed's one-GPU runs there, which stream
    # every weight across it each step.
    "ada6000": _machine("1xRTX6000-Ada", "RTX6000-Ada", 1, "pcie4", "server-unstated",
                        link_fitted=dict(h2d_eff=0.7838),
                        fitted=f"link.h2d_eff: {FITTED_SMALL}"),
    "rtx-a6000": _machine("1xRTXA6000", "RTXA6000", 1, "pcie4", "server-unstated",
                          link_fitted=dict(h2d_eff=0.6196),
                          fitted=f"link.h2d_eff: {FITTED_SMALL}"),
    "rtxpro6000-epyc": _machine("1xRTXPRO6000, EPYC 12-channel", "RTXPRO6000", 1, "pcie5",
                                "epyc-12ch"),
}

# The implementation profile each system named in a measurements file runs as, where it is not
# the one its schedule stands for by default (a file of Fiddler's or kTransformers' runs would
# name them; the published rows of scenarios/small-batch/ name theirs in their scenarios).
SYSTEMS: dict[str, str] = {
    "Mixtral-offloading": "mixtral-offloading",
    "llama.cpp": "llama.cpp",
    "Fiddler": "fiddler",
    "kTransformers": "ktransformers",
}

# Workload shapes from the paper (docs/design.md §6).
WORKLOADS: dict[str, dict[str, Any]] = {
    "mtbench": dict(prompt_len=77, max_prompt_len=418, gen_len=128),
    "helm-reasoning": dict(prompt_len=242, max_prompt_len=256, gen_len=50),
    "helm-summarization": dict(prompt_len=1693, max_prompt_len=1984, gen_len=64),
}


def _block_quantized_cpu_experts() -> dict[str, Any]:
    """The CPU experts' kernel of ggml's family for block-quantized weights (llama.cpp's, and
    llamafile's tinyBLAS and iqk_mul_mat in kTransformers): each block unpacked and multiplied
    between its loads, so a CPU expert's reads and arithmetic add (the "llama.cpp" profile
    below gives the measurement). A fresh mapping for each profile that uses it."""
    return {"CPUFFN": dict(serial=True)}


# Implementation profiles: what one system's software achieves relative to the machine's own
# kernels and copies (taskgraph.specs.ImplementationSpec). "ideal" prices every task at the
# machine's rates. The figures marked fitted come from `tg fit` on the MoE-Lightning paper's
# Table 4 and Fig. 7 (shared/measurements); the rest are public measurements, cited where they
# are used.
IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "ideal": dict(name="ideal", title="the machine's own rates, no software losses"),
    # What `tg validate` prices tg's own executor as: the calibrated machine's rates (its
    # fitted per-kind costs already hold the executor's own overheads), and weights copied from
    # pageable memory by the schedules without pinned staging, as its runtime really copies them.
    "tg": dict(name="tg", title="tg's own executor (the calibrated machine's rates)",
               pageable_weights=True),
    # Fitted (FITTED_MULTI): on several GPUs each of its processes (one per GPU, tensor
    # parallel) does its host work, its heads' CPU attention and its copies into pinned memory,
    # with about one thread (0.94): what torchrun gives a process unless told otherwise
    # (OMP_NUM_THREADS=1). Its copies then run at one core's rate, and the 2xT4 machine's decode
    # is bound by them; on one GPU its one process has every core.
    "moe-lightning": dict(
        name="moe-lightning", title="MoE-Lightning (CGOPipe's system)", rank_threads=0.9369,
        fitted=f"rank_threads: {FITTED_MULTI}",
        sources=["MoE-Lightning, ASPLOS 2025: pinned staging of weights (Algorithm 1)"]),
    # DeepSpeed ZeRO-Inference: transformers' eager Mixtral under ZeRO-3 parameter offload, data
    # parallel on several GPUs. Its parameters are offloaded to pinned CPU memory
    # (offload_param.pin_memory, as the ZeRO-Inference examples set it); the eager kernels are
    # PyTorch's GEMMs and SDPA at the machine's rates, and the eager MoE block reads the weights
    # of every expert it routes to, which the cost model charges already. Fitted
    # (FITTED_MULTI): on several GPUs its layer-by-layer parameter gather moves weights at 20%
    # of each GPU's link (2.5 GB/s on a T4): ZeRO-3 fetches module by module with Python hooks
    # and gathers through host memory, the GPUs having no peer-to-peer. That figure is the
    # shared host's: on one GPU the gather is its own mechanism (kinds.D3).
    "deepspeed": dict(
        name="deepspeed", title="DeepSpeed ZeRO-Inference (transformers' eager Mixtral)",
        several_gpus_kinds={"D3": dict(bytes_eff=0.2024)},
        fitted=f"several_gpus_kinds.D3.bytes_eff: {FITTED_MULTI}",
        sources=["DeepSpeed ZeRO-3 offload_param with pin_memory (deepspeed.readthedocs.io, "
                 "zero3.html); transformers MixtralSparseMoeBlock: a loop over the experts hit"]),
    # Mixtral-offloading (dvmazur/mixtral-offloading), the expert cache as the Fiddler authors
    # ran it unquantized: an LRU cache of experts a layer on the GPU, the rest in pinned host
    # memory, the MoE block a Python loop over the experts chosen. A miss swaps: the chosen
    # expert is copied in and the evicted one out, one after the other on the one CUDA stream
    # (the artifact's src/expert_cache.py, ExpertCache._swap). Nothing fitted: with the swap
    # priced, its copies run at the link's rates DeepSpeed's gathers reach on the same machines
    # (`tg fit` put their share at its bound, 1.0; it was 0.74 of one copy a miss before).
    "mixtral-offloading": dict(
        name="mixtral-offloading",
        title="Mixtral-offloading (an LRU expert cache that swaps, transformers' eager Mixtral)",
        expert_swaps=True,
        sources=["dvmazur/mixtral-offloading, and the Fiddler artifact's copy "
                 "(efeslab/fiddler benchmarks/mixtral_offloading/src/expert_cache.py): "
                 "offloaded experts in pinned host storage; on a miss ExpertCache._swap copies "
                 "the expert in and the evicted one out on the current stream"]),
    "flexgen": dict(
        name="flexgen", title="FlexGen (its Mixtral port in the MoE-Lightning artifact)",
        # Weights (pin_weight=False in its generated policies) and its KV cache
        # (init_cache_one_gpu_batch allocates it unpinned, "due to high memory overhead") are
        # copied to the GPU through one path, a pinned copy made for each, which its profiler
        # timed at ctog_bdw, 5.43 GiB/s, for both.
        pageable_weights=True, pageable_kv_cache=True,
        kinds={# FlexGen's own profiler: GPU->CPU copies of cache and hidden states at
               # 2.0151 GiB/s on both machines, against ~12.6 GB/s that pinned PCIe 3.0 copies
               # reach (shared/reference/flexgen-cost-model.yaml, gtoc_bdw_*).
               "KVOut": dict(bytes_eff=0.171), "D1": dict(bytes_eff=0.171),
               # Its pipeline's stages pass hidden states through the CPU (its multi-GPU runs
               # use a CPU communication device): the same copies, out and back in.
               "Send": dict(bytes_eff=0.171),
               # Fitted (FITTED): its CPU attention (FlexGen(c)) moves KV at 1.7% of host
               # memory bandwidth, ~1.8 GB/s: it upcasts the fp16 cache to fp32 and computes
               # with repeated KV heads in PyTorch ops, not a fused kernel.
               "CPUAttn": dict(bytes_eff=0.0172)},
        fitted=f"kinds.CPUAttn.bytes_eff: {FITTED}",
        sources=["FlexGen's fitted cost model for these machines "
                 "(shared/reference/flexgen-cost-model.yaml): pageable weight copies at "
                 "5.43 GiB/s (pin_weight=False), GPU->CPU at 2.0 GiB/s",
                 "FlexGen's pytorch_backend.py: its CPU KV cache allocated unpinned "
                 "(init_cache_one_gpu_batch), copied to the GPU as its unpinned weights are"]),
    # Fiddler (efeslab/fiddler, src/fiddler/mixtral.py), EP as its authors run Mixtral: the
    # CPU's experts are transformers' bf16 expert modules called in PyTorch, on the 16
    # threads its generate() sets (torch.set_num_threads(16)). Measured here with oneDNN held
    # to AVX512_CORE, the instruction set of its Skylake and Cascade Lake hosts (no bf16
    # arithmetic), against fp32 on the same threads in the same run (python
    # bench/cpu_expert_rate.py; bench/results/cpu-2026-12-05/):
    # - one token an expert streams its weights as a matrix-vector product at 0.76-0.80 of
    #   fp32's rate a thread: sixteen threads at that share of a core's 11.66 GB/s
    #   (core_gbps of the paper's Xeons) ask 144 GB/s, more than those hosts' 105, so the
    #   host's rate stands (the kind's own effects: none);
    # - two or more tokens convert and pack the weights, then multiply, one after the other:
    #   the packing at 0.38-0.46 of a thread's fp32 bandwidth, so sixteen threads read at
    #   16 x 0.42 x 11.66 = 78 GB/s, 0.75 of those hosts' 105 (bytes_eff); the arithmetic at
    #   0.30-0.35 of fp32's FLOP rate (flops_eff 0.32, of the 16 threads' share of the host);
    # - before a layer's experts its host chooses where each runs, summing the cost of all
    #   2^8 CPU/GPU assignments in Python: 0.33 ms a layer timed here (a fixed cost of the
    #   layer's CPU experts; the device waits of its torch.where and tolist calls are not).
    # Not fitted: no figure here comes from a Fiddler run. Not modelled: it runs a layer's GPU
    # experts and then its CPU ones, where EP overlaps them, and in prefill it copies an
    # expert that sees ten tokens or more to the GPU instead (docs/experts.md).
    "fiddler": dict(
        name="fiddler", title="Fiddler (bf16 PyTorch experts on 16 CPU threads)", threads=16,
        kinds={"CPUFFN": dict(overhead_us=330, several_tokens=dict(
            serial=True, bytes_eff=0.75, flops_eff=0.32))},
        sources=["efeslab/fiddler src/fiddler/mixtral.py: torch.set_num_threads(16); CPU "
                 "experts as the model's bf16 modules; the 2^E placement search a layer",
                 "python bench/cpu_expert_rate.py (bench/results/cpu-2026-12-05/): a Mixtral "
                 "expert in bf16 PyTorch under ONEDNN_MAX_CPU_ISA=AVX512_CORE"]),
    # llama.cpp's CPU kernels (ggml's quantized dot products: each block unpacked, the
    # activations quantized to 8 bits, integer multiply-adds) do not hide their arithmetic
    # under their reads: a CPU decode takes the weights' bytes at the host's bandwidth plus
    # their products at its FLOP rate. llama-bench of Phi-4 (14.66 B weights) on an EPYC 9554
    # (12 x DDR5-4800, 460.8 GB/s; 64 Zen 4 cores, 6.35 TFLOPS fp32 at base clock) at Q4_K_M,
    # Q5_0, Q6_K and Q8_0 (8.43, 9.87, 11.20, 14.51 GiB) ran 28.74, 25.44, 23.25 and 19.19
    # tok/s: a straight line in the bytes (least squares), 2.63 ms a GB (82% of the datasheet
    # bandwidth) plus 11.2 ms, which is the 29 GFLOP of the token's products at 2.6 TFLOPS.
    # Priced at tg's host figures (75% of the bandwidth, half the FLOP rate), the sum gives
    # each within 5%; the larger of the two, 15-33% too fast. Not fitted: no figure here comes from the runs it
    # predicts (scenarios/small-batch/published.yaml).
    "llama.cpp": dict(
        name="llama.cpp", title="llama.cpp (ggml's CPU kernels: reads and arithmetic add)",
        kinds=_block_quantized_cpu_experts(),
        sources=["ahelpme.com/?p=6685: llama-bench, Phi-4 14B on an AMD EPYC 9554, "
                 "Q4_K_M 28.74, Q5_0 25.44, Q6_K 23.25, Q8_0 19.19 tok/s"]),
    # kTransformers (kvcache-ai/ktransformers V0.2, 0.2.1): its CPU MoE operator runs
    # llamafile's sgemm over the GGUF file's own block formats, each expert's rows against
    # the activations first quantized to the weights' dot-product type
    # (ktransformers/ktransformers_ext/operators/llamafile/moe.cpp: from_float, then
    # llamafile_sgemm; its llamafile is tinyBLAS with iqk_mul_mat for the K-quants): ggml's
    # family of block kernels, priced as the llama.cpp profile prices it. Not measured for
    # kTransformers itself (iqk_mul_mat may be faster than the ggml kernels llama-bench
    # timed); its later AMX kernels (V0.3) are other software.
    "ktransformers": dict(
        name="ktransformers",
        title="kTransformers (llamafile's CPU kernels over GGUF blocks: reads and arithmetic "
              "add)",
        kinds=_block_quantized_cpu_experts(),
        sources=["kvcache-ai/ktransformers ktransformers/ktransformers_ext/operators/llamafile/"
                 "moe.cpp: "
                 "from_float to the weights' vec_dot_type, llamafile_sgemm per expert"]),
}
