"""What a plan's tasks work on: the model, policy and micro-batch each kind's work reads
(:class:`TaskWork`; the FLOPs and bytes of each kind are its record's, in
:mod:`taskgraph.kinds`), and where a layer's weights lie (:class:`WeightLayout`).

A micro-batch is ``mu`` sequences of the workload's mean prompt unless a :class:`Load` says
otherwise (a batch of real requests: how many are still generating, how many prompt tokens they
hold); its figures may be arrays, one per task. Durations are not here: the cost model turns
work into time for a hardware profile, and the executor measures it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Union

import numpy as np

from taskgraph.dag.routing import Routing
from taskgraph.kinds import KINDS, SHARDED, Work, tokens_of
from taskgraph.specs import ModelSpec, PolicySpec, WorkloadSpec

Number = Union[float, np.ndarray]


@dataclass(frozen=True)
class WeightLayout:
    """One layer's weights: sections qkv | o | router | experts in that order. The first
    ``r_w`` of the bytes stay on the GPU; the rest streams in ``n_pages`` equal pages."""

    model: ModelSpec
    r_w: float
    n_pages: int
    # False (FFN on the CPU): the experts never leave host memory; r_w and the pages cover the
    # rest of the layer (qkv | o | router | shared).
    streams_experts: bool = True
    # A dense layer: qkv | o | its FFN, all of it where the GPU's part of a layer lies.
    dense: bool = False

    @property
    def layer_bytes(self) -> float:
        """The whole layer's bytes."""
        return self.model.dense_layer_bytes if self.dense else self.model.layer_bytes

    @property
    def extent_bytes(self) -> float:
        """The bytes of a layer that live on the GPU, resident or streamed."""
        m = self.model
        if self.streams_experts or self.dense:
            return self.layer_bytes
        return m.layer_bytes - m.E * m.expert_bytes

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
        """Pages that hold any byte of a section ('qkv', 'o', 'route', 'shared', 'moe', 'post'
        or 'all')."""
        return self._pages[section]

    @cached_property
    def _pages(self) -> dict[str, range]:
        return {section: self._pages_of(section)
                for section in ("qkv", "post", "route", "o", "shared", "moe", "all")}

    def sections(self) -> dict[str, tuple[float, float]]:
        """Each section's byte range in the layer: qkv | o | router | shared | experts, or on a
        dense layer qkv | o | its FFN (which its router task, 'route', runs)."""
        m, end = self.model, self.layer_bytes
        qkv, o = m.qkv_bytes, m.qkv_bytes + m.o_bytes
        route = end if self.dense else o + m.router_bytes
        shared = route if self.dense else route + m.shared_bytes
        # MLA: attention computed as tg's executor computes it (and transformers) projects the
        # cached latents to values through the up-projection's value half, the first of the
        # 'o' bytes: the tasks that wait for 'qkv' wait for it too.
        attention = qkv + (m.value_up_bytes if m.attention == "mla" else 0.0)
        return {"qkv": (0, attention), "post": (qkv, end), "route": (qkv, route), "o": (qkv, o),
                "shared": (route, shared), "moe": (o, end), "all": (0, end)}

    def _pages_of(self, section: str) -> range:
        if not self.n_pages:
            return range(0)
        lo, hi = self.sections()[section]
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
    """What every task kind's work reads (:mod:`taskgraph.kinds`) for one model, policy and
    workload: the model, the policy, a micro-batch's load, where the layer's weights lie, where
    the schedule runs the experts and how the tokens route. With `tp` GPUs in tensor parallel, a
    sharded kind's work is one GPU's shard: 1/tp of the task's FLOPs and bytes (weights, KV
    heads, experts' columns and the copies of them split evenly), but for what its record says
    every GPU runs whole (the router)."""

    def __init__(self, model: ModelSpec, policy: PolicySpec, workload: WorkloadSpec,
                 layout: WeightLayout, load: Load | None = None, tp: int = 1,
                 routing: Routing | None = None, ffn: str = "gpu", prefetches: bool = False,
                 held: tuple[np.ndarray, np.ndarray] | None = None, window: int | None = None):
        self.model, self.policy, self.workload, self.layout, self.tp = (model, policy, workload,
                                                                        layout, tp)
        self.window = window        # the layers attend within their last `window` tokens
        # EP: which experts the GPU holds, (L, E), and the layers whose work this is (a class
        # of layers holding as many: taskgraph.dag.builder.Plan.layer_classes)
        self.held = held
        self.dense = layout.dense       # the layer is dense: its FFN is one MLP, no experts
        self.ffn_place = ffn    # where the schedule runs the experts (Schedule.ffn)
        self.prefetches = prefetches    # ECP: the next layer's misses cross ahead
        p = workload.context_prompt
        self.load = load or Load(policy.mu, policy.mu * p, policy.mu * p * p)
        self.routing = routing or Routing.uniform(model)

    def with_load(self, load: Load) -> "TaskWork":
        return TaskWork(self.model, self.policy, self.workload, self.layout, load, self.tp,
                        self.routing, self.ffn_place, self.prefetches, self.held, self.window)

    def causal_squares(self, tokens: Number, squares: Number) -> Number:
        """What causal attention over prompts of `tokens` tokens, their lengths' squares summing
        to `squares`, computes, in squares: P^2 a prompt, twice its query-key pairs less half
        the diagonal's. In a sliding-window layer a prompt of P > w tokens pairs each token with
        at most w keys: 2wP - w^2 + w - P instead of P^2 (the same count of the mask), the
        prompts taken as alike at their square-weighted mean length (exact when they are)."""
        if self.window is None:
            return squares
        w = self.window
        tokens, squares = np.asarray(tokens, float), np.asarray(squares, float)
        mean = np.divide(squares, tokens, out=np.zeros_like(squares), where=tokens > 0)
        inside = np.divide(w * w - w, mean, out=np.zeros_like(mean), where=mean > 0)
        out = np.where(mean <= w, squares, tokens * (2 * w - 1 - inside))
        return float(out) if out.ndim == 0 else out

    def of(self, kind: str, *, prefill: bool = False) -> Work:
        """A task's work: its kind's, one GPU's shard of it under tensor parallelism."""
        record, tokens = KINDS[kind], tokens_of(self, prefill)
        work = record.work(self, tokens, prefill)
        if self.tp == 1 or kind not in SHARDED:
            return work
        n = self.tp
        whole = record.replicated(self, tokens, prefill) if record.replicated else Work()
        # what is read per token of context is the KV cache: a GPU past the KV heads (or any,
        # for MLA's latent) reads a copy of its heads' part, not 1/n of it
        kv_share = self.model.kv_copies(n) / n
        byte_share = kv_share if record.cache_bytes else 1 / n
        return Work((work.flops - whole.flops) / n + whole.flops, work.flops_per_ctx / n,
                    (work.bytes - whole.bytes) * byte_share + whole.bytes,
                    work.bytes_per_ctx * kv_share)

    # What the FFN's kinds ask.
    def ffn(self, tokens: Number) -> Work:
        """A layer's FFN over `tokens` tokens, with the residual's activations: on an MoE layer
        the router, the routed experts the tokens choose (each read once) and the shared ones;
        on a dense layer its MLP."""
        m, b = self.model, self.model.dtype_bytes
        if self.dense:
            return Work(flops=2 * tokens * m.dense_params,
                        bytes=m.dense_bytes + b * tokens * (2 * m.h + 2 * m.h_dense))
        routed = self.experts(tokens, 1, self.distinct(tokens))
        flops, nbytes = 2 * tokens * m.h * m.E + routed.flops, m.router_bytes + routed.bytes
        if m.shared_experts:
            shared = self.shared(tokens)
            flops, nbytes = flops + shared.flops, nbytes + shared.bytes
        return Work(flops=flops, bytes=nbytes)

    def shared(self, tokens: Number) -> Work:
        """The shared experts over `tokens` tokens (nothing on a dense layer, or without any)."""
        m = self.model
        if self.dense or not m.shared_experts:
            return Work()
        return Work(flops=2 * tokens * m.shared_params,
                    bytes=m.shared_bytes
                    + m.dtype_bytes * tokens * 2 * m.shared_experts * m.h_shared)

    def distinct(self, tokens: Number) -> Number:
        """Distinct experts `tokens` tokens route to in a layer (taskgraph.dag.routing)."""
        return self.routing.distinct(tokens)

    def misses(self, tokens: Number) -> Number:
        """Distinct experts of `tokens` tokens an expert cache misses in decode."""
        return self.distinct(tokens) * (1.0 - float(np.mean(self.cache_hits())))

    def cache_hits(self) -> np.ndarray:
        """Per layer, the share of a decode step's chosen experts the cache holds (EC)."""
        return self.routing.cache_hits(self.policy.N, self.policy.experts_gpu,
                                       self.policy.eviction)

    def placed(self, tokens: Number) -> tuple[float, Number, Number]:
        """With the experts the policy places on the GPU (EP; each layer's most popular, or
        those pinned: Routing.held): the share of token-expert pairs they take, and the
        distinct experts touched on the GPU and on the CPU, over this work's layers. Otherwise
        (S5) every expert is the CPU's."""
        if self.ffn_place != "split":
            return 0.0, 0.0, self.distinct(tokens)
        on, layers = self.held
        return self.routing.split(tokens, on, layers)

    def experts(self, tokens: Number, share: float, distinct: Number) -> Work:
        """`share` of a micro-batch's token-expert pairs through `distinct` experts, with the
        residual: SwiGLU's three products per pair, each expert's weights read once."""
        m, b = self.model, self.model.dtype_bytes
        return Work(flops=6 * tokens * m.k * share * m.h * m.h_i,
                    bytes=distinct * m.expert_bytes
                    + b * tokens * (2 * m.h + 2 * m.k * share * m.h_i))
