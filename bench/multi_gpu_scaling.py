"""What two more T4s buy, system by system, on the calibrated 2xT4 and 4xT4 presets.

Mixtral 8x22B, MTBench prompts padded to 418 tokens, 128 generated (the paper's Fig. 7 setting).
Each system runs as it does on several GPUs (README, *Several GPUs*): MoE-Lightning(p) tensor
parallel (S1) at the policy its own optimizer chose (the calibration file's); DeepSpeed
ZeRO-Inference data parallel (DS), 32 sequences per GPU; FlexGen's pipeline (PP) at the best of a
small simulated grid (mu in MUS, every weight streamed, the largest batch within the planning
headroom, as the search plans); and S1 at `tg search`'s pick for each machine. Measured figures,
where the paper has them, beside.

    python bench/multi_gpu_scaling.py            # about 8 minutes here
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from taskgraph.dag.builder import make_plan
from taskgraph.study.measurements import load_measurements
from taskgraph.errors import TgError
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.scenario import scenario_from_dict
from taskgraph.study.search import search
from taskgraph.sim.simulate import simulate_scenario

CELLS = "scenarios/measurements/moe-lightning-multi-gpu.yaml"
GEN = 128
MUS = (16, 32, 64)
WORKLOAD = {"preset": "mtbench", "gen_len": GEN, "padded": True}


def _scenario(machine: str, schedule: str, policy: dict) -> object:
    return scenario_from_dict({"model": "mixtral-8x22b", "hardware": machine,
                               "workload": WORKLOAD, "policy": policy, "schedule": schedule},
                              source=f"{machine} {schedule}")


def _pipeline(machine: str):
    """FlexGen's pipeline at its best simulated policy of the grid, or None."""
    best = None
    for mu in MUS:
        gpus = int(machine[0])
        for groups in range(64 // gpus, 0, -1):
            sc = _scenario(machine, "PP", {"N": mu * gpus * groups, "mu": mu, "r_w": 0.0})
            try:        # within the planning headroom, as tg search and the paper's runs
                check_fits(memory_footprint(make_plan(sc)), "PP", planning=True)
            except TgError:
                continue
            sim = simulate_scenario(sc)
            if best is None or sim.summary["throughput_tok_s"] > best.summary["throughput_tok_s"]:
                best = sim
            break
    return best


def main() -> None:
    console = Console()
    _, cells = load_measurements(CELLS)
    runs: dict[str, dict[str, tuple]] = {}
    for c in cells:
        if c.workload["gen_len"] == GEN:
            sim = simulate_scenario(c.scenario(), over_memory=True)
            runs.setdefault(f"{c.system} ({c.schedule})", {})[c.machine] = (
                sim, c.measured_tok_s)
    for machine in ("2xt4", "4xt4"):
        runs.setdefault("FlexGen (PP, best of grid)", {})[machine] = (_pipeline(machine), None)
        base = _scenario(machine, "S1", {"N": 36, "mu": 36})
        pick = next(c for c in search(base, top=200).top if c.schedule == "S1")
        sim = simulate_scenario(_scenario(machine, "S1", pick.policy))
        runs.setdefault("CGOPipe (S1) at tg search's pick", {})[machine] = (sim, None)
        console.log(f"{machine}: done")
    table = Table(title=f"Mixtral 8x22B, MTBench padded, {GEN} tokens: 2xT4 -> 4xT4, simulated "
                        "on the calibrated presets [measured]", title_justify="left")
    for col in ("system", "policy 2xT4 -> 4xT4", "2xT4 tok/s", "4xT4 tok/s", "4 / 2",
                "decode bound 2xT4 -> 4xT4", "host memory in use (decode)"):
        table.add_column(col, justify="left" if col[0] in "sdph" else "right")
    for name, by in runs.items():
        (a, ma), (b, mb) = by["2xt4"], by["4xt4"]
        sa, sb = a.summary, b.summary
        pol = " -> ".join(f"N={s['policy']['N']} mu={s['policy']['mu']} r_w={s['policy']['r_w']:g}"
                          for s in (sa, sb))
        shown = [f"{s['throughput_tok_s']:.2f}" + (f" [{m:.2f}]" if m else "")
                 for s, m in ((sa, ma), (sb, mb))]
        ratio = f"{sb['throughput_tok_s'] / sa['throughput_tok_s']:.2f}x" + (
            f" [{mb / ma:.2f}x]" if ma and mb else "")
        mem = " -> ".join(f"{s['shared'].get('host_memory', {}).get('decode', 0):.0%}"
                          for s in (sa, sb))
        table.add_row(name, pol, *shown, ratio,
                      f"{sa['bound_by']['decode']} -> {sb['bound_by']['decode']}", mem)
    console.print(table)


if __name__ == "__main__":
    main()
