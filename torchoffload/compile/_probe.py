"""Weight probes: run an exported program with its weights streamed from host memory.

`insert_weight_probes` puts ``torch.ops.torchoffload.probe(w, probe_id)`` in front of every use
of every weight in a graph; `stream_exported_weights` serves those probes from the weight
engine of `torchoffload.weights` (pinned host copy, capped device arena, prefetch on a copy
stream), one unit per weight, so a probe is served by its id and no schedule cursor can serve
a wrong weight.

Note: [Serving a probe]
Probe ids are numbered in graph order, and the runner runs the graph in that order (eagerly,
node by node). Serving probe i starts the unit of its weight (wait for its copy or fetch it
now, bind it, prefetch the next units of the recorded schedule) and returns the weight as a
tensor over the arena. That unit is finished (its "done" event recorded on the compute stream,
after which the copy stream may overwrite its bytes) at the first probe that comes after the
node that uses it, or at the end of the run: by then the use has been queued on the compute
stream, so "done" follows it. A weight probed again while still held is returned as it is.
A probe outside a runner returns a copy of its weight (the program runs unchanged, resident).

Note: [A version counter of its own]
A server holds several units at once: one node may read weights of several units, and a
unit is finished only after its readers. At a unit's exit the runtime checks that no tensor
it bound was modified in place, by comparing version counters with their values right after
its bind, and binding (``set_``) moves a counter. So a tensor handed to the runtime shares
its counter with no other: ``detach()`` and ``nn.Parameter(t)`` share ``t``'s, and with them
two views of one storage bound by two units held at once count each other's binds (a first
call refused as "modified in place" where nothing was), and the model's own tensors count
every call's binds (a backward through a graph that saved one fails autograd's version
check, though the program holds a copy and leaves the model alone). `own_version` makes the
tensor over the same memory with a counter of its own. A real in-place write to a bound
tensor while its unit is held still moves that counter and is refused.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from torchoffload._flatten import is_composite
from torchoffload._transfer import compute_device
from torchoffload.weights import WeightStreamHandle, _layout
from torchoffload.weights._runtime import StreamConfig, WeightRuntime

__all__ = [
    "ExportedWeightRunner",
    "ProbeServer",
    "insert_weight_probes",
    "own_version",
    "readers",
    "serving",
    "stream_exported_weights",
]

_local = threading.local()  # .active: the servers whose programs run on this thread


def _active() -> list[ProbeServer]:
    if not hasattr(_local, "active"):
        _local.active = []
    return _local.active


def serving() -> ProbeServer | None:
    """The `ProbeServer` of the program running now on this thread, or None (a program runs
    its probes on the thread that calls it, so two threads each get their own)."""
    active = _active()
    return active[-1] if active else None


def readers(node: fx.Node, ordering: Sequence[Any] = (), outputs: bool = False) -> list[fx.Node]:
    """The nodes that read ``node``'s memory: its users, and the users of every view of it (a
    view reads nothing itself; whoever consumes the view does). Users whose target is one of
    ``ordering`` (ops that take tensors only to be ordered after them) read nothing. The
    graph's output node is one only with ``outputs``."""
    out: list[fx.Node] = []
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if (user.op == "output" and not outputs) or user.target in ordering:
            continue
        out.append(user)
        if _is_view(user):
            todo.extend(user.users)
    return out


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


