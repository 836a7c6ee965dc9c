"""Invariants of simulated runs, over random small scenarios and policies (hypothesis).

Checked against the full dependency graph read back from the networkx segment graphs, not
against the pruned form the simulator iterates over, so a pruning or engine bug shows up here.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskgraph.dag.builder import launch_sequence
from taskgraph.perf.cost import cost_model
from taskgraph.kinds import KIND_NAMES
from taskgraph.scenario import scenario_from_dict
from taskgraph.dag.schedules import RESOURCES
from taskgraph.sim.simulate import simulate_scenario
from taskgraph.tracing.writer import Window, write_trace
from tests.helpers import unrolled_edges


@st.composite
def scenarios(draw):
    schedule = draw(st.sampled_from(["S1", "S2", "S3", "S4", "DS", "S5", "PP", "EP", "EC",
                                     "ECP"]))
    expert_level = schedule in ("EP", "EC", "ECP")
    n_q = draw(st.sampled_from([2, 4, 8]))
    n_kv = draw(st.sampled_from([d for d in (1, 2, 4, 8) if n_q % d == 0]))
    E = draw(st.sampled_from([2, 4, 8]))
    # DS runs one micro-batch, so its KV prefetch needs a second layer to look ahead to
    L = draw(st.integers(2 if schedule == "DS" else 1, 4))
    h = n_q * draw(st.sampled_from([8, 16, 32]))
    # MoE-shaped: expert weights dominate a layer, as in every real MoE (a QKV projection larger
    # than a weight page is a separate, tested error).
    model = {"h": h, "h_i": draw(st.integers(4 * h, 8 * h)),
             "L": L, "n_q": n_q, "n_kv": n_kv, "E": E,
             "k": draw(st.integers(1, min(E, 2))), "V": draw(st.integers(16, 512))}
    if draw(st.booleans()):
        model.update(_modern(draw, model))
    # S1/S2 need two micro-batches; S4 prefetches the next (layer, micro-batch), which must not
    # be the one it is computing (test_builder covers the errors for these).
    min_micro = 2 if schedule in ("S1", "S2", "S5") or (
        (schedule in ("S4", "PP") or expert_level) and L == 1) else 1
    # Tensor parallelism over 2 or 4 GPUs, for every schedule whose FFN runs on the GPUs;
    # pipeline stages of at least one layer, and one group of micro-batches per stage.
    tensor = schedule not in ("PP", "DS")
    gpus = 1 if schedule == "S5" or expert_level else draw(st.sampled_from(
        [g for g in (1, 1, 2, 4)
         if (schedule != "PP" or g <= L) and (not tensor or n_q % g == 0)]))
    if tensor:       # even shards of the expert width and the vocabulary (check_shardable)
        model["h_i"] -= model["h_i"] % gpus
        model["V"] -= model["V"] % gpus
    if schedule == "DS":               # one micro-batch per GPU
        n_micro = gpus
    elif schedule == "PP":
        n_micro = gpus * draw(st.integers(-(-min_micro // gpus), max(1, 5 // gpus)))
    else:
        n_micro = draw(st.integers(min_micro, 5))
    mu = draw(st.integers(1, 6))
    gpu_attention = schedule in ("S4", "DS", "S5", "PP") or expert_level
    policy = {"N": n_micro * mu, "mu": mu, "A_g": int(gpu_attention),
              "F_g": int(schedule not in ("S5", "EP", "EC", "ECP")),
              # ZeRO-Inference streams every weight
              "r_w": 0.0 if schedule == "DS" else draw(st.sampled_from([0.0, 0.0, 0.3, 0.9, 1.0])),
              "r_c": 1.0 if schedule == "DS" else
              draw(st.sampled_from([0.0, 0.5])) if gpu_attention else 0.0}
    if expert_level:
        policy["experts_gpu"] = draw(st.integers(0, E))
    if schedule in ("EC", "ECP"):
        policy["eviction"] = draw(st.sampled_from(["lru", "popular"]))
    if schedule == "ECP":
        policy["prefetch"] = draw(st.sampled_from([0.0, 0.5, 1.0]))
    prompt = draw(st.integers(1, 64))
    workload = {"prompt_len": prompt, "max_prompt_len": prompt + draw(st.integers(0, 32)),
                "gen_len": draw(st.integers(1, 4)), "padded": draw(st.booleans())}
    hardware = {"preset": "t4",
                "gpu": {"tflops": draw(st.floats(0.01, 1000)), "count": gpus,
                        "task_overhead_us": draw(st.floats(0, 50))},
                "cpu": {"tflops": draw(st.floats(0.001, 10)),
                        "memcpy_gbps": draw(st.floats(0.1, 50))},
                "link": {"h2d_gbps": draw(st.floats(0.05, 64)),
                         "d2h_gbps": draw(st.floats(0.05, 64)),
                         "latency_us": draw(st.floats(0, 20))},
                "handoff_us": draw(st.sampled_from([0.0, 0.0, 5.0, 50.0]))}
    if gpus > 1 and draw(st.booleans()):
        hardware["interconnect"] = {"gbps": draw(st.floats(0.05, 600)), "eff": 1.0,
                                    "latency_us": draw(st.floats(0, 30))}
    if draw(st.booleans()):            # what the GPUs of the host share
        hardware["shared"] = {"memory_gbps": draw(st.floats(0.5, 200)),
                              "pcie_gbps": draw(st.one_of(st.none(), st.floats(0.5, 100)))}
        hardware["cpu"]["core_gbps"] = draw(st.one_of(st.none(), st.floats(0.5, 20)))
    if draw(st.booleans()):
        hardware["interference"] = {"slowdown": {
            "gpu": {"cpu": draw(st.floats(0, 2)), "h2d": draw(st.floats(0, 2))},
            "cpu": {"gpu": draw(st.floats(0, 2)), "pin": draw(st.floats(0, 2))}}}
    doc = {"model": model, "hardware": hardware, "workload": workload, "policy": policy,
           "schedule": schedule}
    # The schedule's own software, or a random implementation profile on top of the machine.
    if draw(st.booleans()):
        hardware["link"]["pageable_h2d_gbps"] = draw(st.floats(0.05, 64))
        kinds = {kind: {"flops_eff": draw(st.floats(0.01, 1)),
                        "bytes_eff": draw(st.floats(0.01, 1)),
                        "overhead_us": draw(st.floats(0, 100)),
                        "intensity_half": draw(st.sampled_from([0.0, 1.0, 30.0]))}
                 for kind in draw(st.sets(st.sampled_from(
                     ["Prefill", "PreAttn", "PostAttn", "CPUAttn", "GPUAttn", "D3", "KVOut"])))}
        doc["implementation"] = {"name": "random", "kinds": kinds,
                                 "pageable_weights": draw(st.booleans())}
    return scenario_from_dict(doc, source="<hypothesis>")


def _modern(draw, model: dict) -> dict:
    """What today's MoEs add: dense layers, shared experts, MLA or sliding-window attention,
    tensors stored at 4 to 8 bits."""
    h, L = model["h"], model["L"]
    out: dict = {}
    if L > 1 and draw(st.booleans()):
        out.update(dense_layers=sorted(draw(st.sets(st.integers(0, L - 1), min_size=1,
                                                    max_size=L - 1))),
                   h_dense=draw(st.integers(h, 4 * h)))
    if draw(st.booleans()):
        out.update(shared_experts=draw(st.integers(1, 2)), h_shared=draw(st.integers(h, 2 * h)),
                   shared_gate=draw(st.booleans()))
    if draw(st.booleans()):
        out.update(attention="mla", kv_lora_rank=draw(st.sampled_from([16, 32])),
                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                   q_lora_rank=draw(st.sampled_from([None, 24])), n_kv=model["n_q"])
    elif draw(st.booleans()):
        out.update(sliding_window=draw(st.integers(1, 40)),
                   sliding_layers=sorted(draw(st.sets(st.integers(0, L - 1), max_size=L))))
    out["precision"] = {"experts": draw(st.sampled_from(["q4_k", "mxfp4", 8.5, None])),
                        "attention": draw(st.sampled_from(["q8_0", None])),
                        "kv_cache": draw(st.sampled_from([8, None]))}
    return out


@given(scenarios())
def test_simulated_runs_keep_every_invariant(sc):
    sim = simulate_scenario(sc)
    prog, run = sim.program, sim.run
    start, end, dur = run.start, run.end, run.durations

    # Every task of the schedule runs exactly once.
    launched = Counter(k for d in range(prog.plan.G + 1) for k in launch_sequence(prog.plan, d))
    assert max(launched.values()) == 1
    assert len(launched) == prog.total
    assert run.finished.all()
    assert np.allclose(end - start, dur, rtol=1e-9, atol=1e-15)

    # No task starts before its predecessors end (data and buffer-reuse edges alike), nor before
    # the hardware's hand-off time has passed when the predecessor ran on another stream.
    edges = unrolled_edges(prog)
    stream = prog.column("stream")
    other = stream[edges[:, 0]] != stream[edges[:, 1]]
    handoff = sc.hardware.handoff_us * 1e-6
    gap = start[edges[:, 1]] - end[edges[:, 0]]
    assert (gap >= -1e-12).all()
    assert (gap[other] >= handoff * (1 - 1e-9) - 1e-12).all()

    # Streams run in launch order, one task at a time; no two tasks overlap on one resource
    # (each GPU and each GPU's link being a resource of its own).
    for sid in range(len(prog.streams)):
        ids = np.flatnonzero(stream == sid)          # global ids are in launch order
        assert (start[ids[1:]] >= end[ids[:-1]]).all()
    resource, device = prog.column("resource"), prog.device
    busy = {}
    for rid in np.unique(device):
        ids = np.flatnonzero(device == rid)
        busy[rid] = dur[ids].sum()
        # an empty task (DS's KV moves carry nothing) occupies no time, nor does one whose
        # duration is below the clock's resolution at that time (a 1e-219 s latency)
        ids = ids[end[ids] > start[ids]]
        order = ids[np.argsort(start[ids], kind="stable")]
        assert (start[order[1:]] >= end[order[:-1]]).all()

    # The makespan is at least the critical path and the busiest resource's work.
    makespan = end.max()
    finish = dur.copy()
    for src, dst in sorted(map(tuple, edges), key=lambda e: e[1]):
        finish[dst] = max(finish[dst], finish[src] + dur[dst])
    assert makespan >= finish.max() * (1 - 1e-12)
    assert makespan >= max(busy.values()) * (1 - 1e-12)

    # Whatever overlaps a task (interference, shared pools) only ever slows it.
    assert (dur >= prog.durations(cost_model(sc, sc.schedule)) * (1 - 1e-9)).all()

    # The simulated decode layer is never faster than the HRM bound.
    s = sim.summary
    assert s["decode_layer_ms"] >= s["hrm_layer_ms"] * (1 - 1e-9)
    assert s["tasks"] == prog.total

    # Phases: prefill ends with its last compute task (whatever kinds a schedule gives it), the
    # decode window is the rest, and decode work before that end is reported as overlap.
    kind = prog.column("kind")
    compute = np.isin(resource, [RESOURCES.index("gpu"), RESOURCES.index("cpu")])
    prefill_end = end[(prog.step == 0) & compute].max()
    # the last layer's prefill: whole (Prefill), or ending with the experts' output (Merge, or
    # each GPU's part of it under tensor parallelism)
    last = (prog.step == 0) & np.isin(kind, [KIND_NAMES.index(k) for k in (
        "Prefill", "Merge", "MoE", "GPUFFN", "Route")])
    assert prefill_end >= end[last].max()
    assert s["prefill_s"] == pytest.approx(prefill_end, rel=1e-5)
    assert s["prefill_s"] + s["decode_s"] == pytest.approx(makespan, rel=1e-5)
    first_decode = start[prog.step >= 1].min()
    assert s["overlap_s"] == pytest.approx(max(0.0, prefill_end - first_decode), rel=1e-5,
                                           abs=1e-12)


@settings(max_examples=10)
@given(scenarios())
def test_same_input_gives_identical_json_and_trace(tmp_path_factory, sc):
    out = tmp_path_factory.mktemp("det")
    texts, traces = [], []
    for i in range(2):
        sim = simulate_scenario(sc)
        summary = dict(sim.summary, wall_s=None)   # the only field that measures this machine
        texts.append(json.dumps(summary, sort_keys=True))
        path = out / f"t{i}.json.gz"
        write_trace(path, [sim.trace_run()], Window(None))
        traces.append(path.read_bytes())
    assert texts[0] == texts[1]
    assert traces[0] == traces[1]


@pytest.mark.slow
@given(scenarios())
def test_long_property_run(sc):
    """The same invariants over many more examples (--runslow)."""
    test_simulated_runs_keep_every_invariant.hypothesis.inner_test(sc)
