"""The one trace writer: runs of a compiled program -> Chrome JSON or Perfetto protobuf
(docs/design.md §7).

Simulated and measured runs of one graph go into one file as separate processes that line up in
time, one process per run, numbered in the order given ("1. simulated", "2. measured"). Each
stream is one track, named after its device ("GPU compute", "PCIe CPU->GPU", ...); a stream is
serial, so its slices never overlap. Perfetto orders processes by slice count and then by name,
and a process's threads by tid, so run numbers and tids carry the order (GPU, CPU, CPU->GPU,
GPU->CPU, pinned copy); sort-index metadata is written too, for viewers that read it. Times are
integer nanoseconds written as microseconds with three decimals, and every ``dur`` is end minus
start in those integers, so rounding can never make neighbours overlap. Cross-stream dependencies are flow arrows whose ends lie strictly inside their
slices. Counters show the GPU weight buffer, KV cache sizes and link throughput.

What is drawn is one stream of events (:func:`_run_events`); two encoders write it: Chrome JSON
(``.json``, gzip when the path ends in ``.gz``) and Perfetto's native protobuf (``.pftrace``,
:mod:`taskgraph.tracing.protobuf`), so both formats carry the same tracks, slices, flows and counters.
Events are written in batches as they come, so big traces stream out.
"""

from __future__ import annotations

import gzip
import json
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np

from taskgraph.dag.compiled import Program
from taskgraph.errors import TgError
from taskgraph.files import atomic_path
from taskgraph.kinds import KIND_NAMES, MOVES, PAGED, WEIGHT_SECTIONS

_STREAM_INFO = {
    # stream: (track name, category in PyTorch profiler terms)
    "gpu": ("GPU compute", "kernel"),
    "cpu": ("CPU attention", "cpu_op"),
    "h2d": ("PCIe CPU->GPU", "gpu_memcpy"),
    "h2d_kv": ("PCIe CPU->GPU (KV)", "gpu_memcpy"),
    "d2h": ("PCIe GPU->CPU", "gpu_memcpy"),
    "pin": ("CPU pinned staging copy", "cpu_memcpy"),
    "peer": ("GPU interconnect", "kernel"),
}
#: stream -> the name of its track.
STREAM_TRACKS = {stream: track for stream, (track, _) in _STREAM_INFO.items()}


def _stream_info(stream: str) -> tuple[str, str]:
    """(track name, category) of a stream; a GPU's own stream (``gpu:1``) names its GPU."""
    base, _, gpu = stream.partition(":")
    track, cat = _STREAM_INFO[base]
    return (track.replace("GPU", f"GPU {gpu}", 1) if gpu else track), cat
_FLOW_ID_STRIDE = 1_000_000_000   # keeps flow ids of different runs disjoint


@dataclass
class TraceRun:
    """One run of a program to draw: `start`/`end` in seconds per task (NaN: did not run)."""

    label: str            # e.g. "simulated", "measured"
    program: Program
    start: np.ndarray
    end: np.ndarray
    offset_s: float = 0.0  # shift applied to this run's times (to align runs)
    # What the PyTorch profiler saw inside the run (taskgraph.exec.profiling.ProfiledOp: a
    # track, a name, a category, ns on the run's clock), drawn on tracks of their own.
    ops: list[Any] = field(default_factory=list)
    # The host's shared pools (taskgraph.perf.cost.POOLS) the run was priced with: a track's name ->
    # the bytes each task drew from the pool, in global id order.
    pools: dict[str, np.ndarray] = field(default_factory=dict)
    # A run too long to hold whole keeps the task times of prefill and this many decode steps
    # (taskgraph.sim.simulate.simulate_scenario's keep_steps); None: every step.
    kept_steps: int | None = None
    # Per task kind, the share of its time on a link spent copying back the other way
    # (taskgraph.perf.cost.CostModel.kind_written_back: a swapping cache's); None: a measured
    # run's (the executor's cache does not swap).
    written_back: np.ndarray | None = None


