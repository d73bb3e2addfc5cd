"""Mixture-of-experts inference: decode (batch 1) and prefill of a Qwen3-MoE with random weights,
resident against today's ``stream_weights``, ``stream_experts`` (routed experts only, through a
device expert cache of a few sizes; eagerly and replayed as CUDA graphs) and accelerate's
``cpu_offload``, with uniform and Zipf-skewed routing.

    python benchmarks/moe.py                                 # Qwen3-30B-A3B shape, bf16 (~61 GB)
    python benchmarks/moe.py --shape small                   # 4 layers x 32 experts: a quick run
    python benchmarks/moe.py --layers 8 --experts 64 --caches 1,2   # a shape in between

Rows, in this order (``ROWS``: a builder per kind of row), each under every routing, decode
then prefill:
- ``resident``: every tensor on the device (the eager experts loop of transformers).
- ``resident graph`` (CUDA, ``--impl grouped_mm``): the same, each decode step replayed in a
  CUDA graph of its own (`ResidentGraph`: the first step eager, the second captured): the
  compute term of the graph rows' bound. transformers' eager experts loop reads the routing on
  the host and cannot be captured: with ``--impl eager`` the row is skipped and the ``graph all
  cached`` row is that term, as before.
- ``stream_experts least``: routed-only, the least cache (one token's top-k of one block), so
  every routed expert is copied; then ``stream_experts C GiB`` for each ``--caches`` size (the
  issue's 8, 16 and 32 GiB by default), per ``--policies``.
- the same with ``graph`` (decode steps replayed by ``handle.cuda_graph``: routing, cache map
  and copies on the device; CUDA only, no prefill), after ``graph all cached`` (every expert in
  the cache, filled first by untimed forwards of ``--fill`` tokens, in chunks too small to stage
  a whole layer: the graph's compute term, no copies), and ``graph prefetch N``
  (``prefetch=N``, each of ``--prefetch``) at each cache size.
- ``resident graph beside`` (CUDA, ``--impl grouped_mm``, where the device holds the experts
  twice): the resident graph captured before the experts leave the device and replayed beside
  ``graph all cached``, one step of each in turn (`ResidentBeside`), that row's bound. The same
  resident graph took 11.43 ms a step as a process's first graph and 13.10 ms after other
  graphs and a cache had come and gone (H200, torch 2.11, 2026-11-30): rows measured minutes
  apart differ by more than the 5% the all-cached graph is held to.
- ``stream_weights B GiB``: today's engine, every weight streamed per token (``--stream-weights``
  budgets).
- ``accelerate cpu_offload``: every weight copied from pageable host memory at every forward, so
  ``--accelerate-tokens`` timed steps after one warm-up, one timed prefill and the first routing
  only (``--no-accelerate`` skips it; it runs on the CPU too when accelerate is installed).
- ``stream_experts least P host auto`` / ``host all`` (``--host-compute``): routed-only, eager,
  a small call's missed experts computed on the host (``host_compute``: split between the host
  and the link by rates measured at setup, printed; or all of them). Not bitwise on a GPU: those
  experts round as the CPU's kernels.

Columns: ms per step (decode: per token, the median of ``--tokens`` timed steps after
``--warmup``; prefill: one forward of ``--prefill`` tokens, median of 2), MiB copied to the
device per step, the cache's hit rate, the bound, ``x bound`` (the row's ms over the bound: 1.0
at the bound, larger is slower), peak device GiB, and whether its logits are bitwise the
resident model's (every decode step's). The bound is ``max(compute, bytes / bw)`` with bytes the
row's copies (missed experts, for ``stream_experts``), bw the pinned host-to-device bandwidth
measured in this run and compute the resident model's ms (eager rows) or the ``resident
graph`` row's (graph rows; ``graph all cached``'s where there is none). ``x serial`` (graph
decode rows): the row's ms over compute plus bytes / bw, the bound where nothing overlaps the
copies: a block's experts are known only after its router ran and the next block's attention
needs their output, so routed loading without a prediction (``prefetch``) copies and computes
one after the other.

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
A router called from another decoder layer than its own (stream_experts' ``prefetch=True``
runs the next block's router on this block's hidden states) sees the same noise with a share
``--unseen`` of its entries drawn again: 0.17 lets it predict about 0.8 of the next block's
routed experts (0.75 and 0.79 of a token's top 8 of 128, simulated for uniform and Zipf
routing), which is what predicting a block's experts from the previous block's gate input
reaches on Qwen3-30B-A3B (the pre-attention predictor of arXiv 2511.10676 reports 94.7% there,
about 15 points above that previous-layer method, FATE, arXiv 2502.12224). Without it (the
noise being a table of layer and position) a prediction would be exact, and with fresh noise
never right: neither is a model.

Host memory (the GPU machine has 128 GiB; the default shape's weights are 61 GB, 57 GiB, of
which 54 GiB experts). The model is built on the device (random init there is fast), and each
builder frees what it took before the next starts:
- ``resident``: nothing on the host.
- ``stream_experts`` rows (eager, then graph): the experts move to pageable host memory (54 GiB)
  so that the device never holds them and a cache at once; each row's setup copies them into
  its pinned store and frees the pageable copies, and its ``remove()`` copies them back and
  frees the store: 108 GiB at the peak, while both exist. The experts go back to the device
  after the builder's last row.
- ``stream_weights``: a pinned store of every weight (57 GiB), freed by ``remove()``; one budget
  at a time, as ``remove()`` copies the model back while the arena is still allocated (budget
  plus model on the device: pass one budget for the default shape on an 80 GB card).
- ``accelerate``: ``cpu_offload`` keeps a pageable copy of every weight (57 GiB) and puts the
  model's own tensors on the meta device; last, as it is never undone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weights import h2d_bandwidth, sync  # noqa: E402 (the link measured as weights.py does)

import torchoffload as to  # noqa: E402
from torchoffload.moe._grouped import STAGE_ROWS  # noqa: E402 (fill's chunks stay under it)
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


def build(shape: dict, device: torch.device, impl: str = "eager"):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=6144,
        moe_intermediate_size=shape["width"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"], max_position_embeddings=8192,
        experts_implementation=impl, tie_word_embeddings=False,
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
    the module doc): uniform (no bias) or Zipf-skewed with drift. Its tensors live on ``device``
    (default: the routers'), where the routers run."""

    def __init__(self, model, kind: str, a: float, drift: int, noise: float, positions: int,
                 device: torch.device | None = None, unseen: float = 0.17):  # fmt: skip
        self.kind = kind
        self.a = a
        self.drift = drift
        self.layers = list(model.model.layers)
        self.routers = [layer.mlp.gate for layer in self.layers]
        self.n = self.routers[0].num_experts
        dev = self.routers[0].weight.device if device is None else device
        self.bias = [torch.zeros(self.n, device=dev) for _ in self.routers]
        g = torch.Generator(device=dev).manual_seed(7)
        shape = (len(self.routers), positions, self.n)

        def gumbel():
            u = torch.rand(shape, generator=g, device=dev)
            return -torch.log(-torch.log(u.clamp_min(1e-30))) * noise

        self.scale = noise
        self.noise = gumbel()
        # What a router called from another layer's block sees (a prediction, such as
        # stream_experts' prefetch): the same noise with a fraction ``unseen`` of it drawn
        # again (the module doc: what the next layer's routing shares with this one's)
        redraw = torch.rand(shape, generator=g, device=dev) < unseen
        self.seen = torch.where(redraw, gumbel(), self.noise)
        self.current = None  # the decoder layer running
        self.one = torch.zeros(1, dtype=torch.long, device=dev)  # a decode step's position
        self.pos = self.one

    def start(self) -> None:
        """Install the routers and reset the drift: every row sees the same routing."""
        self.ranks = ZipfRanks([self.n] * len(self.routers), self.a, self.drift, seed=1)
        self._write()
        self.saved = []
        for li, r in enumerate(self.routers):
            # Under accelerate's hooks a module's forward is their wrapper, which loads the
            # weights and calls _old_forward: replace that one
            attr = "_old_forward" if hasattr(r, "_hf_hook") else "forward"
            self.saved.append((r, attr, r.__dict__.get(attr)))
            setattr(r, attr, _noisy(r, self, li))
        self.hooks = [h for li, layer in enumerate(self.layers) for h in (
            layer.register_forward_pre_hook(self._enter(li)),
            layer.register_forward_hook(self._exit),
        )]  # fmt: skip

    def _enter(self, li: int):
        def hook(module, args):
            self.current = li

        return hook

    def _exit(self, module, args, output) -> None:
        self.current = None

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
        for h in self.hooks:
            h.remove()
        self.current = None
        for r, attr, old in self.saved:
            if old is None:
                r.__dict__.pop(attr, None)
            else:
                setattr(r, attr, old)


