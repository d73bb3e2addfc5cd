"""Routed experts inside a CUDA graph (`ExpertStreamHandle.cuda_graph`) on the CPU, where the
same device tables, updates and copies run without a graph: a decode over a static KV cache
is bitwise the resident model's at the least cache, a middle one and every expert cached, with
both policies; the device-side policy picks the victims the host-side one would; eager calls,
writes and remove() between replays; what graph mode refuses. The capture's stand-in runs
under `HostReadCheck`, so a host read in the graphed path fails here as it would on a GPU."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from fuzz_models import skips_sentinel
from test_moe import qwen3  # tests/ is on sys.path

import torchoffload as to
from torchoffload.moe._graphed import DeviceTables
from torchoffload.weights._syncs import HostReadInCapture

nan = float("nan")

transformers = pytest.importorskip("transformers")


def decode(model, prompt, n, wrap=None, edit=None, again=None):
    """Greedy decode of ``n`` tokens over a static cache, each step ``wrap(step)``;
    ``edit(i)`` runs before step i; ``again``: the (step, cache) of an earlier decode, reset
    and used again (a serving loop's next request)."""
    if again is None:
        cache = transformers.StaticCache(config=model.config, max_cache_len=prompt.shape[1] + n + 4)

        def step(ids, pos):
            out = model(input_ids=ids, position_ids=pos.unsqueeze(0), cache_position=pos,
                        past_key_values=cache, use_cache=True)  # fmt: skip
            return out.logits[:, -1]

        f = step if wrap is None else wrap(step)
    else:
        f, cache = again
    with torch.inference_mode():
        if again is not None:
            cache.reset()
        at = torch.arange(prompt.shape[1], device=prompt.device)
        out = model(input_ids=prompt, cache_position=at, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        toks = [tok]
        for i in range(n - 1):
            if edit is not None:
                edit(i)
            tok = f(tok, torch.tensor([prompt.shape[1] + i], device=prompt.device)).argmax(
                -1, keepdim=True
            )
            toks.append(tok)
    return torch.cat(toks, 1), (f, cache)


def prompt(seq=4, seed=1):
    return torch.randint(1, 64, (1, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("slots", [2, 5, 16])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefetch", [False, True])
def test_graphed_decode_is_bitwise(slots, policy, dtype, prefetch):
    ref, model = qwen3(dtype=dtype), qwen3(dtype=dtype)
    want, _ = decode(ref, prompt(), 10)
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=slots * slot_bytes, policy=policy,
                          pin_memory=False, prefetch=prefetch)  # fmt: skip
    got, (g, _) = decode(model, prompt(), 10, wrap=h.cuda_graph)
    assert torch.equal(got, want)
    gs = g.stats()
    assert (gs.graphs, gs.captures, gs.replays, gs.eager_calls) == (1, 1, 8, 1)
    st = h.stats()
    assert st.calls == 10 and st.tokens == 4 + 9  # prefill and 9 steps, per layer
    uses = sum(layer.uses for layer in st.layers)
    assert st.hits + st.misses == uses
    assert st.h2d_bytes == (st.misses + st.prefetched + st.staged) * st.layers[0].expert_bytes
    assert (st.prefetched > 0) == (prefetch and slots > 2)  # the least cache has no room
    if slots == 2:  # the least cache: graph mode stages every expert from the host
        assert st.layers[0].hits == 0 or st.calls > 2
    if slots == 16:  # every expert fits (14 cache slots beside the stage of 2): cold misses only
        assert st.evictions == 0
    h.remove()
    again, _ = decode(model, prompt(), 10)
    assert torch.equal(again, want)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_cache_of_every_expert_holds_them_all_in_a_graph():
    """A budget beyond every expert buys every expert plus the stage a graph computes from
    (``top_k`` slots): after one forward routed to every expert, the replays copy nothing.
    Capped at every expert, the stage's slots were taken from the cache, and a graph of an
    'all cached' budget kept missing (H200: 2-3% of its routed experts a step)."""
    ref, model = qwen3(), qwen3()
    want, _ = decode(ref, prompt(), 10)
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=100 * slot_bytes, pin_memory=False)
    assert h.stats().slots == 16 + 2  # two layers of 8 experts, top 2
    with torch.inference_mode():
        model(prompt(seq=48, seed=2))  # eager: every expert routed, each copied once
    assert h.stats().cached == h.stats().misses == 16
    got, (g, _) = decode(model, prompt(), 10, wrap=h.cuda_graph)
    assert torch.equal(got, want) and g.stats().replays == 8
    st = h.stats()
    assert (st.misses, st.evictions, st.h2d_copies) == (16, 0, 16)
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("slots", [2, 16])
def test_graphed_kernels_decode_is_bitwise(slots, dtype, prefetch, impl):
    """transformers' grouped_mm and batched_mm experts through the graphed path: every step's
    logits bitwise the resident model's (Note: [Grouped experts, one group at a time])."""

    def recording(into, wrap=None):
        def outer(step):
            f = step if wrap is None else wrap(step)

            def g(*a):
                into.append(f(*a).clone())
                return into[-1]

            return g

        return outer

    ref, model = qwen3(impl=impl, dtype=dtype), qwen3(impl=impl, dtype=dtype)
    want_logits, got_logits = [], []
    want, _ = decode(ref, prompt(), 10, wrap=recording(want_logits))
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=slots * slot_bytes, pin_memory=False,
                          prefetch=prefetch)  # fmt: skip
    got, _ = decode(model, prompt(), 10, wrap=recording(got_logits, h.cuda_graph))
    assert torch.equal(got, want)
    assert len(got_logits) == 9 and all(map(torch.equal, got_logits, want_logits))
    st = h.stats()
    assert st.calls == 10 and st.hits + st.misses == sum(layer.uses for layer in st.layers)
    assert (st.prefetched > 0) == (prefetch and slots > 2)
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("limit", [2, 3, 10, 1023])
@pytest.mark.parametrize("slots", [2, 7, 20])
def test_grouped_experts_compute_in_their_slots(limit, slots, policy, monkeypatch):
    """grouped_mm experts in a graph call compute in the slots they are in: the cache is cut
    into parts of at most ``GROUP_LIMIT`` slots (the grouped GEMM's groups: 1023 on CUDA;
    smaller here), each its layers' window with a stage of its own, so no hit is ever copied to
    a stage and no grouped GEMM takes more groups than its layer's part has slots; the
    prefetch after a call never takes a slot the call reads (LFU would pick them). Every
    step's logits are bitwise the resident model's, and where every expert has a slot no stage
    is written (Note: [Parts of the cache]; Note: [Experts computed in their slots])."""
    from torchoffload.moe import _graphed, _layout

    monkeypatch.setattr(_layout, "GROUP_LIMIT", limit)
    groups, staged = [], []
    linear = _graphed.grouped_linear
    apply = _graphed.Stage.apply

    def counted(rows, weight, offs, module):
        groups.append(offs.numel())
        return linear(rows, weight, offs, module)

    def watched(self, li, plan):
        staged.append(plan.held.clone())  # read after the decode (no host read in a capture)
        return apply(self, li, plan)

    monkeypatch.setattr(_graphed, "grouped_linear", counted)
    monkeypatch.setattr(_graphed.Stage, "apply", watched)
    ref, model = qwen3(impl="grouped_mm"), qwen3(impl="grouped_mm")
    want_logits, got_logits = [], []

    def recording(into, wrap=None):
        def outer(step):
            f = step if wrap is None else wrap(step)
            return lambda *a: into.append(f(*a).clone()) or into[-1]

        return outer

    want, _ = decode(ref, prompt(seed=3), 12, wrap=recording(want_logits))
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=slots * slot_bytes, pin_memory=False,
                          prefetch=slots > 2, policy=policy)  # fmt: skip
    cache = h._runtime.cache
    parts = [(p.slots[0].index, p.slots[-1].index + 1) for p in cache.parts]
    sb = cache.slot_bytes
    assert all(hi - lo <= max(limit, 2) for lo, hi in parts), parts
    assert len(parts) == (1 if slots <= limit or limit >= 1023 else 2)
    for _, hi in parts:  # each part's stage
        cache.data[(hi - 2) * sb : hi * sb].fill_(0)
    got, _ = decode(model, prompt(seed=3), 12, wrap=recording(got_logits, h.cuda_graph))
    assert torch.equal(got, want)
    assert len(got_logits) == 11 and all(map(torch.equal, got_logits, want_logits))
    tables = h._runtime.tables
    assert [tables.copies.window(li) for li in range(2)] == [parts[cache.layer_part[li]][0] if
                                                             cache.layer_part else 0
                                                             for li in range(2)]  # fmt: skip
    assert groups and max(groups) == max(hi - lo for lo, hi in parts)
    assert staged and not any(bool(held.any()) for held in staged)
    if slots == 20 and limit >= 10:  # every expert has a slot: no stage is written
        assert not any(cache.data[(hi - 2) * sb : hi * sb].any() for _, hi in parts)
    st = h.stats()
    assert st.parts == len(parts)
    assert (st.hits > 0) == (slots > 2 and limit > 2)
    assert st.hits + st.misses == sum(layer.uses for layer in st.layers)
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_graph_is_captured_again_when_the_experts_implementation_changes():
    """transformers' generate() switches grouped_mm to batched_mm for decoding on a GPU: a graph
    captured under one implementation is captured again under the other (the handle's graph
    state), and replays stay bitwise the resident model's under each."""
    ref, model = qwen3(impl="grouped_mm"), qwen3(impl="grouped_mm")
    want, _ = decode(ref, prompt(), 6)
    h = to.stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    got, again = decode(model, prompt(), 6, wrap=h.cuda_graph)
    assert torch.equal(got, want)
    for m in (ref, model):
        m.set_experts_implementation("batched_mm")
    want, _ = decode(ref, prompt(), 6)
    got, _ = decode(model, prompt(), 6, again=again)
    assert torch.equal(got, want)
    gs = again[0].stats()
    assert gs.captures == 2, gs
    h.remove()


