"""What each task kind does: FLOPs and bytes (docs/design.md §3.3), and where a layer's weights
lie.

Work is affine in the context length ``s`` (tokens in a sequence's KV cache when the task runs,
on average over the micro-batch), ``flops + flops_per_ctx * s``, so one compiled step serves every
decode step. A micro-batch is ``mu`` sequences of the workload's mean prompt unless a
:class:`Load` says otherwise (a batch of real requests: how many are still generating, how many
prompt tokens they hold); its figures may be arrays, one per task. Bytes are those the
task moves through the memory of the device it runs on, or over the link for transfers, or through
host memory for the pinned staging copy. Durations are not here: the cost model turns work into
time for a hardware profile, and the executor measures it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Union

import numpy as np

from taskgraph.dag.routing import Routing
from taskgraph.kinds import EITHER_PHASE, SHARDED
from taskgraph.specs import ModelSpec, PolicySpec, WorkloadSpec

Number = Union[float, np.ndarray]


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes of one task, affine in the context length s."""

    flops: float = 0.0
    flops_per_ctx: float = 0.0
    bytes: float = 0.0
    bytes_per_ctx: float = 0.0

    def at(self, s: float) -> tuple[float, float]:
        return self.flops + self.flops_per_ctx * s, self.bytes + self.bytes_per_ctx * s


