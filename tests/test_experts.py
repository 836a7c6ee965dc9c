"""Which experts a batch touches (taskgraph.dag.routing) and the expert-level schedules (EP, EC):
the closed forms against draws made another way (numpy's own sampler), the large-batch numbers
unchanged, the small-batch ones where the experts' bytes say they must be, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from taskgraph.dag.routing import Routing
from taskgraph.scenario import for_schedule, load_scenario
from taskgraph.sim.simulate import simulate_scenario
from taskgraph.specs import PREFETCH_PUBLISHED

T4 = "scenarios/t4.yaml"
TINY = "scenarios/tiny.yaml"
A5000 = "scenarios/small-batch/a5000.yaml"


def _draws(p: np.ndarray, k: int, tokens: int, trials: int, seed: int) -> np.ndarray:
    """Distinct experts `tokens` tokens touch, in `trials` trials, each token's k experts drawn
    without replacement in proportion to p by numpy's Generator.choice (not the Gumbel top-k
    the code uses)."""
    rng = np.random.default_rng(seed)
    out = np.empty(trials)
    for i in range(trials):
        seen = set()
        for _ in range(tokens):
            seen.update(rng.choice(len(p), size=k, replace=False, p=p).tolist())
        out[i] = len(seen)
    return out


@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 32])
def test_uniform_distinct_experts_mean_and_spread_match_draws(tokens):
    sc = load_scenario(T4)                     # Mixtral: 2 of 8
    routing = Routing.of(sc)
    d = _draws(np.full(8, 1 / 8), 2, tokens, 4000, seed=tokens)
    assert routing.distinct(tokens) == pytest.approx(d.mean(), abs=4 * d.std() / 63 + 1e-9)
    assert routing.distinct_std(tokens) == pytest.approx(d.std(), abs=0.05)
    assert routing.distinct(1) == 2.0 and routing.distinct(10_000) == pytest.approx(8.0)


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_skewed_distinct_experts_match_draws(tokens):
    sc = load_scenario(T4, ["workload.routing.kind=skewed", "workload.routing.zipf=1.2"])
    routing = Routing.of(sc)
    p = np.arange(1, 9, dtype=float) ** -1.2
    d = _draws(p / p.sum(), 2, tokens, 4000, seed=100 + tokens)
    assert routing.distinct(tokens) == pytest.approx(d.mean(), abs=4 * d.std() / 63 + 0.01)
    # skew makes a batch touch fewer experts than uniform routing does
    if tokens > 1:
        assert routing.distinct(tokens) < Routing.of(load_scenario(T4)).distinct(tokens)


def test_an_lru_cache_of_c_experts_hits_c_of_e_under_uniform_routing():
    """At batch 1 under uniform routing each chosen expert is any of E alike, so whatever the
    cache holds, c of E of them are in it."""
    routing = Routing.of(load_scenario(T4))
    for c in (2, 4, 6):
        assert np.mean(routing.cache_hits(1, c, "lru")) == pytest.approx(c / 8, abs=0.03)
    assert np.all(routing.cache_hits(1, 8, "lru") == 1.0)
    assert np.all(routing.cache_hits(1, 0, "lru") == 0.0)


def test_a_cache_of_the_most_popular_experts_hits_their_share():
    sc = load_scenario(T4, ["workload.routing.kind=skewed",
                            "workload.routing.popularity=[8,4,2,1,1,1,1,1]"])
    routing = Routing.of(sc)
    # at batch 1 a popular cache of c holds each chosen expert with the top c's share of the
    # token-expert pairs
    share, on_gpu, on_cpu = routing.split(1, routing.on_gpu(routing.popular(3)))
    assert np.mean(routing.cache_hits(1, 3, "popular")) == pytest.approx(share, abs=0.03)
    assert on_gpu + on_cpu == pytest.approx(routing.distinct(1))
    assert share == pytest.approx(np.sort(routing.q[0])[::-1][:3].sum() / 2)


@pytest.mark.parametrize("schedule", ["S1", "S2", "S3", "S4"])
def test_at_large_batches_the_routing_changes_nothing(schedule):
    """CGOPipe and FlexGen batches touch every expert whatever the routing: a skewed router
    moves their throughput by under 0.1%."""
    base = ["workload.gen_len=4"]
    uniform = _run(schedule, base)
    skewed = _run(schedule, base + ["workload.routing.kind=skewed", "workload.routing.zipf=1.0"])
    assert skewed["throughput_tok_s"] == pytest.approx(uniform["throughput_tok_s"], rel=1e-3)


def _run(schedule: str, sets: list[str], path: str = T4) -> dict:
    sc = for_schedule(load_scenario(path, [f"schedule={schedule}", *sets]), schedule)[0]
    return simulate_scenario(sc, schedule).summary


def _small(schedule: str, *more: str) -> dict:
    return _run(schedule, ["policy.N=1", "policy.mu=1", "workload.gen_len=8", *more])


def test_at_batch_1_an_expert_cache_is_bound_by_its_misses_on_the_link():
    """EC at batch 1 with no cache copies both chosen experts of every layer: a decode layer
    takes at least their bytes over the link, and a cache of c experts saves c/8 of that."""
    sc = load_scenario(T4)
    m, link = sc.model, sc.hardware.link.h2d_gbps * 1e9        # the peak: a lower bound
    cold = _small("EC", "policy.experts_gpu=0")
    assert cold["decode_layer_ms"] >= 2 * m.expert_bytes / link * 1e3
    assert cold["experts"]["hit_rate"] == 0.0 and cold["bound_by"]["decode"] == "h2d"
    warm = _small("EC", "policy.experts_gpu=1")
    assert warm["experts"]["hit_rate"] == pytest.approx(1 / 8, abs=0.03)
    assert warm["decode_layer_ms"] < cold["decode_layer_ms"]


def test_at_batch_1_placed_experts_run_on_the_cpu_at_its_memory_bandwidth():
    """EP with nothing placed reads both chosen experts from host memory on the CPU."""
    sc = load_scenario(T4)
    m, cpu = sc.model, sc.hardware.cpu
    s = _small("EP", "policy.experts_gpu=0")
    assert s["bound_by"]["decode"] == "cpu"
    assert s["decode_layer_ms"] >= 2 * m.expert_bytes / (cpu.mem_gbps * 1e9) * 1e3
    assert s["experts"]["gpu_share"] == 0.0


def test_cgopipe_wins_at_its_batch_and_expert_offloading_at_batch_1():
    """The crossover exists on t4: at batch 1 running experts where they lie (EP) beats
    streaming every layer's weights (S1, S4); at CGOPipe's own batch it is the other way."""
    small = {s: _small(s, "policy.experts_gpu=0")["token_latency_ms"] for s in ("EP",)}
    small["S4"] = _small("S4")["token_latency_ms"]
    assert small["EP"] < small["S4"] / 5
    s1 = _run("S1", ["workload.gen_len=4"])["throughput_tok_s"]
    ep = _run("EP", ["workload.gen_len=4"])["throughput_tok_s"]
    assert s1 > 1.5 * ep


def _tg(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "taskgraph.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("sets, field", [
    (["workload.routing.kind=skewed", "workload.routing.popularity=[1,2,3]"],
     "popularity"),
    (["workload.routing.kind=skewed"], "popularity"),
    (["workload.routing.kind=uniform", "workload.routing.zipf=1"], "zipf"),
    (["workload.routing.kind=trace"], "trace"),
    (["policy.experts_gpu=99"], "experts_gpu"),
])
def test_bad_routing_and_expert_fields_are_one_clear_error(sets, field):
    run = _tg("simulate", TINY, "--schedule", "EC", *[a for s in sets for a in ("--set", s)])
    assert run.returncode == 2, run.stderr
    assert field in run.stderr and "Traceback" not in run.stderr


def test_a_cache_larger_than_gpu_memory_names_the_field():
    run = _tg("simulate", T4, "--schedule", "EC", "--set", "policy.N=1", "--set", "policy.mu=1",
              "--set", "policy.experts_gpu=8")
    assert run.returncode == 2 and "GPU memory" in run.stderr, run.stderr
    assert "policy.experts_gpu" in run.stderr and "Traceback" not in run.stderr


def test_a_routing_trace_of_another_model_is_refused(tmp_path):
    sc = load_scenario(TINY)
    m = sc.model
    steps = [np.tile(np.arange(m.k), (m.L, 3, 1)).tolist()] * 2
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"format": "tg-routing/1", "E": m.E + 1, "k": m.k, "L": m.L,
                               "steps": steps}))
    run = _tg("simulate", TINY, "--set", "workload.routing.kind=trace", "--set",
              f"workload.routing.trace={bad}")
    assert run.returncode == 2 and "workload.routing.trace" in run.stderr, run.stderr
    assert f"E = {m.E + 1}" in run.stderr and "Traceback" not in run.stderr


def test_across_batch_sizes_expert_offloading_wins_small_and_cgopipe_large(tmp_path):
    """tg compare --batch-sizes on t4: every point at a policy that fits, an expert-level
    schedule best at batch 1, CGOPipe best at its own batch, and the crossover between."""
    from taskgraph import crossover
    from taskgraph.perf.memory import check_fits, memory_footprint
    from taskgraph.dag.builder import make_plan
    from taskgraph.study.crossover import EXPERT_LEVEL, policy_for
    from tests.helpers import assert_drawn

    c = crossover(T4, ["S1", "S4", "EP", "EC"], [1, 16, 504])
    assert len(c.rows) == 12
    assert c.best(1, c.schedules)["schedule"] in EXPERT_LEVEL
    assert c.best(504, c.schedules)["schedule"] == "S1"
    assert 1 < c.crossover["N"] <= 504
    sc = load_scenario(T4)
    assert [r["N"] for r in c.rows if "error" in r] == [1]       # S1 needs two sequences
    for r in (r for r in c.rows if "error" not in r):
        placed = policy_for(sc, r["schedule"], r["N"])
        assert placed.policy.N == r["N"]
        check_fits(memory_footprint(make_plan(placed, r["schedule"])), r["schedule"])
    assert json.loads(json.dumps(c.to_dict()))["crossover"]["N"] == c.crossover["N"]
    assert_drawn(c.plot(tmp_path / "x.png"))


def test_the_greedy_policy_fills_the_gpu_with_experts():
    """At batch 1 on a 24 GB L4, one expert a layer (11.3 GB) fits beside the rest, two do not:
    the greedy choice takes exactly one."""
    from taskgraph.study.crossover import policy_for

    sc = policy_for(load_scenario("scenarios/l4.yaml"), "EC", 1)
    assert (sc.policy.r_w, sc.policy.r_c, sc.policy.experts_gpu) == (1.0, 1.0, 1)


def _published() -> list[dict]:
    import yaml
    from pathlib import Path

    return yaml.safe_load(Path("scenarios/small-batch/published.yaml").read_text())


@pytest.mark.parametrize("entry", [e for e in _published() if e.get("tolerance")
                                   or e.get("at_least_tok_s")], ids=lambda e: e["system"][:40])
def test_published_batch_1_figures_are_reproduced_within_the_stated_tolerance(entry):
    """docs/experts.md's table: each system's published batch-1 figure against the schedule
    that models it, on a datasheet machine (nothing fitted to these figures)."""
    sc = load_scenario(f"scenarios/small-batch/{entry['scenario']}")
    s = simulate_scenario(for_schedule(sc, entry["schedule"])[0], entry["schedule"]).summary
    if "at_least_tok_s" in entry:
        assert s["throughput_tok_s"] >= entry["at_least_tok_s"]
    else:
        measured = entry["s_per_token"] * 1e3
        assert abs(s["token_latency_ms"] / measured - 1) <= entry["tolerance"], s


def test_the_trace_shows_each_layers_cache_hit_rate(tmp_path):
    from taskgraph import simulate

    sim = simulate(TINY, schedule="EC", overrides=["policy.N=2", "policy.mu=2",
                                                   "policy.experts_gpu=3"])
    sim.write_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    misses = [e["args"] for e in events if e.get("name") == "ExpertIn"]
    decode = [a for a in misses if a["step"] > 0]
    assert decode and all(a["cache hit rate"] == pytest.approx(sim.summary["experts"][
        "hit_rate_by_layer"][a["layer"]], abs=1e-4) for a in decode)
    assert all("cache hit rate" not in a for a in misses if a["step"] == 0)


def test_a_prefetch_hides_the_copies_it_gets_right_and_wastes_the_others():
    """ECP at batch 1: with every miss predicted the copies overlap the layer before (never
    slower than EC); with none predicted they cross twice (slower than EC); in between, the
    more it gets right the faster."""
    def latency(schedule, *sets):
        return _run(schedule, list(sets), A5000)["token_latency_ms"]

    ec = latency("EC")
    ecp = [latency("ECP", f"policy.prefetch={a}") for a in (0.0, 0.5, 0.9, 1.0)]
    assert ecp[0] > ec >= ecp[3]
    assert ecp == sorted(ecp, reverse=True)


def test_an_unset_prefetch_is_the_published_figure_and_says_so():
    """ECP with no policy.prefetch was priced as a predictor that is always wrong (0: every
    guess a wasted copy), a default nobody would choose; unset it is the published figure for
    its predictor, priced and reported as if given."""
    def run(*sets):
        return _run("ECP", list(sets), A5000)

    unset = run()
    assert unset["policy"]["prefetch"] == PREFETCH_PUBLISHED
    given = run(f"policy.prefetch={PREFETCH_PUBLISHED}")
    assert unset["token_latency_ms"] == given["token_latency_ms"]
    # what a person sees: the figure is an assumption, said once, and not when given
    said = [w for w in unset["warnings"] if "policy.prefetch is unset" in w]
    assert len(said) == 1 and "78.8%" in said[0] and "FATE" in said[0]
    assert not any("policy.prefetch" in w for w in given["warnings"])
    assert unset["token_latency_ms"] < run("policy.prefetch=0")["token_latency_ms"]


def test_a_batch_size_beyond_any_run_is_a_row_that_says_why():
    from taskgraph import crossover

    c = crossover(TINY, ["S4", "EC"], [1, 1_000_000])
    huge = [r for r in c.rows if r["N"] == 1_000_000]
    assert all("at most 256" in r["error"] for r in huge if r["schedule"] == "S4")
    assert c.best(1, ["S4", "EC"]) is not None


@pytest.mark.parametrize("ids, words", [
    ([0.5, 1], "fractional numbers"), ([True, False], "true/false"), (["0", "1"], "text"),
    ([1, 1], "one expert twice"), ([0, 99], "outside 0..7"),
])
def test_a_routing_trace_holds_k_different_integer_expert_ids_a_token(tmp_path, ids, words):
    """Floats were truncated (2.7 -> 2), true read as 1 and a token's expert taken twice."""
    sc = load_scenario(TINY)
    m = sc.model
    good = np.tile(np.arange(m.k), (m.L, 2, 1)).tolist()
    bad = [[list(ids)] * 2] * m.L
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"format": "tg-routing/1", "E": m.E, "k": m.k, "L": m.L,
                                "steps": [good, bad]}))
    run = _tg("simulate", TINY, "--set", "workload.routing.kind=trace", "--set",
              f"workload.routing.trace={path}")
    assert run.returncode == 2 and words in run.stderr and "steps[1]" in run.stderr, run.stderr


