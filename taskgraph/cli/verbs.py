"""Each `tg` verb: its scenario loaded, the API called, its result printed (JSON on stdout with
``--json``, tables on stderr otherwise) and its exit status."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from rich.text import Text

from taskgraph import api
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.errors import CheckFailed, TgError
from taskgraph.files import refuse_input
from taskgraph.output.report import progress_bar, stderr_console
from taskgraph.tracing.writer import Window


def simulate(args: argparse.Namespace) -> int:
    scenario = _load(args, args.schedule)
    if args.csv and scenario.requests is None:
        raise TgError("--csv writes each request's finish time; the scenario lists no requests "
                      "(give workload.requests or workload.lengths).")
    label = "simulating batches" if scenario.requests is not None else "simulating"
    with progress_bar(not args.json, label) as tick:
        result = api.simulate(scenario, keep_runs=bool(args.trace or args.gantt), progress=tick,
                              keep_steps=_kept(args))
    if args.csv:
        result.write_csv(args.csv)
    _shown(args, result, _outputs(args, result))
    return _interrupted(result.summary)


def compare(args: argparse.Namespace) -> int:
    names = None
    if args.schedules is not None:
        names = [n.strip() for n in args.schedules.split(",") if n.strip()]
        if not names:
            raise TgError(f"--schedules names no schedule; known schedules: "
                          f"{', '.join(SCHEDULES)}.")
    if args.batch_sizes is not None:
        return _crossover(args, names)
    if args.plot:
        raise TgError("--plot draws a comparison across batch sizes; give --batch-sizes.")
    first = api.parse_entry(names[0])[0] if names else None
    scenario = _load(args, first)
    with progress_bar(not args.json, "simulating") as tick:
        result = api.compare(scenario, names, check=args.check,
                             keep_runs=bool(args.trace or args.gantt), progress=tick,
                             keep_steps=_kept(args))
    _shown(args, result, _outputs(args, result))
    if result.interrupted:
        return _interrupted(result.results[-1])
    result.raise_if_failed(args.scenario)
    return 0


def _crossover(args: argparse.Namespace, names: list[str] | None) -> int:
    if args.check or args.trace or args.gantt:
        raise TgError("--batch-sizes runs many policies; --check, --trace and --gantt take one "
                      "scenario's: drop them, or --batch-sizes.")
    sizes = None
    if args.batch_sizes.strip() != "default":
        try:
            sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
        except ValueError:
            raise TgError(f"--batch-sizes must be comma-separated integers or 'default', not "
                          f"'{args.batch_sizes}'.") from None
    with progress_bar(not args.json, "simulating", "points") as tick:
        result = api.crossover(_load(args), names, sizes, backend=args.backend,
                               ray_address=args.ray_address, progress=tick)
    _show(args, result)
    if args.plot:
        result.plot(args.plot)
        if not args.json:
            _console().print(Text(f"wrote {args.plot}"))
    return 0


def execute(args: argparse.Namespace) -> int:
    if args.profile and not args.trace:
        raise TgError("--profile puts the PyTorch profiler's ops in the trace; give --trace "
                      "PATH.")
    if args.steps is not None and args.steps < 1:
        raise TgError(f"--steps must be at least 1, not {args.steps}.")
    steps = [f"workload.gen_len={args.steps}"] if args.steps is not None else []
    scenario = _load(args, args.schedule, steps)
    batches = scenario.requests is not None and not args.prompts
    with progress_bar(not args.json, "executing batches" if batches else "executing",
                   "batches" if batches else "segments") as tick:
        result = api.execute(scenario, device=args.device, weights=args.weights,
                             prompts=args.prompts, out=args.out, zero_copy=args.zero_copy,
                             profile=args.profile, processes=args.processes,
                             record_routing=args.record_routing, progress=tick)
    if result.summary.get("routing") and not args.json:
        steps = len(result.routing.experts)
        _console().print(Text(f"wrote {args.record_routing}: the router's experts of the "
                              f"prefill and {steps - 1} decode steps"))
    traced = _outputs(args, result)
    if result.failure is not None:
        failure = result.failure
        raise TgError(f"A task failed during execution ({type(failure).__name__}: {failure}); "
                      + (f"the trace in {args.trace} shows what ran before it." if args.trace
                         else "rerun with --trace to see what ran before it."))
    _shown(args, result, traced)
    if result.summary.get("requests_match_alone") is False:
        mismatched = result.summary["mismatched"]
        raise CheckFailed(f"{len(mismatched)} requests generated other tokens in their batch "
                          f"than alone: {', '.join(map(str, mismatched[:10]))}.")
    return _interrupted(result.summary)


def calibrate(args: argparse.Namespace) -> int:
    with progress_bar(not args.json, "calibrating") as tick:
        result = api.calibrate(args.scenario, out=args.out, overrides=args.overrides,
                               device=args.device, progress=tick)
    _show(args, result)
    return 0


def fit(args: argparse.Namespace) -> int:
    with progress_bar(not args.json, "fitting", "steps") as tick:
        report = api.fit(args.measurements, out=args.out, loo=not args.no_loo,
                         backend=args.backend, ray_address=args.ray_address, progress=tick)
    _show(args, report)
    return 0


def validate(args: argparse.Namespace) -> int:
    try:
        mus = [int(x) for x in args.mu.split(",")] if args.mu else None
    except ValueError:
        raise TgError(f"--mu must be comma-separated integers, not '{args.mu}'.") from None
    scenario = _load(args)
    if scenario.hardware.calibrated is None and not args.json:
        _console().print(Text.assemble(
            ("warning:", "yellow"), f" hardware '{scenario.hardware.name}' holds datasheet "
            "figures, not this machine's: the errors below compare two different machines. Run "
            "`tg calibrate --out P.yaml` and pass `--set hardware=P.yaml`."))
    with progress_bar(not args.json, "validating") as tick:
        result = api.validate(scenario, [n.strip() for n in args.schedules.split(",")
                                         if n.strip()], mu=mus, repeats=args.repeats,
                              device=args.device, backend=args.backend,
                              ray_address=args.ray_address, progress=tick)
    traced = _outputs(args, result)
    if args.plot:
        result.parity_plot(args.plot)
    _shown(args, result, traced)
    return 0


def search(args: argparse.Namespace) -> int:
    with progress_bar(not args.json, "simulating", "jobs") as tick:
        result = api.search(args.scenario, overrides=args.overrides, top=args.top,
                            verify=args.verify, brute_force=args.brute_force,
                            backend=args.backend, ray_address=args.ray_address, progress=tick)
    _show(args, result)
    return 0


def sweep(args: argparse.Namespace) -> int:
    with progress_bar(not args.json, "sweeping", "jobs") as tick:
        result = api.sweep(args.scenario, args.vary, out=args.out, overrides=args.overrides,
                           backend=args.backend, ray_address=args.ray_address, progress=tick)
    _show(args, result)
    return 0


def batch(args: argparse.Namespace) -> int:
    result = api.batch(_load(args))
    if args.csv:
        result.write_csv(args.csv)
    _show(args, result)
    return 0


def roofline(args: argparse.Namespace) -> int:
    _console().print(api.roofline(_load(args), out=args.out))
    return 0


def graph(args: argparse.Namespace) -> int:
    segment = api.graph(_load(args, args.schedule), step=args.step, out=args.out)
    _console().print(Text(f"wrote {args.out}: {segment}"))
    return 0


def _load(args: argparse.Namespace, schedule: str | None = None, extra: list[str] = ()):
    """The scenario of the command line, with `schedule` chosen; `policy: auto` is replaced by
    the search's best, which is said."""
    scenario, found = api.load(args.scenario, [*args.overrides, *extra], schedule)
    for flag in ("trace", "gantt", "csv", "out", "plot", "record_routing"):   # now that its
        if getattr(args, flag, None):                                       # files have been read
            refuse_input(getattr(args, flag), f"--{flag.replace('_', '-')}")
    if found is not None and not getattr(args, "json", False):
        p = found.best.policy
        _console().print(f"policy: auto -> {found.best.schedule} N={p['N']} mu={p['mu']} "
                         f"A_g={p['A_g']} r_w={p['r_w']:g} r_c={p['r_c']:g} (best of "
                         f"{found.evaluated:,} by HRM, {found.wall_s:.1f} s)")
    return scenario


