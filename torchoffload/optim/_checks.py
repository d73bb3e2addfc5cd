"""What the host step refuses, before anything changes: a parameter converted, moved, frozen or
unstreamed since the optimizer was built, a gradient `step()` consumed, hyperparameters changed
after buckets were stepped with the old ones."""

from __future__ import annotations

from typing import Any

import torch

from torchoffload._hosted import HOSTED
from torchoffload.optim._build import capturable_refusal, check_host_groups
from torchoffload.optim._grads import ConsumedGrad
from torchoffload.optim._host import Bucket, HostMasters, Record
from torchoffload.optim._params import local

# Note: [Refused before a backward accumulates]
# A backward on a parameter the step would refuse (converted, moved, frozen or unfrozen where
# that is refused, no longer streamed) is refused before autograd accumulates any gradient of
# this optimizer, not at the first final gradient: by then autograd has accumulated into other
# parameters' gradients (a device part's, a layer that came earlier in backward), and the
# refused backward would leave them half of a step (found by the differential fuzzer: a model
# converted to float64 with ``offload_fraction=0.25``, the next backward's gradients off by
# 0.34). Every trainable parameter of the optimizer, the device part's included, has a tensor
# hook, which autograd runs before it accumulates; the first hook of each backward that
# accumulates checks every parameter's metadata (`refusal`: no values read, no copy) and
# raises. A backward is told apart by its autograd graph task id, so one that raised does not
# leave the next unchecked (found by a review: a flag reset by a callback at the end of the
# backward stayed set after a failed one). `torch.autograd.grad`, which returns gradients
# without accumulating them, is not checked (`accumulates`). Not covered: a parameter that
# needed no gradient when the optimizer was built has no hook (a hook needs a tensor that
# requires grad); unfrozen since, with ``offload_fraction`` < 1, it is refused at the first
# hooked parameter, possibly after its own gradient accumulated.


def check_record(host: HostMasters, rec: Record) -> None:
    """Refuse a parameter whose dtype or shape changed; re-read one changed outside."""
    message = refusal(host, rec)
    if message is not None:
        raise RuntimeError(message)
    if rec.hosted is not None:
        if rec.synced[0] != rec.hosted.version:
            host.refresh(rec)
        return
    p = local(rec.param)
    if (p._version, p.data_ptr()) != rec.synced:
        # Changed outside the optimizer (load_state_dict, an in-place init): its master
        # follows. A blocking copy, only after such a change.
        host.moved(rec)


def refusal(host: HostMasters, rec: Record) -> str | None:
    """Why the host step refuses ``rec``'s parameter as it is now (None: it does not). Reads
    nothing but metadata: also run at the start of each backward (Note: [Refused before a
    backward accumulates])."""
    # Frozen or unfrozen since the build: stepped as torch.optim steps it, when it has a
    # gradient (Note: [requires_grad changed after the build]); not yet for streamed and
    # DTensor parameters, whose gradients reach the optimizer another way, nor with a device
    # part (offload_fraction < 1), which refuses it
    fixed = rec.hosted is not None or rec.dtensor or host.requires_grad_fixed
    if rec.param.requires_grad != rec.trainable and fixed:
        return (
            f"parameter {host.no(rec)}: requires_grad was {rec.trainable} when the "
            f"optimizer was built and is {rec.param.requires_grad} now: build the "
            "OffloadedOptimizer after freezing or unfreezing parameters"
        )
    if rec.hosted is not None:
        if HOSTED.get(rec.param) is not rec.hosted:
            return (
                f"parameter {host.no(rec)} is no longer streamed by the "
                "stream_parameters handle it was streamed by when the optimizer was built"
            )
        return None
    return converted(host, rec)


