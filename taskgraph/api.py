"""The Python API: what each `tg` verb does, as a function returning a typed result.

    import taskgraph as tg

    sim = tg.simulate("scenarios/t4.yaml", overrides={"policy.mu": 32})
    sim.summary["throughput_tok_s"]       # the figures; sim.to_dict() is `tg simulate --json`
    sim                                   # in a notebook: the tables `tg simulate` prints
    sim.write_trace("t4.json.gz")         # open it at https://ui.perfetto.dev

Every function takes a scenario as a file path, a mapping (the YAML document) or a
:class:`~taskgraph.specs.Scenario`; `overrides` are `--set` fields, as a mapping
(``{"policy.mu": 32}``) or ``"key=value"`` strings; the other options are the command line's.
Each result has ``to_dict()`` (exactly what the verb's ``--json`` prints), shows itself as the
verb's tables (``rich.print(result)``, or as HTML in a notebook), and, where the verb writes
traces, ``write_trace(path)`` and ``write_gantt(png)``. Bad input raises
:class:`~taskgraph.errors.TgError` with the message the command line prints; a path a function
writes is checked before any work (:func:`verb`). `progress(done,
total)`, where given, is called as work completes. Where a verb runs many simulations,
`backend` says where: "pool" (this machine's cores) or "ray", joining `ray_address` ("auto":
the cluster this node belongs to; ray://HOST:10001; None: a local Ray started for the call).

The command line (:mod:`taskgraph.cli`) is argument parsing and printing over these functions:
each option is the parameter of the same name, and its ``--help`` is that parameter's line in
the function's ``Args:`` section below, as the verb's help is the docstring's first paragraph,
so the two cannot drift apart (the command line says itself what ``--set``, ``--json``,
``--backend``, ``--ray-address``, ``--trace`` and ``--gantt`` do).
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import json
import numbers
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from taskgraph.errors import TgError
from taskgraph.files import Folder
from taskgraph.specs import Scenario

ScenarioLike = Union[str, Path, Mapping[str, Any], Scenario]
Overrides = Union[Mapping[str, Any], Iterable[str], None]
Progress = Union[Callable[[int, int], None], None]

__all__ = ["load", "simulate", "compare", "search", "execute", "fit", "sweep", "batch", "catalog",
           "validate", "calibrate", "roofline", "graph"]

from taskgraph.study.compare import parse_entry  # noqa: E402  (re-exported: the CLI reads entries)


def load(scenario: ScenarioLike, overrides: Overrides = None,
         schedule: str | None = None) -> Scenario:
    """The scenario, overridden and validated, with `schedule` (an override like any other, so
    that its placement replaces the file's). Loading runs nothing: ``policy: auto`` stays
    until :func:`resolve_policy`. Within a :func:`verb`, an output of it that loading read (a
    profile, a request list) is refused."""
    from taskgraph.dag.schedules import SCHEDULES
    from taskgraph.files import refuse_outputs_read
    from taskgraph.scenario import apply_override, load_scenario, scenario_from_dict

    if schedule is not None and (not isinstance(schedule, str) or schedule not in SCHEDULES):
        shown = repr(schedule) if len(repr(schedule)) <= 40 else repr(schedule)[:37] + "..."
        raise TgError(f"schedule {shown} is not a schedule; known schedules: "
                      f"{', '.join(SCHEDULES)}.")
    items = _override_items(overrides) + ([f"schedule={schedule}"] if schedule else [])
    if isinstance(scenario, Scenario):
        if items:
            raise TgError("Overrides apply to a scenario file or mapping; change a Scenario "
                          "object with scenario.model_copy(update=...).")
        loaded = scenario
    elif isinstance(scenario, Mapping):
        doc = json.loads(_as_json(scenario, "The scenario mapping"))   # the caller's copy stays
        for item in items:
            apply_override(doc, item)
        loaded = scenario_from_dict(doc)
    elif isinstance(scenario, (str, Path)):
        loaded = load_scenario(scenario, items)
    else:
        raise TgError(f"A scenario is a file path, a mapping or a Scenario, not "
                      f"{type(scenario).__name__}.")
    refuse_outputs_read()          # a profile, a request list the scenario names
    return loaded


def resolve_policy(scenario: Scenario) -> tuple[Scenario, Any]:
    """A scenario with ``policy: auto`` given the search's best policy (an expert-level
    schedule keeps its schedule), with that search's result; one with a policy as it is, with
    None. The verbs that run one policy (simulate, compare, execute, batch, validate, roofline,
    graph) call it first; the CLI says what it picked."""
    from taskgraph.study.search import resolve_auto_policy

    return resolve_auto_policy(scenario)


def _override_items(overrides: Overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        # JSON is YAML: each value reads back as the same number, string, list or mapping
        return [f"{k}={_as_json(v, f'overrides[{k!r}]')}" for k, v in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    from taskgraph.scenario import shortened

    items = list(overrides) if isinstance(overrides, Iterable) else None
    if items is None or not all(isinstance(item, str) for item in items):
        raise TgError(f"overrides are KEY=VALUE strings (a list of them, or one) or a mapping "
                      f"of keys to values, not {shortened(overrides)}.")
    return items


def _as_json(value: Any, what: str) -> str:
    """`value` as JSON text, or a TgError saying why a scenario file could not hold it."""
    try:
        return json.dumps(value)
    except TypeError as err:        # a Path, a set, bytes
        raise TgError(f"{what}: every value is a number, string, list or mapping, as in a "
                      f"scenario file ({err}).") from None
    except ValueError:
        raise TgError(f"{what} contains itself (a list or mapping inside itself); a scenario "
                      "file cannot.") from None
    except RecursionError:
        raise TgError(f"{what} nests too deep for a scenario.") from None


def verb(**writes: tuple[str, ...] | Folder) -> Callable[[Callable], Callable]:
    """A verb of the API, writing files at the parameters `writes` names: a file ending in one
    of the suffixes given (any, if none), or a :class:`Folder`. Each path given is checked
    before any work, as the command line checks its options (:func:`taskgraph.files.
    check_outputs`), and again once the scenario is loaded, against the files it read: a bad
    one must not cost a run. The files a call reads are inputs no output may replace while it
    runs (:func:`taskgraph.files.inputs_of_call`). The function's ``writes`` holds `writes`,
    for the command line's checks."""
    def wrap(func: Callable) -> Callable:
        signature = inspect.signature(func)
        assert set(writes) <= set(signature.parameters), f"{func.__name__} has no {writes}"
        hints = typing.get_type_hints(func, globals())

        @functools.wraps(func)
        def checked(*args: Any, **kwargs: Any) -> Any:
            from taskgraph.files import checked_outputs, inputs_of_call, path_error, writing

            try:
                given = signature.bind(*args, **kwargs).arguments
            except TypeError:       # the call itself says it the way Python does
                return func(*args, **kwargs)
            for name, value in given.items():
                if name not in writes:         # an output is named by its flag (_outputs)
                    _check_argument(func.__name__, name, value, hints.get(name))
            outputs = checked_outputs(writes, given)
            with inputs_of_call(), writing(outputs):
                try:
                    return func(*args, **kwargs)
                except OSError as err:      # a path no check of tg's looked at
                    error = path_error(err)
                    if error is None or error.exit_code != TgError.exit_code:
                        raise
                    raise error from None

        checked.writes = writes
        return checked
    return wrap


