"""The executor (CPU backend) against the sequential reference: every schedule, several
policies, random delays, and a graph with a buffer-reuse edge removed."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from taskgraph.dag import builder  # noqa: E402
from taskgraph.dag.builder import make_plan  # noqa: E402
from taskgraph.dag.compiled import compile_plan  # noqa: E402
from taskgraph.exec.dispatch import execute  # noqa: E402
from taskgraph.exec.runtime import Runtime  # noqa: E402
from taskgraph.kernels.reference import reference_forward, synthetic_prompts  # noqa: E402
from taskgraph.kernels.weights import synthetic_weights  # noqa: E402
from tests.helpers import tiny  # noqa: E402

POLICIES = [
    # (schedule, N, mu, r_w, r_c)
    ("S1", 8, 2, 0.0, 0.0),      # 4 micro-batches
    ("S1", 6, 2, 0.3, 0.0),      # odd count, part of the weights resident
    ("S2", 4, 2, 0.0, 0.0),      # 2 micro-batches (CGOPipe-style lookahead wraps layers)
    ("S3", 3, 3, 0.0, 0.0),      # one micro-batch
    ("S3", 10, 2, 0.6, 0.0),
    ("S4", 6, 2, 0.0, 0.5),      # GPU attention, half the KV resident
    ("S4", 3, 3, 0.25, 0.0),
    ("DS", 4, 4, 0.0, 1.0),      # one micro-batch, the whole KV cache on the GPU, every
    ("DS", 3, 3, 0.0, 1.0),      # weight streamed (ZeRO-Inference offloads them all)
    ("S5", 6, 2, 0.0, 0.0),      # the experts on the CPU
    ("S5", 4, 2, 0.5, 0.5),
]


def _run(schedule, N, mu, r_w, r_c, steps=3, delay=None, model=None, zero_copy=False):
    sc = tiny(schedule=schedule, policy={"N": N, "mu": mu, "r_w": r_w, "r_c": r_c},
              workload={"prompt_len": 6, "gen_len": steps},
              **({"model": model} if model else {}))
    plan = make_plan(sc, schedule)
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(N, 6, sc.model.V, seed=2)
    runtime = Runtime(plan, w, prompts, torch.device("cpu"), zero_copy=zero_copy)
    run = execute(compile_plan(plan), runtime, delay=delay)
    return run, runtime, reference_forward(w, prompts, mu, steps)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["emulating", "zero-copy"])
@pytest.mark.parametrize("schedule,N,mu,r_w,r_c", POLICIES)
def test_every_schedule_computes_what_the_reference_computes(schedule, N, mu, r_w, r_c,
                                                             zero_copy):
    run, rt, ref = _run(schedule, N, mu, r_w, r_c, zero_copy=zero_copy)
    assert not run.interrupted and run.finished.all()
    tokens, logits, hidden = rt.outputs()
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule,N,mu,r_c", [("S1", 8, 2, 0.0), ("S2", 8, 2, 0.0),
                                               ("S4", 8, 2, 0.0), ("DS", 4, 4, 1.0),
                                               ("S5", 8, 2, 0.0)])
def test_random_delays_do_not_change_the_numbers(schedule, N, mu, r_c):
    rng = random.Random(7)
    delays = {}

    def delay(gid):
        return delays.setdefault(gid, rng.random() * 0.003)

    run, rt, ref = _run(schedule, N, mu, 0.0, r_c, steps=2, delay=delay)
    tokens, logits, _ = rt.outputs()
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["emulating", "zero-copy"])
def test_zero_copy_keeps_the_graph_and_one_thread_per_stream(monkeypatch, zero_copy):
    """Zero copy: no device weight buffers, transfers still run (as no-ops) and are timed. In
    both modes every stream's ops run on one intra-op thread (the layout measured fastest)."""
    seen: dict[str, set[int]] = {}
    real_run = Runtime.run

    def spy(self, step, kind, layer, index, gpu=-1):
        seen.setdefault(kind, set()).add(torch.get_num_threads())
        real_run(self, step, kind, layer, index, gpu)

    monkeypatch.setattr(Runtime, "run", spy)
    run, rt, ref = _run("S1", 4, 2, 0.0, 0.0, steps=2, zero_copy=zero_copy)
    assert run.finished.all() and torch.equal(rt.outputs()[0], ref.tokens)
    assert {"D1", "D2", "D3", "W_CtoPin"} <= seen.keys()       # transfers still scheduled
    assert (rt.halves[0].numel() == 0) == zero_copy
    assert seen["PostAttn"] == seen["CPUAttn"] == seen["D3"] == {1}


