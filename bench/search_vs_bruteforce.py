"""Benchmark: how much throughput does trusting the predicted pick lose against brute force?

For each scenario: the search over the full grid picks a policy by prediction, the simulator
runs it; a coarse grid (6 micro-batch sizes x 5 r_w x 3 r_c, the largest, 3/4 and 1/2 the
largest batch that fit) is simulated policy by policy; the loss is 1 - (the pick, simulated) /
(best simulated).
MoE-Lightning's reviewers asked exactly this.

    python bench/search_vs_bruteforce.py [scenario.yaml ...]     (default: t4, l4, h100)
"""

from __future__ import annotations

import sys
import time

from taskgraph.scenario import load_scenario
from taskgraph.study.search import brute_force, search, verify


def main(paths: list[str]) -> int:
    rows = []
    for path in paths:
        sc = load_scenario(path)
        t0 = time.perf_counter()
        hrm = verify(sc, search(sc, top=1))
        pick = hrm.best
        grid = brute_force(sc)
        best = grid[0]
        in_grid = max(grid, key=lambda c: c.predicted_tok_s)
        rows.append((sc.name, pick, best, in_grid, len(grid), time.perf_counter() - t0))
        print(f"{sc.name}: predicted pick {pick.schedule} {pick.policy} predicted "
              f"{pick.predicted_tok_s:.2f}, simulated {pick.simulated_tok_s:.2f} tok/s; "
              f"brute-force best of {len(grid)} {best.schedule} {best.policy} simulated "
              f"{best.simulated_tok_s:.2f} tok/s", flush=True)
    print()
    print(f"{'scenario':10} {'pick sim':>13} {'BF best sim':>12} {'loss':>7} "
          f"{'in-grid loss':>13} {'sims':>5} {'wall s':>7}")
    for name, pick, best, in_grid, n, wall in rows:
        loss = 1 - pick.simulated_tok_s / best.simulated_tok_s
        grid_loss = 1 - in_grid.simulated_tok_s / best.simulated_tok_s
        print(f"{name:10} {pick.simulated_tok_s:13.2f} {best.simulated_tok_s:12.2f} "
              f"{loss:7.1%} {grid_loss:13.1%} {n:5d} {wall:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["scenarios/t4.yaml", "scenarios/l4.yaml",
                                   "scenarios/h100.yaml"]))
