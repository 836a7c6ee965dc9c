"""One generic builder: a schedule description plus a scenario in, a networkx DAG out.

The run is cut into *segments* of launch order: segment 0 is the prefill (and the decode
prologue), segment ``d >= 1`` is the decode body of step ``d``. Tasks keep their true identity
``(step, kind, layer, index)`` even when a segment launches them early (CGOPipe launches the next
step's first PreAttn during this step's last layer). A segment's graph holds its own tasks plus,
marked ``external``, the tasks of the previous segment it depends on; that is all the simulator
and executor need, since every later segment has the same shape.

Dependencies are derived here for every schedule alike (docs/design.md §3.6):

* data (read after write): what each kind reads, its record's ``reads`` (:func:`_data_deps`);
* buffer reuse (write after read), as rings of slots: a weight page may land in its half of the
  double buffer only after the last task reading the page two layers back; a pinned staging slot
  is refilled only after the D3 that emptied it; a GPU KV prefetch slot only after the attention
  that read it.

On several GPUs (tensor parallelism) every GPU task and copy is launched as one shard per GPU on
that GPU's streams, a task holding an all-reduce as its parts (PostAttn: OProj, MoE), and so is
the host's work for that GPU (its heads' CPU attention, its part of each page's pinned copy), on
the host streams of that GPU's process; a shard depends on its own GPU's shards, and a task
reading a partial sum (the O projection's or the experts' output, the logits) on the collective
that completes it, launched right after the shards that feed it. Buffers are rings per GPU.

A pipeline schedule on several GPUs instead gives each GPU a stage of layers and splits the
micro-batches into one group per stage, launched group by group (each group through every
layer); a GPU task or copy runs on its layer's stage, reads another stage's output only through
the send that carried it, and a GPU's rings follow that GPU's own order of use
(:meth:`Plan.use_position`). A data-parallel schedule splits the micro-batches into one group per
GPU too, but every GPU runs every layer on its own group, launched layer by layer, and receives
every layer's weights over its own link.

Every dependency must point to a task launched earlier: on real streams an event that is not yet
recorded cannot be waited on. A description that breaks this gets a :class:`ScheduleError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Callable, Iterator, NamedTuple, NoReturn

import networkx as nx
import numpy as np

from taskgraph.dag.routing import Routing
from taskgraph.dag.schedules import (EXPERT_FIELDS, PER_GPU, PLACEMENT_MEANS, SCHEDULES,
                                     STREAM_RESOURCE, Loop, Op, Schedule)
from taskgraph.dag.work import TaskWork, WeightLayout
from taskgraph.errors import ScheduleError
from taskgraph.kinds import (COLLECTIVE_AFTER, COLLECTIVES, KINDS, PAGED, SEND_AFTER, SENDS,
                             SHARDED, TP_WHOLES, WEIGHT_SECTIONS, Read, tp_parts)
from taskgraph.specs import ModelSpec, Scenario


class TaskKey(NamedTuple):
    step: int       # 0 = prefill, 1..G = decode steps
    kind: str
    layer: int      # 0-based
    index: int      # micro-batch, or page for paged kinds
    gpu: int = -1   # the GPU whose shard this is (tensor parallelism); -1: not sharded

    @property
    def name(self) -> str:
        return _task_name(self)


@lru_cache(maxsize=1 << 16)
def _task_name(key: TaskKey) -> str:
    # Kept: a segment's graph names each task once as a node and again on every edge to it
    # (a 4xT4 segment: 66,000 tasks, 300,000 edges), mostly soon after; 65,536 names (~20 MB)
    # answer 9 of 10 there.
    tag = "p" if key.kind in PAGED else "m"
    shard = f",g{key.gpu}" if key.gpu >= 0 else ""
    return f"{key.kind}[s{key.step},L{key.layer},{tag}{key.index}{shard}]"


@dataclass(frozen=True)
class Plan:
    """A scenario bound to a schedule, checked to be runnable (policy and schedule agree)."""

    scenario: Scenario
    schedule: Schedule
    # A batch of real requests (taskgraph.serving.requests.BatchLoad) whose lengths price each task;
    # None: every micro-batch is mu sequences of the workload's mean lengths.
    load: Any = None

    @property
    def L(self) -> int:
        return self.scenario.model.L

    @property
    def G(self) -> int:
        return self.scenario.decode_steps

    @property
    def n(self) -> int:
        return self.scenario.policy.n_micro

    @property
    def gpus(self) -> int:
        return self.scenario.hardware.gpu.count

    @property
    def tp(self) -> int:
        """GPUs in tensor parallel: every GPU task and copy runs as one shard per GPU."""
        return self.gpus if self.schedule.parallel == "tensor" else 1

    @property
    def pp(self) -> int:
        """Pipeline stages, one per GPU, and as many groups of micro-batches."""
        return self.gpus if self.schedule.parallel == "pipeline" else 1

    @property
    def dp(self) -> int:
        """GPUs in data parallel, each running its own group of micro-batches."""
        return self.gpus if self.schedule.parallel == "data" else 1

    @property
    def groups(self) -> int:
        """Groups of micro-batches: one per GPU in pipeline or data parallel, else one."""
        return self.pp * self.dp

    @cached_property
    def stages(self) -> tuple[range, ...]:
        """Each stage's layers: consecutive, the first L mod pp stages one layer more (as
        FlexGen splits them)."""
        out, first = [], 0
        for i in range(self.pp):
            size = self.L // self.pp + (i < self.L % self.pp)
            out.append(range(first, first + size))
            first += size
        return tuple(out)

    @cached_property
    def _stage_index(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.stages) for _ in r)

    def stage_of(self, layer: int) -> int:
        """The stage (and GPU) holding a layer; 0 unless the GPUs split the layers."""
        return self._stage_index[layer]

    def group_of(self, index: int) -> int:
        """The group of micro-batch `index` (pipeline and data parallelism; else 0)."""
        return index // (self.n // self.groups)

    def gpu_of(self, key: "TaskKey") -> int:
        """The GPU a task of a GPU's kind runs on, in pipeline or data parallel: its layer's
        stage, or its group's GPU (a weight copy's index counts its group's pages)."""
        if self.pp > 1:
            return self.stage_of(key.layer)
        per = self.layout.n_pages if key.kind in PAGED else self.n // self.groups
        return key.index // per

    def stream_of(self, key: TaskKey) -> str:
        """The stream a task is launched on: its kind's, on its own GPU for a GPU's task."""
        base = self.schedule.streams[key.kind]
        return f"{base}:{key.gpu}" if key.gpu >= 0 else base

    @cached_property
    def streams(self) -> tuple[str, ...]:
        """Every stream of the plan, one per GPU for the per-GPU resources."""
        used = set(self.schedule.streams.values())
        out: list[str] = []
        for base in _STREAM_ORDER:
            if base not in used or (base == "peer" and self.gpus == 1):
                continue
            # Every stage sends on its own stream, as each of FlexGen's processes does, and at
            # the interconnect's per-GPU rate (as every GPU of a ring all-reduce sends at once).
            # Every GPU's process runs its host work on threads of its own.
            if self.gpus > 1 and (STREAM_RESOURCE[base] in PER_GPU
                                  or (base == "peer" and self.pp > 1)):
                out += [f"{base}:{g}" for g in range(self.gpus)]
            else:
                out.append(base)
        return tuple(out)

    @cached_property
    def layout(self) -> WeightLayout:
        """Where an MoE layer's weights lie (a dense layer's: :meth:`layout_of`)."""
        return self.layouts[False]

    @cached_property
    def work(self) -> TaskWork:
        """What the first MoE layer's tasks work on (another layer's: :meth:`work_of`)."""
        m = self.scenario.model
        return self.work_of(next(l for l in range(self.L) if not m.is_dense(l)))

    def layout_of(self, layer: int) -> WeightLayout:
        return self.layouts[self.scenario.model.is_dense(layer)]

    def work_of(self, layer: int) -> TaskWork:
        return self.works[self.layer_classes[layer]]

    def task_work(self, key: TaskKey):
        """A task's work (:meth:`TaskWork.of`): its kind's in its layer's class, in prefill or
        decode, the same for every micro-batch and GPU, so worked out once for all of them."""
        at = (key.kind, self.layer_classes[key.layer], key.step == 0)
        work = self._task_works.get(at)
        if work is None:
            work = self._task_works[at] = self.work_of(key.layer).of(key.kind,
                                                                     prefill=key.step == 0)
        return work

    @cached_property
    def _task_works(self) -> dict:
        return {}

    @cached_property
    def routing(self) -> Routing:
        return Routing.of(self.scenario)

    @cached_property
    def held(self) -> list | None:
        """EP: the experts the GPU holds in each layer (Routing.held); None otherwise."""
        if self.schedule.ffn != "split":
            return None
        return self.routing.held(self.scenario.policy, self.scenario.model)

    @cached_property
    def layer_classes(self) -> tuple[tuple[bool, int, int | None], ...]:
        """Each layer's class: whether it is dense, how many experts EP holds on the GPU in it,
        and its attention's window (None: every token). A class's layers do the same work, the
        routing's mean over them (a placement of whole layers, llama.cpp's, gives some layers
        every expert and others none)."""
        m = self.scenario.model
        return tuple((m.is_dense(l), len(self.held[l]) if self.held else 0, m.window(l))
                     for l in range(self.L))

    @cached_property
    def layouts(self) -> dict[bool, WeightLayout]:
        """Where the weights of an MoE layer (False) and of a dense one (True) lie."""
        streamed = self.scenario.policy.r_w < 1.0
        pages = (self.n if self.schedule.paged else 1) if streamed else 0
        return {dense: WeightLayout(self.scenario.model, self.scenario.policy.r_w, pages,
                                    streams_experts=self.schedule.ffn == "gpu", dense=dense)
                for dense in (False, True)}

    @cached_property
    def works(self) -> dict[tuple[bool, int, int | None], TaskWork]:
        """What the tasks of each class of layers (:attr:`layer_classes`) work on."""
        s, routing = self.scenario, self.routing
        prefetches = any(op.kind == "ExpertAhead" for op in self.schedule.decode)
        on = None if self.held is None else routing.on_gpu(self.held)
        out = {}
        for cls in dict.fromkeys(self.layer_classes):
            layers = np.array([l for l, c in enumerate(self.layer_classes) if c == cls])
            out[cls] = TaskWork(s.model, s.policy, s.workload, self.layouts[cls[0]], tp=self.tp,
                                routing=routing, ffn=self.schedule.ffn, prefetches=prefetches,
                                held=None if on is None else (on, layers), window=cls[2])
        return out

    @cached_property
    def _launched(self) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
        """Per phase (prefill, decode), each kind the schedule launches and when (Op.when)."""
        sched = self.schedule
        phases: tuple[dict[str, set[str]], dict[str, set[str]]] = ({}, {})
        for phase, ops in ((0, [op for loop in sched.prefill for op in loop.ops]),
                           (1, [op for loop in sched.decode_prologue for op in loop.ops]
                            + list(sched.decode))):
            for op in ops:
                phases[phase].setdefault(op.kind, set()).add(op.when)
        return phases

    def launches(self, kind: str, step: int, layer: int, index: int) -> bool:
        """Whether the schedule launches a task of `kind` at a position (a kind launched only
        at the last layer, or only for the first micro-batch, is nowhere else)."""
        when = self._launched[min(step, 1)].get(kind, ())
        where = KINDS[kind].where
        if where is not None and not where(self.scenario.model, layer):
            return False
        return ("each" in when or ("last_layer" in when and layer == self.L - 1)
                or ("first" in when and (index == 0 or kind in PAGED)))

    def items(self, kind: str) -> int:
        """Tasks of a kind per layer and group: pages, or the group's micro-batches."""
        return self.layout.n_pages if kind in PAGED else self.n // self.groups

    def use_position(self, step: int, layer: int, index: int, per: int) -> int:
        """Where a task of a kind with `per` items per layer and group stands in its GPU's order
        of use (step, group, layer of the GPU's stage, item): the cycle a ring of buffers on
        that GPU follows. On one GPU, sharded, or in data parallel (a group per GPU), every
        layer is every GPU's."""
        group, item = divmod(index, per)
        if self.dp > 1:
            group = 0
        layers = self.stages[self.stage_of(layer)]
        return ((step * self.pp + group) * len(layers) + layer - layers.start) * per + item

    def _gpu_of_group(self, layer: int, group: int) -> int:
        return group if self.dp > 1 else self.stage_of(layer)

    def weight_pages(self, layer: int, index: int, section: str) -> list[int]:
        """The weight pages (D3 indices) a task of micro-batch `index` reads for a section of
        its layer: its group's copy of them."""
        first = self.group_of(index) * self.layout.n_pages
        return [first + p for p in self.layout_of(layer).pages_for(section)]

    def weight_buffer(self, step: int, layer: int, group: int) -> int:
        """The half of the weight double buffer (numbered over the GPUs, two each) that holds
        a layer's streamed weights for a group in a step."""
        turn = self.use_position(step, layer, group, 1)
        return 2 * self._gpu_of_group(layer, group) + turn % 2

    def kv_slot(self, step: int, layer: int, index: int) -> int:
        """The GPU KV slot (numbered over the GPUs) micro-batch `index` uses in a layer."""
        slots = self.schedule.kv_slots
        turn = self.use_position(step, layer, index, self.items("KVOut"))
        return slots * self._gpu_of_group(layer, self.group_of(index)) + turn % slots


