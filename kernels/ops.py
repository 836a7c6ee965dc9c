"""The compute kernels of one decoder layer, shared by the executor and the reference forward.

A layer's matrices are read through a :class:`LayerView`: a page table from matrix name to a
slice of the layer's flat vector, which lives in two buffers: the part kept on the GPU (``r_w``)
and the streamed part, in one half of the double-buffered weight pages. Only a matrix that
straddles the two is stitched together; every other one is a view, no copy.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from taskgraph.errors import TgError
from taskgraph.kernels.weights import Section, layer_sections
from taskgraph.specs import ModelSpec


@contextmanager
def one_thread() -> Iterator[None]:
    """PyTorch's intra-op threads set to one for the block. A micro-batch's products are too small
    to split, and OpenMP teams in several threads spin on each other's cores: on small.yaml
    (2 cores) the executor ran S1 mu=4 at 0.57x transformers' speed with one thread per stream,
    0.51x with two; the sequential reference on 120 short prompts of a tiny checkpoint took
    12.7 s with one thread and 59-123 s with two beside other busy processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LayerView:
    """Matrices of one layer over (resident prefix, streamed tail) flat buffers.

    Besides each matrix, ``qkv`` (q, k and v stacked) and ``w13.{e}`` (an expert's w1 and w3
    stacked) are views too, since they lie next to each other in the flat order: one matmul
    each instead of three and two. A view is made once and kept (the buffers never move; what
    streams in overwrites them in place); a matrix straddling the two buffers is stitched anew
    on every read."""

    def __init__(self, model: ModelSpec, resident: torch.Tensor, streamed: torch.Tensor):
        self.m = model
        self.cut = resident.numel()
        self.resident, self.streamed = resident, streamed
        self._sections = _sections(model)
        self._views: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is not None:
            return view
        s: Section = self._sections[name]
        a, b = s.offset, s.offset + s.size
        if a < self.cut < b:
            return torch.cat([self.resident[a:], self.streamed[:b - self.cut]]).view(s.shape)
        flat = self.resident[a:b] if b <= self.cut else self.streamed[a - self.cut:b - self.cut]
        view = self._views[name] = flat.view(s.shape)
        return view


def _sections(m: ModelSpec) -> dict[str, Section]:
    """Every matrix of a layer by name, plus the stacked ``qkv`` and ``w13.{e}``."""
    key = (m.h, m.h_i, m.q_dim, m.h_kv, m.E)
    table = _SECTION_CACHE.get(key)
    if table is None:
        table = {s.name: s for s in layer_sections(m)}
        table["qkv"] = Section("qkv", (m.q_dim + 2 * m.h_kv, m.h), table["q"].offset)
        for e in range(m.E):
            table[f"w13.{e}"] = Section(f"w13.{e}", (2 * m.h_i, m.h), table[f"w1.{e}"].offset)
        _SECTION_CACHE[key] = table
    return table


_SECTION_CACHE: dict[tuple[int, ...], dict[str, Section]] = {}


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, as transformers does."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Rope:
    """Rotary position embedding (the rotate-half form of Llama/Mixtral), with linear position
    scaling. cos/sin are computed in fp32 and cast to the activations' dtype, as transformers
    does, so bf16 runs round where it rounds."""

    def __init__(self, m: ModelSpec, device: torch.device | str = "cpu"):
        if m.rope_type not in ("default", "linear"):
            raise TgError(f"model.rope_type = '{m.rope_type}': tg computes the default and "
                          "linear RoPE scalings only.")
        d = m.d
        self.inv_freq = 1.0 / (m.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                               device=device) / d))
        self.scale = 1.0 / m.rope_scaling_factor

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, d] at positions [..., T] (broadcastable) -> x rotated."""
        freqs = (positions.float() * self.scale).unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)        # [..., T, 1, d]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def pre_attention(x: torch.Tensor, norm: torch.Tensor, W: LayerView) -> torch.Tensor:
    """RMSNorm + QKV projection: x [..., h] -> [..., q_dim + 2 h_kv] (q | k | v), unrotated."""
    return rmsnorm(x, norm, W.m.rms_norm_eps) @ W["qkv"].T


def split_qkv(qkv: torch.Tensor, m: ModelSpec) -> tuple[torch.Tensor, ...]:
    q, k, v = qkv.split([m.q_dim, m.h_kv, m.h_kv], dim=-1)
    shape = qkv.shape[:-1]
    return (q.reshape(*shape, m.n_q, m.d), k.reshape(*shape, m.n_kv, m.d),
            v.reshape(*shape, m.n_kv, m.d))


def rotate_qkv(qkv: torch.Tensor, positions: torch.Tensor, rope: Rope, m: ModelSpec
               ) -> torch.Tensor:
    """q | k | v with RoPE applied to q and k at each row's position (v untouched): the form
    that crosses to attention and whose K lands in the cache."""
    q, k, v = split_qkv(qkv, m)
    shape = qkv.shape[:-1]
    return torch.cat([rope(q, positions).reshape(*shape, -1),
                      rope(k, positions).reshape(*shape, -1), v.reshape(*shape, -1)], dim=-1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query decode attention of one new token per sequence.

    q [B, n_q, d]; k, v [B, T, n_kv, d] (the whole cache, new token included) -> [B, n_q * d].
    `mask` [B, T] (True: attend) hides cache columns a sequence does not own (the padding after
    a shorter prompt); None attends to every column.
    ``scaled_dot_product_attention`` with ``enable_gqa`` reads each K/V head once per group; it
    measured 3-10x faster than the alternatives below on this machine's CPU
    (bench/attention_kernel.py), so it is the kernel.
    """
    B, n_q, d = q.shape
    if mask is not None:
        mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, enable_gqa=True)
    return out.reshape(B, n_q * d)


