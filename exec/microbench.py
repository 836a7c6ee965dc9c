"""Microbenchmarks for `tg calibrate`: the rates a hardware profile holds, measured on this machine.

Each is taken at a size where it is a rate, not an overhead: a large matrix multiply (FLOP/s), a
large copy (memory bandwidth), decode attention over a long context (the bandwidth CPU attention
achieves), copies the size of weight pages (the link), and a tiny copy (the link's latency).

On the CPU backend the "GPU" is this CPU too, every op runs on one thread (as the executor runs
it), and a transfer is a memcpy. On CUDA, GPU work is timed with CUDA events, host work with a
monotonic clock; link bandwidths are measured from pinned and from pageable host memory, and the
profile takes the pinned figures (the executor's staging, KV and activation buffers are pinned).
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Callable

import torch

Progress = Callable[[str], None]

#: What each device's measurement reports through `progress`, in order.
STEPS = {
    "cpu": ("matrix multiply", "memory bandwidth", "attention", "copies"),
    "cuda": ("matrix multiply", "memory bandwidth", "attention", "copies", "launches"),
}


def best_time(fn: Callable[[], Any], repeat: int = 5) -> float:
    """Seconds of the fastest of `repeat` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(device: str, progress: Progress | None = None) -> dict[str, float]:
    """The rates of :data:`STEPS` for `device` ("cpu" or "cuda")."""
    say = progress or (lambda _: None)
    return measure_cuda_rates(say) if device == "cuda" else measure_rates(say)


