"""FlexGen's pipeline parallelism (schedule PP): each GPU runs a stage of consecutive layers, the
batch is split into one group of micro-batches per stage, every group reloads the stage's
weights, and hidden states cross between stages in sends on the interconnect.

References: S4's one-GPU graph (PP is S4's order, so on one GPU it must be S4 exactly, and on
several every task's work must be S4's), FlexGen's dist_flex_opt.py for the stage split and the
per-group weight reload, and the sequential reference for what the executor computes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest

from taskgraph.dag.builder import build_segment, launch_sequence, make_plan
from taskgraph.cli import main
from taskgraph.dag.compiled import compile_plan
from taskgraph.errors import ScheduleError
from taskgraph.kinds import SENDS, SHARDED
from taskgraph.sim.simulate import simulate_scenario
from tests.helpers import tiny, unrolled_edges, wait_for


def _pp(gpus: int, **sections):
    hw = {"preset": "t4", "gpu": {"count": gpus}}
    hw.update(sections.pop("hardware", {}))
    return tiny(schedule="PP", policy={"N": 8, "mu": 2, "A_g": 1, **sections.pop("policy", {})},
                hardware=hw, **sections)


def _own(g: nx.DiGraph) -> dict:
    return {n: a for n, a in g.nodes(data=True) if not a["external"]}


def _base(name: str) -> str:
    return name.split(",g")[0] + "]" if ",g" in name else name


def test_on_one_gpu_pp_is_s4():
    s4 = tiny(schedule="S4", policy={"A_g": 1})
    pp = _pp(1)
    for d in (0, 1, 2):
        a, b = build_segment(make_plan(s4), d), build_segment(make_plan(pp), d)
        assert dict(a.nodes(data=True)) == dict(b.nodes(data=True))
        assert set(a.edges) == set(b.edges)


@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_stages_hold_consecutive_layers_and_meet_only_through_sends(gpus):
    plan = make_plan(_pp(gpus, policy={"N": 2 * gpus * 2}))
    L = plan.L
    # FlexGen's split: L // n layers each, the first L % n stages one more
    sizes = [len(r) for r in plan.stages]
    assert sum(sizes) == L and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)[::-1]
    for d in (0, 1, 2):
        g = build_segment(plan, d)
        a = dict(g.nodes(data=True))
        sends = 0
        for name, attrs in a.items():
            if attrs["kind"] in SHARDED:
                assert attrs["gpu"] == plan.stage_of(attrs["layer"])
                assert attrs["stream"].endswith(f":{attrs['gpu']}")
        for src, dst in g.edges:
            s, t = a[src], a[dst]
            if s["kind"] in SHARDED and t["kind"] in SHARDED:
                assert s["gpu"] == t["gpu"], (src, dst)      # stages meet only in sends
            if s["kind"] in SENDS:
                sends += 1
                assert t["gpu"] == (s["gpu"] + 1) % gpus      # to the next stage, last to first
                assert s["kind"] == ("SendTokens" if s["gpu"] == gpus - 1 else "Send")
        assert sends


@pytest.mark.parametrize("gpus", [2, 4])
def test_every_task_does_s4s_work_and_each_group_reloads_the_stage_weights(gpus):
    s4 = make_plan(tiny(schedule="S4", policy={"A_g": 1}))
    pp = make_plan(_pp(gpus))
    for d in (1, 2):
        one = _own(build_segment(s4, d))
        many = _own(build_segment(pp, d))
        loads = [a for a in many.values() if a["kind"] == "D3"]
        # one load of each layer per group (FlexGen's load_weight runs per inner iteration)
        assert len(loads) == pp.L * gpus
        assert sum(a["bytes"] for a in loads) == pytest.approx(
            gpus * sum(a["bytes"] for a in one.values() if a["kind"] == "D3"))
        for stage, layers in enumerate(pp.stages):
            on = [a for a in loads if a["stream"] == f"h2d:{stage}"]
            assert sorted({a["layer"] for a in on}) == list(layers)
        for name, a in many.items():
            if a["kind"] in SENDS or a["kind"] == "D3":
                continue
            whole = one[_base(name)]
            for field in ("flops", "flops_per_ctx", "bytes", "bytes_per_ctx"):
                assert a[field] == whole[field], (name, field)


def _decode_s(sc, schedule):
    return simulate_scenario(sc, schedule).summary["decode_s"]


def test_streaming_bound_pp_gains_nothing_from_a_second_gpu_while_tp_halves():
    """The mechanism the MoE-Lightning paper blames for FlexGen's poor multi-GPU scaling: with
    weights streamed, every group reloads its stage's layers, so each GPU's link carries as many
    bytes per step as one GPU's does, while tensor parallelism splits them."""
    slow_link = {"link": {"h2d_gbps": 0.05, "latency_us": 0.0},
                 "gpu": {"task_overhead_us": 0.0}, "handoff_us": 0.0}

    def on(gpus, schedule):
        hw = {"preset": "t4", **slow_link, "gpu": {"count": gpus, "task_overhead_us": 0.0}}
        # the KV cache stays on the GPU: only weights cross the links
        return tiny(schedule=schedule, policy={"A_g": 1, "r_w": 0.0, "r_c": 1.0},
                    workload={"gen_len": 8}, hardware=hw)

    one = _decode_s(on(1, "S4"), "S4")
    assert _decode_s(on(1, "PP"), "PP") == pytest.approx(one, rel=1e-9)
    pp2 = _decode_s(on(2, "PP"), "PP")
    tp2 = _decode_s(on(2, "S4"), "S4")
    assert pp2 == pytest.approx(one, rel=0.05)
    assert tp2 == pytest.approx(one / 2, rel=0.05)


