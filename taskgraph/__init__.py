"""tg: one task graph for offloaded MoE inference, simulated and executed.

The Python API (:mod:`taskgraph.api`): ``simulate``, ``compare``, ``search``, ``execute`` and
``fit`` do what the `tg` verbs of the same names do and return typed results whose
``to_dict()`` is the verb's ``--json``; ``load`` reads a scenario.
"""

__version__ = "0.1.0"

from taskgraph.api import compare, execute, fit, load, search, simulate  # noqa: E402

__all__ = ["load", "simulate", "compare", "search", "execute", "fit", "__version__"]
