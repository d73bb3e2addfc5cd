"""The expert cache planner (`torchoffload.planner.plan_experts`) on the CPU: a routing profile
recorded from a streamed model replays to exactly the handle's stats at that cache size (fused
and ModuleList experts, LRU and LFU, wrong router predictions, a warm-up); shapes give the
layouts of the models they describe; synthetic profiles route as they say; the prediction and
the target search follow their model."""

from __future__ import annotations

import pytest
import torch
from fuzz_models import MoEBlock, tokens  # tests/ is on sys.path
from test_moe import GEN, SPEC, moe, prompt, qwen3, snapshot

import torchoffload as to
from torchoffload.moe import BlockCall, RoutingProfile
from torchoffload.moe._layout import find_experts
from torchoffload.planner import ExpertShape, plan_experts, synthetic_routing
from torchoffload.planner._experts import as_layout, replay
from torchoffload.planner._routing import ZipfRanks

LINK = 25e9


class Contrary(MoEBlock):
    """Runs the experts its router ranks last: the runtime's prediction (the router's top-k)
    is wrong for every token."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = self.norm(h).reshape(-1, h.shape[-1])
        chosen = torch.topk(-self.gate(flat), self.top_k, dim=-1).indices
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, _ = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]))
        return h + out.view_as(h)


def list_model(contrary: bool = False):
    model = moe()
    if contrary:
        for block in model.blocks:
            block.__class__ = Contrary
    return model


def run_list(model, steps):
    with torch.no_grad():
        for i, (b, s) in enumerate(steps):
            model(tokens(SPEC, b, s, i))


DECODE = [(1, 4)] + [(1, 1)] * 12  # a prompt, then one token a step
MIXED = [(1, 1), (2, 5), (1, 1), (3, 2), (1, 1), (1, 1), (2, 3), (1, 1)]


def check(handle, profile, cache, policy, warmup_steps=0):
    """The prediction at ``cache`` equals the handle's stats, in total and per layer."""
    st = handle.stats()
    plan = plan_experts(handle, profile, link_bytes_per_s=LINK, resident_ms_per_token=1.0,
                        cache_bytes=[cache], policy=policy, warmup_steps=warmup_steps)  # fmt: skip
    (p,) = plan.predictions
    got = (p.slots, p.cache_bytes, p.tokens, p.hits, p.misses, p.evictions, p.h2d_bytes)
    want = (st.slots, st.cache_bytes, st.tokens, st.hits, st.misses, st.evictions, st.h2d_bytes)
    assert got == want
    assert p.bytes_per_token == st.bytes_per_token and p.hit_rate == st.hit_rate
    layout = as_layout(handle)
    rt = replay(layout, profile, st.slots, to.moe.CachePolicy(policy), warmup_steps)
    for c, layer in zip(rt.counters, st.layers, strict=True):
        assert (c.calls, c.tokens, c.hits, c.misses, c.h2d_bytes) == (
            layer.calls, layer.tokens, layer.hits, layer.misses, layer.h2d_bytes
        )  # fmt: skip
    assert sum(c.unused for c in rt.counters) == st.unused
    assert sum(c.loads for c in rt.counters) == st.h2d_copies
    return st


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", ["least", 3, 5, 9, "all"])
def test_recorded_qwen3_profile_replays_to_the_stats(policy, slots):
    model = qwen3()
    least = to.minimum_cache_bytes(model)
    cache = {"least": least, "all": 1 << 30}.get(slots) or slots * least // 2
    h = to.stream_experts(model, "cpu", cache_bytes=cache, policy=policy, pin_memory=False)
    with h.record_routing() as rec:
        model.generate(prompt(), **GEN)
        model.generate(prompt(1, 3, 2), **GEN)
    profile = rec.profile()
    assert profile.steps == 2 * GEN["max_new_tokens"] and profile.layers == 2
    assert all(c.routed == c.experts for c in profile.calls)  # fused: routed, then computed
    st = check(h, profile, cache, policy)
    assert st.misses > 0 and (slots == "least" or st.hits > 0)
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", ["least", 5, 9, "all"])
def test_a_profile_replays_to_the_stats_of_calls_routed_on_the_device(policy, slots):
    """``device_routed=True``: a profile recorded with every call routed on the host replays
    to exactly the stats of the same run with block graphs (one-token calls through the
    device tables, the stage's ``top_k`` slots taken from the cache; the CPU runs the same
    tables without graphs), prompts routed on the host between them; per layer too."""
    least = to.minimum_cache_bytes(qwen3(impl="grouped_mm"))
    cache = {"least": least, "all": 1 << 30}.get(slots) or slots * least // 2

    def run(block_graphs, record=False):
        model = qwen3(impl="grouped_mm")
        h = to.stream_experts(model, "cpu", cache_bytes=cache, policy=policy,
                              pin_memory=False, block_graphs=block_graphs)  # fmt: skip
        rec = h.record_routing() if record else None
        with rec if rec is not None else torch.no_grad():
            # prompts of 3 tokens: routed on the host, too small to be staged (the replay
            # counts a staged prefill apart: Note: [Predicting expert streaming])
            outs = [model.generate(prompt(1, 3, 1), **GEN), model.generate(prompt(1, 3, 2), **GEN)]
        return h, outs, rec

    host, want, rec = run(False, record=True)
    h, got, _ = run(True)
    assert all(map(torch.equal, got, want))
    st = h.stats()
    assert st.block_eager_calls > 0 and st.block_replays == 0  # the CPU: the path, no graph
    plan = plan_experts(h, rec.profile(), link_bytes_per_s=LINK, resident_ms_per_token=1.0,
                        cache_bytes=[cache], policy=policy, device_routed=True)  # fmt: skip
    (p,) = plan.predictions
    assert (p.slots, p.tokens, p.hits, p.misses, p.h2d_bytes) == (
        st.slots, st.tokens, st.hits, st.misses, st.h2d_bytes)  # fmt: skip
    assert "routed on the device" in str(plan)
    rt = replay(as_layout(h), rec.profile(), st.slots, to.moe.CachePolicy(policy),
                device_routed=True)  # fmt: skip
    for c, layer in zip(rt.counters, st.layers, strict=True):
        assert (c.calls, c.tokens, c.hits, c.misses, c.h2d_bytes) == (
            layer.calls, layer.tokens, layer.hits, layer.misses, layer.h2d_bytes
        )  # fmt: skip
    [q] = plan_experts(h, rec.profile(), link_bytes_per_s=LINK, resident_ms_per_token=1.0,
                       cache_bytes=[cache], policy=policy).predictions  # fmt: skip
    hs = host.stats()
    assert (q.hits, q.misses) == (hs.hits, hs.misses)
    if slots in (5, 9):  # the stage's slots leave fewer for the cache on the device (the
        # least holds none either way; "all" holds every expert beside the stage)
        assert p.hits < q.hits
    host.remove()
    h.remove()


