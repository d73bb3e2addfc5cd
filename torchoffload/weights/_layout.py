"""The weight engine's layout: how a model's weights are cut into units and placed in the host
store and in a unit's span of the arena.

Everything here is a pure function of the model and the settings: computing a layout reads the
model and changes nothing. `plan` chooses among the candidate cuts by comparing their values;
`minimum_budget` is `Layout.least_budget` of the same values; the runtime builds its state from
the chosen one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchoffload import _hosted
from torchoffload._flatten import flatten, is_composite
from torchoffload._modules import find_layers, matches

ALIGN = 512  # the caching allocator's alignment; see Note: [Binding weights in place]
_MiB = 1 << 20

Where = tuple[nn.Module, str, str]  # (module, "_parameters" | "_buffers", qualified name)


def round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def round_down(n: int, to: int = ALIGN) -> int:
    return n // to * to


@dataclass(frozen=True, eq=False)
class Leaf:
    """A plain tensor bound in place: a parameter, a buffer, or a composite's inner buffer,
    with its geometry as setup found it. ``key`` names its storage; ``[start, end)`` is the
    byte range of that storage it covers."""

    source: torch.Tensor
    name: str
    key: tuple[int, torch.device]
    start: int
    end: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor, name: str) -> Leaf:
        itemsize = t.element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        start = t.storage_offset() * itemsize
        storage = t.untyped_storage()
        # Meta storages all have data_ptr 0: they are told apart by the storage itself.
        key = (storage._cdata if t.is_meta else storage.data_ptr(), t.device)
        return Leaf(
            t, name, key, start, start + extent * itemsize,
            tuple(t.shape), t.stride(), t.dtype, t.device,
        )  # fmt: skip


@dataclass(frozen=True, eq=False)
class Slot:
    """A tensor object held by the model's modules, with every place that holds it (tied weights
    are one slot held in two places) and, when streamed, its leaves in flatten order."""

    tensor: torch.Tensor
    where: tuple[Where, ...]
    leaves: tuple[Leaf, ...] = ()

    @property
    def name(self) -> str:
        return self.where[0][2]


@dataclass(frozen=True, eq=False)
class UnitLayout:
    """One unit: the module whose forward binds it, its leaves at their byte offsets in the
    unit's span, and the copies (host offset, unit offset, bytes) that fill that span."""

    name: str
    module: nn.Module
    binds: tuple[tuple[Leaf, int], ...]
    segments: tuple[tuple[int, int, int], ...]
    nbytes: int  # span in the arena, 512-aligned
    copy_bytes: int  # bytes copied to fill it


@dataclass(frozen=True, eq=False)
class Layout:
    """A cut of the model into units and where every streamed byte lives."""

    kind: str  # "blocks", "leaves" or "given"
    units: tuple[UnitLayout, ...]
    streamed: tuple[Slot, ...]
    resident: tuple[Slot, ...]
    pieces: dict[Any, tuple[int, int, int]]  # storage key -> (lo, hi, host offset)
    host_bytes: int
    # tensors another engine hosts, left alone (Note: [Tensors hosted by another engine])
    hosted: tuple[Slot, ...] = ()
    # plain tensors with no elements, in no unit (Note: [Tensors with no elements])
    empty: tuple[Slot, ...] = ()

    @property
    def leaves(self) -> list[Leaf]:
        return [leaf for slot in self.streamed for leaf in slot.leaves]

    @property
    def streamed_bytes(self) -> int:
        return sum(hi - lo for lo, hi, _ in self.pieces.values())

    def pipeline(self, depth: int) -> int:
        return min(depth + 1, len(self.units))

    def least_budget(self, depth: int) -> int:
        """The smallest arena that runs this cut ``depth`` units ahead: the pipeline times the
        largest unit."""
        return self.pipeline(depth) * max(u.nbytes for u in self.units)

    def arena_bytes(self, budget: int) -> int:
        return min(round_down(budget), sum(u.nbytes for u in self.units))

    def streamed_per_call(self, budget: int, depth: int) -> int:
        """Bytes copied per call once the kept units are in place (an estimate that assumes
        every unit runs once per call). See Note: [Kept units]."""
        sizes = [u.nbytes for u in self.units]
        kept = plan_kept(sizes, self.arena_bytes(budget), min(depth + 2, len(sizes)))
        return sum(sizes) - sum(sizes[i] for i in kept)

    def budget_error(self, budget: int, depth: int) -> str:
        largest = max(self.units, key=lambda u: u.nbytes)
        need = self.least_budget(depth)
        hint = " or unit='leaves'" if self.kind == "blocks" else ""
        return (
            f"budget_bytes={budget} ({budget / _MiB:.1f} MiB) cannot hold {self.pipeline(depth)} "
            f"units (prefetch_depth={depth} + the one computing) of the largest unit "
            f"{largest.name!r} ({largest.nbytes / _MiB:.1f} MiB): the minimum budget is "
            f"{need / _MiB:.1f} MiB ({need} bytes). Raise budget_bytes, lower prefetch_depth"
            f"{hint}, or keep large modules resident."
        )


