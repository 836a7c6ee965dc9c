"""Jobs on a process pool and on Ray: the same results in the same order, progress as jobs
finish, a job's own error raised as itself, and Ctrl-C cancelling what has not finished."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from taskgraph.cli import main
from taskgraph.errors import TgError
from taskgraph.study.jobs import Backend, run_jobs
from tests.helpers import wait_for

TINY = "scenarios/tiny.yaml"


@dataclass(frozen=True)
class Sleepy:
    """Sleeps, then leaves a file: a job that finishes out of order and shows whether it ran.
    With `started`, it first leaves its process id there (Ray's workers are not the test's
    children: the test waits for those processes to end)."""

    value: int
    delay: float
    mark: str | None = None
    started: str | None = None

    def run(self) -> int:
        if self.started:
            Path(self.started, str(self.value)).write_text(str(os.getpid()))
        time.sleep(self.delay)
        if self.mark:
            Path(self.mark).write_text(str(self.value))
        return self.value * self.value


@dataclass(frozen=True)
class Failing:
    def run(self) -> None:
        raise TgError("policy.mu: this job's own error")


def _backends() -> list:
    out = [pytest.param(Backend(workers=2), id="pool")]
    try:
        import ray  # noqa: F401
        out.append(pytest.param(Backend("ray"), id="ray"))
    except ImportError:
        out.append(pytest.param(None, id="ray", marks=pytest.mark.skip("Ray is not installed")))
    return out


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray with two CPUs for the module; `run_jobs` uses it rather than start its own."""
    ray = pytest.importorskip("ray")
    # its own Ray, even beside a cluster someone started on this machine (`ray start`)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def backend(request, local_ray_if_needed):
    return request.param


@pytest.fixture
def local_ray_if_needed(request):
    if request.node.callspec.id.startswith("ray"):
        request.getfixturevalue("local_ray")


@pytest.mark.parametrize("backend", _backends(), indirect=True)
def test_results_come_back_in_job_order_and_progress_as_jobs_finish(backend):
    jobs = [Sleepy(i, 0.6 - 0.1 * i) for i in range(6)]       # the last finishes first
    seen = []
    results = run_jobs(jobs, backend, progress=lambda done, total: seen.append((done, total)))
    assert results == [i * i for i in range(6)]
    assert seen[-1] == (6, 6) and all(t == 6 for _, t in seen)
    assert [d for d, _ in seen] == sorted({d for d, _ in seen})     # rising, each once


@pytest.mark.parametrize("backend", _backends(), indirect=True)
def test_a_jobs_error_is_raised_as_itself(backend):
    with pytest.raises(TgError, match="this job's own error"):
        run_jobs([Sleepy(1, 0.0), Failing()], backend)


@pytest.mark.parametrize("backend", _backends(), indirect=True)
def test_ctrl_c_cancels_the_jobs_not_finished(backend, tmp_path, capsys):
    """The first job to finish raises KeyboardInterrupt in the caller (as Ctrl-C would); the
    slow jobs, running or queued, must never write their files."""
    marks, started = tmp_path / "marks", tmp_path / "started"
    marks.mkdir()
    started.mkdir()
    jobs = [Sleepy(0, 0.0, str(marks / "0"))]
    jobs += [Sleepy(i, 2.0, str(marks / str(i)), str(started)) for i in range(1, 5)]

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as stopped:
        run_jobs(jobs, backend, progress=interrupt)
    assert "jobs finished; the rest were cancelled" in capsys.readouterr().err
    assert stopped.value.said           # so the CLI does not say "interrupted." once more
    if backend.kind == "ray":
        # a cancelled job's worker is killed (queued ones never start): once every slow job
        # that started has no process left, nothing can write a mark any more
        pids = [int(f.read_text()) for f in started.iterdir()]
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and
                                 open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                                 for pid in pids), 60, "the cancelled jobs' workers to end")
    else:
        # once the pool's workers have exited, nothing can write a mark any more. They are
        # killed, but the pool's own thread reaps them: a join here can return before that
        # thread has recorded the exit, so wait for the record rather than join once.
        wait_for(lambda: not multiprocessing.active_children(), 30, "the pool's workers to end")
    assert sorted(p.name for p in marks.iterdir()) == ["0"]


