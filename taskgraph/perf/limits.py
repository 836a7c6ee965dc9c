"""The hardware limit of offloaded decoding (MoE-Lens, Stage 1; docs/design.md §3.7).

However well a schedule overlaps, a machine cannot decode faster than
``T_max = min(PME * M / delta, T_GPU)``. Every decode step must stream the model over the link:
``delta = model bytes / link bandwidth`` seconds (all the GPUs' links, or what they share
upstream or of host memory, if less). The KV capacity ``M`` (tokens) caps how many
sequences share that cost; sliding-window layers keep at most their window, so it holds more
sequences of a model that has them (:func:`_window_gain`). ``PME = 2(p+g) / ((2p+g) g)`` converts capacity into generated tokens
over a request's life, given the average prompt ``p`` and generation ``g``; for a request list
it is the same ratio summed over the requests, ``sum 2(p+g) / sum (2p+g) g`` (each request's own
lengths, or the longest prompt and generation for every one when padded), which equals the
formula when every length is equal. ``T_GPU`` is the GPU's own ceiling: the achieved FLOP rate
over the FLOPs a token costs.
"""

from __future__ import annotations

import math

import numpy as np

from taskgraph.perf.memory import GB
from taskgraph.specs import Scenario


def hardware_limit_tok_s(scenario: Scenario) -> float:
    m, hw, w = scenario.model, scenario.hardware, scenario.workload
    if scenario.requests is None:
        p, g = np.array([float(w.context_prompt)]), np.array([float(w.gen_len)])
    elif w.padded:
        p = np.full(len(scenario.requests), float(max(r.prompt_len for r in scenario.requests)))
        g = np.full(len(scenario.requests), float(max(r.gen_len for r in scenario.requests)))
    else:
        p = np.array([float(r.prompt_len) for r in scenario.requests])
        g = np.array([float(r.gen_len) for r in scenario.requests])
    pme = float((2 * (p + g)).sum() / ((2 * p + g) * g).sum())
    # every GPU's link, but no faster than the lanes upstream of them or the host memory every
    # byte is read from, where the GPUs share those (hardware.shared)
    link = min(hw.link.h2d_gbps * hw.link.h2d_eff * hw.gpu.count,
               hw.shared.pcie_gbps or math.inf, hw.shared.memory_gbps or math.inf) * 1e9
    delta = m.model_bytes / link
    # KV capacity: what host and GPU memory hold beyond the weights, within the planning
    # headroom, or where the weights leave none there, within what an explicit policy may use
    # (memory less its reserve, as taskgraph.perf.memory.check_fits allows).
    free = (hw.cpu.memory_gb * hw.cpu.usable_fraction
            + hw.gpu.memory_gb * hw.gpu.usable_fraction * hw.gpu.count) * GB - m.model_bytes
    if free <= 0:
        free = ((hw.cpu.memory_gb - hw.cpu.reserve_gb)
                + (hw.gpu.memory_gb - hw.gpu.reserve_gb) * hw.gpu.count) * GB - m.model_bytes
    # tokens of context every layer holds; sliding-window layers hold fewer, so more fit
    capacity_tokens = max(free, 0.0) / (m.L * m.kv_bytes_per_token) * _window_gain(m, p, g)
    # the FLOPs of a token's layers: twice the parameters they use (the LM head aside)
    active_params = m.params["active"] - m.V * m.h
    t_gpu = hw.gpu.tflops * 1e12 * hw.gpu.flops_eff * hw.gpu.count / (2 * active_params)
    return min(pme * capacity_tokens / delta, t_gpu)


def _window_gain(m, p: np.ndarray, g: np.ndarray) -> float:
    """How many times more sequences a KV cache holds because sliding-window layers keep only
    their window: every layer's tokens over a request's decode, summed over the requests, over
    what the layers really keep (each at min(context, window) at each step). 1 without
    windows."""
    if m.sliding_window is None:
        return 1.0

    def held(w: float | None) -> float:
        """Sum over the requests and their decode steps t < g of min(p + t, w)."""
        below = g if w is None else np.clip(w - p, 0, g)   # steps with less context than w
        rest = 0.0 if w is None else (g - below) * w
        return float((below * p + below * (below - 1) / 2 + rest).sum())

    full = held(None)
    return m.L * full / sum(full if w is None else held(w)
                            for w in (m.window(l) for l in range(m.L)))
