"""Which experts a batch's tokens route to, and so which experts' bytes a schedule must move or
read (docs/experts.md).

At the batch sizes CGOPipe and FlexGen run, every expert of a layer is touched at every step;
at batch 1 Mixtral touches 2 of 8. A :class:`Routing` holds, per layer, the chance that a token
picks each expert (its *inclusion* probability ``q``, which sums to ``k`` over a layer's
experts), from one of three sources (``workload.routing``):

* ``uniform``: each token's ``k`` experts are any ``k`` of ``E`` alike, ``q = k/E``;
* ``skewed``: drawn without replacement in proportion to a popularity (``popularity``, or
  ``rank^-zipf``), the same for every layer;
* ``trace``: the router decisions a real checkpoint made (``tg execute --record-routing``),
  replayed.

Tokens are independent, so ``t`` tokens touch ``sum_e 1 - (1 - q_e)^t`` distinct experts on
average. For uniform routing that is ``E(1 - (1 - k/E)^t)`` and its variance is exact; for the
others the variance treats experts as independent. A recorded trace keeps what independence
loses (tokens of one sequence reuse experts, and experts co-occur): at the batch it was recorded
with, its own distinct counts are used, and an expert cache's hit rate is measured by replaying
it.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from taskgraph.errors import TgError
from taskgraph.files import parsed_json
from taskgraph import placement
from taskgraph.specs import ModelSpec, PolicySpec, Scenario

#: Decode steps an expert cache is replayed for when the routing is synthetic (after as many
#: again to warm it): enough for a hit rate within about a percent.
CACHE_STEPS = 400
#: Draws that estimate a skewed routing's inclusion probabilities (exact for uniform).
_DRAWS = 200_000
#: Tokens drawn for one synthetic step at most: past this many every expert a batch could touch
#: is touched (an expert a token picks once in 10^3 is missed with probability e^-4).
DRAWN_TOKENS = 4_096


@dataclass(frozen=True)
class RoutingTrace:
    """Router decisions of a run: for each recorded step (0: prefill, then decode steps), each
    layer's experts per token, ``experts[step]`` an int array of shape (L, tokens, k). A dense
    layer (`dense`) has no router: its rows hold -1."""

    E: int
    k: int
    L: int
    experts: tuple[np.ndarray, ...]
    dense: tuple[int, ...] = ()
    # what is computed from the trace once, whichever plan asks (a comparison builds many)
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def decode(self) -> tuple[np.ndarray, ...]:
        return self.experts[1:]

    @property
    def moe_layers(self) -> list[int]:
        return [l for l in range(self.L) if l not in self.dense]

    def to_dict(self) -> dict:
        return {"format": FORMAT, "E": self.E, "k": self.k, "L": self.L,
                **({"dense_layers": list(self.dense)} if self.dense else {}),
                "steps": [e.tolist() for e in self.experts]}


FORMAT = "tg-routing/1"


def trace_from_json(text: str, where: str) -> RoutingTrace:
    """A routing trace from its JSON text (:func:`trace_from_dict`), each layer of each step
    made an array of 2-byte ids as soon as it is read: the nested lists of a whole trace took
    ~20x its text (a 120 MB file, 2.7 GB); one layer's lists at a time take little, and the
    arrays a third of the text."""
    return trace_from_dict(parsed_json(text, where, _streamed_steps), where)


def _ids(rows: object) -> object:
    """Ids as the smallest integer array that holds them; what is not such an array as it was
    (trace_from_dict says what is wrong with it)."""
    try:
        a = np.asarray(rows)
    except (ValueError, TypeError, OverflowError):
        return rows
    if a.dtype.kind not in "iu" or a.size == 0:
        return a
    small = np.int16 if -2**15 <= a.min() and a.max() < 2**15 else np.int64
    return a.astype(small)


_SPACE = re.compile(r"[ \t\n\r]*")


def _streamed_steps(text: str) -> object:
    """The JSON document `text`, its top-level object's "steps" read one layer of one step at a
    time, each made an array (:func:`_ids`) before the next is read; any other document as json
    reads it."""
    decoder = json.JSONDecoder()
    i = _SPACE.match(text).end()
    if not text.startswith("{", i):
        return json.loads(text)

    def expect(chars: str, at: int) -> tuple[str, int]:
        at = _SPACE.match(text, at).end()
        if at >= len(text) or text[at] not in chars:
            raise json.JSONDecodeError(f"Expecting one of {chars!r}", text, at)
        return text[at], _SPACE.match(text, at + 1).end()

    def decode(at: int, convert) -> tuple[object, int]:
        value, at = decoder.raw_decode(text, at)
        return convert(value), at

    def array(at: int, element, combine) -> tuple[object, int]:
        """A JSON array at `at`, element by element (`element(at)`), or any other value."""
        if not text.startswith("[", at):
            return decode(at, lambda value: value)
        items, at = [], _SPACE.match(text, at + 1).end()
        if text.startswith("]", at):
            return combine(items), at + 1
        while True:
            item, at = element(at)
            items.append(item)
            sep, at = expect(",]", at)
            if sep == "]":
                return combine(items), at

    doc: dict = {}
    i = _SPACE.match(text, i + 1).end()
    if text.startswith("}", i):
        return doc
    while True:
        key, i = decoder.raw_decode(text, i)
        if not isinstance(key, str):
            raise json.JSONDecodeError("Expecting property name", text, i)
        _, i = expect(":", i)
        if key == "steps" and text.startswith("[", i):
            steps, i = array(i, lambda at: array(at, lambda at2: decode(at2, _ids), _stacked),
                             list)
            doc[key] = steps
        else:
            doc[key], i = decoder.raw_decode(text, i)
        sep, i = expect(",}", i)
        if sep == "}":
            break
    if i < len(text):
        raise json.JSONDecodeError("Extra data", text, i)
    return doc


def _stacked(layers: list) -> object:
    """A step's layers as one array where they are arrays of one shape and kind; else as read."""
    if layers and all(isinstance(a, np.ndarray) and a.dtype.kind in "iu" for a in layers) \
            and len({a.shape for a in layers}) == 1:
        return np.stack(layers)
    return layers


