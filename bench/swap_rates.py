"""The link rate each Mixtral-offloading row of the small-batch artifact needs, for each count of
experts a layer it could have kept resident, beside the rate DeepSpeed's gathers reached on the
same machine: the arithmetic behind the resident count the calibration file gives its RTX 6000
Ada rows (scenarios/measurements/small-batch-fiddler-artifact.yaml).

Mixtral-offloading's cache swaps on a miss (the artifact's benchmarks/mixtral_offloading/src/
expert_cache.py, ExpertCache._swap): the chosen expert is copied in and the evicted one out,
one after the other on one CUDA stream, so each miss moves an expert's bytes twice across the
link. Under uniform routing a decode step of b sequences uses E (1 - (1 - k/E)^b) experts of a
layer (Routing.distinct, as every schedule prices it), and an LRU cache of r holds any one of
them with chance r/E (its contents do not depend on this step's choice); prefill uses all E. The rate a row needs is then
2 x expert bytes x misses / its seconds, every other cost left out (so each is a lower bound).
DeepSpeed's is every weight once a forward pass (prefill and gen_len - 1 decode steps).

    python bench/swap_rates.py [--file scenarios/measurements/small-batch-fiddler-artifact.yaml]

Arithmetic on published figures: no simulation, no timing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from taskgraph import presets
from taskgraph.dag.routing import Routing
from taskgraph.specs import ModelSpec

PCIE4_X16_GBPS = 31.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default="scenarios/measurements/small-batch-fiddler-artifact.yaml")
    args = ap.parse_args()
    doc = yaml.safe_load(Path(args.file).read_text())
    model = ModelSpec.model_validate(presets.MODELS[doc["model"]])
    expert, weights, layers = model.expert_bytes, model.model_bytes, model.L
    used = Routing.uniform(model).distinct     # experts a layer b tokens choose, uniform routing

    def seconds(cell: dict) -> float:       # the row as quoted: input, output, batch, seconds
        return float(cell["quote"].split(",")[3])

    deepspeed = {}
    for c in doc["cells"]:
        if c["schedule"] == "DS":
            deepspeed.setdefault(c["machine"], []).append(
                c["gen_len"] * weights / seconds(c) / 1e9)
    print(f"GB/s each of a miss's two {expert / 1e6:.0f} MB copies needs, by experts a layer "
          f"resident (PCIe 4.0 x16 carries {PCIE4_X16_GBPS}):")
    print(f"{'row':<14}{'batch':>6}" + "".join(f"{f'{r} resident':>13}" for r in (1, 2, 3, 4))
          + f"{'DeepSpeed there':>17}")
    for c in doc["cells"]:
        if c["schedule"] != "EC":
            continue
        row = []
        for r in (1, 2, 3, 4):
            decode = used(c["batch"]) * (model.E - r) / model.E     # held with chance r/E
            misses = layers * ((c["gen_len"] - 1) * decode + model.E - r)
            row.append(2 * expert * misses / seconds(c) / 1e9)
        ds = deepspeed.get(c["machine"], [float("nan")])
        print(f"{c['id']:<14}{c['batch']:>6}" + "".join(f"{x:>13.1f}" for x in row)
              + f"{min(ds):>10.1f}-{max(ds):.1f}"
              + f"   (the file: {c.get('experts_resident_per_layer')})")


if __name__ == "__main__":
    main()
