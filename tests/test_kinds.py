"""One record per task kind (taskgraph/kinds.py) plus its kernel: every part present, and the
records are what the builder, the work model and the executor use."""

from __future__ import annotations

import dataclasses

import pytest

from taskgraph.dag.builder import build_segment, make_plan
from taskgraph.dag.schedules import SCHEDULES, STREAM_RESOURCE, Op, Schedule
from taskgraph.errors import ScheduleError
from taskgraph.exec.runtime import Runtime
from taskgraph.exec.tensor import ShardRuntime
from taskgraph.kinds import COLLECTIVES, KINDS, SENDS, Kind, Work
from tests.helpers import tiny

SECTIONS = {"qkv", "o", "route", "shared", "moe", "post", "all"}
RINGS = {"weights", "pinned", "kv"}


def missing_parts(kinds: dict[str, Kind], kernels: set[str]) -> list[str]:
    """What each kind lacks of its record and its kernel."""
    out = []
    for name, k in kinds.items():
        if not k.meaning.strip():
            out.append(f"{name}: no meaning")
        if k.stream not in STREAM_RESOURCE:
            out.append(f"{name}: stream {k.stream!r} is no stream")
        if not callable(k.work):
            out.append(f"{name}: no work")
        for read in k.reads:
            out += [f"{name}: reads unknown kind {r}" for r in read.kinds if r not in kinds]
        if k.weights is not None and k.weights not in SECTIONS:
            out.append(f"{name}: weights {k.weights!r} is no section")
        out += [f"{name}: ring {r!r} unknown" for r in (k.fills, *k.reads_slots)
                if r is not None and r not in RINGS]
        if name not in kernels:
            out.append(f"{name}: no kernel")
    return out


def kernels() -> set[str]:
    """The kinds the executor runs: a Runtime's marked methods, a tensor-parallel shard's, and
    the collectives and sends the multi-GPU wrappers carry out."""
    return set(Runtime.kernels) | set(ShardRuntime.kernels) | COLLECTIVES | SENDS


def test_every_kind_has_every_part():
    assert missing_parts(KINDS, kernels()) == []


def test_a_kind_without_a_part_is_found():
    fake = Kind("Probe", " ", "gpu2", work=None, reads=(), weights="ffn", fills="scratch")
    found = missing_parts({**KINDS, "Probe": fake}, kernels())
    assert found == ["Probe: no meaning", "Probe: stream 'gpu2' is no stream", "Probe: no work",
                     "Probe: weights 'ffn' is no section", "Probe: ring 'scratch' unknown",
                     "Probe: no kernel"]
    # a kind a record names as read but that has no record
    reader = dataclasses.replace(KINDS["D1"], reads=(dataclasses.replace(
        KINDS["D1"].reads[0], kinds=("PreAttention",)),))
    assert missing_parts({**KINDS, "D1": reader}, kernels()) == [
        "D1: reads unknown kind PreAttention"]


@pytest.mark.parametrize("prefill", [False, True])
def test_every_kinds_work_is_figures(prefill):
    """Every record's work, on a real plan: FLOPs and bytes, none negative."""
    work = make_plan(tiny(schedule="S1")).work
    for name in KINDS:
        w = work.of(name, prefill=prefill)
        assert isinstance(w, Work), name
        assert min(float(w.flops), float(w.bytes), float(w.flops_per_ctx),
                   float(w.bytes_per_ctx)) >= 0, name


def test_a_schedule_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"unknown task kinds \['Probe'\]"):
        dataclasses.replace(SCHEDULES["S3"], name="X", decode=(*SCHEDULES["S3"].decode,
                                                               Op("Probe")))


def test_a_record_decides_what_the_builder_waits_for():
    """A kind's reads are the dependencies the builder draws: S3's PostAttn reads D2 (CPU
    attention's output, back on the GPU) and its pages; a read of a kind the schedule does not
    launch is reported as never launched."""
    plan = make_plan(tiny(schedule="S3"))
    g = build_segment(plan, 2)
    post = "PostAttn[s2,L1,m0]"
    preds = {p for p in g.predecessors(post) if g.edges[p, post]["why"] == "data"}
    assert preds == {"D2[s2,L1,m0]", "D3[s2,L1,p0]"}
    # Without D2 in the decode body, PostAttn's read of (D2 or GPUAttn) finds neither.
    broken = dataclasses.replace(SCHEDULES["S3"], name="S3-no-D2",
                                 decode=tuple(op for op in SCHEDULES["S3"].decode
                                              if op.kind != "D2"))
    with pytest.raises(ScheduleError, match=r"needs D2\[s2,L0,m0\].*not launched"):
        build_segment(make_plan(tiny(schedule="S3"), broken), 2)


def test_every_schedule_launches_only_kinds_with_records():
    for s in SCHEDULES.values():
        assert isinstance(s, Schedule)
        assert {op.kind for op in s.ops} <= set(KINDS), s.name
        assert set(s.streams) == set(KINDS), s.name
