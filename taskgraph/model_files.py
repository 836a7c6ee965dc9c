"""A model described by the files that describe it: a Hugging Face ``config.json`` (with its
``quantization_config``) or a GGUF file, read with llama.cpp's own ``gguf`` package.

Each family is read from its own fields (Mixtral's ``num_local_experts``, Qwen's
``num_experts`` and ``mlp_only_layers``, DeepSeek's ``n_routed_experts`` and
``first_k_dense_replace`` ...), never through another family's names: a ``model_type`` tg does
not know, or a field whose value would change what tg models in a way it cannot say (a router
it does not price, a layer pattern it cannot place), is an error naming it.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any, Callable

from taskgraph.errors import TgError
from taskgraph.files import read_json
from taskgraph.specs import ARCHITECTURES, TENSOR_CLASSES

# The JSON type of each config.json field tg reads. Checked before anything is read, because
# Python's truthiness and pydantic's lax coercion would take a wrong type as a value:
# bool("false") is True, "256" becomes 256, true becomes 1.
_INT, _NUMBER = ("a whole number", (int,)), ("a number", (int, float))
_HF_TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    **dict.fromkeys((
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "num_local_experts", "num_experts", "n_routed_experts",
        "num_experts_per_tok", "vocab_size", "head_dim", "sliding_window",
        "max_position_embeddings", "d_model", "n_layers", "n_heads", "moe_intermediate_size",
        "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace",
        "moe_layer_freq", "decoder_sparse_step", "n_group", "topk_group", "kv_lora_rank",
        "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "max_window_layers", "bits", "group_size"), _INT),
    **dict.fromkeys(("rope_theta", "rms_norm_eps", "factor", "routed_scaling_factor",
                     "swiglu_limit", "swiglu_alpha", "router_jitter_noise",
                     "partial_rotary_factor"), _NUMBER),
    **dict.fromkeys(("torch_dtype", "dtype", "hidden_act", "_name_or_path", "rope_type", "type",
                     "model_type", "topk_method", "scoring_func", "quant_method"),
                    ("a string", (str,))),
    **dict.fromkeys(("rope_scaling", "rope_parameters", "ffn_config", "attn_config",
                     "quantization_config"), ("an object", (dict,))),
    **dict.fromkeys(("mlp_only_layers", "layer_types", "weight_block_size",
                     "modules_to_not_convert"), ("a list", (list,))),
    **dict.fromkeys(("tie_word_embeddings", "norm_topk_prob", "use_sliding_window",
                     "rope_interleave"), ("true or false", (bool,))),
}
# Fields read with a fallback where they are unset (a layer pattern's step, the KV heads), so
# that 0 would silently mean the fallback, and counts of what may be absent: checked here.
_AT_LEAST_ONE = frozenset({"num_key_value_heads", "decoder_sparse_step", "moe_layer_freq",
                           "n_group", "topk_group"})
_NOT_NEGATIVE = frozenset({"first_k_dense_replace", "n_shared_experts",
                           "shared_expert_intermediate_size", "max_window_layers"})
_ABOVE_ZERO = frozenset({"factor", "rope_theta", "swiglu_limit", "swiglu_alpha"})
_JSON_KIND = {bool: "true/false", int: "a number", float: "a number with a decimal point",
              str: "a string", list: "a list", dict: "an object"}
_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


def hf_config_json(path: str | Path) -> dict[str, Any]:
    """A Hugging Face ``config.json`` whose fields tg reads each hold their JSON type (null
    counts as absent); a wrong one is an error naming the field, never a guess."""
    path = Path(path)
    cfg = read_json(path, "model config")
    if not isinstance(cfg, dict):
        raise TgError(f"The model config '{path}' must hold a JSON object.")
    nested = [(f"{outer}.", cfg[outer]) for outer in ("rope_scaling", "rope_parameters",
                                                      "quantization_config")
              if isinstance(cfg.get(outer), dict)]
    for prefix, doc in [("", cfg)] + nested:
        for key, value in doc.items():
            want = _HF_TYPES.get(key)
            if want is None or value is None:
                continue
            if isinstance(value, bool) != (want[1] == (bool,)) or not isinstance(value, want[1]):
                raise TgError(f"Model config '{path}': {prefix}{key} must be {want[0]}, not "
                              f"{_JSON_KIND.get(type(value), 'that')}.")
            bound = ("at least 1" if key in _AT_LEAST_ONE and value < 1 else
                     "0 or more" if key in _NOT_NEGATIVE and value < 0 else
                     "above 0" if key in _ABOVE_ZERO and value <= 0 else None)
            if bound:
                raise TgError(f"Model config '{path}': {prefix}{key} must be {bound}, not "
                              f"{value}.")
    return cfg


def model_from_hf_config(path: str | Path) -> dict[str, Any]:
    """Model fields from a Hugging Face ``config.json`` of a family tg knows (ARCHITECTURES):
    its shapes, which layers are dense, its shared experts and router, its attention (GQA or
    MLA, sliding windows, sinks), every field that changes what it computes, its dtype and,
    from ``quantization_config``, how each class of tensor is stored."""
    path = Path(path)
    cfg = hf_config_json(path)
    family = cfg.get("model_type") or _family_of(cfg, path)
    reader = _FAMILIES.get(family)
    if reader is None:
        raise TgError(f"Model config '{path}': model_type '{family}' is not a family tg "
                      f"describes ({', '.join(ARCHITECTURES)}).")
    try:
        fields = reader({**cfg, "model_type": family})     # the readers branch on it
    except KeyError as missing:
        raise TgError(f"Model config '{path}': a {family} config needs the field {missing}."
                      ) from None
    except _Unsupported as err:
        raise TgError(f"Model config '{path}': {err}") from None
    fields["architecture"] = family
    fields["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings") or False)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype is not None:
        if dtype not in _DTYPES:
            raise TgError(f"Model config '{path}': dtype '{dtype}' is not one tg runs "
                          "(float32, bfloat16, float16).")
        fields.update(dtype=dtype, dtype_bytes=_DTYPES[dtype])
    quant = cfg.get("quantization_config")
    if quant:
        try:
            fields["precision"] = _precision(quant, fields)
        except _Unsupported as err:
            raise TgError(f"Model config '{path}': quantization_config.{err}") from None
    name = cfg.get("_name_or_path") or path.parent.name or path.stem
    return dict(name=str(name), **fields)


#: transformers' model class of each family (a config's "architectures"), for a config
#: without its model_type.
_CLASSES = {"MixtralForCausalLM": "mixtral", "DbrxForCausalLM": "dbrx",
            "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
            "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
            "OlmoeForCausalLM": "olmoe", "PhimoeForCausalLM": "phimoe",
            "GptOssForCausalLM": "gpt_oss", "Glm4MoeForCausalLM": "glm4_moe"}


def _family_of(cfg: dict[str, Any], path: Path) -> str:
    """The family of a config without a model_type: its transformers class, or, with neither,
    the oldest configs' (DBRX's d_model, else Mixtral's)."""
    classes = cfg.get("architectures")
    if classes is not None and not isinstance(classes, list):
        raise TgError(f"Model config '{path}': architectures must be a list, not "
                      f"{_JSON_KIND.get(type(classes), 'that')}.")
    if not classes:
        return "dbrx" if "d_model" in cfg else "mixtral"
    named = [_CLASSES[c] for c in classes if isinstance(c, str) and c in _CLASSES]
    if not named:
        raise TgError(f"Model config '{path}' has no model_type, and its architectures "
                      f"{str(classes)[:80]} name no family tg describes "
                      f"({', '.join(ARCHITECTURES)}).")
    return named[0]


