"""Undoing a bucket's step: what the optimizer class overwrites in a step (its masters and its
state) is copied aside before a step taken during backward, and copied back when the loop does
what that step did not foresee (Note: [Steps taken during backward])."""

from __future__ import annotations

from typing import Any

import torch

# Note: [Steps taken during backward]
# A bucket whose gradients arrive during backward is stepped at once (the overlap), before the
# loop has said what the step is: a second backward may follow (gradient accumulation without
# `accumulating()`), clipping may scale every gradient by a coefficient known only once all have
# arrived (``max_grad_norm``, ``clip_grad_norm_`` on the model), a GradScaler may unscale them
# or skip the step, the hyperparameters may change before `step()`, `zero_grad()` may come
# instead of `step()`, and a refusal at `step()` must leave everything as it was. So a step
# taken before `step()` is speculative:
# - Before the optimizer class steps the bucket, its fp32 masters and every tensor of its state
#   are copied into host buffers of the bucket's own (allocated at its first such step, reused
#   after), and the state's other entries are kept by value (`Undo.save`).
# - Nothing of the step leaves the host before `step()`: the upload to the device parameters
#   (and a streamed parameter's write into its host store) is queued when `step()` commits it.
#   Until then the device parameters hold their old values, so a forward before `step()`
#   (the next micro-batch) reads what it reads with torch.optim.
# - `step()` commits the bucket when the step it took is the step the call asks for: the same
#   hyperparameters, a clip coefficient of exactly 1 (multiplying by 1 changes no bit), no
#   unscale since. Otherwise `Undo.restore` copies the masters and the state back (entries the
#   step created are deleted, so a first step is undone to "no state") and the bucket is
#   stepped again with the gradients as the call has them.
# So every loop ends each step bitwise where synchronous torch.optim ends it, or, for a
# refusal, where it started. The price: the copies aside (the masters' and the state's bytes,
# read and written once more: for AdamW 12 bytes a parameter, against 28 for the step) and
# their buffers in host memory, both only for the buckets stepped before `step()`; and a
# bucket undone is stepped twice.


class Undo:
    """The copies aside of one bucket's optimizer: masters and state before its last step."""

    __slots__ = ("_buffers", "_saved", "saved")

    def __init__(self) -> None:
        # (id of the tensor copied aside, its shape, dtype) -> the buffer it is copied into
        self._buffers: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        # (state key or None for the master, the master, what the state held: the tensor
        # object and its copy, or the value; absent if the entry did not exist)
        self._saved: list[tuple[torch.Tensor, dict[str, Any] | None]] = []
        self.saved = False

    def save(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy aside ``optimizer``'s masters and state before a step."""
        saved = []
        old, self._buffers = self._buffers, {}  # only this save's: a replaced tensor's go
        with torch.no_grad():
            for group in optimizer.param_groups:
                for master in group["params"]:
                    self._buffer(master, old).copy_(master)
                    state = optimizer.state.get(master)
                    if state is None:
                        saved.append((master, None))
                        continue
                    kept = {}
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            self._buffer(value, old).copy_(value)
                            kept[key] = (value, True)
                        else:
                            kept[key] = (value, False)
                    saved.append((master, kept))
        self._saved = saved
        self.saved = True

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put back what `save` copied aside: the masters, each state entry (the same tensor
        objects, their values copied back), and no entry the step created."""
        assert self.saved, "restore() without save()"
        with torch.no_grad():
            for master, kept in self._saved:
                master.copy_(self._buffer(master))
                if kept is None:
                    optimizer.state.pop(master, None)
                    continue
                state = optimizer.state[master]
                state.clear()
                for key, (value, is_tensor) in kept.items():
                    if is_tensor:
                        value.copy_(self._buffer(value))
                    state[key] = value
        self.drop()

    def drop(self) -> None:
        """The step was committed: nothing to restore (the buffers are kept for the next)."""
        self._saved = []
        self.saved = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer(self, t: torch.Tensor, old: dict | None = None) -> torch.Tensor:
        key = (id(t), tuple(t.shape), t.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = None if old is None else old.get(key)
            if buf is None:
                buf = torch.empty_like(t, memory_format=torch.contiguous_format)
            self._buffers[key] = buf
        return buf
