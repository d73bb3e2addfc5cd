"""Weight streaming's module contract on a GPU: state_dict/load_state_dict with copies in
flight, .to(dtype), threads serving one model, and a KeyboardInterrupt mid-forward."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from conftest import in_threads
from test_weights_gpu import CFG, block_bytes, inputs, make
from torch import nn

from torchoffload import stream_weights, testing
from torchoffload.models import GPT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]


def _outs(model, xs):
    with torch.inference_mode():
        return [model(x) for x in xs]


def test_state_dict_and_load_state_dict_with_copies_in_flight():
    ref = make()
    torch.manual_seed(7)
    other = GPT(CFG).cuda().eval()
    xs = inputs(3)
    expected, expected_other = _outs(ref, xs), _outs(other, xs)
    model = make(device="cpu")
    h = stream_weights(model, "cuda", budget_bytes=3 * block_bytes() + 4096)
    with testing.slow_copies(cycles=2_000_000):
        with torch.inference_mode():
            for x, e in zip(xs, expected, strict=True):
                assert torch.equal(model(x), e)
            sd = model.state_dict()  # right after queued prefetches: waits for nothing wrong
        for k, v in ref.state_dict().items():
            assert sd[k].device.type == "cpu" and torch.equal(sd[k], v.cpu()), k
        model.load_state_dict(other.state_dict())
        for _ in range(2):
            outs = _outs(model, xs)
            assert all(torch.equal(o, e) for o, e in zip(outs, expected_other, strict=True))
    h.remove()
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p.cuda(), q)


def test_dtype_conversion_raises_and_remove_restores():
    model = make(device="cpu")
    values = [p.detach().clone() for p in model.parameters()]
    h = stream_weights(model, "cuda", budget_bytes=3 * block_bytes() + 4096)
    with pytest.raises(RuntimeError, match=r"model.to\(\).*Nothing was converted"):
        model.half()  # refused before any tensor is converted (Note: [Placeholders never answer])
    assert all(p.dtype == torch.float32 for p in model.parameters())
    h.remove()
    for p, v in zip(model.parameters(), values, strict=True):
        assert p.dtype == torch.float32 and p.device.type == "cpu" and torch.equal(p, v)


def test_threads_serve_one_streamed_model():
    ref = make()
    xs = inputs(4)
    expected = _outs(ref, xs)
    model = make(device="cpu")
    h = stream_weights(model, "cuda", budget_bytes=3 * block_bytes() + 4096)
    wrong = []

    def serve(k):
        for i in range(8):
            j = (k + i) % len(xs)
            out = _outs(model, [xs[j]])[0]
            torch.cuda.current_stream().synchronize()
            if not torch.equal(out, expected[j]):
                wrong.append((k, i))

    errors = in_threads(serve, range(3))
    print(f"\nthreads: {h.stats().calls} calls, wrong {wrong}, errors {errors}")
    assert not errors and not wrong and h.stats().calls == 24
    h.remove()


def test_keyboard_interrupt_with_copies_in_flight_recovers():
    ref = make()
    xs = inputs(2)
    expected = _outs(ref, xs)
    model = make(device="cpu")
    model.layers[3].ln1 = nn.Sequential(model.layers[3].ln1, testing.Interrupt())
    h = stream_weights(model, "cuda", budget_bytes=3 * block_bytes() + 4096, unit="blocks")
    before = torch.cuda.memory_allocated()
    with testing.slow_copies(cycles=2_000_000):
        _outs(model, xs)
        testing.Interrupt.armed = True
        with pytest.raises(KeyboardInterrupt):
            _outs(model, xs[:1])
        outs = _outs(model, xs)
    assert all(torch.equal(o, e) for o, e in zip(outs, expected, strict=True))
    assert h.stats().interrupted_calls == 1
    del outs
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
    h.remove()


def _break_like(resident, streamed, handle):
    """Graph breaks on ``resident`` where ``streamed`` has them: a no-op eager hook on the
    root and on each unit's module (the same compiled regions, so the same kernels)."""
    noop = torch.compiler.disable(lambda *args: None)
    names = {id(m): n for n, m in streamed.named_modules()}
    modules = dict(resident.named_modules())
    for module in [resident] + [modules[names[id(u.layout.module)]] for u in handle._runtime.units]:
        module.register_forward_pre_hook(noop)
        module.register_forward_hook(noop)


def _compiled_rounds(wrap=None, mode=None):
    """A streamed model and the resident one with graph breaks at the same units, each
    compiled and called over three rounds of `inputs` (copy stream slowed in the streamed
    model's last round); ``wrap`` makes the streamed model's callable from its handle and
    compiled model. Returns (streamed outputs, resident outputs, handle, callable, budget)."""
    torch._dynamo.reset()
    xs = inputs(4)
    model = make(torch.bfloat16, device="cpu")
    budget = 3 * block_bytes(torch.bfloat16) + 4096
    h = stream_weights(model, "cuda", budget_bytes=budget, unit="blocks")
    resident = make(torch.bfloat16)
    _break_like(resident, model, h)

    def rounds(fn, slow):
        out = []
        with torch.no_grad():
            for r in range(3):
                with testing.slow_copies(cycles=2_000_000) if slow and r == 2 else nullcontext():
                    out += [fn(x).clone() for x in xs]
        return out

    expected = rounds(torch.compile(resident, mode=mode), slow=False)
    torch._dynamo.reset()
    fn = torch.compile(model, mode=mode)
    fn = wrap(h, fn) if wrap is not None else fn
    return rounds(fn, slow=True), expected, h, fn, budget


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_of_a_streamed_model_on_cuda(mode):
    """torch.compile after stream_weights, copy stream slowed in the last round: outputs
    bitwise equal to the resident model compiled with graph breaks at the same units and
    called in the same order (Inductor's kernels depend on the regions and on which shapes
    were seen); the arena never above the budget."""
    got, expected, h, _, budget = _compiled_rounds(mode=mode)
    assert [torch.equal(g, e) for g, e in zip(got, expected, strict=True)] == [True] * len(got)
    s = h.stats()
    assert s.peak_device_bytes <= budget and s.h2d_copies > 0
    h.remove()
    torch._dynamo.reset()


def test_torch_compile_replayed_in_a_streamed_cuda_graph():
    """``handle.cuda_graph(torch.compile(model))``: Inductor's kernels and the weight copies in
    one CUDA graph (the compiled path with no host work per unit). Copy stream slowed in the
    last round; outputs bitwise those of the resident model compiled with the same graph
    breaks, called in the same order; replays primed (Note: [Primed replays]); the arena
    within its budget."""
    got, expected, h, g, budget = _compiled_rounds(lambda h, compiled: h.cuda_graph(compiled))
    assert [torch.equal(a, e) for a, e in zip(got, expected, strict=True)] == [True] * len(got)
    s, st = g.stats(), h.stats()
    # three shapes: each warmed up in round 0 (the fourth input is the first one's capture)
    assert (s.graphs, s.eager_calls, s.replays) == (3, 3, 9) and min(s.primed_units) > 0, s
    assert st.peak_device_bytes <= budget and st.h2d_copies > 0
    h.remove()
    torch._dynamo.reset()
