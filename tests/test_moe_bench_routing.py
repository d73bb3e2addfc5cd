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