def reference_policy(calls, capacity, lfu):
    """The host policy's choices for one-token calls (hits pinned, misses take victims in
    order, every routed expert used in order): hits per call and the experts cached after."""
    order: OrderedDict = OrderedDict()  # cached keys, least recently used first
    uses: dict = {}
    tick = 0
    stamp: dict = {}
    hits = []
    for routed in calls:
        routed = sorted(routed)
        hit = [e for e in routed if e in order]
        hits.append(len(hit))
        misses = [e for e in routed if e not in order]
        free = capacity - len(order)
        candidates = [k for k in order if k not in hit]
        if lfu:
            candidates.sort(key=lambda k: (uses.get(k, 0), stamp[k]))
        for i, e in enumerate(misses):
            if i < free:
                order[e] = None
            elif i - free < len(candidates):
                victim = candidates[i - free]
                del order[victim]
                order[e] = None
        for e in routed:
            uses[e] = uses.get(e, 0) + 1
            if e in order:
                order.move_to_end(e)
                tick += 1
                stamp[e] = tick
    return hits, set(order)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", [3, 4, 6, 9])
def test_device_policy_chooses_as_the_host_policy(policy, slots):
    model = qwen3(layers=1)
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=slots * slot_bytes, policy=policy,
                          pin_memory=False)  # fmt: skip
    rt = h._runtime
    tables = DeviceTables(rt)
    tables.push()
    g = torch.Generator().manual_seed(slots)
    hot = [0, 1, 2]
    calls = []
    for i in range(60):  # skewed: a hot set most of the time
        if i % 3:
            pick = torch.randperm(3, generator=g)[:2]
            calls.append([hot[j] for j in pick.tolist()])
        else:
            calls.append(torch.randperm(8, generator=g)[:2].tolist())
    got = []
    for routed in calls:
        before = int(tables.counts[0, 2])
        tables.copies.apply(0, tables.call(0, torch.tensor(sorted(routed)), False))
        got.append(int(tables.counts[0, 2]) - before)
    # 8 experts, top 2: the cache is capped at 8 + 2 slots, of which 2 are the graph's stage
    want, cached = reference_policy(calls, min(slots, 8 + 2) - 2, policy == "lfu")
    assert got == want
    tables.pull()
    assert {e for _, e in h.cached()} == cached
    h.remove()


