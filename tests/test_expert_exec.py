"""The executor runs the expert-level schedules (docs/experts.md): EP (each layer's experts_gpu
most popular experts placed on the GPU, the others on the CPU, summed by Merge) and EC (an
expert cache on the GPU that ExpertIn fills on a miss). Each run is compared with the sequential
reference and with transformers' MixtralForCausalLM; guards show the copies and the GPU's part
matter; ExpertIn's copies are counted against an LRU replayed here from the recorded routing.
EC's device memory is c slots a layer plus one staging area of S = min(E, mu * k) slots shared
by the layers; a micro-batch missing more than S experts (prefill) runs in rounds."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")

from taskgraph import api  # noqa: E402
from taskgraph.dag.builder import make_plan  # noqa: E402
from taskgraph.dag.compiled import compile_plan  # noqa: E402
from taskgraph.exec import runtime as runtime_module  # noqa: E402
from taskgraph.exec.expert_cache import CachedExperts, LayerCache, PlacedExperts  # noqa: E402
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
    # placements across layers (taskgraph.placement): Fiddler's budget, llama.cpp's
    ("policy.experts_total=11", *SKEWED),
    ("policy.cpu_moe=2",),
    (r"policy.override_tensor=blk\.[13]\.ffn_(gate|up|down)_exps=CPU",),
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
        x = out["experts"]
        assert "hit_rate" in x or "gpu_share" in x                  # the model's figures stay
        if schedule == "EC":        # the copies the run made, all layers and by layer
            assert len(x["copies_by_layer"]) == out["layers"] == 4
            assert x["copies"] == sum(x["copies_by_layer"]) > 0
            assert 0 < x["copies_in_gpuffn"] < x["copies"]          # prefill's later rounds
        else:
            assert "copies" not in x
    # other schedules' JSON has no experts block
    assert main(["execute", TINY, "--device", "cpu", "--schedule", "S1", "--steps", "2",
                 "--json"]) == 0
    assert "experts" not in json.loads(capsys.readouterr().out)


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


def _run_checkpoint(folder, schedule, prompts, lens, mu, policy, zero_copy=False, device="cpu"):
    from taskgraph.exec.dispatch import CudaDevice
    from taskgraph.kernels.weights import load_safetensors
    from taskgraph.scenario import scenario_from_dict
    from tests.test_transformers_parity import STEPS

    sc = scenario_from_dict({
        "model": {"hf_config": str(folder / "config.json"), "dtype_bytes": 4},
        "hardware": "t4", "workload": {"prompt_len": prompts.shape[1], "gen_len": STEPS},
        "policy": {"N": len(lens), "mu": mu, "A_g": 1, "F_g": 0, **policy},
        "schedule": schedule})
    plan = make_plan(sc)
    w = load_safetensors(folder, sc.model, torch.float32)
    rt = Runtime(plan, w, prompts, torch.device(device), prompt_lens=lens, record_logits=True,
                 zero_copy=zero_copy, pin_memory=device == "cuda")
    run = execute(compile_plan(plan), rt, CudaDevice(torch) if device == "cuda" else None)
    assert not run.interrupted and run.failure is None, run.failure
    return rt


# CUDA where this machine has it (zero copy is the CPU backend's emulation only)
CUDA = [pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                      reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("schedule,mu,policy,zero_copy", [
    ("EP", 2, {"experts_gpu": 1}, False),
    ("EP", 6, {"experts_gpu": 2}, False),                 # one micro-batch
    ("EP", 2, {"experts_gpu": 4}, False),
    ("EP", 3, {"experts_gpu": 2}, True),
    ("EP", 2, {"cpu_moe": 1}, False),                    # llama.cpp's whole-layer split
    ("EP", 2, {"experts_total": 3}, False),              # Fiddler's: 2 and 1 a layer
    ("EC", 2, {"experts_gpu": 1, "eviction": "lru"}, False),
    ("EC", 6, {"experts_gpu": 2, "eviction": "lru"}, False),
    ("EC", 2, {"experts_gpu": 0, "eviction": "lru"}, False),
    ("EC", 2, {"experts_gpu": 2, "eviction": "popular"}, False),
    ("EC", 3, {"experts_gpu": 1, "eviction": "lru"}, True),
    # mu = 1: S = min(E, k) = 2 staging slots, and prefill's up to 7 tokens miss up to all 4
    # experts, so they run in rounds
    ("EC", 1, {"experts_gpu": 1, "eviction": "lru"}, False),
    ("EC", 1, {"experts_gpu": 0, "eviction": "lru"}, False),
    ("EC", 1, {"experts_gpu": 1, "eviction": "popular"}, False),
])
@pytest.mark.parametrize("device", ["cpu", *CUDA])
def test_tokens_and_logits_are_transformers_own(hf_checkpoint, schedule, mu, policy,
                                                zero_copy, device):
    if zero_copy and device != "cpu":
        pytest.skip("zero copy is the CPU backend's")
    folder, prompts, lens, expected = hf_checkpoint
    rt = _run_checkpoint(folder, schedule, prompts, lens, mu, policy, zero_copy, device)
    if device == "cuda":         # the experts cross from pinned memory (weights_pinned)
        assert all(flat.is_pinned() for flat in rt.w.layers)
    tokens, step_logits = rt.outputs()[0], rt.step_logits.cpu()
    for i, (hf_tokens, hf_logits) in enumerate(expected):
        assert tokens[i].tolist() == hf_tokens.tolist(), f"request {i} ({lens[i]} tokens)"
        torch.testing.assert_close(step_logits[i], hf_logits, rtol=0, atol=2e-4)
    if schedule == "EC" and not zero_copy:
        assert rt.cache.copies > 0             # the experts it ran crossed into the cache
        assert rt.cache.staging_slots == min(4, mu * 2)
        # with one sequence a micro-batch, prefill's misses outnumber the staging slots
        assert (rt.cache.copies_in_gpuffn > 0) == (mu == 1)


# --- 3. guards: without the copies, or without the GPU's part, the result is wrong -----------

def test_without_expertin_copies_the_check_fails(monkeypatch):
    """ExpertIn still maps experts to slots but copies nothing: the slots stay zero and the
    tokens are no longer the reference's."""
    assert _execute("EC", "policy.experts_gpu=2").summary["tokens_match"] is True
    monkeypatch.setattr(CachedExperts, "copy", lambda self, l, e, slot: None)
    s = _execute("EC", "policy.experts_gpu=2").summary
    assert s["tokens_match"] is False and s["max_abs_err"] > 1e-2


