"""Traces: the one trace writer (:mod:`.writer`, Chrome JSON or Perfetto
protobuf), the protobuf encoder and reader (:mod:`.protobuf`), and a checker for the rules
Perfetto's importer enforces (:mod:`.check`, ``python -m taskgraph.tracing.check TRACE``).

The output layer: imports specs, the graph and the cost model's kinds; never the simulator's
entry point, the executor, studies or the CLI (they hand it what ran)."""
