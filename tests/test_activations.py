from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise, clone_model, train_steps

import torchoffload
from torchoffload import PinnedPool, PoolExhaustedError, no_offload, offload_activations
from torchoffload._saved import PARAMS as _PARAMS


def pool(capacity=64 << 20):
    return PinnedPool(capacity, slab_bytes=1 << 20, pin_memory=False)


def offloader(**kw):
    kw.setdefault("min_bytes", 0)
    kw.setdefault("pool", pool())
    kw.setdefault("device", "cpu")  # these tests run the CPU path, also on a GPU machine
    return offload_activations(**kw)


def hooks_installed() -> bool:
    x = torch.randn(8, requires_grad=True)
    y = x.exp()
    return y.grad_fn._saved_result.data_ptr() != y.data_ptr()


# -- parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bitwise_parity_over_steps_with_pool_reuse(small_gpt, batches, dtype):
    model = small_gpt(dtype)
    ref = train_steps(clone_model(model), batches)
    p = pool()
    ctxs = []

    def factory():
        ctxs.append(offload_activations(min_bytes=0, pool=p, device="cpu"))
        return ctxs[-1]

    got = train_steps(clone_model(model), batches, factory)
    assert_bitwise(ref, got)
    per_step = [c.stats() for c in ctxs]
    assert all(s.offloaded_bytes > 0 for s in per_step)
    assert all(s.reloaded_bytes == s.offloaded_bytes for s in per_step)
    ps = p.stats()
    assert ps.used_bytes == 0
    assert ps.slabs == per_step[0].pool.slabs  # step 1 grew the pool; later steps reused it


def test_bitwise_parity_mixed_dtypes_under_autocast(small_gpt, batches):
    model = small_gpt()
    ref = train_steps(clone_model(model), batches, autocast=torch.bfloat16)
    ctx = offloader()
    got = train_steps(clone_model(model), batches, lambda: ctx, autocast=torch.bfloat16)
    assert_bitwise(ref, got)
    assert ctx.stats().offloaded_tensors > 0


def test_same_context_object_reused_across_steps(small_gpt, batches):
    model = small_gpt()
    ref = train_steps(clone_model(model), batches)
    ctx = offloader()
    got = train_steps(clone_model(model), batches, lambda: ctx)
    assert_bitwise(ref, got)
    s = ctx.stats()
    assert s.offloaded_tensors > 0 and s.pool.used_bytes == 0


def test_gradient_accumulation_two_forwards_one_backward(small_gpt, batches):
    model = small_gpt()
    m1, m2 = clone_model(model), clone_model(model)
    (m1.loss(batches[0]) + m1.loss(batches[1])).backward()
    with offloader() as c1:
        l1 = m2.loss(batches[0])
    with offloader() as c2:
        l2 = m2.loss(batches[1])
    (l1 + l2).backward()
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert c1.stats().offloaded_bytes > 0 and c2.stats().offloaded_bytes > 0


# -- what is offloaded ------------------------------------------------------------------------


def test_parameters_and_their_views_are_not_offloaded():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    with offloader() as ctx:
        y = lin(x * 2)
    # addmm saves mat2 = weight.t(): a view of the parameter, not a Parameter object
    assert y.grad_fn._saved_mat2.data_ptr() == lin.weight.data_ptr()
    s = ctx.stats()
    assert s.skip_reasons.get("parameter", 0) >= 1
    assert s.offloaded_bytes == 32 * 64 * 4  # only x * 2


def test_frozen_parameter_used_outside_any_module_call_is_not_offloaded():
    """FSDP2's unsharded parameters are set on a module after the module hooks that record
    parameters ran; a frozen one is not a leaf that requires grad either. Its views must still
    be kept (FSDP frees that storage with resize_(0) after forward, which no copy may race)."""
    w = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    x = torch.randn(32, 64, requires_grad=True)
    with offloader() as ctx:
        torch.nn.functional.linear(x * 2, w)
    s = ctx.stats()
    assert s.skip_reasons == {"parameter": 1}  # the only saved tensor (w needs no grad)
    assert s.offloaded_bytes == 0


def test_buffers_are_not_offloaded():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.randn(64, 64))

        def forward(self, x):
            return x @ self.scale

    m = Scale()
    x = torch.randn(32, 64, requires_grad=True)
    with offloader() as ctx:
        y = m(x)
    assert y.grad_fn._saved_mat2.data_ptr() == m.scale.data_ptr()
    assert ctx.stats().skip_reasons == {"parameter": 1}
    assert ctx.stats().offloaded_bytes == 0  # mm saved only the buffer (scale needs no grad)


