"""The expert runtime: a block's routed experts through the device cache. Entry points (the
fused experts' forward, the hooks of a list of expert modules) drive it through ``begin`` /
``route`` / ``enter`` / ``exit`` / ``end`` around one block's use of its experts.

Note: [Routed experts and the copy stream]
The protocol of Note: [H2D into an arena] (in _transfer.py), per expert slot:
- The cache's storage is allocated once, at setup, on the compute stream, and the device is
  synchronized before the first use; afterwards only copies and the experts' compute touch
  it, so a copy waits on no compute-stream work but the reads of the bytes it overwrites.
- ``route`` (the block's router has run and its choice was read on the host) queues, on the
  copy stream, one copy per member of each routed expert not in the cache, in expert order,
  as far as slots can be taken without evicting what the block still needs. Each copy into a
  slot first waits on the slot's "done" events (recorded on the compute stream after the last
  compute that read it, one per compute stream that read it), then records "ready".
- ``enter`` makes the compute stream wait on "ready" of that expert only, and only once per
  compute stream: a hit, or an expert whose copy that stream already waited for, waits on
  nothing. So expert i computes while experts i+1... are still copied.
- ``exit`` records "done" on the compute stream and unpins the slot; a slot is never
  overwritten before the compute that read it is done, because every copy into it waits on
  those events (stream order, no host sync).
- The host store is written only under the runtime's lock, after a device synchronize, while
  no block runs (`_on_write`): a copy never reads bytes being changed, and every cached copy
  of the changed experts is forgotten.
On the CPU the copies are synchronous and every event is None.

Note: [Interrupted expert blocks]
PyTorch skips ``always_call`` forward hooks when a `BaseException` (KeyboardInterrupt) leaves
a forward, so a list block interrupted inside an expert leaves that expert bound to its slot
and its slots pinned. The block's pre-hook gives ``begin`` the frame of the block's call
(`_calls.hook_caller`); the next ``begin``, write of the host store or ``remove()`` ends every
block whose frame is no longer running: it unbinds what it left bound (placeholders again),
records "done" for its slots and unpins them. A fused block needs none of it: its forward
ends the block in a ``finally``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from torchoffload import _hosted
from torchoffload._calls import running
from torchoffload._transfer import copy_engine
from torchoffload.moe._cache import CachePolicy, ExpertCache, Key, Slot
from torchoffload.moe._layout import ExpertLayout
from torchoffload.moe._routing import NO_RECORDER, Recorder
from torchoffload.moe._store import ExpertStore

__all__ = ["Counters", "ExpertConfig", "ExpertRuntime"]


@dataclass(frozen=True)
class ExpertConfig:
    """What `stream_experts` was asked for, checked (strings parsed at the entry)."""

    device: torch.device
    cache_bytes: int
    policy: CachePolicy
    use_streams: bool
    pin_memory: bool
    prefetch: int = 0  # experts a graph call copies ahead for the next block (0: none)
    # bookkeeping only, for the planner's replay of a routing profile: no cache storage, no
    # host store (the model is not touched), nothing copied
    dry: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.policy, CachePolicy):
            raise TypeError(f"policy must be a CachePolicy, got {type(self.policy).__name__}")


@dataclass
class Counters:
    """One layer's counts since setup (or reset)."""

    calls: int = 0  # block calls
    tokens: int = 0  # rows of hidden states through the block
    hits: int = 0  # routed expert found in the cache when the block used it
    misses: int = 0  # routed expert copied for this use
    h2d_bytes: int = 0
    loads: int = 0  # experts copied
    unused: int = 0  # experts copied for a use that did not come
    prefetched: int = 0  # experts copied ahead on the next router's prediction (graph calls)
    host_computed: int = 0  # routed experts computed on the host (Note: [Cold experts on the host])
    staged: int = 0  # copied over the link with their layer, no token of the call routed to


