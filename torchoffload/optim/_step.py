"""The host step itself, run on the worker: a bucket's gradients arrive in fp32, are clipped
(``max_grad_norm``), stepped by the bucket's instance of the optimizer class with the
hyperparameters of the `step()` call, and the new values uploaded to the device."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import torch

from torchoffload.optim._checks import changed_hyper, changed_in
from torchoffload.optim._config import OptimizerOffloadConfig
from torchoffload.optim._grads import GradsWritten
from torchoffload.optim._host import Bucket, HostMasters
from torchoffload.optim._params import hyper, local

# Note: [Where the conversions run]
# A bf16 parameter is stepped as an fp32 master: its gradient goes bf16 -> fp32 and its new
# value fp32 -> bf16. On the host those conversions are 12 bytes of memory traffic per element
# beside the 28 of a fused AdamW step, and the host step is what binds (run E in
# benchmarks/log/2026-11-23-optimizer-on-host.md, Llama-3.2-3B shape on an H100: fused AdamW
# 687 ms, the conversions about 400 ms more). The link has room (the bf16 bytes both ways
# took 234 ms), so by default the copies convert on the device (Note: [Copies that convert]
# in _transfer.py): twice the link bytes, no host conversion, no staging buffer (2 bytes of
# host memory less per element). Both give the same bits: a widening conversion is exact, and
# rounding to bf16 is round-to-nearest-even on both.
# Measured in one run on an H100 machine (run G): 1222 ms a step converting on the device
# against 1558 on the host, host memory 49.4 GiB against 55.3. ``convert_on="host"`` keeps the
# host placement, for a link slower than the host.
#
# Note: [Uploading while backward runs]
# A bucket's new values are copied into its device parameters on the copy stream after an event
# recorded on the compute stream when the bucket's gradients became final, and only once
# `step()` has committed its step (Note: [Steps taken during backward]): a forward before
# `step()` reads the old values, as with torch.optim. When `step()` is called while backward
# is still queued on the device (the host runs ahead), the copy may still run during backward.
# Every kernel through which autograd reads a parameter in backward (its gradient formula, a
# forward recomputed under activation checkpointing) is queued before the parameter's gradient
# is accumulated, so before that event. Invariant relied on: nothing queued later in backward
# reads the parameter, i.e. the model does not read parameters in backward outside autograd (a
# backward hook reading a weight under `no_grad`). `step()` makes the compute stream wait on
# the last upload, so the next forward reads the new values; no host sync.
#
# Note: [Clipping bucket by bucket]
# `clip_grad_norm_` multiplies every gradient by one clamped coefficient, an elementwise
# product that gives the same bits whichever tensors are multiplied together. So once the
# total norm is known (every gradient has arrived), each bucket's gradients are scaled right
# before that bucket is stepped, in forward order, rather than all of them before the first
# step: the first layers' new values (those the next forward reads first, and waits for with
# ``step_ahead``) are uploaded one bucket's scaling after `step()`, not 3.2 B parameters'
# (a pass over 12.8 GB of fp32 gradients at the Llama-3.2-3B shape).
#
# Note: [The order of the clipping norm]
# ``clip_grad_norm_`` takes the norm of each gradient (`torch._foreach_norm`, per device and
# dtype), stacks those norms in the order of the tensors it was given and takes the norm of
# that vector: the order of that sum changes the last bits of the clip coefficient. The
# reference of ``max_grad_norm`` is what Trainer and accelerate call,
# ``clip_grad_norm_(model.parameters())``, over the fp32 gradients the host steps: with
# ``model=`` given, the norms are stacked in the order of ``model.parameters()`` (the
# optimizer's parameters the model lacks after them, in the order given); without it, in
# the order the parameters were given (the param groups concatenated), which is
# ``clip_grad_norm_(params)``. Param groups listed in another order than the model's (a
# decay and a no-decay group) therefore need ``model=`` to match the model's bits. The host
# gradients are all fp32 tensors of one device, so clip_grad_norm_'s grouping by device and
# dtype does not reorder them: for fp32 parameters this is bitwise ``clip_grad_norm_`` on
# the model; for others it is ``clip_grad_norm_`` over their fp32 master gradients.


class HostStep:
    """The worker's work on ``host``'s buckets, and the state of the current `step()` call:
    its time and hyperparameters, the errors of its buckets, its last upload. ``lock`` is the
    runtime's (it guards the buckets' flags and the snapshot); ``clip_order``: each
    parameter's place in the sum of the clipping norm."""

    def __init__(
        self,
        host: HostMasters,
        user_groups: list[dict[str, Any]],
        config: OptimizerOffloadConfig,
        engine: Any,
        lock: threading.Lock,
        clip_order: list[int],
    ):
        self.host = host
        self.buckets = host.buckets
        self.user_groups = user_groups  # the public optimizer's param_groups (live dicts)
        self.config = config
        self.engine = engine
        self.lock = lock
        self.clip_order = clip_order
        # - The current call (reset by `end_call`)
        self.call_time: float | None = None
        self.call_steps = False  # the call is a step(), not a discard
        self.snapshot: list[dict[str, Any]] | None = None  # hyperparameters at step()
        self.errors: list[tuple[int, BaseException]] = []  # (bucket index or -1, the error)
        self.last_upload: Any = None
        # When a step taken during backward may be taken again: the buckets the worker was
        # taking at step() (Note: [A class that writes its gradients])
        self.in_flight: list[Bucket] | None = None
        # A GradScaler unscales this optimizer's gradients: None until the first step() is
        # done (Note: [Loss scaling])
        self.loss_scaling: bool | None = None
        # - Counters
        self.h2d_bytes = 0
        self.host_ms = 0.0
        self.host_ms_after_call = 0.0
        self.last_host_ms = self.last_host_ms_after_call = 0.0
        self.grad_norm: torch.Tensor | None = None
        self.clipped = False  # the last clip scaled the gradients
        self.speculated = 0  # buckets stepped before step() committed or undid them
        self.undone = 0  # of which undone
        self.norms = NormPool(config.host_threads)  # Note: [Gradient norms on a pool]
        self.hint: list[int] = []  # `hint_of` the last step; copies made ahead; arrivals
        self.prepared = self.arrivals = 0
        self.grads_written = False  # Note: [A class that writes its gradients]

    def steps_early(self) -> bool:
        """Whether a bucket is stepped as soon as it arrives: not while a GradScaler may
        unscale (Note: [Loss scaling]), nor with ``max_grad_norm`` when the last step clipped
        (it would likely be undone: Note: [Steps taken during backward])."""
        c = self.config
        clip_expected = c.max_grad_norm is not None and self.clipped
        return c.overlap and not (clip_expected or self.loss_scaling or self.grads_written)

    # - The call (the caller's thread)
    def open_call(self, called: float, steps: bool) -> list[dict[str, Any]]:
        """Start a `step()` (``steps``) or discard call made at ``called``; its
        hyperparameters."""
        self.call_time = called
        self.call_steps = steps
        # Every bucket stepped from now on uses the values of this call (a scheduler may
        # change them while the host still steps ahead). Under the lock: a bucket the worker
        # steps meanwhile reads either this snapshot or the values before it, never values
        # changed after step() returned (seen as a flaky "param_groups changed" error).
        with self.lock:
            snapshot = [hyper(g) for g in self.user_groups]
            self.snapshot = snapshot
            self.in_flight = in_flight(self, snapshot) if steps else None
        return snapshot

    def end_call(self, keep_times: bool) -> None:
        """The call is done: its buckets reset, its times kept for `stats()` (``keep_times``)."""
        if keep_times:
            self.last_host_ms = self.host_ms
            self.last_host_ms_after_call = self.host_ms_after_call
        self.host_ms = self.host_ms_after_call = 0.0
        for bucket in self.buckets:
            bucket.reset()
        self.call_time = None
        self.snapshot = None

    # - The worker's thread
    def arrive(self, bucket: Bucket, event: Any) -> None:
        """The bucket's gradients are on the host once ``event`` completes: to fp32 (host
        conversions), their norms (``max_grad_norm``), then the step if it runs early."""
        start = time.perf_counter()
        try:
            if event is not None:
                event.synchronize()  # the worker's wait: see Note: [When a gradient is final]
                start = time.perf_counter()  # host work only
            with torch.no_grad():
                for rec in bucket.records:
                    if rec.has_grad and rec.staging is not None:
                        rec.grad.copy_(rec.staging)
                if self.config.max_grad_norm is not None:
                    grads = [r.grad for r in bucket.records if r.has_grad]
                    bucket.norms = self.norms.start(grads, self.config.norm_type)
            bucket.arrived = True
            bucket.arrival, self.arrivals = self.arrivals, self.arrivals + 1
        except BaseException as exc:
            bucket.failed = exc
            self.errors.append((bucket.index, exc))
        self._account(start)
        if not self.steps_early() or bucket.failed:
            return
        # Before step() the step is speculative (Note: [Steps taken during backward]); after
        # it, final unless finish() has to clip first; after zero_grad(), not taken.
        if self.snapshot is None:
            if not bucket.held:  # Note: [Written gradients brought back]
                self.step(bucket, speculative=True)
        elif self.call_steps and self.config.max_grad_norm is None:
            self.step(bucket, speculative=False)

    def finish(self, step_rest: bool, snapshot: list[dict[str, Any]]) -> None:
        """Commit or step what has arrived, in forward order, with the hyperparameters of the
        `step()` call (clipping first): a bucket stepped before is committed (uploaded) when
        its step is the one this call asks for, else undone and stepped again (Note: [Steps
        taken during backward]). When not ``step_rest`` (zero_grad): undo what was stepped,
        step nothing."""
        start = time.perf_counter()
        todo = [b for b in reversed(self.buckets) if b.arrived and not b.failed]
        if not step_rest:
            for bucket in todo:
                self.undo(bucket, again=False)
            self._account(start)
            return
        coefficient = None
        self.hint = hint_of(todo)
        if self.config.max_grad_norm is not None:
            self.grad_norm, coefficient = clip_coefficient(self.host, self.config,
                                                           self.clip_order)  # fmt: skip
            self.clipped = coefficient is not None
        # Stepped with the gradients before clipping, or other values: taken again
        redo = [b for b in todo if b.pending and (self.clipped or changed_in(b, snapshot))]
        if any(b.grads_written for b in redo):  # Note: [A class that writes its gradients]
            for bucket in todo:
                self.undo(bucket, again=False)
            raise GradsWritten(next(b for b in redo if b.grads_written).index, "step")
        for bucket in redo:
            self.undo(bucket)
        self._account(start)
        for bucket in todo:
            if bucket.pending:
                self.publish(bucket)
            elif not bucket.stepped:
                if coefficient is not None:  # Note: [Clipping bucket by bucket]
                    start = time.perf_counter()
                    scale(bucket, coefficient)
                    self._account(start)
                self.step(bucket, speculative=False)

    def undo(self, bucket: Bucket, again: bool = True) -> None:
        """Undo the bucket's speculative step (nothing when it has none), to take it again
        with its gradients (``again``) or not at all (Note: [A class that writes its
        gradients])."""
        if not bucket.pending:
            return
        bucket.undo.restore(bucket.optimizer)
        bucket.pending = bucket.stepped = False
        bucket.used = None
        self.undone += 1
        if again and bucket.grads_written:  # refused before, by whoever undoes it
            raise GradsWritten(bucket.index, "step")

    def step(self, bucket: Bucket, *, speculative: bool) -> None:
        """One call of the optimizer class over the bucket; then, unless ``speculative``, the
        upload of its new values (Note: [Steps taken during backward])."""
        start = time.perf_counter()
        try:
            opt = bucket.optimizer
            with self.lock:  # `open_call` takes its snapshot under it: both, or the snapshot
                snapshot = self.snapshot  # (a scheduler may change the values after step())
                if snapshot is None:  # stepped during backward: checked against step()'s
                    bucket.used = hyper_now(self.user_groups, bucket.groups)
            if snapshot is None and bucket.used is None:  # groups edited: taken at step()
                self._account(start)  # not `done`: step ahead's forward waits for its upload
                return
            for k, (host_group, g) in enumerate(zip(opt.param_groups, bucket.groups, strict=True)):
                host_group.update(snapshot[g] if snapshot is not None else bucket.used[k])
            if speculative:
                bucket.undo.save(opt, bucket.steps)
            # Views of one buffer share a version counter: a speculative step's class gets
            # tensors with their own (Note: [A class that writes its gradients])
            alias = own_counter if speculative else (lambda g: g)
            grads = [alias(r.grad) if r.has_grad else None for r in bucket.records]
            for rec, grad in zip(bucket.records, grads, strict=True):
                rec.master.grad = grad
            grads = [g for g in grads if g is not None]
            bucket.steps += 1  # Note: [Copies aside made ahead]
            for rec in bucket.records:  # Note: [A master that is its parameter's bits]
                rec.fresh = False
            NormPool.results(bucket.norms)  # they read the gradients the class may write
            versions = [g._version for g in grads]
            try:
                step_unhooked(opt)
            finally:
                for rec in bucket.records:
                    rec.master.grad = None
            if speculative and versions != [g._version for g in grads]:
                bucket.grads_written = self.grads_written = True
            bucket.stepped = True
            if speculative:
                bucket.pending = True
                self.speculated += 1
            else:
                self._publish(bucket)
        except BaseException as exc:
            if speculative and bucket.undo.saved:  # as if never stepped
                bucket.undo.restore(bucket.optimizer)
                bucket.pending = bucket.stepped = False
            self._fail(bucket, exc)
        if not bucket.pending:
            bucket.done.set()
        self._account(start)

    def publish(self, bucket: Bucket) -> None:
        """Commit a speculative step: upload its new values."""
        start = time.perf_counter()
        try:
            bucket.undo.drop()
            bucket.pending = False
            self._publish(bucket)
        except BaseException as exc:
            self._fail(bucket, exc)
        bucket.done.set()
        self._account(start)

    def _fail(self, bucket: Bucket, exc: BaseException) -> None:
        bucket.failed = exc
        self.errors.append((bucket.index, exc))
        for rec in bucket.records:  # not uploaded: the master follows the device again
            rec.synced = (-1, -1)

    def _publish(self, bucket: Bucket) -> None:
        """Upload the bucket's new values (`upload`)."""
        nbytes = upload(bucket, self.engine)
        if nbytes:
            self.last_upload = bucket.upload_event
            self.h2d_bytes += nbytes

    def _account(self, start: float) -> None:
        end = time.perf_counter()
        self.host_ms += (end - start) * 1e3
        called = self.call_time
        if called is not None and end > called:
            self.host_ms_after_call += (end - max(start, called)) * 1e3


