"""`tg fit`: the free parameters of machine and implementation profiles, fitted to end-to-end
measurements by simulation.

The parameters are few, physically bounded and shared where the mechanism is shared: a GPU's
dense GEMM rate belongs to the GPU (every system's prefill runs on it; the 2xT4 and 4xT4 machines
share one T4 figure), the memory bandwidth a host's GPUs and processes share belongs to the host
(the paper's 2xT4 and 4xT4 machines are one 32-core host), a system's kernel losses and habits
belong to its implementation profile (FlexGen's kernels are the same software on the T4 and the
L4; how many threads MoE-Lightning's processes run with is its own). Everything else comes from
datasheets or from public measurements cited where they are used (taskgraph.presets).

Least squares on log(predicted / measured). The HRM predictor (:mod:`taskgraph.perf.predict`), fast
enough to call thousands of times, drives the inner loop; each outer round simulates every cell
and corrects the predictor by its ratio to the simulation, so the fit converges on what the
simulator says. The reported numbers are simulations. Leave-one-out: refit without a cell, then
simulate it.

The simulations of a round, and the leave-one-out refits, are independent jobs
(:func:`taskgraph.study.jobs.run_jobs`): on this machine's cores by default, or on a Ray cluster. Each
job is deterministic, so the backend never changes the numbers.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np

from taskgraph import presets
from taskgraph.errors import LongRunWarning, TgError
from taskgraph.files import Output, atomic_path, check_outputs, csv_row
from taskgraph.output.report import (Shown, cell_label, differences_table, fit_table,
                                      phases_table)
from taskgraph.study.jobs import LOCAL, Backend, run_jobs
from taskgraph.study.measurements import Cell


@dataclass(frozen=True)
class Mechanism:
    """A mechanism a fit may tune: the field path in its preset, its physical bounds (an
    efficiency lies in (0, 1]; a host's memory bandwidth below what its channels carry), where
    the fit starts, its datasheet-era value (the model before any fit; None: the field left
    out) and what it stands for."""

    path: tuple[str, ...]
    lo: float
    hi: float
    start: float
    datasheet: float | None
    why: str
    # Which cells inform it: "any", "several" (where several GPUs run at once: the mechanism
    # does nothing on one) or "one" (a one-GPU run's, kept apart from a shared host's).
    gpus: str = "any"
    # Only cells of these schedules inform it (empty: any): a machine part that one kind of
    # run measures alone.
    schedules: tuple[str, ...] = ()
    # Only cells whose routed experts are stored below 16 bits inform it (a kernel's
    # unpacking of them).
    quantized: bool = False

    def informed_by(self, cell: Cell) -> bool:
        return ({"any": True, "one": cell.gpus == 1, "several": cell.gpus > 1}[self.gpus]
                and (not self.schedules or cell.schedule in self.schedules)
                and (not self.quantized or cell.experts_quantized))


@dataclass(frozen=True, kw_only=True)
class Param(Mechanism):
    """One free parameter: a mechanism in the machine or implementation presets it is set in
    (several, when they share the part)."""

    section: str                  # "hardware" or "implementation"
    targets: tuple[str, ...]      # the presets' names

    @property
    def name(self) -> str:
        return f"{'+'.join(self.targets)} {'.'.join(self.path)}"


# Shared by the machines with the same GPU (gpu) or the same host (host).
MACHINE_PARAMS = {
    "gpu": [Mechanism(("gpu", "flops_eff"), 0.03, 0.9, 0.3, 0.6,
                  "dense fp16 GEMM rate this GPU sustains (prefill), as a share of the datasheet "
                  "peak; a T4 at its 70 W cap reaches well under half")],
    "host": [Mechanism(("shared", "memory_gbps"), 15.0, 140.0, 60.0, None,
                   "host memory bandwidth the GPUs' DMA, the processes' copies into pinned "
                   "memory and CPU attention share (GB/s, read plus written)",
                   gpus="several")],
    # A machine's own link, measured by the runs that stream every weight across it each step
    # and do nothing else of note: DeepSpeed's ZeRO-3 on one GPU (every layer's parameters
    # gathered from pinned host memory, batch 1-16: the step's time barely moves with batch).
    # The expert caches' copies on the same machine are then priced against it.
    "link": [Mechanism(("link", "h2d_eff"), 0.1, 0.95, 0.6, 0.8,
                       "CPU->GPU copies from pinned memory, as a share of the link's datasheet "
                       "rate, on this machine", gpus="one", schedules=("DS",))],
}
IMPLEMENTATION_PARAMS: dict[str, list[Mechanism]] = {
    "flexgen": [
        Mechanism(("kinds", "CPUAttn", "bytes_eff"), 0.003, 1.0, 0.3, 1.0,
              "its CPU attention's share of host memory bandwidth (it computes in fp32 over "
              "fp16 KV)"),
    ],
    "moe-lightning": [
        Mechanism(("rank_threads",), 0.5, 16.0, 4.0, None,
              "threads each of its processes (one per GPU) runs its host work with: its share "
              "of the host's copy and CPU-attention rates", gpus="several"),
    ],
    "deepspeed": [
        Mechanism(("several_gpus_kinds", "D3", "bytes_eff"), 0.02, 1.0, 0.3, 1.0,
              "its layer-by-layer parameter gather's share of each GPU's link where several "
              "GPUs gather through one host (ZeRO-3: fetched module by module, through host "
              "memory)", gpus="several"),
    ],
    # Mixtral-offloading has none: its misses swap an expert each way at the machine's link
    # rates (ImplementationSpec.expert_swaps), which its cells fitted at 1.0 of (2026-12-06).
}


# Every implementation's, where its cells inform them: the rate each kind that computes
# routed experts unpacks them at when they are stored below 16 bits (a kernel that
# dequantizes into temporaries before its product; none: unpacked as they stream).
EVERY_IMPLEMENTATION = [
    Mechanism(("kinds", kind, "dequant_gweights"), 1.0, 1e5, 100.0, None,
              f"the rate its {where} experts unpack quantized weights at (G weights/s), a "
              "time added to their reading", quantized=True)
    for kind, where in (("CPUFFN", "CPU's"), ("GPUFFN", "GPU's"),
                        ("PostAttn", "streamed decode layer's"), ("Prefill", "prefill layer's"))]


def free_parameters(cells: list[Cell]) -> list[Param]:
    """The parameters `cells` can inform: each machine part (a GPU type, a host) once for the
    machines that share it, each system's once; a mechanism of several GPUs only where some
    cell runs on several; and only a mechanism that moves some cell's prediction (a GPU's GEMM
    rate where every run streams weights is left as it is, not fitted to noise)."""
    return [p for p in _candidates(cells) if _moves(p, cells)]


def _moves(param: Param, cells: list[Cell]) -> bool:
    """Whether the parameter at one end of its bounds rather than the other changes some
    cell's predicted throughput by more than 1% (the ends: a rate may bind in part of its
    range only)."""
    mine = [c for c in cells if param.informed_by(c) and
            (c.machine if param.section == "hardware" else c.implementation_name)
            in param.targets]
    low, high = (profiles([param], [v]) for v in (param.lo, param.hi))
    return any(abs(predicted_tok_s(c, *high) / predicted_tok_s(c, *low) - 1) > 0.01
               for c in mine)


def _candidates(cells: list[Cell]) -> list[Param]:
    def part(machine: str, scope: str) -> str:
        hw = presets.HARDWARE[machine]
        return {"gpu": hw["gpu"]["name"], "host": hw["cpu"]["name"], "link": machine}[scope]

    out = []
    for scope, specs in MACHINE_PARAMS.items():
        for spec in specs:
            groups: dict[str, list[str]] = {}
            for c in cells:
                if spec.informed_by(c):
                    groups.setdefault(part(c.machine, scope), []).append(c.machine)
            out += [Param(section="hardware", targets=tuple(sorted(set(ms))), **asdict(spec))
                    for _, ms in sorted(groups.items())]
    for impl in sorted({c.implementation_name for c in cells}):
        mine = [c for c in cells if c.implementation_name == impl]
        out += [Param(section="implementation", targets=(impl,), **asdict(spec))
                for spec in [*IMPLEMENTATION_PARAMS.get(impl, []), *EVERY_IMPLEMENTATION]
                if any(spec.informed_by(c) for c in mine)]
    return out


def datasheet_profiles(params: list[Param]):
    """The model before fitting: datasheet-era machine figures (nothing of a host shared) and
    every system priced at the machine's own rates (the "ideal" implementation)."""
    machines, impls = profiles(params, [p.datasheet for p in params])
    ideal = presets.IMPLEMENTATIONS["ideal"]
    return machines, {name: ideal for name in impls}


