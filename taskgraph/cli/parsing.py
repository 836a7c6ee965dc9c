"""The `tg` command line's arguments, and the check of every output path before any work."""

from __future__ import annotations

import argparse
from typing import Callable

from taskgraph import __version__, files
from taskgraph.cli import verbs
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.tracing.writer import Window, require_perfetto


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tg", description="One task graph for offloaded MoE inference: simulate schedules "
        "on modelled hardware and write Perfetto traces.")
    p.add_argument("--version", action="version", version=f"tg {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, func: Callable, help: str, json: bool = True,
                schedule: bool = False) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("scenario", help="scenario YAML file (e.g. scenarios/t4.yaml)")
        c.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a scenario field, e.g. policy.mu=36 "
                       "or hardware.link.h2d_gbps=25 (repeatable)")
        if schedule:
            c.add_argument("--schedule", choices=list(SCHEDULES),
                           help="override the scenario's schedule")
        if json:
            _json_arg(c)
        c.set_defaults(func=func)
        return c

    c = command("simulate", verbs.simulate, "simulate one schedule of a scenario (its whole request "
                "queue, batch after batch, when the workload lists requests)", schedule=True)
    c.add_argument("--csv", metavar="FILE.csv", help="with a request list: write each "
                   "request's batch, micro-batch and finish time here")
    _trace_args(c)

    c = command("compare", verbs.compare, "simulate several schedules side by side")
    c.add_argument("--schedules", default=None,
                   help="comma-separated schedules (default: every schedule that runs on the "
                        f"machine: {','.join(SCHEDULES)}; S5 on one GPU only, PP on several)")
    c.add_argument("--check", action="store_true",
                   help="enforce the scenario's `expect` section; exit 1 if any check fails")
    c.add_argument("--batch-sizes", metavar="N,N,...", help="compare across these batch sizes "
                   "instead, each schedule at the policy that fills its GPU (default schedules: "
                   "S1,S4,S5,EP,EC); 'default' for 1,2,4,...,256,504 (docs/experts.md)")
    c.add_argument("--plot", metavar="PNG", help="with --batch-sizes: draw throughput and "
                   "per-token latency against batch size")
    _backend_args(c, "the batch sizes' simulations")
    _trace_args(c)

    c = command("execute", verbs.execute, "run a schedule for real with real kernels, checked "
                "against a sequential reference forward", schedule=True)
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
    c.add_argument("--record-routing", metavar="FILE.json", help="write the router's top-k "
                   "experts of every layer and token here (tg-routing/1, what "
                   "workload.routing.trace replays): the prefill's for each request's prompt "
                   "tokens, then one token per request each decode step (filler sequences left "
                   "out), taken from the reference forward the tokens are checked against. A "
                   "run of several batches (more prompts than policy.N, or a request list) "
                   "records its first batch only")
    _trace_args(c)

    c = sub.add_parser("calibrate", help="measure this machine and write a hardware profile",
                       description="Measure what the cost model needs on this machine (rates by "
                       "microbenchmark, per-task costs fitted from the executor's own tasks) and "
                       "write a hardware profile any scenario can use.")
    c.add_argument("scenario", nargs="?", default="scenarios/tiny.yaml",
                   help="scenario whose model shapes the executor runs (default: %(default)s)")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    c.add_argument("--out", required=True, help="hardware profile to write (.yaml)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    _json_arg(c)
    c.set_defaults(func=verbs.calibrate)

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
    _json_arg(c)
    c.set_defaults(func=verbs.fit)

    c = command("validate", verbs.validate, "execute and simulate the same graphs; report, task "
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

    c = command("search", verbs.search, "find the policy with the best predicted throughput")
    c.add_argument("--top", type=int, default=10, help="how many policies to list (default 10)")
    c.add_argument("--verify", action="store_true",
                   help="simulate the top policies and re-rank them by simulated throughput")
    c.add_argument("--brute-force", action="store_true",
                   help="also simulate a whole coarse grid and report what trusting the "
                        "predicted pick costs against the best simulated policy")
    _backend_args(c, "the simulations of --verify and --brute-force")

    c = command("sweep", verbs.sweep, "re-run the policy search across hardware or workload values")
    c.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a scenario field and its values (repeatable; the first is the x axis)")
    c.add_argument("--out", required=True, help="output folder for sweep.csv and sweep.png")
    _backend_args(c)

    c = command("batch", verbs.batch, "pack a scenario's request list into batches of "
                "micro-batches (Algorithm 2; padded in arrival order with workload.padded)")
    c.add_argument("--csv", metavar="FILE.csv", help="write each request's batch and "
                   "micro-batch (or 'aborted') here")

    c = command("roofline", verbs.roofline, "plot the Hierarchical Roofline of a scenario (PNG)",
                json=False)
    c.add_argument("--out", required=True, help="output PNG file")

    c = command("graph", verbs.graph, "export one step's task graph (node-link JSON or "
                "Graphviz DOT)", json=False, schedule=True)
    c.add_argument("--step", type=int, default=None,
                   help="segment to export: 0 is prefill, d >= 1 decode step d (default: a "
                        "middle decode step)")
    c.add_argument("--out", required=True, help="output file: .json or .dot")
    return p


def _json_arg(c: argparse.ArgumentParser) -> None:
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")


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


# Where each command writes, and what it must be: (a folder?, required suffixes).
_OUTPUTS = {"trace": (False, (".json", ".json.gz", ".pftrace")), "gantt": (False, (".png",)),
            "plot": (False, (".png",)), "csv": (False, (".csv",)),
            "record_routing": (False, (".json",))}
_OUT = {"fit": (True, ()), "sweep": (True, ()), "roofline": (False, (".png",)),
        "calibrate": (False, (".yaml", ".yml")), "graph": (False, (".json", ".dot")),
        "execute": (False, ())}


def check_outputs(args: argparse.Namespace) -> None:
    """Every output path and trace option, checked before any work (files.check_outputs)."""
    wanted = {k: v for k, v in _OUTPUTS.items() if getattr(args, k, None) is not None}
    if getattr(args, "out", None) is not None and args.command in _OUT:
        wanted["out"] = _OUT[args.command]
    inputs = [getattr(args, a, None) for a in ("scenario", "measurements", "prompts")]
    files.check_outputs({f"--{k.replace('_', '-')}": (getattr(args, k), *v)
                         for k, v in wanted.items()}, [p for p in inputs if p])
    if getattr(args, "trace", None) is not None:
        Window.parse(args.trace_steps)
        if args.trace.endswith(".pftrace"):
            require_perfetto()
