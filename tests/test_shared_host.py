"""What the GPUs of one host share: its cores (each GPU's process runs its host work on threads of
its own), its memory bandwidth and the PCIe lanes upstream of the links (pools divided among the
tasks drawing on them at once), and data parallelism, where every GPU receives every layer.

The pool solver is checked against a brute-force sum on a fine time grid, the fixed point
against its own definition (each task's duration is its cost over the speed the pool gave it
while it ran), and the machine against what it must reduce to when nothing is shared."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskgraph.dag.builder import launch_sequence, make_plan
from taskgraph.dag.compiled import compile_plan
from taskgraph.perf.cost import POOLS, CostModel, cost_model
from taskgraph.perf.predict import ROWS, predict
from taskgraph.dag.schedules import RESOURCES, SCHEDULES
from taskgraph.scenario import load_scenario
from taskgraph.sim.contention import pool_speed
from taskgraph.sim.interference import _fixed_point, simulate_with_interference
from taskgraph.sim.simulate import simulate_scenario
from taskgraph.tracing.check import check_trace, load_trace
from taskgraph.tracing.writer import write_trace
from tests.helpers import tiny

TWO = {"preset": "t4", "gpu": {"count": 2}}


def _intervals(draw, n):
    out = []
    for _ in range(n):
        s = draw(st.floats(0, 10))
        out.append((s, s + draw(st.floats(0.01, 5)), draw(st.floats(0, 3))))
    return out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_pool_speed_matches_a_fine_grid(data):
    """Each task's mean speed is the mean over its run of min(1, capacity / total demand)."""
    tasks = _intervals(data.draw, data.draw(st.integers(1, 6)))
    capacity = data.draw(st.floats(0.5, 6))
    start, end, demand = (np.array(x, dtype=float) for x in zip(*tasks))
    got = pool_speed(start, end, demand, capacity)
    grid = np.linspace(0, 16, 160_001)
    mid = (grid[1:] + grid[:-1]) / 2
    load = sum(np.where((mid >= s) & (mid < e), d, 0.0) for s, e, d in tasks)
    speed = np.minimum(1.0, capacity / np.maximum(load, 1e-12))
    for i, (s, e, d) in enumerate(tasks):
        inside = (mid >= s) & (mid < e)
        want = speed[inside].mean() if d > 0 and inside.any() else 1.0
        assert got[i] == pytest.approx(want, abs=2e-3)


def test_pool_speed_alone_and_together():
    # one task drawing 4 GB/s of a 10 GB/s pool runs at full speed; three at once share it
    start, end = np.zeros(3), np.ones(3)
    assert pool_speed(start[:1], end[:1], np.array([4.0]), 10.0) == pytest.approx([1.0])
    assert pool_speed(start, end, np.full(3, 4.0), 10.0) == pytest.approx([10 / 12] * 3)
    # a task that draws nothing, or never ran, is not slowed
    got = pool_speed(np.array([0.0, 0.0, 0.0]), np.array([1.0, 1.0, np.nan]),
                     np.array([0.0, 30.0, 30.0]), 10.0)
    assert got[0] == 1.0 and got[1] == pytest.approx(1 / 3) and got[2] == 1.0


def _shared(memory_gbps=None, pcie_gbps=None, **sections):
    """The tiny model on four T4s whose host shares what is given, and nothing else: no limit
    per core, every system at the machine's own rates."""
    hw = {"preset": "4xt4", "shared": {"memory_gbps": memory_gbps, "pcie_gbps": pcie_gbps},
          "cpu": {"core_gbps": None}}
    return tiny(hardware=hw, implementation={"name": "plain"}, **sections)