def _noisy(router, routing: Routing, li: int):
    """Qwen3MoeTopKRouter.forward with the routing's bias and noise added to the logits."""

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        own = routing.current in (li, None)  # called from its own layer, or outside any
        extra = routing.bias[li] + (routing.noise if own else routing.seen)[li][routing.pos]
        logits = F.linear(hidden_states, router.weight) + extra.to(router.weight.dtype)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    return forward


def decode(model, ids: torch.Tensor, warmup: int, steps: int, routing: Routing, handle,
           graph: bool = False, cache_len: int | None = None,
           after_prompt=None, beside=None):  # fmt: skip
    """Teacher-forced decode after a prompt (``ids[0]``), one token a step (``ids[1 + i]``)
    over a static cache of ``cache_len`` positions (default: room for ``ids``), the step
    replayed by ``handle.cuda_graph`` when ``graph``: ms of each timed step, every step's
    logits, and the handle's stats over the timed steps. Rows compared bitwise need one
    ``cache_len``: attention over a longer cache rounds differently on the CPU.
    ``after_prompt``: called after the prompt's forward (the ``graph all cached`` row's fill:
    a prompt of ``STAGE_ROWS`` rows or more per expert stages its layers whole, which leaves
    the staging slots' experts uncached). ``beside``: (a step function, two lists) another
    model's step run with each step, first on even steps and second on odd ones, its timed
    steps' ms appended to the first list and every step's logits to the second."""
    from transformers import StaticCache

    device = ids.device
    prompt = ids[:, : -(warmup + steps)]
    n = prompt.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=cache_len or ids.shape[1] + 1)

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
        if after_prompt is not None:
            after_prompt()
        for i in range(warmup + steps):
            if i == warmup and handle is not None:
                handle.reset_stats()
            routing.step(i)
            routing.at(positions[n + i : n + i + 1])
            args = (ids[:, n + i : n + i + 1], positions[n + i : n + i + 1])
            both = [(f, times, logits)]
            if beside is not None:
                both = [both[0], beside][:: 1 if i % 2 else -1]
            for fn, into, outs in both:
                sync(device)
                t0 = time.perf_counter()
                out = fn(*args)
                sync(device)
                if i >= warmup:
                    into.append((time.perf_counter() - t0) * 1e3)
                outs.append(out.clone())
    return times, torch.stack(logits), handle.stats() if handle is not None else None


