"""Hostile input, round two, continued: the trace checker's inputs, sizes given on the command
line, signals and a Ray address that never answers. Each ends in one clear error (exit 2) or the
right result, in bounded time and memory, with no traceback and no process left behind."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskgraph.tracing.check import check_trace

CHECK = [sys.executable, "-m", "taskgraph.tracing.check"]


def _limit_memory() -> None:
    import resource

    # the unfixed checker inflated a bomb whole (6 GB); 2 GiB is several times what it needs
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))


def _gzip_bomb(path: Path) -> None:
    """640 MiB of spaces in 640 KB: gzip members concatenate, so one compressed block of 16 MiB
    written 40 times is a valid file."""
    block = gzip.compress(b" " * 16 * 2**20, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(b'{"traceEvents": ['))
        for _ in range(40):
            f.write(block)
        f.write(gzip.compress(b"]}"))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes, devices and rlimits")
@pytest.mark.parametrize("kind, words", [
    ("gzip bomb", "inflates to more than 512 MiB"),
    ("/dev/zero", "is not a regular file"),
    ("fifo", "is not a regular file"),
    ("deep nesting", "nesting deeper than JSON can be read"),
    ("not gzip", "is not gzip data"),
    ("not JSON", "is not JSON"),
    ("missing", "does not exist"),
])
def test_the_trace_checker_reads_only_what_is_a_trace(tmp_path, kind, words):
    path = {"gzip bomb": tmp_path / "bomb.json.gz", "/dev/zero": Path("/dev/zero"),
            "fifo": tmp_path / "fifo.json", "deep nesting": tmp_path / "deep.json",
            "not gzip": tmp_path / "t.json.gz", "not JSON": tmp_path / "t.json",
            "missing": tmp_path / "none.json"}[kind]
    if kind == "gzip bomb":
        _gzip_bomb(path)
    elif kind == "fifo":
        os.mkfifo(path)                     # reading it would wait for a writer for ever
    elif kind == "deep nesting":
        path.write_text('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif kind == "not gzip":
        path.write_bytes(b"\x1f\x8b not really gzip")
    elif kind == "not JSON":
        path.write_text('{"traceEvents": [')
    run = subprocess.run(CHECK + [str(path)], capture_output=True, text=True, timeout=60,
                         preexec_fn=_limit_memory)
    assert run.returncode == 2, run.stderr[-2000:]
    assert words in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == ""


def test_events_that_are_not_objects_are_problems_not_a_crash(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [1, "x", null, [], {"ph": "X", "pid": [1], "ts": 1e400, '
                    '"dur": "1", "name": {"a": 1}}]}')
    run = subprocess.run(CHECK + [str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "event 0: not an object" in run.stdout and "5 problems" in run.stderr


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3), max_leaves=8)
_EVENT = st.fixed_dictionaries({}, optional={
    "ph": st.sampled_from(["M", "X", "s", "f", "C", "B"]) | _JSON,
    "name": st.sampled_from(["process_name", "thread_name", "process_sort_index",
                             "thread_sort_index", "x"]) | _JSON,
    "pid": st.integers(-2, 3) | _JSON, "tid": st.integers(-2, 3) | _JSON,
    "ts": st.floats(-1, 10) | st.integers(-1, 10**30) | _JSON,
    "dur": st.floats(-1, 10) | st.integers(-1, 10**30) | _JSON,
    "id": st.integers(-2, 3) | _JSON, "bp": st.just("e") | _JSON,
    "args": st.dictionaries(st.sampled_from(["sort_index", "name", "v"]), _JSON) | _JSON})


@settings(max_examples=300, deadline=None)
@given(trace=_JSON | st.fixed_dictionaries({"traceEvents": st.lists(_EVENT | _JSON,
                                                                    max_size=8)}))
def test_the_trace_checker_answers_problems_for_any_json(trace):
    """A trace is anyone's file: whatever JSON it holds, the checker lists problems."""
    problems = check_trace(json.loads(json.dumps(trace)))
    assert isinstance(problems, list) and all(len(p) < 1000 for p in problems)


@pytest.mark.parametrize("schedules", ["", " , "])
def test_compare_with_an_empty_schedule_list_says_so(capsys, schedules):
    from taskgraph.cli import main

    assert main(["compare", "scenarios/tiny.yaml", "--schedules", schedules]) == 2
    err = capsys.readouterr().err
    assert "--schedules: names no schedule" in err and "Traceback" not in err


