"""Greedy decode of a Llama-shaped model (random weights, built from a config, no download)
with its weights resident, streamed eagerly, streamed under torch.compile and streamed in a
CUDA graph (`WeightStreamHandle.cuda_graph`).

    python benchmarks/decode.py --shape 8b      # hidden 4096, 32 layers, GQA 8, vocab 128256
    python benchmarks/decode.py --shape demo    # hidden 1024, 8 layers
    python benchmarks/decode.py --shape tiny    # a smoke run (CPU or GPU)

A static KV cache (transformers' StaticCache), a ``--prompt``-token prefill, then
``--tokens`` decode steps of one token, each step's token fed to the next on the device (no
host sync inside the loop). Each row decodes twice (warm-up, timed) from the same prompt and
must produce the tokens of the eager resident row; the decode steps are timed, not the
prefill. Columns: ms per decoded token, weight bytes
copied to the device per token and their GB/s, the bound ``max(t_resident_graph,
bytes / bw)`` (the fastest resident row that replays a graph, and the pinned host-to-device
bandwidth measured in this run) over the time, peak device memory, and the host time per
token (median seconds a step's call takes on the host, measured in a third decode that
synchronizes the device before each step, so that no call waits for a full launch queue).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.weights import h2d_bandwidth  # noqa: E402
from torchoffload import minimum_budget, stream_weights  # noqa: E402

GIB = 1 << 30
SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, vocab, budgets (GiB)
    "8b": (4096, 14336, 32, 32, 8, 128256, [4, 12]),
    "demo": (1024, 2816, 8, 16, 4, 32000, [0.2, 0.3]),
    "tiny": (256, 512, 4, 4, 2, 2048, [0.004, 0.008]),
}


def build(shape: str, device: torch.device):
    import transformers

    hidden, inter, layers, heads, kv, vocab, _ = SHAPES[shape]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=4096,
    )  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(dtype).eval()


class Decoder:
    """Prefill and one-token steps over a static cache; ``wrap(step)`` makes the step that
    runs (eager, compiled, graphed)."""

    def __init__(self, model, prompt: torch.Tensor, tokens: int, wrap=None, step_model=None):
        from transformers import StaticCache

        self.model = model  # runs the prefill
        self.step_model = step_model if step_model is not None else model
        self.prompt = prompt
        self.tokens = tokens
        self.cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + tokens)
        self.step = self._step if wrap is None else wrap(self._step)

    def _step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.step_model(input_ids=ids, position_ids=pos.unsqueeze(0), cache_position=pos,
                              past_key_values=self.cache, use_cache=True)  # fmt: skip
        return out.logits[:, -1]

    def run(self, host_times: list[float] | None = None, after_prefill=None) -> torch.Tensor:
        """Decode; ``host_times``: the device is synchronized before each step and the
        seconds the step's call takes are appended (its host cost, with an idle device)."""
        dev = self.prompt.device
        n = self.prompt.shape[1]
        with torch.inference_mode():
            self.cache.reset()
            out = self.model(input_ids=self.prompt, cache_position=torch.arange(n, device=dev),
                             past_key_values=self.cache, use_cache=True)  # fmt: skip
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            toks = [tok]
            positions = torch.arange(n, n + self.tokens, device=dev)
            if after_prefill is not None:
                after_prefill()
            for i in range(self.tokens - 1):
                if host_times is not None:
                    sync(dev)
                t0 = time.perf_counter()
                tok = self.step(tok, positions[i : i + 1]).argmax(-1, keepdim=True)
                if host_times is not None:
                    host_times.append(time.perf_counter() - t0)
                toks.append(tok)
        return torch.cat(toks, 1)


def plain_graph(step):
    """A resident step captured as a CUDA graph (first call warm-up, then capture, replay)."""
    state: dict = {}

    def run(ids, pos):
        if "warm" not in state:
            state["warm"] = True
            return step(ids, pos)
        if "graph" not in state:
            state["ids"], state["pos"] = ids.clone(), pos.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                state["out"] = step(state["ids"], state["pos"])
            state["graph"] = graph
        state["ids"].copy_(ids)
        state["pos"].copy_(pos)
        state["graph"].replay()
        return state["out"]

    return run