def hyper_now(groups: list[Any], indices: list[int]) -> list[dict[str, Any]] | None:
    """The hyperparameters of ``groups[g]`` for each g in ``indices`` as the loop holds them
    now, for a step taken during backward; None where they cannot be read as built. The loop's
    thread may edit ``param_groups`` while the worker reads them (a hook that deleted a group
    was read as an IndexError that failed the next step); the bucket is then stepped at
    `step()`, where `GroupsCheck` refuses the edit or it was put back (Note: [The param groups
    the host steps])."""
    try:
        return [hyper(groups[g]) for g in indices]
    except Exception:  # an index gone, not a dict, a dict resized while read
        return None


def upload(bucket: Bucket, engine: Any) -> int:
    """Queue the upload of the bucket's new values (a streamed parameter's: into its host
    store); the bytes queued. See Note: [Uploading while backward runs]."""
    pairs = []
    with torch.no_grad():
        for rec in bucket.records:
            if rec.has_grad and rec.hosted is not None:  # Note: [Hosted parameters]
                rec.hosted.before_write()
                rec.hosted.host.copy_(rec.master)
                rec.synced = (rec.hosted.version, -2)
            elif rec.has_grad:
                if rec.staging is not None:
                    rec.staging.copy_(rec.master)
                pairs.append((local(rec.param).detach(), rec.master
                              if rec.staging is None else rec.staging))  # fmt: skip
    if not pairs:
        return 0
    bucket.upload_event = engine.load(pairs, after=[bucket.final_event])
    # Every parameter of a storage written here, the unwritten ones included (Note:
    # [Parameters that share a storage])
    written = {r.family for r in bucket.records if r.has_grad and r.hosted is None}
    for rec in bucket.records:
        if rec.family in written:
            p = local(rec.param)
            rec.synced = (p._version, p.data_ptr())
    return sum(src.numel() * src.element_size() for _, src in pairs)


