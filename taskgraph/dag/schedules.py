"""The schedules of docs/design.md §3.6, written as data.

A schedule says which tasks to launch, in which order, on which stream. It says nothing about
dependencies: those follow from what each task reads and writes, and the one generic builder
(:mod:`taskgraph.dag.builder`) derives them for every schedule alike.

Launch order is given by loops of :class:`Op`. In the decode body an op is launched for every
layer ``i`` and micro-batch ``j``; ``ahead`` and ``layer`` shift the task it launches forward
(``PreAttn`` two micro-batches ahead, page ``j`` of the *next* layer's weights), and a position
past the last micro-batch (or page) wraps into the following layer and, past the last layer, into
the next decode step. Ops on weight kinds count pages instead of micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from taskgraph.kinds import KINDS

#: Stream -> the resource it occupies. Streams are in-order queues; a resource runs one task at a
#: time. Two streams on one resource (S4's weight and KV loads) take turns on it.
STREAM_RESOURCE: dict[str, str] = {
    "gpu": "gpu", "cpu": "cpu", "h2d": "h2d", "h2d_kv": "h2d", "d2h": "d2h", "pin": "pin",
    "peer": "peer",
}
#: Kinds of resource. On a machine with several GPUs, every GPU has its own ``gpu``, ``h2d`` and
#: ``d2h`` (its compute and its own PCIe link), and its process its own ``cpu`` and ``pin`` (the
#: host threads that run its share of the host's work: see PER_GPU); the GPUs' ``peer``
#: interconnect (all-reduces) is one. What the processes' threads and the links share of the
#: host (its cores, memory bandwidth, PCIe lanes) the cost model and the simulator's contention
#: solver price.
RESOURCES: tuple[str, ...] = ("gpu", "cpu", "h2d", "d2h", "pin", "peer")
PER_GPU: frozenset[str] = frozenset({"gpu", "h2d", "d2h", "cpu", "pin"})


@dataclass(frozen=True)
class Op:
    """Launch one task of `kind` at the loop position, shifted `ahead` items and `layer` layers."""

    kind: str
    ahead: int = 0
    layer: int = 0
    when: Literal["each", "first", "last_layer"] = "each"


@dataclass(frozen=True)
class Loop:
    """Ops launched once (``once``), for every page of the first layer (``items``), or for every
    layer and micro-batch (``layers``)."""

    over: Literal["once", "items", "layers"]
    ops: tuple[Op, ...]


def _streams(**moved: str) -> dict[str, str]:
    """Every kind's stream (its record's), with some moved to another."""
    return {**{name: k.stream for name, k in KINDS.items()}, **moved}


@dataclass(frozen=True)
class Schedule:
    name: str
    title: str
    summary: str
    attention: Literal["cpu", "gpu"]
    paged: bool                 # weights cross in one page per micro-batch, else one per layer
    staging: bool               # weights pass through pinned staging buffers (W_CtoPin)
    prefill: tuple[Loop, ...]
    decode_prologue: tuple[Loop, ...]
    decode: tuple[Op, ...]
    streams: dict[str, str] = field(default_factory=_streams)
    min_micro_batches: int = 1
    pin_slots: int = 2          # pinned staging pages
    kv_slots: int = 2           # GPU KV prefetch buffers
    # The software whose kernels and copies a simulation of this schedule prices by default (a
    # name in taskgraph.presets.IMPLEMENTATIONS); `implementation:` in a scenario swaps it.
    implementation: str = "ideal"
    # The policy fields the schedule decides (where attention, the KV cache and the FFN live).
    # Choosing the schedule sets them; only an explicit, different value is an error.
    placement: dict[str, float] = field(default_factory=dict)
    # At most this many micro-batches (0: any), per GPU where each GPU runs a group of the
    # batch; choosing the schedule caps N at mu times it (times the GPUs).
    max_micro_batches: int = 0
    # Streamed weights a GPU holds at once, in parameters (0: a double buffer of two layers'
    # streamed weights).
    live_params: int = 0
    # Where the routed experts run: "gpu" (their weights cross the link with the layer's),
    # "cpu" (F_g = 0: they stay in host memory and the CPU computes them), "split" (the
    # policy's experts_gpu most popular of each layer stay on the GPU and run there, the rest
    # run on the CPU) or "cache" (on the GPU, from a cache of experts_gpu experts a layer; the
    # misses cross the link once the router has chosen them). Under all but "gpu" the layer's
    # other weights are what r_w and the pages cover.
    ffn: Literal["gpu", "cpu", "split", "cache"] = "gpu"
    # How several GPUs share the work: "tensor" shards every layer across them (MoE-Lightning);
    # "pipeline" gives each GPU a stage of consecutive layers and splits the batch into one
    # group per stage, so the stages work on different groups at once (FlexGen); "data" gives
    # each GPU a group of the batch and every layer whole, each GPU receiving every layer's
    # weights (DeepSpeed ZeRO-Inference).
    parallel: Literal["tensor", "pipeline", "data"] = "tensor"

    def __post_init__(self) -> None:
        unknown = sorted({op.kind for op in self.ops} - set(KINDS))
        if unknown:
            raise ValueError(f"schedule {self.name} launches unknown task kinds {unknown}")
        # A group's buffers are its GPU's; pinned staging and experts on the host would be
        # shared by all groups, which the builder does not model.
        if self.grouped and (self.staging or self.ffn != "gpu"):
            raise ValueError(f"schedule {self.name}: a {self.parallel}-parallel schedule "
                             "neither stages weights nor runs the FFN on the CPU")

    @property
    def ops(self) -> tuple[Op, ...]:
        """Every op, prefill's, the decode prologue's and the decode body's."""
        return (*(op for loop in (*self.prefill, *self.decode_prologue) for op in loop.ops),
                *self.decode)

    def reads(self, field: str) -> bool:
        """Whether the schedule reads an expert-level policy field (EXPERT_FIELDS): how many
        experts the GPU holds (EP, EC, ECP), how they are placed across layers (EP), how its
        cache evicts (EC, ECP), how right its prefetch is (ECP)."""
        if field == "experts_gpu":
            return self.expert_level
        if field in PLACED:
            return self.ffn == "split"
        if field == "eviction":
            return self.ffn == "cache"
        return any(op.kind == "ExpertAhead" for op in self.decode)

    @property
    def experts_on_host(self) -> bool:
        """The experts live in host memory, not in the layer's streamed weights."""
        return self.ffn != "gpu"

    @property
    def expert_level(self) -> bool:
        """Experts are placed or cached one by one (EP, EC, ECP), not streamed with the layer
        or all run on the CPU."""
        return self.ffn in ("split", "cache")

    @property
    def weights_pinned(self) -> bool:
        """Weights cross the link from pinned host memory: through the staging buffers, or
        because the systems that keep experts on the host pin their copy (Mixtral-offloading's
        and MoE-Infinity's expert stores, llama.cpp's CUDA_Host buffers). From pinned memory a
        copy runs at the link's rate and does not hold up other threads' kernel launches, as
        the driver's staging of pageable memory does."""
        return self.staging or self.experts_on_host

    @property
    def grouped(self) -> bool:
        """On several GPUs, the batch splits into one group of micro-batches per GPU, and each
        GPU keeps buffers of its own (pipeline and data parallelism)."""
        return self.parallel != "tensor"


