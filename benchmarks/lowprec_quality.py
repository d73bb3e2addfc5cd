"""Quality of low-precision host state: a small GPT (`torchoffload.models.GPT`, bf16) trained a
few hundred steps on a fixed synthetic corpus by `OffloadedOptimizer`, once per way of keeping
the training state on the host, against fp32 masters and fp32 AdamW moments.

    python benchmarks/lowprec_quality.py                  # CPU, a few minutes
    python benchmarks/lowprec_quality.py --device cuda --hidden 512 --layers 8 --steps 2000

The corpus is a fixed random trigram language over ``--vocab`` tokens: each pair of previous
tokens allows ``--branch`` next tokens with fixed random probabilities (seeded), so a model
that learns it reaches the corpus's conditional entropy (printed as ``floor``), well below
the unigram entropy that a model ignoring context reaches. Every row starts from the same
weights and sees the same batches; the recipe is AdamW (betas 0.9/0.95, weight decay 0.1),
linear warm-up then cosine decay to 10% of ``--lr``, gradients clipped to norm 1. Rows:

- ``fp32``: fp32 masters, `torch.optim.AdamW` (fp32 moments): the reference, 16 bytes a
  parameter on the host. ``fp32-seed1``: the same with other weights and batches (seed 1): the
  run-to-run spread a gap should be compared with.
- ``8bit``: fp32 masters, `AdamW8bit` (10.03 bytes).
- ``bf16-sr``: bf16 masters (``master_dtype=torch.bfloat16``) with stochastic rounding,
  `LowPrecisionAdamW` fp32 moments (12 bytes); ``bf16-sr-8bit``: with `AdamW8bit` (6.03);
  ``bf16-kahan-8bit``: a Kahan compensation term instead (8.03); ``bf16-nearest-8bit``:
  round-to-nearest, which loses the updates below half a bf16 step (6.03): for comparison.

Printed: the held-out loss (nats a token) at checkpoints, the final training loss (mean of the
last 10% of steps), the final held-out gap to ``fp32``, host bytes a parameter and the median
host step (ms). ``--json`` writes the raw curves. Bytes a parameter are without the copies
aside that ``overlap`` may keep (`host_bytes_per_param(overlap=False)`).

``--speed-params N`` instead times one host step of each way over N parameters (bf16, in
tensors of 64 M elements, random gradients), on this host's threads: ns a parameter (median of
``--speed-steps``) and what a step of the Llama-3.1-8B shape's 8.03 B parameters would take at
that rate. The 8-bit and bf16 steps are eager PyTorch ops over chunks of 1 M elements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import torchoffload as to
from torchoffload.models import GPT, GPTConfig
from torchoffload.optim import (
    AdamW8bit,
    LowPrecisionAdamW,
    host_bytes_per_param,
    measure_host_step,
)

BF16 = torch.bfloat16
ROWS = {  # name: (optimizer class, master dtype, class options, seed)
    "fp32": (torch.optim.AdamW, torch.float32, {}, 0),
    "fp32-seed1": (torch.optim.AdamW, torch.float32, {}, 1),
    "8bit": (AdamW8bit, torch.float32, {}, 0),
    "bf16-sr": (LowPrecisionAdamW, BF16, {}, 0),
    "bf16-sr-8bit": (AdamW8bit, BF16, {}, 0),
    "bf16-kahan-8bit": (AdamW8bit, BF16, {"bf16_rounding": "kahan"}, 0),
    "bf16-nearest-8bit": (AdamW8bit, BF16, {"bf16_rounding": "nearest"}, 0),
}


def corpus(vocab: int, context: int, branch: int, tokens: int, seed: int):
    """``tokens`` tokens of a random n-gram language (each run of ``context`` tokens allows
    ``branch`` next ones, with Dirichlet(1) probabilities), and its conditional entropy."""
    g = torch.Generator().manual_seed(seed)
    contexts = vocab**context
    successors = torch.randint(0, vocab, (contexts, branch), generator=g)
    weights = -torch.rand(contexts, branch, generator=g).log()  # Exp(1): Dirichlet(1) after
    probs = weights / weights.sum(1, keepdim=True)
    cum = probs.cumsum(1)
    out = torch.empty(tokens, dtype=torch.long)
    out[:context] = torch.randint(0, vocab, (context,), generator=g)
    u = torch.rand(tokens, generator=g)
    nll = 0.0
    for i in range(context, tokens):  # sequential: a few seconds per million tokens
        ctx = 0
        for t in out[i - context : i].tolist():
            ctx = ctx * vocab + t
        k = min(int(torch.searchsorted(cum[ctx], u[i])), branch - 1)
        out[i] = successors[ctx, k]
        nll -= math.log(float(probs[ctx, k]))
    return out, nll / (tokens - context)


def batches(data: torch.Tensor, n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (n, batch), generator=g)
    return [torch.stack([data[s : s + seq + 1] for s in row.tolist()]) for row in starts]


def schedule(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def run(name: str, args, train: torch.Tensor, held_out: list[torch.Tensor]) -> dict:
    cls, master_dtype, options, seed = ROWS[name]
    torch.manual_seed(seed)
    cfg = GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                    vocab=args.vocab, max_seq=args.seq + 1)  # fmt: skip
    model = GPT(cfg)
    for module in model.modules():  # GPT-2's initialization: N(0, 0.02) weights, zero biases
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    model = model.to(args.device, BF16)
    opt = to.OffloadedOptimizer(
        model.parameters(), cls, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
        max_grad_norm=1.0, model=model, master_dtype=master_dtype, **options,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, args.steps, args.warmup))
    data = batches(train, args.steps, args.batch, args.seq, seed=100 + seed)
    curve, losses, host_ms = {}, [], []

    def evaluate() -> float:
        with torch.no_grad():
            return sum(float(model.loss(b.to(args.device))) for b in held_out) / len(held_out)

    start = time.perf_counter()
    for step in range(args.steps):
        if step % args.every == 0:
            curve[step] = evaluate()
        loss = model.loss(data[step].to(args.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
        host_ms.append(opt.stats().host_step_ms)
    curve[args.steps] = evaluate()
    opt.remove()
    tail = losses[-max(args.steps // 10, 1) :]
    state_bits = 8 if cls is AdamW8bit else 32
    per = host_bytes_per_param(BF16, master_dtype=master_dtype, state_bits=state_bits,
                               overlap=False,
                               **({} if cls is torch.optim.AdamW else options))  # fmt: skip
    return dict(
        curve=curve, train=sum(tail) / len(tail), losses=losses, bytes=per,
        host_ms=sorted(host_ms)[len(host_ms) // 2], seconds=time.perf_counter() - start,
    )  # fmt: skip


SPEED = {  # name: (class, master dtype, class options)
    "fp32 fused AdamW": (torch.optim.AdamW, torch.float32, {"fused": True}),
    "fp32 AdamW (single-tensor)": (torch.optim.AdamW, torch.float32, {"foreach": False}),
    "8bit": (AdamW8bit, torch.float32, {}),
    "bf16-sr": (LowPrecisionAdamW, BF16, {}),
    "bf16-sr-8bit": (AdamW8bit, BF16, {}),
    "bf16-kahan-8bit": (AdamW8bit, BF16, {"bf16_rounding": "kahan"}),
}


def speed(args) -> None:
    """Host step time per parameter of each way, as the host step runs it (the class over the
    host masters: fp32 copies, or the bf16 parameters themselves): `measure_host_step`."""
    tensors = -(-args.speed_params // (64 << 20))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; host step over "
          f"{args.speed_params / 1e9:.2f} B parameters in {tensors} tensors")  # fmt: skip
    print(f"{'way':<38} {'B/param':>7} {'ns/param':>9} {'8.03 B: s/step':>15}")
    ways = [
        (name, way, native)
        for name, way in SPEED.items()
        for native in ((True, False) if issubclass(way[0], LowPrecisionAdamW) else (True,))
    ]
    for name, (cls, master_dtype, options), native in ways:
        # Note: [The native host step]: the C kernel, or per-op PyTorch (the same bits)
        os.environ["TORCHOFFLOAD_NATIVE"] = "1" if native else "0"
        if issubclass(cls, LowPrecisionAdamW):
            name += " (native)" if native else " (per-op)"
        rate = measure_host_step(cls, master_dtype=master_dtype, numel=args.speed_params,
                                 tensors=tensors, steps=args.speed_steps, lr=1e-4,
                                 **options)  # fmt: skip
        ns = 1e9 / rate
        bits = 8 if cls is AdamW8bit else 32
        rounding = {k: v for k, v in options.items() if k == "bf16_rounding"}
        per = host_bytes_per_param(BF16, master_dtype=master_dtype, state_bits=bits,
                                   overlap=False, **rounding)  # fmt: skip
        print(f"{name:<38} {per:>7.2f} {ns:>9.2f} {ns * 8.03:>15.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--context", type=int, default=2, help="tokens a next token depends on")
    p.add_argument("--branch", type=int, default=4, help="next tokens allowed per context")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--every", type=int, default=100, help="held-out loss every this many steps")
    p.add_argument("--tokens", type=int, default=400_000, help="corpus size")
    p.add_argument("--json", default=None)
    p.add_argument("--speed-params", type=int, default=0, help="time the host step instead")
    p.add_argument("--speed-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.speed_params:
        speed(args)
        return
    rows = args.rows.split(",")
    unknown = set(rows) - set(ROWS)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}")
    data, floor = corpus(args.vocab, args.context, args.branch, args.tokens, seed=1234)
    split = int(0.9 * data.numel())
    train, held = data[:split], data[split:]
    held_out = batches(held, 8, args.batch, args.seq, seed=99)
    unigram = torch.bincount(data, minlength=args.vocab).double() / data.numel()
    uniform = -(unigram[unigram > 0] * unigram[unigram > 0].log()).sum()
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads; "
          f"GPT h{args.hidden} L{args.layers} vocab {args.vocab} bf16, batch {args.batch} x "
          f"{args.seq}, {args.steps} steps, lr {args.lr}")  # fmt: skip
    print(f"corpus: {args.tokens} tokens, {args.context + 1}-gram language, {args.branch} "
          f"successors a "
          f"context; floor (conditional entropy) {floor:.3f} nats, unigram entropy "
          f"{float(uniform):.3f}")  # fmt: skip
    results = {}
    for name in rows:
        results[name] = run(name, args, train, held_out)
        print(f"  {name}: {results[name]['seconds']:.0f} s", flush=True)
    ref = results.get("fp32")
    steps = sorted(next(iter(results.values()))["curve"])
    print()
    print("held-out loss (nats a token) by step")
    print(f"{'row':<18} {'B/param':>7} " + " ".join(f"{s:>6}" for s in steps)
          + f" {'train':>7} {'gap':>7} {'host ms':>8}")  # fmt: skip
    for name, r in results.items():
        gap = r["curve"][args.steps] - ref["curve"][args.steps] if ref else float("nan")
        print(f"{name:<18} {r['bytes']:>7.2f} " + " ".join(f"{r['curve'][s]:>6.3f}" for s in steps)
              + f" {r['train']:>7.3f} {gap:>+7.3f} {r['host_ms']:>8.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "floor": floor, "results": results}, f)


if __name__ == "__main__":
    main()
