"""Policy search: the best policy for a machine, by HRM prediction or simulation, for the
scenario's objective (the most tokens per second, or the lowest per-token latency, within
limits on per-token latency and time to first token).

The grid of the schedules that stream whole layers is enumerated per (schedule, mu, r_w, r_c),
vectorised over the number of micro-batches (N = n * mu), filtered by the one memory model and
priced by the HRM prediction of end-to-end throughput and latency
(:mod:`taskgraph.perf.predict`). Attention placement picks the schedule: CPU attention runs the
scenario's own CPU-attention schedule (CGOPipe by default), GPU attention runs S4, and GPU
attention with the routed experts on the CPU (F_g = 0) runs S5. The expert-level schedules (EP,
EC, ECP) have no HRM bound: each is simulated at the batch sizes they are made for, at the
policies that fill the GPU (:func:`expert_jobs`). Every priced policy also enters the Pareto
front of throughput against per-token latency (:func:`pareto_front`).

Work is cut into independent, picklable jobs (:class:`GridJob`, :class:`ExpertJob`,
:class:`SimJob`) for :func:`taskgraph.study.jobs.run_jobs`: the HRM grid and the expert-level
simulations on this machine's cores, the simulations of ``--verify`` and ``--brute-force``
there or on a Ray cluster.
"""

from __future__ import annotations

import math
import os
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np

from taskgraph import placement
from taskgraph.dag.builder import build_segment, make_plan
from taskgraph.dag.schedules import EXPERT_FIELDS, SCHEDULES, Schedule
from taskgraph.errors import MemoryFitError, ScheduleError, TgError
from taskgraph.output.plots import pareto_plot
from taskgraph.output.report import Shown, brute_force_table, pareto_table, search_table
from taskgraph.perf.cost import CostModel, cost_model
from taskgraph.perf.limits import hardware_limit_tok_s
from taskgraph.perf.memory import GB, memory_items
from taskgraph.perf.predict import ROWS, predict_micro_batches
from taskgraph.serving.queue import simulate_queue
from taskgraph.sim.simulate import simulate_scenario
from taskgraph.specs import ObjectiveSpec, PolicySpec, Scenario
from taskgraph.study.crossover import first_fitting, fits_with, policy_for
from taskgraph.study.jobs import LOCAL, Backend, run_jobs

MU = (1, 2, 4, 8, 12, 16, 24, 32, 36, 48, 64, 96, 128, 192, 256, 384, 512)
R_W = tuple(round(float(x), 2) for x in np.linspace(0.0, 1.0, 21))
R_C = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_MICRO_BATCHES = 64
#: Batch sizes at which the expert-level schedules are simulated: those they are made for (the
#: Fiddler artifact measures 1-16) and on to 64, past which their throughput stops growing on
#: the presets (EP on t4: 21.7 tok/s at 64 and at 256) while their latency still does.
EXPERT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: Points of the Pareto front a table shows (spread evenly over log latency; --json has all).
FRONT_SHOWN = 12
# Policies `tg search` lists: each costs a build (~0.1 s) and, with --verify, a simulation.
MAX_TOP = 100
_RESOURCE_NAMES = {"gpu": "GPU", "cpu": "CPU", "h2d": "link (CPU->GPU)",
                   "d2h": "link (GPU->CPU)", "pin": "CPU (pinned staging copy)",
                   "peer": "GPU interconnect", "host_memory": "host memory bandwidth",
                   "pcie_h2d": "shared PCIe lanes (CPU->GPU)",
                   "pcie_d2h": "shared PCIe lanes (GPU->CPU)"}


