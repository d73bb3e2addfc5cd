"""Weight streaming on the CPU: the same bookkeeping as on a GPU, with synchronous copies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchoffload import WeightStreamHandle, minimum_budget, stream_weights
from torchoffload.models import GPT, BlockStack, GPTConfig
from torchoffload.testing import GroupedTensor, QuantizedTensor, quantize_int8, weight_test_hooks

CFG = GPTConfig(hidden=64, layers=6, heads=4, vocab=128, max_seq=64)
_A = 512  # arena alignment


def make(config=CFG, dtype=torch.float32):
    torch.manual_seed(0)
    return GPT(config).to(dtype).eval()


def tokens(batch=2, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab, (batch, seq), generator=g)


def stream(model, budget, **kw):
    kw.setdefault("pin_memory", False)
    return stream_weights(model, "cpu", budget_bytes=budget, **kw)


def aligned(n):
    return (n + _A - 1) // _A * _A


def block_bytes(config=CFG, dtype=torch.float32):
    """Arena bytes of one GPT block: each parameter 512-aligned, in registration order."""
    block = GPT(config).to(dtype).layers[0]
    return sum(aligned(p.numel() * p.element_size()) for p in block.parameters())


# -- parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "budget_units, depth, unit",
    [(3, 2, None), (4, 1, "blocks"), (3, 2, "leaves"), (1, 0, "leaves"), (100, 2, None)],
)
def test_parity_bitwise(dtype, budget_units, depth, unit):
    ref_model = make(dtype=dtype)
    model = copy.deepcopy(ref_model)
    xs = [tokens(2, 16, 1), tokens(3, 9, 2), tokens(1, 40, 3), tokens(2, 16, 1)]
    with torch.no_grad():
        refs = [ref_model(x) for x in xs]
    h = stream(model, budget_units * block_bytes(dtype=dtype), prefetch_depth=depth, unit=unit)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            for x, ref in zip(xs, refs, strict=True):
                assert torch.equal(model(x), ref)
    st = h.stats()
    assert st.calls == 8 and st.peak_device_bytes <= st.arena_bytes <= st.budget_bytes
    h.remove()


def test_first_call_records_then_hits():
    model = make()
    h = stream(model, 3 * block_bytes(), prefetch_depth=2, unit="blocks")
    n = len(h.units)
    with torch.no_grad():
        model(tokens())
    st = h.stats()
    assert st.misses == n and st.hits == 0 and st.prefetch_issued == 0
    assert h.schedule == ["tok", "pos"] + [f"layers.{i}" for i in range(6)] + ["ln_f", "head"]
    with torch.no_grad():
        model(tokens())
        h.reset_stats()
        for _ in range(3):
            model(tokens())
    st = h.stats()
    # Steady state: every unit prefetched in time (cyclic schedule), nothing fetched on demand.
    assert st.misses == 0 and st.hits == 3 * n
    assert st.h2d_bytes > 0 and st.prefetch_issued > 0 and st.evictions > 0


# -- budget ---------------------------------------------------------------------------------


@pytest.mark.parametrize("budget_units, depth", [(3, 2), (4, 2), (2, 1), (7, 3)])
def test_budget_never_exceeded(budget_units, depth):
    model = make()
    budget = budget_units * block_bytes() + 1000
    h = stream(model, budget, prefetch_depth=depth, unit="blocks")
    hooks = weight_test_hooks(h, trace=True)
    arena = h._runtime.arena
    with torch.no_grad():
        for seq in (16, 5, 33, 16):
            model(tokens(2, seq))
            # Accounting: regions never overlap, stay inside the arena, and loaded units add up.
            regions = arena.regions
            assert arena.starts == [r.start for r in regions]
            for a, b in zip(regions, regions[1:], strict=False):
                assert a.end <= b.start
            assert all(0 <= r.start < r.end <= arena.nbytes for r in regions)
            loaded = sum(r.end - r.start for r in regions if r.unit is not None)
            assert loaded == arena.loaded_bytes <= arena.nbytes
    assert arena.tensor.numel() == h.stats().arena_bytes <= budget
    assert h.stats().peak_device_bytes <= budget
    for _, _, start, end, *_ in hooks.trace:
        assert 0 <= start < end <= budget


def test_minimum_budget_error_states_mib():
    # Units of 4,000,000 + 4,000 bytes (weight, bias), the largest one of 1200 x 1000.
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 1200), nn.Linear(1200, 10))
    need = 3 * (aligned(4_800_000) + aligned(4_800))
    with pytest.raises(ValueError) as info:
        stream(model, need - 1, prefetch_depth=2)
    msg = str(info.value)
    assert f"the minimum budget is {need / 2**20:.1f} MiB ({need} bytes)" in msg
    assert "prefetch_depth=2" in msg and "largest unit '1'" in msg
    assert minimum_budget(model, prefetch_depth=2) == need
    h = stream(model, need, prefetch_depth=2)  # exactly the minimum works
    h.remove()
    # One unit needs no pipeline: the budget must hold that unit only.
    h = stream(nn.Linear(1000, 1000), aligned(4_000_000) + aligned(4_000), prefetch_depth=2)
    h.remove()


def test_auto_units_choice():
    model = make()
    b = block_bytes()
    # Everything fits: blocks (fewer, larger copies).
    h = stream(model, 20 * b, prefetch_depth=2)
    assert "layers.0" in h.units
    h.remove()
    # Blocks fit, but leaf modules let the budget keep more units for good: leaves.
    h = stream(model, 3 * b, prefetch_depth=2)
    assert "layers.0.fc1" in h.units and "layers.0" not in h.units
    h.remove()
    h = stream(model, 3 * b, prefetch_depth=2, unit="blocks")
    assert "layers.0" in h.units
    h.remove()
    # Blocks do not fit: leaves; asked for blocks: the error.
    h = stream(model, 3 * b - 1, prefetch_depth=2)
    assert "layers.0.fc1" in h.units
    h.remove()
    with pytest.raises(ValueError, match="cannot hold 3 units"):
        stream(model, 3 * b - 1, prefetch_depth=2, unit="blocks")


def test_plan_kept():
    from torchoffload.weights._layout import plan_kept as _plan_kept

    assert _plan_kept([10, 10, 10], 30, 3) == [0, 1, 2]  # all fit
    assert _plan_kept([10, 10, 10, 10], 30, 3) == []  # the ring needs 3 x 10
    assert _plan_kept([10] * 6, 50, 3) == [0, 1]  # 50 - 20 kept = 30 = ring
    assert _plan_kept([40, 10, 10, 10, 10], 70, 3) == [0]  # keeping the big one shrinks the ring
    assert _plan_kept([30, 10, 10, 10], 50, 2) == [0]  # the ring keeps 2 x 10


def test_nothing_to_stream_is_an_error():
    with pytest.raises(ValueError, match="nothing to stream.*no parameters"):
        stream(nn.ReLU(), 1 << 20)
    with pytest.raises(ValueError, match="nothing to stream.*resident"):
        stream(nn.Linear(4, 4), 1 << 20, resident=("weight", "bias"))


def test_bad_arguments():
    model = make()
    with pytest.raises(TypeError, match="budget_bytes"):
        stream(model, 1.5)
    with pytest.raises(ValueError, match="budget_bytes"):
        stream(model, 0)
    with pytest.raises(ValueError, match="prefetch_depth"):
        stream(model, 1 << 20, prefetch_depth=-1)
    with pytest.raises(ValueError, match="matches no parameter"):
        stream(model, 1 << 20, resident=("nope",))
    with pytest.raises(ValueError, match="unit must be"):
        stream(model, 1 << 20, unit="layers")
    with pytest.raises(ValueError, match="not part of the model"):
        stream(model, 1 << 20, unit=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="may not nest"):
        stream(model, 1 << 20, unit=[model.layers[0], model.layers[0].fc1])
    with pytest.raises(TypeError, match="nn.Module"):
        stream_weights("model", budget_bytes=1)
    with pytest.raises(TypeError, match="stream_weights"):
        WeightStreamHandle()
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        stream(meta, 1 << 20)
    # Nothing was changed by the failed calls.
    assert all(p.numel() and p.device.type == "cpu" for p in model.parameters())
    assert not hasattr(model, "_torchoffload_weights")


def test_streaming_twice_is_an_error():
    model = make()
    h = stream(model, 1 << 22)
    with pytest.raises(RuntimeError, match="already streams"):
        stream(model, 1 << 22)
    h.remove()
    stream(model, 1 << 22).remove()


# -- schedule -------------------------------------------------------------------------------


class Branchy(nn.Module):
    """Blocks, some skipped on request: the call order changes between calls."""

    def __init__(self, n=6, hidden=32):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(n))

    def forward(self, x, skip=()):
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = torch.tanh(layer(x))
        return x


def test_schedule_verified_and_rerecorded_on_divergence():
    model = Branchy()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 32)
    unit = aligned(32 * 32 * 4) + aligned(32 * 4)
    h = stream(model, 3 * unit, prefetch_depth=2)
    with torch.no_grad():
        for skip in [(), (), (2,), (2,), (), (0, 5), ()]:
            assert torch.equal(model(x, skip=skip), ref(x, skip=skip)), skip
    st = h.stats()
    # Changes of order: () -> (2,) -> () -> (0,5) -> (): four re-records, each first seen as an
    # out-of-order unit; the repeated (2,) and the first () verify against the schedule.
    assert st.schedule_rerecords == 4
    assert st.out_of_order >= 4
    assert h.schedule == [f"layers.{i}" for i in range(6)]
    with torch.no_grad():
        model(x, skip=(3,))
    assert h.schedule == [f"layers.{i}" for i in (0, 1, 2, 4, 5)]


def test_out_of_order_never_serves_a_wrong_weight():
    # Layers of one shape, so a unit bound to another's bytes would compute without error.
    model = Branchy(n=8)
    ref = copy.deepcopy(model)
    unit = aligned(32 * 32 * 4) + aligned(32 * 4)
    h = stream(model, 3 * unit, prefetch_depth=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(30):
            skip = tuple(i for i in range(8) if torch.rand((), generator=g) < 0.3)
            x = torch.randn(2, 32, generator=g)
            assert torch.equal(model(x, skip=skip), ref(x, skip=skip))
    assert h.stats().out_of_order > 0


def test_unit_called_outside_the_model_call():
    model = make()
    ref = copy.deepcopy(model)
    h = stream(model, 3 * block_bytes(), unit="blocks")
    x = torch.randn(2, 8, CFG.hidden)
    with torch.no_grad():
        model(tokens())
        assert torch.equal(model.layers[3](x), ref.layers[3](x))
        assert torch.equal(model(tokens()), ref(tokens()))
    assert h.stats().schedule_rerecords == 0


def test_failing_forward_leaves_a_usable_model():
    model = make()
    ref = copy.deepcopy(model)
    h = stream(model, 3 * block_bytes(), unit="blocks")
    with torch.no_grad():
        model(tokens())
        bad = torch.full((2, 100), 1)  # longer than max_seq: the position embedding fails
        for _ in range(5):
            with pytest.raises(IndexError):
                model(bad)
        assert h._runtime._call is None and not any(u.busy for u in h._runtime.units)
        assert torch.equal(model(tokens()), ref(tokens()))
    assert h.stats().schedule_rerecords == 0
    h.remove()


# -- tensors --------------------------------------------------------------------------------


def test_tied_weights_stored_once():
    model = make()
    assert model.head.weight is model.tok.weight
    unique = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in unique)
    h = stream(model, 3 * block_bytes(), unit="blocks")
    assert h.stats().streamed_bytes == total
    assert model.head.weight is model.tok.weight
    h.remove()
    assert model.head.weight is model.tok.weight


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm1d(16)
        self.lin = nn.Linear(16, 16)
        self.register_buffer("offset", torch.randn(16))
        self.register_buffer("scale", torch.rand(16) + 0.5, persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # 0-d int buffer
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.lin(self.bn(x)) * self.scale + self.offset + self.steps


def test_buffers_stream():
    model = WithBuffers().eval()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    h = stream(model, 1 << 20, prefetch_depth=1)
    assert set(h.units) == {"<root>"} or {"bn", "lin"} <= set(h.units)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), ref(x))
    # Outside its unit a streamed buffer is a placeholder: no device bytes, its reads served
    # with the real values (Note: [Placeholders never answer]); a plain tensor after remove().
    assert model.bn.running_mean.untyped_storage().nbytes() == 0
    assert torch.equal(model.bn.running_mean, ref.bn.running_mean)
    h.remove()
    for name, b in ref.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], b)


def test_buffer_modified_in_place_is_an_error():
    model = WithBuffers().train()  # BatchNorm in training mode updates its running stats
    h = stream(model, 1 << 20)
    with torch.no_grad(), pytest.raises(RuntimeError, match="modified in place.*resident="):
        model(torch.randn(4, 16))
    h.remove()
    model = WithBuffers().train()
    h = stream(model, 1 << 20, resident=("bn",))  # the fix the message suggests
    with torch.no_grad():
        model(torch.randn(4, 16))
    h.remove()


class ReturnsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.w[0]


def test_output_aliasing_a_weight_is_an_error():
    model = ReturnsWeight()
    h = stream(model, 1 << 20)
    with torch.no_grad(), pytest.raises(RuntimeError, match="shares memory with its streamed"):
        model(torch.randn(4))
    h.remove()


class SharedStorage(nn.Module):
    """Two parameters that are views of one storage (a fused QKV weight split in place)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        fused = torch.randn(96, 32)
        self.lin = nn.Linear(32, 32)
        self.q = nn.Parameter(fused[:32])
        self.k = nn.Parameter(fused[32:64])
        self.v = nn.Parameter(fused[64:].t())  # a transposed view at an offset

    def forward(self, x):
        return self.lin(x) @ self.q.t() + x @ self.k.t() - x @ self.v