def check_shardable(m: ModelSpec, gpus: int) -> None:
    """Tensor parallelism gives each GPU an equal block of query heads with their KV heads (or,
    with more GPUs than KV heads, a copy of one, as vLLM does; MLA's latent whole), of each
    expert's intermediate rows and of the vocabulary; a GPU count that leaves a remainder is
    refused, not priced (exec/tensor.py executes the same splits)."""
    if m.kv_split % gpus and gpus % m.kv_split:
        raise ScheduleError(
            f"Tensor parallelism splits model.n_kv = {m.n_kv} KV heads over hardware.gpu.count "
            f"= {gpus} GPUs: the count must divide them or be a multiple of them (each GPU a "
            "copy of one); choose another GPU count.")
    for field, value in (("n_q", m.n_q), ("h_i", m.h_i), ("V", m.V)):
        if value % gpus:
            raise ScheduleError(
                f"Tensor parallelism splits model.{field} = {value} evenly over "
                f"hardware.gpu.count = {gpus} GPUs; choose a GPU count that divides it.")


def make_plan(scenario: Scenario, schedule: str | Schedule | None = None) -> Plan:
    """Bind a schedule (the scenario's own by default) and check it can run the policy."""
    if schedule is None:
        schedule = scenario.schedule
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ScheduleError(
                f"Unknown schedule '{schedule}'; known schedules: {', '.join(SCHEDULES)}."
            )
        schedule = SCHEDULES[schedule]
    p, s = scenario.policy, schedule
    for key, value in s.placement.items():
        if getattr(p, key) != value:
            # Reached only by code that pairs a scenario with another schedule by hand;
            # scenario.for_schedule sets these fields.
            raise ScheduleError(
                f"Schedule {s.name} ({s.title}) decides {PLACEMENT_MEANS[key]}: policy.{key} "
                f"must be {value:g}, not {getattr(p, key):g} (scenario.for_schedule sets it).")
    ignored = [k for k, default in EXPERT_FIELDS.items()
               if getattr(p, k) != default and not s.reads(k)]
    if ignored:
        k = ignored[0]
        users = [n for n, o in SCHEDULES.items() if o.reads(k)]
        raise ScheduleError(
            f"policy.{k} = {getattr(p, k)} means nothing to schedule {s.name} ({s.title}): it "
            f"applies to {', '.join(users)}. Drop it, or choose one of those.")
    gpus = scenario.hardware.gpu.count
    if gpus > 1 and s.experts_on_host:
        raise ScheduleError(
            f"Schedule {s.name} ({s.title}) runs on one GPU; hardware.gpu.count is {gpus}. "
            "Choose a one-GPU machine, or a schedule with the FFN on the GPUs.")
    if s.parallel == "tensor" and gpus > 1:
        check_shardable(scenario.model, gpus)
    if s.grouped and gpus > 1:
        if p.n_micro % gpus:
            raise ScheduleError(
                f"Schedule {s.name} ({s.title}) splits the batch into one group per GPU: "
                f"policy.N / policy.mu = {p.n_micro} micro-batches must be a multiple of "
                f"hardware.gpu.count = {gpus}.")
        if s.parallel == "pipeline" and scenario.model.L < gpus:
            raise ScheduleError(
                f"Schedule {s.name} ({s.title}) gives each GPU a stage of layers: model.L = "
                f"{scenario.model.L} is fewer than hardware.gpu.count = {gpus}.")
    if p.n_micro < s.min_micro_batches:
        raise ScheduleError(
            f"Schedule {s.name} ({s.title}) needs at least {s.min_micro_batches} micro-batches, "
            f"but policy.N / policy.mu = {p.N} / {p.mu} = {p.n_micro}; lower policy.mu or raise "
            "policy.N."
        )
    return Plan(scenario, schedule)


