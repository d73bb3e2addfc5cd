"""Which calls are still running: a module hook's cleanup is skipped when a `BaseException`
(KeyboardInterrupt, SystemExit) leaves a forward, since PyTorch runs ``always_call`` forward
hooks for `Exception` only. An engine that began something in a pre-hook remembers the frame
that called the hook; when that frame is no longer on its thread's stack, the call is over and
what it began can be undone (see Note: [One call at a time] in weights/_runtime.py)."""

from __future__ import annotations

import sys
import threading
from types import FrameType


def running(thread: int, frame: FrameType | None) -> bool:
    """Whether ``frame`` is on ``thread``'s stack now (no frame: always)."""
    if frame is None:
        return True
    f = sys._getframe() if thread == threading.get_ident() else sys._current_frames().get(thread)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False
