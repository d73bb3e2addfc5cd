"""Validate the planner on the GPT shapes of `benchmarks/activations.py`: predicted against
measured peak and step time, and the plan against the alternatives a user has, at budgets of
75%, 50% and 25% of the measured no-offloading peak.

    python benchmarks/planner.py                 # the three shapes, on CUDA
    python benchmarks/planner.py --shapes tiny   # a smoke run (works on CPU; times mean little)

Per shape the model is traced once under fake tensors (`torchoffload.trace`) and the hardware
is measured (`Hardware.detect`). Then, each measured as in `benchmarks/activations.py` (median
ms/step over --steps after --warmup, `max_memory_allocated` over the timed steps; a step is
forward + backward + zero_grad, no optimizer):

- none: no offloading, no checkpointing; its peak sets the budgets.
- ckpt[m]: non-reentrant `torch.utils.checkpoint` on the first m layers, m = 1..L.
- save_on_cpu: `torch.autograd.graph.save_on_cpu(pin_memory=True)`.
- offload_act: `torchoffload.offload_activations()` around forward and loss.
- hand[X]: `apply_activation_offloading` with ``max_offload_bytes=X`` (rule "spread"): X is
  1, 1.5 and 2 times what the budget needs removed (no-offloading peak minus budget), and no
  limit ("hand[all]").
- plan[f]: `plan_from_profile` at budget f x the no-offloading peak, applied with
  ``plan.apply(model)``. Decisions per layer: k keep, o offload,
  r recompute, R recompute with the input offloaded, s stream (the whole model).

The checkpointing rows are predicted too (a plan that recomputes the first m layers), which
tests the time model on more points than the plans. The verdict per budget compares the plan
with the fastest alternative whose measured peak fits the budget.

Where the host binds (small shapes), its speed drifts between rounds by more than the verdict's
differences; ``--pairs N`` then measures, per budget, the plan and that alternative
alternately N times in short segments and reports the median ratio with a bootstrap 90%
interval (Note: [Paired comparison]). ``--only h1024`` runs one shape.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from activations import SHAPES, Timer  # noqa: E402

from torchoffload import (  # noqa: E402
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    offload_activations,
)
from torchoffload._modules import checkpointed  # noqa: E402
from torchoffload.models import BlockStack  # noqa: E402
from torchoffload.planner import (  # noqa: E402
    Hardware,
    InfeasibleBudgetError,
    plan_from_profile,
    trace,
)
from torchoffload.planner._cost import CostModel as _Model  # noqa: E402

GIB = 1 << 30
FRACTIONS = (0.75, 0.5, 0.25)
# one letter per layer decision, as the tables print them
CODE = {"keep": "k", "offload": "o", "recompute": "r", "recompute+offload": "R", "stream": "s"}


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def measure(model, x, *, steps, warmup, device, ctx=contextlib.nullcontext, phases=False,
            min_ms=1500.0):  # fmt: skip
    """Median ms/step and peak bytes over the timed steps (``phases``: forward and backward
    timed apart as well, with a sync between them). Short steps are timed more often: at
    least ``min_ms`` in all, as the last warm-up step predicts."""
    cuda = device.type == "cuda"
    times, fwd, bwd = [], [], []
    total = warmup + steps
    i = 0
    while i < total:
        if i == warmup and cuda:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
        if phases:
            with Timer(device) as tf, ctx():
                loss = loss_of(model(x))
            with Timer(device) as tb:
                loss.backward()
                model.zero_grad(set_to_none=True)
            if i >= warmup:
                fwd.append(tf.ms)
                bwd.append(tb.ms)
        with Timer(device) as t:
            with ctx():
                loss = loss_of(model(x))
            loss.backward()
            model.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(t.ms)
        elif i == warmup - 1:
            total = warmup + max(steps, int(min_ms / max(t.ms, 1e-3)))
        del loss
        i += 1
    out = {
        "ms": statistics.median(times),
        "peak": torch.cuda.max_memory_allocated() if cuda else 0,
        "steps": total,
    }
    if phases:
        out.update(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd))
    return out


def run_shape(shape, hw, pool, args, device, dtype):
    hidden, nlayers, batch, seq = shape
    torch.manual_seed(0)
    model = BlockStack(hidden, nlayers, heads=max(1, hidden // 128)).to(device, dtype)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
    layers = list(model.layers)
    profile = trace(model, (x,), layers=model.layers, loss_fn=loss_of, optimizer="none")
    base_plan = plan_from_profile(profile, None, hardware=hw)
    predictor = _Model(profile, hw, base_plan.defer_layers, base_plan.prefetch_layers)
    name = f"h{hidden} L{nlayers} b{batch} s{seq}"

    timing = {"steps": args.steps, "warmup": args.warmup, "min_ms": args.min_ms}

    def run(ctx=contextlib.nullcontext, phases=False):
        return measure(model, x, device=device, ctx=ctx, phases=phases, **timing)

    def with_handle(config=None, plan=None):
        if plan is not None:
            handle = plan.apply(model, layers=model.layers, pool=pool)
        else:
            handle = apply_activation_offloading(
                model, layers=model.layers, config=config, pool=pool
            )
        try:
            result = run()
            result["offloaded"] = handle.stats().offloaded_bytes // result["steps"]
        finally:
            handle.remove()
        return result

    ctx = offload_activations(pool=pool)  # around forward and loss, as a user writes it

    def offload_act():
        ctx.reset_stats()
        result = run(lambda: ctx)
        result["offloaded"] = ctx.stats().offloaded_bytes // result["steps"]
        return result

    # the reference: forward and backward timed apart, and the peak that sets the budgets
    none = run(phases=True)
    pred_base = predictor.predict(["keep"] * nlayers)
    peak0 = none["peak"] or pred_base.peak_bytes  # the predicted one on CPU (a smoke run)
    # (config, runner, prediction, extra); measured round-robin below
    configs = [("none", run, pred_base, {})]
    for m in range(1, nlayers + 1):
        decisions = ["recompute"] * m + ["keep"] * (nlayers - m)
        configs.append((f"ckpt[{m}]", lambda m=m: run(lambda: checkpointed(layers[:m])),
                        predictor.predict(decisions), {}))  # fmt: skip
    pinned = device.type == "cuda"
    configs.append(
        ("save_on_cpu", lambda: run(lambda: torch.autograd.graph.save_on_cpu(pin_memory=pinned)),
         None, {})
    )  # fmt: skip
    configs.append(("offload_act", offload_act, None, {}))
    configs.append(("hand[all]", lambda: with_handle(ActivationOffloadConfig()), None, {}))
    infeasible = []
    for f in FRACTIONS:
        need = peak0 - int(f * peak0)
        for k in (1.0, 1.5, 2.0):
            nbytes = int(k * need)
            key = f"hand[{nbytes / GIB:.2f}G]"
            if key not in {c[0] for c in configs}:
                cfg = ActivationOffloadConfig(max_offload_bytes=nbytes)
                configs.append((key, lambda cfg=cfg: with_handle(cfg), None, {}))
    for f in FRACTIONS:
        budget = int(f * peak0)
        try:
            plan = plan_from_profile(profile, budget, hardware=hw)
        except InfeasibleBudgetError as e:
            infeasible.append({"shape": name, "config": f"plan[{f:.2f}]", "infeasible": str(e)})
            continue
        extra = {"budget": budget, "decisions": "".join(CODE[d] for d in plan.decisions)}
        configs.append((f"plan[{f:.2f}]", lambda plan=plan: with_handle(plan=plan),
                        plan.predicted, extra))  # fmt: skip
    # Round-robin: the host's speed drifts over a run by as much as a fifth (measured, H200), so
    # every configuration is measured once per round and its median over rounds is kept.
    results = {c[0]: [] for c in configs}
    for _ in range(args.rounds):
        for config, runner, _, _ in configs:
            results[config].append(runner())
    rows = []
    for config, _, pred, extra in configs:
        rs = results[config]
        r = {
            "shape": name,
            "config": config,
            "ms": statistics.median(x["ms"] for x in rs),
            "ms_rounds": [x["ms"] for x in rs],
            "peak": max(x["peak"] for x in rs),
            "pred_ms": pred.step_s * 1e3 if pred else None,
            "pred_peak": pred.peak_bytes if pred else None,
        }
        if "offloaded" in rs[0]:
            r["offloaded"] = rs[0]["offloaded"]
        r.update(extra)
        rows.append(r)
    base = rows[0]
    base.update(fwd_ms=none["fwd_ms"], bwd_ms=none["bwd_ms"], ref_peak=peak0)
    base.update(pred_fwd_ms=pred_base.forward_s * 1e3, pred_bwd_ms=pred_base.backward_s * 1e3)
    pairs = []
    if args.pairs:
        runners = {c[0]: c[1] for c in configs}
        timing.update(steps=args.pair_steps, warmup=1, min_ms=0.0)
        for _, f, _, plan, best in verdicts(rows, FRACTIONS):
            if plan and best and "ms" in plan:
                pairs.append(paired(name, f, plan["config"], best["config"], runners, args.pairs))
    if args.profile_dir and device.type == "cuda":
        profile_step(model, x, args.profile_dir / f"{name.replace(' ', '_')}.txt")
    return rows + infeasible, pairs


def paired(shape, fraction, a, b, runners, pairs, seed=0):
    """Note: [Paired comparison]: ``a`` and ``b`` measured alternately, ``pairs`` times (the
    order flips every pair), each a short segment of a few steps; the ratio a/b per pair, its
    median, and a bootstrap 90% interval of that median."""
    ratios, ms_a, ms_b = [], [], []
    for i in range(pairs):
        order = (a, b) if i % 2 == 0 else (b, a)
        got = {c: runners[c]()["ms"] for c in order}
        ms_a.append(got[a])
        ms_b.append(got[b])
        ratios.append(got[a] / got[b])
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return {
        "shape": shape, "fraction": fraction, "a": a, "b": b, "pairs": pairs,
        "ratios": ratios, "ms_a": ms_a, "ms_b": ms_b,
        "ratio": statistics.median(ratios), "ci": (medians[100], medians[1899]),
    }  # fmt: skip


def profile_step(model, x, path):
    """Per-op GPU time of one step without offloading (torch.profiler), for calibrating."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        loss_of(model(x)).backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    path.write_text(
        prof.key_averages().table(
            sort_by="self_device_time_total", row_limit=40, max_name_column_width=60
        )
    )