def prefill(model, x: torch.Tensor, routing: Routing, handle, runs: int = 2):
    """ms of one forward of ``x`` (median of ``runs`` after one warm-up) and the stats of the
    last."""
    times = []
    routing.at(torch.arange(x.shape[1], device=x.device))
    with torch.inference_mode():
        for i in range(1 + runs):
            if handle is not None:
                handle.reset_stats()
            sync(x.device)
            t0 = time.perf_counter()
            model(x)
            sync(x.device)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), handle.stats() if handle is not None else None


def fill(model, x: torch.Tensor, routing: Routing, chunk: int, handle) -> None:
    """Untimed forwards of ``x``, ``chunk`` tokens each: the ``graph all cached`` row's cache is
    filled after its prompt and before its warm-up, so that its timed steps copy nothing. Each
    chunk is below the rows at which a grouped_mm call stages its whole layer (Note: [Whole
    layers for large calls]): a staged call copies a layer into a region of the cache's
    storage and leaves no expert cached there, so one long forward would fill nothing."""
    with torch.inference_mode():
        for start in range(0, x.shape[1], chunk):
            routing.at(torch.arange(start, min(start + chunk, x.shape[1]), device=x.device))
            model(x[:, start : start + chunk])
    sync(x.device)
    st = handle.stats()
    total = sum(layer.experts for layer in st.layers)
    print(f"# fill ({routing.kind}): {st.cached} of {total} experts cached", flush=True)


def predicted(handle, routing: Routing, resident_ms: float, bw: float, args) -> dict:
    """The planner's decode prediction for a stream_experts row, from a synthetic profile of its
    routing (the routing model, not this run's routing): ms per token and hit rate."""
    link = bw * 1e9 if bw == bw else 1.0  # NaN: no link measured (the hit rate only)
    profile = synthetic_routing(handle, args.warmup + args.tokens, routing=routing.kind,
                                a=args.zipf, drift=args.drift)  # fmt: skip
    plan = plan_experts(handle, profile, link_bytes_per_s=link,
                        resident_ms_per_token=resident_ms, warmup_steps=args.warmup,
                        cache_bytes=[handle.stats().cache_bytes],
                        policy=handle._runtime.config.policy.value,
                        device_routed=handle._runtime.block_graphs is not None)  # fmt: skip
    (p,) = plan.predictions
    prefill = None if p.prefill_bytes is None else round(p.prefill_bytes / MIB, 1)
    return dict(pred_ms=round(p.ms_per_token, 2) if bw == bw else None,
                pred_hit=round(p.hit_rate, 3), pred_prefill_mib=prefill)  # fmt: skip


