"""The discrete-event simulator: a compiled program run on SimPy resources.

Semantics shared with the executor (SPEC 4): each stream runs its tasks in launch order; a task
starts when it is at the head of its stream, all its predecessors have finished and its resource
is free. Each stream walks its tasks and holds each for its duration with one SimPy timeout.
A stream alone on its resource owns it: it is a small state machine advanced by its timeouts'
callbacks (SimPy's event callbacks, which spare a generator resume per task). Streams that share a
resource (S4's weight and KV loads on the CPU->GPU link) are SimPy processes that take turns on a
``simpy.Resource`` in request order.

Durations are known, so a task's end time is fixed the moment it starts, and a task can be
*decided* (given its start and end) as soon as its predecessors are decided. A stream whose next
task still has an undecided predecessor parks it as blocked; whoever decides the last missing
predecessor decides the blocked task too and schedules the timeout that ends it. A task costs at
most one SimPy event (a stream that stays busy covers its busy period with one), and start times
are exactly max(previous end on the stream, ends of the predecessors + the hardware's hand-off
time, the delay with which one stream sees another's task finish).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import simpy

from taskgraph.compiled import Program
from taskgraph.cost import CostModel
from taskgraph.errors import ScheduleError


@dataclass
class SimRun:
    """Start and end (seconds) of every task; end is NaN for tasks that never ran."""

    program: Program
    durations: np.ndarray
    start: np.ndarray
    end: np.ndarray
    interrupted: bool
    wall_s: float
    failure: BaseException | None = None     # what stopped an executed run, if a task failed
    # An executed run: time.perf_counter() at its time 0 (one clock for every process of a
    # machine, so the ranks of a multi-process run line up).
    clock_origin: float = float("nan")

    @property
    def finished(self) -> np.ndarray:
        return ~np.isnan(self.end)


def simulate(program: Program, cost: CostModel,
             progress: Callable[[int], None] | None = None,
             durations: np.ndarray | None = None) -> SimRun:
    """Run `program` on the resources of `cost`, each task taking `durations` seconds (default:
    the cost model's). `progress(segment)` is called as the GPU stream enters each segment.
    Ctrl-C stops the run and returns what had finished."""
    t0 = time.perf_counter()
    dur_arr = program.durations(cost) if durations is None else durations
    dur = dur_arr.tolist()
    total = program.total
    start = [0.0] * total
    end = [-1.0] * total + [0.0]   # a sentinel slot: "the task before the first", ended at 0
    blocked: dict[int, list] = {}   # undecided task id -> tasks parked on it
    handoff = cost.handoff          # a dependency on another stream is seen this much later
    env = simpy.Environment()

    users: dict[int, int] = {}
    for r in program.stream_resource:
        users[r] = users.get(r, 0) + 1
    shared = {r: _SharedResource(env) for r, count in users.items() if count > 1}

    for sid, rid in enumerate(program.stream_resource):
        segments = [(int(base), program.templates[t].by_stream[sid])
                    for t, base in zip(program.seg_template, program.seg_base)]
        report = progress if sid == 0 else None
        if rid in shared:
            env.process(_shared_stream(env, segments, dur, start, end, blocked, report,
                                       shared[rid], handoff))
        else:
            _exclusive_stream(env, segments, dur, start, end, blocked, report, handoff)()

    interrupted = False
    # The run allocates ~2 short-lived objects per task and no reference cycles; without this the
    # cyclic collector rescans the large per-task lists over and over.
    collecting = gc.isenabled()
    gc.disable()
    try:
        env.run()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if collecting:
            gc.enable()
    stop = env.now
    end_arr = np.array(end[:total])
    start_arr = np.array(start)
    unfinished = (end_arr < 0) | (end_arr > stop) if interrupted else end_arr < 0
    if unfinished.any() and not interrupted:
        first = int(np.flatnonzero(unfinished)[0])
        raise ScheduleError(
            f"The simulation deadlocked: task {program.task(first)} never started. The schedule's "
            "stream order and dependencies form a cycle."
        )
    end_arr[unfinished] = np.nan
    start_arr[unfinished] = np.nan
    return SimRun(program, dur_arr, start_arr, end_arr, interrupted, time.perf_counter() - t0)


class _SharedResource:
    """A serial resource used by several streams, granted in request order."""

    def __init__(self, env: simpy.Environment):
        self.lock = simpy.Resource(env, capacity=1)
        self.free_at = 0.0


_NORMAL = simpy.events.NORMAL


# A parked task is (task id, its dependency offsets, index of the offset it waits on, ready time
# so far, the event that resumes its stream). Ready is None for a shared-resource stream, which
# must acquire its resource itself and is only woken. One parked task is stored bare; several
# (rare: two streams waiting on one task) as a list.
def _park(blocked: dict, dep: int, entry: tuple) -> None:
    there = blocked.get(dep)
    if there is None:
        blocked[dep] = entry
    elif type(there) is list:
        there.append(entry)
    else:
        blocked[dep] = [there, entry]


def _decided(env, gid: int, start, end, dur, blocked, h: float) -> None:
    """Task `gid` has just been decided: decide what was parked on it and schedule the timeout
    that ends it (its delay is known only now)."""
    parked = blocked.pop(gid)
    if type(parked) is not list:
        parked = (parked,)
    e_dep = end[gid] + h
    for task, rels, i, ready, stream in parked:
        if ready is None:          # a shared-resource stream: wake it to acquire its resource
            stream.succeed()
            continue
        if e_dep > ready:
            ready = e_dep
        i += 1
        n = len(rels)
        while i < n:
            e = end[task + rels[i]]
            if e < 0.0:
                _park(blocked, task + rels[i], (task, rels, i, ready, stream))
                break
            if e + h > ready:
                ready = e + h
            i += 1
        else:
            start[task] = ready
            e = end[task] = ready + dur[task]
            env.timeout(e - env.now).callbacks.append(stream)
            if task in blocked:
                _decided(env, task, start, end, dur, blocked, h)


def _exclusive_stream(env, segments, dur, start, end, blocked, report, h: float) -> Callable:
    """A stream alone on its resource, as the callback that runs when its previous task ends:
    it decides the next task and schedules the timeout that ends it, or parks the task (the
    decider of its last missing predecessor then decides it and schedules that timeout).

    While the stream stays busy, following tasks whose predecessors have all ended by then are
    decided at once and the busy period ends with one timeout: their starts cannot change (each
    starts exactly when the one before ends), and their consumers learn their ends sooner."""
    timeout = env.timeout
    segs = iter(enumerate(segments))
    base, tasks, p, n = 0, (), 0, 0
    prev = len(end) - 1   # the task that just ended (at first: the sentinel slot, 0.0)

    def advance(_event: simpy.Event | None = None) -> None:
        nonlocal base, tasks, p, n, prev
        while p == n:
            d, (base, tasks) = next(segs, (None, (0, None)))
            if tasks is None:
                return
            p, n = 0, len(tasks)
            if report is not None:
                report(d)
        pos, rels = tasks[p]
        p += 1
        gid = base + pos
        # This runs when the previous task ends, so its exact end is both the clock and the
        # earliest start of the next task.
        now = ready = end[prev]
        prev = gid
        for r in rels:
            e = end[gid + r]
            if e < 0.0:
                entry = (gid, rels, rels.index(r), ready, advance)
                if gid + r in blocked:
                    _park(blocked, gid + r, entry)
                else:
                    blocked[gid + r] = entry
                return
            if e + h > ready:
                ready = e + h
        start[gid] = ready
        e = end[gid] = ready + dur[gid]
        if gid in blocked:
            _decided(env, gid, start, end, dur, blocked, h)
        while p < n:   # the rest of the busy period
            pos, rels = tasks[p]
            nxt = base + pos
            for r in rels:
                if not 0.0 <= end[nxt + r] <= e - h:
                    break
            else:
                p += 1
                prev = nxt
                start[nxt] = e
                e = end[nxt] = e + dur[nxt]
                if nxt in blocked:
                    _decided(env, nxt, start, end, dur, blocked, h)
                continue
            break
        timeout(e - now).callbacks.append(advance)

    return advance


def _shared_stream(env, segments, dur, start, end, blocked, report, res: _SharedResource,
                   h: float) -> Iterator:
    timeout = env.timeout
    last = 0.0
    for d, (base, tasks) in enumerate(segments):
        if report is not None:
            report(d)
        for pos, rels in tasks:
            gid = base + pos
            ready = last
            for r in rels:
                e = end[gid + r]
                while e < 0.0:
                    ev = env.event()
                    _park(blocked, gid + r, (gid, rels, 0, None, ev))
                    yield ev
                    e = end[gid + r]
                if e + h > ready:
                    ready = e + h
            if ready > env.now:
                yield timeout(ready - env.now)
            req = res.lock.request()
            yield req
            begin = max(ready, res.free_at, env.now)
            start[gid] = begin
            last = end[gid] = res.free_at = begin + dur[gid]
            if gid in blocked:
                _decided(env, gid, start, end, dur, blocked, h)
            yield timeout(last - env.now)
            res.lock.release(req)