@pytest.mark.heavy
def test_a_ray_sweep_equals_the_pool_sweep(local_ray, tmp_path, capsys):
    """The issue's check: a small sweep on a local two-CPU Ray and on the process pool."""
    args = ["sweep", TINY, "--vary", "hardware.link.h2d_gbps=1,4,16", "--vary",
            "hardware.cpu.tflops=0.5,2", "--json"]
    assert main(args + ["--out", str(tmp_path / "pool")]) == 0
    pool = json.loads(capsys.readouterr().out)["rows"]
    assert main(args + ["--out", str(tmp_path / "ray"), "--backend", "ray"]) == 0
    ray_rows = json.loads(capsys.readouterr().out)["rows"]
    assert ray_rows == pool and len(pool) == 6
    assert (tmp_path / "ray" / "sweep.csv").read_text() == \
        (tmp_path / "pool" / "sweep.csv").read_text()


@pytest.mark.heavy
def test_ray_search_verify_and_brute_force_equal_the_pool(local_ray, capsys):
    from taskgraph.scenario import load_scenario
    from taskgraph.study.search import Grid, brute_force

    args = ["search", TINY, "--top", "4", "--verify", "--json"]
    assert main(args) == 0
    pool = json.loads(capsys.readouterr().out)
    assert main(args + ["--backend", "ray"]) == 0
    on_ray = json.loads(capsys.readouterr().out)
    for out in (pool, on_ray):
        out.pop("wall_s")
    assert on_ray == pool and pool["verified"]
    grid = Grid(mu=(1, 2), r_w=(0.0, 0.5), r_c=(0.0, 1.0))
    sc = load_scenario(TINY)
    simulated = [(c.schedule, c.policy, c.simulated_tok_s) for c in
                 brute_force(sc, grid, Backend(workers=2))]
    assert [(c.schedule, c.policy, c.simulated_tok_s) for c in
            brute_force(sc, grid, Backend("ray"))] == simulated and len(simulated) > 4


def test_ray_fit_equals_the_pool(local_ray, tmp_path):
    from taskgraph.study.fit import run_fit
    from taskgraph.study.measurements import load_measurements

    path = tmp_path / "m.yaml"
    path.write_text(json.dumps({"source": "synthetic", "cells": [
        {"id": f"t4-{s}", "system": "x", "schedule": s, "machine": "t4", "model": "mixtral-8x7b",
         "workload": {"preset": "helm-reasoning", "gen_len": 2, "padded": True},
         "policy": {"mu": mu, "n_ub": 2}, "measured_tok_s": tok_s}
        for s, mu, tok_s in (("S1", 8, 3.0), ("S3", 16, 1.0), ("S4", 16, 1.5))]}))
    source, cells = load_measurements(path)
    pool = run_fit(source, cells, backend=Backend(workers=2))
    on_ray = run_fit(source, cells, backend=Backend("ray"))
    assert on_ray.to_json() == pool.to_json()
    assert pool.summary()["loo_max_abs_error"] is not None


def test_backend_errors_are_clear(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "s")
    sweep = ["sweep", TINY, "--vary", "workload.gen_len=1,2", "--out", out]
    cases = [
        (["--ray-address", "auto"], "needs --backend ray"),
        (["--backend", "ray", "--ray-address", "127.0.0.1:1"], "nothing answers there"),
        (["--backend", "ray", "--ray-address", "no-port"], "must be 'auto', HOST:PORT"),
    ]
    for extra, message in cases:
        assert main(sweep + extra) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "ray", None)           # as if Ray were not installed
    assert main(sweep + ["--backend", "ray"]) == 2
    assert "pip install -e '.[ray]'" in capsys.readouterr().err
    assert not Path(out).exists()
