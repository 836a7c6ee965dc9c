"""Sweeps: the policy search re-run across hardware or workload values.

A sweep is a list of independent :class:`SweepJob` values, each one point's varied settings and
the scenario they make, loaded (and so checked) before anything runs. Each job's ``run()``
returns one plain row, and :func:`taskgraph.study.jobs.run_jobs` runs the list on this machine's cores
or on a Ray cluster; a job carries its scenario, so no node needs the scenario's files.
"""

from __future__ import annotations

import csv
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from taskgraph.errors import TgError
from taskgraph.files import atomic_path, csv_row
from taskgraph.output.plots import pyplot, save
from taskgraph.output.report import Shown, sweep_table
from taskgraph.perf.limits import hardware_limit_tok_s
from taskgraph.scenario import load_scenario
from taskgraph.specs import Scenario
from taskgraph.study.jobs import LOCAL, Backend, run_jobs
from taskgraph.study.search import search

# Points of one sweep (the product of every --vary's values): each loads a scenario and runs a
# search, seconds each; more is hours, and a plot no one can read.
MAX_POINTS = 1_000

COLUMNS = ("throughput_tok_s", "schedule", "N", "mu", "A_g", "F_g", "r_w", "r_c", "binding",
           "hardware_limit_tok_s", "error")


@dataclass(frozen=True)
class SweepJob:
    point: tuple[tuple[str, str], ...]        # (key, value) of each varied setting
    scenario: Scenario

    def run(self) -> dict[str, Any]:
        row: dict[str, Any] = {k: v for k, v in self.point}
        try:
            result = search(self.scenario, top=1, workers=1)
        except TgError as err:
            return {**row, **{c: "" for c in COLUMNS}, "throughput_tok_s": 0.0,
                    "error": str(err)}
        best = result.best
        return {**row, "throughput_tok_s": round(best.predicted_tok_s, 3),
                "schedule": best.schedule, **best.policy, "binding": result.binding,
                "hardware_limit_tok_s": round(hardware_limit_tok_s(self.scenario), 3),
                "error": ""}


@dataclass
class Sweep(Shown):
    """The search's pick at every point of a sweep, and the files written (CSV, plot).
    `to_dict()` is `tg sweep --json`."""

    rows: list[dict[str, Any]]
    vary: list[tuple[str, list[str]]]
    files: list[Path]

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "files": [str(p) for p in self.files]}

    def views(self):
        yield sweep_table(self.rows, self.vary, self.files)


def sweep(scenario: str, overrides: list[str], vary: list[tuple[str, list[str]]],
          out: str | Path, backend: Backend = LOCAL,
          progress: Callable[[int, int], None] | None = None) -> Sweep:
    """Search the best policy at every combination of the `vary` values (at most two settings:
    the x axis and one line each) and write sweep.csv and sweep.png into `out`."""
    if len(vary) > 2:
        raise TgError("tg sweep plots at most two --vary settings (x axis and one line each).")
    load_scenario(scenario, overrides)          # fail fast on a bad scenario
    rows = run_sweep(sweep_jobs(scenario, overrides, vary), backend, progress)
    failed = [r for r in rows if r["error"]]
    if len(failed) == len(rows):
        raise TgError(f"Every point of the sweep failed; the first: {failed[0]['error']}")
    return Sweep(rows, vary, write_sweep(rows, vary, out))


def parse_vary(items: list[str]) -> list[tuple[str, list[str]]]:
    """``KEY=V1,V2,...`` options -> [(key, [values])]."""
    out = []
    for item in items:
        key, sep, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise TgError(f"--vary '{item}' must look like KEY=V1,V2,..., e.g. "
                          "--vary hardware.link.h2d_gbps=100,200,300.")
        if key.strip().startswith("policy"):
            # each point's search replaces the policy: the rows came out identical
            raise TgError(f"--vary {key.strip()}: tg sweep searches the best policy at every "
                          "point, so its fields are not settings to vary; vary hardware, model "
                          "or workload fields, or compare policies with `tg simulate --set` or "
                          "`tg compare --batch-sizes`.")
        if any(key.strip() == k for k, _ in out):
            raise TgError(f"--vary names '{key.strip()}' twice; give its values once, "
                          "comma-separated.")
        out.append((key.strip(), vals))
    return out


def sweep_jobs(scenario: str, overrides: list[str], vary: list[tuple[str, list[str]]]
               ) -> list[SweepJob]:
    """One job per point of the grid. Every point must be a valid scenario before any runs: a
    typo in a value is an error, not a row of the CSV."""
    points = math.prod(len(vals) for _, vals in vary)
    if points > MAX_POINTS:
        raise TgError(f"--vary gives {points:,} sweep points; tg sweeps at most {MAX_POINTS:,} "
                      "(each is a policy search of a few seconds). Give fewer values.")
    keys = [k for k, _ in vary]
    jobs = []
    for combo in itertools.product(*(vals for _, vals in vary)):
        point = tuple(zip(keys, combo))
        try:
            loaded = load_scenario(scenario, list(overrides) + [f"{k}={v}" for k, v in point])
        except TgError as err:
            where = ", ".join(f"{k}={v}" for k, v in point)
            raise TgError(f"The sweep point {where} is not a valid scenario: {err}") from None
        jobs.append(SweepJob(point, loaded))
    return jobs


def run_sweep(jobs: list[SweepJob], backend: Backend = LOCAL,
              progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    return run_jobs(jobs, backend, progress)


def write_sweep(rows: list[dict[str, Any]], vary: list[tuple[str, list[str]]],
                out_dir: str | Path) -> list[Path]:
    """``sweep.csv`` and ``sweep.png`` (best throughput and chosen policy against the first
    varied value, one line per value of the second) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = [k for k, _ in vary]
    path = out / "sweep.csv"
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + list(COLUMNS))
        writer.writeheader()
        for row in rows:
            columns = keys + list(COLUMNS)
            writer.writerow(dict(zip(columns, csv_row(row.get(k, "") for k in columns))))
    return [path, _plot(rows, vary, out / "sweep.png")]


def _plot(rows, vary, path: Path) -> Path:
    plt = pyplot()
    x_key, x_vals = vary[0]
    series = vary[1][1] if len(vary) > 1 else [None]
    panels = (("throughput_tok_s", "best throughput (tok/s, predicted)"), ("r_w", "r_w: weights on GPU"),
              ("r_c", "r_c: KV cache on GPU"), ("A_g", "A_g: attention on GPU"),
              ("mu", "mu (micro-batch)"), ("N", "N (batch)"))
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), dpi=110)
    x = [float(v) if _is_number(v) else i for i, v in enumerate(x_vals)]
    for (col, title), ax in zip(panels, axes.flat):
        for s in series:
            ys = []
            for v in x_vals:
                row = next(r for r in rows if r[x_key] == v and (s is None or r[vary[1][0]] == s))
                ys.append(float(row[col]) if row.get(col, "") != "" else float("nan"))
            label = f"{vary[1][0]}={s}" if s is not None else None
            ax.plot(x, ys, marker="o", label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(x_key, fontsize=8)
        if not all(_is_number(v) for v in x_vals):
            ax.set_xticks(x, x_vals)
        ax.grid(alpha=0.3)
    if len(vary) > 1:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"policy search across {x_key}", fontsize=11)
    return save(fig, path)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