@dataclass(frozen=True)
class Window:
    """Which tasks to draw: prefill plus decode steps up to `max_step` (None: everything)."""

    max_step: int | None = 2

    @classmethod
    def parse(cls, text: str) -> Window:
        """A number of decode steps, or 'all' (``--trace-steps``)."""
        if text == "all":
            return cls(None)
        try:
            steps = int(text)
        except ValueError:
            raise TgError(f"a number of decode steps or 'all', not '{text}'") from None
        if steps < 0:
            raise TgError(f"a number of decode steps or 'all', not {steps}")
        return cls(steps)

    def mask(self, program: Program) -> np.ndarray:
        if self.max_step is None:
            return np.ones(program.total, dtype=bool)
        return program.step <= self.max_step


class Traced:
    """A result whose runs can be written as a trace and drawn as a Gantt chart. Subclasses
    give `trace_runs()` (and `gantt_runs()` where the chart shows fewer, or other labels)."""

    def trace_runs(self) -> list[TraceRun]:
        raise NotImplementedError

    def gantt_runs(self) -> list[TraceRun]:
        return self.trace_runs()

    def write_trace(self, path: str | Path, steps: int | None = 2) -> int:
        """Prefill and `steps` decode steps (None: all) to `path` (.json, .json.gz or
        .pftrace); returns the number of task slices. The result's scalar figures go in the
        trace's metadata, but not its wall time, which would change the trace's bytes."""
        meta = {k: v for k, v in self.to_dict().items()
                if not isinstance(v, (dict, list)) and k != "wall_s"}
        return write_trace(path, self.trace_runs(), Window(steps), metadata=meta)

    def write_gantt(self, path: str | Path) -> Path:
        """Two layers of decode step 2, one row per stream, to a PNG (needs matplotlib)."""
        from taskgraph.output.plots import gantt

        return gantt(self.gantt_runs(), path)


def write_trace(path: str | Path, runs: list[TraceRun], window: Window = Window(),
                metadata: dict[str, Any] | None = None) -> int:
    """Write `runs` to `path`: Chrome JSON (``.json`` or ``.json.gz``) or Perfetto protobuf
    (``.pftrace``); returns the number of task slices.

    The file appears complete or not at all (:func:`taskgraph.files.atomic_path`)."""
    path = Path(path)
    for run in runs:
        if run.kept_steps is not None and (window.max_step is None
                                           or window.max_step > run.kept_steps):
            raise TgError(
                f"The run '{run.label}' kept the task times of prefill and {run.kept_steps} "
                "decode steps (a run of millions of tasks keeps only what its trace asks for); "
                "simulate it with the trace's steps (--trace-steps, or keep_steps in the "
                "Python API).")
    encode = _write_proto if path.suffix == ".pftrace" else _write_json
    if encode is _write_proto:
        require_perfetto()
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            encode(f, path, runs, window, metadata or {})
    return sum(int((window.mask(run.program) & ~np.isnan(run.end)).sum()) for run in runs)


def require_perfetto() -> None:
    try:
        import perfetto.trace_builder.proto_builder  # noqa: F401
    except ImportError:
        raise TgError("A .pftrace trace needs the perfetto package, an optional extra: pip "
                      "install -e '.[perfetto]' (or write .json / .json.gz).") from None


def _write_json(f: IO[bytes], path: Path, runs: list[TraceRun], window: Window,
                metadata: dict[str, Any]) -> None:
    # No name and mtime=0 in the gzip header: identical input gives identical bytes. Level 6,
    # zlib's default: on the full t4 trace 1.2 s for 15 MB, where 9 took 3.8 s for 14 MB.
    raw = (gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=6)
           if path.suffix == ".gz" else f)
    with raw:
        out = _Writer(raw)
        out.write_raw('{"traceEvents":[\n')
        for k, run in enumerate(runs):
            for event in _run_events(run, k, window):
                out.event(event)
        out.write_raw('\n],"displayTimeUnit":"ms","otherData":')
        out.write_raw(json.dumps(metadata, sort_keys=True))
        out.write_raw("}\n")


