"""A queue of requests, simulated batch after batch.

The scenario's request list is packed for its policy (:func:`taskgraph.serving.requests.pack_scenario`:
Algorithm 2, or padded in arrival order) and each batch is simulated on its own, back to back.
Every task is priced by its own micro-batch's requests (:class:`taskgraph.serving.requests.BatchLoad`):
prefill by the actual prompt tokens, attention by the actual contexts, the FFN by the tokens
still generating and the experts they reach. A request stops at its own generation length, so
its micro-batch shrinks; a micro-batch whose requests have all finished is skipped, and the
batch ends with its longest request.

With ``workload.refill`` the queue runs instead as one continuous batch
(:func:`taskgraph.serving.requests.refill`): a finished request's slot goes to the next request, whose
prompt is prefilled within its micro-batch's tasks of the next decode step, so the GPU
prefills while the CPU attends for the others (MoE-Lens's prefill/decode overlap). The graph is
the schedule's own, one long run; only the work of its tasks changes.

The figures add up over the batches (times, tasks) or are weighted by them (decode-layer
latency by decode layers, utilisation by time); throughput counts every request's own
generated tokens over the whole queue's time. Each request's finish time is the end of the LM
head that produced its last token.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from taskgraph.dag.builder import make_plan
from taskgraph.dag.compiled import Program, compile_plan
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.errors import TgError
from taskgraph.files import atomic_path, csv_row
from taskgraph.kinds import KIND_NAMES
from taskgraph.output.report import Shown, queue_rows, simulate_table, warnings_of
from taskgraph.perf.cost import cost_model
from taskgraph.perf.limits import hardware_limit_tok_s
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.serving.requests import BatchLoad, Packing, Refill, Request, pack_scenario, refill
from taskgraph.sim.engine import SimRun
from taskgraph.sim.interference import simulate_with_interference
from taskgraph.sim.metrics import summarize
from taskgraph.sim.simulate import check_size
from taskgraph.specs import Scenario
from taskgraph.tracing.writer import Traced, TraceRun


@dataclass
class BatchRun:
    summary: dict[str, Any]
    offset_s: float               # when the batch started, in the queue's time
    program: Program | None       # the batch's tasks and their times, when kept
    run: SimRun | None


@dataclass
class QueueRun(Shown, Traced):
    """A request list simulated batch after batch (or as one refilled batch); `summary` is the
    JSON of `tg simulate` on it."""

    packing: Packing | Refill
    batches: list[BatchRun]
    finish_s: dict[str, float]       # request id -> when its last token was produced
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.summary

    def views(self):
        yield simulate_table(self.summary, queue_rows(self.summary))
        yield from warnings_of(self.summary)

    def write_csv(self, path: str) -> None:
        """Each request's batch, micro-batch, prefill step and finish time, as CSV."""
        import csv

        with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["id", "prompt_len", "gen_len", "batch", "micro_batch",
                          "prefill_step", "finish_s"])
            out.writerows(csv_row(row) for row in self.rows())

    def gantt_runs(self) -> list[TraceRun]:
        return self.trace_runs()[:1]

    def rows(self) -> list[tuple]:
        """Per request: id, prompt_len, gen_len, batch, micro-batch, the step that prefilled it,
        finish time (s); aborted requests last, with batch 'aborted'."""
        out = []
        if isinstance(self.packing, Refill):
            placed = [(a.request, 0, a.micro_batch, a.step) for a in self.packing.admissions]
        else:
            placed = [(r, b, j, 0) for b, batch in enumerate(self.packing.batches)
                      for j, mb in enumerate(batch) for r in mb.requests]
        for r, b, j, step in placed:
            finish = f"{self.finish_s[r.id]:.6g}" if r.id in self.finish_s else ""
            out.append((r.id, r.prompt_len, r.gen_len, b, j, step, finish))
        out += [(r.id, r.prompt_len, r.gen_len, "aborted", "", "", "")
                for r in self.packing.aborted]
        return out

    def trace_runs(self) -> list[TraceRun]:
        if any(r.run is None for r in self.batches):        # else an empty trace, saying nothing
            raise TgError("This request list's batches kept no task times to draw. A "
                          "20,000-request queue is 17 M tasks, so they are kept only when asked: "
                          "keep_runs=True in the Python API (--trace and --gantt ask).")
        part = "window" if isinstance(self.packing, Refill) else "batch"
        return [TraceRun(f"{part} {b}", r.program, r.run.start, r.run.end, r.offset_s,
                         written_back=cost_model(r.program.plan.scenario,
                                                 r.program.plan.schedule.name).kind_written_back)
                for b, r in enumerate(self.batches)]


