"""Reference tensor types made of several buffers, for tests and as examples.

- `TwoBufferTensor`: a traceable wrapper subclass holding two tensors; every op runs on both
  (like PyTorch's internal ``TwoTensor``).
- `QuantizedTensor` and `quantized_matmul`: int8 ``qdata`` + a float32 scale per row. Its autograd
  function saves the input in quantized form, as float8/int8 training recipes do.
- `GroupedTensor` and `grouped_matmul`: N expert buffers of different sizes plus tiny per-group
  scales, as a mixture-of-experts grouped GEMM keeps them. It is *not* a traceable subclass;
  it is made known through `torchoffload.register_flattener` when this module is imported.

Importing this module is optional: nothing in the package needs it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from torchoffload._flatten import register_flattener
from torchoffload._transfer import InjectedCopyError

__all__ = [
    "Fault",
    "GroupedTensor",
    "InjectedCopyError",
    "Interrupt",
    "QuantizedTensor",
    "TwoBufferTensor",
    "failing_copies",
    "grouped_matmul",
    "held_host_step",
    "quantize_int8",
    "quantized_matmul",
    "simulated_async_copies",
    "slow_copies",
    "weight_test_hooks",
]


def _wrapper(cls, like: torch.Tensor, size=None, stride=None, dtype=None, requires_grad=False):
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.size() if size is None else size,
        strides=like.stride() if stride is None else stride,
        storage_offset=0,
        dtype=like.dtype if dtype is None else dtype,
        device=like.device,
        requires_grad=requires_grad,
    )


class TwoBufferTensor(torch.Tensor):
    """Two tensors of one shape behind one tensor object; ops apply to both."""

    a: torch.Tensor
    b: torch.Tensor

    @staticmethod
    def __new__(cls, a, b, outer_size=None, outer_stride=None, requires_grad=False):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            raise ValueError("TwoBufferTensor needs two tensors of one shape, dtype and device")
        return _wrapper(cls, a, outer_size, outer_stride, requires_grad=requires_grad)

    def __init__(self, a, b, outer_size=None, outer_stride=None, requires_grad=False):
        self.a = a
        self.b = b

    def __repr__(self) -> str:
        return f"TwoBufferTensor(a={self.a!r}, b={self.b!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["a", "b"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return TwoBufferTensor(inner["a"], inner["b"], outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args_a = tree_map_only(TwoBufferTensor, lambda x: x.a, args)
        args_b = tree_map_only(TwoBufferTensor, lambda x: x.b, args)
        kwargs_a = tree_map_only(TwoBufferTensor, lambda x: x.a, kwargs)
        kwargs_b = tree_map_only(TwoBufferTensor, lambda x: x.b, kwargs)
        out_a = func(*args_a, **kwargs_a)
        out_b = func(*args_b, **kwargs_b)
        flat_a, spec = tree_flatten(out_a)
        flat_b, _ = tree_flatten(out_b)
        out = [
            TwoBufferTensor(x, y) if isinstance(x, torch.Tensor) else x
            for x, y in zip(flat_a, flat_b, strict=True)
        ]
        return return_and_correct_aliasing(func, args, kwargs, tree_unflatten(out, spec))


class QuantizedTensor(torch.Tensor):
    """int8 ``qdata`` with a float32 ``scale`` per row; it reads as ``qdata * scale`` in
    ``dtype``. Any op on it runs on the dequantized value."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata, scale, dtype=torch.float32, outer_size=None, outer_stride=None):
        return _wrapper(cls, qdata, outer_size, outer_stride, dtype=dtype)

    def __init__(self, qdata, scale, dtype=torch.float32, outer_size=None, outer_stride=None):
        self.qdata = qdata
        self.scale = scale

    def __repr__(self) -> str:
        return f"QuantizedTensor({tuple(self.shape)}, dtype={self.dtype})"

    def dequantize(self) -> torch.Tensor:
        return (self.qdata.to(torch.float32) * self.scale).to(self.dtype)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return QuantizedTensor(inner["qdata"], inner["scale"], dtype, outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            (t,) = args
            return QuantizedTensor(t.qdata, t.scale, t.dtype)
        deq = tree_map_only(QuantizedTensor, lambda x: x.dequantize(), (args, kwargs))
        return func(*deq[0], **deq[1])


def quantize_int8(x: torch.Tensor) -> QuantizedTensor:
    """Symmetric per-row int8 quantization of a 2-D (or flattened to 2-D) tensor."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    scale = (x2.abs().amax(dim=-1, keepdim=True).float() / 127).clamp_min(1e-12)
    data = torch.round(x2.float() / scale).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor(data.reshape(x.shape), scale.reshape(*x.shape[:-1], 1), x.dtype)


class _QuantizedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(quantize_int8(x), w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        q, w = ctx.saved_tensors
        assert type(q) is QuantizedTensor, type(q)
        x = q.dequantize()
        grad_w = x.reshape(-1, x.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])
        return grad @ w.t(), grad_w


def quantized_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` that saves ``x`` for backward as an int8 `QuantizedTensor` (so the weight
    gradient uses the quantized activation, as low-precision training recipes do)."""
    return _QuantizedMatmul.apply(x, w)


class GroupedTensor(torch.Tensor):
    """One tensor object over N buffers of different sizes (the tokens routed to each
    expert) plus a tiny float32 scale per group. Not a traceable subclass: torchoffload knows
    it through `register_flattener`. Only detach/alias are supported as ops."""

    buffers: list[torch.Tensor]
    scales: torch.Tensor

    @staticmethod
    def __new__(cls, buffers, scales):
        total = sum(b.numel() for b in buffers)
        return torch.Tensor._make_wrapper_subclass(
            cls, (total,), dtype=buffers[0].dtype, device=buffers[0].device
        )

    def __init__(self, buffers, scales):
        self.buffers = list(buffers)
        self.scales = scales

    def __repr__(self) -> str:
        return f"GroupedTensor({[tuple(b.shape) for b in self.buffers]})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            (t,) = args
            return GroupedTensor(t.buffers, t.scales)
        raise NotImplementedError(f"GroupedTensor supports only detach/alias, not {func}")


register_flattener(
    GroupedTensor,
    flatten=lambda t: ([*t.buffers, t.scales], len(t.buffers)),
    unflatten=lambda buffers, n: GroupedTensor(buffers[:n], buffers[n]),
)


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, splits, *weights):
        groups = list(torch.split(x, splits))
        scales = torch.stack([g.abs().amax().float() for g in groups])
        ctx.save_for_backward(GroupedTensor([g.contiguous() for g in groups], scales), *weights)
        ctx.splits = splits
        return torch.cat([g @ w for g, w in zip(groups, weights, strict=True)])

    @staticmethod
    def backward(ctx, grad):
        grouped, *weights = ctx.saved_tensors
        assert type(grouped) is GroupedTensor, type(grouped)
        grads = torch.split(grad, ctx.splits)
        grad_x = torch.cat([g @ w.t() for g, w in zip(grads, weights, strict=True)])
        grad_w = [x.t() @ g for x, g in zip(grouped.buffers, grads, strict=True)]
        return grad_x, None, *grad_w


