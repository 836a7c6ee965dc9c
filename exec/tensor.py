"""Tensor parallelism executed: each GPU's shard of the model, and the collectives between them.

A GPU's shard is Megatron's: its block of query heads with their KV heads (column-parallel QKV,
attention, the KV cache), the matching columns of the O projection (row-parallel: a partial sum),
its columns of every expert's gate and up projections and rows of the down projection (a
partial sum), its rows of the LM head (vocabulary-parallel); norms, router and embedding whole.
So a shard is a Mixtral with n_q/n heads, n_kv/n KV heads and h_i/n expert width, and one
:class:`~taskgraph.exec.runtime.Runtime` runs it, with the parts only tensor parallelism has
(``OProj``, ``MoE``, the partial LM head) added here.

A shard's weights are the elements of the full layer its GPU reads, in the full layer's order,
so the plan's weight pages (byte ranges of the full layer) map onto contiguous ranges of the
shard's: a shard's copy of page p moves exactly the elements of page p it will read.

:class:`TensorParallel` runs every shard in one process (a task of GPU g, or of the host for GPU
g, on shard g; a collective as a sum over the shards); :mod:`taskgraph.exec.distributed`
runs one shard per process and the collectives over ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taskgraph.dag.builder import Plan
from taskgraph.errors import TgError
from taskgraph.exec.pages import page_elements
from taskgraph.exec.marks import runs
from taskgraph.exec.runtime import Runtime
from taskgraph.kernels.ops import experts, lm_head, rmsnorm, route
from taskgraph.kernels.weights import ModelWeights, layer_sections
from taskgraph.kinds import COLLECTIVES
from taskgraph.specs import ModelSpec


@dataclass(frozen=True)
class Shard:
    """What a Runtime needs to run GPU `gpu`'s shard."""

    gpu: int
    model: ModelSpec
    cut: int                           # first streamed element of the shard's layer
    pages: list[tuple[int, int]]       # the shard's element range of each page


def check_shardable(m: ModelSpec, n: int) -> None:
    if m.n_kv % n and n % m.n_kv:
        raise TgError(
            f"Tensor-parallel execution splits model.n_kv = {m.n_kv} KV heads over "
            f"hardware.gpu.count = {n} GPUs: the count must divide them or be a multiple of "
            "them (each GPU a copy of one); choose another GPU count.")
    for field, value in (("n_q", m.n_q), ("h_i", m.h_i), ("V", m.V)):
        if value % n:
            raise TgError(
                f"Tensor-parallel execution splits model.{field} = {value} evenly over "
                f"hardware.gpu.count = {n} GPUs; choose a GPU count that divides it.")


