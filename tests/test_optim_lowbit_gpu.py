"""Low-precision host state on a GPU: `OffloadedOptimizer` with bf16 masters and `AdamW8bit`
is bitwise the class on bf16 host copies with the copy streams slowed (bf16 gradients down and
bf16 values up, nothing converted)."""

from __future__ import annotations

import copy

import pytest
import torch

import torchoffload as to
from torchoffload import testing
from torchoffload.models import GPT, GPTConfig
from torchoffload.optim import AdamW8bit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]

CFG = GPTConfig(hidden=256, layers=4, heads=4, vocab=1024, max_seq=128)


def tokens(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, CFG.vocab, (4, 128), generator=g).cuda()


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_bf16_masters_bitwise_with_slowed_copies(rounding, clip):
    torch.manual_seed(0)
    a = GPT(CFG).to("cuda", torch.bfloat16)
    twin = copy.deepcopy(a)
    masters = [p.detach().cpu().requires_grad_() for p in twin.parameters()]
    kw = dict(lr=1e-3, weight_decay=0.1, bf16_rounding=rounding)
    ref = AdamW8bit(masters, **kw)
    opt = to.OffloadedOptimizer(a.parameters(), AdamW8bit, bucket_bytes=1 << 20,
                                master_dtype=torch.bfloat16, max_grad_norm=clip, model=a,
                                **kw)  # fmt: skip
    params = sum(p.numel() * p.element_size() for p in a.parameters())
    with testing.slow_copies(cycles=5_000_000):
        for step in range(4):
            x = tokens(step)
            a.loss(x).backward()
            opt.step()
            opt.zero_grad()
            twin.loss(x).backward()
            for m, p in zip(masters, twin.parameters(), strict=True):
                m.grad = p.grad.cpu()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(masters, clip)
            ref.step()
            twin.zero_grad()
            with torch.no_grad():
                for m, p in zip(masters, twin.parameters(), strict=True):
                    p.copy_(m)
            for p, q in zip(a.parameters(), twin.parameters(), strict=True):
                assert torch.equal(p, q), step
    stats = opt.stats()
    assert stats.d2h_bytes == stats.h2d_bytes == 4 * params  # bf16 both ways
    opt.remove()


def test_the_classes_step_cuda_tensors_without_a_host_sync():
    g = torch.Generator().manual_seed(0)
    params = [(torch.randn(n, generator=g) * 0.02).to("cuda", torch.bfloat16).requires_grad_()
              for n in (5000, 300)]  # fmt: skip
    start = [p.detach().clone() for p in params]
    opt = AdamW8bit(params, lr=1e-3)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        if step > 0:  # the first step builds the tables and the state
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert "exp_avg_codes" in opt.state[params[0]] and "exp_avg" in opt.state[params[1]]
    for p, s in zip(params, start, strict=True):
        assert bool(p.isfinite().all()) and not torch.equal(p, s)
