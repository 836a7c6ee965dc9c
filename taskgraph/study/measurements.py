"""End-to-end measurements to fit and judge the model against (the format of
``shared/measurements/``): cells, each one system's measured throughput on one machine, model,
workload and policy. Users write the same file for their own runs.

A cell becomes a scenario: the machine and model presets, the workload, the policy with
N = mu x n_ub, and the schedule that stands for the system (whose implementation profile prices
it unless the cell names another). A system that runs one batch per GPU at once (DeepSpeed's
ZeRO-Inference: each rank generates for a batch of its own) gives ``batch`` instead: the
sequences of each GPU's one micro-batch, so N = batch x GPUs.

A cell whose policy needs more memory than its machine has under tg's memory model is simulated
all the same (the run happened); the fit report says which memory and by how much
(:attr:`Cell.memory_note`), as a lead on which of the model's terms is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from taskgraph import presets
from taskgraph.dag.builder import make_plan
from taskgraph.dag.schedules import SCHEDULES
from taskgraph.errors import MemoryFitError, TgError
from taskgraph.files import plain_text
from taskgraph.formats import bits
from taskgraph.perf.memory import check_fits, memory_footprint
from taskgraph.scenario import read_yaml, scenario_from_dict
from taskgraph.specs import TENSOR_CLASSES, Numbers


class CellPolicy(Numbers):
    model_config = ConfigDict(extra="forbid")

    mu: int | None = Field(default=None, gt=0)
    n_ub: int | None = Field(default=None, gt=0)
    N: int | None = Field(default=None, gt=0)
    # Sequences each GPU runs as its one micro-batch (instead of mu, n_ub and N).
    batch: int | None = Field(default=None, gt=0)
    # None: as the schedule places them (0 unless it decides otherwise).
    r_w: float | None = Field(default=None, ge=0.0, le=1.0)
    r_c: float | None = Field(default=None, ge=0.0, le=1.0)
    # An expert-level schedule's experts kept on the GPU, per layer.
    experts_gpu: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _batch(self) -> "CellPolicy":
        if self.batch is not None:
            if any(x is not None for x in (self.mu, self.n_ub, self.N)):
                raise ValueError("give batch (each GPU's one micro-batch) or mu with N or "
                                 "n_ub, not both")
            return self
        if self.mu is None:
            raise ValueError("mu: required but missing (or give batch)")
        if self.N is None and self.n_ub is None:
            raise ValueError("give N or n_ub (micro-batches)")
        if self.N is not None and self.n_ub is not None and self.N != self.mu * self.n_ub:
            raise ValueError(f"N = {self.N} is not mu x n_ub = {self.mu} x {self.n_ub}")
        if self.N is not None and self.N % self.mu:
            raise ValueError(f"N = {self.N} is not a multiple of mu = {self.mu}")
        return self

    def sequences(self, gpus: int) -> tuple[int, int]:
        """(N, mu) on a machine with `gpus` GPUs."""
        if self.batch is not None:
            return self.batch * gpus, self.batch
        return (self.N if self.N is not None else self.mu * self.n_ub), self.mu


#: The fields a published table gives beside a cell's id, and where they belong.
PUBLISHED_FIELDS = {"batch": ("policy", "batch"),
                    "experts_resident_per_layer": ("policy", "experts_gpu"),
                    "prompt_len": ("workload", "prompt_len"),
                    "gen_len": ("workload", "gen_len")}


class Cell(Numbers):
    """One measured run."""

    # Spaces around a name are not part of it ("FlexGen " and "FlexGen" are one system).
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    # An id names the cell in every table and error: a line's worth of text, not a document.
    id: str = Field(min_length=1, max_length=200)
    system: str = Field(default="", max_length=200)
    schedule: str
    machine: str
    model: str
    # The weights' precision where the source states it: 16-bit (fp16 or bf16, the bytes
    # tg's presets count), or each class of tensor stored otherwise and its format, as a
    # scenario's model.precision says ({experts: q4_k}: the routed experts in Q4_K blocks).
    precision: Literal["fp16", "bf16"] | dict[str, str | float] | None = None
    implementation: str | None = None      # default: the system's, else the schedule's
    workload: dict[str, Any] = Field(default_factory=dict)
    policy: CellPolicy
    # Within what any run measures (as a machine's figures are): past it the fit's arithmetic
    # over- or underflows (5e-324 stopped the least squares with a traceback; 1e-304 wrote
    # Infinity into the JSON; 1e308 the parity plot).
    measured_tok_s: float = Field(ge=1e-6, le=1e9, allow_inf_nan=False)
    # The source's own words for the figure (a CSV row, a sentence), kept for the reader.
    quote: str | None = Field(default=None, max_length=2000)
    # The measurements file the cell came from (set by the loader, not by the file).
    _file: str = PrivateAttr(default="")

    @property
    def file(self) -> str:
        return self._file

    @model_validator(mode="before")
    @classmethod
    def _as_published(cls, raw: Any) -> Any:
        """A cell as a published table gives it, flat: `batch`, `prompt_len`, `gen_len` and
        `experts_resident_per_layer` beside the id are the policy's and workload's fields."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        sections = {"policy": raw.get("policy", {}), "workload": raw.get("workload", {})}
        for flat, (section, inner) in PUBLISHED_FIELDS.items():
            nested = sections[section]
            if flat not in raw or not isinstance(nested, dict):
                continue
            if inner in nested:
                raise ValueError(f"{flat} is given twice, beside the id and as "
                                 f"{section}.{inner}: give it once")
            sections[section] = {**nested, inner: raw.pop(flat)}
        for section, nested in sections.items():
            if nested != {} or section in raw:
                raw[section] = nested
        return raw

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, name: str) -> str:
        if name not in SCHEDULES:
            raise ValueError(f"{_quote(name)} is not a schedule tg knows "
                             f"({', '.join(SCHEDULES)})")
        return name

    @field_validator("machine", "model", "implementation")
    @classmethod
    def _preset(cls, name: str | None, info) -> str | None:
        """A preset's name, in any case (a source's "L4" is the preset l4)."""
        table = {"machine": presets.HARDWARE, "model": presets.MODELS,
                 "implementation": presets.IMPLEMENTATIONS}[info.field_name]
        if name is None or name in table:
            return name
        same = [known for known in table if known.lower() == name.lower()]
        if not same:
            raise ValueError(f"{_quote(name)} is not a preset ({', '.join(table)})")
        return same[0]

    @field_validator("precision", mode="before")
    @classmethod
    def _formats(cls, precision: Any) -> Any:
        """fp16, bf16, or {class of tensor: format}, the formats' names lower-cased and the
        classes in order (cells alike but in how they spell it are alike)."""
        if precision is None or precision in ("fp16", "bf16"):
            return precision
        classes = (*TENSOR_CLASSES, "kv_cache")
        if not isinstance(precision, dict):
            raise ValueError(f"{_quote(precision)} is neither fp16, bf16 nor a mapping of "
                             "classes of tensor to their formats ({experts: q4_k})")
        for name, fmt in precision.items():
            if name not in classes:
                raise ValueError(f"{_quote(name)} is no class of tensor ({', '.join(classes)})")
            if isinstance(fmt, bool) or not isinstance(fmt, (str, int, float)):
                shown = ({True: "true", False: "false", None: "null"}[fmt]
                         if fmt is None or isinstance(fmt, bool) else _quote(fmt))
                raise ValueError(f"{name}: {shown} is no format (a name such as q4_k, or bits "
                                 "per weight)")
            try:
                bits(fmt)
            except TgError as err:
                raise ValueError(f"{name}: {err}".rstrip(".")) from None
        return {name: precision[name].lower() if isinstance(precision[name], str)
                else precision[name] for name in classes if name in precision}

    @property
    def experts_quantized(self) -> bool:
        """Whether its routed experts are stored below 16 bits."""
        fmt = self.precision.get("experts") if isinstance(self.precision, dict) else None
        return fmt is not None and bits(fmt) < 16

    @field_validator("workload")
    @classmethod
    def _workload_preset(cls, workload: dict[str, Any]) -> dict[str, Any]:
        name = workload.get("preset")
        if name is not None and (not isinstance(name, str) or name not in presets.WORKLOADS):
            raise ValueError(f"preset {_quote(name)} is not a workload preset "
                             f"({', '.join(presets.WORKLOADS)})")
        return workload

    @property
    def gpus(self) -> int:
        return presets.HARDWARE[self.machine]["gpu"]["count"]

    def scenario(self, hardware: dict[str, Any] | None = None,
                 implementation: dict[str, Any] | None = None):
        """The scenario this cell ran (on its machine's and system's presets by default)."""
        return scenario_from_dict(self.scenario_doc(
            hardware or self.machine,
            implementation or presets.IMPLEMENTATIONS[self.implementation_name]),
            source=f"cell '{self.id}'")

    def memory_note(self) -> str | None:
        """What is over, if the policy needs more memory than the machine has under tg's memory
        model: the run happened, so a term of the model is wrong (None: it fits)."""
        try:
            check_fits(memory_footprint(make_plan(self.scenario())), self.schedule)
        except MemoryFitError as err:
            return str(err)
        return None

    @property
    def implementation_name(self) -> str:
        systems = {name.lower(): impl for name, impl in presets.SYSTEMS.items()}
        return (self.implementation or systems.get(self.system.lower())
                or SCHEDULES[self.schedule].implementation)

    def scenario_doc(self, hardware: dict[str, Any], implementation: dict[str, Any]
                     ) -> dict[str, Any]:
        """The scenario this cell ran, on the given machine and implementation profiles."""
        workload = dict(self.workload)
        name = workload.pop("preset", None)
        if name is not None:
            workload = {**presets.WORKLOADS[name], **workload}
        N, mu = self.policy.sequences(presets.HARDWARE[self.machine]["gpu"]["count"])
        policy = dict(N=N, mu=mu, A_g=int(SCHEDULES[self.schedule].attention == "gpu"),
                      **{k: v for k, v in (("r_w", self.policy.r_w), ("r_c", self.policy.r_c),
                                           ("experts_gpu", self.policy.experts_gpu))
                         if v is not None})
        model: Any = self.model
        if isinstance(self.precision, dict):
            model = {"preset": self.model, "precision": dict(self.precision)}
        return dict(name=self.id, model=model, hardware=hardware, workload=workload,
                    policy=policy, schedule=self.schedule, implementation=implementation)


