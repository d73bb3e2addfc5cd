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
resident slice is modulo 512 (Note: [Experts as units]). What makes it bitwise: a grouped GEMM
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

from typing import Any

import torch

from torchoffload.moe._layout import ALIGN, round_up
from torchoffload.moe._routing import NO_RECORDER
from torchoffload.moe._runtime import bind_offsets

__all__ = ["WholeLayers", "batched_forward", "grouped_forward", "grouped_linear", "kernel_forward"]

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
# computes. One host read per call, after its copy is queued: the expert indices' bounds and
# which experts were routed (counted as hits where they came from a slot, else as misses; the
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
    """transformers' ``_grouped_linear`` of one expert's ``rows`` with its ``weight`` (a member
    view in a slot), as a group of one; ``offs``: that group's row count, int32 on the device."""
    from transformers.integrations.moe import _grouped_linear

    if rows.device.type == "cpu" and rows.data_ptr() % 16:  # torch <= 2.10's CPU kernel
        rows = rows.clone()  # reads aligned rows only (transformers falls back otherwise)
    return _grouped_linear(rows, weight.unsqueeze(0), offs, is_transposed=module.is_transposed)


def grouped_forward(rt: Any, li: int, module: Any, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``grouped_mm_experts_forward`` on the experts in the cache (Note: [Grouped experts, one
    group at a time]): its operations in its order, one host read of the group sizes."""
    layer = rt.layout.layers[li]
    n = layer.experts
    device = hidden_states.device
    with rt._lock:
        rt.begin(li, hidden_states.shape[0])
        try:
            if rt.whole is None:
                rt.whole = WholeLayers(rt)
            if rt.whole.serves(rt, li, top_k_index.numel()):  # Note: [Whole layers for large calls]
                out = rt.whole.forward(rt, li, module, (hidden_states, top_k_index,
                                                        top_k_weights))  # fmt: skip
                if out is not None:
                    return out
            num_top_k = top_k_index.size(-1)
            num_tokens = hidden_states.size(0)
            hidden_dim = hidden_states.size(-1)
            sample_weights = top_k_weights.reshape(-1)
            expert_ids = top_k_index.reshape(-1)
            expert_ids_g, perm = torch.sort(expert_ids)
            selected = hidden_states[perm // num_top_k]
            sample_weights_g = sample_weights[perm]
            histc_input = (expert_ids_g.float() if device.type in ("cpu", "mps")
                           else expert_ids_g.int())  # fmt: skip
            tokens_per_expert = torch.histc(histc_input, bins=n, min=0, max=n - 1)
            sizes = tokens_per_expert.to(torch.int32)
            counts = [int(c) for c in sizes.tolist()]  # the block's one host read
            if sum(counts) != expert_ids.numel():
                raise outside(layer.name, n, "grouped_mm")
            routed = [e for e, c in enumerate(counts) if c]
            rt.route(li, routed)
            outs, start = [], 0
            for e in routed:
                slot = rt.enter(li, e)
                gate_up_proj, down_proj = rt.views(li, e, slot)
                offs = sizes[e : e + 1]
                rows = selected[start : start + counts[e]]
                start += counts[e]
                proj = grouped_linear(rows, gate_up_proj, offs, module)
                proj = module._apply_gate(proj)
                outs.append(grouped_linear(proj, down_proj, offs, module))
                rt.exit(li, e)
            if outs:
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
            start = 0
            for e in routed:
                views = rt.views(li, e, rt.enter(li, e))
                count = len(places[e])
                for into, view in zip(gathered, views, strict=True):
                    into.index_copy_(0, at[start : start + count],
                                     view.unsqueeze(0).expand(count, *view.shape))  # fmt: skip
                start += count
                rt.exit(li, e)
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


class WholeLayers:
    """The cache's storage as one or two regions of a whole layer's experts (Note: [Whole
    layers for large calls])."""

    def __init__(self, rt: Any):
        layers = rt.layout.layers
        self.sizes = [[round_up(layer.experts * m.nbytes, ALIGN) for m in layer.members]
                      for layer in layers]  # fmt: skip
        self.region = max(sum(s) for s in self.sizes)
        total = 0 if rt.cache.data is None else rt.cache.data.numel()
        self.regions = min(2, total // self.region)
        self.next = 0

    def serves(self, rt: Any, li: int, rows: int) -> bool:
        """Whether a call of ``rows`` (token, expert) rows stages layer ``li``: enough rows
        and a region."""
        layer = rt.layout.layers[li]
        return (self.regions > 0 and rows >= STAGE_ROWS * layer.experts
                and rt.recorder is NO_RECORDER and rt.store is not None)  # fmt: skip

    def forward(self, rt: Any, li: int, module: Any, args: tuple) -> torch.Tensor | None:
        """transformers' grouped_mm forward on layer ``li`` assembled in the next region;
        None (nothing queued) where a slot of the region is pinned."""
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        cache, layer, n = rt.cache, rt.layout.layers[li], rt.layout.layers[li].experts
        start = self.next * self.region
        slots = [
            s
            for s in cache.slots
            if s.offset < start + self.region and s.offset + cache.slot_bytes > start
        ]
        if any(s.pins for s in slots):
            return None
        after = [event for s in slots for event in s.done.values()]
        stream = rt.engine.current_stream()
        # copies into the region's slots that no compute waited on (forget() drops them)
        written = [s.ready for s in slots if s.ready is not None and stream not in s.waited]
        for s in slots:
            if s.key is not None:
                cache.forget(s.key)
        # the layer's experts cached outside the region are copied from their slots on the
        # compute stream, after the host read (the link's stream carries the others only)
        held = {e: s for e in range(n) if (s := cache.lookup((li, e))) is not None}
        pairs, near, tensors, off = [], [], [], start
        for m, member in enumerate(layer.members):
            far, close = _member_pairs(rt, li, m, off, held)
            pairs += far
            near += close
            t = torch.empty(0, dtype=member.dtype, device=rt.device)
            size, item = (n, *member.size), t.element_size()
            stride = (member.nbytes // item, *member.stride)
            tensors.append(t.set_(cache.storage, off // item, size, stride))
            off += self.sizes[li][m]
        ready = rt.engine.load(pairs, after)
        self.next = (self.next + 1) % self.regions
        c, copied = rt.counters[li], n - len(held)
        c.loads += copied
        c.h2d_bytes += copied * layer.expert_bytes
        ids = args[1].reshape(-1)
        hist = torch.histc(ids.float() if ids.device.type in ("cpu", "mps") else ids.int(),
                           bins=n, min=0, max=n - 1)  # fmt: skip
        # one host read, before the compute stream waits for this copy (the router's choice:
        # it waits for the previous layer's compute, while this copy runs): the index bounds,
        # then the routed experts, for the counts and the policy
        low, high, *counts = torch.cat([torch.stack(torch.aminmax(ids)), hist.long()]).tolist()
        if low < 0 or high >= n:
            c.staged += copied  # copied, used by no call
            if ready is not None:  # a later device copy into the region waits for it
                for s in slots:
                    s.done[_REGION_COPY] = ready
            raise outside(layer.name, n, "grouped_mm")
        routed = [e for e, k in enumerate(counts) if k]
        hits = [e for e in routed if e in held]
        c.hits += len(hits)
        c.misses += len(routed) - len(hits)
        c.staged += copied - (len(routed) - len(hits))
        for e in hits:
            cache.use((li, e))
        sources = [s for s in held.values() if s.ready is not None and stream not in s.waited]
        # the region's readers on other streams and copies into it; the source slots' copies
        for event in (
            [ev for s in slots for k, ev in s.done.items() if k != stream]
            + written
            + [s.ready for s in sources]
        ):
            rt.engine.wait(event)
        for s in sources:
            s.waited.add(stream)
        try:
            copy_near(near)
        finally:  # a later copy into a source slot waits for these reads only
            read = rt.engine.record()
            if read is not None:
                for s in held.values():
                    s.done[stream] = read
        rt.engine.wait(ready)
        try:
            return ALL_EXPERTS_FUNCTIONS["grouped_mm"](_Staged(module, tensors), *args)
        finally:  # a failed call's kernels read the region too
            event = rt.engine.record()
            if event is not None:
                for s in slots:
                    s.done[stream] = event


_REGION_COPY = "region copy"  # a region slot's "done" key for a refused call's host copy


def copy_near(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (destination, source) pair of device bytes on the current stream."""
    for dst, src in pairs:
        dst.copy_(src)


def _member_pairs(rt: Any, li: int, m: int, off: int, held: dict) -> tuple[list, list]:
    """The (destination, source) pairs that fill member ``m`` of layer ``li``'s experts from
    byte ``off`` of the cache's storage: from the host store, one per run of experts not in
    ``held`` (expert -> its slot), and from their slots, one per expert in ``held``."""
    layer, data = rt.layout.layers[li], rt.cache.data
    nbytes, n, far, near, e = layer.members[m].nbytes, layer.experts, [], [], 0
    while e < n:
        dst = off + e * nbytes
        slot = held.get(e)
        if slot is not None:
            src = bind_offsets(rt, li, e, slot)[m]
            near.append((data[dst : dst + nbytes], data[src : src + nbytes]))
            e += 1
            continue
        piece, first = layer.source(e, m)
        run = 1
        while e + run < n and e + run not in held and layer.source(e + run, m) == (
            piece, first + run * nbytes):  # fmt: skip
            run += 1
        far.append((data[dst : dst + run * nbytes],
                    rt.store.source(li, piece, first, run * nbytes)))  # fmt: skip
        e += run
    return far, near
