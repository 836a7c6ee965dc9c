"""Benchmark: CPU decode-attention kernels on the same shapes (Mixtral 8x7B heads: 32 query
heads, 8 KV heads, d=128): scaled_dot_product_attention with enable_gqa (the kernel tg uses),
a grouped einsum that reads K/V once per group, and SDPA with K/V repeated per query head.

    python bench/attention_kernel.py

All three give the same numbers (checked here); the fastest is the one `decode_attention` uses.
"""

from __future__ import annotations

import torch

from taskgraph.exec.microbench import best_time

from taskgraph.kernels.ops import (decode_attention, decode_attention_grouped,
                                   decode_attention_repeat)


def main() -> None:
    torch.manual_seed(0)
    n_q, n_kv, d = 32, 8, 128
    print(f"{'batch':>5} {'context':>7} {'SDPA-GQA ms':>11} {'einsum ms':>9} {'repeat ms':>9} "
          f"{'GB/s':>6} {'max diff':>9}   ({torch.get_num_threads()} threads)")
    for B, T in ((8, 128), (36, 141), (36, 512), (64, 1024), (128, 512)):
        q = torch.randn(B, n_q, d)
        k = torch.randn(B, T, n_kv, d)
        v = torch.randn(B, T, n_kv, d)
        ours = best_time(lambda: decode_attention(q, k, v))
        grouped = best_time(lambda: decode_attention_grouped(q, k, v))
        repeat = best_time(lambda: decode_attention_repeat(q, k, v))
        ref = decode_attention(q, k, v)
        diff = max((decode_attention_grouped(q, k, v) - ref).abs().max().item(),
                   (decode_attention_repeat(q, k, v) - ref).abs().max().item())
        gbps = 2 * k.numel() * k.element_size() / ours / 1e9
        print(f"{B:5d} {T:7d} {ours * 1e3:11.2f} {grouped * 1e3:9.2f} {repeat * 1e3:9.2f} "
              f"{gbps:6.1f} {diff:9.1e}")


if __name__ == "__main__":
    main()