def test_views_of_one_storage_stored_once_and_restored_as_views():
    model = SharedStorage()
    ref = copy.deepcopy(model)
    geometry = {n: (p.shape, p.stride(), p.storage_offset()) for n, p in model.named_parameters()}
    x = torch.randn(3, 32)
    h = stream(model, 1 << 20)
    lin = 32 * 32 * 4 + 32 * 4
    assert h.stats().streamed_bytes == lin + 96 * 32 * 4  # the fused storage once
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
    h.remove()
    for n, p in model.named_parameters():
        assert (p.shape, p.stride(), p.storage_offset()) == geometry[n]
    assert model.q.untyped_storage().data_ptr() == model.v.untyped_storage().data_ptr()
    assert torch.equal(model(x), ref(x))


class QuantLinear(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(quantize_int8(torch.randn(n, n)), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(n), requires_grad=False)

    def forward(self, x):
        return x @ self.weight.dequantize().t() + self.bias


class Experts(nn.Module):
    """Weights held as one `GroupedTensor` (registered flattener, not traceable)."""

    def __init__(self, n, sizes):
        super().__init__()
        bufs = [torch.randn(s, n) for s in sizes]
        self.register_buffer("grouped", GroupedTensor(bufs, torch.rand(len(sizes))))

    def forward(self, x):
        g = self.grouped
        return sum(x[:, : b.shape[0]] @ b * s for b, s in zip(g.buffers, g.scales, strict=True))


class QuantStack(nn.Module):
    """int8 quantized linears, then experts in one `GroupedTensor` (sizes n/4, n/2, n)."""

    def __init__(self, n=32, layers=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(QuantLinear(n) for _ in range(layers))
        self.experts = Experts(n, [n // 4, n // 2, n])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.experts(x)


def test_subclass_weights_stream_their_inner_buffers():
    model = QuantStack()
    x = torch.randn(5, 32)
    with torch.no_grad():
        expected = QuantStack()(x)  # same seed: same weights
    qweights = [layer.weight for layer in model.layers]
    h = stream(model, 1 << 20, prefetch_depth=1, unit="leaves")
    # The int8 data and the float scales are what is stored and streamed.
    per_layer = 32 * 32 * 1 + 32 * 4 + 32 * 4
    experts = (8 + 16 + 32) * 32 * 4 + 3 * 4
    assert h.stats().streamed_bytes == 4 * per_layer + experts
    assert all(type(w) is QuantizedTensor and w.qdata.numel() == 0 for w in qweights)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), expected)
    h.remove()
    assert [layer.weight for layer in model.layers] == qweights  # same objects
    assert torch.equal(model(x), expected)


# -- shapes, modes, errors ---------------------------------------------------------------------


def test_grad_mode_is_an_error():
    model = make()
    h = stream(model, 1 << 22)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        model(tokens())
    with torch.no_grad():
        model(tokens())  # still fine afterwards
    h.remove()


def test_block_stack_changing_shapes():
    torch.manual_seed(0)
    model = BlockStack(32, 5, 2).eval()
    ref = copy.deepcopy(model)
    h = stream(model, 2 * block_bytes(GPTConfig(hidden=32, layers=1, heads=2)), prefetch_depth=1)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b, s in [(1, 1), (4, 17), (2, 3), (1, 64), (3, 1)]:
            x = torch.randn(b, s, 32, generator=g)
            assert torch.equal(model(x), ref(x))
    assert h.stats().schedule_rerecords == 0
    h.remove()


# -- remove ---------------------------------------------------------------------------------


def test_remove_restores_everything():
    model = make()
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    hooks = [(m._forward_hooks.copy(), m._forward_pre_hooks.copy()) for m in model.modules()]
    h = stream(model, 3 * block_bytes())
    with torch.no_grad():
        model(tokens())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # freed
    h.remove()
    h.remove()  # idempotent
    assert h.removed
    for n, p in model.named_parameters():
        assert p is params[n] and torch.equal(p, values[n]) and p.device.type == "cpu"
        assert type(p) is torch.nn.Parameter
    after = [(m._forward_hooks.copy(), m._forward_pre_hooks.copy()) for m in model.modules()]
    assert hooks == after
    assert not hasattr(model, "_torchoffload_weights")
    with torch.no_grad():
        model(tokens())
    # and training works again on the restored model
    model.train()
    model.loss(tokens(2, 17)).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_context_manager_removes():
    model = make()
    with stream(model, 1 << 22) as h, torch.no_grad():
        model(tokens())
    assert h.removed and all(p.numel() for p in model.parameters())


def test_resident_patterns():
    model = make()
    ref = copy.deepcopy(model)
    h = stream(model, 3 * block_bytes(), resident=("tok", "ln_f", "layers.5.*"))
    assert "tok.weight" in h.resident and "head.weight" in h.resident  # tied: resident too
    assert "ln_f.bias" in h.resident and "layers.5.fc2.weight" in h.resident
    assert "tok" not in h.units and "head" not in h.units and "layers.5" not in h.units
    assert model.tok.weight.numel() and model.layers[5].fc1.weight.numel()
    resident = sum(
        p.numel() * p.element_size()
        for n, p in ref.named_parameters()
        if n.startswith(("tok", "ln_f", "layers.5"))
    )
    assert h.stats().resident_bytes == resident
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))
    h.remove()


