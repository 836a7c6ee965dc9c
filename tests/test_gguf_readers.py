"""GGUF files of each MoE family, written as llama.cpp's convert_hf_to_gguf.py writes them, read
back with ``model_from_gguf`` and checked against the same model's config.json reading.

Each test builds a tiny transformers config of its family (``AutoConfig.for_model``), reads its
``config.json`` with ``model_from_hf_config``, then writes a GGUF of that model from the same
hparams the way llama.cpp's converter does: the metadata its ``set_gguf_parameters`` writes
(llama.cpp's ``conversion/base.py`` ``TextModel.set_gguf_parameters``, then the family's class),
and the tensors, named from gguf's own tables (``MODEL_TENSORS[arch]``, ``TENSOR_NAMES``) in the
shapes llama.cpp's loader creates them (``src/models/<arch>.cpp`` ``load_arch_tensors``), stored
as zeros. Every field of the two ModelSpecs must agree, but those a GGUF does not carry (or that
``model_from_gguf`` does not read): each test's docstring names them.

Shapes are given in numpy's (PyTorch's) order, out features first; ggml's ``ne`` are the reverse
(llama.cpp's ``{n_embd, n_ff}`` is ``(n_ff, n_embd)`` here).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf.constants import (GGML_QUANT_SIZES, MODEL_ARCH, MODEL_TENSOR as T,  # noqa: E402
                            MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType as Q)

from taskgraph.model_files import model_from_gguf, model_from_hf_config  # noqa: E402
from taskgraph.specs import ModelSpec  # noqa: E402


def _hf(tmp_path, model_type: str, **fields) -> tuple[dict, ModelSpec]:
    """A tiny config of the family saved as transformers saves it: its config.json (the hparams
    convert_hf_to_gguf.py reads) and tg's reading of it."""
    config = transformers.AutoConfig.for_model(model_type, **fields)
    folder = tmp_path / model_type
    config.save_pretrained(folder)
    path = folder / "config.json"
    return json.loads(path.read_text()), ModelSpec.model_validate(model_from_hf_config(path))


def _bits(qtype: Q) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return 8.0 * size / block


class _Gguf:
    """A GGUFWriter of one llama.cpp architecture. Its tensors must be ones the architecture
    names (gguf's MODEL_TENSORS[arch]); vectors are stored F32 (as convert keeps 1-D tensors),
    matrices as zeros of the given type (raw zero blocks when quantized). ``params`` tallies the
    weights a ModelSpec counts (every matrix, and what is passed counted=True) while
    ``counting``."""

    def __init__(self, path, arch: MODEL_ARCH):
        self.arch, self.path, self.params, self.counting = arch, path, 0, True
        self.w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])

    def tensor(self, kind: T, shape: tuple[int, ...], qtype: Q = Q.F16, bid: int | None = None,
               suffix: str = "weight", counted: bool | None = None) -> None:
        assert kind in MODEL_TENSORS[self.arch], f"{kind.name} is no {self.arch.name} tensor"
        name = f"{TENSOR_NAMES[kind].format(bid=bid)}.{suffix}"
        if self.counting and (counted if counted is not None
                              else len(shape) > 1 and suffix == "weight"):
            self.params += math.prod(shape)
        if len(shape) == 1 or suffix == "bias":
            qtype = Q.F32
        if qtype in (Q.F32, Q.F16):
            self.w.add_tensor(name, np.zeros(shape, np.float32 if qtype == Q.F32 else np.float16))
            return
        block, size = GGML_QUANT_SIZES[qtype]
        assert shape[-1] % block == 0, f"{name}: rows of {shape[-1]} are not {qtype.name} blocks"
        self.w.add_tensor(name, np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8),
                          raw_dtype=qtype)

    def vocab(self, n: int, model: str = "gpt2") -> None:
        """What convert's set_vocab writes (its tokens stand in here): the token list, whose
        length is the vocabulary where no {arch}.vocab_size is written."""
        self.w.add_tokenizer_model(model)
        self.w.add_token_list([f"<t{i}>" for i in range(n)])
        self.w.add_token_types([gguf.TokenType.NORMAL] * n)

    def close(self) -> tuple[ModelSpec, int]:
        """Write the file; model_from_gguf's reading of it, and the weights tallied."""
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return ModelSpec.model_validate(model_from_gguf(self.path)), self.params