def profiles(params: list[Param], values
             ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Machine and implementation profiles (plain mappings) with the parameters set (a value of
    None leaves the field out)."""
    machines = {k: copy.deepcopy(v) for k, v in presets.HARDWARE.items()}
    impls = {k: copy.deepcopy(v) for k, v in presets.IMPLEMENTATIONS.items()}
    for p, v in zip(params, values):
        for target in p.targets:
            node = (machines if p.section == "hardware" else impls)[target]
            for key in p.path[:-1]:
                node = node.setdefault(key, {})
            node[p.path[-1]] = None if v is None else float(v)
    return machines, impls


def _scenario(cell: Cell, machines, impls):
    return cell.scenario(machines[cell.machine], impls[cell.implementation_name])


def predicted_tok_s(cell: Cell, machines, impls) -> float:
    return predicted_alike([cell], machines, impls)[0]


def predicted_alike(cells: list[Cell], machines, impls) -> list[float]:
    """The predicted throughput of cells that differ only in their length (:func:`_alike`),
    from one prediction of the longest."""
    from taskgraph.dag.schedules import SCHEDULES
    from taskgraph.perf.predict import predict_lengths

    # the lengths as the cells give them (building a scenario for each costs what predicting
    # it does); a length left to the workload's default, from its scenario
    lengths = [c.scenario_doc(c.machine, c.implementation_name)["workload"].get("gen_len")
               for c in cells]
    if None in lengths:
        lengths = [_scenario(c, machines, impls).decode_steps for c in cells]
    longest = _scenario(cells[int(np.argmax(lengths))], machines, impls)
    return [float(p.throughput_tok_s[0]) for p in predict_lengths(
        longest, SCHEDULES[cells[0].schedule], lengths)]


def _alike(cells: list[Cell]) -> list[list[int]]:
    """The cells' indices, grouped where they differ only in how many tokens they generate."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(cells):
        doc = c.scenario_doc(c.machine, c.implementation_name)
        doc["name"] = None
        doc["workload"] = {k: v for k, v in doc["workload"].items() if k != "gen_len"}
        groups.setdefault(json.dumps(doc, sort_keys=True), []).append(i)
    return list(groups.values())


def simulate_cell(cell: Cell, machines, impls) -> dict[str, Any]:
    """The cell simulated on the given profiles: its throughput, what binds each phase and
    what share of each the host's shared pools were in use. A policy over the machine's memory
    under tg's model is simulated all the same: it ran."""
    from taskgraph.sim.simulate import simulate_scenario

    with warnings.catch_warnings():      # the fit announces its whole length (_announce)
        warnings.simplefilter("ignore", LongRunWarning)
        s = simulate_scenario(_scenario(cell, machines, impls), over_memory=True).summary
    return {k: s[k] for k in ("throughput_tok_s", "prefill_s", "decode_s", "bound_by",
                              "shared")}


def simulated_tok_s(cell: Cell, machines, impls) -> float:
    return float(simulate_cell(cell, machines, impls)["throughput_tok_s"])


@dataclass(frozen=True)
class _Simulate:
    cell: Cell
    machines: dict[str, Any]
    impls: dict[str, Any]

    def run(self) -> dict[str, Any]:
        return simulate_cell(self.cell, self.machines, self.impls)


def simulate_cells(cells: list[Cell], machines, impls, backend: Backend = LOCAL,
                   progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Every cell simulated on the given profiles, in cell order (:func:`simulate_cell`);
    `progress(done, total)` as each finishes."""
    return run_jobs([_Simulate(c, machines, impls) for c in cells], backend, progress)


def _throughputs(sims: list[dict[str, Any]]) -> np.ndarray:
    return np.array([s["throughput_tok_s"] for s in sims])


@dataclass
class FitResult:
    values: np.ndarray
    converged: bool
    message: str
    corrections: np.ndarray          # simulated / predicted, per cell, at the values
    # The last round's simulations, at the values (none with rounds=0)
    simulations: list[dict[str, Any]] = field(default_factory=list)


#: Least-squares starts in each round of a fit (:func:`fit`).
STARTS = 4


def fit(cells: list[Cell], params: list[Param], rounds: int = 2,
        corrections: np.ndarray | None = None, backend: Backend = LOCAL,
        advance: Callable[[int], None] | None = None) -> FitResult:
    """Least squares on log(simulated / measured) over `cells`. The predictor drives the inner
    loop, multiplied by `corrections` (its ratio to the simulation per cell); each of `rounds`
    outer rounds simulates every cell at the new values and updates them. With ``rounds=0`` the
    given corrections stand (leave-one-out refits reuse the full fit's). `advance(n)` as n more
    steps are done: each least-squares start and each cell simulated (:data:`STARTS` +
    len(cells) a round)."""
    from scipy.optimize import least_squares

    advance = advance or (lambda n: None)

    lo = np.log([p.lo for p in params])
    hi = np.log([p.hi for p in params])
    corrections = np.ones(len(cells)) if corrections is None else np.asarray(corrections)
    residuals = _Residuals(cells, params)

    def solve(x: np.ndarray):
        best = None
        # Deterministic starts: the last values, and every parameter at the same place in its
        # (log) bounds: low, middle, high. A rate that binds only in part of its range (a
        # process's copy limited by its threads, or not) is flat elsewhere, so one start
        # cannot find the other regime.
        starts = (x, *(lo + f * (hi - lo) for f in (0.5, 0.15, 0.85)))     # STARTS of them
        for x0 in starts:
            res = least_squares(residuals, np.clip(x0, lo + 1e-9, hi - 1e-9), bounds=(lo, hi),
                                method="trf", diff_step=1e-4, xtol=1e-8, ftol=1e-10,
                                max_nfev=400 * len(params), args=(corrections,))
            if best is None or res.cost < best.cost:
                best = res
            advance(1)
        return best

    x = np.log([p.start for p in params])
    converged, message = True, "converged"
    sims: list[dict[str, Any]] = []
    for _ in range(max(rounds, 1)):
        best = solve(x)
        x = best.x
        if best.status <= 0:
            converged, message = False, best.message
        if rounds == 0:
            break
        machines, impls = profiles(params, np.exp(x))
        pred = np.array([predicted_tok_s(c, machines, impls) for c in cells])
        sims = simulate_cells(cells, machines, impls, backend, _counted(advance))
        corrections = _throughputs(sims) / pred
    if not np.all(np.isfinite(x)):
        converged, message = False, "the parameters left finite values"
    return FitResult(np.exp(x), converged, message, corrections, sims)


class _Residuals:
    """log(predicted x correction / measured) per cell at log-parameters x. Predictions are
    most of a refit's time: a cell's reads its machine's and its system's profiles alone, so
    where a step of the finite differences moves a parameter of other parts, it is the one made
    before; cells that differ only in their length are predicted at once (predict_lengths)."""

    def __init__(self, cells: list[Cell], params: list[Param]):
        self.cells, self.params = cells, params
        self.measured = np.array([c.measured_tok_s for c in cells])
        self.groups = _alike(cells)
        part = {"hardware": lambda c: c.machine, "implementation": lambda c: c.implementation_name}
        self.reads = [[j for j, p in enumerate(params) if part[p.section](cells[g[0]]) in p.targets]
                      for g in self.groups]
        self.made: dict[tuple[int, tuple[float, ...]], list[float]] = {}

    def __call__(self, x: np.ndarray, corrections: np.ndarray) -> np.ndarray:
        keys = [(k, tuple(x[js])) for k, js in enumerate(self.reads)]
        if any(k not in self.made for k in keys):
            machines, impls = profiles(self.params, np.exp(x))
            for g, k in zip(self.groups, keys):
                if k not in self.made:
                    self.made[k] = predicted_alike([self.cells[i] for i in g], machines, impls)
        pred = np.empty(len(self.cells))
        for g, k in zip(self.groups, keys):
            pred[g] = self.made[k]
        return np.log(pred * corrections / self.measured)


@dataclass
class CellReport:
    cell: Cell
    simulated: float = math.nan
    loo: float = math.nan           # simulated after a refit without this cell's group
    datasheet: float = math.nan     # simulated on the presets before any fitting
    # At the fitted values: what binds prefill and decode, and what share of each phase the
    # host's shared pools were in use.
    bound_by: dict[str, str] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    # Memory over the machine's under tg's memory model, if it is (the run happened).
    memory: str | None = None

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
class FitReport(Shown):
    """Fitted values, each cell's error in and out of the fit. `to_json()` is the report file,
    `to_dict()` `tg fit --json` (the report and the files written)."""

    source: str
    params: list[Param]
    values: np.ndarray
    cells: list[CellReport]
    # What each leave-one-out refit leaves out: a cell, a measurements file or a machine.
    leave_out: str = "cell"
    # Each leave-one-out refit's values (None: a field left out, as before any fit), by group.
    loo_values: dict[str, list[float | None]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)     # what `write_fit` wrote

    def to_dict(self) -> dict[str, Any]:
        return {**self.to_json(), "files": [str(f) for f in self.files]}

    @cached_property
    def phases(self) -> list[dict[str, Any]]:
        """Prefill and decode as measured (:func:`phases`), worked out once: the table, the JSON
        and steps.png show the same figures."""
        return phases(self.cells)

    @cached_property
    def system_differences(self) -> list[dict[str, Any]]:
        """What one system costs over another on one policy, measured
        (:func:`system_differences`)."""
        return system_differences(self.cells)

    def views(self):
        from rich.text import Text

        yield from fit_table(self)
        if self.phases:
            yield phases_table(self.phases)
        if self.system_differences:
            yield differences_table(self.system_differences)
        for r in self.cells:
            if r.memory:
                yield Text(f"memory: cell '{r.cell.id}' ran, but under tg's memory model "
                           f"{r.memory}", style="yellow")
        if self.at_bound():
            yield Text.assemble(("at a bound:", "yellow"), " " + ", ".join(self.at_bound()))
        if self.files:
            yield Text(f"wrote {', '.join(str(f) for f in self.files)}")

    def at_bound(self) -> list[str]:
        return [p.name for p, v in zip(self.params, self.values)
                if v <= p.lo * 1.001 or v >= p.hi * 0.999]

    def summary(self) -> dict[str, Any]:
        """Median and worst |error|, in-sample and left out (None without leave-one-out), over
        every cell and, in a fit of several files, over each file's."""
        out = {**_errors(self.cells), "leave_out": self.leave_out,
               "rankings": rankings(self.cells)}
        files = sorted({r.cell.file for r in self.cells})
        if len(files) > 1:
            out["by_file"] = {f: _errors([r for r in self.cells if r.cell.file == f])
                              for f in files}
        return out

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
                       "datasheet_error": round(r.datasheet_error, 4),
                       "bound_by": r.bound_by, "shared": r.shared, "memory": r.memory}
                      for r in self.cells],
            "summary": self.summary(),
            "phases": self.phases,
            "system_differences": self.system_differences,
        }


