"""Train a Llama-style model with FSDP2 and activation offloading, with and without offloading.

    torchrun --nproc-per-node 2 examples/train_fsdp_offload.py    # GPUs (NCCL), or CPUs (gloo)
    python examples/train_fsdp_offload.py                          # one process
    torchrun --nproc-per-node 2 examples/train_fsdp_offload.py --hidden 4096 --layers 16 \\
        --seq 4096 --batch 2 --offload on                           # a bigger run on two H200s

The recipe is three lines: shard each decoder layer and the root with `fully_shard`, then
`apply_activation_offloading` (after sharding, see docs/multi-gpu.md). Each rank trains on its own
batches; the script prints, per mode, the step time, tokens/s, peak device memory per rank and
how much each step offloaded, and whether the losses of both modes are identical.

The model is Hugging Face's ``LlamaForCausalLM`` built from a config with random weights (no
download) when transformers is installed, else torchoffload's small GPT (``--model gpt``).

Offloading every eligible activation is only free when the link can carry them within the
compute time. Hugging Face Llama saves many bytes per FLOP, so at these shapes it is link-bound
on an H200 (the default GPU shape runs about 3x slower, in 59% of the memory); ``--budget-gib``
caps the bytes per step, so that the copies hide behind compute (benchmarks/README.md, "FSDP2 on
two GPUs").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import torchoffload


def size(nbytes: float) -> str:
    if nbytes == 0:
        return "0"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["llama", "gpt"], default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", default=None, help="per rank; a comma list runs each size")
    p.add_argument("--steps", type=int, default=None, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--offload", choices=["off", "on", "both"], default="both")
    p.add_argument("--budget-gib", type=float, default=None, help="max offloaded GiB per step")
    p.add_argument("--deterministic", action="store_true", help="bitwise-comparable GPU runs")
    p.add_argument("--profile", action="store_true", help="measure exposed communication")
    p.add_argument("--json", default=None, help="write the results (rank 0) to this file")
    p.add_argument("--trace", default=None, help="rank 0 writes a Chrome trace of one step here")
    args = p.parse_args(argv)
    if args.model is None:
        try:
            import transformers  # noqa: F401

            args.model = "llama"
        except ImportError:
            args.model = "gpt"
    return args


def setup() -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE; a plain ``python`` run is a group of one."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo")
    return rank, world, device


def defaults(args: argparse.Namespace, device: torch.device) -> None:
    gpu = device.type == "cuda"
    args.hidden = args.hidden or (2048 if gpu else 128)
    args.layers = args.layers or (8 if gpu else 4)
    args.heads = args.heads or max(1, args.hidden // 128)
    args.intermediate = args.intermediate or int(args.hidden * 8 / 3) // 128 * 128
    args.vocab = args.vocab or (32000 if gpu else 1024)
    args.seq = args.seq or (2048 if gpu else 128)
    batches = args.batch or ("4" if gpu else "2")
    args.batches = [int(b) for b in str(batches).split(",")]
    args.steps = args.steps or (5 if gpu else 3)


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The same weights on every rank (one seed), in bf16 on GPUs."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        if args.model == "llama":
            import transformers

            config = transformers.LlamaConfig(
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                intermediate_size=args.intermediate,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=max(1, args.heads // 4),
                max_position_embeddings=args.seq,
            )
            model = transformers.LlamaForCausalLM(config)
            model.config.use_cache = False
        else:
            from torchoffload.models import GPT, GPTConfig

            config = GPTConfig(
                hidden=args.hidden,
                layers=args.layers,
                heads=args.heads,
                vocab=args.vocab,
                max_seq=args.seq,
            )
            model = GPT(config)
    return model.to(dtype)


def _mark(marks, i: int) -> None:
    if marks is not None:
        marks[i].record()


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "loss"):  # torchoffload's GPT
        return model.loss(tokens)
    return model(input_ids=tokens, labels=tokens).loss


def train(args, rank: int, world: int, device: torch.device, offload: bool, batch: int) -> dict:
    gpu = device.type == "cuda"
    start_bytes = torch.cuda.memory_allocated() if gpu else 0  # what an earlier run left
    model = build(args, device)
    # 1. FSDP2: each decoder layer, then the root.
    layers = torchoffload.find_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    # 2. Activation offloading, after sharding.
    handle = None
    if offload:
        budget = None if args.budget_gib is None else int(args.budget_gib * 2**30)
        config = torchoffload.ActivationOffloadConfig(max_offload_bytes=budget)
        handle = torchoffload.apply_activation_offloading(model, layers=layers, config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    losses, times = [], []
    phases = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (batch, args.seq), generator=gen).to(device)
        if step == args.warmup:
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if handle is not None:
                handle.reset_stats()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if gpu else None
        start = time.perf_counter()
        _mark(marks, 0)
        loss = loss_of(model, tokens)
        _mark(marks, 1)
        loss.backward()
        _mark(marks, 2)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _mark(marks, 3)
        if gpu:
            torch.cuda.synchronize()
            if step >= args.warmup:  # GPU time of forward, backward, optimizer
                for phase, i in (("fwd", 0), ("bwd", 1), ("opt", 2)):
                    phases[phase] += marks[i].elapsed_time(marks[i + 1]) / args.steps
        times.append(time.perf_counter() - start)
        losses.append(loss.detach().float().cpu())
    result = {
        "mode": "offload" if offload else "no offload",
        "batch": batch,
        "step_ms": 1e3 * sum(times[args.warmup :]) / args.steps,
        "phase_ms": phases if gpu else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "start_gib": start_bytes / 2**30,
        "losses": [float(x) for x in losses],
        "offloaded_bytes_per_step": 0,
        "exposed_comm_ms": None,
    }
    if handle is not None:
        stats = handle.stats()
        result["offloaded_bytes_per_step"] = stats.offloaded_bytes // args.steps
        result["prefetch_misses_per_step"] = stats.prefetch_misses / args.steps
        result["compute_wait_ms_per_step"] = (stats.compute_wait_ms or 0.0) / args.steps
    if args.profile and gpu:
        result["exposed_comm_ms"] = exposed_comm_ms(model, args, batch, device, gen)
    if args.trace and gpu:  # every rank runs the step (collectives); rank 0 records it
        from torch.profiler import ProfilerActivity, profile

        tokens = torch.randint(0, args.vocab, (batch, args.seq), generator=gen).to(device)
        acts = [ProfilerActivity.CUDA, ProfilerActivity.CPU]
        with profile(activities=acts) if rank == 0 else contextlib.nullcontext() as prof:
            loss_of(model, tokens).backward()
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        if rank == 0:
            mode = result["mode"].replace(" ", "_")
            prof.export_chrome_trace(f"{args.trace}.{mode}.{batch}.json")
    if handle is not None:
        handle.remove()
    del model, opt, layers, handle
    gc.collect()  # FSDP and HF modules hold reference cycles: free this run before the next
    if gpu:
        torch.cuda.empty_cache()
    return result


def exposed_comm_ms(model, args, batch, device, gen, steps: int = 3) -> float:
    """GPU time of a forward and backward in which NCCL kernels run and nothing else does (no
    compute kernel, no host<->device copy): communication that is the step's critical path.
    Copies count as cover because while the step waits on the link, a collective running
    alongside costs nothing. The median over ``steps`` profiled steps."""
    import statistics

    per_step = []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab, (batch, args.seq), generator=gen).to(device)
        per_step.append(_exposed_comm_one(model, tokens))
        model.zero_grad(set_to_none=True)
    return statistics.median(per_step)


def _exposed_comm_one(model, tokens) -> float:
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        loss_of(model, tokens).backward()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    comm, cover = [], []
    for e in trace.get("traceEvents", []):
        if e.get("cat") not in ("kernel", "gpu_memcpy"):
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        (comm if "nccl" in e.get("name", "").lower() else cover).append(span)
    merged: list[list[float]] = []
    for lo, hi in sorted(cover):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    exposed = 0.0
    for lo, hi in comm:
        covered = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in merged)
        exposed += (hi - lo) - covered
    return exposed / 1e3


def main(argv=None) -> None:
    args = parse(argv)
    rank, world, device = setup()
    defaults(args, device)
    if args.deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    attention = contextlib.nullcontext()
    if args.deterministic:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)
    if rank == 0:
        print(
            f"{args.model}: hidden {args.hidden}, {args.layers} layers, seq {args.seq}, batch "
            f"{args.batch or args.batches[0]} per rank, {world} rank(s) on {device.type} "
            f"(torch {torch.__version__})"
        )
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.offload]
    results = []
    with attention:
        for batch in args.batches:
            for offload in modes:
                results.append(train(args, rank, world, device, offload, batch))
    peaks = [r["peak_gib"] for r in results]
    if device.type == "cuda":  # the largest peak over the ranks
        t = torch.tensor([p for p in peaks], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for r, p in zip(results, t.tolist(), strict=True):
            r["peak_gib"] = p
    if rank == 0:
        print(f"\n{'mode':<12}{'batch':>6}{'ms/step':>9}{'tokens/s':>10}{'peak GiB/rank':>15}"
              f"{'offloaded/step':>16}{'exposed comm ms':>17}")  # fmt: skip
        for r in results:
            tokens = world * r["batch"] * args.seq
            peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
            comm = f"{r['exposed_comm_ms']:.1f}" if r["exposed_comm_ms"] is not None else "-"
            print(
                f"{r['mode']:<12}{r['batch']:>6}{r['step_ms']:>9.1f}"
                f"{tokens / r['step_ms'] * 1e3:>10.0f}{peak:>15}"
                f"{size(r['offloaded_bytes_per_step']):>16}{comm:>17}"
            )
        for batch in args.batches:
            pair = [r["losses"] for r in results if r["batch"] == batch]
            if len(pair) != 2:
                continue
            if args.deterministic or device.type != "cuda":
                print(f"batch {batch}: rank 0's losses identical with and without offloading: "
                      f"{pair[0] == pair[1]}")  # fmt: skip
            else:
                diff = max(abs(a - b) for a, b in zip(*pair, strict=True))
                print(f"batch {batch}: rank 0's losses differ by at most {diff:.2e} (kernels "
                      "are not deterministic; --deterministic compares bitwise)")  # fmt: skip
        if device.type != "cuda":
            print("(on CPU there is no device memory to save: this run checks the mechanics)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
