"""The compute kernels of one decoder layer, shared by the executor and the reference forward.

A layer's matrices are read through a :class:`LayerView`: a page table from matrix name to a
slice of the layer's flat vector, which lives in two buffers: the part kept on the GPU (``r_w``)
and the streamed part, in one half of the double-buffered weight pages. Only a matrix that
straddles the two is stitched together; every other one is a view, no copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from taskgraph.kernels.weights import Section, layer_sections
from taskgraph.specs import ModelSpec

EPS = 1e-5


class LayerView:
    """Matrices of one layer over (resident prefix, streamed tail) flat buffers."""

    def __init__(self, model: ModelSpec, resident: torch.Tensor, streamed: torch.Tensor):
        self.m = model
        self.cut = resident.numel()
        self.resident, self.streamed = resident, streamed
        self._sections = {s.name: s for s in layer_sections(model)}

    def __getitem__(self, name: str) -> torch.Tensor:
        s: Section = self._sections[name]
        a, b = s.offset, s.offset + s.size
        if b <= self.cut:
            flat = self.resident[a:b]
        elif a >= self.cut:
            flat = self.streamed[a - self.cut:b - self.cut]
        else:
            flat = torch.cat([self.resident[a:], self.streamed[:b - self.cut]])
        return flat.view(s.shape)


def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def pre_attention(x: torch.Tensor, norm: torch.Tensor, W: LayerView) -> torch.Tensor:
    """RMSNorm + QKV projection: x [..., h] -> [..., h + 2 h_kv] (q | k | v)."""
    y = rmsnorm(x, norm)
    return torch.cat([y @ W["q"].T, y @ W["k"].T, y @ W["v"].T], dim=-1)


def split_qkv(qkv: torch.Tensor, m: ModelSpec) -> tuple[torch.Tensor, ...]:
    q, k, v = qkv.split([m.h, m.h_kv, m.h_kv], dim=-1)
    shape = qkv.shape[:-1]
    return (q.reshape(*shape, m.n_q, m.d), k.reshape(*shape, m.n_kv, m.d),
            v.reshape(*shape, m.n_kv, m.d))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Grouped-query decode attention of one new token per sequence.

    q [B, n_q, d]; k, v [B, T, n_kv, d] (the whole cache, new token included) -> [B, n_q * d].
    ``scaled_dot_product_attention`` with ``enable_gqa`` reads each K/V head once per group; it
    measured 3-10x faster than the alternatives below on this machine's CPU
    (bench/attention_kernel.py), so it is the kernel.
    """
    B, n_q, d = q.shape
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                         enable_gqa=True)
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
    logits = x @ W["router"].T
    top, idx = logits.topk(m.k, dim=-1)
    gates = top.softmax(-1)
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        xe = x[rows]
        y = (F.silu(xe @ W[f"w1.{e}"].T) * (xe @ W[f"w3.{e}"].T)) @ W[f"w2.{e}"].T
        out.index_add_(0, rows, y * gates[rows, slot].unsqueeze(-1))
    return out


def post_attention(x: torch.Tensor, attn: torch.Tensor, norm: torch.Tensor, W: LayerView,
                   m: ModelSpec) -> torch.Tensor:
    """O projection + residual + RMSNorm + router + experts + residual: x, attn [T, h]."""
    x = x + attn @ W["o"].T
    return x + moe(rmsnorm(x, norm), W, m)


def prefill_layer(x: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor], W: LayerView,
                  m: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer over whole prompts: x [B, P, h] -> (x, k, v) with k, v [B, P, n_kv, d]."""
    B, P, _ = x.shape
    q, k, v = split_qkv(pre_attention(x, norms[0], W), m)
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True, enable_gqa=True)
    attn = attn.transpose(1, 2).reshape(B * P, m.h)
    out = post_attention(x.reshape(B * P, m.h), attn, norms[1], W, m)
    return out.reshape(B, P, m.h), k, v


def lm_head(x: torch.Tensor, final_norm: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    return rmsnorm(x, final_norm) @ head.T