class _Unsupported(Exception):
    """A field's value tg cannot describe: the message names the field."""


# --- the families -------------------------------------------------------------------------------

def _common(cfg: dict[str, Any], experts_key: str) -> dict[str, Any]:
    """What most families spell alike: shapes, norms, RoPE, head_dim, activation."""
    fields = dict(h=cfg["hidden_size"], L=cfg["num_hidden_layers"],
                  n_q=cfg["num_attention_heads"],
                  n_kv=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                  E=cfg[experts_key], k=cfg["num_experts_per_tok"], V=cfg["vocab_size"],
                  **_rope_fields(cfg))
    for ours in ("head_dim", "rms_norm_eps", "hidden_act"):
        if cfg.get(ours) is not None:
            fields[ours] = cfg[ours]
    return fields


def _mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = _common(cfg, "num_local_experts")
    fields["h_i"] = cfg["intermediate_size"]
    if cfg.get("sliding_window") is not None:
        fields["sliding_window"] = cfg["sliding_window"]
    return fields


def _phimoe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3.5-MoE: Mixtral's shapes, LayerNorms, biases, SparseMixer routing (two experts,
    whatever num_experts_per_tok says; ModelSpec refuses another k) and LongRoPE."""
    fields = _mixtral(cfg)
    fields.update(attention_bias=bool(cfg.get("attention_bias", False)),
                  lm_head_bias=bool(cfg.get("lm_head_bias", False)))
    if cfg.get("router_jitter_noise") is not None:
        fields["sparsemixer_eps"] = cfg["router_jitter_noise"]
    return fields


def _dbrx(cfg: dict[str, Any]) -> dict[str, Any]:
    ffn, attn = cfg.get("ffn_config") or {}, cfg.get("attn_config") or {}
    return dict(h=cfg["d_model"], h_i=ffn["ffn_hidden_size"], L=cfg["n_layers"],
                n_q=cfg["n_heads"], n_kv=attn["kv_n_heads"], E=ffn["moe_num_experts"],
                k=ffn["moe_top_k"], V=cfg["vocab_size"],
                rope_theta=attn.get("rope_theta", 10000.0))


def _qwen_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE: dense layers by mlp_only_layers and decoder_sparse_step, a
    gated shared expert (Qwen2-MoE), an optional sliding window from max_window_layers on."""
    experts = "num_experts" if "num_experts" in cfg else "num_local_experts"
    fields = _common(cfg, experts)
    L, step = fields["L"], cfg.get("decoder_sparse_step") or 1
    fields["h_i"] = cfg["moe_intermediate_size"]
    fields["renormalize"] = bool(cfg.get("norm_topk_prob", False))
    only = cfg.get("mlp_only_layers") or []
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < L for i in only):
        raise _Unsupported(f"mlp_only_layers must list layer numbers from 0 to {L - 1} "
                           f"(num_hidden_layers {L}), not {str(only)[:60]}.")
    dense = sorted(set(only) | {i for i in range(L) if (i + 1) % step})
    if dense:
        fields.update(dense_layers=tuple(dense), h_dense=cfg["intermediate_size"])
    shared = cfg.get("shared_expert_intermediate_size")
    if shared:
        fields.update(shared_experts=1, h_shared=shared, shared_gate=True)
    if cfg.get("use_sliding_window"):
        window, first = cfg["sliding_window"], cfg.get("max_window_layers", L)
        fields.update(sliding_window=window, sliding_layers=tuple(range(first, L)))
    return fields


