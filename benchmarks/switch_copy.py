"""Copies chosen on the device but made by the copy engine (a probe for issue 41's graph rows):
per routed place, a CUDA SWITCH conditional node (CUDA 12.8+) whose body ``e`` copies expert
``e``'s members from pinned host memory into the place's stage slot; one kernel before them
sets every place's switch from the routing on the device (``switch_copy.cu``, built with
nvcc). Compared with the same bytes copied by plain memcpy nodes (fixed sources) and by
`copy_routed`, the Triton kernel graph mode copies with today (about 48 GB/s against the copy
engine's 55 in earlier runs), and checked: the stage holds the routed experts' bytes.

    PYTHONPATH=. python3 benchmarks/switch_copy.py [--layers 8] [--experts 128] [--k 8]

Written in session 43 (2026-11-30) and compiled there with nvcc 13.0 on a machine without a
GPU: not yet run on one. It prints one line per measurement and "FAILED ..." where a step
fails (the CUDA error, and where: 1000 x the step + the error code).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(nvcc: str) -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "libswitch.so"
    src = Path(__file__).with_name("switch_copy.cu")
    cmd = [nvcc, "-O2", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared",
           "-o", str(out), str(src)]  # fmt: skip
    subprocess.run(cmd, check=True)
    torch.cuda.init()  # torch's libcudart.so.13 first: the library binds to the same one
    lib = ctypes.CDLL(str(out))
    lib.add_routed_copies.restype = ctypes.c_int
    return lib


def array(kind, values):
    return (kind * len(values))(*values)


def time_graph(g: torch.cuda.CUDAGraph, n: int = 20) -> float:
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 0
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    lib = build(nvcc)
    dev = torch.device("cuda")
    E, K = args.experts, args.k
    sizes = [2 * args.width * args.hidden * 2, args.width * args.hidden * 2]  # gate_up, down
    expert = sum(sizes)
    host = torch.empty(E, expert, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.arange(E, dtype=torch.uint8).unsqueeze(1).expand(E, expert))
    stage = torch.zeros(K, expert, dtype=torch.uint8, device=dev)
    routed = torch.randperm(E)[:K].to(dev)
    miss = torch.ones(K, dtype=torch.uint8, device=dev)
    src = array(ctypes.c_ulonglong, [host[e].data_ptr() + off for e in range(E)
                                     for off in (0, sizes[0])])  # fmt: skip
    dst = array(ctypes.c_ulonglong, [stage[r].data_ptr() + off for r in range(K)
                                     for off in (0, sizes[0])])  # fmt: skip
    nbytes = array(ctypes.c_ulonglong, sizes)
    side = torch.cuda.Stream()
    print(f"{torch.__version__}, {torch.cuda.get_device_name()}, {E} experts of {expert} bytes, "
          f"{K} routed", flush=True)  # fmt: skip

    def capture(fn):
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(g, stream=side):
            fn()
        return g, time.perf_counter() - t0

    def switches(layers: int, chain: int, with_miss: bool = True):
        def fn():
            for _ in range(layers):
                rc = lib.add_routed_copies(
                    ctypes.c_void_p(side.cuda_stream), K, E, 2, src, dst, nbytes,
                    ctypes.c_void_p(routed.data_ptr()),
                    ctypes.c_void_p(miss.data_ptr() if with_miss else None), chain,
                )  # fmt: skip
                if rc:
                    raise RuntimeError(f"add_routed_copies: {rc}")
                stage[:, :1].add_(0)  # a kernel between layers, as a block's compute

        return fn

    def report(name, ms, layers=1):
        gbs = K * expert * layers / ms / 1e6
        print(f"{name}: {ms:.3f} ms, {gbs:.1f} GB/s of routed bytes", flush=True)

    try:

        def plain():
            for r in range(K):
                stage[r].copy_(host[int(routed[r])], non_blocking=True)

        g, _ = capture(plain)
        report("memcpy nodes, fixed sources (copy engine)", time_graph(g))
        from torchoffload.moe._kernels import copy_routed

        srcs = torch.tensor([[host[int(routed[r])].data_ptr() + o for o in (0, sizes[0])]
                             for r in range(K)], dtype=torch.int64, device=dev)  # fmt: skip
        dsts = torch.tensor([[stage[r].data_ptr() + o for o in (0, sizes[0])] for r in range(K)],
                            dtype=torch.int64, device=dev)  # fmt: skip
        flag = torch.ones(K, dtype=torch.bool, device=dev)
        no = torch.zeros(K, dtype=torch.bool, device=dev)
        copy_routed(srcs, dsts, flag, dsts, no, sizes)  # compiled outside the capture
        g, _ = capture(lambda: copy_routed(srcs, dsts, flag, dsts, no, sizes))
        report("copy_routed, the Triton kernel (SMs read mapped host memory)", time_graph(g))
        for chain in (0, 1):
            stage.zero_()
            g, took = capture(switches(1, chain))
            ms = time_graph(g)
            ok = all(bool((stage[r] == int(routed[r])).all()) for r in range(K))
            report(f"switch nodes, 1 layer, {'chained' if chain else 'side by side'} "
                   f"(captured in {took:.2f} s; stage right: {ok})", ms)  # fmt: skip
            routed.copy_(torch.randperm(E)[:K].to(dev))
            g.replay()
            torch.cuda.synchronize()
            ok = all(bool((stage[r] == int(routed[r])).all()) for r in range(K))
            print(f"  routed again, replayed: stage right: {ok}", flush=True)
        g, took = capture(switches(args.layers, 0))
        report(f"switch nodes, {args.layers} layers (captured in {took:.2f} s)",
               time_graph(g, 5), args.layers)  # fmt: skip
        miss.zero_()
        ms = time_graph(g, 5)
        print(f"  no miss: {ms:.3f} ms ({ms / args.layers * 1e3:.1f} us a layer: the set kernel "
              "and the switches alone, and the kernel between)", flush=True)  # fmt: skip
    except Exception as e:  # a probe: report and stop
        print(f"FAILED: {type(e).__name__}: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
