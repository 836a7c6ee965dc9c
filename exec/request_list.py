"""A request list executed batch after batch, in the batches the simulator packs it into, each
request checked against the reference forward run on it alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from taskgraph.exec.execute import execute_scenario
from taskgraph.exec.result import Executed, Execution, write_routing
from taskgraph.exec.loading import need_torch
from taskgraph.output.report import Shown, execute_queue_table, warnings_of
from taskgraph.specs import Scenario
from taskgraph.tracing.writer import Traced, TraceRun


@dataclass
class QueueExecution(Executed, Shown, Traced):
    """A request list executed batch after batch, as the simulator batches it; `summary` is
    the JSON of `tg execute` on it."""

    batches: list[Execution]
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.summary

    def write_outputs(self, path: str) -> None:
        from taskgraph.exec.prompts import write_outputs

        write_outputs(path, self.summary.pop("outputs"))
        self.summary["out"] = path

    def write_routing(self, path: str | Path) -> None:
        write_routing(self.routing, path)
        self.summary["routing"] = str(path)

    def warn(self, text: str) -> None:
        self.summary["warnings"].append(text)

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
            offset += ex.figures["makespan_s"]
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
    from taskgraph.serving.requests import pack_scenario

    t0 = time.perf_counter()
    warnings: list[str] = []
    if scenario.workload.refill:
        warnings.append("refill is simulated only; the executor runs the list in consecutive "
                        "batches (Algorithm 2).")
        scenario = scenario.model_copy(update={
            "workload": scenario.workload.model_copy(update={"refill": False})})
    prompts = _random_prompts(scenario, seed)
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
    outputs = [row for ex in runs for row in ex.measured.outputs or []]
    mismatched = _mismatched_alone(outputs, prompts, runs[0].weights) if check else []
    summary = _summary(scenario, packing, runs, outputs, check, mismatched, warnings)
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    return QueueExecution(runs, summary)


def _random_prompts(scenario: Scenario, seed: int) -> dict[Any, Any]:
    """Each request's prompt: random token ids of its own length, drawn from `seed` + 1."""
    torch = need_torch()
    from taskgraph.exec.prompts import Request as Prompt

    gen = torch.Generator().manual_seed(seed + 1)
    return {r.id: Prompt(r.id, torch.randint(0, scenario.model.V, (r.prompt_len,),
                                             generator=gen).tolist(), r.gen_len)
            for r in scenario.requests}


def _mismatched_alone(outputs: list[dict[str, Any]], prompts: dict[Any, Any], weights: Any
                      ) -> list[Any]:
    """The requests whose tokens differ from the reference forward's on that request alone."""
    torch = need_torch()
    from taskgraph.kernels.reference import reference_forward

    mismatched, reference = [], weights.dequantized()
    for row in outputs:
        p = prompts[row["id"]]
        alone = reference_forward(reference, torch.tensor([p.prompt_ids]), 1,
                                  max(1, p.max_new_tokens - 1))
        if alone.tokens[0, :p.max_new_tokens].tolist() != row["output_ids"]:
            mismatched.append(row["id"])
    return mismatched


def _summary(scenario: Scenario, packing: Any, runs: list[Execution],
             outputs: list[dict[str, Any]], check: bool, mismatched: list[Any],
             warnings: list[str]) -> dict[str, Any]:
    """The JSON of `tg execute` on a request list: the first batch's names, the list's
    throughput over every batch, what ran and whether each request's tokens are its own."""
    makespan = sum(ex.figures["makespan_s"] for ex in runs)
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
        "tokens_match": all(ex.measured.tokens_match for ex in runs) if check else None,
        "requests_match_alone": (not mismatched) if check else None,
        "mismatched": mismatched,
        "outputs": outputs,
        "interrupted": any(ex.run.interrupted for ex in runs),
        "warnings": warnings + sorted({w for ex in runs for w in ex.measured.warnings}),
    })
    return summary
