"""Tasks slowing down the tasks they overlap, solved as a fixed point of whole simulations.

Two mechanisms slow a task by what runs beside it: a hardware profile's ``interference`` factors
(tasks on one resource slowed by the time another is busy) and the host's shared pools
(:mod:`taskgraph.sim.contention`: memory bandwidth and PCIe lanes divided among the tasks drawing
on them). A task's slowdown depends on what overlaps it, which depends on every task's duration,
so it cannot be known when the task starts (the engine fixes a task's end at its start). Instead
the run is simulated, each slowed task's duration is recomputed from what overlapped it in that
run, and the run is simulated again with the new durations until no duration moves by more than
``tol`` (with pools: or the run as a whole, its makespan, by less than ``tol``; the tasks that
carry the pools' bytes then sit within a fraction of a percent of their fixed point, while a few
short ones that draw little may not settle at all). A pass that moves durations
more than the one before (the iteration oscillates: a short task's overlaps can flip with a tiny
shift) switches to shrinking steps, ``1 / sqrt(k)`` of the way from old to new at the k-th, which
settle where full steps would circle: on a pool three times oversubscribed, within 5% of its
bytes over its capacity, where half steps circled 25% above. Scenarios with neither are
simulated once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from taskgraph.dag.builder import lookahead_steps
from taskgraph.dag.compiled import Program
from taskgraph.dag.schedules import RESOURCES
from taskgraph.perf.cost import CostModel
from taskgraph.sim.contention import pool_speed
from taskgraph.sim.engine import Recorder, SimRun, simulate


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
                               tol: float = 1e-3, max_passes: int = 30,
                               recorder: Callable[[Program], Recorder] | None = None) -> SimRun:
    """Simulate `program` with the hardware profile's interference and shared pools (see
    module docstring). A long run starts from the slowdowns of short ones: every decode step
    has the same shape, so a few steps solved to their fixed point at contexts along the run
    say how much each task of a step is slowed, and the whole run then needs a pass or two,
    not a dozen.

    With a `recorder` (a run too long to hold whole: :class:`taskgraph.sim.metrics.Summarizing`)
    the run is one pass at the short runs' slowdowns, decided and recorded block by block."""
    slowed = slowdown_matrix(cost.hardware).any() or cost.pools_shared
    if not slowed:
        return simulate(program, cost, progress, recorder=recorder or Recorder)
    warm = _steady_slowdowns(program, cost, tol, max_passes)
    if warm is _INTERRUPTED:      # Ctrl-C while the short run was solved: nothing of this ran
        return (recorder or Recorder)(program).result(True, 0.0)
    if recorder is not None:
        def durations(part: Program) -> np.ndarray:
            base = part.durations(cost)
            return base if warm is None else base * warm(part)
        return simulate(program, cost, progress, durations, recorder)
    base = program.durations(cost)
    return _fixed_point(program, cost, base, base if warm is None else base * warm(program),
                        progress, tol, max_passes)


_INTERRUPTED = object()      # what _steady_slowdowns says when Ctrl-C stopped it


def _fixed_point(program: Program, cost: CostModel, base: np.ndarray, durations: np.ndarray,
                 progress: Callable[[int], None] | None, tol: float, max_passes: int) -> SimRun:
    """Simulate, recompute every task's duration from what overlapped it, repeat (see the
    module docstring)."""
    matrix = slowdown_matrix(cost.hardware)
    resource = program.column("resource")
    drawn = program.pool_bytes(cost) if cost.pools_shared else None
    factors = matrix[resource]                    # per task: its slowdown by each resource
    damped, moved, makespan = 0, np.inf, np.nan
    for n in range(max_passes):
        run = simulate(program, cost, progress if n == 0 else None, durations)
        if run.interrupted:
            break
        target = base
        if matrix.any():
            f = busy_fractions(run.start, run.end, resource)
            target = base * (1.0 + np.einsum("ij,ij->i", factors, f))
        if drawn is not None:
            # what each task would draw alone, at its duration without the pools
            alone = np.divide(drawn, target, out=np.zeros_like(drawn), where=target > 0)
            speed = np.ones(len(base))
            for p, capacity in enumerate(cost.pool_capacity):
                if np.isfinite(capacity) and drawn[p].any():
                    speed = np.minimum(speed, pool_speed(run.start, run.end, alone[p],
                                                         capacity))
            target = target / speed
        change = float(np.max(np.abs(target - durations) / np.maximum(durations, 1e-12)))
        last, makespan = makespan, float(np.nanmax(run.end))
        # Pools: a short task drawing little can flip between overlapping a burst or not with
        # any shift, so some never settle; the run as a whole does.
        if change <= tol or (drawn is not None and abs(makespan - last) <= tol * makespan):
            break
        if change > moved or damped:
            damped += 1
        moved = change
        durations = durations + (target - durations) / np.sqrt(damped + 1)
    return run