def test_device_routed_plans_need_fused_experts():
    model = list_model()
    with pytest.raises(ValueError, match="device_routed=True: the experts .* list of modules"):
        plan_experts(model, synthetic_routing(model, steps=2), link_bytes_per_s=LINK,
                     resident_ms_per_token=1.0, device_routed=True)  # fmt: skip


@pytest.mark.parametrize(("policy", "slots"), [("lru", 2), ("lru", 5), ("lru", 14),
                                               ("lru", 24), ("lfu", 24), ("lru", 64)])  # fmt: skip
def test_a_prefill_copies_the_bytes_the_plan_predicts(policy, slots):
    """Note: [Predicting expert streaming]: after one-token calls recorded as a profile, a
    prefill (a grouped_mm call of each of 3 layers: staged in chunks below two layers' worth
    of slots, else whole layers in alternating regions, experts cached outside them taken from
    their slots) copies exactly the bytes the plan predicts from that profile at that cache;
    a list of expert modules is not staged: None."""
    model = qwen3(impl="grouped_mm", layers=3)
    layout = find_experts(model)
    cache = slots * layout.slot_bytes
    h = to.stream_experts(model, "cpu", cache_bytes=cache, policy=policy, pin_memory=False)
    with h.record_routing() as rec, torch.no_grad():
        for seed in range(8):
            model(prompt(1, 1, seed))
    before = h.stats().h2d_bytes
    with torch.no_grad():
        model(prompt(1, 20, 9))  # 40 routed rows per layer: at least 2 per expert
    copied = h.stats().h2d_bytes - before
    staged = h._runtime.staged
    assert all(staged.chunk) and h.stats().staged > 0
    plan = plan_experts(model, rec.profile(), link_bytes_per_s=LINK, resident_ms_per_token=1.0,
                        policy=policy, cache_bytes=[cache])  # fmt: skip
    [p] = plan.predictions
    assert p.prefill_bytes == copied, (staged.chunk, p.prefill_bytes, copied)
    assert p.prefill_ms == pytest.approx(copied / LINK * 1e3)
    if slots >= 24:  # some experts come from their slots
        assert copied < 3 * 8 * layout.layers[0].expert_bytes
    h.remove()
    model = list_model()
    profile = synthetic_routing(model, steps=2)
    [p] = plan_experts(model, profile, link_bytes_per_s=LINK, resident_ms_per_token=1.0,
                       cache_bytes=[to.minimum_cache_bytes(model)]).predictions  # fmt: skip
    assert p.prefill_bytes is None and p.prefill_ms is None


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", ["least", 3, 7, "all"])
@pytest.mark.parametrize("contrary", [False, True])
def test_recorded_module_list_profile_replays_to_the_stats(policy, slots, contrary):
    model = list_model(contrary)
    least = to.minimum_cache_bytes(model)
    cache = {"least": least, "all": 1 << 30}.get(slots) or slots * least // SPEC.top_k
    h = to.stream_experts(model, "cpu", cache_bytes=cache, policy=policy, pin_memory=False)
    with h.record_routing() as rec:
        run_list(model, MIXED)
    profile = rec.profile()
    assert profile.steps == len(MIXED) and profile.tokens == sum(b * s for b, s in MIXED)
    st = check(h, profile, cache, policy)
    assert (st.unused > 0) == contrary  # a wrong prediction copies experts that do not compute
    h.remove()


