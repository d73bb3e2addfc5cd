"""Hugging Face `transformers.Trainer` with an `OffloadedOptimizer`, keeping the overlap.

Note: [Trainer's gradient norm]
`Trainer` (transformers 5.24) computes the gradient norm at every optimizer step with
``clip_grad_norm_(model.parameters(), max_grad_norm)``, and with ``max_grad_norm=0`` with
``inf``, to log it. Between the final backward and `step()` those gradients have left the
device: each read brings its bucket back (Note: [Reading a moved gradient]), so under a plain
`Trainer` every bucket is recalled every step (bitwise, without any overlap), and with
`stream_parameters` the read is refused. `offload_trainer` has the trainer take the norm and
the clip from the optimizer's own ``max_grad_norm`` instead (computed on the host as
``clip_grad_norm_`` over the fp32 host gradients in ``model.parameters()`` order: Note: [The
order of the clipping norm]): the trainer's ``_clip_grad_norm`` and ``_get_grad_norm`` return a
0-d tensor whose ``item()`` is the norm of the step it precedes, read when `Trainer` logs it
(after that step). With ``max_grad_norm=0`` the optimizer is built with
``max_grad_norm=float("inf")``: the norm only, no gradient scaled.
With gradient accumulation, `Trainer` sets accelerate's ``sync_gradients`` before each
micro-batch, which keeps the gradients of all but the last on the device (Note: [A
micro-batch that accelerate says is not the last]). Nothing else of the loop changes.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from torchoffload.optim import OffloadedOptimizer

__all__ = ["offload_trainer", "trainer_max_grad_norm"]


def trainer_max_grad_norm(args: Any) -> float:
    """The ``max_grad_norm`` to build the `OffloadedOptimizer` with for Trainer arguments
    ``args``: theirs, or ``float("inf")`` (the norm only) where they do not clip."""
    norm = getattr(args, "max_grad_norm", None)
    return float(norm) if norm else float("inf")


def offload_trainer(trainer: Any) -> Any:
    """Have ``trainer`` (a `transformers.Trainer` whose optimizer is an `OffloadedOptimizer`
    built with ``max_grad_norm=trainer_max_grad_norm(args)`` and ``model=model``) clip and log
    the gradient norm through the optimizer, on the host, so that its buckets stay on the host
    and are stepped during backward (Note: [Trainer's gradient norm]). Returns ``trainer``.
    Losses, logged norms and weights are bitwise those of the same `Trainer` with the plain
    class stepping fp32 host tensors."""
    opt = trainer.optimizer
    if not isinstance(opt, OffloadedOptimizer):
        raise TypeError(
            "offload_trainer needs Trainer(optimizers=(OffloadedOptimizer(...), scheduler)), "
            f"got {type(opt).__name__}"
        )
    want = trainer_max_grad_norm(trainer.args)
    have = opt.config.max_grad_norm
    if have != want:
        raise ValueError(
            f"the OffloadedOptimizer clips at max_grad_norm={have} and the Trainer at "
            f"{trainer.args.max_grad_norm}: build it with max_grad_norm="
            "torchoffload.integrations.hf.trainer_max_grad_norm(args) (and model=model, for "
            "the norm's order)"
        )

    def clip(self: Any, model: Any) -> torch.Tensor:
        return _Norm.of(opt)

    def norm(self: Any, model: Any, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else _Norm.of(opt)

    trainer._clip_grad_norm = types.MethodType(clip, trainer)
    trainer._get_grad_norm = types.MethodType(norm, trainer)
    return trainer


class _Norm(torch.Tensor):
    """A 0-d tensor whose ``item()`` is ``opt.grad_norm`` when read: `Trainer` reads it after
    the step it preceded."""

    _opt: OffloadedOptimizer

    @staticmethod
    def of(opt: OffloadedOptimizer) -> _Norm:
        t = torch.Tensor._make_subclass(_Norm, torch.zeros(()))
        t._opt = opt
        return t

    def item(self) -> float:  # type: ignore[override]
        norm = self._opt.grad_norm
        return float("nan") if norm is None else norm.item()