class _Block:
    """One layer's use of its experts in progress."""

    __slots__ = ("active", "order", "index", "q", "acquired", "entered", "implicit", "frame",
                 "thread", "bound")  # fmt: skip

    def __init__(self) -> None:
        self.active = False
        self.implicit = False  # begun by ``enter`` outside a block call
        self.order: list[int] = []  # routed experts, in compute order
        self.index: dict[int, int] = {}  # expert -> its place in ``order``
        self.q = 0  # routed experts acquired so far (``order[:q]``)
        # expert -> (slot, copied for it and not entered yet)
        self.acquired: dict[int, tuple[Slot, bool]] = {}
        self.entered: set[int] = set()  # experts entered and not exited
        self.frame: FrameType | None = None  # the call's frame (None: ends in a finally)
        self.thread = 0
        self.bound: dict[int, Any] = {}  # expert -> its Binding, while bound


class ExpertRuntime:
    """The device cache, the host store and the counters of one streamed model."""

    def __init__(self, layout: ExpertLayout, config: ExpertConfig):
        dev, dry = config.device, config.dry
        self.layout = layout
        self.config = config
        self.device = dev
        # - Copies
        self.engine = copy_engine(dev, use_streams=config.use_streams)
        self._lock = threading.RLock()
        # - The device cache, then the host store (the model's expert tensors become
        #   placeholders: the last step, after every allocation that may fail)
        parts = layout.parts(layout.slots_for(config.cache_bytes))  # Note: [Parts of the cache]
        self.cache = ExpertCache(parts[-1].slots.stop, layout.slot_bytes, dev, config.policy,
                                 storage=not dry, parts=parts)  # fmt: skip
        pin = config.pin_memory and torch.accelerator.is_available() and dev.type != "cpu"
        self.store = None if dry else ExpertStore(layout, dev, pin, self._lock, self._on_write)
        self.empty = torch.empty(0, dtype=torch.uint8, device=dev).untyped_storage()
        self.blocks = [_Block() for _ in layout.layers]
        self.counters = [Counters() for _ in layout.layers]
        self.removed = False
        self.tables: Any = None  # DeviceTables, made at the first capture (Note: [Routed
        self.graphing = False  # experts in a CUDA graph]); whether a captured call runs
        self.recorder: Recorder = NO_RECORDER  # a RoutingRecorder while one is open
        self.host: Any = None  # HostExperts, with host_compute (Note: [Cold experts on the host])
        self.staged: Any = None  # StagedLayers, at the first large grouped_mm call (_grouped.py)
        # BlockGraphs, with block_graphs (Note: [Block calls replayed as graphs] in _replayed.py)
        self.block_graphs: Any = None
        if dev.type != "cpu":
            torch.get_device_module(dev.type).synchronize(dev)

    # -- one block's use of its experts ----------------------------------------------------

    def begin(self, li: int, rows: int, frame: FrameType | None = None) -> None:
        """Layer ``li``'s block starts, on ``rows`` tokens; ``frame``: the Python frame of
        the block's call, when a hook begins it (Note: [Interrupted expert blocks])."""
        layer = self.layout.layers[li]
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"stream_experts serves inference, but {layer.name!r} ran with gradients "
                "enabled: call the model under torch.no_grad() or torch.inference_mode() (an "
                "expert's device bytes are reused by other experts, so autograd cannot keep "
                "them for backward)"
            )
        self._check_live()
        self._reap()
        self.own_map()
        b = self.blocks[li]
        if b.active:
            raise RuntimeError(f"the block of {layer.name!r} was called inside itself")
        b.active = True
        b.frame = frame
        b.thread = threading.get_ident()
        c = self.counters[li]
        c.calls += 1
        c.tokens += rows
        self.recorder.begin(li, rows)

    def route(self, li: int, experts: list[int]) -> None:
        """The block will use ``experts`` (ascending), in that order: queue their copies."""
        b = self.blocks[li]
        b.order = experts
        b.index = {e: i for i, e in enumerate(experts)}
        b.q = 0
        self._fill(li)

    def predict(self, li: int, experts: list[int]) -> None:
        """`route`, for a block whose routing is predicted (a list block's router output):
        only inside a block call, once per call."""
        b = self.blocks[li]
        if b.active and not b.implicit and not b.order and not b.acquired:
            self.route(li, experts)

    def enter(self, li: int, e: int, stream: Any = None) -> Slot:
        """Expert ``e`` of layer ``li`` is about to compute: its slot, its copy waited for on
        the compute stream (``stream``: that stream, where the caller read it in this call)."""
        b = self.blocks[li]
        if not b.active:  # an expert called outside its block's forward
            self.begin(li, 0)
            b.implicit = True
            self.counters[li].calls -= 1
        self.recorder.enter(li, e, b.order)
        if e not in b.acquired:
            queued: list = []
            try:
                if not acquire(self, li, e, True, queued):
                    raise RuntimeError(f"no cache slot is free for expert {e} of layer {li}")
            finally:
                load_queued(self, li, queued)
        slot, copied = b.acquired[e]
        b.entered.add(e)
        c = self.counters[li]
        if copied:
            c.misses += 1
            b.acquired[e] = (slot, False)  # counted: `end` tells unused copies by this flag
        else:
            c.hits += 1
        if slot.ready is not None:
            if stream is None:
                stream = self.engine.current_stream()
            if stream not in slot.waited:
                self.engine.wait(slot.ready, stream)
                slot.waited.add(stream)
        return slot

    def exit(self, li: int, e: int, stream: Any = None) -> None:
        """Expert ``e`` has computed (its kernels are queued): record "done", unpin."""
        self.exit_all(li, (e,), stream)

    def exit_all(self, li: int, experts: Any, stream: Any = None) -> None:
        """`exit` of each of ``experts``, after one event recorded for them all (their last
        reads are queued; ``stream``: the compute stream, where the caller read it in this
        call)."""
        b = self.blocks[li]
        event = self.engine.record(stream)
        if event is not None and stream is None:
            stream = self.engine.current_stream()
        for e in experts:
            slot, _ = b.acquired.pop(e)
            b.entered.discard(e)
            if event is not None:
                slot.done[stream] = event
            slot.pins -= 1
            self.cache.use((li, e))
        if b.q < len(b.order):
            self._fill(li)
        if b.implicit and not b.acquired:
            self.end(li)

    def end(self, li: int) -> None:
        """The block is over: unpin what it routed and did not use (or, after an exception,
        entered and did not exit: "done" is recorded for those, whose kernels may run)."""
        b = self.blocks[li]
        for binding in list(b.bound.values()):  # left bound by an interrupted forward
            binding.unbind()
        if b.acquired:
            event = self.engine.record()
            stream = self.engine.current_stream()
            for slot, copied in b.acquired.values():
                if event is not None:
                    slot.done[stream] = event
                slot.pins -= 1
                if copied:
                    self.counters[li].unused += 1
        b.__init__()

    # -- graph mode (Note: [Routed experts in a CUDA graph] in _graphed.py) ---------------------

    def own_map(self) -> None:
        """The host's cache map in force again (read back from the device after graph calls)."""
        if self.tables is not None and self.tables.owned:
            self.tables.pull()

    def _reap(self) -> None:
        """End the blocks whose call is no longer running (Note: [Interrupted expert
        blocks])."""
        for i, b in enumerate(self.blocks):
            if b.active and not running(b.thread, b.frame):
                self.end(i)

    def views(self, li: int, e: int, slot: Slot) -> list[torch.Tensor]:
        return member_views(self, li, e, slot)  # Expert e's members in the slot, as tensors

    def bind_offsets(self, li: int, e: int, slot: Slot) -> list[int]:
        return bind_offsets(self, li, e, slot)  # Byte offsets of expert e's members

    # -- slots -----------------------------------------------------------------------------

    def _fill(self, li: int) -> None:
        """Pin the block's next routed experts in slots as far as slots can be taken, their
        copies queued together."""
        b = self.blocks[li]
        queued: list = []
        try:
            while b.q < len(b.order):
                e = b.order[b.q]
                if e not in b.acquired and not acquire(self, li, e, not b.acquired, queued):
                    return
                b.q += 1
        finally:
            load_queued(self, li, queued)

    # -- writes of the host store ---------------------------------------------------------

    def _on_write(self, li: int, experts: range) -> None:
        """Before the store's bytes of these experts change (Note: [Routed experts and the
        copy stream]): refuse inside a block; wait for every copy; forget cached copies."""
        self._reap()
        if any(b.active for b in self.blocks) or self.graphing:
            name = self.layout.layers[li].name
            raise _hosted.HostedError(
                f"a write to the experts of {name!r} while a block of the model runs: the "
                "write would change experts the block may be using. Write them between calls"
            )
        self.own_map()
        self._sync()
        for e in experts:
            self.cache.forget((li, e))

    def _sync(self) -> None:
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).synchronize(self.device)

    # -- remove -------------------------------------------------------------------------------

    def _check_live(self) -> None:
        if self.removed:
            raise RuntimeError("this ExpertStreamHandle was removed")

    def restore(self) -> None:
        """Every expert tensor back where it was, with its values; free the cache and the host
        store. Idempotent."""
        with self._lock:
            if self.removed:
                return
            self._reap()
            if any(b.active for b in self.blocks):
                raise RuntimeError("remove() inside a forward of the streamed model")
            self._sync()
            # a replay's routing outside a layer, reported once the removal is done (Note:
            # [Routed outside a layer] in _outside.py)
            error = None if self.tables is None else self.tables.outside.report()
            self.removed = True
            self.block_graphs = None  # before the tables: its graphs read the cache
            self.tables = None
            self.cache.release()  # first: the experts may come back to the same device
            self.store.restore()
        if error is not None:
            raise error

    def reset(self) -> None:
        if self.tables is not None:
            from torchoffload.moe._graphed import pull_counts

            pull_counts(self.tables)
        if self.block_graphs is not None:
            self.block_graphs.reset()
        for i in range(len(self.counters)):
            self.counters[i] = Counters()
        self.cache.evictions = 0


