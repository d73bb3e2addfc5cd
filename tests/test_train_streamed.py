"""stream_parameters on the CPU: training with parameters in the host store is bitwise the same
training with them resident (with the offloaded optimizer, a frozen base, checkpointing,
activation offloading, tied weights), within the budget, with clear errors for misuse."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import torchoffload as to
from torchoffload.models import GPT, GPTConfig

CFG = GPTConfig(hidden=32, layers=4, heads=4, vocab=64, max_seq=16)


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def tokens(i):
    return torch.randint(0, CFG.vocab, (2, 12), generator=torch.Generator().manual_seed(i))


def block_bytes(m):
    return sum(p.numel() * p.element_size() for p in m.layers[0].parameters())


def loss_of(m, x, checkpointed=False):
    if not checkpointed:
        return m.loss(x)
    pos = torch.arange(x.shape[1] - 1)
    h = m.tok(x[:, :-1]) + m.pos(pos)
    for layer in m.layers:
        h = ckpt.checkpoint(layer, h, use_reentrant=False)
    logits = m.head(m.ln_f(h))
    return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def train(m, opt, steps=3, checkpointed=False, activations=False, accumulate=1):
    losses = []
    for s in range(steps):
        for a in range(accumulate):
            x = tokens(10 * s + a)
            final = a == accumulate - 1
            ctx = opt.accumulating() if not final else _null()
            with ctx:
                if activations:
                    with to.offload_activations(min_bytes=0):
                        loss = loss_of(m, x, checkpointed)
                else:
                    loss = loss_of(m, x, checkpointed)
                loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def host_values(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize(
    "variant", ["plain", "checkpointed", "activations", "accumulate", "prefetch0"]
)
def test_streamed_training_is_bitwise_resident_training(variant):
    ref = gpt()
    m = copy.deepcopy(ref)
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref_opt = to.OffloadedOptimizer(ref.parameters(), torch.optim.AdamW, **kw)
    budget = 3 * block_bytes(m) + m.tok.weight.numel() * 4
    handle = to.stream_parameters(
        m, budget, prefetch_depth=0 if variant == "prefetch0" else 1, unit="blocks"
    )
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, **kw)
    run = dict(
        checkpointed=variant == "checkpointed",
        activations=variant == "activations",
        accumulate=2 if variant == "accumulate" else 1,
    )
    mine = train(m, opt, **run)
    theirs = train(ref, ref_opt, **run)
    assert [float(v) for v in mine] == [float(v) for v in theirs]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    got, want = host_values(m), host_values(ref)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # Between steps the streamed parameters hold no device bytes.
    assert all(p.untyped_storage().nbytes() == 0 for p in m.layers.parameters())
    stats = handle.stats()
    assert stats.backward_passes == 3 * run["accumulate"]
    assert stats.peak_loaded_bytes <= budget and stats.over_budget == 0
    if variant != "prefetch0":
        assert stats.prefetched > 0
    # remove() is refused while the optimizer steps the host store, then restores the values.
    with pytest.raises(RuntimeError, match="OffloadedOptimizer steps these parameters"):
        handle.remove()
    opt.remove()
    ref_opt.remove()
    handle.remove()
    for (k, p), (_, q) in zip(m.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), k
    assert m.head.weight is m.tok.weight


def test_units_hold_device_bytes_only_around_their_forward_and_backward():
    m = gpt()
    seen = []

    def probe(i):
        def hook(mod, args):
            loaded = [
                j for j, b in enumerate(m.layers) if b.fc1.weight.untyped_storage().nbytes() > 0
            ]
            seen.append((i, torch._C._current_graph_task_id() != -1, loaded))

        return hook

    for i, b in enumerate(m.layers):
        b.register_forward_pre_hook(probe(i))
    handle = to.stream_parameters(m, 10 * block_bytes(m), prefetch_depth=0)
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    for s in range(2):
        m.loss(tokens(s)).backward()
        opt.step()
        opt.zero_grad()
    # The probes run before the engine's own pre-hook: the unit itself is not loaded yet, and
    # with no prefetch no other block is either.
    assert [s for s in seen if s[2]] == []
    assert handle.stats().loads > 0
    opt.remove()
    handle.remove()


def test_saved_views_read_the_bytes_loaded_again_for_backward():
    """F.linear saves weight.t(), a view of the weight's storage: backward must read the
    weight loaded again into the same storage object, not whatever the dropped bytes became."""
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    ref = copy.deepcopy(m)
    x = torch.randn(4, 8)
    to.stream_parameters(m, 4096, unit=list(m), prefetch_depth=0)
    assert all(p.untyped_storage().nbytes() == 0 for p in m.parameters())
    m(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def frozen_base_and_adapter():
    """A frozen GPT and a trainable adapter on its logits, from the same seed each time."""
    torch.manual_seed(1)
    base = GPT(CFG)
    for p in base.parameters():
        p.requires_grad_(False)
    return base, nn.Linear(CFG.vocab, CFG.vocab)


def test_frozen_streamed_base_trains_resident_adapters_with_any_optimizer():
    build = frozen_base_and_adapter

    def step_all(base, adapter, opt):
        out = []
        for s in range(3):
            x = tokens(s)
            logits = adapter(base(x[:, :-1]))
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
        return out

    base, adapter = build()
    ref = step_all(base, adapter, torch.optim.AdamW(adapter.parameters(), lr=1e-2))
    base, adapter = build()
    handle = to.stream_parameters(base, 2 * block_bytes(base) + base.tok.weight.numel() * 4)
    got = step_all(base, adapter, torch.optim.AdamW(adapter.parameters(), lr=1e-2))
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert handle.stats().backward_passes == 0  # the base is not in the backward graph
    handle.remove()


def test_no_grad_forward_streams_like_inference():
    m = gpt()
    ref = copy.deepcopy(m)
    handle = to.stream_parameters(m, 2 * block_bytes(m) + m.tok.weight.numel() * 4)
    with torch.no_grad():
        for s in range(3):
            assert torch.equal(m(tokens(s)), ref(tokens(s)))
    assert handle.stats().prefetched > 0
    handle.remove()


def test_state_dict_returns_host_values_and_load_state_dict_writes_them():
    """One contract with stream_weights: state_dict() reads the host store, load_state_dict()
    writes it, and an OffloadedOptimizer then steps from the loaded values (as the plain
    optimizer class would after a load)."""
    m = gpt()
    ref = copy.deepcopy(m)
    want = copy.deepcopy(m.state_dict())
    handle = to.stream_parameters(m, 10 << 20)
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sd = m.state_dict()
    assert sd.keys() == want.keys()
    assert all(torch.equal(sd[k], want[k]) for k in want)
    for model, o in ((m, opt), (ref, ref_opt)):
        model.loss(tokens(0)).backward()
        o.step()
        o.zero_grad()
    assert not torch.equal(m.state_dict()["layers.0.fc1.weight"], want["layers.0.fc1.weight"])
    m.load_state_dict(want)
    ref.load_state_dict(want)
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
    for model, o in ((m, opt), (ref, ref_opt)):
        model.loss(tokens(1)).backward()
        o.step()
        o.zero_grad()
    got, expected = m.state_dict(), ref.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(RuntimeError, match="assign=True"):
        m.load_state_dict(want, assign=True)
    opt.remove()
    handle.remove()
    m.load_state_dict(want)


def test_a_parameter_assigned_to_a_streamed_module_is_in_the_state_dict():
    """``module.weight = nn.Parameter(w)`` while streamed: state_dict holds the new tensor, as
    the plain model's does (the hook had served the replaced tensor's host values)."""
    m, ref = gpt(), gpt()
    handle = to.stream_parameters(m, 3 * block_bytes(m))
    for model in (m, ref):
        with torch.no_grad():
            w = model.layers[0].fc1.weight * 0.5
        model.layers[0].fc1.weight = nn.Parameter(w.detach().clone())
    got, want = m.state_dict(), ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    handle.remove()


def test_bad_input_is_refused_before_anything_changes():
    m = gpt()
    with pytest.raises(ValueError, match="minimum budget"):
        to.stream_parameters(m, 1000)
    assert all(p.numel() > 0 for p in m.parameters())
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="build the optimizer after streaming"):
        to.stream_parameters(m, 10 << 20)
    opt.remove()
    handle = to.stream_parameters(m, 10 << 20)
    with pytest.raises(ValueError, match="already streamed"):
        to.stream_parameters(m, 10 << 20)
    with pytest.raises(ValueError, match="step_ahead"):
        to.OffloadedOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, step_ahead=True, model=m)
    with pytest.raises(TypeError, match="nn.Module"):
        to.stream_parameters(object(), 10 << 20)
    handle.remove()
    meta = torch.device("meta")
    with meta:
        mm = GPT(CFG)
    with pytest.raises(ValueError, match="meta device"):
        to.stream_parameters(mm, 10 << 20)


def test_unfreezing_after_setup_is_refused():
    m = gpt()
    m.layers[1].fc1.weight.requires_grad_(False)
    handle = to.stream_parameters(m, 10 << 20)
    m.layers[1].fc1.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="requires_grad"):
        m.loss(tokens(0))
    handle.remove()


def test_a_backward_that_raised_leaves_nothing_loaded_after_the_next_forward():
    m = gpt()
    handle = to.stream_parameters(m, 10 << 20)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    x = tokens(0)
    logits = m(x[:, :-1])
    with pytest.raises(RuntimeError, match="boom"):
        Boom.apply(logits).sum().backward()
    loss = m.loss(x)
    loss.backward()
    assert all(p.untyped_storage().nbytes() == 0 for p in m.layers.parameters())
    rt = handle._runtime
    assert rt.loaded_bytes == 0
    handle.remove()


@pytest.mark.parametrize("edit", ["mul_", "load_state_dict"])
def test_an_edit_after_a_backward_that_raised_inside_a_unit_reaches_the_host_store(edit):
    """Note: [A backward that raised]: the unit the failed pass left bound is unbound before
    the caller sees the error, so an edit then goes to the host store (it went to the device
    copy only, and the next forward dropped it)."""
    from torchoffload._hosted import is_placeholder

    ref = gpt()
    m = copy.deepcopy(ref)
    handle = to.stream_parameters(m, 10 << 20)
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    armed = [True]

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if armed[0]:
                raise RuntimeError("boom")
            return g

    for mm in (ref, m):  # inside layers[2]: its unit is bound when the backward raises
        mm.layers[2].qkv.register_forward_hook(lambda mod, args, out: Boom.apply(out))
    x = tokens(0)
    for mm in (ref, m):
        with pytest.raises(RuntimeError, match="boom"):
            mm.loss(x).backward()
    rt = handle._runtime
    assert rt.loaded_bytes > 0  # device bytes kept until the next forward, unbound
    assert all(is_placeholder(p) for p in m.layers.parameters())
    for mm in (ref, m):
        if edit == "mul_":
            with torch.no_grad():
                mm.layers[2].fc1.weight.mul_(0.9)
        else:
            sd = mm.state_dict()
            sd["layers.2.qkv.weight"] = sd["layers.2.qkv.weight"] * 0.5
            mm.load_state_dict(sd)
    assert host_values(m).keys() == host_values(ref).keys()
    for k, v in host_values(ref).items():
        assert torch.equal(host_values(m)[k], v), k
    armed[0] = False
    for mm, o in ((ref, ref_opt), (m, opt)):
        o.zero_grad()
        mm.loss(x).backward()
        o.step()
        o.zero_grad()
    got, want = host_values(m), host_values(ref)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert rt.loaded_bytes == 0
    opt.remove()
    handle.remove()


@pytest.mark.parametrize("edit", ["mul_", "load_state_dict"])
def test_an_edit_after_a_forward_that_raised_inside_a_unit_reaches_the_host_store(edit):
    """A unit whose forward raised is released like one that returned (its post-forward hook
    is always called): an edit before the next forward goes to the host store. Without that
    the unit stayed bound, the edit went to its device copy, reads showed it, and the next
    load (or remove()) brought back the host's values: the edit was lost."""
    from torchoffload._hosted import is_placeholder

    ref = gpt()
    m = copy.deepcopy(ref)
    handle = to.stream_parameters(m, 10 << 20)
    armed = [True]

    def boom(mod, args, out):
        if armed[0]:
            raise ValueError("boom")

    for mm in (ref, m):  # after layers[2].qkv computed, inside its unit
        mm.layers[2].qkv.register_forward_hook(boom)
    x = tokens(0)
    for mm in (ref, m):
        with pytest.raises(ValueError, match="boom"):
            mm.loss(x)
    assert all(is_placeholder(p) for p in m.layers.parameters())
    for mm in (ref, m):
        if edit == "mul_":
            with torch.no_grad():
                mm.layers[2].qkv.weight.mul_(0.9)
        else:
            sd = mm.state_dict()
            sd["layers.2.qkv.weight"] = sd["layers.2.qkv.weight"] * 0.5
            mm.load_state_dict(sd)
    armed[0] = False
    for mm in (ref, m):
        mm.loss(x).backward()
    for (name, p), q in zip(ref.named_parameters(), m.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    handle.remove()
    for (name, p), q in zip(ref.named_parameters(), m.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hugging_face_llama_with_gradient_checkpointing_is_bitwise(reentrant):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip

    def build():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.config.use_cache = False
        return m.train()

    def run(m, opt):
        out = []
        for s in range(3):
            x = tokens(s)
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
        return out

    ref = build()
    want = run(ref, to.OffloadedOptimizer(ref.parameters(), torch.optim.AdamW, lr=1e-2))
    m = build()
    layer = sum(p.numel() * 4 for p in m.model.layers[0].parameters())
    handle = to.stream_parameters(m, 2 * layer + m.lm_head.weight.numel() * 4)
    got = run(m, to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)
    sd, ref_sd = m.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    assert handle.stats().backward_passes == 3
    assert all(p.untyped_storage().nbytes() == 0 for p in m.model.layers.parameters())


def test_a_write_to_the_host_store_makes_a_loaded_copy_stale():
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    handle = to.stream_parameters(m, 4096, unit=list(m), prefetch_depth=0)
    rt = handle._runtime
    with rt._lock:
        rt._hold(rt.units[0])  # loaded, as a prefetch leaves it
    loads = rt.loads
    hosted = to._hosted.HOSTED[m[0].weight]
    hosted.before_write()  # what the optimizer's worker calls before writing
    hosted.host.fill_(1.0)
    with torch.no_grad():
        out = m[0](torch.ones(1, 8))
    assert rt.loads == loads + 1  # the weight's piece again, not the bias's
    assert torch.equal(out, 8.0 + handle.host_value(m[0].bias).view(1, 8))
    handle.remove()


def test_every_unit_checkpointed_reentrant_is_bitwise_and_leaves_nothing_loaded():
    """With reentrant checkpointing around every unit no forward hook registers a backward
    hook (the forward runs without gradients): the units are loaded by their recomputation,
    and dropped when their gradients are accumulated or the pass ends."""

    def build():
        torch.manual_seed(3)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])

    def run(m, opt):
        losses = []
        for s in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s)).requires_grad_()
            h = x
            for block in m:
                h = ckpt.checkpoint(block, h, use_reentrant=True)
            loss = h.square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    ref = build()
    want = run(ref, to.OffloadedOptimizer(ref.parameters(), torch.optim.AdamW, lr=1e-2))
    m = build()
    unit = sum(p.numel() * 4 for p in m[0].parameters())
    handle = to.stream_parameters(m, 2 * unit, unit=list(m))
    got = run(m, to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(handle.host_value(p), q.detach())
    stats = handle.stats()
    assert stats.backward_passes == 3 and handle._runtime.loaded_bytes == 0
    assert stats.peak_loaded_bytes <= 2 * unit


def test_two_forwards_then_one_backward_of_a_frozen_streamed_base():
    """A frozen unit used by two graphs is dropped only after both graphs' backward through it
    (each forward counts until its own backward has run or its graph is freed)."""

    build = frozen_base_and_adapter

    def step(base, adapter, emb_grad):
        a, b = tokens(0), tokens(1)
        # inputs that need gradients: every block applies the identity on them
        ea = base.tok(a[:, :-1]).requires_grad_(emb_grad)
        eb = base.tok(b[:, :-1]).requires_grad_(emb_grad)

        def logits(e):
            h = e + base.pos(torch.arange(e.shape[1]))
            for layer in base.layers:
                h = layer(h)
            return adapter(base.head(base.ln_f(h)))

        la, lb = logits(ea), logits(eb)
        dropped = logits(eb.detach().requires_grad_())  # a graph freed without backward
        del dropped
        (la.square().mean() + lb.square().mean()).backward()
        return [adapter.weight.grad.clone(), ea.grad.clone(), eb.grad.clone()]

    base, adapter = build()
    want = step(base, adapter, True)
    base, adapter = build()
    handle = to.stream_parameters(base, 10 << 20)
    got = step(base, adapter, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    rt = handle._runtime
    assert rt.loaded_bytes == 0 and all(u.inputs_pending == 0 for u in rt.units)
    handle.remove()


class _ResidualRMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.RMSNorm(4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc(self.norm(h))
        return self.head(h)


def test_a_units_input_used_inside_and_outside_it_sums_its_gradient_as_plain_autograd():
    """Fuzzer finding NEW-7: under unit="leaves" an identity node on the norm's input summed
    the norm's two uses of h before the residual's: emb.weight's gradient 3.7e-9 off. The
    unit's inputs are now watched by hooks, which add no node (Note: [When a unit's backward
    is done])."""
    ref, off = _ResidualRMSNorm(), _ResidualRMSNorm()
    handle = to.stream_parameters(off, budget_bytes=1 << 20, unit="leaves")
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 1, 2]])
    for m in (ref, off):
        m(x).square().mean().backward()
    for (name, p), q in zip(off.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    rt = handle._runtime
    assert rt.loaded_bytes == 0 and all(u.inputs_pending == 0 for u in rt.units)
    handle.remove()


class _WithEmpty(nn.Module):
    """Blocks holding a parameter and a buffer with no elements (their values exact all the
    same: sums of nothing)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.e = nn.Parameter(torch.empty(0, 8))
        self.register_buffer("z", torch.empty(8, 0).t())

    def forward(self, x):
        return self.a(x) + self.e.sum(0) + self.z.sum(0)


@pytest.mark.parametrize("meta", ["e", "z", "both"])
def test_a_tensor_with_no_elements_on_meta_is_made_on_the_device(meta):
    """Note: [Tensors with no elements] as in stream_weights: the same object made on the
    compute device with its geometry. It stayed on meta: the forward raised "Tensor on device
    meta is not on the expected device cpu!", state_dict() held a meta tensor, and so did the
    model after remove()."""
    torch.manual_seed(0)
    ref = nn.Sequential(_WithEmpty(), _WithEmpty())
    model = copy.deepcopy(ref)
    held = {}
    for block in model:
        if meta in ("e", "both"):
            block.e = nn.Parameter(torch.empty(0, 8, device="meta"))
        if meta in ("z", "both"):
            block.z = torch.empty(8, 0, device="meta").t()
        held[block] = (block.e, block.z)
    handle = to.stream_parameters(model, 1 << 20, device="cpu", unit=list(model),
                                  pin_memory=False)  # fmt: skip
    opt = to.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    for block, want in zip(model, ref, strict=True):
        assert (block.e, block.z) == held[block] and type(block.e) is nn.Parameter
        assert [(t.device, t.shape, t.stride()) for t in held[block]] == [
            (t.device, t.shape, t.stride()) for t in (want.e, want.z)]  # fmt: skip
    sd, want = model.state_dict(), ref.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    opt.remove()
    handle.remove()
    assert all(not t.is_meta for t in model.state_dict().values())
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
