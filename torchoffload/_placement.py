"""Where activations go: the one config and the one budget rule that eager
(`apply_activation_offloading`) and compiled (`torchoffload.compile`) activation offloading
share.

Note: [Budget rules]
With ``max_offload_bytes``, the storages offloaded in a step are chosen by one rule, from their
sizes and layers in save (graph) order; the running total never exceeds the budget.
- ``"spread"`` (the default) gives each offloadable layer an equal share of the budget (what a
  layer leaves unused passes to the next) and fills it with that layer's largest storages, so
  every layer's copies can hide behind that layer's compute: a budget of bw x t_fwd is then
  hidden when the layers are alike. It leaves out the last ``prefetch_layers`` offloadable
  layers: they are reloaded as backward starts, when memory peaks, so offloading them would
  not lower the peak.
- ``"largest"`` takes the largest storages of the step wherever they are (ties go to earlier
  layers, so the copies bunch up in the first layers).
- ``"earliest"`` offloads in save order until the first storage that does not fit, so whole
  early layers go first (as TransformerEngine does) and the layers backward needs first stay.
The eager mode applies the rule to the sizes recorded in the previous forward; in its first
step, with no record yet, it applies "earliest" as the storages come.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torchoffload._validate import OnExhausted, check_bool, check_host_bytes, check_int

__all__ = ["ActivationOffloadConfig", "BudgetPolicy", "choose"]


class BudgetPolicy(str, enum.Enum):
    """How ``max_offload_bytes`` is spent (Note: [Budget rules])."""

    SPREAD = "spread"
    LARGEST = "largest"
    EARLIEST = "earliest"

    @classmethod
    def parse(cls, value: object) -> BudgetPolicy:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"budget_policy must be 'spread', 'largest' or 'earliest', got {value!r}"
            ) from None


@dataclass(frozen=True)
class ActivationOffloadConfig:
    """Where activations go, for `apply_activation_offloading` and for the compiled pass
    (`torchoffload.compile`). Validated on construction.

    The pass reads the placement knobs (``prefetch_layers``, ``defer_layers``,
    ``skip_last_layers``, ``max_offload_bytes``, ``min_bytes``, ``budget_policy``); the others
    drive the eager runtime and must keep their defaults there (`check_for_pass`)."""

    prefetch_layers: int = 1  # at layer i's backward start, reload layer i - prefetch_layers
    defer_layers: int = 1  # release layer i's device copies when layer i + defer_layers ends
    skip_last_layers: int = 1  # the last layers' activations stay on the device
    max_offload_bytes: int | None = None  # per-step budget; None: every eligible tensor
    min_bytes: int = 1 << 16  # smaller storages stay on the device
    budget_policy: BudgetPolicy | str = BudgetPolicy.SPREAD  # see Note: [Budget rules]
    offload_outside_layers: bool = False  # also offload embeddings, head, loss (reloaded on demand)
    use_streams: bool = True
    pin_memory: bool = True
    on_pool_exhausted: OnExhausted | str = OnExhausted.FALLBACK
    time_waits: bool = True  # measure how long the compute stream waits on copies (CUDA)
    offload_layers: frozenset[int] | None = None  # only these layers (a plan's choice); None: all

    def __post_init__(self) -> None:
        for name in ("prefetch_layers", "defer_layers", "skip_last_layers", "min_bytes"):
            check_int(name, getattr(self, name), minimum=0)
        if self.max_offload_bytes is not None:
            check_host_bytes("max_offload_bytes", self.max_offload_bytes)
        object.__setattr__(self, "budget_policy", BudgetPolicy.parse(self.budget_policy))
        object.__setattr__(self, "on_pool_exhausted", OnExhausted.parse(self.on_pool_exhausted))
        if self.offload_layers is not None:
            layers = self.offload_layers
            if isinstance(layers, (set, list, tuple)):  # any collection of indices, kept frozen
                layers = frozenset(layers)
                object.__setattr__(self, "offload_layers", layers)
            if not isinstance(layers, frozenset):
                raise TypeError(
                    "offload_layers must be a set of layer indices or None, got "
                    f"{type(layers).__name__}"
                )
            for i in layers:
                check_int("offload_layers entry", i, minimum=0)
        for name in ("offload_outside_layers", "use_streams", "pin_memory", "time_waits"):
            check_bool(name, getattr(self, name))

    def check_for_pass(self) -> None:
        """Raise if a knob the compiled pass cannot honour differs from its default."""
        eager_only = ("offload_outside_layers", "offload_layers", "use_streams", "pin_memory",
                      "on_pool_exhausted", "time_waits")  # fmt: skip
        default = ActivationOffloadConfig()
        changed = [n for n in eager_only if getattr(self, n) != getattr(default, n)]
        if changed:
            raise ValueError(
                f"the compiled activation pass does not support {', '.join(changed)}: those "
                "knobs drive the eager runtime (apply_activation_offloading); leave them at "
                "their defaults for torchoffload.compile"
            )


def choose(
    items: Sequence[tuple[int, int, Hashable]],
    budget: int,
    policy: BudgetPolicy,
    prefetch_layers: int,
) -> tuple[list[Hashable], dict[Hashable, str]]:
    """Note: [Budget rules]. ``items``: (layer, nbytes, key) in save order. Returns the keys
    chosen (in save order) and, for each key left out, why: ``"peak"`` (a spread budget's
    last layers) or ``"over"`` (over the budget)."""
    left = budget
    taken: set[Hashable] = set()
    why: dict[Hashable, str] = {}
    if policy is BudgetPolicy.EARLIEST:
        for _, nbytes, key in items:
            if left is not None and nbytes <= left:
                taken.add(key)
                left -= nbytes
            else:
                left = None  # the first that does not fit closes the prefix
                why[key] = "over"
    elif policy is BudgetPolicy.LARGEST:
        for _, nbytes, key in sorted(items, key=lambda e: -e[1]):  # stable: earlier first
            if nbytes <= left:
                taken.add(key)
                left -= nbytes
            else:
                why[key] = "over"
    else:
        by_layer: dict[int, list[tuple[int, Hashable]]] = defaultdict(list)
        for layer, nbytes, key in items:
            by_layer[layer].append((nbytes, key))
        layers = sorted(by_layer)
        if prefetch_layers and len(layers) > prefetch_layers:
            for layer in layers[len(layers) - prefetch_layers :]:
                why.update((key, "peak") for _, key in by_layer[layer])
            layers = layers[: len(layers) - prefetch_layers]
        for k, layer in enumerate(layers):
            share = left // (len(layers) - k)  # unused shares carry forward
            for nbytes, key in sorted(by_layer[layer], key=lambda e: -e[0]):
                if nbytes <= share:
                    taken.add(key)
                    share -= nbytes
                    left -= nbytes
                else:
                    why[key] = "over"
    return [key for _, _, key in items if key in taken], why
