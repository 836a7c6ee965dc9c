"""Tensor parallelism on per-GPU streams: each GPU task and copy runs as one shard per GPU on
that GPU's compute stream and PCIe link; partial sums meet in collectives on the interconnect.

The one-GPU graph of the same scenario is the reference for what the shards must add up to, and
nccl-tests' definition of bus bandwidth for what an all-reduce costs."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from taskgraph.dag.builder import build_segment, make_plan
from taskgraph.kinds import COLLECTIVES, SHARDED
from taskgraph.perf.predict import predict
from taskgraph.scenario import load_scenario
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.sim.simulate import simulate_scenario
from tests.helpers import tiny


def _graph(sc, d=1) -> nx.DiGraph:
    return build_segment(make_plan(sc), d)


def _own(g: nx.DiGraph) -> dict:
    return {n: a for n, a in g.nodes(data=True) if not a["external"]}


def _base(name: str) -> str:
    """A shard's name without its GPU: the task it is a shard of."""
    return name.split(",g")[0] + "]" if ",g" in name else name


def _whole(name: str, attrs: dict) -> str:
    """The one-GPU task a shard is part of: PostAttn (Prefill in step 0) runs as parts between
    its two all-reduces."""
    base = _base(name)
    if attrs["kind"] in ("OProj", "MoE", "PrefillAttn"):
        whole = "Prefill" if attrs["step"] == 0 else "PostAttn"
        base = whole + base[len(attrs["kind"]):]
    return base


@pytest.mark.parametrize("schedule", ["S1", "S2", "S3", "S4"])
@pytest.mark.parametrize("gpus", [2, 4])
def test_shards_split_every_gpu_task_and_the_hosts_work_for_it_evenly(schedule, gpus):
    """Every GPU's process runs its part of the host's work too (its heads' CPU attention,
    its part of each page's pinned copy): one part per GPU, on that GPU's host streams."""
    for d in (0, 1, 2):
        one = _own(_graph(tiny(schedule=schedule), d))
        many = _own(_graph(tiny(schedule=schedule, hardware={"preset": "t4",
                                                             "gpu": {"count": gpus}}), d))
        shards: dict[str, list] = {}
        for name, a in many.items():
            if a["kind"] not in COLLECTIVES:
                shards.setdefault(_whole(name, a), []).append(a)
        assert shards.keys() == one.keys()           # the same tasks, nothing lost or added
        sc = tiny(schedule=schedule)
        m, tokens = sc.model, sc.policy.mu * sc.workload.context_prompt
        for name, parts in shards.items():
            whole = one[name]
            split = len({p["kind"] for p in parts})
            assert whole["kind"] in SHARDED
            assert sorted(p["gpu"] for p in parts) == sorted(list(range(gpus)) * split)
            assert len({p["stream"] for p in parts}) == gpus    # one stream per GPU
            # Split in three, prefill's attention output is written and read back once more;
            # split at all, every GPU runs the router whole (its weights, 2 h E FLOPs a token)
            t = tokens if whole["step"] == 0 else sc.policy.mu
            extra = {"flops": (gpus - 1) * 2 * t * m.h * m.E if split > 1 else 0.0,
                     "bytes": (gpus - 1) * m.router_bytes if split > 1 else 0.0}
            if split == 3:
                extra["bytes"] += 2 * m.dtype_bytes * m.q_dim * tokens
            # more GPUs than tiny's 2 KV heads: each reads a copy of its head's cache, and
            # sends its copy of the new K,V to its host
            more = max(gpus / m.n_kv, 1) - 1
            extra["bytes_per_ctx"] = whole["bytes_per_ctx"] * more
            if whole["kind"] == "KVOut":
                extra["bytes"] = whole["bytes"] * more
            for field in ("flops", "flops_per_ctx", "bytes", "bytes_per_ctx"):
                want = whole[field] + extra.get(field, 0.0)
                assert sum(p[field] for p in parts) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("schedule", ["S1", "S3", "S4"])
