"""The `tg` command line's arguments, and the check of every output path before any work."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from typing import Callable

from taskgraph import __version__, api, files
from taskgraph.cli import verbs
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.errors import TgError
from taskgraph.tracing.writer import Window, require_perfetto


class _Parser(argparse.ArgumentParser):
    """An option is declared by its API parameter (:func:`taskgraph.api.verb`), in the
    `documented` function: unless the command line gives its own, its help is the parameter's
    line in the docstring's ``Args:`` section (one text for ``tg X --help`` and
    ``help(tg.X)``), a flag is a parameter that defaults to False, a number's type and default
    are the parameter's, and a path the function writes is checked as its ``writes`` says."""

    def __init__(self, *args, documented: Callable | None = None, **kwargs):
        self.documented = _args_section(documented) if documented else {}
        self.writes = getattr(documented, "writes", {})
        self.parameters = inspect.signature(documented).parameters if documented else {}
        self.hints = typing.get_type_hints(documented) if documented else {}
        super().__init__(*args, **kwargs)       # which adds --help

    def add_argument(self, *args, **kwargs):
        dest = kwargs.get("dest") or args[-1].lstrip("-").replace("-", "_")
        if dest in self.parameters and not {"action", "type", "default"} & kwargs.keys():
            kwargs.update(self._declared(dest))
        action = super().add_argument(*args, **kwargs)
        if action.type is None and action.dest in self.writes:
            action.type = output(self.writes[action.dest])
        if action.help is None and action.dest in self.documented:
            text = self.documented[action.dest].replace("%", "%%")    # argparse formats it
            shown = action.default not in (None, False) and "default" not in text
            action.help = text + (" (default: %(default)s)" if shown else "")
        return action

    def _declared(self, name: str) -> dict:
        """A flag, or a number's type and default, as the API parameter `name` declares them."""
        default = self.parameters[name].default
        if default is False:
            return {"action": "store_true"}
        number = [t for t in typing.get_args(self.hints[name]) or [self.hints[name]]
                  if t in (int, float)]
        return {"type": number[0], "default": default} if number else {}

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
    for name, verb in VERBS.items():
        help, description = _summary(name, getattr(api, name))
        c = sub.add_parser(name, help=help, description=description,
                           documented=getattr(api, name))
        verb.declare(c)
        for option, settings in verb.options.items():
            c.add_argument(option, **settings)
        c.set_defaults(func=getattr(verbs, name))
    return p


@dataclasses.dataclass
class Verb:
    """How `tg X` takes its scenario and which of the usual options it has; `options` are its
    own, declared by its API parameter unless given here (_Parser)."""

    options: dict[str, dict] = dataclasses.field(default_factory=dict)
    json: bool = True
    schedule: bool = False
    scenario: str | None = "scenario"
    default: str | None = None
    device: str | None = None
    several: bool = False

    def declare(self, c: argparse.ArgumentParser) -> None:
        scenario = self.scenario
        if self.default:
            c.add_argument(scenario, nargs="?", default=self.default, help="a scenario whose "
                           "model shapes the executor runs (default: %(default)s)")
        elif self.several:
            c.add_argument(scenario, nargs="+", help=f"{scenario} YAML file(s)")
        elif scenario:
            c.add_argument(scenario, help=f"{scenario} YAML file (or a shipped scenario's "
                           "name: t4)" if scenario == "scenario" else f"{scenario} YAML file")
        if scenario == "scenario":
            c.add_argument("--set", dest="overrides", action="append", default=[],
                           metavar="KEY=VALUE", help="override a scenario field, e.g. "
                           "policy.mu=36 or hardware.link.h2d_gbps=25 (repeatable)")
        if self.schedule:
            c.add_argument("--schedule", choices=list(SCHEDULES))
        if self.json:
            c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        if self.device:
            c.add_argument("--device", default=self.device, choices=["auto", "cpu", "cuda"])


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


