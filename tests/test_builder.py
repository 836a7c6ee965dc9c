"""The generic builder: schedules as data in, DAGs with data and buffer-reuse edges out."""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest

from taskgraph.dag.builder import TaskKey, build_segment, launch_sequence, make_plan
from taskgraph.errors import ScheduleError
from taskgraph.dag.schedules import S1, S2, S3, S4, SCHEDULES, Op
from tests.helpers import tiny


def _plan(schedule="S1", **sections):
    return make_plan(tiny(schedule=schedule, **sections))


def _with_stream_order(g: nx.DiGraph) -> nx.DiGraph:
    """The segment graph plus an edge between consecutive tasks of each stream."""
    h = g.copy()
    by_stream: dict[str, list] = {}
    for name, a in sorted(g.nodes(data=True), key=lambda na: (na[1]["external"] is False,
                                                            na[1]["order"])):
        by_stream.setdefault(a["stream"], []).append(name)
    for names in by_stream.values():
        h.add_edges_from(zip(names, names[1:]))
    return h


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_builds_an_acyclic_graph_with_stream_order(name):
    plan = _plan(name)
    for d in range(plan.G + 1):
        g = build_segment(plan, d)
        assert nx.is_directed_acyclic_graph(_with_stream_order(g))
        # every dependency points to an earlier launch (the previous segment counts as earlier)
        for u, v in g.edges():
            a, b = g.nodes[u], g.nodes[v]
            assert a["external"] or a["order"] < b["order"]


def test_cgopipe_launch_order_follows_algorithm_1():
    plan = _plan("S1")                       # 4 layers, 4 micro-batches, 4 pages
    seq = [k.name for k in launch_sequence(plan, 1)]
    assert seq[:8] == ["D2[s1,L0,m0]", "D3[s1,L1,p0]", "PostAttn[s1,L0,m0]",
                       "PreAttn[s1,L0,m2]", "D1[s1,L0,m2]", "CPUAttn[s1,L0,m2]",
                       "W_CtoPin[s1,L1,p2]", "D2[s1,L0,m1]"]
    # j+2 wraps into the next layer, and past the last layer into the next step
    assert "PreAttn[s1,L1,m0]" in seq and "PreAttn[s2,L0,m1]" in seq
    prologue = [k.name for k in launch_sequence(plan, 0) if k.step == 1 and k.kind != "D3"]
    assert prologue[-6:] == ["PreAttn[s1,L0,m0]", "D1[s1,L0,m0]", "CPUAttn[s1,L0,m0]",
                             "PreAttn[s1,L0,m1]", "D1[s1,L0,m1]", "CPUAttn[s1,L0,m1]"]


def test_data_and_buffer_reuse_edges():
    g = build_segment(_plan("S1"), 2)
    preds = lambda n: {p: g.edges[p, n]["why"] for p in g.predecessors(n)}  # noqa: E731
    post = preds("PostAttn[s2,L1,m0]")
    assert post["D2[s2,L1,m0]"] == "data"
    assert {p for p, why in post.items() if p.startswith("D3")} == {
        f"D3[s2,L1,p{p}]" for p in range(4)}                     # every page of its layer
    # page 1 of layer 2 overwrites page 1 of layer 0: after the last task reading it
    assert preds("D3[s2,L2,p1]") == {"W_CtoPin[s2,L2,p1]": "data",
                                     "PostAttn[s2,L0,m3]": "reuse:weights"}
    # a pinned slot is refilled only after the D3 that emptied it (two pages back)
    assert preds("W_CtoPin[s2,L2,p2]") == {"D3[s2,L2,p0]": "reuse:pinned"}
    # attention two layers back lies in the previous step (an external node)
    d3 = preds("D3[s2,L1,p0]")
    assert d3["PostAttn[s1,L3,m3]"] == "reuse:weights"
    assert g.nodes["PostAttn[s1,L3,m3]"]["external"]


def test_s4_kv_slots_and_link_sharing():
    plan = _plan("S4")
    g = build_segment(plan, 2)
    assert {p: g.edges[p, "D4[s2,L1,m2]"]["why"] for p in g.predecessors("D4[s2,L1,m2]")} == {
        "KVOut[s1,L1,m2]": "data", "GPUAttn[s2,L1,m0]": "reuse:kv", "KVOut[s2,L1,m0]": "reuse:kv"}
    # the new K,V are copied out of the slot GPU attention appended them to
    assert ("GPUAttn[s2,L1,m0]", "KVOut[s2,L1,m0]") in g.edges
    assert g.nodes["D4[s2,L1,m2]"]["stream"] == "h2d_kv"
    assert g.nodes["D4[s2,L1,m2]"]["resource"] == g.nodes["D3[s2,L2,p0]"]["resource"] == "h2d"


