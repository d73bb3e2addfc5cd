"""Host time that weight streaming adds per unit (Python hooks, binding, bookkeeping).

    python benchmarks/weights_overhead.py [--units 200] [--device cpu|cuda]

A chain of tiny ``nn.Linear(8, 8)`` units (two tensors each) so that compute is negligible:
the difference to the resident model is the per-unit cost. Two settings: a budget that keeps
every unit (no copies), and a budget of four units (a copy per unit).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchoffload import stream_weights  # noqa: E402


def per_call(model, x, device, reps=200) -> float:
    with torch.inference_mode():
        for _ in range(20):
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--units", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    n = args.units
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)]).eval().to(device)
    x = torch.randn(1, 8, device=device)
    resident = per_call(model, x, device)
    h = stream_weights(model, device, budget_bytes=1 << 30)
    kept = per_call(model, x, device)
    assert h.stats().kept_units == n
    h.remove()
    h = stream_weights(model, device, budget_bytes=4 * 1024, prefetch_depth=2)
    streamed = per_call(model, x, device)
    st = h.stats()
    h.remove()
    print(f"# torch {torch.__version__}, device {device}, {n} units of 2 tensors")
    print("| setting | us/unit | added us/unit |")
    print("|---|---:|---:|")
    print(f"| resident | {resident * 1e6 / n:.1f} | - |")
    print(
        f"| stream_weights, all kept | {kept * 1e6 / n:.1f} | {(kept - resident) * 1e6 / n:.1f} |"
    )
    print(
        f"| stream_weights, 4-unit budget ({st.kept_units} kept) | {streamed * 1e6 / n:.1f} | "
        f"{(streamed - resident) * 1e6 / n:.1f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
