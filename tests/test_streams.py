"""The dispatcher's event protocol: on the CPU backend's device in CI (which fails on a wait for
an unrecorded event), on a CPU device with CUDA's asynchronous stream semantics (queues worked by
their own threads), and on CUDA where there is a GPU."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from taskgraph.dag.builder import make_plan  # noqa: E402
from taskgraph.dag.compiled import compile_plan  # noqa: E402
from taskgraph.exec.runtime import Runtime  # noqa: E402
from taskgraph.exec.dispatch import CudaDevice, HostDevice, execute  # noqa: E402
from taskgraph.kernels.reference import reference_forward, synthetic_prompts  # noqa: E402
from taskgraph.kernels.weights import synthetic_weights  # noqa: E402
from taskgraph.tracing.writer import TraceRun, Window, write_trace  # noqa: E402
from taskgraph.tracing.check import check_trace, load_trace  # noqa: E402
from tests.helpers import QueuedHostDevice, tiny  # noqa: E402


class CountingDevice(HostDevice):
    """The CPU backend's device, counting the cross-stream waits it is asked for."""

    def __init__(self):
        self.waits = 0

    def wait(self, stream, event):
        super().wait(stream, event)
        self.waits += 1


def _setup(schedule, device="cpu"):
    one = schedule == "DS"              # one micro-batch, the KV cache on the GPU, every
    sc = tiny(schedule=schedule, policy={"N": 6, "mu": 6 if one else 2,      # weight streamed
                                         "r_w": 0.0 if one else 0.25, "r_c": 1.0 if one else 0.0},
              workload={"prompt_len": 6, "gen_len": 2})
    plan = make_plan(sc, schedule)
    w = synthetic_weights(sc.model, seed=4)
    prompts = synthetic_prompts(6, 6, sc.model.V, seed=5)
    rt = Runtime(plan, w, prompts, torch.device(device), pin_memory=device == "cuda")
    return plan, compile_plan(plan), rt, reference_forward(w, prompts, 2, 2)


@pytest.mark.parametrize("schedule", ["S1", "S2", "S3", "S4", "DS", "S5"])
def test_stream_protocol_reproduces_the_reference(schedule, tmp_path):
    plan, program, rt, ref = _setup(schedule)
    rng = random.Random(3)
    dev = CountingDevice()
    run = execute(program, rt, dev, delay=lambda gid: rng.random() * 0.001)
    assert run.finished.all() and run.failure is None
    tokens, logits, _ = rt.outputs()
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert dev.waits > 0                        # device streams really waited on each other
    path = tmp_path / "t.json"
    write_trace(path, [TraceRun("measured", program, run.start, run.end)], Window(None))
    assert check_trace(load_trace(path)) == []


@pytest.mark.parametrize("schedule", ["S1", "S2", "S3", "S4", "DS", "S5"])
def test_asynchronous_queues_reproduce_the_reference(schedule):
    """Launches return before the work runs, queues drift apart: the events the dispatcher
    records and waits on are all that orders the work, as on a GPU."""
    plan, program, rt, ref = _setup(schedule)
    rng = random.Random(11)
    with QueuedHostDevice(jitter=lambda: rng.random() * 0.002) as dev:
        run = execute(program, rt, dev)
    assert run.finished.all() and run.failure is None
    tokens, logits, _ = rt.outputs()
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert (run.durations >= 0).all()


class ForgetfulDevice(QueuedHostDevice):
    """A dispatcher bug made on purpose: host tasks do not wait for the device work they read."""

    def synchronize(self, event):
        pass


def test_asynchronous_queues_catch_a_missing_synchronisation():
    """The same omission on the CPU backend's synchronous device goes unnoticed (the work is
    done at launch); with asynchronous queues the CPU attention reads a hidden state the device
    has not copied yet, and the result is wrong."""
    plan, program, rt, ref = _setup("S3")
    with ForgetfulDevice(jitter=lambda: 0.002) as dev:
        execute(program, rt, dev)
    assert not torch.allclose(rt.outputs()[1], ref.logits, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schedule", ["S1", "S2", "S3", "S4", "DS", "S5"])
def test_cuda_backend_reproduces_the_reference(schedule):
    plan, program, rt, ref = _setup(schedule, "cuda")
    run = execute(program, rt, CudaDevice(torch))
    assert run.finished.all() and run.failure is None
    tokens, logits, _ = rt.outputs()
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-3, atol=1e-3)
