"""Small builders shared by the tests."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from taskgraph.compiled import Program
from taskgraph.scenario import scenario_from_dict
from taskgraph.specs import Scenario

TINY: dict[str, Any] = {
    "model": "tiny",
    "hardware": "t4",
    "workload": {"prompt_len": 16, "max_prompt_len": 32, "gen_len": 3},
    "policy": {"N": 8, "mu": 2, "A_g": 0, "F_g": 1, "r_w": 0.0, "r_c": 0.0},
    "schedule": "S1",
}


def tiny(**sections: Any) -> Scenario:
    """The tiny scenario with sections (or fields of them) replaced."""
    doc = copy.deepcopy(TINY)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key].update(value)
        else:
            doc[key] = value
    return scenario_from_dict(doc, source="<test>")


def unrolled_edges(program: Program) -> np.ndarray:
    """Every dependency of the whole run (data and buffer reuse, not pruned) as (src, dst) ids,
    read back from the networkx segment graphs."""
    pairs = []
    for d, (t, base) in enumerate(zip(program.seg_template, program.seg_base)):
        g = program.templates[t].graph
        prev_base = int(program.seg_base[d - 1]) if d else 0
        for u, v in g.edges():
            a, b = g.nodes[u], g.nodes[v]
            src = (prev_base if a["external"] else int(base)) + a["order"]
            dst = int(base) + b["order"]
            pairs.append((src, dst))
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)
