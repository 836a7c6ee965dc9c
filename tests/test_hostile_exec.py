"""The executor under signals and scale: a multi-process run ends with its ranks, promptly, and
its ranks hand results back in a format that cannot run code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import children, wait_for

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals, /proc")

RUN = [sys.executable, "-m", "taskgraph.cli", "execute", "scenarios/small.yaml", "--set",
       "hardware.gpu.count=2", "--set", "workload.gen_len=400", "--processes", "--json"]


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if open(f"/proc/{pid}/stat").read().split()[2] != "Z":
                out.append(pid)
        except OSError:
            pass
    return out


def _ranks(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing's spawn started as ranks."""
    out = []
    for child in children(pid):
        try:
            if b"spawn_main" in open(f"/proc/{child}/cmdline", "rb").read():
                out.append(child)
        except OSError:
            pass
    return out


def _start(tmp_path):
    proc = subprocess.Popen(RUN, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    # the ranks exist, still importing: they start deaf to SIGINT, which is what torch's
    # spawn sends them when their parent dies
    # (a loaded 2-core machine took over 120 s to import and spawn them). The ranks, not any
    # two children: spawn's resource tracker starts first, and a signal sent with it and one
    # rank up came while the parent still started the other, ignoring SIGINT (a Ctrl-C in that
    # window is lost: exec/distributed.py), and the run went on past the test's wait.
    wait_for(lambda: len(_ranks(proc.pid)) >= 2 or proc.poll() is not None, 600,
             "the ranks' processes")
    assert proc.poll() is None, proc.communicate()
    return proc, children(proc.pid)


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, 128 + signal.SIGTERM),
                                     (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_every_rank_promptly(tmp_path, sig, rc):
    """SIGTERM left the ranks running (deaf to the SIGINT their parent's death sends); Ctrl-C
    while they started waited for their imports (4 s), after they met up to 11 s."""
    proc, ranks = _start(tmp_path)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == rc and "Traceback" not in err, err
    # the ranks were ended, not waited for: they were still importing when the signal came
    wait_for(lambda: not _alive(ranks), 10, "every rank's end")
    assert not list(tmp_path.glob("tg-dist-*"))         # its folder removed on the way out


def test_rank_results_travel_without_pickles(tmp_path):
    import numpy as np
    import torch

    from taskgraph.exec.distributed import _load, _save

    logits = torch.randn(3, 5).to(torch.bfloat16)
    _save({"start": np.arange(4.0), "end": np.arange(4.0) + 1,
           "tokens": torch.arange(6).reshape(3, 2), "logits": logits,
           "hidden": torch.ones(3, 2)}, tmp_path / "rank1.npz")
    got = _load(tmp_path / "rank1.npz", 4)
    tokens, back, _ = got["outputs"]
    assert back.dtype == torch.bfloat16 and torch.equal(back, logits)
    assert tokens.dtype == torch.long and np.array_equal(got["end"], np.arange(4.0) + 1)


def test_more_prompts_than_a_batch_run_batch_by_batch_with_the_same_tokens(tmp_path):
    """Every prompt in one batch grew the graph, and the time to build it, with the square of
    the micro-batches (2,000 prompts: 4.2 GB); now policy.N at a time, the same tokens."""
    import json

    from taskgraph.cli import main

    (tmp_path / "p.jsonl").write_text("".join(json.dumps(
        {"id": i, "prompt_ids": list(range(1, 3 + i % 4)), "max_new_tokens": 2 + i % 2}) + "\n"
        for i in range(10)))
    outs = []
    for n in (4, 12):                      # three batches, then one
        out = tmp_path / f"o{n}.jsonl"
        assert main(["execute", "scenarios/tiny.yaml", "--device", "cpu", "--set",
                     f"policy.N={n}", "--prompts", str(tmp_path / "p.jsonl"), "--out",
                     str(out), "--json"]) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 10


@pytest.mark.parametrize("line, field", [
    ('{"prompt_ids": []}', "prompt_ids"),
    ('{"prompt_ids": [1, 2], "max_new_tokens": 0}', "max_new_tokens"),
    ('{"prompt_ids": [1, 2], "foo": 1}', "foo"),
    # JSON's true, 1e1 and "4" are no counts or token ids (one rule for numbers)
    ('{"prompt_ids": [1, 2], "max_new_tokens": true}', "max_new_tokens"),
    ('{"prompt_ids": [1, 2], "max_new_tokens": 1e1}', "max_new_tokens"),
    ('{"prompt_ids": [1, 2], "max_new_tokens": "4"}', "max_new_tokens"),
    ('{"prompt_ids": [true, false]}', "prompt_ids.0"),
    ('{"prompt_ids": [1.0, 2.0]}', "prompt_ids.0"),
    ('{"id": true, "prompt_ids": [1, 2]}', "id"),
    # execute lists the ids it ran: an escape sequence would reach the terminal
    ('{"id": "a\\u001b]0;owned\\u0007", "prompt_ids": [1, 2]}', "id holds a control"),
    ('{"id": "a\\u202eb", "prompt_ids": [1, 2]}', "id holds a control"),
])
def test_a_bad_prompt_line_names_its_field(tmp_path, line, field):
    """Pydantic's ValidationError is a ValueError: the field's message must not be swallowed by
    the handler for numbers too long to read (it was, for every line)."""
    from taskgraph.errors import TgError
    from taskgraph.exec.prompts import read_prompts

    (tmp_path / "p.jsonl").write_text(line + "\n")
    with pytest.raises(TgError) as err:
        read_prompts(tmp_path / "p.jsonl", vocab=100, default_new_tokens=4)
    assert field in str(err.value) and "4,300 digits" not in str(err.value)
