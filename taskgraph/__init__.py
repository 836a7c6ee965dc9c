"""tg: one task graph for offloaded MoE inference, simulated and executed.

The Python API (:mod:`taskgraph.api`): ``simulate``, ``compare`` (and ``crossover``, its
across-batch-sizes form), ``search``, ``execute``,
``fit``, ``sweep``, ``batch``, ``validate``, ``calibrate``, ``roofline`` and ``graph`` do what
the `tg` verbs of the same names do and return typed results whose ``to_dict()`` is the verb's
``--json``; ``load`` reads a scenario and ``resolve_policy`` gives ``policy: auto`` the
search's best.
"""

from taskgraph.errors import TgError      # what every call raises for bad input; imports nothing

__version__ = "0.1.0"

__all__ = ["load", "resolve_policy", "simulate", "compare", "crossover", "search", "execute", "fit", "sweep",
           "batch", "catalog", "validate", "calibrate", "roofline", "graph", "TgError",
           "__version__"]


def __getattr__(name: str):
    """The API's functions, imported when first asked for: importing the package stays light,
    so that `tg`, whose console script imports it, can catch a Ctrl-C while the API (NumPy,
    SimPy, networkx, pydantic) loads (taskgraph.cli.main)."""
    if name in __all__:      # TgError and __version__ are set above: never asked for here
        from taskgraph import api

        return getattr(api, name)
    raise AttributeError(f"module 'taskgraph' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
