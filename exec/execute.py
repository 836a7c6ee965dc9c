"""Scenario in, executed run out: the same plan and compiled graph the simulator uses, run with
real kernels, checked against the sequential reference forward.

This is the library entry point behind `tg execute`. It needs PyTorch.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import ValidationError
from rich.text import Text

from taskgraph.dag.builder import Plan, make_plan
from taskgraph.dag.compiled import compile_plan
from taskgraph.errors import CheckFailed, TgError
from taskgraph.files import atomic_path
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.output.report import Shown, execute_queue_table, execute_table, warnings_of
from taskgraph.sim.metrics import summarize
from taskgraph.sim.simulate import Simulation
from taskgraph.kernels.quant import expert_format
from taskgraph.specs import TENSOR_CLASSES, ModelSpec, Scenario
from taskgraph.tracing.writer import Traced, TraceRun


class Executed:
    """What an executed run (one batch or a request list's) gives beside its figures: the
    generated tokens, the router's decisions, and whether it failed."""

    summary: dict[str, Any]
    routing: Any
    failure: BaseException | None

    def write_outputs(self, path: str) -> None:
        _write_outputs(self.summary, path)

    def write_routing(self, path: str | Path) -> None:
        write_routing(self.routing, path)

    def routing_written(self) -> Iterator[Text]:
        """The line saying where the router's decisions went, if they were written."""
        if self.summary.get("routing"):
            yield Text(f"wrote {self.summary['routing']}: the router's experts of the prefill "
                       f"and {len(self.routing.experts) - 1} decode steps")

    def raise_if_failed(self, trace: str | Path | None = None) -> None:
        """A TgError if a task raised (the run stopped there); `trace`, if written, shows what
        ran before it."""
        if self.failure is not None:
            raise TgError(f"A task failed during execution ({type(self.failure).__name__}: "
                          f"{self.failure}); " + (f"the trace in {trace} shows what ran before "
                          "it." if trace else "rerun with --trace to see what ran before it."))

    def raise_if_mismatched(self) -> None:
        """CheckFailed if requests generated other tokens in their batch than alone."""
        if self.summary.get("requests_match_alone") is False:
            mismatched = self.summary["mismatched"]
            raise CheckFailed(f"{len(mismatched)} requests generated other tokens in their "
                              f"batch than alone: {', '.join(map(str, mismatched[:10]))}.")


@dataclass
class Execution(Executed, Simulation):
    """An executed run: the same fields as a simulated one, traced as "measured", with what the
    PyTorch profiler saw inside it when it ran under ``--profile``."""

    ops: list = field(default_factory=list)
    weights: Any = None           # what ran: the reference forward can be re-run on them
    # the router's decisions (taskgraph.dag.routing.RoutingTrace), with record_routing
    routing: Any = None

    def trace_run(self, label: str = "measured") -> TraceRun:
        run = super().trace_run(label)
        run.ops = self.ops
        return run

    def gantt_runs(self) -> list[TraceRun]:
        return [self.trace_run(f"{self.summary['schedule']} measured")]

    def views(self):
        yield execute_table(self.summary)
        for row in (self.summary.get("outputs") or [])[:5]:
            yield Text(f"  {row['id']}: {row.get('text', row['output_ids'])}")
        yield from self.routing_written()
        yield from warnings_of(self.summary)

    @property
    def failure(self) -> BaseException | None:
        """The exception a task raised, if one did (the run stopped there)."""
        return self.run.failure


def write_routing(trace: Any, path: str | Path) -> None:
    """A run's router decisions as a routing trace file (``tg-routing/1``, the format
    ``workload.routing.trace`` reads: :mod:`taskgraph.dag.routing`), written whole or not at
    all."""
    if trace is None:
        raise TgError("This run recorded no routing: it was executed without record_routing, "
                      "or stopped before its end.")
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(trace.to_dict(), f, separators=(",", ":"))
        f.write("\n")


def _recorded_routing(ref: Any, m: ModelSpec, slots: list | None, lens: Any, P: int) -> Any:
    """The reference forward's router decisions as a routing trace: step 0 the prefill, every
    real prompt token of each sequence (its padding left out), sequence after sequence; then
    each decode step, one token per sequence. Filler sequences (slots without a request) are
    left out: their one-token prompts stand in for nothing the user asked for."""
    from taskgraph.dag.routing import RoutingTrace

    torch = _torch()
    seqs = [i for i in range(ref.tokens.shape[0]) if slots is None or slots[i] is not None]
    pre = ref.prefill_experts                                   # [L, N, P, k]
    step0 = torch.cat([pre[:, i, :P if lens is None else int(lens[i])] for i in seqs], dim=1)
    steps = [step0] + [step[:, seqs] for step in ref.decode_experts]     # each [L, tokens, k]
    return RoutingTrace(m.E, m.k, m.L, tuple(step.numpy() for step in steps))


def _write_outputs(summary: dict[str, Any], path: str) -> None:
    """Each request's tokens go to `path` (JSON lines) instead of the summary, which names it."""
    from taskgraph.exec.prompts import write_outputs

    write_outputs(path, summary.pop("outputs"))
    summary["out"] = path


def _torch():
    try:
        import torch
    except ImportError:
        raise TgError("Running graphs for real (tg execute, calibrate, validate) needs PyTorch. "
                      "Install the CPU build with `pip install torch==2.13.0` (or your CUDA "
                      "build), then try again.") from None
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


# Host bytes dispatch keeps per task (a threading.Event, two device events, start and end
# times, the run's columns): 1.35 KB measured with tracemalloc, rounded up.
_BYTES_PER_TASK = 1500


def _check_host_memory(buffers: float, tasks: int) -> None:
    """Refuse up front a run this machine's memory cannot hold: its host buffers (on the CPU
    backend the "GPU" ones too) and the bookkeeping of every task. A 10^6-step run of the tiny
    model is 116 million tasks, 170 GB, and would otherwise grow until it is killed."""
    import os

    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    need = buffers + tasks * _BYTES_PER_TASK
    if need > 0.9 * have:
        raise TgError(
            f"This run needs about {need / 1e9:.1f} GB of this machine's memory "
            f"({buffers / 1e9:.1f} GB of KV cache and weights, {tasks:,} tasks at "
            f"{_BYTES_PER_TASK:,} bytes each) and {have / 1e9:.1f} GB is free. Lower "
            "workload.gen_len (or --steps, or the prompts' max_new_tokens), the number of "
            "sequences (policy.N) or layers (model.L), or execute a smaller model."
        )


# Fields of a checkpoint's config.json that change what is computed but not its shape: with
# --weights they come from the checkpoint, whatever the scenario's model says.
_MATH_FIELDS = ("rope_theta", "rope_type", "rope_scaling_factor", "rope_yarn",
                "rope_interleave", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
                "sliding_layers",
                "hidden_act", "architecture", "dtype", "dtype_bytes", "router", "renormalize",
                "routed_scaling", "expert_groups", "topk_groups", "shared_gate",
                "attention_sinks")
_SHAPE_FIELDS = ("h", "h_i", "n_q", "n_kv", "d", "E", "k", "V", "dense_layers", "h_dense",
                 "shared_experts", "h_shared", "attention", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
#: The families whose layers the executor's kernels compute as transformers does
#: (tests/test_families.py, tests/test_transformers_parity.py); the others are simulated only.
EXECUTED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
            "gpt_oss")


def checkpoint_model(model: ModelSpec, folder: str | Path) -> tuple[ModelSpec, list[str]]:
    """The scenario's model made to agree with a checkpoint's config.json: shapes must match,
    the fields that change the math come from the checkpoint, and running fewer layers than it
    holds is said, not silent. Returns the model and the warnings to show."""
    from taskgraph.model_files import model_from_hf_config

    config = Path(folder) / "config.json"
    if not config.is_file():
        return model, [f"'{folder}' has no config.json: RoPE theta, norm epsilon and the other "
                       "fields that change the math are the scenario's model's, unchecked."]
    try:
        ckpt = ModelSpec.model_validate(model_from_hf_config(config))
    except ValidationError as err:
        e = err.errors()[0]
        raise TgError(f"The checkpoint's config '{config}' is not a valid model: "
                      f"{'.'.join(map(str, e['loc']))}: {e['msg']}.") from None
    stored = [c for c in TENSOR_CLASSES if getattr(ckpt.precision, c) is not None]
    if stored:
        raise TgError(f"The checkpoint '{folder}' stores its {', '.join(stored)} weights as "
                      f"{getattr(ckpt.precision, stored[0])} (its quantization_config): tg "
                      "execute runs weights in their dtype, and routed experts at q8_0 or q4_0 "
                      "it quantizes itself; the checkpoint is simulated, not executed.")
    for name in _SHAPE_FIELDS:
        if getattr(model, name) != getattr(ckpt, name):
            raise TgError(f"model.{name} = {getattr(model, name)} in the scenario, but the "
                          f"checkpoint '{folder}' has {getattr(ckpt, name)}; start the scenario's "
                          f"model from it (model: {{hf_config: {config}}}).")
    if model.L > ckpt.L:
        raise TgError(f"model.L = {model.L}, but the checkpoint '{folder}' holds {ckpt.L} layers.")
    warnings = []
    if model.L < ckpt.L:
        warnings.append(f"running the first {model.L} of the checkpoint's {ckpt.L} layers "
                        f"(model.L = {model.L}): the tokens are not the full model's.")
    changed = [f for f in _MATH_FIELDS if getattr(model, f) != getattr(ckpt, f)]
    if changed:
        warnings.append("taken from the checkpoint's config.json instead of the scenario: "
                        + ", ".join(f"{f} = {getattr(ckpt, f)}" for f in changed) + ".")
    return model.model_copy(update={f: getattr(ckpt, f) for f in _MATH_FIELDS}), warnings


def check_computable(m: ModelSpec, context: int) -> None:
    """Refuse what the kernels would compute differently from the model."""
    if m.architecture not in EXECUTED:
        raise TgError(f"model.architecture = {m.architecture}: tg execute computes "
                      f"{', '.join(EXECUTED)} layers; {m.architecture} is simulated, not "
                      "executed (docs/models.md).")

    quantized = [c for c in (*TENSOR_CLASSES, "kv_cache") if getattr(m.precision, c) is not None
                 and not (c == "experts" and expert_format(m))]
    if quantized:
        raise TgError(f"model.precision.{quantized[0]} = {getattr(m.precision, quantized[0])}: "
                      "tg execute runs weights in the model's dtype, and routed experts in it "
                      "or at q8_0 or q4_0; other precisions are simulated, not executed.")
    if m.attention_sinks != (m.architecture == "gpt_oss"):
        raise TgError(f"model.attention_sinks = {m.attention_sinks}: tg execute computes sinks "
                      "as gpt-oss has them, and only there.")
    if expert_format(m) and (m.h % 32 or m.h_i % 32):
        raise TgError(f"model.precision.experts = {m.precision.experts}: its blocks hold 32 "
                      f"weights of a row, and the experts' rows are h = {m.h} and h_i = "
                      f"{m.h_i} long.")
    if m.hidden_act != "silu":
        raise TgError(f"model.hidden_act = {m.hidden_act}: the experts' kernels compute SwiGLU "
                      "with SiLU only.")
    if m.rope_type not in ("default", "linear", "yarn"):
        raise TgError(f"model.rope_type = {m.rope_type}: tg computes the default, linear and "
                      "YaRN RoPE scalings only.")
    if m.sliding_window is not None and m.sliding_window < context:
        raise TgError(f"model.sliding_window = {m.sliding_window} is shorter than the context "
                      f"this run reaches ({context} tokens); tg's attention sees every token, "
                      "so it would not compute this model. Use shorter prompts or fewer steps.")


def _torch_dtype(torch, m: ModelSpec, dev: str) -> tuple[Any, list[str]]:
    """Weights run in the checkpoint's dtype. Without one: fp32 for 4-byte weights, bf16 on the
    CPU and fp16 on CUDA for 2-byte ones. A GPU without bf16 (T4) runs a bf16 checkpoint in
    fp16, and says so."""
    if m.dtype is not None:
        dtype = getattr(torch, m.dtype)
    elif m.dtype_bytes == 4:
        dtype = torch.float32
    elif m.dtype_bytes == 2:
        dtype = torch.bfloat16 if dev == "cpu" else torch.float16
    else:
        raise TgError(f"model.dtype_bytes = {m.dtype_bytes}: the executor runs 4-byte (fp32) or "
                      "2-byte (fp16/bf16) weights.")
    if dev == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16, ["this GPU has no bf16: the bf16 weights run in fp16."]
    return dtype, []


def _for_requests(scenario: Scenario, schedule: str | None, requests: list
                  ) -> tuple[Scenario, list]:
    """The scenario resized to run these requests in one batch, in order: N the request count
    rounded up to whole micro-batches, and to as many as the schedule needs. Returns it with
    each sequence slot's request (None: a filler, whose output is dropped)."""
    mu = min(scenario.policy.mu, len(requests))
    return _for_batch(scenario, schedule, [requests[i:i + mu]
                                           for i in range(0, len(requests), mu)], mu)


def _for_batch(scenario: Scenario, schedule: str | None, batch: list[list], mu: int
               ) -> tuple[Scenario, list]:
    """The scenario resized to run one batch of micro-batches of requests (at most `mu` each):
    prompts padded to the longest, as many decode steps as the longest request needs, as many
    micro-batches as the schedule needs. Returns it with each sequence slot's request (None: a
    filler sequence, whose output is dropped)."""
    from taskgraph.dag.schedules import SCHEDULES

    needed = SCHEDULES[schedule or scenario.schedule].min_micro_batches
    n = max(len(batch), needed)
    slots = [r for mb in batch for r in list(mb) + [None] * (mu - len(mb))]
    slots += [None] * (n * mu - len(slots))
    requests = [r for r in slots if r is not None]
    lens = [len(r.prompt_ids) for r in requests]
    workload = scenario.workload.model_copy(update=dict(
        prompt_len=max(1, round(sum(lens) / len(lens))), max_prompt_len=max(lens), padded=True,
        gen_len=max(1, max(r.max_new_tokens for r in requests) - 1), refill=False))
    return scenario.model_copy(update=dict(
        workload=workload, policy=scenario.policy.model_copy(update=dict(N=n * mu, mu=mu)))
    ), slots


def max_positions(folder: str | Path | None) -> int | None:
    """A checkpoint's max_position_embeddings, if its config.json gives one."""
    from taskgraph.model_files import hf_config_json

    config = Path(folder) / "config.json" if folder else None
    if config is None or not config.is_file():
        return None
    return hf_config_json(config).get("max_position_embeddings")


def _check_positions(scenario: Scenario, slots: list | None, limit: int) -> None:
    """Every sequence's prompt and new tokens within the checkpoint's positions."""
    w = scenario.workload
    if slots is None and w.context_prompt + w.gen_len + 1 > limit:
        raise TgError(f"This run's prompts of {w.context_prompt:,} tokens and "
                      f"{w.gen_len + 1:,} new tokens (workload.gen_len + 1, the first coming "
                      f"from prefill) need more positions than the checkpoint's "
                      f"max_position_embeddings ({limit:,}); lower workload.gen_len or "
                      "workload.prompt_len.")
    for r in slots or []:
        if r is not None and len(r.prompt_ids) + r.max_new_tokens > limit:
            raise TgError(f"Request {str(r.id)[:60]!r}: its prompt of {len(r.prompt_ids):,} "
                          f"tokens and {r.max_new_tokens:,} new tokens need more positions "
                          f"than the checkpoint's max_position_embeddings ({limit:,}).")


@dataclass
class _Prompts:
    """What the batches of a run over many prompts share: the batch's requests, how to read
    and end them, the weights (loaded once) and the last batch shape's compiled graph."""

    requests: list
    tokenizer: Any
    eos: set[int]
    weights: Any = None
    programs: dict = field(default_factory=dict)


def _execute_prompts(scenario: Scenario, schedule: str | None, device: str,
                     weights_path: str | None, seed: int, progress, zero_copy: bool,
                     check: bool, profile: bool, processes: bool, warnings: list[str],
                     shared: _Prompts, record_routing: bool = False) -> Execution:
    """More prompts than the policy's N sequences: N at a time, in the file's order, each batch
    the schedule's micro-batches, so memory is one batch's whatever the file's length (one
    batch of every prompt grew its graph, and the time to build it, with the square of the
    micro-batches: 2,000 prompts took 4.2 GB). The result is the first batch's run (its trace)
    with every request's tokens; makespan, throughput, tasks and the check cover all batches.
    `record_routing` records the first batch's router decisions only."""
    t0 = time.perf_counter()
    requests, per = shared.requests, scenario.policy.N
    starts = range(0, len(requests), per)
    first, outputs, tokens, makespan, tasks, ran, errors, matches = (None, [], 0.0, 0.0, 0, 0,
                                                                      [], [])
    for b, start in enumerate(starts):
        shared.requests = requests[start:start + per]
        ex = execute_scenario(scenario, schedule, device, weights_path, seed,
                              zero_copy=zero_copy, check=check, profile=profile and b == 0,
                              processes=processes, shared=shared,
                              record_routing=record_routing and b == 0)
        s = ex.summary
        first = first or ex
        outputs += s.pop("outputs", None) or []
        tokens += s["throughput_tok_s"] * s["makespan_s"]
        makespan += s["makespan_s"]
        tasks += s["tasks"]
        ran += s["requests"]
        errors.append(s["max_abs_err"])
        matches.append(s["tokens_match"])
        if progress:
            progress(b + 1, len(starts))
        if ex.run.interrupted:      # Ctrl-C, or a task that failed: say so as the first batch
            first.run.failure = first.run.failure or ex.failure
            first.summary["interrupted"] = True
            break
    summary = first.summary
    done = None not in matches
    summary.update(
        throughput_tok_s=round(tokens / makespan, 6) if makespan else 0.0,
        makespan_s=round(makespan, 6), tasks=tasks, batches=len(matches),
        max_abs_err=max(errors) if done else None, tokens_match=all(matches) if done else None,
        requests=ran, wall_s=round(time.perf_counter() - t0, 3),
        warnings=warnings + summary["warnings"] + [
            f"{len(requests):,} prompts ran in {len(matches):,} batches of at most policy.N = "
            f"{per} sequences; the timings other than makespan and throughput, and the trace, "
            "are the first batch's."])
    if check and done:
        summary["outputs"] = outputs
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


# The last model's random weights, kept for the next run of the same model (and seed and
# dtype), in this module on purpose: validate and calibrate execute one model many times, each
# run a call of execute_scenario of its own, and drawing a model's weights is slow (a Mixtral
# layer takes seconds; the tiny test model 1.3 s on two cores, so that tests/test_expert_exec.py
# and test_record_routing.py, which execute it some hundred times, took 77 s without this
# instead of 27 s). Only the last model stays: they can be tens of GB. Nothing else is kept
# between runs (a run's weights are read, never written).
_last_weights: dict[tuple, Any] = {}


def _synthetic_weights(m: ModelSpec, seed: int, dtype) -> Any:
    """Random weights drawn from `seed`, the last model's kept (``_last_weights``)."""
    from taskgraph.kernels.weights import synthetic_weights

    key = (m.model_dump_json(), seed, dtype)
    if key not in _last_weights:
        _last_weights.clear()          # one model at a time: they can be tens of GB
        _last_weights[key] = synthetic_weights(m, seed=seed, dtype=dtype)
    return _last_weights[key]


@dataclass
class _Batch:
    """The sequences one run executes: the scenario sized to them, each sequence slot's request
    (``slots``; None in a slot: a filler sequence; ``slots`` None: synthetic prompts of the
    workload's length), the tokenizer that reads and writes their text, what ends a request
    (``eos()``, read only when outputs are written) and the warnings so far. ``overflow``:
    every request of a prompts file holding more than the policy's N sequences, which then run
    N at a time (:func:`_execute_prompts`)."""

    scenario: Scenario
    slots: list | None
    tokenizer: Any
    eos: Callable[[], set[int]]
    warnings: list[str]
    overflow: list | None = None


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
class _Inputs:
    """A batch's prompts as tensors: token ids [N, P] right-padded, each sequence's length
    (None: all P), and the last step each micro-batch's requests need (None: every step)."""

    prompts: Any
    lens: Any
    last_steps: list[int] | None


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
                     shared: _Prompts | None = None, record_routing: bool = False
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
    batch_ = _batch_of(scenario, schedule, weights_path, prompts_path, batch, shared)
    if record_routing and batch_.scenario.model.dense_count:
        raise TgError("--record-routing records every layer's router: a model with dense layers "
                      "(model.dense_layers) has layers without one, which a routing trace "
                      "cannot say yet.")
    if batch_.overflow is not None:
        return _execute_prompts(batch_.scenario, schedule, device, weights_path, seed, progress,
                                zero_copy, check, profile, processes, batch_.warnings,
                                _Prompts(batch_.overflow, batch_.tokenizer, batch_.eos()),
                                record_routing)
    job = _plan(batch_.scenario, schedule, dev, shared)
    w = _load_weights(job, weights_path, seed, shared)
    inputs = _inputs(job.plan.scenario, batch_.slots, seed, batch is not None)
    ran = _run(job, w, inputs, zero_copy, profile, processes, progress)
    summary = _measured(job, ran, zero_copy)
    routing = None
    if check and not ran.run.interrupted:
        routing = _check(summary, job, ran, w, inputs, batch_, record_routing)
    return _result(summary, job, ran, w, batch_, routing, profile, t0)


def _device(device: str, zero_copy: bool, check: bool, record_routing: bool) -> str:
    """The device to run on ("cpu" or "cuda"), once PyTorch is there and the options agree."""
    _torch()
    if record_routing and not check:
        raise TgError("Recording the routing needs the check against the reference forward: "
                      "the router's decisions are taken from it.")
    dev = pick_device(device)
    if zero_copy and dev != "cpu":
        raise TgError("--zero-copy makes the CPU backend a CPU inference engine (host and "
                      f"device buffers shared); it does not apply to --device {dev}.")
    return dev


def _batch_of(scenario: Scenario, schedule: str | None, weights_path: str | None,
              prompts_path: str | None, batch: list[list] | None, shared: _Prompts | None
              ) -> _Batch:
    """Which sequences run: synthetic prompts of the workload's shape, a prompts file's
    requests, one batch of a longer file (`shared`), or given micro-batches of requests
    (`batch`); the scenario's model made the checkpoint's, and the scenario sized to the
    requests, each within the checkpoint's positions."""
    from taskgraph.exec.prompts import eos_ids, load_tokenizer, read_prompts

    warnings: list[str] = []
    if weights_path and shared is None:     # a batch of many prompts has it applied
        model, warnings = checkpoint_model(scenario.model, weights_path)
        scenario = scenario.model_copy(update={"model": model})
    eos = (lambda: shared.eos) if shared is not None else (lambda: eos_ids(weights_path))
    limit = max_positions(weights_path)
    slots, tokenizer = None, None
    if prompts_path:
        tokenizer = load_tokenizer(weights_path)
        requests = read_prompts(prompts_path, scenario.model.V, scenario.workload.gen_len,
                                tokenizer, limit)
        if len(requests) > scenario.policy.N:
            return _Batch(scenario, None, tokenizer, eos, warnings, overflow=requests)
        scenario, slots = _for_requests(scenario, schedule, requests)
    elif shared is not None:
        tokenizer = shared.tokenizer
        scenario, slots = _for_requests(scenario, schedule, shared.requests)
        # equal shapes, one compiled graph: the mean prompt length only names the workload
        scenario = scenario.model_copy(update={"workload": scenario.workload.model_copy(
            update={"prompt_len": scenario.workload.context_prompt})})
    elif batch is not None:
        scenario, slots = _for_batch(scenario, schedule, batch, scenario.policy.mu)
    if limit is not None:
        _check_positions(scenario, slots, limit)
    return _Batch(scenario, slots, tokenizer, eos, warnings)


def _plan(scenario: Scenario, schedule: str | None, dev: str, shared: _Prompts | None) -> _Job:
    """The batch's plan and compiled graph (the last batch shape's, kept in `shared`), once the
    kernels can compute the model, its memory fits the modelled GPU and this machine's memory
    holds the run."""
    torch = _torch()
    m = scenario.model
    check_computable(m, scenario.workload.context_prompt + scenario.workload.gen_len)
    dtype, warnings = _torch_dtype(torch, m, dev)
    plan = make_plan(scenario, schedule)
    if expert_format(m) and not plan.schedule.experts_on_host:
        raise TgError(f"model.precision.experts = {m.precision.experts}: tg execute keeps "
                      "quantized experts apart from their layer, as S5, EP, EC and ECP do; "
                      f"{plan.schedule.name} streams them with the layer's other weights.")
    if plan.tp > 1:
        from taskgraph.exec.tensor import check_shardable

        check_shardable(m, plan.tp)
        if (m.architecture != "mixtral" or m.dense_count or m.shared_experts
                or m.attention != "gqa" or expert_format(m)):
            raise TgError("tensor parallelism splits Mixtral's layers (every one an MoE layer "
                          "of routed experts, grouped-query attention, weights in the model's "
                          "dtype); this model runs on one GPU, or on several in pipeline or data "
                          "parallel.")
    memory = memory_footprint(plan)
    warnings += check_fits(memory, plan.schedule.name)
    key = (scenario.model_dump_json(), schedule)
    program = shared.programs.get(key) if shared else None
    if program is None:
        program = compile_plan(plan)
        if shared is not None:
            shared.programs = {key: program}     # batches come in order: keep the last shape
    _check_host_memory((memory.gpu_total if dev == "cpu" else 0) + memory.cpu_total,
                       program.total)
    return _Job(plan, memory, program, dev, dtype, warnings)


def _load_weights(job: _Job, weights_path: str | None, seed: int, shared: _Prompts | None
                  ) -> Any:
    """The checkpoint's weights, or synthetic ones drawn from `seed`, in the job's dtype; those
    of the batch before when `shared` holds them."""
    if shared is not None and shared.weights is not None:
        return shared.weights
    from taskgraph.kernels.weights import load_safetensors

    m = job.plan.scenario.model
    w = (load_safetensors(weights_path, m, job.dtype) if weights_path
         else _synthetic_weights(m, seed, job.dtype))
    if shared is not None:
        shared.weights = w
    return w


def _inputs(scenario: Scenario, slots: list | None, seed: int, skip_finished: bool) -> _Inputs:
    """The prompts as a tensor: synthetic ones drawn from `seed` + 1, or each slot's request
    right-padded (a filler: one token). With `skip_finished` (a batch of a request list), each
    micro-batch's last step: its tasks after its last request's last step, and every task of a
    micro-batch holding no request, do nothing, as the simulator skips them."""
    torch = _torch()
    from taskgraph.kernels.reference import synthetic_prompts

    p, P = scenario.policy, scenario.workload.context_prompt
    if slots is None:
        prompts, lens = synthetic_prompts(p.N, P, scenario.model.V, seed=seed + 1), None
    else:
        prompts = torch.zeros(p.N, P, dtype=torch.long)
        lens = torch.ones(p.N, dtype=torch.long)      # fillers: one token
        for i, r in enumerate(slots):
            if r is not None:
                prompts[i, :len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
                lens[i] = len(r.prompt_ids)
    last_steps = None
    if skip_finished:
        last_steps = [max((r.max_new_tokens - 1 for r in slots[j * p.mu:(j + 1) * p.mu]
                           if r is not None), default=-1) for j in range(p.N // p.mu)]
    return _Inputs(prompts, lens, last_steps)


def _run(job: _Job, w: Any, inputs: _Inputs, zero_copy: bool, profile: bool, processes: bool,
         progress: Callable[[int, int], None] | None) -> _Ran:
    """The job run once, under the profiler with `profile`: its buffers set up first (a
    Runtime; on several GPUs in one process every GPU's shard on this device, or each pipeline
    stage's buffers in the one Runtime), unless each GPU runs in a process of its own."""
    torch = _torch()
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


def _dispatch(job: _Job, w: Any, inputs: _Inputs, runtime: Any,
              progress: Callable[[int, int], None] | None, annotate: bool = False
              ) -> tuple[Any, Any]:
    """Every task of the job's graph on this device's streams (`runtime` None: as a process per
    GPU). Returns the run and what holds its outputs."""
    if runtime is None:
        from taskgraph.exec.distributed import execute_processes

        ranks = execute_processes(job.plan, w, inputs.prompts, prompt_lens=inputs.lens,
                                  device=job.device)
        return ranks.as_run(job.program), ranks
    torch = _torch()
    from taskgraph.exec.dispatch import CudaDevice, HostDevice, execute

    total = len(job.program.seg_template)
    run = execute(job.program, runtime,
                  CudaDevice(torch) if job.device == "cuda" else HostDevice(),
                  progress=(lambda d: progress(d, total)) if progress else None,
                  annotate=annotate)
    return run, runtime


def _measured(job: _Job, ran: _Ran, zero_copy: bool) -> dict[str, Any]:
    """The run's summary, as a simulation's (its timings measured), with where it ran and, for
    an expert cache, what it copied."""
    summary = summarize(ran.run, job.memory)
    # The hardware limit describes the modelled machine, not the one this ran on.
    del summary["hardware_limit_tok_s"], summary["hardware_limit_fraction"]
    summary["device"] = job.device
    summary["dtype"] = str(job.dtype).removeprefix("torch.")
    summary["measured"] = True
    summary["zero_copy"] = zero_copy
    runtime = ran.runtime
    cache = getattr(runtime, "cache", None)      # a Runtime's (not a run in processes)
    if job.plan.schedule.ffn == "cache" and cache is not None:
        # what EC's expert cache really copied and held, beside what the model expects of it
        summary["experts"] = {**summary.get("experts", {}), **cache.to_dict()}
    summary["max_abs_err"] = summary["tokens_match"] = None
    return summary


def _check(summary: dict[str, Any], job: _Job, ran: _Ran, w: Any, inputs: _Inputs,
           batch_: _Batch, record_routing: bool) -> Any:
    """The run against the reference forward, on the host, sequentially: the largest logit
    error where each micro-batch ran to its end, and whether the tokens (each request's, in a
    batch of a request list) are the reference's, into `summary`, with each request's output.
    Returns the router's decisions with `record_routing`.

    The router's decisions are recorded here, not in the run: the reference is one loop over
    every layer and token whatever the schedule, while the run routes in other places per
    schedule (on the GPU, in the CPU's Route task, per tensor-parallel shard, in other
    processes) and in threads, micro-batches interleaved; the run's tokens are compared with
    the reference's here, and any difference is said in a warning (:func:`_result`)."""
    torch = _torch()
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
        raise TgError(f"The run's logits are NaN or infinite (in {summary['dtype']}), so "
                      "its tokens mean nothing and cannot be compared; the weights are "
                      "finite, so the activations overflowed"
                      + (" (try the checkpoint in float32)." if job.dtype != torch.float32
                         else "."))
    summary["max_abs_err"] = float((logits[full].float() - ref.logits[full].float())
                                   .abs().max()) if full else 0.0
    if last_steps is None:
        summary["tokens_match"] = bool(torch.equal(tokens, ref.tokens))
    else:   # what each request generated
        summary["tokens_match"] = all(
            torch.equal(tokens[i, :r.max_new_tokens], ref.tokens[i, :r.max_new_tokens])
            for i, r in enumerate(slots) if r is not None)
    if slots is not None:
        summary["outputs"] = _outputs(tokens, slots, batch_.tokenizer, batch_.eos())
    return routing


def _outputs(tokens: Any, slots: list, tokenizer: Any, eos: set[int]) -> list[dict[str, Any]]:
    """Each request's generated tokens (ended at its first end-of-sequence token), and their
    text where a tokenizer reads them."""
    from taskgraph.exec.prompts import trim

    rows = []
    for i, r in enumerate(slots):
        if r is None:
            continue
        out = trim(tokens[i].tolist(), r.max_new_tokens, eos)
        row = {"id": r.id, "prompt_ids": r.prompt_ids, "output_ids": out}
        if tokenizer is not None:
            row["text"] = tokenizer.decode(out, skip_special_tokens=True)
        rows.append(row)
    return rows


def _result(summary: dict[str, Any], job: _Job, ran: _Ran, w: Any, batch_: _Batch,
            routing: Any, profile: bool, t0: float) -> Execution:
    """The run's summary completed (requests, warnings, the profiler's op count, wall time)
    and the executed run."""
    warnings = batch_.warnings + job.warnings
    if batch_.slots is not None:
        summary["requests"] = sum(r is not None for r in batch_.slots)
    if routing is not None and summary["tokens_match"] is False:
        warnings.append("the routing recorded is the reference forward's, and the run's tokens "
                        "differ from it.")
    summary["warnings"] = warnings
    if profile:
        summary["profiled_ops"] = len(ran.ops)
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    return Execution(job.plan, job.program, job.memory, ran.run, summary, ran.ops, w, routing)


@dataclass
class QueueExecution(Executed, Shown, Traced):
    """A request list executed batch after batch, as the simulator batches it; `summary` is
    the JSON of `tg execute` on it."""

    batches: list[Execution]
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.summary

    def views(self):
        yield execute_queue_table(self.summary)
        yield from self.routing_written()
        yield from warnings_of(self.summary)

    @property
    def routing(self) -> Any:
        """The first batch's router decisions, if recorded."""
        return self.batches[0].routing if self.batches else None

    @property
    def failure(self) -> BaseException | None:
        return next((ex.failure for ex in self.batches if ex.failure is not None), None)

    def trace_runs(self) -> list[TraceRun]:
        """Each batch on one time line, one after the other as they ran."""
        runs, offset = [], 0.0
        for b, ex in enumerate(self.batches):
            run = ex.trace_run(f"batch {b} measured")
            run.offset_s = offset
            offset += ex.summary["makespan_s"]
            runs.append(run)
        return runs

    def gantt_runs(self) -> list[TraceRun]:
        return [self.batches[0].trace_run("batch 0 measured")]


def execute_queue(scenario: Scenario, device: str = "auto", weights_path: str | None = None,
                  seed: int = 0, progress: Callable[[int, int], None] | None = None,
                  zero_copy: bool = False, check: bool = True, record_routing: bool = False
                  ) -> QueueExecution:
    """Execute the scenario's request list (``workload.requests`` or ``workload.lengths``) in
    the batches the simulator packs it into (:func:`taskgraph.serving.requests.pack_scenario`:
    Algorithm 2, or padded), each request a prompt of random token ids of its own length that
    generates its own ``gen_len`` tokens (the first from prefill, as ``max_new_tokens`` counts
    them). With `check`, each request's tokens are compared with the reference forward run on
    that request alone: batching, padding and neighbours must not change what it generates.
    `record_routing` records the first batch's router decisions (``result.routing``)."""
    torch = _torch()
    from taskgraph.exec.prompts import Request as Prompt
    from taskgraph.kernels.reference import reference_forward
    from taskgraph.serving.requests import pack_scenario

    t0 = time.perf_counter()
    warnings: list[str] = []
    if scenario.workload.refill:
        warnings.append("refill is simulated only; the executor runs the list in consecutive "
                        "batches (Algorithm 2).")
        scenario = scenario.model_copy(update={
            "workload": scenario.workload.model_copy(update={"refill": False})})
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = {r.id: Prompt(r.id, torch.randint(0, scenario.model.V, (r.prompt_len,),
                                                generator=gen).tolist(), r.gen_len)
               for r in scenario.requests}
    packing = pack_scenario(scenario)
    runs: list[Execution] = []
    for b, batch in enumerate(packing.batches):
        mbs = [[prompts[r.id] for r in mb.requests] for mb in batch]
        runs.append(execute_scenario(scenario, None, device, weights_path, seed,
                                     zero_copy=zero_copy, check=check, batch=mbs,
                                     record_routing=record_routing and b == 0))
        if progress:
            progress(b + 1, len(packing.batches))
        if runs[-1].run.interrupted:
            break
    outputs = [row for ex in runs for row in ex.summary.get("outputs") or []]
    mismatched = []
    if check:
        for row in outputs:
            p = prompts[row["id"]]
            alone = reference_forward(runs[0].weights.dequantized(),
                                      torch.tensor([p.prompt_ids]), 1,
                                      max(1, p.max_new_tokens - 1))
            if alone.tokens[0, :p.max_new_tokens].tolist() != row["output_ids"]:
                mismatched.append(row["id"])
    makespan = sum(ex.summary["makespan_s"] for ex in runs)
    tokens = sum(len(row["output_ids"]) for row in outputs)
    first = runs[0].summary
    summary = {k: first[k] for k in ("scenario", "schedule", "schedule_title", "model",
                                     "hardware", "device", "dtype")}
    summary.update({
        "policy": scenario.policy.model_dump(),
        "throughput_tok_s": round(tokens / makespan, 6) if makespan else 0.0,
        "makespan_s": round(makespan, 6),
        "measured": True,
        "requests": {"count": len(scenario.requests), "executed": len(outputs),
                     "batches": len(runs), "generated_tokens": tokens,
                     "padded": packing.padded,
                     "aborted": [r.id for r in packing.aborted]},
        "tokens_match": all(ex.summary["tokens_match"] for ex in runs) if check else None,
        "requests_match_alone": (not mismatched) if check else None,
        "mismatched": mismatched,
        "outputs": outputs,
        "interrupted": any(ex.run.interrupted for ex in runs),
        "warnings": warnings + sorted({w for ex in runs for w in ex.summary["warnings"]}),
        "wall_s": round(time.perf_counter() - t0, 3),
    })
    return QueueExecution(runs, summary)
