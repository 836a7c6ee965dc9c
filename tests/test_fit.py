"""`tg fit`: bad measurement files, a fit that recovers known parameters, and the published
Table 4 cells: every one simulates with its stated policy, and the fitted presets predict them."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import yaml

from taskgraph import presets
from taskgraph.cli import main
from taskgraph.errors import TgError
from taskgraph.study import fit as fit_module
from taskgraph.study.fit import free_parameters, profiles, run_fit, simulated_tok_s
from taskgraph.study.measurements import Cell, load_many, load_measurements

TABLE4 = "scenarios/measurements/moe-lightning-table4.yaml"


def _cell(**changes):
    cell = {"id": "c", "system": "MoE-Lightning(p)", "schedule": "S1", "machine": "t4",
            "model": "mixtral-8x7b",
            "workload": {"preset": "helm-reasoning", "gen_len": 4, "padded": True},
            "policy": {"mu": 8, "n_ub": 4, "r_w": 0.0, "r_c": 0.0}, "measured_tok_s": 10.0}
    for key, value in changes.items():
        if value is None:
            cell.pop(key)
        else:
            cell[key] = value
    return cell


@pytest.mark.parametrize("change, message", [
    ({"measured_tok_s": 0}, "cell 'c': measured_tok_s: Input should be greater than or equal"),
    ({"measured_tok_s": -3}, "cell 'c': measured_tok_s"),
    # past what any run measures the fit's arithmetic over- or underflowed: a traceback from
    # the least squares (5e-324), the parity plot's (1e308), Infinity in the JSON (1e-304)
    ({"measured_tok_s": 5e-324}, "cell 'c': measured_tok_s: Input should be greater than"),
    ({"measured_tok_s": 1e-304}, "cell 'c': measured_tok_s: Input should be greater than"),
    ({"measured_tok_s": 1e308}, "cell 'c': measured_tok_s: Input should be less than"),
    # a number is a number (issue 40): not true, not a quoted figure
    ({"measured_tok_s": True}, "measured_tok_s must be a number, not true"),
    ({"policy": {"mu": "8", "n_ub": 4}}, "mu must be an integer, not the text '8'"),
    ({"machine": "z80"}, "cell 'c': machine: 'z80' is not a preset"),
    ({"schedule": "S9"}, "cell 'c': schedule: 'S9' is not a schedule tg knows"),
    ({"policy": {"r_w": 0.0}}, "cell 'c': policy: mu: required but missing"),
    ({"policy": {"batch": 4, "mu": 4}}, "cell 'c': policy: give batch"),
    ({"machine": None}, "cell 'c': machine: required but missing"),
    ({"policy": {"mu": 8, "n_ub": 4, "N": 30}}, "N = 30 is not mu x n_ub"),
    # a cell that cannot be simulated: CGOPipe needs two micro-batches
    ({"policy": {"mu": 8, "n_ub": 1}}, "cell 'c' is not a scenario tg can run"),
])
def test_bad_measurements_name_the_cell_and_the_field(tmp_path, capsys, change, message):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"cells": [_cell(**change)]}))
    assert main(["fit", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    path.write_text("cells: []\n")
    assert main(["fit", str(path), "--out", str(tmp_path / "out")]) == 2


def test_a_cell_over_its_machines_memory_is_fitted_and_reported(tmp_path, capsys):
    """The run happened, so tg's memory model is what is wrong: the cell is simulated all the
    same, and the report says which memory, by how much, and what is largest."""
    path = tmp_path / "m.yaml"
    over = _cell(id="over", policy={"mu": 8, "n_ub": 4, "r_w": 0.9})
    path.write_text(yaml.safe_dump({"cells": [over, _cell(id="fits")]}))
    assert main(["fit", str(path), "--out", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cells = {c["id"]: c for c in report["cells"]}
    assert cells["fits"]["memory"] is None
    note = cells["over"]["memory"]
    assert "GPU memory" in note and "resident weights (r_w)" in note
    assert cells["over"]["simulated_tok_s"] > 0
    # one cell cannot be left out of a fit of one
    path.write_text(yaml.safe_dump({"cells": [over]}))
    assert main(["fit", str(path), "--out", str(tmp_path / "one")]) == 2
    assert "Leave-one-out" in capsys.readouterr().err


def test_the_fit_recovers_known_parameters(tmp_path):
    """Measurements simulated with known values, fitted back from the presets' values."""
    cells = [Cell.model_validate(_cell(id=f"{m}-{s}", machine=m, schedule=s,
                                       policy={"mu": mu, "n_ub": 4}))
             for m in ("t4", "l4") for s, mu in (("S1", 8), ("S3", 16))]
    params = free_parameters(cells)
    truth = {"t4 gpu.flops_eff": 0.1, "l4 gpu.flops_eff": 0.15,
             "flexgen kinds.CPUAttn.bytes_eff": 0.05}
    assert sorted(p.name for p in params) == sorted(truth)
    machines, impls = profiles(params, np.array([truth[p.name] for p in params]))
    doc = {"source": "synthetic", "cells": []}
    for c in cells:
        raw = c.model_dump(exclude_none=True)
        raw["measured_tok_s"] = simulated_tok_s(c, machines, impls)
        doc["cells"].append(raw)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    ticks: list[tuple[int, int]] = []
    report = run_fit(*load_measurements(path), loo=False,
                     progress=lambda done, total: ticks.append((done, total)))
    for p, v in zip(report.params, report.values):
        assert v == pytest.approx(truth[p.name], rel=0.03), p.name
    # progress at every step (issue 40: the fit was one step of minutes): each cell's datasheet
    # simulation, then each round's four least-squares starts and cell simulations (a pool
    # reports simulations that finish together at once)
    total = 3 * len(cells) + 2 * 4
    done = [d for d, _ in ticks]
    assert {t for _, t in ticks} == {total} and done[-1] == total
    assert done == sorted(set(done)) and len(done) >= 1 + 2 * (4 + 1)
    assert report.summary()["max_abs_error"] < 0.01
    json.dumps(report.to_json(), allow_nan=False)     # no leave-one-out: nulls, not NaN


