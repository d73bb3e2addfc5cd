"""The training loops people use, with `OffloadedOptimizer` as the optimizer and nothing else
changed (issue 40): an accelerate `Accelerator` loop (accumulation, `clip_grad_norm_`, a
scheduler) and Hugging Face `Trainer` with its defaults (clipping at 1.0, gradient
accumulation, an LR scheduler, ``grad_norm`` logging, checkpoint save and resume).

Each runs twice from the same seed: with ``torch.optim.AdamW`` over the fp32 CPU parameters
(the reference: the plain class stepping fp32 host tensors) and with `OffloadedOptimizer` of
the same class; losses, logged gradient norms and weights must be equal bit for bit.
Skipped when accelerate or transformers is not installed.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchoffload as to

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

VOCAB = 64


@pytest.fixture(autouse=True)
def fresh_gradient_state():
    """accelerate's GradientState is process-wide, and the optimizer reads its
    ``sync_gradients`` (Note: [A micro-batch that accelerate says is not the last]): each test
    leaves it as it found it, so that no later test of the process sees this one's."""
    from accelerate.state import GradientState

    yield
    GradientState._reset_state()


def llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    """A fixed corpus of random token rows (labels = inputs: causal LM)."""

    def __init__(self, n=16, seq=12):
        g = torch.Generator().manual_seed(7)
        self.rows = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def optimizer(kind, model, **kw):
    if kind == "plain":
        return torch.optim.AdamW(model.parameters(), **kw)
    return to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, bucket_bytes=4096, **kw)


# - accelerate
def accelerate_loop(kind, steps=4, accumulation=2, max_norm=0.5):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(0)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = llama()
    opt = optimizer(kind, model, lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    losses, norms = [], []
    model.train()
    for i, batch in enumerate(loader):
        if i >= steps * accumulation:
            break
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            losses.append(loss.detach())
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), max_norm))
            opt.step()
            sched.step()
            opt.zero_grad()
    out = (losses, norms, weights(acc.unwrap_model(model)))
    if kind == "offloaded":
        opt.optimizer.remove()
    acc.free_memory()
    return out


def test_an_accelerate_loop_trains_bitwise_as_the_plain_optimizer():
    plain = accelerate_loop("plain")
    offloaded = accelerate_loop("offloaded")
    assert len(plain[0]) == len(offloaded[0]) == 8
    for a, b in zip(plain[0], offloaded[0], strict=True):
        assert torch.equal(a, b)
    assert len(plain[1]) == 4
    for a, b in zip(plain[1], offloaded[1], strict=True):
        assert torch.equal(a, b)
    assert any(float(n) > 0.5 for n in plain[1])  # clipping happened in some steps
    assert_equal(plain[2], offloaded[2])


# - Hugging Face Trainer
def trainer(kind, out_dir, max_steps=4, resume=None, save_steps=2, max_grad_norm=1.0,
            stats=None):  # fmt: skip
    """``kind``: "plain", "offloaded" (the optimizer swapped, nothing else), or "integrated"
    / "streamed" (`offload_trainer`; "streamed" with `stream_parameters` too)."""
    from torchoffload.integrations.hf import offload_trainer, trainer_max_grad_norm

    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=max_steps, learning_rate=3e-3, weight_decay=0.1, logging_steps=1,
        save_steps=save_steps, save_strategy="steps", use_cpu=True, report_to=[], seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, lr_scheduler_type="linear",
        warmup_steps=1, max_grad_norm=max_grad_norm,
    )  # fmt: skip
    model = llama()
    streamed = kind == "streamed"  # on the CPU, where this Trainer runs (use_cpu=True)
    handle = to.stream_parameters(model, 1 << 16, device="cpu") if streamed else None
    if kind in ("integrated", "streamed"):
        opt = to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, bucket_bytes=4096,
                                    lr=3e-3, weight_decay=0.1, model=model,
                                    max_grad_norm=trainer_max_grad_norm(args))  # fmt: skip
    else:
        opt = optimizer(kind, model, lr=3e-3, weight_decay=0.1)
    t = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                             optimizers=(opt, None))  # fmt: skip
    if kind in ("integrated", "streamed"):
        offload_trainer(t)
    t.train(resume_from_checkpoint=resume)
    logs = [(h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h]
    if kind != "plain":
        if stats is not None:
            stats.update(recalled=opt.stats().recalled, speculated=opt._runtime.stepper.speculated)
        opt.remove()
    if handle is not None:
        handle.remove()
    return logs, weights(model)


def test_trainer_with_its_defaults_trains_bitwise_as_the_plain_optimizer(tmp_path):
    """Clipping at 1.0 (the default), accumulation over 2 micro-batches, a linear schedule
    with warmup, grad_norm logged every step."""
    plain = trainer("plain", tmp_path / "plain")
    offloaded = trainer("offloaded", tmp_path / "offloaded")
    assert len(plain[0]) == 4
    assert plain[0] == offloaded[0]  # losses and gradient norms, as logged
    assert all(math.isfinite(n) for _, n in plain[0])
    assert_equal(plain[1], offloaded[1])


def test_trainer_resumes_from_its_checkpoint_bitwise(tmp_path):
    """Trainer saves the optimizer's state_dict at step 2; a new Trainer with a new
    OffloadedOptimizer resumes from it and ends where the plain optimizer's resumed run ends
    (Trainer's own resume is not bitwise its uninterrupted run: the data order differs, with
    the plain optimizer too)."""
    runs = {}
    for kind in ("plain", "offloaded"):
        trainer(kind, tmp_path / kind, max_steps=2)
        checkpoint = tmp_path / kind / "checkpoint-2"
        assert (checkpoint / "optimizer.pt").exists()
        runs[kind] = trainer(kind, tmp_path / kind, max_steps=4, resume=str(checkpoint))
    assert len(runs["plain"][0]) == 4
    assert runs["plain"][0] == runs["offloaded"][0]
    assert_equal(runs["plain"][1], runs["offloaded"][1])


@pytest.mark.parametrize("kind", ["integrated", "streamed"])
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip", "log-only"])
def test_offload_trainer_keeps_the_gradients_on_the_host_bitwise(kind, max_grad_norm, tmp_path):
    """`offload_trainer`: Trainer's clipping and logged norm come from the optimizer's host
    clipping (Note: [Trainer's gradient norm]), so no bucket is brought back to the device (a
    plain Trainer reads every gradient each step and recalls every bucket), with
    `stream_parameters` too (where a plain Trainer is refused); bitwise as the plain class."""
    plain = trainer("plain", tmp_path / "plain", max_grad_norm=max_grad_norm)
    stats = {}
    mine = trainer(kind, tmp_path / kind, max_grad_norm=max_grad_norm, stats=stats)
    assert len(plain[0]) == 4 and all(math.isfinite(n) for _, n in plain[0])
    assert plain[0] == mine[0]  # losses and gradient norms, as logged
    assert_equal(plain[1], mine[1])
    assert stats["recalled"] == 0
    if max_grad_norm == 0.0:  # the norm only: steps are still taken during backward
        assert stats["speculated"] > 0


def test_offload_trainer_refuses_what_it_cannot_serve(tmp_path):
    from torchoffload.integrations.hf import offload_trainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          max_grad_norm=1.0)  # fmt: skip
    model = llama()
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="needs Trainer.*OffloadedOptimizer"):
        offload_trainer(transformers.Trainer(model=model, args=args, optimizers=(plain, None)))
    opt = to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW)  # no max_grad_norm
    with pytest.raises(ValueError, match=r"max_grad_norm=None and the Trainer at 1.0"):
        offload_trainer(transformers.Trainer(model=model, args=args, optimizers=(opt, None)))
    opt.remove()


