"""What a streamed program was exported for, checked per call (`torchoffload.compile._inputs`,
Note: [Checking a package's inputs]), on exported programs without compiling them: static,
shared, derived and unbounded dims, constants, keyword inputs in any order, the catalog form."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchoffload.compile._inputs import CallForm, InputCheck, InputSpec, call_form, input_specs


class _Concat(nn.Module):
    def forward(self, x, y, n, *, scale, mask):
        return torch.cat([x, x]) * n + y + scale * mask.sum()


def _check():
    b = torch.export.Dim("b", min=1)  # no max
    ep = torch.export.export(
        _Concat(), (torch.randn(3, 4), torch.randn(6, 4), 2),
        {"scale": torch.ones(4), "mask": torch.ones(3)},
        dynamic_shapes={"x": {0: b}, "y": {0: 2 * b}, "n": None, "scale": None, "mask": {0: b}},
    )  # fmt: skip
    inputs, dims = input_specs(ep)
    return InputCheck(inputs, dims), inputs, dims


def test_every_dim_kind_is_checked():
    check, inputs, dims = _check()
    assert [i.name for i in inputs] == ["x", "y", "n", "scale", "mask"]
    assert [i.where for i in inputs] == ["args[0]", "args[1]", "args[2]", "kwargs['scale']",
                                         "kwargs['mask']"]  # fmt: skip
    sym = inputs[0].shape[0]
    assert dims[sym] == (1, None) and inputs[1].shape == (f"2*{sym}", 4)
    one = torch.ones(4)
    for b in (1, 5, 100):  # unbounded; the keyword inputs in either order
        check((torch.randn(b, 4), torch.randn(2 * b, 4), 2), {"mask": torch.ones(b), "scale": one})
    cases = [
        (
            (torch.randn(5, 4), torch.randn(9, 4), 2),
            rf"'y' \(args\[1\]\) has shape \[9, 4\], .*\(2\*{sym} = 10 here\)",
        ),
        ((torch.randn(5, 3), torch.randn(10, 3), 2), r"'x' \(args\[0\]\) has shape \[5, 3\]"),
        ((torch.randn(0, 4), torch.randn(0, 4), 2), rf"\[0, 4\], .*with 1 <= {sym}:"),
        ((torch.randn(5, 4), torch.randn(10, 4), 3), r"'n' \(args\[2\]\) is 3, but .* for 2"),
        ((torch.randn(5, 4), torch.randn(10, 4), 2.0), r"'n' \(args\[2\]\) is 2.0, but"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            check(args, {"scale": one, "mask": torch.ones(args[0].shape[0])})
    with pytest.raises(ValueError, match=rf"'mask' \(kwargs\['mask'\]\) .* {sym} is 5 in 'x'"):
        check((torch.randn(5, 4), torch.randn(10, 4), 2), {"scale": one, "mask": torch.ones(4)})
    with pytest.raises(ValueError, match=r"'scale' \(kwargs\['scale'\]\) is missing or not a"):
        check((torch.randn(5, 4), torch.randn(10, 4), 2), {"mask": torch.ones(5)})


def test_the_catalog_form_round_trips_and_refuses_what_it_cannot_read():
    _, inputs, _ = _check()
    assert tuple(InputSpec.from_obj(i.to_obj()) for i in inputs) == inputs
    for bad, message in (
        ({"path": "[0][0]"}, "with a path and a name"),
        ({"path": "[0][0]", "name": "x", "value": [1]}, "a constant must be a JSON scalar"),
        ({"path": "[0][0]", "name": "x", "dtype": "nope", "device": "cpu", "shape": []},
         "must name a dtype"),
        ({"path": "[0][0]", "name": "x", "dtype": "float32", "device": "cpu", "shape": [1.5]},
         "shape must be a list of ints and strings"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            InputSpec.from_obj(bad)


class _Scaled(nn.Module):
    def forward(self, x, scale: float = 2.0):
        return x * scale


def test_a_constant_left_out_of_the_call_is_refused():
    """Exported with ``scale=3.0`` and called without it, a package ran with 3.0 where the model
    gives ``x * 2.0`` (its default): the fast path checked the tensors only, and the full one
    never visited a constant the call does not hold."""
    ep = torch.export.export(_Scaled(), (torch.randn(2, 3), 3.0))
    check = InputCheck(*input_specs(ep))
    check((torch.randn(2, 3), 3.0), {})
    with pytest.raises(ValueError, match=r"'scale' \(args\[1\]\) is missing, but .* 3.0"):
        check((torch.randn(2, 3),), {})


class _Pointwise(nn.Module):
    def forward(self, x, y):
        return x * 2 + y.sum()


def test_an_input_laid_out_otherwise_than_exported_is_refused():
    """An AOTInductor kernel indexes an input with the strides it was exported with and checks
    none of them: a transposed or sliced input of the right shape gave other values (max diff
    4.05 on a 4 x 8 input, CPU). Dims of size 1 take any stride; a dynamic stride is checked
    once its symbols are bound; ``strides=False`` (a `torch.compile`d program, whose guards
    recompile for another layout) checks none."""
    b = torch.export.Dim("b", min=1, max=16)
    ep = torch.export.export(_Pointwise(), (torch.randn(4, 8), torch.randn(3, 4, 5)),
                             dynamic_shapes=({0: b}, {1: b}))  # fmt: skip
    inputs, dims = input_specs(ep)
    check = InputCheck(inputs, dims)
    x, y = torch.randn(4, 8), torch.randn(3, 4, 5)
    check((x, y), {})
    check((torch.randn(8, 1).t(), torch.randn(3, 1, 5)), {})  # size-1 dims: any stride
    check((torch.randn(9, 8)[2:6], y), {})  # an offset: kernels start at the data pointer
    cases = [
        ((torch.randn(8, 4).t(), y), r"'x' \(args\[0\]\) has strides \[1, 4\], but .* \[8, 1\]"),
        ((torch.randn(4, 16)[:, ::2], y), r"'x' \(args\[0\]\) has strides \[16, 2\]"),
        ((x, torch.randn(5, 4, 3).transpose(0, 2)), r"'y' \(args\[1\]\) has strides \[1, 3, 12\]"),
        ((torch.randn(6, 10)[:, :8], torch.randn(3, 6, 5)), r"'x' .* strides \[10, 1\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message + ".*contiguous"):
            check(args, {})
        InputCheck(inputs, dims, strides=False)(args, {})
    assert tuple(InputSpec.from_obj(i.to_obj()) for i in inputs) == inputs


def _bound(form, check, args, kwargs):
    """A call as `StreamedPackage` runs it: bound to the exported form, then checked."""
    args, kwargs = form.bind(args, kwargs)
    check(args, kwargs)
    form.check_complete(args, kwargs)
    return args, kwargs


def test_a_call_is_bound_to_the_exported_form_by_name():
    """Note: [Checking a package's inputs], keywords: a constant (or tensor) exported by
    position and passed by keyword was refused as missing (``program(x, scale=3.0)``), and a
    keyword the program lacks reached AOTInductor's loader ("kwarg keyword mismatch"). Bound
    as Python binds a call, they run; what Python refuses is a ``TypeError``."""
    x = torch.randn(2, 3)
    form = call_form(_Scaled(), (x, 3.0), None)
    assert form == CallForm(2, (), ("x", "scale"))
    assert CallForm.from_obj(form.to_obj()) == form
    check = InputCheck(*input_specs(torch.export.export(_Scaled(), (x, 3.0))))
    for args, kwargs in (((x, 3.0), {}), ((x,), {"scale": 3.0}), ((), {"scale": 3.0, "x": x})):
        got = _bound(form, check, args, kwargs)
        assert got[0] == (x, 3.0) and got[1] == {}, (args, kwargs)
    with pytest.raises(ValueError, match=r"'scale' \(args\[1\]\) is 4.0, but"):
        _bound(form, check, (x,), {"scale": 4.0})
    with pytest.raises(TypeError, match="multiple values for argument 'scale'"):
        _bound(form, check, (x, 3.0), {"scale": 3.0})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bias' .*\(x, scale\)"):
        _bound(form, check, (x, 3.0), {"bias": 1.0})
    with pytest.raises(TypeError, match=r"exported with 2 positional arguments .* 3 were"):
        _bound(form, check, (x, 3.0, 1.0), {})
    with pytest.raises(ValueError, match=r"'scale' \(args\[1\]\) is missing"):
        _bound(form, check, (), {"x": x})  # x moves to its place; scale is still missing

    # Exported by keyword, passed by position; keyword-only inputs stay keywords.
    m, y, mask = _Concat(), torch.randn(6, 4), torch.ones(3)
    kw = {"scale": torch.ones(4), "mask": mask}
    form = call_form(m, (x, y), {"n": 2, **kw})
    ep = torch.export.export(m, (torch.randn(3, 4), y), {"n": 2, **kw})
    check = InputCheck(*input_specs(ep))
    x = torch.randn(3, 4)
    args, kwargs = _bound(form, check, (x, y, 2), kw)
    assert args == (x, y) and kwargs == {"n": 2, **kw}
    with pytest.raises(TypeError, match=r"exported with 2 positional arguments \(x, y\)"):
        _bound(form, check, (x, y, 2, kw["scale"]), {"mask": mask})


def test_a_call_missing_a_constant_the_check_does_not_know_is_refused():
    """A constant that `InputCheck` does not record (not a JSON scalar) and that the call
    leaves out: AOTInductor's runner drops non-tensors, so the program would run with the
    exported value where the model takes its default."""
    form = CallForm(2, ("dtype",), ("x", "mode"))
    form.check_complete((1, 2), {"dtype": torch.float32})
    with pytest.raises(ValueError, match=r"argument mode \(args\[1\]\) is missing"):
        form.check_complete((1,), {"dtype": torch.float32})
    with pytest.raises(ValueError, match=r"argument dtype \(kwargs\['dtype'\]\) is missing"):
        form.check_complete((1, 2), {})
    with pytest.raises(ValueError, match="call must be an object"):
        CallForm.from_obj({"args": 1, "kwargs": [1], "names": []})