#: The expert-level policy fields and their defaults: a schedule that does not read one has it
#: at its default (a comparison drops it with a note; make_plan refuses to ignore it).
EXPERT_FIELDS = {"experts_gpu": 0, "experts_total": None, "cpu_moe": None,
                 "override_tensor": None, "eviction": "lru", "prefetch": None}
#: The fields that place EP's experts otherwise than experts_gpu on every layer
#: (taskgraph.placement): a fixed placement, which a cache (EC, ECP) has not.
PLACED = ("experts_total", "cpu_moe", "override_tensor")

#: What each placement field decides, for messages.
PLACEMENT_MEANS = {"A_g": "where attention runs", "r_c": "where the KV cache lives",
                   "F_g": "where the MoE FFN runs", "r_w": "which weights stay on the GPU"}
_CPU_ATTENTION = {"A_g": 0, "r_c": 0.0, "F_g": 1}
_GPU_ATTENTION = {"A_g": 1, "F_g": 1}


_LMHEAD = Op("LMHead", when="last_layer")

_PREFILL_WHOLE = (
    Loop("once", (Op("D3"),)),
    Loop("layers", (Op("D3", layer=1, when="first"), Op("Prefill"), Op("KVOut"), _LMHEAD)),
)

_PREFILL_PAGED = (
    Loop("once", (Op("W_CtoPin"), Op("W_CtoPin", ahead=1))),
    Loop("items", (Op("D3"), Op("W_CtoPin", ahead=2))),
    Loop("layers", (Op("D3", layer=1), Op("Prefill"), Op("KVOut"),
                    Op("W_CtoPin", layer=1, ahead=2), _LMHEAD)),
)

