"""`OffloadedOptimizer`: any `torch.optim` optimizer class, stepped on the host."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from torchoffload._hosted import HOSTED, MANAGED, HostedParameter
from torchoffload.optim._device import DeviceStep
from torchoffload.optim._grads import MovedGrad
from torchoffload.optim._runtime import (
    HostStepRuntime,
    OptimizerOffloadConfig,
    OptimizerStats,
    _hyper,
    is_dtensor,
    local,
    shape_of,
    storage_families,
    value_of,
)


class OffloadedOptimizer(torch.optim.Optimizer):
    """An optimizer whose state, fp32 master weights and step live in host memory.

    ```python
    opt = torchoffload.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    for batch in batches:
        for micro in batch[:-1]:
            with opt.accumulating():          # every backward but the last of an accumulation
                model(micro).loss.backward()
        model(batch[-1]).loss.backward()      # gradients leave the device as they finish;
        opt.step()                            # the host steps each bucket meanwhile
        opt.zero_grad()
    ```

    ``optimizer_class`` is instantiated on the host, once per bucket of parameters, over fp32
    copies of them, with ``optimizer_kwargs``; the step is that class's own (bitwise what it
    computes on those fp32 host tensors). A parameter that is not fp32 keeps an fp32 master
    copy on the host, and receives the master rounded to its dtype after each step.

    During the final backward each gradient leaves the device as soon as it is final and
    ``param.grad`` then holds a `MovedGrad` that raises when read, until `step()`. Clip with
    ``max_grad_norm`` (the config), not ``clip_grad_norm_`` on the model. LR schedulers,
    `state_dict`/`load_state_dict` (in the plain class's format, plus ``"master_params"`` for
    parameters that are not fp32), `zero_grad` in both forms and step hooks work as with the
    plain class. `step()` consumes the gradients (they left the device): afterwards
    ``param.grad`` holds a `ConsumedGrad` that raises when read or accumulated into, so a loop
    calls `zero_grad()` between `step()` and the next backward, as torch.optim loops do; one
    that does not is refused before anything changes (Note: [The gradient after step()]).
    `torch.amp.GradScaler` works as with the plain class (``scaler.step(opt)``, ``unscale_``):
    the host unscales and checks the moved gradients before any is stepped, so until a first
    `step()` without a scaler is done the host steps at `step()`, not during backward (Note:
    [Loss scaling]).

    ``params``: parameters (or param groups) of one device; ``config``: an
    `OptimizerOffloadConfig`, whose fields may also be passed by keyword; ``model``: the
    module these parameters belong to, needed by ``step_ahead`` (its forward waits for the
    step) and used by ``max_grad_norm`` (the norm is summed as ``clip_grad_norm_(
    model.parameters())`` sums it: Note: [The order of the clipping norm]).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        config: OptimizerOffloadConfig | None = None,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ):
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
            )
        if issubclass(optimizer_class, OffloadedOptimizer):
            raise TypeError(
                "optimizer_class must be the class to run on the host, not OffloadedOptimizer"
            )
        if _needs_closure(optimizer_class):
            raise ValueError(
                f"{optimizer_class.__name__}.step needs a closure (it evaluates the loss again), "
                "which the host step cannot run: the model and its gradients are on the device. "
                "Use an optimizer whose step takes no closure (AdamW, SGD, Adam, ...)"
            )
        config_fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_FIELDS}
        if config is None:
            config = OptimizerOffloadConfig(**config_fields)
        elif not isinstance(config, OptimizerOffloadConfig):
            raise TypeError(
                f"config must be an OptimizerOffloadConfig, got {type(config).__name__}"
            )
        elif config_fields:
            raise TypeError(f"pass {sorted(config_fields)} in config, not beside it")
        groups = _groups(params)
        flat = [p for g in groups for p in g["params"]]
        device = _check_params(flat)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if config.step_ahead and model is None:
            raise ValueError(
                "step_ahead needs model=: the module whose forward reads the parameters "
                "(its forward waits for the parameters still being stepped)"
            )
        if config.step_ahead and any(p in HOSTED for p in flat):
            raise ValueError(
                "step_ahead: not supported for parameters streamed by stream_parameters (their "
                "next forward loads them from the host store the step is writing)"
            )
        if config.step_ahead and any(is_dtensor(p) for p in flat):
            raise ValueError("step_ahead: not supported for DTensor parameters (FSDP2, TP)")
        if config.max_grad_norm is not None and any(is_dtensor(p) for p in flat):
            raise ValueError(
                "max_grad_norm: not supported for DTensor parameters (FSDP2, tensor parallel) "
                "yet; their gradients stay on the device until step(), so clip them with "
                "torch.nn.utils.clip_grad_norm_ before calling step()"
            )
        if config.offload_fraction < 1.0:
            why = None
            if any(is_dtensor(p) for p in flat):
                why = "DTensor parameters (FSDP2, tensor parallel)"
            elif any(p in HOSTED for p in flat):
                why = "parameters streamed by stream_parameters"
            elif config.max_grad_norm is not None:
                why = "max_grad_norm (the norm would span host and device gradients)"
            if why is not None:
                raise ValueError(f"offload_fraction < 1: not supported yet with {why}")
        # The class's defaults, and its own check of the keyword arguments.
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **kwargs)
        self._building = True
        super().__init__(groups, probe.defaults)
        self._building = False
        self.config = config
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        on_host = _split(flat, config.offload_fraction, storage_families(flat))
        # Indices, in the optimizer's parameter order, of the host part's parameters and of
        # the device part's (Note: [Which parameters stay on the device]).
        self._host_index = [i for i, h in enumerate(on_host) if h]
        self._device = None
        if not all(on_host):
            kept = [i for i, h in enumerate(on_host) if not h]
            self._device = DeviceStep(
                [flat[i] for i in kept], kept, [group_of[i] for i in kept], self.param_groups,
                optimizer_class, kwargs,
            )  # fmt: skip
        rank = _clip_order(flat, model)
        self._runtime = HostStepRuntime(
            [flat[i] for i in self._host_index], [group_of[i] for i in self._host_index],
            self.param_groups, optimizer_class, kwargs, config, device, self._host_index,
            clip_order=[rank[i] for i in self._host_index],
        )  # fmt: skip
        if self._device is not None:
            self._runtime.kept_on_device = self._device.params
            self._runtime.kept_numbering = self._device.index
            for p in self._device.params:
                MANAGED[p] = self._runtime
        self._finalizer = weakref.finalize(self, self._runtime.close)
        self._forward_hooks = []
        if config.step_ahead:
            rt = self._runtime
            self._forward_hooks = [
                model.register_forward_pre_hook(_ModelHook(rt.enter_forward)),
                model.register_forward_hook(_ModelHook(rt.exit_forward), always_call=True),
            ]
            # See Note: [Reading the model while stepping ahead]: every module that owns one of
            # these parameters finishes the step before its state is saved or loaded.
            ours = {id(p) for p in flat}
            for m in model.modules():
                if any(id(p) in ours for _, p in m.named_parameters(recurse=False)):
                    self._forward_hooks += [
                        m.register_state_dict_pre_hook(_ModelHook(rt.before_state_dict)),
                        m.register_load_state_dict_pre_hook(_ModelHook(rt.before_state_dict)),
                    ]
        # GradScaler unscales through its own unscale_ (Note: [Loss scaling]): no
        # _step_supports_amp_scaling, whose path hands step() a scale after the host may
        # have stepped.

    # - The optimizer API
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Finish the host step (waiting for the buckets still running on the host) and make
        the compute stream wait on the uploads of the new values (no host sync)."""
        if closure is not None:
            raise ValueError("OffloadedOptimizer.step does not take a closure")
        if any(getattr(self, k, None) is not None for k in ("grad_scale", "found_inf")):
            raise RuntimeError(
                "OffloadedOptimizer.step: grad_scale/found_inf are not supported; let "
                "torch.amp.GradScaler unscale (scaler.step(optimizer)). See Note: [Loss "
                "scaling]"
            )
        rt = self._live()
        dev = self._device
        if dev is None:
            rt.step()
            return
        # Queued on the compute stream once the host part's last buckets are on their way
        # (their copies do not wait for it), while the host finishes its own.
        hyper = [_hyper(g) for g in self.param_groups]
        rt.step(between=lambda: dev.step(hyper))

    def synchronize(self) -> None:
        """Finish a step still running on the host (``step_ahead``): afterwards every
        parameter holds its new value, on the host and (in stream order) on the device."""
        self._live().settle()

    def reload_parameters(self) -> None:
        """Read every fp32 master again from its parameter. Changes made in place are seen
        without it (by the version counter); writes through ``param.data`` are not: call this
        after them."""
        self._live().reload_parameters()
        if self._device is not None:
            for k in range(len(self._device.params)):
                self._device.reload(k)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients: those still on the device, those already on the host and
        those a `step()` consumed. With ``set_to_none=False`` every parameter that has a
        gradient for torch.optim gets zeros on the device instead, as with torch.optim: the
        next backward accumulates into them and a parameter it does not use is stepped with
        a zero gradient (Note: [The gradient after step()]). Buckets that the host stepped
        during backward keep their new values (a warning says so)."""
        rt = self._live()
        params = [p for group in self.param_groups for p in group["params"]]
        if not set_to_none and any(p in HOSTED for p in params):
            raise ValueError(
                "zero_grad(set_to_none=False): not supported for parameters streamed by "
                "stream_parameters (outside its unit such a parameter has no shape for the "
                "zeros to take); call zero_grad() (set_to_none=True)"
            )
        had = [p.grad is not None for p in params]  # moved and consumed ones included
        rt.discard()
        for p, has in zip(params, had, strict=True):
            if not has:
                continue
            if set_to_none:
                p.grad = None
            elif p.grad is None or isinstance(p.grad, MovedGrad):
                p.grad = _zeros_like(p)
            else:
                p.grad.detach_().zero_()

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """Gradients of a backward inside stay on the device and accumulate there as usual;
        the next backward outside is the final one (like DDP's ``no_sync``)."""
        return self._live().accumulating()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(
                "OffloadedOptimizer cannot add a param group after construction: build it with "
                "every group"
            )
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The plain optimizer class's state dict (host tensors), plus ``"master_params"``:
        the fp32 master of every parameter that is not fp32, by index. A parameter changed in
        place since the last step has its master read again first, as the next step would:
        the masters round to the parameters as they are now."""
        rt = self._live()
        rt.check_idle("state_dict()")
        rt.follow_parameters()
        if self._device is not None:
            self._device.follow()
        gidx = self._host_index
        packed_groups, index = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            packed_groups.append(packed)
        state, masters = {}, {}
        for bucket in rt.buckets:
            for rec in bucket.records:
                s = bucket.optimizer.state.get(rec.master)
                if s:
                    state[gidx[rec.entry.index]] = s
                if rec.entry.dtype != torch.float32:
                    masters[gidx[rec.entry.index]] = rec.master
        dev = self._device
        if dev is not None:
            for k, master in enumerate(dev.masters):
                s = dev.optimizer.state.get(master)
                if s:
                    state[dev.index[k]] = s
                if master is not dev.params[k]:
                    masters[dev.index[k]] = master
        return {
            "state": dict(sorted(state.items())),
            "param_groups": packed_groups,
            "master_params": dict(sorted(masters.items())),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of the plain optimizer class. Masters come from
        ``"master_params"`` when present (they must round to the current parameters: load the
        model's state dict from the same checkpoint first), else from the parameters."""
        rt = self._live()
        rt.check_idle("load_state_dict()")
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or len(saved) != len(self.param_groups):
            raise ValueError(
                "loaded state dict has a different number of parameter groups "
                f"({len(saved) if isinstance(saved, list) else saved!r}, expected "
                f"{len(self.param_groups)})"
            )
        for g, (mine, theirs) in enumerate(zip(self.param_groups, saved, strict=True)):
            if len(theirs.get("params", ())) != len(mine["params"]):
                raise ValueError(
                    f"loaded state dict's group {g} has {len(theirs.get('params', ()))} "
                    f"parameters, this optimizer's has {len(mine['params'])}"
                )
        order = [i for group in saved for i in group["params"]]  # saved id of each parameter
        state = state_dict.get("state", {})
        masters = state_dict.get("master_params", {})
        gidx, dev = self._host_index, self._device
        every = [(gidx[k], rec.param) for k, rec in enumerate(rt.records)]
        if dev is not None:
            every += list(zip(dev.index, dev.params, strict=True))
        for i, param in every:
            m = masters.get(order[i])
            if m is None:
                continue
            p = value_of(param)
            if tuple(m.shape) != shape_of(param):
                raise ValueError(
                    f"master_params[{order[i]}] has shape {tuple(m.shape)}, parameter {i} "
                    f"{shape_of(param)}"
                )
            rounded = m.to(device=p.device, dtype=p.dtype)
            if not torch.equal(rounded, p):
                raise ValueError(
                    f"master_params[{order[i]}] does not round to parameter {i}'s current "
                    "value: load the model's state dict from the same checkpoint first"
                )
        for mine, theirs in zip(self.param_groups, saved, strict=True):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        for bucket in rt.buckets:
            local_groups, local_state, slot = [], {}, 0
            by_master = {id(r.master): r for r in bucket.records}
            for host_group in bucket.optimizer.param_groups:
                ids = []
                for master in host_group["params"]:
                    rec = by_master[id(master)]
                    key = order[gidx[rec.entry.index]]
                    if key in state:
                        local_state[slot] = state[key]
                    ids.append(slot)
                    slot += 1
                local_groups.append({**{k: v for k, v in host_group.items() if k != "params"},
                                     "params": ids})  # fmt: skip
            for host_group, g in zip(local_groups, bucket.groups, strict=True):
                host_group.update({k: v for k, v in self.param_groups[g].items() if k != "params"})
            bucket.optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        if dev is not None:
            _load_device(dev, order, state, masters, self.param_groups)
        for k, rec in enumerate(rt.records):
            m = masters.get(order[gidx[k]])
            if m is not None:
                rec.master.copy_(m)
                if rec.hosted is not None:
                    rec.synced = (rec.hosted.version, -2)
                else:
                    p = local(rec.param)
                    rec.synced = (p._version, p.data_ptr())
            else:
                rt._refresh(rec)

    # - torchoffload
    def stats(self) -> OptimizerStats:
        rt = self._live()
        rt.settle()
        state_bytes = sum(
            t.numel() * t.element_size()
            for b in rt.buckets
            for s in b.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        host = rt.last_host_ms
        dev = self._device
        return OptimizerStats(
            steps=rt.steps,
            buckets=len(rt.buckets),
            pinned_bytes=rt.layout.pinned_bytes,
            state_bytes=state_bytes,
            d2h_bytes=rt.d2h_bytes,
            h2d_bytes=rt.h2d_bytes,
            host_step_ms=host,
            host_step_ms_after_call=rt.last_host_ms_after_call,
            step_wait_ms=rt.wait_ms,
            overlap=(1 - rt.last_host_ms_after_call / host) if host > 0 else 0.0,
            grad_norm=None if rt.grad_norm is None else float(rt.grad_norm),
            device_params=0 if dev is None else sum(dev.trainable),
            device_state_bytes=0 if dev is None else dev.state_bytes(),
        )

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm of the last step (with ``max_grad_norm``), before clipping."""
        rt = self._live()
        rt.settle()
        return rt.grad_norm

    def remove(self) -> None:
        """Stop the worker and remove the hooks. The parameters keep their current values; the
        optimizer cannot be used afterwards. The device part (``offload_fraction`` < 1) is
        dropped now; the host buffers are freed with the optimizer object (a `state_dict()`
        taken before may still view them)."""
        for h in self._forward_hooks:
            h.remove()
        self._finalizer()
        self._device = None

    def _live(self) -> HostStepRuntime:
        rt = self._runtime
        if rt.closed:
            raise RuntimeError("this OffloadedOptimizer was removed")
        return rt

    def __repr__(self) -> str:
        rt = self._runtime
        name = type(rt.buckets[0].optimizer).__name__ if rt.buckets else "?"
        kept = "" if self._device is None else f", {len(self._device.params)} kept on the device"
        return (f"OffloadedOptimizer({name}, {len(rt.records)} parameters in "
                f"{len(rt.buckets)} buckets on the host for {rt.device}{kept})")  # fmt: skip

    def __getstate__(self) -> Any:
        raise TypeError("an OffloadedOptimizer cannot be pickled: save its state_dict()")

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(
            "an OffloadedOptimizer cannot be copied: build another and load_state_dict()"
        )


_CONFIG_FIELDS = frozenset(OptimizerOffloadConfig.__dataclass_fields__)


class _ModelHook:
    """A hook this optimizer puts on ``model`` (``step_ahead``). A copy of the model
    (`copy.deepcopy`, pickle: an EMA copy, ``torch.save(model)``) is a plain model of its own
    parameters, which this optimizer does not step: it gets an inert hook, not this one."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any = None):
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        if self.fn is not None:
            self.fn(*args)

    def __deepcopy__(self, memo: Any) -> _ModelHook:
        return _ModelHook()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ModelHook, ())


