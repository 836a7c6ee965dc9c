"""Many short prompts through `tg execute --prompts` against transformers' `generate` on the same
random checkpoint, in the same run: prompts per second and peak RSS of each, at each count.

    python bench/many_prompts.py [--counts 200,2000] [--batch 8] [--new-tokens 4]

tg runs the prompts policy.N (--batch) at a time through the schedule's micro-batches, checking
every batch against its reference forward; transformers generates the same prompts greedily,
left-padded, --batch at a time. Each side runs in a process of its own, so each peak RSS is its
own (the checkpoint is generated first, in a temporary folder, as in the tests).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HF = r"""
import json, resource, sys, time, torch
from transformers import MixtralForCausalLM
folder, prompts, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(prompts)]
model = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
t0 = time.perf_counter()
with torch.no_grad():
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        width = max(len(r["prompt_ids"]) for r in chunk)
        ids = torch.tensor([[0] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in chunk])
        mask = torch.tensor([[0] * (width - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"])
                             for r in chunk])
        model.generate(ids, attention_mask=mask, max_new_tokens=chunk[0]["max_new_tokens"],
                       do_sample=False, pad_token_id=0)
print(json.dumps({"s": time.perf_counter() - t0,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _peak_mb(cmd: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (MB) of the command's process, its stdout."""
    t0 = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{cmd[:4]} failed:\n{out.stderr[-2000:]}")
    return time.perf_counter() - t0, int(out.stderr.strip().splitlines()[-1]) / 1024, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="200,2000")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        subprocess.run([sys.executable, "bench/make_checkpoint.py", str(ckpt)], check=True,
                       capture_output=True)
        scenario = Path(tmp) / "s.yaml"
        scenario.write_text(f"model: {{hf_config: {ckpt}/config.json}}\nhardware: t4\n"
                            "workload: {prompt_len: 8, gen_len: 2}\n"
                            f"policy: {{N: {args.batch}, mu: 2}}\n")
        print(f"{'prompts':>8} {'tg prompts/s':>13} {'tg peak MB':>11} {'tg wall s':>10} "
              f"{'hf prompts/s':>13} {'hf peak MB':>11}  tokens")
        for count in (int(c) for c in args.counts.split(",")):
            rng = random.Random(count)
            prompts, out = Path(tmp) / f"p{count}.jsonl", Path(tmp) / f"o{count}.jsonl"
            prompts.write_text("".join(json.dumps(
                {"id": i, "prompt_ids": [rng.randrange(3, 47) for _ in range(rng.randint(3, 8))],
                 "max_new_tokens": args.new_tokens}) + "\n" for i in range(count)))
            wall, tg_mb, text = _peak_mb(["tg", "execute", str(scenario), "--weights", str(ckpt),
                                          "--device", "cpu", "--prompts", str(prompts), "--out",
                                          str(out), "--json"])
            summary = json.loads(text)
            _, hf_mb, text = _peak_mb([sys.executable, "-c", HF, str(ckpt), str(prompts),
                                       str(args.batch)])
            hf = json.loads(text)
            tg_s = summary["wall_s"]
            print(f"{count:>8} {count / tg_s:>13.1f} {tg_mb:>11.0f} {wall:>10.1f} "
                  f"{count / hf['s']:>13.1f} {hf_mb:>11.0f}  "
                  f"{'identical to reference' if summary['tokens_match'] else 'DIFFER'}",
                  flush=True)


if __name__ == "__main__":
    main()
