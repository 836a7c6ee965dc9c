"""tg calibrate and tg validate on the CPU backend (small, so CI can run them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from taskgraph.cli import main  # noqa: E402
from taskgraph.scenario import load_scenario  # noqa: E402
from taskgraph.specs import PREFETCH_PUBLISHED  # noqa: E402
from taskgraph.tracing.check import check_trace, load_trace  # noqa: E402
from tests.helpers import assert_drawn  # noqa: E402


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "cpu.yaml"
    assert main(["calibrate", "scenarios/tiny.yaml", "--out", str(path), "--json"]) == 0
    return path


def test_calibration_is_a_hardware_profile(profile):
    sc = load_scenario("scenarios/tiny.yaml", [f"hardware={profile}"])
    hw = sc.hardware
    assert hw.calibrated and "CPU backend" in hw.calibrated
    assert hw.gpu.tflops > 0 and hw.cpu.mem_gbps > 0 and hw.link.h2d_gbps > 0
    # per-kind costs fitted from the executor's own tasks, for every kind it ran
    assert {"PreAttn", "PostAttn", "CPUAttn", "GPUAttn", "D3"} <= hw.task_overhead_us.keys()
    # and those only the expert-level schedules run (EP and EC at batch 1): unfitted, Route and
    # GPUFFN were priced at a launch's cost, on an H200 a fortieth and a fifth of what they took
    assert {"Route", "GPUFFN", "Merge", "CPUFFN", "ExpertIn"} <= hw.task_overhead_us.keys()
    # usable as a base with overrides, too
    sc = load_scenario("scenarios/tiny.yaml", [f"hardware.file={profile}",
                                               "hardware.link.h2d_gbps=1"])
    assert sc.hardware.link.h2d_gbps == 1


@pytest.mark.parametrize("schedule,kind,sequences", [("EP", "CPUFFN", 1), ("S1", "PostAttn", 2)])
def test_the_executors_dequantization_is_measured_and_priced(profile, schedule, kind, sequences):
    """tg calibrate times the executor's experts stored in Q4_0 blocks (EP at batch 1, whose
    CPUFFN unpacks them on the CPU; S1, whose PostAttn unpacks a streamed layer's) and writes
    the rate each kind dequantizes them at; priced with it, a Q4_0 run's tasks of that kind are
    as long as they ran. Without it (the stored bytes at the fp32 run's rate) they were priced
    several times short: each read unpacks the blocks through fp32 temporaries. Compared on one
    run, so the machine's speed cancels."""
    from taskgraph.dag.compiled import KIND_NAMES
    from taskgraph.exec.execute import execute_scenario
    from taskgraph.perf.cost import CostModel
    from taskgraph.scenario import for_schedule

    sc = load_scenario("scenarios/tiny.yaml", [
        f"hardware={profile}", "model.precision.experts=q4_0", f"policy.N={sequences}",
        "policy.mu=1", "policy.experts_gpu=2", "workload.gen_len=8"])
    assert sc.hardware.task_dequant_gweights.get(kind, 0) > 0
    # tensor parallelism's expert part is priced as the kind it splits, which one GPU times
    from taskgraph.kinds import KIND_INDEX
    unpacks = CostModel(sc.hardware, expert_bits=4.5).kind_dequant
    assert "MoE" not in sc.hardware.task_dequant_gweights
    assert unpacks[KIND_INDEX["MoE"]] == unpacks[KIND_INDEX["PostAttn"]] > 0
    ex = execute_scenario(for_schedule(sc, schedule)[0], schedule, device="cpu", check=False)
    prog, run = ex.program, ex.run
    tasks = (prog.column("kind") == KIND_NAMES.index(kind)) & run.finished
    assert tasks.sum() >= 10

    def error(hw) -> float:
        """Median |log(priced / measured)| of the run's tasks of that kind."""
        priced = prog.durations(CostModel(hw, expert_bits=sc.model.bits("experts")))
        return float(np.median(np.abs(np.log(priced[tasks] / run.durations[tasks]))))

    without = sc.hardware.model_copy(update={"task_dequant_gweights": {}})
    assert error(sc.hardware) < error(without) - np.log(2)   # at least twice as close


def test_a_dequantization_run_that_fails_leaves_its_kinds_unfitted(profile, monkeypatch):
    """Where a quantized run cannot execute here, its kinds get no rate and a finding says
    which and why, while the other run's kinds are still fitted: the profile is written, not
    the calibration aborted."""
    from taskgraph.errors import TgError
    from taskgraph.study import calibrate

    measure = calibrate._MeasuredTasks.measure

    def s1_fails(self, sc, schedule, skip=frozenset()):
        if schedule == "S1":
            raise TgError("no room for the streamed layer")
        return measure(self, sc, schedule, skip)

    monkeypatch.setattr(calibrate._MeasuredTasks, "measure", s1_fails)
    sc = load_scenario("scenarios/tiny.yaml", [
        f"hardware={profile}", "policy.N=1", "policy.mu=1", "policy.experts_gpu=2",
        "workload.gen_len=8"])
    rates, findings = calibrate._fit_dequant(sc, sc.hardware, {}, "cpu", repeats=1)
    assert rates.get("CPUFFN", 0) > 0
    assert not {"PostAttn", "Prefill"} & rates.keys()
    assert len(findings) == 1
    assert findings[0].startswith("PostAttn, Prefill: no dequantization rate, S1 with q4_0")
    assert "no room for the streamed layer" in findings[0]


def test_a_dequantization_rate_prices_only_weights_below_16_bits():
    """A kind's unpacking adds the experts' weights over its rate to the task, at any precision
    below 16 bits and at none other; the calibrated figure takes the implementation's place."""
    from taskgraph.perf.cost import CostModel
    from taskgraph.presets import HARDWARE
    from taskgraph.specs import HardwareSpec, ImplementationSpec

    hw = HardwareSpec.model_validate(HARDWARE["t4"])
    impl = ImplementationSpec(name="x", kinds={"CPUFFN": {"dequant_gweights": 2.0}})
    nbytes = 4.5e8                                       # 800 M weights at 4.5 bits
    plain = CostModel(hw, impl, 16.0).time("cpu", 0.0, nbytes, "CPUFFN")
    assert CostModel(hw, impl, 32.0).time("cpu", 0.0, nbytes, "CPUFFN") == plain
    assert CostModel(hw, impl, 4.5).time("cpu", 0.0, nbytes, "CPUFFN") == pytest.approx(
        plain + 8e8 / 2e9)
    assert CostModel(hw, impl, 4.5).time("cpu", 0.0, nbytes, "GPUFFN") == CostModel(
        hw, impl, 16.0).time("cpu", 0.0, nbytes, "GPUFFN")
    calibrated = hw.model_copy(update={"task_dequant_gweights": {"CPUFFN": 0.5}})
    assert CostModel(calibrated, impl, 4.5).time("cpu", 0.0, nbytes, "CPUFFN") == pytest.approx(
        plain + 8e8 / 0.5e9)


def test_a_cost_per_expert_is_told_from_the_bytes():
    """Tasks of two expert sizes, priced fixed + bytes x slope + experts x each: the fit finds
    the three, where one size alone (experts proportional to bytes) cannot; with no byte term
    the roof prices the bytes and the fit finds the rest."""
    from taskgraph.study.calibrate import _fit_expert_cost

    rng = np.random.default_rng(0)
    experts = np.concatenate([rng.integers(1, 3, 40), rng.integers(4, 12, 40)]).astype(float)
    size = np.concatenate([np.full(40, 4e6), np.full(40, 1e6)])      # bytes an expert
    x = experts * size
    alone = 50e-6 + x / 5e9 + experts * 80e-6
    alone[::17] *= 3                                                  # preempted tasks
    fixed, slope, each = _fit_expert_cost(x, experts, np.zeros_like(x), alone)
    assert (fixed, 1 / slope, each) == pytest.approx((50e-6, 5e9, 80e-6), rel=1e-6)
    roof = x / 5e9
    fixed, slope, each = _fit_expert_cost(x, experts, roof, 50e-6 + roof + experts * 80e-6)
    assert each == pytest.approx(80e-6, rel=1e-6) and fixed == pytest.approx(50e-6, rel=1e-6)


def test_a_cost_per_expert_prices_each_expert_a_task_touches():
    """The simulator counts a task's experts by its bytes (one expert's as stored) and adds each
    one's cost to the task's roofline time; without an expert size, or for other kinds,
    nothing."""
    from taskgraph.perf.cost import CostModel
    from taskgraph.presets import HARDWARE
    from taskgraph.specs import HardwareSpec

    hw = HardwareSpec.model_validate(HARDWARE["t4"])
    each = hw.model_copy(update={"task_expert_us": {"GPUFFN": 100.0}})
    plain = CostModel(hw, expert_bytes=3e8).time("gpu", 1e12, 9e8, "GPUFFN")
    assert CostModel(each, expert_bytes=3e8).time("gpu", 1e12, 9e8, "GPUFFN") == pytest.approx(
        plain + 3 * 100e-6)
    assert CostModel(each).time("gpu", 1e12, 9e8, "GPUFFN") == plain
    assert CostModel(each, expert_bytes=3e8).time("cpu", 0.0, 9e8, "CPUFFN") == CostModel(
        hw, expert_bytes=3e8).time("cpu", 0.0, 9e8, "CPUFFN")


def test_a_copy_line_no_copy_follows_is_a_finding():
    """A copy kind fitted at under a tenth of its resource's measured rate, or with a fixed cost
    of many copy latencies, is named with both figures (on an H200 a KVOut line at 0.13 GB/s
    priced another model's copies 8x too long); a compute kind's line is not judged so."""
    from taskgraph.dag.schedules import RESOURCES
    from taskgraph.perf.cost import CostModel
    from taskgraph.presets import HARDWARE
    from taskgraph.specs import HardwareSpec
    from taskgraph.study.calibrate import _implausible, _MeasuredTasks, _Samples

    hw = HardwareSpec.model_validate(HARDWARE["t4"])       # links of 15.75 GB/s x 0.8, 10 µs
    tasks = _MeasuredTasks(CostModel(hw), "cpu")
    tasks.samples = {kind: _Samples(RESOURCES.index(r)) for kind, r in
                     (("KVOut", "d2h"), ("D3", "h2d"), ("D1", "d2h"), ("PostAttn", "gpu"))}
    fixed = {"KVOut": 0.0, "D3": 900.0, "D1": 30.0, "PostAttn": 5000.0}
    gbps = {"KVOut": 0.16, "D3": 11.0, "D1": 9.0, "PostAttn": 0.01}
    found = _implausible(tasks, fixed, gbps)
    assert len(found) == 2
    assert found[0].startswith("KVOut's bytes were fitted at 0.16 GB/s") and "12.6 GB/s" in found[0]
    assert found[1].startswith("D3's fixed cost was fitted at 900 µs, 90x the copy latency")


def test_cuda_rates_make_a_valid_profile(monkeypatch):
    """The CUDA profile's mapping, checked without a GPU: the pinned link figures become the
    link, the launch cost the GPU's per-task overhead, and the whole validates."""
    import types

    import torch

    from taskgraph.exec.microbench import base_profile
    from taskgraph.specs import HardwareSpec

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        name="Fake GPU", total_memory=80e9))
    rates = {"gpu_gemm_flops": 700e12, "gpu_mem_bytes_per_s": 3000e9, "cpu_gemm_flops": 2e12,
             "attn_bytes_per_s": 100e9, "memcpy_bytes_per_s": 20e9,
             "h2d_pinned_bytes_per_s": 50e9, "h2d_pageable_bytes_per_s": 20e9,
             "d2h_pinned_bytes_per_s": 45e9, "d2h_pageable_bytes_per_s": 15e9,
             "copy_latency_s": 8e-6, "launch_s": 5e-6}
    hw = HardwareSpec.model_validate(base_profile("cuda", rates))
    assert hw.calibrated.endswith("(CUDA)")
    assert (hw.gpu.tflops, hw.gpu.memory_gb, hw.gpu.task_overhead_us) == (700, 80, 5)
    assert (hw.link.h2d_gbps, hw.link.d2h_gbps, hw.link.latency_us) == (50, 45, 8)
    assert hw.link.pageable_h2d_gbps == 20
    assert (hw.cpu.mem_gbps, hw.cpu.memcpy_gbps, hw.cpu.tflops) == (100, 20, 2)


