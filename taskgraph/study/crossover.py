"""Schedules across batch sizes (``tg compare --batch-sizes``): where CGOPipe stops winning.

At each batch size N every schedule runs the policy a user would give it on this machine:
micro-batches of at most the scenario's ``mu`` (at least the schedule's minimum count of them),
and then, greedily while the GPU's memory holds them, every non-expert weight resident (``r_w``),
the whole KV cache on the GPU where attention runs there (``r_c``), and as many experts a layer
on the GPU as fit (``experts_gpu``, EP and EC), or, where the scenario places EP's experts by
a budget over all layers or by whole layers (``experts_total``, ``cpu_moe``), the most of that
placement that fits. At a fixed batch keeping more on the GPU never
costs time in this model, so the greedy choice is each schedule's best of that kind; the GPU is
filled to its physical memory less the reserve, as an explicit policy may be. Each point is
simulated, and the result says at which batch the throughput-schedules (CGOPipe and FlexGen)
overtake the expert-level ones, and what binds each side there.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from taskgraph.dag.builder import make_plan
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.errors import MemoryFitError, ScheduleError, TgError
from taskgraph.output.plots import crossover_plot
from taskgraph.output.report import Shown, crossover_table
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.scenario import for_schedule
from taskgraph.sim.simulate import simulate_scenario
from taskgraph.specs import MAX_MICRO_BATCHES, PolicySpec, Scenario
from taskgraph.study.jobs import LOCAL, Backend, run_jobs

Progress = Callable[[int, int], None] | None

#: The default comparison: the paper's schedule and FlexGen's against the expert-level ones.
SCHEDULES_COMPARED = ("S1", "S4", "S5", "EP", "EC")
#: The default batch sizes: 1 to CGOPipe's own 504 on t4.
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 504)
#: Points of one comparison (schedules x batch sizes), each a simulation.
MAX_POINTS = 400
#: The largest batch compared: the request lists' bound (specs.MAX_REQUESTS).
MAX_BATCH = 1_000_000
_FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.0)
#: Schedules that leave the experts in host memory and place them one by one (S5 runs them all
#: on the CPU, EP the popular ones on the GPU, EC caches them): made for small batches. The
#: others (S1-S4, DS, PP) stream every layer's weights to the GPU for a large batch.
EXPERT_LEVEL = frozenset(n for n, s in SCHEDULES.items() if s.experts_on_host)


@dataclass(frozen=True)
class PointJob:
    """One schedule at one batch size: its policy chosen, then simulated."""

    scenario: Scenario
    schedule: str
    N: int

    def run(self) -> dict[str, Any]:
        row = {"schedule": self.schedule, "N": self.N}
        policy = self.scenario.policy
        # EP's experts placed as the scenario places them; EC's cache as many a layer
        placed = next((f for f in ("experts_total", "cpu_moe") if getattr(policy, f) is not None
                       and SCHEDULES[self.schedule].reads(f)), "experts_gpu")
        try:
            sc = policy_for(self.scenario, self.schedule, self.N, placed=placed)
            s = simulate_scenario(sc, self.schedule).summary
        except (MemoryFitError, ScheduleError) as err:
            return {**row, "error": str(err)}
        return {**row, "policy": s["policy"], "throughput_tok_s": s["throughput_tok_s"],
                "token_latency_ms": s["token_latency_ms"], "ttft_s": s["ttft_s"],
                "bound_by": s["bound_by"]["decode"], "experts": s.get("experts")}


def policy_for(scenario: Scenario, schedule: str, N: int, experts_first: bool = False,
               eviction: str | None = None, placed: str = "experts_gpu") -> Scenario:
    """`scenario` running `schedule` with N sequences at the greedy policy (module docstring);
    MemoryFitError if not even the least of it fits. `experts_first` fills the GPU with experts
    before the other weights and the KV cache (the other corner of what the GPU's memory is
    spent on); `eviction` replaces the scenario's cache policy; `placed` is how EP's experts
    are placed (taskgraph.placement): as many a layer as fit (experts_gpu), the most over all
    layers (experts_total), or on the GPU from the fewest layers on the CPU (cpu_moe)."""
    s = SCHEDULES[schedule]
    fixed = s.placement
    n_min = max(s.min_micro_batches, 1)
    if N < n_min:
        raise ScheduleError(f"{schedule} needs at least {n_min} sequences (one a micro-batch)")
    # Expert-level schedules read each expert a micro-batch chooses once per micro-batch: they
    # take the batch in as few micro-batches as fit. The others keep the scenario's mu (CGOPipe
    # needs several micro-batches to overlap the CPU's attention with the link).
    mu = N // n_min if schedule in EXPERT_LEVEL else min(scenario.policy.mu, N // n_min)
    while True:
        while N % mu:
            mu -= 1
        if N // mu > MAX_MICRO_BATCHES:
            raise ScheduleError(f"N = {N} would be {N // mu:,} micro-batches of mu = {mu}; tg "
                                f"runs at most {MAX_MICRO_BATCHES} in a batch")
        base = for_schedule(scenario.model_copy(update={"policy": PolicySpec(
            N=N, mu=mu, A_g=fixed.get("A_g", scenario.policy.A_g), F_g=fixed.get("F_g", 1),
            r_w=fixed.get("r_w", 0.0), r_c=fixed.get("r_c", 0.0))}), schedule)[0]
        # the user's eviction and prefetch accuracy, where the schedule has a cache
        own = {k: getattr(scenario.policy, k) for k in ("eviction", "prefetch")
               if s.reads(k)}
        if eviction is not None and s.reads("eviction"):
            own["eviction"] = eviction
        base = base.model_copy(update={"policy": base.policy.model_copy(update=own)})
        fits = fits_with(base, schedule)
        if fits({}):
            break
        if mu == 1 or N // (mu // 2) > MAX_MICRO_BATCHES:
            check_fits(memory_footprint(make_plan(base, schedule)), schedule)  # raises, naming it
        mu //= 2
    m = scenario.model
    # each knob's values, most kept on the GPU first
    experts = {"experts_gpu": range(m.E, -1, -1),
               "experts_total": range(m.E * m.moe_layers, -1, -1),
               "cpu_moe": range(0, m.L + 1)}[placed]
    chosen: dict[str, Any] = {}
    knobs = [("r_w", _FRACTIONS), ("r_c", _FRACTIONS), (placed, experts)]
    for knob, values in knobs[-1:] + knobs[:-1] if experts_first else knobs:
        if knob in fixed or (knob == "r_c" and s.attention == "cpu") or \
                (knob == placed and not s.reads(placed)):
            continue
        chosen[knob] = first_fitting(values, lambda v: fits({**chosen, knob: v}))
    return base.model_copy(update={"policy": base.policy.model_copy(update=chosen)})


def first_fitting(values, ok: Callable[[Any], bool]) -> Any:
    """The first of `values` that is ok, where every value after an ok one is ok too (more
    room on the GPU never stops a policy fitting) and the last is (the least kept on the GPU:
    the base policy, which fits): by bisection, as an expert budget may have thousands."""
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(values[mid]) else (mid + 1, hi)
    return values[lo]


def fits_with(base: Scenario, schedule: str) -> Callable[[dict], bool]:
    """Whether `base` running `schedule` fits its machine with a policy update."""
    def fits(update: dict) -> bool:
        sc = base.model_copy(update={"policy": base.policy.model_copy(update=update)})
        try:
            check_fits(memory_footprint(make_plan(sc, schedule)), schedule)
        except MemoryFitError:
            return False
        return True
    return fits


@dataclass
class Crossover(Shown):
    """Every schedule at every batch size: throughput, per-token latency and what binds.
    `to_dict()` is `tg compare --batch-sizes ... --json`."""

    scenario: str
    hardware: str
    schedules: list[str]
    batch_sizes: list[int]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def best(self, N: int, among) -> dict[str, Any] | None:
        rows = [r for r in self.rows if r["N"] == N and r["schedule"] in among and "error" not in r]
        return max(rows, key=lambda r: r["throughput_tok_s"], default=None)

    @property
    def crossover(self) -> dict[str, Any] | None:
        """The smallest batch from which a schedule that streams whole layers (S1-S4, DS) beats
        every expert-level one (S5, EP, EC) at every larger batch, with each side's best and
        what binds it there."""
        batch = [n for n in self.schedules if n not in EXPERT_LEVEL]
        expert = [n for n in self.schedules if n in EXPERT_LEVEL]
        if not batch or not expert:
            return {"N": None, "note": "no schedule that streams whole layers was compared"
                    if not batch else "no expert-level schedule was compared"}
        if not any(self.best(N, expert) for N in self.batch_sizes):
            return {"N": None, "note": "no expert-level schedule runs on this machine at these "
                                       "sizes (--json says why)"}
        won = []
        for N in self.batch_sizes:
            b, e = self.best(N, batch), self.best(N, expert)
            won.append((N, b, e, b is not None and (e is None or
                                                   b["throughput_tok_s"] > e["throughput_tok_s"])))
        for i, (N, b, e, _) in enumerate(won):
            if all(w for *_, w in won[i:]):
                if i == 0:
                    return {"N": N, "note": "streaming whole layers wins at every size compared",
                            "batch": _side(b), "expert": _side(e)}
                return {"N": N, "batch": _side(b), "expert": _side(e),
                        "below": _side(won[i - 1][2]), "below_N": won[i - 1][0]}
        return {"N": None, "note": "the expert-level schedules win at the largest size compared"}

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "hardware": self.hardware,
                "schedules": self.schedules, "batch_sizes": self.batch_sizes,
                "rows": self.rows, "crossover": self.crossover}

    def views(self):
        yield crossover_table(self)

    def plot(self, out: str | Path) -> Path:
        if all("error" in r for r in self.rows):
            raise TgError(f"--plot {out}: no schedule ran at these batch sizes, so there is "
                          "nothing to draw (--json says why each did not).")
        return crossover_plot(self, out)


def _side(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {k: row[k] for k in ("schedule", "throughput_tok_s", "token_latency_ms", "bound_by")}


def crossover(scenario: Scenario, schedules: list[str] | None = None,
              batch_sizes: list[int] | None = None, jobs: Backend = LOCAL,
              progress: Progress = None) -> Crossover:
    """Simulate `schedules` at each of `batch_sizes` (module docstring)."""
    if isinstance(schedules, str) or isinstance(batch_sizes, (str, bytes)):
        raise TgError("Give the schedules and the batch sizes as lists, e.g. ['S1', 'EC'] and "
                      "[1, 16, 256].")
    try:
        names = list(dict.fromkeys(SCHEDULES_COMPARED if schedules is None else schedules))
    except TypeError:
        raise TgError(f"Give the schedules as a list of names, not {schedules!r:.60}.") from None
    try:
        given = list(BATCH_SIZES if batch_sizes is None else batch_sizes)
        if any(isinstance(n, bool) for n in given):
            raise TypeError
        sizes = sorted({operator.index(n) for n in given})     # 2.5 is not a batch size
    except TypeError:
        raise TgError("Batch sizes must be whole numbers of sequences, e.g. [1, 16, 256]; not "
                      f"{batch_sizes!r:.60}.") from None
    if sizes and sizes[-1] > MAX_BATCH:
        raise TgError(f"A batch of {sizes[-1]:,} sequences is beyond any run; --batch-sizes "
                      f"goes up to {MAX_BATCH:,}.")
    unknown = [n for n in names if n not in SCHEDULES]
    if not names:
        raise TgError(f"--schedules names no schedule; known schedules: {', '.join(SCHEDULES)}.")
    if unknown:
        raise TgError(f"Unknown schedule '{unknown[0]}'; known schedules: "
                      f"{', '.join(SCHEDULES)}.")
    if not sizes or sizes[0] < 1:
        raise TgError("--batch-sizes must be positive numbers of sequences, e.g. 1,4,16,64.")
    if len(names) * len(sizes) > MAX_POINTS:
        raise TgError(f"{len(names)} schedules x {len(sizes)} batch sizes is "
                      f"{len(names) * len(sizes)} simulations; at most {MAX_POINTS}.")
    if scenario.requests is not None:
        raise TgError("--batch-sizes compares fixed batches of the scenario's mean lengths; "
                      "this scenario lists requests.")
    todo = [PointJob(scenario, n, N) for N in sizes for n in names]
    out = Crossover(scenario.name, scenario.hardware.name, names, sizes)
    out.rows = run_jobs(todo, jobs, progress)
    return out
