"""`WeightStreamHandle.cuda_graph` on the CPU: the bookkeeping of calls replayed as graphs
(signatures, warm-up, static inputs and outputs, the ring reset, kept units, counters) runs
with the runtime in capture mode and no graph (tests/test_weights_graph_gpu.py captures)."""

from __future__ import annotations

import copy
import gc
import threading
import warnings

import pytest
import torch

from torchoffload import minimum_budget, stream_weights, testing
from torchoffload.models import GPT, GPTConfig
from torchoffload.weights import HostReadInCapture, StreamedGraph

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
    assert entry.arena == h._runtime.graph_state() and h.stats().kept_units > 0
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


def test_a_replay_copies_the_next_replays_first_units():
    """Note: [Primed replays]: a replay's first ring units were copied by the replay before it
    (at its end, while its last units computed), so a replay starts with no copy to wait for
    and still copies each streamed unit once."""
    ref, model = make(), make()
    h = stream_weights(model, "cpu", budget_bytes=3 * minimum_budget(model))
    g = h.cuda_graph(model)
    x = tokens((2, 10), 0)
    with torch.no_grad():
        expected = ref(x)
    for _ in range(3):  # warm-up, capture, and a replay that starts where the last ended
        assert torch.equal(g(x), expected)
    rt = h._runtime
    entry = next(iter(g._graphs.values()))
    ring = [rt.units[i] for i in dict.fromkeys(rt.schedule.order) if rt.units[i].fixed is None]
    reach = 2 * max(u.nbytes for u in ring)  # prefetch_depth of the largest, in bytes
    first = [u.index for k, u in enumerate(ring) if sum(v.nbytes for v in ring[: k + 1]) <= reach]
    assert len(first) == 3  # tok, pos, layers.0.qkv: more than 2 units, as they are smaller
    assert [i for i, _ in entry.primes] == first
    hooks = testing.weight_test_hooks(h, trace=True)
    before, loads_before = h.stats(), g.stats().prime_loads
    for _ in range(3):
        assert torch.equal(g(x), expected)
    after = h.stats()
    assert after.misses == before.misses  # no unit of the three replays was fetched on demand
    ring = [u for u in rt.units if u.fixed is None and u.index in rt.schedule.order]
    assert after.h2d_bytes - before.h2d_bytes == 3 * sum(u.layout.copy_bytes for u in ring)
    loads = [name for kind, name, *_ in hooks.trace if kind == "load"]
    reads = [name for kind, name, *_ in hooks.trace if kind == "read"]
    names = [rt.units[i].name for i in first]
    assert loads[-len(names) :] == names  # the last replay ended by loading the next one's
    assert reads[0] == names[0] and names[0] not in loads[: loads.index(names[0])]
    s = g.stats()
    assert s.primed_units == (3,) and s.prime_loads == loads_before  # none copied eagerly
    h.remove()


