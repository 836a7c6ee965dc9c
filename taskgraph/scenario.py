"""Scenario files: YAML in, a validated :class:`Scenario` out, or one clear paragraph of error.

A scenario has sections ``model``, ``hardware``, ``workload``, ``policy``, ``schedule`` and an
optional ``expect``. ``model``, ``hardware`` and ``workload`` may each be a preset name, a file
(``*.json``: a Hugging Face config.json for the model, ``*.gguf``: a GGUF file's metadata and
tensor types; ``*.yaml``: a hardware profile), or a
mapping that starts from ``preset:`` (or ``hf_config:`` / ``file:``) and overrides fields.
``--set a.b=value`` overrides are applied to the raw document before validation, so they are
checked exactly like the file.
"""

from __future__ import annotations

import difflib
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from taskgraph import presets
from taskgraph.dag.routing import trace_from_json
from taskgraph.dag.schedules import EXPERT_FIELDS, PLACED, PLACEMENT_MEANS, SCHEDULES
from taskgraph.errors import TgError
from taskgraph.files import plain_text, read_text
from taskgraph.local import local_hardware
from taskgraph.model_files import model_from_gguf, model_from_hf_config
from taskgraph.serving.requests import generate_requests, read_requests, summary
from taskgraph.specs import LengthsSpec, Scenario

_SECTIONS = ("model", "hardware", "workload", "policy", "schedule", "implementation", "expect",
             "objective", "name")


#: The scenarios shipped beside the package (a checkout, or an editable install of one).
SHIPPED = Path(__file__).resolve().parent.parent / "scenarios"


