"""Each `tg` verb: the API function of the same name called with the command line's options
(each option is the parameter of the same name: `tests/test_human_output.py` checks that none is
dropped), its result printed (JSON with ``--json``, tables otherwise, both on stdout; progress
and diagnostics on stderr), the files asked of it written, and its exit status."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from typing import Any, Callable

from rich.text import Text

from taskgraph import api
from taskgraph.errors import TgError
from taskgraph.files import Output, refuse_input
from taskgraph.output.report import progress_bar, stderr_console, stdout_console
from taskgraph.specs import Scenario


def simulate(args: argparse.Namespace) -> int:
    scenario = _load(args)
    label = "simulating batches" if scenario.requests is not None else "simulating"
    result = _call(args, api.simulate, scenario, label, **_keep(args))
    return _report(args, result, result.summary)


def compare(args: argparse.Namespace) -> int:
    if args.batch_sizes is not None:
        return _crossover(args)
    if args.plot:
        raise TgError("--plot draws a comparison across batch sizes; give --batch-sizes.")
    first = api.parse_entry(args.schedules[0])[0] if args.schedules else None
    result = _call(args, api.compare, _load(args, first), "simulating", **_keep(args))
    code = _report(args, result, result.results[-1] if result.interrupted else None)
    if not code:
        result.raise_if_failed(args.scenario)
    return code


def _crossover(args: argparse.Namespace) -> int:
    if args.check or args.trace or args.gantt:
        raise TgError("--batch-sizes runs many policies; --check, --trace and --gantt take one "
                      "scenario's: drop them, or --batch-sizes.")
    sizes = None if args.batch_sizes == "default" else args.batch_sizes
    code = _report(args, _call(args, api.crossover, _load(args), "simulating", "points",
                               batch_sizes=sizes))
    if args.plot:
        _said(args, f"wrote {args.plot}")
    return code


def execute(args: argparse.Namespace) -> int:
    if args.profile and not args.trace:
        raise TgError("--profile puts the PyTorch profiler's ops in the trace; give --trace "
                      "PATH.")
    scenario = _load(args)
    batches = scenario.requests is not None and not args.prompts
    result = _call(args, api.execute, scenario, "executing batches" if batches else "executing",
                   "batches" if batches else "segments")
    if result.failure is not None:      # no figures: the trace shows what ran before it
        _outputs(args, result)
        result.raise_if_failed(args.trace)
    code = _report(args, result, result.summary)
    result.raise_if_mismatched()
    return code


def _plain(verb: Callable, label: str = "", unit: str = "segments", loaded: bool = True
           ) -> Callable[[argparse.Namespace], int]:
    """A verb that prints its result: the API's `verb` on the loaded scenario, or (`loaded`
    False) on the files named, which the API loads itself."""
    def run(args: argparse.Namespace) -> int:
        first = _load(args) if loaded else getattr(args, "scenario", None) or args.measurements
        return _report(args, _call(args, verb, first, label, unit))
    return run


calibrate = _plain(api.calibrate, "calibrating", loaded=False)
fit = _plain(api.fit, "fitting", "steps", loaded=False)
validate = _plain(api.validate, "validating")
search = _plain(api.search, "simulating", "jobs", loaded=False)
sweep = _plain(api.sweep, "sweeping", "jobs", loaded=False)
batch = _plain(api.batch)
roofline = _plain(api.roofline)


def catalog(args: argparse.Namespace) -> int:
    return _report(args, api.catalog())


def graph(args: argparse.Namespace) -> int:
    _said(args, f"wrote {args.out}: {_call(args, api.graph, _load(args))}")
    return 0


# What _load applies to the scenario it returns (the API takes them with a scenario file).
_APPLIED = ("overrides", "schedule", "steps")


def _load(args: argparse.Namespace, schedule: str | None = None):
    """The command line's scenario with its --set, --schedule (or `schedule`) and --steps;
    `policy: auto` is replaced by the search's best, which is said. No output may replace a
    file it read."""
    steps = getattr(args, "steps", None)
    scenario = api.load(args.scenario, [*args.overrides, *(
        [f"workload.gen_len={steps}"] if steps is not None else [])],
        schedule or getattr(args, "schedule", None))
    for flag, path in vars(args).items():
        if isinstance(path, Output):
            refuse_input(path, f"--{flag.replace('_', '-')}")
    scenario, found = api.resolve_policy(scenario)     # before any work: outputs checked
    if found is not None:
        _said(args, found.picked())
    return scenario


def _call(args: argparse.Namespace, verb: Callable, first: Any, label: str = "",
          unit: str = "segments", **fixed: Any):
    """`verb(first, ...)` with each option of the command line that is a parameter of `verb`
    (but those _load applied, when `first` is the Scenario it loaded) and `fixed`, under a
    progress bar where it reports progress."""
    params = list(inspect.signature(verb).parameters)
    skip = {params[0], *fixed, *(_APPLIED if isinstance(first, Scenario) else ())}
    options = {k: str(v) if isinstance(v, Output) else v      # a path as the API takes it
               for k, v in vars(args).items() if k in params and k not in skip}
    if "progress" not in params:
        return verb(first, **options, **fixed)
    with progress_bar(_human(args), label, unit) as tick:
        return verb(first, **options, **fixed, progress=tick)


def _keep(args: argparse.Namespace) -> dict[str, Any]:
    """What a simulation keeps of its task times: the runs for a trace or chart at all, and
    the decode steps the trace draws (the Gantt chart's step 2 at least)."""
    steps = args.trace_steps if args.trace else 2
    return {"keep_runs": bool(args.trace or args.gantt),
            "keep_steps": None if steps is None else max(steps, 2)}


def _report(args: argparse.Namespace, result, summary: dict | None = None) -> int:
    """A result as JSON or as its tables on stdout, then the trace and Gantt chart asked of
    it; 130 if `summary` says Ctrl-C ended the run early."""
    if _human(args):
        stdout_console().print(result)
    else:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    _outputs(args, result)
    if (summary or {}).get("interrupted"):
        print("tg: interrupted; the figures and trace cover what ran before Ctrl-C.",
              file=sys.stderr)
        return 130
    return 0


def _outputs(args: argparse.Namespace, result) -> None:
    if getattr(args, "trace", None):
        slices = result.write_trace(args.trace, args.trace_steps)
        _said(args, f"wrote {args.trace}: {slices:,} task slices (open it at "
                    "https://ui.perfetto.dev)")
    if getattr(args, "gantt", None):
        result.write_gantt(args.gantt)
        _said(args, f"wrote {args.gantt}")


def _said(args: argparse.Namespace, line: str) -> None:
    """A line for a person (none with --json: stdout holds the JSON, stderr only errors)."""
    if _human(args):
        stderr_console().print(Text(line))


def _human(args: argparse.Namespace) -> bool:
    return not getattr(args, "json", False)
