"""What `OffloadedOptimizer` computes from its arguments before it builds anything: its
config, its param groups, the checks of its parameters and optimizer class, which parameters
the host steps and each parameter's place in the clipping norm."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from torchoffload._hosted import HOSTED, MANAGED, HostedParameter
from torchoffload.optim._config import OptimizerOffloadConfig
from torchoffload.optim._params import is_dtensor, local

_CONFIG_FIELDS = frozenset(OptimizerOffloadConfig.__dataclass_fields__)
_PLAIN = (torch.Tensor, torch.nn.Parameter, HostedParameter)  # Note: [Placeholders never answer]


def check_optimizer_class(optimizer_class: Any, offloaded: type) -> None:
    """Refuse what is not a `torch.optim.Optimizer` class the host can step (``offloaded``:
    `OffloadedOptimizer` itself)."""
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    if issubclass(optimizer_class, offloaded):
        raise TypeError(
            "optimizer_class must be the class to run on the host, not OffloadedOptimizer"
        )
    if _needs_closure(optimizer_class):
        raise ValueError(
            f"{optimizer_class.__name__}.step needs a closure (it evaluates the loss again), "
            "which the host step cannot run: the model and its gradients are on the device. "
            "Use an optimizer whose step takes no closure (AdamW, SGD, Adam, ...)"
        )
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        raise ValueError(
            "SparseAdam steps sparse gradients only, and the host receives dense ones (a sparse "
            "gradient is refused at backward): use Adam or AdamW"
        )


def config_of(config: Any, kwargs: dict[str, Any]) -> OptimizerOffloadConfig:
    """The config: ``config``, or one built from the config fields passed by keyword (taken
    out of ``kwargs``, which keeps the optimizer class's)."""
    config_fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_FIELDS}
    if config is None:
        return OptimizerOffloadConfig(**config_fields)
    if not isinstance(config, OptimizerOffloadConfig):
        raise TypeError(f"config must be an OptimizerOffloadConfig, got {type(config).__name__}")
    if config_fields:
        raise TypeError(f"pass {sorted(config_fields)} in config, not beside it")
    return config


def check_supported(
    config: OptimizerOffloadConfig,
    params: list[torch.Tensor],
    model: Any,
    optimizer_class: type | None = None,
) -> None:
    """Refuse the combinations of ``config``, parameters, ``model`` and ``optimizer_class``
    not supported (yet)."""
    check_master_dtype(config, params, optimizer_class)
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if config.step_ahead and model is None:
        raise ValueError(
            "step_ahead needs model=: the module whose forward reads the parameters "
            "(its forward waits for the parameters still being stepped)"
        )
    if config.step_ahead and any(p in HOSTED for p in params):
        raise ValueError(
            "step_ahead: not supported for parameters streamed by stream_parameters (their "
            "next forward loads them from the host store the step is writing)"
        )
    if config.step_ahead and any(is_dtensor(p) for p in params):
        raise ValueError("step_ahead: not supported for DTensor parameters (FSDP2, TP)")
    if config.max_grad_norm is not None and any(is_dtensor(p) for p in params):
        raise ValueError(
            "max_grad_norm: not supported for DTensor parameters (FSDP2, tensor parallel) "
            "yet; their gradients stay on the device until step(), so clip them with "
            "torch.nn.utils.clip_grad_norm_ before calling step()"
        )
    if config.offload_fraction < 1.0:
        why = None
        if any(is_dtensor(p) for p in params):
            why = "DTensor parameters (FSDP2, tensor parallel)"
        elif any(p in HOSTED for p in params):
            why = "parameters streamed by stream_parameters"
        elif config.max_grad_norm is not None:
            why = "max_grad_norm (the norm would span host and device gradients)"
        if why is not None:
            raise ValueError(f"offload_fraction < 1: not supported yet with {why}")


def capturable_refusal(groups: list[Any], host_groups: set[int]) -> str | None:
    """Why ``groups`` (param groups, or a state dict's) cannot be stepped on the host, or None:
    ``capturable=True`` in a group holding a parameter the host steps keeps the step count on
    the device for CUDA graphs, and torch's optimizers refuse it for CPU tensors (at the first
    step, after the backward)."""
    for g in sorted(host_groups):
        if g < len(groups) and isinstance(groups[g], dict) and groups[g].get("capturable"):
            return (
                f"capturable=True (param group {g}): the host steps this group's parameters on "
                "the CPU, where torch's optimizers refuse capturable; drop it (the host step is "
                "never captured in a CUDA graph)"
            )
    return None


def check_host_groups(groups: list[dict[str, Any]], host_groups: set[int]) -> None:
    """Refuse, before anything is hooked, options the host step cannot honour
    (`capturable_refusal`)."""
    message = capturable_refusal(groups, host_groups)
    if message is not None:
        raise ValueError(message)


def check_master_dtype(
    config: OptimizerOffloadConfig, params: list[torch.Tensor], optimizer_class: type | None
) -> None:
    """Refuse what ``master_dtype=torch.bfloat16`` cannot take: float16 parameters, no
    bfloat16 one, an optimizer class that does not say it steps bf16 masters without losing
    updates, and what is not supported with it yet."""
    if config.master_dtype == torch.float32:
        return
    mode = "master_dtype=torch.bfloat16"
    for i, p in enumerate(params):
        if p.dtype == torch.float16:
            raise ValueError(
                f"{mode}: parameter {i} is torch.float16, whose range needs an fp32 master; "
                "use master_dtype=torch.float32, or convert the model to bfloat16"
            )
    if not any(p.dtype == torch.bfloat16 for p in params):
        raise ValueError(
            f"{mode}: no parameter is bfloat16 (a float32 parameter keeps its fp32 master); "
            "convert the model to bfloat16 first"
        )
    if optimizer_class is not None and not getattr(optimizer_class, "supports_bf16_master", False):
        raise ValueError(
            f"{mode}: {optimizer_class.__name__} would step the bf16 masters in bf16 and lose "
            "the updates smaller than half a bf16 step (torch.optim classes round to nearest "
            "and keep bf16 state); use torchoffload.optim.AdamW8bit or LowPrecisionAdamW "
            "(stochastic rounding or a compensation term), or a class that sets "
            "supports_bf16_master = True. See Note: [Updating a bf16 parameter]"
        )
    if config.offload_fraction < 1.0:
        raise ValueError(f"{mode}: not supported yet with offload_fraction < 1")
    trainable = {p.dtype for p in params if p.requires_grad}
    if config.max_grad_norm is not None and len(trainable) > 1:
        raise ValueError(
            f"{mode}: max_grad_norm is not supported yet over parameters of several dtypes "
            f"({sorted(str(d) for d in trainable)}): clip_grad_norm_ sums their norms grouped "
            "by dtype, the host in parameter order"
        )


def param_groups_of(params: Any) -> list[dict[str, Any]]:
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


def check_params(params: list[Any]) -> torch.device:
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


def host_part(params: list[torch.Tensor], fraction: float, families: list[int]) -> list[bool]:
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


def clip_order(params: list[torch.Tensor], model: torch.nn.Module | None) -> list[int]:
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
