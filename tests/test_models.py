"""The MoEs offloaded today, described from their own files: a Hugging Face config.json that
transformers itself writes (checked against the parameters transformers' own model of it has),
its quantization_config, and a GGUF file gguf's writer makes (checked against the tensors'
own types). Presets against their model cards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from taskgraph.errors import TgError
from taskgraph.formats import bits
from taskgraph.model_files import model_from_gguf, model_from_hf_config
from taskgraph.presets import MODELS
from taskgraph.specs import ModelSpec

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# Tiny configs of every family, in each family's own field names.
TINY = {
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, vocab_size=128),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                      num_experts_per_tok=2, vocab_size=128, decoder_sparse_step=1,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, num_experts=8, num_experts_per_tok=4, vocab_size=128,
                      norm_topk_prob=True),
    "deepseek_v2": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
                        n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
                        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, vocab_size=128,
                        topk_method="greedy"),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, vocab_size=128),
    "olmoe": dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                  num_experts_per_tok=2, vocab_size=128),
    "phimoe": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                   num_experts_per_tok=2, vocab_size=128),
    "gpt_oss": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                    sliding_window=8),
    "glm4_moe": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=128),
}


def _save(tmp_path, family: str, **extra) -> tuple:
    config = transformers.AutoConfig.for_model(family, **{**TINY[family], **extra})
    config.save_pretrained(tmp_path)
    return config, tmp_path / "config.json"


def _weights_of(model) -> int:
    """The weights of transformers' model: its matrices (and stacked experts), not its norms,
    biases or attention sinks."""
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dim() >= 2 and "bias" not in name)


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_config_transformers_writes_is_read_as_its_family(tmp_path, family):
    """Every family's config.json, as transformers writes it, is read into a model whose
    parameter count is that of transformers' own model of the config."""
    config, path = _save(tmp_path, family)
    spec = ModelSpec.model_validate(model_from_hf_config(path))
    assert spec.architecture == family
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert spec.params["total"] == _weights_of(model)


def test_each_familys_own_fields(tmp_path):
    qwen2 = ModelSpec.model_validate(model_from_hf_config(_save(tmp_path / "q2", "qwen2_moe")[1]))
    assert (qwen2.E, qwen2.h_i, qwen2.dense_layers, qwen2.h_dense) == (8, 48, (1,), 160)
    assert (qwen2.shared_experts, qwen2.h_shared, qwen2.shared_gate) == (1, 80, True)
    v3 = ModelSpec.model_validate(model_from_hf_config(_save(tmp_path / "v3", "deepseek_v3")[1]))
    assert (v3.attention, v3.kv_lora_rank, v3.q_lora_rank, v3.dense_layers) == ("mla", 32, 48,
                                                                                (0,))
    assert (v3.router, v3.expert_groups, v3.topk_groups, v3.routed_scaling) == ("sigmoid", 4, 2,
                                                                                2.5)
    assert v3.kv_width == 32 + 8        # the latent and the rope key, per token
    oss = ModelSpec.model_validate(model_from_hf_config(_save(tmp_path / "oss", "gpt_oss")[1]))
    assert oss.sliding_layers == (0, 2) and oss.window(0) == 8 and oss.window(1) is None
    assert oss.attention_sinks
    qwen3 = ModelSpec.model_validate(model_from_hf_config(_save(tmp_path / "q3", "qwen3_moe")[1]))
    assert qwen3.renormalize and qwen3.d == 32 and qwen3.q_dim == 128 != qwen3.h
    # Phi-3.5-MoE as it is released (transformers 4's rope_scaling spelling): biases, the
    # router's threshold, LongRoPE's short factors
    phi = ModelSpec.model_validate(model_from_hf_config(_save(
        tmp_path / "phi", "phimoe", attention_bias=True, lm_head_bias=True,
        router_jitter_noise=0.02, rope_scaling={
            "type": "longrope", "short_factor": [1.5] * 8, "long_factor": [3.0] * 8,
            "short_mscale": 1.25, "long_mscale": 1.25, "original_max_position_embeddings": 40})[1]))
    assert (phi.attention_bias, phi.lm_head_bias, phi.sparsemixer_eps) == (True, True, 0.02)
    assert phi.rope_type == "longrope"
    assert phi.rope_longrope == {"short_factor": [1.5] * 8, "short_mscale": 1.25,
                                 "original_max_position_embeddings": 40}


