"""The import graph points one way: each module sits in a layer, and imports (at the top of a
module or inside a function alike) only from its own layer or those below. docs/layout.md draws
the same layers; a module that needs something from above is in the wrong place, or the thing
it needs is."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top. A module is matched by its longest listed prefix.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundations", ["errors", "kinds", "dag.schedules", "presets", "files", "formats",
                     "placement"]),
    ("specs", ["specs", "expect"]),
    ("graph", ["dag"]),
    ("cost", ["perf", "kernels", "sim.engine", "sim.contention"]),
    ("output", ["output", "tracing"]),
    ("scenarios", ["scenario", "model_files", "local", "serving.requests"]),
    ("simulation", ["sim"]),
    ("serving", ["serving.queue"]),
    ("execution", ["exec"]),
    ("studies", ["study"]),
    ("api", ["api", ""]),          # "": the package itself, which re-exports the API
    ("cli", ["cli"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for folder in ("taskgraph", "sim", "exec", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] != "taskgraph":          # installed as taskgraph.sim, .exec, .kernels
                parts.insert(0, "taskgraph")
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts[1:])] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "taskgraph":
            name = node.module.removeprefix("taskgraph").removeprefix(".")
            for alias in node.names:      # `from taskgraph import builder` imports a module
                sub = f"{name}.{alias.name}".lstrip(".")
                found.add(sub if sub in modules else name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "taskgraph":
                    found.add(alias.name.removeprefix("taskgraph").removeprefix("."))
    return found


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".") or p == "") and len(p) > best:
                best, layer = len(p), i
    return layer


def import_graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for target in _imports(path, modules) - {name}:
            g.add_edge(name, target)
    return g


def upward(g: nx.DiGraph) -> list[str]:
    """The imports of `g` that point from a layer to one above it."""
    return [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
            for a, b in g.edges if layer_of(b) > layer_of(a)]


def test_every_module_is_in_a_layer():
    assert all(layer_of(m) is not None for m in import_graph())


def test_no_module_imports_from_a_layer_above_it():
    up = upward(import_graph())
    assert not up, "imports that point up:\n  " + "\n  ".join(up)


def test_there_is_no_import_circle():
    assert not list(nx.simple_cycles(import_graph()))


def test_the_checks_find_the_old_circle():
    """The guards matter: specs reading the kinds from work (as it did, inside a function) is an
    import that points up, and with work's import of specs a circle."""
    g = import_graph()
    g.add_edge("specs", "dag.work")
    assert upward(g) == ["specs (specs) imports dag.work (graph)"]
    assert list(nx.simple_cycles(g))


def test_every_subpackage_is_reachable_as_an_attribute():
    """`import taskgraph.x.y as m` and `taskgraph.x.y` need `taskgraph.x` to be the package: an
    API function of the same name re-exported by `taskgraph` would hide it (the API's `graph`
    hid a `taskgraph.graph` package)."""
    import importlib
    import types

    import taskgraph
    for name in sorted({m.split(".")[0] for m in _modules() if "." in m}):
        importlib.import_module(f"taskgraph.{name}")
        assert isinstance(getattr(taskgraph, name), types.ModuleType), name


def private_imports(sources: dict[str, str]) -> list[str]:
    """`from taskgraph.x import _name` in any of `sources` (module -> its text): a name its
    module keeps to itself, used from outside."""
    found = []
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.split(".")[0] == "taskgraph":
                found += [f"{module} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name_of_another():
    """Issue 39 point 4: a name with a leading underscore is its module's own."""
    assert private_imports({m: p.read_text() for m, p in _modules().items()}) == []
    assert private_imports({"api": "from taskgraph.scenario import _short\n"}) == \
        ["api imports taskgraph.scenario._short"]
