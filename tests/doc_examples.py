"""The README's examples, run as tests (with Sybil, from the root `conftest.py`).

A ```` ```console ```` block is a shell session: each ``$ command`` (continued over lines that
end in a backslash, and with the document of a ``<<'EOF'`` here-document) runs in bash, in a scratch folder that sees the repository's `scenarios/`,
`bench/` and `docs/`, and what the block shows after it must be in what it prints (stdout and
stderr together), line by line and in order:

- whitespace and table borders are not compared, so a table may be shown in part (``...`` or
  simply leaving rows out) and wrapped at another width;
- every figure must be within 2% of the one shown, or within one unit of its last digit;
- wall-clock times (``simulated in 0.79 s``, ``"wall_s"``) are not compared;
- an output that is JSON is compared as JSON, key by key (figures as above);
- a command must exit 0, unless the output shown says ``error:``.

Comments steer a block: ``<!-- check: text -->`` before a block compares its text and its
counts (whole numbers that are not shares: tasks, steps, a policy's fields) but none of its
other figures nor the resource a run is bound by (``gpu-bound``: measured runs; this machine's
speed is not the README's); ``<!-- skip: next
"why" -->`` skips it (Sybil's skip); ``<!-- skip: next if(not SLOW, reason="why") -->`` runs it
only with ``TG_DOCS_SLOW=1``, and ``TG_DOCS_SLOW=only`` runs those blocks alone (what `.ci/run`
sets for its second pass: the test command ran the others), with three times the time limit
(each runs minutes). ```` ```python ```` blocks run as Python, in order, sharing one namespace
per document.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from sybil import Example
from sybil.parsers.markdown import PythonCodeBlockParser

ROOT = Path(__file__).resolve().parent.parent
RELATIVE = 0.02
TIMEOUT_S = 600

_BORDERS = "│┃┏┳┓┡╇┩└┴┘┌┬┐├┼┤─━╭╮╰╯═║╔╗╚╝"
_SPACE = re.compile(f"[\\s{_BORDERS}]+")
_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d])|(?<![\w.])-?\d+(?:\.\d+)?"
                     r"(?:e[-+]?\d+)?(?![\d])")
_ANY_NUMBER = r"(-?[\d,]*\d(?:\.\d+)?(?:e[-+]?\d+)?)"
_BOUND_BY = re.compile(r"\b\w+-bound\b")
# What follows a whole number that is a measurement, not a count (`60 µs fixed`, `72%`).
_MEASURE = re.compile(r"\s*(?:%|[µmn]?s\b|[KMGT]?B\b|[KMGT]?B/s|tok/s|GFLOP|TFLOP|x\b|×)")
# What a figure follows when it is a wall-clock time, which no two runs share.
_WALL_TIME = re.compile(r'(?:(?:simulated|executed|policies|finished) in|"wall_s":|HRM,|takes|'
                        r'took) $')


def setup(namespace: dict) -> None:
    """A scratch folder per document, seeing the repository's inputs; commands write there."""
    work = Path(tempfile.mkdtemp(prefix="tg-docs-"))
    for name in ("scenarios", "bench", "docs"):
        (work / name).symlink_to(ROOT / name)
    for name in ("traces", "profiles"):
        (work / name).mkdir()
    slow = os.environ.get("TG_DOCS_SLOW")
    namespace.update(WORK=work, SLOW=slow in ("1", "only"), ONLY_SLOW=slow == "only",
                     HOME_DIR=os.getcwd())
    os.chdir(work)          # Python blocks open the same relative paths as console blocks


def teardown(namespace: dict) -> None:
    if namespace.get("RAY_STARTED"):      # the block's own `ray stop` did not run if it failed
        subprocess.run(["ray", "stop"], capture_output=True, timeout=TIMEOUT_S)
    os.chdir(namespace["HOME_DIR"])
    shutil.rmtree(namespace["WORK"], ignore_errors=True)


def _comments(example: Example) -> list[str]:
    """The bodies of the ``<!-- ... -->`` comments just above this block (read from the text,
    so that a block run on its own is steered as in the whole document)."""
    text = example.document.text[:example.start].rstrip()
    bodies = []
    while text.endswith("-->") and "<!--" in text:
        start = text.rfind("<!--")
        bodies.append(text[start + 4:-3].strip())
        text = text[:start].rstrip()
    return bodies


def _check_for(example: Example) -> str | None:
    """The ``<!-- check: ... -->`` above this block, if any."""
    how = None
    for body in _comments(example):
        if body.startswith("check:"):
            how = body.removeprefix("check:").strip()
            if how != "text":
                raise ValueError(f"<!-- {body} -->: the only check is 'text'")
    return how


def _slow(example: Example) -> bool:
    """Whether the block is marked to run only with TG_DOCS_SLOW."""
    return any(body.startswith("skip: next if(not SLOW") for body in _comments(example))


class PythonBlocks(PythonCodeBlockParser):
    """Python blocks, run as doctests, but not by ``TG_DOCS_SLOW=only`` (none is slow)."""

    def __call__(self, document):
        for region in super().__call__(document):
            region.evaluator = _not_only_slow(region.evaluator)
            yield region


def _not_only_slow(evaluator):
    def evaluate(example: Example):
        if example.namespace["ONLY_SLOW"]:
            pytest.skip("TG_DOCS_SLOW=only: the test command ran this block")
        return evaluator(example)
    return evaluate


