"""The executor runs ECP: EC's expert cache, and a prefetch one layer ahead (ExpertAhead) with
Mixtral-offloading's speculative guess, layer l's router applied to the hidden state layer
l - 1's router saw. Tokens are the reference's and transformers'; guards show that the prefetch
area is what keeps a guess from landing on a slot still to be read, and that ExpertIn still
copies what a guess missed; the measured accuracy is recomputed here from the reference
forward's own hidden states.

What is checked against what:

* tokens and logits: the sequential reference, and transformers' MixtralForCausalLM;
* the cache: ECP's ExpertIn copies plus the prefetched experts it took equal EC's copies on the
  same run (which tests/test_expert_exec.py checks against an LRU replayed over the recorded
  routing): a prefetch changes when a miss crosses, not what the cache holds;
* the predictor: its counts equal a prediction recomputed in this file from the hidden states
  the reference forward's router saw (kernels.ops.route wrapped), with layer l's router from
  the checkpoint, against the reference's own choices; and on a model whose layers share one
  router and barely change the hidden state, every guess for layers 1.. is right.
"""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")

from taskgraph.dag.builder import make_plan  # noqa: E402
from taskgraph.dag.compiled import compile_plan  # noqa: E402
from taskgraph.exec.dispatch import CudaDevice, execute  # noqa: E402
from taskgraph.exec.runtime import Runtime  # noqa: E402
from taskgraph.kernels import ops  # noqa: E402
from taskgraph.kernels.reference import reference_forward, synthetic_prompts  # noqa: E402
from taskgraph.kernels.weights import layer_sections, synthetic_weights  # noqa: E402
from taskgraph.kinds import KIND_INDEX  # noqa: E402
from taskgraph.scenario import for_schedule, load_scenario  # noqa: E402
from tests.test_expert_exec import (CUDA, SKEWED, TINY, _assert_reference,  # noqa: E402
                                    _execute, _runtime, hf_checkpoint)

__all__ = ["hf_checkpoint"]            # a fixture, used below

# --- 1. tokens: the reference's and transformers' -------------------------------------------

ECP_SETTINGS = [
    ("policy.experts_gpu=0",),                              # no cache: every guess copied
    ("policy.experts_gpu=2",),
    ("policy.experts_gpu=8",),                              # every expert cached, after warm-up
    ("policy.experts_gpu=2", "policy.eviction=popular"),
    ("policy.experts_gpu=0", "policy.eviction=popular"),
    ("policy.experts_gpu=3", "policy.eviction=popular", *SKEWED),
    ("policy.experts_gpu=1", "policy.N=1", "policy.mu=1"),             # one sequence
    ("policy.experts_gpu=2", "policy.N=2", "policy.mu=2"),             # one micro-batch
    ("policy.experts_gpu=3", "policy.N=6", "policy.mu=2", "policy.r_w=1.0", "policy.r_c=1.0"),
    ("policy.experts_gpu=2", "model.L=1", "policy.N=4", "policy.mu=2"),  # one layer
]


@pytest.mark.parametrize("sets", ECP_SETTINGS, ids=lambda s: " ".join(s))
def test_ecp_computes_what_the_reference_computes(sets):
    result = _execute("ECP", *sets, steps=4)
    assert result.failure is None and result.summary["schedule"] == "ECP"
    _assert_reference(result.summary)
    pf = result.summary["experts"]["prefetch"]
    assert pf["predicted"] > 0 and len(pf["by_layer"]) == result.summary["layers"]


def test_zero_copy_ecp_moves_nothing_and_predicts_nothing():
    """Zero copy makes every host-device copy a no-op, ExpertAhead included: EC's result."""
    s = _execute("ECP", "policy.experts_gpu=2", zero_copy=True).summary
    _assert_reference(s)
    assert s["experts"]["prefetch"]["predicted"] == 0
    assert s["experts"]["prefetch"]["accuracy"] is None


