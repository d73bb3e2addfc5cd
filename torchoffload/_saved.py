"""The saved-tensor runtime: what every activation offloading mode shares.

Autograd's saved-tensor hooks hand each saved tensor to `Session.pack`; eligible storages are
copied to a pinned host pool on a copy stream and come back through `Session.unpack`. A
`SavedTensorEngine` holds what lives across steps (knobs, pool, copy engine, lock, counters);
a `Session` is one forward and its backward. *When* device copies are released and reloads are
issued is the mode's business: a session asks its `Policy` (composition, not subclassing).
`BytePolicy` is `offload_activations`' (a forward window in bytes, prefetch in reverse save
order); the layer-aware mode brings its own (`torchoffload.layers`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from itertools import chain
from typing import Any, Literal, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from torchoffload._calls import run_eagerly
from torchoffload._flatten import ViewMeta, flatten, is_composite, storage_bytes
from torchoffload._pool import PinnedPool, PoolStats, default_pool
from torchoffload._transfer import CopyEngine, WaitTimer, compute_device, copy_engine
from torchoffload._validate import OnExhausted, check_bool, check_int

# Note: [Keep-alive and the forward window]
# After a D2H is queued, the device source must live until its "stored" event completes (Note:
# [D2H protocol] in _transfer.py). Each pack polls the oldest in-flight copies and drops the
# sources whose copies are done. The host usually runs far ahead of the GPU, so polling alone
# would keep almost every activation alive (the host sees few copies finish) and save nothing.
# So in-flight bytes are capped at `max_inflight_bytes`: past the cap, the oldest source is
# released with `release_after` (its allocation stream waits on "stored", then the reference is
# dropped). Memory is then bounded in stream order: the allocator reuses the block only after
# the copy. When the link keeps up, that wait is already satisfied and costs nothing. When it
# does not, compute stalls, which is the link bound the step cannot beat anyway.
#
# The sources still in flight when forward ends are not waited on: they stay on the device and
# the first backward nodes use them directly (counted as `resident_hits`). Those are the
# activations backward needs first, so they are kept rather than reloaded, and forward does not
# end with a stall. Once backward has begun they are released only when their views have all
# been unpacked.
#
# Note: [Prefetch in reverse save order]
# Backward unpacks saved tensors roughly in the reverse of the order forward saved them. Each
# unpack of storage i issues reloads of storages i-1, i-2, ... while fewer than `prefetch_bytes`
# of reloads are waiting to be used, so the window is a minimum lookahead that may overshoot by
# one storage. The H2D protocol makes the copy stream wait on the compute stream at issue time,
# so a reload issued k tensors early overlaps the compute of those k tensors' nodes.
#
# Why overshoot rather than a hard cap: inside one node the order is forward, not reverse
# (attention unpacks q/k/v, one large storage, before its small logsumexp). With a hard cap the
# large storage waited behind the small one and was reloaded on demand. Measured on an H200
# (window sweep, 2026-11-21): a 64 MiB hard cap gave 9-37 misses a step; 32 MiB with
# overshoot gave none, at the same peak memory. Device memory held for prefetch is therefore at
# most `prefetch_bytes` plus the largest saved storage.
#
# A storage already unpacked in the current backward pass (identified by autograd's graph task
# id) is not prefetched again; a second backward (retain_graph) starts a new pass and prefetches
# again.
#
# Note: [When a device copy is no longer needed]
# A storage saved through several views (q, k and v as views of one projection; one input saved
# by three linears) has one handle per view, and its device copy (the source while it is held,
# or a reload) is dropped once every live handle has been unpacked from it. `views` counts live
# handles and `unpacked` the live handles unpacked since the copy appeared. Autograd frees a
# node's saved tensors right after the node runs, so a handle usually dies soon after its unpack;
# it must then leave both counts, or the copy is dropped one view too early and the last view
# is reloaded on demand (seen on an H200 with Hugging Face Llama under FSDP2: one 64 MiB storage
# per layer copied back twice, 4% more H2D traffic and a miss per layer). So each handle
# remembers the epoch (the device copy) it was unpacked from, and its retirement takes it out
# of `unpacked` when that epoch is still current; a handle unpacked twice counts once.
#
# Note: [A copy serves only tensors of its version counter]
# A later save of the same storage at the same version reuses the host copy (q, k and v, views
# of one projection). The version proves the bytes unchanged only if it is read from the same
# counter as the copy's. Tensors can share a storage but not a counter: `unsafe_chunk` /
# `unsafe_split` pieces, `.data`, `from_numpy`. A write through one of them leaves the others'
# versions as they were, so equal numbers prove nothing, and the copy would serve bytes from
# before the write. Autograd views share their base's counter; so a copy is reused only for a
# tensor with the same view base (`_base`, or the tensor itself) as the one copied. Anything
# else is copied again: a `detach()` of a copied tensor shares its counter but not its base,
# and costs one extra copy rather than risking a stale one.
#
# Note: [Tensors without one strided storage]
# A saved tensor is offloaded as bytes of one storage plus a geometry (Note: [One flatten layer
# for every engine] takes composites apart first). Tensors that are not that stay where they
# are, counted as `unsupported_type`: other layouts (sparse COO/CSR); forward AD's zero
# tangents (`_efficientzerotensor`: no storage at all, and copying from its null data pointer
# crashed the process); nested tensors, strided (no strides: the pack raised) and jagged (a
# traceable subclass whose rebuild mints a new ragged dimension from its offsets, so backward
# refused the gradient's shape: `[2, j3, 8]` against `[2, j2, 8]`).
#
# Note: [A composite tensor's own version counter]
# An in-place op on a wrapper subclass (`s.add_(1)`) bumps the outer tensor's version counter
# only: its `__torch_dispatch__` runs below autograd, so the inner buffers it writes keep
# their versions. Checking the buffers alone would serve the copy taken at the save (plain
# PyTorch raises its version error there). So a composite records the outer counter too, in
# an alias of the wrapper made with Python dispatch off: a plain tensor over the wrapper's own
# empty storage that shares its version counter and holds none of its buffers.
#
# Note: [Why handles retire through a graveyard]
# A saved tensor's handle dies when autograd frees the graph, which can happen on any thread
# and, through the garbage collector, in the middle of our own code while it holds the lock.
# `__del__` therefore only appends to a list (atomic in CPython) and tries a non-blocking
# acquire; whoever next holds the lock drains the list. Nothing is freed re-entrantly.

_tls = threading.local()


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Inside an offloaded region, keep the tensors saved here on the device.

    Use it around work whose activations backward needs right away (the last layer, the loss)
    or that is too small to be worth a copy. Thread-local; nests.
    """
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        yield
    finally:
        _tls.depth -= 1