@dataclass(frozen=True)
class WeightLayout:
    """One layer's weights: sections qkv | o | router | experts in that order. The first
    ``r_w`` of the bytes stay on the GPU; the rest streams in ``n_pages`` equal pages."""

    model: ModelSpec
    r_w: float
    n_pages: int
    # False (FFN on the CPU): the experts never leave host memory; r_w and the pages cover the
    # rest of the layer (qkv | o | router).
    streams_experts: bool = True

    @property
    def extent_bytes(self) -> float:
        """The bytes of a layer that live on the GPU, resident or streamed."""
        m = self.model
        return m.layer_bytes if self.streams_experts else m.layer_bytes - m.E * m.expert_bytes

    @property
    def resident_bytes(self) -> float:
        return self.r_w * self.extent_bytes

    @property
    def streamed_bytes(self) -> float:
        return self.extent_bytes - self.resident_bytes

    @property
    def page_bytes(self) -> float:
        return self.streamed_bytes / self.n_pages if self.n_pages else 0.0

    def pages_for(self, section: str) -> range:
        """Pages that hold any byte of a section ('qkv', 'o', 'route', 'moe', 'post' or
        'all')."""
        return self._pages[section]

    @cached_property
    def _pages(self) -> dict[str, range]:
        return {section: self._pages_of(section)
                for section in ("qkv", "post", "route", "o", "moe", "all")}

    def _pages_of(self, section: str) -> range:
        if not self.n_pages:
            return range(0)
        m = self.model
        lo, hi = {"qkv": (0, m.qkv_bytes), "post": (m.qkv_bytes, m.layer_bytes),
                  "route": (m.qkv_bytes, m.qkv_bytes + m.o_bytes + m.router_bytes),
                  "o": (m.qkv_bytes, m.qkv_bytes + m.o_bytes),
                  "moe": (m.qkv_bytes + m.o_bytes, m.layer_bytes),
                  "all": (0, m.layer_bytes)}[section]
        lo, hi = max(lo, self.resident_bytes), min(hi, self.extent_bytes)
        if hi <= lo:
            return range(0)
        first = int((lo - self.resident_bytes) // self.page_bytes)
        last = int(-(-(hi - self.resident_bytes) // self.page_bytes))  # ceil
        return range(first, min(last, self.n_pages))


@dataclass(frozen=True)
class Load:
    """What one micro-batch holds (numbers or arrays of them, one per task): `seqs` sequences
    still generating, and for prefill `prompt_tokens` prompt tokens whose squares sum to
    `prompt_sq` (causal attention grows with each prompt's square). In a decode step of a
    continuous batch, `admitted` prompt tokens (squares summing to `admitted_sq`) of requests
    that just took a free slot are prefilled in the same tasks, on the GPU: their QKV and causal
    attention in PreAttn, their K,V to the CPU cache with the step's own, their FFN in PostAttn
    (MoE-Lens's prefill/decode overlap)."""

    seqs: Number
    prompt_tokens: Number
    prompt_sq: Number
    admitted: Number = 0.0
    admitted_sq: Number = 0.0


class TaskWork:
    """Work of every task kind for one model, policy and workload (docs/design.md §3.3). With
    `tp` GPUs in tensor parallel, a sharded kind's work is one GPU's shard: 1/tp of the task's FLOPs and
    bytes (weights, KV heads, experts' columns and the copies of them split evenly), but for
    the router, which every GPU runs whole."""

    def __init__(self, model: ModelSpec, policy: PolicySpec, workload: WorkloadSpec,
                 layout: WeightLayout, load: Load | None = None, tp: int = 1,
                 routing: Routing | None = None, ffn: str = "gpu", prefetches: bool = False):
        self.m, self.p, self.w, self.layout, self.tp = model, policy, workload, layout, tp
        self.ffn = ffn          # where the schedule runs the experts (Schedule.ffn)
        self.prefetches = prefetches    # ECP: the next layer's misses cross ahead
        p = workload.context_prompt
        self.load = load or Load(policy.mu, policy.mu * p, policy.mu * p * p)
        self.routing = routing or Routing.uniform(model)

    def with_load(self, load: Load) -> "TaskWork":
        return TaskWork(self.m, self.p, self.w, self.layout, load, self.tp, self.routing,
                        self.ffn, self.prefetches)

    def distinct(self, tokens: Number) -> Number:
        """Distinct experts `tokens` tokens route to in a layer (taskgraph.dag.routing)."""
        return self.routing.distinct(tokens)

    def of(self, kind: str, *, prefill: bool = False) -> Work:
        work = self._whole(kind, prefill)
        if self.tp == 1 or kind not in SHARDED:
            return work
        n, r = self.tp, self._replicated(kind, prefill)
        return Work((work.flops - r.flops) / n + r.flops, work.flops_per_ctx / n,
                    (work.bytes - r.bytes) / n + r.bytes, work.bytes_per_ctx / n)

    def _replicated(self, kind: str, prefill: bool) -> Work:
        """What every GPU's shard runs whole: the router (its weights and its product over the
        whole hidden state) in the MoE part. Norms are left out: h FLOPs a token."""
        if kind != "MoE":
            return Work()
        t = self.load.prompt_tokens if prefill else self.load.seqs + self.load.admitted
        return Work(flops=2 * t * self.m.h * self.m.E, bytes=self.m.router_bytes)

    def _whole(self, kind: str, prefill: bool) -> Work:
        if kind == "KVOut":
            # Prefill writes the prompt's K,V to the CPU; decode (GPU attention) one token's.
            tokens = self.load.prompt_tokens if prefill else self.load.seqs + self.load.admitted
            return Work(bytes=(1 - self.p.r_c) * tokens * self.m.kv_bytes_per_token)
        if kind in EITHER_PHASE:
            tokens = self.load.prompt_tokens if prefill else self.load.seqs + self.load.admitted
            if kind == "ExpertIn":
                return self._ExpertIn(tokens, prefill)
            return getattr(self, "_" + kind)(tokens)
        return getattr(self, "_" + kind)()

    # Decode, one micro-batch of `seqs` sequences, one layer.
    def _PreAttn(self) -> Work:
        m, b, new = self.m, self.m.dtype_bytes, self.load.admitted
        mu = self.load.seqs + new
        return Work(flops=2 * mu * m.h * (m.q_dim + 2 * m.h_kv)
                    + 2 * self.load.admitted_sq * m.q_dim,       # the admitted prompts' attention
                    bytes=m.qkv_bytes + b * mu * (m.h + m.q_dim + 2 * m.h_kv))

    def _D1(self) -> Work:
        m, b = self.m, self.m.dtype_bytes
        return Work(bytes=b * self.load.seqs * (m.q_dim + 2 * m.h_kv)
                    + b * self.load.admitted * 2 * m.h_kv)      # admitted prompts: K,V only

    def _CPUAttn(self) -> Work:
        m, mu, b = self.m, self.load.seqs, self.m.dtype_bytes
        return Work(flops_per_ctx=4 * mu * m.q_dim, bytes_per_ctx=2 * b * mu * m.h_kv,
                    bytes=b * mu * (2 * m.q_dim + 2 * m.h_kv))

    def _GPUAttn(self) -> Work:
        return self._CPUAttn()

    def _D2(self) -> Work:
        return Work(bytes=self.m.dtype_bytes * self.load.seqs * self.m.q_dim)

    def _D4(self) -> Work:
        # The part of the micro-batch's KV cache that is not kept on the GPU.
        m = self.m
        return Work(bytes_per_ctx=(1 - self.p.r_c) * self.load.seqs * m.kv_bytes_per_token)

    def _PostAttn(self) -> Work:
        m, b = self.m, self.m.dtype_bytes
        tokens = self.load.seqs + self.load.admitted
        return Work(
            flops=2 * tokens * m.q_dim * m.h + 2 * tokens * m.h * m.E
            + 6 * tokens * m.k * m.h * m.h_i,
            bytes=m.o_bytes + m.router_bytes + self.distinct(tokens) * m.expert_bytes
            + b * tokens * (4 * m.h + 2 * m.k * m.h_i),
        )

    def _LMHead(self) -> Work:
        m, mu, b = self.m, self.load.seqs, self.m.dtype_bytes
        return Work(flops=2 * mu * m.h * m.V, bytes=b * m.V * m.h + b * mu * (m.h + m.V))

    # FFN on the CPU (S5), over `t` tokens: the prompt's in prefill, one per sequence in decode.
    def _PrefillAttn(self, t: Number) -> Work:
        m, b = self.m, self.m.dtype_bytes
        return Work(flops=2 * t * m.h * (m.q_dim + 2 * m.h_kv) + 2 * self.load.prompt_sq * m.q_dim,
                    bytes=m.qkv_bytes + b * t * (2 * m.h + 2 * m.q_dim + 2 * m.h_kv))

    def _Route(self, t: Number) -> Work:
        m, b = self.m, self.m.dtype_bytes
        return Work(flops=2 * t * m.q_dim * m.h + 2 * t * m.h * m.E,
                    bytes=m.o_bytes + m.router_bytes + b * t * (m.q_dim + 3 * m.h))

    def _D5(self, t: Number) -> Work:
        # the normed hidden state, the k expert ids (int64) and gates
        return Work(bytes=t * (self.m.dtype_bytes * (self.m.h + self.m.k) + 8 * self.m.k))

    def _CPUFFN(self, t: Number) -> Work:
        share, _, distinct = self._placed(t)
        return self._experts(t, 1.0 - share, distinct)

    # Expert-level schedules (EP, EC): the experts the GPU holds, and a cache's misses.
    def _GPUFFN(self, t: Number) -> Work:
        if self.ffn == "split":
            share, distinct, _ = self._placed(t)
            return self._experts(t, share, distinct)
        return self._experts(t, 1.0, self.distinct(t))     # a cache: every chosen expert

    def _ExpertIn(self, t: Number, prefill: bool) -> Work:
        """The experts a layer's cache misses: in prefill (every expert chosen) those beyond
        the cache's; in decode the share a replay of the routing finds absent, less those a
        prefetch (ECP) brought in right."""
        distinct, cap = self.distinct(t), self.p.experts_gpu
        if prefill:
            return Work(bytes=np.maximum(distinct - cap, 0.0) * self.m.expert_bytes)
        ahead = self.p.prefetch if self.prefetches else 0.0
        return Work(bytes=self._misses(t) * (1.0 - ahead) * self.m.expert_bytes)

    def _ExpertAhead(self) -> Work:
        """One layer's prefetch (ECP): as many experts as its micro-batches will miss; the
        predictor's wrong guesses are copies wasted."""
        return Work(bytes=self.p.n_micro * self._misses(self.load.seqs) * self.m.expert_bytes)

    def _misses(self, t: Number) -> Number:
        return self.distinct(t) * (1.0 - float(np.mean(self.cache_hits())))

    def cache_hits(self) -> np.ndarray:
        """Per layer, the share of a decode step's chosen experts the cache holds (EC)."""
        return self.routing.cache_hits(self.p.N, self.p.experts_gpu, self.p.eviction)

    def _placed(self, t: Number) -> tuple[float, Number, Number]:
        """With the policy's experts_gpu experts of each layer on the GPU (EP; the most popular,
        or those pinned: Routing.popular): the
        share of token-expert pairs they take, and the distinct experts touched on the GPU and
        on the CPU. Otherwise (S5) every expert is the CPU's."""
        if self.ffn != "split":
            return 0.0, 0.0, self.distinct(t)
        return self.routing.split(t, self.p.experts_gpu)

    def _experts(self, t: Number, share: float, distinct: Number) -> Work:
        """`share` of a micro-batch's token-expert pairs through `distinct` experts, with the
        residual: SwiGLU's three products per pair, each expert's weights read once."""
        m, b = self.m, self.m.dtype_bytes
        return Work(flops=6 * t * m.k * share * m.h * m.h_i,
                    bytes=distinct * m.expert_bytes + b * t * (2 * m.h + 2 * m.k * share * m.h_i))

    def _D6(self, t: Number) -> Work:
        return Work(bytes=self.m.dtype_bytes * t * self.m.h)

    def _Merge(self, t: Number) -> Work:
        return Work(flops=t * self.m.h, bytes=3 * self.m.dtype_bytes * t * self.m.h)

    # Tensor parallelism: PostAttn's parts (their sum is PostAttn's work), and ring collectives
    # in the bytes each GPU sends over the interconnect.
    def _OProj(self, t: Number) -> Work:
        m, b = self.m, self.m.dtype_bytes
        return Work(flops=2 * t * m.q_dim * m.h, bytes=m.o_bytes + b * t * m.h)

    def _MoE(self, t: Number) -> Work:
        m, b = self.m, self.m.dtype_bytes
        return Work(flops=2 * t * m.h * m.E + 6 * t * m.k * m.h * m.h_i,
                    bytes=m.router_bytes + self.distinct(t) * m.expert_bytes
                    + b * t * (3 * m.h + 2 * m.k * m.h_i))

    def _AllReduce(self, t: Number) -> Work:
        n = self.tp
        return Work(bytes=2 * (n - 1) / n * self.m.dtype_bytes * t * self.m.h)

    def _AllReduceAttn(self, t: Number) -> Work:
        return self._AllReduce(t)

    def _GatherLogits(self) -> Work:
        n = self.tp
        return Work(bytes=(n - 1) / n * self.m.dtype_bytes * self.load.seqs * self.m.V)

    # Pipeline parallelism: what crosses between stages.
    def _Send(self, t: Number) -> Work:
        return Work(bytes=self.m.dtype_bytes * t * self.m.h)

    def _SendTokens(self) -> Work:
        return Work(bytes=8 * self.load.seqs)      # int64 token ids

    # Weights.
    def _D3(self) -> Work:
        return Work(bytes=self.layout.page_bytes)

    def _W_CtoPin(self) -> Work:
        return Work(bytes=self.layout.page_bytes)

    # Prefill: the whole prompt of a micro-batch through one layer on the GPU.
    def _Prefill(self) -> Work:
        m, b = self.m, self.m.dtype_bytes
        t = self.load.prompt_tokens
        flops = (2 * t * m.h * (m.q_dim + 2 * m.h_kv) + 2 * t * m.q_dim * m.h
                 + 2 * t * m.h * m.E + 6 * t * m.k * m.h * m.h_i
                 + 2 * self.load.prompt_sq * m.q_dim)  # causal attention: half of 4*p^2*q_dim
        return Work(flops=flops,
                    bytes=m.layer_bytes - (m.E - self.distinct(t)) * m.expert_bytes
                    + b * t * (6 * m.h + 2 * m.h_kv + 2 * m.k * m.h_i))
