"""Stepping ahead (``step_ahead``): after `step()` returns, the host step goes on while the
next forward runs; a read of a parameter still being stepped, inside ``model``'s forward or
outside it, waits for that parameter's bucket."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _get_function_stack_at, _len_torch_function_stack
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode

from torchoffload.optim._dispatch import GradientDispatch
from torchoffload.optim._grads import _tensors
from torchoffload.optim._host import Bucket

# Note: [Compiling while the host steps]
# `torch.compiler.is_compiling()` reads a process-wide flag, set while dynamo traces on any
# thread, and torch.optim classes branch on it (AdamW's `_get_value` keeps the step count a
# tensor): a bucket stepped on the worker while the caller's thread traces may round
# differently (1 ulp measured: a recompile at the next forward while stepping ahead). So
# nothing here makes dynamo trace while the worker may step; a user's recompile during a
# step ahead (a new input shape) still can: not solved yet.
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
# Finishing it does not reset the records again (`step()` did): the first gradient of the
# next backward finishes it after counting that backward, and a second reset counted the
# backwards from zero again, so that every later gradient of it was taken for one that another
# backward would accumulate into (Note: [A second backward]) and nothing was stepped during
# that backward (measured on an H100: 0.2 of 57 buckets a step, run T14 in
# benchmarks/log/2026-11-27-clip-on-the-host.md).


class StepAhead:
    """The step still running on the host after `step()` returned, and the waits for it.
    ``settle`` finishes it (the runtime's); ``before_block`` runs right before a caller
    blocks on the host step (torchoffload.testing's hook); ``enabled``: ``step_ahead``."""

    def __init__(
        self,
        engine: Any,
        dispatch: GradientDispatch,
        settle: Callable[[], None],
        before_block: Callable[[], None],
        enabled: bool,
    ):
        self.engine = engine
        self.dispatch = dispatch
        self.settle = settle
        self.before_block = before_block
        self.running: float | None = None  # a step() still running on the host (its time)
        self.waiting: dict[int, Bucket] = {}  # id(parameter) -> its bucket, while running
        if enabled:  # imports torch._dynamo: only for step_ahead
            self._settle_eagerly = torch.compiler.disable(self._settle_compiled)
        self.compiled = False  # model's forward ran under torch.compile
        self._modes = threading.local()
        # The read mode (and its thread) while a step ahead may still be read outside the
        # forward: Note: [Reading the model while stepping ahead]
        self._read_mode: tuple[_WaitMode, int] | None = None

    def start(self, called: float, waiting: dict[int, Bucket]) -> None:
        """`step()` at ``called`` returns while ``waiting``'s buckets are still stepped."""
        self.waiting = waiting
        self.running = called

    def take(self) -> float | None:
        """The time of the step still running, if any, which the caller now finishes."""
        called = self.running
        if called is not None:
            self.running = None
            self.waiting = {}
        return called

    def wait_for(self, bucket: Bucket) -> None:
        """A forward is about to read a parameter of ``bucket``. See Note: [Stepping ahead]."""
        self.before_block()
        bucket.done.wait()
        self.engine.wait(bucket.upload_event)
        for rec in bucket.records:
            self.waiting.pop(id(rec.param), None)
        self.dispatch.drop_copied()

    def _settle_compiled(self) -> None:
        self.compiled = True
        self.settle()

    # - Forward while stepping ahead
    def enter_forward(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Compiled ops do not pass through a TorchFunctionMode: finish the step first,
            # at every call (a disabled function runs eagerly, behind a graph break).
            self._settle_eagerly()
            return
        self.drop_read_mode()  # the forward's own mode takes over
        stack = self._mode_stack()
        if self.running is not None and self.waiting:
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

    # - Reads outside the forward
    def push_read_mode(self) -> bool:
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

    def drop_read_mode(self) -> None:
        """Pop the read mode if this is its thread and it is on top of the stack."""
        held = self._read_mode
        if held is None or held[1] != threading.get_ident():
            return
        n = _len_torch_function_stack()
        if n and _get_function_stack_at(n - 1) is held[0]:
            _pop_mode()
            self._read_mode = None


class _WaitMode(TorchFunctionMode):
    """Makes a torch function that reads a parameter still being stepped wait for it. See
    Note: [Stepping ahead]."""

    def __init__(self, ahead: StepAhead):
        super().__init__()
        self.ahead = ahead

    def __torch_function__(self, func, types, args=(), kwargs=None):
        waiting = self.ahead.waiting
        if waiting and _reads_values(func):
            for t in _tensors(args, kwargs):
                bucket = waiting.get(id(t))
                if bucket is not None:
                    self.ahead.wait_for(bucket)
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


def hook_model(
    model: torch.nn.Module, params: list[torch.Tensor], ahead: StepAhead,
    before_state_dict: Callable[..., None],
) -> list[Any]:  # fmt: skip
    """Put the hooks of ``step_ahead`` on ``model``: its forward enters and leaves the wait
    mode, and every module that owns one of ``params`` finishes the step before its state is
    saved or loaded (Note: [Reading the model while stepping ahead]). The hooks' handles."""
    handles = [
        model.register_forward_pre_hook(_ModelHook(ahead.enter_forward)),
        model.register_forward_hook(_ModelHook(ahead.exit_forward), always_call=True),
    ]
    ours = {id(p) for p in params}
    for m in model.modules():
        if any(id(p) in ours for _, p in m.named_parameters(recurse=False)):
            handles += [
                m.register_state_dict_pre_hook(_ModelHook(before_state_dict)),
                m.register_load_state_dict_pre_hook(_ModelHook(before_state_dict)),
            ]
    return handles


class _ModelHook:
    """A hook this optimizer puts on ``model`` (``step_ahead``). A copy of the model
    (`copy.deepcopy`, pickle: an EMA copy, ``torch.save(model)``) is a plain model of its own
    parameters, which this optimizer does not step: it gets an inert hook, not this one."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any = None):
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        if self.fn is not None:
            self.fn(*args)

    def __deepcopy__(self, memo: Any) -> _ModelHook:
        return _ModelHook()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ModelHook, ())