def _no_offload_active() -> bool:
    return getattr(_tls, "depth", 0) > 0


class _ParamStorages:
    """Storages of the parameters and buffers of every module called while an offloader is
    active. Saved tensors that share one (a weight, its transpose, a buffer) are not offloaded:
    the module keeps that memory alive anyway, so a copy would cost bandwidth and save nothing.

    A global forward pre-hook records them as modules run; `StorageWeakRef` keys cannot be
    confused with a later storage at the same address (the weak reference keeps the address).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._handle: Any = None
        self._refs: dict[int, StorageWeakRef] = {}

    def acquire(self) -> None:
        with self._lock:
            self._users += 1
            if self._handle is None:
                self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._handle is not None:
                self._handle.remove()
                self._handle = None
                self._refs.clear()

    def _hook(self, module: torch.nn.Module, args: Any) -> None:
        # Under torch.compile dynamo inlines this global hook into every module's call and
        # folds it away here (a graph break per module otherwise); compiled code's saved
        # parameters are still caught as parameters or leaves by `_skip_reason`.
        if torch.compiler.is_compiling():
            return
        for t in chain(module._parameters.values(), module._buffers.values()):
            if t is not None and not t.is_meta:
                self._add(t)
        refs = self._refs
        if len(refs) > 4096:  # list(): one atomic snapshot, as other threads may add keys
            for key, ref in list(refs.items()):
                if ref.expired():
                    refs.pop(key, None)

    def _add(self, t: torch.Tensor) -> None:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and is_composite(t):
            try:
                buffers, _ = flatten(t)
            except TypeError:
                return
            for b in buffers:
                if isinstance(b, torch.Tensor):  # DTensor also lists its DeviceMesh
                    self._add(b)
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own
            return
        key = storage._cdata
        ref = self._refs.get(key)
        if ref is None or ref.expired():
            self._refs[key] = StorageWeakRef(storage)

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        ref = self._refs.get(storage._cdata)
        return ref is not None and not ref.expired()


PARAMS = _ParamStorages()


@dataclass(frozen=True)
class ActivationStats:
    """What an offloader did, summed over every ``with`` block since creation or reset.

    Bytes count storages: a storage saved through several views is copied (and counted) once.
    """

    offloaded_tensors: int  # saved tensors whose data went to host memory
    offloaded_bytes: int  # bytes copied device -> host
    shared_storage_tensors: int  # of offloaded_tensors: views of a storage already copied
    reloaded_tensors: int  # storages copied host -> device
    reloaded_bytes: int
    skipped_tensors: int  # saved tensors left where they were
    skip_reasons: dict[str, int]  # why: parameter, leaf, small, no_offload, not_on_device, ...
    prefetch_issued: int  # reloads issued ahead of their use
    prefetch_hits: int  # unpacks served by a prefetched reload
    prefetch_misses: int  # unpacks that had to reload on demand
    resident_hits: int  # unpacks served by a device copy still held (its D2H not yet retired)
    peak_inflight_bytes: int  # most device bytes held for copies in flight (forward)
    peak_prefetched_bytes: int  # most device bytes of prefetched, not yet used reloads
    pool: PoolStats = field(repr=False)
    per_layer_bytes: dict[int, int] = field(default_factory=dict)  # layer-aware mode
    budget_skipped_bytes: int = 0  # eligible bytes kept on the device by max_offload_bytes
    compute_wait_ms: float | None = None  # time the compute stream waited on copies, if timed
    composite_tensors: int = 0  # saved tensors taken apart into buffers (subclasses, registry)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        mib = 1 << 20
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.skip_reasons.items())) or "none"
        return "\n".join(
            [
                f"offloaded  {self.offloaded_tensors} tensors, {self.offloaded_bytes / mib:.1f} MiB"
                f" ({self.shared_storage_tensors} shared a storage already copied)",
                f"reloaded   {self.reloaded_tensors} storages, {self.reloaded_bytes / mib:.1f} MiB"
                f"; prefetch hits {self.prefetch_hits}, misses {self.prefetch_misses},"
                f" resident {self.resident_hits}",
                f"skipped    {self.skipped_tensors} tensors ({reasons})",
                f"host pool  {self.pool.used_bytes / mib:.1f} MiB used, peak "
                f"{self.pool.peak_bytes / mib:.1f} MiB of {self.pool.reserved_bytes / mib:.1f}"
                f" MiB reserved; fallback allocs {self.pool.fallback_allocs}",
            ]
        )


@dataclass
class _Counters:
    """What the engine counts; `ActivationStats` reports them (see its fields)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    shared_storage_tensors: int = 0
    reloaded_tensors: int = 0
    reloaded_bytes: int = 0
    skipped_tensors: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    prefetch_issued: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    resident_hits: int = 0
    peak_inflight_bytes: int = 0
    peak_prefetched_bytes: int = 0
    per_layer_bytes: dict[int, int] = field(default_factory=dict)
    budget_skipped_bytes: int = 0
    composite_tensors: int = 0


