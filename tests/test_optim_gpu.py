"""OffloadedOptimizer on a GPU: the step is bitwise the optimizer class on fp32 host copies with
the copy streams slowed (gradients copied while backward runs, uploads while the next forward
waits), no host sync on the caller's thread in steady state, and no device gradients kept."""

from __future__ import annotations

import copy

import pytest
import torch

import torchoffload as to
from torchoffload import testing
from torchoffload.models import GPT, GPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]

CFG = GPTConfig(hidden=256, layers=4, heads=4, vocab=1024, max_seq=128)


def tokens(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, CFG.vocab, (4, 128), generator=g).cuda()


def gpt(dtype):
    torch.manual_seed(0)
    return GPT(CFG).to("cuda", dtype)


class Reference:
    """A twin on the GPU computes the gradients; fp32 host copies are stepped by the plain
    class; the twin receives them rounded."""

    def __init__(self, twin, cls, max_grad_norm=None, **kw):
        self.twin = twin
        self.masters = [p.detach().float().cpu().requires_grad_() for p in twin.parameters()]
        self.opt = cls(self.masters, **kw)
        self.max_grad_norm = max_grad_norm

    def step(self):
        for m, p in zip(self.masters, self.twin.parameters(), strict=True):
            m.grad = p.grad.float().cpu()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm)
        self.opt.step()
        self.twin.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.masters, self.twin.parameters(), strict=True):
                p.copy_(m)


@pytest.mark.parametrize(
    "dtype,convert_on",
    [(torch.float32, "device"), (torch.bfloat16, "device"), (torch.bfloat16, "host")],
    ids=["fp32", "bf16", "bf16-host-converts"],
)
@pytest.mark.parametrize("mode", ["overlap", "clip", "accumulate", "ahead"])
def test_bitwise_with_slowed_copies(dtype, convert_on, mode, monkeypatch):
    import torchoffload._transfer as transfer

    # Copies that convert go in chunks of 50k elements (the embedding, 1024 x 256, in six), so
    # the scratch reused on each copy stream is exercised with the copies slowed.
    monkeypatch.setattr(transfer, "CAST_CHUNK", 50_000)
    a = gpt(dtype)
    kw = dict(lr=1e-3, weight_decay=0.1, fused=True)
    clip = 0.05 if mode == "clip" else None
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, max_grad_norm=clip, **kw)
    ahead = dict(step_ahead=True, model=a) if mode == "ahead" else {}
    opt = to.OffloadedOptimizer(
        a.parameters(), torch.optim.AdamW, bucket_bytes=1 << 20, max_grad_norm=clip, **kw,
        convert_on=convert_on, **ahead,
    )  # fmt: skip
    with testing.slow_copies(cycles=5_000_000):
        for step in range(4):
            micro = [tokens(10 * step + k) for k in range(2 if mode == "accumulate" else 1)]
            for k, x in enumerate(micro):
                loss, ref_loss = a.loss(x), ref.twin.loss(x)
                assert torch.equal(loss, ref_loss), step  # ahead: read while being stepped
                if k < len(micro) - 1:
                    with opt.accumulating():
                        loss.backward()
                else:
                    loss.backward()
                ref_loss.backward()
            opt.step()
            opt.zero_grad()
            ref.step()
            if mode != "ahead":  # ahead: parameters are read only by the forward
                for p, q in zip(a.parameters(), ref.twin.parameters(), strict=True):
                    assert torch.equal(p, q), step
    opt.synchronize()
    for p, q in zip(a.parameters(), ref.twin.parameters(), strict=True):
        assert torch.equal(p, q)
    mine, theirs = opt.state_dict()["state"], ref.opt.state_dict()["state"]
    for i in theirs:
        for k in theirs[i]:
            assert torch.equal(mine[i][k], theirs[i][k]), (i, k)


