"""Before a run: PyTorch and the device, the model the kernels compute (a checkpoint's
config.json made the scenario's model, what the kernels refuse), the weights' dtype, whether
this machine's memory holds the run, and random weights drawn once per model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from taskgraph.errors import TgError
from taskgraph.formats import is_float
from taskgraph.kernels.quant import FORMATS, block_of, expert_format
from taskgraph.specs import TENSOR_CLASSES, ModelSpec


def need_torch():
    try:
        import torch
    except ImportError:
        raise TgError("Running graphs for real (tg execute, calibrate, validate) needs PyTorch. "
                      "Install the CPU build with `pip install torch==2.13.0` (or your CUDA "
                      "build), then try again.") from None
    return torch


def pick_device(name: str) -> str:
    torch = need_torch()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise TgError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() "
                      "is False); use --device cpu.")
    if name not in ("cpu", "cuda"):
        raise TgError(f"--device must be auto, cpu or cuda, not '{name}'.")
    return name


# Host bytes dispatch keeps per task (a threading.Event, two device events, start and end
# times, the run's columns): 1.35 KB measured with tracemalloc, rounded up.
_BYTES_PER_TASK = 1500


def check_host_memory(buffers: float, tasks: int) -> None:
    """Refuse up front a run this machine's memory cannot hold: its host buffers (on the CPU
    backend the "GPU" ones too) and the bookkeeping of every task. A 10^6-step run of the tiny
    model is 116 million tasks, 170 GB, and would otherwise grow until it is killed."""
    import os

    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    need = buffers + tasks * _BYTES_PER_TASK
    if need > 0.9 * have:
        raise TgError(
            f"This run needs about {need / 1e9:.1f} GB of this machine's memory "
            f"({buffers / 1e9:.1f} GB of KV cache and weights, {tasks:,} tasks at "
            f"{_BYTES_PER_TASK:,} bytes each) and {have / 1e9:.1f} GB is free. Lower "
            "workload.gen_len (or --steps, or the prompts' max_new_tokens), the number of "
            "sequences (policy.N) or layers (model.L), or execute a smaller model."
        )


# Fields of a checkpoint's config.json that change what is computed but not its shape: with
# --weights they come from the checkpoint, whatever the scenario's model says.
_MATH_FIELDS = ("rope_theta", "rope_type", "rope_scaling_factor", "rope_yarn",
                "rope_longrope", "rope_interleave", "rope_partial", "attention_bias",
                "lm_head_bias", "qk_norm", "sparsemixer_eps", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
                "sliding_layers",
                "hidden_act", "architecture", "dtype", "dtype_bytes", "router", "renormalize",
                "routed_scaling", "expert_groups", "topk_groups", "shared_gate",
                "attention_sinks")
_SHAPE_FIELDS = ("h", "h_i", "n_q", "n_kv", "d", "E", "k", "V", "dense_layers", "h_dense",
                 "shared_experts", "h_shared", "attention", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
#: The families whose layers the executor's kernels compute as transformers does
#: (tests/test_families.py, tests/test_transformers_parity.py); the others are simulated only.
EXECUTED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
            "gpt_oss", "phimoe", "glm4_moe")


def checkpoint_model(model: ModelSpec, folder: str | Path) -> tuple[ModelSpec, list[str]]:
    """The scenario's model made to agree with a checkpoint's config.json: shapes must match,
    the fields that change the math come from the checkpoint, and running fewer layers than it
    holds is said, not silent. Returns the model and the warnings to show."""
    from taskgraph.model_files import model_from_hf_config

    config = Path(folder) / "config.json"
    if not config.is_file():
        return model, [f"'{folder}' has no config.json: RoPE theta, norm epsilon and the other "
                       "fields that change the math are the scenario's model's, unchecked."]
    try:
        ckpt = ModelSpec.model_validate(model_from_hf_config(config))
    except ValidationError as err:
        e = err.errors()[0]
        raise TgError(f"The checkpoint's config '{config}' is not a valid model: "
                      f"{'.'.join(map(str, e['loc']))}: {e['msg']}.") from None
    stored = [c for c in TENSOR_CLASSES if getattr(ckpt.precision, c) is not None]
    if stored:
        raise TgError(f"The checkpoint '{folder}' stores its {', '.join(stored)} weights as "
                      f"{getattr(ckpt.precision, stored[0])} (its quantization_config): tg "
                      "execute runs weights in their dtype, and routed experts in the GGUF blocks "
                      f"it quantizes them into itself ({', '.join(FORMATS)}); the "
                      "checkpoint is simulated, not executed.")
    for name in _SHAPE_FIELDS:
        if getattr(model, name) != getattr(ckpt, name):
            raise TgError(f"model.{name} = {getattr(model, name)} in the scenario, but the "
                          f"checkpoint '{folder}' has {getattr(ckpt, name)}; start the scenario's "
                          f"model from it (model: {{hf_config: {config}}}).")
    if model.L > ckpt.L:
        raise TgError(f"model.L = {model.L}, but the checkpoint '{folder}' holds {ckpt.L} layers.")
    warnings = []
    if model.L < ckpt.L:
        warnings.append(f"running the first {model.L} of the checkpoint's {ckpt.L} layers "
                        f"(model.L = {model.L}): the tokens are not the full model's.")
    changed = [f for f in _MATH_FIELDS if getattr(model, f) != getattr(ckpt, f)]
    if changed:
        warnings.append("taken from the checkpoint's config.json instead of the scenario: "
                        + ", ".join(f"{f} = {getattr(ckpt, f)}" for f in changed) + ".")
    return model.model_copy(update={f: getattr(ckpt, f) for f in _MATH_FIELDS}), warnings


def check_computable(m: ModelSpec, context: int) -> None:
    """Refuse what the kernels would compute differently from the model."""
    from taskgraph.kernels.ops import ROPE_TYPES

    if m.architecture not in EXECUTED:
        raise TgError(f"model.architecture = {m.architecture}: tg execute computes "
                      f"{', '.join(EXECUTED)} layers; {m.architecture} is simulated, not "
                      "executed (docs/models.md).")

    # Weights stored as floats (a GGUF file's F16 attention, the F32 router llama.cpp's
    # converter keeps) run in the model's dtype, as every executed weight does: the tokens are
    # the dtype's, the bytes the simulator prices the stored ones. Quantized classes other than
    # the routed experts, and a KV cache other than the dtype's, are not computed.
    quantized = [c for c in (*TENSOR_CLASSES, "kv_cache") if getattr(m.precision, c) is not None
                 and not (c != "kv_cache" and is_float(getattr(m.precision, c)))
                 and not (c == "kv_cache" and m.bits(c) == 8 * m.dtype_bytes)
                 and not (c == "experts" and expert_format(m))]
    if quantized:
        value = getattr(m.precision, quantized[0])
        mixed = (" bits per weight (a mix of types, as a GGUF file's class may be)"
                 if isinstance(value, float) else "")
        raise TgError(f"model.precision.{quantized[0]} = {value}{mixed}: tg execute runs "
                      f"weights in the model's dtype ({8 * m.dtype_bytes:g} bits), and routed "
                      f"experts in it or in GGUF's {', '.join(FORMATS)} blocks; other "
                      "precisions are simulated, not executed.")
    if m.attention_sinks != (m.architecture == "gpt_oss"):
        raise TgError(f"model.attention_sinks = {m.attention_sinks}: tg execute computes sinks "
                      "as gpt-oss has them, and only there.")
    for field, families in (("attention_bias", ("phimoe", "glm4_moe")),
                            ("lm_head_bias", ("phimoe",)), ("qk_norm", ("glm4_moe",))):
        if getattr(m, field) and m.architecture not in families:
            raise TgError(f"model.{field} = true: tg execute computes it in "
                          f"{' and '.join(families)} layers only, as transformers has it "
                          "there (other families' biases and norms come with their "
                          "architecture).")
    fmt = expert_format(m)
    block = block_of(fmt)[0] if fmt else 1
    if m.h % block or m.h_i % block:
        raise TgError(f"model.precision.experts = {m.precision.experts}: its blocks hold "
                      f"{block} weights of a row, and the experts' rows are h = {m.h} and "
                      f"h_i = {m.h_i} long.")
    if m.hidden_act != "silu":
        raise TgError(f"model.hidden_act = {m.hidden_act}: the experts' kernels compute SwiGLU "
                      "with SiLU only.")
    if m.rope_type not in ROPE_TYPES:
        raise TgError(f"model.rope_type = {m.rope_type}: tg computes the default, linear, YaRN "
                      "and LongRoPE scalings only.")
    if m.attention != "mla" and int(m.d * m.rope_partial) % 2:
        raise TgError(f"model.rope_partial = {m.rope_partial} of a head's {m.d} dimensions is "
                      f"{int(m.d * m.rope_partial)}: RoPE rotates pairs, an even number.")
    if m.rope_type == "longrope":
        r = m.rope_longrope or {}
        missing = [k for k in ("short_factor", "short_mscale", "original_max_position_embeddings")
                   if k not in r]
        if missing:
            raise TgError(f"model.rope_longrope lacks {', '.join(missing)}, which LongRoPE "
                          "needs.")
        if len(r["short_factor"]) * 2 != m.d:
            raise TgError(f"model.rope_longrope.short_factor holds {len(r['short_factor'])} "
                          f"factors; a head of {m.d} dimensions rotates {m.d // 2} frequencies.")
        if context > r["original_max_position_embeddings"]:
            raise TgError(f"This run reaches {context} tokens of context, past "
                          "model.rope_longrope.original_max_position_embeddings = "
                          f"{int(r['original_max_position_embeddings'])}, where LongRoPE takes its "
                          "long factors; tg computes the short ones only. Use shorter prompts "
                          "or fewer steps.")


def torch_dtype(torch, m: ModelSpec, dev: str) -> tuple[Any, list[str]]:
    """Weights run in the checkpoint's dtype. Without one: fp32 for 4-byte weights, bf16 on the
    CPU and fp16 on CUDA for 2-byte ones. A GPU without bf16 (T4) runs a bf16 checkpoint in
    fp16, and says so."""
    if m.dtype is not None:
        dtype = getattr(torch, m.dtype)
    elif m.dtype_bytes == 4:
        dtype = torch.float32
    elif m.dtype_bytes == 2:
        dtype = torch.bfloat16 if dev == "cpu" else torch.float16
    else:
        raise TgError(f"model.dtype_bytes = {m.dtype_bytes}: the executor runs 4-byte (fp32) or "
                      "2-byte (fp16/bf16) weights.")
    if dev == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16, ["this GPU has no bf16: the bf16 weights run in fp16."]
    return dtype, []


def max_positions(folder: str | Path | None) -> int | None:
    """A checkpoint's max_position_embeddings, if its config.json gives one."""
    from taskgraph.model_files import hf_config_json

    config = Path(folder) / "config.json" if folder else None
    if config is None or not config.is_file():
        return None
    return hf_config_json(config).get("max_position_embeddings")


# The last model's random weights, kept for the next run of the same model (and seed and
# dtype), in this module on purpose: validate and calibrate execute one model many times, each
# run a call of execute_scenario of its own, and drawing a model's weights is slow (a Mixtral
# layer takes seconds; the tiny test model 1.3 s on two cores, so that tests/test_expert_exec.py
# and test_record_routing.py, which execute it some hundred times, took 77 s without this
# instead of 27 s). Only the last model stays: they can be tens of GB. Nothing else is kept
# between runs (a run's weights are read, never written).
_last_weights: dict[tuple, Any] = {}


def kept_synthetic_weights(m: ModelSpec, seed: int, dtype) -> Any:
    """Random weights drawn from `seed`, the last model's kept (``_last_weights``)."""
    from taskgraph.kernels.weights import synthetic_weights

    key = (m.model_dump_json(), seed, dtype)
    if key not in _last_weights:
        _last_weights.clear()          # one model at a time: they can be tens of GB
        _last_weights[key] = synthetic_weights(m, seed=seed, dtype=dtype)
    return _last_weights[key]
