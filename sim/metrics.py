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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from taskgraph.compiled import KIND_NAMES
from taskgraph.cost import hrm_bound
from taskgraph.limits import hardware_limit_tok_s
from taskgraph.memory import MemoryReport
from taskgraph.schedules import RESOURCES
from taskgraph.sim.engine import SimRun


def summarize(run: SimRun, memory: MemoryReport) -> dict[str, Any]:
    """The result object of one simulated run."""
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
    window_busy = dict(busy)
    device = prog.device
    for d, (r, _gpu) in enumerate(dict.fromkeys(prog.stream_device)):
        mine = (device == d) & done
        busy[r] += float(run.durations[mine].sum()) / _instances(prog, r)
        window_busy[r] = max(window_busy[r], _busy_between(run.start[mine], run.end[mine],
                                                           prefill_end, makespan))
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
        "efficiency": _r(bound_s / layer_s if layer_s else 0.0),
        "utilization": {r: _r(busy[r] / makespan if makespan else 0.0) for r in busy},
        "memory": {"gpu_peak_gb": _r(memory.gpu_peak_gb), "cpu_peak_gb": _r(memory.cpu_peak_gb),
                   "gpu_usable_gb": _r(memory.gpu_capacity / memory.gpu_count / 1e9),
                   "cpu_usable_gb": _r(memory.cpu_capacity / 1e9)},
        "steps": steps_done,
        "layers": L,
        "tasks": int(done.sum()),
        "interrupted": run.interrupted,
        "wall_s": round(run.wall_s, 3),
    }


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
