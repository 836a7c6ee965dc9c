"""Interference: tasks slowing down what they overlap (sim/interference.py) and its fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskgraph.dag.compiled import compile_plan
from taskgraph.dag.builder import make_plan
from taskgraph.perf.cost import CostModel
from taskgraph.errors import TgError
from taskgraph.dag.schedules import RESOURCES
from taskgraph.sim.engine import simulate
from taskgraph.sim.interference import (busy_fractions, covered_fraction,
                                        simulate_with_interference)
from taskgraph.sim.simulate import simulate_scenario
from tests.helpers import tiny

intervals = st.lists(st.tuples(st.floats(0, 100), st.floats(0, 20)), min_size=1, max_size=30)


@given(intervals, intervals)
def test_covered_fraction_matches_a_fine_grid(targets, covers):
    """Against brute force: the covered share of each target on a grid of 1/64 time units."""
    start = np.array([a for a, _ in targets + covers])
    end = start + np.array([d for _, d in targets + covers])
    start, end = np.round(start * 64) / 64, np.round(end * 64) / 64   # exact on the grid
    by = np.arange(len(start)) >= len(targets)
    got = covered_fraction(start, end, by)
    grid = np.arange(0, 128 * 64) / 64 + 1 / 128                      # cell midpoints
    covered = np.zeros(len(grid), dtype=bool)
    for a, b in zip(start[by], end[by]):
        covered |= (grid >= a) & (grid < b)
    for i in range(len(targets)):
        cells = (grid >= start[i]) & (grid < end[i])
        want = covered[cells].mean() if cells.any() else 0.0
        assert got[i] == pytest.approx(want, abs=1e-9)


def test_busy_fractions_leave_out_the_tasks_own_resource():
    start, end = np.array([0.0, 0.0, 5.0]), np.array([10.0, 10.0, 10.0])
    resource = np.array([0, 0, 1])
    f = busy_fractions(start, end, resource)
    assert f[0, 0] == 0 and f[0, 1] == pytest.approx(0.5) and f[2, 0] == pytest.approx(1.0)
    assert f.shape == (3, len(RESOURCES))


def _interfering(**slowdown):
    return tiny(hardware={"preset": "t4", "interference": {"slowdown": slowdown}})


def test_no_interference_is_the_plain_simulation():
    sc = _interfering(gpu={"cpu": 0.0})
    program = compile_plan(make_plan(sc))
    cost = CostModel(sc.hardware)
    a, b = simulate_with_interference(program, cost), simulate(program, cost)
    assert np.array_equal(a.end, b.end)


def test_interference_slows_overlapped_tasks_to_a_fixed_point():
    sc = _interfering(gpu={"h2d": 0.8, "pin": 0.5}, cpu={"gpu": 0.3})
    plain = simulate_scenario(tiny())
    run = simulate_scenario(sc).run
    base = plain.run.durations
    assert (run.durations >= base * (1 - 1e-12)).all()
    assert run.durations.sum() > base.sum() * 1.01          # something did overlap
    assert run.end.max() > plain.run.end.max()
    # At the fixed point each task lasts what its overlaps in this very run say, within the
    # iteration's tolerance.
    resource = run.program.column("resource")
    f = busy_fractions(run.start, run.end, resource)
    factors = np.zeros((len(RESOURCES), len(RESOURCES)))
    factors[0, RESOURCES.index("h2d")], factors[0, RESOURCES.index("pin")] = 0.8, 0.5
    factors[1, 0] = 0.3
    want = base * (1 + (factors[resource] * f).sum(axis=1))
    assert np.allclose(run.durations, want, rtol=5e-3)


@pytest.mark.parametrize("slowdown, message", [
    ({"gpu": {"nvlink": 0.1}}, "unknown resource 'nvlink'"),
    ({"gpu": {"gpu": 0.1}}, "cannot slow itself"),
    ({"cpu": {"gpu": -0.5}}, "must be >= 0"),
])
def test_bad_interference_is_a_clear_error(slowdown, message):
    with pytest.raises(TgError, match=message) as err:
        _interfering(**slowdown)
    assert "hardware.interference" in str(err.value)


@settings(max_examples=20, deadline=None)
@given(st.floats(0.05, 1.5), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_fit_recovers_known_slowdowns(a_cpu, a_h2d, seed):
    _check_fit_recovers(a_cpu, a_h2d, seed)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.floats(0.05, 1.5), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_fit_recovers_known_slowdowns_long(a_cpu, a_h2d, seed):
    _check_fit_recovers(a_cpu, a_h2d, seed)


def _check_fit_recovers(a_cpu, a_h2d, seed):
    """Synthetic tasks with a known cost and known factors, 10% noise and a few preempted ones:
    the fit finds the factors again."""
    pytest.importorskip("torch")
    from taskgraph.study.calibrate import _fit_slowdown, _Samples

    rng = np.random.default_rng(seed)
    n = 600
    smp = _Samples(RESOURCES.index("gpu"))
    x = rng.choice([1e6, 2e6, 4e6], n)
    alone = 50e-6 + x / 5e9
    busy = np.zeros((n, len(RESOURCES)))
    busy[:, 1] = rng.uniform(0, 1, n) * (rng.uniform(0, 1, n) < 0.6)
    busy[:, 2] = rng.uniform(0, 1, n) * (rng.uniform(0, 1, n) < 0.6)
    y = alone * (1 + a_cpu * busy[:, 1] + a_h2d * busy[:, 2]) * rng.normal(1, 0.1, n)
    y[rng.choice(n, 10, replace=False)] *= 5                      # preempted by the OS
    smp.add(nbytes=x, roof=x / 5e9, measured=y, busy=busy)
    got = _fit_slowdown({"PostAttn": smp})["gpu"]
    assert got.get("cpu", 0.0) == pytest.approx(a_cpu, abs=0.15)
    assert got.get("h2d", 0.0) == pytest.approx(a_h2d, abs=0.15)
