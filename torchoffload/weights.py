"""Weight streaming for inference: weights live in pinned host memory and only the units computing
now and next sit on the device, in an arena capped at a byte budget.

```python
handle = torchoffload.stream_weights(model, device="cuda", budget_bytes=4 << 30)
with torch.inference_mode():
    out = model(x)
handle.stats()
handle.remove()
```

Setup copies every streamed parameter and buffer into one exact-size pinned host buffer (tied
tensors and storages shared by views are stored once) and frees the originals. The model is
cut into *units* (its repeated blocks, else its leaf modules with weights). Before a unit runs
its tensors are bound, in place, to its bytes in the device arena; after it, they are unbound.
The order in which units run is recorded on the first forward and used to prefetch the next
``prefetch_depth`` units on a copy stream while the current one computes.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchoffload._flatten import flatten, is_composite
from torchoffload._modules import find_layers, matches
from torchoffload._pool import _check_int, pinned_buffer
from torchoffload._transfer import WaitTimer, compute_device, copy_engine

__all__ = ["WeightStats", "WeightStreamHandle", "minimum_budget", "stream_weights"]

_log = logging.getLogger(__name__)

_ALIGN = 512  # the caching allocator's alignment; see Note: [Binding weights in place]
_MiB = 1 << 20

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
#
# Note: [Arena regions and done events]
# The arena is one device allocation of at most `budget_bytes`, managed here, not by the
# caching allocator. Every byte range of it that held something carries the event of its last
# access: the "ready" event of the copy that wrote it, replaced by the "done" event recorded on
# the compute stream after the forward of the unit that read it (that stream had waited on
# "ready" first, so "done" covers both). A copy into a range first makes the copy stream wait
# on the events of every region it overlaps; the remains of a partly overwritten region keep
# their event as a tombstone until they are overwritten too. So a range is overwritten only
# after the GPU finished reading it, whatever stream read it, and the host never waits.
# Units are placed in a ring over the arena in schedule order (oldest overwritten first); a
# prefetch never overwrites the unit computing now or a prefetched unit not yet used (it waits
# for a later unit's pre-forward instead), an on-demand fetch only avoids the one computing.
#
# Note: [Schedule]
# Units are keyed by module. The order of their pre-forwards within one call of the root
# module is recorded on the first call and checked on every later one. A unit found where the
# schedule expects another (a branch, a skipped layer) is served at once: from the arena if it
# is loaded there, else fetched now (a miss); the cursor resynchronises to that unit's place
# and the pass is re-recorded at its end. Weights are found by unit, never by cursor, so a
# wrong prediction costs time, never a wrong weight. The schedule is cyclic: the last units of
# a call prefetch the first units of the next one (decoding steps in `generate`).
#
# Note: [Kept units]
# With a cyclic schedule and a ring smaller than the model, every unit is evicted before its
# next use, so each call streams every unit. Once the schedule is known, units are instead
# *kept* at fixed places at the top of the arena, largest first, as long as the ring below
# still holds ``prefetch_depth + 2`` of the largest streamed unit (the pipeline plus the waste
# of one wrap). A kept unit is copied once and never again: each call streams only the rest.


@dataclass(frozen=True)
class WeightStats:
    """Counters of a `WeightStreamHandle` since setup (or `reset_stats`). Bytes are exact."""

    units: int  # units the model was cut into
    streamed_bytes: int  # bytes of the host copy of the streamed tensors (each stored once)
    resident_bytes: int  # bytes kept on the device outside the budget
    budget_bytes: int
    arena_bytes: int  # the device arena: min(budget, what all units need)
    kept_units: int  # units kept in the arena across calls (Note: [Kept units])
    calls: int  # completed calls of the model
    hits: int  # unit found loaded (prefetched or kept) at its pre-forward
    misses: int  # unit fetched on demand at its pre-forward
    prefetch_issued: int
    evictions: int
    h2d_bytes: int
    h2d_copies: int
    peak_device_bytes: int  # high-water mark of unit bytes loaded in the arena
    schedule_rerecords: int
    out_of_order: int  # units that ran where the schedule expected another
    stall_ms: float | None  # time the compute stream waited on copies (time_waits=True)
    setup_s: float  # seconds setup took (host copy, pinning, arena)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class _Leaf:
    """A plain tensor bound in place: a parameter, a buffer, or a composite's buffer.

    ``source`` is the tensor as setup found it (its bytes go to the host; `remove()` restores
    into it); ``tensor`` is the object bound to the arena, the same one except for a composite
    that was not on the compute device (rebuilt there, see `_rebuild_composites`)."""

    __slots__ = ("tensor", "source", "name", "key", "start", "end", "size", "stride", "dtype",
                 "device")  # fmt: skip

    def __init__(self, source: torch.Tensor, name: str):
        self.tensor = source
        self.source = source
        self.name = name
        storage = source.untyped_storage()
        self.key = (storage.data_ptr(), source.device)
        itemsize = source.element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(source.shape, source.stride(), strict=True))
        self.start = source.storage_offset() * itemsize
        self.end = self.start + extent * itemsize
        self.size = tuple(source.shape)
        self.stride = source.stride()
        self.dtype = source.dtype
        self.device = source.device


class _Region:
    __slots__ = ("start", "end", "unit", "done")

    def __init__(self, start: int, end: int, unit: _Unit | None, done: Any):
        self.start = start
        self.end = end
        self.unit = unit
        self.done = done


class _Unit:
    __slots__ = (
        "name", "module", "index", "leaves", "binds", "segments", "nbytes", "copy_bytes",
        "loc", "region", "ready", "pending", "busy", "fixed", "versions", "raw_segments",
    )  # fmt: skip

    def __init__(self, name: str, module: nn.Module, index: int):
        self.name = name
        self.module = module
        self.index = index
        self.leaves: list[_Leaf] = []
        self.binds: list[tuple[_Leaf, int]] = []  # (leaf, byte offset of its data in the unit)
        self.segments: list[tuple[torch.Tensor, int, int]] = []  # (host view, unit offset, n)
        self.nbytes = 0
        self.copy_bytes = 0
        self.loc: int | None = None  # arena offset while loaded
        self.region: _Region | None = None
        self.ready: Any = None
        self.pending = False  # in the prefetch window (loaded for it or found loaded), not used yet
        self.busy = False  # between its pre-forward and its forward hook
        self.fixed: int | None = None  # arena offset when kept (Note: [Kept units])
        self.versions: list[int] = []
        self.raw_segments: list[list[int]] = []  # [host offset, unit offset, nbytes]


class _Pass:
    __slots__ = ("record", "cursor", "diverged")

    def __init__(self) -> None:
        self.record: list[int] = []
        self.cursor = 0
        self.diverged = False


class _DebugEvent:
    """Stands in for a device event on the CPU when a test asks for event bookkeeping."""

    __slots__ = ("label",)

    def __init__(self, label: str):
        self.label = label

    def __repr__(self) -> str:
        return self.label


class WeightStreamHandle:
    """What `stream_weights` returns: stats, the schedule, and `remove()`.

    Also a context manager: leaving the ``with`` block calls `remove()`.
    """

    def __init__(self) -> None:  # built by stream_weights
        raise TypeError("use torchoffload.stream_weights(model, ...) to create a handle")

    # -- public -----------------------------------------------------------------------------

    @property
    def units(self) -> list[str]:
        """Names of the units, in setup order."""
        return [u.name for u in self._units]

    @property
    def schedule(self) -> list[str] | None:
        """Unit names in the recorded call order (None before the first complete call)."""
        if self._schedule is None:
            return None
        return [self._units[i].name for i in self._schedule]

    @property
    def resident(self) -> list[str]:
        """Names of the tensors kept on the device (outside the budget)."""
        return list(self._resident_names)

    @property
    def kept(self) -> list[str]:
        """Units kept in the arena across calls (Note: [Kept units])."""
        return [u.name for u in self._units if u.fixed is not None]

    @property
    def removed(self) -> bool:
        return self._removed

    def stats(self) -> WeightStats:
        with self._lock:
            c = self._c
            stall = self._waits.collect(block=True) if self._time_waits else None
            return WeightStats(
                units=len(self._units),
                streamed_bytes=self._streamed_bytes,
                resident_bytes=self._resident_bytes,
                budget_bytes=self._budget,
                arena_bytes=self._arena_bytes,
                kept_units=sum(u.fixed is not None for u in self._units),
                calls=c["calls"],
                hits=c["hits"],
                misses=c["misses"],
                prefetch_issued=c["prefetch_issued"],
                evictions=c["evictions"],
                h2d_bytes=c["h2d_bytes"],
                h2d_copies=c["h2d_copies"],
                peak_device_bytes=self._peak,
                schedule_rerecords=c["schedule_rerecords"],
                out_of_order=c["out_of_order"],
                stall_ms=stall,
                setup_s=self._setup_s,
            )

    def reset_stats(self) -> None:
        with self._lock:
            self._c = dict.fromkeys(_COUNTERS, 0)
            self._peak = self._loaded_bytes
            self._waits.reset()

    def remove(self) -> None:
        """Put every tensor back where it was (its device, its values; parameters keep their
        identity) and free the arena and the host copy. Idempotent."""
        with self._lock:
            if self._removed:
                return
            if self._busy:
                raise RuntimeError("remove() called while a streamed unit is running its forward")
            self._removed = True
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            if getattr(self._model, "_torchoffload_weights", None) is self:
                del self._model._torchoffload_weights
            if self.device.type != "cpu":
                torch.get_device_module(self.device.type).synchronize(self.device)
            with torch.inference_mode(False), torch.no_grad():
                self._restore()
            self._arena = None
            self._host = None
            for unit in self._units:
                unit.segments.clear()
                unit.loc = unit.region = unit.ready = None
            self._regions.clear()
            self._starts.clear()
            self._loaded_bytes = 0

    def __enter__(self) -> WeightStreamHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{len(self._units)} units"
        return (
            f"WeightStreamHandle({state}, budget={self._budget / _MiB:.1f} MiB, "
            f"streamed={self._streamed_bytes / _MiB:.1f} MiB, device={self.device})"
        )

    # -- hooks ------------------------------------------------------------------------------

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self._pass = _Pass()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth:
            return
        p, self._pass = self._pass, None
        if p is None or sys.exc_info()[1] is not None:  # the call raised: nothing to learn
            return
        with self._lock:
            self._end_pass(p)

    def _pre(self, unit: _Unit) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"stream_weights serves inference, but {unit.name!r} ran with gradients "
                "enabled: call the model under torch.no_grad() or torch.inference_mode() (a "
                "streamed weight's device bytes are reused right after its unit, so autograd "
                "cannot keep it for backward)"
            )
        if self._capturing():
            raise RuntimeError(
                f"stream_weights cannot serve {unit.name!r} inside CUDA graph capture: a replay "
                "would skip the host-side schedule and read whatever the arena holds then"
            )
        with self._lock:
            if self._removed:
                raise RuntimeError("this WeightStreamHandle was removed")
            pos = self._advance(unit) if self._pass is not None else None
            if unit.loc is None:
                self._c["misses"] += 1
                self._place(unit, prefetch=False)
            else:
                self._c["hits"] += 1
            unit.pending = False
            self._wait_ready(unit)
            self._bind(unit)
            unit.busy = True
            self._busy += 1
            if pos is not None:
                self._prefetch_after(pos)

    def _post(self, unit: _Unit, output: Any) -> None:
        with self._lock:
            if not unit.busy:  # its pre-forward raised
                return
            error = self._check(unit, output)
            done = self._engine.record()
            if done is None and self._debug_events:
                done = _DebugEvent(f"done:{unit.name}")
            if unit.region is not None:
                unit.region.done = done
                if self._trace is not None:
                    self._trace.append(("read", unit.name, unit.loc, unit.loc + unit.nbytes, done))
            self._unbind(unit)
            unit.busy = False
            self._busy -= 1
        if error is not None:
            raise RuntimeError(error)

    # -- schedule (Note: [Schedule]) ---------------------------------------------------------

    def _advance(self, unit: _Unit) -> int | None:
        p = self._pass
        p.record.append(unit.index)
        sched = self._schedule
        if sched is None:
            return None
        if p.cursor < len(sched) and sched[p.cursor] == unit.index:
            pos = p.cursor
        else:
            self._c["out_of_order"] += 1
            p.diverged = True
            for u in self._units:  # predictions made from the old order are void
                u.pending = False
            places = self._positions.get(unit.index)
            if not places:
                return None
            i = bisect.bisect_left(places, p.cursor)
            pos = places[i] if i < len(places) else places[0]
        p.cursor = pos + 1
        return pos

    def _end_pass(self, p: _Pass) -> None:
        self._c["calls"] += 1
        if not p.record:
            return
        if self._schedule is None:
            self._set_schedule(p.record)
            self._choose_kept()
        elif p.diverged or len(p.record) != len(self._schedule):
            self._set_schedule(p.record)
            self._c["schedule_rerecords"] += 1
            _log.debug("schedule re-recorded: %s", [self._units[i].name for i in p.record])

    def _set_schedule(self, record: list[int]) -> None:
        self._schedule = list(record)
        self._positions = {}
        for pos, index in enumerate(record):
            self._positions.setdefault(index, []).append(pos)

    def _choose_kept(self) -> None:
        """Note: [Kept units]."""
        used = sorted({self._units[i] for i in self._schedule}, key=lambda u: u.index)
        depth = min(self._depth_k + 2, len(used))
        kept = [used[i] for i in _plan_kept([u.nbytes for u in used], self._arena_bytes, depth)]
        top = self._arena_bytes
        for unit in kept:
            top -= unit.nbytes
            unit.fixed = top
        self._ring_cap = top
        if kept:
            _log.debug("kept %d units (%d bytes)", len(kept), self._arena_bytes - top)

    def _prefetch_after(self, pos: int) -> None:
        sched = self._schedule
        n = len(sched)
        for j in range(1, min(self._depth_k, n - 1) + 1):
            unit = self._units[sched[(pos + j) % n]]
            if unit.busy:
                continue
            if unit.loc is None:
                if not self._place(unit, prefetch=True):
                    break  # the ring is full of units still needed: retry at the next unit
                self._c["prefetch_issued"] += 1
            unit.pending = True  # needed soon: later prefetches must not overwrite it

    # -- the arena (Note: [Arena regions and done events]) -----------------------------------

    def _place(self, unit: _Unit, *, prefetch: bool) -> bool:
        n = unit.nbytes
        if unit.fixed is not None:
            candidates = [unit.fixed]
        else:
            cap = self._ring_cap
            candidates = [self._head if self._head + n <= cap else 0]
            if not prefetch:  # must succeed: any place that spares the unit(s) computing now
                candidates += [0, *(r.end for r in self._regions if r.end + n <= cap)]
        regions = self._regions
        for start in candidates:
            end = start + n
            i, j = self._overlapping(start, end)
            hit = regions[i:j]
            if not any(
                r.unit is not None and (r.unit.busy or (prefetch and r.unit.pending)) for r in hit
            ):
                break
        else:
            if prefetch:
                return False
            raise RuntimeError(
                f"no room in the {self._arena_bytes / _MiB:.1f} MiB arena for {unit.name!r} "
                f"({n / _MiB:.1f} MiB) beside the units computing now (units nested inside "
                "other units need a larger budget)"
            )
        after = [r.done for r in hit if r.done is not None and "done" not in self._unsafe_skip]
        for r in hit:
            if r.unit is not None:
                self._evict(r.unit)
        assert start % _ALIGN == 0, start  # every unit, so every tensor, keeps its alignment
        region = _Region(start, end, unit, None)
        new = [region]
        if hit and hit[0].start < start and hit[0].done is not None:  # tombstones keep the
            new.insert(0, _Region(hit[0].start, start, None, hit[0].done))  # event of what
        if hit and hit[-1].end > end and hit[-1].done is not None:  # they held
            new.append(_Region(end, hit[-1].end, None, hit[-1].done))
        regions[i:j] = new
        self._starts[i:j] = [r.start for r in new]
        if unit.fixed is None:
            self._head = end
        unit.loc = start
        unit.region = region
        arena = self._arena
        pairs = [(arena[start + off : start + off + nb], host) for host, off, nb in unit.segments]
        ready = self._engine.load(pairs, after)
        if ready is None and self._debug_events:
            ready = _DebugEvent(f"ready:{unit.name}")
        if self._trace is not None:
            self._trace.append(("load", unit.name, start, end, ready, list(after)))
        unit.ready = ready
        region.done = ready
        self._c["h2d_bytes"] += unit.copy_bytes
        self._c["h2d_copies"] += len(pairs)
        self._loaded_bytes += n
        self._peak = max(self._peak, self._loaded_bytes)
        return True

    def _overlapping(self, start: int, end: int) -> tuple[int, int]:
        """``regions[i:j]`` are the regions that overlap ``[start, end)`` (they are sorted and
        disjoint, so a bisection over their starts finds them)."""
        starts = self._starts
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or self._regions[i].end <= start:
            i += 1
        return i, bisect.bisect_left(starts, end, lo=i)

    def _evict(self, unit: _Unit) -> None:
        unit.loc = None
        unit.region = None
        unit.ready = None
        unit.pending = False
        self._loaded_bytes -= unit.nbytes
        self._c["evictions"] += 1

    def _wait_ready(self, unit: _Unit) -> None:
        event = unit.ready
        if event is None or self._engine.synchronous or "ready" in self._unsafe_skip:
            return
        if event.query():  # copied already (a kept unit): no wait, now or later
            unit.ready = None
            return
        if self._time_waits:  # Note: [Timing compute-stream waits] in _transfer.py
            self._waits.wait(self._engine.current_stream(), event)
        else:
            self._engine.wait(event)

    # -- binding (Note: [Binding weights in place]) ------------------------------------------

    def _bind(self, unit: _Unit) -> None:
        storage = self._arena_storage
        base = unit.loc
        versions = unit.versions
        versions.clear()
        # Gradients are off here (`_pre` checked), so set_ on a leaf needs no no_grad().
        for leaf, off in unit.binds:
            t = leaf.tensor
            t.set_(storage, (base + off) // t.element_size(), leaf.size, leaf.stride)
        # Read after all set_ calls: views of one storage share a version counter.
        versions.extend(leaf.tensor._version for leaf, _ in unit.binds)

    def _unbind(self, unit: _Unit) -> None:
        empty = self._empty
        grad = torch.is_grad_enabled()  # a forward may have turned them on inside its unit
        with torch.no_grad() if grad else contextlib.nullcontext():
            for leaf, _ in unit.binds:
                leaf.tensor.set_(empty, 0, (0,), (1,))

    def _check(self, unit: _Unit, output: Any) -> str | None:
        for (leaf, _), version in zip(unit.binds, unit.versions, strict=True):
            if leaf.tensor._version != version:
                return (
                    f"streamed tensor {leaf.name!r} was modified in place during the forward of "
                    f"{unit.name!r}; the change would be lost when the unit is evicted. Keep it "
                    f"on the device with resident=({leaf.name!r},)"
                )
        ptr = self._arena_ptr
        for t in _tensors(output):
            if t.device == self.device and t.untyped_storage().data_ptr() == ptr:
                return (
                    f"{unit.name!r} returned a tensor that shares memory with its streamed "
                    "weights (a view of a weight); its bytes will be overwritten. Return a copy, "
                    "or keep the weight resident"
                )
        return None

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    # -- remove ----------------------------------------------------------------------------

    def _restore(self) -> None:
        host = self._host
        by_key: dict[Any, list[_Leaf]] = {}
        for leaf in self._streamed_leaves:
            by_key.setdefault(leaf.key, []).append(leaf)
        for key, leaves in by_key.items():
            lo, hi, host_off = self._pieces[key]
            device = leaves[0].device
            data = host[host_off : host_off + hi - lo]
            copy = data.clone() if device.type == "cpu" else data.to(device)
            storage = copy.untyped_storage()
            for leaf in leaves:
                t = leaf.source
                if t.device != device:
                    t.data = torch.empty(0, dtype=leaf.dtype, device=device)
                t.set_(storage, (leaf.start - lo) // t.element_size(), leaf.size, leaf.stride)
        for module, kind, name, original in self._replaced:
            getattr(module, kind)[name] = original
        for t, device in self._moved:
            t.data = t.data.to(device)


_COUNTERS = (
    "calls", "hits", "misses", "prefetch_issued", "evictions", "h2d_bytes", "h2d_copies",
    "schedule_rerecords", "out_of_order",
)  # fmt: skip


def _tensors(output: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    if type(output) in (torch.Tensor, nn.Parameter):
        yield output
    elif depth < 3 and isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item, depth + 1)


def _plan_kept(sizes: list[int], arena: int, depth: int) -> list[int]:
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


def _streamed_per_call(h: WeightStreamHandle, depth: int) -> int:
    """Bytes a layout would copy per call once its kept units are in place (an estimate that
    assumes every unit runs once per call)."""
    sizes = [u.nbytes for u in h._units]
    kept = _plan_kept(sizes, h._arena_bytes, min(depth + 2, len(sizes)))
    return sum(sizes) - sum(sizes[i] for i in kept)


def _round_up(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


def _round_down(n: int, to: int = _ALIGN) -> int:
    return n // to * to


# -- setup ------------------------------------------------------------------------------------


def stream_weights(
    model: nn.Module,
    device: torch.device | str | int | None = None,
    *,
    budget_bytes: int,
    prefetch_depth: int = 2,
    resident: str | Sequence[str] = (),
    unit: str | Sequence[nn.Module] | None = None,
    use_streams: bool = True,
    pin_memory: bool = True,
    time_waits: bool = False,
) -> WeightStreamHandle:
    """Keep ``model``'s weights in pinned host memory and stream them to ``device`` as it runs.

    For inference (call the model under `torch.no_grad()` or `torch.inference_mode()`).
    Outputs are bitwise identical to the model with all weights on the device.

    Args:
        model: the model; its parameters and buffers may be on the host or on ``device``.
        device: where the model computes. ``None``: the current accelerator, else the CPU
            (the same logic runs there synchronously, for testing).
        budget_bytes: hard cap on device bytes for streamed weights (the arena).
        prefetch_depth: units fetched ahead of the one computing. The budget must hold
            ``prefetch_depth + 1`` of the largest unit; `stream_weights` says the minimum.
        resident: name patterns of modules, parameters or buffers to keep on the device,
            outside the budget (``"embed_tokens"``, ``"lm_head"``, ``"layers.0.*"``). A pattern
            matches a dotted name or any dotted part of it.
        unit: how the model is cut into units. ``None``: its repeated blocks when the budget
            holds them, else every module that holds weights itself; ``"blocks"`` or
            ``"leaves"`` to choose; or a list of modules. Weights outside the given modules
            are streamed by the module holding them.
        use_streams: copy on a dedicated stream (overlapping compute); ``False`` queues the
            copies on the compute stream.
        pin_memory: page-lock the host copy (only where an accelerator exists).
        time_waits: measure how long the compute stream waits on copies (``stats().stall_ms``).

    Returns a `WeightStreamHandle`: ``stats()``, ``schedule``, ``remove()``.

    Outside its unit's forward a streamed tensor is empty (Note: [Binding weights in place]):
    a weight read outside the module that owns it must be resident, or inside a larger unit.
    """
    start_time = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_int("budget_bytes", budget_bytes, minimum=1)
    _check_int("prefetch_depth", prefetch_depth, minimum=0)
    for name, value in (("use_streams", use_streams), ("pin_memory", pin_memory)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if isinstance(resident, str):
        resident = (resident,)
    resident = tuple(resident)
    if not all(isinstance(p, str) for p in resident):
        raise TypeError("resident must be a name pattern or a sequence of them")
    if getattr(model, "_torchoffload_weights", None) is not None:
        raise RuntimeError("this model already streams its weights; remove() that handle first")
    dev = compute_device(device)
    with torch.inference_mode(False), torch.no_grad():
        h = _build(model, dev, budget_bytes, prefetch_depth, resident, unit, use_streams)
        h._time_waits = time_waits and dev.type == "cuda"
        _materialize(h, pin_memory and torch.accelerator.is_available())
    _install_hooks(h, model)
    h._setup_s = time.perf_counter() - start_time
    model._torchoffload_weights = h
    h._model = model
    _log.info(
        "streaming %.1f MiB of weights in %d units through a %.1f MiB arena (%d tensors resident)",
        h._streamed_bytes / _MiB, len(h._units), h._arena_bytes / _MiB, len(h._resident_names),
    )  # fmt: skip
    return h


def minimum_budget(
    model: nn.Module,
    *,
    prefetch_depth: int = 2,
    resident: str | Sequence[str] = (),
    unit: str | Sequence[nn.Module] | None = None,
) -> int:
    """The smallest ``budget_bytes`` that `stream_weights` accepts for ``model`` with these
    settings: ``min(prefetch_depth + 1, units)`` times the largest unit, in arena bytes. With
    ``unit=None``, the smaller of the blocks and leaves cuts. The model is not changed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_int("prefetch_depth", prefetch_depth, minimum=0)
    resident = (resident,) if isinstance(resident, str) else tuple(resident)
    cuts = ["blocks", "leaves"] if unit is None else [unit]
    needs = []
    for cut in cuts:
        try:
            h = _build(model, torch.device("cpu"), 1 << 62, prefetch_depth, resident, cut, False)
        except ValueError:
            if unit is None and cut == "blocks":
                continue  # no repeated blocks
            raise
        pipeline = min(prefetch_depth + 1, len(h._units))
        needs.append(pipeline * max(u.nbytes for u in h._units))
    return min(needs)


