"""What ``param.grad`` holds once an offloaded optimizer moved the gradient to the host: a
`MovedGrad` between the final backward and `step()`, a `ConsumedGrad` after it (Note: [The
gradient after step()]); and GradScaler's unscale of moved gradients, served on the host
(Note: [Loss scaling])."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch


class MovedGradError(RuntimeError):
    """A gradient was read after an `OffloadedOptimizer` moved it to the host."""


class GradsWritten(MovedGradError):
    """The optimizer class wrote the gradients of bucket ``index`` in a step taken during
    backward, and ``when`` needs them as backward produced them: a refusal, before anything
    changed (Notes: [A class that writes its gradients], [Written gradients brought back]).
    ``when``: "step" (`step()`: every step taken during backward undone, nothing stepped),
    "unscale" (a GradScaler), "backward" (a second backward, before it accumulated anything),
    "read" (an operation on a moved gradient), "write" (`step()` after a parameter of the
    bucket was written in place: Note: [Written after its gradient left]) or "set" (`step()`
    after a gradient of the bucket was dropped or replaced: Note: [A gradient set after it
    left])."""

    _WHY = {
        "step": "this step must undo it and take it again with the gradients as they were; "
        "every step taken during backward was undone and nothing was stepped",
        "unscale": "a GradScaler unscale must undo it and take it again with the unscaled "
        "gradients; nothing was unscaled or stepped",
        "backward": "this backward would accumulate into them: it is refused before it "
        "accumulated anything, and step() or zero_grad() go on from the backwards before it",
        "read": "this operation reads them: it is refused before anything changed, and "
        "step() or zero_grad() go on as before it",
        "write": "a parameter of it was written in place since its gradient left, and the "
        "step must be taken again from the written value with the gradients as they were: "
        "step() is refused before anything changed; zero_grad() goes on from here",
        "set": "a gradient of it was dropped or replaced (param.grad set) since it left the "
        "device, and the step must be taken again with the others as backward produced them: "
        "step() is refused before anything changed; zero_grad() goes on from here",
    }

    def __init__(self, index: int, when: str):
        note = "A class that writes its gradients" if when in ("step", "unscale") else (
            "Written gradients brought back" if when != "write" else
            "Written after its gradient left")  # fmt: skip
        super().__init__(
            f"the optimizer class wrote the gradients of bucket {index} in place during a step "
            f"taken during backward, and they are no longer those backward produced: "
            f"{self._WHY[when]}. Build the OffloadedOptimizer with overlap=False for this "
            f"class (Note: [{note}])"
        )


_MOVED = (
    "the gradient of this parameter was moved to the host by an OffloadedOptimizer when the "
    "final backward finished it, and cannot come back to the device (its parameter is streamed "
    "by stream_parameters, or the optimizer was removed): read gradients before that backward, "
    "run every backward but the last of an accumulation inside optimizer.accumulating(), and "
    "clip with OffloadedOptimizer(max_grad_norm=...)"
)

_CONSUMED = (
    "the gradient of this parameter was consumed by OffloadedOptimizer.step() (it left the "
    "device; torch.optim would keep it in .grad, to be read, accumulated into by the next "
    "backward, or stepped again): call optimizer.zero_grad() (either form) or "
    "model.zero_grad() (set_to_none=True) after step() and before the next backward or "
    "step(). See Note: [The gradient after step()]"
)

# Note: [The gradient after step()]
# torch.optim leaves ``param.grad`` as it was after `step()`: the next backward accumulates
# into it unless `zero_grad()` ran, `zero_grad(set_to_none=False)` turns it into zeros (so a
# parameter unused in the next backward is stepped with a zero gradient: weight decay and
# momentum still apply), and a second `step()` steps with it again. Here the gradient left the
# device, so after `step()` ``param.grad`` holds a `ConsumedGrad`: a placeholder that stands
# for "a gradient torch.optim would still hold" and raises when anything reads or accumulates
# into it. So every loop either behaves exactly as with torch.optim or is refused before a
# value changes:
# - `zero_grad()` / `model.zero_grad()` (set_to_none) drop it: as torch.optim.
# - `zero_grad(set_to_none=False)` of this optimizer replaces it with real zeros on the
#   device, which the next backward accumulates into and the step reads: as torch.optim
#   (``model.zero_grad(set_to_none=False)`` zeroes it in place, which the placeholder
#   refuses, naming this optimizer's `zero_grad`).
# - The next backward without `zero_grad()` (torch.optim would accumulate across steps), a
#   second `step()` without a backward (it would step again) and a read (`clip_grad_norm_`,
#   logging) are refused: the first final gradient's hook (before any bucket leaves) and
#   `step()` (before any bucket is dispatched) look for a placeholder, and autograd's own
#   accumulation into one raises from the placeholder.
# DTensor parameters (FSDP2, TP) keep their real gradient after `step()` (it is read at
# `step()`, not moved), so they behave as with torch.optim without a placeholder.


# Note: [Reading a moved gradient]
# Between the final backward and `step()` a loop may read or write the gradients: a norm for
# logging, `clip_grad_norm_` on the model, `model.to(dtype)` converting them, a hook. torch.optim
# would hand it the real values, so a `MovedGrad` serves any such operation with them: its
# bucket is recalled (the worker is waited for, a step it took is undone, the gradients are
# copied back to the device in stream order after their copy to the host: Note: [A second
# backward]) and the operation runs on the parameter's gradient, which is a device tensor
# again. That bucket then goes to the host at `step()`, without the overlap. Only a gradient
# `step()` consumed (`ConsumedGrad`) or one of a removed optimizer raises.

# Note: [Loss scaling]
# `torch.amp.GradScaler` unscales and checks every gradient of the optimizer (`unscale_`,
# also inside `scaler.step`) and skips `optimizer.step()` when one is not finite. Its one
# read of the gradients is a call of `_amp_foreach_non_finite_check_and_unscale_` over
# ``param.grad``: for moved ones `MovedGrad` serves that call on the host (the worker, once
# every bucket queued before has arrived, runs the same op on the fp32 host gradients and
# rounds them to the parameter's dtype, which is what the op writes into a gradient of that
# dtype; gradients still on the device go through the op there) and sets ``found_inf``.
# So `scaler.step(opt)` steps with the unscaled gradients, or skips the step with nothing
# written, bitwise as torch.optim; ``max_grad_norm`` clips the unscaled gradients.
# A scaled gradient must never be stepped for good: a scaler is not seen before backward, so
# buckets stepped as they arrived (before the first unscale) are undone by the unscale first
# (Note: [Steps taken during backward]), and once a scaler was seen buckets are stepped at
# `step()`, after the unscale, not as they arrive.


class _Unscale:
    """A GradScaler unscale of moved gradients, run by the worker (Note: [Loss scaling])."""

    def __init__(self, records: list[Any], inv_scale: torch.Tensor):
        self.records = records
        self.inv_scale = inv_scale  # on the host
        self.found = False
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self, host_step: Any) -> None:
        """On the worker, with its `HostStep` (its ``buckets`` and ``config``)."""
        try:
            # A step taken with the scaled gradients is undone (Note: [Steps taken during
            # backward]); one already committed cannot be, nor one that wrote them
            written = next((b for b in host_step.buckets if b.pending and b.grads_written),
                           None)  # fmt: skip
            if written is not None:  # Note: [Written gradients brought back]
                raise GradsWritten(written.index, "unscale")
            for bucket in host_step.buckets:
                host_step.undo(bucket)
            stepped = sum(b.stepped for b in host_step.buckets)
            if stepped:
                raise RuntimeError(
                    f"torch.amp.GradScaler: {stepped} of {len(host_step.buckets)} buckets were "
                    "already stepped and committed with the scaled gradients. See Note: [Loss "
                    "scaling]"
                )
            if any(not host_step.buckets[r.entry.bucket].arrived for r in self.records):
                raise RuntimeError("GradScaler: a moved gradient never reached the host")
            for bucket in host_step.buckets:  # norms still reading the gradients written here
                host_step.norms.results(bucket.norms)
            found = torch.zeros((), dtype=torch.float32)
            grads = [r.grad for r in self.records]
            with torch.no_grad():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self.inv_scale)
                for r in self.records:  # what the op writes into a gradient of this dtype
                    if r.entry.dtype != torch.float32:
                        r.grad.copy_(r.grad.to(r.entry.dtype))
                if host_step.config.max_grad_norm is not None:  # norms of unscaled gradients
                    for b in {r.entry.bucket for r in self.records}:
                        bucket = host_step.buckets[b]
                        with_grad = [r.grad for r in bucket.records if r.has_grad]
                        norm_type = host_step.config.norm_type
                        bucket.norms = host_step.norms.start(with_grad, norm_type)
            self.found = bool(found.item())
        except BaseException as exc:
            self.error = exc
        self.done.set()


_UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"


class MovedGrad(torch.Tensor):
    """What ``param.grad`` holds between the final backward and `step()`: a tensor with the
    gradient's metadata and no storage, any operation on which raises `MovedGradError` (so
    ``clip_grad_norm_`` on the model cannot silently see no gradients), except GradScaler's
    unscale, served on the host (Note: [Loss scaling])."""

    message = _MOVED
    _owner: Any = None  # (weakref to the runtime, the record), while moved

    @staticmethod
    def __new__(cls, like: torch.Tensor, dtype: Any = None, device: Any = None) -> MovedGrad:
        # ``like``'s own geometry: a streamed parameter's placeholder is empty and must take a
        # gradient of its own size (Note: [Placeholders never answer]).
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor._make_wrapper_subclass(
                cls, like.shape, like.stride(), dtype=dtype or like.dtype,
                device=device or like.device,
            )  # fmt: skip

    def __repr__(self) -> str:  # the default repr would run ops
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device})")  # fmt: skip

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        placeholder = next((t for t in _tensors(args, kwargs) if isinstance(t, MovedGrad)), None)
        message = cls.message if placeholder is None else placeholder.message
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            grads, found_inf, inv_scale = args
            moved = [g for g in grads if isinstance(g, MovedGrad)]
            owners = {id(g._owner[0]) for g in moved if type(g) is MovedGrad and g._owner}
            if len(moved) == sum(type(g) is MovedGrad for g in moved) and len(owners) == 1:
                _unscale(grads, found_inf, inv_scale)
                return None
        if func is torch.ops.aten._to_copy.default and type(placeholder) is MovedGrad:
            converted = _converted(placeholder, kwargs)
            if converted is not None:
                return converted
        # Any other read or write: the gradients come back (Note: [Reading a moved gradient])
        real = _recalled(args, kwargs)
        if real is not None:
            return func(*real[0], **real[1])
        raise MovedGradError(f"{func}: {message}")


def _recalled(args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """``args`` and ``kwargs`` with each moved gradient replaced by its parameter's gradient
    brought back to the device; None when one cannot be (consumed by `step()`, its optimizer
    removed). See Note: [Reading a moved gradient]."""
    moved = [t for t in _tensors(args, kwargs) if isinstance(t, MovedGrad)]
    for g in moved:
        runtime = g._owner[0]() if type(g) is MovedGrad and g._owner is not None else None
        if runtime is None or runtime.closed:
            return None
    if any(g._owner[1].hosted is not None for g in moved):
        return None  # Note: [A second backward]
    coming: dict[int, tuple[Any, dict[int, Any]]] = {}  # runtime -> its buckets coming back
    for g in moved:
        runtime, rec = g._owner[0](), g._owner[1]
        if rec.param.grad is g:
            buckets = coming.setdefault(id(runtime), (runtime, {}))[1]
            buckets[rec.entry.bucket] = runtime.buckets[rec.entry.bucket]
    for runtime, buckets in coming.values():  # Note: [Written gradients brought back]
        runtime.recalls.refuse_written(list(buckets.values()), "read")
    for g in moved:
        runtime, rec = g._owner[0](), g._owner[1]
        if rec.param.grad is g:
            runtime.recall(runtime.buckets[rec.entry.bucket])
        if isinstance(rec.param.grad, MovedGrad) or rec.param.grad is None:
            return None

    def swap(a: Any) -> Any:
        if isinstance(a, MovedGrad):
            return a._owner[1].param.grad
        if isinstance(a, (list, tuple)):
            return type(a)(swap(b) for b in a)
        return a

    return [swap(a) for a in args], {k: swap(v) for k, v in (kwargs or {}).items()}


def _converted(g: MovedGrad, kwargs: Any) -> MovedGrad | None:
    """``g`` converted (`model.to(dtype)`, `.cpu()`) where the step of its bucket wrote it: a
    placeholder of the new dtype and device for the same gradient, which refuses any read as
    ``g`` does (Note: [Written gradients brought back]); None where it comes back instead."""
    runtime = g._owner[0]() if g._owner is not None else None
    rec = None if runtime is None or runtime.closed else g._owner[1]
    if rec is None or rec.hosted is not None or rec.param.grad is not g:
        return None
    if not runtime.recalls.written([runtime.buckets[rec.entry.bucket]]):
        return None
    out = MovedGrad(g, dtype=kwargs.get("dtype"), device=kwargs.get("device"))
    out._owner = g._owner
    return out


def _unscale(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor):
    """GradScaler's `_amp_foreach_non_finite_check_and_unscale_` over ``grads``, some of
    them moved (of one runtime). See Note: [Loss scaling]."""
    here = [g for g in grads if not isinstance(g, MovedGrad)]
    if here:
        torch._amp_foreach_non_finite_check_and_unscale_(here, found_inf, inv_scale)
    moved = [g for g in grads if isinstance(g, MovedGrad)]
    runtime = moved[0]._owner[0]()
    if runtime is None or runtime.closed:
        raise MovedGradError(f"{_UNSCALE}: {_MOVED}")
    if runtime.unscale([g._owner[1] for g in moved], inv_scale):
        found_inf.fill_(1.0)


class ConsumedGrad(MovedGrad):
    """What ``param.grad`` holds after `step()` consumed the gradient, until `zero_grad()`:
    any operation on it (a read, the next backward's accumulation) raises `MovedGradError`.
    See Note: [The gradient after step()]."""

    message = _CONSUMED


def _tensors(args: Any, kwargs: Any) -> Iterator[Any]:
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
