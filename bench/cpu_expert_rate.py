"""What a 16-bit expert reaches on the CPU in PyTorch, as Fiddler runs its CPU experts
(transformers' bf16 Mixtral expert module, `torch.set_num_threads(16)`), against the fp32 rates
of the same cores measured in the same run (the rates a host preset's figures stand for).

One Mixtral 8x7B expert (w1, w3: 4096 x 14336, w2: 14336 x 4096; 352 MB in bf16) through
SiLU(x W1) * (x W3) W2 at 1-16 tokens, on each thread count up to the cores, in a fresh process
for each instruction set: the host's own, and oneDNN held to AVX512_CORE
(ONEDNN_MAX_CPU_ISA), the instruction set of the Skylake and Cascade Lake Xeons the Fiddler
authors ran on, which have no bf16 arithmetic. Each is fitted as tg prices a `serial` kind
(taskgraph.specs.KindEffect): seconds = bytes / bandwidth + FLOPs / FLOP rate, on 2-16 tokens,
and each rate is printed as a share of its fp32 reference: a bf16 expert at one token against
an fp32 matrix-vector product's bytes a second (the cores' bandwidth), and the bf16 FLOPs
against an fp32 product of 64 tokens (the cores' FLOP rate).

    python bench/cpu_expert_rate.py [--threads 1,2] [--tokens 1,2,4,8,16] [--repeats 5] [--json]

It also times the host work Fiddler does for each layer before any expert runs (its choice of
where each expert runs, in Python), which `fiddler`'s CPUFFN fixed cost stands for.

A timing on a shared machine: report, do not gate on it. Needs PyTorch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

H, H_I = 4096, 14336
ISAS = {"native": None, "avx512_core (Skylake, Cascade Lake)": "AVX512_CORE"}


def measure(threads: int, tokens: list[int], repeats: int) -> dict:
    """Best-of-`repeats` seconds of one expert per token count (bf16), and the fp32
    references, on `threads` threads of this process."""
    import torch

    from taskgraph.exec.microbench import best_time

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)

    def weights(dtype):
        return [torch.randn(shape, generator=gen).to(dtype) * 0.02
                for shape in ((H_I, H), (H_I, H), (H, H_I))]

    def best(fn) -> float:
        return best_time(fn, repeats)

    def expert(w, x):
        w1, w3, w2 = w
        return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T

    out = {"threads": threads, "bf16": {}}
    with torch.inference_mode():
        w = weights(torch.bfloat16)
        for n in tokens:
            x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
            out["bf16"][n] = best(lambda: expert(w, x))
        del w
        w = weights(torch.float32)
        x1, x64 = torch.randn(1, H, generator=gen), torch.randn(64, H, generator=gen)
        out["fp32_gemv"] = best(lambda: expert(w, x1))
        out["fp32_gemm64"] = best(lambda: expert(w, x64))
    return out


def decision_seconds(experts: int = 8, repeats: int = 200) -> float:
    """Seconds of the host work Fiddler does for each MoE layer before its experts run (its
    mixtral.py at efeslab/fiddler): a latency estimate per expert (tokens x latency_cpu on the
    CPU, latency_gpu to copy it in), then every one of the 2^E CPU/GPU assignments summed
    expert by expert in Python for the cheapest, and each expert's tokens found with
    torch.where and turned into lists. Written here to its shape, on CPU tensors: on a GPU
    each torch.where and tolist also waits for the device, which this leaves out."""
    import time

    import torch

    chosen = torch.tensor([[0, 2]])              # one token, two experts
    cost = np.zeros((experts, 2))

    def layer() -> int:
        mask = torch.nn.functional.one_hot(chosen, num_classes=experts).permute(2, 1, 0)
        for e in range(experts):
            idx, tokens = torch.where(mask[e])
            cost[e] = (tokens.shape[0] * 7, 70)
            tokens.tolist(), idx.tolist()
        best, best_cost = -1, float("inf")
        for config in range(1 << experts):
            total = 0.0
            for e in range(experts):
                total += cost[e, 0] if (config >> e) & 1 else cost[e, 1]
            if total < best_cost:
                best, best_cost = config, total
        return best

    layer()
    t0 = time.perf_counter()
    for _ in range(repeats):
        layer()
    return (time.perf_counter() - t0) / repeats


def fit(run: dict) -> dict:
    """The serial fit's bandwidth and FLOP rate, and their shares of the fp32 references."""
    expert_bytes_bf16, flops_token = 3 * H * H_I * 2, 2 * 3 * H * H_I
    points = sorted((int(n), s) for n, s in run["bf16"].items())
    multi = [(n, s) for n, s in points if n >= 2]
    a = np.array([[expert_bytes_bf16, n * flops_token] for n, _ in multi], dtype=float)
    inv_bw, inv_rate = np.linalg.lstsq(a, np.array([s for _, s in multi]), rcond=None)[0]
    fp32_bw = 2 * expert_bytes_bf16 / run["fp32_gemv"]
    fp32_rate = 64 * flops_token / run["fp32_gemm64"]
    one = dict(points)[1] if 1 in dict(points) else None
    return {
        "bf16_gbps": 1 / inv_bw / 1e9 if inv_bw > 0 else float("inf"),
        "bf16_gflops": 1 / inv_rate / 1e9 if inv_rate > 0 else float("inf"),
        "fp32_gemv_gbps": fp32_bw / 1e9, "fp32_gflops": fp32_rate / 1e9,
        "bytes_share": (1 / inv_bw) / fp32_bw if inv_bw > 0 else float("inf"),
        "flops_share": (1 / inv_rate) / fp32_rate if inv_rate > 0 else float("inf"),
        # one token, as Fiddler's decode runs each CPU expert: the bf16 expert's bytes a second
        "one_token_gbps": expert_bytes_bf16 / one / 1e9 if one else None,
        "one_token_share": expert_bytes_bf16 / one / fp32_bw if one else None,
        "worst_fit_error": float(max(abs(a[i] @ (inv_bw, inv_rate) / s - 1)
                                     for i, (_, s) in enumerate(multi))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default=None, help="comma-separated (default: 1 .. cores)")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        threads, tokens, repeats = args.child
        print(json.dumps(measure(int(threads), [int(t) for t in tokens.split(",")],
                                 int(repeats))))
        return
    cores = os.cpu_count() or 1
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else list(range(1, cores + 1)))
    results = []
    for isa, cap in ISAS.items():
        env = dict(os.environ)
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        if cap:
            env["ONEDNN_MAX_CPU_ISA"] = cap
        for t in threads:
            child = subprocess.run(
                [sys.executable, __file__, "--child", str(t), args.tokens, str(args.repeats)],
                env=env, capture_output=True, text=True, timeout=1800, check=True)
            run = json.loads(child.stdout)
            results.append({"isa": isa, **run, **fit(run)})
    decision = decision_seconds()
    if args.json:
        print(json.dumps({"runs": results, "decision_s": decision}, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="A Mixtral expert in bf16 PyTorch on this CPU, against fp32 on the "
                  "same cores (ms an expert; rates of the serial fit on 2-16 tokens)")
    for col in ("instruction set", "threads", *(f"{n} tok" for n in args.tokens.split(",")),
                "bf16 GB/s (x fp32 GEMV)", "bf16 GFLOP/s (x fp32 GEMM)", "1 token GB/s (x)",
                "fit max err"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["isa"], str(r["threads"]),
                      *(f"{r['bf16'][n] * 1e3:.1f}" for n in r["bf16"]),
                      f"{r['bf16_gbps']:.1f} ({r['bytes_share']:.2f})",
                      f"{r['bf16_gflops']:.1f} ({r['flops_share']:.2f})",
                      (f"{r['one_token_gbps']:.1f} ({r['one_token_share']:.2f})"
                       if r["one_token_gbps"] else "-"),
                      f"{r['worst_fit_error']:.0%}")
    Console().print(table)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown") if os.path.exists(
                    "/proc/cpuinfo") else "unknown"
    print(f"CPU: {cpu}, {cores} cores; fp32 references measured in each run "
          "(GEMV: one token; GEMM: 64 tokens).")
    print(f"Fiddler's host decision for one Mixtral layer (2^8 assignments in Python, each "
          f"expert's tokens found): {decision * 1e6:.0f} us")


if __name__ == "__main__":
    main()
