"""The executor runs the expert-level schedules (docs/experts.md): EP (each layer's experts_gpu
most popular experts placed on the GPU, the others on the CPU, summed by Merge) and EC (an
expert cache on the GPU that ExpertIn fills on a miss). Each run is compared with the sequential
reference and with transformers' MixtralForCausalLM; guards show the copies and the GPU's part
matter; ExpertIn's copies are counted against an LRU replayed here from the recorded routing."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")

from taskgraph import api  # noqa: E402
from taskgraph.dag.builder import make_plan  # noqa: E402
from taskgraph.dag.compiled import compile_plan  # noqa: E402
from taskgraph.exec import runtime as runtime_module  # noqa: E402
from taskgraph.exec.dispatch import execute  # noqa: E402
from taskgraph.exec.runtime import Runtime  # noqa: E402

TINY = "scenarios/tiny.yaml"          # 4 layers, E = 8 experts, top-2, fp32
E = 8
# The other experts of a skewed router are the popular ones: the GPU's set is not 0..n-1.
SKEWED = ["workload.routing.kind=skewed",
          "workload.routing.popularity=[1,1,1,1,1,1,4,8]"]
RESIDENT = ["policy.r_w=1.0", "policy.r_c=1.0"]


def _execute(schedule: str, *sets: str, steps: int = 2, zero_copy: bool = False,
             record_routing=None):
    return api.execute(TINY, schedule=schedule, overrides=list(sets), device="cpu",
                       steps=steps, zero_copy=zero_copy, record_routing=record_routing)


def _assert_reference(summary: dict) -> None:
    assert summary["tokens_match"] is True, summary
    assert summary["max_abs_err"] < 1e-4, summary          # fp32 tolerance


# --- 1. every setting computes what the reference computes ----------------------------------

EP_SETTINGS = [
    ("policy.experts_gpu=0",),                              # nothing placed: S5's sum
    ("policy.experts_gpu=2",),
    ("policy.experts_gpu=8",),                              # every expert on the GPU
    ("policy.experts_gpu=2", *SKEWED),
    ("policy.experts_gpu=3", "policy.N=2", "policy.mu=2", *RESIDENT),   # one micro-batch
    ("policy.experts_gpu=5", "policy.N=6", "policy.mu=2", *RESIDENT),
]
EC_SETTINGS = [
    ("policy.experts_gpu=0",),                              # no cache: every expert a miss
    ("policy.experts_gpu=2",),
    ("policy.experts_gpu=8",),
    ("policy.experts_gpu=2", "policy.eviction=popular"),
    ("policy.experts_gpu=0", "policy.eviction=popular"),
    ("policy.experts_gpu=3", "policy.eviction=popular", *SKEWED),
    ("policy.experts_gpu=1", "policy.N=2", "policy.mu=2", *RESIDENT),   # one micro-batch
    ("policy.experts_gpu=3", "policy.N=6", "policy.mu=2", *RESIDENT),
    ("policy.experts_gpu=8", "policy.eviction=popular", "policy.N=3", "policy.mu=1"),
]


@pytest.mark.parametrize("sets", EP_SETTINGS, ids=lambda s: " ".join(s))
def test_ep_computes_what_the_reference_computes(sets):
    result = _execute("EP", *sets)
    assert result.failure is None and result.summary["schedule"] == "EP"
    _assert_reference(result.summary)


@pytest.mark.parametrize("sets", EC_SETTINGS, ids=lambda s: " ".join(s))
def test_ec_computes_what_the_reference_computes(sets):
    result = _execute("EC", *sets)
    assert result.failure is None and result.summary["schedule"] == "EC"
    _assert_reference(result.summary)


@pytest.mark.parametrize("schedule,sets", [
    ("EP", ("policy.experts_gpu=3",)),
    ("EC", ("policy.experts_gpu=2",)),
    ("EC", ("policy.experts_gpu=2", "policy.eviction=popular")),
])
def test_zero_copy_reads_the_experts_where_they_lie(schedule, sets):
    result = _execute(schedule, *sets, zero_copy=True)
    assert result.summary["zero_copy"] is True
    _assert_reference(result.summary)


def test_the_cli_executes_ep_and_ec(capsys):
    from taskgraph.cli import main

    for schedule in ("EP", "EC"):
        assert main(["execute", TINY, "--device", "cpu", "--schedule", schedule, "--steps", "2",
                     "--set", "policy.experts_gpu=2", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["schedule"] == schedule and out["policy"]["experts_gpu"] == 2
        _assert_reference(out)


def test_bf16_tokens_are_the_references():
    """bf16 on the CPU: the split sum of EP (top-2: one or two terms a part) and EC's experts
    from cache slots still give the reference's tokens."""
    for schedule in ("EP", "EC"):
        s = _execute(schedule, "policy.experts_gpu=3", "model.dtype_bytes=2").summary
        assert s["dtype"] == "bfloat16" and s["tokens_match"] is True, s


