"""Scenario in, executed run out: the same plan and compiled graph the simulator uses, run with
real kernels, checked against the sequential reference forward.

This is the library entry point behind `tg execute`. It needs PyTorch.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from taskgraph.dag.builder import Plan, make_plan
from taskgraph.dag.compiled import compile_plan
from taskgraph.errors import TgError
from taskgraph.exec.batches import (Batch, Inputs, SharedBatches, batch_of, inputs_of,
                                    request_outputs)
from taskgraph.exec.loading import (check_computable, check_host_memory, kept_synthetic_weights,
                                    need_torch, pick_device, torch_dtype)
from taskgraph.exec.result import Batches, Execution, Measurements
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.sim.metrics import summarize
from taskgraph.specs import ModelSpec, Scenario


def _recorded_routing(ref: Any, m: ModelSpec, slots: list | None, lens: Any, P: int) -> Any:
    """The reference forward's router decisions as a routing trace: step 0 the prefill, every
    real prompt token of each sequence (its padding left out), sequence after sequence; then
    each decode step, one token per sequence. Filler sequences (slots without a request) are
    left out: their one-token prompts stand in for nothing the user asked for."""
    from taskgraph.dag.routing import RoutingTrace

    torch = need_torch()
    seqs = [i for i in range(ref.tokens.shape[0]) if slots is None or slots[i] is not None]
    pre = ref.prefill_experts                                   # [L, N, P, k]
    step0 = torch.cat([pre[:, i, :P if lens is None else int(lens[i])] for i in seqs], dim=1)
    steps = [step0] + [step[:, seqs] for step in ref.decode_experts]     # each [L, tokens, k]
    return RoutingTrace(m.E, m.k, m.L, tuple(step.numpy() for step in steps),
                        tuple(l for l in range(m.L) if m.is_dense(l)))


def _execute_prompts(scenario: Scenario, schedule: str | None, device: str,
                     weights_path: str | None, seed: int, progress, zero_copy: bool,
                     check: bool, profile: bool, processes: bool, warnings: list[str],
                     shared: SharedBatches, record_routing: bool = False) -> Execution:
    """More prompts than the policy's N sequences: N at a time, in the file's order, each batch
    the schedule's micro-batches, so memory is one batch's whatever the file's length (one
    batch of every prompt grew its graph, and the time to build it, with the square of the
    micro-batches: 2,000 prompts took 4.2 GB). The result is the first batch's run (its trace)
    with every request's tokens; makespan, throughput, tasks and the check cover all batches.
    `record_routing` records the first batch's router decisions only."""
    t0 = time.perf_counter()
    requests, per = shared.requests, scenario.policy.N
    starts = range(0, len(requests), per)
    runs: list[Execution] = []
    for b, start in enumerate(starts):
        shared.requests = requests[start:start + per]
        runs.append(execute_scenario(scenario, schedule, device, weights_path, seed,
                                     zero_copy=zero_copy, check=check,
                                     profile=profile and b == 0, processes=processes,
                                     shared=shared, record_routing=record_routing and b == 0))
        if progress:
            progress(b + 1, len(starts))
        if runs[-1].run.interrupted:     # Ctrl-C, or a task that failed: say so as the first
            runs[0].run.failure = runs[0].run.failure or runs[-1].failure
            break
    first, figures = runs[0], [ex.figures for ex in runs]
    checks = [ex.measured for ex in runs]
    done = None not in [c.tokens_match for c in checks]
    tokens = sum(f["throughput_tok_s"] * f["makespan_s"] for f in figures)
    makespan = sum(f["makespan_s"] for f in figures)
    first.measured = replace(
        first.measured,
        batches=Batches(len(runs), round(tokens / makespan, 6) if makespan else 0.0,
                        round(makespan, 6), sum(f["tasks"] for f in figures),
                        any(ex.run.interrupted for ex in runs)),
        max_abs_err=max(c.max_abs_err for c in checks) if done else None,
        tokens_match=all(c.tokens_match for c in checks) if done else None,
        requests=sum(c.requests for c in checks), wall_s=round(time.perf_counter() - t0, 3),
        outputs=[row for c in checks for row in c.outputs or []] if check and done else None,
        warnings=warnings + first.measured.warnings + [
            f"{len(requests):,} prompts ran in {len(runs):,} batches of at most policy.N = "
            f"{per} sequences; the timings other than makespan and throughput, and the trace, "
            "are the first batch's."])
    return first