def test_warm_up_steps_are_not_counted():
    model = list_model()
    cache = 5 * to.minimum_cache_bytes(model) // SPEC.top_k
    h = to.stream_experts(model, "cpu", cache_bytes=cache, pin_memory=False)
    with h.record_routing() as rec:
        run_list(model, DECODE[:3])
        h.reset_stats()
        run_list(model, DECODE[3:])
    st = check(h, rec.profile(), cache, "lru", warmup_steps=3)
    assert st.tokens == len(DECODE) - 3
    h.remove()


def test_recording_is_one_at_a_time_and_stops_on_exit():
    model = list_model()
    h = to.stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    rec = h.record_routing()
    with rec:
        with pytest.raises(RuntimeError, match="already records its routing"):
            h.record_routing().__enter__()
        run_list(model, DECODE[:2])
    run_list(model, DECODE[2:4])  # not recorded
    p = rec.profile()
    assert p.steps == 2 and len(p.calls) == 2 * SPEC.layers
    assert [c.layer for c in p.calls] == [0, 1, 2, 0, 1, 2]
    assert p.calls[0].tokens == 4 and p.calls[3].tokens == 1
    assert "recorded: 2 steps, 5 tokens, 6 block calls" in repr(p)
    h.remove()
    with pytest.raises(RuntimeError, match="removed"):
        h.record_routing()


# -- shapes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "hidden", "width"), [(torch.float32, 32, 16), (torch.float16, 24, 12)]
)
def test_fused_shape_is_the_models_layout(dtype, hidden, width):
    model = qwen3(dtype=dtype, hidden=hidden, width=width)
    real = find_experts(model)
    shape = ExpertShape.fused_mlp(layers=2, experts=8, top_k=2, hidden=hidden, width=width,
                                  dtype=dtype)  # fmt: skip
    made = shape.layout()
    assert made.slot_bytes == real.slot_bytes and made.top_k == real.top_k
    assert [(x.experts, x.expert_bytes) for x in made.layers] == [
        (x.experts, x.expert_bytes) for x in real.layers
    ]
    assert made.least_cache_bytes() == to.minimum_cache_bytes(model)
    profile = synthetic_routing(model, 20, routing="zipf", drift=2)
    kw = dict(link_bytes_per_s=LINK, resident_ms_per_token=0.5, policy="lfu")
    assert (
        plan_experts(shape, profile, **kw).predictions
        == plan_experts(model, profile, **kw).predictions
    )
    # routed on the device too: a shape has no tensors, and its dry tables need none
    kw["device_routed"] = True
    assert (
        plan_experts(shape, profile, **kw).predictions
        == plan_experts(model, profile, **kw).predictions
    )


