from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import torchoffload
from torchoffload import (
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    offload_activations,
    register_flattener,
    unregister_flattener,
)
from torchoffload.testing import (
    GroupedTensor,
    QuantizedTensor,
    TwoBufferTensor,
    grouped_matmul,
    quantize_int8,
    quantized_matmul,
)


def pool():
    return PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=False)


class Capture(torch.autograd.Function):
    """Saves ``t`` for backward; backward hands what it got back to the test."""

    seen: list = []

    @staticmethod
    def forward(ctx, dummy, t):
        ctx.save_for_backward(t)
        return dummy.clone()

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        Capture.seen.append(t)
        return grad, None


def roundtrip(t, min_bytes=0):
    Capture.seen = []
    dummy = torch.zeros(1, requires_grad=True)
    with offload_activations(min_bytes=min_bytes, pool=pool(), device="cpu") as ctx:
        out = Capture.apply(dummy, t)
    out.sum().backward()
    (restored,) = Capture.seen
    return restored, ctx.stats()


def buffers_of(t):
    if isinstance(t, GroupedTensor):
        return [*t.buffers, t.scales]
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


def same_tensor(a, b):
    return (
        type(a) is type(b)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and torch.equal(a, b)
    )


# -- round trips ----------------------------------------------------------------------------------


def test_two_buffer_tensor_round_trips_with_outer_size_and_stride():
    a, b = torch.randn(32, 16), torch.randn(32, 16)
    t = TwoBufferTensor(a.t(), b.t())  # non-contiguous outer and inner strides
    restored, s = roundtrip(t)
    assert type(restored) is TwoBufferTensor
    assert restored.shape == t.shape and restored.stride() == t.stride()
    assert same_tensor(restored.a, t.a) and same_tensor(restored.b, t.b)
    assert restored.a.data_ptr() != a.data_ptr()  # came back from the host
    assert s.composite_tensors == 1 and s.offloaded_bytes == 2 * 32 * 16 * 4


def test_quantized_tensor_keeps_tiny_scale_resident_and_offloads_data():
    q = quantize_int8(torch.randn(256, 64))
    restored, s = roundtrip(q, min_bytes=4096)
    assert type(restored) is QuantizedTensor and restored.dtype == torch.float32
    assert same_tensor(restored.qdata, q.qdata) and same_tensor(restored.scale, q.scale)
    assert restored.qdata.data_ptr() != q.qdata.data_ptr()  # offloaded (16 KiB)
    assert restored.scale.data_ptr() == q.scale.data_ptr()  # resident (1 KiB < min_bytes)
    assert s.offloaded_bytes == 256 * 64 and s.skip_reasons == {"small": 1}


def test_grouped_tensor_from_the_registry_round_trips():
    bufs = [torch.randn(n, 8) for n in (3, 17, 40)]  # 96, 544 and 1280 bytes
    g = GroupedTensor(bufs, torch.rand(3))  # scales: 12 bytes
    restored, s = roundtrip(g, min_bytes=128)
    assert type(restored) is GroupedTensor and restored.shape == g.shape
    for x, y in zip(buffers_of(restored), buffers_of(g), strict=True):
        assert same_tensor(x, y)
    moved = [x.data_ptr() != y.data_ptr() for x, y in zip(restored.buffers, bufs, strict=True)]
    assert moved == [False, True, True]  # the decision is per buffer
    assert restored.scales.data_ptr() == g.scales.data_ptr()
    assert s.offloaded_bytes == (17 + 40) * 8 * 4 and s.skip_reasons == {"small": 2}


def test_nothing_offloaded_still_rebuilds():
    calls = []

    class Counted(GroupedTensor):
        pass

    register_flattener(
        Counted,
        flatten=lambda t: ([*t.buffers, t.scales], len(t.buffers)),
        unflatten=lambda b, n: (calls.append(n), Counted(b[:n], b[n]))[1],
    )
    try:
        g = Counted([torch.randn(4, 4)], torch.rand(1))
        restored, s = roundtrip(g, min_bytes=1 << 30)
    finally:
        unregister_flattener(Counted)
    assert calls == [1] and restored is not g and type(restored) is Counted
    assert restored.buffers[0].data_ptr() == g.buffers[0].data_ptr()
    assert s.offloaded_bytes == 0 and s.skip_reasons == {"small": 2}


