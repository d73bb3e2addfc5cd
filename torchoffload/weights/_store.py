"""The host store of a weight runtime: every streamed storage once, in the pieces of the
layout, filled from the model or from a safetensors checkpoint (checked against the layout
before anything is allocated or changed), and the real values of the streamed tensors read
from it and written into it: ``state_dict``, ``load_state_dict`` and the placeholders' reads
and writes (Note: [Placeholders never answer])."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from torchoffload import _hosted
from torchoffload._flatten import flatten, is_composite
from torchoffload.weights._checkpoint import Checkpoint, CheckpointError, Entry
from torchoffload.weights._layout import Layout, Leaf, Slot

if TYPE_CHECKING:
    from torchoffload.weights._call import Calls
    from torchoffload.weights._pipeline import Pipeline


def read_plan(
    layout: Layout, checkpoint: Checkpoint | None, *, strict: bool = True
) -> tuple[dict[Any, tuple[Entry, Leaf]], dict[int, torch.Tensor], list[tuple[Entry, Slot]]]:
    """What to read from ``checkpoint`` (None: the model's own values): for each streamed
    storage it holds, its entry and leaf; the values of the resident tensors it holds, on
    the host (by id); and the entries of tensors another engine hosts, for `fill_hosted`.
    Raises before anything of the model changes; ``strict``: a tensor the checkpoint lacks is
    an error (Note: [Tensors a checkpoint lacks])."""
    if checkpoint is None:
        meta = [s.name for s in (*layout.streamed, *layout.resident) if s.tensor.is_meta]
        if meta:
            raise ValueError(
                f"{len(meta)} tensors of the model are on the meta device (first: "
                f"{meta[0]!r}) and have no values: pass checkpoint= (a safetensors file or "
                "directory), or load the weights first"
            )
        check_replaceable(layout.empty, ValueError)
        return {}, {}, []
    for slot in layout.empty:  # Note: [Tensors with no elements] in _layout.py
        entry = checkpoint.find(_names(slot))
        if entry is not None:
            _check_entry(entry, entry.name, slot.tensor.dtype, tuple(slot.tensor.shape))
    reads, hosted = _match_checkpoint(layout, checkpoint, strict=strict)
    return reads, _resident_from_checkpoint(layout, checkpoint), hosted


def fill_host(host: torch.Tensor, layout: Layout, checkpoint: Checkpoint | None,
              reads: dict[Any, tuple[Entry, Leaf]]) -> None:  # fmt: skip
    """Copy every streamed storage into its piece of ``host``: from the checkpoint where
    ``reads`` says so, else from the model's tensor."""
    originals: dict[Any, torch.Tensor] = {}
    for leaf in layout.leaves:
        originals.setdefault(leaf.key, leaf.source)
    if checkpoint is not None:
        pieces, reordered = [], []
        for key, (entry, leaf) in reads.items():
            lo, _, off = layout.pieces[key]
            dst = _element_bytes(host, off + leaf.start - lo, leaf.size, leaf.stride,
                                 leaf.dtype.itemsize)  # fmt: skip
            if dst.is_contiguous():
                pieces.append((entry, dst.view(-1)))
            else:
                reordered.append((entry, dst))
        checkpoint.read_into(pieces)
        for entry, dst in reordered:  # see Note: [Reading into the host store]
            buf = torch.empty(entry.nbytes, dtype=torch.uint8)
            checkpoint.read_into([(entry, buf)])
            dst.copy_(buf.view(dst.shape))
    for key, t in originals.items():
        if key in reads:
            continue
        lo, hi, off = layout.pieces[key]
        storage = t.untyped_storage()
        src = torch.empty(0, dtype=torch.uint8, device=t.device)
        src.set_(storage, 0, (storage.nbytes(),), (1,))
        host[off : off + hi - lo].copy_(src[lo:hi])


# Note: [Checkpoint entries of tensors another engine hosts]
# A tensor that another engine hosts (an expert of `stream_experts`, applied first: Note:
# [Tensors hosted by another engine] in _layout.py) is still a tensor of the model, and its
# checkpoint entry is its value: it is read, straight into that engine's host store (the
# store's ``fill_piece``, through `_hosted.fill`), as torch's ``load_state_dict`` would load it
# into the plain model. It was left out: the expert computed silently with its old values
# (every expert of a Qwen3-MoE or a ModuleList mixture: logits 58 and 2455 off). Its entry is
# checked with the others before anything changes (dtype, shape; the tensor one whole C-order
# piece of a store that hands pieces out, else `CheckpointError`), counts as a match of the
# model, and a tensor the checkpoint lacks is refused under ``strict`` as any other (Note:
# [Tensors a checkpoint lacks]). The reads come last in the runtime's setup, after every
# check and allocation, each after the other engine's copies that read those bytes, with
# its cached copies forgotten (as a write of its store).


def _match_hosted(
    layout: Layout, checkpoint: Checkpoint, lacked: list[str]
) -> list[tuple[Entry, Slot]]:
    """The entries of the tensors another engine hosts (Note: [Checkpoint entries of tensors
    another engine hosts]), checked; the names of those it lacks go to ``lacked``."""
    out: list[tuple[Entry, Slot]] = []
    for slot in layout.hosted:
        names, t = _names(slot), slot.tensor
        entry = checkpoint.find(names)
        if entry is None:
            lacked.extend(names[:1])
            continue
        _check_entry(entry, names[0], t.dtype, tuple(t.shape))
        if not _hosted.fillable(t) or t.stride() != _c_strides(tuple(t.shape)):
            raise CheckpointError(
                f"{slot.name!r} streams with another engine that cannot read a checkpoint "
                "entry into it: load the checkpoint with load_state_dict, or pass no "
                "checkpoint"
            )
        out.append((entry, slot))
    return out


def fill_hosted(checkpoint: Checkpoint | None, hosted: list[tuple[Entry, Slot]]) -> None:
    """Read each entry into the host store of the engine that hosts its tensor (Note:
    [Checkpoint entries of tensors another engine hosts])."""
    for entry, slot in hosted:
        assert checkpoint is not None
        _hosted.fill(slot.tensor, lambda buf, entry=entry: checkpoint.read_into([(entry, buf)]))


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))


