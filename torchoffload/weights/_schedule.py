"""The recorded order in which a model's units run, and the cursor of the call in progress.

Note: [Schedule]
Units are keyed by module. The order of their pre-forwards within one call of the root module
is recorded on the first call and checked on every later one. A unit found where the schedule
expects another (a branch, a skipped layer) is served at once: from the arena if it is loaded
there, else fetched now (a miss); the cursor resynchronises to that unit's place and the pass
is re-recorded at its end. Weights are found by unit, never by cursor, so a wrong prediction
costs time, never a wrong weight. The schedule is cyclic: the last units of a call prefetch the
first units of the next one (decoding steps in `generate`).
"""

from __future__ import annotations

import bisect
import enum


class Ended(enum.Enum):
    """What the end of a call did to the schedule."""

    VERIFIED = "verified"
    RECORDED = "recorded"  # the first complete call
    RERECORDED = "rerecorded"
    EMPTY = "empty"  # no unit ran


class Pass:
    """One call of the root module: the units it ran and where it stands in the schedule."""

    __slots__ = ("record", "cursor", "diverged")

    def __init__(self) -> None:
        self.record: list[int] = []
        self.cursor = 0
        self.diverged = False


class Schedule:
    def __init__(self) -> None:
        self.order: list[int] | None = None
        self._positions: dict[int, list[int]] = {}

    def advance(self, p: Pass, index: int) -> tuple[int | None, bool]:
        """Unit ``index`` runs now in pass ``p``: its position in the schedule (None when the
        schedule is not known or does not hold it) and whether it came out of order."""
        p.record.append(index)
        order = self.order
        if order is None:
            return None, False
        if p.cursor < len(order) and order[p.cursor] == index:
            pos = p.cursor
            out_of_order = False
        else:
            out_of_order = True
            p.diverged = True
            places = self._positions.get(index)
            if not places:
                return None, True
            i = bisect.bisect_left(places, p.cursor)
            pos = places[i] if i < len(places) else places[0]
        p.cursor = pos + 1
        return pos, out_of_order

    def ahead(self, pos: int, *, wrap: bool = True):
        """The units after position ``pos``, nearest first: cyclic (up to the one before
        ``pos``) unless ``wrap`` is False (up to the call's last). A generator: the caller
        takes as many as it needs."""
        order = self.order
        n = len(order)
        end = n if wrap else n - pos
        for j in range(1, end):
            yield order[(pos + j) % n]

    def end(self, p: Pass) -> Ended:
        if not p.record:
            return Ended.EMPTY
        if self.order is None:
            self._set(p.record)
            return Ended.RECORDED
        if p.diverged or len(p.record) != len(self.order):
            self._set(p.record)
            return Ended.RERECORDED
        return Ended.VERIFIED

    def _set(self, record: list[int]) -> None:
        self.order = list(record)
        self._positions = {}
        for pos, index in enumerate(record):
            self._positions.setdefault(index, []).append(pos)