#: Short runs solved along a long one for its slowdowns: what overlaps a task changes as the
#: context grows (on 4xT4, CPU attention's slowdown falls from 2.09 to 1.86 over 128 steps while
#: the weight copies' rises from 1.79 to 1.90), so one short run at the start of a long one
#: misses its later steps (4xt4-8x22b.yaml: 2.4% fast against the whole run's fixed point).
PROBES = 5


def _steady_slowdowns(program: Program, cost: CostModel, tol: float, max_passes: int
                      ) -> Callable[[Program], np.ndarray] | object | None:
    """The factor each task's duration is slowed by, from runs of the same plan cut to a few
    decode steps at contexts along the run, each solved to its fixed point, as a function of a
    part of `program` (or the whole) giving its tasks' factors. The first and last steps take
    those of the short runs that begin and end as the run does; each middle step, those of a
    middle step of the short runs at the contexts either side of its own, interpolated by its
    step. None for a run short enough to solve whole, or one of real requests; _INTERRUPTED if
    Ctrl-C stopped it."""
    plan = program.plan
    horizon = lookahead_steps(plan)
    # Prefill, the first step, two middle ones and the last ones: the second middle step, the
    # one that stands for the run's, is further from the prefill's tail (with one, S2 on 4xT4
    # streamed 0.5% fast of its fixed point; with two, 0.25%; with four, as two).
    steps = horizon + 4
    if plan.load is not None or plan.G <= 2 * steps:
        return None
    middle = steps - horizon - 1    # a short run's segment whose shape is a middle step's
    sc = plan.scenario
    short = dataclasses.replace(plan, scenario=sc.model_copy(update={
        "workload": sc.workload.model_copy(update={"gen_len": steps})}))
    # The short run's segments are the long run's templates: prefill, the first step, middle
    # steps, and the last steps (those a schedule's lookahead reaches past).
    same = [d if d <= middle else plan.G - (steps - d) for d in range(steps + 1)]
    seg_template = program.seg_template[same]
    sizes = np.array([program.templates[t].size for t in seg_template])
    seg_base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    # Short run k's decode step s sees the context of the long run's step shifts[k] + s: the
    # first is the run's beginning, the last its end.
    # At most PROBES, and in all at most about a quarter of the run's steps: a run short
    # enough to hold is solved whole from here, and its probes would cost what it does.
    probes = int(np.clip((plan.G + 1) // (4 * (steps + 1)), 2, PROBES))
    shifts = np.unique(np.linspace(0, plan.G - steps, probes).round().astype(int))
    slowdowns = []
    for shift in shifts:
        probe = Program(short, program.streams, program.templates, seg_template, seg_base,
                        int(sizes.sum()), context_shift=int(shift))
        base = probe.durations(cost)
        run = _fixed_point(probe, cost, base, base, None, tol, max_passes)
        if run.interrupted:
            return _INTERRUPTED
        slowdowns.append(np.divide(run.durations, base, out=np.ones_like(base),
                                   where=base > 0))
    first, last = slowdowns[0], slowdowns[-1]
    mid = slice(seg_base[middle], seg_base[middle] + sizes[middle])
    middles = np.stack([s[mid] for s in slowdowns])     # (short runs, a middle step's tasks)
    at = shifts + middle                                # the long run's step each stands for

    def of(part: Program) -> np.ndarray:
        """The factors of `part`'s tasks, segment by segment."""
        out = []
        for d in range(part.first_segment, part.first_segment + len(part.seg_template)):
            if d <= middle:
                out.append(first[seg_base[d]:seg_base[d] + sizes[d]])
            elif plan.G - d <= horizon:
                k = steps - (plan.G - d)
                out.append(last[seg_base[k]:seg_base[k] + sizes[k]])
            else:
                k = min(int(np.searchsorted(at, d, side="right")), len(at) - 1)
                w = (d - at[k - 1]) / (at[k] - at[k - 1])
                out.append((1 - w) * middles[k - 1] + w * middles[k])
        return np.concatenate(out)
    return of
