"""Dispatch: the compiled graph run on a device's queues, one host thread per stream.

Each graph stream has one host thread walking its tasks in launch order. Tasks of device streams
(``gpu``, ``h2d``, ``h2d_kv``, ``d2h``) are *enqueued* on that stream's device queue; tasks of host
streams (``cpu``, ``pin``) run on the thread. Two devices implement the queues:
:class:`CudaDevice` (torch.cuda streams and events) and :class:`HostDevice` (the CPU backend: a
queue runs work as it is enqueued, an event is the host time it was recorded), so every schedule
runs, and is checked against the reference, on a machine without a GPU. The rules
(docs/design.md §8):

* a device task waits for a device predecessor with ``stream.wait_event(done[pred])``, and since a
  queue cannot wait on an event not yet recorded, first for the host-side flag that says the
  predecessor's event *has been* recorded;
* a device task waits for a host predecessor on the host (it must have finished);
* a host task that reads what a device task produced synchronises on that task's event first;
* no global barrier anywhere: one event per task, recorded on the task's own stream, which also
  times it.

A failing task or Ctrl-C stops every stream; what finished is returned all the same, so an
interrupted run still leaves a trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch
import torch.profiler

from taskgraph.dag.builder import TaskKey
from taskgraph.dag.compiled import Program
from taskgraph.exec.profiling import ORIGIN, ORIGIN_WITHIN_S
from taskgraph.exec.runtime import Runtime
from taskgraph.kernels.ops import one_thread
from taskgraph.kinds import KIND_NAMES
from taskgraph.sim.engine import SimRun

HOST_STREAMS = frozenset({"cpu", "pin"})


class Device(Protocol):
    """What dispatch needs from a device: queues and events."""

    def stream(self, name: str) -> Any: ...
    def launch(self, stream: Any, work: Callable[[], None]) -> None: ...  # enqueue onto `stream`
    def event(self) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait(self, stream: Any, event: Any) -> None: ...
    def synchronize(self, event: Any) -> None: ...
    def seconds_between(self, earlier: Any, later: Any) -> float: ...
    def finish(self) -> None: ...


class HostDevice:
    """The CPU backend: "device" queues run work as it is enqueued, on the stream's thread.

    Waiting on an event that was never recorded is the one mistake dispatch must not make (on a
    CUDA stream it silently does nothing), so here it fails loudly."""

    def stream(self, name: str) -> str:
        return name

    def launch(self, stream, work: Callable[[], None]) -> None:
        work()

    def event(self) -> list[float | None]:
        return [None]

    def record(self, event, stream) -> None:
        event[0] = time.perf_counter()

    def wait(self, stream, event) -> None:
        assert event[0] is not None, "waited on an event that was never recorded"

    def synchronize(self, event) -> None:
        assert event[0] is not None, "synchronised on an event that was never recorded"

    def seconds_between(self, earlier, later) -> float:
        return later[0] - earlier[0]

    def finish(self) -> None:
        pass


class CudaDevice:
    """The real thing: torch.cuda streams and timing events."""

    def __init__(self, torch):
        self.torch = torch

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """For the run: cuDNN's attention off. It builds an execution plan for each new shape,
        on the launching thread, and decode's KV grows a column every step: on an H200 (torch
        2.11) each step's first GPUAttn took 29 ms of host time where the kernel ran for 3 us
        (bench/results/h200-2026-11-25). Flash, memory-efficient and math kernels build none.
        The switch is the process's, so it is put back after the run."""
        cuda = self.torch.backends.cuda
        was = cuda.cudnn_sdp_enabled()
        cuda.enable_cudnn_sdp(False)
        try:
            yield
        finally:
            cuda.enable_cudnn_sdp(was)

    def stream(self, name: str):
        return self.torch.cuda.Stream()

    def launch(self, stream, work: Callable[[], None]) -> None:
        with self.torch.cuda.stream(stream):
            work()

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def synchronize(self, event) -> None:
        event.synchronize()

    def seconds_between(self, earlier, later) -> float:
        return earlier.elapsed_time(later) / 1e3

    def finish(self) -> None:
        self.torch.cuda.synchronize()