def acquire(rt: ExpertRuntime, li: int, e: int, now: bool, queued: list) -> bool:
    """Pin expert ``e`` of layer ``li`` in a slot; if it is not cached, the slot is assigned to
    it and added to ``queued``, whose copies the caller queues (`load_queued`) before any
    compute reads them. ``now``: the block needs it next (evict an expert it routes later if
    nothing else can go)."""
    b = rt.blocks[li]
    key = (li, e)
    slot = rt.cache.lookup(key)
    copied = slot is None
    if slot is None:
        start = b.index.get(e, b.q - 1) + 1  # experts routed from ``start`` on are spared
        slot = rt.cache.take(li, _routed_from(b.index, li, start))
        if slot is None and now:
            slot = rt.cache.take_routed([(li, x) for x in b.order[start:]])
        if slot is None and now:
            slot = _unroute(rt, li)
        if slot is None:
            if now:
                raise RuntimeError(
                    f"every cache slot is in use: {len(rt.cache.slots)} slots for "
                    f"{rt.layout.layers[li].name!r}"
                )
            return False
        queued.append((slot, key, dict(slot.done)))
        rt.cache.assign(slot, key, None)  # its "ready" set when its copy is queued
    slot.pins += 1
    b.acquired[e] = (slot, copied)
    return True


