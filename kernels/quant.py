"""Experts stored at 8 or 4 bits, as llama.cpp stores them (GGUF's Q8_0 and Q4_0 blocks), and
dequantized where they run.

A block holds 32 weights of a row: an fp16 scale, then 32 int8 values (Q8_0, 34 bytes, 8.5
bits a weight) or 32 4-bit values packed two a byte, the first 16 in the low nibbles (Q4_0, 18
bytes, 4.5 bits; a weight is (nibble - 8) x scale). An expert is its w1, w3 and w2 rows in
blocks, one byte string, so a copy of an expert moves exactly the bytes the cost model counts
for it (ModelSpec.expert_bytes at the format's bits). Weights are quantized with llama.cpp's
own ``gguf`` package; the dequantization here is torch's, checked against the package's
(tests/test_quantized_experts.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Iterator

from taskgraph.specs import ModelSpec

if TYPE_CHECKING:            # torch and numpy are imported where used: the format's names and
    import torch             # sizes (expert_format) serve the executor's checks without them

BLOCK = 32
#: Formats the executor stores experts in, and a block's bytes.
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


def expert_format(m: ModelSpec) -> str | None:
    """The format the model's routed experts are stored in, where the executor stores them so
    (None: in the model's dtype, with the layer's other weights)."""
    fmt = m.precision.experts
    fmt = fmt.lower() if isinstance(fmt, str) else None
    return fmt if fmt in BLOCK_BYTES else None


def expert_nbytes(m: ModelSpec, fmt: str) -> int:
    """One expert's bytes: its three matrices' rows in blocks."""
    return 3 * m.h * m.h_i // BLOCK * BLOCK_BYTES[fmt]


def quantize_expert(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, fmt: str
                    ) -> torch.Tensor:
    """An expert's matrices (rows are output features) as one byte string of blocks."""
    import numpy as np
    import torch
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType[fmt.upper()]
    parts = [quantize(w.detach().float().cpu().numpy(), kind).reshape(-1) for w in (w1, w3, w2)]
    return torch.from_numpy(np.concatenate(parts))


def dequantize(raw: torch.Tensor, fmt: str, rows: int, cols: int, dtype: torch.dtype
               ) -> torch.Tensor:
    """A [rows, cols] matrix from its blocks (`raw`, uint8), in `dtype`, on `raw`'s device."""
    import torch

    blocks = raw.view(-1, BLOCK_BYTES[fmt])
    scale = blocks[:, :2].contiguous().view(torch.float16).float()          # [n, 1]
    if fmt == "q8_0":
        values = blocks[:, 2:].contiguous().view(torch.int8).float()
    else:
        packed = blocks[:, 2:]
        values = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float() - 8.0
    return (values * scale).to(dtype).view(rows, cols)


class QuantizedExperts(Mapping):
    """What :func:`taskgraph.kernels.ops.experts` reads (``w13.{e}``, ``w2.{e}``) over experts
    stored in blocks: `store` [slots, nbytes] (uint8) holding expert `e` in slot `slot_of[e]`;
    each read dequantizes, in `dtype`, where the store lies."""

    def __init__(self, m: ModelSpec, fmt: str, store: torch.Tensor, slot_of: dict[int, int],
                 dtype: torch.dtype):
        self.m, self.fmt, self.store, self.slot_of, self.dtype = m, fmt, store, slot_of, dtype
        self._cut = 2 * m.h * m.h_i // BLOCK * BLOCK_BYTES[fmt]      # w1 | w3, then w2

    def __getitem__(self, name: str) -> torch.Tensor:
        part, e = name.split(".")
        raw = self.store[self.slot_of[int(e)]]
        m = self.m
        if part == "w13":
            return dequantize(raw[:self._cut], self.fmt, 2 * m.h_i, m.h, self.dtype)
        if part == "w2":
            return dequantize(raw[self._cut:], self.fmt, m.h, m.h_i, self.dtype)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        for e in self.slot_of:
            yield f"w13.{e}"
            yield f"w2.{e}"

    def __len__(self) -> int:
        return 2 * len(self.slot_of)
