"""The call protocol of a weight runtime: ``begin_call(frame)`` / ``end_call(ok)`` around one
call of the whole program, ``enter(i, frame)`` / ``exit(i, output)`` around the use of unit
``i``'s weights (a unit entered outside a call makes a call of its own), one call at a time.

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

import logging
import threading
from types import FrameType
from typing import Any

from torchoffload._calls import running
from torchoffload.weights._pipeline import Pipeline
from torchoffload.weights._schedule import Pass

_log = logging.getLogger(__name__)


class _Call:
    __slots__ = ("thread", "frame", "depth", "pass_", "unit")

    def __init__(self, frame: FrameType | None, pass_: Pass | None, unit: int | None):
        self.thread = threading.get_ident()
        self.frame = frame  # see Note: [One call at a time]
        self.depth = 0  # nested calls of the root module
        self.pass_ = pass_
        self.unit = unit  # the unit of a call made by entering a unit outside a call


class Calls:
    """Who runs ``pipeline`` now: the lock every use of the runtime takes, the call that owns
    it (Note: [One call at a time]) and whether the runtime was removed."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.lock = threading.RLock()
        self._free = threading.Condition(self.lock)
        self.current: _Call | None = None
        self.removed = False

    def begin_call(self, frame: FrameType | None) -> None:
        """A call of the whole program starts (``frame``: the Python frame that runs it)."""
        with self.lock:
            self.check_live()
            call, new = self._own(frame, None)
            if not new:
                call.depth += 1
            else:
                call.pass_ = Pass()

    def end_call(self, ok: bool) -> None:
        """The call started by the matching `begin_call` ends; ``ok``: it returned normally."""
        with self.lock:
            call = self.current
            if call is None or call.thread != threading.get_ident() or call.unit is not None:
                return  # recovered meanwhile (Note: [One call at a time])
            if call.depth:
                call.depth -= 1
                return
            self.release()
            capturing = self.pipeline.state.capturing
            if ok and call.pass_ is not None and not self.removed and not capturing:
                self.pipeline.end_pass(call.pass_)

    def enter(self, index: int, frame: FrameType | None) -> None:
        """Unit ``index`` is about to run: load it (or find it loaded), wait for its copy, bind
        its tensors, prefetch the next units of the schedule."""
        pipeline = self.pipeline
        unit = pipeline.units[index]
        pipeline.check_enter(unit)
        with self.lock:
            if self.removed:
                raise RuntimeError("this WeightStreamHandle was removed")
            call = self.current
            if call is None or call.thread != threading.get_ident() or unit.busy:
                call, new = self._own(frame, index)
            else:
                new = False
            try:
                pos = pipeline.load(unit, call.pass_)
            except BaseException:
                if new:
                    self.release()
                raise
            unit.busy = True
            if pos is not None:
                pipeline.prefetch_after(pos)

    def exit(self, index: int, output: Any) -> None:
        """Unit ``index``'s forward is queued: guard its range with a "done" event, unbind it,
        and raise if it changed a weight or returned one."""
        with self.lock:
            unit = self.pipeline.units[index]
            if not unit.busy:  # its enter raised, or an interrupted call was recovered
                return
            error = self.pipeline.done(unit, output)
            call = self.current
            if call is not None and call.unit == index and call.thread == threading.get_ident():
                self.release()
        if error is not None:
            raise RuntimeError(error)

    def _own(self, frame: FrameType | None, unit: int | None) -> tuple[_Call, bool]:
        """Make this thread own a call: (the call, whether it is new). Waits for a call of
        another thread; recovers an interrupted one. Holds the lock."""
        me = threading.get_ident()
        while True:
            call = self.current
            if call is None:
                self.current = _Call(frame, None, unit)
                return self.current, True
            if running(call.thread, call.frame):
                if call.thread == me and unit is None:
                    return call, False  # the root module called inside its own call
                if call.thread == me:  # a busy unit entered again from inside its own call
                    raise RuntimeError(
                        f"{self.pipeline.units[unit].name!r} was called inside its own "
                        "forward: streamed units may not nest"
                    )
                self._free.wait(0.05)
                continue
            self._recover()

    def release(self) -> None:
        self.current = None
        self._free.notify_all()

    def _recover(self) -> None:
        """Undo what an interrupted call left: busy units unbound, its pass dropped."""
        busy = self.pipeline.recover()
        _log.warning(
            "a call of the streamed model was interrupted (%d units were bound); recovered",
            busy,
        )
        self.release()

    def wait_idle(self, what: str) -> None:
        """Wait until no call runs (recovering an interrupted one). Holds the lock."""
        while self.current is not None:
            call = self.current
            if not running(call.thread, call.frame):
                self._recover()
            elif call.thread == threading.get_ident():
                raise RuntimeError(f"{what} called while a streamed unit is running its forward")
            else:
                self._free.wait(0.05)

    def check_live(self) -> None:
        if self.removed:
            raise RuntimeError("this WeightStreamHandle was removed")
