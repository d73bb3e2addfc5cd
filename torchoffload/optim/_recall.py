"""The backwards of a step: how many the loop runs before `step()` (all but the last are
predicted to accumulate), and a bucket's gradients brought back to the device when a later
backward, or a read, needs them after they left (Note: [A second backward])."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from torchoffload.optim._checks import check_record, refusal
from torchoffload.optim._grads import GradsWritten, MovedGrad, MovedGradError
from torchoffload.optim._host import Bucket, HostMasters, Record
from torchoffload.optim._params import local, same_bits
from torchoffload.optim._step import HostStep

# Note: [A second backward]
# torch.optim accumulates every backward before `step()` into ``param.grad``; a loop that
# accumulates without `accumulating()` (torchao's tests, accelerate, Trainer) looks, at its
# first backward, like one whose backward is final, and its gradients leave the device. When a
# later backward is about to accumulate into a moved gradient (a tensor hook on the parameter
# runs before autograd's accumulation), the bucket is recalled:
# - under the runtime's lock its dispatch number (``gen``) moves on: a dispatch the worker has
#   not taken yet is skipped when it comes to it; one it has taken is waited for (the worker is
#   done with the bucket's host buffers then);
# - a step taken with those gradients is undone (Note: [Steps taken during backward]);
# - the gradients are copied back into fresh device tensors of the parameter's dtype (allocated
#   on the compute stream, copied after both the event of their copy to the host and an event
#   recorded on the compute stream after the allocation, the compute stream waiting on the
#   copy) and become ``param.grad``; autograd then adds the new gradient to them as it would
#   have, bitwise. The compute-stream event is needed because the host runs ahead: a fresh
#   block may still be in use by kernels queued earlier under its previous owner, and the copy
#   stream would otherwise write into it under them (NaN losses on an H200, Llama-3.2-3B
#   shape, when `clip_grad_norm_` recalled every bucket right after backward returned);
# - the bucket starts over: it goes to the host when its gradients are final again, or at
#   `step()`.
# So the result is torch.optim's whatever the loop does, at the price of the copies back and a
# wait for the worker. To not pay it at every step, the runtime counts the backwards outside
# `accumulating()` between two `step()` calls and treats all but the last of the count seen in
# the last step as accumulating (their gradients stay on the device): an accumulation loop
# pays it once, in its first step, and again only when its count changes.


# Note: [Written after its gradient left]
# A bucket's masters are read from their parameters (when these changed since the optimizer
# last read or wrote them) as its gradients leave for the host, during backward; but a loop
# may write a parameter after that and before `step()` (a projection, a clamp, a manual
# update), and torch.optim then steps the written value. So `step()`, before its call opens,
# looks at every sent bucket's parameters (metadata: version counter and data pointer, or a
# streamed one's host version): for each bucket with one written since, the worker is kept
# from stepping it during backward or waited for (`Recalls.written`), and the parameter is
# read (a blocking copy, only after such a write). If its master is of its own dtype and it
# holds the master's bits (a round trip through another dtype), reading it again would change
# nothing, and nothing is done. Otherwise a step taken from the old values is undone and the
# written parameters' masters are read again, as after any write outside the optimizer (a
# bf16 parameter's fp32 master drops its extra bits, whatever the write: found by a review,
# which also found -0.0 taken for 0.0 by a comparison of values); the call then steps the
# bucket with its gradients. Where that
# step wrote its gradients (Note: [A class that writes its gradients]), taking it again is
# impossible: refused before anything changes. A write through ``.data`` moves no version
# counter and is not seen: `reload_parameters()` is the way (found by a helper: the write was
# lost in every mode, up to 0.22 off with SGD at lr 0.1).


# Note: [A gradient set after it left]
# torch.optim steps ``param.grad`` as it is at `step()`: a loop may drop some gradients
# (``p.grad = None``: that parameter is not stepped, not even decayed) or replace them with
# tensors of its own between the final backward and `step()`, without reading the moved ones
# (a read brings the bucket back: Note: [A second backward]). The bucket was sent with the
# gradients backward produced, and may have been stepped with them. So `step()`, before its
# call opens, looks at every sent bucket's records (metadata: is ``param.grad`` still the
# record's `MovedGrad`?) and recalls each bucket with one that is not: its step is undone, the
# gradients still moved come back to the device, the dropped or replaced ones are left as the
# loop set them, and the bucket is sent again by `step()` with ``param.grad`` as it is then.
# Without this, a dropped parameter is stepped with its old gradient (0.003 off after one
# AdamW step at lr 3e-3). Where the other gradients cannot come back (a streamed parameter of
# the bucket, or a step that wrote them) `step()` is refused before anything changes.


# Note: [Written gradients brought back]
# The gradients of a bucket whose step taken during backward wrote them (Note: [A class that
# writes its gradients]) cannot come back to the device: undoing the step puts back the
# masters and the state, not the gradients backward produced. So what would bring them back
# is refused, before anything changes:
# - a second backward (without `accumulating()`, or in it) that brings back moved gradients,
#   at its first hook (`Recalls.hold`, after the checks of Note: [Refused before a backward
#   accumulates]). It was refused by the recall of the written bucket, after the buckets that
#   backward reached first had come back and been accumulated into (found by a review: five
#   gradients of six accumulated, and the `step()` after that refusal stepped the written
#   gradients: every parameter off, by up to 0.0125). It is refused whether or not it
#   reaches the written ones: which bucket the worker stepped first, and so wrote, is a
#   matter of timing, and a rule that looked at which would refuse or serve the same loop by
#   chance (a loop that waits for the worker, as the differential fuzzer does, gets the same
#   answer every time);
# - an operation on a moved gradient (a norm, `clip_grad_norm_` on the model, a copy), before
#   any gradient it reads comes back (`_recalled` in _grads.py), and a GradScaler unscale,
#   before any step is undone (the first found by the differential fuzzer, the second by
#   reading the code: each undid the step and left the written gradients for `step()`).
#   An operation that reads gradients one by one (`clip_grad_norm_` on the CPU) brings back
#   those it reads before the written one, exactly as it would without them.
# A conversion (`model.to(dtype)`) cannot be refused cleanly (`Module._apply` converts a
# parameter before its gradient): the written gradient becomes a placeholder of the new dtype
# and device (`_converted`), which refuses every read as the moved one does, and the optimizer
# refuses the converted parameter as it refuses any (`step()` too, though its bucket was sent:
# `check_rest`). `torch.autograd.grad`, which returns its gradients and leaves ``.grad`` as it
# is, brings nothing back (it did, and was refused by the recall).
# After a refusal the step stays pending: `step()` commits it (or refuses as Note: [A class
# that writes its gradients] says), `zero_grad()` undoes it.
# The worker may still be stepping when the check runs (`Recalls.written`). Under the
# runtime's lock, each bucket that may come back (for a backward, each whose gradients left
# the device) that the worker has not taken is held: it
# arrives without being stepped during backward (its recall then skips it; after a refusal
# `step()` steps it, the same bits); one it has taken (``taken`` is set under the same lock,
# before the step) is waited for, as its recall would wait. Then whether a step wrote those
# gradients is known, and no step that could write them starts later.
# Serving them instead would need the gradients as backward produced them: a copy of each
# bucket's before each step taken during backward, 4 bytes a parameter read and written more
# (a third of AdamW's copy aside), paid with every class, for a case that comes at most once
# in an optimizer's life (after its first write nothing is stepped during backward). So they
# are refused. What the check costs a loop: at the first hook of each backward, a look at each
# bucket's ``dispatched`` flag; the rest only where gradients come back, which waits for the
# worker anyway.


class Recalls:
    """Counts the backwards of a step and recalls buckets for ``host``'s runtime. ``lock``
    is the runtime's; ``before_block`` runs right before waiting for the worker."""

    def __init__(
        self,
        host: HostMasters,
        lock: threading.Lock,
        stepper: HostStep,
        engine: Any,
        before_block: Callable[[], None],
    ):
        self.host = host
        self.lock = lock
        self.stepper = stepper
        self.engine = engine
        self.before_block = before_block
        # Backwards outside `accumulating()` in this step, and in the last one
        self.backwards = 0
        self.expected = 1
        self._counted: int | None = None  # the autograd graph task counted last
        self.recalled = 0  # buckets brought back
        # This backward was checked before it accumulated (Note: [Refused before a backward
        # accumulates]); the device part's refusals (the façade's)
        self._checked: int | None = None  # the autograd graph task checked last
        self.device_refusal: Callable[[], str | None] | None = None
        # and the param groups' (Note: [The param groups the host steps])
        self.groups_refusal: Callable[[], str | None] | None = None

    def hook(self, runtime: Any, records: list[Record]) -> list[Any]:
        """A tensor hook on each trainable parameter, run before autograd accumulates into
        its gradient (``runtime``, weakly: a hook must not keep it alive)."""
        owner = runtime.dispatch.owner
        return [
            r.param.register_hook(functools.partial(_incoming, owner, r))
            for r in records
            if r.trainable and not r.dtensor
        ]

    def hook_kept(self, runtime: Any, params: list[torch.Tensor]) -> list[Any]:
        """The tensor hook of each trainable parameter of the device part (``params``)."""
        owner = runtime.dispatch.owner
        return [p.register_hook(functools.partial(_incoming_kept, owner, p))
                for p in params if p.requires_grad]  # fmt: skip

    def before_accumulate(self, param: torch.Tensor) -> None:
        """A tensor hook of ``param``, before autograd accumulates its gradient: the first
        of each accumulating backward refuses a parameter the step would refuse (Note:
        [Refused before a backward accumulates])."""
        task = torch._C._current_graph_task_id()  # a backward that raised is over too
        if task == self._checked or not accumulates(param):
            return
        for rec in self.host.records:
            message = refusal(self.host, rec)
            if message is not None:
                raise RuntimeError(message)
        for refusal_of in (self.groups_refusal, self.device_refusal):
            message = refusal_of() if refusal_of is not None else None
            if message is not None:
                raise RuntimeError(message)
        self.hold()
        self._checked = task

    def hold(self) -> None:
        """At the first hook of an accumulating backward: refused if it brings back moved
        gradients while a step of this step() wrote its own (Note: [Written gradients
        brought back])."""
        moved = [b for b in self.host.buckets if b.dispatched and any(map(_moved, b.records))]
        written = self.written(moved)
        if written and any(_moved(r) and accumulates(r.param) for b in moved for r in b.records):
            raise GradsWritten(written[0].index, "backward")

    def refuse_written(self, buckets: list[Bucket], when: str) -> None:
        """Refuse ``when`` (`GradsWritten`), before anything changes, if the step of one of
        ``buckets``, about to come back, wrote its gradients."""
        written = self.written(buckets)
        if written:
            raise GradsWritten(written[0].index, when)

    def written(self, buckets: list[Bucket]) -> list[Bucket]:
        """Of ``buckets``, about to come back, those whose step wrote their gradients: none
        is stepped during backward from now on, and a step the worker took is waited for
        (Note: [Written gradients brought back])."""
        if not buckets:
            return []
        with self.lock:
            for bucket in buckets:
                bucket.held = bucket.held or not bucket.taken
            taken = [b for b in buckets if b.taken]
        if any(not b.handled.is_set() for b in taken):
            self.before_block()
            for bucket in taken:
                bucket.handled.wait()
        return [b for b in buckets if b.grads_written]

    def follow_writes(self) -> None:
        """`step()`, before its call opens: the masters of parameters written in place since
        their gradients left follow them, a step taken from the old value is undone (Note:
        [Written after its gradient left])."""
        edited = [b for b in self.host.buckets if b.dispatched and any(map(_edited, b.records))]
        self.written(edited)  # held, or waited for: the worker is done with them
        # every edited parameter is looked at: one found unchanged is marked as read
        changed = [b for b in edited if any([_written(b, r) for r in b.records if _edited(r)])]
        if any(b.grads_written for b in changed):
            raise GradsWritten(next(b for b in changed if b.grads_written).index, "write")
        for bucket in changed:
            self.stepper.undo(bucket)
            for rec in bucket.records:
                if _edited(rec):
                    check_record(self.host, rec)

    def follow_grads(self) -> None:
        """`step()`, before its call opens: a bucket one of whose gradients was dropped or
        replaced (``param.grad`` set) since it left the device is brought back and sent
        again at `step()`, with the gradients as they are now (Note: [A gradient set after it
        left])."""
        stale = [b for b in self.host.buckets if b.dispatched and any(map(_replaced, b.records))]
        if not stale:
            return
        for bucket in stale:
            for rec in bucket.records:
                if rec.hosted is not None and _moved(rec):
                    bad = next(r for r in bucket.records if _replaced(r))
                    raise RuntimeError(
                        f"step(): the gradient of parameter {self.host.no(bad)} was dropped or "
                        "replaced (param.grad set) after it left the device, and parameter "
                        f"{self.host.no(rec)} of its bucket is streamed by stream_parameters: "
                        "its gradient cannot come back for the bucket to be stepped again. "
                        "Nothing was stepped; zero_grad() goes on. Set or drop gradients before "
                        "the final backward (with its earlier backwards inside "
                        "optimizer.accumulating())"
                    )
        self.refuse_written(stale, "set")
        for bucket in stale:
            self.recall(bucket)

    def predicts_accumulation(self) -> bool:
        """Called by each final gradient outside `accumulating()`: counts this backward, and
        says whether it is predicted to be followed by another before `step()`."""
        task = torch._C._current_graph_task_id()
        if task != self._counted:  # the first gradient of this backward
            self._counted = task
            self.backwards += 1
        return self.backwards < self.expected

    def end_step(self, consumed: bool) -> None:
        """`step()` (``consumed``) or `zero_grad()`: the count starts over."""
        if consumed:
            self.expected = max(1, self.backwards)
        self.backwards = 0

    def recall(self, bucket: Bucket) -> None:
        """Bring ``bucket``'s gradients back to the device and undo its step, if taken."""
        for rec in bucket.records:
            if rec.has_grad and rec.hosted is not None and _moved(rec):
                raise MovedGradError(
                    f"parameter {self.host.no(rec)} is streamed by stream_parameters: its "
                    "gradient left the device in the final backward and cannot come back to be "
                    "read or accumulated into before step(); run every backward but the last "
                    "inside optimizer.accumulating(), and read gradients before that backward"
                )
        with self.lock:
            taken = bucket.taken
            bucket.gen += 1  # the worker skips the dispatch if it has not taken it yet
        if taken:
            self.before_block()
            bucket.handled.wait()
        self.stepper.undo(bucket)
        pairs = []
        for rec in bucket.records:
            rec.final = False
            if not rec.has_grad or not _moved(rec):  # dropped or replaced: left as it is
                continue
            dst = torch.empty_like(local(rec.param), memory_format=torch.preserve_format)
            # Before the worker took it with host conversions, the staging buffer holds it
            src = rec.staging if (rec.staging is not None and not taken) else rec.grad
            pairs.append((rec, dst, src))
        # After the copy to the host, and after the compute stream's work so far: the
        # destinations are fresh blocks of the compute stream, which its queued kernels may
        # still be using under their old owner (the host runs ahead of the device)
        after = [bucket.d2h_event, self.engine.record()]
        event = self.engine.load([(d, s) for _, d, s in pairs], after=after)
        self.engine.wait(event)
        for rec, dst, _ in pairs:
            rec.param.grad = dst
        bucket.reset()
        self.recalled += 1


