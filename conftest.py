"""The README's examples are tests too: `tests/doc_examples.py` says how each kind of block is
run and checked."""

from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from tests.doc_examples import PythonBlocks, run_console, setup, teardown

pytest_collect_file = Sybil(
    parsers=[SkipParser(), CodeBlockParser("console", run_console), PythonBlocks()],
    patterns=["README.md", "docs/*.md"], setup=setup, teardown=teardown,
).pytest()
