"""Traces (Perfetto rules, content, interrupted runs) and the CLI's JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest

from taskgraph.cli import main
from taskgraph.compiled import compile_plan
from taskgraph.builder import make_plan
from taskgraph.cost import CostModel
from taskgraph.memory import memory_footprint
from taskgraph.sim.engine import simulate
from taskgraph.sim.metrics import summarize
from taskgraph.simulation import simulate_scenario
from taskgraph.trace import TraceRun, Window, write_trace
from taskgraph.tracecheck import check_trace, load_trace
from tests.helpers import tiny

CONTRACT = {"scenario", "schedule", "policy", "throughput_tok_s", "prefill_s", "decode_s",
            "decode_layer_ms", "hrm_layer_ms", "utilization", "memory", "tasks", "wall_s"}


@pytest.mark.parametrize("schedule", ["S1", "S2", "S3", "S4"])
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


def test_the_simulator_does_not_import_torch():
    code = ("import sys, taskgraph.cli, taskgraph.simulation, taskgraph.trace; "
            "from taskgraph.cli import main; main(['simulate', 'scenarios/tiny.yaml', '--json']);"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_multi_gpu_aggregates_and_splits_memory():
    one = simulate_scenario(tiny(hardware="t4")).summary
    four = simulate_scenario(tiny(hardware="4xt4")).summary
    assert four["memory"]["gpu_peak_gb"] == pytest.approx(one["memory"]["gpu_peak_gb"] / 4, rel=1e-5)
    assert four["decode_layer_ms"] < one["decode_layer_ms"]
    assert np.isfinite(four["throughput_tok_s"])


def test_gantt_chart(tmp_path, capsys):
    out = tmp_path / "g.png"
    assert main(["compare", "scenarios/tiny.yaml", "--schedules", "S1,S3", "--gantt", str(out),
                 "--json"]) == 0
    assert out.stat().st_size > 10_000
    capsys.readouterr()
    assert main(["simulate", "scenarios/tiny.yaml", "--gantt", str(tmp_path / "g.svg")]) == 2
    assert ".png" in capsys.readouterr().err