def trace_from_dict(obj: object, where: str) -> RoutingTrace:
    """A routing trace read from JSON, every field checked (a clear error naming it)."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise TgError(f"{where} is not a routing trace: its 'format' must be '{FORMAT}' (write "
                      "one with `tg execute --record-routing FILE`).")
    for name in ("E", "k", "L"):
        if not isinstance(obj.get(name), int) or isinstance(obj.get(name), bool) \
                or obj[name] < 1:
            raise TgError(f"{where}: '{name}' must be a positive integer.")
    E, k, L = obj["E"], obj["k"], obj["L"]
    dense = obj.get("dense_layers", [])
    if not isinstance(dense, list) or any(
            not isinstance(l, int) or isinstance(l, bool) or not 0 <= l < L for l in dense) \
            or len(set(dense)) != len(dense) or len(dense) >= L:
        raise TgError(f"{where}: 'dense_layers' must list distinct layer numbers below L = {L}, "
                      "not every layer.")
    moe = [l for l in range(L) if l not in dense]
    steps = obj.get("steps")
    if not isinstance(steps, list) or len(steps) < 2:
        raise TgError(f"{where}: 'steps' must list the prefill and at least one decode step.")
    experts = []
    for i, step in enumerate(steps):
        try:
            a = np.asarray(step)
        except (ValueError, TypeError, OverflowError):
            raise TgError(f"{where}: steps[{i}] is not an array of expert ids.") from None
        if a.dtype.kind not in "iu":          # floats, booleans, strings: not expert ids
            found = {"b": "true/false", "f": "fractional numbers", "U": "text"}.get(
                a.dtype.kind, "values of mixed kinds")
            raise TgError(f"{where}: steps[{i}] must hold integer expert ids, not {found}.")
        if a.ndim != 3 or a.shape[0] != L or a.shape[2] != k or a.shape[1] < 1:
            raise TgError(f"{where}: steps[{i}] must be {L} layers x tokens x {k} expert ids, "
                          f"not shape {list(a.shape)}.")
        if dense and (a[dense] != -1).any():
            raise TgError(f"{where}: steps[{i}] chooses experts in a dense layer "
                          f"(dense_layers); their rows hold -1.")
        if a[moe].min() < 0 or a[moe].max() >= E:
            raise TgError(f"{where}: steps[{i}] holds an expert id outside 0..{E - 1}.")
        ordered = np.sort(a[moe], axis=2)
        if (ordered[:, :, 1:] == ordered[:, :, :-1]).any():
            raise TgError(f"{where}: steps[{i}] chooses one expert twice for a token; a router "
                          f"chooses {k} different experts.")
        experts.append(a)
    return RoutingTrace(E, k, L, tuple(experts), tuple(sorted(dense)))


class Routing:
    """A layer's inclusion probabilities ``q`` (shape (L, E), each row summing to k), and what
    follows from them for ``t`` tokens."""

    def __init__(self, q: np.ndarray, k: int, weights: np.ndarray | None = None,
                 uniform: bool = False, trace: RoutingTrace | None = None, seed: int = 0):
        self.q, self.k, self.uniform, self.trace, self.seed = q, k, uniform, trace, seed
        self.L, self.E = q.shape
        # what synthetic steps are drawn in proportion to (a popularity per layer)
        self.weights = weights if weights is not None else q / k
        self._hits: dict[tuple, np.ndarray] = {}
        # the experts each layer keeps, where the scenario pins them (Scenario.experts_kept)
        self.pinned: list[np.ndarray] | None = None
        # which layers are dense (no experts), where the model is known
        self.dense = np.zeros(self.L, dtype=bool)

    @classmethod
    def uniform(cls, model: ModelSpec, seed: int = 0) -> "Routing":
        routing = cls(np.full((model.L, model.E), model.k / model.E), model.k, uniform=True,
                      seed=seed)
        routing.dense = _dense(model)
        return routing

    @classmethod
    def of(cls, scenario: Scenario) -> "Routing":
        routing = cls._of(scenario)
        routing.pinned = scenario.experts_kept
        routing.dense = _dense(scenario.model)
        return routing

    @classmethod
    def _of(cls, scenario: Scenario) -> "Routing":
        m, spec = scenario.model, scenario.workload.routing
        if spec.kind == "trace":
            trace = scenario.routing_trace
            if "q" not in trace.memo:
                counts = np.ones((trace.L, trace.E))      # a dense layer's: uniform, unused
                for layer in trace.moe_layers:
                    counts[layer] = sum(np.bincount(step[layer].ravel(), minlength=trace.E)
                                        for step in trace.experts)
                trace.memo["q"] = counts / counts.sum(axis=1, keepdims=True) * trace.k
            return cls(trace.memo["q"], m.k, trace=trace, seed=spec.seed)
        if spec.kind == "uniform":
            return cls.uniform(m, spec.seed)
        weights = np.asarray(spec.popularity if spec.popularity is not None
                             else np.arange(1, m.E + 1, dtype=float) ** -spec.zipf, dtype=float)
        weights = weights / weights.sum()
        q = _inclusion(weights, m.k, spec.seed)
        return cls(np.tile(q, (m.L, 1)), m.k, weights=np.tile(weights, (m.L, 1)), seed=spec.seed)

    # --- distinct experts ------------------------------------------------------------------
    def distinct(self, tokens) -> np.ndarray | float:
        """Expected distinct experts `tokens` tokens touch in a layer, the mean over layers
        (`tokens` a number or an array). At the batch a trace was recorded with, its own
        count."""
        if self.uniform:      # E(1 - (1 - k/E)^t), as every schedule has always priced it
            return self.E * (1.0 - (1.0 - self.k / self.E) ** tokens)
        t = np.asarray(tokens, dtype=float)
        # a batch's tasks share a few token counts: each computed once (layers x experts each)
        counts, where = np.unique(t.reshape(-1), return_inverse=True)
        out = self.E - np.mean(np.sum((1.0 - self.q[:, :, None]) ** counts, axis=1), axis=0)
        for batch, count in self._measured_distinct.items():
            out = np.where(counts == batch, count, out)
        out = out[where].reshape(t.shape)
        return float(out) if out.ndim == 0 else out

    def distinct_std(self, tokens: float) -> float:
        """Standard deviation of the distinct experts `tokens` tokens touch in one layer: exact
        for uniform routing (from pairs of experts both missed), experts taken as independent
        otherwise."""
        t = float(tokens)
        if t <= 1:                  # one token: exactly k experts
            return 0.0
        if self.uniform:
            E, k = self.E, self.k
            a = (1 - k / E) ** t
            b = ((E - k) * (E - k - 1) / (E * (E - 1))) ** t if E > 1 else 0.0
            var = E * a * (1 - a) + E * (E - 1) * (b - a * a)
        else:
            miss = (1.0 - self.q) ** t
            var = float(np.mean(np.sum(miss * (1 - miss), axis=1)))
        return float(np.sqrt(max(var, 0.0)))

    @cached_property
    def _measured_distinct(self) -> dict[int, float]:
        """A trace's own mean distinct count per layer and decode step, at its batch."""
        if self.trace is None:
            return {}
        sizes = {step.shape[1] for step in self.trace.decode}
        if len(sizes) != 1:
            return {}
        counts = [len(np.unique(step[layer])) for step in self.trace.decode
                  for layer in self.trace.moe_layers]
        return {sizes.pop(): float(np.mean(counts))}

    # --- experts held on the GPU -----------------------------------------------------------
    def popular(self, n: int) -> list[np.ndarray]:
        """The `n` experts each layer keeps where a cache evicting by popularity fixes them: its
        `n` most popular, or those the scenario pins."""
        return self._most_popular([n] * self.L)

    def held(self, policy: PolicySpec, model: ModelSpec) -> list[np.ndarray]:
        """The experts EP keeps on the GPU in each layer, as the policy places them
        (taskgraph.placement): each layer's most popular, as many as its placement gives it.
        A budget over all layers (``experts_total``) goes to the most popular (layer, expert)
        pairs, ties to the layer with fewer placed so far (so equal layers share it evenly)."""
        if self.pinned is not None and policy.experts_total is not None:
            # a budget the pinned run spread by its own routing: the same experts, whatever
            # this routing would spread (tg validate prices a run on its recorded routing)
            have = sum(len(row) for row in self.pinned)
            if have != placement.total_on_gpu(policy, model):
                raise TgError(f"policy.experts_total = {policy.experts_total}, but the scenario "
                              f"pins {have} experts on the GPU (experts_kept).")
            return self.pinned
        per_layer = placement.counts(policy, model)
        if per_layer is None:
            moe = np.flatnonzero(~self.dense)
            ranks = np.argsort(np.argsort(-self.q[moe], axis=1, kind="stable"), axis=1)
            layer = np.broadcast_to(moe[:, None], ranks.shape)
            order = np.lexsort((layer.ravel(), ranks.ravel(), -self.q[moe].ravel()))
            chosen = layer.ravel()[order[:placement.total_on_gpu(policy, model)]]
            per_layer = np.bincount(chosen, minlength=self.L).tolist()
        return self._most_popular(per_layer)

    def _most_popular(self, per_layer: list[int]) -> list[np.ndarray]:
        if self.pinned is not None:
            have = [len(row) for row in self.pinned]
            if have != list(per_layer):
                raise TgError(f"the policy places {list(per_layer)} experts on the GPU layer by "
                              f"layer, but the scenario pins {have} (experts_kept).")
            return self.pinned
        order = np.argsort(-self.q, axis=1, kind="stable")
        return [order[l, :n] for l, n in enumerate(per_layer)]

    def on_gpu(self, held: list[np.ndarray]) -> np.ndarray:
        """(L, E): whether each layer's expert is among those `held`."""
        on = np.zeros_like(self.q, dtype=bool)
        for layer, row in enumerate(held):
            on[layer, row] = True
        return on

    def split(self, tokens, on: np.ndarray, layers=None) -> tuple[Any, Any, Any]:
        """With the experts `on` (L, E) on the GPU: the share of token-expert pairs they take,
        and the expected distinct experts touched on the GPU and off it, the mean over `layers`
        (default: every MoE layer). At the batch a trace was recorded with, its decode steps'
        own (its prefill's many tokens route otherwise); as for :meth:`distinct`, a task is
        taken for a decode step by its token count alone."""
        rows = np.flatnonzero(~self.dense) if layers is None else np.asarray(layers)
        q, on = self.q[rows], on[rows]
        t = np.asarray(tokens, dtype=float)
        share = np.full(t.shape, np.mean(np.sum(q * on, axis=1)) / self.k)
        touched = 1.0 - (1.0 - q[:, :, None]) ** t.reshape(-1)
        gpu = np.mean(np.sum(touched * on[:, :, None], axis=1), axis=0).reshape(t.shape)
        cpu = np.mean(np.sum(touched * ~on[:, :, None], axis=1), axis=0).reshape(t.shape)
        if (measured := self._measured_split(on, rows)) is not None:
            batch, *own = measured
            at = t == batch
            share, gpu, cpu = (np.where(at, m, a) for m, a in zip(own, (share, gpu, cpu)))
        return _scalar(share), _scalar(gpu), _scalar(cpu)

    def _measured_split(self, on: np.ndarray, layers: np.ndarray
                        ) -> tuple[int, float, float, float] | None:
        """A trace's decode batch, and over its decode steps and `layers` the mean share of
        choices the experts `on` (one row per layer of `layers`, E wide) take, and distinct
        experts chosen on and off them."""
        if self.trace is None or len({s.shape[1] for s in self.trace.decode}) != 1:
            return None
        key = ("split", on.tobytes(), layers.tobytes())
        if key not in self.trace.memo:
            rows = []
            for step in self.trace.decode:
                for row, layer in enumerate(layers):
                    chosen = step[layer]
                    kept = on[row][chosen]
                    distinct_kept = on[row][np.unique(chosen)]
                    rows.append((kept.mean(), distinct_kept.sum(), (~distinct_kept).sum()))
            self.trace.memo[key] = (self.trace.decode[0].shape[1],
                                    *(float(x) for x in np.mean(rows, axis=0)))
        return self.trace.memo[key]

    def cache_hits(self, tokens: int, capacity: int, eviction: str) -> np.ndarray:
        """Per layer, the share of the experts a decode step touches that an expert cache of
        `capacity` experts per layer already holds: LRU (most recently used kept) or
        ``popular`` (a fixed set, :meth:`popular`). Measured by replaying the trace (its prefill
        fills the cache, its decode steps are counted), or CACHE_STEPS steps drawn from the
        routing after as many to warm the cache."""
        key = ("hits", tokens, capacity, eviction,
               None if self.pinned is None else tuple(row.tobytes() for row in self.pinned))
        memo = self.trace.memo if self.trace is not None else self._hits
        if key not in memo:
            memo[key] = self._replay(tokens, capacity, eviction)
        return memo[key]

    def _replay(self, tokens: int, capacity: int, eviction: str) -> np.ndarray:
        if capacity <= 0:
            return np.zeros(self.L)
        if capacity >= self.E:
            return np.ones(self.L)
        if self._replays_trace(tokens):
            dense = set(self.trace.dense)       # no router there: 0, and never reported
            return np.array([0.0 if layer in dense else
                             _hit_rate(list(self._trace_steps(layer)), capacity, eviction,
                                       self.popular(capacity)[layer], warmup=1)
                             for layer in range(self.L)])
        layers = 1 if self.uniform_layers else self.L      # every layer alike: replay one
        out = [_hit_rate(self._drawn_steps(layer, tokens), capacity, eviction,
                         self.popular(capacity)[layer], warmup=CACHE_STEPS)
               for layer in range(layers)]
        return np.resize(np.array(out), self.L)

    def _replays_trace(self, tokens: int) -> bool:
        """A trace is replayed as recorded at the batch it was recorded with; at another batch
        its popularity is drawn from, as for skewed routing."""
        return self.trace is not None and {s.shape[1] for s in self.trace.decode} == {tokens}

    def _trace_steps(self, layer: int):
        """The recorded steps' chosen experts: the prefill's, which leaves the cache as the
        executor's finds it at the first decode step, then each decode step's."""
        return (np.unique(step[layer]) for step in self.trace.experts)

    def _drawn_steps(self, layer: int, tokens: int):
        """CACHE_STEPS steps to warm the cache, then CACHE_STEPS to count, drawn one at a time
        (a step of `tokens` tokens: at most DRAWN_TOKENS, past which every expert a batch could
        touch is touched)."""
        rng = np.random.default_rng(self.seed)
        for _ in range(2 * CACHE_STEPS):
            yield np.unique(_draw(rng, self.weights[layer:layer + 1], self.k,
                                  min(int(tokens), DRAWN_TOKENS)))

    @property
    def uniform_layers(self) -> bool:
        """Every layer routes alike (synthetic routing)."""
        return bool(np.all(self.weights == self.weights[0]))


