"""torch.compile of a streamed model against eager streaming and the resident model (a first
measurement; the compiled rows of benchmarks/weights.py are issue 21's).

    PYTHONPATH=. python3 benchmarks/weights_compile.py

The demo GPT (hidden 1024, 8 layers, bf16), one forward of 2 x 64 tokens per call (no KV
cache), 50 calls timed after 5; streamed at a budget of a third of the weights. Rows: ms per
call and, for streamed rows, MiB copied per call.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchoffload import minimum_budget, stream_weights  # noqa: E402
from torchoffload.models import GPT, GPTConfig  # noqa: E402


def per_call(fn, x, n=50) -> float:
    with torch.inference_mode():
        for _ in range(5):
            fn(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn(x)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> int:
    torch.manual_seed(0)
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, vocab=1024, max_seq=1025)
    base = GPT(cfg).to(torch.bfloat16).eval()
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    x = torch.randint(0, cfg.vocab, (2, 64), device="cuda")
    rows = []
    resident = copy.deepcopy(base).cuda()
    for name, mode in [("eager resident", None), ("compiled resident", "default"),
                       ("compiled resident r-o", "reduce-overhead")]:  # fmt: skip
        torch._dynamo.reset()
        fn = resident if mode is None else torch.compile(resident, mode=mode)
        rows.append((name, per_call(fn, x), None))
    for name, mode in [("eager streamed", None), ("compiled streamed", "default"),
                       ("compiled streamed r-o", "reduce-overhead")]:  # fmt: skip
        model = copy.deepcopy(base)
        handle = stream_weights(
            model, "cuda", budget_bytes=max(weights // 3, minimum_budget(model))
        )
        torch._dynamo.reset()
        fn = model if mode is None else torch.compile(model, mode=mode)
        ms = per_call(fn, x)
        s = handle.stats()
        rows.append((name, ms, s.h2d_bytes / s.calls / 2**20))
        handle.remove()
    print(f"weights {weights / 2**20:.1f} MiB, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")  # fmt: skip
    print(f"{'mode':<24}{'ms/call':>9}{'MiB copied/call':>17}")
    for name, ms, mib in rows:
        print(f"{name:<24}{ms:>9.2f}{'' if mib is None else f'{mib:.1f}':>17}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