class _Writer:
    """Events as compact Chrome JSON, joined in batches: a full t4 trace is 1.7 million events,
    and building an encoder and making a write call per event was most of its writing time."""

    _BATCH = 20_000

    def __init__(self, raw: IO[bytes]):
        self.raw, self.first = raw, True
        self.pending: list[str] = []
        self.encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode

    def write_raw(self, text: str) -> None:
        self.flush()
        self.raw.write(text.encode())

    def event(self, e: tuple) -> None:
        what = e[0]
        if what == "slice":
            _, pid, tid, name, cat, t0, t1, args, _, _ = e
            if isinstance(args, str):       # a task: its name is a plain ASCII kind
                name = f'"{name}"'
            else:
                name, args = self.encode(name), self.encode(dict(args))
            text = (f'{{"ph":"X","name":{name},"cat":"{cat}","pid":{pid},'
                    f'"tid":{tid},"ts":{t0 / 1000!r},"dur":{(t1 - t0) / 1000!r},"args":{args}}}')
        elif what == "flow":
            _, fid, pid, src_tid, s_ns, dst_tid, f_ns = e
            self.pending.append(f'{{"ph":"s","id":{fid},"name":"dependency","cat":"dependency",'
                                f'"pid":{pid},"tid":{src_tid},"ts":{s_ns / 1000!r}}}')
            text = (f'{{"ph":"f","bp":"e","id":{fid},"name":"dependency","cat":"dependency",'
                    f'"pid":{pid},"tid":{dst_tid},"ts":{f_ns / 1000!r}}}')
        elif what == "counter":
            _, pid, name, t, value = e      # names are tg's own plain ASCII; values floats
            text = (f'{{"ph":"C","name":"{name}","pid":{pid},"ts":{t / 1000!r},'
                    f'"args":{{"{name}":{float(value)!r}}}}}')
        elif what == "process":
            _, pid, name, sort = e
            text = (self.encode({"ph": "M", "name": "process_name", "pid": pid,
                                 "args": {"name": name}}) + ",\n"
                    + self.encode({"ph": "M", "name": "process_sort_index", "pid": pid,
                                   "args": {"sort_index": sort}}))
        else:
            _, pid, tid, name, sort = e
            text = (self.encode({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                 "args": {"name": name}}) + ",\n"
                    + self.encode({"ph": "M", "name": "thread_sort_index", "pid": pid,
                                   "tid": tid, "args": {"sort_index": sort}}))
        self.pending.append(text)
        if len(self.pending) >= self._BATCH:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            text = ",\n".join(self.pending)
            self.raw.write((text if self.first else ",\n" + text).encode())
            self.first = False
            self.pending.clear()


def _write_proto(f: IO[bytes], path: Path, runs: list[TraceRun], window: Window,
                 metadata: dict[str, Any]) -> None:
    from taskgraph.tracing.protobuf import ProtoWriter

    out = ProtoWriter(f)
    for k, run in enumerate(runs):
        for event in _run_events(run, k, window):
            out.event(event)
    out.close()


def _pid(run_index: int) -> int:
    return run_index + 1


def _tid(run_index: int, stream_index: int) -> int:
    """Unique across runs (Perfetto keys threads by tid) and never a pid (no "main thread")."""
    return 100 * (run_index + 1) + stream_index + 1


# --- what is drawn: the events of one run, in the order both encoders write them ------------
#
# ("process", pid, name, sort_index)
# ("thread", pid, tid, name, sort_index)
# ("slice", pid, tid, name, cat, t0_ns, t1_ns, args, flows, gid); `args` is a tuple of
#     (key, value) pairs, or already-formatted JSON text for the many task slices; `flows`
#     (a _Flows, or None) says which arrows leave and enter task `gid`
# ("flow", id, pid, src_tid, s_ns, dst_tid, f_ns): Chrome's "s"/"f" points, strictly inside the
#     slices they join
# ("counter", pid, name, t_ns, value)

def _run_events(run: TraceRun, k: int, window: Window) -> Iterator[tuple]:
    prog = run.program
    plan, model = prog.plan, prog.plan.scenario.model
    streams = prog.streams
    pid = _pid(k)
    yield ("process", pid, f"{k + 1}. {run.label}", k)
    for sid, s in enumerate(streams):
        yield ("thread", pid, _tid(k, sid), _stream_info(s)[0], sid)

    shown = window.mask(prog) & ~np.isnan(run.end)
    ids = np.flatnonzero(shown)
    start_ns = np.zeros(prog.total, dtype=np.int64)
    end_ns = np.zeros(prog.total, dtype=np.int64)
    start_ns[ids] = np.rint((run.start[ids] + run.offset_s) * 1e9).astype(np.int64)
    end_ns[ids] = np.rint((run.end[ids] + run.offset_s) * 1e9).astype(np.int64)

    cols = {c: prog.column(c) for c in ("kind", "stream", "layer", "index")}
    step = prog.step
    flops, nbytes, _ = prog.work()
    flows = _flows(prog, shown, start_ns, end_ns, cols["stream"], k)
    # A stream's slices in time order: Perfetto pairs protobuf begin and end events by time.
    ids = ids[np.lexsort((start_ns[ids], cols["stream"][ids]))]
    yield from _slices(prog, k, ids, start_ns, end_ns, cols, flops, nbytes, flows,
                       run.written_back)
    yield from _profiled(run, k, len(streams), int(end_ns[ids].max()) if len(ids) else 0)
    yield from flows.events
    yield from _counters(run, k, ids, start_ns, end_ns, cols, nbytes, step, model, plan)