def test_phimoe_is_refused_where_its_router_or_rope_would_compute_otherwise(tmp_path):
    """SparseMixer picks two experts whatever num_experts_per_tok says; past
    original_max_position_embeddings LongRoPE takes factors the executor does not compute."""
    from taskgraph.exec.loading import check_computable
    from taskgraph.scenario import scenario_from_dict

    def load(path):
        return scenario_from_dict({"model": {"hf_config": str(path)}, "hardware": "t4",
                                   "workload": {"prompt_len": 8, "gen_len": 2},
                                   "policy": {"N": 1, "mu": 1}, "schedule": "S1"}).model

    with pytest.raises(TgError, match="model: k = 4: a phimoe layer's SparseMixer router picks 2"):
        load(_save(tmp_path / "k4", "phimoe", num_experts_per_tok=4)[1])
    phi = load(_save(tmp_path / "phi", "phimoe", rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.5] * 8,
        "long_factor": [3.0] * 8, "short_mscale": 1.25, "long_mscale": 1.25,
        "original_max_position_embeddings": 40})[1])
    check_computable(phi, 40)
    with pytest.raises(TgError, match="reaches 41 tokens of context, past model.rope_longrope"
                                      ".original_max_position_embeddings = 40"):
        check_computable(phi, 41)
    short = phi.model_copy(update={"rope_longrope": {**phi.rope_longrope, "short_factor": [1.0]}})
    with pytest.raises(TgError, match="short_factor holds 1 factors; a head of 16 dimensions"):
        check_computable(short, 8)


def test_quantization_configs_set_each_classs_format(tmp_path):
    _, path = _save(tmp_path / "v3", "deepseek_v3", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
        "activation_scheme": "dynamic"})
    v3 = ModelSpec.model_validate(model_from_hf_config(path))
    assert v3.bits("experts") == v3.bits("attention") == 8 + 32 / 128 ** 2
    assert v3.bits("embedding") == v3.bits("router") == 16
    _, path = _save(tmp_path / "oss", "gpt_oss", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]})
    oss = ModelSpec.model_validate(model_from_hf_config(path))
    assert oss.bits("experts") == 4.25 and oss.bits("attention") == 16
    _, path = _save(tmp_path / "awq", "qwen3_moe", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
        "modules_to_not_convert": ["mlp.gate"]})
    awq = ModelSpec.model_validate(model_from_hf_config(path))
    assert awq.bits("experts") == awq.bits("attention") == 4 + 20 / 128
    assert awq.bits("router") == 16
    # a quantized expert is priced at its bytes: 4.156 bits of each of its weights
    assert awq.expert_bytes == pytest.approx(awq.expert_params * (4 + 20 / 128) / 8)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mamba"}, "model_type 'mamba' is not a family tg describes"),
    ({"topk_method": "sinkhorn"}, "topk_method 'sinkhorn'"),
    ({"quantization_config": {"quant_method": "bitnet"}}, "quant_method 'bitnet'"),
    ({"n_routed_experts": "8"}, "n_routed_experts must be a whole number"),
    # read with a fallback where unset: 0 or a negative must not mean the fallback
    ({"moe_layer_freq": 0}, "moe_layer_freq must be at least 1, not 0"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace must be 0 or more, not -1"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be at least 1, not 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0}},
     "rope_scaling.factor must be above 0, not 0"),
    ({"model_type": None, "architectures": ["MambaForCausalLM"]},
     r"has no model_type, and its architectures \['MambaForCausalLM'\] name no family"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 7}},
     "quantization_config.group_size 7: tg prices gptq in groups of 8 to 4096"),
    ({"quantization_config": {"quant_method": "awq", "bits": 5}},
     "quantization_config.bits 5: tg prices awq at 2, 3, 4 or 8 bits"),
])
def test_what_tg_cannot_describe_is_named(tmp_path, change, message):
    _, path = _save(tmp_path, "deepseek_v3")
    cfg = json.loads(path.read_text())
    cfg.update(change)
    path.write_text(json.dumps(cfg))
    with pytest.raises(TgError, match=message):
        model_from_hf_config(path)


