"""The expert cache planner: decode ms per token of `stream_experts` for each cache size, from
the model's shape, a routing profile, the link's rate and the resident model's ms per token.

Note: [Predicting expert streaming]
The counts are the engine's own: a routing profile is replayed through an `ExpertRuntime`
built dry (no cache storage, no host store, nothing copied), driven by ``begin`` / ``route``
/ ``enter`` / ``exit`` / ``end`` in the order the entry points drive the real one. The cache's
choices depend on that order alone, never on timing (a slot is pinned from its route to its
exit, on the host), so a replay of a recorded profile gives the hits, misses, evictions and
bytes that `stream_experts` counts for that run at that cache size and policy, on any device,
where its calls route on the host. One-token calls on the device tables (block graphs, the
default on a GPU, and `cuda_graph`) compute from a stage of ``top_k`` slots taken from the
cache, and choose victims on the device: with ``device_routed=True`` the replay sends such
calls through the same tables (`DeviceTables`, run as tensor operations on the CPU, no copy),
the map moving between host and device at each switch as in a run, so the counts are again
the run's (a test compares them). Prefetch is not replayed.
Time is a bound, per token: the missed experts cross the link while the resident model
computes, ``ms = max(bytes per token / link rate, resident ms per token)``: the copies
overlap all of the compute and nothing else waits. A block's experts cannot be copied before
its router has run, so a run is slower than the bound; ``benchmarks/moe.py`` prints the
ratio. Without overlap it would be the sum (``no_overlap_ms``), the other side of the range.
Measured (H200, Qwen3-30B-A3B shape, 2026-11-28): decode replayed by ``cuda_graph`` without
prefetch ran at 1.00-1.03x the sum (its copies wait for the router, the next block for them),
with prefetch between the two ends; eager decode routed on the host is host-bound (0.99-3.0x
the resident ms across leases), which this does not model; with block graphs it took
0.82-0.96x the resident model's (host-bound) eager step, 107-116 ms at the least cache
(session 34).
A prefill after the profile's steps (``prefill_bytes``, fused grouped_mm experts, a call large
enough to stage every layer: at least 2 routed rows per expert) copies each layer's experts
not cached outside the staging regions, whatever its routing; the prediction walks the layers
over the replayed cache's slots as the engine's staging claims them. Its time is those bytes
over the link: measured prefills of 2048 tokens took 1.00-1.05x that at every cache size
(benchmarks/README.md); the prefill's compute (about 0.1 s there, not modelled) bounds it only
when larger.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchoffload._validate import check_int, check_number
from torchoffload.moe._cache import CachePolicy
from torchoffload.moe._graphed import DeviceTables
from torchoffload.moe._handle import ExpertStreamHandle, expert_layout
from torchoffload.moe._layout import ExpertLayout, LayoutKind, shape_layout
from torchoffload.moe._routing import RoutingProfile
from torchoffload.moe._runtime import ExpertConfig, ExpertRuntime

__all__ = [
    "ExpertPlan",
    "ExpertPrediction",
    "ExpertShape",
    "as_layout",
    "plan_experts",
    "prefill_bytes",
]

_MiB = 1 << 20


@dataclass(frozen=True)
class ExpertShape:
    """A model's experts known by their shape alone: ``layers`` expert layers of ``experts``
    experts, ``top_k`` routed per token, each expert made of tensors of ``member_bytes`` bytes;
    ``fused``: slices of fused parameters (transformers' layout), else a list of modules (the
    cache places the two a little differently: Note: [Experts as units])."""

    layers: int
    experts: int
    top_k: int
    member_bytes: tuple[int, ...]
    fused: bool = True

    def __post_init__(self) -> None:
        check_int("layers", self.layers, minimum=1)
        check_int("experts", self.experts, minimum=1)
        check_int("top_k", self.top_k, minimum=1)
        if not self.member_bytes:
            raise ValueError("member_bytes names no tensor")
        for n in self.member_bytes:
            check_int("member_bytes", n, minimum=1)

    @classmethod
    def fused_mlp(cls, *, layers: int, experts: int, top_k: int, hidden: int, width: int,
                  dtype: torch.dtype = torch.bfloat16) -> ExpertShape:  # fmt: skip
        """The fused gated-MLP experts of transformers 5 (Qwen3-MoE, Mixtral, ...):
        ``gate_up_proj`` (E, 2 x width, hidden) and ``down_proj`` (E, hidden, width)."""
        item = torch.empty((), dtype=dtype).element_size()
        return cls(layers, experts, top_k, (2 * width * hidden * item, hidden * width * item))

    @property
    def expert_bytes(self) -> int:
        return sum(self.member_bytes)

    def layout(self) -> ExpertLayout:
        return shape_layout((self.experts,) * self.layers, self.top_k, self.member_bytes,
                            self.fused)  # fmt: skip


def as_layout(model_or_shape: nn.Module | ExpertStreamHandle | ExpertShape) -> ExpertLayout:
    """The expert layout of a model (streamed or not), a streaming handle or a shape."""
    if isinstance(model_or_shape, ExpertShape):
        return model_or_shape.layout()
    if isinstance(model_or_shape, (nn.Module, ExpertStreamHandle)):
        return expert_layout(model_or_shape)
    raise TypeError(
        "model_or_shape must be an nn.Module, an ExpertStreamHandle or an ExpertShape, got "
        f"{type(model_or_shape).__name__}"
    )


@dataclass(frozen=True)
class ExpertPrediction:
    """What the planner predicts for one cache size: the counts `ExpertStats` would show over
    the profile's steps after the warm-up, and ms per token (Note: [Predicting expert
    streaming])."""

    cache_bytes: int  # the device cache: slots x slot_bytes
    slots: int
    tokens: int
    hits: int
    misses: int
    evictions: int
    h2d_bytes: int
    link_ms: float  # per token: its bytes over the link
    resident_ms: float  # per token: the resident model's compute
    ms_per_token: float  # max(link_ms, resident_ms)
    # a prefill after the profile's steps (Note: [Predicting expert streaming]): the bytes its
    # staged layers copy, and their time over the link; None where it would not be staged
    prefill_bytes: int | None = None
    prefill_ms: float | None = None

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0

    @property
    def bytes_per_token(self) -> float:
        return self.h2d_bytes / self.tokens if self.tokens else 0.0

    @property
    def no_overlap_ms(self) -> float:
        """ms per token if the copies overlapped none of the compute."""
        return self.link_ms + self.resident_ms

    @property
    def bound(self) -> str:
        """What bounds it: "link" or "compute"."""
        return "link" if self.link_ms > self.resident_ms else "compute"


@dataclass(frozen=True)
class ExpertPlan:
    """`plan_experts`' answer: a prediction per cache size (ascending), and for a target ms per
    token the least cache that reaches it. ``print(plan)`` shows the table."""

    model: str  # the experts' shape, in words
    profile: str  # the routing profile, in words
    policy: str
    link_bytes_per_s: float
    resident_ms_per_token: float
    slot_bytes: int
    least_cache_bytes: int  # minimum_cache_bytes: one token's routed experts of one block
    all_cache_bytes: int  # a slot for every expert
    warmup_steps: int
    predictions: tuple[ExpertPrediction, ...]
    target_ms_per_token: float | None = None
    target: ExpertPrediction | None = None  # the least cache reaching it (None: none does)
    device_routed: bool = False  # one-token calls routed on the device (block graphs)

    def reaching(self, ms_per_token: float) -> ExpertPrediction | None:
        """The least cache among ``predictions`` predicted at or under ``ms_per_token``."""
        return next((p for p in self.predictions if p.ms_per_token <= ms_per_token), None)

    def __str__(self) -> str:
        from torchoffload.planner._report import describe_experts

        return describe_experts(self)


def plan_experts(
    model_or_shape: nn.Module | ExpertStreamHandle | ExpertShape,
    profile: RoutingProfile,
    *,
    link_bytes_per_s: float,
    resident_ms_per_token: float,
    cache_bytes: list[int] | None = None,
    policy: str = "lru",
    warmup_steps: int = 0,
    target_ms_per_token: float | None = None,
    device_routed: bool = False,
) -> ExpertPlan:
    """Predict decode ms per token of `stream_experts` at each cache size.

    Args:
        model_or_shape: the model (streamed or not, not changed), its `ExpertStreamHandle`,
            or an `ExpertShape`.
        profile: a `RoutingProfile`: recorded (`ExpertStreamHandle.record_routing`) or
            synthetic (`synthetic_routing`), of this model's expert layers.
        link_bytes_per_s: the pinned host-to-device rate (``benchmarks/link.py`` measures it).
        resident_ms_per_token: the model's decode ms per token with every expert on the device.
        cache_bytes: the sizes to predict (each at least `minimum_cache_bytes`); ``None``: the
            least, doubling up to a slot for every expert.
        policy: ``"lru"`` or ``"lfu"``, as `stream_experts` takes it.
        warmup_steps: steps of the profile replayed first and not counted (as a run that
            calls ``reset_stats()`` after them).
        target_ms_per_token: also find the least cache predicted to reach it (a bisection on
            the slot count: it takes more slots never to predict more bytes per token).
        device_routed: one-token calls routed on the device, as `stream_experts` runs them
            with block graphs (the default on a GPU) and in `cuda_graph`: their cache is the
            device tables', with the stage's ``top_k`` slots taken from it. ``False``: every
            call routed on the host (``block_graphs=False``, the CPU). Fused experts only.

    Returns an `ExpertPlan` (``print`` it for the table). See Note: [Predicting expert
    streaming] for what the prediction assumes.
    """
    layout = as_layout(model_or_shape)
    check_number("link_bytes_per_s", link_bytes_per_s)
    check_number("resident_ms_per_token", resident_ms_per_token, positive=False)
    check_int("warmup_steps", warmup_steps, minimum=0)
    if target_ms_per_token is not None:
        check_number("target_ms_per_token", target_ms_per_token)
    pol = CachePolicy.parse(policy)
    if not isinstance(profile, RoutingProfile):
        raise TypeError(f"profile must be a RoutingProfile, got {type(profile).__name__}")
    ours = tuple(layer.experts for layer in layout.layers)
    if profile.experts != ours:
        raise ValueError(
            f"the profile routes over {profile.layers} expert layers of {profile.experts} "
            f"experts; the model has {len(ours)} of {ours}"
        )
    if profile.steps <= warmup_steps:
        raise ValueError(f"the profile has {profile.steps} steps: none is left after "
                         f"warmup_steps={warmup_steps}")  # fmt: skip
    if device_routed:
        listed = [layer.name for layer in layout.layers if layer.kind is not LayoutKind.FUSED]
        if listed:
            raise ValueError(
                f"device_routed=True: the experts {listed[0]!r} are a list of modules; only "
                "fused experts route on the device (block graphs, cuda_graph)"
            )
    least = layout.least_cache_bytes()
    every = layout.total_experts * layout.slot_bytes
    if cache_bytes is None:
        cache_bytes = [least << i for i in range(64) if least << i < every] + [every]
    if not cache_bytes:
        raise ValueError("cache_bytes names no size (None: a sweep from the least to every expert)")
    for b in cache_bytes:
        check_int("cache_bytes", b, minimum=1)
        if b < least:
            raise ValueError(
                f"cache_bytes={b} is under the least cache, {least} bytes (minimum_cache_bytes: "
                "one token's routed experts of one block)"
            )

    def predict(slots: int) -> ExpertPrediction:
        return _predict(layout, profile, slots, pol, warmup_steps, link_bytes_per_s,
                        resident_ms_per_token, device_routed)  # fmt: skip

    found: dict[int, ExpertPrediction] = {}
    for b in cache_bytes:
        slots = layout.slots_for(b)
        if slots not in found:
            found[slots] = predict(slots)
    target = None
    if target_ms_per_token is not None:
        probes = dict(found)
        target = _least_reaching(layout, target_ms_per_token, resident_ms_per_token, probes,
                                 predict)  # fmt: skip
        if target is not None:
            found[target.slots] = target
    return ExpertPlan(
        model=_describe(layout),
        profile=repr(profile),
        policy=pol.value,
        link_bytes_per_s=float(link_bytes_per_s),
        resident_ms_per_token=float(resident_ms_per_token),
        slot_bytes=layout.slot_bytes,
        least_cache_bytes=least,
        all_cache_bytes=every,
        warmup_steps=warmup_steps,
        predictions=tuple(found[s] for s in sorted(found)),
        target_ms_per_token=target_ms_per_token,
        target=target,
        device_routed=device_routed,
    )


def replay(layout: ExpertLayout, profile: RoutingProfile, slots: int, policy: CachePolicy,
           warmup_steps: int = 0, device_routed: bool = False) -> ExpertRuntime:  # fmt: skip
    """A dry runtime of ``slots`` slots after the profile's block calls (its counters reset
    after ``warmup_steps`` steps); ``device_routed``: one-token calls of ``top_k`` experts
    through the device tables, as block graphs and `cuda_graph` route them. See Note:
    [Predicting expert streaming]."""
    config = ExpertConfig(torch.device("cpu"), slots * layout.slot_bytes, policy,
                          use_streams=False, pin_memory=False, dry=True)  # fmt: skip
    rt = ExpertRuntime(layout, config)
    tables = rt.tables = DeviceTables(rt) if device_routed else None
    step = 0
    with torch.no_grad():
        for call in profile.calls:
            li = call.layer
            if li == 0:
                step += 1
                if step == warmup_steps + 1:
                    rt.reset()
            if tables is not None and call.tokens == 1 and len(call.experts) == tables.k:
                tables.push()  # the map to the device, as before a block graph
                tables.route(li, torch.tensor(sorted(call.experts), dtype=torch.int64))
                continue
            rt.begin(li, call.tokens)  # (the map back to the host first, as in a run)
            try:
                if call.routed is not None:
                    rt.route(li, list(call.routed))
                for e in call.experts:
                    rt.enter(li, e)
                    rt.exit(li, e)
            finally:
                rt.end(li)
    if tables is not None:
        tables.pull()  # the map and the counters
    return rt


def _predict(layout: ExpertLayout, profile: RoutingProfile, slots: int, policy: CachePolicy,
             warmup_steps: int, link: float, resident_ms: float,
             device_routed: bool = False) -> ExpertPrediction:  # fmt: skip
    rt = replay(layout, profile, slots, policy, warmup_steps, device_routed)
    cs = rt.counters
    tokens = cs[0].tokens
    h2d = sum(c.h2d_bytes for c in cs)
    link_ms = h2d / tokens / link * 1e3 if tokens else 0.0
    prefill = prefill_bytes(rt)
    return ExpertPrediction(
        cache_bytes=slots * layout.slot_bytes,
        slots=slots,
        tokens=tokens,
        hits=sum(c.hits for c in cs),
        misses=sum(c.misses for c in cs),
        evictions=rt.cache.evictions,
        h2d_bytes=h2d,
        link_ms=link_ms,
        resident_ms=resident_ms,
        ms_per_token=max(link_ms, resident_ms),
        prefill_bytes=prefill,
        prefill_ms=None if prefill is None else prefill / link * 1e3,
    )


def prefill_bytes(rt: ExpertRuntime) -> int | None:
    """The bytes a prefill copies from the state of ``rt``'s cache: a grouped_mm call of every
    layer in order, each large enough to be staged (in moe/_grouped.py: Note: [Whole layers
    for large calls], Note: [Layers in chunks]); None where a layer would not be staged (a
    list of expert modules, or a cache that holds no two chunks of one expert). A staged
    layer copies every expert not cached outside the regions claimed so far (a whole layer
    claims one region, the next layer the other; a chunked one both): the counts of
    `stream_experts`' own staging, over the same slots."""
    from torchoffload.moe._grouped import StagedLayers

    layers = rt.layout.layers
    if any(layer.kind is not LayoutKind.FUSED for layer in layers):
        return None
    staged = StagedLayers(rt)
    if not all(staged.chunk):
        return None
    claimed: set[int] = set()
    nbytes, region = 0, 0
    for li, layer in enumerate(layers):
        if staged.chunk[li] == layer.experts:
            regions, region = (region,), (region + 1) % staged.regions
        else:
            regions = (0, 1)
        for j in regions:
            claimed.update(s.index for s in staged.slots_of(rt, j))
        held = sum(1 for (owner, _), slot in rt.cache.where.items() if owner == li
                   and slot.index not in claimed)  # fmt: skip
        nbytes += (layer.experts - held) * layer.expert_bytes
    return nbytes