def run_console(example: Example) -> None:
    """Run each command of the block and check what it printed against what the block shows."""
    namespace = example.namespace
    how, slow = _check_for(example), _slow(example)
    if namespace["ONLY_SLOW"] and not slow:
        pytest.skip("TG_DOCS_SLOW=only: the test command ran this block")
    for command, shown in _session(str(example.parsed)):
        namespace["RAY_STARTED"] = namespace.get("RAY_STARTED") or command.startswith("ray start")
        proc = subprocess.run(["bash", "-c", command], cwd=namespace["WORK"],
                              capture_output=True, text=True,
                              timeout=TIMEOUT_S * (3 if slow else 1),
                              env={**os.environ, "COLUMNS": "110", "TERM": "dumb"})
        printed = proc.stdout + proc.stderr
        expect_error = "error:" in shown
        if (proc.returncode != 0) != expect_error:
            raise AssertionError(f"$ {command}\nexited {proc.returncode}"
                                 f"{' (the README shows an error)' if expect_error else ''}:\n"
                                 f"{printed[-3000:]}")
        problem = compare(shown, printed, figures=how != "text")
        if problem:
            raise AssertionError(f"$ {command}\n{problem}\n--- printed ---\n{printed[-6000:]}")


_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


def _session(text: str) -> list[tuple[str, str]]:
    """(command, output shown) pairs of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            heredoc = _HEREDOC.search(command)
            while heredoc and i + 1 < len(lines):       # the document is part of the command
                i += 1
                command += "\n" + lines[i]
                if lines[i] == heredoc.group(1):
                    break
            pairs.append((command, []))
        elif pairs:
            pairs[-1][1].append(line)
        i += 1
    return [(c, "\n".join(out)) for c, out in pairs]


def compare(shown: str, printed: str, figures: bool = True) -> str | None:
    """Why `printed` does not show what `shown` says it does (None: it does)."""
    if not shown.strip():
        return None
    as_json = _json(shown)
    if as_json is not None:
        got = _json(printed)
        if got is None:
            return "the README shows JSON; the command printed something else"
        return _compare_json(as_json, got, "", figures)
    text = _SPACE.sub(" ", printed)
    at, before = 0, ""
    for line in shown.splitlines():
        want = _SPACE.sub(" ", line).strip()
        if not want or want in ("...", "…"):
            continue
        if not figures:     # which resource binds a measured run is as much this machine's as its speed
            want = _BOUND_BY.sub("…-bound", want)
        pattern, numbers = _pattern(want, before)
        before = want
        best = None
        for m in re.finditer(pattern, text[at:]):
            wrong = [(w, g) for (w, free, count), g in zip(numbers, m.groups())
                     if (figures or count) and not free and not _close(w, g)]
            if not wrong:
                at += m.end()
                break
            best = best or wrong
        else:
            if best:
                return (f"the line\n    {line.strip()}\nhas other figures now: "
                        + ", ".join(f"{w} -> {g}" for w, g in best))
            return f"the line\n    {line.strip()}\nis not in what the command printed"
    return None


def _pattern(line: str, before: str = "") -> tuple[str, list[tuple[str, bool, bool]]]:
    """A regex for `line` with each figure a group, and each figure with whether it is free
    (a wall time: what precedes it, on this line or at the end of the line `before`, a title
    wrapped at the table's width, says so) and whether it is a count (a whole number, not a
    share: tasks, steps, a policy's N), which a measured run shares with the README. An
    ellipsis stands for anything, the spaces around it included."""
    line = re.sub(r"\s*(?:\.\.\.|…)\s*", "...", line)
    parts, numbers, last = [], [], 0
    for m in _NUMBER.finditer(line):
        if line[last:m.start()]:
            parts.append(re.escape(line[last:m.start()]))
        parts.append(_ANY_NUMBER)
        count = not re.search(r"[.e]", m.group()) and not _MEASURE.match(line[m.end():])
        numbers.append((m.group(), bool(_WALL_TIME.search(f"{before} {line[:m.start()]}")),
                        count))
        last = m.end()
    parts.append(re.escape(line[last:]))
    return "".join(parts).replace(r"\.\.\.", ".*?").replace("…", ".*?"), numbers


def _close(want: str, got: str) -> bool:
    a, b = float(want.replace(",", "")), float(got.replace(",", ""))
    digits = want.split(".")[1] if "." in want and "e" not in want.lower() else ""
    unit = 10.0 ** -len(digits)
    return abs(a - b) <= max(RELATIVE * abs(a), unit) or math.isclose(a, b)


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _compare_json(want, got, where: str, figures: bool) -> str | None:
    if isinstance(want, dict):
        if not isinstance(got, dict) or want.keys() != got.keys():
            return f"{where or 'the object'}: keys {sorted(want)} shown, " \
                   f"{sorted(got) if isinstance(got, dict) else type(got).__name__} printed"
        for k in want:
            if k == "wall_s":
                continue
            problem = _compare_json(want[k], got[k], f"{where}.{k}", figures)
            if problem:
                return problem
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(want) != len(got):
            return f"{where}: {want!r} shown, {got!r} printed"
        for i, (w, g) in enumerate(zip(want, got)):
            problem = _compare_json(w, g, f"{where}[{i}]", figures)
            if problem:
                return problem
        return None
    if isinstance(want, (int, float)) and not isinstance(want, bool) and \
            isinstance(got, (int, float)) and not isinstance(got, bool):
        return None if not figures or _close(repr(want), repr(got)) else \
            f"{where}: {want} shown, {got} printed"
    return None if want == got else f"{where}: {want!r} shown, {got!r} printed"