def test_copying_the_wrong_expert_fails(monkeypatch):
    """A miss copied from the next expert's weights: the slot mapping is what GPUFFN reads."""
    real = CachedExperts.copy
    monkeypatch.setattr(CachedExperts, "copy",
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
    real = PlacedExperts.__init__

    def everything_on_host(self, *args, **kw):
        real(self, *args, **kw)
        self.on_host = [frozenset(range(E))] * len(self.on_host)

    monkeypatch.setattr(PlacedExperts, "__init__", everything_on_host)
    assert _execute("EP", "policy.experts_gpu=2").summary["tokens_match"] is False


# --- 4. the cache behaves as an LRU (or fixed) cache ----------------------------------------

def _lru_misses(steps, capacity):
    """Each layer's misses, micro-batch by micro-batch, of an LRU cache of `capacity` experts
    replayed over the layer's sequence of chosen-expert sets (cold start); independent of the
    runtime's bookkeeping."""
    out = []
    for layer_sets in steps:
        cache: OrderedDict[int, None] = OrderedDict()
        misses = []
        for wanted in layer_sets:
            misses.append({e for e in wanted if e not in cache})
            for e in sorted(wanted):
                cache.pop(e, None)
                cache[e] = None
            while len(cache) > capacity:
                cache.popitem(last=False)
        out.append(misses)
    return out


def _lru_copies(steps, capacity):
    return [sum(map(len, layer)) for layer in _lru_misses(steps, capacity)]


@pytest.fixture
def copy_log(monkeypatch):
    """Every (layer, expert) the runtime copies host -> device, in order."""
    log = []
    real = CachedExperts.copy

    def logged(self, l, e, slot):
        log.append((l, e))
        real(self, l, e, slot)

    monkeypatch.setattr(CachedExperts, "copy", logged)
    return log


def _assert_copied_once(log, misses_per_layer):
    """A layer's copies, cut micro-batch by micro-batch (a micro-batch's copies, ExpertIn's and
    its GPUFFN's later rounds, all come before the next micro-batch's of the layer: the GPU
    stream orders them), are each micro-batch's misses, each once."""
    for layer, misses in enumerate(misses_per_layer):
        copied = [e for l, e in log if l == layer]
        assert len(copied) == sum(map(len, misses))
        at = 0
        for want in misses:
            got = copied[at:at + len(want)]
            assert sorted(got) == sorted(want), (layer, got, want)      # each miss once
            at += len(want)


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
                                           (3, 6, 2), (2, 4, 1), (1, 3, 3)])
