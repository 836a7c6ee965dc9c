"""EP's experts placed across layers as the tools write it (taskgraph.placement): Fiddler's
budget by popularity, llama.cpp's --n-cpu-moe and -ot. The forms against llama.cpp's own
expansion of its options, the budget against a brute-force ranking of (layer, expert) pairs,
a whole-layer split priced layer by layer (not as a mean layer), the memory model, the search,
and bad input. The executor's side is tests/test_expert_exec.py's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from taskgraph import api
from taskgraph.dag.builder import make_plan
from taskgraph.dag.routing import Routing
from taskgraph.errors import TgError
from taskgraph.perf.memory import memory_footprint
from taskgraph.placement import cpu_layers_of_overrides, llama_cpp_options
from taskgraph.scenario import load_scenario
from taskgraph.sim.simulate import simulate_scenario

TINY = "scenarios/tiny.yaml"            # 4 layers, E = 8
# Mixtral 8x7B at batch 1 on a T4 whose memory holds every expert, so any placement fits
BIG_T4 = ["schedule=EP", "policy.N=1", "policy.mu=1", "policy.r_w=1", "policy.r_c=1",
          "workload.gen_len=8", "hardware.gpu.memory_gb=400"]


def _n_cpu_moe_as_llama_cpp_writes_it(n: int) -> list[str]:
    """llama.cpp's --n-cpu-moe N as common/arg.cpp expands it: one tensor override a layer
    below N, blk\\.i\\.ffn_(up|down|gate)_exps to the CPU."""
    return [rf"blk\.{i}\.ffn_(up|down|gate)_exps=CPU" for i in range(n)]


def _per_layer(sets: list[str], base: str = TINY) -> list[int]:
    plan = make_plan(load_scenario(base, ["schedule=EP", *sets]))
    return [len(row) for row in plan.held]


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_n_cpu_moe_is_llama_cpps_own_tensor_overrides(n):
    ours = _per_layer([f"policy.cpu_moe={n}"])
    assert ours == [0] * n + [8] * (4 - n)
    if n:
        theirs = _per_layer(["policy.override_tensor=" + ",".join(
            _n_cpu_moe_as_llama_cpp_writes_it(n))])
        assert theirs == ours


def test_cpu_moe_flag_is_every_expert_on_the_cpu():
    # llama.cpp's --cpu-moe: \.ffn_(up|down|gate)_exps=CPU
    assert _per_layer([r"policy.override_tensor=\.ffn_(up|down|gate)_exps=CPU"]) == [0] * 4
    assert llama_cpp_options([0] * 4, load_scenario(TINY).model)[0] == "-ngl 99 --cpu-moe"


def test_a_first_matching_pattern_wins_as_in_llama_cpp():
    # layer 1's experts matched first by a CUDA0 rule stay on the GPU
    sets = [r"policy.override_tensor=blk\.1\.ffn_.*=CUDA0,ffn_.*_exps=CPU"]
    assert _per_layer(sets) == [0, 8, 0, 0]


def test_the_options_printed_for_a_placement_place_it_again():
    """llama_cpp_options writes -ot for any set of whole layers; read back, the same layers."""
    model = load_scenario(TINY).model
    for per_layer in ([0, 8, 0, 8], [8, 0, 8, 8], [0, 0, 8, 8], [8] * 4):
        options, _ = llama_cpp_options(per_layer, model)
        match = re.search(r"-ot '([^']+)'", options)
        n_cpu = re.search(r"--n-cpu-moe (\d+)", options)
        if match:
            again = _per_layer([f"policy.override_tensor={match.group(1)}"])
        elif n_cpu:
            again = _per_layer([f"policy.cpu_moe={n_cpu.group(1)}"])
        else:
            assert options == "-ngl 99"
            again = [8] * 4
        assert again == per_layer, options
    options, why = llama_cpp_options([2, 2, 1, 1], model)
    assert options is None and "whole" in why


def test_a_budget_goes_to_the_most_popular_layer_expert_pairs(tmp_path):
    """Fiddler's placement: with a recorded routing whose layers differ, the budget's experts
    are the top pairs of a brute-force ranking of every (layer, expert) by how often tokens
    chose it; a layer whose router always picks the same two gets them first."""
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(6):
        step = np.stack([np.argsort(rng.random((3, 8)), axis=1)[:, :2] for _ in range(4)])
        step[0] = [0, 1]                                    # layer 0 always picks 0 and 1
        steps.append(step.tolist())
    trace = tmp_path / "routing.json"
    trace.write_text(json.dumps({"format": "tg-routing/1", "E": 8, "k": 2, "L": 4,
                                 "steps": steps}))
    sets = ["workload.routing.kind=trace", f"workload.routing.trace={trace}"]
    for budget in (2, 5, 13):
        sc = load_scenario(TINY, ["schedule=EP", f"policy.experts_total={budget}", *sets])
        routing = Routing.of(sc)
        held = routing.held(sc.policy, sc.model)
        chosen = {(l, int(e)) for l, row in enumerate(held) for e in row}
        counts = np.zeros((4, 8))
        for step in steps:
            for l, layer in enumerate(step):
                for token in layer:
                    for e in token:
                        counts[l, e] += 1
        assert len(chosen) == budget
        weakest_kept = min(counts[l, e] for l, e in chosen)
        strongest_left = max(counts[l, e] for l in range(4) for e in range(8)
                             if (l, e) not in chosen)
        assert weakest_kept >= strongest_left
        assert {(0, 0), (0, 1)} <= chosen


def test_an_even_budget_is_experts_gpu_on_every_layer():
    per_layer = simulate_scenario(load_scenario("t4", [*BIG_T4, "policy.experts_gpu=3"]))
    budget = simulate_scenario(load_scenario("t4", [*BIG_T4, "policy.experts_total=96"]))
    assert budget.summary["throughput_tok_s"] == per_layer.summary["throughput_tok_s"]
    assert budget.summary["experts"]["on_gpu_by_layer"] == [3] * 32


def test_a_whole_layer_split_is_priced_layer_by_layer():
    """--n-cpu-moe 12 runs 12 layers with every expert on the CPU and 20 with every expert on
    the GPU: its decode step is 12/32 of the all-CPU one's plus 20/32 of the all-GPU one's.
    Priced as 32 mean layers (each with 5/8 of its experts on the GPU, the CPU's 3/8 beside
    them) it would be faster than that: the check fails if layers are averaged."""
    def token_ms(sets):
        return simulate_scenario(load_scenario("t4", [*BIG_T4, *sets])).summary[
            "token_latency_ms"]
    cpu, gpu = token_ms(["policy.experts_gpu=0"]), token_ms(["policy.experts_gpu=8"])
    split = token_ms(["policy.cpu_moe=12"])
    assert split == pytest.approx((12 * cpu + 20 * gpu) / 32, rel=0.02)
    assert token_ms(["policy.experts_gpu=5"]) < 0.9 * split       # the mean layer differs


def test_memory_counts_the_placed_experts_once():
    sc = load_scenario("t4", [*BIG_T4, "policy.cpu_moe=20"])
    m = sc.model
    report = memory_footprint(make_plan(sc))
    assert report.gpu["experts placed on the GPU (cpu_moe)"] == 12 * m.E * m.expert_bytes
    assert report.cpu["experts (FFN on the CPU)"] == 20 * m.E * m.expert_bytes


def test_a_placement_that_does_not_fit_says_which_way_to_move_it():
    sc = load_scenario("t4", [*BIG_T4[:-1], "policy.cpu_moe=27"])    # a 16 GB T4; 28 fits
    with pytest.raises(Exception, match=r"Raise policy\.cpu_moe \(more layers' experts on the "
                                        r"CPU\); lower policy\.r_w"):
        simulate_scenario(sc)
    sc = load_scenario("t4", [*BIG_T4[:-1], "policy.experts_total=200"])
    with pytest.raises(Exception, match=r"Lower policy\.experts_total, policy\.r_w"):
        simulate_scenario(sc)


def test_a_pattern_an_earlier_one_shadows_is_taken_as_llama_cpp_takes_it():
    assert _per_layer(["policy.override_tensor=exps=CPU,exps=CUDA0"]) == [0] * 4


def test_two_placements_set_in_one_command_are_refused():
    with pytest.raises(TgError, match="each place EP's experts; give one"):
        load_scenario(TINY, ["schedule=EP", "policy.cpu_moe=1", "policy.experts_total=3"])


def test_validate_prices_a_budget_on_the_runs_own_routing():
    """tg validate simulates a run on its recorded routing with the experts the run kept: a
    budget the run spread one way is not spread again (it was refused as a mismatch)."""
    pytest.importorskip("torch")
    result = api.validate(TINY, schedules=["EP"], device="cpu", repeats=1,
                          overrides={"policy.experts_total": 5})
    pairs = result.to_dict()["pairs"]
    assert pairs and all(p["simulated"]["experts"]["on_gpu"] == 5 for p in pairs)


def test_the_search_places_experts_across_layers_and_its_pick_runs():
    """At batch 1 on a T4 the search prices Fiddler's and llama.cpp's placements beside a count
    per layer, picks the fastest, and its `Run it` options simulate to the figure it shows."""
    result = api.search("t4", batch=1)
    ways = {next((k for k in ("experts_total", "cpu_moe") if k in c.policy), "experts_gpu")
            for c in result.priced if c.schedule == "EP"}
    assert ways == {"experts_gpu", "experts_total", "cpu_moe"}
    best = max(result.priced, key=lambda c: c.tok_s)
    assert result.best.tok_s == best.tok_s
    again = api.simulate("t4", overrides=_sets(result.best.run_with()))
    assert again.summary["throughput_tok_s"] == pytest.approx(result.best.tok_s, rel=1e-3)


def _sets(run_with: str) -> list[str]:
    import shlex
    words = shlex.split(run_with)
    return [f"schedule={words[1]}"] + [words[i + 1] for i, w in enumerate(words) if w == "--set"]


@pytest.mark.parametrize("sets,field", [
    (["policy.experts_total=33"], "policy.experts_total"),                 # 4 x 8 experts
    (["policy.cpu_moe=5"], "policy.cpu_moe"),                              # 4 layers
    (["policy.override_tensor=blk\\.9\\.ffn_up_exps=CPU"], "matches no tensor"),
    (["policy.override_tensor=blk\\.1\\.ffn_up_exps=CPU"], "whole"),
    (["policy.override_tensor=attn_q=CPU"], "attn_q"),
    (["policy.override_tensor=exps=CUDA1"], "CUDA1"),
    (["policy.override_tensor=blk\\.(1=CPU"], "not a regular expression"),
    (["policy.override_tensor=exps"], "PATTERN=BUFFER"),
    # nested repeats: '([a-z_.0-9]+)+X' took hours on a 40-character name (never run here)
    (["policy.override_tensor=(b+)+x=CPU"], "repeats a repeat"),
    (["policy.override_tensor=blk\\.(1|2+)*\\.ffn_.*_exps=CPU"], "repeats a repeat"),
    # alternatives that begin alike under a repeat: '(a|a)*b' took 2.6 s on 24 characters
    (["policy.override_tensor=(a|a)*b=CPU"], "repeats a repeat"),
    (["policy.override_tensor=blk\\.(1|1[0-9])+\\.ffn=CPU"], "begin alike"),
])
def test_bad_placements_are_refused_naming_the_field(sets, field):
    with pytest.raises(TgError, match=re.escape(field)):
        load_scenario(TINY, ["schedule=EP", *sets])


@pytest.mark.parametrize("pattern", [
    "blk\\.(1|3)\\.ffn_(gate|up|down)_exps\\.weight", "blk\\.[0-9]+\\.ffn_.*_exps",
    "blk\\.([0-9]|1[0-5])\\.ffn_(up|down|gate)_exps", "(0|1|2)+", "(ab|cd)*"])
def test_the_patterns_llama_cpp_users_write_are_not_taken_for_slow_ones(pattern):
    from taskgraph.placement import parse_overrides

    assert len(parse_overrides([f"{pattern}=CPU"])) == 1


def test_two_placements_in_a_file_are_refused_and_a_set_replaces_the_files(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("model: tiny\nhardware: t4\nworkload: {prompt_len: 16, gen_len: 4}\n"
                    "schedule: EP\npolicy: {N: 1, mu: 1, cpu_moe: 1, experts_total: 3}\n")
    with pytest.raises(TgError, match="experts_total and cpu_moe each place the experts"):
        load_scenario(path)
    path.write_text(path.read_text().replace(", experts_total: 3", ""))
    sc = load_scenario(path, ["policy.experts_total=3"])       # replaces the file's cpu_moe
    assert (sc.policy.cpu_moe, sc.policy.experts_total) == (None, 3)


def test_a_cache_refuses_a_placement_it_would_ignore():
    with pytest.raises(Exception, match="applies to EP"):
        simulate_scenario(load_scenario(TINY, ["schedule=EC", "policy.cpu_moe=1"]))


def test_the_cli_shows_the_llama_cpp_options_and_refuses_bad_input():
    run = [sys.executable, "-m", "taskgraph.cli", "simulate", TINY, "--schedule", "EP"]
    ok = subprocess.run([*run, "--set", "policy.cpu_moe=2"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "--n-cpu-moe 2" in " ".join(ok.stdout.split())
    bad = subprocess.run([*run, "--set", "policy.cpu_moe=9"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "policy.cpu_moe" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_deepseeks_dense_layers_and_shared_experts_as_llama_cpp_counts_them():
    """DeepSeek-V3's layers 0-2 are dense: --n-cpu-moe 5 (llama.cpp counts every layer) puts
    the routed experts of layers 3 and 4 on the CPU, and the printed options say so again. Its
    shared experts (ffn_*_shexp) are not routed ones: a pattern sending them to the CPU is
    refused."""
    sc = load_scenario("t4", ["model=deepseek-v3", "schedule=EP", "policy.N=1", "policy.mu=1",
                              "policy.cpu_moe=5"])
    per_layer = [len(row) for row in make_plan(sc).held]
    assert per_layer[:5] == [0] * 5 and set(per_layer[5:]) == {256}
    assert llama_cpp_options(per_layer, sc.model)[0] == "-ngl 99 --n-cpu-moe 5"
    # (a pattern for a dense layer matches no tensor, which tg refuses as a likely mistake)
    assert cpu_layers_of_overrides(_n_cpu_moe_as_llama_cpp_writes_it(5)[3:],
                                   sc.model) == {3, 4}
    with pytest.raises(ValueError, match="shexp"):
        cpu_layers_of_overrides([r"shexp=CPU"], sc.model)


def test_compare_across_batch_sizes_places_ep_as_the_scenario_does():
    """`compare --batch-sizes` chose experts_gpu for EP whatever the scenario said; a
    scenario placing whole layers (llama.cpp's --n-cpu-moe) now gets the fewest CPU layers
    that fit at each batch size, and EC, which caches experts, keeps experts_gpu."""
    rows = api.crossover("scenarios/gpt-oss-120b-4090.yaml", ["EP", "EC"], [1, 4],
                         overrides={"policy.cpu_moe": 20}).rows
    ep = [r for r in rows if r["schedule"] == "EP"]
    ec = [r for r in rows if r["schedule"] == "EC"]
    assert all("cpu_moe" in r["policy"] and "experts_gpu" not in r["policy"] for r in ep)
    assert all(r["experts"]["llama_cpp"].endswith(f"--n-cpu-moe {r['policy']['cpu_moe']}")
               for r in ep)
    assert all(r["policy"]["experts_gpu"] > 0 for r in ec)
    # the fewest CPU layers: one fewer does not fit
    for r in ep:
        fewer = {**r["policy"], "cpu_moe": r["policy"]["cpu_moe"] - 1}
        with pytest.raises(TgError, match="does not fit in GPU memory"):
            simulate_scenario(load_scenario("scenarios/gpt-oss-120b-4090.yaml", [
                f"policy={json.dumps(fewer)}", "schedule=EP"]))