def converted(host: HostMasters, rec: Record) -> str | None:
    """Why ``rec``'s parameter (not a streamed one) is refused for its device, dtype or
    shape, changed since the build (None: it is not)."""
    if rec.hosted is not None:
        return None
    p = local(rec.param)
    if p.device != host.device:
        return (
            f"parameter {host.no(rec)} is now on {p.device}, was on {host.device} when "
            "the optimizer was built"
        )
    if p.dtype != rec.entry.dtype or tuple(p.shape) != rec.entry.shape:
        return (
            f"parameter {host.no(rec)} is now {p.dtype} {tuple(p.shape)}, was "
            f"{rec.entry.dtype} {rec.entry.shape} when the optimizer was built: build "
            "the OffloadedOptimizer after converting the model"
        )
    return None


def refuse_consumed(every: list[tuple[int, torch.Tensor]], what: str) -> None:
    """Refuse ``what`` while a parameter of ``every`` (its index, the parameter) holds a
    `ConsumedGrad`, before anything changes (Note: [The gradient after step()])."""
    for i, p in every:
        if type(p.grad) is ConsumedGrad:
            does = "accumulate into" if "backward" in what else "step again with"
            raise RuntimeError(
                f"{what} after step() without zero_grad(): torch.optim would {does} "
                f"the last step's gradient of parameter {i}, which left the device: call "
                "optimizer.zero_grad() (either form) or model.zero_grad() "
                "(set_to_none=True) after step(). See Note: [The gradient after step()]"
            )


class GroupsCheck:
    """The parameters of each of an optimizer's ``param_groups`` (the live list) at the
    build; called, why the groups no longer hold them (None: they do). Note: [The param
    groups the host steps]."""

    def __init__(self, groups: list[dict[str, Any]]):
        self.groups = groups
        self.built = [list(group["params"]) for group in groups]
        self.host: set[int] = set()  # the groups holding a parameter the host steps

    def __call__(self) -> str | None:
        groups, built = self.groups, self.built
        why = None
        if len(groups) != len(built):
            why = f"it has {len(groups)} param groups, it was built with {len(built)}"
        for g, (group, params) in enumerate(zip(groups, built, strict=False)):
            now = group.get("params") if isinstance(group, dict) else None
            now = [now] if isinstance(now, torch.Tensor) else list(now or ())
            if why is None and (len(now) != len(params) or any(
                a is not b for a, b in zip(now, params, strict=False)
            )):  # fmt: skip
                why = f"param_groups[{g}]['params'] is not the parameters it was built with"
        if why is None:
            message = capturable_refusal(groups, self.host)  # a group edited in place
            return None if message is None else f"OffloadedOptimizer: {message}"
        return (
            f"OffloadedOptimizer: {why}. The host steps the parameters of each group it was "
            "built with, and torch.optim would step these: put them back, or build an "
            "OffloadedOptimizer over the groups you want (add_param_group() is refused too). "
            "See Note: [The param groups the host steps]"
        )

    def check_host(self, host: set[int]) -> None:
        """Record the groups holding a parameter the host steps, and refuse (ValueError) an
        option it cannot honour in them (`check_host_groups`)."""
        self.host = host
        check_host_groups(self.groups, host)

    def refuse(self) -> None:
        """Raise the message, if any, before anything changes."""
        message = self()
        if message is not None:
            raise RuntimeError(message)


def changed_hyper(buckets: list[Bucket], snapshot: list[dict[str, Any]]) -> str | None:
    """The first hyperparameter that differs between a bucket stepped during backward and
    ``snapshot`` (those of the `step()` call), as a message; None when none does."""
    for bucket in buckets:
        if bucket.used is None:
            continue
        for used, g in zip(bucket.used, bucket.groups, strict=True):
            now = snapshot[g]
            for key in now.keys() | used.keys():
                if not _same(used.get(key), now.get(key)):
                    return f"group {g} {key}: {used.get(key)!r} -> {now.get(key)!r}"
    return None


def changed_in(bucket: Bucket, snapshot: list[dict[str, Any]]) -> bool:
    """Whether the hyperparameters ``bucket`` was stepped with differ from ``snapshot``."""
    return bucket.used is not None and changed_hyper([bucket], snapshot) is not None


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
