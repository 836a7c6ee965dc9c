"""One rule for numbers (issue 40 point 3): in a scenario file, a --set or a measurements file
a bool is never a number, a number in quotes is text and is refused, and YAML 1.1's octal,
underscore and sexagesimal forms are text too (PyYAML read `010` as 8, `1_6` as 16 and `1:0`
as 60, silently), each refused naming the field. YAML 1.2's numbers, `1e9` among them (which
YAML 1.1 read as text), are numbers."""

from __future__ import annotations

import pytest

from taskgraph.cli import main
from taskgraph.scenario import load_scenario

TINY = "scenarios/tiny.yaml"


@pytest.mark.parametrize("item, field, words", [
    ("policy.N=true", "policy.N", "must be an integer, not true"),
    ("policy.N=010", "policy.N", "octal"),
    ("policy.N=1_6", "policy.N", "underscore"),
    ("workload.gen_len=1:0", "workload.gen_len", "sexagesimal"),
    ("policy.mu='2'", "policy.mu", "a number in quotes is text"),
    ("policy.r_w=yes", "policy.r_w", "must be a number, not true"),
    ("policy.r_c=0x1", "policy.r_c", "hexadecimal"),
    ("workload.routing={kind: skewed, popularity: [1, true, 1, 1, 1, 1, 1, 1]}",
     "workload.routing.popularity[1]", "not true"),
    ("hardware.link.h2d_gbps='16'", "hardware.link.h2d_gbps", "in quotes"),
])
def test_a_bent_number_is_refused_naming_the_field(capsys, item, field, words):
    assert main(["simulate", TINY, "--set", item]) == 2
    err = capsys.readouterr().err
    assert f"{field}: must be" in err and words in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_in_a_file_too(tmp_path, capsys):
    path = tmp_path / "octal.yaml"
    path.write_text("model: tiny\nhardware: t4\nworkload: {prompt_len: 16, gen_len: 4}\n"
                    "policy: {N: 010, mu: 2}\n")
    assert main(["simulate", str(path)]) == 2
    assert "policy.N: must be an integer, not the text '010'" in capsys.readouterr().err


@pytest.mark.parametrize("item, field, value", [
    ("hardware.link.h2d_gbps=1e1", ("hardware", "link", "h2d_gbps"), 10.0),
    ("policy.r_w=.5", ("policy", "r_w"), 0.5),
    ("hardware.link.d2h_gbps=8.", ("hardware", "link", "d2h_gbps"), 8.0),
    ("policy.N=+8", ("policy", "N"), 8),
    ("workload.gen_len=2E1", ("workload", "gen_len"), 20),
])
def test_yaml_1_2_numbers_are_numbers(item, field, value):
    got = load_scenario(TINY, [item])
    for part in field:
        got = getattr(got, part)
    assert got == value
