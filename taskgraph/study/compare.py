"""Several schedules on one scenario (``tg compare``): which schedules apply to the machine,
which fit its memory, and each one simulated at the scenario's policy (adapted where a schedule
needs it), or over the scenario's whole request list.

Plain data in and out: the command line chooses the names and prints the results.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from taskgraph.dag.builder import make_plan
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.errors import CheckFailed, MemoryFitError, ScheduleError, TgError
from taskgraph.expect import Check, evaluate
from taskgraph.output.report import Shown, check_table, compare_table, warnings_of
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.scenario import for_schedule
from taskgraph.serving.queue import QueueRun, simulate_queue
from taskgraph.serving.requests import with_padding
from taskgraph.sim.simulate import simulate_scenario
from taskgraph.specs import Scenario
from taskgraph.tracing.writer import Traced

Progress = Callable[[int, int], None] | None


@dataclass
class Comparison(Shown, Traced):
    """Simulated schedules in the order asked, what happened to the others and, when asked,
    the scenario's expectations checked against them. `to_dict()` is `tg compare --json`."""

    scenario: str = ""
    sims: dict = field(default_factory=dict)          # name -> Simulation (or a queue's run)
    notes: dict[str, str] = field(default_factory=dict)     # how a schedule's policy was adapted
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why it cannot run this
    checks: list[Check] | None = None                 # the `expect` section, when checked

    @property
    def results(self) -> list[dict]:
        return [s.summary for s in self.sims.values()]

    @property
    def interrupted(self) -> bool:
        return any(r["interrupted"] for r in self.results)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks or [] if not c.ok]

    def raise_if_failed(self, where: str) -> None:
        """CheckFailed naming each of `where`'s expectations that failed (`tg compare --check`
        exits 1 with it)."""
        if self.failed:
            raise CheckFailed(
                f"{len(self.failed)} of {len(self.checks)} expectations in {where} failed: "
                + "; ".join(f"{c.schedule} {c.what}: expected {c.expected}, got {c.actual}"
                            for c in self.failed) + ".")

    def to_dict(self) -> dict:
        out: dict = {"scenario": self.scenario, "results": self.results}
        if self.left_out:
            out["left_out"] = self.left_out
        if self.checks is not None:
            out["checks"] = [c.__dict__ for c in self.checks]
            out["checks_ok"] = not self.failed
        return out

    def views(self):
        from rich.text import Text

        yield compare_table(self.results, self.notes)
        for r in self.results:
            yield from warnings_of(r, f"{r['schedule']}: ")
        for name, why in self.left_out.items():
            yield Text.assemble(("left out:", "yellow"), f" {name}: {why}")
        if self.checks is not None:
            yield check_table(self.checks)

    def trace_runs(self) -> list:
        return self._runs(lambda q: q.trace_runs())

    def gantt_runs(self) -> list:
        # a request list: the first batch of each queue, where the schedules' steps differ
        return self._runs(lambda q: q.gantt_runs())

    def _runs(self, of_queue: Callable[[QueueRun], list]) -> list:
        """Each schedule's run, or a request list's batches labelled with their entry."""
        return [replace(r, label=f"{entry} {r.label}") for entry, s in self.sims.items()
                for r in (of_queue(s) if isinstance(s, QueueRun) else
                          [s.trace_run("simulated")])]


def parse_entry(entry: str) -> tuple[str, str | None]:
    """'S1:refill' -> ('S1', 'refill'); 'S4' -> ('S4', None); an unknown name or batching is
    an error naming the entry."""
    name, colon, batching = entry.partition(":")
    if name not in SCHEDULES:
        raise TgError(f"--schedules names unknown schedule '{name}'; known schedules: "
                      f"{', '.join(SCHEDULES)} (NAME:padded pads a request list, NAME:refill "
                      "runs it as one continuous batch).")
    if colon and batching not in ("padded", "refill"):
        raise TgError(f"--schedules entry '{entry}': after the colon give padded or refill.")
    return name, batching or None


#: The batches the expert-level schedules are made for (the Fiddler artifact's 1-16): at these
#: `tg compare` compares them by default.
SMALL_BATCH = 16


