"""A multi-GPU plan run as one process per GPU, talking through ``torch.distributed``: gloo on
the CPU backend, NCCL with each process on a CUDA device of its own.

Every process builds the same plan and compiled program and runs only its own GPU's streams
(``gpu:r``, ``h2d:r`` ...) and the shared streams its GPU takes part in:

* pipeline parallelism (PP): the stream of the stage that sends to it, as the receiver: a
  ``Send`` task is ``dist.send`` on the sender and ``dist.recv`` on the receiver, into the same
  buffer the receiver's tasks read. Each pair of ranks exchanges messages on one thread per
  direction, in launch order on both ends, so messages pair up without tags.
* tensor parallelism: its own host streams (``cpu:r``, ``pin:r``: its heads' CPU attention,
  its part of each page's staging copy), and the interconnect stream, whose collectives every
  rank calls in the same launch order (``all_reduce``, ``all_gather``).

The builder guarantees that GPUs meet only through sends or collectives (tested),
so nothing else crosses between processes. The last rank returns the outputs; every rank its own
task times, which line up because ``time.perf_counter`` is one monotonic clock for the machine.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taskgraph.dag.builder import Plan
from taskgraph.dag.compiled import compile_plan
from taskgraph.errors import TgError
from taskgraph.exec.dispatch import CudaDevice, execute
from taskgraph.exec.runtime import Runtime
from taskgraph.files import Terminated, sigterm_raises
from taskgraph.kernels.weights import ModelWeights
from taskgraph.kinds import COLLECTIVES, KIND_NAMES, SENDS
from taskgraph.sim.engine import SimRun


@dataclass
class DistributedRun:
    tokens: torch.Tensor      # [N, G + 1], from the last stage
    logits: torch.Tensor      # [N, V] of the last step
    hidden: torch.Tensor
    start: np.ndarray         # per task, seconds from the earliest task's start
    end: np.ndarray
    ranks: int
    wall_s: float
    rank_start: np.ndarray    # [ranks, tasks]: what each process measured (NaN: not its task)
    rank_end: np.ndarray
    interrupted: bool = False  # Ctrl-C: the times cover what ran before it, there are no outputs

    def as_run(self, program) -> SimRun:
        """The task times as the one-process executor reports them."""
        durations = np.nan_to_num(self.end - self.start)
        return SimRun(program, durations, self.start, self.end, self.interrupted, self.wall_s)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens, self.logits, self.hidden


class _Stage:
    """One rank's runtime: what the dispatcher calls, with sends turned into messages.

    Each direction between two stages has a process group of its own, used on each end by one
    thread (the sender's interconnect stream), in launch order: NCCL needs every rank to issue a
    communicator's operations in one order, and a stage that sends and receives on one group
    from two threads would not."""

    def __init__(self, runtime: Runtime, plan: Plan, rank: int):
        import torch.distributed as dist

        self.rt, self.plan, self.rank, self.dist = runtime, plan, rank, dist
        # every rank creates every group, in one order (torch.distributed's rule)
        self.groups = [dist.new_group(sorted({g, (g + 1) % plan.pp})) for g in range(plan.pp)]

    def run(self, step: int, kind: str, layer: int, index: int, gpu: int = -1) -> None:
        if kind not in SENDS:
            self.rt.run(step, kind, layer, index)
            return
        sender = self.plan.stage_of(layer)
        peer, group = (sender + 1) % self.plan.pp, self.groups[sender]
        for buf in self._payload(step, kind, index):
            if self.rank == sender:
                self.dist.send(buf.contiguous(), dst=peer, group=group)
            else:
                tmp = torch.empty_like(buf)
                self.dist.recv(tmp, src=sender, group=group)
                buf.copy_(tmp)

    def _payload(self, step: int, kind: str, j: int) -> list[torch.Tensor]:
        rt = self.rt
        if kind == "Send":                 # the hidden state the next stage's layers read
            return [rt.x_prefill[j] if step == 0 else rt.x[j]]
        rows = slice(j * rt.mu, (j + 1) * rt.mu)
        # the next step's input (the sampled tokens' embeddings), and the tokens for the record
        return [rt.x[j], rt.tokens[rows, step]]


def _owner(stream: str) -> int:
    """The rank whose process runs a stream (its GPU); -1 for the host's."""
    base, _, gpu = stream.partition(":")
    return int(gpu) if gpu else -1


class _Shard:
    """One rank's shard under tensor parallelism, its collectives over torch.distributed."""

    def __init__(self, runtime, plan: Plan):
        import torch.distributed as dist

        self.rt, self.plan, self.dist = runtime, plan, dist

    def run(self, step: int, kind: str, layer: int, index: int, gpu: int = -1) -> None:
        rt = self.rt
        if kind == "GatherLogits":
            parts = [torch.empty_like(rt.logit_part[index]) for _ in range(self.plan.tp)]
            self.dist.all_gather(parts, rt.logit_part[index])
            rt.take(step, index, torch.cat(parts, dim=-1))
        elif kind in COLLECTIVES:
            total = rt.partial(step, index, kind)
            self.dist.all_reduce(total)
            rt.add(step, index, total, kind)
        else:
            rt.run(step, kind, layer, index)


def _rank_streams(plan: Plan, rank: int) -> frozenset[str]:
    if plan.tp > 1:
        return frozenset(s for s in plan.streams if s.endswith(f":{rank}") or ":" not in s)
    sender = (rank - 1) % plan.pp
    return frozenset(s for s in plan.streams
                     if s.endswith(f":{rank}") or s == f"peer:{sender}")


def _worker(rank: int, plan: Plan, weights: ModelWeights, prompts: torch.Tensor,
            prompt_lens: torch.Tensor | None, rendezvous: str, out: str, delay_s: float,
            seed: int, device: str, parent: int) -> None:
    import torch.distributed as dist

    # Ctrl-C reaches the parent only, which passes it on to each rank once (`_wind_down`): a
    # rank hit twice could die before saving what it measured.
    os.setpgrp()
    # Started with Ctrl-C ignored (see `_spawn_and_join`); out of the terminal's group, it
    # listens.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A rank whose parent is gone has no one to report to, and a rank blocked on a peer could
    # outlive it: SIGKILL then, and a parent already gone is seen here.
    set_pdeathsig = getattr(torch.multiprocessing, "_prctl_pr_set_pdeathsig", None)
    if set_pdeathsig is not None:
        set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent or (Path(out) / "stop").exists():   # ended while this one started
        return
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    try:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}",
                                rank=rank, world_size=plan.gpus)
        kw = {"prompt_lens": prompt_lens, "pin_memory": cuda}
        if plan.tp > 1:
            from taskgraph.exec.tensor import ShardRuntime, make_shard

            shard, w = make_shard(plan, weights, rank)
            runtime = _Shard(ShardRuntime(plan, w, prompts, dev, shard, **kw), plan)
        else:
            runtime = _Stage(Runtime(plan, weights, prompts, dev, **kw), plan, rank)
        program = compile_plan(plan)
        delays = np.random.default_rng(seed + rank).random(program.total) * delay_s
        run = execute(program, runtime, CudaDevice(torch) if cuda else None,
                      delay=(lambda gid: float(delays[gid])) if delay_s else None,
                      progress=lambda d: _report(Path(out) / f"rank{rank}.segment", d),
                      streams=_rank_streams(plan, rank))
        if run.failure is not None:
            raise run.failure
        result: dict[str, Any] = {"start": run.start + run.clock_origin,
                                  "end": run.end + run.clock_origin}
        if rank == plan.gpus - 1 and not run.interrupted:
            tokens, logits, hidden = runtime.rt.outputs()
            result.update(tokens=tokens, logits=logits, hidden=hidden)
        _save(result, Path(out) / f"rank{rank}.npz")
        if run.interrupted:
            # Ctrl-C reached every process: a peer may have stopped before sending what this
            # one's receiving thread waits for, so the group is not torn down (that would wait).
            os._exit(0)
    except Exception as err:
        # For the parent, which reports the earliest failure, not the broken connections it
        # leaves behind. The process ends at once: one of its threads may be blocked receiving
        # from a peer that waits for it, and tearing the process group down would wait too.
        (Path(out) / f"rank{rank}.err").write_text(
            f"{time.time()!r}\n{type(err).__name__}: {err}")
        os._exit(1)
    dist.destroy_process_group()


