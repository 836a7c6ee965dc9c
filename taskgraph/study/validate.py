"""`tg validate`: simulate and execute the same graphs and say, task kind by task kind, where the
model is wrong.

Each (schedule, policy) pair is executed `repeats` times (the run with the median decode-layer
latency is kept: single runs on a shared machine move by ~10%) and simulated with the scenario's
hardware profile, normally one `tg calibrate` wrote for this machine. The executions go in rounds,
every pair once per round, so that a machine whose speed drifts during validation shifts every
pair alike rather than whichever ran last. The spread of a pair's repeats says which differences
between schedules the measurement resolves at all. Executions measure this machine, so they run
here; the simulations are jobs for any backend (:mod:`taskgraph.study.jobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from taskgraph.dag.compiled import KIND_NAMES
from taskgraph.dag.routing import Routing
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.errors import TgError
from taskgraph.output.report import Shown, validate_table, warnings_of
from taskgraph.specs import RoutingSpec, Scenario
from taskgraph.study.jobs import LOCAL, Backend, run_jobs
from taskgraph.tracing.writer import Traced, TraceRun


@dataclass
class PairResult:
    schedule: str
    policy: dict[str, Any]
    simulated: dict[str, Any]
    measured: dict[str, Any]
    per_kind: dict[str, dict[str, float]]            # kind -> simulated/measured median (s)
    traces: tuple[TraceRun, TraceRun] = field(repr=False, default=None)
    measured_range: tuple[float, float] = (0.0, 0.0)  # fastest, slowest repeat (ms per layer)

    @property
    def layer_error(self) -> float:
        return self.simulated["decode_layer_ms"] / self.measured["decode_layer_ms"] - 1

    def to_json(self) -> dict[str, Any]:
        # the expert schedules' experts block too (what the cache and the predictor did)
        keys = ("throughput_tok_s", "decode_layer_ms", "prefill_s", "decode_s", "utilization",
                "experts")
        return {
            "schedule": self.schedule, "policy": self.policy,
            "simulated": {k: self.simulated[k] for k in keys if k in self.simulated},
            "measured": {k: self.measured[k] for k in keys if k in self.measured}
            | {"max_abs_err": self.measured["max_abs_err"],
               "decode_layer_ms_range": list(self.measured_range)},
            "error": {
                "decode_layer": round(self.layer_error, 4),
                "throughput": round(self.simulated["throughput_tok_s"]
                                    / self.measured["throughput_tok_s"] - 1, 4),
                "per_task_median": {k: round(v["error"], 4) for k, v in self.per_kind.items()},
            },
            # each task kind's median duration, simulated and measured (ms)
            "per_kind_median_ms": {k: {"simulated": round(v["simulated_s"] * 1e3, 6),
                                       "measured": round(v["measured_s"] * 1e3, 6)}
                                   for k, v in self.per_kind.items()},
        }


@dataclass
class Validation(Shown, Traced):
    """Every pair executed and simulated, and how far apart they are; `to_dict()` is
    `tg validate --json`. Its trace holds both runs of each pair as aligned processes."""

    scenario: Scenario
    results: list[PairResult]

    def to_dict(self) -> dict[str, Any]:
        first = self.results[0].to_json()
        return {"scenario": self.scenario.name, "hardware": self.scenario.hardware.name,
                "simulated": first["simulated"], "measured": first["measured"],
                "error": first["error"], "accuracy": summary(self.results),
                "pairs": [r.to_json() for r in self.results]}

    def views(self):
        hardware = self.scenario.hardware
        if hardware.calibrated is None:
            yield from warnings_of({"warnings": [
                f"hardware '{hardware.name}' holds datasheet figures, not this machine's: the "
                "errors below compare two different machines. Run `tg calibrate --out P.yaml` "
                "and pass `--set hardware=P.yaml`."]})
        yield validate_table(self.results, summary(self.results), self.scenario)

    def trace_runs(self) -> list[TraceRun]:
        return [run for r in self.results for run in r.traces]

    def parity_plot(self, out: str | Path) -> Path:
        return parity_plot(self.results, out)


# Rounds of execution `tg validate` runs; a few settle the timings, each costs real runs.
MAX_REPEATS = 100


def validate_scenario(scenario: Scenario, schedules: list[str], mus: list[int] | None = None,
                      repeats: int = 3, device: str = "cpu", backend: Backend = LOCAL,
                      progress: Callable[[int, int], None] | None = None) -> Validation:
    """`tg validate`: each schedule at each micro-batch size in `mus` (default: the scenario's
    and half of it), executed `repeats` times on `device` and simulated."""
    if not schedules:
        raise TgError(f"--schedules names no schedule; known schedules: {', '.join(SCHEDULES)}.")
    unknown = [n for n in schedules if n not in SCHEDULES]
    if unknown:
        raise TgError(f"--schedules names unknown schedule '{unknown[0][:60]}'.")
    if not 1 <= repeats <= MAX_REPEATS:
        raise TgError(f"--repeats must be from 1 to {MAX_REPEATS}, not {repeats:,}: each repeat "
                      "executes every schedule at every --mu.")
    bad = [mu for mu in mus or () if not 1 <= mu <= scenario.policy.N]
    if bad:
        raise TgError(f"--mu {bad[0]:,} is not a micro-batch size of policy.N = "
                      f"{scenario.policy.N}: each must be from 1 to N.")
    mus = mus or sorted({scenario.policy.mu, max(1, scenario.policy.mu // 2)})
    pairs = pairs_for(scenario, schedules, mus)
    if not pairs:
        raise TgError(f"No --mu value divides policy.N = {scenario.policy.N}.")
    return Validation(scenario, validate(pairs, repeats, device, progress, backend))


def pairs_for(scenario: Scenario, schedules: list[str], mus: list[int]) -> list[Scenario]:
    """The (schedule, policy) pairs: each schedule at each micro-batch size (N fixed)."""
    from taskgraph.presets import IMPLEMENTATIONS
    from taskgraph.scenario import for_schedule
    from taskgraph.specs import ImplementationSpec

    # What runs is tg's executor whatever system a schedule stands for by default (S3 and S4:
    # FlexGen), so it is priced as tg's: its MLA decompresses the cache every step, as
    # transformers' does.
    own = ImplementationSpec.model_validate(IMPLEMENTATIONS["tg"])
    model = scenario.model.model_copy(update={"mla_absorbed": False})
    out = []
    for mu in mus:
        if scenario.policy.N % mu:
            continue
        policy = scenario.policy.model_copy(update={"mu": mu})
        for name in schedules:
            sc, _ = for_schedule(scenario.model_copy(
                update={"policy": policy, "implementation": own, "model": model}), name)
            out.append(sc)
    return out


def validate(pairs: list[Scenario], repeats: int = 3, device: str = "cpu",
             progress: Callable[[int, int], None] | None = None,
             backend: Backend = LOCAL) -> list[PairResult]:
    """Execute every pair `repeats` times in interleaved rounds, then simulate each once, given
    what the executor measured that the model takes as an input (:func:`as_measured`)."""
    if backend.kind == "pool":
        # The pairs are small: a pool would cost more than it saves, and forking once PyTorch
        # has started its threads is unsafe.
        backend = Backend(workers=1)
    from taskgraph.exec.execute import execute_scenario, warm_up

    warm_up(pairs[0], pairs[0].schedule, device)
    runs: list[list] = [[] for _ in pairs]
    for r in range(repeats):
        for i, sc in enumerate(pairs):
            runs[i].append(execute_scenario(sc, sc.schedule, device=device,
                                            record_routing=SCHEDULES[sc.schedule].experts_on_host))
            if progress:
                progress(r * len(pairs) + i + 1, repeats * len(pairs))
    runs = [sorted(executions, key=lambda ex: ex.summary["decode_layer_ms"]) for executions in runs]
    simulated = [as_measured(sc, executions[len(executions) // 2])
                 for sc, executions in zip(pairs, runs)]
    sims = run_jobs([_Simulate(sc) for sc in simulated], backend)
    return [_compare(sc, executions, sim) for sc, executions, sim in zip(simulated, runs, sims)]


def as_measured(scenario: Scenario, execution) -> Scenario:
    """The pair as it is simulated: given what the executor measured of the inputs the model
    takes as given rather than predicts, so that an error is the model's, not the inputs'.

    * The schedules whose cost depends on which experts a batch routes to (those keeping
      experts on the host: S5, EP, EC, ECP) are simulated on the run's own router decisions,
      as a routing trace, not on the scenario's ``workload.routing``. A random checkpoint's
      tokens repeat, and so do its experts: Mixtral-8x7B's layers with seeded weights, at batch
      1, hit 47% of them in EC's cache of two where uniform routing gives 26%.
      The experts the run kept on the GPU (EP's placement, a cache's fixed set) stay those it
      kept: its scenario's routing chose them, and the trace's most popular are others (on an
      H100 those took half of the trace's choices, and EP's CPU experts were priced 8.0 ms a
      layer where they took 10.8).
    * ECP's ``policy.prefetch``, the share of the cache's misses its predictor had copied
      ahead, is what the executor's predictor achieved (``covered``): the simulator has no
      predictor of its own. With the old default of 0 (every guess wasted) ECP was simulated
      83% slow there; an unset one is now a published figure for another model's experts."""
    update: dict[str, Any] = {}
    if execution.routing is not None:
        routing = RoutingSpec(kind="trace", trace="(the validated run's own)",
                              seed=scenario.workload.routing.seed)
        update["workload"] = scenario.workload.model_copy(update={"routing": routing})
    prefetch = execution.summary.get("experts", {}).get("prefetch", {})
    if prefetch.get("covered") is not None:
        update["policy"] = scenario.policy.model_copy(update={"prefetch": prefetch["covered"]})
    if not update:
        return scenario
    simulated = scenario.model_copy(update=update)
    if execution.routing is not None:
        simulated._routing_trace = execution.routing
        sched, p = SCHEDULES[scenario.schedule], scenario.policy
        if sched.ffn == "split":
            simulated._experts_kept = Routing.of(scenario).held(p, scenario.model)
        elif p.experts_gpu and p.eviction == "popular":
            simulated._experts_kept = Routing.of(scenario).popular(p.experts_gpu)
    return simulated