def test_leaf_tensors_that_require_grad_are_kept():
    x = torch.randn(1000, requires_grad=True)
    with offloader() as ctx:
        y = x.sin()
    assert y.grad_fn._saved_self.data_ptr() == x.data_ptr()
    assert ctx.stats().skip_reasons == {"leaf": 1}


def test_min_bytes_threshold():
    x = torch.randn(100, requires_grad=True)
    with offloader(min_bytes=1000) as ctx:
        y = (x * 2).sin()  # 400 bytes: too small
        z = (x.repeat(10) * 2).sin()  # 4000 bytes
    (y.sum() + z.sum()).backward()
    s = ctx.stats()
    assert s.skip_reasons["small"] == 1
    assert s.offloaded_tensors == 1 and s.offloaded_bytes == 4000


def test_no_offload_region_keeps_tensors_and_nests():
    x = torch.randn(1000, requires_grad=True)
    with offloader() as ctx:
        a = (x * 2).sin()
        with no_offload():
            b = (x * 3).sin()
            with no_offload():
                c = (x * 4).sin()
            d = (x * 5).sin()
        e = (x * 6).sin()
    s = ctx.stats()
    assert s.skip_reasons["no_offload"] == 3 and s.offloaded_tensors == 2
    (a.sum() + b.sum() + c.sum() + d.sum() + e.sum()).backward()
    expected = sum(k * torch.cos(x.detach() * k) for k in (2, 3, 4, 5, 6))
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-5)


def test_meta_and_other_device_tensors_are_left_alone():
    x = torch.randn(1000, device="meta", requires_grad=True)
    with offloader() as ctx:
        (x * 2).sin()
    assert ctx.stats().skip_reasons == {"not_on_device": 1}


def test_non_strided_tensors_are_left_alone():
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])
    sp = torch.sparse_coo_tensor(
        i, torch.randn(3), (3, 3), requires_grad=True, check_invariants=True
    )
    with offloader() as ctx:
        y = torch.sparse.mm(sp * 2, torch.randn(3, 4, requires_grad=True))
    y.sum().backward()
    assert ctx.stats().skip_reasons.get("unsupported_type", 0) >= 1


