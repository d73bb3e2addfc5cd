"""Routing outside a layer's experts in a device-routed call: refused now where the host can
tell, reported at the next call where only the device can (Note: [Routed outside a layer]).

Note: [Routed outside a layer]
A router may name an expert index the layer does not have. transformers' experts give it no one
meaning: the per-expert loop ("eager") of transformers 5.24 skips the index ``n`` (the
expert-parallel sentinel, ``n`` the layer's expert count) and raises for any other outside [0,
``n``) (a negative one or one past ``n``), 5.17's raises for ``n`` too (its one_hot has ``n``
classes; `ExpertLayer.sentinel` says which loop a layer runs); ``batched_mm`` indexes its
weights with it (an IndexError, or for -1 the last expert); ``grouped_mm`` leaves or mixes up
rows (Note: [Grouped experts, one group at a time] in _grouped.py). A host-routed call refuses
every index the resident call would not serve with a ValueError before it computes
(`_grouped.outside`, `loop_outside`: the per-expert loop's one_hot would fail, on a GPU with a
device assert). A device-routed call (a graph's, a block graph's, or the eager run of one)
counts such an index as none (it adds zeros: `_graphed._none_outside`, the routing kernel), so
that no table or address goes wrong, and then:
- run eagerly (not inside a capture), the call checks its routing on the host and raises the
  host path's error before it computes anything: one read of ``top_k`` indices, a host sync on
  a GPU. Eager device-routed calls are block graphs' warm-ups (one per layer and signature) on
  a GPU, and every block-graph call on the CPU;
- inside a capture (and the CPU's stand-in for one), each block call's routing is kept
  (``routed``), and at the end of the captured function a few tensor operations count, in
  ``outside`` on the device, the replays that routed outside a layer and the last such layer
  (1 + its index), and copy both to pinned host memory (``seen``). Twelve small kernels
  (three more to gather the calls of a whole step) and one copy a replay, whatever the layer
  count. The host reads ``seen`` (no sync: a replay's copy lands when it has run) before
  every replay, every block-graph call and every capture; after the device synchronize of a
  host-routed call's `DeviceTables.pull` (so before an eager call, `cached()` and
  `remove()`); and in ``stats()`` after a device synchronize. Where the count passed the
  count it last reported (``acked``) it raises a RuntimeError naming the layer. Nothing is
  zeroed, so no replay in flight can undo a report, and none is reported twice.
So a replay routed outside has returned an output computed as if the expert added zeros (a
result the resident model does not give), and a later call of the handle raises instead of
going on: the next one once the device has run that replay (a host running ahead of the
device learns it a call or two later), and any call that synchronizes. Allowed: the indices
[0, ``n``) of each layer, and ``n`` too where the experts are transformers 5.24's per-expert
loop, whose resident call skips it as the device-routed call does.
A report may also come inside the call that routed outside, from a later layer's block call
(a block graph checks before its replay, and the device may have run the earlier layer's):
the call raises instead of returning; the report is not repeated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from torchoffload.moe._grouped import outside

__all__ = ["RoutedOutside", "check_loop", "loop_mask", "loop_outside"]


def loop_outside(name: str, n: int, sentinel: bool) -> ValueError:
    """The refusal of a call of transformers' per-expert loop routed outside [0, ``n``]
    (``sentinel``: the loop skips ``n``) or [0, ``n``)."""
    if sentinel:
        served = f"[0, {n}] (transformers' per-expert loop skips {n} and raises for the others)"
    else:
        served = (f"[0, {n}) (this transformers' per-expert loop, 5.17's, raises for the "
                  "others: its one_hot has as many classes as experts)")  # fmt: skip
    return ValueError(
        f"{name!r} was routed to an expert index outside {served}. Route to experts of the "
        "layer only"
    )


def loop_mask(top_k_index: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' per-expert loop's mask (expert, top-k position, token) over ``n + 2``
    experts: an index outside [0, ``n``] as ``n + 1`` (-1 too, by the remainder), found with
    the rest and refused by `check_loop` (one_hot would fail on it, on a GPU with a device
    assert); ``n`` the sentinel. Two small kernels more than the resident loop's."""
    index = top_k_index.clamp(-1, n + 1).remainder(n + 2)
    return F.one_hot(index, num_classes=n + 2).permute(2, 1, 0)