def simulate_queue(scenario: Scenario, progress: Callable[[int, int], None] | None = None,
                   keep_runs: bool = False) -> QueueRun:
    """Simulate the scenario's whole request list with its own schedule. `progress(done,
    total)` is called after each batch. Each batch's task times are kept only with
    `keep_runs` (for traces): a 20,000-request queue is 17 M tasks."""
    t0 = time.perf_counter()
    schedule = SCHEDULES[scenario.schedule]
    mean_plan = make_plan(scenario)
    memory = memory_footprint(mean_plan)
    warnings = check_fits(memory, schedule.name)
    if scenario.workload.refill:
        q = _simulate_refill(scenario, memory, progress, keep_runs)
    else:
        q = _simulate_batches(scenario, memory, progress, keep_runs)
    q.summary["warnings"] = warnings
    q.summary["wall_s"] = round(time.perf_counter() - t0, 3)
    return q


def _simulate_batches(scenario: Scenario, memory, progress, keep_runs: bool) -> QueueRun:
    schedule = SCHEDULES[scenario.schedule]
    packing = pack_scenario(scenario)
    w, p = scenario.workload, scenario.policy
    padded = w.padded
    longest = max(r.prompt_len for r in scenario.requests) if padded else None
    compiled: dict[tuple[int, int], Program] = {}
    batches: list[BatchRun] = []
    finish: dict[str, float] = {}
    offset = 0.0
    for b, batch in enumerate(packing.batches):
        n = max(len(batch), schedule.min_micro_batches)
        steps = w.gen_len if padded else max(r.gen_len for mb in batch for r in mb.requests)
        sc = scenario.model_copy(update={
            "workload": w.model_copy(update={"gen_len": steps}),
            "policy": p.model_copy(update={"N": n * p.mu})})
        plan = dataclasses.replace(make_plan(sc), load=BatchLoad.of(
            batch, n, padded_to=longest, gen_to=steps if padded else None))
        key = (n, steps)
        if key not in compiled:       # the task graph depends on the shape, not the lengths
            compiled[key] = compile_plan(plan)
            check_size(compiled[key].total)     # as a mean-length run of this size would be
        program = dataclasses.replace(compiled[key], plan=plan)
        cost = cost_model(sc, schedule.name)
        run = simulate_with_interference(program, cost)
        batches.append(BatchRun(summarize(run, memory, cost), offset,
                                program if keep_runs else None, run if keep_runs else None))
        ends = _lm_head_ends(program, run)
        for j, mb in enumerate(batch):
            for r in mb.requests:
                finish[r.id] = offset + ends[steps if padded else r.gen_len, j]
        offset += float(np.nanmax(run.end)) if run.finished.any() else 0.0
        if progress is not None:
            progress(b + 1, len(packing.batches))
        if run.interrupted:
            break
    requests = [r for b in packing.batches for mb in b for r in mb.requests]
    micro = sum(len(b) for b in packing.batches[:len(batches)])
    summary = _summary(scenario, requests, packing.aborted, batches, finish, micro,
                       packing.padded)
    return QueueRun(packing, batches, finish, summary)


#: Tasks simulated at once in a refill run: each window of steps is its own program, so memory
#: stays that of one window (~175 bytes a task) however long the queue.
_WINDOW_TASKS = 1_000_000


