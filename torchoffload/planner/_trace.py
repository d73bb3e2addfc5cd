"""One training step under fake tensors: live bytes, saved activations and FLOPs per layer.

Note: [What the trace records]
One step (forward, backward, optimizer step) runs under `FakeTensorMode` and a dispatch mode
that sees every op. It records (1) the live bytes of fake storages after every allocation and
free: storages are tracked by a finalizer on their (preserved) Python object, so a free is seen
exactly when the last tensor, view or saved reference goes; (2) the FLOPs of each op, by
`torch.utils.flop_counter`'s formulas, charged to the layer running it, forward and backward
apart (causal attention counts half), and the bytes each op reads and writes (views move
nothing), so the planner can price each op at the slower of its FLOPs and its memory traffic;
(3) each storage autograd saves, tagged with the layer that saved it, and how many of the
layer's forward ops had run at its last save (what recomputation replays: non-reentrant
checkpointing stops once the last saved tensor is rebuilt); (4) markers where each layer's
forward ends and its backward starts. Parameters, gradients and optimizer state are counted as
they are allocated.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from torchoffload._modules import find_layers
from torchoffload._validate import check_callable, check_int

__all__ = ["LayerProfile", "Profile", "trace"]

MEMORY, MATMUL, ATTENTION = 0, 1, 2  # kinds of traced op, each with its own achieved rate

_log = logging.getLogger(__name__)


# -- what one step needs ------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerProfile:
    """One repeated block, as traced."""

    index: int
    name: str
    saved_bytes: int  # distinct storages it saved for backward (parameters excluded)
    offloadable_bytes: int  # of saved_bytes: at least min_bytes (what offloading moves)
    recompute_bytes: int  # of saved_bytes: what recomputation frees (all but its input)
    input_bytes: int  # its input, which recomputation keeps
    input_offloadable_bytes: int  # of it: what offloading it while recomputing would free
    saved_tensors: tuple[tuple[str, int], ...]  # (dtype[shape] of the first view, bytes)
    fwd_flops: int
    bwd_flops: int
    # (FLOPs, bytes read and written, kind) of each aten op, in order (kind: MATMUL, ATTENTION
    # or MEMORY); the first ``recompute_ops`` forward ops are what recomputation replays
    fwd_ops: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    bwd_ops: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    recompute_ops: int = 0
    param_bytes: int = 0  # its parameters (each once), what streaming them moves per pass


@dataclass(frozen=True)
class Profile:
    """One training step of a model, as traced under fake tensors. See Note: [What the trace
    records]. ``timeline`` is the live bytes after each allocation or free; the markers index
    into it."""

    layers: tuple[LayerProfile, ...]
    timeline: tuple[int, ...]
    fwd_end: tuple[int, ...]  # per layer: timeline index where its forward ended
    bwd_start: tuple[int, ...]  # per layer: timeline index where its backward started
    step_marks: dict[str, int]  # forward_end, backward_end, step_end
    param_bytes: int  # parameters and buffers
    grad_bytes: int
    optimizer_bytes: int
    outside_fwd_flops: int
    outside_bwd_flops: int
    outside_saved_bytes: int
    tokens: int | None
    description: str = ""
    min_bytes: int = 1 << 16
    # every storage saved for backward (parameters and the batch excluded): (layer or None,
    # bytes, timeline index when saved, when freed, saved inside the model's forward)
    saved_storages: tuple[tuple[int | None, int, int, int, bool], ...] = field(
        default=(), repr=False
    )
    outside_fwd_ops: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    outside_bwd_ops: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    # each parameter's gradient as backward finished it: (timeline index, bytes)
    grad_events: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    trainable_numel: int = 0  # elements of the parameters that require grad
    trainable_bytes: int = 0
    largest_trainable_numel: int = 0  # elements of the largest of them

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state: what no activation plan can remove."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.timeline)

    @property
    def saved_bytes(self) -> int:
        return sum(layer.saved_bytes for layer in self.layers) + self.outside_saved_bytes


class _Tracer(TorchDispatchMode):
    """Counts live storage bytes and FLOPs per layer. See Note: [What the trace records]."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.live = 0
        self.timeline: list[int] = [0]
        self.keys: set[int] = set()
        self.layer: int | None = None
        self.backward: bool | None = False  # None: the optimizer step
        self.flops: dict[tuple[int | None, bool | None], int] = defaultdict(int)
        self.ops: dict[tuple[int | None, bool | None], list[tuple[int, int, int]]] = defaultdict(
            list
        )
        self._finalizers: list[Any] = []
        self.saved_log: list[list[Any]] = []  # [layer, bytes, saved at, freed at, in model]
        self.watch: dict[int, list[Any]] = {}

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.keys:
            return
        nbytes = st.nbytes()
        self.keys.add(key)
        self.live += nbytes
        self.timeline.append(self.live)
        self._finalizers.append(weakref.finalize(st, self._free, key, nbytes))

    def _free(self, key: int, nbytes: int) -> None:
        if key in self.keys:
            self.keys.discard(key)
            self.live -= nbytes
            self.timeline.append(self.live)
            entry = self.watch.pop(key, None)
            if entry is not None:
                entry[3] = len(self.timeline) - 1

    def saved(self, key: int, layer: int | None, nbytes: int, in_model: bool) -> None:
        """A storage autograd saved: when it was saved and (at its free) when it went."""
        entry = [layer, nbytes, len(self.timeline) - 1, -1, in_model]
        self.saved_log.append(entry)
        self.watch[key] = entry

    def close(self) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "aten":  # metadata queries fake tensors dispatch (prim.device)
            return out
        flops = _flops(self.registry, func, args, kwargs, out)
        where = (self.layer, self.backward)
        self.flops[where] += flops
        kind = ATTENTION if "attention" in func.__name__ else (MATMUL if flops else MEMORY)
        self.ops[where].append((flops, _traffic(func, args, kwargs, out), kind))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                self.track(t)
        return out


