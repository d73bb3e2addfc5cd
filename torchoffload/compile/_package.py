"""Compiled programs that hold no weights: AOTInductor packages whose weights stream by id.

::

    import torchoffload.compile as toc
    toc.save_streamed_package(model, (tokens,), "model.pt2", weights="model.safetensors")
    program = toc.load_streamed_package("model.pt2", "model.safetensors", "cuda",
                                        budget_bytes=4 << 30)
    logits = program(tokens)

`export_streamed` traces the model with fake weights on the target device (no weight byte is
read or copied) and replaces every use of every parameter and buffer with
``torch.ops.torchoffload.weight(after, probe_id, geometry, device)``: an op with no weight input
(its ``after`` and its ``weight.finish`` overload's ``finished`` hold earlier probes' outputs,
only to order it), so the program knows each weight by its probe id only and a compiler has no
weight to fold, copy or embed. The `Catalog` says, per probe id, which weight it is (name,
dtype, shape, stride, bytes, and its byte offset in the weights file written at export).
`save_streamed_package` compiles that program with AOTInductor and stores the catalog inside
the ``.pt2``; `load_streamed_package` checks the catalog against a safetensors file (one file, a
sharded index, or a directory), reads the weights straight into the weight engine's pinned host
store (`stream_weights(checkpoint=)`'s reader) and serves every probe from the engine's device
arena.

Note: [Ordering weights in a compiled program]
A compiler may reorder, fuse, recompute and reuse buffers; the eager runner's rules (Note:
[Serving a probe]) hold only if, whatever it does, probes run in id order, no weight is read
after the probe that lets its arena slot be reused, and no weight's memory is used for anything
else. 1, 2 and 4 make each a fact of the program's semantics, not of the schedule a compiler
picks today; 3 is what Inductor needs to honour 2:
1. Probes run in id order: probe j takes probe j-1's output in ``after`` (probe 0 takes an
   empty tensor the graph makes: the output of an op with no tensor input is not tracked by
   functionalization, and 2 declares writes to it).
2. A probe that finishes weights says that it writes them: probe q is ``weight.finish``, whose
   ``finished`` holds the output of every earlier probe p whose last reader comes before q
   (`_finished_at`; a `ProbeServer` finishes p's unit at q or later, never earlier). Nothing
   is written; the declaration is what orders. After q the tensor holds other values as far
   as the program says, so any compiler that respects the op's schema does every read of p's
   weight before q, whether it fuses, recomputes (an embedding gather inlined into a later
   kernel) or reorders. Readers are found through views (`readers`: a view reads nothing,
   its consumers do), and a no-op a compiler removes (``w.clone()`` becomes ``w``) is removed
   before the probes go in, with Inductor's own rules, so that its users count as readers.
   Ordering edges alone do not do this: a compiler may compute a reader again later from the
   weight, as Inductor did with the embedding below though it was an input of the probe. A copy
   of each weight into memory the compiler owns would cut recomputation off from the arena too,
   at the price of copying every weight at every use, outside the budget.
3. What Inductor needs besides: ``after`` also holds each node between probe j-1 and probe j
   that has a user past probe j, and both weight ops carry the ``flexible_layout`` tag, so
   that Inductor realizes those nodes themselves (computes each once into a buffer that later
   kernels read) before the probe. Inductor honours 2 only for readers realized before the
   op that writes: the lazy readers of a written buffer it realizes while lowering the write,
   after that op, and its scheduler then takes them for reads of the new value, free to run
   later (torch 2.13). And without the tag, its default layout constraint for custom ops
   copies an unrealized input into a new buffer and leaves the node itself lazy: later kernels
   inlined it, and a model ``emb -> h + fc2(relu(fc1(ln(h)))) -> head`` at its least budget
   read the embedding from a reused slot on every call after the first (off by 0.97, CPU and
   CUDA; issue 38). Before that, a Hugging Face Llama's compiled residual adds re-read the
   embedding table after its unit was finished, and a cloned table read at the end (max diff
   4.07) did too.
4. No compiler reuses a weight's memory: every probe output is also a graph output (dropped by
   the runner), and an output buffer is never freed or given to another buffer by the program.
The cost is that the nodes in 3 are materialized where a compiler might have fused them into a
later kernel. In a low-precision dtype that also changes rounding: fused, Inductor computes the
chain in fp32; materialized, it is rounded to the dtype. So a streamed package is bitwise the
same package with every unit kept, and a plain package of the model only when the compiler
fuses nothing across a probe (the CPU tests' GPT in fp32). In bf16 the plain GPT fuses its
embedding and position add into the first layer norm, and its logits differed from the
streamed package's by 0.25 at most (one ulp at their largest, 56.75; CPU).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import struct
import weakref
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from torchoffload._modules import matches
from torchoffload._transfer import compute_device
from torchoffload._validate import check_int
from torchoffload.compile._inputs import CallForm, InputCheck, InputSpec, call_form, input_specs
from torchoffload.compile._ops import _lib
from torchoffload.compile._probe import ProbeServer, own_version, readers, serving
from torchoffload.weights import WeightStreamHandle, _layout
from torchoffload.weights._checkpoint import _DTYPES, Checkpoint, CheckpointError, write_safetensors
from torchoffload.weights._handle import _check_resident
from torchoffload.weights._runtime import STREAMED, StreamConfig, WeightRuntime

__all__ = [
    "Catalog",
    "StreamedPackage",
    "WeightEntry",
    "export_streamed",
    "load_streamed_package",
    "read_catalog",
    "save_streamed_package",
]

CATALOG_FILE = "torchoffload_catalog.json"  # inside the .pt2 (a zip): <archive>/extra/<this>
FORMAT = 6  # 2: the weight op's dtype an int code (Note: [A weight's geometry as ints]);
# 3: written_inputs (Note: [Arguments written in place] in weights/_graph.py); 4: weight.finish
# (Note: [Ordering weights in a compiled program]: a package before it may read a reused slot);
# 5: inputs and dims (Note: [Checking a package's inputs] in _inputs.py); 6: the inputs' strides
# (the same Note: a package before it read a transposed input as if contiguous)
_DTYPE_NAMES = {dt: code for code, dt in _DTYPES.items()}


# Defined at the lower level (Note: [Defining the ops with torch.library.Library]) for its cost
# and because its outputs alias each other: every weight is a view of the one arena storage,
# which a custom_op's alias check refuses.
# Both overloads are tagged ``flexible_layout`` (Note: [Ordering weights in a compiled program],
# 3). ``weight.finish`` is the probe that finishes earlier probes' weights and declares that it
# writes them (2 there); an overload of its own because an empty ``Tensor(a!)[]`` is taken
# apart wrongly by Inductor's decomposition of auto_functionalized (torch 2.13: a getitem on
# the op's Tensor result, "<built-in function getitem> is not an OpOverload").
_lib.define(
    "weight(Tensor[] after, int probe_id, int[] geometry, Device device) -> Tensor",
    tags=(torch.Tag.flexible_layout,),
)
_lib.define(
    "weight.finish(Tensor[] after, int probe_id, int[] geometry, Device device, "
    "Tensor(a!)[] finished) -> Tensor",
    tags=(torch.Tag.flexible_layout,),
)

# Note: [A weight's geometry as ints]
# The op says which tensor a probe returns with one int list, ``[dtype code, ndim, *shape,
# *stride]``, the dtype code being its index in `_DTYPE_CODES` (this file's numbering, fixed by
# the package format). Not a ``ScalarType`` argument: the AOTInductor proxy executor of torch
# 2.11 (the GPU machine's) hands a ScalarType to the op in the export serializer's numbering,
# not c10's, so a bfloat16 weight arrived as quint8 (seen on the H100 on 2026-11-25: every
# CUDA package failed its first probe check); torch 2.13 converts it. An int list arrives as
# written on both. Never empty: an empty int list does not survive the proxy executor.
_DTYPE_CODES: tuple[torch.dtype, ...] = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip


def _encode(dtype: torch.dtype, shape: Sequence[int], stride: Sequence[int]) -> list[int]:
    """The ``geometry`` argument of ``torchoffload::weight`` (Note: [A weight's geometry as
    ints])."""
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"cannot stream a {dtype} weight from a compiled package")
    return [_DTYPE_CODES.index(dtype), len(shape), *shape, *stride]


def _decode(geometry: Sequence[int]) -> tuple[torch.dtype, list[int], list[int]]:
    code, n = geometry[0], geometry[1]
    return _DTYPE_CODES[code], list(geometry[2 : 2 + n]), list(geometry[2 + n :])


def _weight(after: list[torch.Tensor], probe_id: int, geometry: list[int], device: torch.device,
            finished: Sequence[torch.Tensor] = ()) -> torch.Tensor:  # fmt: skip
    """The weight of probe ``probe_id``, served by the running program (`StreamedPackage`).
    ``geometry`` is its dtype, shape and stride (`_encode`); ``after`` and ``finished`` only
    order the op (Note: [Ordering weights in a compiled program]): nothing is written."""
    server = serving()
    if server is None:
        raise RuntimeError(
            f"torchoffload.weight probe {probe_id} ran outside a streamed program: load the "
            "package with torchoffload.compile.load_streamed_package and call what it returns"
        )
    t = server.serve(probe_id)
    if probe_id not in server.checked:  # once per probe: the program and its catalog agree
        want = _decode(geometry)
        if (t.dtype, list(t.shape), list(t.stride())) != want:
            raise RuntimeError(
                f"torchoffload.weight probe {probe_id} reads {want[0]} {want[1]} (stride "
                f"{want[2]}) but the catalog serves {t.dtype} {list(t.shape)} (stride "
                f"{list(t.stride())}): the package and its catalog do not belong together"
            )
        server.checked.add(probe_id)
    return t


def _weight_fake(after, probe_id, geometry, device, finished=()):
    dtype, shape, stride = _decode(geometry)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


for _overload in ("weight", "weight.finish"):
    _lib.impl(_overload, _weight, "CompositeExplicitAutograd")
    torch.library.register_fake(f"torchoffload::{_overload}", _weight_fake, lib=_lib)
_WEIGHT_OPS = (torch.ops.torchoffload.weight.default, torch.ops.torchoffload.weight.finish)
for _op in _WEIGHT_OPS:
    fx.node.has_side_effect(_op)


# -- the catalog --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightEntry:
    """One weight of a streamed program: its names (a tied weight has several; the first is the
    one the weights file holds), geometry, bytes, and byte offset in the weights file written at
    export (``None`` when none was)."""

    names: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int
    offset: int | None = None

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class Catalog:
    """What a streamed program's probes serve: ``probes[i]`` is the name of the weight probe
    ``i`` serves; ``weights`` maps that name to its `WeightEntry`. ``positions[i]`` is probe
    ``i``'s place in the traced graph and ``last_use[i]`` that of its last user, which decide
    when a unit is finished (Note: [Serving a probe]). ``inputs`` and ``dims`` say which inputs
    the program was exported for (Note: [Checking a package's inputs])."""

    device_type: str
    probes: tuple[str, ...]
    weights: dict[str, WeightEntry]
    positions: tuple[int, ...]
    last_use: tuple[int, ...]
    # the inputs the program writes in place, as pytree key paths of (args, kwargs)
    written_inputs: tuple[str, ...] = ()
    inputs: tuple[InputSpec, ...] = ()
    dims: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # symbol -> range
    call: CallForm | None = None  # None: a catalog written before it was recorded

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.weights.values())

    def to_json(self) -> str:
        weights = {
            name: {"names": list(e.names), "dtype": _DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                   "stride": list(e.stride), "nbytes": e.nbytes, "offset": e.offset}
            for name, e in self.weights.items()
        }  # fmt: skip
        return json.dumps(
            {"format": FORMAT, "device_type": self.device_type, "probes": list(self.probes),
             "weights": weights, "positions": list(self.positions),
             "last_use": list(self.last_use), "written_inputs": list(self.written_inputs),
             "inputs": [i.to_obj() for i in self.inputs],
             "dims": {s: list(r) for s, r in self.dims.items()},
             **({"call": self.call.to_obj()} if self.call is not None else {})},
            indent=1,
        )  # fmt: skip

    @classmethod
    def from_json(cls, text: str, source: str = "catalog") -> Catalog:
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise ValueError(
                    f"format {d.get('format')!r}, this torchoffload reads {FORMAT}: build the "
                    "package again with save_streamed_package"
                )
            if not isinstance(d.get("weights"), dict):
                raise ValueError("weights must be an object")
            weights = {name: _entry(name, e) for name, e in d["weights"].items()}
            if not isinstance(d.get("device_type"), str):
                raise ValueError("device_type must be a string")
            probes = _list_of(d.get("probes"), str, "probes")
            positions = _list_of(d.get("positions"), int, "positions")
            last_use = _list_of(d.get("last_use"), int, "last_use")
            written = _list_of(d.get("written_inputs"), str, "written_inputs")
            inputs = tuple(InputSpec.from_obj(i) for i in _list_of(d.get("inputs"), dict, "inputs"))
            dims = _dims(d.get("dims"))
            call = CallForm.from_obj(d["call"]) if "call" in d else None
            cat = cls(d["device_type"], tuple(probes), weights, tuple(positions),
                      tuple(last_use), tuple(written), inputs, dims, call)  # fmt: skip
            if not len(cat.probes) == len(cat.positions) == len(cat.last_use):
                raise ValueError("probes, positions and last_use differ in length")
            unknown = [n for n in cat.probes if n not in weights]
            if unknown:
                raise ValueError(f"probe of {unknown[0]!r}, which it does not describe")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{source} is not a torchoffload weight catalog ({e})") from None
        return cat


def _dims(value: object) -> dict[str, tuple[int, int | None]]:
    """The catalog's ``dims``: symbol -> [min, max or null]."""
    if not isinstance(value, dict):
        raise ValueError("dims must be an object")
    out = {}
    for sym, r in value.items():
        ok = isinstance(r, list) and len(r) == 2 and isinstance(r[0], int) and (
            r[1] is None or isinstance(r[1], int))  # fmt: skip
        if not ok:
            raise ValueError(f"dims[{sym!r}] must be [min, max or null]")
        out[sym] = (r[0], r[1])
    return out


def _list_of(value: object, kind: type, what: str) -> list[Any]:
    if not isinstance(value, list) or not all(
        isinstance(v, kind) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"{what} must be a list of {kind.__name__}")
    return value


def _entry(name: object, e: object) -> WeightEntry:
    """A catalog entry, every field checked (a hand-edited or foreign catalog must not be read
    as geometry it does not describe)."""
    if not isinstance(name, str) or not isinstance(e, dict):
        raise ValueError(f"weight {name!r} must map a name to an object")
    names = _list_of(e.get("names"), str, f"{name}.names")
    if not names or names[0] != name:
        raise ValueError(f"{name}.names must start with {name!r}")
    if e.get("dtype") not in _DTYPES:
        raise ValueError(f"{name}.dtype {e.get('dtype')!r} is not a dtype this reads")
    dtype = _DTYPES[e["dtype"]]
    shape = _list_of(e.get("shape"), int, f"{name}.shape")
    stride = _list_of(e.get("stride"), int, f"{name}.stride")
    if len(shape) != len(stride) or any(v < 0 for v in (*shape, *stride)):
        raise ValueError(f"{name}: shape and stride must be non-negative and of one length")
    nbytes, offset = e.get("nbytes"), e.get("offset")
    span = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes != span * dtype.itemsize:
        raise ValueError(f"{name}.nbytes {nbytes!r} does not match its shape, stride and dtype")
    if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)
                               or offset < 0):  # fmt: skip
        raise ValueError(f"{name}.offset must be a non-negative int or null")
    return WeightEntry(tuple(names), dtype, tuple(shape), tuple(stride), nbytes, offset)


