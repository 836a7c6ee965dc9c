"""Bad input, interrupted and concurrent writes: one case per class of the hostile tester's
probes. Each must end with exit 2, one paragraph naming the field or path, no traceback, and no
file left behind."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from taskgraph.cli import main
from taskgraph.errors import TgError
from taskgraph.scenario import load_scenario, scenario_from_dict
from tests.helpers import children, wait_for

TINY = "scenarios/tiny.yaml"


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


CASES = [
    # (what, argv (FOLDER is replaced by the test's folder), text the error must hold)
    ("infinite latency", ["simulate", TINY, "--set", "hardware.link.latency_us=.inf"],
     "hardware.link.latency_us"),
    ("NaN bandwidth", ["simulate", TINY, "--set", "hardware.gpu.mem_gbps=.nan"],
     "hardware.gpu.mem_gbps"),
    ("zero task bandwidth", ["simulate", TINY, "--set", "hardware.task_gbps={D3: 0}"],
     "hardware.task_gbps"),
    ("huge N", ["simulate", TINY, "--set", "policy.N=1000000000000"], "policy.N"),
    # (a run this long without a whole trace is decided block by block: tests/test_long_runs.py)
    ("run too large for memory", ["simulate", TINY, "--set", "workload.gen_len=9000000",
                                  "--trace", "FOLDER/t.json", "--trace-steps", "all"],
     "workload.gen_len"),
    ("non-UTF-8 scenario", ["simulate", "FOLDER/latin1.yaml"], "not UTF-8"),
    ("self-including profile", ["simulate", "FOLDER/loop.yaml"], "includes itself"),
    ("duplicate key", ["simulate", "FOLDER/dup.yaml"], "appears twice"),
    ("alias bomb in a field", ["simulate", "FOLDER/bomb.yaml"], "model.name"),
    ("malformed DBRX config", ["simulate", "FOLDER/dbrx-scenario.yaml"], "config"),
    ("trace is a folder", ["simulate", TINY, "--trace", "FOLDER"], "--trace"),
    ("trace under a file", ["simulate", TINY, "--trace", "FOLDER/latin1.yaml/t.json"],
     "which is a file"),
    ("trace replaces the scenario", ["simulate", "FOLDER/copy.yaml", "--trace",
                                     "FOLDER/copy.yaml"], "is the input"),
    ("empty trace path", ["simulate", TINY, "--trace", ""], "--trace is empty"),
    ("a preset that is a list", ["simulate", TINY, "--set", "model.preset=[]"],
     "is not a preset"),
    ("trace of no known format", ["simulate", TINY, "--trace", "FOLDER/t.pftrace.gz"],
     "must end in .json, .json.gz or .pftrace"),
    ("bad trace steps", ["simulate", TINY, "--trace", "FOLDER/t.json", "--trace-steps", "x"],
     "--trace-steps"),
    ("bad gantt suffix", ["simulate", TINY, "--gantt", "FOLDER/g.jpg"], "--gantt"),
    ("FFN on the CPU over two GPUs", ["simulate", TINY, "--schedule", "S5", "--set",
                                      "hardware.gpu.count=2"], "hardware.gpu.count"),
    ("interconnect without a rate", ["simulate", TINY, "--set", "hardware.gpu.count=2",
                                     "--set", "hardware.interconnect={eff: 0.5}"],
     "hardware.interconnect.gbps"),
    ("tensor-parallel execution over GPUs that split no KV heads evenly",
     ["execute", TINY, "--set", "hardware.gpu.count=3"], "model.n_kv = 2"),
    ("tensor-parallel simulation over GPUs that split no KV heads evenly",
     ["simulate", TINY, "--set", "hardware.gpu.count=3"], "model.n_kv = 2"),
    ("a request field past csv's limit", ["simulate", TINY, "--set",
                                          "workload.requests=FOLDER/big.csv"],
     "line 2: not a CSV row"),
    ("a negative seed for generated lengths",
     ["simulate", TINY, "--set", "workload.lengths={count: 3, prompt_mean: 4, prompt_max: 8, "
                                 "gen_mean: 2, gen_max: 4, seed: -1}"],
     "workload.lengths.seed"),
    ("processes on one GPU", ["execute", TINY, "--processes"], "hardware.gpu.count"),
    ("repeated sweep key", ["sweep", TINY, "--vary", "workload.gen_len=1", "--vary",
                            "workload.gen_len=2", "--out", "FOLDER/sweep"], "twice"),
    ("non-numeric sweep value", ["sweep", TINY, "--vary", "hardware.link.h2d_gbps=16,abc",
                                 "--out", "FOLDER/sweep"], "hardware.link.h2d_gbps"),
    ("a handoff past every clock", ["simulate", TINY, "--set", "hardware.handoff_us=1e308"],
     "hardware.handoff_us"),
    ("a task overhead past every clock", ["simulate", TINY, "--set",
                                          "hardware.task_overhead_us={D3: 1e308}"],
     "hardware.task_overhead_us"),
    # a graph of a million layers was built for hours before anything refused it
    ("a million layers", ["graph", TINY, "--set", "model.L=1000000", "--out", "FOLDER/g.json"],
     "model.L"),
    ("a scenario path longer than the system takes", ["simulate", "FOLDER/" + "a" * 100_000],
     "File name too long"),
    ("a checkpoint path longer than the system takes",
     ["execute", TINY, "--device", "cpu", "--weights", "FOLDER/" + "a" * 100_000],
     "File name too long"),
]


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes("model: tiny # caf\xe9\n".encode("latin-1"))
    (tmp_path / "self.yaml").write_text("file: self.yaml\n")
    (tmp_path / "loop.yaml").write_text(
        "model: tiny\nhardware: self.yaml\nworkload: {prompt_len: 4, gen_len: 2}\n"
        "policy: {N: 4, mu: 2}\n")
    (tmp_path / "dup.yaml").write_text(
        "model: tiny\nhardware: t4\nworkload: {prompt_len: 4, gen_len: 2}\n"
        "policy: {N: 4, mu: 2}\npolicy: {N: 8, mu: 2}\n")
    anchors = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] + [
        f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    (tmp_path / "bomb.yaml").write_text(
        "model:\n  preset: tiny\n  name: [" + ", ".join(anchors) + "]\nhardware: t4\n"
        "workload: {prompt_len: 4, gen_len: 2}\npolicy: {N: 4, mu: 2}\n")
    (tmp_path / "dbrx.json").write_text(json.dumps(
        {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 128,
         "attn_config": [1, 2], "ffn_config": {"ffn_hidden_size": 96}}))
    (tmp_path / "dbrx-scenario.yaml").write_text(
        "model: dbrx.json\nhardware: t4\nworkload: {prompt_len: 4, gen_len: 2}\n"
        "policy: {N: 4, mu: 2}\n")
    (tmp_path / "copy.yaml").write_text(Path(TINY).read_text())
    (tmp_path / "big.csv").write_text("id,prompt_len,gen_len\n" + "x" * 200_000 + ",4,2\n")
    return tmp_path


@pytest.mark.parametrize("what, argv, text", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clean_error(folder, capsys, monkeypatch, what, argv, text):
    before = _files(folder)
    copy = (folder / "copy.yaml").read_text()
    argv = [a.replace("FOLDER", str(folder)) for a in argv]

    def simulated(*args, **kwargs):
        raise AssertionError("a run was simulated before the bad input was refused")

    # refused before any work: the engine is never entered (the clock was checked instead)
    monkeypatch.setattr("taskgraph.sim.interference.simulate", simulated)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err, err
    assert "Traceback" not in err and len(err) < 2000
    assert _files(folder) == before                # nothing written, nothing left behind
    assert (folder / "copy.yaml").read_text() == copy


#: Options of the command line that the Python API does not take (a result writes its trace
#: and chart itself: `Simulation.write_trace`, `write_gantt`).
CLI_ONLY = {"--trace", "--trace-steps", "--gantt"}
API_CASES = [c for c in CASES if not CLI_ONLY & set(c[1])]


def _as_call(argv: list[str]):
    """The API call a command line makes: `simulate X --set K=V --vary K=V,W --out D
    --processes` -> ``simulate(X, overrides=[K=V], vary=[K=V,W], out=D, processes=True)``."""
    import taskgraph as tg

    verb, first, rest = argv[0], argv[1], argv[2:]
    kwargs: dict = {}
    while rest:
        flag, rest = rest[0], rest[1:]
        name = {"--set": "overrides"}.get(flag, flag[2:].replace("-", "_"))
        if rest and not rest[0].startswith("--"):
            value, rest = rest[0], rest[1:]
            kwargs[name] = [*kwargs[name], value] if name in ("overrides", "vary") and \
                name in kwargs else ([value] if name in ("overrides", "vary") else value)
        else:
            kwargs[name] = True
    if verb == "sweep":
        return lambda: tg.sweep(first, kwargs.pop("vary"), **kwargs)
    return lambda: getattr(tg, verb)(first, **kwargs)


@pytest.mark.parametrize("what, argv, text", API_CASES, ids=[c[0] for c in API_CASES])
def test_the_apis_errors_are_the_command_lines(folder, capsys, monkeypatch, what, argv, text):
    """The same bad value through the Python API: the same TgError, word for word, before any
    work, nothing written."""
    import taskgraph as tg
    from taskgraph.files import printable

    argv = [a.replace("FOLDER", str(folder)) for a in argv]
    assert main(argv) == 2
    said = capsys.readouterr().err.strip()
    before = _files(folder)

    def simulated(*args, **kwargs):
        raise AssertionError("a run was simulated before the bad input was refused")

    monkeypatch.setattr("taskgraph.sim.interference.simulate", simulated)
    with pytest.raises(tg.TgError) as err:
        _as_call(argv)()
    assert said == f"tg {argv[0]}: error: {printable(str(err.value))}"
    assert text in str(err.value) and _files(folder) == before


def test_most_of_the_bad_value_table_runs_through_the_api():
    assert len(API_CASES) >= 15, [c[0] for c in CASES if c not in API_CASES]


@settings(max_examples=60, deadline=None)
@given(doc=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["model", "hardware", "workload", "policy", "schedule", "name", "h",
                         "N", "mu", "gpu", "preset", "file", "prompt_len", "gen_len", "x"]),
        inner, max_size=4), max_leaves=12),
    sets=st.lists(st.tuples(st.sampled_from(
        ["policy.N", "policy.mu", "policy.r_w", "workload.gen_len", "hardware.gpu.tflops",
         "hardware.link.h2d_gbps", "model.h", "model", "hardware", "schedule", "implementation",
         "implementation.kinds.PostAttn.bytes_eff"]),
        st.sampled_from(["0", "-1", "1e400", ".nan", "abc", "[1]", "{a: 1}", "2", "0.5", "t4",
                         "S9", "flexgen", "''"])), max_size=3))
def test_the_loader_only_ever_returns_a_scenario_or_a_clean_error(tmp_path_factory, doc, sets):
    path = tmp_path_factory.mktemp("fuzz") / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        load_scenario(path, [f"{k}={v}" for k, v in sets])
    except TgError as err:
        assert str(err) and len(str(err)) < 5000


def test_concurrent_writers_each_leave_a_valid_trace(tmp_path):
    """Two runs writing one trace path: both exit 0, the file is one complete trace, and no
    temporary file is left."""
    from taskgraph.tracing.check import check_trace, load_trace

    trace = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "taskgraph.cli", "simulate", TINY, "--trace", str(trace)]
    procs = [subprocess.Popen(cmd + ["--trace-steps", steps], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for steps in ("all", "1")]
    for p in procs:
        assert p.wait(120) == 0, p.stderr.read()
    assert check_trace(load_trace(trace)) == []
    assert _files(tmp_path) == {"s.json"}


@pytest.mark.parametrize("policy,expected", [
    ("{<<: {N: 8, mu: 2}, mu: 4}", (8, 4)),                    # its own keys override
    ("{<<: [{N: 8}, {mu: 2}], mu: 4}", (8, 4)),                # a list of merges
    ("{N: 8, mu: 2, N: 9}", "the key 'N' appears twice"),
    ("{<<: {N: 8, mu: 2, mu: 4}}", "the key 'mu' appears twice"),   # inside what it merges
    ("{<<: {N: 8}, <<: {mu: 4}, mu: 2}", "the key '<<' appears twice"),
    ("{<<: 5}", "expected a mapping or list of mappings for merging"),
])
def test_yaml_merge_keys_merge_and_a_repeat_is_refused(tmp_path, policy, expected):
    """`<<:` merges a mapping whose keys the mapping's own override (YAML's merge); the
    unique-key loader refused every merge as a repeated key. A key given twice, by the mapping
    or by what it merges, is still refused."""
    path = tmp_path / "s.yaml"
    path.write_text(f"model: tiny\nhardware: t4\nworkload: {{prompt_len: 4, gen_len: 2}}\n"
                    f"policy: {policy}\n")
    if isinstance(expected, tuple):
        assert (load_scenario(path).policy.N, load_scenario(path).policy.mu) == expected
    else:
        with pytest.raises(TgError, match=re.escape(expected)):
            load_scenario(path)


def test_a_merge_of_a_merge_is_refused_not_resolved_wrongly(tmp_path):
    """PyYAML 6 resolves `c` below to N: 8 (the inner merge wins over p's own N: 9); tg refuses
    the nested merge instead of simulating a policy nobody wrote."""
    path = tmp_path / "s.yaml"
    path.write_text("model: tiny\nhardware: t4\nworkload: &p {<<: {gen_len: 8}, gen_len: 2}\n"
                    "policy: {N: 8, mu: 2}\nschedule: {<<: *p}\n")
    with pytest.raises(TgError, match="merges a mapping that merges another"):
        load_scenario(path)


@pytest.mark.parametrize("name", ["t.json", "t.pftrace"])
def test_interrupting_the_trace_write_keeps_the_results_and_the_old_file(tmp_path, name,
                                                                        monkeypatch, capsys):
    from taskgraph.tracing import writer as trace_module

    if name.endswith(".pftrace"):
        pytest.importorskip("perfetto")
    path = tmp_path / name
    path.write_text("previous")
    events = trace_module._run_events

    def interrupted(*args, **kwargs):
        yield from list(events(*args, **kwargs))[:100]
        raise KeyboardInterrupt

    monkeypatch.setattr(trace_module, "_run_events", interrupted)
    assert main(["simulate", TINY, "--json", "--trace", str(path)]) == 130
    out, err = capsys.readouterr()
    assert json.loads(out)["throughput_tok_s"] > 0 and "interrupted" in err
    assert path.read_text() == "previous" and _files(tmp_path) == {name}


@pytest.mark.parametrize("suffix", [".json", ".pftrace"])
def test_trace_bytes_do_not_depend_on_the_wall_clock(tmp_path, suffix):
    if suffix == ".pftrace":
        pytest.importorskip("perfetto")
    for name in ("a", "b"):
        assert main(["simulate", TINY, "--trace", str(tmp_path / (name + suffix))]) == 0
    assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()


def test_tracecheck_has_a_command_line(tmp_path):
    good = tmp_path / "good.json"
    assert main(["simulate", TINY, "--trace", str(good)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": -1}]}')
    run = [sys.executable, "-m", "taskgraph.tracing.check"]
    assert subprocess.run(run + [str(good)], capture_output=True).returncode == 0
    assert subprocess.run(run + [str(good), str(bad)], capture_output=True).returncode == 1
    assert subprocess.run(run + [str(tmp_path / "none.json")],
                          capture_output=True).returncode == 2


def test_scenario_from_dict_names_a_huge_value_briefly():
    with pytest.raises(TgError) as err:
        scenario_from_dict({"model": {"preset": "tiny", "name": [["x" * 10_000] * 100] * 100},
                            "hardware": "t4", "workload": {"prompt_len": 4, "gen_len": 2},
                            "policy": {"N": 4, "mu": 2}})
    assert "model.name" in str(err.value) and len(str(err.value)) < 1000


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_stops_a_parallel_brute_force_at_once():
    proc = subprocess.Popen([sys.executable, "-m", "taskgraph.cli", "search",
                             "scenarios/t4.yaml", "--brute-force"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the simulations are under way once the search's process pool has its workers
    wait_for(lambda: proc.poll() is not None or len(children(proc.pid)) >= 2,
             what="the brute force's worker processes")
    assert proc.poll() is None, "the brute force ended before the test could interrupt it"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err
    # at once: the jobs still queued were cancelled, not run (the clock was checked instead)
    done, total = map(int, re.search(r"with (\d+) of (\d+) jobs finished", err).groups())
    assert done < total, err


@pytest.mark.parametrize("verb", [["simulate"], ["compare", "--schedules", "S1,S4"],
                                  ["search", "--top", "2"], ["batch"]])
def test_names_are_printed_as_written_never_as_markup(tmp_path, capsys, verb):
    """A `[` in a scenario's name, its file's name or a request id is text: rich markup would
    crash (MarkupError) or swallow it."""
    (tmp_path / "r.csv").write_text("id,prompt_len,gen_len\nq[/b]1,12,3\nq2,20,4\n")
    path = tmp_path / "exp[bold]1.yaml"
    path.write_text('name: "x[/oops] [red]y"\nmodel: tiny\nhardware: t4\n'
                    "workload: {requests: r.csv}\npolicy: {N: 4, mu: 2}\n")
    assert main([verb[0], str(path), *verb[1:]]) == 0
    out, err = capsys.readouterr()
    assert "x[/oops] [red]y" in " ".join(out.split()) and "Traceback" not in err


@pytest.mark.parametrize("where, text, words", [
    ("name", 'name: "bad\\e[31mred"\n', "holds a control character"),
    ("model.name", 'model: {preset: tiny, name: "a\\x07b"}\n', "holds a control character"),
    # right-to-left override: the name would show reversed
    ("name", 'name: "abc\\u202Eexe.txt"\n', "holds a control character"),
    # an escape sequence (clear screen) as base64, which the control-character check of text
    # never saw
    ("name", "name: !!binary G1sySg==\n", "is binary data"),
])
def test_control_characters_in_names_are_refused(tmp_path, capsys, where, text, words):
    path = tmp_path / "s.yaml"
    base = "model: tiny\n" if where != "model.name" else ""
    path.write_text(text + base + "hardware: t4\nworkload: {prompt_len: 4, gen_len: 2}\n"
                    "policy: {N: 4, mu: 2}\n")
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{where} {words}" in err
    assert not re.search("[\x1b\x07\u202e]", err)


@pytest.mark.parametrize("argv", [
    ["simulate", "FOLDER/a\x1b]0;owned\x07\x1b[2Jb.yaml"],        # a path: title, clear screen
    ["simulate", TINY, "--trace", "FOLDER/t\u202e.json.txt"],      # reversed in an error
    ["simulate", TINY, "--trace-steps", "x" * 100_000],            # argparse's own error
    ["simulate", TINY, "--set", "policy.N=" + "y" * 100_000],      # the loader's
    ["simulate", TINY, "--gantt", "FOLDER/" + "z" * 100_000 + ".jpg"],
    # a value with spaces in it was echoed whole (no run of 200 without a space to cut)
    ["simulate", TINY, "--schedule", "a " * 50_000],
    ["simulate", TINY, "--set", "a " * 50_000 + "=1"],
    ["simulate", "FOLDER/" + "a " * 50_000 + ".yaml"],
    # a newline in a path split the error over two lines; a line separator did in a terminal
    ["simulate", "FOLDER/a\nb.yaml"],
    ["simulate", "FOLDER/a\u2028b.yaml"],
], ids=["escape in a path", "bidi in a path", "long trace steps", "long set value",
        "long gantt path", "long schedule with spaces", "long set key with spaces",
        "long path with spaces", "newline in a path", "line separator in a path"])
def test_what_an_error_echoes_reaches_the_terminal_as_plain_short_text(tmp_path, capsys,
                                                                       argv):
    """Issue 40 point 5: a path with ESC was echoed raw; thirteen options echoed a
    100,000-character bad value in full. Every error line shows a control or bidirectional
    character as its escape and cuts a long value."""
    argv = [a.replace("FOLDER", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tg simulate: error:") and "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, ascii(err[:300])     # one line
    assert not re.search("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202e]", err[:-1]), \
        ascii(err[:300])
    assert len(err) < 2000, len(err)


def test_a_control_character_in_a_request_id_is_refused(tmp_path, capsys):
    (tmp_path / "r.csv").write_text('id,prompt_len,gen_len\n"a\x1b[2Jb",4,2\n')
    (tmp_path / "s.yaml").write_text("model: tiny\nhardware: t4\nworkload: {requests: r.csv}\n"
                                     "policy: {N: 4, mu: 2}\n")
    assert main(["batch", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err
    assert "line 2: id holds a control character" in err and "\x1b" not in err


def _never(what: str):
    """A stand-in for work a refusal must come before: entering it fails the test."""
    def entered(*args, **kwargs):
        raise AssertionError(f"{what} was entered before the refusal")
    return entered


def test_a_huge_length_in_a_request_file_is_refused_like_one_given_by_set(tmp_path, capsys,
                                                                          monkeypatch):
    """Every way a length arrives meets the same size check: a request file's 10^7 generated
    tokens are refused up front with the estimate, as `--set workload.gen_len=10000000` is
    (before the engine runs: no wall time is asserted, the work is)."""
    import taskgraph.sim.simulate as simulation

    monkeypatch.setattr(simulation, "simulate_with_interference", _never("the engine"))
    (tmp_path / "r.csv").write_text("id,prompt_len,gen_len\na,4,10000000\n")
    (tmp_path / "s.yaml").write_text("model: tiny\nhardware: t4\nworkload: {requests: r.csv}\n"
                                     "policy: {N: 4, mu: 2}\n")
    assert main(["simulate", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err
    assert "tasks" in err and "GB" in err and "Traceback" not in err


def test_no_output_replaces_a_file_the_run_read(tmp_path, capsys, monkeypatch):
    """Inputs found through the scenario (a request list, a hardware profile) are inputs too:
    writing over one is refused, before the work where it can be, and the file is untouched."""
    (tmp_path / "r.csv").write_text("id,prompt_len,gen_len\na,4,2\nb,5,3\n")
    (tmp_path / "s.yaml").write_text("model: tiny\nhardware: t4\nworkload: {requests: r.csv}\n"
                                     "policy: {N: 4, mu: 2}\n")
    before = (tmp_path / "r.csv").read_text()
    assert main(["simulate", str(tmp_path / "s.yaml"), "--csv", str(tmp_path / "r.csv")]) == 2
    assert "is an input of this run" in capsys.readouterr().err
    assert (tmp_path / "r.csv").read_text() == before
    profile = tmp_path / "p.yaml"
    profile.write_text("preset: t4\n")
    pytest.importorskip("torch")
    import taskgraph.study.calibrate as calibration

    monkeypatch.setattr(calibration, "measure", _never("a microbenchmark"))  # refused before
    monkeypatch.setattr(calibration, "fit_tasks", _never("the executor's runs"))  # measuring
    assert main(["calibrate", "scenarios/tiny.yaml", "--set", f"hardware={profile}",
                 "--out", str(profile)]) == 2
    assert "is an input of this run" in capsys.readouterr().err
    assert profile.read_text() == "preset: t4\n"


def test_a_link_stays_a_link_and_a_failed_write_is_one_clean_error(tmp_path, capsys):
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert main(["simulate", TINY, "--trace", str(tmp_path / "link.json")]) == 0
    assert (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "real.json").read_text())["traceEvents"]
    assert (tmp_path / "real.json").stat().st_mode & 0o044    # not private to its writer
    capsys.readouterr()
    if Path("/proc").is_dir():
        assert main(["simulate", TINY, "--trace", "/proc/tg-trace.json"]) == 2
        err = capsys.readouterr().err
        # refused before the run now (files.check_outputs), in one clean paragraph
        assert "--trace '/proc/tg-trace.json' cannot be written" in err
        assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_is_an_error_and_dev_null_stays_a_device(tmp_path, capsys):
    pytest.importorskip("torch")
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt_ids": [1, 2, 3]}\n')
    run = ["execute", TINY, "--device", "cpu", "--steps", "1", "--prompts",
           str(tmp_path / "p.jsonl"), "--out"]
    assert main(run + ["/dev/full"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert main(run + ["/dev/null"]) == 0
    assert Path("/dev/null").is_char_device()


def test_dev_stdout_into_a_pipe_is_written_in_place(tmp_path):
    """`--out /dev/stdout | cat`: stdout a pipe, /dev/stdout resolves to /proc/PID/fd/pipe:[N],
    which is no path; the output was refused ('nothing can be created in /proc/PID/fd')."""
    pytest.importorskip("torch")
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt_ids": [1, 2, 3]}\n')
    run = subprocess.run([sys.executable, "-m", "taskgraph.cli", "execute", TINY, "--device",
                          "cpu", "--steps", "1", "--prompts", str(tmp_path / "p.jsonl"), "--out",
                          "/dev/stdout"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[0])["id"] == "a"


def test_a_folder_in_the_way_of_a_file_a_folder_output_holds_is_refused_first(tmp_path):
    """`tg sweep --out DIR` where DIR/sweep.csv is a folder: found after the sweep, as `tg fit`
    found DIR/report.json after minutes of fitting, having written the profiles before it."""
    import taskgraph as tg

    (tmp_path / "out" / "sweep.csv").mkdir(parents=True)
    with pytest.raises(TgError, match="holds a folder 'sweep.csv'"):
        tg.sweep(TINY, ["workload.gen_len=2,3"], out=tmp_path / "out",
                 progress=lambda *a: pytest.fail("the sweep began"))


def _damaged_checkpoints():
    def outside(folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        doc = json.loads(index.read_text())
        doc["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
        index.write_text(json.dumps(doc))

    def wrong_type(folder: Path) -> None:
        (folder / "model.safetensors.index.json").write_text('{"weight_map": ["a", "b"]}')

    def missing(folder: Path) -> None:
        next(folder.glob("model-00005-*.safetensors")).unlink()

    def truncated(folder: Path) -> None:
        shard = next(folder.glob("model-00003-*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:1000])

    return {"index points outside": (outside, "outside the checkpoint folder"),
            "weight_map a list": (wrong_type, "weight_map must map"),
            "missing shard": (missing, "a missing or partial download"),
            "truncated shard": (truncated, "truncated or corrupt shard")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("ckpt") / "ckpt"
    subprocess.run([sys.executable, "bench/make_checkpoint.py", str(folder)], check=True,
                   capture_output=True)
    return folder


@pytest.mark.parametrize("damage", list(_damaged_checkpoints()))
def test_a_damaged_checkpoint_is_one_clean_error(checkpoint, tmp_path, capsys, damage):
    import shutil

    how, words = _damaged_checkpoints()[damage]
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    how(folder)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"model: {{hf_config: {folder}/config.json}}\nhardware: t4\n"
                        "workload: {prompt_len: 8, gen_len: 2}\npolicy: {N: 4, mu: 2}\n")
    assert main(["execute", str(scenario), "--weights", str(folder), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err) < 2000


def test_two_prompts_with_one_id_are_refused(tmp_path, capsys):
    pytest.importorskip("torch")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [1, 2, 3]}\n{"id": 0, "prompt_ids": [4, 5]}\n')
    assert main(["execute", TINY, "--device", "cpu", "--steps", "1", "--prompts",
                 str(path)]) == 2
    assert "id '0' was already given on line 1" in capsys.readouterr().err


@pytest.mark.parametrize("eos, words", [
    ("two", "eos_token_id must be a token id"),
    # an id past the vocabulary never ends a request; it was accepted, and read after the run
    (10**6, "eos_token_id holds 1000000, outside the model's vocabulary"),
    ([2, -1], "eos_token_id holds -1, outside the model's vocabulary")])
def test_an_eos_token_id_that_is_not_an_id_is_refused(checkpoint, tmp_path, capsys, eos,
                                                       words):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    config = folder / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": eos}))
    (tmp_path / "p.jsonl").write_text('{"id": "q", "prompt_ids": [1, 2, 3]}\n')
    (tmp_path / "s.yaml").write_text(f"model: {{hf_config: {folder}/config.json}}\n"
                                     "hardware: t4\nworkload: {prompt_len: 8, gen_len: 2}\n"
                                     "policy: {N: 4, mu: 2}\n")
    assert main(["execute", str(tmp_path / "s.yaml"), "--weights", str(folder), "--device",
                 "cpu", "--prompts", str(tmp_path / "p.jsonl")]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and "Traceback" not in captured.err
    assert "throughput" not in captured.out      # refused before the run, not after it


@pytest.mark.parametrize("name, content, words", [
    ("bom.csv", "\ufeffid,prompt_len,gen_len\na,4,2\n", None),
    ("digits.jsonl", '{"prompt_len": ' + "9" * 5000 + ', "gen_len": 2}\n', "4,300 digits"),
    # int() refuses 4,300 digits with a ValueError that was a traceback (round three)
    ("digits.csv", "id,prompt_len,gen_len\na,1" + "0" * 5000 + ",2\n", "prompt_len must be a whole"),
    ("deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "nesting deeper"),
    ("passwd.csv", "root:x:0:0:root:/root:/bin/bash\n", "not a list of column names"),
    ("wide.csv", ",".join(f"c{i}" for i in range(300_000)) + "\n", "not a list of column"),
    ("typo.csv", "id,promt_len,gen_len\na,4,2\n", "(it has id, promt_len, gen_len)"),
    # int() reads these; a person reading the file would not
    ("underscore.csv", "id,prompt_len,gen_len\na,5_000,2\n", "prompt_len must be a whole"),
    ("arabic.csv", "id,prompt_len,gen_len\na,\u0664,2\n", "prompt_len must be a whole"),
    ("quoted.jsonl", '{"prompt_len": "4", "gen_len": 2}\n', "prompt_len must be a whole"),
])
def test_a_request_list_is_read_by_one_careful_reader(tmp_path, capsys, name, content, words):
    """A byte-order mark is read; a huge number, deep nesting or another kind of file is one
    short error that never repeats what the file holds."""
    (tmp_path / name).write_text(content, encoding="utf-8")
    (tmp_path / "s.yaml").write_text(f"model: tiny\nhardware: t4\nworkload: {{requests: {name}}}"
                                     "\npolicy: {N: 4, mu: 2}\n")
    rc = main(["batch", str(tmp_path / "s.yaml")])
    out, err = capsys.readouterr()
    if words is None:
        assert rc == 0 and "1 requests" in " ".join(out.split())
        return
    assert rc == 2 and words in err and "Traceback" not in err and len(err) < 1000
    assert "root:x" not in err


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes and devices")
def test_a_pipe_or_a_device_is_refused_not_read(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "r.csv")                       # reading it would wait for ever
    (tmp_path / "s.yaml").write_text("model: tiny\nhardware: t4\nworkload: {requests: r.csv}\n"
                                     "policy: {N: 4, mu: 2}\n")
    assert main(["batch", str(tmp_path / "s.yaml")]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert main(["simulate", "/dev/zero"]) == 2                 # never ends
    assert "is not a regular file" in capsys.readouterr().err


def _edited_checkpoint(checkpoint, tmp_path, config=None, tensor=None, how=None):
    """A copy of the generated checkpoint with config.json fields replaced, or one tensor
    changed by `how`, and a scenario over it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensor:
        shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())[
            "weight_map"][tensor]
        tensors = load_file(shard)
        tensors[tensor] = how(tensors[tensor], torch)
        save_file(tensors, shard, metadata={"format": "pt"})
    (tmp_path / "s.yaml").write_text(f"model: {{hf_config: {folder}/config.json}}\n"
                                     "hardware: t4\nworkload: {prompt_len: 8, gen_len: 2}\n"
                                     "policy: {N: 4, mu: 2}\n")
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt_ids": [1, 5, 6]}\n'
                                      '{"id": "b", "prompt_ids": [3, 25]}\n')
    return ["execute", str(tmp_path / "s.yaml"), "--weights", str(folder), "--device", "cpu",
            "--prompts", str(tmp_path / "p.jsonl"), "--json"]


