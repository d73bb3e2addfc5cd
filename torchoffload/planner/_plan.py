"""The `Plan`: decisions with their predictions, a report, a memory plot, and `apply`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from torchoffload._placement import ActivationOffloadConfig
from torchoffload._pool import PinnedPool
from torchoffload._validate import check_int, check_number
from torchoffload.layers import ActivationOffloadHandle, Mode, resolve_layers
from torchoffload.planner._cost import (
    BOTH,
    DECISIONS,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    STREAM,
    CostModel,
    Decision,
    Prediction,
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

    def __post_init__(self) -> None:
        try:
            decisions = tuple(Decision(d) for d in self.decisions)
        except ValueError:
            raise ValueError(
                f"decisions must be among {[d.value for d in Decision]}, got {self.decisions!r}"
            ) from None
        object.__setattr__(self, "decisions", decisions)

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
        validation, benchmarks/README.md). Its handle only wraps the recomputed layers.
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

    def __str__(self) -> str:
        mib = 2**20
        gib = 2**30 if self.baseline.peak_bytes >= 2**30 else 2**20
        unit = "GiB" if gib == 2**30 else "MiB"
        p, hw = self.profile, self.hardware
        lines = [
            f"torchoffload plan for {p.description}: {len(p.layers)} layers"
            + (f", {p.tokens} tokens per step" if p.tokens else ""),
            f"hardware: link {hw.link_gbps:.1f} GB/s each way, {hw.compute_tflops:.0f} TFLOP/s x "
            f"{hw.efficiency:.2f} efficiency ({hw.source})",
            "",
            f"{'layer':>5}  {'saved MiB':>10}  {'offloadable':>11}  {'fwd GFLOP':>10}  "
            f"{'bwd GFLOP':>10}  decision",
        ]
        for layer, decision in zip(p.layers, self.decisions, strict=True):
            lines.append(
                f"{layer.index:>5}  {layer.saved_bytes / mib:>10.1f}  "
                f"{layer.offloadable_bytes / mib:>11.1f}  {layer.fwd_flops / 1e9:>10.1f}  "
                f"{layer.bwd_flops / 1e9:>10.1f}  {decision}"
            )
        b, q = self.baseline, self.predicted
        lines += [
            "",
            f"static: parameters {p.param_bytes / gib:.2f} {unit}, gradients "
            f"{p.grad_bytes / gib:.2f} {unit}, optimizer state "
            f"{p.optimizer_bytes / gib:.2f} {unit}",
            f"saved activations: {p.saved_bytes / gib:.2f} {unit} per step "
            f"({p.outside_saved_bytes / gib:.2f} outside the layers)",
            f"{'':<14}{'peak ' + unit:>10}{'step ms':>10}{'fwd ms':>9}{'bwd ms':>9}{'opt ms':>9}"
            f"{'offloaded ' + unit:>15}",
        ]
        for name, pr in (("no plan", b), ("this plan", q)):
            lines.append(
                f"{name:<14}{pr.peak_bytes / gib:>10.2f}{pr.step_s * 1e3:>10.1f}"
                f"{pr.forward_s * 1e3:>9.1f}{pr.backward_s * 1e3:>9.1f}{pr.optimizer_s * 1e3:>9.1f}"
                f"{pr.offloaded_bytes / gib:>15.2f}"
            )
        if self.budget_bytes is not None:
            lines.append(f"budget {self.budget_bytes / gib:.2f} {unit}")
        counts = {d: self.decisions.count(d) for d in (*DECISIONS, STREAM)}
        lines.append(
            f"decisions: keep {counts[KEEP]}, offload {counts[OFFLOAD]}, recompute "
            f"{counts[RECOMPUTE]}, recompute+offload {counts[BOTH]}"
            + (
                " (stream: the whole model under offload_activations)"
                if self.stream
                else f" (prefetch {self.prefetch_layers}, defer {self.defer_layers})"
            )
        )
        return "\n".join(lines)

    def memory_timelines(self) -> tuple[list[int], list[int]]:
        """Predicted live bytes over forward and backward: (no plan, this plan)."""
        model = CostModel(self.profile, self.hardware, self.defer_layers, self.prefetch_layers)
        base = model.timeline([KEEP] * len(self.decisions))
        return base, model.stream()[1] if self.stream else model.timeline(self.decisions)

    def plot(self, path: str) -> None:
        """Write a PNG of memory over one step, without a plan and with this one (needs
        matplotlib: ``pip install torchoffload[bench]``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("plot() needs matplotlib: pip install matplotlib") from e
        base, planned = self.memory_timelines()
        gib = 2**30
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot(
            [v / gib for v in base],
            label=f"no plan (peak {self.baseline.peak_bytes / gib:.1f} GiB)",
        )
        ax.plot(
            [v / gib for v in planned],
            label=f"plan (peak {self.predicted.peak_bytes / gib:.1f} GiB)",
        )
        if self.budget_bytes is not None:
            ax.axhline(self.budget_bytes / gib, color="grey", linestyle="--", label="budget")
        ax.axvline(self.profile.step_marks["forward_end"], color="grey", linewidth=0.5)
        ax.set_xlabel("allocation events in one step (forward | backward)")
        ax.set_ylabel("device GiB")
        ax.set_title(f"{self.profile.description}: memory over one training step")
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def plan_from_profile(
    profile: Profile,
    budget_bytes: int | None,
    *,
    hardware: Hardware | None = None,
    prefetch_layers: int = 1,
    defer_layers: int = 1,
) -> Plan:
    """Choose decisions for a traced (or synthetic) profile. Raises `InfeasibleBudgetError`,
    naming the least peak and what it is made of, when nothing fits."""
    hw = hardware or Hardware()
    model = CostModel(profile, hw, defer_layers, prefetch_layers)
    keep = [KEEP] * model.n
    baseline = model.predict(keep)
    if budget_bytes is None or baseline.peak_bytes <= budget_bytes:
        decisions = keep
    else:
        least, least_bytes = least_peak(model)
        stream, _ = model.stream()
        floor = min(least_bytes, stream.peak_bytes) if profile.saved_storages else least_bytes
        options = []
        if least_bytes <= budget_bytes:
            # Offloading any layer installs the engine's hooks on all of them, which the greedy
            # step by step cannot weigh: so also try recomputation alone.
            for allowed in (DECISIONS, (KEEP, RECOMPUTE)):
                decisions = choose_decisions(model, budget_bytes, allowed)
                pred = model.predict(decisions)
                if pred.peak_bytes <= budget_bytes:
                    options.append((pred.step_s, decisions))
            if not options:  # the greedy got stuck; the least-peak decisions fit
                options.append((model.predict(least).step_s, least))
        if profile.saved_storages and stream.peak_bytes <= budget_bytes:
            options.append((stream.step_s, [STREAM] * model.n))
        if not options:
            g = _human
            raise InfeasibleBudgetError(
                f"budget {g(budget_bytes)} is too small: this step needs at least "
                f"{g(floor)}"
                " even with every layer offloaded or "
                "recomputed. "
                f"Parameters, gradients and optimizer state alone take "
                f"{g(profile.static_bytes)} (parameters {g(profile.param_bytes)}, "
                f"gradients {g(profile.grad_bytes)}, optimizer {g(profile.optimizer_bytes)}), "
                f"the device's workspaces {g(hw.workspace_bytes)}; "
                f"without a plan the peak is {g(baseline.peak_bytes)}."
            )
        decisions = min(options, key=lambda o: o[0])[1]
    for i, d in enumerate(decisions):
        _log.debug("layer %d: %s", i, d)
    return Plan(
        profile=profile,
        hardware=hw,
        budget_bytes=budget_bytes,
        decisions=tuple(decisions),
        prefetch_layers=prefetch_layers,
        defer_layers=defer_layers,
        predicted=model.stream()[0] if decisions[0] == STREAM else model.predict(decisions),
        baseline=baseline,
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
) -> Plan:
    """Trace one training step of ``model`` under fake tensors (`trace`) and choose, per layer,
    whether to keep, offload or recompute its activations so that the predicted peak stays
    within ``budget_bytes`` at the least predicted step time.

    ``link_gbps`` and ``compute_tflops``: None measures them on this machine's GPU, or takes
    the defaults of one H200 on a machine without one. See Notes: [How a plan changes memory]
    and [How a plan changes time]; `print(plan)` shows the decisions and predictions.
    """
    if budget_bytes is not None:
        check_int("budget_bytes", budget_bytes, minimum=1)
    for name, value in (("prefetch_layers", prefetch_layers), ("defer_layers", defer_layers)):
        check_int(name, value, minimum=0)
    for name, value in (("link_gbps", link_gbps), ("compute_tflops", compute_tflops)):
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
    return plan_from_profile(
        profile, budget_bytes, hardware=hw, prefetch_layers=prefetch_layers,
        defer_layers=defer_layers,
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
