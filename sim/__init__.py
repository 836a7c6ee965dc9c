"""The discrete-event simulator of compiled task graphs (installed as ``taskgraph.sim``)."""

from taskgraph.sim.engine import SimRun, simulate

__all__ = ["SimRun", "simulate"]
