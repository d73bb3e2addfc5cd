"""Know before you run: trace one training step under fake tensors, then choose per layer
between keeping, offloading and recomputing activations to meet a memory budget.

::

    plan = torchoffload.plan(model, (tokens,), budget_bytes=40 << 30)
    print(plan)                                   # per layer: bytes, FLOPs, decision; predictions
    handle = torchoffload.apply_activation_offloading(model, plan=plan)
    plan.plot("memory.png")                       # memory over one step, baseline vs plan

Nothing is allocated: parameters, inputs and every intermediate are fake tensors (shapes,
dtypes and storages without memory), so a 70B-parameter model traces on a laptop.

The trace is in `torchoffload._trace` (Note: [What the trace records]).

Note: [How a plan changes memory]
Offloading layer i removes its eligible saved storages from the device from the end of layer
i + defer_layers' forward until the backward of layer i + prefetch_layers starts (where the
layer-aware engine frees and reloads them). Recomputing layer i removes every storage it saved,
except its input, from the end of its forward until its backward starts. Between two markers the
live bytes of the baseline trace are shifted by what the plan removes there, so the predicted
peak is the largest shifted value; it takes one pass over the markers, not a new trace.

Note: [How a plan changes time]
Compute time is FLOPs over an achieved rate (``compute_tflops`` times ``efficiency``). Copies
take bytes over ``link_gbps``. Forward: layer j cannot start until the copies of layer
j - defer_layers - 1 are done (the engine's deferred release waits on them). Backward: the
reloads of layer i are issued when the backward of layer i + prefetch_layers starts, wait for
the compute issued before them (the engine orders each reload after the compute stream), and
layer i's backward waits for them; a recomputed layer adds its forward to its backward. The
optimizer step and the code outside the layers are kept as traced.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from torchoffload._trace import LayerProfile, Profile, trace

__all__ = [
    "Hardware",
    "InfeasibleBudgetError",
    "LayerProfile",
    "Plan",
    "Prediction",
    "Profile",
    "plan",
    "plan_from_profile",
    "synthetic_profile",
    "trace",
]

_log = logging.getLogger(__name__)

# -- the machine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What the time model needs. The defaults are one H200 as measured on the GPU machine
    (pinned copies 55 GB/s each way, bf16 matmul 790 TFLOP/s); ``efficiency`` is the share of
    ``compute_tflops`` a training step's counted FLOPs achieve (elementwise work is not counted,
    so this absorbs it)."""

    link_gbps: float = 55.0
    compute_tflops: float = 790.0
    efficiency: float = 0.6
    hbm_gbps: float = 3000.0  # for the optimizer step, which streams parameters and state
    source: str = "defaults (one H200)"

    def __post_init__(self) -> None:
        for name in ("link_gbps", "compute_tflops", "efficiency", "hbm_gbps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"Hardware.{name} must be a positive number, got {value!r}")

    @property
    def flops_per_s(self) -> float:
        return self.compute_tflops * 1e12 * self.efficiency

    @classmethod
    def detect(
        cls, link_gbps: float | None = None, compute_tflops: float | None = None
    ) -> Hardware:
        """Measured on this machine's GPU when there is one (a few hundred ms), else the
        defaults; explicit values win."""
        measured: dict[str, float] = {}
        source = "defaults (one H200)"
        if torch.cuda.is_available() and (link_gbps is None or compute_tflops is None):
            measured = _measure_cuda()
            source = f"measured on {torch.cuda.get_device_name()}"
        link = link_gbps if link_gbps is not None else measured.get("link_gbps", cls.link_gbps)
        tflops = compute_tflops if compute_tflops is not None else measured.get("tflops")
        if link_gbps is not None and compute_tflops is not None:
            source = "given"
        return cls(link_gbps=link, compute_tflops=tflops or cls.compute_tflops, source=source)


def _measure_cuda() -> dict[str, float]:
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(n, dtype=torch.uint8, device=dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def timed(fn, reps: int) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    h2d = timed(lambda: buf.copy_(host, non_blocking=True), 4)
    d2h = timed(lambda: host.copy_(buf, non_blocking=True), 4)
    mm = timed(lambda: a @ a, 10)
    return {"link_gbps": n / max(h2d, d2h) / 1e9, "tflops": 2 * 8192**3 / mm / 1e12}


# -- predictions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    offloaded_bytes: int  # per step, each way


class _Model:
    """A profile prepared for fast what-ifs. See Notes: [How a plan changes memory] and
    [How a plan changes time]."""

    def __init__(self, profile: Profile, hw: Hardware, defer: int, prefetch: int):
        self.p, self.hw, self.defer, self.prefetch = profile, hw, defer, prefetch
        n = len(profile.layers)
        self.n = n
        marks = profile.step_marks
        self.bwd_end = marks["backward_end"]
        # Steady state: the optimizer state of earlier steps is live during forward and backward.
        steady = [v + profile.optimizer_bytes for v in profile.timeline[: self.bwd_end + 1]]
        self.opt_peak = max(profile.timeline[self.bwd_end :]) if profile.timeline else 0
        self.steady = steady
        cuts = {0, len(steady)}
        self.windows: list[dict[str, tuple[int, int]]] = []
        for i in range(n):
            release = profile.fwd_end[i + defer] if i + defer < n else marks["forward_end"]
            reload = profile.bwd_start[min(i + prefetch, n - 1)]
            w = {
                "offload": (release, reload),
                "recompute": (profile.fwd_end[i], profile.bwd_start[i]),
            }
            for a, b in w.values():
                cuts.update((min(a, len(steady)), min(b, len(steady))))
            self.windows.append(w)
        self.cuts = sorted(cuts)
        self.pos = {c: k for k, c in enumerate(self.cuts)}
        self.seg_max = [
            max(steady[a:b]) if b > a else -(1 << 62)
            for a, b in zip(self.cuts, self.cuts[1:], strict=False)
        ]
        rate = hw.flops_per_s
        self.tf = [layer.fwd_flops / rate for layer in profile.layers]
        self.tb = [layer.bwd_flops / rate for layer in profile.layers]
        self.t_out_f = profile.outside_fwd_flops / rate
        self.t_out_b = profile.outside_bwd_flops / rate
        moved = profile.param_bytes * 2 + profile.grad_bytes + profile.optimizer_bytes * 2
        self.t_opt = moved / (hw.hbm_gbps * 1e9) if profile.optimizer_bytes else 0.0
        self.bw = hw.link_gbps * 1e9

    def removed(self, i: int, decision: str) -> int:
        layer = self.p.layers[i]
        if decision == "offload":
            return layer.offloadable_bytes
        if decision == "recompute":
            return layer.recompute_bytes
        return 0

    def peak(self, decisions: Sequence[str]) -> int:
        diff = [0] * (len(self.cuts) + 1)
        for i, d in enumerate(decisions):
            if d == "keep":
                continue
            a, b = self.windows[i][d]
            amount = self.removed(i, d)
            if b > a and amount:
                last = len(self.steady)
                diff[self.pos[min(a, last)]] -= amount
                diff[self.pos[min(b, last)]] += amount
        best, run = self.opt_peak, 0
        for k, seg in enumerate(self.seg_max):
            run += diff[k]
            best = max(best, seg + run)
        return best

    def timeline(self, decisions: Sequence[str]) -> list[int]:
        """The predicted live bytes after each traced event (forward and backward)."""
        diff = [0] * (len(self.steady) + 1)
        for i, d in enumerate(decisions):
            if d != "keep":
                a, b = self.windows[i][d]
                if b > a:
                    diff[a] -= self.removed(i, d)
                    diff[b] += self.removed(i, d)
        out, run = [], 0
        for k, v in enumerate(self.steady):
            run += diff[k]
            out.append(v + run)
        return out

    def time(self, decisions: Sequence[str]) -> tuple[float, float, float]:
        n, defer, prefetch, bw = self.n, self.defer, self.prefetch, self.bw
        d = [self.p.layers[i].offloadable_bytes / bw if x == "offload" else 0.0
             for i, x in enumerate(decisions)]  # fmt: skip
        # forward: layer j waits for the copies of layer j - defer - 1
        c, copy_free = 0.0, 0.0
        d2h_end = [0.0] * n
        for j in range(n):
            start = c
            if j - defer - 1 >= 0:
                start = max(start, d2h_end[j - defer - 1])
            c = start + self.tf[j]
            if d[j]:
                copy_free = max(copy_free, start) + d[j]
            d2h_end[j] = copy_free
        forward = max(c + self.t_out_f, copy_free)  # the model's end waits for every copy
        # backward: head and loss first, then the layers in reverse
        end_of = {n: forward + self.t_out_b}  # when the backward of layers >= k has finished
        h2d_free = 0.0
        for i in range(n - 1, -1, -1):
            issue = end_of[min(i + prefetch + 1, n)]
            ready = 0.0
            if d[i]:
                h2d_free = max(h2d_free, issue) + d[i]
                ready = h2d_free
            extra = self.tf[i] if decisions[i] == "recompute" else 0.0
            end_of[i] = max(end_of[i + 1], ready) + self.tb[i] + extra
        backward = end_of[0] - forward
        return forward, backward, self.t_opt

    def predict(self, decisions: Sequence[str]) -> Prediction:
        f, b, o = self.time(decisions)
        moved = sum(self.removed(i, x) for i, x in enumerate(decisions) if x == "offload")
        return Prediction(self.peak(decisions), f + b + o, f, b, o, moved)


# -- choosing -----------------------------------------------------------------------------------


class InfeasibleBudgetError(ValueError):
    """No plan of keep/offload/recompute per layer meets the budget."""


def _choose(model: _Model, budget: int) -> list[str]:
    """Greedy: from all-keep, apply the change with the least predicted time per byte of peak
    it removes until the peak fits; then undo changes that are no longer needed."""
    n = model.n
    decisions = ["keep"] * n
    current = model.predict(decisions)
    moves = {"keep": ("offload", "recompute"), "offload": ("recompute",), "recompute": ()}
    while current.peak_bytes > budget:
        best = None
        for i in range(n):
            for option in moves[decisions[i]]:
                trial = decisions.copy()
                trial[i] = option
                pred = model.predict(trial)
                gain = current.peak_bytes - pred.peak_bytes
                if gain <= 0:
                    continue
                cost = max(pred.step_s - current.step_s, 0.0)
                # fewest seconds per byte; among free moves, the one that removes most
                key = (cost / gain, -gain, i)
                if best is None or key < best[0]:
                    best = (key, trial, pred)
        if best is None:
            break
        _, decisions, current = best
    # Undo what the budget no longer needs, latest layers first (they cost the most to move).
    lighter = {"keep": (), "offload": ("keep",), "recompute": ("keep", "offload")}
    changed = True
    while changed:
        changed = False
        for i in range(n - 1, -1, -1):
            for option in lighter[decisions[i]]:
                trial = decisions.copy()
                trial[i] = option
                pred = model.predict(trial)
                if pred.peak_bytes <= budget and pred.step_s <= current.step_s:
                    decisions, current, changed = trial, pred, True
                    break
    return decisions


def _least_peak(model: _Model) -> tuple[list[str], int]:
    """The decisions that remove the most from each layer's window, ignoring time."""
    decisions = []
    for i in range(model.n):
        options = sorted(
            ("offload", "recompute"),
            key=lambda d: model.removed(i, d) * (model.windows[i][d][1] > model.windows[i][d][0]),
        )
        decisions.append(options[-1])
    return decisions, model.peak(decisions)


@dataclass(frozen=True)
class Plan:
    """A per-layer choice between keeping, offloading and recomputing activations, with what it
    is predicted to cost. Apply it with ``apply_activation_offloading(model, plan=plan)``."""

    profile: Profile = field(repr=False)
    hardware: Hardware
    budget_bytes: int | None
    decisions: tuple[str, ...]
    prefetch_layers: int
    defer_layers: int
    predicted: Prediction
    baseline: Prediction

    @property
    def offload_layers(self) -> frozenset[int]:
        return frozenset(i for i, d in enumerate(self.decisions) if d == "offload")

    @property
    def recompute_layers(self) -> frozenset[int]:
        return frozenset(i for i, d in enumerate(self.decisions) if d == "recompute")

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
        counts = {d: self.decisions.count(d) for d in ("keep", "offload", "recompute")}
        lines.append(
            f"decisions: keep {counts['keep']}, offload {counts['offload']}, recompute "
            f"{counts['recompute']} (prefetch {self.prefetch_layers}, defer {self.defer_layers})"
        )
        return "\n".join(lines)

    def memory_timelines(self) -> tuple[list[int], list[int]]:
        """Predicted live bytes over forward and backward: (no plan, this plan)."""
        model = _Model(self.profile, self.hardware, self.defer_layers, self.prefetch_layers)
        return model.timeline(["keep"] * len(self.decisions)), model.timeline(self.decisions)

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
    model = _Model(profile, hw, defer_layers, prefetch_layers)
    keep = ["keep"] * model.n
    baseline = model.predict(keep)
    if budget_bytes is None or baseline.peak_bytes <= budget_bytes:
        decisions = keep
    else:
        least, least_peak = _least_peak(model)
        if least_peak > budget_bytes:
            gib = 2**30
            raise InfeasibleBudgetError(
                f"budget {budget_bytes / gib:.2f} GiB is too small: this step needs at least "
                f"{least_peak / gib:.2f} GiB even with every layer offloaded or recomputed. "
                f"Parameters, gradients and optimizer state alone take "
                f"{profile.static_bytes / gib:.2f} GiB (parameters "
                f"{profile.param_bytes / gib:.2f}, "
                f"gradients {profile.grad_bytes / gib:.2f}, optimizer "
                f"{profile.optimizer_bytes / gib:.2f}); without a plan the peak is "
                f"{baseline.peak_bytes / gib:.2f} GiB."
            )
        decisions = _choose(model, budget_bytes)
    for i, d in enumerate(decisions):
        _log.debug("layer %d: %s", i, d)
    return Plan(
        profile=profile,
        hardware=hw,
        budget_bytes=budget_bytes,
        decisions=tuple(decisions),
        prefetch_layers=prefetch_layers,
        defer_layers=defer_layers,
        predicted=model.predict(decisions),
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
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise ValueError(f"budget_bytes must be a positive int or None, got {budget_bytes!r}")
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
                     input_bytes, (), fwd_flops, 2 * fwd_flops)
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
