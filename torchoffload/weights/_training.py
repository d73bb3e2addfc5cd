"""Parameter streaming for training: `stream_parameters`.

Parameters live in a pinned host store; a unit's parameters are copied to the device before its
forward, dropped after it, copied again before its backward and dropped once its backward is
done. The cut into units and the host layout are the weight engine's (`_layout.candidates`);
the settings are its `StreamConfig`. What differs from inference is where the device bytes
live (Note: [Training parameters keep their storage] in _pieces.py) and when they may be
dropped (Note: [When a unit's backward is done]).

Note: [When a unit's backward is done]
A unit is loaded again when the gradient of any of its outputs is computed (a multi-grad hook
registered in forward), which autograd runs before any node of the unit. It is dropped when
both (a) every trainable parameter of the unit (streamed or not) has had its gradient
accumulated: every node that reads the unit's weights to compute a parameter's gradient has
run; and (b) if its inputs required gradients, their gradients are computed (a hook on each
input, registered in forward): every node that reads the weights to compute an
input's gradient has run (counted per graph: several forwards before one backward each wait
for their own). The hooks add no node to the graph: an identity node on the inputs summed the
unit's own uses of an input before its other uses, a different order of the same sum (an
RMSNorm inside a residual came out an ulp off; found by the fuzzer). Whatever is still loaded
when the backward pass ends (a callback queued on the pass) is dropped then.

Note: [A backward that raised]
Autograd runs no queued callback of a backward pass that raised: it frees them with the pass.
The callback object (`_PassEnd`) sees that: released without having been called, it unbinds
every piece the pass left bound, so each of their parameters is a placeholder again (Note:
[Placeholders never answer]) and a user's edit after the failure (``p.mul_`` under no_grad,
``load_state_dict``) goes through the hosting layer to the host store instead of into a device
copy that the next drop would throw away. Unbinding is only the parameters' metadata
(``.data`` to 0 elements, the placeholder class): the device storages stay loaded, with their
holders cleared, and are dropped at the next forward (or the next backward's end) on the
caller's thread, where the compute stream is the caller's (Note: [Streams of a training load]);
until then a load of a piece still loaded and not stale reuses it (its bytes are the host's),
and a write through a placeholder marks it stale. Nothing of the failed pass leaks: the bytes
it left on the device are copies of the host store (a host write since then made them stale),
and its gradients are what autograd accumulated before it raised, as without streaming.
The pass is freed by the last thread that holds it: on the CPU the caller's, while the error
unwinds, so the parameters are placeholders before the caller sees the exception; on a GPU,
where the node that raised may run on an autograd device thread, that thread may let go of the
pass a moment after the caller has been woken. The next forward still drops whatever a pass
left behind if its callback object was never released (``_backward_pass`` still set).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from torchoffload import _hosted
from torchoffload._hosted import HOSTED, MANAGED
from torchoffload._modules import held
from torchoffload._transfer import compute_device
from torchoffload._validate import check_int
from torchoffload.weights import _layout
from torchoffload.weights._binding import set_data
from torchoffload.weights._pieces import Piece, PieceStore
from torchoffload.weights._runtime import STREAMED, StreamConfig
from torchoffload.weights._store import check_replaceable


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class ParameterStats:
    """Counters of a `ParameterStreamHandle` since setup. Bytes are exact."""

    units: int
    streamed_bytes: int  # bytes of the host store (each storage once)
    budget_bytes: int
    loads: int  # pieces copied to the device
    prefetched: int  # of which ahead of their use
    on_demand: int  # of which at their use (a prefetch missed or not possible)
    h2d_bytes: int
    peak_loaded_bytes: int  # high-water mark of parameter bytes on the device
    over_budget: int  # loads on demand that took the loaded bytes above the budget
    backward_passes: int


class _Unit:
    __slots__ = ("index", "name", "module", "pieces", "trainable", "pending",
                 "inputs_pending", "backward", "grad_flags")  # fmt: skip

    def __init__(self, index: int, name: str, module: nn.Module, pieces: list[Piece]):
        self.index = index
        self.name = name
        self.module = module
        self.pieces = pieces
        # Every parameter of the unit that needs a gradient (Note: [When a unit's backward is
        # done]), and the requires_grad flags of all of them as setup found them.
        params = list(dict.fromkeys(module.parameters()))
        self.trainable = [p for p in params if p.requires_grad]
        self.grad_flags = [(p, p.requires_grad) for p in params]
        self.pending = 0
        # graphs built through the unit whose inputs' gradients are not computed yet (each
        # forward that watched its inputs, until their gradients are computed or the graph is freed)
        self.inputs_pending = 0
        self.backward = False  # loaded for the current backward pass


class ParameterRuntime:
    """One model's streamed training parameters, driven by the module hooks of
    `stream_parameters`: when each unit's pieces are loaded and dropped, in forward and in
    backward. The pieces and their host store are a `PieceStore`'s."""

    def __init__(self, layout: _layout.Layout, config: StreamConfig):
        self.config = config
        self.device = config.device
        self.layout = layout
        self._lock = threading.RLock()
        self.store = PieceStore(layout, config, self._lock, self)
        pieces = self.store.pieces
        self.units = [
            _Unit(i, u.name, u.module, list({pieces[leaf.key]: None for leaf, _ in u.binds}))
            for i, u in enumerate(layout.units)
        ]
        self._units_of: dict[int, list[_Unit]] = {}
        for unit in self.units:
            for p in unit.trainable:
                self._units_of.setdefault(id(p), []).append(unit)
        # - Schedule (the forward order of units, recorded) and pass state
        self.order: list[int] | None = None
        self._position: dict[int, int] = {}
        self._recording: list[int] = []
        self._backward_pass: int | None = None
        self._leftover = False  # pieces a pass that raised left loaded (unbound)
        self.backward_passes = 0

    @property
    def removed(self) -> bool:
        return self.store.removed

    @property
    def loads(self) -> int:
        return self.store.loads

    @property
    def loaded_bytes(self) -> int:
        return self.store.loaded_bytes

    def _hold(self, unit: _Unit) -> None:
        """Load ``unit`` (or find it loaded), bind it and make the compute stream wait for
        it."""
        self.store.hold(unit.index, unit.pieces)

    def _release(self, unit: _Unit) -> None:
        unit.backward = False
        self.store.release(unit.index, unit.pieces)

    def _prefetch(self, index: int, step: int) -> None:
        order = self.order
        if order is None or index not in self._position or not self.config.prefetch_depth:
            return
        pos = self._position[index]
        for k in range(1, self.config.prefetch_depth + 1):
            j = pos + step * k
            if not 0 <= j < len(order):
                return
            unit = self.units[order[j]]
            need = sum(p.nbytes for p in unit.pieces if not p.loaded)
            if self.store.loaded_bytes + need > self.config.budget_bytes:
                return
            for piece in unit.pieces:
                self.store.load(piece, ahead=True)
                piece.holders.add(unit.index)

    # -- forward ----------------------------------------------------------------------------

    def pre_forward(self, index: int, args: tuple, kwargs: dict) -> Any:
        unit = self.units[index]
        with self._lock:
            self._check_live()
            if _in_backward():  # a checkpointed unit computed again: it stays for its backward
                self._begin_backward()  # (reentrant checkpointing: maybe no hook fired yet)
                self._hold(unit)
                unit.backward = True
                return None
            self._check_flags(unit)
            if self._backward_pass is not None or self._leftover:  # a backward that raised
                self._end_backward()  # Note: [A backward that raised]
            self._record(index)
            self._hold(unit)
            self._prefetch(index, +1)
        if not torch.is_grad_enabled():
            return None
        inputs = [x for x in pytree.tree_leaves((args, kwargs))
                  if isinstance(x, torch.Tensor) and x.requires_grad]  # fmt: skip
        if inputs:
            _watch_inputs(self, index, inputs)
        return None

    def post_forward(self, index: int, output: Any) -> None:
        unit = self.units[index]
        if _in_backward():
            return  # recomputation: dropped after the unit's backward
        if torch.is_grad_enabled():
            outs = [
                t
                for t in pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if outs:
                ref = weakref.ref(self)
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda _grads, i=index: _call(ref, "pre_backward", i), mode="any"
                )
        with self._lock:
            if not self.removed:
                self._release(unit)

    def _record(self, index: int) -> None:
        rec = self._recording
        if index in rec:  # a unit seen again: a new forward without a backward in between
            self._adopt()
            rec = self._recording = []
        rec.append(index)

    def _adopt(self) -> None:
        if self._recording and self.order != self._recording:
            self.order = list(self._recording)
            self._position = {u: k for k, u in enumerate(self.order)}

    def _check_flags(self, unit: _Unit) -> None:
        for p, flag in unit.grad_flags:
            if p.requires_grad != flag:
                raise RuntimeError(
                    f"a parameter of {unit.name!r} had requires_grad={flag} when "
                    f"stream_parameters set up and has {p.requires_grad} now: remove() the "
                    "handle, freeze or unfreeze, then stream again (the unit's weights are "
                    "dropped after backward by counting its trainable parameters' gradients)"
                )

    # -- backward (Note: [When a unit's backward is done]) ----------------------------------

    def pre_backward(self, index: int) -> None:
        with self._lock:
            if self.removed:
                return
            self._begin_backward()
            unit = self.units[index]
            unit.backward = True
            self._hold(unit)
            self._prefetch(index, -1)

    def _begin_backward(self) -> None:
        """The first hook of a backward pass: count the gradients each unit waits for, and
        queue the callback that drops what is left at the end of the pass."""
        if self._backward_pass is not None:
            return
        self._backward_pass = torch._C._current_graph_task_id()
        self.backward_passes += 1
        self._adopt()
        self._recording = []
        for unit in self.units:
            unit.pending = len(unit.trainable)
        torch.autograd.Variable._execution_engine.queue_callback(
            _PassEnd(weakref.ref(self), self._backward_pass)
        )

    def accumulated(self, param: torch.Tensor) -> None:
        with self._lock:
            if self.removed or self._backward_pass is None:
                return
            for unit in self._units_of.get(id(param), ()):
                unit.pending -= 1
                self._maybe_release(unit)

    def inputs_pending(self, index: int, delta: int) -> None:
        with self._lock:
            self.units[index].inputs_pending += delta

    def inputs_done(self, index: int) -> None:
        with self._lock:
            unit = self.units[index]
            unit.inputs_pending -= 1
            if not self.removed and self._backward_pass is not None:
                self._maybe_release(unit)

    def _maybe_release(self, unit: _Unit) -> None:
        if unit.backward and unit.pending <= 0 and unit.inputs_pending <= 0:
            self._release(unit)

    def end_backward_callback(self) -> None:
        with self._lock:
            if not self.removed:
                self._end_backward()

    def backward_failed(self, task: int) -> None:
        """Backward pass ``task`` raised (its callback was freed unrun): every piece it left
        bound is unbound now, and dropped at the next forward (Note: [A backward that
        raised])."""
        with self._lock:
            if self.removed or self._backward_pass != task:
                return
            self._backward_pass = None
            for unit in self.units:
                unit.backward = False
            self._leftover = self.store.unbind_all()

    def _end_backward(self) -> None:
        self._backward_pass = None
        self._leftover = False
        for unit in self.units:
            unit.backward = False
        self.store.drop_all()

    # -- the real values ----------------------------------------------------------------------

    def host_value(self, t: torch.Tensor) -> torch.Tensor:
        return HOSTED[t].host

    def restore(self) -> None:
        """Put every parameter back on the device with its current values; free the host
        store. Idempotent."""
        with self._lock:
            if self.removed:
                return
            if any(h.users for _, h in self.store.hosted):
                raise RuntimeError(
                    "an OffloadedOptimizer steps these parameters in the host store: remove() "
                    "it (or delete it) first"
                )
            if self._backward_pass is not None or self._leftover:
                self._end_backward()
            self.store.restore()

    def _check_live(self) -> None:
        if self.removed:
            raise RuntimeError("this ParameterStreamHandle was removed")