# -- export -------------------------------------------------------------------------------------


def export_streamed(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    device: torch.device | str | int | None = None,
) -> tuple[torch.export.ExportedProgram, Catalog]:
    """Export ``model`` as a program that holds no weights: each use of each parameter and
    buffer reads ``torch.ops.torchoffload.weight`` by probe id (module docstring). Returns the
    program and its `Catalog`.

    The model is traced with fake weights on ``device`` (default: that of the first tensor in
    ``args``), so its own weights may be anywhere, the ``meta`` device included, and are never
    read. ``args``, ``kwargs`` and ``dynamic_shapes`` are `torch.export.export`'s. Not
    supported (a clear error): buffers the forward writes to, tensor-subclass weights, and a
    model that `stream_weights` streams now.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of arguments, not {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if device is None:
        if not tensors:
            raise ValueError("no tensor in args or kwargs: pass device= to say where it runs")
        device = tensors[0].device
    device = compute_device(device)
    slots = _layout.find_slots(model)
    for slot in slots:
        if slot.tensor in STREAMED:
            raise RuntimeError(
                f"{slot.name!r} is streamed by stream_weights (its device tensor is empty): "
                "export before stream_weights or after the handle's remove()"
            )
        if type(slot.tensor) not in (torch.Tensor, nn.Parameter):
            raise TypeError(
                f"cannot export {slot.name!r}: a {type(slot.tensor).__qualname__} weight (only "
                "plain tensors stream inside a compiled program)"
            )
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    memo: dict[int, Any] = {}
    saved = set(model.state_dict(keep_vars=True))
    for slot in slots:
        t = slot.tensor
        if not t.is_meta and not any(q in saved for _, _, q in slot.where):
            # A buffer outside the state dict (a rotary table computed at construction): no
            # checkpoint holds it, so the program keeps it as a constant of its own.
            memo[id(t)] = t.detach().to(device)
            continue
        fake = mode.from_tensor(t.detach())
        if fake.device != device:
            with mode:
                fake = fake.to(device)
        if isinstance(t, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=False)
        memo[id(t)] = fake
    fake_model = copy.deepcopy(model, memo)
    fake_args, fake_kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: mode.from_tensor(t), (args, kwargs)
    )
    ep = torch.export.export(
        fake_model, fake_args, fake_kwargs, dynamic_shapes=dynamic_shapes, strict=False
    )
    # Inductor's own decompositions (functional: a write to a weight shows in the signature),
    # so that the graph probed is close to the one the compiler sees.
    from torch._inductor.decomposition import select_decomp_table

    ep = ep.run_decompositions(select_decomp_table())
    mutated = list(ep.graph_signature.buffers_to_mutate.values())
    if mutated:
        raise ValueError(
            f"the forward writes to buffer {mutated[0]!r}: a streamed program's weights are "
            "read-only (pass such state, e.g. a KV cache, as an input instead)"
        )
    written = _written_inputs(ep, args, kwargs)
    gm = ep.module()
    # A no-op a compiler removes (``w.clone()``, ``cat([w])``, a same-dtype conversion) makes
    # its users read ``w`` itself: remove them first, with Inductor's own rules, so that those
    # users count as readers (Note: [Ordering weights in a compiled program]).
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    remove_noop_ops(gm.graph)
    gm.recompile()
    catalog = replace(_insert_weight_reads(gm, device), written_inputs=written)
    ep = torch.export.export(gm, fake_args, fake_kwargs, dynamic_shapes=dynamic_shapes,
                             strict=False)  # fmt: skip
    inputs, dims = input_specs(ep)
    return ep, replace(catalog, inputs=inputs, dims=dims, call=call_form(model, args, kwargs))


def _written_inputs(ep: torch.export.ExportedProgram, args: Any, kwargs: Any) -> tuple[str, ...]:
    """The inputs ``ep`` (functional: its decompositions ran) writes in place, as key paths of
    ``(args, kwargs)``: a package's kernels write them without bumping their version counters,
    so `StreamedPackage` bumps them (Note: [Arguments written in place] in weights/_graph.py)."""
    sig = ep.graph_signature
    names = set(sig.user_inputs_to_mutate.values())
    if not names:
        return ()
    leaves = pytree.tree_flatten_with_path((args, kwargs if kwargs is not None else {}))[0]
    if len(leaves) != len(sig.user_inputs):
        raise RuntimeError(
            f"internal error: {len(leaves)} inputs given, the exported program has "
            f"{len(sig.user_inputs)}: cannot say which it writes in place"
        )
    return tuple(
        pytree.keystr(path) for (path, _), name in zip(leaves, sig.user_inputs, strict=True)
        if name in names
    )  # fmt: skip


def _insert_weight_reads(gm: fx.GraphModule, device: torch.device) -> Catalog:
    """Replace every use of a parameter or buffer of ``gm`` by a weight probe, ordered and
    returned as Note: [Ordering weights in a compiled program] says; drop the weights."""
    graph = gm.graph
    found = dict(gm.named_parameters(remove_duplicate=False))
    found.update(gm.named_buffers(remove_duplicate=False))
    found = {n: t for n, t in found.items() if isinstance(t, FakeTensor)}  # the rest: constants
    names_of: dict[int, list[str]] = {}
    for name, t in found.items():
        names_of.setdefault(id(t), []).append(name)
    output = next(n for n in graph.nodes if n.op == "output")
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in found and output in readers(node, outputs=True):
            raise ValueError(
                f"the forward returns {node.target!r} (or a view or copy of it that a "
                "compiler elides): a streamed weight's device memory is reused after the "
                "call; return a computed result, or keep the weight out of the outputs"
            )
    entries: dict[str, WeightEntry] = {}
    probes: list[fx.Node] = []
    probe_names: list[str] = []
    pending: list[fx.Node] = []  # nodes since the last probe
    op = torch.ops.torchoffload.weight.default
    for node in list(graph.nodes):
        if node.op in ("get_attr", "placeholder", "output"):
            continue
        attrs = [a for a in node.all_input_nodes if a.op == "get_attr" and a.target in found]
        for attr in dict.fromkeys(attrs):
            t = found[attr.target]
            if not t.is_contiguous():
                raise ValueError(
                    f"cannot stream {attr.target!r}: it is not contiguous (stride {t.stride()}); "
                    "make it contiguous before export"
                )
            canonical = names_of[id(t)][0]
            if canonical not in entries:
                entries[canonical] = WeightEntry(
                    tuple(names_of[id(t)]), t.dtype, tuple(t.shape), tuple(t.stride()),
                    t.numel() * t.element_size(),
                )  # fmt: skip
            after = [probes[-1]] if probes else [_functional_start(graph, node, device)]
            since = set(pending)
            after += [n for n in pending if _is_tensor(n) and not since.issuperset(n.users)]
            geometry = _encode(t.dtype, t.shape, t.stride())
            with graph.inserting_before(node):
                p = graph.call_function(op, (after, len(probes), geometry, device))
            p.meta["val"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            node.replace_input_with(attr, p)
            probes.append(p)
            probe_names.append(canonical)
            pending = []
        pending.append(node)
    if not probes:
        raise ValueError("the model uses no parameters or buffers: nothing to stream")
    for node in list(graph.nodes):
        if node.op == "get_attr" and node.target in found and not node.users:
            graph.erase_node(node)
    for name in found:
        owner, _, leaf = name.rpartition(".")
        mod = gm.get_submodule(owner)
        mod._parameters.pop(leaf, None)
        mod._buffers.pop(leaf, None)
    flat = tuple(output.args[0])
    output.args = (flat + tuple(probes),)
    info = graph._codegen.pytree_info
    user = pytree.tree_unflatten([0] * len(flat), info.out_spec)
    graph._codegen.pytree_info = info._replace(
        out_spec=pytree.tree_structure((user, tuple(range(len(probes)))))
    )
    position = {n: i for i, n in enumerate(graph.nodes)}
    positions = [position[p] for p in probes]
    last_use = [max(position[u] for u in readers(p, _WEIGHT_OPS)) for p in probes]
    for p, finished in zip(probes, _finished_at(positions, last_use), strict=True):
        if finished:
            p.target = torch.ops.torchoffload.weight.finish
            p.args = (*p.args, [probes[i] for i in finished])
    graph.lint()
    gm.recompile()
    return Catalog(device.type, tuple(probe_names), entries, tuple(positions), tuple(last_use))


def _finished_at(positions: Sequence[int], last_use: Sequence[int]) -> list[list[int]]:
    """For each probe q, the earlier probes p whose weight is finished at q: q is the first
    probe placed after p's last reader (Note: [Ordering weights in a compiled program]). A
    `ProbeServer` finishes p's unit at q or later, never earlier."""
    out: list[list[int]] = [[] for _ in positions]
    for p, use in enumerate(last_use):
        q = next((q for q in range(p + 1, len(positions)) if positions[q] > use), None)
        if q is not None:
            out[q].append(p)
    return out


