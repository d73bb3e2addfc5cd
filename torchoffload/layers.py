"""Layer-aware activation offloading: prefetch k layers ahead, deferred frees, a byte budget.

::

    handle = torchoffload.apply_activation_offloading(model, layers=model.layers)
    loss = model(x).sum(); loss.backward()      # offloading happens inside
    handle.stats(); handle.remove()

`offload_activations` sees a stream of saved tensors. This mode also knows which layer saved
each one, so it can follow the schedule that TransformerEngine, Megatron and torchtitan's graph
pass use:
- keep the last layers on the device, because their backward starts at once;
- release a layer's device copies once its copies are done, checked `defer_layers` layers later;
- at the start of layer i's backward, issue the reloads of layer i - `prefetch_layers`;
- free what is left of a layer once its backward is done;
- offload only up to a per-step byte budget, chosen by a stated rule.
"""

from __future__ import annotations

import enum
import logging
import threading
import weakref
from collections import defaultdict
from types import FrameType
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from torchoffload._calls import eager_call, hook_caller, running
from torchoffload._modules import find_layers
from torchoffload._placement import ActivationOffloadConfig, BudgetPolicy, choose
from torchoffload._pool import PinnedPool
from torchoffload._saved import (
    PARAMS,
    ActivationStats,
    BytePolicy,
    SavedTensorEngine,
    Session,
    Storage,
)

__all__ = [
    "ActivationOffloadConfig",
    "ActivationOffloadHandle",
    "apply_activation_offloading",
    "find_layers",
]

_log = logging.getLogger(__name__)

# Note: [Layer schedule]
# Forward. Each layer's pre-hook marks it current and its post-hook registers a hook on the
# gradient of its output. The saved-tensor hooks are pushed once around the whole model, so
# modules outside the layers (embeddings, head, loss) are seen too, and kept unless asked.
# When layer i ends, the device sources of layer i - defer_layers are dropped. If their copies
# are done (event query), that costs nothing. Otherwise the compute stream waits on them first,
# on the GPU (`release_after`), with no host sync. When the model's forward ends, whatever is
# still held is released the same way, so backward starts with only the skipped last layers
# on the device.
#
# Backward. The hook on layer i's output gradient fires when that gradient is complete: every
# consumer of the output, and so all of layer i + 1's backward that leads to it, has run. At
# that point layer i's backward is about to start. It:
# 1. frees what is left of layer i + 1's reloads (the memory is released in stream order, so
#    this is safe even if a view were still to come; such a view would be reloaded on demand);
# 2. issues the reloads of layers i .. i - prefetch_layers not yet issued. A reload issued for
#    layer i itself, at its own start, counts as a miss, because it is late.
# A callback queued on the autograd engine frees the rest when backward ends.
#
# Recomputation. A checkpointed layer runs its forward again inside backward. The pre- and
# post-hooks see this (autograd's graph task id is set) and do nothing. The tensors saved
# during recomputation go to checkpoint's own hooks, and the inputs that checkpoint saved in
# forward went through ours, tagged with the layer, so they are prefetched with it.
#
# Budget. With max_offload_bytes, the storages are chosen by the rule of Note: [Budget rules]
# in _placement.py, from the sizes recorded in the previous forward; a storage is named by
# (layer, its ordinal among the layer's distinct storages), which does not depend on what was
# offloaded. The first step, with no record yet, applies "earliest" as storages come. Later
# views of a kept storage stay kept.


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    if isinstance(output, dict):
        for item in output.values():
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


