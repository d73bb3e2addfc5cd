"""GPU tests for the planner: run on the GPU machine with ``pytest -m gpu``.

A plan never exceeds its budget as measured (issue 38; Note: [The planning margin]): the
issue's GPT (h2048, 12 layers, batch 8, seq 2048, bf16, AdamW) is measured without a plan,
planned for a fraction of that peak, and the plan applied as a user would
(`plan.stream_parameters`, `plan.optimizer`, `plan.apply`); its `max_memory_allocated` over
whole training steps (forward, backward, optimizer step) must be at most the budget.
"""

from __future__ import annotations

import gc

import pytest
import torch

from torchoffload.models import GPT, GPTConfig
from torchoffload.optim import OffloadedOptimizer
from torchoffload.planner import Hardware, plan_from_profile, trace

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CFG = GPTConfig(hidden=2048, layers=12, heads=16, vocab=1024, max_seq=2048)
BATCH, SEQ = 8, 2048
GIB = 1 << 30


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def measured_peak(model, opt, tokens, before: int, *, warmup: int = 1, steps: int = 2) -> int:
    """Peak bytes allocated over ``steps`` training steps after ``warmup``, beyond ``before``
    (what the process held before the test)."""
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
        loss_of(model(tokens)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.fixture(scope="module")
def hardware():
    return Hardware.detect()  # once: the plans are priced as `torchoffload.plan` prices them


@pytest.mark.parametrize("fraction", [0.75, 0.5, 0.25])
def test_the_plan_fits_its_budget_as_measured(fraction, hardware):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    with dev:
        model = GPT(CFG).to(torch.bfloat16)
        tokens = torch.randint(0, CFG.vocab, (BATCH, SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak0 = measured_peak(model, opt, tokens, before)
    del opt
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()

    budget = int(fraction * peak0)
    profile = trace(model, (tokens,), loss_fn=loss_of)
    plan = plan_from_profile(profile, budget, hardware=hardware)
    assert plan.predicted.peak_bytes + plan.margin_bytes <= budget
    params = plan.stream_parameters(model)
    opt = plan.optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    handle = plan.apply(model)
    try:
        peak = measured_peak(model, opt, tokens, before)
    finally:
        handle.remove()
        if isinstance(opt, OffloadedOptimizer):
            opt.remove()
        if params is not None:
            params.remove()
    assert peak <= budget, (
        f"measured {peak / GIB:.3f} GiB for a budget of {budget / GIB:.3f} GiB (no plan: "
        f"{peak0 / GIB:.3f}; predicted {plan.predicted.peak_bytes / GIB:.3f} + margin "
        f"{plan.margin_bytes / GIB:.3f}; {plan.optimizer_state.value}/{plan.parameters}, "
        f"{[d.value for d in plan.decisions]})"
    )
