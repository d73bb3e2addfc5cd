"""Full fine-tuning of a Llama-style model with AdamW on the host, against AdamW on the device.

    python examples/train_offloaded_optimizer.py                   # a small model, GPU or CPU
    python examples/train_offloaded_optimizer.py --dtype fp32 --layers 2 --hidden 256 \
        --heads 4 --kv-heads 2 --intermediate 512 --vocab 2048 --seq 64   # CPU: seconds, bitwise
    python examples/train_offloaded_optimizer.py --hidden 3072 --layers 28 --heads 24 \\
        --kv-heads 8 --intermediate 8192 --vocab 128256 --seq 4096 --batch 2   # Llama-3.2-3B

The model is Hugging Face's ``LlamaForCausalLM`` built from a config with random weights (no
download), in bf16 with gradient checkpointing. Two runs from the same weights:
- ``device``: ``torch.optim.AdamW`` on the device (its state in the parameters' dtype);
- ``host``: ``torchoffload.OffloadedOptimizer(params, torch.optim.AdamW)``: fp32 master
  weights and AdamW state in host memory, each bucket stepped while backward runs;
- ``params``: also the bf16 parameters in host memory, streamed per decoder layer for forward
  and backward (``torchoffload.stream_parameters``, ``--param-budget-mib``), stepped in place
  on the host.
Each prints the step time, tokens/s, peak device memory and host memory. With bf16 parameters
the two are different arithmetic (fp32 masters on the host), so their losses differ; with
``--dtype fp32`` on the CPU they are bitwise equal, which the script checks. First,
``torchoffload.verify`` checks two steps of ``params`` against ``host`` (the same arithmetic:
bitwise in any dtype, on any device) on a copy of the model, and prints its report.
"""

from __future__ import annotations

import argparse
import time

import torch

import torchoffload


def build(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        vocab_size=args.vocab, max_position_embeddings=args.seq, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(args.dtype)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
    return model.train()


def host_gib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def run(args, device, mode):
    model = build(args, device)
    handle = None
    if mode == "params":
        handle = torchoffload.stream_parameters(model, args.param_budget_mib << 20)
    params = list(model.parameters())
    if mode in ("host", "params"):
        opt = torchoffload.OffloadedOptimizer(params, torch.optim.AdamW, lr=args.lr)
    else:
        opt = torch.optim.AdamW(params, lr=args.lr)
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        for _ in range(args.steps)
    ]
    losses, times = [], []
    for i, x in enumerate(batches):
        if device.type == "cuda":
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # waits for the step's device work
        times.append(time.perf_counter() - start)
    step = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    peak = "   n/a"  # on the CPU there is no separate device memory
    if device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:6.2f}"
    line = (f"{mode:7s} step {step * 1e3:8.1f} ms  {args.batch * args.seq / step:9.0f} tokens/s  "
            f"peak device {peak} GiB  host {host_gib():6.2f} GiB")  # fmt: skip
    if handle is not None:
        ps = handle.stats()
        line += (f"  parameters: at most {ps.peak_loaded_bytes / 2**20:.1f} MiB on the device, "
                 f"{ps.h2d_bytes / len(batches) / 2**20:.1f} MiB up per step")  # fmt: skip
    if mode in ("host", "params"):
        s = opt.stats()
        link = (s.d2h_bytes + s.h2d_bytes) / s.steps / 2**30
        line += (f"  host step {s.host_step_ms:.0f} ms ({s.overlap:.0%} hidden behind backward, "
                 f"{link:.2f} GiB over the link per step)")  # fmt: skip
        opt.remove()
    if handle is not None:
        handle.remove()
    print(line, flush=True)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--param-budget-mib", type=int, default=256,
                   help="params mode: device budget of the streamed parameters")  # fmt: skip
    args = p.parse_args()
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.dtype}, batch {args.batch} x "
          f"{args.seq} on {device}, torch {torch.__version__}")  # fmt: skip
    report = torchoffload.verify(
        build(args, device),
        kwargs={"input_ids": (x := torch.randint(0, args.vocab, (args.batch, args.seq),
                                                 generator=torch.Generator().manual_seed(1)
                                                 ).to(device)), "labels": x},
        apply=lambda m: torchoffload.stream_parameters(m, args.param_budget_mib << 20),
        optimizer=lambda m: torchoffload.OffloadedOptimizer(m.parameters(), torch.optim.AdamW,
                                                            lr=args.lr),
        loss=lambda out: out.loss,
        steps=2,
    )  # fmt: skip
    print(f"verify (params against host): {report}")
    on_device = run(args, device, "device")
    on_host = run(args, device, "host")
    streamed = run(args, device, "params")
    print("losses (device):", [round(x, 4) for x in on_device])
    print("losses (host):  ", [round(x, 4) for x in on_host])
    print("losses (params):", [round(x, 4) for x in streamed])
    if args.dtype == torch.float32 and device.type == "cpu":
        print(f"bitwise equal losses: {on_device == on_host == streamed}")


if __name__ == "__main__":
    main()