def _run(sc, w, prompts, lens=None, delay=None, record_logits=False, patch=None, device="cpu"):
    """A Runtime for scenario `sc` run on these weights and prompts (optionally `patch`ed after
    construction, with `delay(task id)` seconds before each task) on `device`; returns it."""
    plan = make_plan(sc)
    rt = Runtime(plan, w, prompts, torch.device(device), prompt_lens=lens,
                 record_logits=record_logits, pin_memory=device == "cuda")
    if patch is not None:
        patch(rt)
    program = compile_plan(plan)
    gpu = CudaDevice(torch) if device == "cuda" else None
    run = execute(program, rt, gpu, delay=delay(program) if delay else None)
    assert not run.interrupted and run.failure is None, run.failure
    return rt


def _checkpoint_scenario(folder, prompts, lens, mu, policy):
    from taskgraph.scenario import scenario_from_dict
    from tests.test_transformers_parity import STEPS

    return scenario_from_dict({
        "model": {"hf_config": str(folder / "config.json"), "dtype_bytes": 4},
        "hardware": "t4", "workload": {"prompt_len": prompts.shape[1], "gen_len": STEPS},
        "policy": {"N": len(lens), "mu": mu, "A_g": 1, "F_g": 0, **policy},
        "schedule": "ECP"})


@pytest.mark.parametrize("mu,policy", [
    (2, {"experts_gpu": 1, "eviction": "lru"}),
    (6, {"experts_gpu": 2, "eviction": "lru"}),              # one micro-batch
    (2, {"experts_gpu": 0, "eviction": "lru"}),
    (2, {"experts_gpu": 2, "eviction": "popular"}),
    (1, {"experts_gpu": 1, "eviction": "lru"}),              # rounds in prefill
    (3, {"experts_gpu": 0, "eviction": "popular", "r_w": 1.0, "r_c": 1.0}),
])
@pytest.mark.parametrize("device", ["cpu", *CUDA])
def test_tokens_and_logits_are_transformers_own(hf_checkpoint, mu, policy, device):
    from taskgraph.kernels.weights import load_safetensors

    folder, prompts, lens, expected = hf_checkpoint
    sc = _checkpoint_scenario(folder, prompts, lens, mu, policy)
    w = load_safetensors(folder, sc.model, torch.float32)
    rt = _run(sc, w, prompts, lens, record_logits=True, device=device)
    tokens, step_logits = rt.outputs()[0], rt.step_logits.cpu()
    for i, (hf_tokens, hf_logits) in enumerate(expected):
        assert tokens[i].tolist() == hf_tokens.tolist(), f"request {i} ({lens[i]} tokens)"
        torch.testing.assert_close(step_logits[i], hf_logits, rtol=0, atol=2e-4)
    # the prefetch ran, and some of what it copied was taken instead of a copy
    assert sum(rt.cache.prefetch_counts.predicted) > 0 and sum(rt.cache.prefetch_counts.taken) > 0
    assert rt.cache.prefetch_slots == min(4, len(lens) * 2)


# --- 2. what a prefetch changes: when a miss crosses, not what the cache holds --------------

@pytest.mark.parametrize("sets", [
    ("policy.experts_gpu=2",),
    ("policy.experts_gpu=0",),
    ("policy.experts_gpu=3", "policy.N=2", "policy.mu=2"),
    ("policy.experts_gpu=2", "policy.eviction=popular", *SKEWED),
    ("policy.experts_gpu=1", "policy.N=1", "policy.mu=1"),
])
def test_ecp_copies_what_ec_copies_less_what_it_took(sets):
    ec = _execute("EC", *sets, steps=6).summary["experts"]
    ecp = _execute("ECP", *sets, steps=6).summary["experts"]
    pf = ecp["prefetch"]
    taken = [row["taken"] for row in pf["by_layer"]]
    assert [a + b for a, b in zip(ecp["copies_by_layer"], taken)] == ec["copies_by_layer"]
    assert sum(taken) > 0                           # the prefetch saved some copies
    for row in pf["by_layer"]:
        assert 0 <= row["taken"] <= min(row["copies"], row["misses"])
        assert 0 <= row["used"] <= row["predicted"]


