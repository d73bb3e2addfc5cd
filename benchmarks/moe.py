"""Mixture-of-experts inference: decode (batch 1) and prefill of a Qwen3-MoE with random weights,
resident against today's ``stream_weights``, ``stream_experts`` (routed experts only, through a
device expert cache of a few sizes; eagerly and replayed as CUDA graphs) and accelerate's
``cpu_offload``, with uniform and Zipf-skewed routing.

    python benchmarks/moe.py                                 # Qwen3-30B-A3B shape, bf16 (~61 GB)
    python benchmarks/moe.py --shape small                   # 4 layers x 32 experts: a quick run
    python benchmarks/moe.py --layers 8 --experts 64 --caches 1,2   # a shape in between

Rows per routing and phase: ``resident`` (every tensor on the device; the eager experts loop of
transformers), ``stream_weights B GiB`` (every weight streamed per token, ``--stream-weights``
budgets), ``stream_experts least`` (routed-only: the least cache, one token's top-k of one
block, so every routed expert is copied), ``stream_experts C GiB`` (a cache of C GiB,
``--policies``), the same with ``graph`` (decode steps replayed by ``handle.cuda_graph``: routing,
cache map and copies on the device), ``graph prefetch`` (``prefetch=True``), ``graph all
cached`` (every expert in the cache: the graph's compute floor, no copies), and ``accelerate
cpu_offload`` (``--accelerate``; every weight copied from host memory each forward). Columns: ms
per step (decode: per token, the median of ``--tokens`` timed steps after ``--warmup``;
prefill: one forward of ``--prefill`` tokens, median of 2), MiB copied to the device per step,
the cache's hit rate, the bound, the row's ratio to it (1.0 = at the bound), peak device GiB, and
whether its logits are bitwise the resident model's (every decode step's). The bound is ``max(
compute, bytes / bw)`` with bw the pinned host-to-device bandwidth measured in this run and
compute the resident model's ms (eager rows) or the ``graph all cached`` row's (graph rows: the
resident loop of transformers reads the routing on the host and cannot be captured).

Decoding is teacher-forced: each step's input token is drawn at random (a greedy decode of a
random model repeats its tokens, and so its routing), over a static KV cache. Routing: each
router's logits get ``s * (bias + noise[position])``, with ``noise`` Gumbel noise drawn per
layer, position and expert, and ``s`` (``--noise``) large enough that this outweighs the random
router's own logits.
``uniform``: no bias, so each token's top-k is a uniform draw of k experts: the worst case for
a cache. ``zipf``: the bias is ``-a * log(rank)`` over a random order of each layer's experts
(``--zipf a``), and every ``--drift`` tokens two neighbouring ranks swap in each layer, so a
token's experts are drawn without replacement with probabilities proportional to ``rank ** -a``
(Gumbel-top-k), popularity changing slowly over tokens: the synthetic ``zipf`` routing of the
planner (`synthetic_routing`), whose prediction is printed beside each row. It stands for the
skew that traces of real MoE decoding show (a few experts of each layer take most tokens, with
temporal locality; the expert caches of llama.cpp forks, MoE-Infinity and others report 67-81%
hit rates on such traces); ``a`` of about 1 is in that range. Every row runs the same routers.

The model is built on the device (random init there is fast); ``stream_experts`` and
``stream_weights`` copy it to pinned host memory and ``remove()`` puts it back, so the host
needs about the model's size of memory (61 GB for the default shape). The ``stream_weights``
rows run after the others: its ``remove()`` needs the budget and the whole model on the device
at once (pass one budget for the default shape on an 80 GB card). ``accelerate`` runs last and
leaves the model offloaded (its weights then live in host memory).
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
    """The routers of every layer with ``bias + noise[position]`` added to their logits (see
    the module doc): uniform (no bias) or Zipf-skewed with drift."""

    def __init__(self, model, kind: str, a: float, drift: int, noise: float, positions: int):
        self.kind = kind
        self.a = a
        self.drift = drift
        self.routers = [layer.mlp.gate for layer in model.model.layers]
        self.n = self.routers[0].num_experts
        dev = self.routers[0].weight.device
        self.bias = [torch.zeros(self.n, device=dev) for _ in self.routers]
        g = torch.Generator(device=dev).manual_seed(7)
        u = torch.rand(len(self.routers), positions, self.n, generator=g, device=dev)
        self.scale = noise
        self.noise = -torch.log(-torch.log(u.clamp_min(1e-30))) * noise  # Gumbel
        self.one = torch.zeros(1, dtype=torch.long, device=dev)  # a decode step's position
        self.pos = self.one

    def start(self) -> None:
        """Install the routers and reset the drift: every row sees the same routing."""
        self.ranks = ZipfRanks([self.n] * len(self.routers), self.a, self.drift, seed=1)
        self._write()
        for li, r in enumerate(self.routers):
            r.forward = _noisy(r, self, li)

    def at(self, positions: torch.Tensor) -> None:
        """The positions of the next call's tokens (a decode step's go to a tensor of its own,
        which a captured graph reads)."""
        if positions.numel() == 1:
            self.one.copy_(positions.reshape(1))
            self.pos = self.one
        else:
            self.pos = positions

    def step(self, i: int) -> None:
        if self.kind == "zipf" and self.ranks.step(i):
            self._write()

    def _write(self) -> None:
        for li, bias in enumerate(self.bias):
            zipf = self.ranks.bias(li) * self.scale  # scaled as the noise: Gumbel-top-k
            bias.copy_(zipf if self.kind == "zipf" else torch.zeros(self.n))

    def stop(self) -> None:
        for r in self.routers:
            r.__dict__.pop("forward", None)


def _noisy(router, routing: Routing, li: int):
    """Qwen3MoeTopKRouter.forward with the routing's bias and noise added to the logits."""

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        extra = routing.bias[li] + routing.noise[li][routing.pos]
        logits = F.linear(hidden_states, router.weight) + extra.to(router.weight.dtype)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    return forward


