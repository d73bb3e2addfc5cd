"""`torch.ops.torchoffload.{offload, reload, wait}`: activation offloading as graph ops.

Hooks do not reach into compiled code, so a graph pass (or a user) puts these ops into the
graph itself::

    host = torch.ops.torchoffload.offload(x)           # after x's producer: D2H starts
    torch.ops.torchoffload.wait(host)                   # later in forward: x's memory may go
    ...                                                 # backward
    y = torch.ops.torchoffload.reload(host, x.device)  # earlier than needed: H2D starts
    torch.ops.torchoffload.wait(y)                      # right before y's first use

They run on the transfer engine and the pinned pool of the eager paths (`_transfer.py`,
`_pool.py`), follow the same protocol, and have fake implementations, so they trace under
`torch.compile` and `torch.export` and pass `torch.library.opcheck`.

Note: [Graph ops and the transfer protocol]
- offload(x): reads the compute stream, takes a block of the pool, queues the D2H on the copy
  stream after the compute stream, records "stored", and keeps x's storage referenced in its
  record (the graph may drop x right after; the copy still reads it). It returns the host tensor
  (contiguous, x's shape and dtype, on the CPU).
- wait(host, keepalive=x): the compute stream waits on "stored" and the reference to x is
  dropped (`release_after`: the allocator reuses x's block only after the copy). Without a
  wait, the reference is dropped at the next op call that finds "stored" complete, or at
  reload. In a compiled graph the reference the op holds does not stop Inductor from reusing
  x's buffer for a later kernel's output once x is dead in the graph (its own memory planning,
  not the allocator's); passing x as ``keepalive`` keeps x alive in the graph until the wait.
- reload(host, device): allocates the destination on the compute stream, queues the H2D on the
  copy stream after the compute stream and after "stored", records "ready", and returns the
  destination, which is not ready yet. Its pool block goes back to the pool guarded by "ready".
  A host tensor is reloaded at most once (the pass reloads each activation once).
- Host tensors are known by their storage, not by their address: see Note: [Host tensors are
  named by their storage].
- wait(y): the compute stream waits on "ready". Every use of y must come after it; the pass puts
  it right before the first.
`wait` declares that it mutates its argument. It does not write to it, but the declaration is
what keeps every later use ordered after it and keeps Inductor from removing it as dead code
(tests/test_compile.py checks the generated code calls it).

Note: [Host tensors are named by their storage]
A host tensor's block goes back to the pool at the first wait on its reload, and the next
offload may take the same bytes. A graph that runs its backward again (``retain_graph=True``,
after another forward) then hands reload the old host tensor, whose address is now the new
tensor's: looked up by address, it was served the new forward's values. Each offload makes a
storage of its own over the block's bytes, so the records are keyed by that storage (alive as
long as the graph holds the host tensor), and a host tensor whose block was given back is
known as such (`retired`, with a weak reference, so a later storage at the same address is
not mistaken for it) and refused with an error.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from torchoffload._pool import HostBlock, PinnedPool, default_pool
from torchoffload._transfer import CopyEngine, compute_device, copy_engine

__all__ = ["OpStats", "discard_in_flight", "op_stats", "reset_op_stats", "set_op_pool"]


@dataclass
class _Offloaded:
    block: HostBlock
    stored: Any  # "stored" event (None: complete)
    src: torch.Tensor | None  # the device tensor, kept until "stored" completes
    stream: Any  # the stream src was allocated on (the compute stream at offload)
    engine: CopyEngine
    host: StorageWeakRef  # the host tensor's storage (Note: [Host tensors are named by ...])
    last_ready: Any = None  # "ready" of the latest reload (all reloads share the h2d stream)

    def drop_source(self) -> None:
        """Let the device source go: its stream reuses the block only after "stored"."""
        if self.src is not None:
            CopyEngine.release_after(self.stream, self.stored)
            self.src = None


@dataclass
class OpStats:
    """What the graph ops moved since the last `reset_op_stats()`."""

    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    reloaded_bytes: int = 0
    reloaded_tensors: int = 0
    in_flight: int = 0  # host tensors offloaded and not yet reloaded


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: PinnedPool | None = None
        self.host: dict[int, _Offloaded] = {}  # by the host tensor's storage (`_host_key`)
        # reloaded tensor -> ("ready", its engine, the record or None, the host tensor's key)
        self.ready: dict[int, tuple[Any, CopyEngine, _Offloaded | None, int]] = {}
        # host tensors whose block was given back, by `_host_key`
        self.retired: dict[int, StorageWeakRef] = {}
        self.live: deque[_Offloaded] = deque()  # records still holding their device source
        self.stats = OpStats()

    def get_pool(self) -> PinnedPool:
        if self.pool is None:
            self.pool = default_pool()
        return self.pool

    def sweep(self) -> None:
        """Drop the device sources whose copies are done, oldest first (no sync; the copies
        run in order on one copy stream, so the first one not done ends the sweep). Holds
        the lock."""
        live = self.live
        while live and (live[0].src is None or live[0].stored is None or live[0].stored.query()):
            live.popleft().src = None


_state = _State()


def set_op_pool(pool: PinnedPool | None) -> None:
    """The pool the graph ops copy into (None: the process-wide default pool)."""
    if pool is not None and not isinstance(pool, PinnedPool):
        raise TypeError(f"pool must be a PinnedPool or None, got {type(pool).__name__}")
    with _state.lock:
        if _state.host:
            raise RuntimeError("cannot change the pool while offloaded tensors are in flight")
        _state.pool = pool


def op_stats() -> OpStats:
    with _state.lock:
        s = _state.stats
        return OpStats(s.offloaded_bytes, s.offloaded_tensors, s.reloaded_bytes,
                       s.reloaded_tensors, len(_state.host))  # fmt: skip


def reset_op_stats() -> None:
    with _state.lock:
        _state.stats = OpStats()


def discard_in_flight() -> None:
    """Forget every transfer still in flight (after a step that raised between an offload and
    its reload): the host blocks go back to the pool once their copies are done."""
    with _state.lock:
        records = list(_state.host.values())
        _state.host.clear()
        _state.ready.clear()
        _state.retired.clear()
        _state.live.clear()
        for rec in records:
            rec.drop_source()
            _state.get_pool().free(rec.block, after=rec.last_ready or rec.stored)


_CPU = torch.device("cpu")


def _over(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """``like``'s dtype and shape (contiguous) over ``storage`` from offset 0: a new tensor,
    not an autograd view (`wait` declares a mutation of it)."""
    return torch.empty(0, dtype=like.dtype).set_(storage, 0, like.shape)


def _key(t: torch.Tensor) -> int:
    return t.data_ptr()  # distinct per reloaded tensor while in use


def _host_key(t: torch.Tensor) -> int:
    """See Note: [Host tensors are named by their storage]."""
    return t.untyped_storage()._cdata


def _retired(key: int) -> bool:
    ref = _state.retired.get(key)
    return ref is not None and not ref.expired()


# -- the ops -----------------------------------------------------------------------------------
#
# Note: [Defining the ops with torch.library.Library]
# `torch.library.custom_op` wraps every call in Python layers of its own (an autograd kernel,
# an alias check on the outputs). Measured on the H200 host: a trivial op costs 15.7 us per
# call as a custom_op and 5.7 us defined with `Library.define` and one CompositeExplicitAutograd
# kernel (2.6 of them its body); a trivial mutating op 17.2 against 1.3 us. A compiled step
# calls these ops four times per offloaded storage, so they are defined here at the lower
# level (`probe`, called once per weight use and with an autograd formula, stays a custom_op).
# They have no autograd formula: compiled graphs call them below autograd, and PyTorch warns
# when a backward goes through one called eagerly. `wait` declares its mutation in the schema.

_lib = torch.library.Library("torchoffload", "DEF")
_lib.define("offload(Tensor x) -> Tensor")
_lib.define("reload(Tensor host, Device device) -> Tensor")
_lib.define("wait(Tensor(a!) t, Tensor? keepalive=None) -> ()")


def offload(x: torch.Tensor) -> torch.Tensor:
    """Start copying ``x`` to host memory; returns the (contiguous) host tensor. See Note:
    [Graph ops and the transfer protocol]. On the CPU (tests) the copy is synchronous."""
    nbytes = x.numel() * x.element_size()
    if not nbytes:
        return torch.empty(x.shape, dtype=x.dtype, device="cpu")
    engine = copy_engine(x.device)
    with _state.lock:
        _state.sweep()
        block = _state.get_pool().allocate(nbytes)
        ptr = block.data_ptr()
    # The graph's handle on the block: its own storage over the block's bytes, at offset 0 as
    # the fake implementation says (a slice of the slab would carry the block's offset). It
    # does not own the bytes: the record keeps the block until the reload is waited on.
    storage = torch._C._construct_storage_from_data_pointer(ptr, _CPU, nbytes)
    host = _over(storage, x)
    src = x.contiguous()  # a copy on the compute stream when x is strided
    stored, stream = engine.offload(src, host)
    key = _host_key(host)
    with _state.lock:
        keep = src if stored is not None else None
        _state.retired.pop(key, None)  # a storage that died had this address
        abandoned = _state.host.pop(key, None)  # its host tensor died: nothing can reload it
        if abandoned is not None:
            abandoned.drop_source()
            _state.get_pool().free(abandoned.block, after=abandoned.last_ready or abandoned.stored)
        rec = _Offloaded(block, stored, keep, stream, engine, StorageWeakRef(storage))
        _state.host[key] = rec
        if keep is not None:
            _state.live.append(rec)
        _state.stats.offloaded_bytes += nbytes
        _state.stats.offloaded_tensors += 1
    return host


def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


def reload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Start copying a host tensor that `offload` returned back to ``device``; returns the
    destination, usable after `wait`. See Note: [Graph ops and the transfer protocol]."""
    nbytes = host.numel() * host.element_size()
    if not nbytes:
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    key = _host_key(host)
    with _state.lock:
        rec = _state.host.get(key)
        retired = _retired(key)
    if retired:
        raise RuntimeError(
            "torchoffload.reload: this host tensor's reload was waited on already, and its "
            "block went back to the pool (each offloaded tensor is reloaded once; a compiled "
            "graph whose activations torchoffload offloads runs its backward once, so "
            "retain_graph=True with a second backward is not supported there)"
        )
    if rec is None:  # a host tensor of the caller's: a plain copy, nothing to give back
        engine = copy_engine(compute_device(device))
        src = host.contiguous()
        dst = torch.empty(host.shape, dtype=host.dtype, device=engine.device)  # compute stream
        out, ready, _ = engine.reload(src, None, dst)
        if ready is not None:
            with _state.lock:
                _state.ready[_key(out)] = (ready, engine, None, key)
        return out
    engine = rec.engine
    if device != engine.device and compute_device(device) != engine.device:
        raise ValueError(f"torchoffload.reload: offloaded from {engine.device}, asked for {device}")
    # The host tensor is the one `offload` returned (contiguous, over the block's bytes); the
    # destination is allocated here, on the compute stream (Note: [H2D protocol]).
    dst = torch.empty(host.shape, dtype=host.dtype, device=engine.device)
    out, ready, _ = engine.reload(host, rec.stored, dst)
    with _state.lock:
        rec.drop_source()  # the copy back does not read the device source
        rec.last_ready = ready
        _state.stats.reloaded_bytes += nbytes
        _state.stats.reloaded_tensors += 1
        _state.ready[_key(out)] = (ready, engine, rec, key)
    return out


