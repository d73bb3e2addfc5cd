from __future__ import annotations

import functools
import gc

import pytest
import torch
from conftest import SMALL, assert_bitwise, clone_model, train_steps
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from torchoffload import (
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    find_layers,
    testing,
)
from torchoffload._saved import PARAMS as _PARAMS
from torchoffload.models import GPT, GPTConfig

CFG4 = GPTConfig(hidden=64, layers=4, heads=2, vocab=128, max_seq=33)


def make(config=CFG4, dtype=torch.float32):
    torch.manual_seed(0)
    return GPT(config).to(dtype)


def apply(model, pool=None, layers="auto", **cfg):
    cfg.setdefault("min_bytes", 0)
    return apply_activation_offloading(
        model,
        layers=layers,
        config=ActivationOffloadConfig(**cfg),
        pool=pool or PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=False),
        device="cpu",
    )


def hooks_installed() -> bool:
    x = torch.randn(8, requires_grad=True)
    y = x.exp()
    return y.grad_fn._saved_result.data_ptr() != y.data_ptr()


def hook_counts(model):
    return [
        (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
        for m in model.modules()
    ]


# -- layer detection ----------------------------------------------------------------------------


def test_find_layers_picks_the_repeated_blocks():
    model = make()
    assert find_layers(model) is model.layers


def test_find_layers_prefers_the_longest_list_of_one_type():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh()])
            self.short = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.long = nn.ModuleList([nn.ReLU() for _ in range(3)])

    m = M()
    assert find_layers(m) is m.long


def test_find_layers_error_names_the_fix():
    with pytest.raises(ValueError, match="pass layers= explicitly"):
        find_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match="found no repeated layers"):
        apply_activation_offloading(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"layers": "first"}, ValueError),
        ({"layers": []}, ValueError),
        ({"layers": [nn.Linear(2, 2)]}, ValueError),  # not a submodule
        ({"layers": [1, 2]}, TypeError),
        ({"config": {"prefetch_layers": 1}}, TypeError),
    ],
)
def test_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        apply_activation_offloading(make(), **kwargs)


def test_same_layer_twice_is_an_error():
    model = make()
    with pytest.raises(ValueError, match="twice"):
        apply_activation_offloading(model, layers=[model.layers[0], model.layers[0]])


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"prefetch_layers": -1}, ValueError),
        ({"defer_layers": 1.5}, TypeError),
        ({"skip_last_layers": True}, TypeError),
        ({"max_offload_bytes": -1}, ValueError),
        ({"min_bytes": "64K"}, TypeError),
        ({"budget_policy": "smallest"}, ValueError),
        ({"on_pool_exhausted": "drop"}, ValueError),
        ({"use_streams": "yes"}, TypeError),
        ({"time_waits": 1}, TypeError),
    ],
)
def test_bad_config(kwargs, exc):
    with pytest.raises(exc):
        ActivationOffloadConfig(**kwargs)


def test_config_is_frozen():
    cfg = ActivationOffloadConfig()
    with pytest.raises(AttributeError):
        cfg.prefetch_layers = 3


def test_not_a_module():
    with pytest.raises(TypeError):
        apply_activation_offloading(lambda x: x)


# -- parity -------------------------------------------------------------------------------------


def batches(n=3, vocab=128):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (4, 33), generator=g) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"prefetch_layers": 0, "defer_layers": 0, "skip_last_layers": 0},
        {"prefetch_layers": 2, "defer_layers": 2, "skip_last_layers": 2},
        {"max_offload_bytes": 200_000},
        {"max_offload_bytes": 200_000, "budget_policy": "earliest"},
        {"max_offload_bytes": 200_000, "budget_policy": "largest"},
        {"offload_outside_layers": True},
    ],
)
def test_bitwise_parity_over_steps(dtype, cfg):
    model = make(dtype=dtype)
    data = batches()
    ref = train_steps(clone_model(model), data)
    m = clone_model(model)
    handle = apply(m, **cfg)
    got = train_steps(m, data)
    assert_bitwise(ref, got)
    s = handle.stats()
    assert s.offloaded_bytes > 0 and s.pool.used_bytes == 0
    handle.remove()