def _call(ref: weakref.ref, name: str, *args: Any) -> None:
    rt = ref()
    if rt is not None:
        getattr(rt, name)(*args)


class _PassEnd:
    """The callback queued on a backward pass: called when the pass ends; freed without being
    called when the pass raised (Note: [A backward that raised])."""

    __slots__ = ("ref", "task", "ran")

    def __init__(self, ref: weakref.ref, task: int):
        self.ref, self.task, self.ran = ref, task, False

    def __call__(self) -> None:
        self.ran = True
        _call(self.ref, "end_backward_callback")

    def __del__(self) -> None:
        if not self.ran:
            _call(self.ref, "backward_failed", self.task)


class _Token:
    """Lives as long as the hooks of one forward's unit inputs (their graph)."""


def _watch_inputs(runtime: ParameterRuntime, index: int, inputs: list[torch.Tensor]) -> None:
    """Tell the runtime when the gradients of a unit's inputs are computed (Note: [When a
    unit's backward is done]): a hook on each input, counted once. A hook adds no node to the
    graph, so the gradients are summed in the order autograd sums them without streaming (an
    identity node on the inputs once summed the unit's uses of an input before its other uses,
    an ulp off for an RMSNorm inside a residual). An input whose graph is freed without its
    backward (a forward whose loss was dropped) stops being waited for, with its hook (which
    refers to nothing that refers back to it: no cycle keeps it alive)."""
    ref = weakref.ref(runtime)
    for t in inputs:
        ran = [False]
        token = _Token()

        def done(_grad: Any, token: _Token = token, ran: list[bool] = ran) -> None:
            if not ran[0]:
                ran[0] = True
                _call(ref, "inputs_done", index)

        runtime.inputs_pending(index, +1)
        t.register_hook(done)
        weakref.finalize(token, _abandoned, ref, index, ran)
        del token


