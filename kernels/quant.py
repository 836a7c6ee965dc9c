"""Experts stored below 16 bits as llama.cpp stores them (GGUF's block types), and dequantized
where they run.

Every format cuts a row into blocks and stores each block's weights with its own scales:

* ``q8_0``: 32 weights, an fp16 scale and 32 int8 values (34 bytes, 8.5 bits a weight);
* ``q4_0``: 32 weights, an fp16 scale and 32 4-bit values two a byte, the first 16 in the low
  nibbles (18 bytes, 4.5 bits; a weight is (nibble - 8) x scale);
* ``mxfp4``: 32 weights, an 8-bit power-of-two exponent and 32 FP4 (E2M1) values (17 bytes,
  4.25 bits): gpt-oss's experts as OpenAI publishes them;
* ``q4_k``, ``q5_k``: the K-quants Q4_K_M and Q5_K_M are made of: 256 weights in eight
  sub-blocks of 32, an fp16 scale and minimum for the whole, a 6-bit scale and minimum per
  sub-block, 4 (5) bits a weight (144 and 176 bytes: 4.5 and 5.5 bits);
* ``q6_k``: 256 weights in sixteen sub-blocks of 16, an fp16 scale, an int8 scale per sub-block
  and 6-bit values (210 bytes, 6.5625 bits; Q4_K_M's down projections in half the layers).

An expert is its w1, w3 and w2 rows in blocks, one byte string, so a copy of an expert moves
exactly the bytes the cost model counts for it (ModelSpec.expert_bytes at the format's bits).
A layer's experts lie where 16-bit ones would, at the end of its flat vector, their bytes
filling elements of the model's dtype, so the schedules that stream a layer in pages stream
them as they stream the rest.
Block sizes are llama.cpp's own gguf package's (``GGML_QUANT_SIZES``). Weights are quantized
with that package where it can (Q8_0, Q4_0, MXFP4); it only reads the K-quants, so those are
quantized here with plain rounding (not llama.cpp's search for the best scales: the blocks are
the format's, their values a little further from the weights). Every dequantization here is
torch's, checked equal to the package's (tests/test_quantized_experts.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Iterator

from taskgraph.specs import ModelSpec

if TYPE_CHECKING:            # torch and numpy are imported where used: the formats' names
    import numpy as np       # (expert_format) serve the executor's checks without them
    import torch

#: The formats the executor stores experts in (GGUF tensor types, lower-case).
FORMATS = ("q8_0", "q4_0", "mxfp4", "q4_k", "q5_k", "q6_k")
#: The K-quants' super-block: 256 weights.
QK_K = 256


def expert_format(m: ModelSpec) -> str | None:
    """The format the model's routed experts are stored in, where the executor stores them so
    (None: in the model's dtype, with the layer's other weights)."""
    fmt = m.precision.experts
    fmt = fmt.lower() if isinstance(fmt, str) else None
    return fmt if fmt in FORMATS else None


def block_of(fmt: str) -> tuple[int, int]:
    """A block of the format: (weights it holds, its bytes), as llama.cpp's package has it."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[fmt.upper()]]


def row_bytes(fmt: str, cols: int) -> int:
    """The bytes of a row of `cols` weights (a whole number of blocks)."""
    weights, size = block_of(fmt)
    return cols // weights * size


def expert_nbytes(m: ModelSpec, fmt: str) -> int:
    """One expert's bytes: its three matrices' rows in blocks."""
    return 2 * m.h_i * row_bytes(fmt, m.h) + m.h * row_bytes(fmt, m.h_i)


def quantize_expert(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, fmt: str
                    ) -> torch.Tensor:
    """An expert's matrices (rows are output features) as one byte string of blocks."""
    import numpy as np
    import torch

    parts = [quantize_rows(w.detach().float().cpu().numpy(), fmt).reshape(-1)
             for w in (w1, w3, w2)]
    return torch.from_numpy(np.concatenate(parts))


def quantize_rows(x: np.ndarray, fmt: str) -> np.ndarray:
    """A matrix [rows, cols] (fp32) as its rows' blocks [rows, row_bytes], uint8."""
    if fmt in _K_QUANTIZERS:
        rows, cols = x.shape
        blocks = _K_QUANTIZERS[fmt](x.reshape(-1, QK_K).astype("float32"))
        return blocks.reshape(rows, row_bytes(fmt, cols))
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(x, GGMLQuantizationType[fmt.upper()])


