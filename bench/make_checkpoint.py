"""Write a random Mixtral checkpoint as Hugging Face writes one (config.json, sharded
safetensors with an index, tokenizer.json), for trying `tg execute --weights` where no model hub
is reachable. Needs transformers and tokenizers (the test extra).

    python bench/make_checkpoint.py ckpt/ [--layers 4] [--hidden 256] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import MixtralConfig, MixtralForCausalLM

WORDS = ("the a of to and in is it that for on with as was at by an be this from or are "
         "model expert token layer weight cache batch link host device stream page copy "
         "attention router prefill decode schedule memory bandwidth offload mixture").split()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    cfg = MixtralConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=8,
                        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        vocab_size=len(vocab), max_position_embeddings=4096,
                        initializer_range=0.1)
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).to(getattr(torch, args.dtype)).save_pretrained(
        args.out, max_shard_size="2MB")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(f"{args.out}/tokenizer.json")
    print(f"wrote {args.out}: {args.layers} layers, h={args.hidden}, {args.dtype}")


if __name__ == "__main__":
    main()