def test_expertin_copies_what_an_lru_cache_misses(tmp_path, runtimes, copy_log, capacity, N,
                                                  mu):
    """With rounds (every setting here: prefill's 16 tokens a sequence miss more than the
    min(8, 2 mu) staging slots) and the slot swaps of a kept miss (decode micro-batches of more
    than c experts), each miss is copied once per micro-batch, what an LRU replay misses."""
    rec = tmp_path / "routing.json"
    result = _execute("EC", f"policy.experts_gpu={capacity}", "policy.eviction=lru",
                      f"policy.N={N}", f"policy.mu={mu}", steps=6, record_routing=rec)
    _assert_reference(result.summary)
    (rt,) = runtimes
    trace = json.loads(rec.read_text())
    wanted = _wanted_per_layer(trace, N // mu, mu, rt.P)
    expected = _lru_copies(wanted, capacity)
    assert rt.cache.copies_by_layer == expected
    assert rt.cache.copies == sum(expected)
    assert result.summary["experts"]["copies_by_layer"] == expected
    _assert_copied_once(copy_log, _lru_misses(wanted, capacity))
    if capacity < E:
        assert rt.cache.copies_in_gpuffn > 0            # some micro-batch ran in rounds
    # what bounds it: each layer copies at least its distinct experts once, at most every
    # chosen expert of every micro-batch
    for layer, sets in enumerate(wanted):
        assert len(set().union(*sets)) <= expected[layer] <= sum(map(len, sets))
    if capacity == 0:
        assert expected == [sum(map(len, sets)) for sets in wanted]


@pytest.mark.parametrize("capacity,N", [(2, 1), (3, 1), (1, 2), (4, 3)])
def test_the_simulators_replay_of_a_run_hits_what_its_cache_held(tmp_path, capacity, N):
    """At the batch a routing trace was recorded with (one micro-batch a step), the simulator
    replays it from the prefill on, as the executor's cache meets it: its hit rate, layer by
    layer, is the run's own (`measured_hit_rate`, counted in ExpertIn). Replaying the decode
    steps alone, twice (as it once did), put layer 0 at 33% where the run held 25%."""
    rec = tmp_path / "routing.json"
    sets = [f"policy.experts_gpu={capacity}", f"policy.N={N}", f"policy.mu={N}"]
    ran = _execute("EC", *sets, steps=6, record_routing=rec).summary["experts"]
    sim = api.simulate(TINY, schedule="EC", overrides=[
        *sets, "workload.gen_len=6", "workload.routing.kind=trace",
        f"workload.routing.trace={rec}"]).summary["experts"]
    assert 0 < ran["measured_hit_rate"] < 1
    assert sim["hit_rate_by_layer"] == pytest.approx(ran["measured_hit_rate_by_layer"],
                                                     abs=1e-4)


@pytest.mark.parametrize("capacity", [0, 3, 8])
def test_a_popular_cache_copies_only_what_it_does_not_hold(tmp_path, runtimes, copy_log,
                                                          capacity):
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
    assert rt.cache.copies_by_layer == expected
    assert (rt.cache.copies == 0) == (capacity == E)
    _assert_copied_once(copy_log, [[w - set(held[layer].tolist()) for w in sets_]
                                   for layer, sets_ in enumerate(wanted)])


def test_ep_places_the_routers_most_popular_experts_once(runtimes):
    """The GPU's experts are Routing.popular's, copied at start-up into device memory of their
    own (not views of the host's weights), and GPUFFN reads those copies."""
    from taskgraph.dag.routing import Routing
    from taskgraph.scenario import load_scenario

    sets = ["policy.experts_gpu=2", *SKEWED]
    _assert_reference(_execute("EP", *sets).summary)
    (rt,) = runtimes
    popular = Routing.of(load_scenario(TINY, sets)).popular(2)
    assert rt.placed.held == [sorted(row.tolist()) for row in popular] == [[6, 7]] * rt.L
    host = {t.untyped_storage().data_ptr() for t in rt.w.layers}
    for l, held in enumerate(rt.placed.held):
        for e in held:
            w13 = rt.placed.weights[l][f"w13.{e}"]
            assert w13.untyped_storage().data_ptr() not in host
            torch.testing.assert_close(w13, rt._host_views[l][f"w13.{e}"], rtol=0, atol=0)


# --- 5. EC's device memory: c slots a layer and one staging area of min(E, mu k) ------------

@pytest.mark.parametrize("sets,per_layer", [
    (("policy.cpu_moe=3",), [0, 0, 0, 8]),
    ((r"policy.override_tensor=blk\.[02]\.ffn_.*_exps=CPU",), [0, 8, 0, 8]),
    (("policy.experts_total=6",), [2, 2, 1, 1]),      # equal layers share a budget evenly
])
def test_ep_holds_each_layer_as_the_placement_says(runtimes, sets, per_layer):
    """The executor's GPU holds, layer by layer, the count the placement gives (a layer on
    the CPU nothing, a layer on the GPU every expert), and the tokens stay the reference's."""
    _assert_reference(_execute("EP", *sets).summary)
    (rt,) = runtimes
    assert [len(row) for row in rt.placed.held] == per_layer
    assert all(len(rt.placed.on_host[l]) == E - n for l, n in enumerate(per_layer))


def _runtime(sets, schedule="EC") -> Runtime:
    """A Runtime for the tiny scenario, built and not run."""
    from taskgraph.exec.loading import kept_synthetic_weights
    from taskgraph.kernels.reference import synthetic_prompts
    from taskgraph.scenario import for_schedule, load_scenario

    sc, _ = for_schedule(load_scenario(TINY, list(sets)), schedule)
    w = kept_synthetic_weights(sc.model, 0, torch.float32)
    prompts = synthetic_prompts(sc.policy.N, sc.workload.context_prompt, sc.model.V, seed=1)
    return Runtime(make_plan(sc, schedule), w, prompts, torch.device("cpu"))


def _buffer_bytes(rt: Runtime) -> int:
    """Bytes of every distinct storage the runtime's attributes hold (tensors, in lists, tuples
    and dicts; a view counts its storage once)."""
    seen: dict[int, int] = {}

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                walk(o)
        elif type(obj).__module__ == CachedExperts.__module__:    # the experts it holds
            for o in vars(obj).values():
                walk(o)

    for value in vars(rt).values():
        walk(value)
    return sum(seen.values())


@pytest.mark.parametrize("c,mu,eviction", [(2, 2, "lru"), (0, 2, "lru"), (3, 1, "popular"),
                                           (2, 1, "lru")])
def test_ec_allocates_c_slots_a_layer_and_one_staging_area(monkeypatch, c, mu, eviction):
    """What the runtime allocates for experts (its buffers' bytes, less those of the same
    runtime without expert buffers) is c * L + S experts' worth, S = min(E, mu * k): what the
    memory model counts. Prefill's mu * P * k (here 32 or 64) exceeds E = 8, so a layout with
    room for a micro-batch's every chosen expert in each layer would hold E a layer: 32
    experts."""
    from taskgraph.perf.memory import memory_footprint

    sets = [f"policy.experts_gpu={c}", f"policy.mu={mu}", f"policy.eviction={eviction}"]
    rt = _runtime(sets)
    m, L = rt.m, rt.L
    assert rt.mu * rt.P * m.k > m.E
    S = min(m.E, mu * m.k)
    with monkeypatch.context() as patch:
        patch.setattr(Runtime, "_expert_buffers", lambda self: None)
        without = _runtime(sets)
    experts_bytes = _buffer_bytes(rt) - _buffer_bytes(without)
    assert experts_bytes == (c * L + S) * m.expert_bytes
    assert (c * L + S) < L * m.E                       # less than every expert of every layer
    # the memory model's expert items count the same
    model = memory_footprint(rt.plan).gpu
    assert sum(v for k, v in model.items() if "expert" in k) == experts_bytes


def test_the_cache_plans_rounds_that_never_overwrite_what_is_still_to_be_read():
    """LayerCache.plan over random micro-batches of several layers sharing one staging area,
    played on a pool that records which (layer, expert) each slot holds: every expert a round
    computes is in its slot then, no layer's cached expert is overwritten by another's, a round
    stages at most S, each miss is copied once, the cache keeps what an LRU replay keeps, and
    the layers' slots and the staging area always split the pool."""
    rng = random.Random(0)
    rounds_seen = swaps_seen = 0
    for _ in range(300):
        L, n_exp = rng.randint(1, 3), rng.randint(2, 8)
        c, S = rng.randint(0, n_exp), rng.randint(1, n_exp)
        popular = rng.random() < 0.3
        pool: list = [None] * (c * L + S)
        fixed = [sorted(rng.sample(range(n_exp), c)) for _ in range(L)]
        caches = []
        for l in range(L):
            owned = list(range(l * c, (l + 1) * c))
            caches.append(LayerCache(owned, fixed[l] if popular else None))
            if popular:
                for slot, e in zip(owned, fixed[l]):
                    pool[slot] = (l, e)
        staging = list(range(c * L, c * L + S))
        replay = [OrderedDict() for _ in range(L)]
        for _ in range(40):
            l = rng.randrange(L)
            wanted = sorted(rng.sample(range(n_exp), rng.randint(1, n_exp)))
            held = set(fixed[l]) if popular else set(replay[l])
            misses = [e for e in wanted if e not in held]
            before = list(staging)
            rounds = caches[l].plan(wanted, staging)
            rounds_seen += len(rounds) > 1
            swaps_seen += set(staging) != set(before)
            copied, computed = [], []
            for r, round_ in enumerate(rounds):
                staged = [slot for _, slot in round_.copies if r or slot in before]
                assert len(staged) <= S
                for e, slot in round_.copies:
                    pool[slot] = (l, e)
                    copied.append(e)
                for e, slot in round_.compute.items():
                    assert pool[slot] == (l, e), "an expert read from a slot overwritten"
                    computed.append(e)
            assert sorted(copied) == misses                          # each miss once
            assert sorted(computed) == wanted                        # each chosen once
            if not popular:
                for e in wanted:
                    replay[l].pop(e, None)
                    replay[l][e] = None
                while len(replay[l]) > c:
                    replay[l].popitem(last=False)
                assert list(caches[l].lru) == list(replay[l])
            # every layer's cached experts are still where its cache says
            for k, cache in enumerate(caches):
                mapping = cache.fixed if popular else cache.lru
                for e, slot in mapping.items():
                    assert pool[slot] == (k, e)
            used = [s for cache in caches
                    for s in [*(cache.fixed if popular else cache.lru).values(), *cache.free]]
            assert sorted(used + staging) == list(range(c * L + S))
    assert rounds_seen and swaps_seen          # both paths were exercised


@pytest.mark.parametrize("k", [3, 4])
def test_rounds_sum_each_token_exactly_as_the_reference_for_any_k(k):
    """ExpertSum, experts added in any split and order, gives experts()' result bit for bit:
    the outputs fill their rows and the gated sum is taken once (k = 3 and 4, where adding
    a token's terms in another order could differ)."""
    from taskgraph.kernels.ops import ExpertSum, experts
    from taskgraph.scenario import load_scenario

    m = load_scenario(TINY, [f"model.k={k}"]).model
    g = torch.Generator().manual_seed(k)
    T = 40
    x = torch.randn(T, m.h, generator=g)
    ids = torch.stack([torch.randperm(m.E, generator=g)[:k] for _ in range(T)])
    gates = torch.rand(T, k, generator=g)
    W = {}
    for e in range(m.E):
        W[f"w13.{e}"] = torch.randn(2 * m.h_i, m.h, generator=g) / m.h ** 0.5
        W[f"w2.{e}"] = torch.randn(m.h, m.h_i, generator=g) / m.h_i ** 0.5
    whole = experts(x, ids, gates, W, m)
    parts = ExpertSum(x, ids, gates, m)
    chosen = list(parts.chosen)
    random.Random(k).shuffle(chosen)
    for r in range(0, len(chosen), 3):
        parts.add(W, chosen[r:r + 3])
    assert torch.equal(parts.result(), whole)
    # the rounds' partial sums added to each other instead are not always the same
    rounds = [experts(x, ids, gates, W, m, frozenset(chosen[r:r + 3]))
              for r in range(0, len(chosen), 3)]
    assert not torch.equal(sum(rounds[1:], rounds[0]), whole)


def test_route_follows_the_previous_gpuffn_on_the_gpu_stream():
    """What sharing one staging area across layers and micro-batches rests on: on EC's GPU
    stream every Route is followed by its own GPUFFN before the next Route (prefill and
    decode, across layers and micro-batches), and each ExpertIn waits for its Route."""
    from taskgraph.kinds import KIND_NAMES
    from taskgraph.scenario import for_schedule, load_scenario

    sc, _ = for_schedule(load_scenario(TINY, ["policy.experts_gpu=2", "policy.N=6",
                                              "policy.mu=2", "workload.gen_len=3"]), "EC")
    program = compile_plan(make_plan(sc, "EC"))
    gpu = program.streams.index("gpu")
    seq = [(KIND_NAMES[k], int(s), int(l), int(j)) for k, s, l, j, st in zip(
        program.column("kind"), program.step, program.column("layer"),
        program.column("index"), program.column("stream"))
        if st == gpu and KIND_NAMES[k] in ("Route", "GPUFFN")]
    steps = len({s for _, s, _, _ in seq})
    assert steps >= 3 and len(seq) == 2 * steps * 4 * 3        # 4 layers, 3 micro-batches
    assert [kind for kind, *_ in seq] == ["Route", "GPUFFN"] * (len(seq) // 2)
    assert all(a[1:] == b[1:] for a, b in zip(seq[::2], seq[1::2]))
    for template in program.templates:
        g = template.graph
        for node, data in g.nodes(data=True):
            if data["kind"] == "ExpertIn":
                assert any(g.nodes[p]["kind"] == "Route" and
                           all(g.nodes[p][f] == data[f] for f in ("step", "layer", "index"))
                           for p in g.predecessors(node))
