"""Model weights for the executor: synthetic and deterministic by seed, or a Hugging Face
safetensors checkpoint of a family the executor computes (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V2/V3, gpt-oss, Phi-3.5-MoE, GLM-4.5).

Each layer's matrices live in one flat vector, in the order the cost model pages them
(:class:`taskgraph.dag.work.WeightLayout`): q, k, v | o | router | shared experts (w1, w3, w2,
gate) | experts (w1, w3, w2 per expert).
The first ``r_w`` of a layer stays on the GPU and the rest streams in pages, so any byte range of
this vector is a page. Norms, embedding and LM head are small and always resident.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from taskgraph.errors import TgError
from taskgraph.files import note_input, read_json
from taskgraph.kernels.quant import expert_elements, expert_format, quantize_expert
from taskgraph.specs import ModelSpec


@dataclass(frozen=True)
class Section:
    name: str
    shape: tuple[int, int]
    offset: int          # first element in the layer's flat vector

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]


def attention_shapes(m: ModelSpec) -> tuple[list[tuple[str, tuple[int, int]]],
                                             list[tuple[str, tuple[int, int]]]]:
    """The attention's matrices: those that make Q, K and V, and those after attention (the O
    projection). MLA: the Q path (q_a, q_b, or q), the KV down-projection (kv_a: the latent and
    the rope key) and the key half of the up-projection (uk); the value half (uv) and O after,
    as the cost model counts them (ModelSpec.qkv_params, o_params)."""
    if m.attention != "mla":
        return ([("q", (m.q_dim, m.h)), ("k", (m.h_kv, m.h)), ("v", (m.h_kv, m.h))],
                [("o", (m.h, m.q_dim))])
    n, nope, rope, v = m.n_q, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    q = ([("q_a", (m.q_lora_rank, m.h)), ("q_b", (n * (nope + rope), m.q_lora_rank))]
         if m.q_lora_rank else [("q", (n * (nope + rope), m.h))])
    return ([*q, ("kv_a", (m.kv_lora_rank + rope, m.h)), ("uk", (n * nope, m.kv_lora_rank))],
            [("uv", (n * v, m.kv_lora_rank)), ("o", (m.h, n * v))])


#: The section of an MoE layer's flat vector holding its experts' GGUF blocks (kernels.quant),
#: one row an expert, where the model stores them so.
QUANTIZED = "experts.q"


def layer_sections(m: ModelSpec, dense: bool = False) -> list[Section]:
    """The matrices of one layer in flat order (rows are output features): an MoE layer's, or
    with `dense` a dense layer's (its MLP where the router and experts would be)."""
    qkv, o = attention_shapes(m)
    shapes = [*qkv, *o]
    if dense:
        shapes += [("dense.w1", (m.h_dense, m.h)), ("dense.w3", (m.h_dense, m.h)),
                   ("dense.w2", (m.h, m.h_dense))]
        return _laid_out(shapes)
    shapes.append(("router", (m.E, m.h)))
    if m.shared_experts:     # one SwiGLU MLP as wide as all the shared experts (DeepSeek's)
        width = m.shared_experts * m.h_shared
        shapes += [("shared.w1", (width, m.h)), ("shared.w3", (width, m.h)),
                   ("shared.w2", (m.h, width))] + ([("shared.gate", (1, m.h))]
                                                   if m.shared_gate else [])
    fmt = expert_format(m)
    if fmt:     # every expert's blocks, filling elements of the dtype (ModelWeights.blocks)
        return _laid_out(shapes + [(QUANTIZED, (m.E, expert_elements(m, fmt)))])
    for e in range(m.E):
        shapes += [(f"w1.{e}", (m.h_i, m.h)), (f"w3.{e}", (m.h_i, m.h)), (f"w2.{e}", (m.h, m.h_i))]
    return _laid_out(shapes)


def _laid_out(shapes: list[tuple[str, tuple[int, int]]]) -> list[Section]:
    out, offset = [], 0
    for name, shape in shapes:
        out.append(Section(name, shape, offset))
        offset += shape[0] * shape[1]
    return out