class ProbeServer:
    """Serves a program's weight probes by id from a `WeightRuntime` (Note: [Serving a
    probe]). ``sources[i]`` is probe ``i``'s (unit index, module, attribute): the unit to enter
    and where its tensor is bound, or unit -1 for a tensor that stays on the device.
    ``positions[i]`` and ``last_use[i]`` are probe ``i``'s place in the graph and that of its
    last user. Used by `ExportedWeightRunner` and `StreamedPackage`, through the runtime's
    call API (``begin_call``, ``enter``, ``exit``, ``end_call``)."""

    def __init__(self, runtime: WeightRuntime, sources: list[tuple[int, nn.Module, str]],
                 positions: Sequence[int], last_use: Sequence[int]):  # fmt: skip
        self.runtime = runtime
        self.sources = sources
        self.positions = list(positions)
        self.last_use = list(last_use)
        self.served: list[int] = []  # probe ids served in the current call (for tests)
        self._held: dict[int, int] = {}  # unit index -> position of its last use so far
        self.checked: set[int] = set()  # probe ids whose served geometry was checked

    def run(self, program: Any, args: tuple, kwargs: dict) -> Any:
        """Call ``program(*args, **kwargs)`` with its probes served from the runtime."""
        rt = self.runtime
        if program is None:
            raise RuntimeError("this program was removed")
        active = _active()
        if self in active:
            raise RuntimeError("this streamed program is already running (re-entered)")
        with torch.no_grad():
            rt.begin_call(None)  # ended in the finally below, so it needs no frame
            active.append(self)
            self.served = []
            ok = False
            try:
                out = program(*args, **kwargs)
                ok = True
            finally:
                try:
                    self._release(None)
                finally:
                    active.remove(self)
                    rt.end_call(ok)
        return out

    def serve(self, probe_id: int) -> torch.Tensor:
        if not 0 <= probe_id < len(self.sources):
            raise RuntimeError(
                f"probe id {probe_id} is not one of this program's {len(self.sources)} probes"
            )
        self.served.append(probe_id)
        self._release(self.positions[probe_id])
        index, module, attr = self.sources[probe_id]
        if index >= 0:
            if index not in self._held:
                self.runtime.enter(index, None)
            self._held[index] = max(self._held.get(index, -1), self.last_use[probe_id])
        return getattr(module, attr).detach()

    def _release(self, before: int | None) -> None:
        """Finish the units whose uses are queued (Note: [Serving a probe])."""
        for index, use in list(self._held.items()):
            if before is None or use < before:
                del self._held[index]
                self.runtime.exit(index, None)


@torch.library.custom_op("torchoffload::probe", mutates_args=())
def probe(w: torch.Tensor, probe_id: int) -> torch.Tensor:
    """The weight for probe ``probe_id``: served by the running `ExportedWeightRunner`, or a
    copy of ``w`` when no runner is running. See Note: [Serving a probe]."""
    server = serving()
    if server is not None:
        return server.serve(probe_id)
    return w.clone()


@probe.register_fake
def _(w: torch.Tensor, probe_id: int) -> torch.Tensor:
    return torch.empty_like(w)


probe.register_autograd(
    lambda ctx, grad: (grad, None)
)  # the weight itself, as far as autograd sees
fx.node.has_side_effect(torch.ops.torchoffload.probe.default)


def _weights(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    found = dict(gm.named_parameters(remove_duplicate=False))
    found.update(gm.named_buffers(remove_duplicate=False))
    return found


def insert_weight_probes(gm: fx.GraphModule) -> list[str]:
    """Insert ``probe(w, id)`` before each use of each parameter or buffer of ``gm`` (read by a
    ``get_attr`` node, as in ``ExportedProgram.module()``), in place. Returns the weight name of
    each probe id. ``graph.lint()`` holds afterwards."""
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"gm must be a torch.fx.GraphModule, got {type(gm).__name__}")
    graph = gm.graph
    weights = _weights(gm)
    names: list[str] = []
    for node in list(graph.nodes):
        if node.op == "get_attr" or node.op == "placeholder":
            continue
        attrs = [a for a in node.all_input_nodes if a.op == "get_attr" and a.target in weights]
        for attr in dict.fromkeys(attrs):
            with graph.inserting_before(node):
                p = graph.call_function(torch.ops.torchoffload.probe.default, (attr, len(names)))
            p.meta.update({k: attr.meta[k] for k in ("val", "tensor_meta") if k in attr.meta})
            node.replace_input_with(attr, p)
            names.append(str(attr.target))
    graph.lint()
    gm.recompile()
    return names


