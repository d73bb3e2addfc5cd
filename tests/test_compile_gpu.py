"""The graph ops on the GPU: the stream protocol under a delayed copy stream (a race would show
as wrong bytes), memory actually released, and the ops in Inductor's CUDA code."""

from __future__ import annotations

import pytest
import torch
from test_compile import f, f_plain

import torchoffload
import torchoffload.compile as toc
from torchoffload._transfer import copy_engine

ops = torch.ops.torchoffload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def pool():
    p = torchoffload.PinnedPool(2 << 30, slab_bytes=256 << 20)
    toc.set_op_pool(p)
    toc.reset_op_stats()
    yield p
    toc.discard_in_flight()
    toc.set_op_pool(None)
    torch.cuda.synchronize()
    p.release()


def test_roundtrip_with_a_slow_copy_stream(pool):
    """The copy stream spins before every copy: a source block reused before its copy read
    it, or a use before the reload landed, would change the bytes."""
    engine = copy_engine(torch.device("cuda", torch.cuda.current_device()))
    engine.debug_delay_cycles = 50_000_000
    try:
        xs = [torch.randn(1024, 1024, device="cuda") for _ in range(4)]
        want = [x.clone() for x in xs]
        hosts = [ops.offload(x) for x in xs]
        del xs  # the graph drops the sources right after offloading them
        for h in hosts:
            ops.wait(h)  # their blocks may be reused now, in stream order after the copies
        junk = [torch.full((1024, 1024), -1.0, device="cuda") for _ in range(4)]
        ys = [ops.reload(h, junk[0].device) for h in hosts]
        for y in ys:
            ops.wait(y)
        got = [y.clone() for y in ys]  # a use right after the wait
        del junk
    finally:
        engine.debug_delay_cycles = 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    torch.cuda.synchronize()
    assert toc.op_stats().in_flight == 0 and pool.stats().used_bytes == 0


def test_offload_and_wait_release_device_memory(pool):
    x = torch.randn(64 << 20, device="cuda")  # 256 MiB
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    host = ops.offload(x)
    del x
    ops.wait(host)  # the source's block may be reused once the copy is done
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before - (256 << 20)
    y = ops.reload(host, torch.device("cuda"))
    ops.wait(y)
    assert y.shape == (64 << 20,)


def test_ops_in_inductor_cuda_code(pool):
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(256, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda")
    torch._dynamo.reset()
    plain = torch.compile(f_plain, fullgraph=True)(x, w)
    out, codes = run_and_get_code(torch.compile(f, fullgraph=True), x, w)
    code = "\n".join(codes)
    for name in ("offload", "reload", "wait"):
        assert f"torchoffload.{name}" in code, name
    assert torch.equal(out, plain)
    torch.cuda.synchronize()
    assert toc.op_stats().offloaded_bytes == 256 * 512 * 4