def test_nothing_shared_is_todays_machine():
    """Without hardware.shared the host's processes split its cores, copy rate and memory
    bandwidth evenly: every GPU's host work takes what the one host task took for all of them,
    so the run is what one set of host streams gave."""
    sc = _shared()
    cost = cost_model(sc, "S1")
    assert not cost.pools_shared
    whole = CostModel(sc.hardware.model_copy(update={"gpu": sc.hardware.gpu.model_copy(
        update={"count": 1})}))
    # a quarter of the work at a quarter of the rate
    for r in ("cpu", "pin"):
        i = RESOURCES.index(r)
        assert cost.byte_rate[i] == pytest.approx(whole.byte_rate[i] / 4)
    plan = make_plan(sc)
    assert {"cpu:0", "cpu:3", "pin:0", "pin:3"} <= set(plan.streams)
    keys = launch_sequence(plan, 1)
    attn = [k for k in keys if k.kind == "CPUAttn" and k.layer == 0 and k.index == 2]
    assert sorted(k.gpu for k in attn) == [0, 1, 2, 3]     # one per GPU's process


def test_a_shared_pool_slows_what_overlaps_and_nothing_else():
    free = simulate_scenario(_shared())
    tight = simulate_scenario(_shared(memory_gbps=2.0))
    assert tight.summary["throughput_tok_s"] < free.summary["throughput_tok_s"]
    # every task at least its own cost; the host's memory never carries more than it can
    base = tight.program.durations(cost_model(tight.plan.scenario, "S1"))
    assert (tight.run.durations >= base * (1 - 1e-9)).all()
    assert tight.summary["shared"]["host_memory"]["decode"] <= 1.0 + 1e-9
    # the GPUs' own compute draws nothing from the host's memory
    gpu = tight.program.column("resource") == RESOURCES.index("gpu")
    assert np.allclose(tight.run.durations[gpu], base[gpu])
    # a pool wider than anything can draw slows nothing: every task takes its own cost
    wide = simulate_scenario(_shared(memory_gbps=1e6, pcie_gbps=1e6))
    assert np.allclose(wide.run.durations, wide.program.durations(
        cost_model(wide.plan.scenario, "S1")))


def test_a_binding_pool_takes_at_least_its_bytes_over_its_capacity():
    """Three times oversubscribed, the host's memory sets the pace: the run lasts at least the
    bytes drawn over the capacity (no schedule beats that), and little more."""
    sim = simulate_scenario(_shared(memory_gbps=3.0, workload={"gen_len": 24}))
    cost = cost_model(sim.plan.scenario, "S1")
    floor = sim.program.pool_bytes(cost)[POOLS.index("host_memory")].sum() / 3e9
    makespan = float(np.nanmax(sim.run.end))
    assert floor * (1 - 1e-3) <= makespan <= floor * 1.1
    assert sim.summary["bound_by"]["decode"] == "host_memory"


def test_the_fixed_point_is_what_each_task_overlapped():
    """At the solution, each task lasts its own cost over the mean speed the pools gave it in
    that very run: within a fraction of a percent, weighted by the bytes each draws (a few short
    tasks drawing little may flip between overlapping a burst or not)."""
    sim = simulate_scenario(_shared(memory_gbps=20.0, pcie_gbps=12.0))
    run, cost = sim.run, cost_model(sim.plan.scenario, "S1")
    base = run.program.durations(cost)
    drawn = run.program.pool_bytes(cost)
    alone = np.divide(drawn, base, out=np.zeros_like(drawn), where=base > 0)
    speed = np.ones(len(base))
    for p in range(len(POOLS)):
        speed = np.minimum(speed, pool_speed(run.start, run.end, alone[p],
                                             cost.pool_capacity[p]))
    assert (speed < 0.95).any()                          # the pools did bind somewhere
    off = np.abs(run.durations * speed / base - 1)
    weight = drawn.sum(axis=0)
    assert (off * weight).sum() / weight.sum() < 2e-3


def test_a_long_run_starts_from_a_short_ones_slowdowns():
    """The warm start (the slowdowns of a few steps) lands where solving the whole run from
    scratch does."""
    sc = _shared(memory_gbps=20.0, workload={"gen_len": 24})
    program = compile_plan(make_plan(sc))
    cost = cost_model(sc, "S1")
    warm = simulate_with_interference(program, cost)
    base = program.durations(cost)
    cold = _fixed_point(program, cost, base, base, None, 1e-3, 30)
    assert np.nanmax(warm.end) == pytest.approx(np.nanmax(cold.end), rel=3e-3)


