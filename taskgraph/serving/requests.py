"""Requests and how they are batched.

A workload may be a list of requests, each with its own prompt and generation length: read from
a file (CSV or JSONL with ``prompt_len``, ``gen_len`` and an optional ``id``) or generated to
match a dataset's mean and maximum lengths. :func:`pack` turns the list into batches of
micro-batches, either with MoE-Lightning's Algorithm 2 (unpadded: longest prompts first, each
into the micro-batch holding the fewest tokens, none past its cache limit) or in arrival order
with every prompt padded to the longest, as FlexGen runs. :func:`refill` runs the list as one
continuous batch instead: a request's slot goes to the next one in the queue when it finishes.

This module is plain data in, plain data out; nothing here simulates.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from taskgraph.errors import TgError
from taskgraph.files import atomic_path, csv_row, plain_text, read_text
from taskgraph.output.report import Shown, batch_table
from taskgraph.specs import MAX_REQUESTS

#: Lengths beyond any model's context: a file that holds them is a mistake, not a workload.
_MAX_LEN = 10_000_000


@dataclass(frozen=True)
class Request:
    id: str
    prompt_len: int
    gen_len: int

    @property
    def tokens(self) -> int:
        """KV cache tokens the request holds when it finishes."""
        return self.prompt_len + self.gen_len


# --- request lists ----------------------------------------------------------------------------

def read_requests(path: str | Path) -> list[Request]:
    """Requests from a CSV (header row with prompt_len, gen_len, optional id) or JSONL file (one
    object a line with the same fields). Ids default to the line number; every bad line is an
    error naming the file, the line and the field."""
    path = Path(path)
    text = read_text(path, "request file")
    jsonl = path.suffix == ".jsonl"
    rows = _jsonl_rows(path, text) if jsonl else _csv_rows(path, text)
    requests = []
    for line, row in rows:
        if len(requests) == MAX_REQUESTS:
            raise TgError(f"Request file '{path}' holds more than {MAX_REQUESTS:,} requests; tg "
                          f"runs at most {MAX_REQUESTS:,} in a list (split it).")
        requests.append(_request(path, line, row, text_is_number=not jsonl))
    if not requests:
        raise TgError(f"Request file '{path}' holds no requests; give one per line with "
                      "prompt_len and gen_len.")
    seen: set[str] = set()
    for line, r in enumerate(requests, 1):
        if r.id in seen:
            raise TgError(f"Request file '{path}': id '{_short_id(r.id)}' is given twice (the "
                          f"second time on data line {line}).")
        seen.add(r.id)
    return requests


def _csv_rows(path: Path, text: str) -> Iterable[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(text.splitlines())
    missing = {"prompt_len", "gen_len"} - set(reader.fieldnames or ())
    if reader.fieldnames and missing:
        names = reader.fieldnames
        # Echo the columns only when they look like column names: whatever file was named
        # (a password file, a 300,000-column row) is not repeated on the terminal.
        has = (f" (it has {', '.join(names)})" if len(names) <= 20 and all(
            re.fullmatch(r"[\w .-]{1,40}", n or "") for n in names)
            else " (its first row is not a list of column names)")
        raise TgError(f"Request file '{path}': the header row lacks "
                      f"{', '.join(sorted(missing))}{has}; a request list starts with a row "
                      "like id,prompt_len,gen_len.")
    line = 1
    try:
        for line, row in enumerate(reader, start=2):
            yield line, row
    except csv.Error as err:       # a field past csv's 131,072-character limit, a stray NUL
        raise TgError(f"Request file '{path}', line {line + 1}: not a CSV row tg reads "
                      f"({str(err)[:120]}); a request is id,prompt_len,gen_len.") from None


def _jsonl_rows(path: Path, text: str) -> Iterable[tuple[int, dict[str, Any]]]:
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise TgError(f"Request file '{path}', line {i}: not JSON ({err.msg}).") from None
        except (ValueError, RecursionError):     # a 5,000-digit number, 10^5 nested arrays
            raise TgError(f"Request file '{path}', line {i}: not a request (a number of more "
                          "than 4,300 digits, or nesting deeper than JSON can be read).") from None
        if not isinstance(row, dict):
            raise TgError(f"Request file '{path}', line {i}: expected an object with "
                          "prompt_len and gen_len.")
        yield i, row


def _request(path: Path, line: int, row: dict[str, Any], text_is_number: bool) -> Request:
    lengths = []
    for name in ("prompt_len", "gen_len"):
        value = row.get(name)
        number = _whole(value, text_is_number)
        if number is None or not 0 < number <= _MAX_LEN:
            shown = repr(value)[:40]
            raise TgError(f"Request file '{path}', line {line}: {name} must be a whole number "
                          f"from 1 to {_MAX_LEN:,}, not {shown}.")
        lengths.append(number)
    rid = row.get("id")
    plain_text(rid, f"Request file '{path}', line {line}: id")
    return Request(str(rid) if rid not in (None, "") else str(line), *lengths)


def _short_id(rid: str, limit: int = 60) -> str:
    return rid if len(rid) <= limit else rid[:limit] + f"... ({len(rid):,} characters)"


def _whole(value: Any, text_is_number: bool) -> int | None:
    """A whole number from JSON (int, or a float like 12.0) or, where every value is text (a
    CSV cell), decimal digits; None otherwise. A number in quotes in JSON is text, as in every
    file tg reads, and Python's int() would take "5_000" and Arabic-Indic digits."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and text_is_number and _DECIMAL.fullmatch(value.strip()):
        return int(value)
    return None