def in_flight(stepper: HostStep, snapshot: list[dict[str, Any]]) -> list[Bucket] | None:
    """At `step()` (``snapshot``: its hyperparameters), under the lock: where a step taken
    during backward may be taken again (clipping, changed hyperparameters), the buckets the
    worker may be stepping during backward now, else None (Note: [A class that writes its
    gradients])."""
    c = stepper.config
    if c.max_grad_norm is None and changed_hyper(stepper.buckets, snapshot) is None:
        return None
    if not stepper.steps_early():  # none is (one that wrote its gradients turned it off)
        return []
    return [b for b in stepper.buckets if b.taken and not b.handled.is_set()]


def may_refuse(stepper: HostStep, before_block: Any) -> bool:
    """Whether the `step()` just opened may be refused (`GradsWritten`): a step taken during
    its backward wrote its gradients, and clipping or changed hyperparameters may have it
    taken again. Waits for the buckets the worker was taking when `step()` was called
    (``before_block`` first). See Note: [A class that writes its gradients]."""
    if stepper.in_flight is None:
        return False
    if any(not b.handled.is_set() for b in stepper.in_flight):
        before_block()
        for bucket in stepper.in_flight:
            bucket.handled.wait()
    return any(b.grads_written for b in stepper.buckets)


# Note: [The class's step without step hooks]
# torch.optim runs the global step hooks (`register_optimizer_step_pre_hook` and
# `_post_hook`) around every optimizer's `step()`, through a wrapper it installs on the class.
# Here the user's optimizer is the `OffloadedOptimizer`: its `step()` runs them once, as the
# plain class's would. The instances of the class that step the buckets (on the worker,
# during backward too, once more for a step undone and taken again) and the device part are
# internal: the hooks ran on them as well, over host masters, once a bucket and step. A
# hook that scales the gradients (a user's own clipping) scaled them twice: silently off
# with ``overlap=False``, and with overlap a refusal blaming the class for writing its
# gradients. So they step through the class's own `step`, beneath torch's wrapper
# (`step_unhooked`). A class whose `step` calls a parent's wrapped `step` (``super().step()``
# on a class an instance of which torch has wrapped) still runs the hooks there.


