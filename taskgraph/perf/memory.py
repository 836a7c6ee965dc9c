"""The one memory model (docs/design.md §3.5): what a plan keeps in GPU and CPU memory at its peak.

Buffers in these schedules are allocated once and reused (double-buffered weights, pinned staging
slots, KV prefetch slots), so the peak is the sum of the allocations, not a time-varying curve.
Used to reject policies that do not fit and to report peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from taskgraph import placement
from taskgraph.dag.schedules import PLACED
from taskgraph.errors import MemoryFitError

GB = 1e9


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per item in GPU memory (all GPUs together) and CPU memory, and usable capacity."""

    gpu: dict[str, float]
    cpu: dict[str, float]
    gpu_capacity: float          # planning headroom: memory x usable_fraction
    cpu_capacity: float
    gpu_count: int
    gpu_physical: float = np.inf  # what an explicit policy may use: memory - reserve
    cpu_physical: float = np.inf

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu.values())

    @property
    def gpu_peak_gb(self) -> float:
        """Per GPU: tensor parallelism splits every item evenly, pipeline stages hold equal
        shares."""
        return self.gpu_total / self.gpu_count / GB

    @property
    def cpu_peak_gb(self) -> float:
        return self.cpu_total / GB


def memory_footprint(plan) -> MemoryReport:
    """Peak GPU and CPU memory of a plan (a :class:`taskgraph.dag.builder.Plan`)."""
    sc, p = plan.scenario, plan.scenario.policy
    gpu, cpu = memory_items(sc, plan.schedule, p.N, p.mu, p.r_w, p.r_c, plan.layout.n_pages)
    hw = sc.hardware
    return MemoryReport(
        gpu=gpu, cpu=cpu,
        gpu_capacity=hw.gpu.memory_gb * GB * hw.gpu.usable_fraction * hw.gpu.count,
        cpu_capacity=hw.cpu.memory_gb * GB * hw.cpu.usable_fraction,
        gpu_count=hw.gpu.count,
        gpu_physical=(hw.gpu.memory_gb - hw.gpu.reserve_gb) * GB * hw.gpu.count,
        cpu_physical=(hw.cpu.memory_gb - hw.cpu.reserve_gb) * GB,
    )


