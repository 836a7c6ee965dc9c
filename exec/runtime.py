"""What each task of a compiled program really does: buffers and the work of every task kind.

The memory layout follows the memory model (docs/design.md §3.5): host memory holds every layer's
weights and the KV cache of all sequences; the device holds the resident part of every layer
(``r_w``), a double-buffered weight area for the streamed part (global layer ``g`` uses half
``g % 2``), ``kv_slots`` GPU KV slots, and per micro-batch activation buffers; pinned staging slots sit
between host weights and the device (CGOPipe). Every buffer is allocated once, up front; the task
graph's buffer-reuse edges are what keep tasks from clobbering each other.

Expert-level schedules keep experts on the device besides (EP placed, EC a cache, ECP a cache
and a prefetch area): :mod:`taskgraph.exec.expert_cache` holds which expert lies in which slot;
the tasks here say when they cross.

Where the plan's pages fall in a layer's elements, and the start-up check that a task never
reads a page the graph did not make it wait for: :mod:`taskgraph.exec.pages`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from taskgraph.dag.builder import Plan
from taskgraph.dag.routing import Routing
from taskgraph.kernels.ops import (ExpertSum, LayerView, Rope, attn_width, decode_attention,
                                   decode_mask, expert_biases, experts, kv_shape, lm_head, mlp,
                                   norm, o_projection, post_attention, pre_attention,
                                   prefill_attention, prefill_layer, qkv_widths, rotate_qkv,
                                   route, shared_experts, split_qkv)
from taskgraph.exec.expert_cache import CachedExperts, ExpertBlocks, PlacedExperts
from taskgraph.kernels.quant import QuantizedExperts, expert_format
from taskgraph.exec.pages import check_pages, layer_pages
from taskgraph.kernels.weights import ModelWeights
from taskgraph.kinds import HOST_DEVICE_COPIES, PAGED, SENDS


def runs(kind: str) -> Callable[[Callable], Callable]:
    """Mark a method as the executor's work for a task kind (:meth:`Runtime.kernels`)."""
    def mark(method: Callable) -> Callable:
        method.runs = kind
        return method
    return mark


