"""Gradients leaving the device: a parameter's gradient is marked final by its
post-accumulate-grad hook, and once a bucket's are all final they are copied to the host on
the copy stream and the bucket is queued for the worker."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from torchoffload.optim._checks import check_record, converted
from torchoffload.optim._grads import MovedGrad
from torchoffload.optim._host import Bucket, HostMasters
from torchoffload.optim._params import local
from torchoffload.optim._worker import HostWorker, completed

# Note: [When a gradient is final]
# PyTorch runs a parameter's post-accumulate-grad hook once per backward, after every use of the
# parameter has added its gradient (autograd sums a leaf's incoming gradients before its
# AccumulateGrad node runs). Outside `accumulating()`, that backward is the last one before
# `step()`, so the gradient is final: the hook marks the parameter, and once every trainable
# parameter of a bucket is marked, the bucket's gradients are copied to the host on the copy
# stream (which waits on the compute stream first) and the device gradients are dropped
# (Note: [Gradients leave in stream order]).
#
# Note: [Gradients leave in stream order]
# A device gradient is dropped as soon as its copy is queued, with `record_stream` on the copy
# stream: the caching allocator reuses its block only after that copy has completed, with no
# host sync. Keeping it referenced until the host had seen the copy's event complete kept most
# gradients of a backward alive, because the host launches backward far ahead of the device
# and the event was checked when the next bucket was dispatched: on an H100 a training-state
# plan predicted to peak at 4.16 GiB peaked at 6.75 (benchmarks/planner_training.py, h4096).
# The events are still kept, without the tensors, for teardown (the pinned buffers outlive the
# copies into them).


# Note: [requires_grad changed after the build]
# torch.optim steps every parameter of its groups that has a gradient, whatever its
# requires_grad was when the optimizer was built: a layer frozen later (no gradient) is not
# stepped, one unfrozen later (BitFit, gradual unfreezing) is. Here a parameter's hooks are put
# on it at the build, only if it required a gradient then, and a bucket goes to the host once
# every such parameter's gradient is final. So:
# - one frozen since: no gradient comes, its bucket never counts down to zero and goes at
#   `step()`; a gradient it still holds is stepped, as torch.optim does;
# - one unfrozen since has no hook that says when its gradient is final: its bucket does not go
#   during backward (it would take that gradient unfinished), only at `step()`.
# Both are exact; those buckets lose the overlap until the optimizer is built again.


def _unhooked(bucket: Bucket) -> bool:
    """A parameter of ``bucket`` requires a gradient now but did not at the build."""
    return any(r.param.requires_grad and not r.trainable for r in bucket.records)


class GradientDispatch:
    """Sends ``host``'s buckets to ``worker`` as their gradients become final. ``lock`` is the
    runtime's; ``owner``, a weak reference to the runtime, is what a `MovedGrad` serves
    GradScaler's unscale through (Note: [Loss scaling])."""

    def __init__(
        self,
        host: HostMasters,
        engine: Any,
        worker: HostWorker,
        lock: threading.Lock,
        owner: weakref.ref,
    ):
        self.host = host
        self.engine = engine
        self.worker = worker
        self.lock = lock
        self.owner = owner
        self.depth = 0  # `accumulating()` blocks open
        # (D2H event, the device gradients it reads: none with copy streams, see Note:
        # [Gradients leave in stream order])
        self.inflight: list[tuple[Any, list[torch.Tensor]]] = []
        self.d2h_bytes = 0

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        with self.lock:
            self.depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1

    def final(self, param: torch.Tensor) -> None:
        """``param``'s gradient is final: its bucket goes once all of its are. See Note:
        [When a gradient is final]."""
        host = self.host
        rec = host.records[host.index[id(param)]]
        with self.lock:
            if rec.final:  # its bucket is still to go: it accumulates on the device
                return
            rec.final = True
            bucket = host.buckets[rec.entry.bucket]
            bucket.remaining -= 1
            go = bucket.remaining == 0 and not bucket.dispatched and not _unhooked(bucket)
            if go:
                bucket.dispatched = True
        if go:
            self._dispatch_or_unmark(bucket)

    def check_rest(self) -> None:
        """Refuse what `dispatch_rest` would refuse, before `step()` opens its call (a bucket
        sent after that is stepped for good: a refusal half-way would leave some stepped),
        and a parameter converted since its bucket was sent (Note: [Written gradients
        brought back])."""
        for bucket in self.host.buckets:
            for rec in bucket.records:
                message = converted(self.host, rec) if bucket.dispatched else None
                if message is not None:
                    raise RuntimeError(message)
                if not bucket.dispatched:
                    check_record(self.host, rec)

    def dispatch_rest(self) -> None:
        """`step()`: send the buckets not sent yet, in forward order (Note: [The order of the
        host step])."""
        for bucket in reversed(self.host.buckets):
            with self.lock:
                go = not bucket.dispatched
                bucket.dispatched = True
            if go:
                self._dispatch_or_unmark(bucket)

    def _dispatch_or_unmark(self, bucket: Bucket) -> None:
        try:
            self._dispatch(bucket)
        except BaseException:
            with self.lock:
                bucket.dispatched = False
            raise

    def _dispatch(self, bucket: Bucket) -> None:
        """Copy the bucket's gradients to the host and queue it for the worker."""
        pairs, keep = [], []
        for rec in bucket.records:
            check_record(self.host, rec)
            p = local(rec.param)
            g = rec.param.grad
            if g is not None and rec.dtensor:
                g = local(g)
            rec.has_grad = g is not None
            if g is None:
                continue
            if isinstance(g, MovedGrad):
                raise RuntimeError(f"parameter {self.host.no(rec)}: {g.message}")
            if g.layout != torch.strided or (g.dtype, tuple(g.shape)) != (p.dtype, rec.entry.shape):
                raise RuntimeError(
                    f"parameter {self.host.no(rec)}: gradient {g.dtype} {tuple(g.shape)} "
                    f"({g.layout}) does not match the parameter; an OffloadedOptimizer needs "
                    "dense gradients of the parameter's dtype and shape"
                )
            pairs.append((rec.grad if rec.staging is None else rec.staging, g))
            keep.append(g)
        bucket.final_event = self.engine.record()
        event = None
        moved = sum(dst.numel() * dst.element_size() for dst, _ in pairs)  # over the link
        if pairs:
            event, _ = self.engine.offload_many(pairs)
            if self.engine.use_streams:  # Note: [Gradients leave in stream order]
                for g in keep:
                    g.record_stream(self.engine.d2h)
                keep = []
            pairs.clear()
        for rec in bucket.records:
            if rec.has_grad and not rec.dtensor:  # a DTensor's is dispatched by step()
                placeholder = MovedGrad(rec.param)  # a streamed one: as empty as it
                placeholder._owner = (self.owner, rec)  # Note: [Loss scaling]
                rec.param.grad = placeholder
        with self.lock:
            self.inflight = [(e, k) for e, k in self.inflight if not completed(e)]
            if moved:
                self.inflight.append((event, keep))
                self.d2h_bytes += moved
        bucket.d2h_event = event
        self.worker.send(bucket, event)

    def drop_copied(self) -> None:
        """Drop the device gradients whose copies are done."""
        with self.lock:
            self.inflight = [(e, k) for e, k in self.inflight if not completed(e)]

    def synchronize(self) -> None:
        """Wait for every copy (teardown: they read device gradients into pinned buffers)."""
        for event, _ in self.inflight:
            if event is not None:
                event.synchronize()
        self.inflight = []
