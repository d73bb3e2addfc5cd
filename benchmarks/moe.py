"""Mixture-of-experts inference: decode (batch 1) and prefill of a Qwen3-MoE with random weights,
resident against today's ``stream_weights`` and ``stream_experts`` (routed experts only, through
a device expert cache of a few sizes), with uniform and Zipf-skewed routing.

    python benchmarks/moe.py                                 # Qwen3-30B-A3B shape, bf16 (~61 GB)
    python benchmarks/moe.py --shape small                   # 4 layers x 32 experts: a quick run
    python benchmarks/moe.py --layers 8 --experts 64 --caches 1,2   # a shape in between

Rows per routing and phase: ``resident`` (every tensor on the device; the eager experts loop of
transformers), ``stream_weights B GiB`` (every weight streamed per token, ``--stream-weights``
budgets), ``stream_experts least`` (only the routed experts: the least cache, one token's top-k
of one block, so nearly every routed expert is copied), ``stream_experts C GiB`` (a cache of C
GiB, ``--policies``). Columns: ms per step (decode: per token, the median of ``--tokens`` timed
steps after ``--warmup``; prefill: one forward of ``--prefill`` tokens, median of 2), MiB copied
to the device per step, the cache's hit rate, the bound ``max(resident ms, bytes / bw)`` with bw
the pinned host-to-device bandwidth measured in this run, the row's ratio to it (1.0 = at the
bound), peak device GiB, and whether its greedy tokens equal the resident model's.

Routing: ``uniform`` is the random-weight router as it is (almost uniform: the worst case for a
cache). ``zipf`` adds to each layer's router logits ``-a * log(rank)`` over a random order of
its experts (``--zipf a``), so that expert popularity follows a Zipf law, and every ``--drift``
tokens swaps two neighbouring ranks in each layer (popularity that changes slowly over
tokens). It stands for the skew that traces of real MoE decoding show (a few experts of each
layer take most tokens, with temporal locality; the expert caches of llama.cpp forks,
MoE-Infinity and others report 67-81% hit rates on such traces); ``a`` of about 1 is in that
range. Both the resident and the streamed rows run the same patched routers.

The model is built on the device (random init there is fast); ``stream_experts`` and
``stream_weights`` copy it to pinned host memory and ``remove()`` puts it back, so the host
needs about the model's size of memory (61 GB for the default shape). The ``stream_weights``
rows run last: its ``remove()`` needs the budget and the whole model on the device at once
(pass one budget for the default shape on an 80 GB card).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weights import h2d_bandwidth, sync  # noqa: E402 (the link measured as weights.py does)

import torchoffload as to  # noqa: E402
from torchoffload.planner import plan_experts, synthetic_routing  # noqa: E402
from torchoffload.planner._routing import ZipfRanks  # noqa: E402 (the planner's zipf model)

GIB = 1 << 30
MIB = 1 << 20
SHAPES = {
    # Qwen3-30B-A3B: 48 layers, 128 experts (8 routed), hidden 2048, expert width 768
    "qwen3-30b-a3b": dict(
        hidden=2048,
        width=768,
        layers=48,
        experts=128,
        top_k=8,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        caches="8,16,32",
        stream_weights="16",
    ),  # fmt: skip
    "small": dict(
        hidden=512,
        width=256,
        layers=4,
        experts=32,
        top_k=4,
        heads=8,
        kv_heads=2,
        head_dim=64,
        vocab=8192,
        caches="0.02,0.05",
        stream_weights="0.1",
    ),  # fmt: skip
}


def build(shape: dict, device: torch.device):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=6144,
        moe_intermediate_size=shape["width"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"], max_position_embeddings=8192,
        experts_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model


class Routing:
    """The routers of every layer, uniform (as built) or Zipf-skewed with drift."""

    def __init__(self, model, kind: str, a: float, drift: int):
        self.kind = kind
        self.a = a
        self.drift = drift
        self.routers = [layer.mlp.gate for layer in model.model.layers]
        self.n = self.routers[0].num_experts
        self.bias = [torch.zeros(self.n, device=r.weight.device) for r in self.routers]

    def start(self) -> None:
        """Install the routers and reset the drift: every row sees the same routing."""
        self.ranks = ZipfRanks([self.n] * len(self.routers), self.a, self.drift, seed=1)
        self._write()
        for r, bias in zip(self.routers, self.bias, strict=True):
            if self.kind == "zipf":
                r.forward = _biased(r, bias)
            else:
                r.__dict__.pop("forward", None)

    def step(self, i: int) -> None:
        if self.kind == "zipf" and self.ranks.step(i):
            self._write()

    def _write(self) -> None:
        for li, bias in enumerate(self.bias):
            bias.copy_(self.ranks.bias(li))

    def stop(self) -> None:
        for r in self.routers:
            r.__dict__.pop("forward", None)


def _biased(router, bias: torch.Tensor):
    """Qwen3MoeTopKRouter.forward with ``bias`` added to the logits."""

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden_states, router.weight) + bias.to(router.weight.dtype)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    return forward


def decode(model, prompt: torch.Tensor, warmup: int, steps: int, routing: Routing, handle):
    """Greedy decode one token at a time after ``prompt``: ms of each timed step, the tokens,
    and the handle's stats over the timed steps."""
    from transformers import DynamicCache

    device = prompt.device
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:
        cache = DynamicCache()
    times, tokens = [], []
    with torch.inference_mode():
        out = model(prompt, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for i in range(warmup + steps):
            if i == warmup and handle is not None:
                handle.reset_stats()
            routing.step(i)
            sync(device)
            t0 = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            tokens.append(token)
    return times, torch.cat(tokens, dim=1), handle.stats() if handle is not None else None


def prefill(model, x: torch.Tensor, handle):
    """ms of one forward of ``x`` (median of 2 after one warm-up) and the stats of the last."""
    times = []
    with torch.inference_mode():
        for i in range(3):
            if handle is not None:
                handle.reset_stats()
            sync(x.device)
            t0 = time.perf_counter()
            model(x)
            sync(x.device)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), handle.stats() if handle is not None else None