def test_validate_end_to_end(profile, tmp_path, capsys):
    trace, plot = tmp_path / "v.json.gz", tmp_path / "parity.png"
    assert main(["validate", "scenarios/tiny.yaml", "--set", f"hardware={profile}",
                 "--set", "workload.gen_len=2", "--schedules", "S1,S3", "--mu", "2",
                 "--repeats", "1", "--trace", str(trace), "--plot", str(plot), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"simulated", "measured", "error", "accuracy", "pairs"} <= out.keys()
    assert {"decode_layer", "per_task_median"} <= out["error"].keys()
    assert len(out["pairs"]) == 2 and out["accuracy"]["pairs"] == 2
    assert all(p["measured"]["max_abs_err"] < 1e-4 for p in out["pairs"])
    loaded = load_trace(trace)
    assert check_trace(loaded) == []
    procs = sorted(e["args"]["name"] for e in loaded["traceEvents"]
                   if e["name"] == "process_name")
    assert procs == ["1. S1 mu=2 simulated", "2. S1 mu=2 measured", "3. S3 mu=2 simulated",
                     "4. S3 mu=2 measured"]
    assert_drawn(plot)
    # each kind's measured median is the median of that kind's slices in the measured trace
    pid = next(e["pid"] for e in loaded["traceEvents"]
               if e["name"] == "process_name" and e["args"]["name"] == "2. S1 mu=2 measured")
    medians = out["pairs"][0]["per_kind_median_ms"]
    for kind in ("PreAttn", "CPUAttn", "PostAttn"):
        durs = [e["dur"] for e in loaded["traceEvents"]
                if e["ph"] == "X" and e["pid"] == pid and e["name"] == kind]
        assert medians[kind]["measured"] == pytest.approx(np.median(durs) / 1e3, abs=2e-6)
        sim, meas = medians[kind]["simulated"], medians[kind]["measured"]
        assert out["pairs"][0]["error"]["per_task_median"][kind] == pytest.approx(
            sim / meas - 1, abs=1e-3)


def test_what_a_process_pays_once_is_not_measured(monkeypatch):
    """On a GPU the first run in a process loads each kernel at its first call (85-113 ms a
    prefill task on an H200, 1.5-8 ms later). Here the first execution in the process is made
    0.5 s slower in every task: neither validate's pairs nor calibrate's fit may see it."""
    from taskgraph.exec import execute
    from taskgraph.study import calibrate
    from taskgraph.study.validate import validate_scenario

    real = execute.execute_scenario

    def first_call_slow(sc, schedule, **kwargs):
        ex = real(sc, schedule, **kwargs)
        if not ran:
            ex.run.end += 0.5
            ex.run.durations += 0.5
            ex.figures["decode_layer_ms"] += 500
        ran.append(ex)
        return ex

    monkeypatch.setattr(execute, "execute_scenario", first_call_slow)
    sc = load_scenario("scenarios/tiny.yaml")
    ran: list = []
    result = validate_scenario(sc, ["S1"], [2], repeats=1)
    assert result.results[0].measured["decode_layer_ms"] < 100
    ran.clear()
    monkeypatch.setattr(calibrate, "FIT_RUNS", (("S1", 2),))
    monkeypatch.setattr(calibrate, "EXPERT_RUNS", ())
    fit = calibrate.fit_tasks(sc, sc.hardware.model_dump(), repeats=1)
    assert max(fit.fixed_us.values()) < 1e5


def test_validate_runs_several_gpus_task_by_task(profile, capsys):
    """Tensor-parallel shards and pipeline stages executed and simulated side by side: every
    kind they add (the parts between all-reduces, collectives, sends) gets a per-kind error."""
    assert main(["validate", "scenarios/tiny.yaml", "--set", f"hardware={profile}",
                 "--set", "hardware.gpu.count=2", "--set", "workload.gen_len=2",
                 "--schedules", "S1,PP", "--mu", "2", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(p["measured"]["max_abs_err"] < 1e-4 for p in out["pairs"])
    kinds = set(out["pairs"][0]["per_kind_median_ms"]) | set(out["pairs"][1]["per_kind_median_ms"])
    assert {"OProj", "MoE", "AllReduceAttn", "AllReduce", "GatherLogits", "Send"} <= kinds


#: An expert schedule at batch 1, as the expert-routing tests validate it.
BATCH_1 = ["policy.N=1", "policy.mu=1", "policy.experts_gpu=2", "workload.gen_len=6"]


def test_validate_simulates_ecp_at_the_prefetch_the_executor_achieved(capsys, tmp_path):
    """The simulator has no predictor: ECP's simulation takes policy.prefetch, the share of the
    misses copied ahead, as given. Validation gives it the executor's own (``covered``), not
    the published figure an unset one stands for, says so in the pair's policy, and simulates
    with it: the pair's simulation is the scenario's at that share (on the run's routing, as
    below)."""
    from taskgraph import api

    sets = BATCH_1
    assert main(["validate", "scenarios/tiny.yaml", *sum((["--set", x] for x in sets), []),
                 "--schedules", "EC,ECP", "--mu", "1", "--repeats", "1", "--json"]) == 0
    ec, ecp = json.loads(capsys.readouterr().out)["pairs"]
    covered = ecp["measured"]["experts"]["prefetch"]["covered"]
    assert 0 < covered <= 1 and ecp["policy"]["prefetch"] == covered
    assert covered != PREFETCH_PUBLISHED
    # EC has no predictor: nothing to set, nothing measured
    assert ec["policy"]["prefetch"] is None and "prefetch" not in ec["measured"]["experts"]
    trace = tmp_path / "routing.json"
    api.execute("scenarios/tiny.yaml", schedule="ECP", overrides=sets, device="cpu",
                record_routing=trace)
    replay = [*sets, "workload.routing.kind=trace", f"workload.routing.trace={trace}"]
    at = {p: api.simulate("scenarios/tiny.yaml", schedule="ECP",
                          overrides=[*replay, f"policy.prefetch={p}"]).summary["decode_layer_ms"]
          for p in (0, covered)}
    assert ecp["simulated"]["decode_layer_ms"] == at[covered] != at[0]


def _validated_with_routing(capsys, tmp_path, schedule: str):
    """`tg validate`'s pair of `schedule` at BATCH_1, and the routing trace the same run
    records (`tg execute --record-routing`: seeded weights route alike)."""
    from taskgraph import api

    assert main(["validate", "scenarios/tiny.yaml", *sum((["--set", x] for x in BATCH_1), []),
                 "--schedules", schedule, "--mu", "1", "--repeats", "1", "--json"]) == 0
    (pair,) = json.loads(capsys.readouterr().out)["pairs"]
    trace = tmp_path / "routing.json"
    api.execute("scenarios/tiny.yaml", schedule=schedule, overrides=BATCH_1, device="cpu",
                record_routing=trace)
    return pair, trace


def test_validate_simulates_the_expert_schedules_on_the_runs_own_routing(capsys, tmp_path):
    """Which experts a batch routes to is an input of the model: an expert schedule's pair is
    simulated on the executed run's router decisions, as if `tg execute --record-routing` had
    written them and the scenario replayed them, not on the scenario's uniform routing."""
    from taskgraph import api

    ec, trace = _validated_with_routing(capsys, tmp_path, "EC")
    replayed = api.simulate("scenarios/tiny.yaml", schedule="EC", overrides=[
        *BATCH_1, "workload.routing.kind=trace", f"workload.routing.trace={trace}"]).summary
    uniform = api.simulate("scenarios/tiny.yaml", schedule="EC", overrides=BATCH_1).summary
    assert ec["simulated"]["experts"] == replayed["experts"] != uniform["experts"]
    assert ec["simulated"]["decode_layer_ms"] == replayed["decode_layer_ms"]


def test_validate_keeps_eps_experts_where_the_run_kept_them(capsys, tmp_path):
    """EP's run keeps the experts its scenario's routing makes most popular (uniform: a tie,
    experts 0 and 1 of each layer). Simulated on the run's routing trace, the model kept the
    trace's most popular instead, and priced its decode on the trace's prefill and decode
    choices together: on an H100 it gave the GPU half of the choices, CPUFFN 8.0 ms against
    10.8 measured. The pair's split must be the run's decode steps' on the experts it kept."""
    ep, trace = _validated_with_routing(capsys, tmp_path, "EP")
    decode = [np.array(step) for step in json.loads(trace.read_text())["steps"][1:]]
    kept = [np.isin(step[layer], [0, 1]) for step in decode for layer in range(len(step))]
    distinct = [np.unique(step[layer]) for step in decode for layer in range(len(step))]
    experts = ep["simulated"]["experts"]
    assert experts["gpu_share"] == pytest.approx(np.mean([k.mean() for k in kept]), abs=1e-5)
    assert experts["distinct_on_cpu"] == pytest.approx(
        np.mean([np.sum(d >= 2) for d in distinct]), abs=1e-5)


def test_validate_and_calibrate_bad_input(capsys, tmp_path):
    assert main(["validate", "scenarios/tiny.yaml", "--mu", "two"]) == 2
    assert "--mu" in capsys.readouterr().err
    assert main(["validate", "scenarios/tiny.yaml", "--mu", "3"]) == 2
    assert "divides policy.N" in capsys.readouterr().err
    assert main(["validate", "scenarios/tiny.yaml", "--schedules", "S9"]) == 2
    assert "S9" in capsys.readouterr().err
    assert main(["calibrate", "--out", str(tmp_path / "p.json")]) == 2
    assert ".yaml" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "p.yaml")]) == 2
        assert "no CUDA device" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpu: {name: g}\n")
    assert main(["simulate", "scenarios/tiny.yaml", "--set", f"hardware={bad}"]) == 2
    assert "hardware.gpu" in capsys.readouterr().err