class HostStore:
    """The real values of one weight runtime's streamed tensors, in ``host`` (filled by
    `fill_host`). Reads and writes take the runtime's call lock (``calls``) and wait until no
    call runs; a write makes the arena (``pipeline``'s) forget what it holds. Implements
    `_hosted.HostStore` for the placeholders."""

    def __init__(self, layout: Layout, host: torch.Tensor, calls: Calls, pipeline: Pipeline):
        self.layout = layout
        self.host = host
        self.device = pipeline.device
        self.calls = calls
        self.pipeline = pipeline
        self.leaf_ids = {id(leaf.source) for leaf in layout.leaves}
        # id(state_dict() destination) -> (its weak reference, {storage key: host copy})
        self._copies: dict[int, tuple[weakref.ref, dict]] = {}

    def copies_for(self, destination: Any) -> dict[Any, torch.Tensor]:
        """The host copies made for one ``state_dict()`` destination so far (one per storage:
        tied weights held by several modules share it, as in the model), kept while it
        lives."""
        key = id(destination)
        entry = self._copies.get(key)
        if entry is not None and entry[0]() is destination:
            return entry[1]
        try:
            ref = weakref.ref(destination, lambda _, key=key: self._copies.pop(key, None))
        except TypeError:  # a destination that takes no weak reference
            return {}
        self._copies[key] = (ref, {})
        return self._copies[key][1]

    def host_value(self, slot: Slot, cache: dict[Any, torch.Tensor]) -> torch.Tensor:
        """A host copy of ``slot``'s values, views of one storage sharing one copy (``cache``,
        by storage key), rebuilt as the tensor type the model holds."""

        def make(leaf: Leaf) -> torch.Tensor:
            piece = cache.get(leaf.key)
            if piece is None:
                lo, hi, off = self.layout.pieces[leaf.key]
                piece = cache[leaf.key] = self.host[off : off + hi - lo].clone()
            lo = self.layout.pieces[leaf.key][0]
            v = torch.empty(0, dtype=leaf.dtype)
            return v.set_(piece.untyped_storage(), (leaf.start - lo) // v.element_size(),
                          leaf.size, leaf.stride)  # fmt: skip

        with self.calls.lock:
            self.calls.check_live()
            self.calls.wait_idle("state_dict()")
            if not is_composite(slot.tensor):
                return make(slot.leaves[0])
            return rebuild(slot.tensor, iter(slot.leaves), make, torch.device("cpu"),
                           self.leaf_ids)  # fmt: skip

    def write_host(self, slot: Slot, value: Any) -> str | None:
        """Copy ``value`` into ``slot``'s bytes in the host store; the arena forgets what it
        holds. Returns an error message instead when ``value`` does not fit."""
        if not isinstance(value, torch.Tensor):
            return f"expected a tensor for {slot.name!r}, got {type(value).__name__}"
        pairs: list[tuple[Leaf, torch.Tensor]] = []
        error = _match(slot.tensor, value, iter(slot.leaves), self.leaf_ids, pairs, slot.name)
        if error is not None:
            return error
        with self.calls.lock:
            self.calls.check_live()
            self.calls.wait_idle("load_state_dict()")
            self.pipeline.sync()  # nothing may still read the host bytes
            with torch.no_grad():
                for leaf, v in pairs:
                    self._view(leaf).copy_(v)
            self.pipeline.forget()
            self._copies.clear()
        return None

    def read_piece(self, key: Any) -> torch.Tensor:
        """_hosted.HostStore: the piece's bytes, copied to the device on the compute stream. The
        host store changes only between calls (`write_host`, `write_piece`), so a read inside a
        call needs no wait."""
        with self.calls.lock:
            if self.calls.removed:
                raise _hosted.HostedError(
                    "this streamed tensor's WeightStreamHandle was removed: the tensor is a "
                    "leftover view of it; take it from the model again"
                )
            lo, hi, off = self.layout.pieces[key]
            data = self.host[off : off + hi - lo]
            if self.device.type == "cpu":
                return data.clone()
            out = torch.empty(hi - lo, dtype=torch.uint8, device=self.device)
            out.copy_(data)  # synchronous for the host: the store may change after it
            return out

    def write_piece(self, key: Any, data: torch.Tensor, written: list[tuple[int, int]]) -> None:
        """_hosted.HostStore: write the piece's bytes into the host store; the arena forgets
        what it holds (as `write_host`)."""
        with self.calls.lock:
            if self.calls.removed:
                raise _hosted.HostedError("this streamed tensor's WeightStreamHandle was removed")
            self.calls.wait_idle("a write to a streamed tensor outside its unit")
            self.pipeline.sync()  # nothing may still read the host bytes
            lo, hi, off = self.layout.pieces[key]
            with torch.no_grad():
                self.host[off : off + hi - lo].copy_(data)
            self.pipeline.forget()
            self._copies.clear()

    def _view(self, leaf: Leaf) -> torch.Tensor:
        lo, _, off = self.layout.pieces[leaf.key]
        v = torch.empty(0, dtype=leaf.dtype)
        return v.set_(self.host.untyped_storage(), (off + leaf.start - lo) // v.element_size(),
                      leaf.size, leaf.stride)  # fmt: skip


