"""The `Plan`: decisions with their predictions, a report, a memory plot, and `apply`."""

from __future__ import annotations

import dataclasses
import enum
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from torchoffload._placement import ActivationOffloadConfig
from torchoffload._pool import PinnedPool
from torchoffload._validate import check_int, check_number, physical_memory
from torchoffload.layers import ActivationOffloadHandle, Mode, resolve_layers
from torchoffload.planner import _report
from torchoffload.planner._cost import (
    BOTH,
    DECISIONS,
    HOST_FRACTIONS,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    STREAM,
    CostModel,
    Decision,
    Prediction,
    host_optimizer_bytes,
    param_working_bytes,
)
from torchoffload.planner._hardware import Hardware
from torchoffload.planner._search import InfeasibleBudgetError, choose_decisions, least_peak
from torchoffload.planner._trace import LayerProfile, Profile, trace

_log = logging.getLogger(__name__)


def _human(nbytes: int) -> str:
    """Bytes in GiB, or MiB below 1 GiB."""
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


class OptimizerState(str, enum.Enum):
    """Where a plan keeps the optimizer state (and the gradients, which follow it)."""

    AUTO = "auto"  # the faster placement that fits both budgets
    DEVICE = "device"
    HOST = "host"  # `OffloadedOptimizer`: gradients leave as backward finishes them

    @classmethod
    def parse(cls, value: object) -> OptimizerState:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"optimizer_state must be 'auto', 'device' or 'host', got {value!r}"
            ) from None


