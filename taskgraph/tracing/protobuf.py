"""Perfetto's native protobuf trace format (``.pftrace``): the trace writer's second encoder, and
a reader that turns such a file back into the Chrome JSON form, so one checker and one
comparison serve both formats.

The messages are the `perfetto` package's (``perfetto_trace_pb2``, written through its
``TraceProtoBuilder``), laid out as Perfetto's "synthetic TrackEvent" reference describes
(https://perfetto.dev/docs/reference/synthetic-track-event): a track descriptor per process,
thread and counter, then begin/end events on thread tracks, counter events on counter tracks,
and flows as ids on the slices they leave and enter. Packets go out in batches, each batch a
serialized ``Trace``; concatenated, they are one ``Trace`` message.
"""

from __future__ import annotations

import json
from typing import IO, Any

_SEQUENCE = 1               # one writer, one trusted packet sequence
_EXPLICIT = 3               # TrackDescriptor.ChildTracksOrdering.EXPLICIT
_PROCESS, _THREAD, _COUNTER = 1 << 40, 2 << 40, 3 << 40   # uuid spaces


class ProtoWriter:
    """Encodes the trace writer's events (:func:`taskgraph.tracing.writer._run_events`) as packets."""

    _BATCH = 20_000

    def __init__(self, raw: IO[bytes]):
        from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent
        from perfetto.trace_builder.proto_builder import TraceProtoBuilder

        self._builder_class = TraceProtoBuilder
        self._event = TrackEvent
        self.raw = raw
        self.builder = TraceProtoBuilder()
        self.count = 0
        self.counters: dict[tuple[int, str], int] = {}

    def _packet(self, timestamp: int | None = None):
        packet = self.builder.add_packet()
        packet.trusted_packet_sequence_id = _SEQUENCE
        if timestamp is not None:
            packet.timestamp = timestamp
        self.count += 1
        return packet

    def event(self, e: tuple) -> None:
        what = e[0]
        if what == "slice":
            self._slice(*e[1:])
        elif what == "counter":
            _, pid, name, t, value = e
            uuid = self.counters.get((pid, name))
            if uuid is None:
                uuid = self.counters[pid, name] = _COUNTER + len(self.counters)
                track = self._packet().track_descriptor
                track.uuid, track.parent_uuid, track.name = uuid, _PROCESS + pid, name
                track.counter.SetInParent()
            event = self._packet(t).track_event
            event.type = self._event.TYPE_COUNTER
            event.track_uuid = uuid
            event.double_counter_value = float(value)
        elif what == "process":
            _, pid, name, sort = e
            track = self._packet().track_descriptor
            track.uuid = _PROCESS + pid
            track.process.pid, track.process.process_name = pid, name
            track.sibling_order_rank = sort
            track.child_ordering = _EXPLICIT
        elif what == "thread":
            _, pid, tid, name, sort = e
            track = self._packet().track_descriptor
            track.uuid, track.parent_uuid = _THREAD + tid, _PROCESS + pid
            track.thread.pid, track.thread.tid, track.thread.thread_name = pid, tid, name
            track.sibling_order_rank = sort
        # "flow": the ids ride on the slices they join
        if self.count >= self._BATCH:
            self.flush()

    def _slice(self, pid, tid, name, cat, t0, t1, args, flows, gid) -> None:
        begin = self._packet(t0).track_event
        begin.type = self._event.TYPE_SLICE_BEGIN
        begin.track_uuid = _THREAD + tid
        begin.name = name
        begin.categories.append(cat)
        for key, value in (json.loads(args).items() if isinstance(args, str) else args):
            note = begin.debug_annotations.add()
            note.name = key
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                note.string_value = str(value)
            elif isinstance(value, int):
                note.int_value = value
            else:
                note.double_value = value
        if flows is not None:
            begin.flow_ids.extend(flows.leaving(gid))
            begin.terminating_flow_ids.extend(flows.entering(gid))
        end = self._packet(t1).track_event
        end.type = self._event.TYPE_SLICE_END
        end.track_uuid = _THREAD + tid

    def flush(self) -> None:
        if self.count:
            self.raw.write(self.builder.serialize())
            self.builder = self._builder_class()
            self.count = 0

    def close(self) -> None:
        self.flush()


def decode(data: bytes) -> dict[str, Any]:
    """A ``.pftrace`` file's bytes as the Chrome JSON form the writer gives: metadata events for
    processes and threads, one "X" event per slice, "C" events per counter value, and an "s"/"f"
    pair per flow, placed at the middle of the slices it joins (protobuf flows belong to slices,
    not to points in time).

    Begin and end events pair in file order, as the writer means them (it writes each end right
    after its begin). Perfetto pairs them by time, the last begun slice on a track ending first;
    the two agree unless slices on a track overlap without nesting, which the checker reports
    on the slices decoded here, as it does for JSON."""
    from google.protobuf.message import DecodeError
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace

    trace = Trace()
    try:
        trace.ParseFromString(data)
    except DecodeError as err:
        raise ValueError(f"not a Perfetto protobuf trace ({err})") from None
    decoded = _Decoded()
    for packet in trace.packet:
        if packet.HasField("track_descriptor"):
            decoded.track(packet.track_descriptor)
        elif packet.HasField("track_event"):
            decoded.event(packet.track_event, packet.timestamp)
    return {"traceEvents": decoded.events + decoded.flow_events()}


