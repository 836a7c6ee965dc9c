"""Studies over many simulations: schedules side by side (`compare`), the policy search
(`search`) and sweeps of it across hardware or workload values (`sweep`).

These sit above the simulator (`taskgraph.simulation`, `taskgraph.serving`) and below the
Python API (`taskgraph.api`) and the command line; they import downward only. (They are named
so that `taskgraph.study.compare` and `taskgraph.study.search` stay the API's functions.)
"""
