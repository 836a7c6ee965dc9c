"""What an executed run gives: its figures and what it measured (:class:`Execution`), and the
protocol a request list's run shares with it (:class:`Executed`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rich.text import Text

from taskgraph.dag.builder import Plan
from taskgraph.errors import CheckFailed, TgError
from taskgraph.files import atomic_path
from taskgraph.output.report import Shown, execute_table, warnings_of
from taskgraph.sim.simulate import trace_run_of
from taskgraph.tracing.writer import Traced, TraceRun


class Executed:
    """What an executed run (one batch or a request list's) gives beside its figures: the
    generated tokens, the router's decisions, and whether it failed. Each kind keeps its own
    figures (``to_dict()``) and says here how they take a file written or a warning."""

    summary: dict[str, Any]      # the JSON of `tg execute`
    routing: Any
    failure: BaseException | None

    def write_outputs(self, path: str) -> None:
        """Each request's tokens to `path` (JSON lines), which the figures then name instead
        of holding them."""
        raise NotImplementedError

    def write_routing(self, path: str | Path) -> None:
        """The router's decisions to `path`, which the figures then name."""
        raise NotImplementedError

    def warn(self, text: str) -> None:
        """A warning the figures then carry (found after the run: a routing not written)."""
        raise NotImplementedError

    def routing_written(self) -> Iterator[Text]:
        """The line saying where the router's decisions went, if they were written."""
        if self.summary.get("routing"):
            yield Text(f"wrote {self.summary['routing']}: the router's experts of the prefill "
                       f"and {len(self.routing.experts) - 1} decode steps")

    def raise_if_failed(self, trace: str | Path | None = None) -> None:
        """A TgError if a task raised (the run stopped there); `trace`, if written, shows what
        ran before it."""
        if self.failure is not None:
            raise TgError(f"A task failed during execution ({type(self.failure).__name__}: "
                          f"{self.failure}); " + (f"the trace in {trace} shows what ran before "
                          "it." if trace else "rerun with --trace to see what ran before it."))

    def raise_if_mismatched(self) -> None:
        """CheckFailed if requests generated other tokens in their batch than alone."""
        if self.summary.get("requests_match_alone") is False:
            mismatched = self.summary["mismatched"]
            raise CheckFailed(f"{len(mismatched)} requests generated other tokens in their "
                              f"batch than alone: {', '.join(map(str, mismatched[:10]))}.")


@dataclass
class Batches:
    """A prompts file run N sequences at a time: what its batches ran, in all (the figures
    but these are the first batch's)."""

    count: int
    throughput_tok_s: float
    makespan_s: float
    tasks: int
    interrupted: bool


@dataclass
class Measurements:
    """What an executed run measured and checked beside its figures: where it ran, the check
    against the reference forward (None where it was not made: ``check`` off, or the run
    stopped), each request's tokens, and what it had to say."""

    device: str
    dtype: str
    zero_copy: bool
    cache: dict[str, Any] | None = None     # what EC's expert cache really copied and held
    max_abs_err: float | None = None
    tokens_match: bool | None = None
    outputs: list[dict[str, Any]] | None = None      # each request's tokens (with prompts)
    requests: int | None = None
    warnings: list[str] = field(default_factory=list)
    profiled_ops: int | None = None
    wall_s: float = 0.0
    batches: Batches | None = None
    out: str | None = None           # where the outputs were written instead
    routing: str | None = None       # where the router's decisions were written


@dataclass
class Execution(Executed, Shown, Traced):
    """An executed run: the plan and compiled graph it ran, its tasks' measured times (`run`)
    and the figures a simulation gives of them (`figures`, less the modelled machine's limit),
    what it measured and checked beside them (`measured`), traced as "measured" with what the
    PyTorch profiler saw inside it when it ran under ``--profile`` (`ops`)."""

    plan: Plan
    program: Any
    memory: Any
    run: Any
    figures: dict[str, Any]
    measured: Measurements
    ops: list = field(default_factory=list)
    weights: Any = None           # what ran: the reference forward can be re-run on them
    # the router's decisions (taskgraph.dag.routing.RoutingTrace), with record_routing
    routing: Any = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `tg execute`: the figures, with what the run measured, its keys in the
        order they always had (tests/test_execution_result.py): a prompts file's batches and
        its outputs come last."""
        m, over = self.measured, self.measured.batches
        out = dict(self.figures)
        if over is not None:
            out.update(throughput_tok_s=over.throughput_tok_s, makespan_s=over.makespan_s,
                       tasks=over.tasks, interrupted=over.interrupted)
        out.update(wall_s=m.wall_s, device=m.device, dtype=m.dtype, measured=True,
                   zero_copy=m.zero_copy)
        if m.cache is not None:
            out["experts"] = {**out.get("experts", {}), **m.cache}
            if "prefetch" in out.get("policy", {}):
                # the executor runs a predictor of its own: the share it ran at is what that
                # covered, not the figure an unset policy.prefetch stands for in a simulation
                covered = m.cache.get("prefetch", {}).get("covered")
                out["policy"] = {**out["policy"], "prefetch": covered}
        out.update(max_abs_err=m.max_abs_err, tokens_match=m.tokens_match)
        outputs = {} if m.outputs is None or m.out is not None else {"outputs": m.outputs}
        if over is None:
            out.update(outputs)
        if m.requests is not None:
            out["requests"] = m.requests
        out["warnings"] = list(m.warnings)
        if m.profiled_ops is not None:
            out["profiled_ops"] = m.profiled_ops
        if over is not None:
            out["batches"] = over.count
            out.update(outputs)
        if m.out is not None:
            out["out"] = m.out
        if m.routing is not None:
            out["routing"] = m.routing
        return out

    @property
    def summary(self) -> dict[str, Any]:
        """The JSON of `tg execute` (``to_dict()``), to read: a new dict each time."""
        return self.to_dict()

    def write_outputs(self, path: str) -> None:
        from taskgraph.exec.prompts import write_outputs

        write_outputs(path, self.measured.outputs)
        self.measured.out = path

    def write_routing(self, path: str | Path) -> None:
        write_routing(self.routing, path)
        self.measured.routing = str(path)

    def warn(self, text: str) -> None:
        self.measured.warnings.append(text)

    def trace_run(self, label: str = "measured") -> TraceRun:
        run = trace_run_of(self.plan, self.program, self.run, label, measured=True)
        run.ops = self.ops
        return run

    def trace_runs(self) -> list[TraceRun]:
        return [self.trace_run()]

    def gantt_runs(self) -> list[TraceRun]:
        return [self.trace_run(f"{self.figures['schedule']} measured")]

    def views(self):
        summary = self.to_dict()
        yield execute_table(summary)
        for row in (summary.get("outputs") or [])[:5]:
            yield Text(f"  {row['id']}: {row.get('text', row['output_ids'])}")
        yield from self.routing_written()
        yield from warnings_of(summary)

    @property
    def failure(self) -> BaseException | None:
        """The exception a task raised, if one did (the run stopped there)."""
        return self.run.failure


def write_routing(trace: Any, path: str | Path) -> None:
    """A run's router decisions as a routing trace file (``tg-routing/1``, the format
    ``workload.routing.trace`` reads: :mod:`taskgraph.dag.routing`), written whole or not at
    all."""
    if trace is None:
        raise TgError("This run recorded no routing: it was executed without record_routing, "
                      "or stopped before its end.")
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(trace.to_dict(), f, separators=(",", ":"))
        f.write("\n")