def plan_kept(sizes: list[int], arena: int, depth: int) -> list[int]:
    """Indices of the units to keep in an arena of ``arena`` bytes, largest first, while the
    ring left for the others holds ``depth`` of the largest of them (or all of them)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    total = sum(sizes)
    kept: list[int] = []
    kept_bytes = 0
    skipped_max = 0  # largest unit passed over so far (it stays in the ring)
    for pos, i in enumerate(order):
        following = sizes[order[pos + 1]] if pos + 1 < len(order) else 0
        need = min(depth * max(skipped_max, following), total - kept_bytes - sizes[i])
        if arena - kept_bytes - sizes[i] >= need:
            kept.append(i)
            kept_bytes += sizes[i]
        else:
            skipped_max = max(skipped_max, sizes[i])
    return kept


# -- finding the tensors -----------------------------------------------------------------------


def find_slots(model: nn.Module) -> list[Slot]:
    """Every tensor object held by a module, once, with all the places that hold it."""
    found: dict[int, tuple[torch.Tensor, list[Where]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    qual = f"{prefix}.{name}" if prefix else name
                    found.setdefault(id(t), (t, []))[1].append((module, kind, qual))
    return [Slot(t, tuple(where)) for t, where in found.values()]


def leaves_of(t: torch.Tensor, name: str) -> list[Leaf]:
    """The plain tensors to bind for ``t``: itself, or a composite's buffers (recursively, in
    flatten order)."""
    if not is_composite(t):
        if t.layout is not torch.strided:
            raise TypeError(f"cannot stream {name!r}: layout {t.layout} is not strided")
        return [Leaf.of(t, name)]
    entries, _ = flatten(t)
    again, _ = flatten(t)
    out: list[Leaf] = []
    for i, (e, e2) in enumerate(zip(entries, again, strict=True)):
        if not isinstance(e, torch.Tensor):
            continue
        if e is not e2:
            raise TypeError(
                f"cannot stream {name!r}: flattening a {type(t).__qualname__} returns new "
                "tensors each time, so its buffers cannot be bound in place"
            )
        if is_composite(e) or e.numel():
            out.extend(leaves_of(e, f"{name}[{i}]"))
    return out


def nbytes(t: torch.Tensor) -> int:
    if is_composite(t):
        entries, _ = flatten(t)
        return sum(nbytes(e) for e in entries if isinstance(e, torch.Tensor))
    return t.untyped_storage().nbytes()


# -- cutting -----------------------------------------------------------------------------------


def candidates(
    model: nn.Module, resident: tuple[str, ...], unit: str | Sequence[nn.Module] | None
) -> list[Layout]:
    """The layouts ``unit`` allows, in order of preference (blocks before leaves). Raises
    `ValueError` for bad settings or when there is nothing to stream.

    Note: [Tensors hosted by another engine]
    A tensor that is already a placeholder of another engine's host store (``_hosted.REFS``;
    the caller has refused tensors of another weight runtime) is that engine's: today an
    expert tensor of `stream_experts`, which binds it inside its own forward (a routed expert
    inside its block) and serves its reads and writes outside it. A layout leaves it alone: it
    is in no unit and not resident, counts in no budget (nor `minimum_budget`), is not moved
    or copied, and `remove()` does not touch it; a list of modules whose tensors are all
    hosted elsewhere (a ModuleList of experts) is not a candidate for the blocks. Units still
    run around such tensors: a unit's module may hold them (a decoder layer with its experts),
    and while the unit's own tensors are bound the other engine binds its own. So the engines
    compose in one order, the other engine first and `stream_weights` over what it left, and
    come off in the reverse order (stream_experts refuses to start on a model whose tensors
    stream_weights holds, and refuses `remove()` while stream_weights holds its dense
    tensors: it would move them back under stream_weights). A graph captured by one engine
    does not drive the other's copies: `cuda_graph` refuses a layout with hosted tensors, and
    stream_experts' `cuda_graph` refuses while stream_weights holds its dense tensors. A
    checkpoint's entry of such a tensor is read into the other engine's store (Note:
    [Checkpoint entries of tensors another engine hosts] in _store.py).

    Note: [Tensors with no elements]
    A plain tensor with no elements has no bytes to store or copy: it is in no unit, neither
    streamed nor resident (nor listed as resident), and counts in no budget. Its values are
    exact all the same, so it is placed as a resident tensor would be: one not on the
    compute device (built on meta, or on the host for a GPU) is made there, an empty tensor
    of its shape, dtype and strides in the same object (optimizers and tied modules hold
    it); `remove()` gives it back the tensor it had or, if that was on meta, an empty one on
    the host (as every tensor that was on meta). A checkpoint need not hold it; if it does,
    the entry's dtype and shape are checked. A composite with no elements is left as it is.
    `stream_parameters` places them the same way, and leaves them on the device after
    `remove()`, as its resident tensors (one on meta stayed there: the forward raised).
    """
    slots = find_slots(model)
    streamed: list[Slot] = []
    resident_slots: list[Slot] = []
    hosted: list[Slot] = []
    empty: list[Slot] = []
    for slot in slots:
        if slot.tensor in _hosted.REFS:
            hosted.append(slot)
            continue
        if slot.tensor.numel() == 0:  # Note: [Tensors with no elements]
            if not is_composite(slot.tensor):
                empty.append(slot)
            continue
        if resident and any(matches(q, resident) for _, _, q in slot.where):
            resident_slots.append(slot)
        else:
            streamed.append(slot)
    for pattern in resident:
        if not any(matches(q, (pattern,)) for s in slots for _, _, q in s.where):
            raise ValueError(f"resident pattern {pattern!r} matches no parameter or buffer")
        if not any(matches(q, (pattern,)) for s in (*streamed, *resident_slots, *empty)
                   for _, _, q in s.where):  # fmt: skip
            first = next(q for s in hosted for _, _, q in s.where if matches(q, (pattern,)))
            raise ValueError(
                f"resident pattern {pattern!r} matches only tensors that stream with another "
                f"engine (first: {first!r}): that engine keeps them, not stream_weights"
            )
    if not streamed:
        raise ValueError(
            "stream_weights has nothing to stream: "
            + (
                f"all {len(resident_slots)} tensors match resident={resident!r}"
                if resident_slots
                else f"every tensor of {type(model).__name__} streams with another engine"
                if hosted
                else f"{type(model).__name__} has no parameters or buffers"
            )
        )
    streamed = [Slot(s.tensor, s.where, tuple(leaves_of(s.tensor, s.name))) for s in streamed]
    owners: list[nn.Module] = []  # modules holding streamed tensors themselves
    seen: set[int] = set()
    for slot in streamed:
        for module, _, _ in slot.where:
            if id(module) not in seen:
                seen.add(id(module))
                owners.append(module)
    out = []
    for modules, kind in _cuts(model, owners, unit, _hosted_only(hosted)):
        layout = cut(model, modules, kind, streamed, resident_slots, hosted, empty)
        if layout is not None:
            out.append(layout)
    if not out:
        raise ValueError("stream_weights has nothing to stream: every tensor is resident")
    return out


def _hosted_only(hosted: list[Slot]) -> Callable[[nn.ModuleList], bool] | None:
    """Which lists of modules are no candidate for the blocks: those holding tensors, all of
    them another engine's (None: no tensor is)."""
    ids = {id(s.tensor) for s in hosted}

    def skip(modules: nn.ModuleList) -> bool:
        tensors = [
            t
            for m in modules.modules()
            for t in (*m._parameters.values(), *m._buffers.values())
            if t is not None
        ]
        return bool(tensors) and all(id(t) in ids for t in tensors)  # fmt: skip

    return skip if ids else None