def decode(model, ids: torch.Tensor, warmup: int, steps: int, routing: Routing, handle,
           graph: bool = False):  # fmt: skip
    """Teacher-forced decode after a prompt (``ids[0]``), one token a step (``ids[1 + i]``)
    over a static cache, the step replayed by ``handle.cuda_graph`` when ``graph``: ms of
    each timed step, every step's logits, and the handle's stats over the timed steps."""
    from transformers import StaticCache

    device = ids.device
    prompt = ids[:, : -(warmup + steps)]
    n = prompt.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 1)

    def step(x, pos):
        out = model(input_ids=x, position_ids=pos.unsqueeze(0), cache_position=pos,
                    past_key_values=cache, use_cache=True)  # fmt: skip
        return out.logits[:, -1]

    f = handle.cuda_graph(step) if graph else step
    times, logits = [], []
    with torch.inference_mode():
        positions = torch.arange(ids.shape[1], device=device)
        routing.at(positions[:n])
        model(input_ids=prompt, cache_position=positions[:n], past_key_values=cache,
              use_cache=True)  # fmt: skip
        for i in range(warmup + steps):
            if i == warmup and handle is not None:
                handle.reset_stats()
            routing.step(i)
            routing.at(positions[n + i : n + i + 1])
            sync(device)
            t0 = time.perf_counter()
            out = f(ids[:, n + i : n + i + 1], positions[n + i : n + i + 1])
            sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            logits.append(out.clone())
    return times, torch.stack(logits), handle.stats() if handle is not None else None


