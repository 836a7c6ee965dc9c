"""`hardware: local`: this machine as a hardware section, from what its system reports.

Read from the system: the GPUs (``nvidia-smi``, else PyTorch where it is installed: the model,
its memory and how many), the host's cores and memory, and its CPU's name. No system call
reports rates (FLOP/s, memory and link bandwidth, what each task costs): those come from the
presets, from the machine preset with this GPU and the host preset nearest in cores, and each
is named in the section's ``assumed`` text, which every run prints. ``tg calibrate`` measures
them on this machine.

A machine without a GPU can still be asked about one: ``hardware: {preset: local, gpu_like:
rtx4090}`` prices this host with the GPU and link of the named machine preset.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

from taskgraph import presets
from taskgraph.errors import TgError

#: What a run is told of where the figures it did not read come from.
CALIBRATE = "`tg calibrate` measures them here"


def local_hardware(gpu_like: str | None = None, where: str = "hardware") -> dict[str, Any]:
    """This machine as a hardware section (module docstring); `gpu_like` names the machine
    preset whose GPU and link to take instead of the GPU the system reports."""
    cores, memory_gb, cpu_name = os.cpu_count() or 1, _host_memory_gb(), _cpu_name()
    assumed = []
    if gpu_like is not None:
        if gpu_like not in presets.HARDWARE:
            raise TgError(f"{where}.gpu_like: '{str(gpu_like)[:60]}' is not a machine preset; "
                          f"known machines: {', '.join(presets.HARDWARE)}.")
        machine, count = presets.HARDWARE[gpu_like], presets.HARDWARE[gpu_like]["gpu"]["count"]
        gpu = dict(machine["gpu"])
        assumed.append(f"the GPU and its link are {gpu_like}'s ({gpu['count']}x "
                       f"{gpu['name']}), as asked")
    else:
        found = detect_gpus()
        if found is None:
            raise TgError(
                f"{where}: local: this machine reports no NVIDIA GPU (no nvidia-smi, and "
                "PyTorch sees none). Name one to price on this host: hardware: {preset: local, "
                f"gpu_like: rtx4090}} (machines: {', '.join(presets.HARDWARE)}).")
        name, gpu_memory_gb, count = found
        key = _gpu_preset(name)
        if key is None:
            raise TgError(
                f"{where}: local: this machine's GPU is '{name[:60]}', which no preset "
                f"describes (GPUs: {', '.join(presets._GPUS)}). Give its figures in a hardware "
                "profile (tg calibrate writes one), or name a machine preset like it: "
                "hardware: {preset: local, gpu_like: NAME}.")
        machine = next(m for m in presets.HARDWARE.values() if m["gpu"]["name"] == key)
        gpu = dict(machine["gpu"], memory_gb=round(gpu_memory_gb, 2), count=count)
        assumed.append(f"the {key}'s FLOP/s and memory bandwidth are its preset's, and its "
                       f"link is {machine['name']}'s")
    host_key = min(presets._HOSTS, key=lambda k: abs(presets._HOSTS[k]["cores"] - cores))
    host = dict(presets._HOSTS[host_key], name=cpu_name, cores=cores,
                memory_gb=round(memory_gb, 1))
    assumed.append(f"the host's FLOP/s and memory bandwidth are those of the preset host "
                   f"'{presets._HOSTS[host_key]['name']}', nearest in cores")
    gpus = f"{count}x{gpu['name']}"
    return dict(name=f"this machine ({gpus}, {cpu_name}, {cores} cores, {memory_gb:.0f} GB)",
                gpu=gpu, cpu=host, link=dict(machine["link"]),
                **({"interconnect": dict(machine["interconnect"])}
                   if count > 1 and "interconnect" in machine else {}),
                assumed="; ".join(assumed) + f" ({CALIBRATE})")


def detect_gpus() -> tuple[str, float, int] | None:
    """(model, memory in GB, count) of this machine's NVIDIA GPUs; None where it has none."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        rows = [line.rsplit(",", 1) for line in out.strip().splitlines() if "," in line]
        if rows:
            try:
                return rows[0][0].strip(), float(rows[0][1]) * 2**20 / 1e9, len(rows)
            except ValueError:
                pass
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / 1e9, torch.cuda.device_count()


def _gpu_preset(reported: str) -> str | None:
    """The GPU preset a reported model name is ("NVIDIA GeForce RTX 4090" is RTX4090, "NVIDIA
    H100 80GB HBM3" H100-SXM): the longest preset name, less what follows its dash (form
    factor, memory size), within it."""
    def plain(s: str) -> str:
        return re.sub(r"[^A-Z0-9]", "", s.upper().replace("GEFORCE", "").replace("NVIDIA", ""))

    name = plain(reported)
    keys = [k for k in presets._GPUS if plain(k.split("-")[0]) in name]
    return max(keys, key=lambda k: len(plain(k.split("-")[0])), default=None)


def _host_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        raise TgError("hardware: local: this system does not report its memory; give "
                      "hardware.cpu.memory_gb.") from None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()[:60]
    except OSError:
        pass
    return "this host"
