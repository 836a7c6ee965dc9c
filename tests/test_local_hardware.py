"""`hardware: local`: this machine read from the system, the rest from presets, each assumption
named (issue 38 point 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from taskgraph import local
from taskgraph.cli import main
from taskgraph.errors import TgError
from taskgraph.scenario import load_scenario


@pytest.mark.parametrize("reported, preset", [
    ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ("NVIDIA GeForce RTX 4090 D", "RTX4090D"),
    ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("NVIDIA A100-SXM4-80GB", "A100-80G"),
    ("Tesla T4", "T4"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA RTX A6000", "RTXA6000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX6000-Ada"),
    ("NVIDIA GeForce RTX 3090 Ti", "RTX3090Ti"),
    ("AMD Instinct MI300X", None),
])
def test_a_reported_gpu_is_named_by_its_preset(reported, preset):
    assert local._gpu_preset(reported) == preset


def _scenario(tmp_path, hardware: str):
    path = tmp_path / "here.yaml"
    path.write_text(f"model: tiny\nhardware: {hardware}\n"
                    "workload: {prompt_len: 64, gen_len: 8}\n"
                    "policy: {N: 1, mu: 1, r_w: 1.0, r_c: 1.0, experts_gpu: 1}\nschedule: EP\n")
    return path


def test_a_detected_gpu_and_this_host(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "detect_gpus", lambda: ("NVIDIA GeForce RTX 4090", 25.76, 1))
    hw = load_scenario(_scenario(tmp_path, "local")).hardware
    assert hw.gpu.name == "RTX4090" and hw.gpu.memory_gb == 25.76 and hw.gpu.count == 1
    assert hw.cpu.cores == os.cpu_count()
    assert hw.cpu.memory_gb == pytest.approx(
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, abs=0.1)
    # what was not read is named, and how to measure it
    assert "link is 1xRTX4090's" in hw.assumed and "tg calibrate" in hw.assumed


def test_without_a_gpu_it_says_so_and_prices_a_named_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(local, "detect_gpus", lambda: None)
    with pytest.raises(TgError, match="reports no NVIDIA GPU.*gpu_like: rtx4090"):
        load_scenario(_scenario(tmp_path, "local"))
    path = _scenario(tmp_path, "{preset: local, gpu_like: rtx4090}")
    hw = load_scenario(path).hardware
    assert hw.gpu.name == "RTX4090" and hw.cpu.cores == os.cpu_count()
    assert main(["simulate", str(path)]) == 0
    out, err = capsys.readouterr()
    printed = " ".join((out + err).split())
    assert "this machine (1xRTX4090" in printed and "rtx4090's (1x RTX4090), as asked" in printed
    assert "tg calibrate" in printed
    assert main(["simulate", str(path), "--json"]) == 0
    assert any("tg calibrate" in w for w in json.loads(capsys.readouterr().out)["warnings"])


def test_bad_local_hardware_is_one_clear_error(tmp_path):
    path = _scenario(tmp_path, "{preset: local, gpu_like: rtx9999}")
    run = subprocess.run([sys.executable, "-m", "taskgraph.cli", "simulate", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "hardware.gpu_like: 'rtx9999' is not a machine preset" \
        in run.stderr and "Traceback" not in run.stderr
    if local.detect_gpus() is None:      # the real system, asked in a process of its own
        run = subprocess.run([sys.executable, "-m", "taskgraph.cli", "simulate",
                              str(_scenario(tmp_path, "local"))],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "reports no NVIDIA GPU" in run.stderr


def test_what_nvidia_smi_prints_on_an_h200_is_read(monkeypatch):
    """The line an H200 printed (2026-11-27, the lent machine): 143,771 MiB is 150.75 GB."""
    printed = "NVIDIA H200, 143771\n"
    monkeypatch.setattr(local.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(local.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, printed, ""))
    assert local.detect_gpus() == ("NVIDIA H200", pytest.approx(150.75, abs=0.01), 1)
    hw = local.local_hardware()
    assert hw["gpu"]["name"] == "H200" and hw["gpu"]["memory_gb"] == 150.75
    monkeypatch.setattr(local.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, printed * 4, ""))
    assert local.detect_gpus()[2] == 4
