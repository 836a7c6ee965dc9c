"""FLOP and byte counts, the roofline cost model and the memory model, checked against hand
calculation for Mixtral 8x7B (h=4096, h_kv=8*128=1024, h_i=14336, E=8, k=2, fp16)."""

from __future__ import annotations

import numpy as np
import pytest

from taskgraph.dag.builder import make_plan
from taskgraph.dag.schedules import RESOURCES
from taskgraph.dag.work import WeightLayout
from taskgraph.errors import MemoryFitError
from taskgraph.perf.cost import CostModel, cost_model, hrm_bound
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.scenario import load_scenario
from taskgraph.specs import ImplementationSpec, KindEffect

MU, S = 36, 100


@pytest.fixture(scope="module")
def t4():
    return load_scenario("scenarios/t4.yaml")


@pytest.fixture(scope="module")
def work(t4):
    return make_plan(t4).work


def test_layer_and_model_weights(t4):
    m = t4.model
    # qkv 2*4096*(4096+2*1024) + o 2*4096^2 + router 2*4096*8 + experts 8*2*3*4096*14336
    assert m.layer_bytes == 50_331_648 + 33_554_432 + 65_536 + 2_818_572_288 == 2_902_523_904
    assert m.layer_bytes / 2 == pytest.approx(1.45e9, rel=0.01)       # design: ~1.45 B a layer
    # 32 layers + embedding and LM head 2*2*32000*4096
    assert m.model_bytes == 32 * 2_902_523_904 + 524_288_000 == 93_405_052_928
    assert m.kv_bytes_per_token == 2 * 2 * 1024


def test_decode_task_work(work):
    pre = work.of("PreAttn")
    assert pre.flops == 2 * 36 * 4096 * 6144 == 1_811_939_328
    assert work.of("D1").bytes == 2 * 36 * 6144 == 442_368
    f, b = work.of("CPUAttn").at(S)
    assert f == 4 * 36 * 100 * 4096 == 58_982_400
    # reads K and V: 2 * 2 B * 36 seq * 100 tokens * 1024; plus q in and output out
    assert b == 14_745_600 + 2 * 36 * (2 * 4096 + 2 * 1024)
    assert work.of("D2").bytes == 2 * 36 * 4096 == 294_912
    post = work.of("PostAttn")
    # O proj 2*36*4096^2 + router 2*36*4096*8 + experts 6*36*2*4096*14336
    assert post.flops == 1_207_959_552 + 2_359_296 + 25_367_150_592 == 26_577_469_440
    hit = 8 * (1 - 0.75 ** 36)                     # distinct experts hit by 36 tokens
    # weights read (O, router, the experts hit) + activations 2*36*(4*4096 + 2*2*14336)
    assert post.bytes == pytest.approx(33_554_432 + 65_536 + hit * 352_321_536 + 5_308_416,
                                       rel=1e-9)
    assert work.of("KVOut", prefill=True).bytes == 36 * 77 * 4096   # prompt K,V, 77 tokens


def test_pages_cover_the_streamed_bytes(t4):
    layout = WeightLayout(t4.model, r_w=0.0, n_pages=14)
    assert layout.page_bytes * 14 == pytest.approx(2_902_523_904)
    assert list(layout.pages_for("qkv")) == [0]             # 50 MB of qkv fit in the first page
    assert list(layout.pages_for("post")) == list(range(14))
    resident = WeightLayout(t4.model, r_w=0.5, n_pages=14)
    assert list(resident.pages_for("qkv")) == []           # attention weights stay on the GPU
    assert resident.streamed_bytes == pytest.approx(2_902_523_904 / 2)


