"""The experts an expert-level schedule keeps on the device, and how they get there.

EP keeps each layer's ``experts_gpu`` most popular experts (:class:`PlacedExperts`), copied once
at start-up; the host computes the others. EC keeps a cache of ``experts_gpu`` expert slots per
layer and one staging area of min(E, mu * k) slots shared by every layer, filled by
``ExpertIn`` (:class:`CachedExperts`); a micro-batch that misses more than the staging area
holds is computed in rounds. ECP adds a prefetch area of min(E, N * k) slots that
``ExpertAhead`` fills with the next layer's predicted experts (:meth:`CachedExperts.prefetch`),
measured in :class:`PrefetchCounts`.

An expert moves as one block, w1 | w3 | w2 (:class:`ExpertBlocks`): a range of its layer's flat
vector, or its GGUF blocks kept apart from it (kernels.quant). A device slot holds one
block. The runtime's tasks (exec.runtime: ``GPUFFN``, ``ExpertIn``, ``ExpertAhead``) say when;
this module says which expert lies in which slot, and copies it there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from taskgraph.kernels.quant import QuantizedExperts, expert_nbytes
from taskgraph.kernels.weights import QUANTIZED, ModelWeights, layer_sections
from taskgraph.specs import ModelSpec


class ExpertBlocks:
    """Each expert's w1 | w3 | w2 block where it lies in host memory, device areas of slots for
    such blocks, and what the expert kernels read over an area's slots."""

    def __init__(self, m: ModelSpec, weights: ModelWeights, quantized: str | None,
                 dtype: torch.dtype, device: torch.device):
        self.m, self.w, self.quantized = m, weights, quantized
        self.dtype, self.device = dtype, device
        # An expert's w1, w3 and w2 lie next to each other in a layer's flat vector, as
        # matrices or as one row of blocks.
        sections = {s.name: s for s in layer_sections(m)}
        if quantized is None:
            self.offset = [sections[f"w1.{e}"].offset for e in range(m.E)]
            self.numel = 3 * m.h_i * m.h
        else:
            blocks = sections[QUANTIZED]
            self.numel = blocks.shape[1]
            self.offset = [blocks.offset + e * self.numel for e in range(m.E)]

    def host(self, l: int, e: int) -> torch.Tensor:
        """Expert e of layer l in host memory (its blocks as bytes, where it has them)."""
        a = self.offset[e]
        expert = self.w.layers[l][a:a + self.numel]
        return expert if self.quantized is None else expert.view(torch.uint8)

    def area(self, slots: int) -> torch.Tensor:
        """Zeroed device slots for `slots` experts, one block each."""
        if self.quantized is not None:
            return torch.zeros(slots, expert_nbytes(self.m, self.quantized), dtype=torch.uint8,
                               device=self.device)
        return torch.zeros(slots, self.numel, dtype=self.dtype, device=self.device)

    def views(self, area: torch.Tensor, expert_of: dict[int, int]) -> Any:
        """What :func:`taskgraph.kernels.ops.experts` reads (``w13.{e}``, ``w2.{e}``) over an
        area's slots (slot -> expert); GGUF blocks are dequantized as they are read."""
        if self.quantized is not None:
            return QuantizedExperts(self.m, self.quantized, area,
                                    {e: slot for slot, e in expert_of.items()}, self.dtype)
        m, cut, out = self.m, 2 * self.m.h_i * self.m.h, {}
        for slot, e in expert_of.items():
            block = area[slot]
            out[f"w13.{e}"] = block[:cut].view(2 * m.h_i, m.h)
            out[f"w2.{e}"] = block[cut:].view(m.h, m.h_i)
        return out


class PlacedExperts:
    """EP: each layer's most popular experts (``held``, from ``Routing.popular``; none on a
    dense layer), copied to the device once, here, apart from the forward (as gpt-fast's
    setup_caches). The host computes the others (CPUFFN), the GPU these (GPUFFN).

    Zero copy shares host and device memory: the GPU's experts are read where they lie in host
    memory (`host_experts`), with no copy at start-up."""

    def __init__(self, held: list[list[int]], blocks: ExpertBlocks, host_experts: list[Any],
                 zero_copy: bool):
        E = blocks.m.E
        self.held = held
        self.on_gpu = [frozenset(row) for row in held]
        self.on_host = [frozenset(range(E)) - on_gpu for on_gpu in self.on_gpu]
        if zero_copy:
            self.weights = host_experts
            return
        self.weights = []
        for l, row in enumerate(held):
            area = blocks.area(len(row))
            for slot, e in enumerate(row):
                area[slot].copy_(blocks.host(l, e))
            self.weights.append(blocks.views(area, dict(enumerate(row))))


