"""How a tensor maps onto the bytes of its storage, and how to rebuild it from a copy.

A saved tensor is often a view (a transpose, a slice of a fused QKV projection). torchoffload
copies the whole storage once, however many views of it were saved, and rebuilds each view with
its exact dtype, size, stride and storage offset, so kernels see the same layout (and give the
same bits) as without offloading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "Rebuild",
    "ViewMeta",
    "flatten",
    "is_composite",
    "register_flattener",
    "storage_bytes",
    "unregister_flattener",
]


@dataclass(frozen=True, slots=True)
class ViewMeta:
    """The geometry of a strided tensor over its storage."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    conj: bool
    neg: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> ViewMeta:
        return cls(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.is_conj(), t.is_neg())

    def rebuild(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """A tensor with this geometry over ``storage`` (a copy of the original's storage)."""
        out = torch.empty(0, dtype=self.dtype, device=storage.device)
        out.set_(storage, self.offset, self.size, self.stride)
        if self.conj:
            out = out.conj()
        if self.neg:
            out = torch._neg_view(out)
        return out

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.size)}"


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over all bytes of ``t``'s storage (no copy)."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


# -- tensors made of several buffers --------------------------------------------------------------
#
# Note: [One flatten layer for every engine]
# A composite tensor (a traceable wrapper subclass such as DTensor or a float8 tensor, or a type
# registered with `register_flattener`) is handled as its list of inner buffers plus a way to
# rebuild it. Each buffer is then offloaded or kept on its own (a tiny scale stays, the data
# goes). The object is always rebuilt from the buffers, even when none was offloaded: a flatten
# may return buffers detached from the original object, so skipping the rebuild could lose data.
# Traceable subclasses rebuild with `__tensor_unflatten__`, keeping outer size and stride; the
# recursion handles a subclass inside a subclass. The activation engine uses this now, and the
# weight and graph engines are meant to use the same functions.

_Flatten = Callable[[torch.Tensor], "tuple[list[torch.Tensor | None], Any]"]
_Unflatten = Callable[["list[torch.Tensor | None]", Any], torch.Tensor]
_REGISTRY: dict[type, tuple[_Flatten, _Unflatten]] = {}


def register_flattener(cls: type, *, flatten: _Flatten, unflatten: _Unflatten) -> None:
    """Teach torchoffload how to take a tensor type apart and put it back together.

    ``flatten(t)`` returns ``(buffers, context)``: a list of tensors (or None) and anything
    needed to rebuild. ``unflatten(buffers, context)`` returns the tensor. Use it for tensor
    types that are not traceable wrapper subclasses (no ``__tensor_flatten__``); it also takes
    precedence over ``__tensor_flatten__`` for types that have one. Subclasses of ``cls`` use
    it too unless they are registered themselves.
    """
    if not isinstance(cls, type) or not issubclass(cls, torch.Tensor):
        raise TypeError(f"cls must be a torch.Tensor subclass, got {cls!r}")
    if cls in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"{cls.__name__} cannot be registered: it is handled natively")
    if not callable(flatten) or not callable(unflatten):
        raise TypeError("flatten and unflatten must be callables")
    _REGISTRY[cls] = (flatten, unflatten)


def unregister_flattener(cls: type) -> None:
    """Undo `register_flattener` (no error if ``cls`` was not registered)."""
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {type(cls).__name__}")
    _REGISTRY.pop(cls, None)


def _registered(cls: type) -> tuple[_Flatten, _Unflatten] | None:
    for base in cls.__mro__:
        if base is torch.Tensor:
            return None
        entry = _REGISTRY.get(base)
        if entry is not None:
            return entry
    return None


def is_composite(t: torch.Tensor) -> bool:
    """True for a registered type or a traceable wrapper subclass."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    return _registered(type(t)) is not None or is_traceable_wrapper_subclass(t)


class Rebuild:
    """Puts a composite tensor back together from its (possibly reloaded) buffers."""

    __slots__ = ("cls", "names", "context", "size", "stride", "unflatten")

    def __init__(self, cls, names, context, size, stride, unflatten):
        self.cls = cls
        self.names = names  # inner attribute names (traceable), or None (registry)
        self.context = context
        self.size = size
        self.stride = stride
        self.unflatten = unflatten

    def __call__(self, buffers: list[torch.Tensor | None]) -> torch.Tensor:
        try:
            if self.names is None:
                out = self.unflatten(buffers, self.context)
            else:
                inner = dict(zip(self.names, buffers, strict=True))
                out = self.cls.__tensor_unflatten__(inner, self.context, self.size, self.stride)
        except Exception as e:
            raise TypeError(
                f"torchoffload could not rebuild a {self.cls.__qualname__} from its buffers: "
                f"{type(e).__name__}: {e}"
            ) from e
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"unflatten for {self.cls.__qualname__} returned {type(out).__name__}, not a tensor"
            )
        return out


def flatten(t: torch.Tensor) -> tuple[list[Any], Rebuild]:
    """Split a composite tensor into its inner entries and a `Rebuild`.

    Entries are tensors (offloadable), None, or other objects a type keeps beside its tensors
    (DTensor lists its DeviceMesh), which are handed back to the rebuild unchanged. Raises
    TypeError, naming the type, when the type's own flatten fails."""
    cls = type(t)
    entry = _registered(cls)
    try:
        if entry is not None:
            buffers, context = entry[0](t)
            buffers = list(buffers)
            rebuild = Rebuild(cls, None, context, None, None, entry[1])
        else:
            names, context = t.__tensor_flatten__()
            buffers = [getattr(t, name) for name in names]
            rebuild = Rebuild(cls, list(names), context, t.size(), t.stride(), None)
    except Exception as e:
        raise TypeError(
            f"torchoffload could not flatten a {cls.__qualname__}: {type(e).__name__}: {e}"
        ) from e
    return buffers, rebuild


# Note: [Async collective results are waited on before they are read]
# A functional collective (DTensor's redistribute under tensor parallelism) returns an
# `AsyncCollectiveTensor`: a wrapper whose inner buffer is only valid once `wait_tensor` has
# run. Its `__tensor_flatten__` hands out that inner buffer as is, so copying it would read the
# collective's output before it is written (seen on gloo: wrong weight gradients from a
# row-parallel output saved by the next column-parallel linear). Its flatten therefore waits
# first. On CUDA the wait makes the current stream wait on the collective (no host sync), which
# the copy stream then inherits through its own wait on the compute stream. The rebuilt tensor
# is the plain, completed buffer, which is what the wrapper would have become at first use.
def _register_builtin() -> None:
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except Exception:  # torch built without distributed
        return
    register_flattener(
        AsyncCollectiveTensor,
        flatten=lambda t: ([t.trigger_wait()], None),
        unflatten=lambda buffers, context: buffers[0],
    )


_register_builtin()
