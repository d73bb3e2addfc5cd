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

__all__ = ["batched_forward", "grouped_forward", "grouped_linear", "kernel_forward"]


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                   module: Any) -> torch.Tensor:  # fmt: skip
    """transformers' ``_grouped_linear`` of one expert's ``rows`` with its ``weight`` (a member
    view in a slot), as a group of one; ``offs``: that group's row count, int32 on the device."""
    from transformers.integrations.moe import _grouped_linear

    if rows.data_ptr() % 16:  # the CPU kernel of torch <= 2.10 reads aligned rows only
        rows = rows.clone()
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
                raise ValueError(
                    f"{layer.name!r} was routed to an expert index outside [0, {n}): "
                    "transformers' grouped_mm leaves those rows unwritten, so there is no "
                    "resident result to match. Route to experts of the layer only"
                )
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
                raise ValueError(
                    f"{layer.name!r} was routed to an expert index outside [0, {n}): "
                    "transformers' batched_mm clamps or masks those, so stream_experts does "
                    "not serve them. Route to experts of the layer only"
                )
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
