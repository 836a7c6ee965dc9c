"""Pictures of the model: the Hierarchical Roofline of a scenario, and sweeps.

matplotlib is an optional dependency (``pip install 'moe-taskgraph[plots]'``); front else in
tg works without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.text import Text

from taskgraph.dag.builder import make_plan
from taskgraph.dag.schedules import RESOURCES, SCHEDULES
from taskgraph.errors import TgError
from taskgraph.files import atomic_path
from taskgraph.perf.cost import CostModel
from taskgraph.specs import Scenario


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise TgError("Plots need matplotlib: pip install 'moe-taskgraph[plots]' (or "
                      "pip install matplotlib).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roofline_points(scenario: Scenario) -> dict[str, Any]:
    """Roofs, turning points and the operational intensity of each task kind (FLOP/byte)."""
    cost = CostModel(scenario.hardware)
    gpu, cpu, h2d = (RESOURCES.index(r) for r in ("gpu", "cpu", "h2d"))
    p_gpu, p_cpu = cost.flops_rate[gpu], cost.flops_rate[cpu]
    b_gpu, b_cpu, b_link = cost.byte_rate[gpu], cost.byte_rate[cpu], cost.byte_rate[h2d]
    m, pol, w = scenario.model, scenario.policy, scenario.workload
    plan = make_plan(scenario.model_copy(update={"policy": pol.model_copy(update={"A_g": 0})}),
                     "S3")
    s = w.context_prompt + scenario.decode_steps / 2          # mean decode context
    attn_f, attn_b = plan.work.of("CPUAttn").at(s)
    ffn_flops_token = 6 * m.k * m.h * m.h_i
    post_f, post_b = plan.work.of("PostAttn").at(s)
    expert_weights = m.E * m.expert_bytes
    intensities = {
        f"attention (decode, s={s:.0f})": attn_f / attn_b,
        f"MoE FFN, micro-batch of {pol.mu} (GPU memory)": post_f / post_b,
        f"MoE FFN, batch of {pol.N} (weights over the link)":
            pol.N * ffn_flops_token / expert_weights,
    }
    p1 = p_cpu / b_link
    ffn = pol.N * ffn_flops_token / expert_weights
    return {
        "roofs": {"GPU compute": p_gpu, "CPU compute": p_cpu},
        "slopes": {"GPU memory": b_gpu, "CPU memory": b_cpu, "CPU->GPU link": b_link},
        "turning_points": {
            "P1: moving data to the GPU pays off": p1,
            "P2: GPU no longer link-bound": p_gpu / b_link,
        },
        "intensities": intensities,
        # Below P1 the CPU computes the experts faster than their weights cross the link (S5).
        "verdicts": {
            "attention": "CPU" if attn_f / attn_b < p1 else "GPU",
            "MoE FFN": "CPU (S5)" if ffn < p1 else "GPU",
        },
    }


@dataclass(frozen=True)
class Roofline:
    """`tg roofline`: the plot written to `path`, and its points (:func:`roofline_points`);
    `to_dict()` is the points."""

    path: str | Path                # as given
    points: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.points

    def __rich__(self) -> Text:
        pts = self.points
        lines = [f"wrote {self.path}"]
        lines += [f"  {k}: I = {v:.1f} FLOP/byte" for k, v in pts["turning_points"].items()]
        lines += [f"  {k}: I = {v:.1f}" for k, v in pts["intensities"].items()]
        lines += [f"  {k} belongs on the {v} (its intensity against P1)"
                  for k, v in pts["verdicts"].items()]
        return Text("\n".join(lines))


def roofline(scenario: Scenario, out: str | Path) -> Path:
    """The Hierarchical Roofline plot of a scenario's attention and MoE FFN (log-log)."""
    plt = pyplot()
    pts = roofline_points(scenario)
    values = list(pts["intensities"].values()) + list(pts["turning_points"].values())
    lo, hi = min(values) / 10, max(values) * 10
    x = np.logspace(np.log10(lo), np.log10(hi), 400)
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    colors = {"GPU": "tab:green", "CPU": "tab:blue", "CPU->GPU": "tab:red"}
    for name, peak in pts["roofs"].items():
        dev = name.split()[0]
        bw = pts["slopes"][f"{dev} memory"]
        ax.loglog(x, np.minimum(peak, bw * x), color=colors[dev], lw=2,
                  label=f"{dev}: {peak / 1e12:.2f} TFLOP/s, {bw / 1e9:.0f} GB/s")
    link = pts["slopes"]["CPU->GPU link"]
    ax.loglog(x, np.minimum(pts["roofs"]["GPU compute"], link * x), color=colors["CPU->GPU"],
              lw=2, ls="--", label=f"GPU fed over the CPU->GPU link: {link / 1e9:.1f} GB/s")
    for (name, i), marker in zip(pts["turning_points"].items(), ("o", "s")):
        y = link * i
        ax.plot([i], [y], marker=marker, color="black", ms=8, zorder=5)
        ax.annotate(f"{name.split(':')[0]}\nI = {i:.0f}", (i, y), textcoords="offset points",
                    xytext=(8, -28), fontsize=8)
    for (name, i), color in zip(pts["intensities"].items(), ("tab:purple", "tab:orange",
                                                             "tab:brown")):
        ax.axvline(i, color=color, ls=":", lw=1.5, label=f"{name}: I = {i:.1f}")
    ax.set_xlabel("operational intensity (FLOP / byte)")
    ax.set_ylabel("attainable performance (FLOP/s)")
    ax.set_title(f"Hierarchical Roofline: {scenario.model.name} on {scenario.hardware.name}, "
                 f"mu={scenario.policy.mu}, N={scenario.policy.N}", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    return save(fig, out)


def save(fig, out: str | Path) -> Path:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    out = Path(out)
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp)
    finally:
        pyplot().close(fig)
    return out