def _clip_order(params: list[torch.Tensor], model: torch.nn.Module | None) -> list[int]:
    """Each parameter's place in the sum of the clipping norm: its place in
    ``model.parameters()``, those the model lacks after them in the order given (Note: [The
    order of the clipping norm])."""
    place = {} if model is None else {id(p): k for k, p in enumerate(model.parameters())}
    after = len(place)
    return [place.get(id(p), after + i) for i, p in enumerate(params)]


def _needs_closure(cls: type) -> bool:
    """Whether ``cls.step`` requires its closure (LBFGS re-evaluates the loss)."""
    try:
        param = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


_PLAIN = (torch.Tensor, torch.nn.Parameter, HostedParameter)  # Note: [Placeholders never answer]


def _zeros_like(p: torch.Tensor) -> torch.Tensor:
    """Zeros laid out as autograd lays out a gradient of ``p`` (its strides when they are
    dense), from its metadata only: a parameter still being stepped ahead need not wait."""
    with torch.no_grad():
        return torch.zeros_like(p, memory_format=torch.preserve_format)


def _split(params: list[torch.Tensor], fraction: float, families: list[int]) -> list[bool]:
    """Which parameters the host steps: the trainable ones whose gradients backward finishes
    first (the last in order) until ``fraction`` of the trainable bytes (at least one), and,
    with every parameter on the host, the frozen ones too (Note: [Which parameters stay on
    the device]). The parameters of one storage (one key in ``families``) go together, where
    the last of them goes (Note: [Parameters that share a storage])."""
    if fraction >= 1.0:
        return [True] * len(params)
    nbytes = [local(p).numel() * p.element_size() if p.requires_grad else 0 for p in params]
    members: dict[int, list[int]] = {}
    for i, key in enumerate(families):
        members.setdefault(key, []).append(i)
    want, taken = fraction * sum(nbytes), 0
    on_host = [False] * len(params)
    decided: set[int] = set()
    for i in reversed(range(len(params))):
        if families[i] in decided:
            continue
        decided.add(families[i])
        together = members[families[i]]
        size = sum(nbytes[j] for j in together)
        if size and (taken < want or taken == 0):
            for j in together:
                on_host[j] = True
            taken += size
    return on_host


