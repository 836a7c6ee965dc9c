"""The discrete-event simulator: a compiled program run on SimPy resources.

Semantics shared with the executor (SPEC 4): each stream runs its tasks in launch order; a task
starts when it is at the head of its stream, all its predecessors have finished and its resource
is free. One SimPy process per stream walks that stream's tasks and holds each for its duration
with one timeout. Streams that share a resource (S4's weight and KV loads on the CPU->GPU link)
take turns on a ``simpy.Resource``; a stream alone on its resource owns it, so no request is made.

Durations are known, so a task's end time is fixed the moment it starts, and a task can be
*decided* (given its start and end) as soon as its predecessors are decided. A stream whose next
task still has an undecided predecessor parks it as blocked; whoever decides the last missing
predecessor decides the blocked task too and schedules the parked stream to resume at that task's
end. Every task therefore costs one SimPy event, as in a bare SimPy loop, and start times are
exactly max(previous end on the stream, ends of the predecessors).
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

    @property
    def finished(self) -> np.ndarray:
        return ~np.isnan(self.end)


def simulate(program: Program, cost: CostModel,
             progress: Callable[[int], None] | None = None) -> SimRun:
    """Run `program` on the resources of `cost`. `progress(segment)` is called as the GPU
    stream enters each segment. Ctrl-C stops the run and returns what had finished."""
    t0 = time.perf_counter()
    dur_arr = program.durations(cost)
    dur = dur_arr.tolist()
    total = program.total
    start = [0.0] * total
    end = [-1.0] * total
    blocked: dict[int, list] = {}   # undecided task id -> tasks parked on it
    env = simpy.Environment()

    users: dict[int, int] = {}
    for r in program.stream_resource:
        users[r] = users.get(r, 0) + 1
    shared = {r: _SharedResource(env) for r, count in users.items() if count > 1}

    for sid, rid in enumerate(program.stream_resource):
        segments = [(int(base), program.templates[t].by_stream[sid])
                    for t, base in zip(program.seg_template, program.seg_base)]
        report = progress if sid == 0 else None
        proc = _exclusive_stream if rid not in shared else _shared_stream
        args = (env, segments, dur, start, end, blocked, report)
        env.process(proc(*args) if rid not in shared else proc(*args, shared[rid]))

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
    end_arr = np.array(end)
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


# A parked task: (task id, its dependency offsets, end of the stream's previous task, the event
# that resumes its stream). `last` is None for a shared-resource stream, which must acquire its
# resource itself and is only woken.
def _decided(env, gid: int, start, end, dur, blocked) -> None:
    """Task `gid` has just been decided: decide what was parked on it, and resume each parked
    stream at the end of its task, as a Timeout would (its delay is known only now)."""
    for task, rels, last, ev in blocked.pop(gid):
        if last is None:
            ev.succeed()
            continue
        ready = last
        for r in rels:
            e = end[task + r]
            if e < 0.0:
                blocked.setdefault(task + r, []).append((task, rels, last, ev))
                break
            if e > ready:
                ready = e
        else:
            start[task] = ready
            e = end[task] = ready + dur[task]
            ev._ok, ev._value = True, None
            env.schedule(ev, _NORMAL, e - env.now)
            if task in blocked:
                _decided(env, task, start, end, dur, blocked)


def _exclusive_stream(env, segments, dur, start, end, blocked, report) -> Iterator:
    timeout, event = env.timeout, env.event
    last = 0.0   # end of this stream's previous task (exact; the clock may differ by an ulp)
    now = env.now
    for d, (base, tasks) in enumerate(segments):
        if report is not None:
            report(d)
        for pos, rels in tasks:
            gid = base + pos
            ready = last
            for r in rels:
                e = end[gid + r]
                if e < 0.0:
                    ev = event()
                    blocked.setdefault(gid + r, []).append((gid, rels, last, ev))
                    yield ev
                    last = end[gid]
                    now = env.now
                    break
                if e > ready:
                    ready = e
            else:
                start[gid] = ready
                last = end[gid] = ready + dur[gid]
                if gid in blocked:
                    _decided(env, gid, start, end, dur, blocked)
                # SimPy's clock after a timeout is exactly now + delay.
                delay = last - now
                yield timeout(delay)
                now += delay


def _shared_stream(env, segments, dur, start, end, blocked, report, res: _SharedResource
                   ) -> Iterator:
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
                    blocked.setdefault(gid + r, []).append((gid, rels, None, ev))
                    yield ev
                    e = end[gid + r]
                if e > ready:
                    ready = e
            if ready > env.now:
                yield timeout(ready - env.now)
            req = res.lock.request()
            yield req
            begin = max(ready, res.free_at, env.now)
            start[gid] = begin
            last = end[gid] = res.free_at = begin + dur[gid]
            if gid in blocked:
                _decided(env, gid, start, end, dur, blocked)
            yield timeout(last - env.now)
            res.lock.release(req)