def _rope_parameters(hp: dict) -> dict:
    """convert's TextModel.__init__: rope_parameters (or rope_scaling), with rope_theta."""
    rope = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "rope_theta" not in rope and hp.get("rope_theta") is not None:
        rope["rope_theta"] = hp["rope_theta"]
    return rope


def _text_model_parameters(g: _Gguf, hp: dict, block_count: int) -> None:
    """Mirrors llama.cpp conversion/base.py TextModel.set_gguf_parameters: what every family's
    converter writes first (its find_hparam lists, first name found)."""
    w = g.w
    w.add_block_count(block_count)
    if hp.get("max_position_embeddings") is not None:
        w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:
        w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    if hp.get("num_key_value_heads") is not None:
        w.add_head_count_kv(hp["num_key_value_heads"])
    rope = _rope_parameters(hp)
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif kind == "longrope":
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    if hp.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    experts = hp.get("num_local_experts", hp.get("num_experts"))
    if experts is not None:
        w.add_expert_count(experts)
    if hp.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    scoring = hp.get("scoring_func")
    if scoring is not None:
        w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[scoring])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _gqa_attention(g: _Gguf, hp: dict, bid: int, qtype: Q, bias: bool, head_dim: int) -> None:
    """attn_q/k/v/output as llama.cpp's create_tensor_qkv makes them, with their biases."""
    h, n_q, n_kv = hp["hidden_size"], hp["num_attention_heads"], hp["num_key_value_heads"]
    for kind, rows in ((T.ATTN_Q, n_q * head_dim), (T.ATTN_K, n_kv * head_dim),
                       (T.ATTN_V, n_kv * head_dim)):
        g.tensor(kind, (rows, h), qtype, bid)
        if bias:
            g.tensor(kind, (rows,), bid=bid, suffix="bias")
    g.tensor(T.ATTN_OUT, (h, n_q * head_dim), qtype, bid)


def _assert_same_model(hf: ModelSpec, gg: ModelSpec, tensors: int,
                       unread: tuple[str, ...] = ()) -> None:
    """Every field agrees but the name, the precision (the GGUF's tensor types; config.json's
    dtype) and what the test says the GGUF does not carry; head_dim as d (config.json may
    give h / n_q); a number as the float32 GGUF stores it (rms_norm_eps 1e-5 reads
    9.9999997e-06). The parameter counts agree, and are the weights of the GGUF's tensors."""
    skip = {"name", "precision", "head_dim", *unread}
    want, got = hf.model_dump(exclude=skip), gg.model_dump(exclude=skip)
    differ = {k: (want[k], got[k]) for k in want
              if got[k] != (pytest.approx(want[k], rel=1e-7) if isinstance(want[k], float)
                            else want[k])}
    assert not differ, f"config.json vs GGUF reading, (config.json, GGUF): {differ}"
    assert gg.d == hf.d
    assert gg.params == hf.params
    assert gg.params["total"] == tensors


# --- DeepSeek-V3 / V2 (deepseek2) ----------------------------------------------------------------

_DEEPSEEK = {
    # DeepSeek-V3: MLA with a Q LoRA, two leading dense layers, two shared experts, sigmoid
    # routing in 4 groups of which 2 are taken, gates renormalised and scaled by 2.5, YaRN.
    "deepseek-v3": ("deepseek_v3", dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        num_hidden_layers=4, first_k_dense_replace=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_shared_experts=2,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                             original_max_position_embeddings=4096, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
    # DeepSeek-V2-Lite: Q projected directly (no q_lora_rank), softmax greedy routing whose
    # gates are not renormalised, one leading dense layer.
    "deepseek-v2-lite": ("deepseek_v2", dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_shared_experts=2,
        num_experts_per_tok=4, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=False, scoring_func="softmax", topk_method="greedy", rms_norm_eps=1e-6,
        max_position_embeddings=163840, rope_parameters=dict(rope_type="default",
                                                             rope_theta=10000.0))),
}


