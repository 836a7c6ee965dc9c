"""What a task graph costs on a machine, without running it.

``cost`` (a task's work -> seconds on its resource: copies, kernels, collectives, and what the
host's shared pools draw), ``memory`` (GPU and CPU bytes a policy needs), ``predict`` (the HRM
bound the search ranks policies by) and ``limits`` (the hardware limit a run cannot beat).

Imports the foundations, ``taskgraph.specs`` and ``taskgraph.dag``; never the simulator, the
executor, outputs or studies.
"""
