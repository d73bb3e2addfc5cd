"""Know before you run: trace one training step under fake tensors, then choose per layer
between keeping, offloading, recomputing, and recomputing with the input offloaded, to meet a
memory budget at the least predicted step time.

::

    plan = torchoffload.plan(model, (tokens,), budget_bytes=40 << 30)
    print(plan)                                   # per layer: bytes, FLOPs, decision; predictions
    handle = torchoffload.apply_activation_offloading(model, plan=plan)
    plan.plot("memory.png")                       # memory over one step, baseline vs plan

Nothing is allocated: parameters, inputs and every intermediate are fake tensors (shapes,
dtypes and storages without memory), so a 70B-parameter model traces on a laptop.

The package, by role: `_trace` (the fake-tensor trace, Note: [What the trace records]),
`_hardware` (the machine: rates and host costs, measured or default), `_cost` (the cost
model: Notes [How a plan changes memory] and [How a plan changes time]), `_search` (choosing
decisions under a budget), `_plan` (the `Plan`, its report, plot and application).

For mixture-of-experts inference, `plan_experts` predicts decode ms per token of
`stream_experts` at each expert cache size, replaying a routing profile (recorded with
`ExpertStreamHandle.record_routing`, or `synthetic_routing`) through the engine's bookkeeping:
`_experts` (Note: [Predicting expert streaming]), `_routing` (the synthetic profiles).
"""

from torchoffload.planner._cost import DECISIONS, STREAM, Decision, Prediction
from torchoffload.planner._experts import ExpertPlan, ExpertPrediction, ExpertShape, plan_experts
from torchoffload.planner._hardware import Hardware
from torchoffload.planner._plan import (
    OptimizerState,
    Plan,
    plan,
    plan_from_profile,
    synthetic_profile,
)
from torchoffload.planner._routing import synthetic_routing
from torchoffload.planner._search import InfeasibleBudgetError
from torchoffload.planner._trace import LayerProfile, Profile, trace

__all__ = [
    "DECISIONS",
    "Decision",
    "ExpertPlan",
    "ExpertPrediction",
    "ExpertShape",
    "STREAM",
    "Hardware",
    "InfeasibleBudgetError",
    "LayerProfile",
    "OptimizerState",
    "Plan",
    "Prediction",
    "Profile",
    "plan",
    "plan_experts",
    "plan_from_profile",
    "synthetic_profile",
    "synthetic_routing",
    "trace",
]