def grouped_matmul(x: torch.Tensor, weights: list[torch.Tensor], splits: list[int]):
    """Rows ``splits[i]`` of ``x`` go through ``weights[i]`` (a mixture-of-experts layer); the
    routed inputs are saved for backward as one `GroupedTensor`."""
    return _GroupedMatmul.apply(x, list(splits), *weights)


def weight_test_hooks(
    handle: Any, *, trace: bool = False, debug_events: bool = False, skip: Any = ()
) -> Any:
    """Instrument a `WeightStreamHandle` for tests: ``trace`` records every load and read of the
    arena (kind, unit, start, end, event, [events waited on]); ``debug_events`` stands labels
    in for device events on the CPU; ``skip`` ({"done", "ready"}) drops those waits, to show
    that a race test catches the missing wait. Returns the hooks (``.trace``)."""
    from torchoffload.weights._arena import TestHooks

    hooks = TestHooks([] if trace else None, debug_events, frozenset(skip))
    handle._runtime.arena.testing = hooks
    return hooks


@contextlib.contextmanager
def slow_copies(device: Any = None, cycles: int = 2_000_000) -> Iterator[Any]:
    """Inside the block, the copy streams of ``device`` (default: the current CUDA device)
    spin ``cycles`` GPU cycles before each copy: races between copies and compute show."""
    from torchoffload._transfer import CopyTestHooks, compute_device, copy_engine

    dev = compute_device(device if device is not None else "cuda")
    engines = [copy_engine(dev, use_streams=s) for s in (True, False)]
    for engine in engines:
        engine.testing = CopyTestHooks(delay_cycles=cycles)
    try:
        yield engines[0]
    finally:
        for engine in engines:
            engine.testing = None