def _functional_start(graph: fx.Graph, before: fx.Node, device: torch.device) -> fx.Node:
    """An empty tensor made by the graph, for probe 0's ``after``: an op with no tensor input
    returns a tensor that functionalization does not track (a FakeTensor, not a
    FunctionalTensor, torch 2.13), and compiling a ``weight.finish`` that declares a write to
    it fails."""
    with graph.inserting_before(before):
        start = graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                    {"dtype": torch.uint8, "device": device})  # fmt: skip
    start.meta["val"] = torch.empty(0, dtype=torch.uint8, device="meta")
    return start


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


# -- package ------------------------------------------------------------------------------------


def save_streamed_package(
    model: nn.Module,
    args: tuple[Any, ...],
    package_path: str | os.PathLike[str],
    kwargs: dict[str, Any] | None = None,
    *,
    weights: str | os.PathLike[str] | None = None,
    dynamic_shapes: Any = None,
    device: torch.device | str | int | None = None,
    inductor_configs: dict[str, Any] | None = None,
) -> Catalog:
    """Compile ``model`` with AOTInductor into ``package_path`` (a ``.pt2`` that holds no
    weight bytes: the program reads them through probes, `export_streamed`), with its `Catalog`
    inside. ``weights``: also write the model's weights there as a safetensors file (the
    catalog records their offsets); leave it ``None`` when they already are in a checkpoint
    with the same names (e.g. a Hugging Face model's), which `load_streamed_package` then
    reads. Returns the catalog."""
    _check_path("package_path", package_path)
    if weights is not None:
        _check_path("weights", weights)
    package_path = Path(os.fspath(package_path))
    if package_path.suffix != ".pt2":
        raise ValueError(f"package_path must end in .pt2, got {str(package_path)!r}")
    for name, path in (("package_path", package_path), ("weights", weights)):
        folder = None if path is None else Path(os.fspath(path)).parent
        if folder is not None and not folder.is_dir():  # before a compile of minutes
            error, what = ((NotADirectoryError, "is not a folder") if folder.exists() else
                           (FileNotFoundError, "does not exist"))  # fmt: skip
            raise error(f"{name}: the folder {str(folder)!r} {what}; nothing was compiled")
    ep, catalog = export_streamed(model, args, kwargs, dynamic_shapes=dynamic_shapes,
                                  device=device)  # fmt: skip
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(package_path), inductor_configs=inductor_configs
    )
    try:
        _check_cxx_runtime(package_path)
    except RuntimeError as e:
        package_path.unlink()  # a package that would crash its loader is not left behind
        raise RuntimeError(f"{e}; the compiler was {_compiler()!r}; nothing was saved") from None
    if weights is not None:  # after the package is known good: a refusal writes nothing
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
        try:
            meta = {"torchoffload": "weights of a streamed package"}
            written = write_safetensors(weights, {n: named[n] for n in catalog.weights}, meta)
        except BaseException:
            package_path.unlink()  # a package without its catalog is of no use
            raise
        catalog = replace(
            catalog,
            weights={n: _with_offset(e, written[n].offset) for n, e in catalog.weights.items()},
        )
    with zipfile.ZipFile(package_path, "a") as z:
        root = z.namelist()[0].split("/", 1)[0]
        z.writestr(f"{root}/extra/{CATALOG_FILE}", catalog.to_json())
    return catalog


