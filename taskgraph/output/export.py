"""Writing a segment graph for people and other tools: node-link JSON or Graphviz DOT."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from taskgraph.errors import LongRunWarning, TgError
from taskgraph.files import atomic_path

_COLORS = {"gpu": "#9ecae1", "cpu": "#fdae6b", "h2d": "#a1d99b", "h2d_kv": "#c7e9c0",
           "d2h": "#bcbddc", "pin": "#fdd0a2"}


#: Tasks a second a segment graph is built at most (about 8,000 on one core of this 2-core
#: machine, unloaded, at 45,000 tasks): an estimate from it never says a large graph is quick.
GRAPH_TASKS_PER_S = 20_000
#: A graph that will take at least this long to build is announced first.
GRAPH_ANNOUNCE_S = 30


def announce_large_graph(schedule: str, step: int, tasks: int) -> None:
    """Warn (LongRunWarning) before building a segment graph that will take minutes."""
    least = tasks / GRAPH_TASKS_PER_S
    if least < GRAPH_ANNOUNCE_S:
        return
    warnings.warn(LongRunWarning(
        f"segment {step} of {schedule} has about {tasks:,} tasks: its graph takes at least "
        f"{least / 60:.1f} minutes to build ({GRAPH_TASKS_PER_S:,} tasks a second at best), "
        f"with some ten dependencies a task. A graph to read or draw holds a few layers and "
        "micro-batches (model.L, policy.N / policy.mu). Ctrl-C stops it."), stacklevel=3)


@dataclass
class SegmentGraph:
    """One segment's task graph: its own tasks and the previous segment's it depends on
    (``external``), for schedule `schedule`; step 0 is prefill, d >= 1 decode step d."""

    graph: nx.DiGraph
    schedule: str
    step: int

    @property
    def tasks(self) -> int:
        return sum(1 for _, a in self.graph.nodes(data=True) if not a["external"])

    def __str__(self) -> str:
        g = self.graph
        return (f"segment {self.step} of {self.schedule}, {self.tasks} tasks, "
                f"{g.number_of_edges()} dependencies ({g.number_of_nodes() - self.tasks} tasks "
                "of the previous segment)")


def write_graph(g: nx.DiGraph, path: str | Path) -> None:
    """Write `g` as node-link JSON (``.json``) or Graphviz DOT (``.dot``/``.gv``)."""
    path = Path(path)
    if path.suffix == ".json":
        text = json.dumps(nx.node_link_data(g, edges="edges"), indent=1, sort_keys=True)
    elif path.suffix in (".dot", ".gv"):
        text = to_dot(g)
    else:
        raise TgError(
            f"--out '{path}': the graph format is chosen by extension; use .json (node-link "
            "JSON, for networkx.node_link_graph and scripts) or .dot (Graphviz)."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def to_dot(g: nx.DiGraph) -> str:
    """Graphviz DOT: one cluster per stream in launch order, buffer-reuse edges dashed,
    tasks of the previous segment grey."""
    lines = [f'digraph "{g.graph.get("schedule", "")} segment {g.graph.get("segment", "")}" {{',
             "  rankdir=LR;", '  node [shape=box, style="rounded,filled", fontsize=10];']
    streams: dict[str, list[str]] = {}
    for name, a in sorted(g.nodes(data=True), key=lambda na: (na[1]["external"], na[1]["order"])):
        streams.setdefault("previous" if a["external"] else a["stream"], []).append(name)
    for stream, names in streams.items():
        lines.append(f'  subgraph "cluster_{stream}" {{ label="{stream}";')
        for name in names:
            color = "#e0e0e0" if stream == "previous" else _COLORS.get(stream, "white")
            lines.append(f'    "{name}" [fillcolor="{color}"];')
        lines.append("  }")
    for u, v, a in g.edges(data=True):
        style = "dashed" if a.get("why", "").startswith("reuse") else "solid"
        lines.append(f'  "{u}" -> "{v}" [style={style}, tooltip="{a.get("why", "")}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
