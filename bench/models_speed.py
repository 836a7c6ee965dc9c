"""Benchmark: do today's large MoEs cost the simulator more per task than Mixtral?

Prints, measured in this run, the simulator's time per simulated task (compile aside, best of
`--repeat`) for Mixtral 8x7B on the paper's T4 machine (S1) and for DeepSeek-V3 (61 layers, 256
experts, MLA, dense layers, a shared expert) at batch 1 (EP) and at a large batch (S1), their
ratio to Mixtral's, and the wall time of a whole `tg search` on DeepSeek-V3.

    python bench/models_speed.py [--repeat 3] [--check]

With --check it exits 1 unless each DeepSeek-V3 run's time per task is within 1.5x Mixtral's and
the search finishes within 60 s (issue 37's targets). Timings on shared machines are noisy: the
best of several runs is what the machine can do.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from taskgraph.dag.builder import make_plan
from taskgraph.dag.compiled import compile_plan
from taskgraph.perf.cost import cost_model
from taskgraph.scenario import load_scenario, scenario_from_dict
from taskgraph.sim.engine import simulate

_WORKLOAD = {"prompt_len": 512, "max_prompt_len": 512, "gen_len": 32}
RUNS = {
    "mixtral-8x7b t4 S1 (N=504)": lambda: load_scenario("scenarios/t4.yaml",
                                                         ["workload.gen_len=32"]),
    "deepseek-v3 EP batch 1": lambda: scenario_from_dict({
        "model": "deepseek-v3", "hardware": "rtx4090-epyc", "workload": _WORKLOAD,
        "policy": {"N": 1, "mu": 1, "r_w": 1.0, "r_c": 1.0, "experts_gpu": 1},
        "schedule": "EP"}),
    "deepseek-v3 S1 (N=2048)": lambda: scenario_from_dict({
        "model": "deepseek-v3",
        "hardware": {"preset": "rtxpro6000-epyc", "cpu": {"memory_gb": 1536}},
        "workload": _WORKLOAD, "policy": {"N": 2048, "mu": 256, "r_w": 0.0, "r_c": 0.0},
        "schedule": "S1"}),
}
_SEARCH_SCENARIO = """
model: deepseek-v3
hardware: {preset: rtxpro6000-epyc, cpu: {memory_gb: 1536}}
workload: {preset: mtbench, gen_len: 64}
policy: auto
"""


def per_task(make, repeat: int) -> tuple[int, float]:
    sc = make()
    program = compile_plan(make_plan(sc))
    cost = cost_model(sc, sc.schedule)
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        simulate(program, cost)
        best = min(best, time.perf_counter() - t0)
    return program.total, best / program.total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    results = {name: per_task(make, args.repeat) for name, make in RUNS.items()}
    base = next(iter(results.values()))[1]
    failed = []
    for name, (tasks, t) in results.items():
        ratio = t / base
        print(f"{name:28s} {tasks:>9,} tasks  {t * 1e6:6.2f} us a task  {ratio:4.2f}x Mixtral's")
        if ratio > 1.5:
            failed.append(f"{name}: {ratio:.2f}x Mixtral's time per task")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "deepseek-v3.yaml"
        path.write_text(_SEARCH_SCENARIO)
        t0 = time.perf_counter()
        proc = subprocess.run(["tg", "search", str(path), "--top", "3"], capture_output=True,
                              text=True)
        search_s = time.perf_counter() - t0
    best = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("best:")]
    print(f"tg search deepseek-v3 (1.5 TB host): {search_s:.1f} s, exit {proc.returncode}; "
          f"{best[0] if best else 'no best line'}")
    if proc.returncode or search_s > 60:
        failed.append(f"search {search_s:.1f} s, exit {proc.returncode}")
    if args.check:
        if failed:
            print("FAILED: " + "; ".join(failed))
            return 1
        print("targets met: DeepSeek-V3 within 1.5x Mixtral's time per task; search <= 60 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
