"""HRM prediction of a policy's throughput, straight from the schedule description.

The policy search evaluates tens of thousands of policies, too many to build a graph for each.
The tasks of one layer are counted from the schedule's launch-order description, the data the
builder uses, and priced with the same work (:mod:`taskgraph.dag.work`) and cost
(:mod:`taskgraph.perf.cost`) models the simulator uses. A decode layer at context ``s`` is predicted to
take ``max`` over resources of the time its tasks need there (Eq. 12-14: perfect overlap), summed
over every decode step's context. Prefill layers likewise. The simulator's ``hrm_layer_ms`` is
the same bound taken over a whole simulated run.

Three effects of the launch order are large enough to rank schedules wrongly without them, and
the prediction takes them where they exceed the HRM bound:

* A schedule that copies the next layer's weights whole (not in pages) queues that copy on the
  CPU->GPU link ahead of the micro-batches' own copies (hidden states, KV), and the link serves in
  order: only the micro-batches whose copies went first overlap the weight copy (one when they
  share its stream; S4's KV prefetch rides a stream of its own and runs ahead into its
  ``kv_slots``), the others follow it. A layer then takes at least
  ``D3 + copy of the first waiting micro-batch + waiting x pace``.
* The pace of a micro-batch is the busiest resource's share of it when the schedule launches with
  lookahead (micro-batches pipeline), but the sum over resources when it launches each
  micro-batch's chain only after the previous one (FlexGen's order, S3): nothing overlaps.

* Under tensor parallelism, prefill launches each micro-batch's parts one after the other on
  the GPU's in-order stream, and a part waits for the all-reduce before it with nothing queued
  to fill the wait: the GPU's prefill time includes the collectives a later part of the same
  micro-batch waits for (on four T4s, OLMoE's prefill was predicted 23% short without it).

On the T4, S2 simulates at 370 ms per layer against a 231 ms HRM bound; 370 is predicted.

What the GPUs of a host share (``hardware.shared``: host memory bandwidth, the PCIe lanes
upstream of the links) enters as one more row per pool beside the resources: the bytes every
GPU's tasks draw from it, over its capacity. That is the pool's own HRM term; how much more the
tasks lose when their bursts collide the simulator finds (:mod:`taskgraph.sim.contention`).

Everything is vectorised over the number of micro-batches, since most policy knobs change work
per micro-batch but not the shape of the computation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from taskgraph.dag.schedules import (EXPERT_FIELDS, PER_GPU, RESOURCES, STREAM_RESOURCE, Op,
                                      Schedule)
from taskgraph.dag.work import TaskWork, WeightLayout
from taskgraph.kinds import COLLECTIVE_AFTER, COLLECTIVES, KIND_INDEX, KINDS, PAGED, tp_parts
from taskgraph.perf.cost import POOLS, CostModel, cost_model
from taskgraph.specs import ModelSpec, PolicySpec, Scenario


@dataclass(frozen=True)
class Predictions:
    """Predicted figures for policies that differ only in their number of micro-batches `n`."""

    n: np.ndarray
    throughput_tok_s: np.ndarray
    prefill_s: np.ndarray
    decode_s: np.ndarray
    decode_layer_ms: np.ndarray
    hrm_layer_ms: np.ndarray     # the HRM bound alone (perfect overlap)
    binding: np.ndarray          # index into ROWS of the busiest decode resource or pool


#: What the prediction prices per layer: every resource, then every shared pool.
ROWS: tuple[str, ...] = RESOURCES + POOLS


def predict(scenario: Scenario, schedule: Schedule, cost: CostModel | None = None
            ) -> Predictions:
    """The prediction for the scenario's own policy."""
    p = scenario.policy
    return predict_micro_batches(scenario, schedule, p.mu, p.r_w, p.r_c,
                                 np.array([p.n_micro]), cost)


def predict_lengths(scenario: Scenario, schedule: Schedule, lengths: list[int],
                    cost: CostModel | None = None) -> list[Predictions]:
    """The scenario's own policy generating each of `lengths` tokens, from one prediction of
    the longest: a decode step's time depends on its context alone, so a shorter run's steps
    are the longer one's first (equal to predicting each length alone, but for rounding)."""
    p = scenario.policy
    return _predict(scenario, schedule, p.mu, p.r_w, p.r_c, np.array([p.n_micro]), cost,
                    lengths)