def step_unhooked(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.step()`` without torch's step hooks: Note: [The class's step without step
    hooks]."""
    own = vars(optimizer).get("step")  # this instance's own (testing.held_host_step's)
    if own is not None:
        return own()
    step = type(optimizer).step
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step(optimizer)


def own_counter(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory with a version counter of its own."""
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def scale(bucket: Bucket, coefficient: torch.Tensor) -> None:
    """Multiply the bucket's gradients by the clip coefficient, as `clip_grad_norm_`."""
    grads = [r.grad for r in bucket.records if r.has_grad]
    if grads:
        torch._foreach_mul_(grads, coefficient)


# Note: [A class that writes its gradients]
# torch.optim's classes only read ``param.grad``, but a class of the user's may write it in
# place (L2 weight decay as ``grad.add_(p, alpha=wd)``). A step taken during backward with
# such a class leaves gradients that are no longer the ones backward produced, so it cannot
# be undone and taken again (after a clip, an unscale, changed hyperparameters) nor brought
# back to the device for a second backward: the gradients' version counters are compared
# around each speculative step (on aliases with counters of their own: the host gradients
# are views of one buffer, whose shared counter other buckets' copies move, as a first
# version of this check found in CI), and such a step is refused when it would have to be
# taken again: at `step()`, every step taken during backward is undone and nothing is
# stepped; undone and left untaken (`zero_grad()`) is still exact. From then on this
# optimizer steps nothing during backward. (Stepping the class once at the build on a
# scratch parameter would find such a class before any refusal, but it runs the user's code,
# and global step hooks, with side effects: a test's class that signals the caller hung.)
# Gradient norms (``max_grad_norm``) are waited for before any step of their bucket, since
# the class may write what they read (found by a review: the norm of a gradient already
# written by the step, clipping by a wrong norm).
# With ``step_ahead`` the refusal must come from `step()`, not from the worker after `step()`
# returned (found while closing Note: [Written gradients brought back]: the next forward ran
# on the old values, and the refusal came out of a later call). So where a step taken during
# backward may be taken again (``max_grad_norm``, hyperparameters changed), `step()` waits
# for the bucket the worker was stepping during backward when it was called, if any
# (`may_refuse`: a step started after `step()` is not one taken during backward) and, if a
# step of this backward wrote its gradients, finishes the call before it returns, without
# stepping ahead: once in an optimizer's life. The wait costs such a `step()` at most the
# rest of one bucket's step, and only while buckets are stepped during backward.


