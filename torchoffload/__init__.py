"""torchoffload: train and run PyTorch models with less accelerator memory by moving tensors to
pinned host memory and back while compute continues.

Importing the package is cheap: it pulls in nothing beyond torch.
"""

from torchoffload._flatten import register_flattener, unregister_flattener
from torchoffload._pool import PinnedPool, PoolExhaustedError, PoolStats, default_pool
from torchoffload.activations import ActivationStats, no_offload, offload_activations
from torchoffload.layers import (
    ActivationOffloadConfig,
    ActivationOffloadHandle,
    apply_activation_offloading,
    find_layers,
)
from torchoffload.moe import (
    ExpertLayerStats,
    ExpertStats,
    ExpertStreamHandle,
    minimum_cache_bytes,
    stream_experts,
)
from torchoffload.optim import (
    MovedGradError,
    OffloadedOptimizer,
    OptimizerOffloadConfig,
    OptimizerStats,
)
from torchoffload.planner import Hardware, InfeasibleBudgetError, Plan, Profile, plan, trace
from torchoffload.verify import Difference, VerificationError, VerifyReport, verify
from torchoffload.weights import (
    CheckpointError,
    ParameterStats,
    ParameterStreamHandle,
    WeightStats,
    WeightStreamHandle,
    minimum_budget,
    stream_parameters,
    stream_weights,
)

__all__ = [
    "ActivationOffloadConfig",
    "ActivationOffloadHandle",
    "ActivationStats",
    "CheckpointError",
    "Difference",
    "ExpertLayerStats",
    "ExpertStats",
    "ExpertStreamHandle",
    "apply_activation_offloading",
    "find_layers",
    "Hardware",
    "InfeasibleBudgetError",
    "plan",
    "Plan",
    "Profile",
    "trace",
    "minimum_budget",
    "minimum_cache_bytes",
    "MovedGradError",
    "OffloadedOptimizer",
    "OptimizerOffloadConfig",
    "OptimizerStats",
    "ParameterStats",
    "ParameterStreamHandle",
    "PinnedPool",
    "PoolExhaustedError",
    "PoolStats",
    "default_pool",
    "no_offload",
    "offload_activations",
    "register_flattener",
    "stream_experts",
    "stream_parameters",
    "stream_weights",
    "unregister_flattener",
    "verify",
    "VerificationError",
    "VerifyReport",
    "WeightStats",
    "WeightStreamHandle",
]

__version__ = "0.1.0"
