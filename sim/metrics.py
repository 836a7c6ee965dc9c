"""What a run means: the figures of the `tg simulate` and `tg execute` JSON (docs/design.md §5).

One definition of the phases, for simulated and executed runs alike:

* ``prefill_s``: from the start of the run until the last prefill *compute* task (step 0, on the
  gpu or cpu resource) ends: when every prompt has been through every layer and has its first
  token. Prefill copies still draining after that (the last layer's KV going to the host) belong
  to the decode window below.
* ``decode_s``: the rest of the run, ``makespan_s - prefill_s``.
* ``overlap_s``: how long decode work ran *before* prefill ended: from the first decode task's
  start (usually the first decode layer's weight prefetch, which can begin as soon as the link
  and a staging buffer are free) to the end of prefill; 0 if decode started after. That work is
  in neither phase's time; it is what overlapping the phases saved.
* ``decode_layer_ms``: ``decode_s`` over the decode layers run (steps x layers).
* ``hrm_layer_ms``: the HRM bound over the same window: the busiest resource's busy time inside
  the decode window, over the same layers. A resource runs one task at a time, so its busy time
  inside a window cannot exceed the window, and ``decode_layer_ms >= hrm_layer_ms`` holds for
  every run, simulated or measured. Work done before the window (the prefetch counted in
  ``overlap_s``) is excluded from both figures alike.
* ``shared``: for each pool of what the GPUs of a host share (host memory bandwidth, the PCIe
  lanes upstream of the links; :mod:`taskgraph.sim.contention`), what share of each phase its
  capacity was in use, and ``bound_by``, what binds each phase: the resource or pool busiest in
  it. A pool's busy time is the bytes drawn from it inside the window over its capacity, so it
  takes part in the HRM bound like a resource.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from taskgraph.dag.compiled import Program
from taskgraph.dag.schedules import PLACED, RESOURCES
from taskgraph.kinds import KIND_NAMES
from taskgraph.perf.cost import POOLS, CostModel, hrm_bound
from taskgraph.perf.limits import hardware_limit_tok_s
from taskgraph.perf.memory import MemoryReport
from taskgraph import placement
from taskgraph.placement import llama_cpp_options
from taskgraph.sim.engine import Recorder, SimRun


class Totals:
    """A run's figures accumulated block by block (the engine's :class:`Recorder` order), so that
    a run's memory does not grow with its length: per resource instance its busy time and the
    work done in each phase's window, per shared pool the bytes drawn in each, and the phase
    boundaries. The prefill's end splits the windows; every prefill task is in the run's first
    segment, so it is known after the first block, or, if no prefill compute task finished (Ctrl-C
    during prefill), at the end (the makespan), the few tasks done by then waiting till then."""

    def __init__(self, program: Program, cost: CostModel | None):
        self.program, self.cost = program, cost
        self.devices = len(dict.fromkeys(program.stream_device))
        self.pools = ([p for p, c in enumerate(cost.pool_capacity) if np.isfinite(c)]
                      if cost is not None and cost.pools_shared else [])
        self.tasks = self.post_done = 0
        self.makespan, self.first_decode = 0.0, np.inf
        self.prefill_end: float | None = None
        self.busy = np.zeros(self.devices)
        # Of the busy time, the seconds copies spent writing back the other way on their
        # stream (CostModel.kind_written_back: a swapping expert cache's evicted experts)
        self.written_back = 0.0
        self.swaps = cost is not None and bool(cost.kind_written_back.any())
        self.work = np.zeros((2, self.devices))          # (prefill, decode) x device
        self.drawn = np.zeros((2, len(POOLS)))           # (prefill, decode) x pool
        self.waiting: list[tuple] = []                   # done tasks before the prefill's end
        # A measured run (no cost model) counts busy time as the union of its tasks' intervals
        # (two streams of a resource may overlap on a device): its tasks, kept to the end.
        self.intervals: list[tuple] = []

    @classmethod
    def of(cls, run: SimRun, cost: CostModel | None) -> Totals:
        """The totals of a run held whole."""
        totals = cls(run.program, cost)
        totals.add(run.program, run.start, run.end, run.durations)
        return totals.finish()

    def add(self, part: Program, start: np.ndarray, end: np.ndarray,
            durations: np.ndarray) -> None:
        """The next block of the run: `part` of the program and its tasks' times (NaN: did not
        run). Everything is worked out before any total changes, so that a Ctrl-C during it
        leaves the totals without the block rather than with part of it."""
        done = ~np.isnan(end)
        if not done.any():         # (after Ctrl-C: the rest of the run, quickly)
            return
        step, device = part.step, part.device
        prefill_end = self.prefill_end
        if prefill_end is None and part.first_segment == 0:
            resource = part.column("resource")
            compute = np.isin(resource, [RESOURCES.index("gpu"), RESOURCES.index("cpu")])
            prefill = done & (step == 0) & compute
            if prefill.any():
                prefill_end = float(end[prefill].max())
        decode = done & (step >= 1)
        first_decode = float(start[decode].min()) if decode.any() else np.inf
        last = KIND_NAMES.index("MoE" if part.plan.tp > 1 else "PostAttn")
        post_done = int((decode & (part.column("kind") == last)).sum())
        busy = np.bincount(device[done], durations[done], minlength=self.devices)
        written_back = (float(durations[done] @ self.cost.kind_written_back[
            part.column("kind")[done]]) if self.swaps else 0.0)
        if self.cost is None:
            waiting = (device[done], start[done], end[done])
        else:
            # The bound takes each task at its own cost, before what it overlapped slowed it
            # (interference, shared pools): the HRM's time of each resource alone.
            alone = part.durations(self.cost)[done]
            drawn = part.pool_bytes(self.cost)[:, done] if self.pools else None
            waiting = (device[done], start[done], end[done], alone, drawn)
        self.prefill_end = prefill_end
        self.first_decode = min(self.first_decode, first_decode)
        self.post_done += post_done
        self.tasks += int(done.sum())
        self.makespan = max(self.makespan, float(end[done].max()))
        self.busy += busy
        self.written_back += written_back
        if self.cost is None:
            self.intervals.append(waiting)
            return
        self.waiting.append(waiting)
        if self.prefill_end is not None:
            self._spread()

    def _spread(self) -> None:
        """Split the work of the tasks waiting between the two windows (worked out whole, then
        kept: a Ctrl-C during it must not count a task twice)."""
        work, drawn_in = self.work.copy(), self.drawn.copy()
        for device, start, end, alone, drawn in self.waiting:
            length = end - start
            after = np.clip(end - np.maximum(start, self.prefill_end), 0.0, None)
            share = np.divide(after, length, out=np.zeros_like(after), where=length > 0)
            before = np.where(length > 0, 1.0 - share, 0.0)
            for w, part in enumerate((before, share)):
                work[w] += np.bincount(device, alone * part, minlength=self.devices)
                if drawn is not None:
                    drawn_in[w] += drawn @ part
        self.work, self.drawn, self.waiting = work, drawn_in, []

    def finish(self) -> Totals:
        if self.prefill_end is None:
            self.prefill_end = self.makespan
        self._spread()
        if self.intervals:
            device, start, end = (np.concatenate(c) for c in zip(*self.intervals))
            for d in range(self.devices):
                mine = device == d
                for w, (lo, hi) in enumerate(((0.0, self.prefill_end),
                                              (self.prefill_end, self.makespan))):
                    self.work[w, d] = _busy_between(start[mine], end[mine], lo, hi)
            self.intervals = []
        return self


class Summarizing(Recorder):
    """A recorder for a run too long to hold whole: it accumulates the run's :class:`Totals`
    and keeps the task times of its first `keep` segments only (what a trace or a chart of the
    first steps draws)."""

    def __init__(self, program: Program, cost: CostModel, keep: int):
        self.whole, self.keep = program, keep
        self.totals = Totals(program, cost)
        self.kept: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def block(self, part: Program, start: np.ndarray, end: np.ndarray,
              durations: np.ndarray) -> None:
        self.totals.add(part, start, end, durations)
        if part.first_segment < self.keep:
            n = part.part(0, min(self.keep - part.first_segment, len(part.seg_template))).total
            self.kept.append((start[:n], end[:n], durations[:n]))

    def result(self, interrupted: bool, wall_s: float) -> SimRun:
        kept = self.whole.part(0, min(self.keep, len(self.whole.seg_template)))
        start, end = np.full(kept.total, np.nan), np.full(kept.total, np.nan)
        durations = np.zeros(kept.total)
        lo = 0
        for times in self.kept:                # none if Ctrl-C came before the run began
            hi = lo + len(times[0])
            start[lo:hi], end[lo:hi], durations[lo:hi] = times
            lo = hi
        return SimRun(kept, durations, start, end, interrupted, wall_s,
                      totals=self.totals.finish())


def summarize(run: SimRun, memory: MemoryReport, cost: CostModel | None = None,
              hardware_limit: bool = True) -> dict[str, Any]:
    """The result object of one simulated run (or executed: its times measured). With the
    `cost` model that priced it, the host's shared pools are reported too. `hardware_limit`:
    the modelled machine's limit and the run's share of it (an executed run leaves them out:
    it ran on another machine)."""
    prog = run.program
    plan, sc = prog.plan, prog.plan.scenario
    p = sc.policy
    G, L = plan.G, plan.L
    t = run.totals if run.totals is not None else Totals.of(run, cost)
    makespan, prefill_end = t.makespan, t.prefill_end
    overlap = max(0.0, prefill_end - t.first_decode) if np.isfinite(t.first_decode) else 0.0
    decode_s = makespan - prefill_end
    # A run stopped early (Ctrl-C) is measured on what it finished: whole decode layers (every
    # micro-batch's PostAttn done) and whole steps.
    layers_done, steps_done = G * L, G
    if run.interrupted:
        # (under tensor parallelism PostAttn runs as parts, the last of them the experts)
        layers_done = t.post_done // (plan.n * plan.tp)     # every GPU's shard
        steps_done = layers_done // L
    busy, prefill_busy, window_busy, shared = _busy(prog, t, cost, prefill_end, decode_s)
    bound_s, binding = hrm_bound(window_busy, max(layers_done, 1))
    layer_s = decode_s / max(layers_done, 1)
    throughput = p.N * steps_done / makespan if makespan else 0.0
    limit = hardware_limit_tok_s(sc) if hardware_limit else None
    return {
        "scenario": sc.name,
        "schedule": plan.schedule.name,
        "schedule_title": plan.schedule.title,
        "model": sc.model.name,
        "hardware": sc.hardware.name,
        "policy": _policy(plan),
        "model_size": sc.model.size(),
        "throughput_tok_s": _r(throughput),
        **({"hardware_limit_tok_s": _r(limit),
            # None where the weights leave no room for a KV cache
            "hardware_limit_fraction": _r(throughput / limit) if limit else None}
           if hardware_limit else {}),
        "prefill_s": _r(prefill_end),
        "decode_s": _r(decode_s),
        "overlap_s": _r(overlap),
        "makespan_s": _r(makespan),
        "decode_layer_ms": _r(layer_s * 1e3),
        # what one sequence sees: its first token at the end of prefill, then one a step
        "ttft_s": _r(prefill_end),
        "token_latency_ms": _r(decode_s / max(steps_done, 1) * 1e3),
        "hrm_layer_ms": _r(bound_s * 1e3),
        "hrm_binding": binding,
        "bound_by": {"prefill": max(prefill_busy, key=prefill_busy.__getitem__),
                     "decode": binding},
        "efficiency": _r(bound_s / layer_s if layer_s else 0.0),
        "utilization": {r: _r(busy[r] / makespan if makespan else 0.0) for r in busy},
        "shared": {pool: {"capacity_gbps": _r(float(cost.pool_capacity[POOLS.index(pool)]) / 1e9),
                          "prefill": _r(pre / prefill_end if prefill_end else 0.0),
                          "decode": _r(dec / decode_s if decode_s else 0.0)}
                   for pool, (pre, dec) in shared.items()},
        "memory": {"gpu_peak_gb": _r(memory.gpu_peak_gb), "cpu_peak_gb": _r(memory.cpu_peak_gb),
                   "gpu_usable_gb": _r(memory.gpu_capacity / memory.gpu_count / 1e9),
                   "cpu_usable_gb": _r(memory.cpu_capacity / 1e9)},
        **({"experts": experts_summary(plan, t if cost is not None else None)}
           if plan.schedule.expert_level else {}),
        "steps": steps_done,
        "layers": L,
        "tasks": t.tasks,
        "interrupted": run.interrupted,
        "wall_s": round(run.wall_s, 3),
    }


def _policy(plan) -> dict[str, Any]:
    """The policy's fields the schedule reads."""
    p = plan.scenario.policy
    return {"N": p.N, "mu": p.mu, "A_g": p.A_g, "F_g": p.F_g, "r_w": p.r_w, "r_c": p.r_c,
            **({"experts_gpu": p.experts_gpu} if plan.schedule.expert_level
               and not placement.given(p) else {}),
            **{f: getattr(p, f) for f in PLACED
               if plan.schedule.reads(f) and getattr(p, f) is not None},
            **({"eviction": p.eviction} if plan.schedule.ffn == "cache" else {}),
            **({"prefetch": p.prefetch_right} if plan.work.prefetches else {})}


