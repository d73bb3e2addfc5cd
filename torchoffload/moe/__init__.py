"""Mixture-of-experts inference: experts live in pinned host memory, and after each block's
router runs only its routed experts that are not in a device cache are copied.

```python
handle = torchoffload.stream_experts(model, device="cuda", cache_bytes=16 << 30)
with torch.inference_mode():
    out = model.generate(...)
handle.stats().hit_rate, handle.stats().bytes_per_token
handle.remove()
```

Modules, bottom up: `_layout` (finding the experts: fused parameters or a list of modules; the
pure byte layout), `_cache` (device slots and the replacement policy), `_routing` (routing
profiles: the block calls of a run, recorded for the planner), `_store` (the host store and
the placeholders of the expert tensors), `_runtime` (routing through the cache, copies and
events), `_host` (cold experts computed on the host), `_forward` (the fused experts' forward
and the hooks of a list of experts), `_handle` (the public face). The dense parts stay on the
device.
"""

from torchoffload.moe._cache import CachePolicy
from torchoffload.moe._handle import (
    ExpertLayerStats,
    ExpertStats,
    ExpertStreamHandle,
    minimum_cache_bytes,
    stream_experts,
)
from torchoffload.moe._host import HostCompute, HostPolicy
from torchoffload.moe._routing import BlockCall, RoutingProfile, RoutingRecorder

__all__ = [
    "BlockCall",
    "CachePolicy",
    "ExpertLayerStats",
    "ExpertStats",
    "ExpertStreamHandle",
    "HostCompute",
    "HostPolicy",
    "RoutingProfile",
    "RoutingRecorder",
    "minimum_cache_bytes",
    "stream_experts",
]
