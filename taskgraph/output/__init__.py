"""What a run leaves for people: tables (``report``), plots (``plots``, matplotlib PNG) and the
task graph written out (``export``). Traces have their own package, ``taskgraph.tracing``.

Imports the layers below (specs, graph, cost); never the simulator's entry point, the executor,
studies or the CLI.
"""
