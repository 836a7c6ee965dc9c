"""Requests and batching: request files, generated lengths, Algorithm 2 (docs/design.md §3.7)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskgraph.cli import main
from taskgraph.kinds import KIND_NAMES
from taskgraph.errors import TgError
from taskgraph.serving.requests import (Request, algorithm2, generate_requests, pack, read_requests,
                                refill, summary)
from taskgraph.scenario import load_scenario
from taskgraph.sim.simulate import simulate_scenario

requests_st = st.lists(st.tuples(st.integers(1, 400), st.integers(1, 64)), min_size=1,
                       max_size=120).map(
    lambda rows: [Request(str(i), p, g) for i, (p, g) in enumerate(rows)])


@settings(max_examples=150, deadline=None)
@given(requests_st, st.integers(1, 8), st.integers(1, 6), st.integers(50, 2000),
       st.booleans())
def test_packing_places_every_request_once_within_its_limits(requests, ubs, n_ub, cache,
                                                             padded):
    packing = pack(requests, ubs, n_ub, cache, padded=padded)
    placed = [r.id for b in packing.batches for mb in b for r in mb.requests]
    aborted = [r.id for r in packing.aborted]
    assert sorted(placed + aborted, key=int) == [r.id for r in requests]   # each exactly once
    longest = max(r.prompt_len for r in requests)
    for r in packing.aborted:                       # aborted only if it cannot fit alone
        assert (longest if padded else r.prompt_len) + r.gen_len > cache
    for batch in packing.batches:
        assert 1 <= len(batch) <= n_ub
        for mb in batch:
            assert 1 <= len(mb.requests) <= ubs
            counted = sum((longest if padded else r.prompt_len) + r.gen_len
                          for r in mb.requests)
            assert mb.tokens == counted <= cache        # no micro-batch past its cache


@settings(max_examples=150, deadline=None)
@given(requests_st, st.integers(1, 8), st.integers(1, 6))
def test_algorithm2_stays_balanced(requests, ubs, n_ub):
    """Longest first, each into the emptiest micro-batch: within a batch, micro-batches differ
    by at most the longest prompt (with room in the cache, so only the ubs limit closes them)."""
    cache = sum(r.tokens for r in requests)
    batch, rest = algorithm2(requests, ubs, n_ub, cache)
    tokens = [mb.prompt_tokens for mb in batch]
    if len(batch) == n_ub:
        assert max(tokens) - min(tokens) <= max(r.prompt_len for r in requests)
    assert len(rest) == max(0, len(requests) - ubs * n_ub)
    # What waits is what Algorithm 2 reached last: the shortest prompts.
    if rest:
        assert max(r.prompt_len for r in rest) <= min(r.prompt_len for mb in batch
                                                      for r in mb.requests)


@settings(max_examples=150, deadline=None)
@given(requests_st, st.integers(1, 8), st.integers(1, 6), st.integers(20, 400),
       st.sampled_from([1024, 3, 1]))
def test_packing_the_queue_is_algorithm2_batch_after_batch(requests, ubs, n_ub, cache, block):
    """`pack` finds the batches in one sort; they must be exactly what Algorithm 2 gives run
    on the queue batch after batch, carrying over what each batch rejects (the paper's loop),
    caches tight enough that requests are skipped included; whatever the blocks its scan for
    the next request that fits goes by (a few requests each, so that queues this size span
    many)."""
    from taskgraph.serving import requests as module

    queue = [r for r in requests if r.tokens <= cache]
    expected = []
    while queue:
        batch, queue = algorithm2(queue, ubs, n_ub, cache)
        expected.append([[r.id for r in mb.requests] for mb in batch])
    before, module._BLOCK = module._BLOCK, block
    try:
        got = pack(requests, ubs, n_ub, cache).batches
    finally:
        module._BLOCK = before
    assert [[[r.id for r in mb.requests] for mb in b] for b in got] == expected


def test_rejected_requests_carry_over_in_order():
    reqs = [Request("e", 3, 3), Request("a", 90, 10), Request("b", 80, 10), Request("c", 5, 5),
            Request("d", 4, 5)]
    batch, rest = algorithm2(reqs, ubs=3, n_ub=1, cache_tokens=120)
    # a (100 tokens) first; b would pass 120; c and d fit, and close the micro-batch at 3.
    assert [r.id for r in batch[0].requests] == ["a", "c", "d"]
    assert [r.id for r in rest] == ["e", "b"]                  # in their arrival order
    packing = pack(reqs, ubs=3, n_ub=1, cache_tokens=120)
    assert [[r.id for r in mb.requests] for b in packing.batches for mb in b] == [
        ["a", "c", "d"], ["b", "e"]]


def test_generated_lengths_reproduce_mean_and_max():
    reqs = generate_requests(20000, 77, 418, 128, 128, seed=3)
    s = summary(reqs)
    assert s["prompt_max"] == 418 and s["prompt_mean"] == pytest.approx(77, rel=0.01)
    assert s["gen_max"] == s["gen_mean"] == 128
    assert min(r.prompt_len for r in reqs) >= 1
    assert len({r.prompt_len for r in reqs}) > 50             # a spread, not a constant
    assert generate_requests(200, 77, 418, 128, 128, seed=3) == reqs[:0] + \
        generate_requests(200, 77, 418, 128, 128, seed=3)      # deterministic by seed


def test_a_scenario_of_equal_requests_is_todays_mean_length_model(tmp_path):
    (tmp_path / "r.jsonl").write_text("".join(
        json.dumps({"prompt_len": 77, "gen_len": 8}) + "\n" for _ in range(64)))
    (tmp_path / "s.yaml").write_text(
        "model: tiny\nhardware: t4\nworkload: {requests: r.jsonl}\n"
        "policy: {N: 16, mu: 4}\nschedule: S1\n")
    listed = load_scenario(tmp_path / "s.yaml")
    mean = load_scenario("scenarios/tiny.yaml", ["policy.N=16", "policy.mu=4",
                                                 "workload.prompt_len=77", "workload.max_prompt_len=77",
                                                 "workload.gen_len=8"])
    assert len(listed.requests) == 64 and mean.requests is None
    a, b = simulate_scenario(listed).summary, simulate_scenario(mean).summary
    for key in ("throughput_tok_s", "prefill_s", "decode_s", "decode_layer_ms", "memory"):
        assert a[key] == b[key], key


def test_a_csv_file_and_a_preset(tmp_path):
    (tmp_path / "r.csv").write_text("id,prompt_len,gen_len\nq1,10,4\nq2,30,8\n")
    assert read_requests(tmp_path / "r.csv") == [Request("q1", 10, 4), Request("q2", 30, 8)]
    sc = load_scenario("scenarios/tiny.yaml", ["workload.lengths.preset=helm-reasoning",
                                               "workload.lengths.count=500"])
    assert (sc.workload.prompt_len, sc.workload.max_prompt_len, sc.workload.gen_len) == (
        242, 256, 50)


@pytest.mark.parametrize("name, text, words", [
    ("empty.csv", "prompt_len,gen_len\n", ["holds no requests"]),
    ("empty.jsonl", "\n", ["holds no requests"]),
    ("words.csv", "prompt_len,gen_len\n12,lots\n", ["line 2", "gen_len", "'lots'"]),
    ("negative.jsonl", '{"prompt_len": -3, "gen_len": 4}\n', ["line 1", "prompt_len", "-3"]),
    ("fraction.jsonl", '{"prompt_len": 2.5, "gen_len": 4}\n', ["prompt_len", "2.5"]),
    ("zero.csv", "prompt_len,gen_len\n0,4\n", ["prompt_len", "'0'"]),
    ("header.csv", "prompt,gen\n1,2\n", ["lacks gen_len, prompt_len"]),
    ("notjson.jsonl", "{prompt_len: 3}\n", ["line 1", "not JSON"]),
    ("list.jsonl", "[3, 4]\n", ["line 1", "object"]),
    ("dup.csv", "id,prompt_len,gen_len\na,1,1\na,2,2\n", ["'a'", "twice"]),
])
def test_bad_request_files_get_one_clear_error(tmp_path, capsys, name, text, words):
    (tmp_path / name).write_text(text)
    (tmp_path / "s.yaml").write_text(
        f"model: tiny\nhardware: t4\nworkload: {{requests: {name}}}\n"
        "policy: {N: 8, mu: 2}\n")
    assert main(["simulate", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    for word in words:
        assert word in err, err


def test_unreadable_request_files(tmp_path):
    (tmp_path / "latin1.csv").write_bytes(b"prompt_len,gen_len\n1,2 \xe9\n")
    (tmp_path / "folder.csv").mkdir()
    for name, words in (("latin1.csv", "not UTF-8"), ("folder.csv", "does not exist"),
                        ("missing.csv", "does not exist")):
        with pytest.raises(TgError, match=words):
            read_requests(tmp_path / name)


def test_requests_too_long_for_the_cache_are_listed_as_aborted(tmp_path, capsys):
    rows = [{"id": "huge", "prompt_len": 5000, "gen_len": 8}] + [
        {"id": f"r{i}", "prompt_len": 20, "gen_len": 8} for i in range(15)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(
        "model: tiny\nhardware: t4\nworkload: {requests: r.jsonl}\n"
        "policy: {N: 8, mu: 2}\nschedule: S1\n")
    assert main(["batch", str(tmp_path / "s.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in out["aborted"]] == ["huge"]
    assert out["requests"] == 15 and out["micro_batches"] >= 8
    assert main(["batch", "scenarios/tiny.yaml"]) == 2
    assert "no request list" in capsys.readouterr().err


# --- the queue, simulated ---------------------------------------------------------------------

def _queue_scenario(tmp_path, rows, policy="{N: 8, mu: 2}", extra=""):
    (tmp_path / "r.jsonl").write_text("".join(
        json.dumps({"id": str(i), "prompt_len": p, "gen_len": g}) + "\n"
        for i, (p, g) in enumerate(rows)))
    (tmp_path / "s.yaml").write_text(
        f"model: tiny\nhardware: t4\nworkload: {{requests: r.jsonl{extra}}}\n"
        f"policy: {policy}\nschedule: S1\n")
    return load_scenario(tmp_path / "s.yaml")


def test_a_queue_of_equal_requests_is_todays_mean_length_model(tmp_path):
    from taskgraph.serving.queue import simulate_queue

    sc = _queue_scenario(tmp_path, [(40, 6)] * 16, policy="{N: 16, mu: 4}")
    q, mean = simulate_queue(sc).summary, simulate_scenario(sc).summary
    for key in ("throughput_tok_s", "prefill_s", "decode_s", "makespan_s", "decode_layer_ms",
                "hrm_layer_ms", "tasks"):
        assert q[key] == mean[key], key
    assert q["requests"]["batches"] == 1 and q["requests"]["generated_tokens"] == 16 * 6


def test_each_request_stops_at_its_own_length(tmp_path):
    """A micro-batch whose requests have all finished is skipped (its tasks take no time);
    one still generating is priced for what is left; a request finishes with its own last
    token, and each batch ends with its longest request."""
    from taskgraph.serving.queue import simulate_queue

    rows = [(30, 2), (30, 2), (30, 9), (30, 5), (12, 3), (45, 7), (8, 1), (20, 6)]
    q = simulate_queue(_queue_scenario(tmp_path, rows, policy="{N: 4, mu: 2}"), keep_runs=True)
    assert len(q.batches) >= 2
    for b, batch in zip(q.batches, q.packing.batches):
        prog, run = b.program, b.run
        kind, step, index = prog.column("kind"), prog.step, prog.column("index")
        post = kind == KIND_NAMES.index("PostAttn")
        dur = run.end - run.start
        for j, mb in enumerate(batch):
            last = max(r.gen_len for r in mb.requests)
            assert (dur[post & (index == j) & (step >= 1) & (step <= last)] > 0).all()
            assert (dur[post & (index == j) & (step > last)] == 0).all()
            for r in mb.requests:       # a request ends with its micro-batch's LM head
                lm = (kind == KIND_NAMES.index("LMHead")) & (index == j) & (step == r.gen_len)
                assert q.finish_s[r.id] == pytest.approx(b.offset_s + run.end[lm].max())
        ends = [q.finish_s[r.id] for mb in batch for r in mb.requests]
        assert max(ends) == pytest.approx(b.offset_s + b.summary["makespan_s"])
    assert q.summary["requests"]["generated_tokens"] == sum(g for _, g in rows)


def test_longer_prompts_cost_more_prefill(tmp_path):
    from taskgraph.serving.queue import simulate_queue

    short = simulate_queue(_queue_scenario(tmp_path, [(20, 3)] * 8)).summary
    long = simulate_queue(_queue_scenario(tmp_path, [(20, 3)] * 4 + [(200, 3)] * 4)).summary
    assert long["prefill_s"] > short["prefill_s"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 6)), min_size=1, max_size=20),
       st.sampled_from(["S1", "S2", "S3", "S4", "DS", "S5"]), st.booleans())
def test_simulated_queues_keep_the_invariants(tmp_path_factory, rows, schedule, padded):
    """Every request finishes exactly once with its own tokens; in every batch no task starts
    before its stream's previous one ends, the makespan covers the busiest resource, and the
    decode layer is never below the HRM bound."""
    from taskgraph.serving.queue import simulate_queue
    from taskgraph.scenario import for_schedule

    tmp = tmp_path_factory.mktemp("q")
    sc = _queue_scenario(tmp, rows, extra=f", padded: {str(padded).lower()}")
    sc, _ = for_schedule(sc, schedule)
    q = simulate_queue(sc, keep_runs=True)
    s = q.summary
    finished = len(rows) - len(s["requests"]["aborted"])
    assert len(q.finish_s) == finished == s["requests"]["finished"]
    assert s["requests"]["generated_tokens"] == sum(
        g for i, (p, g) in enumerate(rows) if str(i) in q.finish_s)
    assert s["decode_layer_ms"] >= s["hrm_layer_ms"] * (1 - 1e-9)
    for b in q.batches:
        prog, run = b.program, b.run
        stream = prog.column("stream")
        for sid in range(len(prog.streams)):
            ids = np.flatnonzero(stream == sid)
            assert (run.start[ids[1:]] >= run.end[ids[:-1]] - 1e-12).all()
        assert b.summary["decode_layer_ms"] >= b.summary["hrm_layer_ms"] * (1 - 1e-9)
    assert max(q.finish_s.values()) <= s["makespan_s"] * (1 + 1e-5)    # JSON: 6 digits


def test_simulate_cli_on_a_request_list(tmp_path, capsys):
    _queue_scenario(tmp_path, [(30, 3), (50, 4), (10, 2)] * 4)
    out_csv = tmp_path / "finish.csv"
    assert main(["simulate", str(tmp_path / "s.yaml"), "--json", "--csv", str(out_csv)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"]["count"] == 12 and out["requests"]["finished"] == 12
    lines = out_csv.read_text().splitlines()
    assert lines[0] == "id,prompt_len,gen_len,batch,micro_batch,prefill_step,finish_s"
    assert len(lines) == 13
    assert main(["simulate", "scenarios/tiny.yaml", "--csv", str(out_csv)]) == 2
    assert "lists no requests" in capsys.readouterr().err


def test_compare_puts_unpadded_next_to_padded_on_one_request_list(tmp_path, capsys):
    """The paper's headline comparison: S1 with Algorithm 2 against S4 padded, same requests."""
    _queue_scenario(tmp_path, [(60, 4), (10, 2), (35, 6), (5, 3)] * 4)
    path = str(tmp_path / "s.yaml")
    assert main(["compare", path, "--schedules", "S1,S4:padded", "--json"]) == 0
    s1, s4 = json.loads(capsys.readouterr().out)["results"]
    assert (s1["schedule"], s1["requests"]["padded"]) == ("S1", False)
    assert (s4["schedule"], s4["requests"]["padded"], s4["policy"]["A_g"]) == ("S4", True, 1)
    # padded, every request runs as long as the longest: the same tokens are counted
    assert s1["requests"]["generated_tokens"] == s4["requests"]["generated_tokens"] == 60
    assert main(["compare", "scenarios/tiny.yaml", "--schedules", "S4:padded"]) == 2
    assert "lists none" in capsys.readouterr().err


# --- refill: one continuous batch ------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(requests_st, st.integers(1, 8), st.integers(1, 6), st.integers(50, 2000))
def test_refill_admits_every_request_once_within_its_limits(requests, ubs, n_ub, cache):
    """Every request is admitted once (or aborted, only if it cannot fit alone), in queue
    order; at no step does a micro-batch hold more than `ubs` requests or reserve more than
    its cache; a request takes part in exactly its own gen_len decode steps."""
    cont = refill(requests, ubs, n_ub, cache)
    admitted = [a.request.id for a in cont.admissions]
    assert sorted(admitted + [r.id for r in cont.aborted], key=int) == [r.id for r in requests]
    assert all(r.tokens > cache for r in cont.aborted)
    steps = [a.step for a in cont.admissions]
    assert steps == sorted(steps) and admitted == sorted(admitted, key=int)   # first come first
    if not cont.admissions:
        return
    load = cont.load()
    for j in range(n_ub):
        mine = [a for a in cont.admissions if a.micro_batch == j]
        for d in range(cont.steps + 1):
            holding = [a for a in mine if a.step <= d <= a.last_step]
            assert len(holding) <= ubs
            assert sum(a.request.tokens for a in holding) <= cache
            decoding = [a for a in holding if a.step < d]
            assert load.seqs[j, d] == (len(decoding) if d else len(holding))
            assert load.ctx[j, d] == sum(a.request.prompt_len + d - a.step for a in decoding)
            assert load.ptok[j, d] == sum(a.request.prompt_len for a in mine if a.step == d)
    # every generated token is one decode step of one request
    assert load.seqs[:, 1:].sum() == sum(a.request.gen_len for a in cont.admissions)


def test_refill_never_leaves_a_slot_empty_while_the_queue_head_fits():
    cont = refill([Request(str(i), 10, g) for i, g in enumerate([5, 1, 3, 2, 8, 1, 1, 4])],
                  ubs=2, n_ub=2, cache_tokens=1000)
    by_id = {a.request.id: a for a in cont.admissions}
    assert [by_id[i].step for i in "0123"] == [0, 0, 0, 0]
    # "1" (gen 1) leaves after step 1, so "4" joins its micro-batch at step 2, and so on
    assert by_id["4"].step == 2 and by_id["4"].micro_batch == by_id["1"].micro_batch
    assert cont.steps == max(a.step + a.request.gen_len for a in cont.admissions)


def test_refill_of_a_queue_that_fits_one_batch_is_that_batch(tmp_path):
    """Nothing to refill: the continuous batch is the consecutive batch, to the number."""
    from taskgraph.serving.queue import simulate_queue

    rows = [(40, 6)] * 16
    one = simulate_queue(_queue_scenario(tmp_path, rows, policy="{N: 16, mu: 4}")).summary
    cont = simulate_queue(_queue_scenario(tmp_path, rows, policy="{N: 16, mu: 4}",
                                          extra=", refill: true")).summary
    for key in ("throughput_tok_s", "makespan_s", "decode_layer_ms", "tasks"):
        assert cont[key] == one[key], key
    assert cont["requests"]["refill"] and cont["requests"]["generated_tokens"] == 16 * 6


def test_refill_prefills_newcomers_inside_decode_steps_and_beats_waiting(tmp_path):
    """Requests of mixed lengths, twice the batch: with refill a newcomer's prompt is priced in
    the decode step that admits it (its micro-batch's PreAttn and PostAttn grow), each request
    still finishes with its own last token, and the queue ends sooner than in consecutive
    batches, each of which waits for its longest request."""
    from taskgraph.serving.queue import simulate_queue

    rows = [(30, 12), (30, 2), (20, 3), (40, 2), (25, 11), (35, 1), (30, 2), (20, 3)] * 2
    plain = simulate_queue(_queue_scenario(tmp_path, rows, policy="{N: 4, mu: 2}")).summary
    q = simulate_queue(_queue_scenario(tmp_path, rows, policy="{N: 4, mu: 2}",
                                       extra=", refill: true"), keep_runs=True)
    s = q.summary
    assert s["requests"]["finished"] == len(rows)
    assert s["requests"]["generated_tokens"] == plain["requests"]["generated_tokens"]
    assert s["makespan_s"] < plain["makespan_s"] and s["throughput_tok_s"] > plain[
        "throughput_tok_s"]
    prog, run = q.batches[0].program, q.batches[0].run
    kind, step, index = prog.column("kind"), prog.step, prog.column("index")
    flops, nbytes, _ = prog.work()
    # the same run with nobody admitted after step 0: only the admitting tasks change
    load = prog.plan.load
    bare = dataclasses.replace(load, ptok=np.where(np.arange(load.ptok.shape[1]) > 0, 0,
                                                   load.ptok),
                               psq=np.where(np.arange(load.psq.shape[1]) > 0, 0, load.psq))
    flops0, nbytes0, _ = dataclasses.replace(
        prog, plan=dataclasses.replace(prog.plan, load=bare)).work()
    late = [a for a in q.packing.admissions if a.step > 0]
    assert late
    admitting = np.zeros(prog.total, bool)
    for a in late:
        admitting |= (index == a.micro_batch) & (step == a.step)
        lm = (kind == KIND_NAMES.index("LMHead")) & (index == a.micro_batch) & (
            step == a.last_step)
        assert q.finish_s[a.request.id] == pytest.approx(run.end[lm].max())
    for k in ("PreAttn", "PostAttn", "D1"):
        sel = (kind == KIND_NAMES.index(k)) & admitting
        assert ((flops[sel] > flops0[sel]) | (nbytes[sel] > nbytes0[sel])).all(), k
    assert (flops[~admitting] == flops0[~admitting]).all()
    assert (nbytes[~admitting] == nbytes0[~admitting]).all()
    assert s["decode_layer_ms"] >= s["hrm_layer_ms"] * (1 - 1e-9)


def test_refill_needs_an_unpadded_request_list(tmp_path, capsys):
    assert main(["simulate", "scenarios/tiny.yaml", "--set", "workload.refill=true"]) == 2
    assert "refill needs a request list" in capsys.readouterr().err
    _queue_scenario(tmp_path, [(30, 3)] * 4)
    path = str(tmp_path / "s.yaml")
    assert main(["simulate", path, "--set", "workload.padded=true", "--set",
                 "workload.refill=true"]) == 2
    assert "refill runs requests unpadded" in capsys.readouterr().err
    assert main(["compare", path, "--schedules", "S1,S1:refill,S4:padded", "--json"]) == 0
    alg2, cont, padded = json.loads(capsys.readouterr().out)["results"]
    assert not alg2["requests"].get("refill") and cont["requests"]["refill"]
    assert padded["requests"]["padded"] and not padded["requests"].get("refill")
    assert main(["compare", path, "--schedules", "S1:fast"]) == 2
    assert "padded or refill" in capsys.readouterr().err


def test_search_verify_simulates_the_request_list(tmp_path, capsys):
    """The search ranks by the mean lengths; --verify simulates each candidate's whole queue,
    and what it reports is what simulating that queue gives."""
    from taskgraph.serving.queue import simulate_queue
    from taskgraph.study.search import Candidate

    rows = [(30, 12), (30, 2), (20, 3), (40, 2), (25, 11), (35, 1)] * 3
    sc = _queue_scenario(tmp_path, rows, extra=", refill: true")
    path = str(tmp_path / "s.yaml")
    assert main(["search", path, "--top", "3", "--verify", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("verified on the request list (18 requests, refill)" in n for n in out["notes"])
    best = Candidate(**{k: v for k, v in out["best"].items()
                        if k in Candidate.__dataclass_fields__})
    queue = simulate_queue(best.scenario(sc)).summary
    assert out["best"]["simulated_tok_s"] == queue["throughput_tok_s"]
    assert queue["requests"]["generated_tokens"] == sum(g for _, g in rows)


def test_the_hardware_limit_follows_the_request_distribution(tmp_path):
    """Equal lengths: the mean-length limit exactly. A spread at the same means: each request
    counts with its own lengths, and long generations hold their KV for longer per token."""
    from taskgraph.perf.limits import hardware_limit_tok_s

    def slow_link(sc):          # so that the KV capacity, not the GPU, bounds the tiny model
        link = sc.hardware.link.model_copy(update={"h2d_gbps": 0.001})
        return sc.model_copy(update={"hardware": sc.hardware.model_copy(update={"link": link})})

    equal = slow_link(_queue_scenario(tmp_path, [(40, 20)] * 8))
    mean = equal.model_copy()
    mean._requests = None
    assert hardware_limit_tok_s(equal) == pytest.approx(hardware_limit_tok_s(mean), rel=1e-12)
    spread = slow_link(_queue_scenario(tmp_path, [(40, 5), (40, 35)] * 4))
    assert spread.workload.gen_len == equal.workload.gen_len == 20
    p, g = 40.0, np.array([5.0, 35.0])
    pme = (2 * (p + g)).sum() / ((2 * p + g) * g).sum()
    ratio = pme / (2 * (p + 20) / ((2 * p + 20) * 20))
    assert hardware_limit_tok_s(spread) == pytest.approx(hardware_limit_tok_s(equal) * ratio)
    assert ratio < 1


def test_compare_on_a_request_list_traces_every_batch_of_every_queue(tmp_path, capsys):
    from taskgraph.tracing.check import check_trace, load_trace

    _queue_scenario(tmp_path, [(60, 4), (10, 2), (35, 6), (5, 3)] * 3)
    path, trace = str(tmp_path / "s.yaml"), tmp_path / "c.json"
    assert main(["compare", path, "--schedules", "S1,S1:refill", "--trace", str(trace),
                 "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    t = load_trace(trace)
    assert check_trace(t) == []
    names = [e["args"]["name"] for e in t["traceEvents"] if e.get("name") == "process_name"]
    batches = results[0]["requests"]["batches"]
    assert names == [f"{i + 1}. S1 batch {b}" for i, b in enumerate(range(batches))] + [
        f"{batches + 1}. S1:refill window 0"]
    assert main(["compare", path, "--check"]) == 2
    assert "request list" in capsys.readouterr().err


def test_a_long_refill_run_is_simulated_in_windows_that_agree_with_one(tmp_path, monkeypatch):
    """Memory stays one window's: the windows, each starting with an empty pipeline, give the
    one-program run's figures within a fraction of a percent, and every request's tokens."""
    from taskgraph.serving import queue

    rows = [(30, 12), (30, 2), (20, 3), (40, 9), (25, 11), (35, 1), (30, 7), (20, 3)] * 6
    sc = _queue_scenario(tmp_path, rows, policy="{N: 4, mu: 2}", extra=", refill: true")
    whole = queue.simulate_queue(sc)
    monkeypatch.setattr(queue, "_WINDOW_TASKS", 1)         # the smallest windows: 8 steps
    parts = queue.simulate_queue(sc)
    assert whole.summary["requests"]["windows"] == 1
    assert parts.summary["requests"]["windows"] > 3
    assert parts.summary["requests"]["generated_tokens"] == sum(g for _, g in rows)
    assert parts.summary["makespan_s"] == pytest.approx(whole.summary["makespan_s"], rel=0.02)
    for rid, t in whole.finish_s.items():
        assert parts.finish_s[rid] == pytest.approx(t, rel=0.05, abs=1e-4)


def test_a_csv_tg_writes_runs_no_formula_in_a_spreadsheet(tmp_path):
    """Ids that a spreadsheet would run (= + - @) get a leading quote, as OWASP recommends;
    an id that reads as a number, and plain ones, are written as they are (issue 40 point 5)."""
    import csv

    requests = tmp_path / "r.csv"
    requests.write_text("id,prompt_len,gen_len\n=1+2,16,4\n-cmd,16,4\n@x,8,4\n+y,8,4\n"
                        "plain,8,4\n-5,8,4\n")
    out = tmp_path / "out.csv"
    assert main(["batch", "scenarios/tiny.yaml", "--set", f"workload.requests={requests}",
                 "--csv", str(out)]) == 0
    ids = {row["id"] for row in csv.DictReader(out.open())}
    assert ids == {"'=1+2", "'-cmd", "'@x", "'+y", "plain", "-5"}