def _slices(prog: Program, k: int, ids, start_ns, end_ns, cols, flops, nbytes, flows: _Flows,
            written_back: np.ndarray | None = None) -> Iterator[tuple]:
    """One slice per task. A full run has hundreds of thousands, so their args are formatted
    here as JSON text (what ``json.dumps`` gives: names are plain ASCII); the protobuf encoder
    reads them back. A swapping cache's copy gives its rate in and the bytes it wrote back
    (`written_back`: TraceRun's)."""
    pid = _pid(k)
    streams = prog.streams
    tids = [_tid(k, sid) for sid in range(len(streams))]
    cats = [_stream_info(s)[1] for s in streams]
    copies = [kind in MOVES for kind in KIND_NAMES]
    tags = ["p" if kind in PAGED else "m" for kind in KIND_NAMES]
    idx_keys = ["page" if kind in PAGED else "micro_batch" for kind in KIND_NAMES]
    # An expert cache's misses carry their layer's hit rate (the share of the chosen experts the
    # cache held), so a trace shows where the cache works.
    cache = prog.plan.work.cache_hits().tolist() if prog.plan.schedule.ffn == "cache" else None
    expert_in = KIND_NAMES.index("ExpertIn")
    columns = zip(ids.tolist(), cols["kind"][ids].tolist(), cols["stream"][ids].tolist(),
                  prog.step[ids].tolist(), cols["layer"][ids].tolist(),
                  cols["index"][ids].tolist(), start_ns[ids].tolist(), end_ns[ids].tolist(),
                  nbytes[ids].tolist(), flops[ids].tolist())
    for gid, kind_i, sid, st, layer, index, t0, t1, nb, fl in columns:
        kind = KIND_NAMES[kind_i]
        nb = int(nb)
        turn = _write_back_starts(t0, t1, written_back, kind_i)        # t1: writes none back
        work = (f'"memory bandwidth (GB/s)":{round(nb / max(turn - t0, 1), 3)!r}'
                if copies[kind_i] else f'"flops":{int(fl)}')
        if turn < t1:
            work += f',"written back (bytes)":{nb}'
        if cache is not None and kind_i == expert_in and st > 0:     # decode steps
            work += f',"cache hit rate":{round(cache[layer], 4)!r}'
        args = (f'{{"task":"{kind}[s{st},L{layer},{tags[kind_i]}{index}]","step":{st},'
                f'"layer":{layer},"{idx_keys[kind_i]}":{index},"bytes":{nb},{work}}}')
        yield ("slice", pid, tids[sid], kind, cats[sid], t0, t1, args, flows, gid)


def _profiled(run: TraceRun, k: int, first: int, until_ns: int) -> Iterator[tuple]:
    """The profiler's ops that start before the last drawn task ends, one track per host thread
    or CUDA stream, after the run's streams; on each track, outer ops before the ops inside."""
    pid = _pid(k)
    tids: dict[str, int] = {}
    offset = round(run.offset_s * 1e9)
    ops = sorted((op for op in run.ops if op.start_ns + offset < until_ns),
                 key=lambda op: (op.start_ns, -op.end_ns))
    for op in ops:
        if op.track not in tids:
            tids[op.track] = tid = _tid(k, first + len(tids))
            yield ("thread", pid, tid, f"torch: {op.track}", first + len(tids) - 1)
    for op in ops:
        yield ("slice", pid, tids[op.track], op.name, op.cat, op.start_ns + offset,
               op.end_ns + offset, (), None, None)


