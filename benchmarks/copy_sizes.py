"""Pinned host-to-device copy speed by copy size: eager, replayed as a CUDA graph, and replayed
with the weight pipeline's waits between a copy stream and a compute stream.

    python benchmarks/copy_sizes.py                  # sizes 0.5 2 5.5 8 32 MiB, 1 GiB each

For each size, ``--total`` MiB are copied as back-to-back copies of that size from distinct
offsets of one pinned buffer into one device buffer (as the weight store and the arena):

- ``eager``: queued on a side stream, one call each;
- ``graph``: the same copies captured on that stream and replayed;
- ``graph+waits``: captured as the weight runtime captures a call: copy ``i`` on the copy
  stream, then on the compute stream a wait on its event and a small kernel (a unit's
  compute), and copy ``i + 2`` waits on the compute event after kernel ``i`` (a ring of
  three places): the cross-stream edges of a streamed replay.

GB/s is bytes over the device time between events around the copies (the graph rows: the
whole replay). Run on a GPU; prints one row per size and mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

MIB = 1 << 20


def timed(fn, stream, repeat: int) -> float:
    """Median device seconds of ``fn()`` queued on ``stream``."""
    out = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return sorted(out)[len(out) // 2]


def measure(size: int, total: int, repeat: int) -> dict[str, float]:
    n = max(1, total // size)
    host = torch.empty(n * size, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(n * size, dtype=torch.uint8, device="cuda")
    work = torch.zeros(1024, device="cuda")
    copy, compute = torch.cuda.Stream(), torch.cuda.Stream()
    pairs = [(dev[i * size : (i + 1) * size], host[i * size : (i + 1) * size]) for i in range(n)]

    def copies():
        with torch.cuda.stream(copy):
            for d, h in pairs:
                d.copy_(h, non_blocking=True)

    def pipeline():
        done: list[torch.cuda.Event] = []
        for i, (d, h) in enumerate(pairs):
            if i >= 2:
                copy.wait_event(done[i - 2])
            with torch.cuda.stream(copy):
                d.copy_(h, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copy)
            compute.wait_event(ready)
            with torch.cuda.stream(compute):
                work.add_(1.0)
            e = torch.cuda.Event()
            e.record(compute)
            done.append(e)
        copy.wait_stream(compute)

    rows = {}
    torch.cuda.synchronize()
    rows["eager"] = n * size / timed(copies, copy, repeat) / 1e9
    for name, body in (("graph", copies), ("graph+waits", pipeline)):
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side):
            copy.wait_stream(side)
            compute.wait_stream(side)
            body()
            side.wait_stream(copy)
            side.wait_stream(compute)
        replay_stream = torch.cuda.current_stream()
        rows[name] = n * size / timed(g.replay, replay_stream, repeat) / 1e9
        g.reset()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="*", default=[0.5, 2, 5.5, 8, 32], help="MiB")
    p.add_argument("--total", type=float, default=1024, help="MiB per measurement")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_sizes.py needs a GPU")
        return 1
    print(f"# {datetime.date.today()} {torch.cuda.get_device_name()} torch {torch.__version__}; "
          f"{args.total:.0f} MiB per row, median of {args.repeat}")  # fmt: skip
    print(f"{'MiB/copy':>9} {'copies':>7} {'eager GB/s':>11} {'graph GB/s':>11} "
          f"{'graph+waits GB/s':>17}")  # fmt: skip
    out = []
    for mib in args.sizes:
        size = int(mib * MIB) // 512 * 512
        r = measure(size, int(args.total * MIB), args.repeat)
        n = max(1, int(args.total * MIB) // size)
        out.append(dict(mib=mib, copies=n, **r))
        print(f"{mib:9.1f} {n:7d} {r['eager']:11.1f} {r['graph']:11.1f} {r['graph+waits']:17.1f}",
              flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
