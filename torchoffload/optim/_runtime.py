"""The host-step runtime of an offloaded optimizer: gradients leave the device as soon as they
are final, a worker thread steps the optimizer class on fp32 host copies while backward goes
on, and the new values go back to the device parameters before the next forward reads them.

Driven by `OffloadedOptimizer` (the public face) through `on_grad` (a post-accumulate-grad
hook), `step`, `discard` (zero_grad), `accumulating`, `settle` and `close`. `HostStepRuntime`
sequences a step over its parts, each built here from values and handed the others it uses:
`HostMasters` (buffers, records, buckets), `HostStep` (the work on a bucket), `HostWorker`
(the thread), `GradientDispatch` (gradients leaving the device) and `StepAhead`.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Any

import torch

from torchoffload._hosted import MANAGED
from torchoffload._transfer import copy_engine
from torchoffload.optim._ahead import StepAhead
from torchoffload.optim._checks import refuse_consumed
from torchoffload.optim._config import OptimizerOffloadConfig
from torchoffload.optim._dispatch import GradientDispatch
from torchoffload.optim._grads import ConsumedGrad, GradsWritten, MovedGrad, _Unscale
from torchoffload.optim._host import Bucket, HostMasters, Record
from torchoffload.optim._recall import Recalls
from torchoffload.optim._step import HostStep, may_refuse
from torchoffload.optim._worker import HostWorker


class HostStepRuntime:
    """The host copies, hooks and worker of one offloaded optimizer."""

    def __init__(
        self,
        params: list[torch.Tensor],
        group_of: list[int],
        groups: list[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        config: OptimizerOffloadConfig,
        device: torch.device,
        numbering: list[int] | None = None,
        clip_order: list[int] | None = None,
    ):
        self.config = config
        self.device = device
        self.engine = copy_engine(device, use_streams=config.use_streams)
        # Each parameter's index in the optimizer's order, for messages (the host part of an
        # offload_fraction split is a subset)
        numbering = list(range(len(params))) if numbering is None else numbering
        # Each parameter's place in the sum of the clipping norm (Note: [The order of the
        # clipping norm])
        clip_order = list(range(len(params))) if clip_order is None else clip_order
        # - The parts, each handed the others it uses
        self.host = HostMasters(params, group_of, groups, optimizer_class, optimizer_kwargs,
                                config, device, numbering)  # fmt: skip
        self.layout = self.host.layout
        self.records = self.host.records  # in parameter order
        self.buckets = self.host.buckets
        self._index = self.host.index  # id(parameter) -> its record's index
        self._lock = threading.Lock()  # the buckets' flags, the snapshot, the copies in flight
        self.stepper = HostStep(self.host, groups, config, self.engine, self._lock, clip_order)
        self.worker = HostWorker(self.stepper, self.buckets, config.host_threads)
        self.dispatch = GradientDispatch(self.host, self.engine, self.worker, self._lock,
                                         weakref.ref(self))  # fmt: skip
        self.ahead = StepAhead(self.engine, self.dispatch, self.settle, self._before_block,
                               enabled=config.step_ahead)  # fmt: skip
        self.testing: Any = None  # torchoffload.testing's (`held_host_step`): ``waiting()``
        # - Counters
        self.steps = 0
        self.wait_ms = 0.0
        # - Hooks. A DTensor parameter's gradient is set by FSDP2 after its reduce-scatter,
        # not accumulated by autograd: its bucket goes to the host at step().
        self._hooks = [
            r.param.register_post_accumulate_grad_hook(self.on_grad)
            for r in self.records
            if r.trainable and not r.dtensor
        ]
        self.recalls = Recalls(self.host, self._lock, self.stepper, self.engine,
                               self._before_block)  # fmt: skip
        self._hooks += self.recalls.hook(self, self.records)
        self.kept_on_device: list[torch.Tensor] = []  # the façade's device part's parameters
        self.kept_numbering: list[int] = []  # and their indices, for messages
        self._fresh_checked = False  # this backward's gradients were checked for placeholders
        self.host.claim(self)
        self.closed = False

    @property
    def waiting(self) -> dict[int, Bucket]:
        """id(parameter) -> its bucket, while a step ahead still steps it."""
        return self.ahead.waiting

    def _before_block(self) -> None:
        if self.testing is not None:
            self.testing.waiting()

    # - Hooks (autograd's threads)
    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook. See Note: [When a gradient is final]."""
        if _not_final(self):
            return
        if self.ahead.running is not None:
            self.settle()
        if not self._fresh_checked:  # the first final gradient of this backward
            self.refuse_consumed("the next backward")
            self._fresh_checked = True
        self.dispatch.final(param)

    def hook_kept(self) -> None:
        """Check each backward before it accumulates into the device part's gradients too
        (Note: [Refused before a backward accumulates])."""
        self._hooks += self.recalls.hook_kept(self, self.kept_on_device)

    def recall(self, bucket: Bucket) -> None:
        """Bring ``bucket``'s gradients back to the device (Note: [A second backward])."""
        self.recalls.recall(bucket)

    # - Step and discard (the caller's thread)
    def step(self, between: Any = None) -> None:
        """``between``: called once every bucket is on its way to the host, before waiting
        for the worker (the device part of an ``offload_fraction`` split steps there)."""
        self.settle()
        self.refuse_consumed("step()")
        self.recalls.follow_grads()  # Note: [A gradient set after it left]
        self.dispatch.check_rest()
        self.recalls.follow_writes()  # Note: [Written after its gradient left]
        called = self._begin(step_rest=True)
        late = may_refuse(self.stepper, self._before_block)  # the device part after a refusal
        if between is not None and not late:
            between()
        if not self.config.step_ahead or late:
            self._end(step_rest=True, called=called)
            if between is not None and late:  # Note: [A class that writes its gradients]
                between()
            return
        # See Note: [Stepping ahead]
        self.ahead.start(called, {id(r.param): self.buckets[r.entry.bucket]
                                  for r in self.records if r.has_grad})  # fmt: skip
        self._reset_records(consumed=True)
        if self.ahead.waiting and (self.ahead.compiled or not self.ahead.push_read_mode()):
            self.settle()  # Note: [Reading the model while stepping ahead]

    def unscale(self, records: list[Record], inv_scale: torch.Tensor) -> bool:
        """GradScaler's unscale of moved gradients (Note: [Loss scaling]): on the host, once
        they have arrived, before any of them is stepped; whether one was not finite."""
        # No bucket is stepped as it arrives from now on (the job sees whether one was)
        self.stepper.loss_scaling = True
        job = _Unscale(records, inv_scale.detach().to("cpu", torch.float32))
        self.worker.unscale(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.found

    def check_idle(self, what: str) -> None:
        """Refuse ``what`` while this step's buckets are on their way (after the final
        backward, before step() or zero_grad())."""
        self.settle()
        self.worker.pause_preparing()  # the caller reads or replaces the state
        if any(b.dispatched for b in self.buckets):
            raise RuntimeError(
                f"{what} between the final backward and step(): the host is stepping this "
                "step's buckets; call step() (or zero_grad()) first"
            )

    def reload_parameters(self) -> None:
        """Read every master again from its parameter (after writes the version counter does
        not see, such as through ``param.data``)."""
        self.check_idle("reload_parameters()")
        for rec in self.records:
            self.host.refresh(rec)

    def settle(self) -> None:
        """Finish a step that is still running on the host (step_ahead)."""
        called = self.ahead.take()
        if called is not None:  # its records were reset by step(): Note: [Stepping ahead]
            self._end(step_rest=True, called=called, reset=False)
        self.ahead.drop_read_mode()

    def before_state_dict(self, *args: Any) -> None:
        """A module's state_dict/load_state_dict pre-hook (Note: [Reading the model while
        stepping ahead])."""
        self.settle()

    def discard(self) -> None:
        """zero_grad(): undo what was stepped during backward (Note: [Steps taken during
        backward]), step nothing, drop the gradients. After a `step()` still running ahead:
        nothing."""
        if self.ahead.running is not None:
            return
        self._end(step_rest=False, called=self._begin(step_rest=False))

    def _begin(self, *, step_rest: bool) -> float:
        called = time.perf_counter()
        snapshot = self.stepper.open_call(called, step_rest)
        if step_rest:
            self.dispatch.dispatch_rest()
        self.worker.finish(step_rest, snapshot)
        return called

    def _end(self, *, step_rest: bool, called: float, reset: bool = True) -> int:
        self._before_block()
        interrupted = self.worker.wait_done()
        if step_rest:
            self.wait_ms = (time.perf_counter() - called) * 1e3
        self.dispatch.inflight.clear()  # every gradient copy was waited on by the worker
        self.engine.wait(self.stepper.last_upload)
        stepped = sum(b.stepped for b in self.buckets)
        errors, self.stepper.errors = self.stepper.errors, []
        if reset:
            self._reset_records(consumed=step_rest)
        self.stepper.end_call(keep_times=step_rest)
        self.worker.idle()
        if step_rest and not errors:
            self.steps += 1
            if self.stepper.loss_scaling is None:
                self.stepper.loss_scaling = False
        if interrupted is not None:
            raise interrupted
        if errors:
            index, exc = errors[0]
            if isinstance(exc, GradsWritten):  # nothing was stepped: a refusal
                raise exc
            where = f"bucket {index}" if index >= 0 else "the worker"
            raise RuntimeError(
                f"the host step failed in {where} ({stepped} of {len(self.buckets)} buckets "
                "were stepped and uploaded; every parameter holds either its old or its new "
                "value, and the failed bucket's masters are read again from the device; its "
                f"optimizer state is what the optimizer class left when it raised): {exc!r}"
            ) from exc
        return stepped

    def _reset_records(self, *, consumed: bool) -> None:
        """After `step()` (``consumed``) a moved gradient becomes a `ConsumedGrad` (Note: [The
        gradient after step()]); after a discard, ``None``."""
        self._fresh_checked = False
        self.recalls.end_step(consumed)
        for rec in self.records:
            rec.final = False
            if type(rec.param.grad) is MovedGrad:
                rec.param.grad = ConsumedGrad(rec.param) if consumed else None

    def refuse_consumed(self, what: str) -> None:
        """Refuse ``what`` while a parameter holds a `ConsumedGrad`, before anything changes
        (Note: [The gradient after step()])."""
        every = [(self.host.no(r), r.param) for r in self.records]
        every += list(zip(self.kept_numbering, self.kept_on_device, strict=True))
        refuse_consumed(every, what)

    # - Teardown
    def close(self) -> None:
        """Finish what is in flight (a step ahead, buckets already sent), wait for every copy,
        then stop. An error of the step being finished is raised after the teardown."""
        if self.closed:
            return
        error: BaseException | None = None
        try:
            self.settle()
        except BaseException as exc:
            error = exc
        try:
            if any(b.dispatched for b in self.buckets):
                self._end(step_rest=False, called=self._begin(step_rest=False))
        except BaseException as exc:
            error = error or exc
        self.dispatch.synchronize()  # copies that read device gradients, pinned buffers
        if self.stepper.last_upload is not None:
            self.stepper.last_upload.synchronize()
        self.closed = True
        for h in self._hooks:
            h.remove()
        self.worker.stop()
        for p in self.kept_on_device:
            if MANAGED.get(p) is self:
                del MANAGED[p]
        self.host.release(self)
        if error is not None:
            raise error


# Note: [Closing from a thread of our own]
# An `OffloadedOptimizer` dropped without `remove()` is closed by its finalizer, which the
# garbage collector runs on whichever thread happens to allocate at that moment: possibly the
# host-step worker itself or a thread of its norm pool (seen in CI: "cannot join current
# thread" from the worker, while it made copies aside ahead). `close()` waits for and joins
# those threads, so on one of them it would fail or hang; there it runs on a new thread.


def close_soon(runtime: HostStepRuntime) -> None:
    """The finalizer of an `OffloadedOptimizer`: ``runtime.close()`` here, or on a thread of
    its own when this is one of torchoffload's threads (Note: [Closing from a thread of our
    own])."""
    if threading.current_thread().name.startswith("torchoffload-"):
        threading.Thread(target=runtime.close, name="closing an OffloadedOptimizer",
                         daemon=True).start()  # fmt: skip
    else:
        runtime.close()


# Note: [A micro-batch that accelerate says is not the last]
# accelerate's ``Accelerator.accumulate`` (and Hugging Face Trainer, which sets it itself)
# marks the backward of each micro-batch but the last of a step with ``sync_gradients``
# False in its process-wide ``GradientState``. Such a backward's gradients are not final:
# the next backward accumulates into them. Read here (only where accelerate is imported, and
# without initializing its state), it keeps them on the device as `accumulating()` does, from
# the first step on: otherwise they leave and come back (a recall for each bucket in the
# first step, counted by `Recalls.predicts_accumulation` from then on), and a streamed
# parameter's cannot come back at all. It is a hint only: a final gradient kept on the device
# is sent at `step()`, exactly, so a stale False (an accelerate loop left before its step's
# last micro-batch) costs the overlap, never a bit.


def _not_final(rt: HostStepRuntime) -> bool:
    """Whether a gradient just accumulated stays on the device: inside `accumulating()`, the
    runtime closed, a micro-batch accelerate says is not the last, or a backward predicted to
    be followed by another (which counts this one: `Recalls.predicts_accumulation`)."""
    return bool(rt.dispatch.depth or rt.closed or _accelerate_defers()
                or rt.recalls.predicts_accumulation())  # fmt: skip


def _accelerate_defers() -> bool:
    """Whether accelerate marks the running backward as one of a micro-batch before the last
    of its step (Note: [A micro-batch that accelerate says is not the last])."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    get = getattr(shared, "get", None)
    return get is not None and get("sync_gradients", True) is False
