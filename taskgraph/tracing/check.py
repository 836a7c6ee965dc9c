"""Check a trace against the rules Perfetto's importer enforces (SPEC 7).

Perfetto's trace processor is downloaded at run time and not available offline, so tests (and
users) check traces with this instead. It returns a list of problems; an empty list means the
trace will import without dropped or moved events. A Perfetto protobuf trace (``.pftrace``) is
read back into the Chrome JSON form first (:func:`taskgraph.tracing.protobuf.decode`), so both formats
meet the same checks.
"""

from __future__ import annotations

import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

_METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def load_trace(path: str | Path) -> dict[str, Any]:
    """A ``.json``, ``.json.gz`` or ``.pftrace`` trace in the Chrome JSON form."""
    path = Path(path)
    if path.suffix == ".pftrace":
        from taskgraph.tracing.protobuf import decode

        return decode(path.read_bytes())
    raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    return json.loads(raw)


def check_trace(trace: dict[str, Any]) -> list[str]:
    """Problems that would make Perfetto drop, move or misread events."""
    problems: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["the trace must be an object with a traceEvents list"]
    slices: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
    named_pids, named_tracks = set(), set()
    flows: dict[int, dict[str, dict]] = defaultdict(dict)
    for i, e in enumerate(trace["traceEvents"]):
        ph = e.get("ph")
        where = f"event {i} ({e.get('name')!r}, ph={ph!r})"
        pid, tid = e.get("pid"), e.get("tid")
        if not (isinstance(pid, int) and pid >= 0):
            problems.append(f"{where}: pid must be a non-negative integer")
        if ph == "M":
            if e.get("name") not in _METADATA:
                problems.append(f"{where}: Perfetto ignores this metadata name")
            if "sort_index" in e.get("name", "") and not isinstance(
                    e.get("args", {}).get("sort_index"), (int, float)):
                problems.append(f"{where}: sort_index must be a number")
            if e.get("name") == "process_name":
                named_pids.add(pid)
            if e.get("name") == "thread_name":
                named_tracks.add((pid, tid))
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or ts < 0 or not _three_decimals(ts):
            problems.append(f"{where}: ts must be a non-negative number of µs, <= 3 decimals")
            continue
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0 or not _three_decimals(dur):
                problems.append(f"{where}: dur must be a non-negative number, <= 3 decimals")
                continue
            if not (isinstance(tid, int) and tid >= 0):
                problems.append(f"{where}: tid must be a non-negative integer")
            if not isinstance(e.get("args"), dict):
                problems.append(f"{where}: slice without args")
            start = round(ts * 1000)
            slices[(pid, tid)].append((start, start + round(dur * 1000), e.get("name")))
        elif ph in ("s", "f"):
            fid = e.get("id")
            if not isinstance(fid, int):
                problems.append(f"{where}: flow id must be an integer")
                continue
            if ph in flows[fid]:
                problems.append(f"{where}: flow id {fid} used twice")
            if ph == "f" and e.get("bp") != "e":
                problems.append(f"{where}: flow end must carry bp='e'")
            flows[fid][ph] = e
        elif ph == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not args or not all(
                    isinstance(v, (int, float)) for v in args.values()):
                problems.append(f"{where}: counter args must be numbers")
        else:
            problems.append(f"{where}: unexpected phase")

    for track, items in slices.items():
        if track not in named_tracks:
            problems.append(f"track {track} has no thread_name")
        if track[0] not in named_pids:
            problems.append(f"process {track[0]} has no process_name")
        items.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(items, items[1:]):
            if b0 < a1 and b1 > a1:   # overlaps without nesting
                problems.append(f"track {track}: {an!r} [{a0}, {a1}] ns and {bn!r} "
                                f"[{b0}, {b1}] ns overlap without nesting")
    starts = {track: [a for a, _, _ in items] for track, items in slices.items()}
    for fid, ends in flows.items():
        if set(ends) != {"s", "f"}:
            problems.append(f"flow {fid} lacks its {'s' if 's' not in ends else 'f'} event")
            continue
        for ph, e in ends.items():
            t = round(e["ts"] * 1000)
            track = (e["pid"], e["tid"])
            k = bisect.bisect_left(starts.get(track, []), t) - 1   # last slice starting before t
            if k < 0 or not t < slices[track][k][1]:
                problems.append(f"flow {fid}: its {ph} point at {t} ns is not strictly inside a "
                                f"slice of track {(e['pid'], e['tid'])}")
    return problems


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
        except (OSError, ValueError, EOFError) as err:     # missing, not gzip, not JSON
            print(f"{path}: cannot be read as a trace ({err})", file=sys.stderr)
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
