"""The Python API: each function's result is what its verb prints, as JSON and as tables.

The command line is wiring over :mod:`taskgraph.api`, so these tests hold the two to one
contract from both sides: `to_dict()` equals the verb's ``--json`` output, and the tables a
result shows (in a terminal or a notebook) are the verb's default output.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

import taskgraph as tg
from taskgraph.cli import main
from taskgraph.errors import TgError
from tests.helpers import TINY

SCENARIO = "scenarios/tiny.yaml"


def _cli_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _without_wall_time(obj):
    """Wall-clock seconds differ between two runs of the same thing; nothing else may."""
    if isinstance(obj, dict):
        return {k: _without_wall_time(v) for k, v in obj.items() if k != "wall_s"}
    if isinstance(obj, list):
        return [_without_wall_time(v) for v in obj]
    return obj


def _shown(result) -> str:
    console = Console(file=io.StringIO(), width=110, highlight=False)
    console.print(result)
    return console.file.getvalue()


def test_simulate_is_tg_simulate(capsys):
    result = tg.simulate(SCENARIO, overrides={"policy.mu": 4}, schedule="S2")
    cli = _cli_json(capsys, "simulate", SCENARIO, "--set", "policy.mu=4", "--schedule", "S2")
    assert _without_wall_time(result.to_dict()) == _without_wall_time(cli)
    assert result.summary["schedule"] == "S2" and result.summary["policy"]["mu"] == 4
    # the default output is the result's tables
    assert main(["simulate", SCENARIO, "--set", "policy.mu=4", "--schedule", "S2"]) == 0
    printed = capsys.readouterr().out
    shown = _shown(result)
    assert "tg simulate tiny: S2" in shown
    for line in shown.splitlines():
        if "simulated in" not in line:          # wall time
            assert line.rstrip() in printed


def test_a_scenario_may_be_a_mapping_or_an_object(capsys):
    by_path = tg.simulate(SCENARIO).to_dict()
    doc = json.loads(json.dumps(TINY))
    by_dict = tg.simulate(doc, overrides=["workload.gen_len=2"])
    assert doc == TINY                                        # the caller's mapping is untouched
    assert by_dict.summary["steps"] == 2
    scenario = tg.load(SCENARIO)
    assert _without_wall_time(tg.simulate(scenario).to_dict()) == _without_wall_time(by_path)
    with pytest.raises(TgError, match="model_copy"):
        tg.simulate(scenario, overrides={"policy.mu": 4})
    with pytest.raises(TgError, match="policy.mu"):
        tg.simulate(SCENARIO, overrides={"policy.mu": "many"})


def test_compare_is_tg_compare(capsys):
    result = tg.compare(SCENARIO, ["S1", "S4"])
    cli = _cli_json(capsys, "compare", SCENARIO, "--schedules", "S1,S4")
    assert _without_wall_time(result.to_dict()) == _without_wall_time(cli)
    assert [r["schedule"] for r in result.results] == ["S1", "S4"]
    assert result.checks is None and not result.failed


def test_schedules_are_a_list_or_comma_separated():
    """As --schedules takes them: a plain "S1" was iterated letter by letter."""
    assert [r["schedule"] for r in tg.compare(SCENARIO, "S1, S4").results] == ["S1", "S4"]
    assert [r["schedule"] for r in tg.compare(SCENARIO, "S2").results] == ["S2"]


def test_compare_check_reports_what_broke(tmp_path, capsys):
    doc = {**TINY, "expect": {"beats": {"S4": ["S1"]}, "min_throughput_tok_s": {"S1": 1e9}}}
    result = tg.compare(doc, ["S1", "S4"], check=True)
    assert {c.what for c in result.failed} == {"beats S1", "throughput"}
    assert result.to_dict()["checks_ok"] is False
    assert "FAILED" in _shown(result)


def test_search_is_tg_search(capsys):
    result = tg.search(SCENARIO, top=3)
    cli = _cli_json(capsys, "search", SCENARIO, "--top", "3")
    assert _without_wall_time(result.to_dict()) == _without_wall_time(cli)
    assert len(result.top) == 3 and result.hardware_limit_tok_s > 0


def test_request_lists_give_queue_results(tmp_path, capsys):
    overrides = {"workload.lengths": {"preset": "mtbench", "count": 12, "seed": 1}}
    result = tg.simulate(SCENARIO, overrides=overrides)
    assert result.summary["requests"]["count"] == 12
    q = result.summary["requests"]
    assert f"{q['finished']} of 12 in {q['batches']} batches" in _shown(result)
    result.write_csv(tmp_path / "q.csv")
    assert len((tmp_path / "q.csv").read_text().splitlines()) == 13
    both = tg.compare(SCENARIO, ["S1", "S4:padded"], overrides=overrides)
    assert [r["requests"]["padded"] for r in both.results] == [False, True]


def test_traces_from_results(tmp_path):
    result = tg.simulate(SCENARIO)
    slices = result.write_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert slices == sum(1 for e in events if e.get("ph") == "X" and e.get("cat") != "op")
    assert tg.compare(SCENARIO, ["S1", "S2"]).write_trace(tmp_path / "c.json", steps=None) > slices


def test_a_request_lists_trace_needs_its_batches_kept(tmp_path):
    """A queue keeps its batches' task times only when asked (millions of tasks): kept, the
    trace holds every batch, and a comparison's names each entry's; not kept, drawing is a
    clear error. It was an empty trace with no word why, and an AttributeError for a
    comparison."""
    queue = {"workload.lengths": {"preset": "mtbench", "count": 12, "seed": 1}}
    kept = tg.simulate(SCENARIO, overrides=queue, keep_runs=True)
    kept.write_trace(tmp_path / "q.json", steps=None)
    names = _process_names(tmp_path / "q.json")
    assert names == [f"{b + 1}. batch {b}" for b in range(kept.summary["requests"]["batches"])]
    both = tg.compare(SCENARIO, ["S1", "S4:padded"], overrides=queue, keep_runs=True)
    both.write_trace(tmp_path / "c.json")
    assert [n.split(". ", 1)[1] for n in _process_names(tmp_path / "c.json")] == \
        ["S1 batch 0", "S1 batch 1", "S4:padded batch 0", "S4:padded batch 1"]
    for result in (tg.simulate(SCENARIO, overrides=queue),
                   tg.compare(SCENARIO, ["S1", "S4:padded"], overrides=queue)):
        for draw in (lambda: result.write_trace(tmp_path / "x.json"),
                     lambda: result.write_gantt(tmp_path / "x.png")):
            with pytest.raises(TgError, match="kept no task times.*keep_runs=True"):
                draw()
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "x.png").exists()


def _process_names(path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(e["args"]["name"] for e in events if e.get("name") == "process_name")


def test_results_show_in_a_notebook():
    bundle = tg.simulate(SCENARIO)._repr_mimebundle_()
    assert "tg simulate tiny" in bundle["text/plain"]
    assert "<pre" in bundle["text/html"] and "throughput" in bundle["text/html"]


def test_fit_is_tg_fit(tmp_path, capsys):
    import yaml

    from tests.test_fit import _cell

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"cells": [_cell(id="a"), _cell(
        id="b", policy={"mu": 4, "n_ub": 4, "r_w": 0.0, "r_c": 0.0}, measured_tok_s=6.0)]}))
    report = tg.fit(path, loo=False, out=tmp_path / "api")
    cli = _cli_json(capsys, "fit", str(path), "--no-loo", "--out", str(tmp_path / "cli"))
    ours = report.to_dict()
    assert [f.replace("/api/", "/") for f in ours.pop("files")] == \
        [f.replace("/cli/", "/") for f in cli.pop("files")]
    assert ours == cli


def test_execute_is_tg_execute(capsys):
    pytest.importorskip("torch")
    result = tg.execute(SCENARIO, device="cpu", steps=2)
    cli = _cli_json(capsys, "execute", SCENARIO, "--device", "cpu", "--steps", "2")
    ours = result.to_dict()
    assert ours.keys() == cli.keys()
    same = ("scenario", "schedule", "policy", "tasks", "steps", "layers", "tokens_match", "dtype")
    assert {k: ours[k] for k in same} == {k: cli[k] for k in same}
    assert result.failure is None and ours["tokens_match"] is True
    assert "tokens identical" in _shown(result)


def test_batch_sweep_and_graph_are_their_verbs(tmp_path, capsys, monkeypatch):
    queue = {"workload.lengths": {"preset": "mtbench", "count": 20, "seed": 3}}
    batching = tg.batch(SCENARIO, overrides=queue)
    cli = _cli_json(capsys, "batch", SCENARIO, "--set",
                    "workload.lengths={preset: mtbench, count: 20, seed: 3}")
    assert batching.to_dict() == cli and "tg batch tiny: 20 requests" in _shown(batching)

    swept = tg.sweep(SCENARIO, {"hardware.link.h2d_gbps": [8, 16]}, out=tmp_path / "api")
    cli = _cli_json(capsys, "sweep", SCENARIO, "--vary", "hardware.link.h2d_gbps=8,16",
                    "--out", str(tmp_path / "cli"))
    assert swept.to_dict()["rows"] == cli["rows"] and len(cli["rows"]) == 2
    # The sweeps below check which points the values given make, not the searches again (a
    # search a point, seconds each): a point's row is the one searched above, and a point
    # not swept above (1 and 6, from "16" taken letter by letter) is a KeyError.
    searched = {(("hardware.link.h2d_gbps", row["hardware.link.h2d_gbps"]),): row
                for row in cli["rows"]}
    monkeypatch.setattr("taskgraph.study.sweep.run_sweep",
                        lambda jobs, *args: [dict(searched[job.point]) for job in jobs])
    # a text is the values as --vary writes them ("16" swept 1 and 6), a number one value
    for values in ("16", 16):
        rows = tg.sweep(SCENARIO, {"hardware.link.h2d_gbps": values},
                        out=tmp_path / f"text-{values}").to_dict()["rows"]
        assert len(rows) == 1
    assert tg.sweep(SCENARIO, {"hardware.link.h2d_gbps": "8,16"},
                    out=tmp_path / "text").to_dict()["rows"] == cli["rows"]

    segment = tg.graph(SCENARIO, schedule="S2", step=0)
    assert segment.schedule == "S2" and segment.step == 0 and segment.tasks > 0
    assert main(["graph", SCENARIO, "--schedule", "S2", "--step", "0", "--out",
                 str(tmp_path / "g.json")]) == 0
    assert f"wrote {tmp_path / 'g.json'}: {segment}" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(TgError, match="--step 99"):
        tg.graph(SCENARIO, step=99)


@pytest.mark.parametrize("kwargs,words", [
    (dict(overrides=5), "overrides are KEY=VALUE strings"),
    (dict(overrides=["policy.mu=2", 3]), "not ['policy.mu=2', 3]"),
    (dict(overrides=Path("x.yaml")), "x.yaml"),
    (dict(keep_steps="x"), "keep_steps must be an integer, not 'x'"),
    (dict(keep_steps=True), "not True"),
])
def test_wrong_types_are_clear_errors_not_tracebacks(kwargs, words):
    """A notebook user's slip (an int where a list of strings goes) was a TypeError or an
    AttributeError from deep inside; it is a TgError naming the argument."""
    with pytest.raises(TgError, match=re.escape(words)):
        tg.simulate(TINY, **kwargs)


def test_roofline_is_a_typed_result(tmp_path, capsys):
    out = tmp_path / "r.png"
    result = tg.roofline(TINY, out=out)
    assert out.stat().st_size > 0
    assert set(result.to_dict()) >= {"turning_points", "intensities", "verdicts"}
    assert main(["roofline", "scenarios/tiny.yaml", "--out", str(tmp_path / "c.png")]) == 0
    assert "belongs on the" in capsys.readouterr().out


@pytest.mark.parametrize("verb,kwargs,words", [
    ("simulate", dict(csv=123), "--csv is a path (a str or os.PathLike), not int"),
    ("batch", dict(csv="requests.txt"), "--csv 'requests.txt' must end in .csv"),
    ("sweep", dict(vary=["hardware.link.h2d_gbps=1,2"], out=SCENARIO), "give a folder"),
    ("roofline", dict(out=SCENARIO), "is the input"),
    ("graph", dict(out="g.svg"), "must end in .json or .dot"),
])
def test_a_bad_output_path_fails_before_any_work(verb, kwargs, words, monkeypatch):
    """From Python as from the command line, a path a function cannot write is found before
    the run it would lose: a simulation of a 20,000-request queue, minutes of calibration.
    Here any work at all (loading the scenario) fails the test."""
    def no_work(*args, **kwargs):
        raise AssertionError("work began before the output path was checked")

    monkeypatch.setattr(tg.api, "load", no_work)
    monkeypatch.setattr("taskgraph.study.sweep.sweep", no_work)
    with pytest.raises(TgError, match=re.escape(words)):
        getattr(tg, verb)(SCENARIO, **kwargs)


def test_an_output_the_scenario_reads_is_refused_before_the_run(tmp_path, monkeypatch):
    """A request list the scenario names, given as the CSV to write: from the command line it
    was refused at once; from Python only when written, after the simulation. And a file an
    earlier call read is not an input of the next call, which does not read it (a notebook's
    second call may write what its first read)."""
    requests = tmp_path / "requests.csv"
    requests.write_text("prompt_len,gen_len\n" + "8,4\n" * 6)
    overrides = {"workload.requests": str(requests)}

    def no_work(*args, **kwargs):
        raise AssertionError("the simulation began before the output path was checked")

    with monkeypatch.context() as m:
        m.setattr("taskgraph.serving.queue.simulate_queue", no_work)
        with pytest.raises(TgError, match=re.escape(f"--csv '{requests}' is an input")):
            tg.simulate(SCENARIO, overrides=overrides, csv=requests)
    before = requests.read_text()
    tg.simulate(SCENARIO, overrides=overrides)
    tg.batch(SCENARIO, overrides={"workload.lengths": {"preset": "mtbench", "count": 3}},
             csv=requests)
    assert requests.read_text() != before and requests.read_text().startswith("id,")


def test_paths_may_be_any_path_like(tmp_path):
    class PathLike:
        def __fspath__(self):
            return str(tmp_path / "r.png")

    tg.roofline(SCENARIO, out=PathLike())
    assert (tmp_path / "r.png").stat().st_size > 0


def test_a_command_keeps_what_its_calls_read_to_its_end(tmp_path):
    """The command line writes --trace and --gantt after the verb's call returns: a file that
    call read (a checkpoint's config.json, read by the executor) must still be refused then,
    while from Python the next call may write what an earlier one read."""
    from taskgraph import files

    read = tmp_path / "config.json"
    read.write_text("{}")
    with files.command_inputs():
        with files.inputs_of_call():
            files.note_input(read)
        with pytest.raises(TgError, match="is an input of this run"):
            files.refuse_input(read, "--trace")
    with files.inputs_of_call():
        files.note_input(read)
    files.refuse_input(read, "--trace")


def _in_a_thread(work):
    """Start `work` in a thread of its own; the returned join() re-raises what it raised."""
    import threading

    outcome = {}

    def run():
        try:
            work()
        except BaseException as err:     # noqa: BLE001 - handed to the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join(timeout=60)
        assert not thread.is_alive(), "the thread did not finish"
        if "error" in outcome:
            raise outcome["error"]
    return join


def test_calls_in_two_threads_keep_their_own_inputs(tmp_path):
    """Issue 40 point 1: a call that returned in one thread cleared what a call still running in
    another had read, so that the running one could replace its own input (a checkpoint's
    config.json); and a call that returned while another ran left its input protected in the
    process after both. Each interleaving is forced with events, in the order that lost data."""
    import threading

    from taskgraph import files

    checkpoint = tmp_path / "config.json"
    checkpoint.write_text("{}")
    other_started, read, other_done = threading.Event(), threading.Event(), threading.Event()

    def other_call():                   # starts first, returns while the first call runs
        with files.inputs_of_call():
            other_started.set()
            assert read.wait(60)
        other_done.set()

    def running_call():
        assert other_started.wait(60)
        with files.inputs_of_call():
            files.note_input(checkpoint)
            read.set()
            assert other_done.wait(60)
            with pytest.raises(TgError, match="is an input of this run"):
                files.refuse_input(checkpoint, "--out")

    joins = [_in_a_thread(other_call), _in_a_thread(running_call)]
    for join in joins:
        join()

    # the reverse: a call reads, another starts, the first returns, then the second: the
    # first call's input must not outlive both
    noted, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first_call():
        with files.inputs_of_call():
            files.note_input(checkpoint)
            noted.set()
            assert second_in.wait(60)
        first_out.set()

    def second_call():
        assert noted.wait(60)
        with files.inputs_of_call():
            second_in.set()
            assert first_out.wait(60)

    joins = [_in_a_thread(first_call), _in_a_thread(second_call)]
    for join in joins:
        join()
    files.refuse_input(checkpoint, "--out")        # a later call may write it


def _containing_itself() -> dict:
    doc: dict = {"model": "tiny", "hardware": "t4"}
    doc["policy"] = doc
    return doc


def _nested(depth: int) -> dict:
    inner: list = []
    for _ in range(depth):
        inner = [inner]
    return {"model": inner}


@pytest.mark.parametrize("call, words", [
    (lambda: tg.search(SCENARIO, top=2.5), "search: top must be an integer, not 2.5"),
    (lambda: tg.execute(SCENARIO, steps=True, device="cpu"),
     "execute: steps must be an integer, not True"),
    (lambda: tg.graph(SCENARIO, step=1.5), "graph: step must be an integer, not 1.5"),
    (lambda: tg.search(SCENARIO, ray_address=123), "ray_address must be text, not 123"),
    (lambda: tg.compare(SCENARIO, ["S1", 5]), "schedules must be names such as 'S1', not 5"),
    # an argument of the wrong kind altogether was a TypeError deep inside
    (lambda: tg.compare(SCENARIO, 5), "schedules must be names such as 'S1' (a list of them"),
    (lambda: tg.sweep(SCENARIO, 5, out="x.csv"), "vary must be"),
    (lambda: tg.fit(5), "fit: measurements must be a path or a list of paths, not 5"),
    (lambda: tg.fit([5]), "fit: measurements must be a path or a list of paths, not [5]"),
    (lambda: tg.validate(SCENARIO, mu=[True], device="cpu"),
     "validate: mu must be a list of integers, not [True]"),
    (lambda: tg.simulate(5), "simulate: scenario must be a path or a mapping or a Scenario, not 5."),
    (lambda: tg.search(SCENARIO, max_token_ms="100"), "max_token_ms must be a number"),
    (lambda: tg.simulate(SCENARIO, schedule=""), "schedule '' is not a schedule; known"),
    (lambda: tg.simulate(_containing_itself()), "The scenario mapping contains itself"),
    (lambda: tg.simulate(SCENARIO, overrides={"policy": _containing_itself()}),
     "overrides['policy'] contains itself"),
    (lambda: tg.simulate(_nested(100_000)), "The scenario mapping nests too deep"),
])
def test_api_arguments_are_checked_as_the_command_lines_are(call, words):
    """Issue 40 point 4: search(top=2.5) never returned; compare(T, ['S1', 5]) and
    search(ray_address=123) raised AttributeError; execute(steps=True) ran one step;
    simulate(schedule="") ran the file's schedule; a mapping inside itself raised ValueError."""
    with pytest.raises(TgError, match=re.escape(words)):
        call()


def test_loading_runs_no_search_and_resolving_says_what_it_picked(tmp_path, monkeypatch):
    """Issue 39, point 4: tg.load ran the policy search for `policy: auto`; now loading is
    loading, and the verbs that run one policy resolve it with tg.resolve_policy."""
    from taskgraph.study import search

    path = tmp_path / "auto.yaml"
    path.write_text("model: tiny\nhardware: t4\nworkload: {prompt_len: 8, gen_len: 2}\n"
                    "policy: auto\n")
    searches, done = [], []
    real = search.search

    def counted(*args, **kwargs):
        # a search asked again of the same scenario answers as the first did (seconds each):
        # what is checked below is that simulate resolves with the search, not the search
        searches.append(1)
        for asked, result in done:
            if asked == (args, kwargs):
                return result
        done.append(((args, kwargs), real(*args, **kwargs)))
        return done[-1][1]

    monkeypatch.setattr(search, "search", counted)
    loaded = tg.load(path)
    assert loaded.policy_auto and searches == []
    resolved, found = tg.resolve_policy(loaded)
    assert searches == [1] and not resolved.policy_auto
    assert resolved.policy.N == found.best.policy["N"]
    assert tg.resolve_policy(resolved) == (resolved, None)       # a given policy stays
    assert tg.simulate(path).summary["policy"]["N"] == resolved.policy.N
    assert searches == [1, 1]
