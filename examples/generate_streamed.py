"""Generate text with a Hugging Face model whose weights live in host memory.

`torchoffload.stream_weights` keeps the weights in pinned host memory and streams them into a
device arena capped at ``--budget-gib``, prefetching the next layers while the current one runs.
The model's own ``generate`` is used unchanged.

    python examples/generate_streamed.py                          # random weights, no download
    python examples/generate_streamed.py --model-path ./my-llama  # a local checkpoint
    python examples/generate_streamed.py --hidden 4096 --layers 16 --budget-gib 2

It generates once with all weights on the device (unless ``--no-compare``) and once streamed,
and prints speed, memory and whether the tokens are identical. Needs ``transformers``.

Then it decodes the same tokens the way a serving loop does: a static KV cache and one step
per token, the step replayed as a CUDA graph with its weight copies captured in it
(``handle.cuda_graph``; on the CPU the same bookkeeping runs without a graph). With
``--compile`` the step calls ``torch.compile(model)`` instead, and ``handle.cuda_graph``
captures Inductor's kernels together with the copies: the fast compiled path.

With ``--aoti`` it also compiles the model with AOTInductor into a package that holds no
weights (``torchoffload.compile.save_streamed_package``) and generates with it, the weights
streamed from a safetensors file (``load_streamed_package``).
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

import torchoffload


def size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def build(args: argparse.Namespace, device: torch.device):
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model_path:
        return transformers.AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=dtype, local_files_only=True
        ).eval()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 8 / 3) // 256 * 256 or 256,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 4),
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device is fast; then back to the host
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return model.to("cpu").eval()


def generate(model, prompt, new_tokens: int, device: torch.device, after_warmup=None):
    """Greedy generation, timed after one full warm-up run; returns (tokens, seconds)."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    kwargs["pad_token_id"] = 0
    with torch.inference_mode():
        model.generate(prompt, **kwargs)  # warm-up (and, when streamed, the schedule)
        if after_warmup is not None:
            after_warmup()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return out, time.perf_counter() - start


