"""What a task kind is: one record per kind, and the sets of kinds the rest of `tg` asks about.

A record (:class:`Kind`, made by :func:`kind` from the function that is its work) says what the
kind means, the stream it runs on unless a schedule moves it, what it reads (the tasks whose
output it needs, and the builder's dependency rule: :class:`Read`), which section of its layer's
streamed weights and which ring of buffer slots it reads or fills, and its work: FLOPs and bytes
(docs/design.md §3.3). A new kind is one record here plus its kernel in the executor
(a ``Runtime`` method marked ``@runs("Name")``); tests/test_kinds.py fails when either is
missing.

Everything above (work, cost, graph, engine, executor, traces) reads kinds from here, and this
imports nothing: a kind's work reads the model, policy and micro-batch it is given
(:class:`taskgraph.dag.work.TaskWork`) by their attributes.

Work is affine in the context length ``s`` (tokens in a sequence's KV cache when the task runs,
on average over its micro-batch), ``flops + flops_per_ctx * s``, so one compiled step serves
every decode step. Bytes are those the task moves through the memory of the device it runs on,
or over the link for transfers, or through host memory for the pinned staging copy. A kind's
work function gets ``work`` (the model, policy and micro-batch load), ``tokens`` (the tokens it
processes in its phase: the prompt's in prefill, one per sequence still generating, and any
admitted prompt's, in decode) and ``prefill`` (whether it is a prefill task).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: A figure of work: a number, or a NumPy array of them (one per task of a request batch).
Number = Any


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes of one task, affine in the context length s."""

    flops: Number = 0.0
    flops_per_ctx: Number = 0.0
    bytes: Number = 0.0
    bytes_per_ctx: Number = 0.0

    def at(self, s: Number) -> tuple[Number, Number]:
        return self.flops + self.flops_per_ctx * s, self.bytes + self.bytes_per_ctx * s


@dataclass(frozen=True)
class Read:
    """A task whose output a kind reads: the first of ``kinds`` the schedule launches where
    the reader stands, ``step`` steps and ``layer`` layers back (a layer before the first is
    the previous step's last), of micro-batch ``index`` (None: the reader's own; a page kind
    reads its own page). A step before the prefill has nothing to read.

    ``if_launched``: the read is of something only some schedules produce (the pinned copy of
    a page, a cache's misses); where the schedule launches none of ``kinds``, there is nothing
    to wait for. Otherwise a schedule that launches none is incomplete, and the builder says so.
    """

    kinds: tuple[str, ...]
    step: int = 0
    layer: int = 0
    index: int | None = None
    if_launched: bool = False


#: What ends a layer for a micro-batch: the experts' output merged into the hidden state (on
#: the GPU, after the CPU's part), a cache's experts run on the GPU into the residual, the
#: whole layer on the GPU (decode's PostAttn, prefill's Prefill), or where the experts run
#: apart, a dense layer's router task (which runs its dense FFN). The first a schedule launches.
LAYER_OUT = ("Merge", "GPUFFN", "PostAttn", "Prefill", "Route")
#: What last wrote a micro-batch's hidden state at the end of a layer: after the last layer the
#: LM head (the sampled token's embedding is the next step's input), else the layer's end.
HIDDEN = ("LMHead", *LAYER_OUT)

#: Streams whose tasks move data rather than compute: the link's two directions, the host's
#: copies into pinned memory, the GPUs' interconnect.
COPY_STREAMS = frozenset({"h2d", "h2d_kv", "d2h", "pin", "peer"})


