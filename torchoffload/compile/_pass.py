"""The activation pass: offload saved activations inside a partitioned forward/backward pair.

AOTAutograd splits a training graph into a forward graph, whose outputs after the user's are
the tensors saved for backward, and a backward graph, whose first inputs are those tensors.
`offload_activations_pass` rewrites both (in place)::

    forward                                   backward
    a = producer(...)                         # in layer i + prefetch_layers (Note: [Where
    h = offload(a)        # right after it    y = reload(h, device)   #   reloads go])
    ... uses of a (and its views) ...         ...
    # end of layer i + defer_layers            wait(y)              # right before first use
    wait(h, keepalive=a)  # a's memory may go  v = view(y, ...)      # saved views, replayed
    return ..., h, ...    # h saved, not a     ... uses of y and v ...

Note: [Storages, not tensors]
The partitioner saves views freely (``view``/``permute`` of a layer norm's output next to the
output itself). Offloading each saved tensor on its own would copy shared bytes twice and free
nothing while another alias stays saved on the device. So saved tensors are grouped by the
storage they view (following view ops, which return an alias of their first argument, back to
the root), and a group is decided as one: its root is offloaded once, and in backward every
saved member is rebuilt by replaying its view ops on the reloaded root, which restores its
exact size, stride and offset. A group is not offloaded when its root is a graph input (a
parameter: no memory to gain), when any alias of it is a model output (it outlives the graph),
when the root is not contiguous, or when a view op takes symbolic arguments (dynamic shapes).

Note: [Layers in a compiled graph]
Layers are read from each node's ``nn_module_stack``: the first module path with a numeric
component (``layers.3``, ``h[3]``) names the layer; layers are numbered in forward order, and
nodes outside any (embeddings, head, loss) belong to none and are not offloaded. Backward nodes
carry no reliable module path, so the backward start of layer i is where the backward graph
first uses a tensor saved by layer i (the backward runs the layers in reverse).

Note: [Where reloads go]
The reloads of layer i go into the backward of layer a = i + ``prefetch_layers``:
- When layer a has offloaded storages of its own, right after the node where layer a's
  backward has released half of the bytes of its saved storages (in a transformer block:
  the MLP's two 4h-wide activations, once the second matmul's gradients and the GELU's are
  done). Before that the device would hold layer a's saved tensors, its first gradients and
  layer i's reloads at once. On the H200 (h2048, a memory trace) reloads at the very
  start of layer a peaked 0.33 GiB above eager offloading; after layer a's first release,
  0.08 GiB above; after half, the same (the peak had moved), at no cost in step time. The
  copy stream loses little: it is still bringing layer a's later tensors when the compute
  stream gets there, since reloads are issued in order of first use (layer a's first-needed
  tensors arrive first).
- Otherwise (layer a kept on the device, or no layer a) at the start of layer a's backward, or
  at the start of the backward graph: the copy stream is idle there.
Each reload's wait goes right before its first use; a reload never goes after that use.
Issuing at the start of layer a instead (as eager offloading does) was measured on the H200
with every storage offloaded: the same step time at hidden 4096 and 1024 (278.0 vs 278.4 ms,
149.5 vs 149.5), 0.25 and 0.06 GiB less saved.

Note: [Forward waits]
``wait(h, keepalive=a)`` goes after the last forward use of any alias of ``a`` and after the
last node of layer i + ``defer_layers``: the compute stream waits on the D2H only when it has
had that many layers of compute to hide it, and ``a``'s buffer is reused only after the wait
(``keepalive`` keeps it live in Inductor's memory plan; see Note: [Graph ops and the transfer
protocol]).
"""

from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

import torchoffload.compile._ops  # noqa: F401  (registers torch.ops.torchoffload.*)
from torchoffload._placement import ActivationOffloadConfig, BudgetPolicy, choose
from torchoffload._validate import check_int

__all__ = ["ActivationPassConfig", "OffloadDecision", "PassReport", "offload_activations_pass"]

_log = logging.getLogger(__name__)
_ops = torch.ops.torchoffload


# One config for eager and compiled activation offloading (Note: [Budget rules] in
# _placement.py); the old name stays for code written against it.
ActivationPassConfig = ActivationOffloadConfig