# PreAttn, D1 and CPUAttn of micro-batches 1 and 2 before the first layer (Algorithm 1).
_CPU_PROLOGUE = (Loop("once", (Op("PreAttn"), Op("D1"), Op("CPUAttn"),
                               Op("PreAttn", ahead=1), Op("D1", ahead=1),
                               Op("CPUAttn", ahead=1))),)

S1 = Schedule(
    name="S1", title="CGOPipe",
    summary="CPU attention two micro-batches ahead; next layer's weights in pages "
            "interleaved with hidden-state transfers",
    attention="cpu", paged=True, staging=True, min_micro_batches=2,
    implementation="moe-lightning",
    placement=_CPU_ATTENTION,
    prefill=_PREFILL_PAGED,
    decode_prologue=_CPU_PROLOGUE,
    decode=(Op("D2"), Op("D3", layer=1), Op("PostAttn"), _LMHEAD,
            Op("PreAttn", ahead=2), Op("D1", ahead=2), Op("CPUAttn", ahead=2),
            Op("W_CtoPin", layer=1, ahead=2)),
)

# Whole layers staged through two pinned buffers: a layer's pinned copy starts as the layer two
# back has left its buffer.
_PREFILL_WHOLE_STAGED = (
    Loop("once", (Op("W_CtoPin"), Op("W_CtoPin", ahead=1), Op("D3"))),
    Loop("layers", (Op("D3", layer=1, when="first"), Op("Prefill"), Op("KVOut"),
                    Op("W_CtoPin", layer=1, ahead=1, when="first"), _LMHEAD)),
)

S2 = Schedule(
    name="S2", title="FastDecode-like",
    summary="CPU attention overlapped as in CGOPipe, but the next layer's weights cross whole",
    attention="cpu", paged=False, staging=True, min_micro_batches=2,
    # The paper's S2 is an ablation inside MoE-Lightning's own system: its kernels and its
    # pinned relay for the weights, FastDecode's order (whole layers, not pages).
    implementation="moe-lightning",
    placement=_CPU_ATTENTION,
    prefill=_PREFILL_WHOLE_STAGED,
    decode_prologue=_CPU_PROLOGUE,
    decode=(Op("D2"), Op("D3", layer=1, when="first"), Op("PostAttn"), _LMHEAD,
            Op("PreAttn", ahead=2), Op("D1", ahead=2), Op("CPUAttn", ahead=2),
            Op("W_CtoPin", layer=1, ahead=1, when="first")),
)

S3 = Schedule(
    name="S3", title="FlexGen (CPU attention)",
    summary="each micro-batch strictly PreAttn, D1, CPUAttn, D2, PostAttn; only the whole-layer "
            "weight prefetch overlaps",
    attention="cpu", paged=False, staging=False, implementation="flexgen",
    placement=_CPU_ATTENTION,
    prefill=_PREFILL_WHOLE,
    decode_prologue=(),
    decode=(Op("D3", layer=1, when="first"), Op("PreAttn"), Op("D1"), Op("CPUAttn"),
            Op("D2"), Op("PostAttn"), _LMHEAD),
)