def shipped(path: str | Path) -> Path:
    """`path`; or, where it is a bare name (`t4`, `t4.yaml`) no file here has, the shipped
    scenario of that name where there is one."""
    path = Path(path)
    if path.exists() or path.parent != Path(".") or not SHIPPED.is_dir():
        return path
    found = SHIPPED / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    return found if found.is_file() else path


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override and validate a scenario file (or a shipped scenario by name)."""
    path = shipped(path)
    if not path.exists() and SHIPPED.is_dir():
        names = ", ".join(sorted(f.stem for f in SHIPPED.glob("*.yaml")))
        raise TgError(f"The scenario file '{str(path)[:200]}' does not exist; the shipped "
                      f"scenarios, which a bare name finds, are {names} (tg catalog lists "
                      "them with the models and machines).")
    doc = read_yaml(path, what="scenario file")
    if not isinstance(doc, dict):
        raise TgError(
            f"Scenario file '{path}' must be a YAML mapping with sections "
            f"{', '.join(_SECTIONS[:5])}; it holds {_kind_of(doc)}."
        )
    pins = _pins(doc, str(path))
    _one_placement_set(overrides)
    for item in overrides:
        apply_override(doc, item)
        key, _, value = item.partition("=")
        key = key.strip()
        if key == "schedule":        # a schedule chosen here is not bound by the file's policy
            pins = {k: v for k, v in pins.items() if v[1]}
        elif key.startswith("policy.") and key.count(".") == 1:
            field = key.removeprefix("policy.")
            pins[field] = (f"--set {key}={value.strip()}", True)
            _placed_otherwise(doc, field)
    return scenario_from_dict(doc, source=str(path), base_dir=path.parent,
                              default_name=path.stem, pins=pins)


def _one_placement_set(overrides) -> None:
    """Two --set placements of EP's experts (taskgraph.placement) in one command are refused,
    as in one file: the later would silently win."""
    ways = ("experts_gpu", *PLACED)
    given = [k for k in dict.fromkeys(item.partition("=")[0].strip().removeprefix("policy.")
                                      for item in overrides if item.strip().startswith("policy."))
             if k in ways]
    if len(given) > 1:
        raise TgError(f"--set policy.{given[0]} and --set policy.{given[1]} each place EP's "
                      "experts; give one.")


def _placed_otherwise(doc: dict[str, Any], field: str) -> None:
    """A --set that places EP's experts one way (taskgraph.placement) replaces the file's
    placement of them another way: `--set policy.cpu_moe=20` on a file with experts_gpu: 34."""
    ways = ("experts_gpu", *PLACED)
    policy = doc.get("policy")
    if field in ways and isinstance(policy, dict):
        doc["policy"] = {k: v for k, v in policy.items() if k == field or k not in ways}


def scenario_from_dict(doc: dict[str, Any], *, source: str = "<dict>",
                       base_dir: Path = Path("."), default_name: str = "scenario",
                       pins: dict[str, tuple[str, bool]] | None = None) -> Scenario:
    """Validate a scenario given as a plain mapping (the YAML document). The schedule's
    placement (:func:`for_schedule`) is applied; `pins` are the policy fields given explicitly
    (default: those in `doc`, binding its own schedule)."""
    unknown = [k for k in doc if k not in _SECTIONS]
    if unknown:
        raise TgError(
            f"Invalid scenario {source}: unknown section {shortened(unknown[0])}"
            f"{_near(unknown[0], _SECTIONS)}; a scenario has sections {', '.join(_SECTIONS)}."
        )
    raw = dict(doc)
    raw.setdefault("name", default_name)
    auto = raw.get("policy") == "auto"
    if auto:   # validated with a placeholder; `resolve_auto_policy` searches for the real one
        raw["policy"] = {"N": 1, "mu": 1, "r_w": 0.0, "r_c": 0.0}
    impl = raw.get("implementation")
    if isinstance(impl, dict) and not {"preset", "file", "name"} & impl.keys():
        # `--set implementation.kinds...` alone: start from the schedule's own software
        own = SCHEDULES.get(str(raw.get("schedule", "S1")))
        raw["implementation"] = {"preset": own.implementation if own else "ideal", **impl}
    for section in _PRESETS:
        if section in raw:
            raw[section] = _resolve_section(section, raw[section], source, base_dir)
    # after the sections are resolved: a preset's or profile's text is printed as well
    plain_text(raw, f"Invalid scenario {source}")
    requests = _resolve_requests(raw, source, base_dir)
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as err:
        raise TgError(_explain(err, source)) from None
    scenario._requests = requests
    scenario._routing_trace = _routing_trace(scenario, source, base_dir)
    _check_schedule_names(scenario, source)
    scenario._policy_auto = auto
    scenario._pins = _pins(doc, source) if pins is None else dict(pins)
    return for_schedule(scenario, scenario.schedule, keep_unused=True)[0]


def for_schedule(scenario: Scenario, schedule: str, keep_unused: bool = False
                 ) -> tuple[Scenario, str | None]:
    """`scenario` running `schedule`, with the policy fields the schedule decides
    (``Schedule.placement``: where attention, the KV cache and the FFN live) set, and a note
    saying what that changed. A field the user gave explicitly with another value is an error
    naming both: a ``--set`` binds every schedule, a value in the file only the file's own."""
    s = SCHEDULES[schedule]
    policy, changes = scenario.policy, {}
    for key, value in s.placement.items():
        have = getattr(policy, key)
        if have == value:
            continue
        where, everywhere = scenario._pins.get(key, (None, False))
        if where is not None and (everywhere or schedule == scenario.schedule):
            allowing = [n for n, o in SCHEDULES.items() if o.placement.get(key, have) == have]
            raise TgError(
                f"{where} conflicts with schedule {s.name} ({s.title}), which decides "
                f"{PLACEMENT_MEANS[key]}: policy.{key}={value:g}. Drop the explicit value, or "
                f"choose a schedule that allows policy.{key}={have:g} "
                f"({', '.join(allowing) or 'none does yet'}).")
        changes[key] = value
    for key, default in EXPERT_FIELDS.items():
        # a schedule compared beside one that reads the field drops it; the file's own schedule
        # keeps it, and make_plan refuses a run of a schedule that would ignore it
        if not keep_unused and getattr(policy, key) != default \
                and not s.reads(key):
            changes[key] = default
    gpus = scenario.hardware.gpu.count
    # a pipeline's stages, or data parallelism's GPUs, run one group of micro-batches each
    groups = gpus if s.grouped else 1
    cap = s.max_micro_batches * policy.mu * groups
    if cap and policy.N > cap:
        where, everywhere = scenario._pins.get("N", (None, False))
        if where is not None and (everywhere or schedule == scenario.schedule):
            raise TgError(f"{where} conflicts with schedule {s.name} ({s.title}), which runs "
                          f"at most {s.max_micro_batches} micro-batch(es) of mu = {policy.mu}"
                          + (f" on each of {gpus} GPUs" if groups > 1 else "")
                          + f": set policy.N = {cap} (or give it no N).")
        changes["N"] = cap
    N, whole = changes.get("N", policy.N), groups * policy.mu
    if groups > 1 and N % whole and N > whole:
        where, everywhere = scenario._pins.get("N", (None, False))
        if where is None or not (everywhere or schedule == scenario.schedule):
            changes["N"] = N // whole * whole
    if not changes and scenario.schedule == schedule:
        return scenario, None
    placed = scenario.model_copy(update={
        "schedule": schedule, "policy": policy.model_copy(update=changes)})
    means = dict(PLACEMENT_MEANS, N=(
        "how many sequences (one micro-batch" + (" per GPU)" if groups > 1 else ")")
        if s.max_micro_batches else "how many sequences (whole micro-batches for each GPU's "
                                    "group)"))
    means.update(experts_gpu="no experts held on the GPU", eviction="no expert cache",
                 prefetch="no prefetch", experts_total="no experts placed",
                 cpu_moe="no experts placed", override_tensor="no experts placed")
    note = (f"{schedule} decides " + ", ".join(
        f"{means[k]}: {k} unset" if v is None else
        f"{means[k]}: {k}={v:g}" if not isinstance(v, str) else f"{means[k]}: {k}={v}"
        for k, v in changes.items())) if changes else None
    return placed, note