def test_gradient_accumulation_two_forwards_one_backward():
    model = make()
    data = batches(2)
    m1, m2 = clone_model(model), clone_model(model)
    (m1.loss(data[0]) + m1.loss(data[1])).backward()
    handle = apply(m2)
    (m2.loss(data[0]) + m2.loss(data[1])).backward()
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    s = handle.stats()
    assert s.prefetch_misses == 0 and s.prefetch_hits > 0


def test_retain_graph_second_backward_prefetches_again():
    model = make()
    tokens = batches(1)[0]
    ref = clone_model(model)
    loss = ref.loss(tokens)
    loss.backward(retain_graph=True)
    loss.backward()
    handle = apply(model)
    loss = model.loss(tokens)
    loss.backward(retain_graph=True)
    first = handle.stats()
    loss.backward()
    second = handle.stats()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert second.prefetch_hits == 2 * first.prefetch_hits and second.prefetch_misses == 0


def test_eval_forward_saves_nothing():
    model = make()
    handle = apply(model)
    with torch.no_grad():
        model(batches(1)[0][:, :-1])
    assert handle.stats().offloaded_tensors == 0 and not hooks_installed()


# -- what is offloaded, and when ------------------------------------------------------------------


def test_skip_last_layers_and_outside_layers_stay_on_device():
    model = make()
    handle = apply(model, skip_last_layers=2)
    model.loss(batches(1)[0]).backward()
    s = handle.stats()
    assert set(s.per_layer_bytes) == {0, 1}
    # no hooks run there at all: those tensors are saved by autograd as usual
    assert "last_layers" not in s.skip_reasons and "outside_layers" not in s.skip_reasons
    assert s.skipped_tensors == s.skip_reasons.get("parameter", 0) + s.skip_reasons.get("leaf", 0)


def test_outside_layers_offloaded_when_asked():
    model = make()
    handle = apply(model, offload_outside_layers=True, skip_last_layers=0)
    model.loss(batches(1)[0]).backward()
    s = handle.stats()
    assert "outside_layers" not in s.skip_reasons
    assert set(s.per_layer_bytes) == {0, 1, 2, 3}


def test_prefetch_one_layer_ahead_gives_all_hits():
    model = make()
    handle = apply(model, prefetch_layers=1, skip_last_layers=1)
    model.loss(batches(1)[0]).backward()
    s = handle.stats()
    assert s.prefetch_misses == 0 and s.prefetch_hits == s.reloaded_tensors > 0


def test_no_skipped_last_layer_makes_its_own_reloads_late():
    # with nothing kept at the end, the last layer's reloads are issued at its own backward
    # start: counted as misses (late), every earlier layer is a hit
    model = make()
    handle = apply(model, prefetch_layers=1, skip_last_layers=0)
    model.loss(batches(1)[0]).backward()
    s = handle.stats()
    per_layer_storages = s.reloaded_tensors // 4
    assert s.prefetch_misses == per_layer_storages
    assert s.prefetch_hits == 3 * per_layer_storages


def test_prefetch_zero_layers_means_every_reload_is_late():
    model = make()
    handle = apply(model, prefetch_layers=0, skip_last_layers=1)
    model.loss(batches(1)[0]).backward()
    s = handle.stats()
    assert s.prefetch_hits == 0 and s.prefetch_misses == s.reloaded_tensors > 0


@pytest.fixture
def simulated_async():
    with testing.simulated_async_copies() as hooks:
        yield hooks