class LayerPolicy:
    """The layer-aware mode's `Policy` for one forward: which storages a layer offloads,
    and when each layer's device copies are released and its reloads issued, driven by the
    handle's layer hooks. See Note: [Layer schedule]."""

    def __init__(
        self, session: Session, handle: ActivationOffloadHandle, chosen: set[tuple[int, int]] | None
    ):
        self.session = session
        self.engine = session.owner
        self.handle = handle
        self.config = handle.config
        self.nlayers = len(handle.layers)
        self.current: int | None = None
        self.layer_recs: dict[int | None, list[Storage]] = defaultdict(list)
        self.ordinal: dict[int, int] = defaultdict(int)
        self.profile: list[tuple[int, int, int]] = []  # (layer, ordinal, nbytes), eligible
        self.chosen = chosen
        self.budget_used = 0
        self.budget_closed = False  # "earliest": once a storage did not fit, keep the rest
        self.kept: dict[int, StorageWeakRef] = {}  # storages kept by a layer rule (by cdata)
        self.released_upto = -1
        self.callback_pass: int | None = None
        self.issued_upto: int | None = None  # lowest layer whose reloads were issued
        self.freed_from = self.nlayers  # backward: layers >= this had their reloads freed
        self.hooks: Any = None  # saved-tensor hooks pushed for the current layer
        self.extra: set[tuple[int, int]] = set()  # (id(rec), layer): joined a later group

    # -- forward ----------------------------------------------------------------------------

    def admit(self, storage: torch.UntypedStorage) -> str | None:
        cfg = self.config
        i = self.current
        if i is None:
            return None if cfg.offload_outside_layers else "outside_layers"
        if i >= self.nlayers - cfg.skip_last_layers:
            return "last_layers"
        if cfg.offload_layers is not None and i not in cfg.offload_layers:
            return "not_planned"
        key = storage._cdata
        ref = self.kept.get(key)
        if ref is not None and not ref.expired():
            return "budget"  # another view of a storage the budget keeps
        nbytes = storage.nbytes()
        ordinal = self.ordinal[i]  # distinct storages of this layer, in save order
        self.ordinal[i] += 1
        self.profile.append((i, ordinal, nbytes))
        budget = cfg.max_offload_bytes
        if budget is None:
            return None
        if self.chosen is not None:
            fits = (i, ordinal) in self.chosen and self.budget_used + nbytes <= budget
        else:  # "earliest" (and the first step of "largest"): a prefix in save order
            fits = not self.budget_closed and self.budget_used + nbytes <= budget
            self.budget_closed = not fits
        if not fits:
            self.engine._counters.budget_skipped_bytes += nbytes
            self.kept[key] = StorageWeakRef(storage)
            return "budget"
        self.budget_used += nbytes
        return None

    def offloaded(self, rec: Storage) -> None:
        rec.layer = self.current
        self.layer_recs[rec.layer].append(rec)
        if rec.layer is not None:
            per_layer = self.engine._counters.per_layer_bytes
            per_layer[rec.layer] = per_layer.get(rec.layer, 0) + rec.nbytes

    def shared_view(self, rec: Storage) -> None:
        # A storage that a later layer saves too (Hugging Face's rotary cos/sin, computed once
        # and passed to every layer) is first needed in that layer's backward, so it joins that
        # layer's group: reloaded with it, not on demand long before its own layer.
        # It also stays in its own layer's group, whose backward frees it (`_release_reloads`
        # skips a storage in a later layer's group), so the layers in between find it loaded.
        i = self.current
        if i is None or rec.layer is None or i <= rec.layer or (id(rec), i) in self.extra:
            return
        self.extra.add((id(rec), i))
        self.layer_recs[i].append(rec)

    def enter_layer(self, i: int) -> None:
        self.current = i

    def exit_layer(self, i: int, output: Any) -> None:
        engine = self.engine
        with engine._lock:
            engine._drain()
            self.current = None
            last = i - self.config.defer_layers
            for j in range(self.released_upto + 1, last + 1):
                self._release_sources(j)
            self.released_upto = max(self.released_upto, last)
        grad_tensor = _first_grad_tensor(output)
        if grad_tensor is not None:
            grad_tensor.register_hook(lambda grad, i=i: self.backward_start(i))

    def _release_sources(self, layer: int | None) -> None:
        for rec in self.layer_recs.get(layer, ()):
            if rec.src is not None:
                self.session.drop_source(rec, done=rec.stored is None or rec.stored.query())

    def end_forward(self) -> None:
        self.current = None
        for layer in list(self.layer_recs):
            self._release_sources(layer)
        self.released_upto = self.nlayers
        self.handle._profile = self.profile

    # -- backward ---------------------------------------------------------------------------

    def backward_start(self, i: int) -> None:
        engine = self.engine
        with engine._lock:
            engine._drain()
            self.session.backward = True
            pass_id = torch._C._current_graph_task_id()
            if pass_id != self.callback_pass:  # a new backward pass (retain_graph reruns)
                self.callback_pass = pass_id
                self.issued_upto = None
                self.freed_from = self.nlayers
                torch.autograd.Variable._execution_engine.queue_callback(self.backward_end)
            for j in range(i + 1, self.freed_from):  # layer i + 1 (and above) are done
                self._release_reloads(j)
            self.freed_from = min(self.freed_from, i + 1)
            lowest = max(i - self.config.prefetch_layers, 0)
            start = i if self.issued_upto is None else min(i, self.issued_upto - 1)
            for j in range(start, lowest - 1, -1):
                for rec in self.layer_recs.get(j, ()):
                    if rec.block is not None and rec.src is None and rec.dev is None:
                        self.session.reload(rec, "ahead" if j < i else "demand")
            if start >= lowest:
                self.issued_upto = (
                    lowest if self.issued_upto is None else min(self.issued_upto, lowest)
                )

    def _release_reloads(self, layer: int | None) -> None:
        for rec in self.layer_recs.get(layer, ()):
            if layer is not None and rec.layer is not None and rec.layer < layer:
                continue  # joined from an earlier layer (`_shared_view`): freed with that one
            if rec.src is not None:
                self.session.drop_source(rec, done=False)
            if rec.dev is not None:
                self.session.drop_device(rec)

    def backward_end(self) -> None:
        engine = self.engine
        with engine._lock:
            engine._drain()
            for layer in list(self.layer_recs):
                self._release_reloads(layer)

    def unpacked(self, rec: Storage) -> None:
        pass  # prefetch is driven by the layer hooks, not by unpack order