class Storage:
    """One device storage saved for backward and its host copy (shared by all its views)."""

    __slots__ = (
        "session",
        "index",
        "nbytes",
        "ptr",
        "version",
        "alias",
        "block",
        "stored",
        "last_event",
        "src",
        "src_stream",
        "inflight",
        "dev",
        "dev_stream",
        "ready",
        "prefetched",
        "views",
        "unpacked",
        "epoch",
        "pass_id",
        "layer",
        "reload_kind",
        "root",
        "__weakref__",
    )

    def __init__(self, session: Session, index: int, nbytes: int, ptr: int) -> None:
        self.session = session
        self.index = index
        self.nbytes = nbytes
        self.ptr = ptr
        self.version = 0
        self.alias: torch.Tensor | None = None
        self.block: Any = None  # HostBlock while the host copy is owned
        self.stored: Any = None  # D2H event
        self.last_event: Any = None  # latest event of a copy touching the host block
        self.src: torch.Tensor | None = None  # the original device storage, while held
        self.src_stream: Any = None
        self.inflight = False
        self.dev: torch.Tensor | None = None  # a reloaded device copy, while held
        self.dev_stream: Any = None
        self.ready: Any = None
        self.prefetched = False
        self.views = 0  # live handles
        self.unpacked = 0  # live handles unpacked since the current device copy appeared
        self.epoch = 0  # bumped whenever a new device copy appears (a reload)
        self.pass_id: int | None = None  # graph task of the last unpack
        self.layer: int | None = None  # layer index (layer-aware mode)
        self.reload_kind: str | None = None  # "ahead" or "demand", until its first unpack
        self.root: Any = None  # weak reference to the copied tensor's view base (or itself)