# --- 3. guards ---------------------------------------------------------------------------------

def _tiny(*sets, schedule="ECP", steps=4):
    sc, _ = for_schedule(load_scenario(TINY, [*sets, f"workload.gen_len={steps}"]), schedule)
    w = synthetic_weights(sc.model, seed=0)
    prompts = synthetic_prompts(sc.policy.N, sc.workload.context_prompt, sc.model.V, seed=1)
    return sc, w, prompts


def _reference(sc, w, prompts):
    return reference_forward(w, prompts, sc.policy.mu, sc.decode_steps)


def _late(kind, seconds=0.03):
    """A delay for dispatch: `seconds` before every decode task of `kind`."""
    def make(program):
        kinds, steps = program.column("kind"), program.step
        return lambda gid: seconds if kinds[gid] == KIND_INDEX[kind] and steps[gid] else 0.0
    return make


def _tokens_match(rt, ref) -> bool:
    tokens, logits, _ = rt.outputs()
    return torch.equal(tokens, ref.tokens) and float((logits - ref.logits).abs().max()) < 1e-4


@pytest.mark.parametrize("sets", [("policy.experts_gpu=0", "policy.N=2", "policy.mu=2"),
                                  ("policy.experts_gpu=2", "policy.eviction=popular",
                                   "policy.N=2", "policy.mu=2")])
def test_a_prefetch_into_the_staging_area_breaks_the_layer_before(sets):
    """What the prefetch area guards. With GPUFFN held back, ExpertAhead(l) runs while layer
    l - 1's GPUFFN has yet to read the misses ExpertIn(l - 1) staged. Into its own area the
    guesses land beside them (the reference's tokens); into the staging area, as if it were
    free, they overwrite them (every miss of these caches is staged) and the tokens break."""
    sc, w, prompts = _tiny(*sets)
    ref = _reference(sc, w, prompts)
    assert _tokens_match(_run(sc, w, prompts, delay=_late("GPUFFN")), ref)

    def into_staging(rt):
        rt.cache.prefetch_area = rt.cache.staging                    # the same slots, the same list
        rt.cache.take_prefetched = lambda *args: None      # nothing taken: ExpertIn copies all

    assert not _tokens_match(_run(sc, w, prompts, delay=_late("GPUFFN"), patch=into_staging),
                             ref)


def test_a_taken_slot_must_leave_the_prefetch_area():
    """When ExpertIn takes a prefetched expert, the prefetch slot holding it joins the cache or
    the staging area, and the slot its copy was planned into joins the prefetch area. Read in
    place instead (the copy still made, so the cache stays right), the slot stays in the area
    and the next layer's ExpertAhead, not waiting for this layer's GPUFFN, overwrites it
    before GPUFFN reads it: the tokens break."""
    sets = ("policy.experts_gpu=2", "policy.N=2", "policy.mu=2")
    sc, w, prompts = _tiny(*sets, steps=6)
    ref = _reference(sc, w, prompts)
    kept = _run(sc, w, prompts, delay=_late("GPUFFN"))
    assert _tokens_match(kept, ref) and sum(kept.cache.prefetch_counts.taken) > 0

    def read_in_place(rt):
        def take(s, l, j, wanted, rounds):
            if rt.cache.ahead is not None and rt.cache.ahead[:2] == (s, l):
                for e, slot in rt.cache.ahead[3].items():
                    if e in rounds[0].compute:
                        rounds[0].compute[e] = slot
        rt.cache.take_prefetched = take

    assert not _tokens_match(_run(sc, w, prompts, delay=_late("GPUFFN"), patch=read_in_place),
                             ref)


def test_without_copying_what_the_guess_missed_the_tokens_break():
    """ExpertIn copies what is still missing once the router has chosen: made to skip it (as
    if every miss had been prefetched), the slots hold stale experts and the tokens break."""
    sets = ("policy.experts_gpu=2", "policy.N=2", "policy.mu=2")
    sc, w, prompts = _tiny(*sets)
    ref = _reference(sc, w, prompts)
    assert _tokens_match(_run(sc, w, prompts), ref)

    def trust_the_guess(rt):
        real = rt.cache.take_prefetched

        def take(s, l, j, wanted, rounds):
            real(s, l, j, wanted, rounds)
            if s:
                rounds[0].copies.clear()
        rt.cache.take_prefetched = take

    assert not _tokens_match(_run(sc, w, prompts, patch=trust_the_guess), ref)