# model -> a weak reference to its handle (the model's hooks keep the handle alive; a strong
# value here would keep the model alive through handle.model, even after it is dropped)
_ATTACHED: WeakKeyDictionary[nn.Module, weakref.ref] = WeakKeyDictionary()


def _check_not_attached(model: nn.Module) -> None:
    """One handle per model: a second one on it, inside it or around it would push its
    saved-tensor hooks over the first one's, which then silently offloads nothing."""
    inside = set(map(id, model.modules()))
    for other, ref in list(_ATTACHED.items()):
        handle = ref()
        if handle is None or handle._removed:
            continue
        where = None
        if other is model:
            where = "this model"
        elif id(other) in inside:
            where = f"its submodule {type(other).__name__}"
        elif any(m is model for m in other.modules()):
            where = f"a model that contains it ({type(other).__name__})"
        if where is not None:
            raise RuntimeError(
                f"activation offloading is already applied to {where} (a "
                f"{handle.mode.value!r} handle); call remove() on that handle first, or apply "
                "once to the outermost model"
            )


class Mode(enum.Enum):
    """How an `ActivationOffloadHandle` drives the saved-tensor runtime."""

    LAYERS = "layers"  # a LayerPolicy, driven by hooks on every layer
    STREAM = "stream"  # a BytePolicy around each forward (offload_activations on the model)
    RECOMPUTE = "recompute"  # no offloading: a plan that only checkpoints layers


class _Forward:
    """One forward of the model in progress on one thread: its session, the saved-tensor hooks
    pushed around it, nested calls, and the frame that called the model (Note: [Interrupted
    forwards]).

    Note: [Forwards on several threads]
    Saved-tensor hooks are per thread, and so is a forward: each thread that runs the model
    (DataParallel's replicas share these hooks; a server's workers share one model) gets a
    session of its own, keyed by its thread, with its own hooks, depth and frame. One session
    for the handle made a second thread's call look nested in the first: its layers saved past
    our hooks, and it popped the other thread's hooks from its own empty stack (an internal
    assert in torch) and left the handle stuck in "forward".
    """

    __slots__ = ("session", "hooks", "depth", "frame")

    def __init__(self, session: Session, hooks: Any, frame: FrameType | None):
        self.session, self.hooks, self.depth, self.frame = session, hooks, 1, frame


