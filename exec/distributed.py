"""A pipeline-parallel plan run as one process per GPU, its stages talking through
``torch.distributed`` (gloo, so it runs on the CPU backend).

Every process builds the same plan and compiled program and runs only its own GPU's streams
(``gpu:r``, ``h2d:r``, ``peer:r`` ...) plus, as a receiver, the stream of the stage that sends to
it: a ``Send`` task is ``dist.send`` on the sender and ``dist.recv`` on the receiver, into the
same buffer the receiver's tasks read. The builder guarantees that stages meet only through sends
(tested), so nothing else crosses between processes. Each pair of ranks exchanges messages on one
thread per direction, in launch order on both ends, so messages pair up without tags.

Only the last stage samples tokens, so it returns the outputs; every rank returns its own task
times, which line up because ``time.perf_counter`` is one monotonic clock for the machine.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taskgraph.builder import Plan
from taskgraph.compiled import KIND_NAMES, compile_plan
from taskgraph.errors import TgError
from taskgraph.exec.dispatch import execute
from taskgraph.exec.runtime import Runtime
from taskgraph.kernels.weights import ModelWeights
from taskgraph.sim.engine import SimRun
from taskgraph.work import SENDS


@dataclass
class DistributedRun:
    tokens: torch.Tensor      # [N, G + 1], from the last stage
    logits: torch.Tensor      # [N, V] of the last step
    hidden: torch.Tensor
    start: np.ndarray         # per task, seconds from the earliest task's start
    end: np.ndarray
    ranks: int
    wall_s: float

    def as_run(self, program) -> SimRun:
        """The task times as the one-process executor reports them."""
        return SimRun(program, self.end - self.start, self.start, self.end, False, self.wall_s)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens, self.logits, self.hidden


class _Stage:
    """One rank's runtime: what the dispatcher calls, with sends turned into messages."""

    def __init__(self, runtime: Runtime, plan: Plan, rank: int):
        import torch.distributed as dist

        self.rt, self.plan, self.rank, self.dist = runtime, plan, rank, dist

    def run(self, step: int, kind: str, layer: int, index: int) -> None:
        if kind not in SENDS:
            self.rt.run(step, kind, layer, index)
            return
        sender = self.plan.stage_of(layer)
        peer = (sender + 1) % self.plan.pp
        for buf in self._payload(step, kind, index):
            if self.rank == sender:
                self.dist.send(buf.contiguous(), dst=peer)
            else:
                tmp = torch.empty_like(buf)
                self.dist.recv(tmp, src=sender)
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


def _rank_streams(plan: Plan, rank: int) -> frozenset[str]:
    sender = (rank - 1) % plan.pp
    return frozenset(s for s in plan.streams
                     if s.endswith(f":{rank}") or s == f"peer:{sender}")


def _worker(rank: int, plan: Plan, weights: ModelWeights, prompts: torch.Tensor,
            prompt_lens: torch.Tensor | None, rendezvous: str, out: str, delay_s: float,
            seed: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=plan.pp)
    try:
        runtime = Runtime(plan, weights, prompts, torch.device("cpu"), prompt_lens=prompt_lens)
        rng = np.random.default_rng(seed + rank)
        delays = rng.random(compile_plan(plan).total) * delay_s
        program = compile_plan(plan)
        run = execute(program, _Stage(runtime, plan, rank),
                      delay=(lambda gid: float(delays[gid])) if delay_s else None,
                      streams=_rank_streams(plan, rank))
        if run.failure is not None:
            raise run.failure
        result: dict[str, Any] = {"start": run.start + run.clock_origin,
                                  "end": run.end + run.clock_origin}
        if rank == plan.pp - 1:
            result["outputs"] = runtime.outputs()
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def execute_pipeline(plan: Plan, weights: ModelWeights, prompts: torch.Tensor,
                     prompt_lens: torch.Tensor | None = None, delay_s: float = 0.0,
                     seed: int = 0) -> DistributedRun:
    """Run a pipeline schedule's plan as one process per stage (CPU backend, gloo). `delay_s`:
    each task first sleeps up to that long, at random (to shake out races)."""
    if plan.pp < 2:
        raise TgError(f"Schedule {plan.schedule.name} on hardware.gpu.count = {plan.gpus} has no "
                      "pipeline stages to run as processes; choose PP on several GPUs.")
    program = compile_plan(plan)
    host = [s for s in program.streams if _owner(s) < 0]
    if np.isin(program.column("stream"), [program.streams.index(s) for s in host]).any():
        raise TgError(f"Schedule {plan.schedule.name} runs tasks on the host's streams "
                      f"({', '.join(host)}), which no stage's process owns.")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tg-dist-") as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(plan, weights, prompts, prompt_lens, rendezvous, tmp, delay_s,
                                seed), nprocs=plan.pp, join=True)
        wall = time.perf_counter() - t0
        results = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False)
                   for r in range(plan.pp)]
    # Every stream is one rank's (its suffix). A send ran on both ends: it starts when the
    # sender starts it and ends when the receiver holds the data, or the sender's call returns
    # if that is sooner (either end may finish first), so it neither ends after what reads it
    # starts nor overlaps the sender's next send.
    owner = np.array([_owner(s) for s in program.streams])
    rank, ids = owner[program.column("stream")], np.arange(program.total)
    starts = np.stack([r["start"] for r in results])
    ends = np.stack([r["end"] for r in results])
    start, end = starts[rank, ids], ends[rank, ids]
    receiver = (rank + 1) % plan.pp
    sends = np.isin(program.column("kind"), [KIND_NAMES.index(k) for k in SENDS])
    end[sends] = np.minimum(end, ends[receiver, ids])[sends]
    t0 = np.nanmin(start)
    tokens, logits, hidden = results[-1]["outputs"]
    return DistributedRun(tokens, logits, hidden, start - t0, end - t0, plan.pp, wall)
