"""What a plan tells its reader: a `Plan`'s report (the CLI prints it) and memory plot, and an
`ExpertPlan`'s table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchoffload.planner._cost import (
    BOTH,
    DECISIONS,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    STREAM,
    device_part_bytes,
    host_optimizer_bytes,
)

if TYPE_CHECKING:
    from torchoffload.planner._experts import ExpertPlan
    from torchoffload.planner._plan import Plan


def describe(plan: Plan) -> str:
    """The plan as the CLI prints it: per-layer decisions, where state lives, predictions."""
    mib = 2**20
    gib = 2**30 if plan.baseline.peak_bytes >= 2**30 else 2**20
    unit = "GiB" if gib == 2**30 else "MiB"
    p, hw = plan.profile, plan.hardware
    lines = [
        f"torchoffload plan for {p.description}: {len(p.layers)} layers"
        + (f", {p.tokens} tokens per step" if p.tokens else ""),
        f"hardware: link {hw.link_gbps:.1f} GB/s each way, {hw.compute_tflops:.0f} TFLOP/s x "
        f"{hw.efficiency:.2f} efficiency ({hw.source})"
        + (
            f"; host step {hw.host_adam_params_per_s / 1e9:.2f} B parameters a second, "
            f"{plan.link_bytes_per_param or 4:g} bytes a parameter over the link each way"
            if plan.optimizer_state == "host"
            else ""
        ),  # fmt: skip
        "",
        f"{'layer':>5}  {'saved MiB':>10}  {'offloadable':>11}  {'fwd GFLOP':>10}  "
        f"{'bwd GFLOP':>10}  decision",
    ]
    for layer, decision in zip(p.layers, plan.decisions, strict=True):
        lines.append(
            f"{layer.index:>5}  {layer.saved_bytes / mib:>10.1f}  "
            f"{layer.offloadable_bytes / mib:>11.1f}  {layer.fwd_flops / 1e9:>10.1f}  "
            f"{layer.bwd_flops / 1e9:>10.1f}  {decision}"
        )
    b, q = plan.baseline, plan.predicted
    per = plan.host_bytes_per_param
    state = "fp32 masters, gradients and state"
    if per is not None:
        state = f"masters, gradients and state at {per:.2f} bytes a parameter"
    if plan.parameters == "host":
        where = (
            f"where state lives: parameters in pinned host memory, streamed per layer for "
            f"forward and again for backward (stream_parameters, device budget "
            f"{plan.parameter_budget_bytes / gib:.2f} {unit} of {p.param_bytes / gib:.2f}); "
            f"gradients and optimizer state on the host (OffloadedOptimizer: gradients leave "
            f"the device as backward finishes them; {state} "
            f"{host_optimizer_bytes(p, 1.0, per) / 2**30:.2f} GiB of host memory, the "
            f"parameters' host store {p.param_bytes / 2**30:.2f} GiB)"
        )
    elif plan.optimizer_state == "host" and plan.offload_fraction < 1.0:
        f = plan.offload_fraction
        where = (
            f"where state lives: parameters on the device ({p.param_bytes / gib:.2f} {unit}); "
            f"{f:.0%} of the gradients and optimizer state on the host, those backward "
            f"finishes first (OffloadedOptimizer(offload_fraction={f}): {state} "
            f"{host_optimizer_bytes(p, f, per) / 2**30:.2f} GiB of host "
            f"memory); the rest on the device, stepped there after backward (fp32 masters "
            f"and state {device_part_bytes(p, f) / gib:.2f} {unit}, and its gradients)"
        )
    elif plan.optimizer_state == "host":
        where = (
            f"where state lives: parameters on the device ({p.param_bytes / gib:.2f} {unit}); "
            f"gradients and optimizer state on the host (OffloadedOptimizer: gradients leave "
            f"the device as backward finishes them; {state} "
            f"{host_optimizer_bytes(p, 1.0, per) / 2**30:.2f} GiB of host memory)"
        )
    else:
        where = (
            "where state lives: parameters, gradients and optimizer state on the device "
            f"({p.static_bytes / gib:.2f} {unit})"
        )
    host_line = f"host memory needed: {plan.host_bytes / 2**30:.2f} GiB"
    if plan.host_budget_bytes is not None and plan.host_bytes > plan.host_budget_bytes:
        host_line += (
            f", more than this machine's {plan.host_budget_bytes / 2**30:.2f} GiB: the "
            "plan is for a machine with that much (--host-budget plans within a limit)"
        )
    elif plan.host_budget_bytes is not None:
        host_line += f" of a {plan.host_budget_bytes / 2**30:.2f} GiB host budget"
    lines += [
        "",
        f"static: parameters {p.param_bytes / gib:.2f} {unit}, gradients "
        f"{p.grad_bytes / gib:.2f} {unit}, optimizer state "
        f"{p.optimizer_bytes / gib:.2f} {unit} (as traced, on the device)",
        where,
        host_line,
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
    if plan.budget_bytes is not None:
        spare = plan.budget_bytes - q.peak_bytes - plan.margin_bytes
        lines.append(
            f"budget {plan.budget_bytes / gib:.2f} {unit} = predicted peak "
            f"{q.peak_bytes / gib:.2f} + margin {plan.margin_bytes / gib:.2f} (for what the "
            f"model does not count) + {spare / gib:.2f} spare"
        )
    counts = {d: plan.decisions.count(d) for d in (*DECISIONS, STREAM)}
    lines.append(
        f"decisions: keep {counts[KEEP]}, offload {counts[OFFLOAD]}, recompute "
        f"{counts[RECOMPUTE]}, recompute+offload {counts[BOTH]}"
        + (
            " (stream: the whole model under offload_activations)"
            if plan.stream
            else f" (prefetch {plan.prefetch_layers}, defer {plan.defer_layers})"
        )
    )
    return "\n".join(lines)


def plot(plan: Plan, path: str) -> None:
    """Write a PNG of memory over one step, without a plan and with this one (needs
    matplotlib: ``pip install torchoffload[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot() needs matplotlib: pip install matplotlib") from e
    base, planned = plan.memory_timelines()
    gib = 2**30
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(
        [v / gib for v in base],
        label=f"no plan (peak {plan.baseline.peak_bytes / gib:.1f} GiB)",
    )
    ax.plot(
        [v / gib for v in planned],
        label=f"plan (peak {plan.predicted.peak_bytes / gib:.1f} GiB)",
    )
    if plan.budget_bytes is not None:
        ax.axhline(plan.budget_bytes / gib, color="grey", linestyle="--", label="budget")
        if plan.margin_bytes:
            ax.axhline((plan.budget_bytes - plan.margin_bytes) / gib, color="grey",
                       linestyle=":", label="budget less the margin")  # fmt: skip
    ax.axvline(plan.profile.step_marks["forward_end"], color="grey", linewidth=0.5)
    ax.set_xlabel("allocation events in one step (forward | backward)")
    ax.set_ylabel("device GiB")
    ax.set_title(f"{plan.profile.description}: memory over one training step")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe_experts(plan: ExpertPlan) -> str:
    """An expert plan as a table: per cache size, the predicted hits and ms per token."""
    big = max(p.cache_bytes for p in plan.predictions) >= 2**30
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    warm = f", the first {plan.warmup_steps} steps not counted" if plan.warmup_steps else ""
    if plan.device_routed:
        warm += "; one-token calls routed on the device (block graphs, cuda_graph)"
    lines = [
        f"torchoffload expert plan: {plan.model}",
        f"routing: {plan.profile}, policy {plan.policy}{warm}",
        f"link {plan.link_bytes_per_s / 1e9:.1f} GB/s, resident {plan.resident_ms_per_token:.2f}"
        " ms/token; ms/token = max(link ms, resident ms); prefill s: a staged prefill's copies"
        " over the link (Note: [Predicting expert streaming])",
        "",
        f"{'cache ' + unit:>10}  {'slots':>6}  {'hit rate':>8}  {'MiB/token':>10}  "
        f"{'link ms':>8}  {'ms/token':>9}  {'no overlap':>10}  {'tokens/s':>9}  "
        f"{'prefill s':>9}  bound",
    ]
    for p in plan.predictions:
        mark = "  <- least for the target" if p is plan.target else ""
        prefill = "-" if p.prefill_ms is None else f"{p.prefill_ms / 1e3:.3f}"
        lines.append(
            f"{p.cache_bytes / scale:>10.2f}  {p.slots:>6}  {p.hit_rate:>8.3f}  "
            f"{p.bytes_per_token / 2**20:>10.1f}  {p.link_ms:>8.2f}  {p.ms_per_token:>9.2f}  "
            f"{p.no_overlap_ms:>10.2f}  {1e3 / p.ms_per_token if p.ms_per_token else 0:>9.1f}  "
            f"{prefill:>9}  {p.bound}{mark}"
        )
    lines.append(
        f"least cache {plan.least_cache_bytes / scale:.2f} {unit} (one token's routed experts of "
        f"one block); every expert {plan.all_cache_bytes / scale:.2f} {unit}"
    )
    if plan.target_ms_per_token is not None:
        t = plan.target_ms_per_token
        if plan.target is not None:
            p = plan.target
            lines.append(
                f"target {t:g} ms/token: the least cache predicted to reach it is "
                f"{p.cache_bytes / scale:.2f} {unit} ({p.slots} slots, hit rate "
                f"{p.hit_rate:.3f}, {p.ms_per_token:.2f} ms/token)"
            )
        elif plan.resident_ms_per_token > t:
            lines.append(f"target {t:g} ms/token: no cache reaches it, the resident model "
                         f"takes {plan.resident_ms_per_token:g}")  # fmt: skip
        else:
            lines.append(f"target {t:g} ms/token: no cache reaches it, not even a slot for "
                         "every expert (the misses of the experts' first uses)")  # fmt: skip
    return "\n".join(lines)