def moved(stats, tokens: int, weights_bytes: int) -> tuple[float, float | None]:
    """(bytes copied per token, hit rate) from an engine's stats."""
    if stats is None:
        return 0.0, None
    if isinstance(stats, to.ExpertStats):
        return stats.h2d_bytes / tokens, stats.hit_rate
    return stats.h2d_bytes / tokens, None


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the rows ------------------------------------------------------------------------------------
#
# Each kind of row has a builder: a generator that sets its engine up on the model, yields a Row
# (which main measures under every routing) and, resumed, takes it down before the next. They
# run in the order of ROWS; the order and what each frees are the host-memory plan of the
# module doc.


@dataclasses.dataclass
class Row:
    """An engine set up on the model, measured under each routing: decode, then a prefill."""

    name: str
    handle: Any = None  # stats(), reset_stats(), cuda_graph(); None: no stats
    setup_s: float = 0.0
    graph: bool = False  # decode steps replayed by handle.cuda_graph (no prefill row)
    warmup: int | None = None  # decode steps before timing (None: --warmup)
    tokens: int | None = None  # timed decode steps (None: --tokens)
    prefill_runs: int = 2  # timed prefills, after one warm-up
    copies: int | None = None  # bytes copied per forward, where no stats count them
    routings: int | None = None  # under the first n routings only (None: every one)
    fill: bool = False  # an untimed eager forward of --fill tokens first: every expert cached
    beside: Any = None  # a `ResidentBeside` replayed step by step beside this row's (graph)


@dataclasses.dataclass
class Bench:
    """What the row builders read."""

    model: Any
    device: torch.device
    args: argparse.Namespace
    caches: list[float]  # GiB
    budgets: list[float]  # GiB
    policies: list[str]
    expert_bytes: int
    weight_bytes: int
    beside: tuple | None = None  # `ResidentBeside`'s routings, ids, prompt and cache length


@contextlib.contextmanager
def experts_on_host(b: Bench) -> Iterator[None]:
    """The experts wait in pageable host memory (as those of a model loaded there would), so the
    device never holds them and a cache at once: stream_experts allocates its cache before it
    moves them."""
    experts = [layer.mlp.experts for layer in b.model.model.layers]
    for m in experts:
        m.to("cpu")
    empty_cache(b.device)
    try:
        yield
    finally:
        for m in experts:
            m.to(b.device)


def streamed_row(b: Bench, name: str, cache: int, policy: str, graph: bool = False,
                 prefetch: bool = False, host_compute: Any = False,
                 fill: bool = False) -> Iterator[Row]:  # fmt: skip
    """One stream_experts row: set up, measured, removed (its pinned store freed)."""
    t0 = time.perf_counter()
    h = to.stream_experts(b.model, b.device, cache_bytes=cache, policy=policy, prefetch=prefetch,
                          host_compute=host_compute)  # fmt: skip
    empty_cache(b.device)
    if host_compute is not False:
        print(f"# {name}: {h.host_compute}", flush=True)
    yield Row(name, h, time.perf_counter() - t0, graph=graph, fill=fill)
    h.remove()
    del h
    gc.collect()


def cache_sizes(b: Bench) -> list[tuple[str, int]]:
    """Routed-only (the least cache: one token's experts of one block, so every routed expert
    is copied), then each --caches size."""
    least = to.minimum_cache_bytes(b.model)
    return [("least", least), *((f"{c:g} GiB", int(c * GIB)) for c in b.caches)]


def resident_rows(b: Bench) -> Iterator[Row]:
    """Every tensor on the device: the compute term of the eager rows' bound."""
    yield Row("resident")


class CaptureFailed(RuntimeError):
    """The resident model's step could not be captured: its row is skipped."""