def test_threads_per_process_bound_its_copies_and_attention():
    sc = tiny(hardware={"preset": "4xt4", "cpu": {"core_gbps": 10.0}},
              implementation={"name": "one-thread", "rank_threads": 1})
    cost = cost_model(sc, "S1")
    pin, cpu = RESOURCES.index("pin"), RESOURCES.index("cpu")
    assert cost.byte_rate[pin] == pytest.approx(5e9)           # one thread copies at 10 / 2
    assert cost.byte_rate[cpu] == pytest.approx(10e9)
    assert cost.flops_rate[cpu] == pytest.approx(
        sc.hardware.cpu.tflops * 1e12 * sc.hardware.cpu.flops_eff / sc.hardware.cpu.cores)
    # more threads than a process's share of the cores get only the share
    many = cost_model(tiny(hardware={"preset": "4xt4"},
                           implementation={"name": "greedy", "rank_threads": 1000}), "S1")
    assert many.process_cores == sc.hardware.cpu.cores / 4
    # one GPU: one process with every core, whatever the system does on several
    one = cost_model(tiny(implementation={"name": "one-thread", "rank_threads": 1}), "S1")
    assert one.process_cores == tiny().hardware.cpu.cores


def test_data_parallel_gives_every_gpu_every_layer():
    """DeepSpeed on two GPUs: each GPU runs its own group, receives the whole layer over its own
    link, and never waits on the other; twice the GPUs, twice the batch, the same step (with the
    same software: `deepspeed`'s own profile gathers slower where GPUs share a host)."""
    ideal = {"name": "ideal"}
    sc = tiny(hardware=TWO, schedule="DS", policy={"N": 4, "mu": 2}, implementation=ideal)
    plan = make_plan(sc)
    assert plan.dp == 2 and plan.tp == 1
    program = compile_plan(plan)
    g = program.templates[program.seg_template[1]].graph
    own = {n: a for n, a in g.nodes(data=True) if not a["external"]}
    d3 = [a for a in own.values() if a["kind"] == "D3"]
    assert sorted(a["gpu"] for a in d3 if a["layer"] == 1) == [0, 1]
    layer = sc.model.layer_bytes
    assert all(a["bytes"] == pytest.approx(layer) for a in d3)
    for u, v in g.edges():
        a, b = g.nodes[u], g.nodes[v]
        assert a["gpu"] == b["gpu"], (u, v)
    two = simulate_scenario(sc).summary
    one = simulate_scenario(tiny(schedule="DS", policy={"N": 2, "mu": 2},
                                 implementation=ideal)).summary
    assert two["decode_layer_ms"] == pytest.approx(one["decode_layer_ms"], rel=1e-6)
    assert two["throughput_tok_s"] == pytest.approx(2 * one["throughput_tok_s"], rel=1e-5)
    # DeepSpeed's own: its gather through the shared host (fitted on 2xT4/4xT4) slows the two
    # GPUs' step, not the one GPU's
    own = simulate_scenario(sc.model_copy(update={"implementation": None})).summary
    alone = simulate_scenario(tiny(schedule="DS", policy={"N": 2, "mu": 2})).summary
    assert alone["decode_layer_ms"] == pytest.approx(one["decode_layer_ms"], rel=1e-6)
    assert own["decode_layer_ms"] > 3 * alone["decode_layer_ms"]


def test_data_parallel_caps_the_batch_per_gpu():
    """Choosing DS on several GPUs gives each GPU one micro-batch."""
    from taskgraph.scenario import for_schedule

    sc = tiny(hardware={"preset": "t4", "gpu": {"count": 4}}, policy={"N": 16})
    placed, note = for_schedule(sc, "DS")
    assert placed.policy.N == 4 * placed.policy.mu and "per GPU" in note


