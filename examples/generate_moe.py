"""Generate text with a mixture-of-experts model whose experts live in host memory.

`torchoffload.stream_experts` keeps the experts in pinned host memory. After each block's router
runs, only the routed experts that are not already in a device expert cache of ``--cache-gib``
(or ``--cache-experts N`` experts) are copied to the device; the dense parts (attention, norms,
embeddings, routers) stay there. The model's own ``generate`` is used unchanged.

    python examples/generate_moe.py                            # a small Qwen3-MoE, random weights
    python examples/generate_moe.py --cache-experts 8          # a cache of 8 experts
    python examples/generate_moe.py --routing zipf --zipf 1.2  # skewed routing: more hits
    python examples/generate_moe.py --model-path ./Qwen3-30B-A3B --cache-gib 16 --no-compare

It generates greedily twice, with every tensor on the device (unless ``--no-compare``) and with
``stream_experts``, and prints the tokens/s of both, the cache's hit rate, the bytes copied per
token and whether the tokens are bitwise equal. Needs ``transformers``. The device is CUDA when
there is one, else the CPU, where the same code runs with host-to-host copies in seconds.

Routing: the model's own routers by default. With random weights they route unlike a trained
model's, so the hit rate says little. ``--routing uniform`` adds noise to each router's logits
so that each token's experts are a uniform draw (the worst case for a cache); ``--routing zipf``
adds a bias too, so that a few experts of each layer take most tokens, their popularity drifting
slowly, as traces of real MoE decoding show. These are benchmarks/moe.py's routings, reused
from there (Qwen3-MoE models only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import torchoffload


def size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def build(args: argparse.Namespace, device: torch.device):
    """A local checkpoint, or a Qwen3-MoE with random weights; on the host either way, with the
    per-expert loop of transformers (what stream_experts replaces)."""
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=dtype, local_files_only=True
        )
    else:
        config = transformers.Qwen3MoeConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            moe_intermediate_size=args.width, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 4),
            head_dim=args.hidden // args.heads, num_experts=args.experts,
            num_experts_per_tok=args.top_k, max_position_embeddings=4096,
        )  # fmt: skip
        torch.manual_seed(0)
        with torch.device(device):  # random init on the device is fast; then to the host
            model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
        model.to("cpu")
    model.set_experts_implementation(args.impl)
    return model.eval()


def skewed_routing(model, args: argparse.Namespace, device: torch.device):
    """benchmarks/moe.py's routing on ``model``'s routers (the bias and noise of each position
    added to their logits); returns the function that restarts it before a run, so that every
    run routes alike."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from moe import Routing

    positions = args.prompt_len + args.new_tokens
    routing = Routing(model, args.routing, args.zipf, args.drift, 8.0, positions, device=device)
    calls = 0

    def before_forward(module, inputs, kwargs):  # each call of the model: its positions
        nonlocal calls
        routing.step(calls)
        routing.at(kwargs["position_ids"][0])
        calls += 1

    model.register_forward_pre_hook(before_forward, with_kwargs=True)

    def restart() -> None:
        nonlocal calls
        calls = 0
        routing.start()

    return restart