def test_gpus_meet_only_in_collectives(schedule):
    gpus = 4
    g = _graph(tiny(schedule=schedule, hardware={"preset": "t4", "gpu": {"count": gpus}}))
    a = dict(g.nodes(data=True))
    collectives = 0
    for src, dst in g.edges:
        s, t = a[src], a[dst]
        if s["gpu"] >= 0 and t["gpu"] >= 0:
            assert s["gpu"] == t["gpu"], (src, dst)       # no shard reads another GPU's
        if t["kind"] in COLLECTIVES and not t["external"]:
            preds = [a[p] for p in g.predecessors(dst)]
            assert sorted(p["gpu"] for p in preds) == list(range(gpus))
            assert len({(p["kind"], p["step"], p["layer"], p["index"]) for p in preds}) == 1
            collectives += 1
        # the O projection's and the experts' outputs, and the logits, are partial sums: only
        # their collective reads them (data edges; buffer reuse may wait on anything)
        partial = {"OProj": "AllReduceAttn", "MoE": "AllReduce", "LMHead": "GatherLogits"}
        if s["kind"] in partial and g.edges[src, dst]["why"] == "data":
            assert t["kind"] == partial[s["kind"]], (src, dst)
        assert s["kind"] not in ("PostAttn", "Prefill") and t["kind"] not in ("PostAttn", "Prefill")
    assert collectives


@pytest.mark.parametrize("schedule", ["S1", "S4"])
def test_a_norm_over_every_head_runs_between_the_projection_and_attention(schedule):
    """OLMoE norms Q and K over every head, which no GPU's heads alone can: under tensor
    parallelism each PreAttn (prefill's attention too) runs as QKV (a GPU's heads and their
    sums of squares) -> AllReduceNorm (two fp32 figures a token) -> the rest on the normed Q and
    K, which the GPU's own attention then reads. A model that norms head by head keeps PreAttn
    whole."""
    gpus = 2
    for model, split in ((_OLMOE, True), (None, False)):
        sc = _tp(schedule, gpus, model=model)
        for d, rest in ((0, "PromptAttn"), (1, "QKNorm")):
            g = _graph(sc, d)
            a = dict(g.nodes(data=True))
            own = {n: x for n, x in a.items() if not x["external"]}
            kinds = {x["kind"] for x in own.values()}
            assert ({"QKV", "AllReduceNorm", rest} <= kinds) == split
            assert d == 0 or ("PreAttn" in kinds) == (not split)
            if not split:
                continue
            for n, x in own.items():
                preds = [a[p] for p in g.predecessors(n)
                         if g.edges[p, n]["why"] == "data"]
                if x["kind"] == "AllReduceNorm":
                    assert sorted(p["gpu"] for p in preds) == list(range(gpus))
                    assert {p["kind"] for p in preds} == {"QKV"}
                    tokens = sc.policy.mu * (sc.workload.context_prompt if x["step"] == 0 else 1)
                    assert x["bytes"] == pytest.approx(2 * (gpus - 1) / gpus * 8 * tokens)
                if x["kind"] == rest:
                    assert [p["kind"] for p in preds if p["kind"] in COLLECTIVES] == [
                        "AllReduceNorm"]
                reads = {"D1": "QKNorm", "GPUAttn": "QKNorm", "KVOut": "PromptAttn"}
                if x["kind"] in reads and (x["kind"] != "KVOut" or x["step"] == 0):
                    # the GPU's own normed heads, not another GPU's
                    normed = [p for p in preds if p["kind"] == reads[x["kind"]]]
                    assert normed and all(p["gpu"] == x["gpu"] for p in normed), n


def test_two_gpus_halve_a_gpu_bound_layer_and_a_slow_interconnect_binds():
    # Everything on the GPU (weights resident, KV cache there too), no fixed costs: a GPU-bound
    # layer whose work two GPUs split in half.
    hw = {"preset": "t4", "gpu": {"task_overhead_us": 0.0}, "link": {"latency_us": 0.0}}
    doc = dict(schedule="S4", policy={"N": 8, "mu": 4, "r_w": 1.0, "r_c": 1.0})
    one = simulate_scenario(tiny(**doc, hardware=hw)).summary
    fast = dict(hw, gpu={"task_overhead_us": 0.0, "count": 2},
                interconnect={"gbps": 1e6, "eff": 1.0, "latency_us": 0.0})
    two = simulate_scenario(tiny(**doc, hardware=fast)).summary
    assert one["hrm_binding"] == two["hrm_binding"] == "gpu"
    assert two["decode_layer_ms"] / one["decode_layer_ms"] == pytest.approx(0.5, rel=0.02)
    slow = dict(fast, interconnect={"gbps": 0.01, "eff": 1.0, "latency_us": 0.0})
    assert simulate_scenario(tiny(**doc, hardware=slow)).summary["hrm_binding"] == "peer"