@pytest.mark.parametrize("order", ["hit first", "miss first"])
def test_lfu_never_gives_a_hit_slot_to_a_miss_after_millions_of_uses(order):
    """The device's LFU score is ``uses * 2**40 + stamp`` against 2**62 for a pinned slot
    (hit by this call): once the unpinned experts had been used 2**22 times (a few million
    tokens of a long-running server), their scores passed the pinned ones', so a miss was
    given the slot of an expert this call hits. Its copy then overwrote that slot, which the
    stage copy of the hit reads (on a GPU, place by place: a hit placed after the miss
    computed with the miss's weights), and the hit was dropped from the map. Uses are
    capped in the score: a hit's slot is never a victim."""
    model = qwen3(layers=1)
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=4 * slot_bytes, policy="lfu",
                          pin_memory=False)  # fmt: skip
    tables = DeviceTables(h._runtime)  # 2 cache slots beside the stage of 2
    tables.push()
    hit, miss = (0, 5) if order == "hit first" else (5, 0)
    other = 1 if order == "hit first" else 6
    with torch.no_grad():
        tables.copies.apply(0, tables.call(0, torch.tensor(sorted([hit, other])), False))
        tables.uses[:-1] += 1 << 22  # a long run: every expert used 4M times
        src, valid, missed, dst, write, _ = tables.route(0, torch.tensor(sorted([hit, miss])))
    place = sorted([hit, miss]).index(hit)
    assert not missed[place] and missed[1 - place] and write[1 - place]
    assert int(tables.slot_of[hit]) >= 0 and int(tables.slot_of[other]) == -1  # LFU ties: LRU
    assert not torch.equal(dst[1 - place], src[place])  # the miss goes elsewhere
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_eager_calls_writes_and_remove_between_replays():
    ref, model = qwen3(), qwen3()
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=6 * slot_bytes, pin_memory=False)
    graphed = h.cuda_graph

    def edit(m):
        def run(i):
            if i == 4:  # a write of the host store between replays
                with torch.no_grad():
                    m.model.layers[1].mlp.experts.down_proj.mul_(0.5)

        return run

    want, _ = decode(ref, prompt(), 9, edit=edit(ref))
    got, again = decode(model, prompt(), 9, wrap=graphed, edit=edit(model))
    assert torch.equal(got, want)
    want2, _ = decode(ref, prompt(6, 3), 7)
    got2, _ = decode(model, prompt(6, 3), 7, again=again)  # the same graph after a prefill
    assert torch.equal(got2, want2)
    assert again[0].stats().replays == 7 + 6  # the second decode: every step replayed
    st = h.stats()
    assert st.hits + st.misses == sum(layer.uses for layer in st.layers)
    assert len(h.cached()) <= 6
    h.remove()
    for name, p in ref.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_graph_mode_refuses_what_it_cannot_serve():
    from test_moe import moe

    lst = moe()
    h = to.stream_experts(lst, "cpu", cache_bytes=1 << 20, pin_memory=False)
    with pytest.raises(ValueError, match="ModuleList"):
        h.cuda_graph(lst)
    h.remove()
    odd = qwen3(hidden=24, width=10)  # slices of 1920 and 960 bytes
    h = to.stream_experts(odd, "cpu", cache_bytes=1 << 20, pin_memory=False)
    with pytest.raises(ValueError, match="multiple of 512"):
        h.cuda_graph(odd)
    h.remove()
    model = qwen3()
    h = to.stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)

    def call(ids, pos):
        return model(input_ids=ids, position_ids=pos.unsqueeze(0), cache_position=pos,
                     past_key_values=cache, use_cache=True).logits  # fmt: skip

    experts = model.model.layers[0].mlp.experts
    step = h.cuda_graph(experts)
    with torch.inference_mode():  # two tokens: the warm-up runs eagerly, the capture refuses
        args = (torch.randn(2, 32), torch.tensor([[0, 1], [1, 2]]), torch.rand(2, 2))
        step(*args)
        with pytest.raises(RuntimeError, match="one token per block call"):
            step(*args)

    def reads(ids, pos):
        out = call(ids, pos)
        return out if out.sum().item() else out  # a host read in the graphed call

    step = h.cuda_graph(reads)
    with torch.inference_mode():
        one, at = torch.tensor([[5]]), torch.tensor([2])
        step(one, at)
        with pytest.raises(HostReadInCapture):
            step(one, at)
    h.remove()
    with pytest.raises(RuntimeError, match="removed"):
        h.cuda_graph(model)
    mixed = qwen3()  # a layer that routes another top_k (docs/moe.md says it is refused)
    mixed.model.layers[1].mlp.gate.top_k = 1
    h = to.stream_experts(mixed, "cpu", cache_bytes=1 << 20, pin_memory=False)
    cache = transformers.StaticCache(config=mixed.config, max_cache_len=16)
    step = h.cuda_graph(
        lambda ids, pos: mixed(
            input_ids=ids, position_ids=pos.unsqueeze(0), cache_position=pos, past_key_values=cache
        )
    )
    with torch.inference_mode():
        step(one, at)  # the warm-up runs eagerly
        with pytest.raises(RuntimeError, match=r"layers.1.* shape \(1, 1\): .* same number"):
            step(one, at)
    h.remove()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_prefetch_never_takes_a_slot_the_call_before_it_used(policy):
    """On a GPU a call's hits are copied to the stage on a stream of their own, beside the
    link's copies, and the prefetch queued after the call runs on the link's stream: it must
    not evict a slot that call hits (its stage copy may still read it) nor one its misses
    took. Here the call's two slots would be among the prefetch's two victims by either
    policy (2 is the least recently used, 5 one of the least used): they stay, and the
    prefetch takes the one other slot."""
    model = qwen3(layers=1)
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=5 * slot_bytes, policy=policy,
                          pin_memory=False, prefetch=True)  # fmt: skip
    tables = DeviceTables(h._runtime)  # 3 cache slots beside the stage of 2
    tables.push()
    with torch.no_grad():
        for routed in ([0, 1], [2, 3]):  # the cache holds 1, 2, 3
            tables.copies.apply(0, tables.call(0, torch.tensor(routed), False))
        two = int(tables.slot_of[2])
        tables.copies.apply(0, tables.call(0, torch.tensor([2, 5]), False))  # 2 hits, 5 misses
        five = int(tables.slot_of[5])
        assert two >= 0 and five >= 0 and int(tables.slot_of[2]) == two
        tables.prefetch(0, torch.tensor([6, 7]), torch.tensor([0.6, 0.4]))
    assert int(tables.slot_of[2]) == two and int(tables.slot_of[5]) == five
    assert int(tables.counts[0, 4]) == 1  # one free slot: 6 prefetched (the higher score), 7 not
    assert int(tables.slot_of[6]) >= 0 and int(tables.slot_of[7]) == -1
    h.remove()


