"""Long runs in bounded memory: the engine decides a run block by block in a ring of task slots,
and a run too long to hold whole keeps its figures and the task times of the steps asked for.
Each is checked against the same run held whole."""

from __future__ import annotations

import json

import numpy as np
import pytest

import taskgraph
import taskgraph.sim.simulate as simulation
from taskgraph.sim import engine
from taskgraph.dag.builder import make_plan
from taskgraph.dag.compiled import Program, Template, compile_plan
from taskgraph.perf.cost import cost_model
from taskgraph.errors import ScheduleError, TgError
from taskgraph.scenario import load_scenario
TINY = "scenarios/tiny.yaml"

CASES = [(s, []) for s in ("S1", "S2", "S3", "S4", "S5", "DS", "PP")] + [
    ("S1", ["hardware.gpu.count=2"]),            # tensor parallel: per-GPU streams
    ("PP", ["hardware.gpu.count=2"]),            # a pipeline's stages run steps apart
    ("S4", ["hardware.gpu.count=2"]),            # two streams share each link
]


def _program(schedule, sets, gen_len=40):
    sc = load_scenario(TINY, [f"schedule={schedule}", f"workload.gen_len={gen_len}", *sets])
    plan = make_plan(sc)
    return compile_plan(plan), cost_model(sc, plan.schedule.name)


@pytest.mark.parametrize("schedule, sets", CASES, ids=[f"{s}{'x2' if x else ''}"
                                                        for s, x in CASES])
def test_a_run_decided_in_a_small_ring_is_the_run_held_whole(monkeypatch, schedule, sets):
    """Blocks of the fewest segments a dependency allows, so the ring wraps many times: every
    task starts and ends exactly when it does with a slot for every task. A ring too short for
    how far a stream lags is found before any slot is reused, and a longer one tried."""
    program, cost = _program(schedule, sets)

    def run(blocks):
        window = engine._Window(program, lambda part: part.durations(cost),
                                engine.Recorder(program), blocks)
        return window, engine._run(program, cost, None, window, 0.0)

    _, whole = run(0)
    monkeypatch.setattr(engine, "_BLOCK_TASKS", 1)
    wrapped = 0
    for blocks in engine._RING_BLOCKS[:-1]:
        try:
            window, ring = run(blocks)
        except engine._Lagging:
            continue
        assert np.array_equal(ring.start, whole.start) and np.array_equal(ring.end, whole.end)
        wrapped += window.mask + 1 < program.total
    assert wrapped


def test_reusing_slots_while_a_stream_lags_would_change_the_run(monkeypatch):
    """The lag check matters: a ring of one block cannot be reused while any stream is still in
    it; without the check, slots are reset while streams still read them, and the run comes out
    different (or deadlocks)."""
    program, cost = _program("S1", [])
    whole = engine.simulate(program, cost)
    monkeypatch.setattr(engine, "_BLOCK_TASKS", 1)

    def window():
        return engine._Window(program, lambda part: part.durations(cost),
                              engine.Recorder(program), 1)

    with pytest.raises(engine._Lagging):
        engine._run(program, cost, None, window(), 0.0)
    unchecked = window()
    unchecked.lag = len(unchecked.bounds)
    try:
        ring = engine._run(program, cost, None, unchecked, 0.0)
    except ScheduleError:       # a deadlock: also a different run
        return
    assert not (np.array_equal(ring.start, whole.start) and np.array_equal(ring.end, whole.end))


def test_a_stream_idle_for_a_ring_of_blocks_starts_after_its_last_task(monkeypatch):
    """A stream with no task for longer than the ring (a made-up program: two streams, the
    second busy alone for four segments) must not read its last task's end from a slot that
    has been reused since."""
    program, cost = _program("S1", [], gen_len=4)
    streams = len(program.streams)

    def template(owners):
        n, zero, none = len(owners), np.zeros(len(owners), np.int64), np.zeros(len(owners))
        by_stream = [[(pos, ()) for pos, s in enumerate(owners) if s == sid]
                     for sid in range(streams)]
        return Template(build=None, kind=zero, stream=np.array(owners), resource=zero,
                        step_rel=zero, layer=zero, index=zero, flops=none, flops_per_ctx=none,
                        nbytes=none, bytes_per_ctx=none, deps=[()] * n, by_stream=by_stream)

    seg_template = np.array([0, 1, 1, 1, 1, 0])
    made = Program(program.plan, program.streams, [template([0, 1]), template([1, 1])],
                   seg_template, np.arange(0, 12, 2), 12)
    durations = np.ones(12)
    durations[0] = 100.0                       # stream 0's first task ends long after
    held = engine._run(made, cost, None, engine._Window(made, durations, engine.Recorder(made),
                                                        0), 0.0)
    assert held.start[10] == 100.0             # stream 0's second task, after its first
    monkeypatch.setattr(engine, "_BLOCK_TASKS", 1)
    ring = engine.simulate(made, cost, durations=durations)
    assert np.array_equal(ring.start, held.start) and np.array_equal(ring.end, held.end)