def _unroute(rt: ExpertRuntime, li: int) -> Slot | None:
    """A slot from an expert routed ahead and not entered yet (a prediction the block did not
    follow): the one routed last gives its slot up."""
    b = rt.blocks[li]
    for e in reversed(b.order):
        if e not in b.acquired or e in b.entered:
            continue
        slot, copied = b.acquired.pop(e)
        slot.pins -= 1
        if copied:
            rt.counters[li].unused += 1
        if slot.pins == 0:
            b.q = min(b.q, b.index[e])
            return rt.cache.take_routed([(li, e)])
    return None


def _routed_from(index: dict[int, int], li: int, start: int) -> Callable[[Key], bool]:
    """Whether a key is an expert of layer ``li`` routed at place ``start`` or later (``index``:
    expert -> its place in the block's routing order)."""
    return lambda k: k[0] == li and index.get(k[1], -1) >= start


def load(rt: ExpertRuntime, slot: Slot, key: Key) -> None:
    """Queue the copy of expert ``key`` into ``slot`` (after the slot's last readers)."""
    queued = [(slot, key, dict(slot.done))]
    rt.cache.assign(slot, key, None)
    load_queued(rt, key[0], queued)


# Note: [A block's copies queued together]
# A block's misses are copied one expert after another (two copies each at the fused layout: its
# gate_up and down slices), and an eager decode step is host-bound: each expert queued on its own
# made the copy stream current and the compute stream current again
# (Note: [Switching streams cheaply]) and sliced the cache's storage and the host store anew. The
# experts a `_fill` pins are queued by one `load_many`: the copy stream made current once, each
# expert's copies still after its own slot's "done" events and followed by its own "ready" event,
# so expert i computes while experts i+1... are copied, as before; the byte ranges of a slot and
# of a host store's expert are kept (`ExpertCache.span`, `ExpertStore.expert_source`). A slot is
# assigned to its expert as it is taken, with no "ready" until its copy is queued: no compute runs
# between the two (the copies are queued before `_fill` returns, and before `enter` returns where
# it acquires). Where queuing fails, every expert of the batch is forgotten and unpinned and its
# slot gets back the "done" events it had: no later read finds bytes that were never copied, and
# no later copy skips a reader of the slot's old bytes.