def gantt(runs: list, out: str | Path, step: int = 2, layers: int = 2) -> Path:
    """A Gantt chart of decode step `step`, first `layers` layers, for each run (a
    :class:`taskgraph.tracing.writer.TraceRun`): one row per stream, one shared time axis. A pipeline's
    stages work on different layers at once, so for one the chart shows the whole step."""
    from taskgraph.kinds import KINDS, KIND_NAMES

    plt = pyplot()
    windows = []
    for run in runs:
        prog = run.program
        shown = prog.plan.L if prog.plan.pp > 1 else layers
        sel = (prog.step == min(step, prog.plan.G)) & (prog.column("layer") < shown) \
            & ~np.isnan(run.end)
        if not sel.any():
            raise TgError(f"The run '{run.label}' has no finished task in decode step {step}.")
        windows.append(sel)
    span = max(float(np.nanmax(r.end[w]) - np.nanmin(r.start[w])) for r, w in zip(runs, windows))
    rows = max(len(r.program.streams) for r in runs)     # a 4-GPU plan has 19 streams
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.0 + max(1.6, 0.14 * rows) * len(runs)),
                             dpi=110,
                             squeeze=False, sharex=True)
    seen: dict[str, Any] = {}
    for ax, run, sel in zip(axes[:, 0], runs, windows):
        prog = run.program
        t0 = float(np.nanmin(run.start[sel]))
        kinds, streams = prog.column("kind"), prog.column("stream")
        for gid in np.flatnonzero(sel):
            kind = KIND_NAMES[kinds[gid]]
            row = len(prog.streams) - 1 - int(streams[gid])
            # Sub-pixel tasks (a 0.1 ms attention next to 10 ms layers) still get a visible bar.
            width = max(run.end[gid] - run.start[gid], span / 600)
            bar = ax.barh(row, width * 1e3, left=(run.start[gid] - t0) * 1e3, height=0.7,
                          color=KINDS[kind].colour, lw=0)
            seen.setdefault(kind, bar)
        ax.set_yticks(range(len(prog.streams)), list(reversed(prog.streams)), fontsize=8)
        which = "all layers" if prog.plan.pp > 1 else f"layers 0-{layers - 1}"
        ax.set_title(f"{run.label}: decode step {min(step, prog.plan.G)}, {which}",
                     fontsize=9, loc="left")
        ax.set_xlim(0, span * 1e3)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the window's first task")
    fig.legend(list(seen.values()), list(seen), loc="upper right", fontsize=7, ncol=6)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return save(fig, out)


def crossover_plot(c, out: str | Path) -> Path:
    """Throughput and per-token latency of each schedule against batch size (log-log), with
    the batch from which streaming whole layers wins marked."""
    plt = pyplot()
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for name in c.schedules:
        rows = [r for r in c.rows if r["schedule"] == name and "error" not in r]
        if not rows:
            continue
        n = [r["N"] for r in rows]
        style = "--" if SCHEDULES[name].experts_on_host else "-"
        tput.plot(n, [r["throughput_tok_s"] for r in rows], style, marker="o", ms=3, label=name)
        lat.plot(n, [r["token_latency_ms"] for r in rows], style, marker="o", ms=3, label=name)
    x = c.crossover
    for ax, label in ((tput, "tokens/s (all sequences)"), (lat, "ms per token (one sequence)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size N (sequences)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.25)
        if x and x.get("N"):
            ax.axvline(x["N"], color="grey", ls=":", lw=1.2)
    tput.legend(fontsize=8)
    fig.suptitle(f"{c.scenario} on {c.hardware}: schedules across batch sizes"
                 + (f" (streaming whole layers wins from N = {x['N']})" if x and x.get("N")
                    else ""),
                 fontsize=10)
    return save(fig, out)


def pareto_plot(result, out: str | Path) -> Path:
    """Every policy the search priced, throughput against per-token latency (log-log), its
    Pareto front drawn through them and the objective's limit marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    front = result.front
    ax.scatter([c.token_latency_ms for c in result.priced], [c.tok_s for c in result.priced],
               s=4, color="0.8", label="every policy priced", rasterized=True)
    for name in dict.fromkeys(c.schedule for c in front):
        points = [c for c in front if c.schedule == name]
        ax.scatter([c.token_latency_ms for c in points], [c.tok_s for c in points], s=14,
                   label=f"front: {name}", zorder=3)
    ax.plot([c.token_latency_ms for c in front], [c.tok_s for c in front], "-",
            color="0.3", lw=0.8, zorder=2)
    if result.objective.max_token_ms:
        ax.axvline(result.objective.max_token_ms, color="red", ls=":", lw=1.2,
                   label=f"limit {result.objective.max_token_ms:g} ms/token")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ms per token (one sequence)")
    ax.set_ylabel("tokens/s (all sequences)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)
    ax.set_title(f"{result.scenario}: throughput against per-token latency", fontsize=10)
    return save(fig, out)