def _resolve_requests(raw: dict[str, Any], source: str, base_dir: Path) -> list | None:
    """The request list of ``workload.requests`` (a file) or ``workload.lengths`` (generated,
    from explicit figures or a workload preset's), with the workload's mean-length fields set
    from it, replacing any given (they are the fast path every model of the run uses)."""
    w = raw.get("workload")
    if not isinstance(w, dict) or not {"requests", "lengths"} & w.keys():
        return None
    given = [k for k in ("requests", "lengths") if w.get(k) is not None]
    if len(given) > 1:
        raise TgError(f"Invalid scenario {source}: give workload.requests (a file) or "
                      "workload.lengths (generated), not both.")
    if not given:
        return None
    w = raw["workload"] = dict(w)
    if given[0] == "requests":
        where = w["requests"]
        if not isinstance(where, str) or not where.strip():
            raise TgError(f"Invalid scenario {source}: workload.requests must be a file path "
                          f"(CSV or JSONL), not {shortened(where)}.")
        requests = read_requests(_resolve_path(where, base_dir))
    else:
        lengths = w["lengths"]
        if isinstance(lengths, dict) and "preset" in lengths:
            lengths = dict(lengths)
            name = lengths.pop("preset")
            if name not in presets.WORKLOADS:
                raise TgError(f"Invalid scenario {source}: workload.lengths.preset "
                              f"{shortened(name)} is not a preset{_near(name, presets.WORKLOADS)}; "
                              "known workloads: "
                              f"{', '.join(presets.WORKLOADS)}.")
            p = presets.WORKLOADS[name]
            lengths = {"prompt_mean": p["prompt_len"],
                       "prompt_max": p.get("max_prompt_len", p["prompt_len"]),
                       "gen_mean": p["gen_len"], "gen_max": p["gen_len"], **lengths}
        try:
            spec = LengthsSpec.model_validate(lengths)
        except ValidationError as err:
            raise TgError(_explain(err, source, prefix=("workload", "lengths"))) from None
        w["lengths"] = spec.model_dump()
        requests = generate_requests(spec.count, spec.prompt_mean, spec.prompt_max,
                                     spec.gen_mean, spec.gen_max, spec.seed)
    s = summary(requests)
    w.update(prompt_len=max(1, round(s["prompt_mean"])), max_prompt_len=s["prompt_max"],
             gen_len=s["gen_max"] if w.get("padded") else max(1, round(s["gen_mean"])))
    return requests


