"""Small builders shared by the tests."""

from __future__ import annotations

import copy
import queue
import threading
import time
from typing import Any

import numpy as np

from taskgraph.dag.compiled import Program
from taskgraph.scenario import scenario_from_dict
from taskgraph.specs import Scenario

TINY: dict[str, Any] = {
    "model": "tiny",
    "hardware": "t4",
    "workload": {"prompt_len": 16, "max_prompt_len": 32, "gen_len": 3},
    "policy": {"N": 8, "mu": 2, "r_w": 0.0, "r_c": 0.0},   # placement: the schedule's
    "schedule": "S1",
}


def assert_drawn(png, min_size: tuple[int, int] = (300, 400), min_colours: int = 8) -> None:
    """A PNG that decodes to a picture of at least `min_size` (rows, columns) with something
    drawn on it: more than `min_colours` distinct colours (a blank or one-colour image, or a
    file that is not a PNG, fails; its byte size says neither)."""
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] >= min_size[0] and image.shape[1] >= min_size[1], image.shape
    colours = np.unique(image.reshape(-1, image.shape[-1]), axis=0)
    assert len(colours) > min_colours, f"{png} has {len(colours)} colours"


def wait_for(condition, timeout_s: float = 120.0, what: str = "the event") -> None:
    """Poll `condition()` until it holds; fail after `timeout_s`. For events a test cannot be
    told of directly (another process's state), instead of sleeping a guessed time."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    try:
        text = open(f"/proc/{pid}/task/{pid}/children").read()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def tiny(**sections: Any) -> Scenario:
    """The tiny scenario with sections (or fields of them) replaced."""
    doc = copy.deepcopy(TINY)
    if sections.get("schedule") == "DS":      # its own placement: one micro-batch, KV on the GPU
        doc["policy"].update(N=doc["policy"]["mu"], r_c=1.0)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key].update(value)
        else:
            doc[key] = value
    return scenario_from_dict(doc, source="<test>")


def unrolled_edges(program: Program) -> np.ndarray:
    """Every dependency of the whole run (data and buffer reuse, not pruned) as (src, dst) ids,
    read back from the networkx segment graphs."""
    pairs = []
    for d, (t, base) in enumerate(zip(program.seg_template, program.seg_base)):
        g = program.templates[t].graph
        prev_base = int(program.seg_base[d - 1]) if d else 0
        for u, v in g.edges():
            a, b = g.nodes[u], g.nodes[v]
            src = (prev_base if a["external"] else int(base)) + a["order"]
            dst = int(base) + b["order"]
            pairs.append((src, dst))
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


class _QueuedEvent:
    def __init__(self):
        self.recorded = False
        self.done = threading.Event()
        self.t: float | None = None


class QueuedHostDevice:
    """CUDA's stream semantics on the CPU, for tests of the dispatcher's CUDA path without a GPU.

    Each device stream is a queue worked by its own thread, so a launch returns at once and the
    work runs later, as a kernel does on a GPU stream. An event completes when its queue reaches
    it; a queue told to wait on an event stalls there until the event completes; waiting on an
    event never recorded fails, where CUDA would silently not wait. ``jitter()`` seconds are
    slept before each piece of work, so that queues drift apart as a busy GPU's would. Errors in
    queued work are raised by :meth:`finish`."""

    def __init__(self, jitter=None):
        self.jitter = jitter
        self.queues: list = []
        self.errors: list[BaseException] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for q in self.queues:
            q.put(None)

    def stream(self, name):
        q = queue.SimpleQueue()
        threading.Thread(target=self._work, args=(q,), daemon=True, name=f"queue-{name}").start()
        self.queues.append(q)
        return q

    def _work(self, q) -> None:
        while (item := q.get()) is not None:
            try:
                item()
            except BaseException as err:      # noqa: BLE001 - raised by finish()
                self.errors.append(err)

    def launch(self, stream, work) -> None:
        def run():
            if self.jitter is not None:
                time.sleep(self.jitter())
            work()

        stream.put(run)

    def event(self):
        return _QueuedEvent()

    def record(self, event, stream) -> None:
        def reach():
            event.t = time.perf_counter()
            event.done.set()

        event.recorded = True
        stream.put(reach)

    def wait(self, stream, event) -> None:
        assert event.recorded, "waited on an event that was never recorded"
        stream.put(event.done.wait)

    def synchronize(self, event) -> None:
        assert event.recorded, "synchronised on an event that was never recorded"
        event.done.wait()

    def seconds_between(self, earlier, later) -> float:
        return later.t - earlier.t

    def finish(self) -> None:
        for q in self.queues:
            drained = threading.Event()
            q.put(drained.set)
            drained.wait()
        if self.errors:
            raise self.errors[0]
