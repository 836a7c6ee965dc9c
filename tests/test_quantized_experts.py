"""Routed experts below 16 bits in GGUF's blocks (Q8_0, Q4_0, MXFP4 and the K-quants Q4_K, Q5_K,
Q6_K), weight-only: the executor keeps them in blocks, copies them as blocks (an expert at a
time, or in a layer's pages) and dequantizes where they run, so a run computes what a reference
run on the dequantized weights computes, and the experts occupy the bytes the model counts for
them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from taskgraph import execute  # noqa: E402
from taskgraph.errors import TgError  # noqa: E402
from taskgraph.kernels.quant import (FORMATS, QuantizedExperts, dequantize,  # noqa: E402
                                     quantize_expert, quantize_rows, row_bytes)
from taskgraph.specs import ModelSpec  # noqa: E402

TINY = "scenarios/tiny.yaml"
#: Bits a weight each format stores, its block scales included, as the formats publish them
#: (llama.cpp's ggml-common.h block structs; the OCP MX spec for MXFP4).
PUBLISHED_BITS = {"q8_0": 8.5, "q4_0": 4.5, "mxfp4": 4.25, "q4_k": 4.5, "q5_k": 5.5,
                  "q6_k": 6.5625}


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_dequantize_as_llama_cpps_package_does(fmt):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as theirs

    g = torch.Generator().manual_seed(0)
    h, h_i = 256, 512                         # whole K-quant super-blocks of 256
    w1, w3, w2 = (torch.randn(shape, generator=g) for shape in ((h_i, h), (h_i, h), (h, h_i)))
    raw = quantize_expert(w1, w3, w2, fmt)
    kind = GGMLQuantizationType[fmt.upper()]
    m = ModelSpec(h=h, h_i=h_i, L=1, n_q=4, n_kv=2, E=1, k=1, V=32,
                  precision={"experts": fmt})
    assert raw.numel() == m.expert_bytes == 3 * h * h_i * PUBLISHED_BITS[fmt] / 8
    read = QuantizedExperts(m, fmt, raw[None], {0: 0}, torch.float32)
    cut = 2 * h_i * row_bytes(fmt, h)
    expected13 = theirs(raw[:cut].numpy().reshape(2 * h_i, -1), kind)
    assert np.array_equal(read["w13.0"].numpy(), expected13)
    assert np.array_equal(read["w2.0"].numpy(), theirs(raw[cut:].numpy().reshape(h, -1), kind))
    assert np.array_equal(read["w13.0"].numpy()[:h_i], theirs(
        quantize_rows(w1.numpy(), fmt), kind))
    assert dequantize(raw[cut:], fmt, h, h_i, torch.float32).shape == (h, h_i)


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_blocks_dequantize_as_llama_cpps_package_does(fmt):
    """Blocks of random bytes, not only those tg's quantizer writes (Q6_K's negative
    sub-block scales, MXFP4's subnormal exponents), the fp16 fields kept finite."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as theirs

    from taskgraph.kernels.quant import block_of

    weights, size = block_of(fmt)
    raw = np.random.default_rng(1).integers(0, 256, (64, size), dtype=np.uint8)
    halves = {"q8_0": (0,), "q4_0": (0,), "mxfp4": (), "q4_k": (0, 2), "q5_k": (0, 2),
              "q6_k": (size - 2,)}[fmt]
    for at in halves:             # an fp16 of exponent 0-29: finite, and no overflow
        raw[:, at + 1] &= 0x77
    if fmt == "mxfp4":            # exponents up to 2^31 (12 x 2^127 would overflow fp32)
        raw[:, 0] %= 160
        raw[:5, 0] = [0, 1, 2, 127, 159]
    expected = theirs(raw, GGMLQuantizationType[fmt.upper()]).reshape(-1, weights)
    mine = dequantize(torch.from_numpy(raw.reshape(-1)), fmt, 64, weights, torch.float32)
    assert np.array_equal(mine.numpy(), expected)