class HostStepTestHooks:
    """The hooks of `held_host_step`: ``gate`` holds the host step until the runtime calls
    ``waiting()``, right before a caller blocks on it."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.waits = 0  # times a caller blocked on the host step

    def waiting(self) -> None:
        self.waits += 1
        self.gate.set()


@contextlib.contextmanager
def held_host_step(optimizer: Any) -> Iterator[Any]:
    """Inside the block, the host step of ``optimizer`` (an `OffloadedOptimizer`) does not
    step any bucket until a call blocks on the host step (the runtime opens the gate right
    before it blocks) or the block ends: a ``step_ahead`` step is then still running when
    `step()` returns, whatever the timing, and a read that does not wait for it sees the old
    values. Yields the hooks (``.gate``, ``.waits``: how many calls blocked)."""
    runtime = optimizer._runtime
    hooks = HostStepTestHooks()
    held = []
    for bucket in runtime.buckets:
        inner = bucket.optimizer

        def step(*args: Any, _step: Any = inner.step, **kwargs: Any) -> Any:
            hooks.gate.wait()
            return _step(*args, **kwargs)

        inner.step = step  # this instance only, shadowing the class's step
        held.append(inner)
    runtime.testing = hooks
    try:
        yield hooks
    finally:
        hooks.gate.set()
        runtime.testing = None
        for inner in held:
            del inner.step


@contextlib.contextmanager
def simulated_async_copies() -> Iterator[Any]:
    """On the CPU: D2H events stay "not done" until ``hooks.complete_events()`` (or the end of
    the block), so the keep-alive and release bookkeeping of asynchronous copies runs in CI.
    Yields the hooks."""
    from torchoffload._transfer import CopyTestHooks, copy_engine

    engine = copy_engine(torch.device("cpu"))
    hooks = engine.testing = CopyTestHooks(async_events=True)
    try:
        yield hooks
    finally:
        hooks.complete_events()
        engine.testing = None


class Interrupt(torch.nn.Module):
    """An identity module that raises `KeyboardInterrupt` in its forward once ``armed`` (a
    class attribute; disarmed when it fires): a Ctrl-C in the middle of a model's forward."""

    armed = False

    def forward(self, x: Any) -> Any:
        if Interrupt.armed:
            Interrupt.armed = False
            raise KeyboardInterrupt
        return x


@contextlib.contextmanager
def failing_copies(
    device: Any = None, *, at: int = 1, kinds: tuple[str, ...] = ("offload", "reload", "load")
) -> Iterator[Any]:
    """Inside the block, the ``at``-th copy (1-based) of the given kinds that an offloader
    queues through ``device``'s copy engine (default: the current accelerator, else the CPU;
    the engine with copy streams, ``use_streams=True``) raises `InjectedCopyError` before
    anything is queued, once: a copy that fails mid-step. Composes with `slow_copies` and
    `simulated_async_copies`. Yields the hooks (``.copies``: how many were counted so far;
    ``.fail_at`` is None once it fired)."""
    from torchoffload._transfer import CopyTestHooks, compute_device, copy_engine

    engine = copy_engine(compute_device(device))
    installed = engine.testing is None
    hooks = engine.testing = CopyTestHooks() if installed else engine.testing
    hooks.fail_at, hooks.fail_kinds, hooks.copies = at, frozenset(kinds), 0
    try:
        yield hooks
    finally:
        hooks.fail_at = None
        if installed:
            engine.testing = None


class Fault(torch.nn.Module):
    """An identity module that, once ``Fault.armed`` is set, fires in its forward and disarms:
    an exception (instance or class) is raised, any other callable is called (say, one that
    allocates more device memory than there is: a real out-of-memory error). A failure in the
    middle of a model's forward."""

    armed: Any = None

    def forward(self, x: Any) -> Any:
        fault = Fault.armed
        if fault is not None:
            Fault.armed = None
            if isinstance(fault, BaseException) or (
                isinstance(fault, type) and issubclass(fault, BaseException)
            ):
                raise fault
            fault()
        return x
