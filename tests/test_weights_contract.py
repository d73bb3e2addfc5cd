"""Weight streaming around the forward: the layout choice, module operations (`.to()`,
`state_dict`, `load_state_dict`, deepcopy, pickling), threads and interrupted calls. CPU."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
from conftest import in_threads
from test_weights import QuantStack, make, stream, tokens  # tests/ is on sys.path
from torch import nn

from torchoffload import minimum_budget, testing
from torchoffload.models import GPT, GPTConfig


def outputs(model, xs):
    with torch.no_grad():
        return [model(x) for x in xs]


# -- the layout that is chosen is the layout that is used ----------------------------------------


@pytest.mark.parametrize("depth", [3, 7, 100])
def test_blocks_kept_when_leaves_do_not_fit(depth):
    """At the least budget of a deep pipeline, blocks fit and leaves do not: the blocks layout
    must be the one the host store was filled by (a failed candidate once left its offsets)."""
    torch.manual_seed(0)
    ref = GPT(GPTConfig(hidden=128, layers=4, heads=4)).eval()
    model = copy.deepcopy(ref)
    x = torch.randint(0, 1024, (2, 16))
    budget = minimum_budget(model, prefetch_depth=depth)
    h = stream(model, budget, prefetch_depth=depth)
    for _ in range(3):
        assert torch.equal(outputs(model, [x])[0], outputs(ref, [x])[0])
    h.remove()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


# -- .to() ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.double(),
    ],
)
def test_dtype_conversion_while_streaming_raises_and_remove_restores(convert):
    ref = make()
    model = copy.deepcopy(ref)
    h = stream(model, 1 << 22, resident=("ln_f",))
    with pytest.raises(RuntimeError, match=r"model.to\(\).*Nothing was converted.*remove\(\)"):
        convert(model)
    # Refused before any tensor changed: resident ones too, and the model still runs.
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
    assert torch.equal(outputs(model, [tokens()])[0], outputs(ref, [tokens()])[0])
    h.remove()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
    assert torch.equal(outputs(model, [tokens()])[0], outputs(ref, [tokens()])[0])


def test_same_device_to_is_harmless():
    ref = make()
    model = copy.deepcopy(ref)
    h = stream(model, 1 << 22)
    model.to("cpu").float().eval()
    assert torch.equal(outputs(model, [tokens()])[0], outputs(ref, [tokens()])[0])
    h.remove()


# -- state_dict / load_state_dict ---------------------------------------------------------------


def test_state_dict_holds_the_real_values():
    ref = make()
    model = copy.deepcopy(ref)
    h = stream(model, 1 << 22, resident=("ln_f",))
    outputs(model, [tokens()])
    sd = model.state_dict()
    expected = ref.state_dict()
    assert list(sd) == list(expected)
    for k, v in expected.items():
        assert torch.equal(sd[k], v), k
    # Tied weights share one storage, as in the model; others do not alias each other.
    assert (
        sd["tok.weight"].untyped_storage().data_ptr()
        == sd["head.weight"].untyped_storage().data_ptr()
    )
    assert (
        sd["layers.0.fc1.weight"].untyped_storage().data_ptr()
        != sd["layers.0.fc2.weight"].untyped_storage().data_ptr()
    )
    # A submodule's own state_dict, and a round trip through torch.save.
    sub = model.layers[1].state_dict()
    assert torch.equal(sub["fc1.weight"], ref.layers[1].fc1.weight)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = GPT(ref.config).eval()
    fresh.load_state_dict(torch.load(buf))
    assert torch.equal(outputs(fresh, [tokens()])[0], outputs(ref, [tokens()])[0])
    assert all(  # placeholders: no device bytes (Note: [Placeholders never answer])
        p.untyped_storage().nbytes() == 0
        for n, p in model.named_parameters()
        if not n.startswith("ln_f")
    )
    h.remove()


def test_load_state_dict_writes_the_host_store():
    ref = make()
    torch.manual_seed(5)
    other = GPT(ref.config).eval()  # other weights, same shapes
    model = copy.deepcopy(ref)
    h = stream(model, 3 * (1 << 20), prefetch_depth=1)
    for _ in range(3):  # units loaded and kept in the arena
        outputs(model, [tokens()])
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for _ in range(2):
        assert torch.equal(outputs(model, [tokens()])[0], outputs(other, [tokens()])[0])
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in other.state_dict().items())
    h.remove()
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)


def test_load_state_dict_rejects_what_does_not_fit():
    model = make()
    h = stream(model, 1 << 22)
    bad = model.state_dict()
    bad["layers.0.fc1.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"layers.0.fc1.weight.*shape \[256, 64\]"):
        model.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="assign=True"):
        model.load_state_dict(model.state_dict(), assign=True)
    assert torch.equal(model.state_dict()["layers.0.fc2.bias"], make().layers[0].fc2.bias)
    h.remove()


@pytest.mark.parametrize("on", ["model", "layer"])
def test_load_state_dict_assign_is_refused_before_anything_is_assigned(on):
    """The refusal comes before any module loads (an error appended to load_state_dict's list
    is raised after every module has: the tensors were replaced by then, resident ones too)."""
    model = make()
    h = stream(model, 1 << 22, resident=("ln_f",))
    target = model if on == "model" else model.layers[0]
    before = {n: (p, p.detach().clone()) for n, p in target.named_parameters()}
    sd = {k: v * 2 for k, v in target.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"assign=True.*Nothing was loaded"):
        target.load_state_dict(sd, assign=True)
    for n, p in target.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    # a state dict of resident tensors only is not the streamed ones': assigned as usual
    w = model.ln_f.weight.detach() * 3
    model.load_state_dict({"ln_f.weight": w}, strict=False, assign=True)
    assert model.ln_f.weight is not before.get("ln_f.weight", (None,))[0]
    h.remove()


def test_a_parameter_assigned_to_a_streamed_module_is_the_modules_own():
    """``module.weight = nn.Parameter(w)`` while streaming: the module computes with it, and
    state_dict and load_state_dict read and write it, as in the resident model (the engine's
    state_dict hook had served the replaced tensor's host values)."""
    ref, model = make(), make()
    h = stream(model, 1 << 22)
    for m in (ref, model):
        with torch.no_grad():
            w = m.layers[0].fc1.weight * 0.5
        m.layers[0].fc1.weight = nn.Parameter(w.detach().clone())
    assert torch.equal(outputs(model, [tokens()])[0], outputs(ref, [tokens()])[0])
    assert torch.equal(model.state_dict()["layers.0.fc1.weight"], ref.layers[0].fc1.weight)
    new = {k: v + 1 for k, v in ref.state_dict().items()}
    ref.load_state_dict(new)
    model.load_state_dict(new)
    assert torch.equal(outputs(model, [tokens()])[0], outputs(ref, [tokens()])[0])
    assert torch.equal(model.layers[0].fc1.weight, new["layers.0.fc1.weight"])
    h.remove()


def test_composite_weights_state_dict_round_trip():
    x = torch.randn(5, 32)
    ref = QuantStack()
    model = QuantStack()  # same seed: same weights
    h = stream(model, 1 << 20, prefetch_depth=1, unit="leaves")
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert type(sd[k]) is type(v)
        if hasattr(v, "qdata"):
            assert torch.equal(sd[k].qdata, v.qdata) and torch.equal(sd[k].scale, v.scale)
        elif hasattr(v, "buffers"):
            pairs = [*zip(sd[k].buffers, v.buffers, strict=True), (sd[k].scales, v.scales)]
            assert all(torch.equal(a, b) for a, b in pairs)
        else:
            assert torch.equal(sd[k], v), k
    model.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    h.remove()


# -- copies -------------------------------------------------------------------------------------


def test_deepcopy_and_pickle_name_the_cause():
    model = make()
    h = stream(model, 1 << 22)
    for op in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match=r"stream_weights is active.*remove\(\)"):
            op(model)
    h.remove()
    copy.deepcopy(model)


