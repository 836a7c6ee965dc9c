"""How weights and caches are stored: the bits a format holds per weight, its block scales
included, so that every byte tg prices (memory, weight pages, transfers, reads) is what the
format stores.

A format is named as the tools that write it name it:

* GGUF's tensor types (``q4_k``, ``q6_k``, ``q8_0``, ``iq4_xs``, ``mxfp4``, ``bf16`` ...): their
  block sizes are llama.cpp's own, read from its ``gguf`` package (``GGML_QUANT_SIZES``), not
  written down here;
* ``fp8``: 8-bit floats with one scale per tensor (or per channel: the same bits, near enough);
  ``fp8-block128``: with an fp32 scale per 128 x 128 block, as DeepSeek-V3 and Qwen3's FP8
  checkpoints store them (``weight_block_size: [128, 128]``);
* ``int8``: 8-bit integers with a scale per output channel;
  ``int4-g128`` (``int<b>-g<g>``): AWQ's and GPTQ's b-bit integers with an fp16 scale and a b-bit
  zero point per group of g weights along the input;
* ``mxfp4``: OCP microscaling FP4, an 8-bit shared exponent per 32 weights (gpt-oss's experts);
  ``nvfp4``: an fp8 scale per 16 weights;
* ``fp32``, ``fp16``, ``bf16`` (also ``float32``, ``float16``, ``bfloat16``).

A number is taken as bits per weight as given (a GGUF file's average over a mix of types).
"""

from __future__ import annotations

import re
from functools import cache

from taskgraph.errors import TgError

#: Formats that are not GGUF tensor types, and their bits per weight.
_FORMATS: dict[str, float] = {
    "fp32": 32.0, "float32": 32.0, "fp16": 16.0, "float16": 16.0, "bfloat16": 16.0,
    "fp8": 8.0, "int8": 8.0,
    "fp8-block128": 8.0 + 32.0 / (128 * 128),
    "mxfp4": 4.0 + 8.0 / 32,
    "nvfp4": 4.0 + 8.0 / 16,
}
#: Float formats by every name they go by (GGUF's f32, f16, bf16 too).
FLOATS = frozenset({"fp32", "float32", "f32", "fp16", "float16", "f16", "bf16", "bfloat16"})
_GROUPED = re.compile(r"int([2-8])-g(\d+)")
#: The fewest and most bits per weight a format can hold (GGUF's ternary TQ1_0 has 1.69; fp32 32).
MIN_BITS, MAX_BITS = 1.0, 32.0


def bits(fmt: str | float) -> float:
    """Bits per weight of a format (see the module docstring), or of a number of bits."""
    if isinstance(fmt, (int, float)) and not isinstance(fmt, bool):
        if not MIN_BITS <= fmt <= MAX_BITS:
            raise TgError(f"{fmt} bits per weight is outside what a format holds "
                          f"({MIN_BITS:g} to {MAX_BITS:g}).")
        return float(fmt)
    name = str(fmt).lower()
    if name in _FORMATS:
        return _FORMATS[name]
    grouped = _GROUPED.fullmatch(name)
    if grouped:
        b, group = int(grouped[1]), int(grouped[2])
        if not 8 <= group <= 4096:
            raise TgError(f"format '{fmt}': a group of {group} weights is not one AWQ or GPTQ "
                          "writes (8 to 4096).")
        return b + (16 + b) / group           # the fp16 scale and the b-bit zero of each group
    gguf = gguf_bits()
    if name in gguf:
        return gguf[name]
    try:
        quoted = float(name)
    except ValueError:
        quoted = None
    if quoted is not None and MIN_BITS <= quoted <= MAX_BITS:
        raise TgError(f"'{fmt}' is text, not a number of bits: give bits per weight unquoted "
                      f"({name}), or a format's name.")
    raise TgError(f"Unknown weight format '{fmt}'; tg knows {', '.join(known())}, "
                  "int<bits>-g<group>, and bits per weight as a number.")


def is_float(fmt: str | float) -> bool:
    """Whether a format names floats (a number of bits never does)."""
    return isinstance(fmt, str) and fmt.lower() in FLOATS


def known() -> list[str]:
    """Every format name :func:`bits` reads (those of the int<b>-g<g> pattern aside)."""
    return sorted(set(_FORMATS) | set(gguf_bits()))


@cache
def gguf_bits() -> dict[str, float]:
    """Bits per weight of every GGUF tensor type, lower-case, from llama.cpp's gguf package: a
    block of ``block`` weights stored in ``size`` bytes."""
    from gguf.constants import GGML_QUANT_SIZES

    return {t.name.lower(): 8.0 * size / block for t, (block, size) in GGML_QUANT_SIZES.items()
            if t.name not in _NOT_WEIGHTS}


#: GGUF types no weight is stored in: integers, fp64, and the Q8 forms llama.cpp quantizes
#: activations into for its dot products.
_NOT_WEIGHTS = frozenset({"I8", "I16", "I32", "I64", "F64", "Q8_1", "Q8_K"})
