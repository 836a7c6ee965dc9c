"""Benchmark: how much throughput does trusting the search's pick lose against brute force?

For each scenario: the search over the full grid picks a policy (by HRM prediction; the
expert-level schedules by simulating the two corners of what fills the GPU), the simulator runs
it; a coarse grid is simulated policy by policy (6 micro-batch sizes x 5 r_w x 3 r_c at the
largest, 3/4 and 1/2 the largest batch that fit, and the expert-level schedules at r_w 0, 0.5, 1,
the KV cache on either side, both evictions, all and half the experts that fit); the loss is
1 - (the pick, simulated) / (best simulated). MoE-Lightning's reviewers asked exactly this; at
small batches (`scenario.yaml:N` holds the batch at N) it is the question for the expert-level
schedules.

    python bench/search_vs_bruteforce.py [scenario.yaml[:N] ...]
    (default: t4, l4, h100, and t4 and gpt-oss-120b on an RTX 4090 at batch 1, 4 and 16)
"""

from __future__ import annotations

import sys
import time

from taskgraph.scenario import load_scenario
from taskgraph.study.search import brute_force, brute_force_summary, search, verify

SMALL = [f"{path}:{n}" for path in ("scenarios/t4.yaml", "scenarios/gpt-oss-120b-4090.yaml")
         for n in (1, 4, 16)]


def main(entries: list[str]) -> int:
    rows = []
    for entry in entries:
        path, _, batch = entry.partition(":")
        sc = load_scenario(path, [f"objective.batch={batch}"] if batch else [])
        name = f"{sc.name}{f' N={batch}' if batch else ''}"
        t0 = time.perf_counter()
        result = verify(sc, search(sc, top=1))
        pick = result.best
        grid = brute_force(sc)
        best = grid[0]
        summary = brute_force_summary(result, grid)
        rows.append((name, pick, best, summary, time.perf_counter() - t0))
        print(f"{name}: the pick {pick.schedule} {pick.policy} simulated "
              f"{pick.simulated_tok_s:.2f} tok/s; brute-force best of {len(grid)} "
              f"{best.schedule} {best.policy} simulated {best.simulated_tok_s:.2f} tok/s",
              flush=True)
    print()
    print(f"{'scenario':28} {'pick sim':>9} {'BF best sim':>12} {'loss':>7} "
          f"{'in-grid loss':>13} {'sims':>5} {'wall s':>7}")
    for name, pick, best, s, wall in rows:
        print(f"{name:28} {pick.simulated_tok_s:9.2f} {best.simulated_tok_s:12.2f} "
              f"{s['loss_vs_best']:7.1%} {s['loss_in_grid']:13.1%} {s['simulated']:5d} "
              f"{wall:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["scenarios/t4.yaml", "scenarios/l4.yaml",
                                   "scenarios/h100.yaml", *SMALL]))
