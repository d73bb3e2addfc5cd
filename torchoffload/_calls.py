"""Which calls are still running: a module hook's cleanup is skipped when a `BaseException`
(KeyboardInterrupt, SystemExit) leaves a forward, since PyTorch runs ``always_call`` forward
hooks for `Exception` only. An engine that began something in a pre-hook remembers the frame
that called the hook; when that frame is no longer on its thread's stack, the call is over and
what it began can be undone (see Note: [One call at a time] in weights/_call.py)."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

_EVAL_FRAME = "torch._dynamo.eval_frame"  # the module of torch.compiler.disable's wrapper


# Note: [Another thread's frame without a collection]
# ``sys._current_frames()`` holds the interpreter's thread-list lock while it builds its dict;
# on CPython before 3.12 (gh-106883) an allocation there may start a garbage collection, and a
# finalizer that needs that lock (one that starts a thread, as an `OffloadedOptimizer` freed
# on one of torchoffload's threads does: Note: [Closing from a thread of our own]) deadlocks
# the process, holding the GIL. Seen as a hung test run on the 2-core machine (Python 3.11.7):
# the worker, polling the caller's frame, collected an earlier test's optimizer. So the
# collector is paused for the call; it runs at the next allocation after.


def current_frame(thread: int) -> FrameType | None:
    """The frame ``thread`` runs now (None: no such thread), with the collector paused
    (Note: [Another thread's frame without a collection])."""
    if thread == threading.get_ident():
        return sys._getframe(1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames().get(thread)
    finally:
        if enabled:
            gc.enable()


def running(thread: int, frame: FrameType | None) -> bool:
    """Whether ``frame`` is on ``thread``'s stack now (no frame: always)."""
    if frame is None:
        return True
    f = current_frame(thread)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def hook_caller(*skip: str) -> FrameType | None:
    """The frame that called a module hook, seen from inside the hook: the first frame up the
    stack whose module (``__name__`` of its globals) is neither one of ``skip`` (the hook's
    own) nor ``torch.compiler.disable``'s wrapper. It is the module's ``_call_impl`` in eager,
    and the compiled frame that called it under torch.compile."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_globals.get("__name__")
        if name not in skip and name != _EVAL_FRAME:
            break
        f = f.f_back
    return f


_eager: dict[Callable[..., Any], Callable[..., Any]] = {}
_eager_lock = threading.Lock()


def run_eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` made opaque to torch.compile (``torch.compiler.disable``: dynamo neither traces
    it nor compiles the frames it calls), made once per function.

    Offloaders call this when they are created, so importing torchoffload does not import
    torch._dynamo. See Note: [Hooks under torch.compile and in copies of the model] in
    layers.py."""
    found = _eager.get(fn)
    if found is None:
        with _eager_lock:
            found = _eager.get(fn)
            if found is None:
                found = _eager[fn] = torch.compiler.disable(fn)
    return found


def eager_call(cls: type) -> None:
    """Make ``cls.__call__`` its ``body``, run eagerly (`run_eagerly`), once per class.

    A hook object whose ``__call__`` is the disabled function itself leaves no Python frame of
    its own for dynamo to compile: a plain ``__call__`` that called the disabled body would be
    compiled, and recompiled per hook type and argument count up to dynamo's limit."""
    if cls.__dict__.get("_eager_call") is not cls.body:
        cls.__call__ = run_eagerly(cls.body)
        cls._eager_call = cls.body