# -- stats and events ------------------------------------------------------------------------


def test_every_overwrite_waits_on_the_last_reader():
    """CPU stand-in events: each copy into a range waits on the event of whatever last read or
    wrote every byte of it (Note: [Arena regions and done events])."""
    model = make()
    h = stream(model, 3 * block_bytes() + 5000, prefetch_depth=2)
    hooks = weight_test_hooks(h, trace=True, debug_events=True)
    with torch.no_grad():
        for seq in (16, 8, 16, 16):
            model(tokens(2, seq))
    last: dict[int, str] = {}  # 512-byte granule of the arena -> label of its last access
    loads = 0
    for kind, name, start, end, event, *after in hooks.trace:  # in call order
        granules = range(start, end, _A)
        if kind == "load":
            loads += 1
            assert {str(e) for e in after[0]} == {last[b] for b in granules if b in last}, name
        else:
            # a read finds the unit's own copy (or its own earlier read) in every granule
            assert all(last[b] in (f"ready:{name}", f"done:{name}") for b in granules)
        for b in granules:
            last[b] = str(event)
    assert loads > len(h.units) and h.stats().evictions > 0


def test_kept_units_stop_streaming():
    model = make()
    b = block_bytes()
    n_units_bytes = sum(aligned(p.numel() * 4) for p in model.parameters()) + b  # tied head
    h = stream(model, n_units_bytes + 4 * b, prefetch_depth=2, unit="blocks")
    with torch.no_grad():
        model(tokens())
        model(tokens())
        h.reset_stats()
        model(tokens())
    st = h.stats()
    assert st.kept_units == len(h.units) and st.h2d_bytes == 0 and st.misses == 0
    model2 = make()
    h2 = stream(model2, 6 * b, prefetch_depth=2, unit="blocks")  # room for some only
    with torch.no_grad():
        model2(tokens())
        model2(tokens())
        h2.reset_stats()
        model2(tokens())
    st2 = h2.stats()
    assert 0 < st2.kept_units < len(h2.units)
    kept_bytes = sum(u.nbytes for u in h2._runtime.units if u.fixed is not None)
    streamed = sum(u.layout.copy_bytes for u in h2._runtime.units if u.fixed is None)
    # Kept units are never copied again; some ring units may survive a call too.
    assert 0 < st2.h2d_bytes <= streamed and kept_bytes > 0 and st2.misses == 0