def _routing_trace(scenario: Scenario, source: str, base_dir: Path):
    """The router decisions ``workload.routing.trace`` names, checked against the model: a trace
    recorded from another model shape would price experts the model does not have."""
    where = scenario.workload.routing.trace
    if where is None:
        return None
    field = f"workload.routing.trace '{where}'"
    trace = trace_from_json(read_text(_resolve_path(where, base_dir), "workload.routing.trace"),
                            field)
    m = scenario.model
    for name, got, want in (("E", trace.E, m.E), ("k", trace.k, m.k), ("L", trace.L, m.L)):
        if got != want:
            raise TgError(f"Invalid scenario {source}: {field} was recorded from a model with "
                          f"{name} = {got}; this scenario's model has {name} = {want}. Record "
                          "it from this model (`tg execute --record-routing FILE`).")
    dense = tuple(l for l in range(m.L) if m.is_dense(l))
    if trace.dense and trace.dense != dense:
        raise TgError(f"Invalid scenario {source}: {field} was recorded from a model whose "
                      f"dense layers are {list(trace.dense)}; this scenario's model has "
                      f"{list(dense)}. Record it from this model.")
    return trace


def _pins(doc: dict[str, Any], source: str) -> dict[str, tuple[str, bool]]:
    """The policy fields a scenario document states, as pins binding its own schedule."""
    policy = doc.get("policy")
    if not isinstance(policy, dict):
        return {}
    return {str(k): (f"policy.{k}={shortened(v)} in {source}", False) for k, v in policy.items()}


# --- overrides -------------------------------------------------------------------------------

def apply_override(doc: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise TgError(f"Override '{item}' must look like key.path=value, "
                      "e.g. --set policy.mu=36.")
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader) if text.strip() else None
    except yaml.YAMLError:
        value = text
    except (ValueError, RecursionError):     # a 5,000-digit number, 10^5 nested brackets
        raise TgError(f"Override '{key.strip()[:60]}': the value is a number of more than 4,300 "
                      "digits or nests deeper than YAML can be read.") from None
    parts = key.strip().split(".")
    node = doc
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif isinstance(child, str) and depth == 0 and part in _PRESETS:
            child = node[part] = {"preset": child} if not _is_file(child) else {"file": child}
        elif not isinstance(child, dict):
            raise TgError(
                f"Override '{item}': '{'.'.join(parts[:depth + 1])}' is {child!r}, not a "
                "mapping, so it has no field to set."
            )
        node = child
    node[parts[-1]] = value


# --- sections --------------------------------------------------------------------------------

_PRESETS = {
    # section: (presets, what they are called, where else the section can come from)
    "model": (presets.MODELS, "models",
              " (or give a Hugging Face config.json, its folder or a GGUF file's path)"),
    "hardware": (presets.HARDWARE, "machines", " (or local: this machine; or give a hardware "
                                               "profile .yaml)"),
    "workload": (presets.WORKLOADS, "workloads", ""),
    "implementation": (presets.IMPLEMENTATIONS, "implementations",
                       " (or give an implementation profile .yaml)"),
}