@dataclass(frozen=True)
class Kind:
    """One task kind: what it means, where it runs, what it reads, its work."""

    name: str
    meaning: str
    stream: str            # the stream it runs on (a schedule may move it: Schedule.streams)
    work: Callable[[Any, Number, bool], Work]
    reads: tuple[Read, ...] = ()
    # The section of its layer's streamed weights it reads ('qkv', 'o', 'route', 'moe', 'post'
    # or 'all'): it waits for the pages holding them (taskgraph.dag.work.WeightLayout).
    weights: str | None = None
    # A ring of buffer slots it fills ('weights', 'pinned', 'kv'), taking a slot the item
    # `back` uses before it emptied (taskgraph.dag.builder._rings), and rings it reads from.
    fills: str | None = None
    reads_slots: tuple[str, ...] = ()
    # Indexed by page of its layer's streamed weights, not by micro-batch.
    per_page: bool = False
    # Tensor parallelism: the parts it runs as (each between two all-reduces), the collective
    # that completes its partial sum, and what every GPU's shard of it runs whole.
    tp_parts: tuple[str, ...] = ()
    # The parts instead where the model normalises Q and K over every head at once (OLMoE),
    # which no GPU's heads alone can: the projection, its sums of squares all-reduced, the rest.
    tp_parts_whole_norm: tuple[str, ...] = ()
    collective: str | None = None
    replicated: Callable[[Any, Number, bool], Work] | None = None
    tp_only: bool = False
    # Its bytes are the KV cache's: a GPU moves its heads' share of it (ModelSpec.kv_copies),
    # a whole copy past the KV heads or of MLA's latent, not 1/n.
    cache_bytes: bool = False
    # Whether a layer of a model has this task (None: every layer of every model): a dense
    # layer has no experts to route, copy or run, a model without shared experts no SharedFFN.
    where: Callable[[Any, int], bool] | None = None
    # Pipeline parallelism: the send that carries its output to the next stage.
    send: str | None = None
    colour: str = "grey"        # its bars in a Gantt chart

    @property
    def moves(self) -> bool:
        """It moves data rather than computes (a trace draws it as a copy, at GB/s)."""
        return self.stream in COPY_STREAMS


#: Every task kind, in its one order: a kind's index in arrays of kinds (compiled programs,
#: cost tables) is its place here.
KINDS: dict[str, Kind] = {}


def kind(name: str, meaning: str, stream: str, **fields: Any) -> Callable[[Callable], Kind]:
    """Make the record of a kind from the function that is its work, and register it."""
    def record(work: Callable[[Any, Number, bool], Work]) -> Kind:
        if name in KINDS:
            raise ValueError(f"task kind {name} is defined twice")
        KINDS[name] = made = Kind(name, meaning, stream, work, **fields)
        return made
    return record


def tokens_of(work: Any, prefill: bool) -> Number:
    """The tokens a task processes in its phase (see the module docstring)."""
    load = work.load
    return load.prompt_tokens if prefill else load.seqs + load.admitted


def moe_layer(model: Any, layer: int) -> bool:
    """A layer with a router and experts (not a dense one)."""
    return not model.is_dense(layer)


def shared_layer(model: Any, layer: int) -> bool:
    """An MoE layer of a model with shared experts."""
    return model.shared_experts > 0 and not model.is_dense(layer)


# --- the layer on the GPU, attention on the CPU (S1-S3) or the GPU (S4, DS, PP) ---------------

@kind("Prefill", "one layer of the prompt on the GPU: attention and MoE FFN over mu*p tokens",
      "gpu", reads=(Read(HIDDEN, layer=-1),), weights="all", fills="kv",
      tp_parts=("PrefillAttn", "OProj", "MoE"),
      tp_parts_whole_norm=("QKV", "PromptAttn", "OProj", "MoE"), send="Send", colour="#4292c6")