def _deepseek(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3 (and GLM-4.5, which routes as V3, its GQA attention with Q, K, V biases,
    per-head Q/K norms where use_qk_norm says, and partial RoPE): MLA, shared
    experts, the first first_k_dense_replace layers dense (and every moe_layer_freq-th after
    them an MoE one), softmax or sigmoid routing with grouped top-k."""
    fields = _common(cfg, "n_routed_experts")
    L, first = fields["L"], cfg.get("first_k_dense_replace") or 0
    every = cfg.get("moe_layer_freq") or 1
    dense = [i for i in range(L) if i < first or i % every]
    fields["h_i"] = cfg["moe_intermediate_size"]
    if dense:
        fields.update(dense_layers=tuple(dense), h_dense=cfg["intermediate_size"])
    if cfg.get("n_shared_experts"):
        fields.update(shared_experts=cfg["n_shared_experts"],
                      h_shared=cfg["moe_intermediate_size"])
    method = cfg.get("topk_method", "noaux_tc" if cfg.get("model_type") != "deepseek_v2"
                     else "greedy")
    scoring = cfg.get("scoring_func", "sigmoid" if method == "noaux_tc" else "softmax")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise _Unsupported(f"topk_method '{method}' is not a router tg describes (greedy, "
                           "group_limited_greedy, noaux_tc).")
    if scoring not in ("softmax", "sigmoid"):
        raise _Unsupported(f"scoring_func '{scoring}' is not a router tg describes (softmax, "
                           "sigmoid).")
    fields.update(router=scoring, renormalize=bool(cfg.get("norm_topk_prob", False)),
                  routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0))
    if method != "greedy" and cfg.get("n_group"):
        fields.update(expert_groups=cfg["n_group"], topk_groups=cfg.get("topk_group") or 1)
    if cfg.get("model_type") == "glm4_moe":
        fields.update(attention_bias=bool(cfg.get("attention_bias", False)),
                      qk_norm=bool(cfg.get("use_qk_norm", False)))
    else:
        fields.pop("head_dim", None)     # DeepSeek's head_dim is the rope part (MLA's own)
        fields["rope_interleave"] = (True if cfg.get("model_type") == "deepseek_v2"
                                     else bool(cfg.get("rope_interleave", True)))
        fields.update(attention="mla", q_lora_rank=cfg.get("q_lora_rank"),
                      kv_lora_rank=cfg["kv_lora_rank"],
                      qk_nope_head_dim=cfg["qk_nope_head_dim"],
                      qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"])
        fields["n_kv"] = fields["n_q"]
    return fields


def _olmoe(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = _common(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts")
    fields.update(h_i=cfg["intermediate_size"],
                  renormalize=bool(cfg.get("norm_topk_prob", False)))
    return fields


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: alternating sliding-window and full attention (layer_types), attention sinks,
    softmax over the top k router logits."""
    fields = _common(cfg, "num_local_experts")
    fields.update(h_i=cfg["intermediate_size"], attention_sinks=True)
    for name, value in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        if cfg.get(name, value) != value:
            raise _Unsupported(f"{name} {cfg[name]}: tg computes gpt-oss's experts with "
                               f"{name} {value}.")
    types = cfg.get("layer_types") or []
    unknown = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if unknown:
        raise _Unsupported(f"layer_types holds {str(unknown[0])[:40]!r}; tg describes "
                           "sliding_attention and full_attention layers.")
    if types and len(types) != fields["L"]:
        raise _Unsupported(f"layer_types lists {len(types)} layers, num_hidden_layers "
                           f"{fields['L']}: one type a layer.")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding:
        fields.update(sliding_window=cfg["sliding_window"], sliding_layers=sliding)
    return fields


_FAMILIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "mixtral": _mixtral, "phimoe": _phimoe, "dbrx": _dbrx, "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
    "glm4_moe": _deepseek, "olmoe": _olmoe, "gpt_oss": _gpt_oss,
}
assert set(_FAMILIES) == set(ARCHITECTURES)