def _resolve_section(section: str, value: Any, source: str, base_dir: Path,
                     seen: tuple[Path, ...] = ()) -> Any:
    """A section given as a preset name, a file, or a mapping that starts from either
    (``preset:``, ``file:``, ``hf_config:``) and overrides fields, as plain fields."""
    if isinstance(value, str):
        # a model's folder, as transformers saves one, stands for the config.json in it (a
        # preset's name is the preset's, whatever folder of that name lies about)
        folder = (section == "model" and value not in presets.MODELS
                  and _resolve_path(value, base_dir).is_dir())
        value = {"file": value} if _is_file(value) or folder else {"preset": value}
    if not isinstance(value, dict):
        return value     # validation will say what is wrong with it
    value = dict(value)
    base: dict[str, Any] = {}
    if section == "hardware" and value.get("preset") == "local":
        value.pop("preset")
        base = local_hardware(value.pop("gpu_like", None), section)
    elif "preset" in value:
        table, plural, elsewhere = _PRESETS[section]
        name = value.pop("preset")
        if not isinstance(name, str) or name not in table:
            raise TgError(
                f"Invalid scenario {source}: {section} {shortened(name)} is not a preset"
                f"{_near(name, table)}; known "
                f"{plural}: {', '.join(table)}{elsewhere}."
            )
        base = table[name]
    for key in ("file", "hf_config"):
        if key in value:
            where = value.pop(key)
            if not isinstance(where, str) or not where.strip():
                raise TgError(f"Invalid scenario {source}: {section}.{key} must be a file path, "
                              f"not {shortened(where)}.")
            base = _section_file(section, _resolve_path(where, base_dir), seen)
    merged = _merge(base, value)
    return _name_machine(base, merged) if section == "hardware" and "name" not in value \
        else merged


