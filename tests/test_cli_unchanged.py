"""What a person sees of every verb stays as it was while the code under it moves (issue 39 point
6): each verb's ``--help`` to the character, its ``--json`` object's keys in order, the words of
its default tables (numbers left out: timings vary), and the t4 figures to the digit.

tests/data/cli_snapshot.json was written by the code before the house's second pass moved the
CLI. A change meant to be seen is recorded by writing it again and reading the diff:

    TG_WRITE_CLI_SNAPSHOT=1 python -m pytest tests/test_cli_unchanged.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from taskgraph.cli import main

SNAPSHOT = Path(__file__).parent / "data" / "cli_snapshot.json"
WRITE = os.environ.get("TG_WRITE_CLI_SNAPSHOT") == "1"
TINY = "scenarios/tiny.yaml"
VERBS = ["simulate", "compare", "execute", "calibrate", "fit", "validate", "search", "sweep",
         "batch", "catalog", "roofline", "graph"]
CELL = {"id": "c", "system": "MoE-Lightning(p)", "schedule": "S1", "machine": "t4",
        "model": "mixtral-8x7b", "workload": {"preset": "helm-reasoning", "gen_len": 4,
                                              "padded": True},
        "policy": {"mu": 8, "n_ub": 4, "r_w": 0.0, "r_c": 0.0}, "measured_tok_s": 10.0}

# Each case: a command line run twice, with --json (keys) and without (tables' words); `{}` is
# the test's own folder. Chosen to reach every verb's every kind of result.
CASES = {
    "simulate t4": ["simulate", "scenarios/t4.yaml"],
    "simulate EC": ["simulate", TINY, "--schedule", "EC", "--set", "policy.experts_gpu=2"],
    "simulate requests": ["simulate", "{}/q.yaml"],
    "compare": ["compare", TINY, "--schedules", "S1,S4,EP"],
    "compare batch sizes": ["compare", TINY, "--batch-sizes", "1,4"],
    "search": ["search", TINY, "--top", "3"],
    "search latency": ["search", TINY, "--top", "3", "--optimize", "latency", "--batch", "2"],
    "sweep": ["sweep", TINY, "--vary", "hardware.link.h2d_gbps=10,20", "--out", "{}/sweep"],
    "batch": ["batch", "{}/q.yaml"],
    "catalog": ["catalog"],
    "roofline": ["roofline", TINY, "--out", "{}/roofline.png"],
    "fit": ["fit", "{}/m.yaml", "--no-loo", "--out", "{}/fit"],
    "execute": ["execute", TINY, "--device", "cpu"],
    "calibrate": ["calibrate", TINY, "--device", "cpu", "--out", "{}/cal.yaml"],
    "validate": ["validate", TINY, "--device", "cpu", "--set", "workload.gen_len=2",
                 "--schedules", "S1", "--mu", "2", "--repeats", "1"],
}
NEEDS_TORCH = {"execute", "calibrate", "validate"}


def _keys(x, path: str = "") -> dict[str, list[str]]:
    """Every object's keys, in order; a list's objects once (its first)."""
    out = {}
    if isinstance(x, list) and x and isinstance(x[0], (dict, list)):
        out.update(_keys(x[0], path + "[]"))
    elif isinstance(x, dict):
        out[path or "."] = list(x)
        for k, v in x.items():
            if k not in ("outputs", "classes", "utilization", "policy", "tasks", "kinds",
                         # maps whose keys are what a run measured, in its order
                         "task_gbps", "task_dequant_gweights", "dequant_gweights", "slowdown",
                         "task_expert_us", "expert_us"):
                out.update(_keys(v, f"{path}.{k}"))
    return out


def _words(text: str, measured: bool) -> list[str]:
    """A table's words: titles, headers, labels and units, not its numbers; of a table of this
    machine's measurements, the rows' labels only (a fitted cost has a byte term or not), and
    not the warnings after it (which fitted costs look implausible is this run's finding), nor
    the caption's note that the machine ran at another speed than when calibrated (under load
    it does)."""
    if measured:
        text = re.sub(r"\.\s+Nearly\s+every\s+task\s+kind\s+is\s+simulated\b.*?just\s+before"
                      r"\s+validating", "", text, flags=re.S)
        lines = text.splitlines()
        end = max((i for i, line in enumerate(lines) if line.startswith("└")), default=-1)
        after = [i for i, line in enumerate(lines) if i > end and line.startswith("warning:")]
        text = "\n".join(line.split("│")[1] if line.startswith("│") else line
                         for line in lines[:after[0] if after else None])
    return re.findall(r"[A-Za-z][A-Za-z_'%/-]*", text)


def _seen(case: str, tmp_path: Path, capsys) -> dict:
    argv = [a.replace("{}", str(tmp_path)) for a in CASES[case]]
    assert main([*argv, "--json"]) == 0, case
    keys = _keys(json.loads(capsys.readouterr().out))
    for folder in ("sweep", "fit"):                     # a folder's run is not written over
        shutil.rmtree(tmp_path / folder, ignore_errors=True)
    assert main(argv) == 0, case
    return {"keys": keys, "words": _words(capsys.readouterr().out, argv[0] in NEEDS_TORCH)}


def _inputs(tmp_path: Path) -> None:
    (tmp_path / "r.csv").write_text("id,prompt_len,gen_len\na,4,2\nb,6,3\nc,3,2\n")
    (tmp_path / "q.yaml").write_text(f"model: tiny\nhardware: t4\nworkload: {{requests: "
                                     f"{tmp_path / 'r.csv'}}}\npolicy: {{N: 4, mu: 2}}\n")
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"cells": [CELL]}))


def _helps(capsys) -> dict[str, str]:
    out = {}
    for verb in ["", *VERBS]:
        assert main([verb, "--help"] if verb else ["--help"]) == 0
        out[verb or "tg"] = capsys.readouterr().out
    return out


@pytest.fixture
def fixed_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")        # argparse's help wraps at the terminal's width


def _snapshot() -> dict:
    return json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}


def test_every_help_is_as_it_was(fixed_width, capsys):
    helps = _helps(capsys)
    if WRITE:
        SNAPSHOT.write_text(json.dumps({**_snapshot(), "help": helps}, indent=1) + "\n")
    for verb, text in _snapshot()["help"].items():
        assert helps[verb] == text, f"tg {verb} --help changed"


@pytest.mark.parametrize("case", CASES)
def test_every_verb_shows_what_it_showed(case, fixed_width, tmp_path, capsys, monkeypatch):
    if case.split()[0] in NEEDS_TORCH:
        pytest.importorskip("torch")
    _inputs(tmp_path)
    seen = _seen(case, tmp_path, capsys)
    if WRITE:
        old = _snapshot()
        SNAPSHOT.write_text(json.dumps({**old, "cases": {**old.get("cases", {}), case: seen}},
                                       indent=1) + "\n")
    expected = _snapshot()["cases"][case]
    assert seen["keys"] == expected["keys"]
    assert seen["words"] == expected["words"]


def test_the_t4_figures_are_as_they_were(capsys):
    assert main(["simulate", "scenarios/t4.yaml", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["throughput_tok_s"], summary["decode_layer_ms"]) == (57.2943, 230.953)


def test_graph_says_what_it_wrote(tmp_path, capsys):
    for out in ("g.json", "g.dot"):
        assert main(["graph", TINY, "--out", str(tmp_path / out)]) == 0
        line = " ".join(capsys.readouterr().err.split()).replace(str(tmp_path), "DIR")
        if WRITE:
            SNAPSHOT.write_text(json.dumps({**_snapshot(), out: line}, indent=1) + "\n")
        assert line == _snapshot()[out]