def _report(path: Path, segment: int) -> None:
    """Where a rank is: the segment its first stream has entered (so segment 1 means every task
    of its prefill on that stream has run), written whole for whoever watches the run."""
    part = path.with_suffix(".part")
    part.write_text(str(segment))
    part.replace(path)


def _save(result: dict[str, Any], path: Path) -> None:
    """Whole or not at all: the parent may read the folder after an interrupt. NumPy arrays
    without pickles, so reading a rank's file cannot run code; a tensor keeps its dtype's name
    beside it (NumPy has no bfloat16: it travels as float32, which holds it exactly)."""
    arrays = {}
    for name, value in result.items():
        if isinstance(value, torch.Tensor):
            arrays[f"{name}.dtype"] = np.array(str(value.dtype).removeprefix("torch."))
            value = value.detach().cpu()
            value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
        arrays[name] = value
    part = path.with_suffix(".part")
    with open(part, "wb") as f:
        np.savez(f, **arrays)
    part.replace(path)


def _first_failure(folder: Path, ranks: int) -> str:
    """The error of the rank that failed first: a rank whose peer died fails too, later, with a
    broken connection or a timeout."""
    errors = []
    for r in range(ranks):
        path = folder / f"rank{r}.err"
        if path.exists():
            when, _, text = path.read_text().partition("\n")
            errors.append((float(when), r, text.strip().splitlines()[0] if text.strip() else ""))
    if not errors:
        return f"A process of {ranks} failed: it exited without saying why."
    _, rank, text = min(errors)
    return f"The process of GPU {rank} of {ranks} failed: {text}"