def _name_machine(base: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
    """A machine named for its GPUs ("1xT4") keeps naming them when an override changes their
    count: `--set hardware.gpu.count=2` runs on "2xT4", as every table and trace says."""
    try:
        gpu = merged["gpu"]
        if base.get("name") == f"{base['gpu']['count']}x{base['gpu']['name']}":
            return {**merged, "name": f"{gpu['count']}x{gpu['name']}"}
    except (KeyError, TypeError):
        pass                    # validation says what is missing
    return merged


def _section_file(section: str, path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if section == "model" and path.is_dir():
        if not (path / "config.json").is_file():
            raise TgError(f"The model folder '{path}' holds no config.json; give a Hugging Face "
                          "config.json, a GGUF file or a preset.")
        path = path / "config.json"
    if section == "model":
        return model_from_gguf(path) if path.suffix == ".gguf" else model_from_hf_config(path)
    if section in ("hardware", "implementation"):
        what = f"{section} profile"
        profile = read_yaml(path, what=what)
        if not isinstance(profile, dict):
            raise TgError(f"The {what} '{path}' must be a YAML mapping.")
        here = path.resolve()
        if here in seen:
            chain = " -> ".join(str(p) for p in (*seen, here))
            raise TgError(f"The {what} '{path}' includes itself through `file:` ({chain}).")
        return _resolve_section(section, profile, str(path), path.parent, (*seen, here))
    raise TgError(f"The {section} section cannot be read from a file ('{path}'); give a preset "
                  "name or its fields.")


def _check_schedule_names(scenario: Scenario, source: str) -> None:
    names = [("schedule", scenario.schedule)]
    if scenario.expect is not None:
        names += [("expect", n) for n in scenario.expect.schedules()]
    for field, name in names:
        if name not in SCHEDULES:
            raise TgError(
                f"Invalid scenario {source}: {field} names schedule '{name}', which tg does not "
                f"know; known schedules: {', '.join(SCHEDULES)}."
            )


# --- helpers ---------------------------------------------------------------------------------

def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _is_file(text: str) -> bool:
    return text.endswith((".json", ".yaml", ".yml", ".gguf"))


def _resolve_path(text: str, base_dir: Path) -> Path:
    path = Path(text).expanduser()
    if not path.is_absolute() and not path.exists():
        path = base_dir / path
    return path


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the second would
    silently win). A merge (``<<: *defaults``) is no repeat: the mapping's own keys override
    what it merges, as YAML says; each mapping is checked as written, before a merge rewrites
    it (PyYAML merges in place, into the anchored mapping itself). A merged mapping that merges
    again is refused: PyYAML 6 lets the inner merge's keys win over that mapping's own."""

    _MERGE = "tag:yaml.org,2002:merge"

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()
        self._merging: set[int] = set()      # the mappings that merge others

    def flatten_mapping(self, node):
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._check_keys(node)
        super().flatten_mapping(node)

    def _check_keys(self, node) -> None:
        seen = set()
        for key_node, value_node in node.value:
            if key_node.tag == self._MERGE:
                key = "<<"
                self._refuse_nested_merge(value_node, key_node.start_mark)
                self._merging.add(id(node))
            else:
                key = self.construct_object(key_node)
                if not isinstance(key, (str, int, float, bool)):
                    raise yaml.constructor.ConstructorError(
                        None, None, "a key must be a name or a number, not a list or a mapping",
                        key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {shortened(key)} appears twice", key_node.start_mark)
            seen.add(key)

    def _refuse_nested_merge(self, value_node, mark) -> None:
        merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        for m in merged:
            if isinstance(m, yaml.MappingNode) and (
                    id(m) in self._merging or any(k.tag == self._MERGE for k, _ in m.value)):
                raise yaml.constructor.ConstructorError(
                    None, None, "this merges a mapping that merges another, which PyYAML "
                    "resolves wrongly; merge both here instead (<<: [*a, *b])", mark)


# Numbers as YAML 1.2 writes them: YAML 1.1's octal (010 was 8), underscores (1_6 was 16),
# sexagesimal (1:0 was 60), binary and hexadecimal forms stay text, which a number field
# refuses naming the field (specs.Spec); 1e9 is a number, as YAML 1.1 did not say.
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                                       list("-+0123456789"))
_UniqueKeyLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:(?:0|[1-9][0-9]*)\.[0-9]*(?:[eE][-+]?[0-9]+)?"
                       r"|\.[0-9]+(?:[eE][-+]?[0-9]+)?|(?:0|[1-9][0-9]*)[eE][-+]?[0-9]+)"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _read_text(path: Path, what: str) -> str:
    return read_text(path, what)


def read_yaml(path: Path, *, what: str) -> Any:
    text = _read_text(path, what)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise TgError(f"The {what} '{path}' nests deeper than a {what} can.") from None
    except ValueError:        # (not a YAMLError) a number of more than 4,300 digits
        raise TgError(f"The {what} '{path}' holds a number of more than 4,300 digits.") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise TgError(f"The {what} '{path}' is not valid YAML{where}: {problem}.") from None


def shortened(value: Any, limit: int = 80) -> str:
    """A value as an error message may echo it: bounded, however deep or large it is."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 2, 4, 4, limit, limit
    text = r.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _kind_of(value: Any) -> str:
    if value is None:
        return "nothing (it is empty)"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _explain(err: ValidationError, source: str, prefix: tuple[str, ...] = ()) -> str:
    """One paragraph naming every field pydantic refused; `prefix` is where in the scenario the
    validated model sits."""
    parts = []
    for e in err.errors():
        where = prefix + tuple(e["loc"])
        loc = ".".join(str(p) for p in where)
        kind = e["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(where[:-1])
            if len(where) == 2 and where[0] in _PRESETS:     # a section may start from a preset
                allowed = ["preset", *allowed]
            msg = "unknown key" + _near(where[-1], allowed) + (
                f" (known keys: {', '.join(allowed)})" if allowed else "")
        elif kind == "missing":
            msg = "required but missing"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if "input" in e and not isinstance(e["input"], dict):
                msg += f" (got {shortened(e['input'])})"
            field = re.match(r"(\w+(?:\[\d+\])?) (must be an? (?:number|integer), .*)", msg,
                             re.S)
            if field:                   # specs.Spec: a field of the section named, as pydantic's
                loc = f"{loc}.{field.group(1)}" if loc else field.group(1)
                msg = field.group(2)
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"Invalid scenario {source}: " + "; ".join(parts) + "."


def _near(name: Any, known) -> str:
    """", did you mean 'x'?" where a known name is a likely misspelling of `name`."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.7)
    return f", did you mean '{close[0]}'?" if close else ""


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names of the model at `loc` inside Scenario, for 'unknown key' hints."""
    cls: Any = Scenario
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        cls = _model_class(field.annotation)
        if cls is None:
            return []
    return list(cls.model_fields)


def _model_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_class(arg)
            if found is not None:
                return found
    return None
