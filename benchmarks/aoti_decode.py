"""Greedy decode of a Llama-shaped model compiled with AOTInductor into a package that holds no
weights (`torchoffload.compile.save_streamed_package`), its weights streamed from a safetensors
file through a device arena (`load_streamed_package`).

    python benchmarks/aoti_decode.py --shape demo   # hidden 1024, 8 layers
    python benchmarks/aoti_decode.py --shape 8b     # hidden 4096, 32 layers, GQA 8, vocab 128256
    python benchmarks/aoti_decode.py --shape tiny   # a smoke run (CPU or GPU)
    python benchmarks/aoti_decode.py --shape tiny --layers 2  # the test's: a quicker compile

The model is this file's `Decoder` (random weights, Hugging Face Llama's names and shapes): one
program for the prefill and the one-token steps (the sequence length is dynamic), its KV cache
two input tensors written in place. Rows: ``aoti resident`` is the same package with a budget
that keeps every unit in the arena (no copy after the first call): the compiled program's own
speed, which is the bound's compute term; ``aoti streamed`` at each budget, the embedding
table resident (``--resident``) as in benchmarks/decode.py. With ``--graph``, ``graph
resident`` and ``graph streamed`` are the same, replayed by ``program.handle.cuda_graph``; their
bound's compute term is ``graph resident``'s time. Each row decodes once to warm up, then
``--repeat`` times timed (the median is reported); its tokens, and the KV caches it wrote,
must equal the resident row's. Columns as
benchmarks/decode.py: ms per decoded token, weight bytes copied per token and their GB/s, the
bound ``max(t_resident, bytes / bw)`` over the time (bw: pinned host-to-device bandwidth
measured in this run), peak device memory, host ms per step. Under a row (GPU): each timed
step's device time (CUDA events recorded after consecutive launches); for the graph rows the
graphs' captures, replays and primed units and the copies per token; with ``--profile`` the
copy stream's timeline, with where in its call each gap falls.

With ``--compiled``, the same rows for `torchoffload.compile.compile_streamed`: the model
exported with its weight probes and compiled by ``torch.compile`` (Inductor, default mode) into
one graph, no package, its weights read from the same safetensors file into pinned memory
(the model rebuilt on ``meta``): ``compiled resident`` (every unit kept: its compute term),
``compiled streamed`` at each budget, and with ``--graph`` ``compiled graph resident`` and
``compiled graph streamed``, the same programs replayed by ``program.handle.cuda_graph``
(each after its eager row, on the same program: its ``load`` column is 0). A line after the
rows says whether the compiled program's tokens equal the package's (they may differ as
kernels compiled differently do; each kind's rows must equal its own resident row).
``--no-aoti`` leaves out the package and its rows (the weights file is still written).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode import SHAPES, sync  # noqa: E402
from benchmarks.weights import h2d_bandwidth  # noqa: E402
from torchoffload.compile import (  # noqa: E402
    compile_streamed,
    load_streamed_package,
    save_streamed_package,
)
from torchoffload.weights._checkpoint import write_safetensors  # noqa: E402

GIB = 1 << 30


class RMSNorm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * self.weight


class Layer(nn.Module):
    def __init__(self, hidden, inter, heads, kv_heads):
        super().__init__()
        hd = hidden // heads
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hd
        self.input_layernorm = RMSNorm(hidden)
        self.post_attention_layernorm = RMSNorm(hidden)
        attn = nn.Module()
        attn.q_proj = nn.Linear(hidden, heads * hd, bias=False)
        attn.k_proj = nn.Linear(hidden, kv_heads * hd, bias=False)
        attn.v_proj = nn.Linear(hidden, kv_heads * hd, bias=False)
        attn.o_proj = nn.Linear(heads * hd, hidden, bias=False)
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(hidden, inter, bias=False)
        mlp.up_proj = nn.Linear(hidden, inter, bias=False)
        mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        self.self_attn, self.mlp = attn, mlp

    def forward(self, x, cos, sin, pos, k_cache, v_cache, mask):
        b, t, _ = x.shape
        a = self.self_attn
        h = self.input_layernorm(x)
        q = a.q_proj(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = a.k_proj(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = a.v_proj(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        rep = self.heads // self.kv_heads
        keys = k_cache.repeat_interleave(rep, 1)
        values = v_cache.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Decoder(nn.Module):
    """A Llama decoder over a static KV cache passed in as two tensors
    ``[layers, batch, kv_heads, max_len, head_dim]`` written in place at ``pos``."""

    def __init__(self, hidden, inter, layers, heads, kv_heads, vocab):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(
            Layer(hidden, inter, heads, kv_heads) for _ in range(layers)
        )
        self.model.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        hd = hidden // heads
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("inv_freq", inv, persistent=False)  # kept in the program

    def forward(self, ids, pos, k_cache, v_cache):
        x = self.model.embed_tokens(ids)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        max_len = k_cache.shape[3]
        mask = torch.arange(max_len, device=ids.device)[None, :] <= pos[:, None]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, pos, k_cache[i], v_cache[i], mask)
        return self.lm_head(self.model.norm(x[:, -1:]))[:, -1].float()


def decode(program, prompt, tokens, caches, host_times=None, after_prefill=None, events=None):
    """Greedy decode of ``tokens`` tokens after ``prompt``; ``events`` (GPU): a list that
    gets a timing event recorded after the prefill and after each step's launch."""
    dev = prompt.device
    n = prompt.shape[1]
    for c in caches:
        c.zero_()
    tok = program(prompt, torch.arange(n, device=dev), *caches).argmax(-1, keepdim=True)
    toks = [tok]
    # one tensor each (a slice of one arange is not 16-byte aligned: AOTInductor copies it, and
    # warns, at every call)
    positions = [torch.full((1,), n + i, device=dev) for i in range(tokens)]
    if after_prefill is not None:
        after_prefill()
    if events is not None:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
    for i in range(tokens - 1):
        if host_times is not None:
            sync(dev)
        t0 = time.perf_counter()
        tok = program(tok, positions[i], *caches).argmax(-1, keepdim=True)
        if host_times is not None:
            host_times.append(time.perf_counter() - t0)
        if events is not None:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        toks.append(tok)
    return torch.cat(toks, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--budgets", type=float, nargs="*", help="GiB (default: the shape's)")
    p.add_argument(
        "--resident",
        default="embed_tokens",
        help="name patterns kept on the device in the streamed rows (comma-separated)",
    )
    p.add_argument(
        "--graph",
        action="store_true",
        help="also replay the streamed package as CUDA graphs (program.handle.cuda_graph), "
        "at each budget: the KV caches, written in place, are held by the graph",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="also time a plain AOTInductor package of the model (weights embedded, no "
        "probes): the compiled program without torchoffload",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one more decode of each streamed row (GPU): the copy stream's busy "
        "fraction, bandwidth while copying and gaps (benchmarks/profile_decode.py)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed decodes per row: ms/token is their median (the range is printed)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="also time compile_streamed (one torch.compile graph, weights probed), resident "
        "and at each budget (replayed too with --graph)",
    )
    p.add_argument(
        "--no-aoti",
        action="store_true",
        help="leave out the AOTInductor package and its rows (with --compiled)",
    )
    p.add_argument("--dir", type=Path, default=None, help="where the package goes (temp)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    if args.no_aoti and not args.compiled:
        p.error("--no-aoti leaves no rows without --compiled")
    if args.no_aoti and args.plain:
        p.error("--plain is compared with the package's rows: leave out --no-aoti")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    hidden, inter, layers, heads, kv, vocab, default_budgets = SHAPES[args.shape]
    layers = args.layers or layers
    shape = args.shape if args.layers is None else f"{args.shape} at {layers} layers"
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(hidden, inter, layers, heads, kv, vocab).to(dtype).eval()
    for prm in model.parameters():
        prm.data.normal_(0, 0.02)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    max_len = args.prompt + args.tokens
    caches = [torch.zeros(layers, 1, kv, max_len, hidden // heads, dtype=dtype, device=device)
              for _ in range(2)]  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, vocab, (1, args.prompt), generator=g).to(device)
    work = Path(args.dir or tempfile.mkdtemp(prefix="aoti_decode_"))
    work.mkdir(parents=True, exist_ok=True)
    seq = torch.export.Dim("seq", min=1, max=max_len)
    example = (prompt, torch.arange(args.prompt, device=device), *caches)
    dynamic = ({1: seq}, {0: seq}, None, None)
    t0 = time.perf_counter()
    if args.no_aoti:
        write_safetensors(work / "decoder.safetensors", model.state_dict())
    else:
        catalog = save_streamed_package(model, example, work / "decoder.pt2",
                                        weights=work / "decoder.safetensors",
                                        dynamic_shapes=dynamic)  # fmt: skip
    save_s = time.perf_counter() - t0
    if args.plain:
        ep = torch.export.export(
            model, (prompt, torch.arange(args.prompt, device=device), *caches),
            dynamic_shapes=({1: seq}, {0: seq}, None, None),
        )  # fmt: skip
        torch._inductor.aoti_compile_and_package(ep, package_path=str(work / "plain.pt2"))
        ep = None
    inv_freq = model.inv_freq  # in the model's dtype, as the package has it
    model = None
    if args.compiled:  # the compiled rows read the weights file: the model only gives the graph
        with torch.device("meta"):
            model = Decoder(hidden, inter, layers, heads, kv, vocab).to(dtype).eval()
        # a non-persistent buffer is not in the weights file: the program keeps the model's
        model.inv_freq = inv_freq
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    bw = h2d_bandwidth(device)
    if args.no_aoti:
        saved = f"no package; weights file written in {save_s:.0f} s"
    else:
        pt2 = (work / "decoder.pt2").stat().st_size
        saved = (f"{len(catalog.probes)} probes; package {pt2 / 2**20:.1f} MiB "
                 f"({pt2 / weights:.4%} of the weights), saved in {save_s:.0f} s")  # fmt: skip
    print(
        f"# {datetime.date.today()} {torch.cuda.get_device_name(device) if gpu else 'cpu'} "
        f"torch {torch.__version__}; {shape}: {weights / GIB:.2f} GiB of weights, "
        f"{saved}; prompt {args.prompt}, {args.tokens} tokens; pinned H2D {bw:.1f} GB/s",
        flush=True,
    )
    rows = []
    # each kind's resident row's tokens and caches, which its other rows must equal (Inductor
    # may compile the package and the torch.compile program into different kernels)
    expected: dict[str, tuple] = {}
    # the all-kept row's time per kind of program (package or compiled), eager and replayed
    t_resident: dict[tuple[str, bool], float] = {}
    steps = args.tokens - 1
    budgets = args.budgets or default_budgets
    runs = []  # (row, budget GiB or None for every unit kept, program kind, replayed)
    kinds = ([] if args.no_aoti else ["aoti"]) + (["compiled"] if args.compiled else [])
    prefix = {("aoti", False): "aoti", ("aoti", True): "graph",
              ("compiled", False): "compiled", ("compiled", True): "compiled graph"}  # fmt: skip
    for kind in kinds:
        for b in [None, *budgets]:
            # the graph rows' compute term is the same program replayed with every unit kept
            for graphed in (False, True) if args.graph else (False,):
                name = prefix[kind, graphed] + (" resident" if b is None else " streamed")
                runs.append((name, b, kind, graphed))  # fmt: skip
    compiled: dict = {}  # budget -> the compiled program, shared by its eager and graph rows
    for name, budget_gib, kind, graphed in runs:
        budget = int(budget_gib * GIB) if budget_gib is not None else weights + (64 << 20)
        resident = tuple(filter(None, args.resident.split(","))) if budget_gib else ()
        t0 = time.perf_counter()
        if kind == "aoti":
            program = load_streamed_package(work / "decoder.pt2", work / "decoder.safetensors",
                                            device, budget_bytes=budget,
                                            resident=resident)  # fmt: skip
        elif budget_gib in compiled:
            program = compiled.pop(budget_gib)
        else:  # export, compile (Inductor's cache serves the later budgets) and load
            program = compile_streamed(model, example, budget_bytes=budget, device=device,
                                       resident=resident, dynamic_shapes=dynamic,
                                       checkpoint=work / "decoder.safetensors")  # fmt: skip
            if args.graph:
                compiled[budget_gib] = program  # its graph row comes next
        load_s = time.perf_counter() - t0
        # Note: [Arguments written in place]: the caches are the same tensors every call
        run = program.handle.cuda_graph(program) if graphed else program
        with torch.inference_mode():
            decode(run, prompt, args.tokens, caches)  # warm-up (and the graphs' captures)
            sync(device)
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
            timed = []  # (seconds, bytes, copies) of each timed decode's steps
            all_toks = []
            step_ms = []  # each timed step's device time (between the events of its neighbours)
            for _ in range(args.repeat):
                events = [] if gpu else None
                start = []

                def after_prefill(start=start, program=program):
                    sync(device)
                    st = program.handle.stats()
                    start.append((time.perf_counter(), st.h2d_bytes, st.h2d_copies))

                toks = decode(run, prompt, args.tokens, caches, after_prefill=after_prefill,
                              events=events)  # fmt: skip
                all_toks.append(toks)
                sync(device)
                events = events or []
                step_ms += [a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)]
                st = program.handle.stats()
                timed.append((time.perf_counter() - start[0][0], st.h2d_bytes - start[0][1],
                              st.h2d_copies - start[0][2]))  # fmt: skip
            seconds = statistics.median(t for t, _, _ in timed)
            final = [c.clone() for c in caches]  # what the decode wrote: compared too
            moved = statistics.median(b for _, b, _ in timed) / steps
            copies = statistics.median(c for _, _, c in timed) / steps
            host: list[float] = []
            decode(run, prompt, args.tokens, caches, host)
            if args.profile and gpu and budget_gib is not None:
                profiled = profile_copies(run, program, prompt, args.tokens, caches)
        ms = seconds * 1e3 / steps
        runs_ms = sorted(t * 1e3 / steps for t, _, _ in timed)
        if kind not in expected:
            expected[kind] = toks, final
        want, want_caches = expected[kind]
        if budget_gib is None:
            t_resident[kind, graphed] = ms
        bound = max(t_resident[kind, graphed], moved / (bw * 1e9) * 1e3) if gpu else math.nan
        peak = torch.cuda.max_memory_allocated(device) / GIB if gpu else math.nan
        row = dict(row=name, budget_gib=budget_gib, ms_per_token=ms, bytes_per_token=moved,
                   gbps=moved / seconds * steps / 1e9, bound_ms=bound, ratio=bound / ms,
                   peak_gib=peak, host_ms=statistics.median(host) * 1e3,
                   equal=all(torch.equal(t, want) for t in all_toks) and all(
                       torch.equal(c, e) for c, e in zip(final, want_caches, strict=True)
                   ), load_s=load_s, runs_ms=runs_ms, step_ms=step_ms, copies_per_token=copies,
                   graph=graph_stats(run) if graphed else None)  # fmt: skip
        rows.append(row)
        print(f"  {name:<23} {budget_gib!s:>6}  {ms:8.2f} ms/token  "
              f"{moved / 2**20:9.1f} MiB/token  {row['gbps']:5.1f} GB/s  bound {bound:8.2f} ms "
              f"({row['ratio']:.3f})  peak {peak:6.2f} GiB  host {row['host_ms']:6.2f} ms  "
              f"equal {row['equal']}  load {load_s:.1f} s"
              + (f"  runs {runs_ms[0]:.2f}-{runs_ms[-1]:.2f} ms" if len(runs_ms) > 1 else ""),
              flush=True)  # fmt: skip
        if len(step_ms) > 1:
            q = statistics.quantiles(step_ms, n=10)
            print(f"      steps (device time): min {min(step_ms):.2f} ms, 10% {q[0]:.2f}, median "
                  f"{statistics.median(step_ms):.2f}, 90% {q[-1]:.2f}, max {max(step_ms):.2f}",
                  flush=True)  # fmt: skip
        if graphed:
            print(f"      graphs: {row['graph']}; copies per token {copies:.0f}", flush=True)
        if args.profile and gpu and budget_gib is not None:
            print("\n".join(f"      {line}" for line in profiled), flush=True)
        if budget_gib not in compiled or kind == "aoti":
            program.remove()
        del program, run
        gc.collect()
    ok = all(r["equal"] for r in rows)
    if len(expected) == 2:  # the two kinds of program: informative, not required to match
        same = torch.equal(expected["aoti"][0], expected["compiled"][0])
        print(f"  compiled resident tokens equal the package's: {same}", flush=True)
    if args.plain:
        rows.append(plain_row(work / "plain.pt2", prompt, args.tokens, caches,
                              expected["aoti"][0], device, args.repeat))  # fmt: skip
        r = rows[-1]
        print(f"  {'aoti plain':<23} {'None':>6}  {r['ms_per_token']:8.2f} ms/token  "
              f"{0.0:9.1f} MiB/token  {0.0:5.1f} GB/s  {'':23}  peak {r['peak_gib']:6.2f} GiB  "
              f"host {r['host_ms']:6.2f} ms  same tokens {r['equal']}  load "
              f"{r['load_s']:.1f} s"
              + (f"  runs {r['runs_ms'][0]:.2f}-{r['runs_ms'][-1]:.2f} ms" if args.repeat > 1
                 else ""), flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(shape=args.shape, bw=bw, rows=rows), indent=1))
    return 0 if ok else 1


def profile_copies(run, program, prompt, tokens, caches) -> list[str]:
    """One decode under torch.profiler: the copy stream's timeline (`copy_timeline`)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.profile_decode import copy_timeline

    sync(prompt.device)
    before = program.handle.stats()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode(run, prompt, tokens, caches)
        sync(prompt.device)
    after = program.handle.stats()
    copies = after.h2d_copies - before.h2d_copies
    per_call = copies // tokens if copies % tokens == 0 else None  # the prefill and the steps
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return copy_timeline(events, after.h2d_bytes - before.h2d_bytes, per_call)


def graph_stats(run) -> dict:
    """What a `StreamedGraph` did: captures, replays, primed units per graph."""
    s = run.stats()
    return dict(captures=s.captures, replays=s.replays, eager_calls=s.eager_calls,
                primed_units=list(s.primed_units), prime_loads=s.prime_loads)  # fmt: skip


def plain_row(path, prompt, tokens, caches, expected, device, repeat=1) -> dict:
    """A plain AOTInductor package (weights embedded, no probes), timed as the other rows. Its
    tokens may differ from the streamed package's in low precision: its compiler may fuse
    across what are probes in the other (Note: [Ordering weights in a compiled program])."""
    gpu = device.type == "cuda"
    t0 = time.perf_counter()
    program = torch._inductor.aoti_load_package(str(path))
    load_s = time.perf_counter() - t0
    steps = tokens - 1
    with torch.inference_mode():
        decode(program, prompt, tokens, caches)  # warm-up
        sync(device)
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        timed, equal = [], True
        for _ in range(repeat):
            start: list[float] = []

            def after_prefill(start=start):
                sync(device)
                start.append(time.perf_counter())

            toks = decode(program, prompt, tokens, caches, after_prefill=after_prefill)
            sync(device)
            timed.append((time.perf_counter() - start[0]) * 1e3 / steps)
            equal = equal and torch.equal(toks, expected)
        host: list[float] = []
        decode(program, prompt, tokens, caches, host)
    return dict(row="aoti plain", budget_gib=None, ms_per_token=statistics.median(timed),
                bytes_per_token=0.0, gbps=0.0, bound_ms=math.nan, ratio=math.nan,
                peak_gib=torch.cuda.max_memory_allocated(device) / GIB if gpu else math.nan,
                host_ms=statistics.median(host) * 1e3, equal=equal, load_s=load_s,
                runs_ms=sorted(timed))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