class ActivationOffloadHandle:
    """Returned by `apply_activation_offloading`, whatever the plan; `remove()` undoes it
    exactly, and so does leaving its ``with`` block.

    Note: [Interrupted forwards]
    A forward cut short by a `BaseException` (KeyboardInterrupt) skips the model's and the
    layer's ``always_call`` hooks, which would close the session and pop the saved-tensor
    hooks. The handle remembers the frame that called the model's pre-hook; the next forward
    or `remove()` that finds that frame gone pops what the session pushed (only when it is
    still the innermost saved-tensor hook) and ends the session, so the handle never stays
    stuck and the session does not grow across steps.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[nn.Module],
        config: ActivationOffloadConfig,
        pool: PinnedPool | None,
        device: torch.device | str | int | None,
        *,
        mode: Mode = Mode.LAYERS,
    ) -> None:
        bad = sorted(i for i in config.offload_layers or () if i >= len(layers))
        if bad:
            raise ValueError(
                f"offload_layers {bad} are out of range: the model has {len(layers)} layers"
            )
        _check_not_attached(model)
        self.model = model
        self.layers = layers
        self.config = config
        self.mode = mode
        # - The saved-tensor runtime (the stream mode keeps offload_activations' defaults)
        self._engine = SavedTensorEngine(
            min_bytes=config.min_bytes,
            pool=pool,
            pin_memory=config.pin_memory,
            use_streams=config.use_streams,
            on_pool_exhausted=config.on_pool_exhausted,
            device=device,
            time_waits=config.time_waits and mode is Mode.LAYERS,
        )
        self._profile: list[tuple[int, int, int]] | None = None
        # - The forward in progress
        self._forwards: dict[int, _Forward] = {}  # by thread: Note: [Forwards on several threads]
        # - What remove() undoes
        self._handles: list[Any] = []
        self._wrapped: list[tuple[nn.Module, bool, Any]] = []  # layers run under checkpoint
        self._removed = False
        _ATTACHED[model] = weakref.ref(self)
        if mode is Mode.RECOMPUTE:
            return  # no hooks at all (Note: [Plans])
        self._handles.append(model.register_forward_pre_hook(_ModelPre(self)))
        self._handles.append(model.register_forward_hook(_ModelPost(self), always_call=True))
        if mode is Mode.LAYERS:
            for i, layer in enumerate(layers):
                self._handles.append(layer.register_forward_pre_hook(_LayerPre(self, i)))
                self._handles.append(
                    layer.register_forward_hook(_LayerPost(self, i), always_call=True)
                )
            PARAMS.acquire()
            # A handle dropped without remove() (with its model) still releases the hook.
            self._params = weakref.finalize(self, PARAMS.release)

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def pool(self) -> PinnedPool:
        return self._engine.pool

    def stats(self) -> ActivationStats:
        return self._engine.stats()

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    # -- hooks ------------------------------------------------------------------------------

    @property
    def _session(self) -> Session | None:
        """The session of the forward this thread runs, if any."""
        fwd = self._forwards.get(threading.get_ident())
        return None if fwd is None else fwd.session

    def _model_pre(self, caller: FrameType | None) -> None:
        if _in_backward():
            return
        thread = threading.get_ident()
        fwd = self._forwards.get(thread)
        if fwd is not None:
            if running(thread, fwd.frame):
                fwd.depth += 1  # the model called inside its own forward
                return
            self._recover(thread)
        if self.mode is Mode.STREAM:
            session = Session(self._engine, self._stream_policy)
            PARAMS.acquire()
        else:
            session = Session(self._engine, lambda s: LayerPolicy(s, self, self._plan()))
        hooks = None
        if self.mode is Mode.STREAM or self.config.offload_outside_layers:
            hooks = session.saved_tensors_hooks()
            hooks.__enter__()  # else the hooks are pushed per layer
        self._forwards[thread] = _Forward(session, hooks, caller)

    @staticmethod
    def _stream_policy(session: Session) -> BytePolicy:
        return BytePolicy(session, prefetch_bytes=32 << 20, max_inflight_bytes=256 << 20)

    def _model_post(self) -> None:
        thread = threading.get_ident()
        fwd = self._forwards.get(thread)
        if _in_backward() or fwd is None:
            return
        fwd.depth -= 1
        if fwd.depth > 0:
            return
        self._end_forward(thread, pop=lambda hooks: hooks.__exit__(None, None, None))

    def _end_forward(self, thread: int, pop: Any) -> None:
        fwd = self._forwards.pop(thread)
        session, hooks = fwd.session, fwd.hooks
        try:
            layer_hooks = getattr(session.policy, "hooks", None)
            if layer_hooks is not None:
                session.policy.hooks = None
                pop(layer_hooks)
            if hooks is not None:
                pop(hooks)
        finally:
            if self.mode is Mode.STREAM:
                PARAMS.release()
            session.end_forward()

    def _recover(self, thread: int) -> None:
        """See Note: [Interrupted forwards]."""
        session = self._forwards[thread].session

        def pop(hooks: Any) -> None:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] is session.pack_hook:
                hooks.__exit__(None, None, None)

        _log.warning("a forward under activation offloading was interrupted; its session ended")
        self._end_forward(thread, pop)

    # Note: [Hooks only where something can be offloaded]
    # Every tensor saved under saved-tensor hooks pays a Python round trip (about 15 us even
    # when it is kept) and loses autograd's own bookkeeping. So, unless the modules outside the
    # layers are to be offloaded too, the hooks are pushed in the pre-hook of each layer that
    # may offload and popped in its post-hook (registered with always_call=True, so an
    # exception in the layer still pops them). Embeddings, head, loss and the skipped last
    # layers then run exactly as without torchoffload.

    def _layer_pre(self, i: int) -> None:
        session = self._session
        if session is None or _in_backward():
            return
        policy = session.policy
        policy.enter_layer(i)
        cfg = self.config
        offloadable = i < len(self.layers) - cfg.skip_last_layers and (
            cfg.offload_layers is None or i in cfg.offload_layers
        )
        if offloadable and policy.hooks is None and not cfg.offload_outside_layers:
            policy.hooks = session.saved_tensors_hooks()
            policy.hooks.__enter__()

    def _layer_post(self, i: int, output: Any) -> None:
        session = self._session
        if session is None or _in_backward():
            return
        policy = session.policy
        if policy.hooks is not None:
            hooks, policy.hooks = policy.hooks, None
            hooks.__exit__(None, None, None)
        policy.exit_layer(i, output)

    def _plan(self) -> set[tuple[int, int]] | None:
        """For the "spread" and "largest" rules: which storages of the next step to offload,
        from the sizes of the last forward (Note: [Budget rules] in _placement.py)."""
        budget = self.config.max_offload_bytes
        policy = self.config.budget_policy
        if budget is None or policy is BudgetPolicy.EARLIEST or not self._profile:
            return None
        items = [(layer, nbytes, (layer, ordinal)) for layer, ordinal, nbytes in self._profile]
        chosen, _ = choose(items, budget, policy, self.config.prefetch_layers)
        _log.debug("budget plan: %d of %d eligible tensors", len(chosen), len(items))
        return set(chosen)

    # -- public -----------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove every hook; the model is exactly as before. Graphs already built still run
        their backward (their saved tensors keep what they need)."""
        if self._removed:
            return
        forwards = list(self._forwards.items())
        if any(running(thread, fwd.frame) for thread, fwd in forwards):
            raise RuntimeError("cannot remove activation offloading during the model's forward")
        for thread, _ in forwards:
            self._recover(thread)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer, had, previous in self._wrapped:
            if had:
                layer.forward = previous
            else:
                del layer.forward
        self._wrapped.clear()
        self._removed = True
        _ATTACHED.pop(self.model, None)
        if self.mode is Mode.LAYERS:
            self._params()  # PARAMS.release(), once

    def recompute(self, indices: list[int]) -> None:
        """Run these layers under non-reentrant activation checkpointing until `remove()`."""
        for i in indices:
            layer = self.layers[i]
            had = "forward" in layer.__dict__
            previous = layer.__dict__.get("forward")
            layer.forward = _CheckpointedForward(layer, previous)
            self._wrapped.append((layer, had, previous))

    @property
    def recomputed_layers(self) -> list[int]:
        return [self.layers.index(layer) for layer, _, _ in self._wrapped]

    def __enter__(self) -> ActivationOffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"ActivationOffloadHandle({type(self.model).__name__}, {self.mode.value}, "
            f"{len(self.layers)} layers, {self.config}, removed={self._removed})"
        )


