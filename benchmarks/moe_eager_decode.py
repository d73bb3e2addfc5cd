"""Eager (uncaptured) `stream_experts` decode against the resident model, step by step in turn.

An eager batch-1 decode step is host-bound, and the GPU machine's host speed drifts by tens of
percent within minutes (the resident step of the 30B shape took 90 and 117 ms on two leases of
one day; one loop of small operations took 8.8 to 14.0 us per operation within one process,
benchmarks/pinned_host_effect.py), so rows measured one after another, as `moe.py` does,
compare different host speeds. Here two models with the same weights, the resident one and a
copy whose experts `stream_experts` serves, decode the same tokens under the same routing, one
step each in turn (the order swapped every step), and the ratio is taken per pair. Every step's
logits are compared bitwise. The Qwen3-30B-A3B shape (``--layers`` of it), random weights,
uniform or Zipf routing (`moe.py`'s). ``--modes``: the streamed model's one-token block calls
replayed as block graphs (``graphs``: ``block_graphs=True``, the design in
torchoffload/moe/_replayed.py) or routed on the host (``host``: ``block_graphs=False``).
``--profile``: one more pair under `torch.profiler`, its tables printed. Needs a GPU
(``--device cpu``: a smoke run of the bookkeeping).

    PYTHONPATH=. python3 benchmarks/moe_eager_decode.py [--layers 48] [--caches 16,0]
        [--routing uniform,zipf] [--modes graphs,host] [--impl grouped_mm] [--tokens 12]
        [--profile]
        [--shape small --device cpu]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode import sync  # noqa: E402
from benchmarks.moe import SHAPES, Routing, build  # noqa: E402
from torchoffload import minimum_cache_bytes, stream_experts  # noqa: E402


class Decoder:
    """One model's decode over a static cache, one step per call, under its own `Routing`."""

    def __init__(self, model, routing: str, prompt: torch.Tensor, steps: int):
        from transformers import StaticCache

        self.model = model
        n = prompt.shape[1]
        self.routing = Routing(model, routing, 1.0, 8, 8.0, n + steps + 1)
        self.routing.start()
        self.cache = StaticCache(config=model.config, max_cache_len=n + steps + 1)
        self.pos = torch.arange(n + steps + 1, device=prompt.device)
        self.n, self.i = n, 0
        with torch.inference_mode():
            self.routing.at(self.pos[:n])
            model(input_ids=prompt, cache_position=self.pos[:n], past_key_values=self.cache,
                  use_cache=True)  # fmt: skip

    def step(self, token: torch.Tensor) -> tuple[float, torch.Tensor]:
        """ms of one decode step (synchronized before and after), and its logits."""
        at = self.pos[self.n + self.i : self.n + self.i + 1]
        self.routing.step(self.i)
        self.routing.at(at)
        self.i += 1
        with torch.inference_mode():
            sync(token.device)
            t0 = time.perf_counter()
            out = self.model(input_ids=token, position_ids=at.unsqueeze(0), cache_position=at,
                             past_key_values=self.cache, use_cache=True)  # fmt: skip
            sync(token.device)
        return (time.perf_counter() - t0) * 1e3, out.logits[:, -1].clone()