def own_version(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory with its geometry and dtype, a version counter of its own
    and no autograd history, never an inference tensor (Note: [A version counter of its
    own]). A tensor subclass, whose inner buffers the runtime binds, is only detached."""
    if is_composite(t):
        return t.detach()
    with torch.inference_mode(False):
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        return out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


class _One(nn.Module):
    def __init__(self, t: torch.Tensor):
        super().__init__()
        self.register_buffer("w", own_version(t))


class ExportedWeightRunner:
    """Runs an exported program with its weights streamed (built by `stream_exported_weights`).

    Call it like the program. ``handle`` is the weight engine's `WeightStreamHandle`
    (``stats()``, ``schedule``); ``probe_names[i]`` is the weight probe ``i`` serves."""

    def __init__(self, ep: torch.export.ExportedProgram, device: Any, budget_bytes: int,
                 prefetch_depth: int, pin_memory: bool = True):  # fmt: skip
        if not isinstance(ep, torch.export.ExportedProgram):
            raise TypeError(f"ep must be a torch.export.ExportedProgram, got {type(ep).__name__}")
        self.device = compute_device(device)
        gm = ep.module()
        weights = _weights(gm)
        self.probe_names = insert_weight_probes(gm)
        if not self.probe_names:
            raise ValueError(
                "this exported program uses no parameters or buffers: nothing to stream"
            )
        units: dict[int, int] = {}  # id(tensor) -> unit index (tied weights share one unit)
        tensors: list[torch.Tensor] = []
        self._unit_of: list[int] = []
        for name in self.probe_names:
            t = weights[name]
            index = units.setdefault(id(t), len(tensors))
            if index == len(tensors):
                tensors.append(t)
            self._unit_of.append(index)
        self._holder = nn.ModuleList(_One(t) for t in tensors)
        config = StreamConfig(self.device, budget_bytes, prefetch_depth, pin_memory=pin_memory)
        layout = _layout.plan(
            self._holder, budget=budget_bytes, depth=prefetch_depth, resident=(),
            unit=list(self._holder),
        )  # fmt: skip
        with torch.inference_mode(False), torch.no_grad():
            self._runtime = WeightRuntime(layout, config)
        self.handle = WeightStreamHandle(self._runtime)
        # The graph reads its weights only through probes, which serve them by id: what the
        # get_attr nodes hand them is an empty stand-in, so gm holds no weight memory.
        for name in weights:
            owner, _, leaf = name.rpartition(".")
            mod = gm.get_submodule(owner)
            stand_in = torch.empty(0, device=self.device)
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(stand_in, requires_grad=False)
            else:
                mod._buffers[leaf] = stand_in
        self._gm = gm
        positions = {n: i for i, n in enumerate(gm.graph.nodes)}
        probes = [n for n in gm.graph.nodes if n.target is torch.ops.torchoffload.probe.default]
        self._server = ProbeServer(
            self._runtime,
            [(i, self._runtime.units[i].layout.module, "w") for i in self._unit_of],
            [positions[p] for p in probes],
            [max(positions[u] for u in readers(p)) for p in probes],
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._server.run(self._gm, args, kwargs)

    def remove(self) -> None:
        """Release the host copy and the arena."""
        self.handle.remove()

    def __repr__(self) -> str:
        return f"ExportedWeightRunner({len(self.probe_names)} probes, {self.handle!r})"


def stream_exported_weights(
    ep: torch.export.ExportedProgram,
    device: Any = None,
    *,
    budget_bytes: int,
    prefetch_depth: int = 2,
    pin_memory: bool = True,
) -> ExportedWeightRunner:
    """Run ``ep`` with its parameters and buffers in pinned host memory, streamed through a
    device arena of at most ``budget_bytes``, ``prefetch_depth`` weights ahead.

    The program runs eagerly (``ep.module()`` with probes, under `torch.no_grad()`); outputs are
    bitwise those of ``ep.module()`` with the weights resident. Not supported: CUDA graph
    capture (a replay skips the probes; capturing raises) and compiling the runner. Weights
    are copied to the host once; drop ``ep`` afterwards to free their original memory.
    """
    return ExportedWeightRunner(ep, device, budget_bytes, prefetch_depth, pin_memory)