class Runtime:
    """Buffers for one plan on one device, and :meth:`run` for any task.

    Prompts are right-padded to the longest, P tokens: ``prompt_lens`` gives each sequence's own
    length (default: all P). Every sequence owns cache columns [0, P) for its prompt (the
    columns past its length are masked out) and column P + s - 1 for decode step s, while RoPE
    uses its own position, length + s - 1; so copies stay contiguous and results are those of
    an unpadded run. ``record_logits`` keeps every step's logits (for checking against another
    implementation).

    ``last_steps`` (one per micro-batch) is the last step a micro-batch's requests need, -1 for
    one holding none: its tasks of later steps do nothing (they are still scheduled and timed),
    as the simulator prices a micro-batch whose requests have all finished.

    ``zero_copy`` (CPU backend only) runs the CPU executor as a CPU inference engine rather than
    a transfer emulator: device and host buffers are one (weights are read where they lie, the
    KV cache and hidden states have one copy), and every transfer task is a no-op, still
    scheduled and timed, so the graph, its order and its trace are unchanged."""

    def __init__(self, plan: Plan, weights: ModelWeights, prompts: torch.Tensor,
                 device: torch.device, pin_memory: bool = False,
                 prompt_lens: torch.Tensor | None = None, record_logits: bool = False,
                 zero_copy: bool = False, last_steps: list[int] | None = None,
                 shard: Any = None):
        if zero_copy and device.type != "cpu":
            raise ValueError("zero_copy shares host and device buffers: CPU backend only")
        # One GPU's shard under tensor parallelism (taskgraph.exec.tensor.Shard): its model
        # (a GPU's heads and expert columns), and where the plan's pages fall in its weights
        # (_weight_layout).
        self.plan, self.w, self.device = plan, weights, device
        self.m = shard.model if shard else plan.scenario.model
        self.mu, self.n, self.L, self.G = plan.scenario.policy.mu, plan.n, self.m.L, plan.G
        self.dtype = weights.embed.dtype
        self.zero_copy, self.pin_memory, self.last_steps = zero_copy, pin_memory, last_steps
        self._prompts(prompts, prompt_lens)
        numel = self._weight_layout(shard)
        self._tasks = self._task_table()
        self._weights(numel)
        self._kv_buffers()
        self._activation_buffers()
        if plan.schedule.experts_on_host:
            self._ffn_buffers()
        # the experts the GPU keeps: EP's placed ones, or EC's cache (exec.expert_cache)
        self.placed: PlacedExperts | None = None
        self.cache: CachedExperts | None = None
        if plan.schedule.expert_level:
            self._expert_buffers()
        self._prediction_buffers()
        self._output_buffers(record_logits)

    # --- set-up: the buffers, each allocated once, apart from the tasks ----------------------

    def _dev(self, *shape: int) -> torch.Tensor:
        """A zeroed device buffer in the weights' dtype."""
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def _host(self, *shape: int) -> torch.Tensor:
        """A zeroed host buffer in the weights' dtype (pinned on CUDA)."""
        return torch.zeros(*shape, dtype=self.dtype, pin_memory=self.pin_memory)

    def _prompts(self, prompts: torch.Tensor, prompt_lens: torch.Tensor | None) -> None:
        """The prompts on the device, right-padded to P tokens, each sequence's length per
        micro-batch (on the device and the host), and the rotary embedding of the positions."""
        self.P = prompts.shape[1]
        self.prompts = prompts.to(self.device)
        lens = (torch.full((prompts.shape[0],), self.P) if prompt_lens is None
                else prompt_lens.cpu().long())
        self.ragged = bool((lens < self.P).any())
        self.lens = [lens[j * self.mu:(j + 1) * self.mu].to(self.device) for j in range(self.n)]
        self.lens_host = [lens[j * self.mu:(j + 1) * self.mu] for j in range(self.n)]
        self.rope = Rope(self.m, self.device)

    def _weight_layout(self, shard: Any) -> dict[bool, int]:
        """Which elements of a layer live on the device (all, or all but the experts when they
        run apart): resident below ``cut``, streamed in ``pages`` above it, checked against what
        each task waits for; with zero copy every one is read where it lies. Per class of layer
        (an MoE layer, False; a dense one, True: ``self.dense[l]``), as is what this returns:
        how many elements of a layer of the class that is."""
        self.dense = [self.m.is_dense(l) for l in range(self.L)]
        numel, self.cut, self.pages = layer_pages(self.plan, self.m, set(self.dense))
        if shard is not None:          # tensor parallelism: Mixtral's layers, all alike
            numel, self.cut, self.pages = ({False: self.w.layer_numel}, {False: shard.cut},
                                           {False: shard.pages})
        check_pages(self.plan, self.m, self.pages)
        if self.zero_copy:
            self.cut, self.pages = dict(numel), {dense: [] for dense in numel}
        return numel

    #: Each task kind this class runs -> the name of its method marked ``@runs`` (a
    #: subclass's mark overrides its base's), found once, as the class is made: the table of a
    #: run looks the methods up by name, so a method replaced later is what runs.
    kernels: dict[str, str] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.kernels = {**cls.kernels, **_marked(cls)}

    def _task_table(self) -> dict[str, Callable[[int, int, int], None]]:
        """Each task kind's work: the methods marked ``@runs``. One device: no tensor-parallel
        parts or collectives to run (:class:`taskgraph.exec.tensor.ShardRuntime` runs the
        parts). Pipeline stages in one process share the device: what a send carries is already
        there (the graph still orders the stages through it). Zero copy: every host-device
        copy is a no-op, still scheduled and timed."""
        tasks = {kind: getattr(self, name) for kind, name in self.kernels.items()}
        tasks.update({kind: _nothing for kind in SENDS})
        if self.zero_copy:
            tasks.update({kind: _nothing for kind in HOST_DEVICE_COPIES})
        return tasks

    def _weights(self, numel: dict[bool, int]) -> None:
        """The weights on the device: each layer's resident prefix (``r_w``), the double buffer
        its streamed part crosses into, the pinned staging pages, a view of each layer over
        each half; the norms, the embedding and the LM head. One double buffer per GPU: on
        several GPUs in pipeline or data parallel (one process, one device) each stage or group
        keeps its own, as on its GPU."""
        # The schedules that keep the experts on the host copy them from pinned memory
        # (Schedule.weights_pinned; the staging schedules pin their pages instead). Each layer is
        # pinned in its place, one at a time, so that the host never holds two copies of the
        # model; later runs on the same weights find them pinned.
        if self.pin_memory and self.plan.schedule.experts_on_host:
            for l, flat in enumerate(self.w.layers):
                if not flat.is_pinned():
                    self.w.layers[l] = flat.pin_memory()
            for l, store in enumerate(self.w.experts_q or ()):
                if store is not None and not store.is_pinned():
                    self.w.experts_q[l] = store.pin_memory()
        self.resident = [flat[:self.cut[dense]].to(self.device)
                         for flat, dense in zip(self.w.layers, self.dense)]
        streamed = max(numel[dense] - self.cut[dense] for dense in numel)   # the largest layer's
        self.halves = [self._dev(streamed) for _ in range(2 * self.plan.groups)]
        page_max = max((b - a for pages in self.pages.values() for a, b in pages), default=0)
        self.pinned = [self._host(page_max) for _ in range(self.plan.schedule.pin_slots)]
        self.norms = [(a.to(self.device), b.to(self.device)) for a, b in self.w.norms]
        extras = [{k: v.to(self.device) for k, v in small.items()} for small in self.w.extras]
        self._views = {(l, half): LayerView(self.m, self.resident[l], self.halves[half],
                                            extras[l], self.dense[l])
                       for l in range(self.L) for half in range(len(self.halves))}
        # each layer where it lies in host memory: what the CPU's tasks read (its experts, and
        # MLA's up-projection for CPU attention)
        empty = torch.empty(0, dtype=self.w.embed.dtype)
        self._host_views = [LayerView(self.m, flat, empty, small, dense)
                            for flat, small, dense in zip(self.w.layers, self.w.extras,
                                                          self.dense)]
        # and each layer's experts there: in its flat vector, or at 8 or 4 bits apart from it
        self._quantized = expert_format(self.m)
        self._host_experts = (self._host_views if self._quantized is None else
                              [QuantizedExperts(self.m, self._quantized, store,
                                                {e: e for e in range(self.m.E)}, self.dtype)
                               if store is not None else None for store in self.w.experts_q])
        self.embed = self.w.embed.to(self.device)
        self.final_norm = self.w.final_norm.to(self.device)
        self.head = self.w.lm_head.to(self.device)
        self.head_bias = None if self.w.head_bias is None else self.w.head_bias.to(self.device)

    def _kv_buffers(self) -> None:
        """The KV cache: in host memory for every (layer, micro-batch), P prompt columns then
        one a decode step; and the GPU's KV slots (``kv_slots`` per GPU, none with zero copy,
        where attention reads the cache where it lies)."""
        m, T = self.m, self.P + self.G
        heads, kw, vw = kv_shape(m)
        self.k_cache = [[self._host(self.mu, T, heads, kw) for _ in range(self.n)]
                        for _ in range(self.L)]
        self.v_cache = [[self._host(self.mu, T, heads, vw) for _ in range(self.n)]
                        for _ in range(self.L)]
        slots = 0 if self.zero_copy else self.plan.schedule.kv_slots * self.plan.groups
        self.k_slot = [self._dev(self.mu, T, heads, kw) for _ in range(slots)]
        self.v_slot = [self._dev(self.mu, T, heads, vw) for _ in range(slots)]

    def _activation_buffers(self) -> None:
        """Each micro-batch's hidden states (the prompts' in prefill, one token a sequence in
        decode), its Q | K | V and its attention output, and the host's copies of the last two
        (CPU attention; one buffer with zero copy)."""
        m, width, out = self.m, sum(qkv_widths(self.m)), attn_width(self.m)
        self.x_prefill = [self._dev(self.mu, self.P, m.h) for _ in range(self.n)]
        self.x = [self._dev(self.mu, m.h) for _ in range(self.n)]
        self.qkv = [self._dev(self.mu, width) for _ in range(self.n)]
        self.attn = [self._dev(self.mu, out) for _ in range(self.n)]
        if self.zero_copy:
            self.qkv_host, self.attn_host = self.qkv, self.attn
        else:
            self.qkv_host = [self._host(self.mu, width) for _ in range(self.n)]
            self.attn_host = [self._host(self.mu, out) for _ in range(self.n)]

    def _prediction_buffers(self) -> None:
        """ECP: what ExpertAhead predicts from, micro-batch 0's normed hidden state as Route
        left it, in a ring of two (see :meth:`_ExpertAhead`); None for other schedules."""
        self._ahead_in = ([self._dev(self.mu, self.m.h) for _ in range(2)]
                          if self.prefetches and not self.zero_copy else None)

    def _output_buffers(self, record_logits: bool) -> None:
        """Each sequence's tokens, its last step's logits and hidden state, and with
        `record_logits` every step's logits. They stay on the device until the run ends
        (reading them back mid-run would stall a stream)."""
        m, rows = self.m, self.n * self.mu
        self.tokens = torch.zeros(rows, self.G + 1, dtype=torch.long, device=self.device)
        self.logits = self._dev(rows, m.V)
        self.hidden = self._dev(rows, m.h)
        self.step_logits = self._dev(rows, self.G + 1, m.V) if record_logits else None

    # --- the tasks ---------------------------------------------------------------------------

    def run(self, step: int, kind: str, layer: int, index: int, gpu: int = -1) -> None:
        """Run one task (`gpu`: the GPU of its stream; one device runs every GPU's)."""
        if (self.last_steps is not None and kind not in PAGED
                and step > self.last_steps[index]):
            return                       # every request of this micro-batch has finished
        self._tasks[kind](step, layer, index)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, logits, hidden) on the host, once the run has finished."""
        return self.tokens.cpu(), self.logits.cpu(), self.hidden.cpu()

    def _view(self, step: int, layer: int, j: int) -> LayerView:
        """Layer weights as micro-batch j reads them: in the half its group's copy landed in."""
        return self._views[layer, self.plan.weight_buffer(step, layer, self.plan.group_of(j))]

    def _slot(self, step: int, layer: int, j: int) -> int:
        return self.plan.kv_slot(step, layer, j)

    def _device_kv(self, step: int, layer: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The GPU-side K and V attention reads: a KV slot, or with zero copy the cache."""
        if self.zero_copy:
            return self.k_cache[layer][j], self.v_cache[layer][j]
        slot = self._slot(step, layer, j)
        return self.k_slot[slot], self.v_slot[slot]

    @runs("Prefill")
    def _Prefill(self, s: int, l: int, j: int) -> None:
        rows = slice(j * self.mu, (j + 1) * self.mu)
        x = self.embed[self.prompts[rows]] if l == 0 else self.x_prefill[j]
        out, k, v = prefill_layer(x, self.norms[l], self._view(s, l, j), self.m, self.rope,
                                  self.lens[j] if self.ragged else None, self.m.window(l))
        self.x_prefill[j].copy_(out)
        K, V = self._device_kv(s, l, j)
        K[:, :self.P].copy_(k)
        V[:, :self.P].copy_(v)

    @runs("KVOut")
    def _KVOut(self, s: int, l: int, j: int) -> None:
        slot = self._slot(s, l, j)
        cols = slice(0, self.P) if s == 0 else slice(self.P + s - 1, self.P + s)
        self.k_cache[l][j][:, cols].copy_(self.k_slot[slot][:, cols], non_blocking=True)
        self.v_cache[l][j][:, cols].copy_(self.v_slot[slot][:, cols], non_blocking=True)

    @runs("LMHead")
    def _LMHead(self, s: int, l: int, j: int) -> None:
        x = self._head_input(s, j)
        self._sample(s, j, lm_head(x, self.final_norm, self.head, self.m.rms_norm_eps,
                                   self.head_bias), x)

    def _head_input(self, s: int, j: int) -> torch.Tensor:
        """What the LM head reads: each prompt's last token in prefill, else the step's."""
        if s == 0:
            return self.x_prefill[j][torch.arange(self.mu, device=self.device), self.lens[j] - 1]
        return self.x[j]

    def _sample(self, s: int, j: int, logits: torch.Tensor, x: torch.Tensor) -> None:
        """Greedy tokens from a micro-batch's logits, recorded, and embedded for the next step."""
        rows = slice(j * self.mu, (j + 1) * self.mu)
        tok = logits.argmax(-1)
        self.tokens[rows, s] = tok
        if self.step_logits is not None:
            self.step_logits[rows, s] = logits
        if s == self.G:
            self.logits[rows] = logits
            self.hidden[rows] = x
        self.x[j].copy_(self.embed[tok])

    @runs("PreAttn")
    def _PreAttn(self, s: int, l: int, j: int) -> None:
        qkv = pre_attention(self.x[j], self.norms[l][0], self._view(s, l, j))
        self.qkv[j].copy_(rotate_qkv(qkv, self.lens[j] + (s - 1), self.rope, self.m))

    def _mask(self, lens: torch.Tensor, columns: int, l: int) -> torch.Tensor | None:
        window = self.m.window(l)
        if window is not None and window < columns:
            return decode_mask(lens, self.P, columns, window)
        return decode_mask(lens, self.P, columns) if self.ragged else None

    @runs("D1")
    def _D1(self, s: int, l: int, j: int) -> None:
        self.qkv_host[j].copy_(self.qkv[j], non_blocking=True)

    @runs("CPUAttn")
    def _CPUAttn(self, s: int, l: int, j: int) -> None:
        q, k, v = split_qkv(self.qkv_host[j], self.m)
        pos = self.P + s - 1
        K, V = self.k_cache[l][j], self.v_cache[l][j]
        K[:, pos], V[:, pos] = k, v
        self.attn_host[j].copy_(decode_attention(q, K[:, :pos + 1], V[:, :pos + 1],
                                                 self._mask(self.lens_host[j], pos + 1, l),
                                                 self._host_views[l]))

    @runs("D2")
    def _D2(self, s: int, l: int, j: int) -> None:
        self.attn[j].copy_(self.attn_host[j], non_blocking=True)

    @runs("D4")
    def _D4(self, s: int, l: int, j: int) -> None:
        slot, pos = self._slot(s, l, j), self.P + s - 1
        self.k_slot[slot][:, :pos].copy_(self.k_cache[l][j][:, :pos], non_blocking=True)
        self.v_slot[slot][:, :pos].copy_(self.v_cache[l][j][:, :pos], non_blocking=True)

    @runs("GPUAttn")
    def _GPUAttn(self, s: int, l: int, j: int) -> None:
        q, k, v = split_qkv(self.qkv[j], self.m)
        pos = self.P + s - 1
        K, V = self._device_kv(s, l, j)
        K[:, pos], V[:, pos] = k, v
        self.attn[j].copy_(decode_attention(q, K[:, :pos + 1], V[:, :pos + 1],
                                            self._mask(self.lens[j], pos + 1, l),
                                            self._view(s, l, j)))

    @runs("PostAttn")
    def _PostAttn(self, s: int, l: int, j: int) -> None:
        self.x[j].copy_(post_attention(self.x[j], self.attn[j], self.norms[l][1],
                                       self._view(s, l, j), self.m))

    # --- routed FFN apart from attention (S5, EP, EC): rows are a micro-batch's prompt tokens
    # in prefill, else its sequences

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
        K, V = self._device_kv(s, l, j)
        K[:, :self.P].copy_(k)
        V[:, :self.P].copy_(v)

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
            self._host_experts[l], self.m, only, expert_biases(self._host_views[l])))

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
                                        self._host_experts, self.zero_copy)
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
            x += self._with_shared(j, T, experts(normed, ids, gates, self._host_experts[l],
                                                 self.m, None,
                                                 expert_biases(self._host_views[l])))
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

    @runs("D3")
    def _D3(self, s: int, l: int, index: int) -> None:
        pages, cut = self.pages[self.dense[l]], self.cut[self.dense[l]]
        group, page = divmod(index, len(pages))
        a, b = pages[page]
        dst = self.halves[self.plan.weight_buffer(s, l, group)][a - cut:b - cut]
        if self.plan.schedule.staging:
            dst.copy_(self.pinned[self._pin_slot(s, l, page)][:b - a], non_blocking=True)
        else:
            dst.copy_(self.w.layers[l][a:b], non_blocking=True)

    @runs("W_CtoPin")
    def _W_CtoPin(self, s: int, l: int, page: int) -> None:
        a, b = self.pages[self.dense[l]][page]
        self.pinned[self._pin_slot(s, l, page)][:b - a].copy_(self.w.layers[l][a:b])

    def _pin_slot(self, s: int, l: int, page: int) -> int:
        return ((s * self.L + l) * self.plan.layout.n_pages + page) % len(self.pinned)

def _marked(cls: type) -> dict[str, str]:
    """The kinds a class's own methods marked ``@runs`` run, and those methods' names."""
    return {fn.runs: name for name, fn in vars(cls).items() if hasattr(fn, "runs")}


Runtime.kernels = _marked(Runtime)


def _nothing(step: int, layer: int, index: int) -> None:
    """A transfer with nothing to move (zero copy): scheduled and timed like any task."""
