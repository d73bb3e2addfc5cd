"""Hugging Face `Trainer` at the Llama-3.2-3B shape: its step time with the optimizer on the GPU
and with `OffloadedOptimizer` (with and without `offload_trainer`), one row per process.

    python benchmarks/trainer.py                         # 3B shape, batch 2 x 4096, GPU
    python benchmarks/trainer.py --layers 2 --hidden 256 --intermediate 512 --heads 4 \
        --kv-heads 2 --vocab 1024 --seq 128 --steps 2     # quick (CPU or GPU)

Rows (the model in bf16, Trainer's gradient checkpointing, AdamW, ``max_grad_norm=--clip``,
``logging_steps=1`` so that every step's loss and gradient norm are read):
- ``resident``: `torch.optim.AdamW(fused=True)` on the device (bf16 state), the Trainer as is.
- ``offload``: `OffloadedOptimizer` (fp32 masters and AdamW state on the host) passed to the
  Trainer with `offload_trainer` (Note: [Trainer's gradient norm]): the norm and clip on the
  host.
- ``offload-noclip``: the same with ``max_grad_norm=0`` (Trainer only logs the norm; the host
  steps each bucket during backward).
- ``offload-plain``: the optimizer swapped in without `offload_trainer`: Trainer's
  ``clip_grad_norm_`` reads every gradient, which brings every bucket back to the device.
- ``loop-offload``: the optimizer of ``offload-noclip`` in a hand-written loop (no Trainer),
  for what the Trainer itself adds; ``loop-offload-norm``: with ``max_grad_norm=inf`` as
  ``offload-noclip`` (the host takes every step's gradient norm, which Trainer logs).

Each row reports the median step time (from Trainer's ``on_step_begin`` to ``on_step_end``
after a device sync; the first step is not timed: it allocates state), tokens/s, device peak
and host memory, the buckets brought back per step, and the logged losses and norms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from optim import host_rss, model_arguments  # benchmarks/, the script's directory

GiB = 2**30


def model_of(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        vocab_size=args.vocab, max_position_embeddings=args.seq, attn_implementation="sdpa",
        tie_word_embeddings=not args.untied,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.config.use_cache = False
    return model


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        self.rows = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def phase_ms(begun: dict, end: float, opt) -> dict:
    """One step's phases in ms of host time: from its start (after a device sync) to the
    optimizer's call (forward and backward queued), the call, and the rest to the step's end
    (after a device sync); with an `OffloadedOptimizer`, what its stats say of the step."""
    t, pre, called = begun["t"], begun["pre"], begun["opt"]
    out = {"to_step": (pre - t) * 1e3, "step": (called - pre) * 1e3, "rest": (end - called) * 1e3}
    if hasattr(opt, "stats"):
        s = opt.stats()
        out.update(host_step=s.host_step_ms, after_call=s.host_step_ms_after_call,
                   wait=s.step_wait_ms, speculated=opt._runtime.stepper.speculated)  # fmt: skip
    return {k: round(v, 1) for k, v in out.items()}


def run_loop(args, model, opt, data, cuda: bool) -> tuple[list, list, list]:
    """The ``loop-offload`` row: the same model, data and optimizer in a hand-written loop
    (no Trainer), batches of ``args.batch`` rows moved to the device, no clipping."""
    times, phases, losses = [], [], []
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    device = "cuda" if cuda else "cpu"
    for i in range(args.steps + 1):
        rows = data.rows[i * args.batch : (i + 1) * args.batch].to(device)
        if cuda:
            torch.cuda.synchronize()
        begun = {"t": time.perf_counter()}
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        begun["pre"] = time.perf_counter()
        opt.step()
        begun["opt"] = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        losses.append(float(loss))
        if i > 0:
            times.append(end - begun["t"])
            phases.append(phase_ms(begun, end, opt))
    return times, phases, losses


def run_row(args, row: str) -> dict:
    import tempfile

    import transformers

    import torchoffload as to
    from torchoffload.integrations.hf import offload_trainer, trainer_max_grad_norm

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    clip = 0.0 if row in ("offload-noclip", "loop-offload", "loop-offload-norm") else args.clip
    model = model_of(args, device)
    times, begun, phases = [], {}, []

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            sync()
            if state.global_step == 1 and cuda:
                torch.cuda.reset_peak_memory_stats()
            begun["t"] = time.perf_counter()

        def on_pre_optimizer_step(self, targs, state, control, **kw):
            begun["pre"] = time.perf_counter()

        def on_optimizer_step(self, targs, state, control, **kw):
            begun["opt"] = time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            sync()
            if state.global_step > 1:  # the first step allocates the optimizer's state
                end = time.perf_counter()
                times.append(end - begun["t"])
                phases.append(phase_ms(begun, end, opt))

    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps + 1,
            learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[], seed=0,
            use_cpu=not cuda, disable_tqdm=True, max_grad_norm=clip,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            dataloader_num_workers=0, lr_scheduler_type="linear", warmup_steps=1,
        )  # fmt: skip
        if row == "resident":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
        else:
            plain = row in ("offload-plain", "loop-offload")
            norm = None if plain else trainer_max_grad_norm(targs)  # inf for loop-offload-norm
            opt = to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5,
                                        fused=True, model=model, max_grad_norm=norm)  # fmt: skip
        data = Tokens(args.batch * (args.steps + 1), args.seq, args.vocab)
        if row.startswith("loop-"):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, phases, losses = run_loop(args, model, opt, data, cuda)
            norms = []
        else:
            trainer = transformers.Trainer(model=model, args=targs, train_dataset=data,
                                           optimizers=(opt, None), callbacks=[Clock()])  # fmt: skip
            if row in ("offload", "offload-noclip"):
                offload_trainer(trainer)
            trainer.train()
            logs = [h for h in trainer.state.log_history if "loss" in h]
            losses, norms = [h["loss"] for h in logs], [h.get("grad_norm") for h in logs]
    med = sorted(times)[len(times) // 2]
    out = dict(
        step_ms=med * 1e3, tokens_s=args.batch * args.seq / med, times_ms=[t * 1e3 for t in times],
        peak_gib=torch.cuda.max_memory_allocated() / GiB if cuda else None, host_gib=host_rss(),
        losses=losses, grad_norms=norms, phases=phases,
    )  # fmt: skip
    if row != "resident":
        s = opt.stats()
        out.update(recalled_per_step=s.recalled / (args.steps + 1), host_step_ms=s.host_step_ms,
                   speculated=opt._runtime.stepper.speculated)  # fmt: skip
        opt.remove()
    return out


ROWS = (
    "resident",
    "offload",
    "offload-noclip",
    "offload-plain",
    "loop-offload",
    "loop-offload-norm",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    model_arguments(p)  # optim.py's: the Llama-3.2-3B shape, batch 2 x 4096
    p.add_argument("--steps", type=int, default=4, help="timed steps (one more runs first)")
    p.add_argument("--clip", type=float, default=1.0, help="Trainer's max_grad_norm")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=int, default=300)
    args = p.parse_args()
    if args.row:
        print("RESULT " + json.dumps(run_row(args, args.row)), flush=True)
        return
    results = {}
    for row in args.rows.split(","):
        if row not in ROWS:
            sys.exit(f"trainer.py: unknown row {row!r}; rows: {', '.join(ROWS)}")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--row", row]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                 env=dict(os.environ))  # fmt: skip
            out = run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:
            out = f"timed out after {args.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if lines:
            results[row] = json.loads(lines[-1][7:])
        else:
            print(f"{row}: FAILED\n{out[-3000:]}", flush=True)
    print(json.dumps(results))
    print("\n| row | step ms | tokens/s | peak GiB | host GiB | x resident | recalled/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = results.get("resident", {}).get("step_ms")
    for row, r in results.items():
        ratio = f"{r['step_ms'] / base:.2f}" if base else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"| {row} | {r['step_ms']:.0f} | {r['tokens_s']:.0f} | {peak} | "
              f"{r['host_gib']:.1f} | {ratio} | {r.get('recalled_per_step', '-')} |")  # fmt: skip


if __name__ == "__main__":
    main()