def test_stats_repr_and_names():
    model = make()
    h = stream(model, 3 * block_bytes(), unit="blocks")
    assert "10 units" in repr(h)
    assert h.units[:6] == [f"layers.{i}" for i in range(6)] and h.schedule is None
    st = h.stats()
    assert st.hit_rate == 1.0 and st.calls == 0 and st.stall_ms is None and st.setup_s > 0
    h.remove()
    assert "removed" in repr(h)
    with torch.no_grad(), pytest.raises(RuntimeError, match="removed"):
        h._runtime.enter(0, None)


@pytest.mark.parametrize("extra", [1, 777, 5000])
def test_unaligned_budget_keeps_alignment_and_parity(extra):
    ref = make(dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    h = stream(model, 6 * block_bytes(dtype=torch.bfloat16) + extra, prefetch_depth=2)
    with torch.no_grad():
        for seq in (16, 3, 16, 16):
            assert torch.equal(model(tokens(2, seq)), ref(tokens(2, seq)))
    assert h.stats().kept_units > 0
    assert all(u.fixed is None or u.fixed % _A == 0 for u in h._runtime.units)
    h.remove()


def test_minimum_budget_matches_what_stream_weights_accepts():
    model = make()
    for depth in (0, 1, 2, 4):
        for unit in (None, "blocks", "leaves"):
            need = minimum_budget(model, prefetch_depth=depth, unit=unit)
            stream(model, need, prefetch_depth=depth, unit=unit).remove()
            with pytest.raises(ValueError, match="minimum budget"):
                stream(model, need - _A, prefetch_depth=depth, unit=unit)
    assert minimum_budget(model, resident=("fc1", "fc2")) < minimum_budget(model)  # the largest
    assert all(p.numel() for p in model.parameters())  # not changed


def test_prefetch_passes_over_kept_units():
    """Note: [Prefetch counts ring units]: with ``prefetch_depth=1`` each ring unit is loaded
    while the ring unit before it computes, even with kept units between them (counting the
    kept units delayed the load until compute reached them)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden=64, layers=4, heads=2, vocab=256, max_seq=64)).eval()
    h = stream_weights(model, "cpu", budget_bytes=3 * minimum_budget(model, prefetch_depth=1),
                       prefetch_depth=1)  # fmt: skip
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        for _ in range(3):
            model(x)
        hooks = weight_test_hooks(h, trace=True)
        h.reset_stats()
        model(x)
    kept = set(h.kept)
    ring = [u for u in h.schedule if u not in kept]
    assert (
        kept
        and any(  # a kept unit between two ring units
            a not in kept and b in kept for a, b in zip(h.schedule, h.schedule[1:], strict=False)
        )
    )
    at = {(kind, name): i for i, (kind, name, *_) in enumerate(hooks.trace)}
    for before, unit in zip(ring, ring[1:], strict=False):
        assert at[("load", unit)] < at[("read", before)], (before, unit)
    assert h.stats().misses == 0
    h.remove()
