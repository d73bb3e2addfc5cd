"""Routed experts inside a CUDA graph: the routing, the cache's map and the copies of missed
experts stay on the device, so a decode step that loads the experts its router picks can be
captured once and replayed (`ExpertStreamHandle.cuda_graph`).

Note: [Routed experts in a CUDA graph]
A captured graph cannot ask the host which experts a router picked, so in a captured call every
decision is made by kernels, from tables on the device (`DeviceTables`):
- ``slot_of[key]``: the cache slot holding expert ``key`` (a layer's first key plus the expert
  index), -1 if none; ``key_of[s]`` and ``stamp[s]`` for each cache slot (the expert in it and
  when it was last used); ``uses[key]`` (uses since setup, for "lfu"); a ``clock``. Each table
  has one spare entry at its end (the *trash*): a write that must not happen is sent there, so
  every update has a fixed shape and no host decision.
- Graph mode keeps the last ``top_k`` slots of each part of the cache (Note: [Parts of the
  cache] in _layout.py) as its *stage*: the routed expert at place r (routed experts in
  ascending order, as the resident loop visits them) is computed from stage slot r of its
  layer's part, at an address fixed at capture (grouped_mm experts: from their own slots, see
  below). The others (``cache slots``, [lo, hi) of the layer's part) cache its experts.
- One block call of one token (``top_k`` routed experts; on CUDA in one kernel, see
  _kernels.py's Note: [One routing kernel per call]): the routed experts are sorted; a hit
  is an expert with a slot; each miss takes, in order, the unpinned slot of least score (LRU:
  the stamp; LFU: uses, then the stamp; an empty slot first; a slot hit by this call is pinned)
  while there are unpinned slots; the tables are updated through the trash entries. A pinned
  slot scores 2**62 and the LFU score counts uses up to 2**22 - 1 (``_USES_CAP``; past it,
  ties go by the stamp), so no unpinned score reaches it: a miss never takes the slot of an
  expert its call hits, whose stage copy reads it.
- One copy kernel then fills the stage (grouped_mm experts instead compute in the slots they
  are in: Note: [Experts computed in their slots]): a hit from its cache slot (device to
  device), a miss from the host store, read by the kernel through its mapped address (pinned
  host memory is addressable from the device under unified addressing), and written to its
  new cache slot as well. A miss left without a slot is copied to the stage only. The copies
  run on two side streams, ordered against the compute stream by events (grouped_mm experts
  without a prefetch: on the compute stream itself; Note: [Two copy streams]): the stage is
  written after the previous block's compute read it and read after it was written, in every
  replay. Copies over the link that the kernel drives
  run at 47-50 GB/s (H200), against 54 GB/s for the copy engine
  (Note: [How many programs copy over the link] in _kernels.py).
- The experts then compute with the resident loop's operations, in its order, on the stage's
  bytes (or their slots'), whose addresses keep the resident slices' alignment modulo 512
  (every member's size is a multiple of 512 bytes in graph mode, checked at `cuda_graph`): one
  token's output is bitwise the resident model's.
- With ``prefetch=True``, see Note: [Prefetch by the next router].
A call run eagerly on this path (a block graph's warm-up, any such call on the CPU) that
raises after the tables' update and before its copies are queued (an interrupt, out of memory)
would leave slots named for bytes never written: the map is emptied (`DeviceTables.forget`),
so every expert is a miss again. A replay is all or nothing; a capture runs nothing.
Who owns the map: the host (`ExpertCache`) in eager calls, the device tables in graph calls.
Before a capture or a replay the host's map is written to the tables (``push``: the stage
slots are emptied first, and the compute stream waits on every eager copy in flight and every
eager read of a slot, on any stream); before an eager block call, a write of the host store,
``cached()`` or ``remove()`` it is read back (``pull``: the device synchronized, so graph calls
on every stream are done, after which every slot is free to be overwritten by an eager
copy). Counters are kept on the device and added to the host's on
``stats()``. On the CPU the same tables, updates and copies run as tensor operations (the
copies index the host store's and the cache's bytes), so the bookkeeping is tested without a
GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import sys
from typing import Any

import torch
import torch.nn.functional as F

from torchoffload.moe._cache import CachePolicy
from torchoffload.moe._grouped import grouped_linear
from torchoffload.moe._layout import ALIGN, LayoutKind, check_grouped, check_held, implementation
from torchoffload.moe._outside import RoutedOutside

# Note: [Prefetch by the next router]
# A block's experts can be copied only after its router ran, so in a graph call the link idles
# while a block computes unless the next block's experts are known earlier. The residual stream
# changes little from one block to the next, so the next block's router run on this block's
# hidden states (the experts' input) predicts most of its choice (pre-gating). With
# ``prefetch``, right after a block's own copies are queued, the next block's router runs on
# its hidden states, and of the predicted experts the cache lacks, the ``prefetch`` (a count;
# ``True``: 2) the router scores highest take slots (the same victim rule; stamped as used
# now; never a slot this block's call uses) and are copied into the cache on the link's
# stream, after this block's misses (Note: [Two copy streams]). The next block's own routing
# then finds them as hits. A wrong prediction costs link time and may evict a useful expert;
# outputs never change (every expert computes from the bytes of the expert its own router
# picked). Counted in ``stats().prefetched``, and in ``h2d_bytes``. Only graph calls prefetch:
# an eager call's Python runs long enough that its copies are already overlapped; and only
# where the cache has more slots than a call uses (``top_k``: a call of ``top_k`` experts pins
# them all).
# Why a count: the next block waits for every copy of the prefetch, used or not (the compute
# stream waits on the link's event after that block's misses, queued behind the prefetch; a
# graph's dependencies cannot depend on the routing). What pays is about as many experts as
# the link copies while a block computes, rounded up, the likeliest first (Qwen3-30B-A3B on an
# H200: a layer's decode step about 230 us, an expert 9.4 MB at about 48 GB/s 200 us, so 1.15
# experts; 2 measured faster than 1 and than every predicted expert). Scores that are NaN rank
# last (as -inf), so that the ranks stay unique: two experts never take one slot.
# Measured (H200, torch 2.11, 2026-11-29, Qwen3-30B-A3B shape, 48 layers, grouped_mm, decode
# replayed; benchmarks/moe.py --prefetch 2,8, log 2026-11-29-moe-routing-kernel.md, session
# 40): ms a token without prefetch / every predicted expert (8) / 2, uniform and Zipf routing:
# 16 GiB 67.4 / 67.3 / 58.1 and 42.4 / 38.2 / 34.4; 32 GiB 58.0 / 50.9 / 48.0 and 18.6 / 18.1 /
# 17.0. In probes on that lease: every predicted expert at 16 GiB uniform copied 277 experts
# a token ahead to spare 207 misses (3092 MiB a token against 2461 without), no faster, the
# link being the bound; 1 a call was slower than 2 (16 GiB: 62.1 against 59.3 ms uniform, 39.5
# against 37.3 Zipf). Before the count (every predicted expert; session 24, log
# 2026-11-27-moe-prefetch.md): 2-14% faster than without, 19-25% bytes more. The kernel's
# link rate and its effect on compute beside it: Note: [How many programs copy over the link]
# in _kernels.py. Off by default: the gain hangs on the model's next-block prediction.

# Note: [Two copy streams]
# A graph call's copies run on two streams beside the compute stream: ``side`` copies over the
# link (a miss to the stage and its cache slot, then the prefetch of the next block), ``near``
# copies a hit from its cache slot to the stage (device to device). Per place, the compute
# stream waits on an event of each before the expert. Invariants:
# - Both wait on the compute stream first: the stage's place r (written by exactly one of them:
#   a place is a miss or a hit) and every victim slot were last read by work the compute stream
#   queued before (the previous block's experts, which waited on the previous copies).
# - ``near`` also waits on ``side`` as it was before this call's misses were queued: a hit's
#   slot was filled by an earlier miss or prefetch on ``side``; the hits do not wait for this
#   call's misses.
# - No copy over the link overwrites a slot that a hit's copy may still read: a miss never takes
#   a slot hit by its call (pinned), and the prefetch queued after the call (the only copy on
#   ``side`` before the compute stream waits on the hits' events) pins every slot the call used
#   (`DeviceTables.used`); a later call's copies wait on the compute stream.
# - In a capture every copy is joined back: a place's events are waited on by the compute
#   stream, and a prefetch by the next call's ``near`` (whose events the compute stream waits
#   on); the last block does not prefetch, and a captured function that ends after a block's
#   prefetch (one block captured alone) has both streams joined at the capture's end
#   (`ExpertGraphs.finish_capture`).
# With one stream, a hit's stage copy (about 9.4 MB at 545 GB/s, Qwen3-30B-A3B) queued between
# the link's copies, so the link idled for every hit. grouped_mm experts copy no hit (Note:
# [Experts computed in their slots]), and their calls queue nothing on ``near``.
# Without a prefetch (``apart`` false), grouped_mm experts' copies go on the compute stream
# itself: the compute waits for a call's misses right after its routing, so a side stream
# overlapped nothing, and each call's fork and join cost graph time. Measured (H200, torch
# 2.11, 2026-11-29, Qwen3-30B-A3B shape, 48 layers, every expert cached, replayed; a probe,
# log 2026-11-29-moe-routing-kernel.md, session 41): a replay's GPU time 11.69 / 11.70 ms
# (uniform / Zipf routing) on the compute stream against 11.89 / 11.88 on ``side`` (the
# resident model's graph: 10.80 / 10.71); at 16 GiB (Zipf, misses copied) 42.58 against 43.12.
# The choice is the runtime's, not a call's: a call on the compute stream would have to wait
# for a prefetch the call before it queued on ``side``. So with ``prefetch`` set, block graphs
# (Note: [Block calls replayed as graphs] in _replayed.py), whose calls do not prefetch, still
# copy on ``side``.

# Note: [Experts computed in their slots]
# transformers' grouped_mm experts (its default) compute in a graph call from the slots the
# routed experts are in, not from the stage. A grouped GEMM takes every group's weights as one
# tensor, the groups on its leading dimension, and sends rows to groups by offsets it reads on
# the device: over a member's view of a window of slots (one slot's bytes apart), with the
# token's rows sorted by slot and the offsets counted from the slots (`torch.searchsorted`), it
# computes each routed expert where it is, with no host decision and no copy. torch's CUDA
# kernel takes at most 1023 groups (`GROUP_LIMIT`), so the window is the layer's part of the
# cache (`Stage.window`; Note: [Parts of the cache] in _layout.py), its stage among them. Every
# place computes there: a hit is not copied, a miss is copied into the cache slot it got, or
# into its stage place where it got none. (The plan's ``inside`` flags say so per place; every
# place is inside since the cache has parts.) Invariants:
# - Bitwise: a grouped GEMM's row depends on its group's weights alone, whatever the group count
#   (Note: [Grouped experts, one group at a time]), and every slot's member keeps the resident
#   slice's address modulo 512 (graph mode's member sizes are multiples of 512).
# - Ordering, as Note: [Two copy streams]: one launch per stream for every place, the compute
#   stream waiting on both events before the GEMMs (without a prefetch, one launch on the
#   compute stream itself, before the GEMMs). The link's event is recorded after this
#   call's misses and before the next block's prefetch, so after any earlier prefetch that
#   brought a hit; ``near`` waits for ``side`` before this call's misses. No copy overwrites a
#   slot this call reads before it read it: a miss never takes a slot its call hits, the
#   prefetch after the call pins every slot the call used (`DeviceTables.used`), and a later
#   call's copies wait on the compute stream.
# A layer's window is its part, not several windows of 1023 slots each with a GEMM pair: that
# was measured slower beyond about 4 windows, each window's pair costing about as much as the
# resident call (57-65 us, below). Before the cache had parts, the window was the cache's last
# 1023 slots and a hit before it was copied to the stage (about 17 us, on ``near``): at every
# expert cached (6152 slots at the Qwen3-30B-A3B shape) about 5 of 6 hits were.
# batched_mm and the eager loop still compute from the stage: they index the weights or call
# F.linear on one expert's tensor, at addresses fixed at capture.
# Measured (H200, torch 2.11, 2026-11-29, benchmarks/moe_in_slots.py, 8 Qwen3-30B-A3B experts
# in bf16, replayed): one layer call took 77-81 us computed in 16 or 600 slots, against 339-341
# us copied to the stage first (8 device copies of 64 programs, then 16 grouped GEMMs of one
# group) and 60-61 us for the resident call over 128 experts; every row bitwise the resident
# call's either way. Windows of 1023 slots, one GEMM pair each: 143 us over 1800 slots (2
# windows), 247 us over 3600 (4).

__all__ = ["DeviceTables", "ExpertGraphs", "check_graphable", "graphed_forward", "tables_of"]

_STAMP_BITS = 40  # LFU score: uses above the stamp (stamps stay below 2**40)
# Uses counted in the LFU score: below 2**62 (a pinned slot's score) with any stamp, so an
# unpinned slot always scores below a pinned one (Note: [Routed experts in a CUDA graph])
_USES_CAP = (1 << (62 - _STAMP_BITS)) - 1
_PINNED = 1 << 62  # a pinned slot's score
# the dtypes of a prefetch's scores the routing kernel is compiled for (others: as float32)
_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Graph calls on CUDA route in one kernel (Note: [One routing kernel per call] in _kernels.py);
# False runs the tensor operations there too (the reference the GPU tests compare it with)
FUSED_ROUTING = True


@dataclasses.dataclass
class CallPlan:
    """One graph call's plan, per place (the token's routed experts in ascending order): its
    expert's place in the router's order (``place``) and the inverse (``inv``); whether it is
    valid, a miss (copied over the link), a hit copied to the stage (``held``), a miss also
    written to its cache slot (``also``), given a slot (``write``), computed in its own slot
    (``inside``); per member, the source, first destination (its stage place, or its cache
    slot) and cache destination addresses; ``dead``, per place of the router's order, whether
    its expert is not valid; for grouped_mm experts, per place of the router's order its row
    among the rows sorted by the slot it computes in (``back``) and the window's group offsets
    (Note: [Experts computed in their slots]). Made by `DeviceTables.call`."""

    place: torch.Tensor
    inv: torch.Tensor
    valid: torch.Tensor
    miss: torch.Tensor
    held: torch.Tensor
    also: torch.Tensor
    write: torch.Tensor
    inside: torch.Tensor | None
    src: torch.Tensor
    first: torch.Tensor
    dst: torch.Tensor
    dead: torch.Tensor
    back: torch.Tensor | None = None
    offs: torch.Tensor | None = None


def tables_of(rt: Any) -> DeviceTables:
    """The runtime's device tables, made at its first capture."""
    if rt.tables is None:
        rt.tables = DeviceTables(rt)
    return rt.tables


