"""The public face of weight streaming: `stream_weights`, `minimum_budget`, the handle and its
stats, and the eager module hooks that drive the runtime."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchoffload import _hosted
from torchoffload._calls import eager_call, hook_caller
from torchoffload._modules import held
from torchoffload._transfer import compute_device
from torchoffload._validate import check_bool, check_int
from torchoffload.weights import _layout
from torchoffload.weights._checkpoint import Checkpoint
from torchoffload.weights._graph import StreamedGraph
from torchoffload.weights._runtime import STREAMED, StreamConfig, WeightRuntime

_log = logging.getLogger(__name__)
_MiB = 1 << 20
_ATTR = "_torchoffload_weights"


@dataclass(frozen=True)
class WeightStats:
    """Counters of a `WeightStreamHandle` since setup (or `reset_stats`). Bytes are exact."""

    units: int  # units the model was cut into
    streamed_bytes: int  # bytes of the host copy of the streamed tensors (each stored once)
    resident_bytes: int  # bytes kept on the device outside the budget
    budget_bytes: int
    arena_bytes: int  # the device arena: min(budget, what all units need)
    kept_units: int  # units kept in the arena across calls (Note: [Kept units])
    calls: int  # completed calls of the model
    hits: int  # unit found loaded (prefetched or kept) at its pre-forward
    misses: int  # unit fetched on demand at its pre-forward
    prefetch_issued: int
    evictions: int
    h2d_bytes: int
    h2d_copies: int
    peak_device_bytes: int  # high-water mark of unit bytes loaded in the arena
    schedule_rerecords: int
    out_of_order: int  # units that ran where the schedule expected another
    stall_ms: float | None  # time the compute stream waited on copies (time_waits=True)
    setup_s: float  # seconds setup took (host copy, pinning, arena)
    interrupted_calls: int = 0  # calls cut short by KeyboardInterrupt and recovered
    graph_replays: int = 0  # calls replayed as CUDA graphs (`cuda_graph`), within ``calls``

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class WeightStreamHandle:
    """What `stream_weights` returns: stats, the schedule, and `remove()`.

    Also a context manager: leaving the ``with`` block calls `remove()`.
    """

    def __init__(
        self,
        runtime: WeightRuntime | None = None,
        hooks: Sequence[RemovableHandle] = (),
        model: nn.Module | None = None,
        setup_s: float = 0.0,
    ):
        if not isinstance(runtime, WeightRuntime):
            raise TypeError("use torchoffload.stream_weights(model, ...) to create a handle")
        self._runtime = runtime
        self._hooks = list(hooks)
        self._model = model
        self._setup_s = setup_s

    # -- public -----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._runtime.device

    @property
    def units(self) -> list[str]:
        """Names of the units, in setup order."""
        return [u.name for u in self._runtime.units]

    @property
    def unit_kind(self) -> str:
        """How the model was cut: ``"blocks"``, ``"leaves"`` or ``"given"``."""
        return self._runtime.layout.kind

    @property
    def schedule(self) -> list[str] | None:
        """Unit names in the recorded call order (None before the first complete call)."""
        order = self._runtime.schedule.order
        return None if order is None else [self._runtime.units[i].name for i in order]

    @property
    def resident(self) -> list[str]:
        """Names of the tensors kept on the device (outside the budget)."""
        return list(self._runtime.resident_names)

    @property
    def kept(self) -> list[str]:
        """Units kept in the arena across calls (Note: [Kept units])."""
        return [u.name for u in self._runtime.units if u.fixed is not None]

    @property
    def removed(self) -> bool:
        return self._runtime.removed

    def stats(self) -> WeightStats:
        rt = self._runtime
        with rt._lock:
            c = rt.counters
            stall = rt.waits.collect(block=True) if rt.time_waits else None
            arena = rt.arena
            return WeightStats(
                units=len(rt.units),
                streamed_bytes=rt.layout.streamed_bytes,
                resident_bytes=rt.resident_bytes,
                budget_bytes=rt.config.budget_bytes,
                arena_bytes=rt.layout.arena_bytes(rt.config.budget_bytes),
                kept_units=sum(u.fixed is not None for u in rt.units),
                calls=c.calls,
                hits=c.hits,
                misses=c.misses,
                prefetch_issued=c.prefetch_issued,
                evictions=c.evictions,
                h2d_bytes=c.h2d_bytes,
                h2d_copies=c.h2d_copies,
                peak_device_bytes=arena.peak if arena is not None else 0,
                schedule_rerecords=c.schedule_rerecords,
                out_of_order=c.out_of_order,
                stall_ms=stall,
                setup_s=self._setup_s,
                interrupted_calls=c.interrupted_calls,
                graph_replays=c.graph_replays,
            )

    def cuda_graph(self, fn: Any, *, max_graphs: int = 8, prime: bool = True) -> StreamedGraph:
        """``fn`` (a function that calls the streamed model, or the model itself) as a
        `StreamedGraph`: called like ``fn``, the first call of an argument signature runs
        eagerly, the second is captured as a CUDA graph with the weight copies, their events
        and the arena slots in it, and later ones replay it, with no host work per unit.

        Tensor arguments are copied into the graph's static inputs; the returned tensors are
        its static outputs, overwritten by its next replay. Other arguments are part of the
        signature (an object such as a KV cache by identity). Runs under `torch.no_grad()`.
        On the CPU the same bookkeeping runs without a graph (for tests). ``prime``: each
        replay copies the next one's first units while its last ones compute (Note: [Primed
        replays]); False captures without it, for comparison. See Note: [Captured calls by
        signature] and Note: [Weights in a captured graph]."""
        rt = self._runtime
        rt._check_live()
        hosted = rt.layout.hosted
        if hosted:  # Note: [Tensors hosted by another engine] in _layout.py
            raise ValueError(
                f"cuda_graph: {len(hosted)} tensors of this model stream with another engine "
                f"(first: {hosted[0].name!r}; stream_experts), whose copies a graph of "
                "stream_weights does not drive (eagerly, it reads each block's routing on the "
                "host). Call the model eagerly (both engines run), or remove() this handle "
                "and use the stream_experts handle's cuda_graph (the dense parts resident)"
            )
        if rt.device.type == "cuda" and not (rt.host.is_pinned() and rt.config.use_streams):
            raise ValueError(
                "cuda_graph needs the host store pinned and a copy stream: call stream_weights "
                "with pin_memory=True and use_streams=True (the defaults)"
            )
        return StreamedGraph(rt, fn, max_graphs=max_graphs, prime=prime, handle=self,
                             model=self._model)  # fmt: skip

    def reset_stats(self) -> None:
        rt = self._runtime
        with rt._lock:
            for f in fields(rt.counters):
                setattr(rt.counters, f.name, 0)
            if rt.arena is not None:
                rt.arena.peak = rt.arena.loaded_bytes
            rt.waits.reset()

    def remove(self) -> None:
        """Put every tensor back where it was (its device, dtype and values; parameters keep
        their identity) and free the arena and the host copy. Idempotent. A call running in
        another thread is waited for."""
        rt = self._runtime
        with rt._lock:
            if rt.removed:
                return
            rt.restore()  # raises, changing nothing, when called inside a forward
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            if self._model is not None and getattr(self._model, _ATTR, None) is self:
                delattr(self._model, _ATTR)

    def __enter__(self) -> WeightStreamHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NO_COPY)

    def __repr__(self) -> str:
        rt = self._runtime
        state = "removed" if rt.removed else f"{len(rt.units)} units"
        return (
            f"WeightStreamHandle({state}, budget={rt.config.budget_bytes / _MiB:.1f} MiB, "
            f"streamed={rt.layout.streamed_bytes / _MiB:.1f} MiB, device={rt.device})"
        )


_NO_COPY = _hosted.no_copy_message("stream_weights")


# -- setup ------------------------------------------------------------------------------------


def stream_weights(
    model: nn.Module,
    device: torch.device | str | int | None = None,
    *,
    budget_bytes: int,
    prefetch_depth: int = 2,
    resident: str | Sequence[str] = (),
    unit: str | Sequence[nn.Module] | None = None,
    use_streams: bool = True,
    pin_memory: bool = True,
    time_waits: bool = False,
    checkpoint: str | os.PathLike[str] | None = None,
    strict: bool = True,
) -> WeightStreamHandle:
    """Keep ``model``'s weights in pinned host memory and stream them to ``device`` as it runs.

    For inference (call the model under `torch.no_grad()` or `torch.inference_mode()`).
    Outputs are bitwise identical to the model with all weights on the device.

    Args:
        model: the model; its parameters and buffers may be on the host or on ``device``
            (a mixture of experts whose experts stream with `stream_experts`: the rest).
        device: where the model computes. ``None``: the current accelerator, else the CPU
            (the same logic runs there synchronously, for testing).
        budget_bytes: hard cap on device bytes for streamed weights (the arena).
        prefetch_depth: units fetched ahead of the one computing. The budget must hold
            ``prefetch_depth + 1`` of the largest unit; `stream_weights` says the minimum.
        resident: name patterns of modules, parameters or buffers to keep on the device,
            outside the budget (``"embed_tokens"``, ``"lm_head"``, ``"layers.0.*"``). A pattern
            matches a dotted name or any dotted part of it.
        unit: how the model is cut into units. ``None``: its repeated blocks when the budget
            holds them, else every module that holds weights itself; ``"blocks"`` or
            ``"leaves"`` to choose; or a list of modules. Weights outside the given modules
            are streamed by the module holding them.
        use_streams: copy on a dedicated stream (overlapping compute); ``False`` queues the
            copies on the compute stream.
        pin_memory: page-lock the host copy (only where an accelerator exists).
        time_waits: measure how long the compute stream waits on copies (``stats().stall_ms``).
        checkpoint: a safetensors checkpoint (a ``.safetensors`` file, a sharded
            ``model.safetensors.index.json``, or a directory holding either) to take the
            values from, read straight into the pinned host store. The model may then be built
            on the ``meta`` device: its weights never exist anywhere else. Tensors are matched
            by their ``state_dict()`` names (a tied weight by any of its names); dtypes and
            shapes must match. A tensor the checkpoint lacks is an error (see ``strict``);
            entries the model does not have are ignored. After ``remove()``, tensors that were
            on meta are on the host.
        strict: with ``checkpoint``, as torch's ``load_state_dict``: ``True`` raises
            `CheckpointError` before anything changes when the checkpoint lacks a tensor of
            the model (non-persistent buffers and tensors with no elements need no entry);
            ``False`` lets such a tensor keep its own values (one on meta has none: still an
            error). ``strict=False`` without a checkpoint is refused (nothing is read).

    Returns a `WeightStreamHandle`: ``stats()``, ``schedule``, ``remove()``.

    Tensors that stream with another engine (the experts of `stream_experts`, applied
    first) are left alone: in no unit, in no budget, not moved; a unit may contain them, and
    that engine loads them inside its forward; ``checkpoint`` entries of theirs are read into
    that engine's host store. `remove()` this handle before that one.
    See Note: [Tensors hosted by another engine] in _layout.py.

    Outside its unit's forward a streamed tensor is empty (Note: [Binding weights in place]):
    a weight read outside the module that owns it must be resident, or inside a larger unit.
    ``model.state_dict()`` returns the real values (host copies) and ``load_state_dict``
    writes into the host store; the README's table states what every other module operation
    does while streaming.
    """
    start_time = time.perf_counter()
    _check_model(model)
    resident = _check_resident(resident)
    _check_strict(strict, checkpoint)
    config = StreamConfig(
        compute_device(device), budget_bytes, prefetch_depth, use_streams, pin_memory, time_waits
    )
    source = Checkpoint.open(checkpoint) if checkpoint is not None else None
    layout = _layout.plan(
        model, budget=budget_bytes, depth=prefetch_depth, resident=resident, unit=unit
    )
    with torch.inference_mode(False), torch.no_grad():
        runtime = WeightRuntime(layout, config, source, strict=strict)
    hooks = install_hooks(runtime, model)
    hooks += _hosted.guard_conversions(model, "stream_weights", _NO_COPY)
    handle = WeightStreamHandle(runtime, hooks, model, time.perf_counter() - start_time)
    setattr(model, _ATTR, handle)
    _log.info(
        "streaming %.1f MiB of weights in %d units through a %.1f MiB arena (%d tensors resident)",
        layout.streamed_bytes / _MiB, len(layout.units),
        layout.arena_bytes(budget_bytes) / _MiB, len(runtime.resident_names),
    )  # fmt: skip
    return handle


def minimum_budget(
    model: nn.Module,
    *,
    prefetch_depth: int = 2,
    resident: str | Sequence[str] = (),
    unit: str | Sequence[nn.Module] | None = None,
) -> int:
    """The smallest ``budget_bytes`` that `stream_weights` accepts for ``model`` with these
    settings: ``min(prefetch_depth + 1, units)`` times the largest unit, in arena bytes. With
    ``unit=None``, the smaller of the blocks and leaves cuts. The model is not changed."""
    _check_model(model)
    check_int("prefetch_depth", prefetch_depth, minimum=0)
    resident = _check_resident(resident)
    return min(
        lay.least_budget(prefetch_depth) for lay in _layout.candidates(model, resident, unit)
    )


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError(
            "this model already streams its weights (its streamed tensors are empty and live "
            "in that handle's host store); call that handle's remove() first"
        )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t in STREAMED:
            raise RuntimeError(
                f"{name!r} already streams with another model (its values live in that "
                "handle's host store); call that handle's remove() first"
            )


def _check_strict(strict: Any, checkpoint: Any) -> None:
    check_bool("strict", strict)
    if not strict and checkpoint is None:
        raise ValueError(
            "strict=False says what to do with tensors a checkpoint lacks, but no checkpoint= "
            "was given (every tensor keeps its own values): pass checkpoint=, or drop strict"
        )


def _check_resident(resident: Any) -> tuple[str, ...]:
    if isinstance(resident, str):
        resident = (resident,)
    try:
        resident = tuple(resident)
    except TypeError:
        raise TypeError("resident must be a name pattern or a sequence of them") from None
    if not all(isinstance(p, str) for p in resident):
        raise TypeError("resident must be a name pattern or a sequence of them")
    return resident


# -- eager hooks --------------------------------------------------------------------------------


class _Hook:
    """A module hook of a streamed model. Copying or pickling it (a deepcopy or torch.save of
    the model) raises with the cause and the fix. No __slots__: torch marks state_dict hooks
    with attributes."""

    def __init__(self, rt: WeightRuntime, index: int = -1, fn: Any = None):
        self.rt = rt
        self.index = index
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NO_COPY)


# The frame handed to the runtime is the one that calls the hook: it runs until the module's
# forward ends (Note: [One call at a time]).


class _Eager(_Hook):
    """A forward hook that runs eagerly under torch.compile: the model's and each unit's hooks
    break the graph, so each unit's forward is compiled on its own and binds its weights like
    in eager (Note: [Hooks under torch.compile and in copies of the model] in layers.py)."""

    def __init__(self, rt: WeightRuntime, index: int = -1):
        super().__init__(rt, index)
        eager_call(type(self))


class _UnitPre(_Eager):
    def body(self, module: nn.Module, args: Any) -> None:
        self.rt.enter(self.index, hook_caller(__name__))


class _UnitPost(_Eager):
    def body(self, module: nn.Module, args: Any, output: Any) -> None:
        self.rt.exit(self.index, output)


class _RootPre(_Eager):
    def body(self, module: nn.Module, args: Any) -> None:
        self.rt.begin_call(hook_caller(__name__))


class _RootPost(_Eager):
    def body(self, module: nn.Module, args: Any, output: Any) -> None:
        self.rt.end_call(ok=sys.exc_info()[1] is None)


def install_hooks(rt: WeightRuntime, model: nn.Module) -> list[RemovableHandle]:
    """Drive ``rt`` from ``model``'s forward (the root brackets a call, each unit's module its
    use) and serve ``state_dict``/``load_state_dict`` of the streamed tensors from the host
    store."""
    hooks: list[RemovableHandle] = []
    for u in rt.units:
        module = u.layout.module
        hooks.append(module.register_forward_pre_hook(_UnitPre(rt, u.index)))
        hooks.append(module.register_forward_hook(_UnitPost(rt, u.index), always_call=True))
    hooks.append(model.register_forward_pre_hook(_RootPre(rt), prepend=True))
    hooks.append(model.register_forward_hook(_RootPost(rt), always_call=True))

    # state_dict / load_state_dict: each module that holds streamed tensors reads and writes
    # them in the host store (a submodule's own state_dict() too).
    owned: dict[int, tuple[nn.Module, list[tuple[str, Any]]]] = {}
    for slot in rt.layout.streamed:
        for module, _, qual in slot.where:
            owned.setdefault(id(module), (module, []))[1].append((qual.rsplit(".", 1)[-1], slot))
    taken: set[str] = set()
    for module, names in owned.values():
        saved = _Hook(rt, fn=_state_dict_hook(rt, names))
        hooks.append(module.register_state_dict_post_hook(saved))
        load = _Hook(rt, fn=_load_hook(rt, names, taken))
        hooks.append(module.register_load_state_dict_pre_hook(load))
        hooks.append(module.register_load_state_dict_post_hook(_Hook(rt, fn=_loaded_hook(taken))))
    quals = [q for slot in rt.layout.streamed for _, _, q in slot.where]
    hooks += _hosted.refuse_assign(model, quals, "stream_weights", "streamed tensors", _NO_COPY)
    return hooks


def _holds(module: nn.Module, name: str, slot: Any) -> bool:
    """Whether ``module`` still holds ``slot``'s tensor under ``name``: a tensor assigned to the
    module since (``module.weight = nn.Parameter(w)``) is the module's own, read and loaded as
    any resident tensor."""
    return held(module, name) is slot.tensor


def _state_dict_hook(rt: WeightRuntime, names: list[tuple[str, Any]]):
    def hook(module, state_dict, prefix, local_metadata):
        # One host copy per storage for the whole state_dict() call (tied weights held by
        # several modules share it, as in the model): keyed by the destination dict.
        cache = rt.copies_for(state_dict)
        for name, slot in names:
            key = prefix + name
            if key in state_dict and _holds(module, name, slot):
                state_dict[key] = rt.host_value(slot, cache)

    return hook


def _load_hook(rt: WeightRuntime, names: list[tuple[str, Any]], taken: set[str]):
    def hook(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        if local_metadata.get("assign_to_params_buffers", False):
            return  # refused before (`_hosted.refuse_assign`) where it reaches a streamed tensor
        for name, slot in names:
            key = prefix + name
            if key not in state_dict or not _holds(mod, name, slot):
                continue
            error = rt.write_host(slot, state_dict.pop(key))
            if error is not None:
                error_msgs.append(f"{key}: {error}")
            taken.add(key)  # not missing: see _loaded_hook

    return hook


def _loaded_hook(taken: set[str]):
    """The default loader counts the keys the load hooks took as missing: they were not."""

    def hook(module, incompatible_keys):
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if k not in taken]
        taken.clear()

    return hook
