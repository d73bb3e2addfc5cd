"""stream_parameters on a GPU: training with parameters streamed from the host store (and
stepped there by the OffloadedOptimizer) is bitwise the same training with them resident, with
the copy streams slowed; the device holds at most the budget of parameters; no host sync on the
training thread in steady state."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import torchoffload as to
from torchoffload import testing
from torchoffload.models import GPT, GPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]

CFG = GPTConfig(hidden=256, layers=6, heads=4, vocab=1024, max_seq=128)


def tokens(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, CFG.vocab, (4, 128), generator=g).cuda()


def gpt():
    torch.manual_seed(0)
    return GPT(CFG).to("cuda", torch.bfloat16)


def loss_of(m, x, checkpointed):
    if not checkpointed:
        return m.loss(x)
    pos = torch.arange(x.shape[1] - 1, device=x.device)
    h = m.tok(x[:, :-1]) + m.pos(pos)
    for layer in m.layers:
        h = ckpt.checkpoint(layer, h, use_reentrant=False)
    logits = m.head(m.ln_f(h))
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def block_bytes(m):
    return sum(p.numel() * p.element_size() for p in m.layers[0].parameters())


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_bitwise_resident_training_with_slowed_copies(checkpointed):
    ref = gpt()
    m = copy.deepcopy(ref)
    kw = dict(lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = to.OffloadedOptimizer(ref.parameters(), torch.optim.AdamW, bucket_bytes=1 << 20, **kw)
    tied = m.tok.weight.numel() * m.tok.weight.element_size()
    budget = tied + 3 * block_bytes(m)
    handle = to.stream_parameters(m, budget)
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, bucket_bytes=1 << 20, **kw)
    with testing.slow_copies(cycles=5_000_000):
        for step in range(4):
            x = tokens(step)
            loss = loss_of(m, x, checkpointed)
            ref_loss = loss_of(ref, x, checkpointed)
            assert torch.equal(loss, ref_loss), step
            loss.backward()
            ref_loss.backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    got, want = m.state_dict(), ref.state_dict()
    for k in want:
        assert torch.equal(got[k].cpu(), want[k].cpu()), k
    stats = handle.stats()
    assert stats.peak_loaded_bytes <= budget and stats.over_budget == 0, stats
    assert stats.prefetched > 0 and stats.backward_passes == 4
    opt.remove()
    ref_opt.remove()
    handle.remove()
    for (k, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), k


def test_device_memory_and_no_host_sync_in_steady_state():
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # what earlier tests of this process left
    m = gpt()
    tied = m.tok.weight.numel() * m.tok.weight.element_size()
    budget = tied + 2 * block_bytes(m)
    handle = to.stream_parameters(m, budget)
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-3, bucket_bytes=1 << 20)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == 0  # the streamed parameters left
    batches = [tokens(step) for step in range(4)]
    for step in range(4):
        if step == 1:
            torch.cuda.reset_peak_memory_stats()
        if step > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            m.loss(batches[step]).backward()
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    stats = handle.stats()
    assert stats.peak_loaded_bytes <= budget and stats.over_budget == 0, stats
    assert handle._runtime.loaded_bytes == 0  # nothing loaded between steps
    opt.remove()
    handle.remove()