def execute_processes(plan: Plan, weights: ModelWeights, prompts: torch.Tensor,
                      prompt_lens: torch.Tensor | None = None, delay_s: float = 0.0,
                      seed: int = 0, device: str = "cpu") -> DistributedRun:
    """Run a multi-GPU plan as one process per GPU: on the CPU backend over gloo, or with
    ``device="cuda"`` each process on its own GPU (``cuda:rank``) over NCCL. `delay_s`: each
    task first sleeps up to that long, at random (to shake out races)."""
    _check_runnable(plan, device)
    program = compile_plan(plan)
    host = [s for s in program.streams if _owner(s) < 0 and s != "peer"]
    if plan.pp > 1 and np.isin(program.column("stream"),
                               [program.streams.index(s) for s in host]).any():
        raise TgError(f"Schedule {plan.schedule.name} runs tasks on the host's streams "
                      f"({', '.join(host)}), which no stage's process owns.")
    with tempfile.TemporaryDirectory(prefix="tg-dist-") as tmp:
        t0 = time.perf_counter()
        interrupted = _spawn_and_join(plan.gpus, Path(tmp), (
            plan, weights, prompts, prompt_lens, os.path.join(tmp, "rendezvous"), tmp, delay_s,
            seed, device, os.getpid()))
        wall = time.perf_counter() - t0
        results = [_load(Path(tmp) / f"rank{r}.npz", program.total) for r in range(plan.gpus)]
    return _merged(plan, program, results, wall, interrupted)


