"""`tg sweep --backend ray` under SIGINT, SIGTERM and SIGHUP (issue 40): each ends the run in
seconds with its own exit status and one line on stderr, and leaves no Ray process, no Ray
session folder and no half-written output. Before, SIGHUP could end in a segfault, SIGTERM in
status 15 or 1 and a C++ stack trace, two Ray processes outlived tg and every run left
its session folder in the temp dir."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.helpers import wait_for

pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals, /proc")

ROOT = Path(__file__).resolve().parent.parent


def _session(sid: int) -> dict[int, str]:
    """The live processes of session `sid` (the run's: tg and every Ray process it started),
    by pid, with their command lines."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                found[int(entry)] = open(f"/proc/{entry}/cmdline").read().replace("\0", " ")
        except OSError:
            pass              # it ended as we looked
    return found


@pytest.fixture
def temp_dir():
    """The run's TMPDIR, where Ray puts its session folder. Not tmp_path: Ray's socket paths
    in it must fit in 107 bytes, and pytest's folders are too deep for that."""
    path = tempfile.mkdtemp(prefix="tg-t")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _cancelled(how: str) -> str:
    return rf"tg: {how} with [0-2] of 2 jobs finished; the rest were cancelled\."


@pytest.mark.parametrize("sig, when, code, lines", [
    (signal.SIGINT, "running", 130, [_cancelled("interrupted")]),     # one line, as the rest
    (signal.SIGTERM, "running", 143, [_cancelled("terminated")]),
    (signal.SIGHUP, "running", 129, [_cancelled("hung up")]),
    (signal.SIGTERM, "starting", 143, [_cancelled("terminated")]),
], ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGTERM as Ray starts"])
def test_a_signal_ends_a_ray_sweep_cleanly(tmp_path, temp_dir, sig, when, code, lines):
    out = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskgraph.cli", "sweep", "scenarios/t4.yaml",
         "--vary", "hardware.link.h2d_gbps=10,20", "--out", str(out), "--backend", "ray"],
        cwd=ROOT, env=dict(os.environ, TMPDIR=str(temp_dir)), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    # running: a Ray worker runs a job (its title is the task's); starting: Ray's raylet is
    # up but tg is still in ray.init
    mark = "ray::_run" if when == "running" else "/raylet"
    try:
        wait_for(lambda: proc.poll() is not None
                 or any(mark in cmd for cmd in _session(proc.pid).values()),
                 what=f"the run's {mark} process")
        assert proc.poll() is None, "".join(err)
        before = len(err)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        reader.join(timeout=10)
        said = [line.rstrip("\n") for line in err[before:]]
        assert proc.returncode == code, "".join(err)[-3000:]
        assert len(said) == len(lines) and all(
            re.fullmatch(pattern, line) for pattern, line in zip(lines, said)), said
        assert not _session(proc.pid), "Ray processes outlived the run"
        assert not os.listdir(temp_dir), "the run left files in the temp dir"
        assert not out.exists() or not os.listdir(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _session(proc.pid):
            os.kill(pid, signal.SIGKILL)