@dataclass(frozen=True)
class OffloadDecision:
    """The pass's decision about one saved storage."""

    root: str  # forward node that owns the storage
    members: tuple[str, ...]  # saved tensors viewing it (the root itself included if saved)
    layer: str | None
    nbytes: int
    offloaded: bool
    reason: str


@dataclass
class PassReport:
    """Every decision of one run of the pass, in forward order."""

    layers: list[str] = field(default_factory=list)
    decisions: list[OffloadDecision] = field(default_factory=list)

    @property
    def offloaded(self) -> list[OffloadDecision]:
        return [d for d in self.decisions if d.offloaded]

    @property
    def offloaded_bytes(self) -> int:
        return sum(d.nbytes for d in self.offloaded)

    @property
    def saved_bytes(self) -> int:
        return sum(d.nbytes for d in self.decisions)

    def __str__(self) -> str:
        lines = [
            f"activation pass: {len(self.offloaded)} of {len(self.decisions)} saved storages "
            f"offloaded, {self.offloaded_bytes / 2**20:.2f} of {self.saved_bytes / 2**20:.2f} MiB, "
            f"{len(self.layers)} layers"
        ]
        for d in self.decisions:
            mark = "offload" if d.offloaded else "keep   "
            lines.append(
                f"  {mark} {d.root:<24} {d.nbytes / 2**20:9.3f} MiB {d.layer or '-':<12} {d.reason}"
            )
        return "\n".join(lines)


# -- reading the graph --------------------------------------------------------------------------

_INDEX = re.compile(r"\.(\d+)(?=\.|$)|\[(\d+)\]")


def _layer_key(node: fx.Node) -> str | None:
    """Note: [Layers in a compiled graph]."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, *_ in stack.values():
        path = str(path)
        m = _INDEX.search(path)
        if m:
            key = path[: m.end()]
            key = re.sub(r"^L\['self'\]\.?", "", key)
            key = re.sub(r"\[(\d+)\]", r".\1", key)
            return key.replace("_orig_mod.", "")
    return None


def _alias_parent(node: fx.Node) -> fx.Node | None:
    """The node whose storage ``node`` views, or None when it owns its storage."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        parent = node.args[0]
        return _alias_parent(parent) if isinstance(parent, fx.Node) else None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        if returns and returns[0].alias_info is not None and isinstance(node.args[0], fx.Node):
            return node.args[0]
    return None


def _chain(node: fx.Node) -> list[fx.Node]:
    """``node``'s storage root first, then the view ops (and getitems) that lead to it."""
    chain = [node]
    while True:
        cur = chain[-1]
        if cur.op == "call_function" and cur.target is operator.getitem:
            split = cur.args[0]
            parent = _alias_parent(split) if isinstance(split, fx.Node) else None
            if parent is None:
                break
            chain += [split, parent]
        else:
            parent = _alias_parent(cur)
            if parent is None:
                break
            chain.append(parent)
    return chain[::-1]