def timed(decoder: Decoder, device: torch.device, expected, stats=None):
    """(ms/token, host ms/token, tokens equal, bytes/token, tokens): a warm-up decode (its
    seconds in ``decoder.warmup_s``), a timed one."""
    t0 = time.perf_counter()
    decoder.run()
    sync(device)
    decoder.warmup_s = time.perf_counter() - t0
    start: list = []

    def after_prefill():  # the decode steps are timed, not the prefill
        sync(device)
        start.append((time.perf_counter(), stats().h2d_bytes if stats is not None else 0))

    toks = decoder.run(None, after_prefill)
    sync(device)
    seconds = time.perf_counter() - start[0][0]
    per_token = stats().h2d_bytes - start[0][1] if stats is not None else 0
    steps = decoder.tokens - 1
    host: list[float] = []
    decoder.run(host)  # a third decode: each step's host time, the device idle before it
    equal = expected is None or torch.equal(toks, expected)
    if not equal:  # where the tokens part: one differing logit (a tie, a rounding) changes all
        first = int((toks != expected).nonzero()[0, 1])
        print(f"    tokens differ from position {first} of {toks.shape[1]}", flush=True)
    return (seconds * 1e3 / steps, statistics.median(host) * 1e3, equal, per_token / steps, toks)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--budgets", type=float, nargs="*", help="GiB (default: the shape's)")
    p.add_argument(
        "--rows",
        default="eager,graph,compile-ro,stream,stream-compile,stream-graph,stream-compile-graph",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--unit", default=None, help="stream_weights(unit=): blocks, leaves")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms and math attention (as the GPU parity tests): "
                   "tokens comparable over long decodes, kernels slower")  # fmt: skip
    args = p.parse_args(argv)
    # Without it, even the resident CUDA graph departs from eager resident after a few hundred
    # tokens (benchmarks/log/2026-11-24-primed-replays.md, "Tokens over long decodes").
    if args.deterministic:
        import contextlib
        import os

        from torch.nn.attention import SDPBackend, sdpa_kernel

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        stack = contextlib.ExitStack()
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    rows_wanted = set(args.rows.split(","))
    # a streamed unit is a graph break, and the frames resumed after one are specialized on
    # Hugging Face's layer index: one compilation per layer (32 at the 8B shape)
    torch._dynamo.config.recompile_limit = 256
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    model = build(args.shape, device)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, vocab, (1, args.prompt), generator=g).to(device)
    bw = h2d_bandwidth(device)
    budgets = args.budgets or SHAPES[args.shape][-1]
    print(
        f"# {datetime.date.today()} {torch.cuda.get_device_name(device) if gpu else 'cpu'} "
        f"torch {torch.__version__}; {args.shape}: {weights / GIB:.2f} GiB of weights, prompt "
        f"{args.prompt}, {args.tokens} tokens; pinned H2D {bw:.1f} GB/s; "
        f"units {args.unit or 'auto'}",
        flush=True,
    )
    rows: list[dict] = []

    def add(name, budget, result, peak, note=""):
        ms, host_ms, equal, moved, _ = result
        rows.append(dict(row=name, budget_gib=budget, ms_per_token=ms, host_ms=host_ms,
                         equal=equal, bytes_per_token=moved, peak_gib=peak, note=note))  # fmt: skip
        print(f"  {name:<22} {budget!s:>6}  {ms:8.2f} ms/token  host {host_ms:6.2f} ms  "
              f"{moved / 2**20:9.1f} MiB/token  peak {peak:6.2f} GiB  equal {equal}",
              flush=True)  # fmt: skip

    def peak_reset():
        sync(device)
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    def peak():
        return torch.cuda.max_memory_allocated(device) / GIB if gpu else float("nan")

    def attempt(name, budget, fn):
        try:
            fn()
        except Exception as e:  # a row that fails is reported, the others still run
            traceback.print_exc()
            rows.append(dict(row=name, budget_gib=budget, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"  {name:<22} {budget!s:>6}  FAILED: {rows[-1]['error']}", flush=True)

    # - Resident rows
    peak_reset()
    result = timed(Decoder(model, prompt, args.tokens), device, None)
    expected = result[-1]
    add("eager resident", "-", result, peak())
    if gpu and "graph" in rows_wanted:

        def graph_row():
            peak_reset()
            add("graph resident", "-", timed(Decoder(model, prompt, args.tokens, plain_graph),
                                             device, expected), peak())  # fmt: skip

        attempt("graph resident", "-", graph_row)
    if gpu and "compile-ro" in rows_wanted:

        def compile_row():
            peak_reset()
            compiled = torch.compile(model, mode="reduce-overhead")

            def marked(step):  # a new cudagraph-trees step per token (the cache is mutated)
                def run(ids, pos):
                    torch.compiler.cudagraph_mark_step_begin()
                    return step(ids, pos).clone()

                return run

            dec = Decoder(model, prompt, args.tokens, marked, step_model=compiled)
            result = timed(dec, device, expected)
            add("compiled resident r-o", "-", result, peak(), f"warm-up {dec.warmup_s:.0f} s")
            torch._dynamo.reset()

        attempt("compiled resident r-o", "-", compile_row)

    # - Streamed rows, per budget (the model's weights move to the host store and back)
    for budget_gib in budgets:
        budget = int(budget_gib * GIB)
        least = minimum_budget(model, resident=("embed_tokens",))
        if budget < least:
            print(f"  budget {budget_gib} GiB is below the minimum {least / GIB:.2f} GiB: skipped")
            continue
        peak_reset()
        h = stream_weights(
            model, device, budget_bytes=budget, resident=("embed_tokens",), unit=args.unit
        )
        try:
            if "stream" in rows_wanted:
                peak_reset()
                add("eager streamed", budget_gib,
                    timed(Decoder(model, prompt, args.tokens), device, expected, h.stats),
                    peak())  # fmt: skip
            if "stream-graph" in rows_wanted:

                def graph_streamed(h=h, budget_gib=budget_gib):
                    peak_reset()
                    dec = Decoder(model, prompt, args.tokens, h.cuda_graph)
                    add("graph streamed", budget_gib, timed(dec, device, expected, h.stats),
                        peak())  # fmt: skip
                    print(f"    {dec.step.stats()}", flush=True)

                attempt("graph streamed", budget_gib, graph_streamed)
            if "stream-graph-unprimed" in rows_wanted:

                def graph_unprimed(h=h, budget_gib=budget_gib):
                    peak_reset()  # Note: [Primed replays] turned off, for comparison

                    def wrap(step):
                        return h.cuda_graph(step, prime=False)

                    dec = Decoder(model, prompt, args.tokens, wrap)
                    add("graph streamed unprimed", budget_gib,
                        timed(dec, device, expected, h.stats), peak())  # fmt: skip

                attempt("graph streamed unprimed", budget_gib, graph_unprimed)
            if "stream-compile" in rows_wanted and gpu:

                def compile_streamed(h=h, budget_gib=budget_gib):
                    peak_reset()
                    compiled = torch.compile(model)
                    dec = Decoder(model, prompt, args.tokens, step_model=compiled)
                    add("compiled streamed", budget_gib, timed(dec, device, expected, h.stats),
                        peak())  # fmt: skip
                    torch._dynamo.reset()

                attempt("compiled streamed", budget_gib, compile_streamed)
            if "stream-compile-graph" in rows_wanted and gpu:

                def compile_graph_streamed(h=h, budget_gib=budget_gib):
                    peak_reset()  # Inductor's kernels and the weight copies in one CUDA graph
                    compiled = torch.compile(model)
                    dec = Decoder(model, prompt, args.tokens, h.cuda_graph, step_model=compiled)
                    add("compiled graph streamed", budget_gib,
                        timed(dec, device, expected, h.stats), peak())  # fmt: skip
                    print(f"    {dec.step.stats()}", flush=True)
                    torch._dynamo.reset()

                attempt("compiled graph streamed", budget_gib, compile_graph_streamed)
            st = h.stats()
            print(f"    stats: kept {st.kept_units}/{st.units} units, arena "
                  f"{st.arena_bytes / GIB:.2f} GiB, resident {st.resident_bytes / GIB:.2f} GiB, "
                  f"hits {st.hits} misses {st.misses}", flush=True)  # fmt: skip
        finally:
            h.remove()

    # - Table
    graphed = [
        r["ms_per_token"]
        for r in rows
        if "error" not in r and r["row"] in ("graph resident", "compiled resident r-o")
    ]
    t_res = min(graphed) if graphed else rows[0]["ms_per_token"]
    how = "in a graph" if graphed else "eagerly (no graph row ran)"
    print(f"\nbound = max({t_res:.2f} ms resident {how}, bytes / {bw:.1f} GB/s)")
    print(
        "| row | budget GiB | ms/token | MiB/token | GB/s | bound ms | bound/time | peak GiB "
        "| host ms/token | tokens equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['row']} | {r['budget_gib']} | failed: {r['error'][:80]} |||||||")
            continue
        moved = r["bytes_per_token"]
        bound = max(t_res, moved / bw / 1e6) if gpu else float("nan")
        gbs = moved / r["ms_per_token"] / 1e6
        r["bound_ms"] = bound
        print(f"| {r['row']} | {r['budget_gib']} | {r['ms_per_token']:.2f} | "
              f"{moved / 2**20:.1f} | {gbs:.1f} | {bound:.2f} | {bound / r['ms_per_token']:.3f} "
              f"| {r['peak_gib']:.2f} | {r['host_ms']:.2f} | {r['equal']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(shape=args.shape, bw=bw, rows=rows), indent=1))
    # compiled rows differ from eager ones as compiled kernels do: only the others must match
    return 0 if all(r.get("equal", True) for r in rows if "compiled" not in r["row"]) else 1


if __name__ == "__main__":
    sys.exit(main())
