"""The `tg` command line's arguments, and the check of every output path before any work."""

from __future__ import annotations

import argparse
import inspect
import re
from typing import Callable

from taskgraph import __version__, api, files
from taskgraph.cli import verbs
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.errors import TgError
from taskgraph.tracing.writer import Window, require_perfetto


class _Parser(argparse.ArgumentParser):
    """An option's help is, unless given, its API parameter's line in the ``Args:`` section of
    the `documented` function: one text for ``tg X --help`` and ``help(tg.X)``; a path the
    function writes is checked as its ``writes`` says (:func:`taskgraph.api.verb`)."""

    def __init__(self, *args, documented: Callable | None = None, **kwargs):
        self.documented = _args_section(documented) if documented else {}
        self.writes = getattr(documented, "writes", {})
        super().__init__(*args, **kwargs)       # which adds --help

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.type is None and action.dest in self.writes:
            action.type = output(self.writes[action.dest])
        if action.help is None and action.dest in self.documented:
            text = self.documented[action.dest].replace("%", "%%")    # argparse formats it
            shown = action.default not in (None, False) and "default" not in text
            action.help = text + (" (default: %(default)s)" if shown else "")
        return action

    def error(self, message: str):
        """Usage errors as one line, as every other bad input is (argparse adds the usage)."""
        self.exit(2, f"{self.prog}: error: {files.printable(message)} (see {self.prog} --help)\n")


def _summary(name: str, func: Callable) -> tuple[str, str]:
    """`tg name`'s help and description: its API function's first sentence and first paragraph
    (after "`tg name`: ")."""
    paragraph = " ".join((inspect.getdoc(func) or "").split("\n\n")[0].split())
    description = paragraph.removeprefix(f"`tg {name}`: ")
    return re.split(r"\.\s+(?=[A-Z])", description)[0].rstrip("."), description


def _args_section(func: Callable) -> dict[str, str]:
    """A docstring's ``Args:`` entries (``name: text``, continued on deeper-indented lines)."""
    section = (inspect.getdoc(func) or "").partition("\nArgs:\n")[2].split("\n\n")[0]
    return {m[1]: " ".join(m[2].split()) for m in re.finditer(r"^ {4}(\w+): (.*(?:\n {8}.*)*)",
                                                              section, re.M)}


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tg", description="One task graph for offloaded MoE inference: simulate schedules "
        "on modelled hardware and write Perfetto traces.")
    p.add_argument("--version", action="version", version=f"tg {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, json: bool = True, schedule: bool = False,
                scenario: str | None = "scenario", default: str | None = None,
                device: str | None = None, several: bool = False) -> argparse.ArgumentParser:
        """`tg name`, run by verbs.name; its help and its options' from api.name's docstring."""
        help, description = _summary(name, getattr(api, name))
        c = sub.add_parser(name, help=help, description=description,
                           documented=getattr(api, name))
        if default:
            c.add_argument(scenario, nargs="?", default=default, help="a scenario whose model "
                           "shapes the executor runs (default: %(default)s)")
        elif several:
            c.add_argument(scenario, nargs="+", help=f"{scenario} YAML file(s)")
        elif scenario:
            c.add_argument(scenario, help=f"{scenario} YAML file (or a shipped scenario's "
                           "name: t4)" if scenario == "scenario" else f"{scenario} YAML file")
        if scenario == "scenario":
            c.add_argument("--set", dest="overrides", action="append", default=[],
                           metavar="KEY=VALUE", help="override a scenario field, e.g. "
                           "policy.mu=36 or hardware.link.h2d_gbps=25 (repeatable)")
        if schedule:
            c.add_argument("--schedule", choices=list(SCHEDULES))
        if json:
            c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        if device:
            c.add_argument("--device", default=device, choices=["auto", "cpu", "cuda"])
        c.set_defaults(func=getattr(verbs, name))
        return c

    c = command("simulate", schedule=True)
    c.add_argument("--csv", metavar="FILE.csv")
    _trace_args(c)

    c = command("compare")
    c.add_argument("--schedules", type=names, help=f"comma-separated, of {','.join(SCHEDULES)} "
                   "(default: every one that runs on the machine)")
    c.add_argument("--check", action="store_true")
    c.add_argument("--batch-sizes", type=integers("default"), metavar="N,N,...|default",
                   help="compare across batch sizes, each schedule (default S1,S4,S5,EP,EC) at "
                   "the policy that fills its GPU; 'default': 1,2,4,...,256,504")
    c.add_argument("--plot", type=output(api.crossover.writes["plot"]), metavar="PNG",
                   help="with --batch-sizes: draw throughput and per-token latency against "
                   "batch size")
    _backend_args(c, "the batch sizes' simulations")
    _trace_args(c)

    c = command("execute", schedule=True, device="auto")
    c.add_argument("--steps", type=positive)
    c.add_argument("--weights", metavar="DIR")
    c.add_argument("--prompts", metavar="FILE.jsonl")
    c.add_argument("--out", metavar="FILE.jsonl")
    c.add_argument("--profile", action="store_true")
    c.add_argument("--zero-copy", action="store_true")
    c.add_argument("--processes", action="store_true")
    c.add_argument("--record-routing", metavar="FILE.json")
    _trace_args(c)

    c = command("calibrate", default="scenarios/tiny.yaml", device="auto")
    c.add_argument("--out", required=True)

    c = command("fit", scenario="measurements", several=True)
    c.add_argument("--out", required=True, metavar="DIR")
    c.add_argument("--no-loo", dest="loo", action="store_false",
                   help="skip leave-one-out refits")
    c.add_argument("--leave-out", choices=["cell", "file", "machine"], default="cell",
                   help="what each leave-one-out refit leaves out (default: %(default)s)")
    _backend_args(c)

    c = command("validate", device="auto")
    c.add_argument("--schedules", type=names)
    c.add_argument("--mu", type=integers())
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--plot", metavar="PNG")
    _backend_args(c, "the simulations (executions measure this machine and run here)")
    _trace_args(c)

    c = command("search")
    c.add_argument("--top", type=int, default=10)
    c.add_argument("--optimize", choices=["throughput", "latency"])
    c.add_argument("--max-token-ms", type=float, metavar="MS")
    c.add_argument("--max-ttft-s", type=float, metavar="S")
    c.add_argument("--batch", type=int, metavar="N")
    c.add_argument("--plot", metavar="PNG")
    c.add_argument("--verify", action="store_true")
    c.add_argument("--brute-force", action="store_true")
    _backend_args(c, "the simulations of --verify and --brute-force")

    c = command("sweep")
    c.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...")
    c.add_argument("--out", required=True)
    _backend_args(c)

    c = command("batch")
    c.add_argument("--csv", metavar="FILE.csv")

    command("catalog", scenario=None)

    c = command("roofline")
    c.add_argument("--out", required=True)

    c = command("graph", json=False, schedule=True)
    c.add_argument("--step", type=int, default=None)
    c.add_argument("--out", required=True)
    return p