@pytest.mark.parametrize("family, change, message", [
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be at least 1, not 0"),
    ("qwen3_moe", {"mlp_only_layers": [0, 100]},
     r"mlp_only_layers must list layer numbers from 0 to {last} \(num_hidden_layers {L}\), "
     r"not \[0, 100\]"),
    ("gpt_oss", {"layer_types": "one too many"},
     "layer_types lists {more} layers, num_hidden_layers {L}: one type a layer"),
    ("gpt_oss", {"swiglu_limit": "7"}, "swiglu_limit must be a number, not a string"),
])
def test_a_familys_own_fields_out_of_range_are_named(tmp_path, family, change, message):
    _, path = _save(tmp_path, family)
    cfg = json.loads(path.read_text())
    L = cfg["num_hidden_layers"]
    if change.get("layer_types") == "one too many":
        change = {"layer_types": ["full_attention"] * (L + 1)}
    cfg.update(change)
    path.write_text(json.dumps(cfg))
    with pytest.raises(TgError, match=message.format(L=L, last=L - 1, more=L + 1)):
        model_from_hf_config(path)


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_config_without_model_type_is_read_by_its_class(tmp_path, family):
    """Some configs leave model_type out; transformers' causal-LM class in architectures (the
    name transformers' own table gives the family) says the family. Read as Mixtral's fields
    before, a Qwen3-MoE config was refused for lacking num_local_experts."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _, path = _save(tmp_path, family)
    want = ModelSpec.model_validate(model_from_hf_config(path))
    cfg = json.loads(path.read_text())
    del cfg["model_type"]
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]]
    path.write_text(json.dumps(cfg))
    assert ModelSpec.model_validate(model_from_hf_config(path)) == want


def test_modules_kept_unconverted_keep_only_their_class(tmp_path):
    """modules_to_not_convert: the router kept leaves the dense FFNs and shared experts
    converted; the shared expert's gate kept leaves the shared experts converted; the
    experts named keep the routed ones, not the shared ones; a group per row (-1) is read."""
    def precision(keep, family="deepseek_v3", **quant):
        _, path = _save(tmp_path / f"{family}-{len(keep)}-{len(quant)}", family,
                        quantization_config={"quant_method": "awq", "bits": 4,
                                             "group_size": 128, **quant,
                                             "modules_to_not_convert": keep})
        return ModelSpec.model_validate(model_from_hf_config(path)).precision

    p = precision(["model.layers.1.mlp.gate"])
    assert (p.router, p.dense, p.shared, p.experts) == (None, "int4-g128", "int4-g128",
                                                        "int4-g128")
    p = precision(["mlp.shared_expert_gate"], family="qwen2_moe")
    assert p.shared == "int4-g128"
    p = precision(["mlp.experts"])
    assert (p.experts, p.shared) == (None, "int4-g128")
    assert precision([], group_size=-1).experts == "int4-g4096"
    # null is unset, as everywhere in a config: GPTQ's defaults, 4 bits in groups of 128
    assert precision([], bits=None, group_size=None).experts == "int4-g128"


def test_a_config_that_is_not_an_object_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(TgError, match="must hold a JSON object"):
        model_from_hf_config(path)
    _, path = _save(tmp_path / "oss", "gpt_oss")
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "layer_types": [1, "x"]}))
    with pytest.raises(TgError, match="layer_types holds '1'"):
        model_from_hf_config(path)


def test_a_shared_expert_without_a_size_is_refused():
    with pytest.raises(ValueError, match="h_shared"):
        ModelSpec(**{**MODELS["mixtral-8x7b"], "shared_experts": 1})
    with pytest.raises(ValueError, match="outside what a format holds"):
        ModelSpec(**{**MODELS["mixtral-8x7b"], "precision": {"experts": 0.5}})
    with pytest.raises(ValueError, match="Unknown weight format 'q4_z'"):
        ModelSpec(**{**MODELS["mixtral-8x7b"], "precision": {"experts": "q4_z"}})
    # YAML's "4" (or --set ...="4") is text: said so, not an unknown format
    with pytest.raises(ValueError, match="'4' is text, not a number of bits"):
        ModelSpec(**{**MODELS["mixtral-8x7b"], "precision": {"experts": "4"}})


@pytest.mark.parametrize("factor", [0, -40])
def test_a_yarn_factor_that_scales_nothing_is_refused(factor):
    """The executor divides RoPE's frequencies by it: 0 or a negative would compute something,
    silently (a config.json's rope_scaling.factor is refused so too)."""
    yarn = {"factor": factor, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="rope_yarn.factor must be a number above 0"):
        ModelSpec(**{**MODELS["deepseek-v3"], "rope_yarn": yarn})


# --- GGUF ---------------------------------------------------------------------------------------

def _write_gguf(path, arch="qwen3moe", expert_type="Q4_K", said_experts=8, shards=1,
                others=("Q8_0", "Q4_K", "Q6_K"), width=256, last_down_width=None):
    """A tiny qwen3moe file: 8 experts 256 wide (`said_experts` and `width` in its metadata;
    width None: no expert_feed_forward_length), its attention, embedding and head of the types
    `others`, its tensors over `shards` files as gguf-split writes them
    (<name>-00001-of-0000N.gguf); `last_down_width`: the last layer's down experts that wide."""
    gguf = pytest.importorskip("gguf")
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    h, h_i, E, L, n_q, n_kv, d, V = 256, 256, 8, 2, 4, 2, 64, 512
    # the writer splits by its tensors' count: 20 tensors over `shards` files
    w = gguf.GGUFWriter(path, arch, split_max_tensors=0 if shards == 1 else -(-20 // shards))
    w.add_block_count(L)
    w.add_embedding_length(h)
    w.add_feed_forward_length(1024)
    if width is not None:
        w.add_expert_feed_forward_length(width)
    w.add_expert_count(said_experts)
    w.add_expert_used_count(2)
    w.add_head_count(n_q)
    w.add_head_count_kv(n_kv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(V)

    def tensor(name, shape, qtype):
        block, size = GGML_QUANT_SIZES[qtype]
        plain = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
                 Q.I32: np.int32}
        if qtype in plain:
            w.add_tensor(name, np.zeros(shape, dtype=plain[qtype]))
            return
        byte_shape = (*shape[:-1], shape[-1] // block * size)
        w.add_tensor(name, np.zeros(byte_shape, dtype=np.uint8), raw_dtype=qtype)

    attention, embedding, head = (Q[t] for t in others)
    tensor("token_embd.weight", (V, h), embedding)
    tensor("output.weight", (V, h), head)
    for l in range(L):
        tensor(f"blk.{l}.attn_q.weight", (n_q * d, h), attention)
        tensor(f"blk.{l}.attn_k.weight", (n_kv * d, h), attention)
        tensor(f"blk.{l}.attn_v.weight", (n_kv * d, h), attention)
        tensor(f"blk.{l}.attn_output.weight", (h, n_q * d), attention)
        tensor(f"blk.{l}.attn_norm.weight", (h,), Q.F32)
        tensor(f"blk.{l}.ffn_gate_inp.weight", (E, h), Q.F32)
        for part in ("gate", "up"):
            tensor(f"blk.{l}.ffn_{part}_exps.weight", (E, h_i, h), Q[expert_type])
        down_width = last_down_width if l == L - 1 and last_down_width else h_i
        tensor(f"blk.{l}.ffn_down_exps.weight", (E, h, down_width),
               Q.Q6_K if expert_type == "Q4_K" else Q[expert_type])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_is_read_with_its_tensors_types(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    spec = ModelSpec.model_validate(model_from_gguf(path))
    assert (spec.architecture, spec.h, spec.E, spec.k, spec.L, spec.d, spec.V) == (
        "qwen3_moe", 256, 8, 2, 2, 64, 512)
    # gate and up at Q4_K, down at Q6_K: each class's bytes over its weights
    assert spec.bits("experts") == pytest.approx((2 * bits("q4_k") + bits("q6_k")) / 3, abs=1e-4)
    assert spec.bits("attention") == pytest.approx(8.5)
    assert (spec.bits("router"), spec.bits("embedding"), spec.bits("head")) == (32, 4.5, 6.5625)
    assert spec.expert_bytes == pytest.approx(256 * 256 * (2 * 144 + 210) / 256)


def test_gguf_metadata_of_the_wrong_type_is_named(tmp_path):
    """A count stored as text is refused naming the GGUF key, as a config.json field is."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "text.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_string("qwen3moe.block_count", "2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TgError, match="qwen3moe.block_count must be a whole number, not '2'"):
        model_from_gguf(path)


def test_a_split_gguf_is_read_from_all_its_shards(tmp_path):
    """Large quants ship as gguf-split shards: the first holds the metadata, the tensors lie
    across all of them, and the model is the one the unsplit file describes. A later shard,
    or a set with one missing, is refused naming the file."""
    _write_gguf(tmp_path / "whole.gguf")
    whole = ModelSpec.model_validate(model_from_gguf(tmp_path / "whole.gguf"))
    (tmp_path / "split").mkdir()
    _write_gguf(tmp_path / "split" / "m.gguf", shards=4)
    shards = sorted(p.name for p in (tmp_path / "split").iterdir())
    assert shards == [f"m-0000{i}-of-00004.gguf" for i in range(1, 5)]
    first = tmp_path / "split" / shards[0]
    split = ModelSpec.model_validate(model_from_gguf(first))
    assert split.model_dump(exclude={"name"}) == whole.model_dump(exclude={"name"})
    assert split.bits("experts") < 16 and split.expert_bytes == whole.expert_bytes
    assert split.name == "m"          # the set's name, not its first shard's
    with pytest.raises(TgError, match="shard 2 of 4 .*give the first, 'm-00001-of-00004.gguf'"):
        model_from_gguf(tmp_path / "split" / shards[1])
    # a shard renamed from another position of the set
    (tmp_path / "split" / shards[1]).rename(tmp_path / "second")
    (tmp_path / "split" / shards[3]).rename(tmp_path / "split" / shards[1])
    with pytest.raises(TgError, match="m-00002-of-00004.gguf' should be shard 2 of 4, but its "
                                      r"split.no and split.count say \(3, 4\)"):
        model_from_gguf(first)
    (tmp_path / "split" / shards[1]).rename(tmp_path / "split" / shards[3])
    (tmp_path / "second").rename(tmp_path / "split" / shards[1])
    (tmp_path / "split" / shards[2]).unlink()
    with pytest.raises(TgError, match="split in 4 shards, and .*m-00003-of-00004.gguf' is missing"):
        model_from_gguf(first)


def test_gguf_metadata_that_its_tensors_contradict_is_named(tmp_path):
    """llama.cpp's loader checks each tensor's shape against the metadata; so does tg (every
    stacked expert tensor), naming the key and the tensor, instead of pricing 64 experts
    the file does not hold, experts as wide as the dense FFN where no width of their own is
    given, or a last layer whose down experts the first layer's do not describe."""
    path = tmp_path / "e64.gguf"
    _write_gguf(path, said_experts=64)
    with pytest.raises(TgError, match=r"qwen3moe.expert_count is 64, but the tensor "
                                      r"'blk.0.ffn_gate_exps.weight' holds 8"):
        model_from_gguf(path)
    import gguf

    reader = gguf.GGUFReader(tmp_path / "e64.gguf")
    assert reader.get_field("qwen3moe.feed_forward_length").contents() == 1024
    _write_gguf(path, said_experts=8, width=None)
    with pytest.raises(TgError, match=r"qwen3moe.feed_forward_length is 1024, but the tensor "
                                      r"'blk.0.ffn_gate_exps.weight' holds 256"):
        model_from_gguf(path)
    _write_gguf(path, last_down_width=512)
    with pytest.raises(TgError, match=r"qwen3moe.expert_feed_forward_length is 256, but the "
                                      r"tensor 'blk.1.ffn_down_exps.weight' holds 512"):
        model_from_gguf(path)


def test_an_expert_a_tensor_counts_as_the_experts(tmp_path):
    """Old Mixtral conversions store each expert's matrices as tensors of their own
    (blk.N.ffn_gate.E.weight): still the routed experts, at their type's bits."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    from taskgraph.model_files import _gguf_precision

    block, size = GGML_QUANT_SIZES[Q.Q4_0]
    w = gguf.GGUFWriter(tmp_path / "old.gguf", "llama")
    for e in range(2):
        for part in ("gate", "up", "down"):
            w.add_tensor(f"blk.0.ffn_{part}.{e}.weight",
                         np.zeros((64, 64 // block * size), np.uint8), raw_dtype=Q.Q4_0)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors = gguf.GGUFReader(tmp_path / "old.gguf").tensors
    assert _gguf_precision(tensors) == {"experts": "q4_0", "attention": "f16"}


@pytest.mark.parametrize("qtype", ["F64", "I8", "I32"])
def test_a_gguf_tensor_of_a_type_no_weight_is_stored_in_is_named(tmp_path, qtype):
    path = tmp_path / "odd.gguf"
    _write_gguf(path, expert_type=qtype)
    with pytest.raises(TgError, match=f"tensor 'blk.0.ffn_gate_exps.weight' is of type {qtype}"):
        model_from_gguf(path)


def test_a_class_of_one_gguf_type_keeps_its_name(tmp_path):
    """Where every tensor of a class has one type, the class is stored in that format; a mix
    (Q4_K_M's experts: gate and up Q4_K, down Q6_K) is its average bits."""
    path = tmp_path / "q6.gguf"
    _write_gguf(path, expert_type="Q6_K")
    spec = ModelSpec.model_validate(model_from_gguf(path))
    assert (spec.precision.experts, spec.precision.attention, spec.precision.router,
            spec.precision.head) == ("q6_k", "q8_0", "f32", "q6_k")
    _write_gguf(path, expert_type="Q4_K")
    assert ModelSpec.model_validate(model_from_gguf(path)).precision.experts == pytest.approx(
        (2 * bits("q4_k") + bits("q6_k")) / 3, abs=1e-4)


def test_a_gguf_whose_experts_the_executor_dequantizes_is_executed(tmp_path):
    """Q4_0 experts, float attention, embedding and head, the router in F32 as llama.cpp's
    converter keeps it: tg execute runs the file's model (its float weights in the model's
    dtype) and computes the reference's tokens; the same file with Q8_0 attention is refused
    naming the class."""
    from taskgraph import api

    path = tmp_path / "q4.gguf"
    _write_gguf(path, expert_type="Q4_0", others=("F16", "F16", "F16"))
    run = api.execute("tiny", schedule="EP", overrides={
        "model": str(path), "workload.gen_len": 2, "workload.prompt_len": 8,
        "workload.max_prompt_len": 8, "policy.N": 1, "policy.mu": 1, "policy.experts_gpu": 2})
    assert run.summary["tokens_match"] is True
    _write_gguf(path, expert_type="Q4_0", others=("Q8_0", "F16", "F16"))
    with pytest.raises(TgError, match="model.precision.attention = q8_0: tg execute runs"):
        api.execute("tiny", schedule="EP", overrides={"model": str(path),
                                                      "workload.gen_len": 2})


def test_a_gguf_of_an_unknown_architecture_is_refused(tmp_path):
    path = tmp_path / "rwkv.gguf"
    _write_gguf(path, arch="rwkv6")
    with pytest.raises(TgError, match="general.architecture 'rwkv6'"):
        model_from_gguf(path)


# --- presets against their model cards ----------------------------------------------------------

# (total, active) parameters in billions, as each model's card states them. Cards count the
# active ones with the embedding and the head, with one of them, or with neither: within 10%
# of tg's (the head, not the embedding, which a token only looks up).
CARDS = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235, 22), "deepseek-v3": (671, 37),
         "deepseek-v2-lite": (15.7, 2.4), "gpt-oss-20b": (21, 3.6), "gpt-oss-120b": (117, 5.1),
         "olmoe-1b-7b": (6.9, 1.3), "phi-3.5-moe": (41.9, 6.6), "qwen2-57b-a14b": (57.4, 14),
         "glm-4.5-air": (106, 12), "mixtral-8x7b": (46.7, 12.9)}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_presets_have_their_model_cards_parameters(name):
    spec = ModelSpec(**MODELS[name])
    total, active = CARDS[name]
    assert spec.params["total"] / 1e9 == pytest.approx(total, rel=0.02)
    assert spec.params["active"] / 1e9 == pytest.approx(active, rel=0.10)


def test_every_published_figures_scenario_runs():
    """scenarios/small-batch/published.yaml: each figure's scenario simulates on its stated
    machine (those not checked against a tolerance are shown in the docs, not tuned to)."""
    import yaml
    from pathlib import Path

    from taskgraph.scenario import for_schedule, load_scenario
    from taskgraph.sim.simulate import simulate_scenario

    for entry in yaml.safe_load(Path("scenarios/small-batch/published.yaml").read_text()):
        sc = load_scenario(f"scenarios/small-batch/{entry['scenario']}")
        s = simulate_scenario(for_schedule(sc, entry["schedule"])[0], entry["schedule"]).summary
        assert np.isfinite(s["token_latency_ms"]) and s["token_latency_ms"] > 0, entry["scenario"]


def test_a_models_folder_stands_for_its_config_json(tmp_path):
    """`model: path/to/Qwen3-30B-A3B/` (the folder transformers saves) reads its config.json;
    a folder without one is refused naming it, not taken for a preset's name."""
    from taskgraph.scenario import load_scenario

    _, path = _save(tmp_path / "qwen3", "qwen3_moe")
    by_file = load_scenario("t4", [f"model={path}"]).model
    assert load_scenario("t4", [f"model={path.parent}"]).model == by_file
    (tmp_path / "empty").mkdir()
    with pytest.raises(TgError, match="The model folder '.*empty' holds no config.json"):
        load_scenario("t4", [f"model={tmp_path / 'empty'}"])


def test_a_folder_named_as_a_preset_leaves_the_preset(tmp_path, monkeypatch):
    """`model: tiny` is the preset, whatever folder named tiny lies where tg runs (a
    download's --local-dir is often named as the model)."""
    from taskgraph.scenario import load_scenario

    want = load_scenario("t4", ["model=tiny"]).model
    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_scenario("t4", ["model=tiny"]).model == want


def test_every_float_name_is_a_format_of_16_or_32_bits():
    """The names tg execute runs in the model's dtype are formats bits() knows as floats."""
    from taskgraph.formats import FLOATS, is_float

    assert {bits(f) for f in FLOATS} == {16.0, 32.0}
    assert is_float("BF16") and not is_float("q8_0") and not is_float(16.0)
