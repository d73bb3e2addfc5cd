"""Choosing a decision per layer under a memory budget at the least predicted step time."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torchoffload.planner._cost import BOTH, DECISIONS, KEEP, OFFLOAD, RECOMPUTE, CostModel

_log = logging.getLogger(__name__)


# -- choosing -----------------------------------------------------------------------------------


class InfeasibleBudgetError(ValueError):
    """No plan of keep/offload/recompute per layer meets the budget."""


def choose_decisions(
    model: CostModel, budget: int, allowed: Sequence[str] = DECISIONS
) -> list[str]:
    """Greedy: from all-keep, apply the change (among ``allowed``) with the least predicted
    time per byte of peak it removes until the peak fits; then undo changes that are no
    longer needed. The result may not fit when no change helps any more."""
    n = model.n
    decisions = [KEEP] * n
    current = model.predict(decisions)
    moves = {KEEP: (OFFLOAD, RECOMPUTE, BOTH), OFFLOAD: (RECOMPUTE, BOTH), RECOMPUTE: (BOTH,),
             BOTH: ()}  # fmt: skip
    moves = {k: tuple(o for o in v if o in allowed) for k, v in moves.items()}
    while current.peak_bytes > budget:
        best = None
        for i in range(n):
            for option in moves[decisions[i]]:
                trial = decisions.copy()
                trial[i] = option
                pred = model.predict(trial)
                gain = current.peak_bytes - pred.peak_bytes
                if gain <= 0:
                    continue
                cost = max(pred.step_s - current.step_s, 0.0)
                # fewest seconds per byte; among free moves, the one that removes most
                key = (cost / gain, -gain, i)
                if best is None or key < best[0]:
                    best = (key, trial, pred)
        if best is None:
            break
        _, decisions, current = best
    # Undo what the budget no longer needs, latest layers first (they cost the most to move).
    lighter = {KEEP: (), OFFLOAD: (KEEP,), RECOMPUTE: (KEEP, OFFLOAD),
               BOTH: (KEEP, OFFLOAD, RECOMPUTE)}  # fmt: skip
    changed = True
    while changed:
        changed = False
        for i in range(n - 1, -1, -1):
            for option in lighter[decisions[i]]:
                trial = decisions.copy()
                trial[i] = option
                pred = model.predict(trial)
                if pred.peak_bytes <= budget and pred.step_s <= current.step_s:
                    decisions, current, changed = trial, pred, True
                    break
    return decisions


def least_peak(model: CostModel) -> tuple[list[str], int]:
    """The decisions with the least predicted peak, ignoring time: the best uniform plan
    (which wins depends on the windows: offloaded bytes come back a layer early, recomputed
    ones keep the layer's input unless it is offloaded too), then improved one layer at a time
    until no single change lowers the peak."""
    n = model.n
    best = min(([d] * n for d in DECISIONS), key=model.peak)
    peak = model.peak(best)
    improved = True
    while improved:
        improved = False
        for i in range(n):
            for option in DECISIONS:
                if option == best[i]:
                    continue
                trial = best.copy()
                trial[i] = option
                trial_peak = model.peak(trial)
                if trial_peak < peak:
                    best, peak, improved = trial, trial_peak, True
    return best, peak