def _errors(cells: list[CellReport]) -> dict[str, Any]:
    err = np.abs([r.error for r in cells])
    loo = np.abs([r.loo_error for r in cells])
    done = bool(np.isfinite(loo).all())
    return {"cells": len(cells), "median_abs_error": float(np.median(err)),
            "max_abs_error": float(err.max()),
            "loo_median_abs_error": float(np.median(loo)) if done else None,
            "loo_max_abs_error": float(loo.max()) if done else None}


#: What a leave-one-out refit may leave out, and each cell's group under it.
LEAVE_OUT: dict[str, Callable[[Cell], str]] = {
    "cell": lambda c: c.id, "file": lambda c: c.file, "machine": lambda c: c.machine}


def _finite(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def rankings(cells: list[CellReport]) -> dict[str, Any]:
    """Within each setting (machine, workload): is the simulated order of systems the measured
    one?"""
    groups: dict[str, list[CellReport]] = {}
    for r in cells:
        w = r.cell.workload
        key = " ".join([r.cell.machine, str(w.get("preset", "")),
                        *(f"{k} {v}" for k, v in sorted(w.items()) if k != "preset")])
        groups.setdefault(key, []).append(r)
    out = {}
    for key, rs in groups.items():
        measured = [r.cell.id for r in sorted(rs, key=lambda r: -r.cell.measured_tok_s)]
        simulated = [r.cell.id for r in sorted(rs, key=lambda r: -r.simulated)]
        out[key] = {"right": measured == simulated, "measured": measured}
    return out


def _run_s(scenario, tok_s: float) -> float:
    """Seconds a run of the scenario's policy and workload took at `tok_s`."""
    return scenario.policy.N * scenario.workload.gen_len / tok_s


def phases(cells: list[CellReport]) -> list[dict[str, Any]]:
    """Prefill and decode as the measurements show them: where cells differ only in how many
    tokens they generate (one model, machine, system, policy and prompts), their run times'
    differences are the time of the decode steps between, and the first run less its steps at
    that rate its prefill. The same differences of the simulated runs beside them. A group whose
    measured times do not grow with the length says so (`note`) and gives no prefill."""
    groups: dict[str, list[tuple[CellReport, Any]]] = {}
    for r in cells:
        c, sc = r.cell, r.cell.scenario()
        key = repr((c.model, c.precision, c.machine, c.system, c.schedule,
                    c.implementation_name, sc.policy.model_dump(),
                    sc.workload.model_copy(update={"gen_len": 0}).model_dump()))
        groups.setdefault(key, []).append((r, sc))
    out = []
    for members in groups.values():
        members.sort(key=lambda m: m[1].workload.gen_len)
        gens = [sc.workload.gen_len for _, sc in members]
        if len(gens) < 2 or len(set(gens)) != len(gens):
            continue      # one length, or two runs of one length: no differences to take
        steps = []
        for (a, sa), (b, sb) in zip(members, members[1:]):
            ga, gb = sa.workload.gen_len, sb.workload.gen_len
            steps.append({
                "from_gen": ga, "to_gen": gb,
                "context": sa.workload.context_prompt + (ga + gb) / 2,
                "measured_s": (_run_s(sb, b.cell.measured_tok_s)
                               - _run_s(sa, a.cell.measured_tok_s)) / (gb - ga),
                "simulated_s": (_run_s(sb, b.simulated) - _run_s(sa, a.simulated))
                               / (gb - ga)})
        (first, s0), g0 = members[0], gens[0]
        grows = all(s["measured_s"] > 0 for s in steps)
        out.append({
            "label": cell_label(first.cell, gen=False), "cells": [r.cell.id for r, _ in members],
            "prefill_s": {
                "measured": (_run_s(s0, first.cell.measured_tok_s)
                             - g0 * steps[0]["measured_s"]) if grows else None,
                "simulated": _run_s(s0, first.simulated) - g0 * steps[0]["simulated_s"]},
            "steps": steps,
            "note": None if grows else "the measured runs take no longer for more tokens: "
                                       "not the phases of one run, no prefill estimated"})
    return out


def system_differences(cells: list[CellReport]) -> list[dict[str, Any]]:
    """What one system costs over another as the measurements show it: where cells differ only
    in their system (one model, machine, policy and workload), the difference of their run
    times a generated token, each cell against the fastest measured where that is another
    system. Where the two prefill alike (Table 4's FlexGen and FlexGen(c): one prefill, one
    weight copy) that is the one decode mechanism that differs, a step; no simulated figure
    enters the measured one. The simulated runs' difference beside it."""
    groups: dict[str, list[tuple[CellReport, Any]]] = {}
    for r in cells:
        c, sc = r.cell, r.cell.scenario()
        # the policy as the cell gives it: what its schedule implies (A_g, F_g) differs
        key = repr((c.model, c.precision, c.machine, c.policy.model_dump(),
                    sc.workload.model_dump()))
        groups.setdefault(key, []).append((r, sc))
    out = []
    for members in groups.values():
        if len({r.cell.system for r, _ in members}) < 2:
            continue
        members.sort(key=lambda m: -m[0].cell.measured_tok_s)
        (fastest, sc), gen = members[0], members[0][1].workload.gen_len
        for r, _ in members[1:]:        # one policy and workload: the same tokens

            if r.cell.system == fastest.cell.system:    # runs of one system: not what differs
                continue
            out.append({
                # the length the run generated, which a cell may take from its preset
                "label": cell_label(fastest.cell, gen=False).removesuffix(
                    f" {fastest.cell.system}") + f", {gen} generated",
                "systems": [r.cell.system or r.cell.id, fastest.cell.system or fastest.cell.id],
                "cells": [r.cell.id, fastest.cell.id],
                "measured_s": (_run_s(sc, r.cell.measured_tok_s)
                               - _run_s(sc, fastest.cell.measured_tok_s)) / gen,
                "simulated_s": (_run_s(sc, r.simulated) - _run_s(sc, fastest.simulated)) / gen})
    return out


def run_fit(source: str, cells: list[Cell], progress: Callable[[int, int], None] | None = None,
            loo: bool = True, backend: Backend = LOCAL, leave_out: str = "cell") -> FitReport:
    """Fit on every cell, report each cell's simulation, its leave-one-out prediction and what
    the unfitted presets simulated. Leave-one-out refits without each `leave_out` in turn (a
    cell, a measurements file, a machine) and predicts its cells. `progress(done, total)`: each
    cell's datasheet simulation, each least-squares start and cell simulation of the fit's
    rounds, then each leave-one-out refit as it finishes."""
    if leave_out not in LEAVE_OUT:
        raise TgError(f"leave_out = {leave_out!r}: it is one of {', '.join(LEAVE_OUT)}.")
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(cells):
        groups.setdefault(LEAVE_OUT[leave_out](c), []).append(i)
    if loo and len(groups) < 2:
        raise TgError(f"Leave-one-out refits without each {leave_out} in turn: it needs at "
                      f"least two (or give --no-loo).")
    rounds = 2
    total = len(cells) + rounds * (STARTS + len(cells)) + (len(groups) if loo else 0)
    tick = progress or (lambda done, total: None)
    done = 0

    def advance(steps: int) -> None:
        nonlocal done
        done += steps
        tick(done, total)
    _announce(cells, *profiles([], []), loo)          # choosing the parameters predicts cells
    params = free_parameters(cells)
    reports = [CellReport(c, memory=c.memory_note()) for c in cells]
    machines, impls = datasheet_profiles(params)
    _compile_here(cells, machines, impls)
    datasheet = simulate_cells(cells, machines, impls, backend, _counted(advance))
    for r, sim in zip(reports, datasheet):
        r.datasheet = float(sim["throughput_tok_s"])
    result = fit(cells, params, rounds, backend=backend, advance=advance)
    if not result.converged:
        raise TgError(f"The fit did not converge ({result.message}); nothing was written.")
    # the last round simulated every cell at the values found
    for r, sim in zip(reports, result.simulations):
        r.simulated = float(sim["throughput_tok_s"])
        r.bound_by, r.shared = sim["bound_by"], sim["shared"]
    report = FitReport(source, params, result.values, reports, leave_out=leave_out)
    if loo:
        jobs = [_LeaveOut(tuple(cells), tuple(left), tuple(params), tuple(result.corrections))
                for left in groups.values()]
        refits = run_jobs(jobs, backend, _counted(advance))
        for group, left, (values, tok_s) in zip(groups, groups.values(), refits):
            report.loo_values[group] = values
            for i, x in zip(left, tok_s):
                reports[i].loo = x
    return report


def _counted(advance: Callable[[int], None]) -> Callable[[int, int], None]:
    """A jobs' progress (done of total; a pool reports jobs that finish together at once) as
    the steps it advances by."""
    seen = 0

    def tick(done: int, total: int) -> None:
        nonlocal seen
        advance(done - seen)
        seen = done
    return tick


def _compile_here(cells: list[Cell], machines, impls) -> None:
    """Compile every cell's task graph in this process, once, before the fit's rounds start
    their workers: forked, each inherits the templates (taskgraph.dag.compiled keeps them;
    the fit changes rates, never shapes) instead of compiling them again in every round: a
    4xT4 cell's take 14 s, a third of its simulation. Ray's workers compile their own."""
    from taskgraph.dag.builder import make_plan
    from taskgraph.dag.compiled import compile_plan

    for c in cells:
        compile_plan(make_plan(_scenario(c, machines, impls)))


#: Simulations of each cell in a fit: on the presets, and after each of the fit's two rounds
#: (the last at the values found); a leave-one-out refit simulates the cells it left out once
#: more.
SIMULATIONS_PER_CELL = 3
#: Tasks of a micro-batch in a layer in a step, at the fewest: every schedule has more
#: (S3 5, DS 6, EC 8 on the calibration files).
FEWEST_TASKS = 4


def _announce(cells: list[Cell], machines, impls, loo: bool) -> None:
    """Warn (LongRunWarning) before a fit that will take minutes, with the least it will: a
    cell of 10 million decode steps makes a fit of hours, and each of its simulations alone
    said only its own share."""
    from taskgraph.dag.builder import make_plan
    from taskgraph.sim.simulate import ANNOUNCE_S, TASKS_PER_S, in_words

    # Counted from the plan: compiling every cell to count its tasks exactly took 78 s for
    # the three calibration files, longer than some fits.
    plans = [make_plan(_scenario(c, machines, impls)) for c in cells]
    tasks = [FEWEST_TASKS * (p.G + 1) * p.L * p.n for p in plans]
    times = SIMULATIONS_PER_CELL + loo
    least = sum(tasks) * times / TASKS_PER_S
    if least < ANNOUNCE_S:
        return
    big = cells[int(np.argmax(tasks))]
    warnings.warn(LongRunWarning(
        f"the fit simulates each of its {len(cells)} cells {times} times, over "
        f"{sum(tasks) * times:,} tasks in all: at least {in_words(least)} at the simulator's "
        f"best pace ({TASKS_PER_S:,} tasks a second). The largest cell is {big.id} "
        f"(over {max(tasks):,} tasks; its workload.gen_len sets its steps). Ctrl-C stops it."),
        stacklevel=3)


def _same_part(refit: Param, full: Param) -> bool:
    """Whether a refit's parameter is the full fit's, on fewer of its targets."""
    return (refit.section, refit.path) == (full.section, full.path) and \
        set(refit.targets) <= set(full.targets)


@dataclass(frozen=True)
class _LeaveOut:
    """Refit without the cells `left` (the predictor with the full fit's corrections), then
    simulate them at the values found."""

    cells: tuple[Cell, ...]
    left: tuple[int, ...]
    params: tuple[Param, ...]
    corrections: tuple[float, ...]      # the full fit's, per cell

    def run(self) -> tuple[list[float | None], list[float]]:
        rest = [c for i, c in enumerate(self.cells) if i not in self.left]
        rest_params = free_parameters(rest)
        found: dict[str, float] = {}
        if rest_params:
            sub = fit(rest, rest_params, rounds=0,
                      corrections=np.delete(np.array(self.corrections), list(self.left)))
            found = dict(zip((p.name for p in rest_params), sub.values))
        # A part shared with the cells left out (a GPU type two machines have) takes what the
        # remaining cells measured of it; a parameter no other cell informs is the model's
        # before any fit (its datasheet value; None leaves the field out): the full fit's value
        # would be the left-out cells'.
        values = [next((v for q, v in zip(rest_params, found.values()) if _same_part(q, p)),
                       p.datasheet) for p in self.params]
        machines, impls = profiles(list(self.params), values)
        return values, [simulated_tok_s(self.cells[i], machines, impls) for i in self.left]


#: The plots write_fit draws, after its texts.
PLOTS = ("parity.png", "steps.png")


def _fitted(params: list[Param], section: str) -> list[str]:
    """The presets of `section` whose parameters a fit of `params` sets: a profile each."""
    return sorted({t for p in params if p.section == section for t in p.targets})


def fit_files(params: list[Param]) -> list[str]:
    """The files :func:`write_fit` writes into its folder for a fit of `params`: known before
    the fit, so that a folder that would replace an input is refused before it runs."""
    return [*(f"hardware-{n}.yaml" for n in _fitted(params, "hardware")),
            *(f"implementation-{n}.yaml" for n in _fitted(params, "implementation")),
            "report.json", "cells.csv", *PLOTS]


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
    for name in _fitted(report.params, "hardware"):
        fitted = ", ".join(".".join(p.path) for p in report.params if name in p.targets)
        texts[f"hardware-{name}.yaml"] = yaml.safe_dump(
            {**machines[name], "fitted": f"{fitted}: {provenance}"}, sort_keys=False)
    for name in _fitted(report.params, "implementation"):
        texts[f"implementation-{name}.yaml"] = yaml.safe_dump(
            {**impls[name], "fitted": provenance}, sort_keys=False)
    data = report.to_json()
    texts["report.json"] = json.dumps(data, indent=2) + "\n"
    table = io.StringIO()
    rows = [{**{k: v for k, v in c.items() if not isinstance(v, dict)},
             "bound_prefill": c["bound_by"].get("prefill"),
             "bound_decode": c["bound_by"].get("decode"),
             **{f"{pool}_decode_share": x["decode"] for pool, x in c["shared"].items()}}
            for c in data["cells"]]
    writer = csv.DictWriter(table, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    writer.writeheader()
    writer.writerows(dict(zip(row, csv_row(row.values()))) for row in rows)
    texts["cells.csv"] = table.getvalue()
    out = Path(out)
    assert [*texts, *PLOTS] == fit_files(report.params)
    # every file checked before the first is written: a folder in the way of the last must not
    # leave the first ones, a set that does not belong together
    check_outputs({f"--out ({name})": Output(str(out / name))
                   for name in fit_files(report.params)}, [])
    written = []
    for name, text in texts.items():
        with atomic_path(out / name) as tmp:
            tmp.write_text(text)
        written.append(out / name)
    written.append(parity_plot(report, out / "parity.png"))
    written.append(steps_plot(report.phases, out / "steps.png"))
    report.files = written
    return written


def parity_plot(report: FitReport, path: Path) -> Path:
    """Simulated (fitted and leave-one-out) and datasheet-only predictions against measured
    throughput, log-log, with y = x and a ±15% band."""
    from taskgraph.output.plots import pyplot, save

    plt = pyplot()
    meas = np.array([r.cell.measured_tok_s for r in report.cells])
    fig, ax = plt.subplots(figsize=(6.5, 6), dpi=120)
    x = np.geomspace(meas.min() * 0.5, meas.max() * 5, 20)
    ax.fill_between(x, x * 0.85, x * 1.15, color="tab:green", alpha=0.15, label="±15%")
    ax.plot(x, x, color="black", lw=1, label="y = x")
    marks = {"S1": "o", "S2": "s", "S3": "^", "S4": "D", "DS": "v", "PP": "P"}
    for r in report.cells:
        m = marks.get(r.cell.schedule, "o")
        ax.plot(r.cell.measured_tok_s, r.datasheet, m, color="tab:gray", alpha=0.6, ms=6)
        ax.plot(r.cell.measured_tok_s, r.loo, m, mfc="none", color="tab:blue", ms=9)
        ax.plot(r.cell.measured_tok_s, r.simulated, m, color="tab:blue", ms=6)
    systems = {r.cell.schedule: r.cell.system for r in report.cells}
    for schedule, system in sorted(systems.items()):
        ax.plot([], [], marks.get(schedule, "o"), color="tab:blue",
                label=f"{schedule} {system}".strip())
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


def steps_plot(steps: list[dict[str, Any]], path: Path) -> Path:
    """The time per decode step against the context it runs at, measured (from runs that differ
    only in generation length) and simulated, one colour per group of runs; a measured step
    that is not positive is left out (the group's note says why), and a file without such runs
    gets a picture that says so."""
    from taskgraph.output.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    if not steps:
        ax.text(0.5, 0.5, "no runs that differ only in generation length", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return save(fig, path)
    for i, group in enumerate(steps):
        colour = f"C{i % 10}"
        shown = [s for s in group["steps"] if s["measured_s"] > 0]
        ax.plot([s["context"] for s in shown], [s["measured_s"] for s in shown], "o-",
                color=colour, label=f"{group['label']}: measured")
        x = [s["context"] for s in group["steps"]]
        ax.plot(x, [s["simulated_s"] for s in group["steps"]], "s--", color=colour, mfc="none",
                label="simulated")
    ax.set_xlabel("context (prompt as cached + tokens generated so far)")
    ax.set_ylabel("seconds a decode step (all sequences)")
    ax.set_yscale("log")
    ax.set_title("time per decode step: measured (differences of runs) and simulated",
                 fontsize=10)
    ax.legend(fontsize=6, loc="best")
    ax.grid(alpha=0.3, which="both")
    return save(fig, path)