def _busy(prog, t: Totals, cost: CostModel | None, prefill_end: float, decode_s: float
          ) -> tuple[dict, dict, dict, dict]:
    """Each resource's busy seconds over the run, and in prefill and the decode window; and
    each shared pool's seconds in those two windows."""
    # Per resource: on a multi-GPU machine, every GPU (and its link) is a resource of its own;
    # utilization is their mean and the HRM bound the busiest of them.
    busy = {r: 0.0 for r in _reported(prog)}
    window_busy, prefill_busy = dict(busy), dict(busy)
    for d, (r, _gpu) in enumerate(dict.fromkeys(prog.stream_device)):
        busy[r] += float(t.busy[d]) / _instances(prog, r)
        prefill_busy[r] = max(prefill_busy[r], float(t.work[0, d]))
        window_busy[r] = max(window_busy[r], float(t.work[1, d]))
    # Per shared pool: seconds of its capacity the tasks drew on in each window (bytes drawn
    # inside it, spread evenly over each task's run, over the capacity), at most the window.
    shared = {}
    for i in t.pools:
        capacity = cost.pool_capacity[i]
        shared[POOLS[i]] = (min(t.drawn[0, i] / capacity, prefill_end),
                            min(t.drawn[1, i] / capacity, decode_s))
    for pool, (pre, dec) in shared.items():
        prefill_busy[pool], window_busy[pool] = pre, dec
    return busy, prefill_busy, window_busy, shared


