"""Benchmark: the CPU executor against Hugging Face transformers, same shapes, same run.

A random Mixtral checkpoint with the scenario's shapes is written with ``save_pretrained``; then
transformers' greedy ``generate`` and ``tg execute`` (S1 unless --schedules says otherwise) run
the same prompts for the same number of tokens, alternately, `--repeats` times each. Both count
every generated token (prefill's first one included) over the time spent generating (loading
excluded: transformers' ``generate`` call, the executor's makespan). Printed: tokens/s, the ratio
to transformers' faster setting (torch's default threads, or one thread) measured in this run,
and whether the tokens are identical.

    python bench/cpu_vs_transformers.py [scenarios/small.yaml] [--mu 1,2,4] [--repeats 3]

Needs the test extra (transformers). Zero-copy is the CPU inference engine; the emulating mode
copies every weight page as a GPU machine would (what validation needs), so it is slower by the
cost of those copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from taskgraph.exec.execute import execute_scenario
from taskgraph.scenario import load_scenario
from taskgraph.dag.schedules import SCHEDULES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", nargs="?", default="scenarios/small.yaml")
    ap.add_argument("--mu", default=None, help="micro-batch sizes (default: N, N/2)")
    ap.add_argument("--schedules", default="S1,S4")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    m, N = sc.model, sc.policy.N
    P, G = sc.workload.context_prompt, sc.workload.gen_len
    mus = ([int(x) for x in args.mu.split(",")] if args.mu
           else [mu for mu in (N, N // 2) if mu >= 1 and N % mu == 0])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        cfg = MixtralConfig(hidden_size=m.h, intermediate_size=m.h_i, num_hidden_layers=m.L,
                            num_attention_heads=m.n_q, num_key_value_heads=m.n_kv,
                            head_dim=m.d, num_local_experts=m.E, num_experts_per_tok=m.k,
                            vocab_size=m.V, rope_theta=m.rope_theta,
                            rms_norm_eps=m.rms_norm_eps, max_position_embeddings=4096,
                            initializer_range=0.1, eos_token_id=None, bos_token_id=None,
                            pad_token_id=None)
        torch.manual_seed(0)
        MixtralForCausalLM(cfg).save_pretrained(folder)
        hf = MixtralForCausalLM.from_pretrained(folder).eval()
        prompts = torch.randint(3, m.V, (N, P), generator=torch.Generator().manual_seed(1))
        prompt_file = Path(tmp) / "prompts.jsonl"
        prompt_file.write_text("".join(json.dumps({"prompt_ids": row, "max_new_tokens": G + 1})
                                       + "\n" for row in prompts.tolist()))
        tokens = N * (G + 1)

        def hf_run(threads: int | None = None) -> tuple[float, list[list[int]]]:
            default = torch.get_num_threads()
            torch.set_num_threads(threads or default)
            try:
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    out = hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                      max_new_tokens=G + 1, min_new_tokens=G + 1,
                                      do_sample=False)
                    return time.perf_counter() - t0, out[:, P:].tolist()
            finally:
                torch.set_num_threads(default)

        def tg_run(schedule: str, mu: int, zero_copy: bool) -> tuple[float, list[list[int]]]:
            s = load_scenario(args.scenario, [f"schedule={schedule}", f"policy.mu={mu}"])
            ex = execute_scenario(s, device="cpu", weights_path=str(folder),
                                  prompts_path=str(prompt_file), zero_copy=zero_copy)
            return ex.summary["makespan_s"], [r["output_ids"] for r in ex.summary["outputs"]]

        hf_run()                                                    # warm-up
        configs = [(s, mu, zc) for s in args.schedules.split(",") for mu in mus
                   for zc in (True, False) if N // mu >= SCHEDULES[s].min_micro_batches]
        hf_times: list[float] = []
        hf_one: list[float] = []
        tg_times: dict[tuple, list[float]] = {c: [] for c in configs}
        same: dict[tuple, bool] = {}
        for _ in range(args.repeats):                  # interleaved: drift hits both alike
            t, hf_tokens = hf_run()
            hf_times.append(t)
            hf_one.append(hf_run(threads=1)[0])
            for c in configs:
                t, got = tg_run(*c)
                tg_times[c].append(t)
                same[c] = got == hf_tokens
        # The baseline is transformers' faster setting: its default threads lose to one
        # thread when anything else shares the cores.
        default_tps = tokens / statistics.median(hf_times)
        one = tokens / statistics.median(hf_one)
        hf_tps = max(default_tps, one)
        print(f"{args.scenario}: N={N}, prompt {P}, {G + 1} tokens generated per sequence, "
              f"{m.L} layers of h={m.h}, {m.E} experts of {m.h_i}; {torch.get_num_threads()} "
              f"torch threads; median of {args.repeats}")
        print(f"{'':28} {'tok/s':>8} {'vs transformers':>16} {'tokens':>10}")
        print(f"{'transformers generate':28} {default_tps:8.1f} {default_tps / hf_tps:16.2f}")
        print(f"{'  (on one thread)':28} {one:8.1f} {one / hf_tps:16.2f}")
        for (schedule, mu, zc), times in tg_times.items():
            tps = tokens / statistics.median(times)
            label = f"tg {schedule} mu={mu} {'zero-copy' if zc else 'emulating'}"
            print(f"{label:28} {tps:8.1f} {tps / hf_tps:16.2f} "
                  f"{'identical' if same[schedule, mu, zc] else 'DIFFER':>10}")


if __name__ == "__main__":
    main()