# Note: [Hooks under torch.compile and in copies of the model]
# The handle's hooks are objects, not bound methods, for two reasons.
# - torch.compile: dynamo would trace the hooks' Python (frames, locks, weak references of
#   storages) and recompile on every change of their state. Their ``__call__`` is
#   ``torch.compiler.disable``d, as are the saved-tensor hooks and the parameter pre-hook in
#   _saved.py, so they run eagerly between compiled regions: a compiled model is compiled per
#   layer, and its saved tensors are offloaded as in eager.
# - deepcopy, pickle and torch.save of the model copy its hook dicts. A copied hook would
#   drive the original handle from the copy's forward (and a handle holds locks, which do not
#   pickle). A hook object copies (and pickles) as `_inert`, a hook that does nothing: the
#   copy offloads nothing (apply offloading to it separately if it trains). Layers the handle
#   recomputes stay checkpointed in the copy, on the copy's own weights (`_CheckpointedForward`
#   refers to its layer), and the original's remove() does not undo that.


def _inert(*args: Any) -> None:
    """What a copy of the model gets in place of the handle's hooks (a no-op)."""


def _inert_hook() -> Any:
    return _inert


class _Hook:
    __slots__ = ("handle", "i")

    def __init__(self, handle: ActivationOffloadHandle, i: int = -1):
        self.handle, self.i = handle, i
        eager_call(type(self))

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _inert_hook, ()


