"""What a weight runtime does to the model's tensors: at setup each streamed tensor is emptied
into a placeholder (composites not on the compute device are rebuilt there) and resident ones
are moved to the device; while its unit runs a streamed tensor is bound in place to its bytes
in the arena; `restore()` puts every tensor back with its values from the host store."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from torchoffload import _hosted
from torchoffload._flatten import is_composite
from torchoffload.weights._arena import UnitState
from torchoffload.weights._layout import Layout, Leaf, nbytes
from torchoffload.weights._store import HostStore, rebuild

# Every tensor that a live runtime streams (the slot tensors the modules hold): streaming a
# model that shares one of them with a streamed model would find it empty.
STREAMED: WeakIdKeyDictionary = WeakIdKeyDictionary()

# Note: [Binding weights in place]
# A streamed tensor keeps its identity (the `nn.Parameter` object an optimizer, a tied module or
# the user holds): only its storage changes. Before its unit runs it is `set_` to its bytes in
# the arena, with its own dtype, size and stride; after the unit it is `set_` to an empty
# storage on the compute device (0 elements). So outside its unit's forward a streamed weight
# is empty: code that reads it there fails loudly (a shape error) instead of reading stale or
# foreign bytes. Each tensor starts at the same address modulo 512 as a caching-allocator
# block, so kernels that pick an algorithm by alignment pick the one they pick without
# streaming (bitwise parity). Composite tensors (quantized data + scales, DTensor) are bound
# buffer by buffer through the flatten layer (Note: [One flatten layer for every engine]).
# A bind first checks the tensor's dtype: `model.to(dtype)` replaces an empty tensor's data
# with one of another dtype, and binding that to the stored bytes would reinterpret them.


class Binding:
    """The model's streamed and resident tensors as one weight runtime changed them, until
    `restore`. Built empty; `setup` changes the model."""

    def __init__(self, layout: Layout, device: torch.device):
        self.layout = layout
        self.device = device
        self.empty = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
        self.device_index = -1 if device.type == "cpu" else device.index
        # - Module state changed until `restore()`
        self.bound: dict[Leaf, torch.Tensor] = {leaf: leaf.source for leaf in layout.leaves}
        self.leaf_ids = {id(leaf.source) for leaf in layout.leaves}
        self.replaced: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        self.moved: list[tuple[torch.Tensor, torch.device]] = []
        # (tensor with no elements, the tensor it had): Note: [Tensors with no elements]
        self.placed: list[tuple[torch.Tensor, torch.Tensor]] = []
        # id(tensor) -> (its class while bound, its placeholder class)
        self.classes: dict[int, tuple[type, type]] = {}

    # -- setup -------------------------------------------------------------------------------

    def setup(self, owner: Any, store: HostStore, storage: torch.UntypedStorage,
              units: list[UnitState], resident: dict[int, torch.Tensor]) -> int:  # fmt: skip
        """Change the model: composites rebuilt over the arena's ``storage``, every streamed
        tensor emptied into a placeholder of ``store``'s values, resident tensors moved to the
        device (``resident``: values read from a checkpoint, by id), the units' binds listed,
        the streamed tensors registered as ``owner``'s. Returns the resident bytes."""
        self._rebuild_composites(owner, storage)
        self._empty_sources(store)
        resident_bytes = self._move_resident(resident)
        self._place_empty()
        for unit in units:
            unit.binds = [(self.bound[leaf], off, leaf) for leaf, off in unit.layout.binds]
            unit.classes = [self.classes.get(id(t)) for t, _, _ in unit.binds]
        for slot in self.layout.streamed:
            STREAMED[slot.tensor] = owner
        return resident_bytes

    def _rebuild_composites(self, owner: Any, storage: torch.UntypedStorage) -> None:
        """Composites that are not on the compute device: a wrapper subclass fixes its device
        when it is built, so each is rebuilt on the device (buffers created over the arena,
        bound in place later like any other) and replaces the original in its modules until
        `restore()`."""
        dev = self.device

        def make(leaf: Leaf) -> torch.Tensor:
            m = torch.empty(0, dtype=leaf.dtype, device=dev)
            m.set_(storage, 0, leaf.size, leaf.stride)  # geometry only; bound before every use
            self.bound[leaf] = m
            return m

        for slot in self.layout.streamed:
            t = slot.tensor
            if not is_composite(t) or t.device == dev:
                continue
            new = rebuild(t, iter(slot.leaves), make, dev, self.leaf_ids)
            for module, kind, qual in slot.where:
                attr = qual.rsplit(".", 1)[-1]
                if getattr(module, kind).get(attr) is t:
                    self.replaced.append((module, kind, attr, t))
                    getattr(module, kind)[attr] = new
                    STREAMED[new] = owner

    def _empty_sources(self, store: HostStore) -> None:
        dev = self.device
        plain = {id(leaf.source) for s in self.layout.streamed if not is_composite(s.tensor)
                 for leaf in s.leaves}  # fmt: skip
        for leaf in self.layout.leaves:
            t = self.bound[leaf]
            if t.device != dev:
                set_data(t, torch.empty(0, dtype=t.dtype, device=dev))
            t.set_(self.empty, 0, (0,), (1,))
            if leaf.source is not t:  # a rebuilt composite's original buffer: free its bytes
                gone = torch.empty(0, dtype=torch.uint8, device=leaf.device).untyped_storage()
                leaf.source.set_(gone, 0, (0,), (1,))
            hosted = _hosted.hosted_class(type(t))
            if id(t) in plain and hosted is not None and id(t) not in self.classes:
                lo = self.layout.pieces[leaf.key][0]
                offset = (leaf.start - lo) // t.element_size()
                ref = _hosted.Ref(store, leaf.key, offset, leaf.size, leaf.stride, leaf.dtype,
                                  leaf.name, type(t))  # fmt: skip
                self.classes[id(t)] = (type(t), hosted)
                _hosted.register(t, ref)  # Note: [Placeholders never answer]

    def _move_resident(self, loaded_values: dict[int, torch.Tensor]) -> int:
        dev = self.device
        total = 0
        for slot in self.layout.resident:
            t = slot.tensor
            total += nbytes(t)
            loaded = loaded_values.get(id(t))
            if loaded is not None:
                self.moved.append((t, t.device))
                set_data(t, loaded.to(dev))
                continue
            if t.device == dev:
                continue
            self.moved.append((t, t.device))
            t.data = t.data.to(dev)
        return total

    def _place_empty(self) -> None:
        """Tensors with no elements made on the device (Note: [Tensors with no elements])."""
        for slot in self.layout.empty:
            t = slot.tensor
            if t.device != self.device:
                self.placed.append((t, t.data))
                set_data(t, _empty_like(t, self.device))

    # -- one unit (Note: [Binding weights in place]) -----------------------------------------

    def bind(self, unit: UnitState, storage: torch.UntypedStorage) -> None:
        """Bind the unit's tensors to their bytes in ``storage`` (the arena's) at its place."""
        base = unit.loc
        versions = unit.versions
        versions.clear()
        index = self.device_index  # get_device(): an int, no torch.device made per tensor
        # Gradients are off here (`enter` checked), so set_ on a leaf needs no no_grad().
        classes = unit.classes
        for k, (t, off, leaf) in enumerate(unit.binds):
            cls = classes[k]
            if cls is not None:
                t.__class__ = cls[0]  # Note: [Placeholders never answer]
            if t.dtype is not leaf.dtype or t.get_device() != index:
                self.unbind(unit, k + 1)  # this one too: its class is swapped
                raise RuntimeError(self._converted(leaf, t))
            t.set_(storage, (base + off) // t.element_size(), leaf.size, leaf.stride)
        # Read after all set_ calls: views of one storage share a version counter.
        versions.extend(t._version for t, _, _ in unit.binds)

    def _converted(self, leaf: Leaf, t: torch.Tensor) -> str:
        return (
            f"streamed tensor {leaf.name!r} was changed from {leaf.dtype} on {self.device} to "
            f"{t.dtype} on {t.device} (model.to(), .half(), .float() or .cpu() while "
            "stream_weights is active); its values are in the host store and were not "
            "converted. Call the handle's remove() first (it restores the original dtype and "
            "device), convert, then stream again"
        )

    def unbind(self, unit: UnitState, count: int | None = None) -> None:
        """Unbind the unit's tensors (its first ``count`` of them)."""
        empty = self.empty
        grad = torch.is_grad_enabled()  # a forward may have turned them on inside its unit
        classes = unit.classes
        with torch.no_grad() if grad else contextlib.nullcontext():
            binds = unit.binds if count is None else unit.binds[:count]  # no copy per call
            for k, (t, _, _) in enumerate(binds):
                cls = classes[k]
                if cls is not None:
                    t.__class__ = cls[0]
                t.set_(empty, 0, (0,), (1,))
                if cls is not None:
                    t.__class__ = cls[1]

    def check(self, unit: UnitState, output: Any, ptr: int) -> str | None:
        """What is wrong after the unit's forward (``ptr``: the arena's address): a weight
        written in place, or an output that views the arena; None if nothing."""
        for (t, _, leaf), version in zip(unit.binds, unit.versions, strict=True):
            if t._version != version:
                return (
                    f"streamed tensor {leaf.name!r} was modified in place during the forward of "
                    f"{unit.name!r}; the change would be lost when the unit is evicted. Keep it "
                    f"on the device with resident=({leaf.name!r},). (Under torch.compile this "
                    "is what a compiled graph does to a streamed weight: stream_weights runs "
                    "eagerly; for a compiled program use torchoffload.compile."
                    "stream_exported_weights)"
                )
        for t in _tensors(output):
            if t.device == self.device and t.untyped_storage().data_ptr() == ptr:
                return (
                    f"{unit.name!r} returned a tensor that shares memory with its streamed "
                    "weights (a view of a weight); its bytes will be overwritten. Return a copy, "
                    "or keep the weight resident"
                )
        return None

    # -- remove ------------------------------------------------------------------------------

    def unregister(self) -> None:
        """Plain tensors again (before they are rebound by `restore`)."""
        for leaf in self.layout.leaves:
            _hosted.unregister(self.bound[leaf])

    def restore(self, host: torch.Tensor) -> None:
        """Every tensor back where it was, with its values from ``host`` (the host store)."""
        by_key: dict[Any, list[Leaf]] = {}
        for leaf in self.layout.leaves:
            by_key.setdefault(leaf.key, []).append(leaf)
        for key, leaves in by_key.items():
            lo, hi, host_off = self.layout.pieces[key]
            device = _restored_device(leaves[0].device)
            data = host[host_off : host_off + hi - lo]
            copy = data.clone() if device.type == "cpu" else data.to(device)
            storage = copy.untyped_storage()
            for leaf in leaves:
                t = leaf.source
                if t.device != device or t.dtype != leaf.dtype:  # see bind
                    t.data = torch.empty(0, dtype=leaf.dtype, device=device)
                t.set_(storage, (leaf.start - lo) // t.element_size(), leaf.size, leaf.stride)
        for module, kind, name, original in self.replaced:
            getattr(module, kind)[name] = original
        for t, device in self.moved:
            t.data = t.data.to(_restored_device(device))
        for t, had in self.placed:
            t.data = _empty_like(had, torch.device("cpu")) if had.is_meta else had


def set_data(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t.data = value``, also for a ``t`` on the meta device (whose ``.data`` cannot take a
    real tensor): there the tensor's contents are swapped, keeping the object (a parameter
    stays the same `nn.Parameter`, tied weights stay tied)."""
    if not t.is_meta or value.is_meta:
        t.data = value
        return
    if isinstance(t, torch.nn.Parameter):
        new = torch.Tensor._make_subclass(type(t), value, t.requires_grad)
    else:
        new = value.as_subclass(type(t))
    new.__dict__.update(t.__dict__)  # swap_tensors swaps __dict__ too: keep the attributes
    torch.utils.swap_tensors(t, new)


def _empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor with ``t``'s shape, strides and dtype on ``device`` (``t`` has no elements)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def _restored_device(device: torch.device) -> torch.device:
    """Where `restore()` puts a tensor back: where it was, except that a tensor that was on
    the meta device (its values came from a checkpoint) comes back on the host."""
    return torch.device("cpu") if device.type == "meta" else device


def _tensors(output: Any, depth: int = 0):
    if type(output) in (torch.Tensor, nn.Parameter):
        yield output
    elif depth < 3 and isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item, depth + 1)
