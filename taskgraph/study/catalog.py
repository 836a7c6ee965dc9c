"""`tg catalog`: what a scenario can name, without reading the source: the model, machine and
workload presets, the schedules, the implementation profiles, and the scenarios shipped with tg
(which a bare name finds: `tg simulate t4`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from taskgraph import presets
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.output.report import Shown
from taskgraph.scenario import SHIPPED
from taskgraph.specs import ModelSpec


@dataclass
class Catalog(Shown):
    """Each name with a line about it. `to_dict()` is `tg catalog --json`."""

    models: dict[str, str] = field(default_factory=dict)
    machines: dict[str, str] = field(default_factory=dict)
    workloads: dict[str, str] = field(default_factory=dict)
    schedules: dict[str, str] = field(default_factory=dict)
    implementations: dict[str, str] = field(default_factory=dict)
    scenarios: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"models": self.models, "machines": self.machines, "workloads": self.workloads,
                "schedules": self.schedules, "implementations": self.implementations,
                "scenarios": self.scenarios}

    def views(self):
        for what, names in self.to_dict().items():
            t = Table(title=f"{what} ({len(names)})", title_justify="left", show_header=False)
            t.add_column(style="bold")
            t.add_column()
            for name, about in names.items():
                t.add_row(name, about)
            yield t


def catalog() -> Catalog:
    return Catalog(
        models={name: _model(spec) for name, spec in presets.MODELS.items()},
        machines={name: _machine(m) for name, m in presets.HARDWARE.items()}
        | {"local": "this machine, read from the system (a GPU named by gpu_like where it "
                    "has none)"},
        workloads={name: f"prompt {w.get('prompt_len')} tokens (max "
                         f"{w.get('max_prompt_len', w.get('prompt_len'))}), "
                         f"{w.get('gen_len')} generated" for name, w in presets.WORKLOADS.items()},
        schedules={name: s.title for name, s in SCHEDULES.items()},
        implementations={name: _implementation(name, i)
                         for name, i in presets.IMPLEMENTATIONS.items()},
        scenarios={f.stem: _first_comment(f) for f in sorted(SHIPPED.glob("*.yaml"))}
        if SHIPPED.is_dir() else {})


def _model(spec: dict[str, Any]) -> str:
    m = ModelSpec.model_validate(spec)
    experts = f"{m.E} experts, top-{m.k}" if m.E else "dense"
    return f"{m.architecture}, {m.L} layers, h={m.h}, {experts}"


def _machine(m: dict[str, Any]) -> str:
    gpu = m["gpu"]
    return (f"{gpu['count']}x {gpu['name']} ({gpu['memory_gb']:g} GB), {m['cpu']['name']} "
            f"({m['cpu']['memory_gb']:g} GB)")


def _implementation(name: str, spec: dict[str, Any]) -> str:
    """Its title, and the schedules that run as it unless a scenario names another."""
    runs = [s for s, schedule in SCHEDULES.items() if schedule.implementation == name]
    return spec.get("title", name) + (f"; the default of {', '.join(runs)}" if runs else "")


def _first_comment(path) -> str:
    """The first sentence of a scenario file's opening comment, where it has one."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    sentence = re.split(r"(?<=\.)\s", " ".join(lines), maxsplit=1)[0].rstrip(".")
    return sentence if len(sentence) <= 100 else sentence[:97].rsplit(" ", 1)[0] + "..."