# at most 18 digits: a longer number is past every limit (and int() refuses 4,300 digits)
_DECIMAL = re.compile(r"[0-9]{1,18}")


def generate_requests(count: int, prompt_mean: float, prompt_max: int, gen_mean: float,
                      gen_max: int, seed: int = 0) -> list[Request]:
    """`count` requests whose prompt and generation lengths are log-normal with the given mean
    and maximum: the spread is the one for which `max` is the expected largest of `count` draws,
    draws are capped at `max`, the largest set to it, and the rest scaled to the mean."""
    rng = np.random.default_rng(seed)
    prompts = _lengths(rng, count, prompt_mean, prompt_max)
    gens = _lengths(rng, count, gen_mean, gen_max)
    return [Request(str(i), int(p), int(g)) for i, (p, g) in enumerate(zip(prompts, gens))]


def _lengths(rng: np.random.Generator, count: int, mean: float, top: int) -> np.ndarray:
    if count == 1 or top <= mean:
        return np.full(count, max(1, round(min(mean, top))), dtype=np.int64)
    from scipy.stats import norm

    z = float(norm.ppf(1 - 1 / count)) if count > 1 else 0.0
    ratio = math.log(top / mean)
    sigma = z - math.sqrt(z * z - 2 * ratio) if z * z > 2 * ratio else z
    x = rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, count)
    x = np.clip(x, 1, top)
    x[np.argmax(x)] = top
    rest = np.ones(count, dtype=bool)
    rest[np.argmax(x)] = False
    for _ in range(20):            # scaling then capping moves the mean; a few rounds settle it
        want = mean * count - top
        have = x[rest].sum()
        if have <= 0 or abs(have - want) < 0.5:
            break
        x[rest] = np.clip(x[rest] * want / have, 1, top)
    return np.maximum(1, np.rint(x)).astype(np.int64)


def summary(requests: list[Request]) -> dict[str, float]:
    """Mean and maximum of the lengths: what the mean-length model (and the search) runs on."""
    prompts = [r.prompt_len for r in requests]
    gens = [r.gen_len for r in requests]
    return {"count": len(requests), "prompt_mean": statistics.fmean(prompts),
            "prompt_max": max(prompts), "gen_mean": statistics.fmean(gens), "gen_max": max(gens)}


