"""Hosted tensors: module tensors whose values live in a host store, one layer for every
streaming engine (`stream_weights`, `stream_parameters`, the compiled-program drivers).

Note: [Placeholders never answer]
A streamed tensor keeps its identity (the `nn.Parameter` object the modules, an optimizer or
the user hold) and holds device bytes only while its unit runs (bound). The rest of the time
it is a *placeholder*: an empty tensor on the compute device whose class is swapped to a
subclass with a ``__torch_function__`` (`HostedParameter`, `HostedTensor`), so every torch
function that reaches it is seen. A placeholder never computes on its empty storage:
- geometry (``shape``, ``size()``, ``numel()``, ``stride()``...) answers with the real tensor's;
  attributes that are the object's own (``grad``, ``requires_grad``, ``dtype``, ``device``,
  hooks, storage identity) are passed through; ``p.grad = g`` is checked against the real
  geometry (`_set_grad`), as autograd checks it on the resident tensor;
- a view that needs no values (``detach()``, ``.data``, ``t()``, indexing by numbers...) is a
  placeholder too, of the same host bytes;
- any other function runs on a device copy of the real values (read from the host store on the
  compute stream, so the bits are those plain PyTorch computes on the device); when it wrote
  that copy in place, the bytes are written back to the host store and the version counters of
  the placeholders of those bytes are bumped (a saved tensor of a pending backward then fails
  autograd's check, as it would without streaming);
- what cannot be served with the real values raises before any value changes: a function that
  would record autograd history into a placeholder (its gradient could not reach the streamed
  parameter: compute it under ``torch.no_grad()`` or on ``p.detach()``), a result that shares
  memory with the copy in a way no placeholder can express, a change of the tensor's own
  geometry (``resize_``, ``t_``, ``set_``), ``.data = ...`` assignment, numpy/DLPack sharing,
  a read during CUDA-graph capture or `torch.compile` tracing. ``set_`` never reaches
  ``__torch_function__`` (torch binds it apart), so the placeholder classes refuse it as a
  method of their own (`_set`); the engines call ``set_`` only on plain (bound) tensors;
- ``model.to(dtype)``, ``.half()``, ``.cpu()``... are checked before any tensor is converted
  (`guard_conversions`): a conversion that would change a hosted tensor's dtype or device
  raises and changes nothing; one that changes nothing (``model.to(its device)``) runs, except
  under ``torch.__future__.set_swap_module_params_on_conversion(True)``, where it would swap
  the tensor objects the engine streams: refused too; so is ``model.share_memory()`` (it
  would share the placeholders' empty storages, never the values);
- a function that gives a device copy another storage (``torch.ops.aten.set_``, which
  reaches ``__torch_function__`` where the method does not) is refused like a geometry
  change, and one that writes an argument without bumping its version counter is told by
  its schema (Note: [Writes that bump no version counter]).
Binding swaps the class back, so inside its unit a parameter is a plain tensor with no
per-op cost. The class swap is an attribute store on the Python object; nothing else of the
tensor changes.

Note: [Hosted parameters]
A streamed training parameter (`stream_parameters`) is stepped by a host optimizer
(`OffloadedOptimizer`) in the host store: the optimizer reads a master from ``Hosted.host`` (at
construction, after ``version`` changed, and on `reload_parameters`) and writes the new value
into ``host`` after its step (rounded to the parameter's dtype), after `before_write()`, which
waits (on the host, on the optimizer's worker) for the last copy that read those bytes to the
device. The next forward loads the new bytes. A write from elsewhere (a placeholder's write
back, ``load_state_dict``) bumps ``version``, so the optimizer reads it again.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary


class Hosted:
    """The host side of one streamed training parameter (Note: [Hosted parameters])."""

    __slots__ = ("host", "version", "users", "_before_write", "__weakref__")

    def __init__(self, host: torch.Tensor, before_write: Callable[[], None]):
        self.host = host  # pinned host view: the parameter's dtype, shape and stride
        self.version = 0  # bumped by writes that do not come from the optimizer
        self.users = 0  # host optimizers stepping it (the streaming engine outlives them)
        self._before_write = before_write

    def before_write(self) -> None:
        """Wait until no copy to the device still reads ``host``."""
        self._before_write()


# parameter -> its Hosted, while a stream_parameters handle streams it
HOSTED: WeakIdKeyDictionary = WeakIdKeyDictionary()

# parameter -> the host optimizer runtime that steps it (an OffloadedOptimizer's)
MANAGED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class HostedError(RuntimeError):
    """A read or write of a streamed tensor outside its unit that cannot be served with its
    real values. Nothing was changed."""


class HostStore(Protocol):
    """What an engine gives the placeholders of its tensors (Note: [Placeholders never
    answer]). ``key`` names one piece of the host store (a storage, stored once)."""

    def read_piece(self, key: Any) -> torch.Tensor:
        """A new uint8 tensor on the compute device holding the piece's current bytes,
        ordered on the compute stream. Raises `HostedError` when it cannot be read now."""
        ...

    def write_piece(self, key: Any, data: torch.Tensor, written: list[tuple[int, int]]) -> None:
        """Write ``data`` (uint8, the piece's bytes, on the compute device) into the host store;
        device copies of the piece become stale. ``written``: the byte ranges of the piece that
        the function wrote through (the tensors of other ranges kept their values). Raises
        `HostedError` when it cannot be written now (before anything changes)."""
        ...


class Ref:
    """Where a placeholder's values are: a piece of a store and a geometry inside it (in
    elements of ``dtype`` from the piece's first byte)."""

    __slots__ = ("store", "key", "offset", "size", "stride", "dtype", "name", "cls", "_meta")

    def __init__(
        self,
        store: HostStore,
        key: Any,
        offset: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        name: str,
        cls: type,
    ) -> None:
        self.store = store
        self.key = key
        self.offset = offset
        self.size = tuple(size)
        self.stride = tuple(stride)
        self.dtype = dtype
        self.name = name
        self.cls = cls  # the class the tensor has while bound
        self._meta: torch.Tensor | None = None

    def meta(self) -> torch.Tensor:
        """A meta tensor of the same geometry (answers shape queries and computes views)."""
        if self._meta is None:
            item = torch.empty(0, dtype=self.dtype).element_size()
            extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
            n = (self.offset + (extent if all(self.size) else 0)) * item
            storage = torch.UntypedStorage(max(n, 0), device="meta")
            m = torch.empty(0, dtype=self.dtype, device="meta")
            self._meta = m.set_(storage, self.offset, self.size, self.stride)
        return self._meta


# placeholder tensor -> its Ref (for a streamed tensor, for its whole streamed life)
REFS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _serve_function(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
    return _serve(func, args, kwargs or {})


def _set(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.set_`` of a placeholder: refused (Note: [Placeholders never answer]). torch
    binds ``set_`` outside the ``__torch_function__`` machinery, so `_serve` never sees it:
    unrefused, it pointed the placeholder at another storage while the engine kept the values
    (and the forward) on the host store's. A tensor of this class that is no placeholder
    (made by ``type(p)(...)``) is a plain one."""
    ref = REFS.get(self)
    if ref is None:
        self.__class__ = nn.Parameter if isinstance(self, nn.Parameter) else torch.Tensor
        return self.set_(*args, **kwargs)
    raise HostedError(
        f"set_ on streamed tensor {ref.name!r} outside its unit: it would replace the storage "
        "of the tensor the engine streams, whose values live in the host store. Write its "
        "values with `p.copy_(value)` under torch.no_grad(), or remove() the handle first"
    )


class HostedTensor(torch.Tensor):
    """The class of a streamed buffer (or a view of a streamed tensor) outside its unit. See
    Note: [Placeholders never answer]."""

    __torch_function__ = classmethod(_serve_function)  # type: ignore[assignment]
    set_ = _set  # type: ignore[assignment]  # not seen by __torch_function__


class HostedParameter(nn.Parameter):
    """The class of a streamed `nn.Parameter` outside its unit. See Note: [Placeholders never
    answer]."""

    __torch_function__ = classmethod(_serve_function)  # type: ignore[assignment]
    set_ = _set  # type: ignore[assignment]  # not seen by __torch_function__

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> Any:
        # ``type(p)(values)`` (Parameter.__deepcopy__) makes a plain parameter
        return nn.Parameter(data, requires_grad)

    def __deepcopy__(self, memo: dict) -> Any:
        return _on_real_copy(nn.Parameter.__deepcopy__, (self, memo), {})

    def __reduce_ex__(self, proto: Any) -> Any:
        return _on_real_copy(nn.Parameter.__reduce_ex__, (self, proto), {})


_HOSTED_CLASSES = (HostedTensor, HostedParameter)


def hosted_class(cls: type) -> type | None:
    """The placeholder class for a tensor of class ``cls``; None for a class that is not
    hosted (a tensor subclass with its own behaviour)."""
    if cls is nn.Parameter:
        return HostedParameter
    if cls is torch.Tensor:
        return HostedTensor
    return None


def register(t: torch.Tensor, ref: Ref) -> None:
    """Make ``t`` (unbound: empty) a placeholder of ``ref``'s values."""
    REFS[t] = ref
    hosted = hosted_class(ref.cls)
    if hosted is not None:
        t.__class__ = hosted


def unregister(t: torch.Tensor) -> None:
    """``t`` is no longer streamed: its own class again."""
    ref = REFS.pop(t, None)
    if ref is not None and type(t) in _HOSTED_CLASSES:
        t.__class__ = ref.cls


def bound(t: torch.Tensor) -> None:
    """``t`` is bound to its bytes (inside its unit): a plain tensor."""
    if type(t) in _HOSTED_CLASSES:
        t.__class__ = REFS[t].cls


def unbound(t: torch.Tensor) -> None:
    """``t`` is empty again (outside its unit): a placeholder."""
    ref = REFS.get(t)
    if ref is not None:
        hosted = hosted_class(ref.cls)
        if hosted is not None:
            t.__class__ = hosted


def is_placeholder(t: Any) -> bool:
    return type(t) in _HOSTED_CLASSES


@contextlib.contextmanager
def plain(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Placeholders among ``tensors`` are plain (empty) tensors inside the block."""
    swapped = [t for t in tensors if type(t) in _HOSTED_CLASSES]
    for t in swapped:
        t.__class__ = REFS[t].cls
    try:
        yield
    finally:
        for t in swapped:
            unbound(t)


# -- serving a torch function ----------------------------------------------------------------

_T = torch.Tensor
_C = torch._C.TensorBase


def _getters(*names: str) -> set[Any]:
    out: set[Any] = set()
    for name in names:
        for base in (_T, _C):
            attr = base.__dict__.get(name)
            if attr is None:
                continue
            for part in ("__get__", "__set__", "__delete__"):
                fn = getattr(attr, part, None)
                if fn is not None:
                    out.add(fn)
            out.add(attr)
    return out


def _methods(*names: str) -> set[Any]:
    out: set[Any] = set()
    for name in names:
        for base in (_T, _C):
            attr = base.__dict__.get(name)
            if attr is not None:
                out.add(attr)
                out.add(getattr(base, name))
    return out


# The object's own attributes: no values involved.
_PASS = (
    _getters(
        "grad",
        "_grad",
        "requires_grad",
        "is_leaf",
        "grad_fn",
        "dtype",
        "device",
        "layout",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_mkldnn",
        "is_nested",
        "is_xpu",
        "is_mps",
        "_version",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
        "retains_grad",
        "name",
        "names",
        "_base",
        "output_nr",
        "_cdata",
        "itemsize",
        "_grad_fn",
        "__dict__",
        "__class__",
    )
    | _methods(
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "retain_grad",
        "get_device",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "_has_compatible_shallow_copy_type",
        "__hash__",
        "untyped_storage",
        "data_ptr",
        "_typed_storage",
        "storage",
        "is_shared",
        "is_pinned",
        "__format__",
        "__setstate__",
        "_is_view",
        "is_inference",
    )
    | {torch._has_compatible_shallow_copy_type, torch.is_floating_point, torch.is_complex}
)

# Geometry: answered from a meta tensor of the real geometry.
_GEOMETRY = (
    _getters("shape", "ndim", "nbytes", "T", "mT", "H", "mH")
    | _methods(
        "size",
        "stride",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "__len__",
        "is_contiguous",
        "storage_offset",
        "is_non_overlapping_and_dense",
    )
    | {torch.numel}
)
_GEOMETRY -= _getters("T", "mT", "H", "mH")  # views, handled below

# Functions that may return a view of their input without reading values.
_VIEWS = _getters("data", "T", "mT", "H", "mH", "real", "imag") | _methods(
    "detach", "view", "t", "transpose", "permute", "__getitem__", "select", "narrow", "expand",
    "squeeze", "unsqueeze", "flatten", "unflatten", "reshape", "split", "chunk", "unbind",
    "diagonal", "as_strided", "movedim", "swapaxes", "swapdims", "unfold", "view_as_real",
    "contiguous", "__iter__", "tensor_split", "split_with_sizes", "expand_as", "view_as",
    "reshape_as", "to", "float", "double", "half", "bfloat16", "cpu", "cuda", "type_as",
) | {torch.t, torch.transpose, torch.permute, torch.select, torch.narrow, torch.squeeze,
     torch.unsqueeze, torch.flatten, torch.reshape, torch.split, torch.chunk, torch.unbind,
     torch.diagonal, torch.as_strided, torch.movedim, torch.swapaxes, torch.detach}  # fmt: skip

_REFUSED = _methods("numpy", "__array__", "__dlpack__", "__dlpack_device__", "share_memory_",
                    "pin_memory", "set_", "resize_", "resize_as_", "as_strided_", "t_",
                    "transpose_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_",
                    "detach_", "_coalesced_")  # fmt: skip
_SET_DATA = {d.__set__ for d in (_T.__dict__.get("data"), _C.__dict__.get("data"))
             if d is not None and hasattr(d, "__set__")}  # fmt: skip
_COPIES = _methods("__deepcopy__", "__reduce_ex__", "__reduce__")
_TYPE = _methods("type")  # with no argument it names the type; with one it converts
_DATA = _getters("data")
_DETACH = _methods("detach")


_SET_GRAD = {d.__set__ for d in (_C.__dict__.get("grad"), _C.__dict__.get("_grad"))
             if d is not None and hasattr(d, "__set__")}  # fmt: skip


def _serve(func: Any, args: tuple, kwargs: dict) -> Any:
    if func in _SET_GRAD and args[0] in REFS and isinstance(args[1], torch.Tensor):
        return _set_grad(func, args[0], args[1])
    if func in _PASS or func in _TYPE and len(args) == 1 and not kwargs:
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func in _GEOMETRY:
        return _with_meta(func, args, kwargs)
    holders = [t for t in pytree.tree_leaves((args, kwargs)) if type(t) in _HOSTED_CLASSES]
    if not all(t in REFS for t in holders):  # not a placeholder (made by ``type(p)(...)``)
        for t in holders:
            if t not in REFS:
                t.__class__ = nn.Parameter if isinstance(t, nn.Parameter) else torch.Tensor
        return _serve(func, args, kwargs)
    refs = [REFS[t] for t in holders]
    name = refs[0].name if refs else "?"
    if func in _SET_DATA:
        raise HostedError(
            f"`.data = ...` on streamed tensor {name!r} outside its unit: it would replace the "
            "tensor the engine streams. Write its values with `p.copy_(value)` under "
            "torch.no_grad(), or remove() the handle first"
        )
    if func in _REFUSED:
        raise HostedError(
            f"{_fname(func)} on streamed tensor {name!r} outside its unit: its values live in "
            "the host store and this would share or reshape memory that is not there. Use a "
            "copy (`p.detach().clone()`), or keep the tensor resident"
        )
    _check_context(name)
    if func in _COPIES:
        return _on_real_copy(func, args, kwargs)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in holders)
    if func in _VIEWS and not grad or func in _DATA or func in _DETACH:
        out = _view_without_values(func, args, kwargs)
        if out is not NotImplemented:
            return out
    return _run_on_values(func, args, kwargs, holders, refs, grad)


def _set_grad(func: Any, t: torch.Tensor, grad: Any) -> None:
    """``p.grad = g`` on a placeholder: autograd checks ``g`` against the tensor's geometry,
    which a placeholder holds only as its `Ref`'s (0 elements of its own). For the
    assignment only, the tensor takes a stand-in of the real geometry (one element, expanded:
    no values); the grad, its accumulator and its version counter are the tensor's own, as
    when ``bind`` gives it its device bytes (Note: [Binding through .data])."""
    ref = REFS[t]
    with DisableTorchFunctionSubclass():
        if grad.shape == t.shape:  # of the placeholder's own geometry (an OffloadedOptimizer's
            return func(t, grad)  # moved gradient of a streamed parameter is as empty as it)
        own = t.data
        stand_in = torch.empty((1,) * len(ref.size), dtype=ref.dtype, device=t.device)
        t.data = stand_in.expand(ref.size)
        try:
            func(t, grad)
        finally:
            t.data = own


def _fname(func: Any) -> str:
    return getattr(func, "__name__", repr(func))


def _check_context(name: str) -> None:
    if torch.compiler.is_compiling():
        raise HostedError(
            f"streamed tensor {name!r} is read outside its unit inside a compiled region: "
            "a compiler cannot see its values. Keep it resident, or read it outside the "
            "compiled function"
        )
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise HostedError(
            f"streamed tensor {name!r} is read outside its unit during a CUDA-graph capture: "
            "the graph would replay a copy made once. Keep it resident (resident=...) or use "
            "it inside the module that owns it"
        )


def _with_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    swap = {id(t): REFS[t].meta() for t in pytree.tree_leaves((args, kwargs))
            if type(t) in _HOSTED_CLASSES}  # fmt: skip
    a, k = pytree.tree_map(lambda x: swap.get(id(x), x) if isinstance(x, torch.Tensor) else x,
                           (args, kwargs))  # fmt: skip
    with DisableTorchFunctionSubclass():
        return func(*a, **k)


def _view_without_values(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view of one placeholder computed on its meta twin: placeholders of the same bytes.
    NotImplemented when it takes other tensors or returns anything that is not a view."""
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if len(tensors) != 1 or type(tensors[0]) not in _HOSTED_CLASSES:
        return NotImplemented
    src = tensors[0]
    ref = REFS[src]
    meta = ref.meta()
    a, k = pytree.tree_map(lambda x: meta if x is src else x, (args, kwargs))
    try:
        with DisableTorchFunctionSubclass():
            out = func(*a, **k)
    except Exception:
        return NotImplemented
    outs = pytree.tree_leaves(out)
    cdata = meta.untyped_storage()._cdata
    if not outs or not all(
        isinstance(o, torch.Tensor) and o.is_meta and o.untyped_storage()._cdata == cdata
        for o in outs
    ):
        return NotImplemented
    return pytree.tree_map(
        lambda o: src if o is meta else _placeholder_view(ref, src, o),
        out,
    )


def _placeholder_view(ref: Ref, src: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A new placeholder (no grad) of the bytes ``v`` views, ``v``'s geometry."""
    t = torch.empty(0, dtype=v.dtype, device=_device_of(src))
    view = Ref(ref.store, ref.key, v.storage_offset(), tuple(v.shape), v.stride(), v.dtype,
               ref.name, torch.Tensor)  # fmt: skip
    register(t, view)
    return t


def _device_of(t: torch.Tensor) -> torch.device:
    with DisableTorchFunctionSubclass():
        return t.device


def _run_on_values(func: Any, args: tuple, kwargs: dict, holders: list[torch.Tensor],
                   refs: list[Ref], grad: bool) -> Any:  # fmt: skip
    """Run ``func`` with each placeholder replaced by a device copy of its values (the pieces
    it views, read once per call); write back the pieces it wrote; map results that are (views
    of) those copies back to placeholders."""
    pieces: dict[tuple[int, Any], tuple[Ref, torch.Tensor]] = {}
    temps: dict[int, tuple[torch.Tensor, tuple[int, Any]]] = {}
    # normal tensors even under inference mode: a write there is allowed on a resident tensor
    # and must be seen (an inference tensor has no version counter)
    with torch.inference_mode(False):
        for t, ref in zip(holders, refs, strict=True):
            if id(t) in temps:
                continue
            pk = (id(ref.store), ref.key)
            if pk not in pieces:
                pieces[pk] = (ref, ref.store.read_piece(ref.key))
            piece = pieces[pk][1]
            v = torch.empty(0, dtype=ref.dtype, device=piece.device)
            v.set_(piece.untyped_storage(), ref.offset, ref.size, ref.stride)
            if t.requires_grad:
                v.requires_grad_(True)
            temps[id(t)] = (v, pk)
    # set_ gives each copy a version counter of its own: a write through any of them counts.
    before = {i: (v._version, v.shape, v.stride(), v.storage_offset(),
                  v.untyped_storage()._cdata) for i, (v, _) in temps.items()}  # fmt: skip
    a, k = pytree.tree_map(
        lambda x: temps[id(x)][0] if id(x) in temps and isinstance(x, torch.Tensor) else x,
        (args, kwargs),
    )
    with DisableTorchFunctionSubclass():
        out = func(*a, **k)
    name = refs[0].name
    declared = _declared_writes(func, a, k)
    written: dict[tuple[int, Any], list[tuple[int, int]]] = {}
    for i, (v, pk) in temps.items():
        if (v.shape, v.stride(), v.storage_offset(), v.untyped_storage()._cdata) != before[i][1:]:
            raise HostedError(
                f"{_fname(func)} changed the geometry or the storage of streamed tensor "
                f"{name!r} outside its unit; it was not applied"
            )
        if v._version != before[i][0] or id(v) in declared:
            written.setdefault(pk, []).append(_byte_range(v))
    by_temp = {id(temps[id(t)][0]): t for t in holders}
    storages = {p.untyped_storage()._cdata: pk for pk, (_, p) in pieces.items()}
    results = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    if grad and any(o.requires_grad for o in results if id(o) not in by_temp):
        raise HostedError(
            f"{_fname(func)} of streamed parameter {name!r} outside its unit with autograd "
            "recording: its gradient could not reach the parameter, whose values live in the "
            "host store. Compute it under torch.no_grad() or on p.detach(), or inside the "
            "forward of the module that owns it"
        )
    for pk, ranges in written.items():
        ref, piece = pieces[pk]
        ref.store.write_piece(ref.key, piece, ranges)
        _bump_versions(ref.store, ref.key)

    def back(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        t = by_temp.get(id(o))
        if t is not None:
            return t
        pk = storages.get(o.untyped_storage()._cdata)
        if pk is None:
            return o
        ref = pieces[pk][0]
        view = Ref(ref.store, ref.key, o.storage_offset(), tuple(o.shape), o.stride(), o.dtype,
                   ref.name, torch.Tensor)  # fmt: skip
        p = torch.empty(0, dtype=o.dtype, device=o.device)
        register(p, view)
        return p

    return pytree.tree_map(back, out)


def _declared_writes(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """The ids of the tensors ``func`` was given in arguments that its aten schema marks
    written (``Tensor(a!)``), whether or not it bumped their version counters.

    Note: [Writes that bump no version counter]
    A write through a placeholder's device copy is told by the copy's version counter
    (`_run_on_values`), but a few kernels write their arguments without bumping it: the fused
    optimizer steps (``torch._fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``,
    ``_fused_adagrad_``, which ``torch.optim.AdamW(fused=True)`` calls on the parameters).
    Told by the version only, such a step of a streamed parameter was computed and dropped:
    the parameters silently kept their old values (0.10 off after one AdamW step). So an
    argument that the function's schema declares written counts as written too (every
    overload's, by position and by name: a write-back of unchanged bytes costs a copy, never
    a value)."""
    positions, names = _schema_writes(func)
    if not positions and not names:
        return set()
    ids: set[int] = set()
    given = [x for i, x in enumerate(args) if i in positions]
    given += [x for n, x in kwargs.items() if n in names]
    for t in pytree.tree_leaves(given):
        if isinstance(t, torch.Tensor):
            ids.add(id(t))
    return ids


_SCHEMA_WRITES: dict[Any, tuple[frozenset[int], frozenset[str]]] = {}


def _schema_writes(func: Any) -> tuple[frozenset[int], frozenset[str]]:
    """Positions and names of the arguments written by ``func`` (an OpOverload, a packet, or a
    torch function or method named after an in-place aten op); none where it has no schema."""
    found = _SCHEMA_WRITES.get(func)
    if found is not None:
        return found
    schemas = []
    if isinstance(func, torch._ops.OpOverload):
        schemas = [func._schema]
    else:
        name = getattr(func, "__name__", "")
        packet = func if isinstance(func, torch._ops.OpOverloadPacket) else None
        if packet is None and name.endswith("_") and not name.startswith("__"):
            packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            schemas = [getattr(packet, o)._schema for o in packet.overloads()]
    args = [(i, a.name) for s in schemas for i, a in enumerate(s.arguments)
            if a.alias_info is not None and a.alias_info.is_write]  # fmt: skip
    found = (frozenset(i for i, _ in args), frozenset(n for _, n in args))
    _SCHEMA_WRITES[func] = found
    return found


def _byte_range(v: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``v`` spans: [start, end)."""
    item = v.element_size()
    extent = 1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True))
    start = v.storage_offset() * item
    return start, start + (extent * item if v.numel() else 0)


def _bump_versions(store: HostStore, key: Any) -> None:
    """Bump the version counter of every placeholder of these bytes, as the in-place write
    would have on the device tensor (autograd then refuses a stale saved tensor)."""
    for t, ref in list(REFS.items()):
        if ref.store is store and ref.key == key and type(t) in _HOSTED_CLASSES:
            with DisableTorchFunctionSubclass(), torch.no_grad():
                torch.Tensor.zero_(t)  # empty: no bytes written, the counter bumped


def fill(t: torch.Tensor, read: Callable[[torch.Tensor], None]) -> None:
    """Write placeholder ``t``'s values in place in its host store, from elsewhere (a
    checkpoint: Note: [Checkpoint entries of tensors another engine hosts] in
    weights/_store.py). ``read`` fills the bytes of ``t``'s piece, a host uint8 tensor, handed
    out by the store's ``fill_piece(key, read)`` (a store without one cannot be filled:
    `fillable`); then ``t``'s placeholders count the write, as after a write back."""
    ref = REFS[t]
    ref.store.fill_piece(ref.key, read)  # type: ignore[attr-defined]
    _bump_versions(ref.store, ref.key)


def fillable(t: torch.Tensor) -> bool:
    """`fill` can write ``t``: its store hands out pieces and ``t`` is one whole piece."""
    ref = REFS.get(t)
    return ref is not None and hasattr(ref.store, "fill_piece") and ref.offset == 0


def _on_real_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """``copy.deepcopy`` / pickling of a placeholder: of a plain tensor with its values."""
    t = args[0]
    ref = REFS[t]
    piece = ref.store.read_piece(ref.key)
    v = torch.empty(0, dtype=ref.dtype, device=piece.device)
    v.set_(piece.untyped_storage(), ref.offset, ref.size, ref.stride)
    v = v.clone()
    real = nn.Parameter(v, requires_grad=t.requires_grad) if ref.cls is nn.Parameter else v
    with DisableTorchFunctionSubclass():
        return func(real, *args[1:], **kwargs)


def no_copy_message(engine: str) -> str:
    return (
        f"cannot copy or pickle a model while {engine} is active: its streamed tensors live in "
        "the handle's host store, not in the model. Save model.state_dict() (it holds the real "
        "values), or call the handle's remove() before copy.deepcopy / torch.save(model)"
    )


# -- conversions of the model -----------------------------------------------------------------


class ConversionGuard:
    """An instance attribute ``_apply`` of a module that holds hosted tensors (in its subtree):
    `Module.to`, ``.half()``, ``.cpu()``... call it, and it refuses a conversion that would
    change a hosted tensor before any tensor is converted. See Note: [Placeholders never
    answer]."""

    def __init__(self, module: nn.Module, engine: str, no_copy: str):
        self.module = weakref.ref(module)
        self.engine = engine
        self.no_copy = no_copy

    def __call__(self, fn: Callable, recurse: bool = True) -> nn.Module:
        module = self.module()
        assert module is not None
        hosted = [t for t in _tensors(module, recurse) if t in REFS]
        for t in hosted:
            ref = REFS[t]
            probe = torch.empty(0, dtype=ref.dtype, device=_device_of(t))
            shared = probe.is_shared()
            out = fn(probe)
            if probe.is_shared() != shared:
                raise HostedError(
                    f"model.share_memory() while {self.engine} is active: streamed tensor "
                    f"{ref.name!r} has its values in the handle's host store, not in memory "
                    "another process could share (a process would see a copy, its writes "
                    "lost). Nothing was changed. Call the handle's remove() first"
                )
            same = (ref.dtype, probe.device)
            if isinstance(out, torch.Tensor) and (out.dtype, out.device) != same:
                raise HostedError(
                    f"streamed tensor {ref.name!r} would be converted from {ref.dtype} on "
                    f"{probe.device} to {out.dtype} on {out.device} (model.to(), .half(), "
                    f".float(), .cpu()...) while {self.engine} is active: its values live in "
                    "the host store. Nothing was converted. Call the handle's remove() first "
                    "(it restores the original dtype and device), convert, then stream again"
                )
        if hosted and torch.__future__.get_swap_module_params_on_conversion():
            raise HostedError(
                "a conversion of the model (model.to(), .float(), .cpu()...) under "
                "torch.__future__.set_swap_module_params_on_conversion(True) swaps every "
                f"tensor for a new one (torch.utils.swap_tensors), streamed tensor "
                f"{REFS[hosted[0]].name!r} too, while {self.engine} is active: the engine "
                "streams that tensor object. Nothing was converted. This conversion changes "
                "no streamed tensor: run it with set_swap_module_params_on_conversion(False), "
                "or call the handle's remove() first"
            )
        with plain(hosted):
            return type(module)._apply(module, fn, recurse)

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(self.no_copy)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(self.no_copy)


def _tensors(module: nn.Module, recurse: bool) -> list[torch.Tensor]:
    mods = module.modules() if recurse else [module]
    out: dict[int, torch.Tensor] = {}
    for m in mods:
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                out[id(t)] = t
    return list(out.values())


def guard_conversions(model: nn.Module, engine: str, no_copy: str) -> list[Any]:
    """Install a `ConversionGuard` on every module of ``model`` whose subtree holds a hosted
    tensor; returns handles whose ``remove()`` takes them away."""
    handles = []
    for m in model.modules():
        if "_apply" in m.__dict__:
            continue
        if any(t in REFS for t in _tensors(m, True)):
            m.__dict__["_apply"] = ConversionGuard(m, engine, no_copy)
            handles.append(_Unguard(m))
    return handles


class _Unguard:
    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)

    def remove(self) -> None:
        m = self.module()
        if m is not None and isinstance(m.__dict__.get("_apply"), ConversionGuard):
            del m.__dict__["_apply"]


# -- load_state_dict(assign=True) ---------------------------------------------------------------


def refuse_assign(
    model: nn.Module,
    names: list[str],
    engine: str,
    what: str,
    no_copy: str,
    live: Callable[[], bool] | None = None,
) -> list[Any]:
    """Refuse ``load_state_dict(assign=True)`` before any tensor is assigned, on ``model`` and on
    every submodule above a streamed tensor (``names``: their qualified names in ``model``),
    where the state dict holds a streamed tensor's key: each such module checks before its own
    tensors and its children load (the root first). An error appended to load_state_dict's
    list is raised only after every module has loaded, the tensors replaced by then, so this
    raises. Returns the hooks' handles. ``live``: where given, a load passes once it answers
    false (the engine removed, its hooks not yet)."""
    hooks = []
    for q, module in model.named_modules():
        rels = names if not q else [n[len(q) + 1 :] for n in names if n.startswith(q + ".")]
        if rels:
            refusal = AssignRefusal(rels, engine, what, no_copy, live)
            hooks.append(module.register_load_state_dict_pre_hook(refusal))
    return hooks


class AssignRefusal:
    """A load_state_dict pre-hook of `refuse_assign`. Copying or pickling it (a deepcopy or
    torch.save of the model) raises with the cause and the fix."""

    def __init__(
        self,
        names: list[str],
        engine: str,
        what: str,
        no_copy: str,
        live: Callable[[], bool] | None = None,
    ):
        self.names = names  # the streamed tensors' names relative to the hook's module
        self.message = (
            f"load_state_dict(assign=True) would replace {what}; load without assign while "
            f"{engine} is active, or call the handle's remove() first. Nothing was loaded"
        )
        self.live = live
        self.no_copy = no_copy

    def __call__(self, module: nn.Module, state_dict: Any, prefix: str, meta: Any,
                 *args: Any) -> None:  # fmt: skip
        if not meta.get("assign_to_params_buffers", False):
            return
        if self.live is not None and not self.live():
            return
        if any(prefix + n in state_dict for n in self.names):
            raise RuntimeError(self.message)

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(self.no_copy)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(self.no_copy)
