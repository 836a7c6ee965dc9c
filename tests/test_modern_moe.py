"""What today's MoEs add, as the simulator prices it: dense layers are dense, a shared expert is
a dense FFN every token runs (on the GPU beside the routed ones where those run apart),
MLA's cache holds its latent, a sliding window caps what attention reads, and every byte is
the format's. Each figure is worked out here from the model's shapes, not read back from tg."""

from __future__ import annotations

import numpy as np
import pytest

from taskgraph.dag.builder import build_segment, make_plan
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.kinds import KIND_NAMES
from taskgraph.perf.memory import memory_footprint
from taskgraph.perf.predict import predict
from taskgraph.sim.simulate import simulate_scenario
from tests.helpers import tiny

# A DeepSeek-shaped tiny model: layer 0 dense, two shared experts, MLA.
DEEPSEEKISH = dict(h=256, h_i=128, L=3, n_q=8, n_kv=8, E=16, k=4, V=512, dense_layers=[0],
                   h_dense=1024, shared_experts=2, h_shared=128, attention="mla",
                   kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
EXPERT_POLICY = {"N": 2, "mu": 1, "r_w": 1.0, "r_c": 1.0}


def _plan(schedule, model=DEEPSEEKISH, **policy):
    sc = tiny(model=model, schedule=schedule, policy={**EXPERT_POLICY, **policy},
              workload={"gen_len": 3})
    return make_plan(sc, schedule)


def _kinds_at(graph, layer):
    return {a["kind"] for _, a in graph.nodes(data=True)
            if a["layer"] == layer and not a["external"]}


@pytest.mark.parametrize("schedule", ["S5", "EP", "EC", "ECP"])
def test_a_dense_layer_has_no_experts_to_route_copy_or_run(schedule):
    extra = {"experts_gpu": 2} if schedule != "S5" else {}
    if schedule == "ECP":
        extra["prefetch"] = 0.5
    plan = _plan(schedule, **extra)
    g = build_segment(plan, 2)
    experts = {"D5", "CPUFFN", "D6", "Merge", "GPUFFN", "ExpertIn", "ExpertAhead", "SharedFFN"}
    assert not _kinds_at(g, 0) & experts
    assert "SharedFFN" in _kinds_at(g, 1)
    # the next layer reads what the dense layer's router task left: its FFN ran there
    assert "Route[s2,L0,m0]" in g.predecessors("PreAttn[s2,L1,m0]")
    # and where the routed experts run apart, the shared ones' output is merged in
    end = "GPUFFN[s2,L1,m0]" if plan.schedule.ffn == "cache" else "Merge[s2,L1,m0]"
    assert "SharedFFN[s2,L1,m0]" in g.predecessors(end)


def test_a_model_without_shared_experts_launches_no_shared_task():
    plan = _plan("EP", model={**DEEPSEEKISH, "shared_experts": 0}, experts_gpu=2)
    assert "SharedFFN" not in {a["kind"] for _, a in build_segment(plan, 2).nodes(data=True)}


def test_the_work_of_dense_moe_and_shared_parts():
    m = _plan("S4").scenario.model
    plan = _plan("S4")
    t = 1                                            # one token a micro-batch in decode
    dense = plan.work_of(0).of("PostAttn")
    moe = plan.work_of(1).of("PostAttn")
    # MLA's O side: the value half of the up-projection and the O projection
    o = 64 * 8 * 32 + 8 * 32 * 256
    assert dense.flops == 2 * t * (o + 3 * 256 * 1024)
    routed, shared = 4 * 3 * 256 * 128, 2 * 3 * 256 * 128
    assert moe.flops == 2 * t * (o + 256 * 16 + routed + shared)
    # EP: the router task runs the dense layer's FFN there, the shared experts run apart
    ep = _plan("EP", experts_gpu=2)
    assert ep.work_of(0).of("Route").flops == dense.flops
    assert ep.work_of(1).of("SharedFFN").flops == 2 * t * shared
    assert m.kv_width == 64 + 16


def test_mla_caches_its_latent_and_rope_key():
    plan = _plan("S4", r_c=0.0)
    kv = plan.work.of("KVOut").bytes            # one token of one sequence, fp16
    assert kv == 2 * (64 + 16)
    # the GQA cache of the same heads would be 2 x 8 heads x 48 dims a token
    gqa = _plan("S4", r_c=0.0, model={k: v for k, v in DEEPSEEKISH.items() if k not in (
        "attention", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")})
    assert gqa.work.of("KVOut").bytes == 2 * 2 * 8 * 32


def test_a_sliding_window_caps_what_attention_reads():
    model = dict(h=256, h_i=512, L=2, n_q=8, n_kv=2, E=8, k=2, V=512, sliding_window=4,
                 sliding_layers=[0])
    sc = tiny(model=model, schedule="S4", policy={"N": 2, "mu": 1, "r_w": 1.0, "r_c": 0.0},
              workload={"prompt_len": 8, "max_prompt_len": 8, "gen_len": 6})
    prog = simulate_scenario(sc).program
    _, nbytes, _ = prog.work()
    kind, layer, step = prog.column("kind"), prog.column("layer"), prog.step
    d4 = kind == KIND_NAMES.index("D4")
    # the KV cache copied for attention: a window of 4 tokens on layer 0, the whole context
    # (prompt 8 + step) on layer 1
    per_token = sc.model.kv_bytes_per_token
    assert set(nbytes[d4 & (layer == 0)]) == {4 * per_token}
    assert sorted(set(nbytes[d4 & (layer == 1)])) == [(8 + s) * per_token for s in range(1, 7)]
    assert (step[d4] >= 1).all()
    # and the memory holds a window's K,V for the sliding layer
    report = memory_footprint(make_plan(sc))
    assert report.cpu["KV cache (1 - r_c)"] == 2 * (4 + 14) * per_token


@pytest.mark.parametrize("prompts", [[64, 64], [100, 12]], ids=["alike", "ragged"])
def test_a_sliding_window_caps_the_prompts_attention(prompts):
    """Prefill's causal attention on a sliding-window layer pairs each prompt token with at most
    the window's keys. The pairs the simulator prices over those of a full layer match the
    mask's own entries counted one by one (key j of query i attends if 0 <= i - j < window, as
    transformers' sliding-window mask has it): exact for prompts alike; a ragged micro-batch is
    priced at its square-weighted mean length, 5.7% over the count for a 100- and a 12-token
    prompt (one longer and one shorter than the window: the worst case of that mean)."""
    window = 16
    model = dict(h=256, h_i=512, L=2, n_q=8, n_kv=2, E=8, k=2, V=512, sliding_window=window,
                 sliding_layers=[0])
    sc = tiny(model=model, schedule="S4", policy={"N": 2, "mu": 2, "r_w": 1.0, "r_c": 0.0},
              workload={"prompt_len": 100, "max_prompt_len": 100, "gen_len": 2})
    plan = make_plan(sc)
    sliding, full = (plan.works[plan.layer_classes[l]] for l in (0, 1))
    tokens, squares = sum(prompts), sum(p * p for p in prompts)

    def masked(w):        # the mask's entries over the prompts, less the diagonal's half
        return sum(sum(min(i + 1, w) for i in range(p)) - p / 2 for p in prompts)

    priced = sliding.causal_squares(tokens, squares) / 2
    assert full.causal_squares(tokens, squares) / 2 == pytest.approx(masked(10**9))
    assert priced == pytest.approx(masked(window), rel=0 if len(set(prompts)) == 1 else 0.06)
    assert priced < 0.6 * full.causal_squares(tokens, squares) / 2


def test_every_transfer_and_read_is_priced_at_the_formats_bytes():
    model = {**DEEPSEEKISH, "precision": {"experts": "q4_k", "attention": "q8_0"}}
    full, quant = _plan("EC", experts_gpu=2), _plan("EC", model=model, experts_gpu=2)
    ratio = quant.work.of("ExpertIn").bytes / full.work.of("ExpertIn").bytes
    assert ratio == pytest.approx(4.5 / 16)
    q = quant.scenario.model
    assert q.expert_bytes == 3 * 256 * 128 * 4.5 / 8
    assert q.qkv_bytes == q.qkv_params * 8.5 / 8
    # the CPU experts (S5) read and the memory model holds the stored bytes
    s5 = _plan("S5", model=model)
    cpu = memory_footprint(s5).cpu["experts (FFN on the CPU)"]
    assert cpu == 2 * 16 * q.expert_bytes                    # two MoE layers, 16 experts each
    assert s5.work_of(1).of("CPUFFN", prefill=False).bytes == pytest.approx(
        s5.work.distinct(1) * q.expert_bytes + 2 * 1 * (2 * 256 + 2 * 4 * 128))


@pytest.mark.parametrize("schedule", ["S1", "S4", "S5"])
def test_the_search_predicts_what_the_simulator_bounds(schedule):
    """The HRM prediction prices each kind of layer once and counts it as often as the model
    has it: it bounds the simulated decode layer as it does for a uniform model."""
    sc = tiny(model={**DEEPSEEKISH, "L": 4}, schedule=schedule,
              policy={"N": 8, "mu": 2, "r_w": 0.0, "r_c": 0.0}, workload={"gen_len": 3})
    pred = predict(sc, SCHEDULES[schedule])
    sim = simulate_scenario(sc).summary
    layers = sc.decode_steps * sc.model.L
    assert sim["hrm_layer_ms"] <= pred.hrm_layer_ms[0] * (1 + 1e-6)
    assert sim["hrm_layer_ms"] >= pred.hrm_layer_ms[0] * (1 - 1 / layers) * (1 - 1e-6)


def test_deepseek_v3_simulates_in_seconds_at_batch_1_and_a_large_batch():
    """61 layers of 256 experts: a batch-1 expert-level run and a large CGOPipe batch, every
    step simulated."""
    small = tiny(model="deepseek-v3", hardware="rtx4090-epyc", schedule="EP",
                 policy={"N": 1, "mu": 1, "r_w": 1.0, "r_c": 1.0, "experts_gpu": 1},
                 workload={"prompt_len": 256, "max_prompt_len": 256, "gen_len": 32})
    sim = simulate_scenario(small).summary
    assert sim["layers"] == 61 and sim["throughput_tok_s"] > 0
    big = tiny(model="deepseek-v3", hardware="rtxpro6000-epyc", schedule="S1",
               policy={"N": 256, "mu": 32, "r_w": 0.0, "r_c": 0.0},
               workload={"prompt_len": 256, "max_prompt_len": 256, "gen_len": 8})
    run = simulate_scenario(big).summary
    assert run["tasks"] > 20_000 and np.isfinite(run["throughput_tok_s"])


def test_a_dense_layer_has_no_cache_hit_rate():
    sc = tiny(model=DEEPSEEKISH, schedule="EC", policy={**EXPERT_POLICY, "experts_gpu": 2},
              workload={"gen_len": 3})
    s = simulate_scenario(sc).summary["experts"]
    assert s["hit_rate_by_layer"][0] is None
    assert all(0 <= h <= 1 for h in s["hit_rate_by_layer"][1:])


@pytest.mark.parametrize("context", [16, 200])
def test_mla_decode_is_priced_as_each_implementation_computes_it(context):
    """torch's FlopCounterMode counts what the executor's decode MLA (kernels.ops.mla_attention,
    as transformers computes it: every cached latent projected to each head's key and value)
    does for one token over a cache of `context`: the decode attention's work with
    model.mla_absorbed false says the same FLOPs. Absorbed, as llama.cpp and vLLM run it, the
    same step costs the latent-space products only, several times fewer at these shapes (the
    heads' query and output widths in the latent, no projection of the cache)."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from taskgraph.kernels.ops import mla_attention

    decompressed = _plan("S4", r_c=0.0, model={**DEEPSEEKISH, "mla_absorbed": False})
    m = decompressed.scenario.model
    n, nope, rope, v = m.n_q, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim

    class Weights:                      # the layer's two up-projections, as LayerView gives them
        def __init__(self):
            self.m = m
            self.w = {"uk": torch.randn(n * nope, m.kv_lora_rank),
                      "uv": torch.randn(n * v, m.kv_lora_rank)}

        def __getitem__(self, name):
            return self.w[name]

    q = torch.randn(1, 1, n, nope + rope)
    cache = torch.randn(1, context, 1, m.kv_lora_rank + rope)
    with FlopCounterMode(display=False) as counted:
        mla_attention(q, cache, Weights(), None)
    flops, _ = decompressed.work.of("GPUAttn").at(context)
    assert flops == counted.get_total_flops()
    absorbed, _ = _plan("S4", r_c=0.0).work.of("GPUAttn").at(context)
    assert absorbed < flops / 5