def test_an_all_reduce_costs_what_nccl_tests_bus_bandwidth_says():
    # nccl-tests: algbw = size / time and busbw = algbw x 2 (n - 1) / n for an all-reduce of
    # `size` bytes over n ranks. A layer has two all-reduces of the hidden states, one after
    # the O projection and one after the experts.
    busbw, gpus = 7.5, 4
    sc = tiny(schedule="S1", hardware={"preset": "t4", "gpu": {"count": gpus},
                                       "interconnect": {"gbps": busbw, "eff": 1.0,
                                                        "latency_us": 0.0}})
    sim = simulate_scenario(sc)
    prog, run = sim.program, sim.run
    kind = np.array([prog.task(i)[1] for i in range(prog.total)])
    m, mu = sc.model, sc.policy.mu
    size = mu * m.h * m.dtype_bytes
    algbw = busbw * 1e9 * gpus / (2 * (gpus - 1))
    for name in ("AllReduceAttn", "AllReduce"):
        ar = np.flatnonzero((kind == name) & (prog.step >= 1))
        assert len(ar) == sc.model.L * sc.policy.n_micro * sc.decode_steps
        assert run.durations[ar] == pytest.approx(size / algbw, rel=1e-9)


@pytest.mark.parametrize("schedule", ["S1", "S4"])
def test_the_search_predictor_prices_four_gpus_as_the_simulator_does(schedule):
    """On the calibrated host, where the processes' copies and the GPUs' DMA share host
    memory (16 generated tokens: the decode layer is the same at every length)."""
    sc = load_scenario("scenarios/4xt4-8x22b.yaml", [f"schedule={schedule}",
                                                     "workload.gen_len=16"] + (
        ["policy.A_g=1"] if schedule == "S4" else []))
    sim = simulate_scenario(sc).summary
    pred = predict(sc, SCHEDULES[schedule])
    assert float(pred.hrm_layer_ms[0]) == pytest.approx(sim["hrm_layer_ms"], rel=0.02)
    assert float(pred.throughput_tok_s[0]) == pytest.approx(sim["throughput_tok_s"], rel=0.1)


@pytest.mark.parametrize("model, within", [("mixtral-8x7b", 0.03), ("olmoe-1b-7b", 0.10)])
def test_the_predictors_prefill_waits_for_its_all_reduces(model, within):
    """Prefill runs each micro-batch's parts in order on a GPU's stream, each waiting for the
    all-reduce before it: priced as perfect overlap, four GPUs' prefill was 7% (Mixtral) and
    23% (OLMoE, whose tiny layers wait on three collectives) short of the simulation's."""
    sc = load_scenario("scenarios/4xt4-8x22b.yaml", [
        f"model={model}", "hardware=4xt4", "schedule=S4", "policy.A_g=1", "policy.r_w=0",
        "policy.N=512", "policy.mu=64", "workload.gen_len=4"])
    sim = simulate_scenario(sc).summary
    pred = predict(sc, SCHEDULES["S4"])
    assert float(pred.prefill_s[0]) == pytest.approx(sim["prefill_s"], rel=within)


def test_the_search_predictor_prices_a_pipeline_as_the_simulator_does():
    # a pipeline policy that fits beside 5% resident weights on 4xT4
    sc = load_scenario("scenarios/4xt4-8x22b.yaml", [
        "schedule=PP", "policy.A_g=1", "policy.N=1792", "policy.mu=64", "policy.r_w=0.05"])
    sim = simulate_scenario(sc).summary
    pred = predict(sc, SCHEDULES["PP"])
    assert float(pred.hrm_layer_ms[0]) == pytest.approx(sim["hrm_layer_ms"], rel=0.02)
    assert float(pred.throughput_tok_s[0]) == pytest.approx(sim["throughput_tok_s"], rel=0.1)


