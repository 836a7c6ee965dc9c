"""The tasks of the schedules that run a layer's routed FFN apart from the rest of it (S5, EP,
EC, ECP): the router on the GPU, the experts' inputs and outputs crossing to and from the host,
the CPU's experts, and the GPU's own (EP's placed experts, EC's cache, ECP's prefetch one layer
ahead). Rows are a micro-batch's prompt tokens in prefill, else its sequences.

:class:`FFNApart` is a part of :class:`taskgraph.exec.runtime.Runtime`, apart because it is a
concept of its own: its methods use the runtime's buffers and views, and it adds its own
(:meth:`FFNApart._ffn_buffers`, :meth:`FFNApart._expert_buffers`). Which expert lies in which
slot: :mod:`taskgraph.exec.expert_cache`.
"""

from __future__ import annotations

import torch

from taskgraph.dag.routing import Routing
from taskgraph.exec.expert_cache import CachedExperts, ExpertBlocks, PlacedExperts
from taskgraph.exec.marks import runs
from taskgraph.kernels.ops import (ExpertSum, attn_width, expert_biases, experts, mlp, norm,
                                   o_projection, prefill_attention, route, shared_experts)


class FFNApart:
    """The routed FFN's buffers and tasks where it runs apart from the layer (a part of
    :class:`taskgraph.exec.runtime.Runtime`)."""

    def _prediction_buffers(self) -> None:
        """ECP: what ExpertAhead predicts from, micro-batch 0's normed hidden state as Route
        left it, in a ring of two (see :meth:`_ExpertAhead`); None for other schedules."""
        self._ahead_in = ([self._dev(self.mu, self.m.h) for _ in range(2)]
                          if self.prefetches and not self.zero_copy else None)

    def _ffn_buffers(self) -> None:
        """The routed FFN's buffers per micro-batch (S5, EP, EC): the prefill attention output,
        the normed hidden state, the router's gates and expert ids, the experts' output, each
        on the device and the host (one buffer with zero copy); and views of each layer's
        experts where they lie in host memory."""
        m, rows = self.m, self.mu * self.P
        dev, host, zero_copy = self._dev, self._host, self.zero_copy
        self.attn_prefill = [dev(rows, attn_width(m)) for _ in range(self.n)]
        self.normed = [dev(rows, m.h) for _ in range(self.n)]
        self.gates = [dev(rows, m.k) for _ in range(self.n)]
        self.expert_ids = [torch.zeros(rows, m.k, dtype=torch.long, device=self.device)
                           for _ in range(self.n)]
        self.ffn_out_host = [host(rows, m.h) for _ in range(self.n)]
        if zero_copy:
            self.normed_host, self.gates_host = self.normed, self.gates
            self.expert_ids_host, self.ffn_out = self.expert_ids, self.ffn_out_host
        else:
            self.normed_host = [host(rows, m.h) for _ in range(self.n)]
            self.gates_host = [host(rows, m.k) for _ in range(self.n)]
            self.expert_ids_host = [torch.zeros(rows, m.k, dtype=torch.long,
                                                pin_memory=self.pin_memory)
                                    for _ in range(self.n)]
            self.ffn_out = [dev(rows, m.h) for _ in range(self.n)]
        # the shared experts' output (SharedFFN), which Merge or a cache's GPUFFN adds in
        self.shared_out = [dev(rows, m.h) for _ in range(self.n)] if m.shared_experts else None


    def _hidden(self, s: int, j: int) -> torch.Tensor:
        """The residual stream of micro-batch j as rows [T, h]: a view, updated in place."""
        return self.x_prefill[j].view(-1, self.m.h) if s == 0 else self.x[j]

    @runs("PrefillAttn")
    def _PrefillAttn(self, s: int, l: int, j: int) -> None:
        rows = slice(j * self.mu, (j + 1) * self.mu)
        if l == 0:               # the residual stream starts at the prompts' embeddings
            self.x_prefill[j].copy_(self.embed[self.prompts[rows]])
        attn, k, v = prefill_attention(self.x_prefill[j], self.norms[l][0], self._view(s, l, j),
                                       self.m, self.rope, self.lens[j] if self.ragged else None,
                                       self.m.window(l))
        self.attn_prefill[j].copy_(attn)
        self._prompt_kv(s, l, j, k, v)

    @runs("Route")
    def _Route(self, s: int, l: int, j: int) -> None:
        """O projection, residual, norm and the router's choice; on a dense layer its MLP
        instead, into the residual (no expert task runs there)."""
        x, W = self._hidden(s, j), self._view(s, l, j)
        x += o_projection(self.attn_prefill[j] if s == 0 else self.attn[j], W)
        normed = norm(x, self.norms[l][1], self.m.rms_norm_eps)
        if W.dense:
            x += mlp(normed, W, "dense")
        else:
            ids, gates = route(normed, W, self.m)
            T = x.shape[0]
            self.normed[j][:T].copy_(normed)
            self.expert_ids[j][:T].copy_(ids)
            self.gates[j][:T].copy_(gates)
        if self._ahead_in is not None and j == 0:
            # ECP: what the next layer's ExpertAhead predicts from (in prefill each sequence's
            # last prompt token, whose step the first decode step follows)
            if s == 0:
                normed = normed.view(self.mu, self.P, -1)[
                    torch.arange(self.mu, device=self.device), self.lens[j] - 1]
            self._ahead_in[(s * self.L + l) % 2].copy_(normed)

    @runs("D5")
    def _D5(self, s: int, l: int, j: int) -> None:
        T = self._hidden(s, j).shape[0]
        self.normed_host[j][:T].copy_(self.normed[j][:T], non_blocking=True)
        self.expert_ids_host[j][:T].copy_(self.expert_ids[j][:T], non_blocking=True)
        self.gates_host[j][:T].copy_(self.gates[j][:T], non_blocking=True)

    @runs("CPUFFN")
    def _CPUFFN(self, s: int, l: int, j: int) -> None:
        T = self.mu * self.P if s == 0 else self.mu
        # EP: only the experts the GPU does not hold (S5: every expert)
        only = self.placed.on_host[l] if self.plan.schedule.ffn == "split" else None
        self.ffn_out_host[j][:T].copy_(experts(
            self.normed_host[j][:T], self.expert_ids_host[j][:T], self.gates_host[j][:T],
            self._host_views[l], self.m, only))

    @runs("D6")
    def _D6(self, s: int, l: int, j: int) -> None:
        T = self._hidden(s, j).shape[0]
        self.ffn_out[j][:T].copy_(self.ffn_out_host[j][:T], non_blocking=True)

    @runs("Merge")
    def _Merge(self, s: int, l: int, j: int) -> None:
        x = self._hidden(s, j)
        T = x.shape[0]
        if self.plan.schedule.ffn == "split":
            # The GPU's part and the CPU's summed first, then added to the residual, as the
            # reference adds the whole sum: with top-2 routing each part holds at most the one
            # or two terms of a token's sum, so this is the reference's sum bit for bit.
            x += self._with_shared(j, T, self.ffn_gpu[j][:T] + self.ffn_out[j][:T])
        else:
            x += self._with_shared(j, T, self.ffn_out[j][:T])

    def _with_shared(self, j: int, T: int, routed: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum and the shared experts' output, added as the reference
        adds them."""
        return routed if self.shared_out is None else routed + self.shared_out[j][:T]

    @runs("SharedFFN")
    def _SharedFFN(self, s: int, l: int, j: int) -> None:
        T = self._hidden(s, j).shape[0]
        self.shared_out[j][:T].copy_(shared_experts(self.normed[j][:T], self._view(s, l, j)))

    # --- experts on the GPU (EP: the most popular, placed; EC: a cache): exec.expert_cache ---

    def _expert_buffers(self) -> None:
        """EP: the placed experts, and a buffer per micro-batch for the GPU's part of the sum.
        EC: the cache's slots and the staging (and ECP's prefetch) area."""
        m, p, sched = self.m, self.plan.scenario.policy, self.plan.schedule
        blocks = ExpertBlocks(m, self.w, self._quantized, self.dtype, self.device)
        n = min(p.experts_gpu, m.E)
        if sched.ffn == "split":
            self.placed = PlacedExperts(self._moe_rows(self.plan.held), blocks,
                                        self._host_views, self.zero_copy)
            self.ffn_gpu = [self._dev(self.mu * self.P, m.h) for _ in range(self.n)]
        else:
            self.cache = CachedExperts(
                blocks, n, staging_slots=min(m.E, self.mu * m.k),
                prefetch_slots=min(m.E, p.N * m.k) if self.prefetches else 0,
                dense=self.dense,
                popular=(self._moe_rows(Routing.of(self.plan.scenario).popular(n))
                         if p.eviction == "popular" else None),
                zero_copy=self.zero_copy)

    def _moe_rows(self, rows: list) -> list[list[int]]:
        """Each layer's experts of `rows` (the placed ones, ``Plan.held``; a fixed cache's,
        ``Routing.popular``), sorted; none on a dense layer."""
        return [[] if dense else sorted(int(e) for e in row)
                for row, dense in zip(rows, self.dense)]

    @property
    def prefetches(self) -> bool:
        """ECP: the decode launches ExpertAhead, a prefetch one layer ahead."""
        return any(op.kind == "ExpertAhead" for op in self.plan.schedule.decode)

    @runs("GPUFFN")
    def _GPUFFN(self, s: int, l: int, j: int) -> None:
        """EP: the experts the GPU holds; the others are the CPU's (CPUFFN), Merge adds both.
        EC: every chosen expert, into the residual, in the rounds ExpertIn planned
        (:meth:`CachedExperts.rounds`). Each round's outputs fill their rows of one buffer
        (kernels.ops.ExpertSum) that is weighed and summed once at the end: the reference's
        sum bit for bit, whatever k.

        Known difference from the simulator's task model: there ExpertIn moves every miss's
        bytes and GPUFFN computes every chosen expert; here, when a micro-batch misses more than
        the S staging slots (prefill), GPUFFN performs the later rounds' copies itself. The
        bytes and flops are the same, split between the two tasks otherwise
        (``copies_in_gpuffn`` counts those copies)."""
        T = self._hidden(s, j).shape[0]
        normed, ids, gates = self.normed[j][:T], self.expert_ids[j][:T], self.gates[j][:T]
        if self.placed is not None:
            self.ffn_gpu[j][:T].copy_(experts(normed, ids, gates, self.placed.weights[l],
                                              self.m, self.placed.on_gpu[l],
                                              expert_biases(self._view(s, l, j))))
            return
        x = self._hidden(s, j)
        if self.cache.pool is None:                     # zero copy: where they lie
            x += self._with_shared(j, T, experts(normed, ids, gates, self._host_views[l],
                                                 self.m))
            return
        parts = ExpertSum(normed, ids, gates, self.m, expert_biases(self._view(s, l, j)))
        for weights, chosen in self.cache.rounds(l, j):
            parts.add(weights, chosen)
        x += self._with_shared(j, T, parts.result())

    @runs("ExpertIn")
    def _ExpertIn(self, s: int, l: int, j: int) -> None:
        """The micro-batch's chosen experts the layer's cache misses, host -> device
        (:meth:`CachedExperts.bring_in`). Reading the router's choice on the host: on the CPU
        backend the ids are host memory already; on CUDA this stream has waited for Route's
        event, and ``tolist()`` waits for the copy back (a host sync, in this task's time, as a
        real cache's lookup is).

        A slot it overwrites may have been read by the previous micro-batch's GPUFFN of this
        layer, or (staging) by the previous layer's: the graph orders them through the GPU
        stream (this task waits for this micro-batch's Route, launched there after that
        GPUFFN)."""
        T = self._hidden(s, j).shape[0]
        self.cache.bring_in(s, l, j, torch.unique(self.expert_ids[j][:T]).tolist())

    @runs("ExpertAhead")
    def _ExpertAhead(self, s: int, l: int, j: int) -> None:
        """ECP: predict the experts layer l's router will choose, and copy those its cache does
        not hold into the prefetch area (:meth:`CachedExperts.prefetch`), while layer l - 1
        runs. The prediction is Mixtral-offloading's speculative guess: layer l's router
        applied to the hidden state layer l - 1's router saw (micro-batch 0's normed rows,
        which Route(l - 1, 0) left in ``_ahead_in``; for layer 0, the previous step's last
        layer's, in prefill each sequence's last prompt token), each row's top k.

        * Its input: Route(l - 1, 0) writes ``_ahead_in[(s L + l - 1) % 2]``, the one this task
          reads (its data dependency). The next Route to write that buffer is Route(l + 1, 0),
          launched on the GPU stream after GPUFFN(l, 0), which waits for this task.
        * Layer l's router: in layer l's weights, which the decode's D3(l) copied into their
          half of the double buffer earlier on this same h2d stream (launched at layer l - 1's
          first micro-batch, before ExpertIn(l - 1, 0) and this task), and which D3(l + 2),
          later on this stream, overwrites; or resident."""
        x = self._ahead_in[(s * self.L + l - 1) % 2]
        ids, _ = route(x, self._view(s, l, 0), self.m)
        self.cache.prefetch(s, l, torch.unique(ids).tolist())
