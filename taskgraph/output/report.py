"""Human-readable views of results: rich tables, which the command line prints on stderr and
a notebook shows as HTML (JSON goes to stdout)."""

from __future__ import annotations

import io
import math
import re
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console, ConsoleOptions, RenderableType
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from taskgraph.expect import Check
from taskgraph.perf.cost import POOL_NAMES


def _policy(p: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else
                    f"{k}={_patterns(v)}" if isinstance(v, (list, tuple)) else f"{k}={v}"
                    for k, v in p.items())


def _patterns(values, limit: int = 3) -> str:
    """A list (llama.cpp's -ot patterns) as -ot writes it, the first `limit` of a long one."""
    more = f",... ({len(values)} in all)" if len(values) > limit else ""
    return ",".join(str(v) for v in values[:limit]) + more


class Shown:
    """A result that shows itself as its tables: `console.print(result)` in a terminal (what
    the command line prints), the same tables as HTML in a notebook. Subclasses say what they
    show in `views()`."""

    def views(self) -> Iterator[RenderableType]:
        raise NotImplementedError

    def __rich_console__(self, console: Console, options: ConsoleOptions
                         ) -> Iterator[RenderableType]:
        yield from self.views()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        console = Console(file=io.StringIO(), record=True, width=110, highlight=False,
                          markup=False)
        console.print(self)
        return {"text/plain": console.export_text(clear=False),
                "text/html": console.export_html(inline_styles=True)}


def warnings_of(summary: dict[str, Any], prefix: str = "") -> Iterator[Text]:
    """A result's warnings, as text (never markup: they quote user input)."""
    for text in summary.get("warnings", []):
        yield Text.assemble(("warning:", "yellow"), f" {prefix}{text}")