def test_roofline_and_link_times(t4):
    cost = CostModel(t4.hardware)
    gpu_flops = 65e12 * 0.0839          # the T4's fitted GEMM efficiency (presets.FITTED)
    gpu_bw = 320e9 * 0.85
    # PostAttn of 36 tokens is memory-bound on a T4: 2.8 GB of experts at 272 GB/s
    assert cost.time("gpu", 26.6e9, 2.8e9) == pytest.approx(2.8e9 / gpu_bw + 10e-6)
    # a large prefill is compute-bound
    assert cost.time("gpu", 1e15, 3e9) == pytest.approx(1e15 / gpu_flops + 10e-6)
    # one 207 MB page over PCIe 3.0 at 80% efficiency, plus 10 µs latency
    assert cost.time("h2d", 0, 207e6) == pytest.approx(207e6 / 12.6e9 + 10e-6)
    bound, binding = hrm_bound({"gpu": 1.0, "cpu": 0.5, "h2d": 2.0, "d2h": 0.1, "pin": 0.0}, 4)
    assert (bound, binding) == (0.5, "h2d")


def test_implementation_effects_by_hand(t4):
    """An implementation profile scales the machine's rates per task kind, adds fixed costs,
    streams skinny products' weights at I / (I + I_half) of the bandwidth, and sends pageable
    weights at the link's pageable rate."""
    impl = ImplementationSpec(name="x", pageable_weights=True, kinds={
        "PostAttn": KindEffect(intensity_half=8.0, overhead_us=100.0),
        "Prefill": KindEffect(flops_eff=0.5), "CPUAttn": KindEffect(bytes_eff=0.25)})
    ideal, cost = CostModel(t4.hardware), CostModel(t4.hardware, impl)
    # PostAttn of 36 tokens reads 2.8 GB for 26.6 GFLOP: I = 9.5, so 9.5/17.5 of 272 GB/s
    I = 26.6e9 / 2.8e9
    assert cost.time("gpu", 26.6e9, 2.8e9, "PostAttn") == pytest.approx(
        2.8e9 / (320e9 * 0.85 * I / (I + 8)) + 10e-6 + 100e-6)
    assert cost.time("gpu", 1e15, 3e9, "Prefill") == pytest.approx(
        1e15 / (65e12 * 0.0839 * 0.5) + 10e-6)
    assert cost.time("cpu", 0, 1e9, "CPUAttn") == pytest.approx(
        4 * ideal.time("cpu", 0, 1e9, "CPUAttn") - 3 * 20e-6)
    # pageable weights: the T4 host's measured 5.83 GB/s, not the pinned 12.6
    assert cost.time("h2d", 0, 207e6, "D3") == pytest.approx(207e6 / 5.83e9 + 10e-6)
    assert ideal.time("h2d", 0, 207e6, "D3") == pytest.approx(207e6 / 12.6e9 + 10e-6)
    # kinds the profile does not name run at the machine's rates
    assert cost.time("gpu", 1e12, 1e9, "PreAttn") == ideal.time("gpu", 1e12, 1e9, "PreAttn")
    # the KV cache crosses from pinned memory unless the profile says its cache is pageable
    assert cost.time("h2d", 0, 207e6, "D4") == pytest.approx(207e6 / 12.6e9 + 10e-6)


