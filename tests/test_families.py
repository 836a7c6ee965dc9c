"""The executor on the families after Mixtral, against transformers' own model classes on random
tiny checkpoints transformers writes: Qwen2-MoE (Q, K, V biases, a gated shared expert, gates
not renormalised; and with a dense first layer), Qwen3-MoE (each head's Q and K normed,
head_dim apart from h / n_q, gates renormalised), OLMoE (all heads' Q and K normed at once),
DeepSeek-V2/V3 (MLA, dense first layers, shared experts, greedy, group-limited and biased
sigmoid routing), gpt-oss (biases, attention sinks, YaRN, a softmax over the top router
logits, clamped experts), Phi-3.5-MoE (LayerNorms, biases, SparseMixer, LongRoPE) and GLM-4.5
(V3's router; Q, K, V biases, per-head Q/K norms, RoPE over half of each head). Every schedule, ragged requests
sharing micro-batches: each request's greedy tokens are those of ``generate()`` on its prompt
alone, and every step's logits agree within fp32 tolerance."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from taskgraph.dag.builder import make_plan  # noqa: E402
from taskgraph.dag.compiled import compile_plan  # noqa: E402
from taskgraph.errors import TgError  # noqa: E402
from taskgraph.exec.dispatch import CudaDevice, execute  # noqa: E402
from taskgraph.exec.runtime import Runtime  # noqa: E402
from taskgraph.kernels.reference import reference_forward  # noqa: E402
from taskgraph.kernels.weights import load_safetensors  # noqa: E402
from taskgraph.scenario import scenario_from_dict  # noqa: E402

FAMILIES = {
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                      norm_topk_prob=False),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=6,
                      num_experts_per_tok=3, norm_topk_prob=True, rms_norm_eps=1e-6),
    "olmoe": dict(hidden_size=64, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=4, num_experts=6, num_experts_per_tok=2,
                  rope_theta=500.0),
    # MLA (Q projected directly), a dense first layer, two shared experts, softmax gates not
    # renormalised; and grouped (group-limited greedy) routing with scaled gates
    "deepseek_v2": dict(hidden_size=64, intermediate_size=112, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
                        n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
                        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy",
                        head_dim=8),
    "deepseek_v2-grouped": dict(hidden_size=64, intermediate_size=112, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8,
                                n_shared_experts=1, num_experts_per_tok=2,
                                first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=24,
                                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                routed_scaling_factor=2.0, head_dim=8),
    # MLA with a Q latent, sigmoid scores chosen with a bias in 4 groups of which 2 are taken,
    # renormalised and scaled gates, a dense first layer
    "deepseek_v3": dict(hidden_size=64, intermediate_size=112, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, head_dim=8),
    # biases everywhere, a sink logit per head, a softmax over the k best router logits,
    # clamped experts with interleaved gate | up, YaRN RoPE, sliding and full layers (the
    # window longer than these contexts)
    "gpt_oss": dict(hidden_size=64, intermediate_size=48, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=6,
                    num_experts_per_tok=2, sliding_window=32, num_hidden_layers=2),
    # LayerNorms with biases, Q, K, V, O and LM head biases, SparseMixer routing (its
    # threshold wide enough that several experts share each softmax), LongRoPE's short factors
    "phimoe": dict(hidden_size=64, intermediate_size=48, num_attention_heads=4,
                   num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
                   attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0 + 0.3 * i for i in range(8)],
                                    "long_factor": [4.0] * 8, "short_mscale": 1.2,
                                    "long_mscale": 1.5, "original_max_position_embeddings": 32}),
    # GLM-4.5: DeepSeek-V3's routing (sigmoid with a bias, 2 groups of which 1 is taken,
    # renormalised and scaled gates), a dense first layer and a shared expert, with GQA
    # attention: Q, K, V biases, each head's Q and K normed, RoPE over half of each head
    "glm4_moe": dict(hidden_size=64, intermediate_size=112, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                     first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True),
    # gpt-oss with a window of 4 tokens, shorter than every prompt but one and every context:
    # its sliding layers attend to the last 4 positions, in prefill and in decode
    "gpt_oss-window": dict(hidden_size=64, intermediate_size=48, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_local_experts=6,
                           num_experts_per_tok=2, sliding_window=4, num_hidden_layers=2),
    # a dense first layer (mlp_only_layers) of its own intermediate size before MoE layers
    "qwen2_moe-dense": dict(hidden_size=64, intermediate_size=112, moe_intermediate_size=48,
                            shared_expert_intermediate_size=80, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                            mlp_only_layers=[0], num_hidden_layers=3),
}
# The executor on every device this machine has; transformers always runs on the CPU, in fp32.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROMPT_LENS = [7, 3, 5, 6]
STEPS = 3
SCHEDULES = {"S1": {"r_w": 0.3}, "S2": {}, "S3": {}, "S4": {}, "DS": {}, "S5": {},
             "EP": {"experts_gpu": 2}, "EC": {"experts_gpu": 2},
             "ECP": {"experts_gpu": 2, "prefetch": 0.5}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    family = request.param.split("-")[0]
    folder = tmp_path_factory.mktemp(request.param)
    cfg = transformers.AutoConfig.for_model(
        family, **{"num_hidden_layers": 2, **FAMILIES[request.param]}, vocab_size=128,
        max_position_embeddings=64, initializer_range=0.15, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():     # biases and sinks that matter (transformers starts some at 0)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "e_score_correction_bias" in name or "sinks" in name or name.endswith("bias"):
                t.normal_(0, 0.3)
    model.save_pretrained(folder)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 128, (len(PROMPT_LENS), max(PROMPT_LENS)), generator=g)
    expected = []
    for i, n in enumerate(PROMPT_LENS):
        ids = prompts[i, :n][None]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS + 1,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
        expected.append((out.sequences[0, n:], torch.stack(out.logits, 1)[0]))
    return folder, prompts, torch.tensor(PROMPT_LENS), expected


def _run(folder, schedule, prompts, lens, mu=2, device="cpu"):
    n = len(lens)
    gpu_attention = schedule not in ("S1", "S2", "S3")
    policy = {"N": n, "mu": n if schedule == "DS" else mu, "A_g": int(gpu_attention),
              "F_g": int(schedule in ("S1", "S2", "S3", "S4", "DS")), "r_w": 0.0, "r_c": 0.0,
              **SCHEDULES[schedule]}
    if schedule == "DS":
        policy["r_c"] = 1.0
    sc = scenario_from_dict({
        "model": {"hf_config": str(folder / "config.json"), "dtype_bytes": 4},
        "hardware": "t4", "workload": {"prompt_len": prompts.shape[1], "gen_len": STEPS},
        "policy": policy, "schedule": schedule})
    plan = make_plan(sc)
    w = load_safetensors(folder, sc.model, torch.float32)
    rt = Runtime(plan, w, prompts, torch.device(device), prompt_lens=lens, record_logits=True,
                 pin_memory=device == "cuda")
    run = execute(compile_plan(plan), rt, CudaDevice(torch) if device == "cuda" else None)
    assert not run.interrupted and run.failure is None, run.failure
    return rt.outputs()[0], rt.step_logits.cpu(), w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_family_computes_transformers_tokens(checkpoint, schedule, device):
    folder, prompts, lens, expected = checkpoint
    tokens, step_logits, w = _run(folder, schedule, prompts, lens, device=device)
    for i, (hf_tokens, hf_logits) in enumerate(expected):
        assert tokens[i].tolist() == hf_tokens.tolist(), f"request {i} ({lens[i]} tokens)"
        torch.testing.assert_close(step_logits[i], hf_logits, rtol=0, atol=2e-4)
    ref = reference_forward(w, prompts, 2, STEPS, lens)
    assert torch.equal(ref.tokens, tokens)


def test_without_the_familys_own_parts_the_tokens_are_not_transformers(checkpoint):
    """The guard: the same checkpoint without its family's own parts (biases, Q/K norms, the
    router's bias, the shared expert's gate; the other renormalisation, gate scale and RoPE
    pairing) does not compute the family's logits."""
    folder, prompts, lens, expected = checkpoint
    from taskgraph.model_files import model_from_hf_config
    from taskgraph.specs import ModelSpec

    m = ModelSpec.model_validate(model_from_hf_config(folder / "config.json"))
    w = load_safetensors(folder, m, torch.float32)
    plain = m.model_copy(update={"renormalize": not m.renormalize, "shared_gate": False,
                                 "routed_scaling": 1.0, "rope_interleave": not m.rope_interleave})
    for l in range(m.L):
        w.extras[l] = {k: v for k, v in w.extras[l].items()
                       if k.endswith("_a_norm") or k == "router_logit_bias"}
    w.model = plain
    ref = reference_forward(w, prompts, 2, STEPS, lens)
    theirs = torch.stack([e[1][-1] for e in expected])
    assert (ref.logits - theirs).abs().max() > 1e-2