def _pair(schedule, measured, simulated, spread):
    from taskgraph.study.validate import PairResult

    return PairResult(schedule, {"mu": 1}, {"decode_layer_ms": simulated},
                      {"decode_layer_ms": measured}, {},
                      measured_range=(measured - spread, measured + spread))


def test_ranking_counts_only_orders_the_measurement_resolves():
    from taskgraph.study.validate import ranking

    # S1 and S2 overlap in their repeats; S3 is clearly slower than both.
    group = [_pair("S1", 10.0, 12.0, 1.0), _pair("S2", 10.5, 11.0, 1.0),
             _pair("S3", 20.0, 25.0, 1.0)]
    r = ranking(group)
    assert not r["same"] and r["agree"] and r["unresolved"] == ["S1~S2"]
    # The simulation putting S3 first contradicts a resolved order.
    group[2] = _pair("S3", 20.0, 5.0, 1.0)
    r = ranking(group)
    assert not r["agree"]
    assert ranking([_pair("S1", 1.0, 1.0, 0.1), _pair("S2", 2.0, 2.0, 0.1)])["same"]


def test_a_machine_speed_shift_is_told_from_model_error():
    from taskgraph.study.validate import _speed_shift

    # every kind 20-50% slow: the machine changed speed
    assert _speed_shift([0.2, 0.3, 0.5, 0.25, 0.4]) == pytest.approx(0.3)
    assert _speed_shift([-0.2, -0.3, -0.25, -0.1, 0.01]) == pytest.approx(-0.2)
    # some kinds off, others right: a model error, no shift to report
    assert _speed_shift([0.3, -0.02, 0.01, 0.4, -0.2]) is None