def test_a_quantized_runs_unpacking_is_fitted_back():
    """Cells whose experts are stored in Q4_0 blocks inform the rate the kind that computes
    them unpacks them at (issue 37: a dequantization is an effect tg fit can fit); 16-bit
    cells do not. Measurements simulated with the CPU's experts unpacking at 40 G weights/s
    (EP at batch 1, a few of each layer's experts on the GPU, the rest on the CPU) are fitted
    back to it from the field's start."""
    def quantized(experts_gpu: int, precision: object = {"experts": "q4_0"}) -> Cell:
        return Cell.model_validate(_cell(
            id=f"ep-{experts_gpu}", system="llama.cpp", schedule="EP", machine="rtx4090",
            precision=precision, workload={"prompt_len": 16, "gen_len": 8},
            policy={"batch": 1, "experts_gpu": experts_gpu}))

    assert not any("dequant" in p.name for p in free_parameters(
        [quantized(2, "bf16"), quantized(4, "bf16")]))
    cells = [quantized(e) for e in (0, 2, 4, 6)]
    params = [p for p in free_parameters(cells) if "dequant" in p.name]
    assert [p.name for p in params] == ["llama.cpp kinds.CPUFFN.dequant_gweights",
                                        "llama.cpp kinds.GPUFFN.dequant_gweights"]
    # a streamed layer unpacks its experts inside its decode and prefill tasks
    layers = Cell.model_validate(_cell(precision={"experts": "q4_0"}))
    assert {p.name for p in free_parameters([layers]) if "dequant" in p.name} == {
        "moe-lightning kinds.PostAttn.dequant_gweights",
        "moe-lightning kinds.Prefill.dequant_gweights"}
    # a format in any case, the classes in any order: one precision
    assert quantized(0, {"head": "Q6_K", "experts": "Q4_0"}).precision == {
        "experts": "q4_0", "head": "q6_k"}
    truth = [40.0, 1e5]              # the GPU's: none to speak of
    machines, impls = profiles(params, np.array(truth))
    for c in cells:
        c.measured_tok_s = simulated_tok_s(c, machines, impls)
    result = fit_module.fit(cells, params)
    assert result.converged
    assert result.values[0] == pytest.approx(40.0, rel=0.03)
    # the GPU's few experts overlap the CPU's: above a rate that binds, no cell tells it
    assert result.values[1] > 40.0
    for c, sim in zip(cells, result.simulations):
        assert sim["throughput_tok_s"] == pytest.approx(c.measured_tok_s, rel=0.01), c.id