def verdicts(rows, fractions):
    """Per shape and budget: the plan against the fastest alternative that fits."""
    out = []
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    for shape in shapes:
        mine = [r for r in rows if r["shape"] == shape]
        peak0 = next(r["ref_peak"] for r in mine if r["config"] == "none")
        for f in fractions:
            budget = int(f * peak0)
            plan = next((r for r in mine if r["config"] == f"plan[{f:.2f}]"), None)
            alts = [
                r for r in mine
                if not r["config"].startswith("plan") and "ms" in r and r["config"] != "none"
                and r["peak"] <= budget
            ]  # fmt: skip
            best = min(alts, key=lambda r: r["ms"], default=None)
            out.append((shape, f, budget, plan, best))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="issue")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round, at least")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-ms", type=float, default=500.0, help="timed ms per round, at least")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated shape names (h1024,...)")
    p.add_argument(
        "--pairs", type=int, default=0,
        help="per budget, this many paired segments of the plan and the best alternative",
    )  # fmt: skip
    p.add_argument("--pair-steps", type=int, default=3, help="timed steps per paired segment")
    p.add_argument("--json", type=Path, default=None, help="also write raw results here")
    p.add_argument("--profile-dir", type=Path, default=None, help="per-op GPU time tables")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    hw = Hardware.detect()
    pool = PinnedPool(16 * GIB if device.type == "cuda" else GIB, slab_bytes=GIB)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"# {datetime.date.today()} {gpu}, torch {torch.__version__}, {dtype}; hardware: link "
        f"{hw.link_gbps:.1f} GB/s, {hw.compute_tflops:.0f} TFLOP/s x {hw.efficiency:.2f}, "
        f"memory {hw.hbm_gbps:.0f} GB/s, host {hw.host_us_fwd:.1f}/{hw.host_us_bwd:.1f} us per "
        f"fwd/bwd op, {hw.host_us_saved:.1f} us per offloaded storage, "
        f"{hw.host_us_layer:.1f} us per layer with the engine, "
        f"{hw.host_us_checkpoint_fwd:.1f}/{hw.host_us_checkpoint_bwd:.1f} us per checkpointed "
        f"storage fwd/bwd, {hw.kernel_us:.1f} us per kernel ({hw.source})"
    )
    rows, pairs = [], []
    only = {o for o in args.only.split(",") if o}
    for shape in SHAPES[args.shapes]:
        if only and f"h{shape[0]}" not in only:
            continue
        shape_rows, shape_pairs = run_shape(shape, hw, pool, args, device, dtype)
        pairs += shape_pairs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows += shape_rows
        b = shape_rows[0]
        print(
            f"{b['shape']}: measured fwd {b['fwd_ms']:.1f} bwd {b['bwd_ms']:.1f} ms, predicted "
            f"fwd {b['pred_fwd_ms']:.1f} bwd {b['pred_bwd_ms']:.1f} ms",
            flush=True,
        )

    def err(pred, meas):
        return f"{(pred / meas - 1) * 100:+6.1f}%" if pred and meas else f"{'':>7}"

    header = (
        f"| {'shape':<20} | {'config':<16} | {'ms/step':>8} | {'pred ms':>8} | {'err':>7} | "
        f"{'peak GiB':>8} | {'pred GiB':>8} | {'err':>7} | {'offl GiB':>8} | decisions"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:]))
    for r in rows:
        if "infeasible" in r:
            print(f"| {r['shape']:<20} | {r['config']:<16} | infeasible: {r['infeasible']}")
            continue
        pm = r["pred_ms"]
        pp = r["pred_peak"]
        print(
            f"| {r['shape']:<20} | {r['config']:<16} | {r['ms']:>8.1f} | "
            f"{pm if pm is not None else float('nan'):>8.1f} | {err(pm, r['ms'])} | "
            f"{r['peak'] / GIB:>8.2f} | {(pp or float('nan')) / GIB:>8.2f} | "
            f"{err(pp, r['peak'])} | {r.get('offloaded', 0) / GIB:>8.2f} | "
            f"{r.get('decisions', '')}"
        )
    print()
    print(
        f"| {'shape':<20} | budget | {'GiB':>6} | {'plan ms':>8} | {'plan GiB':>8} | fits | "
        f"{'best alternative':<16} | {'alt ms':>8} | {'alt GiB':>8} | plan/alt |"
    )
    print("|" + "|".join(["-" * 22, "-" * 8, "-" * 8, "-" * 10, "-" * 10, "-" * 6, "-" * 18,
                          "-" * 10, "-" * 10, "-" * 10]) + "|")  # fmt: skip
    for shape, f, budget, plan, best in verdicts(rows, FRACTIONS):
        pms = plan["ms"] if plan and "ms" in plan else float("nan")
        pgb = plan["peak"] / GIB if plan and "ms" in plan else float("nan")
        fits = "yes" if plan and "ms" in plan and plan["peak"] <= budget else "no"
        bname = best["config"] if best else "(none fits)"
        bms = best["ms"] if best else float("nan")
        bgb = best["peak"] / GIB if best else float("nan")
        print(
            f"| {shape:<20} | {f:>5.0%} | {budget / GIB:>6.2f} | {pms:>8.1f} | {pgb:>8.2f} | "
            f"{fits:>4} | {bname:<16} | {bms:>8.1f} | {bgb:>8.2f} | {pms / bms:>8.2f} |"
        )
    if pairs:
        print()
        print(
            f"| {'shape':<20} | budget | {'plan':<16} | {'alternative':<16} | pairs | "
            f"{'plan ms':>8} | {'alt ms':>8} | plan/alt | {'90% interval':>13} |"
        )
        print("|" + "|".join(["-" * 22, "-" * 8, "-" * 18, "-" * 18, "-" * 7, "-" * 10,
                              "-" * 10, "-" * 10, "-" * 15]) + "|")  # fmt: skip
        for r in pairs:
            lo, hi = r["ci"]
            print(
                f"| {r['shape']:<20} | {r['fraction']:>5.0%} | {r['a']:<16} | {r['b']:<16} | "
                f"{r['pairs']:>5} | {statistics.median(r['ms_a']):>8.1f} | "
                f"{statistics.median(r['ms_b']):>8.1f} | {r['ratio']:>8.3f} | "
                f"{lo:>6.3f}-{hi:<6.3f} |"
            )
    if args.json:
        out = {"gpu": gpu, "hardware": hw.__dict__, "rows": rows, "pairs": pairs}
        args.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