def test_a_caches_prefill_does_not_price_its_decode_experts(monkeypatch):
    """EC's prefill misses more experts than its staging slots hold, and there the executor's
    GPUFFN copies the later rounds itself: on an H100 those copies (PCIe, 6 ms an expert) made
    the fit price a decode GPUFFN of 0.65 ms at 7.2. Here EC's prefill GPUFFN tasks are made
    50 ms longer, as such copies would make them: the fitted cost must still price the decode
    GPUFFN tasks as they ran."""
    from taskgraph.dag.compiled import KIND_NAMES
    from taskgraph.exec import execute
    from taskgraph.study import calibrate

    real, ran = execute.execute_scenario, []

    def copying_prefill(sc, schedule, **kwargs):
        ex = real(sc, schedule, **kwargs)
        gpuffn = ex.program.column("kind") == KIND_NAMES.index("GPUFFN")
        if schedule == "EC":
            ex.run.end[gpuffn & (ex.program.step == 0)] += 0.05
            ex.run.durations[:] = ex.run.end - ex.run.start
            ran.append(ex)
        return ex

    monkeypatch.setattr(execute, "execute_scenario", copying_prefill)
    monkeypatch.setattr(calibrate, "FIT_RUNS", ())            # the expert runs alone
    sc = load_scenario("scenarios/tiny.yaml")
    fit = calibrate.fit_tasks(sc, sc.hardware.model_dump(), repeats=1)
    ex = ran[0]
    prog = ex.program
    decode = (prog.column("kind") == KIND_NAMES.index("GPUFFN")) & (prog.step > 0)
    nbytes = prog.column("nbytes")[decode]
    rate = fit.gbps.get("GPUFFN")           # none fitted: the roof's (microseconds here)
    priced = fit.fixed_us["GPUFFN"] * 1e-6 + (nbytes / (rate * 1e9) if rate else 0.0)
    measured = ex.run.durations[decode]
    assert np.median(priced) < 3 * np.median(measured) + 1e-3