@pytest.mark.parametrize(("ahead", "predicted", "score", "written"), [
    (1, [3, 7], [0.2, 0.8], {7}),  # the router's higher score, whatever its place
    (1, [7, 3], [0.5, 0.5], {7}),  # equal scores: the earlier place
    (1, [0, 7], [0.9, 0.1], {7}),  # 0 is cached: the cap counts copies, not predictions
    (2, [3, 7], [0.2, 0.8], {3, 7}),
    (1, [8, 7], [0.8, 0.2], {7}),  # 8 (the layer's expert count): none, never copied
    (1, [3, 7], [nan, 0.1], {7}),  # NaN ranks last
    (2, [3, 7], [nan, nan], {3, 7}),  # each its own slot (NaN == NaN is false)
    (1, [3, 7], [nan, nan], {3}),
])  # fmt: skip
def test_a_prefetch_copies_at_most_prefetch_experts_those_the_router_scores_highest(
        ahead, predicted, score, written):  # fmt: skip
    """Note: [Prefetch by the next router]: ``prefetch=n`` copies at most ``n`` of the
    predicted experts the cache lacks, those of highest router score first: the next block
    waits for every copy of the prefetch, used or not. Here 6 cache slots beside the stage,
    4 free for the prefetch."""
    model = qwen3(layers=1)
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=8 * slot_bytes, pin_memory=False,
                          prefetch=ahead)  # fmt: skip
    tables = DeviceTables(h._runtime)
    tables.push()
    with torch.no_grad():
        tables.copies.apply(0, tables.call(0, torch.tensor([0, 1]), False))  # 0 and 1 cached
        tables.prefetch(0, torch.tensor(predicted), torch.tensor(score))
    got = {e for e in (2, 3, 4, 5, 6, 7) if int(tables.slot_of[e]) >= 0}
    assert got == written and int(tables.counts[0, 4]) == len(written)
    slots = {e: int(tables.slot_of[e]) for e in written}
    assert len(set(slots.values())) == len(slots)  # each its own slot, named for it
    assert all(int(tables.key_of[s]) == tables.first[0] + e for e, s in slots.items())
    h.remove()


