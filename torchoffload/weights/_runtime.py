"""The weight runtime: the host store, the arena, the schedule and the call protocol, built from
a `Layout`. Eager module hooks, the exported-program runner and compiled programs drive it
through one package-internal API:

- ``begin_call(frame)`` / ``end_call(ok)`` bracket one call of the whole program;
- ``enter(i, frame)`` / ``exit(i, output)`` bracket the use of unit ``i``'s weights (a unit
  entered outside a call makes a call of its own);
- ``state_dict_values`` / ``write_host`` read and write the real values of streamed tensors.

Note: [One call at a time]
Streamed tensors are bound in place (Note: [Binding weights in place]): the parameter objects
are shared by every caller, so two calls of one model cannot both bind them. A call owns the
runtime from ``begin_call`` to ``end_call``; a call from another thread waits for it, so a
streamed model served from several threads gives each the same result as alone, one call
after the other. A call knows the Python frame that made it. A call whose frame is no longer
running was interrupted by an exception that skipped the hooks' cleanup (PyTorch does not run
``always_call`` forward hooks for a `KeyboardInterrupt` or another `BaseException`); the next
``begin_call``, ``enter`` of a busy unit, ``remove()`` or load, from any thread, finds it so,
waits for the device, unbinds what it left bound and carries on (``stats().interrupted_calls``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from torchoffload import _hosted
from torchoffload._calls import running
from torchoffload._flatten import flatten, is_composite
from torchoffload._pool import pinned_buffer
from torchoffload._transfer import WaitTimer, copy_engine
from torchoffload._validate import check_bool, check_int, physical_memory
from torchoffload.weights._arena import Arena, Counters, UnitState
from torchoffload.weights._checkpoint import Checkpoint, CheckpointError, Entry
from torchoffload.weights._layout import Layout, Leaf, Slot, nbytes
from torchoffload.weights._schedule import Ended, Pass, Schedule

_log = logging.getLogger(__name__)
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
# A bind first checks the tensor's dtype: `model.to(dtype)` replaces an empty tensor's data
# with one of another dtype, and binding that to the stored bytes would reinterpret them.

#
# Note: [Weights in a captured graph]
# A CUDA graph replays the device work of one captured call: kernels, weight copies into the
# arena and the events between the copy and compute streams, at the addresses chosen at
# capture; the host runs none of the hooks. So the captured call is made self-contained:
# - Before it (outside the capture, device synchronized, the lock held until it ends): every
#   kept unit is loaded. The graph reads kept units and never copies them.
# - At its start, the ring is one tombstone guarded by an event recorded on the capture
#   stream. Every copy in the ring waits on it or on an event after it, so the copy stream
#   joins the capture (an event recorded before a capture cannot be waited on inside it).
#   Copies go to a copy stream of the graph's own: no other thread's copy can enter it.
# - Inside it, ready events are waited on, never queried. At its end the capture stream waits
#   on the copy stream. Past its last unit it prefetches only its primes, at their fixed
#   places (Note: [Primed replays]).
# - A replay first makes the compute stream wait on the event of every arena region (eager
#   copies in flight, eager reads on any stream) and loads again the kept units that were
#   dropped since (`load_state_dict` clears the arena). After the launch the ring becomes
#   one tombstone guarded by an event recorded after it, so an eager call that follows
#   overwrites nothing the replay still reads. Consecutive replays on one stream are
#   ordered by the stream.
# The replay path does not query or wait on the host. Ring weights are copied from the host
# store at every replay or at the end of the one before (primes), so values loaded with
# `load_state_dict` (which clears the arena, primes included) are what the next replay reads.
#
# Note: [Primed replays]
# A graph that stops prefetching at its call's last unit leaves the copy stream idle while
# its last units compute and until the next replay's first copy ends: on the H100 a 181 us
# median gap per decode step of the demo Llama, 1.18x the link bound
# (benchmarks/log/2026-11-23-decode-cuda-graph.md).
# Eager calls avoid it by prefetching the next call's first units; a graph may do the same
# only if the next replay finds them where its kernels read them, at addresses fixed at
# capture. So a graph is captured with its *primes*: the schedule's first ring units loaded
# side by side from the ring's start before it runs, and it loads them there again at its end
# for the next replay.
# - Where they land cannot be left to the ring: its head moves by the bytes a call copies,
#   so the next call's first units land elsewhere each call (a cycle of 2 or 4 places for
#   the GPU tests' model, run on the CPU). Instead the capture places them at their fixed
#   offsets, and the call's last ``prefetch_depth + 1`` ring units (the tail, the only ones
#   that can still be pending or computing then) are placed above the primes' span. So the
#   primes' range holds nothing still needed when they are copied, and their copies wait
#   only on the events of units done earlier: they run while the tail computes. Those left
#   for `finish_capture` (a prefetch found no room) are copied there. The capture checks
#   that it ends with its primes in place; if not, it is captured again unprimed (never
#   wrong, only slower).
# - How many: as many first ring units as fit in the bytes of ``prefetch_depth`` of the
#   largest ring unit (the most a call's prefetch has in flight), counted in bytes rather
#   than units because the copy stream idles from the end of the primes' copies to the next
#   launch: the kept units after the last ring unit compute meanwhile. The 8B AOTI decoder at
#   12 GiB streams 8 and 32 MiB units; primed with its first two (16 MiB), its replays left
#   the copy stream idle a median 284 us at each boundary (H100), and ran at 0.915-0.939 of
#   the link bound; primed with the first eight (64 MiB: two of its largest), 47 us and
#   0.992-0.997 (H200; benchmarks/log/2026-11-25-aoti-session12.md). Primes past what the
#   tail's compute covers delay the next launch by the difference; bounded so, that is no
#   more than a prefetch of the largest units could delay it.
# - They leave room above them for the tail, its last ``prefetch_depth + 1`` ring units (at
#   least two of the largest ring unit); fewer are primed when the ring is smaller, none when
#   nothing is prefetched. A tail that does not fit waits for its own compute: the demo
#   Llama at 0.2 GiB (a 22.3 MiB ring, its tail the last MLP's three 5.5 MiB units) primed
#   10.5 MiB with room for only two of them, and its replays took 1.35 ms against 1.15
#   unprimed (Hugging Face model, H200); with the tail's room, 5.5 MiB primed, 1.18 ms, and
#   the compiled program of benchmarks/aoti_decode.py 1.12 ms against 1.19. The 8B decoder's
#   primes at 12 GiB are the same under both rules. A ring that holds only the tail (the least
#   budget, for units of one size) primes nothing; the tail's bytes are counted even where a
#   tail unit is also one of the call's first units (a short call), which reserves more room
#   than such a call needs.
# - Before a launch, `replaying` loads any prime not at its offset (after an eager call or
#   `load_state_dict`), after its range's events; the launch is ordered after those copies
#   on the stream. After the launch the primes stay loaded, guarded by the event recorded
#   after it; eager calls find them as hits. Inside the graph they need no wait (the replay
#   starts after their copies) and are pending, so no prefetch overwrites them before use.


# ((unit index, arena offset), ...): the units a replay finds loaded (Note: [Primed replays])
Primes = tuple


class Replay:
    """What `WeightRuntime.replaying` did before a launch (``loaded``: primes it copied) and
    which units the replay leaves loaded for the next one (``primes``, the caller may set)."""

    __slots__ = ("primes", "loaded")

    def __init__(self, primes: Primes):
        self.primes = primes
        self.loaded = 0


@dataclass(frozen=True)
class StreamConfig:
    """The settings of one weight runtime (`stream_weights` documents each)."""

    device: torch.device
    budget_bytes: int
    prefetch_depth: int = 2
    use_streams: bool = True
    pin_memory: bool = True
    time_waits: bool = False

    def __post_init__(self) -> None:
        total, what = _device_memory(self.device)
        check_int("budget_bytes", self.budget_bytes, minimum=1, maximum=total, limit=what)
        check_int("prefetch_depth", self.prefetch_depth, minimum=0)
        for name in ("use_streams", "pin_memory", "time_waits"):
            check_bool(name, getattr(self, name))


def _device_memory(device: torch.device) -> tuple[int | None, str]:
    """The most bytes an arena on ``device`` could take, and what that limit is."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"the memory of {device}"
    if device.type == "cpu":
        return physical_memory(), "this host's physical memory"
    return None, ""


