"""Weight streaming for inference: weights live in pinned host memory and only the units computing
now and next sit on the device, in an arena capped at a byte budget.

```python
handle = torchoffload.stream_weights(model, device="cuda", budget_bytes=4 << 30)
with torch.inference_mode():
    out = model(x)
handle.stats()
handle.remove()
```

Setup copies every streamed parameter and buffer into one exact-size pinned host buffer (tied
tensors and storages shared by views are stored once) and frees the originals. The model is
cut into *units* (its repeated blocks, else its leaf modules with weights). Before a unit runs
its tensors are bound, in place, to its bytes in the device arena; after it, they are unbound.
The order in which units run is recorded on the first forward and used to prefetch the next
``prefetch_depth`` units on a copy stream while the current one computes.

Modules, bottom up: `_layout` (the pure cut and byte layout), `_arena` (device ranges, ring and
events), `_schedule` (the recorded order), `_checkpoint` (safetensors catalogs read into the
host store), `_runtime` (the engine, driven by eager hooks, the exported-program runner and
compiled programs), `_graph` (calls replayed as CUDA graphs), `_handle` (the public face).

For training, `stream_parameters` (`_training`) keeps the same cut and host store but a device
storage per host piece that backward's saved views share: parameters are loaded for each
unit's forward and again, in reverse, for its backward.
"""

from torchoffload.weights._checkpoint import CheckpointError
from torchoffload.weights._graph import GraphStats, StreamedGraph
from torchoffload.weights._handle import (
    WeightStats,
    WeightStreamHandle,
    minimum_budget,
    stream_weights,
)
from torchoffload.weights._syncs import HostReadInCapture
from torchoffload.weights._training import (
    ParameterStats,
    ParameterStreamHandle,
    stream_parameters,
)

__all__ = [
    "CheckpointError",
    "GraphStats",
    "HostReadInCapture",
    "StreamedGraph",
    "WeightStats",
    "WeightStreamHandle",
    "minimum_budget",
    "ParameterStats",
    "ParameterStreamHandle",
    "stream_parameters",
    "stream_weights",
]