def execute(program: Program, runtime: Runtime, device: Device | None = None,
            delay: Callable[[int], float] | None = None,
            progress: Callable[[int], None] | None = None, annotate: bool = False,
            streams: frozenset[str] | None = None) -> SimRun:
    """Run every task of `program` for real on `device` (default: the CPU backend). Times come
    from events recorded on each task's own stream (device tasks) and a monotonic clock aligned to
    the same origin (host tasks). `delay(task_id)` seconds are slept before a task starts (to
    shake out races in tests); `progress(segment)` is called as the first stream enters each
    segment. `annotate` marks the clock's origin and every task for the PyTorch profiler
    (:mod:`taskgraph.exec.profiling`). `streams` runs only those streams (one process of a
    multi-process run, :mod:`taskgraph.exec.distributed`): a dependency on a task of another
    stream is another process's, met by the message that task's receiver waits for."""
    if device is None:
        device = HostDevice()
    if not isinstance(device, HostDevice):
        # a device may set the process up for the run (CudaDevice.running), and put it back
        with getattr(device, "running", contextlib.nullcontext)():
            return _execute(program, runtime, device, delay, progress, annotate, streams)
    # On the CPU backend every stream has its own thread, and one intra-op thread per op is
    # fastest in both modes (kernels.ops.one_thread). Measured on small.yaml (2 cores), against
    # transformers' own speed in the same run: zero copy S4 mu=8 0.91x with one, 0.75x with two.
    with one_thread():
        return _execute(program, runtime, device, delay, progress, annotate, streams)


def _task_marks(program: Program) -> Callable[[int], str]:
    """Task id -> its name (``PostAttn[s1,L0,m1]``), for the profiler's marks."""
    kinds, layers, index = (program.column(c) for c in ("kind", "layer", "index"))
    return lambda gid: TaskKey(int(program.step[gid]), KIND_NAMES[kinds[gid]], int(layers[gid]),
                               int(index[gid])).name


def _execute(program: Program, runtime: Runtime, device: Device, delay, progress,
             annotate: bool, only: frozenset[str] | None = None) -> SimRun:
    """Start a thread per stream of this process (`only`: those streams), wait for them all
    (or for Ctrl-C, which stops them), and read every task's times."""
    run = _Run(program, runtime, device, delay, progress, annotate, only)
    # each in a copy of this call's context: what it reads is the call's input (files._INPUTS)
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(run.stream, sid),
                                daemon=True, name=f"tg-{program.streams[sid]}")
               for sid in run.mine]
    interrupted = False
    try:
        for th in threads:
            th.start()
        _wait(threads, run.stop)
    except KeyboardInterrupt:
        interrupted = True
        run.stop.set()
        _wait(threads, run.stop)
    except SystemExit:
        # SIGTERM or SIGHUP (files.exit_on_termination): the streams stop before the process
        # exits; torch aborts the process ("terminate called without an active exception")
        # when it exits with a stream's thread still inside an op.
        run.stop.set()
        _wait(threads, run.stop)
        raise
    return run.result(interrupted)


