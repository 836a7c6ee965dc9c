"""tg: one task graph for offloaded MoE inference, simulated and executed."""

__version__ = "0.1.0"