def extra_shapes(m: ModelSpec, dense: bool = False) -> dict[str, tuple[int, ...]]:
    """A family's small per-layer tensors beside its matrices (kept where the layer runs, as the
    norms are): Q, K and V biases (one vector, q | k | v: Qwen2-MoE's, and where
    attention_bias says, Phi-3.5-MoE's with an O bias and GLM-4.5's), RMSNorms of each head's Q
    and K (Qwen3-MoE's, and GLM-4.5's where qk_norm says) or of all heads' at once (OLMoE's);
    MLA's norms of the Q and KV latents, and the sigmoid router's bias (an MoE layer's);
    gpt-oss's biases and sinks."""
    if m.architecture == "gpt_oss":
        # biases of Q | K | V and O, a sink logit per head, the router's bias, and each
        # expert's (its gate | up, and down)
        return {"qkv_bias": (m.q_dim + 2 * m.h_kv,), "o_bias": (m.h,), "sinks": (m.n_q,),
                "router_logit_bias": (m.E,), "b13": (m.E, 2 * m.h_i), "b2": (m.E, m.h)}
    out: dict[str, tuple[int, ...]] = {}
    if m.architecture == "qwen2_moe" or m.attention_bias:
        out["qkv_bias"] = (m.q_dim + 2 * m.h_kv,)
    if m.attention_bias and m.architecture == "phimoe":
        out["o_bias"] = (m.h,)
    if m.architecture == "qwen3_moe" or m.qk_norm:
        out.update(q_norm=(m.d,), k_norm=(m.d,))
    if m.architecture == "olmoe":
        out.update(q_norm=(m.q_dim,), k_norm=(m.h_kv,))
    if m.attention == "mla":
        out["kv_a_norm"] = (m.kv_lora_rank,)
        if m.q_lora_rank:
            out["q_a_norm"] = (m.q_lora_rank,)
    if m.router == "sigmoid" and not dense:
        out["router_bias"] = (m.E,)
    return out


