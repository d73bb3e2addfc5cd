"""The device expert cache: equal slots in one device allocation, a map from (layer, expert) to
the slot holding it, and a replacement policy for each part of the cache (Note: [Parts of the
cache] in _layout.py). Bookkeeping only: the runtime queues the copies
and records the events it keeps on each slot.

Note: [The expert cache]
One cache for every layer (global, not per layer): slots of one size (the largest expert's),
``cache_bytes // slot_bytes`` of them, at most one per expert of the model (and one call's
routed experts per part). A cache of more than 1023 slots is cut into parts, each a cache of
its own for a run of layers (Note: [Parts of the cache] in _layout.py). A global cache
gives the slots to the layers whose experts are used again: under skewed routing a layer with
a few hot experts keeps only those, and one with uniform routing does not hold slots that
another layer would hit in. Under uniform routing a global and a per-layer cache of the same
size hit alike. A slot is *pinned* while a block uses it or has routed it ahead (copy queued,
compute pending); the policy chooses only among unpinned slots, and first among those the
running block does not route later (Belady within a block: an expert routed later is evicted
only when nothing else can be, the one routed last first).
Policies (`CachePolicy`): "lru" evicts the expert used longest ago; "lfu" the one used least
often since setup (counts survive eviction, so a hot expert evicted once comes back with its
history), least recently among equals. The least cache is one token's routed experts of one
block (``top_k`` slots): a decode step of one block then loads all its misses at once and
computes while they arrive; with more routed experts than slots (a prefill), a block cycles
its slots in expert order, each reused after the compute that read it (its "done" event).
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["CachePolicy", "ExpertCache", "Slot"]

Key = tuple[int, int]  # (layer index, expert index)


class CachePolicy(str, enum.Enum):
    """Which unpinned expert the cache evicts (Note: [The expert cache])."""

    LRU = "lru"
    LFU = "lfu"

    @classmethod
    def parse(cls, value: object) -> CachePolicy:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"policy must be 'lru' or 'lfu', got {value!r}") from None


class Slot:
    """One expert's room in the cache, and the events that order its reuse."""

    __slots__ = ("index", "offset", "key", "ready", "waited", "done", "pins")

    def __init__(self, index: int, offset: int):
        self.index = index
        self.offset = offset  # bytes into the cache's storage
        self.key: Key | None = None  # the expert it holds
        self.ready: Any = None  # recorded after the copy into it (None: complete)
        self.waited: set[Hashable] = set()  # compute streams that waited on ``ready``
        self.done: dict[Hashable, Any] = {}  # compute stream -> event after its last read
        self.pins = 0  # uses in flight: entered or routed ahead, not yet exited


class _LRU:
    def __init__(self) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()

    def add(self, key: Key) -> None:
        self.order[key] = None

    def use(self, key: Key) -> None:
        self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        del self.order[key]

    def victim(self, ok: Callable[[Key], bool]) -> Key | None:
        return next((k for k in self.order if ok(k)), None)


class _LFU:
    """Least frequently used, least recently among equals: a heap of (uses, tick, key) with
    stale entries dropped as they surface."""

    def __init__(self) -> None:
        self.uses: dict[Key, int] = {}  # since setup, kept across evictions
        self.current: dict[Key, tuple[int, int]] = {}  # cached key -> its live heap entry
        self.heap: list[tuple[int, int, Key]] = []
        self.tick = 0

    def _push(self, key: Key) -> None:
        self.tick += 1
        entry = (self.uses.get(key, 0), self.tick)
        self.current[key] = entry
        heapq.heappush(self.heap, (*entry, key))
        if len(self.heap) > 4 * len(self.current) + 64:
            self.heap = [(*e, k) for k, e in self.current.items()]
            heapq.heapify(self.heap)

    def add(self, key: Key) -> None:
        self._push(key)

    def use(self, key: Key) -> None:
        self.uses[key] = self.uses.get(key, 0) + 1
        self._push(key)

    def remove(self, key: Key) -> None:
        del self.current[key]

    def victim(self, ok: Callable[[Key], bool]) -> Key | None:
        skipped, found = [], None
        while self.heap:
            uses, tick, key = heapq.heappop(self.heap)
            if self.current.get(key) != (uses, tick):
                continue  # stale
            skipped.append((uses, tick, key))
            if ok(key):
                found = key
                break
        for entry in skipped:
            heapq.heappush(self.heap, entry)
        return found


class _Part:
    """One part's free slots and policy (Note: [Parts of the cache] in _layout.py)."""

    __slots__ = ("slots", "free", "policy")

    def __init__(self, slots: list[Slot], policy: CachePolicy):
        self.slots = slots
        self.free = list(reversed(slots))  # pop() takes its first slot first
        self.policy = _policy(policy)


def _policy(kind: CachePolicy) -> _LRU | _LFU:
    return _LFU() if kind is CachePolicy.LFU else _LRU()


