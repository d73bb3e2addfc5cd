"""`WeightStreamHandle.cuda_graph` on the CPU: the bookkeeping of calls replayed as graphs
(signatures, warm-up, static inputs and outputs, the ring reset, kept units, counters) runs
with the runtime in capture mode and no graph (tests/test_weights_graph_gpu.py captures)."""

from __future__ import annotations

import threading

import pytest
import torch

from torchoffload import minimum_budget, stream_weights
from torchoffload.models import GPT, GPTConfig
from torchoffload.weights import StreamedGraph

CFG = GPTConfig(hidden=64, layers=4, heads=2, vocab=256, max_seq=64)


def make(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG).eval()


def tokens(shape, seed):
    return torch.randint(0, CFG.vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def streamed():
    ref = make()
    model = make()
    budget = 2 * minimum_budget(model)
    h = stream_weights(model, "cpu", budget_bytes=budget)
    yield ref, model, h
    h.remove()


def test_replays_match_the_resident_model(streamed):
    ref, model, h = streamed
    g = h.cuda_graph(model)
    assert isinstance(g, StreamedGraph)
    shapes = [(2, 16)] * 4 + [(1, 9)] * 3 + [(2, 16)] * 2
    for i, shape in enumerate(shapes):
        x = tokens(shape, i)
        with torch.no_grad():
            expected = ref(x)
        assert torch.equal(g(x), expected), i
    s = g.stats()
    # per signature: one warm-up, one capture; every later call (and the capturing one) replays
    assert (s.graphs, s.captures, s.eager_calls, s.replays) == (2, 2, 2, 7)
    st = h.stats()
    assert st.calls == 9 and st.graph_replays == 7
    assert st.peak_device_bytes <= st.budget_bytes
    assert s.h2d_bytes_per_replay[0] > 0


def test_outputs_are_static_and_inputs_copied(streamed):
    ref, model, h = streamed
    g = h.cuda_graph(model)
    x0, x1, x2 = (tokens((2, 8), s) for s in range(3))
    g(x0)  # warm-up
    out1 = g(x1)  # captured
    kept = out1.clone()
    out2 = g(x2)
    assert out2 is out1  # the graph's static output, overwritten by its next replay
    with torch.no_grad():
        assert torch.equal(kept, ref(x1)) and torch.equal(out2, ref(x2))
    x2.zero_()  # the graph copied it: changing the caller's tensor changes nothing
    with torch.no_grad():
        assert not torch.equal(g(tokens((2, 8), 2)), ref(x2))


def test_eager_calls_between_replays_and_load_state_dict(streamed):
    ref, model, h = streamed
    g = h.cuda_graph(model)
    xs = [tokens((2, 12), s) for s in range(6)]
    for x in xs[:3]:
        g(x)
    assert h.stats().kept_units > 0  # the case where a replay reads units it never copies
    with torch.no_grad():
        assert torch.equal(model(xs[3]), ref(xs[3]))  # eager, on the ring the replays use
        assert torch.equal(g(xs[4]), ref(xs[4]))
        new = make(seed=7)
        model.load_state_dict(new.state_dict())  # clears the arena, kept units included
        assert torch.equal(g(xs[5]), new(xs[5]))
        assert torch.equal(model(xs[0]), new(xs[0]))


def test_beyond_max_graphs_calls_run_eagerly(streamed):
    ref, model, h = streamed
    g = h.cuda_graph(model, max_graphs=1)
    for i, shape in enumerate([(1, 4), (1, 4), (1, 5), (1, 5), (1, 4)]):
        x = tokens(shape, i)
        with torch.no_grad():
            assert torch.equal(g(x), ref(x))
    s = g.stats()
    assert (s.graphs, s.eager_calls, s.replays) == (1, 3, 2)


def test_non_tensor_arguments_are_part_of_the_signature(streamed):
    ref, model, h = streamed

    def step(x, scale):
        return model(x) * scale

    g = h.cuda_graph(step)
    x = tokens((1, 6), 0)
    with torch.no_grad():
        base = ref(x)
    for scale in (1.0, 2.0, 1.0, 2.0, 1.0, 2.0):
        assert torch.equal(g(x, scale), base * scale)
    assert g.stats().graphs == 2
    with pytest.raises(TypeError, match="argument 1 .* neither a tensor nor hashable"):
        g(x, {1.0})


def test_a_failing_call_leaves_the_runtime_usable(streamed):
    ref, model, h = streamed
    calls = []

    def step(x):
        calls.append(1)
        if len(calls) == 2:  # the capturing call
            raise RuntimeError("boom")
        return model(x)

    g = h.cuda_graph(step)
    x = tokens((1, 6), 0)
    g(x)
    with pytest.raises(RuntimeError, match="boom"):
        g(x)
    rt = h._runtime
    assert not rt.capturing and rt._call is None and not any(u.busy for u in rt.units)
    assert rt._lock.acquire(blocking=False)  # not left held by the failed capture
    rt._lock.release()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        assert torch.equal(g(x), ref(x))
        assert torch.equal(g(x), ref(x))


def test_another_thread_waits_for_a_capture(streamed):
    ref, model, h = streamed
    x = tokens((1, 6), 0)
    started, results = threading.Event(), []

    def step(t):
        started.set()
        return model(t)

    g = h.cuda_graph(step)
    g(x)

    def other():
        started.wait()
        with torch.no_grad():
            results.append(torch.equal(model(x), ref(x)))

    t = threading.Thread(target=other)
    t.start()
    with torch.no_grad():
        assert torch.equal(g(x), ref(x))
    t.join()
    assert results == [True]


def test_removed_handle_and_bad_arguments(streamed):
    ref, model, h = streamed
    with pytest.raises(TypeError, match="fn"):
        h.cuda_graph(3)
    with pytest.raises(ValueError, match="max_graphs"):
        h.cuda_graph(model, max_graphs=0)
    g = h.cuda_graph(model)
    h.remove()
    with pytest.raises(RuntimeError, match="removed"):
        g(tokens((1, 4), 0))
    with pytest.raises(RuntimeError, match="removed"):
        h.cuda_graph(model)


def arena_consistent(rt):
    """The invariants a replay relies on: kept units at their fixed places, regions sorted and
    disjoint (a kept unit left in the ring would be overwritten by the next replay's copies)."""
    regions = rt.arena.regions
    assert all(a.end <= b.start for a, b in zip(regions, regions[1:], strict=False)), regions
    for u in rt.units:
        if u.fixed is not None:
            assert u.loc == u.fixed, (u.name, u.loc, u.fixed)


def test_kept_units_sit_at_their_places_for_every_replay():
    ref, model = make(), make()
    # the first call loads every unit in the ring; kept places are fixed at its end
    h = stream_weights(model, "cpu", budget_bytes=3 * minimum_budget(model))  # kept: 7 of 28
    g = h.cuda_graph(model)
    x = tokens((2, 10), 0)
    with torch.no_grad():
        expected = ref(x)
    for i in range(4):
        assert torch.equal(g(x), expected)
        if i >= 1:  # captured
            assert h.stats().kept_units > 0
            arena_consistent(h._runtime)
    h.remove()


def test_a_failed_warm_up_is_no_warm_up():
    """A capture needs the schedule and the kept places of a completed eager call: after a
    warm-up that raised, the next call is a warm-up again (a graph captured before the kept
    places were fixed would copy into them at every replay)."""
    ref, model = make(), make()
    h = stream_weights(model, "cpu", budget_bytes=3 * minimum_budget(model))
    fail = [True]

    def step(x):
        if fail.pop() if fail else False:
            raise RuntimeError("first call fails")
        return model(x)

    g = h.cuda_graph(step)
    x = tokens((2, 10), 0)
    with pytest.raises(RuntimeError, match="first call fails"):
        g(x)
    with torch.no_grad():
        expected = ref(x)
    for _ in range(3):
        assert torch.equal(g(x), expected)
    s = g.stats()
    assert (s.eager_calls, s.captures, s.replays) == (2, 1, 2)
    entry = next(iter(g._graphs.values()))
    assert entry.arena == g._arena_state() and h.stats().kept_units > 0
    h.remove()


def test_a_graph_is_recaptured_when_the_kept_places_change(streamed):
    ref, model, h = streamed
    g = h.cuda_graph(model)
    x = tokens((2, 10), 0)
    with torch.no_grad():
        expected = ref(x)
    for _ in range(3):
        g(x)
    entry = next(iter(g._graphs.values()))
    entry.arena = ("another split",)  # as if the arena had been planned again since
    assert torch.equal(g(x), expected)
    assert g.stats().captures == 2