def test_a_family_the_executor_does_not_compute_is_refused(tmp_path):
    from taskgraph.exec.loading import check_computable
    from taskgraph.presets import MODELS
    from taskgraph.specs import ModelSpec

    with pytest.raises(TgError, match="dbrx is simulated, not executed"):
        check_computable(ModelSpec(**MODELS["dbrx"]), 64)
    with pytest.raises(TgError, match="model.precision.experts = iq4_xs"):
        check_computable(ModelSpec(**{**MODELS["qwen3-30b-a3b"],
                                      "precision": {"experts": "iq4_xs"}}), 64)


def _tp_run(folder, schedule, prompts, lens, r_w, gpus=2):
    """The checkpoint on `gpus` GPUs in tensor parallel, every shard in this process."""
    from taskgraph.exec.tensor import TensorParallel

    sc = scenario_from_dict({
        "model": {"hf_config": str(folder / "config.json"), "dtype_bytes": 4},
        "hardware": {"preset": "t4", "gpu": {"count": gpus}},
        "workload": {"prompt_len": prompts.shape[1], "gen_len": STEPS},
        "policy": {"N": len(lens), "mu": 2, "A_g": int(schedule == "S4"), "F_g": 1,
                   "r_w": r_w, "r_c": 0.0},
        "schedule": schedule})
    plan = make_plan(sc)
    w = load_safetensors(folder, sc.model, torch.float32)
    rt = TensorParallel(plan, w, prompts, torch.device("cpu"), prompt_lens=lens,
                        record_logits=True)
    run = execute(compile_plan(plan), rt)
    assert not run.interrupted and run.failure is None, run.failure
    return rt