def test_primes_leave_room_for_the_calls_tail():
    """Note: [Primed replays]: the primes and the call's tail (its last ``prefetch_depth + 1``
    ring units, placed above the primes) fit in the ring together, so the tail's copies do not
    wait for its own compute. Eight small layers, then four large ones at the end: under the
    old rule (room for two of the largest above the primes) all eight small layers were primed
    and the tail, three large units, did not fit beside them."""
    torch.manual_seed(0)
    small = [torch.nn.Linear(32, 32) for _ in range(8)]
    large = [torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Linear(256, 32))
             for _ in range(4)]  # fmt: skip
    ref = torch.nn.Sequential(*small, *large).eval()
    model = copy.deepcopy(ref)
    least = minimum_budget(model, unit="leaves")
    h = stream_weights(model, "cpu", budget_bytes=least * 6 // 5, unit="leaves")
    g = h.cuda_graph(model)
    for i in range(4):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            assert torch.equal(g(x), ref(x)), i
    rt = h._runtime
    ring = [rt.units[i] for i in rt.schedule.order if rt.units[i].fixed is None]
    tail = sum(u.nbytes for u in ring[-3:])  # prefetch_depth 2, plus the one computing
    primes = next(iter(g._graphs.values())).primes
    assert 0 < len(primes) < 8, primes
    assert sum(rt.units[i].nbytes for i, _ in primes) + tail <= rt.arena.ring_cap
    assert g.stats().primed_units == (len(primes),)
    h.remove()


def test_primes_lost_to_an_eager_call_or_a_load_are_copied_before_the_replay(streamed):
    ref, model, h = streamed
    g = h.cuda_graph(model)
    x, y = tokens((2, 12), 0), tokens((1, 5), 1)
    for _ in range(3):
        g(x)
    entry = next(iter(g._graphs.values()))
    assert entry.primes
    rt = h._runtime

    def replay(model_ref):
        loads, misses = g.stats().prime_loads, h.stats().misses
        assert torch.equal(g(x), model_ref(x))
        assert h.stats().misses == misses  # its first units were loaded before it started
        return g.stats().prime_loads - loads

    with torch.no_grad():
        for z in (y, y):  # eager calls on the same ring (they find the primes as hits)
            assert torch.equal(model(z), ref(z))
        replay(ref)  # copies the primes first if the eager calls moved them
        assert replay(ref) == 0  # the replay before left them
        rt.arena.drop(rt.units[entry.primes[0][0]])  # as if another call had overwritten it
        assert replay(ref) == 1
        new = make(seed=3)
        model.load_state_dict(new.state_dict())  # the primes hold the old values: dropped
        assert replay(new) == 1


def test_resetting_the_ring_leaves_disjoint_regions_of_loaded_units(streamed):
    """`reset_ring` runs around every capture and replay: what it leaves must be sorted,
    disjoint regions, each of a unit loaded there or a tombstone, or a later copy may miss
    the event it must wait on (a bisection over overlapping regions skips the tombstone)."""
    from torchoffload.weights._arena import DebugEvent

    ref, model, h = streamed
    rt = h._runtime
    x = tokens((2, 12), 0)
    arena = rt.arena
    for n_keep in (0, 1):
        with torch.no_grad():
            model(x)
            model(x)  # kept units fixed, ring units loaded
        keep = tuple(u for u in rt.units if u.loc is not None and u.fixed is None)[:n_keep]
        assert any(u.loc is not None and u.fixed is None for u in rt.units)
        arena.reset_ring(rt.units, DebugEvent("after"), keep=keep)
        regions = arena.regions
        assert all(a.end <= b.start for a, b in zip(regions, regions[1:], strict=False))
        assert [r.start for r in regions] == arena.starts
        covered = sum(r.end - r.start for r in regions if r.start < arena.ring_cap)
        assert covered == arena.ring_cap  # every ring byte is guarded by the event
        loaded = [u for u in rt.units if u.loc is not None]
        assert {id(r.unit) for r in regions if r.unit is not None} == {id(u) for u in loaded}
        assert all(u.region.start == u.loc for u in loaded)
        assert arena.loaded_bytes == sum(u.nbytes for u in loaded)
        assert all(r.done is not None for r in regions)
        assert [u.index for u in loaded if u.fixed is None] == [u.index for u in keep]


def _six_calls_at_the_least_budget(ref, model, depth, extra):
    """``model`` streamed per leaf at its least budget plus ``extra`` units' worth, graphed,
    called six times (warm-up, capture, replays), each call bitwise ``ref``'s."""
    least = minimum_budget(model, prefetch_depth=depth, unit="leaves")
    budget = least + extra * least // (depth + 1)  # room for a prime beside the tail's ring
    h = stream_weights(model, "cpu", budget_bytes=budget, prefetch_depth=depth, unit="leaves")
    g = h.cuda_graph(model)
    for i in range(6):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            assert torch.equal(g(x), ref(x)), i
    return h, g


@pytest.mark.parametrize("layers, depth, extra", [(4, 1, 1), (6, 1, 1), (5, 2, 1), (8, 2, 1)])
def test_primed_replays_of_a_call_shorter_than_its_pipeline(layers, depth, extra):
    """Calls of a few ring units at the least budget: the call's first units are among its
    last ones (the prefetch wraps to a prime while it is still loaded or computing).
    Replays read the right weights, are primed, and keep the budget."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)]).eval()
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)]).eval()
    model.load_state_dict(ref.state_dict())
    h, g = _six_calls_at_the_least_budget(ref, model, depth, extra)
    s = g.stats()
    assert s.replays == 5 and min(s.primed_units) > 0, s
    assert h.stats().peak_device_bytes <= h.stats().budget_bytes
    h.remove()


class _Reused(torch.nn.Module):
    """Linear layers called in ``order``: a layer called twice is one unit used twice a call."""

    def __init__(self, n: int, order: list[int]):
        super().__init__()
        self.ls = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(n))
        self.order = order

    def forward(self, x):
        for i in self.order:
            x = self.ls[i](x)
        return x


@pytest.mark.parametrize(
    "n, order, depth, extra",
    [
        (4, [1, 0, 2, 3, 0, 1], 1, 1),  # the next call's prime is computing elsewhere
        (6, [0, 1, 2, 3, 4, 0, 5], 1, 1),  # it is loaded elsewhere: moved to its place
        (7, [0, 1, 2, 3, 4, 5, 0, 6], 2, 1),  # both, one after the other
    ],
)
def test_primed_replays_of_a_layer_called_twice(n, order, depth, extra):
    """Note: [Primed replays] with a unit used twice a call: when the capture's last units
    prefetch the next call's first one (a prime), they can find it computing at another place
    (then the capture stops prefetching and `finish_capture` loads it after) or loaded at
    another place (then it is dropped there and copied to its own, while the last unit
    computes). Replays read the right weights, stay primed and keep the budget; a unit that
    computes is never dropped (the arena raises). Each check fails with its branch removed."""
    torch.manual_seed(0)
    ref, model = _Reused(n, order).eval(), _Reused(n, order).eval()
    model.load_state_dict(ref.state_dict())
    h, g = _six_calls_at_the_least_budget(ref, model, depth, extra)
    s = g.stats()
    assert s.captures == 1 and s.replays == 5 and s.primed_units == (1,), s
    assert h.stats().peak_device_bytes <= h.stats().budget_bytes
    # Where a replay copies the prime: while the last unit computes, or after it when the
    # prime is the last unit itself (then `finish_capture` loads it).
    ((index, _),) = next(iter(g._graphs.values())).primes
    prime, last = h._runtime.units[index].name, f"ls.{order[-1]}"
    hooks = testing.weight_test_hooks(h, trace=True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))  # the last call's input
    with torch.no_grad():
        g(x)
    events = [(kind, name) for kind, name, *_ in hooks.trace]
    copied = max(i for i, e in enumerate(events) if e == ("load", prime))
    last_read = max(i for i, e in enumerate(events) if e == ("read", last))
    assert (copied < last_read) == (prime != last), events
    h.remove()


def _counting(h):
    lin = h._runtime.units[0].layout.module

    def step(x, cache):
        cache.add_(1)  # written in place, as a KV cache passed as an argument is
        return lin(x) + cache

    return step


def test_an_argument_written_in_place_is_the_graphs_own():
    """Note: [Arguments written in place]: a tensor argument that the function writes in place
    is not copied into a static input (the writes would go to the copy and be lost, and the
    next call would copy the stale tensor back in); the graph reads and writes it itself."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ref = torch.nn.Linear(8, 8)
    ref.load_state_dict(model.state_dict())
    h = stream_weights(model, "cpu", budget_bytes=1 << 20)
    g = h.cuda_graph(_counting(h))
    cache, expected_cache = torch.zeros(8), torch.zeros(8)  # made outside inference mode
    for i in range(5):
        with torch.inference_mode():  # x: an inference tensor, which has no version counter
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
            expected_cache.add_(1)
            expected = ref(x) + expected_cache
            assert torch.equal(g(x, cache), expected), i
        assert torch.equal(cache, expected_cache), i
    assert g.stats().captures == 1 and g.stats().replays == 4
    with torch.inference_mode():
        x = torch.randn(2, 8)  # an inference tensor, as before: the same signature
    with pytest.raises(ValueError, match="argument 1 of the graphed call is written in place"):
        g(x, torch.zeros(8))  # another tensor would not see the graph's writes
    assert torch.equal(cache, expected_cache)  # refused before anything ran
    h.remove()


def test_an_argument_first_written_at_capture_is_copied_back_and_captured_again():
    """A write the warm-up did not show (it depends on something else): the write of that
    call is copied back to the caller's tensor, and the graph is captured again holding it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    h = stream_weights(model, "cpu", budget_bytes=1 << 20)
    writes = {"on": False}

    def step(x, cache):
        if writes["on"]:
            cache.add_(1)
        return model(x) + cache

    g = h.cuda_graph(step)
    cache, x = torch.zeros(8), torch.randn(2, 8)
    g(x, cache)  # warm-up: no write
    writes["on"] = True
    for i in range(1, 4):
        g(x, cache)
        assert cache[0].item() == i, i
    assert g.stats().captures == 2
    h.remove()


def test_a_view_of_the_held_argument_is_the_same_argument():
    """The graph holds the memory of an argument written in place: a new view of it each call
    (``cache[0]``) is accepted, other memory is refused."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    h = stream_weights(model, "cpu", budget_bytes=1 << 20)
    g = h.cuda_graph(_counting(h))
    cache, x = torch.zeros(2, 8), torch.randn(2, 8)
    for i in range(1, 5):
        g(x, cache[0])
        assert cache[0, 0].item() == i and cache[1, 0].item() == 0, i
    with pytest.raises(ValueError, match="written in place"):
        g(x, cache[1])
    h.remove()


def test_an_inference_tensor_written_at_capture_is_copied_back():
    """An inference tensor has no version counter, so the warm-up cannot see the function
    write it; the CPU run sees the write on its static copy and copies it back, in inference
    mode (outside it, writing an inference tensor raises), then captures it in place."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    h = stream_weights(model, "cpu", budget_bytes=1 << 20)

    def step(x, cache):
        with torch.inference_mode():
            cache.add_(1)
        return model(x)

    g = h.cuda_graph(step)
    with torch.inference_mode():
        cache = torch.zeros(8)
    x = torch.randn(2, 8)
    for i in range(1, 5):  # 1: the warm-up; 2: written on the static copy and copied back
        g(x, cache)
        assert cache[0].item() == i, i
    assert g.stats().captures == 2  # the 2nd call's graph was dropped, the 3rd's holds it
    h.remove()


def test_a_large_inference_tensor_argument_is_warned_about():
    """Under inference mode the graph's static copy of an inference tensor has no version
    counter either, so a write to it cannot be seen: a large one (state, likely) is warned
    about at the capture; small ones (token ids, positions) are not."""
    model = torch.nn.Linear(8, 8)
    h = stream_weights(model, "cpu", budget_bytes=1 << 20)
    g = h.cuda_graph(lambda x, state: model(x) + state[:8])
    with torch.inference_mode():
        x, state = torch.randn(2, 8), torch.zeros(1 << 18)  # 1 MiB
        g(x, state)  # the warm-up
        with pytest.warns(UserWarning, match="argument 1 .* inference tensor of 1.0 MiB"):
            g(x, state)  # the capture
        g2 = h.cuda_graph(lambda x, state: model(x) + state)
        for _ in range(3):  # small: no warning
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                g2(x, torch.zeros(8))
    h.remove()


def test_a_first_run_that_raises_holds_nothing():
    """On the CPU a capture's first run is where the call runs: when it raises, the graph is
    dropped as a failed capture is on a GPU, so the next call may pass another tensor."""
    model = torch.nn.Linear(8, 8)
    h = stream_weights(model, "cpu", budget_bytes=1 << 20)
    fail = {"now": False}

    def step(x, cache):
        cache.add_(1)
        if fail["now"]:
            raise RuntimeError("boom")
        return model(x)

    g = h.cuda_graph(step)
    x, cache = torch.randn(2, 8), torch.zeros(8)
    g(x, cache)  # the warm-up: the cache is written, so the graph will hold it
    fail["now"] = True
    with pytest.raises(RuntimeError, match="boom"):
        g(x, cache)
    fail["now"] = False
    other = torch.zeros(8)
    g(x, other)  # not refused: nothing was captured
    assert other[0].item() == 1
    h.remove()


def test_a_held_argument_moved_to_other_memory_is_refused():
    """The graph writes the memory it captured: the same tensor object pointed elsewhere
    (``set_``) is other memory, refused, and the captured storage stays alive meanwhile."""
    model = torch.nn.Linear(8, 8)
    h = stream_weights(model, "cpu", budget_bytes=1 << 20)
    g = h.cuda_graph(_counting(h))
    x, cache = torch.randn(2, 8), torch.zeros(8)
    for _ in range(3):
        g(x, cache)
    cache.set_(torch.zeros(8).untyped_storage())
    with pytest.raises(ValueError, match="written in place"):
        g(x, cache)
    h.remove()


def test_a_compiled_function_is_not_compiled_again_at_the_capture(streamed):
    """Note: [Static inputs mirror their arguments]: a prompt made outside inference mode and
    decoded inside it; the static input the capture reads is a normal tensor as the prompt is,
    so Dynamo's guards pass and the capture runs what the warm-up compiled (on a GPU a compile
    inside a capture fails)."""
    ref, model, h = streamed
    compiled = torch.compile(model)
    g = h.cuda_graph(compiled)
    x = tokens((2, 16), 0)  # a normal tensor
    try:
        with torch.inference_mode():
            expected = g(x).clone()  # the warm-up compiles (Inductor's kernels: not eager's)
            torch.testing.assert_close(expected, ref(x))
            with torch._dynamo.config.patch(error_on_recompile=True):
                for _ in range(3):  # the capture, then replays
                    assert torch.equal(g(x), expected)
        s = g.stats()
        assert (s.captures, s.replays) == (1, 3)
    finally:
        torch._dynamo.reset()


def test_a_replay_outside_inference_mode_of_a_graph_captured_inside_it(streamed):
    """Note: [Static inputs mirror their arguments]: captured under inference mode with an
    inference tensor argument, the static input is an inference tensor; a later replay outside
    inference mode writes it inside inference mode (outside, writing it raises). A normal
    tensor in its place is another signature: its own warm-up and graph."""
    ref, model, h = streamed
    g = h.cuda_graph(model)
    with torch.inference_mode():
        x, y = tokens((2, 8), 0), tokens((2, 8), 1)  # inference tensors
        g(x)  # the warm-up
        g(x)  # the capture
    with torch.no_grad():
        assert torch.equal(g(y), ref(y))  # a replay, outside inference mode
        s = g.stats()
        assert (s.graphs, s.eager_calls, s.replays) == (1, 1, 2)
        z = tokens((2, 8), 2)  # a normal tensor
        for _ in range(3):
            assert torch.equal(g(z), ref(z))
    s = g.stats()
    assert (s.graphs, s.eager_calls, s.replays) == (2, 2, 4)


@pytest.mark.parametrize(
    "read",
    [
        lambda y: y.sum().item(),
        lambda y: y[0, 0].tolist(),
        lambda y: bool((y > 0).any()),
        lambda y: int(y.argmax()),
        lambda y: y.nonzero(),
        lambda y: torch.equal(y, y),
        lambda y: repr(y),
    ],
    ids=["item", "tolist", "bool", "int", "nonzero", "equal", "repr"],
)
def test_a_host_read_fails_where_the_gpu_captures(streamed, read):
    """Note: [Host reads in a captured call]: on the CPU, the call that stands for the capture
    (a signature's second) refuses what a GPU capture refuses, every time it is captured
    again; the warm-up may read values, and a function without reads is replayed."""
    ref, model, h = streamed
    x = tokens((2, 16), 0)

    def step(ids):
        y = model(ids)
        read(y)
        return y

    g = h.cuda_graph(step)
    assert torch.equal(g(x), ref(x))  # the warm-up: eager, as on the GPU
    for _ in range(2):
        with pytest.raises(HostReadInCapture, match="reads a tensor's value on the host"):
            g(x)
    assert g.stats().replays == 0
    plain = h.cuda_graph(model)
    for _ in range(3):
        assert torch.equal(plain(x), ref(x))
    assert plain.stats().replays == 2


def test_a_read_only_in_the_warm_up_is_allowed(streamed):
    ref, model, h = streamed
    seen = []

    def step(ids):
        y = model(ids)
        if not seen:  # lazy set-up on the first call, as a cache might do
            seen.append(y.sum().item())
        return y

    g = h.cuda_graph(step)
    x = tokens((2, 16), 0)
    for _ in range(3):
        assert torch.equal(g(x), ref(x))


@pytest.mark.parametrize("change", ["assign a streamed", "assign a resident", "data", "module"])
def test_a_graph_is_captured_again_when_the_model_holds_other_tensors(change):
    """Note: [The model a graph was captured with]: a replay would read the tensors the capture
    saw (on a GPU, outputs of the old model); the changed model's next call is captured again
    and computes with what the model holds, as the eager call and the resident model do."""
    ref, model = make(), make()
    h = stream_weights(model, "cpu", budget_bytes=2 * minimum_budget(model, resident=["pos"]),
                       resident=["pos"])  # fmt: skip
    g = h.cuda_graph(model)
    x = tokens((2, 8), 0)
    for _ in range(3):
        g(x)
    assert g.stats().captures == 1
    for m in (ref, model):
        with torch.no_grad():
            if change == "assign a streamed":
                m.layers[1].fc1.weight = torch.nn.Parameter(m.layers[1].fc1.weight * 0.5)
            elif change == "assign a resident":
                m.pos.weight = torch.nn.Parameter(m.pos.weight * 0.5)
            elif change == "data":
                m.pos.weight.data = m.pos.weight.detach() * 0.5
            else:
                m.ln_f = torch.nn.LayerNorm(CFG.hidden, eps=0.5)
    with torch.no_grad():
        expected = ref(x)
    assert torch.equal(g(x), expected)
    assert g.stats().captures == 2
    assert torch.equal(g(x), expected)  # and replays it
    assert g.stats().captures == 2
    h.remove()


def test_the_collector_is_off_while_any_capture_runs_and_restored_as_it_was():
    """Note: [Nothing collected during a capture]: off while captures run (nested or on two
    threads), back on after the last only if it was on before the first."""
    from torchoffload.weights._graph import _no_collection

    was = gc.isenabled()
    try:
        gc.enable()
        with _no_collection():
            assert not gc.isenabled()
            with _no_collection():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer capture still runs
        assert gc.isenabled()
        gc.disable()
        with _no_collection():
            pass
        assert not gc.isenabled()  # the caller's choice kept
    finally:
        (gc.enable if was else gc.disable)()
