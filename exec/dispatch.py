"""Dispatch: one thread per stream walks that stream's tasks in launch order.

A task waits for its predecessors (the compiled program's dependencies; earlier tasks of its own
stream are implied by the order), runs, and records its start and end on a monotonic clock
relative to the run's start. This is the executor's CPU backend: threads stand in for CUDA
streams and copies are memcpy, so every schedule runs, and is checked, on a machine without a
GPU. A failing task or Ctrl-C stops every stream; what finished is returned all the same, so an
interrupted run still leaves a trace.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
import torch

from taskgraph.compiled import KIND_NAMES, Program
from taskgraph.exec.runtime import Runtime
from taskgraph.sim.engine import SimRun


def execute(program: Program, runtime: Runtime, delay: Callable[[int], float] | None = None,
            progress: Callable[[int], None] | None = None) -> SimRun:
    """Run every task of `program` for real. `delay(task_id)` seconds are slept before a task
    starts (to shake out races in tests); `progress(segment)` is called as the first stream
    enters each segment."""
    # Several stream threads on a few cores: one intra-op thread per op, or torch's own thread
    # pool oversubscribes the cores (measured: 2x slower and twice as noisy on 2 cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _threaded(program, runtime, delay, progress)
    finally:
        torch.set_num_threads(threads)


def _threaded(program: Program, runtime: Runtime, delay, progress) -> SimRun:
    total = program.total
    done = [threading.Event() for _ in range(total)]
    start = np.full(total, np.nan)
    end = np.full(total, np.nan)
    stop = threading.Event()
    failure: list[BaseException] = []
    kinds = program.column("kind")
    steps, layers, index = program.step, program.column("layer"), program.column("index")
    t0 = time.perf_counter()

    def stream(sid: int) -> None:
        try:
            for d, (t, base) in enumerate(zip(program.seg_template, program.seg_base)):
                if sid == 0 and progress is not None:
                    progress(d)
                for pos, rels in program.templates[t].by_stream[sid]:
                    gid = int(base) + pos
                    for r in rels:
                        while not done[gid + r].wait(0.05):
                            if stop.is_set():
                                return
                    if stop.is_set():
                        return
                    if delay is not None:
                        time.sleep(delay(gid))
                    start[gid] = time.perf_counter() - t0
                    runtime.run(int(steps[gid]), KIND_NAMES[kinds[gid]], int(layers[gid]),
                                int(index[gid]))
                    end[gid] = time.perf_counter() - t0
                    done[gid].set()
        except BaseException as err:          # noqa: BLE001 - reported after the run
            failure.append(err)
            stop.set()

    threads = [threading.Thread(target=stream, args=(sid,), name=f"tg-{s}", daemon=True)
               for sid, s in enumerate(program.streams)]
    for th in threads:
        th.start()
    interrupted = False
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.1)
    except KeyboardInterrupt:
        interrupted = True
        stop.set()
        for th in threads:
            th.join(5)
    unfinished = np.isnan(end)
    start[unfinished] = np.nan
    run = SimRun(program, end - start, start, end, interrupted or bool(failure),
                 time.perf_counter() - t0, failure[0] if failure else None)
    run.durations[unfinished] = 0.0
    return run