def _rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE theta and scaling from either transformers 4's (rope_theta, rope_scaling) or 5's
    (rope_parameters) spelling."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 1e6))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": kind}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None:
        out["rope_partial"] = partial
    if kind == "linear":
        out["rope_scaling_factor"] = params.get("factor", 1.0)
    if kind == "yarn":
        out["rope_yarn"] = {k: params[k] for k in _YARN if params.get(k) is not None}
        if cfg.get("max_position_embeddings") is not None:
            out["rope_yarn"]["max_position_embeddings"] = cfg["max_position_embeddings"]
    if kind == "longrope":
        original = params.get("original_max_position_embeddings",
                              cfg.get("original_max_position_embeddings"))
        out["rope_longrope"] = {k: params[k] for k in _LONGROPE if params.get(k) is not None}
        if original is not None:
            out["rope_longrope"]["original_max_position_embeddings"] = original
    return out


_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
         "attention_factor", "mscale", "mscale_all_dim")
_LONGROPE = ("short_factor", "short_mscale")


# --- quantization_config -------------------------------------------------------------------------

#: What a quantization method converts, by default: every linear layer (attention, experts,
#: shared experts, dense FFNs). The router, embedding and LM head stay as they were.
_LINEAR = ("attention", "experts", "shared", "dense")
#: Which of a checkpoint's module names belong to which class of tensor, for
#: modules_to_not_convert (one layer's module named keeps the whole class unconverted: tg states
#: a class's precision, not a layer's).
_MODULES = {"attention": re.compile(r"self_attn|attention|\battn\b"),
            "router": re.compile(r"(^|\.)gate$|\brouter\b"),
            "experts": re.compile(r"(?<!shared_)experts"),
            "shared": re.compile(r"shared_experts?($|\.)"),
            "dense": re.compile(r"mlp($|\.(gate|up|down)_proj)"),
            "embedding": re.compile(r"embed"), "head": re.compile(r"lm_head")}