def memory_items(sc, schedule, N, mu, r_w, r_c, n_pages):
    """GPU and CPU bytes per item for a scenario's model and workload under `schedule` with the
    given policy numbers. `N` and `n_pages` may be NumPy arrays (the policy search evaluates a
    whole column of batch sizes at once); every item is then an array too."""
    m, w = sc.model, sc.workload
    b = m.dtype_bytes
    prompt = w.context_prompt
    context = prompt + sc.decode_steps
    kv_all = N * kv_tokens(m, context) * m.kv_bytes_per_token
    # With the FFN on the CPU the experts never leave host memory; r_w covers the rest. A dense
    # layer lies wholly where the rest of a layer does.
    experts_on_cpu = m.E * m.expert_bytes if schedule.experts_on_host else 0
    # (layers, each one's bytes on the GPU's side) for the MoE layers and the dense ones
    extents = [(m.moe_layers, m.layer_bytes - experts_on_cpu)] + (
        [(m.dense_count, m.dense_layer_bytes)] if m.dense_count else [])
    streamed = (1 - r_w) * max(e for _, e in extents)      # the largest layer's, in a buffer

    # Pipeline stages and data-parallel GPUs each keep their own double buffer, activations
    # and KV slots; tensor parallelism splits one set across the GPUs. Data-parallel GPUs each
    # hold every resident weight and the embedding and LM head too.
    copies = sc.hardware.gpu.count if schedule.grouped else 1
    replicas = sc.hardware.gpu.count if schedule.parallel == "data" else 1
    # tensor parallelism over more GPUs than KV heads (or over MLA's latent): copies of them
    kv_copies = m.kv_copies(sc.hardware.gpu.count) if schedule.parallel == "tensor" else 1
    gpu = {
        "resident weights (r_w)": sum(r_w * n * e for n, e in extents) * replicas,
        "embedding + LM head": float(m.embed_bytes) * replicas,
        ("live weights (ZeRO-3)" if schedule.live_params else "weight double buffer"):
            np.minimum(2 * streamed, schedule.live_params * b or np.inf) * copies,
        "activations (one micro-batch)": _activations(m, mu, prompt) * copies,
        "hidden states (N sequences)": 2 * b * N * m.h,
        **_experts_on_gpu(sc, schedule, N, mu),
    }
    if schedule.parallel == "tensor" and sc.hardware.gpu.count > 1:
        # what each shard holds whole: every GPU past the first holds another copy, resident
        # (r_w) and in its double buffer
        whole = [(n, m.whole_on_every_gpu_bytes(dense))
                 for (n, _), dense in zip(extents, (False, True))]
        gpu["weights every GPU holds whole"] = (sc.hardware.gpu.count - 1) * (
            sum(r_w * n * e for n, e in whole) + 2 * (1 - r_w) * max(e for _, e in whole))
    if schedule.attention == "gpu":
        gpu["KV cache on GPU (r_c)"] = r_c * kv_all * kv_copies
        gpu["KV slots"] = float(schedule.kv_slots * mu * _longest(m, context)
                                * m.kv_bytes_per_token) * copies * kv_copies
    else:   # prefill's K,V pass through the slots on their way to the CPU cache
        gpu["KV slots"] = float(schedule.kv_slots * mu * prompt * m.kv_bytes_per_token
                                * kv_copies)
    cpu = {
        "weights (1 - r_w)": sum((1 - r_w) * n * e for n, e in extents),
        "KV cache (1 - r_c)": (1 - r_c) * kv_all * kv_copies,   # each GPU's heads, for its host
        "hidden-state buffers": 2 * b * N * (2 * m.h + m.kv_width),
    }
    if schedule.staging:
        cpu["pinned staging"] = schedule.pin_slots * streamed / np.maximum(n_pages, 1)
    if experts_on_cpu:
        # EP's placed experts live on the GPU only (llama.cpp's -ot buffers, Fiddler's
        # placement); a cache's experts are the host's, the cache holding copies
        on_gpu = placement.total_on_gpu(sc.policy, m) if schedule.ffn == "split" else 0
        cpu["experts (FFN on the CPU)"] = float((m.moe_layers * m.E - on_gpu) * m.expert_bytes)
        # a micro-batch's prompt tokens in and out of the CPU experts, in prefill
        cpu["expert FFN buffers"] = float(b * mu * prompt * (2 * m.h + 2 * m.k * m.h_i))
    return gpu, cpu


def _activations(m, mu, prompt: int) -> float:
    """One micro-batch's activations on a GPU: a decode step's or its prompt's, the larger."""
    b = m.dtype_bytes
    ffn = max(2 * m.k * m.h_i + 2 * m.shared_experts * (m.h_shared or 0), 2 * (m.h_dense or 0))
    decode = b * mu * (6 * m.h + m.kv_width + ffn + m.V)
    prefill = b * (mu * prompt * (6 * m.h + m.kv_width + ffn)
                   + mu * m.n_q * prompt * prompt)      # attention scores, not fused
    return float(max(decode, prefill))