@dataclass
class ModelWeights:
    """All weights on the host: `layers[l]` is layer l's flat vector, `extras[l]` its family's
    small tensors (:func:`extra_shapes`; none for Mixtral)."""

    model: ModelSpec
    layers: list[torch.Tensor]
    # (input, post-attention) norm per layer: an RMSNorm's weight [h], or a LayerNorm's weight
    # and bias stacked [2, h] (Phi-3.5-MoE; kernels.ops.norm), as is final_norm
    norms: list[tuple[torch.Tensor, torch.Tensor]]
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    extras: list[dict[str, torch.Tensor]] | None = None
    head_bias: torch.Tensor | None = None        # the LM head's (lm_head_bias)

    def __post_init__(self) -> None:
        if self.extras is None:
            self.extras = [{} for _ in self.layers]

    def blocks(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s experts in GGUF blocks, [E, bytes] (uint8), a view of its flat
        vector; None for a dense layer or a model whose experts are in its dtype."""
        if not expert_format(self.model) or self.model.is_dense(layer):
            return None
        return _blocks(self.layers[layer], self.model)

    def dequantized(self) -> "ModelWeights":
        """The same weights with the experts dequantized back into each layer's vector, for a
        model that keeps them in its dtype: what a reference run computes with."""
        fmt = expert_format(self.model)
        if fmt is None:
            return self
        from taskgraph.kernels.quant import dequantize_part

        m = self.model.model_copy(update={"precision": self.model.precision.model_copy(
            update={"experts": None})})
        layers = []
        for l, flat in enumerate(self.layers):
            blocks = self.blocks(l)
            if blocks is None:
                layers.append(flat)
                continue
            parts = [flat[:_quantized_section(self.model).offset]]
            for raw in blocks:
                parts += [dequantize_part(raw, part, self.model, fmt, flat.dtype).reshape(-1)
                          for part in ("w13", "w2")]
            layers.append(torch.cat(parts))
        return ModelWeights(m, layers, self.norms, self.embed, self.final_norm, self.lm_head,
                            self.extras, head_bias=self.head_bias)

    @property
    def layer_numel(self) -> int:
        return self.layers[0].numel()


def synthetic_weights(m: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32
                      ) -> ModelWeights:
    """Random weights scaled so activations stay O(1) through many layers."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for l in range(m.L):
        sections = layer_sections(m, m.is_dense(l))
        numel = sections[-1].offset + sections[-1].size
        flat = torch.empty(numel, dtype=torch.float32)
        for s in sections:
            if s.name == QUANTIZED:
                continue                   # bytes, written once the layer is in its dtype
            fan_in = s.shape[1]
            flat[s.offset:s.offset + s.size] = torch.randn(s.size, generator=g) / fan_in ** 0.5
        layers.append(flat.to(dtype))
    if expert_format(m):     # after every layer's other weights, as they were always drawn
        for l in range(m.L):
            if not m.is_dense(l):
                _quantize_into(layers[l], m, lambda e, part, shape: torch.randn(
                    shape, generator=g) / shape[1] ** 0.5)
    norm_shape = (2, m.h) if layer_norms(m) else (m.h,)     # LayerNorm: weight and bias
    norms = [(1 + 0.1 * torch.randn(norm_shape, generator=g),
              1 + 0.1 * torch.randn(norm_shape, generator=g)) for _ in range(m.L)]
    if layer_norms(m):           # biases near 0, not 1
        for pair in norms:
            for t in pair:
                t[1] -= 1
    extras = [{name: ((1 + 0.1 * torch.randn(shape, generator=g)) if "norm" in name else
                      0.1 * torch.randn(shape, generator=g)).to(dtype)
               for name, shape in extra_shapes(m, m.is_dense(l)).items()} for l in range(m.L)]
    embed = torch.randn(m.V, m.h, generator=g).to(dtype)
    head = (torch.randn(m.V, m.h, generator=g) / m.h ** 0.5).to(dtype)
    final_norm = torch.ones(m.h, dtype=dtype)
    if layer_norms(m):
        final_norm = torch.stack([final_norm, torch.zeros_like(final_norm)])
    return ModelWeights(
        model=m, layers=layers, norms=[(a.to(dtype), b.to(dtype)) for a, b in norms],
        embed=embed, final_norm=final_norm,
        lm_head=embed if m.tie_word_embeddings else head, extras=extras,
        head_bias=(0.1 * torch.randn(m.V, generator=g)).to(dtype) if m.lm_head_bias else None)


def layer_norms(m: ModelSpec) -> bool:
    """Whether the model's norms are LayerNorms with a bias (Phi-3.5-MoE), not RMSNorms."""
    return m.architecture == "phimoe"


def _quantized_section(m: ModelSpec) -> Section:
    return layer_sections(m)[-1]


def _blocks(flat: torch.Tensor, m: ModelSpec) -> torch.Tensor:
    """An MoE layer's experts' blocks [E, bytes] (uint8), a view of its flat vector."""
    if flat.element_size() != m.dtype_bytes:
        raise ValueError(f"Experts in blocks fill elements of model.dtype_bytes = "
                         f"{m.dtype_bytes} bytes, and this layer's vector holds "
                         f"{flat.element_size()}-byte {flat.dtype}: build it in the model's "
                         "dtype.")
    s = _quantized_section(m)
    return flat[s.offset:s.offset + s.size].view(s.shape).view(torch.uint8)


def _quantize_into(flat: torch.Tensor, m: ModelSpec, matrix: Any) -> None:
    """Write an MoE layer's experts into its vector's blocks, an expert at a time (the layer's
    blocks are never held twice), from `matrix(e, part, shape)` giving each of an expert's
    w1, w3, w2 (rows are output features)."""
    shapes = {"w1": (m.h_i, m.h), "w3": (m.h_i, m.h), "w2": (m.h, m.h_i)}
    for e, blocks in enumerate(_blocks(flat, m)):
        blocks.copy_(quantize_expert(*(matrix(e, part, shape) for part, shape in shapes.items()),
                                     expert_format(m)))


_ATTENTION = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "q_a": "self_attn.q_a_proj", "q_b": "self_attn.q_b_proj",
              "kv_a": "self_attn.kv_a_proj_with_mqa"}
