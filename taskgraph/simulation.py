"""Scenario in, simulated run out: plan, memory check, compile, simulate, summarise.

This is the library entry point behind `tg simulate` and `tg compare`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from taskgraph.builder import Plan, make_plan
from taskgraph.compiled import Program, compile_plan
from taskgraph.errors import TgError
from taskgraph.cost import cost_model
from taskgraph.memory import MemoryReport, check_fits, memory_footprint
from taskgraph.sim.engine import SimRun
from taskgraph.sim.interference import simulate_with_interference
from taskgraph.sim.metrics import summarize
from taskgraph.specs import Scenario
from taskgraph.tracing.writer import TraceRun


@dataclass
class Simulation:
    plan: Plan
    program: Program
    memory: MemoryReport
    run: SimRun
    summary: dict[str, Any]

    def trace_run(self, label: str = "simulated") -> TraceRun:
        return TraceRun(label, self.program, self.run.start, self.run.end)


def simulate_scenario(scenario: Scenario, schedule: str | None = None,
                      progress: Callable[[int, int], None] | None = None) -> Simulation:
    """Simulate a scenario with its own schedule or `schedule`. `progress(done, total)` is
    called once per segment (prefill, then each decode step)."""
    t0 = time.perf_counter()
    plan = make_plan(scenario, schedule)
    memory = memory_footprint(plan)
    warnings = check_fits(memory, plan.schedule.name)
    program = compile_plan(plan)
    check_size(program.total)
    total = len(program.seg_template)
    tick = (lambda d: progress(d, total)) if progress else None
    run = simulate_with_interference(program, cost_model(scenario, plan.schedule.name), tick)
    summary = summarize(run, memory)
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
