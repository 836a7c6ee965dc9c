"""The compute kernels of one decoder layer, shared by the executor and the reference forward.

A layer's matrices are read through a :class:`LayerView`: a page table from matrix name to a
slice of the layer's flat vector, which lives in two buffers: the part kept on the GPU (``r_w``)
and the streamed part, in one half of the double-buffered weight pages. Only a matrix that
straddles the two is stitched together; every other one is a view, no copy. Experts stored in
GGUF blocks are the exception: each read dequantizes one (kernels.quant).
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from taskgraph.errors import TgError
from taskgraph.kernels.quant import dequantize_part, expert_format
from taskgraph.kernels.weights import QUANTIZED, Section, layer_sections
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
    on every read. Experts in GGUF blocks are dequantized on every read, where the buffer
    holding their blocks lies (the blocks in it are overwritten as the layer streams)."""

    def __init__(self, model: ModelSpec, resident: torch.Tensor, streamed: torch.Tensor,
                 extras: dict[str, torch.Tensor] | None = None, dense: bool = False):
        self.m, self.dense = model, dense       # a dense layer: its MLP, no router or experts
        self.cut = resident.numel()
        self.resident, self.streamed = resident, streamed
        self._sections = _sections(model, dense)
        # a family's small per-layer tensors (biases, q/k norms), always where the layer runs
        self.extras = extras or {}
        self._views: dict[str, torch.Tensor] = dict(self.extras)
        self._format = None if dense else expert_format(model)

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is not None:
            return view
        if self._format and name.startswith(("w13.", "w2.")):
            part, e = name.split(".")
            raw = self[f"q.{e}"].view(-1).view(torch.uint8)
            return dequantize_part(raw, part, self.m, self._format, self.resident.dtype)
        s: Section = self._sections[name]
        a, b = s.offset, s.offset + s.size
        if a < self.cut < b:
            return torch.cat([self.resident[a:], self.streamed[:b - self.cut]]).view(s.shape)
        flat = self.resident[a:b] if b <= self.cut else self.streamed[a - self.cut:b - self.cut]
        view = self._views[name] = flat.view(s.shape)
        return view


def _sections(m: ModelSpec, dense: bool = False) -> dict[str, Section]:
    """Every matrix of a layer by name, plus the stacked ``qkv``, ``w13.{e}`` (and a dense
    layer's ``dense.w13``, the shared experts' ``shared.w13``); experts in blocks, each one's
    row of them, ``q.{e}``."""
    key = (m.h, m.h_i, m.q_dim, m.h_kv, m.E, m.shared_experts, m.h_shared, m.shared_gate,
           dense and m.h_dense, m.attention, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim,
           m.qk_rope_head_dim, m.v_head_dim, expert_format(m), m.dtype_bytes)
    table = _SECTION_CACHE.get(key)
    if table is None:
        table = {s.name: s for s in layer_sections(m, dense)}
        if m.attention != "mla":
            table["qkv"] = Section("qkv", (m.q_dim + 2 * m.h_kv, m.h), table["q"].offset)
        if dense:
            table["dense.w13"] = Section("dense.w13", (2 * m.h_dense, m.h),
                                         table["dense.w1"].offset)
            _SECTION_CACHE[key] = table
            return table
        for e in range(m.E) if "w1.0" in table else ():
            table[f"w13.{e}"] = Section(f"w13.{e}", (2 * m.h_i, m.h), table[f"w1.{e}"].offset)
        blocks = table.get(QUANTIZED)
        for e in range(m.E) if blocks else ():
            row = blocks.shape[1]
            table[f"q.{e}"] = Section(f"q.{e}", (1, row), blocks.offset + e * row)
        if m.shared_experts:
            width = m.shared_experts * m.h_shared
            table["shared.w13"] = Section("shared.w13", (2 * width, m.h),
                                          table["shared.w1"].offset)
        _SECTION_CACHE[key] = table
    return table


