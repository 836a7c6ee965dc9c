"""The PyTorch profiler around an executed run: what ran inside each task, on the run's clock.

`tg execute --profile` runs the dispatcher under :mod:`torch.profiler`. The dispatcher marks the
instant its clock starts (:data:`ORIGIN`) and wraps every task in a ``record_function`` named
``"<stream>: <task>"``, so the profiler's events can be placed on the run's own time axis (the
marker's profiler time is the run's zero) and each host thread's ops can be named after the
stream that ran them. What comes back are :class:`ProfiledOp` records the one trace writer draws
on their own tracks beside the task slices: aten ops on the host threads, and on CUDA the
kernels and copies on each CUDA stream.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

#: The dispatcher's mark of its clock's zero.
ORIGIN = "tg: run origin"
#: How close the last origin mark's start and the run's clock zero are (:func:`execute`
#: repeats the mark until they are)
ORIGIN_WITHIN_S = 20e-6

#: Chrome-trace categories of the profiler worth drawing: host ops, task marks, device work.
_KEPT = {"cpu_op": "ops", "user_annotation": "ops", "kernel": "GPU", "gpu_memcpy": "GPU",
         "gpu_memset": "GPU"}

T = TypeVar("T")


@dataclass(frozen=True)
class ProfiledOp:
    """One profiler event: `track` names the thread or CUDA stream, times are integer ns on the
    run's clock, and nested ops on one track nest exactly (children are clipped to parents)."""

    track: str
    name: str
    cat: str
    start_ns: int
    end_ns: int


def profile_run(fn: Callable[[], T], cuda: bool) -> tuple[T, list[ProfiledOp]]:
    """Call `fn` (which runs the dispatcher with ``annotate=True``) under the profiler."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from taskgraph.errors import TgError

    # The profiler follows only the thread that started it unless told otherwise, and every
    # task runs on a stream thread.
    try:
        every_thread = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        raise TgError("--profile needs a PyTorch whose profiler can follow every thread "
                      "(profile_all_threads, PyTorch 2.6 or later).") from None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, experimental_config=every_thread) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return result, ops_on_run_clock(events)


def ops_on_run_clock(events: list[dict[str, Any]]) -> list[ProfiledOp]:
    """The kept complete events of a profiler's Chrome trace, shifted so :data:`ORIGIN` is zero
    (events before it are dropped), each host thread named after the stream whose task marks it
    holds and each CUDA stream after its number."""
    marks = [e for e in events if e.get("ph") == "X" and e.get("name") == ORIGIN]
    if not marks:
        return []
    origin = round(float(marks[-1]["ts"]) * 1000)
    kept = [e for e in events if e.get("ph") == "X" and e.get("cat") in _KEPT
            and e.get("name") != ORIGIN]
    streams: dict[Any, str] = {}
    for e in kept:
        if e["cat"] == "user_annotation" and ": " in e["name"]:
            streams.setdefault(e["tid"], e["name"].split(": ", 1)[0])
    by_track: dict[str, list[tuple[int, int, str, str]]] = {}
    for e in kept:
        start = round(float(e["ts"]) * 1000) - origin
        if start < 0:
            continue
        end = start + max(0, round(float(e.get("dur", 0)) * 1000))
        if _KEPT[e["cat"]] == "GPU":
            track = f"CUDA stream {e.get('tid')}"
        else:
            track = f"{streams.get(e['tid'], 'thread ' + str(e['tid']))} thread"
        by_track.setdefault(track, []).append((start, end, str(e["name"]), e["cat"]))
    out = []
    for track, items in sorted(by_track.items()):
        items.sort(key=lambda x: (x[0], -x[1]))
        open_ends: list[int] = []
        for start, end, name, cat in items:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            if open_ends:
                end = min(end, open_ends[-1])     # rounding must not make a child outlast it
            open_ends.append(end)
            out.append(ProfiledOp(track, name, cat, start, end))
    return out
