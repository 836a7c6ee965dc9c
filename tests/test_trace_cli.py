"""Traces (Perfetto rules, content, interrupted runs) and the CLI's JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest

from taskgraph.cli import main
from taskgraph.dag.compiled import compile_plan
from taskgraph.dag.builder import make_plan
from taskgraph.perf.cost import CostModel
from taskgraph.perf.memory import memory_footprint
from taskgraph.sim.engine import simulate
from taskgraph.sim.metrics import summarize
from taskgraph.sim.simulate import simulate_scenario
from taskgraph.tracing.writer import TraceRun, Window, write_trace
from taskgraph.tracing.check import check_trace, load_trace
from tests.helpers import assert_drawn, tiny

CONTRACT = {"scenario", "schedule", "policy", "throughput_tok_s", "prefill_s", "decode_s",
            "decode_layer_ms", "hrm_layer_ms", "utilization", "memory", "tasks", "wall_s"}


@pytest.mark.parametrize("schedule", ["S1", "S2", "S3", "S4", "DS", "S5"])
def test_trace_follows_perfetto_rules(tmp_path, schedule):
    sc = tiny(schedule=schedule)
    sim = simulate_scenario(sc, schedule)
    path = tmp_path / "t.json.gz"
    n = write_trace(path, [sim.trace_run()], Window(None))
    trace = load_trace(path)
    assert check_trace(trace) == []
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert n == len(slices) == sim.program.total
    # named tracks grouped by device, args on every slice, flows and counters present
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "GPU compute" in names and "PCIe CPU->GPU" in names
    assert all({"task", "step", "layer", "bytes"} <= e["args"].keys() for e in slices)
    assert any(e["ph"] == "s" for e in events) and any(e["ph"] == "f" for e in events)
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"GPU weight buffer (GB)", "PCIe CPU->GPU (GB/s)"} <= counters


def test_trace_times_match_the_simulation(tmp_path):
    sim = simulate_scenario(tiny())
    path = tmp_path / "t.json"
    write_trace(path, [sim.trace_run()], Window(None))
    by_task = {e["args"]["task"]: e for e in load_trace(path)["traceEvents"] if e["ph"] == "X"}
    prog = sim.program
    for gid in (0, prog.total // 2, prog.total - 1):
        step, kind, layer, index = prog.task(gid)
        e = by_task[f"{kind}[s{step},L{layer},{'p' if kind in ('D3', 'W_CtoPin') else 'm'}{index}]"]
        assert e["ts"] == pytest.approx(sim.run.start[gid] * 1e6, abs=1e-3)
        assert e["ts"] + e["dur"] == pytest.approx(sim.run.end[gid] * 1e6, abs=2e-3)


def test_default_window_is_small_and_two_runs_share_a_file(tmp_path):
    sim = simulate_scenario(tiny(workload={"gen_len": 6}))
    path = tmp_path / "both.json"
    runs = [sim.trace_run("simulated"), sim.trace_run("again")]
    n = write_trace(path, runs, Window(1))
    trace = load_trace(path)
    assert check_trace(trace) == []
    assert n == 2 * int((sim.program.step <= 1).sum()) < 2 * sim.program.total
    procs = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert procs == {"1. simulated", "2. again"}
    tids = [(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert len({t for _, t in tids}) == len(tids)          # tids unique across runs
    assert all(t != p for p, t in tids)                     # and never a pid
    flow_ids = [e["id"] for e in trace["traceEvents"] if e["ph"] == "s"]
    assert len(flow_ids) == len(set(flow_ids))


def test_interrupted_run_leaves_a_valid_trace(tmp_path):
    plan = make_plan(tiny(workload={"gen_len": 6}))
    prog = compile_plan(plan)

    def stop(segment):
        if segment == 3:
            raise KeyboardInterrupt

    run = simulate(prog, CostModel(plan.scenario.hardware), progress=stop)
    assert run.interrupted
    assert 0 < run.finished.sum() < prog.total
    # figures describe what finished: fewer steps, a plausible layer latency
    full = summarize(simulate(prog, CostModel(plan.scenario.hardware)), memory_footprint(plan))
    part = summarize(run, memory_footprint(plan))
    assert part["interrupted"] and part["steps"] < full["steps"]
    assert part["tasks"] == run.finished.sum()
    assert 0.5 < part["decode_layer_ms"] / full["decode_layer_ms"] < 2
    path = tmp_path / "partial.json"
    n = write_trace(path, [TraceRun("simulated", prog, run.start, run.end)], Window(None))
    assert n == run.finished.sum()
    assert check_trace(load_trace(path)) == []


def test_simulate_json_contract(capsys, tmp_path):
    trace = tmp_path / "t.json.gz"
    assert main(["simulate", "scenarios/tiny.yaml", "--json", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert CONTRACT <= out.keys()
    assert set(out["policy"]) == {"N", "mu", "A_g", "F_g", "r_w", "r_c"}
    assert {"gpu", "cpu", "h2d", "d2h"} <= out["utilization"].keys()
    assert {"gpu_peak_gb", "cpu_peak_gb"} <= out["memory"].keys()
    assert out["throughput_tok_s"] > 0 and out["decode_layer_ms"] >= out["hrm_layer_ms"]
    assert check_trace(load_trace(trace)) == []


def test_compare_json_and_overrides(capsys):
    assert main(["compare", "scenarios/tiny.yaml", "--schedules", "S1,S3", "--json",
                 "--set", "workload.gen_len=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in out["results"]] == ["S1", "S3"]
    assert all(CONTRACT <= r.keys() and r["steps"] == 2 for r in out["results"])


def test_check_gate_passes_and_fails(capsys, tmp_path):
    path = tmp_path / "gate.yaml"
    doc = json.loads(json.dumps({"model": "tiny", "hardware": "t4",
                                 "workload": {"prompt_len": 16, "gen_len": 2},
                                 "policy": {"N": 8, "mu": 2, "r_w": 0, "r_c": 0},
                                 "expect": {"beats": {"S1": ["S3"]},
                                            "max_decode_layer_ms": {"S1": 1000}}}))
    path.write_text(json.dumps(doc))
    assert main(["compare", str(path), "--schedules", "S1", "--check"]) == 0
    capsys.readouterr()
    doc["expect"] = {"beats": {"S3": ["S1"]}, "min_throughput_tok_s": {"S1": 1e12}}
    path.write_text(json.dumps(doc))
    assert main(["compare", str(path), "--check", "--json"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["checks_ok"] is False
    assert [c["ok"] for c in out["checks"]] == [False, False]
    assert "2 of 2 expectations" in captured.err and "S3 beats S1" in captured.err


def test_graph_export(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["graph", "scenarios/tiny.yaml", "--out", str(out)]) == 0
    g = nx.node_link_graph(json.loads(out.read_text()), edges="edges")
    own = [n for n, a in g.nodes(data=True) if not a["external"]]
    assert len(own) == 4 * 4 * 7 + 4                       # L x n x 7 kinds + LM heads
    assert nx.is_directed_acyclic_graph(g)
    dot = tmp_path / "g.dot"
    assert main(["graph", "scenarios/tiny.yaml", "--out", str(dot), "--step", "0"]) == 0
    text = dot.read_text()
    assert text.startswith('digraph "S1 segment 0"') and "Prefill[s0,L0,m0]" in text


def test_a_graph_of_minutes_is_announced_before_it_is_built(tmp_path, capsys, monkeypatch):
    """Round three: tg graph of 1,000 layers and 256 micro-batches (1.8 million tasks) built
    for minutes without a word. Now the estimate comes first, on stderr, then the build (here
    stopped where it would start)."""
    import taskgraph.dag.builder as builder

    def stop(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "build_segment", stop)
    assert main(["graph", "scenarios/tiny.yaml", "--set", "model.L=1000", "--set",
                 "policy.N=256", "--set", "policy.mu=1", "--out", str(tmp_path / "g.json")]) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert "segment 2 of S1 has about 1,792,256 tasks" in err and "minutes to build" in err
    assert not (tmp_path / "g.json").exists()
    monkeypatch.undo()
    assert main(["graph", "scenarios/tiny.yaml", "--out", str(tmp_path / "g.json")]) == 0
    assert "to build" not in capsys.readouterr().err      # a small graph is just built


def test_the_simulator_does_not_import_torch():
    code = ("import sys, taskgraph.cli, taskgraph.sim.simulate, taskgraph.tracing.writer; "
            "from taskgraph.cli import main; main(['simulate', 'scenarios/tiny.yaml', '--json']);"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_multi_gpu_aggregates_and_splits_memory():
    one = simulate_scenario(tiny(hardware="t4")).summary
    four = simulate_scenario(tiny(hardware="4xt4")).summary
    # Four KV heads split over four GPUs exactly; tiny's two are held twice (a copy per GPU).
    # What no shard splits is the router: at r_w = 0 each GPU's double buffer holds two
    # layers' routers whole, so the three GPUs past the first add 3 x 2 routers to the split.
    kv4 = {"preset": "tiny", "n_kv": 4}
    one_kv4 = simulate_scenario(tiny(hardware="t4", model=kv4)).summary
    four_scenario = tiny(hardware="4xt4", model=kv4)
    assert four_scenario.policy.r_w == 0
    four_kv4 = simulate_scenario(four_scenario).summary
    routers_gb = 3 * 2 * four_scenario.model.router_bytes / 1e9
    assert four_kv4["memory"]["gpu_peak_gb"] == pytest.approx(
        (one_kv4["memory"]["gpu_peak_gb"] + routers_gb) / 4, rel=1e-5)
    assert four["memory"]["gpu_peak_gb"] > one["memory"]["gpu_peak_gb"] / 4
    assert np.isfinite(four["throughput_tok_s"])
    # The tiny model's all-reduces over PCIe cost more than its layers gain (120 us of ring
    # latency each, two per layer and micro-batch); over an NVLink-class interconnect four
    # GPUs are faster.
    assert four["decode_layer_ms"] > one["decode_layer_ms"]
    fast = simulate_scenario(tiny(hardware={"preset": "4xt4", "interconnect": {
        "gbps": 300.0, "eff": 0.77, "latency_us": 1.0}})).summary
    assert fast["decode_layer_ms"] < one["decode_layer_ms"]


def test_gantt_chart(tmp_path, capsys):
    out = tmp_path / "g.png"
    assert main(["compare", "scenarios/tiny.yaml", "--schedules", "S1,S3", "--gantt", str(out),
                 "--json"]) == 0
    assert_drawn(out)
    capsys.readouterr()
    assert main(["simulate", "scenarios/tiny.yaml", "--gantt", str(tmp_path / "g.svg")]) == 2
    assert ".png" in capsys.readouterr().err


# --- Perfetto protobuf (.pftrace): the same trace as the JSON, event by event ------------------

def _events_by_kind(trace: dict) -> tuple:
    """A trace's tracks, slices, counters and flows, in orders that do not depend on the
    format; each flow as the two slices it joins (Perfetto binds a flow's point to the slice
    around it)."""
    import bisect
    from collections import Counter

    events = trace["traceEvents"]
    meta = sorted(json.dumps(e, sort_keys=True) for e in events if e["ph"] == "M")
    slices = sorted((e["pid"], e["tid"], e["ts"], e["dur"], e["name"], e["cat"],
                     json.dumps(e["args"], sort_keys=True)) for e in events if e["ph"] == "X")
    counters = Counter((e["pid"], e["name"], e["ts"], float(e["args"][e["name"]]))
                       for e in events if e["ph"] == "C")
    tracks: dict = {}
    for s in slices:
        tracks.setdefault(s[:2], []).append(s)
    starts = {k: [round(s[2] * 1000) for s in v] for k, v in tracks.items()}
    flows: dict = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            track = (e["pid"], e["tid"])
            i = bisect.bisect_left(starts[track], round(e["ts"] * 1000)) - 1
            flows.setdefault(e["id"], {})[e["ph"]] = tracks[track][i][:5]
    return meta, slices, counters, flows


def test_the_protobuf_trace_carries_the_json_trace_event_by_event(tmp_path):
    """Simulated runs of every schedule in one file, and an executed run whose profiler ops
    nest inside each other on their threads: the .pftrace, read back with the protobuf
    messages, holds what the .json holds."""
    pytest.importorskip("perfetto")
    from taskgraph.exec.execute import execute_scenario

    sc = tiny(workload={"gen_len": 2})
    runs = [simulate_scenario(tiny(schedule=s, workload={"gen_len": 2})).trace_run(f"{s} sim")
            for s in ("S1", "S2", "S3", "S4")]
    runs.append(execute_scenario(sc, "S1", "cpu", profile=True).trace_run("S1 measured"))
    assert any(op.cat == "cpu_op" for op in runs[-1].ops)
    n_json = write_trace(tmp_path / "t.json", runs, Window(None))
    n_proto = write_trace(tmp_path / "t.pftrace", runs, Window(None))
    as_json, as_proto = load_trace(tmp_path / "t.json"), load_trace(tmp_path / "t.pftrace")
    assert check_trace(as_proto) == [] and check_trace(as_json) == []
    assert n_json == n_proto
    for what, a, b in zip(("tracks", "slices", "counters", "flows"),
                          _events_by_kind(as_json), _events_by_kind(as_proto)):
        assert a == b, what
        assert len(a) > 0, what


def test_the_checker_reads_protobuf_traces(tmp_path, capsys):
    """Overlapping slices are found in a .pftrace as in a .json; bytes that are no trace are a
    read error (exit 2), not a crash."""
    pytest.importorskip("perfetto")
    from taskgraph.tracing.check import main as check_main

    sim = simulate_scenario(tiny())
    run = sim.trace_run()
    gpu = np.flatnonzero(sim.program.column("stream") == 0)
    run.end = run.end.copy()
    run.end[gpu[0]] = run.start[gpu[1]] + (run.end[gpu[1]] - run.start[gpu[1]]) / 2
    for name in ("bad.json", "bad.pftrace"):
        write_trace(tmp_path / name, [run], Window(None))
        assert any("overlap" in p for p in check_trace(load_trace(tmp_path / name))), name
    (tmp_path / "junk.pftrace").write_bytes(b"\xff\xff\xff not a trace")
    assert check_main([str(tmp_path / "junk.pftrace")]) == 2
    assert "cannot be read as a trace" in capsys.readouterr().err


def test_pftrace_from_the_cli_and_without_the_package(tmp_path, capsys, monkeypatch):
    pytest.importorskip("perfetto")
    path = tmp_path / "run.pftrace"
    assert main(["simulate", "scenarios/tiny.yaml", "--trace", str(path)]) == 0
    assert check_trace(load_trace(path)) == []
    assert "wrote" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "perfetto", None)          # as if it were not installed
    other = tmp_path / "other.pftrace"
    assert main(["simulate", "scenarios/tiny.yaml", "--trace", str(other)]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[perfetto]'" in err and "Traceback" not in err
    assert not other.exists()
