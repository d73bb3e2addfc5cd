"""The unit pipeline of a weight runtime: before a unit's forward it is loaded into the arena
(or found loaded), the compute stream waits for its copy and its tensors are bound; after it,
its range is guarded by a "done" event and its tensors unbound; meanwhile the next units of the
recorded schedule are prefetched into the ring (Note: [Arena regions and done events], Note:
[Prefetch counts ring units])."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from torchoffload._transfer import CopyEngine, WaitTimer
from torchoffload.weights._arena import Arena, Counters, UnitState
from torchoffload.weights._binding import Binding
from torchoffload.weights._schedule import Ended, Pass, Schedule

_log = logging.getLogger(__name__)


@dataclass
class CaptureState:
    """What the pipeline does differently while a call is captured (Note: [Weights in a
    captured graph]): set by `Capture`, read here."""

    capturing: bool = False
    # Primed (Note: [Primed replays]): {unit: offset} of the next call's first units, their
    # span (the tail's floor), the schedule position where the tail starts
    primes: dict[int, int] = field(default_factory=dict)
    floor: int = 0
    tail_from: int = 0


@dataclass(eq=False)
class Pipeline:
    """The units of one weight runtime and what moves them: the arena (None once removed),
    the schedule, the copy engine, the binding of their tensors. Driven by `Calls`."""

    device: torch.device
    depth: int  # prefetch_depth
    units: list[UnitState]
    arena: Arena
    schedule: Schedule
    engine: CopyEngine
    counters: Counters
    binding: Binding
    waits: WaitTimer
    time_waits: bool
    state: CaptureState = field(default_factory=CaptureState)

    def check_enter(self, unit: UnitState) -> None:
        """Refuse to serve ``unit`` where its bytes could be read after they are reused."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"stream_weights serves inference, but {unit.name!r} ran with gradients "
                "enabled: call the model under torch.no_grad() or torch.inference_mode() (a "
                "streamed weight's device bytes are reused right after its unit, so autograd "
                "cannot keep it for backward)"
            )
        if (self.device.type == "cuda" and not self.state.capturing
                and torch.cuda.is_current_stream_capturing()):  # fmt: skip
            raise RuntimeError(
                f"stream_weights cannot serve {unit.name!r} inside a CUDA graph capture made "
                "outside torchoffload: a replay would skip the host-side schedule and read "
                "whatever the arena holds then. Capture with handle.cuda_graph(fn) instead"
            )

    def load(self, unit: UnitState, p: Pass | None) -> int | None:
        """Load ``unit`` (or find it loaded), wait for its copy and bind it; returns its
        position in the schedule (None outside a call of the program)."""
        pos = None
        if p is not None:
            pos, out_of_order = self.schedule.advance(p, unit.index)
            if out_of_order:
                self.counters.out_of_order += 1
                for u in self.units:  # predictions made from the old order are void
                    u.pending = False
        if unit.loc is None:
            self.counters.misses += 1
            tail = pos is not None and pos >= self.state.tail_from
            self.arena.place(unit, prefetch=False, floor=self.state.floor if tail else 0)
        else:
            self.counters.hits += 1
        unit.pending = False
        self._wait_ready(unit)
        self.binding.bind(unit, self.arena.storage)
        return pos

    def done(self, unit: UnitState, output: Any) -> str | None:
        """``unit``'s forward is queued: its range guarded by a "done" event, its tensors
        unbound. Returns what it did wrong (a weight written, or returned), if anything."""
        error = self.binding.check(unit, output, self.arena.ptr)
        self.arena.finished(unit, self.engine.record())
        self.binding.unbind(unit)
        unit.busy = False
        return error

    def recover(self) -> int:
        """Unbind the units an interrupted call left busy and forget its predictions; returns
        how many were busy."""
        busy = [u for u in self.units if u.busy]
        if busy:
            self.sync()
        for unit in busy:
            self.arena.finished(unit, None)
            self.binding.unbind(unit)
            unit.busy = False
        for unit in self.units:
            unit.pending = False
        self.counters.interrupted_calls += 1
        return len(busy)

    def end_pass(self, p: Pass) -> None:
        self.counters.calls += 1
        ended = self.schedule.end(p)
        if ended is Ended.RECORDED:
            used = sorted({self.units[i] for i in self.schedule.order}, key=lambda u: u.index)
            depth = min(self.depth + 2, len(used))
            kept = self.arena.keep(used, depth)
            if kept:
                _log.debug("kept %d units", len(kept))
        elif ended is Ended.RERECORDED:
            self.counters.schedule_rerecords += 1
            _log.debug("schedule re-recorded: %s", [self.units[i].name for i in p.record])

    def prefetch_after(self, pos: int) -> None:
        """Prefetch the next ``prefetch_depth`` units of the schedule that live in the ring;
        kept units found loaded are passed over (Note: [Prefetch counts ring units]). A
        capture prefetches past its call's last unit only its primes, at their places (Note:
        [Primed replays])."""
        depth = self.depth
        if not depth or not self.arena.ring_cap:  # nothing lives in the ring: all kept
            return
        n = len(self.schedule.order)
        state = self.state
        primed = state.primes
        wrap = not state.capturing or bool(primed)
        for j, index in enumerate(self.schedule.ahead(pos, wrap=wrap)):
            unit = self.units[index]
            if unit.fixed is not None and unit.loc is not None:
                continue
            at = None
            if state.capturing and pos + 1 + j >= n:  # the next call's: only primes, in place
                at = primed.get(index)
                if at is None or (unit.busy and unit.loc != at):
                    break  # a prime computing elsewhere now (a short call): `finish_capture`
                if unit.loc not in (None, at):
                    self.arena.drop(unit)
            if not unit.busy:
                if unit.loc is None:
                    floor = state.floor if pos + 1 + j >= state.tail_from else 0
                    if not self.arena.place(unit, prefetch=True, at=at, floor=floor):
                        break  # the ring is full of units still needed: retry at the next unit
                    self.counters.prefetch_issued += 1
                unit.pending = True  # needed soon: later prefetches must not overwrite it
            depth -= 1
            if not depth:
                break

    def _wait_ready(self, unit: UnitState) -> None:
        event = unit.ready
        testing = self.arena.testing
        if event is None or self.engine.synchronous:
            return
        if testing is not None and "ready" in testing.skip:
            return
        if self.state.capturing:  # an event of the capture cannot be queried
            self.engine.wait(event)
            return
        if event.query():  # copied already (a kept unit): no wait, now or later
            unit.ready = None
            return
        if self.time_waits:  # Note: [Timing compute-stream waits] in _transfer.py
            self.waits.wait(self.engine.current_stream(), event)
        else:
            self.engine.wait(event)

    def sync(self) -> None:
        """Wait for the device (nothing to wait for on the CPU)."""
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).synchronize(self.device)

    def forget(self) -> None:
        """The host store changed: nothing loaded in the arena is current."""
        self.arena.clear(self.units)