@dataclass(frozen=True)
class Plan:
    """A per-layer choice between keeping, offloading and recomputing activations, with what it
    is predicted to cost. Apply it with ``apply_activation_offloading(model, plan=plan)``."""

    profile: Profile = field(repr=False)
    hardware: Hardware
    budget_bytes: int | None
    decisions: tuple[Decision, ...]  # strings accepted, parsed in __post_init__
    prefetch_layers: int
    defer_layers: int
    predicted: Prediction
    baseline: Prediction
    # kept free below the budget: predicted.peak_bytes + margin_bytes <= budget_bytes (Note:
    # [The planning margin])
    margin_bytes: int = 0
    optimizer_state: OptimizerState = OptimizerState.DEVICE
    host_bytes: int = 0  # host memory the plan needs (optimizer copies, offloaded activations)
    host_budget_bytes: int | None = None
    parameters: str = "device"  # "host": streamed from pinned host memory (stream_parameters)
    parameter_budget_bytes: int = 0  # the device budget of the streamed parameters
    # with the optimizer state on the host: the fraction there (OffloadedOptimizer's)
    offload_fraction: float = 1.0
    # host bytes per trainable parameter of the optimizer on the host (None: fp32 masters and
    # gradients, the traced state in fp32; `torchoffload.optim.host_bytes_per_param`)
    host_bytes_per_param: float | None = None
    # bytes over the link per hosted parameter, each way (None: 4, fp32 gradients and new
    # values; `torchoffload.optim.link_bytes_per_param`)
    link_bytes_per_param: float | None = None

    def __post_init__(self) -> None:
        if self.parameters not in ("device", "host"):
            raise ValueError(f"parameters must be 'device' or 'host', got {self.parameters!r}")
        try:
            decisions = tuple(Decision(d) for d in self.decisions)
        except ValueError:
            raise ValueError(
                f"decisions must be among {[d.value for d in Decision]}, got {self.decisions!r}"
            ) from None
        object.__setattr__(self, "decisions", decisions)
        object.__setattr__(self, "optimizer_state", OptimizerState.parse(self.optimizer_state))

    @property
    def stream(self) -> bool:
        """Every tensor the model saves is offloaded as with `offload_activations` (reloaded
        one by one in backward): the least memory, at the link's speed."""
        return bool(self.decisions) and self.decisions[0] == STREAM

    @property
    def offload_layers(self) -> frozenset[int]:
        """Layers whose saved activations are offloaded (for "recompute+offload": its input)."""
        return frozenset(i for i, d in enumerate(self.decisions) if d in (OFFLOAD, BOTH, STREAM))

    @property
    def recompute_layers(self) -> frozenset[int]:
        return frozenset(i for i, d in enumerate(self.decisions) if d in (RECOMPUTE, BOTH))

    def apply(
        self,
        model: nn.Module,
        *,
        layers: nn.ModuleList | list[nn.Module] | str = "auto",
        pool: PinnedPool | None = None,
        device: torch.device | str | int | None = None,
    ) -> ActivationOffloadHandle:
        """Apply the plan to ``model`` (the one it was made for) until ``handle.remove()``:
        its offloaded layers are offloaded, its recomputed layers run under
        ``torch.utils.checkpoint`` (non-reentrant), the rest keep their activations. A
        "recompute+offload" layer is checkpointed and its input offloaded; a "stream" plan
        runs each forward under `offload_activations`' policy.

        Note: [Plans] A plan that offloads no layer needs none of the engine's hooks: module
        hooks on every layer and the global parameter hook cost host time in every layer's
        forward and backward, which a host-bound step pays in full (measured in the planner's
        validation, benchmarks/README.md "Planner accuracy" and the runs it links). Its handle
        only wraps the recomputed layers.
        """
        layer_list = resolve_layers(model, layers)
        if len(self.decisions) != len(layer_list):
            raise ValueError(
                f"the plan is for {len(self.decisions)} layers but the model has "
                f"{len(layer_list)}: plan and apply with the same model and layers"
            )
        config = ActivationOffloadConfig(
            prefetch_layers=self.prefetch_layers,
            defer_layers=self.defer_layers,
            skip_last_layers=0,
            min_bytes=self.profile.min_bytes,
            offload_layers=self.offload_layers,
        )
        if self.stream:
            mode = Mode.STREAM
        elif not self.offload_layers:
            mode = Mode.RECOMPUTE
        else:
            mode = Mode.LAYERS
        handle = ActivationOffloadHandle(model, layer_list, config, pool, device, mode=mode)
        handle.recompute(sorted(self.recompute_layers))
        return handle

    def stream_parameters(self, model: nn.Module, **kwargs: Any) -> Any:
        """Stream ``model``'s parameters as the plan places them (`stream_parameters` with the
        plan's parameter budget); None when the plan keeps them on the device. Call it before
        `optimizer`."""
        if self.parameters != "host":
            return None
        from torchoffload.weights import stream_parameters

        return stream_parameters(model, self.parameter_budget_bytes, **kwargs)

    def optimizer(
        self, params: Any, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """The optimizer this plan places: ``optimizer_class(params, **kwargs)`` on the device,
        or an `OffloadedOptimizer` running it on the host (``offload_fraction`` of it)."""
        if self.optimizer_state == OptimizerState.HOST:
            from torchoffload.optim import OffloadedOptimizer

            if self.offload_fraction < 1.0:
                if "offload_fraction" in kwargs:
                    raise ValueError(
                        f"offload_fraction: the plan chose {self.offload_fraction}; plan with "
                        "plan(..., offload_fraction=...) to choose another"
                    )
                if kwargs.get("max_grad_norm") is not None:
                    raise ValueError(
                        f"max_grad_norm: the plan keeps part of the optimizer state on the "
                        f"device (offload_fraction {self.offload_fraction}), which clipping by "
                        "global norm does not support yet; plan with offload_fraction=1.0"
                    )
                kwargs = {**kwargs, "offload_fraction": self.offload_fraction}
            return OffloadedOptimizer(params, optimizer_class, **kwargs)
        return optimizer_class(params, **kwargs)

    def __str__(self) -> str:
        return _report.describe(self)

    def memory_timelines(self) -> tuple[list[int], list[int]]:
        """Predicted live bytes over forward and backward: (no plan, this plan), both with the
        optimizer state and the parameters where the plan places them (as `baseline`)."""
        model = CostModel(
            self.profile, self.hardware, self.defer_layers, self.prefetch_layers,
            host_optimizer=self.optimizer_state == OptimizerState.HOST,
            host_params=self.parameters == "host", host_fraction=self.offload_fraction,
            link_bytes=self.link_bytes_per_param or 4.0,
        )  # fmt: skip
        base = model.timeline([KEEP] * len(self.decisions))
        return base, model.stream()[1] if self.stream else model.timeline(self.decisions)

    def plot(self, path: str) -> None:
        """Write a PNG of memory over one step, without a plan and with this one (needs
        matplotlib: ``pip install torchoffload[bench]``)."""
        _report.plot(self, path)


def _choose(
    profile: Profile, model: CostModel, limit: int | None
) -> tuple[list[str], Prediction, Prediction, int]:
    """The fastest activation decisions whose predicted peak is at most ``limit`` (the budget
    less the margin, Note: [The planning margin]) for one placement: (decisions, prediction,
    baseline, least peak); decisions empty when nothing fits."""
    keep = [KEEP] * model.n
    baseline = model.predict(keep)
    if limit is None or baseline.peak_bytes <= limit:
        return keep, baseline, baseline, baseline.peak_bytes
    least, least_bytes = least_peak(model)
    stream, _ = model.stream()
    floor = min(least_bytes, stream.peak_bytes) if profile.saved_storages else least_bytes
    options = []
    if least_bytes <= limit:
        # Offloading any layer installs the engine's hooks on all of them, which the greedy
        # step by step cannot weigh: so also try recomputation alone.
        for allowed in (DECISIONS, (KEEP, RECOMPUTE)):
            decisions = choose_decisions(model, limit, allowed)
            pred = model.predict(decisions)
            if pred.peak_bytes <= limit:
                options.append((pred.step_s, decisions, pred))
        if not options:  # the greedy got stuck; the least-peak decisions fit
            options.append((model.predict(least).step_s, least, model.predict(least)))
    if profile.saved_storages and stream.peak_bytes <= limit:
        options.append((stream.step_s, [STREAM] * model.n, stream))
    if not options:
        return [], baseline, baseline, floor
    _, decisions, pred = min(options, key=lambda o: o[0])
    return decisions, pred, baseline, floor


def plan_from_profile(
    profile: Profile,
    budget_bytes: int | None,
    *,
    hardware: Hardware | None = None,
    prefetch_layers: int = 1,
    defer_layers: int = 1,
    optimizer_state: str = "auto",
    host_budget_bytes: int | None = None,
    parameters: str = "auto",
    offload_fraction: float | str = "auto",
    host_bytes_per_param: float | None = None,
    link_bytes_per_param: float | None = None,
) -> Plan:
    """Choose decisions for a traced (or synthetic) profile: per layer, keep, offload or
    recompute; where the optimizer state lives (``optimizer_state``: "device", "host" or
    "auto", the faster that fits); and where the parameters live (``parameters``: "device",
    "host", streamed with `stream_parameters`, which needs the optimizer state on the host,
    or "auto": on the host only when nothing fits otherwise). ``offload_fraction``: with the
    optimizer state on the host and the parameters on the device, the fraction of it there
    (`OffloadedOptimizer`'s ``offload_fraction``; "auto": the fastest of `HOST_FRACTIONS` that
    fits, see Note: [A fraction of the state on the host]; 1.0 where the optimizer needs it
    whole, as with ``max_grad_norm`` or DTensor parameters). ``host_budget_bytes``: host
    memory the plan may use (the optimizer's host copies, the parameters' host store and the
    offloaded activations; default: this host's physical memory). ``host_bytes_per_param``:
    the host bytes of the optimizer on the host per trainable parameter, for low-precision
    host state (`torchoffload.optim.host_bytes_per_param`: 6.03 for bf16 masters and 8-bit
    AdamW moments; None: fp32 masters and gradients and the traced state in fp32).
    ``link_bytes_per_param``: the bytes of a hosted parameter's gradient and new value over
    the link, each way (`torchoffload.optim.link_bytes_per_param`: 2 for bf16 masters of bf16
    parameters; None: 4, fp32 converted on the device). Raises
    `InfeasibleBudgetError`, naming the least peak and what it is made of, when nothing fits."""
    hw = hardware or Hardware()
    for name, value in (("host_bytes_per_param", host_bytes_per_param),
                        ("link_bytes_per_param", link_bytes_per_param)):  # fmt: skip
        if value is not None:
            check_number(name, value)
    where = OptimizerState.parse(optimizer_state)
    _check_parameters(parameters, where)
    fractions = _fractions(offload_fraction)
    # Note: [The default host budget] With no host budget given, the plan is for this machine
    # where one fits its memory; where none does but one fits the device, that plan is
    # returned with its host need stated and a warning (planning for a bigger host, as for a
    # 70B model on a laptop, is what the planner is for). A host budget given is a limit: a
    # plan that needs more is refused.
    # See Note: [The planning margin]
    margin = 0 if budget_bytes is None else hw.margin(budget_bytes)
    limit = None if budget_bytes is None else budget_bytes - margin
    machine = host_budget_bytes is None
    if machine:
        host_budget_bytes = physical_memory()
    else:
        check_int("host_budget_bytes", host_budget_bytes, minimum=0)
    placements, stepped, auto = _placements(profile, where, parameters)
    tried = []

    def attempt(host: bool, params: bool, fraction: float = 1.0) -> None:
        model = CostModel(profile, hw, defer_layers, prefetch_layers, host_optimizer=host,
                          host_params=params, host_fraction=fraction,
                          link_bytes=link_bytes_per_param or 4.0)  # fmt: skip
        decisions, pred, baseline, floor = _choose(profile, model, limit)
        host_need = (
            (host_optimizer_bytes(profile, fraction, host_bytes_per_param) if host else 0)
            + (profile.param_bytes if params else 0)
            + pred.offloaded_bytes
        )
        tried.append(((host, params, fraction), decisions, pred, baseline, floor, host_need))

    for host, params in placements:
        for fraction in fractions if host and not params else (1.0,):
            attempt(host, params, fraction)
    fits = [t for t in tried if t[1] and t[5] <= host_budget_bytes]
    if not fits and auto:
        attempt(stepped, True)
        fits = [t for t in tried if t[1] and t[5] <= host_budget_bytes]
    if not fits and machine:
        fits = [t for t in tried if t[1]]  # fits the device: returned with a warning
    if not fits:
        raise InfeasibleBudgetError(
            _refusal(
                profile, hw, budget_bytes, host_budget_bytes, tried, margin, host_bytes_per_param
            )  # fmt: skip
        )
    # the fastest; among equals, the least on the device
    (host, params, fraction), decisions, pred, baseline, _, host_need = min(
        fits, key=lambda t: (t[2].step_s, t[0][:2], -t[0][2])
    )
    for i, d in enumerate(decisions):
        _log.debug("layer %d: %s", i, d)
    if host_need > host_budget_bytes:
        warnings.warn(
            f"the plan needs {_human(host_need)} of host memory, more than this machine's "
            f"{_human(host_budget_bytes)}: it is for a machine with that much (give "
            "host_budget_bytes, --host-budget on the command line, to plan within a limit)",
            stacklevel=2,
        )
    return Plan(
        profile=profile,
        hardware=hw,
        budget_bytes=budget_bytes,
        decisions=tuple(decisions),
        prefetch_layers=prefetch_layers,
        defer_layers=defer_layers,
        predicted=pred,
        baseline=baseline,
        margin_bytes=margin,
        optimizer_state=OptimizerState.HOST if host else OptimizerState.DEVICE,
        host_bytes=host_need,
        host_budget_bytes=host_budget_bytes,
        parameters="host" if params else "device",
        parameter_budget_bytes=param_working_bytes(profile) if params else 0,
        offload_fraction=fraction if host else 1.0,
        host_bytes_per_param=host_bytes_per_param,
        link_bytes_per_param=link_bytes_per_param,
    )


def _placements(
    profile: Profile, where: OptimizerState, parameters: str
) -> tuple[list[tuple[bool, bool]], bool, bool]:
    """The placements to try, each (optimizer state on the host, parameters on the host);
    whether the trainable parameters are stepped (their state is counted); and whether
    parameters go to the host when nothing else fits (``parameters="auto"``)."""
    placements = {
        OptimizerState.AUTO: [(False, False), (True, False)],
        OptimizerState.DEVICE: [(False, False)],
        OptimizerState.HOST: [(True, False)],
    }[where]  # fmt: skip
    if not profile.trainable_numel or not profile.optimizer_bytes:
        placements = [(False, False)]  # no optimizer state counted: nothing to place
    # Trainable streamed parameters are stepped in the host store by an OffloadedOptimizer:
    # they go to the host with the optimizer state (or when none is trainable).
    stepped = bool(profile.trainable_numel and profile.optimizer_bytes)
    streamable = stepped or not profile.trainable_numel
    if parameters == "host":
        if not streamable:
            raise ValueError(
                "parameters='host': the profile counts no optimizer state for its trainable "
                "parameters (traced with optimizer='none'); streamed trainable parameters are "
                "stepped on the host by an OffloadedOptimizer: trace with optimizer='adamw' or "
                "'sgd' (--optimizer on the command line)"
            )
        placements = [(stepped, True)]
    # "auto": parameters go to the host only when nothing else fits (tried last, if needed)
    auto = parameters == "auto" and where != OptimizerState.DEVICE and streamable
    return placements, stepped, auto


def _fractions(offload_fraction: object) -> tuple[float, ...]:
    if offload_fraction == "auto":
        return HOST_FRACTIONS
    if (
        isinstance(offload_fraction, bool)
        or not isinstance(offload_fraction, (int, float))
        or not 0.0 < offload_fraction <= 1.0
    ):
        raise ValueError(
            f"offload_fraction must be 'auto' or a number in (0, 1], got {offload_fraction!r}"
        )
    return (float(offload_fraction),)


def _check_parameters(parameters: object, where: OptimizerState) -> None:
    if parameters not in ("auto", "device", "host"):
        raise ValueError(f"parameters must be 'auto', 'device' or 'host', got {parameters!r}")
    if parameters == "host" and where == OptimizerState.DEVICE:
        raise ValueError(
            "parameters='host' needs optimizer_state 'host' or 'auto': streamed trainable "
            "parameters are stepped in the host store by an OffloadedOptimizer"
        )


def _refusal(profile, hw, budget_bytes, host_budget_bytes, tried, margin, per_param) -> str:
    g = _human
    p = profile
    held = g(host_optimizer_bytes(p, 1.0, per_param))
    kind = "fp32 " if per_param is None else ""
    parts = []
    for (host, params, fraction), decisions, _, _, floor, host_need in tried:
        if fraction < 1.0:  # a part on the device: between the whole on the host and none
            continue
        if params:
            what = (
                f"with the parameters streamed from the host (and the optimizer state there) "
                f"it needs at least {g(floor)} on the device, and {g(host_need)} of host "
                f"memory: the parameters' store {g(p.param_bytes)}"
                + (f" and {held} for the {kind}master weights, gradients and state" if host else "")
            )
        elif host:
            what = (
                f"with the optimizer state on the host (gradients leave the device as backward "
                f"finishes them) it needs at least {g(floor)} on the device, where the "
                f"parameters alone take {g(p.param_bytes)}, and {held} of host memory for "
                f"the {kind}master weights, gradients and state"
            )
        else:
            what = (
                f"with the optimizer state on the device this step needs at least {g(floor)}; "
                f"parameters, gradients and optimizer state alone take {g(p.static_bytes)} "
                f"(parameters {g(p.param_bytes)}, gradients {g(p.grad_bytes)}, optimizer "
                f"{g(p.optimizer_bytes)})"
            )
        if decisions and host_need > host_budget_bytes:
            what += f"; that fits the device but needs {g(host_need)} of host memory"
        parts.append(what)
    budget = "no device budget" if budget_bytes is None else f"budget {g(budget_bytes)}"
    tail = ""
    streamed = any(params for (_, params, _), *_ in tried)
    if (
        not streamed
        and budget_bytes is not None
        and p.param_bytes + hw.workspace_bytes + margin > budget_bytes
    ):
        tail = (
            " The parameters alone do not fit: allow them on the host "
            "(parameters='auto' or 'host', --parameters on the command line)."
        )
    return (
        f"{budget} (host budget {g(host_budget_bytes)}) is too small even with every layer "
        "offloaded or recomputed: " + "; ".join(parts) + f". The device's workspaces take "
        f"{g(hw.workspace_bytes)}; without a plan the peak is {g(tried[0][3].peak_bytes)}."
        + (
            f" A plan keeps {g(margin)} of the budget free for what the model does not count "
            "(the planning margin, Hardware.margin_bytes and margin_fraction)."
            if margin
            else ""
        )
        + tail
    )


def plan(
    model: nn.Module,
    example_inputs: Sequence[Any] | dict[str, Any],
    *,
    budget_bytes: int | None,
    link_gbps: float | None = None,
    compute_tflops: float | None = None,
    layers: nn.ModuleList | list[nn.Module] | str = "auto",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: Literal["adamw", "sgd", "none"] = "adamw",
    min_bytes: int = 1 << 16,
    prefetch_layers: int = 1,
    defer_layers: int = 1,
    progress: Callable[[str], None] | None = None,
    optimizer_state: str = "auto",
    host_budget_bytes: int | None = None,
    parameters: str = "auto",
    offload_fraction: float | str = "auto",
    host_bytes_per_param: float | None = None,
    host_step_params_per_s: float | None = None,
    link_bytes_per_param: float | None = None,
) -> Plan:
    """Trace one training step of ``model`` under fake tensors (`trace`) and choose, per layer,
    whether to keep, offload or recompute its activations so that the predicted peak stays
    within ``budget_bytes`` at the least predicted step time, and where the optimizer state
    lives (``optimizer_state``, ``host_budget_bytes``, ``parameters``, ``offload_fraction``,
    ``host_bytes_per_param``, ``link_bytes_per_param``: see `plan_from_profile`).

    ``link_gbps`` and ``compute_tflops``: None measures them on this machine's GPU, or takes
    the defaults of one H200 on a machine without one. ``host_step_params_per_s``: the host
    step's rate (`torchoffload.optim.measure_host_step` of the class and host state the
    optimizer will use; None: ``Hardware.host_adam_params_per_s``, fused fp32 AdamW on 16
    cores). See Notes: [How a plan changes memory] and [How a plan changes time];
    `print(plan)` shows the decisions and predictions.
    """
    if budget_bytes is not None:
        check_int("budget_bytes", budget_bytes, minimum=1)
    _check_parameters(parameters, OptimizerState.parse(optimizer_state))  # before tracing
    _fractions(offload_fraction)
    if host_budget_bytes is not None:
        check_int("host_budget_bytes", host_budget_bytes, minimum=0)
    for name, value in (("prefetch_layers", prefetch_layers), ("defer_layers", defer_layers)):
        check_int(name, value, minimum=0)
    for name, value in (("link_gbps", link_gbps), ("compute_tflops", compute_tflops),
                        ("host_step_params_per_s", host_step_params_per_s)):  # fmt: skip
        if value is not None:
            check_number(name, value)
    profile = trace(
        model,
        example_inputs,
        layers=layers,
        loss_fn=loss_fn,
        optimizer=optimizer,
        min_bytes=min_bytes,
        progress=progress,
    )
    hw = Hardware.detect(link_gbps, compute_tflops)
    if host_step_params_per_s is not None:
        hw = dataclasses.replace(hw, host_adam_params_per_s=host_step_params_per_s)
    return plan_from_profile(
        profile, budget_bytes, hardware=hw, prefetch_layers=prefetch_layers,
        defer_layers=defer_layers, optimizer_state=optimizer_state,
        host_budget_bytes=host_budget_bytes, parameters=parameters,
        offload_fraction=offload_fraction, host_bytes_per_param=host_bytes_per_param,
        link_bytes_per_param=link_bytes_per_param,
    )  # fmt: skip


def synthetic_profile(
    *,
    layers: int,
    saved_bytes: int,
    fwd_flops: int,
    static_bytes: int = 0,
    input_bytes: int = 0,
) -> Profile:
    """A profile of ``layers`` identical layers without tracing: each saves ``saved_bytes`` in
    forward (freed in its backward) and does ``fwd_flops`` forward, twice that backward. For
    tests and what-ifs."""
    timeline = [static_bytes]
    live = static_bytes
    fwd_end = []
    for _ in range(layers):
        live += saved_bytes
        timeline.append(live)
        fwd_end.append(len(timeline) - 1)
    forward_end = len(timeline) - 1
    bwd_start = [0] * layers
    for i in range(layers - 1, -1, -1):
        bwd_start[i] = len(timeline) - 1
        live -= saved_bytes
        timeline.append(live)
    backward_end = len(timeline) - 1
    layer_profiles = tuple(
        LayerProfile(i, f"layers.{i}", saved_bytes, saved_bytes, saved_bytes - input_bytes,
                     input_bytes, input_bytes if i else 0, (), fwd_flops, 2 * fwd_flops)
        for i in range(layers)
    )  # fmt: skip
    return Profile(
        layers=layer_profiles,
        timeline=tuple(timeline),
        fwd_end=tuple(fwd_end),
        bwd_start=tuple(bwd_start),
        step_marks={
            "forward_end": forward_end,
            "backward_end": backward_end,
            "step_end": backward_end,
        },
        param_bytes=static_bytes,
        grad_bytes=0,
        optimizer_bytes=0,
        outside_fwd_flops=0,
        outside_bwd_flops=0,
        outside_saved_bytes=0,
        tokens=None,
        description="synthetic",
    )