def _simulate_refill(scenario: Scenario, memory, progress, keep_runs: bool) -> QueueRun:
    """The queue as one continuous batch: the schedule's graph for every step until the last
    request finishes, each task priced by what its micro-batch holds at that step. Long runs
    are simulated in windows of steps back to back, each a program whose step 0 (the prefill
    segment) does nothing: a window starts with an empty pipeline, which costs it about one
    layer's weight transfer against the run it stands for (a window is hundreds of steps)."""
    schedule = SCHEDULES[scenario.schedule]
    w, p = scenario.workload, scenario.policy
    cont = refill(scenario.requests, p.mu, p.n_micro, p.mu * (w.context_prompt + w.gen_len))
    n = max(p.n_micro, schedule.min_micro_batches)
    load = cont.load(n)
    per_step = _tasks_per_step(scenario, n)
    width = max(8, _WINDOW_TASKS // per_step)
    windows = [(d0, min(cont.steps, d0 + width)) for d0 in range(0, cont.steps, width)]
    batches: list[BatchRun] = []
    ends: dict[tuple[int, int], float] = {}
    compiled: dict[int, Program] = {}
    offset = 0.0
    for k, (d0, d1) in enumerate(windows):
        sc = scenario.model_copy(update={
            "workload": w.model_copy(update={"gen_len": d1 - d0}),
            "policy": p.model_copy(update={"N": n * p.mu})})
        plan = dataclasses.replace(make_plan(sc), load=load.window(d0, d1))
        if d1 - d0 not in compiled:        # windows of one width share their task graph
            compiled[d1 - d0] = compile_plan(plan)
            check_size(compiled[d1 - d0].total)
        program = dataclasses.replace(compiled[d1 - d0], plan=plan)
        cost = cost_model(sc, schedule.name)
        run = simulate_with_interference(program, cost)
        batches.append(BatchRun(summarize(run, memory, cost), offset,
                                program if keep_runs else None, run if keep_runs else None))
        ends.update({(step + d0, j): offset + t
                     for (step, j), t in _lm_head_ends(program, run).items() if step > 0})
        offset += float(np.nanmax(run.end)) if run.finished.any() else 0.0
        if progress is not None:
            progress(k + 1, len(windows))
        if run.interrupted:
            break
    finish = {a.request.id: ends[a.last_step, a.micro_batch] for a in cont.admissions
              if not np.isnan(ends.get((a.last_step, a.micro_batch), np.nan))}
    summary = _summary(scenario, [a.request for a in cont.admissions], cont.aborted, batches,
                       finish, p.n_micro, False)
    summary["requests"]["refill"] = True
    summary["requests"]["batches"] = 1
    summary["requests"]["windows"] = len(batches)
    return QueueRun(cont, batches, finish, summary)


def _tasks_per_step(scenario: Scenario, n: int) -> int:
    """Tasks in one decode step of `n` micro-batches under the scenario's schedule."""
    p = scenario.policy
    sc = scenario.model_copy(update={
        "workload": scenario.workload.model_copy(update={"gen_len": 3}),
        "policy": p.model_copy(update={"N": n * p.mu})})
    program = compile_plan(make_plan(sc))
    return max(1, int((program.step == 2).sum()))


def _lm_head_ends(program: Program, run: SimRun) -> dict[tuple[int, int], float]:
    """(step, micro-batch) -> when its LM head ended: a token for each request generating."""
    lm = np.flatnonzero(program.column("kind") == KIND_NAMES.index("LMHead"))
    return dict(zip(zip(program.step[lm].tolist(), program.column("index")[lm].tolist()),
                    run.end[lm].tolist()))


def _summary(scenario: Scenario, requests: list[Request], aborted, batches: list[BatchRun],
             finish: dict[str, float], micro_batches: int, padded: bool) -> dict[str, Any]:
    s = [b.summary for b in batches]
    first = s[0]
    makespan = sum(x["makespan_s"] for x in s)
    layers = [x["steps"] * x["layers"] for x in s]
    decode_s = sum(x["decode_s"] for x in s)
    layer_ms = decode_s / max(sum(layers), 1) * 1e3
    hrm_ms = sum(x["hrm_layer_ms"] * n for x, n in zip(s, layers)) / max(sum(layers), 1)
    by_id = {r.id: r for r in requests}
    tokens = sum(by_id[i].gen_len for i in finish)
    throughput = tokens / makespan if makespan else 0.0
    limit = hardware_limit_tok_s(scenario)
    times = sorted(finish.values())
    out = {k: first[k] for k in ("scenario", "schedule", "schedule_title", "model", "hardware",
                                 "policy")}
    out.update({
        "throughput_tok_s": _r(throughput),
        "hardware_limit_tok_s": _r(limit),
        "hardware_limit_fraction": _r(throughput / limit) if limit else None,
        "prefill_s": _r(sum(x["prefill_s"] for x in s)),
        "decode_s": _r(decode_s),
        "overlap_s": _r(sum(x["overlap_s"] for x in s)),
        "makespan_s": _r(makespan),
        "decode_layer_ms": _r(layer_ms),
        "hrm_layer_ms": _r(hrm_ms),
        "hrm_binding": Counter(x["hrm_binding"] for x in s).most_common(1)[0][0],
        "efficiency": _r(hrm_ms / layer_ms if layer_ms else 0.0),
        "utilization": {r: _r(sum(x["utilization"][r] * x["makespan_s"] for x in s) / makespan
                              if makespan else 0.0) for r in first["utilization"]},
        "memory": first["memory"],
        "steps": sum(x["steps"] for x in s),
        "layers": first["layers"],
        "tasks": sum(x["tasks"] for x in s),
        "interrupted": any(x["interrupted"] for x in s),
        "requests": {
            "count": len(scenario.requests), "finished": len(finish),
            "generated_tokens": tokens, "batches": len(batches),
            "micro_batches": micro_batches,
            "padded": padded,
            "finish_s": {"median": _r(statistics.median(times)) if times else None,
                         "p99": _r(times[min(len(times) - 1, int(0.99 * len(times)))])
                         if times else None},
            "aborted": [{"id": r.id, "prompt_len": r.prompt_len, "gen_len": r.gen_len}
                        for r in aborted]},
    })
    # What bound each phase in most batches; the experts of the first batch, a full one, said
    # so ("batch": 1): each batch routes its own tokens.
    if "bound_by" in first:
        out["bound_by"] = {phase: Counter(x["bound_by"][phase] for x in s).most_common(1)[0][0]
                           for phase in first["bound_by"]}
    if "experts" in first:
        out["experts"] = {**first["experts"], "batch": 1}
    return out


def _r(x: float) -> float:
    return float(f"{x:.6g}")