_SECTION_CACHE: dict[tuple[int, ...], dict[str, Section]] = {}


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, as transformers does."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """A layer's (or the final) norm: RMSNorm with weight `w` [h], or LayerNorm where `w`
    stacks its weight and bias [2, h] (Phi-3.5-MoE's, :class:`ModelWeights`)."""
    if w.dim() == 2:
        return F.layer_norm(x, (x.shape[-1],), w[0], w[1], eps)
    return rmsnorm(x, w, eps)


#: The RoPE scalings the executor computes (Hugging Face rope_type).
ROPE_TYPES = ("default", "linear", "yarn", "longrope")


class Rope:
    """Rotary position embedding (the rotate-half form of Llama/Mixtral, or DeepSeek's rotation
    of neighbouring pairs), with linear position scaling, over each head's dimensions (MLA's
    rope part; GLM-4.5's first half, the rest passed through). cos/sin are computed in fp32 and cast to the activations' dtype, as
    transformers does, so bf16 runs round where it rounds."""

    def __init__(self, m: ModelSpec, device: torch.device | str = "cpu"):
        if m.rope_type not in ROPE_TYPES:
            raise TgError(f"model.rope_type = '{m.rope_type}': tg computes the default, linear, "
                          "YaRN and LongRoPE scalings only.")
        d = m.qk_rope_head_dim if m.attention == "mla" else int(m.d * m.rope_partial)
        self.rotated = d             # the first d of a head's dimensions (GLM-4.5: half)
        self.inv_freq = 1.0 / (m.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                               device=device) / d))
        self.scale = 1.0 / m.rope_scaling_factor
        self.interleave = m.rope_interleave
        self.attention_scaling = 1.0           # what multiplies cos and sin (YaRN's)
        if m.rope_type == "yarn":
            self.inv_freq, self.attention_scaling = _yarn(m, d, device)
        if m.rope_type == "longrope":
            # Phi-3.5-MoE's within original_max_position_embeddings (exec.loading refuses a
            # longer context): each frequency divided by its short factor, cos and sin scaled
            # by short_mscale, as transformers' PhimoeRotaryEmbedding computes them
            r = m.rope_longrope or {}
            self.inv_freq = self.inv_freq / torch.tensor(r["short_factor"], dtype=torch.float32,
                                                         device=device)
            self.attention_scaling = float(r["short_mscale"])

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, d] at positions [..., T] (broadcastable) -> x rotated. Pairs
        (DeepSeek's) come out as the even dimensions' then the odd ones' (transformers'
        DeepSeek-V3 layout): q and k alike, so their products are the pairs' own."""
        if x.shape[-1] > self.rotated:
            return torch.cat([self(x[..., :self.rotated], positions), x[..., self.rotated:]],
                             dim=-1)
        freqs = (positions.float() * self.scale).unsqueeze(-1) * self.inv_freq
        a = self.attention_scaling
        if self.interleave:
            cos = (freqs.cos() * a).to(x.dtype).unsqueeze(-2)
            sin = (freqs.sin() * a).to(x.dtype).unsqueeze(-2)
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)        # [..., T, 1, d]
        if a == 1.0:
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        else:
            cos, sin = (emb.cos() * a).to(x.dtype), (emb.sin() * a).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def _yarn(m: ModelSpec, dim: int, device) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and cos/sin scale, as transformers computes them
    (modeling_rope_utils._compute_yarn_parameters)."""
    y = m.rope_yarn or {}
    base, original = m.rope_theta, y.get("original_max_position_embeddings")
    if original is None:
        raise TgError("model.rope_yarn: YaRN needs original_max_position_embeddings.")
    factor = y.get("factor") or y["max_position_embeddings"] / original

    def mscale(scale: float, value: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * value * math.log(scale) + 1.0

    attention = y.get("attention_factor")
    if attention is None:
        attention = (mscale(factor, y["mscale"]) / mscale(factor, y["mscale_all_dim"])
                     if y.get("mscale") and y.get("mscale_all_dim") else mscale(factor))

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(y.get("beta_fast") or 32), correction(y.get("beta_slow") or 1)
    if y.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = (1 - ramp).to(device)
    freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * freqs)) * (1 - extrapolate) + (1.0 / freqs) * extrapolate
    return inv_freq, float(attention)


def softmax_scale(m: ModelSpec) -> float:
    """Attention's score scale: 1 / sqrt(head), MLA's query head being nope + rope, times
    YaRN's mscale squared where the model's rope parameters give mscale_all_dim (DeepSeek)."""
    head = m.qk_nope_head_dim + m.qk_rope_head_dim if m.attention == "mla" else m.d
    scale = head ** -0.5
    y = m.rope_yarn or {}
    if m.rope_type == "yarn" and y.get("mscale_all_dim"):
        factor = y.get("factor") or y["max_position_embeddings"] / y[
            "original_max_position_embeddings"]
        if factor > 1:
            mscale = 0.1 * y["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


# The widths of what attention keeps and moves, by kind of attention. GQA: a token's q, k and v
# heads. MLA (computed as transformers computes it, the cache decompressed for each step): its
# queries (nope | rope, each head), one cache entry a token holding the normed KV latent and the
# rope key, and no values of their own (they come from the latent).
_MLA_NORM_EPS = 1e-6          # DeepSeek's q_a_layernorm and kv_a_layernorm, whatever the config


def qkv_widths(m: ModelSpec) -> tuple[int, int, int]:
    """Elements of one token's q | k | v as PreAttn leaves them."""
    if m.attention == "mla":
        return (m.n_q * (m.qk_nope_head_dim + m.qk_rope_head_dim),
                m.kv_lora_rank + m.qk_rope_head_dim, 0)
    return m.q_dim, m.h_kv, m.h_kv


