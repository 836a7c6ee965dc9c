"""What each task of a compiled program really does: buffers and the work of every task kind.

The memory layout follows the memory model (docs/design.md §3.5): host memory holds every layer's
weights and the KV cache of all sequences; the device holds the resident part of every layer
(``r_w``), a double-buffered weight area for the streamed part (global layer ``g`` uses half
``g % 2``), ``kv_slots`` GPU KV slots, and per micro-batch activation buffers; pinned staging slots sit
between host weights and the device (CGOPipe). Every buffer is allocated once, up front; the task
graph's buffer-reuse edges are what keep tasks from clobbering each other.

The schedules that run a layer's routed FFN apart (S5, EP, EC, ECP) have buffers and tasks of
their own, in :class:`taskgraph.exec.ffn_apart.FFNApart`, a part of the runtime; the
expert-level ones keep experts on the device besides (EP placed, EC a cache, ECP a cache and a
prefetch area): :mod:`taskgraph.exec.expert_cache` holds which expert lies in which slot.

Where the plan's pages fall in a layer's elements, and the start-up check that a task never
reads a page the graph did not make it wait for: :mod:`taskgraph.exec.pages`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from taskgraph.dag.builder import Plan
from taskgraph.exec.expert_cache import CachedExperts, PlacedExperts
from taskgraph.exec.ffn_apart import FFNApart
from taskgraph.exec.marks import marked, runs
from taskgraph.exec.pages import check_pages, layer_pages
from taskgraph.kernels.ops import (LayerView, Rope, attn_width, decode_attention, decode_mask,
                                   kv_shape, lm_head, post_attention, pre_attention,
                                   prefill_layer, qkv_widths, rotate_qkv, split_qkv)
from taskgraph.kernels.quant import expert_format
from taskgraph.kernels.weights import ModelWeights
from taskgraph.kinds import HOST_DEVICE_COPIES, PAGED, SENDS


class Runtime(FFNApart):
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
        if shard is not None:          # tensor parallelism: a GPU's part of each page
            numel, self.cut, self.pages = shard.numel, dict(shard.cut), dict(shard.pages)
        else:
            numel, self.cut, self.pages = layer_pages(self.plan, self.m, set(self.dense))
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
        cls.kernels = marked(cls)

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
        self._quantized = expert_format(self.m)
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
        self._prompt_kv(s, l, j, k, v)

    def _prompt_kv(self, s: int, l: int, j: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompts' K and V of a layer into the cache attention reads (its first P columns:
        a KV slot, or with zero copy the cache)."""
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

Runtime.kernels = marked(Runtime)


def _nothing(step: int, layer: int, index: int) -> None:
    """A transfer with nothing to move (zero copy): scheduled and timed like any task."""