def test_the_search_runs_the_pipeline_on_several_gpus_and_the_one_gpu_schedule_on_one():
    from taskgraph.study.search import Grid, evaluate, grid_jobs

    sc = load_scenario("scenarios/2xt4-8x22b.yaml")
    names = {c[0] for job in grid_jobs(sc, Grid(), 1) for c in job.combos}
    assert "S5" not in names and {"S1", "S4", "PP"} <= names
    one = load_scenario("scenarios/t4.yaml")
    names = {c[0] for job in grid_jobs(one, Grid(), 1) for c in job.combos}
    assert "S5" in names and "PP" not in names
    # a pipeline's candidates hold whole groups: micro-batches a multiple of the GPUs
    found, _ = evaluate(tiny(hardware={"preset": "t4", "gpu": {"count": 2}}), workers=1)
    pp = [c for c in found if c.schedule == "PP"]
    assert pp and all(c.policy["N"] // c.policy["mu"] % 2 == 0 for c in pp)
    # and they survive the check that a candidate can run (on a model cut to a layer a GPU)
    from taskgraph.study.search import _runnable

    four = load_scenario("scenarios/4xt4-8x22b.yaml")
    pp = [c for c in evaluate(four, workers=1)[0] if c.schedule == "PP"][:5]
    assert len(_runnable(four, pp, 5)) == len(pp) > 0


# --- execution: each GPU's shard, the collectives between them --------------------------------

torch = pytest.importorskip("torch")

_KV4 = {"preset": "tiny", "n_kv": 4}      # tiny has 2 KV heads: at most 2 GPUs
# Q and K RMS-normed over every head at once, as OLMoE norms them
_OLMOE = {"preset": "tiny", "architecture": "olmoe"}
_OLMOE4 = {**_OLMOE, "n_kv": 4}


def _tp(schedule, gpus, N=8, mu=2, r_w=0.0, r_c=0.0, model=None):
    gpu_attention = schedule in ("S4", "DS")
    return tiny(schedule=schedule, policy={"N": N, "mu": mu, "r_w": r_w,
                                           "r_c": 1.0 if schedule == "DS" else r_c,
                                           "A_g": int(gpu_attention)},
                workload={"prompt_len": 6, "gen_len": 3},
                hardware={"preset": "t4", "gpu": {"count": gpus}},
                **({"model": model} if model else {}))


def test_the_shards_partition_every_split_matrix_and_share_the_router():
    from taskgraph.exec.tensor import shard_elements
    from taskgraph.kernels.weights import layer_sections

    m = tiny(model=_KV4).model
    shards = [set(shard_elements(m, 4, g).tolist()) for g in range(4)]
    for s in layer_sections(m):
        cells = set(range(s.offset, s.offset + s.size))
        held = [cells & sh for sh in shards]
        if s.name == "router":
            assert all(h == cells for h in held)
        else:
            assert sum(len(h) for h in held) == len(cells) and set.union(*held) == cells
            assert all(len(h) == len(cells) // 4 for h in held)


@pytest.mark.parametrize("schedule,gpus,N,mu,r_w,r_c,model", [
    ("S1", 2, 8, 2, 0.0, 0.0, None), ("S1", 2, 6, 2, 0.3, 0.0, None),
    ("S2", 2, 4, 2, 0.0, 0.0, None), ("S3", 2, 6, 3, 0.0, 0.0, None),
    ("S4", 2, 6, 2, 0.25, 0.5, None),
    ("S1", 4, 8, 2, 0.0, 0.0, _KV4), ("S4", 4, 6, 2, 0.5, 0.0, _KV4),
    # more GPUs than tiny's 2 KV heads: each GPU a copy of the one its queries use (vLLM)
    ("S1", 4, 8, 2, 0.0, 0.0, None), ("S4", 4, 6, 2, 0.5, 0.5, None),
    # Q and K normed over every head: each GPU's sums of squares all-reduced (past the KV
    # heads, each GPU's copy of one counts for its share of the whole's mean)
    ("S1", 2, 6, 2, 0.3, 0.0, _OLMOE), ("S4", 4, 6, 2, 0.5, 0.5, _OLMOE4),
    ("S3", 2, 6, 3, 0.0, 0.0, _OLMOE), ("S1", 4, 8, 2, 0.0, 0.0, _OLMOE),
])
def test_one_process_runs_every_gpus_shard_and_computes_the_reference(
        schedule, gpus, N, mu, r_w, r_c, model):
    import random

    from taskgraph.dag.compiled import compile_plan
    from taskgraph.exec.dispatch import execute
    from taskgraph.exec.tensor import TensorParallel
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights

    sc = _tp(schedule, gpus, N, mu, r_w, r_c, model)
    plan = make_plan(sc)
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(N, 6, sc.model.V, seed=2)
    rt = TensorParallel(plan, w, prompts, torch.device("cpu"))
    rng = random.Random(gpus * 100 + N)
    delays: dict[int, float] = {}
    run = execute(compile_plan(plan), rt,
                  delay=lambda gid: delays.setdefault(gid, rng.random() * 0.001))
    assert not run.interrupted and run.finished.all()
    ref = reference_forward(w, prompts, mu, 3)
    tokens, logits, hidden = rt.outputs()
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule,gpus,model", [("S1", 2, None), ("S4", 4, _KV4),
                                                  ("S1", 2, _OLMOE)])