def _least_reaching(
    layout: ExpertLayout,
    target: float,
    resident_ms: float,
    found: dict[int, ExpertPrediction],
    predict: Callable[[int], ExpertPrediction],
) -> ExpertPrediction | None:
    """The fewest slots predicted at or under ``target`` ms per token, by bisection over the
    slot counts; ``found``: the predictions made (more land there)."""
    if resident_ms > target:
        return None  # the compute alone takes longer

    def ok(slots: int) -> bool:
        if slots not in found:
            found[slots] = predict(slots)
        return found[slots].ms_per_token <= target

    lo, hi = layout.slots_for(layout.least_cache_bytes()), layout.total_experts
    if not ok(hi):
        return None
    if ok(lo):
        return found[lo]
    while hi - lo > 1:  # ok(hi), not ok(lo)
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return found[hi]


def _describe(layout: ExpertLayout) -> str:
    layers = layout.layers
    counts = sorted({layer.experts for layer in layers})
    kinds = {layer.kind for layer in layers}
    kind = "fused" if kinds == {LayoutKind.FUSED} else "list" if kinds == {LayoutKind.LIST} else ""
    size = max(layer.expert_bytes for layer in layers)
    total = sum(layer.experts * layer.expert_bytes for layer in layers)
    return (
        f"{len(layers)} expert layers x {'/'.join(map(str, counts))} {kind} experts (top "
        f"{layout.top_k}), {size / _MiB:.2f} MiB an expert in slots of "
        f"{layout.slot_bytes / _MiB:.2f} MiB, {total / 2**30:.2f} GiB of experts"
    ).replace("  ", " ")
