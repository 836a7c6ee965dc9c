"""tg: one task graph for offloaded MoE inference, simulated and executed.

The Python API (:mod:`taskgraph.api`): ``simulate``, ``compare`` (and ``crossover``, its
across-batch-sizes form), ``search``, ``execute``,
``fit``, ``sweep``, ``batch``, ``validate``, ``calibrate``, ``roofline`` and ``graph`` do what
the `tg` verbs of the same names do and return typed results whose ``to_dict()`` is the verb's
``--json``; ``load`` reads a scenario.
"""

__version__ = "0.1.0"

from taskgraph.api import (batch, calibrate, catalog, compare, crossover, execute, fit,  # noqa: E402
                           graph, load, roofline, search, simulate, sweep, validate)

__all__ = ["load", "simulate", "compare", "crossover", "search", "execute", "fit", "sweep",
           "batch", "catalog", "validate", "calibrate", "roofline", "graph", "__version__"]
