"""Compute kernels of a decoder layer and the sequential reference forward (installed as
``taskgraph.kernels``; needs PyTorch)."""
