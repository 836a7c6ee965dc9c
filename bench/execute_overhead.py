"""Benchmark: the CPU backend's dispatch overhead per task and the overlap it achieves.

* overhead: the executor runs every task of a schedule with the task bodies replaced by no-ops;
  wall time / tasks is what dispatch (threads, dependency waits, timing) costs per task;
* overlap: with real kernels, the sum of per-stream busy time / wall time (1.0 = nothing ran
  concurrently; the number of streams = everything did).

    python bench/execute_overhead.py [scenario.yaml] [--steps K]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from taskgraph.dag.builder import make_plan
from taskgraph.dag.compiled import compile_plan
from taskgraph.exec.dispatch import execute
from taskgraph.exec.runtime import Runtime
from taskgraph.kernels.reference import synthetic_prompts
from taskgraph.kernels.weights import synthetic_weights
from taskgraph.scenario import for_schedule, load_scenario


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", nargs="?", default="scenarios/tiny.yaml")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    base = load_scenario(args.scenario, [f"workload.gen_len={args.steps}"])
    print(f"{args.scenario}, {args.steps} decode steps, CPU backend, "
          f"{torch.get_num_threads()} torch threads")
    print(f"{'sched':5} {'tasks':>6} {'dispatch µs/task':>17} {'wall s':>7} {'busy s':>7} "
          f"{'overlap':>8} {'streams':>8}")
    for name in ("S1", "S2", "S3", "S4"):
        sc, _ = for_schedule(base, name)
        plan = make_plan(sc, name)
        program = compile_plan(plan)
        w = synthetic_weights(sc.model)
        prompts = synthetic_prompts(sc.policy.N, sc.workload.context_prompt, sc.model.V)
        runtime = Runtime(plan, w, prompts, torch.device("cpu"))
        real_run = runtime.run
        runtime.run = lambda *a: None
        empty = min((execute(program, runtime) for _ in range(3)), key=lambda r: r.wall_s)
        runtime.run = real_run
        run = execute(program, runtime)
        busy = float(np.nansum(run.durations))
        print(f"{name:5} {program.total:6d} {empty.wall_s / program.total * 1e6:17.1f} "
              f"{run.wall_s:7.2f} {busy:7.2f} {busy / run.wall_s:8.2f} {len(program.streams):8d}")


if __name__ == "__main__":
    main()