def run_plain_and_offloaded(f):
    """``f(ctx)`` under no hooks and under an offloader: its results (a list of tensors) and
    the offloader's stats."""
    torch.manual_seed(0)
    ref = f(contextlib.nullcontext())
    torch.manual_seed(0)
    ctx = offloader()
    got = f(ctx)
    for a, b in zip(ref, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    return ctx.stats()


def test_forward_ad_zero_tangents_are_left_alone():
    # matmul under forward AD saves an efficient zero tensor for the tangent of `w` (it has
    # none): no storage at all. Copying from its null data pointer crashed the process.
    import torch.autograd.forward_ad as fwAD

    def f(ctx):
        x = torch.randn(32, 16, requires_grad=True)
        w = torch.randn(16, 16, requires_grad=True)
        with ctx, fwAD.dual_level():
            y = torch.tanh(fwAD.make_dual(x, torch.ones_like(x)) @ w).pow(3)
            primal, tangent = fwAD.unpack_dual(y)
            loss = primal.sum() + tangent.sum()
        loss.backward()
        return [primal, tangent, x.grad, w.grad]

    s = run_plain_and_offloaded(f)
    assert s.skip_reasons["unsupported_type"] == 1 and s.offloaded_tensors > 0


def test_jvp_inside_the_block():
    def f(ctx):
        w = torch.randn(16, 16, requires_grad=True)
        x = torch.randn(32, 16)
        with ctx:
            out, t = torch.func.jvp(lambda x: torch.tanh(x @ w).pow(3), (x,), (torch.ones_like(x),))
        (out.sum() + t.sum()).backward()
        return [out, t, w.grad]

    assert run_plain_and_offloaded(f).offloaded_tensors > 0


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_are_left_alone(layout):
    # A strided nested tensor has no strides (the pack raised); a jagged one rebuilt from its
    # buffers got a new ragged dimension, and backward refused the gradient's shape.
    def f(ctx):
        a = torch.randn(3, 8, requires_grad=True)
        b = torch.randn(5, 8, requires_grad=True)
        with ctx:
            nt = torch.nested.as_nested_tensor([a * 1, b * 1], layout=layout)
            y = nt.sin() * nt
            loss = torch.nested.to_padded_tensor(y, 0.0).sum()
        loss.backward()
        return [a.grad, b.grad]

    assert run_plain_and_offloaded(f).skip_reasons["unsupported_type"] >= 2


# -- views and shared storage ---------------------------------------------------------------


class SaveViews(torch.autograd.Function):
    """Saves a base and two views of it; backward checks what it gets back."""

    seen: list = []

    @staticmethod
    def forward(ctx, base):
        ctx.save_for_backward(base, base.t(), base[1:, 2:])
        return base.sum()

    @staticmethod
    def backward(ctx, g):
        a, b, c = ctx.saved_tensors
        SaveViews.seen = [
            (t.shape, t.stride(), t.storage_offset(), t.untyped_storage().data_ptr(), t.clone())
            for t in (a, b, c)
        ]
        return g * (a + b.t() + F.pad(c, (2, 0, 1, 0)))


def test_views_restore_exact_geometry_and_storage_copied_once():
    base_in = torch.randn(6, 5, requires_grad=True)
    with offloader() as ctx:
        base = base_in * 1  # a non-leaf activation
        out = SaveViews.apply(base)
    s = ctx.stats()
    assert s.offloaded_tensors == 3 and s.shared_storage_tensors == 2
    assert s.offloaded_bytes == 6 * 5 * 4
    out.backward()
    (sa, sta, oa, pa, va), (sb, stb, ob, pb, vb), (sc, stc, oc, pc, vc) = SaveViews.seen
    assert (tuple(sa), sta, oa) == ((6, 5), (5, 1), 0)
    assert (tuple(sb), stb, ob) == ((5, 6), (1, 5), 0)
    assert (tuple(sc), stc, oc) == ((5, 3), (5, 1), 7)
    assert pa == pb == pc  # one reloaded storage serves all three views
    ref = base_in.detach()
    assert torch.equal(va, ref) and torch.equal(vb, ref.t()) and torch.equal(vc, ref[1:, 2:])
    assert ctx.stats().reloaded_bytes == 6 * 5 * 4


def test_transpose_saved_beside_base_gives_same_gradients():
    torch.manual_seed(0)
    w = torch.randn(48, 48, requires_grad=True)
    x0 = torch.randn(48, 48)

    def f(x):
        y = x @ w
        return (y @ y.t()).tanh().sum() + (y.t() * y).sum()

    f(x0.clone()).backward()
    ref = w.grad.clone()
    w.grad = None
    with offloader() as ctx:
        loss = f(x0.clone())
    loss.backward()
    assert torch.equal(w.grad, ref)
    assert ctx.stats().shared_storage_tensors >= 1


def test_split_views_of_fused_projection(small_gpt, batches):
    # the GPT block splits one qkv tensor into three views; they must share one copy
    model = small_gpt()
    with offloader() as ctx:
        loss = model.loss(batches[0])
    loss.backward()
    assert ctx.stats().shared_storage_tensors > 0


def test_conj_and_neg_views_round_trip():
    z = torch.randn(64, dtype=torch.complex64, requires_grad=True)
    with offloader() as ctx:
        a = z * 1
        y = (a.conj() * a).real.sum() + (torch._neg_view(a.conj()) * 2).abs().sum()
    y.backward()
    ref_z = z.detach().clone().requires_grad_()
    a = ref_z * 1
    ((a.conj() * a).real.sum() + (torch._neg_view(a.conj()) * 2).abs().sum()).backward()
    assert torch.equal(z.grad, ref_z.grad)
    assert ctx.stats().offloaded_tensors > 0


# -- autograd semantics ----------------------------------------------------------------------


def test_inplace_modification_after_save_raises_version_error():
    x = torch.randn(1000, requires_grad=True)
    with offloader():
        y = x * 2
        z = y.sin()  # saves y
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_inplace_modification_of_kept_tensor_raises_version_error():
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with offloader():
        y = (x * 2) @ w
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_storage_written_through_a_tensor_of_another_version_counter_is_copied_again():
    # unsafe_chunk's pieces share one storage but each has its own version counter: a write
    # through `b` leaves `a`'s version as it was. `b` saved after that write must not be served
    # from the copy taken when `a` was saved, even though the two version numbers match.
    def f(x):
        a, b = (x * 1).unsafe_chunk(2)
        a.mul_(2)  # a: version 1
        sa = a.sin()  # saves a (the whole storage is copied)
        b.mul_(3)  # b: version 1, writes b's half of that storage
        sb = b.sin()  # saves b at its version 1
        return sa.sum() + sb.sum()

    x0 = torch.randn(8, 6)
    ref_x = x0.clone().requires_grad_()
    f(ref_x).backward()
    x = x0.clone().requires_grad_()
    with offloader():
        loss = f(x)
    loss.backward()
    assert torch.equal(x.grad, ref_x.grad)


def test_inplace_before_save_is_fine():
    x = torch.randn(1000, requires_grad=True)
    with offloader():
        y = x * 2
        y.add_(1)
        z = y.sin()
    z.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(x.detach() * 2 + 1), rtol=0, atol=0)