def _slots(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str]]]]:
    """Every tensor object held by a module: id -> (tensor, [(module, kind, qualified name)]).

    A tensor held in several places (tied weights, a module reachable by two paths) is listed
    once with all of them."""
    found: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str]]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    qual = f"{prefix}.{name}" if prefix else name
                    found.setdefault(id(t), (t, []))[1].append((module, kind, qual))
    return found


class _BudgetError(ValueError):
    pass


def _candidates(
    model: nn.Module, owners: list[nn.Module], unit: str | Sequence[nn.Module] | None
) -> list[tuple[list[nn.Module], str]]:
    """The ways to cut the model into units, in order of preference: (modules, kind)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    leaves = (_close([], owners), "leaves")
    if unit is None or unit == "blocks":
        try:
            blocks = list(find_layers(model))
        except ValueError:
            if unit == "blocks":
                raise
            return [leaves]
        chosen = (_close(blocks, owners), "blocks")
        return [chosen] if unit == "blocks" else [chosen, leaves]
    if unit == "leaves":
        return [leaves]
    if isinstance(unit, str):
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
            continue  # holds units itself: its own tensors go resident (see _layout)
        out.append(owner)
        inside.update(id(m) for m in owner.modules())
    # owners added later may contain owners added earlier (a parent holding a weight and a child)
    return [u for u in out if not any(v is not u and any(m is u for m in v.modules()) for v in out)]


def _build(model, dev, budget, depth, resident, unit, use_streams) -> WeightStreamHandle:
    h = object.__new__(WeightStreamHandle)
    h.device = dev
    h._budget = budget
    h._depth_k = depth
    h._lock = threading.RLock()
    h._engine = copy_engine(dev, use_streams=use_streams)
    h._removed = False
    h._hooks = []
    h._replaced = []
    h._moved = []
    h._depth = 0
    h._busy = 0
    h._pass = None
    h._schedule = None
    h._positions = {}
    h._c = dict.fromkeys(_COUNTERS, 0)
    h._regions = []
    h._starts = []  # region starts, for bisection
    h._head = 0
    h._loaded_bytes = 0
    h._peak = 0
    h._waits = WaitTimer()
    h._model = None
    h._time_waits = False
    h._debug_events = False
    h._trace = None
    h._setup_s = 0.0
    # Tests only: {"done", "ready"} drops those waits, to show the race tests catch it.
    h._unsafe_skip = frozenset()

    slots = _slots(model)
    resident_ids: set[int] = set()
    streamed: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str]]]] = {}
    for key, (t, where) in slots.items():
        if t.device.type == "meta":
            raise ValueError(f"{where[0][2]!r} is on the meta device: load the weights first")
        if t.numel() == 0:
            continue
        if resident and any(matches(q, resident) for _, _, q in where):
            resident_ids.add(key)
            continue
        streamed[key] = (t, where)
    for pattern in resident:
        if not any(matches(q, (pattern,)) for _, (t, w) in slots.items() for _, _, q in w):
            raise ValueError(f"resident pattern {pattern!r} matches no parameter or buffer")
    if not streamed:
        raise ValueError(
            "stream_weights has nothing to stream: "
            + (
                f"all {len(resident_ids)} tensors match resident={resident!r}"
                if resident_ids
                else f"{type(model).__name__} has no parameters or buffers"
            )
        )
    owners: list[nn.Module] = []  # modules holding streamed tensors themselves
    seen: set[int] = set()
    for _, where in streamed.values():
        for module, _, _ in where:
            if id(module) not in seen:
                seen.add(id(module))
                owners.append(module)
    h._slots = slots

    def layout(modules, how):
        _layout(h, model, modules, how, dict(streamed), set(resident_ids), budget, depth)

    # Note: [Choosing units] Blocks mean fewer, larger copies and fewer hooks; leaf modules
    # need a smaller pipeline, so a budget keeps more of them for good (Note: [Kept units]).
    # Without an explicit `unit`, take blocks unless leaves copy at least 5% fewer bytes per
    # call, or blocks do not fit at all.
    options = _candidates(model, owners, unit)
    fitting = []
    error = None
    for modules, how in options:
        try:
            layout(modules, how)
        except _BudgetError as e:
            error = e
            _log.debug("unit=%r does not fit: %s", how, e)
            continue
        fitting.append((modules, how, _streamed_per_call(h, depth)))
    if not fitting:
        raise ValueError(str(error)) from None
    best = fitting[0]
    if len(fitting) > 1 and fitting[1][2] < 0.95 * fitting[0][2]:
        best = fitting[1]
    if best is not fitting[-1]:
        layout(best[0], best[1])
    return h


def _layout(h, model, modules, how, streamed, resident_ids, budget, depth) -> None:
    """Cut the model into ``modules`` and lay out the host buffer and every unit."""
    dev = h.device
    h._off_device = []
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    in_unit: dict[int, int] = {}
    for i, m in enumerate(modules):
        for sub in m.modules():
            in_unit.setdefault(id(sub), i)
    units = [_Unit(names[id(m)] or "<root>", m, i) for i, m in enumerate(modules)]

    # Tensors held only outside every unit (a container that also holds units) stay resident.
    for key, (_, where) in list(streamed.items()):
        if not any(id(m) in in_unit for m, _, _ in where):
            del streamed[key]
            resident_ids.add(key)
            _log.info("%s is held outside every unit: kept resident", where[0][2])

    # Leaves per unit (a tensor held by modules of several units is bound in each).
    all_leaves: dict[int, list[_Leaf]] = {}
    for key, (t, where) in streamed.items():
        owner_units = sorted({in_unit[id(m)] for m, _, _ in where if id(m) in in_unit})
        if key not in all_leaves:
            all_leaves[key] = _leaves_of(t, where[0][2])
            if is_composite(t) and t.device != dev:
                h._off_device.append((t, where, all_leaves[key]))
        for ui in owner_units:
            units[ui].leaves.extend(all_leaves[key])
    h._streamed_leaves = [leaf for leaves in all_leaves.values() for leaf in leaves]

    # Host pieces: one per source storage, spanning every streamed tensor over it.
    pieces: dict[Any, list[int]] = {}  # key -> [lo, hi, host_off]
    for leaf in h._streamed_leaves:
        piece = pieces.setdefault(leaf.key, [_round_down(leaf.start), leaf.end, -1])
        piece[0] = min(piece[0], _round_down(leaf.start))
        piece[1] = max(piece[1], leaf.end)
    host_off = 0
    for u in units:
        for leaf in u.leaves:
            piece = pieces[leaf.key]
            if piece[2] < 0:
                piece[2] = host_off
                host_off += _round_up(piece[1] - piece[0])
    h._pieces = {k: tuple(v) for k, v in pieces.items()}
    h._streamed_bytes = sum(v[1] - v[0] for v in pieces.values())
    h._host_bytes = host_off

    # Unit layouts: the span of each storage the unit uses, 512-aligned, in order.
    for u in units:
        spans: dict[Any, list[int]] = {}
        for leaf in u.leaves:
            span = spans.setdefault(leaf.key, [_round_down(leaf.start), leaf.end])
            span[0] = min(span[0], _round_down(leaf.start))
            span[1] = max(span[1], leaf.end)
        offset = 0
        layout: dict[Any, int] = {}
        segs: list[list[int]] = []  # [host_off, unit_off, nbytes]
        for key, (lo_u, hi_u) in spans.items():
            lo, _, p_off = h._pieces[key]
            layout[key] = offset - lo_u
            src = p_off + lo_u - lo
            n = hi_u - lo_u
            last = segs[-1] if segs else None
            if (
                last
                and src - (last[0] + last[2]) == offset - (last[1] + last[2]) < _ALIGN
                and (src >= last[0] + last[2])
            ):
                last[2] = src + n - last[0]  # contiguous on both sides: one copy
            else:
                segs.append([src, offset, n])
            u.copy_bytes += n
            offset = _round_up(offset + n)
        u.nbytes = max(offset, _ALIGN)
        seen: set[int] = set()
        for leaf in u.leaves:
            if id(leaf) not in seen:
                seen.add(id(leaf))
                u.binds.append((leaf, layout[leaf.key] + leaf.start))
        u.raw_segments = segs  # host views are made once the host buffer exists

    used = [u for u in units if u.leaves]
    if not used:
        raise _BudgetError("stream_weights has nothing to stream: every tensor is resident")
    largest = max(used, key=lambda u: u.nbytes)
    pipeline = min(depth + 1, len(used))
    need = pipeline * largest.nbytes
    if budget < need:
        hint = " or unit='leaves'" if how == "blocks" else ""
        raise _BudgetError(
            f"budget_bytes={budget} ({budget / _MiB:.1f} MiB) cannot hold {pipeline} units "
            f"(prefetch_depth={depth} + the one computing) of the largest unit "
            f"{largest.name!r} ({largest.nbytes / _MiB:.1f} MiB): the minimum budget is "
            f"{need / _MiB:.1f} MiB ({need} bytes). Raise budget_bytes, lower prefetch_depth"
            f"{hint}, or keep large modules resident."
        )
    h._units = used
    for i, u in enumerate(used):
        u.index = i
    h._arena_bytes = min(_round_down(budget), sum(u.nbytes for u in used))
    h._ring_cap = h._arena_bytes
    h._resident_ids = resident_ids
    h._resident_names = [q for k in resident_ids for _, _, q in h._slots[k][1]]
    h._unit_kind = how


def _nbytes(t: torch.Tensor) -> int:
    if is_composite(t):
        entries, _ = flatten(t)
        return sum(_nbytes(e) for e in entries if isinstance(e, torch.Tensor))
    return t.untyped_storage().nbytes()


def _leaves_of(t: torch.Tensor, name: str) -> list[_Leaf]:
    """The plain tensors to bind for ``t``: itself, or a composite's buffers (recursively)."""
    if not is_composite(t):
        if t.layout is not torch.strided:
            raise TypeError(f"cannot stream {name!r}: layout {t.layout} is not strided")
        return [_Leaf(t, name)]
    entries, _ = flatten(t)
    again, _ = flatten(t)
    out: list[_Leaf] = []
    for i, (e, e2) in enumerate(zip(entries, again, strict=True)):
        if not isinstance(e, torch.Tensor):
            continue
        if e is not e2:
            raise TypeError(
                f"cannot stream {name!r}: flattening a {type(t).__qualname__} returns new "
                "tensors each time, so its buffers cannot be bound in place"
            )
        if is_composite(e) or e.numel():
            out.extend(_leaves_of(e, f"{name}[{i}]"))
    return out