def _flops(registry, func, args, kwargs, out) -> int:
    packet = func.overloadpacket
    name = str(packet)
    if "flash_attention_for_cpu" in name:  # not in torch's registry; counted like CUDA flash
        if name.endswith("_backward"):
            q, k, v = args[1:4]
            causal = args[7] if len(args) > 7 else kwargs.get("is_causal", False)
        else:
            q, k, v = args[:3]
            causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        # Per query head (grouped-query attention shares key/value heads): Q K^T and P V
        # forward; backward recomputes Q K^T and does dV, dP, dQ and dK.
        b, h, sq, d = q.shape[0], q.shape[-3], q.shape[-2], q.shape[-1]
        sk, dv = k.shape[-2], v.shape[-1]
        qk, pv = 2 * b * h * sq * sk * d, 2 * b * h * sq * sk * dv
        count = (3 * qk + 2 * pv) if name.endswith("_backward") else (qk + pv)
        return count // 2 if causal else count
    fn = registry.get(packet)
    if fn is None:
        return 0
    count = fn(*args, **kwargs, out_val=out)
    if "attention" in name and kwargs.get("is_causal", False) is True:
        count //= 2  # causal kernels skip the masked half
    return int(count)


def _traffic(func, args, kwargs, out) -> int:
    """Bytes an op reads and writes: its tensor arguments and results, as viewed. A view or an
    op that only allocates moves nothing."""
    if func.is_view or func.overloadpacket in _NO_TRAFFIC:
        return 0
    total = 0
    for t in tree_flatten((args, kwargs, out))[0]:
        if isinstance(t, torch.Tensor) and t.layout is torch.strided:
            total += t.numel() * t.element_size()
    return total


_NO_TRAFFIC = {
    torch.ops.aten.empty,
    torch.ops.aten.empty_like,
    torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_empty_strided,
    torch.ops.aten._unsafe_view,
    torch.ops.aten.detach,
    torch.ops.aten.lift_fresh,
}