def _simulate(sets, hold, monkeypatch, keep=2):
    monkeypatch.setattr(simulation, "HOLD_TASKS", hold)
    monkeypatch.setattr(engine, "_BLOCK_TASKS", 500)       # many blocks, even on tiny
    return simulation.simulate_scenario(load_scenario(TINY, sets), keep_steps=keep)


@pytest.mark.parametrize("sets", [["workload.gen_len=300"],
                                  ["workload.gen_len=300", "schedule=S4",
                                   "hardware.gpu.count=2"]], ids=["S1", "S4x2"])
def test_a_run_too_long_to_hold_reports_what_it_would_held_whole(monkeypatch, tmp_path, sets):
    """Streamed (held: nothing), the figures are those of the run held whole, and the trace of
    its first steps is the same file."""
    held = _simulate(sets, 10**9, monkeypatch)
    streamed = _simulate(sets, 0, monkeypatch)
    assert streamed.run.program.total < held.run.program.total / 50    # it kept 3 of 301 segments
    a, b = dict(held.summary), dict(streamed.summary)
    a.pop("wall_s"), b.pop("wall_s")
    assert json.dumps(a) == json.dumps(b)
    held.write_trace(tmp_path / "held.json")
    streamed.write_trace(tmp_path / "streamed.json")
    assert (tmp_path / "held.json").read_bytes() == (tmp_path / "streamed.json").read_bytes()


def test_a_trace_of_steps_the_run_did_not_keep_is_refused(monkeypatch, tmp_path):
    sim = _simulate(["workload.gen_len=50"], 0, monkeypatch, keep=3)
    assert sim.write_trace(tmp_path / "ok.json", steps=3) > 0
    compared = taskgraph.compare(TINY, ["S1", "S2"], overrides={"workload.gen_len": 50},
                                 keep_steps=3)
    for result in (sim, compared):
        for steps in (4, None):
            with pytest.raises(TgError, match="kept the task times of prefill and 3"):
                result.write_trace(tmp_path / "t.json", steps=steps)
    assert not (tmp_path / "t.json").exists()
    with pytest.raises(TgError, match="keep_steps"):
        _simulate(["workload.gen_len=50"], 0, monkeypatch, keep=-1)


def test_keeping_every_step_holds_the_run_whole(monkeypatch):
    sim = _simulate(["workload.gen_len=50"], 0, monkeypatch, keep=None)
    assert sim.run.program.total == compile_plan(sim.plan).total


def test_a_streamed_run_with_shared_pools_is_the_whole_runs_fixed_point(monkeypatch):
    """A run too long to hold whose tasks slow each other is one pass at the slowdowns of short
    runs solved along it: within the fixed point's tolerance of the whole run solved whole
    (bench/pool_solve.py: the same on runs of 6-15 M tasks), in a tenth of the memory."""
    sc = load_scenario("scenarios/2xt4-8x22b.yaml", ["workload.gen_len=40", "policy.N=504"])
    held = simulation.simulate_scenario(sc, keep_steps=None)
    monkeypatch.setattr(simulation, "HOLD_TASKS", 0)
    streamed = simulation.simulate_scenario(sc, keep_steps=0)
    assert streamed.run.program.total < held.run.program.total / 20
    for figure in ("throughput_tok_s", "decode_layer_ms", "prefill_s"):
        assert streamed.summary[figure] == pytest.approx(held.summary[figure], rel=0.003)
    assert streamed.summary["warnings"] == held.summary["warnings"]


def test_ctrl_c_in_a_streamed_run_reports_what_ran(monkeypatch):
    """An interrupt part-way through a run held block by block: the figures of the steps that
    finished, as for a run held whole."""
    calls = []

    def progress(done, total):
        calls.append(done)
        if done == 40:
            raise KeyboardInterrupt

    monkeypatch.setattr(simulation, "HOLD_TASKS", 0)
    sim = simulation.simulate_scenario(load_scenario(TINY, ["workload.gen_len=200"]),
                                       progress=progress)
    s = sim.summary
    assert s["interrupted"] and 30 <= s["steps"] < 40 and s["throughput_tok_s"] > 0


def test_ctrl_c_while_a_block_is_set_up_leaves_only_true_times(monkeypatch):
    """An interrupt while a block's durations are being worked out: that block is not set up,
    so no task reports the times its slots held for an older block."""
    program, cost = _program("S1", [], gen_len=200)
    whole = engine.simulate(program, cost)
    monkeypatch.setattr(engine, "_BLOCK_TASKS", 1024)
    calls = []

    def durations(part):
        calls.append(part.first_segment)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return part.durations(cost)

    run = engine.simulate(program, cost, durations=durations)
    ran = run.finished
    assert run.interrupted and 0 < ran.sum() < program.total
    assert np.array_equal(run.start[ran], whole.start[ran])
    assert np.array_equal(run.end[ran], whole.end[ran])