S4 = Schedule(
    name="S4", title="FlexGen (GPU attention)",
    summary="attention on the GPU; the next micro-batch's KV cache is prefetched on its own "
            "stream and competes with the whole-layer weight prefetch for the CPU->GPU link",
    attention="gpu", paged=False, staging=False, implementation="flexgen",
    placement=_GPU_ATTENTION,
    prefill=_PREFILL_WHOLE,
    decode_prologue=(Loop("once", (Op("D4"),)),),
    decode=(Op("D3", layer=1, when="first"), Op("D4", ahead=1), Op("PreAttn"), Op("GPUAttn"),
            Op("KVOut"), Op("PostAttn"), _LMHEAD),
    streams=_streams(D4="h2d_kv"),
)

# DeepSpeed's ZeRO-Inference on several GPUs is data parallel (ZeRO stage 3): each GPU runs a
# batch of its own, and each layer's parameters, partitioned across the GPUs' shares of host
# memory, are gathered whole on every GPU before use. Without peer-to-peer the gather passes
# through host memory, so every GPU's own link carries the whole layer.
DS = Schedule(
    name="DS", title="DeepSpeed ZeRO-Inference",
    summary="S4's order with one micro-batch per GPU and the whole KV cache on the GPU: each "
            "layer's weights cross whole to every GPU, prefetched one layer ahead",
    attention="gpu", paged=False, staging=False, implementation="deepspeed",
    placement={"A_g": 1, "r_c": 1.0, "F_g": 1, "r_w": 0.0}, max_micro_batches=1,
    parallel="data",
    # ZeRO-3 gathers parameters module by module as the forward pass reaches them and frees
    # them after, keeping at most stage3_max_live_parameters (10^9 by default) on the GPU.
    live_params=10**9,
    prefill=S4.prefill,
    decode_prologue=S4.decode_prologue,
    decode=S4.decode,
    streams=S4.streams,
)

# A model's shared experts run on the GPU while the CPU runs the routed ones (kTransformers):
# SharedFFN is launched only where a layer has them (its record's `where`).
_EXPERTS_ON_CPU = (Op("Route", ahead=1), Op("D5", ahead=1), Op("SharedFFN", ahead=1),
                   Op("CPUFFN", ahead=1))

S5 = Schedule(
    name="S5", title="FFN on the CPU",
    summary="attention and routing on the GPU, the routed experts on the CPU where their weights "
            "lie (Fiddler, kTransformers); the next micro-batch's attention overlaps this one's "
            "experts, and only attention and router weights cross the link",
    attention="gpu", paged=False, staging=False, ffn="cpu", min_micro_batches=2,
    placement={"A_g": 1, "F_g": 0},
    prefill=(Loop("once", (Op("D3"),)),
             Loop("layers", (Op("D3", layer=1, when="first"), Op("PrefillAttn"), Op("KVOut"),
                             Op("Route"), Op("D5"), Op("SharedFFN"), Op("CPUFFN"), Op("D6"),
                             Op("Merge"), _LMHEAD))),
    # Micro-batch 1's attention and routing run before micro-batch 0's merge, so the GPU works
    # while the CPU computes experts.
    decode_prologue=(Loop("once", (Op("D4"), Op("PreAttn"), Op("GPUAttn"), Op("KVOut"),
                                   Op("Route"), Op("D5"), Op("SharedFFN"), Op("CPUFFN"))),),
    decode=(Op("D3", layer=1, when="first"), Op("D4", ahead=1), Op("PreAttn", ahead=1),
            Op("GPUAttn", ahead=1), Op("KVOut", ahead=1), *_EXPERTS_ON_CPU, Op("D6"),
            Op("Merge"), _LMHEAD),
    streams=_streams(D4="h2d_kv"),
)

# Expert-level offloading for small batches: attention on the GPU (with as much of the KV cache
# and of the other weights as r_c and r_w keep there: at batch 1, all of both), and each layer's
# experts placed one by one. A micro-batch's tasks run in order (at batch 1 there is no other
# micro-batch to overlap); the next layer's streamed weights, if any, cross ahead as in S4.
_GPU_LAYER = {"A_g": 1, "F_g": 0}
_EXPERT_PREFILL_START = (Loop("once", (Op("D3"),)),)
_NEXT_LAYER = Op("D3", layer=1, when="first")
# What every expert-level layer does before its experts: attention, then the router.
_PREFILL_TO_ROUTE = (_NEXT_LAYER, Op("PrefillAttn"), Op("KVOut"), Op("Route"))
_DECODE_TO_ROUTE = (_NEXT_LAYER, Op("D4"), Op("PreAttn"), Op("GPUAttn"), Op("KVOut"),
                    Op("Route"))