def dequantize(raw: torch.Tensor, fmt: str, rows: int, cols: int, dtype: torch.dtype
               ) -> torch.Tensor:
    """A [rows, cols] matrix from its blocks (`raw`, uint8), in `dtype`, on `raw`'s device."""
    blocks = raw.view(-1, block_of(fmt)[1])
    return _DEQUANTIZERS[fmt](blocks).to(dtype).view(rows, cols)


def expert_elements(m: ModelSpec, fmt: str) -> int:
    """The elements of the model's dtype one expert's blocks fill in a layer's flat vector.
    A whole number: h and h_i are multiples of the block's 32 or 256 weights (the executor
    refuses others), so each of w1, w3 (h_i rows) and w2 (h rows) is a multiple of 32 rows of
    whole blocks, a multiple of 32 bytes."""
    return expert_nbytes(m, fmt) // m.dtype_bytes


def dequantize_part(raw: torch.Tensor, part: str, m: ModelSpec, fmt: str, dtype: torch.dtype
                    ) -> torch.Tensor:
    """An expert's stacked gate | up (``w13``) or its down projection (``w2``) from its
    blocks (`raw`, uint8: w1 | w3 | w2), in `dtype`, where `raw` lies."""
    cut = 2 * m.h_i * row_bytes(fmt, m.h)
    if part == "w13":
        return dequantize(raw[:cut], fmt, 2 * m.h_i, m.h, dtype)
    if part == "w2":
        return dequantize(raw[cut:], fmt, m.h, m.h_i, dtype)
    raise KeyError(part)


class QuantizedExperts(Mapping):
    """What :func:`taskgraph.kernels.ops.experts` reads (``w13.{e}``, ``w2.{e}``) over experts
    stored in blocks: `store` [slots, nbytes] (uint8) holding expert `e` in slot `slot_of[e]`;
    each read dequantizes, in `dtype`, where the store lies."""

    def __init__(self, m: ModelSpec, fmt: str, store: torch.Tensor, slot_of: dict[int, int],
                 dtype: torch.dtype):
        self.m, self.fmt, self.store, self.slot_of, self.dtype = m, fmt, store, slot_of, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        part, e = name.split(".")
        return dequantize_part(self.store[self.slot_of[int(e)]], part, self.m, self.fmt,
                               self.dtype)

    def __iter__(self) -> Iterator[str]:
        for e in self.slot_of:
            yield f"w13.{e}"
            yield f"w2.{e}"

    def __len__(self) -> int:
        return 2 * len(self.slot_of)


# --- dequantization (torch), each block's weights as llama.cpp's package computes them -------

def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 number at byte `start` of each block, as fp32 [n, 1]."""
    import torch

    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [n, g, b] as each row's low nibbles then its high ones, 32 values a row of the
    result: [n, 2gb / 32, 32]."""
    return _shifted(packed, [0, 4], 0x0F).reshape(packed.shape[0], -1, 32)


def _shifted(packed: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """Bytes [n, g, w] shifted right by each of `shifts` and masked: [n, g, len(shifts), w]."""
    import torch

    by = torch.tensor(shifts, dtype=torch.uint8, device=packed.device).view(1, 1, -1, 1)
    return (packed.unsqueeze(2) >> by) & mask


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    packed = blocks[:, 2:]
    values = _nibbles(packed[:, None]).reshape(packed.shape[0], 32).float() - 8.0
    return values * _f16(blocks, 0)


#: E2M1's sixteen values, doubled (the exponent below is halved to match, as ggml has it).
_FP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    e = blocks[:, :1].to(torch.int32)
    # 2^(e - 128) as fp32 bits (ggml_e8m0_to_fp32_half): subnormal below e = 2
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e),
                       (e - 1) << 23)
    scale = bits.view(torch.float32)
    packed = blocks[:, 1:]
    index = _nibbles(packed[:, None]).reshape(packed.shape[0], 32).long()
    table = torch.tensor(_FP4_DOUBLED, dtype=torch.float32, device=blocks.device)
    return scale * table[index]