def plan(
    model: nn.Module,
    *,
    budget: int,
    depth: int,
    resident: tuple[str, ...],
    unit: str | Sequence[nn.Module] | None,
) -> Layout:
    """The layout `stream_weights` uses.

    Note: [Choosing units] Blocks mean fewer, larger copies and fewer hooks; leaf modules need
    a smaller pipeline, so a budget keeps more of them for good (Note: [Kept units]). Without
    an explicit `unit`, take blocks unless leaves copy at least 5% fewer bytes per call, or
    blocks do not fit at all. Each candidate is a value of its own, so a candidate that does
    not fit leaves nothing behind.
    """
    options = candidates(model, resident, unit)
    fitting = [lay for lay in options if budget >= lay.least_budget(depth)]
    if not fitting:
        raise ValueError(options[-1].budget_error(budget, depth))
    best = fitting[0]
    if len(fitting) > 1:
        per_call = [lay.streamed_per_call(budget, depth) for lay in fitting[:2]]
        if per_call[1] < 0.95 * per_call[0]:
            best = fitting[1]
    return best


def _cuts(
    model: nn.Module,
    owners: list[nn.Module],
    unit: str | Sequence[nn.Module] | None,
    skip: Callable[[nn.ModuleList], bool] | None = None,
) -> list[tuple[list[nn.Module], str]]:
    """The ways to cut the model into units, in order of preference: (modules, kind)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    leaves = (_close([], owners), "leaves")
    if unit is None or unit == "blocks":
        try:
            blocks = list(find_layers(model, skip))
        except ValueError:
            if unit == "blocks":
                raise
            return [leaves]
        chosen = (_close(blocks, owners), "blocks")
        return [chosen] if unit == "blocks" else [chosen, leaves]
    if unit == "leaves":
        return [leaves]
    if isinstance(unit, str) or not isinstance(unit, Sequence):
        raise ValueError(
            f"unit must be None, 'blocks', 'leaves' or a list of modules, not {unit!r}"
        )
    given = list(unit)
    for m in given:
        if not isinstance(m, nn.Module):
            raise TypeError(f"unit must list nn.Modules, got {type(m).__name__}")
        if id(m) not in names:
            raise ValueError(f"unit lists a {type(m).__name__} that is not part of the model")
    for a in given:
        for b in given:
            if a is not b and any(x is b for x in a.modules()):
                raise ValueError(
                    f"units may not nest: {names[id(b)] or '<root>'!r} is inside "
                    f"{names[id(a)] or '<root>'!r}"
                )
    return [(_close(given, owners), "given")]


def _close(units: list[nn.Module], owners: list[nn.Module]) -> list[nn.Module]:
    """``units`` plus every owner of tensors that is neither inside one nor contains one."""
    inside: set[int] = set()
    for u in units:
        inside.update(id(m) for m in u.modules())
    out = list(units)
    for owner in owners:
        if id(owner) in inside:
            continue
        if any(any(m is u for m in owner.modules()) for u in out):
            continue  # holds units itself: its own tensors go resident (see cut)
        out.append(owner)
        inside.update(id(m) for m in owner.modules())
    # owners added later may contain owners added earlier (a parent holding a weight and a child)
    return [u for u in out if not any(v is not u and any(m is u for m in v.modules()) for v in out)]


def cut(
    model: nn.Module,
    modules: list[nn.Module],
    kind: str,
    streamed: list[Slot],
    resident: list[Slot],
    hosted: Sequence[Slot] = (),
    empty: Sequence[Slot] = (),
) -> Layout | None:
    """Cut the model into ``modules``; lay out the host store and every unit's span. None when
    no unit holds a streamed tensor."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    in_unit: dict[int, int] = {}
    for i, m in enumerate(modules):
        for sub in m.modules():
            in_unit.setdefault(id(sub), i)

    # Tensors held only outside every unit (a container that also holds units) stay resident.
    kept_streamed: list[Slot] = []
    resident = list(resident)
    unit_leaves: list[list[Leaf]] = [[] for _ in modules]
    for slot in streamed:
        owner_units = sorted({in_unit[id(m)] for m, _, _ in slot.where if id(m) in in_unit})
        if not owner_units:
            resident.append(slot)
            continue
        kept_streamed.append(slot)
        for ui in owner_units:  # a tensor held by modules of several units is bound in each
            unit_leaves[ui].extend(slot.leaves)

    # Host pieces: one per source storage, spanning every streamed tensor over it, in the order
    # units first use them.
    spans: dict[Any, list[int]] = {}
    for slot in kept_streamed:
        for leaf in slot.leaves:
            span = spans.setdefault(leaf.key, [round_down(leaf.start), leaf.end])
            span[0] = min(span[0], round_down(leaf.start))
            span[1] = max(span[1], leaf.end)
    pieces: dict[Any, tuple[int, int, int]] = {}
    host_off = 0
    for leaves in unit_leaves:
        for leaf in leaves:
            if leaf.key not in pieces:
                lo, hi = spans[leaf.key]
                pieces[leaf.key] = (lo, hi, host_off)
                host_off += round_up(hi - lo)

    units = []
    for m, leaves in zip(modules, unit_leaves, strict=True):
        if leaves:
            units.append(_unit_layout(names[id(m)] or "<root>", m, leaves, pieces))
    if not units:
        return None
    return Layout(kind, tuple(units), tuple(kept_streamed), tuple(resident), pieces, host_off,
                  tuple(hosted), tuple(empty))  # fmt: skip


