"""The CI gate: a scenario's ``expect`` section checked against simulated results.

Checks, each per schedule: ``beats`` (higher throughput than each listed schedule),
``min_efficiency`` (HRM bound / simulated decode-layer latency), ``max_decode_layer_ms`` and
``min_throughput_tok_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from taskgraph.specs import Expect


@dataclass(frozen=True)
class Check:
    schedule: str
    what: str
    expected: str
    actual: str
    ok: bool


def evaluate(expect: Expect, results: dict[str, dict[str, Any]]) -> list[Check]:
    """Every check of `expect` against `results` (schedule name -> simulate summary)."""
    checks: list[Check] = []
    for winner, losers in expect.beats.items():
        mine = results[winner]["throughput_tok_s"]
        for loser in losers:
            theirs = results[loser]["throughput_tok_s"]
            checks.append(Check(winner, f"beats {loser}", f"> {theirs:.2f} tok/s",
                                f"{mine:.2f} tok/s", mine > theirs))
    for name, floor in expect.min_efficiency.items():
        got = results[name]["efficiency"]
        checks.append(Check(name, "efficiency vs HRM bound", f">= {floor:g}", f"{got:.3f}",
                            got >= floor))
    for name, ceiling in expect.max_decode_layer_ms.items():
        got = results[name]["decode_layer_ms"]
        checks.append(Check(name, "decode layer latency", f"<= {ceiling:g} ms", f"{got:.2f} ms",
                            got <= ceiling))
    for name, floor in expect.min_throughput_tok_s.items():
        got = results[name]["throughput_tok_s"]
        checks.append(Check(name, "throughput", f">= {floor:g} tok/s", f"{got:.2f} tok/s",
                            got >= floor))
    return checks