# --- launch order ----------------------------------------------------------------------------

_STREAM_ORDER: tuple[str, ...] = ("gpu", "cpu", "h2d", "h2d_kv", "d2h", "pin", "peer")


def segment_size(plan: Plan, d: int) -> int:
    """About how many tasks segment `d` launches, without launching them (1.8 million took
    7.5 s to launch): a copy of the plan with a few layers launches its tasks, and every
    further layer adds as many as the last of those did. Exact where the layers are alike."""
    few = max(2, plan.gpus)
    if plan.L <= few + 1:
        return len(launch_sequence(plan, d))
    m = plan.scenario.model
    counts = [len(launch_sequence(make_plan(plan.scenario.model_copy(update={
        "model": m.model_copy(update={"L": layers})}), plan.schedule), d))
        for layers in (few, few + 1)]
    return counts[0] + (counts[1] - counts[0]) * (plan.L - few)


def launch_sequence(plan: Plan, d: int) -> list[TaskKey]:
    """Tasks of segment `d` in launch order (segment 0: prefill and decode prologue)."""
    if d < 0 or d > plan.G:
        return []
    sched = plan.schedule
    if d == 0:
        loops = [(0, lp) for lp in sched.prefill] + [(1, lp) for lp in sched.decode_prologue]
    else:
        loops = [(d, Loop("layers", sched.decode))]
    keys = [key for step, loop in loops for key in _expand(plan, step, loop)
            if key.step <= plan.G]
    if plan.tp > 1:
        return _shard(plan, keys)
    return _stage(plan, keys) if plan.groups > 1 else keys


