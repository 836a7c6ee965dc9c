"""Several schedules on one scenario (``tg compare``): which schedules apply to the machine,
which fit its memory, and each one simulated at the scenario's policy (adapted where a schedule
needs it), or over the scenario's whole request list.

Plain data in and out: the command line chooses the names and prints the results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from taskgraph.errors import MemoryFitError, TgError
from taskgraph.schedules import SCHEDULES
from taskgraph.specs import Scenario

Progress = Callable[[int, int], None] | None


@dataclass
class Comparison:
    """Simulated schedules in the order asked, and what happened to the others."""

    sims: dict = field(default_factory=dict)          # name -> Simulation (or a queue's run)
    notes: dict[str, str] = field(default_factory=dict)     # how a schedule's policy was adapted
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why its memory does not fit

    @property
    def results(self) -> list[dict]:
        return [s.summary for s in self.sims.values()]

    @property
    def interrupted(self) -> bool:
        return any(r["interrupted"] for r in self.results)


def parse_entry(entry: str) -> tuple[str, str | None]:
    """'S1:refill' -> ('S1', 'refill'); 'S4' -> ('S4', None); an unknown name or batching is
    an error naming the entry."""
    name, _, batching = entry.partition(":")
    if name not in SCHEDULES:
        raise TgError(f"--schedules names unknown schedule '{name}'; known schedules: "
                      f"{', '.join(SCHEDULES)} (NAME:padded pads a request list, NAME:refill "
                      "runs it as one continuous batch).")
    if batching and batching not in ("padded", "refill"):
        raise TgError(f"--schedules entry '{entry}': after the colon give padded or refill.")
    return name, batching or None


def default_schedules(scenario: Scenario) -> list[str]:
    """The schedules worth comparing on this machine: S5 runs its experts on one host for one
    GPU, and PP on one GPU is S4."""
    one = scenario.hardware.gpu.count == 1
    return [n for n, s in SCHEDULES.items()
            if (s.parallel != "pipeline" or not one) and (one or s.ffn == "gpu")]


def compare_scenario(scenario: Scenario, names: list[str], required: set[str],
                     progress: Progress = None) -> Comparison:
    """Simulate `names` on a mean-length scenario. Every schedule's memory is checked before
    any is simulated; one that does not fit fails the comparison if it is `required`, and is
    left out, with the reason, if not. Ctrl-C ends the comparison after the schedule it hit."""
    from taskgraph.builder import make_plan
    from taskgraph.memory import check_fits, memory_footprint
    from taskgraph.scenario import for_schedule
    from taskgraph.simulation import simulate_scenario

    out, adapted = Comparison(), {}
    for name in names:
        adapted[name], note = for_schedule(scenario, name)
        try:
            check_fits(memory_footprint(make_plan(adapted[name], name)), name)
        except MemoryFitError as e:
            if name in required:
                raise
            out.left_out[name] = str(e)
            continue
        if note:
            out.notes[name] = note
    for name in (n for n in names if n not in out.left_out):
        out.sims[name] = simulate_scenario(adapted[name], name, progress=progress)
        if out.sims[name].summary["interrupted"]:
            break
    return out


def compare_queues(scenario: Scenario, entries: list[str], keep_runs: bool,
                   progress: Progress = None) -> tuple[Comparison, list]:
    """Each schedule over the whole request list; NAME:padded batches it as FlexGen does (the
    paper's headline: unpadded MoE-Lightning against padded FlexGen on the same requests),
    NAME:refill as one continuous batch (MoE-Lens). Returns the comparison, keyed by entry, and
    the runs to trace, labelled with their entry."""
    from taskgraph.scenario import for_schedule
    from taskgraph.serving.queue import simulate_queue
    from taskgraph.serving.requests import with_padding

    out, runs = Comparison(), []
    w = scenario.workload
    for entry in entries:
        name, batching = parse_entry(entry)
        if batching == "padded" or (not batching and w.padded):
            queue = with_padding(scenario, True)
        else:
            queue = with_padding(scenario, False)
            queue = queue.model_copy(update={"workload": queue.workload.model_copy(
                update={"refill": batching == "refill" or (not batching and w.refill)})})
        adapted, note = for_schedule(queue, name)
        if note:
            out.notes[name] = note
        out.sims[entry] = q = simulate_queue(adapted, progress=progress, keep_runs=keep_runs)
        for run in q.trace_runs():
            run.label = f"{entry} {run.label}"
            runs.append(run)
        if q.summary["interrupted"]:
            break
    return out, runs
