"""`tg fit`: the free parameters of machine and implementation profiles, fitted to end-to-end
measurements by simulation.

The parameters are few, physically bounded and shared where the mechanism is shared: a GPU's
dense GEMM rate belongs to the machine (every system's prefill runs on it), a system's kernel
losses belong to its implementation profile (FlexGen's kernels are the same software on the T4
and the L4). Everything else comes from datasheets or from public measurements cited where they
are used (taskgraph.presets).

Least squares on log(predicted / measured). The HRM predictor (:mod:`taskgraph.predict`), fast
enough to call thousands of times, drives the inner loop; each outer round simulates every cell
and corrects the predictor by its ratio to the simulation, so the fit converges on what the
simulator says. The reported numbers are simulations. Leave-one-out: refit without a cell, then
simulate it.

The simulations of a round, and the leave-one-out refits, are independent jobs
(:func:`taskgraph.jobs.run_jobs`): on this machine's cores by default, or on a Ray cluster. Each
job is deterministic, so the backend never changes the numbers.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from taskgraph import presets
from taskgraph.errors import TgError
from taskgraph.files import atomic_path
from taskgraph.jobs import LOCAL, Backend, run_jobs
from taskgraph.calibration.measurements import Cell


@dataclass(frozen=True)
class Param:
    """One free parameter: where it lives (a machine or implementation preset and the field
    path in it), its physical bounds, its datasheet-era value (the model before any fit) and
    the mechanism it stands for."""

    section: str                  # "hardware" or "implementation"
    target: str                   # the preset's name
    path: tuple[str, ...]
    lo: float
    hi: float
    start: float
    datasheet: float
    why: str

    @property
    def name(self) -> str:
        return f"{self.target} {'.'.join(self.path)}"


# The mechanisms a fit may tune. Bounds are physical: an efficiency lies in (0, 1]; a skinny
# product's half-bandwidth intensity is a few to a few tens of tokens per expert.
# (path, lower bound, upper bound, start, datasheet-era value, mechanism)
MACHINE_PARAMS = [
    (("gpu", "flops_eff"), 0.03, 0.9, 0.3, 0.6,
     "dense fp16 GEMM rate this GPU sustains (prefill), as a share of the datasheet peak; a T4 "
     "at its 70 W cap reaches well under half"),
]
_Spec = tuple[tuple[str, ...], float, float, float, float, str]
IMPLEMENTATION_PARAMS: dict[str, list[_Spec]] = {
    "flexgen": [
        (("kinds", "CPUAttn", "bytes_eff"), 0.003, 1.0, 0.3, 1.0,
         "its CPU attention's share of host memory bandwidth (it computes in fp32 over fp16 KV)"),
    ],
}


def free_parameters(cells: list[Cell]) -> list[Param]:
    machines = sorted({c.machine for c in cells})
    impls = sorted({c.implementation_name for c in cells})
    out = [Param("hardware", m, *spec) for m in machines for spec in MACHINE_PARAMS]
    out += [Param("implementation", i, *spec)
            for i in impls for spec in IMPLEMENTATION_PARAMS.get(i, [])]
    return out


def datasheet_profiles(params: list[Param]):
    """The model before fitting: datasheet-era machine figures and every system priced at the
    machine's own rates (the "ideal" implementation)."""
    machines, impls = profiles(params, np.array([p.datasheet for p in params]))
    ideal = presets.IMPLEMENTATIONS["ideal"]
    return machines, {name: ideal for name in impls}