@pytest.mark.parametrize("defer", [0, 1, 2])
def test_defer_releases_device_copies_defer_layers_later(simulated_async, defer):
    model = make()
    handle = apply(model, defer_layers=defer, skip_last_layers=0)
    held_at_exit = []
    sessions = []

    def record(module, args, out, i):
        session = handle._session.policy
        sessions.append(session)
        held_at_exit.append(
            sorted(
                {r.layer for recs in session.layer_recs.values() for r in recs if r.src is not None}
            )
        )

    hs = [
        layer.register_forward_hook(functools.partial(record, i=i))
        for i, layer in enumerate(model.layers)
    ]
    loss = model.loss(batches(1)[0])
    for h in hs:
        h.remove()
    # hooks registered after the handle's run after its release: at the end of layer i, the
    # layers i - defer + 1 .. i still hold their device sources (copies not known done)
    for i, held in enumerate(held_at_exit):
        assert held == list(range(max(0, i - defer + 1), i + 1)), (i, held)
    # forward's end releases everything: backward starts with nothing held
    session = sessions[-1]
    assert all(r.src is None for recs in session.layer_recs.values() for r in recs)
    simulated_async.complete_events()
    loss.backward()
    assert handle.stats().pool.used_bytes == 0


def test_reloads_are_freed_when_their_layer_backward_is_done():
    model = make()
    handle = apply(model, skip_last_layers=1)
    sessions = []
    held_at_start = {}

    def remember(module, args, out):
        sessions.append(handle._session.policy)

    model.layers[0].register_forward_hook(remember)
    loss = model.loss(batches(1)[0])
    session = sessions[0]
    original = session.backward_start

    def spy(i):
        original(i)
        held_at_start[i] = sorted(
            {r.layer for recs in session.layer_recs.values() for r in recs if r.dev is not None}
        )

    session.backward_start = spy
    loss.backward()
    assert sorted(held_at_start) == [0, 1, 2, 3]
    # at layer i's backward start only layers i - 1 (prefetched) and maybe i hold device copies
    for i, held in held_at_start.items():
        assert set(held) <= {i, i - 1}, (i, held)
    # and when backward is over nothing is held
    assert all(
        r.dev is None and r.src is None for recs in session.layer_recs.values() for r in recs
    )


# -- budget -------------------------------------------------------------------------------------


def eligible_sizes(model, tokens):
    handle = apply(model)
    model.loss(tokens).backward()
    handle.remove()
    return handle._profile


@pytest.mark.parametrize("policy", ["spread", "largest", "earliest"])
def test_budget_is_never_exceeded(policy):
    model = make()
    tokens = batches(1)[0]
    total = sum(n for _, _, n in eligible_sizes(clone_model(model), tokens))
    budget = total * 4 // 10
    handle = apply(model, max_offload_bytes=budget, budget_policy=policy)
    for _ in range(3):
        handle.reset_stats()
        model.loss(tokens).backward()
        s = handle.stats()
        assert 0 < s.offloaded_bytes <= budget
        assert s.budget_skipped_bytes > 0 and s.skip_reasons["budget"] > 0


def test_budget_earliest_fills_the_first_layers_first():
    model = make()
    tokens = batches(1)[0]
    profile = eligible_sizes(clone_model(model), tokens)
    per_layer = {}
    for layer, _, n in profile:
        per_layer[layer] = per_layer.get(layer, 0) + n
    budget = per_layer[0] + per_layer[1] // 2
    handle = apply(model, max_offload_bytes=budget, budget_policy="earliest")
    model.loss(tokens).backward()
    s = handle.stats()
    assert s.per_layer_bytes[0] == per_layer[0]
    assert 0 < s.per_layer_bytes[1] < per_layer[1] and 2 not in s.per_layer_bytes


def test_budget_spread_gives_every_layer_an_equal_share():
    model = make()
    tokens = batches(1)[0]
    profile = eligible_sizes(clone_model(model), tokens)
    total = sum(n for _, _, n in profile)
    budget = total // 2
    handle = apply(model, max_offload_bytes=budget, budget_policy="spread")
    model.loss(tokens).backward()  # step 1: no profile yet, earliest-first
    handle.reset_stats()
    model.loss(tokens).backward()
    s = handle.stats()
    # layers 0, 1, 2 may offload (3 is skipped); 2 is left out, since it comes back at once
    share = budget // 2
    assert set(s.per_layer_bytes) == {0, 1}
    assert all(b >= 0.5 * share for b in s.per_layer_bytes.values())  # unused share carries on
    assert s.offloaded_bytes <= budget