def _check_runnable(plan: Plan, device: str) -> None:
    """Refuse what a run in processes cannot do, before any process starts."""
    if plan.gpus < 2:
        raise TgError(f"hardware.gpu.count is {plan.gpus}: there is no second GPU to run as a "
                      "process of its own.")
    if device == "cuda" and torch.cuda.device_count() < plan.gpus:
        raise TgError(f"hardware.gpu.count is {plan.gpus}, but this machine has "
                      f"{torch.cuda.device_count()} CUDA device(s): --processes --device cuda "
                      "runs each GPU of the plan on a GPU of its own.")
    if plan.dp > 1:
        raise TgError(f"Schedule {plan.schedule.name} ({plan.schedule.title}) runs data "
                      "parallel: --processes runs tensor-parallel and pipeline schedules only "
                      "so far. Run it in one process (drop --processes).")
    if plan.tp > 1:
        from taskgraph.exec.tensor import check_shardable

        check_shardable(plan.scenario.model, plan.tp)


def _spawn_and_join(ranks_n: int, tmp: Path, args: tuple) -> bool:
    """Start a process per rank (`_worker` with `args`) and wait for them all; True if a
    Ctrl-C stopped them (each saved what it measured). A failing rank is a TgError naming
    the first failure; a SIGTERM ends the ranks and then this process."""
    import multiprocessing

    # Each rank's arguments are pickled before any rank starts, into a file it reads once
    # running: with torch's reductions (`import torch` registers them) its tensors move into
    # shared memory once, and each rank gets handles of its own (a handle is served once). A
    # rank then starts in milliseconds.
    for rank in range(ranks_n):
        (tmp / f"rank{rank}.args").write_bytes(
            multiprocessing.reduction.ForkingPickler.dumps((rank, *args)))
    # The ranks start deaf to Ctrl-C (a start-up interrupted in an import leaves a
    # traceback); each listens once it is running (`_worker`), and the parent passes a Ctrl-C
    # on to each once (`_wind_down`). Deaf means started with SIGINT ignored, which a process
    # keeps across exec: a blocked signal mask is not kept by multiprocessing's spawn, and under
    # load ranks died in their imports with KeyboardInterrupt tracebacks. The parent ignores it
    # too for as long as it starts them (a fork and an exec each): a Ctrl-C in those
    # milliseconds is lost, and the run goes on to its end.
    main = threading.current_thread() is threading.main_thread()
    came: list[int] = []
    interrupted, ranks = False, []
    # SIGTERM ends the ranks with the parent (left to themselves they ran on) and the
    # parent with its usual status, its temporary folder removed on the way out.
    with sigterm_raises(_Terminated) as terminated:
        try:
            # A SIGTERM while a rank starts is noted too: raised there, it cut the rank's
            # start-up data short and the rank died with a traceback (seen under load).
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
            if terminated:
                signal.signal(signal.SIGTERM, lambda sig, _: came.append(sig))
            try:
                spawn = multiprocessing.get_context("spawn")
                for rank in range(ranks_n):
                    proc = spawn.Process(target=_rank, args=(str(tmp / f"rank{rank}.args"),),
                                         name=f"tg-rank{rank}")
                    proc.start()
                    ranks.append(proc)
            finally:
                if main:
                    signal.signal(signal.SIGINT, previous)
                if terminated:
                    signal.signal(signal.SIGTERM, terminated)
            if came:
                raise _Terminated
            _join(ranks, tmp)
        except KeyboardInterrupt:
            interrupted = True
            _wind_down(ranks, tmp)
        except _Terminated:
            _wind_down(ranks, tmp, grace_s=0.0)
            raise Terminated(signal.SIGTERM) from None
        except BaseException:
            _wind_down(ranks, tmp, grace_s=0.0)
            raise
    return interrupted


def _rank(args_path: str) -> None:
    """A rank's process: its arguments read from the file the parent wrote, then its run."""
    import pickle

    with open(args_path, "rb") as f:
        rank, *args = pickle.load(f)
    _worker(rank, *args)


