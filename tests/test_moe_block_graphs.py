"""Eager one-token block calls on the device-routed path (``block_graphs``, Note: [Block calls
replayed as graphs]) on the CPU, where no graph is captured and every such call runs the
tables' updates and copies as tensor operations: decode logits bitwise the resident model's at
the least cache, a middle one and every expert cached, for each experts implementation; the
map handed between the host and the device tables around prefills, ``cached()``, a write and a
routing recorder; the setting's refusals."""

from __future__ import annotations

import pytest
import torch
from test_moe import moe, qwen3  # tests/ is on sys.path
from test_moe_graph import prompt

import torchoffload as to

transformers = pytest.importorskip("transformers")


def decode_logits(model, ids, n, edit=None, requests=1):
    """Every step's logits of a greedy decode of ``n`` tokens over a static cache, for
    ``requests`` prompts in turn (each a prefill, then one-token steps); ``edit(r, i)`` runs
    before step i of request r."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + n + 4)
    out = []
    with torch.inference_mode():
        for r in range(requests):
            cache.reset()
            at = torch.arange(ids.shape[1], device=ids.device)
            logits = model(input_ids=ids, cache_position=at, past_key_values=cache).logits[:, -1]
            out.append(logits)
            for i in range(n - 1):
                if edit is not None:
                    edit(r, i)
                tok = logits.argmax(-1, keepdim=True)
                pos = torch.tensor([ids.shape[1] + i], device=ids.device)
                logits = model(input_ids=tok, position_ids=pos.unsqueeze(0), cache_position=pos,
                               past_key_values=cache).logits[:, -1]  # fmt: skip
                out.append(logits)
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


F32, BF16 = torch.float32, torch.bfloat16
CASES = [  # (slots, policy, dtype, impl): each cache and policy, each implementation, both dtypes
    (2, "lru", F32, "eager"), (5, "lfu", BF16, "eager"), (5, "lru", F32, "eager"),
    (16, "lru", BF16, "eager"), (2, "lru", BF16, "grouped_mm"), (5, "lfu", BF16, "grouped_mm"),
    (16, "lru", F32, "grouped_mm"), (2, "lru", F32, "batched_mm"), (5, "lru", BF16, "batched_mm"),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("slots, policy, dtype, impl", CASES)
def test_block_graph_decode_is_bitwise(slots, policy, dtype, impl):
    """Two requests of a prefill (routed on the host) and 7 one-token steps (on the device
    tables): the map moves to the tables at each request's first step and back at its next
    prefill, and every step's logits are the resident model's."""
    want = decode_logits(qwen3(impl, dtype=dtype), prompt(), 8, requests=2)
    model = qwen3(impl, dtype=dtype)
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=slots * slot_bytes, policy=policy,
                          pin_memory=False, block_graphs=True)  # fmt: skip
    got = decode_logits(model, prompt(), 8, requests=2)
    assert same(got, want)
    st = h.stats()
    # two layers x 2 x 7 steps on the device-routed path; no graph on the CPU
    assert (st.block_eager_calls, st.block_captures, st.block_replays) == (28, 0, 0)
    assert st.calls == 16 and st.tokens == 2 * (4 + 7)
    assert st.hits + st.misses == sum(layer.uses for layer in st.layers)
    assert st.h2d_bytes == (st.misses + st.staged) * st.layers[0].expert_bytes
    assert st.prefetched == 0  # a block graph does not prefetch
    if slots == 2:  # the least cache is the stage: every step's expert comes from the host
        assert st.cached == 0
    tables = h._runtime.tables  # the steps left the map on the device
    assert tables.owned and st.cached == int((tables.key_of[:-1] >= 0).sum())
    h.remove()
    assert same(decode_logits(model, prompt(), 8, requests=2), want)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_cache_carries_over_between_the_host_and_the_tables():
    """With every expert cached, the experts the prefill copied are hits on the device path,
    and those the steps copied are hits of the next prefill: nothing is copied twice."""
    model = qwen3()
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=100 * slot_bytes, pin_memory=False,
                          block_graphs=True)  # fmt: skip
    want = decode_logits(qwen3(), prompt(seq=48, seed=2), 6, requests=2)
    assert same(decode_logits(model, prompt(seq=48, seed=2), 6, requests=2), want)
    st = h.stats()
    # the first prefill routes to every expert: each copied once, then hits only
    assert (st.misses, st.h2d_copies, st.evictions, st.cached) == (16, 16, 0, 16)
    assert len(h.cached()) == 16
    assert st.block_eager_calls == 2 * 2 * 5
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_reads_writes_and_a_recorder_between_block_calls():
    """Between one-token steps: ``cached()`` and ``stats()`` read the tables; a write of an
    expert (``mul_`` on its placeholder) takes the map back and is seen by the next step; a
    routing recorder routes on the host (it records what the host reads); the logits are the
    resident model's under the same edits."""

    def edits(model, handle=None, seen=None):
        def edit(r, i):
            if handle is not None and i == 1:
                seen.append((handle.cached(), handle.stats().calls))
            if i == 3:
                with torch.no_grad():
                    model.model.layers[1].mlp.experts.down_proj.mul_(1.5)

        return edit

    ref = qwen3()
    want = decode_logits(ref, prompt(), 7, edit=edits(ref))
    model = qwen3()
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=6 * slot_bytes, pin_memory=False,
                          block_graphs=True)  # fmt: skip
    seen = []
    assert same(decode_logits(model, prompt(), 7, edit=edits(model, h, seen)), want)
    ((cached, calls),) = seen
    assert calls == 2 and 0 < len(cached) <= 4  # the prefill's and a step's, beside the stage
    with h.record_routing() as rec:
        assert same(decode_logits(model, prompt(), 3), decode_logits(ref, prompt(), 3))
    assert rec.profile().steps == 3  # a prefill and two steps, seen on the host
    st = h.stats()
    assert st.block_eager_calls == 2 * 6
    h.reset_stats()
    assert h.stats().block_eager_calls == 0
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_block_graphs_setting():
    """``None`` is off on the CPU (no graphs to gain); ``True`` refuses what a block graph
    cannot serve; gradients on still get the inference error."""
    model = qwen3()
    least = to.minimum_cache_bytes(model)
    h = to.stream_experts(model, "cpu", cache_bytes=least, pin_memory=False)
    decode_logits(model, prompt(), 3)
    assert h.stats().block_eager_calls == 0
    h.remove()
    with pytest.raises(TypeError, match="block_graphs"):
        to.stream_experts(model, "cpu", cache_bytes=least, block_graphs="yes")
    with pytest.raises(ValueError, match="block_graphs=True and host_compute"):
        to.stream_experts(model, "cpu", cache_bytes=least, host_compute=True, block_graphs=True)
    listed = moe()
    with pytest.raises(ValueError, match="block_graphs=True: .*ModuleList"):
        to.stream_experts(listed, "cpu", cache_bytes=to.minimum_cache_bytes(listed),
                          block_graphs=True)  # fmt: skip
    h = to.stream_experts(model, "cpu", cache_bytes=least, pin_memory=False, block_graphs=True)
    with pytest.raises(RuntimeError, match="serves inference"):
        model(prompt()[:, :1])
    for _ in range(2):  # nothing left half done: the model still runs, bitwise
        assert same(decode_logits(model, prompt(), 3), decode_logits(qwen3(), prompt(), 3))
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_call_interrupted_after_the_tables_update_leaves_no_false_hit():
    """An interrupt between the tables' update and the queueing of the copies (the third
    block call here) would leave slots named for bytes never written: the map is emptied, and
    the same request again gives the resident model's logits."""
    from torchoffload.moe import _graphed

    want = decode_logits(qwen3(), prompt(), 6)
    model = qwen3()
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=6 * slot_bytes, pin_memory=False,
                          block_graphs=True)  # fmt: skip
    apply = _graphed.Stage.apply
    calls = []

    def interrupted(self, li, plan):
        calls.append(li)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return apply(self, li, plan)

    _graphed.Stage.apply = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            decode_logits(model, prompt(), 6)
    finally:
        _graphed.Stage.apply = apply
    assert same(decode_logits(model, prompt(), 6), want)
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_python_that_runs_at_every_call_routes_on_the_host():
    """A hook on the experts' activation and a dispatch mode run at every call, so those calls
    route on the host (a graph would replay what its capture saw): the hook sees each call, and
    the logits are the resident model's."""
    from torch.utils.flop_counter import FlopCounterMode

    seen = {"ref": 0, "off": 0}

    def hook(name):
        def count(module, args, out):
            seen[name] += 1

        return count

    ref = qwen3()
    ref.model.layers[0].mlp.experts.act_fn.register_forward_hook(hook("ref"))
    want = decode_logits(ref, prompt(), 5)
    model = qwen3()
    slot_bytes = to.minimum_cache_bytes(model) // 2
    h = to.stream_experts(model, "cpu", cache_bytes=6 * slot_bytes, pin_memory=False,
                          block_graphs=True)  # fmt: skip
    model.model.layers[0].mlp.experts.act_fn.register_forward_hook(hook("off"))
    assert same(decode_logits(model, prompt(), 5), want)
    assert seen["off"] == seen["ref"] > 0
    assert h.stats().block_eager_calls == 4  # layer 1's four steps; layer 0's on the host
    h.reset_stats()
    with FlopCounterMode(display=False):
        got = decode_logits(model, prompt(), 3)
    assert h.stats().block_eager_calls == 0
    assert same(got, decode_logits(ref, prompt(), 3))
    h.remove()


def test_the_new_precision_api_is_read_without_an_error():
    """After `torch.backends.cuda.matmul.fp32_precision` is set (torch's new API), reading the
    legacy flags raises; the settings of a block graph's signature are still read (and differ
    from the defaults), and a one-token call runs. The setting is global: restored after, and
    the settings read as before (in-process; a child process took 28 s of a CI core)."""
    from torchoffload.moe._replayed import _settings

    mm = torch.backends.cuda.matmul
    device = torch.device("cuda")
    before = _settings(device)
    old = mm.fp32_precision
    try:
        mm.fp32_precision = "tf32"  # legacy reads raise from here (torch 2.13)
        assert _settings(device) != before
        m = qwen3()
        h = to.stream_experts(m, "cpu", cache_bytes=to.minimum_cache_bytes(m),
                              pin_memory=False, block_graphs=True)  # fmt: skip
        with torch.inference_mode():
            m(torch.ones(1, 1, dtype=torch.long))
        h.remove()
    finally:
        mm.fp32_precision = old
    assert _settings(device) == before