class _Run:
    """One run's shared state: the program's columns, each device stream's queue, and per task
    whether it is recorded (a device task enqueued, a host task finished), its events or host
    times; ``stop`` ends every stream, ``failure`` holds what stopped them."""

    def __init__(self, program: Program, runtime: Runtime, device: Device, delay, progress,
                 annotate: bool, only: frozenset[str] | None):
        self.program, self.runtime, self.device = program, runtime, device
        self.delay, self.progress = delay, progress
        total, streams = program.total, program.streams
        self.mine = [sid for sid, s in enumerate(streams) if only is None or s in only]
        # the GPU a stream's tasks run on (``gpu:1``), -1 for the host's and shared streams
        self.gpu_of = [int(s.partition(":")[2]) if ":" in s else -1 for s in streams]
        self.local = np.isin(program.column("stream"), self.mine)
        on_host = [s.partition(":")[0] in HOST_STREAMS for s in streams]
        self.on_device = ~np.array(on_host)[program.column("stream")]
        self.queues = {s: device.stream(s) for s, host in zip(streams, on_host) if not host}
        self.kinds, self.steps = program.column("kind"), program.step
        self.layers, self.index = program.column("layer"), program.column("index")
        self.recorded = [threading.Event() for _ in range(total)]
        self.begin_ev: list[Any] = [None] * total
        self.done_ev: list[Any] = [None] * total
        self.host_start = np.full(total, np.nan)
        self.host_end = np.full(total, np.nan)
        self.stop = threading.Event()
        self.failure: list[BaseException] = []
        self.mark = _task_marks(program) if annotate else None
        self.origin, self.t0 = self._mark_origin(annotate)

    def _mark_origin(self, annotate: bool) -> tuple[Any, float]:
        """The device's origin (on the CPU backend a host clock reading too), the host tasks'
        t0 and the profiler's mark, as close together as they can be: the profiler's ops are
        placed on the run's clock by the last mark, and a thread preempted between them under
        load shifted the ops 0.1-4 ms off their tasks. A mark whose readings lie apart is made
        again."""
        device = self.device
        if annotate:
            # The profiler's clock is not this one: a mark at the origin ties the two. The
            # first mark pays the profiler's set-up, so it is not the one that counts.
            with torch.profiler.record_function("tg warm-up"):
                pass
        origin = device.event()
        first = next(iter(self.queues.values()), None)
        device.finish()
        for _ in range(100):
            before = time.perf_counter()
            with torch.profiler.record_function(ORIGIN) if annotate else contextlib.nullcontext():
                if first is not None:
                    device.record(origin, first)
                t0 = time.perf_counter()
            if not annotate or t0 - before < ORIGIN_WITHIN_S:
                break
        return origin, t0

    def stream(self, sid: int) -> None:
        """One stream's thread: its tasks in launch order, segment by segment, each once what
        it depends on is recorded. A failure stops every stream."""
        program, queue = self.program, self.queues.get(self.program.streams[sid])
        try:
            for d, (t, base) in enumerate(zip(program.seg_template, program.seg_base)):
                if sid == self.mine[0] and self.progress is not None:
                    self.progress(d)
                for pos, rels in program.templates[t].by_stream[sid]:
                    gid = int(base) + pos
                    if not self._wait_for(gid, rels, queue):
                        return
                    self._run(gid, sid, queue)
        except BaseException as err:          # noqa: BLE001 - reported after the run
            self.failure.append(err)
            self.stop.set()

    def _wait_for(self, gid: int, rels: Any, queue: Any) -> bool:
        """Task `gid`'s predecessors (at the offsets `rels`) of this process: each recorded,
        then a device one's event waited for (by the queue, or by the host for a host task).
        False once the run is stopped."""
        for r in rels:
            dep = gid + r
            if not self.local[dep]:
                continue
            while not self.recorded[dep].wait(0.05):
                if self.stop.is_set():
                    return False
            if self.on_device[dep]:
                if queue is not None:
                    self.device.wait(queue, self.done_ev[dep])
                else:
                    self.device.synchronize(self.done_ev[dep])
        return not self.stop.is_set()

    def _run(self, gid: int, sid: int, queue: Any) -> None:
        """Task `gid`: run on this thread (a host stream, timed by the clock) or enqueued
        between two events on its device queue; then recorded."""
        if self.delay is not None:
            time.sleep(self.delay(gid))
        args = (int(self.steps[gid]), KIND_NAMES[self.kinds[gid]], int(self.layers[gid]),
                int(self.index[gid]), self.gpu_of[sid])
        scope = (torch.profiler.record_function(f"{self.program.streams[sid]}: "
                                                f"{self.mark(gid)}")
                 if self.mark else contextlib.nullcontext())
        if queue is None:
            self.host_start[gid] = time.perf_counter() - self.t0
            with scope:
                self.runtime.run(*args)
            self.host_end[gid] = time.perf_counter() - self.t0
        else:
            device = self.device
            self.begin_ev[gid], self.done_ev[gid] = device.event(), device.event()
            device.record(self.begin_ev[gid], queue)
            with scope:
                device.launch(queue, functools.partial(self.runtime.run, *args))
            device.record(self.done_ev[gid], queue)
        self.recorded[gid].set()

    def result(self, interrupted: bool) -> SimRun:
        """Every task's start and end on the run's clock (device tasks from their events),
        NaN and no duration for a task that did not finish."""
        self.device.finish()
        start, end = self.host_start.copy(), self.host_end.copy()
        for gid in np.flatnonzero(self.on_device):
            if self.done_ev[gid] is not None and self.recorded[gid].is_set():
                start[gid] = self.device.seconds_between(self.origin, self.begin_ev[gid])
                end[gid] = self.device.seconds_between(self.origin, self.done_ev[gid])
        unfinished = np.isnan(end)
        start[unfinished] = np.nan
        run = SimRun(self.program, end - start, start, end, interrupted or bool(self.failure),
                     time.perf_counter() - self.t0, self.failure[0] if self.failure else None,
                     self.t0)
        run.durations[unfinished] = 0.0
        return run


def _wait(threads: list[threading.Thread], stop: threading.Event, grace_s: float = 5.0) -> None:
    """Until every stream's thread has ended, or `grace_s` after the run was stopped: a thread
    can be inside a call nothing interrupts (a receive from a peer process that will never send,
    a long kernel), and the run's failure must still be reported. Such a thread is a daemon and
    its task is left out of the times as unfinished."""
    give_up = float("inf")
    for th in threads:
        while th.is_alive():
            if stop.is_set():
                give_up = min(give_up, time.monotonic() + grace_s)
                if time.monotonic() > give_up:
                    return
            th.join(0.1)