def _check_processes(plan, zero_copy: bool, profile: bool, last_steps) -> None:
    if plan.gpus < 2:
        raise TgError(
            f"--processes runs each GPU as its own process; hardware.gpu.count is "
            f"{plan.gpus}. Set it to 2 or more (--set hardware.gpu.count=2).")
    for bad, what in ((zero_copy, "--zero-copy"), (profile, "--profile"),
                      (last_steps is not None, "a request list")):
        if bad:
            raise TgError(f"--processes does not combine with {what}.")


@dataclass
class _Job:
    """What a batch runs as: its plan, the memory it needs, its compiled graph, the device it
    runs on, the weights' dtype, and what planning had to say (warnings)."""

    plan: Plan
    memory: Any
    program: Any
    device: str
    dtype: Any
    warnings: list[str]


@dataclass
class _Ran:
    """A finished (or stopped) run: its timings, what holds its tokens and logits
    (``outputs()``: the Runtime, or the ranks of a run in processes), the Runtime of a run in
    this process (None in processes), and the ops the profiler saw."""

    run: Any
    outputs: Any
    runtime: Any
    ops: list


def execute_scenario(scenario: Scenario, schedule: str | None = None, device: str = "auto",
                     weights_path: str | None = None, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None,
                     prompts_path: str | None = None, zero_copy: bool = False,
                     check: bool = True, profile: bool = False,
                     batch: list[list] | None = None, processes: bool = False,
                     shared: SharedBatches | None = None, record_routing: bool = False
                     ) -> Execution:
    """Execute a scenario's schedule for real and compare it with the reference forward
    (unless `check` is False: calibration runs only want the timings). `profile` runs it under
    the PyTorch profiler and keeps the ops it saw (:mod:`taskgraph.exec.profiling`). With
    `prompts_path`, run those requests (see :mod:`taskgraph.exec.prompts`) and put what each
    generated in ``summary["outputs"]``; `batch` runs given requests (``exec.prompts.Request``)
    as those micro-batches instead (:func:`execute_queue` runs a request list batch by batch).
    `zero_copy` (CPU only) makes every transfer a no-op over shared buffers
    (:class:`taskgraph.exec.runtime.Runtime`). `processes` runs each GPU of a multi-GPU plan as
    a process of its own over torch.distributed (:mod:`taskgraph.exec.distributed`). More
    prompts than the policy's N sequences run N at a time (:func:`_execute_prompts`); `shared`
    is one such batch. `record_routing` keeps the router's decisions in ``result.routing``
    (:func:`_recorded_routing`; the first batch's, if there are several; None if the run stopped
    before its end), which needs `check`.

    Its steps, in order: the device; the batch (which requests, the scenario sized to them);
    the plan (its graph, memory and dtype); the weights; the prompts as tensors; the run; the
    check against the reference; the result. What a step refuses, it refuses before the next
    step's work."""
    t0 = time.perf_counter()
    dev = _device(device, zero_copy, check, record_routing)
    batch_ = batch_of(scenario, schedule, weights_path, prompts_path, batch, shared)
    if batch_.overflow is not None:
        return _execute_prompts(batch_.scenario, schedule, device, weights_path, seed, progress,
                                zero_copy, check, profile, processes, batch_.warnings,
                                SharedBatches(batch_.overflow, batch_.tokenizer, batch_.eos),
                                record_routing)
    job = _plan(batch_.scenario, schedule, dev, shared)
    w = _load_weights(job, weights_path, seed, shared)
    inputs = inputs_of(job.plan.scenario, batch_.slots, seed, batch is not None)
    ran = _run(job, w, inputs, zero_copy, profile, processes, progress)
    measured = _measured(job, ran, zero_copy)
    routing = None
    if check and not ran.run.interrupted:
        routing = _check(measured, job, ran, w, inputs, batch_, record_routing)
    return _result(measured, job, ran, w, batch_, routing, profile, t0)


def warm_up(scenario: Scenario, schedule: str, device: str) -> None:
    """Run `scenario`'s `schedule` once, its prompt and one generated token, and drop what it
    measured: what a process pays once (CUDA loading each kernel at its first call) is no
    task's cost. On an H200 the first run of a `tg validate` took 85-113 ms a PrefillAttn or
    Prefill task where the later runs took 1.5-8 (bench/results/h200-2026-11-29), and its
    throughput came out at half the later runs'."""
    short = scenario.workload.model_copy(update={"gen_len": 1})
    ex = execute_scenario(scenario.model_copy(update={"workload": short}), schedule,
                          device=device, check=False)
    # the executor keeps what ran before Ctrl-C or a failed task; a warm-up stops there too
    if ex.run.interrupted:
        raise KeyboardInterrupt
    if ex.failure is not None:
        raise TgError(f"A task failed while warming up {schedule} before measuring "
                      f"({type(ex.failure).__name__}: {ex.failure}).")