def test_prefill_kv_passes_through_two_slots():
    g = build_segment(_plan("S1"), 0)
    why = {p: g.edges[p, "Prefill[s0,L1,m2]"]["why"] for p in g.predecessors("Prefill[s0,L1,m2]")}
    assert why["KVOut[s0,L1,m0]"] == "reuse:kv"


def test_whole_layer_schedules_send_one_page_per_layer():
    for sched in (S2, S3, S4):
        seq = launch_sequence(_plan(sched.name), 2)
        assert sum(k.kind == "D3" for k in seq) == 4          # one per layer
        # FastDecode's order in MoE-Lightning's system stages whole layers through its pinned
        # relay; FlexGen copies from pageable memory
        assert sum(k.kind == "W_CtoPin" for k in seq) == (4 if sched is S2 else 0)


def test_resident_weights_need_no_transfers():
    seq = launch_sequence(_plan("S1", policy={"r_w": 1.0}), 2)
    assert not any(k.kind in ("D3", "W_CtoPin") for k in seq)


def test_a_reordered_schedule_is_rejected():
    # PostAttn launched before the D2 that carries its input
    broken = dataclasses.replace(S3, name="broken", decode=(
        Op("D3", layer=1, when="first"), Op("PreAttn"), Op("D1"), Op("CPUAttn"), Op("PostAttn"),
        Op("D2"), Op("LMHead", when="last_layer")))
    with pytest.raises(ScheduleError, match=r"launches PostAttn\[s1,L0,m0\] before D2"):
        build_segment(make_plan(tiny(), broken), 1)


def test_a_read_after_overwrite_is_rejected():
    # PreAttn three micro-batches ahead reads weights two layers on, whose double-buffer half
    # the next page copy is already overwriting
    greedy = dataclasses.replace(S1, name="greedy", decode=tuple(
        dataclasses.replace(op, ahead=op.ahead + 4) if op.kind in ("PreAttn", "D1", "CPUAttn")
        else op for op in S1.decode))
    with pytest.raises(ScheduleError):
        for d in range(3):
            build_segment(make_plan(tiny(), greedy), d)


def test_policies_a_schedule_cannot_run_get_clear_errors():
    with pytest.raises(ScheduleError, match="at least 2 micro-batches"):
        _plan("S1", policy={"mu": 8})
    # S4 with one layer and one micro-batch would prefetch the KV it is still computing
    plan = _plan("S4", model={"preset": "tiny", "L": 1}, policy={"mu": 8})
    with pytest.raises(ScheduleError, match="before KVOut"):
        build_segment(plan, 1)
    # a QKV projection larger than a page is not streamed by the time CGOPipe's PreAttn needs it
    plan = _plan("S1", model={"preset": "tiny", "h_i": 1}, policy={"mu": 4})
    with pytest.raises(ScheduleError, match="launches PreAttn"):
        build_segment(plan, 1)


def test_task_keys_name_pages_and_micro_batches():
    assert TaskKey(3, "D3", 1, 2).name == "D3[s3,L1,p2]"
    assert TaskKey(3, "PostAttn", 1, 2).name == "PostAttn[s3,L1,m2]"


EXPERTS = {"EP": {"experts_gpu": 2}, "EC": {"experts_gpu": 2}, "ECP": {"experts_gpu": 2}}


@pytest.mark.parametrize("name,gpus", [(s, 1) for s in SCHEDULES] + [("S1", 2), ("PP", 2)])
def test_a_segments_size_is_known_before_it_is_launched(name, gpus):
    """`tg graph` announces a graph of minutes from segment_size, which launches a copy with
    a few layers: it must count what launching the whole segment counts."""
    from taskgraph.dag.builder import segment_size
    from taskgraph.scenario import for_schedule

    sc = tiny(schedule=name, model={"preset": "tiny", "L": 9}, hardware={"preset": "t4", "gpu": {"count": gpus}},
              workload={"prompt_len": 16, "max_prompt_len": 32, "gen_len": 5},
              **({"policy": EXPERTS[name]} if name in EXPERTS else {}))
    plan = make_plan(for_schedule(sc, name)[0])
    for d in range(plan.G + 1):
        assert segment_size(plan, d) == len(launch_sequence(plan, d)), f"segment {d}"