def test_more_bits_come_closer_to_the_weights():
    """A quantization, not a copy, and in the formats' known order of fidelity: Q8_0, then
    Q6_K, Q5_K, Q4_K (4.5 bits with a scale and a minimum per 32 weights) before Q4_0 (4.5
    bits, a scale only), then MXFP4's power-of-two scales."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as theirs

    x = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)

    def error(fmt: str) -> float:
        back = theirs(quantize_rows(x, fmt), GGMLQuantizationType[fmt.upper()])
        return float(np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean()))

    order = ["q8_0", "q6_k", "q5_k", "q4_k", "q4_0", "mxfp4"]
    errors = [error(f) for f in order]
    assert errors == sorted(errors), dict(zip(order, errors))
    assert 0 < errors[0] < 0.01 and errors[-1] < 0.2, dict(zip(order, errors))


_EXPERT_LEVEL = [("S5", {"policy.N": 4, "policy.mu": 2}), ("EP", {"policy.experts_gpu": 3}),
                 ("EC", {"policy.experts_gpu": 2}),
                 ("ECP", {"policy.experts_gpu": 2, "policy.prefetch": 0.5})]


# every format in the schedule that places experts (EP), both 8- and 4-bit ones in all four
@pytest.mark.parametrize("fmt, schedule, policy", [
    *((fmt, *_EXPERT_LEVEL[1]) for fmt in FORMATS if fmt not in ("q8_0", "q4_0")),
    *((fmt, *case) for fmt in ("q8_0", "q4_0") for case in _EXPERT_LEVEL)])
def test_quantized_experts_compute_the_dequantized_models_tokens(fmt, schedule, policy):
    """The run's tokens and logits against the reference forward on the dequantized weights
    (execute's own check), and the bytes the experts take: the model's count, on the host and
    in the device's slots."""
    ex = execute(TINY, schedule=schedule, overrides={
        "model.precision.experts": fmt, "workload.gen_len": 3, **policy})
    s = ex.summary
    assert s["tokens_match"] is True and s["max_abs_err"] <= 1e-5, s
    m = ex.plan.scenario.model
    assert m.expert_bytes == 3 * m.h * m.h_i * PUBLISHED_BITS[fmt] / 8
    blocks = [ex.weights.blocks(l) for l in range(m.L)]
    assert all(b.shape == (m.E, m.expert_bytes) and b.dtype == torch.uint8 for b in blocks)
    # a layer's vector holds its experts' blocks and nothing else of them: the model's bytes
    assert all(flat.numel() * 4 == m.layer_bytes for flat in ex.weights.layers)


# The schedules that stream whole layers in pages, each with a cut (r_w) inside the experts'
# blocks in some case, so that an expert's blocks straddle the resident part and the pages.
_LAYER_STREAMING = [("S1", {"policy.r_w": 0.5}), ("S2", {}), ("S3", {"policy.r_w": 0.3}),
                    ("S4", {}), ("DS", {})]


@pytest.mark.parametrize("fmt, schedule, policy", [
    *(("q4_0", *case) for case in _LAYER_STREAMING),
    *((fmt, *_LAYER_STREAMING[0]) for fmt in FORMATS if fmt != "q4_0")])
def test_experts_in_blocks_stream_with_their_layer(fmt, schedule, policy):
    """The schedules that stream a layer's weights move its experts' blocks in its pages and
    dequantize them on the GPU: the tokens and logits of the dequantized model."""
    ex = execute(TINY, schedule=schedule, overrides={
        "model.precision.experts": fmt, "workload.gen_len": 3, **policy})
    s = ex.summary
    assert s["tokens_match"] is True and s["max_abs_err"] <= 1e-5, s
    m = ex.plan.scenario.model
    layout = ex.plan.layouts[False]
    assert layout.n_pages and layout.streamed_bytes >= m.E * m.expert_bytes * 0.5


def test_the_pages_carry_the_blocks_the_gpu_computes(monkeypatch):
    """The guard: S1's last page of every layer (experts' blocks only) copied from the next
    layer's vector computes other logits."""
    from taskgraph.exec.runtime import Runtime

    real = Runtime._D3

    def other_layers(self, s, l, index):
        pages = self.pages[self.dense[l]]
        if index % len(pages) != len(pages) - 1:
            return real(self, s, l, index)
        a, b = pages[-1]
        dst = self.halves[self.plan.weight_buffer(s, l, index // len(pages))]
        dst[a - self.cut[False]:b - self.cut[False]].copy_(self.w.layers[(l + 1) % self.L][a:b])

    monkeypatch.setattr(Runtime, "_D3", other_layers)
    s = execute(TINY, schedule="S1", overrides={"model.precision.experts": "q8_0",
                                                 "workload.gen_len": 3}).summary
    assert not (s["tokens_match"] and s["max_abs_err"] <= 1e-5), s


@pytest.mark.parametrize("fmt", ["q8_0", "mxfp4"])        # MXFP4: as OpenAI publishes them
@pytest.mark.parametrize("schedule, policy", [("S5", {"policy.N": 2, "policy.mu": 1}),
                                              ("EP", {"policy.experts_gpu": 3})])
def test_gpt_oss_experts_keep_their_biases_in_blocks(fmt, schedule, policy):
    """gpt-oss's experts add biases after their blocks are dequantized, on the CPU as on the
    GPU (lost on the CPU's side, the check fails by 5 units of logit)."""
    s = execute(TINY, schedule=schedule, overrides={
        "model.architecture": "gpt_oss", "model.attention_sinks": True,
        "model.precision.experts": fmt, "workload.gen_len": 2, **policy}).summary
    assert s["tokens_match"] is True and s["max_abs_err"] <= 1e-5, s


def test_the_blocks_copied_are_what_the_gpu_computes(monkeypatch):
    """The guard: EP's blocks copied from the next expert's (the CPU's own, and the
    reference's, untouched) compute other tokens."""
    from taskgraph.exec.expert_cache import ExpertBlocks

    real = ExpertBlocks.host
    monkeypatch.setattr(ExpertBlocks, "host",
                        lambda self, l, e: real(self, l, (e + 1) % self.m.E))
    s = execute(TINY, schedule="EP", overrides={"model.precision.experts": "q8_0",
                                                 "policy.experts_gpu": 3,
                                                 "workload.gen_len": 3}).summary
    assert s["tokens_match"] is False


@pytest.mark.parametrize("fmt, schedule, hardware", [
    ("q4_k", "S1", "2xt4"), ("q6_k", "S3", "2xt4"), ("q4_0", "S4", "4xt4"),
    ("mxfp4", "S1", "4xt4"), ("Q8_0", "S3", "4xt4")])         # a format's name in any case
def test_tensor_parallel_shards_split_the_blocks(fmt, schedule, hardware):
    """Each GPU's shard holds its rows of every expert's w1 and w3 and its block of columns of
    each w2 row, in whole blocks: the dequantized model's tokens and logits, and a shard's
    layer holds the bytes the model counts for a shard (its heads, a KV head's copy where GPUs
    outnumber them, 1/n of every expert, the router whole)."""
    ex = execute(TINY, schedule=schedule, overrides={
        "model.precision.experts": fmt, "hardware": hardware, "workload.gen_len": 3,
        "policy.r_w": 0.4})
    s = ex.summary
    assert s["tokens_match"] is True and s["max_abs_err"] <= 1e-5, s
    m, n = ex.plan.scenario.model, ex.plan.tp
    from taskgraph.exec.tensor import make_shard, shard_model

    for g in range(n):
        _, shard = make_shard(ex.plan, ex.weights, g)
        assert shard.blocks(0).shape == (m.E, m.expert_bytes / n)
        assert shard.layers[0].numel() * 4 == shard_model(m, n).layer_bytes


def test_gloo_processes_run_shards_of_blocks():
    """One process a GPU over torch.distributed: the same shards, the reference's tokens."""
    from taskgraph.dag.builder import make_plan
    from taskgraph.exec.distributed import execute_processes
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights
    from taskgraph.scenario import load_scenario

    sc = load_scenario(TINY, ["model.precision.experts=q4_0", "hardware=2xt4",
                              "workload.gen_len=3"])
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(8, 6, sc.model.V, seed=2)
    run = execute_processes(make_plan(sc), w, prompts, delay_s=0.001, seed=2)
    ref = reference_forward(w.dequantized(), prompts, 2, 3)
    assert torch.equal(run.tokens, ref.tokens)
    torch.testing.assert_close(run.logits, ref.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule, overrides, message", [
    ("EP", {"model.precision.experts": "iq4_xs"}, "model.precision.experts = iq4_xs"),
    # four GPUs split each w2 row's 512 columns into 128, half a K-quant's super-block
    ("S1", {"model.precision.experts": "q4_k", "hardware": "4xt4"},
     "model.h_i = 512 over hardware.gpu.count = 4 GPUs is 128 columns each, no whole number"),
])
def test_what_the_executor_does_not_quantize_is_refused(schedule, overrides, message):
    with pytest.raises(TgError, match=message):
        execute(TINY, schedule=schedule, overrides={**overrides, "workload.gen_len": 2})


def test_a_class_stored_at_the_models_own_width_runs_and_others_are_named():
    """tiny is fp32: attention stated as fp32 is what runs (float weights run in the model's
    dtype: a GGUF file's F16 attention and F32 router likewise), attention at Q8_0 is refused
    naming the field and the dtype, and a mix of types (bits per weight, as a Q4_K_M file's
    experts) says it is one."""
    s = execute(TINY, schedule="EP", overrides={"model.precision.attention": "fp32",
                                                "workload.gen_len": 2})
    assert s.summary["tokens_match"] is True
    with pytest.raises(TgError, match=r"model.precision.attention = q8_0: tg execute runs "
                                      r"weights in the model's dtype \(32 bits\)"):
        execute(TINY, schedule="EP", overrides={"model.precision.attention": "q8_0",
                                                "workload.gen_len": 2})
    with pytest.raises(TgError, match=r"model.precision.experts = 4.85 bits per weight \(a "
                                      "mix of types"):
        execute(TINY, schedule="EP", overrides={"model.precision.experts": 4.85,
                                                "workload.gen_len": 2})


def test_a_row_that_is_no_whole_number_of_blocks_is_refused():
    """Q4_K's super-blocks hold 256 weights of a row: an expert 288 wide runs at Q4_0 (blocks
    of 32) and is refused at Q4_K, naming the field."""
    overrides = {"model.h_i": 288, "workload.gen_len": 2, "policy.experts_gpu": 3}
    s = execute(TINY, schedule="EP", overrides={**overrides, "model.precision.experts": "q4_0"})
    assert s.summary["tokens_match"] is True
    with pytest.raises(TgError, match="model.precision.experts = q4_k: its blocks hold 256"):
        execute(TINY, schedule="EP", overrides={**overrides, "model.precision.experts": "q4_k"})
