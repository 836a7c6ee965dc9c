"""The README's examples are tests too: `tests/doc_examples.py` says how each kind of block is
run and checked.

The repository's root is on sys.path while the tests run (tests/ is a package, and `python -m
pytest` adds the working directory), so its folders `sim/`, `exec/` and `kernels/` -- installed as
taskgraph.sim, taskgraph.exec and taskgraph.kernels (SPEC section 2) -- would be found as
top-level packages of those names. One is a real one: transformers >= 5.25 depends on Hugging
Face's `kernels` and imports it (`from kernels import CUDAProperties`), and found this folder
instead, an ImportError in every test that builds a transformers model. A finder put first says
where each name is installed, never in this repository; a name installed nowhere is not found."""

import importlib.machinery
import sys
from pathlib import Path

from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent
FOLDERS = {"sim", "exec", "kernels"}


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == ROOT
    except OSError:
        return False


def _installed_elsewhere(name):
    return importlib.machinery.PathFinder.find_spec(
        name, [entry for entry in sys.path if not _is_root(entry)])


class InstalledElsewhere:
    """A meta path finder for the top-level names of this repository's folders: the package of
    that name installed outside the repository."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        return _installed_elsewhere(name) if name in FOLDERS else None


for name in FOLDERS:
    if _installed_elsewhere(name) is None:
        # Installed nowhere: a None in sys.modules is Python's own "not importable" (a finder
        # that found nothing would let the next one find the folder).
        sys.modules[name] = None
sys.meta_path.insert(0, InstalledElsewhere())

from tests.doc_examples import PythonBlocks, run_console, setup, teardown  # noqa: E402

pytest_collect_file = Sybil(
    parsers=[SkipParser(), CodeBlockParser("console", run_console), PythonBlocks()],
    patterns=["README.md", "docs/*.md"], setup=setup, teardown=teardown,
).pytest()