@dataclass(frozen=True)
class Grid:
    """The policies a search considers."""

    mu: tuple[int, ...] = MU
    r_w: tuple[float, ...] = R_W
    r_c: tuple[float, ...] = R_C
    max_micro_batches: int = MAX_MICRO_BATCHES
    attention: tuple[str, ...] = ("cpu", "gpu")
    ffn: tuple[str, ...] = ("gpu", "cpu")        # where the routed experts run (F_g = 1, 0)
    batch: int | None = None                     # N held fixed (None: any)

    def micro_batch_sizes(self) -> tuple[int, ...]:
        """`mu`, or where the batch is fixed every size that divides it."""
        if self.batch is None:
            return self.mu
        return tuple(m for m in range(1, self.batch + 1) if self.batch % m == 0
                     and self.batch // m <= self.max_micro_batches)


@dataclass
class Candidate:
    """One feasible policy with its predicted (and, after verification, simulated) figures."""

    schedule: str
    policy: dict[str, Any]
    predicted_tok_s: float
    predicted_layer_ms: float
    resource: str                       # what bounds its decode layers
    token_latency_ms: float             # a sequence's time per token in decode
    ttft_s: float                       # the batch's time to its first tokens
    priced_by: str = "HRM"              # or "simulation" (the expert-level schedules)
    simulated_tok_s: float | None = None
    simulated_layer_ms: float | None = None

    def run_with(self) -> str:
        """The options that run this policy: `tg simulate` or `tg execute` SCENARIO with them
        (less what the schedule decides itself)."""
        decided = SCHEDULES[self.schedule].placement
        return f"--schedule {self.schedule} " + " ".join(
            "--set " + shlex.quote(f"policy.{k}={_option(v)}")
            for k, v in self.policy.items() if k not in decided)

    @property
    def tok_s(self) -> float:
        """Simulated throughput where simulated, else predicted."""
        return self.simulated_tok_s if self.simulated_tok_s is not None else self.predicted_tok_s

    def scenario(self, base: Scenario) -> Scenario:
        picked = base.model_copy(update={"policy": PolicySpec(**self.policy),
                                         "schedule": self.schedule})
        # a copy keeps the base's private fields: `policy: auto` would be searched again
        # by every verb it passed through (the CLI's, then the API's)
        picked._policy_auto = False
        return picked


@dataclass
class SearchResult(Shown):
    """The search's ranking; with `search_scenario` also the machine's limit and, after a
    brute-force run, the simulated grid. `to_dict()` is `tg search --json`."""

    best: Candidate
    top: list[Candidate]
    evaluated: int                      # feasible policies scored
    considered: int                     # policies enumerated
    binding: str                        # what stops the winner from going faster
    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    limits_met: bool = True             # False: no policy meets them; `top` is the closest
    front: list[Candidate] = field(default_factory=list)    # Pareto, lowest latency first
    priced: list[Candidate] = field(default_factory=list, repr=False)   # all, for the plot
    simulated: int = 0                  # expert-level policies simulated to price them
    wall_s: float = 0.0
    verified: bool = False
    notes: list[str] = field(default_factory=list)
    scenario: str = ""
    path: str = "SCENARIO"              # the scenario's file, for the command that runs the pick
    hardware_limit_tok_s: float | None = None   # MoE-Lens's bound for the machine
    grid: list[Candidate] = field(default_factory=list)     # brute force, best first

    def to_json(self) -> dict[str, Any]:
        return {"best": asdict(self.best), "top": [asdict(c) for c in self.top],
                "binding": self.binding, "evaluated": self.evaluated,
                "considered": self.considered, "simulated": self.simulated,
                "objective": self.objective.model_dump(), "limits_met": self.limits_met,
                "run_with": self.best.run_with(),
                "pareto": [asdict(c) for c in self.front],
                "verified": self.verified, "notes": self.notes, "wall_s": round(self.wall_s, 3)}

    def to_dict(self) -> dict[str, Any]:
        out = self.to_json()
        if self.grid:
            out["brute_force"] = brute_force_summary(self, self.grid)
        limit = self.hardware_limit_tok_s
        if limit is not None:
            out["hardware_limit_tok_s"] = round(limit, 3)
            tok_s = self.best.simulated_tok_s or self.best.predicted_tok_s
            out["best"]["throughput_tok_s"] = tok_s
            out["best"]["hardware_limit_fraction"] = round(tok_s / limit, 4)
        return out

    def picked(self) -> str:
        """What `policy: auto` became, in one line."""
        p = self.best.policy
        experts = "".join(f" {k}={p[k]}" for k in EXPERT_FIELDS if k in p)
        return (f"policy: auto -> {self.best.schedule} N={p['N']} mu={p['mu']} A_g={p['A_g']} "
                f"r_w={p['r_w']:g} r_c={p['r_c']:g}{experts} (best of {self.evaluated:,}, "
                f"{self.wall_s:.1f} s)")

    def shown_front(self) -> list[Candidate]:
        """At most FRONT_SHOWN points of the front, spread evenly over log latency, both ends
        kept."""
        front = self.front
        if len(front) <= FRONT_SHOWN:
            return front
        logs = np.log([c.token_latency_ms for c in front])
        targets = np.linspace(logs[0], logs[-1], FRONT_SHOWN)
        return [front[i] for i in sorted({int(np.abs(logs - x).argmin()) for x in targets})]

    def plot(self, out) -> Any:
        return pareto_plot(self, out)

    def views(self):
        yield search_table(self, self.scenario, self.hardware_limit_tok_s)
        if self.front:
            yield pareto_table(self)
        if self.grid:
            yield brute_force_table(self.grid[:len(self.top)],
                                    brute_force_summary(self, self.grid))


@dataclass(frozen=True)
class GridJob:
    """Score every micro-batch count for some (schedule, mu, r_w, r_c) combinations."""

    scenario: Scenario
    combos: tuple[tuple[str, int, float, float], ...]
    max_micro_batches: int
    batch: int | None = None

    def run(self) -> tuple[list[Candidate], int]:
        costs: dict[str, CostModel] = {}
        found: list[Candidate] = []
        considered = 0
        for name, mu, r_w, r_c in self.combos:
            schedule = SCHEDULES[name]
            cost = costs.get(name) or costs.setdefault(name, cost_model(self.scenario, name))
            # one group of micro-batches per GPU in pipeline or data parallel
            groups = self.scenario.hardware.gpu.count if schedule.grouped else 1
            n = np.arange(_min_micro(self.scenario, schedule),
                          (schedule.max_micro_batches * groups or self.max_micro_batches) + 1)
            n = n[(n % groups == 0) & ((n * mu == self.batch) if self.batch else True)]
            considered += len(n)
            fits = _fits(self.scenario, schedule, n, mu, r_w, r_c)
            if not fits.any():
                continue
            n = n[fits]
            pred = predict_micro_batches(self.scenario, schedule, mu, r_w, r_c, n, cost)
            steps = self.scenario.decode_steps
            # as Python numbers once (tolist gives what float() and int() of each would)
            for n_i, tok_s, layer_ms, binding, decode_s, prefill_s in zip(
                    n.tolist(), pred.throughput_tok_s.tolist(), pred.decode_layer_ms.tolist(),
                    pred.binding.tolist(), pred.decode_s.tolist(), pred.prefill_s.tolist()):
                found.append(Candidate(
                    schedule=name,
                    policy=_policy(n_i * mu, mu, schedule, r_w, r_c),
                    predicted_tok_s=tok_s,
                    predicted_layer_ms=layer_ms,
                    resource=_RESOURCE_NAMES[ROWS[binding]],
                    token_latency_ms=decode_s / steps * 1e3,
                    ttft_s=prefill_s))
        return found, considered


def search(scenario: Scenario, top: int = 10, grid: Grid = Grid(), workers: int | None = None,
           schedules: tuple[str, ...] | None = None) -> SearchResult:
    """The best policies for `scenario`'s model, machine, workload and objective: the schedules
    that stream whole layers by HRM prediction, the expert-level ones simulated (`schedules`:
    only these)."""
    t0 = time.perf_counter()
    objective = scenario.objective
    grid = replace(grid, batch=objective.batch)
    # one pool for both: the simulations start first, the HRM grid's chunks fill in beside them
    jobs = expert_jobs(scenario, objective.batch, schedules)
    if schedules is None or any(not SCHEDULES[n].expert_level for n in schedules):
        jobs += grid_jobs(scenario, grid, workers or os.cpu_count() or 1)
    found, considered = [], 0
    for cands, n in run_jobs(jobs, Backend(workers=workers)):
        found += [c for c in cands if schedules is None or c.schedule in schedules]
        considered += n
    simulated = sum(c.priced_by == "simulation" for c in found)
    if not found:
        raise TgError(_nothing_fits(scenario, grid))
    meeting = [c for c in found if objective.met_by(c.token_latency_ms, c.ttft_s)]
    ranked = _runnable(scenario, _best_first(objective, meeting or found), top)
    best = ranked[0]
    result = SearchResult(best=best, top=ranked, evaluated=len(found), considered=considered,
                          binding=_binding(scenario, best, grid.max_micro_batches),
                          objective=objective, limits_met=bool(meeting),
                          front=pareto_front(found), priced=found, simulated=simulated)
    if not meeting:
        result.notes.append(_unreachable(objective, best))
    if best.schedule == "EP":
        result.notes.append(_llama_cpp(scenario, best, meeting or found))
    if scenario.hardware.assumed:
        result.notes.append(f"hardware: local: {scenario.hardware.assumed}.")
    result.wall_s = time.perf_counter() - t0
    return result


def _llama_cpp(scenario: Scenario, best: Candidate, candidates: list[Candidate]) -> str:
    """How llama.cpp runs an EP pick: its options, or, where the pick splits layers (which
    llama.cpp, one tensor a layer, cannot), the best whole-layer placement at its batch."""
    def options(c: Candidate) -> str | None:
        plan = make_plan(c.scenario(scenario))
        return placement.llama_cpp_options([len(row) for row in plan.held],
                                           scenario.model)[0]
    batch = f" -np {best.policy['N']}" if best.policy["N"] > 1 else ""
    own = options(best)
    if own is not None:
        return f"In llama.cpp: {own}{batch}."
    whole = [c for c in candidates if c.schedule == "EP" and "cpu_moe" in c.policy
             and c.policy["N"] == best.policy["N"]]
    if not whole:
        return "llama.cpp places a layer's experts whole; this placement splits layers."
    c = max(whole, key=lambda c: c.tok_s)
    return (f"llama.cpp places a layer's experts whole; its best here is {options(c)}{batch} "
            f"(r_w={c.policy['r_w']:g} r_c={c.policy['r_c']:g}): {c.tok_s:.2f} tok/s, "
            f"{1 - c.tok_s / best.tok_s:.0%} below the pick.")


def search_scenario(scenario: Scenario, top: int = 10, verify_top: bool = False,
                    brute: bool = False, backend: Backend = LOCAL,
                    progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """`tg search`: the ranking, with the machine's limit; `verify_top` simulates the top
    policies and re-ranks them; `brute` also simulates a coarse grid (which verifies too)."""
    if not 1 <= top <= MAX_TOP:
        raise TgError(f"--top must be from 1 to {MAX_TOP}, not {top:,}: each policy listed is "
                      "built to check that its schedule can run it.")
    result = search(scenario, top=top)
    result.scenario = scenario.name
    if verify_top or brute:
        verify(scenario, result, backend, progress)
    if brute:
        result.grid = brute_force(scenario, backend=backend, progress=progress)
    result.hardware_limit_tok_s = hardware_limit_tok_s(scenario)
    return result


@dataclass(frozen=True)
class ExpertJob:
    """Simulate an expert-level schedule at one policy; returns its candidate (none where it
    cannot run) and 1, as a GridJob returns its own."""

    scenario: Scenario            # the policy set
    schedule: str

    def run(self) -> tuple[list[Candidate], int]:
        try:
            s = simulate_scenario(self.scenario, self.schedule).summary
        except (MemoryFitError, ScheduleError):
            return [], 1
        return [Candidate(
            schedule=self.schedule, policy=_expert_policy(self.schedule, self.scenario.policy),
            predicted_tok_s=s["throughput_tok_s"], predicted_layer_ms=s["decode_layer_ms"],
            resource=_RESOURCE_NAMES.get(s["bound_by"]["decode"], s["bound_by"]["decode"]),
            token_latency_ms=s["token_latency_ms"], ttft_s=s["ttft_s"],
            priced_by="simulation", simulated_tok_s=s["throughput_tok_s"],
            simulated_layer_ms=s["decode_layer_ms"])], 1


def expert_jobs(scenario: Scenario, batch: int | None = None,
                schedules: tuple[str, ...] | None = None) -> list[ExpertJob]:
    """The expert-level schedules (EP, EC, ECP), which no HRM bound prices, to simulate at each
    batch of EXPERT_BATCHES (or at `batch`). Each runs the policy that fills its GPU
    (:func:`~taskgraph.study.crossover.policy_for`) twice over: the other weights and the KV
    cache first, then experts; and experts first. The two differ where the GPU cannot hold
    both (EP at 64 on t4: 21.7 tok/s the first way, 24.7 the second). EP also spends the
    memory each corner gives its experts on the other placements (:func:`across_layers`), and
    places its budget over all layers before the other weights (at t4's N = 16, 41 experts
    with the weights streamed: 16.61 tok/s, where one a layer and the weights resident give
    15.96). A cache (EC, ECP) runs under each eviction rule (where it holds an expert).
    Policies that come out the same are simulated once."""
    jobs: dict[tuple, ExpertJob] = {}
    for name in _expert_level(schedules):
        for N in (batch,) if batch else EXPERT_BATCHES:
            for experts_first in (False, True):
                for eviction in _evictions(name):
                    try:
                        sc = policy_for(scenario, name, N, experts_first, eviction)
                    except (MemoryFitError, ScheduleError):
                        continue
                    for each in (sc, *across_layers(sc, name)):
                        _add_expert_job(jobs, each, name)
                    if experts_first and SCHEDULES[name].reads("experts_total"):
                        # the budget before the other weights: what a count a layer leaves
                        # over may be worth more than the weights it makes room for
                        _add_expert_job(jobs, policy_for(scenario, name, N, True, eviction,
                                                         "experts_total"), name)
    return list(jobs.values())


def _even(scenario: Scenario) -> int | None:
    """The count every MoE layer holds where a placement across layers comes to one count (a
    budget a multiple of the layers under a routing whose layers are alike; no layer or every
    layer on the CPU), else None."""
    m, p = scenario.model, scenario.policy
    if p.cpu_moe is not None:
        moe_on_cpu = sum(1 for l in range(min(p.cpu_moe, m.L)) if not m.is_dense(l))
        return {0: m.E, m.moe_layers: 0}.get(moe_on_cpu)
    if p.experts_total is not None and p.experts_total % m.moe_layers == 0 \
            and scenario.workload.routing.kind != "trace":
        return p.experts_total // m.moe_layers
    return None


def across_layers(scenario: Scenario, schedule: str) -> list[Scenario]:
    """EP's other placements of the memory `scenario` gives its experts `experts_gpu` on
    every layer (taskgraph.placement): the most experts over all layers by popularity
    (Fiddler's), and the fewest layers whose experts stay on the CPU (llama.cpp's
    --n-cpu-moe). None where every expert is placed already, or for another schedule."""
    m, p = scenario.model, scenario.policy
    if not SCHEDULES[schedule].reads("experts_total") or p.experts_gpu >= m.E:
        return []
    fits = fits_with(scenario, schedule)
    out = []
    # the memory `scenario` already fits holds its own count in every layer, and no expert
    budget = first_fitting(range(m.E * m.moe_layers, p.experts_gpu * m.moe_layers - 1, -1),
                           lambda b: fits({"experts_gpu": 0, "experts_total": b}))
    if budget > p.experts_gpu * m.moe_layers:
        out.append({"experts_gpu": 0, "experts_total": budget})
    out.append({"experts_gpu": 0, "cpu_moe": first_fitting(
        range(0, m.L + 1), lambda n: fits({"experts_gpu": 0, "cpu_moe": n}))})
    return [scenario.model_copy(update={"policy": p.model_copy(update=u)}) for u in out]


def expert_grid(scenario: Scenario, sizes: tuple[int, ...]) -> list[ExpertJob]:
    """The brute-force grid of the expert-level schedules at batch sizes `sizes`: every r_w of
    0, 0.5 and 1, the KV cache on the CPU or the GPU, each eviction rule, and with each as many
    experts a layer as then fit, and half as many."""
    jobs: dict[tuple, ExpertJob] = {}
    for name in _expert_level(None):
        fixed = SCHEDULES[name].placement
        for N in sizes:
            try:
                base = policy_for(scenario, name, N)
            except (MemoryFitError, ScheduleError):
                continue
            fits = fits_with(base, name)
            for r_w in (0.0, 0.5, 1.0):
                for r_c in (fixed["r_c"],) if "r_c" in fixed else (0.0, 1.0):
                    for eviction in _evictions(name):
                        update = {"r_w": r_w, "r_c": r_c, "experts_gpu": 0,
                                  **({"eviction": eviction} if eviction else {})}
                        if not fits(update):
                            continue
                        most = next(e for e in range(scenario.model.E, -1, -1)
                                    if fits({**update, "experts_gpu": e}))
                        for experts in {most, most // 2}:
                            policy = base.policy.model_copy(
                                update={**update, "experts_gpu": experts})
                            placed = base.model_copy(update={"policy": policy})
                            for each in (placed, *across_layers(placed, name)):
                                _add_expert_job(jobs, each, name)
    return list(jobs.values())


def _expert_level(schedules: tuple[str, ...] | None) -> list[str]:
    return [n for n, s in SCHEDULES.items() if s.expert_level
            and (schedules is None or n in schedules)]


def _evictions(name: str) -> tuple[str | None, ...]:
    return ("lru", "popular") if SCHEDULES[name].reads("eviction") else (None,)


def _add_expert_job(jobs: dict, scenario: Scenario, name: str) -> None:
    """One job per distinct policy (with no expert cached, the eviction rule is moot; a
    placement across layers that comes to the same count in every layer is that count)."""
    policy = scenario.policy
    if policy.experts_gpu == 0:
        policy = policy.model_copy(update={"eviction": "lru"})
    per_layer = _even(scenario)
    if per_layer is not None:
        policy = policy.model_copy(update={"experts_total": None, "cpu_moe": None,
                                           "experts_gpu": per_layer})
    jobs.setdefault((name, policy), ExpertJob(
        scenario.model_copy(update={"policy": policy}), name))


def _expert_policy(name: str, policy: PolicySpec) -> dict[str, Any]:
    """The policy's fields, the expert ones only where the schedule reads them and they place
    the experts (experts_gpu, or the one way of taskgraph.placement the policy gives)."""
    other = placement.given(policy)
    return {k: v for k, v in policy.model_dump().items()
            if k not in EXPERT_FIELDS or (SCHEDULES[name].reads(k) and v is not None
                                          and not (k == "experts_gpu" and other))}


def _option(value: Any) -> str:
    """A policy value as --set takes it."""
    if isinstance(value, float):
        return f"{value:g}"
    return ",".join(value) if isinstance(value, (list, tuple)) else str(value)


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates no other beats on both throughput and per-token latency, lowest latency
    first (so throughput rises along it)."""
    latency = np.array([c.token_latency_ms for c in candidates], dtype=float)
    tok_s = np.array([c.tok_s for c in candidates], dtype=float)
    # by latency, then throughput, highest first (a stable sort: ties keep their order); on
    # the front, each that beats the throughput of every one before it. A candidate missing
    # either figure (NaN) beats nothing and is on no front.
    order = np.lexsort((-tok_s, latency))
    order = order[~(np.isnan(latency) | np.isnan(tok_s))[order]]
    ranked = tok_s[order]
    best_before = np.maximum.accumulate(np.concatenate(([-np.inf], ranked[:-1])))
    return [candidates[i] for i in order[ranked > best_before].tolist()]


def _order(objective: ObjectiveSpec) -> Callable[[Candidate], tuple]:
    if objective.optimize == "latency":
        return lambda c: (round(math.log(c.token_latency_ms) * 1000), *_rank(c))
    return _rank


def _overshoot(objective: ObjectiveSpec, c: Candidate) -> float:
    """How far past its limits a policy is: its worse ratio of figure to limit."""
    return max(c.token_latency_ms / (objective.max_token_ms or math.inf),
               c.ttft_s / (objective.max_ttft_s or math.inf))


def _unreachable(objective: ObjectiveSpec, closest: Candidate) -> str:
    p = closest.policy
    return (f"No policy meets {objective.limits()}; the table lists the closest first: "
            f"{closest.schedule} N={p['N']} at {closest.token_latency_ms:,.0f} ms a token and "
            f"{closest.ttft_s:,.2f} s to the first, bound by {closest.resource}.")


def evaluate(scenario: Scenario, grid: Grid = Grid(), workers: int | None = None
             ) -> tuple[list[Candidate], int]:
    """Every feasible policy of the grid with its prediction, best first, and how many policies
    were enumerated."""
    found, considered = [], 0
    jobs = grid_jobs(scenario, grid, workers or os.cpu_count() or 1)
    for cands, n in run_jobs(jobs, Backend(workers=workers)):
        found += cands
        considered += n
    found.sort(key=_rank)
    return found, considered


def _rank(c: Candidate) -> tuple:
    """Best first; policies within 0.1% of each other are equals, and among equals the cheapest
    wins: weights and KV left on the CPU, then the smaller batch."""
    p = c.policy
    return (-round(math.log(c.tok_s) * 1000), p["r_w"], p["r_c"], p["N"], p["mu"])


def resolve_auto_policy(scenario: Scenario) -> tuple[Scenario, SearchResult | None]:
    """A scenario with `policy: auto` gets the search's best policy (and its schedule), for the
    scenario's objective; an expert-level schedule keeps its schedule and gets its best
    policy."""
    if not scenario.policy_auto:
        return scenario, None
    own = SCHEDULES[scenario.schedule]
    result = search(scenario, top=1, schedules=(own.name,) if own.expert_level else None)
    return result.best.scenario(scenario), result


def verify(scenario: Scenario, result: SearchResult, backend: Backend = LOCAL,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Simulate each of the top candidates and re-rank them by simulated throughput."""
    t0 = time.perf_counter()
    jobs = [SimJob(c.scenario(scenario)) for c in result.top]
    for c, summary in zip(result.top, run_jobs(jobs, backend, progress)):
        _simulated(c, summary)
    result.top = _best_first(result.objective, result.top)
    result.best = result.top[0]
    result.verified = True
    if scenario.requests is not None:
        w = scenario.workload
        how = "padded" if w.padded else "refill" if w.refill else "Algorithm 2"
        result.notes.append(f"Ranked by the mean lengths, verified on the request list "
                            f"({len(scenario.requests):,} requests, {how}).")
    result.wall_s += time.perf_counter() - t0
    return result


COARSE = Grid(mu=(16, 32, 64, 128, 192, 256), r_w=(0.0, 0.05, 0.1, 0.25, 0.5),
              r_c=(0.0, 0.5, 1.0))


def brute_force(scenario: Scenario, grid: Grid = COARSE, backend: Backend = LOCAL,
                progress: Callable[[int, int], None] | None = None) -> list[Candidate]:
    """Simulate a whole coarse grid: for every (schedule, mu, r_w, r_c) of `grid`, the largest,
    three quarters and half the largest batch that fit; and the expert-level schedules'
    :func:`expert_grid` at batch 1, 4 and 16 (or the objective's batch). Returns the simulated
    candidates, best first for the objective."""
    objective = scenario.objective
    found, _ = evaluate(scenario, replace(grid, batch=objective.batch), backend.workers)
    largest: dict[tuple, list[Candidate]] = {}
    for c in found:
        key = (c.schedule, c.policy["mu"], c.policy["r_w"], c.policy["r_c"])
        largest.setdefault(key, []).append(c)
    chosen = []
    for cands in largest.values():
        cands.sort(key=lambda c: c.policy["N"])
        picks = (cands[-1], cands[(3 * len(cands) - 1) // 4], cands[(len(cands) - 1) // 2])
        chosen += {id(c): c for c in picks}.values()
    chosen = _runnable(scenario, sorted(chosen, key=lambda c: -c.predicted_tok_s),
                       len(chosen)) if chosen else []
    experts = expert_grid(scenario, (objective.batch,) if objective.batch else (1, 4, 16))
    jobs = [SimJob(c.scenario(scenario)) for c in chosen]
    results = run_jobs([*jobs, *experts], backend, progress)
    for c, summary in zip(chosen, results):
        _simulated(c, summary)
    for cands, _ in results[len(jobs):]:
        chosen += cands
    return _best_first(objective, chosen)


def brute_force_summary(result: SearchResult, grid: list[Candidate]) -> dict[str, Any]:
    """The predicted pick against the best of a simulated grid (the reviewers' question), in
    the objective's figure (throughput, or per-token latency: the loss is the share of the
    best's speed given up)."""
    objective, best = result.objective, grid[0]
    if objective.optimize == "latency":
        def figure(c, simulated=True):
            return 1 / c.token_latency_ms
    else:
        def figure(c, simulated=True):
            return c.simulated_tok_s if simulated else c.predicted_tok_s
    # what the prediction alone would have chosen, and its choice among the grid's policies
    pick = result.top[0] if not result.verified else _best_first(
        objective, result.top, lambda c: figure(c, simulated=False))[0]
    in_grid = _best_first(objective, grid, lambda c: figure(c, simulated=False))[0]
    return {
        "simulated": len(grid),
        "best": asdict(best),
        "hrm_pick_simulated_tok_s": pick.simulated_tok_s,
        "loss_vs_best": round(1 - figure(pick) / figure(best), 4),
        "hrm_pick_in_grid_simulated_tok_s": in_grid.simulated_tok_s,
        "loss_in_grid": round(1 - figure(in_grid) / figure(best), 4),
    }


def _simulated(c: Candidate, summary: dict[str, Any]) -> None:
    c.simulated_tok_s = summary["throughput_tok_s"]
    c.simulated_layer_ms = summary["decode_layer_ms"]
    # a request list's queue has no one per-token latency: the mean lengths' stands
    c.token_latency_ms = summary.get("token_latency_ms", c.token_latency_ms)
    c.ttft_s = summary.get("ttft_s", c.ttft_s)


def _best_first(objective: ObjectiveSpec, cands: list[Candidate],
                figure: Callable[[Candidate], float] | None = None) -> list[Candidate]:
    """Those that meet the objective's limits, best first (by `figure`, higher better, where
    given), then the others, closest to the limits first."""
    meeting = [c for c in cands if objective.met_by(c.token_latency_ms, c.ttft_s)]
    rest = [c for c in cands if not objective.met_by(c.token_latency_ms, c.ttft_s)]
    key = (lambda c: -figure(c)) if figure else _order(objective)
    return sorted(meeting, key=key) + sorted(rest, key=lambda c: _overshoot(objective, c))


@dataclass(frozen=True)
class SimJob:
    """Simulate one scenario; returns its summary (picklable in and out). A scenario with a
    request list is simulated as its whole queue, batched as its workload says: the search
    ranks by the mean lengths (the paper's fast path), verification by the real requests."""

    scenario: Scenario

    def run(self) -> dict[str, Any]:
        if self.scenario.requests is not None:
            return simulate_queue(self.scenario).summary

        return simulate_scenario(self.scenario).summary


def grid_jobs(scenario: Scenario, grid: Grid, chunks: int) -> list[GridJob]:
    combos = []
    for attention, ffn in ((a, f) for a in grid.attention for f in grid.ffn):
        for schedule in _schedules_for(scenario, attention, ffn):
            _add_combos(combos, schedule, grid)
    size = math.ceil(len(combos) / chunks)
    return [GridJob(scenario, tuple(combos[i:i + size]), grid.max_micro_batches, grid.batch)
            for i in range(0, len(combos), size)]


def _add_combos(combos: list, schedule: Schedule, grid: Grid) -> None:
    for mu in grid.micro_batch_sizes():
        for r_w in grid.r_w:
            # where the schedule decides the KV cache's place (S1-S3, DS), only its own
            r_cs = (schedule.placement["r_c"],) if "r_c" in schedule.placement else grid.r_c
            for r_c in r_cs:
                combos.append((schedule.name, mu, r_w, r_c))


def _schedules_for(scenario: Scenario, attention: str, ffn: str = "gpu"
                   ) -> tuple[Schedule, ...]:
    """The schedules a search runs for an attention and FFN placement: the scenario's own
    where it places them so, else CGOPipe (CPU attention), S4 (GPU attention) or S5 (GPU
    attention, experts on the CPU), and on several GPUs FlexGen's pipeline (PP) beside S4's
    tensor parallelism; none where no schedule does (CPU attention with CPU experts; experts
    on the CPU of a multi-GPU machine, S5 being a one-GPU schedule)."""
    gpus = scenario.hardware.gpu.count
    if ffn == "cpu" and gpus > 1:
        return ()
    own = SCHEDULES[scenario.schedule]
    if own.attention == attention and own.ffn == ffn and own.parallel == "tensor":
        found = [own]
    else:
        found = [s for s in (_BY_PLACEMENT.get((attention, ffn)),) if s is not None]
    if (attention, ffn) == ("gpu", "gpu") and 1 < gpus <= scenario.model.L:
        found.append(SCHEDULES["PP"])
    return tuple(found)


_BY_PLACEMENT = {("cpu", "gpu"): SCHEDULES["S1"], ("gpu", "gpu"): SCHEDULES["S4"],
                 ("gpu", "cpu"): SCHEDULES["S5"]}


def _min_micro(scenario: Scenario, schedule: Schedule) -> int:
    # S4 with one layer and one micro-batch would prefetch the KV it is still computing.
    one_layer_gpu_attention = schedule.attention == "gpu" and scenario.model.L == 1
    return max(schedule.min_micro_batches, 2 if one_layer_gpu_attention else 1)


def _policy(N: int, mu: int, schedule: Schedule, r_w: float, r_c: float) -> dict[str, Any]:
    return {"N": int(N), "mu": int(mu), "A_g": int(schedule.attention == "gpu"),
            "F_g": int(schedule.ffn == "gpu"),
            "r_w": float(r_w), "r_c": float(r_c)}


def _fits(scenario: Scenario, schedule: Schedule, n: np.ndarray, mu: int, r_w: float,
          r_c: float) -> np.ndarray:
    gpu, cpu = _memory_totals(scenario, schedule, n, mu, r_w, r_c)
    g_cap, c_cap = _capacities(scenario)
    return (gpu <= g_cap) & (cpu <= c_cap)


def _memory_totals(scenario, schedule, n, mu, r_w, r_c):
    pages = n if schedule.paged else np.ones_like(n)
    gpu, cpu = memory_items(scenario, schedule, n * mu, mu, r_w, r_c, pages)
    return sum(gpu.values()) * np.ones(len(n)), sum(cpu.values()) * np.ones(len(n))


def _capacities(scenario: Scenario) -> tuple[float, float]:
    g, c = scenario.hardware.gpu, scenario.hardware.cpu
    return g.memory_gb * GB * g.usable_fraction * g.count, c.memory_gb * GB * c.usable_fraction


def _runnable(scenario: Scenario, ranked: list[Candidate], top: int) -> list[Candidate]:
    """The first `top` candidates whose schedule can actually run their policy (the builder
    rejects, e.g., CGOPipe pages too small to hold the next layer's QKV weights in time)."""
    # a pipeline needs a layer per GPU
    layers = min(scenario.model.L, max(2, scenario.hardware.gpu.count))
    small = scenario.model_copy(update={
        "model": scenario.model.model_copy(update={"L": layers}),
        "workload": scenario.workload.model_copy(update={"gen_len": 2})})
    keep: list[Candidate] = []
    for c in ranked:
        try:
            plan = make_plan(c.scenario(small))
            for d in range(plan.G + 1):
                build_segment(plan, d)
        except ScheduleError:
            continue
        keep.append(c)
        if len(keep) == top:
            break
    if not keep:
        raise TgError("No feasible policy can be run by the schedules tg knows; see "
                      "`tg simulate` on a candidate for the reason.")
    return keep


def _binding(scenario: Scenario, best: Candidate, max_micro_batches: int) -> str:
    """What stops the winner from going faster: the memory that forbids a bigger batch when a
    bigger batch would be predicted faster, else the resource that bounds its decode layers."""
    p = best.policy
    schedule = SCHEDULES[best.schedule]
    n_next = np.array([p["N"] // p["mu"] + 1])
    if n_next[0] <= max_micro_batches and not schedule.expert_level \
            and scenario.objective.batch is None:
        pred = predict_micro_batches(scenario, schedule, p["mu"], p["r_w"], p["r_c"], n_next)
        if pred.throughput_tok_s[0] > best.predicted_tok_s:
            gpu, cpu = _memory_totals(scenario, schedule, n_next, p["mu"], p["r_w"], p["r_c"])
            g_cap, c_cap = _capacities(scenario)
            if cpu[0] > c_cap:
                return "CPU memory"
            if gpu[0] > g_cap:
                return "GPU memory"
    return best.resource


def _nothing_fits(scenario: Scenario, grid: Grid) -> str:
    """Explain an infeasible scenario: how short each memory is at its most lenient policy (one
    sequence; S3, which needs no staging buffers and no minimum number of micro-batches)."""
    g_cap, c_cap = _capacities(scenario)
    one = np.array([1])
    needs = [(float(g[0]), float(c[0])) for g, c in
             (_memory_totals(scenario, SCHEDULES["S3"], one, 1, r_w, 0.0) for r_w in grid.r_w)]
    gpu_min = min(g for g, _ in needs)
    if gpu_min > g_cap:
        short = (f"GPU memory: even streaming every weight with one sequence needs "
                 f"{gpu_min / GB:.2f} GB of {g_cap / GB:.2f} GB usable "
                 f"({(gpu_min - g_cap) / GB:.2f} GB short)")
    else:
        cpu_min = min(c for g, c in needs if g <= g_cap)
        if cpu_min > c_cap:
            short = (f"CPU memory: keeping as many weights on the GPU as fit, one sequence still "
                     f"needs {cpu_min / GB:.2f} GB of {c_cap / GB:.2f} GB usable "
                     f"({(cpu_min - c_cap) / GB:.2f} GB short)")
        else:
            short = "every policy that fits needs more micro-batches than the grid allows"
    return (f"No policy fits {scenario.model.name} on {scenario.hardware.name}: {short}. Use a "
            "machine with more memory or a smaller model.")