def _incoming(owner: Any, rec: Record, grad: torch.Tensor) -> None:
    """Autograd is about to accumulate into ``rec``'s gradient: the backward is checked first
    (Note: [Refused before a backward accumulates]), and a gradient that left the device in an
    earlier backward of this step comes back (not for `torch.autograd.grad`, which leaves
    ``.grad`` as it is: Note: [Written gradients brought back])."""
    runtime = owner()
    if runtime is None or runtime.closed:
        return
    runtime.recalls.before_accumulate(rec.param)
    g = rec.param.grad
    if type(g) is not MovedGrad or g._owner is None:
        return
    if g._owner[0]() is runtime and accumulates(rec.param):
        runtime.recall(runtime.buckets[rec.entry.bucket])


def _incoming_kept(owner: Any, param: torch.Tensor, grad: torch.Tensor) -> None:
    """The tensor hook of a device part's parameter: the backward is checked before autograd
    accumulates (Note: [Refused before a backward accumulates])."""
    runtime = owner()
    if runtime is not None and not runtime.closed:
        runtime.recalls.before_accumulate(param)


def _edited(rec: Record) -> bool:
    """``rec``'s parameter was written since its master was read or written (metadata)."""
    if rec.hosted is not None:
        return rec.synced[0] != rec.hosted.version
    p = local(rec.param)
    return (p._version, p.data_ptr()) != rec.synced