def _precision(quant: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Each class of tensor's format under a checkpoint's quantization_config."""
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is None:
            fmt: str | float = "fp8"
        elif block == [128, 128]:
            fmt = "fp8-block128"
        elif (len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                      for b in block)):
            fmt = 8.0 + 32.0 / (block[0] * block[1])       # an fp32 scale per block
        else:
            raise _Unsupported(f"weight_block_size {block} is not a block of weights.")
        converted = _LINEAR
    elif method == "mxfp4":
        fmt, converted = "mxfp4", ("experts",)
    elif method in ("awq", "gptq"):
        bits, group = quant.get("bits"), quant.get("group_size")     # null: the default
        bits, group = 4 if bits is None else bits, 128 if group is None else group
        if bits not in (2, 3, 4, 8):
            raise _Unsupported(f"bits {bits}: tg prices {method} at 2, 3, 4 or 8 bits.")
        if not (group == -1 or 8 <= group <= 4096):
            raise _Unsupported(f"group_size {group}: tg prices {method} in groups of 8 to 4096 "
                               "weights (or -1, a group per row).")
        fmt = f"int{bits}-g{group if group > 0 else 4096}"
        converted = _LINEAR
    else:
        raise _Unsupported(f"quant_method '{method}' is not a format tg prices (fp8, mxfp4, "
                           "awq, gptq).")
    kept = [str(name) for name in quant.get("modules_to_not_convert") or []]
    precision = {}
    for cls in converted:
        if not any(_MODULES[cls].search(name) for name in kept):
            precision[cls] = fmt
    return precision


# --- GGUF --------------------------------------------------------------------------------------

#: llama.cpp's architecture names (general.architecture) and the family each stands for. A
#: "llama" file with experts is a Mixtral.
_GGUF_FAMILIES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                  "deepseek2": "deepseek_v3", "olmoe": "olmoe", "phimoe": "phimoe",
                  "gpt-oss": "gpt_oss", "glm4moe": "glm4_moe", "dbrx": "dbrx"}


def model_from_gguf(path: str | Path) -> dict[str, Any]:
    """Model fields from a GGUF file's metadata (a split file's first shard), and each class
    of tensor's format from its tensors' types, checked against each other."""
    from gguf.constants import Keys

    path = Path(path)
    reader = _gguf_reader(path)
    tensors = _gguf_shards(reader, path)
    meta = _Metadata(reader, path)
    fields, width_key = _gguf_shape(meta)
    _check_experts_tensor(meta, tensors, fields, width_key)
    fields.update(_gguf_ffn(meta, fields["h_i"]))
    fields.update(_gguf_attention(meta, fields))
    fields.update(_gguf_rope(meta))
    fields.update(_gguf_tensors(tensors, meta.family))
    name = meta.value(Keys.General.NAME) or _SHARD.sub("", path.name).removesuffix(".gguf")
    return dict(name=str(name), **fields)


def _gguf_reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as err:
        raise TgError(f"GGUF file '{path}' cannot be read (truncated, or not a GGUF file?): "
                      f"{err}") from None


#: How llama.cpp's gguf-split names the shards of a model: <name>-00001-of-00003.gguf.
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _gguf_shards(reader: Any, path: Path) -> list[Any]:
    """The tensors of the whole model: a file split by gguf-split (split.count > 1) holds the
    metadata in its first shard and the tensors across all of them, which are read from
    beside it by their names; a later shard given, or one missing or not the shard its name
    says, is an error naming it."""
    from gguf.constants import Keys

    count = _gguf_value(reader, Keys.Split.LLM_KV_SPLIT_COUNT)
    if count is None or count == 1:
        return list(reader.tensors)
    named = _SHARD.search(path.name)
    if not isinstance(count, int) or named is None or int(named[2]) != count:
        raise TgError(f"GGUF file '{path}' is one of {count} shards (split.count), but its name "
                      "is not gguf-split's <name>-00001-of-0000N.gguf: tg cannot find the others.")

    def shard(i: int) -> Path:
        return path.with_name(_SHARD.sub(f"-{i:05d}-of-{count:05d}.gguf", path.name))

    number = _gguf_value(reader, Keys.Split.LLM_KV_SPLIT_NO, 0)
    if number != 0:
        raise TgError(f"GGUF file '{path}' is shard {number + 1} of {count} (split.no); give "
                      f"the first, '{shard(1).name}', which holds the model's metadata.")
    tensors = list(reader.tensors)
    for i in range(2, count + 1):
        other = shard(i)
        if not other.is_file():
            raise TgError(f"GGUF file '{path}' is split in {count} shards, and '{other}' is "
                          "missing.")
        part = _gguf_reader(other)
        said = (_gguf_value(part, Keys.Split.LLM_KV_SPLIT_NO),
                _gguf_value(part, Keys.Split.LLM_KV_SPLIT_COUNT))
        if said != (i - 1, count):
            raise TgError(f"GGUF file '{other}' should be shard {i} of {count}, but its "
                          f"split.no and split.count say {said}.")
        tensors += part.tensors
    expected = _gguf_value(reader, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    if isinstance(expected, int) and expected != len(tensors):
        raise TgError(f"GGUF file '{path}': its {count} shards hold {len(tensors)} tensors, "
                      f"split.tensors.count says {expected}.")
    return tensors


def _check_experts_tensor(meta: "_Metadata", tensors: list[Any], fields: dict[str, Any],
                          width_key: str) -> None:
    """The metadata's expert count, width (read from `width_key`) and hidden size are every
    stacked routed-expert tensor's shape (ggml's order: the gate's and up's [hidden size,
    width, experts], the down's [width, hidden size, experts]), as llama.cpp's loader requires
    of each tensor; files whose experts are tensors of their own (old Mixtral conversions)
    carry no count to check."""
    from gguf.constants import Keys

    keys = {"E": Keys.LLM.EXPERT_COUNT.format(arch=meta.arch), "h_i": width_key,
            "h": Keys.LLM.EMBEDDING_LENGTH.format(arch=meta.arch)}
    for tensor in tensors:
        part = re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", tensor.name)
        if part is None:
            continue
        shape = [int(x) for x in tensor.shape]
        order = ("h_i", "h", "E") if part[1] == "down" else ("h", "h_i", "E")
        for field, held in zip(order, shape):
            if fields[field] != held:
                raise TgError(f"GGUF file '{meta.path}': {keys[field]} is {fields[field]}, but "
                              f"the tensor '{tensor.name}' holds {held} (its shape {shape}, "
                              "ggml's order).")


class _Metadata:
    """A GGUF file's metadata, its values checked as config.json's fields are."""

    def __init__(self, reader: Any, path: Path):
        from gguf.constants import Keys

        self.reader, self.path = reader, path
        self.arch = self.value(Keys.General.ARCHITECTURE)
        self.family = _GGUF_FAMILIES.get(self.arch)
        if self.family is None:
            raise TgError(f"GGUF file '{path}': general.architecture '{self.arch}' is not a "
                          f"family tg describes ({', '.join(sorted(_GGUF_FAMILIES))}).")

    def value(self, key: str, default: Any = None) -> Any:
        return _gguf_value(self.reader, key, default)

    def key(self, template: str, default: Any = None, required: bool = False) -> Any:
        """A number of the architecture's: a count must be a whole number (a head count may
        be one per layer), a scale a number."""
        name = template.format(arch=self.arch)
        got = self.value(name, default)
        if got is None:
            if required:
                raise TgError(f"GGUF file '{self.path}' lacks {name}.")
            return None
        numbers = got if isinstance(got, list) else [got]
        whole = name.endswith(("_count", "_length", "_rank", "sliding_window", "vocab_size",
                               "count_kv", "nextn_predict_layers"))
        kind = (int,) if whole else (int, float)
        if not numbers or any(isinstance(x, bool) or not isinstance(x, kind) for x in numbers):
            raise TgError(f"GGUF file '{self.path}': {name} must be "
                          f"{'a whole number' if whole else 'a number'}, not {str(got)[:40]!r}.")
        return got


def _gguf_shape(meta: _Metadata) -> tuple[dict[str, Any], str]:
    """Layers, widths, heads, experts and vocabulary; and the key the experts' width is read
    from."""
    from gguf.constants import Keys

    # llama.cpp loads a model's NextN (MTP) layers after the ones that run, and skips them
    # (GLM-4.5's converter counts them in block_count)
    L = (meta.key(Keys.LLM.BLOCK_COUNT, required=True)
         - (meta.key(Keys.LLM.NEXTN_PREDICT_LAYERS) or 0))
    E = meta.key(Keys.LLM.EXPERT_COUNT, required=True)
    if not E:
        raise TgError(f"GGUF file '{meta.path}': {meta.arch} with no experts is no MoE.")
    n_q = meta.key(Keys.Attention.HEAD_COUNT, required=True)
    n_kv = meta.key(Keys.Attention.HEAD_COUNT_KV, n_q)
    # the experts' width: their own key, else (Mixtral, OLMoE, DBRX) the FFN's
    width_key = (Keys.LLM.EXPERT_FEED_FORWARD_LENGTH if meta.key(
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH) else Keys.LLM.FEED_FORWARD_LENGTH)
    tokens = meta.value(Keys.Tokenizer.LIST)
    vocab = meta.key(Keys.LLM.VOCAB_SIZE) or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise TgError(f"GGUF file '{meta.path}' gives neither {meta.arch}.vocab_size nor a "
                      "token list.")
    return dict(
        h=meta.key(Keys.LLM.EMBEDDING_LENGTH, required=True), L=L,
        n_q=n_q if isinstance(n_q, int) else max(n_q),
        n_kv=n_kv if isinstance(n_kv, int) else max(n_kv), E=E,
        k=meta.key(Keys.LLM.EXPERT_USED_COUNT, required=True), V=vocab,
        h_i=meta.key(width_key, required=True),
        rms_norm_eps=float(meta.key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        architecture=meta.family), width_key.format(arch=meta.arch)


def _gguf_ffn(meta: _Metadata, h_i: int) -> dict[str, Any]:
    """Dense layers, shared experts and the router."""
    from gguf.constants import Keys

    fields: dict[str, Any] = {}
    dense = meta.key(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0) or 0
    if dense:
        fields.update(dense_layers=tuple(range(dense)),
                      h_dense=meta.key(Keys.LLM.FEED_FORWARD_LENGTH, required=True))
    shared = meta.key(Keys.LLM.EXPERT_SHARED_COUNT, 0) or 0
    shared_ff = meta.key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
    if shared or shared_ff:
        fields.update(shared_experts=shared or 1, h_shared=shared_ff or h_i,
                      shared_gate=meta.family == "qwen2_moe")
    if meta.key(Keys.LLM.EXPERT_GATING_FUNC) == 2:        # llama.cpp: 1 softmax, 2 sigmoid
        fields["router"] = "sigmoid"
    norm = meta.value(Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=meta.arch))       # a boolean
    if meta.arch in ("qwen2moe", "olmoe"):      # llama.cpp's graphs never renormalise these
        fields["renormalize"] = False
    elif norm is not None or meta.arch in ("deepseek2", "glm4moe"):   # read there, else false
        fields["renormalize"] = bool(norm)
    scale = meta.key(Keys.LLM.EXPERT_WEIGHTS_SCALE)
    if scale:
        fields["routed_scaling"] = float(scale)
    groups = meta.key(Keys.LLM.EXPERT_GROUP_COUNT)
    if groups and groups > 1:
        fields.update(expert_groups=groups,
                      topk_groups=meta.key(Keys.LLM.EXPERT_GROUP_USED_COUNT, 1))
    return fields


def _gguf_attention(meta: _Metadata, shape: dict[str, Any]) -> dict[str, Any]:
    """Heads' size and RoPE's part of them, MLA, sliding windows and sinks."""
    from gguf.constants import Keys

    fields: dict[str, Any] = {}
    kv_lora = meta.key(Keys.Attention.KV_LORA_RANK, required=meta.arch == "deepseek2")
    if meta.arch == "deepseek2" and kv_lora < 1:
        raise TgError(f"GGUF file '{meta.path}': deepseek2.attention.kv_lora_rank is "
                      f"{kv_lora}; MLA caches a latent of at least one element.")
    if kv_lora:
        rope = meta.key(Keys.Rope.DIMENSION_COUNT, required=True)
        k_len = (meta.key(Keys.Attention.KEY_LENGTH_MLA)
                 or meta.key(Keys.Attention.KEY_LENGTH, required=True))
        v_len = (meta.key(Keys.Attention.VALUE_LENGTH_MLA)
                 or meta.key(Keys.Attention.VALUE_LENGTH, required=True))
        # llama.cpp ropes deepseek2 on neighbouring pairs (LLAMA_ROPE_TYPE_NORM) of weights its
        # converter leaves as DeepSeek's: rope_interleave
        fields.update(attention="mla", kv_lora_rank=kv_lora, rope_interleave=True,
                      q_lora_rank=meta.key(Keys.Attention.Q_LORA_RANK) or None,
                      qk_rope_head_dim=rope, qk_nope_head_dim=k_len - rope, v_head_dim=v_len,
                      n_kv=shape["n_q"])
    elif meta.family != "deepseek_v3":
        head_dim = meta.key(Keys.Attention.KEY_LENGTH) or shape["h"] // shape["n_q"]
        if head_dim != shape["h"] // shape["n_q"]:
            fields["head_dim"] = head_dim
        rotated = meta.key(Keys.Rope.DIMENSION_COUNT)      # RoPE's part of a head (GLM-4.5's)
        if rotated and rotated != head_dim:
            fields["rope_partial"] = rotated / head_dim
    window = meta.key(Keys.Attention.SLIDING_WINDOW)
    if window:
        fields["sliding_window"] = window
        if meta.family == "gpt_oss":            # llama.cpp: every other layer, from the first
            fields["sliding_layers"] = tuple(range(0, shape["L"], 2))
    if meta.family == "gpt_oss":
        fields["attention_sinks"] = True
    return fields


def _gguf_rope(meta: _Metadata) -> dict[str, Any]:
    """RoPE's base and scaling as llama.cpp's converters write them ({arch}.rope.scaling.*).
    LongRoPE's factors are tensors (rope_factors_short), which tg does not read: such a file
    is described with plain RoPE, which changes no cost."""
    from gguf.constants import Keys

    fields: dict[str, Any] = {"rope_theta": float(meta.key(Keys.Rope.FREQ_BASE, 10000.0))}
    kind, factor = meta.value(Keys.Rope.SCALING_TYPE.format(arch=meta.arch)), \
        meta.key(Keys.Rope.SCALING_FACTOR)
    if kind == "linear" and factor:
        fields.update(rope_type="linear", rope_scaling_factor=float(factor))
    elif kind == "yarn" and factor:
        yarn = {"factor": factor,
                # 0: unset (llama.cpp then takes the training context)
                "original_max_position_embeddings": meta.key(Keys.Rope.SCALING_ORIG_CTX_LEN)
                or None,
                "beta_fast": meta.key(Keys.Rope.SCALING_YARN_BETA_FAST),
                "beta_slow": meta.key(Keys.Rope.SCALING_YARN_BETA_SLOW),
                "attention_factor": meta.key(Keys.Rope.SCALING_YARN_ATTN_FACTOR),
                "max_position_embeddings": meta.key(Keys.LLM.CONTEXT_LENGTH)}
        log_multiplier = meta.key(Keys.Rope.SCALING_YARN_LOG_MUL)
        if log_multiplier:
            # DeepSeek's 0.1 * mscale_all_dim; llama.cpp takes mscale to be the same (it is,
            # in DeepSeek-V2 and V3), which makes YaRN's cos and sin unscaled
            yarn["mscale"] = yarn["mscale_all_dim"] = round(log_multiplier / 0.1, 6)
        fields.update(rope_type="yarn",
                      rope_yarn={k: v for k, v in yarn.items() if v is not None})
    return fields


def _gguf_tensors(tensors: list[Any], family: str) -> dict[str, Any]:
    """What the tensors say: each class's format, a head apart from the embedding, and
    Phi-3.5-MoE's and GLM-4.5's biases and norms."""
    names = {t.name for t in tensors}
    fields = dict(precision=_gguf_precision(tensors),
                  tie_word_embeddings="output.weight" not in names)
    if family in ("phimoe", "glm4_moe"):
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
    if family == "phimoe":
        fields["lm_head_bias"] = "output.bias" in names
    if family == "glm4_moe":
        fields["qk_norm"] = "blk.0.attn_q_norm.weight" in names
    return fields


def _gguf_precision(tensors: list[Any]) -> dict[str, str | float]:
    """Each class of tensor's format: its tensors' GGUF type where they share one (q4_k, f16
    ...), else its bits per weight, the bytes of its tensors over their weights (a Q4_K_M
    file's experts mix Q4_K and Q6_K). A tensor type no weight is priced in (an integer type,
    F64) is an error naming the tensor and the type."""
    from gguf.constants import GGML_QUANT_SIZES

    from taskgraph.formats import gguf_bits

    stored: dict[str, list[int]] = {cls: [0, 0] for cls in TENSOR_CLASSES}  # weights, bytes
    types: dict[str, set[str]] = {cls: set() for cls in TENSOR_CLASSES}
    for tensor in tensors:
        cls = _gguf_class(tensor.name)
        if cls is None:
            continue
        name = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
        if name.lower() not in gguf_bits():
            raise TgError(f"GGUF tensor '{tensor.name}' is of type {name}, which tg does not "
                          "price as a weight.")
        block, size = GGML_QUANT_SIZES[tensor.tensor_type]
        stored[cls][0] += int(tensor.n_elements)
        stored[cls][1] += int(tensor.n_elements) // block * size
        types[cls].add(name.lower())
    return {cls: (next(iter(types[cls])) if len(types[cls]) == 1
                  else round(8.0 * nbytes / weights, 4))
            for cls, (weights, nbytes) in stored.items() if weights}


def _gguf_class(name: str) -> str | None:
    """The class of tensor a GGUF tensor belongs to (by llama.cpp's tensor names); None for
    what tg does not count (norms, biases, sinks)."""
    if not name.endswith(".weight"):
        return None
    if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", name):
        return "experts"            # old Mixtral conversions: an expert's matrix a tensor
    return _gguf_classes().get(re.sub(r"^blk\.\d+\.", "blk.{bid}.", name[:-len(".weight")]))


@cache
def _gguf_classes() -> dict[str, str]:
    """llama.cpp's tensor names -> class of tensor, from the gguf package's own table."""
    from gguf.constants import MODEL_TENSOR as T, TENSOR_NAMES

    groups = {
        "embedding": (T.TOKEN_EMBD,), "head": (T.OUTPUT,),
        "attention": (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_QKV, T.ATTN_OUT, T.ATTN_Q_A,
                      T.ATTN_Q_B, T.ATTN_KV_A_MQA, T.ATTN_KV_B, T.ATTN_K_B, T.ATTN_V_B),
        "router": (T.FFN_GATE_INP,),
        "experts": (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP, T.FFN_GATE_UP_EXP),
        "shared": (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP, T.FFN_GATE_INP_SHEXP),
        "dense": (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN),
    }
    return {TENSOR_NAMES[t]: cls for cls, ts in groups.items() for t in ts}
