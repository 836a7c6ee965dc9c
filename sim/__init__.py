"""The simulator (installed as ``taskgraph.sim``): ``simulate`` (the entry point,
``simulate_scenario``: scenario -> compiled graph -> figures), ``engine`` (SimPy: each stream's
tasks in launch order, block by block in bounded memory), ``interference`` and ``contention``
(what overlapping tasks cost each other: the fixed point, and shared host pools) and ``metrics``
(a run's figures, held whole or accumulated as it streams).

The engine and contention only run durations (the cost layer); the rest may import specs, the
graph, the cost model and outputs; never the executor, studies, the API or the CLI."""

from taskgraph.sim.engine import SimRun, simulate

__all__ = ["SimRun", "simulate"]