def profiles(params: list[Param], values: np.ndarray
             ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Machine and implementation profiles (plain mappings) with the parameters set."""
    machines = {k: copy.deepcopy(v) for k, v in presets.HARDWARE.items()}
    impls = {k: copy.deepcopy(v) for k, v in presets.IMPLEMENTATIONS.items()}
    for p, v in zip(params, values):
        node = (machines if p.section == "hardware" else impls)[p.target]
        for key in p.path[:-1]:
            node = node.setdefault(key, {})
        node[p.path[-1]] = float(v)
    return machines, impls


def _scenario(cell: Cell, machines, impls):
    from taskgraph.scenario import scenario_from_dict

    return scenario_from_dict(cell.scenario_doc(machines[cell.machine],
                                                impls[cell.implementation_name]),
                              source=f"cell '{cell.id}'")


def predicted_tok_s(cell: Cell, machines, impls) -> float:
    from taskgraph.predict import predict
    from taskgraph.schedules import SCHEDULES

    return float(predict(_scenario(cell, machines, impls),
                         SCHEDULES[cell.schedule]).throughput_tok_s[0])


def simulated_tok_s(cell: Cell, machines, impls) -> float:
    from taskgraph.simulation import simulate_scenario

    return float(simulate_scenario(_scenario(cell, machines, impls)).summary["throughput_tok_s"])


@dataclass(frozen=True)
class _Simulate:
    cell: Cell
    machines: dict[str, Any]
    impls: dict[str, Any]

    def run(self) -> float:
        return simulated_tok_s(self.cell, self.machines, self.impls)


def simulate_cells(cells: list[Cell], machines, impls, backend: Backend = LOCAL) -> np.ndarray:
    """Every cell simulated on the given profiles, in cell order."""
    return np.array(run_jobs([_Simulate(c, machines, impls) for c in cells], backend))


@dataclass
class FitResult:
    values: np.ndarray
    converged: bool
    message: str
    corrections: np.ndarray          # simulated / predicted, per cell, at the values


def fit(cells: list[Cell], params: list[Param], rounds: int = 2,
        corrections: np.ndarray | None = None, backend: Backend = LOCAL) -> FitResult:
    """Least squares on log(simulated / measured) over `cells`. The predictor drives the inner
    loop, multiplied by `corrections` (its ratio to the simulation per cell); each of `rounds`
    outer rounds simulates every cell at the new values and updates them. With ``rounds=0`` the
    given corrections stand (leave-one-out refits reuse the full fit's)."""
    from scipy.optimize import least_squares

    measured = np.array([c.measured_tok_s for c in cells])
    lo = np.log([p.lo for p in params])
    hi = np.log([p.hi for p in params])
    corrections = np.ones(len(cells)) if corrections is None else np.asarray(corrections)

    def residuals(x: np.ndarray) -> np.ndarray:
        machines, impls = profiles(params, np.exp(x))
        pred = np.array([predicted_tok_s(c, machines, impls) for c in cells])
        return np.log(pred * corrections / measured)

    def solve(x: np.ndarray):
        best = None
        # Two deterministic starts: the last values and the middle of the bounds.
        for x0 in (x, (lo + hi) / 2):
            res = least_squares(residuals, np.clip(x0, lo + 1e-9, hi - 1e-9), bounds=(lo, hi),
                                method="trf", diff_step=1e-4, xtol=1e-8, ftol=1e-10,
                                max_nfev=400 * len(params))
            if best is None or res.cost < best.cost:
                best = res
        return best

    x = np.log([p.start for p in params])
    converged, message = True, "converged"
    for _ in range(max(rounds, 1)):
        best = solve(x)
        x = best.x
        if best.status <= 0:
            converged, message = False, best.message
        if rounds == 0:
            break
        machines, impls = profiles(params, np.exp(x))
        pred = np.array([predicted_tok_s(c, machines, impls) for c in cells])
        corrections = simulate_cells(cells, machines, impls, backend) / pred
    if not np.all(np.isfinite(x)):
        converged, message = False, "the parameters left finite values"
    return FitResult(np.exp(x), converged, message, corrections)


@dataclass
class CellReport:
    cell: Cell
    simulated: float = math.nan
    loo: float = math.nan           # simulated after a refit without this cell
    datasheet: float = math.nan     # simulated on the presets before any fitting

    @property
    def error(self) -> float:
        return self.simulated / self.cell.measured_tok_s - 1

    @property
    def loo_error(self) -> float:
        return self.loo / self.cell.measured_tok_s - 1

    @property
    def datasheet_error(self) -> float:
        return self.datasheet / self.cell.measured_tok_s - 1


@dataclass
class FitReport:
    source: str
    params: list[Param]
    values: np.ndarray
    cells: list[CellReport]
    loo_values: list[np.ndarray] = field(default_factory=list)

    def at_bound(self) -> list[str]:
        return [p.name for p, v in zip(self.params, self.values)
                if v <= p.lo * 1.001 or v >= p.hi * 0.999]

    def summary(self) -> dict[str, Any]:
        """Median and worst |error|, in-sample and left out (None without leave-one-out)."""
        err = np.abs([r.error for r in self.cells])
        loo = np.abs([r.loo_error for r in self.cells])
        done = bool(np.isfinite(loo).all())
        return {"cells": len(self.cells), "median_abs_error": float(np.median(err)),
                "max_abs_error": float(err.max()),
                "loo_median_abs_error": float(np.median(loo)) if done else None,
                "loo_max_abs_error": float(loo.max()) if done else None,
                "rankings": rankings(self.cells)}

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "parameters": [{"name": p.name, "value": float(v), "lo": p.lo, "hi": p.hi,
                            "at_bound": p.name in self.at_bound(), "mechanism": p.why}
                           for p, v in zip(self.params, self.values)],
            "cells": [{"id": r.cell.id, "system": r.cell.system, "schedule": r.cell.schedule,
                       "machine": r.cell.machine, "measured_tok_s": r.cell.measured_tok_s,
                       "simulated_tok_s": round(r.simulated, 4), "error": round(r.error, 4),
                       "loo_tok_s": _finite(r.loo), "loo_error": _finite(r.loo_error),
                       "datasheet_tok_s": round(r.datasheet, 4),
                       "datasheet_error": round(r.datasheet_error, 4)} for r in self.cells],
            "summary": self.summary(),
        }


def _finite(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def rankings(cells: list[CellReport]) -> dict[str, Any]:
    """Within each setting (machine, workload): is the simulated order of systems the measured
    one?"""
    groups: dict[str, list[CellReport]] = {}
    for r in cells:
        key = f"{r.cell.machine} {r.cell.workload.get('preset', '')}".strip()
        groups.setdefault(key, []).append(r)
    out = {}
    for key, rs in groups.items():
        measured = [r.cell.id for r in sorted(rs, key=lambda r: -r.cell.measured_tok_s)]
        simulated = [r.cell.id for r in sorted(rs, key=lambda r: -r.simulated)]
        out[key] = {"right": measured == simulated, "measured": measured}
    return out


def run_fit(source: str, cells: list[Cell], progress: Callable[[int, int], None] | None = None,
            loo: bool = True, backend: Backend = LOCAL) -> FitReport:
    """Fit on every cell, report each cell's simulation, its leave-one-out prediction and what
    the unfitted presets simulated. `progress(done, total)`: the datasheet simulations, the
    fit, then each leave-one-out refit as it finishes."""
    total = 2 + (len(cells) if loo else 0)
    tick = progress or (lambda done, total: None)
    params = free_parameters(cells)
    reports = [CellReport(c) for c in cells]
    machines, impls = datasheet_profiles(params)
    for r, tok_s in zip(reports, simulate_cells(cells, machines, impls, backend)):
        r.datasheet = float(tok_s)
    tick(1, total)
    result = fit(cells, params, backend=backend)
    if not result.converged:
        raise TgError(f"The fit did not converge ({result.message}); nothing was written.")
    machines, impls = profiles(params, result.values)
    for r, tok_s in zip(reports, simulate_cells(cells, machines, impls, backend)):
        r.simulated = float(tok_s)
    tick(2, total)
    report = FitReport(source, params, result.values, reports)
    if loo:
        jobs = [_LeaveOneOut(tuple(cells), i, tuple(params), tuple(result.values),
                             tuple(result.corrections)) for i in range(len(cells))]
        done = run_jobs(jobs, backend, lambda k, n: tick(2 + k, total))
        for r, (values, tok_s) in zip(reports, done):
            report.loo_values.append(values)
            r.loo = tok_s
    return report


@dataclass(frozen=True)
class _LeaveOneOut:
    """Refit without cell `i` (the predictor with the full fit's corrections), then simulate
    it at the values found."""

    cells: tuple[Cell, ...]
    i: int
    params: tuple[Param, ...]
    values: tuple[float, ...]           # the full fit's
    corrections: tuple[float, ...]      # the full fit's, per cell

    def run(self) -> tuple[np.ndarray, float]:
        rest = list(self.cells[:self.i] + self.cells[self.i + 1:])
        rest_params = free_parameters(rest)
        sub = fit(rest, rest_params, rounds=0,
                  corrections=np.delete(np.array(self.corrections), self.i))
        # a parameter the other cells do not touch keeps the full fit's value
        found = dict(zip((p.name for p in rest_params), sub.values))
        values = np.array([found.get(p.name, v) for p, v in zip(self.params, self.values)])
        machines, impls = profiles(list(self.params), values)
        return values, simulated_tok_s(self.cells[self.i], machines, impls)


def write_fit(report: FitReport, out: str | Path, date: str) -> list[Path]:
    """The fitted profiles (one hardware profile per machine, one implementation profile per
    system, each with its provenance), the report as JSON and CSV, and the parity plot, into
    folder `out`. Each file is written whole or not at all; nothing else in `out` is touched."""
    import csv
    import io
    import json

    import yaml

    s = report.summary()
    loo = (f", leave-one-out {s['loo_median_abs_error']:.1%} (max {s['loo_max_abs_error']:.1%})"
           if s["loo_median_abs_error"] is not None else "")
    provenance = (f"tg fit on {report.source} ({len(report.cells)} cells), {date}: median "
                  f"|error| {s['median_abs_error']:.1%}{loo}")
    machines, impls = profiles(report.params, report.values)
    texts: dict[str, str] = {}
    for name in sorted({p.target for p in report.params if p.section == "hardware"}):
        fitted = ", ".join(".".join(p.path) for p in report.params if p.target == name)
        texts[f"hardware-{name}.yaml"] = yaml.safe_dump(
            {**machines[name], "fitted": f"{fitted}: {provenance}"}, sort_keys=False)
    for name in sorted({p.target for p in report.params if p.section == "implementation"}):
        texts[f"implementation-{name}.yaml"] = yaml.safe_dump(
            {**impls[name], "fitted": provenance}, sort_keys=False)
    data = report.to_json()
    texts["report.json"] = json.dumps(data, indent=2) + "\n"
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=list(data["cells"][0]))
    writer.writeheader()
    writer.writerows(data["cells"])
    texts["cells.csv"] = table.getvalue()
    out = Path(out)
    written = []
    for name, text in texts.items():
        with atomic_path(out / name) as tmp:
            tmp.write_text(text)
        written.append(out / name)
    written.append(parity_plot(report, out / "parity.png"))
    return written


def parity_plot(report: FitReport, path: Path) -> Path:
    """Simulated (fitted and leave-one-out) and datasheet-only predictions against measured
    throughput, log-log, with y = x and a ±15% band."""
    from taskgraph.plots import _pyplot, save

    plt = _pyplot()
    meas = np.array([r.cell.measured_tok_s for r in report.cells])
    fig, ax = plt.subplots(figsize=(6.5, 6), dpi=120)
    x = np.geomspace(meas.min() * 0.5, meas.max() * 5, 20)
    ax.fill_between(x, x * 0.85, x * 1.15, color="tab:green", alpha=0.15, label="±15%")
    ax.plot(x, x, color="black", lw=1, label="y = x")
    marks = {"S1": "o", "S2": "s", "S3": "^", "S4": "D"}
    for r in report.cells:
        m = marks.get(r.cell.schedule, "o")
        ax.plot(r.cell.measured_tok_s, r.datasheet, m, color="tab:gray", alpha=0.6, ms=6)
        ax.plot(r.cell.measured_tok_s, r.loo, m, mfc="none", color="tab:blue", ms=9)
        ax.plot(r.cell.measured_tok_s, r.simulated, m, color="tab:blue", ms=6)
    for label, m in (("S1 MoE-Lightning(p)", "o"), ("S3 FlexGen(c)", "^"), ("S4 FlexGen", "D")):
        ax.plot([], [], m, color="tab:blue", label=label)
    ax.plot([], [], "o", color="tab:gray", alpha=0.6, label="datasheet presets, before")
    ax.plot([], [], "o", mfc="none", color="tab:blue", label="leave-one-out")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x[0], x[-1] / 2.5)
    ax.set_ylim(x[0], x[-1])
    ax.set_xlabel("measured throughput (tok/s)")
    ax.set_ylabel("simulated throughput (tok/s)")
    s = report.summary()
    loo = (f", leave-one-out {s['loo_median_abs_error']:.1%}"
           if s["loo_median_abs_error"] is not None else "")
    ax.set_title(f"tg fit: {len(report.cells)} cells, median |error| {s['median_abs_error']:.1%}"
                 + loo, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    return save(fig, path)
