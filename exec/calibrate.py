"""`tg calibrate`: measure what the cost model needs on this machine and write a hardware profile.

Rates come from microbenchmarks at sizes where they are rates, not overheads: a large matrix
multiply (FLOP/s), a large copy (memory bandwidth), decode attention over a long context (the
bandwidth CPU attention achieves), and copies the size of weight pages (the "link": on the CPU
backend a transfer is a memcpy). Fixed per-task costs are fitted from the executor's own measured
tasks, which include everything a microbenchmark leaves out (dispatch, Python, small-op
overheads): per resource, the median of measured time minus roofline time.

On the CPU backend the "GPU" is this CPU too: the profile describes the machine tg executes on.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Callable

import numpy as np
import torch

from taskgraph.cost import CostModel
from taskgraph.schedules import RESOURCES
from taskgraph.specs import HardwareSpec, Scenario


def best_time(fn: Callable[[], Any], repeat: int = 5) -> float:
    """Seconds of the fastest of `repeat` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_rates(progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Microbenchmarks: FLOP/s, memory, attention and memcpy bandwidth (bytes/s), copy latency."""
    say = progress or (lambda _: None)
    out: dict[str, float] = {}
    say("matrix multiply")
    a, b = torch.randn(1024, 2048), torch.randn(2048, 2048)
    out["gemm_flops"] = 2 * 1024 * 2048 * 2048 / best_time(lambda: a @ b)
    say("memory bandwidth")
    src = torch.randn(32 * 1024 * 1024)            # 128 MB
    dst = torch.empty_like(src)
    out["mem_bytes_per_s"] = 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src))
    say("attention")
    from taskgraph.kernels.ops import decode_attention

    q, k = torch.randn(32, 32, 128), torch.randn(32, 1024, 8, 128)
    v = torch.randn_like(k)
    out["attn_bytes_per_s"] = 2 * k.numel() * 4 / best_time(lambda: decode_attention(q, k, v))
    say("copies")
    page = torch.randn(4 * 1024 * 1024)             # 16 MB, a weight page
    dst = torch.empty_like(page)
    out["memcpy_bytes_per_s"] = page.numel() * 4 / best_time(lambda: dst.copy_(page))
    tiny_src, tiny_dst = torch.randn(16), torch.empty(16)
    out["copy_latency_s"] = best_time(lambda: tiny_dst.copy_(tiny_src), repeat=50)
    return out


def profile_from_rates(rates: dict[str, float], memory_gb: float,
                       fixed_us: dict[str, float] | None = None,
                       kind_gbps: dict[str, float] | None = None,
                       handoff_us: float = 0.0) -> dict[str, Any]:
    """A hardware profile (the `hardware:` mapping of a scenario) for the CPU backend."""
    name = f"CPU backend on {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    tflops = round(rates["gemm_flops"] / 1e12, 5)
    link = round(rates["memcpy_bytes_per_s"] / 1e9, 3)
    fixed = fixed_us or {}
    return {
        "name": name,
        "calibrated": f"{platform.node()} on {time.strftime('%Y-%m-%d %H:%M')} (CPU backend)",
        "gpu": {"name": "CPU (executes the GPU streams)", "count": 1, "memory_gb": memory_gb,
                "usable_fraction": 0.8, "mem_gbps": round(rates["mem_bytes_per_s"] / 1e9, 3),
                "tflops": tflops, "flops_eff": 1.0, "mem_eff": 1.0, "task_overhead_us": 0.0},
        "cpu": {"name": platform.processor() or platform.machine(), "cores": os.cpu_count() or 1,
                "memory_gb": memory_gb, "usable_fraction": 0.8,
                "mem_gbps": round(rates["attn_bytes_per_s"] / 1e9, 3), "tflops": tflops,
                "flops_eff": 1.0, "mem_eff": 1.0, "memcpy_gbps": link, "task_overhead_us": 0.0},
        "link": {"h2d_gbps": link, "d2h_gbps": link, "h2d_eff": 1.0, "d2h_eff": 1.0,
                 "latency_us": round(rates["copy_latency_s"] * 1e6, 2)},
        "handoff_us": round(float(handoff_us), 2),
        "task_overhead_us": {k: round(float(v), 2) for k, v in sorted(fixed.items())},
        "task_gbps": {k: round(float(v), 4) for k, v in sorted((kind_gbps or {}).items())},
    }


#: Policies the fit runs: several micro-batch sizes so that task sizes vary, and a CPU- and a
#: GPU-attention schedule so that every task kind is seen.
FIT_RUNS = tuple((schedule, mu) for schedule in ("S1", "S4") for mu in (1, 2, 4))


def fit_tasks(scenario: Scenario, rates: dict[str, float], memory_gb: float, repeats: int = 2
              ) -> tuple[dict[str, float], dict[str, float], float, dict[str, Any]]:
    """Per task kind, ``time = fixed + bytes / rate`` fitted by least squares to the executor's
    own measured tasks over :data:`FIT_RUNS`. Returns fixed costs (µs), rates (GB/s; only where
    task sizes varied enough to fit one), the hand-off time (µs: median delay between a task's
    end and the start of a task on another stream that was waiting for it) and per kind the
    samples' summary."""
    from taskgraph.compiled import KIND_NAMES
    from taskgraph.execution import execute_scenario
    from taskgraph.simulation import for_schedule

    base = CostModel(HardwareSpec.model_validate(profile_from_rates(rates, memory_gb)))
    samples: dict[str, list[tuple[float, float, float]]] = {}   # kind -> (bytes, base, measured)
    gaps: list[float] = []
    for schedule, mu in FIT_RUNS * repeats:      # medians over repeats: runs are noisy
        policy = scenario.policy.model_copy(update={"mu": mu, "N": mu * 4})
        sc, _ = for_schedule(scenario.model_copy(update={"policy": policy}), schedule)
        ex = execute_scenario(sc, schedule, device="cpu")
        prog, run = ex.program, ex.run
        ctx = prog.context(prog.step)
        nbytes = prog.column("nbytes") + prog.column("bytes_per_ctx") * ctx
        roof = prog.durations(base) - base.fixed(prog.column("resource"), prog.column("kind"))
        kinds = prog.column("kind")
        for i in np.flatnonzero(run.finished):
            samples.setdefault(KIND_NAMES[kinds[i]], []).append(
                (float(nbytes[i]), float(roof[i]), float(run.durations[i])))
        gaps += _handoff_gaps(prog, run)
    fixed, gbps, summary = {}, {}, {}
    for kind, rows in samples.items():
        x, roof, y = (np.array(c) for c in zip(*rows))
        slope = 0.0
        if x.std() > 0.05 * x.mean():        # sizes vary: fit a rate
            slope, intercept = np.polyfit(x, y, 1)
        if slope > 0:
            gbps[kind] = 1 / slope / 1e9
            fixed[kind] = max(0.0, float(np.median(y - x * slope)) * 1e6)
        else:                                  # one size: keep the measured roof, fit the rest
            fixed[kind] = max(0.0, float(np.median(y - roof)) * 1e6)
        summary[kind] = {"tasks": len(y), "median_us": float(np.median(y)) * 1e6}
    handoff = max(0.0, float(np.median(gaps)) * 1e6) if gaps else 0.0
    return fixed, gbps, handoff, summary


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


def calibrate(scenario: Scenario, progress: Callable[[str], None] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hardware profile, measurements) for the CPU backend on this machine."""
    memory_gb = round(_memory_gb(), 1)
    rates = measure_rates(progress)
    if progress:
        progress("executor tasks")
    fixed, gbps, handoff, per_kind = fit_tasks(scenario, rates, memory_gb)
    return profile_from_rates(rates, memory_gb, fixed, gbps, handoff), {
        "rates": rates, "fixed_us": fixed, "task_gbps": gbps, "handoff_us": handoff,
        "tasks": per_kind}


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 16.0
