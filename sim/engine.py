"""The discrete-event simulator: a compiled program run on SimPy resources.

Semantics shared with the executor (docs/design.md §4): each stream runs its tasks in launch order;
a task starts when it is at the head of its stream, all its predecessors have finished and its
resource is free. Each stream walks its tasks and holds each for its duration with one SimPy
timeout. A stream alone on its resource owns it: it is a small state machine advanced by its
timeouts' callbacks (SimPy's event callbacks, which spare a generator resume per task). Streams
that share a resource (S4's weight and KV loads on the CPU->GPU link) are SimPy processes that take
turns on a ``simpy.Resource`` in request order.

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
from typing import Any, Callable, Iterator, Union

import numpy as np
import simpy

from taskgraph.dag.compiled import Program
from taskgraph.errors import ScheduleError
from taskgraph.perf.cost import CostModel


@dataclass
class SimRun:
    """Start and end (seconds) of every task; end is NaN for tasks that never ran.

    A run too long to hold whole keeps only its first segments (`program` is then that part,
    :meth:`Program.part`) and `totals`, its figures accumulated over every task
    (:class:`taskgraph.sim.metrics.Totals`)."""

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
    totals: Any = None

    @property
    def finished(self) -> np.ndarray:
        return ~np.isnan(self.end)


class Recorder:
    """What becomes of decided tasks: the engine hands it the run block by block, in order, each
    as its part of the program (:meth:`Program.part`) with its tasks' start, end and duration
    (end NaN: never ran); `result` makes the run. This one keeps every task."""

    def __init__(self, program: Program):
        self.program = program
        self.start = np.full(program.total, np.nan)
        self.end = np.full(program.total, np.nan)
        self.durations = np.zeros(program.total)
        self.lo = 0

    def block(self, part: Program, start: np.ndarray, end: np.ndarray,
              durations: np.ndarray) -> None:
        hi = self.lo + part.total
        self.start[self.lo:hi], self.end[self.lo:hi] = start, end
        self.durations[self.lo:hi] = durations
        self.lo = hi

    def result(self, interrupted: bool, wall_s: float) -> SimRun:
        return SimRun(self.program, self.durations, self.start, self.end, interrupted, wall_s)


Durations = Union[np.ndarray, Callable[[Program], np.ndarray], None]


def simulate(program: Program, cost: CostModel,
             progress: Callable[[int], None] | None = None,
             durations: Durations = None,
             recorder: Callable[[Program], Recorder] = Recorder) -> SimRun:
    """Run `program` on the resources of `cost`, each task taking `durations` seconds (an array
    in global id order, or a function of a part of the program; default: the cost model's).
    `progress(segment)` is called as the GPU stream enters each segment. The decided tasks go
    to a `recorder` made for the run (default: keep them all). Ctrl-C stops the run and returns
    what had finished.

    Memory: the run's tasks are decided in blocks of consecutive segments, into a ring of task
    slots a few blocks long, so a run of any length holds a few blocks at once (and the
    recorder what it keeps)."""
    t0 = time.perf_counter()
    if durations is None:
        durations = lambda part: part.durations(cost)          # noqa: E731
    for blocks in _RING_BLOCKS:
        if not blocks and recorder is not Recorder:
            # The whole run in the ring would undo what the recorder saves.
            raise ScheduleError(
                f"The simulation stalled: a stream fell {_RING_BLOCKS[-2] - 2} blocks of tasks "
                "behind the others (a deadlock, or a schedule whose streams drift apart). "
                "Simulate fewer steps (workload.gen_len), which holds the run whole, to see "
                "which.")
        try:
            window = _Window(program, durations, recorder(program), blocks)
            return _run(program, cost, progress, window, t0)
        except _Lagging:
            # A stream fell too many blocks behind the one in front for the ring: the same run
            # with a longer one (at last, as long as the run, which nothing can outrun).
            continue
    raise AssertionError("unreachable: the last ring holds the whole run")


def _run(program: Program, cost: CostModel, progress, window: _Window, t0: float) -> SimRun:
    handoff = cost.handoff          # a dependency on another stream is seen this much later
    env = simpy.Environment()
    blocked: dict[int, list] = {}   # undecided task id -> tasks parked on it
    users: dict[int, int] = {}
    for r in program.stream_resource:
        users[r] = users.get(r, 0) + 1
    shared = {r: _SharedResource(env) for r, count in users.items() if count > 1}

    for sid, rid in enumerate(program.stream_resource):
        segments = window.segments(sid, progress if sid == 0 else None)
        if rid in shared:
            env.process(_shared_stream(env, segments, window, blocked, shared[rid], handoff))
        else:
            _exclusive_stream(env, segments, window, blocked, handoff)()

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
    window.finish(interrupted, env.now)
    return window.recorder.result(interrupted, time.perf_counter() - t0)


class _Lagging(Exception):
    """A stream is too far behind for the ring's slots to be reused."""


#: Tasks per block: large enough that per-block NumPy work is cheap, small enough that a few
#: blocks are a few MB.
_BLOCK_TASKS = 1 << 16
#: Blocks in the ring, tried in turn while a stream lags too far behind (0: the whole run).
_RING_BLOCKS = (4, 16, 64, 0)


class _Window:
    """The run's blocks and the ring of task slots they take turns in.

    A task's state lives in slot ``gid & mask`` of the `start`, `end` (-1: not decided yet) and
    `dur` lists. The ring holds `blocks` blocks (0: the whole run), each at least as many
    segments as a dependency reaches back, so the tasks of block b depend only on blocks b and
    b - 1. Block b's slots are set up (durations in, ends cleared) when a stream first has a
    task in it; they are those of blocks b - `blocks` and before, which were handed to the
    recorder when every stream had left them and last read when every stream had left block
    b - `blocks` + 1: so every stream must be in block b - `blocks` + 2 or later then
    (:class:`_Lagging` if not). A block goes to the recorder as soon as every stream has left
    it. A stream cannot race ahead of the rest by more than its dependencies let it, so a ring
    of four blocks holds every schedule here (tests/test_long_runs.py)."""

    def __init__(self, program: Program, durations: Durations, recorder: Recorder,
                 blocks: int):
        self.program, self.recorder, self.durations = program, recorder, durations
        nseg = len(program.seg_template)
        sizes = np.diff(np.append(program.seg_base, program.total))
        reach = _reach(program)
        per = max(reach, int(_BLOCK_TASKS // max(1, sizes.max())), 1)
        self.bounds = list(range(0, nseg, per if blocks else nseg)) + [nseg]
        self.lag = blocks - 2 if blocks else nseg
        biggest = max(int(program.seg_base[hi - 1] + sizes[hi - 1] - program.seg_base[lo])
                      for lo, hi in zip(self.bounds, self.bounds[1:])) if nseg else 1
        slots = 1 << max(1, int(min(blocks * biggest or program.total + 1, program.total + 1)
                                    - 1).bit_length())
        self.mask = slots - 1
        self.start = [0.0] * slots
        self.end = [-1.0] * slots
        self.dur = [0.0] * slots
        self.at = [0] * len(program.streams)      # each stream's block
        self.prepared = -1                          # the last block whose slots are set up
        self.recorded = 0                           # blocks handed to the recorder

    def segments(self, sid: int, report: Callable[[int], None] | None) -> Iterator:
        """Stream `sid`'s segments: (number, first task id, its (position, dependencies)). A
        block's slots are set up when a stream first has a task there (a stream with nothing
        left to do runs through the rest at once, and must not reuse slots others still
        read)."""
        prog = self.program
        tasks_of = [t.by_stream[sid] for t in prog.templates]
        for b, (lo, hi) in enumerate(zip(self.bounds, self.bounds[1:])):
            self._enter(sid, b)
            for d in range(lo, hi):
                if report is not None:
                    report(d)
                tasks = tasks_of[prog.seg_template[d]]
                if tasks and b > self.prepared:
                    self._prepare(b)
                yield d, int(prog.seg_base[d]), tasks
        self._enter(sid, len(self.bounds) - 1)

    def _enter(self, sid: int, b: int) -> None:
        was = self.at[sid]
        self.at[sid] = b
        if was == self.recorded:
            low = min(self.at)
            while self.recorded < low:
                self._record(self.recorded, True)

    def _span(self, b: int) -> tuple[int, int, Program]:
        lo, hi = self.bounds[b], self.bounds[b + 1]
        part = self.program.part(lo, hi)
        first = int(self.program.seg_base[lo])
        return first, first + part.total, part

    def _slices(self, first: int, last: int) -> list[slice]:
        """The ring's slices that hold tasks [first, last)."""
        a, n = first & self.mask, last - first
        if a + n <= self.mask + 1:
            return [slice(a, a + n)]
        return [slice(a, self.mask + 1), slice(0, a + n - self.mask - 1)]

    def _prepare(self, b: int) -> None:
        """Set up the slots of the blocks up to `b`: their durations, and no task decided. A
        block counts as set up only once it is (Ctrl-C may come at any point)."""
        while self.prepared < b:
            block = self.prepared + 1
            if min(self.at) < block - self.lag:
                raise _Lagging
            first, last, part = self._span(block)
            d = self.durations
            values = (d(part) if callable(d) else d[first:last]).tolist()
            at = 0
            for s in self._slices(first, last):
                n = s.stop - s.start
                self.dur[s] = values[at:at + n]
                self.end[s] = [-1.0] * n
                at += n
            self.prepared = block

    def _record(self, b: int, decided: bool, stop: float = np.inf) -> None:
        first, last, part = self._span(b)
        if b <= self.prepared:
            cut = self._slices(first, last)
            start = np.concatenate([np.array(self.start[s]) for s in cut])
            end = np.concatenate([np.array(self.end[s]) for s in cut])
            dur = np.concatenate([np.array(self.dur[s]) for s in cut])
        else:
            start = end = np.full(part.total, -1.0)
            dur = np.zeros(part.total)
        if not decided:
            missing = (end < 0) | (end > stop)
            start, end = np.where(missing, np.nan, start), np.where(missing, np.nan, end)
        elif (end < 0).any():
            first_missing = first + int(np.flatnonzero(end < 0)[0])
            raise ScheduleError(
                f"The simulation deadlocked: task {self.program.task(first_missing)} never "
                "started. The schedule's stream order and dependencies form a cycle.")
        self.recorded = b + 1           # handed over once, even if Ctrl-C comes during it
        self.recorder.block(part, start, end, dur)

    def finish(self, interrupted: bool, stop: float) -> None:
        """Hand the blocks not yet recorded to the recorder: after Ctrl-C, tasks not decided
        or ending after the moment it came did not run; otherwise none may be undecided."""
        while self.recorded < len(self.bounds) - 1:
            self._record(self.recorded, not interrupted, stop)


def _reach(program: Program) -> int:
    """How many segments back a task's dependencies reach, at most."""
    back = max((-(pos + min(rels)) for t in program.templates
                for pos, rels in enumerate(t.deps) if rels), default=0)
    smallest = max(1, min((t.size for t in program.templates), default=1))
    return max(1, -(-back // smallest))


class _SharedResource:
    """A serial resource used by several streams, granted in request order."""

    def __init__(self, env: simpy.Environment):
        self.lock = simpy.Resource(env, capacity=1)
        self.free_at = 0.0


# A parked task is (task id, its dependency offsets, index of the offset it waits on, ready time
# so far, the event that resumes its stream). Ready is None for a shared-resource stream, which
# must acquire its resource itself and is only woken. One parked task is stored bare; several
# (rare: two streams waiting on one task) as a list. Task ids are the run's; their state is in
# the window's ring at ``id & mask``.
def _park(blocked: dict, dep: int, entry: tuple) -> None:
    there = blocked.get(dep)
    if there is None:
        blocked[dep] = entry
    elif type(there) is list:
        there.append(entry)
    else:
        blocked[dep] = [there, entry]


def _decided(env, gid: int, w: _Window, blocked, h: float) -> None:
    """Task `gid` has just been decided: decide what was parked on it and schedule the timeout
    that ends it (its delay is known only now)."""
    start, end, dur, mask = w.start, w.end, w.dur, w.mask
    parked = blocked.pop(gid)
    if type(parked) is not list:
        parked = (parked,)
    e_dep = end[gid & mask] + h
    for task, rels, i, ready, stream in parked:
        if ready is None:          # a shared-resource stream: wake it to acquire its resource
            stream.succeed()
            continue
        if e_dep > ready:
            ready = e_dep
        i += 1
        n = len(rels)
        while i < n:
            e = end[(task + rels[i]) & mask]
            if e < 0.0:
                _park(blocked, task + rels[i], (task, rels, i, ready, stream))
                break
            if e + h > ready:
                ready = e + h
            i += 1
        else:
            slot = task & mask
            start[slot] = ready
            e = end[slot] = ready + dur[slot]
            env.timeout(e - env.now, e).callbacks.append(stream)
            if task in blocked:
                _decided(env, task, w, blocked, h)


def _exclusive_stream(env, segments, w: _Window, blocked, h: float) -> Callable:
    """A stream alone on its resource, as the callback that runs when its previous task ends:
    it decides the next task and schedules the timeout that ends it, or parks the task (the
    decider of its last missing predecessor then decides it and schedules that timeout).

    While the stream stays busy, following tasks whose predecessors have all ended by then are
    decided at once and the busy period ends with one timeout: their starts cannot change (each
    starts exactly when the one before ends), and their consumers learn their ends sooner."""
    timeout = env.timeout
    start, end, dur, mask = w.start, w.end, w.dur, w.mask
    base, tasks, p, n = 0, (), 0, 0

    def advance(event: simpy.Event | None = None) -> None:
        nonlocal base, tasks, p, n
        # This runs when the previous task ends, so its exact end (the timeout's value; not the
        # clock, which the delay's rounding may have moved) is the earliest start of the next
        # task. (Not its slot either: a stream idle for a ring's worth of blocks finds it
        # reused.)
        now = ready = 0.0 if event is None else event.value
        while p == n:
            _d, base, tasks = next(segments, (None, 0, None))
            if tasks is None:
                return
            p, n = 0, len(tasks)
        pos, rels = tasks[p]
        p += 1
        gid = base + pos
        for r in rels:
            e = end[(gid + r) & mask]
            if e < 0.0:
                entry = (gid, rels, rels.index(r), ready, advance)
                if gid + r in blocked:
                    _park(blocked, gid + r, entry)
                else:
                    blocked[gid + r] = entry
                return
            if e + h > ready:
                ready = e + h
        slot = gid & mask
        start[slot] = ready
        e = end[slot] = ready + dur[slot]
        if gid in blocked:
            _decided(env, gid, w, blocked, h)
        while p < n:   # the rest of the busy period
            pos, rels = tasks[p]
            nxt = base + pos
            for r in rels:
                if not 0.0 <= end[(nxt + r) & mask] <= e - h:
                    break
            else:
                p += 1
                slot = nxt & mask
                start[slot] = e
                e = end[slot] = e + dur[slot]
                if nxt in blocked:
                    _decided(env, nxt, w, blocked, h)
                continue
            break
        timeout(e - now, e).callbacks.append(advance)

    return advance


def _shared_stream(env, segments, w: _Window, blocked, res: _SharedResource,
                   h: float) -> Iterator:
    timeout = env.timeout
    start, end, dur, mask = w.start, w.end, w.dur, w.mask
    last = 0.0
    for _d, base, tasks in segments:
        for pos, rels in tasks:
            gid = base + pos
            ready = last
            for r in rels:
                e = end[(gid + r) & mask]
                while e < 0.0:
                    ev = env.event()
                    _park(blocked, gid + r, (gid, rels, 0, None, ev))
                    yield ev
                    e = end[(gid + r) & mask]
                if e + h > ready:
                    ready = e + h
            if ready > env.now:
                yield timeout(ready - env.now)
            req = res.lock.request()
            yield req
            begin = max(ready, res.free_at, env.now)
            slot = gid & mask
            start[slot] = begin
            last = end[slot] = res.free_at = begin + dur[slot]
            if gid in blocked:
                _decided(env, gid, w, blocked, h)
            yield timeout(last - env.now)
            res.lock.release(req)