@pytest.mark.parametrize("streamed", [False, True], ids=["host", "stream_parameters"])
def test_an_accelerate_loop_clipping_on_the_host_recalls_nothing(streamed):
    """accelerate marks each micro-batch but the last with ``sync_gradients`` False: their
    gradients stay on the device from the first step on (Note: [A micro-batch that accelerate
    says is not the last]), so with the clip on the host (``max_grad_norm``) no bucket comes
    back, and `stream_parameters` trains too (a streamed gradient cannot come back); bitwise
    the plain class clipping with ``accelerator.clip_grad_norm_``."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    runs = {}
    for kind in ("plain", "offloaded"):
        set_seed(0)
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = llama()
        handle = None
        if kind == "plain":
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        else:
            if streamed:
                handle = to.stream_parameters(model, 1 << 16, device="cpu")
            opt = to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3,
                                        weight_decay=0.1, bucket_bytes=4096, model=model,
                                        max_grad_norm=0.5)  # fmt: skip
        loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
        model, opt, loader = acc.prepare(model, opt, loader)
        losses, norms = [], []
        for i, batch in enumerate(loader):
            if i >= 8:
                break
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                losses.append(loss.detach())
                if acc.sync_gradients and kind == "plain":
                    norms.append(acc.clip_grad_norm_(model.parameters(), 0.5))
                opt.step()
                if acc.sync_gradients and kind != "plain":
                    norms.append(opt.optimizer.grad_norm)
                opt.zero_grad()
        runs[kind] = (losses, norms, weights(acc.unwrap_model(model)))
        if kind != "plain":
            assert opt.optimizer.stats().recalled == 0
            opt.optimizer.remove()
        if handle is not None:
            handle.remove()
        acc.free_memory()
    (la, na, wa), (lb, nb, wb) = runs["plain"], runs["offloaded"]
    assert len(na) == 4 and all(torch.equal(a, b) for a, b in zip(la, lb, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(na, nb, strict=True))
    assert any(float(n) > 0.5 for n in na)  # clipping happened
    assert_equal(wa, wb)


def test_accelerate_moves_no_master_when_it_prepares_the_optimizer():
    """accelerate's AcceleratedOptimizer (Trainer, ``accelerator.prepare``) moves the state
    dict to the device and loads it back as it wraps the optimizer: before the first step no
    tensor of it is moved, where every fp32 master of the bf16 parameters was (4 bytes a
    parameter on the device at once; Note: [A master that is its parameter's bits])."""
    import accelerate.optimizer
    from accelerate import Accelerator

    from torchoffload.optim._state import MASTER

    model = llama().to(torch.bfloat16)
    opt = to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    moved = []
    real = accelerate.optimizer.move_to_device

    def spy(obj, device, *args, **kwargs):
        if isinstance(obj, dict) and "state" in obj:  # the optimizer's state dict
            moved.extend(t for s in obj["state"].values() for t in s.values()
                         if isinstance(t, torch.Tensor))  # fmt: skip
        return real(obj, device, *args, **kwargs)

    accelerate.optimizer.move_to_device = spy
    try:
        acc = Accelerator(cpu=True)
        model, wrapped = acc.prepare(model, opt)
    finally:
        accelerate.optimizer.move_to_device = real
    assert moved == []
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    acc.backward(model(input_ids=x, labels=x).loss)
    wrapped.step()
    assert all(MASTER in s for s in opt.state_dict()["state"].values())  # stepped: kept
    opt.remove()
