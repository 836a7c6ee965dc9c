#!/usr/bin/env python
"""The hostile-input probe catalogue of all three rounds, as a command (issue 40, point 7).

    python bench/hostile_probes.py [--only SUBSTR] [--jobs N] [--json OUT] [--list] [--keep]

Round one (issue 14): bad input, interrupted writes, concurrent runs. Round two (issue 26):
faults and scale: damaged files, outputs over inputs, devices and pipes, sizes, signals to
worker pools. Round three (issue 40): API calls sharing a process, signals under Ray and torch,
values YAML and Python bend into numbers, text that reaches a terminal or a spreadsheet, scale.
Each probe is data: what it runs (a `tg` command line, `python -m ...`, or a Python API snippet
run in a subprocess), the files it writes into a fresh folder first, and what clean means for
it. Every probe, whatever it expects, must also leave no traceback, no control or bidi
character in what it prints, no input changed, no process and no temporary file behind, and
answer within its timeout (a guard against hangs, not a speed target).

The house rules for bad input (README, docs/scenarios.md): one short paragraph on stderr naming
the field or path, exit 2, nothing on stdout, nothing written. Signals: exit 128 + signum (130
for Ctrl-C) with a one-line message. CSV cells a spreadsheet would run (= + @ - tab CR first)
neutralised, as OWASP recommends.

Prints a table of the probes that were not clean, with why, and
"N probes: C clean, D not clean, I inconclusive"; exits 0 when every probe ran clean.
Probes that need what this machine lacks (CUDA, Ray, PyTorch) are skipped and counted apart.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "scenarios" / "tiny.yaml")
T4 = str(REPO / "scenarios" / "t4.yaml")
SMALL = str(REPO / "scenarios" / "small.yaml")
MEASURED = str(REPO / "scenarios" / "measurements" / "moe-lightning-multi-gpu.yaml")


# --- how a probe is described ------------------------------------------------------------------

@dataclass(frozen=True)
class Special:
    """A file that is not plain text: a FIFO, a folder, a link, a sparse file, bytes made by a
    function (`make(path)`), or a copy of the generated checkpoint changed by `make(folder)`."""

    kind: str
    arg: Any = None


def fifo() -> Special:
    return Special("fifo")


def folder() -> Special:
    return Special("dir")


def link(target: str) -> Special:
    return Special("link", target)


def sparse(size: int) -> Special:
    """A file of `size` zero bytes that takes no disk (a 'huge file' costs nothing to make)."""
    return Special("sparse", size)


def made(make: Callable[[Path], None]) -> Special:
    return Special("call", make)


def checkpoint(change: Callable[[Path], None] | None = None) -> Special:
    """A copy of bench/make_checkpoint.py's random Mixtral checkpoint, changed by `change`."""
    return Special("ckpt", change)


@dataclass(frozen=True)
class Signal:
    """Send `sig` once `after` holds: ("file", GLOB) a file appears in the folder, ("children",
    N) the process has N children, ("stderr", TEXT) stderr says TEXT, ("delay", S) S seconds
    passed. `group`: to the whole process
    group, as a terminal's Ctrl-C does; otherwise to tg alone, as `kill PID` does. The run must
    end within `within` seconds of it."""

    sig: int
    after: tuple
    group: bool = False
    within: float = 30.0
    wait: float = 120.0        # how long the event may take to come (a guard)


@dataclass
class Probe:
    id: str
    round: int                  # 1, 2 or 3: the hostile round (issue 14, 26, 40) it comes from
    cls: str                    # the class of that issue's list it belongs to
    cmd: list[str] | None = None        # "tg ..." or "python ..." (run in the probe's folder)
    api: str | None = None              # a Python snippet (see API_PRELUDE), in a subprocess
    files: dict[str, Any] = field(default_factory=dict)   # written into the folder first
    rc: tuple[int, ...] = (2,)
    err: tuple[str, ...] = ()           # stderr must hold each
    err_any: tuple[str, ...] = ()       # stderr must hold one of these
    out: tuple[str, ...] = ()           # stdout must hold each
    not_in_output: tuple[str, ...] = () # text that must not be echoed (a file's secrets)
    creates: tuple[str, ...] = ()       # files that must exist afterwards
    may_exist: tuple[str, ...] = ()     # new files a failing or signalled run may leave
    may_change: tuple[str, ...] = ()    # inputs the run may rightly replace
    valid_json: tuple[str, ...] = ()    # if present afterwards, each must be whole JSON
    csv: tuple[str, ...] = ()           # CSV files ("-": stdout) whose cells must be neutral
    strict_json: bool = False           # a zero exit prints JSON without NaN/Infinity
    timeout: float = 60.0               # guard: no answer by then is a hang
    needs: tuple[str, ...] = ()         # "torch", "transformers", "ray", "cuda", "nonroot"
    signal: Signal | None = None
    max_err: int = 2000                 # an error paragraph longer than this echoes too much
    cost: float = 1.5                   # rough seconds, to start the slow probes first
    note: str = ""                      # what the issue said, where the id does not


def _split(cmd: str | list[str]) -> list[str]:
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def bad(pid: str, rnd: int, cls: str, cmd: str | list[str], *err: str, **kw: Any) -> Probe:
    """A command that must be refused: exit 2, one paragraph naming each of `err`."""
    return Probe(pid, rnd, cls, cmd=_split(cmd), err=err, **kw)


def good(pid: str, rnd: int, cls: str, cmd: str | list[str], *out: str, **kw: Any) -> Probe:
    """A valid-input control: exit 0, stdout holding each of `out`."""
    kw.setdefault("rc", (0,))
    return Probe(pid, rnd, cls, cmd=_split(cmd), out=out, **kw)


def api(pid: str, rnd: int, cls: str, snippet: str, *err: str, **kw: Any) -> Probe:
    """A Python API call: a TgError naming each of `err` is exit 2 (the prelude's); any other
    exception is a traceback. A snippet that checks a result calls fail(why)."""
    return Probe(pid, rnd, cls, api=textwrap.dedent(snippet).strip(), err=err, **kw)


def signalled(pid: str, rnd: int, cls: str, cmd: str | list[str], sig: int, after: tuple,
              **kw: Any) -> Probe:
    """A run stopped by `sig`: exit 128 + sig, a one-line message that says so."""
    sig_kw = {k: kw.pop(k) for k in ("group", "within", "wait") if k in kw}
    kw.setdefault("rc", (128 + sig,))
    kw.setdefault("err_any", ("interrupted", "stopped by", "terminated", "hung up"))
    kw.setdefault("cost", 15.0)
    kw.setdefault("timeout", 240.0)
    return Probe(pid, rnd, cls, cmd=_split(cmd), signal=Signal(sig, after, **sig_kw), **kw)


def scenario(model: str = "tiny", hardware: str = "t4",
             workload: str = "{prompt_len: 4, gen_len: 2}", policy: str = "{N: 4, mu: 2}",
             extra: str = "") -> str:
    """A small scenario file's text, with any section replaced."""
    return (f"{extra}model: {model}\nhardware: {hardware}\nworkload: {workload}\n"
            f"policy: {policy}\n")


REQUESTS = scenario(workload="{requests: r.csv}")       # a scenario over the list in r.csv


def requests(*rows: str, header: str = "id,prompt_len,gen_len") -> str:
    return header + "\n" + "".join(r + "\n" for r in rows)


def routing(E: int = 8, k: int = 2, L: int = 4, steps: int = 4, token: Any = None,
            fmt: str = "tg-routing/1") -> str:
    """A routing trace as `tg execute --record-routing` writes it (prefill then decode steps),
    every token's experts `token(step, layer, i)` (default: a fixed valid choice)."""
    def pick(s: int, layer: int, i: int) -> Any:
        if token is not None:
            return token(s, layer, i)
        return [(s + layer + i) % E, (s + layer + i + 1) % E][:k]

    doc = {"format": fmt, "E": E, "k": k, "L": L,
           "steps": [[[pick(s, layer, i) for i in range(64 if s == 0 else 8)]
                      for layer in range(L)] for s in range(steps + 1)]}
    return json.dumps(doc)


# the command that replays a routing trace r.json (docs/experts.md)
REPLAY = ["tg", "simulate", TINY, "--schedule", "EC", "--set", "policy.N=8", "--set",
          "policy.mu=8", "--set", "policy.experts_gpu=4", "--set", "workload.routing.kind=trace",
          "--set", "workload.routing.trace=r.json"]

MIXTRAL_CONFIG = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                  "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 128,
                  "max_position_embeddings": 4096, "rope_theta": 1000000.0,
                  "torch_dtype": "float32"}


def config(**changes: Any) -> str:
    """A Mixtral config.json with fields replaced (a value None removes the field)."""
    doc = {**MIXTRAL_CONFIG, **changes}
    return json.dumps({k: v for k, v in doc.items() if v is not None})


MODEL_FILE = scenario(model="config.json")         # a scenario over ./config.json


def gguf_file(arch: str = "llama", **fields: Any) -> Special:
    """A GGUF file written with llama.cpp's gguf package: a 4-layer MoE's metadata, with fields
    replaced by (kind, value), kind one of the writer's add_* value types."""
    def make(path: Path) -> None:
        import gguf
        import numpy as np

        w = gguf.GGUFWriter(str(path), arch)
        meta = {"block_count": ("uint32", 4), "embedding_length": ("uint32", 256),
                "feed_forward_length": ("uint32", 512), "attention.head_count": ("uint32", 8),
                "attention.head_count_kv": ("uint32", 2), "expert_count": ("uint32", 8),
                "expert_used_count": ("uint32", 2), "context_length": ("uint32", 4096),
                "vocab_size": ("uint32", 128), **fields}
        for key, (kind, value) in meta.items():
            getattr(w, f"add_{kind}")(f"{arch}.{key}", value)
        w.add_tensor("token_embd.weight", np.zeros((128, 256), dtype=np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return made(make)


def measurements(**changes: Any) -> Special:
    """The first cell of the shipped multi-GPU measurements, with fields replaced (`cells`
    replaces the whole list; a dotted key replaces a nested field)."""
    def make(path: Path) -> None:
        import yaml

        doc = yaml.safe_load(Path(MEASURED).read_text())
        cell = doc["cells"][0]
        cells: Any = [cell]
        for key, value in changes.items():
            if key == "cells":
                cells = value
                continue
            *outer, last = key.split(".")
            target = cell
            for part in outer:
                target = target[part]
            target[last] = value
        text = yaml.safe_dump({"source": "probe", "cells": cells}, allow_unicode=True)
        for i, raw in enumerate(raws):       # YAML written as is (010, 1_6): no dumper makes it
            text = text.replace(f"'__RAW{i}__'", raw.text)
        path.write_text(text)

    raws = [v for v in changes.values() if isinstance(v, Raw)]
    changes = {k: (f"__RAW{raws.index(v)}__" if isinstance(v, Raw) else v)
               for k, v in changes.items()}
    return made(make)


@dataclass(frozen=True)
class Raw:
    """A value written into YAML as this very text."""

    text: str


def _gzip_bomb(path: Path) -> None:
    """640 MiB of spaces in 640 KB (gzip members concatenate)."""
    block = gzip.compress(b" " * 16 * 2**20, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(b'{"traceEvents": ['))
        for _ in range(40):
            f.write(block)
        f.write(gzip.compress(b"]}"))


def _alias_bomb(depth: int = 9) -> str:
    """Billion laughs: nine nested lists of nine aliases each."""
    anchors = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] + [
        f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, depth)]
    return "[" + ", ".join(anchors) + "]"


def _prompts(n: int, new: int = 4) -> str:
    return "".join(json.dumps({"id": f"p{i}", "prompt_ids": [1, 2, 3, 4 + i % 5],
                               "max_new_tokens": new}) + "\n" for i in range(n))


def _edit_json(name: str, **changes: Any) -> Callable[[Path], None]:
    def change(ckpt: Path) -> None:
        path = ckpt / name
        doc = json.loads(path.read_text())
        doc.update(changes)
        _rewrite(path, json.dumps(doc).encode())
    return change


def _rewrite(path: Path, data: bytes) -> None:
    """Shards are hard links to the shared checkpoint: unlink before writing."""
    path.unlink()
    path.write_bytes(data)


def _shard_of(ckpt: Path, tensor: str) -> Path:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return ckpt / index["weight_map"][tensor]


def _truncate_shard(ckpt: Path) -> None:
    shard = sorted(ckpt.glob("model-00003-*.safetensors"))[0]
    _rewrite(shard, shard.read_bytes()[:1000])


def _missing_shard(ckpt: Path) -> None:
    sorted(ckpt.glob("model-00005-*.safetensors"))[0].unlink()