def _reload_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)


def wait(t: torch.Tensor, keepalive: torch.Tensor | None = None) -> None:
    """Order the compute stream after ``t``'s transfer: for a host tensor from `offload`, the
    D2H is done and the device source may be reused; for a tensor from `reload`, it is ready,
    and the host block goes back to the pool. A tensor with no transfer in flight passes
    through. ``keepalive`` (the offloaded source, in graphs) is not read: it keeps a compiler
    from reusing the source's buffer before this wait. See Note: [Graph ops and the transfer
    protocol]."""
    if not t.numel():
        return
    with _state.lock:
        pending = _state.ready.pop(_key(t), None)
        rec = _state.host.get(_host_key(t)) if pending is None else None
        if rec is not None:  # a host tensor from offload
            rec.drop_source()
    if pending is None:
        return
    ready, engine, rec, host_key = pending
    engine.wait(ready)
    if rec is None:  # the reload of a caller's host tensor: no block to give back
        return
    with _state.lock:
        if _state.host.pop(host_key, None) is rec:  # the first wait of its reloads
            rec.drop_source()
            _state.get_pool().free(rec.block, after=rec.last_ready)
            _state.retired[host_key] = rec.host
            if len(_state.retired) > 4096:  # forget the host tensors that are gone
                for k, ref in list(_state.retired.items()):
                    if ref.expired():
                        del _state.retired[k]


def _wait_fake(t: torch.Tensor, keepalive: torch.Tensor | None = None) -> None:
    return None


for _name, _impl, _fake in (
    ("offload", offload, _offload_fake),
    ("reload", reload, _reload_fake),
    ("wait", wait, _wait_fake),
):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"torchoffload::{_name}", _fake, lib=_lib)