def measure_rates(progress: Progress | None = None) -> dict[str, float]:
    """CPU backend: FLOP/s, memory, attention and memcpy bandwidth (bytes/s), copy latency, each
    on one thread as the executor's CPU backend runs every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _host_rates(progress or (lambda _: None))
    finally:
        torch.set_num_threads(threads)


def _host_rates(say: Progress, pinned_dst: bool = False) -> dict[str, float]:
    from taskgraph.kernels.ops import decode_attention

    out: dict[str, float] = {}
    say("matrix multiply")
    a, b = torch.randn(1024, 2048), torch.randn(2048, 2048)
    out["gemm_flops"] = 2 * 1024 * 2048 * 2048 / best_time(lambda: a @ b)
    say("memory bandwidth")
    src = torch.randn(32 * 1024 * 1024)            # 128 MB
    dst = torch.empty_like(src)
    out["mem_bytes_per_s"] = 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src))
    say("attention")
    q, k = torch.randn(32, 32, 128), torch.randn(32, 1024, 8, 128)
    v = torch.randn_like(k)
    out["attn_bytes_per_s"] = 2 * k.numel() * 4 / best_time(lambda: decode_attention(q, k, v))
    say("copies")
    page = torch.randn(4 * 1024 * 1024)             # 16 MB, a weight page
    dst = torch.empty(page.shape, dtype=page.dtype, pin_memory=pinned_dst)
    out["memcpy_bytes_per_s"] = page.numel() * 4 / best_time(lambda: dst.copy_(page))
    tiny_src, tiny_dst = torch.randn(16), torch.empty(16)
    out["copy_latency_s"] = best_time(lambda: tiny_dst.copy_(tiny_src), repeat=50)
    return out


def measure_cuda_rates(say: Progress) -> dict[str, float]:
    """CUDA: GPU FLOP/s and memory bandwidth, the host's (all threads: CPU attention and the
    pinned memcpy use every core), and both link directions from pinned and pageable memory."""
    cuda = torch.cuda
    out: dict[str, float] = {}

    def gpu_time(fn: Callable[[], Any], repeat: int = 5) -> float:
        fn()
        best = float("inf")
        for _ in range(repeat):
            start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    say("matrix multiply")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    out["gpu_gemm_flops"] = 2 * 4096 ** 3 / gpu_time(lambda: a @ a)
    say("memory bandwidth")
    big = torch.empty(256 * 1024 * 1024, device="cuda", dtype=torch.uint8)   # 256 MB
    other = torch.empty_like(big)
    out["gpu_mem_bytes_per_s"] = 2 * big.numel() / gpu_time(lambda: other.copy_(big))
    say("attention")
    host = _host_rates(lambda _: None, pinned_dst=True)   # on every core, as CPU attention runs
    out["cpu_gemm_flops"] = host["gemm_flops"]
    out["attn_bytes_per_s"] = host["attn_bytes_per_s"]
    out["memcpy_bytes_per_s"] = host["memcpy_bytes_per_s"]          # pageable -> pinned
    say("copies")
    # Pinned: 64 MB, a few weight pages. Pageable: 1 GB, as schedules without staging copy
    # whole layers; the driver stages such a copy through its own small pinned buffer, and on an
    # H100 host 64 MB crossed at 18.8 GB/s where a 2.9 GB Mixtral layer took 7 GB/s.
    for kind, pin, n in (("pinned", True, 64 << 20), ("pageable", False, 1 << 30)):
        h = torch.ones(n, dtype=torch.uint8, pin_memory=pin)     # ones: pages really mapped
        d = torch.empty(n, dtype=torch.uint8, device="cuda")
        out[f"h2d_{kind}_bytes_per_s"] = n / gpu_time(lambda: d.copy_(h, non_blocking=pin))
        out[f"d2h_{kind}_bytes_per_s"] = n / gpu_time(lambda: h.copy_(d, non_blocking=pin))
    h, d = torch.empty(4, pin_memory=True), torch.empty(4, device="cuda")
    out["copy_latency_s"] = gpu_time(lambda: d.copy_(h, non_blocking=True), repeat=50)
    say("launches")
    x = torch.zeros(1, device="cuda")
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(1000):
        x.add_(1)
    out["launch_s"] = (time.perf_counter() - t) / 1000      # host side: what a task pays per op
    cuda.synchronize()
    return out


def base_profile(device: str, rates: dict[str, float]) -> dict[str, Any]:
    """The `hardware:` mapping of a scenario from `device`'s rates, before the executor's tasks
    are fitted: peaks are the measured rates and every efficiency is 1."""
    host_gb = round(_memory_gb(), 1)
    cpu_name = platform.processor() or platform.machine()
    when = f"{platform.node()} on {time.strftime('%Y-%m-%d %H:%M')}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return {
            "name": f"{props.name} with {cpu_name} ({os.cpu_count()} cores)",
            "calibrated": f"{when} (CUDA)",
            "gpu": {"name": props.name, "count": 1,
                    "memory_gb": round(props.total_memory / 1e9, 1),
                    "mem_gbps": round(rates["gpu_mem_bytes_per_s"] / 1e9, 1),
                    "tflops": round(rates["gpu_gemm_flops"] / 1e12, 2), "flops_eff": 1.0,
                    "mem_eff": 1.0, "task_overhead_us": round(rates["launch_s"] * 1e6, 2)},
            "cpu": _cpu(cpu_name, host_gb, rates, rates["cpu_gemm_flops"]),
            "link": {"h2d_gbps": round(rates["h2d_pinned_bytes_per_s"] / 1e9, 3),
                     "d2h_gbps": round(rates["d2h_pinned_bytes_per_s"] / 1e9, 3),
                     "h2d_eff": 1.0, "d2h_eff": 1.0,
                     "latency_us": round(rates["copy_latency_s"] * 1e6, 2),
                     "pageable_h2d_gbps": round(rates["h2d_pageable_bytes_per_s"] / 1e9, 3)},
        }
    link = round(rates["memcpy_bytes_per_s"] / 1e9, 3)
    tflops = round(rates["gemm_flops"] / 1e12, 5)
    return {
        "name": f"CPU backend on {cpu_name} ({os.cpu_count()} cores)",
        "calibrated": f"{when} (CPU backend)",
        "gpu": {"name": "CPU (executes the GPU streams)", "count": 1, "memory_gb": host_gb,
                "usable_fraction": 0.8, "mem_gbps": round(rates["mem_bytes_per_s"] / 1e9, 3),
                "tflops": tflops, "flops_eff": 1.0, "mem_eff": 1.0, "task_overhead_us": 0.0},
        "cpu": _cpu(cpu_name, host_gb, rates, rates["gemm_flops"]),
        "link": {"h2d_gbps": link, "d2h_gbps": link, "h2d_eff": 1.0, "d2h_eff": 1.0,
                 "latency_us": round(rates["copy_latency_s"] * 1e6, 2)},
    }


def _cpu(name: str, memory_gb: float, rates: dict[str, float], flops: float) -> dict[str, Any]:
    return {"name": name, "cores": os.cpu_count() or 1, "memory_gb": memory_gb,
            "usable_fraction": 0.8, "mem_gbps": round(rates["attn_bytes_per_s"] / 1e9, 3),
            "tflops": round(flops / 1e12, 5), "flops_eff": 1.0, "mem_eff": 1.0,
            "memcpy_gbps": round(rates["memcpy_bytes_per_s"] / 1e9, 3), "task_overhead_us": 0.0}


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 16.0