def _rebuild_composites(h: WeightStreamHandle) -> None:
    """Composites that are not on the compute device: a wrapper subclass fixes its device when
    it is built, so each is rebuilt on the device (buffers created over the arena, bound in
    place later like any other) and replaces the original in its modules until `remove()`."""
    for t, where, leaves in h._off_device:
        it = iter(leaves)
        new = _rebuild(t, h.device, h._arena_storage, it)
        for module, kind, qual in where:
            attr = qual.rsplit(".", 1)[-1]
            if getattr(module, kind).get(attr) is t:
                h._replaced.append((module, kind, attr, t))
                getattr(module, kind)[attr] = new


def _rebuild(t: torch.Tensor, dev: torch.device, storage, leaves) -> torch.Tensor:
    entries, rebuild = flatten(t)
    moved: list[Any] = []
    for e in entries:
        if not isinstance(e, torch.Tensor):
            moved.append(e)
        elif is_composite(e):
            moved.append(_rebuild(e, dev, storage, leaves))
        elif e.numel() == 0:
            moved.append(torch.empty(e.shape, dtype=e.dtype, device=dev))
        else:
            leaf = next(leaves)
            m = torch.empty(0, dtype=e.dtype, device=dev)
            m.set_(storage, 0, e.shape, e.stride())  # geometry only; bound before every use
            leaf.tensor = m
            moved.append(m)
    return rebuild(moved)


