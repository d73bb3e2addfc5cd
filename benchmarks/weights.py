"""Weight streaming for inference on a GPT-style stack: time per forward against the fully
resident model, accelerate's cpu_offload and the link bound.

    python benchmarks/weights.py                # the issue's model: 16 blocks of hidden 8192, bf16
    python benchmarks/weights.py --size tiny    # a smoke run (CPU or GPU)

Rows per input shape: resident (all weights on the device), accelerate ``cpu_offload`` (if
installed), and ``torchoffload.stream_weights`` at each budget. Columns: ms per forward (median
of --reps timings of --steps back-to-back forwards), GB/s of weights moved to the device, the
ratio of the bound ``max(t_resident, h2d_bytes / bw)`` to the measured time (1.0 = at the bound),
with bw the pinned host-to-device bandwidth measured in this run, and the peak device memory.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchoffload import stream_weights  # noqa: E402
from torchoffload.models import BlockStack  # noqa: E402

GIB = 1 << 30
SIZES = {
    # hidden, layers, heads, shapes (batch, seq), budgets (GiB)
    "issue": (8192, 16, 64, [(1, 512), (16, 2048)], [2, 4, 8]),
    "tiny": (256, 4, 4, [(1, 16), (4, 64)], [0.0025, 0.005, 0.01]),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forwards(model, x, steps: int, reps: int, device: torch.device) -> float:
    """Median ms per forward over ``reps`` runs of ``steps`` back-to-back forwards."""
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(steps):
                model(x)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times)


def h2d_bandwidth(device: torch.device, nbytes: int = GIB) -> float:
    """Pinned host-to-device copy bandwidth in GB/s (median of 5)."""
    if device.type != "cuda":
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="issue")
    p.add_argument("--steps", type=int, default=3, help="forwards per timing")
    p.add_argument("--reps", type=int, default=3, help="timings per row (median)")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--no-accelerate", action="store_true")
    p.add_argument(
        "--exported",
        action="store_true",
        help="also torchoffload.compile.stream_exported_weights on the first input shape",
    )
    p.add_argument("--json", type=Path, default=None, help="also write raw results here")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden, layers, heads, shapes, budgets = SIZES[args.size]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = BlockStack(hidden, layers, heads).eval()
    torch.set_default_dtype(torch.float32)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = h2d_bandwidth(device)
    inputs = {
        s: torch.randn(*s, hidden, dtype=torch.bfloat16, device=device) for s in shapes
    }  # fmt: skip
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"# {datetime.date.today()} {gpu} torch {torch.__version__}; weights "
        f"{weight_bytes / GIB:.2f} GiB bf16 ({layers} blocks, hidden {hidden}); "
        f"pinned H2D {bw:.1f} GB/s",
        flush=True,
    )
    rows = []

    def streamed_row(shape, x, name, run, h, setup_s, kind):
        """Two warm-up calls, then time ``run`` and add a row from its handle ``h``."""
        with torch.inference_mode():
            run(x)
            run(x)
        reset_peak(device)
        h.reset_stats()
        ms = time_forwards(run, x, args.steps, args.reps, device)
        st = h.stats()
        row(
            shape, name, ms, st.h2d_bytes / max(st.calls, 1), peak_gib(device),
            units=f"{st.units} {kind}", kept=st.kept_units, misses=st.misses,
            arena_gib=round(st.arena_bytes / GIB, 2), setup_s=round(setup_s, 1),
        )  # fmt: skip

    def row(shape, name, ms, moved, peak, **extra):
        link_ms = moved / (bw * 1e9) * 1e3 if bw == bw else 0.0  # bw is nan on the CPU
        bound = max(resident_ms[shape], link_ms)
        r = dict(
            shape=f"{shape[0]}x{shape[1]}", mode=name, ms=round(ms, 2),
            gbps=round(moved / (ms * 1e-3) / 1e9, 1) if moved else None,
            moved_gib=round(moved / GIB, 2), of_bound=round(bound / ms, 3),
            peak_gib=round(peak, 2), **extra,
        )  # fmt: skip
        rows.append(r)
        print(r, flush=True)

    # 1. resident
    resident_ms = {}
    for shape, x in inputs.items():
        with torch.inference_mode():
            model(x)
        reset_peak(device)
        resident_ms[shape] = time_forwards(model, x, args.steps, args.reps, device)
        row(shape, "resident", resident_ms[shape], 0, peak_gib(device))

    # 2. stream_weights at each budget (the model goes to the host and back each time)
    for budget_gib in budgets:
        budget = int(budget_gib * GIB)
        t0 = time.perf_counter()
        h = stream_weights(model, device, budget_bytes=budget, prefetch_depth=args.prefetch_depth)
        setup_s = time.perf_counter() - t0
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for shape, x in inputs.items():
            name = f"stream_weights {budget_gib:g} GiB"
            streamed_row(shape, x, name, model, h, setup_s, h.unit_kind)
        h.remove()
        del h
        gc.collect()

    # 3. the exported program with weight probes, on the first (bandwidth-bound) shape
    if args.exported:
        import torchoffload.compile as toc

        shape, x = next(iter(inputs.items()))
        ep = torch.export.export(model, (x,))
        for budget_gib in budgets:
            t0 = time.perf_counter()
            runner = toc.stream_exported_weights(
                ep, device, budget_bytes=int(budget_gib * GIB), prefetch_depth=args.prefetch_depth
            )
            setup_s = time.perf_counter() - t0
            name = f"exported probes {budget_gib:g} GiB"
            streamed_row(shape, x, name, runner, runner.handle, setup_s, "weights")
            runner.remove()
            del runner
            gc.collect()
        del ep

    # 4. accelerate's cpu_offload (last: it leaves the model on the meta device)
    if not args.no_accelerate:
        try:
            import accelerate
        except ImportError:
            print("# accelerate not installed: row skipped")
        else:
            if device.type == "cuda":
                t0 = time.perf_counter()
                accelerate.cpu_offload(model, execution_device=device)
                setup_s = time.perf_counter() - t0
                gc.collect()
                torch.cuda.empty_cache()
                for shape, x in inputs.items():
                    with torch.inference_mode():
                        model(x)
                    reset_peak(device)
                    ms = time_forwards(model, x, max(1, args.steps // 2), 2, device)
                    row(
                        shape, f"accelerate cpu_offload {accelerate.__version__}", ms,
                        weight_bytes, peak_gib(device), setup_s=round(setup_s, 1),
                    )  # fmt: skip

    print("\n| shape | mode | ms/fwd | GB/s | GiB moved/fwd | of bound | peak GiB | notes |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        notes = ", ".join(
            f"{k} {r[k]}" for k in ("units", "kept", "misses", "arena_gib", "setup_s") if k in r
        )
        print(
            f"| {r['shape']} | {r['mode']} | {r['ms']} | {r['gbps'] or '-'} | {r['moved_gib']} | "
            f"{r['of_bound'] if r['mode'] != 'resident' else '-'} | {r['peak_gib']} | {notes} |"
        )
    if args.json:
        args.json.write_text(json.dumps(dict(bw_gbps=bw, rows=rows), indent=1))
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
