"""The compact form of a plan's task graph, which the simulator (and executor) iterate over.

Unrolling every step into networkx nodes is too slow for real runs (~0.5 M tasks for the T4
scenario), but every decode step has the same shape: only the context length grows. A
:class:`Program` therefore keeps a few compiled *templates* (prefill, first decode step, middle
step, the last steps), each a set of flat arrays built once from its networkx segment graph, and a list
saying which template each segment uses and where its tasks start in the global numbering.

Global task id = segment base + position in the segment's launch order. A dependency is stored as
a negative offset from the task's own id, so it holds whichever segment the template is placed at.
Dependencies between tasks of one stream are dropped, and of several dependencies on one other
stream only the last launched is kept: stream order implies the rest.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Callable

import networkx as nx
import numpy as np

from taskgraph.dag.builder import Plan, build_segment, lookahead_steps
from taskgraph.dag.schedules import RESOURCES, STREAM_RESOURCE
from taskgraph.dag.work import Load
from taskgraph.kinds import KIND_NAMES, PAGED


@dataclass
class Template:
    """One compiled segment shape. Its arrays are shared by every program of that shape
    (:func:`compile_plan` keeps them), so they are read-only."""

    # The segment's networkx graph, built again where asked for (an export, a test): kept by
    # every template, a 36,000-task segment's graph would outweigh its arrays many times over.
    build: Callable[[], nx.DiGraph] | None
    kind: np.ndarray          # index into KIND_NAMES
    stream: np.ndarray        # index into Program.streams
    resource: np.ndarray      # index into RESOURCES (the kind of resource; see Program.device)
    step_rel: np.ndarray      # task step minus the segment number
    layer: np.ndarray
    index: np.ndarray
    flops: np.ndarray
    flops_per_ctx: np.ndarray
    nbytes: np.ndarray
    bytes_per_ctx: np.ndarray
    deps: list[tuple[int, ...]]                # cross-stream deps, negative id offsets
    by_stream: list[list[tuple[int, tuple[int, ...]]]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.kind)

    @cached_property
    def graph(self) -> nx.DiGraph:
        return self.build()


@dataclass
class Program:
    plan: Plan
    streams: tuple[str, ...]
    templates: list[Template]
    seg_template: np.ndarray   # per segment: template index
    seg_base: np.ndarray       # per segment: global id of its first task
    total: int
    # A part of a longer run (:meth:`part`): the run's number of its first segment, so that
    # steps, and what depends on them (context lengths), are the run's.
    first_segment: int = 0
    # A probe of a long run's later steps (taskgraph.sim.interference): its decode steps see
    # this many more tokens of context than their number says (its prefill, the prompt's).
    context_shift: int = 0

    @cached_property
    def stream_device(self) -> list[tuple[str, int]]:
        """Per stream, the resource it occupies: (kind of resource, GPU or -1). Two streams on
        one GPU's link (S4's weight and KV loads) occupy the same one."""
        out = []
        for s in self.streams:
            base, _, gpu = s.partition(":")
            out.append((STREAM_RESOURCE[base], int(gpu) if gpu else -1))
        return out

    @property
    def stream_resource(self) -> list[int]:
        """Per stream, an id of the resource it occupies (equal ids: one resource)."""
        ids: dict[tuple[str, int], int] = {}
        return [ids.setdefault(d, len(ids)) for d in self.stream_device]

    @cached_property
    def device(self) -> np.ndarray:
        """Per task, in global id order, the id (as in `stream_resource`) of what it occupies."""
        return np.asarray(self.stream_resource)[self.column("stream")]

    def context(self, step: np.ndarray | int) -> np.ndarray | int:
        """KV tokens per sequence when a task of `step` runs (prompt + tokens so far)."""
        prompt = self.plan.scenario.workload.context_prompt
        if self.context_shift:
            return prompt + step + self.context_shift * (np.asarray(step) > 0)
        return prompt + step

    def column(self, name: str) -> np.ndarray:
        """A per-task attribute over the whole run, in global id order."""
        if name == "step_rel":
            return np.concatenate([self.templates[t].step_rel + d for d, t in
                                   enumerate(self.seg_template, self.first_segment)])
        return np.concatenate([getattr(self.templates[t], name) for t in self.seg_template])

    def part(self, lo: int, hi: int) -> Program:
        """Segments [lo, hi) as a program of their own (task ids from 0), for the parts of a
        run too long to hold whole: its columns, work and durations are those of the run's."""
        base = self.seg_base[lo:hi]
        end = self.seg_base[hi] if hi < len(self.seg_base) else self.total
        return Program(self.plan, self.streams, self.templates, self.seg_template[lo:hi],
                       base - (base[0] if len(base) else 0), int(end - self.seg_base[lo]),
                       self.first_segment + lo, self.context_shift)

    @cached_property
    def step(self) -> np.ndarray:
        return self.column("step_rel")

    def durations(self, cost) -> np.ndarray:
        """Seconds each task takes under a cost model, in global id order. A task of a
        micro-batch whose requests have all finished takes none (it is skipped)."""
        flops, nbytes, idle = self.work()
        out = cost.times(self.column("resource"), flops, nbytes, self.column("kind"))
        out[idle] = 0.0
        return out

    def pool_bytes(self, cost) -> np.ndarray:
        """(pools x tasks): the bytes each task draws from each of the host's shared pools
        (:data:`taskgraph.perf.cost.POOLS`), in global id order; none for a skipped task."""
        _, nbytes, idle = self.work()
        nbytes[idle] = 0.0
        return cost.pool_bytes(self.column("resource"), self.column("kind"), nbytes)

    def work(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(FLOPs, bytes, idle) of every task, in global id order: idle marks tasks of a
        micro-batch with no request left (only with a batch of real requests, ``plan.load``)."""
        step = self.step
        flops, nbytes = self.column("flops"), self.column("nbytes")
        if self.plan.load is None:
            s = self._seen(self.context(step))
            return (flops + self.column("flops_per_ctx") * s,
                    nbytes + self.column("bytes_per_ctx") * s, np.zeros(self.total, bool))
        seqs, ctx, ptok, psq = self.plan.load.tables(self.plan.G)
        kind, index = self.column("kind"), self.column("index")
        classes = list(self.plan.works)
        of_layer = np.array([classes.index(c) for c in self.plan.layer_classes])
        layer_class = of_layer[self.column("layer")]
        idle = np.zeros(self.total, bool)
        for k in np.unique(kind):
            name = KIND_NAMES[k]
            if name in PAGED:                 # weight pages: the same whatever the requests
                continue
            for prefill, c in itertools.product((True, False), range(len(classes))):
                sel = np.flatnonzero((kind == k) & ((step == 0) == prefill) & (layer_class == c))
                if not len(sel):
                    continue
                j, d = index[sel], step[sel]
                a = seqs[j, d]
                load = (Load(a, ptok[j, 0], psq[j, 0]) if prefill else
                        Load(a, 0.0, 0.0, admitted=ptok[j, d], admitted_sq=psq[j, d]))
                work = self.plan.works[classes[c]].with_load(load).of(name, prefill=prefill)
                mean_ctx = np.divide(ctx[j, d], a, out=np.zeros(len(sel)), where=a > 0)
                f, b = work.at(self._seen(mean_ctx, sel))
                flops[sel] = np.broadcast_to(f, len(sel))
                nbytes[sel] = np.broadcast_to(b, len(sel))
                idle[sel] = (a == 0) & (ptok[j, d] == 0)
        if self.plan.load.continuation:
            idle |= step == 0       # a window of a longer run: its prefill segment did not happen
        return flops, nbytes, idle

    def _seen(self, context: np.ndarray, sel: np.ndarray | None = None) -> np.ndarray:
        """The context each task's attention sees: all of it, or a sliding-window layer's
        window (of the tasks `sel` picks, or of every task)."""
        m = self.plan.scenario.model
        if m.sliding_window is None:
            return context
        windows = np.array([m.window(l) or np.inf for l in range(m.L)])
        layer = self.column("layer") if sel is None else self.column("layer")[sel]
        return np.minimum(context, windows[layer])

    def segment_of(self, gid: int) -> int:
        return int(np.searchsorted(self.seg_base, gid, side="right") - 1)

    def task(self, gid: int) -> tuple[int, str, int, int]:
        """(step, kind, layer, index) of a global task id."""
        d = self.segment_of(gid)
        tpl = self.templates[self.seg_template[d]]
        i = gid - self.seg_base[d]
        return (int(tpl.step_rel[i]) + d + self.first_segment, KIND_NAMES[tpl.kind[i]],
                int(tpl.layer[i]), int(tpl.index[i]))


def compile_plan(plan: Plan) -> Program:
    """Build the segment graphs a run needs and compile them.

    Segments share a template when they have the same shape: the prefill and first decode step
    are special, and the last few steps lose the tasks a schedule launches for steps past the
    end (how many steps ahead it launches is read from the description). Every other step uses
    one "middle" template, so a long run compiles a handful of segments."""
    G = plan.G
    horizon = lookahead_steps(plan)

    def shape(d: np.ndarray) -> np.ndarray:
        """A segment's shape as one number: prefill, first step, or its steps left up to the
        horizon."""
        return np.minimum(G - d, horizon + 1) + (horizon + 2) * ((d == 0) + 2 * (d == 1))

    # Only segments 0 to 2 and the last horizon + 1 can differ; every one between is segment
    # 2's shape. Worked out on those alone, and the run's arrays filled in whole: a typo of
    # nine million steps is refused in a moment, not after sorting nine million shapes.
    edges = np.unique(np.r_[np.arange(min(G, 2) + 1), np.arange(max(G - horizon, 0), G + 1)])
    shapes, first = np.unique(shape(edges), return_index=True)
    in_order = np.argsort(first)                 # templates numbered by their first segment
    structure = _structure(plan)
    templates = [_template(plan, structure, int(shapes[i]), int(edges[first[i]]))
                 for i in in_order]
    number = dict(zip(shapes[in_order].tolist(), range(len(shapes))))
    seg_template = np.full(G + 1, number[int(shape(np.array(min(G, 2))))], dtype=np.int64)
    seg_template[edges] = [number[x] for x in shape(edges).tolist()]
    sizes = np.array([t.size for t in templates], dtype=np.int64)[seg_template]
    seg_base = np.zeros(G + 1, dtype=np.int64)
    np.cumsum(sizes[:-1], out=seg_base[1:])
    return Program(plan, plan.streams, templates, seg_template, seg_base, int(sizes.sum()))


#: Compiled templates by the plan's structure and the segment's shape, most recently used last:
#: a sweep over a machine's rates, a fit's rounds or its cells that differ only in how many
#: tokens they generate compile each shape once (a 4xT4 tensor-parallel run's five templates:
#: 170,000 tasks, 14 s). Bounded by the tasks they hold (~300 bytes a task).
_TEMPLATES: OrderedDict[tuple[str, int], Template] = OrderedDict()
TEMPLATE_TASKS = 500_000


def _structure(plan: Plan) -> str | None:
    """Everything a segment's tasks, their work and their dependencies are built from: the
    model, the policy, the workload but its length (a template is a step's shape, the same
    however many steps follow; tests/test_compiled.py holds it to that), the schedule and the
    number of GPUs. Not the machine's rates and sizes, which price tasks and never shape them.
    None where the run carries what no text names (requests, a routing trace, pinned experts):
    its templates are compiled afresh."""
    sc = plan.scenario
    if (plan.load is not None or sc.requests is not None or sc.routing_trace is not None
            or sc.experts_kept is not None):
        return None
    workload = sc.workload.model_dump(mode="json")
    del workload["gen_len"]
    return json.dumps([sc.model.model_dump(mode="json"), sc.policy.model_dump(mode="json"),
                       workload, repr(plan.schedule), sc.hardware.gpu.count], sort_keys=True)


def _template(plan: Plan, structure: str | None, shape: int, d: int) -> Template:
    """The template of segment `d` (of shape `shape`), compiled or kept; its graph is this
    plan's segment `d` either way."""
    build = partial(build_segment, plan, d)
    if structure is None:
        return _compile(build, d, plan.streams)
    key = (structure, shape)
    kept = _TEMPLATES.get(key)
    if kept is None:
        kept = _TEMPLATES[key] = _compile(build, d, plan.streams)
        while sum(t.size for t in _TEMPLATES.values()) > TEMPLATE_TASKS and len(_TEMPLATES) > 1:
            _TEMPLATES.popitem(last=False)
    _TEMPLATES.move_to_end(key)
    return replace(kept, build=build)


def _compile(build: Callable[[], nx.DiGraph], d: int, streams: tuple[str, ...]) -> Template:
    g = build()
    prev_len = g.graph["prev_len"]
    own = sorted((data["order"], name) for name, data in g.nodes(data=True)
                 if not data["external"])
    stream_ix = {s: i for i, s in enumerate(streams)}
    cols: dict[str, list] = {c: [] for c in (
        "kind", "stream", "resource", "step_rel", "layer", "index", "flops", "flops_per_ctx",
        "nbytes", "bytes_per_ctx")}
    deps: list[tuple[int, ...]] = []
    by_stream: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in streams]
    for pos, (order, name) in enumerate(own):
        assert order == pos, "launch positions must be dense"
        a = g.nodes[name]
        sid = stream_ix[a["stream"]]
        cols["kind"].append(KIND_NAMES.index(a["kind"]))
        cols["stream"].append(sid)
        cols["resource"].append(RESOURCES.index(a["resource"]))
        cols["step_rel"].append(a["step"] - d)
        cols["layer"].append(a["layer"])
        cols["index"].append(a["index"])
        cols["flops"].append(a["flops"])
        cols["flops_per_ctx"].append(a["flops_per_ctx"])
        cols["nbytes"].append(a["bytes"])
        cols["bytes_per_ctx"].append(a["bytes_per_ctx"])
        latest: dict[str, int] = {}   # other stream -> offset of its last-launched dependency
        for p in g.predecessors(name):
            pa = g.nodes[p]
            if pa["stream"] == a["stream"]:
                continue
            offset = (pa["order"] - prev_len if pa["external"] else pa["order"]) - pos
            latest[pa["stream"]] = max(offset, latest.get(pa["stream"], offset))
        rel = tuple(sorted(latest.values()))
        deps.append(rel)
        by_stream[sid].append((pos, rel))
    ints = ("kind", "stream", "resource", "step_rel", "layer", "index")
    arrays = {c: np.array(v, dtype=np.int64 if c in ints else np.float64)
              for c, v in cols.items()}
    for a in arrays.values():
        a.flags.writeable = False
    return Template(build=build, deps=deps, by_stream=by_stream, **arrays)