# S1 with a third of each layer resident: the pages' boundaries fall inside matrices (in
# DeepSeek-V2's dense layer, inside the value up-projection its attention reads)
@pytest.mark.parametrize("schedule,r_w", [("S1", 0.3), ("S3", 0.0), ("S4", 0.0)])
def test_tensor_parallelism_computes_each_familys_tokens(checkpoint, schedule, r_w):
    """Two GPUs, each its block of heads and of every MLP's columns (the shared experts' and
    the dense layers' too), biases after a partial sum once, norms and routers whole, MLA's
    latents whole on each, OLMoE's Q/K norm over every head from all-reduced sums of squares:
    transformers' tokens and logits."""
    folder, prompts, lens, expected = checkpoint
    rt = _tp_run(folder, schedule, prompts, lens, r_w)
    tokens, step_logits = rt.outputs()[0], rt.shards[0].step_logits
    for i, (hf_tokens, hf_logits) in enumerate(expected):
        assert tokens[i].tolist() == hf_tokens.tolist(), f"request {i} ({lens[i]} tokens)"
        torch.testing.assert_close(step_logits[i], hf_logits, rtol=0, atol=2e-4)


def test_the_shards_partition_each_familys_split_matrices(checkpoint):
    """Over 2 GPUs, every matrix of every class of layer is split into disjoint halves, but
    for those each GPU holds whole (routers, MLA's down-projections, the shared experts'
    gate), which the memory model counts on each GPU; and each shard's flat layer is the
    shard model's layout."""
    from taskgraph.exec.tensor import shard_elements, shard_model
    from taskgraph.kernels.weights import layer_sections
    from taskgraph.model_files import model_from_hf_config
    from taskgraph.specs import ModelSpec

    m = ModelSpec.model_validate(model_from_hf_config(checkpoint[0] / "config.json"))
    whole = {"router", "kv_a", "q_a", "shared.gate"}
    for dense in sorted({m.is_dense(l) for l in range(m.L)}):
        shards = [set(shard_elements(m, 2, g, dense).tolist()) for g in range(2)]
        twice = 0                           # elements both GPUs hold, but K,V head copies
        for s in layer_sections(m, dense):
            if s.name not in ("k", "v"):
                twice += len(set(range(s.offset, s.offset + s.size)) & shards[0] & shards[1])
            cells = set(range(s.offset, s.offset + s.size))
            held = [cells & sh for sh in shards]
            if s.name in whole:
                assert all(h == cells for h in held), s.name
            elif s.name in ("k", "v") and m.n_kv < 2:
                assert all(len(h) == len(cells) for h in held), s.name
            else:
                assert not held[0] & held[1] and set.union(*held) == cells, s.name
        part = layer_sections(shard_model(m, 2), dense)
        assert all(len(sh) == part[-1].offset + part[-1].size for sh in shards)
        assert twice * m.dtype_bytes == m.whole_on_every_gpu_bytes(dense)


def test_a_checkpoint_stored_in_fp8_is_refused(checkpoint, tmp_path):
    """Its quantization_config says the weights are fp8 blocks: tg does not run them as if
    they were the dtype's (the scales would be lost), whatever the tensors hold."""
    import json
    import shutil

    from taskgraph import execute

    folder = checkpoint[0]
    copy = tmp_path / "fp8"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TgError, match="stores its .* weights as fp8-block128"):
        execute({"model": {"hf_config": str(copy / "config.json"), "dtype_bytes": 4},
                 "hardware": "t4", "workload": {"prompt_len": 4, "gen_len": 2},
                 "policy": {"N": 2, "mu": 1, "r_w": 0.0, "r_c": 0.0}, "schedule": "S4"},
                weights=str(copy))