def _names(slot: Any) -> list[str]:
    """The tensor's ``state_dict()`` names: a non-persistent buffer has none, so a checkpoint
    entry under its name is not read into it (torch's ``load_state_dict`` ignores it too)."""
    return [
        q
        for module, kind, q in slot.where
        if kind != "_buffers" or q.rpartition(".")[2] not in module._non_persistent_buffers_set
    ]


# Note: [Tensors a checkpoint lacks]
# A tensor of the model that the checkpoint does not hold under any of its ``state_dict()``
# names (a tied weight saved once is held) is an error by default, as torch's
# ``load_state_dict(strict=True)``: a model built with random values and a checkpoint whose
# names mostly differ (another prefix, a shard missing from the index) would otherwise compute
# silently with random weights. ``strict=False`` keeps such a tensor's own values. Not
# required: non-persistent buffers (not in ``state_dict()``, never read from a checkpoint)
# and tensors with no elements (no values). Tensors another engine hosts are required too
# (Note: [Checkpoint entries of tensors another engine hosts]). A tensor on meta that the
# checkpoint lacks has no values: an error whatever ``strict`` says. Entries the model does
# not have are ignored (older Hugging Face checkpoints hold ``rotary_emb.inv_freq``), unless
# no entry matches at all: then it is not this model's checkpoint.