def _written(bucket: Bucket, rec: Record) -> bool:
    """Whether ``rec``'s parameter (edited: `_edited`) must be read again: always where its
    master has more precision (reading it again drops that, as after any write: Note:
    [Parameters that share a storage] in _params.py); else unless it holds its master's bits
    (as before a step taken during backward), where reading it again would change nothing (a
    round trip through another dtype), and then it is marked as read. A blocking copy, only
    after such a write."""
    src = rec.hosted.host if rec.hosted is not None else local(rec.param).detach()
    if (src.dtype, tuple(src.shape)) != (rec.entry.dtype, rec.entry.shape):
        return True  # converted: check_record refuses it
    master = bucket.undo.before(rec.master) if bucket.pending else rec.master
    if master is None or master.dtype != src.dtype or not same_bits(src.to("cpu"), master):
        return True
    if rec.hosted is None:
        rec.synced = (local(rec.param)._version, local(rec.param).data_ptr())
    else:
        rec.synced = (rec.hosted.version, -2)
    return False


def _replaced(rec: Record) -> bool:
    """``rec``'s gradient left the device in a backward of this step, and ``param.grad`` was
    set since (to None or to another tensor) without reading it (Note: [A gradient set after
    it left])."""
    return rec.has_grad and not rec.dtensor and not _moved(rec)


def _moved(rec: Record) -> bool:
    """``rec``'s gradient left the device in a backward of this step (before `step()`)."""
    g = rec.param.grad
    return type(g) is MovedGrad and g._owner is not None and g._owner[1] is rec


def accumulates(param: torch.Tensor) -> bool:
    """In a tensor hook of ``param`` (a leaf): whether this backward accumulates into its
    ``.grad`` (False under `torch.autograd.grad`, which returns the gradients instead)."""
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(param).node)
    except RuntimeError:  # "currently running autograd.grad()"
        return False