def default_schedules(scenario: Scenario) -> list[str]:
    """The schedules worth comparing on this machine: S5 runs its experts on one host for one
    GPU, and PP on one GPU is S4. The expert-level schedules (EP, EC, ECP) are compared by
    default at batches of up to SMALL_BATCH sequences, what they are made for, and elsewhere
    where named (docs/experts.md)."""
    one = scenario.hardware.gpu.count == 1
    small = scenario.policy.N <= SMALL_BATCH
    return [n for n, s in SCHEDULES.items()
            if (s.parallel != "pipeline" or not one) and (one or s.ffn == "gpu")
            and (small or s.ffn not in ("split", "cache"))]


def compare(scenario: Scenario, schedules: list[str] | None = None, check: bool = False,
            keep_runs: bool = False, progress: Progress = None,
            keep_steps: int | None = 2) -> Comparison:
    """Simulate `schedules` (entries as `parse_entry` reads them; default: every schedule that
    runs on the machine) side by side, on the scenario's mean lengths or over its whole request
    list. `check` evaluates the scenario's `expect` section (mean lengths only): its schedules
    are added to the comparison and must fit. A schedule named here must fit; one chosen by
    default is left out, with the reason, when it does not. `keep_runs`: keep a request list's
    task times for traces; `keep_steps`: the decode steps a long run keeps them for
    (:func:`~taskgraph.sim.simulate.simulate_scenario`)."""
    # each once: the table has a row per schedule (S1,S1,... 5,000 times simulated each)
    names = list(dict.fromkeys(schedules)) if schedules is not None else list(SCHEDULES)
    if not names:
        raise TgError(f"--schedules names no schedule; known schedules: {', '.join(SCHEDULES)}.")
    entries = [parse_entry(n) for n in names]
    if scenario.requests is not None:
        if check:
            raise TgError("tg compare --check gates a mean-length scenario's schedules; on a "
                          "request list, compare the queues' figures (--json) instead.")
        return compare_queues(scenario, names, keep_runs, progress)
    if any(batching for _, batching in entries):
        raise TgError("NAME:padded and NAME:refill batch a request list; this scenario lists "
                      "none (give workload.requests or workload.lengths).")
    expected: set[str] = set()
    if check:
        if scenario.expect is None:
            raise TgError(f"--check needs an `expect` section in the scenario '{scenario.name}'"
                          "; see the README for its fields (beats, min_efficiency, "
                          "max_decode_layer_ms, min_throughput_tok_s).")
        expected = set(scenario.expect.schedules())
        names += [n for n in scenario.expect.schedules() if n not in names]
    if schedules is None:
        names = [n for n in names if n in default_schedules(scenario)]
    out = compare_scenario(scenario, names, set(names) if schedules is not None else expected,
                           progress, keep_steps)
    if check:
        out.checks = evaluate(scenario.expect, {n: s.summary for n, s in out.sims.items()})
    return out


def compare_scenario(scenario: Scenario, names: list[str], required: set[str],
                     progress: Progress = None, keep_steps: int | None = 2) -> Comparison:
    """Simulate `names` on a mean-length scenario. Every schedule's memory is checked before
    any is simulated; one that does not fit, or cannot run the policy (CGOPipe at N = 1: it
    needs two micro-batches), fails the comparison if it is `required`, and is left out, with
    the reason, if not. Ctrl-C ends the comparison after the schedule it hit."""
    out, adapted = Comparison(scenario.name), {}
    for name in names:
        adapted[name], note = for_schedule(scenario, name)
        try:
            check_fits(memory_footprint(make_plan(adapted[name], name)), name)
        except (MemoryFitError, ScheduleError) as e:
            if name in required:
                raise
            out.left_out[name] = str(e)
            continue
        if note:
            out.notes[name] = note
    for name in (n for n in names if n not in out.left_out):
        out.sims[name] = simulate_scenario(adapted[name], name, progress=progress,
                                           keep_steps=keep_steps)
        if out.sims[name].summary["interrupted"]:
            break
    return out


def compare_queues(scenario: Scenario, entries: list[str], keep_runs: bool,
                   progress: Progress = None) -> Comparison:
    """Each schedule over the whole request list; NAME:padded batches it as FlexGen does (the
    paper's headline: unpadded MoE-Lightning against padded FlexGen on the same requests),
    NAME:refill as one continuous batch (MoE-Lens). Returns the comparison, keyed by entry,
    with the runs to trace labelled with their entry."""
    out = Comparison(scenario.name)
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
        if q.summary["interrupted"]:
            break
    return out