def _experts_on_gpu(sc, schedule, N, mu) -> dict[str, float]:
    """What the expert-level schedules hold on the GPU besides: the experts the policy places
    or caches (taskgraph.placement), a cache's staging area and its prefetched experts."""
    if not schedule.expert_level:
        return {}
    m = sc.model
    items = {}
    placed = placement.total_on_gpu(sc.policy, m)
    if placed:
        field = placement.given(sc.policy) or "experts_gpu"
        items[("expert cache" if schedule.ffn == "cache" else "experts placed on the GPU")
              + f" ({field})"] = float(placed * m.expert_bytes)
    if schedule.ffn == "cache":
        # where a micro-batch's misses land before they run, one area for every layer (a
        # layer's copies start after the previous layer's experts ran): a decode micro-batch's
        # chosen experts at most; prefill's, more, pass through it in rounds
        items["expert staging (mu x k)"] = float(np.minimum(m.E, mu * m.k) * m.expert_bytes)
        if any(op.kind == "ExpertAhead" for op in schedule.decode):
            # the next layer's prefetched experts wait beside this layer's
            items["expert prefetch (N x k)"] = float(np.minimum(m.E, N * m.k) * m.expert_bytes)
    return items


def kv_tokens(model, context: int) -> int:
    """Tokens of K,V one sequence of `context` tokens keeps, summed over the layers: a sliding
    window layer keeps its window's."""
    if model.sliding_window is None:
        return model.L * context
    return sum(min(context, model.window(l) or context) for l in range(model.L))


def _longest(model, context: int) -> int:
    """The most tokens of K,V one layer of one sequence keeps."""
    return max(min(context, model.window(l) or context) for l in range(model.L))


#: How a placement of whole layers keeps fewer experts on the GPU, for messages (a count
#: a layer and a budget are lowered).
_FEWER_EXPERTS = {"cpu_moe": "raise policy.cpu_moe (more layers' experts on the CPU)",
                  "override_tensor": "send more layers' experts to the CPU "
                                     "(policy.override_tensor)"}


def check_fits(report: MemoryReport, schedule: str, planning: bool = False) -> list[str]:
    """Raise :class:`MemoryFitError` naming the binding constraint and by how much it is over.

    With ``planning`` (the policy search) the limit is the planning headroom, memory x
    usable_fraction. For an explicit policy it is the physical memory less its reserve: a policy
    that really ran must simulate. Between the two the policy runs, and the returned warnings
    say by how much it passes the headroom."""
    warnings = []
    for where, items, usable, physical, spec, knobs in (
        ("GPU", report.gpu, report.gpu_capacity, report.gpu_physical, "hardware.gpu",
         "policy.r_w, policy.mu or policy.r_c"),
        ("CPU", report.cpu, report.cpu_capacity, report.cpu_physical, "hardware.cpu",
         "policy.N or workload.gen_len, raise policy.r_w"),
    ):
        placing = [f for f in ("experts_gpu", *PLACED) if any(f"({f})" in i for i in items)]
        fewer = ""
        if placing and placing[0] in ("experts_gpu", "experts_total"):
            knobs = f"policy.{placing[0]}, " + knobs
        elif placing:
            fewer = _FEWER_EXPERTS[placing[0]][0].upper() + _FEWER_EXPERTS[placing[0]][1:] + "; "
        need = sum(items.values())
        cap, rule = ((usable, f"{spec}.memory_gb x {spec}.usable_fraction") if planning else
                     (physical, f"{spec}.memory_gb - {spec}.reserve_gb"))
        if need > cap:
            top = sorted(items.items(), key=lambda kv: -kv[1])[:3]
            listing = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in top)
            raise MemoryFitError(
                f"The policy does not fit in {where} memory with schedule {schedule}: it needs "
                f"{need / GB:.2f} GB but {cap / GB:.2f} GB is usable ({rule}), "
                f"{(need - cap) / GB:.2f} GB over. Largest items: "
                f"{listing}. {fewer}{'lower' if fewer else 'Lower'} {knobs}, or use a machine "
                f"with more {where} memory."
            )
        if need > usable:
            warnings.append(
                f"{where} memory: the policy needs {need / GB:.2f} GB, above the planning "
                f"headroom of {usable / GB:.2f} GB ({spec}.usable_fraction) by "
                f"{(need - usable) / GB:.2f} GB; it fits the {cap / GB:.2f} GB left after "
                f"{spec}.reserve_gb, so it runs, with little room to spare.")
    return warnings
