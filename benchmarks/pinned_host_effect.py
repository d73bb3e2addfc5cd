"""Does holding a large pinned host allocation slow the host's own work? The host time of a
launch-bound loop (small GPU operations, as a host-bound decode step runs them) measured with
nothing held, with ``--gib`` GiB of pinned host memory held (as `stream_experts`' store holds
the experts), and with as much pageable memory held, interleaved, best of ``--repeats``. Prints
the machine's NUMA layout and memory first. Needs a GPU.

    PYTHONPATH=. python3 benchmarks/pinned_host_effect.py [--gib 54] [--ops 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch


def loop(ops: int) -> float:
    """us per operation of ``ops`` small elementwise operations on the device."""
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(ops // 2):
        x = x * 1.0001
        x = x + 0.5
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / ops * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=54.0)
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    for cmd in (["numactl", "-H"], ["free", "-g"]):
        try:
            print(subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"{cmd[0]}: {e}")
    nbytes = int(args.gib * 2**30)
    loop(args.ops)  # warm-up
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for held in ("nothing", "pinned", "pageable"):
            buf = None
            if held != "nothing":
                t0 = time.perf_counter()
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=held == "pinned")
                buf[::4096].fill_(1)  # every page touched
                made = time.perf_counter() - t0
            us = loop(args.ops)
            best[held] = min(best.get(held, float("inf")), us)
            if buf is not None:
                print(f"# {held} {args.gib} GiB made in {made:.1f} s; {us:.2f} us per op")
            del buf
    print(f"| held | us per operation (best of {args.repeats}) |")
    print("|---|---:|")
    for held, us in best.items():
        print(f"| {held} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