def _shard(plan: Plan, keys: list[TaskKey]) -> list[TaskKey]:
    """Tensor parallelism: each GPU task and copy launched as one shard per GPU (a task holding
    an all-reduce as its parts), and a task whose output is a partial sum followed by the
    collective that completes it."""
    out: list[TaskKey] = []
    for key in keys:
        if key.kind not in SHARDED:
            out.append(key)
            continue
        for kind in tp_parts(key.kind, plan.scenario.model) or (key.kind,):
            out += [key._replace(kind=kind, gpu=g) for g in range(plan.tp)]
            if kind in COLLECTIVE_AFTER:
                out.append(TaskKey(key.step, COLLECTIVE_AFTER[kind], key.layer, key.index))
    return out


def _stage(plan: Plan, keys: list[TaskKey]) -> list[TaskKey]:
    """Pipeline and data parallelism: each GPU task and copy on its layer's stage or its
    group's GPU, and (pipeline) an output another stage reads followed by the send that
    carries it there."""
    out: list[TaskKey] = []
    for key in keys:
        if key.kind not in SHARDED:
            out.append(key)
            continue
        out.append(key._replace(gpu=plan.gpu_of(key)))
        send = _send_after(plan, key) if plan.pp > 1 else None
        if send is not None:
            out.append(send)
    return out