def _backend_args(c: argparse.ArgumentParser, what: str = "the jobs") -> None:
    c.add_argument("--backend", choices=["pool", "ray"], default="pool",
                   help=f"where {what} run: this machine's cores (pool, the default) or Ray")
    c.add_argument("--ray-address", metavar="ADDRESS", help="the Ray cluster to join: 'auto' "
                   "(the cluster this node belongs to, after `ray start`) or ray://HOST:10001 "
                   "(default: a local Ray started for this run)")


def _trace_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--gantt", type=output((".png",)), metavar="PNG", help="draw a Gantt chart "
                   "of two layers of decode step 2 (one row per stream) to PNG")
    c.add_argument("--trace", type=output((".json", ".json.gz", ".pftrace")), metavar="PATH",
                   help="write a trace: Chrome JSON (.json, .json.gz) or Perfetto protobuf "
                   "(.pftrace); Perfetto opens both")
    c.add_argument("--trace-steps", type=window, default=2, metavar="N|all",
                   help="decode steps the trace covers after prefill (default 2; 'all')")


def output(spec: tuple[str, ...] | files.Folder) -> Callable[[str], files.Output]:
    """A path the run writes, declared as the API's are (:func:`taskgraph.api.verb`)."""
    return lambda text: files.output_path(text, spec)


def positive(text: str) -> int:
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def names(text: str) -> list[str]:
    """Comma-separated schedules (``--schedules``)."""
    if not (out := [n.strip() for n in text.split(",") if n.strip()]):
        raise argparse.ArgumentTypeError(f"names no schedule; known schedules: "
                                         f"{', '.join(SCHEDULES)}")
    return out


def integers(*words: str) -> Callable[[str], list[int] | str]:
    """Comma-separated integers, or one of `words`."""
    def parse(text: str) -> list[int] | str:
        if text.strip() in words:
            return text.strip()
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated integers expected, not '{text}'"
                                             ) from None
    return parse


def window(text: str) -> int | None:
    """Decode steps to draw, or 'all' (None)."""
    try:
        return Window.parse(text).max_step
    except TgError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_outputs(args: argparse.Namespace) -> None:
    """Every output path, checked before any work (files.check_outputs); a protobuf trace needs
    the perfetto package."""
    outputs = {f"--{k.replace('_', '-')}": v for k, v in vars(args).items()
               if isinstance(v, files.Output)}
    given = [getattr(args, a, None) for a in ("scenario", "measurements", "prompts")]
    inputs = [p for p in given if isinstance(p, str)] + [
        p for many in given if isinstance(many, list) for p in many]   # tg fit's several files
    files.check_outputs(outputs, inputs)
    if (getattr(args, "trace", None) or "").endswith(".pftrace"):
        require_perfetto()