# Note: [A statically linked libstdc++]
# An AOTInductor package's compiled code (its wrapper ``.so``) must use the C++ runtime that
# the process already has: PyTorch's libraries need the shared libstdc++. On the GPU machine
# (torch 2.11.0+cu130) Inductor's compiler, /opt/gcc/bin/g++, linked libstdc++ statically into
# every wrapper (no libstdc++.so among its needed libraries, libstdc++'s own symbols defined in
# it), and loading any package, plain or streamed, CPU or CUDA, killed the process: SIGSEGV at
# address 0 inside std::regex (``parse_device_str`` in the AOTInductorModel constructor), in a
# virtual call that reached ``codecvt::do_unshift``, as seen on 2026-11-25 by a signal handler's
# backtrace. With /usr/bin/g++ (the same GCC 13.3, shared libstdc++) the same packages load
# and run. So `save_streamed_package` and `load_streamed_package` read the wrapper's needed
# libraries (its ELF dynamic section) and refuse such a package with the fix, before anything
# is loaded or pinned, instead of letting the loader crash.


def _needed_libraries(elf: bytes) -> list[str] | None:
    """The ``DT_NEEDED`` entries of a 64-bit little-endian ELF shared object, or None when
    ``elf`` is not one (another platform's format: nothing to check)."""
    if len(elf) < 64 or elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    try:
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
                    for i in range(shnum)]  # fmt: skip
        for _name, kind, _flags, _addr, offset, size, link, *_ in sections:
            if kind != 6:  # SHT_DYNAMIC
                continue
            strings = sections[link][4]
            needed = []
            for at in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", elf, at)
                if tag == 0:  # DT_NULL
                    break
                if tag == 1:  # DT_NEEDED
                    start = strings + value
                    needed.append(elf[start : elf.index(b"\0", start)].decode())
            return needed
    except (struct.error, IndexError, ValueError):
        return None
    return None


