"""The `tg` command line (docs/design.md §5). Human output goes to stderr, `--json` output to
stdout."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from taskgraph import __version__, api
from taskgraph.errors import CheckFailed, TgError
from taskgraph.files import forget_inputs, refuse_input
from taskgraph.schedules import SCHEDULES


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    restore = _exit_on_termination()
    try:
        forget_inputs()                 # what this run reads, no output of it may replace
        _check_outputs(args)
        rc = args.func(args) or 0
        if getattr(args, "trace_interrupted", False):
            print(f"tg {args.command}: interrupted while writing the trace; the results above "
                  f"are complete, {args.trace} was left as it was.", file=sys.stderr)
            return 130
        return rc
    except BrokenPipeError:       # e.g. `tg ... --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except TgError as err:
        print(f"tg {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"tg {args.command}: interrupted.", file=sys.stderr)
        return 130
    finally:
        restore()


def _exit_on_termination() -> Callable[[], Any]:
    """SIGTERM and SIGHUP end the run as an exit (status 128 + the signal) raised where it is,
    so that every `finally` runs: a half-written output is removed (files.atomic_path) and
    child processes are stopped by their owners, as after Ctrl-C. Without this the process
    died where it stood, leaving a 1.3 GB partial trace."""
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():   # only it may set handlers
        return lambda: None
    signals = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    before = {sig: signal.signal(sig, stop) for sig in signals}
    return lambda: [signal.signal(sig, old) for sig, old in before.items()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tg", description="One task graph for offloaded MoE inference: simulate schedules "
        "on modelled hardware and write Perfetto traces.")
    p.add_argument("--version", action="version", version=f"tg {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, func: Callable, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("scenario", help="scenario YAML file (e.g. scenarios/t4.yaml)")
        c.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a scenario field, e.g. policy.mu=36 "
                       "or hardware.link.h2d_gbps=25 (repeatable)")
        c.set_defaults(func=func)
        return c

    c = command("simulate", _simulate, "simulate one schedule of a scenario (its whole request "
                "queue, batch after batch, when the workload lists requests)")
    c.add_argument("--schedule", choices=list(SCHEDULES), help="override the scenario's schedule")
    c.add_argument("--csv", metavar="FILE.csv", help="with a request list: write each "
                   "request's batch, micro-batch and finish time here")
    _trace_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    c = command("compare", _compare, "simulate several schedules side by side")
    c.add_argument("--schedules", default=None,
                   help="comma-separated schedules (default: every schedule that runs on the "
                        f"machine: {','.join(SCHEDULES)}; S5 on one GPU only, PP on several)")
    c.add_argument("--check", action="store_true",
                   help="enforce the scenario's `expect` section; exit 1 if any check fails")
    _trace_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    c = command("execute", _execute, "run a schedule for real with real kernels, checked "
                "against a sequential reference forward")
    c.add_argument("--schedule", choices=list(SCHEDULES), help="override the scenario's schedule")
    c.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    c.add_argument("--steps", type=int, help="decode steps to run (default: workload.gen_len)")
    c.add_argument("--weights", metavar="DIR", help="a Hugging Face Mixtral safetensors "
                   "checkpoint matching the model (default: synthetic weights, seeded)")
    c.add_argument("--prompts", metavar="FILE.jsonl", help="requests to run, one JSON object "
                   "a line: prompt_ids (or prompt text, with the checkpoint's tokenizer.json) "
                   "and optional id, max_new_tokens (default: synthetic prompts)")
    c.add_argument("--out", metavar="FILE.jsonl", help="write each request's generated tokens "
                   "here (with --prompts)")
    c.add_argument("--profile", action="store_true", help="run under the PyTorch profiler and "
                   "put the ops (on CUDA also kernels and copies) in the trace, on tracks beside "
                   "the tasks; needs --trace")
    c.add_argument("--zero-copy", action="store_true", help="CPU backend as an inference "
                   "engine: weights read in place, transfers scheduled as zero-cost stand-ins "
                   "(default: real copies, as a GPU machine would make them)")
    c.add_argument("--processes", action="store_true", help="several GPUs: each GPU its own "
                   "process, collectives and pipeline sends over torch.distributed (gloo on "
                   "the CPU backend; NCCL with --device cuda, a CUDA device per process)")
    _trace_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    c = sub.add_parser("calibrate", help="measure this machine and write a hardware profile",
                       description="Measure what the cost model needs on this machine (rates by "
                       "microbenchmark, per-task costs fitted from the executor's own tasks) and "
                       "write a hardware profile any scenario can use.")
    c.add_argument("scenario", nargs="?", default="scenarios/tiny.yaml",
                   help="scenario whose model shapes the executor runs (default: %(default)s)")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    c.add_argument("--out", required=True, help="hardware profile to write (.yaml)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.set_defaults(func=_calibrate)

    c = sub.add_parser("fit", help="fit machine and implementation profiles to measured "
                       "throughputs", description="Fit the free parameters of machine and "
                       "implementation profiles to end-to-end measurements (the format of "
                       "shared/measurements/), by simulation; report each cell's error and its "
                       "leave-one-out error, and write the fitted profiles.")
    c.add_argument("measurements", help="measurements YAML file")
    c.add_argument("--out", required=True, metavar="DIR", help="folder for the fitted profiles, "
                   "report.json, cells.csv and parity.png")
    c.add_argument("--no-loo", action="store_true", help="skip leave-one-out refits")
    _backend_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.set_defaults(func=_fit)

    c = command("validate", _validate, "execute and simulate the same graphs; report, task "
                "kind by task kind, where the model is wrong")
    c.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    # PP on the one device validate runs on is S4
    c.add_argument("--schedules", default=",".join(n for n, s in SCHEDULES.items()
                                                   if s.parallel != "pipeline"),
                   help="schedules to validate (default: %(default)s)")
    c.add_argument("--mu", default=None, help="micro-batch sizes, comma-separated (default: "
                   "the scenario's and half of it)")
    c.add_argument("--repeats", type=int, default=3,
                   help="executions per pair; the median run is kept (default 3)")
    c.add_argument("--plot", metavar="PNG", help="write the parity plot here")
    _backend_args(c, "the simulations (executions measure this machine and run here)")
    _trace_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    c = command("search", _search, "find the policy with the best predicted throughput")
    c.add_argument("--top", type=int, default=10, help="how many policies to list (default 10)")
    c.add_argument("--verify", action="store_true",
                   help="simulate the top policies and re-rank them by simulated throughput")
    c.add_argument("--brute-force", action="store_true",
                   help="also simulate a whole coarse grid and report what trusting the "
                        "predicted pick costs against the best simulated policy")
    _backend_args(c, "the simulations of --verify and --brute-force")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    c = command("sweep", _sweep, "re-run the policy search across hardware or workload values")
    c.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a scenario field and its values (repeatable; the first is the x axis)")
    c.add_argument("--out", required=True, help="output folder for sweep.csv and sweep.png")
    _backend_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    c = command("batch", _batch, "pack a scenario's request list into batches of "
                "micro-batches (Algorithm 2; padded in arrival order with workload.padded)")
    c.add_argument("--csv", metavar="FILE.csv", help="write each request's batch and "
                   "micro-batch (or 'aborted') here")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    c = command("roofline", _roofline, "plot the Hierarchical Roofline of a scenario (PNG)")
    c.add_argument("--out", required=True, help="output PNG file")

    c = command("graph", _graph, "export one step's task graph (node-link JSON or Graphviz DOT)")
    c.add_argument("--schedule", choices=list(SCHEDULES), help="override the scenario's schedule")
    c.add_argument("--step", type=int, default=None,
                   help="segment to export: 0 is prefill, d >= 1 decode step d (default: a "
                        "middle decode step)")
    c.add_argument("--out", required=True, help="output file: .json or .dot")
    return p


def _backend_args(c: argparse.ArgumentParser, what: str = "the jobs") -> None:
    c.add_argument("--backend", choices=["pool", "ray"], default="pool",
                   help=f"where {what} run: this machine's cores (pool, the default) or Ray")
    c.add_argument("--ray-address", metavar="ADDRESS", help="the Ray cluster to join: 'auto' "
                   "(the cluster this node belongs to, after `ray start`) or ray://HOST:10001 "
                   "(default: a local Ray started for this run)")


def _trace_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--gantt", metavar="PNG", help="draw a Gantt chart of two layers of decode "
                   "step 2 (one row per stream) to PNG")
    c.add_argument("--trace", metavar="PATH",
                   help="write a trace to PATH: Chrome JSON (.json, .json.gz) or Perfetto "
                   "protobuf (.pftrace); Perfetto opens both")
    c.add_argument("--trace-steps", default="2", metavar="N|all",
                   help="decode steps the trace covers after prefill (default 2; 'all' for the "
                        "whole run)")


# --- commands --------------------------------------------------------------------------------

def _simulate(args: argparse.Namespace) -> int:
    scenario = _load(args, args.schedule)
    if args.csv and scenario.requests is None:
        raise TgError("--csv writes each request's finish time; the scenario lists no requests "
                      "(give workload.requests or workload.lengths).")
    label = "simulating batches" if scenario.requests is not None else "simulating"
    with _progress(not args.json, label) as tick:
        result = api.simulate(scenario, keep_runs=bool(args.trace or args.gantt), progress=tick,
                              keep_steps=_kept(args))
    if args.csv:
        result.write_csv(args.csv)
    _outputs(args, result)
    _show(args, result)
    return _interrupted(result.summary)


def _compare(args: argparse.Namespace) -> int:
    names = None
    if args.schedules is not None:
        names = [n.strip() for n in args.schedules.split(",") if n.strip()]
        if not names:
            raise TgError(f"--schedules names no schedule; known schedules: "
                          f"{', '.join(SCHEDULES)}.")
    first = api.parse_entry(names[0])[0] if names else None
    scenario = _load(args, first)
    with _progress(not args.json, "simulating") as tick:
        result = api.compare(scenario, names, check=args.check,
                             keep_runs=bool(args.trace or args.gantt), progress=tick,
                             keep_steps=_kept(args))
    _outputs(args, result)
    _show(args, result)
    if result.interrupted:
        return _interrupted(result.results[-1])
    if result.failed:
        raise CheckFailed(
            f"{len(result.failed)} of {len(result.checks)} expectations in {args.scenario} "
            "failed: " + "; ".join(f"{c.schedule} {c.what}: expected {c.expected}, got "
                                   f"{c.actual}" for c in result.failed) + "."
        )
    return 0


def _execute(args: argparse.Namespace) -> int:
    if args.profile and not args.trace:
        raise TgError("--profile puts the PyTorch profiler's ops in the trace; give --trace "
                      "PATH.")
    if args.steps is not None and args.steps < 1:
        raise TgError(f"--steps must be at least 1, not {args.steps}.")
    steps = [f"workload.gen_len={args.steps}"] if args.steps is not None else []
    scenario = _load(args, args.schedule, steps)
    batches = scenario.requests is not None and not args.prompts
    with _progress(not args.json, "executing batches" if batches else "executing",
                   "batches" if batches else "segments") as tick:
        result = api.execute(scenario, device=args.device, weights=args.weights,
                             prompts=args.prompts, out=args.out, zero_copy=args.zero_copy,
                             profile=args.profile, processes=args.processes, progress=tick)
    _outputs(args, result)
    if result.failure is not None:
        failure = result.failure
        raise TgError(f"A task failed during execution ({type(failure).__name__}: {failure}); "
                      + (f"the trace in {args.trace} shows what ran before it." if args.trace
                         else "rerun with --trace to see what ran before it."))
    _show(args, result)
    if result.summary.get("requests_match_alone") is False:
        mismatched = result.summary["mismatched"]
        raise CheckFailed(f"{len(mismatched)} requests generated other tokens in their batch "
                          f"than alone: {', '.join(map(str, mismatched[:10]))}.")
    return _interrupted(result.summary)


def _calibrate(args: argparse.Namespace) -> int:
    with _progress(not args.json, "calibrating") as tick:
        result = api.calibrate(args.scenario, out=args.out, overrides=args.overrides,
                               device=args.device, progress=tick)
    _show(args, result)
    return 0


def _fit(args: argparse.Namespace) -> int:
    with _progress(not args.json, "fitting", "steps") as tick:
        report = api.fit(args.measurements, out=args.out, loo=not args.no_loo,
                         backend=args.backend, ray_address=args.ray_address, progress=tick)
    _show(args, report)
    return 0


def _validate(args: argparse.Namespace) -> int:
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
    with _progress(not args.json, "validating") as tick:
        result = api.validate(scenario, [n.strip() for n in args.schedules.split(",")
                                         if n.strip()], mu=mus, repeats=args.repeats,
                              device=args.device, backend=args.backend,
                              ray_address=args.ray_address, progress=tick)
    _outputs(args, result)
    if args.plot:
        result.parity_plot(args.plot)
    _show(args, result)
    return 0


def _search(args: argparse.Namespace) -> int:
    with _progress(not args.json, "simulating", "jobs") as tick:
        result = api.search(args.scenario, overrides=args.overrides, top=args.top,
                            verify=args.verify, brute_force=args.brute_force,
                            backend=args.backend, ray_address=args.ray_address, progress=tick)
    _show(args, result)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    with _progress(not args.json, "sweeping", "jobs") as tick:
        result = api.sweep(args.scenario, args.vary, out=args.out, overrides=args.overrides,
                           backend=args.backend, ray_address=args.ray_address, progress=tick)
    _show(args, result)
    return 0


def _batch(args: argparse.Namespace) -> int:
    result = api.batch(_load(args))
    if args.csv:
        result.write_csv(args.csv)
    _show(args, result)
    return 0


def _roofline(args: argparse.Namespace) -> int:
    pts = api.roofline(_load(args), out=args.out)
    lines = [f"wrote {args.out}"]
    lines += [f"  {k}: I = {v:.1f} FLOP/byte" for k, v in pts["turning_points"].items()]
    lines += [f"  {k}: I = {v:.1f}" for k, v in pts["intensities"].items()]
    lines += [f"  {k} belongs on the {v} (its intensity against P1)"
              for k, v in pts["verdicts"].items()]
    _console().print(Text("\n".join(lines)))
    return 0


def _graph(args: argparse.Namespace) -> int:
    segment = api.graph(_load(args, args.schedule), step=args.step, out=args.out)
    _console().print(Text(f"wrote {args.out}: {segment}"))
    return 0


# --- helpers ---------------------------------------------------------------------------------

def _load(args: argparse.Namespace, schedule: str | None = None, extra: list[str] = ()):
    """The scenario of the command line, with `schedule` chosen; `policy: auto` is replaced by
    the search's best, which is said."""
    scenario, found = api.load(args.scenario, [*args.overrides, *extra], schedule)
    for flag in ("trace", "gantt", "csv", "out", "plot"):   # now that its files have been read
        if getattr(args, flag, None):
            refuse_input(getattr(args, flag), f"--{flag}")
    if found is not None and not getattr(args, "json", False):
        p = found.best.policy
        _console().print(f"policy: auto -> {found.best.schedule} N={p['N']} mu={p['mu']} "
                         f"A_g={p['A_g']} r_w={p['r_w']:g} r_c={p['r_c']:g} (best of "
                         f"{found.evaluated:,} by HRM, {found.wall_s:.1f} s)")
    return scenario