@pytest.mark.parametrize("precision, message", [
    ({"expert": "q4_0"}, "precision: 'expert' is no class of tensor"),
    ({"experts": "q4_z"}, "precision: experts: Unknown weight format 'q4_z'"),
    ({"experts": True}, "precision: experts: true is no format"),
    ({"experts": None}, "precision: experts: null is no format"),
    ("q4_k", "precision: 'q4_k' is neither fp16, bf16 nor a mapping"),
])
def test_a_cells_precision_names_classes_and_formats_tg_knows(tmp_path, capsys, precision,
                                                              message):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"cells": [_cell(precision=precision)]}))
    assert main(["fit", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_every_published_cell_simulates_with_its_stated_policy(capsys):
    """The paper ran these on 192 GB hosts; above the 0.8 planning headroom they run and warn."""
    _, cells = load_measurements(TABLE4)
    warned = 0
    for c in cells:
        doc = c.scenario_doc(c.machine, presets.IMPLEMENTATIONS[c.implementation_name])
        path_args = [f"--set=policy.{k}={v}" for k, v in doc["policy"].items()]
        scenario = "scenarios/t4.yaml"
        args = ["simulate", scenario, "--json", "--set", f"hardware={c.machine}",
                "--set", f"schedule={c.schedule}", "--set", "workload.gen_len=2",
                *path_args, *[f"--set=workload.{k}={v}" for k, v in doc["workload"].items()
                              if k != "gen_len"]]
        assert main(args) == 0, c.id
        out = json.loads(capsys.readouterr().out)
        warned += bool(out["warnings"])
    assert warned >= 9          # 9 of the 12 pass the CPU planning headroom


def test_the_search_keeps_the_planning_headroom():
    from taskgraph.perf.memory import check_fits, memory_footprint
    from taskgraph.dag.builder import make_plan
    from taskgraph.scenario import scenario_from_dict

    _, cells = load_measurements(TABLE4)
    c = next(c for c in cells if c.id.endswith("reasoning-t4-flexgen-c"))
    sc = scenario_from_dict(c.scenario_doc(c.machine, presets.IMPLEMENTATIONS["flexgen"]))
    report = memory_footprint(make_plan(sc))
    assert check_fits(report, "S3")                       # runs, with a warning
    with pytest.raises(TgError, match="usable_fraction"):
        check_fits(report, "S3", planning=True)
    tight = copy.deepcopy(presets.HARDWARE["t4"])
    tight["cpu"]["memory_gb"] = 150
    sc = scenario_from_dict(c.scenario_doc(tight, presets.IMPLEMENTATIONS["flexgen"]))
    with pytest.raises(TgError, match="reserve_gb"):
        check_fits(memory_footprint(make_plan(sc)), "S3")


@pytest.mark.heavy
def test_fitted_presets_predict_table4(tmp_path, capsys):
    """The shipped presets are what the fit finds, and every within-setting ranking is right.
    (Its leave-one-out error is bench/fidelity.py's to check, which CI runs: it fails when that
    error worsens.)"""
    assert main(["fit", TABLE4, "--no-loo", "--out", str(tmp_path / "fit"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["summary"]
    assert all(r["right"] for r in s["rankings"].values())
    assert s["max_abs_error"] <= 0.30
    # the presets carry what the fit finds
    fitted = {p["name"]: p["value"] for p in out["parameters"]}
    assert fitted["t4 gpu.flops_eff"] == pytest.approx(
        presets.HARDWARE["t4"]["gpu"]["flops_eff"], rel=0.02)
    assert fitted["flexgen kinds.CPUAttn.bytes_eff"] == pytest.approx(
        presets.IMPLEMENTATIONS["flexgen"]["kinds"]["CPUAttn"]["bytes_eff"], rel=0.02)
    assert {f.rsplit("/", 1)[-1] for f in out["files"]} >= {
        "hardware-t4.yaml", "implementation-flexgen.yaml", "parity.png", "report.json"}
    # the fitted profiles load as scenario sections
    assert main(["simulate", "scenarios/t4.yaml", "--json", "--schedule", "S3", "--set",
                 f"hardware={tmp_path / 'fit' / 'hardware-t4.yaml'}", "--set",
                 f"implementation={tmp_path / 'fit' / 'implementation-flexgen.yaml'}"]) == 0
    flexgen = json.loads(capsys.readouterr().out)["throughput_tok_s"]
    assert main(["simulate", "scenarios/t4.yaml", "--json", "--schedule", "S3"]) == 0
    assert json.loads(capsys.readouterr().out)["throughput_tok_s"] == pytest.approx(flexgen,
                                                                                   rel=0.02)


MULTI = "scenarios/measurements/moe-lightning-multi-gpu.yaml"


def test_the_multi_gpu_presets_predict_the_papers_2xt4_and_4xt4_cells():
    """The calibrated presets against published cells (the full fit with leave-one-out takes
    6 minutes: README): MoE-Lightning(p) at 32 tokens and DeepSpeed at 256 on both machines,
    within 15%; their 2 -> 4 GPU gains within 10% of the measured (2.77x and 2.10x, where this
    morning's model said 2.2x and 2.0x at 32 tokens: 1.61x measured), and MoE-Lightning(p) far
    above DeepSpeed on both."""
    from taskgraph.study.fit import simulated_tok_s

    _, cells = load_measurements(MULTI)
    sims = {}
    for c in cells:
        if c.workload["gen_len"] == {"S1": 32, "DS": 256}[c.schedule]:
            sims[c.machine, c.schedule] = (
                simulated_tok_s(c, presets.HARDWARE, presets.IMPLEMENTATIONS), c.measured_tok_s)
    for key, (sim, measured) in sims.items():
        assert sim == pytest.approx(measured, rel=0.15), key
    for schedule in ("S1", "DS"):
        gain = sims["4xt4", schedule][0] / sims["2xt4", schedule][0]
        assert gain == pytest.approx(sims["4xt4", schedule][1] / sims["2xt4", schedule][1],
                                     rel=0.1)
    for machine in ("2xt4", "4xt4"):
        assert sims[machine, "S1"][0] > 5 * sims[machine, "DS"][0]
    # DeepSpeed's batch of 32 is each GPU's: its cells are data parallel, 32 a GPU
    ds = next(c for c in cells if c.schedule == "DS" and c.machine == "4xt4")
    assert ds.scenario().policy.N == 4 * 32


def test_a_fit_that_does_not_converge_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import scipy.optimize

    real = scipy.optimize.least_squares

    def stuck(*args, **kwargs):
        res = real(*args, **{**kwargs, "max_nfev": 1})
        res.status, res.message = 0, "The maximum number of function evaluations is exceeded."
        return res

    monkeypatch.setattr(scipy.optimize, "least_squares", stuck)
    cells = [_cell(id=f"c{i}", policy={"mu": 8, "n_ub": 2 + i}) for i in range(2)]
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"cells": cells}))
    assert main(["fit", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "did not converge" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


SMALL_BATCH = "scenarios/measurements/small-batch-fiddler-artifact.yaml"


def test_a_published_table_reads_as_it_is_printed(tmp_path):
    """The small-batch artifact's form: the model and precision once for the file, each cell
    flat (batch, lengths, experts resident per layer, the CSV row it quotes), machines as the
    artifact's folders name them, the system's own implementation profile."""
    path = tmp_path / "m.yaml"
    cell = {"id": "ec", "system": "Mixtral-offloading", "schedule": "EC", "machine": "Ada6000",
            "experts_resident_per_layer": 1, "batch": 4, "prompt_len": 64, "gen_len": 8,
            "quote": "64, 8, 4, 1.0, 32.0", "measured_tok_s": 1.29}
    path.write_text(yaml.safe_dump({"model": "mixtral-8x7b", "precision": "bf16",
                                    "cells": [cell, {**{k: v for k, v in cell.items()
                                                        if k != "experts_resident_per_layer"},
                                                     "id": "l4", "machine": "L4",
                                                     "schedule": "DS", "system": "DeepSpeed"}]}))
    _, (ec, ds) = load_measurements(path)
    assert (ec.machine, ec.model, ec.implementation_name) == ("ada6000", "mixtral-8x7b",
                                                              "mixtral-offloading")
    assert ds.machine == "l4" and ds.implementation_name == "deepspeed"
    sc = ec.scenario()
    assert (sc.policy.N, sc.policy.mu, sc.policy.experts_gpu) == (4, 4, 1)
    assert (sc.workload.prompt_len, sc.workload.gen_len) == (64, 8)
    assert sc.implementation.name == "mixtral-offloading"
    # a precision tg's presets do not hold is refused, naming the field
    path.write_text(yaml.safe_dump({"model": "mixtral-8x7b", "precision": "int4",
                                    "cells": [cell]}))
    with pytest.raises(TgError, match="cell 'ec': precision"):
        load_measurements(path)


def test_the_small_batch_artifact_loads_whole():
    source, cells = load_measurements(SMALL_BATCH)
    assert "efeslab/fiddler" in source and len(cells) == 16
    assert {c.machine for c in cells} == {"l4", "ada6000", "rtx-a6000"}
    assert {c.implementation_name for c in cells} == {"deepspeed", "mixtral-offloading"}
    # three a layer on both 48 GB cards: the RTX 6000 Ada's by its runs' times (the file says why)
    assert {c.scenario().policy.experts_gpu for c in cells if c.schedule == "EC"} == {3}


def test_deepspeeds_shared_host_gather_does_not_price_one_gpu():
    """ZeRO-3's gather through the 2xT4/4xT4 host (fitted there at 20% of each link) is that
    host's mechanism: one GPU's gather streams at its own link's rate (issue 36)."""
    from taskgraph.kinds import KIND_INDEX
    from taskgraph.perf.cost import CostModel
    from taskgraph.specs import HardwareSpec, ImplementationSpec

    ds = ImplementationSpec.model_validate(presets.IMPLEMENTATIONS["deepspeed"])
    d3 = KIND_INDEX["D3"]
    one = CostModel(HardwareSpec.model_validate(presets.HARDWARE["t4"]), ds)
    two = CostModel(HardwareSpec.model_validate(presets.HARDWARE["2xt4"]), ds)
    assert one.kind_bytes_eff[d3] == 1.0
    assert two.kind_bytes_eff[d3] == pytest.approx(0.2024)


def test_each_mechanism_is_fitted_by_the_runs_that_inform_it():
    """A one-GPU file fits no shared-host figure; a machine's link is fitted where DeepSpeed
    streams every weight across it on one GPU (and only there); Mixtral-offloading has nothing
    of its own to fit (its swaps run at the link's rates)."""
    _, cells = load_measurements(SMALL_BATCH)
    names = {p.name for p in free_parameters(cells)}
    assert names == {"l4 link.h2d_eff", "ada6000 link.h2d_eff", "rtx-a6000 link.h2d_eff"}
    assert not any("several_gpus_kinds" in n or "shared" in n for n in names)
    ec_only = [c for c in cells if c.schedule == "EC"]
    assert not any("link" in p.name for p in free_parameters(ec_only))
    _, multi = load_measurements(MULTI)
    assert "deepspeed several_gpus_kinds.D3.bytes_eff" in {p.name for p in
                                                          free_parameters(multi)}


def test_leave_one_out_forgets_what_only_the_left_out_cell_informed():
    """Two machines, a cell each: leaving the T4's out, nothing else informs the T4's GEMM
    rate, so its prediction is the model's before any fit (the datasheet figure), not the full
    fit's (as it was before 2026-11-27), which that cell made."""
    from taskgraph.study.fit import _LeaveOut

    cells = [Cell.model_validate(_cell(id=m, machine=m)) for m in ("t4", "l4")]
    params = free_parameters(cells)
    loo, _ = _LeaveOut(tuple(cells), (0,), tuple(params), (1.0, 1.0)).run()
    by_name = dict(zip((p.name for p in params), loo))
    assert by_name["t4 gpu.flops_eff"] == next(p.datasheet for p in params
                                               if p.name == "t4 gpu.flops_eff")


def test_the_presets_predict_the_small_batch_cells():
    """The fitted presets (one GPU: DeepSpeed's gather at the link's rate, each machine's link,
    Mixtral-offloading's swaps at it) against cells of the artifact, within 15%. The artifact's L4 is
    the exception the docs name: DeepSpeed moved 10 GB/s there, where the paper's L4 machine's
    measured link (the l4 preset) says 17."""
    _, cells = load_measurements(SMALL_BATCH)
    for c in cells:
        if c.id in ("ada-ds-b1", "ada-ec-b4", "ada-ec-b16", "a6000-ds-b1", "a6000-ec3-b1"):
            sim = simulated_tok_s(c, presets.HARDWARE, presets.IMPLEMENTATIONS)
            assert sim == pytest.approx(c.measured_tok_s, rel=0.15), c.id
        if c.id == "l4-ds-b1":
            assert simulated_tok_s(c, presets.HARDWARE, presets.IMPLEMENTATIONS) > \
                1.3 * c.measured_tok_s


def test_several_files_fit_as_one_and_each_is_left_out_whole(tmp_path, capsys):
    """Two files, a machine each: one parameter set, each file's errors apart, and leaving a
    file out leaves its machine's GEMM rate to the datasheet (nothing else informs it)."""
    files = []
    for m in ("t4", "l4"):
        path = tmp_path / f"{m}.yaml"
        path.write_text(yaml.safe_dump({"source": f"{m} runs", "cells": [
            _cell(id=f"{m}-{n}", machine=m, policy={"mu": 8, "n_ub": n},
                  measured_tok_s=8.0 + n) for n in (2, 4)]}))
        files.append(str(path))
    assert main(["fit", *files, "--leave-out", "file", "--out", str(tmp_path / "out"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["summary"]
    assert s["leave_out"] == "file" and sorted(s["by_file"]) == sorted(files)
    assert all(e["cells"] == 2 and e["loo_median_abs_error"] is not None
               for e in s["by_file"].values())
    assert out["source"] == "t4 runs + l4 runs"
    report = run_fit(*load_many(files), leave_out="file")
    names = [p.name for p in report.params]
    t4 = names.index("t4 gpu.flops_eff")
    assert report.loo_values[files[0]][t4] == report.params[t4].datasheet
    # a machine left out is the same here: each file is one machine
    by_machine = run_fit(*load_many(files), leave_out="machine")
    assert sorted(by_machine.loo_values) == ["l4", "t4"]
    assert [r.loo for r in by_machine.cells] == [r.loo for r in report.cells]
    # the table a person reads says what was left out, and each file's errors
    assert main(["fit", *files, "--leave-out", "file", "--out", str(tmp_path / "o2")]) == 0
    shown = capsys.readouterr().out
    assert "leaving each file out" in shown and f"{files[0]}: median |error|" in shown


def test_a_cell_id_names_one_cell_across_files(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for path in (a, b):
        path.write_text(yaml.safe_dump({"cells": [_cell(), _cell(id="d")]}))
    assert main(["fit", str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"'{b}' and '{a}' both have a cell called 'c'" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_runs_that_differ_in_generation_length_give_prefill_and_step_times(tmp_path, capsys):
    """Three runs of one policy at 8, 16 and 32 tokens, made to measure 100 s of prefill and
    2 s a step then 3 s a step: the report recovers those from their throughputs, sets the
    simulated differences beside them, and draws them (steps.png)."""
    cells = []
    for gen, run_s in ((8, 100 + 8 * 2), (16, 100 + 16 * 2), (32, 100 + 16 * 2 + 16 * 3)):
        cells.append(_cell(id=f"g{gen}", workload={"preset": "helm-reasoning", "gen_len": gen,
                                                   "padded": True},
                           measured_tok_s=32 * gen / run_s))
    cells.append(_cell(id="other", policy={"mu": 8, "n_ub": 2}))    # another policy: alone
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"cells": cells}))
    assert main(["fit", str(path), "--no-loo", "--out", str(tmp_path / "out"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (group,) = out["phases"]
    assert group["cells"] == ["g8", "g16", "g32"]
    assert group["prefill_s"]["measured"] == pytest.approx(100)
    assert [s["measured_s"] for s in group["steps"]] == pytest.approx([2, 3])
    assert [(s["from_gen"], s["to_gen"]) for s in group["steps"]] == [(8, 16), (16, 32)]
    assert all(s["simulated_s"] > 0 for s in group["steps"])
    from tests.helpers import assert_drawn
    assert_drawn(tmp_path / "out" / "steps.png")
    # what a person reads: the same figures in a table
    assert main(["fit", str(path), "--no-loo", "--out", str(tmp_path / "o2")]) == 0
    shown = capsys.readouterr().out
    assert "prefill (extrapolated)" in shown and "a step, 16-32 generated" in shown
    assert "nan" not in shown     # no leave-one-out: its columns say so with a dash


def test_leaving_a_machine_out_keeps_what_the_others_measured_of_a_shared_part():
    """The T4 of t4 and 2xt4 is one GPU part: leaving the one-GPU cell out, the 2xT4 cell still
    measures the T4's GEMM rate, so the refit's value prices the left-out cell, not the
    datasheet's (a part named by fewer machines after the refit is the same part)."""
    from taskgraph.study.fit import _LeaveOut

    cells = [Cell.model_validate(_cell(id=m, machine=m)) for m in ("t4", "2xt4")]
    params = free_parameters(cells)
    names = [p.name for p in params]
    assert "2xt4+t4 gpu.flops_eff" in names
    loo, _ = _LeaveOut(tuple(cells), (0,), tuple(params), (1.0, 1.0)).run()
    shared = dict(zip(names, loo))["2xt4+t4 gpu.flops_eff"]
    rest = free_parameters(cells[1:])
    from taskgraph.study.fit import fit as refit
    alone = refit(cells[1:], rest, rounds=0, corrections=np.ones(1)).values
    assert shared == pytest.approx(dict(zip((p.name for p in rest), alone))[
        "2xt4 gpu.flops_eff"])
    assert shared != params[names.index("2xt4+t4 gpu.flops_eff")].datasheet


def test_phases_group_by_model_and_read_lengths_from_presets_and_say_when_runs_do_not_grow(
        tmp_path):
    from taskgraph.study.fit import CellReport, phases

    def report(cell, simulated):
        r = CellReport(Cell.model_validate(cell))
        r.simulated = simulated
        return r

    mtbench = {"preset": "mtbench", "padded": True}       # gen_len from the preset: 128
    rows = [report(_cell(id="a", workload=mtbench, measured_tok_s=10.0), 10.0),
            report(_cell(id="b", workload={**mtbench, "gen_len": 64}, measured_tok_s=8.0), 8.0),
            # another model, the same policy and prompts: its own runs
            report(_cell(id="c", model="mixtral-8x22b", workload={**mtbench, "gen_len": 64},
                         measured_tok_s=3.0), 3.0)]
    (group,) = phases(rows)
    assert group["cells"] == ["b", "a"] and group["note"] is None
    # the context is what the KV cache holds: the padded prompt (418) and the tokens so far
    assert group["steps"][0]["context"] == pytest.approx(418 + 96)
    # a longer run that took less time: no phases of one run, and no prefill made up
    rows[0] = report(_cell(id="a", workload=mtbench, measured_tok_s=100.0), 10.0)
    (group,) = phases(rows)
    assert group["note"] and group["prefill_s"]["measured"] is None


def test_systems_on_one_policy_give_what_one_costs_over_the_other_from_the_measurements_alone():
    """Table 4 runs FlexGen and FlexGen(c) at one policy on each machine and workload: their
    measured run times' difference a generated token is CPU attention's cost over GPU
    attention's, with nothing simulated in it. By hand from the published throughputs, L4
    reasoning: (2112 x 50 / 20.015 - 2112 x 50 / 50.138) / 50 = 63.40 s; T4 reasoning:
    1952 / 16.903 - 1952 / 22.691 = 29.46 s. MoE-Lightning(p) ran its own policy: no pair."""
    from rich.console import Console

    from taskgraph.output.report import differences_table
    from taskgraph.study.fit import CellReport, system_differences

    _, cells = load_measurements(TABLE4)
    rows = []
    for c in cells:
        r = CellReport(c)
        r.simulated = c.measured_tok_s * (0.5 if c.id.endswith("flexgen-c") else 1.0)
        rows.append(r)
    # a second run of FlexGen on the L4's reasoning policy, its name with a space after it:
    # not a system over another
    again = CellReport(Cell.model_validate({**cells[4].model_dump(exclude_unset=True),
                                            "id": "again", "system": "FlexGen ",
                                            "measured_tok_s": 40.0}))
    again.simulated = 40.0
    assert cells[4].id == "table4-synthetic-reasoning-l4-flexgen"
    found = {d["cells"][0]: d for d in system_differences([*rows, again])}
    assert sorted(found) == sorted(c.id for c in cells if c.id.endswith("flexgen-c"))
    l4 = found["table4-synthetic-reasoning-l4-flexgen-c"]
    assert l4["systems"] == ["FlexGen(c)", "FlexGen"]
    assert l4["cells"][1] == "table4-synthetic-reasoning-l4-flexgen"
    assert l4["measured_s"] == pytest.approx(63.40, abs=0.01)
    assert found["table4-synthetic-reasoning-t4-flexgen-c"]["measured_s"] == pytest.approx(
        29.46, abs=0.01)
    # the simulated runs' difference: FlexGen(c) at half its measured rate takes twice as long
    assert l4["simulated_s"] == pytest.approx(2 * 2112 / 20.015 - 2112 / 50.138, rel=1e-6)
    assert l4["label"] == "l4 helm-reasoning, 50 generated"
    # a length the cells take from their workload's preset (HELM reasoning: 50) is named too
    bare = []
    for r in rows[3:5]:
        workload = {k: v for k, v in r.cell.workload.items() if k != "gen_len"}
        bare.append(CellReport(r.cell.model_copy(update={"workload": workload})))
        bare[-1].simulated = r.simulated
    assert [d["label"] for d in system_differences(bare)] == ["l4 helm-reasoning, 50 generated"]
    console = Console(width=120, record=True)
    console.print(differences_table(list(found.values())))
    shown = console.export_text()
    assert "FlexGen(c) over FlexGen" in shown and "63.4" in shown


def test_a_field_given_flat_and_nested_and_a_file_given_twice_are_refused(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    cell = _cell(policy={"mu": 8, "n_ub": 4, "batch": None})
    cell["policy"].pop("batch")
    path.write_text(yaml.safe_dump({"cells": [{**cell, "gen_len": 8}]}))
    assert main(["fit", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "gen_len is given twice" in err and "Traceback" not in err
    path.write_text(yaml.safe_dump({"cells": [_cell(), _cell(id="d")]}))
    assert main(["fit", str(path), str(tmp_path / "." / "m.yaml"), "--out",
                 str(tmp_path / "o")]) == 2
    assert "is given twice" in capsys.readouterr().err
    # a misspelt field at the top is not a silent default
    path.write_text(yaml.safe_dump({"precison": "bf16", "cells": [_cell(), _cell(id="d")]}))
    assert main(["fit", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "'precison' at its top" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["scenarios/t4.yaml", "scenarios/4xt4-8x22b.yaml",
                                  "scenarios/gpt-oss-120b-4090.yaml"])
def test_lengths_predicted_at_once_are_each_predicted_alone(path):
    """The fit predicts cells that differ only in length from the longest (predict_lengths):
    every figure equal but for rounding (numpy sums a step's rows in another order where a run
    has one step), on one GPU, four in tensor parallel with a shared host, and sliding-window
    layers."""
    from taskgraph.dag.schedules import SCHEDULES
    from taskgraph.perf.predict import predict, predict_lengths
    from taskgraph.scenario import load_scenario

    lengths = [1, 7, 50, 128]
    longest = load_scenario(path, ["workload.gen_len=128"])
    together = predict_lengths(longest, SCHEDULES[longest.schedule], lengths)
    for length, got in zip(lengths, together):
        alone = load_scenario(path, [f"workload.gen_len={length}"])
        want = predict(alone, SCHEDULES[alone.schedule])
        for name in ("n", "throughput_tok_s", "prefill_s", "decode_s", "decode_layer_ms",
                     "hrm_layer_ms", "binding"):
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-12,
                                       atol=0, err_msg=f"{name} at {length} tokens")


def test_a_fit_groups_only_cells_alike_but_in_length():
    _, cells = load_measurements("scenarios/measurements/moe-lightning-multi-gpu.yaml")
    groups = fit_module._alike(cells)
    assert sorted(i for g in groups for i in g) == list(range(len(cells)))
    for g in groups:
        docs = [cells[i].scenario_doc(cells[i].machine, cells[i].implementation_name)
                for i in g]
        assert len({c["workload"]["gen_len"] for c in docs}) == len(g)
        for d in docs:
            del d["name"], d["workload"]["gen_len"]
        assert all(d == docs[0] for d in docs)
    # the 2xT4 and 4xT4 MoE-Lightning runs: gen 32, 64, 128, 256 each
    assert sorted(len(g) for g in groups)[-2:] == [4, 4]


def test_a_fit_that_would_write_a_profile_over_its_measurements_is_refused_before_it_runs(
        tmp_path, capsys, monkeypatch):
    """The measurements saved as out/hardware-t4.yaml, the profile a fit of t4 cells writes
    there: refused before any fitting (it was refused only after the fit)."""
    out = tmp_path / "out"
    out.mkdir()
    measurements = out / "hardware-t4.yaml"
    measurements.write_text(yaml.safe_dump({"source": "t4 runs", "cells": [
        _cell(id=f"t4-{n}", policy={"mu": 8, "n_ub": n}, measured_tok_s=8.0 + n)
        for n in (2, 4)]}))
    before = measurements.read_text()

    def fitted(*args, **kwargs):
        raise AssertionError("the fit ran")
    monkeypatch.setattr(fit_module, "run_fit", fitted)
    assert main(["fit", str(measurements), "--no-loo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "hardware-t4.yaml" in err and "input" in err, err
    assert measurements.read_text() == before
