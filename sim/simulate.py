"""Scenario in, simulated run out: plan, memory check, compile, simulate, summarise.

This is the library entry point behind `tg simulate` and `tg compare`.
"""

from __future__ import annotations

import functools
import numbers
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from taskgraph.dag.builder import Plan, make_plan
from taskgraph.dag.compiled import Program, compile_plan
from taskgraph.errors import LongRunWarning, MemoryFitError, TgError
from taskgraph.output.report import Shown, simulate_table, warnings_of
from taskgraph.perf.cost import POOL_NAMES, POOLS, cost_model
from taskgraph.perf.memory import MemoryReport, check_fits, memory_footprint
from taskgraph.sim.engine import SimRun
from taskgraph.sim.interference import simulate_with_interference
from taskgraph.sim.metrics import Summarizing, summarize
from taskgraph.specs import PREFETCH_PUBLISHED, Scenario
from taskgraph.tracing.writer import Traced, TraceRun


@dataclass
class Simulation(Shown, Traced):
    """One schedule's run of a scenario: its plan, tasks, task times and figures (`summary`,
    the JSON of `tg simulate`)."""

    plan: Plan
    program: Program
    memory: MemoryReport
    run: SimRun
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.summary

    def views(self):
        yield simulate_table(self.summary)
        yield from warnings_of(self.summary)

    def trace_runs(self) -> list[TraceRun]:
        return [self.trace_run()]

    def gantt_runs(self) -> list[TraceRun]:
        return [self.trace_run(f"{self.summary['schedule']} simulated")]

    def trace_run(self, label: str = "simulated") -> TraceRun:
        return trace_run_of(self.plan, self.program, self.run, label)


def trace_run_of(plan: Plan, program: Program, run: Any, label: str,
                 measured: bool = False) -> TraceRun:
    """A run's tasks and times (simulated or measured) as a trace draws them, with what each
    drew from the host's shared pools where they are priced, and, simulated, the share of each
    copy that writes back (a swapping cache's: the executor's cache does not swap)."""
    cost = cost_model(plan.scenario, plan.schedule.name)
    drawn = program.pool_bytes(cost) if cost.pools_shared else ()
    pools = {POOL_NAMES[p]: drawn[i] for i, p in enumerate(POOLS)
             if len(drawn) and np.isfinite(cost.pool_capacity[i])}
    kept = len(program.seg_template) - 1        # decode steps whose times were kept
    return TraceRun(label, program, run.start, run.end, pools=pools,
                    kept_steps=kept if kept < plan.G else None,
                    written_back=None if measured else cost.kind_written_back)


#: A run of at most this many tasks is held whole (every task's times, ~150 bytes a task); a
#: longer one is decided block by block into its figures, keeping the task times of only the
#: steps asked for, so that its memory does not grow with its length. Where tasks slow each
#: other (interference, shared pools), a run held whole is solved as a fixed point of whole
#: runs; a longer one is one pass at the slowdowns of short runs solved along it, within the
#: fixed point's own tolerance of it (bench/pool_solve.py) in a fraction of its time and memory.
HOLD_TASKS = 2_000_000


def simulate_scenario(scenario: Scenario, schedule: str | None = None,
                      progress: Callable[[int, int], None] | None = None,
                      over_memory: bool = False, keep_steps: int | None = 2) -> Simulation:
    """Simulate a scenario with its own schedule or `schedule`. `progress(done, total)` is
    called once per segment (prefill, then each decode step). A policy that needs more memory
    than the machine has is refused, unless `over_memory` (a run that did happen: the memory
    model is what is wrong), when the result's warnings say so. A run longer than
    :data:`HOLD_TASKS` keeps the task times of prefill and `keep_steps` decode steps (None:
    all) for traces and charts; its figures cover every step either way."""
    if keep_steps is not None and (isinstance(keep_steps, bool)
                                   or not isinstance(keep_steps, numbers.Integral)
                                   or keep_steps < 0):
        raise TgError(f"keep_steps is a number of decode steps (0 or more) or None, not "
                      f"{keep_steps!r}.")
    t0 = time.perf_counter()
    plan = make_plan(scenario, schedule)
    memory = memory_footprint(plan)
    try:
        warnings = check_fits(memory, plan.schedule.name)
    except MemoryFitError as err:
        if not over_memory:
            raise
        warnings = [str(err)]
    program = compile_plan(plan)
    cost = cost_model(scenario, plan.schedule.name)
    held = program.total <= HOLD_TASKS or keep_steps is None
    if held:
        check_size(program.total)
        recorder = None
    else:
        keep = min(keep_steps + 1, len(program.seg_template))
        check_size(program.part(0, keep).total)
        recorder = functools.partial(Summarizing, cost=cost, keep=keep)
    announce_long_run(scenario, plan, program.total)
    total = len(program.seg_template)
    tick = (lambda d: progress(d, total)) if progress else None
    run = simulate_with_interference(program, cost, tick, recorder=recorder)
    summary = summarize(run, memory, cost)
    if scenario.hardware.assumed:
        warnings.append(f"hardware: local: {scenario.hardware.assumed}.")
    if plan.work.prefetches and scenario.policy.prefetch is None:
        warnings.append(
            f"policy.prefetch is unset: ECP's predictor is taken to fetch {PREFETCH_PUBLISHED:.1%} "
            "of the cache's misses right, FATE's published figure for it on other MoEs "
            "(docs/experts.md). Give the share yours reaches; tg execute --schedule ECP "
            "measures it on a checkpoint.")
    summary["warnings"] = warnings
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    return Simulation(plan, run.program, memory, run, summary)


#: Tasks a second the simulator handles at most (about 500,000 on one core of this 2-core
#: machine, unloaded, on t4.yaml and tiny.yaml at 20,000 steps): a run takes at least its
#: tasks at this pace, so an estimate from it never says a long run is short.
TASKS_PER_S = 1_000_000
#: A run that will take at least this long is announced before it starts.
ANNOUNCE_S = 120


def announce_long_run(scenario: Scenario, plan, tasks: int) -> None:
    """Warn (LongRunWarning) before a run that will take minutes, with the least it will."""
    least = tasks / TASKS_PER_S
    if least < ANNOUNCE_S:
        return
    warnings.warn(LongRunWarning(
        f"{scenario.name} ({plan.schedule.name}) has {tasks:,} tasks to simulate "
        f"({plan.G:,} decode steps of {plan.L} layers): at least {in_words(least)} at the "
        f"simulator's best pace ({TASKS_PER_S:,} tasks a second). Ctrl-C stops it and keeps "
        "what ran; workload.gen_len sets the steps."), stacklevel=3)


def in_words(seconds: float) -> str:
    """A long run's time as a person reads it: minutes, or hours past an hour and a half."""
    if seconds < 5400:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"


# Bytes the simulator keeps per task held whole (start, end and duration arrays, per-task
# columns, the interference solver's copies): a 116M-task run (tiny.yaml, gen_len 1e6) completed
# within this machine's 24 GB, so at most ~200; this errs on the side of running.
_BYTES_PER_TASK = 150


def check_size(tasks: int) -> None:
    """Refuse, with an estimate, a run that would not fit in this machine's memory, rather than
    run out of it part-way."""
    import os

    try:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    need = tasks * _BYTES_PER_TASK
    if need > 0.8 * free:
        raise TgError(
            f"Keeping the times of {tasks:,} tasks needs about {need / 1e9:.1f} GB and "
            f"{free / 1e9:.1f} GB of this machine's memory is free. Trace fewer steps "
            "(--trace-steps N), or lower workload.gen_len, model.L or the number of "
            "micro-batches (policy.N / policy.mu).")
