"""Check a trace against the rules Perfetto's importer enforces (docs/design.md §7).

Perfetto's trace processor is downloaded at run time and not available offline, so tests (and
users) check traces with this instead. It returns a list of problems; an empty list means the
trace will import without dropped or moved events. A Perfetto protobuf trace (``.pftrace``) is
read back into the Chrome JSON form first (:func:`taskgraph.tracing.protobuf.decode`), so both formats
meet the same checks.
"""

from __future__ import annotations

import bisect
import json
import math
import reprlib
from collections import defaultdict
from pathlib import Path
from typing import Any

from taskgraph.errors import TgError
from taskgraph.files import read_bytes

_METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def load_trace(path: str | Path) -> dict[str, Any]:
    """A ``.json``, ``.json.gz`` or ``.pftrace`` trace in the Chrome JSON form. Read as every
    input is (:func:`taskgraph.files.read_bytes`): a regular file of bounded size, bounded once
    inflated too; a file that is not a trace is a :class:`TgError` naming it."""
    path = Path(path)
    raw = read_bytes(path, "trace", gunzip=path.suffix == ".gz")
    if path.suffix == ".pftrace":
        from taskgraph.tracing.protobuf import decode

        try:
            return decode(raw)
        except ValueError as err:
            raise TgError(f"'{path}' cannot be read as a trace ({err}).") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        raise TgError(f"The trace '{path}' is not JSON ({err.msg} at line {err.lineno}, "
                      f"column {err.colno}).") from None
    except (ValueError, RecursionError):       # not UTF-8, a 5,000-digit number, deep nesting
        raise TgError(f"The trace '{path}' is not a JSON trace (not UTF-8, a number of more "
                      "than 4,300 digits, or nesting deeper than JSON can be read).") from None


