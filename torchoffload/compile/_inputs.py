"""The inputs a streamed program was exported for, checked before every call.

Note: [Checking a package's inputs]
An AOTInductor package runs the kernels it was compiled for and checks no input: called with
another shape than it was exported for, a streamed package returned a silently partial result
(a larger batch) or aborted the process (a smaller one, rc -6; issue 38). So `export_streamed`
records, from the exported program's input specs and range constraints, what each user input
must be (`InputSpec`): its place in ``(args, kwargs)`` as a pytree key path, and for a tensor
its dtype, device type, dims and strides, each an int, a symbol within its range (dims that
share a symbol are equal) or an expression of symbols; a non-tensor input is a constant the
program was specialized to, and must be passed (left out, the model would take its default,
the program the exported value). `StreamedPackage` checks every call against them before it
starts the call: tensor metadata only (shape, strides, dtype, device), so no host sync and
nothing to undo; a ``ValueError`` names the argument and what it accepts. The common call,
tensors by position only, is checked without flattening ``(args, kwargs)`` (4 us against 21 us
per call, CPU). An argument the program does not take is left to the program (AOTInductor's
runner refuses a tensor it does not take).

Keywords: AOTInductor's runner takes the keywords the program was exported with and flattens
the rest by position, and `InputCheck` knows each input by its place in ``(args, kwargs)``. A
call that passed by keyword what the export passed by position (``program(x, scale=3.0)`` for
an export with ``(x, 3.0)``), or the other way round, was refused as missing an argument it
had, or failed inside AOTInductor's loader ("Ran into a kwarg keyword mismatch"). So the
export also records the call's form (`CallForm`: how many positional arguments, which
keywords, and the forward's positional parameter names), and each call is first bound to that
form as Python binds a call to a signature: by name where the forward's signature allows it,
with Python's ``TypeError`` for a value given twice or a keyword the program does not take.
Then it is checked; a call that still lacks an argument is refused (a constant the check does
not know, left out, would run with the exported value).

Strides: an AOTInductor kernel indexes an input with the strides of the exported program's
input (it checks them only under ``AOTI_RUNTIME_CHECK_INPUTS=1``), so a transposed or sliced
input of the right shape was read as if laid out the exported way: other values, silently (max
diff 4.05 on a 4 x 8 input, CPU). A dim of size 1 is never stepped over, so its stride is not
checked; nor is the storage offset (kernels start at the data pointer). A `torch.compile`d
program (`compile_streamed`) checks none (``strides=False``): its guards recompile for another
layout.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["CallForm", "InputCheck", "InputSpec", "call_form", "input_specs"]

_CONSTANT_TYPES = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class InputSpec:
    """One user input of an exported program: ``path`` is its pytree key path in ``(args,
    kwargs)``, ``name`` the program's name for it. A tensor has a ``dtype``, ``device_type``
    and ``shape`` and ``stride`` (each an int or a symbol expression, a plain name such as
    ``"s31"`` for a dynamic dim); a constant has ``dtype`` None and its ``value``."""

    path: str
    name: str
    dtype: torch.dtype | None
    device_type: str | None = None
    shape: tuple[int | str, ...] = ()
    value: Any = None
    stride: tuple[int | str, ...] = ()

    @property
    def where(self) -> str:
        """``args[0]`` or ``kwargs['mask']``."""
        head, rest = self.path[:3], self.path[3:]
        return ("args" if head == "[0]" else "kwargs" if head == "[1]" else "") + rest

    def to_obj(self) -> dict[str, Any]:
        if self.dtype is None:
            return {"path": self.path, "name": self.name, "value": self.value}
        return {"path": self.path, "name": self.name, "dtype": str(self.dtype).split(".")[-1],
                "device": self.device_type, "shape": list(self.shape),
                "stride": list(self.stride)}  # fmt: skip

    @classmethod
    def from_obj(cls, d: object) -> InputSpec:
        if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("path", "name")):
            raise ValueError("an input must be an object with a path and a name")
        if "dtype" not in d:
            if not isinstance(d.get("value"), _CONSTANT_TYPES):
                raise ValueError(f"input {d['name']!r}: a constant must be a JSON scalar")
            return cls(d["path"], d["name"], None, value=d["value"])
        dtype = getattr(torch, str(d["dtype"]), None)
        shape, stride = d.get("shape"), d.get("stride")
        if not isinstance(dtype, torch.dtype) or not isinstance(d.get("device"), str):
            raise ValueError(
                f"input {d['name']!r}: dtype and device must name a dtype and a device"
            )
        for what, dims in (("shape", shape), ("stride", stride)):
            if not isinstance(dims, list) or not all(
                isinstance(v, (int, str)) and not isinstance(v, bool) for v in dims
            ):
                raise ValueError(f"input {d['name']!r}: {what} must be a list of ints and strings")
        if len(stride) != len(shape):
            raise ValueError(f"input {d['name']!r}: stride and shape differ in length")
        return cls(d["path"], d["name"], dtype, d["device"], tuple(shape), stride=tuple(stride))


def input_specs(
    ep: torch.export.ExportedProgram,
) -> tuple[tuple[InputSpec, ...], dict[str, tuple[int, int | None]]]:
    """The `InputSpec` of each user input of ``ep`` and the range of each symbol its dims use
    (``(min, max)``, max None when unbounded)."""
    spec = ep.call_spec.in_spec
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten([0] * spec.num_leaves, spec))[0]]  # fmt: skip
    users = [s for s in ep.graph_signature.input_specs
             if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]  # fmt: skip
    if len(users) != len(paths):
        raise RuntimeError(
            f"internal error: the exported program has {len(users)} user inputs and its input "
            f"spec {len(paths)} leaves"
        )
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for path, s in zip(paths, users, strict=True):
        arg = s.arg
        val = vals.get(getattr(arg, "name", None))
        if isinstance(arg, torch.export.graph_signature.ConstantArgument):
            if isinstance(arg.value, _CONSTANT_TYPES):  # another constant: not checked here
                out.append(InputSpec(path, arg.name, None, value=arg.value))
        elif isinstance(val, torch.Tensor):
            shape = tuple(d if isinstance(d, int) else _dim(d) for d in val.shape)
            stride = tuple(d if isinstance(d, int) else _dim(d) for d in val.stride())
            out.append(InputSpec(path, arg.name, val.dtype, val.device.type, shape,
                                 stride=stride))  # fmt: skip
        # a symbolic int or an opaque object: not checked here
    ranges: dict[str, tuple[int, int | None]] = {}
    for sym, vr in ep.range_constraints.items():
        lower = int(vr.lower) if vr.lower.is_Integer else 0
        ranges[str(sym)] = (lower, int(vr.upper) if vr.upper.is_Integer else None)  # None: oo
    return tuple(out), ranges


@dataclass(frozen=True)
class CallForm:
    """How a program was called at export: ``args`` positional arguments and the keywords
    ``kwargs``; ``names[i]`` is the name of the forward's ``i``-th positional parameter ("" for
    one that cannot be passed by keyword). Note: [Checking a package's inputs]."""

    args: int
    kwargs: tuple[str, ...]
    names: tuple[str, ...] = ()

    def to_obj(self) -> dict[str, Any]:
        return {"args": self.args, "kwargs": list(self.kwargs), "names": list(self.names)}

    @classmethod
    def from_obj(cls, d: object) -> CallForm:
        ok = isinstance(d, dict) and isinstance(d.get("args"), int) and d["args"] >= 0
        lists = [d.get(k) for k in ("kwargs", "names")] if ok else []  # type: ignore[union-attr]
        if not ok or not all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                             for v in lists):  # fmt: skip
            raise ValueError("call must be an object of args (an int), kwargs and names (strings)")
        return cls(d["args"], tuple(lists[0]), tuple(lists[1]))  # type: ignore[index]

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` in the exported form: a positional argument the export passed by
        keyword becomes that keyword, and a keyword the export passed by position moves there.
        ``TypeError`` as Python's for a value given twice or a keyword the program lacks."""
        n, exported = self.args, self.kwargs
        if len(args) == n and (not kwargs if not exported else kwargs.keys() == set(exported)):
            return args, kwargs
        args, kwargs = list(args), dict(kwargs)
        for i in range(n, len(args)):
            name = self._name(i)
            if name not in exported:
                raise TypeError(
                    f"this program was exported with {n} positional arguments "
                    f"({self._listed(range(n))}) and keywords ({', '.join(exported)}); "
                    f"{len(args)} were given"
                )
            if name in kwargs:
                raise TypeError(f"got multiple values for argument {name!r}")
            kwargs[name] = args[i]
        del args[n:]
        while len(args) < n and self._name(len(args)) in kwargs:
            args.append(kwargs.pop(self._name(len(args))))
        for name in kwargs:
            if name in exported:
                continue
            if name in self.names[: len(args)]:
                raise TypeError(f"got multiple values for argument {name!r}")
            if name not in self.names[:n]:
                raise TypeError(
                    f"got an unexpected keyword argument {name!r} (this program was exported "
                    f"with positional arguments ({self._listed(range(n))}) and keywords "
                    f"({', '.join(exported)}))"
                )
        return tuple(args), kwargs

    def check_complete(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """A bound call that still lacks an argument: ``ValueError`` (`InputCheck` names those
        it knows first; this catches the rest)."""
        missing = [f"{self._name(i) or i} (args[{i}])" for i in range(len(args), self.args)]
        missing += [f"{k} (kwargs[{k!r}])" for k in self.kwargs if k not in kwargs]
        if missing:
            raise ValueError(
                f"argument {missing[0]} is missing, but this program was exported with it (a "
                "non-tensor input is a constant of the program: pass it)"
            )

    def _name(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else ""

    def _listed(self, positions: range) -> str:
        return ", ".join(self._name(i) or f"args[{i}]" for i in positions)


def call_form(model: Any, args: tuple, kwargs: dict[str, Any] | None) -> CallForm:
    """The `CallForm` of ``model(*args, **kwargs)`` (no names where the forward's signature
    cannot be read)."""
    names: list[str] = []
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind == p.POSITIONAL_ONLY:
            names.append("")
        elif p.kind == p.POSITIONAL_OR_KEYWORD:
            names.append(p.name)
        else:
            break
    return CallForm(len(args), tuple(kwargs or ()), tuple(names))


def _dim(d: torch.SymInt) -> int | str:
    expr = d.node.expr
    return int(expr) if expr.is_Integer else str(expr)


class InputCheck:
    """Checks a call's ``(args, kwargs)`` against `InputSpec`s (Note: [Checking a package's
    inputs])."""

    def __init__(self, inputs: Sequence[InputSpec], dims: dict[str, tuple[int, int | None]],
                 *, strides: bool = True):  # fmt: skip
        import sympy

        self.inputs = {spec.path: spec for spec in inputs}
        self._tensors = sum(spec.dtype is not None for spec in inputs)
        self._constants = len(self.inputs) - self._tensors
        # the common call, tensors by position only, without flattening: spec of args[i]
        self._positional = [self.inputs.get(f"[0][{i}]") for i in range(len(inputs))]
        self.dims = dict(dims)
        self._strides = strides
        # dims and strides that are neither an int nor a symbol: checked once the symbols are
        # bound
        self._exprs = {d: sympy.sympify(d) for spec in inputs for d in (*spec.shape, *spec.stride)
                       if isinstance(d, str) and not d.isidentifier()}  # fmt: skip

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Raise a ``ValueError`` for the first input the program was not exported for."""
        if not kwargs and len(args) == self._tensors and not self._constants:
            specs = self._positional[: len(args)]
            if all(type(x) is torch.Tensor for x in args) and None not in specs:
                self._check(zip(specs, args, strict=True))
                return
        leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
        self._check(((self.inputs.get(pytree.keystr(p)), x) for p, x in leaves), leaves)

    def _check(self, pairs: Any, leaves: list[tuple[Any, Any]] | None = None) -> None:
        bound: dict[str, tuple[int, InputSpec]] = {}
        later: list[tuple[InputSpec, torch.Tensor]] = []
        strided: list[tuple[InputSpec, torch.Tensor]] = []
        found = constants = 0
        for spec, x in pairs:
            if spec is None:
                continue
            if spec.dtype is None:
                constants += 1
                if type(x) is not type(spec.value) or x != spec.value:
                    raise ValueError(
                        f"argument {spec.name!r} ({spec.where}) is {x!r}, but this program was "
                        f"exported for {spec.value!r} (a non-tensor input is a constant of the "
                        "program: export it again for another value)"
                    )
                continue
            if not isinstance(x, torch.Tensor):
                raise ValueError(
                    f"argument {spec.name!r} ({spec.where}) is a {type(x).__name__}, but this "
                    f"program was exported for a tensor of shape {self._allowed(spec)}"
                )
            found += 1
            if x.dtype != spec.dtype or x.device.type != spec.device_type:
                raise ValueError(
                    f"argument {spec.name!r} ({spec.where}) is {x.dtype} on {x.device.type}, but "
                    f"this program was exported for {spec.dtype} on {spec.device_type}"
                )
            if x.dim() != len(spec.shape):
                self._refuse(spec, x)
            if self._strides and spec.stride:
                strided.append((spec, x))  # checked once every symbol is bound
            for size, want in zip(x.shape, spec.shape, strict=True):
                if isinstance(want, int):
                    if size != want:
                        self._refuse(spec, x)
                elif want in self._exprs:
                    if not later or later[-1][1] is not x:
                        later.append((spec, x))
                else:
                    low, high = self.dims.get(want, (0, None))
                    if size < low or (high is not None and size > high):
                        self._refuse(spec, x)
                    seen = bound.setdefault(want, (size, spec))
                    if seen[0] != size:
                        self._refuse(spec, x, f", and {want} is {seen[0]} in {seen[1].name!r}")
        if found != self._tensors:  # one is missing, or a container stands in its place
            paths = {pytree.keystr(path) for path, _ in leaves or ()}
            spec = next(
                s for s in self.inputs.values() if s.dtype is not None and s.path not in paths
            )
            raise ValueError(
                f"argument {spec.name!r} ({spec.where}) is missing or not a tensor, but this "
                f"program was exported for a tensor of shape {self._allowed(spec)}"
            )
        if constants != self._constants:
            paths = {pytree.keystr(path) for path, _ in leaves or ()}
            spec = next(s for s in self.inputs.values() if s.dtype is None and s.path not in paths)
            raise ValueError(
                f"argument {spec.name!r} ({spec.where}) is missing, but this program was exported "
                f"for {spec.value!r} (a non-tensor input is a constant of the program: pass it)"
            )
        values = {s: v for s, (v, _) in bound.items()}
        for spec, x in later:
            for size, want in zip(x.shape, spec.shape, strict=True):
                value = self._value(want, values) if want in self._exprs else None
                if value is not None and size != value:
                    self._refuse(spec, x, f" ({want} = {value} here)")
        for spec, x in strided:
            for size, step, want in zip(x.shape, x.stride(), spec.stride, strict=True):
                value = self._value(want, values)
                if size > 1 and value is not None and step != value:
                    self._refuse_layout(spec, x, values)

    def _value(self, want: int | str, values: dict[str, int]) -> int | None:
        """A dim or stride of an `InputSpec` with the call's symbols ``values``; None where one
        it needs is not bound."""
        if isinstance(want, int):
            return want
        if want in values:
            return values[want]
        expr = self._exprs.get(want)
        if expr is None or not {str(s) for s in expr.free_symbols} <= values.keys():
            return None
        return int(expr.subs(values))

    def _refuse_layout(self, spec: InputSpec, x: torch.Tensor, values: dict[str, int]) -> None:
        want = [self._value(d, values) for d in spec.stride]
        raise ValueError(
            f"argument {spec.name!r} ({spec.where}) has strides {list(x.stride())}, but this "
            f"program was exported for strides {want} at shape {list(x.shape)} (its compiled "
            "kernels index the input that way): pass a tensor laid out so, e.g. "
            f"{spec.name}.contiguous() for an input exported contiguous"
        )

    def _allowed(self, spec: InputSpec) -> str:
        shape = "[" + ", ".join(str(d) for d in spec.shape) + "]"
        syms = sorted({d for d in spec.shape if isinstance(d, str) and d in self.dims})
        ranges = []
        for s in syms:
            low, high = self.dims[s]
            ranges.append(f"{low} <= {s}" + (f" <= {high}" if high is not None else ""))
        return shape + (" with " + ", ".join(ranges) if ranges else "")

    def _refuse(self, spec: InputSpec, x: torch.Tensor, why: str = "") -> None:
        raise ValueError(
            f"argument {spec.name!r} ({spec.where}) has shape {list(x.shape)}, but this program "
            f"was exported for shape {self._allowed(spec)}{why}: export it again for this "
            "shape, or with dynamic_shapes= covering it"
        )
