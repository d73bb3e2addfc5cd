"""`OffloadedOptimizer`: any `torch.optim` optimizer class, stepped on the host."""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from torchoffload._hosted import HOSTED, MANAGED
from torchoffload.optim._ahead import hook_model
from torchoffload.optim._build import (
    check_host_groups,
    check_optimizer_class,
    check_params,
    check_supported,
    clip_order,
    config_of,
    host_part,
    param_groups_of,
)
from torchoffload.optim._checks import GroupsCheck
from torchoffload.optim._config import OptimizerOffloadConfig, OptimizerStats
from torchoffload.optim._device import DeviceStep
from torchoffload.optim._grads import MovedGrad
from torchoffload.optim._params import GroupsInPlace, hyper, storage_families
from torchoffload.optim._runtime import HostStepRuntime, close_soon
from torchoffload.optim._state import (
    device_master,
    entry_of,
    host_master,
    load_state,
    state_dict_of,
    stats_of,
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

    During backward each gradient leaves the device as soon as it is final and the host steps
    its bucket meanwhile. Those steps are speculative (Note: [Steps taken during backward]):
    their new values reach the device parameters only when `step()` commits them, and they are
    undone exactly when the loop does what they did not foresee, so every loop ends each step
    bitwise where torch.optim ends it. Until `step()`, ``param.grad`` holds a `MovedGrad`; an
    operation on it (``clip_grad_norm_`` on the model, a norm for logging, a second backward
    without `accumulating()`, as accelerate and Hugging Face ``Trainer`` accumulate) brings the
    gradients back to the device and runs on them (Notes: [Reading a moved gradient], [A
    second backward]): exact, but that bucket loses the overlap. ``max_grad_norm`` (the
    config) clips on the host instead. LR schedulers, `state_dict`/`load_state_dict` (in the
    plain class's format, each fp32 master in its parameter's state entry), `zero_grad` in
    both forms, step hooks and state-dict hooks work as with the plain class.
    `step()` consumes the gradients (they left the device): afterwards
    ``param.grad`` holds a `ConsumedGrad` that raises when read or accumulated into, so a loop
    calls `zero_grad()` between `step()` and the next backward, as torch.optim loops do; one
    that does not is refused before anything changes (Note: [The gradient after step()]).
    `torch.amp.GradScaler` works as with the plain class (``scaler.step(opt)``, ``unscale_``):
    the host unscales and checks the moved gradients, steps taken with the scaled gradients
    are undone first, and once a scaler was seen the host steps at `step()` (Note: [Loss
    scaling]).

    ``params``: parameters (or param groups) of one device; ``config``: an
    `OptimizerOffloadConfig`, whose fields may also be passed by keyword; ``model``: the
    module these parameters belong to, needed by ``step_ahead`` (its forward waits for the
    step) and used by ``max_grad_norm`` (the norm is summed as ``clip_grad_norm_(
    model.parameters())`` sums it: Note: [The order of the clipping norm]).
    """

    param_groups = GroupsInPlace()  # Note: [The param groups the host steps]

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        config: OptimizerOffloadConfig | None = None,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ):
        check_optimizer_class(optimizer_class, OffloadedOptimizer)
        config = config_of(config, kwargs)
        groups = param_groups_of(params)
        flat = [p for g in groups for p in g["params"]]
        device = check_params(flat)
        check_supported(config, flat, model, optimizer_class)
        # The class's defaults, and its own check of the keyword arguments.
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **kwargs)
        self._building = True
        super().__init__(groups, probe.defaults)
        self._building = False
        self.config = config
        self._groups = GroupsCheck(self.param_groups)
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        families = storage_families(flat)
        on_host = host_part(flat, config.offload_fraction, families)
        self._groups.check_host({group_of[i] for i, h in enumerate(on_host) if h})
        # Indices, in the optimizer's parameter order, of the host part's parameters and of
        # the device part's (Note: [Which parameters stay on the device]).
        self._host_index = [i for i, h in enumerate(on_host) if h]
        self._device = None
        if not all(on_host):
            kept = [i for i, h in enumerate(on_host) if not h]
            self._device = DeviceStep(
                [flat[i] for i in kept], kept, [group_of[i] for i in kept], self.param_groups,
                optimizer_class, kwargs, [families[i] for i in kept],
            )  # fmt: skip
        rank = clip_order(flat, model)
        self._runtime = HostStepRuntime(
            [flat[i] for i in self._host_index], [group_of[i] for i in self._host_index],
            self.param_groups, optimizer_class, kwargs, config, device, self._host_index,
            clip_order=[rank[i] for i in self._host_index],
        )  # fmt: skip
        if self._device is not None:
            self._runtime.kept_on_device = self._device.params
            self._runtime.host.requires_grad_fixed = True
            self._runtime.kept_numbering = self._device.index
            self._runtime.recalls.device_refusal = self._device.refusal
            self._runtime.hook_kept()
            for p in self._device.params:
                MANAGED[p] = self._runtime
        self._runtime.recalls.groups_refusal = self._groups
        self._finalizer = weakref.finalize(self, close_soon, self._runtime)
        self._forward_hooks = []
        if config.step_ahead:
            rt = self._runtime
            self._forward_hooks = hook_model(model, flat, rt.ahead, rt.before_state_dict)
        # GradScaler unscales through its own unscale_ (Note: [Loss scaling]): no
        # _step_supports_amp_scaling, whose path hands step() a scale after the host may
        # have stepped.

    # - The optimizer API
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Finish the host step (waiting for the buckets still running on the host) and make
        the compute stream wait on the uploads of the new values (no host sync)."""
        _refuse_step_arguments(self, closure)
        self._groups.refuse()
        rt = self._live()
        dev = self._device
        if dev is None:
            rt.step()
            return
        dev.check()  # its refusals come before the host part commits anything
        # Queued on the compute stream once the host part's last buckets are on their way
        # (their copies do not wait for it), while the host finishes its own.
        hyper_now = [hyper(g) for g in self.param_groups]
        rt.step(between=lambda: dev.step(hyper_now))

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
        a zero gradient (Note: [The gradient after step()]). Steps the host took during
        backward are undone: without `step()` nothing changes, as with torch.optim."""
        rt = self._live()
        self._groups.refuse()
        params = [p for group in self.param_groups for p in group["params"]]
        if not set_to_none:
            _refuse_streamed_zeros(params)
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
        return self._live().dispatch.accumulating()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(
                "OffloadedOptimizer cannot add a param group after construction: build it with "
                "every group"
            )
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The plain optimizer class's state dict (host tensors), with the fp32 master of
        each parameter that is not its own master in its state entry, as
        ``"torchoffload_master"`` (Note: [The fp32 master in the state dict]). A parameter
        changed in place since the last step has its master read again first, as the next
        step would: the masters round to the parameters as they are now. Its hooks
        (``register_state_dict_pre_hook``/``_post_hook``) run as the plain class runs them."""
        self._live().check_idle("state_dict()")
        self._groups.refuse()
        return _hooked_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class (an earlier version's too) or of the plain class.
        Masters come from it when present (they must round to the parameters: load the model's
        first), else from the parameters (Note: [The fp32 master in the state dict]). Its
        hooks (``register_load_state_dict_pre_hook``/``_post_hook``) run as the plain class
        runs them."""
        self._live().check_idle("load_state_dict()")
        self._groups.refuse()
        _hooked_load(self, state_dict)

    @property
    def state(self) -> Mapping[torch.Tensor, Mapping[str, Any]]:  # type: ignore[override]
        """Each parameter's state, read-only (`HostStateView`): see `load_state_dict()`."""
        return HostStateView(self)

    @state.setter
    def state(self, value: Any) -> None:  # allowed in torch.optim.Optimizer.__init__ only
        if not getattr(self, "_building", False):
            _refuse_state()

    # - torchoffload
    def stats(self) -> OptimizerStats:
        self._live().settle()
        return stats_of(self._runtime, self._device)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm of the last step (with ``max_grad_norm``), before clipping."""
        (rt := self._live()).settle()
        return rt.stepper.grad_norm

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


_STATE_READ_ONLY = (
    "OffloadedOptimizer.state is a read-only view of the state the host steps: change it "
    'with load_state_dict() (to start it over, load a state_dict() whose "state" is {})'
)


def _refuse_state(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(_STATE_READ_ONLY)


class HostStateView(Mapping):
    """`OffloadedOptimizer.state`: parameter -> the optimizer class's state of it (a
    read-only mapping of host tensors, device ones for the device part), for the parameters
    that have one, as the plain class's ``state`` holds them; refused between the final
    backward and `step()`, as `state_dict()` is. Its truth, length and keys are the plain
    class's: code that looks at them (`torch.distributed.checkpoint`'s
    ``get_optimizer_state_dict`` takes an empty one for an optimizer never stepped, and steps
    it once with zero gradients) sees what it would see. An entry also holds the parameter's
    fp32 master when it is not the parameter itself, as `state_dict()` does (Note: [The fp32
    master in the state dict]: DCP's flattened state dicts are put back together by these
    keys); a lookup of a parameter that has no state but such a master gives the master alone.
    Writes are refused (they were silently dropped: the host never read this dict)."""

    def __init__(self, opt: OffloadedOptimizer):
        self._opt = opt

    def _entries(self) -> dict[torch.Tensor, Any]:
        """The whole mapping (iteration, length); a lookup reads one entry (`_place`)."""
        opt = self._opt
        rt = opt._live()
        rt.check_idle("reading optimizer.state")  # and no copy aside ahead: it may be edited
        out: dict[torch.Tensor, Any] = {}
        for rec in rt.records:
            st = rt.buckets[rec.entry.bucket].optimizer.state.get(rec.master)
            if st:
                out[rec.param] = _view(st, rec.param, host_master(rec))
        dev = opt._device
        if dev is not None:
            for k, (p, master) in enumerate(zip(dev.params, dev.masters, strict=True)):
                st = dev.optimizer.state.get(master)
                if st:
                    out[p] = _view(st, p, device_master(dev, k))
        return out

    def __getitem__(self, param: torch.Tensor) -> Mapping[str, Any]:
        # O(1): the state is read where the optimizer class keeps it, at every lookup
        self._opt._live().check_idle("reading optimizer.state")
        place = self._place(param)
        if place is None:
            raise KeyError(param)
        optimizer, master, own = place
        return _view(optimizer.state.get(master), param, own)  # {}: not stepped yet

    def _place(self, param: torch.Tensor) -> tuple[Any, torch.Tensor, Any] | None:
        """The optimizer (a host bucket's or the device part's) that steps ``param``, the
        master it keys the state by, and that master unless it is the parameter's own bits:
        fixed at construction."""
        rt, dev = self._opt._runtime, self._opt._device
        i = rt.host.index.get(id(param))
        if i is not None and rt.records[i].param is param:
            rec = rt.records[i]
            return rt.buckets[rec.entry.bucket].optimizer, rec.master, host_master(rec)
        k = None if dev is None else dev.position.get(id(param))
        if k is not None and dev.params[k] is param:
            return dev.optimizer, dev.masters[k], device_master(dev, k)
        return None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse_state

    def __repr__(self) -> str:
        return f"HostStateView({len(self)} parameters with state)"


def _view(state: Any, param: torch.Tensor, master: Any) -> Mapping[str, Any]:
    """A read-only view of ``param``'s state and its ``master`` (None: its own), as
    `state_dict()` gives them (Notes: [The state of a DTensor parameter], [The fp32 master in
    the state dict])."""
    return types.MappingProxyType(entry_of(state, param, master))


def _refuse_streamed_zeros(params: list[torch.Tensor]) -> None:
    """Refuse ``zero_grad(set_to_none=False)`` for parameters streamed by
    `stream_parameters`."""
    if any(p in HOSTED for p in params):
        raise ValueError(
            "zero_grad(set_to_none=False): not supported for parameters streamed by "
            "stream_parameters (outside its unit such a parameter has no shape for the "
            "zeros to take); call zero_grad() (set_to_none=True)"
        )


def _refuse_step_arguments(opt: OffloadedOptimizer, closure: Any) -> None:
    """Refuse a closure and GradScaler's ``grad_scale``/``found_inf`` path."""
    if closure is not None:
        raise ValueError("OffloadedOptimizer.step does not take a closure")
    if any(getattr(opt, k, None) is not None for k in ("grad_scale", "found_inf")):
        raise RuntimeError(
            "OffloadedOptimizer.step: grad_scale/found_inf are not supported; let "
            "torch.amp.GradScaler unscale (scaler.step(optimizer)). See Note: [Loss scaling]"
        )


