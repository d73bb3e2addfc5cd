"""Finding the experts of a model and placing their bytes: pure functions of the model's modules
and tensors (nothing is changed). `find_experts` returns an `ExpertLayout`; the least cache is
`ExpertLayout.least_cache_bytes`; the runtime builds its state from the layout.

Two layouts are known (Note: [Experts as units]):
- *fused*: one parameter per projection with the experts on the leading dimension, as Hugging
  Face transformers 5 keeps them (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)); an
  expert is a slice of each parameter;
- *list*: a ``ModuleList`` named ``experts`` of modules of one type and one set of tensor
  shapes, inside a block that also holds a router (a child named like ``gate`` or ``router``
  with a weight of E rows); an expert is one module of the list.
"""

from __future__ import annotations

import enum
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchoffload._modules import held
from torchoffload.moe._references import known

__all__ = [
    "GROUP_LIMIT",
    "ExpertLayer",
    "ExpertLayout",
    "LayoutKind",
    "Member",
    "Part",
    "Piece",
    "check_grouped",
    "find_experts",
    "implementation",
    "region_bytes",
    "shape_layout",
]

ALIGN = 512  # the caching allocator's block alignment (Note: [Experts as units])
HOST_ALIGN = 64


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def region_bytes(nbytes: int, fused: bool) -> int:
    """A member's region in a slot (Note: [Experts as units]): its bytes rounded up to 512, and
    512 more for a fused slice whose bytes are not a multiple of 512 (its shift varies)."""
    return round_up(nbytes, ALIGN) + (ALIGN if fused and nbytes % ALIGN else 0)


# Note: [Experts as units]
# An expert is the unit of copying and caching: the same bytes of every one of its tensors
# ("members"). In the fused layout a member is one expert's slice of a fused parameter; in the
# list layout it is one tensor of one expert module. A cache slot holds one expert: each member
# in a region of its own, regions 512-aligned. Kernels may pick an algorithm by the alignment
# of their operands, so a member is placed where its address is congruent modulo 512 to the
# address it has in the resident model, whose tensors start at caching-allocator blocks: 0 for
# a tensor of a list expert, ``e * slice_bytes % 512`` for expert e's slice of a fused
# parameter (a region has 512 bytes to spare where that is not always 0). The computation
# then runs the resident model's kernels on the same bits (bitwise equal outputs).
# The host store keeps each tensor's bytes as the model had them ("pieces": a whole fused
# parameter, or one tensor of one list expert), so placeholders, state_dict and remove() read
# them in place; expert e's member m is one contiguous range of one piece, one copy each.


class LayoutKind(str, enum.Enum):
    FUSED = "fused"
    LIST = "list"


@dataclass(frozen=True)
class Member:
    """One tensor of an expert: its name in the expert, one expert's geometry, and where it
    lies in a cache slot."""

    name: str  # "gate_up_proj" (fused) or "w1.weight" (list)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # one expert's bytes
    region: int  # offset of its region in a slot (a multiple of ALIGN)


@dataclass(frozen=True, eq=False)
class Piece:
    """One tensor of the model whose bytes the host store keeps as they are."""

    tensor: torch.Tensor
    name: str  # qualified name in the model
    module: nn.Module  # the module holding it
    attr: str  # its name in ``module``
    host_offset: int  # in its layer's host buffer
    nbytes: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device  # where it was before streaming

    @staticmethod
    def of(t: torch.Tensor, name: str, module: nn.Module, attr: str, host_offset: int) -> Piece:
        return Piece(t, name, module, attr, host_offset, t.numel() * t.element_size(),
                     tuple(t.shape), tuple(t.stride()), t.dtype, t.device)  # fmt: skip