def check_graphable(rt: Any) -> None:
    """Refuse, before anything is captured, a model whose experts graph mode cannot serve."""
    layout = rt.layout
    for layer in layout.layers:
        if layer.kind is not LayoutKind.FUSED:
            raise ValueError(
                f"cuda_graph replays routed experts of fused experts modules (transformers' "
                f"layout); {layer.name!r} is a ModuleList of expert modules, whose Python runs "
                "per expert and reads the routing on the host. Call the model without "
                "cuda_graph (the eager path serves this layout)"
            )
        for m in layer.members:
            if m.nbytes % ALIGN:
                raise ValueError(
                    f"cuda_graph needs each expert's slice of a fused parameter to be a multiple "
                    f"of {ALIGN} bytes (its address alignment, which kernels may depend on, is "
                    f"then the same for every expert); {layer.name}.{m.name} has {m.nbytes}. "
                    "Call the model without cuda_graph"
                )
    if min(len(p.slots) for p in rt.cache.parts) < layout.top_k:
        raise ValueError("the cache holds fewer slots than one token's routed experts")
    if rt.device.type == "cuda":
        if not rt.store.pinned:
            raise ValueError(
                "cuda_graph reads missed experts from pinned host memory: call "
                "stream_experts with pin_memory=True (the default)"
            )
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ValueError("stream_experts' cuda_graph needs triton (its copy kernel)") from None