def test_no_host_sync_on_the_callers_thread_and_no_device_gradients_kept():
    base = torch.cuda.memory_allocated()
    a = gpt(torch.bfloat16)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-3, bucket_bytes=1 << 20)
    params = sum(p.numel() * p.element_size() for p in a.parameters())
    batches = [tokens(step) for step in range(4)]
    for step in range(4):
        if step > 0:  # the first step allocates the optimizer state
            torch.cuda.set_sync_debug_mode("error")
        try:
            a.loss(batches[step]).backward()
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert all(p.grad is None for p in a.parameters())
    # Only the parameters stay on the device: no gradients, no optimizer state.
    assert torch.cuda.memory_allocated() - base < params + (8 << 20)
    stats = opt.stats()
    # gradients down and new values up in fp32 (the copies convert): twice the bf16 bytes
    assert stats.steps == 4 and stats.d2h_bytes == stats.h2d_bytes == 4 * 2 * params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_fraction_bitwise_with_slowed_copies(dtype):
    """Half the state on the host, half on the GPU: the host part is bitwise the class on fp32
    host copies, the device part the class on fp32 device copies (fused AdamW on each)."""
    a = gpt(dtype)
    twin = copy.deepcopy(a)
    kw = dict(lr=1e-3, weight_decay=0.1, fused=True)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, bucket_bytes=1 << 20,
                                offload_fraction=0.5, **kw)  # fmt: skip
    kept = {id(p) for p in opt._device.params}
    pairs = list(zip(a.parameters(), twin.parameters(), strict=True))
    on_dev = [id(p) in kept for p, _ in pairs]
    assert any(on_dev) and not all(on_dev)
    masters = [q.detach().float().clone() if d else q.detach().float().cpu()
               for (_, q), d in zip(pairs, on_dev, strict=True)]  # fmt: skip
    refs = [torch.optim.AdamW([m for m, d in zip(masters, on_dev, strict=True) if d == side], **kw)
            for side in (True, False)]  # fmt: skip
    with testing.slow_copies(cycles=5_000_000):
        for step in range(4):
            x = tokens(step)
            loss, ref_loss = a.loss(x), twin.loss(x)
            assert torch.equal(loss, ref_loss), step
            loss.backward()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            for m, (_, q) in zip(masters, pairs, strict=True):
                m.grad = q.grad.float().to(m.device)
            for ref in refs:
                ref.step()
            twin.zero_grad()
            with torch.no_grad():
                for m, (_, q) in zip(masters, pairs, strict=True):
                    q.copy_(m)
            for p, q in pairs:
                assert torch.equal(p, q), step
    assert opt.stats().device_state_bytes > 0
    opt.remove()


# -- Issue 38 items 4-6 on the GPU ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["overlap", "ahead", "clip"])
def test_grad_scaler_with_fp16_autocast_bitwise_with_slowed_copies(mode):
    """Item 5: fp16 autocast with torch.amp.GradScaler("cuda"): scaler.step(opt) unscales the
    moved gradients on the host and skips the step with a non-finite one, bitwise the plain
    class on fp32 host copies under the same scaler (its scale follows the same path)."""
    a = gpt(torch.float32)
    twin = copy.deepcopy(a)
    kw = dict(lr=1e-3, weight_decay=0.1, fused=True)
    clip = dict(max_grad_norm=0.5) if mode == "clip" else {}
    ref = Reference(twin, torch.optim.AdamW, **clip, **kw)
    extra = dict(step_ahead=True, model=a) if mode == "ahead" else {}
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, bucket_bytes=1 << 20,
                                **clip, **extra, **kw)  # fmt: skip
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=2)
    holder = torch.optim.SGD(twin.parameters(), lr=0.0)  # what ref_scaler unscales
    skipped = []
    with testing.slow_copies(cycles=5_000_000):
        for step in range(5):
            x = tokens(step)
            poison = float("inf") if step == 2 else 1.0  # a non-finite gradient
            with torch.autocast("cuda", dtype=torch.float16):
                loss, ref_loss = a.loss(x) * poison, twin.loss(x) * poison
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            ref_scaler.scale(ref_loss).backward()
            ref_scaler.unscale_(holder)
            found = sum(v.item() for v in ref_scaler._found_inf_per_device(holder).values())
            skipped.append(bool(found))
            if found:
                twin.zero_grad()
            else:
                ref.step()
            ref_scaler.update()
            opt.synchronize()
            for p, q in zip(a.parameters(), twin.parameters(), strict=True):
                assert torch.equal(p, q), step
            assert scaler.get_scale() == ref_scaler.get_scale(), step
    assert skipped == [False, False, True, False, False]
    opt.remove()


def test_step_ahead_state_dict_right_after_step_has_the_new_values():
    """Item 6: the host step held (and the copies slowed) when step() returns; the model's
    state_dict, and a norm read for logging, are those of the stepped parameters."""
    a = gpt(torch.bfloat16)
    twin = copy.deepcopy(a)
    kw = dict(lr=1e-3, weight_decay=0.1, fused=True)
    ref = Reference(twin, torch.optim.AdamW, **kw)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, bucket_bytes=1 << 20,
                                step_ahead=True, model=a, **kw)  # fmt: skip
    with testing.slow_copies(cycles=5_000_000):
        for step in range(3):
            with testing.held_host_step(opt):
                a.loss(tokens(step)).backward()
                opt.step()
                opt.zero_grad()
                saved = {k: v.cpu() for k, v in a.state_dict().items()}
                norms = [p.float().norm().cpu() for p in a.parameters()]
            twin.loss(tokens(step)).backward()
            ref.step()
            for k, v in twin.state_dict().items():
                assert torch.equal(saved[k], v.cpu()), (step, k)
            for n, p in zip(norms, twin.parameters(), strict=True):
                assert torch.equal(n, p.float().norm().cpu()), step
    opt.remove()


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(256, 512)
        self.a = torch.nn.Linear(512, 64)
        self.b = torch.nn.Linear(512, 64)

    def forward(self, x, use_b):
        h = torch.nn.functional.gelu(self.body(x))
        return self.b(h) if use_b else self.a(h)


