"""Benchmark: wall time of the policy search (issue 38's target: the whole search, expert-level
schedules simulated, <= 10 s for t4.yaml at its default batch and at batch 1 on a 2-core
machine; the MoE-Lightning paper's MILP takes under a minute). Beside it, in the same run, the
HRM grid alone: the search before it priced EP, EC and ECP.

    python bench/search_speed.py [scenario.yaml ...] [--check]
"""

from __future__ import annotations

import os
import sys
import time

from taskgraph.scenario import load_scenario
from taskgraph.study.search import Grid, evaluate, search

TARGET_S = 10.0


def best_of_3(run) -> tuple[float, object]:
    times, result = [], None
    for _ in range(3):
        t = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t)
    return min(times), result


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [a for a in argv if a != "--check"] or ["scenarios/t4.yaml", "scenarios/l4.yaml",
                                                   "scenarios/h100.yaml"]
    slow = []
    for path in paths:
        for batch in (None, 1):
            sc = load_scenario(path, [f"objective.batch={batch}"] if batch else [])
            grid_s, _ = best_of_3(lambda: evaluate(sc, Grid(batch=batch)))
            whole_s, result = best_of_3(lambda: search(sc, top=10))
            b = result.best
            at = f"batch {batch}" if batch else "any batch"
            print(f"{sc.name} ({at}): {whole_s:.2f} s for {result.considered:,} policies, "
                  f"{result.simulated} of them simulated; the HRM grid alone {grid_s:.2f} s "
                  f"({whole_s / grid_s:.1f}x); {os.cpu_count()} cores, best of 3. Best "
                  f"{b.schedule} N={b.policy['N']} mu={b.policy['mu']}: {b.tok_s:.1f} tok/s, "
                  f"{b.token_latency_ms:,.0f} ms/token")
            if path.endswith("t4.yaml") and whole_s > TARGET_S:
                slow.append(f"{sc.name} ({at}) {whole_s:.2f} s")
    if check and slow:
        print(f"FAILED: over {TARGET_S:g} s: {'; '.join(slow)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
