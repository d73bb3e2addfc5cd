"""`verify`: run one step of a user's own model and setup with and without torchoffload, from
the same state, and say whether every output, loss, gradient, parameter and buffer is the same.

```python
report = torchoffload.verify(
    model, (x,),
    apply=lambda m: torchoffload.stream_parameters(m, budget_bytes=64 << 20),
    optimizer=lambda m: torchoffload.OffloadedOptimizer(m.parameters(), torch.optim.AdamW),
    loss=lambda out: out.float().pow(2).mean(),
)
print(report)  # "equal: 14 tensors compared" or the first tensor that differs, and by how much
```

The user's model, inputs and random state are left as they were: each run works on its own
deep copy of the model, made before any engine touches it, and on copies of the inputs, from
the same random state (dropout draws the same masks) under deterministic algorithms.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["Difference", "VerifyReport", "VerificationError", "verify"]


@dataclass(frozen=True)
class Difference:
    """One tensor that differs between the plain run and the offloaded one."""

    # "output", "loss", "gradient", "parameter", "buffer" (read with the engine applied, through
    # state_dict(); a non-persistent buffer directly), "parameter after remove", "buffer after
    # remove" (once it is removed)
    kind: str
    name: str  # "output[0]", "layers.0.fc1.weight", ...
    step: int  # which call or step (0-based); parameters and buffers: after the last one
    max_abs_diff: float  # inf where NaN meets a number; nan where shapes or dtypes differ
    differing: int  # elements that differ
    numel: int
    detail: str = ""  # why they cannot be compared element by element (shape, dtype, missing)

    def __str__(self) -> str:
        kind, _, removed = self.kind.partition(" after ")
        if removed:
            where = f"{kind} {self.name!r} after remove()"
        elif kind in ("parameter", "buffer"):
            where = f"{kind} {self.name!r} after step {self.step}"
        else:
            where = f"{kind} {self.name!r} at step {self.step}"
        if self.detail:
            return f"{where}: {self.detail}"
        signs = " (zeros of the other sign)" if self.max_abs_diff == 0 else ""
        return (
            f"{where}: {self.differing} of {self.numel} elements differ, "
            f"max abs diff {self.max_abs_diff:.6g}{signs}"
        )


@dataclass(frozen=True)
class VerifyReport:
    """What `verify` found. ``equal`` is True when every compared tensor is bitwise the same
    (NaN where the plain run has NaN)."""

    equal: bool
    compared: int  # tensors compared
    differences: tuple[Difference, ...]
    not_compared: tuple[str, ...] = ()  # what could not be compared, and why

    @property
    def first_difference(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    def __str__(self) -> str:
        lines = []
        if self.equal:
            lines.append(f"equal: {self.compared} tensors compared, all bitwise the same")
        else:
            n = len(self.differences)
            first = self.differences[0]
            lines.append(f"NOT equal: {n} of {self.compared} tensors differ; first: {first}")
            lines += [f"  {d}" for d in self.differences[1:10]]
            if n > 10:
                lines.append(f"  ... and {n - 10} more")
        lines += [f"  not compared: {why}" for why in self.not_compared]
        return "\n".join(lines)


class VerificationError(AssertionError):
    """Raised by ``verify(..., raise_on_difference=True)``; ``.report`` holds the report."""

    def __init__(self, report: VerifyReport):
        super().__init__(str(report))
        self.report = report


def verify(
    model: nn.Module,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    apply: Callable[[nn.Module], Any] | None = None,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    steps: int = 1,
    reference_apply: Callable[[nn.Module], Any] | None = None,
    reference_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    deterministic: bool = True,
    raise_on_difference: bool = False,
) -> VerifyReport:
    """Run ``steps`` calls (``loss=None``: inference, under ``torch.no_grad()``) or training
    steps of ``model`` on ``args``/``kwargs`` twice, plainly and with torchoffload, and compare
    every output, loss, gradient and (after the last step) parameter and buffer bitwise.

    Args:
        model: the model, before any engine is applied to it (it is deep-copied for each run
            and never changed).
        args: the model's positional inputs (a lone tensor is one argument); copied for each
            call.
        kwargs: the model's keyword inputs; copied for each call.
        apply: ``apply(model_copy)`` applies an engine to the offloaded run's copy, e.g.
            ``lambda m: torchoffload.stream_weights(m, "cuda", budget_bytes=2 << 30)``. What it
            returns is removed at the end (``.remove()``); if it is callable (a compiled
            program, ``compile_streamed``'s, or a graphed call, ``handle.cuda_graph(m)``), it
            is called in place of the model. A graphed call has no ``remove()``: the handle
            that made it (its ``handle``) is removed.
        context: a factory of a context manager entered around each forward of the offloaded
            run, e.g. ``torchoffload.offload_activations``.
        optimizer: ``optimizer(model_copy)`` builds the offloaded run's optimizer (after
            ``apply``), e.g. ``lambda m: OffloadedOptimizer(m.parameters(), torch.optim.AdamW)``;
            ``step()`` and ``zero_grad()`` run after each backward.
        loss: ``loss(output)`` gives the scalar to backpropagate; ``None`` runs inference.
        steps: calls or steps per run, each compared.
        reference_apply: the plain run's engine (default none).
        reference_optimizer: the plain run's optimizer (default ``optimizer``: the same
            factory). To check `OffloadedOptimizer` against the plain class, pass
            ``reference_optimizer=lambda m: torch.optim.AdamW(m.parameters())``.
        deterministic: run both under ``torch.use_deterministic_algorithms(True,
            warn_only=True)`` (on CUDA, set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` before the first
            matmul for deterministic cuBLAS).
        raise_on_difference: raise `VerificationError` (an ``AssertionError``) if anything
            differs.

    An exception in either run propagates, after that run's engine is removed. Gradients are
    compared where both runs can read them (an `OffloadedOptimizer` moves them to the host
    during backward: then the parameters after its step carry them); ``report.not_compared``
    says what was skipped.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    for name, fn in (("apply", apply), ("context", context), ("optimizer", optimizer),
                     ("loss", loss), ("reference_apply", reference_apply),
                     ("reference_optimizer", reference_optimizer)):  # fmt: skip
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    if optimizer is not None and loss is None:
        raise ValueError("optimizer= needs loss=: inference runs have nothing to step")
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = dict(kwargs or {})
    if reference_optimizer is None:
        reference_optimizer = optimizer

    plain = _run(model, args, kwargs, reference_apply, None, reference_optimizer, loss, steps,
                 deterministic)  # fmt: skip
    offloaded = _run(model, args, kwargs, apply, context, optimizer, loss, steps, deterministic)
    report = _compare(plain, offloaded)
    if raise_on_difference and not report.equal:
        raise VerificationError(report)
    return report


# - One run


@dataclass
class _Record:
    tensors: dict[tuple[str, str, int], torch.Tensor]  # (kind, name, step) -> a detached copy
    not_compared: list[str]
    moved: bool = False  # gradients went to the host (an OffloadedOptimizer)


def _run(model, args, kwargs, apply, context, make_opt, loss, steps, deterministic) -> _Record:
    from torchoffload.optim import MovedGrad

    record = _Record({}, [])
    devices = _cuda_devices(model, args, kwargs)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        if deterministic:
            stack.enter_context(_deterministic())
        m = copy.deepcopy(model)
        handle = apply(m) if apply is not None else None
        undo = _remover(handle)
        if undo is not None:
            stack.callback(undo)
        call = handle if callable(handle) else m
        opt = make_opt(m) if make_opt is not None else None
        if opt is not None and hasattr(opt, "remove"):
            stack.callback(opt.remove)  # runs before handle.remove (LIFO), as streaming needs
        for step in range(steps):
            a, kw = pytree.tree_map_only(torch.Tensor, _copy, (args, kwargs))
            grad_mode = torch.enable_grad() if loss is not None else torch.no_grad()
            with grad_mode, context() if context is not None else contextlib.nullcontext():
                out = call(*a, **kw)
                value = loss(out) if loss is not None else None
            _record_output(record, out, step)
            if value is None:
                continue
            record.tensors["loss", "loss", step] = _copy(value)
            value.backward()
            for name, p in m.named_parameters():
                if p.grad is None:
                    continue
                if isinstance(p.grad, MovedGrad):  # a read would bring it back: not the
                    # run the user has (Note: [Reading a moved gradient])
                    why = "gradients: moved to the host by an OffloadedOptimizer during backward"
                    record.moved = True
                    if why not in record.not_compared:
                        record.not_compared.append(why)
                    continue
                record.tensors["gradient", name, step] = _copy(p.grad)
            if opt is not None:
                opt.step()
                opt.zero_grad()
        _record_state(record, m, steps - 1, "")
    _record_state(record, m, steps - 1, " after remove")  # what the user keeps
    return record


def _remover(handle: Any) -> Callable[[], Any] | None:
    """What undoes what ``apply`` returned: its ``remove()``, or, for a graphed call
    (``handle.cuda_graph(fn)``, a `StreamedGraph`), that of the handle that made it."""
    for obj in (handle, getattr(handle, "handle", None)):
        remove = getattr(obj, "remove", None)
        if callable(remove):
            return remove
    return None


def _record_output(record: _Record, out: Any, step: int) -> None:
    """Every tensor and Python number of ``out``, through pytree nodes and dataclasses; what
    cannot be compared (another object) is named in ``not_compared``."""
    for name, leaf in _leaves(out, "output"):
        if isinstance(leaf, torch.Tensor):
            record.tensors["output", name, step] = _copy(leaf)
        elif isinstance(leaf, (bool, int, float, complex)):
            try:
                record.tensors["output", name, step] = torch.tensor(leaf)
            except RuntimeError:  # an int beyond int64
                record.not_compared.append(f"{name}: an int beyond int64")
        elif leaf is not None:
            why = f"{name}: an object of type {type(leaf).__qualname__}, not a tensor or number"
            if why not in record.not_compared:
                record.not_compared.append(why)


def _opaque_dataclass(x: Any) -> bool:
    """A dataclass instance that pytree takes as a leaf (a Hugging Face ``ModelOutput`` is a
    pytree node of its own)."""
    return (
        dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and type(x) not in pytree.SUPPORTED_NODES
    )


def _leaves(tree: Any, prefix: str) -> Any:
    for path, leaf in pytree.tree_flatten_with_path(tree, is_leaf=_opaque_dataclass)[0]:
        name = prefix + pytree.keystr(path)
        if _opaque_dataclass(leaf):
            for f in dataclasses.fields(leaf):
                yield from _leaves(getattr(leaf, f.name), f"{name}.{f.name}")
        else:
            yield name, leaf


def _record_state(record: _Record, m: nn.Module, step: int, suffix: str) -> None:
    params = {id(p) for p in m.parameters()}
    live = dict(m.named_parameters(remove_duplicate=False))
    live.update(m.named_buffers(remove_duplicate=False))
    state = m.state_dict()
    for name, t in state.items():
        kind = "parameter" if id(live.get(name)) in params else "buffer"
        record.tensors[kind + suffix, name, step] = _copy(t)
    for name, t in m.named_buffers(remove_duplicate=False):  # non-persistent ones: not in
        if name not in state:  # state_dict(), but the model computes with them
            record.tensors["buffer" + suffix, name, step] = _copy(t)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _cuda_devices(*trees: Any) -> list[int]:
    devs = set()
    for tree in trees:
        tensors = tree.parameters() if isinstance(tree, nn.Module) else pytree.tree_leaves(tree)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                devs.add(t.device.index or 0)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devs.add(torch.cuda.current_device())
    return sorted(devs)


@contextlib.contextmanager
def _deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark


# - Comparing


_ORDER = {"output": 0, "loss": 1, "gradient": 2, "parameter": 3, "buffer": 4,
          "parameter after remove": 5, "buffer after remove": 6}  # fmt: skip


def _compare(plain: _Record, offloaded: _Record) -> VerifyReport:
    keys = list(dict.fromkeys([*plain.tensors, *offloaded.tensors]))  # in the order recorded
    keys.sort(key=lambda k: (k[2], _ORDER[k[0]]))
    moved = offloaded.moved or plain.moved
    differences: list[Difference] = []
    compared = 0
    for key in keys:
        kind, name, step = key
        a, b = plain.tensors.get(key), offloaded.tensors.get(key)
        if kind == "gradient" and moved and (a is None or b is None):
            continue  # one side's gradients went to a host optimizer: see not_compared
        compared += 1
        d = _differ(kind, name, step, a, b)
        if d is not None:
            differences.append(d)
    not_compared = tuple(dict.fromkeys(plain.not_compared + offloaded.not_compared))
    return VerifyReport(not differences, compared, tuple(differences), not_compared)


def _differ(kind, name, step, a, b) -> Difference | None:
    if a is None or b is None:
        side = "offloaded" if b is None else "plain"
        n = (a if a is not None else b).numel()
        return Difference(kind, name, step, math.nan, n, n, f"missing from the {side} run")
    if a.shape != b.shape or a.dtype != b.dtype:
        what = f"plain {a.dtype}{list(a.shape)}, offloaded {b.dtype}{list(b.shape)}"
        return Difference(kind, name, step, math.nan, max(a.numel(), b.numel()), a.numel(), what)
    a, b = a.cpu(), b.cpu()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)
    same = a == b
    if a.is_floating_point():  # bitwise: 0.0 and -0.0 differ (1 / x does)
        same &= a.signbit() == b.signbit()
        same |= a.isnan() & b.isnan()
    if bool(same.all()):
        return None
    wide = torch.float64 if a.is_floating_point() else torch.int64
    diff = (a.to(wide) - b.to(wide)).abs()[~same]
    diff = torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)
    return Difference(kind, name, step, float(diff.max()), int((~same).sum()), a.numel())
