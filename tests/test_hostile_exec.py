"""The executor under signals and scale: a multi-process run ends with its ranks, promptly, and
its ranks hand results back in a format that cannot run code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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


def _start(tmp_path):
    proc = subprocess.Popen(RUN, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    # the ranks exist, still importing: they start deaf to SIGINT, which is what torch's
    # spawn sends them when their parent dies
    wait_for(lambda: len(children(proc.pid)) >= 2, 120, "the ranks' processes")
    return proc, children(proc.pid)


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, 128 + signal.SIGTERM),
                                     (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_every_rank_promptly(tmp_path, sig, rc):
    """SIGTERM left the ranks running (deaf to the SIGINT their parent's death sends); Ctrl-C
    while they started waited for their imports (4 s), after they met up to 11 s."""
    proc, ranks = _start(tmp_path)
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == rc and "Traceback" not in err, err
    assert time.monotonic() - t0 < 5
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