def test_nested_subclass():
    inner1 = TwoBufferTensor(torch.randn(8, 8), torch.randn(8, 8))
    inner2 = TwoBufferTensor(torch.randn(8, 8), torch.randn(8, 8))
    t = TwoBufferTensor(inner1, inner2)
    restored, s = roundtrip(t)
    assert type(restored) is TwoBufferTensor and type(restored.a) is TwoBufferTensor
    for x, y in ((restored.a.a, inner1.a), (restored.b.b, inner2.b)):
        assert same_tensor(x, y) and x.data_ptr() != y.data_ptr()
    assert s.composite_tensors == 3 and s.offloaded_bytes == 4 * 8 * 8 * 4


def test_registry_takes_precedence_and_unregister_restores():
    used = []
    register_flattener(
        TwoBufferTensor,
        flatten=lambda t: (used.append("flatten") or [t.a, t.b], None),
        unflatten=lambda b, _: TwoBufferTensor(b[0], b[1]),
    )
    try:
        roundtrip(TwoBufferTensor(torch.randn(4), torch.randn(4)))
    finally:
        unregister_flattener(TwoBufferTensor)
    assert used == ["flatten"]
    used.clear()
    roundtrip(TwoBufferTensor(torch.randn(4), torch.randn(4)))
    assert used == []


@pytest.mark.parametrize(
    "cls, kwargs, exc",
    [
        (int, {}, TypeError),
        (torch.Tensor, {}, ValueError),
        (nn.Parameter, {}, ValueError),
        (GroupedTensor, {"flatten": 1}, TypeError),
    ],
)
def test_register_flattener_rejects_bad_input(cls, kwargs, exc):
    args = {"flatten": lambda t: ([], None), "unflatten": lambda b, c: None, **kwargs}
    with pytest.raises(exc):
        register_flattener(cls, **args)


class BrokenFlatten(TwoBufferTensor):
    def __tensor_flatten__(self):
        raise RuntimeError("no can do")


class BrokenUnflatten(TwoBufferTensor):
    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        raise RuntimeError("lost the recipe")


class MissingBuffer(TwoBufferTensor):
    def __tensor_flatten__(self):
        return ["a", "c"], None


@pytest.mark.parametrize(
    "cls, match",
    [
        (BrokenFlatten, "could not flatten a BrokenFlatten: RuntimeError: no can do"),
        (BrokenUnflatten, "could not rebuild a BrokenUnflatten"),
        (MissingBuffer, "could not flatten a MissingBuffer: AttributeError"),
    ],
)
def test_broken_subclass_errors_name_the_type(cls, match):
    t = cls(torch.randn(4), torch.randn(4))
    with pytest.raises(TypeError, match=match):
        roundtrip(t)


def test_parameters_that_are_subclasses_are_kept_whole():
    p = nn.Parameter(TwoBufferTensor(torch.randn(16), torch.randn(16)))
    x = torch.randn(16, requires_grad=True)
    with offload_activations(min_bytes=0, pool=pool(), device="cpu") as ctx:
        y = (x * p).sum()
    y.backward()
    s = ctx.stats()
    assert s.composite_tensors == 0 and s.skip_reasons.get("parameter", 0) >= 1


def test_no_offload_keeps_a_composite_whole():
    t = TwoBufferTensor(torch.randn(64), torch.randn(64))
    Capture.seen = []
    dummy = torch.zeros(1, requires_grad=True)
    ctx = offload_activations(min_bytes=0, pool=pool(), device="cpu")
    with ctx, torchoffload.no_offload():
        out = Capture.apply(dummy, t)
    out.sum().backward()
    assert ctx.stats().composite_tensors == 0 and Capture.seen[0].a.data_ptr() == t.a.data_ptr()