class ResidentGraph:
    """A handle-like object whose ``cuda_graph(step)`` replays the resident model's decode step
    in a CUDA graph of its own: the first call runs eagerly, the second is captured (running
    nothing) and replayed, later calls replay. A capture runs no kernel, so transformers'
    StaticCache (which writes at a counter it advances on the device, whatever
    ``cache_position`` says) advances once per step, as in the eager steps: logits comparable
    bitwise. No stats."""

    def cuda_graph(self, fn):
        state = {}

        def call(*args):
            if not state:
                state["eager"] = True
                return fn(*args)
            if "graph" not in state:
                state["inputs"] = [a.clone() for a in args]
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        state["out"] = fn(*state["inputs"])
                except Exception as e:
                    raise CaptureFailed(f"{type(e).__name__}: {e}") from e
                state["graph"] = graph
            else:
                for static, a in zip(state["inputs"], args, strict=True):
                    static.copy_(a)
            state["graph"].replay()
            return state["out"]

        return call

    def reset_stats(self) -> None:
        pass

    def stats(self) -> None:
        return None


class ResidentBeside:
    """The resident model's decode step captured in a CUDA graph (`ResidentGraph`) per routing
    while the experts are on the device, then replayed beside a stream_experts graph row
    (`decode`'s ``beside``): both measured in one process state. Keeps the experts' device
    tensors (their parameters move to the host): the device holds them twice. After the
    capture its static cache is emptied and given the prompt again, so its replays compute
    the resident decode's steps: their logits are compared with the resident row's (a check
    that the kept experts are the ones it computes with)."""

    def __init__(self, b: Bench, routings: dict, ids: torch.Tensor, prompt: int,
                 cache_len: int):  # fmt: skip
        from transformers import StaticCache

        model = b.model
        self.kept = [p.data for layer in model.model.layers for p in layer.mlp.experts.parameters()]
        self.steps = {}
        positions = torch.arange(ids.shape[1], device=b.device)
        for kind, routing in routings.items():
            cache = StaticCache(config=model.config, max_cache_len=cache_len + 2)

            def step(x, pos, cache=cache):
                out = model(input_ids=x, position_ids=pos.unsqueeze(0), cache_position=pos,
                            past_key_values=cache, use_cache=True)  # fmt: skip
                return out.logits[:, -1]

            f = ResidentGraph().cuda_graph(step)
            routing.start()
            at = slice(prompt, prompt + 1)  # the first decode step's position
            try:
                with torch.inference_mode():
                    # the prompt, then its first step: run eagerly, then captured (and
                    # replayed once); the cache emptied (in place: the graph reads the same
                    # tensors) and given the prompt again after each, so the row's replays
                    # compute its steps from the first
                    for call in ("eager", "capture", None):
                        routing.at(positions[:prompt])
                        model(input_ids=ids[:, :prompt], cache_position=positions[:prompt],
                              past_key_values=cache, use_cache=True)  # fmt: skip
                        if call is None:
                            break
                        routing.at(positions[at])
                        f(ids[:, at], positions[at])
                        cache.reset()
            finally:
                routing.stop()
            self.steps[kind] = f

    @staticmethod
    def fits(b: Bench) -> bool:
        """Whether the device has room for the experts a second time, and a margin."""
        empty_cache(b.device)
        free, _ = torch.cuda.mem_get_info(b.device)
        return free > 1.1 * b.expert_bytes + 4 * GIB


def resident_graph_rows(b: Bench) -> Iterator[Row]:
    """The resident model's decode steps replayed in a CUDA graph of its own (CUDA and
    grouped_mm experts only): the compute term of the graph rows' bound."""
    if b.args.no_graph or b.device.type != "cuda":
        return
    if b.args.impl != "grouped_mm":
        print("# resident graph skipped: transformers' eager experts read the routing on the "
              "host (the graph rows' compute term: graph all cached)", flush=True)  # fmt: skip
        return
    yield Row("resident graph", ResidentGraph(), graph=True)


def stream_experts_rows(b: Bench) -> Iterator[Row]:
    """stream_experts, eager: routed-only and each cache size, per --policies."""
    if b.args.no_eager:
        return
    with experts_on_host(b):
        for policy in b.policies:
            for label, cache in cache_sizes(b):
                yield from streamed_row(b, f"stream_experts {label} {policy}", cache, policy)


def host_compute_rows(b: Bench) -> Iterator[Row]:
    """stream_experts routed-only, eager, with cold experts on the host: split by measured
    rates, then all of them (--host-compute)."""
    if not b.args.host_compute:
        return
    with experts_on_host(b):
        least, policy = to.minimum_cache_bytes(b.model), b.policies[0]
        for mode, value in (("auto", "auto"), ("all", True)):
            name = f"stream_experts least {policy} host {mode}"
            yield from streamed_row(b, name, least, policy, host_compute=value)


