"""The plain sequential forward that every executed schedule must reproduce.

Micro-batch by micro-batch, layer by layer, with the same kernels and the same shapes the
executor uses and none of its overlap, buffering or paging: prefill the prompts, then greedy
decode step after step.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from taskgraph.kernels.ops import (LayerView, Rope, decode_attention, decode_mask, kv_shape,
                                   lm_head, one_thread, post_attention, pre_attention,
                                   prefill_layer, rotate_qkv, routes_seen, split_qkv)
from taskgraph.kernels.weights import ModelWeights


@dataclass
class Generation:
    """What a run produced: greedy tokens (prefill's, then one per decode step), and the last
    step's logits and hidden states, per sequence. With ``record``, also each layer's top-k
    experts of every token (the router's decisions): prefill's for every prompt column, padding
    included, and each decode step's."""

    tokens: torch.Tensor        # [N, steps + 1]
    logits: torch.Tensor        # [N, V]
    hidden: torch.Tensor        # [N, h]
    prefill_experts: torch.Tensor | None = None     # [L, N, P, k]
    decode_experts: torch.Tensor | None = None      # [steps, L, N, k]


def synthetic_prompts(N: int, prompt_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (N, prompt_len), generator=torch.Generator().manual_seed(seed))


def reference_forward(w: ModelWeights, prompts: torch.Tensor, mu: int, steps: int,
                      prompt_lens: torch.Tensor | None = None, record: bool = False
                      ) -> Generation:
    """Prompts [N, P], right-padded where `prompt_lens` [N] says a prompt is shorter (the cache
    layout of :class:`taskgraph.exec.runtime.Runtime`), micro-batch by micro-batch, on one
    thread as the executor runs (:func:`~taskgraph.kernels.ops.one_thread`). `record` keeps the
    router's decisions (``Generation.prefill_experts``, ``decode_experts``)."""
    with one_thread():
        return _forward(w, prompts, mu, steps, prompt_lens, record)


def _forward(w: ModelWeights, prompts: torch.Tensor, mu: int, steps: int,
             prompt_lens: torch.Tensor | None, record: bool = False) -> Generation:
    m = w.model
    N, P = prompts.shape
    lens_all = torch.full((N,), P) if prompt_lens is None else prompt_lens.long()
    ragged = bool((lens_all < P).any())
    rope = Rope(m)
    empty = torch.empty(0, dtype=w.layers[0].dtype)
    views = [LayerView(m, flat, empty, small, m.is_dense(l))
             for l, (flat, small) in enumerate(zip(w.layers, w.extras))]
    tokens = torch.empty(N, steps + 1, dtype=torch.long)
    logits = torch.empty(N, m.V, dtype=w.embed.dtype)
    hidden = torch.empty(N, m.h, dtype=w.embed.dtype)
    # each layer routes once per call below (prefill_layer, post_attention): the experts are
    # the layers' in order
    seen = routes_seen if record else lambda: nullcontext([])
    # a dense layer routes nothing: its rows stay -1 (RoutingTrace.dense)
    moe = [l for l in range(m.L) if not m.is_dense(l)]
    pre = torch.full((m.L, N, P, m.k), -1, dtype=torch.long) if record else None
    dec = torch.full((steps, m.L, N, m.k), -1, dtype=torch.long) if record else None
    for j in range(0, N, mu):
        rows = slice(j, j + mu)
        lens = lens_all[rows]
        heads, kw, vw = kv_shape(m)
        K = [torch.zeros(mu, P + steps, heads, kw, dtype=w.embed.dtype) for _ in range(m.L)]
        V = [torch.zeros(mu, P + steps, heads, vw, dtype=w.embed.dtype) for _ in range(m.L)]
        x = w.embed[prompts[rows]]
        with seen() as experts:
            for l in range(m.L):
                x, K[l][:, :P], V[l][:, :P] = prefill_layer(x, w.norms[l], views[l], m, rope,
                                                            lens if ragged else None,
                                                            m.window(l))
        if record:
            pre[moe, rows] = torch.stack(experts).reshape(len(moe), mu, P, m.k)
        out = lm_head(x[torch.arange(mu), lens - 1], w.final_norm, w.lm_head, m.rms_norm_eps,
                      w.head_bias)
        tokens[rows, 0] = out.argmax(-1)
        x = w.embed[tokens[rows, 0]]
        for s in range(1, steps + 1):
            pos = P + s - 1
            mask = decode_mask(lens, P, pos + 1) if ragged else None
            with seen() as experts:
                for l in range(m.L):
                    qkv = rotate_qkv(pre_attention(x, w.norms[l][0], views[l]), lens + (s - 1),
                                     rope, m)
                    q, k, v = split_qkv(qkv, m)
                    K[l][:, pos], V[l][:, pos] = k, v
                    window = m.window(l)
                    attn = decode_attention(q, K[l][:, :pos + 1], V[l][:, :pos + 1],
                                            decode_mask(lens, P, pos + 1, window)
                                            if window is not None and window <= pos else mask,
                                            views[l])
                    x = post_attention(x, attn, w.norms[l][1], views[l], m)
            if record:
                dec[s - 1, moe, rows] = torch.stack(experts)
            out = lm_head(x, w.final_norm, w.lm_head, m.rms_norm_eps, w.head_bias)
            tokens[rows, s] = out.argmax(-1)
            hidden[rows] = x
            x = w.embed[tokens[rows, s]]
        logits[rows] = out
    return Generation(tokens, logits, hidden, pre, dec)