def kv_shape(m: ModelSpec) -> tuple[int, int, int]:
    """(heads, K width, V width) of one token's cache entry."""
    if m.attention == "mla":
        return 1, m.kv_lora_rank + m.qk_rope_head_dim, 0
    return m.n_kv, m.d, m.d


def attn_width(m: ModelSpec) -> int:
    """Elements of one token's attention output, what the O projection reads."""
    return m.n_q * m.v_head_dim if m.attention == "mla" else m.q_dim


def pre_attention(x: torch.Tensor, layer_norm: torch.Tensor, W: LayerView) -> torch.Tensor:
    """Norm + QKV projection: x [..., h] -> [..., q | k | v] (:func:`qkv_widths`),
    unrotated; with the family's bias (Qwen2-MoE) and Q/K norms (Qwen3-MoE: each head's; OLMoE:
    all heads' at once), as its transformers model applies them before RoPE. MLA: the queries,
    the normed KV latent and the rope key."""
    m = W.m
    if m.attention == "mla":
        h = norm(x, layer_norm, m.rms_norm_eps)
        q = (h @ W["q"].T if not m.q_lora_rank else
             rmsnorm(h @ W["q_a"].T, W["q_a_norm"], _MLA_NORM_EPS) @ W["q_b"].T)
        latent, k_rope = (h @ W["kv_a"].T).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        return torch.cat([q, rmsnorm(latent, W["kv_a_norm"], _MLA_NORM_EPS), k_rope], dim=-1)
    qkv = project_qkv(x, layer_norm, W)
    if "q_norm" not in W.extras:
        return qkv
    q, k, v = qkv.split([m.q_dim, m.h_kv, m.h_kv], dim=-1)
    if m.qk_norm_whole:
        q, k = rmsnorm(q, W["q_norm"], m.rms_norm_eps), rmsnorm(k, W["k_norm"], m.rms_norm_eps)
    else:
        shape = q.shape[:-1]
        q = rmsnorm(q.reshape(*shape, m.n_q, m.d), W["q_norm"], m.rms_norm_eps).reshape(
            *shape, -1)
        k = rmsnorm(k.reshape(*shape, m.n_kv, m.d), W["k_norm"], m.rms_norm_eps).reshape(
            *shape, -1)
    return torch.cat([q, k, v], dim=-1)


def project_qkv(x: torch.Tensor, layer_norm: torch.Tensor, W: LayerView) -> torch.Tensor:
    """Norm + QKV projection with the family's bias, before any Q/K norm (not MLA)."""
    qkv = norm(x, layer_norm, W.m.rms_norm_eps) @ W["qkv"].T
    return qkv + W["qkv_bias"] if "qkv_bias" in W.extras else qkv


# Tensor parallelism over a model that norms Q and K over every head (OLMoE): each GPU sums
# its heads' squares, the sums are all-reduced, and each GPU norms its heads by the whole's.

