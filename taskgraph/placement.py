"""Where EP keeps experts on the GPU, written as the tools people run write it
(docs/experts.md, "Placements"):

* ``experts_gpu: n``: each MoE layer's n most popular experts (tg's own form);
* ``experts_total: B``: B experts over all MoE layers, the most popular (layer, expert) pairs
  first: Fiddler's placement (about 56 of Mixtral's 256 on a 24 GB card, 1.75 a layer, which
  no count per layer can say);
* ``cpu_moe: N``: llama.cpp's ``--n-cpu-moe N``, the experts of layers 0 to N-1 on the CPU and
  every other layer's on the GPU;
* ``override_tensor: ["PATTERN=BUFFER", ...]``: llama.cpp's ``-ot``: the first pattern (a
  regular expression searched for in a GGUF tensor name) that matches a tensor puts it in
  BUFFER, ``CPU`` or ``CUDA0``; a tensor no pattern matches lies on the GPU (``-ngl 99``).

Every form comes to a count of experts on the GPU for each layer. Which experts they are is the
routing's (:meth:`taskgraph.dag.routing.Routing.held`): the most popular. llama.cpp keeps a
layer's experts in one tensor, so it places them whole: :func:`llama_cpp_options` writes the
options that run a placement of whole layers, and says why where there are none.

Imports nothing of tg's: the scenario's checks and the routing both read it.
"""

from __future__ import annotations

import re
from typing import Any

#: A layer's three expert tensors, as llama.cpp's GGUF files name them.
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
#: Where -ot may put a tensor: the host, or the one GPU tg's expert-level schedules run on.
BUFFERS = ("CPU", "CUDA0")


def gguf_names(model: Any) -> list[str]:
    """Every tensor name of the model's GGUF file as llama.cpp writes it (what -ot patterns
    are matched against)."""
    attention = (("attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv_a_mqa", "attn_kv_a_norm",
                  "attn_kv_b") if model.attention == "mla" else ("attn_q", "attn_k", "attn_v"))
    names = ["token_embd.weight", "output_norm.weight"]
    if not model.tie_word_embeddings:
        names.append("output.weight")
    for layer in range(model.L):
        ffn = (("ffn_gate", "ffn_up", "ffn_down") if model.is_dense(layer) else
               ("ffn_gate_inp", *EXPERT_TENSORS,
                *(("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
                  if model.shared_experts else ())))
        names += [f"blk.{layer}.{t}.weight"
                  for t in ("attn_norm", *attention, "attn_output", "ffn_norm", *ffn)]
    return names


def parse_overrides(patterns, field: str = "policy.override_tensor"
                    ) -> list[tuple[re.Pattern, str]]:
    """-ot's PATTERN=BUFFER pairs, each checked (ValueError naming the one at fault, as
    `field`[i])."""
    out = []
    for i, text in enumerate(patterns):
        where = f"{field}[{i}] ({text!r})"
        pattern, sep, buffer = text.rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"{where} must be PATTERN=BUFFER, as llama.cpp's -ot takes it "
                             r"(for example 'blk\.(1[0-9])\.ffn_.*_exps=CPU')")
        if buffer not in BUFFERS:
            raise ValueError(f"{where} puts tensors in {buffer!r}; tg's expert-level schedules "
                             f"run on one GPU: the buffer must be one of {', '.join(BUFFERS)}")
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where} is not a regular expression: {e}") from None
        if _nested_repeat(pattern):
            raise ValueError(f"{where} repeats a repeat, or alternatives that begin alike "
                             "(such as '(a+)+', '(a|aa)*'), which Python's regular "
                             "expressions can take hours to match; write it without the nesting (llama.cpp's own are like 'blk\\.[0-9]+\\.ffn_.*_exps')")
        out.append((compiled, buffer))
    return out


def _nested_repeat(pattern: str) -> bool:
    """Whether a repeated part of `pattern` holds a repeat itself ('(a+)+', '(a*b?)*') or an
    alternation whose branches can begin alike ('(a|a)*', '(a|aa)*', '(blk|b)+'): the shapes
    whose backtracking grows exponentially with the name's length ('(a|a)*b' takes 2.6 s on 24
    characters, twice as long for each one more). Read from the parse tree Python's own
    compiler builds (re._parser, the module sre_parse was)."""
    from re import _parser       # Python's own parser of the patterns matched here

    repeats = {_parser.MAX_REPEAT, _parser.MIN_REPEAT, getattr(_parser, "POSSESSIVE_REPEAT", None)}

    def walk(items, inside: bool) -> bool:
        for op, arg in items:
            if op in repeats:
                low, high, sub = arg
                if inside and high > 1:
                    return True
                if walk(sub, inside or high > 1):
                    return True
            elif op in (_parser.SUBPATTERN,):
                if walk(arg[-1], inside):
                    return True
            elif op is _parser.BRANCH:
                if inside and _branches_overlap(arg[1], _parser):
                    return True
                if any(walk(branch, inside) for branch in arg[1]):
                    return True
            elif op in (_parser.ASSERT, _parser.ASSERT_NOT):
                if walk(arg[1], inside):
                    return True
        return False

    return walk(_parser.parse(pattern), False)


def _branches_overlap(branches, parser) -> bool:
    """Whether two branches of an alternation may start with the same character (an empty
    branch, or one whose start is not a plain set of characters, may start with any)."""
    seen: set[int] = set()
    for branch in branches:
        first = _first_characters(branch, parser)
        if first is None or first & seen:
            return True
        seen |= first
    return False