def _abandoned(ref: weakref.ref, index: int, ran: list[bool]) -> None:
    if not ran[0]:
        _call(ref, "inputs_pending", index, -1)


# -- the public face ---------------------------------------------------------------------------


class ParameterStreamHandle:
    """What `stream_parameters` returns: stats, the units, `remove()`. Also a context manager
    (leaving the ``with`` block calls `remove()`)."""

    def __init__(self, runtime: ParameterRuntime, hooks: Sequence[RemovableHandle]):
        if not isinstance(runtime, ParameterRuntime):
            raise TypeError("use torchoffload.stream_parameters(model, ...) to create a handle")
        self._runtime = runtime
        self._hooks = list(hooks)

    @property
    def units(self) -> list[str]:
        return [u.name for u in self._runtime.units]

    @property
    def removed(self) -> bool:
        return self._runtime.removed

    def host_value(self, param: torch.Tensor) -> torch.Tensor:
        """The host store's view of a streamed parameter (its current values; read-only by
        contract: write through ``model.load_state_dict`` after `remove()`)."""
        if param not in HOSTED or STREAMED.get(param) is not self._runtime:
            raise ValueError("not a parameter streamed by this handle")
        return self._runtime.host_value(param)

    def stats(self) -> ParameterStats:
        rt = self._runtime
        store = rt.store
        with rt._lock:
            return ParameterStats(
                units=len(rt.units),
                streamed_bytes=rt.layout.host_bytes,
                budget_bytes=rt.config.budget_bytes,
                loads=store.loads,
                prefetched=store.prefetched,
                on_demand=store.on_demand,
                h2d_bytes=store.h2d_bytes,
                peak_loaded_bytes=store.peak_loaded_bytes,
                over_budget=store.over_budget,
                backward_passes=rt.backward_passes,
            )

    def remove(self) -> None:
        """Put every parameter back on the device with its current values (the host store's)
        and remove the hooks. Idempotent."""
        self._runtime.restore()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __enter__(self) -> ParameterStreamHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        rt = self._runtime
        return (
            f"ParameterStreamHandle({len(rt.units)} units, "
            f"{rt.layout.host_bytes / 2**20:.1f} MiB on the host, budget "
            f"{rt.config.budget_bytes / 2**20:.1f} MiB{', removed' if rt.removed else ''})"
        )