def test_minimum_budget_and_streaming_a_streamed_model_name_the_cause():
    model = make()
    h = stream(model, 1 << 22)
    with pytest.raises(RuntimeError, match="already streams"):
        minimum_budget(model)
    with pytest.raises(RuntimeError, match="'0.ln1.weight' already streams with another model"):
        stream(nn.Sequential(model.layers[0]), 1 << 22)
    with pytest.raises(RuntimeError, match="already streams"):
        stream(model.layers[0], 1 << 22)
    h.remove()
    assert minimum_budget(model) > 0


# -- threads and interrupted calls -----------------------------------------------------------------


def test_threads_share_one_streamed_model():
    ref = make()
    model = copy.deepcopy(ref)
    h = stream(model, 3 * (1 << 20) // 2, prefetch_depth=1)
    xs = [tokens(2, s, seed=s) for s in (4, 9, 16, 23)]
    expected = outputs(ref, xs)
    wrong = []

    def serve(k):
        for i in range(12):
            j = (k + i) % len(xs)
            with torch.no_grad():
                out = model(xs[j])
            if not torch.equal(out, expected[j]):
                wrong.append((k, i))

    errors = in_threads(serve, range(4))
    assert not errors and not wrong
    assert h.stats().calls == 48
    h.remove()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def _interruptible():
    ref = make()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.layers[2].ln2 = nn.Sequential(m.layers[2].ln2, testing.Interrupt())
    return ref, model


@pytest.mark.parametrize("then", ["call", "remove", "other_thread"])
def test_keyboard_interrupt_mid_forward_recovers(then):
    ref, model = _interruptible()
    h = stream(model, 1 << 22, unit="blocks")
    x = tokens()
    outputs(model, [x])
    testing.Interrupt.armed = True
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(x)
    assert any(u.busy for u in h._runtime.units)  # left bound: the hooks' cleanup did not run
    if then == "call":
        assert torch.equal(outputs(model, [x])[0], outputs(ref, [x])[0])
        assert h.stats().interrupted_calls == 1
    elif then == "other_thread":
        out = []
        t = threading.Thread(target=lambda: out.append(outputs(model, [x])[0]))
        t.start()
        t.join(timeout=30)
        assert out and torch.equal(out[0], outputs(ref, [x])[0])
    h.remove()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def test_remove_inside_a_forward_is_refused_and_changes_nothing():
    model = make()
    h = stream(model, 1 << 22, unit="blocks")
    seen = []

    def hook(module, args):
        with pytest.raises(RuntimeError, match="running its forward"):
            h.remove()
        seen.append(True)

    model.layers[1].fc1.register_forward_pre_hook(hook)
    outputs(model, [tokens()])
    assert seen and not h.removed
    h.remove()


@pytest.mark.parametrize("unit", ["blocks", "leaves"])
def test_torch_compile_of_a_streamed_model_matches_the_compiled_resident_model(unit):
    """torch.compile(model) after stream_weights: the hooks break the graph at every unit, each
    unit's forward is compiled once (the blocks share their code) and binds its weights as in
    eager; outputs bitwise equal to the compiled resident model, the arena within budget."""
    torch._dynamo.reset()
    ref = torch.compile(make())
    model = make()
    budget = minimum_budget(model, unit=unit)
    h = stream(model, budget, unit=unit)
    compiled = torch.compile(model)
    with torch.no_grad():
        for seq in (16, 16, 9, 16):
            x = tokens(seq=seq)
            assert torch.equal(compiled(x), ref(x))
    s = h.stats()
    assert s.calls == 4 and s.h2d_copies > 0 and s.peak_device_bytes <= budget
    h.remove()
    torch._dynamo.reset()


def test_torch_compile_fullgraph_of_a_streamed_model_is_refused_by_dynamo():
    """A streamed model cannot be one graph: its hooks run eagerly between units."""
    torch._dynamo.reset()
    model = make()
    h = stream(model, 1 << 22, unit="blocks")
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception, match="disable"):
        compiled(tokens())
    h.remove()
    torch._dynamo.reset()


def test_hooks_added_after_streaming_see_bound_then_empty_weights():
    model = make()
    h = stream(model, 1 << 22, unit="blocks")
    seen = {}
    fc1 = model.layers[2].fc1

    def nbytes(w):
        return w.untyped_storage().nbytes()

    model.layers[2].register_forward_pre_hook(lambda m, a: seen.update(pre=nbytes(fc1.weight)))
    model.layers[2].register_forward_hook(lambda m, a, o: seen.update(post=nbytes(fc1.weight)))
    outputs(model, [tokens()])
    assert seen["pre"] >= 256 * 64 * 4 and seen["post"] == 0  # fc1: 4 * hidden x hidden
    assert fc1.weight.numel() == 256 * 64  # a placeholder answers with the real geometry
    h.remove()