@pytest.mark.parametrize("none", [8, -1, 11])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_a_none_expert_anywhere_in_the_routers_order_adds_zeros(impl, none):
    """An expert index outside the layer (transformers leaves, masks or clamps it; a negative
    one too, which would name another layer's expert) adds zeros wherever the router put it in
    a captured call (which reports it at the next: Note: [Routed outside a layer]): a graph
    call reads its rows back, masks and weighs them in the router's order (`CallPlan.dead` and
    ``back``), so a token routed to [none, e] gives what [e, none] gives with the weights
    swapped, whatever weight the none has."""
    from torchoffload.moe._graphed import graphed_forward, tables_of

    model = qwen3(impl=impl, layers=1)
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False)  # fmt: skip
    rt = h._runtime
    tables = tables_of(rt)
    tables.push()
    module = model.model.layers[0].mlp.experts
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(5))
    n = none  # 8: the layer's expert count
    rt.graphing = True  # as in a capture: the routing is checked at its end
    with torch.no_grad():
        out = [graphed_forward(rt, 0, module, x, torch.tensor([index]), torch.tensor([w]),
                               prefetch=False)  # fmt: skip
               for index, w in (([n, 3], [0.3, 0.7]), ([3, n], [0.7, 0.3]),
                                ([n, 3], [5.0, 0.7]))]  # fmt: skip
        tables.outside.record()
    rt.graphing = False
    assert out[0].abs().sum() > 0
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])
    with pytest.raises(RuntimeError, match="routed 'model.layers.0.mlp.experts' to an expert"):
        tables.outside.check()
    tables.outside.check()  # reported once
    h.remove()


def transformers_loop_skips() -> bool:
    """Whether the installed transformers' per-expert loop skips the sentinel (5.24, not
    5.17)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return skips_sentinel(Qwen3MoeExperts(qwen3(layers=1).config))


def loop_517(model) -> None:
    """Every fused experts module of ``model`` (a Qwen3-MoE) runs transformers 5.17's
    per-expert loop (`fuzz_models.experts_517`)."""
    from fuzz_models import experts_517

    for layer in model.model.layers:
        layer.mlp.experts.__class__ = experts_517(type(layer.mlp.experts))


def route_outside(model, li: int, index: int) -> torch.Tensor:
    """Layer ``li``'s router routes its first place to ``index`` while the returned switch (a
    tensor on the model's device, read on the device: a graph replays it) holds 1."""
    router = model.model.layers[li].mlp.gate
    routed = router.forward
    switch = torch.zeros((), dtype=torch.int64, device=router.weight.device)

    def forward(h):
        logits, weights, experts = routed(h)
        first = torch.where(switch > 0, index, experts[..., :1])
        return logits, weights, torch.cat([first, experts[..., 1:]], -1)

    router.forward = forward
    return switch