def _device(device: str, zero_copy: bool, check: bool, record_routing: bool) -> str:
    """The device to run on ("cpu" or "cuda"), once PyTorch is there and the options agree."""
    need_torch()
    if record_routing and not check:
        raise TgError("Recording the routing needs the check against the reference forward: "
                      "the router's decisions are taken from it.")
    dev = pick_device(device)
    if zero_copy and dev != "cpu":
        raise TgError("--zero-copy makes the CPU backend a CPU inference engine (host and "
                      f"device buffers shared); it does not apply to --device {dev}.")
    return dev


def _plan(scenario: Scenario, schedule: str | None, dev: str, shared: SharedBatches | None) -> _Job:
    """The batch's plan and compiled graph (the last batch shape's, kept in `shared`), once the
    kernels can compute the model, its memory fits the modelled GPU and this machine's memory
    holds the run."""
    torch = need_torch()
    m = scenario.model
    check_computable(m, scenario.workload.context_prompt + scenario.workload.gen_len)
    dtype, warnings = torch_dtype(torch, m, dev)
    plan = make_plan(scenario, schedule)
    if plan.tp > 1:
        from taskgraph.exec.tensor import check_shardable

        check_shardable(m, plan.tp)
    memory = memory_footprint(plan)
    warnings += check_fits(memory, plan.schedule.name)
    key = (scenario.model_dump_json(), schedule)
    program = shared.programs.get(key) if shared else None
    if program is None:
        program = compile_plan(plan)
        if shared is not None:
            shared.programs = {key: program}     # batches come in order: keep the last shape
    check_host_memory((memory.gpu_total if dev == "cpu" else 0) + memory.cpu_total,
                       program.total)
    return _Job(plan, memory, program, dev, dtype, warnings)


def _load_weights(job: _Job, weights_path: str | None, seed: int, shared: SharedBatches | None
                  ) -> Any:
    """The checkpoint's weights, or synthetic ones drawn from `seed`, in the job's dtype; those
    of the batch before when `shared` holds them."""
    if shared is not None and shared.weights is not None:
        return shared.weights
    from taskgraph.kernels.weights import load_safetensors

    m = job.plan.scenario.model
    w = (load_safetensors(weights_path, m, job.dtype) if weights_path
         else kept_synthetic_weights(m, seed, job.dtype))
    if shared is not None:
        shared.weights = w
    return w


def _run(job: _Job, w: Any, inputs: Inputs, zero_copy: bool, profile: bool, processes: bool,
         progress: Callable[[int, int], None] | None) -> _Ran:
    """The job run once, under the profiler with `profile`: its buffers set up first (a
    Runtime; on several GPUs in one process every GPU's shard on this device, or each pipeline
    stage's buffers in the one Runtime), unless each GPU runs in a process of its own."""
    torch = need_torch()
    from taskgraph.exec.runtime import Runtime

    plan = job.plan
    if processes:
        _check_processes(plan, zero_copy, profile, inputs.last_steps)
    make_runtime: Any = Runtime
    if plan.tp > 1:
        from taskgraph.exec.tensor import TensorParallel as make_runtime
    runtime = None if processes else make_runtime(
        plan, w, inputs.prompts, torch.device(job.device), pin_memory=job.device == "cuda",
        prompt_lens=inputs.lens, zero_copy=zero_copy, last_steps=inputs.last_steps)
    go = functools.partial(_dispatch, job, w, inputs, runtime, progress)
    ops: list = []
    if profile:
        from taskgraph.exec.profiling import profile_run

        (run, outputs), ops = profile_run(functools.partial(go, annotate=True),
                                          cuda=job.device == "cuda")
    else:
        run, outputs = go()
    return _Ran(run, outputs, runtime, ops)