def _materialize(h: WeightStreamHandle, pin: bool) -> None:
    """Copy streamed tensors to the host buffer, free them, move resident ones, make the arena."""
    dev = h.device
    h._host = pinned_buffer(h._host_bytes, pin=pin and dev.type != "cpu")
    originals: dict[Any, torch.Tensor] = {}
    for leaf in h._streamed_leaves:
        originals.setdefault(leaf.key, leaf.source)
    for key, t in originals.items():
        lo, hi, off = h._pieces[key]
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            t.untyped_storage(), 0, (t.untyped_storage().nbytes(),), (1,)
        )
        h._host[off : off + hi - lo].copy_(src[lo:hi])
    for u in h._units:
        u.segments = [(h._host[src : src + n], off, n) for src, off, n in u.raw_segments]
    h._arena = torch.empty(h._arena_bytes, dtype=torch.uint8, device=dev)
    h._arena_storage = h._arena.untyped_storage()
    h._arena_ptr = h._arena_storage.data_ptr()
    h._empty = torch.empty(0, dtype=torch.uint8, device=dev).untyped_storage()
    _rebuild_composites(h)
    for leaf in h._streamed_leaves:
        t = leaf.tensor
        if t.device != dev:
            t.data = torch.empty(0, dtype=t.dtype, device=dev)
        t.set_(h._empty, 0, (0,), (1,))
        if leaf.source is not t:  # a rebuilt composite's original buffer: free its bytes
            leaf.source.set_(torch.empty(0, dtype=torch.uint8, device=leaf.device)
                             .untyped_storage(), 0, (0,), (1,))  # fmt: skip
    resident_bytes = 0
    for key in h._resident_ids:
        t, where = h._slots[key]
        resident_bytes += _nbytes(t)
        if t.device == dev:
            continue
        if is_composite(t):
            raise ValueError(
                f"resident {where[0][2]!r} is a {type(t).__qualname__} on {t.device}: move it "
                f"to {dev} before stream_weights"
            )
        h._moved.append((t, t.device))
        t.data = t.data.to(dev)
    h._resident_bytes = resident_bytes
    del h._slots
    if dev.type != "cpu":
        torch.get_device_module(dev.type).synchronize(dev)


def _install_hooks(h: WeightStreamHandle, model: nn.Module) -> None:
    for u in h._units:

        def pre(module, args, unit=u):
            h._pre(unit)

        def post(module, args, output, unit=u):
            h._post(unit, output)

        h._hooks.append(u.module.register_forward_pre_hook(pre))
        h._hooks.append(u.module.register_forward_hook(post, always_call=True))
    h._hooks.append(model.register_forward_pre_hook(h._root_pre, prepend=True))
    h._hooks.append(model.register_forward_hook(h._root_post, always_call=True))