@pytest.mark.parametrize("impl", ["eager", "eager 5.17", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("index", [-1, 8, 9])
@pytest.mark.parametrize("blocks", [False, True])
def test_a_call_routed_outside_a_layer_is_refused_or_reported_at_the_next(impl, index, blocks):
    """Note: [Routed outside a layer]: a graph replay (here the CPU's stand-in) routed to an
    expert index the resident call does not serve returns, and the handle's next call raises
    a RuntimeError naming the layer; an eager device-routed call (block graphs: every one on
    the CPU) raises the host path's ValueError before computing. Calls after the report run
    as before. Transformers 5.24's per-expert loop skips index 8 (the expert count) as the
    graph call does: served, no error; 5.17's ("eager 5.17") fails on it: refused."""
    impl, _, loop = impl.partition(" ")
    model, ref = qwen3(impl=impl, layers=2), qwen3(impl=impl, layers=2)
    if loop:
        loop_517(model)
    switch, ref_switch = route_outside(model, 1, index), route_outside(ref, 1, index)
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False, block_graphs=blocks)  # fmt: skip
    call = model if blocks else h.cuda_graph(model)
    ids = torch.tensor([[3]])
    served = index == 8 and skips_sentinel(ref.model.layers[1].mlp.experts) and not loop
    with torch.inference_mode():
        want = ref(ids).logits
        for _ in range(3):  # eager, captured, replayed
            assert torch.equal(call(ids).logits, want)
        switch.fill_(1)
        if blocks and not served:
            with pytest.raises(ValueError, match="model.layers.1.mlp.experts"):
                call(ids)
        else:
            got = call(ids).logits
            assert not torch.equal(got, want)  # another routing: another result
            if served:  # the resident loop's, bitwise
                ref_switch.fill_(1)
                assert torch.equal(got, ref(ids).logits)
                ref_switch.fill_(0)
            switch.fill_(0)
            if not served:
                with pytest.raises(RuntimeError, match="an earlier graph call of stream_experts "
                                   "routed 'model.layers.1.mlp.experts'"):  # fmt: skip
                    call(ids)
        switch.fill_(0)
        for _ in range(2):
            assert torch.equal(call(ids).logits, want)
    h.stats()
    h.remove()


def test_stats_reports_a_replay_routed_outside_a_layer():
    """Note: [Routed outside a layer]: `stats()` raises where a replay routed outside a layer
    and no call has reported it yet; once."""
    model = qwen3(impl="grouped_mm", layers=2)
    switch = route_outside(model, 0, -2)
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False)  # fmt: skip
    call = h.cuda_graph(model)
    with torch.inference_mode():
        for i in range(3):
            switch.fill_(int(i == 2))  # the replay
            call(torch.tensor([[5]]))
    with pytest.raises(RuntimeError, match="routed 'model.layers.0.mlp.experts'"):
        h.stats()
    assert h.stats().layers[0].calls > 0
    h.remove()


def test_predict_gives_the_routers_experts_and_scores_in_its_order():
    """Note: [Prefetch by the next router]: the next router's experts and scores, in its
    order: transformers' (logits, weights, indices); a router answering every expert's
    weights reads them at its experts; one answering logits only gives their top k."""
    from torchoffload.moe._graphed import predict

    model = qwen3(layers=1)
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False)  # fmt: skip
    layer = h._runtime.layout.layers[0]
    router = model.model.layers[0].mlp.gate
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, weights, index = router(x)
        got, score = predict(layer, x, 2)
        assert torch.equal(got, index[0]) and torch.equal(score, weights[0])
        full = torch.zeros_like(logits).scatter(1, index, weights)  # every expert's weight
        router.forward = lambda h, f=full, i=index: (logits, f, i)
        got, score = predict(layer, x, 2)
        assert torch.equal(got, index[0]) and torch.equal(score, weights[0])
        router.forward = lambda h: logits  # logits only
        got, score = predict(layer, x, 2)
        top = torch.topk(logits, 2)
        assert torch.equal(got, top.indices[0]) and torch.equal(score, top.values[0])
        router.forward = lambda h: (logits, None, index)  # no scores: the router's order
        got, score = predict(layer, x, 2)
        assert torch.equal(got, index[0]) and score.tolist() == [2.0, 1.0]
    del router.forward
    h.remove()


@pytest.mark.parametrize("prefetch", [-1, 1.5, "2"])
def test_prefetch_must_be_a_bool_or_a_count(prefetch):
    model = qwen3(layers=1)
    error = ValueError if prefetch == -1 else TypeError
    with pytest.raises(error, match="prefetch"):
        to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False, prefetch=prefetch)  # fmt: skip


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_prefetch_turns_the_next_blocks_misses_into_hits_when_the_prediction_holds():
    """Layer 1's router is layer 0's and the blocks barely change the hidden states, so the
    next router's prediction is its choice: with prefetch, layer 1 misses only where the
    cache evicted; without, as often as layer 0."""

    def build():
        m = qwen3()
        with torch.no_grad():
            layers = m.model.layers
            layers[1].mlp.gate.weight.copy_(layers[0].mlp.gate.weight * 20)
            layers[0].mlp.gate.weight.mul_(20)
            layers[1].post_attention_layernorm.weight.copy_(
                layers[0].post_attention_layernorm.weight
            )
            for layer in layers:
                layer.self_attn.o_proj.weight.mul_(1e-4)
                layer.mlp.experts.down_proj.mul_(1e-4)
        return m

    ref = build()
    want, _ = decode(ref, prompt(), 12)
    layer1 = {}
    for prefetch in (False, True):
        model = build()
        slot_bytes = to.minimum_cache_bytes(model) // 2
        h = to.stream_experts(model, "cpu", cache_bytes=6 * slot_bytes, pin_memory=False,
                              prefetch=prefetch)  # fmt: skip
        got, _ = decode(model, prompt(), 12, wrap=h.cuda_graph)
        assert torch.equal(got, want)
        st = h.stats()
        layer1[prefetch] = st.layers[1]
        assert (st.prefetched > 0) == prefetch
        h.remove()
    # the prefill and the first step run eagerly alike; the 10 replays differ
    assert layer1[True].misses + 10 <= layer1[False].misses, layer1


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_no_prefetch_where_a_call_pins_every_cache_slot():
    """A cache of no more slots beside the stage than a call routes (``top_k``) has none left
    for a prefetch: the next block's router is not run for it (it runs once per call, by its
    own block); with one slot more it runs again for the prefetch."""
    runs = {}
    for slots in (4, 5):  # 2 or 3 cache slots beside the stage of 2
        model = qwen3()
        calls = []
        model.model.layers[1].mlp.gate.register_forward_hook(lambda *a, c=calls: c.append(1))
        slot_bytes = to.minimum_cache_bytes(model) // 2
        h = to.stream_experts(model, "cpu", cache_bytes=slots * slot_bytes, pin_memory=False,
                              prefetch=True)  # fmt: skip
        decode(model, prompt(), 10, wrap=h.cuda_graph)
        runs[slots] = (len(calls), h.stats().prefetched)
        h.remove()
    assert runs[4] == (10, 0)  # its own block's: the prefill and 9 steps
    assert runs[5][0] == 10 + 8 and runs[5][1] > 0  # and block 0's, in the 8 graph calls