def test_retain_graph_and_second_backward(small_gpt, batches):
    model = small_gpt()
    ref = clone_model(model)
    loss = ref.loss(batches[0])
    loss.backward(retain_graph=True)
    loss.backward()
    with offloader() as ctx:
        loss = model.loss(batches[0])
    loss.backward(retain_graph=True)
    first = ctx.stats()
    loss.backward()
    second = ctx.stats()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert second.reloaded_bytes == 2 * first.reloaded_bytes  # unpacked (reloaded) twice
    del loss
    assert ctx.stats().pool.used_bytes == 0


def test_double_backward():
    torch.manual_seed(0)
    x0 = torch.randn(256, 16)
    w0 = torch.randn(16, 16)

    def run(ctx):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        with ctx:
            y = torch.tanh(x @ w).pow(3).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        gx.pow(2).sum().backward()
        return x.grad, w.grad

    import contextlib

    ref = run(contextlib.nullcontext())
    ctx = offloader()
    got = run(ctx)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert ctx.stats().offloaded_tensors > 0


# -- exceptions and cleanup ------------------------------------------------------------------


class Boom(Exception):
    pass


def test_failing_forwards_leave_no_hooks_and_no_pool_memory(small_gpt, batches):
    model = small_gpt()
    p = pool()

    def exploding_hook(module, args):
        raise Boom

    handle = model.layers[1].register_forward_pre_hook(exploding_hook)
    ctx = offload_activations(min_bytes=0, pool=p, device="cpu")
    for _ in range(100):
        with pytest.raises(Boom), ctx:
            model.loss(batches[0])
        assert not hooks_installed()
    handle.remove()
    assert ctx.stats().offloaded_tensors > 0
    assert p.stats().used_bytes == 0
    assert _PARAMS._users == 0 and _PARAMS._handle is None


def test_failing_backward_releases_pool_memory():
    class FailBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise Boom

    p = pool()
    x = torch.randn(4096, requires_grad=True)
    for _ in range(100):
        with offload_activations(min_bytes=0, pool=p, device="cpu"):
            y = FailBackward.apply((x * 2).sin()).sum()
        with pytest.raises(Boom):
            y.backward()
        del y
    gc.collect()
    assert p.stats().used_bytes == 0


def test_context_cannot_be_entered_twice_at_once():
    ctx = offloader()
    with ctx, pytest.raises(RuntimeError, match="already active"), ctx:
        pass
    assert not hooks_installed()


# -- pool behaviour through the offloader ----------------------------------------------------


def test_pool_exhaustion_raise_policy(small_gpt, batches):
    model = small_gpt()
    tiny = PinnedPool(4096, slab_bytes=4096, pin_memory=False)
    ctx = offload_activations(min_bytes=0, pool=tiny, on_pool_exhausted="raise", device="cpu")
    with pytest.raises(PoolExhaustedError), ctx:
        model.loss(batches[0])
    gc.collect()
    assert tiny.stats().used_bytes == 0
    assert not hooks_installed()


def test_pool_exhaustion_fallback_warns_and_stays_exact(small_gpt, batches):
    model = small_gpt()
    ref = train_steps(clone_model(model), batches)
    tiny = PinnedPool(4096, slab_bytes=4096, pin_memory=False)
    with pytest.warns(RuntimeWarning, match="outside the pool"):
        got = train_steps(
            clone_model(model),
            batches,
            lambda: offload_activations(min_bytes=0, pool=tiny, device="cpu"),
        )
    assert_bitwise(ref, got)
    s = tiny.stats()
    assert s.fallback_allocs > 0 and s.used_bytes == 0


# -- prefetch bookkeeping --------------------------------------------------------------------