def _nan(t, torch):
    t[0, 0] = float("nan")
    return t


@pytest.mark.parametrize("config, words", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, not a string"),
    ({"dtype": 5}, "dtype must be a string, not a number"),
    ({"dtype": None, "torch_dtype": ["float32"]}, "torch_dtype must be a string, not a list"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object, not a string"),
    ({"rope_parameters": {"rope_theta": "1e6"}}, "rope_parameters.rope_theta must be a number"),
    ({"hidden_size": "256"}, "hidden_size must be a whole number, not a string"),
    ({"vocab_size": True}, "vocab_size must be a whole number, not true/false"),
    ({"max_position_embeddings": "4096"}, "max_position_embeddings must be a whole number"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_config_field_of_the_wrong_type_is_named_not_guessed(checkpoint, tmp_path, capsys,
                                                               config, words):
    """bool("false") read a string as true; "256" and true were coerced to numbers."""
    assert main(_edited_checkpoint(checkpoint, tmp_path, config=config)) == 2
    err = capsys.readouterr().err
    assert words in err and "config.json" in err and "Traceback" not in err


@pytest.mark.parametrize("tensor, how, words", [
    ("model.embed_tokens.weight", _nan, "holds NaN or infinite values"),
    ("model.layers.1.block_sparse_moe.experts.3.w1.weight", lambda t, torch: t.to(torch.int8),
     "is int8"),
], ids=["NaN weight", "int8 tensor"])
def test_weights_that_cannot_run_are_refused_by_name(checkpoint, tmp_path, capsys, tensor, how,
                                                    words):
    """A NaN weight gave token 0 everywhere, 'identical' and a bare NaN in the JSON; an int8
    tensor was cast to float silently."""
    assert main(_edited_checkpoint(checkpoint, tmp_path, tensor=tensor, how=how)) == 2
    out, err = capsys.readouterr()
    assert words in err and tensor in err and "Traceback" not in err and not out


def test_logits_that_overflow_are_an_error_not_identical_tokens(checkpoint, tmp_path, capsys):
    """Finite weights whose activations overflow: NaN logits argmax to token 0 in the run and
    the reference alike, which read as 'identical'."""
    argv = _edited_checkpoint(checkpoint, tmp_path, tensor="model.layers.0.self_attn.o_proj.weight",
                              how=lambda t, torch: t * 1e38)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "logits are NaN or infinite" in err and not out


def test_a_prompt_past_the_model_positions_is_refused(checkpoint, tmp_path, capsys):
    argv = _edited_checkpoint(checkpoint, tmp_path, config={"max_position_embeddings": 16})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [1, 5, 6]}\n'
                       '{"id": "b", "prompt_ids": [' + ", ".join(["3"] * 12) + "], "
                       '"max_new_tokens": 5}\n')
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "max_position_embeddings (16)" in err
    prompts.write_text('{"id": "a", "prompt_ids": [1, 5, 6]}\n')
    assert main(argv[:-3] + ["--set", "workload.gen_len=20"]) == 2   # synthetic prompts
    assert "max_position_embeddings (16)" in capsys.readouterr().err


def test_an_execution_too_long_for_memory_is_refused_up_front(tmp_path, capsys, monkeypatch):
    """gen_len 10^6 on tiny grew past 11 GB in 30 s (a threading.Event per task): refused
    before a runtime is built."""
    pytest.importorskip("torch")
    from taskgraph.exec import runtime

    monkeypatch.setattr(runtime.Runtime, "__init__", _never("the runtime"))
    assert main(["execute", TINY, "--device", "cpu", "--set", "workload.gen_len=1000000"]) == 2
    assert "116,000,068 tasks" in capsys.readouterr().err
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2], "max_new_tokens": 1000000}\n')
    assert main(["execute", TINY, "--device", "cpu", "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "This run needs about" in capsys.readouterr().err