# --- 2. against transformers ----------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from tests.test_transformers_parity import (PROMPT_LENS, generate, make_checkpoint,
                                                ragged_prompts)

    folder = tmp_path_factory.mktemp("mixtral-experts")
    # 4 experts of which each token picks 2; GQA 4:1; ragged prompts share micro-batches
    model = make_checkpoint(folder, hidden_size=64, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=16)
    prompts, lens = ragged_prompts()
    expected = [generate(model, prompts[i, :n]) for i, n in enumerate(PROMPT_LENS)]
    return folder, prompts, lens, expected


def _run_checkpoint(folder, schedule, prompts, lens, mu, policy, zero_copy=False):
    from taskgraph.kernels.weights import load_mixtral_safetensors
    from taskgraph.scenario import scenario_from_dict
    from tests.test_transformers_parity import STEPS

    sc = scenario_from_dict({
        "model": {"hf_config": str(folder / "config.json"), "dtype_bytes": 4},
        "hardware": "t4", "workload": {"prompt_len": prompts.shape[1], "gen_len": STEPS},
        "policy": {"N": len(lens), "mu": mu, "A_g": 1, "F_g": 0, **policy},
        "schedule": schedule})
    plan = make_plan(sc)
    w = load_mixtral_safetensors(folder, sc.model, torch.float32)
    rt = Runtime(plan, w, prompts, torch.device("cpu"), prompt_lens=lens, record_logits=True,
                 zero_copy=zero_copy)
    run = execute(compile_plan(plan), rt)
    assert not run.interrupted and run.failure is None, run.failure
    return rt


@pytest.mark.parametrize("schedule,mu,policy,zero_copy", [
    ("EP", 2, {"experts_gpu": 1}, False),
    ("EP", 6, {"experts_gpu": 2}, False),                 # one micro-batch
    ("EP", 2, {"experts_gpu": 4}, False),
    ("EP", 3, {"experts_gpu": 2}, True),
    ("EC", 2, {"experts_gpu": 1, "eviction": "lru"}, False),
    ("EC", 6, {"experts_gpu": 2, "eviction": "lru"}, False),
    ("EC", 2, {"experts_gpu": 0, "eviction": "lru"}, False),
    ("EC", 2, {"experts_gpu": 2, "eviction": "popular"}, False),
    ("EC", 3, {"experts_gpu": 1, "eviction": "lru"}, True),
])
def test_tokens_and_logits_are_transformers_own(hf_checkpoint, schedule, mu, policy,
                                                zero_copy):
    folder, prompts, lens, expected = hf_checkpoint
    rt = _run_checkpoint(folder, schedule, prompts, lens, mu, policy, zero_copy)
    tokens, step_logits = rt.outputs()[0], rt.step_logits.cpu()
    for i, (hf_tokens, hf_logits) in enumerate(expected):
        assert tokens[i].tolist() == hf_tokens.tolist(), f"request {i} ({lens[i]} tokens)"
        torch.testing.assert_close(step_logits[i], hf_logits, rtol=0, atol=2e-4)
    if schedule == "EC" and not zero_copy:
        assert rt.expert_copies > 0             # the experts it ran crossed into the cache


# --- 3. guards: without the copies, or without the GPU's part, the result is wrong -----------

def test_without_expertin_copies_the_check_fails(monkeypatch):
    """ExpertIn still maps experts to slots but copies nothing: the slots stay zero and the
    tokens are no longer the reference's."""
    assert _execute("EC", "policy.experts_gpu=2").summary["tokens_match"] is True
    monkeypatch.setattr(Runtime, "_copy_expert", lambda self, l, e, slot: None)
    s = _execute("EC", "policy.experts_gpu=2").summary
    assert s["tokens_match"] is False and s["max_abs_err"] > 1e-2


def test_copying_the_wrong_expert_fails(monkeypatch):
    """A miss copied from the next expert's weights: the slot mapping is what GPUFFN reads."""
    real = Runtime._copy_expert
    monkeypatch.setattr(Runtime, "_copy_expert",
                        lambda self, l, e, slot: real(self, l, (e + 1) % E, slot))
    assert _execute("EC", "policy.experts_gpu=3").summary["tokens_match"] is False


def test_without_gpuffn_ep_fails(monkeypatch):
    """EP's GPU part made a no-op: the placed experts' contribution is lost."""
    monkeypatch.setattr(Runtime, "_GPUFFN", lambda self, s, l, j: None)
    s = _execute("EP", "policy.experts_gpu=2").summary
    assert s["tokens_match"] is False and s["max_abs_err"] > 1e-2
    # with nothing placed the GPU has no part to lose: still the reference's
    assert _execute("EP", "policy.experts_gpu=0").summary["tokens_match"] is True


def test_ep_with_the_cpu_computing_every_expert_fails(monkeypatch):
    """If the host's part also computed the GPU's experts, Merge would count them twice."""
    real = Runtime._expert_buffers

    def everything_on_host(self, dev):
        real(self, dev)
        self._on_host = [frozenset(range(E))] * self.L

    monkeypatch.setattr(Runtime, "_expert_buffers", everything_on_host)
    assert _execute("EP", "policy.experts_gpu=2").summary["tokens_match"] is False