def _tensor(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _nbytes(t: torch.Tensor) -> int | None:
    try:
        return int(t.numel()) * t.element_size()
    except Exception:  # symbolic sizes
        return None


def _must_offload(node: fx.Node) -> bool:
    policy = getattr(torch.utils.checkpoint, "CheckpointPolicy", None)
    must = getattr(policy, "MUST_CPU_OFFLOAD", None)
    return must is not None and (
        node.meta.get("recompute") is must or node.meta.get("torchoffload_must_offload", False)
    )


def _prefers_offload(node: fx.Node) -> bool:
    policy = getattr(torch.utils.checkpoint, "CheckpointPolicy", None)
    prefer = getattr(policy, "PREFER_CPU_OFFLOAD", None)
    return prefer is not None and node.meta.get("recompute") is prefer


@dataclass
class _Group:
    root: fx.Node
    members: list[fx.Node]  # saved outputs viewing root, in output order
    chains: dict[fx.Node, list[fx.Node]]
    layer: int | None = None
    nbytes: int = 0
    forced: bool = False
    preferred: bool = False
    reason: str = ""


def _groups(fw: fx.Graph, num_fwd_outputs: int) -> tuple[list[_Group], list[fx.Node]]:
    out = fw.find_nodes(op="output")[0]
    outputs = list(out.args[0])
    saved = [n for n in outputs[num_fwd_outputs:] if _tensor(n) is not None]
    by_root: dict[fx.Node, _Group] = {}
    for n in saved:
        chain = _chain(n)
        g = by_root.setdefault(chain[0], _Group(chain[0], [], {}))
        if n not in g.members:
            g.members.append(n)
            g.chains[n] = chain
    return list(by_root.values()), outputs


# -- the pass -----------------------------------------------------------------------------------


def offload_activations_pass(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    config: ActivationPassConfig | None = None,
    *,
    num_fwd_outputs: int,
) -> PassReport:
    """Offload the saved activations of a partitioned forward/backward pair, in place.

    ``fw_module`` and ``bw_module`` are what a partitioner returns (for instance
    `torch._functorch.partitioners.min_cut_rematerialization_partition`); ``num_fwd_outputs`` is
    the number of forward outputs that are the user's (the rest are saved for backward). The
    backward's saved-tensor inputs are matched to forward outputs by name, as the partitioner
    names them. Returns the report of every decision (also logged at debug level). See the
    module docstring and its Notes for what is chosen and where the ops go.
    """
    for name, gm in (("fw_module", fw_module), ("bw_module", bw_module)):
        if not isinstance(gm, fx.GraphModule):
            raise TypeError(f"{name} must be a torch.fx.GraphModule, got {type(gm).__name__}")
    check_int("num_fwd_outputs", num_fwd_outputs, minimum=0)
    config = config or ActivationOffloadConfig()
    if not isinstance(config, ActivationOffloadConfig):
        raise TypeError(
            f"config must be an ActivationOffloadConfig (ActivationPassConfig), got "
            f"{type(config).__name__}"
        )
    config.check_for_pass()
    decided, report = _decide(fw_module.graph, bw_module.graph, config, num_fwd_outputs)
    if decided.chosen:
        _rewrite(fw_module.graph, bw_module.graph, decided, config, num_fwd_outputs)
        for gm in (fw_module, bw_module):
            gm.graph.lint()
            gm.recompile()
    return report


@dataclass
class _Decided:
    """What the first phase decided, and the graph facts the rewrite places ops by."""

    groups: list[_Group]
    chosen: list[_Group]
    outputs: list[Any]  # the forward's outputs as the partitioner left them
    pos: dict[fx.Node, int]  # forward node -> position
    layer_end: dict[int, fx.Node]  # layer -> its last forward node
    n_layers: int
    bw_inputs: dict[str, fx.Node]


def _decide(
    fw: fx.Graph, bw: fx.Graph, config: ActivationOffloadConfig, num_fwd_outputs: int
) -> tuple[_Decided, PassReport]:
    """Phase 1: group the saved outputs by storage, find their layers, decide which to
    offload and why (the graphs are not changed)."""
    groups, outputs = _groups(fw, num_fwd_outputs)
    report = PassReport()

    fw_nodes = list(fw.nodes)
    pos = {n: i for i, n in enumerate(fw_nodes)}
    layer_of: dict[str, int] = {}
    layer_end: dict[int, fx.Node] = {}  # the last node before the next layer's first
    prev = None
    for n in fw_nodes:
        key = _layer_key(n)
        if key is not None and key not in layer_of:
            layer_of[key] = len(layer_of)
            if layer_of[key] > 0:
                layer_end[layer_of[key] - 1] = prev
        if key is not None and key in layer_of and layer_of[key] == len(layer_of) - 1:
            layer_end[layer_of[key]] = n  # the last layer ends at its last node
        prev = n
    report.layers = list(layer_of)
    n_layers = len(layer_of)

    # The storages of the user's outputs outlive the graph.
    output_roots = {_chain(n)[0] for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    bw_inputs = {p.name: p for p in bw.find_nodes(op="placeholder")}

    for g in groups:
        val = _tensor(g.root)
        key = _layer_key(g.root) or next((k for m in g.members if (k := _layer_key(m))), None)
        g.layer = layer_of.get(key) if key is not None else None
        g.nbytes = (_nbytes(val) if val is not None else None) or 0
        g.forced = any(_must_offload(n) for n in [g.root, *g.members])
        g.preferred = any(_prefers_offload(n) for n in [g.root, *g.members])
        g.reason = _ineligible(g, val, output_roots, bw_inputs)
        if not g.reason and not g.forced:
            if g.layer is None:
                g.reason = "outside the layers"
            elif g.layer >= n_layers - config.skip_last_layers:
                g.reason = f"in the last {config.skip_last_layers} layer(s)"
            elif g.nbytes < config.min_bytes:
                g.reason = f"smaller than min_bytes ({config.min_bytes})"
        if g.forced and g.reason:
            _log.warning(
                "cannot offload %s although tagged MUST_CPU_OFFLOAD: %s", g.root.name, g.reason
            )

    chosen = _choose(groups, config.max_offload_bytes, config.budget_policy, config.prefetch_layers)
    for g in groups:
        layer = report.layers[g.layer] if g.layer is not None else None
        d = OffloadDecision(
            g.root.name,
            tuple(m.name for m in g.members),
            layer,
            g.nbytes,
            g in chosen,
            g.reason or ("tagged MUST_CPU_OFFLOAD" if g.forced else "offload"),
        )
        report.decisions.append(d)
        _log.debug(
            "%s %s (%d bytes, layer %s, members %s): %s",
            "offload" if d.offloaded else "keep",
            d.root,
            d.nbytes,
            d.layer,
            d.members,
            d.reason,
        )
    decided = _Decided(groups, chosen, outputs, pos, layer_end, n_layers, bw_inputs)
    return decided, report


def _rewrite(
    fw: fx.Graph,
    bw: fx.Graph,
    d: _Decided,
    config: ActivationOffloadConfig,
    num_fwd_outputs: int,
) -> None:
    """Phase 2: insert the ops for the chosen storages (offload and deferred wait in the
    forward, reload and wait in the backward) and drop them from the saved outputs."""
    bw_inputs = d.bw_inputs
    bw_pos = {n: i for i, n in enumerate(bw.nodes)}
    bw_start = _backward_starts(d.groups, bw_inputs, bw_pos)
    first_compute = next(n for n in bw.nodes if n.op != "placeholder")
    first_free = _first_frees(d.chosen, d.groups, bw, bw_inputs, bw_pos, bw_start, config.min_bytes)

    aliases = _aliases(fw)
    replaced: dict[fx.Node, fx.Node | None] = {}  # saved output -> host node (None: dropped)
    hosts = []
    for g in d.chosen:
        host = _rewrite_forward(
            fw, g, aliases.get(g.root, []), d.pos, d.layer_end, d.n_layers, config.defer_layers
        )
        hosts.append(host)
        for i, m in enumerate(g.members):
            replaced[m] = host if i == 0 else None
    # Note: [Where reloads go]: issued in order of first use (a reload placed at a point
    # follows the ones placed there before it).
    by_use = sorted(
        zip(d.chosen, hosts, strict=True), key=lambda gh: _first_use_pos(gh[0], bw_inputs, bw_pos)
    )
    for g, host in by_use:
        at = _reload_point(g, bw_start, first_free, first_compute, config.prefetch_layers)
        _rewrite_backward(bw, g, host, bw_inputs, bw_pos, at)

    out = fw.find_nodes(op="output")[0]
    outputs = d.outputs
    new_outputs = list(outputs[:num_fwd_outputs])
    for n in outputs[num_fwd_outputs:]:
        if n in replaced:
            if replaced[n] is not None:
                new_outputs.append(replaced[n])
        else:
            new_outputs.append(n)
    out.args = (tuple(new_outputs), *out.args[1:])


def _ineligible(g: _Group, val: torch.Tensor | None, output_roots: set, bw_inputs: dict) -> str:
    root = g.root
    if root.op == "placeholder":
        return "a graph input (parameter or input): nothing to free"
    if root in output_roots:
        return "aliases a model output"
    if (
        val is None
        or val.layout != torch.strided
        or type(val).__name__ not in ("FakeTensor", "Tensor")
    ):
        return "not a plain strided tensor"
    if _nbytes(val) is None:
        return "symbolic shape"
    if val.storage_offset() != 0 or _dense_order(val) is None:
        return "not dense (gaps or overlaps in its storage)"
    for m in g.members:
        if m.name not in bw_inputs:
            return f"{m.name} is not an input of the backward graph"
        for v in g.chains[m][1:]:
            if any(isinstance(a, fx.Node) for a in _flat([*v.args[1:], *v.kwargs.values()])):
                return "a view op with symbolic arguments"
    return ""


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """A permutation that makes ``t`` contiguous (identity when it is), or None when ``t``
    has gaps or overlaps. Note: [Storages, not tensors]: a dense root that is not contiguous
    (attention's output, laid out [batch, seq, heads, dim] behind a [batch, heads, seq, dim]
    shape) is offloaded through that permutation and permuted back after its reload."""
    if t.is_contiguous():
        return list(range(t.dim()))
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return order if t.permute(order).is_contiguous() else None


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    fx.node.map_aggregate(args, out.append)
    return out


def _choose(
    groups: list[_Group], budget: int | None, policy: BudgetPolicy, prefetch_layers: int
) -> list[_Group]:
    """Forced storages first, then preferred ones (by layer, while they fit), then the rest by
    the budget rule that the eager mode uses too (Note: [Budget rules] in _placement.py)."""
    chosen = [g for g in groups if g.forced and not g.reason]
    left = None if budget is None else budget - sum(g.nbytes for g in chosen)
    rest = [g for g in groups if not g.reason and not g.forced]
    for g in sorted((g for g in rest if g.preferred), key=lambda g: g.layer):
        if left is not None and g.nbytes > left:
            g.reason = f"over max_offload_bytes ({budget}, {policy.value})"
            continue
        chosen.append(g)
        if left is not None:
            left -= g.nbytes
    others = [g for g in rest if not g.preferred]  # graph order
    spread = left is not None and policy is BudgetPolicy.SPREAD
    if left is not None:
        items = [(g.layer, g.nbytes, i) for i, g in enumerate(others)]
        keep, why = choose(items, left, policy, prefetch_layers)
        for i, reason in why.items():
            others[i].reason = (
                f"reloaded as backward starts (the last {prefetch_layers} eligible layer(s) "
                "under a spread budget): would not lower the peak"
                if reason == "peak"
                else f"over max_offload_bytes ({budget}, {policy.value})"
            )
        others = [others[i] for i in keep]
    return chosen + sorted(others, key=lambda g: (g.layer, -g.nbytes if spread else 0))


def _backward_starts(groups: list[_Group], bw_inputs: dict, bw_pos: dict) -> dict[int, fx.Node]:
    """Note: [Layers in a compiled graph]: layer -> its first backward node."""
    start: dict[int, fx.Node] = {}
    for g in groups:
        if g.layer is None:
            continue
        for m in g.members:
            p = bw_inputs.get(m.name)
            if p is None or not p.users:
                continue
            first = min(p.users, key=bw_pos.__getitem__)
            if g.layer not in start or bw_pos[first] < bw_pos[start[g.layer]]:
                start[g.layer] = first
    return start


def _aliases(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Storage root -> the nodes of ``graph`` viewing it (Note: [Storages, not tensors])."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function":
            out.setdefault(_chain(n)[0], []).append(n)
    return out


def _first_use_pos(g: _Group, bw_inputs: dict, bw_pos: dict) -> int:
    uses = [bw_pos[u] for m in g.members for u in bw_inputs[m.name].users]
    return min(uses, default=len(bw_pos))


def _first_frees(chosen, groups, bw, bw_inputs, bw_pos, bw_start, min_bytes) -> dict:
    """Note: [Where reloads go]: for each layer with offloaded storages, the node right after
    the one where its backward has released half of the bytes of its saved storages (of at
    least ``min_bytes``; a storage is released at the last use of any alias of it). Only
    releases after the layer's backward started count: a layer's output, saved by the next
    layer, is released where the next layer's backward ends. Read before the backward is
    rewritten."""
    aliases = _aliases(bw)
    end = len(bw_pos)
    offloaded_layers = {g.layer for g in chosen if g.layer is not None}
    releases: dict[int, list[tuple[int, int, fx.Node]]] = {}  # layer -> (pos, bytes, node)
    for g in groups:
        if g.layer not in offloaded_layers or g.layer not in bw_start or g.nbytes < min_bytes:
            continue
        last, last_pos = None, -1
        for m in g.members:
            p = bw_inputs.get(m.name)
            if p is None:
                continue
            for a in [p, *aliases.get(p, [])]:
                for u in a.users:
                    i = end if u.op == "output" else bw_pos[u]
                    if i > last_pos:
                        last, last_pos = u, i
        if last is not None and last.op != "output" and last_pos > bw_pos[bw_start[g.layer]]:
            releases.setdefault(g.layer, []).append((last_pos, g.nbytes, last))
    frees = {}
    for layer, rel in releases.items():
        rel.sort(key=lambda r: r[0])
        total, done = sum(r[1] for r in rel), 0
        for _, nbytes, node in rel:
            done += nbytes
            if 2 * done >= total:
                frees[layer] = node.next
                break
    return frees


def _reload_point(g, bw_start, first_free, first_compute, prefetch) -> fx.Node:
    """Note: [Where reloads go]: the node the reloads of ``g`` go in front of (before its
    first use, which `_rewrite_backward` enforces)."""
    if g.layer is None:
        return first_compute
    later = [layer for layer in bw_start if layer >= g.layer + prefetch]
    if not later:
        return first_compute
    a = min(later)
    if a in first_free and a != g.layer:
        return first_free[a]
    return bw_start[a]


def _rewrite_forward(fw, g, aliases, pos, layer_end, n_layers, defer) -> fx.Node:
    root = g.root
    val = _tensor(root)
    order = _dense_order(val)
    src = root
    if order != sorted(order):  # Note: [Storages, not tensors]
        with fw.inserting_after(root):
            src = fw.call_function(torch.ops.aten.permute.default, (root, order))
        src.meta["val"] = val.permute(order)
    with fw.inserting_after(src):
        host = fw.create_node(
            "call_function", _ops.offload.default, (src,), name=f"offload_{root.name}"
        )
    host.meta["val"] = src.meta["val"].to("cpu")
    # Note: [Forward waits]
    last = max(
        (u for a in aliases for u in a.users if u.op != "output" and u in pos),
        key=pos.__getitem__,
        default=root,
    )
    if g.layer is not None:
        end = layer_end.get(min(g.layer + defer, n_layers - 1))
        if end is not None and pos[end] > pos[last]:
            last = end
    after = host if last is root else last
    with fw.inserting_after(after):
        w = fw.call_function(_ops.wait.default, (host,), {"keepalive": root})
    w.meta["val"] = None
    return host


def _rewrite_backward(bw, g, host, bw_inputs, bw_pos, at) -> None:
    members = [bw_inputs[m.name] for m in g.members]
    users = [u for p in members for u in p.users]
    first_use = min(users, key=bw_pos.__getitem__) if users else None
    with bw.inserting_before(members[0]):
        ph = bw.placeholder(host.name)
    ph.meta["val"] = host.meta["val"]
    if first_use is None:  # saved but unused: nothing to reload
        for p in members:
            bw.erase_node(p)
        return
    if bw_pos.get(at, -1) > bw_pos[first_use]:
        at = first_use
    val = _tensor(g.root)
    with bw.inserting_before(at):
        y = bw.call_function(_ops.reload.default, (ph, val.device))
    y.meta["val"] = host.meta["val"].to(val.device)
    with bw.inserting_before(first_use):
        w = bw.call_function(_ops.wait.default, (y,))
        w.meta["val"] = None
        root = y
        order = _dense_order(val)
        if order != sorted(order):
            inverse = sorted(range(len(order)), key=order.__getitem__)
            root = bw.call_function(torch.ops.aten.permute.default, (y, inverse))
            root.meta["val"] = val
        rebuilt: dict[fx.Node, fx.Node] = {g.root: root}
        for m, p in zip(g.members, members, strict=True):
            prev = root
            for v in g.chains[m][1:]:
                if v not in rebuilt:
                    rebuilt[v] = bw.call_function(v.target, (prev, *v.args[1:]), dict(v.kwargs))
                    rebuilt[v].meta["val"] = v.meta.get("val")
                prev = rebuilt[v]
            p.replace_all_uses_with(prev)
    for p in members:
        bw.erase_node(p)