@dataclass(frozen=True)
class _Simulate:
    scenario: Scenario

    def run(self):
        from taskgraph.sim.simulate import simulate_scenario

        # every task's times: each kind's durations are matched to the executed run's
        return simulate_scenario(self.scenario, self.scenario.schedule, keep_steps=None)


def _compare(sc: Scenario, executions: list, sim) -> PairResult:
    """The median of the pair's `executions` (sorted by decode-layer latency) against `sim`."""
    ex = executions[len(executions) // 2]
    kinds = ex.program.column("kind")
    per_kind = {}
    for k in np.unique(kinds):
        sel = kinds == k
        meas = float(np.median(ex.run.durations[sel & ex.run.finished]))
        pred = float(np.median(sim.run.durations[sel]))
        per_kind[KIND_NAMES[k]] = {"simulated_s": pred, "measured_s": meas,
                                   "error": pred / meas - 1 if meas else 0.0}
    spread = (executions[0].summary["decode_layer_ms"], executions[-1].summary["decode_layer_ms"])
    return PairResult(sc.schedule, sc.policy.model_dump(), sim.summary, ex.summary, per_kind,
                      (sim.trace_run(f"{sc.schedule} mu={sc.policy.mu} simulated"),
                       ex.trace_run(f"{sc.schedule} mu={sc.policy.mu} measured")), spread)


def ranking(group: list[PairResult]) -> dict[str, Any]:
    """How simulation and measurement order the schedules of one micro-batch size. ``same``: the
    two orders are identical. Two schedules whose repeats overlap (the slower one's fastest run
    beat the faster one's slowest) are not ordered by the measurement at all; ``agree`` says
    whether simulation orders every pair the measurement does order the same way, and
    ``unresolved`` lists the others."""
    sim = [r.schedule for r in sorted(group, key=lambda r: r.simulated["decode_layer_ms"])]
    meas = [r.schedule for r in sorted(group, key=lambda r: r.measured["decode_layer_ms"])]
    agree, unresolved = True, []
    for i, a in enumerate(group):
        for b in group[i + 1:]:
            (a_lo, a_hi), (b_lo, b_hi) = a.measured_range, b.measured_range
            if a_hi < b_lo or b_hi < a_lo:
                meas_a_first = a_hi < b_lo
                sim_a_first = a.simulated["decode_layer_ms"] < b.simulated["decode_layer_ms"]
                agree &= meas_a_first == sim_a_first
            else:
                unresolved.append(f"{a.schedule}~{b.schedule}")
    return {"simulated": sim, "measured": meas, "same": sim == meas, "agree": agree,
            "unresolved": unresolved}


def summary(results: list[PairResult]) -> dict[str, Any]:
    """Accuracy across pairs: median |error| of decode-layer latency, and how simulation and
    measurement rank the schedules at each micro-batch size (:func:`ranking`)."""
    errors = [abs(r.layer_error) for r in results]
    rankings = {f"mu={mu}": ranking([r for r in results if r.policy["mu"] == mu])
                for mu in sorted({r.policy["mu"] for r in results})}
    kinds: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.per_kind.items():
            kinds.setdefault(k, []).append(v["error"])
    return {
        "pairs": len(results),
        "median_abs_error_decode_layer": round(float(np.median(errors)), 4),
        "max_abs_error_decode_layer": round(float(np.max(errors)), 4),
        "ranking": rankings,
        "per_task_median_error": {k: round(float(np.median(v)), 4) for k, v in kinds.items()},
        "speed_shift": _speed_shift([float(np.median(v)) for v in kinds.values()]),
    }


def _speed_shift(kind_errors: list[float]) -> float | None:
    """The median per-kind error when at least 80% of the task kinds err the same way by over 5%:
    the signature of a machine that ran at another speed than when it was calibrated (the same
    factor on everything), not of a model error (which hits some kinds and not others)."""
    errors = np.array(kind_errors)
    for sign in (1, -1):
        if (sign * errors > 0.05).mean() >= 0.8:
            return round(float(np.median(errors)), 4)
    return None


def parity_plot(results: list[PairResult], out: str | Path) -> Path:
    """Predicted vs measured decode-layer latency, one point per pair (the bar: the fastest and
    slowest of its repeats), y = x and a ±10% band."""
    from taskgraph.output.plots import pyplot, save

    plt = pyplot()
    meas = np.array([r.measured["decode_layer_ms"] for r in results])
    pred = np.array([r.simulated["decode_layer_ms"] for r in results])
    top = max(r.measured_range[1] for r in results)
    lo, hi = min(meas.min(), pred.min()) * 0.8, max(meas.max(), pred.max(), top) * 1.1
    fig, ax = plt.subplots(figsize=(6.5, 6), dpi=120)
    x = np.linspace(lo, hi, 10)
    ax.fill_between(x, x * 0.9, x * 1.1, color="tab:green", alpha=0.15, label="±10%")
    ax.plot(x, x, color="black", lw=1, label="y = x")
    markers = {"S1": "o", "S2": "s", "S3": "^", "S4": "D"}
    for r, m_, p_ in zip(results, meas, pred):
        fast, slow = r.measured_range
        ax.errorbar(m_, p_, xerr=[[max(0.0, m_ - fast)], [max(0.0, slow - m_)]],
                    marker=markers.get(r.schedule, "o"), markersize=7, capsize=3, linestyle="none",
                    label=f"{r.schedule} mu={r.policy['mu']} ({r.layer_error:+.0%})")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured decode-layer latency (ms)")
    ax.set_ylabel("simulated decode-layer latency (ms)")
    errs = np.abs(pred / meas - 1)
    ax.set_title(f"tg validate: median |error| {np.median(errs):.1%} over {len(results)} pairs "
                 "(bars: range of the repeats)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    return save(fig, out)