def test_list_shape_is_the_models_layout():
    model = list_model()
    expert = model.blocks[0].experts[0]
    shape = ExpertShape(SPEC.layers, SPEC.experts, SPEC.top_k,
                        tuple(p.numel() * p.element_size() for p in expert.parameters()),
                        fused=False)  # fmt: skip
    real, made = find_experts(model), shape.layout()
    assert made.slot_bytes == real.slot_bytes
    assert made.layers[0].expert_bytes == real.layers[0].expert_bytes


def test_planning_leaves_the_model_alone():
    model = qwen3()
    before = snapshot(model)
    plan_experts(model, synthetic_routing(model, 4), link_bytes_per_s=LINK,
                 resident_ms_per_token=1.0)  # fmt: skip
    assert all(
        torch.equal(a, b) for a, b in zip(snapshot(model).values(), before.values(), strict=True)
    )
    assert not hasattr(model, "_torchoffload_experts")
    to.stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False).remove()


# -- synthetic profiles --------------------------------------------------------------------------

SHAPE = ExpertShape(layers=3, experts=16, top_k=4, member_bytes=(1 << 20,))


def test_uniform_routing():
    p = synthetic_routing(SHAPE, 400, seed=3)
    assert p.source == "uniform" and p.steps == 400 and p.tokens == 400
    assert [c.layer for c in p.calls[:6]] == [0, 1, 2, 0, 1, 2]
    assert all(len(c.experts) == 4 and c.experts == tuple(sorted(c.experts)) for c in p.calls)
    assert all(c.routed == c.experts and c.tokens == 1 for c in p.calls)
    counts = torch.bincount(torch.tensor([e for c in p.calls for e in c.experts]), minlength=16)
    assert counts.min() > 0.7 * counts.float().mean()  # 1200 x 4 draws of 16: about 300 each
    assert synthetic_routing(SHAPE, 400, seed=3) == p != synthetic_routing(SHAPE, 400, seed=4)
    wide = synthetic_routing(SHAPE, 50, batch=3)
    assert all(4 <= len(c.experts) <= 12 and c.tokens == 3 for c in wide.calls)
    assert wide.tokens == 150 and wide.source == "uniform batch 3"


def test_zipf_routing_follows_the_ranks():
    p = synthetic_routing(SHAPE, 2000, routing="zipf", a=1.2, drift=0)
    ranks = ZipfRanks([16] * 3, 1.2, 0)  # the orders the profile drew
    for li in range(3):
        counts = torch.bincount(
            torch.tensor([e for c in p.calls if c.layer == li for e in c.experts]), minlength=16
        )
        assert counts[ranks.orders[li][0]] == counts.max()  # rank 1 is the most used
        assert counts[ranks.orders[li][0]] > 3 * counts[ranks.orders[li][-1]]
    assert p.source == "zipf a=1.2 drift=0"


def test_zipf_ranks_drift():
    ranks = ZipfRanks([5, 6], a=1.0, drift=4, seed=1)
    first = [o.clone() for o in ranks.orders]
    assert torch.equal(ranks.bias(1)[first[1]], -torch.arange(1, 7, dtype=torch.float32).log())
    assert [ranks.step(i) for i in range(9)] == [True, False, False, False, True] + [False] * 3 + [
        True
    ]
    for before, after in zip(first, ranks.orders, strict=True):
        assert sorted(after.tolist()) == sorted(before.tolist())
        assert 1 <= (after != before).sum() <= 6  # neighbours swapped, three times
    assert not ZipfRanks([5], 1.0, 0).step(0)


# -- the prediction --------------------------------------------------------------------------------


