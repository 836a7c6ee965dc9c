"""Writing output files whole or not at all.

Every file tg writes (traces, plots, profiles, CSV, JSONL) goes through :func:`atomic_path`: the
content is written to a temporary file of its own beside the target and renamed over it only once
complete. So an interrupted or failed write leaves the previous file (or none), never half of one,
and two runs writing the same path each leave a valid file: the last to finish wins.
"""

from __future__ import annotations

import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from taskgraph.errors import TgError


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path to write `path`'s content to; it replaces `path` when the block ends
    without an exception (Ctrl-C included) and is removed otherwise. The temporary name keeps
    the target's suffixes, so writers that pick a format by suffix (matplotlib) still do."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".partial{''.join(path.suffixes)}",
                                dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# C0 and C1 control characters but tab and newline: an escape sequence in a name would reach
# the terminal of whoever reads the table.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain_text(value: Any, context: str) -> None:
    """Refuse control characters in any text of `value` (a value, or a document read from a
    file: nested mappings and lists, however deep), naming the field after `context`; names,
    ids and paths are printed, so they must be text. The character is never echoed, only its
    code."""
    stack: list[tuple[Any, str]] = [(value, "")]
    seen: set[int] = set()          # YAML aliases share containers: each is walked once
    while stack:
        item, at = stack.pop()
        if isinstance(item, (dict, list)):
            if id(item) in seen:
                continue
            seen.add(id(item))
        if isinstance(item, str):
            bad = _CONTROL.search(item)
            if bad:
                raise TgError(f"{context}{': ' + at if at else ''} holds a control character "
                              f"({ascii(bad.group())} at position {bad.start()}); names, ids "
                              "and paths are printed, so they must be plain text.")
        elif isinstance(item, dict):
            stack += [(k, f"{at} (a key)".strip()) for k in item]
            stack += [(v, f"{at}.{k}".lstrip(".")) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(v, f"{at}[{i}]") for i, v in enumerate(item)]