def _first_tensor(value: Any) -> torch.Tensor | None:
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            return t
    return None


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    t = _first_tensor(output)
    if t is None:
        raise TypeError("the model returned no tensor: pass loss_fn=")
    return t.float().mean()


def _is_param_view(t: torch.Tensor, params: set[int]) -> bool:
    root = t if t._base is None else t._base
    if isinstance(root, nn.Parameter) or t.untyped_storage()._cdata in params:
        return True
    return root.requires_grad and root.grad_fn is None


class _StepRecorder:
    """What one traced step does layer by layer: which layer is running (for the tracer), what
    each layer saves for backward, where its forward ends and its backward starts in the
    tracer's timeline. `install` puts its hooks on the layers; `pack` is the saved-tensor hook;
    `layer_profiles` turns the record into `LayerProfile`s."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], min_bytes: int, say: Any):
        self.layers = layers
        self.min_bytes = min_bytes
        self.say = say
        self.tracer = _Tracer()
        self.index = {id(m): i for i, m in enumerate(layers)}
        self.names = {id(m): name for name, m in model.named_modules()}
        # - Timeline markers, per layer
        self.fwd_end: dict[int, int] = {}
        self.bwd_start: dict[int, int] = {}
        # - What is saved: per layer (None: outside the layers), storage key -> (what, bytes)
        self.saved: dict[int | None, dict[int, tuple[str, int]]] = defaultdict(dict)
        self.first_saver: dict[int, int | None] = {}
        self.inputs_of: dict[int, int] = {}  # layer -> storage key of its input
        self.input_bytes: dict[int, int] = {}
        self.last_save: dict[int, int] = {}  # layer -> forward ops run at its last save
        # - The step's own tensors, set by trace()
        self.param_keys: set[int] = set()
        self.batch_keys: set[int] = set()
        self.in_model = True

    def install(self) -> list[Any]:
        handles = []
        for m in self.layers:
            handles.append(m.register_forward_pre_hook(self.pre))
            handles.append(m.register_forward_hook(self.post))
        return handles

    def pre(self, module: nn.Module, args: Any) -> None:
        i = self.index[id(module)]
        if torch._C._current_graph_task_id() != -1:
            return
        self.tracer.layer = i
        x = _first_tensor(args)
        if x is not None:
            self.inputs_of[i] = x.untyped_storage()._cdata
            self.input_bytes[i] = x.untyped_storage().nbytes()

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        i = self.index[id(module)]
        if torch._C._current_graph_task_id() != -1:
            return
        tracer = self.tracer
        tracer.layer = None
        self.fwd_end[i] = len(tracer.timeline) - 1
        self.say(f"forward: layer {i + 1}/{len(self.layers)}")
        out = _first_tensor(output)
        if out is not None and out.requires_grad:
            out.register_hook(lambda grad, i=i: self.backward_start(i))

    def backward_start(self, i: int) -> None:
        self.bwd_start.setdefault(i, len(self.tracer.timeline) - 1)
        self.tracer.layer = i
        self.say(f"backward: layer {i + 1}/{len(self.layers)}")

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout is not torch.strided or _is_param_view(t, self.param_keys):
            return t
        tracer = self.tracer
        st = t.untyped_storage()
        key = st._cdata
        layer = tracer.layer if not tracer.backward else None
        if layer is not None:  # recomputing the layer replays its ops up to here
            self.last_save[layer] = len(tracer.ops[(layer, False)])
        if key not in self.first_saver:
            self.first_saver[key] = layer
            what = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            self.saved[layer][key] = (what, st.nbytes())
            if key not in self.batch_keys:
                tracer.saved(key, layer, st.nbytes(), self.in_model)
        return t

    def layer_profiles(self) -> list[LayerProfile]:
        tracer = self.tracer
        floor = max(self.min_bytes, 1)
        profiles = []
        for i, m in enumerate(self.layers):
            mine = self.saved.get(i, {})
            sizes = [n for _, n in mine.values()]
            # the batch is held by the caller: copying it frees nothing
            offloadable = sum(
                n for key, (_, n) in mine.items() if n >= floor and key not in self.batch_keys
            )
            recompute = sum(n for key, (_, n) in mine.items() if key != self.inputs_of.get(i))
            key = self.inputs_of.get(i)
            own_input = key in mine and key not in self.batch_keys and mine[key][1] >= floor
            input_bytes = self.input_bytes.get(i, 0)
            profiles.append(
                LayerProfile(
                    index=i,
                    name=self.names.get(id(m), f"layer{i}"),
                    saved_bytes=sum(sizes),
                    offloadable_bytes=offloadable,
                    recompute_bytes=recompute,
                    input_bytes=input_bytes,
                    input_offloadable_bytes=input_bytes if own_input else 0,
                    saved_tensors=tuple(mine.values()),
                    fwd_flops=tracer.flops[(i, False)],
                    bwd_flops=tracer.flops[(i, True)],
                    fwd_ops=tuple(tracer.ops[(i, False)]),
                    bwd_ops=tuple(tracer.ops[(i, True)]),
                    recompute_ops=self.last_save.get(i, 0),
                    param_bytes=sum(
                        q.numel() * q.element_size() for q in dict.fromkeys(m.parameters())
                    ),
                )
            )
        return profiles


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any] | dict[str, Any],
    *,
    layers: nn.ModuleList | list[nn.Module] | str = "auto",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: Literal["adamw", "sgd", "none"] = "adamw",
    min_bytes: int = 1 << 16,
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Trace one training step of ``model`` under fake tensors and return its `Profile`.

    ``model`` may live on any device, including ``meta`` (build huge models that way); it is
    not changed and nothing is allocated. ``example_inputs`` are positional arguments (or a dict
    of keyword arguments) whose shapes and dtypes matter, not their values. ``loss_fn`` maps
    the output to a scalar (default: ``output.loss`` when there is one, else the mean of the
    first tensor). ``optimizer`` decides what state is counted (AdamW: two tensors per
    parameter; SGD with momentum: one; "none", as plain SGD: none).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer not in ("adamw", "sgd", "none"):
        raise ValueError(f"optimizer must be 'adamw', 'sgd' or 'none', got {optimizer!r}")
    check_int("min_bytes", min_bytes, minimum=0)
    check_callable("loss_fn", loss_fn)
    check_callable("progress", progress)
    layer_list = list(find_layers(model) if isinstance(layers, str) else layers)
    if not layer_list:
        raise ValueError("no layers to plan for")
    start = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    rec = _StepRecorder(model, layer_list, min_bytes, progress or (lambda msg: None))
    tracer = rec.tracer
    handles = rec.install()
    try:
        with mode:
            fake = {}
            for name, p in list(model.named_parameters()) + list(model.named_buffers()):
                t = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu")
                fake[name] = t.requires_grad_(p.requires_grad) if p.is_floating_point() else t
            args, kwargs = _fake_inputs(example_inputs)
            params = [t for t in fake.values() if t.requires_grad]
            rec.param_keys = {t.untyped_storage()._cdata for t in fake.values()}
            opt = _make_optimizer(optimizer, params)
            grad_events: list[tuple[int, int]] = []

            def on_grad(p: torch.Tensor) -> None:
                grad_events.append((len(tracer.timeline) - 1, p.grad.untyped_storage().nbytes()))

            handles += [p.register_post_accumulate_grad_hook(on_grad) for p in params]
            with tracer:
                for t in fake.values():
                    tracer.track(t)
                param_bytes = tracer.live
                for t in tree_flatten((args, kwargs))[0]:  # the batch is on the device too
                    if isinstance(t, torch.Tensor):
                        tracer.track(t)
                        rec.batch_keys.add(t.untyped_storage()._cdata)
                tracer.timeline = [tracer.live]  # the step starts with parameters and batch
                with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
                    out = torch.func.functional_call(model, fake, args, kwargs)
                    rec.in_model = False  # the loss is outside the model
                    loss = (loss_fn or _default_loss)(out)
                del out
                tracer.layer = None
                forward_end = len(tracer.timeline) - 1
                tracer.backward = True
                loss.backward()
                del loss
                backward_end = len(tracer.timeline) - 1
                grad_bytes = sum(p.untyped_storage().nbytes() for p in params if p.grad is not None)
                tracer.layer = None
                tracer.backward = None  # the optimizer's ops: priced by the planner on their own
                if opt is not None:
                    opt.step()
                optimizer_bytes = _state_bytes(opt)
                step_end = len(tracer.timeline) - 1
    finally:
        for h in handles:
            h.remove()
        tracer.close()

    profile = _assemble(
        rec, layer_list, args, kwargs, params, grad_events,
        step_marks={"forward_end": forward_end, "backward_end": backward_end, "step_end": step_end},
        param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
        description=type(model).__name__, min_bytes=min_bytes,
    )  # fmt: skip
    _log.debug("traced %s in %.1f s", type(model).__name__, time.perf_counter() - start)
    return profile


def _assemble(
    rec: _StepRecorder,
    layer_list: list[nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params: list[torch.Tensor],
    grad_events: list[tuple[int, int]],
    *,
    step_marks: dict[str, int],
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes: int,
    description: str,
    min_bytes: int,
) -> Profile:
    """The `Profile` of a traced step, from what the recorder and its tracer saw."""
    tracer = rec.tracer
    missing = [i for i in range(len(layer_list)) if i not in rec.fwd_end]
    if missing:
        raise RuntimeError(f"layers {missing} did not run in forward: are they all used?")
    profiles = rec.layer_profiles()
    fwd_end, bwd_start, saved = rec.fwd_end, rec.bwd_start, rec.saved
    # A layer whose output needs no grad has no backward marker: use the next one's.
    starts = []
    for i in range(len(layer_list)):
        starts.append(bwd_start.get(i, bwd_start.get(i + 1, step_marks["backward_end"])))
    return Profile(
        layers=tuple(profiles),
        timeline=tuple(tracer.timeline),
        fwd_end=tuple(fwd_end[i] for i in range(len(layer_list))),
        bwd_start=tuple(starts),
        step_marks=step_marks,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        outside_fwd_flops=tracer.flops[(None, False)],
        outside_bwd_flops=tracer.flops[(None, True)],
        outside_saved_bytes=sum(n for _, n in saved.get(None, {}).values()),
        tokens=_tokens(args, kwargs),
        description=description,
        min_bytes=min_bytes,
        saved_storages=tuple(
            (e[0], e[1], e[2], e[3] if e[3] >= 0 else len(tracer.timeline), e[4])
            for e in tracer.saved_log
        ),
        outside_fwd_ops=tuple(tracer.ops[(None, False)]),
        grad_events=tuple(grad_events),
        trainable_numel=sum(p.numel() for p in params),
        trainable_bytes=sum(p.numel() * p.element_size() for p in params),
        largest_trainable_numel=max((p.numel() for p in params), default=0),
        outside_bwd_ops=tuple(tracer.ops[(None, True)]),
    )


def _fake_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs as fake tensors of the same shape and dtype (their values never matter)."""

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (dict, list, tuple)):
        raise TypeError(
            "example_inputs must be a tensor, a tuple of positional arguments or a dict of "
            f"keyword arguments, got {type(example_inputs).__name__}"
        )
    leaves = tree_flatten(example_inputs)[0]
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        raise TypeError(
            f"example_inputs holds no tensor ({[type(t).__name__ for t in leaves][:4]}): pass "
            "the model's inputs, e.g. (tokens,)"
        )
    if isinstance(example_inputs, dict):
        return (), tree_map_only(torch.Tensor, fake, dict(example_inputs))
    return tuple(tree_map_only(torch.Tensor, fake, list(example_inputs))), {}


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2:
            return t.numel()
    return None


def _make_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    if kind == "none" or not params:
        return None
    if kind == "sgd":  # with momentum: its buffer is the state (plain SGD keeps none: "none")
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _state_bytes(opt: torch.optim.Optimizer | None) -> int:
    if opt is None:
        return 0
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += v.untyped_storage().nbytes()
    return total
