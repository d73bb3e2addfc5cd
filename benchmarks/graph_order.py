"""A process's CUDA graphs replayed in capture order, plain torch: does the first graph
captured replay faster than later ones of the same work, and does the capture stream or the
replay stream matter? (CUDA only; about 10 s.)

    python benchmarks/graph_order.py

Each graph is a chain of 2000 ``t * 1.0001 + 0.5`` steps on 2048 floats (4000 kernels),
captured on a new pool stream (then on high-priority streams, then with a side stream
current), and replayed 20 times on the current stream and on its own capture stream: the
median host time of ``CUDAGraph.replay`` (the launch) and GPU time between events around it,
in ms. Measured on an H200 (torch 2.11.0+cu130, 2026-11-29; log
benchmarks/log/2026-11-29-moe-routing-kernel.md, "Session 42"): the first graph 3.72 ms, every
later one 4.42-4.51, whatever the streams. Used to tell the driver's behaviour from
stream_experts' own."""

import statistics
import time

import torch

dev = torch.device("cuda")
x = torch.randn(2048, device=dev)


def chain(t, n):
    for _ in range(n):
        t = t * 1.0001 + 0.5
    return t


def capture(stream, n=2000, mode="global"):
    g = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x, 3)
        g.capture_begin(capture_error_mode=mode)
        out = chain(x, n)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return g, out


def timeit(g, reps=20, on=None):
    gpu, launch = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        s = on or torch.cuda.current_stream()
        with torch.cuda.stream(s):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            g.replay()
            launch.append((time.perf_counter() - t0) * 1e3)
            b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b))
    return round(statistics.median(launch), 3), round(statistics.median(gpu), 3)


keep = []
for i in range(12):
    s = torch.cuda.Stream(dev)
    g, out = capture(s, mode="thread_local")
    keep.append((g, out, s))
    print(
        f"pool stream #{i} id {s.stream_id}: replay on current {timeit(g)}, "
        f"on its capture stream {timeit(g, on=s)}",
        flush=True,
    )
for i in range(3):
    s = torch.cuda.Stream(dev, priority=-1)
    g, out = capture(s)
    keep.append((g, out, s))
    print(f"high-priority stream #{i}: replay on current {timeit(g)}", flush=True)
side = torch.cuda.Stream(dev)
with torch.cuda.stream(side):
    for i in range(3):
        g, out = capture(torch.cuda.Stream(dev))
        keep.append((g, out, None))
        print(f"replayed on a side current stream #{i}: {timeit(g)}", flush=True)