def predicted(handle, routing: Routing, resident_ms: float, bw: float, args) -> dict:
    """The planner's decode prediction for a stream_experts row, from a synthetic profile of its
    routing (the routing model, not this run's routing): ms per token and hit rate."""
    link = bw * 1e9 if bw == bw else 1.0  # NaN: no link measured (the hit rate only)
    profile = synthetic_routing(handle, args.warmup + args.tokens, routing=routing.kind,
                                a=args.zipf, drift=args.drift)  # fmt: skip
    plan = plan_experts(handle, profile, link_bytes_per_s=link,
                        resident_ms_per_token=resident_ms, warmup_steps=args.warmup,
                        cache_bytes=[handle.stats().cache_bytes],
                        policy=handle._runtime.config.policy.value)  # fmt: skip
    (p,) = plan.predictions
    return dict(pred_ms=round(p.ms_per_token, 2) if bw == bw else None,
                pred_hit=round(p.hit_rate, 3))  # fmt: skip


def moved(stats, tokens: int, weights_bytes: int) -> tuple[float, float | None]:
    """(bytes copied per token, hit rate) from an engine's stats."""
    if stats is None:
        return 0.0, None
    if isinstance(stats, to.ExpertStats):
        return stats.h2d_bytes / tokens, stats.hit_rate
    return stats.h2d_bytes / tokens, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    for name in ("layers", "experts", "top-k"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the shape's")
    p.add_argument("--caches", default=None, help="expert cache sizes in GiB, comma-separated")
    p.add_argument("--stream-weights", default=None, help="budgets in GiB ('' for none)")
    p.add_argument("--policies", default="lru", help="cache policies: lru, lfu or both")
    p.add_argument("--routing", default="uniform,zipf")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the skewed routing")
    p.add_argument("--drift", type=int, default=8, help="tokens between rank swaps (0: none)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    p.add_argument("--tokens", type=int, default=16, help="timed decode steps")
    p.add_argument("--prefill", type=int, default=2048, help="prefill tokens (0: skip)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)

    shape = dict(SHAPES[args.shape])
    for key in ("layers", "experts", "top_k"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    caches = [float(c) for c in (args.caches or shape["caches"]).split(",") if c]
    sw = args.stream_weights if args.stream_weights is not None else shape["stream_weights"]
    budgets = [float(b) for b in sw.split(",") if b]
    policies = args.policies.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(shape, device)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if ".experts." in n)  # fmt: skip
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = h2d_bandwidth(device)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"# {datetime.date.today()} {gpu} torch {torch.__version__}; Qwen3-MoE {shape['layers']} "
        f"layers x {shape['experts']} experts (top {shape['top_k']}), hidden {shape['hidden']}, "
        f"width {shape['width']}, bf16: weights {weight_bytes / GIB:.2f} GiB, experts "
        f"{expert_bytes / GIB:.2f} GiB; pinned H2D {bw:.1f} GB/s",
        flush=True,
    )
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape["vocab"], (1, args.prompt), generator=g).to(device)
    long = torch.randint(0, shape["vocab"], (1, args.prefill), generator=g).to(device)
    routings = {k: Routing(model, k, args.zipf, args.drift) for k in args.routing.split(",")}
    rows, resident = [], {}

    def measure(name: str, handle=None, setup_s: float = 0.0) -> None:
        for kind, routing in routings.items():
            routing.start()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, tokens, st = decode(model, prompt, args.warmup, args.tokens, routing, handle)
            ms = statistics.median(times)
            per, hit = moved(st, args.tokens, weight_bytes)
            add(name, kind, "decode", ms, per, hit, tokens, setup_s)
            if isinstance(handle, to.ExpertStreamHandle):
                rows[-1] |= predicted(handle, routing, resident[(kind, "decode")][0], bw, args)
            if args.prefill:
                ms, st = prefill(model, long, handle)
                per, hit = moved(st, args.prefill, weight_bytes)
                add(name, kind, f"prefill {args.prefill}", ms, per * args.prefill, hit, None,
                    setup_s)  # fmt: skip
            routing.stop()

    def add(name, kind, phase, ms, per, hit, tokens, setup_s):
        key = (kind, phase)
        if name == "resident":
            resident[key] = (ms, tokens)
        link = per / (bw * 1e9) * 1e3 if bw == bw else 0.0
        bound = max(resident[key][0], link)
        same = None if tokens is None else bool(torch.equal(tokens, resident[key][1]))
        peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else math.nan
        r = dict(routing=kind, phase=phase, row=name, ms=round(ms, 2), mib=round(per / MIB, 1),
                 hit=None if hit is None else round(hit, 3), bound_ms=round(bound, 2),
                 of_bound=round(bound / ms, 3), peak_gib=round(peak, 2), same_tokens=same,
                 setup_s=round(setup_s, 1))  # fmt: skip
        rows.append(r)
        print(r, flush=True)

    measure("resident")
    least = to.minimum_cache_bytes(model)
    for policy in policies:
        for cache in [least, *[int(c * GIB) for c in caches]]:
            t0 = time.perf_counter()
            h = to.stream_experts(model, device, cache_bytes=cache, policy=policy)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            name = "least" if cache == least else f"{cache / GIB:g} GiB"
            measure(f"stream_experts {name} {policy}", h, time.perf_counter() - t0)
            h.remove()
            del h
            gc.collect()
    # Last: stream_weights' remove() copies the model back while its arena is still allocated
    # (budget + model on the device), which the last budget skips.
    for i, budget in enumerate(budgets):
        t0 = time.perf_counter()
        h = to.stream_weights(model, device, budget_bytes=int(budget * GIB))
        measure(f"stream_weights {budget:g} GiB", h, time.perf_counter() - t0)
        if i + 1 < len(budgets):
            h.remove()
            del h
            gc.collect()

    print("\n| routing | phase | row | ms | MiB/step | hit rate | bound ms | of bound | peak GiB | "
          "same tokens |\n|---|---|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for r in rows:
        print(
            f"| {r['routing']} | {r['phase']} | {r['row']} | {r['ms']} | {r['mib']} | "
            f"{r['hit'] if r['hit'] is not None else '-'} | {r['bound_ms']} | {r['of_bound']} | "
            f"{r['peak_gib']} | {'-' if r['same_tokens'] is None else r['same_tokens']} |"
        )
    print("\nThe planner's prediction (plan_experts, a synthetic routing of the same kind) per "
          "decode row:\n\n| routing | row | ms | predicted ms | hit rate | predicted hit rate |\n"
          "|---|---|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        if "pred_ms" in r:
            print(f"| {r['routing']} | {r['row']} | {r['ms']} | {r['pred_ms']} | {r['hit']} | "
                  f"{r['pred_hit']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(bw_gbps=bw, shape=shape, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