def check_loop(layer: Any, sentinel: bool, beyond: bool) -> None:
    """Refuse a host-routed call of the per-expert loop of ``layer`` that routed to the index
    ``n`` (``sentinel``) where its loop does not skip it, or outside [0, ``n``] (``beyond``):
    `loop_mask`'s experts ``n`` and ``n + 1``."""
    if beyond or sentinel and not layer.sentinel:
        raise loop_outside(layer.name, layer.experts, layer.sentinel)


class RoutedOutside:
    """The check of Note: [Routed outside a layer] for one runtime's device tables."""

    def __init__(self, rt: Any):
        self.rt = rt
        layers = rt.layout.layers
        dev = rt.device
        cuda = dev.type == "cuda"
        with torch.inference_mode(False), torch.no_grad():
            # per layer, the largest index served: strict (n - 1) and the per-expert loop's
            # (n where it skips the sentinel n)
            self.top = [(layer.experts - 1, layer.experts - 1 + layer.sentinel)
                        for layer in layers]  # fmt: skip
            self.limits = torch.tensor(self.top, dtype=torch.int64, device=dev)
            self.ids = torch.arange(1, len(layers) + 1, dtype=torch.int64, device=dev)
            # replays that routed outside a layer, and the last such layer (1 + its index)
            self.outside = torch.zeros(2, dtype=torch.int64, device=dev)
            self.seen = torch.zeros(2, dtype=torch.int64, pin_memory=cuda)
        self.pinned = cuda  # ``seen`` is pinned: copied to without blocking
        self.acked = 0  # the count last reported
        self.routed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def call(self, li: int, index: torch.Tensor, impl: str) -> None:
        """A device-routed block call of layer ``li`` routed to ``index`` (one token's, the
        router's order): kept for the capture's check, or checked now when run eagerly."""
        layer = self.rt.layout.layers[li]
        loop = int(impl == "eager")  # ``limits``' column: the per-expert loop's
        if self.rt.graphing:
            self.routed.append((index, self.limits[li, loop], self.ids[li]))
            return
        top = self.top[li][loop]
        if any(not 0 <= i <= top for i in index.tolist()):
            if impl == "eager":  # the resident loop's one_hot refuses it
                raise loop_outside(layer.name, layer.experts, layer.sentinel)
            raise outside(layer.name, layer.experts, impl)

    def record(self) -> None:
        """At the end of a captured function (inside the capture): whether its calls routed
        outside a layer counted, and the last such layer, on the device, both copied to
        ``seen``. Nothing where no call was kept."""
        if not self.routed:
            return
        if len(self.routed) == 1:  # a block graph's call: views, no stack
            index, top, ids = (r.unsqueeze(0) for r in self.routed[0])
        else:
            index, top, ids = (torch.stack(r) for r in zip(*self.routed, strict=True))
        top = top.unsqueeze(1)
        self.routed.clear()
        last = (((index < 0) | (index > top)).any(1) * ids).amax()  # 0: none
        hit = (last > 0).long()
        self.outside.add_(torch.stack([hit, (last - self.outside[1]) * hit]))
        self.seen.copy_(self.outside, non_blocking=self.pinned)

    def forget(self) -> None:
        """A capture that failed: its kept routing is dropped."""
        self.routed.clear()

    def check(self) -> None:
        """Raise `report`'s error, if any."""
        error = self.report()
        if error is not None:
            raise error

    def report(self) -> RuntimeError | None:
        """The error of replays that routed outside a layer since the last report, once
        (reads pinned host memory: no sync)."""
        count, v = self.seen.tolist()
        if count <= self.acked:
            return None
        self.acked = count
        layer = self.rt.layout.layers[v - 1]
        served = f"[0, {layer.experts})"
        if layer.sentinel:
            served += f" ({layer.experts} too where its experts run the per-expert loop)"
        return RuntimeError(
            f"an earlier graph call of stream_experts routed {layer.name!r} to an expert index "
            f"outside {served} (Note: [Routed outside a layer] in "
            "torchoffload/moe/_outside.py): that call computed the expert as adding zeros, which "
            "the resident model does not do, so its output and any token generated from it are "
            "wrong. Route to experts of the layer only"
        )