def check_trace(trace: Any) -> list[str]:
    """Problems that would make Perfetto drop, move or misread events. Whatever JSON `trace`
    is, the answer is a list of problems, never an exception: the file is anyone's."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["the trace must be an object with a traceEvents list"]
    events = _Events()
    for i, e in enumerate(trace["traceEvents"]):
        events.read(i, e)
    events.check_tracks()
    events.check_flows()
    return events.problems


class _Events:
    """A trace's events read one by one, each checked alone, then its tracks' slices and its
    flows checked as a whole."""

    def __init__(self):
        self.problems: list[str] = []
        self.slices: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
        self.named_pids: set = set()
        self.named_tracks: set = set()
        self.flows: dict[int, dict[str, dict]] = defaultdict(dict)

    def read(self, i: int, e: Any) -> None:
        if not isinstance(e, dict):
            self.problems.append(f"event {i}: not an object")
            return
        ph = e.get("ph")
        where = f"event {i} ({_short(e.get('name'))}, ph={_short(ph)})"
        if not _whole(e.get("pid")):
            self.problems.append(f"{where}: pid must be a non-negative integer")
        elif ph == "M":
            self._metadata(e, where)
        elif not (_number(ts := e.get("ts")) and ts >= 0 and _three_decimals(ts)):
            self.problems.append(f"{where}: ts must be a non-negative number of µs, "
                                 "<= 3 decimals")
        elif ph == "X":
            self._slice(e, where)
        elif ph in ("s", "f"):
            self._flow_end(e, where)
        elif ph == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not args or not all(
                    _number(v) for v in args.values()):
                self.problems.append(f"{where}: counter args must be numbers")
        else:
            self.problems.append(f"{where}: unexpected phase")

    def _metadata(self, e: dict, where: str) -> None:
        name, args, tid = e.get("name"), e.get("args"), e.get("tid")
        if not isinstance(name, str) or name not in _METADATA:
            self.problems.append(f"{where}: Perfetto ignores this metadata name")
            return
        if "sort_index" in name and not (isinstance(args, dict) and _number(
                args.get("sort_index"))):
            self.problems.append(f"{where}: sort_index must be a number")
        if name == "process_name":
            self.named_pids.add(e["pid"])
        if name == "thread_name":
            if not _whole(tid):
                self.problems.append(f"{where}: tid must be a non-negative integer")
                return
            self.named_tracks.add((e["pid"], tid))

    def _slice(self, e: dict, where: str) -> None:
        dur, tid = e.get("dur"), e.get("tid")
        if not (_number(dur) and dur >= 0 and _three_decimals(dur)):
            self.problems.append(f"{where}: dur must be a non-negative number, <= 3 decimals")
            return
        if not _whole(tid):
            self.problems.append(f"{where}: tid must be a non-negative integer")
            return
        if not isinstance(e.get("args"), dict):
            self.problems.append(f"{where}: slice without args")
        start = round(e["ts"] * 1000)
        self.slices[(e["pid"], tid)].append((start, start + round(dur * 1000),
                                             _short(e.get("name"))))

    def _flow_end(self, e: dict, where: str) -> None:
        ph, fid = e["ph"], e.get("id")
        if not _whole(fid, signed=True):
            self.problems.append(f"{where}: flow id must be an integer")
            return
        if ph in self.flows[fid]:
            self.problems.append(f"{where}: flow id {fid} used twice")
        if ph == "f" and e.get("bp") != "e":
            self.problems.append(f"{where}: flow end must carry bp='e'")
        self.flows[fid][ph] = e

    def check_tracks(self) -> None:
        """Every track named, and its slices nested or apart."""
        for track, items in self.slices.items():
            if track not in self.named_tracks:
                self.problems.append(f"track {track} has no thread_name")
            if track[0] not in self.named_pids:
                self.problems.append(f"process {track[0]} has no process_name")
            items.sort(key=lambda item: item[:2])
            for (a0, a1, an), (b0, b1, bn) in zip(items, items[1:]):
                if b0 < a1 and b1 > a1:   # overlaps without nesting
                    self.problems.append(f"track {track}: {an} [{a0}, {a1}] ns and {bn} "
                                         f"[{b0}, {b1}] ns overlap without nesting")

    def check_flows(self) -> None:
        """Every flow has both ends, each strictly inside a slice of its track (after
        check_tracks, which sorts the slices)."""
        starts = {track: [a for a, _, _ in items] for track, items in self.slices.items()}
        for fid, ends in self.flows.items():
            if set(ends) != {"s", "f"}:
                self.problems.append(f"flow {fid} lacks its {'s' if 's' not in ends else 'f'} "
                                     "event")
                continue
            for ph, e in ends.items():
                t = round(e["ts"] * 1000)
                track = (e["pid"], e["tid"] if _whole(e.get("tid")) else None)
                k = bisect.bisect_left(starts.get(track, []), t) - 1   # last slice before t
                if k < 0 or not t < self.slices[track][k][1]:
                    self.problems.append(f"flow {fid}: its {ph} point at {t} ns is not strictly "
                                         f"inside a slice of {_short(track)}")


# Names and values from the file, as a problem may quote them: bounded, however long or deep.
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlevel = 60, 60, 2


def _short(value: Any) -> str:
    return _REPR.repr(value)


def _whole(x: Any, signed: bool = False) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and (signed or x >= 0) \
        and abs(x) < 2**63


def _number(x: Any) -> bool:
    """A finite JSON number that a time in ns can be made of (JSON reads 1e400 as infinity)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) < 1e15 \
        and not math.isnan(x)


def _three_decimals(x: float) -> bool:
    """Whether the number, as JSON wrote it, has at most three decimals."""
    text = repr(float(x))
    if "e" in text:
        mantissa, exp = text.split("e")
        decimals = len(mantissa.partition(".")[2].rstrip("0")) - int(exp)
    else:
        decimals = len(text.partition(".")[2].rstrip("0"))
    return decimals <= 3


def main(argv: list[str] | None = None) -> int:
    """`python -m taskgraph.tracing.check FILE...`: check traces; exit 1 if any has problems, 2 if
    one cannot be read."""
    import sys

    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m taskgraph.tracing.check TRACE.json[.gz]|TRACE.pftrace ...",
              file=sys.stderr)
        return 2
    worst = 0
    for path in paths:
        try:
            problems = check_trace(load_trace(path))
        except TgError as err:
            print(f"error: {err}", file=sys.stderr)
            worst = 2
            continue
        for problem in problems[:50]:
            print(f"{path}: {problem}")
        if len(problems) > 50:
            print(f"{path}: ... and {len(problems) - 50} more")
        print(f"{path}: {'ok' if not problems else f'{len(problems)} problems'}",
              file=sys.stderr)
        worst = max(worst, 1 if problems else 0)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