#: A SwiGLU MLP's matrices as tg names them (w1 gate, w3 up, w2 down) and as the families
#: after Mixtral do.
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _tensor_name(m: ModelSpec, layer: int, section: str) -> str:
    """A layer's matrix in a Hugging Face checkpoint of the model's family."""
    mixtral = m.architecture in ("mixtral", "phimoe")       # Phi-3.5-MoE names them so too
    if section in _ATTENTION:
        base = _ATTENTION[section]
    elif section.startswith("dense."):
        base = f"mlp.{_PROJ[section.split('.')[1]]}"
    elif section == "router":
        base = ("block_sparse_moe.gate" if mixtral else
                "mlp.router" if m.architecture == "gpt_oss" else "mlp.gate")
    elif section.startswith("shared."):
        part = section.split(".")[1]
        shared = "mlp.shared_expert" if m.architecture == "qwen2_moe" else "mlp.shared_experts"
        base = "mlp.shared_expert_gate" if part == "gate" else f"{shared}.{_PROJ[part]}"
    else:
        part, e = section.split(".")
        base = (f"block_sparse_moe.experts.{e}.{part}" if mixtral
                else f"mlp.experts.{e}.{_PROJ[part]}")
    return f"model.layers.{layer}.{base}.weight"


def _extra_names(layer: int, name: str) -> list[str]:
    """The checkpoint tensors a family's small tensor is made of (concatenated in order)."""
    p = f"model.layers.{layer}.self_attn."
    if name == "qkv_bias":
        return [p + f"{x}_proj.bias" for x in "qkv"]
    if name in ("o_bias", "sinks"):
        return [p + ("o_proj.bias" if name == "o_bias" else "sinks")]
    if name == "router_logit_bias":
        return [f"model.layers.{layer}.mlp.router.bias"]
    if name == "router_bias":
        return [f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
    if name in ("q_a_norm", "kv_a_norm"):
        return [p + f"{name[:-5]}_layernorm.weight"]
    return [p + f"{name}.weight"]


def checkpoint_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from ``model.safetensors.index.json``
    when the checkpoint is sharded, else from the files' own headers (no tensor is read)."""
    from safetensors import safe_open

    index_file = folder / "model.safetensors.index.json"
    for f in folder.iterdir() if folder.is_dir() else [folder]:
        note_input(f)                   # no output of this run may replace the checkpoint
    if folder.is_dir() and index_file.is_file():
        doc = read_json(index_file, "safetensors index")
        if not isinstance(doc, dict) or "weight_map" not in doc:
            raise TgError(f"'{index_file}' is not a safetensors index (a JSON object with a "
                          "weight_map).")
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise TgError(f"'{index_file}': weight_map must map tensor names to shard file "
                          "names (strings).")
        inside, index = folder.resolve(), {}
        for name, file in weight_map.items():
            shard = (folder / file).resolve()
            if shard.parent != inside:        # "../x", an absolute path, a link out of it
                raise TgError(f"'{index_file}': tensor '{name[:80]}' is said to lie in "
                              f"'{file[:80]}', outside the checkpoint folder; a shard must be a "
                              "file of the folder itself.")
            if not shard.is_file():
                raise TgError(f"'{index_file}' lists the shard '{file[:80]}', which is not in "
                              f"'{folder}' (a missing or partial download?).")
            index[name] = shard
        return index
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    if not files or not all(f.is_file() for f in files):
        raise TgError(f"No .safetensors files in '{folder}'.")
    index: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                index.update({name: f for name in handle.keys()})
        except Exception as err:      # noqa: BLE001 - safetensors raises several kinds
            raise TgError(f"'{f}' is not a readable safetensors file ({err}).") from None
    return index


def load_safetensors(path: str | Path, m: ModelSpec, dtype: torch.dtype = torch.float32
                     ) -> ModelWeights:
    """Weights of the first ``m.L`` layers of a Hugging Face checkpoint of the model's family
    (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3: a folder of ``*.safetensors``,
    sharded with ``model.safetensors.index.json`` or not) whose shapes match `m`, converted
    to `dtype`. MLA's up-projection is split into its key and value rows (uk, uv).

    Tensors are read one at a time through memory-mapped ``safe_open`` handles and copied into
    each layer's flat vector; the handles close after every layer, so peak host memory is the
    weights the run keeps plus one layer's mapped pages, not the checkpoint. A tied checkpoint
    (``m.tie_word_embeddings``) shares one matrix between embedding and LM head."""
    checkpoint = _Checkpoint(Path(path), m, dtype)
    layers, norms, extras = [], [], []
    for i in range(m.L):
        flat, norm, extra = _layer(checkpoint, i)
        layers.append(flat)
        norms.append(norm)
        extras.append(extra)
        checkpoint.close()     # unmap: the pages read stay resident while a handle is open
    embed = checkpoint.read("model.embed_tokens.weight", (m.V, m.h))
    if m.tie_word_embeddings:
        head = embed
    elif "lm_head.weight" not in checkpoint.index:
        raise TgError(f"Checkpoint '{path}' has no 'lm_head.weight' and its config does not "
                      "tie the LM head to the embedding (tie_word_embeddings is false).")
    else:
        head = checkpoint.read("lm_head.weight", (m.V, m.h))
    head_bias = checkpoint.read("lm_head.bias", (m.V,)) if m.lm_head_bias else None
    final_norm = checkpoint.read_norm("model.norm")
    checkpoint.close()
    return ModelWeights(model=m, layers=layers, norms=norms, embed=embed,
                        final_norm=final_norm, lm_head=head, extras=extras,
                        head_bias=head_bias)


class _Checkpoint:
    """A checkpoint's tensors by name, each checked (present, of the model's shape, floating
    point, finite) as it is read and converted to the run's dtype."""

    def __init__(self, folder: Path, m: ModelSpec, dtype: torch.dtype):
        try:
            from safetensors import safe_open
        except ImportError:
            raise TgError("Loading checkpoints needs safetensors: pip install "
                          "safetensors.") from None
        self.open, self.folder, self.model, self.dtype = safe_open, folder, m, dtype
        self.index = checkpoint_index(folder)
        self.handles: dict[Path, Any] = {}

    def close(self) -> None:
        self.handles.clear()

    def read(self, name: str, shape: tuple[int, ...], out: torch.Tensor | None = None
             ) -> torch.Tensor:
        file = self.index.get(name)
        if file is None:
            raise TgError(f"Checkpoint '{self.folder}' has no tensor '{name}', which a "
                          f"{self.model.architecture} checkpoint holds.")
        try:
            if file not in self.handles:
                self.handles[file] = self.open(str(file), framework="pt")
            t = self.handles[file].get_tensor(name)
        except Exception as err:      # noqa: BLE001 - safetensors raises several kinds
            raise TgError(f"Checkpoint tensor '{name}' cannot be read from '{file}' (a "
                          f"truncated or corrupt shard?): {str(err)[:200]}") from None
        if tuple(t.shape) != shape:
            raise TgError(f"Checkpoint tensor '{name}' has shape {tuple(t.shape)}, but the "
                          f"scenario's model needs {shape}.")
        # Casting would turn quantized integers into wrong weights, and one NaN spreads to every
        # logit (argmax then says token 0), so neither is run.
        if not t.dtype.is_floating_point or t.dtype.itemsize == 1:       # fp8: scaled blocks
            raise TgError(f"Checkpoint tensor '{name}' in '{file}' is "
                          f"{str(t.dtype).removeprefix('torch.')}; tg runs float32, bfloat16 or "
                          "float16 weights, not quantized ones (dequantize the checkpoint first).")
        if out is None:       # a copy: a tensor on the mapped file keeps all of it resident
            out = t.to(self.dtype, copy=True)
        else:
            out.copy_(t.reshape(-1))
        if not _finite(out):     # as it will run: fp32 -> fp16 can overflow
            raise TgError(f"Checkpoint tensor '{name}' in '{file}' holds NaN or infinite values "
                          f"(as {str(self.dtype).removeprefix('torch.')}); the model's outputs "
                          "would be meaningless.")
        return out

    def read_norm(self, name: str) -> torch.Tensor:
        """A norm's weight, or a LayerNorm's weight and bias stacked (ModelWeights.norms)."""
        h = self.model.h
        if not layer_norms(self.model):
            return self.read(name + ".weight", (h,))
        return torch.stack([self.read(name + ".weight", (h,)), self.read(name + ".bias", (h,))])


def _layer(checkpoint: _Checkpoint, i: int) -> tuple[torch.Tensor, tuple, dict]:
    """Layer `i`'s flat vector (its experts quantized where the model stores them so), its
    two norms and its small tensors."""
    m, read = checkpoint.model, checkpoint.read
    sections = layer_sections(m, m.is_dense(i))
    flat = torch.empty(sections[-1].offset + sections[-1].size, dtype=checkpoint.dtype)
    fused = _fused_experts(read, m, i) if m.architecture == "gpt_oss" else None
    for s in sections:
        out = flat[s.offset:s.offset + s.size]
        if s.name == QUANTIZED:
            _quantize_into(flat, m, lambda e, part, shape: (
                fused[part][e] if fused is not None
                else read(_tensor_name(m, i, f"{part}.{e}"), shape)))
        elif fused is not None and s.name.split(".")[0] in ("w1", "w3", "w2"):
            part, e = s.name.split(".")
            out.copy_(fused[part][int(e)].reshape(-1))
        elif s.name in ("uk", "uv"):      # MLA's up-projection, each head's key | value rows
            n, nope, v = m.n_q, m.qk_nope_head_dim, m.v_head_dim
            kv_b = read(f"model.layers.{i}.self_attn.kv_b_proj.weight",
                        (n * (nope + v), m.kv_lora_rank)).view(n, nope + v, -1)
            out.copy_((kv_b[:, :nope] if s.name == "uk" else kv_b[:, nope:]).reshape(-1))
        else:
            read(_tensor_name(m, i, s.name), s.shape, out)
    p = f"model.layers.{i}."
    norms = (checkpoint.read_norm(p + "input_layernorm"),
             checkpoint.read_norm(p + "post_attention_layernorm"))
    small = {}
    for name, shape in extra_shapes(m, m.is_dense(i)).items():
        if name in ("b13", "b2"):
            small[name] = fused[name]
            continue
        parts = _extra_names(i, name)
        sizes = [m.q_dim, m.h_kv, m.h_kv] if len(parts) == 3 else [shape[0]]
        small[name] = torch.cat([read(t, (n,)) for t, n in zip(parts, sizes)])
    return flat, norms, small


def _fused_experts(read: Any, m: ModelSpec, layer: int) -> dict[str, torch.Tensor]:
    """gpt-oss's experts as its checkpoint stores them, all of a layer's in one tensor (x @ W,
    gate and up interleaved column by column), as tg's matrices (rows are output features):
    w1 the gates, w3 the ups, w2 the down projections; b13 each expert's gate | up bias, b2
    its down bias."""
    p = f"model.layers.{layer}.mlp.experts."
    gate_up = read(p + "gate_up_proj", (m.E, m.h, 2 * m.h_i))
    bias = read(p + "gate_up_proj_bias", (m.E, 2 * m.h_i))
    return {"w1": gate_up[..., 0::2].transpose(1, 2), "w3": gate_up[..., 1::2].transpose(1, 2),
            "w2": read(p + "down_proj", (m.E, m.h_i, m.h)).transpose(1, 2),
            "b13": torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=-1),
            "b2": read(p + "down_proj_bias", (m.E, m.h))}


