"""`tg execute --record-routing FILE`: the router's decisions of a run, written in the format
``workload.routing.trace`` replays (taskgraph.dag.routing, ``tg-routing/1``).

Checked end to end through the command line: the file round-trips through the trace reader
with the model's shapes; its experts are those Hugging Face transformers' own Mixtral picks on
the same prompts and generated tokens (an implementation this project did not write); the
simulator's distinct-expert count at the recorded batch is the recording's own; a random
router records near-uniform counts; and a trace of another model's shape is one clear error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from taskgraph.cli import main  # noqa: E402
from taskgraph.dag.routing import Routing, trace_from_dict  # noqa: E402
from taskgraph.scenario import load_scenario, scenario_from_dict  # noqa: E402

TINY = "scenarios/tiny.yaml"          # h=256, L=4, E=8, k=2; N=8 sequences of 16 tokens
STEPS = 16                            # decode steps recorded: 64 (step, layer) samples


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One `tg execute` of the tiny scenario on synthetic weights, its routing recorded."""
    path = tmp_path_factory.mktemp("routing") / "tiny-routing.json"
    assert main(["execute", TINY, "--steps", str(STEPS), "--record-routing", str(path),
                 "--json"]) == 0
    return path


def yaml_of(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def _distinct_per_step_and_layer(doc: dict) -> np.ndarray:
    """From the raw JSON, with plain Python sets: distinct experts of each decode step's layer."""
    return np.array([[len({e for token in layer for e in token}) for layer in step]
                     for step in doc["steps"][1:]], dtype=float)


def test_the_file_round_trips_with_the_models_shapes(recorded, capsys):
    capsys.readouterr()
    doc = json.loads(recorded.read_text())
    trace = trace_from_dict(doc, "x")                # the reader the simulator uses accepts it
    m, w = load_scenario(TINY).model, load_scenario(TINY).workload
    assert doc["format"] == "tg-routing/1"
    assert (trace.E, trace.k, trace.L) == (m.E, m.k, m.L) == (8, 2, 4)
    assert len(trace.experts) == 1 + STEPS           # the prefill, then every decode step
    N, P = 8, w.context_prompt                       # synthetic prompts: N of P tokens
    assert trace.experts[0].shape == (m.L, N * P, m.k)
    assert all(step.shape == (m.L, N, m.k) for step in trace.decode)
    for step in trace.experts:                       # top-k: k different experts per token
        assert (np.sort(step, axis=-1)[..., 1:] != np.sort(step, axis=-1)[..., :-1]).all()
    # the routing is not one fixed choice: different tokens route differently
    assert len({tuple(t) for t in trace.experts[0][0].tolist()}) > 4


def test_the_output_path_is_checked_before_any_work(tmp_path, capsys):
    scen = tmp_path / "s.yaml"
    scen.write_text(Path(TINY).read_text())
    for bad, said in ((tmp_path / "r.txt", "must end in .json"),
                      (tmp_path / "d.json", "is a folder")):
        if said == "is a folder":
            bad.mkdir()
        assert main(["execute", str(scen), "--record-routing", str(bad)]) == 2
        err = capsys.readouterr().err
        assert "--record-routing" in err and said in err and "Traceback" not in err
    # an input of the run (here the routing trace the scenario itself reads) is never replaced
    trace = tmp_path / "t.json"
    assert main(["execute", str(scen), "--steps", "1", "--record-routing", str(trace),
                 "--json"]) == 0
    before = trace.read_text()
    assert main(["execute", str(scen), "--set", "workload.routing.kind=trace", "--set",
                 f"workload.routing.trace={trace}", "--record-routing", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "--record-routing" in err and "is an input of this run" in err
    assert trace.read_text() == before


def test_recording_needs_the_reference_check():
    from taskgraph.errors import TgError
    from taskgraph.exec.execute import execute_scenario

    with pytest.raises(TgError, match="needs the check against the reference"):
        execute_scenario(load_scenario(TINY), device="cpu", check=False, record_routing=True)


def test_the_simulators_distinct_count_is_the_recordings_own(recorded):
    doc = json.loads(recorded.read_text())
    counts = _distinct_per_step_and_layer(doc)
    batch = len(doc["steps"][1][0])                  # tokens of a decode step: N = 8
    assert batch == 8 and counts.shape == (STEPS, 4)
    sc = scenario_from_dict({**yaml_of(TINY), "workload": {
        **yaml_of(TINY)["workload"], "routing": {"kind": "trace", "trace": str(recorded)}}})
    routing = Routing.of(sc)
    assert routing.distinct(batch) == pytest.approx(counts.mean(), abs=1e-12)
    # the same through --set on the command line's loader
    sc2 = load_scenario(TINY, ["workload.routing.kind=trace",
                               f"workload.routing.trace={recorded}"])
    assert Routing.of(sc2).distinct(batch) == pytest.approx(counts.mean(), abs=1e-12)
    # A random router is near uniform, E(1 - (1 - k/E)^t) = 7.199 at t = 8 of E = 8, k = 2.
    # The tolerance is 4 standard errors of that mean under uniform routing: the exact
    # per-layer spread (Routing.distinct_std, 0.68 here) over the 64 (step, layer) samples,
    # 0.34. Measured: 7.172 with 16 steps, 7.219 with 32 (0.03 and 0.02 off). A recording that
    # mixed up layers, steps or tokens (e.g. one sequence's consecutive tokens, which reuse
    # experts, or repeated rows) lands far outside it: a batch of 8 identical tokens touches
    # 2, and the prefill rows taken 8 consecutive tokens of one sequence at a time touch 6.3
    # on average here (measured on this recording).
    E, k = doc["E"], doc["k"]
    uniform = Routing.uniform(sc.model)
    expected = E * (1 - (1 - k / E) ** batch)
    assert uniform.distinct(batch) == pytest.approx(expected)
    tolerance = 4 * uniform.distinct_std(batch) / np.sqrt(counts.size)
    assert 0.3 < tolerance < 0.4
    assert abs(counts.mean() - expected) < tolerance, (counts.mean(), expected, tolerance)


def test_a_trace_of_another_shape_is_one_clear_error(recorded, tmp_path, capsys):
    doc = json.loads(recorded.read_text())
    for field, value in (("E", 16), ("k", 3)):
        bad = dict(doc, **{field: value})
        if field == "k":      # shapes must still parse: every token's k ids
            bad["steps"] = [[[t + [min(set(range(doc["E"])) - set(t))] for t in layer]
                             for layer in step] for step in doc["steps"]]
        path = tmp_path / f"bad-{field}.json"
        path.write_text(json.dumps(bad))
        capsys.readouterr()
        rc = main(["simulate", TINY, "--set", "workload.routing.kind=trace", "--set",
                   f"workload.routing.trace={path}"])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert "Traceback" not in err
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("tg simulate: error:"), err
        assert "workload.routing.trace" in err and f"{field} = {value}" in err
    # and the good one simulates
    assert main(["simulate", TINY, "--set", "workload.routing.kind=trace", "--set",
                 f"workload.routing.trace={recorded}", "--json"]) == 0


# --- against transformers' Mixtral ---------------------------------------------------------

def _hf_topk(model, ids: list[int]) -> list[list[set[int]]]:
    """Each layer's top-k expert set of every position, by transformers' own router."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return [[set(row.tolist()) for row in logits.topk(k, dim=-1).indices]
            for logits in out.router_logits]


def test_the_recorded_experts_are_transformers_own(tmp_path, capsys):
    """A random Mixtral checkpoint, three prompts of different lengths in a batch of N = 4 (one
    filler sequence, padded prompts): step 0 holds each prompt's real tokens, prompt after
    prompt, and every decode step one token per prompt, each token's experts those
    transformers' router picks at that position of prompt + generated tokens."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from tests.test_transformers_parity import make_checkpoint

    ckpt = tmp_path / "ckpt"
    model = make_checkpoint(ckpt, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                            layers=3)
    assert isinstance(model, transformers.MixtralForCausalLM)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 4, 13)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "prompt_ids": p}) + "\n"
                                              for i, p in enumerate(prompts)))
    scen = tmp_path / "s.yaml"
    scen.write_text(f"model: {{hf_config: {ckpt / 'config.json'}}}\nhardware: t4\n"
                    "workload: {prompt_len: 8, gen_len: 5}\npolicy: {N: 4, mu: 2}\n"
                    "schedule: S1\n")
    out, rec = tmp_path / "o.jsonl", tmp_path / "routing.json"
    assert main(["execute", str(scen), "--weights", str(ckpt), "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(out), "--record-routing", str(rec),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens_match"] and summary["routing"] == str(rec)
    generated = {row["id"]: row["output_ids"]
                 for row in map(json.loads, out.read_text().splitlines())}
    doc = json.loads(rec.read_text())
    trace = trace_from_dict(doc, "x")
    cfg = model.config
    assert (trace.E, trace.k, trace.L) == (cfg.num_local_experts, cfg.num_experts_per_tok,
                                           cfg.num_hidden_layers) == (4, 2, 3)
    assert len(doc["steps"]) == 1 + 4                # 5 new tokens: prefill's + 4 decode steps
    # step 0: the prompts' real tokens, prompt after prompt (no padding, no filler)
    assert trace.experts[0].shape == (3, sum(map(len, prompts)), 2)
    start = 0
    compared = 0
    for i, p in enumerate(prompts):
        hf = _hf_topk(model, p)
        for layer in range(3):
            got = [set(t) for t in doc["steps"][0][layer][start:start + len(p)]]
            assert got == hf[layer], f"prompt {i} layer {layer}"
            compared += len(p)
        start += len(p)
    # decode step s: one token per prompt, the one generated at step s - 1, at position
    # len(prompt) + s - 1; transformers run over prompt + generated tokens, read at the end
    for s in range(1, 5):
        assert trace.experts[s].shape == (3, 3, 2)
        for i, p in enumerate(prompts):
            hf = _hf_topk(model, p + generated[i][:s])
            for layer in range(3):
                assert set(doc["steps"][s][layer][i]) == hf[layer][-1], \
                    f"step {s} prompt {i} layer {layer}"
                compared += 1
    assert compared == 3 * sum(map(len, prompts)) + 4 * 3 * 3


def test_a_run_of_several_batches_records_its_first(tmp_path, capsys):
    """Five prompts with policy.N = 4: two batches, the first one recorded."""
    g = torch.Generator().manual_seed(5)
    lens = (3, 6, 2, 5, 4)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in lens]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                                              for p in prompts))
    rec = tmp_path / "r.json"
    assert main(["execute", TINY, "--set", "policy.N=4", "--steps", "3", "--prompts",
                 str(tmp_path / "p.jsonl"), "--record-routing", str(rec), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["batches"] == 2 and summary["tokens_match"]
    trace = trace_from_dict(json.loads(rec.read_text()), "x")
    assert trace.experts[0].shape == (4, sum(lens[:4]), 2)
    assert [s.shape for s in trace.decode] == [(4, 4, 2)] * 2     # 3 new tokens: 2 decode steps


def test_a_run_that_stops_writes_no_routing(tmp_path, monkeypatch, capsys):
    """The routing comes from the reference forward that runs after the run; a run stopped by a
    failed task has none, so no file is written (not an empty one) and the warnings say so."""
    from taskgraph import api
    from taskgraph.exec.runtime import Runtime

    real_run = Runtime.run

    def boom(self, step, kind, layer, index, gpu=-1):
        if (step, kind, layer) == (1, "PostAttn", 2):
            raise RuntimeError("a kernel failed (simulated)")
        real_run(self, step, kind, layer, index, gpu)

    monkeypatch.setattr(Runtime, "run", boom)
    rec = tmp_path / "r.json"
    result = api.execute(TINY, device="cpu", record_routing=rec)
    assert result.failure is not None and result.routing is None and not rec.exists()
    assert any("no routing written" in w for w in result.summary["warnings"])
    assert "routing" not in result.summary
    assert main(["execute", TINY, "--record-routing", str(rec)]) == 2
    assert "a kernel failed" in capsys.readouterr().err and not rec.exists()
    assert not list(tmp_path.iterdir())          # no partial file either


def test_a_model_with_dense_layers_records_its_routers_and_replays(tmp_path, capsys):
    """DeepSeek-V3 with a dense first layer (transformers' own random checkpoint): the trace
    names the dense layer and holds -1 there (no router to record), each MoE layer's experts
    are those transformers' router picks (read with a hook on its gate), and the simulator
    replays the file (its expert cache on the recorded routing)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")

    cfg = transformers.AutoConfig.for_model(
        "deepseek_v3", hidden_size=64, intermediate_size=112, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, head_dim=8, vocab_size=128,
        max_position_embeddings=64, initializer_range=0.15, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, t in model.named_buffers():
            if "e_score_correction_bias" in name:
                t.normal_(0, 0.3)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    prompt = torch.randint(1, 128, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": prompt}) + "\n")
    scen = tmp_path / "s.yaml"
    scen.write_text(f"model: {{hf_config: {ckpt / 'config.json'}, dtype_bytes: 4}}\n"
                    "hardware: t4\nworkload: {prompt_len: 8, gen_len: 3}\n"
                    "policy: {N: 1, mu: 1, experts_gpu: 2}\nschedule: EC\n")
    rec = tmp_path / "routing.json"
    assert main(["execute", str(scen), "--weights", str(ckpt), "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"),
                 "--record-routing", str(rec), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_match"]
    doc = json.loads(rec.read_text())
    trace = trace_from_dict(doc, "x")
    assert doc["dense_layers"] == [0] and trace.dense == (0,)
    assert (trace.experts[0][0] == -1).all()

    picked = {}
    hooks = [model.model.layers[l].mlp.gate.register_forward_hook(
        lambda mod, args, out, l=l: picked.__setitem__(l, out[2])) for l in (1, 2)]
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    for l in (1, 2):
        assert [set(t) for t in trace.experts[0][l].tolist()] == \
            [set(t) for t in picked[l].tolist()], f"layer {l}"

    replay = tmp_path / "replay.yaml"
    replay.write_text(scen.read_text().replace(
        "workload: {prompt_len: 8, gen_len: 3}",
        f"workload: {{prompt_len: 7, gen_len: 3, routing: {{kind: trace, trace: {rec}}}}}"))
    assert main(["simulate", str(replay), "--json"]) == 0
    experts = json.loads(capsys.readouterr().out)["experts"]
    assert experts["hit_rate_by_layer"][0] is None
    assert all(0 <= h <= 1 for h in experts["hit_rate_by_layer"][1:])


def _trace_doc(L=3, tokens=5, steps=4, E=8, k=2, seed=0):
    rng = np.random.default_rng(seed)
    return {"format": "tg-routing/1", "E": E, "k": k, "L": L,
            "steps": [np.array([[rng.choice(E, k, replace=False) for _ in range(tokens)]
                                for _ in range(L)]).tolist() for _ in range(steps)]}


@pytest.mark.parametrize("indent, separators, steps_first", [
    (None, (",", ":"), False), (2, (", ", ": "), True), ("\t", (" ,", " : "), False)])
def test_a_trace_is_read_step_by_step_as_json_reads_it(indent, separators, steps_first):
    """The streamed reader gives what json's own gives, however the file is laid out."""
    from taskgraph.dag.routing import trace_from_json

    doc = _trace_doc()
    if steps_first:
        doc = {"steps": doc["steps"], **{k: v for k, v in doc.items() if k != "steps"}}
    text = "\n " + json.dumps(doc, indent=indent, separators=separators) + " \n"
    streamed, whole = trace_from_json(text, "t"), trace_from_dict(json.loads(text), "t")
    assert (streamed.E, streamed.k, streamed.L) == (whole.E, whole.k, whole.L)
    assert all(np.array_equal(a, b) for a, b in zip(streamed.experts, whole.experts))
    assert len(streamed.experts) == len(whole.experts) == 4


@pytest.mark.parametrize("text, words", [
    ('{"format": "tg-routing/1", "steps": [[[[0, 1]]]] "E": 2}', "not valid JSON"),
    ('{"format": "tg-routing/1", "E": 8, "k": 2, "L": 1, "steps": [[[[0, 1]]], [[[0, 1.5]]]]}',
     "steps[1] must hold integer expert ids, not fractional numbers"),
    ('{"format": "tg-routing/1", "E": 8, "k": 2, "L": 1, "steps": [[[[0, 1]]], [[[0], [1, 2]]]]}',
     "steps[1] is not an array of expert ids"),
    ('{"format": "tg-routing/1", "E": 8, "k": 2, "L": 1, "steps": []} x', "not valid JSON"),
    ('[1, 2]', "is not a routing trace"),
    # a bool is no expert id (round three: [true, false] were experts 1 and 0)
    ('{"format": "tg-routing/1", "E": 8, "k": 2, "L": 1, "steps": [[[[0, 1]]], [[[true, false]]]]}',
     "steps[1] must hold integer expert ids, not true/false"),
])
def test_a_bad_trace_read_step_by_step_is_one_clear_error(text, words):
    from taskgraph.dag.routing import trace_from_json
    from taskgraph.errors import TgError

    with pytest.raises(TgError, match=re.escape(words)):
        trace_from_json(text, "workload.routing.trace 't.json'")


def test_a_traces_memory_is_a_small_multiple_of_its_text():
    """Issue 40 point 6: a 120 MB trace took 2.7 GB (its nested lists, ~22x). Read step by step
    into 2-byte ids, the reader's peak allocation is under the text's own size (the arrays a
    third of it), wherever tracemalloc counts it."""
    import tracemalloc

    from taskgraph.dag.routing import trace_from_json

    text = json.dumps(_trace_doc(L=16, tokens=64, steps=60), separators=(",", ":"))
    tracemalloc.start()
    try:
        trace = trace_from_json(text, "t")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert trace.experts[0].dtype == np.int16
    assert peak < len(text), (peak, len(text))