def share(part: int, whole: int) -> float | None:
    """part / whole, rounded, or None when there is no whole (a run that never looked)."""
    return round(part / whole, 6) if whole else None


class CachedExperts:
    """EC and ECP: the device's expert slots, which expert each holds, and what was copied.

    The device holds c = ``experts_gpu`` slots per MoE layer (the cache) and ONE staging area of
    S = min(E, mu * k) slots shared by every layer: the most a decode micro-batch can miss (its
    mu tokens choose at most mu * k distinct experts). That is what the memory model counts. A
    micro-batch missing more than S experts (prefill: mu * P tokens choose up to all E) is
    computed in rounds of at most S staged experts (:meth:`bring_in`, :meth:`rounds`). All slots
    lie in one pool: [l * c, (l + 1) * c) start as layer l's cache, the last S as the staging
    area; a miss the cache keeps may cross through a staging slot, which then joins the layer's
    cache while the slot of a hit the cache drops joins the staging area (a swap of slot
    numbers, no copy: see :meth:`LayerCache.plan`), so a layer's slots and the staging area's
    are any c and S of the pool, c and S at all times.

    Sharing the staging area between layers is safe because its writers and readers are
    ordered: layer l's ExpertIn waits for layer l's Route (it reads the router's choice), and
    the GPU stream runs that Route after the previous layer's GPUFFN, the last reader of the
    staging area; micro-batches of one layer likewise (EC's prefill and decode launch Route(l,
    j + 1) after GPUFFN(l, j) on the GPU stream: tests/test_expert_exec.py checks that order on
    the compiled graph). GPUFFN's own later rounds copy on the GPU stream, between its
    computations.

    ``eviction: popular`` holds the c most popular experts (`popular`) fixed, copied here once
    like EP's; every miss goes through the staging area.

    ECP adds a prefetch area of A = min(E, N * k) slots, what the memory model counts ("expert
    prefetch (N x k)"): ExpertAhead copies into it the experts it predicts for the next layer
    that its cache does not hold (see :meth:`prefetch` for why they can never land on a slot
    still to be read).

    Zero copy shares host and device memory: there are no slots (``pool`` None), ExpertIn and
    ExpertAhead are no-ops like every other host-device copy, and GPUFFN reads the experts where
    they lie; the counts stay zero."""

    def __init__(self, blocks: ExpertBlocks, capacity: int, staging_slots: int,
                 prefetch_slots: int, dense: list[bool], popular: list[list[int]] | None,
                 zero_copy: bool):
        L = len(dense)
        self.blocks = blocks
        self.capacity, self.staging_slots = capacity, staging_slots
        self.prefetch_slots = prefetch_slots
        self.prefetch_counts = PrefetchCounts(L)
        self.copies = 0                      # experts copied host -> device, all layers
        self.copies_by_layer = [0] * L
        self.copies_in_gpuffn = 0            # of those, copied by GPUFFN's later rounds
        # decode's chosen experts and those not in the cache (a prefetched one is a miss too),
        # per layer: the measured hit rate
        self.decode_chosen, self.decode_missed = [0] * L, [0] * L
        self.prefetches = prefetch_slots > 0
        if zero_copy:
            self.pool = None
            return
        cached = capacity * sum(not d for d in dense)      # a dense layer has no experts
        slots = cached + staging_slots + prefetch_slots
        self.pool = blocks.area(slots)
        self.layers: list[LayerCache | None] = []
        first = 0
        for l in range(L):
            if dense[l]:
                self.layers.append(None)
                continue
            owned = list(range(first, first + capacity))
            first += capacity
            if popular is not None:
                for slot, e in zip(owned, popular[l]):
                    self.pool[slot].copy_(blocks.host(l, e))
            self.layers.append(LayerCache(owned, popular[l] if popular is not None else None))
        # the pool slots that form the staging area and the prefetch area now (swaps change
        # which)
        self.staging = list(range(cached, cached + staging_slots))
        self.prefetch_area = list(range(cached + staging_slots, slots))
        # the last prediction: the (step, layer) ExpertAhead predicted for, the experts it
        # predicted, and those it copied into the prefetch area -> their slots
        self.ahead: tuple[int, int, list[int], dict[int, int]] | None = None
        # each (layer, micro-batch)'s rounds: ExpertIn plans them and runs the first's copies,
        # that micro-batch's GPUFFN computes them (and copies the later rounds' experts)
        self._rounds: dict[tuple[int, int], list[Round]] = {}

    def bring_in(self, s: int, l: int, j: int, wanted: list[int]) -> None:
        """ExpertIn: the misses among micro-batch j's chosen experts (`wanted`, sorted),
        host -> device: those the cache keeps into its slots, the others into the shared
        staging area, in rounds of at most S when there are more (:meth:`LayerCache.plan`).
        This copies the first round's; :meth:`rounds`, in GPUFFN, the later rounds'. Each miss
        is copied once per micro-batch."""
        rounds = self.layers[l].plan(wanted, self.staging)
        if s:       # decode: what the cache held of what the step chose (prefill finds it cold)
            self.decode_chosen[l] += len(wanted)
            self.decode_missed[l] += sum(len(r.copies) for r in rounds)
        if self.prefetch_area:
            self.take_prefetched(s, l, j, wanted, rounds)
        for e, slot in rounds[0].copies:
            self.copy(l, e, slot)
        copies = sum(len(r.copies) for r in rounds)
        self.copies += copies
        self.copies_by_layer[l] += copies
        self.copies_in_gpuffn += copies - len(rounds[0].copies)
        self._rounds[l, j] = rounds

    def rounds(self, l: int, j: int) -> Iterator[tuple[Any, list[int]]]:
        """GPUFFN: the rounds :meth:`bring_in` planned for micro-batch j of layer l, each as
        (what the expert kernels read over its slots, its experts). The first round's experts
        are on the device already; each later round's are copied into the staging area as the
        round is reached, so after the previous round's computation read it (on GPUFFN's
        stream)."""
        for r, round_ in enumerate(self._rounds.pop((l, j))):
            if r:
                for e, slot in round_.copies:
                    self.copy(l, e, slot)
            yield (self.blocks.views(self.pool, {slot: e for e, slot in round_.compute.items()}),
                   sorted(round_.compute))

    def prefetch(self, s: int, l: int, predicted: list[int]) -> None:
        """ExpertAhead: copy the `predicted` experts (sorted, distinct) that layer l's cache
        does not hold into the prefetch area, while layer l - 1 runs. Layer l's ExpertIn then
        takes those its micro-batch chose from the prefetch area instead of copying them
        (:meth:`take_prefetched`) and copies only what is still missing: a wrong guess costs a
        wasted copy, never a wrong token.

        Why nothing here overwrites what is still to be read:

        * Its slots: the prefetch area is A pool slots that neither a layer's cache nor the
          staging area owns, so no GPUFFN reads them: neither layer l - 1's (ExpertAhead waits
          only for Route(l - 1, 0), so they may still run beside it) nor layer l's. A slot
          joins the area only in an ExpertIn that takes a prefetched expert instead
          (:meth:`take_prefetched`): it is the slot that ExpertIn had planned to copy a miss
          into, so free to write then (see the staging paragraph of the class), and every
          later write to it comes later on the same in-order h2d stream. What the area held
          before is layer l - 1's prediction: ExpertIn(l - 1, 0), launched before ExpertAhead
          on this stream, took from it what its micro-batch chose; the rest is dropped (a
          wasted copy).
        * Layer l's GPUFFNs wait for ExpertAhead (GPUFFN's record reads it), so the experts
          copied here have landed before any of them reads them."""
        cache = self.layers[l]
        absent = [e for e in predicted if not cache.holds(e)]
        assert len(absent) <= len(self.prefetch_area)       # mu * k <= N * k, and <= E
        placed = dict(zip(absent, self.prefetch_area))
        for e, slot in placed.items():
            self.copy(l, e, slot)
        self.ahead = (s, l, predicted, placed)
        self.prefetch_counts.predicted[l] += len(predicted)
        self.prefetch_counts.copies[l] += len(placed)

    def take_prefetched(self, s: int, l: int, j: int, wanted: list[int], rounds: list[Round]
                        ) -> None:
        """ECP, in ExpertIn: count the predicted experts the router chose for micro-batch 0
        (whose rows the prediction was made from), and take those the prefetch area holds
        instead of copying them. A taken expert's prefetch slot and the slot its copy was
        planned into swap roles (every mention of the one in the plan, the cache and the
        staging area is renamed to the other): the prefetch slot, holding the expert, joins the
        cache or the staging area; the planned slot, free to write now, joins the prefetch
        area, where only a later ExpertAhead (later on this stream) writes it.

        Only while the area still holds this layer's prediction for this step: ExpertAhead(l +
        1), launched on this stream right after ExpertIn(l, 0), replaces it, so in general only
        micro-batch 0 takes (the other micro-batches find what the cache kept of micro-batch
        0's); the last layer of the last step has no next prediction, and its later
        micro-batches may take what is left. Only the first round's copies are taken (decode,
        whose misses fit the staging area, has one round; prefill has no prediction)."""
        counts = self.prefetch_counts
        if s:
            counts.misses[l] += sum(len(r.copies) for r in rounds)
        if self.ahead is None or self.ahead[:2] != (s, l):
            return
        predicted, placed = self.ahead[2:]
        if j == 0:
            counts.used[l] += len(set(predicted) & set(wanted))
        for e, planned in list(rounds[0].copies):
            slot = placed.pop(e, None)
            if slot is None:
                continue
            rounds[0].copies.remove((e, planned))
            for round_ in rounds:
                round_.copies = [(x, slot if y == planned else y) for x, y in round_.copies]
                round_.compute = {x: slot if y == planned else y
                                  for x, y in round_.compute.items()}
            self.layers[l].rename(planned, slot)
            self.staging[:] = [slot if y == planned else y for y in self.staging]
            self.prefetch_area[self.prefetch_area.index(slot)] = planned
            counts.taken[l] += 1

    def copy(self, l: int, e: int, slot: int) -> None:
        """Expert e of layer l, host -> a pool slot: one copy of its block."""
        self.pool[slot].copy_(self.blocks.host(l, e), non_blocking=True)

    def to_dict(self) -> dict[str, Any]:
        """What the cache really copied (host -> device, misses) and held (its decode hit
        rate), for ``summary["experts"]``; GPUFFN's share of the copies is the later rounds of
        a micro-batch missing more experts than the staging area holds. ECP adds its predictor
        as measured (``prefetch``)."""
        chosen, missed = self.decode_chosen, self.decode_missed
        out = {"copies": self.copies, "copies_by_layer": list(self.copies_by_layer),
               "copies_in_gpuffn": self.copies_in_gpuffn,
               "measured_hit_rate": share(sum(chosen) - sum(missed), sum(chosen)),
               "measured_hit_rate_by_layer": [share(c - m, c) for c, m in zip(chosen, missed)]}
        if self.prefetches:
            out["prefetch"] = self.prefetch_counts.to_dict()
        return out