def test_budget_largest_offloads_the_largest_tensors_after_the_first_step():
    model = make()
    tokens = batches(1)[0]
    profile = eligible_sizes(clone_model(model), tokens)
    sizes = sorted((n for _, _, n in profile), reverse=True)
    budget = sum(sizes[:3])
    handle = apply(model, max_offload_bytes=budget, budget_policy="largest")
    model.loss(tokens).backward()  # step 1: no profile yet, earliest-first
    handle.reset_stats()
    model.loss(tokens).backward()  # step 2: largest first
    s = handle.stats()
    assert s.offloaded_bytes == budget
    assert s.offloaded_tensors - s.shared_storage_tensors == 3


# -- checkpoint and SAC -------------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, inner, context_fn=None):
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, x):
        kw = {"context_fn": self.context_fn} if self.context_fn else {}
        return checkpoint(self.inner, x, use_reentrant=False, **kw)


def test_checkpointed_layers_offload_their_inputs_and_recompute_correctly():
    model = make()
    data = batches(2)
    ref = train_steps(clone_model(model), data)
    m = clone_model(model)
    m.layers[0] = Checkpointed(m.layers[0])
    m.layers[2] = Checkpointed(m.layers[2])
    handle = apply(m, layers=m.layers)
    got = train_steps(m, data)
    assert_bitwise(ref, got)
    s = handle.stats()
    hidden_bytes = 4 * 32 * 64 * 4  # a checkpointed layer saves only its input
    assert s.per_layer_bytes[0] == s.per_layer_bytes[2] == 2 * hidden_bytes  # two steps
    assert s.per_layer_bytes[1] > 10 * hidden_bytes
    assert s.prefetch_misses == 0


def test_selective_checkpoint_policy_composes():
    # torch's eager SAC treats MUST_CPU_OFFLOAD like recompute (it is honoured by
    # torch.compile only); the layer's input is still offloaded by us and results stay exact
    def policy(ctx, func, *args, **kwargs):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        if func is torch.ops.aten.gelu.default:
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.PREFER_RECOMPUTE

    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    model = make()
    data = batches(2)
    ref = train_steps(clone_model(model), data)
    m = clone_model(model)
    for i in range(3):
        m.layers[i] = Checkpointed(m.layers[i], ctx_fn)
    handle = apply(m, layers=m.layers)
    got = train_steps(m, data)
    assert_bitwise(ref, got)
    assert set(handle.stats().per_layer_bytes) == {0, 1, 2}


# -- lifecycle ----------------------------------------------------------------------------------


def test_remove_restores_the_model_exactly():
    model = make()
    before = hook_counts(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gc.collect()  # handles dropped by other tests release the parameter hook when collected
    users = _PARAMS._users
    handle = apply(model)
    assert hook_counts(model) != before
    model.loss(batches(1)[0]).backward()
    handle.remove()
    handle.remove()  # idempotent
    assert hook_counts(model) == before and _PARAMS._users == users
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    offloaded = handle.stats().offloaded_tensors
    model.loss(batches(1)[0]).backward()
    assert handle.stats().offloaded_tensors == offloaded


def test_handle_as_context_manager_removes():
    model = make()
    before = hook_counts(model)
    with apply(model):
        model.loss(batches(1)[0]).backward()
    assert hook_counts(model) == before


def test_backward_after_remove_still_works():
    model = make()
    ref = clone_model(model)
    tokens = batches(1)[0]
    ref.loss(tokens).backward()
    handle = apply(model)
    loss = model.loss(tokens)
    handle.remove()
    loss.backward()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_failing_forwards_leave_no_hooks_and_no_pool_memory():
    model = make()
    pool = PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=False)
    handle = apply(model, pool=pool)

    def boom(module, args):
        raise ValueError("boom")

    h = model.layers[2].register_forward_pre_hook(boom)
    for _ in range(100):
        with pytest.raises(ValueError):
            model.loss(batches(1)[0])
        assert not hooks_installed()
    h.remove()
    assert handle.stats().offloaded_tensors > 0 and pool.stats().used_bytes == 0
    model.loss(batches(1)[0]).backward()  # still usable
    assert pool.stats().used_bytes == 0