def test_with_everything_resident_the_stages_run_in_parallel():
    """No weights to stream: the groups keep every stage busy, so two GPUs take about half the
    time of one (less the pipeline's fill)."""
    fast = {"gpu": {"task_overhead_us": 0.0, "tflops": 0.05}, "handoff_us": 0.0,
            "interconnect": {"gbps": 1000.0, "eff": 1.0, "latency_us": 0.0}}

    def on(gpus, schedule):
        hw = {"preset": "t4", **fast, "gpu": {**fast["gpu"], "count": gpus}}
        return tiny(schedule=schedule, policy={"A_g": 1, "r_w": 1.0, "r_c": 1.0},
                    workload={"gen_len": 16}, hardware=hw)

    one = _decode_s(on(1, "PP"), "PP")
    two = _decode_s(on(2, "PP"), "PP")
    assert 0.5 * one <= two <= 0.6 * one


def test_bad_pipeline_policies_get_clear_errors():
    with pytest.raises(ScheduleError, match=r"multiple of hardware.gpu.count = 2"):
        make_plan(_pp(2, policy={"N": 6}))
    with pytest.raises(ScheduleError, match=r"model.L = 4 is fewer than hardware.gpu.count = 8"):
        make_plan(_pp(8, policy={"N": 16}))


def test_cli_rounds_an_unpinned_batch_to_whole_groups_and_refuses_a_pinned_one(capsys):
    # tiny.yaml: N=8, mu=2 -> 4 micro-batches; 3 GPUs need a multiple of 3
    assert main(["simulate", "scenarios/tiny.yaml", "--schedule", "PP", "--json",
                 "--set", "hardware.gpu.count=3"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"]["N"] == 6
    assert main(["simulate", "scenarios/tiny.yaml", "--schedule", "PP",
                 "--set", "hardware.gpu.count=3", "--set", "policy.N=8"]) == 2
    err = capsys.readouterr().err
    assert "multiple of hardware.gpu.count = 3" in err and err.count("\n") == 1


def test_the_launch_order_runs_each_group_through_every_layer(gpus=2):
    plan = make_plan(_pp(gpus))
    order = [(k.layer, plan.group_of(k.index)) for k in launch_sequence(plan, 1)
             if k.kind == "PostAttn"]
    groups = [grp for _, grp in order]
    assert groups == sorted(groups)              # group 0 through all layers, then group 1
    assert [layer for layer, grp in order if grp == 0] == sorted(
        layer for layer, grp in order if grp == 0)


def test_compare_offers_pp_on_several_gpus_only(capsys):
    assert main(["compare", "scenarios/tiny.yaml", "--json"]) == 0
    one = [r["schedule"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert "PP" not in one and "S4" in one
    assert main(["compare", "scenarios/tiny.yaml", "--json",
                 "--set", "hardware.gpu.count=2"]) == 0
    two = [r["schedule"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert "PP" in two and "S5" not in two


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("gpus,N,r_w,r_c", [(2, 8, 0.0, 0.0), (2, 4, 0.4, 0.5), (4, 8, 0.0, 0.0)])
def test_the_executor_runs_the_stages_and_computes_the_reference(gpus, N, r_w, r_c):
    from taskgraph.dag.compiled import compile_plan
    from taskgraph.exec.dispatch import execute
    from taskgraph.exec.runtime import Runtime
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights

    sc = _pp(gpus, policy={"N": N, "mu": 2, "r_w": r_w, "r_c": r_c},
             workload={"prompt_len": 6, "gen_len": 3})
    plan = make_plan(sc)
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(N, 6, sc.model.V, seed=2)
    rng = random.Random(gpus * 10 + N)
    delays: dict[int, float] = {}
    runtime = Runtime(plan, w, prompts, torch.device("cpu"))
    run = execute(compile_plan(plan), runtime,
                  delay=lambda gid: delays.setdefault(gid, rng.random() * 0.002))
    assert not run.interrupted and run.finished.all()
    ref = reference_forward(w, prompts, 2, 3)
    tokens, logits, hidden = runtime.outputs()
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gpus,N,r_w,r_c", [(2, 8, 0.0, 0.0), (4, 8, 0.3, 0.5)])
def test_one_process_per_stage_over_gloo_computes_the_reference(gpus, N, r_w, r_c):
    """torch.distributed (gloo, CPU): each stage a process of its own, hidden states and tokens
    crossing as messages, random delays; the tokens are the sequential reference's."""
    from taskgraph.exec.distributed import execute_processes
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights

    sc = _pp(gpus, policy={"N": N, "mu": 2, "r_w": r_w, "r_c": r_c},
             workload={"prompt_len": 6, "gen_len": 3})
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(N, 6, sc.model.V, seed=2)
    run = execute_processes(make_plan(sc), w, prompts, delay_s=0.002, seed=gpus)
    ref = reference_forward(w, prompts, 2, 3)
    assert torch.equal(run.tokens, ref.tokens)
    torch.testing.assert_close(run.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run.hidden, ref.hidden, rtol=1e-5, atol=1e-5)
    # every task ran, each after its predecessors on the same clock
    assert not np.isnan(run.end).any()
    program = compile_plan(make_plan(sc))
    edges = unrolled_edges(program)
    assert (run.start[edges[:, 1]] >= run.end[edges[:, 0]] - 1e-6).all()


def test_execute_processes_cli_checks_tokens_and_writes_a_valid_trace(tmp_path, capsys):
    from taskgraph.tracing.check import check_trace, load_trace

    trace = tmp_path / "pp.json.gz"
    assert main(["execute", "scenarios/tiny.yaml", "--schedule", "PP", "--processes", "--json",
                 "--set", "hardware.gpu.count=2", "--steps", "2", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_match"] and out["max_abs_err"] < 1e-4
    assert out["decode_layer_ms"] >= out["hrm_layer_ms"] > 0
    assert check_trace(load_trace(trace)) == []
    # no stages to split, or a combination the processes cannot run: one clear line, exit 2
    for argv in (["--processes"],
                 ["--schedule", "PP", "--set", "hardware.gpu.count=2", "--processes",
                  "--zero-copy"]):
        assert main(["execute", "scenarios/tiny.yaml", *argv]) == 2
        err = capsys.readouterr().err
        assert "--processes" in err and err.count("\n") == 1


def test_a_failing_process_is_named_with_its_own_error():
    """The rank that fails first is reported with its error, not the broken connection its
    peer sees afterwards."""
    from taskgraph.errors import TgError
    from taskgraph.exec.distributed import execute_processes
    from taskgraph.kernels.reference import synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights

    sc = _pp(2)
    w = synthetic_weights(sc.model, seed=1)
    w.layers[3] = w.layers[3][:10]          # stage 1's last layer, truncated
    with pytest.raises(TgError, match=r"GPU 1 of 2 failed: RuntimeError: The size of tensor"):
        execute_processes(make_plan(sc), w, synthetic_prompts(8, 16, sc.model.V, seed=2))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_under_processes_leaves_a_valid_trace_of_what_ran(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) during a multi-process run: exit 130,
    the figures and a valid trace cover the tasks that ran, no traceback."""
    from taskgraph.scenario import load_scenario
    from taskgraph.tracing.check import check_trace

    trace = tmp_path / "run.json"
    overrides = ["hardware.gpu.count=2", "workload.gen_len=400"]
    total = compile_plan(make_plan(load_scenario("scenarios/small.yaml", overrides))).total
    env = {**os.environ, "TMPDIR": str(tmp_path)}     # to see when the ranks have met
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskgraph.cli", "execute", "scenarios/small.yaml",
         *(a for o in overrides for a in ("--set", o)), "--processes", "--trace", str(trace),
         "--trace-steps", "all", "--json"],
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)
    def segments() -> list[int]:
        """The segment each rank's first stream has entered (1: its prefill tasks have run)."""
        out = []
        for f in tmp_path.glob("tg-dist-*/rank*.segment"):
            try:
                out.append(int(f.read_text()))
            except (OSError, ValueError):      # the run's folder went away
                pass
        return out

    def past_prefill() -> bool:
        assert proc.poll() is None, "the run ended before the test could interrupt it"
        got = segments()
        return len(got) == 2 and min(got) >= 1

    wait_for(past_prefill, what="both ranks past their prefill")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, err
    summary = json.loads(out)
    assert summary["interrupted"]
    ran = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert 0 < len(ran) == summary["tasks"] < total
    assert not check_trace(json.loads(trace.read_text()))


def test_processes_on_cuda_need_a_gpu_for_each_process(monkeypatch):
    from taskgraph.errors import TgError
    from taskgraph.exec.distributed import execute_processes
    from taskgraph.kernels.reference import synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights

    sc = _pp(2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(TgError, match="hardware.gpu.count is 2, but this machine has 1 CUDA"):
        execute_processes(make_plan(sc), synthetic_weights(sc.model), synthetic_prompts(8, 16,
                          sc.model.V), device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs")
@pytest.mark.parametrize("schedule", ["PP", "S1", "S4"])
def test_one_process_per_gpu_over_nccl_computes_the_reference(schedule):
    """Each GPU of the plan a process on a CUDA device of its own, messages and collectives
    over NCCL: the tokens are the sequential reference's (float32 weights)."""
    from taskgraph.exec.distributed import execute_processes
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import synthetic_weights

    sc = _pp(2, workload={"prompt_len": 6, "gen_len": 3}).model_copy(
        update={"schedule": schedule})
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(8, 6, sc.model.V, seed=2)
    run = execute_processes(make_plan(sc), w, prompts, delay_s=0.002, device="cuda")
    ref = reference_forward(w, prompts, 2, 3)
    assert torch.equal(run.tokens, ref.tokens)
    torch.testing.assert_close(run.logits, ref.logits, rtol=1e-4, atol=1e-4)
    assert not np.isnan(run.end).any()