class PrefetchCounts:
    """ECP's predictor, measured layer by layer over the decode steps: experts predicted (each
    step's distinct ones, from micro-batch 0's tokens), those of them the router then chose for
    micro-batch 0 (used), the predicted ones ExpertAhead copied (those the cache did not hold), the
    copies an ExpertIn took instead of copying (taken), and the decode misses (what ExpertIn
    would have copied without a prefetch: its copies plus the ones it took)."""

    def __init__(self, layers: int):
        self.predicted = [0] * layers
        self.used = [0] * layers
        self.copies = [0] * layers
        self.taken = [0] * layers
        self.misses = [0] * layers

    def to_dict(self) -> dict[str, Any]:
        """``summary["experts"]["prefetch"]``: ``accuracy`` (used / predicted) is the share of
        the predictor's guesses the router confirmed; ``covered`` (taken / misses) is the share
        of the cache's decode misses that were already on the device, what the simulator's
        ``policy.prefetch`` stands for."""
        by_layer = [{"predicted": p, "used": u, "accuracy": share(u, p), "copies": c,
                     "taken": t, "misses": m, "covered": share(t, m)}
                    for p, u, c, t, m in zip(self.predicted, self.used, self.copies, self.taken,
                                             self.misses)]
        total = {key: sum(row[key] for row in by_layer)
                 for key in ("predicted", "used", "copies", "taken", "misses")}
        return {**total, "accuracy": share(total["used"], total["predicted"]),
                "covered": share(total["taken"], total["misses"]), "by_layer": by_layer}