def assign_o_proj(m):
    """A decode's ``edit``: before step 4, layer 1's ``o_proj.weight`` assigned a new tensor."""

    def run(i):
        if i == 4:
            attn = m.model.layers[1].self_attn
            attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight * -2.0)

    return run


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_graph_is_captured_again_when_a_dense_tensor_is_assigned():
    """Note: [The model a graph was captured with]: a dense tensor assigned between replays
    (``o_proj.weight = nn.Parameter(...)``) is computed with from the next call on: the graph is
    captured again (on a GPU a replay read the old tensor: the fuzzer saw 0.52 off)."""
    ref, model = qwen3(), qwen3()
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=6 * slot_bytes, pin_memory=False)
    want, _ = decode(ref, prompt(), 9, edit=assign_o_proj(ref))
    got, again = decode(model, prompt(), 9, wrap=h.cuda_graph, edit=assign_o_proj(model))
    assert torch.equal(got, want)
    assert again[0].stats().captures == 2
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_verify_removes_the_handle_of_a_graphed_call():
    """`torchoffload.verify` calls a graphed decode step returned by ``apply`` in place of the
    model and removes the handle that made it (it was left applied to the run's copy)."""
    copies = []

    def step_of(m):
        cache = transformers.StaticCache(config=m.config, max_cache_len=4)
        at = torch.tensor([0])

        def step(ids):
            out = m(input_ids=ids, position_ids=at.unsqueeze(0), cache_position=at,
                    past_key_values=cache, use_cache=True)  # fmt: skip
            return out.logits[:, -1]

        return step

    def graphed(m):
        copies.append(m)
        h = to.stream_experts(m, "cpu", cache_bytes=to.minimum_cache_bytes(m), pin_memory=False)
        return h.cuda_graph(step_of(m))

    report = to.verify(qwen3(), (prompt(seq=1),), apply=graphed, reference_apply=step_of,
                       steps=3)  # fmt: skip
    assert report.equal and report.compared, str(report)
    [m] = copies
    assert not hasattr(m, "_torchoffload_experts")
    assert all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel()
               for t in m.state_dict(keep_vars=True).values())  # fmt: skip


def test_every_entry_of_a_device_routed_call_reports_a_routing_outside_a_layer():
    """Note: [Routed outside a layer]: a replay's report (``seen``: a count and a layer, which
    a GPU's replay writes) is raised by a replay (`graph_replaying`: the CPU's stand-in also
    captures, so its capture's check reports first), a capture, a block-graph call, a
    host-routed call (after the tables' pull), `remove()` and `stats()`, each once per
    report."""
    from torchoffload.moe._graphed import ExpertGraphs, tables_of

    model = qwen3(impl="grouped_mm", layers=2)
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False, block_graphs=True)  # fmt: skip
    rt = h._runtime
    graphs, tables = ExpertGraphs(rt), tables_of(rt)
    match = "routed 'model.layers.1.mlp.experts' to an expert index outside"

    def replay():
        with graphs.graph_replaying(graphs.graph_state()):
            pass

    def prefill():
        tables.push()  # as a graph call leaves them: the device's map in force
        model(torch.tensor([[3, 4, 5]]))

    entries = [replay, graphs.prepare_capture, lambda: model(torch.tensor([[3]])), prefill,
               h.stats, h.remove]  # fmt: skip
    with torch.inference_mode():
        for count, entry in enumerate(entries, 1):
            tables.outside.seen.copy_(torch.tensor([count, 2]))  # layer 1 (1 + its index)
            with pytest.raises(RuntimeError, match=match):
                entry()
            entry()  # once
    assert rt.removed


