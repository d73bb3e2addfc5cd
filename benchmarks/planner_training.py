"""Training-state plans against their budgets: does a plan that places the optimizer state (and
the parameters) as well as the activations stay within its budget when applied?

    python benchmarks/planner_training.py                 # h2048 L12 b8 s2048, bf16, on CUDA
    python benchmarks/planner_training.py --shape tiny    # a smoke run (CPU: no peaks)

The model is `BlockStack` (as in `benchmarks/activations.py`) trained with AdamW (lr 1e-4): a
step is forward, backward, ``opt.step()``, ``opt.zero_grad()``. The reference (``none``) keeps
everything on the device (fused AdamW, state in bf16); its peak over the timed steps sets the
budgets: 75%, 50% and 25% of it. For each, `plan_from_profile` on the traced step (optimizer
"adamw") chooses the activation decisions and where the optimizer state and the parameters
live; the plan is applied as a user would (`plan.stream_parameters`, `plan.optimizer`,
`plan.apply(model)`) to a fresh model, and its peak
(`max_memory_allocated` over the timed steps, the optimizer step included) is compared with
the budget and the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner import CODE  # noqa: E402

from torchoffload import OffloadedOptimizer  # noqa: E402
from torchoffload.models import BlockStack  # noqa: E402
from torchoffload.planner import (  # noqa: E402
    Hardware,
    InfeasibleBudgetError,
    plan_from_profile,
    trace,
)

GIB = 1 << 30
SHAPES = {"h2048": (2048, 12, 8, 2048), "h4096": (4096, 8, 4, 2048), "tiny": (64, 4, 2, 32)}
FRACTIONS = (0.75, 0.5, 0.25)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def build(shape, device, dtype):
    hidden, layers, _, _ = shape
    torch.manual_seed(0)
    return BlockStack(hidden, layers, heads=max(1, hidden // 128)).to(device, dtype)


def measure(model, opt, x, *, steps, warmup, device):
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + steps):
        if i == warmup and cuda:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss_of(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), (torch.cuda.max_memory_allocated() if cuda else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="h2048")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--offload-fraction", default="auto",
        help="the plans' offload_fraction: auto (the planner's choice) or a number",
    )  # fmt: skip
    p.add_argument("--optimizer-state", default="auto", choices=["auto", "device", "host"])
    args = p.parse_args()
    fraction = (
        args.offload_fraction if args.offload_fraction == "auto" else float(args.offload_fraction)
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    hidden, nlayers, batch, seq = shape
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
    with torch.device("meta"):
        meta = BlockStack(hidden, nlayers, heads=max(1, hidden // 128)).to(dtype)
    profile = trace(meta, (x.to("meta"),), layers=meta.layers, loss_fn=loss_of, optimizer="adamw")
    hw = Hardware.detect()
    if device.type == "cpu":  # a smoke run: no device workspaces to count
        hw = dataclasses.replace(hw, workspace_bytes=0)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {datetime.date.today()} {gpu}, torch {torch.__version__}, {dtype}; "
          f"h{hidden} L{nlayers} b{batch} s{seq}, AdamW; hardware: {hw.source}")  # fmt: skip

    model = build(shape, device, dtype)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    ms, peak0 = measure(model, opt, x, steps=args.steps, warmup=args.warmup, device=device)
    base = plan_from_profile(profile, None, hardware=hw, optimizer_state="device",
                             parameters="device")  # fmt: skip
    peak0 = peak0 or base.predicted.peak_bytes
    rows = [("none", None, base.predicted.peak_bytes, peak0, ms, "device/device", "-",
             base.predicted.step_s * 1e3)]  # fmt: skip
    del model, opt
    gc.collect()
    for f in FRACTIONS:
        budget = int(f * peak0)
        try:
            plan = plan_from_profile(profile, budget, hardware=hw, offload_fraction=fraction,
                                     optimizer_state=args.optimizer_state)  # fmt: skip
        except InfeasibleBudgetError as e:
            rows.append((f"plan[{f:.2f}]", budget, None, None, None, "infeasible", str(e)[:160],
                         None))  # fmt: skip
            continue
        model = build(shape, device, dtype)
        params = plan.stream_parameters(model)
        kw = dict(lr=1e-4, fused=fused)
        opt = plan.optimizer(model.parameters(), torch.optim.AdamW, **kw)
        act = plan.apply(model, layers=model.layers)
        try:
            ms, peak = measure(model, opt, x, steps=args.steps, warmup=args.warmup, device=device)
        finally:
            act.remove()
            if isinstance(opt, OffloadedOptimizer):
                opt.remove()
            if params is not None:
                params.remove()
        where = f"{plan.optimizer_state.value}/{plan.parameters}"
        if plan.offload_fraction < 1.0:
            where = f"host {plan.offload_fraction:g}/{plan.parameters}"
        decisions = "".join(CODE[str(d)] for d in plan.decisions)
        rows.append((f"plan[{f:.2f}]", budget, plan.predicted.peak_bytes, peak, ms, where,
                     decisions, plan.predicted.step_s * 1e3))  # fmt: skip
        del model, opt, act, params
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("| config | budget GiB | predicted GiB | measured GiB | fits | predicted ms | "
          "ms/step | optimizer/parameters | decisions |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, budget, pred, peak, ms, where, decisions, pred_ms in rows:
        if pred is None:
            print(f"| {name} | {budget / GIB:.2f} | - | - | - | - | - | {where} | {decisions} |")
            continue
        fits = "-" if budget is None or not peak else ("yes" if peak <= budget else "NO")
        b = "-" if budget is None else f"{budget / GIB:.2f}"
        print(f"| {name} | {b} | {pred / GIB:.2f} | {peak / GIB:.2f} | {fits} | {pred_ms:.1f} | "
              f"{ms:.1f} | "
              f"{where} | {decisions} |")  # fmt: skip


if __name__ == "__main__":
    main()