def hint_of(buckets: list[Bucket]) -> list[int]:
    """The buckets to copy aside ahead of the next backward (Note: [Copies aside made
    ahead]): of ``buckets``, the step's, as many as it stepped during backward and two more,
    in the order their gradients arrived."""
    spec = sum(b.pending for b in buckets)
    first = sorted(buckets, key=lambda b: b.arrival)
    return [b.index for b in first][: spec + 2] if spec else []


def clip_coefficient(
    host: HostMasters, config: OptimizerOffloadConfig, clip_order: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The total norm of the host gradients as ``clip_grad_norm_`` takes it over them (the
    per-tensor norms computed as buckets arrived, stacked in ``clip_order``: Note: [The order
    of the clipping norm]), and the clamped coefficient that scales them, or None where it
    changes no gradient (a coefficient of exactly 1: Note: [Steps taken during backward])."""
    norms: dict[int, torch.Tensor] = {}
    for bucket in host.buckets:
        with_grad = [r for r in bucket.records if r.has_grad]
        done = NormPool.results(bucket.norms)
        norms.update({r.entry.index: n for r, n in zip(with_grad, done, strict=True)})
    if not norms:
        return torch.tensor(0.0), None
    ordered = [norms[i] for i in sorted(norms, key=clip_order.__getitem__)]
    total = torch.linalg.vector_norm(torch.stack(ordered), config.norm_type)
    coefficient = config.max_grad_norm / (total + 1e-6)
    # at least 1, +inf included (``max_grad_norm=inf``: the norm only), changes no gradient;
    # a NaN coefficient makes every gradient NaN, as clip_grad_norm_'s does
    if not bool(coefficient < 1.0) and not bool(torch.isnan(coefficient)):
        return total, None
    return total, torch.clamp(coefficient, max=1.0)


# Note: [Gradient norms on a pool]
# The per-tensor norms of ``max_grad_norm`` are what binds a clipped step on the host, not the
# step: the CPU kernel of an fp32 2-norm runs on one thread whatever the intra-op setting (16
# cores of the H100 machine: `torch._foreach_norm` over 3.2 B fp32 gradients in 57 buckets
# took 1072 ms, 11.9 GB/s, against 640 ms for fused AdamW over the same parameters; on two
# cores, 1 and 2 threads give the same time and the same bits; benchmarks/clip_kernels.py).
# So each gradient's 2-norm (or max) is one task on a pool of host threads: the same kernel
# on the same tensor, hence the same bits as `clip_grad_norm_`'s, computed side by side.
# Other norm types run multi-threaded kernels whose bits depend on the thread count: they
# are computed on the worker, as before. A bucket holds the futures (`NormPool.start`),
# and whoever needs the values or writes the gradients waits for them (`NormPool.results`:
# the clip coefficient, GradScaler's unscale); a gradient buffer written again while a
# discarded bucket's norms still read it (a recall, the next step's copy) only spoils values
# nobody reads.


class NormPool:
    """Host threads that compute gradient norms, one tensor per task (Note: [Gradient norms
    on a pool]); ``threads``: how many (None: the process's intra-op setting). Started at
    its first use."""

    def __init__(self, threads: int | None):
        self.threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, grads: list[torch.Tensor], norm_type: float) -> list[Any]:
        """The norms of ``grads``, on their way: futures (`results` waits for them). Other
        norms than the 2-norm and the max are computed here and now: their kernels' bits
        depend on the intra-op thread count."""
        if norm_type not in (2.0, float("inf")):
            return [_norm(g, norm_type) for g in grads]
        if self._pool is None:
            n = self.threads or torch.get_num_threads()
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max(1, n), thread_name_prefix="torchoffload-norms"
            )
        return [self._pool.submit(_norm, g, norm_type) for g in grads]

    @staticmethod
    def results(norms: list[Any]) -> list[torch.Tensor]:
        """The values of ``norms`` (futures or tensors), waiting for those still running."""
        return [n.result() if isinstance(n, concurrent.futures.Future) else n for n in norms]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    with torch.no_grad():  # the kernel `clip_grad_norm_` runs over a list of CPU tensors
        return torch._foreach_norm([grad], norm_type)[0]