#: What a plain parameter must be, by its annotation, as the command line's parser requires
#: (a bool is no number: `steps=True` was one step).
_PLAIN = {int: ("an integer", lambda v: isinstance(v, numbers.Integral)
                 and not isinstance(v, bool)),
          float: ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
          str: ("text", lambda v: isinstance(v, str)),
          bool: ("true or false", lambda v: isinstance(v, bool))}


def _check_argument(verb_name: str, name: str, value: Any, hint: Any) -> None:
    """An argument of the type its annotation says (a plain int, float, str or bool; a path; a
    list of them; a mapping; or a union of these): a TgError naming it otherwise, not a run that
    never returns (`search(top=2.5)`) or a TypeError or AttributeError deep inside
    (`compare(T, 5)`). Annotations it cannot read (callables) are not checked."""
    if _fits(value, hint):
        return
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise TgError(f"{verb_name}: {name} must be {_described(hint)}, not {shown}.")


# typing's generics as get_origin names them
_MAPPINGS = (collections.abc.Mapping, dict)
_LISTS = (collections.abc.Iterable, collections.abc.Sequence, list, tuple)


def _options(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) \
        else (hint,)


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` is of type `hint`; True where the hint is not one _described reads."""
    if any(o is type(None) for o in _options(hint)) and value is None:
        return True
    checks = [_fits_one(value, o) for o in _options(hint) if o is not type(None)]
    return any(c is not False for c in checks)


def _fits_one(value: Any, hint: Any) -> bool | None:
    """Whether `value` is a `hint` (no union); None where the hint is not read here."""
    if hint in _PLAIN:
        return _PLAIN[hint][1](value)
    if hint is Path:
        return isinstance(value, (str, os.PathLike))
    origin = typing.get_origin(hint)
    if origin in _MAPPINGS:
        return isinstance(value, Mapping)
    if origin in _LISTS:
        item = (typing.get_args(hint) or (Any,))[0]
        if item is str:       # names and KEY=VALUE: the verb says what one should look like
            return None
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            return False
        # a list's items are checked (True is no integer); a generator is not drained
        return not isinstance(value, (list, tuple)) or all(_fits(v, item) for v in value)
    if isinstance(hint, type) and hint.__module__.startswith("taskgraph."):
        return isinstance(value, hint)
    return None


def _described(hint: Any, plural: bool = False) -> str:
    """What a hint takes, in words: "a path or a list of paths"."""
    options = [o for o in _options(hint) if o is not type(None)]
    if Path in options:                     # str | Path is a path
        options = [o for o in options if o is not str]
    words = []
    for option in options:
        origin = typing.get_origin(option)
        if option in _PLAIN:
            words.append(_PLURAL.get(option, "text") if plural else _PLAIN[option][0])
        elif option is Path:
            words.append("paths" if plural else "a path")
        elif origin in _MAPPINGS:
            words.append("mappings" if plural else "a mapping")
        elif origin in _LISTS:
            words.append(f"a list of {_described((typing.get_args(option) or (Any,))[0], True)}")
        elif isinstance(option, type):
            words.append(f"{option.__name__}s" if plural else f"a {option.__name__}")
    return " or ".join(dict.fromkeys(words)) or "something else"


_PLURAL = {int: "integers", float: "numbers", str: "text", bool: "true or false"}


@verb(csv=(".csv",))
def simulate(scenario: ScenarioLike, *, schedule: str | None = None,
             overrides: Overrides = None, csv: str | Path | None = None, keep_runs: bool = False,
             keep_steps: int | None = 2, progress: Progress = None):
    """`tg simulate`: simulate one schedule of a scenario (its whole request queue, batch after
    batch, when the workload lists requests).

    Returns a :class:`~taskgraph.serving.queue.QueueRun` for a request list, a
    :class:`~taskgraph.sim.simulate.Simulation` otherwise.

    Args:
        schedule: override the scenario's schedule
        csv: with a request list: write each request's batch, micro-batch and finish time here
        keep_runs: with a request list: keep each batch's task times, for ``write_trace`` and
            ``write_gantt`` (a 20,000-request queue is 17 M tasks)
        keep_steps: a run of millions of tasks keeps the task times of prefill and this many
            decode steps (None: all) for its trace and chart
    """
    from taskgraph.serving.queue import simulate_queue
    from taskgraph.sim.simulate import simulate_scenario

    s, _ = resolve_policy(load(scenario, overrides, schedule))
    if s.requests is None:
        if csv:
            raise TgError("--csv writes each request's finish time; the scenario lists no "
                          "requests (give workload.requests or workload.lengths).")
        return simulate_scenario(s, progress=progress, keep_steps=keep_steps)
    result = simulate_queue(s, progress=progress, keep_runs=keep_runs)
    if csv:
        result.write_csv(csv)
    return result


@verb()
def compare(scenario: ScenarioLike, schedules: Iterable[str] | str | None = None, *,
            overrides: Overrides = None, check: bool = False, keep_runs: bool = False,
            keep_steps: int | None = 2, progress: Progress = None):
    """`tg compare`: simulate several schedules side by side. Entries NAME:padded and
    NAME:refill batch a request list.

    Returns a :class:`~taskgraph.study.compare.Comparison`; ``result.failed`` lists the
    `expect` checks that broke.

    Args:
        schedules: the schedules to compare, comma-separated (default: every one that runs on
            the machine)
        check: check the scenario's `expect` section (tg compare exits 1 if a check fails)
        keep_runs: keep a request list's batches' task times (see `simulate`)
        keep_steps: the decode steps a long run keeps the task times of (see `simulate`)
    """
    from taskgraph.study.compare import compare as run

    names = _names(schedules)
    # the first schedule named is the scenario's own: its placement replaces the file's
    first = parse_entry(names[0])[0] if names and not isinstance(scenario, Scenario) else None
    s, _ = resolve_policy(load(scenario, overrides, first))
    return run(s, names, check=check, keep_runs=keep_runs, progress=progress,
               keep_steps=keep_steps)


@verb(plot=(".png",))
def crossover(scenario: ScenarioLike, schedules: Iterable[str] | str | None = None,
              batch_sizes: Iterable[int] | None = None, *, overrides: Overrides = None,
              plot: str | Path | None = None, backend: str = "pool",
              ray_address: str | None = None, progress: Progress = None):
    """`tg compare --batch-sizes`: each schedule (default S1, S4, S5, EP, EC) at each batch
    size (default 1, 2, 4, ..., 256, 504), at the policy that fills its GPU, simulated; where
    the batch schedules overtake the expert-level ones. Returns a
    :class:`~taskgraph.study.crossover.Crossover`.

    Args:
        schedules: the schedules to compare (default S1, S4, S5, EP, EC)
        batch_sizes: the batch sizes (default 1, 2, 4, ..., 256, 504)
        plot: draw throughput and per-token latency against batch size to this PNG
    """
    from taskgraph.study.crossover import crossover as run

    s = load(scenario, overrides)
    result = run(s, _names(schedules), batch_sizes, _backend(backend, ray_address), progress)
    if plot:
        result.plot(plot)
    return result


@verb(plot=(".png",))
def search(scenario: ScenarioLike, *, overrides: Overrides = None, top: int = 10,
           optimize: str | None = None, max_token_ms: float | None = None,
           max_ttft_s: float | None = None, batch: int | None = None,
           plot: str | Path | None = None, verify: bool = False, brute_force: bool = False,
           backend: str = "pool", ray_address: str | None = None, progress: Progress = None):
    """`tg search`: find the policy with the most tokens per second, or the lowest per-token
    latency, within limits on per-token latency and time to first token, over every schedule.

    The schedules that stream whole layers are priced by HRM prediction, the expert-level ones
    (EP, EC, ECP) by simulation at batch sizes 1 to 64. The objective is the scenario's
    `objective` section; the options below replace its fields. Returns a
    :class:`~taskgraph.study.search.SearchResult`, whose `front` is the Pareto front of
    throughput against per-token latency.

    Args:
        top: how many policies to list (default 10)
        optimize: throughput (the most tok/s) or latency (the lowest ms per token)
        max_token_ms: keep each sequence's time per token within this many ms
        max_ttft_s: keep the time to the first token within this many seconds
        batch: hold the batch size N fixed (e.g. 1 for one user)
        plot: draw every policy priced, throughput against per-token latency, with the Pareto
            front, to this PNG
        verify: simulate the top policies and re-rank them by simulated figures
        brute_force: also simulate a coarse grid: what trusting the predicted pick costs
            against the best simulated policy
    """
    from taskgraph.study.search import search_scenario

    jobs = _backend(backend, ray_address)
    given = {"optimize": optimize, "max_token_ms": max_token_ms, "max_ttft_s": max_ttft_s,
             "batch": batch}
    overrides = _override_items(overrides) + [f"objective.{k}={v}" for k, v in given.items()
                                              if v is not None]
    s = load(scenario, overrides)      # the search is what `auto` would run
    result = search_scenario(s, top, verify, brute_force, jobs, progress)
    if isinstance(scenario, (str, Path)):
        result.path = str(scenario)
    if plot:
        result.plot(plot)
    return result


@verb(out=(), record_routing=(".json",))
def execute(scenario: ScenarioLike, *, schedule: str | None = None,
            overrides: Overrides = None, device: str = "auto", steps: int | None = None,
            weights: str | None = None, prompts: str | None = None, out: str | None = None,
            zero_copy: bool = False, profile: bool = False, processes: bool = False,
            record_routing: str | Path | None = None, progress: Progress = None):
    """`tg execute`: run a schedule for real with real kernels, checked against a sequential
    reference forward.

    A scenario with a request list runs in the simulator's batches
    (:class:`~taskgraph.exec.request_list.QueueExecution`); otherwise returns an
    :class:`~taskgraph.exec.result.Execution`. A task that raised stops the run:
    ``result.failure`` holds its exception; its trace shows what ran before it. The routing
    recorded is the reference forward's, the one the tokens are checked against:
    ``result.routing`` holds it (:class:`~taskgraph.dag.routing.RoutingTrace`) and
    ``summary["routing"]`` names the file; a run that stops before its end writes none and
    says so in its warnings.

    Args:
        schedule: override the scenario's schedule
        device: cpu, cuda, or auto: cuda when this machine has one
        steps: decode steps (default: workload.gen_len)
        weights: a Hugging Face safetensors checkpoint folder of a family tg executes
            (docs/models.md) matching the model (default: synthetic weights, seeded)
        prompts: requests, a JSON object a line: prompt_ids or prompt, optional id and
            max_new_tokens (docs/execute.md)
        out: write each request's generated tokens here (JSON lines; with --prompts)
        zero_copy: CPU backend as an inference engine: weights read in place, no copies
            (default: as a GPU machine)
        profile: run under the PyTorch profiler; its ops (on CUDA kernels and copies too) go
            in the trace (--trace, write_trace) beside the tasks
        processes: several GPUs: a process each, talking over torch.distributed (gloo on the
            CPU backend, NCCL on CUDA)
        record_routing: write the router's top-k experts of every layer and token here
            (JSON; the first batch's), what workload.routing.trace replays
            (docs/experts.md)
    """
    from taskgraph.exec.execute import execute_scenario
    from taskgraph.exec.request_list import execute_queue

    if steps is not None and steps < 1:
        raise TgError(f"--steps must be at least 1, not {steps}.")
    items = _override_items(overrides) + ([f"workload.gen_len={steps}"] if steps else [])
    s, _ = resolve_policy(load(scenario, items, schedule))
    if s.requests is not None and not prompts:
        if profile:
            raise TgError("--profile traces one batch; run it without a request list (or with "
                          "--prompts).")
        if processes:
            raise TgError("--processes does not combine with a request list; run one batch "
                          "(or --prompts).")
        result = execute_queue(s, device, weights, progress=progress, zero_copy=zero_copy,
                               record_routing=record_routing is not None)
    else:
        if out and not prompts:
            raise TgError("--out writes each request's generated tokens; give --prompts FILE "
                          "or a scenario with a request list.")
        result = execute_scenario(s, None, device, weights, progress=progress,
                                  prompts_path=prompts, zero_copy=zero_copy, profile=profile,
                                  processes=processes, record_routing=record_routing is not None)
    if out and result.summary.get("outputs") is not None:
        result.write_outputs(out)       # in the file, not repeated in the JSON
    if record_routing is not None:
        if result.routing is not None:
            result.write_routing(record_routing)
        elif result.failure is not None or result.summary.get("interrupted"):
            result.warn(f"no routing written to {record_routing}: the run stopped before its "
                        "end, and the router's decisions are recorded by the reference forward "
                        "that follows it.")
        else:       # every finished run records: never an empty file
            raise TgError(f"The run recorded no routing; {record_routing} was not written.")
    return result


@verb(out=Folder(("report.json", "cells.csv", "parity.png", "steps.png")))
def fit(measurements: str | Path | Sequence[str | Path], *, out: str | Path | None = None,
        loo: bool = True, leave_out: str = "cell", backend: str = "pool",
        ray_address: str | None = None, progress: Progress = None):
    """`tg fit`: fit machine and implementation profiles to measured throughputs. By
    simulation, from end-to-end measurements (the format of shared/measurements/): one file, or
    several fitted as one parameter set where their machines and systems share parts; each
    cell's error and leave-one-out error, and each file's.

    Returns a :class:`~taskgraph.study.fit.FitReport`.

    Args:
        out: folder for the fitted profiles, report.json, cells.csv, parity.png and (where
            runs differ only in generation length) steps.png
        loo: refit without each cell in turn, for its leave-one-out error (default: True)
        leave_out: what each leave-one-out refit leaves out: a cell, a measurements file or a
            machine (default: cell)
    """
    import datetime

    from taskgraph.files import Output, check_outputs
    from taskgraph.study.fit import fit_files, free_parameters, run_fit, write_fit
    from taskgraph.study.measurements import load_many

    jobs = _backend(backend, ray_address)
    paths = [measurements] if isinstance(measurements, (str, os.PathLike)) else list(measurements)
    source, cells = load_many(paths)
    if out is not None:
        # the profiles the fit writes are named by its parts, known now: a folder where one
        # would replace a measurements file is refused before the fit, not after it
        check_outputs({"--out": Output(os.fspath(out), folder=True,
                                       holds=tuple(fit_files(free_parameters(cells))))}, paths)
    report = run_fit(source, cells, loo=loo, leave_out=leave_out, progress=progress,
                     backend=jobs)
    if out is not None:
        write_fit(report, out, datetime.date.today().isoformat())
    return report


@verb(out=Folder(("sweep.csv", "sweep.png")))
def sweep(scenario: str | Path, vary: Mapping[str, Iterable[Any]] | Iterable[str], *,
          out: str | Path, overrides: Overrides = None, backend: str = "pool",
          ray_address: str | None = None, progress: Progress = None):
    """`tg sweep`: re-run the policy search across hardware or workload values.

    At every combination of the varied fields, given as ``"KEY=V1,V2"`` strings or a mapping
    ``{"hardware.link.h2d_gbps": [8, 16, 32]}``. The scenario is a file (each point is a job
    that reads it). Returns a :class:`~taskgraph.study.sweep.Sweep`.

    Args:
        vary: a scenario field and its values, KEY=V1,V2,... (repeatable; the first is the x
            axis, a second one line each)
        out: output folder for sweep.csv and sweep.png
    """
    from taskgraph.study.sweep import parse_vary
    from taskgraph.study.sweep import sweep as run

    if isinstance(vary, str):
        vary = [vary]
    if not isinstance(vary, Iterable):
        raise TgError(f"vary must be KEY=V1,V2 strings (a list of them, or one) or a mapping "
                      f"of fields to values, not {str(vary)[:40]!r}.")
    items = ([f"{k}={_values(values)}" for k, values in vary.items()]
             if isinstance(vary, Mapping) else list(vary))
    jobs = _backend(backend, ray_address)
    return run(str(scenario), _override_items(overrides), parse_vary(items), out, jobs, progress)


def _values(values: Any) -> str:
    """A varied field's values as --vary writes them: a text is already "V1,V2" (it was
    iterated, "16" sweeping 1 and 6), a single value is one."""
    if isinstance(values, str):
        return values
    if not isinstance(values, Iterable):
        return str(values)
    return ",".join(str(v) for v in values)


@verb(csv=(".csv",))
def batch(scenario: ScenarioLike, *, overrides: Overrides = None,
          csv: str | Path | None = None):
    """`tg batch`: pack a scenario's request list into batches of micro-batches (Algorithm 2;
    padded in arrival order with workload.padded).

    Returns a :class:`~taskgraph.serving.requests.Batching`.

    Args:
        csv: write each request's batch and micro-batch (or 'aborted') here
    """
    from taskgraph.serving.requests import batching

    s, _ = resolve_policy(load(scenario, overrides))
    result = batching(s)
    if csv:
        result.write_csv(csv)
    return result


@verb(plot=(".png",))
def validate(scenario: ScenarioLike, schedules: Iterable[str] | str | None = None, *,
             overrides: Overrides = None, mu: Iterable[int] | None = None, repeats: int = 3,
             plot: str | Path | None = None, device: str = "auto", backend: str = "pool",
             ray_address: str | None = None, progress: Progress = None):
    """`tg validate`: execute and simulate the same graphs; report, task kind by task kind,
    where the model is wrong.

    Each schedule at each micro-batch size. Returns a
    :class:`~taskgraph.study.validate.Validation` (``write_trace``, ``parity_plot``).

    Args:
        schedules: schedules to validate, comma-separated (default: all but PP, which on the
            one device validate runs on is S4)
        mu: micro-batch sizes, comma-separated (default: the scenario's and half of it)
        repeats: executions per pair; the median run is kept (default 3)
        plot: write the parity plot (PNG) here
        device: cpu, cuda, or auto: cuda when this machine has one
    """
    from taskgraph.dag.schedules import SCHEDULES
    from taskgraph.exec.loading import pick_device
    from taskgraph.study.validate import validate_scenario

    names = _names(schedules)
    if names is None:
        names = [n for n, s in SCHEDULES.items() if s.parallel != "pipeline"]
    dev = pick_device(device)
    jobs = _backend(backend, ray_address)
    s, _ = resolve_policy(load(scenario, overrides))
    result = validate_scenario(s, names, list(mu) if mu else None, repeats, dev, jobs,
                               progress)
    if plot:
        result.parity_plot(plot)
    return result


@verb(out=(".yaml", ".yml"))
def calibrate(scenario: ScenarioLike, *, out: str | Path, overrides: Overrides = None,
              device: str = "auto", progress: Progress = None):
    """`tg calibrate`: measure this machine and write a hardware profile. Rates by
    microbenchmark, per-task costs fitted from the executor's own tasks; any scenario can use
    the profile.

    The scenario's model shapes the runs. Returns a
    :class:`~taskgraph.study.calibrate.Calibration`.

    Args:
        out: hardware profile to write (.yaml)
        device: cpu, cuda, or auto: cuda when this machine has one
    """
    from taskgraph.study.calibrate import calibrate_to
    from taskgraph.exec.loading import pick_device

    dev = pick_device(device)
    s = load(scenario, overrides)
    return calibrate_to(s, str(out), dev, progress)


@verb()
def catalog():
    """`tg catalog`: the models, machines, workloads, schedules and implementation profiles a
    scenario can name, and the scenarios shipped with tg, which a bare name finds (`tg
    simulate t4`).

    Returns a :class:`~taskgraph.study.catalog.Catalog`.
    """
    from taskgraph.study.catalog import catalog as run

    return run()


@verb(out=(".png",))
def roofline(scenario: ScenarioLike, *, out: str | Path, overrides: Overrides = None):
    """`tg roofline`: plot the Hierarchical Roofline of a scenario (PNG).

    Returns a :class:`~taskgraph.output.plots.Roofline`: its turning points, the intensity of
    each task kind, and where each belongs.

    Args:
        out: output PNG file
    """
    from taskgraph.output.plots import Roofline
    from taskgraph.output.plots import roofline as draw
    from taskgraph.output.plots import roofline_points

    s, _ = resolve_policy(load(scenario, overrides))
    draw(s, out)
    return Roofline(out, roofline_points(s))


@verb(out=(".json", ".dot"))
def graph(scenario: ScenarioLike, *, schedule: str | None = None, step: int | None = None,
          out: str | Path | None = None, overrides: Overrides = None):
    """`tg graph`: export one step's task graph (node-link JSON or Graphviz DOT).

    Returns a :class:`~taskgraph.output.export.SegmentGraph` (its networkx DiGraph is
    ``.graph``).

    Args:
        schedule: override the scenario's schedule
        step: segment to export: 0 is prefill, d >= 1 decode step d (default: a middle decode
            step)
        out: output file: .json or .dot
    """
    from taskgraph.dag.builder import build_segment, make_plan, segment_size
    from taskgraph.output.export import SegmentGraph, announce_large_graph, write_graph

    plan = make_plan(resolve_policy(load(scenario, overrides, schedule))[0])
    step = step if step is not None else min(2, plan.G)
    if not 0 <= step <= plan.G:
        raise TgError(f"--step {step} is outside the run: 0 (prefill) to {plan.G} "
                      "(workload.gen_len decode steps).")
    announce_large_graph(plan.schedule.name, step, segment_size(plan, step))
    segment = SegmentGraph(build_segment(plan, step), plan.schedule.name, step)
    if out is not None:
        write_graph(segment.graph, out)
    return segment


def _names(schedules: Iterable[str] | str | None) -> list[str] | None:
    """Schedules as a list or comma-separated, as --schedules takes them ("S1" is not S, 1)."""
    if schedules is None:
        return None
    if not isinstance(schedules, (str, Iterable)):
        raise TgError(f"schedules must be names such as 'S1' (a list of them, or one string "
                      f"'S1,S2'), not {str(schedules)[:40]!r}.")
    names = schedules.split(",") if isinstance(schedules, str) else list(schedules)
    wrong = [n for n in names if not isinstance(n, str)]
    if wrong:
        raise TgError(f"schedules must be names such as 'S1', not {wrong[0]!r}.")
    return [n.strip() for n in names if n.strip()]


def _backend(kind: str, address: str | None):
    """The backend asked for; Ray's absence, or an address where no Ray node answers, is found
    before any work."""
    from taskgraph.study.jobs import Backend, check_reachable, require_ray

    backend = Backend(kind, address)
    if backend.kind == "ray":
        require_ray()
        check_reachable(backend.address)
    return backend
