"""Host time of eager one-token MoE calls: what `stream_experts` adds to each block call over the
resident model, with its expert copies taken out of the picture.

A Qwen3-MoE of tiny width (hidden 64, expert width 32) and the expert count and top-k of the
30B shape (128, 8): its kernels cost next to nothing, so the time per call is the host's (its
Python and each operation's dispatch or launch), as in a batch-1 decode step that is host-bound.
Three models, the same weights: resident, `stream_experts` at the least cache (every routed
expert copied at each call) and at a cache holding every expert (no copy). Runs are
interleaved, the best of ``--repeats`` kept; on a CPU, one intra-op thread and CPU time.
Prints ms per call and the microseconds each streamed block call adds over the resident one.

    PYTHONPATH=. python3 benchmarks/moe_eager_host.py [--device cpu|cuda] [--impl grouped_mm]
        [--dtype bfloat16] [--layers 8] [--experts 128] [--top-k 8] [--calls 100] [--repeats 7]
        [--profile 25] [--paired]

``--profile N`` then runs each model's calls once more under cProfile and prints its N
functions of most own time (where the host time goes; the profiler's own cost inflates small
functions). ``--paired`` times each call alone instead (synchronized before and after), the
models in turn per call, and prints the median over calls of what a streamed call adds to the
resident call beside it: the GPU machine's host speed drifted by up to 2x between processes
and within one (resident calls of 12 to 24 ms, 2026-11-29), which best-of-N runs of each
model in a block do not cancel.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import time

import torch

import torchoffload as to


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=args.experts, num_experts_per_tok=args.top_k,
        max_position_embeddings=512, experts_implementation=args.impl,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).to(device, dtype).eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impl", default="grouped_mm", choices=["grouped_mm", "eager", "batched_mm"])
    p.add_argument(
        "--dtype",
        default=None,
        help="default: bfloat16 on a GPU (the 30B shape's; "
        "torch's grouped GEMM in float32 there reads its offsets on the host), "
        "float32 on a CPU",
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--paired", action="store_true", help="each call timed, the models in turn")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    resident = build(args, device, dtype)
    models = {"resident": resident}
    for name in ("least cache", "every expert cached"):
        m = copy.deepcopy(resident).cpu()  # stream_experts moves the dense parts
        cache = to.minimum_cache_bytes(m) if name == "least cache" else 1 << 30
        to.stream_experts(m, device, cache_bytes=cache, pin_memory=device.type == "cuda")
        models[name] = m
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (1, 1), generator=g).to(device) for _ in range(args.calls)]

    # on a CPU the process's CPU time: other processes on a shared two-core machine moved the
    # wall time of the same run by 20-40%
    clock = time.process_time if device.type == "cpu" else time.perf_counter

    def run(model) -> float:
        with torch.no_grad():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = clock()
            for x in xs:
                model(x, use_cache=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return (clock() - start) / len(xs) * 1e3

    for model in models.values():  # warm-up
        run(model)
    if args.paired:
        return paired(args, models, xs, device)
    best = dict.fromkeys(models, float("inf"))
    for _ in range(args.repeats):
        for name, model in models.items():
            best[name] = min(best[name], run(model))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {datetime.date.today()} {gpu} torch {torch.__version__}; {args.impl}, {dtype}, "
          f"{args.layers} layers x {args.experts} experts (top {args.top_k}), hidden 64, "
          f"{args.calls} one-token calls, best of {args.repeats}")  # fmt: skip
    print("| model | ms per call | us added per block call |")
    print("|---|---:|---:|")
    for name, ms in best.items():
        added = "-" if name == "resident" else f"{(ms - best['resident']) / args.layers * 1e3:.0f}"
        print(f"| {name} | {ms:.2f} | {added} |")
    if args.profile:
        profile(models, run, args.profile)
    return 0


def paired(args: argparse.Namespace, models: dict, xs: list, device: torch.device) -> int:
    """Each call of each model timed on its own (synchronized before and after), the models in
    turn per call, the order rotated: the median over calls of what each streamed call adds
    to the resident call next to it (the host's speed drifts between runs and processes)."""
    names = list(models)
    ms: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for _ in range(args.repeats):
            for i, x in enumerate(xs):
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    models[name](x, use_cache=False)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    ms[name].append((time.perf_counter() - t) * 1e3)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {datetime.date.today()} {gpu} torch {torch.__version__}; {args.impl}, "
          f"{args.layers} layers x {args.experts} experts (top {args.top_k}), hidden 64, "
          f"{len(ms['resident'])} one-token calls each, in turn; medians")  # fmt: skip
    print("| model | ms per call | us added per block call (median of pairs) |")
    print("|---|---:|---:|")
    for name in names:
        v = ms[name]
        diff = [a - r for a, r in zip(v, ms["resident"], strict=True)]
        added = "-" if name == "resident" else f"{statistics.median(diff) / args.layers * 1e3:.0f}"
        print(f"| {name} | {statistics.median(v):.2f} | {added} |")
    return 0


def profile(models: dict, run, top: int) -> None:
    """Each model's calls under cProfile: its ``top`` functions by own time."""
    import cProfile
    import pstats

    for name, model in models.items():
        prof = cProfile.Profile()
        prof.enable()
        run(model)
        prof.disable()
        print(f"\n## cProfile: {name}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    raise SystemExit(main())