def _hooked_state_dict(opt: OffloadedOptimizer) -> dict[str, Any]:
    """`state_dict()` of an idle ``opt`` between its state-dict hooks, as
    `torch.optim.Optimizer.state_dict` runs them (a post-hook may return another dict)."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    out = state_dict_of(opt._runtime, opt._device, opt._host_index, opt.param_groups)
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, out)
        out = out if result is None else result
    return out


def _hooked_load(opt: OffloadedOptimizer, state_dict: dict[str, Any]) -> None:
    """`load_state_dict()` into an idle ``opt`` between its load hooks, as
    `torch.optim.Optimizer.load_state_dict` runs them (on a shallow copy; a pre-hook may
    return another dict)."""
    state_dict = state_dict.copy()
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        state_dict = state_dict if result is None else result
    check_host_groups(list(state_dict.get("param_groups", ())), opt._groups.host)  # first
    load_state(opt._runtime, opt._device, opt._host_index, opt.param_groups, state_dict,
               opt.defaults)  # fmt: skip
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def _zeros_like(p: torch.Tensor) -> torch.Tensor:
    """Zeros laid out as autograd lays out a gradient of ``p`` (its strides when they are
    dense), from its metadata only: a parameter still being stepped ahead need not wait."""
    with torch.no_grad():
        return torch.zeros_like(p, memory_format=torch.preserve_format)
