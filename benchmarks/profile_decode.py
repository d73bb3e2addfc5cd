"""The copy-stream timeline of a CUDA-graph streamed decode (`handle.cuda_graph`): how busy the
copy stream is, its gaps, and the bandwidth while copying, from `torch.profiler`.

    python benchmarks/profile_decode.py --shape demo --budget-gib 0.2
    python benchmarks/profile_decode.py --shape 8b --budget-gib 12 --tokens 8
    python benchmarks/profile_decode.py --shape demo --budget-gib 0.2 --compile  # torch.compile'd
                                                    # step in the graph; --kernels N: top kernels
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode import Decoder, build, sync  # noqa: E402
from torchoffload import stream_weights  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="demo")
    p.add_argument("--budget-gib", type=float, default=0.2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--compile", action="store_true", help="the step is torch.compile(model)")
    p.add_argument("--kernels", type=int, default=0, help="print the N costliest GPU kernels")
    p.add_argument("--unprimed", action="store_true", help="cuda_graph(prime=False)")
    p.add_argument("--trace", type=Path, default=None, help="write a Chrome trace here")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    model = build(args.shape, dev)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (1, 128), generator=g).to(dev)
    h = stream_weights(model, dev, budget_bytes=int(args.budget_gib * 2**30),
                       resident=("embed_tokens",))  # fmt: skip
    step_model = torch.compile(model) if args.compile else None

    def wrap(step):
        return h.cuda_graph(step, prime=not args.unprimed)

    dec = Decoder(model, prompt, args.tokens, wrap, step_model=step_model)
    dec.run()  # warm-up and capture
    sync(dev)
    before = h.stats().h2d_bytes
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.run()
        sync(dev)
    moved = h.stats().h2d_bytes - before
    if args.trace is not None:
        prof.export_chrome_trace(str(args.trace))
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"{args.shape}, budget {args.budget_gib} GiB, {len(h.kept)}/{len(h.units)} units kept; "
          f"one decode (prefill + {args.tokens - 1} steps)")  # fmt: skip
    for line in copy_timeline(events, moved):
        print(line)
    if args.kernels:
        kernels: dict[str, list[float]] = {}
        for e in events:
            if "HtoD" not in e.name and "Memcpy" not in e.name:
                kernels.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
        total = sum(sum(v) for v in kernels.values())
        print(f"GPU kernels: {total / 1e3:.2f} ms in {sum(map(len, kernels.values()))} launches")
        for name, ts in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[: args.kernels]:
            print(f"  {sum(ts) / 1e3:8.2f} ms {len(ts):6d}x  {name[:100]}")
    h.remove()
    return 0


def copy_timeline(events, moved: int, per_call: int | None = None) -> list[str]:
    """How busy the copy stream was over the profiled CUDA ``events`` (``moved``: the bytes the
    handle copied meanwhile): its busy fraction of the span from the first copy to the last,
    the bandwidth while copying, and its gaps. With ``per_call`` (copies per call, every call
    alike), also where the gaps fall: the position in its call of the copy after each."""
    copies = sorted((e.time_range.start, e.time_range.end) for e in events if "HtoD" in e.name)
    if not copies:
        return ["no host-to-device copies"]
    busy = sum(b - a for a, b in copies)
    span = copies[-1][1] - copies[0][0]
    after = [(b[0] - a[1], i + 1) for i, (a, b) in enumerate(zip(copies, copies[1:], strict=False))
             if b[0] - a[1] > 20]  # fmt: skip
    gaps = sorted(g for g, _ in after)
    durations = sorted(b - a for a, b in copies)
    out = [
        f"H2D copies {len(copies)}, {moved / 2**20:.1f} MiB, copy stream busy {busy / 1e3:.2f} ms "
        f"of a {span / 1e3:.2f} ms span ({busy / span:.3f}), {moved / busy / 1e3:.1f} GB/s while "
        "copying",
        f"copy durations: min {durations[0]:.0f} us, median {durations[len(durations) // 2]:.0f}, "
        f"max {durations[-1]:.0f}",
    ]
    if gaps:
        out.append(f"gaps over 20 us: {len(gaps)}, total {sum(gaps) / 1e3:.2f} ms, median "
                   f"{gaps[len(gaps) // 2]:.0f} us, largest {gaps[-1]:.0f} us")  # fmt: skip
        if per_call and len(copies) % per_call == 0:
            where: dict[int, list[float]] = {}
            for g, i in after:
                where.setdefault(i % per_call, []).append(g)
            top = sorted(where.items(), key=lambda kv: -sum(kv[1]))[:4]
            out.append(f"gaps by the position in its call ({per_call} copies) of the copy after: "
                       + ", ".join(f"{pos}: {len(v)} gaps, {sum(v) / 1e3:.2f} ms"
                                   for pos, v in top))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
