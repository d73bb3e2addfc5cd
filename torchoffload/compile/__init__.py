"""Offloading inside compiled graphs: `torch.library` ops that survive `torch.compile` and
`torch.export` (see `torchoffload.compile._ops`, Note: [Graph ops and the transfer protocol]).

::

    import torchoffload.compile as toc
    host = torch.ops.torchoffload.offload(x)
    torch.ops.torchoffload.wait(host)          # x's memory may be reused
    y = torch.ops.torchoffload.reload(host, x.device)
    torch.ops.torchoffload.wait(y)             # y is ready

Training: ``torch.compile(model, backend=toc.backend(ActivationOffloadConfig()))`` offloads
saved activations inside the compiled graphs (`offload_activations_pass`); the config is the
eager mode's (``ActivationPassConfig`` is the same type). Inference:
``toc.stream_exported_weights(ep, device, budget_bytes=...)`` runs an exported program with
its weights streamed through probes (`insert_weight_probes`).
"""

from torchoffload.compile._backend import ActivationPartitioner, backend
from torchoffload.compile._ops import (
    OpStats,
    discard_in_flight,
    op_stats,
    reset_op_stats,
    set_op_pool,
)
from torchoffload.compile._pass import (
    ActivationPassConfig,
    OffloadDecision,
    PassReport,
    offload_activations_pass,
)
from torchoffload.compile._probe import (
    ExportedWeightRunner,
    insert_weight_probes,
    stream_exported_weights,
)

__all__ = [
    "ActivationPartitioner",
    "ActivationPassConfig",
    "ExportedWeightRunner",
    "OffloadDecision",
    "OpStats",
    "PassReport",
    "backend",
    "discard_in_flight",
    "insert_weight_probes",
    "offload_activations_pass",
    "op_stats",
    "reset_op_stats",
    "set_op_pool",
    "stream_exported_weights",
]
