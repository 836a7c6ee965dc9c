"""A schedule's task graph, from data to the form the simulator and the executor run.

``schedules`` (each schedule as data: a launch order and a stream per task kind), ``work``
(each task's FLOPs and bytes), ``builder`` (a schedule and a scenario -> a networkx task graph
with every dependency derived), ``compiled`` (that graph as flat arrays, one segment repeated)
and ``routing`` (which experts a batch's tokens route to, and so the experts' bytes a schedule
moves or reads).

Imports only the foundations and ``taskgraph.specs``; never the cost model, the simulator, the
executor or anything above them.
"""