def _first_characters(items, parser, limit: int = 1024) -> set[int] | None:
    """The characters a sequence of parsed items can start with, or None for any (or for more
    than `limit` of them: a conservative answer)."""
    if not items:
        return None
    op, arg = items[0]
    if op is parser.LITERAL:
        return {arg}
    if op is parser.SUBPATTERN:
        return _first_characters(list(arg[-1]) + list(items[1:]), parser, limit)
    if op in (parser.MAX_REPEAT, parser.MIN_REPEAT) and arg[0] > 0:
        return _first_characters(arg[2], parser, limit)
    if op is parser.IN:
        out: set[int] = set()
        for member, value in arg:
            if member is parser.LITERAL:
                out.add(value)
            elif member is parser.RANGE and value[1] - value[0] < limit:
                out.update(range(value[0], value[1] + 1))
            else:                       # a negation, a category (\w, \d): any, to be safe
                return None
        return out if len(out) <= limit else None
    return None


def cpu_layers_of_overrides(patterns, model: Any) -> frozenset[int]:
    """The layers whose experts -ot puts on the CPU. ValueError where a pattern matches no
    tensor of the model, puts a tensor other than the experts on the CPU (tg's EP keeps
    attention and the rest of a layer on the GPU), or splits a layer's three expert tensors."""
    rules = parse_overrides(patterns)
    names = gguf_names(model)
    # a pattern that matches only what an earlier one placed is no mistake (llama.cpp takes it)
    used = [any(pattern.search(name) for name in names) for pattern, _ in rules]
    on_cpu: dict[int, set[str]] = {}
    for name in names:
        for i, (pattern, buffer) in enumerate(rules):
            if not pattern.search(name):
                continue
            if buffer == "CPU":
                parts = name.split(".")
                if len(parts) < 3 or parts[2] not in EXPERT_TENSORS:
                    raise ValueError(
                        f"policy.override_tensor[{i}] ({patterns[i]!r}) puts {name} on the CPU; "
                        "tg's EP runs everything but the routed experts on the GPU, so a "
                        "pattern may send only *_exps tensors to the CPU")
                on_cpu.setdefault(int(parts[1]), set()).add(parts[2])
            break
    for i, hit in enumerate(used):
        if not hit:
            raise ValueError(f"policy.override_tensor[{i}] ({patterns[i]!r}) matches no tensor "
                             f"of {model.name} (its expert tensors are named like "
                             f"blk.{_first_moe_layer(model)}.ffn_up_exps.weight)")
    for layer, parts in sorted(on_cpu.items()):
        if len(parts) != len(EXPERT_TENSORS):
            rest = sorted(set(EXPERT_TENSORS) - parts)
            raise ValueError(f"policy.override_tensor puts {', '.join(sorted(parts))} of layer "
                             f"{layer} on the CPU but not {', '.join(rest)}; tg places a layer's "
                             "experts whole (each expert runs where its weights lie)")
    return frozenset(on_cpu)


def _first_moe_layer(model: Any) -> int:
    return next(l for l in range(model.L) if not model.is_dense(l))


def counts(policy: Any, model: Any) -> list[int] | None:
    """Experts on the GPU in each layer (none on a dense one), where the policy fixes them:
    ``experts_gpu``, ``cpu_moe``, ``override_tensor``. None for ``experts_total``, which the
    routing spreads (:meth:`taskgraph.dag.routing.Routing.held`)."""
    if policy.experts_total is not None:
        return None
    if policy.cpu_moe is not None:
        cpu = frozenset(range(policy.cpu_moe))
    elif policy.override_tensor is not None:
        cpu = cpu_layers_of_overrides(policy.override_tensor, model)
    else:
        return [0 if model.is_dense(l) else min(policy.experts_gpu, model.E)
                for l in range(model.L)]
    return [0 if model.is_dense(l) or l in cpu else model.E for l in range(model.L)]


def total_on_gpu(policy: Any, model: Any) -> int:
    """Experts the GPU holds over all layers (what the memory model counts)."""
    if policy.experts_total is not None:
        return min(policy.experts_total, model.E * model.moe_layers)
    return sum(counts(policy, model))


def given(policy: Any) -> str | None:
    """The placement field the policy sets other than experts_gpu, if any."""
    return next((f for f in ("experts_total", "cpu_moe", "override_tensor")
                 if getattr(policy, f) is not None), None)


def llama_cpp_options(per_layer: list[int], model: Any) -> tuple[str | None, str]:
    """llama.cpp's options for a placement of `per_layer` experts on the GPU (a count per
    layer), and what they are or why there are none: llama.cpp places each layer's experts
    whole (one tensor a layer), as ``--n-cpu-moe N`` (layers 0 to N-1 on the CPU), ``-ot``
    (any set of layers) or ``--cpu-moe`` (every layer)."""
    moe = [l for l in range(model.L) if not model.is_dense(l)]
    partial = [l for l in moe if 0 < per_layer[l] < model.E]
    if partial:
        return None, (f"llama.cpp places a layer's experts whole, and this placement splits "
                      f"{len(partial)} of {len(moe)} layers")
    cpu = [l for l in moe if per_layer[l] == 0]
    if not cpu:
        return "-ngl 99", "every layer's experts on the GPU"
    if len(cpu) == len(moe):
        return "-ngl 99 --cpu-moe", "every expert on the CPU"
    first_n = max(cpu) + 1
    if cpu == [l for l in moe if l < first_n]:
        return (f"-ngl 99 --n-cpu-moe {first_n}",
                f"the experts of layers 0-{first_n - 1} on the CPU")
    layers = "|".join(str(l) for l in cpu)
    return (f"-ngl 99 -ot 'blk\\.({layers})\\.ffn_(gate|up|down)_exps\\.weight=CPU'",
            f"the experts of {len(cpu)} layers on the CPU")
