"""Scenario in, simulated run out: plan, memory check, compile, simulate, summarise.

This is the library entry point behind `tg simulate` and `tg compare`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from taskgraph.builder import Plan, make_plan
from taskgraph.compiled import Program, compile_plan
from taskgraph.errors import MemoryFitError, TgError
from taskgraph.cost import POOL_NAMES, POOLS, cost_model
from taskgraph.memory import MemoryReport, check_fits, memory_footprint
from taskgraph.report import Shown, simulate_table, warnings_of
from taskgraph.sim.engine import SimRun
from taskgraph.sim.interference import simulate_with_interference
from taskgraph.sim.metrics import summarize
from taskgraph.specs import Scenario
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
        cost = cost_model(self.plan.scenario, self.plan.schedule.name)
        drawn = self.program.pool_bytes(cost) if cost.pools_shared else ()
        pools = {POOL_NAMES[p]: drawn[i] for i, p in enumerate(POOLS)
                 if len(drawn) and np.isfinite(cost.pool_capacity[i])}
        return TraceRun(label, self.program, self.run.start, self.run.end, pools=pools)


def simulate_scenario(scenario: Scenario, schedule: str | None = None,
                      progress: Callable[[int, int], None] | None = None,
                      over_memory: bool = False) -> Simulation:
    """Simulate a scenario with its own schedule or `schedule`. `progress(done, total)` is
    called once per segment (prefill, then each decode step). A policy that needs more memory
    than the machine has is refused, unless `over_memory` (a run that did happen: the memory
    model is what is wrong), when the result's warnings say so."""
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
    check_size(program.total)
    total = len(program.seg_template)
    tick = (lambda d: progress(d, total)) if progress else None
    cost = cost_model(scenario, plan.schedule.name)
    run = simulate_with_interference(program, cost, tick)
    summary = summarize(run, memory, cost)
    summary["warnings"] = warnings
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    return Simulation(plan, program, memory, run, summary)


# Bytes the simulator keeps per task (start, end and duration arrays, per-task columns, the
# interference solver's copies): a 116M-task run (tiny.yaml, gen_len 1e6) completed within this
# machine's 24 GB, so at most ~200; this errs on the side of running.
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
            f"This run has {tasks:,} tasks; simulating them needs about {need / 1e9:.1f} GB and "
            f"{free / 1e9:.1f} GB of this machine's memory is free. Lower workload.gen_len, "
            "model.L or the number of micro-batches (policy.N / policy.mu).")
