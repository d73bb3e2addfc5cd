"""Streamed calls replayed as CUDA graphs, on a GPU: bitwise parity with the copy stream
slowed, the arena within its budget, no host sync while replaying, and the cases where a
replay could read a stale weight (eager calls in between, load_state_dict, a new shape)."""

from __future__ import annotations

import gc

import pytest
import torch

from torchoffload import minimum_budget, stream_weights, testing
from torchoffload.models import GPT, GPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]

CFG = GPTConfig(hidden=512, layers=8, heads=8, vocab=4096, max_seq=256)


def make(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return GPT(CFG).to(dtype).cuda().eval()


def tokens(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab, shape, generator=g).cuda()


@pytest.mark.parametrize("budget_units", [3, 6, 100])  # 100: every unit kept, no copies
def test_replays_bitwise_with_slow_copies(budget_units):
    ref = make()
    xs = [tokens((2, 64), s) for s in range(8)] + [tokens((1, 33), s) for s in range(8, 12)]
    with torch.no_grad():
        expected = [ref(x) for x in xs]
    del ref
    model = make()
    budget = budget_units * minimum_budget(model, prefetch_depth=0)
    h = stream_weights(model, "cuda", budget_bytes=budget)
    g = h.cuda_graph(model)
    with testing.slow_copies():  # the graph's copies are slowed as well (captured sleeps)
        for i, (x, e) in enumerate(zip(xs, expected, strict=True)):
            out = g(x)
            assert torch.equal(out, e), i
    s, st = g.stats(), h.stats()
    assert (s.graphs, s.eager_calls, s.replays) == (2, 2, len(xs) - 2)
    assert st.graph_replays == len(xs) - 2 and st.peak_device_bytes <= budget
    assert (s.h2d_bytes_per_replay[0] > 0) == (st.kept_units < st.units)
    # Note: [Primed replays]: each replay copied the next one's first units (none to copy
    # when every unit is kept); a primed graph never had to copy them eagerly
    assert (min(s.primed_units) > 0) == (st.kept_units < st.units), s
    assert s.prime_loads == 0, s
    h.remove()


def test_device_memory_and_no_host_sync_while_replaying():
    model = make()
    budget = 3 * minimum_budget(model, prefetch_depth=0)
    h = stream_weights(model, "cuda", budget_bytes=budget)
    g = h.cuda_graph(model)
    x = tokens((2, 64), 0)
    for _ in range(3):
        g(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")  # raises on any synchronizing CUDA call
    try:
        for _ in range(20):
            g(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert h.stats().peak_device_bytes <= budget
    h.remove()


def test_eager_calls_load_state_dict_and_a_new_shape_between_replays():
    ref = make()
    model = make()
    h = stream_weights(model, "cuda", budget_bytes=6 * minimum_budget(model, prefetch_depth=0))
    g = h.cuda_graph(model)
    xs = [tokens((2, 40), s) for s in range(8)]
    with torch.no_grad(), testing.slow_copies():
        for x in xs[:3]:
            assert torch.equal(g(x), ref(x))
        assert h.stats().kept_units > 0
        assert torch.equal(model(xs[3]), ref(xs[3]))  # eager, on the same ring
        assert torch.equal(g(xs[4]), ref(xs[4]))
        new = make(seed=5)
        model.load_state_dict(new.state_dict())  # drops the kept units too
        assert torch.equal(g(xs[5]), new(xs[5]))
        y = tokens((1, 7), 9)
        assert torch.equal(g(y), new(y)) and torch.equal(g(y), new(y))  # warm-up, capture
        assert torch.equal(g(xs[6]), new(xs[6]))
    h.remove()


def test_a_primed_and_an_unprimed_graph_take_turns_on_one_handle():
    """Graphs with and without primes, and eager calls, on one arena (what the decode
    benchmark does row after row): each reads its own weights, copy stream slowed."""
    ref = make()
    model = make()
    h = stream_weights(model, "cuda", budget_bytes=6 * minimum_budget(model, prefetch_depth=0))
    primed, unprimed = h.cuda_graph(model), h.cuda_graph(model, prime=False)
    xs = [tokens((2, 40), s) for s in range(12)]
    with torch.no_grad(), testing.slow_copies():
        for i, x in enumerate(xs):
            fn = (primed, unprimed, model)[i % 3] if i >= 6 else (primed, unprimed)[i % 2]
            assert torch.equal(fn(x), ref(x)), i
    assert min(primed.stats().primed_units) > 0 and unprimed.stats().primed_units == (0,)
    assert h.stats().peak_device_bytes <= h.stats().budget_bytes
    h.remove()


@pytest.mark.parametrize("first_write", [1, 2])  # 1: in the warm-up; 2: only from the capture
def test_an_argument_written_in_place_is_held_by_the_graph(first_write):
    """Note: [Arguments written in place] on a GPU: a cache the step writes in place is
    updated in the caller's tensor by every replay, whether the warm-up showed the write (the
    graph holds it from its capture) or only the capture did (then it is captured again)."""
    ref, model = make(), make()
    h = stream_weights(model, "cuda", budget_bytes=3 * minimum_budget(model, prefetch_depth=0))
    calls = {"n": 0}

    def step(x, cache, m):
        calls["n"] += 1
        if calls["n"] >= first_write:
            cache.add_(1)
        return m(x)[:, -1]

    g = h.cuda_graph(lambda x, cache: step(x, cache, model))
    cache, expected_cache = torch.zeros(8, device="cuda"), torch.zeros(8, device="cuda")
    xs = [tokens((2, 16), s) for s in range(6)]
    with testing.slow_copies():
        for i, x in enumerate(xs):
            with torch.no_grad():
                expected = ref(x)[:, -1]
            expected_cache += i + 1 >= first_write
            assert torch.equal(g(x, cache), expected), i
            assert torch.equal(cache, expected_cache), i
    assert g.stats().captures == first_write  # 2: the capture saw the write and captured again
    h.remove()


def test_a_capture_that_fails_reports_its_cause_and_leaves_the_device_usable():
    """Note: [A capture that fails]: a step that syncs the host (``.item()``) cannot be
    captured; the caller gets the step's own error, not CUDA's "operation failed due to a
    previous error during capture"; the device's random generator still works (PyTorch leaves
    it in capture mode otherwise), nothing is held, and the handle serves the model as before."""
    ref, model = make(), make()
    h = stream_weights(model, "cuda", budget_bytes=3 * minimum_budget(model, prefetch_depth=0))
    x = tokens((2, 16), 0)

    def syncs(x):
        out = model(x)[:, -1]
        out.sum().item()  # a host sync: not allowed in a capture
        return out

    g = h.cuda_graph(syncs)
    with torch.no_grad():
        expected = ref(x)[:, -1]
        assert torch.equal(g(x), expected)  # the warm-up runs eagerly
        with pytest.raises(Exception) as info:
            g(x)  # the capture
    assert "previous error during capture" not in str(info.value), info.value
    assert "capturing" in str(info.value), info.value  # CUDA's reason for the sync
    torch.randint(0, 10, (4,), device="cuda")  # raised "Offset increment outside graph capture"
    assert g.stats().captures == 0
    with torch.no_grad():
        assert torch.equal(model(x)[:, -1], expected)  # eager, after the failed capture
        good = h.cuda_graph(lambda x: model(x)[:, -1])
        for _ in range(3):
            assert torch.equal(good(x), expected)
    assert good.stats().replays == 2  # the capturing call replays too
    h.remove()


def test_a_graph_freed_by_the_collector_during_a_capture_does_not_fail_it():
    """Note: [Nothing collected during a capture]: a captured CUDA graph that only a reference
    cycle keeps, freed when the cyclic collector runs inside a later capture, destroyed its CUDA
    graph there ("operation not permitted when stream is capturing (function reset)") and the
    capture failed at its first kernel. Here the cycle is made during the capture, with the
    collector's threshold at 1 so that the next allocation would collect it."""
    ref, model = make(), make()
    h = stream_weights(model, "cuda", budget_bytes=3 * minimum_budget(model, prefetch_depth=0))
    x = tokens((2, 16), 0)
    old = torch.cuda.CUDAGraph()
    static = torch.ones(4, device="cuda")
    with torch.cuda.graph(old):
        static.mul_(2)
    pending, calls = [old], []
    del old

    def fn(x):
        calls.append(1)
        if len(calls) == 2:  # the capture (the first call is the eager warm-up)
            cycle = [pending.pop()]
            cycle.append(cycle)
            del cycle
            _ = [[] for _ in range(100)]  # tracked allocations: a collection, if one may run
        return model(x)[:, -1]

    g = h.cuda_graph(fn)
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        with torch.no_grad():
            expected = ref(x)[:, -1]
            for _ in range(3):
                assert torch.equal(g(x), expected)
    finally:
        gc.set_threshold(*threshold)
    assert len(calls) == 2 and g.stats().replays == 2
    gc.collect()  # the cycle, freed outside the capture
    h.remove()


def test_static_inputs_mirror_their_arguments():
    """Note: [Static inputs mirror their arguments], on a GPU. A compiled model whose warm-up
    saw a normal tensor (made outside inference mode, called inside it) is not compiled again
    inside the capture, where Inductor's compile fails ("operation not permitted when stream is
    capturing"); and a graph captured under inference mode, its argument an inference tensor,
    replays outside inference mode."""
    model = make()
    h = stream_weights(model, "cuda", budget_bytes=3 * minimum_budget(model, prefetch_depth=0))
    try:
        g = h.cuda_graph(torch.compile(model))
        x = tokens((2, 64), 0)
        with torch.inference_mode():
            expected = g(x).clone()  # the warm-up compiles
            with torch._dynamo.config.patch(error_on_recompile=True):
                for _ in range(3):  # the capture, then replays
                    assert torch.equal(g(x), expected)
        torch._dynamo.reset()
        g2 = h.cuda_graph(model)
        with torch.inference_mode():
            y, z = tokens((2, 64), 1), tokens((2, 64), 1)  # inference tensors
            g2(y)  # the warm-up
            first = g2(y).clone()  # the capture
        with torch.no_grad():
            assert torch.equal(g2(z), first)  # a replay outside inference mode
        assert (g.stats().replays, g2.stats().replays) == (3, 2)
    finally:
        torch._dynamo.reset()
        h.remove()


@pytest.mark.parametrize("change", ["assign a streamed", "assign a resident", "data"])
def test_replays_after_the_model_holds_other_tensors(change):
    """A tensor assigned, or a resident tensor's storage replaced, between replays: outputs
    are the resident model's with the change (a replay of the old graph read the old
    addresses; Note: [The model a graph was captured with])."""
    ref, model = make(), make()
    budget = 3 * minimum_budget(model, prefetch_depth=0, resident=["pos"])
    h = stream_weights(model, "cuda", budget_bytes=budget, prefetch_depth=0, resident=["pos"])
    g = h.cuda_graph(model)
    x = tokens((2, 64), 0)
    with testing.slow_copies(cycles=2_000_000), torch.no_grad():
        for _ in range(3):
            g(x)
        for m in (ref, model):
            if change == "assign a streamed":
                m.layers[1].fc1.weight = torch.nn.Parameter(m.layers[1].fc1.weight * -2.0)
            elif change == "assign a resident":
                m.pos.weight = torch.nn.Parameter(m.pos.weight * -2.0)
            else:
                m.pos.weight.data = m.pos.weight.detach() * -2.0
        expected = ref(x)
        assert torch.equal(g(x), expected)
        assert torch.equal(g(x), expected)
    assert g.stats().captures == 2
    h.remove()