def _check_cxx_runtime(package_path: str | os.PathLike[str]) -> None:
    """Refuse a package whose compiled code holds its own copy of the C++ runtime (Note: [A
    statically linked libstdc++])."""
    with zipfile.ZipFile(package_path) as z:
        for info in z.infolist():
            if "/aotinductor/" not in info.filename or not info.filename.endswith(".so"):
                continue
            needed = _needed_libraries(z.read(info))
            if needed is None or any(n.startswith(("libstdc++", "libc++")) for n in needed):
                continue
            raise RuntimeError(
                f"{os.fspath(package_path)}: its compiled code "
                f"({info.filename.rsplit('/', 1)[-1]}) links the C++ runtime statically (it "
                f"needs {needed}, no libstdc++.so), and PyTorch's AOTInductor loader crashes "
                "loading such code into a process that uses the shared libstdc++, as PyTorch "
                "does. Build the package with a C++ compiler that links libstdc++ as a shared "
                "library, e.g. with the environment variable CXX=/usr/bin/g++"
            )


def _compiler() -> str:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # private API: the message only names it when it can
        return "unknown"


def _check_path(name: str, value: object) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")


def _with_offset(e: WeightEntry, offset: int) -> WeightEntry:
    return WeightEntry(e.names, e.dtype, e.shape, e.stride, e.nbytes, offset)


