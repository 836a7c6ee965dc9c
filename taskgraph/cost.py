"""The one cost model: task work -> time on a hardware profile (SPEC 3.4).

A compute task at a level takes its roofline time, ``max(F / P, B / BW)`` with achieved (peak x
efficiency) FLOP rate and memory bandwidth, plus a fixed per-task overhead (kernel launches,
thread hand-off). A transfer takes ``bytes / (link bandwidth x efficiency)`` plus the link's
latency. The pinned staging copy is bound by host memcpy bandwidth. On a multi-GPU machine every GPU and
its link are resources of their own, priced at one GPU's rates (a task there is one GPU's shard
of the work); the host's cores and memory copies serve them all, and a ring collective crosses
the interconnect, paying its latency at each of its 2 (n - 1) steps.

The HRM bound of a decode layer (Eq. 12-14) is ``max(comm_CPU->GPU, T_cpu, T_gpu)``: each term the
time the layer's tasks need on that resource, which no overlap can beat. It is computed from the
same per-task times the simulator uses, so ``simulated >= bound`` is a theorem, not a hope.
"""

from __future__ import annotations

import math

import numpy as np

from taskgraph.schedules import RESOURCES
from taskgraph.specs import HardwareSpec, ImplementationSpec, Scenario
from taskgraph.work import KINDS

KIND_INDEX = {k: i for i, k in enumerate(KINDS)}


class CostModel:
    """Per-resource achieved rates of a hardware profile, in the order of ``RESOURCES``."""

    def __init__(self, hw: HardwareSpec, impl: ImplementationSpec | None = None):
        g, c, k = hw.gpu, hw.cpu, hw.link
        peer = hw.interconnect
        peer_rate, peer_latency = ((peer.gbps * 1e9 * peer.eff, peer.latency_us) if peer else
                                   (k.d2h_gbps * 1e9 * k.d2h_eff, k.latency_us))
        rates = {
            # resource: (FLOP/s, bytes/s, fixed seconds per task)
            "gpu": (g.tflops * 1e12 * g.flops_eff, g.mem_gbps * 1e9 * g.mem_eff,
                    g.task_overhead_us * 1e-6),
            "cpu": (c.tflops * 1e12 * c.flops_eff, c.mem_gbps * 1e9 * c.mem_eff,
                    c.task_overhead_us * 1e-6),
            "h2d": (math.inf, k.h2d_gbps * 1e9 * k.h2d_eff, k.latency_us * 1e-6),
            "d2h": (math.inf, k.d2h_gbps * 1e9 * k.d2h_eff, k.latency_us * 1e-6),
            "pin": (math.inf, c.memcpy_gbps * 1e9, c.task_overhead_us * 1e-6),
            "peer": (math.inf, peer_rate, 2 * (g.count - 1) * peer_latency * 1e-6),
        }
        self.hardware = hw
        self.flops_rate = np.array([rates[r][0] for r in RESOURCES])
        self.byte_rate = np.array([rates[r][1] for r in RESOURCES])
        self.overhead = np.array([rates[r][2] for r in RESOURCES])
        # Per task kind (index into KINDS): its own fixed cost and bandwidth, NaN for the
        # resource's.
        self.kind_overhead = np.array([hw.task_overhead_us.get(k, np.nan) * 1e-6 for k in KINDS])
        self.kind_byte_rate = np.array([hw.task_gbps.get(k, np.nan) * 1e9 for k in KINDS])
        for send in ("Send", "SendTokens"):       # one hop, not a ring
            if np.isnan(self.kind_overhead[KIND_INDEX[send]]):
                self.kind_overhead[KIND_INDEX[send]] = peer_latency * 1e-6
        self.handoff = hw.handoff_us * 1e-6
        # The implementation's share of those rates, and its own fixed cost, per kind.
        impl = impl or ImplementationSpec(name="ideal")
        self.implementation = impl
        effects = [impl.kinds.get(kind) for kind in KINDS]
        self.kind_flops_eff = np.array([e.flops_eff if e else 1.0 for e in effects])
        self.kind_bytes_eff = np.array([e.bytes_eff if e else 1.0 for e in effects])
        self.kind_extra = np.array([e.overhead_us * 1e-6 if e else 0.0 for e in effects])
        self.kind_i_half = np.array([e.intensity_half if e else 0.0 for e in effects])
        if impl.pageable_weights and k.pageable_h2d_gbps is not None:
            self.kind_byte_rate[KIND_INDEX["D3"]] = k.pageable_h2d_gbps * 1e9

    def fixed(self, resource: np.ndarray | int, kind: np.ndarray | int) -> np.ndarray:
        """Fixed seconds per task: the kind's own if the profile has one, else the resource's,
        plus the implementation's."""
        own = self.kind_overhead[kind]
        return np.where(np.isnan(own), self.overhead[resource], own) + self.kind_extra[kind]

    def byte_rates(self, resource: np.ndarray | int, kind: np.ndarray | int) -> np.ndarray:
        own = self.kind_byte_rate[kind]
        return np.where(np.isnan(own), self.byte_rate[resource], own) * self.kind_bytes_eff[kind]

    def flops_rates(self, resource: np.ndarray | int, kind: np.ndarray | int) -> np.ndarray:
        return self.flops_rate[resource] * self.kind_flops_eff[kind]

    def time(self, resource: str, flops: float, nbytes: float, kind: str | None = None) -> float:
        """Seconds one task takes on `resource`."""
        i = RESOURCES.index(resource)
        if kind is None:
            return max(flops / self.flops_rate[i], nbytes / self.byte_rate[i]) + self.overhead[i]
        return float(self.times(i, flops, nbytes, KIND_INDEX[kind]))

    def times(self, resource: np.ndarray | int, flops: np.ndarray, nbytes: np.ndarray,
              kind: np.ndarray | int) -> np.ndarray:
        """Seconds per task, vectorised over arrays (or scalars) of resource indexes, work and
        kind indexes: the roofline at the implementation's rates plus fixed costs."""
        i_half = self.kind_i_half[kind]
        with np.errstate(divide="ignore", invalid="ignore"):
            intensity = np.where(nbytes > 0, flops / np.maximum(nbytes, 1e-30), np.inf)
            # only products lose to skinniness; a copy (no FLOPs) has no intensity to speak of
            skinny = np.where((i_half > 0) & (flops > 0), intensity / (intensity + i_half), 1.0)
        return (np.maximum(flops / self.flops_rates(resource, kind),
                           nbytes / (self.byte_rates(resource, kind) * skinny))
                + self.fixed(resource, kind))


