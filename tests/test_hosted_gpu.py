"""Hosted tensors on a GPU (Note: [Placeholders never answer]): a placeholder's reads run on a
device copy of the real values, so they are bitwise the resident tensor's on the device;
writes reach the host store through the pinned copy; a read inside a capture is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchoffload as to
from torchoffload._hosted import HostedError, is_placeholder
from torchoffload.models import GPT, GPTConfig

pytestmark = pytest.mark.gpu
CFG = GPTConfig(hidden=64, layers=3, heads=4, vocab=128, max_seq=32)


def gpt():
    torch.manual_seed(0)
    return GPT(CFG).cuda()


def tokens(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, CFG.vocab, (2, 16), generator=g).cuda()


@pytest.mark.parametrize("engine", ["weights", "parameters"])
def test_reads_and_writes_outside_the_unit_on_the_gpu(engine):
    ref = gpt()
    model = copy.deepcopy(ref)
    if engine == "weights":
        model.eval()
        ref.eval()
        handle = to.stream_weights(model, budget_bytes=to.minimum_budget(model))
        with torch.no_grad():
            model(tokens(0))
    else:
        handle = to.stream_parameters(model, 8 << 20)
        model.loss(tokens(0)).backward()
        ref.loss(tokens(0)).backward()
    w, v = model.layers[1].fc1.weight, ref.layers[1].fc1.weight
    assert is_placeholder(w) and w.device == v.device and w.untyped_storage().nbytes() == 0
    with torch.no_grad():
        assert torch.equal(w.norm(), v.norm())  # the device kernel, on the real values
        assert torch.equal(w @ v.t(), v @ v.t())
        for p in (w, v):
            p.mul_(0.5)
            p.t()[0].copy_(torch.arange(p.shape[0], device="cuda", dtype=p.dtype))
    assert torch.equal(w.detach().cpu(), v.detach().cpu())
    with pytest.raises(HostedError, match="Nothing was converted"):
        model.half()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    if engine == "weights":
        with torch.no_grad():
            assert torch.equal(model(tokens(1)), ref(tokens(1)))
    handle.remove()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q) and type(p) is nn.Parameter


def test_a_read_inside_a_capture_is_refused():
    model = gpt().eval()
    handle = to.stream_weights(model, budget_bytes=to.minimum_budget(model))
    w = model.layers[0].fc1.weight
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with (
        torch.cuda.stream(stream),
        pytest.raises(HostedError, match="CUDA-graph capture"),
        torch.cuda.graph(graph, stream=stream),
    ):
        w.sum()
    handle.remove()