def _load_device(dev: DeviceStep, order, state, masters, user_groups) -> None:
    """`load_state_dict` for the device part: its state and masters from the saved ones."""
    local_state, local_groups, slot = {}, [], 0
    position = {id(m): k for k, m in enumerate(dev.masters)}
    for group, g in zip(dev.optimizer.param_groups, dev.groups, strict=True):
        ids = []
        for master in group["params"]:
            key = order[dev.index[position[id(master)]]]
            if key in state:
                local_state[slot] = state[key]
            ids.append(slot)
            slot += 1
        local_groups.append({**{k: v for k, v in user_groups[g].items() if k != "params"},
                             "params": ids})  # fmt: skip
    dev.optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
    for k, master in enumerate(dev.masters):
        m = masters.get(order[dev.index[k]])
        if m is not None and master is not dev.params[k]:
            master.copy_(m)
            dev.synced[k] = (dev.params[k]._version, dev.params[k].data_ptr())
        else:
            dev.reload(k)


def _groups(params: Any) -> list[dict[str, Any]]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or dicts, got a Tensor")
    groups = list(params)
    if not groups:
        raise ValueError("params is empty: give the optimizer at least one parameter")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g in groups:
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError("params must be all tensors or all dicts with a 'params' key")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        out.append({**g, "params": ps})
    return out


