"""Where the plan's weight pages fall in a layer's elements, and the start-up check that no
task reads an element of a page the graph did not make it wait for.

Page boundaries are the cost model's byte ranges (:class:`taskgraph.dag.work.WeightLayout`)
mapped to elements: an element belongs to the page holding its first byte.
"""

from __future__ import annotations

import math
from typing import Any

from taskgraph.dag.builder import Plan
from taskgraph.kernels.weights import attention_shapes, layer_sections
from taskgraph.kinds import WEIGHT_SECTIONS
from taskgraph.specs import ModelSpec

#: Per class of layer (an MoE layer, False; a dense one, True): a count of elements, the first
#: streamed element, or the element range of each page.
ByClass = dict[bool, Any]


def layer_pages(plan: Plan, m: ModelSpec, classes: set[bool]
                ) -> tuple[ByClass, ByClass, ByClass]:
    """(elements of a layer, first streamed element, [element range of each page]) of each
    class of layer in `classes`, from the plan's byte layouts."""
    numel, cut, pages = {}, {}, {}
    for dense in sorted(classes):
        layout = plan.layouts[dense]
        numel[dense] = math.ceil(layout.extent_bytes / m.dtype_bytes)
        cut[dense], pages[dense] = page_elements(layout, numel[dense], m.dtype_bytes)
    return numel, cut, pages


def page_elements(layout: Any, numel: int, b: int) -> tuple[int, list[tuple[int, int]]]:
    """(first streamed element, [element range of each page]) for a layer's byte layout
    (:class:`taskgraph.dag.work.WeightLayout`) over `numel` elements of `b` bytes."""
    cut = min(numel, math.ceil(layout.resident_bytes / b))
    if not layout.n_pages:
        return numel, []
    bounds = [min(numel, math.ceil((layout.resident_bytes + p * layout.page_bytes) / b))
              for p in range(layout.n_pages)] + [numel]
    bounds[0] = cut
    return cut, [(bounds[p], bounds[p + 1]) for p in range(layout.n_pages)]


def check_pages(plan: Plan, m: ModelSpec, pages: ByClass) -> None:
    """Every element a task reads lies in a page the graph makes that task wait for (`pages`:
    each class of layer's element ranges, for model `m`, the whole model or a GPU's shard)."""
    launched = {op.kind for op in plan.schedule.ops}
    for dense, ranges in pages.items():
        layout = plan.layouts[dense]
        sections = {s.name: (s.offset, s.offset + s.size) for s in layer_sections(m, dense)}
        qkv, o = (tuple(name for name, _ in part) for part in attention_shapes(m))
        # MLA's attention decompresses the cached values through uv (WeightLayout.sections)
        attention = (*qkv, "uv") if m.attention == "mla" else qkv
        ffn = tuple(n for n in sections if n not in (*qkv, *o))
        groups = {"qkv": attention, "post": (*o, *ffn), "o": o, "all": tuple(sections),
                  # a dense layer's router task runs its MLP
                  "route": (*o, *ffn) if dense else (*o, "router"),
                  "shared": tuple(n for n in ffn if n.startswith("shared.")), "moe": ffn}
        for section in {WEIGHT_SECTIONS[k] for k in launched if k in WEIGHT_SECTIONS}:
            allowed = set(layout.pages_for(section))
            for name in groups[section]:
                a, b = sections[name]
                for p, (lo, hi) in enumerate(ranges):
                    if lo < b and a < hi and p not in allowed:
                        raise AssertionError(f"{name} reads page {p}, outside {allowed}")