def test_random_delays_leave_the_tokens_alone():
    """Tasks held back at random (every kind, every stream): whatever order the streams'
    threads take within the graph's edges, the tokens are the reference's."""
    for seed, sets in enumerate([("policy.experts_gpu=0",), ("policy.experts_gpu=2",),
                                 ("policy.experts_gpu=2", "policy.eviction=popular"),
                                 ("policy.experts_gpu=3", "policy.N=2", "policy.mu=1")]):
        sc, w, prompts = _tiny(*sets, steps=3)
        rng = random.Random(seed)

        def delay(program, rng=rng):
            shakes = [rng.choice((0.0, 0.0, 0.002, 0.01)) for _ in range(program.total)]
            return lambda gid: shakes[gid]

        assert _tokens_match(_run(sc, w, prompts, delay=delay), _reference(sc, w, prompts)), sets


# --- 4. the order the comments in exec/runtime.py rely on -------------------------------------

@pytest.mark.parametrize("sets", [("policy.N=6", "policy.mu=2"), ("policy.N=2", "policy.mu=2"),
                                  ("policy.N=4", "policy.mu=2", "model.L=1")])
def test_the_graph_orders_what_the_prefetch_relies_on(sets):
    """On ECP's compiled graph: each ExpertAhead(s, l) is on the h2d stream after D3(s, l) (the
    router it reads) and ExpertIn(l - 1, 0), before ExpertIn(l - 1, 1); it depends on
    Route(l - 1, 0) and every GPUFFN(s, l, j) on it; and on the GPU stream Route(l + 1, 0)
    (the next writer of the buffer it reads) follows GPUFFN(s, l, 0)."""
    from taskgraph.dag.builder import launch_sequence

    sc, _ = for_schedule(load_scenario(TINY, ["policy.experts_gpu=2", "workload.gen_len=3",
                                              *sets]), "ECP")
    plan = make_plan(sc, "ECP")
    program = compile_plan(plan)
    L, n = plan.L, plan.n
    order = {}              # task -> (its stream, where it is launched)
    for d in range(plan.G + 1):
        for key in launch_sequence(plan, d):
            order[key.kind, key.step, key.layer, key.index] = (plan.stream_of(key), len(order))
    ahead = [k for k in order if k[0] == "ExpertAhead"]
    assert len(ahead) == plan.G * L
    for _, s, l, _ in ahead:
        stream, at = order["ExpertAhead", s, l, 0]
        prev = (s, l - 1) if l else (s - 1, L - 1)
        assert stream == order["D3", s, l, 0][0] == order["ExpertIn", *prev, 0][0] == "h2d"
        assert order["D3", s, l, 0][1] < at
        assert order["ExpertIn", *prev, 0][1] < at
        if n > 1 and prev[0]:               # (layer 0 of step 1: after all of prefill)
            assert at < order["ExpertIn", *prev, 1][1]
        nxt = (s, l + 1) if l + 1 < L else (s + 1, 0)
        if nxt[0] <= plan.G:
            assert order["GPUFFN", s, l, 0][1] < order["Route", *nxt, 0][1]
            assert order["Route", *nxt, 0][0] == order["GPUFFN", s, l, 0][0] == "gpu"
    for template in program.templates:
        g = template.graph
        for node, data in g.nodes(data=True):
            if data["external"]:
                continue
            preds = {(g.nodes[p]["kind"], g.nodes[p]["step"], g.nodes[p]["layer"],
                      g.nodes[p]["index"]) for p in g.predecessors(node)}
            s, l = data["step"], data["layer"]
            if data["kind"] == "ExpertAhead":
                prev = (s, l - 1) if l else (s - 1, L - 1)
                assert ("Route", *prev, 0) in preds
            if data["kind"] == "GPUFFN" and s:
                assert ("ExpertAhead", s, l, 0) in preds


