"""Benchmark: wall time of the HRM policy search (issue 3's target: <= 10 s for t4.yaml on a
2-core machine; the MoE-Lightning paper's MILP takes under a minute).

    python bench/search_speed.py [scenario.yaml ...] [--check]
"""

from __future__ import annotations

import os
import sys
import time

from taskgraph.scenario import load_scenario
from taskgraph.study.search import search


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [a for a in argv if a != "--check"] or ["scenarios/t4.yaml", "scenarios/l4.yaml",
                                                   "scenarios/h100.yaml"]
    worst = 0.0
    for path in paths:
        sc = load_scenario(path)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            result = search(sc, top=10)
            times.append(time.perf_counter() - t)
        worst = max(worst, min(times))
        b = result.best
        print(f"{sc.name}: {result.considered:,} policies ({result.evaluated:,} feasible) in "
              f"{min(times):.2f} s on {os.cpu_count()} cores (best of 3); best {b.schedule} "
              f"N={b.policy['N']} mu={b.policy['mu']} r_w={b.policy['r_w']:g} "
              f"r_c={b.policy['r_c']:g}: {b.predicted_tok_s:.1f} tok/s predicted")
    if check and worst > 10:
        print(f"FAILED: slowest search {worst:.2f} s > 10 s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