def shard_model(m: ModelSpec, n: int) -> ModelSpec:
    return m.model_copy(update={"n_q": m.n_q // n, "n_kv": max(m.n_kv // n, 1),
                                "h_i": m.h_i // n, "head_dim": m.d})


def shard_elements(m: ModelSpec, n: int, g: int) -> torch.Tensor:
    """Indices into the full layer's flat vector of GPU g's elements, in the full layer's
    order (so increasing)."""
    parts = []
    for s in layer_sections(m):
        rows, cols = s.shape
        idx = torch.arange(s.offset, s.offset + s.size).view(rows, cols)
        base = s.name.split(".")[0]
        if base in ("k", "v") and n > m.n_kv:          # a copy of the KV head its queries use
            head = g * m.n_kv // n
            parts.append(idx[head * m.d:(head + 1) * m.d])
        elif base in ("q", "k", "v", "w1", "w3"):      # column-parallel: a block of rows
            parts.append(idx[g * rows // n:(g + 1) * rows // n])
        elif base in ("o", "w2"):                      # row-parallel: a block of columns
            parts.append(idx[:, g * cols // n:(g + 1) * cols // n])
        else:                                          # the router: every GPU's whole
            parts.append(idx)
    return torch.cat([p.reshape(-1) for p in parts])


def make_shard(plan: Plan, weights: ModelWeights, g: int) -> tuple[Shard, ModelWeights]:
    """GPU g's shard of the plan's model: its spec, weights and page ranges."""
    m, n = plan.scenario.model, plan.tp
    idx = shard_elements(m, n, g)
    cut, pages = page_elements(plan.layout, weights.layer_numel, m.dtype_bytes)
    at = lambda e: int(torch.searchsorted(idx, e))      # noqa: E731 - first shard element >= e
    vocab = slice(g * m.V // n, (g + 1) * m.V // n)
    shard_w = ModelWeights(shard_model(m, n), [flat[idx] for flat in weights.layers],
                           weights.norms, weights.embed, weights.final_norm,
                           weights.lm_head[vocab])
    return (Shard(g, shard_w.model, at(cut), [(at(a), at(b)) for a, b in pages]), shard_w)


class ShardRuntime(Runtime):
    """One GPU's shard: the Runtime's tasks on the shard's heads and columns, plus the parts
    tensor parallelism splits PostAttn into, each leaving a partial sum for a collective."""

    def __init__(self, plan: Plan, weights: ModelWeights, prompts: torch.Tensor,
                 device: torch.device, shard: Shard, **kw):
        super().__init__(plan, weights, prompts, device, shard=shard, **kw)
        m, mu, dtype = self.m, self.mu, weights.embed.dtype
        rows = mu * self.P
        self.attn_prefill = [torch.zeros(rows, m.q_dim, dtype=dtype, device=device)
                             for _ in range(self.n)]
        self.part = [torch.zeros(rows, m.h, dtype=dtype, device=device) for _ in range(self.n)]
        self.logit_part = [torch.zeros(mu, weights.lm_head.shape[0], dtype=dtype, device=device)
                           for _ in range(self.n)]

    @runs("OProj")
    def _OProj(self, s: int, l: int, j: int) -> None:
        attn = self.attn_prefill[j] if s == 0 else self.attn[j]
        out = attn @ self._view(s, l, j)["o"].T
        self.part[j][:out.shape[0]].copy_(out)

    @runs("MoE")
    def _MoE(self, s: int, l: int, j: int) -> None:
        x = self._hidden(s, j)
        normed = rmsnorm(x, self.norms[l][1], self.m.rms_norm_eps)
        W = self._view(s, l, j)
        out = experts(normed, *route(normed, W, self.m), W, self.m)
        self.part[j][:out.shape[0]].copy_(out)

    @runs("LMHead")
    def _LMHead_part(self, s: int, l: int, j: int) -> None:
        x = self._head_input(s, j)
        self.logit_part[j].copy_(lm_head(x, self.final_norm, self.head, self.m.rms_norm_eps))

    def partial(self, s: int, j: int) -> torch.Tensor:
        """The partial sum the last part left for micro-batch j (rows of the hidden state)."""
        return self.part[j][:self._hidden(s, j).shape[0]]

    def add(self, s: int, j: int, total: torch.Tensor) -> None:
        """A completed sum into the residual stream."""
        self._hidden(s, j).add_(total)

    def take(self, s: int, j: int, logits: torch.Tensor) -> None:
        """The gathered logits: sample, as the one-GPU LM head does."""
        self._sample(s, j, logits, self._head_input(s, j))


class TensorParallel:
    """Every GPU's shard in one process: what the dispatcher calls for a tensor-parallel plan."""

    def __init__(self, plan: Plan, weights: ModelWeights, prompts: torch.Tensor,
                 device: torch.device, **kw):
        check_shardable(plan.scenario.model, plan.tp)
        self.plan = plan
        self.shards = []
        for g in range(plan.tp):
            shard, w = make_shard(plan, weights, g)
            self.shards.append(ShardRuntime(plan, w, prompts, device, shard, **kw))

    def run(self, step: int, kind: str, layer: int, index: int, gpu: int = -1) -> None:
        last = self.shards[0].last_steps
        if kind in COLLECTIVES and last is not None and step > last[index]:
            return                    # the micro-batch's requests have all finished
        if gpu >= 0:                  # a GPU's task, or the host's for that GPU's process
            self.shards[gpu].run(step, kind, layer, index)
        elif kind == "GatherLogits":
            logits = torch.cat([rt.logit_part[index] for rt in self.shards], dim=-1)
            for rt in self.shards:
                rt.take(step, index, logits)
        else:                         # AllReduceAttn, AllReduce
            total = sum(rt.partial(step, index) for rt in self.shards)
            for rt in self.shards:
                rt.add(step, index, total)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.shards[0].outputs()