class _Decoded:
    """A trace's events in the Chrome JSON form, packet by packet: tracks as they are declared,
    then their events; flows once every slice is read."""

    def __init__(self):
        self.events: list[dict[str, Any]] = []
        self.tracks: dict[int, tuple] = {}
        self.open_slices: dict[int, list] = {}
        self.flows: dict[int, dict[str, tuple]] = {}

    def track(self, d: Any) -> None:
        if d.HasField("process"):
            self.tracks[d.uuid] = ("process", d.process.pid)
            self.events.append({"ph": "M", "name": "process_name", "pid": d.process.pid,
                                "args": {"name": d.process.process_name}})
            self.events.append({"ph": "M", "name": "process_sort_index", "pid": d.process.pid,
                                "args": {"sort_index": d.sibling_order_rank}})
        elif d.HasField("thread"):
            t = d.thread
            self.tracks[d.uuid] = ("thread", t.pid, t.tid)
            self.events.append({"ph": "M", "name": "thread_name", "pid": t.pid, "tid": t.tid,
                                "args": {"name": t.thread_name}})
            self.events.append({"ph": "M", "name": "thread_sort_index", "pid": t.pid,
                                "tid": t.tid, "args": {"sort_index": d.sibling_order_rank}})
        elif d.HasField("counter"):
            parent = self.tracks.get(d.parent_uuid)
            if parent is None or parent[0] != "process":
                raise ValueError(f"counter track {d.uuid} belongs to no process declared "
                                 "before it")
            self.tracks[d.uuid] = ("counter", parent[1], d.name)

    def event(self, e: Any, ts: int) -> None:
        from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent

        track = self.tracks.get(e.track_uuid)
        if track is None:
            raise ValueError(f"an event at {ts} ns names track {e.track_uuid}, which no "
                             "descriptor declares")
        if e.type == TrackEvent.TYPE_COUNTER:
            if track[0] != "counter":
                raise ValueError(f"a counter value at {ts} ns lies on {track[0]} track "
                                 f"{e.track_uuid}, not a counter's")
            self.events.append({"ph": "C", "name": track[2], "pid": track[1], "ts": ts / 1000,
                                "args": {track[2]: e.double_counter_value}})
        elif e.type == TrackEvent.TYPE_SLICE_BEGIN:
            self.open_slices.setdefault(e.track_uuid, []).append((ts, e))
        elif e.type == TrackEvent.TYPE_SLICE_END:
            self._slice_end(e, ts, track)

    def _slice_end(self, e: Any, ts: int, track: tuple) -> None:
        if not self.open_slices.get(e.track_uuid):
            raise ValueError(f"a slice ends at {ts} ns on {track} with none begun there")
        t0, begin = self.open_slices[e.track_uuid].pop()
        if track[0] != "thread":
            raise ValueError(f"a slice at {ts} ns lies on {track[0]} track "
                             f"{e.track_uuid}, not a thread's")
        _, pid, tid = track
        self.events.append({"ph": "X", "name": begin.name, "cat": ",".join(begin.categories),
                            "pid": pid, "tid": tid, "ts": t0 / 1000, "dur": (ts - t0) / 1000,
                            "args": {a.name: _value(a) for a in begin.debug_annotations}})
        mid = (t0 + ts) // 2
        for fid in begin.flow_ids:
            self.flows.setdefault(fid, {})["s"] = (pid, tid, mid)
        for fid in begin.terminating_flow_ids:
            self.flows.setdefault(fid, {})["f"] = (pid, tid, mid)

    def flow_events(self) -> list[dict[str, Any]]:
        """Each flow's "s" and "f" events, once every slice has ended."""
        unclosed = sum(len(stack) for stack in self.open_slices.values())
        if unclosed:
            raise ValueError(f"{unclosed} slices begin and never end")
        out = []
        for fid, ends in sorted(self.flows.items()):
            for ph, (pid, tid, t) in sorted(ends.items(), reverse=True):      # "s" before "f"
                event = {"ph": ph, "id": fid, "name": "dependency", "cat": "dependency",
                         "pid": pid, "tid": tid, "ts": t / 1000}
                if ph == "f":
                    event["bp"] = "e"
                out.append(event)
        return out


def _value(note) -> Any:
    which = note.WhichOneof("value")
    return getattr(note, which) if which else None