def test_ms_per_token_is_the_larger_of_link_and_compute():
    profile = synthetic_routing(SHAPE, 64, routing="zipf")
    plan = plan_experts(SHAPE, profile, link_bytes_per_s=1e9, resident_ms_per_token=2.0,
                        warmup_steps=8)  # fmt: skip
    caches = [p.cache_bytes for p in plan.predictions]
    least = SHAPE.top_k * SHAPE.layout().slot_bytes
    assert caches[0] == least and caches[-1] == 48 * SHAPE.layout().slot_bytes
    assert caches == sorted(caches)
    for p in plan.predictions:
        assert p.tokens == 56
        assert p.link_ms == pytest.approx(p.h2d_bytes / 56 / 1e9 * 1e3)
        assert p.ms_per_token == max(p.link_ms, 2.0)
        assert p.bound == ("link" if p.link_ms > 2.0 else "compute")
        assert p.h2d_bytes == p.misses * SHAPE.expert_bytes
    assert plan.predictions[0].hit_rate < plan.predictions[-1].hit_rate
    assert plan.reaching(1e9) is plan.predictions[0]
    assert plan.reaching(1.0) is None


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_target_finds_the_least_cache(policy):
    profile = synthetic_routing(SHAPE, 96, routing="zipf", a=1.0, drift=4)
    kw = dict(link_bytes_per_s=1e9, resident_ms_per_token=0.5, policy=policy, warmup_steps=16)
    every = plan_experts(SHAPE, profile, cache_bytes=[s * SHAPE.layout().slot_bytes
                                                      for s in range(4, 49)], **kw)  # fmt: skip
    target = every.predictions[len(every.predictions) // 2].ms_per_token
    plan = plan_experts(SHAPE, profile, cache_bytes=[4 << 20], target_ms_per_token=target, **kw)
    assert plan.target == every.reaching(target)
    assert plan.target in plan.predictions and len(plan.predictions) == 2
    assert "<- least for the target" in str(plan)
    assert f"target {target:g} ms/token: the least cache predicted" in str(plan)


def test_unreachable_targets_say_why():
    profile = synthetic_routing(SHAPE, 16)
    plan = plan_experts(SHAPE, profile, link_bytes_per_s=1e9, resident_ms_per_token=3.0,
                        target_ms_per_token=2.0)  # fmt: skip
    assert plan.target is None and "the resident model takes 3" in str(plan)
    plan = plan_experts(SHAPE, profile, link_bytes_per_s=1e6, resident_ms_per_token=0.0,
                        target_ms_per_token=1.0)  # fmt: skip
    assert plan.target is None and "not even a slot for every expert" in str(plan)


def test_the_report():
    plan = plan_experts(SHAPE, synthetic_routing(SHAPE, 16), link_bytes_per_s=LINK,
                        resident_ms_per_token=1.0, cache_bytes=[4 << 20, 8 << 20])  # fmt: skip
    text = str(plan)
    assert text.startswith("torchoffload expert plan: 3 expert layers x 16 fused experts (top 4)")
    assert "routing: RoutingProfile(uniform: 16 steps" in text and "policy lru" in text
    assert "link 25.0 GB/s, resident 1.00 ms/token" in text
    rows = [line.split() for line in text.splitlines() if line[:10].strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("4.00", "4"), ("8.00", "8")]


def test_bad_arguments():
    profile = synthetic_routing(SHAPE, 4)
    kw = dict(link_bytes_per_s=LINK, resident_ms_per_token=1.0)
    other = ExpertShape(layers=2, experts=16, top_k=4, member_bytes=(1 << 20,))
    cases = [
        (dict(model_or_shape="model"), TypeError, "must be an nn.Module, an ExpertStreamHandle"),
        (dict(model_or_shape=other), ValueError, r"routes over 3 expert layers.*model has 2"),
        (dict(profile=[]), TypeError, "profile must be a RoutingProfile"),
        (dict(cache_bytes=[1 << 20]), ValueError, "under the least cache, 4194304 bytes"),
        (dict(cache_bytes=[1.5]), TypeError, "cache_bytes must be an int"),
        (dict(cache_bytes=[]), ValueError, "cache_bytes names no size"),
        (dict(policy="fifo"), ValueError, "policy must be 'lru' or 'lfu'"),
        (dict(warmup_steps=4), ValueError, "none is left after warmup_steps=4"),
        (dict(link_bytes_per_s=0), ValueError, "link_bytes_per_s"),
        (dict(resident_ms_per_token=-1), ValueError, "resident_ms_per_token"),
    ]
    for change, exc, match in cases:
        args = dict(model_or_shape=SHAPE, profile=profile, **kw) | change
        with pytest.raises(exc, match=match):
            plan_experts(args.pop("model_or_shape"), args.pop("profile"), **args)
    with pytest.raises(ValueError, match="routing must be 'uniform' or 'zipf'"):
        synthetic_routing(SHAPE, 4, routing="hot")
    with pytest.raises(ValueError, match="outside layer 0's 16"):
        RoutingProfile((16,), 2, (BlockCall(0, 1, (16,)),))
    with pytest.raises(ValueError, match="names layer 1"):
        RoutingProfile((16,), 2, (BlockCall(1, 1, (0,)),))
    with pytest.raises(ValueError, match="top_k"):
        ExpertShape(layers=1, experts=4, top_k=0, member_bytes=(8,))
