"""Model weights for the executor: synthetic and deterministic by seed, or a Hugging Face
Mixtral safetensors checkpoint.

Each layer's matrices live in one flat vector, in the order the cost model pages them
(:class:`taskgraph.work.WeightLayout`): q, k, v | o | router | experts (w1, w3, w2 per expert).
The first ``r_w`` of a layer stays on the GPU and the rest streams in pages, so any byte range of
this vector is a page. Norms, embedding and LM head are small and always resident.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from taskgraph.errors import TgError
from taskgraph.specs import ModelSpec


@dataclass(frozen=True)
class Section:
    name: str
    shape: tuple[int, int]
    offset: int          # first element in the layer's flat vector

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]


def layer_sections(m: ModelSpec) -> list[Section]:
    """The matrices of one layer in flat order (rows are output features)."""
    shapes = [("q", (m.h, m.h)), ("k", (m.h_kv, m.h)), ("v", (m.h_kv, m.h)), ("o", (m.h, m.h)),
              ("router", (m.E, m.h))]
    for e in range(m.E):
        shapes += [(f"w1.{e}", (m.h_i, m.h)), (f"w3.{e}", (m.h_i, m.h)), (f"w2.{e}", (m.h, m.h_i))]
    out, offset = [], 0
    for name, shape in shapes:
        out.append(Section(name, shape, offset))
        offset += shape[0] * shape[1]
    return out


@dataclass
class ModelWeights:
    """All weights on the host: `layers[l]` is layer l's flat vector."""

    model: ModelSpec
    layers: list[torch.Tensor]
    norms: list[tuple[torch.Tensor, torch.Tensor]]   # (input, post-attention) RMSNorm per layer
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    @property
    def layer_numel(self) -> int:
        return self.layers[0].numel()


def synthetic_weights(m: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32
                      ) -> ModelWeights:
    """Random weights scaled so activations stay O(1) through many layers."""
    g = torch.Generator().manual_seed(seed)
    sections = layer_sections(m)
    numel = sections[-1].offset + sections[-1].size
    layers = []
    for _ in range(m.L):
        flat = torch.empty(numel, dtype=torch.float32)
        for s in sections:
            fan_in = s.shape[1]
            flat[s.offset:s.offset + s.size] = torch.randn(s.size, generator=g) / fan_in ** 0.5
        layers.append(flat.to(dtype))
    norms = [(1 + 0.1 * torch.randn(m.h, generator=g), 1 + 0.1 * torch.randn(m.h, generator=g))
             for _ in range(m.L)]
    return ModelWeights(
        model=m, layers=layers, norms=[(a.to(dtype), b.to(dtype)) for a, b in norms],
        embed=torch.randn(m.V, m.h, generator=g).to(dtype),
        final_norm=torch.ones(m.h, dtype=dtype),
        lm_head=(torch.randn(m.V, m.h, generator=g) / m.h ** 0.5).to(dtype))


def load_mixtral_safetensors(path: str | Path, m: ModelSpec, dtype: torch.dtype = torch.float32
                             ) -> ModelWeights:
    """Weights from a Hugging Face Mixtral checkpoint folder (``*.safetensors``, possibly
    sharded) whose shapes match `m`."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise TgError("Loading checkpoints needs safetensors: pip install safetensors.") from None
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    if not files:
        raise TgError(f"No .safetensors files in '{folder}'.")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise TgError(f"Checkpoint '{folder}' has no tensor '{name}'; tg reads Mixtral "
                          "(model.layers.N.block_sparse_moe.experts.E.w1 ...) names.")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise TgError(f"Checkpoint tensor '{name}' has shape {tuple(t.shape)}, but the "
                          f"scenario's model needs {shape}.")
        return t.to(dtype)

    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "router": "block_sparse_moe.gate"}
    sections = layer_sections(m)
    layers, norms = [], []
    for i in range(m.L):
        p = f"model.layers.{i}."
        parts = []
        for s in sections:
            base = names.get(s.name) or "block_sparse_moe.experts.{1}.{0}".format(
                *s.name.split("."))
            parts.append(get(p + base + ".weight", s.shape).reshape(-1))
        layers.append(torch.cat(parts))
        norms.append((get(p + "input_layernorm.weight", (m.h,)),
                      get(p + "post_attention_layernorm.weight", (m.h,))))
    return ModelWeights(model=m, layers=layers, norms=norms,
                        embed=get("model.embed_tokens.weight", (m.V, m.h)),
                        final_norm=get("model.norm.weight", (m.h,)),
                        lm_head=get("lm_head.weight", (m.V, m.h)))


def save_mixtral_safetensors(w: ModelWeights, folder: str | Path) -> Path:
    """Write `w` as a Hugging Face Mixtral checkpoint (model.safetensors + config.json)."""
    from safetensors.torch import save_file

    m = w.model
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm,
           "lm_head.weight": w.lm_head}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "router": "block_sparse_moe.gate"}
    for i, flat in enumerate(w.layers):
        p = f"model.layers.{i}."
        for s in layer_sections(m):
            base = names.get(s.name) or "block_sparse_moe.experts.{1}.{0}".format(
                *s.name.split("."))
            out[p + base + ".weight"] = flat[s.offset:s.offset + s.size].reshape(s.shape).clone()
        out[p + "input_layernorm.weight"], out[p + "post_attention_layernorm.weight"] = w.norms[i]
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": m.h, "intermediate_size": m.h_i, "num_hidden_layers": m.L,
        "num_attention_heads": m.n_q, "num_key_value_heads": m.n_kv,
        "num_local_experts": m.E, "num_experts_per_tok": m.k, "vocab_size": m.V}))
    return folder
