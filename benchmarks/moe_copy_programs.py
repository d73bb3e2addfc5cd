"""How many programs `copy_routed` (stream_experts' graph-mode copy kernel) should run: its rate
over the link (mapped pinned host memory) and between device addresses, alone and beside a
captured graph of decode-sized compute, whose slowdown it prints (Note: [How many programs copy
over the link] in torchoffload/moe/_kernels.py). CUDA only.

    PYTHONPATH=. python3 benchmarks/moe_copy_programs.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchoffload.moe._kernels import copy_routed

DEV = torch.device("cuda")
SIZES = [2048 * 1536 * 2, 768 * 2048 * 2]  # a Qwen3-30B-A3B expert's two members, bytes
PLACES = 8  # one token's routed experts
TOTAL = PLACES * sum(SIZES)


def addresses(base: int) -> torch.Tensor:
    out, off = [], 0
    for _ in range(PLACES):
        row = []
        for n in SIZES:
            row.append(base + off)
            off += n
        out.append(row)
    return torch.tensor(out, dtype=torch.int64, device=DEV)


def timed(fn, stream) -> tuple:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    with torch.cuda.stream(stream):
        fn()
    b.record(stream)
    return a, b


def main() -> None:
    host = torch.full((TOTAL,), 3, dtype=torch.uint8, pin_memory=True)
    device_src = torch.full((TOTAL,), 5, dtype=torch.uint8, device=DEV)
    stage = torch.empty(TOTAL, dtype=torch.uint8, device=DEV)
    srcs = {"host": addresses(host.data_ptr()), "device": addresses(device_src.data_ptr())}
    dst = addresses(stage.data_ptr())
    every = torch.ones(PLACES, dtype=torch.bool, device=DEV)
    none = ~every
    w1 = [torch.randn(1536, 2048, dtype=torch.bfloat16, device=DEV) for _ in range(4)]
    w2 = [torch.randn(2048, 768, dtype=torch.bfloat16, device=DEV) for _ in range(4)]
    x = torch.randn(1, 2048, dtype=torch.bfloat16, device=DEV)

    def compute(n: int = 100) -> torch.Tensor:  # decode-sized expert MLPs and a norm
        y = x
        for i in range(n):
            g, u = F.linear(y, w1[i % 4]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, w2[i % 4]) * 0.5 + y
            y = y / (y.float().pow(2).mean().sqrt().to(y.dtype) + 1)
        return y

    for src in srcs.values():
        copy_routed(src, dst, every, dst, none, SIZES)
    torch.cuda.synchronize()
    assert torch.equal(stage, device_src)
    copy_routed(srcs["host"], dst, every, dst, none, SIZES)
    torch.cuda.synchronize()
    assert torch.equal(stage.cpu(), host), "the copy over the link is wrong"
    compute()
    graph, cap = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap), torch.cuda.graph(graph, stream=cap):
        compute()
    torch.cuda.synchronize()
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    alone = float("inf")
    for _ in range(5):
        a, b = timed(graph.replay, main_stream)
        torch.cuda.synchronize()
        alone = min(alone, a.elapsed_time(b))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; compute alone "
          f"{alone:.3f} ms; {TOTAL / 1e6:.1f} MB a copy")  # fmt: skip
    print("| from | programs | GB/s alone | GB/s beside compute | compute x alone |")
    print("|---|---:|---:|---:|---:|")
    for kind, src in srcs.items():
        reps = 3 if kind == "host" else 60  # each lasts about as long as the compute

        for programs in (16, 32, 64, 128, 256):

            def one(src=src, programs=programs):
                copy_routed(src, dst, every, dst, none, SIZES, programs)

            best = float("inf")
            for _ in range(3):
                a, b = timed(one, main_stream)
                torch.cuda.synchronize()
                best = min(best, a.elapsed_time(b))
            side.wait_stream(main_stream)
            ca, cb = timed(lambda one=one, reps=reps: [one() for _ in range(reps)], side)
            ka, kb = timed(graph.replay, main_stream)
            torch.cuda.synchronize()
            beside = reps * TOTAL / ca.elapsed_time(cb) / 1e6
            slow = ka.elapsed_time(kb) / alone
            print(f"| {kind} | {programs} | {TOTAL / best / 1e6:.1f} | {beside:.1f} | "
                  f"{slow:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