def _index_outside(ckpt: Path) -> None:
    path = ckpt / "model.safetensors.index.json"
    doc = json.loads(path.read_text())
    doc["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    _rewrite(path, json.dumps(doc).encode())


def _tensor(name: str, how: Callable[[Any], Any]) -> Callable[[Path], None]:
    def change(ckpt: Path) -> None:
        from safetensors.numpy import load_file, save_file

        shard = _shard_of(ckpt, name)
        tensors = load_file(str(shard))
        tensors[name] = how(tensors[name])
        shard.unlink()
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return change


def _nan_first(t: Any) -> Any:
    t = t.copy()
    t.flat[0] = float("nan")
    return t


CKPT_SCENARIO = scenario(model="{hf_config: ckpt/config.json}",
                         workload="{prompt_len: 8, gen_len: 2}")
EXEC_CKPT = ["tg", "execute", "s.yaml", "--weights", "ckpt", "--device", "cpu", "--prompts",
             "p.jsonl", "--json"]
TWO_PROMPTS = '{"id": "a", "prompt_ids": [1, 5, 6]}\n{"id": "b", "prompt_ids": [3, 25]}\n'


# --- the catalogue --------------------------------------------------------------------------------
# Numbers per field (rounds one and three): every numeric field a scenario or `--set` takes,
# against the values YAML and careless users produce. Round one found infinities, NaN and huge
# values accepted or crashing; round three found bools, quoted numbers and YAML 1.1's forms
# read as numbers (`true` as 1, '8' as 8, 010 as 8, 1_6 as 16, 1:0 as 60).

NUMERIC_FIELDS = ["hardware.gpu.tflops", "hardware.gpu.mem_gbps", "hardware.gpu.memory_gb",
                  "hardware.gpu.count", "hardware.link.h2d_gbps", "hardware.link.latency_us",
                  "hardware.cpu.mem_gbps", "hardware.cpu.cores", "hardware.gpu.task_overhead_us",
                  "hardware.handoff_us", "policy.N", "policy.mu", "policy.r_w", "policy.prefetch",
                  "workload.prompt_len", "workload.gen_len", "model.h", "model.L", "model.E",
                  "model.k"]
# (value, round, name); values every field must refuse
BAD_NUMBERS = [(".inf", 1, "inf"), (".nan", 1, "nan"), ("-1", 1, "negative"),
               ("true", 3, "bool")]
# and more, on fewer fields (each probe costs a second; one loader reads them all)
SOME = ["hardware.gpu.tflops", "hardware.link.h2d_gbps", "hardware.cpu.cores",
        "hardware.handoff_us", "policy.N", "policy.r_w", "workload.gen_len", "model.h"]
MORE_NUMBERS = {"'4'": (3, "quoted", SOME), "010": (3, "octal", SOME),
                "1e308": (1, "huge", ["hardware.gpu.tflops", "hardware.link.latency_us",
                                       "hardware.handoff_us", "policy.N", "workload.gen_len",
                                       "model.h", "model.L", "model.E", "hardware.cpu.cores"]),
                "-.inf": (1, "minus-inf", ["hardware.link.latency_us", "policy.prefetch"]),
                "0": (1, "zero", ["hardware.gpu.tflops", "hardware.gpu.mem_gbps",
                                  "hardware.link.h2d_gbps", "hardware.cpu.mem_gbps",
                                  "policy.N", "policy.mu", "model.k", "model.E"]),
                "1_6": (3, "underscore", ["policy.N", "workload.gen_len", "model.h"]),
                "1:0": (3, "sexagesimal", ["workload.gen_len", "policy.mu"]),
                "0x10": (3, "hex", ["policy.N", "model.h"]),
                "yes": (3, "yes", ["policy.N", "hardware.gpu.count"]),
                "abc": (1, "text", ["policy.N", "hardware.link.h2d_gbps", "policy.r_w"]),
                "[4]": (1, "list", ["policy.N", "hardware.gpu.tflops"]),
                "{a: 1}": (1, "mapping", ["policy.mu", "workload.gen_len"]),
                "null": (1, "null", ["policy.N", "hardware.link.h2d_gbps"]),
                "1e-320": (2, "subnormal", ["hardware.gpu.tflops", "hardware.link.h2d_gbps"]),
                "1" + "0" * 5000: (2, "5000-digits", ["policy.N", "hardware.gpu.tflops"])}


def _numbers() -> list[Probe]:
    probes = []
    for key in NUMERIC_FIELDS:
        for value, rnd, name in BAD_NUMBERS:
            probes.append(bad(f"set-{key}-{name}", rnd, "numbers: --set", ["tg", "simulate", TINY,
                              "--json", "--set", f"{key}={value}"], key, strict_json=True))
    for value, (rnd, name, keys) in MORE_NUMBERS.items():
        for key in keys:
            probes.append(bad(f"set-{key}-{name}", rnd, "numbers: --set", ["tg", "simulate", TINY,
                              "--json", "--set", f"{key}={value}"], key, strict_json=True))
    return probes


def _scenario_files() -> list[Probe]:
    """Round one: files that are not scenarios; round three: YAML's own surprises in a file."""
    R1, R3 = "bad input: scenario file", "numbers and tags: scenario file"
    sim = ["tg", "simulate", "s.yaml"]

    def pol(pid: str, policy: str, field: str) -> Probe:
        return bad(pid, 3, R3, sim, field, files={"s.yaml": scenario(policy=policy)})
    return [
        good("scenario-control", 1, R1, sim, "throughput", files={"s.yaml": scenario()}),
        good("scenario-bom", 1, R1, sim, "throughput",
             files={"s.yaml": "\ufeff" + scenario()}, note="a BOM is read, not refused"),
        good("scenario-merge-key", 2, R1, sim, "N=8 mu=4",
             files={"s.yaml": scenario(policy="{<<: {N: 8, mu: 2}, mu: 4}")}),
        good("scenario-yaml12-numbers", 3, R3, sim, "r_w=0.5",
             files={"s.yaml": scenario(hardware="{preset: t4, gpu: {memory_gb: 1.6e1}}",
                                       policy="{N: 4, mu: 2, r_w: .5}")}),
        good("scenario-name-digits", 3, R3, sim, "1234",
             files={"s.yaml": 'name: "1234"\n' + scenario()},
             note="a quoted number where text belongs is text"),
        bad("scenario-empty", 1, R1, sim, "s.yaml", files={"s.yaml": ""}),
        bad("scenario-comments-only", 1, R1, sim, "s.yaml", files={"s.yaml": "# nothing\n"}),
        bad("scenario-scalar", 1, R1, sim, "s.yaml", files={"s.yaml": "hello\n"}),
        bad("scenario-list", 1, R1, sim, "s.yaml", files={"s.yaml": "- model\n- tiny\n"}),
        bad("scenario-two-documents", 1, R1, sim, "s.yaml",
            files={"s.yaml": scenario() + "---\n" + scenario()}),
        bad("scenario-latin1", 1, R1, sim, "not UTF-8",
            files={"s.yaml": scenario().encode() + "# caf\xe9\n".encode("latin-1")}),
        bad("scenario-utf16", 1, R1, sim, "s.yaml", files={"s.yaml": scenario().encode("utf-16")}),
        bad("scenario-nul-byte", 1, R1, sim, "s.yaml", files={"s.yaml": "model: ti\x00ny\n"}),
        bad("scenario-tab-indent", 1, R1, sim, "s.yaml",
            files={"s.yaml": "model: tiny\nhardware: t4\npolicy:\n\tN: 4\n"}),
        bad("scenario-missing", 1, R1, ["tg", "simulate", "none.yaml"], "none.yaml"),
        bad("scenario-folder", 1, R1, ["tg", "simulate", "d.yaml"], "d.yaml",
            files={"d.yaml": folder()}),
        bad("scenario-dev-zero", 2, R1, ["tg", "simulate", "/dev/zero"], "not a regular file",
            timeout=30),
        bad("scenario-fifo", 2, R1, sim, "not a regular file", files={"s.yaml": fifo()},
            timeout=30),
        bad("scenario-link-loop", 2, R1, sim, "s.yaml",
            files={"s.yaml": link("t.yaml"), "t.yaml": link("s.yaml")}),
        bad("scenario-huge-sparse", 2, R1, sim, "s.yaml", files={"s.yaml": sparse(600 * 2**20)},
            timeout=60),
        bad("scenario-duplicate-key", 1, R1, sim, "appears twice",
            files={"s.yaml": scenario() + "policy: {N: 8, mu: 2}\n"}),
        bad("scenario-merge-of-merge", 2, R1, sim, "merges",
            files={"s.yaml": scenario(workload="&p {<<: {gen_len: 8}, gen_len: 2, prompt_len: 4}")
                   + "schedule: {<<: *p}\n"}),
        bad("scenario-unknown-top-key", 1, R1, sim, "bogus",
            files={"s.yaml": scenario() + "bogus: 1\n"}),
        bad("scenario-unknown-nested-key", 1, R1, sim, "policy.bogus",
            files={"s.yaml": scenario(policy="{N: 4, mu: 2, bogus: 1}")}),
        bad("scenario-list-as-key", 2, R1, sim, "key",
            files={"s.yaml": "model: tiny\nhardware: t4\n? [a, b]\n: 1\n"}),
        bad("scenario-alias-bomb", 1, R1, sim, "model.name",
            files={"s.yaml": scenario(model="{preset: tiny, name: " + _alias_bomb() + "}")},
            timeout=30),
        bad("scenario-alias-bomb-policy", 1, R1, sim, "policy",
            files={"s.yaml": "bomb: &b " + _alias_bomb(8) + "\n" + scenario(policy="*b")},
            timeout=30),
        bad("scenario-deep-nesting", 1, R1, sim, "s.yaml",
            files={"s.yaml": "model: " + "[" * 100_000 + "]" * 100_000 + "\n"}, timeout=30),
        bad("scenario-huge-int", 2, R1, sim, "4,300 digits",
            files={"s.yaml": scenario(policy="{N: 1" + "0" * 5000 + ", mu: 2}")}),
        bad("scenario-schedule-unknown", 1, R1, sim, "S9",
            files={"s.yaml": scenario(extra="schedule: S9\n")}),
        bad("scenario-preset-unknown", 1, R1, sim, "nosuch",
            files={"s.yaml": scenario(model="nosuch")}),
        bad("scenario-preset-list", 1, R1, ["tg", "simulate", TINY, "--set", "model.preset=[]"],
            "is not a preset"),
        bad("scenario-self-profile", 1, R1, sim, "includes itself",
            files={"s.yaml": scenario(hardware="p.yaml"), "p.yaml": "file: p.yaml\n"}),
        bad("scenario-mutual-profiles", 1, R1, sim, "p.yaml",
            files={"s.yaml": scenario(hardware="p.yaml"), "p.yaml": "file: q.yaml\n",
                   "q.yaml": "file: p.yaml\n"}),
        bad("scenario-profile-latin1", 1, R1, sim, "not UTF-8",
            files={"s.yaml": scenario(hardware="p.yaml"),
                   "p.yaml": "preset: t4 # caf\xe9\n".encode("latin-1")}),
        bad("scenario-profile-missing", 1, R1, sim, "p.yaml",
            files={"s.yaml": scenario(hardware="p.yaml")}),
        # round three: YAML 1.1 and Python bend values into numbers, in a file too
        pol("file-N-octal", "{N: 010, mu: 2}", "policy.N"),
        pol("file-N-underscore", "{N: 1_6, mu: 2}", "policy.N"),
        bad("file-gen-len-sexagesimal", 3, R3, sim, "workload.gen_len",
            files={"s.yaml": scenario(workload="{prompt_len: 4, gen_len: 1:0}")}),
        pol("file-N-true", "{N: true, mu: 2}", "policy.N"),
        pol("file-N-quoted", "{N: '8', mu: 2}", "policy.N"),
        pol("file-prefetch-quoted", "{N: 4, mu: 2, prefetch: '0.5'}", "policy.prefetch"),
        pol("file-N-hex", "{N: 0x8, mu: 2}", "policy.N"),
        pol("file-N-binary", "{N: 0b100, mu: 2}", "policy.N"),
        pol("file-N-str-tag", "{N: !!str 8, mu: 2}", "policy.N"),
        pol("file-N-float-nan-tag", "{N: !!float nan, mu: 2}", "policy.N"),
        bad("file-python-object-tag", 3, R3, sim, "s.yaml",
            files={"s.yaml": scenario(model='!!python/object/apply:os.system ["touch owned"]')}),
        bad("file-python-name-tag", 3, R3, sim, "s.yaml",
            files={"s.yaml": scenario(model="!!python/name:os.system")}),
        bad("file-binary-name-escape", 3, "text to a terminal", sim, "name",
            files={"s.yaml": "name: !!binary G1sySg==\n" + scenario()},
            note="ESC[2J (clear screen) as base64 passed the control-character check"),
        bad("file-binary-model", 3, R3, sim, "model",
            files={"s.yaml": scenario(model="!!binary dGlueQ==")}),
        bad("file-timestamp-name", 3, R3, sim, "policy.N",
            files={"s.yaml": scenario(policy="{N: 2001-12-14, mu: 2}")}),
        bad("file-set-tag", 3, R3, sim, "policy",
            files={"s.yaml": scenario(policy="!!set {N: null, mu: null}")}),
        bad("file-self-alias", 3, R3, sim, "s.yaml",
            files={"s.yaml": "model: &m [tiny, *m]\nhardware: t4\n"}),
    ]


def _set_keys() -> list[Probe]:
    """`--set` itself: keys and forms a hurried user types."""
    C = "bad input: --set"
    sim = ["tg", "simulate", TINY, "--set"]
    return [
        good("set-control", 1, C, sim + ["policy.mu=4"], "mu=4"),
        bad("set-no-equals", 1, C, sim + ["policy.N"], "policy.N"),
        bad("set-empty-key", 1, C, sim + ["=4"], "--set"),
        bad("set-empty", 1, C, sim + [""], "--set"),
        bad("set-unknown-section", 1, C, sim + ["nosuch.x=1"], "nosuch"),
        bad("set-unknown-policy-key", 1, C, sim + ["policy.bogus=1"], "policy.bogus"),
        bad("set-double-dot", 1, C, sim + ["policy..N=4"], "policy"),
        bad("set-key-into-number", 1, C, sim + ["policy.N.x=4"], "policy.N"),
        bad("set-deep-value", 2, C, sim + ["policy.N=" + "[" * 50_000], "nests deeper"),
        bad("set-unclosed-flow", 1, C, sim + ["policy={N: 4"], "policy"),
        bad("set-python-tag", 3, C, sim + ["model=!!python/object/apply:os.system [touch owned]"],
            "model"),
        bad("set-alias-bomb", 1, C, sim + ["model.name=" + _alias_bomb()], "model.name",
            timeout=30),
        bad("set-placement-conflict", 1, C, ["tg", "simulate", T4, "--set", "policy.A_g=1"],
            "conflicts with schedule"),
        bad("set-schedule-empty", 3, C, sim + ["schedule="], "schedule"),
        bad("set-schedule-flag-unknown", 1, C, ["tg", "simulate", TINY, "--schedule", "S9"],
            "--schedule"),
        bad("set-lengths-seed-negative", 3, C, sim + [
            "workload.lengths={count: 3, prompt_mean: 4, prompt_max: 8, gen_mean: 2, "
            "gen_max: 4, seed: -1}"], "workload.lengths.seed"),
        bad("set-task-gbps-zero", 1, C, sim + ["hardware.task_gbps={D3: 0}"], "hardware.task_gbps"),
        bad("set-task-gbps-nan", 1, C, sim + ["hardware.task_gbps={D3: .nan}"],
            "hardware.task_gbps"),
        bad("set-interconnect-no-rate", 1, C, sim + ["hardware.gpu.count=2", "--set",
                                                     "hardware.interconnect={eff: 0.5}"],
            "hardware.interconnect"),
        bad("set-precision-unknown", 1, C, sim + ["model.precision.experts=q4_z"],
            "model.precision.experts"),
        bad("set-hardware-local-no-gpu", 2, C, sim + ["hardware=local"], "hardware",
            needs=("nocuda",)),
    ]


def _outputs() -> list[Probe]:
    """Round one: output paths checked before any work; round two: outputs over inputs,
    devices, links; round three: paths with control characters."""
    C1, C2 = "output paths", "outputs over inputs and devices"
    sim = ["tg", "simulate", TINY]
    return [
        good("trace-control", 1, C1, sim + ["--trace", "t.json"], creates=("t.json",),
             valid_json=("t.json",)),
        good("trace-missing-folder", 1, C1, sim + ["--trace", "new/sub/t.json"],
             creates=("new/sub/t.json",), note="a missing folder is made"),
        good("trace-symlink-stays", 2, C2, sim + ["--trace", "l.json"], creates=("real.json",),
             files={"l.json": link("real.json")}, valid_json=("real.json",)),
        good("trace-dev-null", 2, C2, sim + ["--trace", "/dev/null"], rc=(0, 2),
             note="/dev/null must stay a device (a trace path needs its suffix: 2 is clean)"),
        bad("trace-empty-path", 1, C1, sim + ["--trace", ""], "--trace"),
        bad("trace-is-folder", 1, C1, sim + ["--trace", "d"], "--trace", files={"d": folder()}),
        bad("trace-under-file", 1, C1, sim + ["--trace", "f.txt/t.json"], "--trace",
            files={"f.txt": "x"}),
        bad("trace-is-scenario", 1, C1, ["tg", "simulate", "s.yaml", "--trace", "s.yaml"],
            "is the input", files={"s.yaml": scenario()}),
        bad("trace-is-profile", 2, C2, ["tg", "simulate", "s.yaml", "--trace", "p.json"],
            "p.json", files={"s.yaml": scenario(hardware="p.json"), "p.json": '{"preset": "t4"}'}),
        bad("trace-unknown-suffix", 1, C1, sim + ["--trace", "t.pftrace.gz"], "--trace"),
        bad("trace-steps-word", 1, C1, sim + ["--trace", "t.json", "--trace-steps", "x"],
            "--trace-steps"),
        bad("trace-steps-negative", 1, C1, sim + ["--trace", "t.json", "--trace-steps", "-1"],
            "--trace-steps"),
        bad("trace-under-link-loop", 2, C2, sim + ["--trace", "a/x.json"], "cannot be resolved",
            files={"a": link("b"), "b": link("a")}),
        bad("trace-in-proc", 2, C2, sim + ["--trace", "/proc/tg-probe.json"], "/proc"),
        bad("trace-dev-full", 2, C2, sim + ["--trace", "/dev/full"], "/dev/full"),
        bad("trace-name-too-long", 1, C1, sim + ["--trace", "x" * 300 + ".json"], "--trace"),
        bad("trace-and-gantt-same", 2, C1, ["tg", "simulate", TINY, "--trace", "x.json",
                                            "--gantt", "x.json"], "--gantt"),
        bad("gantt-bad-suffix", 1, C1, sim + ["--gantt", "g.jpg"], "--gantt"),
        bad("csv-without-requests", 1, C1, sim + ["--csv", "c.csv"], "--csv"),
        bad("csv-is-request-list", 2, C2, ["tg", "simulate", "s.yaml", "--csv", "r.csv"],
            "is an input", files={"s.yaml": REQUESTS, "r.csv": requests("a,4,2", "b,5,3")}),
        bad("batch-csv-is-request-list", 2, C2, ["tg", "batch", "s.yaml", "--csv", "r.csv"],
            "is an input", files={"s.yaml": REQUESTS, "r.csv": requests("a,4,2", "b,5,3")}),
        bad("csv-bad-suffix", 1, C1, ["tg", "batch", "s.yaml", "--csv", "c.txt"], "--csv",
            files={"s.yaml": REQUESTS, "r.csv": requests("a,4,2")}),
        bad("graph-bad-suffix", 1, C1, ["tg", "graph", TINY, "--out", "g.txt"], "--out"),
        bad("graph-out-is-scenario", 1, C1, ["tg", "graph", "s.yaml", "--out", "s.yaml"], "--out",
            files={"s.yaml": scenario()}),
        bad("roofline-bad-suffix", 1, C1, ["tg", "roofline", TINY, "--out", "r.jpg"], "--out"),
        bad("roofline-out-folder", 1, C1, ["tg", "roofline", TINY, "--out", "d.png"], "--out",
            files={"d.png": folder()}),
        bad("sweep-out-is-file", 1, C1, ["tg", "sweep", TINY, "--vary", "workload.gen_len=2,3",
                                         "--out", "f"], "--out", files={"f": "x"}),
        bad("sweep-out-holds-folder", 2, C1, ["tg", "sweep", TINY, "--vary",
                                              "workload.gen_len=2,3", "--out", "o"], "sweep.csv",
            files={"o/sweep.csv": folder()}),
        bad("fit-out-under-file", 2, C1, ["tg", "fit", MEASURED, "--out", "f/o", "--no-loo"],
            "--out", files={"f": "x"}),
        # the measurements file named as a profile fit writes into its --out folder; the
        # guard tells a refusal before the fit (a second) from one after it (minutes)
        bad("fit-out-over-its-input", 2, C2, ["tg", "fit", "m/hardware-2xt4.yaml", "--out", "m",
                                              "--no-loo"], "hardware-2xt4.yaml",
            files={"m/hardware-2xt4.yaml": Path(MEASURED).read_text()}, timeout=20, cost=20,
            note="an output over an input is refused before any work (round one, item 7)"),
        # round three: a path a user did not mean to print
        bad("path-escape-scenario", 3, "text to a terminal",
            ["tg", "simulate", "a\x1b]0;owned\x07\x1b[2Jb.yaml"], "simulate"),
        bad("path-bidi-trace", 3, "text to a terminal",
            sim + ["--trace", "t\u202e.json.txt"], "--trace"),
        bad("path-escape-gantt", 3, "text to a terminal",
            sim + ["--gantt", "g\x1b[31m.jpg"], "--gantt"),
        bad("path-c1-csi-trace", 3, "text to a terminal",
            sim + ["--trace", "t\x9b2J.txt"], "--trace"),
    ]


def _requests() -> list[Probe]:
    """Request lists (round two: one careful reader; round three: one rule for numbers)."""
    C2, C3 = "request lists", "numbers: request lists"
    batch = ["tg", "batch", "s.yaml"]

    def rq(pid: str, rnd: int, cls: str, content: Any, *err: str, **kw: Any) -> Probe:
        return bad(pid, rnd, cls, batch, *err, files={"s.yaml": REQUESTS, "r.csv": content},
                   **kw)

    def rqj(pid: str, rnd: int, cls: str, content: Any, *err: str, **kw: Any) -> Probe:
        return bad(pid, rnd, cls, batch, *err,
                   files={"s.yaml": scenario(workload="{requests: r.jsonl}"), "r.jsonl": content},
                   **kw)

    return [
        good("requests-control", 2, C2, batch, "2 requests",
             files={"s.yaml": REQUESTS, "r.csv": requests("a,4,2", "b,5,3")}),
        good("requests-bom", 2, C2, batch, "1 requests",
             files={"s.yaml": REQUESTS, "r.csv": "\ufeff" + requests("a,4,2")}),
        good("requests-jsonl-control", 2, C2, batch, "2 requests",
             files={"s.yaml": scenario(workload="{requests: r.jsonl}"),
                    "r.jsonl": '{"prompt_len": 4, "gen_len": 2}\n'
                               '{"prompt_len": 5, "gen_len": 3}\n'}),
        rq("requests-empty", 2, C2, "", "r.csv"),
        rq("requests-header-only", 2, C2, requests(), "r.csv"),
        rq("requests-typo-header", 2, C2, requests("a,4,2", header="id,promt_len,gen_len"),
           "promt_len"),
        rq("requests-passwd", 2, C2, "root:x:0:0:root:/root:/bin/bash\n", "r.csv",
           not_in_output=("root:x",)),
        rq("requests-wide-header", 2, C2, ",".join(f"c{i}" for i in range(300_000)) + "\n",
           "r.csv", max_err=1000),
        rq("requests-huge-field", 3, C2, requests("x" * 200_000 + ",4,2"), "line 2"),
        rq("requests-5000-digits", 2, C2, requests("a,1" + "0" * 5000 + ",2"), "line 2"),
        rqj("requests-jsonl-deep", 2, C2, "[" * 100_000 + "]" * 100_000 + "\n", "nesting"),
        rqj("requests-jsonl-digits", 2, C2, '{"prompt_len": ' + "9" * 5000 + ', "gen_len": 2}\n',
            "4,300 digits"),
        rq("requests-fifo", 2, C2, fifo(), "not a regular file", timeout=30),
        bad("requests-dev-zero", 2, C2, batch, "not a regular file", timeout=30,
            files={"s.yaml": scenario(workload="{requests: /dev/zero}")}),
        bad("requests-proc-environ", 2, C2, batch, "environ", timeout=30,
            files={"s.yaml": scenario(workload="{requests: /proc/self/environ}")},
            not_in_output=("PATH=",)),
        rq("requests-folder", 2, C2, folder(), "r.csv"),
        rq("requests-latin1", 2, C2, requests("caf\xe9,4,2").encode("latin-1"), "not UTF-8"),
        rq("requests-sparse-huge", 2, C2, sparse(600 * 2**20), "r.csv", timeout=60),
        rq("requests-negative", 2, C2, requests("a,-4,2"), "prompt_len"),
        rq("requests-zero-gen", 2, C2, requests("a,4,0"), "gen_len"),
        rq("requests-fraction", 2, C2, requests("a,4.5,2"), "prompt_len"),
        rq("requests-duplicate-id", 2, C2, requests("a,4,2", "a,5,3"), "twice"),
        rq("requests-short-row", 2, C2, requests("a,4"), "line 2"),
        bad("requests-gen-10e7", 2, "scale", ["tg", "simulate", "s.yaml"], "GB",
            files={"s.yaml": REQUESTS, "r.csv": requests("a,4,10000000")}),
        rq("requests-id-escape", 3, "text to a terminal", requests('"a\x1b[2Jb",4,2'), "line 2"),
        rq("requests-id-bidi", 3, "text to a terminal", requests("abc\u202eexe,4,2"), "line 2"),
        rq("requests-id-nul", 3, "text to a terminal", requests("a\x00b,4,2"), "line 2"),
        rq("requests-id-1mb", 2, C2, requests("x" * 2**20 + ",4,2", "x" * 2**20 + ",5,2"),
           "line 2", max_err=1000),
        rq("requests-true", 3, C3, requests("a,true,2"), "prompt_len"),
        rq("requests-underscore", 3, C3, requests("a,5_000,2"), "prompt_len"),
        rq("requests-arabic-digits", 3, C3, requests("a,\u0664,2"), "prompt_len"),
        rq("requests-exponent", 3, C3, requests("a,1e3,2"), "prompt_len"),
        rq("requests-nan", 3, C3, requests("a,nan,2"), "prompt_len"),
        rq("requests-inf", 3, C3, requests("a,inf,2"), "prompt_len"),
        rqj("requests-jsonl-bool", 3, C3, '{"prompt_len": true, "gen_len": 2}\n', "prompt_len"),
        rqj("requests-jsonl-quoted", 3, C3, '{"prompt_len": "4", "gen_len": 2}\n', "prompt_len"),
        rqj("requests-jsonl-float", 3, C3, '{"prompt_len": 4.0, "gen_len": 2.5}\n', "gen_len"),
        rqj("requests-jsonl-nan", 3, C3, '{"prompt_len": NaN, "gen_len": 2}\n', "prompt_len"),
        rqj("requests-jsonl-not-object", 2, C2, "[4, 2]\n", "line 1"),
        bad("lengths-count-10e7", 2, "scale", ["tg", "simulate", TINY, "--set",
                                               "workload.lengths.preset=mtbench", "--set",
                                               "workload.lengths.count=10000000"],
            "workload.lengths.count"),
        bad("lengths-count-bool", 3, C3, ["tg", "batch", TINY, "--set",
                                          "workload.lengths={preset: mtbench, count: true}"],
            "workload.lengths.count"),
        good("batch-1m-generated", 3, "scale", ["tg", "batch", TINY, "--set",
                                                "workload.lengths.preset=mtbench", "--set",
                                                "workload.lengths.count=1000000"], "1,000,000",
             timeout=150, cost=60, note="round three: 1M rows took over 150 s"),
    ]


def _csv_injection() -> list[Probe]:
    """Round three: cells a spreadsheet would run, in every CSV tg writes."""
    C = "CSV injection"
    rows = requests('"=HYPERLINK(""http://x"")",4,2', "+cmd,5,3", "@SUM(A1),4,2", "-2+3,6,2",
                    '"\tx",4,2', '"\ry",4,2', "ok,4,2")
    return [
        good("csv-simulate-ids", 3, C, ["tg", "simulate", "s.yaml", "--csv", "c.csv"],
             files={"s.yaml": REQUESTS, "r.csv": rows}, csv=("c.csv",), creates=("c.csv",)),
        good("csv-batch-ids", 3, C, ["tg", "batch", "s.yaml", "--csv", "c.csv"],
             files={"s.yaml": REQUESTS, "r.csv": rows}, csv=("c.csv",), creates=("c.csv",)),
        good("csv-batch-jsonl-ids", 3, C, ["tg", "batch", "s.yaml", "--csv", "c.csv"],
             files={"s.yaml": scenario(workload="{requests: r.jsonl}"),
                    "r.jsonl": '{"id": "=1+2", "prompt_len": 4, "gen_len": 2}\n'
                               '{"id": "-3", "prompt_len": 4, "gen_len": 2}\n'},
             csv=("c.csv",), creates=("c.csv",)),
        # (the batch held fixed: each point's search takes a second, not ten)
        good("csv-sweep-values", 3, C, ["tg", "sweep", TINY, "--set", "objective.batch=4",
                                        "--vary", "model.name=@x,=1+2,-2+3", "--out", "o"],
             csv=("o/sweep.csv",), creates=("o/sweep.csv",), timeout=120, cost=5),
        good("csv-fit-cell-ids", 3, C, ["tg", "fit", "m.yaml", "--out", "o", "--no-loo"],
             files={"m.yaml": measurements(id='=HYPERLINK("http://x")', system="@sys")},
             csv=("o/cells.csv",), creates=("o/cells.csv",), timeout=240, cost=45),
    ]


def _model_files() -> list[Probe]:
    """A model's own files: config.json (rounds one and two), GGUF."""
    C = "model files"
    sim = ["tg", "simulate", "s.yaml"]

    def cfg(pid: str, rnd: int, content: Any, *err: str, **kw: Any) -> Probe:
        return bad(pid, rnd, C, sim, *err, files={"s.yaml": MODEL_FILE, "config.json": content},
                   **kw)

    def gg(pid: str, content: Any, *err: str, **kw: Any) -> Probe:
        return bad(pid, 2, C, sim, *err,
                   files={"s.yaml": scenario(model="m.gguf"), "m.gguf": content}, **kw)

    return [
        good("config-control", 2, C, sim, "throughput",
             files={"s.yaml": MODEL_FILE, "config.json": config()}),
        good("gguf-control", 2, C, sim, "throughput",
             files={"s.yaml": scenario(model="m.gguf"), "m.gguf": gguf_file()}),
        cfg("config-latin1", 1, config().encode()[:-1] + ', "x": "caf\xe9"}'.encode("latin-1"),
            "not UTF-8"),
        cfg("config-empty", 2, "", "config.json"),
        cfg("config-list", 2, "[]", "config.json"),
        cfg("config-truncated", 2, config()[:40], "config.json"),
        cfg("config-nan", 2, config().replace('"hidden_size": 256', '"hidden_size": NaN'),
            "hidden_size"),
        cfg("config-hidden-string", 2, config(hidden_size="256"), "hidden_size"),
        cfg("config-hidden-bool", 3, config(hidden_size=True), "hidden_size"),
        cfg("config-layers-negative", 2, config(num_hidden_layers=-4), "L"),
        cfg("config-experts-zero", 2, config(num_local_experts=0), "E"),
        cfg("config-k-over-E", 2, config(num_experts_per_tok=9), "k"),
        cfg("config-vocab-huge", 2, config(vocab_size=10**12), "memory"),
        # round two's note: model.L had no upper bound (a memory refusal built what it
        # refused); now at most 1,000 layers, refused as the field
        cfg("config-layers-huge", 2, config(num_hidden_layers=10**6), "model.L", "1000000",
            timeout=60),
        cfg("config-unknown-family", 2, config(model_type="llama4"), "model_type"),
        cfg("config-missing-field", 2, config(hidden_size=None), "hidden_size"),
        cfg("config-deep", 2, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper"),
        cfg("config-digits", 2, config().replace("256", "1" + "0" * 5000, 1), "4,300 digits"),
        cfg("config-tie-string", 2, config(tie_word_embeddings="false"), "tie_word_embeddings"),
        cfg("config-dtype-number", 2, config(torch_dtype=5), "dtype"),
        cfg("config-rope-scaling-string", 2, config(rope_scaling="linear"), "rope_scaling"),
        cfg("config-name-escape", 3, config(_name_or_path="x\x1b[2Jy"), "control character",
            note="a checkpoint's name reaches the terminal"),
        cfg("config-name-markup", 2, config(_name_or_path="x[/oops]"), rc=(0,),
            out=("x[/oops]",)),
        bad("config-dbrx-malformed", 1, C, sim, "config",
            files={"s.yaml": MODEL_FILE, "config.json": json.dumps(
                {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 128,
                 "attn_config": [1, 2], "ffn_config": {"ffn_hidden_size": 96}})}),
        cfg("config-fifo", 2, fifo(), "not a regular file", timeout=30),
        cfg("config-sparse-huge", 2, sparse(600 * 2**20), "config.json", timeout=60),
        gg("gguf-garbage", b"GGUF" + os.urandom(64), "m.gguf"),
        gg("gguf-empty", b"", "m.gguf"),
        gg("gguf-not-gguf", b"PK\x03\x04 not a gguf", "m.gguf"),
        gg("gguf-unknown-arch", gguf_file(arch="bert"), "general.architecture"),
        gg("gguf-layers-string", gguf_file(block_count=("string", "4")), "block_count"),
        gg("gguf-layers-negative", gguf_file(block_count=("int32", -4)), "model.L"),
        gg("gguf-layers-huge", gguf_file(block_count=("uint64", 2**40)), "model.L"),
        gg("gguf-experts-zero", gguf_file(expert_count=("uint32", 0)), "no experts"),
        gg("gguf-sparse-huge", sparse(600 * 2**20), "m.gguf", timeout=60),
    ]


def _routing() -> list[Probe]:
    """Routing traces (docs/experts.md): round three's bools, and what else a file can hold."""
    C = "routing traces"

    def rt(pid: str, rnd: int, content: Any, *err: str, **kw: Any) -> Probe:
        return bad(pid, rnd, C, REPLAY, *err, files={"r.json": content}, **kw)

    return [
        good("routing-control", 3, C, REPLAY, "trace routing", files={"r.json": routing()}),
        rt("routing-bools", 3, routing(token=lambda s, l, i: [True, False]), "r.json"),
        rt("routing-negative", 3, routing(token=lambda s, l, i: [-1, 2]), "r.json"),
        rt("routing-out-of-range", 3, routing(token=lambda s, l, i: [8, 2]), "r.json"),
        rt("routing-floats", 3, routing(token=lambda s, l, i: [1.0, 2.0]), "r.json"),
        rt("routing-strings", 3, routing(token=lambda s, l, i: ["1", "2"]), "r.json"),
        rt("routing-repeat-expert", 3, routing(token=lambda s, l, i: [1, 1]), "r.json"),
        rt("routing-wrong-k", 3, routing(token=lambda s, l, i: [1, 2, 3]), "r.json"),
        rt("routing-other-E", 3, routing(E=16), "E"),
        rt("routing-other-L", 3, routing(L=2), "L"),
        rt("routing-E-bool", 3, routing().replace('"E": 8', '"E": true'), "E"),
        rt("routing-format", 3, routing(fmt="tg-routing/9"), "format"),
        rt("routing-steps-object", 3, json.dumps({"format": "tg-routing/1", "E": 8, "k": 2,
                                                  "L": 4, "steps": {"a": 1}}), "steps"),
        rt("routing-no-steps", 3, json.dumps({"format": "tg-routing/1", "E": 8, "k": 2, "L": 4,
                                              "steps": []}), "steps"),
        rt("routing-not-json", 3, '{"format": "tg-routing/1", "steps": [', "r.json"),
        rt("routing-deep", 3, "[" * 100_000 + "]" * 100_000, "r.json"),
        rt("routing-fifo", 3, fifo(), "not a regular file", timeout=30),
        rt("routing-sparse-huge", 3, sparse(600 * 2**20), "r.json", timeout=60),
        bad("routing-missing", 3, C, REPLAY, "r.json"),
    ]


def _verbs() -> list[Probe]:
    """Flags of every verb: empty, negative, fractional, huge (rounds one and two)."""
    C1, C2 = "flags", "scale"
    return [
        good("simulate-json-control", 1, C1, ["tg", "simulate", TINY, "--json"], "throughput",
             strict_json=True),
        good("compare-control", 1, C1, ["tg", "compare", TINY, "--schedules", "S1,S4"], "S4"),
        good("compare-duplicates-once", 2, C1, ["tg", "compare", TINY, "--schedules",
                                                "S1,S1,S4"], "S4"),
        good("search-control", 1, C1, ["tg", "search", TINY, "--top", "2", "--batch", "4"], "S"),
        good("graph-control", 1, C1, ["tg", "graph", TINY, "--out", "g.json"],
             creates=("g.json",), valid_json=("g.json",)),
        good("roofline-control", 1, C1, ["tg", "roofline", TINY, "--out", "r.png"],
             creates=("r.png",)),
        good("catalog-control", 1, C1, ["tg", "catalog"], "tiny"),
        bad("compare-schedules-empty", 2, C1, ["tg", "compare", TINY, "--schedules", ""],
            "--schedules"),
        bad("compare-schedules-commas", 2, C1, ["tg", "compare", TINY, "--schedules", " , "],
            "--schedules"),
        bad("compare-schedules-colon", 2, C1, ["tg", "compare", TINY, "--schedules", "S1:"],
            "padded or refill"),
        bad("compare-schedules-unknown", 1, C1, ["tg", "compare", TINY, "--schedules", "S1,S9"],
            "S9"),
        bad("compare-batch-sizes-zero", 1, C1, ["tg", "compare", TINY, "--batch-sizes", "0"],
            "--batch-sizes"),
        bad("compare-batch-sizes-word", 1, C1, ["tg", "compare", TINY, "--batch-sizes", "a,b"],
            "--batch-sizes"),
        bad("compare-batch-sizes-huge", 2, C2, ["tg", "compare", TINY, "--batch-sizes",
                                                "1000000000"], "--batch-sizes", timeout=60),
        bad("compare-plot-alone", 1, C1, ["tg", "compare", TINY, "--plot", "p.png"], "--plot"),
        bad("search-top-zero", 1, C1, ["tg", "search", TINY, "--top", "0"], "--top"),
        bad("search-top-fraction", 3, C1, ["tg", "search", TINY, "--top", "2.5"], "--top"),
        bad("search-top-huge", 2, C2, ["tg", "search", TINY, "--top", "1000000000"], "--top"),
        bad("search-max-token-nan", 1, C1, ["tg", "search", TINY, "--max-token-ms", "nan"],
            "max_token_ms"),
        bad("search-max-token-negative", 1, C1, ["tg", "search", TINY, "--max-token-ms", "-1"],
            "max_token_ms"),
        bad("search-max-ttft-inf", 1, C1, ["tg", "search", TINY, "--max-ttft-s", "inf"],
            "max_ttft_s"),
        bad("search-batch-zero", 1, C1, ["tg", "search", TINY, "--batch", "0"], "batch"),
        bad("search-optimize-unknown", 1, C1, ["tg", "search", TINY, "--optimize", "speed"],
            "--optimize"),
        bad("search-backend-unknown", 1, C1, ["tg", "search", TINY, "--backend", "spark"],
            "--backend"),
        bad("graph-step-fraction", 3, C1, ["tg", "graph", TINY, "--step", "1.5", "--out", "g.json"],
            "--step"),
        bad("graph-step-negative", 1, C1, ["tg", "graph", TINY, "--step", "-1", "--out", "g.json"],
            "--step"),
        bad("graph-step-past-run", 1, C1, ["tg", "graph", TINY, "--step", "1000000000",
                                           "--out", "g.json"], "--step"),
        bad("graph-N-huge", 2, C2, ["tg", "graph", TINY, "--set", "policy.N=1000000", "--out",
                                    "g.json"], "micro-batches"),
        bad("graph-L-huge", 2, C2, ["tg", "graph", TINY, "--set", "model.L=1000000", "--out",
                                    "g.json"], "model.L", timeout=30,
            note="round two's note: model.L has no upper bound; tg graph is unbounded"),
        bad("simulate-L-huge", 2, C2, ["tg", "simulate", TINY, "--set", "model.L=1000000"],
            "model.L", "1000", timeout=40),
        bad("simulate-gpus-huge", 2, C2, ["tg", "simulate", TINY, "--set",
                                          "hardware.gpu.count=1000000000"], "hardware.gpu.count"),
        bad("simulate-N-1e21", 1, C2, ["tg", "simulate", TINY, "--set", "policy.N=1e21"],
            "policy.N"),
        bad("simulate-N-1e12", 1, C2, ["tg", "simulate", TINY, "--set", "policy.N=1000000000000"],
            "policy.N"),
        bad("simulate-too-large-for-memory", 1, C2,
            ["tg", "simulate", TINY, "--set", "workload.gen_len=9000000", "--trace", "t.json",
             "--trace-steps", "all"], "workload.gen_len", timeout=30,
            note="round three: this refusal took 21 s; refuse first"),
        bad("simulate-tp-3-gpus", 3, "simulator vs executor",
            ["tg", "simulate", TINY, "--set", "hardware.gpu.count=3"], "model.n_kv"),
        bad("simulate-s5-two-gpus", 1, C1, ["tg", "simulate", TINY, "--schedule", "S5", "--set",
                                            "hardware.gpu.count=2"], "hardware.gpu.count"),
        bad("simulate-policy-too-big-for-gpu", 1, C1, ["tg", "simulate", T4, "--set",
                                                       "policy.r_w=0.6"], "GPU memory"),
        bad("sweep-repeated-key", 1, C1, ["tg", "sweep", TINY, "--vary", "workload.gen_len=1",
                                          "--vary", "workload.gen_len=2", "--out", "o"], "twice"),
        bad("sweep-non-numeric", 1, C1, ["tg", "sweep", TINY, "--vary",
                                         "hardware.link.h2d_gbps=16,abc", "--out", "o"],
            "hardware.link.h2d_gbps"),
        bad("sweep-bool-value", 3, C1, ["tg", "sweep", TINY, "--vary",
                                        "hardware.link.h2d_gbps=16,true", "--out", "o"],
            "hardware.link.h2d_gbps"),
        bad("sweep-10000-values", 2, C2, ["tg", "sweep", TINY, "--vary",
                                          "hardware.link.h2d_gbps=" + ",".join(
                                              str(v) for v in range(1, 10_001)), "--out", "o"],
            "1,000"),
        bad("sweep-no-values", 1, C1, ["tg", "sweep", TINY, "--vary", "policy.N=", "--out", "o"],
            "--vary"),
        bad("sweep-no-equals", 1, C1, ["tg", "sweep", TINY, "--vary", "policy.N", "--out", "o"],
            "--vary"),
        bad("sweep-unknown-key", 1, C1, ["tg", "sweep", TINY, "--vary", "nosuch.x=1,2", "--out",
                                         "o"], "nosuch"),
        bad("sweep-searched-key", 2, C1, ["tg", "sweep", TINY, "--vary", "policy.experts_gpu=1,2",
                                          "--out", "o"], "policy.experts_gpu"),
        bad("tracecheck-missing", 1, "trace checker",
            ["python", "-m", "taskgraph.tracing.check", "none.json"], "does not exist"),
    ]


def _overlong() -> list[Probe]:
    """Round three: thirteen options echoed a 100,000-character bad value in full."""
    C = "overlong values echoed"
    x = "x" * 100_000
    cases = {
        "trace-steps": ["simulate", TINY, "--trace", "t.json", "--trace-steps", x],
        "set-value": ["simulate", TINY, "--set", "policy.N=" + x],
        "set-key": ["simulate", TINY, "--set", x + "=1"],
        "set-no-equals": ["simulate", TINY, "--set", x],
        "schedule": ["simulate", TINY, "--schedule", x],
        "schedules": ["compare", TINY, "--schedules", x],
        "batch-sizes": ["compare", TINY, "--batch-sizes", x],
        "top": ["search", TINY, "--top", x],
        "optimize": ["search", TINY, "--optimize", x],
        "max-token-ms": ["search", TINY, "--max-token-ms", x],
        "backend": ["search", TINY, "--backend", x],
        "ray-address": ["search", TINY, "--verify", "--backend", "ray", "--ray-address", x],
        "vary": ["sweep", TINY, "--vary", x, "--out", "o"],
        "vary-value": ["sweep", TINY, "--vary", "hardware.link.h2d_gbps=" + x, "--out", "o"],
        "step": ["graph", TINY, "--step", x, "--out", "g.json"],
        "gantt": ["simulate", TINY, "--gantt", "g" * 100_000 + ".jpg"],
        "trace": ["simulate", TINY, "--trace", "t" * 100_000 + ".json"],
        "scenario-path": ["simulate", "s" * 100_000 + ".yaml"],
        "scenario-name": ["simulate", x],
        "model-preset": ["simulate", TINY, "--set", "model=" + x],
        "leave-out": ["fit", MEASURED, "--out", "o", "--leave-out", x],
        "repeats": ["validate", TINY, "--repeats", x],
        "mu": ["validate", TINY, "--mu", x],
        "device": ["validate", TINY, "--device", x],
        "steps": ["execute", TINY, "--steps", x],
        "weights": ["execute", TINY, "--weights", x],
        "prompts": ["execute", TINY, "--prompts", x],
    }
    return [bad(f"long-{name}", 3, C, ["tg", *argv], max_err=2000)
            for name, argv in cases.items()]


def _execute() -> list[Probe]:
    """The executor's inputs (round two) and numbers in prompt files (round three)."""
    C2, C3 = "executor input", "numbers: prompt files"
    ex = ["tg", "execute", TINY, "--device", "cpu"]
    T = ("torch",)

    def pr(pid: str, rnd: int, cls: str, line: str, *err: str, **kw: Any) -> Probe:
        return bad(pid, rnd, cls, ex + ["--steps", "1", "--prompts", "p.jsonl"], *err,
                   files={"p.jsonl": line + "\n"}, needs=T, cost=5, **kw)

    return [
        good("execute-control", 2, C2, ex + ["--steps", "1"], "identical", needs=T, cost=5),
        good("execute-prompts-control", 2, C2, ex + ["--steps", "1", "--prompts", "p.jsonl",
                                                     "--out", "o.jsonl"],
             files={"p.jsonl": _prompts(3)}, creates=("o.jsonl",), needs=T, cost=5),
        good("execute-out-dev-null", 2, "outputs over inputs and devices",
             ex + ["--steps", "1", "--prompts", "p.jsonl", "--out", "/dev/null"],
             files={"p.jsonl": _prompts(1)}, needs=T, cost=5),
        bad("execute-out-dev-full", 2, "outputs over inputs and devices",
            ex + ["--steps", "1", "--prompts", "p.jsonl", "--out", "/dev/full"],
            "No space left", files={"p.jsonl": _prompts(1)}, needs=T, cost=5),
        bad("execute-out-is-prompts", 2, "outputs over inputs and devices",
            ex + ["--prompts", "p.jsonl", "--out", "p.jsonl"], "p.jsonl",
            files={"p.jsonl": _prompts(1)}, needs=T),
        bad("execute-out-without-prompts", 2, C2, ex + ["--out", "o.jsonl"], "--out", needs=T),
        bad("execute-steps-zero", 2, C2, ex + ["--steps", "0"], "--steps", needs=T),
        bad("execute-steps-negative", 2, C2, ex + ["--steps", "-3"], "--steps", needs=T),
        bad("execute-gen-1e6", 2, "scale", ex + ["--set", "workload.gen_len=1000000"], "tasks",
            needs=T, cost=5),
        bad("execute-max-new-1e6", 2, "scale", ex + ["--prompts", "p.jsonl"], "needs about",
            files={"p.jsonl": '{"prompt_ids": [1, 2], "max_new_tokens": 1000000}\n'}, needs=T,
            cost=5),
        bad("execute-processes-one-gpu", 2, C2, ex + ["--processes"], "hardware.gpu.count",
            needs=T),
        good("execute-tp-4-gpus", 3, C2, ex + ["--steps", "1", "--set", "hardware.gpu.count=4"],
             "identical", needs=T, cost=5, note="more GPUs than KV heads: run as vLLM does"),
        bad("execute-tp-3-gpus", 1, C2, ex + ["--set", "hardware.gpu.count=3"], "model.n_kv",
            needs=T),
        bad("execute-cuda-absent", 2, C2, ["tg", "execute", TINY, "--device", "cuda"], "cuda",
            needs=T + ("nocuda",)),
        bad("execute-weights-missing", 2, C2, ex + ["--weights", "nodir"], "nodir", needs=T),
        bad("execute-weights-file", 2, C2, ex + ["--weights", "f.txt"], "f.txt",
            files={"f.txt": "x"}, needs=T),
        bad("execute-weights-empty-folder", 2, C2, ex + ["--weights", "w"], "w",
            files={"w": folder()}, needs=T),
        bad("execute-prompts-missing", 2, C2, ex + ["--prompts", "none.jsonl"], "none.jsonl",
            needs=T),
        bad("execute-prompts-fifo", 2, C2, ex + ["--prompts", "p.jsonl"], "not a regular file",
            files={"p.jsonl": fifo()}, needs=T, timeout=30),
        bad("execute-record-routing-proc", 2, C2, ex + ["--record-routing", "/proc/r.json"],
            "/proc", needs=T),
        bad("execute-record-routing-suffix", 2, C2, ex + ["--record-routing", "r.txt"],
            "--record-routing", needs=T),
        pr("prompt-empty-ids", 2, C2, '{"prompt_ids": []}', "prompt_ids"),
        pr("prompt-unknown-field", 2, C2, '{"prompt_ids": [1, 2], "foo": 1}', "foo"),
        pr("prompt-id-out-of-vocab", 2, C2, '{"prompt_ids": [1, 1000000]}', "prompt_ids"),
        pr("prompt-id-negative", 2, C2, '{"prompt_ids": [1, -2]}', "prompt_ids"),
        pr("prompt-duplicate-id", 2, C2, '{"prompt_ids": [1, 2, 3]}\n{"id": 0, "prompt_ids": [4]}',
           "already given"),
        pr("prompt-not-json", 2, C2, '{"prompt_ids": [1, 2', "line 1"),
        pr("prompt-max-new-float", 3, C3, '{"prompt_ids": [1, 2], "max_new_tokens": 1e1}',
           "max_new_tokens"),
        pr("prompt-max-new-bool", 3, C3, '{"prompt_ids": [1, 2], "max_new_tokens": true}',
           "max_new_tokens"),
        pr("prompt-max-new-quoted", 3, C3, '{"prompt_ids": [1, 2], "max_new_tokens": "4"}',
           "max_new_tokens"),
        pr("prompt-ids-bools", 3, C3, '{"prompt_ids": [true, false]}', "prompt_ids"),
        pr("prompt-ids-floats", 3, C3, '{"prompt_ids": [1.0, 2.0]}', "prompt_ids"),
        pr("prompt-ids-nan", 3, C3, '{"prompt_ids": [1, NaN]}', "prompt_ids"),
        pr("prompt-id-escape", 3, "text to a terminal",
           '{"id": "a\\u001b[2Jb", "prompt_ids": [1, 2]}', "id"),
        pr("prompt-id-bidi", 3, "text to a terminal",
           '{"id": "abc\\u202eexe", "prompt_ids": [1, 2]}', "id"),
        pr("prompt-id-huge", 2, C2, '{"id": "' + "x" * 2**20 + '", "prompt_ids": [1, 2]}\n'
           '{"id": "' + "x" * 2**20 + '", "prompt_ids": [1, 2]}', "already given", max_err=1000),
        api("api-execute-steps-bool", 3, "API arguments",
            'tg.execute(T, steps=True, device="cpu")', "steps", needs=T),
        api("api-execute-steps-zero", 3, "API arguments",
            'tg.execute(T, steps=0, device="cpu")', "steps", needs=T),
    ]


def _checkpoints() -> list[Probe]:
    """Round two: damaged checkpoints and config fields of the wrong type."""
    C = "checkpoints"
    N = ("torch", "transformers")

    def ck(pid: str, change: Callable[[Path], None] | None, *err: str, **kw: Any) -> Probe:
        kw.setdefault("files", {})
        kw["files"] = {"ckpt": checkpoint(change), "s.yaml": CKPT_SCENARIO,
                       "p.jsonl": TWO_PROMPTS, **kw["files"]}
        kw.setdefault("cmd", EXEC_CKPT)
        kw.setdefault("rc", (2,))
        return Probe(pid, 2, C, err=err, needs=N, cost=8, timeout=120, **kw)

    long_prompt = ('{"id": "a", "prompt_ids": [1, 5, 6]}\n{"id": "b", "prompt_ids": ['
                   + ", ".join(["3"] * 12) + '], "max_new_tokens": 5}\n')
    return [
        ck("ckpt-control", None, rc=(0,), out=('"tokens_match": true',), strict_json=True),
        ck("ckpt-missing-shard", _missing_shard, "missing or partial"),
        ck("ckpt-truncated-shard", _truncate_shard, "truncated or corrupt"),
        ck("ckpt-index-outside", _index_outside, "outside the checkpoint folder"),
        ck("ckpt-weight-map-list", lambda c: _rewrite(c / "model.safetensors.index.json",
                                                      b'{"weight_map": ["a", "b"]}'),
           "weight_map"),
        ck("ckpt-tie-string", _edit_json("config.json", tie_word_embeddings="false"),
           "tie_word_embeddings"),
        ck("ckpt-dtype-number", _edit_json("config.json", dtype=5, torch_dtype=None), "dtype"),
        ck("ckpt-hidden-quoted", _edit_json("config.json", hidden_size="256"), "hidden_size"),
        ck("ckpt-eos-string", _edit_json("generation_config.json", eos_token_id="two"),
           "eos_token_id"),
        ck("ckpt-eos-out-of-vocab", _edit_json("generation_config.json", eos_token_id=10**9),
           "eos_token_id", note="round two's note: eos_token_id outside the vocabulary"),
        ck("ckpt-nan-weight", _tensor("model.embed_tokens.weight", _nan_first),
           "NaN or infinite"),
        ck("ckpt-int8-tensor", _tensor("model.layers.1.block_sparse_moe.experts.3.w1.weight",
                                       lambda t: t.astype("int8")), "int8"),
        ck("ckpt-prompt-past-positions", _edit_json("config.json", max_position_embeddings=16),
           "max_position_embeddings", files={"p.jsonl": long_prompt}),
        ck("ckpt-out-over-config", None, "config.json",
           cmd=EXEC_CKPT + ["--out", "ckpt/config.json"]),
    ]


def _fit_and_others() -> list[Probe]:
    """tg fit's measurement files (rounds two and three), validate and calibrate's flags, and
    the trace checker (round two)."""
    C2, C3 = "measurement files", "numbers: measurement files"
    fit = ["tg", "fit", "m.yaml", "--out", "o", "--no-loo"]

    def mf(pid: str, rnd: int, cls: str, content: Any, *err: str, **kw: Any) -> Probe:
        kw.setdefault("cmd", fit)
        kw.setdefault("cost", 3)
        return Probe(pid, rnd, cls, files={"m.yaml": content}, err=err, **kw)

    chk = ["python", "-m", "taskgraph.tracing.check", "t.json"]
    T = ("torch",)
    X = ["--device", "cpu"]
    return [
        mf("fit-measured-bool", 3, C3, measurements(measured_tok_s=True), "measured_tok_s"),
        mf("fit-measured-quoted", 3, C3, measurements(measured_tok_s="5.3"), "measured_tok_s"),
        mf("fit-measured-nan", 3, C3, measurements(measured_tok_s=Raw(".nan")), "measured_tok_s"),
        mf("fit-measured-negative", 3, C3, measurements(measured_tok_s=-1), "measured_tok_s"),
        mf("fit-measured-zero", 3, C3, measurements(measured_tok_s=0), "measured_tok_s"),
        mf("fit-measured-octal", 3, C3, measurements(measured_tok_s=Raw("010")), "measured_tok_s"),
        mf("fit-policy-N-bool", 3, C3, measurements(**{"policy.N": True}), "N"),
        mf("fit-gen-len-sexagesimal", 3, C3, measurements(**{"workload.gen_len": Raw("1:0")}),
           "gen_len"),
        mf("fit-unknown-preset", 2, C2, measurements(**{"workload.preset": "no-such"}), "no-such"),
        mf("fit-id-1mb", 2, C2, measurements(id="x" * 2**20), "id", max_err=600),
        mf("fit-machine-1mb", 2, C2, measurements(machine="z" * 2**20), "machine", max_err=600),
        mf("fit-no-cells", 2, C2, measurements(cells=[]), "cells"),
        mf("fit-cells-text", 2, C2, measurements(cells="x"), "cells"),
        mf("fit-one-cell-loo", 2, C2, measurements(), "Leave-one-out", rc=(0, 2), timeout=240,
           cmd=["tg", "fit", "m.yaml", "--out", "o"], cost=45,
           note="a one-cell file with leave-one-out was a ValueError"),
        # a legal fit of hours: it must say so with an estimate, and stop at Ctrl-C
        signalled("fit-huge-cell", 3, "scale", fit, signal.SIGINT, ("stderr", "at least"),
                  group=True, files={"m.yaml": measurements(**{"workload.gen_len": 10_000_000})},
                  err=("at least",), wait=60, cost=10,
                  note="round three: a fit cell of this size ran for hours without a word"),
        mf("fit-id-escape", 3, "text to a terminal", measurements(id="a\x1b[2Jb"), "id"),
        bad("fit-leave-out-unknown", 2, C2, ["tg", "fit", MEASURED, "--out", "o",
                                             "--leave-out", "bogus"], "--leave-out"),
        bad("fit-missing-file", 2, C2, ["tg", "fit", "none.yaml", "--out", "o"], "none.yaml"),
        bad("validate-repeats-huge", 2, "scale", ["tg", "validate", TINY, "--repeats",
                                                  "1000000000"] + X, "--repeats", needs=T),
        bad("validate-mu-zero", 2, C2, ["tg", "validate", TINY, "--mu", "0"] + X, "--mu",
            needs=T),
        bad("validate-mu-word", 2, C2, ["tg", "validate", TINY, "--mu", "a"] + X, "--mu",
            needs=T),
        bad("validate-schedules-empty", 2, C2, ["tg", "validate", TINY, "--schedules", " , "] + X,
            "--schedules", needs=T),
        bad("validate-gantt-is-plot", 2, C2, ["tg", "validate", TINY, "--gantt", "x.png",
                                              "--plot", "x.png"] + X, "same file", needs=T),
        bad("calibrate-out-suffix", 1, C2, ["tg", "calibrate", TINY, "--out", "c.txt"] + X,
            "--out", needs=T),
        bad("calibrate-out-over-profile", 2, "outputs over inputs and devices",
            ["tg", "calibrate", "s.yaml", "--out", "p.yaml"] + X, "is an input",
            files={"s.yaml": scenario(hardware="p.yaml"), "p.yaml": "preset: t4\n"}, needs=T),
        bad("calibrate-out-folder", 1, C2, ["tg", "calibrate", TINY, "--out", "d.yaml"] + X,
            "--out", files={"d.yaml": folder()}, needs=T),
        # the trace checker reads anyone's file
        Probe("tracecheck-valid", 2, "trace checker", cmd=chk, rc=(0,),
              files={"t.json": made(lambda path: subprocess.run(
                  [str(BIN / "tg"), "simulate", TINY, "--trace", str(path)], check=True,
                  capture_output=True))}),
        bad("tracecheck-gzip-bomb", 2, "trace checker",
            ["python", "-m", "taskgraph.tracing.check", "t.json.gz"], "512 MiB",
            files={"t.json.gz": made(_gzip_bomb)}, timeout=60),
        bad("tracecheck-dev-zero", 2, "trace checker",
            ["python", "-m", "taskgraph.tracing.check", "/dev/zero"], "not a regular file",
            timeout=30),
        bad("tracecheck-fifo", 2, "trace checker", chk, "not a regular file",
            files={"t.json": fifo()}, timeout=30),
        bad("tracecheck-deep", 2, "trace checker", chk, "nesting",
            files={"t.json": '{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}"}),
        bad("tracecheck-not-gzip", 2, "trace checker",
            ["python", "-m", "taskgraph.tracing.check", "t.json.gz"], "not gzip",
            files={"t.json.gz": b"\x1f\x8b not really gzip"}),
        bad("tracecheck-not-json", 2, "trace checker", chk, "not JSON",
            files={"t.json": '{"traceEvents": ['}),
        Probe("tracecheck-events-not-objects", 2, "trace checker", cmd=chk, rc=(1,),
              err=("problems",), out=("not an object",),
              files={"t.json": '{"traceEvents": [1, "x", null, [], {"ph": "X", "pid": [1], '
                               '"ts": 1e400, "dur": "1", "name": {"a": 1}}]}'}),
        Probe("tracecheck-metadata-name", 2, "trace checker", cmd=chk, rc=(1,),
              files={"t.json": '{"traceEvents": [{"ph": "M", "pid": 1, "name": 5, '
                               '"args": {"name": "x"}}]}'}),
        Probe("tracecheck-escape-in-name", 3, "text to a terminal", cmd=chk, rc=(0, 1),
              files={"t.json": '{"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, '
                               '"dur": -1, "name": "a\\u001b]0;owned\\u0007\\u001b[2J"}]}'}),
    ]


def _signals() -> list[Probe]:
    """Signals (rounds one to three): each verb and backend, stopped by INT, TERM and HUP,
    ends within a bounded time with 128 + signum and a one-line message, leaving no process,
    temporary file or half-written output; the file it was to replace stays as it was."""
    C = "signals"
    INT, TERM, HUP = signal.SIGINT, signal.SIGTERM, signal.SIGHUP
    # a long run's whole trace: its partial file appears after the run, and writing it takes
    # seconds: the window round one (Ctrl-C loses the run) and three (no exit in 100 s) found
    trace_run = ["tg", "simulate", TINY, "--set", "workload.gen_len=6000", "--trace", "t.json",
                 "--trace-steps", "all"]
    writing = ("file", ".t.*")
    prev = {"t.json": "previous"}
    long_run = ["tg", "simulate", TINY, "--set", "workload.gen_len=300000"]
    sweep = ["tg", "sweep", TINY, "--vary", "workload.gen_len=2,3,4,5", "--out", "o"]
    ray_sweep = sweep + ["--backend", "ray"]
    workers = ("children", 2)
    T, R = ("torch",), ("ray",)
    processes = ["tg", "execute", SMALL, "--set", "hardware.gpu.count=2", "--set",
                 "workload.gen_len=400", "--processes", "--json"]
    prompts = ["tg", "execute", TINY, "--device", "cpu", "--prompts", "p.jsonl", "--out",
               "o.jsonl"]
    return [
        signalled("sigint-trace-write", 1, C, trace_run, INT, writing, group=True, files=prev,
                  out=("throughput",), note="Ctrl-C keeps the finished run's results"),
        signalled("sigterm-trace-write", 2, C, trace_run, TERM, writing, files=prev),
        signalled("sighup-trace-write", 2, C, trace_run, HUP, writing, files=prev),
        signalled("sigint-long-run", 1, C, long_run, INT, ("delay", 4.0), group=True,
                  out=("throughput",), note="Ctrl-C stops a run and keeps what ran"),
        signalled("sigterm-long-run", 2, C, long_run, TERM, ("delay", 4.0)),
        signalled("sigint-while-importing", 3, C, ["tg", "simulate", TINY], INT, ("delay", 0.3),
                  group=True, cost=3, note="a Ctrl-C while tg imports printed a traceback"),
        signalled("sigint-brute-force", 1, C, ["tg", "search", T4, "--brute-force"], INT,
                  workers, group=True, err=("jobs finished",)),
        signalled("sigterm-brute-force", 2, C, ["tg", "search", T4, "--brute-force"], TERM,
                  workers),
        signalled("sigterm-search-verify", 2, C, ["tg", "search", T4, "--verify"], TERM, workers),
        signalled("sigterm-fit", 2, C, ["tg", "fit", MEASURED, "--out", "o"], TERM, workers),
        signalled("sigint-fit", 2, C, ["tg", "fit", MEASURED, "--out", "o"], INT, workers,
                  group=True),
        signalled("sigterm-sweep-pool", 3, C, sweep, TERM, workers),
        signalled("sighup-sweep-pool", 3, C, sweep, HUP, workers),
        signalled("sigint-sweep-ray", 3, C, ray_sweep, INT, ("children", 3), group=True,
                  needs=R, cost=40, note="left two processes and a Ray session folder"),
        signalled("sigterm-sweep-ray", 3, C, ray_sweep, TERM, ("delay", 6.0), needs=R,
                  cost=40, note="exited 15 with no message"),
        signalled("sighup-sweep-ray", 3, C, ray_sweep, HUP, ("delay", 6.0), needs=R, cost=40,
                  note="segfault (rc -11)"),
        signalled("sigterm-execute-prompts", 3, C, prompts, TERM, ("delay", 7.0),
                  files={"p.jsonl": _prompts(400)}, needs=T, cost=12,
                  note="'terminate called without an active exception', rc -6"),
        signalled("sigint-execute-prompts", 3, C, prompts, INT, ("delay", 7.0), group=True,
                  files={"p.jsonl": _prompts(400)}, needs=T, cost=12),
        signalled("sigterm-execute-processes", 2, C, processes, TERM, workers, needs=T, cost=20,
                  wait=300),
        signalled("sigint-execute-processes", 2, C, processes, INT, workers, group=True,
                  needs=T, cost=20, wait=300),
        signalled("sigint-calibrate", 2, C, ["tg", "calibrate", TINY, "--device", "cpu", "--out",
                                             "c.yaml"], INT, ("delay", 8.0), group=True,
                  needs=T, note="an interrupted calibration wrote a profile and exited 0"),
        signalled("sighup-calibrate", 3, C, ["tg", "calibrate", TINY, "--device", "cpu", "--out",
                                             "c.yaml"], HUP, ("delay", 8.0), needs=T),
    ]


def _api() -> list[Probe]:
    """Round three: API arguments checked as the CLI checks them, and calls that share a
    process."""
    C = "API arguments"
    S = "API calls sharing a process"
    return [
        api("api-simulate-control", 3, C, 'print(tg.simulate(Path(T)).summary["throughput_tok_s"])',
            rc=(0,)),
        api("api-mapping-control", 3, C, '''
            r = tg.simulate({"model": "tiny", "hardware": "t4",
                             "workload": {"prompt_len": 4, "gen_len": 2},
                             "policy": {"N": 4, "mu": 2}}, overrides={"policy.N": 8})
            print(r.to_dict()["policy"])''', rc=(0,)),
        api("api-search-top-fraction", 3, C, "tg.search(T, top=2.5)", "top", timeout=60),
        api("api-search-top-bool", 3, C, "tg.search(T, top=True)", "top"),
        api("api-search-top-huge", 2, C, "tg.search(T, top=10**9)", "top"),
        api("api-search-ray-address-int", 3, C, 'tg.search(T, backend="ray", ray_address=123)',
            "ray_address"),
        api("api-search-backend-int", 3, C, "tg.search(T, backend=5)", "backend"),
        api("api-search-max-token-nan", 3, C, 'tg.search(T, max_token_ms=float("nan"))',
            "max_token_ms"),
        api("api-compare-mixed-list", 3, C, 'tg.compare(T, ["S1", 5])', "schedules"),
        api("api-compare-int", 3, C, "tg.compare(T, 5)", "schedules"),
        api("api-compare-string-is-one-name", 3, C, '''
            names = [r["schedule"] for r in tg.compare(T, "S1").to_dict()["results"]]
            if names != ["S1"]:
                fail(f"compare(T, 'S1') compared {names}")''', rc=(0,),
            note="a plain string iterated over its characters"),
        api("api-graph-step-fraction", 3, C, "tg.graph(T, step=1.5)", "step"),
        api("api-graph-step-bool", 3, C, "tg.graph(T, step=True)", "step"),
        api("api-simulate-schedule-empty", 3, C, 'tg.simulate(T, schedule="")', "schedule"),
        api("api-simulate-schedule-int", 3, C, "tg.simulate(T, schedule=1)", "schedule"),
        api("api-simulate-scenario-int", 3, C, "tg.simulate(5)", "scenario"),
        api("api-simulate-scenario-bytes", 3, C, 'tg.simulate(T.encode())', "scenario"),
        api("api-simulate-csv-int", 3, C, "tg.simulate(T, csv=5)", "--csv"),
        api("api-simulate-keep-steps-text", 3, C, 'tg.simulate(T, keep_steps="2")', "keep_steps"),
        api("api-overrides-int", 3, C, "tg.simulate(T, overrides=5)", "overrides"),
        api("api-overrides-bool-value", 3, C, 'tg.simulate(T, overrides={"policy.N": True})',
            "policy.N"),
        api("api-overrides-nan-value", 3, C,
            'tg.simulate(T, overrides={"policy.r_w": float("nan")})', "policy.r_w"),
        api("api-overrides-quoted-value", 3, C, 'tg.simulate(T, overrides={"policy.N": "8"})',
            "policy.N"),
        api("api-overrides-path-value", 3, C,
            'tg.simulate(T, overrides={"workload.requests": Path("r.csv")})', "overrides"),
        api("api-overrides-key-int", 3, C, "tg.simulate(T, overrides={5: 1})", "5"),
        api("api-self-containing-mapping", 3, C, '''
            d = {"model": "tiny", "hardware": "t4", "workload": {"prompt_len": 4, "gen_len": 2},
                 "policy": {"N": 4, "mu": 2}}
            d["policy"]["self"] = d
            tg.simulate(d)''', "contains itself"),
        api("api-mapping-with-set", 3, C, '''
            tg.simulate({"model": "tiny", "hardware": "t4", "policy": {"N": 4, "mu": 2},
                         "workload": {"prompt_len": 4, "gen_len": {2, 3}}})''',
            "every value is a number"),
        api("api-sweep-quoted-number", 3, C, '''
            tg.sweep(T, {"hardware.link.h2d_gbps": "16"}, out="sw")
            rows = list(csv.reader(open("sw/sweep.csv")))
            if len(rows) != 2 or float(rows[1][0]) != 16:
                fail(f"swept {[r[0] for r in rows[1:]]}, not 16 alone")''',
            "hardware.link.h2d_gbps", rc=(0, 2), timeout=180, cost=30,
            note="'16' swept 1 and 6"),
        api("api-sweep-vary-int", 3, C, 'tg.sweep(T, 5, out="sw")', "vary"),
        api("api-sweep-value-none", 3, C, 'tg.sweep(T, {"policy.N": None}, out="sw")',
            "policy.N"),
        api("api-sweep-value-bool", 3, C,
            'tg.sweep(T, {"hardware.link.h2d_gbps": [16, True]}, out="sw")',
            "hardware.link.h2d_gbps"),
        api("api-crossover-batch-sizes-text", 3, C, 'tg.crossover(T, batch_sizes=["a"])',
            "batch_sizes"),
        api("api-crossover-batch-sizes-bool", 3, C, 'tg.crossover(T, batch_sizes=[True])',
            "batch_sizes"),
        api("api-validate-mu-bool", 3, C, 'tg.validate(T, mu=[True], device="cpu")', "mu",
            needs=("torch",)),
        api("api-validate-repeats-fraction", 3, C, 'tg.validate(T, repeats=2.5, device="cpu")',
            "repeats", needs=("torch",)),
        api("api-fit-measurements-int", 3, C, "tg.fit(5)", "measurements"),
        api("api-fit-loo-text", 3, C, f'tg.fit({MEASURED!r}, loo="no")', "loo"),
        api("api-batch-csv-is-input", 2, C, '''
            Path("r.csv").write_text("id,prompt_len,gen_len\\na,4,2\\n")
            tg.batch({"model": "tiny", "hardware": "t4", "workload": {"requests": "r.csv"},
                      "policy": {"N": 4, "mu": 2}}, csv="r.csv")''', "r.csv",
            may_exist=("r.csv",)),
        # calls sharing a process
        api("api-threads-agree-with-sequential", 3, S, '''
            one = tg.simulate(T).summary["throughput_tok_s"]
            two = tg.simulate(T, overrides={"policy.mu": 4}).summary["throughput_tok_s"]
            got = {}
            def run(name, **kw):
                got[name] = tg.simulate(T, **kw).summary["throughput_tok_s"]
            threads = [threading.Thread(target=run, args=("one",)),
                       threading.Thread(target=run, args=("two",),
                                        kwargs={"overrides": {"policy.mu": 4}})]
            for t in threads: t.start()
            for t in threads: t.join()
            if got != {"one": one, "two": two}:
                fail(f"threads gave {got}, alone {one} and {two}")''', rc=(0,), cost=4),
        api("api-concurrent-return-keeps-inputs", 3, S, '''
            Path("r.csv").write_text("id,prompt_len,gen_len\\na,4,2\\nb,5,3\\n")
            before = Path("r.csv").read_text()
            s = {"model": "tiny", "hardware": "t4", "workload": {"requests": "r.csv"},
                 "policy": {"N": 4, "mu": 2}}
            stop = threading.Event()
            def churn():            # calls that return while the other call runs
                while not stop.is_set():
                    tg.simulate(T)
            t = threading.Thread(target=churn)
            t.start()
            try:
                tg.execute(s, device="cpu", out="r.csv")
                refused = False
            except TgError:
                refused = True
            finally:
                stop.set()
                t.join()
            if Path("r.csv").read_text() != before or not refused:
                fail("an execute writing over its own request list ran while another call "
                     "returned")''', rc=(0,), needs=("torch",), may_exist=("r.csv",), cost=10,
            timeout=120, note="issue 40 point 1: a returning call cleared another's inputs"),
        api("api-concurrent-checkpoint-config", 3, S, '''
            before = Path("ckpt/config.json").read_bytes()
            stop = threading.Event()
            def churn():
                while not stop.is_set():
                    tg.simulate(T)
            t = threading.Thread(target=churn)
            t.start()
            try:
                tg.execute("s.yaml", weights="ckpt", prompts="p.jsonl", device="cpu",
                           out="ckpt/config.json")
                refused = False
            except TgError:
                refused = True
            finally:
                stop.set()
                t.join()
            if Path("ckpt/config.json").read_bytes() != before or not refused:
                fail("execute replaced the checkpoint's config.json while another call "
                     "returned")''', rc=(0,), needs=("torch", "transformers"), cost=12,
            timeout=180, files={"ckpt": checkpoint(), "s.yaml": CKPT_SCENARIO,
                                "p.jsonl": TWO_PROMPTS},
            note="issue 40 point 1's reproducer"),
        api("api-finished-call-releases-inputs", 3, S, '''
            Path("r.csv").write_text("id,prompt_len,gen_len\\na,4,2\\n")
            Path("q.csv").write_text("id,prompt_len,gen_len\\nb,5,3\\n")
            tg.simulate({"model": "tiny", "hardware": "t4", "workload": {"requests": "r.csv"},
                         "policy": {"N": 4, "mu": 2}})
            tg.batch({"model": "tiny", "hardware": "t4", "workload": {"requests": "q.csv"},
                      "policy": {"N": 4, "mu": 2}}, csv="r.csv")
            if "micro_batch" not in Path("r.csv").read_text():
                fail("the later write did not happen")''', rc=(0,),
            note="a finished call's input stayed protected"),
        # round one: concurrent runs; round two: file modes
        api("concurrent-trace-writers", 1, "interrupted and concurrent writes", '''
            cmd = ["tg", "simulate", T, "--trace", "s.json", "--trace-steps"]
            procs = [subprocess.Popen(cmd + [n], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True) for n in ("all", "1")]
            for p in procs:
                if p.wait(120) != 0:
                    fail(f"a writer exited {p.returncode}: {p.stderr.read()[-300:]}")
            json.loads(Path("s.json").read_text())
            if sorted(os.listdir(".")) != ["s.json"]:
                fail(f"left {sorted(os.listdir('.'))}")''', rc=(0,), cost=8, timeout=150),
        api("trace-bytes-deterministic", 1, "interrupted and concurrent writes", '''
            for name in ("a.json", "b.json"):
                subprocess.run(["tg", "simulate", T, "--trace", name], check=True,
                               capture_output=True)
            if Path("a.json").read_bytes() != Path("b.json").read_bytes():
                fail("two traces of one input differ")''', rc=(0,), cost=4),
        api("output-mode-follows-umask", 2, "outputs over inputs and devices", '''
            os.umask(0o022)
            subprocess.run(["tg", "simulate", T, "--trace", "new.json"], check=True,
                           capture_output=True)
            Path("old.json").write_text("x")
            os.chmod("old.json", 0o664)
            subprocess.run(["tg", "simulate", T, "--trace", "old.json"], check=True,
                           capture_output=True)
            modes = {n: oct(os.stat(n).st_mode & 0o777) for n in ("new.json", "old.json")}
            if modes != {"new.json": "0o644", "old.json": "0o664"}:
                fail(f"modes {modes}: want 0o644 new, 0o664 kept")''', rc=(0,), cost=4),
    ]


def catalogue() -> list[Probe]:
    probes = (_numbers() + _scenario_files() + _set_keys() + _outputs() + _requests()
              + _csv_injection() + _model_files() + _routing() + _verbs() + _overlong()
              + _execute() + _checkpoints() + _fit_and_others() + _signals() + _api())
    ids = [p.id for p in probes]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    return probes


# --- the runner ---------------------------------------------------------------------------------

API_PRELUDE = """\
import csv, json, os, subprocess, sys, threading
from pathlib import Path
R, D = sys.argv[1], sys.argv[2]
T = os.path.join(R, "scenarios", "tiny.yaml")


def fail(why):
    print("probe failed: " + why, file=sys.stderr)
    sys.exit(1)


import taskgraph as tg
from taskgraph.errors import TgError
try:
{body}
except TgError as err:
    print(f"TgError: {{err}}", file=sys.stderr)
    sys.exit(2)
"""

# what no terminal should receive from user text: C0 controls but tab and newline, DEL, C1
# controls (0x9b is a one-byte CSI), and the bidi overrides and isolates that reorder text
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
CAPTURE_LIMIT = 16 * 2**20          # bytes of each stream kept (a bomb could print GBs)
BIN = Path(sys.executable).parent


@dataclass
class Result:
    probe: Probe
    status: str = "clean"           # clean, not clean, inconclusive, skipped
    why: list[str] = field(default_factory=list)
    rc: int | None = None
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""
    err_len: int = 0

    def fault(self, why: str) -> None:
        self.why.append(why)


class Fixtures:
    """What several probes share, made once when first needed: the generated checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()
        self._ckpt: Path | None = None

    def checkpoint(self) -> Path:
        with self.lock:
            if self._ckpt is None:
                path = self.root / "_fixtures" / "ckpt"
                subprocess.run([sys.executable, str(REPO / "bench" / "make_checkpoint.py"),
                                str(path)], check=True, capture_output=True, timeout=300)
                self._ckpt = path
            return self._ckpt


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


NEEDS = {"torch": lambda: _have("torch"), "transformers": lambda: _have("transformers"),
         "ray": lambda: _have("ray"), "cuda": _has_cuda, "nocuda": lambda: not _has_cuda(),
         "nonroot": lambda: os.geteuid() != 0}


def _missing(probe: Probe, cache: dict[str, bool]) -> list[str]:
    for need in probe.needs:
        if need not in cache:
            cache[need] = NEEDS[need]()
    return [n for n in probe.needs if not cache[n]]


def _write_files(d: Path, files: dict[str, Any], fixtures: Fixtures) -> None:
    for name, content in files.items():
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        elif isinstance(content, bytes):
            path.write_bytes(content)
        elif content.kind == "fifo":
            os.mkfifo(path)
        elif content.kind == "dir":
            path.mkdir(exist_ok=True)
        elif content.kind == "link":
            os.symlink(content.arg, path)
        elif content.kind == "sparse":
            with open(path, "wb") as f:
                f.truncate(content.arg)
        elif content.kind == "call":
            content.arg(path)
        elif content.kind == "ckpt":
            # hard links: 50 MB a copy otherwise; a change unlinks what it rewrites
            shutil.copytree(fixtures.checkpoint(), path, copy_function=os.link)
            for small in path.glob("*.json"):
                data = small.read_bytes()
                small.unlink()
                small.write_bytes(data)
            if content.arg is not None:
                content.arg(path)
        else:
            raise ValueError(content)


def _snapshot(d: Path) -> dict[str, str]:
    """Every entry under the folder: kind and content hash."""
    seen = {}
    for root, dirs, names in os.walk(d):
        rel_root = Path(root).relative_to(d)
        for name in dirs + names:
            path = Path(root) / name
            rel = str(rel_root / name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                seen[rel] = "link:" + os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                seen[rel] = "dir"
            elif stat.S_ISREG(st.st_mode):
                if st.st_size > 64 * 2**20 and st.st_blocks == 0:      # our sparse files
                    seen[rel] = f"sparse:{st.st_size}"
                    continue
                digest = hashlib.sha1()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
                seen[rel] = "file:" + digest.hexdigest()
            else:
                seen[rel] = f"special:{stat.S_IFMT(st.st_mode)}"
    return seen


def _tagged_processes(token: str) -> list[int]:
    """Live processes started by this probe, however they detached: each inherits the probe's
    environment, and Ray's raylet and workers too."""
    mark = f"TG_PROBE={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


class _Reader(threading.Thread):
    """Reads a pipe to its end, keeping the first CAPTURE_LIMIT bytes and counting the rest."""

    def __init__(self, pipe: Any) -> None:
        super().__init__(daemon=True)
        self.pipe, self.data, self.total = pipe, bytearray(), 0
        self.start()

    def run(self) -> None:
        for chunk in iter(lambda: self.pipe.read1(1 << 16), b""):
            self.total += len(chunk)
            if len(self.data) < CAPTURE_LIMIT:
                self.data += chunk[:CAPTURE_LIMIT - len(self.data)]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _command(probe: Probe, d: Path) -> list[str]:
    if probe.api is not None:
        body = textwrap.indent(probe.api, "    ")
        return [sys.executable, "-c", API_PRELUDE.format(body=body), str(REPO), str(d)]
    argv = list(probe.cmd)
    if argv[0] == "tg":
        tg = BIN / "tg"
        argv[:1] = [str(tg)] if tg.exists() else [sys.executable, "-m", "taskgraph.cli"]
    elif argv[0] == "python":
        argv[0] = sys.executable
    return argv


def _event(sig: Signal, proc: subprocess.Popen, d: Path, err: _Reader, t0: float) -> bool:
    """Wait for the event the signal follows; False if the run ended first or it never came."""
    kind, arg = sig.after
    while proc.poll() is None:
        now = time.monotonic()
        if now - t0 > sig.wait:
            return False
        if kind == "delay" and now - t0 >= arg:
            return True
        if kind == "file" and list(d.glob(arg)):
            return True
        if kind == "children" and len(_children(proc.pid)) >= arg:
            return True
        if kind == "stderr" and arg.encode() in err.data:
            return True
        time.sleep(0.05)
    return False


def _csv_faults(text: str, where: str) -> list[str]:
    """Cells a spreadsheet would read as a formula: starting with = + @ - (or tab, CR), which
    OWASP says to neutralise with a leading quote. A plain number (-1.5) is data."""
    faults = []
    for row in csv.reader(io.StringIO(text)):
        for cell in row:
            if cell[:1] in ("=", "+", "-", "@", "\t", "\r"):
                try:
                    float(cell)
                    continue
                except ValueError:
                    faults.append(f"{where}: cell {cell[:30]!r} is not neutralised")
    return faults[:3]


def _strict_json(text: str) -> str | None:
    def refuse(name: str) -> Any:
        raise ValueError(f"bare {name}")
    try:
        json.loads(text, parse_constant=refuse)
    except ValueError as err:
        return str(err)[:100]
    return None


def _valid_file_json(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        json.loads(data)
    except (OSError, ValueError, EOFError) as err:
        return f"{path.name} is not whole JSON ({str(err)[:80]})"
    return None


def run_probe(probe: Probe, root: Path, fixtures: Fixtures, keep: bool) -> Result:
    result = Result(probe)
    d = Path(tempfile.mkdtemp(prefix=re.sub(r"\W", "_", probe.id)[:40] + "-", dir=root))
    try:
        _run(probe, d, fixtures, result)
    except Exception as err:       # the probe's own setup broke: say so, do not judge tg
        result.status = "inconclusive"
        result.why = [f"probe error: {type(err).__name__}: {str(err)[:200]}"]
        return result
    finally:
        if not keep:
            _remove(d)
    if result.status == "clean" and result.why:
        result.status = "not clean"
    return result


def _remove(d: Path) -> None:
    for root, dirs, _ in os.walk(d):        # folders a probe made unwritable
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(d, ignore_errors=True)


def _run(probe: Probe, d: Path, fixtures: Fixtures, result: Result) -> None:
    # the run's own TMPDIR, to find what it leaves there; short, for Ray's socket paths (107
    # bytes at most) lie under it
    tmp = Path(tempfile.mkdtemp(prefix="tgp", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        _run_in(probe, d, tmp, fixtures, result)
    finally:
        _remove(tmp)


def _run_in(probe: Probe, d: Path, tmp: Path, fixtures: Fixtures, result: Result) -> None:
    _write_files(d, probe.files, fixtures)
    before = _snapshot(d)
    token = uuid.uuid4().hex
    env = {**os.environ, "TMPDIR": str(tmp), "TG_PROBE": token, "PYTHONUNBUFFERED": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("COLUMNS", None)
    t0 = time.monotonic()
    proc = subprocess.Popen(_command(probe, d), cwd=d, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)
    hung = False
    if probe.signal is not None:
        sig = probe.signal
        if not _event(sig, proc, d, err, t0):
            ended = proc.poll()
            result.status = "inconclusive"
            result.why.append(f"the run ended (rc {ended}) before {sig.after} could be "
                              "signalled" if ended is not None else
                              f"{sig.after} did not happen within {sig.wait:.0f} s")
        else:
            (os.killpg if sig.group else os.kill)(proc.pid, sig.sig)
            try:
                proc.wait(timeout=sig.within)
            except subprocess.TimeoutExpired:
                hung = True
                result.fault(f"still running {sig.within:.0f} s after "
                             f"{signal.Signals(sig.sig).name}")
    try:
        proc.wait(timeout=max(1.0, probe.timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        hung = True
        result.fault(f"no answer within {probe.timeout:.0f} s (killed)")
    if hung:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
    result.seconds = time.monotonic() - t0
    out.join(10)
    err.join(10)
    result.rc, result.stdout, result.stderr = proc.returncode, out.text(), err.text()
    result.err_len = err.total
    if result.status == "inconclusive":
        _leftovers(token, tmp, result, report=False)
        return
    _judge(probe, result, d, before, hung)
    _leftovers(token, tmp, result, report=True)


def _judge(probe: Probe, r: Result, d: Path, before: dict[str, str], hung: bool) -> None:
    so, se = r.stdout, r.stderr
    if not hung and r.rc not in probe.rc:
        tail = se.strip().splitlines()[-1][:100] if se.strip() else ""
        r.fault(f"exit {r.rc}, expected {'/'.join(map(str, probe.rc))}"
                + (f": {tail}" if tail else ""))
    if "Traceback (most recent call last)" in so + se:
        last = [ln for ln in se.splitlines() if ln.strip()][-1:] or [""]
        r.fault(f"traceback: {last[0].strip()[:100]}")
    if "probe failed: " in se:
        r.fault(se.split("probe failed: ", 1)[1].strip()[:200])
    for name, text in (("stdout", so), ("stderr", se)):
        bad_char = CONTROL.search(text)
        if bad_char:
            at = bad_char.start()
            r.fault(f"{name} holds {bad_char.group()!r}: {text[max(0, at - 30):at + 10]!r}")
    for secret in probe.not_in_output:
        if secret in so + se:
            r.fault(f"output echoes {secret!r}")
    if r.rc == 2 and probe.api is None:
        # the house rule for bad input: one short paragraph on stderr, nothing on stdout
        if r.err_len > probe.max_err:
            r.fault(f"error is {r.err_len:,} bytes (bound {probe.max_err:,})")
        if so.strip():
            r.fault(f"stdout not empty on an error: {so.strip()[:80]!r}")
        if "\n\n" in se.strip():
            r.fault("error is more than one paragraph")
        if not se.strip():
            r.fault("exit 2 with nothing on stderr")
    if r.rc == 2 and probe.api is not None and r.err_len > probe.max_err:
        r.fault(f"error is {r.err_len:,} bytes (bound {probe.max_err:,})")
    if r.rc != 0:
        for text in probe.err:
            if text not in se:
                r.fault(f"stderr does not name {text!r}")
        if probe.err_any and not any(t in se for t in probe.err_any):
            r.fault(f"stderr says none of {probe.err_any}: {se.strip()[-120:]!r}")
    if probe.signal is not None and r.rc is not None and r.rc > 0:
        lines = [ln for ln in se.splitlines() if ln.strip()]
        if lines and len(lines[-1]) > 300:
            r.fault("the signal's message is longer than a line")
    if r.rc == 0 or probe.signal is not None:
        for text in probe.out:
            if text not in so:
                r.fault(f"stdout does not hold {text!r}")
    if r.rc == 0 and probe.strict_json:
        problem = _strict_json(so)
        if problem:
            r.fault(f"--json output is not strict JSON: {problem}")
    # files: inputs untouched; a refused or stopped run writes nothing new
    after = _snapshot(d)
    for rel, kind in before.items():
        if rel in probe.may_change:
            continue
        if rel not in after:
            r.fault(f"input {rel} was removed")
        elif after[rel] != kind:
            r.fault(f"input {rel} was changed ({kind.split(':')[0]} -> "
                    f"{after[rel].split(':')[0]})")
    new = sorted(set(after) - set(before))
    if r.rc != 0 or probe.signal is not None:
        allowed = set(probe.may_exist) | set(probe.creates)
        extra = [n for n in new if n not in allowed and not any(
            a.startswith(n + "/") for a in allowed)]
        if extra:
            r.fault(f"left {', '.join(extra[:4])}")
    if r.rc == 0 and probe.signal is None:
        for rel in probe.creates:
            if rel not in after:
                r.fault(f"did not write {rel}")
    for rel in probe.valid_json:
        if (d / rel).exists():
            problem = _valid_file_json(d / rel)
            if problem:
                r.fault(problem)
    for rel in probe.csv:
        if rel == "-":
            r.why += _csv_faults(so, "stdout")
        elif (d / rel).is_file():
            r.why += _csv_faults((d / rel).read_text(errors="replace"), rel)
    if Path("/dev/null").exists() and not Path("/dev/null").is_char_device():
        r.fault("/dev/null is no longer a device")      # replaced by an atomic write


def _leftovers(token: str, tmp: Path, r: Result, report: bool) -> None:
    """Processes and temporary files the run left. Workers get a few seconds to go (they are
    told to; the run must not wait on them), then are killed by id."""
    deadline = time.monotonic() + 5
    alive = _tagged_processes(token)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = _tagged_processes(token)
    if alive and report:
        names = []
        for pid in alive[:3]:
            try:
                names.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(
                    b"\0", b" ").decode(errors="replace")[:60].strip())
            except OSError:
                pass
        r.fault(f"{len(alive)} process(es) left: {'; '.join(names)}")
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    left = sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []
    if left and report:
        r.fault(f"temp files left: {', '.join(left[:4])}")


def repro(probe: Probe) -> str:
    """A command line to reproduce the probe (files named, written by the probe)."""
    def short(a: str) -> str:
        if len(a) > 60:
            a = a[:30] + f"...({len(a):,} chars)"
        return shlex.quote(a.encode("unicode_escape").decode() if CONTROL.search(a) else a)
    if probe.api is not None:
        return "python: " + " ".join(probe.api.split())[:150]
    cmd = " ".join(short(a) for a in probe.cmd).replace(str(REPO) + "/", "")
    if probe.files:
        cmd += "   # with " + ", ".join(probe.files)
    if probe.signal:
        cmd += f"   # {signal.Signals(probe.signal.sig).name} after {probe.signal.after}"
    return cmd


# --- the command --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run the probes whose id or class holds this text")
    ap.add_argument("--jobs", type=int, default=2, help="probes run at once (default 2)")
    ap.add_argument("--json", metavar="OUT", help="write every probe's result here")
    ap.add_argument("--list", action="store_true", help="list the probes and exit")
    ap.add_argument("--keep", action="store_true", help="keep each probe's folder")
    args = ap.parse_args(argv)

    # a shell's background job ignores SIGINT, and children inherit that: the Ctrl-C probes
    # need tg to start with the default disposition
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT
                          else signal.default_int_handler)

    probes = catalogue()
    if args.only:
        probes = [p for p in probes if args.only in p.id or args.only in p.cls]
    if args.list:
        for p in probes:
            print(f"{p.id:45} r{p.round}  {p.cls}")
        print(f"{len(probes)} probes")
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    root = Path(tempfile.mkdtemp(prefix="tg-probes-"))
    fixtures = Fixtures(root)
    cache: dict[str, bool] = {}
    results: list[Result] = []
    todo = []
    for p in probes:
        missing = _missing(p, cache)
        if missing:
            results.append(Result(p, "skipped", [f"needs {', '.join(missing)}"]))
        else:
            todo.append(p)
    todo.sort(key=lambda p: -p.cost)          # the slow ones first: the pool ends together
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_probe, p, root, fixtures, args.keep): p for p in todo}
        for n, future in enumerate(as_completed(futures), 1):
            r = future.result()
            results.append(r)
            mark = {"clean": ".", "not clean": "X", "inconclusive": "?"}[r.status]
            console.print(f"[{n}/{len(todo)}] {mark} {r.probe.id} ({r.seconds:.1f} s)"
                          + (f": {r.why[0][:100]}" if r.why else ""), markup=False,
                          highlight=False)
    elapsed = time.monotonic() - t0
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)

    order = {p.id: i for i, p in enumerate(catalogue())}
    results.sort(key=lambda r: order[r.probe.id])
    counts = {s: sum(r.status == s for r in results)
              for s in ("clean", "not clean", "inconclusive", "skipped")}
    shown = [r for r in results if r.status in ("not clean", "inconclusive")]
    if shown:
        table = Table(title="probes not clean", show_lines=True)
        for col in ("probe", "round / class", "why", "repro"):
            table.add_column(col, overflow="fold")
        for r in shown:
            table.add_row(("? " if r.status == "inconclusive" else "") + r.probe.id,
                          f"{r.probe.round} / {r.probe.cls}", "; ".join(r.why),
                          repro(r.probe))
        Console(width=None if sys.stdout.isatty() else 200).print(table)
    ran = len(results) - counts["skipped"]
    print(f"{ran} probes: {counts['clean']} clean, {counts['not clean']} not clean, "
          f"{counts['inconclusive']} inconclusive ({counts['skipped']} skipped: "
          f"{'; '.join(sorted({r.why[0] for r in results if r.status == 'skipped'})) or '-'}) "
          f"in {elapsed:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([{
            "id": r.probe.id, "round": r.probe.round, "class": r.probe.cls,
            "status": r.status, "why": r.why, "rc": r.rc, "seconds": round(r.seconds, 2),
            "repro": repro(r.probe), "note": r.probe.note,
            "stderr_tail": r.stderr[-1000:]} for r in results], indent=1))
    return 0 if counts["not clean"] == counts["inconclusive"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
