"""`OffloadedOptimizer` in the loops people train with, their code unchanged but for the
optimizer: Hugging Face ``Trainer`` (its defaults: clipping at 1.0, a linear schedule;
here with gradient accumulation over 2 micro-batches) and an accelerate ``Accelerator`` loop
(``accelerator.accumulate``, ``accelerator.backward``, ``accelerator.clip_grad_norm_``).

    python examples/train_loops.py                 # both loops, a small Llama, CPU or GPU
    python examples/train_loops.py --loop trainer

Each loop runs twice from the same seed: with ``torch.optim.AdamW`` and with
``torchoffload.OffloadedOptimizer(params, torch.optim.AdamW)``. On the CPU with fp32 weights the
two are the same arithmetic (the plain class stepping fp32 host tensors), and the script checks
that losses, logged gradient norms and weights are bitwise equal; on a GPU in bf16 the host
keeps fp32 masters, so the runs differ by design and it prints both.

Steps the host takes during backward are speculative and undone exactly when the loop does
what they did not foresee (a second backward of an accumulation, clipping): see "Steps taken
during backward" in docs/training-state.md.

``Trainer`` reads every gradient's norm at every step (to clip and to log it), which would
bring every bucket of gradients back to the device; the Trainer run here therefore adds one
line, ``torchoffload.integrations.hf.offload_trainer(trainer)``, with the optimizer built with
``max_grad_norm=trainer_max_grad_norm(args)`` and ``model=model``: the norm and the clip are
then the optimizer's, on the host, and the script prints how many buckets were brought back
(none).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import torchoffload

VOCAB = 256


def llama(device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).to(device, dtype)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=32):
        self.rows = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def make_optimizer(kind, model):
    kw = dict(lr=3e-3, weight_decay=0.1)
    if kind == "torch.optim":
        return torch.optim.AdamW(model.parameters(), **kw)
    return torchoffload.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, **kw)


def trainer_run(kind, device, dtype, steps):
    import transformers

    from torchoffload.integrations.hf import offload_trainer, trainer_max_grad_norm

    model = llama(device, dtype)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=steps, learning_rate=3e-3, logging_steps=1, save_strategy="no",
            report_to=[], seed=0, use_cpu=device == "cpu", disable_tqdm=True,
        )  # fmt: skip
        if kind == "torch.optim":
            opt = make_optimizer(kind, model)
        else:  # clipping on the host, summed in model.parameters() order
            opt = torchoffload.OffloadedOptimizer(
                model.parameters(), torch.optim.AdamW, lr=3e-3, weight_decay=0.1, model=model,
                max_grad_norm=trainer_max_grad_norm(args),
            )  # fmt: skip
        t = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                 optimizers=(opt, None))  # fmt: skip
        if kind != "torch.optim":
            offload_trainer(t)  # the one line the loop gains
        t.train()
    logs = [(h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h]
    if kind != "torch.optim":
        print(f"trainer: buckets brought back to the device: {opt.stats().recalled}")
    return logs, model


def accelerate_run(kind, device, dtype, steps):
    from accelerate import Accelerator

    acc = Accelerator(cpu=device == "cpu", gradient_accumulation_steps=2)
    model = llama(acc.device, dtype)
    opt = make_optimizer(kind, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=4)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    logs = []
    for i, batch in enumerate(loader):
        if i >= 2 * steps:
            break
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), 1.0)
                logs.append((loss.item(), norm.item()))
            opt.step()
            sched.step()
            opt.zero_grad()
    return logs, acc.unwrap_model(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--loop", choices=["trainer", "accelerate", "both"], default="both")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loops = {"trainer": trainer_run, "accelerate": accelerate_run}
    names = list(loops) if args.loop == "both" else [args.loop]
    for name in names:
        runs = {kind: loops[name](kind, device, dtype, args.steps)
                for kind in ("torch.optim", "OffloadedOptimizer")}  # fmt: skip
        print(f"{name} ({device}, {dtype}): step, (loss, grad norm) with torch.optim | "
              "with OffloadedOptimizer")  # fmt: skip
        for i, (a, b) in enumerate(zip(runs["torch.optim"][0], runs["OffloadedOptimizer"][0],
                                       strict=True)):  # fmt: skip
            print(f"  {i}  ({a[0]:.6f}, {a[1]:.6f}) | ({b[0]:.6f}, {b[1]:.6f})")
        if device == "cpu":
            pa, pb = (dict(r[1].named_parameters()) for r in runs.values())
            same = runs["torch.optim"][0] == runs["OffloadedOptimizer"][0] and all(
                torch.equal(pa[k], pb[k]) for k in pa
            )
            print(f"{name}: bitwise equal: {same}")
            if not same:
                raise SystemExit(f"{name}: the offloaded run differs from torch.optim")


if __name__ == "__main__":
    main()