def read_catalog(package_path: str | os.PathLike[str]) -> Catalog:
    """The `Catalog` stored in a package by `save_streamed_package`."""
    _check_path("package_path", package_path)
    p = Path(os.fspath(package_path))
    if not p.is_file():
        raise FileNotFoundError(f"package {str(p)!r} does not exist")
    try:
        with zipfile.ZipFile(p) as z:
            found = [n for n in z.namelist() if n.endswith(f"/extra/{CATALOG_FILE}")]
            if not found:
                raise ValueError(
                    f"{p} holds no torchoffload weight catalog: it was not built by "
                    "save_streamed_package (a plain AOTInductor package embeds its weights "
                    "and has no weight probes to serve)"
                )
            text = z.read(found[0]).decode()
    except zipfile.BadZipFile:
        raise ValueError(f"{p} is not a .pt2 package (not a zip archive)") from None
    return Catalog.from_json(text, f"{p}'s catalog")


# Note: [A package run without its container's events]
# AOTInductor's model container keeps a pool of model instances for callers on several threads:
# `run` records an event after each run and, before the next, queries (`cudaEventQuery`) or waits
# on it to find a free instance. Neither is allowed inside a CUDA graph capture, so a package run
# by `handle.cuda_graph` failed its capture ("operation not permitted when stream is capturing",
# H100, torch 2.11). The package is loaded with ``run_single_threaded=True``, which runs the one
# instance with no event (the loader's documented use: "to avoid conflicts with CUDAGraphs").
# What the pool guarded needs no guard here: the weight runtime runs one call at a time (Note:
# [One call at a time]), so the instance is never run from two threads at once.


# Note: [A tied weight held once]
# The weight engine binds a tensor held by modules of several units in each of those units (the
# eager forward runs one unit at a time). A `ProbeServer` holds several units at once (Note:
# [Serving a probe]), and a probe reads a weight by one name, so the module tree that holds a
# program's weights holds each streamed weight under one name only: its catalog name, or the
# name the checkpoint holds it by. Held under every name, a tied head's weight was bound again
# by the head's unit (kept for its bias) while the embedding's unit held it, which moved the
# tensor to the head's bytes and bumped its version counter: the embedding's unit then
# reported "modified in place" on every first call, and the head's unit copied the embedding
# a second time. A resident weight is bound in no unit and keeps all its names, which the
# ``resident`` patterns match.


class _Holder(nn.Module):
    """The module tree that names a streamed program's weights (Note: [A tied weight held
    once])."""

    held: dict[str, str]  # at the root: catalog name -> the name held


