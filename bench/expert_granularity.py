"""Does a cost per routed expert transfer to experts of other sizes? The executor's expert tasks
(GPUFFN, CPUFFN, ExpertIn) of EP and EC at batch 1, measured back to back on one model at four
expert granularities (the same weights a token through 1x, 2x, 4x and 8x the experts, each that
much smaller). Two fits, as `tg calibrate` makes them: the one before, on the scenario's own
experts alone (a fixed cost and a byte rate), and the one with a cost per expert, on the 1x and
4x runs. Each prices every granularity's tasks; 2x and 8x are held out of both.

    python bench/expert_granularity.py [SCENARIO] [--repeats 3] [--device cpu] [--json]

(`--json`: {kind: {fit: {grain: median |error|}}} on stdout instead of the table.)
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from rich.console import Console
from rich.table import Table

from taskgraph.dag.compiled import KIND_NAMES
from taskgraph.perf.cost import CostModel
from taskgraph.scenario import for_schedule, load_scenario
from taskgraph.study import calibrate as cal

GRAINS = (1, 2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", nargs="?", default="scenarios/tiny.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
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
        smp = {g: t.samples[kind] for g, (_, t) in grains.items()}
        cols = {g: (s.array("nbytes"), s.array("experts"), s.array("roof"), s.alone({}))
                for g, s in smp.items()}
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
    if args.json:
        print(json.dumps(errors))
        return
    table = Table(title="expert tasks' median |error| (held out: 2x, 8x)", title_justify="left")
    for col in ("kind", "fit", *(f"{g}x" for g in GRAINS)):
        table.add_column(col, justify="left" if col in ("kind", "fit") else "right")
    for kind, fits in errors.items():
        for name, by_grain in fits.items():
            table.add_row(kind, name, *(f"{by_grain[g]:.0%}" for g in GRAINS))
    Console().print(table)


if __name__ == "__main__":
    main()