class _Entered(Exception):
    pass


def test_a_run_of_minutes_is_announced_before_it_starts(monkeypatch):
    """gen_len=9000000 (a typo) is a billion tasks: the warning comes with the least time it
    takes, before the engine is entered; a run of seconds says nothing."""
    def entered(*args, **kwargs):
        raise _Entered
    monkeypatch.setattr(simulation, "simulate_with_interference", entered)
    with pytest.warns(taskgraph.errors.LongRunWarning, match=r"1,044,000,068 tasks.*at least "
                                                              r"17 minutes") as caught:
        with pytest.raises(_Entered):
            simulation.simulate_scenario(load_scenario(TINY, ["workload.gen_len=9000000"]))
    assert len(caught) == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", taskgraph.errors.LongRunWarning)
        with pytest.raises(_Entered):
            simulation.simulate_scenario(load_scenario(TINY, ["workload.gen_len=20000"]))


def test_the_command_line_says_so_off_a_terminal_at_once():
    """Off a terminal, where no progress bar shows, the note reaches stderr before the work."""
    import subprocess
    import sys
    import threading

    from tests.helpers import wait_for

    proc = subprocess.Popen([sys.executable, "-m", "taskgraph.cli", "simulate", TINY, "--set",
                             "workload.gen_len=9000000"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: lines or proc.poll() is not None, 120, "the note on stderr")
        assert proc.poll() is None, "the run ended before its note was read"
        assert lines[0].startswith("tg simulate: note: tiny (S1) has 1,044,000,068 tasks")
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_off_a_terminal_a_long_run_prints_its_progress_and_time_left(monkeypatch, capsys):
    """Off a terminal (a log, a pipe, --json) there is no bar: a run past a minute says how far
    it is and how long it may take still, once a minute; a short one says nothing."""
    from taskgraph.output import report

    now = [100.0]
    monkeypatch.setattr(report.time, "monotonic", lambda: now[0])
    with report.progress_bar(True, "simulating", "segments") as tick:    # stderr: captured
        for done, at in [(10, 130.0), (20, 170.0), (30, 175.0), (60, 290.0)]:
            now[0] = at
            tick(done, 200)
    lines = capsys.readouterr().err.splitlines()
    # 70 s for 20 of 200: 10:30 left at that pace; 190 s for 60: 7:23 left
    assert lines == ["tg: simulating: 20 of 200 segments in 0:01:10, about 0:10:30 left",
                     "tg: simulating: 60 of 200 segments in 0:03:10, about 0:07:23 left"]


def test_the_next_run_of_a_comparison_is_timed_from_its_own_start(monkeypatch, capsys):
    """tg compare simulates its schedules one after another under one progress line; the second
    schedule's first segment after a 4-minute first one was said to leave 10 hours (CI log):
    its pace counted the first schedule's time as its own."""
    from taskgraph.output import report

    now = [0.0]
    monkeypatch.setattr(report.time, "monotonic", lambda: now[0])
    with report.progress_bar(False, "simulating", "segments") as tick:
        for done, at in [(32, 60.0), (129, 240.0), (1, 250.0), (2, 310.0)]:
            now[0] = at
            tick(done, 129)
    lines = capsys.readouterr().err.splitlines()
    # the second run began at 240 s: 10 s for its first segment (128 left: 21:20), 70 s for two
    assert lines == ["tg: simulating: 32 of 129 segments in 0:01:00, about 0:03:01 left",
                     "tg: simulating: 1 of 129 segments in 0:00:10, about 0:21:20 left",
                     "tg: simulating: 2 of 129 segments in 0:01:10, about 1:14:05 left"]


def test_a_fit_of_hours_says_so_before_it_chooses_its_parameters(tmp_path, monkeypatch):
    """Fit cells of 10 million steps made a fit of hours, and each simulation's note named
    only its own share (and came after 24 s of choosing parameters)."""
    import yaml

    from taskgraph.study import fit

    cells = yaml.safe_load(open("scenarios/measurements/small-batch-fiddler-artifact.yaml"))
    cells["cells"] = cells["cells"][:2]
    for cell in cells["cells"]:
        cell["gen_len"] = 10_000_000
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(cells))

    def entered(*args, **kwargs):
        raise _Entered
    monkeypatch.setattr(fit, "free_parameters", entered)
    from taskgraph.study.measurements import load_measurements

    _, loaded = load_measurements(tmp_path / "m.yaml")
    with pytest.warns(taskgraph.errors.LongRunWarning,
                      match=r"each of its 2 cells 4 times.*at least \d\.\d hours"):
        with pytest.raises(_Entered):
            fit.run_fit("m", loaded)
