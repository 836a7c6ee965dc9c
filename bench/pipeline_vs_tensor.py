"""FlexGen's pipeline parallelism (PP) against tensor parallelism on the paper's multi-GPU T4
machines, 2 and 4 GPUs: which scales, and why.

Tensor parallelism runs each scenario's own policy (`tg search`'s best CGOPipe policy) for S1
and S4. PP gets a small simulated grid here (`tg search` scores it by prediction): mu in MUS,
r_w in R_WS, and for each the largest batch (whole groups of micro-batches, one group per GPU)
that fits both memories; the best simulated row is reported, with its policy.

    python bench/pipeline_vs_tensor.py [SCENARIO ...]
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from taskgraph.builder import make_plan
from taskgraph.errors import TgError
from taskgraph.memory import check_fits, memory_footprint
from taskgraph.scenario import for_schedule, load_scenario
from taskgraph.simulation import simulate_scenario

MUS = (32, 64, 128)
R_WS = (0.0, 0.05)


def _largest_fitting(scenario, mu: int, r_w: float):
    """PP's scenario with the largest N (whole groups) that fits, or None."""
    gpus = scenario.hardware.gpu.count
    step = gpus * mu
    for N in range(scenario.policy.N // step * step, 0, -step):
        policy = scenario.policy.model_copy(update={"N": N, "mu": mu, "r_w": r_w})
        sc, _ = for_schedule(scenario.model_copy(update={"policy": policy}), "PP")
        try:
            check_fits(memory_footprint(make_plan(sc, "PP")), "PP")
        except TgError:
            continue
        return sc
    return None


def _row(sim) -> tuple[str, ...]:
    s, p = sim.summary, sim.plan.scenario.policy
    return (f"N={p.N} mu={p.mu} r_w={p.r_w:g}", f"{s['throughput_tok_s']:.2f}",
            f"{s['decode_layer_ms']:.1f}", f"{s['hrm_layer_ms']:.1f}", s["hrm_binding"],
            f"{s['prefill_s']:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenarios", nargs="*",
                    default=["scenarios/2xt4-8x22b.yaml", "scenarios/4xt4-8x22b.yaml"])
    args = ap.parse_args()
    table = Table(title="pipeline (PP) vs tensor parallelism (S1, S4), simulated",
                  title_justify="left")
    for col in ("machine", "schedule", "policy", "tok/s", "layer ms", "HRM ms", "bound",
                "prefill s"):
        table.add_column(col, justify="left" if col in ("machine", "schedule", "policy",
                                                        "bound") else "right")
    console = Console()
    for path in args.scenarios:
        base = load_scenario(path)
        machine = base.hardware.name
        for name in ("S1", "S4"):
            sc, _ = for_schedule(base, name)
            table.add_row(machine, f"{name} (tensor)", *_row(simulate_scenario(sc, name)))
        best = None
        for mu in MUS:
            for r_w in R_WS:
                sc = _largest_fitting(base, mu, r_w)
                if sc is None:
                    continue
                sim = simulate_scenario(sc, "PP")
                console.log(f"{machine} PP {_row(sim)}")
                if best is None or sim.summary["throughput_tok_s"] > \
                        best.summary["throughput_tok_s"]:
                    best = sim
        if best is not None:
            table.add_row(machine, "PP (pipeline)", *_row(best))
    console.print(table)


if __name__ == "__main__":
    main()
