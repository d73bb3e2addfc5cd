"""The host-step runtime of an offloaded optimizer: gradients leave the device as soon as they
are final, a worker thread steps the optimizer class on fp32 host copies while backward goes
on, and the new values go back to the device parameters before the next forward reads them.

Driven by `OffloadedOptimizer` (the public face) through `on_grad` (a post-accumulate-grad
hook), `step`, `discard` (zero_grad), `accumulating` and `close`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._C import _get_function_stack_at, _len_torch_function_stack
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode

from torchoffload._hosted import HOSTED, MANAGED, Hosted
from torchoffload._pool import pinned_buffer
from torchoffload._transfer import copy_engine
from torchoffload._validate import check_bool, check_int, check_number
from torchoffload.optim._grads import (
    ConsumedGrad,
    MovedGrad,
    _tensors,
    _Unscale,
)
from torchoffload.optim._layout import Entry, HostLayout, default_bucket_bytes, plan_layout

logger = logging.getLogger(__name__)

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
#
# Note: [Uploading while backward runs]
# A bucket's new values are copied into its device parameters on the copy stream after an event
# recorded on the compute stream when the bucket's gradients became final. Every kernel through
# which autograd reads a parameter in backward (its gradient formula, a forward recomputed under
# activation checkpointing) is queued before the parameter's gradient is accumulated, so before
# that event. Invariant relied on: nothing queued later in backward reads the parameter, i.e.
# the model does not read parameters in backward outside autograd (a backward hook reading a
# weight under `no_grad`). `step()` makes the compute stream wait on the last upload, so the
# next forward reads the new values; no host sync.
#
# Note: [Host buffers are reused across steps without a sync]
# A bucket's host buffers receive its gradient (D2H, into the fp32 gradient or, with host
# conversions, the staging buffer), then its new value (the master, or the staging buffer the
# worker converts it into), which the upload reads. The next step's gradient copy is queued
# after `step()` made the compute stream wait on the upload, and the copy stream waits on the
# compute stream, so it cannot overtake the upload. The worker touches a bucket's host buffers
# only after it has waited on that bucket's gradient copy event.

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
# Note: [Host threads]
# The host step runs on its own thread, whose OpenMP team has `host_threads` threads (set with
# `torch.set_num_threads` on that thread: it changes that thread's setting and the default of
# threads started later, not the caller's). Leaving cores to backward's own host work was
# measured not to pay: on the H100 machine (16 cores, a Llama-3.2-3B shape, benchmarks/optim.py)
# a step took 1536 ms with all 16 threads and 1602 ms with 14. So the default keeps the
# process's setting.

# Note: [The order of the host step]
# Backward finishes the last layers' buckets first, the next forward needs the first layers'
# first. The worker therefore steps, among the buckets it has, the one of the earliest
# parameters (the highest bucket index) first: when it lags behind backward, what is left when
# `step()` is called is the later layers', which the next forward needs last; after `step()`
# the rest goes in forward order. It picks only among buckets whose gradient copy has
# completed (else the oldest): the host launches backward well ahead of the device, so the
# newest bucket's copy completes only when the device gets there, and waiting on it would idle
# the worker for most of backward (picking the newest regardless, 3% of the host step ran
# during backward on two H100 machines, runs C and D in
# benchmarks/log/2026-11-23-optimizer-on-host.md; this rule is not measured yet).
#
# Note: [Compiling while the host steps]
# `torch.compiler.is_compiling()` reads a process-wide flag, set while dynamo traces on any
# thread, and torch.optim classes branch on it (AdamW's `_get_value` keeps the step count a
# tensor): a bucket stepped on the worker while the caller's thread traces may round
# differently (1 ulp measured: a recompile at the next forward while stepping ahead). So
# nothing here makes dynamo trace while the worker may step; a user's recompile during a
# step ahead (a new input shape) still can: not solved yet.
#
# Note: [Parameters that share a storage]
# Parameters that are views of one storage (`nn.Parameter(base[0])`, `nn.Parameter(base[1])`)
# share its version counter: the optimizer's write of one (an upload, the device part's
# rounding) moves the version of the others, which then look changed outside the optimizer
# (`_check`), and a bf16 one's fp32 master would be read again from its rounded value,
# losing the low bits the plain class keeps in its fp32 master. And uploading one during
# backward, while autograd still holds another saved for its backward, fails autograd's
# version check. So the parameters of one storage are kept together: in one part of an
# ``offload_fraction`` split (Note: [Which parameters stay on the device]) and in one bucket,
# whose upload starts once all their gradients are final (so backward no longer reads any of
# them: Note: [Uploading while backward runs]). After the optimizer writes a bucket (or the
# device part its parameters), every parameter of a storage it wrote is recorded as in sync:
# each was in sync before (checked when the bucket was dispatched, or by the device part's
# `check`), and, as for every parameter, nothing but the optimizer writes it between its
# final backward and `step()`. Views that ``module.to(dtype)`` gave storages of their own
# still share one version counter (``to`` sets ``param.data``): one family too
# (`storage_families` finds them by bumping each counter, which changes no value).
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
#
# Note: [Stepping ahead]
# With ``step_ahead``, `step()` queues every bucket with a snapshot of the hyperparameters and
# returns. The parameters of buckets not yet uploaded are "waiting"; while any is, a
# `TorchFunctionMode` entered by ``model``'s forward pre-hook (and left by its forward hook,
# also on an exception) looks at the tensors each torch function receives: a waiting parameter
# first waits, on the host, until the worker has queued its bucket's upload, then the compute
# stream waits on that upload's event. Every read of a parameter through a torch function
# inside the forward is covered, wherever the module that owns it is.
#
# Note: [Reading the model while stepping ahead]
# A read outside the forward must see the new values too (a checkpoint taken right after
# `step()` that silently lacks the last step is lost work). So:
# - ``model``'s `state_dict()` and `load_state_dict()` (every submodule's, through their
#   pre-hooks) first finish the step: `save_pretrained` and `torch.save(model.state_dict())`
#   save the new values, and a load is not overwritten by an upload still to come.
# - From `step()` until the step is finished, the same `_WaitMode` sits on the calling
#   thread's torch-function mode stack, so any torch function on a parameter still being
#   stepped (``p.norm()`` for logging, ``p.detach().clone()``, ``p.data``) waits for its
#   bucket. Metadata (``p.grad``, ``p.shape``, ``p.size()``, factories ``*_like``) does not
#   wait, so `zero_grad()`, an LR scheduler and the next forward's start still overlap the
#   host step. The mode is popped by the first call on that thread that finds it on top of
#   the stack (finishing the step, the next forward's pre-hook, the next `step()`); one
#   found below a mode pushed later stays, passing every call through, until then. It is
#   pushed only above an empty stack or default-device modes: above a mode that the user's
#   own `with` block will pop, `step()` finishes the step instead (exact, without the
#   overlap), since that pop would take ours. Once ``model``'s forward has run under
#   torch.compile, `step()` finishes the step too (the compiled forward would finish it
#   first thing anyway): a mode on the stack when a compiled forward is entered fails
#   dynamo's guards, and a trace then runs while the host steps (Note: [Compiling while
#   the host steps]).
# Any call of the optimizer (the next backward's hooks included) also finishes the step.


@dataclass(frozen=True)
class OptimizerOffloadConfig:
    """How an `OffloadedOptimizer` runs.

    - ``bucket_bytes``: parameter bytes per bucket, the unit whose gradients leave the device
      together and whose step is one call of the optimizer class (smaller: more overlap, more
      host overhead per step). ``None``: `default_bucket_bytes` of the parameters' bytes
      (about 50 buckets, 32 to 256 MiB each).
    - ``max_grad_norm``: clip the gradients to this global norm before the step (like
      ``torch.nn.utils.clip_grad_norm_``, computed on the host in fp32, summed in the order of
      ``model.parameters()`` when the optimizer is given ``model``, else in the order the
      parameters were given: Note: [The order of the clipping norm]). The step then starts
      only once every gradient has arrived; the copies still overlap backward. ``None``: no
      clipping. Clip here, not with ``clip_grad_norm_`` on the model: its gradients have left
      the device by then (reading them raises).
    - ``norm_type``: the norm's p (``float('inf')`` for the max norm).
    - ``overlap``: step each bucket on the host as soon as its gradients arrive, while backward
      goes on. ``False``: step everything when `step()` is called (the gradients still leave
      the device during backward).
    - ``pin_memory``: page-lock the host buffers (the copies are asynchronous only then).
    - ``use_streams``: copy on side streams; ``False`` queues the copies on the compute stream.
    - ``host_threads``: intra-op threads of the host step (set on the worker thread; see
      Note: [Host threads]). ``None``: the process's setting.
    - ``convert_on``: where a parameter that is not fp32 is converted to and from the fp32 the
      optimizer steps (Note: [Where the conversions run]). ``"device"``: its gradient crosses
      the link in fp32 and its new value comes back in fp32, each converted on the device by
      the copy; the host does no conversion and holds no staging buffer. ``"host"``: the
      parameter's own dtype crosses the link (half the bytes for bf16) and the host converts
      (12 bytes of host memory traffic per bf16 element). Choose ``"host"`` when the link,
      not the host, binds.
    - ``offload_fraction``: the share of the trainable parameter bytes whose optimizer step,
      state and fp32 masters go to the host (those whose gradients backward finishes first);
      the rest stay on the device and are stepped there at `step()` (Note: [Which parameters
      stay on the device]). ``1.0``: all of them. Below 1, not supported yet: DTensor
      parameters, parameters streamed by `stream_parameters`, ``max_grad_norm``. The default
      ``bucket_bytes`` is then computed from the host part alone.
    - ``step_ahead``: `step()` returns once every bucket is queued, and the host step goes on
      while the next forward runs: inside ``model``'s forward (given to `OffloadedOptimizer`),
      the first op that reads a parameter still being stepped waits for it (Note: [Stepping
      ahead]). Parameters must not be read outside that forward before the next `step()`,
      `synchronize()` or any other call of the optimizer, which all finish the step.
    """

    bucket_bytes: int | None = None
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    overlap: bool = True
    pin_memory: bool = True
    use_streams: bool = True
    host_threads: int | None = None
    step_ahead: bool = False
    convert_on: str = "device"
    offload_fraction: float = 1.0

    def __post_init__(self) -> None:
        check_number("offload_fraction", self.offload_fraction, maximum=1.0)
        if self.convert_on not in ("device", "host"):
            raise ValueError(f"convert_on must be 'device' or 'host', got {self.convert_on!r}")
        if self.host_threads is not None:
            check_int("host_threads", self.host_threads, minimum=1)
        if self.bucket_bytes is not None:
            check_int("bucket_bytes", self.bucket_bytes, minimum=1)
        if self.max_grad_norm is not None:
            check_number("max_grad_norm", self.max_grad_norm)
        if self.norm_type != float("inf"):
            check_number("norm_type", self.norm_type, positive=True)
        for name in ("overlap", "pin_memory", "use_streams", "step_ahead"):
            check_bool(name, getattr(self, name))


@dataclass(frozen=True)
class OptimizerStats:
    """What an `OffloadedOptimizer` did. Times are of the last `step()`; bytes are totals.

    ``host_step_ms``: worker time converting gradients (with ``convert_on="host"``), clipping
    and stepping (the host work). ``host_step_ms_after_call``: the part of it that ran after
    `step()` was called, i.e. was not hidden behind backward. ``step_wait_ms``: how long
    `step()` blocked its caller. ``overlap``: the fraction of ``host_step_ms`` hidden behind
    backward. ``device_params``/``device_state_bytes``:
    trainable parameters stepped on the device (``offload_fraction`` < 1) and the device bytes
    of their fp32 masters and optimizer state."""

    steps: int
    buckets: int
    pinned_bytes: int
    state_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    host_step_ms: float
    host_step_ms_after_call: float
    step_wait_ms: float
    overlap: float
    grad_norm: float | None
    device_params: int = 0
    device_state_bytes: int = 0


class _Record:
    """One parameter: its place, its host views, its state in the current step."""

    __slots__ = ("entry", "param", "trainable", "master", "grad", "staging", "synced",
                 "has_grad", "final", "dtensor", "hosted", "family")  # fmt: skip

    def __init__(self, entry: Entry, param: torch.Tensor, master, grad, staging):
        self.entry = entry
        self.param = param
        self.dtensor = is_dtensor(param)  # FSDP2 / TP: the host holds the local shard
        self.trainable = param.requires_grad
        self.master = master  # fp32 host values the optimizer steps
        self.grad = grad  # fp32 host gradient
        # host buffer of the parameter's dtype (conversions on the host), or None: the copies
        # convert (Note: [Where the conversions run])
        self.staging = staging
        self.synced: tuple[int, int] = (-1, -1)  # (version, data_ptr) the master matches
        self.has_grad = False
        self.final = False
        # Streamed by stream_parameters: its values are in the host store (Note: [Hosted
        # parameters]); the optimizer reads and writes them there.
        self.hosted: Hosted | None = HOSTED.get(param)
        # The parameters of one storage share a key (Note: [Parameters that share a storage])
        self.family = entry.index


class _Bucket:
    __slots__ = ("index", "records", "optimizer", "groups", "trainable", "remaining",
                 "dispatched", "arrived", "stepped", "failed", "final_event", "norms", "used",
                 "done", "upload_event")  # fmt: skip

    def __init__(self, index: int, records: list[_Record], optimizer, groups: list[int]):
        self.index = index
        self.records = records  # in parameter order
        self.optimizer = optimizer  # the optimizer class over these records' masters
        self.groups = groups  # the user group of each of the optimizer's groups
        self.trainable = sum(r.trainable for r in records)
        self.done = threading.Event()  # its upload is queued (or it will not be stepped)
        self.reset()

    def reset(self) -> None:
        self.remaining = self.trainable
        self.dispatched = False  # gradients sent to the host this step
        self.arrived = False  # the worker has them in fp32
        self.stepped = False
        self.failed: BaseException | None = None
        self.final_event: Any = None
        self.norms: list[torch.Tensor] = []
        self.used: list[dict[str, Any]] | None = None  # hyperparameters, if stepped early
        self.upload_event: Any = None
        self.done.clear()


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
        self.user_groups = groups  # the public optimizer's param_groups (live dicts)
        # Each parameter's index in the optimizer's order, for messages (the host part of an
        # offload_fraction split is a subset)
        self.numbering = list(range(len(params))) if numbering is None else numbering
        # Each parameter's place in the sum of the clipping norm (Note: [The order of the
        # clipping norm])
        self.clip_order = list(range(len(params))) if clip_order is None else clip_order
        shapes = [(shape_of(p), p.dtype) for p in params]
        families = storage_families(params)
        bucket_bytes = config.bucket_bytes
        if bucket_bytes is None:  # of the trainable bytes, as the planner counts them
            trainable = zip(shapes, params, strict=True)
            total = sum(torch.Size(s).numel() * t.itemsize for (s, t), p in trainable
                        if p.requires_grad)  # fmt: skip
            bucket_bytes = default_bucket_bytes(total)
        self.bucket_bytes = bucket_bytes
        self.layout: HostLayout = plan_layout(
            shapes, bucket_bytes, staging=config.convert_on == "host", families=families
        )
        self.engine = copy_engine(device, use_streams=config.use_streams)
        # - Host buffers (allocated once, exact size)
        pin = config.pin_memory and device.type != "cpu" and torch.accelerator.is_available()
        layout = self.layout
        self._master_buf = pinned_buffer(layout.master_bytes, pin=pin)
        self._grad_buf = pinned_buffer(layout.grad_bytes, pin=pin)
        self._staging_buf = pinned_buffer(layout.staging_bytes, pin=pin)
        self.records = [self._record(e, p) for e, p in zip(layout.entries, params, strict=True)]
        for rec, key in zip(self.records, families, strict=True):
            rec.family = key
        self._index = {id(p): i for i, p in enumerate(params)}
        for rec in self.records:
            self._refresh(rec)
        # - Buckets, each with an instance of the optimizer class over its masters
        self.buckets = [
            self._bucket(
                b,
                [self.records[i] for i in sorted(members)],
                group_of,
                optimizer_class,
                optimizer_kwargs,
            )  # fmt: skip
            for b, members in enumerate(layout.buckets)
        ]
        # - Step state (reset by `step` and `discard`)
        self._lock = threading.Lock()
        self._accumulating = 0
        # (D2H event, the device gradients it reads: none with copy streams, see Note:
        # [Gradients leave in stream order])
        self._inflight: list[tuple[Any, list[torch.Tensor]]] = []
        self._last_upload: Any = None
        self._call_time: float | None = None
        self._errors: list[tuple[int, BaseException]] = []
        self._snapshot: list[dict[str, Any]] | None = None  # hyperparameters at step()
        self._ahead: float | None = None  # a step() still running on the host (its time)
        self.waiting: dict[int, _Bucket] = {}  # id(parameter) -> its bucket, while ahead
        if config.step_ahead:  # imports torch._dynamo: only for step_ahead
            self._settle_eagerly = torch.compiler.disable(self._settle_compiled)
        self._compiled = False  # model's forward ran under torch.compile
        # A GradScaler unscales this optimizer's gradients: None until the first step() is
        # done (Note: [Loss scaling])
        self.loss_scaling: bool | None = None
        self._modes = threading.local()
        # The read mode (and its thread) while a step ahead may still be read outside the
        # forward: Note: [Reading the model while stepping ahead]
        self._read_mode: tuple[_WaitMode, int] | None = None
        # torchoffload.testing's hooks (`held_host_step`): ``waiting()`` right before a caller
        # blocks on the host step
        self.testing: Any = None
        # - Counters
        self.steps = 0
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.host_ms = 0.0
        self.host_ms_after_call = 0.0
        self.wait_ms = 0.0
        self.last_host_ms = self.last_host_ms_after_call = 0.0
        self.grad_norm: torch.Tensor | None = None
        # - Worker and hooks
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._finish_seq = 0  # finishes queued
        self._done_seq = 0  # finishes the worker completed
        self._worker = threading.Thread(target=self._work, name="torchoffload-host-step",
                                        daemon=True)  # fmt: skip
        self._worker.start()
        # A DTensor parameter's gradient is set by FSDP2 after its reduce-scatter, not
        # accumulated by autograd: its bucket goes to the host at step().
        self._hooks = [
            r.param.register_post_accumulate_grad_hook(self.on_grad)
            for r in self.records
            if r.trainable and not r.dtensor
        ]
        self.kept_on_device: list[torch.Tensor] = []  # the façade's device part's parameters
        self.kept_numbering: list[int] = []  # and their indices, for messages
        self._fresh_checked = False  # this backward's gradients were checked for placeholders
        for rec in self.records:
            MANAGED[rec.param] = self
            if rec.hosted is not None:
                rec.hosted.users += 1
        self.closed = False

    def _no(self, rec: _Record) -> int:
        """The record's parameter's index in the optimizer's order, for messages."""
        return self.numbering[rec.entry.index]

    # - Construction
    def _record(self, entry: Entry, param: torch.Tensor) -> _Record:
        n, shape = entry.numel, entry.shape
        master = self._master_buf[entry.master : entry.master + 4 * n].view(torch.float32)
        grad = self._grad_buf[entry.grad : entry.grad + 4 * n].view(torch.float32)
        staging = None
        if entry.staging >= 0:
            nbytes = n * entry.dtype.itemsize
            raw = self._staging_buf[entry.staging : entry.staging + nbytes]
            staging = raw.view(entry.dtype).view(shape)
        return _Record(entry, param, master.view(shape), grad.view(shape), staging)

    def _bucket(self, b, records, group_of, optimizer_class, optimizer_kwargs) -> _Bucket:
        by_group: dict[int, list[torch.Tensor]] = {}
        for rec in records:
            by_group.setdefault(group_of[rec.entry.index], []).append(rec.master)
        host_groups = [
            {**_hyper(self.user_groups[g]), "params": masters} for g, masters in by_group.items()
        ]
        optimizer = optimizer_class(host_groups, **optimizer_kwargs)
        return _Bucket(b, records, optimizer, list(by_group))

    # - Hooks (autograd's threads)
    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook. See Note: [When a gradient is final]."""
        if self._accumulating or self.closed:
            return
        if self._ahead is not None:
            self.settle()
        if not self._fresh_checked:  # the first final gradient of this backward
            self.refuse_consumed("the next backward")
            self._fresh_checked = True
        rec = self.records[self._index[id(param)]]
        with self._lock:
            if rec.final:
                raise RuntimeError(
                    f"parameter {self._no(rec)} got a second final gradient before step(): "
                    "run every backward but the last of a gradient accumulation inside "
                    "optimizer.accumulating()"
                )
            rec.final = True
            bucket = self.buckets[rec.entry.bucket]
            bucket.remaining -= 1
            go = bucket.remaining == 0 and not bucket.dispatched
            if go:
                bucket.dispatched = True
        if go:
            self._dispatch_or_unmark(bucket)

    def _dispatch_or_unmark(self, bucket: _Bucket) -> None:
        try:
            self._dispatch(bucket)
        except BaseException:
            with self._lock:
                bucket.dispatched = False
            raise

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        with self._lock:
            self._accumulating += 1
        try:
            yield
        finally:
            with self._lock:
                self._accumulating -= 1

    def _dispatch(self, bucket: _Bucket) -> None:
        """Copy the bucket's gradients to the host and queue it for the worker."""
        pairs, keep = [], []
        for rec in bucket.records:
            self._check(rec)
            p = local(rec.param)
            g = rec.param.grad
            if g is not None and rec.dtensor:
                g = local(g)
            rec.has_grad = g is not None
            if g is None:
                continue
            if isinstance(g, MovedGrad):
                raise RuntimeError(f"parameter {self._no(rec)}: {g.message}")
            if g.layout != torch.strided or (g.dtype, tuple(g.shape)) != (p.dtype, rec.entry.shape):
                raise RuntimeError(
                    f"parameter {self._no(rec)}: gradient {g.dtype} {tuple(g.shape)} "
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
                placeholder._owner = (weakref.ref(self), rec)  # Note: [Loss scaling]
                rec.param.grad = placeholder
        with self._lock:
            self._inflight = [(e, k) for e, k in self._inflight if not _completed(e)]
            if moved:
                self._inflight.append((event, keep))
                self.d2h_bytes += moved
        self._queue.put(("bucket", bucket, event))

    def _check(self, rec: _Record) -> None:
        """Refuse a parameter whose dtype or shape changed; re-read one changed outside."""
        p = local(rec.param)
        if rec.param.requires_grad != rec.trainable:
            raise RuntimeError(
                f"parameter {self._no(rec)}: requires_grad was {rec.trainable} when the "
                f"optimizer was built and is {rec.param.requires_grad} now: build the "
                "OffloadedOptimizer after freezing or unfreezing parameters"
            )
        if rec.hosted is not None:
            if HOSTED.get(rec.param) is not rec.hosted:
                raise RuntimeError(
                    f"parameter {self._no(rec)} is no longer streamed by the "
                    "stream_parameters handle it was streamed by when the optimizer was built"
                )
            if rec.synced[0] != rec.hosted.version:
                self._refresh(rec)
            return
        if p.device != self.device:
            raise RuntimeError(
                f"parameter {self._no(rec)} is now on {p.device}, was on {self.device} when "
                "the optimizer was built"
            )
        if p.dtype != rec.entry.dtype or tuple(p.shape) != rec.entry.shape:
            raise RuntimeError(
                f"parameter {self._no(rec)} is now {p.dtype} {tuple(p.shape)}, was "
                f"{rec.entry.dtype} {rec.entry.shape} when the optimizer was built: build "
                "the OffloadedOptimizer after converting the model"
            )
        if (p._version, p.data_ptr()) != rec.synced:
            # Changed outside the optimizer (load_state_dict, an in-place init): its master
            # follows. A blocking copy, only after such a change.
            self._refresh(rec)

    def follow_parameters(self) -> None:
        """Read again the master of every parameter changed in place since the optimizer last
        read or wrote it, as the next step would (`_check`), so that a `state_dict()` holds
        masters that round to the parameters as the user left them. A parameter whose dtype,
        shape or device changed is left to the next step, which refuses it."""
        for rec in self.records:
            if rec.hosted is not None:
                if HOSTED.get(rec.param) is rec.hosted and rec.synced[0] != rec.hosted.version:
                    self._refresh(rec)
                continue
            p = local(rec.param)
            built = (self.device, rec.entry.dtype, rec.entry.shape)
            if (p.device, p.dtype, tuple(p.shape)) == built and (
                (p._version, p.data_ptr()) != rec.synced
            ):
                self._refresh(rec)

    def _refresh(self, rec: _Record) -> None:
        if rec.hosted is not None:
            rec.master.copy_(rec.hosted.host)
            rec.synced = (rec.hosted.version, -2)
            return
        with torch.no_grad():
            p = local(rec.param)
            rec.master.copy_(p.detach())
        rec.synced = (p._version, p.data_ptr())

    # - Worker
    def _work(self) -> None:
        if self.config.host_threads is not None:
            torch.set_num_threads(self.config.host_threads)
        ready: dict[int, tuple[_Bucket, Any]] = {}
        finish = None
        jobs: list[_Unscale] = []  # after the buckets queued before them, before a finish
        while True:
            items = [] if ready or finish or jobs else [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item[0] == "stop":
                    return
                if item[0] == "bucket":
                    ready[item[1].index] = (item[1], item[2])
                elif item[0] == "unscale":
                    jobs.append(item[1])
                else:
                    finish = item
            try:
                if ready:  # Note: [The order of the host step]
                    copied = [i for i, (_, e) in ready.items() if _completed(e)]
                    self._arrive(*ready.pop(max(copied) if copied else min(ready)))
                    continue
                if jobs:
                    jobs.pop(0).run(self)
                    continue
                if finish is not None:
                    self._finish(finish[1], finish[2])
            except BaseException as exc:  # reported by step()
                self._errors.append((-1, exc))
            if finish is not None:
                seq = finish[3]
                finish = None
                for bucket in self.buckets:
                    bucket.done.set()
                with self._done:
                    self._done_seq = seq
                    self._done.notify_all()

    def _arrive(self, bucket: _Bucket, event: Any) -> None:
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
                    norm_type = self.config.norm_type
                    bucket.norms = list(torch._foreach_norm(grads, norm_type)) if grads else []
            bucket.arrived = True
        except BaseException as exc:
            bucket.failed = exc
            self._errors.append((bucket.index, exc))
        self._account(start)
        if self.steps_early() and not bucket.failed:
            self._step(bucket)

    def steps_early(self) -> bool:
        """Whether a bucket is stepped as soon as it arrives (Note: [Loss scaling])."""
        c = self.config
        return c.overlap and c.max_grad_norm is None and self.loss_scaling is False

    def _finish(self, step_rest: bool, snapshot: list[dict[str, Any]]) -> None:
        """Step what has arrived and is not stepped yet (clipping first), in forward order,
        with the hyperparameters of the `step()` call; or, when not ``step_rest`` (zero_grad),
        nothing more."""
        start = time.perf_counter()
        todo = [b for b in reversed(self.buckets) if b.arrived and not b.stepped and not b.failed]
        if step_rest and self.config.max_grad_norm is not None:
            self._clip()
        self._account(start)
        if step_rest:
            for bucket in todo:
                self._step(bucket)

    def _clip(self) -> None:
        """Scale every host gradient like ``clip_grad_norm_`` over them: the per-tensor norms
        (computed as buckets arrived) are stacked in ``clip_order`` (Note: [The order of the
        clipping norm])."""
        norms: dict[int, torch.Tensor] = {}
        for bucket in self.buckets:
            with_grad = [r for r in bucket.records if r.has_grad]
            norms.update({r.entry.index: n for r, n in zip(with_grad, bucket.norms, strict=True)})
        if not norms:
            self.grad_norm = torch.tensor(0.0)
            return
        ordered = [norms[i] for i in sorted(norms, key=self.clip_order.__getitem__)]
        total = torch.linalg.vector_norm(torch.stack(ordered), self.config.norm_type)
        self.grad_norm = total
        masters = []
        for rec in self.records:
            if rec.has_grad:
                rec.master.grad = rec.grad
                masters.append(rec.master)
        torch.nn.utils.clip_grads_with_norm_(masters, self.config.max_grad_norm, total)

    def _step(self, bucket: _Bucket) -> None:
        """One call of the optimizer class over the bucket, then the upload of its new values.
        See Note: [Uploading while backward runs]."""
        start = time.perf_counter()
        try:
            optimizer = bucket.optimizer
            with self._lock:  # `_begin` takes its snapshot under it: both, or the snapshot
                snapshot = self._snapshot  # (a scheduler may change the values after step())
                if snapshot is None:  # stepped during backward: checked against step()'s
                    bucket.used = [_hyper(self.user_groups[g]) for g in bucket.groups]
            for k, (host_group, g) in enumerate(
                zip(optimizer.param_groups, bucket.groups, strict=True)
            ):
                host_group.update(snapshot[g] if snapshot is not None else bucket.used[k])
            for rec in bucket.records:
                rec.master.grad = rec.grad if rec.has_grad else None
            optimizer.step()
            pairs = []
            with torch.no_grad():
                for rec in bucket.records:
                    rec.master.grad = None
                    if rec.has_grad and rec.hosted is not None:  # Note: [Hosted parameters]
                        rec.hosted.before_write()
                        rec.hosted.host.copy_(rec.master)
                        rec.synced = (rec.hosted.version, -2)
                    elif rec.has_grad:
                        if rec.staging is not None:
                            rec.staging.copy_(rec.master)
                        pairs.append((local(rec.param).detach(), rec.master
                                      if rec.staging is None else rec.staging))  # fmt: skip
            bucket.stepped = True
            if pairs:
                bucket.upload_event = self.engine.load(pairs, after=[bucket.final_event])
                self._last_upload = bucket.upload_event
                self.h2d_bytes += sum(src.numel() * src.element_size() for _, src in pairs)
                # Every parameter of a storage written here, the unwritten ones included
                # (Note: [Parameters that share a storage])
                written = {r.family for r in bucket.records if r.has_grad and r.hosted is None}
                for rec in bucket.records:
                    if rec.family in written:
                        p = local(rec.param)
                        rec.synced = (p._version, p.data_ptr())
        except BaseException as exc:
            bucket.failed = exc
            self._errors.append((bucket.index, exc))
            for rec in bucket.records:  # not uploaded: the master follows the device again
                rec.synced = (-1, -1)
        bucket.done.set()
        self._account(start)

    def _account(self, start: float) -> None:
        end = time.perf_counter()
        self.host_ms += (end - start) * 1e3
        called = self._call_time
        if called is not None and end > called:
            self.host_ms_after_call += (end - max(start, called)) * 1e3

    # - Step and discard (the caller's thread)
    def step(self, between: Any = None) -> None:
        """``between``: called once every bucket is on its way to the host, before waiting
        for the worker (the device part of an ``offload_fraction`` split steps there)."""
        self.settle()
        self.refuse_consumed("step()")
        called = self._begin(step_rest=True)
        if between is not None:
            between()
        if not self.config.step_ahead:
            self._end(step_rest=True, called=called)
            return
        # Note: [Stepping ahead]
        self.waiting = {id(r.param): self.buckets[r.entry.bucket] for r in self.records
                        if r.has_grad}  # fmt: skip
        self._ahead = called
        self._reset_records(consumed=True)
        if self.waiting and (self._compiled or not self._push_read_mode()):
            self.settle()  # Note: [Reading the model while stepping ahead]

    def unscale(self, records: list[_Record], inv_scale: torch.Tensor) -> bool:
        """GradScaler's unscale of moved gradients (Note: [Loss scaling]): on the host, once
        they have arrived, before any of them is stepped; whether one was not finite."""
        # From now on no bucket is stepped as it arrives; the job, run by the worker after
        # the buckets queued before it, sees whether one was (no step is running then).
        self.loss_scaling = True
        job = _Unscale(records, inv_scale.detach().to("cpu", torch.float32))
        self._queue.put(("unscale", job))
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.found

    def check_idle(self, what: str) -> None:
        """Refuse ``what`` while this step's buckets are on their way (after the final
        backward, before step() or zero_grad())."""
        self.settle()
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
            self._refresh(rec)

    def settle(self) -> None:
        """Finish a step that is still running on the host (step_ahead)."""
        called = self._ahead
        if called is not None:
            self._ahead = None
            self.waiting = {}
            self._end(step_rest=True, called=called)
        self._drop_read_mode()

    def _settle_compiled(self) -> None:
        self._compiled = True
        self.settle()

    def before_state_dict(self, *args: Any) -> None:
        """A module's state_dict/load_state_dict pre-hook (Note: [Reading the model while
        stepping ahead])."""
        self.settle()

    def _push_read_mode(self) -> bool:
        """Cover reads outside the forward until the step is finished; False where the mode
        cannot be pushed safely (Note: [Reading the model while stepping ahead])."""
        stack = [_get_function_stack_at(i) for i in range(_len_torch_function_stack())]
        held = self._read_mode
        if held is not None:  # still on its thread's stack: it serves this step too
            if held[1] != threading.get_ident():
                return False
            if any(m is held[0] for m in stack):
                return True
            self._read_mode = None  # popped by someone else's exit
        if any(type(m).__name__ != "DeviceContext" for m in stack):
            return False
        mode = _WaitMode(self)
        _push_mode(mode)
        self._read_mode = (mode, threading.get_ident())
        return True

    def _drop_read_mode(self) -> None:
        """Pop the read mode if this is its thread and it is on top of the stack."""
        held = self._read_mode
        if held is None or held[1] != threading.get_ident():
            return
        n = _len_torch_function_stack()
        if n and _get_function_stack_at(n - 1) is held[0]:
            _pop_mode()
            self._read_mode = None

    def wait_for(self, bucket: _Bucket) -> None:
        """A forward is about to read a parameter of ``bucket``. See Note: [Stepping ahead]."""
        if self.testing is not None:
            self.testing.waiting()
        bucket.done.wait()
        self.engine.wait(bucket.upload_event)
        for rec in bucket.records:
            self.waiting.pop(id(rec.param), None)
        with self._lock:  # drop the device gradients whose copies are done
            self._inflight = [(e, k) for e, k in self._inflight if not _completed(e)]

    def discard(self) -> None:
        """zero_grad(): finish what is in flight (buckets already stepped are uploaded), step
        nothing more, drop the gradients. After a `step()` still running ahead: nothing."""
        if self._ahead is not None:
            return
        stepped = self._end(step_rest=False, called=self._begin(step_rest=False))
        if stepped:
            logger.warning(
                "zero_grad() without step(): %d of %d buckets had already been stepped on the "
                "host during backward (their gradients were final); those parameters hold their "
                "new values, the others their old ones", stepped, len(self.buckets),
            )  # fmt: skip

    def _begin(self, *, step_rest: bool) -> float:
        called = time.perf_counter()
        self._call_time = called
        # Every bucket stepped from now on uses the values of this call (a scheduler may
        # change them while the host still steps ahead). Under the lock: a bucket the worker
        # steps meanwhile reads either this snapshot or the values before it, never values
        # changed after step() returned (seen as a flaky "param_groups changed" error).
        with self._lock:
            snapshot = [_hyper(g) for g in self.user_groups]
            self._snapshot = snapshot
        if step_rest:
            for bucket in reversed(self.buckets):  # forward order: Note: [The order of ...]
                with self._lock:
                    go = not bucket.dispatched
                    bucket.dispatched = True
                if go:
                    self._dispatch_or_unmark(bucket)
        self._finish_seq += 1
        self._queue.put(("finish", step_rest, snapshot, self._finish_seq))
        return called

    def _wait_done(self) -> BaseException | None:
        """Wait for the worker to complete the last finish queued. An interrupt (Ctrl-C) does
        not cut the handshake: the wait goes on, and the interrupt is returned to re-raise."""
        seq, interrupted = self._finish_seq, None
        if self.testing is not None:
            self.testing.waiting()
        while True:
            try:
                with self._done:
                    self._done.wait_for(lambda: self._done_seq >= seq)
                return interrupted
            except BaseException as exc:
                interrupted = interrupted or exc

    def _end(self, *, step_rest: bool, called: float) -> int:
        interrupted = self._wait_done()
        if step_rest:
            self.wait_ms = (time.perf_counter() - called) * 1e3
        self._inflight.clear()  # every gradient copy was waited on by the worker
        self.engine.wait(self._last_upload)
        stepped = sum(b.stepped for b in self.buckets)
        errors, self._errors = self._errors, []
        changed = self._changed_hyper(self._snapshot) if step_rest else None
        self._reset_records(consumed=step_rest)
        self._reset_buckets(keep_times=step_rest)
        if step_rest and not errors:
            self.steps += 1
            if self.loss_scaling is None:
                self.loss_scaling = False
        if interrupted is not None:
            raise interrupted
        if errors:
            index, exc = errors[0]
            where = f"bucket {index}" if index >= 0 else "the worker"
            raise RuntimeError(
                f"the host step failed in {where} ({stepped} of {len(self.buckets)} buckets "
                "were stepped and uploaded; every parameter holds either its old or its new "
                "value, and the failed bucket's masters are read again from the device; its "
                f"optimizer state is what the optimizer class left when it raised): {exc!r}"
            ) from exc
        if changed:
            raise RuntimeError(
                f"param_groups changed between the final backward and step() ({changed}) "
                "after some buckets had been stepped on the host during backward with the old "
                "values: change hyperparameters before backward (an LR scheduler's step() "
                "after optimizer.step() is fine), or pass overlap=False"
            )
        return stepped

    def _changed_hyper(self, snapshot: list[dict[str, Any]]) -> str | None:
        for bucket in self.buckets:
            if bucket.used is None:
                continue
            for used, g in zip(bucket.used, bucket.groups, strict=True):
                now = snapshot[g]
                for key in now.keys() | used.keys():
                    if not _same(used.get(key), now.get(key)):
                        return f"group {g} {key}: {used.get(key)!r} -> {now.get(key)!r}"
        return None

    def _reset_records(self, *, consumed: bool) -> None:
        """After `step()` (``consumed``) a moved gradient becomes a `ConsumedGrad` (Note: [The
        gradient after step()]); after a discard, ``None``."""
        self._fresh_checked = False
        for rec in self.records:
            rec.final = False
            if type(rec.param.grad) is MovedGrad:
                rec.param.grad = ConsumedGrad(rec.param) if consumed else None

    def refuse_consumed(self, what: str) -> None:
        """Refuse ``what`` while a parameter holds a `ConsumedGrad`, before anything changes
        (Note: [The gradient after step()])."""
        every = [(self._no(r), r.param) for r in self.records]
        every += list(zip(self.kept_numbering, self.kept_on_device, strict=True))
        for i, p in every:
            if type(p.grad) is ConsumedGrad:
                does = "accumulate into" if "backward" in what else "step again with"
                raise RuntimeError(
                    f"{what} after step() without zero_grad(): torch.optim would {does} "
                    f"the last step's gradient of parameter {i}, which left the device: call "
                    "optimizer.zero_grad() (either form) or model.zero_grad() "
                    "(set_to_none=True) after step(). See Note: [The gradient after step()]"
                )

    def _reset_buckets(self, keep_times: bool) -> None:
        if keep_times:
            self.last_host_ms = self.host_ms
            self.last_host_ms_after_call = self.host_ms_after_call
        self.host_ms = self.host_ms_after_call = 0.0
        for bucket in self.buckets:
            bucket.reset()
        self._call_time = None
        self._snapshot = None

    # - Forward while stepping ahead
    def enter_forward(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Compiled ops do not pass through a TorchFunctionMode: finish the step first,
            # at every call (a disabled function runs eagerly, behind a graph break).
            self._settle_eagerly()
            return
        self._drop_read_mode()  # the forward's own mode takes over
        stack = self._mode_stack()
        if self._ahead is not None and self.waiting:
            mode = _WaitMode(self)
            mode.__enter__()
            stack.append(mode)
        else:
            stack.append(None)

    def exit_forward(self, module: Any, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        stack = self._mode_stack()
        if stack:
            mode = stack.pop()
            if mode is not None:
                mode.__exit__(None, None, None)

    def _mode_stack(self) -> list[Any]:
        stack = getattr(self._modes, "stack", None)
        if stack is None:
            stack = self._modes.stack = []
        return stack

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
        for event, _ in self._inflight:  # copies that read device gradients, pinned buffers
            if event is not None:
                event.synchronize()
        self._inflight = []
        if self._last_upload is not None:
            self._last_upload.synchronize()
        self.closed = True
        for h in self._hooks:
            h.remove()
        self._queue.put(("stop",))
        self._worker.join()
        for p in self.kept_on_device:
            if MANAGED.get(p) is self:
                del MANAGED[p]
        for rec in self.records:
            if MANAGED.get(rec.param) is self:
                del MANAGED[rec.param]
            if rec.hosted is not None:
                rec.hosted.users -= 1
            if type(rec.param.grad) is MovedGrad:
                rec.param.grad = None
        if error is not None:
            raise error


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters, tensors copied (a scheduler updates a tensor lr in place)."""
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else v
        for k, v in group.items()
        if k != "params"
    }


def _completed(event: Any) -> bool:
    return event is None or event.query()


def storage_families(params: list[torch.Tensor]) -> list[int]:
    """For each parameter, the index of the first of ``params`` that is a view of the same
    storage (its own index when none is; a streamed parameter's values are its host store's):
    Note: [Parameters that share a storage]."""
    first: dict[tuple[torch.device, int], int] = {}
    out = []
    for i, p in enumerate(params):
        if p in HOSTED:
            out.append(i)
            continue
        t = local(p)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        out.append(first.setdefault(key, i) if storage.nbytes() else i)
    # Views that ``module.to(dtype)`` gave storages of their own (it sets ``param.data``) still
    # share the version counter: found by bumping each counter (no value changes)
    probe = [i for i, p in enumerate(params) if p not in HOSTED]
    before = [local(params[i])._version for i in probe]
    for i in probe:
        torch.autograd.graph.increment_version(local(params[i]))
    shared = [i for i, b in zip(probe, before, strict=True) if local(params[i])._version > b + 1]
    for i in shared:
        seen = [local(params[j])._version for j in shared]
        torch.autograd.graph.increment_version(local(params[i]))
        together = [j for j, v in zip(shared, seen, strict=True) if local(params[j])._version != v]
        key = min(out[j] for j in together)
        old = {out[j] for j in together}
        out = [key if k in old else k for k in out]
    return out


def shape_of(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape (a DTensor's local shard; a streamed one's host store view)."""
    hosted = HOSTED.get(p)
    return tuple(hosted.host.shape if hosted is not None else local(p).shape)


def value_of(p: torch.Tensor) -> torch.Tensor:
    """The parameter's current values (a streamed one's in the host store)."""
    hosted = HOSTED.get(p)
    return hosted.host if hosted is not None else local(p).detach()


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank's host holds), else the tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:
        return a is b


class _WaitMode(TorchFunctionMode):
    """Makes a torch function that reads a parameter still being stepped wait for it. See
    Note: [Stepping ahead]."""

    def __init__(self, runtime: HostStepRuntime):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        waiting = self.runtime.waiting
        if waiting and _reads_values(func):
            for t in _tensors(args, kwargs):
                bucket = waiting.get(id(t))
                if bucket is not None:
                    self.runtime.wait_for(bucket)
        return func(*args, **(kwargs or {}))


# Tensor attributes and functions that read or set no values of the tensor (a parameter
# still being stepped need not wait for them): Note: [Reading the model while stepping ahead].
# Not data_ptr(): a custom kernel (Triton, an extension) reads the values through it.
_METADATA_ATTRS = frozenset({
    "grad", "_grad", "grad_fn", "_grad_fn", "requires_grad", "is_leaf", "retains_grad",
    "_version", "shape", "dtype", "device", "layout", "ndim", "names", "name", "itemsize",
    "nbytes", "output_nr", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
    "is_nested", "is_mkldnn", "_backward_hooks", "_post_accumulate_grad_hooks",
})  # fmt: skip
_METADATA_FUNCS = frozenset({
    "size", "stride", "dim", "ndimension", "numel", "nelement", "element_size",
    "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "get_device",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "__hash__", "__len__", "empty_like", "zeros_like", "ones_like", "full_like",
})  # fmt: skip


def _reads_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a tensor attribute: func is its descriptor's
        return getattr(getattr(func, "__self__", None), "__name__", "") not in _METADATA_ATTRS
    return name not in _METADATA_FUNCS
