"""Scenario in, executed run out: the same plan and compiled graph the simulator uses, run with
real kernels, checked against the sequential reference forward.

This is the library entry point behind `tg execute`. It needs PyTorch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError
from rich.text import Text

from taskgraph.builder import make_plan
from taskgraph.compiled import compile_plan
from taskgraph.errors import TgError
from taskgraph.memory import check_fits, memory_footprint
from taskgraph.report import Shown, execute_queue_table, execute_table, warnings_of
from taskgraph.sim.metrics import summarize
from taskgraph.simulation import Simulation
from taskgraph.specs import ModelSpec, Scenario
from taskgraph.tracing.writer import Traced, TraceRun


@dataclass
class Execution(Simulation):
    """An executed run: the same fields as a simulated one, traced as "measured", with what the
    PyTorch profiler saw inside it when it ran under ``--profile``."""

    ops: list = field(default_factory=list)
    weights: Any = None           # what ran: the reference forward can be re-run on them

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
        yield from warnings_of(self.summary)

    def write_outputs(self, path: str) -> None:
        _write_outputs(self.summary, path)

    @property
    def failure(self) -> BaseException | None:
        """The exception a task raised, if one did (the run stopped there)."""
        return self.run.failure


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


# Fields of a checkpoint's config.json that change what is computed but not its shape: with
# --weights they come from the checkpoint, whatever the scenario's model says.
_MATH_FIELDS = ("rope_theta", "rope_type", "rope_scaling_factor", "rms_norm_eps",
                "tie_word_embeddings", "sliding_window", "hidden_act", "architecture", "dtype",
                "dtype_bytes")
_SHAPE_FIELDS = ("h", "h_i", "n_q", "n_kv", "d", "E", "k", "V")


def checkpoint_model(model: ModelSpec, folder: str | Path) -> tuple[ModelSpec, list[str]]:
    """The scenario's model made to agree with a checkpoint's config.json: shapes must match,
    the fields that change the math come from the checkpoint, and running fewer layers than it
    holds is said, not silent. Returns the model and the warnings to show."""
    from taskgraph.scenario import model_from_hf_config

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
    if m.architecture != "mixtral":
        raise TgError(f"model.architecture = {m.architecture}: tg execute computes Mixtral-style "
                      "layers (RMSNorm, separate q/k/v, SwiGLU experts); DBRX checkpoints (fused "
                      "Wqkv, LayerNorm, clipped QKV) can be simulated but not executed.")
    if m.hidden_act != "silu":
        raise TgError(f"model.hidden_act = {m.hidden_act}: the experts' kernels compute SwiGLU "
                      "with SiLU only.")
    if m.rope_type not in ("default", "linear"):
        raise TgError(f"model.rope_type = {m.rope_type}: tg computes the default and linear "
                      "RoPE scalings only.")
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
    from taskgraph.schedules import SCHEDULES

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


_last_weights: dict[tuple, Any] = {}


def _check_processes(plan, zero_copy: bool, profile: bool, last_steps) -> None:
    if plan.gpus < 2:
        raise TgError(
            f"--processes runs each GPU as its own process; hardware.gpu.count is "
            f"{plan.gpus}. Set it to 2 or more (--set hardware.gpu.count=2).")
    for bad, what in ((zero_copy, "--zero-copy"), (profile, "--profile"),
                      (last_steps is not None, "a request list")):
        if bad:
            raise TgError(f"--processes does not combine with {what}.")


def _synthetic_weights(m: ModelSpec, seed: int, dtype) -> Any:
    """Random weights, kept for the next run of the same model: validate and calibrate execute
    one model many times, and a Mixtral layer takes seconds to draw. The last model's weights
    stay in memory until another model is drawn."""
    from taskgraph.kernels.weights import synthetic_weights

    key = (m.model_dump_json(), seed, dtype)
    if key not in _last_weights:
        _last_weights.clear()          # one model at a time: they can be tens of GB
        _last_weights[key] = synthetic_weights(m, seed=seed, dtype=dtype)
    return _last_weights[key]


def execute_scenario(scenario: Scenario, schedule: str | None = None, device: str = "auto",
                     weights_path: str | None = None, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None,
                     prompts_path: str | None = None, zero_copy: bool = False,
                     check: bool = True, profile: bool = False,
                     batch: list[list] | None = None, processes: bool = False) -> Execution:
    """Execute a scenario's schedule for real and compare it with the reference forward
    (unless `check` is False: calibration runs only want the timings). `profile` runs it under
    the PyTorch profiler and keeps the ops it saw (:mod:`taskgraph.exec.profiling`). With
    `prompts_path`, run those requests (see :mod:`taskgraph.exec.prompts`) and put what each
    generated in ``summary["outputs"]``; `batch` runs given requests (``exec.prompts.Request``)
    as those micro-batches instead (:func:`execute_queue` runs a request list batch by batch).
    `zero_copy` (CPU only) makes every transfer a no-op over shared buffers
    (:class:`taskgraph.exec.runtime.Runtime`). `processes` runs each GPU of a multi-GPU plan as
    a process of its own over torch.distributed (:mod:`taskgraph.exec.distributed`)."""
    torch = _torch()
    from taskgraph.exec.dispatch import CudaDevice, HostDevice, execute
    from taskgraph.exec.prompts import eos_ids, load_tokenizer, read_prompts, trim
    from taskgraph.exec.runtime import Runtime
    from taskgraph.kernels.reference import reference_forward, synthetic_prompts
    from taskgraph.kernels.weights import load_mixtral_safetensors

    t0 = time.perf_counter()
    dev = pick_device(device)
    if zero_copy and dev != "cpu":
        raise TgError("--zero-copy makes the CPU backend a CPU inference engine (host and "
                      f"device buffers shared); it does not apply to --device {dev}.")
    warnings: list[str] = []
    if weights_path:
        model, warnings = checkpoint_model(scenario.model, weights_path)
        scenario = scenario.model_copy(update={"model": model})
    slots, tokenizer = None, None
    if prompts_path:
        tokenizer = load_tokenizer(weights_path)
        requests = read_prompts(prompts_path, scenario.model.V, scenario.workload.gen_len,
                                tokenizer)
        scenario, slots = _for_requests(scenario, schedule, requests)
    elif batch is not None:
        scenario, slots = _for_batch(scenario, schedule, batch, scenario.policy.mu)
    m, p = scenario.model, scenario.policy
    check_computable(m, scenario.workload.context_prompt + scenario.workload.gen_len)
    dtype, more = _torch_dtype(torch, m, dev)
    warnings += more
    plan = make_plan(scenario, schedule)
    if plan.tp > 1:
        from taskgraph.exec.tensor import check_shardable

        check_shardable(m, plan.tp)
    memory = memory_footprint(plan)
    warnings += check_fits(memory, plan.schedule.name)
    if dev == "cpu":
        _check_host_memory(memory.gpu_total + memory.cpu_total)
    program = compile_plan(plan)
    w = (load_mixtral_safetensors(weights_path, m, dtype) if weights_path
         else _synthetic_weights(m, seed, dtype))
    P = scenario.workload.context_prompt
    if slots is None:
        prompts, lens = synthetic_prompts(p.N, P, m.V, seed=seed + 1), None
    else:
        prompts = torch.zeros(p.N, P, dtype=torch.long)
        lens = torch.ones(p.N, dtype=torch.long)      # fillers: one token
        for i, r in enumerate(slots):
            if r is not None:
                prompts[i, :len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
                lens[i] = len(r.prompt_ids)
    # A batch of a request list skips what the simulator skips: a micro-batch's tasks after its
    # last request's last step, and every task of a micro-batch holding no request.
    last_steps = None
    if batch is not None:
        last_steps = [max((r.max_new_tokens - 1 for r in slots[j * p.mu:(j + 1) * p.mu]
                           if r is not None), default=-1) for j in range(p.N // p.mu)]
    if processes:
        _check_processes(plan, zero_copy, profile, last_steps)
    # Several GPUs in one process: every GPU's shard on this device (TensorParallel), or each
    # pipeline stage's buffers in the one Runtime.
    make_runtime: Any = Runtime
    if plan.tp > 1:
        from taskgraph.exec.tensor import TensorParallel as make_runtime
    runtime = None if processes else make_runtime(
        plan, w, prompts, torch.device(dev), pin_memory=dev == "cuda", prompt_lens=lens,
        zero_copy=zero_copy, last_steps=last_steps)
    total = len(program.seg_template)
    ranks = None

    def run_it(annotate: bool = False):
        nonlocal ranks
        if processes:
            from taskgraph.exec.distributed import execute_processes

            ranks = execute_processes(plan, w, prompts, prompt_lens=lens, device=dev)
            return ranks.as_run(program)
        return execute(program, runtime, CudaDevice(torch) if dev == "cuda" else HostDevice(),
                       progress=(lambda d: progress(d, total)) if progress else None,
                       annotate=annotate)

    ops: list = []
    if profile:
        from taskgraph.exec.profiling import profile_run

        run, ops = profile_run(lambda: run_it(annotate=True), cuda=dev == "cuda")
    else:
        run = run_it()
    summary = summarize(run, memory)
    # The hardware limit describes the modelled machine, not the one this ran on.
    del summary["hardware_limit_tok_s"], summary["hardware_limit_fraction"]
    summary["device"] = dev
    summary["dtype"] = str(dtype).removeprefix("torch.")
    summary["measured"] = True
    summary["zero_copy"] = zero_copy
    summary["max_abs_err"] = summary["tokens_match"] = None
    if check and not run.interrupted:
        ref = reference_forward(w, prompts, p.mu, plan.G, lens)   # on the host, sequentially
        tokens, logits, _ = (ranks or runtime).outputs()
        if last_steps is None:
            summary["max_abs_err"] = float((logits.float() - ref.logits.float()).abs().max())
            summary["tokens_match"] = bool(torch.equal(tokens, ref.tokens))
        else:   # what each request generated; final logits where its micro-batch ran to the end
            full = [i for i in range(p.N) if last_steps[i // p.mu] == plan.G]
            summary["max_abs_err"] = float((logits[full].float() - ref.logits[full].float())
                                           .abs().max()) if full else 0.0
            summary["tokens_match"] = all(
                torch.equal(tokens[i, :r.max_new_tokens], ref.tokens[i, :r.max_new_tokens])
                for i, r in enumerate(slots) if r is not None)
        if slots is not None:
            eos = eos_ids(weights_path)
            summary["outputs"] = []
            for i, r in enumerate(slots):
                if r is None:
                    continue
                out = trim(tokens[i].tolist(), r.max_new_tokens, eos)
                row = {"id": r.id, "prompt_ids": r.prompt_ids, "output_ids": out}
                if tokenizer is not None:
                    row["text"] = tokenizer.decode(out, skip_special_tokens=True)
                summary["outputs"].append(row)
    if slots is not None:
        summary["requests"] = sum(r is not None for r in slots)
    summary["warnings"] = warnings
    if profile:
        summary["profiled_ops"] = len(ops)
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    return Execution(plan, program, memory, run, summary, ops, w)


@dataclass
class QueueExecution(Shown, Traced):
    """A request list executed batch after batch, as the simulator batches it; `summary` is
    the JSON of `tg execute` on it."""

    batches: list[Execution]
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.summary

    def views(self):
        yield execute_queue_table(self.summary)
        yield from warnings_of(self.summary)

    def write_outputs(self, path: str) -> None:
        _write_outputs(self.summary, path)

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
                  zero_copy: bool = False, check: bool = True) -> QueueExecution:
    """Execute the scenario's request list (``workload.requests`` or ``workload.lengths``) in
    the batches the simulator packs it into (:func:`taskgraph.serving.requests.pack_scenario`:
    Algorithm 2, or padded), each request a prompt of random token ids of its own length that
    generates its own ``gen_len`` tokens (the first from prefill, as ``max_new_tokens`` counts
    them). With `check`, each request's tokens are compared with the reference forward run on
    that request alone: batching, padding and neighbours must not change what it generates."""
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
                                     zero_copy=zero_copy, check=check, batch=mbs))
        if progress:
            progress(b + 1, len(packing.batches))
        if runs[-1].run.interrupted:
            break
    outputs = [row for ex in runs for row in ex.summary.get("outputs") or []]
    mismatched = []
    if check:
        for row in outputs:
            p = prompts[row["id"]]
            alone = reference_forward(runs[0].weights, torch.tensor([p.prompt_ids]), 1,
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