def _send_after(plan: Plan, key: TaskKey) -> TaskKey | None:
    """The send that carries a task's output to another stage, if one does."""
    kind, stage = SEND_AFTER.get(key.kind), plan.stage_of(key.layer)
    if kind == "SendTokens":      # the first stage needs them for the next step, if one comes
        return TaskKey(key.step, kind, key.layer, key.index, stage) if key.step < plan.G else None
    if kind == "Send" and key.layer == plan.stages[stage][-1] < plan.L - 1:
        return TaskKey(key.step, kind, key.layer, key.index, stage)
    return None


def lookahead_steps(plan: Plan) -> int:
    """How many steps past its own the decode body launches tasks for (CGOPipe launches the
    next step's first PreAttn and pinned copies; with one layer, two steps ahead)."""
    body = Loop("layers", plan.schedule.decode)
    return max((k.step for k in _expand(plan, 0, body)), default=0)


def _expand(plan: Plan, step: int, loop: Loop) -> Iterator[TaskKey]:
    # Positions (group, layer, item of the group): with pipeline parallelism every group runs
    # through all layers before the next group starts, as each stage runs them; with data
    # parallelism every group (GPU) runs each layer before the next; else one group.
    groups = range(plan.groups) if plan.dp > 1 else range(1)
    if loop.over == "once":
        positions = [(t, 0, 0) for t in groups]
    elif loop.over == "items":
        positions = [(t, 0, j) for t in groups for j in range(plan.layout.n_pages)]
    elif plan.dp > 1:
        per = plan.n // plan.groups
        positions = [(t, i, j) for i in range(plan.L) for t in groups for j in range(per)]
    else:
        per = plan.n // plan.pp
        positions = [(t, i, j) for t in range(plan.pp) for i in range(plan.L)
                     for j in range(per)]
    for t, i, j in positions:
        for op in loop.ops:
            if (op.when == "first" and j) or (op.when == "last_layer" and i != plan.L - 1):
                continue
            if plan.items(op.kind) == 0:   # nothing streamed: no weight tasks at all
                continue
            key = _place(plan, step, t, i, j, op)
            where = KINDS[op.kind].where
            if where is None or where(plan.scenario.model, key.layer):
                yield key