def simulate_table(r: dict[str, Any], rows: list[tuple[str, str]] = ()) -> Table:
    """One run's figures; `rows` are added before the task count (a queue's requests)."""
    t = Table(title=f"tg simulate {r['scenario']}: {r['schedule']} ({r['schedule_title']}), "
                    f"{r['model']} on {r['hardware']}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("policy", _policy(r["policy"]))
    if "model_size" in r:
        t.add_row("model", _model_size(r["model_size"]))
    limit = (f" ({r['hardware_limit_fraction']:.0%} of the hardware limit, "
             f"{r['hardware_limit_tok_s']:.0f} tok/s)"
             if r.get("hardware_limit_fraction") is not None else
             " (the weights leave no room for a KV cache)" if "hardware_limit_tok_s" in r
             else "")
    t.add_row("throughput", f"{r['throughput_tok_s']:.2f} tok/s{limit}")
    t.add_row("prefill / decode", f"{r['prefill_s']:.2f} s / {r['decode_s']:.2f} s "
                                  f"({r['steps']} steps x {r['layers']} layers)")
    if r.get("overlap_s"):
        t.add_row("overlap", f"decode began {r['overlap_s']:.2f} s before prefill ended")
    t.add_row("decode layer", f"{r['decode_layer_ms']:.2f} ms (HRM bound {r['hrm_layer_ms']:.2f}"
                              f" ms, {r['hrm_binding']}-bound: {r['efficiency']:.1%})")
    t.add_row("utilization", "  ".join(f"{k} {v:.0%}" for k, v in r["utilization"].items()))
    if r.get("shared"):
        t.add_row("host shared", "  ".join(
            f"{POOL_NAMES[p]} {x['capacity_gbps']:g} GB/s: {x['prefill']:.0%} of prefill, "
            f"{x['decode']:.0%} of decode" for p, x in r["shared"].items()))
    if "bound_by" in r and not r.get("measured"):
        t.add_row("bound by", f"prefill {r['bound_by']['prefill']}, decode "
                              f"{r['bound_by']['decode']}")
    if "experts" in r:
        if "ttft_s" in r:         # a request list's latencies are its requests' (finish times)
            t.add_row("latency", f"first token {r['ttft_s']:.2f} s, then "
                                 f"{r['token_latency_ms']:.1f} ms a token")
        t.add_row("experts", _experts(r["experts"], r["policy"]))
    m = r["memory"]
    t.add_row("memory peak", f"GPU {m['gpu_peak_gb']:.2f} of {m['gpu_usable_gb']:.2f} GB   "
                             f"CPU {m['cpu_peak_gb']:.1f} of {m['cpu_usable_gb']:.1f} GB")
    for row in rows:
        t.add_row(*row)
    verb = "executed" if r.get("measured") else "simulated"
    t.add_row("tasks", f"{r['tasks']:,} {verb} in {r['wall_s']:.2f} s"
              + ("  (INTERRUPTED)" if r.get("interrupted") else ""))
    return t


def _model_size(x: dict[str, Any]) -> str:
    """Parameters, GB as stored, and the bits per weight of each class of tensor."""
    p = x["params"]
    by_bits: dict[float, list[str]] = {}
    for c, v in x["classes"].items():
        by_bits.setdefault(v["bits"], []).append(c)
    size = f"{p['total'] / 1e9:.1f} B params ({p['active'] / 1e9:.1f} B a token), {x['gb']:.2f} GB"
    if len(by_bits) == 1:
        return f"{size} at {next(iter(by_bits)):g} bits"
    return f"{size}: " + "; ".join(f"{b:g} bits {', '.join(cs)}"
                                   for b, cs in sorted(by_bits.items()))


def _experts(x: dict[str, Any], policy: dict[str, Any]) -> str:
    touched = (f"{x['distinct_per_layer']:.2f} ± {x['distinct_std']:.2f} distinct a layer and "
               f"micro-batch ({x['routing']} routing)")
    if "gpu_share" in x:
        llama = (f"; llama.cpp: {x['llama_cpp']}" if x.get("llama_cpp")
                 else f"; no llama.cpp equivalent ({x['llama_cpp_means']})"
                 if "llama_cpp_means" in x else "")
        return (f"{touched}; the {_placed(x, policy)} placed on the GPU take "
                f"{x['gpu_share']:.0%} of the tokens' experts{llama}")
    hits = f"{x['hit_rate']:.0%}"
    if x.get("measured_hit_rate") is not None:          # an executed run: what its cache held
        hits = f"{x['measured_hit_rate']:.0%} in decode (the model: {hits})"
    # a swapping cache writes each evicted expert back on the copy stream, after the copy in:
    # the stream (h2d) is busy for both, and binds
    swaps = (f"; every copy in swaps, the h2d stream writing evicted experts back GPU->CPU "
             f"{x['written_back']:.0%} of the run" if x.get("written_back") else "")
    return (f"{touched}; cache of {policy['experts_gpu']} a layer ({policy['eviction']}) hits "
            f"{hits}{swaps}")


def _placed(x: dict[str, Any], policy: dict[str, Any]) -> str:
    """EP's experts on the GPU in words: '2 a layer', '56 (1 to 2 a layer)'."""
    per_layer = [n for n in x.get("on_gpu_by_layer", ()) if n is not None]
    if not per_layer:                                   # a result written before placements
        return f"{policy['experts_gpu']} a layer"
    lo, hi = min(per_layer), max(per_layer)
    if lo == hi:
        return f"{lo} a layer"
    return f"{x['on_gpu']} ({lo} to {hi} a layer)"


def queue_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """A simulated request queue's rows: how its requests were batched and when they finished."""
    q = r["requests"]
    fin = q["finish_s"]
    how = "padded" if q["padded"] else "refill" if q.get("refill") else "Algorithm 2"
    return [("requests", f"{q['finished']:,} of {q['count']:,} in {q['batches']} batches "
                         f"({how}), {len(q['aborted'])} aborted"),
            ("finished", f"{fin['median']:.2f} s median, {fin['p99']:.2f} s p99")]


def execute_queue_table(r: dict[str, Any]) -> Table:
    q = r["requests"]
    t = Table(title=f"tg execute {r['scenario']}: {r['schedule']} ({r['schedule_title']}) on "
                    f"{r['device']}, {r['model']} dimensions, a request list (measured)",
              show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("policy", _policy(r["policy"]))
    t.add_row("throughput", f"{r['throughput_tok_s']:.2f} tok/s "
                            f"({q['generated_tokens']:,} tokens in {r['makespan_s']:.2f} s)")
    t.add_row("requests", f"{q['executed']:,} of {q['count']:,} in {q['batches']} batches "
                          f"({'padded' if q['padded'] else 'Algorithm 2'}), "
                          f"{len(q['aborted'])} aborted")
    batched, alone = r["tokens_match"], r["requests_match_alone"]
    t.add_row("vs reference", "not checked" if batched is None else
              f"batches {'identical' if batched else 'DIFFER'}; each request alone: "
              + ("identical" if alone else f"{len(r['mismatched'])} DIFFER"))
    t.add_row("weights", r["dtype"])
    return t


def execute_table(r: dict[str, Any]) -> Table:
    t = simulate_table(r)
    t.title = (f"tg execute {r['scenario']}: {r['schedule']} ({r['schedule_title']}) on "
               f"{r['device']}, {r['model']} dimensions (measured)")
    ok = r["tokens_match"]
    t.add_row("vs reference", "not checked (run stopped early)" if ok is None else
              f"tokens {'identical' if ok else 'DIFFER'}, max |logit error| {r['max_abs_err']:.3g}")
    t.add_row("weights", r["dtype"])
    if "requests" in r:
        t.add_row("requests", f"{r['requests']}" + (f", tokens written to {r['out']}"
                                                    if r.get("out") else ""))
    return t


def validate_table(results, accuracy: dict[str, Any], scenario) -> Table:
    ranks = "; ".join(f"{k}: {_ranking(v)}" for k, v in accuracy["ranking"].items())
    shift = accuracy.get("speed_shift")
    if shift is not None:
        ranks += (f". Nearly every task kind is simulated {abs(shift):.0%} "
                  f"{'slower' if shift > 0 else 'faster'} than measured: this machine ran at "
                  "another speed than when it was calibrated; calibrate again just before "
                  "validating")
    t = Table(title=f"tg validate {scenario.name} on {scenario.hardware.name}: median |error| "
                    f"{accuracy['median_abs_error_decode_layer']:.1%} over "
                    f"{accuracy['pairs']} pairs", title_justify="left",
              caption=f"ranking of schedules by decode-layer latency: {ranks}. Per task kind, "
                      "median error: " + ", ".join(f"{k} {v:+.0%}" for k, v in
                                                   accuracy["per_task_median_error"].items()),
              caption_justify="left")
    for col in ("pair", "measured ms/layer", "repeats' range", "simulated ms/layer", "error",
                "measured tok/s", "simulated tok/s", "vs reference"):
        t.add_column(col, justify="left" if col == "pair" else "right")
    for r in results:
        lo, hi = r.measured_range
        t.add_row(f"{r.schedule} mu={r.policy['mu']}", f"{r.measured['decode_layer_ms']:.2f}",
                  f"{lo:.1f}-{hi:.1f}",
                  f"{r.simulated['decode_layer_ms']:.2f}", f"{r.layer_error:+.1%}",
                  f"{r.measured['throughput_tok_s']:.1f}",
                  f"{r.simulated['throughput_tok_s']:.1f}",
                  "exact" if r.measured.get("tokens_match") else "DIFFERS")
    return t


def _ranking(v: dict[str, Any]) -> str:
    order = f"measured {' < '.join(v['measured'])}"
    if v["same"]:
        return f"same ({order})"
    if v["agree"]:
        return (f"same where the repeats tell schedules apart ({order}; not told apart: "
                f"{', '.join(v['unresolved'])})")
    return f"DIFFERENT ({order}, simulated {' < '.join(v['simulated'])})"


def compare_table(results: list[dict[str, Any]], notes: dict[str, str]) -> Table:
    first = results[0]
    best = max(r["throughput_tok_s"] for r in results)
    # the title holds the fields every row has (the scenario's values; a schedule that decides
    # another says so in its caption); a field only some rows have (an expert cache's eviction,
    # ECP's prefetch) goes in those rows' captions, not above rows it does not apply to
    everyone = set.intersection(*(set(r["policy"]) for r in results))

    def caption(r: dict[str, Any]) -> str:
        own = {k: v for k, v in r["policy"].items() if k not in everyone}
        said = [x for x in (_policy(own) if own else None, notes.get(r["schedule"])) if x]
        return f"{r['schedule']}: {r['schedule_title']}" + (f" ({'; '.join(said)})" if said
                                                             else "")

    captions = list(dict.fromkeys(caption(r) for r in results))
    shared = {k: v for k, v in first["policy"].items() if k in everyone}
    t = Table(title=f"tg compare {first['scenario']}: {first['model']} on {first['hardware']}, "
                    f"{_policy(shared)}; busy = share of the run each resource works",
              title_justify="left",
              caption="; ".join(captions), caption_justify="left")
    for col in ("", "tok/s", "vs best", "layer ms", "HRM ms", "eff.", "bound", "gpu", "cpu",
                "h2d", "d2h", "GPU GB"):
        t.add_column(col, justify="left" if col in ("", "bound") else "right")
    for r in results:
        u = r["utilization"]
        q = r.get("requests")
        label = r["schedule"] + ("" if q is None else " padded" if q["padded"]
                                 else " refill" if q.get("refill") else " Alg. 2")
        t.add_row(label, f"{r['throughput_tok_s']:.2f}",
                  f"{r['throughput_tok_s'] / best:.2f}x", f"{r['decode_layer_ms']:.1f}",
                  f"{r['hrm_layer_ms']:.1f}", f"{r['efficiency']:.0%}", r["hrm_binding"],
                  *(f"{u[k]:.0%}" for k in ("gpu", "cpu", "h2d", "d2h")),
                  f"{r['memory']['gpu_peak_gb']:.2f}")
    return t


def search_table(result, scenario_name: str, limit: float) -> Table:
    verified, objective = result.verified, result.objective
    wanted = "lowest per-token latency" if objective.optimize == "latency" else "most tok/s"
    within = f" within {objective.limits()}" if objective.limits() else ""
    at = f" at N = {objective.batch:,}" if objective.batch else ""
    simulated = f", {result.simulated:,} of them simulated" if result.simulated else ""
    if not result.limits_met:
        wanted, within = f"no policy meets {objective.limits()}", ""
        at += ", the closest first"
    t = Table(title=f"tg search {scenario_name}: {wanted}{within}{at}; {result.evaluated:,} "
                    f"feasible of {result.considered:,} policies in {result.wall_s:.2f} s"
                    f"{simulated}", title_justify="left",
              caption=f"best: {result.best.schedule} {_policy(result.best.policy)}, bound by "
                      f"{result.binding}; hardware limit {limit:.0f} tok/s. Run it: tg "
                      f"execute (or simulate) {result.path} {result.best.run_with()}. "
                      "Figures are HRM predictions but those marked *, simulated (the "
                      "expert-level schedules have no HRM bound); policies within 0.1% are "
                      "equal and the one that keeps less on the GPU wins. "
                      + " ".join(result.notes),
              caption_justify="left")
    experts = any(_experts_placed(c.policy) for c in result.top)
    for col in ("#", "sched", "N", "mu", "A_g", "r_w", "r_c", *(("experts",) if experts else ()),
                "tok/s", *(("sim tok/s",) if verified else ()), "ms/token", "TTFT s",
                "layer ms", "bound by"):
        t.add_column(col, justify="left" if col in ("sched", "bound by", "experts") else "right")
    for i, c in enumerate(result.top, 1):
        p = c.policy
        mark = "*" if c.priced_by == "simulation" else ""
        t.add_row(str(i), c.schedule, str(p["N"]), str(p["mu"]), str(p["A_g"]), f"{p['r_w']:g}",
                  f"{p['r_c']:g}", *((_experts_placed(p),) if experts else ()),
                  f"{c.predicted_tok_s:.2f}{mark}",
                  *((f"{c.simulated_tok_s:.2f}",) if verified else ()),
                  f"{_num(c.token_latency_ms)}{mark}", f"{_num(c.ttft_s)}{mark}",
                  f"{_num(c.predicted_layer_ms)}{mark}", c.resource)
    return t


def _experts_placed(p: dict[str, Any]) -> str:
    """An expert-level policy's experts on the GPU (per layer, or as placed across layers),
    and its cache's eviction."""
    if "experts_total" in p:
        return f"{p['experts_total']} in all"
    if "cpu_moe" in p:
        return f"--n-cpu-moe {p['cpu_moe']}"
    if "override_tensor" in p:
        return "-ot " + _patterns(p["override_tensor"])
    if "experts_gpu" not in p:
        return ""
    return f"{p['experts_gpu']} a layer" + (f", {p['eviction']}" if "eviction" in p else "")


def pareto_table(result) -> Table:
    shown, front = result.shown_front(), result.front
    t = Table(title=f"the trade-off: {len(front)} polic{'y' if len(front) == 1 else 'ies'} no "
                    "other beats on both tok/s and "
                    f"ms/token" + (f" ({len(shown)} shown)" if len(shown) < len(front) else ""),
              title_justify="left",
              caption="Lower latency costs throughput along the front; * simulated, the others "
                      "HRM predictions. --plot draws it.", caption_justify="left")
    for col in ("sched", "N", "mu", "r_w", "experts", "tok/s", "ms/token", "TTFT s",
                "bound by", "meets limits"):
        t.add_column(col, justify="left" if col in ("sched", "experts", "bound by") else "right")
    for c in shown:
        p, mark = c.policy, "*" if c.priced_by == "simulation" else ""
        t.add_row(c.schedule, str(p["N"]), str(p["mu"]), f"{p['r_w']:g}", _experts_placed(p),
                  f"{c.tok_s:.2f}{mark}", f"{_num(c.token_latency_ms)}{mark}",
                  f"{_num(c.ttft_s)}{mark}", c.resource,
                  "yes" if result.objective.met_by(c.token_latency_ms, c.ttft_s) else "no")
    return t


def brute_force_table(grid, summary: dict[str, Any]) -> Table:
    loss, in_grid = summary["loss_vs_best"], summary["loss_in_grid"]
    t = Table(title=f"brute force: {summary['simulated']} policies of a coarse grid simulated",
              title_justify="left",
              caption=f"The search's pick simulates at {summary['hrm_pick_simulated_tok_s']:.2f} "
                      f"tok/s: {_loss(loss)} the best simulated policy; among the grid's own "
                      f"policies the predicted favourite is {_loss(in_grid)} the best.",
              caption_justify="left")
    experts = any(_experts_placed(c.policy) for c in grid)
    for col in ("#", "sched", "N", "mu", "A_g", "r_w", "r_c", *(("experts",) if experts else ()),
                "sim tok/s", "pred. tok/s"):
        t.add_column(col, justify="left" if col in ("sched", "experts") else "right")
    for i, c in enumerate(grid, 1):
        p = c.policy
        t.add_row(str(i), c.schedule, str(p["N"]), str(p["mu"]), str(p["A_g"]), f"{p['r_w']:g}",
                  f"{p['r_c']:g}", *((_experts_placed(p),) if experts else ()),
                  f"{c.simulated_tok_s:.2f}", f"{c.predicted_tok_s:.2f}")
    return t


def _loss(x: float) -> str:
    return f"{x:.1%} below" if x > 0 else f"{-x:.1%} above" if x < 0 else "equal to"


def sweep_table(rows: list[dict[str, Any]], vary, paths) -> Table:
    t = Table(title=f"tg sweep: {len(rows)} points, files {', '.join(map(str, paths))}",
              title_justify="left")
    keys = [k for k, _ in vary]
    for col in keys + ["tok/s", "sched", "N", "mu", "A_g", "r_w", "r_c", "binding"]:
        t.add_column(col)
    for r in rows:
        if r["error"]:
            t.add_row(*(str(r[k]) for k in keys), "infeasible", *[""] * 6, r["error"][:40])
            continue
        t.add_row(*(str(r[k]) for k in keys), f"{r['throughput_tok_s']:.1f}", r["schedule"],
                  str(r["N"]), str(r["mu"]), str(r["A_g"]), f"{r['r_w']:g}", f"{r['r_c']:g}",
                  r["binding"])
    return t


#: How `tg calibrate` shows each rate it measured: label, scale, unit.
_RATES = {
    "gemm_flops": ("matrix multiply", 1e9, "GFLOP/s"),
    "gpu_gemm_flops": ("GPU matrix multiply (fp16)", 1e12, "TFLOP/s"),
    "cpu_gemm_flops": ("CPU matrix multiply", 1e9, "GFLOP/s"),
    "gpu_mem_bytes_per_s": ("GPU memory copy", 1e9, "GB/s"),
    "mem_bytes_per_s": ("memory copy", 1e9, "GB/s"),
    "attn_bytes_per_s": ("decode attention (CPU)", 1e9, "GB/s"),
    "memcpy_bytes_per_s": ("page copy (memcpy)", 1e9, "GB/s"),
    "h2d_pinned_bytes_per_s": ("CPU->GPU from pinned memory", 1e9, "GB/s"),
    "h2d_pageable_bytes_per_s": ("CPU->GPU from pageable memory", 1e9, "GB/s"),
    "d2h_pinned_bytes_per_s": ("GPU->CPU to pinned memory", 1e9, "GB/s"),
    "d2h_pageable_bytes_per_s": ("GPU->CPU to pageable memory", 1e9, "GB/s"),
    "copy_latency_s": ("copy latency", 1e-6, "µs"),
    "launch_s": ("kernel launch (host side)", 1e-6, "µs"),
}


def calibrate_table(measured: dict[str, Any], out: str) -> Table:
    t = Table(title=f"tg calibrate: wrote {out}", title_justify="left")
    t.add_column("measured")
    t.add_column("value", justify="right")
    for key, value in measured["rates"].items():
        label, scale, unit = _RATES[key]
        t.add_row(label, f"{value / scale:.1f} {unit}")
    t.add_row("hand-off between streams", f"{measured['handoff_us']:.1f} µs")
    for victim, by in measured.get("slowdown", {}).items():
        t.add_row(f"{victim} tasks slowed while busy", ", ".join(
            f"{name} +{x:.0%}" for name, x in by.items() if x > 0) or "-")
    for kind, info in measured["tasks"].items():
        rate, expert = measured["task_gbps"].get(kind), measured.get("expert_us", {}).get(kind)
        t.add_row(f"{kind} ({info['tasks']} tasks)",
                  f"{measured['fixed_us'][kind]:.0f} µs fixed"
                  + (f" + {expert:.0f} µs an expert" if expert else "")
                  + (f" + bytes / {rate:.2f} GB/s" if rate else ""))
    for kind, rate in measured.get("dequant_gweights", {}).items():
        t.add_row(f"{kind} dequantizing Q4_0 experts",
                  f"{rate:.3f} G weights/s" if rate else "no measurable cost")
    return t


def check_table(checks: list[Check]) -> Table:
    failed = sum(not c.ok for c in checks)
    t = Table(title=f"expect: {len(checks) - failed} of {len(checks)} checks hold",
              title_justify="left")
    for col in ("schedule", "check", "expected", "actual", "result"):
        t.add_column(col)
    for c in checks:
        t.add_row(c.schedule, c.what, c.expected, c.actual,
                  Text("ok", style="green") if c.ok else Text("FAILED", style="bold red"))
    return t


def stderr_console() -> Console:
    """Where progress and diagnostics go."""
    return _console(sys.stderr)


def stdout_console() -> Console:
    """Where results go, so that `tg simulate x.yaml > out.txt` and `| less` hold them."""
    return _console(sys.stdout)


def _console(stream) -> Console:
    # CI logs are not terminals; give tables room rather than rich's 80-column default. No
    # string is markup: names, paths and ids are the user's text ("x[/b]" is a fine name);
    # styles come from Text objects.
    return Console(file=stream, highlight=False, markup=False,
                   width=None if stream.isatty() else 110)


def fit_table(report) -> tuple[Table, Table, Table]:
    """The cells (measured, simulated, leave-one-out, datasheet-only), what binds each at the
    fitted values, and the fitted values."""
    s = report.summary()
    wrong = [k for k, v in s["rankings"].items() if not v["right"]]
    ranks = (f"right in all {len(s['rankings'])} settings" if not wrong else
             f"WRONG in {len(wrong)} of {len(s['rankings'])}: " + "; ".join(wrong))
    def errors(e: dict) -> str:
        loo = (f", {left} {e['loo_median_abs_error']:.1%} (max {e['loo_max_abs_error']:.1%})"
               if e["loo_median_abs_error"] is not None else ", no leave-one-out")
        return f"median |error| {e['median_abs_error']:.1%} (max {e['max_abs_error']:.1%}){loo}"

    left = ("leave-one-out" if s["leave_out"] == "cell" else
            f"leaving each {s['leave_out']} out")
    by_file = "".join(f"\n{f}: {errors(e)}" for f, e in s.get("by_file", {}).items())
    cells = Table(title=f"tg fit {report.source}: {errors(s)}",
                  title_justify="left", caption=f"ranking of systems within each setting: "
                                                f"{ranks}{by_file}", caption_justify="left")
    for col in ("cell", "sched", "measured tok/s", "simulated", "error", left,
                "error", "datasheet only", "error"):
        cells.add_column(col, justify="left" if col == "cell" else "right")
    for r in report.cells:
        cells.add_row(cell_label(r.cell), r.cell.schedule, f"{r.cell.measured_tok_s:.2f}",
                      f"{r.simulated:.2f}", f"{r.error:+.1%}",
                      *((f"{r.loo:.2f}", f"{r.loo_error:+.1%}") if math.isfinite(r.loo) else
                        ("-", "-")),      # --no-loo
                      f"{r.datasheet:.2f}", f"{r.datasheet_error:+.1%}")
    pools = sorted({p for r in report.cells for p in r.shared})
    binds = Table(title="what binds each cell at the fitted values (share of each phase the "
                        "host's shared pools were in use)", title_justify="left")
    for col in ("cell", "prefill", "decode", *(f"{POOL_NAMES[p]} (decode)" for p in pools),
                "memory"):
        binds.add_column(col, justify="left" if col in ("cell", "memory") else "right")
    for r in report.cells:
        binds.add_row(cell_label(r.cell), r.bound_by.get("prefill", ""), r.bound_by.get("decode", ""),
                      *(f"{r.shared[p]['decode']:.0%}" if p in r.shared else "" for p in pools),
                      "over: " + r.memory.split(":")[0] if r.memory else "fits")
    values = Table(title="fitted parameters", title_justify="left")
    for col in ("parameter", "value", "bounds", "mechanism"):
        values.add_column(col, justify="right" if col == "value" else "left")
    bound = set(report.at_bound())
    for p, v in zip(report.params, report.values):
        values.add_row(p.name, f"{v:.4g}" + (" AT BOUND" if p.name in bound else ""),
                       f"[{p.lo:g}, {p.hi:g}]", p.why)
    return cells, binds, values


def phases_table(phases: list[dict]) -> Table:
    """Prefill and the time per decode step between generation lengths, measured (from runs
    that differ only in how many tokens they generate) and simulated."""
    t = Table(title="prefill and decode as measured: runs that differ only in generation "
                    "length, their times' differences", title_justify="left")
    for col in ("cells", "phase", "context", "measured s", "simulated s", "error"):
        t.add_column(col, justify="left" if col in ("cells", "phase") else "right")
    for group in phases:
        p = group["prefill_s"]
        rows = [("prefill (extrapolated)", "", p["measured"], p["simulated"])] + [
            (f"a step, {s['from_gen']}-{s['to_gen']} generated", f"{s['context']:.0f}",
             s["measured_s"], s["simulated_s"]) for s in group["steps"]]
        for i, (phase, context, measured, simulated) in enumerate(rows):
            known = measured is not None and measured > 0
            t.add_row(group["label"] if i == 0 else "", phase, context,
                      "-" if measured is None else f"{measured:.3g}", f"{simulated:.3g}",
                      f"{simulated / measured - 1:+.0%}" if known else "")
        if group["note"]:
            t.add_row("", Text(group["note"], style="yellow"), "", "", "", "")
    return t


def differences_table(differences: list[dict]) -> Table:
    """What one system costs over another on one policy, a generated token: measured (the
    difference of their run times) and simulated."""
    t = Table(title="systems on one policy: what one costs over the other, a generated token",
              title_justify="left")
    for col in ("setting", "systems", "measured s", "simulated s", "error"):
        t.add_column(col, justify="left" if col in ("setting", "systems") else "right")
    for d in differences:
        measured, simulated = d["measured_s"], d["simulated_s"]
        t.add_row(d["label"], " over ".join(d["systems"]), f"{measured:.3g}",
                  f"{simulated:.3g}", f"{simulated / measured - 1:+.0%}" if measured > 0 else "")
    return t


def cell_label(c, gen: bool = True) -> str:
    """A measured cell as a reader names it: machine, workload, generated tokens (unless not
    `gen`), batch, system."""
    w = c.workload
    if not c.system:
        return c.id
    batch = f"batch {c.policy.batch}" if c.policy.batch is not None else ""
    return " ".join(str(x) for x in (c.machine, w.get("preset", ""),
                                     w.get("gen_len", "") if gen else "", batch, c.system)
                    if x != "")


def batch_table(scenario: Any, packing: Any) -> Table:
    """How a request list was packed: batches, micro-batches, their balance, what was aborted."""
    p, j = scenario.policy, packing.to_json()
    how = ("padded, arrival order" if packing.padded else "Algorithm 2, longest prompt first")
    t = Table(title=f"tg batch {scenario.name}: {len(scenario.requests):,} requests, N={p.N} "
                    f"mu={p.mu} ({how})", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    sizes = [len(mb.requests) for b in packing.batches for mb in b]
    t.add_row("batches", f"{j['batches']:,} of up to {p.n_micro} micro-batches")
    t.add_row("micro-batches", f"{j['micro_batches']:,}, {min(sizes, default=0)}-"
                               f"{max(sizes, default=0)} requests each (at most {p.mu})")
    t.add_row("prompt tokens", f"{j['micro_batch_prompt_tokens']['min']:,}-"
                               f"{j['micro_batch_prompt_tokens']['max']:,} per micro-batch")
    t.add_row("cache limit", f"{packing.cache_tokens:,} tokens per micro-batch (mu x (prompt + "
                             "generated) at the mean lengths)")
    aborted = packing.aborted
    shown = ", ".join(f"{r.id} ({r.prompt_len}+{r.gen_len})" for r in aborted[:5])
    t.add_row("aborted", f"{len(aborted)}" + (f": {shown}" + (", ..." if len(aborted) > 5
                                                              else "") if aborted else ""))
    return t


def crossover_table(c) -> Table:
    """Schedules across batch sizes: a row per batch size, each schedule's tokens per second
    and milliseconds per token (latency), the best in bold; then where the sides cross."""
    # why a schedule did not run at a size: each reason once, numbered, under the table
    reasons: dict[str, tuple[int, str]] = {}       # the reason, its figures masked: number, text
    for r in c.rows:
        if "error" in r:
            text = _reason(r)
            reasons.setdefault(_masked(text), (len(reasons) + 1, text))
    why = " ".join(f"n/a {i}: {text}." for i, text in reasons.values())
    t = Table(title=f"tg compare {c.scenario} on {c.hardware} across batch sizes: tokens/s "
                    "of the batch / ms a token of one sequence", title_justify="left",
              caption=" ".join(x for x in (_crossover_caption(c.crossover), why) if x),
              caption_justify="left")
    t.add_column("N", justify="right")
    for name in c.schedules:
        t.add_column(name, justify="right")
    t.add_column("best (bound by)")
    for N in c.batch_sizes:
        rows = {r["schedule"]: r for r in c.rows if r["N"] == N}
        best = c.best(N, c.schedules)
        cells = []
        for name in c.schedules:
            r = rows[name]
            if "error" in r:
                number = reasons[_masked(_reason(r))][0]
                cells.append(Text(f"n/a {number}", style="dim"))
                continue
            text = f"{_num(r['throughput_tok_s'])} / {_num(r['token_latency_ms'])}"
            cells.append(Text(text, style="bold" if r is best else ""))
        t.add_row(str(N), *cells, f"{best['schedule']} ({best['bound_by']})" if best else "-")
    return t


def _reason(row: dict[str, Any]) -> str:
    """Why a schedule did not run: its error's first sentence, naming the schedule."""
    sentence = re.split(r"(?<=[.;:])\s", row["error"], maxsplit=1)[0].rstrip(".;:")
    return sentence if row["schedule"] in sentence else f"{row['schedule']}: {sentence}"


def _masked(text: str) -> str:
    """`text` with its figures masked (not a name's digits: S1): one reason at every size it
    holds at."""
    return re.sub(r"(?<![A-Za-z\d])\d[\d,.]*", "#", text)


def _num(x: float) -> str:
    """Three significant digits, without exponents: 0.0623, 4.62, 57.3, 15,932."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _crossover_caption(x: dict[str, Any] | None) -> str:
    if x is None:
        return ""
    if x["N"] is None:
        return x["note"] + "."
    if "note" in x:
        return x["note"] + "."
    b, e, below = x["batch"], x["expert"], x["below"]
    return (f"From N = {x['N']} streaming whole layers wins: {b['schedule']} "
            f"{b['throughput_tok_s']:.3g} tok/s, {b['bound_by']}-bound, against "
            f"{e['schedule']} {e['throughput_tok_s']:.3g} tok/s, {e['bound_by']}-bound. At N = "
            f"{x['below_N']} {below['schedule']} still led, placing experts ({below['bound_by']}-bound).")


@contextmanager
def progress_bar(show: bool, label: str, unit: str = "segments"
                 ) -> Iterator[Callable[[int, int], None] | None]:
    """Progress on stderr: yields the `progress(done, total)` callback the API's long calls
    take. For humans at a terminal a rich bar with the time left; elsewhere (a log, a pipe,
    ``--json``) a line a minute once a run has lasted one (:class:`ProgressLines`)."""
    if not (show and sys.stderr.isatty()):
        yield ProgressLines(label, unit)
        return
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn(unit), TimeElapsedColumn(),
                        TextColumn("left"), TimeRemainingColumn(),
                        console=stderr_console(), transient=True)
    task = progress.add_task(label, total=None)
    last = [0]

    def tick(done: int, total: int) -> None:
        if done < last[0]:       # the next run of several (compare's schedules): a new clock
            progress.reset(task)
        last[0] = done
        progress.update(task, completed=done, total=total)

    with progress:
        yield tick


class ProgressLines:
    """Progress as a line on stderr at most once every `every_s`, from the first that long on,
    with the time left at the pace so far: a long run in a log or behind a pipe shows it moves
    and when it may end, a short one prints nothing. A call whose `done` is below the last
    one's is the next run of several (compare's schedules), timed from the last one's end:
    the time left is at that run's pace, not at all the runs' so far."""

    def __init__(self, label: str, unit: str, every_s: float = 60.0) -> None:
        self.label, self.unit, self.every_s = label, unit, every_s
        self.start = time.monotonic()
        self.next = self.start + every_s
        self.last, self.last_at = 0, self.start

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < self.last:            # the next run began when the last one last ticked
            self.start = self.last_at
        self.last, self.last_at = done, now
        if now < self.next or not 0 < done < total:
            return
        self.next = now + self.every_s
        spent = now - self.start
        print(f"tg: {self.label}: {done:,} of {total:,} {self.unit} in {_clock(spent)}, about "
              f"{_clock(spent * (total - done) / done)} left", file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    """h:mm:ss, as rich's bar shows times."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"
