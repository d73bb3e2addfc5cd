"""The public face of expert streaming: `stream_experts`, `minimum_cache_bytes`, the handle and
its stats."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchoffload import _hosted
from torchoffload._transfer import compute_device
from torchoffload._validate import check_bool, check_int
from torchoffload.moe._cache import CachePolicy
from torchoffload.moe._forward import NO_COPY, install
from torchoffload.moe._host import HostCompute, HostExperts, check_host_layout
from torchoffload.moe._layout import ExpertLayout, find_experts
from torchoffload.moe._replayed import BlockGraphs
from torchoffload.moe._routing import RoutingRecorder
from torchoffload.moe._runtime import ExpertConfig, ExpertRuntime
from torchoffload.weights._runtime import STREAMED, WeightRuntime

__all__ = [
    "ExpertLayerStats",
    "ExpertStats",
    "ExpertStreamHandle",
    "expert_layout",
    "minimum_cache_bytes",
    "stream_experts",
]

# ``prefetch=True``'s experts copied ahead per block call: the best of 1, 2 and 8 (uncapped) at
# the Qwen3-30B-A3B shape on an H200 (Note: [Prefetch by the next router] in _graphed.py)
PREFETCH_AHEAD = 2

_log = logging.getLogger(__name__)
_MiB = 1 << 20
_ATTR = "_torchoffload_experts"


@dataclass(frozen=True)
class ExpertLayerStats:
    """One expert layer's counters."""

    name: str  # the experts' qualified name
    experts: int
    expert_bytes: int  # bytes copied per missed expert
    calls: int  # calls of its block
    tokens: int  # tokens through its block
    hits: int  # routed experts found in the device cache
    misses: int  # routed experts copied for their use
    h2d_bytes: int
    host_computed: int = 0  # routed experts missing from the cache computed on the host
    # experts copied over the link with their layer (a large grouped_mm call), not routed to
    staged: int = 0

    @property
    def uses(self) -> int:
        """Routed experts used: in each call, each expert that at least one token routed to."""
        return self.hits + self.misses + self.host_computed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 1.0


@dataclass(frozen=True)
class ExpertStats:
    """Counters of an `ExpertStreamHandle` since setup (or `reset_stats`). Bytes are exact."""

    layers: tuple[ExpertLayerStats, ...]
    slots: int  # experts the device cache holds
    slot_bytes: int
    cache_bytes: int  # the device cache: slots x slot_bytes (at most cache_bytes asked)
    cached: int  # experts in the cache now
    host_bytes: int  # the host store of every expert
    dense_bytes: int  # the other tensors, on the device outside the cache
    calls: int  # calls of the first expert layer's block
    tokens: int  # tokens through the first expert layer's block
    hits: int
    misses: int
    evictions: int
    h2d_bytes: int  # expert bytes copied to the device
    h2d_copies: int  # experts copied (with `unused` ones)
    unused: int  # experts copied ahead for a use that did not come (a failed block)
    prefetched: int  # experts copied ahead on the next router's prediction (prefetch=True)
    setup_s: float
    host_computed: int = 0  # misses computed on the host (host_compute), not copied
    staged: int = 0  # copied over the link with their layer, not routed to
    # eager one-token block calls replayed as graphs (block_graphs), graphs captured for
    # them, and such calls run without a graph (each signature's first; every one on the CPU)
    block_replays: int = 0
    block_captures: int = 0
    block_eager_calls: int = 0
    # the cache's parts: consecutive slots caching a run of layers' experts, each with a stage
    # of top_k slots in graph calls (Note: [Parts of the cache]); 1 up to 1023 slots
    parts: int = 1

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses + self.host_computed
        return self.hits / total if total else 1.0

    @property
    def bytes_per_token(self) -> float:
        return self.h2d_bytes / self.tokens if self.tokens else 0.0