def _dispatch(job: _Job, w: Any, inputs: Inputs, runtime: Any,
              progress: Callable[[int, int], None] | None, annotate: bool = False
              ) -> tuple[Any, Any]:
    """Every task of the job's graph on this device's streams (`runtime` None: as a process per
    GPU). Returns the run and what holds its outputs."""
    if runtime is None:
        from taskgraph.exec.distributed import execute_processes

        ranks = execute_processes(job.plan, w, inputs.prompts, prompt_lens=inputs.lens,
                                  device=job.device)
        return ranks.as_run(job.program), ranks
    torch = need_torch()
    from taskgraph.exec.dispatch import CudaDevice, HostDevice, execute

    total = len(job.program.seg_template)
    run = execute(job.program, runtime,
                  CudaDevice(torch) if job.device == "cuda" else HostDevice(),
                  progress=(lambda d: progress(d, total)) if progress else None,
                  annotate=annotate)
    return run, runtime


def _measured(job: _Job, ran: _Ran, zero_copy: bool) -> Measurements:
    """Where the run ran and, for an expert cache, what it copied."""
    cache = getattr(ran.runtime, "cache", None)      # a Runtime's (not a run in processes)
    return Measurements(job.device, str(job.dtype).removeprefix("torch."), zero_copy,
                        cache=cache.to_dict() if job.plan.schedule.ffn == "cache"
                        and cache is not None else None)


def _check(measured: Measurements, job: _Job, ran: _Ran, w: Any, inputs: Inputs,
           batch_: Batch, record_routing: bool) -> Any:
    """The run against the reference forward, on the host, sequentially: the largest logit
    error where each micro-batch ran to its end, and whether the tokens (each request's, in a
    batch of a request list) are the reference's, into `measured`, with each request's output.
    Returns the router's decisions with `record_routing`.

    The router's decisions are recorded here, not in the run: the reference is one loop over
    every layer and token whatever the schedule, while the run routes in other places per
    schedule (on the GPU, in the CPU's Route task, per tensor-parallel shard, in other
    processes) and in threads, micro-batches interleaved; the run's tokens are compared with
    the reference's here, and any difference is said in a warning (:func:`_result`)."""
    torch = need_torch()
    from taskgraph.kernels.reference import reference_forward

    p, G, lens, slots = job.plan.scenario.policy, job.plan.G, inputs.lens, batch_.slots
    ref = reference_forward(w.dequantized(), inputs.prompts, p.mu, G, lens,
                            record=record_routing)
    routing = (_recorded_routing(ref, job.plan.scenario.model, slots, lens,
                                 inputs.prompts.shape[1]) if record_routing else None)
    tokens, logits, _ = ran.outputs.outputs()
    last_steps = inputs.last_steps
    # final logits where each micro-batch ran to its end
    full = list(range(p.N)) if last_steps is None else [
        i for i in range(p.N) if last_steps[i // p.mu] == G]
    if not (torch.isfinite(logits[full]).all() and torch.isfinite(ref.logits[full]).all()):
        # argmax over NaN is token 0 in both, which would read as identical
        raise TgError(f"The run's logits are NaN or infinite (in {measured.dtype}), so "
                      "its tokens mean nothing and cannot be compared; the weights are "
                      "finite, so the activations overflowed"
                      + (" (try the checkpoint in float32)." if job.dtype != torch.float32
                         else "."))
    measured.max_abs_err = float((logits[full].float() - ref.logits[full].float())
                                 .abs().max()) if full else 0.0
    if last_steps is None:
        measured.tokens_match = bool(torch.equal(tokens, ref.tokens))
    else:   # what each request generated
        measured.tokens_match = all(
            torch.equal(tokens[i, :r.max_new_tokens], ref.tokens[i, :r.max_new_tokens])
            for i, r in enumerate(slots) if r is not None)
    if slots is not None:
        measured.outputs = request_outputs(tokens, slots, batch_.tokenizer, batch_.eos)
    return routing


def _result(measured: Measurements, job: _Job, ran: _Ran, w: Any, batch_: Batch,
            routing: Any, profile: bool, t0: float) -> Execution:
    """The executed run: its figures (a simulation's, its times measured; not the modelled
    machine's limit: it ran on another) and what it measured, completed (requests, warnings,
    the profiler's op count, wall time)."""
    measured.warnings = batch_.warnings + job.warnings
    if batch_.slots is not None:
        measured.requests = sum(r is not None for r in batch_.slots)
    if routing is not None and measured.tokens_match is False:
        measured.warnings.append("the routing recorded is the reference forward's, and the "
                                 "run's tokens differ from it.")
    if profile:
        measured.profiled_ops = len(ran.ops)
    measured.wall_s = round(time.perf_counter() - t0, 3)
    figures = summarize(ran.run, job.memory, hardware_limit=False)
    return Execution(job.plan, job.program, job.memory, ran.run, figures, measured, ran.ops, w,
                     routing)