def _match_checkpoint(
    layout: Layout, checkpoint: Checkpoint, *, strict: bool = True
) -> tuple[dict[Any, tuple[Entry, Leaf]], list[tuple[Entry, Slot]]]:
    """For each streamed storage the checkpoint holds: its entry and its leaf, checked (name
    under any of the tensor's names, dtype, shape, a whole contiguous storage); and the
    entries of hosted tensors (`_match_hosted`). Raises
    `CheckpointError` before anything is read or changed; a tensor on the meta device that the
    checkpoint lacks is an error (it has no values), and so is any other it lacks if ``strict``
    (Note: [Tensors a checkpoint lacks])."""
    reads: dict[Any, tuple[Entry, Leaf]] = {}
    missing: list[str] = []  # on meta: no values
    lacked: list[str] = []  # real: they would keep their own values
    by_key: dict[Any, list[tuple[Slot, Leaf]]] = {}  # tensors sharing a storage: tied
    for slot in layout.streamed:
        t = slot.tensor
        if is_composite(t) or len(slot.leaves) != 1:
            if any(n in checkpoint.entries for n in _names(slot)) or t.is_meta:
                raise CheckpointError(
                    f"{slot.name!r} is a {type(t).__qualname__} made of several buffers: "
                    "loading it from a checkpoint is not supported; materialize it and pass "
                    "no checkpoint"
                )
            lacked.extend(_names(slot)[:1])
            continue
        by_key.setdefault(slot.leaves[0].key, []).append((slot, slot.leaves[0]))
    for group in by_key.values():
        names = [n for slot, _ in group for n in _names(slot)]
        entry = checkpoint.find(names)
        if entry is None:
            if any(leaf.source.is_meta for _, leaf in group):
                missing.append(group[0][0].name)
            else:
                lacked.extend(names[:1])
            continue
        first = group[0][1]
        for slot, leaf in group:
            _check_entry(entry, names[0], leaf.dtype, leaf.size)
            why = _unfillable(leaf)
            if why is None and (leaf.start, leaf.stride) != (first.start, first.stride):
                why = f"views the storage of {group[0][0].name!r} with other strides"
            if why is not None:
                raise CheckpointError(
                    f"{slot.name!r} {why}: a checkpoint's values cannot be read into it. Give "
                    "it a storage of its own before streaming (module.w = nn.Parameter("
                    "w.contiguous()); a buffer: w.contiguous()), or load the checkpoint with "
                    "load_state_dict and pass no checkpoint"
                )
        reads[first.key] = (entry, first)
    hosted = _match_hosted(layout, checkpoint, lacked)
    if (
        not reads
        and not hosted
        and not any(n in checkpoint.entries for slot in layout.resident for n in _names(slot))
    ):
        raise CheckpointError(
            f"no tensor of the model is in the checkpoint {checkpoint.source} (model names "
            f"like {layout.streamed[0].name!r}, checkpoint names like "
            f"{next(iter(checkpoint.entries), '(none)')!r}): is it this model's checkpoint?"
        )
    check_replaceable((*layout.streamed, *layout.resident, *layout.empty), CheckpointError)
    for slot in layout.resident:
        names = _names(slot)
        if not any(n in checkpoint.entries for n in names):
            if slot.tensor.is_meta:
                missing.append(slot.name)
            else:
                lacked.extend(names[:1])
    if missing:
        raise CheckpointError(
            f"{len(missing)} tensors are on the meta device and not in the checkpoint "
            f"{checkpoint.source} (first: {', '.join(map(repr, missing[:5]))}): they have no "
            "values. Check that the checkpoint is this model's (names as in state_dict()); "
            "buffers computed at construction (rotary tables) must be real: build with "
            "accelerate's init_empty_weights(include_buffers=False)"
        )
    if strict and lacked:
        are = "tensor of the model is" if len(lacked) == 1 else "tensors of the model are"
        raise CheckpointError(
            f"{len(lacked)} {are} not in the checkpoint {checkpoint.source} (first: "
            f"{', '.join(map(repr, lacked[:5]))}): they would keep the values they have now. "
            "Check that the checkpoint is this model's and complete (names as in "
            "state_dict(), every shard in the index), or pass strict=False to keep their own "
            "values"
        )
    return reads, hosted


def check_replaceable(slots: tuple[Slot, ...], error: type[ValueError]) -> None:
    """A tensor on the meta device gets its contents swapped in place (`set_data`), which a
    weak reference to it prevents: refused before anything changes."""
    for slot in slots:
        t = slot.tensor
        if t.is_meta and weakref.getweakrefs(t):
            raise error(
                f"{slot.name!r} is on the meta device and something holds a weak reference to "
                "it: its contents cannot be replaced in place; drop the reference (or build "
                "the model on the host) and retry"
            )