def chain(n, ctx):
    x = torch.randn(1024, requires_grad=True)
    with ctx:
        y = x * 1
        for _ in range(n):
            y = y.sin()  # each saves its input: n distinct storages
    return y.sum()


def test_prefetch_reverse_order_hits_after_first_miss():
    ctx = offloader(prefetch_bytes=1 << 20)
    chain(10, ctx).backward()
    s = ctx.stats()
    assert s.offloaded_tensors == 10
    assert s.prefetch_misses == 1 and s.prefetch_hits == 9 and s.prefetch_issued == 9
    assert s.reloaded_tensors == 10 and s.pool.used_bytes == 0


def test_prefetch_window_zero_means_every_reload_is_on_demand():
    ctx = offloader(prefetch_bytes=0)
    chain(10, ctx).backward()
    s = ctx.stats()
    assert s.prefetch_misses == 10 and s.prefetch_hits == 0 and s.prefetch_issued == 0


def test_prefetch_window_bounds_bytes_waiting():
    ctx = offloader(prefetch_bytes=3 * 4096)
    chain(10, ctx).backward()
    s = ctx.stats()
    assert s.peak_prefetched_bytes == 3 * 4096
    assert s.prefetch_hits + s.prefetch_misses == 10


def test_prefetch_window_is_a_minimum_lookahead_of_one_storage():
    # a window smaller than any storage still keeps exactly one storage in flight ahead
    ctx = offloader(prefetch_bytes=1)
    chain(10, ctx).backward()
    s = ctx.stats()
    assert s.prefetch_misses == 1 and s.prefetch_hits == 9
    assert s.peak_prefetched_bytes == 4096


def test_retain_graph_second_pass_prefetches_again():
    ctx = offloader(prefetch_bytes=1 << 20)
    y = chain(6, ctx)
    y.backward(retain_graph=True)
    y.backward()
    s = ctx.stats()
    assert s.prefetch_misses == 2 and s.prefetch_hits == 10


# -- knobs and stats ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"min_bytes": -1}, ValueError),
        ({"min_bytes": 1.0}, TypeError),
        ({"min_bytes": True}, TypeError),
        ({"prefetch_bytes": -5}, ValueError),
        ({"max_inflight_bytes": "1G"}, TypeError),
        ({"use_streams": 1}, TypeError),
        ({"pin_memory": None}, TypeError),
        ({"on_pool_exhausted": "ignore"}, ValueError),
        ({"pool": object()}, TypeError),
        ({"device": "meta"}, ValueError),
    ],
)
def test_bad_knobs(kwargs, exc):
    with pytest.raises(exc):
        offload_activations(**kwargs)


def test_positional_arguments_are_rejected():
    with pytest.raises(TypeError):
        offload_activations(1024)


def test_stats_are_readable(small_gpt, batches):
    model = small_gpt()
    with offloader() as ctx:
        loss = model.loss(batches[0])
    loss.backward()
    s = ctx.stats()
    text = str(s)
    assert "offloaded" in text and "MiB" in text and "prefetch hits" in text
    d = s.as_dict()
    assert d["offloaded_bytes"] == s.offloaded_bytes and "pool" in d
    ctx.reset_stats()
    assert ctx.stats().offloaded_bytes == 0


def test_public_api():
    assert set(torchoffload.__all__) >= {
        "offload_activations",
        "no_offload",
        "PinnedPool",
        "PoolExhaustedError",
        "ActivationStats",
    }


def test_no_warnings_in_normal_use(small_gpt, batches):
    model = small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_steps(model, batches, lambda: offloader())


def test_storage_with_views_saved_by_several_nodes_is_reloaded_once():
    """q, k and v projections each save their own [tokens, hidden] view of one normed input.
    Autograd frees each node's saved tensors right after the node runs; the device copy must
    stay until the last of the three is unpacked (Note: [When a device copy is no longer
    needed]), not be dropped one view early and copied back again."""
    torch.manual_seed(0)
    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(3)]
    x = torch.randn(2, 16, 64, requires_grad=True)
    with offloader() as ctx:
        normed = x * 2  # one storage, saved through three views
        q, k, v = (torch.nn.functional.linear(normed, w) for w in ws)
        loss = (q * k * v).sum()
    loss.backward()
    s = ctx.stats()
    assert s.shared_storage_tensors >= 2
    assert s.reloaded_bytes == s.offloaded_bytes
    assert s.reloaded_tensors == s.offloaded_tensors - s.shared_storage_tensors
