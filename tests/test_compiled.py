"""Compiled templates are kept by what shapes them (taskgraph.dag.compiled._structure): a run
that differs only in the machine's rates or in how many tokens it generates reuses them. These
tests hold the key to what it leaves out: compiled afresh, such runs give the same templates."""

from __future__ import annotations

import numpy as np
import pytest

from taskgraph.dag import compiled
from taskgraph.dag.builder import make_plan
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.dag.compiled import compile_plan
from taskgraph.scenario import for_schedule
from taskgraph.sim.simulate import simulate_scenario
from tests.helpers import tiny

COLUMNS = ("kind", "stream", "resource", "step_rel", "layer", "index", "flops",
           "flops_per_ctx", "nbytes", "bytes_per_ctx")
# Every rate and size of the machine a sweep or a fit moves, far from the preset's.
OTHER_MACHINE = {"preset": "t4", "gpu": {"tflops": 13.0, "flops_eff": 0.2, "mem_gbps": 150.0,
                                         "memory_gb": 40.0},
                 "cpu": {"tflops": 0.4, "mem_gbps": 30.0},
                 "link": {"h2d_gbps": 3.0, "d2h_gbps": 2.0}}
# Experts kept on the GPU for the expert-level schedules; the others take no such field.
EXPERT_POLICY = {"EP": {"experts_gpu": 2}, "EC": {"experts_gpu": 2}, "ECP": {"experts_gpu": 2}}


def _fresh(scenario, schedule: str):
    compiled._TEMPLATES.clear()
    return compile_plan(make_plan(for_schedule(scenario, schedule)[0]))


def _same(a: compiled.Template, b: compiled.Template) -> list[str]:
    differ = [c for c in COLUMNS if not np.array_equal(getattr(a, c), getattr(b, c))]
    return differ + [c for c in ("deps", "by_stream") if getattr(a, c) != getattr(b, c)]


@pytest.mark.parametrize("schedule,gpus", [(s, 1) for s in SCHEDULES]
                         + [("S1", 2), ("S4", 2), ("PP", 2)])
def test_a_template_is_a_steps_shape_whatever_the_length_and_the_machine(schedule, gpus):
    policy = {"policy": EXPERT_POLICY[schedule]} if schedule in EXPERT_POLICY else {}
    short = tiny(schedule=schedule, **policy,
                 hardware={"preset": "t4", "gpu": {"count": gpus}},
                 workload={"prompt_len": 16, "max_prompt_len": 32, "gen_len": 6})
    other = {**OTHER_MACHINE, "gpu": {**OTHER_MACHINE["gpu"], "count": gpus}}
    long = tiny(schedule=schedule, **policy, hardware=other,
                workload={"prompt_len": 16, "max_prompt_len": 32, "gen_len": 11})
    a, b = _fresh(short, schedule), _fresh(long, schedule)
    assert compiled._structure(a.plan) == compiled._structure(b.plan)
    assert len(a.templates) == len(b.templates) >= 4
    for i, (x, y) in enumerate(zip(a.templates, b.templates)):
        assert not _same(x, y), f"template {i} differs in {_same(x, y)}"


def test_a_sweep_over_rates_compiles_each_shape_once_and_simulates_as_if_afresh(monkeypatch):
    built = []
    build = compiled.build_segment
    monkeypatch.setattr(compiled, "build_segment",
                        lambda plan, d: built.append(d) or build(plan, d))
    compiled._TEMPLATES.clear()
    first = tiny(workload={"prompt_len": 16, "max_prompt_len": 32, "gen_len": 6})
    second = tiny(hardware=OTHER_MACHINE,
                  workload={"prompt_len": 16, "max_prompt_len": 32, "gen_len": 11})
    kept = [simulate_scenario(s).summary for s in (first, second)]
    shapes = len(compile_plan(make_plan(first)).templates)
    assert len(built) == shapes                     # the second run built none
    afresh = []
    for s in (first, second):
        compiled._TEMPLATES.clear()
        afresh.append(simulate_scenario(s).summary)
    for k, a in zip(kept, afresh):
        assert {n: v for n, v in k.items() if n != "wall_s"} == \
            {n: v for n, v in a.items() if n != "wall_s"}
    # A kept template's graph is the segment of the run that asks: its last step is 11's.
    program = compile_plan(make_plan(second))
    steps = {a["step"] for _, a in program.templates[-1].graph.nodes(data=True)
             if not a["external"]}
    assert max(steps) == 11


def test_a_different_policy_or_model_compiles_its_own():
    compiled._TEMPLATES.clear()
    compile_plan(make_plan(tiny()))
    compile_plan(make_plan(tiny(policy={"N": 8, "mu": 4, "r_w": 0.0, "r_c": 0.0})))
    compile_plan(make_plan(tiny(model={"preset": "tiny", "L": 3})))
    assert len({structure for structure, _ in compiled._TEMPLATES}) == 3


def test_kept_templates_are_read_only_and_bounded(monkeypatch):
    compiled._TEMPLATES.clear()
    program = compile_plan(make_plan(tiny()))
    with pytest.raises(ValueError):
        program.templates[0].flops[0] = 1.0
    monkeypatch.setattr(compiled, "TEMPLATE_TASKS", program.templates[0].size)
    compile_plan(make_plan(tiny(policy={"N": 8, "mu": 4, "r_w": 0.0, "r_c": 0.0})))
    assert len(compiled._TEMPLATES) == 1           # the most recent; the rest let go


@pytest.mark.parametrize("schedule", ["S1", "S4", "EC"])
def test_every_segment_runs_the_template_of_its_own_graph(schedule):
    """compile_plan works the segments' shapes out from the first three and the last few (a
    nine-million-step run is refused in a moment): each segment's template must still be the
    one its own graph compiles to, at every length from one decode step to several past the
    schedule's horizon, and the segments' bases must add up their templates' sizes."""
    policy = {"policy": EXPERT_POLICY[schedule]} if schedule in EXPERT_POLICY else {}
    for gen_len in range(2, 11):
        sc = tiny(schedule=schedule, **policy,
                  workload={"prompt_len": 16, "max_prompt_len": 32, "gen_len": gen_len})
        program = _fresh(sc, schedule)
        plan = program.plan
        assert len(program.seg_template) == plan.G + 1
        for d, t in enumerate(program.seg_template):
            own = compiled._compile(lambda: compiled.build_segment(plan, d), d, plan.streams)
            differ = _same(program.templates[t], own)
            assert not differ, f"gen_len {gen_len}, segment {d}: template {t} differs in {differ}"
        sizes = [program.templates[t].size for t in program.seg_template]
        assert list(program.seg_base) == [sum(sizes[:d]) for d in range(len(sizes))]
        assert program.total == sum(sizes)
