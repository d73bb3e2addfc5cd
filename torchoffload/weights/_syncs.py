"""What a CUDA-graph capture forbids, seen on the CPU: reading a tensor's value on the host.

Note: [Host reads in a captured call]
A capture records work on the GPU; it cannot give the host a value the GPU has not computed
yet. So ``.item()``, ``.tolist()``, ``bool(t)`` (an ``if`` on a tensor), ``int(t)``, printing,
``torch.equal`` and ops whose output size depends on values (``nonzero``, ``unique``,
``masked_select``) fail inside `handle.cuda_graph`'s capture on the GPU ("operation not
permitted when stream is capturing"). On the CPU there is no capture, and the same function
ran: a CPU test passed what the GPU refuses. So the CPU's stand-in for a capture (the second
call of a signature, where the GPU captures) runs the function under `HostReadCheck`, a torch
function mode that raises `HostReadInCapture` at the first such read, naming it and the way
out. Only the capture is checked, as on the GPU: the first call of a signature (the eager
warm-up) may read values, and replays run what was captured. Not checked: a function compiled
with `torch.compile`, which Dynamo would compile again for the mode's sake (its guards see the
mode stack); its host reads are graph breaks that the GPU refuses the same way. Not seen: host
reads that bypass torch functions (a C++ extension's own sync).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReadCheck", "HostReadInCapture", "is_compiled"]


class HostReadInCapture(RuntimeError):
    """A graphed function read a tensor's value on the host where the GPU would capture it."""


def _names() -> dict[Any, str]:
    t = torch.Tensor
    reads = {
        t.item: "Tensor.item()",
        t.tolist: "Tensor.tolist()",
        t.numpy: "Tensor.numpy()",
        t.__bool__: "bool(tensor) (an `if` or `and` on a tensor)",
        t.__int__: "int(tensor)",
        t.__float__: "float(tensor)",
        t.__index__: "a tensor used as a Python int (range, slicing)",
        t.__complex__: "complex(tensor)",
        t.__repr__: "printing a tensor",
        t.__format__: "formatting a tensor",
        t.__array__: "numpy.asarray(tensor)",
        torch.equal: "torch.equal (a Python bool)",
        torch.allclose: "torch.allclose (a Python bool)",
        torch.is_nonzero: "torch.is_nonzero",
        torch.nonzero: "torch.nonzero (its size depends on values)",
        t.nonzero: "Tensor.nonzero() (its size depends on values)",
        torch.unique: "torch.unique (its size depends on values)",
        t.unique: "Tensor.unique() (its size depends on values)",
        torch.masked_select: "torch.masked_select (its size depends on values)",
        t.masked_select: "Tensor.masked_select() (its size depends on values)",
    }
    return {k: v for k, v in reads.items() if k is not None}


_READS: dict[Any, str] | None = None


class HostReadCheck(TorchFunctionMode):
    """Raises `HostReadInCapture` at a host read of a tensor's value (Note: [Host reads in a
    captured call])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        global _READS
        if _READS is None:
            _READS = _names()
        what = _READS.get(func)
        if what is not None:
            raise HostReadInCapture(
                f"handle.cuda_graph: the graphed function reads a tensor's value on the host "
                f"({what}) in the call the GPU captures (a signature's second call); a CUDA "
                "graph capture forbids that and the GPU raises 'operation not permitted when "
                "stream is capturing'. Keep the value on the device (torch.where, indexing "
                "with tensors, a fixed size), or read it outside the graphed function. See "
                "Note: [Host reads in a captured call]"
            )
        return func(*args, **(kwargs or {}))


def is_compiled(fn: Any) -> bool:
    """Whether ``fn`` is a `torch.compile` product (a compiled module or function)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return (
        isinstance(fn, OptimizedModule)
        or hasattr(fn, "_torchdynamo_orig_callable")
        or getattr(fn, "dynamo_compiled", False)  # a `compile_streamed` program
    )