def test_a_traces_hit_rate_is_replayed_from_its_prefill_at_its_own_batch(tmp_path):
    """At the batch a trace was recorded with its steps are replayed from the prefill on, as the
    executor's cache meets them (one step used to give 0% hits, the cache starting empty; then
    100%, replayed twice, where the run held none); at another batch its popularity is drawn
    from (a trace at batch 1 gave 65% hits at 64, where at most 50% can be)."""
    from taskgraph.dag.routing import Routing

    sc = load_scenario(TINY)
    m = sc.model
    pairs = np.arange(m.E).reshape(-1, 2)          # a prompt whose tokens choose every expert
    prefill = np.tile(np.tile(pairs, (10, 1)), (m.L, 1, 1)).tolist()

    def replayed(decode_experts, tokens=1):
        path = tmp_path / "r.json"
        step = np.tile(np.array(decode_experts), (m.L, 1, 1)).tolist()
        path.write_text(json.dumps({"format": "tg-routing/1", "E": m.E, "k": m.k, "L": m.L,
                                    "steps": [prefill, step]}))
        return Routing.of(load_scenario(TINY, ["workload.routing.kind=trace",
                                               f"workload.routing.trace={path}"]))

    # the prefill's experts enter the cache in id order: a cache of two keeps 6 and 7
    assert np.all(replayed([6, 7]).cache_hits(1, 2, "lru") == 1.0)
    assert np.all(replayed([0, 1]).cache_hits(1, 2, "lru") == 0.0)
    assert np.all(replayed([1, 7]).cache_hits(1, 2, "lru") == 0.5)
    # 64 tokens touch all 8 experts: a cache of 2 holds 2 of them
    assert replayed([0, 1]).cache_hits(64, m.k, "lru") == pytest.approx(np.full(m.L, m.k / m.E))


