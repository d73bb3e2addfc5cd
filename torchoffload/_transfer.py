"""Copy streams, events and the device<->host protocol shared by every engine.

Everything about *when* a copy may start and when memory may be reused lives here, so that the
engines above deal in tensors and events, not in stream rules. On a device without streams (the
CPU, used by CI) the same calls run synchronously and every event is ``None`` ("complete").
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CAST_CHUNK", "CopyEngine", "WaitTimer", "compute_device", "copy_engine"]

CAST_CHUNK = 2 << 20  # elements per conversion chunk: Note: [Copies that convert]

# Note: [The compute stream is read at every call]
# The stream a tensor is produced and consumed on is whatever stream is current *at that moment*
# on the calling thread: the user may switch streams, and autograd runs each backward node on the
# stream its forward ran on, from a worker thread. So every entry point below reads
# `current_stream(device)` before entering a side-stream context, and nothing caches it. Where a
# stream has to be remembered, it is the stream a *specific allocation* was made on (see
# `CopyEngine.release_after`), which is a property of that memory, not of the engine.
#
# Note: [D2H protocol]
# 1. The copy stream waits on the compute stream, so the copy reads the finished producer.
# 2. The copy goes into a pool block with non_blocking=True and a "stored" event is recorded.
# 3. The device source must stay allocated until "stored" has completed. The caller keeps its
#    own reference (no `record_stream`) and drops it either when `event.query()` says so, or
#    right after making the stream the source was allocated on wait on "stored"
#    (`release_after`): the caching allocator reuses a freed block in that stream's order, so
#    any later kernel that reuses the memory runs after the copy. No host sync either way.
#
# Note: [H2D protocol]
# 1. The destination is allocated on the compute stream (the caching allocator ties a block to
#    the stream it was allocated on, and frees it in that stream's order).
# 2. The copy stream waits on the compute stream (the block may have been freed by kernels still
#    queued there) and on the buffer's "stored" event: a reload, prefetched or on demand, never
#    reads a host buffer whose D2H has not completed.
# 3. The copy runs on the copy stream and records "ready"; the compute stream waits on "ready"
#    before the tensor is used, and before it is dropped if it never is (a prefetch whose
#    consumer did not run), or its block could be reused while the copy still writes to it.
# 4. The host buffer goes back to the pool with "ready" as its guard (Note: [Event-guarded
#    reuse] in _pool.py).

#
# Note: [Copies that convert]
# A pair whose two tensors differ in dtype is converted on the device, in chunks of
# `CAST_CHUNK` elements, on the stream that copies: D2H casts a chunk of the device source into
# a scratch tensor and copies the scratch down; H2D copies a chunk of the host source up into a
# scratch tensor of the source's dtype and casts it into the destination. The scratch is
# allocated on the copy stream and dropped right after its last use is queued: the caching
# allocator reuses its block only for later work on that stream, which runs after. So a
# conversion holds at most about one chunk of device scratch per copy stream however large the
# tensor (a 128256 x 3072 embedding would need a 1.5 GiB fp32 temporary in one piece), and the
# host does no conversion work. A tensor that is not contiguous (a channels_last conv weight)
# is converted whole, with scratch of its own size: not counted by the planner, which assumes
# one chunk. Conversions between fp32 and bf16/fp16 round to nearest even on
# the CPU and on CUDA alike, so the bits are those a host conversion gives (tested bitwise).
# 2 Mi elements a chunk (8 MiB of fp32) keeps the scratch small beside a small model's
# gradients; measured on an H100 (benchmarks/optim.py calibrate, run G in
# benchmarks/log/2026-11-23-optimizer-on-host.md) the chunks cost 32 us (D2H) and 23 us (H2D)
# of host time each and move fp32 at 49 and 44 GB/s, against 55 and 54 for plain pinned
# copies (the cast and the copy of a chunk are serial on one stream).
#
# Note: [H2D into an arena]
# The weight engine copies into a device arena it allocated once and manages itself, instead of
# into fresh caching-allocator blocks. The copy stream then does *not* wait on the compute stream
# (that would serialise every prefetch behind the layer computing now). It waits only on the
# events the caller passes: the "done" events recorded on the compute stream after the last
# kernels that read the bytes being overwritten. Waits queued on a stream apply to everything
# queued after them, so a region partly overwritten earlier stays ordered too: see Note: [Arena
# regions and done events] in weights/_arena.py.


def compute_device(device: torch.device | str | int | None = None) -> torch.device:
    """The device whose tensors are offloaded: the given one, else the current accelerator, else
    the CPU (where the same logic runs synchronously, for testing)."""
    if device is None:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if acc is None:
            return torch.device("cpu")
        return torch.device(acc.type, torch.accelerator.current_device_index())
    dev = torch.device(device)
    if dev.type not in ("cpu", "meta") and dev.index is None:
        dev = torch.device(dev.type, torch.get_device_module(dev.type).current_device())
    if dev.type == "meta":
        raise ValueError("cannot offload from the meta device")
    return dev


class CopyEngine:
    """Copy streams and the D2H/H2D protocol for one device. Use `copy_engine(device)`.

    ``use_streams=False`` queues the copies on the compute stream instead (still asynchronous to
    the host, but serialised with compute).
    """

    def __init__(self, device: torch.device, *, use_streams: bool = True):
        self.device = device
        # Set only by torchoffload.testing (slow_copies, simulated_async_copies).
        self.testing: CopyTestHooks | None = None
        self.synchronous = device.type == "cpu"
        self.use_streams = use_streams and not self.synchronous
        self._cuda = device.type == "cuda"
        if not self.synchronous:
            self._mod = torch.get_device_module(device.type)
            # The device's index, not its stream: `current_stream(int)` skips the parsing of a
            # torch.device (a fifth of the host time of a small streamed unit, profiled).
            self._index = device.index
            if self.use_streams:
                self.d2h = self._mod.Stream(device=device)
                self.h2d = self._mod.Stream(device=device)

    def current_stream(self) -> Any:
        """The compute stream, read now. See Note: [The compute stream is read at every call]."""
        return None if self.synchronous else self._mod.current_stream(self._index)

    def offload(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[Any, Any]:
        """Copy device ``src`` into host ``dst``. Returns ``(stored_event, compute_stream)``.

        See Note: [D2H protocol]. The caller keeps ``src`` alive until the event completed.
        """
        testing = self.testing
        if testing is not None:
            testing.before_copy("offload")
        if self.synchronous:
            dst.copy_(src)
            if testing is not None and testing.async_events:
                event = ManualEvent()
                testing.events.append(event)
                return event, None
            return None, None
        compute = self._mod.current_stream(self._index)
        stream = self.d2h if self.use_streams else compute
        if stream is not compute:
            stream.wait_stream(compute)
        return self._copy(stream, [(dst, src)], (), compute), compute

    def offload_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, Any]:
        """`offload` of several ``(host dst, device src)`` pairs: one wait, one "stored" event
        after the last copy."""
        testing = self.testing
        if testing is not None:
            testing.before_copy("offload")
        if self.synchronous:
            for dst, src in pairs:
                _copy_pair(dst, src)
            return None, None
        compute = self._mod.current_stream(self._index)
        stream = self.d2h if self.use_streams else compute
        if stream is not compute:
            stream.wait_stream(compute)
        return self._copy(stream, pairs, (), compute), compute

    def reload(
        self, src: torch.Tensor, stored: Any, dst: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any, Any]:
        """Copy host ``src`` to a new device tensor, after ``stored``.

        ``dst``: the destination, allocated by the caller on the compute stream, of ``src``'s
        shape and dtype (default: a new 1-D uint8 tensor, for a 1-D uint8 ``src``).
        Returns ``(tensor, ready_event, compute_stream)``; the consumer must `wait(ready)` on its
        stream before use. See Note: [H2D protocol].
        """
        if self.testing is not None:
            self.testing.before_copy("reload")
        if self.synchronous:
            if dst is None:
                return src.clone(), None, None
            return dst.copy_(src), None, None
        compute = self._mod.current_stream(self._index)
        if dst is None:
            dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)  # on `compute`
        stream = self.h2d if self.use_streams else compute
        if stream is not compute:
            stream.wait_stream(compute)
        return dst, self._copy(stream, [(dst, src)], [stored], compute), compute

    def load(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: list[Any]) -> Any:
        """Copy host ``src`` into preallocated device ``dst`` for each pair, after ``after``.

        For memory the caller manages itself (the weight arena): see Note: [H2D into an arena].
        Returns the "ready" event recorded after the last copy.
        """
        return self.load_many([(pairs, after)])[0]

    def load_many(self, groups: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], list[Any]]]
                  ) -> list[Any]:  # fmt: skip
        """`load` of each ``(pairs, after)`` group, in order, with the copy stream made current
        once (Note: [Switching streams cheaply]): each group's copies wait on its own ``after``
        and are followed by its own "ready" event. Returns the events, one per group. A copy
        failure injected by the test hooks is raised before any group is queued."""
        if self.testing is not None:
            for _ in groups:
                self.testing.before_copy("load")
        if self.synchronous:
            for pairs, _ in groups:
                for dst, src in pairs:
                    _copy_pair(dst, src)
            return [None] * len(groups)
        stream = self.h2d if self.use_streams else self._mod.current_stream(self._index)
        return self._on(stream, None, lambda: [self._queue(stream, p, a) for p, a in groups])

    def record(self, stream: Any = None) -> Any:
        """An event recorded now on ``stream`` (default: the compute stream, read now); None on
        the CPU."""
        if self.synchronous:
            return None
        event = self._mod.Event()
        event.record(self._mod.current_stream(self._index) if stream is None else stream)
        return event

    def _copy(
        self,
        stream: Any,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        after: Any = (),
        compute: Any = None,
    ) -> Any:
        """Queue ``dst.copy_(src)`` for each pair on ``stream`` after the ``after`` events;
        return the event recorded after the last copy. ``compute``: the current stream, when
        the caller has just read it.

        Note: [Switching streams cheaply]
        A copy is queued per offloaded tensor, so making the copy stream current is on the hot
        path: ``with torch.cuda.stream(s)`` costs about 16 us of host time on the H200 host,
        setting the stream and setting it back about 6 (measured in a loop). On CUDA, when
        the engine's device is the current device, the stream is set directly and set back
        in a ``finally``; otherwise (setting a stream of another device also makes that device
        current) the context manager does both.
        """
        return self._on(stream, compute, lambda: self._queue(stream, pairs, after))

    def _on(self, stream: Any, compute: Any, queue: Callable[[], Any]) -> Any:
        """``queue()`` with ``stream`` current (``compute``: the current stream, when the
        caller has just read it), the current stream restored after."""
        fast = self._cuda and torch._C._cuda_getDevice() == self._index
        if not fast:
            with self._mod.stream(stream):
                return queue()
        if compute is None:
            compute = self._mod.current_stream(self._index)
        if stream is compute:
            return queue()
        torch.cuda.set_stream(stream)
        try:
            return queue()
        finally:
            torch.cuda.set_stream(compute)

    def _queue(
        self, stream: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Any
    ) -> Any:
        for e in after:
            if e is not None:
                stream.wait_event(e)
        testing = self.testing
        if testing is not None and testing.delay_cycles:
            torch.cuda._sleep(testing.delay_cycles)
        for dst, src in pairs:
            _copy_pair(dst, src)
        event = self._mod.Event()
        event.record(stream)
        return event

    def wait(self, event: Any, stream: Any = None) -> None:
        """Make ``stream`` (default: the compute stream, read now) wait on ``event`` (no host
        sync)."""
        if event is not None and not self.synchronous:
            if stream is None:
                stream = self._mod.current_stream(self._index)
            stream.wait_event(event)

    @staticmethod
    def release_after(stream: Any, event: Any) -> None:
        """Order the reuse of memory allocated on ``stream`` after ``event`` (no host sync).

        Call it right before dropping the last reference to that memory.
        """
        if stream is not None and event is not None:
            stream.wait_event(event)


def _copy_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` queued on the current stream; a pair of two dtypes is converted on
    the device side in chunks (Note: [Copies that convert])."""
    if dst.dtype == src.dtype:
        dst.copy_(src, non_blocking=True)
        return
    if dst.shape != src.shape:
        raise ValueError(
            f"a converting copy needs two tensors of one shape, got {tuple(dst.shape)} and "
            f"{tuple(src.shape)}"
        )
    # D2H: the device side is the source. Between two tensors of one device (the CPU, in CI)
    # a widening copy takes that branch too, so both are exercised there.
    down = src.device.type != "cpu" or (
        src.device == dst.device and dst.element_size() > src.element_size()
    )
    if not (dst.is_contiguous() and src.is_contiguous()):
        # A strided parameter (channels_last, a transposed weight): one whole-size scratch
        # tensor, whose layout the cast keeps; rare enough not to chunk.
        if down:
            dst.copy_(src.to(dst.dtype), non_blocking=True)
        else:
            up = torch.empty_like(src, device=dst.device)
            up.copy_(src, non_blocking=True)
            dst.copy_(up)
        return
    d, s = dst.view(-1), src.view(-1)
    for i in range(0, d.numel(), CAST_CHUNK):
        j = min(i + CAST_CHUNK, d.numel())
        if down:
            d[i:j].copy_(s[i:j].to(dst.dtype), non_blocking=True)
        else:
            up = torch.empty(j - i, dtype=src.dtype, device=dst.device)
            up.copy_(s[i:j], non_blocking=True)
            d[i:j].copy_(up)
            del up  # before the next chunk's: one chunk of scratch at a time


