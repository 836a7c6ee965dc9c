"""Tasks slowing down what they overlap, solved as a fixed point of whole simulations.

A task's slowdown depends on what overlaps it, which depends on every task's duration, so it
cannot be known when the task starts (the engine fixes a task's end at its start). Instead the run
is simulated, each slowed task's duration is recomputed from what overlapped it in that run, and
the run is simulated again with the new durations until no duration moves by more than ``tol``.
A pass that moves durations more than the one before (the iteration oscillates) switches to
damped steps, half-way between old and new. Scenarios without an ``interference`` profile are
simulated once, as before.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from taskgraph.compiled import Program
from taskgraph.cost import CostModel
from taskgraph.schedules import RESOURCES
from taskgraph.sim.engine import SimRun, simulate


def covered_fraction(start: np.ndarray, end: np.ndarray, by: np.ndarray) -> np.ndarray:
    """For every interval ``[start, end)``, the fraction of it covered by the union of the
    intervals selected by the mask `by` (NaN intervals, tasks that never ran, are ignored)."""
    sel = by & ~np.isnan(end)
    s, e = start[sel], end[sel]
    out = np.zeros(len(start))
    if not len(s):
        return out
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    first = np.concatenate(([True], s[1:] > reach[:-1]))   # starts a new piece of the union
    us = s[first]
    ue = np.maximum.reduceat(e, np.flatnonzero(first))
    before = np.concatenate(([0.0], np.cumsum(ue - us)))   # union length before piece i

    def union_below(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(us, t, side="right") - 1
        j = np.maximum(i, 0)
        inside = np.clip(t - us[j], 0.0, ue[j] - us[j])
        return np.where(i >= 0, before[j] + inside, 0.0)

    ok = ~np.isnan(end) & (end > start)
    a, b = start[ok], end[ok]
    out[ok] = (union_below(b) - union_below(a)) / (b - a)
    return out


def busy_fractions(start: np.ndarray, end: np.ndarray, resource: np.ndarray) -> np.ndarray:
    """(tasks x resources): the fraction of each task's run during which each resource was busy;
    0 for the task's own resource (a resource does not overlap itself)."""
    out = np.stack([covered_fraction(start, end, resource == r)
                    for r in range(len(RESOURCES))], axis=1)
    out[np.arange(len(resource)), resource] = 0.0
    return out


def slowdown_matrix(hardware) -> np.ndarray:
    """(victim x aggressor) factors of a hardware profile's interference; zeros if it has none."""
    out = np.zeros((len(RESOURCES), len(RESOURCES)))
    spec = hardware.interference
    for victim, by in (spec.slowdown if spec else {}).items():
        for aggressor, x in by.items():
            out[RESOURCES.index(victim), RESOURCES.index(aggressor)] = x
    return out


def simulate_with_interference(program: Program, cost: CostModel,
                               progress: Callable[[int], None] | None = None,
                               tol: float = 1e-3, max_passes: int = 30) -> SimRun:
    """Simulate `program` with the hardware profile's interference (see module docstring)."""
    base = program.durations(cost)
    matrix = slowdown_matrix(cost.hardware)
    if not matrix.any():
        return simulate(program, cost, progress, base)
    resource = program.column("resource")
    factors = matrix[resource]                    # per task: its slowdown by each resource
    durations, step, moved = base, 1.0, np.inf
    for n in range(max_passes):
        run = simulate(program, cost, progress if n == 0 else None, durations)
        if run.interrupted:
            break
        f = busy_fractions(run.start, run.end, resource)
        target = base * (1.0 + np.einsum("ij,ij->i", factors, f))
        change = float(np.max(np.abs(target - durations) / np.maximum(durations, 1e-12)))
        if change <= tol:
            break
        if change > moved:
            step = 0.5
        moved = change
        durations = durations + step * (target - durations)
    return run