class _Flows:
    """Cross-stream dependency arrows of one run, in compact arrays: each arrow's id, the tasks
    it leaves and enters, and its two points. The JSON encoder writes them as "s"/"f" events;
    the protobuf encoder asks each slice for the arrows leaving and entering it."""

    def __init__(self, pid: int, first_id: int):
        self.pid, self.first_id = pid, first_id
        self.cols = {c: array("q") for c in ("src", "dst", "src_tid", "dst_tid", "s", "f")}

    def add(self, src: int, dst: int, src_tid: int, dst_tid: int, s_ns: int, f_ns: int) -> None:
        for c, v in zip(("src", "dst", "src_tid", "dst_tid", "s", "f"),
                        (src, dst, src_tid, dst_tid, s_ns, f_ns)):
            self.cols[c].append(v)

    @property
    def events(self) -> Iterator[tuple]:
        c = self.cols
        for i, (a, b, s_ns, f_ns) in enumerate(zip(c["src_tid"], c["dst_tid"], c["s"], c["f"])):
            yield ("flow", self.first_id + i + 1, self.pid, a, s_ns, b, f_ns)

    @cached_property
    def _by_task(self) -> dict[str, dict[int, list[int]]]:
        """Arrow ids by the task they leave ("src") and enter ("dst"); built only when asked
        (by the protobuf encoder), since the JSON needs none of it."""
        out: dict[str, dict[int, list[int]]] = {}
        for end in ("src", "dst"):
            table: dict[int, list[int]] = {}
            for i, gid in enumerate(self.cols[end], self.first_id + 1):
                table.setdefault(gid, []).append(i)
            out[end] = table
        return out

    def leaving(self, gid: int) -> list[int]:
        return self._by_task["src"].get(gid, [])

    def entering(self, gid: int) -> list[int]:
        return self._by_task["dst"].get(gid, [])