def test_one_process_per_gpu_over_gloo_computes_the_reference(schedule, gpus, model):
    """torch.distributed (gloo, CPU): each GPU's shard a process of its own, all-reduces and
    the logits' gather as collectives, random delays."""
    from taskgraph.dag.compiled import compile_plan
    from taskgraph.exec.distributed import execute_processes
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights
    from tests.helpers import unrolled_edges

    sc = _tp(schedule, gpus, model=model)
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(8, 6, sc.model.V, seed=2)
    plan = make_plan(sc)
    run = execute_processes(plan, w, prompts, delay_s=0.001, seed=gpus)
    ref = reference_forward(w, prompts, 2, 3)
    assert torch.equal(run.tokens, ref.tokens)
    torch.testing.assert_close(run.logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert not np.isnan(run.end).any()
    # each process ran its tasks after their predecessors it ran (its own GPU's, and its part
    # of the host's tasks and of each collective)
    edges = unrolled_edges(compile_plan(plan))
    for start, end in zip(run.rank_start, run.rank_end):
        both = ~np.isnan(start[edges[:, 1]]) & ~np.isnan(end[edges[:, 0]])
        assert both.sum() > len(edges) / gpus / 2
        assert (start[edges[both, 1]] >= end[edges[both, 0]] - 1e-6).all()


@pytest.mark.parametrize("model, copies", [(None, 2), (_KV4, 1)])
def test_gpus_past_the_kv_heads_each_hold_and_read_a_copy(model, copies):
    """Four GPUs over tiny's two KV heads: each GPU holds the head its queries use, so the KV
    cache is held twice over the GPUs and each attention task reads half of it, not a quarter
    (it was priced split four ways while the executor refused the split)."""
    from taskgraph.perf.memory import memory_footprint

    def priced(gpus):
        sc = _tp("S4", gpus, N=8, mu=2, r_c=1.0, model=model)
        plan = make_plan(sc)
        attention = plan.work.of("GPUAttn")
        kv = memory_footprint(plan).gpu["KV cache on GPU (r_c)"]
        return attention.bytes_per_ctx, kv, plan.work.of("KVOut", prefill=True).bytes

    (read1, kv1, out1), (read4, kv4, out4) = priced(1), priced(4)
    assert read4 == pytest.approx(read1 * copies / 4)
    assert kv4 == pytest.approx(kv1 * copies)
    assert out4 == pytest.approx(out1 * copies / 4)       # each GPU's copy to its host


def test_each_gpu_counts_what_its_shard_holds_whole():
    """DeepSeek-V3 on four GPUs in tensor parallel, every layer resident: each GPU holds the
    latent projections and routers whole (tests/test_families.py checks which elements the
    executor's shards hold twice), so the GPUs together hold three more copies of them than
    one GPU does, and no more of anything else."""
    from taskgraph.perf.memory import memory_footprint

    def weights(gpus):
        sc = tiny(model="deepseek-v3", schedule="S4", policy={"N": 8, "mu": 2, "r_w": 1.0,
                                                              "A_g": 1},
                  hardware={"preset": "t4", "gpu": {"count": gpus, "memory_gb": 4000}})
        return sc.model, memory_footprint(make_plan(sc)).gpu

    m, one = weights(1)
    _, four = weights(4)
    per_copy = (m.moe_layers * m.whole_on_every_gpu_bytes(False)
                + m.dense_count * m.whole_on_every_gpu_bytes(True))
    assert per_copy > 0.5e9                   # 61 layers' latent projections: about 1.9 GB
    assert four["weights every GPU holds whole"] == pytest.approx(3 * per_copy)
    assert four["resident weights (r_w)"] == one["resident weights (r_w)"]
