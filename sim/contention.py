"""Shared bandwidth divided among the tasks that draw on it at once.

The GPUs of one host share its memory bandwidth (every link's DMA, every copy into pinned memory,
CPU attention) and, behind a switch or the CPU's lanes, the PCIe bandwidth upstream of their
links (``hardware.shared``). Each is a *pool*: a capacity in bytes per second, and per task the
bytes it draws from it (:meth:`taskgraph.perf.cost.CostModel.pool_bytes`). A task alone would draw at
``bytes / duration``; when the tasks running at once would draw more than the capacity, each runs
at ``capacity / total`` of its own speed (a proportional share, as memory controllers and PCIe
arbiters divide bandwidth among busy requesters). A task therefore takes longer the more it
overlaps, which the engine cannot know when the task starts, so the run is solved as a fixed
point of whole simulations (:mod:`taskgraph.sim.interference`) with :func:`pool_speed` giving
each task's average speed over its run.
"""

from __future__ import annotations

import numpy as np


def pool_speed(start: np.ndarray, end: np.ndarray, demand: np.ndarray,
               capacity: float) -> np.ndarray:
    """Per task, the average fraction of its own speed it ran at over ``[start, end)`` when the
    pool of `capacity` (bytes/s) is divided among the tasks running at once in proportion to
    their `demand` (bytes/s each would draw alone). 1 for tasks that draw nothing, never ran,
    or took no time."""
    out = np.ones(len(start))
    sel = (demand > 0) & ~np.isnan(end) & (end > start)
    if not sel.any() or not np.isfinite(capacity):
        return out
    s, e, d = start[sel], end[sel], demand[sel]
    times = np.concatenate([s, e])
    order = np.argsort(times, kind="stable")
    times = times[order]
    load = np.cumsum(np.concatenate([d, -d])[order])        # demand right after each event
    speed = np.minimum(1.0, capacity / np.maximum(load, capacity * 1e-12))
    speed[-1] = 1.0                                          # after the last task ends
    integral = np.concatenate([[0.0], np.cumsum(speed[:-1] * np.diff(times))])

    def progress(t: np.ndarray) -> np.ndarray:
        """Integral of the speed from the first event to t."""
        i = np.searchsorted(times, t, side="right") - 1
        return integral[i] + speed[i] * (t - times[i])

    out[sel] = (progress(e) - progress(s)) / (e - s)
    return out