def test_huge_batches_replay_a_cache_in_bounded_time():
    """800 drawn steps of the whole batch were held at once (N = 262,144: 13 GB)."""
    from taskgraph.dag.routing import Routing

    routing = Routing.of(load_scenario(TINY))
    assert np.mean(routing.cache_hits(10_000_000, 2, "lru")) == pytest.approx(2 / 8, abs=0.01)


def test_an_expert_field_a_schedule_does_not_read_is_refused_or_dropped_with_a_note():
    """experts_gpu, eviction and prefetch changed nothing on S1-S5 and were silently ignored:
    for the run's own schedule they are refused; a schedule compared beside one that reads
    them drops them and says so."""
    run = _tg("simulate", TINY, "--set", "policy.experts_gpu=2")
    assert run.returncode == 2 and "policy.experts_gpu = 2 means nothing to schedule S1" \
        in run.stderr
    assert "EP, EC, ECP" in run.stderr and "Traceback" not in run.stderr
    run = _tg("simulate", TINY, "--schedule", "EP", "--set", "policy.eviction=popular")
    assert run.returncode == 2 and "it applies to EC, ECP" in run.stderr
    run = _tg("compare", TINY, "--schedules", "S1,EC", "--set", "policy.experts_gpu=2")
    assert run.returncode == 0, run.stderr
    assert "experts_gpu=0" in " ".join(run.stdout.split())


