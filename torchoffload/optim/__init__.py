"""Training state on the host: an optimizer whose state, fp32 master weights and step live in
pinned host memory, stepped on a worker thread while backward computes.

```python
opt = torchoffload.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
loss.backward()   # each bucket's gradients leave the device once final; the host steps it
opt.step()        # waits for the last buckets; the next forward waits on the uploads
opt.zero_grad()
```

Modules, bottom up: `_config` (the config and stats), `_layout` (the pure host layout and
buckets), `_params` (what the optimizer reads of a parameter and a param group), `_grads`
(what ``param.grad`` holds once moved), `_host` (the pinned buffers, records and buckets),
`_checks` (what the host step refuses), `_step` (the work on a bucket), `_worker` (the thread
and its queue), `_dispatch` (gradients leaving the device), `_ahead` (``step_ahead``'s waits),
`_runtime` (`HostStepRuntime`, which sequences a step over those), `_device` (the part stepped
on the device with ``offload_fraction`` < 1), `_build` (the constructor's checks and
placement), `_state` (the state dict and stats), `_optimizer` (the public face, a
`torch.optim.Optimizer`). Beside them, optimizer classes with low-precision state, for the
host step or any other: `_lowbit` (8-bit moments, bf16 rounding) and `_adamw`
(`LowPrecisionAdamW`, `AdamW8bit`), whose host step on a CPU is the C kernel of `_native`
(``_lowbit_step.c``); and `_rate` (`measure_host_step`, the host step's rate, for the
planner).
"""

from torchoffload.optim._adamw import AdamW8bit, Bf16Rounding, LowPrecisionAdamW
from torchoffload.optim._config import OptimizerOffloadConfig, OptimizerStats
from torchoffload.optim._grads import ConsumedGrad, MovedGrad, MovedGradError
from torchoffload.optim._layout import (
    HostLayout,
    default_bucket_bytes,
    host_bytes_per_param,
    host_state_bytes,
    link_bytes_per_param,
    plan_layout,
)
from torchoffload.optim._optimizer import OffloadedOptimizer
from torchoffload.optim._rate import measure_host_step

__all__ = [
    "AdamW8bit",
    "Bf16Rounding",
    "ConsumedGrad",
    "HostLayout",
    "MovedGrad",
    "MovedGradError",
    "OffloadedOptimizer",
    "OptimizerOffloadConfig",
    "OptimizerStats",
    "LowPrecisionAdamW",
    "default_bucket_bytes",
    "host_bytes_per_param",
    "host_state_bytes",
    "link_bytes_per_param",
    "measure_host_step",
    "plan_layout",
]
