"""The one cost model: task work -> time on a hardware profile (docs/design.md §3.4).

A compute task at a level takes its roofline time, ``max(F / P, B / BW)`` with achieved (peak x
efficiency) FLOP rate and memory bandwidth, plus a fixed per-task overhead (kernel launches,
thread hand-off). A transfer takes ``bytes / (link bandwidth x efficiency)`` plus the link's
latency. The pinned staging copy is bound by host memcpy bandwidth. On a multi-GPU machine every
GPU and its link are resources of their own, priced at one GPU's rates (a task there is one
GPU's shard of the work), and a ring collective crosses the interconnect, paying its latency at
each of its 2 (n - 1) steps. Each GPU has a process of its own, whose host work (``cpu``, ``pin``)
runs on its threads: its share of the host's cores, or the implementation's ``rank_threads``,
whichever is fewer, each thread driving at most ``cpu.core_gbps`` of memory traffic.

What the processes and links share beyond the cores (``hardware.shared``: host memory bandwidth,
the PCIe lanes upstream of the links) are *pools*: :meth:`CostModel.pool_bytes` says what each
task draws from each, and the simulator divides a pool among the tasks drawing on it at once
(:mod:`taskgraph.sim.contention`). Without a shared memory figure a process gets its share of
the host's memory bandwidth and copy rate outright, so the host's totals are today's.

The HRM bound of a decode layer (Eq. 12-14) is ``max(comm_CPU->GPU, T_cpu, T_gpu)``: each term the
time the layer's tasks need on that resource, which no overlap can beat. It is computed from the
same per-task times the simulator uses, so ``simulated >= bound`` is a theorem, not a hope.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from taskgraph.dag.schedules import RESOURCES, SCHEDULES
from taskgraph.kinds import KIND_INDEX, KINDS, SENDS
from taskgraph.presets import IMPLEMENTATIONS
from taskgraph.specs import HardwareSpec, ImplementationSpec, Scenario

#: What the GPUs of one host share (hardware.shared): host memory bandwidth, and the PCIe lanes
#: upstream of the GPUs' links, each direction.
POOLS: tuple[str, ...] = ("host_memory", "pcie_h2d", "pcie_d2h")
POOL_NAMES = {"host_memory": "host memory", "pcie_h2d": "shared PCIe CPU->GPU",
              "pcie_d2h": "shared PCIe GPU->CPU"}


#: Tensor parallelism's expert part unpacks a shard's experts with decode's PostAttn kernel
#: (in prefill too), so where no figure of its own is given it takes PostAttn's: one GPU, where
#: `tg calibrate` measures, and `tg fit`'s one-GPU cells cannot time it apart.
DEQUANT_AS = {"MoE": "PostAttn"}

#: The copies into an expert cache: a cache that swaps (ImplementationSpec.expert_swaps) writes
#: an evicted expert back for each of them.
SWAPPED = ("ExpertIn", "ExpertAhead")


class CostModel:
    """Per-resource achieved rates of a hardware profile, in the order of ``RESOURCES``."""

    def __init__(self, hw: HardwareSpec, impl: ImplementationSpec | None = None,
                 expert_bits: float = 16.0, expert_bytes: float | None = None):
        g, c, k = hw.gpu, hw.cpu, hw.link
        impl = impl or ImplementationSpec(name="ideal")
        peer = hw.interconnect
        peer_rate, peer_latency = ((peer.gbps * 1e9 * peer.eff, peer.latency_us) if peer else
                                   (k.d2h_gbps * 1e9 * k.d2h_eff, k.latency_us))
        # A process's host threads (one process per GPU) and what they reach.
        self.processes = g.count
        fair = c.cores / g.count
        self.process_cores = (min(impl.rank_threads or fair, fair) if g.count > 1
                              else min(impl.threads or c.cores, c.cores))
        share = self.process_cores / c.cores
        # Host memory priced as shared: a process may burst to the host's rates and the
        # contention solver divides them; else each process owns its share outright. One
        # process alone on the host reaches its memory with fewer threads than cores (each
        # thread's rate, core_gbps, is the limit there); only its arithmetic is theirs alone.
        outright = 1.0 if hw.shared.memory_gbps or g.count == 1 else share
        cpu_bw, copy_bw = c.mem_gbps * 1e9 * c.mem_eff * outright, c.memcpy_gbps * 1e9 * outright
        if c.core_gbps is not None:
            cpu_bw = min(cpu_bw, self.process_cores * c.core_gbps * 1e9)
            copy_bw = min(copy_bw, self.process_cores * c.core_gbps * 1e9 / 2)
        rates = {
            # resource: (FLOP/s, bytes/s, fixed seconds per task)
            "gpu": (g.tflops * 1e12 * g.flops_eff, g.mem_gbps * 1e9 * g.mem_eff,
                    g.task_overhead_us * 1e-6),
            "cpu": (c.tflops * 1e12 * c.flops_eff * share, cpu_bw, c.task_overhead_us * 1e-6),
            "h2d": (math.inf, k.h2d_gbps * 1e9 * k.h2d_eff, k.latency_us * 1e-6),
            "d2h": (math.inf, k.d2h_gbps * 1e9 * k.d2h_eff, k.latency_us * 1e-6),
            "pin": (math.inf, copy_bw, c.task_overhead_us * 1e-6),
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
        self.implementation = impl
        several = impl.several_gpus_kinds if g.count > 1 else {}
        effects = [several.get(kind) or impl.kinds.get(kind) for kind in KINDS]
        # The kernel a kind runs for experts that see more than one token each: the rates
        # KindEffect.several_tokens sets, over the kind's own.
        multi = [e.model_copy(update={name: getattr(e.several_tokens, name)
                                      for name in e.several_tokens.model_fields_set})
                 if e and e.several_tokens else e for e in effects]
        self.kind_multi = np.array([bool(e and e.several_tokens) for e in effects])
        self.expert_bits = expert_bits
        self.kind_flops_eff = np.array([e.flops_eff if e else 1.0 for e in effects])
        self.kind_bytes_eff = np.array([e.bytes_eff if e else 1.0 for e in effects])
        self.multi_flops_eff = np.array([m.flops_eff if m else 1.0 for m in multi])
        self.multi_bytes_eff = np.array([m.bytes_eff if m else 1.0 for m in multi])
        # Seconds a kind spends unpacking each byte of experts stored below 16 bits (0: none);
        # a kind without a rate of its own runs the kernel of the kind in DEQUANT_AS
        own = {kind: hw.task_dequant_gweights.get(kind, e.dequant_gweights if e else None)
               for kind, e in zip(KINDS, effects)}
        rates = [own[kind] if own[kind] is not None or kind not in DEQUANT_AS
                 else own[DEQUANT_AS[kind]] for kind in KINDS]
        self.kind_dequant = np.array([8 / expert_bits / (r * 1e9) if r and expert_bits < 16
                                      else 0.0 for r in rates])
        # Seconds each routed expert a task touches adds beyond its bytes (its own operators,
        # dispatched expert by expert), per byte of the experts' weights (`expert_bytes`, one
        # expert as stored): a task's bytes count its experts. Added to the roofline, not under
        # it: dispatch does not overlap the products.
        self.kind_expert = np.array([hw.task_expert_us.get(kind, 0.0) * 1e-6 / expert_bytes
                                     if expert_bytes else 0.0 for kind in KINDS])
        self.kind_extra = np.array([e.overhead_us * 1e-6 if e else 0.0 for e in effects])
        self.kind_i_half = np.array([e.intensity_half if e else 0.0 for e in effects])
        self.kind_serial = np.array([bool(e and e.serial) for e in effects])
        self.multi_serial = np.array([bool(m and m.serial) for m in multi])
        # the copies from pageable memory: the driver stages each through its pinned buffer
        pageable = [kind for kind, unpinned in (("D3", impl.pageable_weights),
                                                ("D4", impl.pageable_kv_cache))
                    if unpinned and k.pageable_h2d_gbps is not None]
        for kind in pageable:          # no faster than the link itself (one set slower)
            self.kind_byte_rate[KIND_INDEX[kind]] = min(k.pageable_h2d_gbps * 1e9,
                                                        self.byte_rate[RESOURCES.index("h2d")])
        # The share of a kind's time on its stream spent copying the other way (GPU->CPU):
        # a swapping cache's write-backs (the experts block and a trace's link counters say it).
        self.kind_written_back = np.zeros(len(KINDS))
        if impl.expert_swaps:
            # Every copy into the cache, on a miss or ahead of one, evicts an expert and copies
            # it out after, on the same stream: the two in series.
            out = self.byte_rate[RESOURCES.index("d2h")]
            for copy in SWAPPED:
                into = self.kind_byte_rate[KIND_INDEX[copy]]
                into = self.byte_rate[RESOURCES.index("h2d")] if np.isnan(into) else into
                self.kind_byte_rate[KIND_INDEX[copy]] = 1.0 / (1.0 / into + 1.0 / out)
                self.kind_written_back[KIND_INDEX[copy]] = into / (into + out)
        self._pools(hw, pageable, impl.expert_swaps)
        # (resource, kind) -> what `times_of` prices a task at
        self._rates: dict[tuple[int, int], tuple[bool, Any, Any, Any]] = {}

    def _pools(self, hw: HardwareSpec, pageable: list[str], expert_swaps: bool) -> None:
        """Capacities of the shared pools (bytes/s, inf: not shared) and, per (resource, kind),
        the bytes a task draws from each pool per byte it moves."""
        sh = hw.shared
        self.pool_capacity = np.array([(x or math.inf) * 1e9 for x in
                                       (sh.memory_gbps, sh.pcie_gbps, sh.pcie_gbps)])
        f = np.zeros((len(POOLS), len(RESOURCES), len(KINDS)))
        mem, up, down = range(len(POOLS))
        r = {name: RESOURCES.index(name) for name in RESOURCES}
        f[mem, r["cpu"]] = 1.0          # a host task's bytes are its memory traffic
        f[mem, r["pin"]] = 2.0          # a copy reads and writes every byte
        f[[mem, up], r["h2d"]] = 1.0    # DMA reads host memory, crosses the lanes
        f[[mem, down], r["d2h"]] = 1.0
        for kind in pageable:           # the driver copies each byte into its pinned buffer
            f[mem, r["h2d"], KIND_INDEX[kind]] = 3.0
        if expert_swaps:                # the evicted expert is written back across the lanes
            for copy in SWAPPED:
                f[mem, r["h2d"], KIND_INDEX[copy]] = 2.0
                f[down, r["h2d"], KIND_INDEX[copy]] = 1.0
        if hw.interconnect is not None and hw.interconnect.through_host:
            # A collective's bytes are what each GPU sends; every GPU sends and receives them
            # through host memory (written, read back). A send goes from one GPU to one.
            n = hw.gpu.count
            senders = np.array([1.0 if kind in SENDS else n for kind in KINDS])
            f[mem, r["peer"]] = 2 * senders
            f[up, r["peer"]] = senders
            f[down, r["peer"]] = senders
        self.pool_factor = f
        self.pooled = np.flatnonzero(np.isfinite(self.pool_capacity))   # the pools priced

    @property
    def pools_shared(self) -> bool:
        """Whether any pool is priced (a finite capacity)."""
        return bool(np.isfinite(self.pool_capacity).any())

    def pool_bytes(self, resource: np.ndarray | int, kind: np.ndarray | int,
                   nbytes: np.ndarray) -> np.ndarray:
        """(pools x tasks): the bytes each task draws from each shared pool (tasks given as
        arrays of resource and kind indexes and bytes, or one task's, its bytes any shape)."""
        f = self.pool_factor[:, resource, kind]
        return f.reshape(f.shape + (1,) * (np.ndim(nbytes) - f.ndim + 1)) * nbytes

    def fixed(self, resource: np.ndarray | int, kind: np.ndarray | int) -> np.ndarray:
        """Fixed seconds per task: the kind's own if the profile has one, else the resource's,
        plus the implementation's."""
        own = self.kind_overhead[kind]
        return np.where(np.isnan(own), self.overhead[resource], own) + self.kind_extra[kind]

    def byte_rates(self, resource: np.ndarray | int, kind: np.ndarray | int,
                   several: np.ndarray | bool = False) -> np.ndarray:
        """Bytes a second a task of `kind` moves: its rate, slowed by unpacking the weights
        (`several`: its experts see more than one token each)."""
        own = self.kind_byte_rate[kind]
        eff = np.where(several, self.multi_bytes_eff[kind], self.kind_bytes_eff[kind])
        rate = np.where(np.isnan(own), self.byte_rate[resource], own) * eff
        return rate / (1.0 + rate * self.kind_dequant[kind])

    def flops_rates(self, resource: np.ndarray | int, kind: np.ndarray | int,
                    several: np.ndarray | bool = False) -> np.ndarray:
        return self.flops_rate[resource] * np.where(several, self.multi_flops_eff[kind],
                                                    self.kind_flops_eff[kind])

    def time(self, resource: str, flops: float, nbytes: float, kind: str | None = None) -> float:
        """Seconds one task takes on `resource`."""
        i = RESOURCES.index(resource)
        if kind is None:
            return max(flops / self.flops_rate[i], nbytes / self.byte_rate[i]) + self.overhead[i]
        return float(self.times(i, flops, nbytes, KIND_INDEX[kind]))

    def times_of(self, resource: int, kind: int, flops: np.ndarray, nbytes: np.ndarray
                 ) -> np.ndarray:
        """:meth:`times` for one resource and kind (indexes), their rates looked up once: the
        same seconds, for the prediction's many small calls."""
        key = (resource, kind)
        rates = self._rates.get(key)
        if rates is None:
            # a kind whose kernel depends on its tokens takes the general path, as skinny does
            skinny = bool(self.kind_i_half[kind] > 0 or self.kind_multi[kind])
            combine = np.add if self.kind_serial[kind] else np.maximum
            rates = self._rates[key] = (skinny, combine, self.flops_rates(resource, kind),
                                        self.byte_rates(resource, kind),
                                        self.fixed(resource, kind), self.kind_expert[kind])
        skinny, combine, flops_rate, byte_rate, fixed, per_expert_byte = rates
        if skinny:
            return self.times(resource, flops, nbytes, kind)
        # no skinniness: `times` divides the bytes by the byte rate times ones
        return (combine(flops / flops_rate, nbytes / byte_rate) + fixed
                + nbytes * per_expert_byte)

    def times(self, resource: np.ndarray | int, flops: np.ndarray, nbytes: np.ndarray,
              kind: np.ndarray | int) -> np.ndarray:
        """Seconds per task, vectorised over arrays (or scalars) of resource indexes, work and
        kind indexes: the roofline at the implementation's rates (the sum of its two terms for a
        kind whose arithmetic does not hide under its reads) plus fixed costs."""
        i_half = self.kind_i_half[kind]
        with np.errstate(divide="ignore", invalid="ignore"):
            intensity = np.where(nbytes > 0, flops / np.maximum(nbytes, 1e-30), np.inf)
            # only products lose to skinniness; a copy (no FLOPs) has no intensity to speak of
            skinny = np.where((i_half > 0) & (flops > 0), intensity / (intensity + i_half), 1.0)
        kernel = self._kernel(resource, kind, flops, nbytes, skinny, False)
        multi = self.kind_multi[kind] & (flops > 0)
        if np.any(multi):
            # An expert's FLOPs per byte of its weights are its tokens x 16 / bits. The experts
            # that see one token run the kind's own kernel, the rest its other one: their share
            # of the task's experts (bytes) and of its tokens (FLOPs), for a mean of m tokens.
            m = np.where(multi, intensity * self.expert_bits / 16, 1.0)
            one = one_token_share(m)
            one_flops, one_bytes = flops * one / m, nbytes * one
            split = (self._kernel(resource, kind, one_flops, one_bytes, skinny, False)
                     + self._kernel(resource, kind, flops - one_flops, nbytes - one_bytes,
                                    skinny, True))
            kernel = np.where(multi, split, kernel)
        return kernel + self.fixed(resource, kind) + nbytes * self.kind_expert[kind]

    def _kernel(self, resource: np.ndarray | int, kind: np.ndarray | int, flops: np.ndarray,
                nbytes: np.ndarray, skinny: np.ndarray, several: bool) -> np.ndarray:
        """Seconds of a task's arithmetic and reads on the kind's kernel (`several`: the one
        it runs for experts that see more than one token): the larger, or their sum."""
        arithmetic = flops / self.flops_rates(resource, kind, several)
        reads = nbytes / (self.byte_rates(resource, kind, several) * skinny)
        serial = self.multi_serial[kind] if several else self.kind_serial[kind]
        return np.where(serial, arithmetic + reads, np.maximum(arithmetic, reads))


# A touched expert's tokens taken as a zero-truncated Poisson count: for its mean
# m = lambda / (1 - e^-lambda), the share that see exactly one is m e^-lambda.
_LAMBDA = np.geomspace(1e-6, 80.0, 2000)
_MEAN = _LAMBDA / -np.expm1(-_LAMBDA)
_ONE = _MEAN * np.exp(-_LAMBDA)


def one_token_share(mean_tokens: np.ndarray) -> np.ndarray:
    """The share of the experts a task touches that see one token, where they see
    `mean_tokens` on average (1: all of them; it falls smoothly towards 0 as the mean grows,
    so a kind's two kernels meet without a step at any batch)."""
    return np.interp(mean_tokens, _MEAN, _ONE, left=1.0, right=0.0)


def implementation_for(scenario: Scenario, schedule: str) -> ImplementationSpec:
    """The scenario's implementation, or the one `schedule` stands for by default."""
    if scenario.implementation is not None:
        return scenario.implementation
    return ImplementationSpec.model_validate(IMPLEMENTATIONS[SCHEDULES[schedule].implementation])


def cost_model(scenario: Scenario, schedule: str) -> CostModel:
    """The cost model a simulation of `schedule` in `scenario` runs on: the scenario's machine,
    priced for the implementation that runs it. A schedule whose weights cross from pinned
    memory (staging buffers, or a pinned host copy) does so whatever the software's habit."""
    impl = implementation_for(scenario, schedule)
    if SCHEDULES[schedule].weights_pinned and impl.pageable_weights:
        impl = impl.model_copy(update={"pageable_weights": False})
    m = scenario.model
    return CostModel(scenario.hardware, impl, m.bits("experts"), m.expert_bytes)


def hrm_bound(decode_busy_s: dict[str, float], layers: int) -> tuple[float, str]:
    """Per-layer HRM lower bound in seconds, and the resource that sets it, from the total time
    each resource must spend on decode work over `layers` layer executions."""
    binding = max(decode_busy_s, key=decode_busy_s.__getitem__)
    return decode_busy_s[binding] / layers, binding