class ExpertStreamHandle:
    """What `stream_experts` returns: ``stats()``, ``reset_stats()``, ``remove()``. Also a
    context manager: leaving the ``with`` block calls ``remove()``."""

    def __init__(self, runtime: ExpertRuntime | None = None, undo: list[Any] | None = None,
                 model: nn.Module | None = None, moved: list | None = None,
                 setup_s: float = 0.0):  # fmt: skip
        if not isinstance(runtime, ExpertRuntime):
            raise TypeError("use torchoffload.stream_experts(model, ...) to create a handle")
        self._runtime = runtime
        self._undo = list(undo or [])
        self._model = model
        self._moved = list(moved or [])  # (dense tensor, the device it came from)
        self._setup_s = setup_s

    @property
    def device(self) -> torch.device:
        return self._runtime.device

    @property
    def layers(self) -> list[str]:
        """The expert layers' qualified names, in model order."""
        return [layer.name for layer in self._runtime.layout.layers]

    @property
    def removed(self) -> bool:
        return self._runtime.removed

    @property
    def host_compute(self) -> HostCompute | None:
        """The host compute in force (Note: [Cold experts on the host]), its rates as measured
        at setup where they were not given; None when off."""
        host = self._runtime.host
        return None if host is None else host.config

    def cached(self) -> list[tuple[str, int]]:
        """(layer name, expert index) of every expert in the device cache now."""
        rt = self._runtime
        with rt._lock:
            rt._check_live()
            rt.own_map()
            return sorted((rt.layout.layers[li].name, e) for li, e in rt.cache.where)

    def stats(self) -> ExpertStats:
        rt = self._runtime
        with rt._lock:
            if rt.tables is not None:  # graph calls count on the device
                from torchoffload.moe._graphed import pull_counts

                rt._sync()  # replays on any stream (Note: [Routed outside a layer])
                pull_counts(rt.tables)
                rt.tables.outside.check()
            layout = rt.layout
            layers = tuple(
                ExpertLayerStats(
                    layer.name,
                    layer.experts,
                    layer.expert_bytes,
                    c.calls,
                    c.tokens,
                    c.hits,
                    c.misses,
                    c.h2d_bytes,
                    c.host_computed,
                    c.staged,
                )  # fmt: skip
                for layer, c in zip(layout.layers, rt.counters, strict=True)
            )
            cs = rt.counters
            graphs = rt.block_graphs
            slots = 0 if rt.removed else len(rt.cache.slots)
            cached = 0 if rt.removed else len(rt.cache.where)
            if rt.tables is not None and rt.tables.owned:
                cached = int((rt.tables.key_of[:-1] >= 0).sum())
            return ExpertStats(
                layers=layers,
                slots=slots,
                slot_bytes=layout.slot_bytes,
                cache_bytes=slots * layout.slot_bytes,
                cached=cached,
                host_bytes=layout.host_bytes,
                dense_bytes=sum(t.numel() * t.element_size() for _, t in layout.dense),
                calls=cs[0].calls,
                tokens=cs[0].tokens,
                hits=sum(c.hits for c in cs),
                misses=sum(c.misses for c in cs),
                evictions=rt.cache.evictions,
                h2d_bytes=sum(c.h2d_bytes for c in cs),
                h2d_copies=sum(c.loads for c in cs),
                unused=sum(c.unused for c in cs),
                prefetched=sum(c.prefetched for c in cs),
                setup_s=self._setup_s,
                host_computed=sum(c.host_computed for c in cs),
                staged=sum(c.staged for c in cs),
                block_replays=0 if graphs is None else graphs.replays,
                block_captures=0 if graphs is None else graphs.captures,
                block_eager_calls=0 if graphs is None else graphs.warm_ups,
                parts=0 if rt.removed else len(rt.cache.parts),
            )

    def cuda_graph(self, fn: Any, *, max_graphs: int = 8) -> Any:
        """``fn`` (a decode step that calls the streamed model on one token) as a
        `StreamedGraph`: the first call of an argument signature runs eagerly, the second is
        captured as a CUDA graph with the routing, the cache's map and the copies of missed
        experts in it, and later calls replay it (Note: [Routed experts in a CUDA graph]).
        Outputs are bitwise the resident model's. Each block call inside it must be of one
        token (run prefills outside the graphed function). While graphs run, the cache's last
        ``top_k`` slots hold the experts being computed. Fused experts only (transformers'
        layout). On the CPU the same bookkeeping runs without a graph. The graph's
        ``stats()`` counts captures and replays; the handle's counts the experts."""
        from torchoffload.moe._graphed import ExpertGraphs, check_graphable
        from torchoffload.weights._graph import StreamedGraph

        rt = self._runtime
        with rt._lock:
            rt._check_live()
            _check_not_streamed_over(rt.layout, graph=True)
            check_graphable(rt)
            return StreamedGraph(ExpertGraphs(rt), fn, max_graphs=max_graphs, prime=False,
                                 handle=self, model=self._model)  # fmt: skip

    def reset_stats(self) -> None:
        with self._runtime._lock:
            self._runtime.reset()

    def record_routing(self) -> RoutingRecorder:
        """Record which experts every block call uses while the returned context is open::

            with handle.record_routing() as rec:
                model.generate(...)
            profile = rec.profile()  # a RoutingProfile, for torchoffload.planner.plan_experts

        A few list appends per block call; one recording at a time."""
        self._runtime._check_live()
        return RoutingRecorder(self._runtime)

    def remove(self) -> None:
        """Put every expert tensor back where it was (its device, dtype and values; parameters
        keep their identity), the dense tensors on their devices, and free the cache and the
        host store. Idempotent. Refused, changing nothing, while `stream_weights` streams
        the dense parts: remove that handle first."""
        rt = self._runtime
        with rt._lock:
            if rt.removed:
                return
            _check_not_streamed_over(rt.layout)
            _restore(rt)  # raises, changing nothing, inside a forward
            for u in self._undo:
                u.remove()
            self._undo.clear()
            _move_back(self._moved)
            if self._model is not None and getattr(self._model, _ATTR, None) is self:
                delattr(self._model, _ATTR)

    def __enter__(self) -> ExpertStreamHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(NO_COPY)

    def __repr__(self) -> str:
        rt = self._runtime
        if rt.removed:
            return "ExpertStreamHandle(removed)"
        return (
            f"ExpertStreamHandle({len(rt.layout.layers)} layers, {len(rt.cache.slots)} slots "
            f"of {rt.layout.slot_bytes / _MiB:.2f} MiB, policy={rt.config.policy.value}, "
            f"device={rt.device})"
        )