class WaitTimer:
    """How long compute streams stalled on copy events, read without a hot-path sync.

    Note: [Timing compute-stream waits] Two timing events bracket the wait on the stream itself,
    so their distance is how long that stream stalled. They are read once completed, or (with
    ``block=True``, from stats()) after synchronising on them: never on the hot path.
    """

    def __init__(self) -> None:
        self.ms = 0.0
        self._pending: deque[tuple[Any, Any]] = deque()

    def wait(self, stream: Any, event: Any) -> None:
        """``stream.wait_event(event)``, timed."""
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        self._pending.append((before, after))
        if len(self._pending) > 4096:
            self.collect(block=False)

    def collect(self, *, block: bool) -> float:
        """Add the completed waits (all of them when ``block``) to ``ms``; return it."""
        pending = self._pending
        while pending:
            before, after = pending[0]
            if block:
                after.synchronize()
            elif not after.query():
                break
            self.ms += before.elapsed_time(after)
            pending.popleft()
        return self.ms

    def reset(self) -> None:
        """Forget everything timed so far (pending timing events are dropped, not waited on)."""
        self._pending.clear()
        self.ms = 0.0


@dataclass
class CopyTestHooks:
    """Test-only behaviour of a `CopyEngine` (set through `torchoffload.testing`).

    ``delay_cycles``: the copy stream spins this many cycles before each copy, to provoke
    races. ``async_events`` (CPU): copies stay synchronous, but D2H events report "not done"
    until completed, so the keep-alive and release bookkeeping runs in CI. ``fail_at``: the
    n-th copy queued from now (1-based; offloads, reloads and loads alike, of the kinds in
    ``fail_kinds``) raises `InjectedCopyError` before anything is queued, once."""

    delay_cycles: int = 0
    async_events: bool = False
    events: list[ManualEvent] = field(default_factory=list)
    fail_at: int | None = None
    fail_kinds: frozenset[str] = frozenset({"offload", "reload", "load"})
    copies: int = 0  # copies of fail_kinds queued so far (counted while fail_at is set)

    def before_copy(self, kind: str) -> None:
        if self.fail_at is None or kind not in self.fail_kinds:
            return
        self.copies += 1
        if self.copies == self.fail_at:
            self.fail_at = None
            raise InjectedCopyError(f"injected failure of {kind} copy {self.copies}")

    def complete_events(self) -> None:
        for event in self.events:
            event.done = True
        self.events.clear()


class InjectedCopyError(RuntimeError):
    """A copy failure injected by `torchoffload.testing.failing_copies`."""


class ManualEvent:
    """An event for tests on the CPU: complete only once marked so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


_engines: dict[tuple[torch.device, bool], CopyEngine] = {}
_engines_lock = threading.Lock()


def copy_engine(device: torch.device, *, use_streams: bool = True) -> CopyEngine:
    """The process-wide engine for ``device`` (copy streams are created once and shared)."""
    key = (device, use_streams)
    engine = _engines.get(key)  # no lock on the hot path: engines are never replaced
    if engine is not None:
        return engine
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = CopyEngine(device, use_streams=use_streams)
        return engine