def test_a_compare_titles_only_what_every_row_runs_with():
    """The title took the first row's policy: with ECP first it showed its prefetch above EC,
    which has none. The title holds what every row has; ECP's prefetch sits in its caption."""
    run = _tg("compare", A5000, "--schedules", "ECP,EC")
    assert run.returncode == 0, run.stderr
    words = " ".join(run.stdout.split())
    title = words[:words.index("busy = share")]
    assert "eviction=lru" in title and "prefetch" not in title
    assert f"(MoE-Infinity) (prefetch={PREFETCH_PUBLISHED:g})" in words


def test_across_batch_sizes_the_users_prefetch_accuracy_is_kept():
    """ECP was always priced with prefetch = 0, whatever --set said."""
    run = _tg("compare", TINY, "--batch-sizes", "1,2", "--schedules", "S4,ECP", "--set",
              "policy.prefetch=0.8", "--json")
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["rows"]
    assert {r["policy"]["prefetch"] for r in rows if r["schedule"] == "ECP"} == {0.8}
    assert all("prefetch" not in r["policy"] for r in rows if r["schedule"] == "S4")


@pytest.mark.parametrize("sizes", [[2.5], "1,2", [None], 5, [True], [10**10], []])
def test_crossover_from_python_refuses_what_is_not_a_batch_size(sizes):
    """2.5 looped for ever (mu went negative), 1.5 divided by zero, others were tracebacks."""
    from taskgraph import crossover
    from taskgraph.errors import TgError

    with pytest.raises(TgError):
        crossover(TINY, ["S4"], sizes)


