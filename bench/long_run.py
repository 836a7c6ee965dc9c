"""Benchmark: does a run's memory depend on its length? `tiny` decoded for 10^4, 10^5 and 10^6
steps (1.2M, 12M and 116M tasks), each in a fresh subprocess: wall time, peak RSS, time per
million tasks.

    python bench/long_run.py [--steps 10000 100000 1000000] [--check]

Runs of more than `taskgraph.sim.simulate.HOLD_TASKS` tasks are decided block by block and keep
only their figures and the first steps' task times (issue 26's target: 10^6 steps within 1 GB,
its time linear in steps; before, memory grew ~20 KB a step: 1.0 GB at 50,000 steps, 13 GB and
still running at 10^6). With --check it exits 1 unless the longest run peaks at <= 1 GB and its
time per task is within 1.5x of the 10^5-step run's (measured in the same run; CI runs it so).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from taskgraph.scenario import load_scenario
from taskgraph.sim.simulate import simulate_scenario
s = simulate_scenario(load_scenario("scenarios/tiny.yaml",
                                    [f"workload.gen_len={sys.argv[1]}"])).summary
print(json.dumps({"wall_s": time.perf_counter() - t0,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "tasks": s["tasks"], "steps": s["steps"],
                  "throughput_tok_s": s["throughput_tok_s"]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    rows = []
    print(f"{'steps':>10} {'tasks':>12} {'wall s':>8} {'peak MB':>8} {'s / M tasks':>12} "
          f"{'tok/s':>9}")
    for steps in args.steps:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(steps)], capture_output=True,
                             text=True, check=True)
        r = json.loads(out.stdout)
        r["per_m"] = r["wall_s"] / (r["tasks"] / 1e6)
        rows.append(r)
        print(f"{r['steps']:>10,} {r['tasks']:>12,} {r['wall_s']:>8.1f} {r['rss_mb']:>8.0f} "
              f"{r['per_m']:>12.2f} {r['throughput_tok_s']:>9.2f}", flush=True)
    longest = rows[-1]
    ratio = longest["per_m"] / rows[-2]["per_m"] if len(rows) > 1 else 1.0
    print(f"longest run: {longest['rss_mb']:.0f} MB peak (target <= 1024); time per task "
          f"{ratio:.2f}x the next longest's (target <= 1.5: linear in steps)")
    if args.check and (longest["rss_mb"] > 1024 or ratio > 1.5):
        print("FAILED: a long run's memory or time per task is over its target")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