def _console():
    return stderr_console()


def _show(args: argparse.Namespace, result) -> None:
    """A result as JSON on stdout, or as its tables on stderr."""
    _emit(args, result.to_dict(), lambda: _console().print(result))


class TraceInterrupted(Exception):
    """Ctrl-C while the trace was written, after the results were reported."""


def _outputs(args: argparse.Namespace, result) -> bool:
    """The trace and Gantt chart a command line asks of a result; False if a Ctrl-C stopped the
    trace, after which the results are still reported (then TraceInterrupted is raised)."""
    if args.trace:
        try:
            slices = result.write_trace(args.trace, Window.parse(args.trace_steps).max_step)
        except KeyboardInterrupt:
            return False
        else:
            if not args.json:
                _console().print(Text(f"wrote {args.trace}: {slices:,} task slices "
                                      "(open it at https://ui.perfetto.dev)"))
    if args.gantt:
        result.write_gantt(args.gantt)
        if not args.json:
            _console().print(Text(f"wrote {args.gantt}"))
    return True


def _shown(args: argparse.Namespace, result, traced: bool) -> None:
    _show(args, result)
    if not traced:
        raise TraceInterrupted


def _emit(args: argparse.Namespace, obj: dict[str, Any], human: Callable[[], None]) -> None:
    if args.json:
        json.dump(obj, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        human()


def _interrupted(summary: dict[str, Any]) -> int:
    if summary.get("interrupted"):
        print("tg: interrupted; the figures and trace cover what ran before Ctrl-C.",
              file=sys.stderr)
        return 130
    return 0


def _kept(args: argparse.Namespace) -> int | None:
    """The decode steps whose task times a long run keeps: those the trace draws, and the
    Gantt chart's step 2."""
    steps = Window.parse(args.trace_steps).max_step if args.trace else 2
    return None if steps is None else max(steps, 2)