class _Saved:
    """What the pack hook returns for an offloaded tensor."""

    __slots__ = ("storage", "meta", "alias", "version", "epoch")

    def __init__(self, storage: Storage, meta: ViewMeta, alias: torch.Tensor, version: int):
        self.storage = storage
        self.meta = meta
        self.alias = alias  # shares the saved tensor's version counter, holds no memory
        self.version = version
        self.epoch = -1  # the storage's epoch in which this handle was last unpacked

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.storage.session.owner._retire_view(self.storage, self.epoch)


class _Composite:
    """What the pack hook returns for a tensor made of several buffers."""

    __slots__ = ("rebuild", "parts", "alias", "version")

    def __init__(self, t: torch.Tensor, rebuild: Any, parts: list[Any]):
        self.rebuild = rebuild
        self.parts = parts  # per entry: _Saved, _Kept or _Composite; non-tensors as they were
        # See Note: [A composite tensor's own version counter]
        with torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():
            self.alias = t.detach()
        self.version = t._version


class _Kept:
    """What the pack hook returns for a tensor left in place."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()  # no grad_fn: returning an output itself would be a cycle
        self.version = tensor._version


_PACKED = (_Saved, _Kept, _Composite)


def _version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``t``'s version counter but none of its memory."""
    alias = t.detach()
    alias.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias


