"""The fused experts' ``grouped_mm`` implementation (transformers' default) and ``batched_mm``
(what its generate() decodes with on a GPU) while they stream: transformers' forwards for them,
each routed expert's weights read from its bytes in the cache.

Note: [Grouped experts, one group at a time]
transformers 5 runs fused experts with ``experts_implementation="grouped_mm"`` unless told
otherwise: the rows of every (token, expert) pair sorted by expert, one grouped GEMM over all
E experts' weights for each projection (``F.grouped_mm``, offsets from ``histc``), the gate,
the routing weights, the rows put back in token order and summed over the top-k. Streamed, an
expert's weights are in a cache slot, not in one (E, ...) tensor, so each routed expert's group
is computed by its own grouped GEMM: a group of one, its rows the resident call's rows of that
expert, in the same order (the same ``torch.sort``), its weights the slot's, placed as the
resident slice is modulo 512 (Note: [Experts as units]); or experts in a run, stacked (Note:
[Routed experts stacked]). What makes it bitwise: a grouped GEMM
computes each group's rows from that group's weights alone, whatever the other groups hold, and
its per-row result does not change with the group count. Measured on an H200 (torch 2.11,
2026-11-28, 128 experts of (1536, 2048), top 8, 1 to 8192 tokens: every kernel shape the
resident call's heuristic picks, including its rows-per-group switch near 128): every expert's
rows bitwise equal to the resident call's in bf16, fp16 and fp32; the CPU kernel (one matmul
per group) is bitwise by construction. The gate and the routing weights are elementwise on rows,
the sum over the top-k runs on the same (tokens, k, H) tensor as the resident's. Routing to an
expert index outside [0, E) (the expert-parallel sentinel) is refused: transformers' kernel
leaves those rows unwritten.
``batched_mm`` multiplies each (token, expert) pair by its own copy of the expert's weights,
gathered by indexing the (E, ...) parameters. Streamed, the same gathered tensors are built by
copying each routed expert from its slot into its pairs' places (one copy per expert while it
holds its slot; the tensors are the call's activations, outside the cache, as the resident's
are), then the same batched products on the same shapes and values: bitwise. On a GPU,
transformers' generate() switches grouped_mm to batched_mm for the decode steps and back: the
implementation is read at every call.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from torchoffload.moe._layout import ALIGN, round_up
from torchoffload.moe._routing import NO_RECORDER
from torchoffload.moe._runtime import bind_offsets

__all__ = [
    "Chunked",
    "StagedLayers",
    "batched_forward",
    "grouped_forward",
    "grouped_linear",
    "kernel_forward",
]

# Note: [Whole layers for large calls]
# A call of many tokens routes to most of a layer's experts (a prefill of 2048 tokens at top 8
# of 128 routes to all of them), and one grouped GEMM per routed expert costs the host more
# than the expert's copy takes (H200: 1.19-1.55x the link time for a 2048-token prefill of the
# 30B shape; 1.8x at a 32 GiB cache holding about a third of the experts). Where the cache's
# storage holds a layer's experts in the resident layout (each fused parameter contiguous,
# 512-aligned), a grouped_mm call of at least ``STAGE_ROWS`` rows (token, expert pairs) per
# expert assembles its whole layer in a region of that storage and runs transformers' own
# grouped_mm forward on it: the resident call on the same bytes, bitwise. Each run of experts
# not cached outside the region is copied from the host store in one copy on the link's
# stream: it carries the layer's missing experts only. Ordering (Note: [Routed experts and the
# copy stream]): that copy waits on the "done" events of every cache slot the region overlaps
# (the last readers of those bytes: a cached expert's compute, or the region's previous staged
# call), whose experts are forgotten first. An expert cached outside the region is copied from
# its slot on the compute stream (on the link's stream these device copies ran at about
# 480 GB/s in series with the host's: a prefill at a 32 GiB cache holding half of each layer
# took 1.22x its link time, 1.03x with them here; H200), after that slot's "ready" event, the
# region's readers on other streams and any copy into the region that no compute waited on (an
# unused copy, or a refused call's); an event recorded after these device copies is each
# source slot's "done", the compute's each region slot's: a later copy into one waits for it.
# Two regions where the storage holds two layers: layer l+1's copy runs while layer l
# computes (where it holds less, the layer is staged in chunks: Note: [Layers in chunks]).
# One host read per call, after its copy is queued: the expert indices' bounds and which
# experts were routed (counted as hits where they came from a slot, else as misses; the
# rest of the layer copied over the link counts as ``staged``; routed cached experts are used
# for the cache's policy). Measured on an H200 at the 30B shape, prefill of 2048 tokens, a
# 16 GiB cache: the link busy 1062.5 of the GPU's 1071.7 ms (copies back to back), 1.02x the
# link time in all; 1.03-1.10x at 8, 16 and 32 GiB (benchmarks/README.md).
STAGE_ROWS = 2


def outside(name: str, n: int, impl: str) -> ValueError:
    """The refusal of a call routed to an expert index outside [0, ``n``)."""
    what = ("leaves those rows unwritten, so there is no resident result to match"
            if impl == "grouped_mm" else "clamps or masks those, so stream_experts does not "
            "serve them")  # fmt: skip
    return ValueError(
        f"{name!r} was routed to an expert index outside [0, {n}): transformers' {impl} "
        f"{what}. Route to experts of the layer only"
    )


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                   module: Any) -> torch.Tensor:  # fmt: skip
    """transformers' ``_grouped_linear`` of ``rows`` with ``weight``: one expert's (a member
    view in a slot) as a group of one, or a chunk's experts (a member's tensor over a region,
    their leading dimension); ``offs``: the groups' cumulative row counts, int32 on the
    device."""
    from transformers.integrations.moe import _grouped_linear

    if rows.device.type == "cpu" and rows.data_ptr() % 16:  # torch <= 2.10's CPU kernel
        rows = rows.clone()  # reads aligned rows only (transformers falls back otherwise)
    if weight.dim() == 2:
        weight = weight.unsqueeze(0)
    return _grouped_linear(rows, weight, offs, is_transposed=module.is_transposed)


def grouped_forward(rt: Any, li: int, module: Any, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``grouped_mm_experts_forward`` on the experts in the cache (Note: [Grouped experts, one
    group at a time]): its operations in its order, one host read of the group sizes. A large
    call stages its layer whole (Note: [Whole layers for large calls]) or in chunks (Note:
    [Layers in chunks]) where the cache's storage holds them."""
    layer = rt.layout.layers[li]
    n = layer.experts
    device = hidden_states.device
    with rt._lock:
        rt.begin(li, hidden_states.shape[0])
        try:
            if rt.staged is None:
                rt.staged = StagedLayers(rt)
            chunked = None
            if rt.staged.serves(rt, li, top_k_index.numel()):
                if rt.staged.chunk[li] == n:
                    out = rt.staged.forward(rt, li, module, (hidden_states, top_k_index,
                                                             top_k_weights))  # fmt: skip
                    if out is not None:
                        return out
                else:
                    chunked = Chunked(rt.staged, rt, li)
                    if not chunked.open():  # a slot of a region is pinned: expert by expert
                        chunked = None
            num_top_k = top_k_index.size(-1)
            num_tokens = hidden_states.size(0)
            hidden_dim = hidden_states.size(-1)
            try:
                sample_weights = top_k_weights.reshape(-1)
                expert_ids = top_k_index.reshape(-1)
                expert_ids_g, perm = torch.sort(expert_ids)
                selected = hidden_states[perm // num_top_k]
                sample_weights_g = sample_weights[perm]
                histc_input = (expert_ids_g.float() if device.type in ("cpu", "mps")
                               else expert_ids_g.int())  # fmt: skip
                tokens_per_expert = torch.histc(histc_input, bins=n, min=0, max=n - 1)
                sizes = tokens_per_expert.to(torch.int32)
                counts = sizes.tolist()  # the block's one host read
                if sum(counts) != expert_ids.numel():
                    raise outside(layer.name, n, "grouped_mm")
            except BaseException:
                if chunked is not None:  # its copies, used by no compute
                    chunked.abandon()
                raise
            routed = [e for e, c in enumerate(counts) if c]
            if chunked is not None:
                outs = chunked.compute(module, selected, sizes, counts, routed)
            else:
                rt.route(li, routed)
                outs = routed_groups(rt, li, module, selected, sizes, counts, routed)
            if len(outs) == 1:  # one run (a decode step's): no copy
                proj_out = outs[0]
            elif outs:
                proj_out = torch.cat(outs)
            else:
                proj_out = selected.new_empty((0, hidden_dim), dtype=layer.members[1].dtype)
            weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
            inv_perm = torch.empty_like(perm)
            inv_perm[perm] = torch.arange(perm.size(0), device=device)
            weighted_out = weighted_out[inv_perm]
            final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        finally:
            rt.end(li)
    return final_hidden_states.to(hidden_states.dtype)


# Note: [Routed experts stacked]
# Computing each routed expert as its own group costs the host three operations per expert (two
# grouped GEMMs and the gate: 24 in a decode step's block at top 8, where the resident call makes
# 3), and an eager decode step is host-bound. Where every member's slice is a multiple of 512
# bytes, a routed expert and those after it already pinned in their slots by the block's copies
# are taken as a run of up to ``top_k``: each member of the run stacked into one tensor of its own
# (``torch.stack``: the slices contiguous with the resident parameter's strides, each at a
# multiple of 512 bytes from a 512-aligned base, as the resident slices are), then one grouped
# GEMM per projection over the run, its offsets the cumulative sum of the run's row counts read on
# the host (one small host-to-device copy). Bitwise for the reason of
# Note: [Grouped experts, one group at a time]: each group's rows are computed from that group's
# weights alone, as with the chunks of Note: [Layers in chunks], which are such tensors. Ordering:
# a run's experts are entered (their copies waited for) before the stack and exited right after
# it, after one event recorded for them all (`ExpertRuntime.exit_all`), so each slot's "done"
# event follows its last reader, the stack, and the slot may take the next copy while the GEMMs
# run; an expert computed alone reads its slot and is exited after its GEMMs. The stacked tensors
# are the call's activations, outside the cache: at most ``top_k`` experts' bytes (what
# batched_mm's resident gather allocates for one token). A run is one expert where a member's
# slice is not a multiple of 512 (a stacked expert would sit at another address modulo 512 than
# its resident slice) or where the next routed expert has no slot yet.


def stacked(views: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each member of a run of experts (``views``: per expert, its members in its slot) in one
    tensor: the experts on the leading dimension, in order (Note: [Routed experts stacked])."""
    return [torch.stack([v[m] for v in views]) for m in range(len(views[0]))]


def routed_groups(rt: Any, li: int, module: Any, selected: torch.Tensor, sizes: torch.Tensor,
                  counts: list[int], routed: list[int]) -> list[torch.Tensor]:  # fmt: skip
    """The routed experts' outputs for their rows of ``selected`` (sorted by expert; ``sizes``
    and ``counts``: rows per expert of the layer, on the device and the host), in runs stacked
    where they can be (Note: [Routed experts stacked])."""
    layer = rt.layout.layers[li]
    most = rt.layout.top_k if all(m.nbytes % ALIGN == 0 for m in layer.members) else 1
    b = rt.blocks[li]
    stream = rt.engine.current_stream()  # this call's compute stream, read now
    outs, start, i = [], 0, 0
    while i < len(routed):
        j = i + 1  # the run: routed[i] and the experts after it already in their slots
        while j < len(routed) and j - i < most and routed[j] in b.acquired:
            j += 1
        run = routed[i:j]
        views = [rt.views(li, e, rt.enter(li, e, stream)) for e in run]
        if len(run) == 1:
            weights, off = views[0], sizes[run[0] : run[0] + 1]
        else:  # the stack is the slots' last reader: they are free for other copies after it
            weights = stacked(views)
            rt.exit_all(li, run, stream)
            off = run_offsets([counts[e] for e in run], sizes.device)
        rows = sum(counts[e] for e in run)
        proj = grouped_linear(selected[start : start + rows], weights[0], off, module)
        proj = module._apply_gate(proj)
        outs.append(grouped_linear(proj, weights[1], off, module))
        if len(run) == 1:
            rt.exit(li, run[0], stream)
        start += rows
        i = j
    return outs


def run_offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """A run's grouped GEMM offsets (the cumulative row counts, int32 on ``device``) from its
    counts read on the host: one small copy, where the run's entries of the device histogram
    took an indexing operation per expert, a stack and a sum."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32).to(
        device, non_blocking=True
    )