def graph_rows(b: Bench) -> Iterator[Row]:
    """stream_experts with its decode steps replayed by handle.cuda_graph (CUDA only): every
    expert cached first (the compute term of the graph rows' bound: no copies), then as the
    eager rows, then prefetch=N (each of --prefetch) at each cache size."""
    if b.args.no_graph or b.device.type != "cuda":
        return
    beside = None
    if b.beside is not None and b.args.impl == "grouped_mm":
        if ResidentBeside.fits(b):
            try:
                beside = ResidentBeside(b, *b.beside)
            except CaptureFailed as e:
                print(f"# resident graph beside skipped: its capture failed ({e})", flush=True)
        else:
            print("# resident graph beside skipped: the device cannot hold the experts twice",
                  flush=True)  # fmt: skip
    with experts_on_host(b):
        every = 2 * b.expert_bytes  # more than every expert needs: capped
        for row in streamed_row(b, "stream_experts graph all cached", every, "lru", graph=True,
                                fill=True):  # fmt: skip
            row.beside = beside
            yield row
            row.beside = None
        del beside  # the experts' second copy freed before the next rows
        empty_cache(b.device)
        for policy in b.policies:
            for label, cache in cache_sizes(b):
                name = f"stream_experts {label} {policy} graph"
                yield from streamed_row(b, name, cache, policy, graph=True)
        policy = b.policies[0]
        for c in b.caches:
            for ahead in b.args.prefetch:  # experts copied ahead a block call, at most
                name = f"stream_experts {c:g} GiB {policy} graph prefetch {ahead}"
                yield from streamed_row(b, name, int(c * GIB), policy, graph=True,
                                        prefetch=ahead)  # fmt: skip


