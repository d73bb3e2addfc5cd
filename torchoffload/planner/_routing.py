"""Synthetic routing profiles for the expert planner: uniform (each token routes to ``top_k`` of a
layer's experts at random) or Zipf-skewed with slow drift, the model of ``benchmarks/moe.py``'s
``zipf`` routing (`ZipfRanks` is shared with it)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
from torch import nn

from torchoffload._validate import check_int, check_number
from torchoffload.moe._handle import ExpertStreamHandle
from torchoffload.moe._routing import BlockCall, RoutingProfile
from torchoffload.planner._experts import ExpertShape, as_layout

__all__ = ["Routing", "ZipfRanks", "synthetic_routing"]


class Routing(str, enum.Enum):
    """How a synthetic profile routes."""

    UNIFORM = "uniform"
    ZIPF = "zipf"

    @classmethod
    def parse(cls, value: object) -> Routing:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"routing must be 'uniform' or 'zipf', got {value!r}") from None


class ZipfRanks:
    """Expert popularity that follows a Zipf law and drifts. Each layer ranks its experts in a
    random order (drawn from ``seed``); the expert of rank r (from 1) gets the logit bias
    ``-a * log(r)``; before token i, when ``i % drift == 0``, two neighbouring ranks swap in
    each layer (``drift=0``: never). ``benchmarks/moe.py`` adds these biases to its routers'
    logits; `synthetic_routing` adds Gumbel noise instead, so that a token's top-k is a draw
    of k experts without replacement with probabilities proportional to ``rank ** -a``."""

    def __init__(self, experts: Sequence[int], a: float, drift: int, seed: int = 1):
        self.a = a
        self.drift = drift
        self.gen = torch.Generator().manual_seed(seed)
        self.orders = [torch.randperm(n, generator=self.gen) for n in experts]

    def step(self, i: int) -> bool:
        """Before token ``i``: swap two neighbouring ranks of each layer when it is time.
        Returns whether the ranks changed."""
        if not self.drift or i % self.drift:
            return False
        for order in self.orders:
            if len(order) > 1:
                j = int(torch.randint(0, len(order) - 1, (1,), generator=self.gen))
                order[[j, j + 1]] = order[[j + 1, j]]
        return True

    def bias(self, layer: int) -> torch.Tensor:
        """The logit bias of each expert of ``layer`` (float32)."""
        order = self.orders[layer]
        values = torch.empty(len(order))
        values[order] = -self.a * torch.arange(1, len(order) + 1, dtype=torch.float32).log()
        return values


def synthetic_routing(
    model_or_shape: nn.Module | ExpertStreamHandle | ExpertShape,
    steps: int,
    *,
    routing: str = "uniform",
    a: float = 1.0,
    drift: int = 8,
    batch: int = 1,
    seed: int = 0,
) -> RoutingProfile:
    """A `RoutingProfile` of ``steps`` decode steps of ``batch`` tokens through every expert
    layer of a model (streamed or not), its `ExpertStreamHandle` or an `ExpertShape`: per step
    and layer, each token routes to ``top_k`` of the layer's experts, and the block computes
    their union in expert order.

    ``routing="uniform"``: each token's experts are a uniform draw. ``"zipf"``: expert
    popularity follows a Zipf law of exponent ``a`` over a random order of each layer's experts,
    two neighbouring ranks swapping every ``drift`` tokens (``0``: never): a token's experts
    are drawn without replacement with probabilities proportional to ``rank ** -a``. The model
    of ``benchmarks/moe.py``'s ``zipf`` routing (whose router logits stand in for the noise);
    an ``a`` of about 1 gives the hit rates that traces of real MoE decoding report. ``seed``
    draws the tokens; the ranks are drawn as the benchmark draws them."""
    layout = as_layout(model_or_shape)
    kind = Routing.parse(routing)
    check_int("steps", steps, minimum=1)
    check_int("batch", batch, minimum=1)
    check_int("drift", drift, minimum=0)
    check_int("seed", seed, minimum=0)
    check_number("a", a, positive=False)
    experts = [layer.experts for layer in layout.layers]
    ks = [min(layer.top_k or 1, layer.experts) for layer in layout.layers]
    k = layout.top_k
    most = max(experts)
    gen = torch.Generator().manual_seed(seed)
    ranks = ZipfRanks(experts, a, drift) if kind is Routing.ZIPF else None
    pad = torch.zeros(len(experts), 1, most)  # -inf past a layer's experts
    for li, n in enumerate(experts):
        pad[li, :, n:] = -torch.inf
    bias = None
    calls = []
    for i in range(steps):
        if ranks is not None and (ranks.step(i) or bias is None):
            bias = torch.full((len(experts), 1, most), -torch.inf)
            for li, n in enumerate(experts):
                bias[li, 0, :n] = ranks.bias(li)
        u = torch.rand(len(experts), batch, most, generator=gen)
        # uniform: the top-k of i.i.d. scores; zipf: Gumbel-top-k
        gumbel = None if bias is None else -torch.log(-torch.log(u.clamp_min(1e-30)))
        scores = u + pad if bias is None else bias + gumbel
        chosen = torch.topk(scores, min(k, most), dim=-1).indices
        for li, rows in enumerate(chosen.tolist()):
            used = tuple(sorted({e for row in rows for e in row[: ks[li]]}))
            calls.append(BlockCall(li, batch, used, used))
    name = kind.value if ranks is None else f"zipf a={a:g} drift={drift}"
    if batch > 1:
        name += f" batch {batch}"
    return RoutingProfile(tuple(experts), k, tuple(calls), name)
