"""The one budget rule of eager and compiled activation offloading (Note: [Budget rules])."""

from __future__ import annotations

import pytest

from torchoffload import ActivationOffloadConfig
from torchoffload._placement import BudgetPolicy, choose

# (layer, nbytes, key) in save order: layer 0 saves 10 then 30, layer 1 20 then 20, layer 2 40
ITEMS = [(0, 10, "a"), (0, 30, "b"), (1, 20, "c"), (1, 20, "d"), (2, 40, "e")]


def test_earliest_is_a_prefix_in_save_order():
    keep, why = choose(ITEMS, 65, BudgetPolicy.EARLIEST, prefetch_layers=1)
    assert keep == ["a", "b", "c"] and why == {"d": "over", "e": "over"}  # "d" would not fit


def test_largest_takes_the_largest_wherever_they_are():
    keep, why = choose(ITEMS, 75, BudgetPolicy.LARGEST, prefetch_layers=1)
    assert keep == ["b", "e"] and set(why) == {"a", "c", "d"}  # 40 + 30; then no 20 fits in 5
    keep, _ = choose(ITEMS, 80, BudgetPolicy.LARGEST, prefetch_layers=1)
    assert keep == ["a", "b", "e"]  # ties go to earlier layers: 40, 30, then 10 fits


def test_spread_shares_per_layer_largest_first_and_leaves_out_the_peak_layers():
    keep, why = choose(ITEMS, 60, BudgetPolicy.SPREAD, prefetch_layers=1)
    # layers 0-1 share 60: layer 0 gets 30 (takes "b", 30), layer 1 gets 30 (one 20 fits)
    assert keep == ["b", "c"] and why["e"] == "peak" and why["a"] == "over"
    # what layer 0 leaves unused passes to layer 1
    keep, _ = choose(ITEMS, 66, BudgetPolicy.SPREAD, prefetch_layers=1)
    assert keep == ["b", "c"]  # layer 0: share 33, takes 30; layer 1: 36, takes one 20
    keep, _ = choose(ITEMS, 70, BudgetPolicy.SPREAD, prefetch_layers=1)
    assert keep == ["b", "c", "d"]  # layer 0: 35 -> 30; layer 1: 40 -> both 20s
    keep, why = choose(ITEMS, 100, BudgetPolicy.SPREAD, prefetch_layers=0)
    assert keep == ["b", "c", "e"] and "peak" not in why.values()


def test_strings_are_parsed_once_into_the_enum():
    config = ActivationOffloadConfig(budget_policy="largest")
    assert config.budget_policy is BudgetPolicy.LARGEST and config.budget_policy == "largest"
    with pytest.raises(ValueError, match="budget_policy"):
        ActivationOffloadConfig(budget_policy="biggest")