#: The cell fields a measurements file may give once, for all its cells.
FILE_DEFAULTS = ("model", "precision")


def _quote(value: Any, limit: int = 60) -> str:
    """A value from the file as an error quotes it: at most `limit` characters of it."""
    text, mark = (value, "'") if isinstance(value, str) else (repr(value), "")
    if len(text) > limit:
        return f"{mark}{text[:limit]}...{mark} ({len(text):,} characters)"
    return f"{mark}{text}{mark}"


def load_measurements(path: str | Path) -> tuple[str, list[Cell]]:
    """(source, cells) from a measurements file; each error names the cell and the field."""
    path = Path(path)
    doc = read_yaml(path, what="measurements file")
    if not isinstance(doc, dict) or not isinstance(doc.get("cells"), list) or not doc["cells"]:
        raise TgError(f"The measurements file '{path}' must be a mapping with a non-empty list "
                      "'cells' (see shared/measurements/ for the format).")
    plain_text(doc, f"The measurements file '{path}'")
    unknown = sorted(set(doc) - {"source", "cells", *FILE_DEFAULTS}, key=str)
    if unknown:
        raise TgError(f"The measurements file '{path}' has {_quote(unknown[0])} at its top, "
                      f"which tg does not read (it reads source, cells, "
                      f"{', '.join(FILE_DEFAULTS)}).")
    # What every cell shares, given once at the top of the file (a cell's own value wins).
    shared = {k: doc[k] for k in FILE_DEFAULTS if k in doc}
    cells, seen = [], set()
    for number, raw in enumerate(doc["cells"], 1):
        label = (f"cell {_quote(raw['id'])}" if isinstance(raw, dict)
                 and isinstance(raw.get("id"), str) else f"cell #{number}")
        try:
            cell = Cell.model_validate({**shared, **raw} if isinstance(raw, dict) else raw)
        except ValidationError as err:
            e = err.errors()[0]
            field = ".".join(str(p) for p in e["loc"]) or "the cell"
            msg = "required but missing" if e["type"] == "missing" else \
                e["msg"].removeprefix("Value error, ")
            raise TgError(f"Measurements '{path}', {label}: {field}: {msg}.") from None
        if cell.id in seen:
            raise TgError(f"Measurements '{path}': two cells are called '{cell.id}'.")
        seen.add(cell.id)
        try:        # the cell must be a scenario tg can simulate (memory aside: see memory_note)
            make_plan(cell.scenario())
        except TgError as err:
            raise TgError(f"Measurements '{path}', {label} is not a scenario tg can run: "
                          f"{err}") from None
        cell._file = str(path)
        cells.append(cell)
    return str(doc.get("source", path)), cells


def load_many(paths: list[str | Path]) -> tuple[str, list[Cell]]:
    """(sources joined, cells) from several measurements files, fitted as one: a cell's id
    must name it across them all."""
    sources, cells, seen = [], [], {}
    resolved = [Path(p).resolve() for p in paths]
    for i, path in enumerate(resolved):
        if path in resolved[:i]:
            raise TgError(f"Measurements '{paths[i]}' is given twice (as "
                          f"'{paths[resolved.index(path)]}'): a cell is fitted once.")
    for path in paths:
        source, mine = load_measurements(path)
        for cell in mine:
            if cell.id in seen:
                raise TgError(f"Measurements '{path}' and '{seen[cell.id]}' both have a cell "
                              f"called {_quote(cell.id)}: a cell's id must name it in a fit of "
                              "several files.")
            seen[cell.id] = path
        sources.append(source)
        cells += mine
    return " + ".join(sources), cells