def test_flexgens_kv_cache_crosses_as_its_weights_do(t4):
    """FlexGen allocates its CPU KV cache unpinned (init_cache_one_gpu_batch: "disable
    pin_memory due to high memory overhead") and copies it to the GPU through the path its
    unpinned weights take, a pinned copy made for each, which its profiler timed at 5.43 GiB/s
    on the paper's T4 host (shared/reference/flexgen-cost-model.yaml, ctog_bdw): so GPU
    attention's KV copies (D4) cross at the host's pageable rate, 5.83 GB/s, not the pinned
    12.6, and draw host memory three times over (read, staged, read by the DMA), as pageable
    weights do. tg's executor keeps its KV buffers pinned."""
    from taskgraph import presets
    from taskgraph.kinds import KIND_INDEX
    from taskgraph.perf.cost import POOLS

    flexgen = CostModel(t4.hardware, ImplementationSpec(**presets.IMPLEMENTATIONS["flexgen"]))
    executor = CostModel(t4.hardware, ImplementationSpec(**presets.IMPLEMENTATIONS["tg"]))
    assert flexgen.time("h2d", 0, 207e6, "D4") == pytest.approx(207e6 / 5.83e9 + 10e-6)
    assert executor.time("h2d", 0, 207e6, "D4") == pytest.approx(207e6 / 12.6e9 + 10e-6)
    h2d, memory = RESOURCES.index("h2d"), POOLS.index("host_memory")
    assert flexgen.pool_factor[memory, h2d, KIND_INDEX["D4"]] == 3.0
    assert executor.pool_factor[memory, h2d, KIND_INDEX["D4"]] == 1.0
    # a pageable copy is no faster than the link: on a 4 GB/s one (3.2 GB/s at its 0.8) the
    # weights and the cache crossed at the host's 5.83
    slow = t4.hardware.model_copy(update={"link": t4.hardware.link.model_copy(
        update={"h2d_gbps": 4.0})})
    slow_flexgen = CostModel(slow, ImplementationSpec(**presets.IMPLEMENTATIONS["flexgen"]))
    for kind in ("D3", "D4"):
        assert slow_flexgen.time("h2d", 0, 207e6, kind) == pytest.approx(207e6 / 3.2e9 + 10e-6)


#: llama-bench of Phi-4 (14.66 B weights) on one AMD EPYC 9554, CPU only (ahelpme.com/?p=6685):
#: the file's GiB and the decode's tok/s at each format.
PHI4_EPYC_9554 = {"Q4_K_M": (8.43, 28.74), "Q5_0": (9.87, 25.444), "Q6_K": (11.20, 23.246),
                  "Q8_0": (14.51, 19.194)}


def test_llama_cpps_cpu_decode_takes_its_reads_plus_its_arithmetic(t4):
    """The llama.cpp profile against llama-bench on a host described by its datasheet (12 x
    DDR5-4800, 64 Zen 4 cores at 3.1 GHz, 32 fp32 FLOPs a cycle): every format within 5%,
    where the roofline's larger term alone is 15-33% fast; and the predictor's pricing
    (times_of) is the simulator's (times)."""
    from taskgraph.kinds import KIND_INDEX
    from taskgraph.presets import IMPLEMENTATIONS
    from taskgraph.specs import HardwareSpec

    hw = HardwareSpec.model_validate(t4.hardware.model_dump() | {"cpu": {
        **t4.hardware.cpu.model_dump(), "name": "EPYC 9554", "cores": 64, "mem_gbps": 460.8,
        "tflops": 64 * 3.1 * 32 / 1e3, "core_gbps": None}})
    llama = CostModel(hw, ImplementationSpec.model_validate(IMPLEMENTATIONS["llama.cpp"]))
    roofline = CostModel(hw)
    flops = 2 * 14.66e9                                 # a multiply-add a weight
    for fmt, (gib, measured) in PHI4_EPYC_9554.items():
        nbytes = gib * 2 ** 30
        assert 1 / llama.time("cpu", flops, nbytes, "CPUFFN") == pytest.approx(
            measured, rel=0.05), fmt
        assert 1 / roofline.time("cpu", flops, nbytes, "CPUFFN") > 1.15 * measured, fmt
        cpu, kind = RESOURCES.index("cpu"), KIND_INDEX["CPUFFN"]
        assert llama.times_of(cpu, kind, flops, nbytes) == pytest.approx(
            float(llama.times(cpu, flops, nbytes, kind)))