def batched_forward(rt: Any, li: int, module: Any, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``batched_mm_experts_forward`` on the experts in the cache: the (token, expert) pairs'
    weights gathered as the resident indexing gathers them (tensors of the same shape and
    values, allocated outside the cache as the resident's are), each routed expert copied into
    its pairs' places while it holds its slot, then the batched products and the sum."""
    from transformers.integrations.moe import _batched_linear

    layer = rt.layout.layers[li]
    n = layer.experts
    device = hidden_states.device
    with rt._lock:
        rt.begin(li, hidden_states.shape[0])
        try:
            num_top_k = top_k_index.size(-1)
            num_tokens = hidden_states.size(0)
            hidden_dim = hidden_states.size(-1)
            selected_hidden_states = hidden_states.repeat_interleave(num_top_k, dim=0)
            sample_weights = top_k_weights.reshape(-1)
            ids = top_k_index.reshape(-1).tolist()  # the block's one host read
            if any(not 0 <= e < n for e in ids):
                raise outside(layer.name, n, "batched_mm")
            places: dict[int, list[int]] = {}
            for j, e in enumerate(ids):
                places.setdefault(e, []).append(j)
            routed = sorted(places)
            order = [j for e in routed for j in places[e]]
            at = torch.tensor(order, dtype=torch.int64).to(device, non_blocking=True)
            gathered = [torch.empty((len(ids), *m.size), dtype=m.dtype, device=device)
                        for m in layer.members]  # fmt: skip
            rt.route(li, routed)
            stream = rt.engine.current_stream()  # this call's compute stream, read now
            start = 0
            for e in routed:
                views = rt.views(li, e, rt.enter(li, e, stream))
                count = len(places[e])
                for into, view in zip(gathered, views, strict=True):
                    into.index_copy_(0, at[start : start + count],
                                     view.unsqueeze(0).expand(count, *view.shape))  # fmt: skip
                start += count
                rt.exit(li, e, stream)
            proj_out = _batched_linear(selected_hidden_states, gathered[0],
                                       is_transposed=module.is_transposed)  # fmt: skip
            proj_out = module._apply_gate(proj_out)
            proj_out = _batched_linear(proj_out, gathered[1], is_transposed=module.is_transposed)
            del gathered
            weighted_out = proj_out * sample_weights.unsqueeze(-1)
            final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        finally:
            rt.end(li)
    return final_hidden_states.to(hidden_states.dtype)


def kernel_forward(impl: str, *args: Any) -> torch.Tensor:
    """`grouped_forward` or `batched_forward`, by transformers' implementation name."""
    return (grouped_forward if impl == "grouped_mm" else batched_forward)(*args)


class _Staged:
    """A fused experts module seen with its expert tensors in a staged region."""

    def __init__(self, module: Any, tensors: list[torch.Tensor]):
        self._module = module
        self.gate_up_proj, self.down_proj = tensors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def chunk_bytes(layer: Any, count: int) -> list[int]:
    """The bytes each member of ``count`` consecutive experts of ``layer`` takes in a region:
    their slices contiguous as in the resident parameter, 512-aligned, and 512 more where a
    chunk's first expert may start off a 512 boundary (Note: [Experts as units])."""
    return [round_up(count * m.nbytes, ALIGN) + (ALIGN if count < layer.experts and
            m.nbytes % ALIGN else 0) for m in layer.members]  # fmt: skip


def _most(layer: Any, room: int) -> int:
    """The most consecutive experts of ``layer`` a region of ``room`` bytes holds."""
    count = layer.experts
    while count and sum(chunk_bytes(layer, count)) > room:
        count -= 1
    return count


def _balanced(n: int, most: int) -> int:
    """Chunks of ``n`` experts, ``most`` at most each: as few as that allows, of sizes as
    equal as they can be (127 and 1 would leave the last chunk's copy nothing to overlap)."""
    if not most:
        return 0
    return -(-n // -(-n // most))


class StagedLayers:
    """The cache's storage as two regions, each of a whole layer's experts (Note: [Whole layers
    for large calls]) or, where the storage holds less than two layers, of a chunk of a
    layer's consecutive experts (Note: [Layers in chunks])."""

    def __init__(self, rt: Any):
        layers = rt.layout.layers
        total = len(rt.cache.slots) * rt.cache.slot_bytes  # the storage (a dry runtime's too)
        sb = rt.cache.slot_bytes
        if 2 * max(sum(chunk_bytes(layer, layer.experts)) for layer in layers) <= total:
            self.chunk = [layer.experts for layer in layers]
        else:  # regions of whole slots (Note: [Layers in chunks]), chunks of equal sizes
            room = total // 2 // sb * sb
            self.chunk = [_balanced(layer.experts, _most(layer, room)) for layer in layers]
        self.sizes = [chunk_bytes(layer, c) for layer, c in zip(layers, self.chunk, strict=True)]
        self.region = max(sum(s) for s in self.sizes)
        if any(c < layer.experts for layer, c in zip(layers, self.chunk, strict=True)):
            self.region = round_up(self.region, sb)
        self.regions = 2 if self.region else 0
        self.next = 0

    def serves(self, rt: Any, li: int, rows: int) -> bool:
        """Whether a call of ``rows`` (token, expert) rows stages layer ``li``: enough rows
        and a region that holds one of its experts at least."""
        layer = rt.layout.layers[li]
        return (self.chunk[li] > 0 and rows >= STAGE_ROWS * layer.experts
                and rt.recorder is NO_RECORDER and rt.store is not None)  # fmt: skip

    def slots_of(self, rt: Any, j: int) -> list[Any]:
        """The cache slots region ``j`` overlaps."""
        start, sb = j * self.region, rt.cache.slot_bytes
        return [s for s in rt.cache.slots if s.offset < start + self.region
                and s.offset + sb > start]  # fmt: skip

    def assemble(self, rt: Any, li: int, start: int, first: int, count: int,
                 held: dict) -> tuple[list, list, list]:  # fmt: skip
        """Experts ``first`` to ``first + count - 1`` of layer ``li`` in the region at byte
        ``start``: the (destination, source) pairs from the host store (one per run of
        experts not in ``held``, expert -> its slot), those from their slots (one per expert
        in ``held``), and each member's tensor of them there."""
        layer, cache = rt.layout.layers[li], rt.cache
        pairs, near, tensors, off = [], [], [], start
        for m, member in enumerate(layer.members):
            at = off + layer.shift(first, m)  # the resident slice's place modulo 512
            far, close = _member_pairs(rt, li, m, at, held, range(first, first + count))
            pairs += far
            near += close
            t = torch.empty(0, dtype=member.dtype, device=rt.device)
            size, item = (count, *member.size), t.element_size()
            stride = (member.nbytes // item, *member.stride)
            tensors.append(t.set_(cache.storage, at // item, size, stride))
            off += self.sizes[li][m]
        return pairs, near, tensors

    def forward(self, rt: Any, li: int, module: Any, args: tuple) -> torch.Tensor | None:
        """transformers' grouped_mm forward on layer ``li`` assembled in the next region;
        None (nothing queued) where a slot of the region is pinned."""
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        cache, layer, n = rt.cache, rt.layout.layers[li], rt.layout.layers[li].experts
        slots = self.slots_of(rt, self.next)
        if any(s.pins for s in slots):
            return None
        stream = rt.engine.current_stream()
        after, others = claim(rt, slots)
        # the layer's experts cached outside the region are copied from their slots on the
        # compute stream, after the host read (the link's stream carries the others only)
        held = {e: s for e in range(n) if (s := cache.lookup((li, e))) is not None}
        pairs, near, tensors = self.assemble(rt, li, self.next * self.region, 0, n, held)
        ready = rt.engine.load(pairs, after)
        region_copy(slots, ready)
        self.next = (self.next + 1) % self.regions
        c, copied = rt.counters[li], n - len(held)
        c.loads += copied
        c.h2d_bytes += copied * layer.expert_bytes
        try:
            ids = args[1].reshape(-1)
            hist = torch.histc(ids.float() if ids.device.type in ("cpu", "mps") else ids.int(),
                               bins=n, min=0, max=n - 1)  # fmt: skip
            # one host read, before the compute stream waits for this copy (the router's
            # choice: it waits for the previous layer's compute, while this copy runs): the
            # index bounds, then the routed experts, for the counts and the policy
            low, high, *counts = torch.cat([torch.stack(torch.aminmax(ids)),
                                            hist.long()]).tolist()  # fmt: skip
            if low < 0 or high >= n:
                raise outside(layer.name, n, "grouped_mm")
        except BaseException:
            c.staged += copied  # copied, used by no call
            raise
        count_routed(rt, li, [e for e, k in enumerate(counts) if k], held, copied)
        sources = [s for s in held.values() if s.ready is not None and stream not in s.waited]
        for event in others + [s.ready for s in sources]:  # and the source slots' copies
            rt.engine.wait(event)
        for s in sources:
            s.waited.add(stream)
        try:
            copy_from_slots(rt, near, held.values())
            rt.engine.wait(ready)
            return ALL_EXPERTS_FUNCTIONS["grouped_mm"](_Staged(module, tensors), *args)
        finally:  # a failed call's copies and kernels wrote and read the region too
            computed(rt, slots)


# Note: [Layers in chunks]
# Where the cache's storage holds less than two layers' experts (the least cache holds
# ``top_k`` slots; a layer is 1.15 GB at the Qwen3-30B-A3B shape, 11 GB at DeepSeek-V3's), a
# large grouped_mm call stages its layer in chunks: each of the storage's two regions (whole
# slots: a slot across their border would make a layer's first copy wait on the last chunk's
# compute) holds ``C`` consecutive experts (at most what a half of the storage holds, the
# chunks of equal sizes, each member's slices contiguous as in the resident parameter, at its
# alignment modulo 512). Chunk i is copied into region i % 2 after chunk i - 2's compute read
# it; its rows (consecutive: the rows are sorted by expert) run through one grouped GEMM per
# projection, that chunk's experts as its groups.
# Bitwise: a grouped GEMM's per-row result does not change with the groups beside it (Note:
# [Grouped experts, one group at a time]); measured for chunks on an H200, torch 2.11
# (benchmarks/moe_grouped_chunks.py: 128 experts of (1536, 2048), top 8, 1 to 8192 tokens,
# chunks of 1 to 64 experts, bf16 and fp16): every row equal to the resident call's. The
# first two chunks' copies are queued before the call's one host read (as a whole layer's), the
# others after the compute of the chunk before in their region is queued: chunk i + 2's copy
# overlaps chunk i + 1's compute and the host's queuing. So every expert of the layer is
# copied, routed or not (a prefill routes to all of them); routed experts count as hits
# where they came from a slot outside the regions, else as misses, the rest as ``staged``. The
# host's cost is per chunk rather than per expert: the grouped GEMMs of 4 experts queue in
# 0.17 ms of host time on the H200 host, where their copy takes 0.68 ms at 55 GB/s, and those
# of one expert in 0.16 ms against its 0.17 ms copy (the per-expert path was host-bound:
# 1.6-1.8x the link time at the least cache). Ordering is Note: [Whole layers for large
# calls]'s, per chunk: the first copy into a region waits on the "done" events of the slots it
# overlaps (their experts forgotten first), a later one on the compute of the chunk before it
# there; the compute stream waits, before the first chunk, on the regions' readers on other
# streams and on any copy into them no compute waited on, and before each chunk on its copy
# and its source slots' copies. Each copy is also kept as its region slots' "region copy"
# event as it is queued, so a call that fails or is refused before computing leaves nothing
# unordered: the next staged call's copies from slots and a graph's push wait on it.


class Chunked:
    """One grouped_mm call of layer ``li`` staged chunk by chunk in the two regions (Note:
    [Layers in chunks]): `open` claims the regions and queues the first two copies, the
    caller reads the routing on the host, `compute` runs the chunks (or `abandon`)."""

    def __init__(self, staged: StagedLayers, rt: Any, li: int):
        self.staged, self.rt, self.li = staged, rt, li
        n, c = rt.layout.layers[li].experts, staged.chunk[li]
        self.bounds = [(a, min(c, n - a)) for a in range(0, n, c)]
        self.stream = rt.engine.current_stream()
        self.queued: list[tuple[Any, list, list]] = []
        self.done: list[Any] = [None, None]  # each region's last compute in this call
        self.counted = False  # the call's hits, misses and staged experts

    def open(self) -> bool:
        """Claim both regions and queue the first two chunks' copies; False (nothing queued)
        where a slot of either is pinned."""
        rt = self.rt
        self.slots = [self.staged.slots_of(rt, j) for j in (0, 1)]
        every = list({id(s): s for ss in self.slots for s in ss}.values())
        if any(s.pins for s in every):
            return False
        self.after = [[ev for s in ss for ev in s.done.values()] for ss in self.slots]
        self.first = claim(rt, every)[1]
        n = rt.layout.layers[self.li].experts
        self.held = {e: s for e in range(n) if (s := rt.cache.lookup((self.li, e))) is not None}
        self.copied = n - len(self.held)
        c = rt.counters[self.li]
        c.loads += self.copied
        c.h2d_bytes += self.copied * rt.layout.layers[self.li].expert_bytes
        try:
            for i in range(min(2, len(self.bounds))):
                self.queue(i)
        except BaseException:
            self.abandon()
            raise
        return True

    def queue(self, i: int) -> None:
        """Queue chunk ``i``'s copy from the host into region ``i % 2``."""
        j, (first, count) = i % 2, self.bounds[i]
        pairs, near, tensors = self.staged.assemble(self.rt, self.li, j * self.staged.region,
                                                    first, count, self.held)  # fmt: skip
        after = self.after[j] if i < 2 else [self.done[j]]
        ready = self.rt.engine.load(pairs, after)
        region_copy(self.slots[j], ready)  # whatever happens to this call
        self.queued.append((ready, near, tensors))

    def abandon(self) -> None:
        """The call ends before its compute (refused, or failed): its copied experts count as
        staged, used by no call."""
        if not self.counted:
            self.rt.counters[self.li].staged += self.copied
            self.counted = True

    def compute(self, module: Any, selected: torch.Tensor, sizes: torch.Tensor,
                counts: list[int], routed: list[int]) -> list[torch.Tensor]:  # fmt: skip
        """Each chunk's rows of ``selected`` (sorted by expert; ``sizes`` per expert, int32 on
        the device, ``counts`` the same on the host) through its experts, in order: the
        projections' outputs, a tensor per chunk with rows."""
        rt, stream = self.rt, self.stream
        count_routed(rt, self.li, routed, self.held, self.copied)
        self.counted = True
        for event in self.first:
            rt.engine.wait(event)
        outs, start = [], 0
        for i, (first, count) in enumerate(self.bounds):
            ready, near, tensors = self.queued[i]
            sources = [self.held[e] for e in range(first, first + count) if e in self.held]
            for s in sources:
                if s.ready is not None and stream not in s.waited:
                    rt.engine.wait(s.ready)
                    s.waited.add(stream)
            rows = sum(counts[first : first + count])
            try:
                copy_from_slots(rt, near, sources)
                rt.engine.wait(ready)
                if rows:
                    offs = torch.cumsum(sizes[first : first + count], 0, dtype=torch.int32)
                    x = selected[start : start + rows]
                    start += rows
                    proj = module._apply_gate(grouped_linear(x, tensors[0], offs, module))
                    outs.append(grouped_linear(proj, tensors[1], offs, module))
            finally:  # a failed call's copies and kernels wrote and read the region too
                self.done[i % 2] = computed(rt, self.slots[i % 2])
            if i + 2 < len(self.bounds):
                self.queue(i + 2)
        return outs


def claim(rt: Any, slots: list[Any]) -> tuple[list, list]:
    """Forget the experts cached in ``slots`` (a region's) for a staged call. Returns the events
    a copy into them waits on (every "done": their last readers) and those the compute stream
    waits on before it writes there itself (readers on other streams, and copies into them no
    compute waited on: a refused call's; forget() drops a cached expert's "ready")."""
    stream = rt.engine.current_stream()
    after = [ev for s in slots for ev in s.done.values()]
    others = [ev for s in slots for k, ev in s.done.items() if k != stream]
    others += [s.ready for s in slots if s.ready is not None and stream not in s.waited]
    for s in slots:
        if s.key is not None:
            rt.cache.forget(s.key)
    return after, others


def computed(rt: Any, slots: list[Any]) -> Any:
    """An event after the work queued on the compute stream so far, each of ``slots``' "done"
    there (a later copy into them waits for it); None on the CPU."""
    event = rt.engine.record()
    if event is not None:
        stream = rt.engine.current_stream()
        for s in slots:
            s.done[stream] = event
    return event


def count_routed(rt: Any, li: int, routed: list[int], held: dict, copied: int) -> None:
    """A staged call's counts: routed experts from a slot are hits (used, for the cache's
    policy), the other routed ones misses, the rest of the ``copied`` experts staged."""
    c = rt.counters[li]
    hits = [e for e in routed if e in held]
    c.hits += len(hits)
    c.misses += len(routed) - len(hits)
    c.staged += copied - (len(routed) - len(hits))
    for e in hits:
        rt.cache.use((li, e))


# a region slot's "done" key for the last copy into the region: a later device copy there (a
# staged call's copies from slots, a graph's stage) waits for it, whether or not a compute did
REGION_COPY = "region copy"


def region_copy(slots: list[Any], ready: Any) -> None:
    """A copy into the region of ``slots`` was queued: its "ready" event, under REGION_COPY."""
    if ready is not None:
        for s in slots:
            s.done[REGION_COPY] = ready


def copy_from_slots(rt: Any, near: list, sources: Any) -> None:
    """The device copies ``near`` on the compute stream, then an event: each source slot's
    "done" (a later copy into one waits for these reads)."""
    try:
        copy_near(near)
    finally:
        read = rt.engine.record()
        if read is not None:
            for s in sources:
                s.done[rt.engine.current_stream()] = read


def copy_near(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (destination, source) pair of device bytes on the current stream."""
    for dst, src in pairs:
        dst.copy_(src)


def _member_pairs(rt: Any, li: int, m: int, off: int, held: dict,
                  experts: range) -> tuple[list, list]:  # fmt: skip
    """The (destination, source) pairs that fill member ``m`` of layer ``li``'s ``experts``
    from byte ``off`` of the cache's storage: from the host store, one per run of experts not
    in ``held`` (expert -> its slot), and from their slots, one per expert in ``held``."""
    layer, data = rt.layout.layers[li], rt.cache.data
    nbytes, end, far, near, e = layer.members[m].nbytes, experts.stop, [], [], experts.start
    while e < end:
        dst = off + (e - experts.start) * nbytes
        slot = held.get(e)
        if slot is not None:
            src = bind_offsets(rt, li, e, slot)[m]
            near.append((data[dst : dst + nbytes], data[src : src + nbytes]))
            e += 1
            continue
        piece, first = layer.source(e, m)
        run = 1
        while e + run < end and e + run not in held and layer.source(e + run, m) == (
            piece, first + run * nbytes):  # fmt: skip
            run += 1
        far.append((data[dst : dst + run * nbytes],
                    rt.store.source(li, piece, first, run * nbytes)))  # fmt: skip
        e += run
    return far, near