def _flows(prog: Program, shown, start_ns, end_ns, stream, k) -> _Flows:
    flows = _Flows(_pid(k), k * _FLOW_ID_STRIDE)
    tids = [_tid(k, sid) for sid in range(len(prog.streams))]
    starts, ends, streams = start_ns.tolist(), end_ns.tolist(), stream.tolist()
    shown_list = shown.tolist()
    for d, (t, base) in enumerate(zip(prog.seg_template, prog.seg_base)):
        tpl = prog.templates[t]
        lo, hi = int(base), int(base) + tpl.size
        if not shown[lo:hi].any():
            continue
        for pos in np.flatnonzero(shown[lo:hi]).tolist():
            gid = lo + pos
            b0, b1 = starts[gid], ends[gid]
            for r in tpl.deps[pos]:
                src = gid + r
                if src < 0 or not shown_list[src]:
                    continue
                a0, a1 = starts[src], ends[src]
                if a1 - a0 < 2 or b1 - b0 < 2:
                    continue  # no point strictly inside a slice this short
                flows.add(src, gid, tids[streams[src]], tids[streams[gid]],
                          a1 - min(500, (a1 - a0) // 2), b0 + min(500, (b1 - b0) // 2))
    return flows


def _counters(run: TraceRun, k, ids, start_ns, end_ns, cols, nbytes, step, model, plan
              ) -> Iterator[tuple]:
    """The counter tracks of one trace window: memory in use, each link's rate, and what the
    host's shared pools carried."""
    yield from _memory_counters(k, ids, end_ns, cols, nbytes, step, model, plan)
    yield from _link_counters(run, k, ids, start_ns, end_ns, cols, nbytes)
    yield from _pool_counters(run, k, ids, start_ns, end_ns)


def _memory_counters(k, ids, end_ns, cols, nbytes, step, model, plan) -> Iterator[tuple]:
    """The GPU's weight buffer and the CPU's KV cache in use (GB)."""
    kinds = np.array(KIND_NAMES)[cols["kind"][ids]]
    t_end = end_ns[ids]
    changes: dict[str, list[tuple[int, float]]] = {}

    # GPU weight buffer: a page counts from when its copy lands to when the last task reading its
    # layer ends.
    is_d3 = kinds == "D3"
    loaded: dict[tuple[int, int], float] = {}
    w = changes.setdefault("GPU", [])
    for gid, t in zip(ids[is_d3].tolist(), t_end[is_d3].tolist()):
        key = (int(step[gid]), int(cols["layer"][gid]))
        loaded[key] = loaded.get(key, 0.0) + float(nbytes[gid])
        w.append((t, float(nbytes[gid])))
    readers = np.isin(kinds, list(WEIGHT_SECTIONS))
    last_read: dict[tuple[int, int], int] = {}
    for gid, t in zip(ids[readers].tolist(), t_end[readers].tolist()):
        key = (int(step[gid]), int(cols["layer"][gid]))
        last_read[key] = max(t, last_read.get(key, t))
    for key, t in last_read.items():
        if key in loaded:
            w.append((t, -loaded[key]))

    # KV cache on the CPU: prefill's copies out, then one token per sequence per layer per step.
    kv = changes.setdefault("CPU", [])
    append = plan.scenario.policy.mu * model.kv_bytes_per_token * (1 - plan.scenario.policy.r_c)
    for gid, t, kind in zip(ids.tolist(), t_end.tolist(), kinds.tolist()):
        if kind == "KVOut":
            kv.append((t, float(nbytes[gid])))
        elif kind == "CPUAttn":
            kv.append((t, append))

    for dev, key in (("GPU", "GPU weight buffer (GB)"), ("CPU", "CPU KV cache (GB)")):
        level = 0.0
        for t, delta in sorted(changes[dev]):
            level += delta
            yield ("counter", _pid(k), key, t, round(level / 1e9, 6))


def _link_counters(run: TraceRun, k, ids, start_ns, end_ns, cols, nbytes) -> Iterator[tuple]:
    """Link throughput, per direction and per GPU's link (S4's two streams on one link: one
    track, their rates added where they overlap). A swapping cache's copy (TraceRun.written_back)
    draws its bytes in, then the evicted expert's out: that part on the GPU->CPU track."""
    prog = run.program
    first = {d: prog.stream_device.index(d) for d in prog.stream_device}
    link_of = np.array([first[d] for d in prog.stream_device])[cols["stream"]]
    spans: dict[str, list[tuple[int, int, float]]] = {}
    for d in sorted((d for d in first if d[0] in ("h2d", "d2h")),
                    key=lambda d: (d[0] != "h2d", d[1])):
        stream = prog.streams[first[d]]
        label = _stream_info(stream)[0] + " (GB/s)"
        _, colon, gpu = stream.partition(":")
        back_label = _stream_info("d2h" + colon + gpu)[0] + " (GB/s)"
        for g in ids[link_of[ids] == first[d]].tolist():
            t0, t1 = int(start_ns[g]), int(end_ns[g])
            turn = _write_back_starts(t0, t1, run.written_back, int(cols["kind"][g]))
            for track, a, b in ((label, t0, turn), (back_label, turn, t1)):
                if b > a:
                    spans.setdefault(track, []).append((a, b, float(nbytes[g]) / (b - a)))
    for label, track in spans.items():
        a, b, rate = (np.array(x) for x in zip(*track))
        yield from _levels(k, label, a, b, rate)


def _write_back_starts(t0: int, t1: int, written_back: np.ndarray | None, kind: int) -> int:
    """Where in a task's [t0, t1] (ns) its write-back begins: t1 for a task that writes none."""
    share = float(written_back[kind]) if written_back is not None else 0.0
    return t1 - int(round((t1 - t0) * share))


def _levels(k: int, label: str, start_ns: np.ndarray, end_ns: np.ndarray, rate: np.ndarray
            ) -> Iterator[tuple]:
    """A counter track of what spans [start, end) carry together at each instant (GB/s)."""
    times = np.concatenate([start_ns, end_ns])
    order = np.argsort(times, kind="stable")
    level = np.cumsum(np.concatenate([rate, -rate])[order])
    times = times[order]
    last = np.append(times[1:] != times[:-1], True)       # one point per instant
    for t, x in zip(times[last].tolist(), level[last].tolist()):
        yield ("counter", _pid(k), label, t, round(max(x, 0.0), 3))


def _pool_counters(run: TraceRun, k, ids, start_ns, end_ns) -> Iterator[tuple]:
    """What the tasks drew from each of the host's shared pools, all GPUs' together."""
    for name, drawn in run.pools.items():
        mine = ids[(drawn[ids] > 0) & (end_ns[ids] > start_ns[ids])]
        if not len(mine):            # nothing drew on it in this window
            continue
        rate = drawn[mine] / (end_ns[mine] - start_ns[mine])          # bytes/ns = GB/s
        yield from _levels(k, f"{name} (GB/s)", start_ns[mine], end_ns[mine], rate)