def save_mixtral_safetensors(w: ModelWeights, folder: str | Path) -> Path:
    """Write `w` as a Hugging Face Mixtral checkpoint (model.safetensors + config.json)."""
    from safetensors.torch import save_file

    m = w.model
    if m.architecture != "mixtral" or expert_format(m):
        raise ValueError("tg writes 16-bit Mixtral checkpoints only")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = w.lm_head
    for i, flat in enumerate(w.layers):
        for s in layer_sections(m):
            out[_tensor_name(m, i, s.name)] = flat[s.offset:s.offset + s.size].reshape(
                s.shape).clone()
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"], out[p + "post_attention_layernorm.weight"] = w.norms[i]
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": m.h, "intermediate_size": m.h_i, "num_hidden_layers": m.L,
        "num_attention_heads": m.n_q, "num_key_value_heads": m.n_kv,
        "num_local_experts": m.E, "num_experts_per_tok": m.k, "vocab_size": m.V,
        "head_dim": m.d, "rope_theta": m.rope_theta, "rms_norm_eps": m.rms_norm_eps,
        "tie_word_embeddings": m.tie_word_embeddings,
        "torch_dtype": str(w.embed.dtype).removeprefix("torch.")}))
    return folder


def _finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """No NaN or infinity in `t`, checked a million elements at a time: a whole-tensor mask
    would add a quarter of a float32 tensor's size to the loader's peak (an 8x7B expert's: 44
    MB)."""
    return all(bool(torch.isfinite(part).all()) for part in t.reshape(-1).split(chunk))
