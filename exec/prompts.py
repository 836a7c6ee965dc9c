"""Real requests for `tg execute`: a JSONL file of prompts in, a JSONL file of tokens out.

An input line holds ``prompt_ids`` (token ids) or ``prompt`` (text, tokenized with the
checkpoint's ``tokenizer.json`` through the `tokenizers` library), an optional ``id`` and an
optional ``max_new_tokens``. An output line holds the request's ``id``, its ``prompt_ids``, the
generated ``output_ids`` and, with a tokenizer, their ``text``. Generation is greedy and stops
at a request's ``max_new_tokens`` or just after its first end-of-sequence token, as
transformers' ``generate`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError,
                      model_validator)

from taskgraph.errors import TgError
from taskgraph.files import atomic_path, plain_text, read_json, read_text


class _Line(BaseModel):
    # strict: JSON's true, 1e1 and "4" are not token ids or counts (one rule for numbers, as in
    # scenarios: taskgraph/specs.py:Numbers)
    model_config = ConfigDict(extra="forbid")

    id: StrictStr | StrictInt | None = None
    prompt: StrictStr | None = None
    prompt_ids: list[StrictInt] | None = None
    max_new_tokens: StrictInt | None = Field(default=None, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _one_prompt(self) -> "_Line":
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of prompt (text) and prompt_ids (token ids)")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids is empty")
        return self


@dataclass(frozen=True)
class Request:
    id: str | int
    prompt_ids: list[int]
    max_new_tokens: int


def load_tokenizer(folder: str | Path | None) -> Any | None:
    """The checkpoint's ``tokenizer.json`` as a `tokenizers.Tokenizer`, or None if it has none."""
    if folder is None:
        return None
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TgError(f"'{path}' needs the tokenizers library: pip install tokenizers.") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:      # noqa: BLE001 - the library raises plain Exceptions
        raise TgError(f"'{path}' is not a tokenizer file tokenizers can read ({err}).") from None


def read_prompts(path: str | Path, vocab: int, default_new_tokens: int,
                 tokenizer: Any | None = None, max_positions: int | None = None
                 ) -> list[Request]:
    """Requests from a JSONL file; every error names the line and the field. With
    `max_positions` (a checkpoint's max_position_embeddings), a prompt and its new tokens must
    fit in it."""
    path = Path(path)
    text = read_text(path, "prompts file")
    requests: list[Request] = []
    first_line: dict[str, int] = {}         # id -> the line that gave it
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path} line {number}"
        try:
            line = _Line.model_validate(json.loads(raw))
        except json.JSONDecodeError as err:
            raise TgError(f"{where} is not a JSON object: {err.msg}.") from None
        except ValidationError as err:       # (a ValueError too: it must come first)
            e = err.errors()[0]
            field = ".".join(str(p) for p in e["loc"]) or "the line"
            msg = e["msg"].removeprefix("Value error, ")
            raise TgError(f"{where}: {field}: {msg}. A line looks like "
                          '{"id": 1, "prompt_ids": [1, 415, 2936], "max_new_tokens": 16} or '
                          '{"prompt": "Hello", ...}.') from None
        except (ValueError, RecursionError):     # a 5,000-digit number, 10^5 nested arrays
            raise TgError(f"{where} is not a request (a number of more than 4,300 digits, or "
                          "nesting deeper than JSON can be read).") from None
        plain_text(line.id, f"{where}: id")        # execute lists the ids it ran
        if line.prompt is not None:
            if tokenizer is None:
                raise TgError(f"{where} gives prompt text, but the checkpoint has no "
                              "tokenizer.json (pass --weights DIR with one, or give prompt_ids).")
            ids = tokenizer.encode(line.prompt).ids
            if not ids:
                raise TgError(f"{where}: prompt tokenizes to no tokens.")
        else:
            ids = line.prompt_ids
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise TgError(f"{where}: prompt_ids holds {bad[0]}, outside the model's vocabulary "
                          f"(0 to {vocab - 1}).")
        new_tokens = line.max_new_tokens or default_new_tokens
        if max_positions is not None and len(ids) + new_tokens > max_positions:
            # past the positions it was trained on, a model's tokens are not its answer
            raise TgError(f"{where}: the prompt's {len(ids):,} tokens and {new_tokens:,} new "
                          f"tokens need {len(ids) + new_tokens:,} positions, more than the "
                          f"model's max_position_embeddings ({max_positions:,}); shorten the "
                          "prompt or lower max_new_tokens.")
        rid = line.id if line.id is not None else len(requests)
        if str(rid) in first_line:           # the output file is keyed by id
            raise TgError(f"{where}: id {str(rid)[:60]!r} was already given on line "
                          f"{first_line[str(rid)]}; each request needs its own id.")
        first_line[str(rid)] = number
        requests.append(Request(rid, ids, new_tokens))
    if not requests:
        raise TgError(f"The prompts file '{path}' holds no requests.")
    return requests


def trim(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Generated ids as `generate` returns them: at most max_new_tokens, ending at the first EOS."""
    out = tokens[:max_new_tokens]
    for i, t in enumerate(out):
        if t in eos:
            return out[:i + 1]
    return out


def eos_ids(folder: str | Path | None, vocab: int) -> set[int]:
    """End-of-sequence ids from the checkpoint's generation_config.json, else its config.json,
    each within the model's `vocab` tokens (one outside could never end a request: every
    request would run to its max_new_tokens, unnoticed)."""
    if folder is None:
        return set()
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if path.is_file():
            doc = read_json(path, "checkpoint's generation config")
            if not isinstance(doc, dict):
                raise TgError(f"'{path}' must hold a JSON object.")
            value = doc.get("eos_token_id")
            if value is not None:
                values = value if isinstance(value, list) else [value]
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                    raise TgError(f"'{path}': eos_token_id must be a token id or a list of "
                                  f"them, not {str(value)[:60]!r}.")
                bad = [v for v in values if not 0 <= v < vocab]
                if bad:
                    raise TgError(f"'{path}': eos_token_id holds {str(bad[0])[:60]}, outside "
                                  f"the model's vocabulary (0 to {vocab - 1}).")
                return set(values)
    return set()


def write_outputs(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """One JSON line per request, written whole or not at all."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, allow_nan=False) + "\n")