def _cells(tmp_path: Path, **changes) -> Path:
    import yaml

    doc = yaml.safe_load(Path("scenarios/measurements/moe-lightning-multi-gpu.yaml").read_text())
    cell = doc["cells"][0]
    for key, value in changes.items():
        if key == "preset":
            cell["workload"] = {**cell["workload"], "preset": value}
        else:
            cell[key] = value
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"source": "test", "cells": [cell]}))
    return path


@pytest.mark.parametrize("changes, words", [
    ({"preset": "no-such-workload"}, "workload: preset 'no-such-workload' is not a workload "
                                     "preset (mtbench"),
    ({"preset": ["a"]}, "workload: preset ['a'] is not a workload preset"),
    ({"id": "x" * 2**20}, "id: String should have at most 200 characters"),
    ({"machine": "z" * 2**20}, "(1,048,576 characters) is not a preset"),
])
def test_fit_names_a_bad_cell_field_briefly(tmp_path, capsys, changes, words):
    """An unknown workload preset was a KeyError; a 1 MB id was echoed whole in the error."""
    from taskgraph.cli import main

    path = _cells(tmp_path, **changes)
    assert main(["fit", str(path), "--out", str(tmp_path / "out"), "--no-loo"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err) < 600, err[:2000]
    assert not (tmp_path / "out").exists()


TINY = "scenarios/tiny.yaml"
_VALUES = ",".join(str(v) for v in range(1, 10_001))
_PROC = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")


@pytest.mark.parametrize("argv, words", [
    (["simulate", TINY, "--set", "workload.lengths.preset=mtbench", "--set",
      "workload.lengths.count=10000000"],
     "workload.lengths.count: Input should be less than or equal to 1000000"),
    (["simulate", TINY, "--set", "hardware.gpu.count=1000000000"],
     "hardware.gpu.count: Input should be less than or equal to 16"),
    (["graph", TINY, "--set", "policy.N=1000000", "--out", "OUT/g.json"],
     "N / mu = 500,000 micro-batches; tg runs at most 256"),
    (["search", TINY, "--top", "1000000000"], "--top must be from 1 to 100"),
    (["sweep", TINY, "--vary", f"hardware.link.h2d_gbps={_VALUES}", "--out", "OUT/sweep"],
     "--vary gives 10,000 sweep points; tg sweeps at most 1,000"),
    (["validate", TINY, "--repeats", "1000000000"], "--repeats must be from 1 to 100"),
    (["validate", TINY, "--mu", "0"], "--mu 0 is not a micro-batch size"),
    (["validate", TINY, "--schedules", " , "], "--schedules: names no schedule"),
    # an output no file can be created beside was found after the run, which was lost (/proc:
    # no file can be made there, whoever runs the test)
    pytest.param(["execute", TINY, "--device", "cpu", "--record-routing", "/proc/routing.json"],
                 "cannot be written: nothing can be created in '/proc'", marks=_PROC),
    pytest.param(["simulate", TINY, "--trace", "/proc/t.json"],
                 "nothing can be created in '/proc'", marks=_PROC),
    # the search at each point replaced them: every row was the same
    (["sweep", TINY, "--vary", "policy.experts_gpu=1,2", "--out", "OUT/sweep"],
     "--vary policy.experts_gpu: tg sweep searches the best policy"),
])
def test_sizes_beyond_any_run_are_refused_up_front(tmp_path, argv, words):
    """Each of these hung, grew to GBs or was a traceback (a ZeroDivisionError for --mu 0); now
    each is refused at once, naming the option or field and its limit."""
    # a process of its own, so that a size that is not refused fails the test, not hangs it
    run = subprocess.run([sys.executable, "-m", "taskgraph.cli",
                          *[a.replace("OUT", str(tmp_path)) for a in argv]],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert words in run.stderr and "Traceback" not in run.stderr and len(run.stderr) < 2000
    assert list(tmp_path.iterdir()) == []


def test_a_request_file_longer_than_the_limit_is_refused(tmp_path, capsys, monkeypatch):
    """The same bound as workload.lengths.count, for a list read from a file (checked as rows are
    read; the limit is lowered here to keep the file small)."""
    from taskgraph.cli import main
    from taskgraph.serving import requests

    monkeypatch.setattr(requests, "MAX_REQUESTS", 3)
    (tmp_path / "r.csv").write_text("id,prompt_len,gen_len\n" + "".join(
        f"r{i},4,2\n" for i in range(4)))
    (tmp_path / "s.yaml").write_text("model: tiny\nhardware: t4\nworkload: {requests: r.csv}\n"
                                     "policy: {N: 4, mu: 2}\n")
    assert main(["batch", str(tmp_path / "s.yaml")]) == 2
    assert "holds more than 3 requests" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("argv", [
    ["search", "scenarios/t4.yaml", "--verify"],
    ["search", "scenarios/t4.yaml", "--brute-force"],
    # a file of one-GPU cells: its fit compiles them in seconds before its workers start
    ["fit", "scenarios/measurements/small-batch-fiddler-artifact.yaml", "--out", "OUT/fit"],
], ids=["search --verify", "search --brute-force", "fit"])
def test_sigterm_leaves_no_worker_process(tmp_path, argv):
    """SIGTERM used to end tg alone: its pool's workers ran on, orphaned (and one that started
    as the signal came could keep tg itself waiting for it at exit)."""
    import signal

    from tests.helpers import children, wait_for

    proc = subprocess.Popen([sys.executable, "-m", "taskgraph.cli",
                             *[a.replace("OUT", str(tmp_path)) for a in argv]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: proc.poll() is not None or len(children(proc.pid)) >= 2,
                 what="the pool's worker processes")
        workers = children(proc.pid)
        assert proc.poll() is None, "tg ended before the test could signal it"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143 and "Traceback" not in err, err[-2000:]
        assert "terminated" in err
        wait_for(lambda: not any(_alive(w) for w in workers), timeout_s=30,
                 what="the workers' end")
        assert not (tmp_path / "fit").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _interrupt_the_first_wait(monkeypatch) -> list[int]:
    """The executor's first wait for a task interrupted as Ctrl-C would; the waits counted."""
    from taskgraph.exec import dispatch

    wait, calls = dispatch._wait, []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return wait(*args, **kwargs)

    monkeypatch.setattr(dispatch, "_wait", interrupted_once)
    return calls


def test_an_interrupted_calibration_writes_no_profile(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the executor measured its tasks was caught by the executor (which keeps a
    run's partial times for its trace), and calibrate fitted a profile to the partial run,
    wrote it and exited 0. Here the executor's wait is interrupted as Ctrl-C would."""
    pytest.importorskip("torch")
    from taskgraph.cli import main

    calls = _interrupt_the_first_wait(monkeypatch)
    out = tmp_path / "p.yaml"
    assert main(["calibrate", "scenarios/tiny.yaml", "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert calls and list(tmp_path.iterdir()) == []


def test_ctrl_c_while_validate_warms_up_stops_it(tmp_path, capsys, monkeypatch):
    """validate's first execution is a warm-up whose times are dropped; Ctrl-C there must stop
    the command as anywhere else (it was swallowed with the warm-up's times once)."""
    pytest.importorskip("torch")
    from taskgraph.cli import main

    calls = _interrupt_the_first_wait(monkeypatch)
    plot = tmp_path / "parity.png"
    assert main(["validate", "scenarios/tiny.yaml", "--schedules", "S1", "--repeats", "1",
                 "--plot", str(plot)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert calls and not plot.exists()


def _loopback_server(answer: bytes | None):
    """A server on 127.0.0.1 that accepts every connection and then says `answer` (None:
    nothing, ever). Returns its port and a function that stops it."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()

    def stop():
        server.close()
        for conn in held:
            conn.close()

    return server.getsockname()[1], stop


@pytest.mark.parametrize("answer, words", [
    (None, "accepts connections there but does not answer within 10 s"),
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "is not a Ray node (it does not speak gRPC)"),
])
def test_a_ray_address_that_never_answers_is_a_clear_error(answer, words):
    """ray.init waited on a port that accepted and stayed silent for more than 90 s: tg's own
    check answers first (its words say which check), and the run ends before the 90 s bound."""
    pytest.importorskip("ray")
    port, stop = _loopback_server(answer)
    try:
        run = subprocess.run([sys.executable, "-m", "taskgraph.cli", "search", TINY, "--verify",
                              "--backend", "ray", "--ray-address", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=90)
        assert run.returncode == 2 and words in run.stderr, run.stderr[-2000:]
        assert "Traceback" not in run.stderr
    finally:
        stop()