# --- batching ---------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """Requests that run together, with their prompt tokens and the KV cache tokens they hold
    once every one of them has finished generating."""

    requests: list[Request] = field(default_factory=list)
    prompt_tokens: int = 0
    tokens: int = 0

    def add(self, r: Request, prompt_len: int | None = None) -> None:
        """Add `r`, its prompt counted at `prompt_len` (padding) if given."""
        p = r.prompt_len if prompt_len is None else prompt_len
        self.requests.append(r)
        self.prompt_tokens += p
        self.tokens += p + r.gen_len


@dataclass
class Packing:
    """Batches (each a list of micro-batches) in the order they run, and the requests no
    micro-batch can hold even alone."""

    batches: list[list[MicroBatch]]
    aborted: list[Request]
    cache_tokens: int
    padded: bool

    def to_json(self) -> dict[str, Any]:
        sizes = [len(mb.requests) for b in self.batches for mb in b]
        prompt = [mb.prompt_tokens for b in self.batches for mb in b]
        return {"batches": len(self.batches), "micro_batches": len(sizes),
                "requests": sum(sizes), "cache_tokens": self.cache_tokens,
                "padded": self.padded,
                "micro_batch_prompt_tokens": {"min": min(prompt, default=0),
                                              "max": max(prompt, default=0)},
                "aborted": [{"id": r.id, "prompt_len": r.prompt_len, "gen_len": r.gen_len}
                            for r in self.aborted]}


@dataclass
class Batching(Shown):
    """How a scenario's request list is packed (`tg batch`); `to_dict()` is its --json."""

    scenario: Any
    packing: Packing

    def to_dict(self) -> dict[str, Any]:
        return self.packing.to_json()

    def views(self):
        yield batch_table(self.scenario, self.packing)

    def write_csv(self, path: str | Path) -> None:
        """Each request's batch and micro-batch ('aborted' for those none can hold)."""
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["id", "prompt_len", "gen_len", "batch", "micro_batch"])
            for b, batch in enumerate(self.packing.batches):
                for j, mb in enumerate(batch):
                    out.writerows(csv_row([r.id, r.prompt_len, r.gen_len, b, j])
                                  for r in mb.requests)
            out.writerows(csv_row([r.id, r.prompt_len, r.gen_len, "aborted", ""])
                          for r in self.packing.aborted)


def algorithm2(queue: list[Request], ubs: int, n_ub: int, cache_tokens: int
               ) -> tuple[list[MicroBatch], list[Request]]:
    """One batch by MoE-Lightning's Algorithm 2: requests longest prompt first, each into the
    open micro-batch holding the fewest prompt tokens; a request that would take that
    micro-batch past `cache_tokens` (prompts plus generated tokens of everything in it), or that
    finds every micro-batch full (`ubs` requests), waits for the next batch. Returns the batch
    and the requests carried over, in their original order."""
    open_ = [MicroBatch() for _ in range(n_ub)]
    full: list[MicroBatch] = []
    placed: set[int] = set()
    for i in sorted(range(len(queue)), key=lambda i: -queue[i].prompt_len):   # stable
        if not open_:
            break
        r = queue[i]
        target = min(open_, key=lambda mb: mb.prompt_tokens)
        if target.tokens + r.tokens > cache_tokens:
            continue
        target.add(r)
        placed.add(i)
        if len(target.requests) == ubs:
            open_.remove(target)
            full.append(target)
    batch = [mb for mb in full + open_ if mb.requests]
    return batch, [r for i, r in enumerate(queue) if i not in placed]


def pack(requests: list[Request], ubs: int, n_ub: int, cache_tokens: int,
         padded: bool = False) -> Packing:
    """The whole queue as consecutive batches of at most `n_ub` micro-batches of `ubs`
    requests. Unpadded: Algorithm 2 per batch, carrying over what it rejects. Padded (FlexGen):
    arrival order, every prompt counted at the longest one's length. Requests that do not fit
    a micro-batch's cache even alone are aborted, never dropped silently."""
    if padded:
        longest = max(r.prompt_len for r in requests)
        aborted = [r for r in requests if longest + r.gen_len > cache_tokens]
        mbs = [MicroBatch()]
        for r in requests:
            if longest + r.gen_len > cache_tokens:
                continue
            mb = mbs[-1]
            if len(mb.requests) == ubs or mb.tokens + longest + r.gen_len > cache_tokens:
                mb = MicroBatch()
                mbs.append(mb)
            mb.add(r, prompt_len=longest)
        mbs = [mb for mb in mbs if mb.requests]
        return Packing([mbs[i:i + n_ub] for i in range(0, len(mbs), n_ub)], aborted,
                       cache_tokens, True)
    aborted = [r for r in requests if r.tokens > cache_tokens]
    queue = [r for r in requests if r.tokens <= cache_tokens]
    return Packing(_algorithm2_batches(queue, ubs, n_ub, cache_tokens), aborted, cache_tokens,
                   False)


