"""A long soak: training steps under activation offloading and forward calls under weight
streaming, with random shapes and a fault injected every few dozen steps. Device and pinned
memory must stay flat and every result bitwise equal to the same model without torchoffload.

    python benchmarks/soak.py [--train-steps 2000] [--decode-calls 500] [--fault-every 37]
                              [--device cuda] [--json soak.json]

Training: a GPT (hidden 256, 6 layers) and its reference train in lockstep on the same random
batches (batch 1-4, sequence 16-256), the first half under `apply_activation_offloading`, the
second under `offload_activations`. A faulted step is applied to neither model. Faults, in
turn: a real out-of-memory error inside a layer with copies in flight, a device-to-host copy
that fails, a host-to-device copy that fails in backward, Ctrl-C between forward and
backward, a backward never run, Ctrl-C inside a layer. Every 100 steps: parameters compared
bitwise, device bytes and pool bytes recorded.

Serving: the same architecture in eval mode under `stream_weights` at three blocks of budget,
against the resident model, random (batch, sequence); faults in turn: out-of-memory inside a
unit, a weight copy that fails, Ctrl-C inside a unit. Every output compared bitwise.

Deterministic settings: `torch.use_deterministic_algorithms(True)`, the math attention
backend, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchoffload import (  # noqa: E402
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    minimum_budget,
    offload_activations,
    stream_weights,
    testing,
)
from torchoffload.models import GPT, GPTConfig  # noqa: E402
from torchoffload.testing import InjectedCopyError  # noqa: E402

CFG = GPTConfig(hidden=256, layers=6, heads=4, vocab=1024, max_seq=256)
TRAIN_FAULTS = ["oom", "offload_copy", "reload_copy", "interrupt_between", "no_backward",
                "interrupt_in_layer"]  # fmt: skip
SERVE_FAULTS = ["oom", "load_copy", "interrupt_in_unit"]


def make(device):
    torch.manual_seed(0)
    model = GPT(CFG)
    model.layers[2].ln2 = nn.Sequential(model.layers[2].ln2, testing.Fault())
    return model.to(device)


def oom_now(device):
    def fire():
        torch.empty(1 << 46, dtype=torch.uint8, device=device)  # more than any GPU has

    return fire if device.type == "cuda" else torch.OutOfMemoryError("injected")


def slow(device):
    return (
        testing.slow_copies(device, 2_000_000)
        if device.type == "cuda"
        else (contextlib.nullcontext())
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_bytes(device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def train_soak(device, steps, fault_every, rng):
    model, ref = make(device), make(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3, momentum=0.9)
    pool = PinnedPool(1 << 30, slab_bytes=32 << 20, pin_memory=device.type == "cuda")
    handle = apply_activation_offloading(
        model, config=ActivationOffloadConfig(min_bytes=0), pool=pool, device=device
    )
    ctx = offload_activations(min_bytes=0, pool=pool, device=device)
    faults = {k: 0 for k in TRAIN_FAULTS}
    checkpoints, mismatched_losses = [], 0
    losses = []

    def forward(tokens, phase):
        with ctx if phase == "context" else contextlib.nullcontext():
            return model.loss(tokens)

    for step in range(steps):
        phase = "layers" if step < steps // 2 else "context"
        if step == steps // 2:
            handle.remove()
        batch, seq = rng.choice([1, 2, 4]), rng.randint(16, CFG.max_seq)
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, CFG.vocab, (batch, seq + 1), generator=g).to(device)
        if step % fault_every == fault_every - 1:
            kind = TRAIN_FAULTS[(step // fault_every) % len(TRAIN_FAULTS)]
            faults[kind] += 1
            try:
                if kind == "oom":
                    testing.Fault.armed = oom_now(device)
                    with slow(device):
                        forward(tokens, phase)
                elif kind == "offload_copy":
                    with slow(device), testing.failing_copies(device, at=7, kinds=("offload",)):
                        forward(tokens, phase)
                elif kind == "reload_copy":
                    loss = forward(tokens, phase)
                    with testing.failing_copies(device, at=5, kinds=("reload",)):
                        loss.backward()
                elif kind == "interrupt_between":
                    loss = forward(tokens, phase)
                    raise KeyboardInterrupt
                elif kind == "no_backward":
                    forward(tokens, phase)
                    raise RuntimeError("graph dropped")
                else:
                    testing.Fault.armed = KeyboardInterrupt
                    with slow(device):
                        forward(tokens, phase)
                raise AssertionError(f"fault {kind} did not fire at step {step}")
            except (torch.OutOfMemoryError, InjectedCopyError, KeyboardInterrupt, RuntimeError):
                pass
            finally:
                testing.Fault.armed = None
                loss = None
            opt.zero_grad(set_to_none=True)
            continue
        loss = forward(tokens, phase)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_loss = ref.loss(tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        losses.append((loss.detach(), ref_loss.detach()))
        loss = ref_loss = tokens = None
        if step % 100 == 99 or step == steps - 1:
            gc.collect()
            sync(device)
            mismatched_losses += sum(not torch.equal(a, b) for a, b in losses)
            losses.clear()
            params_equal = all(
                torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
            )
            s = pool.stats()
            checkpoints.append(
                {
                    "step": step + 1,
                    "phase": phase,
                    "params_bitwise": params_equal,
                    "device_bytes": device_bytes(device),
                    "pool_used": s.used_bytes,
                    "pool_pending": s.pending_bytes,
                    "pool_reserved": s.reserved_bytes,
                }
            )
    stats = ctx.stats()
    return {
        "steps": steps,
        "faults": faults,
        "mismatched_losses": mismatched_losses,
        "checkpoints": checkpoints,
        "handle_offloaded_bytes": handle.stats().offloaded_bytes,
        "context_offloaded_bytes": stats.offloaded_bytes,
        "fallback_allocs": pool.stats().fallback_allocs,
    }


def serve_soak(device, calls, fault_every, rng):
    ref, model = make(device).eval(), make(device).eval()
    budget = minimum_budget(model, unit="blocks", prefetch_depth=2)
    handle = stream_weights(
        model, device, budget_bytes=budget, unit="blocks", pin_memory=device.type == "cuda"
    )
    faults = {k: 0 for k in SERVE_FAULTS}
    wrong, samples = 0, []
    with torch.no_grad():
        for call in range(calls):
            batch, seq = rng.choice([1, 2, 4, 8]), rng.randint(1, CFG.max_seq)
            g = torch.Generator().manual_seed(10_000 + call)
            x = torch.randint(0, CFG.vocab, (batch, seq), generator=g).to(device)
            if call % fault_every == fault_every - 1:
                kind = SERVE_FAULTS[(call // fault_every) % len(SERVE_FAULTS)]
                faults[kind] += 1
                try:
                    if kind == "oom":
                        testing.Fault.armed = oom_now(device)
                        with slow(device):
                            model(x)
                    elif kind == "load_copy":
                        with slow(device), testing.failing_copies(device, at=3, kinds=("load",)):
                            model(x)
                    else:
                        testing.Fault.armed = KeyboardInterrupt
                        with slow(device):
                            model(x)
                    raise AssertionError(f"fault {kind} did not fire at call {call}")
                except (torch.OutOfMemoryError, InjectedCopyError, KeyboardInterrupt):
                    pass
                finally:
                    testing.Fault.armed = None
                continue
            wrong += not torch.equal(model(x), ref(x))
            x = None  # not counted in the device bytes below
            if call % 50 == 49 or call == calls - 1:
                gc.collect()
                sync(device)
                samples.append({"call": call + 1, "device_bytes": device_bytes(device)})
    s = handle.stats()
    handle.remove()
    restored = all(
        torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return {
        "calls": calls,
        "faults": faults,
        "wrong_outputs": wrong,
        "samples": samples,
        "budget_bytes": budget,
        "peak_device_bytes": s.peak_device_bytes,
        "h2d_bytes": s.h2d_bytes,
        "interrupted_calls": s.interrupted_calls,
        "restored_bitwise": restored,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--train-steps", type=int, default=2000, help="training steps (default 2000)")
    p.add_argument("--decode-calls", type=int, default=500, help="serving calls (default 500)")
    p.add_argument("--fault-every", type=int, default=37, help="a fault every N steps/calls")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, help="write the full record here")
    args = p.parse_args(argv)
    for name in ("train_steps", "decode_calls", "fault_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device(args.device)
    torch.use_deterministic_algorithms(True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rng = random.Random(0)
    t0 = time.perf_counter()
    with sdpa_kernel(SDPBackend.MATH):
        train = train_soak(device, args.train_steps, args.fault_every, rng)
        t1 = time.perf_counter()
        serve = serve_soak(device, args.decode_calls, args.fault_every, rng)
    t2 = time.perf_counter()
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "train": train,
        "serve": serve,
        "train_s": round(t1 - t0, 1),
        "serve_s": round(t2 - t1, 1),
    }
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    cps = train["checkpoints"]
    warm = cps[1:] or cps  # the first checkpoint includes the pool's and allocator's warm-up
    mib = 2**20
    print(f"soak on {record['device']}, torch {record['torch']}")
    print(f"{'part':<8} {'count':>6} {'faults':>7} {'bitwise':>8} {'dev MiB min-max':>16} "
          f"{'pool used max':>13} {'pool MiB min-max':>17} {'seconds':>8}")  # fmt: skip
    dev = [c["device_bytes"] for c in warm]
    res = [c["pool_reserved"] for c in warm]
    train_ok = train["mismatched_losses"] == 0 and all(c["params_bitwise"] for c in cps)
    print(
        f"{'train':<8} {train['steps']:>6} {sum(train['faults'].values()):>7} "
        f"{str(train_ok):>8} {min(dev) / mib:>7.1f}-{max(dev) / mib:<8.1f} "
        f"{max(c['pool_used'] + c['pool_pending'] for c in cps):>13} "
        f"{min(res) / mib:>8.1f}-{max(res) / mib:<8.1f} {record['train_s']:>8}"
    )
    sdev = [s["device_bytes"] for s in serve["samples"][1:] or serve["samples"]]
    serve_ok = serve["wrong_outputs"] == 0 and serve["restored_bitwise"]
    print(
        f"{'serve':<8} {serve['calls']:>6} {sum(serve['faults'].values()):>7} "
        f"{str(serve_ok):>8} {min(sdev) / mib:>7.1f}-{max(sdev) / mib:<8.1f} "
        f"{'-':>13} {'-':>17} {record['serve_s']:>8}"
    )
    print(f"train faults {train['faults']}; serve faults {serve['faults']}")
    flat = max(dev) == min(dev) and max(sdev) == min(sdev)
    ok = train_ok and serve_ok and flat and all(c["pool_used"] == 0 for c in cps)
    print(f"flat device memory: {flat}; all checks: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
