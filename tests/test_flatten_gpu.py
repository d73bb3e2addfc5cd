"""GPU tests for composite tensors (subclasses, registry, DTensor): ``pytest -m gpu``."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from test_flatten import Capture, MoEModel, buffers_of, same_tensor, train

from torchoffload import (
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    offload_activations,
)
from torchoffload.testing import GroupedTensor, TwoBufferTensor, quantize_int8, quantized_matmul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]


def roundtrip_cuda(t, pool, min_bytes=0):
    Capture.seen = []
    dummy = torch.zeros(1, device="cuda", requires_grad=True)
    with offload_activations(min_bytes=min_bytes, pool=pool) as ctx:
        out = Capture.apply(dummy, t)
    out.sum().backward()
    torch.cuda.synchronize()
    return Capture.seen[0], ctx.stats()


@pytest.mark.parametrize(
    "make",
    [
        lambda: TwoBufferTensor(
            torch.randn(64, 32, device="cuda").t(), torch.randn(64, 32).cuda().t()
        ),
        lambda: quantize_int8(torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)),
        lambda: GroupedTensor(
            [torch.randn(n, 64, device="cuda") for n in (1, 100, 300)], torch.rand(3).cuda()
        ),
        lambda: TwoBufferTensor(
            TwoBufferTensor(torch.randn(32, 32).cuda(), torch.randn(32, 32).cuda()),
            TwoBufferTensor(torch.randn(32, 32).cuda(), torch.randn(32, 32).cuda()),
        ),
    ],
    ids=["two_buffer", "quantized", "grouped", "nested"],
)
def test_round_trip_on_cuda(make, gpu_pool):
    t = make()
    restored, s = roundtrip_cuda(t, gpu_pool, min_bytes=1024)
    assert type(restored) is type(t) and restored.shape == t.shape
    assert restored.stride() == t.stride() and restored.dtype == t.dtype

    def leaves(x):
        if type(x) in (torch.Tensor,):
            return [x]
        return [leaf for b in buffers_of(x) for leaf in leaves(b)]

    for x, y in zip(leaves(restored), leaves(t), strict=True):
        assert same_tensor(x, y) and x.device == y.device
        moved = x.data_ptr() != y.data_ptr()
        assert moved == (y.untyped_storage().nbytes() >= 1024), (x.shape, moved)
    assert s.offloaded_bytes > 0


@pytest.mark.parametrize("mode", ["context", "layers"])
def test_bitwise_training_parity_on_cuda(mode, gpu_pool):
    torch.manual_seed(0)
    model = MoEModel().cuda()
    ref = train_cuda(copy.deepcopy(model))
    m = copy.deepcopy(model)
    if mode == "context":
        got = train_cuda(m, lambda: offload_activations(min_bytes=256, pool=gpu_pool))
    else:
        handle = apply_activation_offloading(
            m, config=ActivationOffloadConfig(min_bytes=256), pool=gpu_pool
        )
        got = train_cuda(m)
        assert handle.stats().composite_tensors > 0 and handle.stats().prefetch_misses == 0
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


def train_cuda(model, factory=None):
    out = train(model, 3, factory)
    torch.cuda.synchronize()
    return out


def test_inner_buffers_leave_the_device(gpu_pool):
    torch.manual_seed(0)
    weights = [
        (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.01).requires_grad_()
        for _ in range(8)
    ]  # leaves that require grad, like parameters: kept, not offloaded
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def forward():
        h = x
        for w in weights:
            h = quantized_matmul(h, w)  # saves only the int8 form of h (and w, which is kept)
        return h

    def after_forward(ctx):
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if ctx is None:
            out = forward()
        else:
            with ctx:
                out = forward()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.float().sum().backward()
        x.grad = None
        for w in weights:
            w.grad = None
        return held

    after_forward(offload_activations(min_bytes=1 << 20, pool=gpu_pool))  # warm-up
    base = after_forward(None)
    ctx = offload_activations(min_bytes=1 << 20, pool=gpu_pool, max_inflight_bytes=0)
    off = after_forward(ctx)
    s = ctx.stats()
    qdata = 8 * 8192 * 4096  # int8 bytes
    mib = 1 << 20
    print(
        f"held after forward: {base / mib:.1f} MiB without, {off / mib:.1f} MiB with offloading;"
        f" offloaded {s.offloaded_bytes / mib:.1f} MiB; int8 data {qdata / mib:.1f} MiB"
    )
    assert s.offloaded_bytes == qdata and s.composite_tensors == 8
    assert s.skip_reasons.get("small", 0) == 8  # the float32 scales stay on the device
    assert s.skip_reasons.get("leaf", 0) == 8  # and so do the weights
    assert base - off >= qdata


def test_dtensor_on_cuda():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        x = distribute_tensor(torch.randn(256, 64, device="cuda"), mesh, [Shard(0)])
        x.requires_grad_()
        with offload_activations(min_bytes=0, pool=PinnedPool(1 << 24)) as ctx:
            y = (x * 2).sin()
        saved = y.grad_fn._saved_self
        assert type(saved) is DTensor and saved.placements == (Shard(0),)
        assert saved.to_local().is_cuda and torch.equal(saved.to_local(), (x * 2).to_local())
        y.sum().backward()
        assert torch.equal(x.grad.to_local(), torch.cos(x.to_local().detach() * 2) * 2)
        assert ctx.stats().offloaded_bytes == 256 * 64 * 4
    finally:
        dist.destroy_process_group()
