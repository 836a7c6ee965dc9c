"""An executed run's result contains what it ran and what it measured (issue 39 point 3): it is
not a simulation, no result edits another's figures, and `tg execute --json` says what it said
before the change. tests/data/execute_json_keys.json holds every object's keys, in order, of
`tg execute --json` in each case below, written by the code before (Execution then inherited
the simulation's result and edited its summary)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from taskgraph.cli import main

pytest.importorskip("torch")

KEYS = json.loads((Path(__file__).parent / "data" / "execute_json_keys.json").read_text())
TINY = "scenarios/tiny.yaml"
PROMPTS = "".join(f'{{"prompt_ids": {ids}}}\n' for ids in (
    [1, 2, 3], [4, 5], [6, 7, 8, 9], [3], [5, 6], [7], [8, 9, 10], [11], [12, 13], [14]))


def _keys(x, path: str = "") -> dict[str, list[str]]:
    out = {}
    if isinstance(x, dict):
        out[path or "."] = list(x)
        for k, v in x.items():
            if k not in ("outputs", "classes", "utilization", "policy"):
                out.update(_keys(v, f"{path}.{k}"))
    return out


CASES = {
    "plain": [TINY],
    "expert cache": [TINY, "--schedule", "EC", "--set", "policy.experts_gpu=2"],
    "prompts in batches": [TINY, "--prompts", "p.jsonl"],
    "record routing": [TINY, "--record-routing", "rr.json"],
    "prompts written out": [TINY, "--prompts", "p.jsonl", "--out", "o.jsonl"],
    "request list": ["q.yaml"],
}


@pytest.mark.parametrize("case", CASES)
def test_execute_json_has_the_keys_it_had(case, tmp_path, capsys, monkeypatch):
    root = Path.cwd()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(PROMPTS)
    (tmp_path / "r.csv").write_text("id,prompt_len,gen_len\na,4,2\nb,6,3\nc,3,2\nd,5,2\ne,2,4\n")
    (tmp_path / "q.yaml").write_text("model: tiny\nhardware: t4\nworkload: {requests: r.csv}\n"
                                     "policy: {N: 4, mu: 2}\n")
    argv = [str(root / a) if a == TINY else a for a in CASES[case]]
    assert main(["execute", *argv, "--device", "cpu", "--json"]) == 0
    assert _keys(json.loads(capsys.readouterr().out)) == KEYS[case]


def test_an_execution_contains_its_figures_and_its_measurements():
    from taskgraph.exec.execute import execute_scenario
    from taskgraph.exec.result import Execution, Measurements
    from taskgraph.sim.simulate import Simulation
    from tests.helpers import tiny

    ex = execute_scenario(tiny(), device="cpu")
    assert isinstance(ex, Execution) and not isinstance(ex, Simulation)
    assert isinstance(ex.measured, Measurements) and ex.measured.tokens_match is True
    # the modelled machine's limit is not an executed run's figure: never made, never deleted
    assert "hardware_limit_tok_s" not in ex.figures
    figures = dict(ex.figures)
    shown = ex.to_dict()
    shown["warnings"].append("edited")
    shown["throughput_tok_s"] = -1
    assert ex.figures == figures and ex.to_dict()["warnings"] == ex.measured.warnings
    assert ex.summary == ex.to_dict() and ex.summary["throughput_tok_s"] > 0