def _write_deepseek2(path, hp: dict) -> tuple[ModelSpec, int]:
    """Mirrors llama.cpp conversion/deepseek.py DeepseekV2Model.set_gguf_parameters (MLA written
    as MQA: one KV head, key/value lengths of the latent, the _mla lengths of the heads) and
    modify_tensors (kv_b_proj split into attn_k_b and attn_v_b, experts merged); tensors as
    src/models/deepseek2.cpp loads them."""
    hp = dict(hp, num_key_value_heads=1, rms_norm_eps=hp.get("rms_norm_eps", 1e-6))
    g = _Gguf(path, MODEL_ARCH.DEEPSEEK2)
    w = g.w
    _text_model_parameters(g, hp, hp["num_hidden_layers"])
    first_dense = hp.get("first_k_dense_replace")
    if first_dense is None:
        first_dense = 0 if hp.get("n_routed_experts") is not None else hp["num_hidden_layers"]
    w.add_leading_dense_block_count(first_dense)
    kv_lora = hp.get("kv_lora_rank", 512)
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    nope, rope, v = hp["qk_nope_head_dim"], hp["qk_rope_head_dim"], hp["v_head_dim"]
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v)
    w.add_expert_feed_forward_length(hp.get("moe_intermediate_size", hp["intermediate_size"]))
    if hp.get("n_routed_experts") is not None:
        w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_shared_count(hp.get("n_shared_experts", 0))
    if hp.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_rope_dimension_count(rope)
    mscale_all = _rope_parameters(hp).get("mscale_all_dim")
    if mscale_all is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all)

    h, V, n_q, q_lora = hp["hidden_size"], hp["vocab_size"], hp["num_attention_heads"], \
        hp.get("q_lora_rank")
    E, h_i, shared = hp["n_routed_experts"], hp["moe_intermediate_size"], hp["n_shared_experts"]
    g.vocab(V, "llama" if g.arch == MODEL_ARCH.PHIMOE else "gpt2")
    g.tensor(T.TOKEN_EMBD, (V, h), Q.Q8_0)
    g.tensor(T.OUTPUT_NORM, (h,))
    g.tensor(T.OUTPUT, (V, h), Q.Q6_K)
    for i in range(hp["num_hidden_layers"]):
        g.tensor(T.ATTN_NORM, (h,), bid=i)
        if q_lora:
            g.tensor(T.ATTN_Q_A, (q_lora, h), Q.Q8_0, i)
            g.tensor(T.ATTN_Q_A_NORM, (q_lora,), bid=i)
            g.tensor(T.ATTN_Q_B, (n_q * (nope + rope), q_lora), Q.Q8_0, i)
        else:
            g.tensor(T.ATTN_Q, (n_q * (nope + rope), h), Q.Q8_0, i)
        g.tensor(T.ATTN_KV_A_MQA, (kv_lora + rope, h), Q.Q8_0, i)
        g.tensor(T.ATTN_KV_A_NORM, (kv_lora,), bid=i)
        g.tensor(T.ATTN_K_B, (n_q, kv_lora, nope), Q.Q8_0, i)
        g.tensor(T.ATTN_V_B, (n_q, v, kv_lora), Q.Q8_0, i)
        g.tensor(T.ATTN_OUT, (h, n_q * v), Q.Q8_0, i)
        g.tensor(T.FFN_NORM, (h,), bid=i)
        if i < first_dense:
            n_ff = hp["intermediate_size"]
            g.tensor(T.FFN_GATE, (n_ff, h), Q.Q8_0, i)
            g.tensor(T.FFN_UP, (n_ff, h), Q.Q8_0, i)
            g.tensor(T.FFN_DOWN, (h, n_ff), Q.Q8_0, i)
            continue
        g.tensor(T.FFN_GATE_INP, (E, h), Q.F32, i)
        if hp.get("topk_method") == "noaux_tc":      # e_score_correction_bias
            g.tensor(T.FFN_EXP_PROBS_B, (E,), bid=i, suffix="bias")
        g.tensor(T.FFN_GATE_EXP, (E, h_i, h), Q.Q4_0, i)
        g.tensor(T.FFN_UP_EXP, (E, h_i, h), Q.Q4_0, i)
        g.tensor(T.FFN_DOWN_EXP, (E, h, h_i), Q.Q4_0, i)
        g.tensor(T.FFN_GATE_SHEXP, (shared * h_i, h), Q.Q8_0, i)
        g.tensor(T.FFN_UP_SHEXP, (shared * h_i, h), Q.Q8_0, i)
        g.tensor(T.FFN_DOWN_SHEXP, (h, shared * h_i), Q.Q8_0, i)
    return g.close()


