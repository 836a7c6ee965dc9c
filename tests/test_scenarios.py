"""Scenario loading: presets, Hugging Face configs, overrides, and one clear error per bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from taskgraph import presets
from taskgraph.dag.builder import make_plan
from taskgraph.cli import main
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.sim.simulate import simulate_scenario
from taskgraph.scenario import for_schedule, load_scenario
from tests.helpers import TINY

ROOT = Path(__file__).resolve().parent.parent

SCENARIOS = sorted(Path("scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenarios_fit_and_run(path):
    sc = load_scenario(path)
    check_fits(memory_footprint(make_plan(sc)), sc.schedule)
    short = load_scenario(path, ["workload.gen_len=2", "model.L=2"])
    assert simulate_scenario(short).summary["throughput_tok_s"] > 0


def test_t4_is_the_paper_setting():
    sc = load_scenario("scenarios/t4.yaml")
    assert (sc.model.name, sc.hardware.gpu.name, sc.schedule) == ("mixtral-8x7b", "T4", "S1")
    assert (sc.policy.mu, sc.policy.N, sc.workload.gen_len) == (36, 504, 128)
    assert (sc.workload.prompt_len, sc.workload.max_prompt_len) == (77, 418)


@pytest.mark.parametrize("name", presets.HARDWARE)
def test_every_hardware_preset_runs_a_scenario(name, tmp_path):
    """Each machine preset loads and simulates (a figure missing or out of range would be a
    load error, a resource with no rate an infinite run)."""
    doc = dict(TINY, hardware=name)
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(doc))
    sc = load_scenario(path)
    schedule = "S1" if sc.hardware.gpu.count == 1 else "S4"
    s = simulate_scenario(for_schedule(sc, schedule)[0], schedule).summary
    assert 0 < s["throughput_tok_s"] <= s["hardware_limit_tok_s"]


def test_presets_match_the_public_configs():
    assert presets.MODELS["mixtral-8x22b"]["h"] == 6144 and presets.MODELS["dbrx"]["E"] == 16
    assert presets.HARDWARE["4xt4"]["gpu"]["count"] == 4
    assert presets.HARDWARE["h200"]["gpu"]["memory_gb"] == 141


def test_overrides_and_preset_mappings(tmp_path):
    sc = load_scenario("scenarios/t4.yaml", ["policy.mu=24", "hardware.link.h2d_gbps=25",
                                             "model.L=4", "workload.padded=true"])
    assert sc.policy.mu == 24 and sc.hardware.link.h2d_gbps == 25 and sc.model.L == 4
    assert sc.model.h == 4096            # the rest of the preset stays
    assert sc.workload.context_prompt == 418


def _config(tmp_path, **fields):
    cfg = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "num_experts_per_tok": 2, "vocab_size": 32000, **fields}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_model_from_hugging_face_config(tmp_path):
    path = _config(tmp_path, num_hidden_layers=2)
    doc = dict(TINY, model={"hf_config": str(path)})
    scen = tmp_path / "s.yaml"
    scen.write_text(json.dumps(doc))
    m = load_scenario(scen).model
    assert (m.h, m.h_i, m.L, m.n_kv, m.E, m.k) == (4096, 14336, 2, 8, 8, 2)
    dbrx = {"d_model": 6144, "n_layers": 40, "n_heads": 48, "vocab_size": 100352,
            "attn_config": {"kv_n_heads": 8, "rope_theta": 500000},
            "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}}
    (tmp_path / "dbrx.json").write_text(json.dumps(dbrx))
    scen.write_text(json.dumps(dict(TINY, model="dbrx.json")))
    got = load_scenario(scen).model.model_dump(exclude={"name"}, exclude_defaults=True)
    assert got == {k: v for k, v in presets.MODELS["dbrx"].items() if k != "name"}


def _run(capsys, *argv):
    rc = main(["simulate", *argv])
    err = capsys.readouterr().err
    return rc, err


def _scenario(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


BAD = [
    # (what, scenario text or None for a missing file, overrides, words the error must contain)
    ("missing file", None, [], ["does not exist"]),
    ("malformed YAML", "model: [unclosed\n", [], ["not valid YAML", "line"]),
    ("not a mapping", "- 1\n- 2\n", [], ["must be a YAML mapping"]),
    ("unknown section", None, ["colour=red"], ["unknown section 'colour'"]),
    ("unknown key", None, ["policy.nu=3"], ["policy.nu", "unknown key", "known keys"]),
    ("wrong type", None, ["policy.mu=lots"], ["policy.mu", "integer"]),
    ("negative size", None, ["workload.gen_len=-4"], ["workload.gen_len", "greater than 0"]),
    ("zero size", None, ["model.h=0"], ["model.h", "greater than 0"]),
    ("mu > N", None, ["policy.mu=16"], ["policy.mu", "exceeds N"]),
    ("N not a multiple", None, ["policy.N=7"], ["policy.mu", "multiple"]),
    ("fraction out of range", None, ["policy.r_w=1.5"], ["policy.r_w", "less than or equal"]),
    ("unknown preset", None, ["model=mixtral-9x9b"], ["mixtral-9x9b", "known models"]),
    ("unknown schedule", None, ["schedule=S9"], ["S9", "known schedules"]),
    ("GPU memory", None, ["model=mixtral-8x7b", "policy.r_w=0.9"], ["GPU memory", "over"]),
    ("CPU memory", None, ["model=mixtral-8x7b", "policy.N=40000", "policy.mu=400"],
     ["CPU memory", "KV cache"]),
    ("attention placement", None, ["policy.A_g=1"], ["policy.A_g", "S4"]),
    ("FFN on CPU", None, ["policy.F_g=0"], ["policy.F_g"]),
    ("KV on GPU with CPU attention", None, ["policy.r_c=0.5"], ["policy.r_c"]),
    ("CGOPipe with one micro-batch", None, ["policy.mu=8"], ["at least 2 micro-batches"]),
    ("bad override syntax", None, ["policy.mu"], ["key.path=value"]),
]


@pytest.mark.parametrize("what,text,overrides,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gives_one_clear_error(capsys, tmp_path, what, text, overrides, words):
    if what == "missing file":
        path = str(tmp_path / "nope.yaml")
    else:
        path = _scenario(tmp_path, text if text is not None else json.dumps(TINY))
    argv = [path]
    for o in overrides:
        argv += ["--set", o]
    rc, err = _run(capsys, *argv)
    assert rc != 0
    assert "Traceback" not in err
    assert err.count("\n") == 1, f"expected one paragraph, got:\n{err}"
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"


@pytest.mark.parametrize("argv", [["--schedule", "S4"], ["--set", "schedule=S4"],
                                  ["--schedule", "S4", "--set", "policy.r_c=0.5"]])
def test_a_schedule_chosen_on_the_command_line_sets_its_placement(capsys, argv):
    """tiny.yaml says S1 with A_g: 0; choosing S4 moves attention (and with r_c the KV) to the
    GPU without being told."""
    assert main(["simulate", "scenarios/tiny.yaml", "--json", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "S4" and out["policy"]["A_g"] == 1
    assert out["policy"]["r_c"] == (0.5 if "policy.r_c=0.5" in argv else 0.0)


@pytest.mark.parametrize("argv, words", [
    (["--schedule", "S4", "--set", "policy.A_g=0"], ["--set policy.A_g=0", "S4", "S1, S2, S3"]),
    (["--set", "policy.A_g=1"], ["--set policy.A_g=1", "schedule S1", "(S4, DS, S5, PP, EP, EC, ECP)"]),
    (["--schedule", "S1", "--set", "policy.r_c=0.25"], ["--set policy.r_c=0.25", "KV cache"]),
])
def test_an_explicit_conflicting_set_names_both(capsys, argv, words):
    assert main(["simulate", "scenarios/tiny.yaml", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_a_file_that_contradicts_its_own_schedule_is_refused(tmp_path, capsys):
    doc = dict(TINY, schedule="S4", policy=dict(TINY["policy"], A_g=0))
    path = _scenario(tmp_path, json.dumps(doc))
    assert main(["simulate", path]) == 2
    err = capsys.readouterr().err
    assert f"policy.A_g=0 in {path}" in err and "S4" in err
    # ... unless the command line chooses the schedule, which the file's policy does not bind.
    assert main(["simulate", path, "--schedule", "S1"]) == 0


def test_compare_and_execute_place_each_schedule(capsys):
    assert main(["compare", "scenarios/tiny.yaml", "--json"]) == 0
    placed = {r["schedule"]: r["policy"]["A_g"] for r in json.loads(capsys.readouterr().out)["results"]}
    # at N = 8 the expert-level schedules, made for small batches, are compared too
    assert placed == {"S1": 0, "S2": 0, "S3": 0, "S4": 1, "DS": 1, "S5": 1, "EP": 1, "EC": 1,
                      "ECP": 1}
    # A --set binds every schedule compared: r_c on the GPU suits S4 alone.
    assert main(["compare", "scenarios/tiny.yaml", "--schedules", "S4",
                 "--set", "policy.r_c=0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["policy"]["r_c"] == 0.5
    assert main(["compare", "scenarios/tiny.yaml", "--set", "policy.r_c=0.5"]) == 2


def test_bad_cli_values(capsys, tmp_path):
    assert main(["compare", "scenarios/tiny.yaml", "--schedules", "S1,S7"]) == 2
    assert "S7" in capsys.readouterr().err
    assert main(["simulate", "scenarios/tiny.yaml", "--trace", str(tmp_path / "t.json"),
                 "--trace-steps", "some"]) == 2
    assert "--trace-steps" in capsys.readouterr().err
    assert main(["graph", "scenarios/tiny.yaml", "--out", str(tmp_path / "g.png")]) == 2
    assert ".dot" in capsys.readouterr().err
    assert main(["compare", "scenarios/tiny.yaml", "--check"]) == 2
    assert "expect" in capsys.readouterr().err


def test_a_shipped_scenario_is_found_by_its_name_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "t4", "--json"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    monkeypatch.chdir(ROOT)
    assert main(["simulate", "scenarios/t4.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["throughput_tok_s"] == by_name["throughput_tok_s"]
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "t5"]) == 2
    err = capsys.readouterr().err
    assert "'t5' does not exist" in err and "t4, tiny" in err and "tg catalog" in err
    # a file here of that name is read, not the shipped one
    (tmp_path / "t4.yaml").write_text("model: tiny\nhardware: t4\nworkload: {prompt_len: 8, "
                                      "gen_len: 2}\npolicy: {N: 4, mu: 2}\n")
    assert main(["simulate", "t4.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny"


def test_the_catalog_lists_every_preset_and_shipped_scenario(capsys):
    from taskgraph.dag.schedules import SCHEDULES

    assert main(["catalog", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert list(found["models"]) == list(presets.MODELS)
    assert set(found["machines"]) == set(presets.HARDWARE) | {"local"}
    assert list(found["schedules"]) == list(SCHEDULES)
    assert list(found["implementations"]) == list(presets.IMPLEMENTATIONS)
    assert found["implementations"]["flexgen"].endswith("the default of S3, S4, PP")
    assert set(found["scenarios"]) == {p.stem for p in (ROOT / "scenarios").glob("*.yaml")}
    assert "Mixtral 8x7B on one T4" in found["scenarios"]["t4"]
    assert found["models"]["deepseek-v3"] == "deepseek_v3, 61 layers, h=7168, 256 experts, top-8"
    assert main(["catalog"]) == 0
    shown = capsys.readouterr().out
    assert "models (14)" in shown and "gpt-oss-120b-4090" in shown


@pytest.mark.parametrize("override, words", [
    ("workload.gen_lenn=5", "workload.gen_lenn: unknown key, did you mean 'gen_len'? (known "
                            "keys: preset, prompt_len"),
    ("workload.preset=mtbnch", "workload 'mtbnch' is not a preset, did you mean 'mtbench'?"),
    ("polcy.mu=5", "unknown section 'polcy', did you mean 'policy'?"),
    ("hardware=t5", "hardware 't5' is not a preset; known machines: t4,"),
])
def test_a_near_miss_is_named_once_quoted(override, words, capsys):
    assert main(["simulate", "t4", "--set", override]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert words in err and "''" not in err