def _place(plan: Plan, step: int, t: int, i: int, j: int, op: Op) -> TaskKey:
    """The task an op launches at a position: shifted items past the group's last wrap into
    the next layer, layers past the last into the next group (in data parallel: the next
    step, each group staying on its GPU), groups into the next step."""
    per = plan.items(op.kind)
    idx = j + op.ahead
    layer = i + op.layer + idx // per
    if plan.dp > 1:
        return TaskKey(step + layer // plan.L, op.kind, layer % plan.L, t * per + idx % per)
    group = t + layer // plan.L
    return TaskKey(step + group // plan.pp, op.kind, layer % plan.L,
                   group % plan.pp * per + idx % per)


# --- dependencies ----------------------------------------------------------------------------

def _deps(plan: Plan, t: TaskKey) -> list[TaskKey]:
    """Read-after-write dependencies of a task, shards and collectives included: a shard reads
    its own GPU's shards, a later part of a split task the collective after the part before
    it, and whatever reads a partial sum (the hidden state after a layer, the logits) waits for
    the collective that completes it. Pipeline stages and data-parallel groups: see
    :func:`_stage_deps`."""
    if plan.groups > 1:
        return _stage_deps(plan, t)
    if plan.tp == 1:
        return _data_deps(plan, t)
    if t.kind in COLLECTIVES:
        producer = next(k for k, c in COLLECTIVE_AFTER.items() if c == t.kind)
        return [TaskKey(t.step, producer, t.layer, t.index, g) for g in range(plan.tp)]
    model = plan.scenario.model
    whole, parts = _whole_of(t, model)
    out: list[TaskKey] = []
    if parts and t.kind != parts[0]:
        # a later part of a split task: after the part before it (through its collective)
        before = t._replace(kind=parts[parts.index(t.kind) - 1])
        out.append(TaskKey(t.step, COLLECTIVE_AFTER[before.kind], t.layer, t.index)
                   if before.kind in COLLECTIVE_AFTER else before)
        deps = []
    else:
        deps = _data_deps(plan, whole)
    split = bool(parts)
    for d in deps:
        if d.kind == "D3" and split:
            continue                      # a part reads only its own section's pages (below)
        read = tp_parts(d.kind, model) or (d.kind,)
        if d.kind not in SHARDED:
            out.append(d)
        elif t.kind == "KVOut" and len(read) > 1:   # K,V: the shard's own attention's
            out.append(d._replace(kind=next(p for p in read if KINDS[p].fills == "kv"),
                                  gpu=t.gpu))
        elif read[-1] in COLLECTIVE_AFTER:   # a partial sum: completed
            out.append(TaskKey(d.step, COLLECTIVE_AFTER[read[-1]], d.layer, d.index))
        else:                             # the shard's own output, on its GPU
            out.append(d._replace(kind=read[-1], gpu=t.gpu))
    if split and t.kind in WEIGHT_SECTIONS:
        out += [TaskKey(t.step, "D3", t.layer, p, t.gpu)
                for p in plan.weight_pages(t.layer, t.index, WEIGHT_SECTIONS[t.kind])]
    return out


def _whole_of(t: TaskKey, model: Any) -> tuple[TaskKey, tuple[str, ...]]:
    """The one-GPU task a shard belongs to (a part of a split task belongs to the whole), and
    the whole's parts (none: the shard runs it whole). A part of several wholes (PrefillAttn,
    QKV) is prefill's Prefill's in prefill, a decode kind's in decode."""
    for whole in TP_WHOLES:
        parts = tp_parts(whole, model)
        if t.kind in parts and (t.step == 0) == (whole == "Prefill"):
            return t._replace(kind=whole, gpu=-1), parts
    return t._replace(gpu=-1), ()


def _stage_deps(plan: Plan, t: TaskKey) -> list[TaskKey]:
    """Pipeline and data parallelism: a task reads what its GPU's tasks wrote; on a pipeline,
    another stage's output only through the send that carried it, and a send reads its producer
    on the producer's GPU."""
    if t.kind in SENDS:
        producer = ("LMHead" if t.kind == "SendTokens" else "Prefill" if t.step == 0
                    else "PostAttn")
        return [TaskKey(t.step, producer, t.layer, t.index, plan.stage_of(t.layer))]
    out: list[TaskKey] = []
    for d in _data_deps(plan, t._replace(gpu=-1)):
        if d.kind not in SHARDED:
            out.append(d)
            continue
        d = d._replace(gpu=plan.gpu_of(d))
        if t.kind in SHARDED and d.gpu != t.gpu:
            d = _send_after(plan, d)
        out.append(d)
    return out


def _data_deps(plan: Plan, t: TaskKey) -> list[TaskKey]:
    """Read-after-write dependencies of a task: the tasks whose output its kind reads
    (:class:`taskgraph.kinds.Read`), and the pages of its layer's streamed weights it reads."""
    record = KINDS[t.kind]
    deps = [d for read in record.reads if (d := _producer(plan, t, read)) is not None]
    if record.weights:
        deps += [TaskKey(t.step, "D3", t.layer, p)
                 for p in plan.weight_pages(t.layer, t.index, record.weights)]
    return deps


def _producer(plan: Plan, t: TaskKey, read: Read) -> TaskKey | None:
    """The task a read finds: the first of its kinds the schedule launches at the position it
    names; None where there is nothing to read (before the prefill, or a read of what this
    schedule does not produce). A read the schedule launches nothing for names its first kind,
    which the builder then reports as never launched."""
    step, layer = t.step + read.step, t.layer + read.layer
    if layer < 0:                           # the layer before the first: the last, a step back
        step, layer = step - 1, layer + plan.L
    if step < 0:
        return None
    index = t.index if read.index is None else read.index
    for kind in read.kinds:
        if plan.launches(kind, step, layer, index):
            return TaskKey(step, kind, layer, index)
    return None if read.if_launched else TaskKey(step, read.kinds[0], layer, index)


class _Ring:
    """A buffer of slots reused in a fixed cycle: a producer of item g overwrites the slot of
    item g - back, so it must wait for the last consumer of that item."""

    def __init__(self, plan: Plan, name: str, producers: tuple[str, ...], back: int, per: int):
        self.plan, self.name, self.producers, self.back, self.per = plan, name, producers, back, per
        # A GPU-side buffer exists once per GPU; the host's pinned staging serves them all.
        self.per_gpu = any(p in SHARDED for p in producers)

    def item(self, step: int, layer: int, index: int) -> int:
        """Position in the ring's use order (negative items are empty slots)."""
        return self.plan.use_position(step, layer, index, self.per)


def _rings(plan: Plan) -> tuple[list[_Ring], dict[str, list[tuple[_Ring, Callable]]]]:
    """The rings of this plan and, per consumer kind, the items of each ring it reads:

    * ``weights``: the double buffer a layer's streamed weights cross into, page by page (D3),
      read by the kinds that read a section of them (their pages);
    * ``pinned``: the pinned staging slots (W_CtoPin) D3 copies from, where weights are staged;
    * ``kv``: the GPU KV slots: prefill writes a micro-batch's K,V there for KVOut to copy out;
      with GPU attention, decode prefetches the KV cache into them (D4) for GPUAttn, which
      appends the new K,V that KVOut copies back.

    Which kinds fill and read each ring is their records' (``fills``, ``reads_slots``)."""
    sched, n_pages = plan.schedule, plan.layout.n_pages
    slots = {"weights": 2 * n_pages, "pinned": sched.pin_slots if sched.staging else 0,
             "kv": sched.kv_slots}
    if not n_pages:                         # nothing streamed: no weight copies at all
        slots["weights"] = slots["pinned"] = 0
    rings: list[_Ring] = []
    readers: dict[str, list] = {}
    for name, back in slots.items():
        if not back:
            continue
        producers = tuple(k.name for k in KINDS.values() if k.fills == name)
        ring = _Ring(plan, name, producers, back, plan.items(producers[0]))
        rings.append(ring)
        for k in KINDS.values():
            if name == "weights" and k.weights:
                readers.setdefault(k.name, []).append(
                    (ring, lambda t, r=ring, section=k.weights: [
                        r.item(t.step, t.layer, p)
                        for p in plan.weight_pages(t.layer, t.index, section)]))
            elif name in k.reads_slots:
                readers.setdefault(k.name, []).append(
                    (ring, lambda t, r=ring: [r.item(t.step, t.layer, t.index)]))
    return rings, readers


# --- the graph -------------------------------------------------------------------------------

def build_segment(plan: Plan, d: int) -> nx.DiGraph:
    """The DAG of segment `d`: its tasks (attribute ``order`` = launch position) and, marked
    ``external``, the previous segment's tasks they depend on. Edges carry ``why``: ``data`` or
    ``reuse:<ring>``."""
    prev, cur = launch_sequence(plan, d - 1), launch_sequence(plan, d)
    rings, ring_readers = _rings(plan)
    producer_of = {kind: r for r in rings for kind in r.producers}
    launched: dict[TaskKey, tuple[int, int]] = {}       # key -> (segment offset, position)
    # (ring, item, GPU or -1) -> stream -> where its last reader was launched
    last_reader: dict[tuple[str, int, int], dict[str, tuple[int, int]]] = {}
    overwritten: dict[tuple[str, int, int], TaskKey] = {}
    later: set[TaskKey] | None = None
    g = nx.DiGraph(schedule=plan.schedule.name, segment=d, prev_len=len(prev))

    for seg, seq in ((-1, prev), (0, cur)):
        for pos, key in enumerate(seq):
            ring = producer_of.get(key.kind)
            old = ring.item(key.step, key.layer, key.index) - ring.back if ring else -1
            slot = (ring.name, old, key.gpu if ring.per_gpu else -1) if ring else None
            if seg == 0:
                _add_node(g, plan, key, pos, external=False)
                for dep in _deps(plan, key):
                    where = launched.get(dep)
                    if where is None:
                        if later is None:
                            later = set(cur[pos:]) | set(launch_sequence(plan, d + 1))
                        _missing(plan, key, dep, dep in later)
                    _add_edge(g, plan, dep, where, key, "data")
                if old >= 0:
                    # The last reader on each stream: readers on different streams can finish
                    # in any order.
                    last = last_reader.get(slot)
                    if not last:
                        raise ScheduleError(
                            f"Schedule {plan.schedule.name} launches {key.name}, which reuses a "
                            f"{ring.name} buffer slot whose readers are not in this segment or "
                            "the one before.")
                    for where in last.values():
                        src = prev[where[1]] if where[0] < 0 else cur[where[1]]
                        _add_edge(g, plan, src, where, key, "reuse:" + ring.name)
            launched[key] = (seg, pos)
            if slot is not None:
                overwritten[slot] = key
            for r, items_of in ring_readers.get(key.kind, ()):
                for item in items_of(key):
                    read = (r.name, item, key.gpu if r.per_gpu else -1)
                    if seg == 0 and read in overwritten:
                        raise ScheduleError(
                            f"Schedule {plan.schedule.name} launches {key.name} after "
                            f"{overwritten[read].name}, which overwrites the "
                            f"{r.name} buffer slot it reads."
                        )
                    last_reader.setdefault(read, {})[plan.stream_of(key)] = (seg, pos)
    return g


def _add_node(g: nx.DiGraph, plan: Plan, key: TaskKey, pos: int, external: bool) -> None:
    work = plan.task_work(key)
    g.add_node(key.name, kind=key.kind, step=key.step, layer=key.layer, index=key.index,
               gpu=key.gpu, stream=plan.stream_of(key),
               resource=STREAM_RESOURCE[plan.schedule.streams[key.kind]], order=pos,
               external=external,
               flops=work.flops, flops_per_ctx=work.flops_per_ctx, bytes=work.bytes,
               bytes_per_ctx=work.bytes_per_ctx)


def _add_edge(g: nx.DiGraph, plan: Plan, dep: TaskKey, where: tuple[int, int], key: TaskKey,
              why: str) -> None:
    name = dep.name
    if name not in g:
        _add_node(g, plan, dep, where[1], external=True)
    g.add_edge(name, key.name, why=why)


def _missing(plan: Plan, key: TaskKey, dep: TaskKey, launched_later: bool) -> NoReturn:
    name = f"Schedule {plan.schedule.name} ({plan.schedule.title})"
    if launched_later:
        raise ScheduleError(
            f"{name} launches {key.name} before {dep.name}, which it needs; on real streams it "
            "would wait on an event not yet recorded. Reorder the schedule's ops."
        )
    raise ScheduleError(
        f"{name} launches {key.name}, which needs {dep.name}, but that task is not launched in "
        "this segment or the one before; the schedule description is incomplete."
    )