class StreamedPackage:
    """An AOTInductor program whose weights stream from pinned host memory (built by
    `load_streamed_package`). Call it like the exported model; ``handle`` is the weight
    engine's `WeightStreamHandle` (``stats()``, ``schedule``); ``catalog`` the package's."""

    dynamo_compiled = False  # True for `compile_streamed`'s (Note: [Host reads in a captured call])

    def __init__(self, program: Any, catalog: Catalog, runtime: WeightRuntime,
                 holder: nn.Module, *, dynamo_compiled: bool = False):  # fmt: skip
        self.catalog = catalog
        self.handle = WeightStreamHandle(runtime)
        self._program = program
        self._holder = holder
        self._server = ProbeServer(
            runtime, _sources(runtime, holder, [holder.held[n] for n in catalog.probes]),
            catalog.positions, catalog.last_use,
        )  # fmt: skip
        # Dropped without remove(): release the store and the arena (the engine's registry of
        # streamed tensors would otherwise keep them alive).
        self._finalizer = weakref.finalize(self, runtime.restore, False)
        self._written = frozenset(catalog.written_inputs)  # Note: [Arguments written in place]
        self.dynamo_compiled = dynamo_compiled
        # Dynamo's guards recompile for another layout; AOTInductor's kernels assume one
        self._check = InputCheck(catalog.inputs, catalog.dims, strides=not dynamo_compiled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        form = self.catalog.call  # Note: [Checking a package's inputs]
        if form is not None:
            args, kwargs = form.bind(args, kwargs)
        self._check(args, kwargs)
        if form is not None:
            form.check_complete(args, kwargs)
        out, _weights = self._server.run(self._program, args, kwargs)
        if self._written:  # Note: [Arguments written in place] (weights/_graph.py)
            for path, x in pytree.tree_flatten_with_path((args, kwargs))[0]:
                tracked = isinstance(x, torch.Tensor) and not x.is_inference()
                if tracked and pytree.keystr(path) in self._written:
                    torch.autograd.graph.increment_version(x)
        return out

    def remove(self) -> None:
        """Release the host store and the arena; the program cannot run afterwards."""
        self._finalizer()
        self._program = None

    def __repr__(self) -> str:
        return f"StreamedPackage({len(self.catalog.probes)} probes, {self.handle!r})"


def _sources(runtime: WeightRuntime, holder: nn.Module, names: Sequence[str]):
    """(unit index, module, attribute) of each probe's weight; unit -1: resident."""
    unit_of: dict[int, int] = {}  # every module inside a unit: a unit may be a parent module
    for i, unit in enumerate(runtime.units):
        for m in unit.layout.module.modules():
            unit_of.setdefault(id(m), i)
    out = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = holder.get_submodule(owner)
        out.append((unit_of.get(id(module), -1), module, leaf))
    return out


def load_streamed_package(
    package_path: str | os.PathLike[str],
    weights: str | os.PathLike[str],
    device: torch.device | str | int | None = None,
    *,
    budget_bytes: int,
    prefetch_depth: int = 2,
    resident: str | Sequence[str] = (),
    pin_memory: bool = True,
) -> StreamedPackage:
    """Load a package written by `save_streamed_package` and the safetensors ``weights`` it
    reads (a file, a sharded ``model.safetensors.index.json``, or a directory holding either):
    the weights go straight into pinned host memory and stream through a device arena of at
    most ``budget_bytes``, ``prefetch_depth`` units ahead; ``resident`` name patterns stay on
    the device, outside the budget (as in `stream_weights`). A unit is a module's weights.

    Everything that can be checked before reading a byte is: the catalog against the weights
    file (names, dtypes, shapes, sizes, truncation), the package's device type, the budget.
    Outputs are bitwise those of the same program compiled with its weights resident.
    """
    check_int("budget_bytes", budget_bytes, minimum=1)
    check_int("prefetch_depth", prefetch_depth, minimum=0)
    _check_path("weights", weights)
    resident = _check_resident(resident)
    catalog = read_catalog(package_path)
    _check_cxx_runtime(package_path)
    dev = compute_device(device)
    if dev.type != catalog.device_type:
        raise ValueError(
            f"the package was compiled for {catalog.device_type!r} and cannot run on {dev}"
        )
    checkpoint = Checkpoint.open(weights)
    _check_catalog(catalog, checkpoint)
    runtime, holder = _runtime_for(catalog, dev, budget_bytes, prefetch_depth, resident,
                                   pin_memory, checkpoint=checkpoint)  # fmt: skip
    # Note: [A package run without its container's events]
    program = torch._inductor.aoti_load_package(
        os.fspath(package_path), run_single_threaded=True,
        device_index=dev.index if dev.index is not None else -1,
    )  # fmt: skip
    return StreamedPackage(program, catalog, runtime, holder)


def _check_catalog(catalog: Catalog, checkpoint: Checkpoint) -> None:
    """Every weight the catalog reads is in the checkpoint, with its dtype, shape and size."""
    for entry in catalog.weights.values():
        found = checkpoint.find(list(entry.names))
        if found is None:
            raise CheckpointError(
                f"{checkpoint.source} has no tensor {entry.name!r}, which the package reads (a "
                "buffer computed at construction, such as a rotary table, is in no checkpoint: "
                "export a model whose buffers are real, e.g. built under accelerate's "
                "init_empty_weights(include_buffers=False), and the package keeps it)"
            )
        if found.dtype != entry.dtype or found.shape != entry.shape or found.nbytes != entry.nbytes:
            raise CheckpointError(
                f"{checkpoint.source}: {found.name!r} is {list(found.shape)} {found.dtype} "
                f"({found.nbytes} bytes) but the package reads {list(entry.shape)} "
                f"{entry.dtype} ({entry.nbytes} bytes)"
            )


def _runtime_for(
    catalog: Catalog,
    dev: torch.device,
    budget_bytes: int,
    prefetch_depth: int,
    resident: tuple[str, ...],
    pin_memory: bool,
    *,
    checkpoint: Checkpoint | None = None,
    values: dict[str, torch.Tensor] | None = None,
) -> tuple[WeightRuntime, nn.Module]:
    """The weight engine serving a catalog's weights, read from ``checkpoint`` or copied from
    ``values`` (name -> tensor) into the pinned store, and the module tree that holds them
    (Note: [A tied weight held once]); ``holder.held`` maps a catalog name to the name the
    tree holds it by."""
    holder = _Holder()
    holder.held = {}
    for name, entry in catalog.weights.items():
        if values is not None:  # Note: [A version counter of its own] in _probe.py
            t = nn.Parameter(own_version(values[name]), requires_grad=False)
        else:
            t = nn.Parameter(
                torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device="meta"),
                requires_grad=False,
            )
        if resident and any(matches(n, resident) for n in entry.names):
            names = entry.names  # resident: bound in no unit, so held under every name
        elif checkpoint is not None:  # the name the checkpoint holds it by (_check_catalog)
            names = (next(n for n in entry.names if n in checkpoint.entries),)
        else:
            names = (name,)
        holder.held[name] = name if name in names else names[0]
        for alias in names:
            owner, _, leaf = alias.rpartition(".")
            module = holder
            for part in owner.split(".") if owner else ():
                if part not in module._modules:
                    module.add_module(part, _Holder())
                module = module._modules[part]
            module._parameters[leaf] = t
    config = StreamConfig(dev, budget_bytes, prefetch_depth, pin_memory=pin_memory)
    layout = _layout.plan(holder, budget=budget_bytes, depth=prefetch_depth, resident=resident,
                          unit="leaves")  # fmt: skip
    with torch.inference_mode(False), torch.no_grad():
        runtime = WeightRuntime(layout, config, checkpoint)
    return runtime, holder


