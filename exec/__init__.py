"""The real executor: the compiled task graph run on streams with real kernels (installed as
``taskgraph.exec``; needs PyTorch)."""