@dataclass(frozen=True, eq=False)
class ExpertLayer:
    """The experts of one block, and where their bytes lie."""

    name: str  # the experts' qualified name ("model.layers.0.mlp.experts")
    kind: LayoutKind
    container: nn.Module  # the fused experts module, or the ModuleList
    block: nn.Module  # the module around it, whose forward routes
    experts: int
    top_k: int | None
    members: tuple[Member, ...]
    pieces: tuple[Piece, ...]  # fused: one per member; list: expert-major, members inside
    host_bytes: int
    slot_bytes: int
    router: nn.Module | None = None  # list: the router whose output predicts the routing
    # fused: the per-expert loop skips the index ``experts`` (transformers 5.24's mask has a
    # padding class; 5.17's one_hot fails on it): Note: [Routed outside a layer] in _outside.py
    sentinel: bool = False

    @property
    def expert_bytes(self) -> int:
        """Bytes copied for one expert (its members' exact sizes)."""
        return sum(m.nbytes for m in self.members)

    def source(self, expert: int, m: int) -> tuple[int, int]:
        """Where expert ``expert``'s member ``m`` is: (piece index, byte offset in the piece)."""
        if self.kind is LayoutKind.FUSED:
            return m, expert * self.members[m].nbytes
        return expert * len(self.members) + m, 0

    def shift(self, expert: int, m: int) -> int:
        """The member's offset in its slot region (Note: [Experts as units])."""
        if self.kind is LayoutKind.FUSED:
            return expert * self.members[m].nbytes % ALIGN
        return 0

    def experts_of_piece(self, piece: int, lo: int, hi: int) -> range:
        """The experts whose bytes lie in bytes [lo, hi) of ``piece``."""
        if self.kind is LayoutKind.LIST:
            e = piece // len(self.members)
            return range(e, e + 1)
        n = self.members[piece].nbytes
        return range(lo // n, min(self.experts, (hi + n - 1) // n)) if hi > lo else range(0)


@dataclass(frozen=True, eq=False)
class ExpertLayout:
    """Every expert layer of a model and the tensors outside them (the dense parts)."""

    layers: tuple[ExpertLayer, ...]
    dense: tuple[tuple[str, torch.Tensor], ...]  # every other parameter and buffer, once

    @property
    def slot_bytes(self) -> int:
        return max(layer.slot_bytes for layer in self.layers)

    @property
    def top_k(self) -> int:
        """The most experts one token routes to in one block (1 where no router says)."""
        return max((layer.top_k or 1 for layer in self.layers), default=1)

    @property
    def total_experts(self) -> int:
        return sum(layer.experts for layer in self.layers)

    @property
    def host_bytes(self) -> int:
        return sum(layer.host_bytes for layer in self.layers)

    def least_cache_bytes(self) -> int:
        """One token's routed experts of one block (Note: [The expert cache])."""
        return min(self.top_k, self.total_experts) * self.slot_bytes

    def slots_for(self, cache_bytes: int) -> int:
        """The cache slots ``cache_bytes`` buy that its parts use: at most each part's layers'
        experts and one call's routed experts (a CUDA graph computes from ``top_k`` slots of
        each part, its stage: Note: [Routed experts in a CUDA graph]; only then does a graph
        hold every expert), at most `GROUP_LIMIT` a part (Note: [Parts of the cache]).
        ``parts`` of the answer uses every slot of it."""
        slots = min(cache_bytes // self.slot_bytes,
                    self.total_experts + len(self.layers) * self.top_k)  # fmt: skip
        while True:  # fewer slots may cut into fewer parts, of fewer stages: until it holds
            used = self.parts(slots)[-1].slots.stop
            if used == slots:
                return slots
            slots = used

    def parts(self, slots: int) -> tuple[Part, ...]:
        """At most ``slots`` cache slots cut into parts of at most `GROUP_LIMIT` slots (and at
        least ``top_k``), each serving a run of consecutive layers (Note: [Parts of the
        cache]). A part gets no more slots than its layers' experts and a stage; what no part
        can use is left out (the answer's last slot is the cache's)."""
        layers, k = self.layers, self.top_k
        most = max(GROUP_LIMIT, k)
        experts = [layer.experts for layer in layers]
        if slots <= most or len(layers) == 1:
            return (Part(range(len(layers)), range(min(slots, most, sum(experts) + k))),)
        top = min(len(layers), max(slots // k, 1))  # parts of one layer at most, a stage each
        count = min(-(-slots // most), top)
        # slots past every expert and the stages: more parts, down to a part per layer (Note:
        # [Parts of the cache]: a smaller window costs a graph call less), as many as keep each
        # run's experts and stage within a part (with unequal layers more parts may cut worse)
        for more in range(min(top, (slots - sum(experts)) // k), count, -1):
            if max(_run_experts(experts, _runs(experts, more))) + k <= most:
                count = more
                break
        while True:  # more parts while a run's experts overflow a part and slots are left
            runs = _runs(experts, count)
            run_experts = _run_experts(experts, runs)
            room = [min(most, n + k) - k for n in run_experts]
            extra = _fill(slots - count * k, run_experts, room)
            left = slots - count * k - sum(extra)
            if count == top or not left or max(run_experts) + k <= most:
                break
            count += 1
        out, at = [], 0
        for r, n in zip(runs, extra, strict=True):
            out.append(Part(r, range(at, at + k + n)))
            at += k + n
        return tuple(out)


# The most groups one grouped GEMM takes (torch 2.11's CUDA kernel checks ``group_count < 1024``:
# "Can't process more than 1024 groups"); Note: [Parts of the cache]
GROUP_LIMIT = 1023

# Note: [Parts of the cache]
# A CUDA graph computes transformers' grouped_mm experts in the cache slots they are in (Note:
# [Experts computed in their slots] in _graphed.py): one grouped GEMM over a window of slots,
# one slot a group, and torch's CUDA kernel takes at most 1023 groups (`GROUP_LIMIT`). So a
# cache of more slots is cut into *parts* of at most 1023 slots, each serving a run of
# consecutive layers: an expert is cached only in its layer's part (the host's map and the
# device tables alike), and in a graph call each part's last ``top_k`` slots are its stage.
# Every cached expert of a layer is then in its window, and a hit computes where it is with no
# copy. Invariants:
# - Parts are consecutive slots, in layer order, and cover every slot the cache allocates
#   (never more than the budget buys); a layer belongs to exactly one part; each part holds
#   ``top_k`` slots at least (its stage).
# - Layers go to parts as runs of about equal expert counts: as few parts as the slots need
#   (each costs a stage), more while a run's experts and stage overflow 1023 slots. A part's
#   slots past its stage are shared as its layers' experts are, none past what they can use
#   (the rest goes to the others). A cache of every expert gives each part its experts and its
#   stage: at least 7 parts at the Qwen3-30B-A3B shape (6200 slots), 14 at Qwen3-235B-A22B's,
#   20 at DeepSeek-V3's. A layer of more than ``1023 - top_k`` experts (none known) cannot be
#   cached whole, eagerly either.
# - A cache of at most 1023 slots is one part: the cache of every earlier session, where every
#   layer's experts compete for every slot (Note: [The expert cache]).
# - Slots past every expert and the stages of the fewest parts go to more parts (each of its
#   layers' experts and a stage), down to a part per layer (`slots_for` caps there): a graph
#   call's two grouped GEMMs and its routing kernel take a part's slots as groups and scan them,
#   and a part per layer is the resident call's groups and its stage. Measured (H200, torch
#   2.11, 2026-11-29, 24 layers at the Qwen3-30B-A3B shape, every expert cached, a replayed
#   step under the profiler): the grouped GEMMs took 1262 us a step over parts of 776-904 slots
#   against 1091 over a part per layer (the resident call's: 1086), the routing kernel 200 us
#   against 98; a step took 8.13 ms against 7.08 (the resident graph: 5.62, unprofiled, one
#   process). At 48 layers (`benchmarks/moe.py`, every expert cached in 6528 slots): 12.73 /
#   12.27 ms a step (uniform / Zipf) against the resident graph's 11.18, where 6200 slots in 7
#   parts took 12.95 / 12.79 against 11.04 on another lease. A cache of fewer slots keeps the
#   fewest parts: each part more costs ``top_k`` slots of experts.
# Each part is a cache of its own: under routing whose hot experts crowd into some layers, a
# part cannot lend its slots to another's (a per-layer-group cache, between a global and a
# per-layer one). The eager path keeps the parts too, so the map moves between host and device
# unchanged. Predicted by the planner's replay (`plan_experts` of the Qwen3-30B-A3B shape, 72
# synthetic decode steps, 24 of them warm-up, LRU, 2026-11-29), hit rates at 8 / 16 / 32 GiB
# in parts against one part: uniform 0.118 / 0.272 / 0.578 against 0.118 / 0.272 / 0.575, Zipf
# 0.390 / 0.609 / 0.836 against 0.390 / 0.607 / 0.835 (routed on the host; on the device
# within 0.002 of each other): the layers of these routings are alike, so no part lacks slots
# another has spare.


@dataclass(frozen=True)
class Part:
    """Consecutive cache slots serving consecutive layers (Note: [Parts of the cache])."""

    layers: range
    slots: range


def _runs(experts: list[int], count: int) -> list[range]:
    """``count`` runs of consecutive layers (each not empty) of about equal expert counts."""
    total, bounds, at = sum(experts), [0], 0
    cum = 0
    for j in range(1, count):
        while at < len(experts) - (count - j) and (cum + experts[at]) * count <= j * total:
            cum += experts[at]
            at += 1
        at = max(at, bounds[-1] + 1)
        cum = sum(experts[:at])
        bounds.append(at)
    bounds.append(len(experts))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _run_experts(experts: list[int], runs: list[range]) -> list[int]:
    """Each run's experts."""
    return [sum(experts[i] for i in r) for r in runs]


def _shares(n: int, weights: list[int]) -> list[int]:
    """``max(n, 0)`` cut as ``weights`` are (largest remainders first, then the first)."""
    n, total = max(n, 0), sum(weights) or 1
    base = [n * w // total for w in weights]
    rest = sorted(range(len(weights)), key=lambda i: (-(n * weights[i] % total), i))
    for i in rest[: n - sum(base)]:
        base[i] += 1
    return base


def _fill(n: int, weights: list[int], room: list[int]) -> list[int]:
    """``max(n, 0)`` cut as ``weights`` are, none past its ``room``: what a full one would get
    goes to the others, as their weights are (what none has room for is left)."""
    out = [0] * len(weights)
    n = max(n, 0)
    while n:
        open_ = [i for i in range(len(weights)) if out[i] < room[i]]
        if not open_:
            break
        given = 0
        for i, share in zip(open_, _shares(n, [weights[i] for i in open_]), strict=True):
            give = min(share, room[i] - out[i])
            out[i] += give
            given += give
        n -= given
    return out


# -- finding the experts ------------------------------------------------------------------------


class _Unknown(Exception):
    """Why a module that looks like experts is not a layout this engine knows."""


def find_experts(model: nn.Module) -> ExpertLayout:
    """The model's expert layers, in module order. Raises ValueError naming what was found
    when there are none, or when something that looks like experts has an unknown layout."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    found: list[tuple[str, nn.Module, LayoutKind]] = []
    unknown: list[str] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        try:
            kind = _kind(name, module)
        except _Unknown as e:
            unknown.append(f"{name or type(model).__name__}: {e}")
            continue
        if kind is not None:
            found.append((name, module, kind))
            inside.update(id(m) for m in module.modules())
    if unknown:
        raise ValueError(
            "found experts in a layout stream_experts does not know: " + "; ".join(unknown)
            + ". It knows fused experts with the eager forward of transformers' "
            "Qwen3MoeExperts (gate_up_proj (E, 2I, H), down_proj (E, H, I)) and a ModuleList "
            "named 'experts' of identical modules beside a router ('gate' or 'router')"
        )  # fmt: skip
    if not found:
        raise ValueError(
            f"found no mixture-of-experts layers in {type(model).__name__}: no fused experts "
            "module (gate_up_proj and down_proj with the experts on the leading dimension) "
            "and no ModuleList named 'experts' beside a router"
        )
    layers = tuple(_layer(model, names, name, module, kind) for name, module, kind in found)
    taken = {id(p.tensor) for layer in layers for p in layer.pieces}
    dense: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in taken:
            dense.setdefault(id(t), (name, t))
    _check_storages(layers, [t for _, t in dense.values()])
    return ExpertLayout(layers, tuple(dense.values()))


def _kind(name: str, module: nn.Module) -> LayoutKind | None:
    if isinstance(module, nn.ModuleList):
        if name.rsplit(".", 1)[-1] != "experts":
            return None
        return LayoutKind.LIST  # checked in full by _layer
    threed = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    fused_names = {"gate_up_proj", "down_proj"} <= set(module._parameters)
    if not fused_names and not (threed and type(module).__name__.endswith("Experts")):
        return None
    if not fused_names:
        raise _Unknown(
            f"{type(module).__name__} with 3-D parameters {threed} (not gate_up_proj and down_proj)"
        )
    if "forward" in module.__dict__:
        raise _Unknown(f"{type(module).__name__} whose forward was replaced on the instance")
    fn = type(module).forward
    original = getattr(fn, "__wrapped__", fn)
    code = getattr(original, "__code__", None)
    if not any(_same_code(code, ref) for ref in _reference_codes()):
        raise _Unknown(
            f"{type(module).__name__} whose eager forward is not the per-expert loop of "
            "Qwen3MoeExperts (biases, another activation or another order of operations)"
        )
    if original is not fn:
        check_grouped(module, name, setup=True)
    return LayoutKind.FUSED


KERNELS = ("grouped_mm", "batched_mm")  # transformers' implementations computed (moe/_grouped.py)
_known: set[Any] = set()  # code objects of transformers' forwards found to be known ones


def implementation(module: nn.Module, name: str | None = None) -> str:
    """The experts implementation a fused experts module (named ``name``) runs now: "eager"
    (the per-expert loop), "grouped_mm" (transformers' default) or "batched_mm" (what its
    generate() switches grouped_mm to for decoding on a GPU). Others raise."""
    fn = type(module).forward
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if getattr(fn, "__wrapped__", None) is None or impl in (None, "eager"):
        return "eager"
    if impl in KERNELS:
        return impl
    raise ValueError(
        f"the experts {name or type(module).__name__!r} run with experts_implementation="
        f"{impl!r}, whose kernels stream_experts does not compute: its outputs would not be "
        "bitwise the resident model's. stream_experts computes 'grouped_mm' (transformers' "
        "default), 'batched_mm' and 'eager': set model.set_experts_implementation("
        "'grouped_mm') (or load with it) before stream_experts, and compare with that"
    )


def check_grouped(module: nn.Module, name: str, setup: bool = False) -> str:
    """The module's implementation (`implementation`); refuse one whose ``grouped_mm`` or
    ``batched_mm`` forward is not what moe/_grouped.py computes (Note: [Grouped experts, one
    group at a time]): transformers' function another than the known ones (moe/_references.py),
    or options of its decorator other than Qwen3-MoE's (a bias, no gate, transposed weights, a
    norm after each expert, expert parallelism)."""
    impl = implementation(module, name)
    if impl == "eager":
        return impl
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    fn = ALL_EXPERTS_FUNCTIONS.get(impl, None)
    code = getattr(fn, "__code__", None)
    if code not in _known and any(_same_code(code, c) for c in known(impl)):
        _known.add(code)
    if code not in _known:
        raise ValueError(
            f"the experts {name!r} run with experts_implementation={impl!r}, and this "
            f"transformers' {impl}_experts_forward is not one stream_experts computes "
            "(transformers 5.17's or 5.24's). Set model.set_experts_implementation('eager') "
            "before stream_experts, and compare with that"
        )
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False,
             "has_post_expert_norm": False, "_is_expert_parallel": False}  # fmt: skip
    # transformers 5.17 sets neither has_post_expert_norm nor _is_expert_parallel
    other = {k: getattr(module, k, v) for k, v in flags.items() if getattr(module, k, v) != v}
    if other:
        what = ", ".join(f"{k}={v!r}" for k, v in other.items())
        raise (ValueError if setup else RuntimeError)(
            f"the {impl} experts {name!r} have {what}: stream_experts computes Qwen3-MoE's "
            f"experts only ({', '.join(f'{k}={v}' for k, v in flags.items())})"
        )
    return impl


def _layer(model: nn.Module, names: dict[int, str], name: str, module: nn.Module,
           kind: LayoutKind) -> ExpertLayer:  # fmt: skip
    parent_name = name.rsplit(".", 1)[0] if "." in name else ""
    block = model.get_submodule(parent_name)
    if kind is LayoutKind.FUSED:
        return _fused_layer(name, module, block)
    return _list_layer(name, module, block)


def _fused_layer(name: str, module: nn.Module, block: nn.Module) -> ExpertLayer:
    gu, down = module.gate_up_proj, module.down_proj
    e = gu.shape[0] if gu.dim() == 3 else -1
    ok = (
        gu.dim() == 3 and down.dim() == 3 and down.shape[0] == e and gu.shape[1] % 2 == 0
        and down.shape[1] == gu.shape[2] and down.shape[2] == gu.shape[1] // 2
        and getattr(module, "num_experts", None) == e
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"the fused experts {name!r} have gate_up_proj {tuple(gu.shape)} and down_proj "
            f"{tuple(down.shape)} for num_experts={getattr(module, 'num_experts', None)}: "
            "expected (E, 2I, H) and (E, H, I)"
        )
    top_k = _top_k(block, module)
    tensors = [("gate_up_proj", gu), ("down_proj", down)]
    members, region = [], 0
    for attr, t in tensors:
        _check_tensor(f"{name}.{attr}", t)
        n = t[0].numel() * t.element_size()
        members.append(Member(attr, tuple(t.shape[1:]), tuple(t.stride()[1:]), t.dtype, n, region))
        region += region_bytes(n, fused=True)
    pieces, off = [], 0
    for attr, t in tensors:
        pieces.append(Piece.of(t, f"{name}.{attr}", module, attr, off))
        off = round_up(off + pieces[-1].nbytes, HOST_ALIGN)
    fn = type(module).forward
    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    sentinel = _same_code(code, _reference_codes()[0])  # 5.24's loop, not 5.17's
    return ExpertLayer(name, LayoutKind.FUSED, module, block, e, top_k, tuple(members),
                       tuple(pieces), off, region, sentinel=sentinel)  # fmt: skip


def _list_layer(name: str, module: nn.Module, block: nn.Module) -> ExpertLayer:
    experts = list(module)
    if len(experts) < 2 or len({type(m) for m in experts}) != 1:
        kinds = sorted({type(m).__name__ for m in experts})
        raise ValueError(
            f"the ModuleList {name!r} holds {len(experts)} modules of types {kinds}: experts "
            "are two or more modules of one type"
        )
    router = _router(block, module, len(experts))
    if router is None:
        raise ValueError(
            f"the ModuleList {name!r} has no router beside it in {type(block).__name__} (a "
            f"child named like 'gate' or 'router' with a weight of {len(experts)} rows)"
        )
    signature = None
    per_expert: list[list[tuple[str, nn.Module, str, torch.Tensor]]] = []
    for i, expert in enumerate(experts):
        found = _tensors_of(expert)
        sig = [(q, tuple(t.shape), t.dtype) for q, _, _, t in found]
        if signature is None:
            signature = sig
        elif sig != signature:
            raise ValueError(
                f"the experts of {name!r} differ: expert {i} holds {sig}, expert 0 {signature}"
            )
        per_expert.append(found)
    if not signature:
        raise ValueError(f"the experts of {name!r} hold no tensors")
    members, region = [], 0
    for q, _, _, t in per_expert[0]:
        n = t.numel() * t.element_size()
        members.append(Member(q, tuple(t.shape), tuple(t.stride()), t.dtype, n, region))
        region += region_bytes(n, fused=False)
    pieces, off = [], 0
    for i, found in enumerate(per_expert):
        for q, m, tn, t in found:
            _check_tensor(f"{name}.{i}.{q}", t)
            pieces.append(Piece.of(t, f"{name}.{i}.{q}", m, tn, off))
            off = round_up(off + pieces[-1].nbytes, HOST_ALIGN)
    return ExpertLayer(name, LayoutKind.LIST, module, block, len(experts), _top_k(block, router),
                       tuple(members), tuple(pieces), off, region, router)  # fmt: skip


def shape_layout(experts: tuple[int, ...], top_k: int, member_bytes: tuple[int, ...],
                 fused: bool) -> ExpertLayout:  # fmt: skip
    """The layout of a model known by its shape alone: an expert layer of ``experts[i]``
    experts for each i, each expert ``member_bytes`` (its tensors' bytes). It has no modules
    and no tensors: only a dry runtime's bookkeeping reads it (the planner)."""
    members, region = [], 0
    for i, n in enumerate(member_bytes):
        members.append(Member(f"member{i}", (n,), (1,), torch.uint8, n, region))
        region += region_bytes(n, fused)
    kind = LayoutKind.FUSED if fused else LayoutKind.LIST
    layers = tuple(
        ExpertLayer(f"expert layer {li}", kind, None, None, e, top_k, tuple(members), (),  # type: ignore[arg-type]
                    e * sum(round_up(n, HOST_ALIGN) for n in member_bytes), region)
        for li, e in enumerate(experts)
    )  # fmt: skip
    return ExpertLayout(layers, ())


def _tensors_of(expert: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """(name in the expert, holding module, its name there, tensor) of every parameter and
    buffer."""
    out = []
    for mn, m in expert.named_modules():
        for tn, t in (*m._parameters.items(), *m._buffers.items()):
            if t is not None:
                out.append((f"{mn}.{tn}" if mn else tn, m, tn, t))
    return out


def _router(block: nn.Module, experts: nn.Module, n: int) -> nn.Module | None:
    for child_name, child in block.named_children():
        if child is experts or not any(w in child_name for w in ("gate", "router")):
            continue
        for p in child.parameters():
            if p.dim() >= 1 and p.shape[0] == n:
                return child
    return None


def _top_k(*modules: Any) -> int | None:
    for m in modules:
        for attr in ("top_k", "num_experts_per_tok", "k"):
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        for child in ("gate", "router"):
            v = getattr(m, child, None)
            if isinstance(v, nn.Module) and v is not m:
                found = _top_k(v)
                if found is not None:
                    return found
        v = getattr(getattr(m, "config", None), "num_experts_per_tok", None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _check_tensor(name: str, t: torch.Tensor) -> None:
    if type(t) not in (torch.Tensor, nn.Parameter):
        raise ValueError(
            f"expert tensor {name!r} is a {type(t).__qualname__}: stream_experts streams plain "
            "tensors and parameters (keep this model resident, or use stream_weights)"
        )
    if t.is_meta:
        raise ValueError(f"expert tensor {name!r} is on the meta device and has no values")
    storage = t.untyped_storage()
    if not t.is_contiguous() or t.storage_offset() != 0 or storage.nbytes() != t.nbytes:
        raise ValueError(
            f"expert tensor {name!r} is a view or not contiguous: stream_experts needs each "
            "expert tensor to own its storage whole (call .contiguous() and assign it)"
        )


def _check_storages(layers: tuple[ExpertLayer, ...], dense: list[torch.Tensor]) -> None:
    """No two tensors of the model share an expert tensor's storage (tied experts)."""
    owner: dict[tuple[int, torch.device], str] = {}
    for layer in layers:
        for p in layer.pieces:
            key = (p.tensor.untyped_storage().data_ptr(), p.tensor.device)
            if key in owner and p.tensor.nbytes:
                raise ValueError(f"expert tensors {owner[key]!r} and {p.name!r} share a storage")
            owner[key] = p.name
    for t in dense:
        if t.is_meta or not t.nbytes:
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in owner:
            raise ValueError(
                f"expert tensor {owner[key]!r} shares its storage with a tensor outside the "
                "experts (tied weights): stream_experts cannot stream it"
            )


# -- the eager forward the fused layout computes ------------------------------------------------

# The eager forward of transformers' Qwen3MoeExperts (and of the classes generated from it:
# Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...). A fused experts module is known when its
# eager forward compiles to the same code: moe/_forward.py computes exactly these operations.
# The imports are part of it: Python 3.11 compiles a call on an imported module's attribute
# differently.
_REFERENCE = """
import torch
from torch import nn


def forward(
    self,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states
"""  # noqa: E501

# transformers 5.17 builds the mask without the padding class (``num_classes=num_experts``):
# the same operations on every expert a router can pick (an index of num_experts, which
# 5.24's mask skips, makes 5.17's one_hot raise, on a GPU with a device assert). The first
# reference is 5.24's: `ExpertLayer.sentinel`.
_REFERENCES = (
    _REFERENCE,
    _REFERENCE.replace("num_classes=self.num_experts + 1)", "num_classes=self.num_experts)"),
)
_reference: list[Any] = []


def _reference_codes() -> list[Any]:
    if not _reference:
        for source in _REFERENCES:
            module = compile(textwrap.dedent(source), "<reference>", "exec", dont_inherit=True)
            _reference.append(next(c for c in module.co_consts if hasattr(c, "co_code")))
    return _reference


def _same_code(a: Any, b: Any) -> bool:
    """Two code objects compiled from the same source text, wherever it was."""
    if a is None or b is None:
        return False
    if (a.co_code, a.co_names, a.co_varnames, a.co_argcount, a.co_kwonlyargcount) != (
        b.co_code, b.co_names, b.co_varnames, b.co_argcount, b.co_kwonlyargcount
    ):  # fmt: skip
        return False
    ca, cb = a.co_consts, b.co_consts
    if len(ca) != len(cb):
        return False
    for x, y in zip(ca, cb, strict=True):
        if hasattr(x, "co_code") or hasattr(y, "co_code"):
            if not _same_code(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def check_held(layout: ExpertLayout, li: int | None = None) -> None:
    """Refuse a fused experts module (layer ``li``, or every one) whose module no longer holds
    the tensors streamed for it (``module.down_proj = nn.Parameter(...)``): its forward
    computes from the host store of the tensors it replaced. A list expert's forward reads its
    module's own tensors, whatever they are."""
    for layer in layout.layers if li is None else (layout.layers[li],):
        if layer.kind is not LayoutKind.FUSED:
            continue
        for p in layer.pieces:
            if held(p.module, p.attr) is not p.tensor:
                raise RuntimeError(
                    f"{p.name!r} was replaced on its module ({type(p.module).__name__}."
                    f"{p.attr} = ...) while stream_experts streams it: the experts' forward "
                    "computes from the host store of the tensor it replaced. Write new values "
                    "in place instead (p.copy_(new) under torch.no_grad(), or load_state_dict), "
                    "or remove() the handle, assign, and stream again"
                )