def _unit_layout(name: str, module: nn.Module, leaves: list[Leaf], pieces: dict) -> UnitLayout:
    """The span of each storage the unit uses, 512-aligned, in order; contiguous copies
    merged."""
    spans: dict[Any, list[int]] = {}
    for leaf in leaves:
        span = spans.setdefault(leaf.key, [round_down(leaf.start), leaf.end])
        span[0] = min(span[0], round_down(leaf.start))
        span[1] = max(span[1], leaf.end)
    offset = 0
    copy_bytes = 0
    base: dict[Any, int] = {}
    segs: list[list[int]] = []  # [host_off, unit_off, nbytes]
    for key, (lo_u, hi_u) in spans.items():
        lo, _, p_off = pieces[key]
        base[key] = offset - lo_u
        src = p_off + lo_u - lo
        n = hi_u - lo_u
        last = segs[-1] if segs else None
        if (
            last
            and src - (last[0] + last[2]) == offset - (last[1] + last[2]) < ALIGN
            and src >= last[0] + last[2]
        ):
            last[2] = src + n - last[0]  # contiguous on both sides: one copy
        else:
            segs.append([src, offset, n])
        copy_bytes += n
        offset = round_up(offset + n)
    binds = tuple(
        (leaf, base[leaf.key] + leaf.start) for leaf in dict.fromkeys(leaves)
    )  # each leaf once
    return UnitLayout(
        name, module, binds, tuple(tuple(s) for s in segs), max(offset, ALIGN), copy_bytes
    )
