"""Activation offloading on a GPT-style stack: step time and peak memory against peers and the
link bound.

    python benchmarks/activations.py                 # the three shapes of the issue, on CUDA
    python benchmarks/activations.py --shapes tiny   # a smoke run (works on CPU)

Rows per shape: no offloading, torch's save_on_cpu(pin_memory=True), full activation
checkpointing (non-reentrant, every block), torchoffload.offload_activations, and (with
--modes) torch.compile rows: `compiled` (Inductor, no offloading), `compiled_pass` (Inductor
with torchoffload.compile's activation pass, every eligible storage) and
`compiled_pass_hidden` (the pass under the hidden budget). A compiled row's link bound uses
the compiled model's own t_fwd and t_bwd. The link bound is
max(t_fwd, B/bw_d2h) + max(t_bwd, B/bw_h2d), with t_fwd and t_bwd measured without offloading, B
the bytes offload_activations moved per step, and bw the pinned copy bandwidth measured in this
run. ms/step: the median over --steps timed steps after --warmup steps, each step timed alone
(the GPU idle when it starts). b2b ms: then --steps more steps back to back under one timer,
per step, so that a step's host work at entry (hooks, torch.compile's guards and wrappers)
overlaps the previous step's GPU work as in a training loop that does not sync every step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchoffload import (  # noqa: E402
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    offload_activations,
)
from torchoffload.models import BlockStack  # noqa: E402


class _CompiledStats:
    """What a compiled-pass row reports (the graph ops count the bytes)."""

    def __init__(self, offloaded_bytes: int):
        self.offloaded_bytes = offloaded_bytes
        self.compute_wait_ms = None


def _compiled(model, mode: str, hidden_bytes: int):
    import torchoffload.compile as toc

    torch._dynamo.reset()
    if mode == "compiled":
        return torch.compile(model)
    config = toc.ActivationPassConfig(
        max_offload_bytes=hidden_bytes if mode == "compiled_pass_hidden" else None
    )
    return torch.compile(model, backend=toc.backend(config))


SHAPES = {
    "issue": [(4096, 8, 4, 2048), (2048, 12, 8, 2048), (1024, 16, 8, 1024)],
    "tiny": [(128, 2, 2, 64)],
}
GIB = 1 << 30


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t) * 1e3


def copy_bandwidth(nbytes: int = GIB, reps: int = 5) -> tuple[float, float]:
    """Pinned host <-> device copy bandwidth in GB/s (median), each direction alone."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for src, dst in ((dev, host), (host, dev)):
        times = []
        for _ in range(reps + 1):
            with Timer(dev.device) as t:
                dst.copy_(src, non_blocking=True)
            times.append(t.ms)
        out.append(nbytes / (statistics.median(times[1:]) * 1e-3) / 1e9)
    return out[0], out[1]