# --- 5. memory: the prefetch area is the memory model's --------------------------------------

@pytest.mark.parametrize("c,N,mu", [(2, 8, 2), (0, 2, 2), (3, 1, 1), (1, 2, 1)])
def test_ecp_allocates_the_memory_models_prefetch_area(monkeypatch, c, N, mu):
    """The experts' device bytes are c * L + S + A experts: the cache, the staging area
    S = min(E, mu k) and the prefetch area A = min(E, N k), item for item the memory model's
    (taskgraph.perf.memory: "expert prefetch (N x k)")."""
    from taskgraph.perf.memory import memory_footprint
    from tests.test_expert_exec import _buffer_bytes

    sets = [f"policy.experts_gpu={c}", f"policy.N={N}", f"policy.mu={mu}"]
    rt = _runtime(sets, "ECP")
    m, L = rt.m, rt.L
    A = min(m.E, N * m.k)
    assert rt.cache.prefetch_slots == A and len(rt.cache.prefetch_area) == A
    with monkeypatch.context() as patch:
        patch.setattr(Runtime, "_expert_buffers", lambda self: None)
        without = _runtime(sets, "ECP")
    experts_bytes = _buffer_bytes(rt) - _buffer_bytes(without)
    assert experts_bytes == (c * L + min(m.E, mu * m.k) + A) * m.expert_bytes
    model = memory_footprint(rt.plan).gpu
    assert model["expert prefetch (N x k)"] == A * m.expert_bytes
    assert sum(v for k, v in model.items() if "expert" in k) == experts_bytes


# --- 6. the predictor's accuracy, recomputed -------------------------------------------------

def _router(w, l):
    m = w.model
    sec = next(s for s in layer_sections(m) if s.name == "router")
    return w.layers[l][sec.offset:sec.offset + sec.size].view(sec.shape)


def _expected_counts(w, prompts, mu, steps, lens, monkeypatch):
    """Per layer, (predicted, used) recomputed from the reference forward: the hidden state
    each of its router calls saw (micro-batch 0's rows), layer l's router applied to layer
    l - 1's (to the last layer's of the step before for layer 0; in prefill each sequence's
    last prompt token), each row's top k against what the reference's router chose for layer
    l."""
    m = w.model
    seen, ids = [], []
    real = ops.route

    def route(x, W, model):
        seen.append(x.detach().clone())
        ids.append(real(x, W, model)[0])
        return ids[-1], real(x, W, model)[1]

    with monkeypatch.context() as patch:
        patch.setattr(ops, "route", route)
        reference_forward(w, prompts[:mu], mu, steps, None if lens is None else lens[:mu])
    # micro-batch 0 only (the first mu sequences): prefill's L calls, then L a step
    assert len(seen) == m.L * (steps + 1)
    P = prompts.shape[1]
    last = (lens[:mu] if lens is not None else torch.full((mu,), P)) - 1
    hidden = {(0, m.L - 1): seen[m.L - 1].view(mu, P, m.h)[torch.arange(mu), last]}
    chosen = {}
    for s in range(1, steps + 1):
        for l in range(m.L):
            hidden[s, l] = seen[s * m.L + l]
            chosen[s, l] = set(ids[s * m.L + l].flatten().tolist())
    predicted, used = [0] * m.L, [0] * m.L
    for s in range(1, steps + 1):
        for l in range(m.L):
            x = hidden[(s, l - 1) if l else (s - 1, m.L - 1)]
            guess = set((x @ _router(w, l).T).float().softmax(-1).topk(m.k).indices
                        .flatten().tolist())
            predicted[l] += len(guess)
            used[l] += len(guess & chosen[s, l])
    return predicted, used


@pytest.mark.parametrize("sets", [("policy.experts_gpu=2",),
                                  ("policy.experts_gpu=0", "policy.N=1", "policy.mu=1"),
                                  ("policy.experts_gpu=8", "policy.N=6", "policy.mu=3")])
