"""The device arena: one allocation of at most ``budget_bytes`` that holds the units computing
now and next, with the byte ranges, ring and events that decide where a unit goes and what a
copy into a range must wait for."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from torchoffload._transfer import CopyEngine
from torchoffload.weights._layout import ALIGN, UnitLayout, plan_kept

_MiB = 1 << 20

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
# Note: [Kept units]
# With a cyclic schedule and a ring smaller than the model, every unit is evicted before its
# next use, so each call streams every unit. Once the schedule is known, units are instead
# *kept* at fixed places at the top of the arena, largest first, as long as the ring below
# still holds ``prefetch_depth + 2`` of the largest streamed unit (the pipeline plus the waste
# of one wrap). A kept unit is copied once and never again: each call streams only the rest.
#
# Note: [Prefetch counts ring units]
# ``prefetch_depth`` counts the units ahead that live in the ring; kept units found loaded are
# passed over. Counted, they filled the window with units that need no copy, so the next ring
# unit's copy started only when compute reached the kept units before it (seen in the arena
# trace: `test_prefetch_passes_over_kept_units`), and the copy stream idled meanwhile.
# The ring still holds ``prefetch_depth + 2`` of its largest unit, so the window fits.


@dataclass
class Counters:
    """What the engine counts; `WeightStats` reports them."""

    calls: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_issued: int = 0
    evictions: int = 0
    h2d_bytes: int = 0
    h2d_copies: int = 0
    schedule_rerecords: int = 0
    out_of_order: int = 0
    interrupted_calls: int = 0
    graph_replays: int = 0


@dataclass
class TestHooks:
    """Test-only instruments (set through `torchoffload.testing.weight_test_hooks`).

    ``trace`` records every load and read with its byte range and events; ``debug_events``
    stands CPU labels in for device events; ``skip`` drops the "done" or "ready" waits, to show
    that the race tests catch a missing wait."""

    trace: list[tuple] | None = None
    debug_events: bool = False
    skip: frozenset[str] = field(default_factory=frozenset)


class DebugEvent:
    """Stands in for a device event on the CPU when a test asks for event bookkeeping."""

    __slots__ = ("label",)

    def __init__(self, label: str):
        self.label = label

    def __repr__(self) -> str:
        return self.label


class UnitState:
    """A unit at run time: its layout, its host segments and where it is in the arena."""

    __slots__ = (
        "layout", "index", "nbytes", "segments", "binds", "loc", "region", "ready", "pending",
        "busy", "fixed", "versions", "classes",
    )  # fmt: skip

    def __init__(self, layout: UnitLayout, index: int, host: torch.Tensor):
        self.layout = layout
        self.index = index
        self.nbytes = layout.nbytes  # span in the arena
        self.segments = [(host[src : src + n], off, n) for src, off, n in layout.segments]
        self.binds: list[tuple[torch.Tensor, int, Any]] = []  # (tensor, unit offset, leaf)
        self.loc: int | None = None  # arena offset while loaded
        self.region: Region | None = None
        self.ready: Any = None
        self.pending = False  # in the prefetch window (loaded for it or found loaded), not used yet
        self.busy = False  # between its pre-forward and its forward hook
        self.fixed: int | None = None  # arena offset when kept (Note: [Kept units])
        self.versions: list[int] = []
        # per bind: (its class while bound, its placeholder class) or None (not hosted)
        self.classes: list[tuple[type, type] | None] = []

    @property
    def name(self) -> str:
        return self.layout.name


class Region:
    __slots__ = ("start", "end", "unit", "done")

    def __init__(self, start: int, end: int, unit: UnitState | None, done: Any):
        self.start = start
        self.end = end
        self.unit = unit
        self.done = done


class Arena:
    """``nbytes`` of device memory and the regions loaded in it."""

    def __init__(self, nbytes: int, device: torch.device, engine: CopyEngine, counters: Counters):
        # - Memory
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.storage = self.tensor.untyped_storage()
        self.ptr = self.storage.data_ptr()
        # - Placement: sorted, disjoint regions and their starts (for bisection)
        self.regions: list[Region] = []
        self.starts: list[int] = []
        self.head = 0
        self.ring_cap = nbytes  # the ring is [0, ring_cap); kept units sit above it
        self.loaded_bytes = 0
        self.peak = 0
        # - Collaborators
        self.engine = engine
        self.counters = counters
        self.testing: TestHooks | None = None

    def keep(self, units: list[UnitState], depth: int) -> list[UnitState]:
        """Fix the places of the units to keep (Note: [Kept units]); return them."""
        kept = [units[i] for i in plan_kept([u.nbytes for u in units], self.nbytes, depth)]
        top = self.nbytes
        for unit in kept:
            top -= unit.nbytes
            unit.fixed = top
        self.ring_cap = top
        return kept

    def place(
        self, unit: UnitState, *, prefetch: bool, at: int | None = None, floor: int = 0
    ) -> bool:
        """Load ``unit``: choose its range (``at``: this offset; ``floor``: in the ring above
        it), evict what is there, queue its copies after the events of that range. A prefetch
        that finds no range free of needed units returns False; an on-demand fetch raises
        then."""
        n = unit.nbytes
        if unit.fixed is not None:
            candidates = [unit.fixed]
        elif at is not None:
            assert at % ALIGN == 0 and at + n <= self.ring_cap, (at, n, self.ring_cap)
            candidates = [at]
        else:
            cap = self.ring_cap
            head = self.head
            candidates = [head if floor <= head and head + n <= cap else floor]
            if not prefetch:  # must succeed: any place that spares the unit(s) computing now
                ends = (r.end for r in self.regions if floor <= r.end and r.end + n <= cap)
                candidates += [floor, *ends]
        regions = self.regions
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
                f"no room in the {self.nbytes / _MiB:.1f} MiB arena for {unit.name!r} "
                f"({n / _MiB:.1f} MiB) beside the units computing now (units nested inside "
                "other units need a larger budget)"
            )
        testing = self.testing
        skip_done = testing is not None and "done" in testing.skip
        after = [r.done for r in hit if r.done is not None and not skip_done]
        for r in hit:
            if r.unit is not None:
                self.evict(r.unit)
        assert start % ALIGN == 0, start  # every unit, so every tensor, keeps its alignment
        region = Region(start, end, unit, None)
        new = [region]
        if hit and hit[0].start < start and hit[0].done is not None:  # tombstones keep the
            new.insert(0, Region(hit[0].start, start, None, hit[0].done))  # event of what
        if hit and hit[-1].end > end and hit[-1].done is not None:  # they held
            new.append(Region(end, hit[-1].end, None, hit[-1].done))
        regions[i:j] = new
        self.starts[i:j] = [r.start for r in new]
        if unit.fixed is None:
            self.head = end
        unit.loc = start
        unit.region = region
        arena = self.tensor
        pairs = [(arena[start + off : start + off + nb], host) for host, off, nb in unit.segments]
        ready = self.engine.load(pairs, after)
        if testing is not None:
            if ready is None and testing.debug_events:
                ready = DebugEvent(f"ready:{unit.name}")
            if testing.trace is not None:
                testing.trace.append(("load", unit.name, start, end, ready, list(after)))
        unit.ready = ready
        region.done = ready
        c = self.counters
        c.h2d_bytes += unit.layout.copy_bytes
        c.h2d_copies += len(pairs)
        self.loaded_bytes += n
        self.peak = max(self.peak, self.loaded_bytes)
        return True

    def finished(self, unit: UnitState, done: Any) -> None:
        """``unit``'s forward is queued; ``done`` (recorded after it) guards its range."""
        testing = self.testing
        if testing is not None and done is None and testing.debug_events:
            done = DebugEvent(f"done:{unit.name}")
        if unit.region is not None:
            unit.region.done = done
            if testing is not None and testing.trace is not None:
                testing.trace.append(("read", unit.name, unit.loc, unit.loc + unit.nbytes, done))

    def drop(self, unit: UnitState) -> None:
        """Evict a loaded ``unit`` now; its range stays guarded by its event (a tombstone). Never
        a unit whose forward is running: its event is not recorded yet, so nothing would keep
        a copy from overwriting the weights it reads."""
        if unit.busy:
            raise RuntimeError(f"internal error: unit {unit.name!r} dropped while it computes")
        region = unit.region
        if region is not None:
            region.unit = None
        self.evict(unit)

    def evict(self, unit: UnitState) -> None:
        unit.loc = None
        unit.region = None
        unit.ready = None
        unit.pending = False
        self.loaded_bytes -= unit.nbytes
        self.counters.evictions += 1

    def clear(self, units: list[UnitState]) -> None:
        """Forget every loaded unit (their bytes are stale or the arena goes away). The caller
        has synchronized the device."""
        for unit in units:
            unit.loc = unit.region = unit.ready = None
            unit.pending = False
        self.regions.clear()
        self.starts.clear()
        self.head = 0
        self.loaded_bytes = 0

    def reset_ring(self, units: list[UnitState], done: Any, keep: tuple = ()) -> None:
        """Forget the units in the ring (not the kept ones, nor the ring units in ``keep``)
        and make the rest of the ring one tombstone guarded by ``done``: what overwrites it
        next waits on that event (Note: [Weights in a captured graph] in _capture.py). What
        stays is guarded by ``done`` too; ``None``: the caller synchronized the device. The
        head follows the last unit of ``keep``."""
        stay = {id(u) for u in keep if u.loc is not None}
        for unit in units:
            # a kept unit loaded in the ring before it was kept is forgotten like the others
            if unit.loc is not None and unit.loc != unit.fixed and id(unit) not in stay:
                unit.loc = unit.region = unit.ready = None
                unit.pending = False
                self.loaded_bytes -= unit.nbytes
        held = [  # kept units at their places, and what ``keep`` asks for (not the regions
            r for r in self.regions  # of units forgotten above: their loc is None now)
            if r.unit is not None
            and ((r.unit.fixed is not None and r.unit.loc == r.unit.fixed) or id(r.unit) in stay)
        ]  # fmt: skip
        for region in held:  # read by what ``done`` follows, or (None) by nothing in flight
            region.done = done
        ring: list[Region] = []
        if self.ring_cap and done is not None:  # the gaps between the units that stay
            at = 0
            for r in held:
                if r.start >= self.ring_cap:
                    break
                if r.start > at:
                    ring.append(Region(at, r.start, None, done))
                at = r.end
            if at < self.ring_cap:
                ring.append(Region(at, self.ring_cap, None, done))
        self.regions[:] = sorted(ring + held, key=lambda r: r.start)
        self.starts[:] = [r.start for r in self.regions]
        ends = [u.loc + u.nbytes for u in keep if id(u) in stay]
        self.head = ends[-1] if ends else 0

    def _overlapping(self, start: int, end: int) -> tuple[int, int]:
        """``regions[i:j]`` are the regions that overlap ``[start, end)`` (they are sorted and
        disjoint, so a bisection over their starts finds them)."""
        starts = self.starts
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or self.regions[i].end <= start:
            i += 1
        return i, bisect.bisect_left(starts, end, lo=i)
