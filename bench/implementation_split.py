"""How much of MoE-Lightning's speedup over FlexGen on the T4 comes from the schedule and how
much from the software (kernels and copies)? Each system's policy from the paper's Table 4 is
simulated under both implementation profiles: S1 (CGOPipe) with FlexGen's software and S4 (FlexGen's
order) with MoE-Lightning's.

    python bench/implementation_split.py [MEASUREMENTS.yaml] [--machine t4]
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from taskgraph import presets
from taskgraph.study.fit import simulated_tok_s
from taskgraph.study.measurements import load_measurements


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("measurements", nargs="?",
                    default="scenarios/measurements/moe-lightning-table4.yaml")
    ap.add_argument("--machine", default="t4")
    args = ap.parse_args()
    _, cells = load_measurements(args.measurements)
    table = Table(title=f"schedule vs software on the {args.machine} (simulated tok/s; "
                        "measured in brackets)", title_justify="left")
    for col in ("cell", "schedule", "MoE-Lightning software", "FlexGen software",
                "software's gain"):
        table.add_column(col, justify="left" if col == "cell" else "right")
    for c in cells:
        if c.machine != args.machine or c.schedule not in ("S1", "S4"):
            continue
        runs = {}
        for impl in ("moe-lightning", "flexgen"):
            cell = c.model_copy(update={"implementation": impl})
            runs[impl] = simulated_tok_s(cell, presets.HARDWARE, presets.IMPLEMENTATIONS)
        own = c.implementation_name
        marks = {k: f"{v:.2f}" + (f" [{c.measured_tok_s:.2f}]" if k == own else "")
                 for k, v in runs.items()}
        table.add_row(f"{c.workload.get('preset', '')} {c.system}", c.schedule, marks["moe-lightning"], marks["flexgen"],
                      f"{runs['moe-lightning'] / runs['flexgen']:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