def test_reports_are_counted_on_the_device_so_a_later_good_replay_keeps_them():
    """Note: [Routed outside a layer]: a replay routed outside a layer and a valid one after
    it, both run before the host reads: one report, for the first; two bad replays: one report
    (the count passed the last reported one); none where every routing was valid."""
    from torchoffload.moe._graphed import tables_of

    model = qwen3(impl="grouped_mm", layers=2)
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False)  # fmt: skip
    outside = tables_of(h._runtime).outside

    def replay(first, li=0):
        outside.routed.append((torch.tensor([first, 1]), outside.limits[li, 0], outside.ids[li]))
        outside.record()

    for bad in ([-1, 0], [9, 8]):
        for first in bad:
            replay(first)
        with pytest.raises(RuntimeError, match="'model.layers.0.mlp.experts'"):
            outside.check()
        outside.check()
    replay(7)  # the layer's last expert: valid
    outside.check()
    h.remove()


def test_a_capture_whose_function_raises_records_no_routing():
    """Note: [Routed outside a layer]: the end of a capture whose function raised (run in its
    ``finally``) queues nothing and drops the calls it kept; so does a failed capture of a
    graphed call, and valid calls after it report nothing."""
    from torchoffload.moe._graphed import ExpertGraphs, tables_of

    model = qwen3(impl="grouped_mm", layers=2)
    switch = route_outside(model, 1, -1)
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False)  # fmt: skip
    rt = h._runtime
    graphs, outside = ExpertGraphs(rt), tables_of(rt).outside
    graphs.start_capture(None)
    outside.routed.append((torch.tensor([-1, 0]), outside.limits[0, 0], outside.ids[0]))
    with pytest.raises(KeyError):
        try:
            raise KeyError("the captured function's")
        finally:
            graphs.finish_capture()
    graphs.end_capture()
    assert not outside.routed
    outside.check()  # nothing recorded
    calls = [0]

    def step(ids):
        out = model(ids).logits
        calls[0] += 1
        if calls[0] == 2:  # the capture (the CPU's stand-in)
            raise KeyError("the capture's run fails")
        return out

    call, ids = h.cuda_graph(step), torch.tensor([[3]])
    with torch.inference_mode():
        call(ids)
        switch.fill_(1)
        with pytest.raises(KeyError):
            call(ids)
        switch.fill_(0)
        call(ids)
        call(ids)
    assert not outside.routed
    h.stats()
    h.remove()


def test_a_capture_inside_an_exception_handler_still_checks_its_routing():
    """Note: [Routed outside a layer]: the end of a capture tells a captured function that
    raised from one captured while its caller handles another exception: the latter's routing
    is still checked."""
    model = qwen3(impl="grouped_mm", layers=2)
    switch = route_outside(model, 0, 9)
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False)  # fmt: skip
    call = h.cuda_graph(model)
    ids = torch.tensor([[5]])
    with torch.inference_mode():
        call(ids)  # eager
        try:
            raise KeyError("the caller's own")
        except KeyError:
            switch.fill_(1)
            call(ids)  # captured (the CPU's stand-in), routed outside
            switch.fill_(0)
        with pytest.raises(RuntimeError, match="routed 'model.layers.0.mlp.experts'"):
            call(ids)
    h.remove()


@pytest.mark.parametrize("index", [-1, 8, 9])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("loop", ["5.24", "5.17"])
@pytest.mark.parametrize("host", [False, True])
def test_the_per_expert_loop_routed_on_the_host_outside_a_layer(index, tokens, loop, host):
    """Note: [Routed outside a layer]: transformers 5.24's per-expert loop routed on the host
    skips index 8 (the expert count) as the resident loop does, bitwise, and refuses -1 and 9
    with a ValueError before it computes (the resident loop's one_hot fails there too: on a GPU
    with a device assert); 5.17's loop refuses 8 too (its one_hot has 8 classes). Calls after
    it are served. The same with the misses computed on the host (Note: [Cold experts on the
    host]), whose one_hot would fail as the resident's."""
    model, ref = qwen3(impl="eager", layers=2), qwen3(impl="eager", layers=2)
    if loop == "5.17":
        loop_517(model)
        loop_517(ref)
    switches = [route_outside(m, 1, index) for m in (model, ref)]
    h = to.stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model) * 4,
                          pin_memory=False, block_graphs=False, host_compute=host)  # fmt: skip
    skips = skips_sentinel(ref.model.layers[1].mlp.experts)  # 5.17 installed: never
    assert skips == (loop == "5.24" and transformers_loop_skips())
    assert h._runtime.layout.layers[1].sentinel == skips
    ids = torch.arange(3, 3 + tokens).unsqueeze(0)
    with torch.inference_mode():
        for s in switches:
            s.fill_(1)
        if index == 8 and skips:
            assert torch.equal(model(ids).logits, ref(ids).logits)
        else:
            served = "\\[0, 8\\]" if skips else "\\[0, 8\\)"
            with pytest.raises(ValueError, match="'model.layers.1.mlp.experts' was routed to an "
                               f"expert index outside {served}"):  # fmt: skip
                model(ids)
            if index == 8:  # the resident loop fails too
                with pytest.raises(RuntimeError, match="Class values must be smaller"):
                    ref(ids)
        for s in switches:
            s.fill_(0)
        assert torch.equal(model(ids).logits, ref(ids).logits)
    h.remove()
