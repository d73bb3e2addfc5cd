"""Pinned host memory pool: a few large slabs, exact-size blocks, event-guarded reuse.

Pinning host memory is slow (about 0.5 s per GiB on an H200 host) and PyTorch's caching host
allocator rounds every request up to a power of two. A step of activation offloading allocates
hundreds of host buffers of odd sizes, so doing that per tensor costs time and up to 2x memory.
`PinnedPool` pins a few large slabs once and hands out exact-size, aligned byte ranges of them.

A block given back with ``free(block, after=event)`` is reused only once ``event`` has completed
(the copy that reads or writes it has finished), which makes reuse across steps and micro-batches
safe without a host synchronisation on the hot path. See Note: [Event-guarded reuse].
"""

from __future__ import annotations

import bisect
import logging
import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchoffload._validate import OnExhausted, check_int, physical_memory

__all__ = [
    "HostBlock",
    "PinnedPool",
    "PoolExhaustedError",
    "PoolStats",
    "default_pool",
    "pinned_buffer",
]

_log = logging.getLogger(__name__)

_ALIGN = 64  # bytes; covers every dtype's alignment and a cache line
_DEFAULT_SLAB = 256 << 20
_RECLAIM_PER_ALLOC = 4  # Note: [Bounded reclaim]

# Note: [Event-guarded reuse]
# A host block is written by a device->host copy and read by a host->device copy, both queued on
# copy streams and both still running when the Python code that queued them has moved on. The
# caller therefore frees a block with the event recorded after the last copy that touches it.
# The pool keeps such blocks in a FIFO "pending" list and reclaims one only when its event has
# completed: `query()` is polled on allocation (no host sync). Only when the pool would
# otherwise grow or overflow while pending blocks could satisfy the request does it block on the
# oldest pending event (`event_waits` counts these): at that point the host is ahead of the GPU
# and waiting costs no device time, whereas growing would pin memory that the next step reuses
# anyway. Any object with `query()` and `synchronize()` works as an event; None means "complete".
#
# Note: [Bounded reclaim]
# A training step frees every block of its backward with a "ready" event that has not completed
# yet (the host runs ahead), so the next step's first allocation used to find them all pending
# and release them at once: 135 event queries and slab merges at the h1024 benchmark shape,
# about 0.65 ms of host time under the profiler on the H200, while the GPU, idle at the start
# of a step timed alone, waited for the step's first copy (it started 1.4 ms after the first
# kernel, 0.35 ms after this change). An allocation now reclaims at most `_RECLAIM_PER_ALLOC`
# blocks before it looks for room, and every completed block only when nothing fits; over a
# forward that allocates as many blocks as the last backward freed, the pending list drains at
# several blocks per allocation. Blocks waiting there still count in `used_bytes` (as before),
# and `peak_bytes` counts live blocks only, so that it does not depend on when they are
# reclaimed.


class PoolExhaustedError(RuntimeError):
    """Raised when a pool cannot serve a request and the policy is ``"raise"``."""


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a `PinnedPool`. Bytes are exact (block sizes before alignment padding)."""

    capacity_bytes: int
    reserved_bytes: int  # bytes in slabs allocated so far (pinned when the pool pins)
    used_bytes: int  # bytes in live blocks, including blocks freed but waiting on their event
    pending_bytes: int  # of used_bytes: freed, waiting on their copy's event
    peak_bytes: int  # high-water mark of bytes in live blocks (used_bytes less pending_bytes)
    slabs: int
    allocs: int
    fallback_allocs: int  # requests served outside the slabs (pool full, policy "fallback")
    fallback_bytes: int
    event_waits: int  # times an allocation blocked on a pending block's event


class HostBlock:
    """An exact-size byte range of host memory handed out by a `PinnedPool`.

    ``tensor`` is a 1-D ``uint8`` tensor of exactly ``nbytes`` bytes (made on first access:
    the graph ops need only ``data_ptr``, and slicing the slab costs host time on their hot
    path). Do not keep views of it after the block is freed.
    """

    __slots__ = ("_tensor", "_base", "nbytes", "_slab", "_offset", "_span", "_freed")

    def __init__(self, base: torch.Tensor, offset: int, nbytes: int, slab: int, span: int):
        self._base = base  # the slab (or the fallback allocation) the block lies in
        self._tensor: torch.Tensor | None = None
        self.nbytes = nbytes
        self._slab = slab  # -1: fallback allocation outside the slabs
        self._offset = offset
        self._span = span  # bytes taken in the slab, alignment included
        self._freed = False

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self._live_base()[self._offset : self._offset + self.nbytes]
        return self._tensor

    def data_ptr(self) -> int:
        """The address of the block's first byte."""
        return self._live_base().data_ptr() + self._offset

    def _live_base(self) -> torch.Tensor:
        if self._base is None:
            raise RuntimeError(f"{self!r} was freed")
        return self._base

    def __repr__(self) -> str:
        where = "fallback" if self._slab < 0 else f"slab {self._slab} @ {self._offset}"
        return f"HostBlock({self.nbytes} bytes, {where})"