def stream_parameters(
    model: nn.Module,
    budget_bytes: int,
    *,
    device: torch.device | str | None = None,
    prefetch_depth: int = 1,
    unit: str | Sequence[nn.Module] | None = "blocks",
    resident: Sequence[str] = (),
    pin_memory: bool = True,
    use_streams: bool = True,
) -> ParameterStreamHandle:
    """Train ``model`` with its parameters in pinned host memory, each unit's parameters copied
    to ``device`` for its forward and again for its backward, at most ``budget_bytes`` of them
    there at once (prefetch stays within it; a load that cannot wait is counted in
    ``stats().over_budget``).

    ```python
    handle = torchoffload.stream_parameters(model, budget_bytes=4 << 30)
    opt = torchoffload.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5)
    loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()
    ```

    Trainable streamed parameters are stepped by an `OffloadedOptimizer` built after this
    call, which steps them in the host store (Note: [Hosted parameters]). Another optimizer
    reads and writes them through their placeholders (the same bits, but every step copies
    every streamed parameter to the device and back). Frozen streamed parameters (a base model
    under adapters) work with any optimizer of the other parameters.

    ``unit``: ``"blocks"`` (the model's repeated blocks, the default), ``"leaves"`` or a list
    of modules; parameters outside every unit, buffers and those matching ``resident``
    (patterns over dotted names) stay on the device. ``prefetch_depth``: units loaded ahead, in
    the recorded forward order and in reverse in backward. Parameters may be on the CPU or on
    ``device``; their device and host copies are replaced by the host store.
    Outside its unit a streamed parameter is a placeholder whose every read and write is served
    with the host values or refused (Note: [Placeholders never answer]): `model.state_dict()`
    returns the host values, `model.load_state_dict` writes them (an `OffloadedOptimizer`
    reads its masters again), conversions and copies of the model are refused.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(resident, str):
        resident = (resident,)
    resident = tuple(resident)
    dev = compute_device(device)
    check_int("budget_bytes", budget_bytes, minimum=1)
    config = StreamConfig(
        device=dev,
        budget_bytes=budget_bytes,
        prefetch_depth=prefetch_depth,
        use_streams=use_streams,
        pin_memory=pin_memory,
    )
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:  # fmt: skip
        if t in HOSTED or t in STREAMED or t in _hosted.REFS:
            raise ValueError(f"{name!r} is already streamed: remove() that handle first")
    buffers = tuple(n for n, _ in model.named_buffers(remove_duplicate=False))
    layout = _pick(model, resident + buffers, unit)
    for slot in layout.streamed:
        t = slot.tensor
        if not isinstance(t, nn.Parameter) or len(slot.leaves) != 1 or type(t) is not nn.Parameter:
            raise ValueError(
                f"stream_parameters streams plain nn.Parameters; {slot.name!r} is a "
                f"{type(t).__qualname__}: keep it with resident=({slot.name!r},)"
            )
        if t.is_meta:
            raise ValueError(f"{slot.name!r} is on the meta device: materialize the model first")
        if t.device.type not in ("cpu", dev.type) or (
            t.device.type == dev.type and t.device != dev
        ):
            raise ValueError(f"{slot.name!r} is on {t.device}; expected the CPU or {dev}")
        if t in HOSTED or t in STREAMED:
            raise ValueError(f"{slot.name!r} is already streamed: remove() that handle first")
        if not t.is_leaf:
            raise ValueError(f"{slot.name!r} is not a leaf tensor")
        if t in MANAGED:
            raise ValueError(
                f"{slot.name!r} is stepped by an OffloadedOptimizer built before "
                "stream_parameters: build the optimizer after streaming (it then steps the host "
                "store)"
            )
    sizes = [_unit_bytes(layout, u) for u in layout.units]
    largest = max(sizes)
    if budget_bytes < largest:
        biggest = layout.units[sizes.index(largest)]
        raise ValueError(
            f"budget_bytes={budget_bytes} is below the largest unit, {biggest.name!r} "
            f"({largest} bytes, {largest / 2**20:.1f} MiB): the minimum budget. Its backward "
            "may hold two units at once; prefetching needs more"
        )
    _place(layout, dev)
    runtime = ParameterRuntime(layout, config)
    hooks: list[RemovableHandle] = []
    ref = weakref.ref(runtime)
    for i, unit_state in enumerate(runtime.units):
        m = unit_state.module
        hooks.append(m.register_forward_pre_hook(_PreForward(ref, i), with_kwargs=True))
        # always_call: a forward that raised inside the unit releases it too (else an edit
        # before the next forward went to its device copy and was lost at the next load)
        hooks.append(m.register_forward_hook(_PostForward(ref, i), always_call=True))
    params = {id(p): p for u in runtime.units for p in u.trainable}
    for p in params.values():
        hooks.append(p.register_post_accumulate_grad_hook(_Accumulated(ref)))
    hooks.append(model.register_state_dict_post_hook(_StateDict(ref, layout)))
    names = [q for s in layout.streamed for _, _, q in s.where]
    what = "streamed parameters"
    hooks += _hosted.refuse_assign(model, names, "stream_parameters", what, _NO_COPY, _live(ref))
    hooks += _hosted.guard_conversions(model, "stream_parameters", _NO_COPY)
    return ParameterStreamHandle(runtime, hooks)


_NO_COPY = _hosted.no_copy_message("stream_parameters")


class _Hook:
    """A hook of a streamed model: copying or pickling it (a deepcopy or torch.save of the
    model) raises with the cause and the fix, as under `stream_weights`."""

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NO_COPY)


def _place(layout: _layout.Layout, dev: torch.device) -> None:
    """Resident tensors moved to ``dev`` (one on meta is left: it has no values), and tensors
    with no elements made there, as `stream_weights` does (Note: [Tensors with no elements] in
    _layout.py); they stay on ``dev`` after `remove()`, as the resident ones."""
    check_replaceable(layout.empty, ValueError)
    with torch.no_grad():
        for t in (s.tensor for s in layout.empty):
            if t.device != dev:
                set_data(t, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev))
        for t in (s.tensor for s in layout.resident):
            if t.device != dev and not t.is_meta:
                t.data = t.data.to(dev)


def _unit_bytes(layout: _layout.Layout, unit: _layout.UnitLayout) -> int:
    """Device bytes of a unit: the whole host piece of every storage it uses."""
    keys = {leaf.key for leaf, _ in unit.binds}
    return sum(layout.pieces[k][1] - layout.pieces[k][0] for k in keys)


def _pick(model: nn.Module, resident: tuple[str, ...], unit: Any) -> _layout.Layout:
    try:
        options = _layout.candidates(model, resident, unit)
    except ValueError as exc:
        raise ValueError(str(exc).replace("stream_weights", "stream_parameters")) from None
    return options[0]


class _PreForward(_Hook):
    def __init__(self, ref: weakref.ref, i: int):
        self.ref, self.i = ref, i

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        rt = self.ref()
        return None if rt is None else rt.pre_forward(self.i, args, kwargs)


class _PostForward(_Hook):
    def __init__(self, ref: weakref.ref, i: int):
        self.ref, self.i = ref, i

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        rt = self.ref()
        if rt is not None:
            rt.post_forward(self.i, output)


class _Accumulated(_Hook):
    def __init__(self, ref: weakref.ref):
        self.ref = ref

    def __call__(self, param: torch.Tensor) -> None:
        rt = self.ref()
        if rt is not None:
            rt.accumulated(param)


class _StateDict(_Hook):
    def __init__(self, ref: weakref.ref, layout: _layout.Layout):
        self.ref = ref
        self.names = [(s.tensor, [(m, q) for m, _, q in s.where]) for s in layout.streamed]

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any):
        rt = self.ref()
        if rt is None or rt.removed:
            return
        copies: dict[int, torch.Tensor] = {}
        for t, names in self.names:
            for m, q in names:
                key = prefix + q
                # a tensor assigned to the module since (m.weight = ...) is its own value
                if key in state_dict and held(m, q.rsplit(".", 1)[-1]) is t:
                    if id(t) not in copies:
                        copies[id(t)] = rt.host_value(t).clone()
                    state_dict[key] = copies[id(t)]


def _live(ref: weakref.ref) -> Callable[[], bool]:
    def live() -> bool:
        rt = ref()
        return rt is not None and not rt.removed

    return live
