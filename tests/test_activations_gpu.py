"""GPU tests for offload_activations: run on the GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchoffload import offload_activations, testing
from torchoffload.models import GPT, BlockStack, GPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]

CFG = GPTConfig(hidden=256, layers=4, heads=4, vocab=512, max_seq=257)


def make(dtype):
    torch.manual_seed(0)
    return GPT(CFG).to("cuda", dtype)


def data(steps=5, batch=8, seq=256):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab, (batch, seq + 1), generator=g).cuda() for _ in range(steps)]


def train(model, batches, factory=None, hooks=()):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    handles = [h(model) for h in hooks]
    out = []
    for tokens in batches:
        ctx = factory() if factory else None
        if ctx is not None:
            with ctx:
                loss = model.loss(tokens)
        else:
            loss = model.loss(tokens)
        loss.backward()
        out.append(loss.detach().clone())
        out.extend(p.grad.clone() for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    for hs in handles:
        for h in hs:
            h.remove()
    torch.cuda.synchronize()
    return out + [p.detach().clone() for p in model.parameters()]


def assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_streams", [True, False])
def test_parity_over_steps(dtype, use_streams, gpu_pool):
    model = make(dtype)
    batches = data()
    ref = train(copy.deepcopy(model), batches)
    ctxs = []

    def factory():
        ctxs.append(offload_activations(min_bytes=0, pool=gpu_pool, use_streams=use_streams))
        return ctxs[-1]

    got = train(copy.deepcopy(model), batches, factory)
    assert_equal(ref, got)
    s = ctxs[-1].stats()
    assert s.offloaded_bytes > 0 and s.prefetch_hits > 0
    assert gpu_pool.stats().slabs == ctxs[0].stats().pool.slabs  # gpu_pool reused, not grown


def test_parity_mixed_dtypes_under_autocast(gpu_pool):
    model = make(torch.float32)
    batches = data(steps=3)

    class Autocast:
        def __init__(self, inner=None):
            self.inner = inner
            self.ac = torch.autocast("cuda", dtype=torch.bfloat16)

        def __enter__(self):
            self.ac.__enter__()
            if self.inner:
                self.inner.__enter__()

        def __exit__(self, *exc):
            if self.inner:
                self.inner.__exit__(*exc)
            self.ac.__exit__(*exc)

    ref = train(copy.deepcopy(model), batches, lambda: Autocast())
    got = train(
        copy.deepcopy(model),
        batches,
        lambda: Autocast(offload_activations(min_bytes=0, pool=gpu_pool)),
    )
    assert_equal(ref, got)


def _slow_compute_hooks(model, cycles=200_000):
    """Spin the compute stream before every Linear, forward and backward."""
    hs = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            hs.append(m.register_forward_pre_hook(lambda *_: torch.cuda._sleep(cycles)))
            hs.append(m.register_full_backward_pre_hook(lambda *_: torch.cuda._sleep(cycles)))
    return hs


@pytest.mark.parametrize("slow", ["copies", "compute", "both"])
def test_race_slowed_streams_still_bitwise(slow, gpu_pool):
    """Slow the copy streams (a missing wait on "stored"/"ready" reads garbage) or the compute
    stream (a copy that does not wait on its producer, or a reload into a block still in use,
    reads or clobbers live data). Five steps of gpu_pool reuse must stay bitwise exact."""
    model = make(torch.float32)
    batches = data(steps=5)
    ref = train(copy.deepcopy(model), batches)
    hooks = (_slow_compute_hooks,) if slow in ("compute", "both") else ()
    with testing.slow_copies(cycles=2_000_000 if slow in ("copies", "both") else 0):
        got = train(
            copy.deepcopy(model),
            batches,
            lambda: offload_activations(min_bytes=0, pool=gpu_pool),
            hooks=hooks,
        )
    assert_equal(ref, got)


def test_forward_on_a_side_stream(gpu_pool):
    model = make(torch.float32)
    batches = data(steps=2)
    ref = train(copy.deepcopy(model), batches)
    side = torch.cuda.Stream()
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    got = []
    for tokens in batches:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            with offload_activations(min_bytes=0, pool=gpu_pool):
                loss = m.loss(tokens)
            loss.backward()
            got.append(loss.detach().clone())
            got.extend(p.grad.clone() for p in m.parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    got += [p.detach().clone() for p in m.parameters()]
    assert_equal(ref, got)


def test_no_host_sync_in_steady_state(gpu_pool):
    model = make(torch.bfloat16)
    batches = data(steps=3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i, tokens in enumerate(batches):
        if i > 0:  # the first step grows the gpu_pool
            torch.cuda.set_sync_debug_mode("error")
        try:
            with offload_activations(min_bytes=0, pool=gpu_pool) as ctx:
                loss = model.loss(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert ctx.stats().offloaded_bytes > 0


def test_peak_memory_drops_by_most_of_the_offloaded_bytes(gpu_pool):
    torch.manual_seed(0)
    model = BlockStack(hidden=1024, layers=8, heads=8).to("cuda", torch.bfloat16)
    x = torch.randn(8, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    window = 64 << 20

    def step(ctx):
        if ctx is not None:
            with ctx:
                loss = model(x).float().pow(2).mean()
        else:
            loss = model(x).float().pow(2).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        x.grad = None

    def peak(factory):
        step(factory())  # warm-up (gpu_pool growth, allocator caching)
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        ctx = factory()
        step(ctx)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), ctx

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # memory, not bits, is under test here
        torch.use_deterministic_algorithms(False)
        base, _ = peak(lambda: None)
        off, ctx = peak(
            lambda: offload_activations(
                pool=gpu_pool, prefetch_bytes=window, max_inflight_bytes=window
            )
        )
    s = ctx.stats()
    saved = base - off
    gib = 1 << 30
    print(
        f"peak {base / gib:.2f} -> {off / gib:.2f} GiB; offloaded {s.offloaded_bytes / gib:.2f}"
        f" GiB; saved {saved / gib:.2f} GiB ({saved / s.offloaded_bytes:.0%})"
    )
    # Bound: everything offloaded leaves the device, except what the two windows may hold and
    # one layer's backward working set (a few of its largest tensors, here 4 x 8 x 1024 x 4096 x 2).
    slack = 2 * window + 4 * 8 * 1024 * 4096 * 2
    assert saved >= s.offloaded_bytes - slack


def test_failing_forwards_release_pool_memory(gpu_pool):
    model = make(torch.float32)
    tokens = data(steps=1)[0]

    def boom(*_):
        raise ValueError("boom")

    h = model.layers[2].register_forward_pre_hook(boom)
    ctx = offload_activations(min_bytes=0, pool=gpu_pool)
    for _ in range(100):
        with pytest.raises(ValueError), ctx:
            model.loss(tokens)
    h.remove()
    torch.cuda.synchronize()
    assert ctx.stats().offloaded_tensors > 0
    assert gpu_pool.stats().used_bytes == 0
