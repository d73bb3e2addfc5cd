"""Host<->device copy bandwidth per GPU while every rank copies at once.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/link.py
    python benchmarks/link.py                                  # one GPU

Two GPUs of one host may share a PCIe switch or the host's memory bandwidth, so the link bound
of a multi-GPU offloading run is set by what each GPU gets while the others copy too. Each rank
copies a pinned buffer of ``--gib`` GiB to and from its GPU: one direction at a time, then both
directions at once (D2H and H2D on two streams), all ranks in lockstep.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def timed(fn, reps: int) -> float:
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(args.gib * 2**30)
    dev_a = torch.empty(n, dtype=torch.uint8, device=device)
    dev_b = torch.empty(n, dtype=torch.uint8, device=device)
    host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h():
        host_a.copy_(dev_a, non_blocking=True)

    def h2d():
        dev_b.copy_(host_b, non_blocking=True)

    def both():
        with torch.cuda.stream(s1):
            d2h()
        with torch.cuda.stream(s2):
            h2d()

    for fn in (d2h, h2d, both):
        fn()  # warm-up
    rows = [("D2H", timed(d2h, args.reps), 1), ("H2D", timed(h2d, args.reps), 1)]
    rows.append(("both at once (each way)", timed(both, args.reps), 1))
    result = torch.tensor([n / t / 1e9 for _, t, _ in rows], device=device)
    gathered = [torch.empty_like(result) for _ in range(world)]
    dist.all_gather(gathered, result)
    if rank == 0:
        print(f"{world} GPU(s) copying at once, {args.gib} GiB pinned buffers, GB/s per GPU")
        print(f"{'direction':<26}" + "".join(f"{'rank ' + str(r):>10}" for r in range(world)))
        for i, (name, _, _) in enumerate(rows):
            print(f"{name:<26}" + "".join(f"{g[i].item():>10.1f}" for g in gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