def test_the_measured_accuracy_is_the_guess_recomputed_from_the_reference(monkeypatch, sets):
    sc, w, prompts = _tiny(*sets, steps=5)
    rt = _run(sc, w, prompts)
    assert _tokens_match(rt, _reference(sc, w, prompts))
    predicted, used = _expected_counts(w, prompts, sc.policy.mu, sc.decode_steps, None,
                                       monkeypatch)
    assert rt.cache.prefetch_counts.predicted == predicted
    assert rt.cache.prefetch_counts.used == used
    assert 0 < sum(used) < sum(predicted)          # a guess, right some of the time


def test_the_accuracy_on_a_transformers_checkpoint_is_recomputed_too(hf_checkpoint,
                                                                      monkeypatch):
    from taskgraph.kernels.weights import load_safetensors

    folder, prompts, lens, _ = hf_checkpoint
    sc = _checkpoint_scenario(folder, prompts, lens, 2, {"experts_gpu": 1})
    w = load_safetensors(folder, sc.model, torch.float32)
    rt = _run(sc, w, prompts, lens)
    predicted, used = _expected_counts(w, prompts, 2, sc.decode_steps, lens, monkeypatch)
    assert (rt.cache.prefetch_counts.predicted, rt.cache.prefetch_counts.used) == (predicted, used)


def test_a_model_whose_layers_agree_is_predicted_right(monkeypatch):
    """Every layer with layer 0's router, and attention and experts scaled down so a layer
    barely changes the hidden state: the guess for layers 1.. (from the layer before, the same
    router on nearly the same rows) is always right and every copy it made is taken; layer
    0's, from the previous token's last layer, is a different token's and right less often."""
    sc, w, prompts = _tiny("policy.experts_gpu=0", "policy.N=2", "policy.mu=2", steps=6)
    m = w.model
    sections = {s.name: s for s in layer_sections(m)}
    for l in range(m.L):
        _router(w, l).copy_(_router(w, 0))
        w.norms[l] = (w.norms[l][0], w.norms[0][1])
        for name in ["o"] + [f"w2.{e}" for e in range(m.E)]:
            sec = sections[name]
            w.layers[l][sec.offset:sec.offset + sec.size] *= 1e-4
    rt = _run(sc, w, prompts)
    assert _tokens_match(rt, _reference(sc, w, prompts))
    pf = rt.cache.prefetch_counts.to_dict()["by_layer"]
    assert all(row["accuracy"] == 1.0 and row["taken"] == row["copies"] for row in pf[1:])
    assert pf[0]["accuracy"] < 1.0


# --- 7. the summary ----------------------------------------------------------------------------

def test_the_cli_reports_the_prefetch(capsys):
    from taskgraph.cli import main

    assert main(["execute", TINY, "--device", "cpu", "--schedule", "ECP", "--steps", "4",
                 "--set", "policy.experts_gpu=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    _assert_reference(out)
    pf = out["experts"]["prefetch"]
    rows = pf["by_layer"]
    assert len(rows) == out["layers"] == 4
    for key in ("predicted", "used", "copies", "taken", "misses"):
        assert pf[key] == sum(row[key] for row in rows)
    assert 0 <= pf["used"] <= pf["predicted"] and pf["accuracy"] == round(
        pf["used"] / pf["predicted"], 6)
    assert pf["covered"] == round(pf["taken"] / pf["misses"], 6)
    # the run's policy is the share its own predictor covered, not the published figure an
    # unset policy.prefetch stands for in a simulation
    assert out["policy"]["prefetch"] == pf["covered"]
    assert out["experts"]["copies"] == sum(out["experts"]["copies_by_layer"])
    # EC's JSON has no prefetch
    assert main(["execute", TINY, "--device", "cpu", "--schedule", "EC", "--steps", "2",
                 "--set", "policy.experts_gpu=2", "--json"]) == 0
    assert "prefetch" not in json.loads(capsys.readouterr().out)["experts"]