def compile_streamed(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    budget_bytes: int,
    device: torch.device | str | int | None = None,
    prefetch_depth: int = 2,
    resident: str | Sequence[str] = (),
    dynamic_shapes: Any = None,
    checkpoint: str | os.PathLike[str] | None = None,
    mode: str | None = None,
    pin_memory: bool = True,
) -> StreamedPackage:
    """``torch.compile`` ``model`` into one graph (``fullgraph=True``) whose weights stream
    from pinned host memory through a device arena of at most ``budget_bytes``: the program of
    `export_streamed` (every weight use a ``torchoffload.weight`` probe, ordered so that the
    compiler cannot read a weight after its unit is finished), compiled by Inductor, its probes
    served by the weight engine as an AOTInductor package's are, with prefetch
    ``prefetch_depth`` units ahead. The model is not changed; its weights are copied into the
    host store, or read from the safetensors ``checkpoint`` (then the model may be on meta).
    ``mode``: `torch.compile`'s, except the modes that replay CUDA graphs on a GPU
    ("reduce-overhead", "max-autotune"): Inductor's CUDA-graph trees expect every tensor the
    graph makes to come from their memory pool, and a probe's output is a view of the arena
    (on an H100 with torch 2.11 its pool check raises). Replay a streamed decode step with
    ``stream_weights(...).cuda_graph(fn)`` instead. Outputs are bitwise those of the same
    program with every unit kept on the device (a budget that holds them all)."""
    check_int("budget_bytes", budget_bytes, minimum=1)
    check_int("prefetch_depth", prefetch_depth, minimum=0)
    resident = _check_resident(resident)
    if checkpoint is not None:
        _check_path("checkpoint", checkpoint)
    if mode in _CUDA_GRAPH_MODES and _program_device(args, kwargs, device).type == "cuda":
        raise ValueError(
            f"compile_streamed(mode={mode!r}): modes that replay CUDA graphs are not supported "
            "on a GPU (Inductor's CUDA-graph trees expect every tensor the graph makes in their "
            "own memory pool; a weight probe's output is a view of the arena). Use mode=None or "
            "'max-autotune-no-cudagraphs', or stream_weights(...).cuda_graph(fn) for a replayed "
            "decode step"
        )
    ep, catalog = export_streamed(model, args, kwargs, dynamic_shapes=dynamic_shapes,
                                  device=device)  # fmt: skip
    dev = _program_device(args, kwargs, device)
    values = None
    ckpt = None
    if checkpoint is not None:
        ckpt = Checkpoint.open(checkpoint)
        _check_catalog(catalog, ckpt)
    else:
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
        values = {n: named[n] for n in catalog.weights}
        meta = [n for n, t in values.items() if t.is_meta]
        if meta:
            raise ValueError(
                f"{meta[0]!r} is on the meta device: pass checkpoint= to read the weights "
                "from a safetensors file"
            )
    runtime, holder = _runtime_for(catalog, dev, budget_bytes, prefetch_depth, resident,
                                   pin_memory, checkpoint=ckpt, values=values)  # fmt: skip
    program = _compiled_call(torch.compile(ep.module(), fullgraph=True, mode=mode))
    return StreamedPackage(program, catalog, runtime, holder, dynamo_compiled=True)


_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _compiled_call(compiled: Any) -> Any:
    """Note: [Probes alias the arena]
    Every ``torchoffload.weight`` output is a view of the one device arena, and so are the
    earlier probes' outputs it takes as ``after``: the op's outputs alias its inputs by design,
    and Note: [Ordering weights in a compiled program] is what makes that safe. AOTAutograd
    checks the first call of a compiled function for custom ops whose outputs alias their
    inputs: a deprecation warning, or an error where the ``CI`` environment variable is set
    (torch 2.13, `torch._functorch.config.error_on_custom_op_aliasing`). The check is turned
    off around the calls of our compiled program only.

    Note: [An error raised inside a compiled program]
    A probe raises inside the compiled code (a unit finished at a later probe that finds its
    weight written in place, Note: [Serving a probe]). The exception leaves through the
    ``GraphModule``'s call wrapper, whose handler walks the traceback with a generator while
    Dynamo's frame callback is still set; under ``fullgraph=True`` Dynamo raises "Attempt to
    trace generator" for that frame, with the probe's error only as its ``__context__``
    (torch 2.13). That error is raised again as it was."""
    cfg = torch._functorch.config
    patch = hasattr(cfg, "check_custom_op_aliasing")

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with cfg.patch(check_custom_op_aliasing=False) if patch else contextlib.nullcontext():
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            cause = e.__context__
            if isinstance(cause, Exception) and str(e).startswith("Attempt to trace generator"):
                raise cause from None
            raise

    return call


def _program_device(args: Any, kwargs: Any, device: Any) -> torch.device:
    if device is None:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = tensors[0].device
    return compute_device(device)