def predict_micro_batches(scenario: Scenario, schedule: Schedule, mu: int, r_w: float,
                          r_c: float, n: np.ndarray, cost: CostModel | None = None
                          ) -> Predictions:
    """Predictions for batches of ``n * mu`` sequences in ``n`` micro-batches, for every n."""
    return _predict(scenario, schedule, mu, r_w, r_c, n, cost, [scenario.decode_steps])[0]


def _predict(scenario: Scenario, schedule: Schedule, mu: int, r_w: float, r_c: float,
             n: np.ndarray, cost: CostModel | None, lengths: list[int]) -> list[Predictions]:
    cost = cost or cost_model(scenario, schedule.name)
    m, w = scenario.model, scenario.workload
    batches = np.asarray(n, dtype=float)
    # A pipeline's stages each run every layer of theirs once per group, a group at a time,
    # all stages at once on different groups: per step, every stage does the work of L layers
    # of one group's micro-batches (n / stages of them), in parallel with the others. In data
    # parallel every GPU runs every layer on its own group, all at once: the same per GPU.
    gpus = scenario.hardware.gpu.count
    groups = gpus if schedule.grouped else 1
    n = batches / groups
    L = m.L
    streamed = r_w < 1.0
    n_pages = (n if schedule.paged else np.ones_like(n)) if streamed else np.zeros_like(n)
    # Work per task, with weight pages for one page per layer; page sizes scale with n below.
    policy = PolicySpec.model_construct(
        N=mu, mu=mu, A_g=int(schedule.attention == "gpu"), F_g=int(schedule.ffn == "gpu"),
        r_w=r_w, r_c=r_c, **{f: getattr(scenario.policy, f) for f in EXPERT_FIELDS})
    tp = gpus if schedule.parallel == "tensor" else 1
    contexts = w.context_prompt + np.arange(1, max(lengths) + 1, dtype=float)
    # Layers alike in what their tasks do (MoE or dense, full or sliding-window attention,
    # as many experts held on the GPU), each priced once and counted as often as the model
    # has them.
    layers = []
    for layer, count, work in _layer_works(scenario, schedule, policy, tp, streamed):
        seen = np.minimum(contexts, work.window or np.inf)
        layers.append((count, *_layer_time(scenario, schedule, work, cost, n, n_pages, layer,
                                           seen, streamed)))
    out = []
    for G in lengths:
        decode_s = prefill_s = hrm_s = 0.0
        decode_rows = 0.0
        for count, decode, layer_s, prefill in layers:
            decode_s = decode_s + count * layer_s[:, :G].sum(axis=1)
            prefill_s = prefill_s + count * prefill.max(axis=0)
            hrm_s = hrm_s + count * decode[..., :G].max(axis=0).sum(axis=1)
            decode_rows = decode_rows + count * decode[..., :G]
        total = prefill_s + decode_s
        out.append(Predictions(
            n=batches.astype(int),
            throughput_tok_s=batches * mu * G / total,
            prefill_s=prefill_s,
            decode_s=decode_s,
            decode_layer_ms=decode_s / (G * L) * 1e3,
            hrm_layer_ms=hrm_s / (G * L) * 1e3,
            binding=decode_rows.sum(axis=2).argmax(axis=0),
        ))
    return out


def _layer_works(scenario: Scenario, schedule: Schedule, policy: PolicySpec, tp: int,
                 streamed: bool) -> list[tuple[int, int, TaskWork]]:
    """(a layer, how many layers are like it, their tasks' work) for each class of layers.
    Where the experts run apart from the layer's weights (on the CPU, placed or cached on the
    GPU), the work is the builder's plan's: which experts the GPU holds or caches, under the
    scenario's routing."""
    m, w = scenario.model, scenario.workload
    if schedule.ffn != "gpu":
        from taskgraph.dag.builder import Plan

        plan = Plan(scenario.model_copy(update={"policy": policy}), schedule)
        counts = Counter(plan.layer_classes)
        return [(plan.layer_classes.index(c), n, plan.works[c]) for c, n in counts.items()]
    out = []
    for layer, count in _layer_classes(m):
        layout = WeightLayout(m, policy.r_w, 1 if streamed else 0, streams_experts=True,
                              dense=m.is_dense(layer))
        out.append((layer, count, TaskWork(m, policy, w, layout, tp=tp,
                                           window=m.window(layer))))
    return out


def _layer_classes(model) -> list[tuple[int, int]]:
    """(a layer, how many are like it) for each kind of layer the model has."""
    classes: dict[tuple[bool, int | None], list[int]] = {}
    for layer in range(model.L):
        classes.setdefault((model.is_dense(layer), model.window(layer)), []).append(layer)
    return [(layers[0], len(layers)) for layers in classes.values()]