@dataclass
class Round:
    """One round of a micro-batch's experts (EC): the (expert, pool slot) copies that bring
    its misses in, then the experts computed, each from its slot."""

    copies: list[tuple[int, int]]
    compute: dict[int, int]


class LayerCache:
    """Which expert each of a layer's c cache slots holds, for EC, and where a micro-batch's
    chosen experts are read from.

    "lru" (``fixed`` None): the least recently used go first. Which experts stay is what
    ``taskgraph.dag.routing``'s replay keeps: a micro-batch's experts, in id order, become the
    most recent, then the cache is cut to c. "popular": the fixed experts in the c slots never
    go, and every miss is staged."""

    def __init__(self, slots: list[int], fixed: list[int] | None):
        self.capacity = len(slots)
        self.fixed = dict(zip(fixed, slots)) if fixed is not None else None
        self.lru: OrderedDict[int, int] = OrderedDict()    # expert -> slot, least recent first
        self.free = [] if fixed is not None else list(slots)

    def holds(self, e: int) -> bool:
        """Whether expert e is in the cache's slots."""
        return e in (self.fixed if self.fixed is not None else self.lru)

    def rename(self, old: int, new: int) -> None:
        """Pool slot `old` is called `new` from now on (ECP: a prefetched expert's slot takes
        the place of the slot its copy was planned into)."""
        if self.fixed is None:
            for e, slot in self.lru.items():
                if slot == old:
                    self.lru[e] = new
            self.free = [new if slot == old else slot for slot in self.free]

    def plan(self, wanted: list[int], staging: list[int]) -> list[Round]:
        """The rounds of a micro-batch whose chosen experts are `wanted` (sorted, distinct),
        given the pool slots of the shared staging area (S of them; updated in place when a
        slot changes hands). Round 0 computes every hit from its cache slot, the misses the
        cache keeps that fit in a slot free now (empty, or holding an expert this micro-batch
        neither needs nor keeps) from that slot, and up to S other misses from the staging
        area; each later round up to S more staged misses, in id order. A miss the cache keeps
        that found no free slot (the only ones left hold hits the cut drops, read in round 0)
        is staged, and after its round the two slots swap roles: the miss stays in the cache
        where it was copied, the dropped hit's slot joins the staging area. Each miss is copied
        once, and no slot is written while an expert in it is still to be read."""
        if self.fixed is not None:                        # "popular": every miss staged
            hits = {e: self.fixed[e] for e in wanted if e in self.fixed}
            return _rounds(hits, [], [e for e in wanted if e not in self.fixed], staging)
        need = set(wanted)
        hits = {e: self.lru[e] for e in wanted if e in self.lru}
        order = [e for e in self.lru if e not in need] + wanted
        keep = set(order[max(0, len(order) - self.capacity):]) if self.capacity else set()
        dropped = [e for e in self.lru if e not in keep]
        free_now = self.free + [self.lru[e] for e in dropped if e not in need]
        free_later = [self.lru[e] for e in dropped if e in need]
        stay = [e for e in wanted if e not in hits and e in keep]
        direct = list(zip(stay, free_now))
        slot_of = dict(direct)                            # where each kept miss will lie
        staged = [e for e in wanted if e not in hits and e not in slot_of]
        # the kept misses left over are as many as the dropped hits' slots at most: the cache's
        # c slots hold what it keeps
        assert len(stay) - len(direct) <= len(free_later)
        swaps = dict(zip(stay[len(direct):], free_later))
        rounds = _rounds(hits, direct, staged, staging, swaps, slot_of)
        self.free = free_now[len(direct):] + free_later[len(swaps):]
        self.lru = OrderedDict((e, slot_of[e] if e in slot_of else self.lru[e])
                               for e in order if e in keep)
        return rounds


def _rounds(hits: dict[int, int], direct: list[tuple[int, int]], staged: list[int],
            staging: list[int], swaps: dict[int, int] | None = None,
            slot_of: dict[int, int] | None = None) -> list[Round]:
    """Round 0: the hits and the misses copied straight into cache slots (`direct`), then the
    `staged` misses S at a time into the staging area. A staged miss in `swaps` takes its
    staging slot into the cache (``slot_of``) and gives the staging area the slot named, from
    the next round on."""
    S, swaps = len(staging), swaps or {}
    rounds = [Round(list(direct), {**hits, **dict(direct)})]
    for r in range(0, len(staged), S):
        if r:
            rounds.append(Round([], {}))
        now = rounds[-1]
        for i, e in enumerate(staged[r:r + S]):
            now.copies.append((e, staging[i]))
            now.compute[e] = staging[i]
        for i, e in enumerate(staged[r:r + S]):
            if e in swaps:
                slot_of[e], staging[i] = staging[i], swaps[e]
    return rounds
