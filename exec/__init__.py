"""The executor (installed as ``taskgraph.exec``; needs PyTorch): the same
compiled task graph the simulator runs, run on CUDA streams and CPU threads with real kernels.
``execute`` (the entry point), ``runtime`` (buffers and each task kind's work), ``dispatch`` (a
thread per stream over a device's queues), ``tensor`` (each GPU's tensor-parallel shard),
``distributed`` (a process per GPU over ``torch.distributed``), ``prompts`` (requests in,
tokens out), ``profiling``, ``microbench`` and ``calibrate`` (``tg calibrate``: many runs, so a
study).

May import everything below the studies (specs, graph, cost, kernels, outputs, the simulator);
never studies (``calibrate`` excepted, which is one), the API or the CLI."""