def _layer_time(scenario: Scenario, schedule: Schedule, work: TaskWork, cost: CostModel,
                n: np.ndarray, n_pages: np.ndarray, layer: int, contexts: np.ndarray,
                streamed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer like `layer`: each resource's decode work (ROWS, n, steps), the layer's time
    in each step (n, steps), and each resource's prefill work (ROWS, n)."""
    m, w, tp = scenario.model, scenario.workload, work.tp
    L = m.L
    decode_ops = _with_collectives(_ops_of(m, schedule.decode, layer), tp, m)
    # each kind's decode work, priced once for the layer's total and the parts of it below
    terms: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}
    decode = _per_layer_time(schedule, decode_ops, work, cost, n, n_pages, L, contexts,
                             prefill=False, terms=terms)          # (resources, n, steps)
    prefill_ops = _with_collectives(_ops_of(
        m, tuple(op for lp in schedule.prefill if lp.over == "layers" for op in lp.ops), layer),
        tp, m)
    prompt = np.array([float(w.context_prompt)])
    prefill_terms: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}
    prefill = _per_layer_time(schedule, prefill_ops, work, cost, n, n_pages, L, prompt,
                              prefill=True, terms=prefill_terms)[..., 0]
    # Prefill launches each micro-batch's parts one after the other on the GPU's in-order
    # stream: a part that needs the all-reduce before it waits for it, with nothing queued to
    # fill the wait (only a micro-batch's last collective overlaps the next one's first part)
    exposed = _exposed_collectives(schedule, prefill_ops)
    if exposed:
        waits = _per_layer_time(schedule, exposed, work, cost, n, n_pages, L, prompt,
                                prefill=True, terms=prefill_terms)[..., 0]
        prefill[ROWS.index("gpu")] += waits[ROWS.index("peer")]

    hrm = decode.max(axis=0)                                      # (n, steps)
    whole = streamed and not schedule.paged
    # A layer's whole-layer work (its weight copy, and with staging its copy into pinned memory)
    # is no micro-batch's: it sets no micro-batch's pace.
    once = copy = 0.0
    if whole:
        def per_layer(ops) -> np.ndarray:
            return _per_layer_time(schedule, tuple(ops), work, cost, n, n_pages, L, contexts,
                                   prefill=False, terms=terms)

        own = _ops_of(m, schedule.decode, layer)
        once = per_layer(op for op in own if op.when == "first")
        copy = per_layer(op for op in own if op.kind == "D3")
    per_micro_batch = (decode - once) / n[:, None]                # (rows, n, steps)
    # Launched with lookahead, micro-batches pipeline and the busiest resource sets the pace;
    # launched one after the other (FlexGen's order), each waits for the one before it.
    lookahead = any(op.ahead > 0 for op in decode_ops)
    pace = per_micro_batch.max(axis=0) if lookahead else per_micro_batch.sum(axis=0)
    if whole:
        # Micro-batches whose own copies the weight copy holds up wait for it. Copies on a
        # stream of their own (S4's KV prefetch) run ahead into their slots, so the first
        # `kv_slots` micro-batches went before the copy started, and the next waits for the
        # copy and then its own share of the link.
        free = _ahead_of_copy(schedule, decode_ops)
        h2d = ROWS.index("h2d")
        waiting = np.maximum(n - free, 0)[:, None]
        # the copy takes its link's time, or what it draws from a shared pool over the pool's
        # capacity (every GPU copies at once), whichever is longer
        layer_s = np.maximum(hrm, copy.max(axis=0)
                             + np.where(waiting > 0, per_micro_batch[h2d], 0.0)
                             + waiting * pace)
    else:
        layer_s = np.maximum(hrm, n[:, None] * pace)
    return decode, layer_s, prefill


def _ops_of(model, ops, layer: int) -> tuple[Op, ...]:
    """The ops a layer like `layer` launches (a dense layer no expert's, ...)."""
    return tuple(op for op in ops
                 if KINDS[op.kind].where is None or KINDS[op.kind].where(model, layer))


def _ahead_of_copy(schedule: Schedule, ops) -> int:
    """How many of a layer's micro-batches go before its whole-layer weight copy on the link:
    one, if a micro-batch's own CPU->GPU copies queue on the weight copy's stream; the copies'
    slots (`kv_slots`), if they ride a stream of their own."""
    d3 = schedule.streams["D3"]
    own = {schedule.streams[op.kind] for op in ops
           if op.when == "each" and STREAM_RESOURCE[schedule.streams[op.kind]] == "h2d"}
    return schedule.kv_slots if own and d3 not in own else 1


