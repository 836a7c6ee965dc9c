"""Writing output files whole or not at all.

Every file tg writes (traces, plots, profiles, CSV, JSONL) goes through :func:`atomic_path`: the
content is written to a temporary file of its own beside the target and renamed over it only once
complete. So an interrupted or failed write leaves the previous file (or none), never half of one,
and two runs writing the same path each leave a valid file: the last to finish wins.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
