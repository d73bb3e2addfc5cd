"""``torchoffload demo``: train a small GPT with and without activation offloading, then
generate from it with and without weight streaming, and compare."""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from torchoffload._transfer import compute_device
from torchoffload.activations import offload_activations
from torchoffload.models import GPT, GPTConfig
from torchoffload.weights import minimum_budget, stream_weights


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def _saved_bytes(model: torch.nn.Module, fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves in ``fn``, parameters excluded."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in params:
            seen[s._cdata] = s.nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _train(
    model: GPT,
    batches: list[torch.Tensor],
    offload: bool,
    device: torch.device,
) -> dict[str, object]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    times, losses, grads = [], [], []
    ctx = offload_activations(min_bytes=1 << 12) if offload else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for tokens in batches:
        _sync(device)
        start = time.perf_counter()
        with ctx if ctx is not None else nullcontext():
            loss = model.loss(tokens)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    out: dict[str, object] = {
        "ms": statistics.median(times[1:] if len(times) > 1 else times) * 1e3,
        "losses": losses,
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "stats": ctx.stats() if ctx is not None else None,
    }
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(device)
    return out


def _generate(model: GPT, prompt: torch.Tensor, n: int, device: torch.device):
    """Greedy decoding without a KV cache: ``n`` forwards of a growing sequence."""
    tokens = prompt
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(n):
            logits = model(tokens)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    _sync(device)
    return tokens, (time.perf_counter() - start) * 1e3 / n


def _inference(model: GPT, device: torch.device, seq: int) -> bool:
    model.eval()
    mib = 1 << 20
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = torch.randint(
        0, model.config.vocab, (2, 8), generator=torch.Generator().manual_seed(2)
    )
    prompt = prompt.to(device)
    n = min(24, seq - 8)
    _generate(model, prompt, 2, device)  # warm-up
    ref, ref_ms = _generate(model, prompt, n, device)
    budget = max(weights // 3, minimum_budget(model))
    handle = stream_weights(model, device, budget_bytes=budget)
    _generate(model, prompt, 2, device)  # records the schedule, places kept units
    handle.reset_stats()
    out, ms = _generate(model, prompt, n, device)
    st = handle.stats()
    handle.remove()
    same = torch.equal(out, ref)
    print()
    print(f"Inference: greedy decoding of {n} tokens (2 sequences, no KV cache)")
    print(f"{'mode':<22}{'ms/token':>10}{'weights on device MiB':>28}{'copied MiB/token':>21}")
    print(f"{'resident':<22}{ref_ms:>10.1f}{weights / mib:>28.1f}{0.0:>21.1f}")
    print(
        f"{'stream_weights':<22}{ms:>10.1f}{st.arena_bytes / mib:>28.1f}"
        f"{st.h2d_bytes / max(st.calls, 1) / mib:>21.1f}"
    )
    print()
    print(
        f"tokens bitwise equal: {same}; budget {budget / mib:.1f} MiB, {st.units} units "
        f"({st.kept_units} kept), prefetch hits {st.hits}, misses {st.misses}"
    )
    return same


def demo(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchoffload demo", description=demo.__doc__)
    p.add_argument("--device", default=None, help="compute device (default: best available)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    args = p.parse_args(argv)
    device = compute_device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu:  # bitwise comparison needs deterministic kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    hidden = args.hidden or (1024 if on_gpu else 256)
    layers = args.layers or (8 if on_gpu else 4)
    batch = args.batch or (8 if on_gpu else 8)
    seq = args.seq or (1024 if on_gpu else 128)
    cfg = GPTConfig(hidden=hidden, layers=layers, heads=max(1, hidden // 64), max_seq=seq + 1)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, cfg.vocab, (batch, seq + 1), generator=gen).to(device)
        for _ in range(args.steps)
    ]
    print(
        f"torchoffload demo: GPT hidden={hidden} layers={layers} batch={batch} seq={seq}, "
        f"{args.steps} training steps on {device} (torch {torch.__version__})"
    )

    def attn():
        if not on_gpu:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)  # deterministic backward

    with attn():
        held = _saved_bytes(base, lambda: base.loss(batches[0]))
        ref = _train(copy.deepcopy(base), batches, False, device)
        off = _train(copy.deepcopy(base), batches, True, device)

    stats = off["stats"]
    same = all(torch.equal(a, b) for a, b in zip(ref["losses"], off["losses"], strict=True))
    same = same and all(
        torch.equal(a, b)
        for ga, gb in zip(ref["grads"], off["grads"], strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    same = same and all(
        torch.equal(a, b) for a, b in zip(ref["params"], off["params"], strict=True)
    )
    mib = 1 << 20
    per_step = stats.offloaded_bytes / args.steps
    if on_gpu:
        mem_label = "peak device MiB"
        mem = [ref["peak"] / mib, off["peak"] / mib]
    else:
        mem_label = "saved acts on device MiB*"
        mem = [held / mib, max(held - per_step, 0) / mib]
    rows = [
        ("no offloading", ref["ms"], mem[0], 0.0),
        ("offload_activations", off["ms"], mem[1], per_step / mib),
    ]
    print()
    print(f"{'mode':<22}{'ms/step':>10}{mem_label:>28}{'offloaded MiB/step':>21}")
    for name, ms, m, o in rows:
        print(f"{name:<22}{ms:>10.1f}{m:>28.1f}{o:>21.1f}")
    print()
    print(f"gradients, losses and weights bitwise equal over {args.steps} steps: {same}")
    print(
        f"prefetch hits {stats.prefetch_hits}, misses {stats.prefetch_misses}, resident "
        f"{stats.resident_hits}; host pool peak {stats.pool.peak_bytes / mib:.1f} MiB"
    )
    if not on_gpu:
        print(
            "* on the CPU there is no separate device memory: this is the bytes of saved "
            "activations left on the compute device after forward (measured without "
            "offloading, minus what was offloaded)."
        )
    with attn():
        same_tokens = _inference(base, device, seq)
    return 0 if same and same_tokens else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchoffload")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo", help="train and run a small GPT with and without offloading", add_help=False
    )
    args, rest = p.parse_known_args(argv)
    if args.command == "demo":
        return demo(rest)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