class ExpertCache:
    """``slots`` slots of ``slot_bytes`` in one device allocation (made here, on the compute
    stream, once), cut into ``parts`` (`Part`s: consecutive slots for consecutive layers, Note:
    [Parts of the cache] in _layout.py; default: one part for every layer). ``storage=False``:
    bookkeeping only, nothing allocated (``data`` and ``storage`` are None), for a dry runtime
    (the planner's replay of a routing profile)."""

    def __init__(self, slots: int, slot_bytes: int, device: torch.device, policy: CachePolicy,
                 *, storage: bool = True, parts: tuple = ()):  # fmt: skip
        self.data: torch.Tensor | None = None
        self.storage: Any = None
        if storage:
            with torch.inference_mode(False):
                self.data = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device)
            self.storage = self.data.untyped_storage()
        # tensors over the storage by (byte offset, size, stride, dtype): `member_views`
        self.views: dict[tuple, torch.Tensor] = {}
        self.spans: dict[tuple[int, int], torch.Tensor] = {}  # `span`s by (offset, bytes)
        self.slot_bytes = slot_bytes
        self.slots = [Slot(i, i * slot_bytes) for i in range(slots)]
        self.kind = policy
        ranges = [p.slots for p in parts] or [range(slots)]
        if ranges[0].start != 0 or ranges[-1].stop != slots or any(
                a.stop != b.start for a, b in zip(ranges, ranges[1:], strict=False)):  # fmt: skip
            raise ValueError(f"the cache's parts {ranges} do not cover its {slots} slots")
        self.parts = [_Part(self.slots[r.start : r.stop], policy) for r in ranges]
        # each layer's part (none given: every layer in the one part)
        self.layer_part = [i for i, p in enumerate(parts) for _ in p.layers]
        self.where: dict[Key, Slot] = {}
        self.evictions = 0

    def part(self, layer: int) -> _Part:
        """The part caching layer ``layer``'s experts."""
        return self.parts[self.layer_part[layer]] if self.layer_part else self.parts[0]

    def span(self, start: int, nbytes: int) -> torch.Tensor:
        """Bytes [start, start + nbytes) of the storage (uint8), made once and kept (a copy
        into a slot's member is queued at every miss; made outside inference mode, as it is
        written in and out of it)."""
        t = self.spans.get((start, nbytes))
        if t is None:
            with torch.inference_mode(False):
                t = self.spans[start, nbytes] = self.data[start : start + nbytes]
        return t

    def lookup(self, key: Key) -> Slot | None:
        return self.where.get(key)

    def take(self, layer: int, spare: Callable[[Key], bool]) -> Slot | None:
        """An empty slot of layer ``layer``'s part to copy into: a free one, else the part's
        policy's choice among unpinned experts for which ``spare`` is false (evicted). None
        when there is none."""
        part = self.part(layer)
        if part.free:
            return part.free.pop()
        where = self.where
        key = part.policy.victim(lambda k: where[k].pins == 0 and not spare(k))
        return None if key is None else self._evict(key)

    def take_routed(self, later: list[Key]) -> Slot | None:
        """An empty slot when only experts routed later are left to evict: the one routed
        last (``later`` in routing order, of one layer: its part's)."""
        for key in reversed(later):
            slot = self.where.get(key)
            if slot is not None and slot.pins == 0:
                return self._evict(key)
        return None

    def _evict(self, key: Key) -> Slot:
        slot = self.where.pop(key)
        self.part(key[0]).policy.remove(key)
        slot.key = None
        self.evictions += 1
        return slot

    def assign(self, slot: Slot, key: Key, ready: Any) -> None:
        """``slot`` holds ``key`` from now (its copy queued, ``ready`` after it)."""
        slot.key = key
        slot.ready = ready
        slot.waited = set()
        slot.done = {}  # the copy waited on them: later copies are ordered after it
        self.where[key] = slot
        self.part(key[0]).policy.add(key)

    def use(self, key: Key) -> None:
        self.part(key[0]).policy.use(key)

    def forget(self, key: Key) -> None:
        """The cached copy of ``key`` is stale: its slot is free (its done events kept)."""
        slot = self.where.pop(key, None)
        if slot is None:
            return
        part = self.part(key[0])
        part.policy.remove(key)
        slot.key = None
        slot.ready = None
        part.free.append(slot)

    def policy_order(self) -> list[Key]:
        """The cached experts, part by part, each part's first victim first among equal uses
        (LRU: least recently used first; LFU: by its ticks)."""
        out: list[Key] = []
        for part in self.parts:
            policy = part.policy
            if isinstance(policy, _LRU):
                out += policy.order
            else:
                out += sorted(policy.current, key=lambda k, c=policy.current: c[k][1])
        return out

    def policy_uses(self) -> dict[Key, int]:
        """Uses since setup (LFU's counts; empty for LRU)."""
        out: dict[Key, int] = {}
        for part in self.parts:
            if isinstance(part.policy, _LFU):
                out |= part.policy.uses
        return out

    def load_map(self, located: list[tuple[Key, int]], uses: dict[Key, int]) -> None:
        """Replace the map: ``located`` (key, slot index) in the policy's order, first victim
        first; ``uses`` (LFU's counts since setup). Every slot's events are dropped: the
        caller synchronized with the work that read or wrote them."""
        self.where = {}
        for part in self.parts:
            part.policy = _policy(self.kind)
        for key, n in uses.items():
            policy = self.part(key[0]).policy
            if isinstance(policy, _LFU):
                policy.uses[key] = n
        for slot in self.slots:
            slot.key = None
            slot.ready = None
            slot.waited = set()
            slot.done = {}
        for key, index in located:
            slot = self.slots[index]
            slot.key = key
            self.where[key] = slot
            self.part(key[0]).policy.add(key)
        for part in self.parts:
            part.free = [s for s in reversed(part.slots) if s.key is None]

    def clear(self) -> None:
        for key in list(self.where):
            self.forget(key)

    def release(self) -> None:
        self.clear()
        self.data = self.storage = None
        self.views = {}
        self.spans = {}
