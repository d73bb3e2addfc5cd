"""Undoing a bucket's step: what the optimizer class overwrites in a step (its masters and its
state) is copied aside before a step taken during backward, and copied back when the loop does
what that step did not foresee (Note: [Steps taken during backward])."""

from __future__ import annotations

import weakref
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


# Note: [Copies aside made ahead]
# The copy aside costs a speculative step as much host memory traffic as the step itself (a
# bucket's copy took 21 ms against 15 ms for its fused AdamW step, H200 machine, Llama-3.2-3B
# shape), and it falls in backward, when the host step competes with the device for time. But
# the masters and state it copies do not change between the end of one step and the next
# step's backward, while the worker is idle (the forward). So the worker, when idle, copies
# aside ahead (`Undo.prepare`) as many buckets as it stepped during the last backward and two
# more, those whose gradients arrived first (`hint_of`); during backward it steps first, of
# the buckets whose gradients have arrived, one copied ahead; and `save` copies only a tensor
# that changed since.
# "Changed": the bucket was stepped since (a count kept by `HostStep.step`, bumped before
# the optimizer class runs: a fused kernel such as `torch._fused_adamw_` writes its tensors
# without moving their version counters, measured on torch 2.13), or a tensor's version
# counter moved (every other in-place write bumps it: a restore, a master read again from its
# parameter, a write through a view), or its data pointer or identity changed (a weak
# reference: `load_state_dict` puts new tensors in the state). The stamp is taken before
# the copy, so a write that lands while the copy runs leaves a stale stamp, and the copy is
# made again. The worker prepares one bucket at a time, only once the call that stepped it
# is over (`HostWorker.idle`), and never while the caller reads or loads the state
# (`HostWorker.pause_preparing`, until the next `step()`), which also drops every copy made
# ahead: `state_dict()` hands out the live state tensors, and a write through ``.data`` or a
# NumPy view moves no version counter (found by a review). Not covered: such a write to a
# tensor held from an earlier `state_dict()` after the next step. Every master is a view of
# one host buffer, so they share one version counter: a write to one master (a restore, a
# master read again) makes every bucket's masters copy again at `save`, a cost, never a
# stale copy.


class Undo:
    """The copies aside of one bucket's optimizer: masters and state before its last step."""

    __slots__ = ("_buffers", "_saved", "saved", "_ahead", "_ahead_steps")

    def __init__(self) -> None:
        # (id of the tensor copied aside, its shape, dtype) -> the buffer it is copied into
        self._buffers: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        # (state key or None for the master, the master, what the state held: the tensor
        # object and its copy, or the value; absent if the entry did not exist)
        self._saved: list[tuple[torch.Tensor, dict[str, Any] | None]] = []
        self.saved = False
        # The tensors copied ahead by `prepare`, as they were then: key -> (the tensor,
        # weakly; its version counter, its data pointer), and the bucket's step count then
        # (Note: [Copies aside made ahead])
        self._ahead: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[Any, int, int]] = {}
        self._ahead_steps = -1

    def prepare(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        """Copy aside ``optimizer``'s masters and state now, ahead of a step to come (the
        worker is idle; ``steps``: how many times the bucket was stepped so far): its `save`
        then copies only what changed since (Note: [Copies aside made ahead])."""
        ahead = {}
        with torch.no_grad():
            for t in _tensors(optimizer):
                # The stamp before the copy: a write that lands during the copy moves the
                # version after it, and the copy is then made again at `save`
                ahead[_key(t)] = (weakref.ref(t), t._version, t.data_ptr())
                self._buffer(t).copy_(t)
        self._ahead = ahead
        self._ahead_steps = steps

    def save(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        """Copy aside ``optimizer``'s masters and state before a step (``steps``: how many
        times the bucket was stepped so far; a tensor copied ahead since its last step and
        unchanged since is not copied again)."""
        saved = []
        old, self._buffers = self._buffers, {}  # only this save's: a replaced tensor's go
        ahead, self._ahead = self._ahead, {}
        if steps != self._ahead_steps:  # stepped since: its kernels may not move versions
            ahead = {}

        def keep(t: torch.Tensor) -> None:
            buf = self._buffer(t, old)
            if not unchanged(ahead.get(_key(t)), t):
                buf.copy_(t)

        with torch.no_grad():
            for group in optimizer.param_groups:
                for master in group["params"]:
                    keep(master)
                    state = optimizer.state.get(master)
                    if state is None:
                        saved.append((master, None))
                        continue
                    kept = {}
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            keep(value)
                            kept[key] = (value, True)
                        else:
                            kept[key] = (value, False)
                    saved.append((master, kept))
        self._saved = saved
        self.saved = True

    def before(self, t: torch.Tensor) -> torch.Tensor | None:
        """What ``t`` held before the step `save` was called for (None: not saved)."""
        return self._buffers.get(_key(t)) if self.saved else None

    @property
    def prepared(self) -> bool:
        return bool(self._ahead)

    def prepared_for(self, steps: int) -> bool:
        """Copied ahead since the bucket's last step (its ``steps``-th)."""
        return bool(self._ahead) and self._ahead_steps == steps

    def forget(self) -> None:
        """Drop the copies made ahead: the state may be written in ways no stamp sees."""
        self._ahead = {}

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
        key = _key(t)
        buf = self._buffers.get(key)
        if buf is None:
            buf = None if old is None else old.get(key)
            if buf is None:
                buf = torch.empty_like(t, memory_format=torch.contiguous_format)
            self._buffers[key] = buf
        return buf


def unchanged(stamp: tuple[Any, int, int] | None, t: torch.Tensor) -> bool:
    """Whether ``t`` is as its `Undo.prepare` stamp (None: no stamp) says it was."""
    return stamp is not None and stamp[0]() is t and stamp[1:] == (t._version, t.data_ptr())


def _key(t: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    return (id(t), tuple(t.shape), t.dtype)


def _tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The masters of ``optimizer`` and the tensors of its state."""
    out = []
    for group in optimizer.param_groups:
        for master in group["params"]:
            out.append(master)
            state = optimizer.state.get(master, {})
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out