def test_predicted_pools_track_the_simulation():
    """The predictor's pool rows (bytes over capacity) bound what the simulator finds."""
    sc = _shared(memory_gbps=2.0, workload={"gen_len": 8})
    pred = predict(sc, SCHEDULES["S1"])
    sim = simulate_scenario(sc).summary
    assert ROWS[int(pred.binding[0])] == "host_memory"
    assert sim["bound_by"]["decode"] == "host_memory"
    assert pred.throughput_tok_s[0] == pytest.approx(sim["throughput_tok_s"], rel=0.15)
    assert pred.throughput_tok_s[0] >= sim["throughput_tok_s"] * 0.99


def test_the_trace_draws_each_shared_pool(tmp_path):
    sim = simulate_scenario(_shared(memory_gbps=3.0, pcie_gbps=2.0))
    path = tmp_path / "t.json"
    write_trace(path, [sim.trace_run()])
    trace = load_trace(path)
    assert check_trace(trace) == []
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "C"}
    assert {"host memory (GB/s)", "shared PCIe CPU->GPU (GB/s)"} <= names


def test_scenarios_name_what_their_hosts_share():
    for path in ("scenarios/2xt4-8x22b.yaml", "scenarios/4xt4-8x22b.yaml"):
        hw = load_scenario(path).hardware
        assert hw.shared.memory_gbps is not None and hw.cpu.core_gbps is not None


def test_data_parallel_in_one_process_computes_the_reference():
    """Each GPU's group in its own weight double buffer and KV slots on one device, with random
    delays: the sequential reference's tokens and logits."""
    import random

    torch = pytest.importorskip("torch")
    from taskgraph.exec.dispatch import execute
    from taskgraph.exec.runtime import Runtime
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights

    sc = tiny(hardware=TWO, schedule="DS", policy={"N": 6, "mu": 3},
              workload={"prompt_len": 6, "gen_len": 3})
    plan = make_plan(sc)
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(6, 6, sc.model.V, seed=2)
    rt = Runtime(plan, w, prompts, torch.device("cpu"))
    rng = random.Random(7)
    run = execute(compile_plan(plan), rt, delay=lambda gid: rng.random() * 0.001)
    assert not run.interrupted and run.finished.all()
    ref = reference_forward(w, prompts, 3, 3)
    tokens, logits, _ = rt.outputs()
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_ctrl_c_while_the_short_run_is_solved_stops_the_whole_run(monkeypatch):
    """The warm start's short run is part of the simulation: Ctrl-C there ends it, reported as
    an interrupted run of nothing, not a long run the user must interrupt again."""
    import taskgraph.sim.interference as solver

    real = solver.simulate

    def interrupted_probe(program, cost, progress=None, durations=None):
        run = real(program, cost, progress, durations)
        run.interrupted = program.plan.G < 24        # the short run, not the whole
        return run

    monkeypatch.setattr(solver, "simulate", interrupted_probe)
    sim = simulate_scenario(_shared(memory_gbps=20.0, workload={"gen_len": 24}))
    assert sim.run.interrupted and np.isnan(sim.run.end).all()
    assert sim.summary["interrupted"] and sim.summary["tasks"] == 0


def test_a_pool_nothing_drew_on_leaves_no_track(tmp_path):
    """DS keeps the KV cache on the GPU: nothing crosses the shared lanes towards the CPU, and
    the trace has no track for them (it once failed to write: found by hypothesis)."""
    from taskgraph.cli import main

    path = tmp_path / "ds.json"
    assert main(["simulate", "scenarios/tiny.yaml", "--schedule", "DS", "--set",
                 "hardware.shared.pcie_gbps=10", "--trace", str(path)]) == 0
    names = {e["name"] for e in json.loads(path.read_text())["traceEvents"]
             if e.get("ph") == "C"}
    assert "shared PCIe CPU->GPU (GB/s)" in names
    assert "shared PCIe GPU->CPU (GB/s)" not in names