def pairs(args, resident, streamed, h, routing: str) -> tuple[dict, bool]:
    """Decode steps of the two models in turn under ``routing``: ms per timed step of each,
    and whether every step's logits were bitwise equal. Prints the table."""
    dev = next(resident.parameters()).device
    steps = args.warmup + args.tokens + (1 if args.profile else 0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (1, 8 + steps), generator=g).to(dev)
    models = {"resident": Decoder(resident, routing, ids[:, :8], steps),
              "streamed": Decoder(streamed, routing, ids[:, :8], steps)}  # fmt: skip
    ms: dict[str, list[float]] = {"resident": [], "streamed": []}
    same = True
    for i in range(args.warmup + args.tokens):
        if i == args.warmup:
            h.reset_stats()
        order = ["resident", "streamed"][:: 1 if i % 2 else -1]
        out = {}
        for name in order:
            t, out[name] = models[name].step(ids[:, 8 + i : 9 + i])
            if i >= args.warmup:
                ms[name].append(t)
        same &= torch.equal(out["resident"], out["streamed"])
    st = h.stats()
    ratios = [s / r for r, s in zip(ms["resident"], ms["streamed"], strict=True)]
    print(f"\n{routing} routing:\n\n| step | resident ms | streamed ms | ratio |")
    print("|---:|---:|---:|---:|")
    for i, (r, s) in enumerate(zip(ms["resident"], ms["streamed"], strict=True)):
        print(f"| {i} | {r:.2f} | {s:.2f} | {s / r:.3f} |")
    med = {name: statistics.median(v) for name, v in ms.items()}
    med["ratio"] = statistics.median(ratios)
    med["mib"] = st.bytes_per_token / 2**20
    print(f"\nmedian: resident {med['resident']:.2f} ms, streamed {med['streamed']:.2f} ms, "
          f"ratio of pairs {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max "
          f"{max(ratios):.3f}); hit rate {st.hit_rate:.3f}, {st.bytes_per_token / 2**20:.1f} "
          f"MiB per token; block calls replayed {st.block_replays}, run eagerly "
          f"{st.block_eager_calls}; logits bitwise equal: {same}", flush=True)  # fmt: skip
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        i = args.warmup + args.tokens
        for name, d in models.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t, _ = d.step(ids[:, 8 + i : 9 + i])
            print(f"\n## {name}, profiled step: {t:.2f} ms")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                            max_name_column_width=44))  # fmt: skip
    for d in models.values():
        d.routing.stop()
    return med, same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="override the shape's")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the bookkeeping")
    p.add_argument("--caches", default="16", help="GiB, comma-separated; 0: the least cache")
    p.add_argument("--routing", default="uniform", help="uniform, zipf or both")
    p.add_argument("--modes", default="graphs,host", help="graphs (block_graphs), host or both")
    p.add_argument("--impl", default="grouped_mm", choices=["grouped_mm", "eager", "batched_mm"])
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rows", type=int, default=20, help="rows of each profile table")
    args = p.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    shape["layers"] = args.layers or shape["layers"]
    dev = torch.device(args.device)
    resident = build(shape, dev, args.impl)
    streamed = copy.deepcopy(resident)
    for layer in streamed.model.layers:  # its experts wait in host memory, as in moe.py
        layer.mlp.experts.to("cpu")
    torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(
        f"# {datetime.date.today()} {gpu} torch {torch.__version__}; {args.shape} shape, "
        f"{shape['layers']} layers, {args.impl}; steps in turn, the order swapped each step"
    )
    rows, same = [], True
    for gib in map(float, args.caches.split(",")):
        cache = int(gib * 2**30) if gib else minimum_cache_bytes(streamed)
        for mode in args.modes.split(","):
            if mode not in ("graphs", "host"):
                p.error(f"--modes: graphs or host, not {mode!r}")
            h = stream_experts(streamed, dev, cache_bytes=cache, pin_memory=dev.type == "cuda",
                               block_graphs=mode == "graphs")  # fmt: skip
            print(f"\n## cache {cache / 2**30:.2f} GiB, block calls: {mode}", flush=True)
            for routing in args.routing.split(","):
                med, ok = pairs(args, resident, streamed, h, routing)
                same &= ok
                rows.append((f"{gib:g} GiB" if gib else "least", mode, routing, med))
            h.remove()
    print("\n| cache | block calls | routing | resident ms | streamed ms | MiB/token | x resident "
          "(median of pairs) |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|")
    for cache, mode, routing, med in rows:
        print(f"| {cache} | {mode} | {routing} | {med['resident']:.2f} | {med['streamed']:.2f} | "
              f"{med['mib']:.1f} | {med['ratio']:.3f} |")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