def experts_summary(plan, priced: Totals | None = None) -> dict[str, Any]:
    """Which experts a decode step touches (taskgraph.dag.routing), for the expert-level
    schedules: distinct experts a micro-batch routes to in a layer (mean and spread), and the
    share held on the GPU: EP's placed experts' share of the token-expert pairs, EC's cache hit
    rate layer by layer. With the totals of a priced (simulated) run, a cache's share of the run
    its copy stream spent writing evicted experts back (0 where the cache drops them)."""
    work, p = plan.work, plan.scenario.policy
    routing = work.routing
    out = {"routing": plan.scenario.workload.routing.kind,
           "distinct_per_layer": _r(float(routing.distinct(p.mu))),
           "distinct_std": _r(routing.distinct_std(p.mu))}
    if plan.schedule.ffn == "split":
        share, on_gpu, on_cpu = routing.split(p.mu, routing.on_gpu(plan.held))
        m = plan.scenario.model
        per_layer = [len(row) for row in plan.held]
        options, meaning = llama_cpp_options(per_layer, m)
        # a dense layer has no experts to place: None
        out.update(gpu_share=_r(share), distinct_on_gpu=_r(float(on_gpu)),
                   distinct_on_cpu=_r(float(on_cpu)), on_gpu=sum(per_layer),
                   on_gpu_by_layer=[None if m.is_dense(l) else n
                                    for l, n in enumerate(per_layer)],
                   llama_cpp=options, llama_cpp_means=meaning)
    else:
        hits, m = work.cache_hits(), plan.scenario.model
        moe = [float(h) for l, h in enumerate(hits) if not m.is_dense(l)]
        # a dense layer has no experts to cache: None
        out.update(hit_rate=_r(float(np.mean(moe))),
                   hit_rate_by_layer=[None if m.is_dense(l) else _r(float(h))
                                      for l, h in enumerate(hits)])
        if priced is not None:
            # The share of the run its copy stream (h2d) spent writing evicted experts back,
            # GPU->CPU: utilization counts the stream busy, which it is. One GPU (EC/ECP).
            out["written_back"] = _r(priced.written_back / priced.makespan
                                     if priced.makespan else 0.0)
    return out


def _reported(prog) -> tuple[str, ...]:
    """The resources a result reports: all of them, the GPUs' interconnect only where there are
    several GPUs."""
    return tuple(r for r in RESOURCES if r != "peer" or prog.plan.gpus > 1)


def _instances(prog, resource: str) -> int:
    return sum(1 for r, _ in dict.fromkeys(prog.stream_device) if r == resource) or 1


def _busy_between(start: np.ndarray, end: np.ndarray, lo: float, hi: float) -> float:
    """Seconds inside [lo, hi] covered by at least one of the intervals: two streams sharing a
    resource (S4's weight and KV loads) may overlap on a real device, and count once."""
    s, e = np.clip(start, lo, hi), np.clip(end, lo, hi)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    covered = np.maximum.accumulate(e)
    before = np.concatenate(([lo], covered[:-1]))
    return float(np.maximum(0.0, e - np.maximum(s, before)).sum())


def _r(x: float) -> float:
    """Six significant digits: enough for any comparison, stable across platforms."""
    return float(f"{x:.6g}")