def stream_weights_rows(b: Bench) -> Iterator[Row]:
    """Today's stream_weights: every weight streamed through an arena of each budget."""
    for budget in b.budgets:
        t0 = time.perf_counter()
        h = to.stream_weights(b.model, b.device, budget_bytes=int(budget * GIB))
        yield Row(f"stream_weights {budget:g} GiB", h, time.perf_counter() - t0,
                  tokens=max(2, b.args.tokens // 2))  # fmt: skip
        h.remove()
        del h
        gc.collect()


def accelerate_rows(b: Bench) -> Iterator[Row]:
    """accelerate's cpu_offload: every weight copied from (pageable) host memory at every
    forward, so a few tokens, one warm-up step, one timed prefill and the first routing only
    (what it copies does not depend on the routing). Not undone: last."""
    if b.args.no_accelerate:
        return
    try:
        import accelerate
    except ImportError:
        print("# accelerate not installed: its row skipped", flush=True)
        return
    t0 = time.perf_counter()
    accelerate.cpu_offload(b.model, execution_device=b.device)
    gc.collect()
    empty_cache(b.device)
    yield Row(f"accelerate {accelerate.__version__} cpu_offload", None,
              time.perf_counter() - t0, warmup=1, tokens=b.args.accelerate_tokens,
              prefill_runs=1, copies=b.weight_bytes, routings=1)  # fmt: skip


# In this order (the module doc says why).
ROWS = [resident_rows, resident_graph_rows, stream_experts_rows, host_compute_rows, graph_rows,
        stream_weights_rows, accelerate_rows]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    for name in ("layers", "experts", "top-k"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the shape's")
    p.add_argument(
        "--caches", default=None, help="expert cache sizes in GiB, comma-separated ('' for none)"
    )
    p.add_argument("--stream-weights", default=None, help="budgets in GiB ('' for none)")
    p.add_argument("--policies", default="lru", help="cache policies: lru, lfu or both")
    p.add_argument("--routing", default="uniform,zipf")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the skewed routing")
    p.add_argument("--drift", type=int, default=8, help="tokens between rank swaps (0: none)")
    p.add_argument("--noise", type=float, default=8.0, help="scale of the routing's noise")
    p.add_argument("--unseen", type=float, default=0.17,
                   help="share of the noise a router called from another layer sees drawn again "
                        "(0.17: ~0.8 of its top-k predicted)")  # fmt: skip
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument(
        "--fill",
        type=int,
        default=2048,
        help="tokens of the forward that fills the 'graph all cached' row's cache",
    )
    p.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    p.add_argument("--tokens", type=int, default=16, help="timed decode steps")
    p.add_argument("--prefill", type=int, default=2048, help="prefill tokens (0: skip)")
    p.add_argument("--no-graph", action="store_true", help="skip the cuda_graph rows")
    p.add_argument(
        "--prefetch",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[2],
        help="the graph prefetch rows' prefetch= values (experts copied ahead a "
        "block call, at most), comma-separated",
    )
    p.add_argument("--no-eager", action="store_true", help="skip the eager stream_experts rows")
    p.add_argument("--no-accelerate", action="store_true", help="skip accelerate's row")
    p.add_argument("--host-compute", action="store_true", help="add the host_compute rows")
    p.add_argument("--impl", choices=["eager", "grouped_mm"], default="eager",
                   help="transformers' experts implementation: the per-expert loop, or its "
                   "default grouped GEMMs (host_compute rows need eager)")  # fmt: skip
    p.add_argument("--accelerate-tokens", type=int, default=2, metavar="N",
                   help="timed decode steps of accelerate's cpu_offload")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if args.accelerate_tokens < 1:
        p.error("--accelerate-tokens must be at least 1 (--no-accelerate skips the row)")

    shape = dict(SHAPES[args.shape])
    for key in ("layers", "experts", "top_k"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    caches = [float(c) for c in (shape["caches"] if args.caches is None else args.caches)
              .split(",") if c]  # fmt: skip
    sw = args.stream_weights if args.stream_weights is not None else shape["stream_weights"]
    budgets = [float(b) for b in sw.split(",") if b]
    policies = args.policies.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.host_compute and args.impl != "eager":
        p.error("--host-compute needs --impl eager (host compute refuses grouped_mm)")
    model = build(shape, device, args.impl)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if ".experts." in n)  # fmt: skip
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = h2d_bandwidth(device)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"# {datetime.date.today()} {gpu} torch {torch.__version__}; Qwen3-MoE {shape['layers']} "
        f"layers x {shape['experts']} experts (top {shape['top_k']}), hidden {shape['hidden']}, "
        f"width {shape['width']}, bf16, experts {args.impl}: weights {weight_bytes / GIB:.2f} "
        f"GiB, experts {expert_bytes / GIB:.2f} GiB; pinned H2D {bw:.1f} GB/s",
        flush=True,
    )
    g = torch.Generator().manual_seed(0)
    steps = args.warmup + args.tokens
    ids = torch.randint(0, shape["vocab"], (1, args.prompt + steps), generator=g).to(device)
    long = torch.randint(0, shape["vocab"], (1, args.prefill), generator=g).to(device)
    fill_ids = torch.randint(0, shape["vocab"], (1, args.fill), generator=g).to(device)
    fill_chunk = max(1, (STAGE_ROWS * shape["experts"] - 1) // shape["top_k"])
    positions = max(args.prefill, ids.shape[1], args.fill) + 1
    routings = {k: Routing(model, k, args.zipf, args.drift, args.noise, positions,
                           unseen=args.unseen)
                for k in args.routing.split(",")}  # fmt: skip
    rows, resident = [], {}

    def measure(row: Row) -> None:
        warmup = args.warmup if row.warmup is None else row.warmup
        n = args.tokens if row.tokens is None else row.tokens
        for kind, routing in list(routings.items())[: row.routings]:
            routing.start()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # eager forwards of --fill tokens route to every expert of every layer: after the
            # prompt (see `decode`)
            filled = None
            if row.fill:
                filled = functools.partial(fill, model, fill_ids, routing, fill_chunk, row.handle)
            # the same prompt and the first warmup + n of the resident row's steps
            beside = None if row.beside is None else (row.beside.steps[kind], [], [])
            try:
                times, logits, st = decode(model, ids[:, : args.prompt + warmup + n], warmup, n,
                                           routing, row.handle, row.graph,
                                           cache_len=ids.shape[1] + 1, after_prompt=filled,
                                           beside=beside)  # fmt: skip
            except CaptureFailed as e:
                print(f"# {row.name} ({kind}) skipped: its capture failed ({e})", flush=True)
                routing.stop()
                continue
            if beside is not None:  # this row's bound, measured step by step beside it
                add(Row("resident graph beside", graph=True), kind, "decode",
                    statistics.median(beside[1]), 0, None, torch.stack(beside[2]))  # fmt: skip
            per, hit = moved(st, n, weight_bytes)
            add(row, kind, "decode", statistics.median(times), row.copies or per, hit, logits)
            guess = None
            if isinstance(row.handle, to.ExpertStreamHandle) and not row.graph:
                rows[-1] |= predicted(row.handle, routing, resident[(kind, "decode")][0], bw, args)
                guess = rows[-1].pop("pred_prefill_mib")
            if args.prefill and not row.graph:
                ms, st = prefill(model, long, routing, row.handle, row.prefill_runs)
                per, hit = moved(st, 1, weight_bytes)
                add(row, kind, f"prefill {args.prefill}", ms, row.copies or per, hit, None)
                if guess is not None:  # a staged prefill's copies, after the synthetic decode
                    rows[-1]["pred_mib"] = guess
            routing.stop()

    def add(row: Row, kind, phase, ms, per, hit, logits):
        key = (kind, phase)
        if row.name == "resident":
            resident[key] = (ms, logits)
        if row.name == "resident graph" or (row.name.endswith("graph all cached")
                                            and (kind, "graph") not in resident):  # fmt: skip
            resident[(kind, "graph")] = (ms, None)
        if row.name == "resident graph beside":
            resident[(kind, "beside")] = (ms, None)
        link = per / (bw * 1e9) * 1e3 if bw == bw else 0.0
        floor = resident.get((kind, "graph"), (math.nan,))[0] if row.graph else resident[key][0]
        if row.name.endswith("graph all cached") and (kind, "beside") in resident:
            floor = resident.pop((kind, "beside"))[0]  # measured beside it
        bound = max(floor, link) if floor == floor else link
        serial = floor + link if row.graph and floor == floor else None
        want = resident[(kind, "decode")][1]  # of the same steps: the first len(logits)
        same = None if logits is None else bool(torch.equal(logits, want[: len(logits)]))
        peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else math.nan
        r = dict(routing=kind, phase=phase, row=row.name, ms=round(ms, 2),
                 mib=round(per / MIB, 1), hit=None if hit is None else round(hit, 3),
                 bound_ms=round(bound, 2), x_bound=round(ms / bound, 3) if bound else None,
                 x_serial=round(ms / serial, 3) if serial else None,
                 peak_gib=round(peak, 2), same_logits=same,
                 setup_s=round(row.setup_s, 1))  # fmt: skip
        rows.append(r)
        print(r, flush=True)

    # An untimed decode and prefill first: the first row measured once ran 5-6x slower than
    # the same row later (benchmarks/log/2026-11-26-runtime-split-and-moe.md)
    first = next(iter(routings.values()))
    first.start()
    decode(model, ids, args.warmup, args.tokens, first, None)
    if args.prefill:
        prefill(model, long, first, None, runs=1)
    first.stop()
    b = Bench(model, device, args, caches, budgets, policies, expert_bytes, weight_bytes)
    if device.type == "cuda":
        b.beside = (routings, ids, args.prompt, ids.shape[1] + 1)
    for builder in ROWS:
        for row in builder(b):
            measure(row)

    print("\n| routing | phase | row | ms | MiB/step | hit rate | bound ms | x bound | x serial "
          "| peak GiB | same logits |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
          )  # fmt: skip
    for r in rows:
        print(
            f"| {r['routing']} | {r['phase']} | {r['row']} | {r['ms']} | {r['mib']} | "
            f"{r['hit'] if r['hit'] is not None else '-'} | {r['bound_ms']} | {r['x_bound']} | "
            f"{r['x_serial'] or '-'} | {r['peak_gib']} | "
            f"{'-' if r['same_logits'] is None else r['same_logits']} |"
        )
    print("\nThe planner's prediction (plan_experts, a synthetic routing of the same kind) per "
          "decode row:\n\n| routing | row | ms | predicted ms | hit rate | predicted hit rate |\n"
          "|---|---|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        if "pred_ms" in r:
            print(f"| {r['routing']} | {r['row']} | {r['ms']} | {r['pred_ms']} | {r['hit']} | "
                  f"{r['pred_hit']} |")  # fmt: skip
    if any("pred_mib" in r for r in rows):
        print("\nPer prefill row, the MiB the planner predicts a staged prefill copies after the "
              "synthetic decode (plan_experts' prefill_bytes; each row's prefill runs after its "
              "decode steps, a second routing's after the first's prefill too):\n\n| routing | "
              "row | MiB | predicted MiB |\n|---|---|---:|---:|")  # fmt: skip
        for r in rows:
            if "pred_mib" in r:
                print(f"| {r['routing']} | {r['row']} | {r['mib']} | {r['pred_mib']} |")
    if args.json:
        args.json.write_text(json.dumps(dict(bw_gbps=bw, shape=shape, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