def _join(ranks: list, folder: Path) -> None:
    """Wait for every rank to end; the first to fail ends the others, and is reported (the
    earliest failure any rank wrote, not the broken connections it left its peers)."""
    from multiprocessing.connection import wait

    running = list(ranks)
    while running:
        wait([proc.sentinel for proc in running])
        for proc in [p for p in running if not p.is_alive()]:
            running.remove(proc)
            if proc.exitcode != 0:
                for other in running:
                    other.kill()
                    other.join()
                raise TgError(_first_failure(folder, len(ranks)))


def _merged(plan: Plan, program: Any, results: list[dict[str, Any]], wall: float,
            interrupted: bool) -> DistributedRun:
    """Every rank's times as one run's, and the last rank's outputs.

    A GPU's stream is its rank's (the suffix). A task every rank runs its part of (a host task,
    a collective) spans from the last part's start to the last part's end: after everything any
    part waited for. A send ran on both ends (pipelines only): it starts when the sender starts
    it and ends when the receiver holds the data, or the sender's call returns if that is
    sooner (either end may finish first), so it neither ends after what reads it starts nor
    overlaps the sender's next send."""
    owner = np.array([max(_owner(s), 0) for s in program.streams])
    rank, ids = owner[program.column("stream")], np.arange(program.total)
    starts = np.stack([r["start"] for r in results])
    ends = np.stack([r["end"] for r in results])
    start, end = starts[rank, ids], ends[rank, ids]
    shared = np.array([_owner(s) < 0 for s in program.streams])[program.column("stream")]
    if plan.tp > 1:
        start[shared] = starts[:, shared].max(axis=0)
        end[shared] = ends[:, shared].max(axis=0)
    receiver = (rank + 1) % plan.gpus
    sends = np.isin(program.column("kind"), [KIND_NAMES.index(k) for k in SENDS])
    end[sends] = np.minimum(end, ends[receiver, ids])[sends]
    start[np.isnan(end)] = np.nan
    t0 = np.nanmin(start) if np.isfinite(start).any() else 0.0
    tokens, logits, hidden = results[-1].get("outputs") or (None, None, None)
    return DistributedRun(tokens, logits, hidden, start - t0, end - t0, plan.gpus, wall,
                          starts - t0, ends - t0, interrupted)


class _Terminated(Exception):
    pass


def _wind_down(processes, folder: Path, grace_s: float = 10.0) -> None:
    """Interrupt every rank once, let each save what it measured, as the one-process executor
    does (its run gives blocked threads 5 s), then end whatever is left."""
    (folder / "stop").touch()               # before the signal: see `_worker`
    for rank, proc in enumerate(processes):
        if not (folder / f"rank{rank}.segment").exists():
            proc.kill()      # still starting (deaf to Ctrl-C, seconds in imports): ran nothing
        elif proc.is_alive():
            os.kill(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in processes:
        while proc.is_alive() and time.monotonic() < deadline:
            try:
                proc.join(0.1)
            except KeyboardInterrupt:     # a second Ctrl-C: stop waiting
                deadline = 0.0
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _load(path: Path, total: int) -> dict[str, Any]:
    """A rank's times (and the last rank's outputs, as tensors); a rank that saved nothing
    (interrupted before it ran) ran nothing."""
    if not path.exists():
        return {"start": np.full(total, np.nan), "end": np.full(total, np.nan)}
    with np.load(path, allow_pickle=False) as f:
        out = {k: f[k] for k in f.files if not k.endswith(".dtype")}
        for k in f.files:
            if k.endswith(".dtype"):
                name = k.removesuffix(".dtype")
                out[name] = torch.from_numpy(out[name]).to(getattr(torch, str(f[k])))
    if "tokens" in out:
        out["outputs"] = (out.pop("tokens"), out.pop("logits"), out.pop("hidden"))
    return out
