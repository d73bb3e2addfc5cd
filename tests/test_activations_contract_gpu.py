"""The data-carrying rows of the activation contract on CUDA: deepcopy, dtype conversion,
torch.compile, state_dict, with offloading active and gradients bitwise."""

from __future__ import annotations

import copy

import pytest
import torch

from torchoffload import ActivationOffloadConfig, PinnedPool, apply_activation_offloading
from torchoffload.models import GPT, GPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CFG = GPTConfig(hidden=128, layers=4, heads=4, vocab=256, max_seq=65)


def make(dtype=torch.float32):
    torch.manual_seed(0)
    return GPT(CFG).to("cuda", dtype)


def data(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab, (4, 65), generator=g).cuda() for _ in range(n)]


def train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = []
    for tokens in batches:
        loss = model.loss(tokens)
        loss.backward()
        out.append(loss.detach())
        out.extend(p.grad.clone() for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def attach(model, min_bytes=0):
    return apply_activation_offloading(
        model,
        config=ActivationOffloadConfig(min_bytes=min_bytes),
        pool=PinnedPool(256 << 20, slab_bytes=16 << 20),
    )


def test_deepcopy_and_state_dict_on_cuda(gpu_deterministic):
    model = make()
    handle = attach(model)
    ema = copy.deepcopy(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    ref = train(make(), data())
    assert same(ref, train(ema, data()))
    assert handle.stats().offloaded_tensors == 0  # the copy did not drive the handle
    assert same(ref, train(model, data()))
    assert handle.stats().offloaded_tensors > 0
    fresh = make()
    fresh.load_state_dict(sd)
    assert same(train(make(), data(1)), train(fresh, data(1)))
    handle.remove()


def test_bf16_conversion_after_apply(gpu_deterministic):
    model = make()
    handle = attach(model)
    model.to(torch.bfloat16)
    assert same(train(make(torch.bfloat16), data()), train(model, data()))
    assert handle.stats().offloaded_bytes > 0
    handle.remove()


def test_torch_compile_with_a_handle(gpu_deterministic):
    """Against the same compiled program with a handle that offloads nothing (the hooks break
    the graph at the same places), bitwise; against the plain compiled model, reported."""
    torch._dynamo.reset()
    keep = make()
    h_keep = attach(keep, min_bytes=1 << 40)
    base = train(torch.compile(keep), data())
    assert h_keep.stats().offloaded_tensors == 0
    h_keep.remove()
    torch._dynamo.reset()
    model = make()
    handle = attach(model)
    got = train(torch.compile(model), data())
    assert handle.stats().offloaded_tensors > 0 and handle.stats().reloaded_tensors > 0
    assert same(base, got)
    handle.remove()
    torch._dynamo.reset()
    plain = train(torch.compile(make()), data())
    print(f"\ncompiled with handle vs plain compiled: bitwise {same(plain, got)}")
    torch._dynamo.reset()