def test_stats_report_layers_and_budget():
    model = make(SMALL)
    handle = apply(model, max_offload_bytes=10_000_000)
    model.loss(batches(1)[0]).backward()
    s = handle.stats()
    assert s.per_layer_bytes and s.compute_wait_ms is None  # not timed on the CPU
    assert "ActivationOffloadHandle" in repr(handle)


class SharedTable(nn.Module):
    """Like Hugging Face's rotary embedding: one tensor computed before the layers and saved
    by every layer."""

    class Layer(nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.lin = nn.Linear(hidden, hidden)

        def forward(self, h, table):
            return self.lin(h) * table  # mul saves table (h's gradient needs it)

    def __init__(self, layers=4, hidden=64):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(self.Layer(hidden) for _ in range(layers))
        self.register_buffer("freq", torch.linspace(0.1, 1.0, hidden))

    def forward(self, x):
        table = torch.cos(self.freq * torch.arange(x.shape[1], dtype=x.dtype)[:, None])
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, table)
        return h


def test_storage_saved_by_later_layers_is_prefetched_with_them_and_reloaded_once():
    torch.manual_seed(0)
    model = SharedTable()
    handle = apply(model, prefetch_layers=1, skip_last_layers=1)
    x = torch.randn(2, 32, 64)
    for _ in range(2):
        model(x).square().sum().backward()
    s = handle.stats()
    assert s.shared_storage_tensors > 0
    assert s.prefetch_misses == 0
    assert s.reloaded_bytes == s.offloaded_bytes
    handle.remove()


# -- interrupted forwards (Note: [Interrupted forwards]) -------------------------------------------


@pytest.mark.parametrize("then", ["train", "remove"])
@pytest.mark.parametrize("outside", [False, True])
def test_keyboard_interrupt_mid_forward_recovers(then, outside):
    ref = make()
    model = make()
    for m in (ref, model):
        m.layers[1].ln2 = nn.Sequential(m.layers[1].ln2, testing.Interrupt())
    data = batches(3)
    base = train_steps(ref, data)
    before = hook_counts(model)
    handle = apply(model, skip_last_layers=0, offload_outside_layers=outside)
    testing.Interrupt.armed = True
    with pytest.raises(KeyboardInterrupt):
        model.loss(data[0])
    # The layer's and the model's post-hooks did not run: the saved-tensor hooks are still
    # pushed until the next forward or remove() finds the call over.
    assert hooks_installed()
    if then == "remove":
        handle.remove()
        assert not hooks_installed() and hook_counts(model) == before
        return
    got = train_steps(model, data)
    assert not hooks_installed()
    assert_bitwise(base, got)
    sessions = []
    model.layers[0].register_forward_hook(lambda *a: sessions.append(handle._session))
    model.loss(data[0]).backward()
    model.loss(data[0]).backward()
    assert len(sessions) == 2 and sessions[0] is not sessions[1]  # one session per step
    handle.remove()
    assert not hooks_installed()


def test_offload_activations_exit_without_enter_is_an_error():
    from torchoffload import offload_activations

    with pytest.raises(RuntimeError, match="not entered"):
        offload_activations(device="cpu").__exit__(None, None, None)


def test_bad_layers_and_offload_layers_name_the_argument():
    model = make()
    with pytest.raises(TypeError, match=r"layers must be .*single layer"):
        apply(model, layers=model.layers[0])
    with pytest.raises(TypeError, match="layers must be"):
        apply(model, layers=123)
    with pytest.raises(ValueError, match=r"offload_layers \[99\] are out of range"):
        apply(model, offload_layers=frozenset({99}))
    assert hook_counts(model) == hook_counts(make())
