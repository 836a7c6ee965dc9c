"""Which sequences a run executes: synthetic prompts of the workload's shape, a prompts file's
requests, or given micro-batches of a request list; the scenario sized to them, the prompts as
tensors, and each request's output read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from taskgraph.errors import TgError
from taskgraph.exec.loading import checkpoint_model, max_positions, need_torch
from taskgraph.specs import Scenario


def for_requests(scenario: Scenario, schedule: str | None, requests: list
                  ) -> tuple[Scenario, list]:
    """The scenario resized to run these requests in one batch, in order: N the request count
    rounded up to whole micro-batches, and to as many as the schedule needs. Returns it with
    each sequence slot's request (None: a filler, whose output is dropped)."""
    mu = min(scenario.policy.mu, len(requests))
    return for_batch(scenario, schedule, [requests[i:i + mu]
                                           for i in range(0, len(requests), mu)], mu)


def for_batch(scenario: Scenario, schedule: str | None, batch: list[list], mu: int
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


def check_positions(scenario: Scenario, slots: list | None, limit: int) -> None:
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
class SharedBatches:
    """What the batches of a run over many prompts share: the batch's requests, how to read
    and end them, the weights (loaded once) and the last batch shape's compiled graph."""

    requests: list
    tokenizer: Any
    eos: set[int]
    weights: Any = None
    programs: dict = field(default_factory=dict)


@dataclass
class Batch:
    """The sequences one run executes: the scenario sized to them, each sequence slot's request
    (``slots``; None in a slot: a filler sequence; ``slots`` None: synthetic prompts of the
    workload's length), the tokenizer that reads and writes their text, what ends a request
    (``eos``, read where requests are given: their outputs end there) and the warnings so far. ``overflow``:
    every request of a prompts file holding more than the policy's N sequences, which then run
    N at a time (:func:`_execute_prompts`)."""

    scenario: Scenario
    slots: list | None
    tokenizer: Any
    eos: set[int]
    warnings: list[str]
    overflow: list | None = None


@dataclass
class Inputs:
    """A batch's prompts as tensors: token ids [N, P] right-padded, each sequence's length
    (None: all P), and the last step each micro-batch's requests need (None: every step)."""

    prompts: Any
    lens: Any
    last_steps: list[int] | None


def batch_of(scenario: Scenario, schedule: str | None, weights_path: str | None,
              prompts_path: str | None, batch: list[list] | None, shared: SharedBatches | None
              ) -> Batch:
    """Which sequences run: synthetic prompts of the workload's shape, a prompts file's
    requests, one batch of a longer file (`shared`), or given micro-batches of requests
    (`batch`); the scenario's model made the checkpoint's, and the scenario sized to the
    requests, each within the checkpoint's positions."""
    from taskgraph.exec.prompts import eos_ids, load_tokenizer, read_prompts

    warnings: list[str] = []
    if weights_path and shared is None:     # a batch of many prompts has it applied
        model, warnings = checkpoint_model(scenario.model, weights_path)
        scenario = scenario.model_copy(update={"model": model})
    # read before the run, not when its outputs are written: a bad id refused after the run
    # would cost the run
    eos = (shared.eos if shared is not None else
           eos_ids(weights_path, scenario.model.V) if prompts_path or batch is not None
           else set())
    limit = max_positions(weights_path)
    slots, tokenizer = None, None
    if prompts_path:
        tokenizer = load_tokenizer(weights_path)
        requests = read_prompts(prompts_path, scenario.model.V, scenario.workload.gen_len,
                                tokenizer, limit)
        if len(requests) > scenario.policy.N:
            return Batch(scenario, None, tokenizer, eos, warnings, overflow=requests)
        scenario, slots = for_requests(scenario, schedule, requests)
    elif shared is not None:
        tokenizer = shared.tokenizer
        scenario, slots = for_requests(scenario, schedule, shared.requests)
        # equal shapes, one compiled graph: the mean prompt length only names the workload
        scenario = scenario.model_copy(update={"workload": scenario.workload.model_copy(
            update={"prompt_len": scenario.workload.context_prompt})})
    elif batch is not None:
        scenario, slots = for_batch(scenario, schedule, batch, scenario.policy.mu)
    if limit is not None:
        check_positions(scenario, slots, limit)
    return Batch(scenario, slots, tokenizer, eos, warnings)


def inputs_of(scenario: Scenario, slots: list | None, seed: int, skip_finished: bool) -> Inputs:
    """The prompts as a tensor: synthetic ones drawn from `seed` + 1, or each slot's request
    right-padded (a filler: one token). With `skip_finished` (a batch of a request list), each
    micro-batch's last step: its tasks after its last request's last step, and every task of a
    micro-batch holding no request, do nothing, as the simulator skips them."""
    torch = need_torch()
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
    return Inputs(prompts, lens, last_steps)


def request_outputs(tokens: Any, slots: list, tokenizer: Any, eos: set[int]
                    ) -> list[dict[str, Any]]:
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
