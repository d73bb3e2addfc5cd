"""A weight runtime under CUDA-graph capture and replay: what is loaded before a capture, how
its copies join it, which units a replay finds loaded (its primes), and what each replay
waits on and leaves behind. `StreamedGraph` (_graph.py) drives it through `WeightRuntime`."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from torchoffload.weights._arena import Counters, UnitState
from torchoffload.weights._call import Calls
from torchoffload.weights._pipeline import Pipeline

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


class Capture:
    """Captures and replays of ``pipeline``'s units (Note: [Weights in a captured graph]),
    under ``calls``' lock: `prepare` takes it, `end` gives it back."""

    def __init__(self, pipeline: Pipeline, calls: Calls):
        self.pipeline = pipeline
        self.calls = calls
        self.state = pipeline.state
        self._saved_counters: Counters | None = None  # as before the capture

    def prepare(self, primes: Primes = ()) -> None:
        """Before a capture, outside it: wait for the device and for calls of other threads,
        load every kept unit and the ``primes`` at their places, forget the rest of the ring.
        Takes the lock, which `end` gives back, so no other call runs until the capture
        ends."""
        p = self.pipeline
        self.calls.lock.acquire()
        try:
            self.calls.check_live()
            self.calls.wait_idle("capture")
            p.sync()
            there = self._primes_at(primes)
            p.arena.reset_ring(p.units, None, keep=there)
            for unit in p.units:
                if unit.fixed is not None and unit.loc is None:
                    p.arena.place(unit, prefetch=False)
            for index, loc in primes:
                if p.units[index].loc is None:
                    p.arena.place(p.units[index], prefetch=False, at=loc)
            p.sync()
            for unit in p.units:
                unit.ready = None
                unit.pending = False
            p.arena.reset_ring(p.units, None, keep=self._primes_at(primes))
            self._saved_counters = dataclasses.replace(p.counters)
        except BaseException:
            self.calls.lock.release()
            raise

    def start(self, engine: Any, primes: Primes = ()) -> None:
        """First thing inside the capture: its copies go to ``engine`` (streams of the graph's
        own), and the ring, but for the ``primes`` (loaded before every replay), is one
        tombstone guarded by an event of the capture stream, so the first copy joins the
        capture. With ``primes``, the call ends by loading them again (Note: [Primed
        replays])."""
        p = self.pipeline
        units = p.units
        misplaced = [u.name for u in units if u.fixed is not None and u.loc != u.fixed]
        misplaced += [units[i].name for i, loc in primes if units[i].loc != loc]
        if misplaced:  # the graph would read them where its own copies write
            raise AssertionError(f"units not at their places at capture: {misplaced}")
        self.state.capturing = True
        p.arena.engine = engine
        p.arena.reset_ring(units, p.engine.record(), keep=self._primes_at(primes))
        for index, _ in primes:
            unit = units[index]
            unit.ready = None  # copied before the replay, which the stream orders after it
            unit.pending = True  # the call's first units: no prefetch overwrites them
        if primes:
            self.state.primes = dict(primes)
            self.state.floor = max(loc + units[i].nbytes for i, loc in primes)
            ring = [k for k, i in enumerate(p.schedule.order) if units[i].fixed is None]
            self.state.tail_from = ring[-min(len(ring), p.depth + 1)]

    def finish(self) -> Primes:
        """Last thing inside the capture: the primes not loaded yet are loaded, and the
        capture stream waits on the graph's copies. Returns where the primes are now (Note:
        [Primed replays])."""
        p = self.pipeline
        for index, loc in self.state.primes.items():
            if not p.units[index].busy:  # busy: the call raised; its error is the one told
                self._load_at(p.units[index], loc)
        engine = p.arena.engine
        saved = self._saved_counters
        copied = saved is None or p.counters.h2d_copies > saved.h2d_copies
        if copied and not engine.synchronous and engine.use_streams:  # else never joined
            p.engine.current_stream().wait_stream(engine.h2d)
        return tuple((i, p.units[i].loc) for i in self.state.primes)

    def end(self, keep: Primes = ()) -> Counters:
        """After the capture (also after a failed one): the shared engine back, the ring
        forgotten but for ``keep`` (loaded by a call that ran: the CPU stand-in), the counters
        as before it; returns what one replay adds to them."""
        p = self.pipeline
        try:
            self.state.capturing = False
            self.state.primes, self.state.floor, self.state.tail_from = {}, 0, 0
            if p.arena is not None:
                p.arena.engine = p.engine
                p.arena.reset_ring(p.units, None, keep=self._primes_at(keep))
                for unit in p.units:
                    unit.ready = None
                    unit.pending = False
            before, self._saved_counters = self._saved_counters, None
            after = p.counters
            if before is None:
                return Counters()
            delta = Counters(**{
                f.name: getattr(after, f.name) - getattr(before, f.name)
                for f in dataclasses.fields(Counters)
            })  # fmt: skip
            for f in dataclasses.fields(Counters):  # the shared object, as before the capture
                setattr(after, f.name, getattr(before, f.name))
            return delta
        finally:
            self.calls.lock.release()

    @contextlib.contextmanager
    def replaying(self, kept: list[int], primes: Primes = ()):
        """Around the launch of a captured call: the compute stream waits on what eager
        calls left in flight; kept units dropped since, and ``primes`` not where the graph
        expects them, are loaded (eagerly) first. Yields a `Replay`; afterwards the ring is
        guarded by an event recorded after the launch, with ``Replay.primes`` loaded (the
        graph copied them for its next replay)."""
        p = self.pipeline
        with self.calls.lock:
            self.calls.check_live()
            self.calls.wait_idle("a graph replay")
            for index in kept:
                unit = p.units[index]
                if unit.loc is None:
                    p.arena.place(unit, prefetch=False)
            replay = Replay(primes)
            replay.loaded = sum(self._load_at(p.units[i], loc) for i, loc in primes)
            waited: set[int] = set()  # after a replay every region holds one event
            stream = p.engine.current_stream()  # None on the CPU: nothing to wait on
            for region in p.arena.regions if stream is not None else ():
                done = region.done
                if done is not None and id(done) not in waited:
                    waited.add(id(done))
                    stream.wait_event(done)
            try:
                yield replay
            finally:
                done = p.engine.record()
                p.arena.reset_ring(p.units, done, keep=self._primes_at(replay.primes))
                for index, _ in replay.primes:
                    p.units[index].ready = done

    def _load_at(self, unit: UnitState, loc: int) -> bool:
        """Load ``unit`` at offset ``loc`` of the ring unless it is there; True if copied."""
        if unit.loc == loc:
            return False
        arena = self.pipeline.arena
        if unit.loc is not None:
            arena.drop(unit)
        arena.place(unit, prefetch=False, at=loc)
        return True

    def _primes_at(self, primes: Primes) -> tuple[UnitState, ...]:
        """The units of ``primes`` that are loaded at their places."""
        units = self.pipeline.units
        return tuple(units[i] for i, loc in primes if units[i].loc == loc)

    def primes(self) -> Primes:
        """The units a captured call should find loaded, and where (Note: [Primed replays]):
        the schedule's first ring units, side by side from the ring's start, as many as fit
        in ``prefetch_depth`` of the largest ring unit and leave room behind them for the
        call's tail (its last ``prefetch_depth + 1`` ring units, and at least two of the
        largest). Empty when nothing streams or nothing is prefetched."""
        p = self.pipeline
        order = p.schedule.order
        ring = [p.units[i] for i in dict.fromkeys(order or ()) if p.units[i].fixed is None]
        depth = p.depth
        if not ring or not depth:
            return ()
        largest = max(u.nbytes for u in ring)
        tail = [i for i in order if p.units[i].fixed is None][-(depth + 1) :]
        tail_bytes = sum(p.units[i].nbytes for i in dict.fromkeys(tail))
        room = min(p.arena.ring_cap - max(tail_bytes, 2 * largest), depth * largest)
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
        with self.calls.lock:
            c = self.pipeline.counters
            for f in dataclasses.fields(Counters):
                setattr(c, f.name, getattr(c, f.name) + getattr(delta, f.name))
            c.calls += 1
            c.graph_replays += 1
