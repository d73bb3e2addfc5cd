"""benchmarks/moe.py's routing model: in a forward, each router reads the routing's noise; a
router called from another decoder layer's block (as stream_experts' prefetch calls the next
block's) sees a share ``unseen`` of it drawn again (the module doc of benchmarks/moe.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("moe")
    finally:
        sys.path.remove(str(BENCH))


def routed_with(router, h, extra):
    """The experts ``router`` picks for ``h`` with ``extra`` added to its logits (the
    benchmark's router, written out)."""
    logits = F.linear(h.reshape(-1, router.hidden_dim), router.weight) + extra.to(h.dtype)
    return torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), router.top_k).indices


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_a_forward_reads_the_noise_and_a_prediction_most_of_it(bench, kind):
    shape = dict(bench.SHAPES["small"], layers=3, experts=32, top_k=4)
    model = bench.build(shape, torch.device("cpu"))
    n = 64
    ids = torch.randint(0, shape["vocab"], (1, n), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n)
    shares = {}
    for unseen in (0.0, 0.17):
        routing = bench.Routing(model, kind, 1.0, 8, 8.0, n, unseen=unseen)
        calls = {li: [] for li in range(len(routing.routers))}  # (input, experts) in order

        def record(li, calls=calls):
            return lambda module, args, out: calls[li].append((args[0], out[2]))

        def predict(li, routing=routing):  # block li calls router li + 1, as a prefetch does
            def hook(module, args):
                routing.routers[li + 1](args[0])

            return hook

        hooks = [r.register_forward_hook(record(li)) for li, r in enumerate(routing.routers)]
        hooks += [layer.mlp.register_forward_pre_hook(predict(li))
                  for li, layer in enumerate(routing.layers[:-1])]  # fmt: skip
        routing.start()
        try:
            routing.at(pos)
            with torch.no_grad():
                model(ids)
            assert routing.current is None  # outside the layers again
        finally:
            routing.stop()
            for h in hooks:
                h.remove()
        assert not routing.layers[0]._forward_pre_hooks and not routing.layers[0]._forward_hooks
        for li, r in enumerate(routing.routers):
            own = calls[li][-1]  # its own block's call comes last
            assert torch.equal(own[1], routed_with(r, own[0], routing.bias[li] + routing.noise[li]))
            if li:
                h, got = calls[li][0]  # called from block li - 1
                assert len(calls[li]) == 2
                assert torch.equal(got, routed_with(r, h, routing.bias[li] + routing.seen[li]))
                mine, theirs = own[1].sort(-1).values, got.sort(-1).values
                share = (mine.unsqueeze(2) == theirs.unsqueeze(1)).any(2).float().mean().item()
                shares.setdefault(unseen, []).append(share)
    assert all(s > 0.95 for s in shares[0.0]), shares  # the hidden states differ a little
    assert all(0.6 < s < 0.95 for s in shares[0.17]), shares  # 0.75-0.79 simulated


def test_the_all_cached_row_fills_its_cache_after_the_prompt(bench):
    """A grouped_mm prompt of at least ``STAGE_ROWS`` rows per expert stages each layer whole,
    which leaves the staging slots' experts uncached: filled before the prompt, the decode
    steps after it miss; filled after it (`decode`'s ``after_prompt``, as the ``graph all
    cached`` row does), they hit every routed expert."""
    import torchoffload as to

    shape = dict(bench.SHAPES["small"], layers=3, hidden=128, width=64, heads=2, vocab=512)
    model = bench.build(shape, torch.device("cpu"), "grouped_mm")
    top_k, experts = shape["top_k"], shape["experts"]
    prompt = bench.STAGE_ROWS * experts // top_k  # the fewest tokens that stage a layer
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (1, prompt + 1 + 4), generator=g)
    fill_ids = torch.randint(0, shape["vocab"], (1, 256), generator=g)
    chunk = (bench.STAGE_ROWS * experts - 1) // top_k
    routing = bench.Routing(model, "uniform", 1.0, 8, 8.0, fill_ids.shape[1], unseen=0.17)
    h = to.stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    rates = {}
    try:
        routing.start()
        for when in ("before", "after"):
            fill = lambda: bench.fill(model, fill_ids, routing, chunk, h)  # noqa: E731
            if when == "before":
                fill()
            _, _, st = bench.decode(model, ids, 1, 4, routing, h,
                                    after_prompt=fill if when == "after" else None)  # fmt: skip
            rates[when] = (st.hits, st.misses)
    finally:
        routing.stop()
        h.remove()
    assert rates["after"][1] == 0 and rates["after"][0] == 4 * 3 * top_k, rates
    assert rates["before"][1] > 0, rates