def test_one_processs_threads_bound_its_arithmetic_and_its_threads_reads(t4):
    """On one GPU an implementation's `threads` (Fiddler's torch.set_num_threads(16)) takes its
    share of the host's FLOP rate, and reads at most `core_gbps` a thread: the T4 host's 24
    cores at 0.8 TFLOPS and 105 GB/s achieved, 11.66 GB/s a core."""
    hw = t4.hardware
    host = CostModel(hw)
    four = CostModel(hw, ImplementationSpec(name="x", threads=4))
    sixteen = CostModel(hw, ImplementationSpec(name="x", threads=16))
    many = CostModel(hw, ImplementationSpec(name="x", threads=1000))
    assert host.time("cpu", 1e12, 0, "CPUFFN") == pytest.approx(1e12 / 0.8e12 + 20e-6)
    assert four.time("cpu", 1e12, 0, "CPUFFN") == pytest.approx(1e12 / 0.8e12 * 6 + 20e-6)
    assert sixteen.time("cpu", 1e12, 0, "CPUFFN") == pytest.approx(1e12 / 0.8e12 * 1.5 + 20e-6)
    # four threads read at 4 x 11.66 GB/s; sixteen reach the host's 105 GB/s as every core does
    assert four.time("cpu", 0, 1e9, "CPUFFN") == pytest.approx(1e9 / 46.64e9 + 20e-6)
    assert sixteen.time("cpu", 0, 1e9, "CPUFFN") == host.time("cpu", 0, 1e9, "CPUFFN")
    assert many.time("cpu", 1e12, 1e9, "CPUFFN") == host.time("cpu", 1e12, 1e9, "CPUFFN")


def _expert(tokens: float, bits: float = 16.0, experts: int = 1) -> tuple[float, float]:
    """FLOPs and bytes of `experts` Mixtral experts seeing `tokens` tokens each on average,
    their weights at `bits`."""
    params = 3 * 4096 * 14336
    return 2 * tokens * params * experts, params * bits / 8 * experts


def _one_token_share(mean: float) -> float:
    """The zero-truncated Poisson's share of ones at this mean, solved on its own here."""
    from scipy.optimize import brentq

    lam = brentq(lambda x: x / -np.expm1(-x) - mean, 1e-9, 100.0)
    return mean * np.exp(-lam)


def test_several_tokens_an_expert_run_the_kinds_other_kernel(t4):
    """KindEffect.several_tokens prices the experts of a task that see more than one token
    each: one token each keeps the kind's own effects, whatever the bits its weights are
    stored in; many tokens each take the other kernel's; between, the experts that see one
    token (a zero-truncated Poisson count) take the first and the rest the second, so the
    price has no step at any batch."""
    from taskgraph.kinds import KIND_INDEX

    impl = ImplementationSpec(name="x", kinds={"CPUFFN": KindEffect(
        overhead_us=100, several_tokens=KindEffect(serial=True, bytes_eff=0.5, flops_eff=0.25))})
    bw, rate, fixed = 140e9 * 0.75, 1.6e12 * 0.5, 120e-6
    for bits in (16.0, 4.25):
        cost, host = CostModel(t4.hardware, impl, expert_bits=bits), CostModel(
            t4.hardware, expert_bits=bits)
        flops, nbytes = _expert(1, bits, experts=3)
        assert cost.time("cpu", flops, nbytes, "CPUFFN") == pytest.approx(
            host.time("cpu", flops, nbytes, "CPUFFN") + 100e-6), bits
        flops, nbytes = _expert(64, bits, experts=3)
        assert cost.time("cpu", flops, nbytes, "CPUFFN") == pytest.approx(
            nbytes / (0.5 * bw) + flops / (0.25 * rate) + fixed), bits
        flops, nbytes = _expert(2, bits, experts=3)
        one = _one_token_share(2.0)
        by_hand = (max(flops * one / 2 / rate, nbytes * one / bw)
                   + nbytes * (1 - one) / (0.5 * bw) + flops * (1 - one / 2) / (0.25 * rate))
        assert cost.time("cpu", flops, nbytes, "CPUFFN") == pytest.approx(by_hand + fixed,
                                                                      rel=1e-4)
        cpu, kind = RESOURCES.index("cpu"), KIND_INDEX["CPUFFN"]
        means = np.arange(1.0, 4.0, 0.001)       # rising with the tokens, and no step
        flops, nbytes = _expert(means, bits, experts=3)
        times = cost.times(cpu, flops, nbytes, kind)
        assert np.all(np.diff(times) > 0) and np.max(times[1:] / times[:-1]) < 1.01, bits
        # the predictor's pricing (times_of) is the simulator's (times)
        assert cost.times_of(cpu, kind, flops, nbytes) == pytest.approx(times)