class DeviceTables:
    """The cache's map on the device, and the addresses the copy kernel reads (Note: [Routed
    experts in a CUDA graph])."""

    def __init__(self, rt: Any):
        layout = rt.layout
        dev = rt.device
        self.rt = rt
        self.k = k = layout.top_k
        self.trash = len(rt.cache.slots)  # the slot tables' spare entry
        # per layer, its part's cache slots [lo, hi); its stage: slots [hi, hi + k) (Note:
        # [Parts of the cache] in _layout.py)
        self.lo = [rt.cache.part(li).slots[0].index for li in range(len(layout.layers))]
        self.hi = [rt.cache.part(li).slots[-1].index + 1 - k for li in range(len(layout.layers))]
        # a part of no more cache slots than a call uses has none left for a prefetch (a call
        # of ``k`` experts pins them all; one routed partly to the layer's "none" expert may
        # leave some, and its prefetch is skipped too): the next router is not run
        self.prefetches = rt.config.prefetch > 0 and min(map(operator.sub, self.hi, self.lo)) > k
        # a prefetch copies at most this many experts (Note: [Prefetch by the next router])
        self.ahead = min(rt.config.prefetch, k)
        self.keys = layout.total_experts
        # each layer's first key
        self.first = [0, *itertools.accumulate(layer.experts for layer in layout.layers)][:-1]
        self.lfu = rt.config.policy is CachePolicy.LFU
        i64 = dict(dtype=torch.int64, device=dev)
        with torch.inference_mode(False), torch.no_grad():
            self.slot_of = torch.full((self.keys + 1,), -1, **i64)
            self.key_of = torch.full((self.trash + 1,), -1, **i64)
            self.stamp = torch.zeros(self.trash + 1, **i64)
            self.uses = torch.zeros(self.keys + 1, **i64)
            self.clock = torch.zeros(1, **i64)
            # per layer: calls, tokens, hits, misses, prefetched
            self.counts = torch.zeros(len(layout.layers), 5, **i64)
            self.order = torch.arange(self.k, **i64)
            self.before = torch.ones(self.k, self.k, dtype=torch.bool, device=dev).tril()
            self.token = torch.zeros(1, **i64)
            self.big = torch.full((1,), _PINNED, **i64)
            self.none = torch.full((1,), -1, **i64)
            self.used = torch.full((self.k,), self.trash, **i64)  # the last call's slots
        self.copies = Stage(rt, self.lo, self.hi, self.k, apart=self.prefetches)
        self.outside = RoutedOutside(rt)  # Note: [Routed outside a layer] in _outside.py
        c = self.copies
        self.cache_base, self.region, self.stage, self.host = c.base, c.region, c.stage, c.host
        self.owned = False  # the device's map is the one in force
        self.warm = False  # the routing kernel compiled

    # -- the map between host and device --------------------------------------------------------

    def push(self) -> None:
        """The host's map to the tables (before a capture or a replay); the compute stream
        waits for the eager copies still in flight (graph calls read and write any slot),
        a staged call's into its regions too."""
        if self.owned:
            return
        cache, engine, waited = self.rt.cache, self.rt.engine, set()
        for slot in cache.slots:
            # the copies in flight into a slot, and every read of it (an eager call's, on any
            # compute stream; a staged call's copy out of it, REGION_COPY): a graph call may
            # write any slot
            for event in (slot.ready, *slot.done.values()):
                if event is not None and id(event) not in waited:
                    waited.add(id(event))
                    engine.wait(event)
        for slot in (cache.slots[s] for hi in set(self.hi) for s in range(hi, hi + self.k)):
            if slot.key is not None:  # every part's stage: emptied
                cache.forget(slot.key)
        key_of = [-1] * (self.trash + 1)
        stamp = [-1 - i for i in range(self.trash + 1)]  # empty slots first
        slot_of = [-1] * (self.keys + 1)
        order = cache.policy_order()  # keys, least recently used first
        for t, key in enumerate(order):
            s = cache.where[key].index
            key_of[s] = self.first[key[0]] + key[1]
            stamp[s] = t
            slot_of[key_of[s]] = s
        uses = [0] * (self.keys + 1)
        for key, u in cache.policy_uses().items():
            uses[self.first[key[0]] + key[1]] = u
        with torch.inference_mode(False), torch.no_grad():
            for table, values in ((self.key_of, key_of), (self.stamp, stamp),
                                  (self.slot_of, slot_of), (self.uses, uses)):  # fmt: skip
                table.copy_(torch.tensor(values, dtype=torch.int64), non_blocking=False)
            self.clock.fill_(len(order))
        self.owned = True

    def pull(self) -> None:
        """The tables' map back to the host's cache (one host sync); every slot's events are
        dropped (the sync waited for the work that read or wrote it)."""
        if not self.owned:
            return
        self.rt._sync()  # graph calls on any stream wrote the tables and read the slots,
        # whose events are dropped below
        pull_counts(self)
        key_of = self.key_of.tolist()
        stamp = self.stamp.tolist()
        uses = self.uses.tolist()
        located = sorted((stamp[s], s) for s in range(self.trash) if key_of[s] >= 0)
        keys = {first + e: (li, e) for li, first in enumerate(self.first)
                for e in range(self.rt.layout.layers[li].experts)}  # fmt: skip
        self.rt.cache.load_map([(keys[key_of[s]], s) for _, s in located],
                               {keys[i]: u for i, u in enumerate(uses[:-1]) if u})  # fmt: skip
        self.owned = False
        self.outside.check()  # after the sync: Note: [Routed outside a layer] in _outside.py

    def forget(self) -> None:
        """Empty the map (every expert a miss from now on): a call that raised between its
        update of the tables and the queueing of its copies left slots named for bytes never
        written (Note: [Routed experts in a CUDA graph])."""
        with torch.inference_mode(False), torch.no_grad():
            self.slot_of.fill_(-1)
            self.key_of.fill_(-1)
            self.used.fill_(self.trash)

    # -- one block call -------------------------------------------------------------------------

    def _admit(self, li: int, experts: torch.Tensor, pinned: torch.Tensor | None = None,
               place: torch.Tensor | None = None,
               score: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """Find ``experts`` (sorted; the layer's expert count marks none) in the cache and
        give each miss, in order, a slot while unpinned slots last (a slot hit by these
        experts is pinned, and the slots in ``pinned``, the cache's slot count marking none);
        the map updated; victims are cache slots of the layer's part (Note: [Parts of the cache]
        in _layout.py). ``place`` and ``score``: a prefetch's, each expert's place in the
        router's order and its score there: the misses are ranked by score (the earlier place
        first among equals), and only the first ``ahead`` are candidates (Note: [Prefetch by
        the next router]). Returns key, valid, slot, hit, miss, write (got a slot), vslot (that
        slot) and its cache addresses."""
        n = self.rt.layout.layers[li].experts
        trash_key = self.keys
        valid = experts < n
        key = torch.where(valid, experts + self.first[li], trash_key)
        slot = self.slot_of[key]
        hit = slot >= 0
        miss = valid & ~hit
        if place is None:  # misses before each, itself too, less one
            chosen, rank = miss, (self.before & miss.unsqueeze(0)).sum(1) - 1
        else:
            chosen, rank = _by_score(miss, place, score, self.ahead)
        lo, hi = self.lo[li], self.hi[li]
        sc = hi - lo
        if not sc:
            return key, valid, slot, hit, miss, torch.zeros_like(miss), None, self.stage[li]
        score = self.stamp[lo:hi]
        owner = self.key_of[lo:hi]
        if self.lfu:
            scored = self.uses[torch.where(owner >= 0, owner, trash_key)]
            score = scored.clamp(max=_USES_CAP) * (1 << _STAMP_BITS) + score
            score = torch.where(owner >= 0, score, self.stamp[lo:hi])
        score = torch.cat([score, self.big])  # a pin outside the part goes to its end
        score.index_put_((torch.where(hit, slot - lo, sc),), self.big)  # pinned: the hits
        if pinned is not None:
            inside = (pinned >= lo) & (pinned < hi)
            score.index_put_((torch.where(inside, pinned - lo, sc),), self.big)
        nv = min(self.k, sc)
        victims = torch.topk(score[:sc], nv, largest=False).indices + lo
        free = torch.clamp(sc - (score[:sc] >= self.big).sum(), max=nv)  # unpinned slots
        write = chosen & (rank < free)
        vslot = victims[rank.clamp(0, nv - 1)]
        old = self.key_of[vslot]
        self.slot_of.index_put_((torch.where(write & (old >= 0), old, trash_key),), self.none)
        self.slot_of.index_put_((torch.where(write, key, trash_key),), vslot)
        self.key_of.index_put_((torch.where(write, vslot, self.trash),), key)
        self.slot_of[trash_key:].fill_(-1)
        dst = self.cache_base + vslot.unsqueeze(1) * self.rt.cache.slot_bytes + self.region[li]
        return key, valid, slot, hit, miss, write, vslot, dst

    def route(self, li: int, experts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tables' update for one token routed to ``experts`` (sorted, ``k`` of them; the
        layer's expert count marks none) and the copy plan: per place, its source addresses,
        whether it is valid, whether it is a miss, the cache addresses a miss is written to,
        whether it is, and the slot the place's expert is in once copied (a hit's, a written
        miss's, else the stage's place: Note: [Experts computed in their slots])."""
        n = self.rt.layout.layers[li].experts
        key, valid, slot, hit, miss, write, vslot, dst = self._admit(li, experts)
        at = self.hi[li] + self.order  # the part's stage
        if self.hi[li] > self.lo[li]:
            at = torch.where(hit, slot, torch.where(write, vslot, at))
            used = torch.where(hit, slot, torch.where(write, vslot, self.trash))
            self.stamp.index_put_((used,), self.clock + self.order)
            self.clock.add_(self.k)
            # pinned by the next prefetch (Note: [Prefetch by the next router]); written in
            # place: a captured call's own tensor would keep its graph's pool alive
            self.used.copy_(used)
        self.uses.index_put_((key,), torch.ones_like(key), accumulate=True)
        self.uses[self.keys :].fill_(0)
        host = self.host[li][torch.where(valid, experts, n)]
        sb = self.rt.cache.slot_bytes
        cached = self.cache_base + slot.clamp(min=0).unsqueeze(1) * sb + self.region[li]
        src = torch.where(miss.unsqueeze(1), host, cached)
        counts = self.counts[li]
        counts[:2] += 1  # a call of one token
        counts[2] += (valid & hit).sum()
        counts[3] += miss.sum()
        return src, valid, miss, dst, write, at

    @property
    def fused(self) -> bool:
        """Whether calls route in one kernel (on CUDA: Note: [One routing kernel per call] in
        _kernels.py) rather than as tensor operations (the CPU's path, and the reference)."""
        return self.copies.cuda and FUSED_ROUTING

    def call(self, li: int, index: torch.Tensor, direct: bool) -> CallPlan:
        """Route one token's experts ``index`` (the router's order; an index outside the
        layer, negative or not, is none: it adds zeros) and plan its copies (`CallPlan`): the
        tables updated as `route` does, in one kernel where `fused`. ``direct``: grouped_mm
        experts, computed in the slots of the window (Note: [Experts computed in their
        slots])."""
        if self.fused:
            return _fused(self, li, index, direct=direct)
        experts, place = _none_outside(index, self.rt.layout.layers[li].experts).sort(stable=True)
        inv = torch.empty_like(place)
        inv[place] = self.order
        src, valid, miss, dst, write, at = self.route(li, experts)
        c = self.copies
        inside = at >= c.window(li) if direct else None
        first, held, also = c.derive(li, valid, miss, dst, write, inside)
        plan = CallPlan(place, inv, valid, miss, held, also, write, inside, src, first, dst,
                        ~valid[inv])  # fmt: skip
        if direct:
            back, plan.offs = _by_slot(self, li, torch.where(inside, at, self.hi[li] +
                                                             self.order))  # fmt: skip
            plan.back = back[inv]  # in the router's order
        return plan

    def prefetch(self, li: int, experts: torch.Tensor, score: torch.Tensor) -> None:
        """Copy into the cache, on the link's stream after this call's misses, the predicted
        ``experts`` of layer ``li`` that it lacks, at most ``ahead`` of them, those of most
        ``score`` (the router's, per expert) first, never into a slot the call before it used
        (Note: [Two copy streams]; Note: [Prefetch by the next router]); they count as used
        now (LRU) and not as uses (LFU)."""
        if self.hi[li] == self.lo[li]:
            return
        self.copies.copy_ahead(li, *self.plan_prefetch(li, experts, score))

    def plan_prefetch(self, li: int, experts: torch.Tensor,
                      score: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """`prefetch`'s routing (the tables updated): per place (the experts sorted), the host
        addresses of its expert, the cache addresses it is written to, and whether it is."""
        if self.fused:  # Note: [One routing kernel per call] in _kernels.py
            plan = _fused(self, li, experts, prefetch=True, score=score)
            return plan.src, plan.dst, plan.write
        n = self.rt.layout.layers[li].experts
        experts, place = _none_outside(experts, n).sort(stable=True)
        key, valid, slot, hit, miss, write, vslot, dst = self._admit(li, experts, self.used,
                                                                     place, score)  # fmt: skip
        self.stamp.index_put_((torch.where(write, vslot, self.trash),),
                              self.clock + self.order)  # fmt: skip
        self.clock.add_(self.k)
        self.counts[li, 4] += write.sum()
        return self.host[li][torch.where(valid, experts, n)], dst, write


def pull_counts(tables: DeviceTables) -> None:
    """The device's counters added to the host's, and zeroed (one host sync)."""
    counts = tables.counts.tolist()
    if not any(any(row) for row in counts):
        return
    for li, (calls, tokens, hits, misses, prefetched) in enumerate(counts):
        c = tables.rt.counters[li]
        c.calls += calls
        c.tokens += tokens
        c.hits += hits
        c.misses += misses
        c.prefetched += prefetched
        c.loads += misses + prefetched
        c.h2d_bytes += (misses + prefetched) * tables.rt.layout.layers[li].expert_bytes
    with torch.inference_mode(False), torch.no_grad():
        tables.counts.zero_()


def _none_outside(index: torch.Tensor, n: int) -> torch.Tensor:
    """``index`` with every expert outside the layer's ``n`` (a negative one too) as none
    (``n``): it adds zeros, as the routing kernel makes it (a negative index would otherwise
    name another layer's expert)."""
    return torch.where((index >= 0) & (index < n), index, n)


def _by_score(miss: torch.Tensor, place: torch.Tensor, score: torch.Tensor,
              ahead: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A prefetch's misses (``miss``, per place; ``place``: each one's in the router's order)
    ranked by ``score`` (NaN as -inf; the earlier place first among equals), and those below
    ``ahead`` (Note: [Prefetch by the next router]): chosen, and the misses ahead of each."""
    w = score[place].float()
    w = torch.where(w.isnan(), float("-inf"), w)  # NaN last: the order stays total, ranks unique
    w0, w1 = w.unsqueeze(0), w.unsqueeze(1)
    first = (w0 > w1) | ((w0 == w1) & (place.unsqueeze(0) < place.unsqueeze(1)))
    rank = (first & miss.unsqueeze(0)).sum(1)
    return miss & (rank < ahead), rank


def _by_slot(tables: DeviceTables, li: int,
             computed: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Each place's row among the rows sorted by the slot it computes in (``computed``), and the
    window's group offsets (Note: [Experts computed in their slots])."""
    by_slot, order = torch.sort(computed)
    ends = torch.arange(tables.copies.window(li), tables.hi[li] + tables.k,
                        device=computed.device)  # fmt: skip
    back = torch.empty_like(order)
    back[order] = tables.order
    return back, torch.searchsorted(by_slot, ends, right=True).to(torch.int32)


def _fused(tables: DeviceTables, li: int, index: torch.Tensor, *, direct: bool = False,
           prefetch: bool = False, score: torch.Tensor | None = None,
           on: tuple | None = None) -> CallPlan:  # fmt: skip
    """`DeviceTables.call` (or `plan_prefetch`'s routing, ``score`` per expert of ``index``)
    in one kernel (Note: [One routing kernel per call] in _kernels.py), on the tables ``on``
    (default: ``tables``')."""
    from torchoffload.moe._kernels import route_call

    c = tables.copies
    if on is None:
        on = (tables.slot_of, tables.key_of, tables.stamp, tables.uses, tables.clock,
              tables.counts, tables.used)  # fmt: skip
    if index.dtype != torch.int64:
        index = index.to(torch.int64)
    flags, addrs, perms, offs = route_call(
        index.contiguous(), on, c.host[li], c.region[li], c.stage[li],
        first_key=tables.first[li], experts=tables.rt.layout.layers[li].experts,
        lo=tables.lo[li], hi=tables.hi[li], trash=tables.trash, cache_base=c.base,
        slot_bytes=tables.rt.cache.slot_bytes, window=c.window(li), layer=li, big=_PINNED,
        cap=_USES_CAP, stamp_bits=_STAMP_BITS, lfu=tables.lfu,
        prefetch=prefetch, direct=direct, ahead=tables.ahead,
        score=None if score is None else score.contiguous(),
    )  # fmt: skip
    valid, miss, held, also, write, inside, dead = flags
    src, first, dst = addrs
    place, inv, back = perms
    return CallPlan(place, inv, valid, miss, held, also, write, inside if direct else None,
                    src, first, dst, dead, back if direct else None, offs)  # fmt: skip


def warm_routing(tables: DeviceTables) -> None:
    """Compile the routing kernel for every layer's calls and prefetches (outside a capture),
    on copies of the tables: nothing changes."""
    if not tables.fused or tables.warm:
        tables.warm = True
        return
    with torch.inference_mode(False), torch.no_grad():
        on = tuple(t.clone() for t in (tables.slot_of, tables.key_of, tables.stamp, tables.uses,
                                       tables.clock, tables.counts, tables.used))  # fmt: skip
        for li, layer in enumerate(tables.rt.layout.layers):
            none = torch.full((tables.k,), layer.experts, dtype=torch.int64,
                              device=tables.rt.device)  # fmt: skip
            for direct in (False, True):
                _fused(tables, li, none, direct=direct, on=on)
            if tables.prefetches and tables.hi[li] > tables.lo[li]:
                for dtype in _SCORE_DTYPES:
                    score = torch.zeros(tables.k, dtype=dtype, device=tables.rt.device)
                    _fused(tables, li, none, prefetch=True, score=score, on=on)
    tables.warm = True


class Stage:
    """The stages (each part's last ``k`` slots, Note: [Parts of the cache] in _layout.py), the
    addresses the copy kernel reads, and the copies (Note: [Routed experts in a CUDA graph]);
    ``lo`` and ``hi``: per layer, its part's first slot and its stage's; ``apart``: whether
    the copies of experts computed in their slots go on streams of their own (the tables
    prefetch: Note: [Two copy streams])."""

    def __init__(self, rt: Any, lo: list[int], hi: list[int], k: int, apart: bool = True):
        dev = rt.device
        self.rt = rt
        self.k = k
        self.cuda = dev.type == "cuda"
        i64 = dict(dtype=torch.int64, device=dev)
        self.base = base = rt.cache.data.data_ptr() if self.cuda else 0
        # per layer: member regions, sizes, the stage's and the host's addresses
        self.region, self.sizes, self.stage, self.host = [], [], [], []
        slot_bytes = rt.cache.slot_bytes
        with torch.inference_mode(False), torch.no_grad():
            self.no_write = torch.zeros(k, dtype=torch.bool, device=dev)
            for li, layer in enumerate(rt.layout.layers):
                self.region.append(torch.tensor([m.region for m in layer.members], **i64))
                self.sizes.append([m.nbytes for m in layer.members])
                stage = [[base + (hi[li] + r) * slot_bytes + m.region
                          for m in layer.members] for r in range(k)]  # fmt: skip
                self.stage.append(torch.tensor(stage, **i64))
                hbase = rt.store.hosts[li].data_ptr() if self.cuda else 0
                # a dry runtime (the planner's replay, perhaps of a shape with no tensors)
                # copies nothing: its host addresses are never read
                offsets = [p.host_offset for p in layer.pieces] if rt.store else None
                rows = []
                for e in range(layer.experts):
                    row = []
                    for m in range(len(layer.members)):
                        piece, offset = layer.source(e, m)
                        row.append(hbase + offset + (offsets[piece] if offsets else 0))
                    rows.append(row)
                rows.append([hbase] * len(layer.members))  # the trash expert (never copied)
                self.host.append(torch.tensor(rows, **i64))
        self.lo, self.hi = lo, hi
        self.apart = apart
        self._slot_views: dict = {}
        self.warm = False
        self.forked: set = set()  # the copy streams this capture queued work on
        if self.cuda:  # the copies over the link, a hit's stage copies; an event per place each
            self.side = torch.cuda.Stream(dev)
            self.near = torch.cuda.Stream(dev)
            self.events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(k)]

    def warm_up(self) -> None:
        """Compile the copy kernel for every layer's shapes (outside a capture), copying
        nothing."""
        if self.warm or not self.cuda:
            self.warm = True
            return
        from torchoffload.moe._kernels import DEVICE_PROGRAMS, LINK_PROGRAMS, copy_routed

        none = torch.zeros(self.k, dtype=torch.bool, device=self.rt.device)
        for li in range(len(self.rt.layout.layers)):
            for places in (1, self.k):  # a stage place, a prefetch
                stage = self.stage[li][:places]
                for programs in (LINK_PROGRAMS, DEVICE_PROGRAMS):
                    copy_routed(stage, stage, none[:places], stage, none[:places],
                                self.sizes[li], programs)  # fmt: skip
        self.warm = True

    def derive(self, li: int, valid: torch.Tensor, miss: torch.Tensor, dst: torch.Tensor,
               write: torch.Tensor,
               inside: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """Per place, where its copy goes first (its stage place, or its cache slot where it
        computes there), whether it is a hit copied to the stage, and whether a miss is also
        written to its cache slot. ``inside``: per place, whether its expert computes in its
        own slot (Note: [Experts computed in their slots]); such a hit is not copied and such a
        miss is copied into its cache slot only."""
        stage = self.stage[li]
        held = valid & ~miss
        first, also = stage, write
        if inside is not None:
            first = torch.where((inside & write).unsqueeze(1), dst, stage)
            also = write & ~inside
            held = held & ~inside
        return first, held, also

    def apply(self, li: int, plan: CallPlan) -> list | None:
        """Fill the stage (and a miss's cache slot) for layer ``li``'s call, as its
        `DeviceTables.call` plan says: each place copied (a miss from the host, a held hit from
        its slot) to ``plan.first``, and to ``plan.dst`` where ``plan.also``; on CUDA queued by
        `_queue`, whose events it returns (the compute stream waits on each before its
        expert; none where the copies queue on the compute stream), on the CPU done."""
        src, first, dst, linked, held, also = (plan.src, plan.first, plan.dst, plan.miss,
                                               plan.held, plan.also)  # fmt: skip
        if self.cuda:
            return self._queue(li, src, first, dst, linked, held, also, plan.inside is not None)
        host = self.rt.store.hosts[li]
        cache = self.rt.cache.data
        copied = (linked | held).unsqueeze(1)
        for m, nbytes in enumerate(self.sizes[li]):
            span = torch.arange(nbytes, dtype=torch.int64)
            from_host = host[(torch.where(linked, src[:, m], 0)).unsqueeze(1) + span]
            from_cache = cache[(torch.where(linked, 0, src[:, m])).unsqueeze(1) + span]
            x = torch.where(linked.unsqueeze(1), from_host, from_cache)
            to = first[:, m].unsqueeze(1) + span  # a place not copied writes back its bytes
            cache.index_put_((to,), torch.where(copied, x, cache[to]))
            to = torch.where(also, dst[:, m], first[:, m]).unsqueeze(1) + span
            cache.index_put_((to,), torch.where(also.unsqueeze(1), x, cache[to]))
        return None

    def _queue(self, li: int, src: torch.Tensor, first: torch.Tensor, dst: torch.Tensor,
               linked: torch.Tensor, held: torch.Tensor, also: torch.Tensor,
               together: bool) -> list:  # fmt: skip
        """`apply`'s launches on CUDA: misses over the link on ``side``, staged hits on
        ``near``; per place (its events) or, ``together``, one launch per stream (on the
        compute stream itself where the copies are not `apart`)."""
        from torchoffload.moe._kernels import DEVICE_PROGRAMS, copy_routed

        # Note: [Two copy streams]. Per place a launch for a miss on the link's stream and one
        # for a hit on the other, with their own program counts (Note: [How many programs copy
        # over the link] in _kernels.py; one of the two copies nothing), then an event on each:
        # place r computes while r + 1... are copied (the plan's tensors live until the
        # caller's compute stream waited on every event: no block of theirs is reused before
        # these copies read it; the tensors made here are recorded on their streams)
        sizes = self.sizes[li]
        if together and not self.apart:  # Note: [Two copy streams]: the compute stream's own
            copy_routed(src, first, linked, dst, also, sizes)
            return []
        compute = torch.cuda.current_stream(self.rt.device)
        near = not together  # a hit may be staged (in slots: never, Note: [Parts of the cache])
        self.forked.add(self.side)
        if near:
            self.forked.add(self.near)
            self.near.wait_stream(self.side)  # before this call's misses
            self.near.wait_stream(compute)
        self.side.wait_stream(compute)
        places = [slice(0, self.k)] if together else [slice(r, r + 1) for r in range(self.k)]
        for p, (over, hit) in zip(places, self.events, strict=False):
            with torch.cuda.stream(self.side):
                copy_routed(src[p], first[p], linked[p], dst[p], also[p], sizes)
                over.record(self.side)
            if near:
                with torch.cuda.stream(self.near):
                    copy_routed(src[p], first[p], held[p], dst[p], self.no_write[p], sizes,
                                DEVICE_PROGRAMS)  # fmt: skip
                    hit.record(self.near)
        for t in (first, linked, also):
            t.record_stream(self.side)
        if near:
            for t in (first, held):
                t.record_stream(self.near)
        if together:
            return [self.events[0] if near else self.events[0][:1]]
        return self.events

    def copy_ahead(self, li: int, src: torch.Tensor, dst: torch.Tensor,
                   write: torch.Tensor) -> None:  # fmt: skip
        """Copy, where ``write``, each place's expert from host addresses ``src`` into cache
        addresses ``dst`` (the prefetch's copy: queued on the link's stream, ``side``)."""
        if self.cuda:
            from torchoffload.moe._kernels import copy_routed

            self.side.wait_stream(torch.cuda.current_stream(self.rt.device))
            self.forked.add(self.side)
            with torch.cuda.stream(self.side):
                copy_routed(src, dst, write, dst, self.no_write, self.sizes[li])
            # made on the compute stream and read by this copy after the caller drops them:
            # their blocks are not reused before the copy ran (in a capture, not at all)
            for t in (src, dst, write):
                t.record_stream(self.side)
            return
        host = self.rt.store.hosts[li]
        cache = self.rt.cache.data
        for m, nbytes in enumerate(self.sizes[li]):
            span = torch.arange(nbytes, dtype=torch.int64)
            for r in range(self.k):  # in order: a place without a copy writes back what is there
                at = dst[r, m] + span
                x = torch.where(write[r], host[src[r, m] + span], cache[at])
                cache.index_put_((at,), x)

    def window(self, li: int) -> int:
        """The first slot of layer ``li``'s grouped GEMMs' window: its part's first (Note:
        [Experts computed in their slots]; Note: [Parts of the cache] in _layout.py)."""
        return self.lo[li]

    def slot_views(self, li: int, first: int, slots: int) -> list[torch.Tensor]:
        """Layer ``li``'s members in ``slots`` slots from slot ``first`` (the stage's places
        are the last slots), each as one tensor with the slots on its leading dimension."""
        key = (li, first, slots)
        out = self._slot_views.get(key)
        if out is None:
            storage = self.rt.cache.storage
            sb = self.rt.cache.slot_bytes
            out = []
            for m in self.rt.layout.layers[li].members:
                t = torch.empty(0, dtype=m.dtype, device=self.rt.device)
                size = t.element_size()
                out.append(t.set_(storage, (first * sb + m.region) // size, (slots, *m.size),
                                  (sb // size, *m.stride)))  # fmt: skip
            self._slot_views[key] = out
        return out

    def views(self, li: int, r: int) -> list[torch.Tensor]:
        """The members of the expert at place ``r`` in layer ``li``'s stage."""
        return [t[0] for t in self.slot_views(li, self.hi[li] + r, 1)]


def graphed_forward(
    rt: Any,
    li: int,
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    prefetch: bool = True,
) -> torch.Tensor:
    """The fused experts' forward in a captured call: one token, its routed experts loaded and
    computed with no host decision (Note: [Routed experts in a CUDA graph]); ``prefetch``:
    the next block's predicted experts copied ahead where the tables prefetch (a block call's
    own graph does not: Note: [Block calls replayed as graphs] in _replayed.py)."""
    tables = rt.tables
    layer = rt.layout.layers[li]
    if hidden_states.dim() != 2 or hidden_states.shape[0] != 1:
        raise RuntimeError(
            f"cuda_graph of stream_experts serves one token per block call (a decode step of "
            f"batch 1); {layer.name!r} was called on {tuple(hidden_states.shape)} hidden "
            "states. Run prefills and larger batches outside the graphed function"
        )
    if top_k_index.shape != (1, tables.k):
        raise RuntimeError(
            f"cuda_graph of stream_experts expects {tables.k} routed experts per token, "
            f"{layer.name!r} got routing of shape {tuple(top_k_index.shape)}: graph mode "
            "needs every expert layer to route the same number of experts per token (top_k). "
            "Call the model without cuda_graph (the eager path serves it)"
        )
    impl = check_grouped(module, layer.name)
    tables.outside.call(li, top_k_index[0], impl)  # Note: [Routed outside a layer]
    direct = impl == "grouped_mm"  # Note: [Experts computed in their slots]
    with torch.no_grad():
        try:
            plan = tables.call(li, top_k_index[0], direct)
            copied = tables.copies.apply(li, plan)
            if prefetch and tables.prefetches and li + 1 < len(rt.layout.layers):
                predicted = predict(rt.layout.layers[li + 1], hidden_states, tables.k)
                if predicted is not None:
                    tables.prefetch(li + 1, *predicted)
        except BaseException:  # run eagerly, the map may name slots never written: emptied
            # (a capture ran nothing: its tables are as they were)
            if not (tables.copies.cuda and torch.cuda.is_current_stream_capturing()):
                tables.forget()
            raise
    place, valid = plan.place, plan.valid
    if impl != "eager":  # Note: [Grouped experts, one group at a time]
        return _graphed_kernels(impl, tables, li, module, hidden_states, top_k_weights, plan,
                                copied)  # fmt: skip
    final = torch.zeros((2, hidden_states.shape[1]), dtype=hidden_states.dtype,
                        device=hidden_states.device)  # fmt: skip
    trash = tables.token + 1
    for r in range(tables.k):
        if copied is not None:
            compute = torch.cuda.current_stream(hidden_states.device)
            for event in copied[r]:
                compute.wait_event(event)
        gate_up_proj, down_proj = tables.copies.views(li, r)
        token_idx = tables.token
        top_k_pos = place[r : r + 1]
        current_state = hidden_states[token_idx]
        gate, up = F.linear(current_state, gate_up_proj).chunk(2, dim=-1)
        current = module.act_fn(gate) * up
        current = F.linear(current, down_proj)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        into = torch.where(valid[r : r + 1], token_idx, trash)  # an expert index of none: trash
        final.index_add_(0, into, current.to(final.dtype))
    return final[:1]


def _graphed_kernels(impl: str, tables: DeviceTables, li: int, module: Any,
                     hidden_states: torch.Tensor, top_k_weights: torch.Tensor, plan: CallPlan,
                     copied: Any) -> torch.Tensor:  # fmt: skip
    """`graphed_forward`'s computation for experts running transformers' ``grouped_mm`` or
    ``batched_mm`` (Note: [Grouped experts, one group at a time]). grouped_mm: the token's row
    through each routed expert in the slot it computes in (Note: [Experts computed in their
    slots]), read back in the router's order, then the resident's weighting and sum over the
    top-k (the resident weights its rows in the experts' order and reorders them: each row
    meets the same weight, so the products are the same bits; one gather and one index fewer a
    call). batched_mm: the staged experts' weights stacked in the token's top-k order (the
    resident's gather), its batched products and sum. An expert index outside the layer
    (``plan.dead``; transformers leaves, masks or clamps it) adds zeros."""
    from transformers.integrations.moe import _batched_linear

    dtype = tables.rt.layout.layers[li].members[0].dtype
    if impl == "grouped_mm" and hidden_states.is_cuda and dtype != torch.bfloat16:
        raise RuntimeError(
            f"cuda_graph of stream_experts with grouped_mm experts in {dtype}: torch's grouped "
            "GEMM for other dtypes than bfloat16 reads its offsets on the host (seen with fp32, "
            "torch 2.11), which a CUDA graph cannot capture, for the resident model too. Use "
            "bfloat16 experts, or experts_implementation='batched_mm' or 'eager' for the graph"
        )
    k = tables.k
    for events in copied or ():
        compute = torch.cuda.current_stream(hidden_states.device)
        for event in events:
            compute.wait_event(event)
    inv_perm, dead = plan.inv, plan.dead.unsqueeze(-1)
    if impl == "batched_mm":
        views = [tables.copies.views(li, r) for r in range(k)]
        rows = hidden_states.repeat_interleave(k, dim=0)
        weights = torch.stack([gu for gu, _ in views])[inv_perm]
        proj = module._apply_gate(
            _batched_linear(rows, weights, is_transposed=module.is_transposed)
        )
        weights = torch.stack([down for _, down in views])[inv_perm]
        proj_out = _batched_linear(proj, weights, is_transposed=module.is_transposed)
        proj_out = proj_out.masked_fill_(dead, 0)
    else:
        proj_out = _in_slots(tables, li, module, hidden_states, plan).masked_fill_(dead, 0)
    weighted_out = proj_out * top_k_weights.reshape(-1).unsqueeze(-1)
    final = weighted_out.view(1, k, hidden_states.shape[1]).sum(dim=1)
    return final.to(hidden_states.dtype)


def _in_slots(tables: DeviceTables, li: int, module: Any, hidden_states: torch.Tensor,
              plan: CallPlan) -> torch.Tensor:  # fmt: skip
    """The token's row through the expert of each place, read in the slot it computes in (each
    in the window): transformers' two grouped GEMMs and gate over the window's views, the rows
    sorted by slot and the groups' offsets counted on the device (``plan.offs``, ``plan.back``;
    Note: [Experts computed in their slots]). Rows in the router's order."""
    k = tables.k
    rows = hidden_states.expand(k, hidden_states.shape[1]).contiguous()
    first = tables.copies.window(li)
    slots = tables.hi[li] + k - first
    gate_up_proj, down_proj = tables.copies.slot_views(li, first, slots)
    proj = module._apply_gate(grouped_linear(rows, gate_up_proj, plan.offs, module))
    out = grouped_linear(proj, down_proj, plan.offs, module)
    return out[plan.back]


def _idle(rt: Any, what: str) -> None:
    """Refuse ``what`` while a block of the model runs (an interrupted one ended first)."""
    rt._reap()
    if any(b.active for b in rt.blocks):
        raise RuntimeError(f"{what} inside a forward of the streamed model")


def predict(layer: Any, hidden_states: torch.Tensor,
            k: int) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """The ``k`` experts ``layer``'s router picks for ``hidden_states`` (one token) and the
    router's score of each (its weight, or logit), in its order; None where its router is not
    found or answers in another form (Note: [Prefetch by the next router])."""
    router = next((getattr(layer.block, n) for n in ("gate", "router") if
                   isinstance(getattr(layer.block, n, None), torch.nn.Module)), None)  # fmt: skip
    if router is None:
        return None
    out = router(hidden_states)
    if isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], torch.Tensor):
        score, index = out[1], out[2]  # transformers' routers: (logits, weights, indices)
    elif isinstance(out, torch.Tensor) and out.shape[-1] == layer.experts:
        score, index = torch.topk(out, min(k, layer.experts), dim=-1)
    else:
        return None
    if index.shape != (1, k) or index.dtype not in (torch.int64, torch.int32):
        return None
    if isinstance(score, torch.Tensor) and score.shape == (1, layer.experts) != (1, k):
        score = score.gather(1, index.to(torch.int64))  # every expert's: the routed ones'
    if not isinstance(score, torch.Tensor) or score.shape != (1, k):
        score = torch.arange(k, 0, -1, dtype=torch.float32, device=index.device)[None]
    elif score.dtype not in _SCORE_DTYPES:
        score = score.float()
    return index[0].to(torch.int64), score[0]


class _Replay:
    __slots__ = ("loaded", "primes")

    def __init__(self) -> None:
        self.loaded = 0
        self.primes: tuple = ()


class ExpertGraphs:
    """The `GraphRuntime` (weights/_graph.py) of `ExpertStreamHandle.cuda_graph`: the device
    tables own the cache's map around a capture and each replay; nothing is primed."""

    def __init__(self, rt: Any):
        self.rt = rt
        self.device = rt.device
        self.engine = rt.engine
        self._held_at = -1  # module registrations counted at the last `check_held` of a replay
        self._handling: BaseException | None = None  # at `start_capture`: see `finish_capture`
        self._fused = [(layer.container, layer.name) for layer in rt.layout.layers
                       if layer.kind is LayoutKind.FUSED]  # fmt: skip

    @property
    def removed(self) -> bool:
        return self.rt.removed

    def graph_ready(self) -> bool:
        return True

    def graph_state(self) -> Any:
        """The fused layers' experts implementations: a graph captured under others is
        captured again (transformers' generate() switches them between prefill and decode).
        Read at every call of the graphed function, so once per module class and config
        (the layers share them: `check_grouped` over 48 layers took 0.4-1.4 ms of Python a
        step on a CPU-only VM); a capture's block calls check the rest (`graphed_forward`). The
        state: each layer's implementation (a layer whose config is replaced by another layer's
        changes it too). Over the fused layers listed at set-up: 29 us at 48 layers on this
        CPU-only VM against 44 reading each layer's kind and module every call (2026-11-29;
        99 us of the 0.48 ms before a replay on an H200's host)."""
        seen: dict = {}
        out = []
        for m, name in self._fused:
            key = (type(m), id(getattr(m, "config", None)))
            impl = seen.get(key)
            if impl is None:
                impl = seen[key] = implementation(m, name)
            out.append(impl)
        return tuple(out)

    def primes(self) -> tuple:
        return ()

    def prepare_capture(self, primes: tuple = ()) -> None:
        rt = self.rt
        with rt._lock:
            rt._check_live()
            _idle(rt, "a captured call")
            check_held(rt.layout)
            tables = tables_of(rt)
            tables.outside.check()  # Note: [Routed outside a layer] in _outside.py
            tables.push()
            tables.copies.warm_up()
            warm_routing(tables)

    def start_capture(self, engine: Any, primes: tuple = ()) -> None:
        tables_of(self.rt).copies.forked.clear()
        self.rt.graphing = True
        self._handling = sys.exc_info()[1]  # an exception the caller is handling, if any

    def finish_capture(self) -> tuple:
        """The copy streams joined to the capture's stream: a captured function that ends
        after a block's prefetch (before the next block, whose stage copies would wait on it)
        leaves the prefetch's copies on ``side`` only, and a capture ends with every stream it
        forked joined (only those: waiting on a stream the capture did not fork is an error)."""
        self.rt.graphing = False
        tables = tables_of(self.rt)
        # a function that returned: its calls' routing checked (Note: [Routed outside a
        # layer]); one that raised (this runs in the capture's `finally`, where its exception
        # is the one being handled) ends a capture that is reset: nothing more queued into it
        if sys.exc_info()[1] is self._handling:
            tables.outside.record()
        else:
            tables.outside.forget()
        self._handling = None  # not kept alive
        copies = tables.copies
        compute = torch.cuda.current_stream(self.device) if copies.forked else None
        for stream in (copies.side, copies.near) if compute is not None else ():
            if stream in copies.forked:
                compute.wait_stream(stream)
        copies.forked.clear()
        return ()

    def end_capture(self, keep: tuple = ()) -> Any:
        from torchoffload.weights._arena import Counters

        self.rt.graphing = False
        self._handling = None
        if self.rt.tables is not None:
            self.rt.tables.outside.forget()
        return Counters()  # a replay's copies depend on its routing: the handle counts them

    @contextlib.contextmanager
    def graph_replaying(self, state: Any, primes: tuple = ()):
        rt = self.rt
        with rt._lock:
            rt._check_live()
            _idle(rt, "a graph replay")
            from torchoffload.weights._graph import _registrations

            # a streamed tensor replaced on its module is a registration (see
            # weights/_graph.py's Note: [The model a graph was captured with]): checked again
            # only after one
            seen = _registrations()
            if seen != self._held_at:
                check_held(rt.layout)
                self._held_at = seen
            tables = tables_of(rt)
            tables.outside.check()  # Note: [Routed outside a layer] in _outside.py
            tables.push()
            yield _Replay()

    def count_replay(self, delta: Any) -> None:
        pass