def _view_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` uses: its view base, or ``t`` itself."""
    return t if t._base is None else t._base


def _check_version(now: int, saved: int, what: Callable[[], str]) -> None:
    if now != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{what()}] is at version {now}; expected version {saved} instead. "
            "(Detected by torchoffload: autograd does not check tensors saved through "
            "saved-tensor hooks, so the offloader does.)"
        )


def unpack(packed: Any) -> torch.Tensor:
    if type(packed) is _Composite:
        _check_version(packed.alias._version, packed.version, lambda: _describe(packed.alias))
        return packed.rebuild([unpack(p) if type(p) in _PACKED else p for p in packed.parts])
    if type(packed) is _Kept:
        _check_version(packed.tensor._version, packed.version, lambda: _describe(packed.tensor))
        return packed.tensor
    return packed.storage.session.unpack(packed)


def _describe(t: torch.Tensor) -> str:
    shape = "[nested]" if t.is_nested else list(t.shape)
    return f"{str(t.dtype).removeprefix('torch.')}{shape}"


class Session:
    """One forward (one ``with`` block) and its backward: what it saved, in order, and the
    device copies it holds. ``policy(session)`` makes the mode's `Policy`."""

    def __init__(self, owner: SavedTensorEngine, policy: Callable[[Session], Policy]) -> None:
        self.owner = owner
        self.order: list[weakref.ref[Storage]] = []
        self.by_storage: dict[int, tuple[StorageWeakRef, Storage]] = {}
        self.inflight_bytes = 0
        self.prefetched_bytes = 0
        self.backward = False
        self.pass_id: int | None = None
        self.policy = policy(self)
        self.pack_hook = functools.partial(run_eagerly(Session.pack), self)

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks that route this session's saved tensors (not yet entered).

        Both run eagerly under torch.compile too: AOTAutograd's runtime wrapper calls them on
        real tensors, and dynamo must not trace them."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack_hook, run_eagerly(unpack))

    # -- forward ----------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        owner = self.owner
        with owner._lock:
            owner._drain()
            return self._pack_locked(t)

    def _pack_locked(self, t: torch.Tensor) -> Any:
        owner = self.owner
        c = owner._counters
        if (
            type(t) is not torch.Tensor
            and not isinstance(t, torch.nn.Parameter)
            and not _no_offload_active()
            and not t.is_nested
            and is_composite(t)
        ):  # See Note: [One flatten layer for every engine] in _flatten.py
            buffers, rebuild = flatten(t)
            c.composite_tensors += 1
            parts = [self._pack_locked(b) if isinstance(b, torch.Tensor) else b for b in buffers]
            return _Composite(t, rebuild, parts)
        reason = owner._skip_reason(t)
        if reason is not None:
            c.skipped_tensors += 1
            c.skip_reasons[reason] = c.skip_reasons.get(reason, 0) + 1
            return _Kept(t)
        storage = t.untyped_storage()
        version = t._version
        rec = self._shared(t, storage, version)
        if rec is not None:
            rec.views += 1
            c.shared_storage_tensors += 1
            self.policy.shared_view(rec)
        else:
            reason = self.policy.admit(storage)
            if reason is not None:
                c.skipped_tensors += 1
                c.skip_reasons[reason] = c.skip_reasons.get(reason, 0) + 1
                return _Kept(t)
            rec = self._offload(t, storage, version)
            c.offloaded_bytes += rec.nbytes
        c.offloaded_tensors += 1
        return _Saved(rec, ViewMeta.of(t), _version_alias(t), version)

    def _shared(
        self, t: torch.Tensor, storage: torch.UntypedStorage, version: int
    ) -> Storage | None:
        """The record whose host copy already holds ``t``'s bytes, if any. See Note: [A copy
        serves only tensors of its version counter]."""
        entry = self.by_storage.get(storage._cdata)
        if entry is None:
            return None
        ref, rec = entry
        if (
            ref.expired()
            or rec.root() is not _view_root(t)
            or rec.block is None
            or rec.ptr != storage.data_ptr()
            or rec.nbytes != storage.nbytes()
            or version != rec.version
            or rec.alias is None
            or rec.alias._version != rec.version
        ):
            return None  # changed since it was copied: copy it again
        return rec

    def _offload(self, t: torch.Tensor, storage: torch.UntypedStorage, version: int) -> Storage:
        owner = self.owner
        nbytes = storage.nbytes()
        block = owner._pool.allocate(nbytes, on_exhausted=owner.on_pool_exhausted)
        src = storage_bytes(t)
        try:
            stored, src_stream = owner._engine.offload(src, block.tensor)
        except BaseException:
            owner._pool.free(block)  # nothing was queued: the block is free at once
            raise
        rec = Storage(self, len(self.order), nbytes, storage.data_ptr())
        rec.version = version
        rec.alias = _version_alias(t)
        rec.root = weakref.ref(_view_root(t))
        rec.block = block
        rec.views = 1
        rec.stored, rec.src_stream = stored, src_stream
        rec.last_event = rec.stored
        self.order.append(weakref.ref(rec))
        self.by_storage[storage._cdata] = (StorageWeakRef(storage), rec)
        if rec.stored is not None:
            rec.src = src
            rec.inflight = True
            self.inflight_bytes += nbytes
            c = owner._counters
            c.peak_inflight_bytes = max(c.peak_inflight_bytes, self.inflight_bytes)
        self.policy.offloaded(rec)
        return rec

    def end_forward(self) -> None:
        with self.owner._lock:
            self.by_storage.clear()
            self.policy.end_forward()

    def drop_source(self, rec: Storage, *, done: bool) -> None:
        if rec.src is None:
            return
        if not done:
            self.owner._release_after(rec.src_stream, rec.stored)
        rec.src = None
        rec.src_stream = None
        if rec.inflight:
            rec.inflight = False
            self.inflight_bytes -= rec.nbytes

    def drop_device(self, rec: Storage) -> None:
        if rec.dev is None:
            return
        CopyEngine.release_after(rec.dev_stream, rec.ready)
        rec.reload_kind = None
        rec.dev = None
        rec.dev_stream = None
        if rec.prefetched:
            rec.prefetched = False
            self.prefetched_bytes -= rec.nbytes

    # -- backward ---------------------------------------------------------------------------

    def unpack(self, handle: _Saved) -> torch.Tensor:
        owner = self.owner
        rec = handle.storage
        with owner._lock:
            owner._drain()
            _check_version(handle.alias._version, handle.version, handle.meta.describe)
            c = owner._counters
            self.backward = True
            pass_id = torch._C._current_graph_task_id()
            self.pass_id = pass_id
            if rec.src is not None:
                base = rec.src
                c.resident_hits += 1
            else:
                if rec.dev is None:
                    self.reload(rec, "demand")
                if rec.reload_kind is not None:  # first use of this reload
                    if rec.reload_kind == "ahead":
                        c.prefetch_hits += 1
                    else:
                        c.prefetch_misses += 1
                    rec.reload_kind = None
                if rec.prefetched:
                    rec.prefetched = False
                    self.prefetched_bytes -= rec.nbytes
                owner._wait(rec.ready)
                base = rec.dev
            out = handle.meta.rebuild(base.untyped_storage())
            rec.pass_id = pass_id
            if handle.epoch != rec.epoch:  # See Note: [When a device copy is no longer needed]
                handle.epoch = rec.epoch
                rec.unpacked += 1
            if rec.unpacked >= rec.views:  # every view has its tensor: stop holding the storage
                self.drop_source(rec, done=False)
                self.drop_device(rec)
            self.policy.unpacked(rec)
            return out

    def reload(self, rec: Storage, kind: str) -> None:
        owner = self.owner
        rec.dev, rec.ready, rec.dev_stream = owner._engine.reload(rec.block.tensor, rec.stored)
        rec.reload_kind = kind
        if rec.ready is not None:
            rec.last_event = rec.ready
        rec.unpacked = 0
        rec.epoch += 1
        owner._counters.reloaded_tensors += 1
        owner._counters.reloaded_bytes += rec.nbytes

    def retire(self, rec: Storage) -> None:
        """The last view of ``rec`` is gone: release its device and host memory."""
        self.drop_source(rec, done=False)
        self.drop_device(rec)
        if rec.block is not None:
            self.owner._pool.free(rec.block, after=rec.last_event)
            rec.block = None
        rec.alias = None


class Policy(Protocol):
    """What a `Session` asks of the mode that drives it. Called with the engine's lock held."""

    def admit(self, storage: torch.UntypedStorage) -> str | None:
        """Why an eligible storage stays on the device (a skip reason), or None to offload."""

    def offloaded(self, rec: Storage) -> None:
        """A new storage's copy was queued."""

    def shared_view(self, rec: Storage) -> None:
        """Another view of an offloaded storage was saved."""

    def unpacked(self, rec: Storage) -> None:
        """A view of ``rec`` was unpacked in backward."""

    def end_forward(self) -> None:
        """The forward that the session covers is over."""


class BytePolicy:
    """`offload_activations`' policy: in-flight device bytes capped in forward (Note:
    [Keep-alive and the forward window]), reloads prefetched by bytes in reverse save order
    (Note: [Prefetch in reverse save order])."""

    def __init__(self, session: Session, *, prefetch_bytes: int, max_inflight_bytes: int):
        self.session = session
        self.prefetch_bytes = prefetch_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight: deque[Storage] = deque()
        self.cursor = -1
        self.pass_id: int | None = None

    def admit(self, storage: torch.UntypedStorage) -> str | None:
        return None

    def shared_view(self, rec: Storage) -> None:
        pass

    def offloaded(self, rec: Storage) -> None:
        if rec.inflight:
            self.inflight.append(rec)
            self._trim_inflight()

    def end_forward(self) -> None:
        if not self.session.backward:
            self._trim_inflight()

    def _trim_inflight(self) -> None:
        """See Note: [Keep-alive and the forward window]."""
        s = self.session
        limit = self.max_inflight_bytes
        while self.inflight:
            rec = self.inflight[0]
            if not rec.inflight:
                self.inflight.popleft()
            elif rec.stored.query():
                self.inflight.popleft()
                s.drop_source(rec, done=True)
            elif s.inflight_bytes > limit:
                self.inflight.popleft()
                s.drop_source(rec, done=False)
            else:
                break

    def unpacked(self, rec: Storage) -> None:
        """See Note: [Prefetch in reverse save order]."""
        s = self.session
        if s.pass_id != self.pass_id:  # a new backward pass starts below this storage
            self.pass_id = s.pass_id
            self.cursor = rec.index - 1
        room = self.prefetch_bytes - s.prefetched_bytes
        j = min(self.cursor, rec.index - 1)
        scanned = 0
        while room > 0 and j >= 0 and scanned < 64:
            other = s.order[j]()
            scanned += 1
            if (
                other is None
                or other.block is None
                or other.src is not None
                or other.dev is not None
                or other.pass_id == s.pass_id
            ):
                j -= 1
                continue
            s.reload(other, "ahead")
            other.prefetched = True
            s.prefetched_bytes += other.nbytes
            room -= other.nbytes
            c = s.owner._counters
            c.prefetch_issued += 1
            c.peak_prefetched_bytes = max(c.peak_prefetched_bytes, s.prefetched_bytes)
            j -= 1
        self.cursor = j


class SavedTensorEngine:
    """What lives across steps: knobs, pool, copy engine, lock, counters. Sessions use it."""

    def __init__(
        self,
        *,
        min_bytes: int,
        pool: PinnedPool | None,
        pin_memory: bool,
        use_streams: bool,
        on_pool_exhausted: Literal["fallback", "raise"],
        device: torch.device | str | int | None,
        time_waits: bool = False,
    ) -> None:
        check_int("min_bytes", min_bytes, minimum=0)
        check_bool("pin_memory", pin_memory)
        check_bool("use_streams", use_streams)
        on_pool_exhausted = OnExhausted.parse(on_pool_exhausted)
        if pool is not None and not isinstance(pool, PinnedPool):
            raise TypeError(f"pool must be a PinnedPool, got {type(pool).__name__}")
        self.device = compute_device(device)
        pin = pin_memory and torch.accelerator.is_available()
        if pool is not None and not pin_memory and pool.pin_memory:
            raise ValueError("pin_memory=False conflicts with a pinned pool; pass one or the other")
        self.min_bytes = min_bytes
        self.on_pool_exhausted = on_pool_exhausted
        self._pool = pool if pool is not None else default_pool(pin)
        self._engine = copy_engine(self.device, use_streams=use_streams)
        self._lock = threading.Lock()
        self._graveyard: list[Storage] = []
        self._counters = _Counters()
        self._time_waits = time_waits and self.device.type == "cuda"
        self._waits = WaitTimer()

    @property
    def pool(self) -> PinnedPool:
        return self._pool

    def stats(self) -> ActivationStats:
        with self._lock:
            self._drain()
            c = self._counters
            values = {f.name: getattr(c, f.name) for f in fields(c)}
            values["skip_reasons"] = dict(c.skip_reasons)
            values["per_layer_bytes"] = dict(c.per_layer_bytes)
            wait_ms = self._waits.collect(block=True) if self._time_waits else None
        return ActivationStats(**values, pool=self._pool.stats(), compute_wait_ms=wait_ms)

    def reset_stats(self) -> None:
        with self._lock:
            self._counters = _Counters()
            self._waits.reset()
        self._pool.reset_peak()

    # -- internals (lock held unless said otherwise) -----------------------------------------

    def _skip_reason(self, t: torch.Tensor) -> str | None:
        kind = type(t)
        if kind is not torch.Tensor:
            return "parameter" if isinstance(t, torch.nn.Parameter) else "unsupported_type"
        if _no_offload_active():
            return "no_offload"
        if t.device != self.device:
            return "not_on_device"
        if t.layout is not torch.strided or t._is_zerotensor() or t.is_nested:
            return "unsupported_type"  # See Note: [Tensors without one strided storage]
        storage = t.untyped_storage()
        if storage.nbytes() < max(self.min_bytes, 1):
            return "small"
        root = t if t._base is None else t._base
        # A view of a parameter is caught here even when the parameter is frozen and was never
        # seen by a module hook: FSDP2's unsharded parameters are such (an all-gather output that
        # FSDP frees with resize_(0) after forward, which a copy must never race).
        if storage in PARAMS or isinstance(root, torch.nn.Parameter):
            return "parameter"
        if root.requires_grad and root.grad_fn is None:
            return "leaf"  # a parameter or input held by its owner: a copy would free nothing
        return None

    def _wait(self, event: Any) -> None:
        """The compute stream waits on ``event`` (timed when asked)."""
        if event is None:
            return
        if not self._time_waits:
            self._engine.wait(event)
            return
        self._waits.wait(self._engine.current_stream(), event)

    def _release_after(self, stream: Any, event: Any) -> None:
        if self._time_waits and stream is not None and event is not None:
            self._waits.wait(stream, event)
        else:
            CopyEngine.release_after(stream, event)

    def _retire_view(self, rec: Storage, epoch: int) -> None:
        """Called from `_Saved.__del__` on any thread. See Note: [Why handles retire through
        a graveyard]."""
        self._graveyard.append((rec, epoch))
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        graveyard = self._graveyard
        while graveyard:
            rec, epoch = graveyard.pop()
            rec.views -= 1
            if epoch == rec.epoch:  # it was counted in `unpacked`: no longer a live handle
                rec.unpacked -= 1
            if rec.views == 0:
                rec.session.retire(rec)