def test_several_tokens_sets_rates_over_the_kinds_own(t4):
    """What several_tokens does not set is the kind's: a serial kind stays serial."""
    serial = KindEffect(serial=True, several_tokens=KindEffect(flops_eff=0.5))
    cost = CostModel(t4.hardware, ImplementationSpec(name="x", kinds={"CPUFFN": serial}))
    flops, nbytes = _expert(64)
    assert cost.time("cpu", flops, nbytes, "CPUFFN") == pytest.approx(
        nbytes / 105e9 + flops / 0.4e12 + 20e-6)


@pytest.mark.parametrize("kind,effect,field", [
    ("CPUFFN", {"overhead_us": 5}, "overhead_us"),
    ("CPUFFN", {"several_tokens": {"serial": True}}, "several_tokens"),
    ("Route", {"serial": True}, "Route.several_tokens"),
    ("CPUAttn", {"bytes_eff": 0.5}, "CPUAttn.several_tokens")])
def test_several_tokens_gives_an_expert_kernels_rates_only(kind, effect, field):
    """A fixed cost, skinniness or unpacking under several_tokens would be ignored, and a kind
    whose work is not counted in experts has no tokens an expert to switch on: refused,
    naming the field."""
    with pytest.raises(ValueError, match=field):
        ImplementationSpec.model_validate({"name": "x", "kinds": {
            kind: {"several_tokens": effect}}})


def test_fiddlers_profile_is_the_measured_bf16_expert(t4):
    """The `fiddler` profile against what bench/cpu_expert_rate.py measured (bf16 PyTorch with
    oneDNN held to Skylake's AVX512_CORE, fp32 on the same threads as the reference):
    - one thread's times at 2-16 tokens are reads plus arithmetic (the serial form) within 5%;
    - one token a thread streams fast enough that Fiddler's 16 threads ask more than the
      paper's Xeon host gives, so its own effects are none;
    - the packing kernel's reads at 16 threads, from the measured share of a thread's rate,
      and its arithmetic's share, are the profile's within the measured spread;
    - Fiddler's per-layer host decision is the fixed cost measured beside them."""
    import json
    from pathlib import Path

    from taskgraph.presets import IMPLEMENTATIONS

    data = json.loads(Path("bench/results/cpu-2026-12-05/cpu_expert_rate.json").read_text())
    runs = [r for r in data["runs"] if r["isa"].startswith("avx512_core")]
    fiddler = ImplementationSpec.model_validate(IMPLEMENTATIONS["fiddler"])
    cpu = t4.hardware.cpu
    host_bw, core = cpu.mem_gbps * cpu.mem_eff, cpu.core_gbps
    effect = fiddler.kinds["CPUFFN"]
    assert next(r for r in runs if r["threads"] == 1)["worst_fit_error"] < 0.05
    assert (effect.bytes_eff, effect.flops_eff, effect.serial) == (1.0, 1.0, False)
    assert fiddler.threads * core * min(r["one_token_share"] for r in runs) > host_bw
    packed = fiddler.threads * core * np.array([r["bytes_share"] for r in runs]) / host_bw
    assert packed.min() - 0.02 <= effect.several_tokens.bytes_eff <= packed.max() + 0.02
    shares = [r["flops_share"] for r in runs]
    assert min(shares) - 0.02 <= effect.several_tokens.flops_eff <= max(shares) + 0.02
    assert effect.several_tokens.serial
    assert effect.overhead_us * 1e-6 == pytest.approx(data["decision_s"], rel=0.1)