def generate(model, prompt, new_tokens: int, device: torch.device, before_run, after_warmup=None):
    """Greedy generation, timed after one full warm-up run; returns (tokens, seconds)."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    kwargs["pad_token_id"] = 0
    with torch.inference_mode():
        before_run()
        model.generate(prompt, **kwargs)  # warm-up
        if after_warmup is not None:
            after_warmup()
        before_run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="a local HF checkpoint directory")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    shape = p.add_argument_group("the random model (default: small on the CPU, larger on a GPU)")
    for name in ("layers", "experts", "top-k", "hidden", "width", "heads", "vocab"):
        shape.add_argument(f"--{name}", type=int, default=None)
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cache-gib", type=float, default=None, help="device expert cache")
    cache.add_argument("--cache-experts", type=int, default=None, metavar="N",
                       help="a cache of N experts (default: a quarter of them)")  # fmt: skip
    p.add_argument("--policy", choices=("lru", "lfu"), default="lru", help="what the cache evicts")
    p.add_argument("--impl", choices=("eager", "grouped_mm"), default="eager",
                   help="transformers' experts implementation: the per-expert loop, or its "
                   "default grouped GEMMs (both stream bitwise)")  # fmt: skip
    p.add_argument("--routing", choices=("model", "uniform", "zipf"), default="model")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of --routing zipf")
    p.add_argument("--drift", type=int, default=8, help="tokens between rank swaps (zipf)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-compare", action="store_true", help="skip the all-on-device run")
    args = p.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    defaults = dict(layers=8, experts=64, top_k=8, hidden=2048, width=768, heads=16, vocab=32000)
    if not gpu:
        defaults = dict(layers=4, experts=16, top_k=4, hidden=256, width=128, heads=4, vocab=2048)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    model = build(args, device)
    restart = skewed_routing(model, args, device) if args.routing != "model" else lambda: None

    # The cache is counted in experts (slots of the largest one); the least holds one token's
    # routed experts of one block.
    least = torchoffload.minimum_cache_bytes(model)
    top_k = model.config.num_experts_per_tok
    slot = least // top_k
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if ".experts." in n)  # fmt: skip
    if args.cache_gib is not None:
        cache_bytes = int(args.cache_gib * 2**30)
    elif args.cache_experts is not None:
        cache_bytes = args.cache_experts * slot
    else:
        cache_bytes = max(experts // 4 // slot * slot, least)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (1, args.prompt_len), generator=gen)
    prompt = prompt.to(device)
    print(
        f"{type(model).__name__}: {size(experts)} of experts ({size(slot)} each), on {device} "
        f"(torch {torch.__version__}); expert cache {size(cache_bytes)}, {cache_bytes // slot} "
        f"experts (least: {top_k}), {args.policy}; routing: {args.routing}; {args.prompt_len} "
        f"prompt tokens, {args.new_tokens} new"
    )

    rows = []
    expected = None
    if not args.no_compare:
        model.to(device)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        expected, seconds = generate(model, prompt, args.new_tokens, device, restart)
        rows.append(("resident", seconds, torch.cuda.max_memory_allocated() if gpu else None))
        model.to("cpu")
        if gpu:
            torch.cuda.empty_cache()

    # The recipe: one call. The experts move to pinned host memory, the dense parts to the
    # device, and a cache of cache_bytes is allocated there.
    handle = torchoffload.stream_experts(model, device, cache_bytes=cache_bytes, policy=args.policy)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    got, seconds = generate(model, prompt, args.new_tokens, device, restart, handle.reset_stats)
    rows.append(("stream_experts", seconds, torch.cuda.max_memory_allocated() if gpu else None))
    st = handle.stats()  # of the timed run

    print(f"\n{'mode':<16}{'tokens/s':>10}{'ms/token':>10}{'peak device GiB':>17}")
    for name, secs, peak in rows:
        mem = f"{peak / 2**30:.2f}" if peak is not None else "n/a"
        print(f"{name:<16}{args.new_tokens / secs:>10.1f}{secs / args.new_tokens * 1e3:>10.1f}"
              f"{mem:>17}")  # fmt: skip
    link = f", {st.h2d_bytes / rows[-1][1] / 1e9:.1f} GB/s" if gpu else ""
    print(
        f"\nstream_experts: hit rate {st.hit_rate:.3f} ({st.hits} hits, {st.misses} misses, "
        f"{st.evictions} evictions), {size(st.bytes_per_token)} copied per token over "
        f"{st.tokens} tokens (prompt included), {size(st.h2d_bytes)} in all{link}; "
        f"{st.cached} of {st.slots} cache slots used"
    )
    if st.block_replays or st.block_eager_calls:  # one-token calls replayed per layer (GPU)
        print(
            f"block graphs: {st.block_replays} one-token block calls replayed, "
            f"{st.block_captures} captured, {st.block_eager_calls} run without a graph"
        )
    if expected is not None:
        print(f"tokens identical to the resident run: {torch.equal(expected, got)}")
    handle.remove()  # every expert back in the model, as it was


if __name__ == "__main__":
    main()