class _Slab:
    __slots__ = ("tensor", "size", "starts", "sizes")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.size = tensor.numel()
        self.starts = [0]  # sorted offsets of free segments
        self.sizes = {0: self.size}  # offset -> free segment length

    def take(self, span: int) -> int | None:
        for start in self.starts:  # first fit in address order
            size = self.sizes[start]
            if size >= span:
                i = bisect.bisect_left(self.starts, start)
                del self.starts[i]
                del self.sizes[start]
                if size > span:
                    bisect.insort(self.starts, start + span)
                    self.sizes[start + span] = size - span
                return start
        return None

    def give(self, start: int, span: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        if i < len(self.starts) and self.starts[i] == start + span:  # merge with the next segment
            span += self.sizes.pop(self.starts.pop(i))
        if i > 0:  # merge with the previous segment
            prev = self.starts[i - 1]
            if prev + self.sizes[prev] == start:
                self.sizes[prev] += span
                return
        self.starts.insert(i, start)
        self.sizes[start] = span

    def largest_free(self) -> int:
        return max(self.sizes.values(), default=0)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class PinnedPool:
    """A pool of host memory in a few large slabs, shareable between offloaders.

    Args:
        capacity_bytes: the most host memory the slabs may take. ``None``: half of physical
            memory. Slabs are allocated lazily, as requests need them, and kept until
            `release()`.
        slab_bytes: size of each new slab (a request larger than this gets a slab of its own
            size). Slabs are the only pinned allocations the pool makes.
        pin_memory: pin the slabs (page-locked memory is what makes copies asynchronous and
            fast). ``None``: pin when an accelerator is available. ``True`` without an
            accelerator is an error.
        on_exhausted: what `allocate()` does when the request does not fit under the capacity:
            ``"fallback"`` allocates that block outside the slabs (one warning per pool, counted
            in ``fallback_allocs``), ``"raise"`` raises `PoolExhaustedError`.

    Blocks are aligned to 64 bytes, so one slab holds tensors of mixed dtypes. Thread-safe.
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        slab_bytes: int = _DEFAULT_SLAB,
        pin_memory: bool | None = None,
        on_exhausted: Literal["fallback", "raise"] = "fallback",
    ):
        if capacity_bytes is None:
            capacity_bytes = physical_memory() // 2
        check_int(
            "capacity_bytes", capacity_bytes, minimum=1, maximum=physical_memory(),
            limit="this host's physical memory",
        )  # fmt: skip
        check_int("slab_bytes", slab_bytes, minimum=_ALIGN)
        if pin_memory is None:
            pin_memory = torch.accelerator.is_available()
        elif not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool or None, got {type(pin_memory).__name__}")
        elif pin_memory and not torch.accelerator.is_available():
            raise ValueError("pin_memory=True needs an accelerator, and torch sees none")
        on_exhausted = OnExhausted.parse(on_exhausted, "on_exhausted")
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.pin_memory = pin_memory
        self.on_exhausted = on_exhausted
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        self._reserved = 0
        self._used = 0
        self._peak = 0
        self._pending: deque[tuple[Any, HostBlock]] = deque()
        self._pending_bytes = 0
        self._allocs = 0
        self._fallback_allocs = 0
        self._fallback_bytes = 0
        self._event_waits = 0
        self._warned = False

    # -- public -----------------------------------------------------------------------------

    def allocate(
        self, nbytes: int, *, on_exhausted: Literal["fallback", "raise"] | None = None
    ) -> HostBlock:
        """Return a block of exactly ``nbytes`` bytes. ``on_exhausted`` overrides the pool's."""
        check_int("nbytes", nbytes, minimum=1)
        policy = self.on_exhausted if on_exhausted is None else OnExhausted.parse(on_exhausted)
        span = _round_up(nbytes, _ALIGN)
        with self._lock:
            self._reclaim(limit=_RECLAIM_PER_ALLOC)
            block = self._fit(nbytes, span)
            if block is None and self._pending:
                self._reclaim()
                block = self._fit(nbytes, span)
            if block is None and self._could_fit_after_pending(span):
                while block is None and self._pending:
                    self._event_waits += 1
                    self._pending[0][0].synchronize()
                    self._reclaim()
                    block = self._fit(nbytes, span)
            if block is None and self._grow(span):
                block = self._fit(nbytes, span)
            if block is None:
                block = self._exhausted(nbytes, span, policy)
            self._allocs += 1
            self._used += nbytes
            self._peak = max(self._peak, self._used - self._pending_bytes)
            return block

    def free(self, block: HostBlock, *, after: Any = None) -> None:
        """Give ``block`` back; it is reused only after ``after`` (an event) has completed."""
        if not isinstance(block, HostBlock):
            raise TypeError(
                f"block must be a HostBlock from allocate(), got {type(block).__name__}"
            )
        with self._lock:
            if block._freed:
                raise RuntimeError(f"{block!r} was freed twice")
            block._freed = True
            if after is None or after.query():
                self._release(block)
            else:
                self._pending.append((after, block))
                self._pending_bytes += block.nbytes

    def reserve(self, nbytes: int) -> None:
        """Allocate (and pin) slabs now until at least ``nbytes`` are reserved, within capacity.

        Call it before the first step to keep slab allocation out of the timed loop.
        """
        check_int("nbytes", nbytes, minimum=0, maximum=self.capacity_bytes)
        with self._lock:
            while self._reserved < nbytes:
                if not self._grow(_round_up(min(self.slab_bytes, nbytes - self._reserved), _ALIGN)):
                    break

    def release(self) -> None:
        """Free all slabs. Every block must have been freed and its event completed."""
        with self._lock:
            self._reclaim(wait=True)
            if self._used:
                raise RuntimeError(f"cannot release a pool with {self._used} bytes in use")
            self._slabs.clear()
            self._reserved = 0

    def stats(self) -> PoolStats:
        with self._lock:
            self._reclaim()
            return PoolStats(
                capacity_bytes=self.capacity_bytes,
                reserved_bytes=self._reserved,
                used_bytes=self._used,
                pending_bytes=self._pending_bytes,
                peak_bytes=self._peak,
                slabs=len(self._slabs),
                allocs=self._allocs,
                fallback_allocs=self._fallback_allocs,
                fallback_bytes=self._fallback_bytes,
                event_waits=self._event_waits,
            )

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._used - self._pending_bytes

    def __repr__(self) -> str:
        return (
            f"PinnedPool(capacity={self.capacity_bytes}, reserved={self._reserved}, "
            f"used={self._used}, pinned={self.pin_memory})"
        )

    # -- internals (lock held) --------------------------------------------------------------

    def _fit(self, nbytes: int, span: int) -> HostBlock | None:
        for i, slab in enumerate(self._slabs):
            start = slab.take(span)
            if start is not None:
                return HostBlock(slab.tensor, start, nbytes, i, span)
        return None

    def _could_fit_after_pending(self, span: int) -> bool:
        if not self._pending:
            return False
        free = sum(sum(s.sizes.values()) for s in self._slabs)
        return free + self._pending_bytes >= span

    def _grow(self, span: int) -> bool:
        room = self.capacity_bytes - self._reserved
        if span > room:
            return False
        size = max(span, min(self.slab_bytes, room))
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._slabs.append(_Slab(tensor))
        self._reserved += size
        _log.debug("pool grew by a %d-byte slab (%d reserved)", size, self._reserved)
        return True

    def _exhausted(self, nbytes: int, span: int, policy: str) -> HostBlock:
        msg = (
            f"PinnedPool cannot serve {nbytes} bytes: capacity {self.capacity_bytes}, "
            f"{self._used} in use ({self._pending_bytes} waiting on copies), largest free "
            f"range {max((s.largest_free() for s in self._slabs), default=0)}"
        )
        if policy == "raise":
            raise PoolExhaustedError(msg + "; raise capacity_bytes or offload less")
        if not self._warned:
            self._warned = True
            warnings.warn(
                msg + "; allocating outside the pool (slower: pinned per tensor). "
                "Raise capacity_bytes to avoid this. This warning is shown once per pool.",
                RuntimeWarning,
                stacklevel=4,
            )
        self._fallback_allocs += 1
        self._fallback_bytes += nbytes
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        return HostBlock(tensor, 0, nbytes, -1, span)

    def _reclaim(self, wait: bool = False, limit: int | None = None) -> None:
        """Release pending blocks whose events completed, oldest first, stopping at the first
        one not done (``wait``: wait for each instead), or after ``limit`` blocks."""
        pending = self._pending
        while pending and (limit is None or limit > 0):
            if limit is not None:
                limit -= 1
            event, block = pending[0]
            if wait:
                event.synchronize()
            elif not event.query():
                break
            pending.popleft()
            self._pending_bytes -= block.nbytes
            self._release(block)

    def _release(self, block: HostBlock) -> None:
        self._used -= block.nbytes
        if block._slab >= 0:
            self._slabs[block._slab].give(block._offset, block._span)
        block._tensor = block._base = None


_default_pools: dict[bool, PinnedPool] = {}
_default_lock = threading.Lock()


def default_pool(pin_memory: bool | None = None) -> PinnedPool:
    """The process-wide pool that offloaders use when given none (created on first use).

    Its capacity is half of physical memory; pass your own `PinnedPool` to choose another.
    """
    pin = torch.accelerator.is_available() if pin_memory is None else pin_memory
    with _default_lock:
        pool = _default_pools.get(pin)
        if pool is None:
            pool = _default_pools[pin] = PinnedPool(pin_memory=pin)
        return pool


# Note: [Exact-size pinned buffers]
# `torch.empty(n, pin_memory=True)` goes through PyTorch's caching host allocator, which rounds
# every request up to a power of two: pinning 24.1 GiB of weights that way takes 32 GiB of
# page-locked memory. A long-lived buffer of a known size (the weight store) is instead allocated
# as ordinary host memory of exactly ``n`` bytes and page-locked in place with
# ``cudaHostRegister``; a weakref finalizer unregisters it when the tensor object is collected,
# which runs before the tensor releases its memory. Views do not keep the registration: the
# owner keeps the returned tensor itself alive while copies may read any part of it. Copies from
# registered memory are as asynchronous and as fast as from `cudaHostAlloc` memory.


def pinned_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A 1-D uint8 host tensor of exactly ``nbytes`` bytes, page-locked when ``pin``.

    See Note: [Exact-size pinned buffers]. Keep the returned tensor (not a view of it) alive as
    long as copies may read it; the registration ends when it is garbage collected.
    """
    check_int("nbytes", nbytes, minimum=0)
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return tensor
    if not torch.cuda.is_available():  # other accelerators: their own pinned allocator
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    cudart = torch.cuda.cudart()
    ptr = tensor.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        raise RuntimeError(
            f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory (cudaHostRegister "
            f"error {err}); free host memory or lower the amount streamed"
        )
    weakref.finalize(tensor, _unregister, cudart, ptr)
    return tensor


def _unregister(cudart: Any, ptr: int) -> None:
    cudart.cudaHostUnregister(ptr)