@pytest.mark.parametrize("scenario", ["deepseek-v3-xeon6454s-1s", "deepseek-v3-xeon6454s-2s",
                                      "deepseek-v3-tr7965wx"])
def test_ktransformers_cpu_experts_are_priced_as_llama_cpps_kernels(scenario):
    """kTransformers' CPU MoE operator runs llamafile's sgemm over the GGUF blocks with the
    activations quantized first (its moe.cpp): ggml's kernel family, so each published
    kTransformers run prices its CPU experts as the llama.cpp profile would on its machine,
    reads plus arithmetic, and not as the machine's larger term alone."""
    from taskgraph.presets import IMPLEMENTATIONS

    sc = load_scenario(f"scenarios/small-batch/{scenario}.yaml")
    assert sc.implementation.name == "ktransformers"
    llama = sc.model_copy(update={"implementation": ImplementationSpec.model_validate(
        IMPLEMENTATIONS["llama.cpp"])})
    bits = sc.model.bits("experts")
    flops, nbytes = 2 * sc.model.h * sc.model.h_i * 3, sc.model.expert_bytes
    prices = [cost_model(s, "EP").time("cpu", flops, nbytes, "CPUFFN") for s in (sc, llama)]
    roofline = CostModel(sc.hardware, expert_bits=bits).time("cpu", flops, nbytes, "CPUFFN")
    assert prices[0] == prices[1] > roofline * 1.05


@pytest.mark.parametrize("schedule,pinned", [("S1", True), ("S3", False), ("S4", False),
                                              ("EP", True), ("EC", True), ("ECP", True)])
def test_tg_executor_copies_weights_from_pageable_memory_unless_pinned(t4, schedule, pinned):
    """tg's executor copies a layer's weights from pageable memory (the driver stages them)
    except through pinned staging pages (S1, S2) or out of the pinned host copy the expert
    schedules keep, as Mixtral-offloading and MoE-Infinity keep theirs: measured on an H200,
    pageable experts crossed at 10 GB/s and held the other streams' launches up
    (bench/results/h200-2026-11-25). The rates are the t4 preset's pinned 12.6 GB/s and its
    host's measured pageable 5.83 GB/s."""
    sc = t4.model_copy(update={"implementation": ImplementationSpec(name="tg",
                                                                    pageable_weights=True)})
    rate = 207e6 / (cost_model(sc, schedule).time("h2d", 0, 207e6, "D3") - 10e-6)
    assert rate == pytest.approx(12.6e9 if pinned else 5.83e9)


def test_memory_model_t4(t4):
    report = memory_footprint(make_plan(t4))
    gb = 1e9
    assert report.gpu["weight double buffer"] == pytest.approx(2 * 2_902_523_904)
    assert report.cpu["weights (1 - r_w)"] == pytest.approx(32 * 2_902_523_904)
    # KV of 504 sequences * 32 layers * (77 + 128) tokens * 4096 B
    assert report.cpu["KV cache (1 - r_c)"] == pytest.approx(504 * 32 * 205 * 4096)
    assert report.gpu_capacity == pytest.approx(16 * gb * 0.86)
    check_fits(report, "S1")  # the paper's policy fits


def test_memory_rejects_with_binding_constraint(t4):
    too_resident = t4.model_copy(update={"policy": t4.policy.model_copy(update={"r_w": 0.5})})
    with pytest.raises(MemoryFitError, match=r"GPU memory.*over.*resident weights"):
        check_fits(memory_footprint(make_plan(too_resident)), "S1")
    huge_batch = t4.model_copy(update={"policy": t4.policy.model_copy(update={"N": 36 * 200})})
    with pytest.raises(MemoryFitError, match=r"CPU memory.*KV cache"):
        check_fits(memory_footprint(make_plan(huge_batch)), "S1")