def qk_square_sums(qkv: torch.Tensor, m: ModelSpec, n: int) -> torch.Tensor:
    """[..., 2]: each token's sums of its Q's and of its K's squares, in fp32, over the heads
    of `qkv` (a GPU's, of `n`), each over the whole's width: all-reduced, the means."""
    q, k, _ = qkv.float().split([m.q_dim, m.h_kv, m.h_kv], dim=-1)
    return torch.stack([q.pow(2).sum(-1) / (m.q_dim * n), k.pow(2).sum(-1) / (m.h_kv * n)],
                       dim=-1)


def norm_qk_by(qkv: torch.Tensor, means: torch.Tensor, W: LayerView) -> torch.Tensor:
    """A GPU's heads' Q and K RMS-normed by every head's mean squares (`means` [..., 2], all
    GPUs' :func:`qk_square_sums` summed), as :func:`rmsnorm` norms the whole."""
    m, eps = W.m, W.m.rms_norm_eps
    q, k, v = qkv.split([m.q_dim, m.h_kv, m.h_kv], dim=-1)

    def normed(x: torch.Tensor, mean: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x.float() * torch.rsqrt(mean.unsqueeze(-1) + eps)).to(x.dtype)

    return torch.cat([normed(q, means[..., 0], W["q_norm"]),
                      normed(k, means[..., 1], W["k_norm"]), v], dim=-1)


def split_qkv(qkv: torch.Tensor, m: ModelSpec) -> tuple[torch.Tensor, ...]:
    """q [..., n_q, head], k [..., heads, K width], v [..., heads, V width] (:func:`kv_shape`)."""
    q, k, v = qkv.split(qkv_widths(m), dim=-1)
    shape, (heads, kw, vw) = qkv.shape[:-1], kv_shape(m)
    return (q.reshape(*shape, m.n_q, -1), k.reshape(*shape, heads, kw),
            v.reshape(*shape, heads, vw))


def rotate_qkv(qkv: torch.Tensor, positions: torch.Tensor, rope: Rope, m: ModelSpec
               ) -> torch.Tensor:
    """q | k | v with RoPE applied to q and k at each row's position (v untouched): the form
    that crosses to attention and whose K lands in the cache. MLA: each head's rope part of q,
    and the rope key after the latent."""
    q, k, v = split_qkv(qkv, m)
    shape = qkv.shape[:-1]
    if m.attention == "mla":
        nope, kv = m.qk_nope_head_dim, m.kv_lora_rank
        q = torch.cat([q[..., :nope], rope(q[..., nope:], positions)], dim=-1)
        k = torch.cat([k[..., :kv], rope(k[..., kv:], positions)], dim=-1)
        return torch.cat([q.reshape(*shape, -1), k.reshape(*shape, -1)], dim=-1)
    return torch.cat([rope(q, positions).reshape(*shape, -1),
                      rope(k, positions).reshape(*shape, -1), v.reshape(*shape, -1)], dim=-1)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, W: LayerView,
                  mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """Multi-head latent attention as transformers computes it: each cached token's latent
    decompressed into every head's key (nope part, beside the shared rope key) and value.
    q [B, Tq, n_q, nope + rope], cache [B, T, 1, latent + rope], `mask` [B, 1, Tq, T] (or
    None; `causal` for prompts) -> [B, Tq, n_q * v]."""
    m = W.m
    B, T = cache.shape[:2]
    n, nope, rope, vd = m.n_q, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    latent, k_rope = cache[:, :, 0, :m.kv_lora_rank], cache[:, :, 0, m.kv_lora_rank:]
    keys = torch.cat([(latent @ W["uk"].T).view(B, T, n, nope),
                      k_rope[:, :, None].expand(B, T, n, rope)], dim=-1)
    values = (latent @ W["uv"].T).view(B, T, n, vd)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                         values.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal and mask is None,
                                         scale=softmax_scale(m))
    return out.transpose(1, 2).reshape(B, q.shape[1], n * vd)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """Attention with a learned sink logit per head in every softmax, dropped after it
    (gpt-oss), as transformers' eager attention computes it. q [B, Tq, n_q, d]; k, v
    [B, T, n_kv, d]; `mask` [B, 1, Tq, T] bool (True: attend) or None -> [B, Tq, n_q * d]."""
    B, Tq, n_q, d = q.shape
    T, group = k.shape[1], n_q // k.shape[2]
    keys = k.repeat_interleave(group, dim=2).transpose(1, 2)          # [B, n_q, T, d]
    values = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = q.transpose(1, 2) @ keys.transpose(2, 3) * d ** -0.5     # [B, n_q, Tq, T]
    if causal:
        rows = torch.arange(Tq, device=q.device)[:, None] + (T - Tq)
        allowed = torch.arange(T, device=q.device)[None, :] <= rows
        mask = allowed if mask is None else mask & allowed
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, n_q, Tq, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = logits.softmax(dim=-1)[..., :-1].to(values.dtype)
    return (probs @ values).transpose(1, 2).reshape(B, Tq, n_q * d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None, W: LayerView | None = None
                     ) -> torch.Tensor:
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
    if W is not None and W.m.attention == "mla":      # `k` is the latent cache; `W` expands it
        return mla_attention(q[:, None], k, W, mask)[:, 0]
    if W is not None and "sinks" in W.extras:
        return sink_attention(q[:, None], k, v, W["sinks"], mask)[:, 0]
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
    """Top-k routed SwiGLU experts, and the shared ones where the model has them: x [T, h] ->
    [T, h], summed as transformers sums them (the routed experts' sum, then the shared)."""
    routed = experts(x, *route(x, W, m), W, m)
    return routed + shared_experts(x, W) if m.shared_experts else routed


