"""Loading a safetensors checkpoint into the pinned host store, against reading the file.

    python benchmarks/load.py [--gib 4] [--dir /tmp/torchoffload-load]

Writes a checkpoint of ``--gib`` GiB (bf16 ``nn.Linear(8192, 8192)`` blocks, random values),
reads it once to warm the page cache, then times, each in a fresh process:
- ``read``: the file read with ``readinto`` into one new pageable host buffer (the speed of
  reading it, the destination's page faults included);
- ``read_prefaulted``: the same into a buffer whose pages were touched first (the copy out of
  the page cache alone);
- ``pin``: allocating and page-locking a buffer of the file's size alone (cudaHostRegister);
- ``stream_weights``: a model built on the meta device streamed from the checkpoint
  (``checkpoint=``): host store allocated, page-locked and filled, hooks installed; its
  ``stats().setup_s``.
Peak host memory is the process's VmHWM; "over start" subtracts its value before the timed
part (after importing torch, building the meta model and initializing CUDA).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN = 8192


def model_on_meta(blocks: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(blocks))).to(
            torch.bfloat16
        )


def write(path: Path, blocks: int) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    state = {
        f"{i}.weight": torch.randn(HIDDEN, HIDDEN, generator=g).to(torch.bfloat16)
        for i in range(blocks)
    }
    save_file(state, str(path))


def hwm() -> int:
    """Peak resident bytes of this process (VmHWM: reset by exec, unlike ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(mode: str, path: Path, blocks: int) -> dict:
    base = hwm()
    size = path.stat().st_size
    if mode in ("read", "read_prefaulted"):
        buf = torch.empty(size, dtype=torch.uint8)
        if mode == "read_prefaulted":
            buf.zero_()  # the destination's pages exist: only the copy out of the page cache
            base = hwm()
        view = memoryview(buf.numpy())
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                done += f.readinto(view[done : done + (64 << 20)])
        seconds = time.perf_counter() - t0
    elif mode == "pin":  # the page-locking part of stream_weights alone
        from torchoffload._pool import pinned_buffer

        torch.cuda.init()
        base = hwm()
        t0 = time.perf_counter()
        buf = pinned_buffer(size, pin=True)
        seconds = time.perf_counter() - t0
    else:
        from torchoffload import stream_weights

        model = model_on_meta(blocks)
        torch.cuda.init()
        base = hwm()
        handle = stream_weights(model, "cuda", budget_bytes=3 * HIDDEN * HIDDEN * 2 + (4 << 20),
                                checkpoint=path)  # fmt: skip
        seconds = handle.stats().setup_s
        peak = hwm()  # remove() puts the values back on the host: a second copy, not loading
        handle.remove()
        return {"mode": mode, "seconds": seconds, "bytes": size, "peak_rss": peak, "base_rss": base}
    peak = hwm()
    return {"mode": mode, "seconds": seconds, "bytes": size, "peak_rss": peak, "base_rss": base}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0, help="checkpoint size in GiB (default 4)")
    p.add_argument("--dir", type=Path, default=Path("/tmp/torchoffload-load"))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    blocks = max(1, round(args.gib * 2**30 / (HIDDEN * HIDDEN * 2)))
    path = args.dir / "model.safetensors"
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), blocks)))
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.stat().st_size < blocks * HIDDEN * HIDDEN * 2:
        write(path, blocks)
    with open(path, "rb") as f:  # warm the page cache
        while f.read(256 << 20):
            pass
    rows = []
    modes = ("read", "read_prefaulted", "pin", "stream_weights")
    for mode in modes + modes:
        out = subprocess.run(
            [sys.executable, __file__, "--gib", str(args.gib), "--dir", str(args.dir),
             "--child", mode, str(path)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    gib = 2**30
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"load on {name}, torch {torch.__version__}; checkpoint {rows[0]['bytes'] / gib:.2f} GiB")
    print(f"{'mode':<16}{'seconds':>9}{'GB/s':>8}{'peak RSS GiB':>14}{'RSS over start GiB':>20}")
    for r in rows:
        gbps = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else float("nan")
        print(
            f"{r['mode']:<16}{r['seconds']:>9.2f}{gbps:>8.2f}{r['peak_rss'] / gib:>14.2f}"
            f"{(r['peak_rss'] - r['base_rss']) / gib:>20.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