# -- setup ------------------------------------------------------------------------------------


def _ahead(prefetch: object) -> int:
    """``stream_experts``' ``prefetch`` as the experts a block call copies ahead (0: none)."""
    if isinstance(prefetch, bool):
        return PREFETCH_AHEAD if prefetch else 0
    if not isinstance(prefetch, int):
        raise TypeError(
            f"prefetch must be a bool or an int (the experts copied ahead a block call, at "
            f"most), got {type(prefetch).__name__}"
        )
    check_int("prefetch", prefetch, minimum=0)
    return prefetch


def stream_experts(
    model: nn.Module,
    device: torch.device | str | int | None = None,
    *,
    cache_bytes: int,
    policy: str = "lru",
    use_streams: bool = True,
    pin_memory: bool = True,
    prefetch: bool | int = False,
    host_compute: bool | str | HostCompute = False,
    block_graphs: bool | None = None,
) -> ExpertStreamHandle:
    """Keep ``model``'s experts in pinned host memory and copy to ``device`` only the experts
    each block's router picks that are not in a device cache of ``cache_bytes``.

    For inference (call the model under `torch.no_grad()` or `torch.inference_mode()`).

    Args:
        model: a mixture-of-experts model: fused experts as Hugging Face transformers 5 keeps
            them (``gate_up_proj`` and ``down_proj`` with the experts on the leading dimension,
            with the eager experts implementation), or a ``ModuleList`` named ``experts`` of
            identical modules beside a router. Its other tensors (the dense parts) are moved to
            ``device`` and stay there, or stream with `stream_weights` applied after this
            (Note: [Tensors hosted by another engine] in weights/_layout.py).
        device: where the model computes. ``None``: the current accelerator, else the CPU
            (the same logic runs there synchronously, for testing).
        cache_bytes: device bytes for the expert cache. At least `minimum_cache_bytes` (one
            token's routed experts of one block). A cache of more than 1023 slots is cut
            into parts, each with a stage of ``top_k`` slots that a CUDA graph computes
            misses from (Note: [Parts of the cache]); slots past every expert and the fewest
            parts' stages buy more parts, down to a part per layer (the cap: every expert
            and ``top_k`` a layer), over which graph calls compute faster. Beyond every
            expert, eager calls leave those slots empty.
        policy: which expert the full cache evicts: ``"lru"`` (used longest ago) or ``"lfu"``
            (used least often since setup). See Note: [The expert cache].
        use_streams: copy on a dedicated stream (overlapping compute); ``False`` queues the
            copies on the compute stream.
        pin_memory: page-lock the host store (only where an accelerator exists).
        prefetch: in calls replayed by `cuda_graph`, run each next block's router on the
            current block's hidden states and copy the experts it predicts into the cache
            while this block computes, at most ``prefetch`` of them a block (an int), those
            the router scores highest first; ``True``: at most 2 (``PREFETCH_AHEAD``). About
            as many as the link copies while one block computes a decode step pays best:
            more make the next block wait for copies it may not use (Note: [Prefetch by the
            next router] has the measurements). Eager calls do not prefetch.
        host_compute: compute cold experts on the host (fused experts only): in an eager block
            call of a few tokens, routed experts missing from the cache run on the CPU from
            the host store while the device computes the others, instead of being copied
            (See Note: [Cold experts on the host]). ``False`` (default): off; ``True``: every
            such miss; ``"auto"``: the misses split between the host and the link by rates
            measured at setup; or a `HostCompute`. Their values are then the CPU kernels'
            (bitwise on a CPU device only); every expert computed on the device is bitwise
            the resident loop's, and the sum keeps its order. They do not enter the cache.
        block_graphs: eager block calls of one token (batch-1 decode) replayed as one CUDA
            graph per layer, routing and copies on the device with no host read: the host
            runs ahead of the device instead of waiting for each block's routing (see the
            design in Note: [Block calls replayed as graphs]). ``None`` (default): on where
            the model allows it (a CUDA device, fused experts whose slices are multiples of
            512 bytes, a pinned host store, triton, no ``host_compute``); ``True``: required
            (an error says what stands in the way; on the CPU the same path runs without
            graphs, for testing); ``False``: off. Outputs stay bitwise the resident model's.
            While they run, the cache's last ``top_k`` slots hold the experts being computed,
            as in `cuda_graph`.

    Returns an `ExpertStreamHandle`: ``stats()``, ``cached()``, ``remove()``.

    Outputs are bitwise identical to the resident model's, except for what ``host_compute``
    computes on the host.

    Outside its forward an expert tensor is a placeholder whose reads and writes are served
    from the host store (``model.state_dict()``, ``p.norm()``, ``p.mul_(2)`` under no_grad),
    or refused with a clear error (Note: [Placeholders never answer] in _hosted.py).
    """
    start = time.perf_counter()
    _check_model(model)
    check_int("cache_bytes", cache_bytes, minimum=1)
    check_bool("use_streams", use_streams)
    check_bool("pin_memory", pin_memory)
    prefetch = _ahead(prefetch)
    if block_graphs is not None:
        check_bool("block_graphs", block_graphs)
    host = HostCompute.parse(host_compute)
    config = ExpertConfig(compute_device(device), cache_bytes, CachePolicy.parse(policy),
                          use_streams, pin_memory, prefetch)  # fmt: skip
    layout = find_experts(model)
    if host is not None:
        check_host_layout(layout)
    least = layout.least_cache_bytes()
    if cache_bytes < least:
        raise ValueError(
            f"cache_bytes={cache_bytes} holds {cache_bytes // layout.slot_bytes} experts of "
            f"{layout.slot_bytes} bytes; the least is {least} bytes: {least // layout.slot_bytes}"
            " experts, one token's routed experts of one block (minimum_cache_bytes(model))"
        )
    meta = [name for name, t in layout.dense if t.is_meta]
    if meta:
        raise ValueError(f"{len(meta)} tensors of the model are on the meta device (first: "
                         f"{meta[0]!r}) and have no values")  # fmt: skip
    with torch.inference_mode(False), torch.no_grad():
        runtime = ExpertRuntime(layout, config)
    moved: list[tuple[torch.Tensor, torch.device]] = []
    try:
        if host is not None:  # its rates may be measured now (Note: [Cold experts on the host])
            runtime.host = HostExperts(runtime, host)
        runtime.block_graphs = _block_graphs(runtime, block_graphs)
        _move_dense(layout, config.device, moved)
        undo = install(runtime, model)
    except BaseException:  # out of memory: the model as it was
        _restore(runtime)
        _move_back(moved)
        raise
    undo += _hosted.guard_conversions(model, "stream_experts", NO_COPY)
    handle = ExpertStreamHandle(runtime, undo, model, moved, time.perf_counter() - start)
    setattr(model, _ATTR, handle)
    _log.info(
        "streaming %d expert layers (%.1f MiB on the host) through a cache of %d experts "
        "(%.1f MiB)", len(layout.layers), layout.host_bytes / _MiB, len(runtime.cache.slots),
        len(runtime.cache.slots) * layout.slot_bytes / _MiB,
    )  # fmt: skip
    return handle