def decode_attention_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Baseline: grouped einsum, K/V read once per group without a fused kernel."""
    B, n_q, d = q.shape
    n_kv = k.shape[2]
    qg = q.reshape(B, n_kv, n_q // n_kv, d)                       # [B, kv, group, d]
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) / d ** 0.5
    out = torch.einsum("bkgt,btkd->bkgd", scores.softmax(-1), v)
    return out.reshape(B, n_q * d)


def decode_attention_repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Baseline: ``scaled_dot_product_attention`` with K/V repeated per query head."""
    B, n_q, d = q.shape
    group = n_q // k.shape[2]
    kk = k.transpose(1, 2).repeat_interleave(group, dim=1)        # [B, n_q, T, d]
    vv = v.transpose(1, 2).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv)  # [B, n_q, 1, d]
    return out.reshape(B, n_q * d)


def moe(x: torch.Tensor, W: LayerView, m: ModelSpec) -> torch.Tensor:
    """Top-k routed SwiGLU experts (Mixtral): x [T, h] -> [T, h]."""
    return experts(x, *route(x, W, m), W, m)


def route(x: torch.Tensor, W: LayerView, m: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: each token's top-k experts [T, k] and their gates [T, k]. The softmax runs in
    fp32 over all experts, then the top k are renormalised, as transformers does. Inside
    :func:`routes_seen`, the experts are also kept."""
    probs = (x @ W["router"].T).float().softmax(-1)
    top, idx = probs.topk(m.k, dim=-1)
    seen = getattr(_routes, "seen", None)
    if seen is not None:
        seen.append(idx.detach().cpu())
    return idx, (top / top.sum(-1, keepdim=True)).to(x.dtype)


_routes = threading.local()


@contextmanager
def routes_seen() -> Iterator[list[torch.Tensor]]:
    """Keep the experts :func:`route` picks during the block on this thread: a list of each
    call's [T, k] expert ids, in call order (`tg execute --record-routing`). Per thread, so the
    executor's streams, which run on threads of their own, are never mixed in."""
    before = getattr(_routes, "seen", None)
    _routes.seen = seen = []
    try:
        yield seen
    finally:
        _routes.seen = before


def experts(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, W: LayerView,
            m: ModelSpec, only: frozenset[int] | None = None) -> torch.Tensor:
    """The routed SwiGLU experts: x [T, h] with each token's experts and gates -> [T, h].

    `W` is anything that gives ``w13.{e}`` and ``w2.{e}`` for the experts chosen (a
    :class:`LayerView`, or a mapping over an expert cache's slots). With `only`, the experts
    outside it contribute exactly zero and their weights are not read: one part of a sum split
    between two places (EP: the GPU's experts and the CPU's). Every other expert is computed on
    the same rows at the same place as without `only`, so for top-2 routing the two parts add up
    to the whole bit for bit (adding zero is exact and a sum of two terms commutes)."""
    parts = ExpertSum(x, idx, gates, m)
    parts.add(W, parts.chosen if only is None else [e for e in parts.chosen if e in only])
    return parts.result()


class ExpertSum:
    """:func:`experts` computed a few experts at a time, from weights that need not all be there
    at once (EC's rounds: a staging area smaller than a micro-batch's misses is refilled between
    them). Each :meth:`add` computes the named experts' outputs for the tokens that chose them
    into their rows of one buffer; :meth:`result` then weighs and sums every token's experts in
    one pass, as :func:`experts` does, so the sum is :func:`experts`' bit for bit whatever the
    rounds and whatever k (an expert never added contributes exactly zero)."""

    def __init__(self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, m: ModelSpec):
        # Group the (token, expert) pairs by expert once: one sort and one host sync per layer
        # instead of a unique() and a nonzero() per expert.
        flat = idx.reshape(-1)
        self.order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=m.E).tolist()
        self._rows: dict[int, slice] = {}
        start = 0
        for e, count in enumerate(counts):
            if count:
                self._rows[e] = slice(start, start + count)
            start += count
        self.chosen = list(self._rows)            # the experts some token chose, in id order
        self.rows = self.order // m.k
        self.x, self.gates = x, gates
        self.xs = x[self.rows]
        self.ys = torch.empty_like(self.xs)
        self._done: set[int] = set()

    def add(self, W, which) -> None:
        """The outputs of the experts `which` (each chosen by some token) from weights `W`."""
        for e in which:
            rows = self._rows[e]
            g, u = (self.xs[rows] @ W[f"w13.{e}"].T).chunk(2, dim=-1)
            self.ys[rows] = (F.silu(g) * u) @ W[f"w2.{e}"].T
            self._done.add(e)

    def result(self) -> torch.Tensor:
        """Each token's gated sum over its experts [T, h]; those never added count zero."""
        for e, rows in self._rows.items():
            if e not in self._done:
                self.ys[rows] = 0
        self.ys *= self.gates.reshape(-1)[self.order].unsqueeze(-1)
        return torch.zeros_like(self.x).index_add_(0, self.rows, self.ys)


