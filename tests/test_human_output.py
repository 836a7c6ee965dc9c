"""What a person sees: every verb's default output (no --json), in each mode it has, ends with
exit 0, no traceback, and the rows a reader needs. The JSON of the same runs is tested elsewhere;
this is the output that used to go untested (a table that died after the right tokens)."""

from __future__ import annotations

import pytest

from taskgraph.cli import main
from taskgraph.cli.verbs import _APPLIED

TINY = "scenarios/tiny.yaml"
QUEUE = ["--set", "workload.lengths.preset=mtbench", "--set", "workload.lengths.count=12"]
TWO_GPUS = ["--set", "hardware.gpu.count=2"]

def _needs_torch():
    pytest.importorskip("torch")


# (argv, words the reader needs, whether it runs the executor)
CASES = {
    "simulate": (["simulate", TINY], ["tg simulate tiny: S1 (CGOPipe)", "throughput", "tok/s",
                                      "decode layer", "HRM bound", "bound by", "memory peak",
                                      "simulated in"], False),
    "simulate a request list": (["simulate", TINY, *QUEUE],
                                ["requests", "of 12 in", "batches (Algorithm 2)", "finished",
                                 "median", "p99"], False),
    "simulate refill": (["simulate", TINY, *QUEUE, "--set", "workload.refill=true"],
                        ["requests", "(refill)"], False),
    "simulate two GPUs": (["simulate", TINY, *TWO_GPUS], ["tiny on 2xT4", "peer"], False),
    "simulate a pipeline": (["simulate", TINY, *TWO_GPUS, "--schedule", "PP"],
                            ["PP (FlexGen pipeline parallelism)", "tiny on 2xT4"], False),
    "simulate the 2xT4 host": (["simulate", TINY, "--set", "hardware=2xt4"],
                               ["host shared", "host memory", "of decode"], False),
    "simulate an expert cache": (["simulate", TINY, "--schedule", "EC", "--set", "policy.N=1",
                                  "--set", "policy.mu=1", "--set", "policy.experts_gpu=2"],
                                 ["EC (Expert cache", "first token", "a token", "distinct",
                                  "uniform routing", "(lru) hits"], False),
    "simulate placed experts": (["simulate", TINY, "--schedule", "EP", "--set", "policy.N=2",
                                 "--set", "policy.mu=2", "--set", "policy.experts_gpu=2",
                                 "--set", "workload.routing={kind: skewed, zipf: 1}"],
                                ["EP (Experts placed", "first token", "skewed routing",
                                 "a layer placed on", "of the tokens' experts",
                                 "no llama.cpp equivalent"], False),
    "simulate llama.cpp's placement": (["simulate", TINY, "--schedule", "EP", "--set",
                                        "policy.cpu_moe=2"],
                                       ["the 16 (0 to 8 a layer)", "-ngl 99 --n-cpu-moe 2"],
                                       False),
    "compare": (["compare", TINY], ["tg compare tiny", "tok/s", "vs best", "S1", "S4", "DS",
                                    "S5: FFN on the CPU"], False),
    "compare across batch sizes": (["compare", TINY, "--batch-sizes", "1,2,8"],
                                   ["across batch sizes", "ms a token", "EP", "EC",
                                    "best (bound by)", "n/a 1",
                                    # each reason once, however many sizes it holds at
                                    "n/a 1: S1 needs at least 2 sequences (one a micro-batch)",
                                    "n/a 2: S5 needs at least 2 sequences"], False),
    "compare a request list": (["compare", TINY, *QUEUE, "--schedules", "S1,S4:padded"],
                               ["S1 Alg. 2", "S4 padded"], False),
    "search": (["search", TINY, "--top", "3"], ["tg search tiny", "feasible of", "ms/token",
                                                "best:", "hardware limit", "the trade-off"], False),
    "search --verify": (["search", TINY, "--top", "2", "--verify"], ["sim tok/s"], False),
    "batch": (["batch", TINY, *QUEUE], ["tg batch tiny: 12 requests", "micro-batches",
                                        "cache limit", "aborted"], False),
    "execute": (["execute", TINY, "--device", "cpu", "--steps", "2"],
                ["tg execute tiny: S1 (CGOPipe) on cpu", "(measured)", "executed in",
                 "tokens identical", "weights"], True),
    "execute a request list": (["execute", TINY, *QUEUE, "--set", "workload.lengths.count=4",
                                "--device", "cpu"],
                               ["a request list (measured)", "batches identical",
                                "each request alone: identical"], True),
    "execute two GPUs": (["execute", TINY, *TWO_GPUS, "--device", "cpu", "--steps", "2"],
                         ["tiny dimensions (measured)", "peer", "tokens identical"], True),
    "execute --processes": (["execute", TINY, *TWO_GPUS, "--device", "cpu", "--steps", "2",
                             "--processes"], ["tokens identical"], True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_default_output_shows_what_a_reader_needs(case, capsys):
    argv, words, executes = CASES[case]
    if executes:
        _needs_torch()
    assert main(argv) == 0
    out, err = capsys.readouterr()
    # results on stdout (`> out.txt` and `| less` hold them), only diagnostics on stderr
    assert not any(border in err for border in "┏┌│"), err
    assert "Traceback" not in err and "error:" not in err
    text = " ".join(out.split())                      # a title may wrap at the table's width
    missing = [w for w in words if w not in text]
    assert not missing, f"{missing} not in:\n{out}"


def test_outputs_and_profiles_are_named(tmp_path, capsys):
    """The files a verb wrote are named, each once, with how to open a trace."""
    _needs_torch()
    trace, png = tmp_path / "t.json.gz", tmp_path / "g.png"
    assert main(["simulate", TINY, "--trace", str(trace), "--gantt", str(png)]) == 0
    err = capsys.readouterr().err
    assert f"wrote {trace}" in err and "ui.perfetto.dev" in err and f"wrote {png}" in err
    assert main(["execute", TINY, "--device", "cpu", "--steps", "2", "--profile", "--trace",
                 str(trace)]) == 0
    out, err = capsys.readouterr()
    assert f"wrote {trace}" in err and "tokens identical" in out
    csv = tmp_path / "q.csv"
    assert main(["simulate", TINY, *QUEUE, "--csv", str(csv)]) == 0
    assert "requests" in capsys.readouterr().out and csv.exists()


def test_a_failed_check_shows_the_table_then_the_error(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(open(TINY).read() + "expect: {min_throughput_tok_s: {S1: 1.0e9}}\n")
    assert main(["compare", str(scenario), "--schedules", "S1", "--check"]) == 1
    out, err = capsys.readouterr()
    assert "expect: 0 of 1 checks hold" in out and "FAILED" in out
    assert "1 of 1 expectations" in err and "Traceback" not in err


def test_sweep_graph_and_roofline_say_what_they_wrote(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", TINY, "--vary", "hardware.link.h2d_gbps=8,16", "--out", str(out)]) == 0
    shown = "".join(capsys.readouterr())
    assert "tg sweep: 2 points" in shown and "sweep.csv" in shown and "tok/s" in shown
    assert main(["graph", TINY, "--out", str(tmp_path / "g.dot")]) == 0
    assert "segment 2 of S1" in "".join(capsys.readouterr())
    assert main(["roofline", TINY, "--out", str(tmp_path / "r.png")]) == 0
    assert "belongs on the" in "".join(capsys.readouterr())


def test_a_path_is_printed_as_given_not_as_markup(tmp_path, capsys):
    trace = tmp_path / "run[bold]1.json"
    assert main(["simulate", TINY, "--trace", str(trace)]) == 0
    assert f"wrote {trace}" in " ".join(capsys.readouterr().err.split()) and trace.exists()


# What the command line keeps for itself: where results go and how they are printed, and what
# it applies to the scenario before the API sees it (cli.verbs._load).
CLI_OWN = {"command", "func", "json", "trace", "trace_steps", "gantt", "batch_sizes",
           "scenario", "measurements", *_APPLIED}


def test_every_option_reaches_the_api():
    """The verbs pass each option to the API function of the same name by its name
    (cli.verbs._call): an option whose name no parameter has would be dropped in silence. A
    rename on either side fails here."""
    import argparse
    import inspect

    from taskgraph import api
    from taskgraph.cli.parsing import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"simulate", "compare", "execute", "calibrate", "fit",
                                "validate", "search", "sweep", "batch", "roofline", "graph"}
    for verb, p in sub.choices.items():
        params = set(inspect.signature(getattr(api, verb)).parameters)
        if verb == "compare":           # --batch-sizes hands the scenario to api.crossover
            params |= set(inspect.signature(api.crossover).parameters)
        dests = {a.dest for a in p._actions if a.dest != "help"}
        dropped = dests - params - CLI_OWN
        assert not dropped, f"tg {verb}: options no API parameter takes: {dropped}"


def test_every_verb_and_option_says_what_it_does():
    """A verb's help is its API function's first sentence, and an option's, unless the command
    line gives its own, its API parameter's line in the function's ``Args:`` section
    (cli.parsing): a parameter added without that line shows no help, and fails here."""
    import argparse

    from taskgraph.cli.parsing import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = {a.dest: a.help for a in sub._choices_actions}
    for verb, p in sub.choices.items():
        assert len(listed[verb]) > 20 and p.description.startswith(listed[verb]), verb
        bare = [a.option_strings or a.dest for a in p._actions if not a.help]
        assert not bare, f"tg {verb}: options without help: {bare}"