def _check_params(params: list[Any]) -> torch.device:
    seen: set[int] = set()
    device = None
    for i, p in enumerate(params):
        what = f"params: parameter {i}"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{what} is a {type(p).__name__}, not a tensor")
        if not p.is_leaf:
            raise ValueError(f"{what} is not a leaf tensor")
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"{what} is {p.dtype}; float32, bfloat16 and float16 parameters are supported "
                "(the host steps fp32 masters)"
            )
        if p.layout != torch.strided or not (type(p) in _PLAIN or is_dtensor(p)):
            raise ValueError(
                f"{what} is a {type(p).__name__} ({p.layout}); only dense plain tensors and "
                "DTensors (FSDP2, tensor parallel) are supported"
            )
        if p.device.type == "meta":
            raise ValueError(f"{what} is on the meta device; materialize the model first")
        if id(p) in seen:
            raise ValueError(f"{what} appears twice")
        seen.add(id(p))
        if device is None:
            device = p.device
        elif p.device != device:
            raise ValueError(
                f"params: parameter 0 is on {device} and parameter {i} on {p.device}; an "
                "OffloadedOptimizer takes parameters of one device"
            )
        if p in MANAGED:
            raise ValueError(
                f"{what} is already managed by another OffloadedOptimizer; remove() that first"
            )
    assert device is not None
    return device