def _block_graphs(rt: ExpertRuntime, asked: bool | None) -> BlockGraphs | None:
    """The runtime's `BlockGraphs` as ``block_graphs`` asks (Note: [Block calls replayed as
    graphs])."""
    if asked is False or (asked is None and rt.device.type != "cuda"):
        return None
    if rt.host is not None:
        if asked:
            raise ValueError(
                "block_graphs=True and host_compute: a block graph computes every routed "
                "expert on the device. Choose one (block_graphs=None picks host_compute)"
            )
        return None
    try:
        return BlockGraphs(rt)
    except ValueError as e:
        if asked:
            raise ValueError(f"block_graphs=True: {e}") from None
        _log.info("eager block calls route on the host: %s", e)
        return None


def minimum_cache_bytes(model: nn.Module) -> int:
    """The smallest ``cache_bytes`` that `stream_experts` accepts for ``model``: one token's
    routed experts of one block (``top_k`` slots of the largest expert). The model is not
    changed."""
    _check_model(model)
    return find_experts(model).least_cache_bytes()


def expert_layout(model: nn.Module | ExpertStreamHandle) -> ExpertLayout:
    """The layout of a model's experts: its handle's while it streams them (the tensors are
    placeholders then), else found now (the model is not changed)."""
    handle = model if isinstance(model, ExpertStreamHandle) else getattr(model, _ATTR, None)
    if isinstance(handle, ExpertStreamHandle):
        handle._runtime._check_live()
        return handle._runtime.layout
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module or an ExpertStreamHandle, got "
                        f"{type(model).__name__}")  # fmt: skip
    return find_experts(model)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError(
            "this model already streams its experts; call that handle's remove() first"
        )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(STREAMED.get(t), WeightRuntime):
            raise RuntimeError(
                f"{name!r} already streams with stream_weights. To stream the experts too, "
                "apply stream_experts first and stream_weights over what it leaves: call the "
                "stream_weights handle's remove(), then stream_experts(model, ...), then "
                "stream_weights(model, ...)"
            )
        if t in _hosted.REFS:
            raise RuntimeError(
                f"{name!r} already streams with another engine (its values live in that "
                "handle's host store); call that handle's remove() first"
            )