@pytest.mark.parametrize("ahead", [False, True], ids=["at-step", "ahead"])
def test_zero_grad_set_to_none_false_steps_unused_parameters_with_zeros(ahead):
    """Item 4: with zero_grad(set_to_none=False) a parameter unused in a step is stepped with
    its zero gradient (on the device: zeros, as torch.optim keeps them), bitwise."""
    a = Branchy().cuda()
    twin = copy.deepcopy(a)
    kw = dict(lr=1e-3, weight_decay=0.1)
    ref = Reference(twin, torch.optim.AdamW, **kw)
    extra = dict(step_ahead=True, model=a) if ahead else {}
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, bucket_bytes=1 << 16,
                                **extra, **kw)  # fmt: skip
    with testing.slow_copies(cycles=5_000_000):
        for step, use_b in enumerate([True, False, False, True]):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 256, generator=g).cuda()
            a(x, use_b).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            twin(x, use_b).square().mean().backward()
            for m, p in zip(ref.masters, twin.parameters(), strict=True):
                m.grad = None if p.grad is None else p.grad.float().cpu()
            ref.opt.step()
            twin.zero_grad(set_to_none=False)
            with torch.no_grad():
                for m, p in zip(ref.masters, twin.parameters(), strict=True):
                    p.copy_(m)
            opt.synchronize()
            for p, q in zip(a.parameters(), twin.parameters(), strict=True):
                assert torch.equal(p, q), step
                assert (p.grad is None) == (q.grad is None), step
                assert p.grad is None or torch.equal(p.grad, q.grad), step
    opt.remove()


@pytest.mark.parametrize("read", ["clip_grad_norm_", "second backward"])
def test_recalled_gradients_are_not_overwritten_by_kernels_still_queued(read):
    """Issue 40: gradients brought back to the device after they left (a read, a second
    backward: Note: [A second backward]) land in fresh blocks of the compute stream, whose
    queued kernels may still write them under their old owner: the copy back waits for the
    compute stream. Here the compute stream is held back by a sleep, then NaN fills of
    tensors of the gradients' sizes are queued and freed, right before the read."""
    a = gpt(torch.bfloat16)
    twin = copy.deepcopy(a)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-3,
                                bucket_bytes=1 << 20)  # fmt: skip
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    x = tokens(0)
    for step in range(2):
        a(x).float().square().mean().backward()
        twin(x).float().square().mean().backward()
        torch.cuda._sleep(200_000_000)  # about 0.1 s of compute-stream work
        junk = [torch.empty_like(p).fill_(float("nan")) for p in a.parameters()]
        del junk  # freed blocks, still to be written by the queued fills
        if read == "clip_grad_norm_":
            norm = torch.nn.utils.clip_grad_norm_(a.parameters(), 1e9)
            assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e9))
        else:
            a(x).float().square().mean().backward()
            twin(x).float().square().mean().backward()
        for p, q in zip(a.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), step
        opt.zero_grad()
        ref.zero_grad()
    assert opt._runtime.recalls.recalled > 0
    opt.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
def test_clip_grad_norm_on_the_model_is_the_plain_loop_bitwise(dtype, overlap):
    """Issue 40: `clip_grad_norm_(model.parameters())` between backward and `step()` reads the
    moved gradients on the device (Note: [Reading a moved gradient]): the norm and every step
    are the plain loop's, which clips the twin's device gradients, with clipping active in
    even steps and inactive in odd ones."""
    a = gpt(dtype)
    twin = copy.deepcopy(a)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-3, overlap=overlap,
                                bucket_bytes=1 << 20)  # fmt: skip
    ref = Reference(twin, torch.optim.AdamW, lr=1e-3)
    for step in range(4):
        x = tokens(step)
        a(x).float().square().mean().backward()
        twin(x).float().square().mean().backward()
        max_norm = 1e-3 if step % 2 == 0 else 1e9
        norm = torch.nn.utils.clip_grad_norm_(a.parameters(), max_norm)
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm))
        assert (float(norm) > max_norm) == (step % 2 == 0)
        opt.step()
        opt.zero_grad()
        ref.step()
        for p, q in zip(a.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), step
    opt.remove()


def test_accelerate_prepares_the_optimizer_with_no_master_on_the_device():
    """accelerate's AcceleratedOptimizer moves the optimizer's state dict to the device and
    loads it back as it wraps it (Trainer, ``accelerator.prepare``): before the first step no
    fp32 master goes there (Note: [A master that is its parameter's bits]); it put every one
    on the device at once, 4 bytes a parameter (here 2x the bf16 model's 32 MiB)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    model = model.to("cuda", torch.bfloat16)
    opt = to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        acc = accelerate.Accelerator()
        model, wrapped = acc.prepare(model, opt)
        torch.cuda.synchronize()
        grown = torch.cuda.max_memory_allocated() - before
        assert grown < 1 << 20, f"{grown / 2**20:.1f} MiB on the device while preparing"
        model(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        wrapped.step()
    finally:
        opt.remove()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