def load_queued(rt: ExpertRuntime, li: int, queued: list[tuple[Slot, Key, dict]]) -> None:
    """Queue the copies of ``queued`` (slot, its expert of layer ``li``, the slot's "done"
    events when it was taken), in order, and count them.
    See Note: [A block's copies queued together]."""
    if not queued:
        return
    layer, cache, store = rt.layout.layers[li], rt.cache, rt.store
    if store is not None:
        groups = []
        for slot, (_, e), done in queued:
            pairs = []
            for m, at in enumerate(bind_offsets(rt, li, e, slot)):
                nbytes = layer.members[m].nbytes
                piece, offset = layer.source(e, m)
                pairs.append((cache.span(at, nbytes),
                              store.expert_source(li, piece, offset, nbytes)))  # fmt: skip
            groups.append((pairs, list(done.values())))
        try:
            readies = rt.engine.load_many(groups)
        except BaseException:
            unqueue(rt, li, queued)
            raise
        for (slot, _, _), ready in zip(queued, readies, strict=True):
            slot.ready = ready
    c = rt.counters[li]
    c.loads += len(queued)
    c.h2d_bytes += len(queued) * layer.expert_bytes


def unqueue(rt: ExpertRuntime, li: int, queued: list[tuple[Slot, Key, dict]]) -> None:
    """Undo the slots of copies that could not be queued: each expert forgotten and unpinned
    (out of its block's pinned experts), its slot's "done" events as they were."""
    b = rt.blocks[li]
    for slot, key, done in queued:
        held = b.acquired.get(key[1])
        if held is not None and held[0] is slot:
            del b.acquired[key[1]]
            slot.pins -= 1
        rt.cache.forget(key)
        slot.done = done


def member_views(rt: ExpertRuntime, li: int, e: int, slot: Slot) -> list[torch.Tensor]:
    """Expert ``e``'s members in ``slot`` of ``rt``'s cache, as tensors of their geometry: made
    once per place and geometry and kept by the cache (an eager block call takes them for each
    routed expert; two tensors made anew took about a fifth of its host time on a CPU)."""
    layer, cache = rt.layout.layers[li], rt.cache
    out = []
    for m, member in enumerate(layer.members):
        start = slot.offset + member.region + layer.shift(e, m)
        key = (start, member.size, member.stride, member.dtype)
        view = cache.views.get(key)
        if view is None:
            with torch.inference_mode(False):  # usable in and out of inference mode
                t = torch.empty(0, dtype=member.dtype, device=rt.device)
                item = t.element_size()
                view = t.set_(cache.storage, start // item, member.size, member.stride)
            cache.views[key] = view
        out.append(view)
    return out


def bind_offsets(rt: ExpertRuntime, li: int, e: int, slot: Slot) -> list[int]:
    """Byte offsets of expert ``e``'s members in ``rt``'s cache storage."""
    layer = rt.layout.layers[li]
    return [slot.offset + m.region + layer.shift(e, i) for i, m in enumerate(layer.members)]