# --- 4. the cache behaves as an LRU (or fixed) cache ----------------------------------------

def _lru_copies(steps, capacity):
    """Misses of an LRU cache of `capacity` experts, replayed over each layer's sequence of
    chosen-expert sets (cold start); independent of the runtime's bookkeeping."""
    copies = []
    for layer_sets in steps:
        cache: OrderedDict[int, None] = OrderedDict()
        n = 0
        for wanted in layer_sets:
            n += sum(e not in cache for e in wanted)
            for e in sorted(wanted):
                cache.pop(e, None)
                cache[e] = None
            while len(cache) > capacity:
                cache.popitem(last=False)
        copies.append(n)
    return copies


def _wanted_per_layer(trace: dict, micro_batches: int, mu: int, P: int) -> list[list[set]]:
    """Each layer's chosen-expert sets in ExpertIn's order: step by step, micro-batch by
    micro-batch. The trace lists step 0's tokens sequence after sequence (every prompt P
    tokens long here), then one token per sequence for each decode step."""
    out = []
    for layer in range(trace["L"]):
        sets = []
        for s, step in enumerate(trace["steps"]):
            tokens = step[layer]
            per = mu * P if s == 0 else mu
            assert len(tokens) == per * micro_batches
            for j in range(micro_batches):
                sets.append({e for tok in tokens[j * per:(j + 1) * per] for e in tok})
        out.append(sets)
    return out


@pytest.fixture
def runtimes(monkeypatch):
    """Every Runtime the executor builds, kept for the test to read."""
    made = []

    class Kept(Runtime):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(runtime_module, "Runtime", Kept)
    return made


@pytest.mark.parametrize("capacity,N,mu", [(2, 2, 2), (3, 1, 1), (0, 2, 2), (8, 2, 2),
                                           (3, 6, 2)])
def test_expertin_copies_what_an_lru_cache_misses(tmp_path, runtimes, capacity, N, mu):
    rec = tmp_path / "routing.json"
    result = _execute("EC", f"policy.experts_gpu={capacity}", "policy.eviction=lru",
                      f"policy.N={N}", f"policy.mu={mu}", steps=6, record_routing=rec)
    _assert_reference(result.summary)
    (rt,) = runtimes
    trace = json.loads(rec.read_text())
    wanted = _wanted_per_layer(trace, N // mu, mu, rt.P)
    expected = _lru_copies(wanted, capacity)
    assert rt.expert_copies_by_layer == expected
    assert rt.expert_copies == sum(expected)
    # what bounds it: each layer copies at least its distinct experts once, at most every
    # chosen expert of every micro-batch
    for layer, sets in enumerate(wanted):
        assert len(set().union(*sets)) <= expected[layer] <= sum(map(len, sets))
    if capacity == 0:
        assert expected == [sum(map(len, sets)) for sets in wanted]


@pytest.mark.parametrize("capacity", [0, 3, 8])
def test_a_popular_cache_copies_only_what_it_does_not_hold(tmp_path, runtimes, capacity):
    from taskgraph.dag.routing import Routing
    from taskgraph.scenario import load_scenario

    sets = [f"policy.experts_gpu={capacity}", "policy.eviction=popular", "policy.N=4",
            "policy.mu=2", *SKEWED]
    rec = tmp_path / "routing.json"
    result = _execute("EC", *sets, steps=4, record_routing=rec)
    _assert_reference(result.summary)
    (rt,) = runtimes
    held = Routing.of(load_scenario(TINY, sets)).popular(capacity)
    assert capacity in (0, 8) or {6, 7} <= set(held[0].tolist())      # the skewed ones
    wanted = _wanted_per_layer(json.loads(rec.read_text()), 2, 2, rt.P)
    expected = [sum(len(w - set(held[layer].tolist())) for w in sets_)
                for layer, sets_ in enumerate(wanted)]
    assert rt.expert_copies_by_layer == expected
    assert (rt.expert_copies == 0) == (capacity == E)


def test_ep_places_the_routers_most_popular_experts_once(runtimes):
    """The GPU's experts are Routing.popular's, copied at start-up into device memory of their
    own (not views of the host's weights), and GPUFFN reads those copies."""
    from taskgraph.dag.routing import Routing
    from taskgraph.scenario import load_scenario

    sets = ["policy.experts_gpu=2", *SKEWED]
    _assert_reference(_execute("EP", *sets).summary)
    (rt,) = runtimes
    popular = Routing.of(load_scenario(TINY, sets)).popular(2)
    assert rt.placed == [sorted(row.tolist()) for row in popular] == [[6, 7]] * rt.L
    host = {t.untyped_storage().data_ptr() for t in rt.w.layers}
    for l, held in enumerate(rt.placed):
        for e in held:
            w13 = rt._gpu_experts[l][f"w13.{e}"]
            assert w13.untyped_storage().data_ptr() not in host
            torch.testing.assert_close(w13, rt._host_views[l][f"w13.{e}"], rtol=0, atol=0)
