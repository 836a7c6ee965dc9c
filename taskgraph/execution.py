"""Scenario in, executed run out: the same plan and compiled graph the simulator uses, run with
real kernels, checked against the sequential reference forward.

This is the library entry point behind `tg execute`. It needs PyTorch.
"""

from __future__ import annotations

import time
from typing import Callable

from taskgraph.builder import make_plan
from taskgraph.compiled import compile_plan
from taskgraph.errors import TgError
from taskgraph.memory import check_fits, memory_footprint
from taskgraph.sim.metrics import summarize
from taskgraph.simulation import Simulation
from taskgraph.specs import Scenario
from taskgraph.trace import TraceRun


class Execution(Simulation):
    """An executed run: the same fields as a simulated one, traced as "measured"."""

    def trace_run(self, label: str = "measured") -> TraceRun:
        return super().trace_run(label)


def _torch():
    try:
        import torch
    except ImportError:
        raise TgError("tg execute needs PyTorch. Install the CPU build with "
                      "`pip install torch==2.13.0` (or your CUDA build), then try again.") from None
    return torch


def pick_device(name: str) -> str:
    torch = _torch()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise TgError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() "
                      "is False); use --device cpu.")
    if name not in ("cpu", "cuda"):
        raise TgError(f"--device must be auto, cpu or cuda, not '{name}'.")
    return name


def _check_host_memory(need: float) -> None:
    """On the CPU backend the "GPU" buffers live in this machine's memory too."""
    import os

    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > 0.9 * have:
        raise TgError(
            f"The CPU backend keeps the whole run in this machine's memory: it needs "
            f"{need / 1e9:.1f} GB and {have / 1e9:.1f} GB is free. Execute a smaller model "
            "(scenarios/tiny.yaml, scenarios/small.yaml) or fewer layers and sequences "
            "(--set model.L=2 --set policy.N=...)."
        )


def execute_scenario(scenario: Scenario, schedule: str | None = None, device: str = "auto",
                     weights_path: str | None = None, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> Execution:
    """Execute a scenario's schedule for real and compare it with the reference forward."""
    torch = _torch()
    from taskgraph.exec.dispatch import execute
    from taskgraph.exec.runtime import Runtime
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import load_mixtral_safetensors, synthetic_weights

    t0 = time.perf_counter()
    dev = pick_device(device)
    plan = make_plan(scenario, schedule)
    memory = memory_footprint(plan)
    check_fits(memory, plan.schedule.name)
    if dev == "cpu":
        _check_host_memory(memory.gpu_total + memory.cpu_total)
    program = compile_plan(plan)
    m, p = scenario.model, scenario.policy
    dtype = {4: torch.float32, 2: torch.bfloat16 if dev == "cpu" else torch.float16}.get(
        m.dtype_bytes)
    if dtype is None:
        raise TgError(f"model.dtype_bytes = {m.dtype_bytes}: the executor runs 4-byte (fp32) or "
                      "2-byte (fp16/bf16) weights.")
    w = (load_mixtral_safetensors(weights_path, m, dtype) if weights_path
         else synthetic_weights(m, seed=seed, dtype=dtype))
    prompts = synthetic_prompts(p.N, scenario.workload.context_prompt, m.V, seed=seed + 1)
    runtime = Runtime(plan, w, prompts, torch.device(dev), pin_memory=dev == "cuda")
    total = len(program.seg_template)
    from taskgraph.exec.dispatch import CudaDevice, HostDevice

    run = execute(program, runtime, CudaDevice(torch) if dev == "cuda" else HostDevice(),
                  progress=(lambda d: progress(d, total)) if progress else None)
    summary = summarize(run, memory)
    # The hardware limit describes the modelled machine, not the one this ran on.
    del summary["hardware_limit_tok_s"], summary["hardware_limit_fraction"]
    summary["device"] = dev
    summary["measured"] = True
    if not run.interrupted:
        ref = reference_forward(w, prompts, p.mu, plan.G)   # on the host, sequentially
        tokens, logits, _ = runtime.outputs()
        summary["max_abs_err"] = float((logits.float() - ref.logits.float()).abs().max())
        summary["tokens_match"] = bool(torch.equal(tokens, ref.tokens))
    else:
        summary["max_abs_err"] = None
        summary["tokens_match"] = None
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    return Execution(plan, program, memory, run, summary)