_BLOCK = 1024       # requests per block of _algorithm2_batches' scan


def _algorithm2_batches(queue: list[Request], ubs: int, n_ub: int, cache_tokens: int
                        ) -> list[list[MicroBatch]]:
    """:func:`algorithm2` batch after batch until the queue is empty, the same batches in
    O(n log n) rather than a sort and a walk of the whole queue per batch. What a batch carries
    over keeps its order, so the queue is sorted once (longest prompt first, stable); placed
    requests are skipped through a "next unplaced" forest; and where a request does not fit the
    target micro-batch (which stays the target until something is placed), the next that does is
    found by a scan of blocks: the rest of this block, then the first later block whose least
    unplaced request fits (the blocks' minima kept as requests are placed), then within it. A
    whole-queue scan each time took minutes for a million requests in small micro-batches."""
    reqs = sorted(queue, key=lambda r: -r.prompt_len)                     # stable
    n = len(reqs)
    blocks = max(1, -(-n // _BLOCK))
    tokens = np.full(blocks * _BLOCK, np.inf)                           # placed: inf
    tokens[:n] = [r.tokens for r in reqs]
    least = tokens.reshape(blocks, _BLOCK).min(axis=1)      # each block's least unplaced
    nxt = list(range(n + 1))

    def first_fit(i: int, room: float) -> int:      # the first index >= i that fits (n: none)
        b = i // _BLOCK
        hit = np.flatnonzero(tokens[i:(b + 1) * _BLOCK] <= room)
        if hit.size:
            return i + int(hit[0])
        later = np.flatnonzero(least[b + 1:] <= room)
        if not later.size:
            return n
        start = (b + 1 + int(later[0])) * _BLOCK
        return start + int(np.flatnonzero(tokens[start:start + _BLOCK] <= room)[0])

    def place(i: int) -> None:
        b, was = i // _BLOCK, tokens[i]
        tokens[i] = np.inf
        if was == least[b]:
            least[b] = tokens[b * _BLOCK:(b + 1) * _BLOCK].min()

    def unplaced(i: int) -> int:            # the first unplaced index >= i (n: none)
        while nxt[i] != i:
            nxt[i] = nxt[nxt[i]]
            i = nxt[i]
        return i

    batches, left = [], n
    while left:
        mbs = [MicroBatch() for _ in range(n_ub)]
        heap = [(0, k) for k in range(n_ub)]       # open micro-batches: (prompt tokens, order)
        full: list[MicroBatch] = []
        i = unplaced(0)
        while heap and i < n:
            target = mbs[heap[0][1]]
            room = cache_tokens - target.tokens
            if tokens[i] > room:
                i = first_fit(i, room)
                if i == n:
                    break
            target.add(reqs[i])
            place(i)
            nxt[i] = i + 1
            left -= 1
            if len(target.requests) == ubs:
                full.append(mbs[heapq.heappop(heap)[1]])
            else:
                heapq.heapreplace(heap, (target.prompt_tokens, heap[0][1]))
            i = unplaced(i + 1)
        batches.append([mb for mb in full + [mbs[k] for k in sorted(k for _, k in heap)]
                        if mb.requests])
    return batches


def batching(scenario) -> Batching:
    """`tg batch`: the scenario's request list packed into consecutive batches."""
    if scenario.workload.refill:
        raise TgError("tg batch shows consecutive batches; with workload.refill the list runs "
                      "as one continuous batch: tg simulate --csv FILE lists each request's "
                      "micro-batch and the step that prefilled it.")
    return Batching(scenario, pack_scenario(scenario))


def pack_scenario(scenario) -> Packing:
    """The scenario's request list packed for its policy: batches of N/mu micro-batches of at
    most mu requests, each micro-batch's cache the tokens the policy budgets for it at the mean
    lengths (what the memory check passed: mu x (prompt + generated))."""
    if scenario.requests is None:
        raise TgError("This scenario has no request list; give workload.requests (a CSV or "
                      "JSONL file) or workload.lengths (generated).")
    p, w = scenario.policy, scenario.workload
    return pack(scenario.requests, p.mu, p.n_micro, p.mu * (w.context_prompt + w.gen_len),
                padded=w.padded)


@dataclass(frozen=True)
class BatchLoad:
    """One batch's requests by micro-batch, as the cost model prices them: each request's prompt
    length (as counted: the longest one's when padded) and how many decode steps it takes part
    in (its generation length; every request the batch's longest when padded, as FlexGen runs
    them). Micro-batches past the requests' (kept for a schedule's minimum count) are empty."""

    prompts: tuple[tuple[int, ...], ...]
    gens: tuple[tuple[int, ...], ...]
    continuation = False            # a batch starts with its own prefill (see StepLoad.window)

    @classmethod
    def of(cls, batch: list[MicroBatch], n_micro: int, padded_to: int | None = None,
           gen_to: int | None = None) -> "BatchLoad":
        prompts = [tuple(padded_to or r.prompt_len for r in mb.requests) for mb in batch]
        gens = [tuple(gen_to or r.gen_len for r in mb.requests) for mb in batch]
        empty = [()] * (n_micro - len(batch))
        return cls(tuple(prompts + empty), tuple(gens + empty))

    def tables(self, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """As :class:`StepLoad` gives them: prompts are prefilled at step 0 only."""
        n = len(self.prompts)
        d = np.arange(steps + 1)
        seqs = np.zeros((n, steps + 1))
        ctx = np.zeros((n, steps + 1))
        for j, (ps, gs) in enumerate(zip(self.prompts, self.gens)):
            if not ps:
                continue
            p, g = np.array(ps, dtype=float), np.array(gs)
            active = (g[:, None] >= d[None, :]) | (d[None, :] == 0)         # [requests, steps]
            seqs[j] = active.sum(0)
            ctx[j] = (active * (p[:, None] + d[None, :])).sum(0)
        ptok = np.zeros((n, steps + 1))
        psq = np.zeros((n, steps + 1))
        ptok[:, 0] = [float(sum(ps)) for ps in self.prompts]
        psq[:, 0] = [float(sum(x * x for x in ps)) for ps in self.prompts]
        return seqs, ctx, ptok, psq


# --- continuous batching ------------------------------------------------------------------------

@dataclass(frozen=True)
class Admission:
    """A request in a continuous batch: its micro-batch, and the step whose tasks prefill its
    prompt (0: the first prefill; later: mixed into that decode step's tasks). It then takes
    part in decode steps ``step + 1`` to ``step + gen_len`` and leaves."""

    request: Request
    micro_batch: int
    step: int

    @property
    def last_step(self) -> int:
        return self.step + self.request.gen_len


@dataclass(frozen=True)
class Refill:
    """A queue run as one continuous batch (MoE-Lens's refill): every micro-batch keeps its
    slots full, each request admitted as soon as one frees."""

    admissions: tuple[Admission, ...]
    aborted: tuple[Request, ...]
    n_micro: int
    cache_tokens: int

    @property
    def steps(self) -> int:
        """Decode steps until the last request finishes."""
        return max(a.last_step for a in self.admissions)

    def load(self, n_micro: int | None = None) -> "StepLoad":
        """The batch's load per micro-batch and step; `n_micro` rows (at least the batch's own:
        a schedule may need more micro-batches than the policy fills, which stay empty)."""
        n, steps = max(n_micro or 0, self.n_micro), self.steps
        seqs = np.zeros((n, steps + 2))       # difference arrays over steps, then summed
        held = np.zeros((n, steps + 2))       # sum over decoding requests of (prompt - admitted)
        ptok = np.zeros((n, steps + 1))
        psq = np.zeros((n, steps + 1))
        for a in self.admissions:
            p, j, d = a.request.prompt_len, a.micro_batch, a.step
            seqs[j, d + 1] += 1
            seqs[j, a.last_step + 1] -= 1
            held[j, d + 1] += p - d
            held[j, a.last_step + 1] -= p - d
            ptok[j, d] += p
            psq[j, d] += p * p
        seqs = np.cumsum(seqs, axis=1)[:, :steps + 1]
        seqs[:, 0] = [sum(1 for a in self.admissions if a.step == 0 and a.micro_batch == j)
                      for j in range(n)]           # step 0 prefills the first requests
        # a request admitted at step a holds prompt + (d - a) tokens at decode step d
        ctx = np.cumsum(held, axis=1)[:, :steps + 1] + seqs * np.arange(steps + 1)
        return StepLoad(seqs, ctx, ptok, psq)


def refill(requests: list[Request], ubs: int, n_ub: int, cache_tokens: int) -> Refill:
    """The queue in arrival order as one continuous batch of `n_ub` micro-batches of at most
    `ubs` requests. Before each step, the requests that finished leave and the queue's head
    joins the micro-batch with a free slot that holds the fewest tokens, as long as the
    tokens it reserves (prompt plus generation, as Algorithm 2 counts them) keep that
    micro-batch within `cache_tokens`; a head that fits nowhere waits (first come, first
    served). Requests that fit no micro-batch even alone are aborted."""
    aborted = tuple(r for r in requests if r.tokens > cache_tokens)
    queue = [r for r in requests if r.tokens <= cache_tokens]
    active: list[list[Admission]] = [[] for _ in range(n_ub)]
    reserved = [0] * n_ub
    admissions: list[Admission] = []
    head, step = 0, 0
    while head < len(queue):
        for j in range(n_ub):
            done = [a for a in active[j] if a.last_step < step]
            if done:
                active[j] = [a for a in active[j] if a.last_step >= step]
                reserved[j] -= sum(a.request.tokens for a in done)
        while head < len(queue):
            r = queue[head]
            room = [j for j in range(n_ub)
                    if len(active[j]) < ubs and reserved[j] + r.tokens <= cache_tokens]
            if not room:
                break
            j = min(room, key=lambda j: reserved[j])
            a = Admission(r, j, step)
            active[j].append(a)
            reserved[j] += r.tokens
            admissions.append(a)
            head += 1
        # Nothing changes until the next request finishes: jump there.
        step = max(step + 1, min((a.last_step + 1 for mb in active for a in mb), default=step + 1))
    return Refill(tuple(admissions), aborted, n_ub, cache_tokens)


@dataclass(frozen=True)
class StepLoad:
    """Per micro-batch j and step d (0 = prefill): sequences generating ``seqs[j, d]``, the KV
    tokens they attend over ``ctx[j, d]``, and the prompt tokens admitted (prefilled) in that
    step's tasks ``ptok[j, d]`` with their sum of squares ``psq[j, d]``."""

    seqs: np.ndarray
    ctx: np.ndarray
    ptok: np.ndarray
    psq: np.ndarray

    # A window of a longer run (:meth:`window`): its step 0 stands for nothing that happens.
    continuation: bool = False

    def tables(self, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.seqs, self.ctx, self.ptok, self.psq

    def window(self, d0: int, d1: int) -> "StepLoad":
        """Steps ``d0 + 1 .. d1`` as steps ``1 .. d1 - d0`` of their own run; with ``d0 = 0``
        the run's own start, prefill included."""
        if d0 == 0:
            cols = slice(0, d1 + 1)
            return StepLoad(self.seqs[:, cols], self.ctx[:, cols], self.ptok[:, cols],
                            self.psq[:, cols])
        idle = np.zeros((self.seqs.shape[0], 1))
        cols = slice(d0 + 1, d1 + 1)
        return StepLoad(np.hstack([idle, self.seqs[:, cols]]),   # contexts are absolute
                        np.hstack([idle, self.ctx[:, cols]]),
                        np.hstack([idle, self.ptok[:, cols]]), np.hstack([idle, self.psq[:, cols]]),
                        continuation=True)


def with_padding(scenario, padded: bool):
    """`scenario` with its request list batched padded (FlexGen: every prompt at the longest,
    every request generating the longest generation) or unpadded (Algorithm 2), and the
    mean-length fields that follow from that."""
    s = summary(scenario.requests)
    gen = s["gen_max"] if padded else max(1, round(s["gen_mean"]))
    update = {"padded": padded, "gen_len": gen, **({"refill": False} if padded else {})}
    w = scenario.workload.model_copy(update=update)
    return scenario.model_copy(update={"workload": w})