def _backend(what: str = "the jobs") -> dict[str, dict]:
    return {"--backend": dict(choices=["pool", "ray"], default="pool",
                              help=f"where {what} run: this machine's cores (pool, the default) "
                              "or Ray"),
            "--ray-address": dict(metavar="ADDRESS", help="the Ray cluster to join: 'auto' (the "
                                  "cluster this node belongs to, after `ray start`) or "
                                  "ray://HOST:10001 (default: a local Ray started for this run)")}


TRACE = {
    "--gantt": dict(type=output((".png",)), metavar="PNG", help="draw a Gantt chart of two "
                    "layers of decode step 2 (one row per stream) to PNG"),
    "--trace": dict(type=output((".json", ".json.gz", ".pftrace")), metavar="PATH",
                    help="write a trace: Chrome JSON (.json, .json.gz) or Perfetto protobuf "
                    "(.pftrace); Perfetto opens both"),
    "--trace-steps": dict(type=window, default=2, metavar="N|all", help="decode steps the "
                          "trace covers after prefill (default 2; 'all')")}
PNG, REQUIRED = dict(metavar="PNG"), dict(required=True)

VERBS = {
    "simulate": Verb(schedule=True, options={"--csv": dict(metavar="FILE.csv"), **TRACE}),
    "compare": Verb(options={
        "--schedules": dict(type=names, help=f"comma-separated, of {','.join(SCHEDULES)} "
                            "(default: every one that runs on the machine)"),
        "--check": {},
        "--batch-sizes": dict(type=integers("default"), metavar="N,N,...|default",
                              help="compare across batch sizes, each schedule (default "
                              "S1,S4,S5,EP,EC) at the policy that fills its GPU; 'default': "
                              "1,2,4,...,256,504"),
        "--plot": dict(type=output(api.crossover.writes["plot"]), metavar="PNG",
                       help="with --batch-sizes: draw throughput and per-token latency against "
                       "batch size"),
        **_backend("the batch sizes' simulations"), **TRACE}),
    "execute": Verb(schedule=True, device="auto", options={
        "--steps": dict(type=positive), "--weights": dict(metavar="DIR"),
        "--prompts": dict(metavar="FILE.jsonl"), "--out": dict(metavar="FILE.jsonl"),
        "--profile": {}, "--zero-copy": {}, "--processes": {},
        "--record-routing": dict(metavar="FILE.json"), **TRACE}),
    "calibrate": Verb(default="scenarios/tiny.yaml", device="auto", options={"--out": REQUIRED}),
    "fit": Verb(scenario="measurements", several=True, options={
        "--out": dict(required=True, metavar="DIR"),
        "--no-loo": dict(dest="loo", action="store_false", help="skip leave-one-out refits"),
        "--leave-out": dict(choices=["cell", "file", "machine"], default="cell",
                            help="what each leave-one-out refit leaves out (default: "
                            "%(default)s)"),
        **_backend()}),
    "validate": Verb(device="auto", options={
        "--schedules": dict(type=names), "--mu": dict(type=integers()), "--repeats": {},
        "--plot": PNG,
        **_backend("the simulations (executions measure this machine and run here)"),
        **TRACE}),
    "search": Verb(options={
        "--top": {}, "--optimize": dict(choices=["throughput", "latency"]),
        "--max-token-ms": dict(metavar="MS"), "--max-ttft-s": dict(metavar="S"),
        "--batch": dict(metavar="N"), "--plot": PNG, "--verify": {}, "--brute-force": {},
        **_backend("the simulations of --verify and --brute-force")}),
    "sweep": Verb(options={"--vary": dict(action="append", required=True,
                                          metavar="KEY=V1,V2,..."),
                           "--out": REQUIRED, **_backend()}),
    "batch": Verb(options={"--csv": dict(metavar="FILE.csv")}),
    "catalog": Verb(scenario=None),
    "roofline": Verb(options={"--out": REQUIRED}),
    "graph": Verb(json=False, schedule=True, options={"--step": {}, "--out": REQUIRED}),
}


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
