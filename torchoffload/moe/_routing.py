"""Routing profiles: which experts each block call of a mixture-of-experts model used, in order.
Recorded from a streamed model (`ExpertStreamHandle.record_routing`) or made up
(`torchoffload.planner.synthetic_routing`); the planner replays one through the runtime's
bookkeeping to predict the cache's hits and the bytes copied (`torchoffload.planner.plan_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["NO_RECORDER", "BlockCall", "Recorder", "RoutingProfile", "RoutingRecorder"]


class Recorder:
    """What the runtime tells of each block call (under its lock); this one records nothing."""

    def begin(self, li: int, rows: int) -> None:
        """Layer ``li``'s block starts on ``rows`` tokens."""

    def enter(self, li: int, e: int, routed: list[int]) -> None:
        """Expert ``e`` computes; ``routed``: what the block routed ahead so far."""


NO_RECORDER = Recorder()


@dataclass(frozen=True)
class BlockCall:
    """One call of an expert layer's block, as the runtime saw it."""

    layer: int  # the expert layer (0: the model's first one)
    tokens: int  # rows of hidden states through the block
    experts: tuple[int, ...]  # the experts it computed, in the order they computed
    # routed ahead (ascending) when its first expert computed (None: nothing routed ahead)
    routed: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RoutingProfile:
    """The block calls of a run, in order: a step (one call of the model, a token when decoding
    at batch 1) starts at each call of the first expert layer.

    ``experts``: the experts of each expert layer; ``top_k``: the most experts one token routes
    to in one block; ``source``: where the profile came from ("recorded", "uniform", "zipf
    a=1 drift=8").
    """

    experts: tuple[int, ...]
    top_k: int
    calls: tuple[BlockCall, ...]
    source: str = "recorded"

    def __post_init__(self) -> None:
        if not self.experts or any(n < 1 for n in self.experts) or self.top_k < 1:
            raise ValueError(
                f"a profile needs expert layers of at least one expert and top_k >= 1, got "
                f"experts={self.experts} top_k={self.top_k}"
            )
        for i, c in enumerate(self.calls):
            if not 0 <= c.layer < len(self.experts) or c.tokens < 0:
                raise ValueError(f"call {i} of the profile names layer {c.layer} with "
                                 f"{c.tokens} tokens; the model has {len(self.experts)} expert "
                                 "layers")  # fmt: skip
            n = self.experts[c.layer]
            if any(not 0 <= e < n for e in (*c.experts, *(c.routed or ()))):
                raise ValueError(f"call {i} of the profile routes to an expert outside layer "
                                 f"{c.layer}'s {n}: {c.experts}")  # fmt: skip

    @property
    def layers(self) -> int:
        return len(self.experts)

    @property
    def steps(self) -> int:
        """Calls of the first expert layer."""
        return sum(1 for c in self.calls if c.layer == 0)

    @property
    def tokens(self) -> int:
        """Tokens through the first expert layer (what `ExpertStats.tokens` counts)."""
        return sum(c.tokens for c in self.calls if c.layer == 0)

    def __repr__(self) -> str:
        return (
            f"RoutingProfile({self.source}: {self.steps} steps, {self.tokens} tokens, "
            f"{len(self.calls)} block calls; {self.layers} expert layers of "
            f"{max(self.experts)} experts, top {self.top_k})"
        )


class RoutingRecorder(Recorder):
    """What `ExpertStreamHandle.record_routing` returns: a context manager that records every
    block call of the streamed model while it is open; `profile` returns what it recorded.
    Eager calls only: a call replayed by `ExpertStreamHandle.cuda_graph` routes on the device
    and is not recorded."""

    def __init__(self, runtime: Any):
        self._rt = runtime
        layout = runtime.layout
        self._experts = tuple(layer.experts for layer in layout.layers)
        self._top_k = layout.top_k
        self._calls: list[list[Any]] = []  # [layer, tokens, routed, experts]
        self._open: dict[int, list[Any]] = {}  # layer -> its call in progress

    def __enter__(self) -> RoutingRecorder:
        rt = self._rt
        with rt._lock:
            rt._check_live()
            if rt.recorder is not NO_RECORDER:
                raise RuntimeError("this handle already records its routing")
            rt.recorder = self
        return self

    def __exit__(self, *exc: object) -> None:
        with self._rt._lock:
            if self._rt.recorder is self:
                self._rt.recorder = NO_RECORDER
            self._open.clear()

    def profile(self) -> RoutingProfile:
        """The block calls recorded so far."""
        with self._rt._lock:
            calls = tuple(BlockCall(li, rows, tuple(experts), routed)
                          for li, rows, routed, experts in self._calls)  # fmt: skip
        return RoutingProfile(self._experts, self._top_k, calls, "recorded")

    # - What the runtime tells it (an expert called outside its block's forward is a call of
    #   its own, of 0 tokens)

    def begin(self, li: int, rows: int) -> None:
        call = [li, rows, None, []]
        self._calls.append(call)
        self._open[li] = call

    def enter(self, li: int, e: int, routed: list[int]) -> None:
        call = self._open.get(li)
        if call is None:
            return
        if not call[3] and routed:
            call[2] = tuple(routed)
        call[3].append(e)
