"""The README checker itself: what it lets through and what it stops (tests/doc_examples.py)."""

from __future__ import annotations

import unittest

from tests.doc_examples import _session, compare

PRINTED = """\
tg simulate t4: S1 (CGOPipe), mixtral-8x7b on 1xT4
┌──────────────────┬────────────────────────────────────────────────────┐
│ throughput       │ 57.29 tok/s (27% of the hardware limit, 216 tok/s) │
│ utilization      │ gpu 72%  cpu 1%  h2d 85%  d2h 0%  pin 53%          │
│ tasks            │ 405,006 simulated in 0.79 s                        │
└──────────────────┴────────────────────────────────────────────────────┘
"""


def test_the_same_output_passes_at_another_width_and_in_part():
    assert compare(PRINTED, PRINTED) is None
    narrower = "│ throughput │ 57.29 tok/s (27% of the\nhardware limit, 216 tok/s) │"
    assert compare(narrower, PRINTED) is None
    assert compare("...\n│ tasks │ 405,006 simulated in 0.79 s │", PRINTED) is None


def test_a_figure_that_moved_fails_and_a_wall_time_does_not():
    assert "57.29 -> 60.1" in compare(PRINTED, PRINTED.replace("57.29", "60.1"))
    assert compare(PRINTED, PRINTED.replace("57.29", "57.9")) is None          # within 2%
    assert compare(PRINTED, PRINTED.replace("cpu 1%", "cpu 2%")) is None       # last digit
    assert "405,006" in compare(PRINTED, PRINTED.replace("405,006", "415,006"))
    assert compare(PRINTED, PRINTED.replace("in 0.79 s", "in 9.31 s")) is None
    # a title wrapped at the table's width: the time starts the next line
    wrapped = "tg search t4: 59,871 feasible of 249,224 policies in\n12.22 s, 38 of them simulated"
    assert compare(wrapped, wrapped.replace("12.22", "7.05").replace("\n", " ")) is None
    assert "38 -> 48" in compare(wrapped, wrapped.replace("38", "48"))
    assert compare(PRINTED, PRINTED.replace("57.29", "99.99"), figures=False) is None


def test_a_measured_runs_counts_are_compared_but_not_its_speed_or_shares():
    """A measured run's tok/s and shares are the machine's; its task count is the graph's."""
    assert compare(PRINTED, PRINTED.replace("gpu 72%", "gpu 12%"), figures=False) is None
    assert "405,006 -> 415,006" in compare(PRINTED, PRINTED.replace("405,006", "415,006"),
                                           figures=False)
    fixed = "│ CPUAttn (2304 tasks) │ 60 µs fixed + bytes / 2.68 GB/s │"
    assert compare(fixed, fixed.replace("60 µs", "82 µs"), figures=False) is None
    assert "2304 -> 2404" in compare(fixed, fixed.replace("2304", "2404"), figures=False)


def test_missing_lines_and_changed_words_fail():
    assert "is not in" in compare(PRINTED, PRINTED.replace("h2d 85%", "pcie 85%"))
    assert "is not in" in compare(PRINTED + "│ bound by │ prefill gpu │", PRINTED)
    # lines must come in the order shown
    lines = PRINTED.splitlines()
    assert compare("\n".join([lines[4], lines[2]]), PRINTED) is not None


def test_json_is_compared_key_by_key():
    shown = '{"throughput_tok_s": 57.29, "wall_s": 0.8,\n "warnings": []}'
    assert compare(shown, '{\n  "throughput_tok_s": 57.3,\n  "wall_s": 3.1,\n  "warnings": []\n}') is None
    assert "keys" in compare(shown, '{"throughput_tok_s": 57.29, "wall_s": 1, "warnings": [], '
                                    '"bound_by": {}}')
    assert "throughput_tok_s" in compare(shown, '{"throughput_tok_s": 70, "wall_s": 1, '
                                                '"warnings": []}')


def test_a_session_splits_into_commands_with_continuations_and_here_documents():
    block = ("$ tg compare a.yaml \\\n    --schedules S1\nout 1\n"
             "$ cat > f.csv <<'EOF'\nid,x\n$ not a prompt\nEOF\n$ tg simulate f.yaml\nout 2\n")
    assert _session(block) == [("tg compare a.yaml  --schedules S1", "out 1"),
                               ("cat > f.csv <<'EOF'\nid,x\n$ not a prompt\nEOF", ""),
                               ("tg simulate f.yaml", "out 2")]


def test_an_ellipsis_inside_a_line_stands_for_anything_there():
    assert compare("│ utilization │ gpu 72% ... pin 53% │", PRINTED) is None
    assert compare("│ utilization │ gpu 72% ... pcie 53% │", PRINTED) is not None


def test_a_measured_run_may_be_bound_by_another_resource_but_a_simulated_one_may_not():
    shown = "│ decode layer │ 2.04 ms (HRM bound 1.81 ms, gpu-bound: 88.8%) │"
    printed = "│ decode layer │ 4.45 ms (HRM bound 3.55 ms, pin-bound: 79.8%) │"
    assert compare(shown, printed, figures=False) is None
    assert "is not in" in compare(shown, printed.replace("4.45", "2.04").replace("3.55", "1.81")
                                  .replace("79.8", "88.8"))
    assert "is not in" in compare(shown, printed.replace("HRM bound", "HRM limit"), figures=False)


PAGE = """\
```console
$ echo fast
fast
```

<!-- skip: next if(not SLOW, reason="slow") -->
```console
$ echo slow
slow
```

```python
>>> 1 + 1
2
```
"""


def _outcomes(tmp_path, monkeypatch, slow: str | None) -> list[str]:
    """Each block of PAGE run as the test command runs a page, with TG_DOCS_SLOW=`slow`."""
    from _pytest.outcomes import Skipped
    from sybil import Sybil
    from sybil.parsers.markdown import CodeBlockParser, SkipParser

    from tests.doc_examples import PythonBlocks, run_console, setup, teardown

    if slow is None:
        monkeypatch.delenv("TG_DOCS_SLOW", raising=False)
    else:
        monkeypatch.setenv("TG_DOCS_SLOW", slow)
    tmp_path.mkdir()
    (tmp_path / "page.md").write_text(PAGE)
    document = Sybil([SkipParser(), CodeBlockParser("console", run_console),
                      PythonBlocks()]).parse(tmp_path / "page.md")
    setup(document.namespace)
    out = []
    try:
        for example in document.examples():
            try:
                example.evaluate()
                out.append("ran")
            except (Skipped, unittest.SkipTest):      # ours; Sybil's skip of a slow block
                out.append("skipped")
    finally:
        teardown(document.namespace)
    return out[:1] + out[2:]         # the second "example" is the skip comment itself


def test_only_slow_runs_the_slow_blocks_alone_and_the_test_command_the_others(
        tmp_path, monkeypatch):
    """CI's second pass (TG_DOCS_SLOW=only) ran every block of every page again, 25 minutes
    of it, for the six slow ones."""
    slow_only = _outcomes(tmp_path / "a", monkeypatch, "only")
    both = _outcomes(tmp_path / "b", monkeypatch, "1")
    plain = _outcomes(tmp_path / "c", monkeypatch, None)
    # blocks: a console block, a slow one, a Python one
    assert slow_only == ["skipped", "ran", "skipped"]
    assert both == ["ran", "ran", "ran"]
    assert plain == ["ran", "skipped", "ran"]