@pytest.mark.parametrize("variant", sorted(_DEEPSEEK))
def test_a_deepseek2_gguf_describes_the_deepseek_its_config_does(tmp_path, variant):
    """DeepSeek-V3 (and V2-Lite) as a deepseek2 GGUF: MLA's ranks and head dims, the leading
    dense layers and their size, the shared experts, the router (sigmoid or softmax, groups,
    renormalisation, scale) and the parameter counts agree with config.json's reading.

    Not carried: which of V2 and V3 it is (llama.cpp's deepseek2 stands for both; tg reads
    deepseek_v3, whose layers compute as V2's where the fields agree); RoPE's interleaving
    (llama.cpp computes deepseek2's RoPE on neighbouring pairs, LLAMA_ROPE_TYPE_NORM, which is
    DeepSeek's rope_interleave); YaRN's mscale apart from mscale_all_dim (the GGUF's
    rope.scaling.yarn_log_multiplier is 0.1 * mscale_all_dim, and llama.cpp computes as if
    mscale were the same, as it is in both models)."""
    model_type, fields = _DEEPSEEK[variant]
    hp, hf = _hf(tmp_path, model_type, **fields)
    gg, tensors = _write_deepseek2(tmp_path / f"{variant}.gguf", hp)
    assert gg.architecture == "deepseek_v3"
    assert gg.attention == "mla" and gg.rope_interleave
    _assert_same_model(hf, gg, tensors, unread=("architecture",))
    assert gg.rope_type == hf.rope_type == ("yarn" if variant == "deepseek-v3" else "default")
    assert (gg.bits("experts"), gg.bits("attention"), gg.bits("shared"), gg.bits("dense")) == (
        _bits(Q.Q4_0), _bits(Q.Q8_0), _bits(Q.Q8_0), _bits(Q.Q8_0))


# --- gpt-oss -------------------------------------------------------------------------------------

