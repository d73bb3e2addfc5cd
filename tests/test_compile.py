"""The graph ops on CPU: opcheck, the transfer round trip and its bookkeeping, and that they
survive Inductor (called in the generated code) and torch.export."""

from __future__ import annotations

import pytest
import torch

import torchoffload.compile as toc

ops = torch.ops.torchoffload


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    host = ops.offload(x)
    ops.wait(host)
    y = ops.reload(host, x.device)
    ops.wait(y)
    return y


def test_opcheck(op_pool):
    x = torch.randn(4, 8)
    torch.library.opcheck(ops.offload, (x,))
    host = ops.offload(x)
    torch.library.opcheck(ops.wait, (host,))
    torch.library.opcheck(ops.reload, (host, torch.device("cpu")))
    y = ops.reload(host, torch.device("cpu"))
    torch.library.opcheck(ops.wait, (y,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_roundtrip_is_exact_and_returns_the_block(op_pool, dtype):
    x = (torch.randn(6, 10) * 100).to(dtype)
    strided = x.t()[2:5]  # a non-contiguous view: copied as its values, contiguous on the host
    for src in (x, strided):
        y = roundtrip(src)
        assert y.shape == src.shape and y.dtype == src.dtype and torch.equal(y, src)
    s = toc.op_stats()
    assert s.offloaded_tensors == s.reloaded_tensors == 2 and s.in_flight == 0
    assert s.offloaded_bytes == x.nbytes + strided.numel() * strided.element_size()
    assert op_pool.stats().used_bytes == 0  # every block went back


def test_empty_tensor_needs_no_block(op_pool):
    y = roundtrip(torch.empty(0, 3))
    assert y.shape == (0, 3) and op_pool.stats().used_bytes == 0


def test_reload_of_a_callers_tensor_and_twice(op_pool):
    mine = torch.randn(3)
    y = ops.reload(mine, torch.device("cpu"))  # not from offload: a plain copy
    ops.wait(y)
    assert torch.equal(y, mine) and y.data_ptr() != mine.data_ptr()
    host = ops.offload(torch.randn(3))
    ops.wait(ops.reload(host, torch.device("cpu")))
    with pytest.raises(RuntimeError, match="reloaded once"):
        ops.reload(host, torch.device("cpu"))  # its block may hold someone else's bytes now


def test_reload_after_the_block_was_handed_out_again_is_refused(op_pool):
    # A second backward (retain_graph=True) after another forward: the first forward's host
    # tensor reaches reload again, after its block went back to the pool and the new forward's
    # offload took the same bytes. It must not be served the new forward's values.
    first = torch.randn(64, 64)
    host = ops.offload(first)
    ops.wait(host)
    ops.wait(ops.reload(host, torch.device("cpu")))
    second = ops.offload(torch.randn(64, 64))  # the same pool bytes
    assert second.data_ptr() == host.data_ptr()
    with pytest.raises(RuntimeError, match="reloaded once"):
        ops.reload(host, torch.device("cpu"))
    y = ops.reload(second, torch.device("cpu"))  # the new one is unaffected
    ops.wait(y)
    ops.wait(second)


def test_a_second_compiled_backward_after_another_forward_is_never_served_its_bytes(op_pool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 16)
    cfg = toc.ActivationPassConfig(min_bytes=0, skip_last_layers=0)
    compiled = torch.compile(model, backend=toc.backend(cfg))
    from torch._functorch import config as functorch_config

    with functorch_config.patch(donated_buffer=False):  # what torch asks for retain_graph
        loss = compiled(x).pow(2).sum()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        other = compiled(x * 3).sum()  # offloads into the blocks the first backward gave back
        assert toc.op_stats().in_flight > 0
        try:
            loss.backward()
        except RuntimeError as e:  # a clear error is fine; another forward's bytes are not
            assert "reloaded once" in str(e)
        else:
            assert all(
                torch.equal(p.grad, g) for p, g in zip(model.parameters(), first, strict=True)
            )
        del other
        toc.discard_in_flight()


def f(x, w):
    a = torch.relu(x @ w)
    host = ops.offload(a)
    b = (a * 2).sum(dim=1, keepdim=True)
    ops.wait(host)
    y = ops.reload(host, x.device)
    ops.wait(y)
    return y * b


def f_plain(x, w):
    a = torch.relu(x @ w)
    b = (a * 2).sum(dim=1, keepdim=True)
    return a * b


def test_ops_survive_inductor(op_pool):
    """Inductor keeps all three ops, `wait` included (it returns nothing), and the result is
    the compiled result without them, bit for bit."""
    from torch._inductor.utils import run_and_get_code

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    torch._dynamo.reset()
    eager = torch.compile(f_plain, backend="inductor", fullgraph=True)(x, w)
    out, codes = run_and_get_code(torch.compile(f, backend="inductor", fullgraph=True), x, w)
    code = "\n".join(codes)
    for name in ("offload", "reload", "wait"):
        assert f"torchoffload.{name}" in code, name
    assert code.count("torchoffload.wait") >= 2
    assert torch.equal(out, eager)
    assert toc.op_stats().in_flight == 0


def test_ops_survive_export(op_pool):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return f(x, self.w)

    m = M()
    x = torch.randn(8, 16)
    ep = torch.export.export(m, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("torchoffload.offload" in t for t in targets)
    assert any("torchoffload.reload" in t for t in targets)
    assert any("wait" in t for t in targets)
    assert torch.equal(ep.module()(x), m(x))