def post_attention(x: torch.Tensor, attn: torch.Tensor, norm: torch.Tensor, W: LayerView,
                   m: ModelSpec) -> torch.Tensor:
    """O projection + residual + RMSNorm + router + experts + residual: x [T, h], attn
    [T, q_dim]."""
    x = x + attn @ W["o"].T
    return x + moe(rmsnorm(x, norm, m.rms_norm_eps), W, m)


def prefill_layer(x: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor], W: LayerView,
                  m: ModelSpec, rope: Rope, lens: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer over whole prompts: x [B, P, h] -> (x, k, v) with k, v [B, P, n_kv, d], k
    rotated. Prompts shorter than P (`lens` [B]) are right-padded: their padding columns are
    masked out of every real token's attention and their outputs are ignored."""
    B, P, _ = x.shape
    attn, k, v = prefill_attention(x, norms[0], W, m, rope, lens)
    out = post_attention(x.reshape(B * P, m.h), attn, norms[1], W, m)
    return out.reshape(B, P, m.h), k, v


def prefill_attention(x: torch.Tensor, norm: torch.Tensor, W: LayerView, m: ModelSpec,
                      rope: Rope, lens: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm, QKV and causal attention over whole prompts: x [B, P, h] -> (attention output
    [B*P, q_dim], k, v [B, P, n_kv, d], k rotated), padding masked as in prefill_layer."""
    B, P, _ = x.shape
    positions = torch.arange(P, device=x.device)
    q, k, v = split_qkv(rotate_qkv(pre_attention(x, norm, W), positions, rope, m), m)
    mask = None
    if lens is not None:
        cols = torch.arange(P, device=x.device)
        causal = cols[None, :] <= cols[:, None]                          # [P, P]
        mask = (causal[None] & (cols[None, None, :] < lens[:, None, None]))[:, None]
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return attn.transpose(1, 2).reshape(B * P, m.q_dim), k, v


def decode_mask(lens: torch.Tensor, P: int, columns: int) -> torch.Tensor:
    """Which of the first `columns` cache columns each sequence attends to in decode: its own
    prompt (columns below its length, of the P reserved for prompts) and every generated token
    (columns P and up). [B, columns] bool."""
    cols = torch.arange(columns, device=lens.device)
    return (cols[None, :] < lens[:, None]) | (cols[None, :] >= P)


def lm_head(x: torch.Tensor, final_norm: torch.Tensor, head: torch.Tensor, eps: float
            ) -> torch.Tensor:
    return rmsnorm(x, final_norm, eps) @ head.T