def run_mode(
    model,
    x,
    mode,
    pool,
    steps,
    warmup,
    device,
    phases=False,
    windows=None,
    layer_config=None,
    hidden_bytes=0,
):
    """Median ms/step (one timer around forward + backward, no sync inside the step) and peak
    memory. With ``phases``, forward and backward are timed separately instead (a sync between
    them), which is how t_fwd and t_bwd of the link bound are measured."""
    layers = model.layers
    handle = None
    if layer_config is not None:
        handle = apply_activation_offloading(model, layers=layers, config=layer_config, pool=pool)

    fn = _compiled(model, mode, hidden_bytes) if mode.startswith("compiled") else model
    if mode.startswith("compiled_pass"):
        import torchoffload.compile as toc

        toc.set_op_pool(pool)

    def forward():
        if mode != "checkpoint":
            return fn(x).float().pow(2).mean()
        h = x
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return h.float().pow(2).mean()

    is_cuda = device.type == "cuda"

    def make_ctx():
        if mode == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=is_cuda)
        if mode.startswith("offload_activations"):
            kw = {}
            if windows is not None:
                kw = {"prefetch_bytes": windows[0] << 20, "max_inflight_bytes": windows[1] << 20}
            return offload_activations(pool=pool, **kw)
        return contextlib.nullcontext()

    def train_step(ctx):
        with ctx:
            loss = forward()
        loss.backward()
        model.zero_grad(set_to_none=True)

    stats = None
    times, fwd_times, bwd_times = [], [], []
    for i in range(warmup + steps):
        if i == warmup and is_cuda:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
        ctx = make_ctx()
        if handle is not None:
            handle.reset_stats()
        if mode.startswith("compiled_pass"):
            toc.reset_op_stats()
        if phases:
            with Timer(device) as fwd, ctx:
                loss = forward()
            with Timer(device) as bwd:
                loss.backward()
            model.zero_grad(set_to_none=True)
            del loss
            if i >= warmup:
                fwd_times.append(fwd.ms)
                bwd_times.append(bwd.ms)
        else:
            with Timer(device) as step:
                train_step(ctx)
            if i >= warmup:
                times.append(step.ms)
        if mode.startswith("offload_activations"):
            stats = ctx.stats()
        elif handle is not None:
            stats = handle.stats()
        elif mode.startswith("compiled_pass"):
            stats = _CompiledStats(toc.op_stats().offloaded_bytes)
    peak = torch.cuda.max_memory_allocated() if is_cuda else 0
    b2b_ms = float("nan")
    if not phases:
        # The same steps back to back, one timer around them all: a step's host work at entry
        # (hooks, torch.compile's guards and wrappers) overlaps the previous step's GPU work,
        # as in a training loop that does not sync every step.
        with Timer(device) as run:
            for _ in range(steps):
                train_step(make_ctx())
        b2b_ms = run.ms / steps
    if handle is not None:
        handle.remove()
    if mode.startswith("compiled"):
        del fn
        torch._dynamo.reset()
    if phases:
        return {"fwd_ms": statistics.median(fwd_times), "bwd_ms": statistics.median(bwd_times)}
    return {"ms": statistics.median(times), "b2b_ms": b2b_ms, "peak": peak, "stats": stats}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="issue")
    p.add_argument("--only", default="", help="comma-separated shape names (h1024,...)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--modes",
        default="none,save_on_cpu,checkpoint,offload_activations,layers,"
        "layers_hidden_spread,layers_hidden_largest,layers_hidden_earliest",
        help="comma-separated; 'none' is always run (the baseline)",
    )
    p.add_argument(
        "--windows",
        default="",
        help="extra offload_activations rows, 'PREFETCH:INFLIGHT' MiB pairs, comma-separated",
    )
    p.add_argument(
        "--hidden-gib",
        type=float,
        default=None,
        help="the hidden budget in GiB (default: d2h bandwidth x the measured t_fwd)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write raw results here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = ["none"] + [m for m in args.modes.split(",") if m != "none"]
    windows = [tuple(int(v) for v in w.split(":")) for w in args.windows.split(",") if w]
    pool = PinnedPool(48 * GIB if device.type == "cuda" else 1 * GIB, slab_bytes=1 * GIB)
    if device.type == "cuda":
        d2h, h2d = copy_bandwidth()
        gpu = torch.cuda.get_device_name()
    else:
        d2h = h2d = float("nan")
        gpu = "cpu"
    print(
        f"# {datetime.date.today()} {gpu}, torch {torch.__version__}, {dtype}; "
        f"pinned copy bandwidth d2h {d2h:.1f} GB/s, h2d {h2d:.1f} GB/s"
    )
    rows = []
    only = {o for o in args.only.split(",") if o}
    for hidden, nlayers, batch, seq in SHAPES[args.shapes]:
        if only and f"h{hidden}" not in only:
            continue
        torch.manual_seed(0)
        model = BlockStack(hidden, nlayers, heads=max(1, hidden // 128)).to(device, dtype)
        x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
        shape = f"h{hidden} L{nlayers} b{batch} s{seq}"
        phases = run_mode(model, x, "none", pool, args.steps, args.warmup, device, phases=True)
        # the budget a link can hide behind forward compute: bytes = bw x t_fwd
        hidden = int(d2h * 1e6 * phases["fwd_ms"]) if device.type == "cuda" else 1 << 20
        if args.hidden_gib is not None:
            hidden = int(args.hidden_gib * GIB)
        layer_modes = {
            "layers": ActivationOffloadConfig(),
            "layers_hidden_spread": ActivationOffloadConfig(
                max_offload_bytes=hidden, budget_policy="spread"
            ),
            "layers_hidden_largest": ActivationOffloadConfig(
                max_offload_bytes=hidden, budget_policy="largest"
            ),
            "layers_hidden_earliest": ActivationOffloadConfig(
                max_offload_bytes=hidden, budget_policy="earliest"
            ),
        }
        results = {}
        for m in modes:
            results[m] = run_mode(
                model,
                x,
                m,
                pool,
                args.steps,
                args.warmup,
                device,
                layer_config=layer_modes.get(m),
                hidden_bytes=hidden,
            )
        compiled_phases = None
        if any(m.startswith("compiled") for m in modes):
            compiled_phases = run_mode(
                model, x, "compiled", pool, args.steps, args.warmup, device, phases=True
            )
        for w in windows:
            results[f"offload_activations[{w[0]}:{w[1]}]"] = run_mode(
                model, x, "offload_activations", pool, args.steps, args.warmup, device, windows=w
            )
        results["none"].update(phases)
        base = results.get("none")

        def link_bound(nbytes, phases=base):
            if device.type != "cuda":
                return None
            fwd, bwd = phases["fwd_ms"], phases["bwd_ms"]
            return max(fwd, nbytes / d2h / 1e6) + max(bwd, nbytes / h2d / 1e6)

        off = results.get("offload_activations")
        ref_bound = link_bound(off["stats"].offloaded_bytes) if off else None
        print(
            f"{shape}: t_fwd {base['fwd_ms']:.1f} ms, t_bwd {base['bwd_ms']:.1f} ms, "
            f"hidden budget {hidden / GIB:.2f} GiB"
            + (
                f"; compiled t_fwd {compiled_phases['fwd_ms']:.1f} ms, "
                f"t_bwd {compiled_phases['bwd_ms']:.1f} ms"
                if compiled_phases
                else ""
            )
        )
        for m in results:
            r = results[m]
            moved = r["stats"].offloaded_bytes if r["stats"] else 0
            phases_m = compiled_phases if m.startswith("compiled") else base
            if m == "compiled":
                bound = None
            else:
                bound = link_bound(moved, phases_m) if r["stats"] else ref_bound
            rows.append(
                {
                    "shape": shape,
                    "mode": m,
                    "ms": r["ms"],
                    "b2b_ms": r["b2b_ms"],
                    "peak_gib": r["peak"] / GIB,
                    "saved_gib": (base["peak"] - r["peak"]) / GIB,
                    "x_none": r["ms"] / base["ms"] if base else float("nan"),
                    "x_bound": r["ms"] / bound if bound else float("nan"),
                    "offloaded_gib": moved / GIB,
                    "bound_ms": bound or float("nan"),
                    "wait_ms": (
                        r["stats"].compute_wait_ms
                        if r["stats"] and r["stats"].compute_wait_ms is not None
                        else float("nan")
                    ),
                    "prefetch": (
                        f"{r['stats'].prefetch_hits}/{r['stats'].prefetch_misses}"
                        f"/{r['stats'].resident_hits}"
                        if r["stats"] and hasattr(r["stats"], "prefetch_hits")
                        else ""
                    ),
                }
            )
        del model, x, results
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    header = (
        f"| {'shape':<22} | {'mode':<30} | {'ms/step':>8} | {'b2b ms':>7} | "
        f"{'peak GiB':>8} | {'saved':>6} | {'x none':>6} | {'x bound':>7} | {'bound ms':>8} | "
        f"{'offl GiB':>8} | {'wait ms':>7} | {'hit/miss/res':>12} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['shape']:<22} | {r['mode']:<30} | {r['ms']:>8.1f} | {r['b2b_ms']:>7.1f} | "
            f"{r['peak_gib']:>8.2f} | {r['saved_gib']:>6.2f} | {r['x_none']:>6.2f} | "
            f"{r['x_bound']:>7.2f} | {r['bound_ms']:>8.1f} | {r['offloaded_gib']:>8.2f} | "
            f"{r['wait_ms']:>7.1f} | "
            f"{r['prefetch']:>12} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"d2h": d2h, "h2d": h2d, "gpu": gpu, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