def _scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's twelve bytes as eight 6-bit scales and eight 6-bit minimums [n, 8]:
    bytes 0-3 and 4-7 hold the first four of each in their low six bits and the top two bits
    of the last four in their high two; bytes 8-11 the last four's low nibbles."""
    import torch

    first, second, low = packed.view(-1, 3, 4).unbind(1)      # bytes 0-3, 4-7, 8-11
    scales = torch.cat([first & 0x3F, (low & 0x0F) | ((first >> 2) & 0x30)], dim=-1)
    mins = torch.cat([second & 0x3F, (low >> 4) | ((second >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's weights from their values [n, 8, 32]: scale x value - minimum."""
    scales, mins = _scales_mins(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * scales).unsqueeze(-1)
    low = (_f16(blocks, 2) * mins).unsqueeze(-1)
    return (scale * q.float() - low).reshape(-1, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_affine(blocks, _nibbles(blocks[:, 16:].reshape(-1, 4, 32)))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    high = _shifted(blocks[:, 16:48].reshape(-1, 1, 32), list(range(8)), 1).reshape(-1, 8, 32)
    return _k_affine(blocks, _nibbles(blocks[:, 48:].reshape(-1, 4, 32)) | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    n = blocks.shape[0]
    low = _shifted(blocks[:, :128].reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 8, 32)
    high = _shifted(blocks[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scale = _f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()
    return (scale.unsqueeze(-1) * q).reshape(n, QK_K)


_DEQUANTIZERS = {"q8_0": _q8_0, "q4_0": _q4_0, "mxfp4": _mxfp4, "q4_k": _q4_k, "q5_k": _q5_k,
                 "q6_k": _q6_k}


# --- the K-quants' quantization (numpy): round to the nearest, no search ---------------------

def _fp16_bytes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [n] rounded to fp16: (its value as fp32 [n, 1], its two bytes [n, 2])."""
    import numpy as np

    half = x.astype(np.float16)
    return half.astype(np.float32)[:, None], half.view(np.uint8).reshape(-1, 2)


def _divide(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    import numpy as np

    return np.divide(x, by, out=np.zeros(np.broadcast_shapes(x.shape, by.shape), np.float32),
                     where=by > 0)


def _quantize_affine(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's fields of super-blocks [n, 256]: (d | dmin | twelve bytes of scales
    and minimums [n, 16], values [n, 8, 32] of `bits` bits)."""
    import numpy as np

    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)                  # a minimum is stored as -low >= 0
    scale, minimum = (sub.max(axis=-1) - low) / (2 ** bits - 1), -low
    d, d_bytes = _fp16_bytes(scale.max(axis=-1) / 63)
    dmin, dmin_bytes = _fp16_bytes(minimum.max(axis=-1) / 63)
    scales = np.clip(np.rint(_divide(scale, d)), 0, 63).astype(np.uint8)
    mins = np.clip(np.rint(_divide(minimum, dmin)), 0, 63).astype(np.uint8)
    packed = np.concatenate([
        (scales[:, :4] & 0x3F) | ((scales[:, 4:] >> 4) << 6),
        (mins[:, :4] & 0x3F) | ((mins[:, 4:] >> 4) << 6),
        (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)], axis=-1)
    step = (d * scales)[..., None]
    values = np.rint(_divide(sub + (dmin * mins)[..., None], step))
    return (np.concatenate([d_bytes, dmin_bytes, packed], axis=-1),
            np.clip(values, 0, 2 ** bits - 1).astype(np.uint8))


def _low_nibbles_packed(q: np.ndarray) -> np.ndarray:
    """Values [n, 8, 32] as 128 bytes: sub-blocks 2g and 2g+1 in the low and high nibbles of
    bytes 32g to 32g+31."""
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    import numpy as np

    head, q = _quantize_affine(x, 4)
    return np.concatenate([head, _low_nibbles_packed(q)], axis=-1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    import numpy as np

    head, q = _quantize_affine(x, 5)
    high = np.zeros((len(x), 32), np.uint8)
    for j in range(8):                                     # bit j: sub-block j's fifth bit
        high |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([head, high, _low_nibbles_packed(q)], axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    import numpy as np

    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31                  # values -31..31 of -32..31
    d, d_bytes = _fp16_bytes(scale.max(axis=-1) / 127)
    scales = np.clip(np.rint(_divide(scale, d)), 0, 127).astype(np.int8)
    q = np.clip(np.rint(_divide(sub, (d * scales)[..., None])), -32, 31)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 128)     # halves of 128 values
    low, high = q & 0x0F, (q >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, scales.view(np.uint8), d_bytes], axis=-1)


_K_QUANTIZERS = {"q4_k": _quantize_q4_k, "q5_k": _quantize_q5_k, "q6_k": _quantize_q6_k}
