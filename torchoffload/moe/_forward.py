"""The entry points that drive the expert runtime from a model's forward: the fused experts'
forward (installed on the experts module itself) and the hooks of a list of expert modules
(the block brackets a use, each expert module binds its tensors to its cache slot)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchoffload import _hosted
from torchoffload._calls import eager_call, hook_caller
from torchoffload._modules import held
from torchoffload.moe._graphed import graphed_forward
from torchoffload.moe._grouped import kernel_forward
from torchoffload.moe._host import check_host_implementation, host_forward
from torchoffload.moe._layout import ExpertLayer, LayoutKind, check_grouped, check_held
from torchoffload.moe._outside import check_loop, loop_mask
from torchoffload.moe._runtime import ExpertRuntime

__all__ = ["NO_COPY", "install"]

NO_COPY = _hosted.no_copy_message("stream_experts")


class _Entry:
    """An object the streamed model holds (a forward, a hook): copying or pickling the model
    raises with the cause and the fix. No __slots__: torch marks hooks with attributes."""

    def __init__(self, rt: ExpertRuntime, li: int):
        self.rt = rt
        self.li = li

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(NO_COPY)


# Note: [One host read per block call]
# The resident loop (transformers' fused experts) reads the routing on the host once per block
# and twice per routed expert (``torch.where(expert_mask[e])`` and the comparison with the
# expert count): each read waits for the device to finish all queued work, so the copies and
# kernels of the next expert are queued only once the previous one has run. The streamed
# forward reads it once per block call: ``expert_mask[:n].nonzero()`` gives every routed
# (expert, top-k position, token) in the order of the expert, then of ``torch.where`` on that
# expert's mask (row-major), so each expert's ``top_k_pos`` and ``token_idx`` are the values the
# resident loop computes, and every kernel after them gets the same inputs: bitwise. Only the
# ``nonzero`` waits for queued work; the copy of its expert column after it finds the device
# idle. With no read between experts, the host queues a block's experts while the device copies
# and computes. Serving a one-token eager call with no host read at all, as a graph call is
# (`graphed_forward`: routing and copies on the device), was measured slower run eagerly on an
# H200 (the Qwen3-30B-A3B shape, grouped_mm: 264-306 ms per token against 184-221 on this path,
# benchmarks/log/2026-11-28-moe-grouped-mm.md): its host work per block, the device tables'
# update and two copy launches per routed expert, costs more than the one read saves. Captured
# per layer and replayed it has no such cost: one-token calls take that path by default where
# a GPU can graph it (Note: [Block calls replayed as graphs] in _replayed.py); this path serves
# the rest (prefills, larger batches, layouts a graph cannot serve).


class FusedForward(_Entry):
    """The forward of a fused experts module while it streams: the operations of its eager
    forward, in its order, on each routed expert's bytes in the cache (Note: [Experts as
    units]), so the output is bitwise the resident module's. Runs eagerly under
    torch.compile (the routing is read on the host)."""

    def __init__(self, rt: ExpertRuntime, li: int, module: nn.Module):
        super().__init__(rt, li)
        self.module = weakref.ref(module)
        eager_call(type(self))

    def body(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        rt, li = self.rt, self.li
        module = self.module()
        n = rt.layout.layers[li].experts
        check_held(rt.layout, li)
        impl = check_grouped(module, rt.layout.layers[li].name)
        if rt.graphing:  # a captured call: Note: [Routed experts in a CUDA graph]
            return graphed_forward(rt, li, module, hidden_states, top_k_index, top_k_weights)
        graphs = rt.block_graphs  # Note: [Block calls replayed as graphs]
        if graphs is not None and graphs.serves(li, impl, hidden_states, top_k_index):
            out = graphs(li, impl, module, hidden_states, top_k_index, top_k_weights)
            if out is not None:  # None: a signature beyond the layer's graphs
                return out
        if impl != "eager":  # Note: [Grouped experts, one group at a time]
            if rt.host is not None:  # switched from eager since setup
                check_host_implementation(rt.layout.layers[li], setup=False)
            return kernel_forward(impl, rt, li, module, hidden_states, top_k_index,
                                  top_k_weights)  # fmt: skip
        if rt.host is not None and rt.host.serves(hidden_states, top_k_index):
            # a small call, misses on the host: Note: [Cold experts on the host]
            return host_forward(rt, li, module, hidden_states, top_k_index, top_k_weights)
        with rt._lock:
            rt.begin(li, hidden_states.shape[0])
            try:
                final_hidden_states = torch.zeros_like(hidden_states)
                with torch.no_grad():  # Note: [One host read per block call]
                    expert_mask = loop_mask(top_k_index, n)  # Note: [Routed outside a layer]
                    # rows (expert, top-k position, token), experts n and n + 1 last
                    found = expert_mask.nonzero()
                    places = found[:, 1:].t().contiguous()
                    routed, counts = torch.unique_consecutive(found[:, 0].cpu(),
                                                              return_counts=True)  # fmt: skip
                routed, counts = routed.tolist(), counts.tolist()
                last = routed[-1] if routed else None
                check_loop(rt.layout.layers[li], last == n, last == n + 1)
                if routed and routed[-1] == n:  # the expert-parallel sentinel: skipped
                    routed, counts = routed[:-1], counts[:-1]
                rt.route(li, routed)
                stream = rt.engine.current_stream()  # this call's compute stream, read now
                start = 0
                for e, count in zip(routed, counts, strict=True):
                    slot = rt.enter(li, e, stream)
                    gate_up_proj, down_proj = rt.views(li, e, slot)
                    top_k_pos, token_idx = places[:, start : start + count]
                    start += count
                    current_state = hidden_states[token_idx]
                    gate, up = F.linear(current_state, gate_up_proj).chunk(2, dim=-1)
                    current = module.act_fn(gate) * up
                    current = F.linear(current, down_proj)
                    current = current * top_k_weights[token_idx, top_k_pos, None]
                    final_hidden_states.index_add_(
                        0, token_idx, current.to(final_hidden_states.dtype)
                    )
                    rt.exit(li, e, stream)
            finally:
                rt.end(li)
        return final_hidden_states


class _BlockPre(_Entry):
    def __init__(self, rt: ExpertRuntime, li: int):
        super().__init__(rt, li)
        eager_call(type(self))

    def body(self, module: nn.Module, args: Any) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        rows = x.numel() // x.shape[-1] if x is not None and x.dim() and x.shape[-1] else 0
        with self.rt._lock:
            self.rt.begin(self.li, rows, hook_caller(__name__))


class _BlockPost(_BlockPre):
    def body(self, module: nn.Module, args: Any, output: Any) -> None:
        with self.rt._lock:
            self.rt.end(self.li)


class _RouterPost(_BlockPre):
    """After a list block's router: its top-k experts, read on the host, are routed ahead
    (their copies queued at once). A prediction: the block's own routing decides which experts
    run; one predicted and not run costs a copy (``stats().unused``), one run and not predicted
    is copied when it is called. Only for a router whose output is one tensor of scores with
    the experts on the last dimension."""

    def body(self, module: nn.Module, args: Any, output: Any) -> None:
        rt, li = self.rt, self.li
        layer = rt.layout.layers[li]
        n, k = layer.experts, layer.top_k
        if k is None or not isinstance(output, torch.Tensor) or output.dim() == 0:
            return
        if output.shape[-1] != n or output.numel() == 0 or output.is_complex():
            return
        with torch.no_grad():
            chosen = torch.topk(output.detach().reshape(-1, n), min(k, n), dim=-1).indices
            routed = torch.unique(chosen).tolist()  # sorted; one host sync
        with rt._lock:
            rt.predict(li, routed)


class Binding:
    """Expert ``e``'s tensors bound in place to its slot while it runs (plain tensors then),
    placeholders again after (See Note: [Placeholders never answer]). The runtime unbinds
    what an interrupted forward left bound (`ExpertRuntime.end`)."""

    def __init__(self, rt: ExpertRuntime, li: int, e: int, tensors: list[torch.Tensor]):
        self.rt = rt
        self.li = li
        self.e = e
        self.tensors = tensors
        self.versions: list[int] = []

    def bind(self) -> None:
        rt, li, e = self.rt, self.li, self.e
        layer = rt.layout.layers[li]
        slot = rt.enter(li, e)
        storage = rt.cache.storage
        offsets = rt.bind_offsets(li, e, slot)
        for t, m, off in zip(self.tensors, layer.members, offsets, strict=True):
            _hosted.bound(t)
            t.set_(storage, off // t.element_size(), m.size, m.stride)
        self.versions[:] = [t._version for t in self.tensors]
        rt.blocks[li].bound[e] = self

    def unbind(self) -> str | None:
        """Placeholders again; the name of a member written in place while bound, if any."""
        rt = self.rt
        rt.blocks[self.li].bound.pop(self.e, None)
        changed = None
        grad = torch.is_grad_enabled()
        with torch.no_grad() if grad else contextlib.nullcontext():
            for t, m, v in zip(self.tensors, rt.layout.layers[self.li].members, self.versions,
                               strict=True):  # fmt: skip
                if t._version != v and changed is None:
                    changed = m.name
                t.set_(rt.empty, 0, (0,), (1,))
                _hosted.unbound(t)
        return changed


class _ExpertPre(_Entry):
    def __init__(self, binding: Binding):
        super().__init__(binding.rt, binding.li)
        self.binding = binding
        eager_call(type(self))

    def body(self, module: nn.Module, args: Any) -> None:
        with self.rt._lock:
            self.binding.bind()


class _ExpertPost(_ExpertPre):
    def body(self, module: nn.Module, args: Any, output: Any) -> None:
        rt, li, e = self.rt, self.li, self.binding.e
        with rt._lock:
            changed = self.binding.unbind()
            rt.exit(li, e)
        if changed is not None:
            name = rt.layout.layers[li].name
            raise RuntimeError(
                f"expert tensor {name}.{e}.{changed} was modified in place during its "
                "forward; the change would be lost when the expert leaves the cache. Write "
                "expert weights outside the forward (they are written to the host store)"
            )


def install(rt: ExpertRuntime, model: nn.Module) -> list[Any]:
    """Drive ``rt`` from ``model``'s forward and serve ``state_dict`` from the host store.
    Returns objects whose ``remove()`` undoes each part."""
    undo: list[Any] = []
    try:
        for li, layer in enumerate(rt.layout.layers):
            if layer.kind is LayoutKind.FUSED:
                layer.container.forward = FusedForward(rt, li, layer.container)
                undo.append(_Unset(layer.container, "forward"))
            else:
                undo += _list_hooks(rt, li, layer)
            undo += _state_dict_hooks(rt, li, layer)
        undo += _assign_hooks(rt, model)
    except BaseException:
        for u in undo:
            u.remove()
        raise
    return undo


def _list_hooks(rt: ExpertRuntime, li: int, layer: ExpertLayer) -> list[Any]:
    hooks = [
        layer.block.register_forward_pre_hook(_BlockPre(rt, li)),
        layer.block.register_forward_hook(_BlockPost(rt, li), always_call=True),
    ]
    if layer.router is not None:
        hooks.append(layer.router.register_forward_hook(_RouterPost(rt, li)))
    per = len(layer.members)
    for e, module in enumerate(layer.container):
        binding = Binding(rt, li, e, [p.tensor for p in layer.pieces[e * per : (e + 1) * per]])
        hooks.append(module.register_forward_pre_hook(_ExpertPre(binding)))
        hooks.append(module.register_forward_hook(_ExpertPost(binding), always_call=True))
    return hooks


def _state_dict_hooks(rt: ExpertRuntime, li: int, layer: ExpertLayer) -> list[Any]:
    owned: dict[int, tuple[nn.Module, list[tuple[str, int]]]] = {}
    for pi, p in enumerate(layer.pieces):
        owned.setdefault(id(p.module), (p.module, []))[1].append((p.attr, pi))
    hooks = []
    for module, names in owned.values():
        hooks.append(module.register_state_dict_post_hook(_StateDict(rt, li, names)))
    return hooks


def _assign_hooks(rt: ExpertRuntime, model: nn.Module) -> list[Any]:
    """``load_state_dict(assign=True)`` refused where the state dict holds an expert key."""
    names = [p.name for layer in rt.layout.layers for p in layer.pieces]
    what = "streamed expert tensors"
    return _hosted.refuse_assign(
        model, names, "stream_experts", what, NO_COPY, live=lambda: not rt.removed
    )


class _StateDict(_Entry):
    """``state_dict()`` holds host copies of the expert tensors (their real values)."""

    def __init__(self, rt: ExpertRuntime, li: int, names: list[tuple[str, int]]):
        super().__init__(rt, li)
        self.names = names

    def __call__(self, module: nn.Module, state_dict: Any, prefix: str, meta: Any) -> None:
        with self.rt._lock:
            self.rt._check_live()
            self.rt._reap()
            pieces = self.rt.layout.layers[self.li].pieces
            for attr, pi in self.names:
                key = prefix + attr
                # a tensor assigned to the module since (module.w = ...) is its own value
                if key in state_dict and held(module, attr) is pieces[pi].tensor:
                    state_dict[key] = self.rt.store.host_value(self.li, pi)


class _Unset:
    """Removes an instance attribute set on a module (the fused experts' forward)."""

    def __init__(self, module: nn.Module, attr: str):
        self.module = weakref.ref(module)
        self.attr = attr

    def remove(self) -> None:
        m = self.module()
        if m is not None and isinstance(m.__dict__.get(self.attr), FusedForward):
            del m.__dict__[self.attr]
