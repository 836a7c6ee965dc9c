"""Compute kernels of a decoder layer and the sequential reference forward
(installed as ``taskgraph.kernels``; needs PyTorch): ``ops`` (RoPE, RMSNorm, GQA attention,
routed SwiGLU experts), ``weights`` (synthetic, or Mixtral safetensors read lazily) and
``reference`` (the model computed layer after layer, with no schedule).

Imports only the foundations and specs: what the model computes does not depend on a schedule."""