def _hit_rate(steps, capacity: int, eviction: str, popular: np.ndarray, warmup: int) -> float:
    """The share of the experts each step chooses that a cache of `capacity` already holds:
    LRU (a step's experts become the most recent, then the cache is cut to `capacity`) or the
    `popular` ones, fixed. `steps`: each step's chosen experts; the first `warmup` of them fill
    the cache and are not counted."""
    held = set(popular.tolist())
    cache: OrderedDict[int, None] = OrderedDict()
    hit = need = 0
    for i, wanted in enumerate(steps):
        wanted = wanted.tolist()
        if eviction == "popular":
            found = sum(e in held for e in wanted)
        else:
            found = sum(e in cache for e in wanted)
            for e in wanted:
                cache.pop(e, None)
                cache[e] = None
            while len(cache) > capacity:
                cache.popitem(last=False)
        if i >= warmup:
            hit, need = hit + found, need + len(wanted)
    return hit / need if need else 1.0


def _dense(model: ModelSpec) -> np.ndarray:
    return np.array([model.is_dense(l) for l in range(model.L)], dtype=bool)


def _inclusion(p: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Per-token inclusion probabilities of k experts drawn without replacement in proportion to
    `p`: estimated from _DRAWS draws (exact for k = 1)."""
    if k == 1:
        return p.copy()
    rng = np.random.default_rng(seed)
    draws = max(1_000, min(_DRAWS, 50_000_000 // len(p)))    # at most 50M keys (400 MB)
    picks = _draw(rng, p[None, :], k, draws)[0]
    return np.bincount(picks.ravel(), minlength=len(p)) / draws


def _draw(rng: np.random.Generator, p: np.ndarray, k: int, tokens: int) -> np.ndarray:
    """Each of `tokens` tokens' k experts in each layer (rows of `p`), drawn without replacement
    in proportion to `p` (Gumbel top-k): shape (layers, tokens, k)."""
    gumbel = rng.gumbel(size=(p.shape[0], tokens, p.shape[1]))
    keys = np.log(np.maximum(p, 1e-300))[:, None, :] + gumbel
    return np.argsort(-keys, axis=2)[:, :, :k]


def _scalar(a: np.ndarray) -> float | np.ndarray:
    return float(a) if a.ndim == 0 else a