def _write_gpt_oss(path, hp: dict) -> tuple[ModelSpec, int]:
    """Mirrors llama.cpp conversion/gpt_oss.py GptOssModel.set_gguf_parameters (the base's
    keys, then sliding_window, the experts' size and count) and its tensors: attention with
    biases and sinks, a router with a bias, MXFP4 experts (repack_mxfp4) with biases."""
    g = _Gguf(path, MODEL_ARCH.GPT_OSS)
    w = g.w
    _text_model_parameters(g, hp, hp["num_hidden_layers"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    w.add_expert_count(hp.get("num_local_experts") or hp.get("num_experts") or 32)
    w.add_expert_used_count(hp.get("num_experts_per_tok") or 4)

    h, V, n_q, d = hp["hidden_size"], hp["vocab_size"], hp["num_attention_heads"], hp["head_dim"]
    E, h_i = hp["num_local_experts"], hp["intermediate_size"]
    g.vocab(V, "llama" if g.arch == MODEL_ARCH.PHIMOE else "gpt2")
    g.tensor(T.TOKEN_EMBD, (V, h), Q.Q8_0)
    g.tensor(T.OUTPUT_NORM, (h,))
    g.tensor(T.OUTPUT, (V, h), Q.Q8_0)
    for i in range(hp["num_hidden_layers"]):
        g.tensor(T.ATTN_NORM, (h,), bid=i)
        _gqa_attention(g, hp, i, Q.Q8_0, bias=True, head_dim=d)
        g.tensor(T.ATTN_OUT, (h,), bid=i, suffix="bias")
        g.tensor(T.ATTN_SINKS, (n_q,), bid=i)
        g.tensor(T.ATTN_POST_NORM, (h,), bid=i)
        g.tensor(T.FFN_GATE_INP, (E, h), Q.F32, i)
        g.tensor(T.FFN_GATE_INP, (E,), bid=i, suffix="bias")
        for kind, shape in ((T.FFN_GATE_EXP, (E, h_i, h)), (T.FFN_UP_EXP, (E, h_i, h)),
                            (T.FFN_DOWN_EXP, (E, h, h_i))):
            g.tensor(kind, shape, Q.MXFP4, i)
            g.tensor(kind, shape[:2], bid=i, suffix="bias")
    return g.close()


def test_a_gpt_oss_gguf_describes_the_gpt_oss_its_config_does(tmp_path):
    """gpt-oss as a gpt-oss GGUF: head_dim apart from h / n_q, the sliding window on every other
    layer from the first, attention sinks, MXFP4 experts, and the parameter counts.

    Not carried, but implied by the architecture as llama.cpp has it: which layers slide (its
    set_swa_pattern(2), layer_types' alternation), the sinks (attn_sinks), the experts'
    clamped SwiGLU (swiglu_alpha 1.702, swiglu_limit 7.0, which tg refuses to change). Not
    carried: YaRN's truncate (False); llama.cpp's YaRN truncates, as the GGUF's reading does."""
    hp, hf = _hf(tmp_path, "gpt_oss", vocab_size=512, hidden_size=256, intermediate_size=256,
                 head_dim=64, num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                 num_experts_per_tok=2, num_hidden_layers=4, sliding_window=128)
    assert hf.sliding_layers == (0, 2) and hf.attention_sinks and hf.d * hf.n_q != hf.h
    gg, tensors = _write_gpt_oss(tmp_path / "gpt-oss.gguf", hp)
    _assert_same_model(hf, gg, tensors, unread=("rope_yarn",))
    assert hf.rope_type == gg.rope_type == "yarn" and hf.rope_yarn["truncate"] is False
    assert gg.rope_yarn == {k: v for k, v in hf.rope_yarn.items() if k != "truncate"}
    assert gg.bits("experts") == _bits(Q.MXFP4) == 4.25


# --- GLM-4.5 (glm4moe) ---------------------------------------------------------------------------

_GLM = {
    # GLM-4.5-Air: one leading dense layer, one shared expert, sigmoid routing, partial RoPE,
    # Q/K/V biases, head_dim apart from h / n_q, one MTP layer after the last.
    "glm-4.5-air": dict(use_qk_norm=False, routed_scaling_factor=1.0),
    # GLM-4.5: the same, with per-head Q/K norms and gates scaled by 2.5; and, to read the
    # GGUF's rope.scaling.type and factor, linear RoPE scaling (GLM-4.5 has none).
    "glm-4.5": dict(use_qk_norm=True, routed_scaling_factor=2.5,
                    rope=dict(rope_type="linear", factor=4.0)),
}


def _write_glm4moe(path, hp: dict) -> tuple[ModelSpec, int]:
    """Mirrors llama.cpp conversion/glm.py Glm4MoeModel (block_count = num_hidden_layers +
    num_nextn_predict_layers; set_gguf_parameters: the rotated part of a head as
    rope.dimension_count, routed experts, leading dense blocks, sigmoid gating, weights scale and
    norm, nextn_predict_layers); tensors as src/models/glm4-moe.cpp loads them, the NextN layer's
    included."""
    nextn = hp.get("num_nextn_predict_layers", 0)
    L = hp["num_hidden_layers"]
    g = _Gguf(path, MODEL_ARCH.GLM4_MOE)
    w = g.w
    _text_model_parameters(g, hp, L + nextn)
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    w.add_rope_dimension_count(
        int(head_dim * _rope_parameters(hp).get("partial_rotary_factor", 0.5)))
    if hp.get("n_routed_experts") is not None:
        w.add_expert_count(hp["n_routed_experts"])
    if hp.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("n_shared_experts") is not None:
        w.add_expert_shared_count(hp["n_shared_experts"])
    if hp.get("first_k_dense_replace") is not None:
        w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if hp.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob") is not None:
        w.add_expert_weights_norm(hp["norm_topk_prob"])
    if hp.get("num_nextn_predict_layers") is not None:
        w.add_nextn_predict_layers(hp["num_nextn_predict_layers"])

    h, V = hp["hidden_size"], hp["vocab_size"]
    E, h_i, shared = hp["n_routed_experts"], hp["moe_intermediate_size"], hp["n_shared_experts"]
    g.vocab(V, "llama" if g.arch == MODEL_ARCH.PHIMOE else "gpt2")
    g.tensor(T.TOKEN_EMBD, (V, h), Q.Q8_0)
    g.tensor(T.OUTPUT_NORM, (h,))
    g.tensor(T.OUTPUT, (V, h), Q.Q6_K)
    for i in range(L + nextn):
        mtp = i >= L                                 # the NextN layer: loaded, never run
        g.counting = not mtp
        g.tensor(T.ATTN_NORM, (h,), bid=i)
        _gqa_attention(g, hp, i, Q.Q8_0, bias=hp["attention_bias"], head_dim=head_dim)
        if hp.get("use_qk_norm"):
            g.tensor(T.ATTN_Q_NORM, (head_dim,), bid=i)
            g.tensor(T.ATTN_K_NORM, (head_dim,), bid=i)
        g.tensor(T.ATTN_POST_NORM, (h,), bid=i)
        if i < hp["first_k_dense_replace"]:
            n_ff = hp["intermediate_size"]
            g.tensor(T.FFN_GATE, (n_ff, h), Q.Q8_0, i)
            g.tensor(T.FFN_UP, (n_ff, h), Q.Q8_0, i)
            g.tensor(T.FFN_DOWN, (h, n_ff), Q.Q8_0, i)
        else:
            g.tensor(T.FFN_GATE_INP, (E, h), Q.F32, i)
            g.tensor(T.FFN_EXP_PROBS_B, (E,), bid=i, suffix="bias")
            g.tensor(T.FFN_GATE_EXP, (E, h_i, h), Q.Q4_0, i)
            g.tensor(T.FFN_UP_EXP, (E, h_i, h), Q.Q4_0, i)
            g.tensor(T.FFN_DOWN_EXP, (E, h, h_i), Q.Q4_0, i)
            g.tensor(T.FFN_GATE_SHEXP, (shared * h_i, h), Q.Q8_0, i)
            g.tensor(T.FFN_UP_SHEXP, (shared * h_i, h), Q.Q8_0, i)
            g.tensor(T.FFN_DOWN_SHEXP, (h, shared * h_i), Q.Q8_0, i)
        if mtp:
            g.tensor(T.NEXTN_EH_PROJ, (h, 2 * h), Q.Q8_0, i)
            g.tensor(T.NEXTN_ENORM, (h,), bid=i)
            g.tensor(T.NEXTN_HNORM, (h,), bid=i)
            g.tensor(T.NEXTN_SHARED_HEAD_NORM, (h,), bid=i)
    return g.close()


@pytest.mark.parametrize("variant", sorted(_GLM))
def test_a_glm4moe_gguf_describes_the_glm_its_config_does(tmp_path, variant):
    """GLM-4.5(-Air) as a glm4moe GGUF: the layers that run (block_count less the NextN layer
    llama.cpp loads but skips), the leading dense layer, the shared expert, sigmoid routing, the
    gates' scale and renormalisation, partial RoPE (rope.dimension_count over head_dim), Q/K/V
    biases and per-head Q/K norms (as tensors), and the parameter counts all agree."""
    hp, hf = _hf(tmp_path, "glm4_moe", vocab_size=512, hidden_size=256, intermediate_size=512,
                 moe_intermediate_size=64, num_hidden_layers=3, first_k_dense_replace=1,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                 n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=1,
                 topk_group=1, norm_topk_prob=True, attention_bias=True,
                 num_nextn_predict_layers=1, rms_norm_eps=1e-5,
                 rope_parameters=dict(rope_theta=1e6, partial_rotary_factor=0.5,
                                      **_GLM[variant].get("rope", {"rope_type": "default"})),
                 **{k: v for k, v in _GLM[variant].items() if k != "rope"})
    assert (hf.L, hf.rope_partial, hf.router, hf.dense_layers) == (3, 0.5, "sigmoid", (0,))
    gg, tensors = _write_glm4moe(tmp_path / f"{variant}.gguf", hp)
    _assert_same_model(hf, gg, tensors)
    assert (gg.rope_type, gg.rope_scaling_factor) == (
        ("linear", 4.0) if variant == "glm-4.5" else ("default", 1.0))
    assert (gg.bits("experts"), gg.bits("dense"), gg.bits("head")) == (
        _bits(Q.Q4_0), _bits(Q.Q8_0), _bits(Q.Q6_K))


# --- Phi-3.5-MoE (phimoe) ------------------------------------------------------------------------

def _write_phimoe(path, hp: dict) -> tuple[ModelSpec, int]:
    """Mirrors llama.cpp conversion/phi.py PhiMoeModel: Phi3MiniModel.set_gguf_parameters (which
    does not call the base's: the context, LongRoPE's original context, the shapes, the
    rotated dimensions, theta, sliding_window or 0) then the experts' count and top k, and
    generate_extra_tensors (LongRoPE's attn_factor and its long and short factors as
    tensors); tensors with the biases Phi-3.5-MoE has (attention, norms, LM head)."""
    g = _Gguf(path, MODEL_ARCH.PHIMOE)
    w = g.w
    rope = _rope_parameters(hp)
    h, n_q = hp["hidden_size"], hp["num_attention_heads"]
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * h) // n_q
    w.add_context_length(hp["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(n_q)
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_sliding_window(hp.get("sliding_window") or 0)
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_count(hp["num_local_experts"])
    scale = hp["max_position_embeddings"] / rope["original_max_position_embeddings"]
    orig = rope["original_max_position_embeddings"]
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    assert len(rope["short_factor"]) == rope_dims // 2
    g.tensor(T.ROPE_FACTORS_LONG, (rope_dims // 2,))
    g.tensor(T.ROPE_FACTORS_SHORT, (rope_dims // 2,))

    V, E, h_i = hp["vocab_size"], hp["num_local_experts"], hp["intermediate_size"]
    g.vocab(V, "llama" if g.arch == MODEL_ARCH.PHIMOE else "gpt2")
    g.tensor(T.TOKEN_EMBD, (V, h), Q.Q8_0)
    g.tensor(T.OUTPUT_NORM, (h,))
    g.tensor(T.OUTPUT_NORM, (h,), suffix="bias")
    g.tensor(T.OUTPUT, (V, h), Q.Q6_K)
    if hp.get("lm_head_bias"):
        g.tensor(T.OUTPUT, (V,), suffix="bias")
    for i in range(hp["num_hidden_layers"]):
        for norm in (T.ATTN_NORM, T.FFN_NORM):
            g.tensor(norm, (h,), bid=i)
            g.tensor(norm, (h,), bid=i, suffix="bias")
        _gqa_attention(g, hp, i, Q.Q8_0, bias=hp["attention_bias"], head_dim=h // n_q)
        if hp["attention_bias"]:
            g.tensor(T.ATTN_OUT, (h,), bid=i, suffix="bias")
        g.tensor(T.FFN_GATE_INP, (E, h), Q.F32, i)
        g.tensor(T.FFN_GATE_EXP, (E, h_i, h), Q.Q4_0, i)
        g.tensor(T.FFN_UP_EXP, (E, h_i, h), Q.Q4_0, i)
        g.tensor(T.FFN_DOWN_EXP, (E, h, h_i), Q.Q4_0, i)
    return g.close()


def test_a_phimoe_gguf_describes_the_phi_moe_its_config_does(tmp_path):
    """Phi-3.5-MoE as a phimoe GGUF: Mixtral's shapes read from feed_forward_length (phimoe
    writes no expert_feed_forward_length), the sliding window, the attention and LM-head biases
    (as tensors), and the parameter counts.

    Not carried: SparseMixer's router_jitter_noise (sparsemixer_eps; llama.cpp routes phimoe by
    softmax over the top 2 instead): its value here is Phi-3.5-MoE's, tg's default, which the
    GGUF reading keeps. Not read by model_from_gguf: LongRoPE (rope_type, rope_longrope), which
    the GGUF carries as rope_factors_short/long tensors and the original context, but for
    short_mscale, whose place it takes a rope.scaling.attn_factor computed from the contexts."""
    hp, hf = _hf(tmp_path, "phimoe", vocab_size=512, hidden_size=256, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=131072,
                 sliding_window=131072, attention_bias=True, lm_head_bias=True,
                 router_jitter_noise=0.01, rms_norm_eps=1e-5,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                      short_factor=[1.0] * 32, long_factor=[2.0] * 32,
                                      short_mscale=1.243, long_mscale=1.243,
                                      original_max_position_embeddings=4096))
    assert hf.attention_bias and hf.lm_head_bias and hf.sliding_window == 131072
    gg, tensors = _write_phimoe(tmp_path / "phimoe.gguf", hp)
    _assert_same_model(hf, gg, tensors, unread=("rope_type", "rope_longrope"))


# --- Qwen2-MoE (qwen2moe) ------------------------------------------------------------------------

def _write_qwen2moe(path, hp: dict) -> tuple[ModelSpec, int]:
    """Mirrors llama.cpp conversion/qwen.py Qwen2MoeModel.set_gguf_parameters (the base's keys,
    then the experts' and the shared expert's sizes: no shared count, no weights norm) and its
    tensors as src/models/qwen2moe.cpp loads them: Q/K/V biases, the shared expert and its
    sigmoid gate (ffn_gate_inp_shexp)."""
    g = _Gguf(path, MODEL_ARCH.QWEN2MOE)
    w = g.w
    _text_model_parameters(g, hp, hp["num_hidden_layers"])
    if hp.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])

    h, V, n_q = hp["hidden_size"], hp["vocab_size"], hp["num_attention_heads"]
    E, h_i, h_sh = hp["num_experts"], hp["moe_intermediate_size"], \
        hp["shared_expert_intermediate_size"]
    g.vocab(V, "llama" if g.arch == MODEL_ARCH.PHIMOE else "gpt2")
    g.tensor(T.TOKEN_EMBD, (V, h), Q.Q8_0)
    g.tensor(T.OUTPUT_NORM, (h,))
    g.tensor(T.OUTPUT, (V, h), Q.Q6_K)
    for i in range(hp["num_hidden_layers"]):
        g.tensor(T.ATTN_NORM, (h,), bid=i)
        _gqa_attention(g, hp, i, Q.Q8_0, bias=True, head_dim=h // n_q)
        g.tensor(T.FFN_NORM, (h,), bid=i)
        g.tensor(T.FFN_GATE_INP, (E, h), Q.F32, i)
        g.tensor(T.FFN_GATE_EXP, (E, h_i, h), Q.Q4_0, i)
        g.tensor(T.FFN_UP_EXP, (E, h_i, h), Q.Q4_0, i)
        g.tensor(T.FFN_DOWN_EXP, (E, h, h_i), Q.Q4_0, i)
        g.tensor(T.FFN_GATE_INP_SHEXP, (h,), bid=i, counted=True)
        g.tensor(T.FFN_GATE_SHEXP, (h_sh, h), Q.Q8_0, i)
        g.tensor(T.FFN_UP_SHEXP, (h_sh, h), Q.Q8_0, i)
        g.tensor(T.FFN_DOWN_SHEXP, (h, h_sh), Q.Q8_0, i)
    return g.close()


def test_a_qwen2moe_gguf_describes_the_qwen2_moe_its_config_does(tmp_path):
    """Qwen2-MoE (as Qwen2-57B-A14B) as a qwen2moe GGUF: the gated shared expert of its own size
    (expert_shared_feed_forward_length), the gates not renormalised (llama.cpp's qwen2moe graph
    never renormalises them, as norm_topk_prob false says), and the parameter counts.

    Not carried: dense layers (mlp_only_layers, decoder_sparse_step: llama.cpp's qwen2moe has
    none) and Qwen's sliding window (use_sliding_window, which the converter does not write);
    this model has neither, as Qwen2-57B-A14B."""
    hp, hf = _hf(tmp_path, "qwen2_moe", vocab_size=512, hidden_size=256, intermediate_size=512,
                 moe_intermediate_size=64, shared_expert_intermediate_size=384, num_experts=8,
                 num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, norm_topk_prob=False, rms_norm_eps=1e-6,
                 rope_parameters=dict(rope_type="default", rope_theta=1e6))
    assert (hf.shared_experts, hf.h_shared, hf.shared_gate, hf.renormalize) == (1, 384, True,
                                                                                False)
    gg, tensors = _write_qwen2moe(tmp_path / "qwen2moe.gguf", hp)
    _assert_same_model(hf, gg, tensors)
    # the shared class holds the shared expert at Q8_0 and its gate, a vector, at F32
    h, h_sh = hp["hidden_size"], hp["shared_expert_intermediate_size"]
    assert gg.bits("shared") == pytest.approx(
        (3 * h * h_sh * _bits(Q.Q8_0) + 32 * h) / (3 * h * h_sh + h), abs=1e-4)
    assert gg.bits("experts") == _bits(Q.Q4_0)
