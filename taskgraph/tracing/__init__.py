"""Traces: the one trace writer (:mod:`.writer`, Chrome JSON or Perfetto protobuf), the
protobuf encoder and reader (:mod:`.protobuf`), and a checker for the rules Perfetto's
importer enforces (:mod:`.check`, ``python -m taskgraph.tracing.check TRACE``)."""