def _console():
    from taskgraph.report import stderr_console
    return stderr_console()


def _show(args: argparse.Namespace, result) -> None:
    """A result as JSON on stdout, or as its tables on stderr."""
    _emit(args, result.to_dict(), lambda: _console().print(result))


def _outputs(args: argparse.Namespace, result) -> None:
    """The trace and Gantt chart a command line asks of a result."""
    if args.trace:
        try:
            slices = result.write_trace(args.trace, _window(args.trace_steps).max_step)
        except KeyboardInterrupt:
            args.trace_interrupted = True     # the results are still reported; see main()
        else:
            if not args.json:
                _console().print(Text(f"wrote {args.trace}: {slices:,} task slices "
                                      "(open it at https://ui.perfetto.dev)"))
    if args.gantt:
        result.write_gantt(args.gantt)
        if not args.json:
            _console().print(Text(f"wrote {args.gantt}"))


def _emit(args: argparse.Namespace, obj: dict[str, Any], human: Callable[[], None]) -> None:
    if args.json:
        json.dump(obj, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        human()


# Where each command writes, and what it must be: (argument, a folder?, required suffixes).
_OUTPUTS = {"trace": (False, (".json", ".json.gz", ".pftrace")), "gantt": (False, (".png",)), "plot": (False, (".png",)),
            "csv": (False, (".csv",))}
_OUT = {"fit": (True, ()), "sweep": (True, ()), "roofline": (False, (".png",)),
        "calibrate": (False, (".yaml", ".yml")), "graph": (False, (".json", ".dot")),
        "execute": (False, ())}


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path and trace option is checked before any work: a bad one must not cost a
    simulation, and no output may replace an input."""
    inputs = [Path(p) for p in (getattr(args, "scenario", None), getattr(args, "measurements", None),
                                getattr(args, "prompts", None)) if p]
    wanted = {k: v for k, v in _OUTPUTS.items() if getattr(args, k, None) is not None}
    if getattr(args, "out", None) is not None and args.command in _OUT:
        wanted["out"] = _OUT[args.command]
    written: dict[Path, str] = {}
    for arg, (folder, suffixes) in wanted.items():
        text = getattr(args, arg)
        flag = f"--{arg}"
        if not text.strip():
            raise TgError(f"{flag} is empty; give a path.")
        path = Path(text)
        try:
            where = path.resolve()
        except (OSError, RuntimeError) as err:      # a loop of symbolic links
            raise TgError(f"{flag} '{text}' cannot be resolved: {err}.") from None
        if where in written:
            raise TgError(f"{flag} and {written[where]} name the same file '{text}'; one would "
                          "replace the other. Give each its own path.")
        written[where] = flag
        if path.exists() and path.is_dir() != folder:
            raise TgError(f"{flag} '{text}' is {'a file' if folder else 'a folder'}; give "
                          f"{'a folder' if folder else 'a file path'}.")
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise TgError(f"{flag} '{text}' lies under '{parent}', which is a file.")
        for source in inputs:
            if path.exists() and source.exists() and path.resolve() == source.resolve():
                raise TgError(f"{flag} '{text}' is the input {source}; writing it would replace "
                              "it. Choose another path.")
        if suffixes and not folder and not text.endswith(suffixes):
            endings = ", ".join(suffixes[:-1]) + " or " + suffixes[-1] if len(suffixes) > 1 \
                else suffixes[0]
            raise TgError(f"{flag} '{text}' must end in {endings}.")
    if getattr(args, "trace", None) is not None:
        _window(args.trace_steps)
        if args.trace.endswith(".pftrace"):
            from taskgraph.tracing.writer import require_perfetto

            require_perfetto()


def _window(text: str):
    from taskgraph.tracing.writer import Window

    if text == "all":
        return Window(None)
    try:
        steps = int(text)
    except ValueError:
        raise TgError(f"--trace-steps must be a number of decode steps or 'all', not "
                      f"'{text}'.") from None
    if steps < 0:
        raise TgError("--trace-steps must not be negative.")
    return Window(steps)


def _interrupted(summary: dict[str, Any]) -> int:
    if summary.get("interrupted"):
        print("tg: interrupted; the figures and trace cover what ran before Ctrl-C.",
              file=sys.stderr)
        return 130
    return 0


def _kept(args: argparse.Namespace) -> int | None:
    """The decode steps whose task times a long run keeps: those the trace draws, and the
    Gantt chart's step 2."""
    steps = _window(args.trace_steps).max_step if args.trace else 2
    return None if steps is None else max(steps, 2)


@contextmanager
def _progress(show: bool, label: str, unit: str = "segments"
              ) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr, only for humans at a terminal."""
    if not (show and sys.stderr.isatty()):
        yield None
        return
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn(unit), TimeElapsedColumn(),
                        console=_console(), transient=True)
    task = progress.add_task(label, total=None)

    def tick(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    with progress:
        yield tick


if __name__ == "__main__":
    sys.exit(main())