def decode_static(model, prompt, new_tokens: int, device, graph=None, step_model=None, reset=None):
    """Greedy decode over a static KV cache, one token per step; ``graph``: the handle's
    ``cuda_graph``, which replays each step as a CUDA graph; ``step_model``: what the steps
    call (``torch.compile(model)``; default the model). Timed after a warm-up decode (it
    captures the graph), after which ``reset`` (the handle's ``reset_stats``) is called;
    returns (tokens, seconds)."""
    from transformers import StaticCache

    n = prompt.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=n + new_tokens)
    # transformers 5.24 names it ``cache`` (``past_key_values`` still works, with a warning)
    params = inspect.signature(model.forward).parameters
    with_cache = {"cache" if "cache" in params else "past_key_values": cache}
    step_model = model if step_model is None else step_model

    def step(ids, pos):
        out = step_model(input_ids=ids, position_ids=pos.expand(ids.shape[0], 1),
                         cache_position=pos, use_cache=True, **with_cache)  # fmt: skip
        return out.logits[:, -1]

    run_step = graph(step) if graph is not None else step
    positions = torch.arange(n, n + new_tokens, device=device)

    def decode():
        with torch.inference_mode():
            cache.reset()
            out = model(input_ids=prompt, cache_position=positions.new_tensor(range(n)),
                        use_cache=True, **with_cache)  # fmt: skip
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            toks = [tok]
            for i in range(new_tokens - 1):
                tok = run_step(tok, positions[i : i + 1]).argmax(-1, keepdim=True)
                toks.append(tok)
        return torch.cat(toks, 1)

    decode()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if reset is not None:
        reset()  # the stats of the timed decode only
    start = time.perf_counter()
    toks = decode()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return toks, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="a local HF checkpoint directory")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--budget-gib", type=float, default=None, help="device arena cap")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-compare", action="store_true", help="skip the all-on-device run")
    p.add_argument(
        "--aoti",
        action="store_true",
        help="also compile an AOTInductor package without weights and run it streamed",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also decode with torch.compile(model) replayed in the streamed CUDA graph",
    )
    args = p.parse_args()
    device = torchoffload._transfer.compute_device(None)
    gpu = device.type == "cuda"
    args.hidden = args.hidden or (2048 if gpu else 256)
    args.layers = args.layers or (16 if gpu else 4)
    args.heads = args.heads or max(1, args.hidden // 128)
    args.vocab = args.vocab or (32000 if gpu else 2048)
    model = build(args, device)
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    least = torchoffload.minimum_budget(model)  # what the largest units need, pipelined
    if args.budget_gib is not None:
        budget = int(args.budget_gib * 2**30)
    else:  # a quarter of the weights, or the least that works
        budget = max(n_bytes // 4, least)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=gen).to(device)
    print(
        f"{type(model).__name__}: {size(n_bytes)} of weights, on {device} "
        f"(torch {torch.__version__}); budget {size(budget)} (least that works: "
        f"{size(least)}); batch {args.batch}, "
        f"{args.new_tokens} new tokens"
    )

    rows = []
    expected = None
    if not args.no_compare:
        model.to(device)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        expected, seconds = generate(model, prompt, args.new_tokens, device)
        peak = torch.cuda.max_memory_allocated() if gpu else None
        rows.append(("all on device", seconds, peak, None))
        expected_static, seconds = decode_static(model, prompt, args.new_tokens, device)
        rows.append(("  static cache", seconds, None, None))
        model.to("cpu")
        if gpu:
            torch.cuda.empty_cache()

    # First, the check anyone can run on their own model: one forward of the prompt, resident
    # against streamed at this budget, bitwise (on copies of the model).
    report = torchoffload.verify(
        model.to(device) if gpu else model, (prompt,),
        apply=lambda m: torchoffload.stream_weights(m, device, budget_bytes=budget,
                                                    pin_memory=gpu),
    )  # fmt: skip
    model.to("cpu")
    print(f"verify (stream_weights against resident): {report}")

    # The recipe: one call; the weights move to pinned host memory, the arena to the device.
    handle = torchoffload.stream_weights(model, device, budget_bytes=budget, pin_memory=gpu)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    got, seconds = generate(model, prompt, args.new_tokens, device, handle.reset_stats)
    peak = torch.cuda.max_memory_allocated() if gpu else None
    stats = handle.stats()
    rows.append(("stream_weights", seconds, peak, stats))
    graphed, seconds = decode_static(
        model, prompt, args.new_tokens, device, handle.cuda_graph, reset=handle.reset_stats
    )
    graph_stats = handle.stats()
    rows.append(("  + CUDA graph", seconds, None, graph_stats))
    if args.compile:  # Inductor's kernels and the weight copies, replayed in one graph
        # Every streamed unit is a graph break, and the frames resumed after one are
        # specialized on Hugging Face's layer index: one compilation per layer
        torch._dynamo.config.recompile_limit = max(64, 2 * args.layers)
        compiled, seconds = decode_static(model, prompt, args.new_tokens, device,
                                          handle.cuda_graph, torch.compile(model),
                                          reset=handle.reset_stats)  # fmt: skip
        rows.append(("  + compiled", seconds, None, handle.stats()))

    print(f"\n{'mode':<16}{'tokens/s':>10}{'ms/token':>10}{'peak device GiB':>17}{'H2D GB/s':>10}")
    for name, secs, peak_bytes, st in rows:
        tokens = args.batch * args.new_tokens
        mem = f"{peak_bytes / 2**30:.2f}" if peak_bytes is not None else "n/a"
        link = f"{st.h2d_bytes / secs / 1e9:.1f}" if st is not None and gpu else "-"
        print(
            f"{name:<16}{tokens / secs:>10.1f}{secs / args.new_tokens * 1e3:>10.1f}"
            f"{mem:>17}{link:>10}"
        )
    print(
        f"\nstreamed {size(stats.streamed_bytes)} of weights through a "
        f"{size(stats.arena_bytes)} arena: {stats.units} units, {stats.kept_units} "
        f"kept, hit rate {stats.hit_rate:.3f}, setup {stats.setup_s:.1f} s"
    )
    print(f"CUDA-graph decode: {graph_stats.graph_replays} of {graph_stats.calls} calls replayed "
          "(timed decode)")  # fmt: skip
    if expected is not None:
        print(f"tokens identical to the all-on-device run: {torch.equal(expected, got)}")
        same = torch.equal(expected_static, graphed)
        print(f"CUDA-graph tokens identical to the all-on-device static-cache decode: {same}")
        if args.compile:  # compiled kernels fuse and round differently from eager ones
            same = torch.equal(expected_static, compiled)
            print(f"compiled tokens identical to the eager static-cache decode: {same} "
                  "(compiled kernels may round differently)")  # fmt: skip
    handle.remove()
    if args.aoti:
        aoti(model, prompt, args.new_tokens, device, budget)


def aoti(model, prompt, new_tokens: int, device: torch.device, budget: int) -> None:
    """The compiled path: an AOTInductor package that holds no weights, its weights streamed
    from a safetensors file. The model's forward without a KV cache is exported with a dynamic
    sequence length, and each token recomputes the whole sequence (a simple loop; a serving
    loop exports a step with its cache as inputs, as benchmarks/aoti_decode.py does)."""
    import tempfile
    from pathlib import Path

    import torchoffload.compile as toc

    work = Path(tempfile.mkdtemp(prefix="generate_streamed_"))
    seq = torch.export.Dim("seq", min=2, max=prompt.shape[1] + new_tokens)
    kwargs = {"input_ids": prompt, "use_cache": False}
    t0 = time.perf_counter()
    catalog = toc.save_streamed_package(
        model, (), work / "model.pt2", kwargs, weights=work / "model.safetensors",
        dynamic_shapes={"input_ids": {1: seq}, "use_cache": None},
    )  # fmt: skip
    package = (work / "model.pt2").stat().st_size
    print(
        f"\nAOTInductor package: {size(package)} holding no weight bytes ({len(catalog.probes)} "
        f"probes), weights {size(catalog.nbytes)} in model.safetensors; built in "
        f"{time.perf_counter() - t0:.0f} s"
    )
    results = []
    for name, b in (("aoti streamed", budget), ("aoti all kept", catalog.nbytes + (64 << 20))):
        program = toc.load_streamed_package(work / "model.pt2", work / "model.safetensors",
                                            device, budget_bytes=b)  # fmt: skip
        ids = prompt
        with torch.inference_mode():
            program(input_ids=ids, use_cache=False)  # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                logits = program(input_ids=ids, use_cache=False).logits
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
            ids.cpu()
        seconds = time.perf_counter() - t0
        st = program.handle.stats()
        print(f"  {name:<14} budget {size(b)}: {seconds / new_tokens * 1e3:.1f} ms/token, "
              f"{st.units} units, {st.kept_units} kept")  # fmt: skip
        results.append(ids)
        program.remove()
    print(f"AOTI streamed tokens identical to the same package all kept: "
          f"{torch.equal(results[0], results[1])}")  # fmt: skip


if __name__ == "__main__":
    main()
