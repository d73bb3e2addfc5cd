"""The host part's state: pinned buffers laid out by `_layout.plan_layout`, a `Record` per
parameter (its master, gradient and staging views) and a `Bucket` per bucket (an instance of
the optimizer class over its masters), each master following its parameter."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import torch

from torchoffload._hosted import HOSTED, MANAGED, Hosted
from torchoffload._pool import pinned_buffer
from torchoffload.optim._config import OptimizerOffloadConfig
from torchoffload.optim._grads import MovedGrad
from torchoffload.optim._layout import Entry, HostLayout, default_bucket_bytes, plan_layout
from torchoffload.optim._params import (
    follow_written,
    hyper,
    is_dtensor,
    local,
    shape_of,
    shared_families,
    storage_families,
)
from torchoffload.optim._undo import Undo

# Note: [Host buffers are reused across steps without a sync]
# A bucket's host buffers receive its gradient (D2H, into the fp32 gradient or, with host
# conversions, the staging buffer), then its new value (the master, or the staging buffer the
# worker converts it into), which the upload reads. The next step's gradient copy is queued
# after `step()` made the compute stream wait on the upload, and the copy stream waits on the
# compute stream, so it cannot overtake the upload. The worker touches a bucket's host buffers
# only after it has waited on that bucket's gradient copy event.


class Record:
    """One parameter: its place, its host views, its state in the current step."""

    __slots__ = ("entry", "param", "trainable", "master", "grad", "staging", "synced",
                 "has_grad", "final", "dtensor", "hosted", "family", "fresh")  # fmt: skip

    def __init__(self, entry: Entry, param: torch.Tensor, master, grad, staging):
        self.entry = entry
        self.param = param
        self.dtensor = is_dtensor(param)  # FSDP2 / TP: the host holds the local shard
        self.trainable = param.requires_grad
        self.master = master  # host values the optimizer steps (fp32, or the bf16 parameter's)
        self.grad = grad  # host gradient, of the master's dtype
        # host buffer of the parameter's dtype (conversions on the host), or None: the copies
        # convert (Note: [Where the conversions run])
        self.staging = staging
        self.synced: tuple[int, int] = (-1, -1)  # (version, data_ptr) the master matches
        # the master was read from the parameter and not stepped since: its bits are the
        # parameter's (Note: [A master that is its parameter's bits])
        self.fresh = True
        self.has_grad = False
        self.final = False
        # Streamed by stream_parameters: its values are in the host store (Note: [Hosted
        # parameters]); the optimizer reads and writes them there.
        self.hosted: Hosted | None = HOSTED.get(param)
        # The parameters of one storage share a key (Note: [Parameters that share a storage])
        self.family = entry.index


class Bucket:
    __slots__ = ("index", "records", "optimizer", "groups", "trainable", "remaining",
                 "dispatched", "arrived", "stepped", "failed", "final_event", "norms", "used",
                 "done", "upload_event", "undo", "pending", "d2h_event", "taken", "handled",
                 "gen", "steps", "arrival", "grads_written", "held")  # fmt: skip

    def __init__(self, index: int, records: list[Record], optimizer, groups: list[int]):
        self.index = index
        self.records = records  # in parameter order
        self.optimizer = optimizer  # the optimizer class over these records' masters
        self.groups = groups  # the user group of each of the optimizer's groups
        self.trainable = sum(r.trainable for r in records)
        self.done = threading.Event()  # its upload is queued (or it will not be stepped)
        # The worker is done with its gradients of this dispatch (arrived, maybe stepped)
        self.handled = threading.Event()
        self.undo = Undo()  # Note: [Steps taken during backward]
        # Its dispatches so far: the worker skips a dispatch that a second backward recalled
        # before the worker took it (Note: [A second backward])
        self.gen = 0
        self.steps = 0  # times its optimizer class was called (Note: [Copies aside made ahead])
        self.arrival = 0  # when its gradients last arrived, in the worker's count
        self.reset()

    def reset(self) -> None:
        self.remaining = self.trainable
        self.dispatched = False  # gradients sent to the host this step
        self.arrived = False  # the worker has them in fp32
        self.stepped = False
        self.failed: BaseException | None = None
        self.final_event: Any = None
        # Its gradients' norms (futures: Note: [Gradient norms on a pool])
        for norm in getattr(self, "norms", ()):  # a discarded one is not computed
            if isinstance(norm, concurrent.futures.Future):
                norm.cancel()
        self.norms: list[Any] = []
        self.used: list[dict[str, Any]] | None = None  # hyperparameters, if stepped early
        self.upload_event: Any = None
        # Stepped before step() said what the step is: its upload waits for step() to commit
        # it, and it can be undone (Note: [Steps taken during backward])
        self.pending = False
        self.d2h_event: Any = None  # its gradients' copy to the host
        self.taken = False  # the worker took this dispatch from its queue
        self.grads_written = False  # Note: [A class that writes its gradients]
        # Its gradients are about to come back: not stepped as they arrive (Note: [Written
        # gradients brought back])
        self.held = False
        if self.undo.saved:
            self.undo.drop()
        self.done.clear()
        self.handled.clear()


def host_layout(params: list[torch.Tensor], config: OptimizerOffloadConfig,
                families: list[int]) -> HostLayout:  # fmt: skip
    """The layout of the host buffers for ``params``, in buckets of ``config.bucket_bytes``
    (by default `default_bucket_bytes` of the trainable bytes, as the planner counts them)."""
    shapes = [(shape_of(p), p.dtype) for p in params]
    bucket_bytes = config.bucket_bytes
    if bucket_bytes is None:
        trainable = zip(shapes, params, strict=True)
        total = sum(torch.Size(s).numel() * t.itemsize for (s, t), p in trainable
                    if p.requires_grad)  # fmt: skip
        bucket_bytes = default_bucket_bytes(total)
    return plan_layout(shapes, bucket_bytes, staging=config.convert_on == "host",
                       families=families, master_dtype=config.master_dtype)  # fmt: skip


class HostMasters:
    """The pinned host buffers of ``params``, their records and buckets. ``numbering``: each
    parameter's index in the optimizer's order, for messages (the host part of an
    ``offload_fraction`` split is a subset); ``user_groups``: the public optimizer's
    param_groups, ``group_of`` each parameter's."""

    def __init__(
        self,
        params: list[torch.Tensor],
        group_of: list[int],
        user_groups: list[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        config: OptimizerOffloadConfig,
        device: torch.device,
        numbering: list[int],
    ):
        self.device = device
        self.numbering = numbering
        # A change of requires_grad since the build is refused (a device part: Note:
        # [requires_grad changed after the build])
        self.requires_grad_fixed = False
        families = storage_families(params)
        self.shared = shared_families(families)  # families of several parameters
        self.layout = layout = host_layout(params, config, families)
        # - Host buffers (allocated once, exact size)
        pin = config.pin_memory and device.type != "cpu" and torch.accelerator.is_available()
        self._master_buf = pinned_buffer(layout.master_bytes, pin=pin)
        self._grad_buf = pinned_buffer(layout.grad_bytes, pin=pin)
        self._staging_buf = pinned_buffer(layout.staging_bytes, pin=pin)
        self.records = [self._record(e, p) for e, p in zip(layout.entries, params, strict=True)]
        for rec, key in zip(self.records, families, strict=True):
            rec.family = key
        self.index = {id(p): i for i, p in enumerate(params)}
        for rec in self.records:
            self.refresh(rec)
        # - Buckets, each with an instance of the optimizer class over its masters
        self.buckets = [
            self._bucket(
                b,
                [self.records[i] for i in sorted(members)],
                group_of,
                user_groups,
                optimizer_class,
                optimizer_kwargs,
            )  # fmt: skip
            for b, members in enumerate(layout.buckets)
        ]

    def no(self, rec: Record) -> int:
        """The record's parameter's index in the optimizer's order, for messages."""
        return self.numbering[rec.entry.index]

    def _record(self, entry: Entry, param: torch.Tensor) -> Record:
        n, shape, own = entry.numel, entry.shape, entry.master_dtype
        master = self._master_buf[entry.master : entry.master + own.itemsize * n].view(own)
        grad = self._grad_buf[entry.grad : entry.grad + own.itemsize * n].view(own)
        staging = None
        if entry.staging >= 0:
            nbytes = n * entry.dtype.itemsize
            raw = self._staging_buf[entry.staging : entry.staging + nbytes]
            staging = raw.view(entry.dtype).view(shape)
        return Record(entry, param, master.view(shape), grad.view(shape), staging)

    @staticmethod
    def _bucket(b, records, group_of, user_groups, optimizer_class, optimizer_kwargs) -> Bucket:
        by_group: dict[int, list[torch.Tensor]] = {}
        for rec in records:
            by_group.setdefault(group_of[rec.entry.index], []).append(rec.master)
        host_groups = [
            {**hyper(user_groups[g]), "params": masters} for g, masters in by_group.items()
        ]
        optimizer = optimizer_class(host_groups, **optimizer_kwargs)
        return Bucket(b, records, optimizer, list(by_group))

    # - A master follows its parameter
    def refresh(self, rec: Record) -> None:
        """Read the master again from the parameter (a streamed one's host store)."""
        rec.fresh = True
        if rec.hosted is not None:
            rec.master.copy_(rec.hosted.host)
            rec.synced = (rec.hosted.version, -2)
            return
        with torch.no_grad():
            p = local(rec.param)
            rec.master.copy_(p.detach())
        rec.synced = (p._version, p.data_ptr())

    def moved(self, rec: Record) -> None:
        """The parameter's (version, data_ptr) moved since the optimizer last read or wrote it
        (not streamed): read its master again, or, in a family of one version counter, only
        if its bytes changed (Note: [Parameters that share a storage] in _params.py)."""
        p = local(rec.param)
        if rec.family not in self.shared or p.data_ptr() != rec.synced[1]:
            self.refresh(rec)
            return
        with torch.no_grad():
            follow_written(rec.master, p.detach().to(rec.master.device))
        rec.synced = (p._version, p.data_ptr())

    def follow(self) -> None:
        """Read again the master of every parameter changed in place since the optimizer last
        read or wrote it, as the next step would (`check_record`), so that a `state_dict()`
        holds masters that round to the parameters as the user left them. A parameter whose
        dtype, shape or device changed is left to the next step, which refuses it."""
        for rec in self.records:
            if rec.hosted is not None:
                if HOSTED.get(rec.param) is rec.hosted and rec.synced[0] != rec.hosted.version:
                    self.refresh(rec)
                continue
            p = local(rec.param)
            built = (self.device, rec.entry.dtype, rec.entry.shape)
            if (p.device, p.dtype, tuple(p.shape)) == built and (
                (p._version, p.data_ptr()) != rec.synced
            ):
                self.moved(rec)

    def load_master(self, rec: Record, master: torch.Tensor) -> None:
        """Take a saved master (one that rounds to the parameter: `load_state_dict`)."""
        rec.master.copy_(master)
        rec.fresh = False
        if rec.hosted is not None:
            rec.synced = (rec.hosted.version, -2)
        else:
            p = local(rec.param)
            rec.synced = (p._version, p.data_ptr())

    # - Ownership
    def claim(self, owner: Any) -> None:
        """Mark the parameters as stepped by ``owner`` (`MANAGED`), a streamed one's host
        store as used by one more optimizer."""
        for rec in self.records:
            MANAGED[rec.param] = owner
            if rec.hosted is not None:
                rec.hosted.users += 1

    def release(self, owner: Any) -> None:
        """Undo `claim` (teardown): a gradient still moved becomes None."""
        for rec in self.records:
            if MANAGED.get(rec.param) is owner:
                del MANAGED[rec.param]
            if rec.hosted is not None:
                rec.hosted.users -= 1
            if type(rec.param.grad) is MovedGrad:
                rec.param.grad = None