def test_without_the_weight_reuse_edges_the_check_fails(monkeypatch):
    """The double-buffer edges are what keep a page copy from overwriting weights a PostAttn is
    still to read: drop them, slow the readers down, and the result is wrong."""
    original = builder._rings

    def no_weight_ring(plan):
        rings, readers = original(plan)
        keep = [r for r in rings if r.name != "weights"]
        return keep, {k: [(r, f) for r, f in v if r.name != "weights"]
                      for k, v in readers.items()}

    monkeypatch.setattr(builder, "_rings", no_weight_ring)
    kinds = {}

    def slow_readers(gid):
        return 0.02 if kinds.get(gid) == "PostAttn" else 0.0

    sc = tiny(policy={"N": 8, "mu": 2, "r_w": 0.0, "r_c": 0.0},
              workload={"prompt_len": 6, "gen_len": 2})
    plan = make_plan(sc, "S2")
    program = compile_plan(plan)
    from taskgraph.kinds import KIND_NAMES
    kinds.update({g: KIND_NAMES[k] for g, k in enumerate(program.column("kind"))})
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(8, 6, sc.model.V, seed=2)
    rt = Runtime(plan, w, prompts, torch.device("cpu"))
    execute(program, rt, delay=slow_readers)
    ref = reference_forward(w, prompts, 2, 2)
    assert not torch.allclose(rt.outputs()[1], ref.logits, rtol=1e-3, atol=1e-3)


