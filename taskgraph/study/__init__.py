"""Studies over many runs: schedules side by side (`compare`), the policy search (`search`),
sweeps of it across hardware or workload values (`sweep`), and executions against simulations
(`validate`).

These sit above the simulator (`taskgraph.simulation`, `taskgraph.serving`) and the executor,
and below the Python API (`taskgraph.api`) and the command line; they import downward only.
(They live here so that `taskgraph.compare`, `.search`, `.sweep` and `.validate` are the
API's functions.)
"""