def Prefill(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b, load = work.model, work.model.dtype_bytes, work.load
    t = load.prompt_tokens
    ffn = work.ffn(t)
    flops = (2 * t * m.qkv_params + 2 * t * m.o_params + ffn.flops
             + work.causal_squares(t, load.prompt_sq) * (m.prefill_pair_flops // 2))
    return Work(flops=flops,
                bytes=m.qkv_bytes + m.o_bytes + ffn.bytes
                + b * t * (4 * m.h + m.kv_width))


@kind("KVOut", "new K,V of a micro-batch, GPU -> CPU (the whole prompt's in prefill, one "
      "token's in decode)", "d2h", reads=(Read(("GPUAttn", "PrefillAttn", "Prefill")),),
      reads_slots=("kv",), cache_bytes=True, colour="#bcbddc")
def KVOut(work: Any, tokens: Number, prefill: bool) -> Work:
    # only the part of the cache not kept on the GPU (r_c) goes to the host
    return Work(bytes=(1 - work.policy.r_c) * tokens * work.model.kv_bytes_per_token)


def _latent_projections(work: Any, tokens: Number, prefill: bool) -> Work:
    """MLA's projections down to the Q and KV latents: under tensor parallelism every GPU's
    shard of attention runs them whole, since all its heads read both latents (and the KV
    cache holds the latent whole on every GPU: ModelSpec.kv_split)."""
    m = work.model
    params = m.latent_projection_params
    return Work(flops=2 * tokens * params, bytes=params * m.bits("attention") / 8)


@kind("PreAttn", "RMSNorm + QKV projection on the GPU", "gpu",
      reads=(Read(HIDDEN, layer=-1),), weights="qkv", replicated=_latent_projections,
      tp_parts_whole_norm=("QKV", "QKNorm"), colour="#6baed6")
def PreAttn(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b, new = work.model, work.model.dtype_bytes, work.load.admitted
    mu = work.load.seqs + new
    return Work(flops=2 * mu * m.qkv_params
                + work.causal_squares(new, work.load.admitted_sq)       # admitted prompts'
                * (m.prefill_pair_flops // 2),
                bytes=m.qkv_bytes + b * mu * (m.h + m.q_width + m.kv_width))


@kind("D1", "Q, K, V of a micro-batch, GPU -> CPU", "d2h", reads=(Read(("PreAttn",)),),
      colour="#9e9ac8")
def D1(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b = work.model, work.model.dtype_bytes
    return Work(bytes=b * work.load.seqs * (m.q_width + m.kv_width)
                + b * work.load.admitted * m.kv_width)      # admitted prompts: K,V only


@kind("CPUAttn", "grouped-query decode attention over the CPU KV cache; appends the new K,V",
      "cpu", colour="#fd8d3c",
      # the KV cache it reads: appended by the previous step's attention, or by prefill
      reads=(Read(("D1",)), Read(("CPUAttn", "KVOut"), step=-1)))
def CPUAttn(work: Any, tokens: Number, prefill: bool) -> Work:
    m, mu, b = work.model, work.load.seqs, work.model.dtype_bytes
    # MLA decompressed: each cached latent projected to every head's key and value (a
    # product), which attention then reads; the up-projection's weights read once
    return Work(flops_per_ctx=2 * mu * (m.q_width + m.attn_out_width + m.decompress_params),
                bytes_per_ctx=mu * (m.kv_bytes_per_token + b * m.decompressed_width),
                bytes=b * mu * (m.q_width + m.attn_out_width + m.kv_width)
                + m.decompress_params * m.bits("attention") / 8)


@kind("D2", "attention output (hidden state) of a micro-batch, CPU -> GPU", "h2d",
      reads=(Read(("CPUAttn",)),), colour="#74c476")
def D2(work: Any, tokens: Number, prefill: bool) -> Work:
    return Work(bytes=work.model.dtype_bytes * work.load.seqs * work.model.attn_out_width)


@kind("D4", "KV cache of a micro-batch, CPU -> GPU (GPU-attention schedules)", "h2d",
      reads=(Read(("KVOut",), step=-1),), fills="kv", colour="#a1d99b")
def D4(work: Any, tokens: Number, prefill: bool) -> Work:
    # the part of the micro-batch's KV cache that is not kept on the GPU
    return Work(bytes_per_ctx=(1 - work.policy.r_c) * work.load.seqs
                * work.model.kv_bytes_per_token)


@kind("GPUAttn", "decode attention on the GPU over the prefetched KV", "gpu",
      reads=(Read(("PreAttn",)), Read(("D4",))), reads_slots=("kv",), colour="#08519c")
def GPUAttn(work: Any, tokens: Number, prefill: bool) -> Work:
    return CPUAttn.work(work, tokens, prefill)


@kind("PostAttn", "O projection + residual + RMSNorm + router + top-k SwiGLU experts", "gpu",
      reads=(Read(("D2", "GPUAttn")),), weights="post", tp_parts=("OProj", "MoE"),
      send="Send", colour="#2171b5")
def PostAttn(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b = work.model, work.model.dtype_bytes
    ffn = work.ffn(tokens)
    return Work(flops=2 * tokens * m.o_params + ffn.flops,
                bytes=m.o_bytes + ffn.bytes + b * tokens * (m.attn_out_width + m.h))


@kind("D3", "a page of a layer's streamed weights, CPU -> GPU", "h2d", per_page=True,
      reads=(Read(("W_CtoPin",), if_launched=True),), fills="weights",
      reads_slots=("pinned",), colour="#238b45")
def D3(work: Any, tokens: Number, prefill: bool) -> Work:
    return Work(bytes=work.layout.page_bytes)


@kind("W_CtoPin", "a page of weights, pageable CPU memory -> pinned staging buffer", "pin",
      per_page=True, fills="pinned", colour="#fdd0a2")
def W_CtoPin(work: Any, tokens: Number, prefill: bool) -> Work:
    return Work(bytes=work.layout.page_bytes)


@kind("LMHead", "final norm + LM head + sampling of one micro-batch", "gpu",
      reads=(Read(LAYER_OUT),), collective="GatherLogits", send="SendTokens",
      colour="#9ecae1")
def LMHead(work: Any, tokens: Number, prefill: bool) -> Work:
    m, mu, b = work.model, work.load.seqs, work.model.dtype_bytes
    return Work(flops=2 * mu * m.h * m.V, bytes=m.head_bytes + b * mu * (m.h + m.V))


# --- FFN on the CPU (S5, EP): the GPU routes, the CPU runs the experts where their weights lie --

@kind("PrefillAttn", "one layer's RMSNorm, QKV and causal attention over the prompt, on the GPU",
      "gpu", reads=(Read(HIDDEN, layer=-1),), weights="qkv", fills="kv",
      replicated=_latent_projections, tp_parts_whole_norm=("QKV", "PromptAttn"))
def PrefillAttn(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b = work.model, work.model.dtype_bytes
    return Work(flops=2 * tokens * m.qkv_params
                + work.causal_squares(tokens, work.load.prompt_sq) * (m.prefill_pair_flops // 2),
                bytes=m.qkv_bytes
                + b * tokens * (2 * m.h + m.q_width + m.attn_out_width + m.kv_width))


@kind("Route", "O projection + residual + RMSNorm + router (top-k) on the GPU", "gpu",
      reads=(Read(("GPUAttn", "PrefillAttn")),), weights="route")
def Route(work: Any, tokens: Number, prefill: bool) -> Work:
    """And on a dense layer its FFN, which no expert kind runs."""
    m, b = work.model, work.model.dtype_bytes
    work_ = Work(flops=2 * tokens * m.o_params + 2 * tokens * m.h * m.E,
                 bytes=m.o_bytes + m.router_bytes + b * tokens * (m.attn_out_width + 3 * m.h))
    if not work.dense:
        return work_
    ffn = work.ffn(tokens)
    return Work(flops=2 * tokens * m.o_params + ffn.flops,
                bytes=m.o_bytes + ffn.bytes + b * tokens * (m.attn_out_width + 3 * m.h))


@kind("D5", "normed hidden state and routing of a micro-batch, GPU -> CPU", "d2h",
      reads=(Read(("Route",)),), where=moe_layer)
def D5(work: Any, tokens: Number, prefill: bool) -> Work:
    m = work.model      # the normed hidden state, the k expert ids (int64) and gates
    return Work(bytes=tokens * (m.dtype_bytes * (m.h + m.k) + 8 * m.k))


@kind("CPUFFN", "top-k SwiGLU experts on the CPU, reading their weights in host memory", "cpu",
      reads=(Read(("D5",)),), where=moe_layer)
def CPUFFN(work: Any, tokens: Number, prefill: bool) -> Work:
    share, _, distinct = work.placed(tokens)
    return work.experts(tokens, 1.0 - share, distinct)


@kind("D6", "expert output of a micro-batch, CPU -> GPU", "h2d", reads=(Read(("CPUFFN",)),),
      where=moe_layer)
def D6(work: Any, tokens: Number, prefill: bool) -> Work:
    return Work(bytes=work.model.dtype_bytes * tokens * work.model.h)


@kind("Merge", "residual add of the expert output on the GPU", "gpu",
      reads=(Read(("D6",)), Read(("GPUFFN",), if_launched=True),
             Read(("SharedFFN",), if_launched=True)), where=moe_layer)
def Merge(work: Any, tokens: Number, prefill: bool) -> Work:
    m = work.model
    return Work(flops=tokens * m.h, bytes=3 * m.dtype_bytes * tokens * m.h)


# --- tensor parallelism (several GPUs): each GPU runs a shard of every GPU task, and a layer's
# PostAttn (or Prefill) runs as the parts between its two all-reduces; the builder derives what
# these read from the task they are parts of (taskgraph.dag.builder._deps) ---------------------

@kind("OProj", "O projection of a micro-batch's attention output (a GPU's heads: a partial sum)",
      "gpu", weights="o", collective="AllReduceAttn", tp_only=True)
def OProj(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b = work.model, work.model.dtype_bytes
    return Work(flops=2 * tokens * m.o_params, bytes=m.o_bytes + b * tokens * m.h)


@kind("AllReduceAttn", "the O projection's partial sums all-reduced, over the GPUs' "
      "interconnect", "peer")
def AllReduceAttn(work: Any, tokens: Number, prefill: bool) -> Work:
    return AllReduce.work(work, tokens, prefill)


def _router(work: Any, tokens: Number, prefill: bool) -> Work:
    """The router: its weights and its product over the whole hidden state (every GPU's
    shard of MoE runs it whole). Norms are left out: h FLOPs a token."""
    m = work.model
    if work.dense:
        return Work()
    return Work(flops=2 * tokens * m.h * m.E, bytes=m.router_bytes)


@kind("MoE", "residual + RMSNorm + router + top-k SwiGLU experts (a GPU's columns of each "
      "expert: a partial sum)", "gpu", weights="moe", collective="AllReduce",
      replicated=_router, tp_only=True)
def MoE(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b = work.model, work.model.dtype_bytes
    ffn = work.ffn(tokens)
    return Work(flops=ffn.flops, bytes=ffn.bytes + b * tokens * m.h)


@kind("AllReduce", "the experts' partial sums all-reduced, over the GPUs' interconnect", "peer",
      colour="#e7298a")
def AllReduce(work: Any, tokens: Number, prefill: bool) -> Work:
    n = work.tp         # a ring all-reduce: each GPU sends 2 (n - 1) / n of the sum
    return Work(bytes=2 * (n - 1) / n * work.model.dtype_bytes * tokens * work.model.h)


# Where a model normalises Q and K over every head at once (OLMoE), a GPU's heads alone cannot:
# each GPU projects its heads and sums their squares, the sums are all-reduced (two figures a
# token; vLLM all-gathers Q and K instead), and the rest of the attention runs on the normed
# Q and K.

@kind("QKV", "RMSNorm + QKV projection of a GPU's heads, and each token's sums of their Q's and "
      "K's squares (a partial sum)", "gpu", weights="qkv", collective="AllReduceNorm",
      tp_only=True, colour="#6baed6")
def QKV(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b = work.model, work.model.dtype_bytes
    return Work(flops=2 * tokens * m.qkv_params,
                bytes=m.qkv_bytes + b * tokens * (m.h + m.q_width + m.kv_width))


@kind("AllReduceNorm", "each token's sums of Q's and K's squares all-reduced (a norm over every "
      "head), over the GPUs' interconnect", "peer", colour="#e7298a")
def AllReduceNorm(work: Any, tokens: Number, prefill: bool) -> Work:
    n = work.tp         # two fp32 figures a token, in a ring
    return Work(bytes=2 * (n - 1) / n * 8 * tokens)


def _qk_norm(work: Any, tokens: Number) -> Work:
    """Q and K normed by the all-reduced sums and rotated: read and written once."""
    m, b = work.model, work.model.dtype_bytes
    width = m.q_width + m.kv_width
    return Work(flops=4 * tokens * width, bytes=2 * b * tokens * width)


@kind("QKNorm", "a GPU's heads' Q and K normed over every head and rotated (decode)", "gpu",
      tp_only=True, colour="#6baed6")
def QKNorm(work: Any, tokens: Number, prefill: bool) -> Work:
    """And, as PreAttn prices it, the attention of prompts admitted into the step."""
    m, norm = work.model, _qk_norm(work, tokens)
    admitted = work.causal_squares(work.load.admitted, work.load.admitted_sq)
    return Work(flops=norm.flops + admitted * (m.prefill_pair_flops // 2), bytes=norm.bytes)


@kind("PromptAttn", "a GPU's heads' Q and K normed over every head and rotated, and causal "
      "attention over the prompt", "gpu", fills="kv", tp_only=True)
def PromptAttn(work: Any, tokens: Number, prefill: bool) -> Work:
    m, b = work.model, work.model.dtype_bytes
    attention = PrefillAttn.work(work, tokens, prefill)
    projection = QKV.work(work, tokens, prefill)
    norm = _qk_norm(work, tokens)
    return Work(flops=attention.flops - projection.flops + norm.flops,
                bytes=attention.bytes - m.qkv_bytes - b * tokens * m.h + norm.bytes)


@kind("GatherLogits", "the vocabulary shards' logits gathered for sampling, over the "
      "interconnect", "peer", colour="#c994c7")
def GatherLogits(work: Any, tokens: Number, prefill: bool) -> Work:
    n = work.tp
    return Work(bytes=(n - 1) / n * work.model.dtype_bytes * work.load.seqs * work.model.V)


# --- pipeline parallelism (several GPUs): each GPU runs a stage of consecutive layers --------

@kind("Send", "a micro-batch's hidden state to the next pipeline stage's GPU, over the "
      "interconnect", "peer", colour="#e7298a")
def Send(work: Any, tokens: Number, prefill: bool) -> Work:
    return Work(bytes=work.model.dtype_bytes * tokens * work.model.h)


@kind("SendTokens", "a micro-batch's sampled tokens from the last pipeline stage to the first",
      "peer", colour="#c994c7")
def SendTokens(work: Any, tokens: Number, prefill: bool) -> Work:
    return Work(bytes=8 * work.load.seqs)      # int64 token ids


# --- expert-level offloading (EP, EC, ECP): some experts of a layer are held on the GPU -------

@kind("GPUFFN", "the top-k SwiGLU experts a micro-batch routes to that the GPU holds (placed or "
      "cached), on the GPU", "gpu",
      reads=(Read(("Route",)), Read(("ExpertIn",), if_launched=True),
             Read(("ExpertAhead",), index=0, if_launched=True),
             Read(("SharedFFN",), if_launched=True)), where=moe_layer)
def GPUFFN(work: Any, tokens: Number, prefill: bool) -> Work:
    if work.ffn_place == "split":   # the experts placed on the GPU (EP)
        share, distinct, _ = work.placed(tokens)
        return work.experts(tokens, share, distinct)
    return work.experts(tokens, 1.0, work.distinct(tokens))    # a cache: every chosen expert


@kind("ExpertIn", "the experts a micro-batch routes to that the GPU's expert cache misses, "
      "CPU -> GPU", "h2d", where=moe_layer,
      reads=(Read(("Route",)),))     # which to copy: the router's choice
def ExpertIn(work: Any, tokens: Number, prefill: bool) -> Work:
    """In prefill (every expert chosen) those beyond the cache's; in decode the share a replay
    of the routing finds absent, less those a prefetch (ECP) brought in right."""
    m, p = work.model, work.policy
    if prefill:
        beyond = work.distinct(tokens) - p.experts_gpu
        # max(beyond, 0) for a number or an array alike, without importing NumPy
        return Work(bytes=(beyond + abs(beyond)) / 2 * m.expert_bytes)
    ahead = p.prefetch_right if work.prefetches else 0.0
    return Work(bytes=work.misses(tokens) * (1.0 - ahead) * m.expert_bytes)


@kind("ExpertAhead", "the experts a predictor expects a layer's router to choose that the cache "
      "misses, CPU -> GPU, while the layer before runs", "h2d",
      # the prediction reads the layer before's hidden state, once its router has run
      reads=(Read(("Route",), layer=-1, index=0),), where=moe_layer)
def ExpertAhead(work: Any, tokens: Number, prefill: bool) -> Work:
    """One layer's prefetch: as many experts as its micro-batches will miss; the predictor's
    wrong guesses are copies wasted."""
    return Work(bytes=work.policy.n_micro * work.misses(work.load.seqs)
                * work.model.expert_bytes)


# --- shared experts, where the routed ones run apart (S5, EP, EC, ECP) ----------------------------

@kind("SharedFFN", "the shared experts every token runs besides its routed ones, on the GPU "
      "while the routed ones run or cross", "gpu", reads=(Read(("Route",)),), weights="shared",
      where=shared_layer, colour="#3182bd")
def SharedFFN(work: Any, tokens: Number, prefill: bool) -> Work:
    return work.shared(tokens)


# --- the sets of kinds the rest of tg asks about ------------------------------------------------

#: Kinds in their one order: a kind's index in arrays of kinds (compiled programs, cost tables).
KIND_NAMES: tuple[str, ...] = tuple(KINDS)
KIND_INDEX: dict[str, int] = {k: i for i, k in enumerate(KIND_NAMES)}
#: Kinds that read the streamed weights of their layer, and which section they read.
WEIGHT_SECTIONS: dict[str, str] = {k.name: k.weights for k in KINDS.values() if k.weights}
#: Kinds indexed by weight page rather than by micro-batch.
PAGED = frozenset(k.name for k in KINDS.values() if k.per_page)
#: Kinds that move data rather than compute (a trace draws them as copies).
MOVES = frozenset(k.name for k in KINDS.values() if k.moves)
#: Kinds that copy between host and device memory (the link, or the host's pinned staging):
#: what the CPU backend's zero copy makes no-ops.
HOST_DEVICE_COPIES = frozenset(k.name for k in KINDS.values() if k.moves and k.stream != "peer")
#: Kinds that run on the host (its cores, its memory copies): on several GPUs, each GPU's
#: process runs its own part.
HOST_KINDS = frozenset(k.name for k in KINDS.values() if k.stream in ("cpu", "pin"))
#: Under tensor parallelism, a kind whose output is a sum of per-GPU partial sums, and the
#: collective that completes it (Megatron-style: column-parallel QKV and expert up/gate
#: projections, row-parallel O and down projections; a vocabulary-parallel LM head).
COLLECTIVE_AFTER: dict[str, str] = {k.name: k.collective for k in KINDS.values()
                                    if k.collective}
COLLECTIVES = frozenset(COLLECTIVE_AFTER.values())
#: Under tensor parallelism, a kind that holds an all-reduce inside it runs as its parts (the
#: residual, norm and router after the O projection need the whole hidden state) on some model
#: (:func:`tp_parts`), prefill's Prefill first.
TP_WHOLES: tuple[str, ...] = tuple(k.name for k in KINDS.values()
                                   if k.tp_parts or k.tp_parts_whole_norm)


def tp_parts(kind: str, model: Any) -> tuple[str, ...]:
    """The parts `kind` runs as under tensor parallelism on `model` (none: it runs whole)."""
    record = KINDS[kind]
    if record.tp_parts_whole_norm and model.qk_norm_whole:
        return record.tp_parts_whole_norm
    return record.tp_parts


#: Under pipeline parallelism, a kind whose output another stage reads, and the send carrying it
#: there: a stage's last layer's hidden state; the sampled tokens back to the first stage.
SEND_AFTER: dict[str, str] = {k.name: k.send for k in KINDS.values() if k.send}
SENDS = frozenset(SEND_AFTER.values())
#: Kinds that run on a GPU, cross its own link, or run on the host for it: split across GPUs
#: under tensor parallelism, one shard per GPU (each GPU moves its shard over its own link, its
#: process computes its heads' CPU attention and copies its part of each page into pinned
#: memory); placed on the GPU of their layer's stage (pipeline) or of their group (data
#: parallelism).
SHARDED = frozenset(KINDS) - COLLECTIVES - SENDS
