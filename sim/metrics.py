"""What a run means: the figures of the `tg simulate` and `tg execute` JSON (SPEC 5).

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

from taskgraph.compiled import KIND_NAMES
from taskgraph.cost import POOLS, CostModel, hrm_bound
from taskgraph.limits import hardware_limit_tok_s
from taskgraph.memory import MemoryReport
from taskgraph.schedules import RESOURCES
from taskgraph.sim.engine import SimRun


def summarize(run: SimRun, memory: MemoryReport, cost: CostModel | None = None
              ) -> dict[str, Any]:
    """The result object of one simulated run (or executed: its times measured). With the
    `cost` model that priced it, the host's shared pools are reported too."""
    prog = run.program
    plan, sc = prog.plan, prog.plan.scenario
    p = sc.policy
    G, L = plan.G, plan.L
    done = run.finished
    makespan = float(np.nanmax(run.end)) if done.any() else 0.0
    step = prog.step
    decode = step >= 1
    prefill_end, overlap = _phases(run, prog, done, makespan)
    decode_s = makespan - prefill_end
    # A run stopped early (Ctrl-C) is measured on what it finished: whole decode layers (every
    # micro-batch's PostAttn done) and whole steps.
    layers_done, steps_done = G * L, G
    if run.interrupted:
        # (under tensor parallelism PostAttn runs as parts, the last of them the experts)
        last = "MoE" if plan.tp > 1 else "PostAttn"
        post = done & decode & (prog.column("kind") == KIND_NAMES.index(last))
        layers_done = int(post.sum()) // (plan.n * plan.tp)     # every GPU's shard
        steps_done = layers_done // L
    # Per resource: on a multi-GPU machine, every GPU (and its link) is a resource of its own;
    # utilization is their mean and the HRM bound the busiest of them.
    busy = {r: 0.0 for r in _reported(prog)}
    window_busy, prefill_busy = dict(busy), dict(busy)
    device = prog.device
    # A simulated run's bound takes each task at its own cost, before what it overlapped
    # slowed it (interference, shared pools): the HRM's time of each resource alone.
    alone = prog.durations(cost) if cost is not None else None
    for d, (r, _gpu) in enumerate(dict.fromkeys(prog.stream_device)):
        mine = (device == d) & done
        busy[r] += float(run.durations[mine].sum()) / _instances(prog, r)
        for window, lo, hi in ((window_busy, prefill_end, makespan),
                               (prefill_busy, 0.0, prefill_end)):
            if alone is None:
                seconds = _busy_between(run.start[mine], run.end[mine], lo, hi)
            else:
                seconds = _work_between(run.start[mine], run.end[mine], alone[mine], lo, hi)
            window[r] = max(window[r], seconds)
    shared = _pools(run, cost, prefill_end, makespan) if cost is not None else {}
    for pool, (pre, dec) in shared.items():
        prefill_busy[pool], window_busy[pool] = pre, dec
    bound_s, binding = hrm_bound(window_busy, max(layers_done, 1))
    layer_s = decode_s / max(layers_done, 1)
    throughput = p.N * steps_done / makespan if makespan else 0.0
    limit = hardware_limit_tok_s(sc)
    return {
        "scenario": sc.name,
        "schedule": plan.schedule.name,
        "schedule_title": plan.schedule.title,
        "model": sc.model.name,
        "hardware": sc.hardware.name,
        "policy": {"N": p.N, "mu": p.mu, "A_g": p.A_g, "F_g": p.F_g, "r_w": p.r_w, "r_c": p.r_c},
        "throughput_tok_s": _r(throughput),
        "hardware_limit_tok_s": _r(limit),
        "hardware_limit_fraction": _r(throughput / limit),
        "prefill_s": _r(prefill_end),
        "decode_s": _r(decode_s),
        "overlap_s": _r(overlap),
        "makespan_s": _r(makespan),
        "decode_layer_ms": _r(layer_s * 1e3),
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
        "steps": steps_done,
        "layers": L,
        "tasks": int(done.sum()),
        "interrupted": run.interrupted,
        "wall_s": round(run.wall_s, 3),
    }


def _pools(run: SimRun, cost: CostModel, prefill_end: float, makespan: float
           ) -> dict[str, tuple[float, float]]:
    """Per shared pool: seconds of its capacity the tasks drew on in the prefill window and in
    the decode window (bytes drawn inside each, spread evenly over each task's run, over the
    capacity), at most the window itself."""
    if not cost.pools_shared:
        return {}
    drawn = run.program.pool_bytes(cost)
    ran = ~np.isnan(run.end)
    out = {}
    for p, pool in enumerate(POOLS):
        capacity = cost.pool_capacity[p]
        if np.isfinite(capacity):
            out[pool] = tuple(
                min(_work_between(run.start[ran], run.end[ran], drawn[p][ran], lo, hi)
                    / capacity, hi - lo)
                for lo, hi in ((0.0, prefill_end), (prefill_end, makespan)))
    return out


def _reported(prog) -> tuple[str, ...]:
    """The resources a result reports: all of them, the GPUs' interconnect only where there are
    several GPUs."""
    return tuple(r for r in RESOURCES if r != "peer" or prog.plan.gpus > 1)


def _instances(prog, resource: str) -> int:
    return sum(1 for r, _ in dict.fromkeys(prog.stream_device) if r == resource) or 1


def _phases(run: SimRun, prog, done: np.ndarray, makespan: float) -> tuple[float, float]:
    """(end of prefill, how long decode ran before it) as the module docstring defines them."""
    resource = prog.column("resource")
    compute = np.isin(resource, [RESOURCES.index("gpu"), RESOURCES.index("cpu")])
    prefill = done & (prog.step == 0) & compute
    end = float(np.nanmax(run.end[prefill])) if prefill.any() else makespan
    decode = done & (prog.step >= 1)
    first = float(np.nanmin(run.start[decode])) if decode.any() else end
    return end, max(0.0, end - first)


def _work_between(start: np.ndarray, end: np.ndarray, work: np.ndarray, lo: float,
                  hi: float) -> float:
    """Seconds of `work` done inside [lo, hi], each task's spread evenly over its run."""
    length = end - start
    inside = np.clip(np.minimum(end, hi) - np.maximum(start, lo), 0.0, None)
    share = np.divide(inside, length, out=np.zeros_like(inside), where=length > 0)
    return float((work * share).sum())


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
