"""Model weights for the executor: synthetic and deterministic by seed, or a Hugging Face
Mixtral safetensors checkpoint.

Each layer's matrices live in one flat vector, in the order the cost model pages them
(:class:`taskgraph.dag.work.WeightLayout`): q, k, v | o | router | experts (w1, w3, w2 per expert).
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
    shapes = [("q", (m.q_dim, m.h)), ("k", (m.h_kv, m.h)), ("v", (m.h_kv, m.h)),
              ("o", (m.h, m.q_dim)), ("router", (m.E, m.h))]
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
    embed = torch.randn(m.V, m.h, generator=g).to(dtype)
    head = (torch.randn(m.V, m.h, generator=g) / m.h ** 0.5).to(dtype)
    return ModelWeights(
        model=m, layers=layers, norms=[(a.to(dtype), b.to(dtype)) for a, b in norms],
        embed=embed, final_norm=torch.ones(m.h, dtype=dtype),
        lm_head=embed if m.tie_word_embeddings else head)


_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
          "o": "self_attn.o_proj", "router": "block_sparse_moe.gate"}


def _tensor_name(layer: int, section: str) -> str:
    base = _NAMES.get(section) or "block_sparse_moe.experts.{1}.{0}".format(*section.split("."))
    return f"model.layers.{layer}.{base}.weight"


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


def load_mixtral_safetensors(path: str | Path, m: ModelSpec, dtype: torch.dtype = torch.float32
                             ) -> ModelWeights:
    """Weights of the first ``m.L`` layers of a Hugging Face Mixtral checkpoint (a folder of
    ``*.safetensors``, sharded with ``model.safetensors.index.json`` or not) whose shapes match
    `m`, converted to `dtype`.

    Tensors are read one at a time through memory-mapped ``safe_open`` handles and copied into
    each layer's flat vector; the handles close after every layer, so peak host memory is the
    weights the run keeps plus one layer's mapped pages, not the checkpoint. A tied checkpoint (``m.tie_word_embeddings``) shares one matrix between
    embedding and LM head."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise TgError("Loading checkpoints needs safetensors: pip install safetensors.") from None
    folder = Path(path)
    index = checkpoint_index(folder)
    handles: dict[Path, Any] = {}

    def read(name: str, shape: tuple[int, ...], out: torch.Tensor | None = None
             ) -> torch.Tensor:
        file = index.get(name)
        if file is None:
            raise TgError(f"Checkpoint '{folder}' has no tensor '{name}'; tg reads Mixtral "
                          "tensor names (model.layers.N.block_sparse_moe.experts.E.w1.weight "
                          "...).")
        try:
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            t = handles[file].get_tensor(name)
        except Exception as err:      # noqa: BLE001 - safetensors raises several kinds
            raise TgError(f"Checkpoint tensor '{name}' cannot be read from '{file}' (a "
                          f"truncated or corrupt shard?): {str(err)[:200]}") from None
        if tuple(t.shape) != shape:
            raise TgError(f"Checkpoint tensor '{name}' has shape {tuple(t.shape)}, but the "
                          f"scenario's model needs {shape}.")
        # Casting would turn quantized integers into wrong weights, and one NaN spreads to every
        # logit (argmax then says token 0), so neither is run.
        if not t.dtype.is_floating_point:
            raise TgError(f"Checkpoint tensor '{name}' in '{file}' is "
                          f"{str(t.dtype).removeprefix('torch.')}; tg runs float32, bfloat16 or "
                          "float16 weights, not quantized ones (dequantize the checkpoint first).")
        if out is None:       # a copy: a tensor on the mapped file keeps all of it resident
            out = t.to(dtype, copy=True)
        else:
            out.copy_(t.reshape(-1))
        if not _finite(out):     # as it will run: fp32 -> fp16 can overflow
            raise TgError(f"Checkpoint tensor '{name}' in '{file}' holds NaN or infinite values "
                          f"(as {str(dtype).removeprefix('torch.')}); the model's outputs would "
                          "be meaningless.")
        return out

    sections = layer_sections(m)
    numel = sections[-1].offset + sections[-1].size
    layers, norms = [], []
    for i in range(m.L):
        flat = torch.empty(numel, dtype=dtype)
        for s in sections:
            read(_tensor_name(i, s.name), s.shape, flat[s.offset:s.offset + s.size])
        layers.append(flat)
        p = f"model.layers.{i}."
        norms.append((read(p + "input_layernorm.weight", (m.h,)),
                      read(p + "post_attention_layernorm.weight", (m.h,))))
        handles.clear()     # unmap: the pages read stay resident while a handle is open
    embed = read("model.embed_tokens.weight", (m.V, m.h))
    if m.tie_word_embeddings:
        head = embed
    elif "lm_head.weight" not in index:
        raise TgError(f"Checkpoint '{folder}' has no 'lm_head.weight' and its config does not "
                      "tie the LM head to the embedding (tie_word_embeddings is false).")
    else:
        head = read("lm_head.weight", (m.V, m.h))
    handles.clear()
    return ModelWeights(model=m, layers=layers, norms=norms, embed=embed,
                        final_norm=read("model.norm.weight", (m.h,)), lm_head=head)


def save_mixtral_safetensors(w: ModelWeights, folder: str | Path) -> Path:
    """Write `w` as a Hugging Face Mixtral checkpoint (model.safetensors + config.json)."""
    from safetensors.torch import save_file

    m = w.model
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = w.lm_head
    for i, flat in enumerate(w.layers):
        for s in layer_sections(m):
            out[_tensor_name(i, s.name)] = flat[s.offset:s.offset + s.size].reshape(
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
