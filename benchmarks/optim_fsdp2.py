"""FSDP2 on several GPUs with the optimizer state on the host: `OffloadedOptimizer` over each
rank's shards against FSDP2's own ``CPUOffloadPolicy``, at the Llama shape of
``benchmarks/optim.py`` (random weights, bf16, gradient checkpointing, AdamW).

    python benchmarks/optim_fsdp2.py                      # every row, on every visible GPU
    python benchmarks/optim_fsdp2.py --layers 4 --steps 3 # quick

Each row runs in its own ``torchrun --standalone --nproc-per-node N`` (N: ``--gpus``, default
every visible GPU), so host and device memory start clean. ``fully_shard`` on each decoder
layer, then on the root; the same steps and tokens on every row (each rank trains on the
batch that `optim.py`'s ``train`` draws, the same on every rank):
- ``fsdp2``: AdamW on the GPU over the bf16 shards (bf16 state): the resident reference.
- ``fsdp2-cpu``: FSDP2 ``CPUOffloadPolicy``: parameters, gradients and AdamW state of each
  rank's shards on the host, stepped by torch's AdamW on the CPU after backward.
- ``fsdp2-offload``: `torchoffload.OffloadedOptimizer` (fused AdamW on fp32 host masters of
  each rank's shards, stepped while backward runs); parameters and gradients stay on the
  device, sharded.
(``step_ahead`` is refused for DTensor parameters.)

Columns: tokens/s over all ranks (``N x batch x seq`` over rank 0's median step), the median
step, and per rank the peak device memory (``max_memory_allocated``) and the host memory of
the process (RSS), the largest over the ranks. The ranks of one host share its cores and memory
bandwidth: each rank's process gets ``OMP_NUM_THREADS`` = the host's cores over N (torchrun
would set 1), for torch's CPU AdamW and for the host step alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from optim import llama, model_arguments, train  # noqa: E402

ROWS = ("fsdp2", "fsdp2-cpu", "fsdp2-offload")


def shard(model, policy=None) -> None:
    from torch.distributed.fsdp import fully_shard

    kw = {} if policy is None else {"offload_policy": policy}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def run_row(args) -> dict:
    """One row on this rank (inside torchrun)."""
    import torch.distributed as dist

    import torchoffload as to

    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.manual_seed(0)
    model = llama(args)  # on the current device, the same weights on every rank
    if args.row == "fsdp2-cpu":
        from torch.distributed.fsdp import CPUOffloadPolicy

        shard(model, CPUOffloadPolicy())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    else:
        shard(model)
        if args.row == "fsdp2":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        else:
            opt = to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5,
                                        fused=True)  # fmt: skip
    torch.cuda.empty_cache()
    out = train(args, model, opt, sync_between=False)
    if hasattr(opt, "remove"):
        out["host_step_ms"] = opt.stats().host_step_ms
        opt.remove()
    out["rank"] = rank
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per row")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # inside torchrun
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # where the ranks write
    args = p.parse_args()
    args.profile = False  # train()'s profiler pass: not here
    if args.row is not None:  # one file per rank: the ranks' stdout lines interleave
        out = run_row(args)
        Path(args.out, f"{out['rank']}.json").write_text(json.dumps(out))
        return
    gpus = args.gpus or torch.cuda.device_count()
    if gpus < 1:
        sys.exit("optim_fsdp2.py needs CUDA GPUs (torch.cuda.device_count() is 0)")
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // gpus))
    env = dict(os.environ, OMP_NUM_THREADS=threads)  # torchrun's default: 1
    results = {}
    for row in args.rows.split(","):
        if row not in ROWS:
            sys.exit(f"unknown row {row!r}; rows: {', '.join(ROWS)}")
        where = Path(tempfile.mkdtemp(prefix=f"optim_fsdp2-{row}-"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={gpus}", __file__, *sys.argv[1:], "--row", row,
               "--out", str(where)]  # fmt: skip
        t = time.perf_counter()
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            out = run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:
            out = f"timed out after {args.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
        got = [json.loads(f.read_text()) for f in sorted(where.glob("*.json"))]
        if len(got) == gpus:
            results[row] = sorted(got, key=lambda r: r["rank"])
            print(f"{row}: {time.perf_counter() - t:.0f} s; rank 0: "
                  f"{json.dumps({k: v for k, v in got[0].items() if k != 'losses'})}",
                  flush=True)  # fmt: skip
        else:
            print(f"{row}: FAILED\n{out[-3000:]}", flush=True)
    print(f"\ntorch {torch.__version__}, {gpus} x {torch.cuda.get_device_name()}, hidden "
          f"{args.hidden}, layers {args.layers}, vocab {args.vocab}, batch {args.batch} per rank, "
          f"seq {args.seq}, OMP_NUM_THREADS={threads}")  # fmt: skip
    print("| row | tokens/s | step ms | peak GiB per rank | host GiB per rank | host step ms |")
    print("|---|---|---|---|---|---|")
    for row, ranks in results.items():
        r0 = ranks[0]
        hs = r0.get("host_step_ms")
        peak, host = (max(r[k] for r in ranks) for k in ("peak_gib", "host_gib"))
        print(f"| {row} | {gpus * r0['tokens_s']:.0f} | {r0['step_ms']:.0f} | {peak:.1f} | "
              f"{host:.1f} | {'-' if hs is None else f'{hs:.0f}'} |")  # fmt: skip
    for row, ranks in results.items():
        print(f"{row} losses (rank 0): {[round(x, 4) for x in ranks[0]['losses']]}")


if __name__ == "__main__":
    main()
