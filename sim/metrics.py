"""What a simulated run means: the figures of the `tg simulate` JSON contract (SPEC 5).

The decode phase starts when the first task of a decode step starts. Decode work that a schedule
prefetches during prefill (the first decode layer's weights stream in during the last prefill
layer) therefore falls inside it, which makes ``decode_layer_ms >= hrm_layer_ms`` exact: every
resource does all its decode work inside the decode window.
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
    resource = prog.column("resource")
    decode = step >= 1
    decode_start = float(np.nanmin(run.start[decode & done])) if (decode & done).any() else makespan
    decode_s = makespan - decode_start
    # A run stopped early (Ctrl-C) is measured on what it finished: whole decode layers (every
    # micro-batch's PostAttn done) and whole steps.
    layers_done, steps_done = G * L, G
    if run.interrupted:
        post = done & decode & (prog.column("kind") == KIND_NAMES.index("PostAttn"))
        layers_done = int(post.sum()) // plan.n
        steps_done = layers_done // L
    busy = {r: float(run.durations[(resource == i) & done].sum()) for i, r in enumerate(RESOURCES)}
    decode_busy = {r: float(run.durations[(resource == i) & decode & done].sum())
                   for i, r in enumerate(RESOURCES)}
    bound_s, binding = hrm_bound(decode_busy, max(layers_done, 1))
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
        "prefill_s": _r(decode_start),
        "decode_s": _r(decode_s),
        "makespan_s": _r(makespan),
        "decode_layer_ms": _r(layer_s * 1e3),
        "hrm_layer_ms": _r(bound_s * 1e3),
        "hrm_binding": binding,
        "efficiency": _r(bound_s / layer_s if layer_s else 0.0),
        "utilization": {r: _r(busy[r] / makespan if makespan else 0.0) for r in RESOURCES},
        "memory": {"gpu_peak_gb": _r(memory.gpu_peak_gb), "cpu_peak_gb": _r(memory.cpu_peak_gb),
                   "gpu_usable_gb": _r(memory.gpu_capacity / memory.gpu_count / 1e9),
                   "cpu_usable_gb": _r(memory.cpu_capacity / 1e9)},
        "steps": steps_done,
        "layers": L,
        "tasks": int(done.sum()),
        "interrupted": run.interrupted,
        "wall_s": round(run.wall_s, 3),
    }


def _r(x: float) -> float:
    """Six significant digits: enough for any comparison, stable across platforms."""
    return float(f"{x:.6g}")