class _ModelPre(_Hook):
    __slots__ = ()

    def body(self, module: nn.Module, args: Any) -> None:
        self.handle._model_pre(hook_caller(__name__))


class _ModelPost(_Hook):
    __slots__ = ()

    def body(self, module: nn.Module, args: Any, output: Any) -> None:
        self.handle._model_post()


class _LayerPre(_Hook):
    __slots__ = ()

    def body(self, module: nn.Module, args: Any) -> None:
        self.handle._layer_pre(self.i)


class _LayerPost(_Hook):
    __slots__ = ()

    def body(self, module: nn.Module, args: Any, output: Any) -> None:
        self.handle._layer_post(self.i, output)


class _CheckpointedForward:
    """A layer's forward run under non-reentrant activation checkpointing (`recompute`).
    It refers to its layer, so a deepcopy of the model checkpoints the copy's own layer."""

    __slots__ = ("layer", "inner")

    def __init__(self, layer: nn.Module, inner: Any):
        self.layer = layer
        self.inner = inner  # a forward the layer had in its __dict__ before, else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        inner = self.inner
        if inner is None:
            inner = type(self.layer).forward.__get__(self.layer)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)


def apply_activation_offloading(
    model: nn.Module,
    *,
    layers: nn.ModuleList | list[nn.Module] | str = "auto",
    config: ActivationOffloadConfig | None = None,
    pool: PinnedPool | None = None,
    device: torch.device | str | int | None = None,
    plan: object = None,
) -> ActivationOffloadHandle:
    """Offload ``model``'s activations layer by layer, in place, until ``handle.remove()``.

    Args:
        model: the module whose forward is offloaded (its forward is the step's boundary).
        layers: the repeated blocks, in forward order (an ``nn.ModuleList`` or a list of
            modules), or ``"auto"``: the largest ``nn.ModuleList`` of one module type.
        config: an `ActivationOffloadConfig` (defaults if None).
        pool: the `PinnedPool` to copy into; default: the process-wide pool.
        device: the compute device; default: the current accelerator, else the CPU.
        plan: not accepted: a `torchoffload.Plan` applies itself, ``plan.apply(model,
            layers=..., pool=..., device=...)``. The planner sits above the engines, and
            no engine imports it.
    """
    if plan is not None:
        raise TypeError(
            "apply_activation_offloading takes no plan: apply a torchoffload.Plan with "
            "plan.apply(model, layers=..., pool=..., device=...)"
        )
    config = ActivationOffloadConfig() if config is None else config
    if not isinstance(config, ActivationOffloadConfig):
        raise TypeError(f"config must be an ActivationOffloadConfig, got {type(config).__name__}")
    return ActivationOffloadHandle(model, resolve_layers(model, layers), config, pool, device)


def resolve_layers(model: nn.Module, layers: nn.ModuleList | list[nn.Module] | str) -> list:
    """``layers`` as a checked list of distinct submodules of ``model`` (``"auto"``: found)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(layers, str):
        if layers != "auto":
            raise ValueError(f"layers must be 'auto' or a list of modules, got {layers!r}")
        layers = find_layers(model)
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"layers must be 'auto', an nn.ModuleList or a list of modules, got a "
            f"{type(layers).__name__} (a single layer? pass [layer])"
        )
    try:
        layer_list = list(layers)
    except TypeError:
        raise TypeError(
            f"layers must be 'auto', an nn.ModuleList or a list of modules, got "
            f"{type(layers).__name__}"
        ) from None
    if not layer_list:
        raise ValueError("layers is empty")
    owned = {id(m) for m in model.modules()}
    for m in layer_list:
        if not isinstance(m, nn.Module):
            raise TypeError(f"layers must contain nn.Modules, got {type(m).__name__}")
        if id(m) not in owned:
            raise ValueError(f"layer {type(m).__name__} is not a submodule of the model")
    if len({id(m) for m in layer_list}) != len(layer_list):
        raise ValueError("layers contains the same module twice")
    return layer_list
