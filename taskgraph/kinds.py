"""What a task kind is: every kind with its meaning, and the sets of kinds the rest of `tg` asks
about (which move data, which read streamed weights, which run on the host, which tensor or
pipeline parallelism adds). One place, so that a new kind is named once; everything above it
(work, cost, graph, engine, executor, traces) imports from here, and this imports nothing.
"""

from __future__ import annotations

# Every task kind, with a one-line meaning. Schedules place them on streams.
KINDS: dict[str, str] = {
    "Prefill": "one layer of the prompt on the GPU: attention and MoE FFN over mu*p tokens",
    "KVOut": "new K,V of a micro-batch, GPU -> CPU (the whole prompt's in prefill, one token's in decode)",
    "PreAttn": "RMSNorm + QKV projection on the GPU",
    "D1": "Q, K, V of a micro-batch, GPU -> CPU",
    "CPUAttn": "grouped-query decode attention over the CPU KV cache; appends the new K,V",
    "D2": "attention output (hidden state) of a micro-batch, CPU -> GPU",
    "D4": "KV cache of a micro-batch, CPU -> GPU (GPU-attention schedules)",
    "GPUAttn": "decode attention on the GPU over the prefetched KV",
    "PostAttn": "O projection + residual + RMSNorm + router + top-k SwiGLU experts",
    "D3": "a page of a layer's streamed weights, CPU -> GPU",
    "W_CtoPin": "a page of weights, pageable CPU memory -> pinned staging buffer",
    "LMHead": "final norm + LM head + sampling of one micro-batch",
    # FFN on the CPU (S5): the GPU routes, the CPU runs the experts where their weights lie.
    "PrefillAttn": "one layer's RMSNorm, QKV and causal attention over the prompt, on the GPU",
    "Route": "O projection + residual + RMSNorm + router (top-k) on the GPU",
    "D5": "normed hidden state and routing of a micro-batch, GPU -> CPU",
    "CPUFFN": "top-k SwiGLU experts on the CPU, reading their weights in host memory",
    "D6": "expert output of a micro-batch, CPU -> GPU",
    "Merge": "residual add of the expert output on the GPU",
    # Tensor parallelism (several GPUs): each GPU runs a shard of every GPU task, and a layer's
    # PostAttn (or Prefill) runs as the parts between its two all-reduces.
    "OProj": "O projection of a micro-batch's attention output (a GPU's heads: a partial sum)",
    "AllReduceAttn": "the O projection's partial sums all-reduced, over the GPUs' interconnect",
    "MoE": "residual + RMSNorm + router + top-k SwiGLU experts (a GPU's columns of each expert: "
           "a partial sum)",
    "AllReduce": "the experts' partial sums all-reduced, over the GPUs' interconnect",
    "GatherLogits": "the vocabulary shards' logits gathered for sampling, over the interconnect",
    # Pipeline parallelism (several GPUs): each GPU runs a stage of consecutive layers.
    "Send": "a micro-batch's hidden state to the next pipeline stage's GPU, over the interconnect",
    "SendTokens": "a micro-batch's sampled tokens from the last pipeline stage to the first",
    # Expert-level offloading (EP, EC): some experts of a layer are held on the GPU.
    "GPUFFN": "the top-k SwiGLU experts a micro-batch routes to that the GPU holds (placed or "
              "cached), on the GPU",
    "ExpertIn": "the experts a micro-batch routes to that the GPU's expert cache misses, "
                "CPU -> GPU",
    "ExpertAhead": "the experts a predictor expects a layer's router to choose that the cache "
                   "misses, CPU -> GPU, while the layer before runs",
}

#: Kinds whose work lies on the link and is counted as bytes moved.
TRANSFERS = frozenset({"KVOut", "D1", "D2", "D3", "D4", "D5", "D6", "ExpertIn", "ExpertAhead",
                       "AllReduce", "GatherLogits", "Send", "SendTokens"})
#: Kinds that read the streamed weights of their layer, and which section they read.
WEIGHT_SECTIONS: dict[str, str] = {"Prefill": "all", "PreAttn": "qkv", "PostAttn": "post",
                                   "PrefillAttn": "qkv", "Route": "route", "OProj": "o",
                                   "MoE": "moe"}
#: Kinds that run in prefill and decode alike, priced by the tokens of the phase.
EITHER_PHASE = frozenset({"Route", "D5", "CPUFFN", "D6", "Merge", "PrefillAttn", "AllReduce",
                           "Send", "OProj", "AllReduceAttn", "MoE", "GPUFFN", "ExpertIn"})
#: Kinds indexed by weight page rather than by micro-batch.
PAGED = frozenset({"D3", "W_CtoPin"})
#: Kinds that run on the host (its cores, its memory copies): on several GPUs, each GPU's
#: process runs its own part.
HOST_KINDS = frozenset({"CPUAttn", "CPUFFN", "W_CtoPin"})
#: Under tensor parallelism, a kind whose output is a sum of per-GPU partial sums, and the
#: collective that completes it (Megatron-style: column-parallel QKV and expert up/gate
#: projections, row-parallel O and down projections; a vocabulary-parallel LM head).
COLLECTIVE_AFTER: dict[str, str] = {"OProj": "AllReduceAttn", "MoE": "AllReduce",
                                    "LMHead": "GatherLogits"}
COLLECTIVES = frozenset(COLLECTIVE_AFTER.values())
#: Under tensor parallelism, a kind that holds an all-reduce inside it runs as its parts: the
#: residual, norm and router after the O projection need the whole hidden state.
TP_PARTS: dict[str, tuple[str, ...]] = {"PostAttn": ("OProj", "MoE"),
                                        "Prefill": ("PrefillAttn", "OProj", "MoE")}
#: Kinds that only tensor parallelism launches.
TP_ONLY = frozenset({"OProj", "MoE"})
#: Under pipeline parallelism, a kind whose output another stage reads, and the send carrying it
#: there: a stage's last layer's hidden state; the sampled tokens back to the first stage.
SEND_AFTER: dict[str, str] = {"PostAttn": "Send", "Prefill": "Send", "LMHead": "SendTokens"}
SENDS = frozenset(SEND_AFTER.values())
#: Kinds that run on a GPU, cross its own link, or run on the host for it: split across GPUs
#: under tensor parallelism, one shard per GPU (each GPU moves its shard over its own link, its
#: process computes its heads' CPU attention and copies its part of each page into pinned
#: memory); placed on the GPU of their layer's stage (pipeline) or of their group (data
#: parallelism).
SHARDED = frozenset(KINDS) - COLLECTIVES - SENDS

#: Kinds in their one order: a kind's index in arrays of kinds (compiled programs, cost tables).
KIND_NAMES: tuple[str, ...] = tuple(KINDS)
KIND_INDEX: dict[str, int] = {k: i for i, k in enumerate(KIND_NAMES)}
#: Kinds that copy between host and device memory (the link, or the host's pinned staging):
#: what the CPU backend's zero copy makes no-ops.
HOST_DEVICE_COPIES = frozenset({"D1", "D2", "D3", "D4", "D5", "D6", "ExpertIn", "ExpertAhead",
                                "KVOut", "W_CtoPin"})
#: Kinds that move data rather than compute (a trace draws them as copies).
MOVES = TRANSFERS | {"W_CtoPin"}
