"""Does a cost per routed expert transfer to experts of other sizes? The executor's expert tasks
(GPUFFN, CPUFFN, ExpertIn) of EP and EC at batch 1, measured back to back on one model at four
expert granularities (the same weights a token through 1x, 2x, 4x and 8x the experts, each that
much smaller). Two fits, as `tg calibrate` makes them: the one before, on the scenario's own
experts alone (a fixed cost and a byte rate), and the one with a cost per expert, on the 1x and
4x runs. Each prices every granularity's tasks; 2x and 8x are held out of both.

    python bench/expert_granularity.py [SCENARIO] [--repeats 3] [--device cpu] [--json] [--check]

(`--json`: {kind: {fit: {grain: median |error|}}} on stdout instead of the table. `--check`:
exit 1 unless the cost per expert prices the 8x experts of GPUFFN and CPUFFN closer. A timing
on a shared machine: CI runs it to report, not to fail; under load the CPU stream's tasks
share their cores with the other streams' threads and its figures scatter.)
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from rich.console import Console
from rich.table import Table

from taskgraph.dag.compiled import KIND_NAMES
from taskgraph.perf.cost import CostModel
from taskgraph.scenario import for_schedule, load_scenario
from taskgraph.study import calibrate as cal

GRAINS = (1, 2, 4, 8)


def _fastest(samples: cal._Samples, repeats: int) -> tuple[np.ndarray, ...]:
    """(bytes, experts, roof, seconds) of each task of a repeated run, its fastest repeat's
    time: the runs repeat the same tasks in the same order, and a task a loaded machine
    preempted in one repeat ran whole in another."""
    chunks = samples.chunks
    per = len(chunks["measured"]) // repeats          # chunks (runs with this kind) a repeat
    first = [np.concatenate(chunks[name][:per]) for name in ("nbytes", "experts", "roof")]
    fastest = np.min([np.concatenate(chunks["measured"][r * per:(r + 1) * per])
                      for r in range(repeats)], axis=0)
    return (*first, fastest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", nargs="?", default="scenarios/tiny.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    policy = sc.policy.model_copy(update={"mu": 1, "N": 1, "experts_gpu": sc.model.k})
    one = sc.model_copy(update={"policy": policy, "workload": sc.workload.model_copy(
        update={"gen_len": cal.EXPERT_STEPS})})
    cost = CostModel(sc.hardware)
    skip = frozenset(KIND_NAMES) - set(cal.EXPERT_KINDS)
    grains = {grain: (cal._finer(one, grain), cal._MeasuredTasks(cost, args.device))
              for grain in GRAINS}
    for _ in range(args.repeats):         # interleaved: a machine's drift hits every grain alike
        for grain, (scenario, tasks) in grains.items():
            for schedule in cal.EXPERT_RUNS:
                tasks.measure(for_schedule(scenario, schedule)[0], schedule, skip=skip)
    errors: dict[str, dict[str, dict[int, float]]] = {}
    for kind in cal.EXPERT_KINDS:
        cols = {g: _fastest(t.samples[kind], args.repeats) for g, (_, t) in grains.items()}
        fixed, slope = cal._fit_cost(cols[1][0], cols[1][2], cols[1][3])
        before = {g: fixed + x * slope + (0 if slope else roof)
                  for g, (x, _, roof, _) in cols.items()}
        both = [np.concatenate(a) for a in zip(cols[1], cols[4])]
        fixed, slope, each = cal._fit_expert_cost(*both)
        after = {g: fixed + x * slope + n * each + (0 if slope else roof)
                 for g, (x, n, roof, _) in cols.items()}
        errors[kind] = {name: {g: float(np.median(np.abs(priced[g] / cols[g][3] - 1)))
                               for g in GRAINS}
                        for name, priced in (("bytes alone", before), ("a cost per expert", after))}
    worse = [k for k in ("GPUFFN", "CPUFFN")
             if errors[k]["a cost per expert"][8] >= errors[k]["bytes alone"][8]]
    if args.json:
        print(json.dumps(errors))
    else:
        _show(errors)
    if args.check and worse:
        print(f"expert_granularity: at 8x the experts, {', '.join(worse)} not priced closer "
              "with a cost per expert", file=sys.stderr)
        sys.exit(1)


def _show(errors: dict[str, dict[str, dict[int, float]]]) -> None:
    table = Table(title="expert tasks' median |error| (held out: 2x, 8x)", title_justify="left")
    for col in ("kind", "fit", *(f"{g}x" for g in GRAINS)):
        table.add_column(col, justify="left" if col in ("kind", "fit") else "right")
    for kind, fits in errors.items():
        for name, by_grain in fits.items():
            table.add_row(kind, name, *(f"{by_grain[g]:.0%}" for g in GRAINS))
    Console().print(table)


if __name__ == "__main__":
    main()
