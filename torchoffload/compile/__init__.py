"""Offloading inside compiled graphs: `torch.library` ops that survive `torch.compile` and
`torch.export` (see `torchoffload.compile._ops`, Note: [Graph ops and the transfer protocol]).

::

    import torchoffload.compile as toc
    host = torch.ops.torchoffload.offload(x)
    torch.ops.torchoffload.wait(host)          # x's memory may be reused
    y = torch.ops.torchoffload.reload(host, x.device)
    torch.ops.torchoffload.wait(y)             # y is ready

Status: the ops (this module). The activation graph pass, the `torch.compile` backend and
weight probes for exported programs are not built yet (issue "Compiled graphs").
"""

from torchoffload.compile._ops import (
    OpStats,
    discard_in_flight,
    op_stats,
    reset_op_stats,
    set_op_pool,
)

__all__ = ["OpStats", "discard_in_flight", "op_stats", "reset_op_stats", "set_op_pool"]
