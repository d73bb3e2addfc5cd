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
its weights streamed through probes (`insert_weight_probes`); ``toc.save_streamed_package``
compiles a model with AOTInductor into a package that holds no weights and
``toc.load_streamed_package`` runs it with its weights streamed from a safetensors file
(`torchoffload.compile._package`).
"""

from torchoffload.compile._backend import ActivationPartitioner, backend
from torchoffload.compile._ops import (
    OpStats,
    discard_in_flight,
    op_stats,
    reset_op_stats,
    set_op_pool,
)
from torchoffload.compile._package import (
    Catalog,
    StreamedPackage,
    WeightEntry,
    compile_streamed,
    export_streamed,
    load_streamed_package,
    read_catalog,
    save_streamed_package,
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
    "Catalog",
    "ExportedWeightRunner",
    "OffloadDecision",
    "OpStats",
    "PassReport",
    "StreamedPackage",
    "WeightEntry",
    "backend",
    "discard_in_flight",
    "export_streamed",
    "insert_weight_probes",
    "load_streamed_package",
    "offload_activations_pass",
    "op_stats",
    "read_catalog",
    "reset_op_stats",
    "compile_streamed",
    "save_streamed_package",
    "set_op_pool",
    "stream_exported_weights",
]