# Every tensor that a live runtime streams (the slot tensors the modules hold): streaming a
# model that shares one of them with a streamed model would find it empty.
STREAMED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Call:
    __slots__ = ("thread", "frame", "depth", "pass_", "unit")

    def __init__(self, frame: FrameType | None, pass_: Pass | None, unit: int | None):
        self.thread = threading.get_ident()
        self.frame = frame  # see Note: [One call at a time]
        self.depth = 0  # nested calls of the root module
        self.pass_ = pass_
        self.unit = unit  # the unit of a call made by entering a unit outside a call


class WeightRuntime:
    """One model's streamed weights. Construct it from a layout; drive it through the API in
    the module docstring."""

    def __init__(self, layout: Layout, config: StreamConfig, checkpoint: Checkpoint | None = None):
        """``checkpoint``: read the values of the tensors it holds from it (the model may be
        on the meta device); the others keep their own (Note: [Reading into the host
        store] in _checkpoint.py)."""
        dev = config.device
        self.config = config
        self.device = dev
        self.layout = layout
        # - Copies and counters
        self.engine = copy_engine(dev, use_streams=config.use_streams)
        self.counters = Counters()
        self.waits = WaitTimer()
        self.time_waits = config.time_waits and dev.type == "cuda"
        for slot in layout.resident:  # checked before anything changes
            if is_composite(slot.tensor) and slot.tensor.device != dev:
                raise ValueError(
                    f"resident {slot.name!r} is a {type(slot.tensor).__qualname__} on "
                    f"{slot.tensor.device}: move it to {dev} before stream_weights"
                )
        # - Host store: every streamed storage once, in the pieces of the layout
        if checkpoint is None:
            meta = [s.name for s in (*layout.streamed, *layout.resident) if s.tensor.is_meta]
            if meta:
                raise ValueError(
                    f"{len(meta)} tensors of the model are on the meta device (first: "
                    f"{meta[0]!r}) and have no values: pass checkpoint= (a safetensors file or "
                    "directory), or load the weights first"
                )
        reads = _match_checkpoint(layout, checkpoint) if checkpoint is not None else {}
        self.checkpoint_resident = (
            _resident_from_checkpoint(layout, checkpoint) if checkpoint is not None else {}
        )
        pin = config.pin_memory and torch.accelerator.is_available() and dev.type != "cpu"
        self.host = pinned_buffer(layout.host_bytes, pin=pin)
        self._fill_host(checkpoint, reads)
        # - Units and the arena
        self.units = [UnitState(u, i, self.host) for i, u in enumerate(layout.units)]
        self.arena = Arena(layout.arena_bytes(config.budget_bytes), dev, self.engine, self.counters)
        self.schedule = Schedule()
        self._empty = torch.empty(0, dtype=torch.uint8, device=dev).untyped_storage()
        self._device_index = -1 if dev.type == "cpu" else dev.index
        self._cuda = dev.type == "cuda"
        # - Module state changed until `restore()`
        self.bound: dict[Leaf, torch.Tensor] = {leaf: leaf.source for leaf in layout.leaves}
        self._leaf_ids = {id(leaf.source) for leaf in layout.leaves}
        self.replaced: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        self.moved: list[tuple[torch.Tensor, torch.device]] = []
        self._rebuild_composites()
        self._empty_sources()
        self.resident_bytes = self._move_resident()
        self.resident_names = [q for s in layout.resident for _, _, q in s.where]
        for unit in self.units:
            unit.binds = [(self.bound[leaf], off, leaf) for leaf, off in unit.layout.binds]
            unit.classes = [self._classes.get(id(t)) for t, _, _ in unit.binds]
        for slot in layout.streamed:
            STREAMED[slot.tensor] = self
        # - Call state (Note: [One call at a time])
        self._lock = threading.RLock()
        self._free = threading.Condition(self._lock)
        self._call: _Call | None = None
        self.removed = False
        self.capturing = False  # a call is being captured (Note: [Weights in a captured graph])
        # ... and, primed (Note: [Primed replays]): {unit: offset} of the next call's first
        # units, their span (the tail's floor), the schedule position where the tail starts
        self._primes: dict[int, int] = {}
        self._floor = 0
        self._tail_from = 0
        self._saved_counters: Counters | None = None
        # id(state_dict() destination) -> (its weak reference, {storage key: host copy})
        self._copies: dict[int, tuple[weakref.ref, dict]] = {}
        if dev.type != "cpu":
            torch.get_device_module(dev.type).synchronize(dev)

    # -- setup -------------------------------------------------------------------------------

    def _fill_host(self, checkpoint: Checkpoint | None, reads: dict[Any, Any]) -> None:
        originals: dict[Any, torch.Tensor] = {}
        for leaf in self.layout.leaves:
            originals.setdefault(leaf.key, leaf.source)
        if checkpoint is not None:
            pieces = []
            for key, (entry, leaf) in reads.items():
                lo, _, off = self.layout.pieces[key]
                start = off + leaf.start - lo
                pieces.append((entry, self.host[start : start + entry.nbytes]))
            checkpoint.read_into(pieces)
        for key, t in originals.items():
            if key in reads:
                continue
            lo, hi, off = self.layout.pieces[key]
            storage = t.untyped_storage()
            src = torch.empty(0, dtype=torch.uint8, device=t.device)
            src.set_(storage, 0, (storage.nbytes(),), (1,))
            self.host[off : off + hi - lo].copy_(src[lo:hi])

    def _rebuild_composites(self) -> None:
        """Composites that are not on the compute device: a wrapper subclass fixes its device
        when it is built, so each is rebuilt on the device (buffers created over the arena,
        bound in place later like any other) and replaces the original in its modules until
        `restore()`."""
        dev = self.device
        storage = self.arena.storage

        def make(leaf: Leaf) -> torch.Tensor:
            m = torch.empty(0, dtype=leaf.dtype, device=dev)
            m.set_(storage, 0, leaf.size, leaf.stride)  # geometry only; bound before every use
            self.bound[leaf] = m
            return m

        for slot in self.layout.streamed:
            t = slot.tensor
            if not is_composite(t) or t.device == dev:
                continue
            new = _rebuild(t, iter(slot.leaves), make, dev, self._leaf_ids)
            for module, kind, qual in slot.where:
                attr = qual.rsplit(".", 1)[-1]
                if getattr(module, kind).get(attr) is t:
                    self.replaced.append((module, kind, attr, t))
                    getattr(module, kind)[attr] = new
                    STREAMED[new] = self

    def _empty_sources(self) -> None:
        dev = self.device
        self._classes: dict[int, tuple[type, type]] = {}
        plain = {id(leaf.source) for s in self.layout.streamed if not is_composite(s.tensor)
                 for leaf in s.leaves}  # fmt: skip
        for leaf in self.layout.leaves:
            t = self.bound[leaf]
            if t.device != dev:
                _set_data(t, torch.empty(0, dtype=t.dtype, device=dev))
            t.set_(self._empty, 0, (0,), (1,))
            if leaf.source is not t:  # a rebuilt composite's original buffer: free its bytes
                gone = torch.empty(0, dtype=torch.uint8, device=leaf.device).untyped_storage()
                leaf.source.set_(gone, 0, (0,), (1,))
            hosted = _hosted.hosted_class(type(t))
            if id(t) in plain and hosted is not None and id(t) not in self._classes:
                lo = self.layout.pieces[leaf.key][0]
                offset = (leaf.start - lo) // t.element_size()
                ref = _hosted.Ref(self, leaf.key, offset, leaf.size, leaf.stride, leaf.dtype,
                                  leaf.name, type(t))  # fmt: skip
                self._classes[id(t)] = (type(t), hosted)
                _hosted.register(t, ref)  # Note: [Placeholders never answer]

    def _move_resident(self) -> int:
        dev = self.device
        total = 0
        for slot in self.layout.resident:
            t = slot.tensor
            total += nbytes(t)
            loaded = self.checkpoint_resident.get(id(t))
            if loaded is not None:
                self.moved.append((t, t.device))
                _set_data(t, loaded.to(dev))
                continue
            if t.device == dev:
                continue
            self.moved.append((t, t.device))
            t.data = t.data.to(dev)
        self.checkpoint_resident = {}
        return total

    # -- calls (Note: [One call at a time]) ----------------------------------------------------

    def begin_call(self, frame: FrameType | None) -> None:
        """A call of the whole program starts (``frame``: the Python frame that runs it)."""
        with self._lock:
            self._check_live()
            call, new = self._own(frame, None)
            if not new:
                call.depth += 1
            else:
                call.pass_ = Pass()

    def end_call(self, ok: bool) -> None:
        """The call started by the matching `begin_call` ends; ``ok``: it returned normally."""
        with self._lock:
            call = self._call
            if call is None or call.thread != threading.get_ident() or call.unit is not None:
                return  # recovered meanwhile (Note: [One call at a time])
            if call.depth:
                call.depth -= 1
                return
            self._release()
            if ok and call.pass_ is not None and not self.removed and not self.capturing:
                self._end_pass(call.pass_)

    def enter(self, index: int, frame: FrameType | None) -> None:
        """Unit ``index`` is about to run: load it (or find it loaded), wait for its copy, bind
        its tensors, prefetch the next units of the schedule."""
        unit = self.units[index]
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"stream_weights serves inference, but {unit.name!r} ran with gradients "
                "enabled: call the model under torch.no_grad() or torch.inference_mode() (a "
                "streamed weight's device bytes are reused right after its unit, so autograd "
                "cannot keep it for backward)"
            )
        if self._cuda and not self.capturing and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"stream_weights cannot serve {unit.name!r} inside a CUDA graph capture made "
                "outside torchoffload: a replay would skip the host-side schedule and read "
                "whatever the arena holds then. Capture with handle.cuda_graph(fn) instead"
            )
        with self._lock:
            if self.removed:
                raise RuntimeError("this WeightStreamHandle was removed")
            call = self._call
            if call is None or call.thread != threading.get_ident() or unit.busy:
                call, new = self._own(frame, index)
            else:
                new = False
            try:
                pos = None
                p = call.pass_
                if p is not None:
                    pos, out_of_order = self.schedule.advance(p, index)
                    if out_of_order:
                        self.counters.out_of_order += 1
                        for u in self.units:  # predictions made from the old order are void
                            u.pending = False
                if unit.loc is None:
                    self.counters.misses += 1
                    tail = pos is not None and pos >= self._tail_from
                    self.arena.place(unit, prefetch=False, floor=self._floor if tail else 0)
                else:
                    self.counters.hits += 1
                unit.pending = False
                self._wait_ready(unit)
                self._bind(unit)
            except BaseException:
                if new:
                    self._release()
                raise
            unit.busy = True
            if pos is not None:
                self._prefetch_after(pos)

    def exit(self, index: int, output: Any) -> None:
        """Unit ``index``'s forward is queued: guard its range with a "done" event, unbind it,
        and raise if it changed a weight or returned one."""
        with self._lock:
            unit = self.units[index]
            if not unit.busy:  # its enter raised, or an interrupted call was recovered
                return
            error = self._check(unit, output)
            self.arena.finished(unit, self.engine.record())
            self._unbind(unit)
            unit.busy = False
            call = self._call
            if call is not None and call.unit == index and call.thread == threading.get_ident():
                self._release()
        if error is not None:
            raise RuntimeError(error)

    def _own(self, frame: FrameType | None, unit: int | None) -> tuple[_Call, bool]:
        """Make this thread own a call: (the call, whether it is new). Waits for a call of
        another thread; recovers an interrupted one. Holds the lock."""
        me = threading.get_ident()
        while True:
            call = self._call
            if call is None:
                self._call = _Call(frame, None, unit)
                return self._call, True
            if running(call.thread, call.frame):
                if call.thread == me and unit is None:
                    return call, False  # the root module called inside its own call
                if call.thread == me:  # a busy unit entered again from inside its own call
                    raise RuntimeError(
                        f"{self.units[unit].name!r} was called inside its own forward: streamed "
                        "units may not nest"
                    )
                self._free.wait(0.05)
                continue
            self._recover()

    def _release(self) -> None:
        self._call = None
        self._free.notify_all()

    def _recover(self) -> None:
        """Undo what an interrupted call left: busy units unbound, its pass dropped."""
        busy = [u for u in self.units if u.busy]
        if busy:
            self._sync()
        for unit in busy:
            self._finish(unit, None)
        for unit in self.units:
            unit.pending = False
        self.counters.interrupted_calls += 1
        _log.warning(
            "a call of the streamed model was interrupted (%d units were bound); recovered",
            len(busy),
        )
        self._release()

    def _wait_idle(self, what: str) -> None:
        """Wait until no call runs (recovering an interrupted one). Holds the lock."""
        while self._call is not None:
            call = self._call
            if not running(call.thread, call.frame):
                self._recover()
            elif call.thread == threading.get_ident():
                raise RuntimeError(f"{what} called while a streamed unit is running its forward")
            else:
                self._free.wait(0.05)

    def _check_live(self) -> None:
        if self.removed:
            raise RuntimeError("this WeightStreamHandle was removed")

    # -- CUDA graphs (Note: [Weights in a captured graph]) ------------------------------------

    def prepare_capture(self, primes: Primes = ()) -> None:
        """Before a capture, outside it: wait for the device and for calls of other threads,
        load every kept unit and the ``primes`` at their places, forget the rest of the ring.
        Takes the lock, which `end_capture` gives back, so no other call runs until the
        capture ends."""
        self._lock.acquire()
        try:
            self._check_live()
            self._wait_idle("capture")
            self._sync()
            there = self._primes_at(primes)
            self.arena.reset_ring(self.units, None, keep=there)
            for unit in self.units:
                if unit.fixed is not None and unit.loc is None:
                    self.arena.place(unit, prefetch=False)
            for index, loc in primes:
                if self.units[index].loc is None:
                    self.arena.place(self.units[index], prefetch=False, at=loc)
            self._sync()
            for unit in self.units:
                unit.ready = None
                unit.pending = False
            self.arena.reset_ring(self.units, None, keep=self._primes_at(primes))
            self._saved_counters = dataclasses.replace(self.counters)
        except BaseException:
            self._lock.release()
            raise

    def start_capture(self, engine: Any, primes: Primes = ()) -> None:
        """First thing inside the capture: its copies go to ``engine`` (streams of the graph's
        own), and the ring, but for the ``primes`` (loaded before every replay), is one
        tombstone guarded by an event of the capture stream, so the first copy joins the
        capture. With ``primes``, the call ends by loading them again (Note: [Primed
        replays])."""
        misplaced = [u.name for u in self.units if u.fixed is not None and u.loc != u.fixed]
        misplaced += [self.units[i].name for i, loc in primes if self.units[i].loc != loc]
        if misplaced:  # the graph would read them where its own copies write
            raise AssertionError(f"units not at their places at capture: {misplaced}")
        self.capturing = True
        self.arena.engine = engine
        self.arena.reset_ring(self.units, self.engine.record(), keep=self._primes_at(primes))
        for index, _ in primes:
            unit = self.units[index]
            unit.ready = None  # copied before the replay, which the stream orders after it
            unit.pending = True  # the call's first units: no prefetch overwrites them
        if primes:
            self._primes = dict(primes)
            self._floor = max(loc + self.units[i].nbytes for i, loc in primes)
            ring = [p for p, i in enumerate(self.schedule.order) if self.units[i].fixed is None]
            self._tail_from = ring[-min(len(ring), self.config.prefetch_depth + 1)]

    def finish_capture(self) -> Primes:
        """Last thing inside the capture: the primes not loaded yet are loaded, and the
        capture stream waits on the graph's copies. Returns where the primes are now (Note:
        [Primed replays])."""
        for index, loc in self._primes.items():
            if not self.units[index].busy:  # busy: the call raised; its error is the one told
                self._load_at(self.units[index], loc)
        engine = self.arena.engine
        saved = self._saved_counters
        copied = saved is None or self.counters.h2d_copies > saved.h2d_copies
        if copied and not engine.synchronous and engine.use_streams:  # else never joined
            self.engine.current_stream().wait_stream(engine.h2d)
        return tuple((i, self.units[i].loc) for i in self._primes)

    def end_capture(self, keep: Primes = ()) -> Counters:
        """After the capture (also after a failed one): the shared engine back, the ring
        forgotten but for ``keep`` (loaded by a call that ran: the CPU stand-in), the counters
        as before it; returns what one replay adds to them."""
        try:
            self.capturing = False
            self._primes, self._floor, self._tail_from = {}, 0, 0
            if self.arena is not None:
                self.arena.engine = self.engine
                self.arena.reset_ring(self.units, None, keep=self._primes_at(keep))
                for unit in self.units:
                    unit.ready = None
                    unit.pending = False
            before, self._saved_counters = self._saved_counters, None
            after = self.counters
            if before is None:
                return Counters()
            delta = Counters(**{
                f.name: getattr(after, f.name) - getattr(before, f.name)
                for f in dataclasses.fields(Counters)
            })  # fmt: skip
            self.counters = before
            if self.arena is not None:  # fn may have called remove()
                self.arena.counters = before
            return delta
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def replaying(self, kept: list[int], primes: Primes = ()):
        """Around the launch of a captured call: the compute stream waits on what eager
        calls left in flight; kept units dropped since, and ``primes`` not where the graph
        expects them, are loaded (eagerly) first. Yields a `Replay`; afterwards the ring is
        guarded by an event recorded after the launch, with ``Replay.primes`` loaded (the
        graph copied them for its next replay)."""
        with self._lock:
            self._check_live()
            self._wait_idle("a graph replay")
            for index in kept:
                unit = self.units[index]
                if unit.loc is None:
                    self.arena.place(unit, prefetch=False)
            replay = Replay(primes)
            replay.loaded = sum(self._load_at(self.units[i], loc) for i, loc in primes)
            waited: set[int] = set()  # after a replay every region holds one event
            stream = self.engine.current_stream()  # None on the CPU: nothing to wait on
            for region in self.arena.regions if stream is not None else ():
                done = region.done
                if done is not None and id(done) not in waited:
                    waited.add(id(done))
                    stream.wait_event(done)
            try:
                yield replay
            finally:
                done = self.engine.record()
                self.arena.reset_ring(self.units, done, keep=self._primes_at(replay.primes))
                for index, _ in replay.primes:
                    self.units[index].ready = done

    def _load_at(self, unit: UnitState, loc: int) -> bool:
        """Load ``unit`` at offset ``loc`` of the ring unless it is there; True if copied."""
        if unit.loc == loc:
            return False
        if unit.loc is not None:
            self.arena.drop(unit)
        self.arena.place(unit, prefetch=False, at=loc)
        return True

    def _primes_at(self, primes: Primes) -> tuple[UnitState, ...]:
        """The units of ``primes`` that are loaded at their places."""
        return tuple(self.units[i] for i, loc in primes if self.units[i].loc == loc)

    def primes(self) -> Primes:
        """The units a captured call should find loaded, and where (Note: [Primed replays]):
        the schedule's first ring units, side by side from the ring's start, as many as fit
        in ``prefetch_depth`` of the largest ring unit and leave room behind them for the
        call's tail (its last ``prefetch_depth + 1`` ring units, and at least two of the
        largest). Empty when nothing streams or nothing is prefetched."""
        order = self.schedule.order
        ring = [self.units[i] for i in dict.fromkeys(order or ()) if self.units[i].fixed is None]
        depth = self.config.prefetch_depth
        if not ring or not depth:
            return ()
        largest = max(u.nbytes for u in ring)
        tail = [i for i in order if self.units[i].fixed is None][-(depth + 1) :]
        tail_bytes = sum(self.units[i].nbytes for i in dict.fromkeys(tail))
        room = min(self.arena.ring_cap - max(tail_bytes, 2 * largest), depth * largest)
        out: list[tuple[int, int]] = []
        at = 0
        for unit in ring:
            if at + unit.nbytes > room:
                break
            out.append((unit.index, at))
            at += unit.nbytes
        return tuple(out)

    def count_replay(self, delta: Counters) -> None:
        """A replay did what its capture counted (``delta``)."""
        with self._lock:
            c = self.counters
            for f in dataclasses.fields(Counters):
                setattr(c, f.name, getattr(c, f.name) + getattr(delta, f.name))
            c.calls += 1
            c.graph_replays += 1

    def _sync(self) -> None:
        """Wait for the device (nothing to wait for on the CPU)."""
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).synchronize(self.device)

    # -- one unit --------------------------------------------------------------------------------

    def _finish(self, unit: UnitState, done: Any) -> None:
        self.arena.finished(unit, done)
        self._unbind(unit)
        unit.busy = False

    def _end_pass(self, p: Pass) -> None:
        self.counters.calls += 1
        ended = self.schedule.end(p)
        if ended is Ended.RECORDED:
            used = sorted({self.units[i] for i in self.schedule.order}, key=lambda u: u.index)
            depth = min(self.config.prefetch_depth + 2, len(used))
            kept = self.arena.keep(used, depth)
            if kept:
                _log.debug("kept %d units", len(kept))
        elif ended is Ended.RERECORDED:
            self.counters.schedule_rerecords += 1
            _log.debug("schedule re-recorded: %s", [self.units[i].name for i in p.record])

    def _prefetch_after(self, pos: int) -> None:
        """Prefetch the next ``prefetch_depth`` units of the schedule that live in the ring;
        kept units found loaded are passed over (Note: [Prefetch counts ring units]). A
        capture prefetches past its call's last unit only its primes, at their places (Note:
        [Primed replays])."""
        depth = self.config.prefetch_depth
        if not depth or not self.arena.ring_cap:  # nothing lives in the ring: all kept
            return
        n = len(self.schedule.order)
        primed = self._primes
        wrap = not self.capturing or bool(primed)
        for j, index in enumerate(self.schedule.ahead(pos, wrap=wrap)):
            unit = self.units[index]
            if unit.fixed is not None and unit.loc is not None:
                continue
            at = None
            if self.capturing and pos + 1 + j >= n:  # the next call's: only primes, in place
                at = primed.get(index)
                if at is None or (unit.busy and unit.loc != at):
                    break  # a prime computing elsewhere now (a short call): `finish_capture`
                if unit.loc not in (None, at):
                    self.arena.drop(unit)
            if not unit.busy:
                if unit.loc is None:
                    floor = self._floor if pos + 1 + j >= self._tail_from else 0
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
        if self.capturing:  # an event of the capture cannot be queried
            self.engine.wait(event)
            return
        if event.query():  # copied already (a kept unit): no wait, now or later
            unit.ready = None
            return
        if self.time_waits:  # Note: [Timing compute-stream waits] in _transfer.py
            self.waits.wait(self.engine.current_stream(), event)
        else:
            self.engine.wait(event)

    # -- binding (Note: [Binding weights in place]) ------------------------------------------

    def _bind(self, unit: UnitState) -> None:
        storage = self.arena.storage
        base = unit.loc
        versions = unit.versions
        versions.clear()
        index = self._device_index  # get_device(): an int, no torch.device made per tensor
        # Gradients are off here (`enter` checked), so set_ on a leaf needs no no_grad().
        classes = unit.classes
        for k, (t, off, leaf) in enumerate(unit.binds):
            cls = classes[k]
            if cls is not None:
                t.__class__ = cls[0]  # Note: [Placeholders never answer]
            if t.dtype is not leaf.dtype or t.get_device() != index:
                self._unbind(unit, k + 1)  # this one too: its class is swapped
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

    def _unbind(self, unit: UnitState, count: int | None = None) -> None:
        """Unbind the unit's tensors (its first ``count`` of them)."""
        empty = self._empty
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

    def _check(self, unit: UnitState, output: Any) -> str | None:
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
        ptr = self.arena.ptr
        for t in _tensors(output):
            if t.device == self.device and t.untyped_storage().data_ptr() == ptr:
                return (
                    f"{unit.name!r} returned a tensor that shares memory with its streamed "
                    "weights (a view of a weight); its bytes will be overwritten. Return a copy, "
                    "or keep the weight resident"
                )
        return None

    # -- the real values (state_dict, load_state_dict) -----------------------------------------

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

        with self._lock:
            self._check_live()
            self._wait_idle("state_dict()")
            if not is_composite(slot.tensor):
                return make(slot.leaves[0])
            return _rebuild(
                slot.tensor, iter(slot.leaves), make, torch.device("cpu"), self._leaf_ids
            )

    def write_host(self, slot: Slot, value: Any) -> str | None:
        """Copy ``value`` into ``slot``'s bytes in the host store; the arena forgets what it
        holds. Returns an error message instead when ``value`` does not fit."""
        if not isinstance(value, torch.Tensor):
            return f"expected a tensor for {slot.name!r}, got {type(value).__name__}"
        pairs: list[tuple[Leaf, torch.Tensor]] = []
        error = _match(slot.tensor, value, iter(slot.leaves), self._leaf_ids, pairs, slot.name)
        if error is not None:
            return error
        with self._lock:
            self._check_live()
            self._wait_idle("load_state_dict()")
            self._sync()  # nothing may still read the host bytes
            with torch.no_grad():
                for leaf, v in pairs:
                    self._host_view(leaf).copy_(v)
            self.arena.clear(self.units)
            self._copies.clear()
        return None

    # -- the host store of placeholders (Note: [Placeholders never answer]) ----------------------

    def read_piece(self, key: Any) -> torch.Tensor:
        """_hosted.HostStore: the piece's bytes, copied to the device on the compute stream. The
        host store changes only between calls (`write_host`, `write_piece`), so a read inside a
        call needs no wait."""
        with self._lock:
            if self.removed:
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
        with self._lock:
            if self.removed:
                raise _hosted.HostedError("this streamed tensor's WeightStreamHandle was removed")
            self._wait_idle("a write to a streamed tensor outside its unit")
            self._sync()  # nothing may still read the host bytes
            lo, hi, off = self.layout.pieces[key]
            with torch.no_grad():
                self.host[off : off + hi - lo].copy_(data)
            self.arena.clear(self.units)
            self._copies.clear()

    def _host_view(self, leaf: Leaf) -> torch.Tensor:
        lo, _, off = self.layout.pieces[leaf.key]
        v = torch.empty(0, dtype=leaf.dtype)
        return v.set_(self.host.untyped_storage(), (off + leaf.start - lo) // v.element_size(),
                      leaf.size, leaf.stride)  # fmt: skip

    # -- remove ----------------------------------------------------------------------------

    def restore(self, keep_values: bool = True) -> None:
        """Put every tensor back where it was (its device, dtype and values; parameters keep
        their identity) and free the arena and the host store. Idempotent. ``keep_values=False``
        frees without copying the values back (tensors nobody else holds)."""
        with self._lock:
            if self.removed:
                return
            self._wait_idle("remove()")
            self.removed = True
            self._sync()
            for leaf in self.layout.leaves:  # plain tensors again before they are rebound
                _hosted.unregister(self.bound[leaf])
            if keep_values:
                with torch.inference_mode(False), torch.no_grad():
                    self._restore()
            for slot in self.layout.streamed:
                STREAMED.pop(slot.tensor, None)
            self.arena.clear(self.units)
            self.arena = None  # type: ignore[assignment]
            self.host = None  # type: ignore[assignment]
            for unit in self.units:
                unit.segments.clear()

    def _restore(self) -> None:
        by_key: dict[Any, list[Leaf]] = {}
        for leaf in self.layout.leaves:
            by_key.setdefault(leaf.key, []).append(leaf)
        for key, leaves in by_key.items():
            lo, hi, host_off = self.layout.pieces[key]
            device = _restored_device(leaves[0].device)
            data = self.host[host_off : host_off + hi - lo]
            copy = data.clone() if device.type == "cpu" else data.to(device)
            storage = copy.untyped_storage()
            for leaf in leaves:
                t = leaf.source
                if t.device != device or t.dtype != leaf.dtype:  # see _bind
                    t.data = torch.empty(0, dtype=leaf.dtype, device=device)
                t.set_(storage, (leaf.start - lo) // t.element_size(), leaf.size, leaf.stride)
        for module, kind, name, original in self.replaced:
            getattr(module, kind)[name] = original
        for t, device in self.moved:
            t.data = t.data.to(_restored_device(device))


def _set_data(t: torch.Tensor, value: torch.Tensor) -> None:
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


def _restored_device(device: torch.device) -> torch.device:
    """Where `restore()` puts a tensor back: where it was, except that a tensor that was on
    the meta device (its values came from a checkpoint) comes back on the host."""
    return torch.device("cpu") if device.type == "meta" else device


def _names(slot: Any) -> list[str]:
    return [q for _, _, q in slot.where]


def _match_checkpoint(layout: Layout, checkpoint: Checkpoint) -> dict[Any, tuple[Entry, Leaf]]:
    """For each streamed storage the checkpoint holds: its entry and its leaf, checked (name
    under any of the tensor's names, dtype, shape, a whole contiguous storage). Raises
    `CheckpointError` before anything is read or changed; a tensor on the meta device that the
    checkpoint lacks is an error (it has no values)."""
    reads: dict[Any, tuple[Entry, Leaf]] = {}
    missing: list[str] = []
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
            continue
        by_key.setdefault(slot.leaves[0].key, []).append((slot, slot.leaves[0]))
    for group in by_key.values():
        names = [n for slot, _ in group for n in _names(slot)]
        entry = checkpoint.find(names)
        if entry is None:
            if any(leaf.source.is_meta for _, leaf in group):
                missing.append(names[0])
            continue
        for slot, leaf in group:
            _check_entry(entry, names[0], leaf.dtype, leaf.size)
            if not slot.tensor.is_contiguous() or leaf.start != 0:
                raise CheckpointError(
                    f"{slot.name!r} is a view into a larger storage: loading it from a "
                    "checkpoint is not supported"
                )
        reads[group[0][1].key] = (entry, group[0][1])
    if not reads and not any(
        n in checkpoint.entries for slot in layout.resident for n in _names(slot)
    ):
        raise CheckpointError(
            f"no tensor of the model is in the checkpoint {checkpoint.source} (model names "
            f"like {layout.streamed[0].name!r}, checkpoint names like "
            f"{next(iter(checkpoint.entries), '(none)')!r}): is it this model's checkpoint?"
        )
    for slot in (*layout.streamed, *layout.resident):
        t = slot.tensor
        if t.is_meta and weakref.getweakrefs(t):
            raise CheckpointError(
                f"{slot.name!r} is on the meta device and something holds a weak reference to "
                "it: its contents cannot be replaced in place; drop the reference (or build "
                "the model on the host) and retry"
            )
    for slot in layout.resident:
        if slot.tensor.is_meta and not any(n in checkpoint.entries for n in _names(slot)):
            missing.append(_names(slot)[0])
    if missing:
        raise CheckpointError(
            f"{len(missing)} tensors are on the meta device and not in the checkpoint "
            f"{checkpoint.source} (first: {', '.join(map(repr, missing[:5]))}): they have no "
            "values. Check that the checkpoint is this model's (names as in state_dict()); "
            "buffers computed at construction (rotary tables) must be real: build with "
            "accelerate's init_empty_weights(include_buffers=False)"
        )
    return reads


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
        out[id(t)] = buf.view(t.dtype).reshape(t.shape)
    return out


def _rebuild(t: torch.Tensor, leaves, make, dev: torch.device, leaf_ids: set[int]):
    """``t`` (a composite) rebuilt with ``make(leaf)`` for each of its streamed inner tensors
    (``leaf_ids``, in flatten order, matching ``leaves``); other empty ones made on ``dev``."""
    entries, rebuild = flatten(t)
    moved: list[Any] = []
    for e in entries:
        if not isinstance(e, torch.Tensor):
            moved.append(e)
        elif is_composite(e):
            moved.append(_rebuild(e, leaves, make, dev, leaf_ids))
        elif id(e) in leaf_ids:
            moved.append(make(next(leaves)))
        else:
            moved.append(torch.empty(e.shape, dtype=e.dtype, device=dev))
    return rebuild(moved)


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


def _tensors(output: Any, depth: int = 0):
    if type(output) in (torch.Tensor, nn.Parameter):
        yield output
    elif depth < 3 and isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item, depth + 1)