@pytest.mark.parametrize("write", ["whole", "view"])
def test_composite_written_in_place_after_its_save_raises_the_version_error(write):
    # A wrapper subclass's in-place op bumps only the outer version counter (its
    # __torch_dispatch__ runs below autograd, so the buffers keep theirs); the offloaded
    # buffers' copies were served silently, where plain PyTorch raises.
    def run(ctx):
        t = TwoBufferTensor(torch.randn(64), torch.randn(64))
        dummy = torch.zeros(1, requires_grad=True)
        with ctx:
            out = Capture.apply(dummy, t)
        if write == "whole":
            t.add_(1)
        else:
            t[8:].mul_(2)
        assert t.a._version == t.b._version == 0
        out.sum().backward()

    match = "modified by an inplace operation"
    with pytest.raises(RuntimeError, match=match):
        run(contextlib.nullcontext())  # plain PyTorch
    ctx = offload_activations(min_bytes=0, pool=pool(), device="cpu")
    with pytest.raises(RuntimeError, match=match):
        run(ctx)
    assert ctx.stats().offloaded_tensors == 2


# -- DTensor ---------------------------------------------------------------------------------------


@pytest.fixture
def gloo_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_offloads_its_local_shard_and_keeps_placements(gloo_mesh):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    x = distribute_tensor(torch.randn(64, 32), gloo_mesh, [Shard(0)]).requires_grad_()
    with offload_activations(min_bytes=0, pool=pool(), device="cpu") as ctx:
        y = (x * 2).sin()
    saved = y.grad_fn._saved_self  # unpacks through torchoffload
    assert type(saved) is DTensor and saved.placements == (Shard(0),)
    assert saved.device_mesh == gloo_mesh
    assert torch.equal(saved.to_local(), (x * 2).to_local())
    y.sum().backward()
    ref = torch.cos(x.to_local().detach() * 2) * 2
    assert torch.equal(x.grad.to_local(), ref)
    s = ctx.stats()
    assert s.composite_tensors >= 1
    assert s.offloaded_bytes == 64 * 32 * 4  # the local shard only, once


# -- training parity with quantized and grouped activations ---------------------------------------


class MoEBlock(nn.Module):
    def __init__(self, dim=32, experts=3):
        super().__init__()
        self.up = nn.Parameter(torch.randn(dim, 2 * dim) / dim**0.5)
        self.experts = nn.ParameterList(
            nn.Parameter(torch.randn(2 * dim, dim) / dim**0.5) for _ in range(experts)
        )

    def forward(self, x):
        h = torch.tanh(quantized_matmul(x, self.up))
        return x + grouped_matmul(h, list(self.experts), [10, 25, x.shape[0] - 35])


class MoEModel(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def train(model, steps, offload=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    out = []
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g).to(device)
        if offload is not None:
            with offload():
                loss = model(x)
        else:
            loss = model(x)
        loss.backward()
        out += [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("mode", ["context", "layers"])
def test_bitwise_training_parity_with_quantized_and_grouped_activations(mode):
    torch.manual_seed(0)
    model = MoEModel()
    import copy

    ref = train(copy.deepcopy(model), 3)
    m = copy.deepcopy(model)
    p = pool()
    if mode == "context":
        ctxs = []

        def factory():
            ctxs.append(offload_activations(min_bytes=256, pool=p, device="cpu"))
            return ctxs[-1]

        got = train(m, 3, factory)
        s = ctxs[-1].stats()
    else:
        handle = apply_activation_offloading(
            m, config=ActivationOffloadConfig(min_bytes=256), pool=p, device="cpu"
        )
        got = train(m, 3)
        s = handle.stats()
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert s.composite_tensors > 0 and s.offloaded_bytes > 0
    assert p.stats().used_bytes == 0


def test_torchao_tensors_round_trip():
    torchao = pytest.importorskip("torchao")  # optional extra; absent in CI and on the GPU box
    from torchao.dtypes.nf4tensor import to_nf4

    t = to_nf4(torch.randn(64, 64, dtype=torch.bfloat16))
    restored, s = roundtrip(t)
    assert type(restored) is type(t) and torch.equal(
        restored.to(torch.bfloat16), t.to(torch.bfloat16)
    )
    assert s.composite_tensors >= 1, torchao.__version__