def prefill(model, x: torch.Tensor, routing: Routing, handle):
    """ms of one forward of ``x`` (median of 2 after one warm-up) and the stats of the last."""
    times = []
    routing.at(torch.arange(x.shape[1], device=x.device))
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
    p.add_argument("--noise", type=float, default=8.0, help="scale of the routing's noise")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    p.add_argument("--tokens", type=int, default=16, help="timed decode steps")
    p.add_argument("--prefill", type=int, default=2048, help="prefill tokens (0: skip)")
    p.add_argument("--no-graph", action="store_true", help="skip the cuda_graph rows")
    p.add_argument("--no-eager", action="store_true", help="skip the eager stream_experts rows")
    p.add_argument(
        "--accelerate",
        type=int,
        default=2,
        metavar="TOKENS",
        help="timed decode steps of accelerate's cpu_offload (0: skip the row)",
    )
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
    steps = args.warmup + args.tokens
    ids = torch.randint(0, shape["vocab"], (1, args.prompt + steps), generator=g).to(device)
    long = torch.randint(0, shape["vocab"], (1, args.prefill), generator=g).to(device)
    positions = max(args.prefill, ids.shape[1]) + 1
    routings = {k: Routing(model, k, args.zipf, args.drift, args.noise, positions)
                for k in args.routing.split(",")}  # fmt: skip
    rows, resident = [], {}

    def measure(name: str, handle=None, setup_s: float = 0.0, graph: bool = False,
                tokens: int | None = None, prefill_too: bool = True) -> None:  # fmt: skip
        for kind, routing in routings.items():
            routing.start()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            n = args.tokens if tokens is None else tokens
            times, logits, st = decode(model, ids[:, : ids.shape[1] - args.tokens + n],
                                       args.warmup, n, routing, handle, graph)  # fmt: skip
            ms = statistics.median(times)
            per, hit = moved(st, n, weight_bytes)
            if name.startswith("accelerate"):  # every weight copied at every forward
                per = weight_bytes
            add(name, kind, "decode", ms, per, hit, logits, setup_s, graph)
            if isinstance(handle, to.ExpertStreamHandle) and not graph:
                rows[-1] |= predicted(handle, routing, resident[(kind, "decode")][0], bw, args)
            if args.prefill and prefill_too and not graph:
                ms, st = prefill(model, long, routing, handle)
                per, hit = moved(st, args.prefill, weight_bytes)
                if name.startswith("accelerate"):
                    per = weight_bytes / args.prefill
                add(name, kind, f"prefill {args.prefill}", ms, per * args.prefill, hit, None,
                    setup_s)  # fmt: skip
            routing.stop()

    def add(name, kind, phase, ms, per, hit, logits, setup_s, graph=False):
        key = (kind, phase)
        if name == "resident":
            resident[key] = (ms, logits)
        if name.endswith("graph all cached"):
            resident[(kind, "graph")] = (ms, None)
        link = per / (bw * 1e9) * 1e3 if bw == bw else 0.0
        floor = resident.get((kind, "graph"), (math.nan,))[0] if graph else resident[key][0]
        bound = max(floor, link) if floor == floor else link
        want = resident[key][1]
        same = None if logits is None else bool(torch.equal(logits, want[: len(logits)]))
        peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else math.nan
        r = dict(routing=kind, phase=phase, row=name, ms=round(ms, 2), mib=round(per / MIB, 1),
                 hit=None if hit is None else round(hit, 3), bound_ms=round(bound, 2),
                 of_bound=round(ms / bound, 3) if bound else None, peak_gib=round(peak, 2),
                 same_logits=same, setup_s=round(setup_s, 1))  # fmt: skip
        rows.append(r)
        print(r, flush=True)

    measure("resident")
    least = to.minimum_cache_bytes(model)
    every = expert_bytes * 2  # more than every expert needs: capped
    graphs = [] if args.no_graph or device.type != "cuda" else [False, True]
    runs = [(every, "lru", True, False)] if graphs else []  # the graph's floor first
    for policy in policies:
        for cache in [least, *[int(c * GIB) for c in caches]]:
            if not args.no_eager:
                runs.append((cache, policy, False, False))
            if graphs:
                runs.append((cache, policy, True, False))
    if graphs and caches:
        runs.append((int(caches[len(caches) // 2] * GIB), policies[0], True, True))
    # The experts wait on the host between rows (as a model loaded there would): the device
    # then never holds them and a cache at once (the cache is allocated before they move)
    experts = [layer.mlp.experts for layer in model.model.layers]
    for m in experts:
        m.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for cache, policy, graph, prefetch in runs:
        t0 = time.perf_counter()
        h = to.stream_experts(model, device, cache_bytes=cache, policy=policy, prefetch=prefetch)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        name = {least: "least", every: "all cached"}.get(cache, f"{cache / GIB:g} GiB")
        name = f"stream_experts {name} {policy}" + (" graph" if graph else "")
        name += " prefetch" if prefetch else ""
        if cache == every:
            name = "stream_experts graph all cached"
        measure(name, h, time.perf_counter() - t0, graph=graph)
        h.remove()
        del h
        gc.collect()
    for m in experts:
        m.to(device)
    # stream_weights' remove() copies the model back while its arena is still allocated
    # (budget + model on the device): one budget at a time, removed before accelerate
    for budget in budgets:
        t0 = time.perf_counter()
        h = to.stream_weights(model, device, budget_bytes=int(budget * GIB))
        measure(f"stream_weights {budget:g} GiB", h, time.perf_counter() - t0,
                tokens=max(2, args.tokens // 2))  # fmt: skip
        h.remove()
        del h
        gc.collect()
    if args.accelerate and device.type == "cuda":  # last: leaves the model offloaded
        from accelerate import cpu_offload

        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cpu_offload(model, execution_device=device)
        measure("accelerate cpu_offload", None, time.perf_counter() - t0,
                tokens=args.accelerate, prefill_too=True)  # fmt: skip

    print("\n| routing | phase | row | ms | MiB/step | hit rate | bound ms | of bound | peak GiB | "
          "same logits |\n|---|---|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for r in rows:
        print(
            f"| {r['routing']} | {r['phase']} | {r['row']} | {r['ms']} | {r['mib']} | "
            f"{r['hit'] if r['hit'] is not None else '-'} | {r['bound_ms']} | {r['of_bound']} | "
            f"{r['peak_gib']} | {'-' if r['same_logits'] is None else r['same_logits']} |"
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