def _exposed_collectives(schedule: Schedule, ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """The collectives of a micro-batch's ops that a later GPU op of the same micro-batch
    waits for."""
    gpu = [i for i, op in enumerate(ops)
           if op.when == "each" and STREAM_RESOURCE[schedule.streams[op.kind]] == "gpu"]
    return tuple(op for i, op in enumerate(ops)
                 if op.kind in COLLECTIVES and op.when == "each" and gpu and i < gpu[-1])


def _with_collectives(ops: tuple[Op, ...], tp: int, model: ModelSpec) -> tuple[Op, ...]:
    """Under tensor parallelism, each op as the builder launches it: a task holding an
    all-reduce as its parts, each part whose output is a partial sum followed by its collective
    (every GPU's shard takes one GPU's time, so a resource's time below is that of each
    GPU's)."""
    if tp == 1:
        return ops
    out: list[Op] = []
    for op in ops:
        for kind in tp_parts(op.kind, model) or (op.kind,):
            out.append(Op(kind, op.ahead, op.layer, op.when))
            if kind in COLLECTIVE_AFTER:
                out.append(Op(COLLECTIVE_AFTER[kind], op.ahead, op.layer, op.when))
    return tuple(out)


def _per_layer_time(schedule: Schedule, ops, work: TaskWork, cost: CostModel, n: np.ndarray,
                    n_pages: np.ndarray, L: int, contexts: np.ndarray, prefill: bool,
                    terms: dict | None = None) -> np.ndarray:
    """Seconds each resource works per layer, and each shared pool is drawn on by every GPU's
    tasks together: array (ROWS, len(n), len(contexts)). `terms` keeps each (kind, when)'s
    share between calls on the same work, micro-batches and contexts."""
    out = np.zeros((len(ROWS), len(n), len(contexts)))
    terms = {} if terms is None else terms
    for op in ops:
        key = (op.kind, op.when)
        shares = terms.get(key)
        if shares is None:
            shares = terms[key] = _op_shares(schedule, op, work, cost, n, n_pages, L, contexts,
                                             prefill)
        for row, share in shares:
            out[row] += share
    return out


def _op_shares(schedule: Schedule, op: Op, work: TaskWork, cost: CostModel, n: np.ndarray,
               n_pages: np.ndarray, L: int, contexts: np.ndarray, prefill: bool
               ) -> list[tuple[int, np.ndarray]]:
    """What one op adds per layer: (row of ROWS, seconds (len(n), len(contexts))) for its
    resource and each shared pool it draws on."""
    paged = op.kind in PAGED
    if paged and not n_pages.any():
        return []
    # Launches per layer: every micro-batch (or page), once per layer, or once per
    # micro-batch per step (the LM head, spread over the step's layers).
    if op.when == "each":
        count = n_pages if paged else n
    elif op.when == "first":
        count = np.ones_like(n)
    else:                       # "last_layer"
        count = n / L
    r = RESOURCES.index(STREAM_RESOURCE[schedule.streams[op.kind]])
    kind = KIND_INDEX[op.kind]
    wk = work.of(op.kind, prefill=prefill)
    flops = wk.flops + wk.flops_per_ctx * contexts                 # (contexts,)
    nbytes = wk.bytes + wk.bytes_per_ctx * contexts
    if paged:   # one page holds 1/n_pages of the streamed bytes
        nbytes = np.divide.outer(nbytes, np.maximum(n_pages, 1)).T    # (n, contexts)
        flops = np.broadcast_to(flops, nbytes.shape)
    t = cost.times_of(r, kind, flops, nbytes)
    shape = (len(n), len(contexts))
    shares = [(r, count[:, None] * t)]                             # (n, contexts)
    pooled = cost.pooled
    if pooled.size:
        # every GPU runs this task (its shard, or its group's) at once; a collective is one
        # task whose draw counts every GPU already; a pipeline's sends leave every stage
        resource = RESOURCES[r]
        each = cost.hardware.gpu.count if resource in PER_GPU or (
            resource == "peer" and schedule.grouped) else 1
        drawn = cost.pool_bytes(r, kind, np.broadcast_to(nbytes, shape))   # (pools, n, ctx)
        for p in pooled:
            shares.append((len(RESOURCES) + p,
                           count[:, None] * each * drawn[p] / cost.pool_capacity[p]))
    return shares
