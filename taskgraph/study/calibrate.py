"""`tg calibrate`: measure what the cost model needs on this machine and write a hardware profile.

Rates come from microbenchmarks (:mod:`taskgraph.exec.microbench`). Per-task costs, the hand-off
between streams and the interference between resources are fitted to the executor's own measured
tasks, which include everything a microbenchmark leaves out (dispatch, Python, small-op overheads,
contention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from taskgraph.dag.schedules import RESOURCES
from taskgraph.errors import TgError
from taskgraph.exec.microbench import base_profile, measure
from taskgraph.output.report import Shown, calibrate_table, warnings_of
from taskgraph.perf.cost import CostModel
from taskgraph.specs import HardwareSpec, Scenario

#: Policies the fit runs: several micro-batch sizes so that task sizes vary, and every schedule,
#: so that every task kind is seen both alone (S3 overlaps little) and overlapped (S1 overlaps
#: most), which is what separates a task's cost from the interference it suffers.
FIT_RUNS = tuple((schedule, mu) for schedule in ("S1", "S2", "S3", "S4") for mu in (1, 2, 4))

#: Batch-1 runs of the expert-level schedules, for the task kinds only they have (Route,
#: GPUFFN, Merge, CPUFFN, D5, D6, ExpertIn): unfitted, their fixed costs were a kernel launch's,
#: and on an H200 Route (1.2 ms measured, waiting for the router's choice) and GPUFFN (1.2 ms)
#: were priced at 0.03 and 0.2 ms (bench/results/h200-2026-11-26). The kinds the batch
#: schedules have, the slowdown and the hand-off are fitted from FIT_RUNS alone.
EXPERT_RUNS = ("EP", "EC")
#: The kinds whose work is routed experts: computed (on the GPU, on the CPU) or copied in.
EXPERT_KINDS = ("GPUFFN", "CPUFFN", "ExpertIn")
#: How much finer the second expert size the expert runs measure is (:func:`_finer`): each
#: expert's own operators then show apart from its bytes.
FINER = 4
#: Decode steps of an expert run at least: at batch 1 a step is short.
EXPERT_STEPS = 8

#: Resources whose slowdown is fitted: the compute streams. Copies' fitted costs include the
#: interference they meet on average (they are seldom alone, so it cannot be separated).
SLOWED = ("gpu", "cpu")
#: What slows them, fitted one factor per group. On the CPU backend every copy is a memcpy
#: through the same memory, so the three copy resources share one factor; fitted apart, the
#: rarely busy ones (pinned staging: 6% of a compute task's time, D1/KVOut under 1%) came out
#: anywhere between 0 and 0.5 from one calibration to the next.
AGGRESSORS = (("gpu",), ("cpu",), ("h2d", "d2h", "pin"))


@dataclass
class _Samples:
    """The executor's measured decode-and-prefill tasks of one kind, pooled over the fit runs
    (one chunk of arrays per run)."""

    resource: int
    chunks: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def add(self, **columns: np.ndarray) -> None:
        for name, values in columns.items():
            self.chunks.setdefault(name, []).append(values)

    def array(self, name: str) -> np.ndarray:
        """``nbytes``, ``roof`` (roofline seconds at base rates), ``measured`` (seconds) or
        ``busy`` (tasks x resources: the share of each task each resource was busy)."""
        return np.concatenate(self.chunks[name])

    def calm(self) -> np.ndarray:
        """Tasks that ran with every other resource (nearly) idle."""
        return self.array("busy").sum(axis=1) < 0.15

    def slowed(self, factors: np.ndarray) -> np.ndarray:
        """Per task, 1 + its slowdown under `factors` (one per aggressor resource)."""
        return 1.0 + self.array("busy") @ factors

    def alone(self, slowdown: dict[str, dict[str, float]]) -> np.ndarray:
        """Per task, its measured time with the fitted slowdown of its resource divided out."""
        by = slowdown.get(RESOURCES[self.resource], {})
        return self.array("measured") / self.slowed(np.array([by.get(r, 0.0)
                                                              for r in RESOURCES]))


@dataclass
class TaskFit:
    """What :func:`fit_tasks` found: per task kind a fixed cost (µs) and, where task sizes varied
    enough to fit one, an effective bandwidth (GB/s); the hand-off between streams (µs); how much
    each compute resource slows down while another resource is busy; per kind a summary; the
    dequantization rates and, per expert kind, what each expert adds (µs); the fitted copy
    costs no copy of that size could take (:func:`_implausible`)."""

    fixed_us: dict[str, float]
    gbps: dict[str, float]
    handoff_us: float
    slowdown: dict[str, dict[str, float]]
    tasks: dict[str, dict[str, float]]
    dequant_gweights: dict[str, float | None] = field(default_factory=dict)
    expert_us: dict[str, float] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)


def fit_tasks(scenario: Scenario, base: dict[str, Any], device: str = "cpu", repeats: int = 2
              ) -> TaskFit:
    """Per task kind ``time = (fixed + bytes / rate) x (1 + sum over resources r of a_r x f_r)``,
    f_r the fraction of the task during which resource r was busy, fitted to the executor's own
    measured tasks over :data:`FIT_RUNS`: first each compute resource's factors a
    (:func:`_fit_slowdown`), then the kinds' costs on the durations with the slowdown divided
    out; the kinds only the expert schedules have, from :data:`EXPERT_RUNS` on one GPU. The
    hand-off is the median delay between a task's end and the start of a task on another
    stream waiting for it. The expert kinds' costs are fitted over the expert runs and the same
    runs with finer experts (:func:`_finer`, :func:`_fit_expert_cost`). On one GPU, last, the
    rate the executor dequantizes experts at (:func:`_fit_dequant`). `base` is the profile the
    microbenchmarks gave, whose roofs price the kinds whose sizes do not vary."""
    from taskgraph.dag.compiled import KIND_NAMES
    from taskgraph.scenario import for_schedule

    tasks = _MeasuredTasks(CostModel(HardwareSpec.model_validate(base)), device)
    finer = None
    for schedule, mu in FIT_RUNS * repeats:      # pooled over repeats: runs are noisy
        policy = scenario.policy.model_copy(update={"mu": mu, "N": mu * 4})
        tasks.measure(for_schedule(scenario.model_copy(update={"policy": policy}), schedule)[0],
                      schedule)
    slowdown = _fit_slowdown(tasks.samples)
    if scenario.hardware.gpu.count == 1:         # the expert schedules run on one GPU
        m, w = scenario.model, scenario.workload
        policy = scenario.policy.model_copy(update={
            "mu": 1, "N": 1, "experts_gpu": min(m.E - 1, max(m.k, scenario.policy.experts_gpu))})
        one = scenario.model_copy(update={"policy": policy, "workload": w.model_copy(
            update={"gen_len": max(w.gen_len, EXPERT_STEPS)})})
        batch_kinds = frozenset(tasks.samples)
        finer = _finer(one)
        for schedule in EXPERT_RUNS * repeats:
            tasks.measure(for_schedule(one, schedule)[0], schedule, skip=batch_kinds)
            if finer is not None:
                tasks.measure(for_schedule(finer, schedule)[0], schedule,
                              skip=frozenset(KIND_NAMES) - set(EXPERT_KINDS))
    fixed, gbps, per_expert = {}, {}, {}
    for kind, smp in tasks.samples.items():
        alone, nbytes, roof = smp.alone(slowdown), smp.array("nbytes"), smp.array("roof")
        if kind in EXPERT_KINDS and finer is not None:
            fixed_s, slope, expert_s = _fit_expert_cost(nbytes, smp.array("experts"), roof, alone)
            per_expert[kind] = expert_s * 1e6
        else:
            fixed_s, slope = _fit_cost(nbytes, roof, alone)
        fixed[kind] = fixed_s * 1e6
        if slope > 0:
            gbps[kind] = 1 / slope / 1e9
    measured = {k: s.array("measured") for k, s in tasks.samples.items()}
    summary = {k: {"tasks": len(m), "median_us": float(np.median(m)) * 1e6}
               for k, m in measured.items()}
    gaps = tasks.gaps
    handoff = max(0.0, float(np.median(gaps)) * 1e6) if gaps else 0.0
    dequant, unfitted = {}, []
    if scenario.hardware.gpu.count == 1:
        fitted = HardwareSpec.model_validate(base | {
            "task_overhead_us": fixed, "task_gbps": gbps,
            "task_expert_us": {k: v for k, v in per_expert.items() if v > 0}})
        dequant, unfitted = _fit_dequant(one, fitted, slowdown, device, repeats)
    findings = _implausible(tasks, fixed, gbps) + unfitted
    return TaskFit(fixed, gbps, handoff, slowdown, summary, dequant, per_expert, findings)


#: The format :func:`_fit_dequant` stores experts in: llama.cpp's Q4_0, the executor's densest.
DEQUANT_FORMAT = "q4_0"


#: Where the executor dequantizes routed experts, and the runs that time those kinds: EP at
#: batch 1 (the expert-level schedules' kinds, on the CPU and on the GPU) and S1 (a layer
#: streamed whole: its experts unpacked inside decode's PostAttn and prefill's Prefill).
DEQUANT_RUNS = {"EP": ("CPUFFN", "GPUFFN"), "S1": ("PostAttn", "Prefill")}
def _fit_dequant(one: Scenario, hardware: HardwareSpec, slowdown: dict[str, dict[str, float]],
                 device: str, repeats: int) -> tuple[dict[str, float | None], list[str]]:
    """Per kind that computes routed experts, the rate the executor dequantizes them at (G
    weights/s): the :data:`DEQUANT_RUNS` at batch 1 with Q4_0 experts, each task's time with
    the slowdown divided out, less what the fitted costs price for its bytes, is its unpacking;
    the weights over that time, the median over the tasks (None where it is not positive: no
    cost the fit can tell). A task's bytes are priced as experts' (as :class:`CostModel` prices
    them), so a layer's other weights in PostAttn are fitted into its rate (tensor parallelism's
    MoE part takes it: :data:`taskgraph.perf.cost.DEQUANT_AS`). A run that fails leaves its
    kinds unfitted, said in the findings, and the profile is written without them."""
    from taskgraph.dag.compiled import KIND_NAMES
    from taskgraph.dag.schedules import SCHEDULES
    from taskgraph.formats import bits
    from taskgraph.scenario import for_schedule

    m = one.model
    quantized = one.model_copy(update={"model": m.model_copy(update={
        "precision": m.precision.model_copy(update={"experts": DEQUANT_FORMAT})})})
    fitted = CostModel(hardware, expert_bytes=quantized.model.expert_bytes)
    tasks, findings, failed = _MeasuredTasks(fitted, device), [], set()
    for _ in range(repeats):
        for schedule, kinds in DEQUANT_RUNS.items():
            # a sequence a micro-batch, as many as the schedule needs (S1 overlaps two)
            n = max(1, SCHEDULES[schedule].min_micro_batches)
            run = quantized.model_copy(update={"policy": quantized.policy.model_copy(
                update={"mu": 1, "N": n})})
            if schedule in failed:
                continue
            try:
                tasks.measure(for_schedule(run, schedule)[0], schedule,
                              skip=frozenset(KIND_NAMES) - set(kinds))
            except TgError as e:
                failed.add(schedule)
                findings.append(f"{', '.join(kinds)}: no dequantization rate, {schedule} with "
                                f"{DEQUANT_FORMAT} experts did not run here: {e}")
    out = {}
    for kind, smp in tasks.samples.items():
        k, nbytes = KIND_NAMES.index(kind), smp.array("nbytes")
        # what the fitted costs price for its work (its roofline: bytes or FLOPs), without a
        # dequantization rate yet
        unpacking = smp.alone(slowdown) - fitted.fixed(smp.resource, k) - smp.array("roof")
        seconds_a_weight = float(np.median(unpacking / (nbytes * 8 / bits(DEQUANT_FORMAT))))
        out[kind] = 1e-9 / seconds_a_weight if seconds_a_weight > 0 else None
    return out, findings


class _MeasuredTasks:
    """The executor's tasks, measured run by run: each kind's samples, and the hand-offs."""

    def __init__(self, base_cost: CostModel, device: str):
        self.base_cost, self.device = base_cost, device
        self.samples: dict[str, _Samples] = {}
        self.gaps: list[float] = []
        self.staged: set[str] = set()       # kinds measured in a run without pageable copies
        self.warm: set[str] = set()         # schedules whose one-off costs are paid (warm_up)

    def measure(self, sc: Scenario, schedule: str, skip: frozenset[str] = frozenset()) -> None:
        """Execute `sc` with `schedule` and add its tasks to the samples, but those of the
        kinds in `skip`, and its hand-offs to the gaps (a batch run's: nothing skipped)."""
        from taskgraph.exec.execute import execute_scenario, warm_up

        if schedule not in self.warm:       # each schedule's kernels load at their first call
            warm_up(sc, schedule, self.device)
            self.warm.add(schedule)
        ex = execute_scenario(sc, schedule, device=self.device, check=False)
        # The executor keeps what ran before Ctrl-C or a failed task (a trace of it is useful);
        # a profile fitted to part of a run is not: stop, and write nothing.
        if ex.failure is not None:
            raise TgError(f"A task failed while measuring {schedule} at mu = {sc.policy.mu} "
                          f"({type(ex.failure).__name__}); no profile was written.")
        if ex.run.interrupted:
            raise KeyboardInterrupt
        self._add(ex.program, ex.run, schedule, skip, sc.model.expert_bytes)
        if not skip:
            self.gaps.extend(_handoff_gaps(ex.program, ex.run))

    def _add(self, prog: Any, run: Any, schedule: str, skip: frozenset[str],
             expert_bytes: float) -> None:
        from taskgraph.dag.compiled import KIND_NAMES
        from taskgraph.dag.schedules import SCHEDULES
        from taskgraph.sim.interference import busy_fractions

        step = prog.step
        nbytes = prog.column("nbytes") + prog.column("bytes_per_ctx") * prog.context(step)
        resource, kinds = prog.column("resource"), prog.column("kind")
        roof = prog.durations(self.base_cost) - self.base_cost.fixed(resource, kinds)
        busy = busy_fractions(run.start, run.end, resource)
        # On CUDA, weights copied from pageable memory (schedules without pinned staging) are
        # staged by the driver on the CPU, and while such a copy is in flight other threads'
        # launches wait for it: on an H100 GPU tasks stretched from 1 ms to 400 ms. The link's
        # pageable rate prices those copies; the other kinds are fitted from runs without them
        # where such runs have them (FIT_RUNS lists S1, which stages, first).
        pageable = self.device == "cuda" and not SCHEDULES[schedule].weights_pinned
        # A cache's prefill misses more experts than its staging slots hold: there the executor
        # copies the later rounds inside GPUFFN, where the model prices them in ExpertIn
        # (exec.runtime.Runtime._GPUFFN), so neither task is what the model calls it. Fitted
        # with them, on an H100, GPUFFN came out at 103 GB/s: 7.2 ms for EC's decode's 0.65.
        copied = [KIND_NAMES.index("GPUFFN"), KIND_NAMES.index("ExpertIn")]
        mixed = (step == 0) & np.isin(kinds, copied) & (SCHEDULES[schedule].ffn == "cache")
        for k in np.unique(kinds):
            name = KIND_NAMES[k]
            if name in skip or (pageable and (name == "D3" or name in self.staged)):
                continue
            if not pageable:
                self.staged.add(name)
            sel = (kinds == k) & run.finished & ~mixed
            if sel.any():
                smp = self.samples.setdefault(name, _Samples(int(resource[sel][0])))
                smp.add(nbytes=nbytes[sel], roof=roof[sel], measured=run.durations[sel],
                        busy=busy[sel], experts=nbytes[sel] / expert_bytes)


def _fit_cost(x: np.ndarray, roof: np.ndarray, alone: np.ndarray) -> tuple[float, float]:
    """(fixed seconds, seconds per byte) of one kind: a line through (bytes, time) where sizes
    vary, refitted without the first fit's outliers (preempted tasks), else the measured roofline
    time plus a fixed cost (slope 0: the roof is kept)."""
    slope = 0.0
    if x.std() > 0.05 * x.mean():
        keep = np.ones(len(x), dtype=bool)
        for _ in range(2):
            slope, intercept = np.polyfit(x[keep], alone[keep], 1)
            keep = _inliers(alone - (intercept + slope * x))
    if slope > 0:
        return max(0.0, float(np.median(alone - x * slope))), float(slope)
    return max(0.0, float(np.median(alone - roof))), 0.0


#: Resources whose tasks are copies: their fitted costs can be set beside the copies measured.
COPIES = ("h2d", "d2h", "pin", "peer")


def _implausible(tasks: _MeasuredTasks, fixed: dict[str, float], gbps: dict[str, float]
                 ) -> list[str]:
    """Copy kinds whose fitted line no copy follows: bytes at under a tenth of the rate the
    microbenchmarks measured for their resource (the time is not the bytes': a cost per call
    that grows with the micro-batch), or a fixed cost of over 20 copy latencies and 100 µs (an
    intercept extrapolated from large copies). Such a line holds between the sizes it was
    fitted on; another model's copies, larger or smaller, are priced off it (on an H200 a
    line through Mixtral's KVOut priced DeepSeek-V2-Lite's 8x too long)."""
    base, out = tasks.base_cost, []
    for kind, smp in tasks.samples.items():
        resource = RESOURCES[smp.resource]
        if resource not in COPIES:
            continue
        rate, latency = base.byte_rate[smp.resource] / 1e9, base.overhead[smp.resource] * 1e6
        if kind in gbps and gbps[kind] < rate / 10:
            out.append(f"{kind}'s bytes were fitted at {gbps[kind]:.2f} GB/s, under a tenth of "
                       f"the {resource} copies measured ({rate:.1f} GB/s): its time is not its "
                       "bytes', and copies of other sizes are priced off the line")
        if fixed[kind] > max(20 * latency, 100.0):
            out.append(f"{kind}'s fixed cost was fitted at {fixed[kind]:.0f} µs, "
                       f"{fixed[kind] / max(latency, 1e-3):.0f}x the copy latency measured "
                       f"({latency:.1f} µs): small copies of it are priced that much")
    return out


def _finer(one: Scenario, factor: int = FINER) -> Scenario | None:
    """`one` with `factor` times the experts, each 1/factor the size, `factor` times as many a
    token and on the GPU: the same weights a token through more experts (None where the
    model's routing or widths do not split so, or its experts' 32-weight blocks would not)."""
    m, p = one.model, one.policy
    if m.h_i % factor or (m.bits("experts") < 16 and m.h_i // factor % 32):
        return None
    try:
        model = m.model_validate(m.model_dump() | {
            "E": m.E * factor, "k": m.k * factor, "h_i": m.h_i // factor})
    except ValueError:
        return None
    return one.model_copy(update={"model": model, "policy": p.model_copy(
        update={"experts_gpu": p.experts_gpu * factor})})


def _fit_expert_cost(x: np.ndarray, experts: np.ndarray, roof: np.ndarray, alone: np.ndarray
                     ) -> tuple[float, float, float]:
    """(fixed seconds, seconds per byte, seconds per expert) of a kind whose work is routed
    experts, from tasks of two expert sizes: at one size a task's experts and bytes rise
    together and no fit can tell what each costs. A line in both, refitted without the first
    fit's outliers, each coefficient >= 0; with none for the bytes, the roof prices them."""
    design = np.column_stack([np.ones_like(x), x, experts])
    keep = np.ones(len(x), dtype=bool)
    for _ in range(2):
        coef = _nonnegative_lstsq(design[keep], alone[keep])
        keep = _inliers(alone - design @ coef)
    if coef[1] > 0:
        return float(coef[0]), float(coef[1]), float(coef[2])
    fixed, per_expert = _nonnegative_lstsq(design[keep][:, [0, 2]], (alone - roof)[keep])
    return float(fixed), 0.0, float(per_expert)


def _inliers(resid: np.ndarray) -> np.ndarray:
    """Residuals within four robust standard deviations (1.4826 MAD) of their median."""
    mid = np.median(resid)
    return np.abs(resid - mid) <= 4 * 1.4826 * np.median(np.abs(resid - mid)) + 1e-15


def _fit_slowdown(samples: dict[str, _Samples]) -> dict[str, dict[str, float]]:
    """Per compute resource, one factor a_g per group of :data:`AGGRESSORS` with ``measured /
    alone - 1 = sum a_g f_g`` (f_g: the summed busy shares of the group's resources) by least
    squares over its tasks. ``alone`` is each kind's cost fitted first on its tasks that ran with
    every other resource (nearly) idle, then, alternating with the factors, on all its tasks with
    the slowdown divided out (tasks "nearly" alone were slowed a little too). Outliers of a fit
    are left out of the next (a task the OS preempts takes several times as long, and a few of
    those would decide a least-squares fit), so are groups that overlapped these tasks too
    little to tell (under 5 tasks' worth); factors are kept non-negative."""
    groups = np.zeros((len(RESOURCES), len(AGGRESSORS)))
    for g, members in enumerate(AGGRESSORS):
        for name in members:
            groups[RESOURCES.index(name), g] = 1.0
    out = {}
    for r in SLOWED:
        kinds = [s for s in samples.values()
                 if RESOURCES[s.resource] == r and s.calm().sum() >= 10]
        if not kinds:
            continue
        design = np.concatenate([s.array("busy") for s in kinds]) @ groups
        cols = [g for g in range(len(AGGRESSORS)) if design[:, g].sum() >= 5]
        factors = np.zeros(len(RESOURCES))
        for round_ in range(3):
            ratio = []
            for s in kinds:
                x, roof, y = s.array("nbytes"), s.array("roof"), s.array("measured")
                fit_on = s.calm() if round_ == 0 else np.ones(len(y), dtype=bool)
                fixed_s, slope = _fit_cost(x[fit_on], roof[fit_on],
                                           (y / s.slowed(factors))[fit_on])
                ratio.append(y / (fixed_s + (x * slope if slope > 0 else roof)) - 1)
            ratio = np.concatenate(ratio)
            keep = np.ones(len(ratio), dtype=bool)
            for _ in range(3):                 # refit without the outliers of the last fit
                coef = _nonnegative_lstsq(design[keep][:, cols], ratio[keep])
                keep = _inliers(ratio - design[:, cols] @ coef)
            per_group = np.zeros(len(AGGRESSORS))
            per_group[cols] = coef
            factors = groups @ per_group
        out[r] = {name: round(float(factors[i]), 4) for i, name in enumerate(RESOURCES)
                  if factors[i] > 0 and name != r}
    return out


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: columns whose coefficient comes out negative
    are dropped (set to 0) and the rest refitted."""
    coef = np.zeros(a.shape[1])
    cols = list(range(a.shape[1]))
    while cols:
        c = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (c >= 0).all():
            coef[cols] = c
            break
        cols = [i for i, x in zip(cols, c) if x >= 0]
    return coef


def _handoff_gaps(prog, run) -> list[float]:
    """Start minus predecessor end, for tasks whose start waited on another stream's task."""
    gaps = []
    stream = prog.column("stream")
    last_end: dict[int, float] = {}
    for t, base in zip(prog.seg_template, prog.seg_base):
        tpl = prog.templates[t]
        for pos, rels in enumerate(tpl.deps):
            gid = int(base) + pos
            sid = int(stream[gid])
            prev = last_end.get(sid, 0.0)
            last_end[sid] = run.end[gid]
            if not rels or np.isnan(run.start[gid]):
                continue
            dep = max(run.end[gid + r] for r in rels)
            if dep > prev:                     # the other stream, not this one, held it back
                gaps.append(run.start[gid] - dep)
    return gaps


@dataclass
class Calibration(Shown):
    """A hardware profile measured on this machine and where it was written; `to_dict()` is
    `tg calibrate --json`."""

    profile: dict[str, Any]
    measured: dict[str, Any]
    out: str

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "measured": self.measured, "out": self.out}

    def views(self):
        yield calibrate_table(self.measured, self.out)
        yield from warnings_of(self.measured)


def calibrate_to(scenario: Scenario, out: str, device: str = "cpu",
                 progress: Callable[[int, int], None] | None = None) -> Calibration:
    """`tg calibrate`: measure this machine and write the profile to `out` (YAML, whole or not
    at all). `progress(done, total)` after each microbenchmark and the executor's runs."""
    import yaml

    from taskgraph.exec.microbench import STEPS
    from taskgraph.files import atomic_path

    steps = [*STEPS[device], "executor tasks"]
    profile, measured = calibrate(scenario, device, progress=lambda what: progress and progress(
        steps.index(what) + 1, len(steps)))
    what = "CPU backend" if device == "cpu" else "GPU and its host"
    with atomic_path(out) as tmp:
        tmp.write_text(
            f"# Written by `tg calibrate`: this machine's {what}. Use it with\n"
            f"# `hardware: {out}` in a scenario or `--set hardware={out}`.\n"
            + yaml.safe_dump(profile, sort_keys=False))
    return Calibration(profile, measured, str(out))


def calibrate(scenario: Scenario, device: str = "cpu",
              progress: Callable[[str], None] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hardware profile, measurements) for `device` ("cpu": the CPU backend, "cuda") here."""
    rates = measure(device, progress)
    base = base_profile(device, rates)
    if progress:
        progress("executor tasks")
    fit = fit_tasks(scenario, base, device)
    profile = base | {
        "handoff_us": round(fit.handoff_us, 2),
        "task_overhead_us": {k: round(v, 2) for k, v in sorted(fit.fixed_us.items())},
        "task_gbps": {k: round(v, 4) for k, v in sorted(fit.gbps.items())},
        "task_dequant_gweights": {k: round(v, 4) for k, v in sorted(
            fit.dequant_gweights.items()) if v is not None},
        "task_expert_us": {k: round(v, 2) for k, v in sorted(fit.expert_us.items())
                           if round(v, 2) > 0},
    } | ({"interference": {"slowdown": fit.slowdown}} if fit.slowdown else {})
    return profile, {"rates": rates, "fixed_us": fit.fixed_us, "task_gbps": fit.gbps,
                     "handoff_us": fit.handoff_us, "slowdown": fit.slowdown, "tasks": fit.tasks,
                     "dequant_gweights": fit.dequant_gweights, "expert_us": fit.expert_us,
                     "warnings": fit.findings}