# -- composing with stream_weights (Note: [Tensors hosted by another engine] in
# weights/_layout.py): stream_weights over a model whose experts stream here holds the dense
# tensors; they come back to this handle when its remove() runs, so it runs second.


def _check_not_streamed_over(layout: ExpertLayout, graph: bool = False) -> None:
    """Refuse, changing nothing, to remove (or to capture, ``graph``) while another engine
    holds the dense tensors."""
    for name, t in layout.dense:
        if t not in STREAMED and t not in _hosted.REFS:
            continue
        if graph:
            raise RuntimeError(
                f"cuda_graph: stream_weights (or another engine) streams this model's dense "
                f"tensors (first: {name!r}); its units load eagerly, which a graph of the "
                "routed experts cannot capture. Graph mode keeps the dense parts resident: "
                "remove() that handle first, or call the model eagerly"
            )
        raise RuntimeError(
            f"stream_weights (or another engine) streams this model's dense tensors "
            f"(first: {name!r}), applied after stream_experts: call that handle's remove() "
            "first, then this one's. Nothing was changed"
        )


def _restore(rt: ExpertRuntime) -> None:
    """`ExpertRuntime.restore`, then the host compute's worker stopped."""
    rt.restore()
    if rt.host is not None:
        rt.host.close()


def _move_dense(layout: ExpertLayout, device: torch.device, moved: list) -> None:
    """The dense tensors to ``device`` (identity kept); ``moved`` records each as it goes."""
    with torch.inference_mode(False), torch.no_grad():
        for _, t in layout.dense:
            if t.device != device:
                value = t.data.to(device)
                moved.append((t, t.device))
                t.data = value


def _move_back(moved: list) -> None:
    with torch.inference_mode(False), torch.no_grad():
        for t, device in moved:
            t.data = t.data.to(device)
    moved.clear()
