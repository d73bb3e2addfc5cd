"""The host kernels of a clipped step, alone: the per-tensor gradient norms that
``max_grad_norm`` takes (on the calling thread, and on a pool of threads as
`OffloadedOptimizer` runs them: Note: [Gradient norms on a pool]), the multiply by the clip
coefficient, a copy and the fused AdamW step, over fp32 tensors laid out as the optimizer's
buckets. It also checks that a norm's bits do not depend on the intra-op thread count.

    python benchmarks/clip_kernels.py                         # 57 buckets of 4 x 14 M: 3.2 B
    python benchmarks/clip_kernels.py --buckets 4 --numel 100000 --reps 1   # quick

GB/s counts 4 bytes an element for a norm, 8 for a multiply or a copy, 28 for AdamW.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--buckets", type=int, default=57)
    p.add_argument("--per-bucket", type=int, default=4, help="tensors per bucket")
    p.add_argument("--numel", type=int, default=14_000_000, help="elements per tensor")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    n = args.buckets * args.per_bucket * args.numel
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} intra-op threads, {args.buckets} buckets of "
          f"{args.per_bucket} fp32 tensors of {args.numel} elements ({n / 1e9:.3f} B)")  # fmt: skip

    def tensors():
        return [[torch.empty(args.numel).uniform_() for _ in range(args.per_bucket)]
                for _ in range(args.buckets)]  # fmt: skip

    grads, params, exp_avg, exp_avg_sq = tensors(), tensors(), tensors(), tensors()
    steps = [[torch.tensor(1.0) for _ in range(args.per_bucket)] for _ in range(args.buckets)]
    flat = [g for bucket in grads for g in bucket]
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    coefficient = torch.tensor(0.5)

    def adamw():
        for p_, g, m, v, s in zip(params, grads, exp_avg, exp_avg_sq, steps, strict=True):
            torch._fused_adamw_(p_, g, m, v, [], s, lr=1e-5, beta1=0.9, beta2=0.999,
                                weight_decay=0.01, eps=1e-8, amsgrad=False,
                                maximize=False)  # fmt: skip

    kernels = [
        ("norm, foreach per bucket", 4, lambda: [torch._foreach_norm(b, 2.0) for b in grads]),
        ("norm, on a pool", 4,
         lambda: [f.result() for f in [pool.submit(torch._foreach_norm, [g], 2.0)
                                       for g in flat]]),
        ("multiply by the coefficient", 8,
         lambda: [torch._foreach_mul_(b, coefficient) for b in grads]),
        ("copy", 8, lambda: [[a.copy_(b) for a, b in zip(pa, ga, strict=True)]
                             for pa, ga in zip(params, grads, strict=True)]),
        ("fused AdamW", 28, adamw),
    ]  # fmt: skip
    print("| kernel | ms | GB/s |")
    print("|---|---|---|")
    for name, nbytes, fn in kernels:
        best = float("inf")
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        print(f"| {name} | {best * 1e3:.3f} | {nbytes * n / 1e9 / best:.1f} |")
    # The same bits whatever the thread count, and whichever thread computes it
    want = [torch._foreach_norm([g], 2.0)[0] for g in flat]
    torch.set_num_threads(1)
    one = [torch._foreach_norm([g], 2.0)[0] for g in flat]
    torch.set_num_threads(threads)
    pooled = [f.result()[0] for f in [pool.submit(torch._foreach_norm, [g], 2.0) for g in flat]]
    listed = torch._foreach_norm(flat, 2.0)
    same = all(torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
               for a, b, c, d in zip(want, one, pooled, listed, strict=True))  # fmt: skip
    print(f"norm bits equal with 1 and {threads} threads, on the pool and over one list: {same}")
    pool.shutdown()


if __name__ == "__main__":
    main()
