"""benchmarks/moe.py's routing model: a router called from another decoder layer's block (the
prefetch's prediction) sees a share ``unseen`` of the noise drawn again, and its own layer's
call sees the routing's noise (the module doc of benchmarks/moe.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("moe")
    finally:
        sys.path.remove(str(BENCH))


def routed(router, h):
    return router(h)[2].sort(dim=-1).values


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_a_router_called_from_the_previous_block_predicts_most_not_all(bench, kind):
    shape = dict(bench.SHAPES["small"], layers=2, experts=32, top_k=4)
    model = bench.build(shape, torch.device("cpu"))
    positions = 256
    h = torch.randn(positions, shape["hidden"], dtype=torch.bfloat16)
    shares = {}
    for unseen in (0.0, 0.17):
        routing = bench.Routing(model, kind, 1.0, 8, 8.0, positions, unseen=unseen)
        routing.start()
        try:
            routing.at(torch.arange(positions))
            gate = routing.routers[1]
            own = routed(gate, h)  # outside any layer: the router's own noise
            routing.current = 1
            assert torch.equal(routed(gate, h), own)
            routing.current = 0  # called from block 0: a prediction
            seen = routed(gate, h)
        finally:
            routing.stop()
        assert routing.current is None and not routing.layers[0]._forward_pre_hooks
        shares[unseen] = (own.unsqueeze(2) == seen.unsqueeze(1)).any(2).float().mean().item()
    assert shares[0.0] == 1.0
    assert 0.6 < shares[0.17] < 0.95, shares  # 0.75-0.79 simulated (the module doc)