def route(x: torch.Tensor, W: LayerView, m: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: each token's top-k experts [T, k] and their gates [T, k]. The softmax runs in
    fp32 over all experts, then the top k are renormalised where the model says so (Mixtral;
    Qwen's and OLMoE's norm_topk_prob), as transformers does. Inside :func:`routes_seen`, the
    experts are also kept."""
    if m.architecture in ("gpt_oss", "phimoe"):
        if m.architecture == "gpt_oss":            # a softmax over the k best logits
            top, idx = (x @ W["router"].T + W["router_logit_bias"]).topk(m.k, dim=-1)
            gates = top.softmax(dim=-1)
        else:
            idx, gates = _sparsemixer(x @ W["router"].T, m.sparsemixer_eps)
        seen = getattr(_routes, "seen", None)
        if seen is not None:
            seen.append(idx.detach().cpu())
        return idx, gates
    logits = (x @ W["router"].T).float()
    if m.router == "softmax" and m.expert_groups == 1:
        top, idx = logits.softmax(-1).topk(m.k, dim=-1)
    else:
        top, idx = _grouped_top_k(logits, W, m)
    seen = getattr(_routes, "seen", None)
    if seen is not None:
        seen.append(idx.detach().cpu())
    if m.renormalize:
        top = top / (top.sum(-1, keepdim=True) + (1e-20 if m.router == "sigmoid" else 0.0))
    if m.routed_scaling != 1.0:
        top = top * m.routed_scaling
    return idx, top.to(x.dtype)


def _sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's SparseMixer at inference, as transformers' ``sparsemixer`` computes it in
    the activations' dtype: the best expert, its gate a softmax over the experts whose logit is
    within 2 `eps` of the best (relatively); then the best of the others, its gate a softmax
    over those within 2 `eps` of it. [T, 2] ids and gates."""
    gates, ids, rest = [], [], logits
    for _ in range(2):
        best, pick = rest.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps
        gates.append(rest.masked_fill(far, float("-inf")).softmax(-1).gather(-1, pick))
        ids.append(pick)
        rest = rest.scatter(-1, pick, float("-inf"))
    return torch.cat(ids, dim=-1), torch.cat(gates, dim=-1)


def _grouped_top_k(logits: torch.Tensor, W: LayerView, m: ModelSpec
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routers, as transformers computes them: softmax scores (V2), or sigmoid
    scores chosen with a bias that the gates leave out (V3, GLM-4.5); with expert groups, each
    token chooses only among the experts of its best `topk_groups` groups (a group scored by
    its best expert under softmax, its best two under sigmoid)."""
    scores = logits.sigmoid() if m.router == "sigmoid" else logits.softmax(-1)
    choice = scores + W["router_bias"] if "router_bias" in W.extras else scores
    if m.expert_groups > 1:
        groups = choice.view(-1, m.expert_groups, m.E // m.expert_groups)
        best = (groups.topk(2, dim=-1)[0].sum(-1) if m.router == "sigmoid"
                else groups.max(dim=-1).values)
        keep = torch.zeros_like(best).scatter_(1, best.topk(m.topk_groups, dim=-1)[1], 1)
        keep = keep.unsqueeze(-1).expand_as(groups).reshape(-1, m.E).bool()
        choice = choice.masked_fill(~keep, float("-inf") if m.router == "sigmoid" else 0.0)
    idx = choice.topk(m.k, dim=-1)[1]
    return scores.gather(-1, idx), idx


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
            m: ModelSpec, only: frozenset[int] | None = None,
            biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The routed SwiGLU experts: x [T, h] with each token's experts and gates -> [T, h].

    `W` is anything that gives ``w13.{e}`` and ``w2.{e}`` for the experts chosen (a
    :class:`LayerView`, or a mapping over an expert cache's slots). With `only`, the experts
    outside it contribute exactly zero and their weights are not read: one part of a sum split
    between two places (EP: the GPU's experts and the CPU's). Every other expert is computed on
    the same rows at the same place as without `only`, so for top-2 routing the two parts add up
    to the whole bit for bit (adding zero is exact and a sum of two terms commutes). gpt-oss's
    experts add `biases` (each expert's gate | up and down; a LayerView's own by default)."""
    parts = ExpertSum(x, idx, gates, m, biases if biases is not None else expert_biases(W))
    parts.add(W, parts.chosen if only is None else [e for e in parts.chosen if e in only])
    return parts.result()


class ExpertSum:
    """:func:`experts` computed a few experts at a time, from weights that need not all be there
    at once (EC's rounds: a staging area smaller than a micro-batch's misses is refilled between
    them). Each :meth:`add` computes the named experts' outputs for the tokens that chose them
    into their rows of one buffer; :meth:`result` then weighs and sums every token's experts in
    one pass, as :func:`experts` does, so the sum is :func:`experts`' bit for bit whatever the
    rounds and whatever k (an expert never added contributes exactly zero)."""

    def __init__(self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, m: ModelSpec,
                 biases: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.biases = biases          # gpt-oss: each expert's gate | up bias and down bias
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
            if self.biases is None:
                g, u = (self.xs[rows] @ W[f"w13.{e}"].T).chunk(2, dim=-1)
                self.ys[rows] = (F.silu(g) * u) @ W[f"w2.{e}"].T
            else:
                b13, b2 = self.biases
                g, u = (self.xs[rows] @ W[f"w13.{e}"].T + b13[e]).chunk(2, dim=-1)
                self.ys[rows] = _clamped_glu(g, u) @ W[f"w2.{e}"].T + b2[e]
            self._done.add(e)

    def result(self) -> torch.Tensor:
        """Each token's gated sum over its experts [T, h]; those never added count zero."""
        for e, rows in self._rows.items():
            if e not in self._done:
                self.ys[rows] = 0
        self.ys *= self.gates.reshape(-1)[self.order].unsqueeze(-1)
        return torch.zeros_like(self.x).index_add_(0, self.rows, self.ys)


def _clamped_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702,
                 limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's gated unit: gate and up clamped, gate x sigmoid(alpha gate) x (up + 1)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_biases(W) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A layer's experts' biases (gpt-oss), where its view holds them."""
    extras = getattr(W, "extras", {})
    return (extras["b13"], extras["b2"]) if "b13" in extras else None


def o_projection(attn: torch.Tensor, W: LayerView) -> torch.Tensor:
    """The O projection, with its bias where the model has one (gpt-oss)."""
    out = attn @ W["o"].T
    return out + W["o_bias"] if "o_bias" in W.extras else out


def shared_experts(x: torch.Tensor, W: LayerView) -> torch.Tensor:
    """The shared experts every token runs, as one SwiGLU MLP as wide as all of them: x [T, h]
    -> [T, h], scaled by a sigmoid gate of x where the model has one (Qwen2-MoE)."""
    y = mlp(x, W, "shared")
    if W.m.shared_gate:
        y = torch.sigmoid(x @ W["shared.gate"].T) * y
    return y


def mlp(x: torch.Tensor, W: LayerView, name: str) -> torch.Tensor:
    """A SwiGLU MLP whose stacked gate | up matrix is ``{name}.w13`` and down ``{name}.w2``."""
    g, u = (x @ W[f"{name}.w13"].T).chunk(2, dim=-1)
    return (F.silu(g) * u) @ W[f"{name}.w2"].T


def ffn(x: torch.Tensor, W: LayerView, m: ModelSpec) -> torch.Tensor:
    """A layer's FFN over its normed input: a dense layer's MLP, else the routed experts and
    the shared ones."""
    return mlp(x, W, "dense") if W.dense else moe(x, W, m)


def post_attention(x: torch.Tensor, attn: torch.Tensor, layer_norm: torch.Tensor, W: LayerView,
                   m: ModelSpec) -> torch.Tensor:
    """O projection + residual + norm + FFN + residual: x [T, h], attn [T, q_dim]."""
    x = x + o_projection(attn, W)
    return x + ffn(norm(x, layer_norm, m.rms_norm_eps), W, m)


def prefill_layer(x: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor], W: LayerView,
                  m: ModelSpec, rope: Rope, lens: torch.Tensor | None = None,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer over whole prompts: x [B, P, h] -> (x, k, v) with k, v [B, P, n_kv, d], k
    rotated. Prompts shorter than P (`lens` [B]) are right-padded: their padding columns are
    masked out of every real token's attention and their outputs are ignored. A sliding
    `window` limits each token to the last `window` positions."""
    B, P, _ = x.shape
    attn, k, v = prefill_attention(x, norms[0], W, m, rope, lens, window)
    out = post_attention(x.reshape(B * P, m.h), attn, norms[1], W, m)
    return out.reshape(B, P, m.h), k, v


def prefill_attention(x: torch.Tensor, layer_norm: torch.Tensor, W: LayerView, m: ModelSpec,
                      rope: Rope, lens: torch.Tensor | None = None, window: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, QKV and causal attention over whole prompts: x [B, P, h] -> (attention output
    [B*P, q_dim], k, v [B, P, n_kv, d], k rotated), padding masked as in prefill_layer."""
    return prompt_attention(pre_attention(x, layer_norm, W), W, m, rope, lens, window)


def prompt_attention(qkv: torch.Tensor, W: LayerView, m: ModelSpec, rope: Rope,
                     lens: torch.Tensor | None = None, window: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention over whole prompts from their normed, unrotated q | k | v [B, P, ...]
    (:func:`pre_attention`): as :func:`prefill_attention`."""
    B, P, _ = qkv.shape
    positions = torch.arange(P, device=qkv.device)
    q, k, v = split_qkv(rotate_qkv(qkv, positions, rope, m), m)
    mask = None
    if window is not None and window >= P:
        window = None                   # the window holds every prompt token
    if lens is not None or window is not None:
        cols = torch.arange(P, device=qkv.device)
        causal = cols[None, :] <= cols[:, None]                          # [P, P]
        if window is not None:
            causal &= cols[None, :] > cols[:, None] - window
        mask = causal[None].expand(B, P, P)
        if lens is not None:
            mask = mask & (cols[None, None, :] < lens[:, None, None])
        mask = mask[:, None]
    if m.attention == "mla":
        return mla_attention(q, k, W, mask, causal=True).reshape(B * P, -1), k, v
    if "sinks" in W.extras:
        return sink_attention(q, k, v, W["sinks"], mask, causal=True).reshape(B * P, -1), k, v
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return attn.transpose(1, 2).reshape(B * P, m.q_dim), k, v


def decode_mask(lens: torch.Tensor, P: int, columns: int, window: int | None = None
                ) -> torch.Tensor:
    """Which of the first `columns` cache columns each sequence attends to in decode: its own
    prompt (columns below its length, of the P reserved for prompts) and every generated token
    (columns P and up); in a sliding-window layer only the last `window` positions up to the
    new token's (column `columns` - 1), as transformers' mask has it (key position > query
    position - window). [B, columns] bool."""
    cols = torch.arange(columns, device=lens.device)[None, :]
    mask = (cols < lens[:, None]) | (cols >= P)
    if window is not None:
        position = torch.where(cols < P, cols, lens[:, None] + cols - P)
        mask &= position > (lens[:, None] + columns - 1 - P) - window
    return mask


def lm_head(x: torch.Tensor, final_norm: torch.Tensor, head: torch.Tensor, eps: float,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The final norm and the LM head, with its bias where the model has one (Phi-3.5-MoE)."""
    logits = norm(x, final_norm, eps) @ head.T
    return logits if bias is None else logits + bias