def _check_entry(entry: Entry, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if entry.dtype != dtype or entry.shape != tuple(shape):
        raise CheckpointError(
            f"{name!r} is {list(shape)} {dtype} in the model but {list(entry.shape)} "
            f"{entry.dtype} in {entry.path}"
        )


def _resident_from_checkpoint(layout: Layout, checkpoint: Checkpoint) -> dict[int, torch.Tensor]:
    """The checkpoint's values of the resident tensors it holds, on the host (id(tensor) ->
    value), read before any model tensor changes."""
    out: dict[int, torch.Tensor] = {}
    for slot in layout.resident:
        t = slot.tensor
        names = _names(slot)
        entry = checkpoint.find(names)
        if entry is None:
            continue
        if is_composite(t):
            raise CheckpointError(
                f"resident {names[0]!r} is a {type(t).__qualname__}: loading it from a "
                "checkpoint is not supported"
            )
        _check_entry(entry, names[0], t.dtype, tuple(t.shape))
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        checkpoint.read_into([(entry, buf)])
        if t.is_contiguous() or not _dense(t.shape, t.stride()):  # a view: C order, its own
            out[id(t)] = buf.view(t.dtype).reshape(t.shape)
            continue
        value = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)  # strides kept
        whole = torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage())
        _element_bytes(whole, 0, tuple(t.shape), t.stride(), t.dtype.itemsize).copy_(
            buf.view(*t.shape, -1)
        )
        out[id(t)] = value
    return out


def _dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """The elements fill one block of memory with no gap and no overlap, in any order of the
    dimensions (a transposed weight is dense, a slice or an expanded tensor is not)."""
    expected = 1
    for st, n in sorted((st, n) for n, st in zip(size, stride, strict=True) if n != 1):
        if st != expected:
            return False
        expected *= n
    return True


def _unfillable(leaf: Leaf) -> str | None:
    """Why a checkpoint entry (its elements in C order) cannot fill ``leaf``'s bytes, or None:
    it can when the leaf's elements are the dense block its storage starts with."""
    if leaf.start != 0:
        return "is a view into a larger storage (it starts inside it)"
    numel = 1
    for n in leaf.size:
        numel *= n
    extent = (leaf.end - leaf.start) // leaf.dtype.itemsize
    if extent < numel or any(
        st == 0 and n > 1 for n, st in zip(leaf.size, leaf.stride, strict=True)
    ):
        return "has elements that share memory (an expanded tensor)"
    if not _dense(leaf.size, leaf.stride):
        return "is a view into a larger storage (its elements are not one dense block)"
    return None


def _element_bytes(base: torch.Tensor, start: int, size: tuple[int, ...],
                   stride: tuple[int, ...], itemsize: int) -> torch.Tensor:  # fmt: skip
    """The bytes of a tensor of ``size`` and ``stride`` (in elements of ``itemsize`` bytes)
    at byte ``start`` of ``base`` (1-D uint8), as a uint8 view with a last dimension for each
    element's bytes: a copy between two layouts moves bytes, for every dtype."""
    return base[start:].as_strided((*size, itemsize), (*(s * itemsize for s in stride), 1))


def rebuild(t: torch.Tensor, leaves, make, dev: torch.device, leaf_ids: set[int]):
    """``t`` (a composite) rebuilt with ``make(leaf)`` for each of its streamed inner tensors
    (``leaf_ids``, in flatten order, matching ``leaves``); other empty ones made on ``dev``."""
    entries, rebuild_fn = flatten(t)
    moved: list[Any] = []
    for e in entries:
        if not isinstance(e, torch.Tensor):
            moved.append(e)
        elif is_composite(e):
            moved.append(rebuild(e, leaves, make, dev, leaf_ids))
        elif id(e) in leaf_ids:
            moved.append(make(next(leaves)))
        else:
            moved.append(torch.empty(e.shape, dtype=e.dtype, device=dev))
    return rebuild_fn(moved)


def _match(ours: torch.Tensor, value: torch.Tensor, leaves, leaf_ids: set[int], out: list,
           name: str) -> str | None:  # fmt: skip
    """Pair each streamed inner tensor of ``ours`` with the tensor of ``value`` in its place
    (same structure, shape and dtype); an error message when they differ."""
    if is_composite(ours):
        if type(value) is not type(ours):
            return f"{name!r} is a {type(ours).__qualname__}, got a {type(value).__qualname__}"
        mine, _ = flatten(ours)
        theirs, _ = flatten(value)
        if len(mine) != len(theirs):
            return f"{name!r}: the {type(ours).__qualname__} has another structure"
        for a, b in zip(mine, theirs, strict=True):
            if isinstance(a, torch.Tensor) and (is_composite(a) or id(a) in leaf_ids):
                error = _match(a, b, leaves, leaf_ids, out, name)
                if error is not None:
                    return error
        return None
    leaf = next(leaves)
    if not isinstance(value, torch.Tensor):
        return f"{name!r}: expected a tensor, got {type(value).__name__}"
    if tuple(value.shape) != leaf.size or value.dtype != leaf.dtype:
        return (
            f"{name!r}: expected {leaf.dtype} of shape {list(leaf.size)}, got {value.dtype} of "
            f"shape {list(value.shape)}"
        )
    out.append((leaf, value))
    return None