def implementation_for(scenario: Scenario, schedule: str) -> ImplementationSpec:
    """The scenario's implementation, or the one `schedule` stands for by default."""
    from taskgraph.presets import IMPLEMENTATIONS
    from taskgraph.schedules import SCHEDULES

    if scenario.implementation is not None:
        return scenario.implementation
    return ImplementationSpec.model_validate(IMPLEMENTATIONS[SCHEDULES[schedule].implementation])


def cost_model(scenario: Scenario, schedule: str) -> CostModel:
    """The cost model a simulation of `schedule` in `scenario` runs on: the scenario's machine,
    priced for the implementation that runs it. A schedule that stages weights through pinned
    buffers (W_CtoPin) copies them from pinned memory whatever the software's habit."""
    from taskgraph.schedules import SCHEDULES

    impl = implementation_for(scenario, schedule)
    if SCHEDULES[schedule].staging and impl.pageable_weights:
        impl = impl.model_copy(update={"pageable_weights": False})
    return CostModel(scenario.hardware, impl)


def hrm_bound(decode_busy_s: dict[str, float], layers: int) -> tuple[float, str]:
    """Per-layer HRM lower bound in seconds, and the resource that sets it, from the total time
    each resource must spend on decode work over `layers` layer executions."""
    binding = max(decode_busy_s, key=decode_busy_s.__getitem__)
    return decode_busy_s[binding] / layers, binding