def test_crossover_with_no_schedule_is_refused():
    from taskgraph import crossover
    from taskgraph.errors import TgError

    with pytest.raises(TgError, match="names no schedule"):
        crossover(TINY, [], [1])
    run = _tg("compare", TINY, "--batch-sizes", "")
    assert run.returncode == 2 and "positive" in run.stderr, run.stderr


def test_a_request_list_keeps_the_experts_block_and_what_bound_it(capsys):
    """A request list runs batch after batch; its summary dropped the experts block and the
    phases' binding resources, and its table raised a KeyError on the latency row."""
    from taskgraph.cli import main

    argv = ["simulate", TINY, "--schedule", "EC", "--set", "policy.experts_gpu=2", "--set",
            "workload.lengths={count: 40, prompt_mean: 16, prompt_max: 24, gen_mean: 4, "
            "gen_max: 6}"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"]["batches"] > 1
    assert 0 < out["experts"]["hit_rate"] < 1 and set(out["bound_by"]) == {"prefill", "decode"}
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "(lru) hits" in out.replace("\n", " ") and "bound by" in out and "Traceback" not in err


def test_a_cache_that_swaps_pays_a_copy_each_way_a_miss():
    """Mixtral-offloading's cache swaps (its ExpertCache._swap: the chosen expert copied in,
    then the evicted one out, on one CUDA stream): a miss, or a prefetch into the cache, takes
    the two copies one after the other, at the link's two rates, and host memory carries both;
    a cache that drops what it
    evicts (tg's own, MoE-Infinity's) pays the one copy. At batch 1 on the A5000, with one
    expert a layer resident, the token pays the copies out on top."""
    from taskgraph import presets
    from taskgraph.kinds import KIND_INDEX
    from taskgraph.perf.cost import POOLS, CostModel
    from taskgraph.specs import RESOURCES, HardwareSpec, ImplementationSpec

    hw = HardwareSpec.model_validate(presets.HARDWARE["a5000"])
    link = hw.link
    into, out = link.h2d_gbps * link.h2d_eff * 1e9, link.d2h_gbps * link.d2h_eff * 1e9
    expert = 352_321_536                     # one Mixtral 8x7B expert in 16 bits
    swaps = CostModel(hw, ImplementationSpec.model_validate(
        presets.IMPLEMENTATIONS["mixtral-offloading"]))
    drops = CostModel(hw, ImplementationSpec(name="drops"))
    fixed = link.latency_us * 1e-6
    assert drops.time("h2d", 0.0, expert, "ExpertIn") == pytest.approx(expert / into + fixed)
    for copy in ("ExpertIn", "ExpertAhead"):      # a prefetch's copy evicts as a miss's does
        assert swaps.time("h2d", 0.0, expert, copy) == pytest.approx(
            expert / into + expert / out + fixed)
        pools = swaps.pool_bytes(RESOURCES.index("h2d"), KIND_INDEX[copy], np.array([1.0]))
        assert dict(zip(POOLS, pools[:, 0])) == {"host_memory": 2.0, "pcie_h2d": 1.0,
                                                 "pcie_d2h": 1.0}

    path = "scenarios/small-batch/a5000-mixtral-offloading.yaml"
    swapped = _run("EC", [], path)["token_latency_ms"]
    dropped = _run("EC", ["implementation.expert_swaps=false"], path)["token_latency_ms"]
    # 32 layers x 1.75 misses (uniform routing, one of eight resident) x a copy out
    assert swapped - dropped == pytest.approx(32 * 1.75 * expert / out * 1e3, rel=0.15)


def test_a_swap_shows_its_write_back_on_the_gpu_to_cpu_link(capsys, tmp_path):
    """What a person sees of a swapping cache. The copy stream runs each copy in and then the
    evicted expert's write-back: it is busy for both (utilization's h2d, what binds), and the
    experts row says what share of the run it spent writing back. A trace's link counters carry
    each part on its own direction at that direction's rate, so that what each counter carries
    over the run is what crossed that way, the write-backs included, where KV cache copies out
    overlap them (ECP, a long prompt). A GPU->CPU link at half the CPU->GPU rate tells the two
    parts apart."""
    from taskgraph import presets
    from taskgraph.cli import main
    from taskgraph.specs import HardwareSpec
    from taskgraph.tracing.check import check_trace, load_trace

    link = HardwareSpec.model_validate(presets.HARDWARE["a5000"]).link
    into = link.h2d_gbps * link.h2d_eff                 # GB/s
    slow = ["--set", f"hardware.link.d2h_gbps={link.h2d_gbps / 2}"]
    out = into / 2 * link.d2h_eff / link.h2d_eff
    path = "scenarios/small-batch/a5000-mixtral-offloading.yaml"
    sets = ["workload.gen_len=4", f"hardware.link.d2h_gbps={link.h2d_gbps / 2}"]
    swapped = _run("EC", sets, path)
    dropped = _run("EC", [*sets, "implementation.expert_swaps=false"], path)
    # the copy stream is busy for the copies in (as long as a dropping cache's) and the
    # write-backs (twice as long at half the rate)
    back = swapped["experts"]["written_back"]
    busy = swapped["utilization"]["h2d"] * swapped["makespan_s"]
    copies_in = dropped["utilization"]["h2d"] * dropped["makespan_s"]
    assert back * swapped["makespan_s"] == pytest.approx(2 * copies_in, rel=0.05)
    assert busy == pytest.approx(3 * copies_in, rel=0.05)
    assert dropped["experts"]["written_back"] == 0.0
    trace = tmp_path / "swap.json"
    assert main(["simulate", path, *slow, "--set", "workload.gen_len=4",
                 "--trace", str(trace)]) == 0
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())     # cells unwrapped
    assert f"writing evicted experts back GPU->CPU {back:.0%} of the run" in shown

    events = _trace_events(trace)
    rates = {name: {v for _, v in points} for name, points in _counters(events).items()}
    assert max(rates["PCIe GPU->CPU (GB/s)"]) == pytest.approx(out, rel=0.01)
    assert max(rates["PCIe CPU->GPU (GB/s)"]) == pytest.approx(into, rel=0.01)
    copies = [e["args"] for e in events if e.get("name") == "ExpertIn" and e.get("ph") == "X"]
    assert copies and all(c["written back (bytes)"] == c["bytes"] for c in copies)
    assert all(c["memory bandwidth (GB/s)"] == pytest.approx(into, rel=0.01) for c in copies)

    long = tmp_path / "long.json"
    assert main(["simulate", path, "--schedule", "ECP", *slow, "--set", "workload.gen_len=2",
                 "--set", "workload.prompt_len=8192", "--set", "workload.max_prompt_len=8192",
                 "--set", "policy.N=64", "--set",
                 "policy.mu=8", "--set", "policy.r_c=0", "--set", "hardware.gpu.memory_gb=80",
                 "--trace", str(long), "--trace-steps", "all"]) == 0
    capsys.readouterr()
    assert check_trace(load_trace(long)) == []
    events = _trace_events(long)
    # a link's tracks: its streams (S4's and ECP's KV copies in have one of their own)
    crossed = {"PCIe CPU->GPU": 0, "PCIe GPU->CPU": 0}
    link = {e["tid"]: way for e in events if e.get("name") == "thread_name"
            for way in crossed if e["args"]["name"].startswith(way)}
    for e in events:
        way = link.get(e.get("tid"))
        if e.get("ph") == "X" and way is not None:
            crossed[way] += e["args"]["bytes"]
            crossed["PCIe GPU->CPU"] += e["args"].get("written back (bytes)", 0)
    assert crossed["PCIe GPU->CPU"] > 0.5 * crossed["PCIe CPU->GPU"]
    for way, points in _counters(events).items():
        if way.startswith("PCIe"):
            points.sort()
            carried = sum((t1 - t0) * 1e-6 * rate * 1e9          # ts in us, rates in GB/s
                          for (t0, rate), (t1, _) in zip(points, points[1:]))
            assert carried == pytest.approx(crossed[way.removesuffix(" (GB/s)")], rel=1e-3)


def _trace_events(path) -> list[dict]:
    events = json.loads(path.read_text())
    return events["traceEvents"] if isinstance(events, dict) else events


def _counters(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Each counter track's points, (time in us, value)."""
    tracks: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "C":
            for name, value in e["args"].items():
                tracks.setdefault(name, []).append((e["ts"], value))
    return tracks