EP = Schedule(
    name="EP", title="Experts placed (llama.cpp -ot, Fiddler)",
    summary="each layer's experts_gpu most popular experts stay on the GPU and run there, the "
            "others run on the CPU where their weights lie, at the same time; only hidden "
            "states cross the link",
    attention="gpu", paged=False, staging=False, ffn="split", placement=_GPU_LAYER,
    prefill=(*_EXPERT_PREFILL_START,
             Loop("layers", (*_PREFILL_TO_ROUTE, Op("D5"), Op("SharedFFN"), Op("GPUFFN"),
                             Op("CPUFFN"), Op("D6"), Op("Merge"), _LMHEAD))),
    decode_prologue=(),
    decode=(*_DECODE_TO_ROUTE, Op("D5"), Op("SharedFFN"), Op("GPUFFN"), Op("CPUFFN"), Op("D6"),
            Op("Merge"), _LMHEAD),
    streams=_streams(D4="h2d_kv"),
)

EC = Schedule(
    name="EC", title="Expert cache (Mixtral-offloading, MoE-Infinity)",
    summary="a cache of experts_gpu experts a layer on the GPU (LRU, or the most popular); once "
            "the router has chosen, the experts it misses cross the link and every chosen "
            "expert runs on the GPU",
    attention="gpu", paged=False, staging=False, ffn="cache", placement=_GPU_LAYER,
    prefill=(*_EXPERT_PREFILL_START,
             Loop("layers", (*_PREFILL_TO_ROUTE, Op("ExpertIn"), Op("SharedFFN"), Op("GPUFFN"),
                             _LMHEAD))),
    decode_prologue=(),
    decode=(*_DECODE_TO_ROUTE, Op("ExpertIn"), Op("SharedFFN"), Op("GPUFFN"), _LMHEAD),
    streams=_streams(D4="h2d_kv"),
)

# MoE-Infinity's activation-aware prefetch, Mixtral-offloading's speculative loading: while a
# layer's chosen experts run, the next layer's expected misses cross (once a layer, after its
# first micro-batch's router has run: the prediction reads its hidden state); what the
# predictor got wrong still crosses once the router has chosen. `policy.prefetch` is the share
# it gets right (unset, a published figure: specs.PREFETCH_PUBLISHED): the simulator has no
# predictor of its own (docs/experts.md).
ECP = Schedule(
    name="ECP", title="Expert cache with prefetch (MoE-Infinity)",
    summary="EC, and the next layer's expected misses cross the link while this layer's "
            "experts run; those the predictor missed cross once the router has chosen",
    attention="gpu", paged=False, staging=False, ffn="cache", placement=_GPU_LAYER,
    prefill=EC.prefill,
    decode_prologue=(Loop("once", (Op("ExpertAhead"),)),),
    decode=(*_DECODE_TO_ROUTE, Op("ExpertIn"), Op("ExpertAhead", layer=1, when="first"),
            Op("SharedFFN"), Op("GPUFFN"), _LMHEAD),
    streams=_streams(D4="h2d_kv"),
)

# FlexGen's dist_flex_opt.py: each stage runs S4's order over its own layers for one group of
# micro-batches at a time (its `num_inner_iterations`, one group per stage by default), reloading
# the stage's weights for every group, and sends the group's hidden states to the next stage; the
# last stage sends the sampled tokens back to the first.
PP = Schedule(
    name="PP", title="FlexGen pipeline parallelism",
    summary="S4's order with the layers split into one stage per GPU and the batch into one group "
            "per stage; every group reloads the stage's weights, hidden states cross between "
            "stages over the interconnect",
    attention="gpu", paged=False, staging=False, implementation="flexgen", parallel="pipeline",
    placement=_GPU_ATTENTION,
    prefill=S4.prefill,
    decode_prologue=S4.decode_prologue,
    decode=S4.decode,
    streams=S4.streams,
)

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (S1, S2, S3, S4, DS, S5, PP, EP, EC,
                                                       ECP)}