def test_execute_cli_json_and_trace(tmp_path, capsys):
    import json

    from taskgraph.cli import main
    from taskgraph.tracing.check import check_trace, load_trace

    trace = tmp_path / "exec.json.gz"
    assert main(["execute", "scenarios/tiny.yaml", "--device", "cpu", "--steps", "2", "--json",
                 "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["measured"] and out["tokens_match"]
    assert out["max_abs_err"] < 1e-4 and out["steps"] == 2     # fp32 tolerance
    assert {"throughput_tok_s", "prefill_s", "decode_s", "overlap_s", "decode_layer_ms",
            "utilization", "tasks", "wall_s", "policy"} <= out.keys()
    # The phases of a measured run, by the definitions simulated runs use.
    assert out["prefill_s"] + out["decode_s"] == pytest.approx(out["makespan_s"], rel=1e-4)
    assert out["decode_layer_ms"] >= out["hrm_layer_ms"] > 0
    loaded = load_trace(trace)
    assert check_trace(loaded) == []
    names = {e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "process_name"}
    assert names == {"1. measured"}
    assert main(["execute", "scenarios/tiny.yaml", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_weights_from_a_mixtral_checkpoint(tmp_path):
    pytest.importorskip("safetensors")
    from taskgraph.kernels.weights import load_safetensors, save_mixtral_safetensors
    from taskgraph.scenario import load_scenario

    sc = tiny()
    w = synthetic_weights(sc.model, seed=3)
    folder = save_mixtral_safetensors(w, tmp_path / "ckpt")
    back = load_safetensors(folder, sc.model)
    assert all(torch.equal(a, b) for a, b in zip(w.layers, back.layers))
    assert torch.equal(w.lm_head, back.lm_head)
    # the checkpoint's config.json is a valid model for a scenario
    scen = tmp_path / "s.yaml"
    scen.write_text(f"model: {{hf_config: {folder / 'config.json'}}}\nhardware: t4\n"
                    "workload: {prompt_len: 4, gen_len: 1}\npolicy: {N: 4, mu: 2}\n")
    assert load_scenario(scen).model.h == sc.model.h
    with pytest.raises(Exception, match="shape"):
        load_safetensors(folder, sc.model.model_copy(update={"h_i": 64}))


def test_a_failing_task_stops_the_run_and_keeps_what_ran():
    sc = tiny(workload={"prompt_len": 6, "gen_len": 2})
    plan = make_plan(sc)
    program = compile_plan(plan)
    w = synthetic_weights(sc.model)
    rt = Runtime(plan, w, synthetic_prompts(8, 6, sc.model.V), torch.device("cpu"))
    original = rt.run

    def boom(step, kind, layer, index, gpu=-1):
        if (step, kind, layer) == (1, "PostAttn", 2):
            raise RuntimeError("CUDA out of memory (simulated)")
        original(step, kind, layer, index, gpu)

    rt.run = boom
    run = execute(program, rt)
    assert run.interrupted and "out of memory" in str(run.failure)
    assert 0 < run.finished.sum() < program.total


def test_a_failure_is_reported_while_another_stream_is_stuck():
    """A stream blocked in a call nothing interrupts (a receive from a peer process that waits
    for this one) must not hold back the report of another stream's failure."""
    import threading
    import time

    sc = tiny(workload={"prompt_len": 6, "gen_len": 2})
    plan = make_plan(sc)
    rt = Runtime(plan, synthetic_weights(sc.model), synthetic_prompts(8, 6, sc.model.V),
                 torch.device("cpu"))
    original, never, waited = rt.run, threading.Event(), threading.Event()

    def stuck(step, kind, layer, index, gpu=-1):
        if (step, kind, layer, index) == (1, "CPUAttn", 0, 0):
            never.wait(60)
            waited.set()
        if (step, kind, layer, index) == (1, "PreAttn", 0, 1):
            time.sleep(0.2)
            raise RuntimeError("a kernel failed")
        original(step, kind, layer, index, gpu)

    rt.run = stuck
    run = execute(compile_plan(plan), rt)
    # the run ended on the failure while the stuck task still waited: it did not wait for it
    assert "a kernel failed" in str(run.failure) and not waited.is_set()
    never.set()


def test_a_model_too_big_for_this_machine_gets_a_clear_error(capsys, monkeypatch):
    import os

    from taskgraph.cli import main

    # 4 GB free, whatever this machine has: on a host with the memory, the run would start.
    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 1 << 20}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert main(["execute", "scenarios/t4.yaml", "--device", "cpu"]) == 2
    assert "of KV cache and weights" in capsys.readouterr().err


def test_profiled_ops_sit_inside_their_tasks(tmp_path):
    """`tg execute --profile`: the PyTorch profiler's marks of each task line up with the task's
    slice on the same clock, and every aten op of a stream thread lies inside one of its marks."""
    from taskgraph.cli import main
    from taskgraph.tracing.writer import STREAM_TRACKS
    from taskgraph.tracing.check import check_trace, load_trace

    trace = tmp_path / "p.json"
    assert main(["execute", "scenarios/tiny.yaml", "--device", "cpu", "--profile",
                 "--trace", str(trace), "--trace-steps", "all", "--json"]) == 0
    doc = load_trace(trace)
    assert check_trace(doc) == []
    events = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("name") == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X"]
    tasks = {(names[e["pid"], e["tid"]], e["args"]["task"]): e for e in slices
             if "task" in e.get("args", {})}
    marks = [e for e in slices if e.get("cat") == "user_annotation"]
    ops = [e for e in slices if e.get("cat") == "cpu_op"
           and names[e["pid"], e["tid"]].startswith("torch: ")]
    assert len(marks) == len(tasks) and len(ops) > len(marks)
    tol = 50.0      # µs: the profiler's clock is placed by one mark at the run's origin
    for m in marks:
        stream, task = m["name"].split(": ", 1)
        t = tasks[STREAM_TRACKS[stream], task]
        assert t["ts"] - tol <= m["ts"] and m["ts"] + m["dur"] <= t["ts"] + t["dur"] + tol, m
    by_track: dict = {}
    for m in marks:
        by_track.setdefault(m["tid"], []).append((m["ts"], m["ts"] + m["dur"]))
    for op in ops:
        spans = by_track.get(op["tid"], [])
        assert any(a <= op["ts"] and op["ts"] + op["dur"] <= b for a, b in spans), op


def test_profile_needs_a_trace(capsys):
    from taskgraph.cli import main

    assert main(["execute", "scenarios/tiny.yaml", "--device", "cpu", "--profile"]) == 2
    assert "--profile" in capsys.readouterr().err


@pytest.mark.parametrize("schedule,gpus", [("S1", 1), ("S3", 1), ("S4", 1), ("S1", 2)])
def test_micro_batches_past_their_last_step_are_skipped(schedule, gpus):
    """As the simulator prices them: a micro-batch whose requests have all finished does no
    work in later steps (its LM head writes no token), one that holds none does nothing at all,
    and the others compute exactly what the reference computes (on two GPUs, the shards and
    collectives alike)."""
    from taskgraph.exec.tensor import TensorParallel

    steps = 3
    sc = tiny(schedule=schedule, policy={"N": 6, "mu": 2, "r_w": 0.0, "r_c": 0.0},
              workload={"prompt_len": 6, "gen_len": steps},
              hardware={"preset": "t4", "gpu": {"count": gpus}})
    plan = make_plan(sc, schedule)
    w = synthetic_weights(sc.model, seed=1)
    prompts = synthetic_prompts(6, 6, sc.model.V, seed=2)
    last = [1, steps, -1]
    rt = (TensorParallel if gpus > 1 else Runtime)(plan, w, prompts, torch.device("cpu"),
                                                  last_steps=last)
    run = execute(compile_plan(plan), rt)
    assert run.finished.all() and run.failure is None
    tokens = rt.outputs()[0]
    ref = reference_forward(w, prompts, 2, steps)
    assert torch.equal(tokens[0:2, :2], ref.tokens[0:2, :2])
    assert (tokens[0:2, 2:] == 0).all()
    assert torch.equal(tokens[2:4], ref.tokens[2:4])
    assert (tokens[4:6] == 0).all()


def test_a_termination_stops_every_stream_before_the_process_exits():
    """SIGTERM during `tg execute --prompts` of 2,000 prompts aborted the process ("terminate
    called without an active exception", rc -6): the exit raised in the main thread left the
    stream threads inside torch ops. Now they are stopped and waited for first."""
    import os
    import signal
    import threading

    from taskgraph.files import Terminated, exit_on_termination

    sent = threading.Event()

    def terminate_once(gid):              # from a stream's thread, as the signal would come
        if not sent.is_set():
            sent.set()
            os.kill(os.getpid(), signal.SIGTERM)
        return 0.001

    with exit_on_termination(), pytest.raises(Terminated) as end:
        _run("S1", 8, 2, 0.0, 0.0, steps=20, delay=terminate_once)
    assert end.value.code == 128 + signal.SIGTERM and end.value.signal_name == "SIGTERM"
    assert not [t for t in threading.enumerate() if t.name.startswith("tg-")]
