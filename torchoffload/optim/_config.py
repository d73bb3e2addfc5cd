"""How an `OffloadedOptimizer` runs (`OptimizerOffloadConfig`) and what it did
(`OptimizerStats`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchoffload._validate import check_bool, check_int, check_number


@dataclass(frozen=True)
class OptimizerOffloadConfig:
    """How an `OffloadedOptimizer` runs.

    - ``bucket_bytes``: parameter bytes per bucket, the unit whose gradients leave the device
      together and whose step is one call of the optimizer class (smaller: more overlap, more
      host overhead per step). ``None``: `default_bucket_bytes` of the parameters' bytes
      (about 50 buckets, 32 to 256 MiB each).
    - ``max_grad_norm``: clip the gradients to this global norm before the step (like
      ``torch.nn.utils.clip_grad_norm_``, computed on the host in fp32, summed in the order of
      ``model.parameters()`` when the optimizer is given ``model``, else in the order the
      parameters were given: Note: [The order of the clipping norm]). The step then starts
      only once every gradient has arrived; the copies still overlap backward. ``None``: no
      clipping; ``float("inf")``: the norm only (``grad_norm``), no gradient scaled, as
      ``clip_grad_norm_(params, inf)`` (steps are still taken during backward). Clip here
      rather than with ``clip_grad_norm_`` on the model: reading a gradient that left the
      device brings its bucket back (exact, without the overlap); under Hugging Face
      ``Trainer``, `torchoffload.integrations.hf.offload_trainer` routes its clipping here.
    - ``norm_type``: the norm's p (``float('inf')`` for the max norm).
    - ``overlap``: step each bucket on the host as soon as its gradients arrive, while backward
      goes on. ``False``: step everything when `step()` is called (the gradients still leave
      the device during backward).
    - ``pin_memory``: page-lock the host buffers (the copies are asynchronous only then).
    - ``use_streams``: copy on side streams; ``False`` queues the copies on the compute stream.
    - ``host_threads``: intra-op threads of the host step (set on the worker thread, see Note:
      [Host threads]). ``None``: the process's setting.
    - ``convert_on``: where a parameter that is not fp32 is converted to and from the fp32 the
      optimizer steps (Note: [Where the conversions run]). ``"device"``: its gradient crosses
      the link in fp32 and its new value comes back in fp32, each converted on the device by
      the copy; the host does no conversion and holds no staging buffer. ``"host"``: the
      parameter's own dtype crosses the link (half the bytes for bf16) and the host converts
      (12 bytes of host memory traffic per bf16 element). Choose ``"host"`` when the link,
      not the host, binds.
    - ``offload_fraction``: the share of the trainable parameter bytes whose optimizer step,
      state and fp32 masters go to the host (those whose gradients backward finishes first);
      the rest stay on the device and are stepped there at `step()` (Note: [Which parameters
      stay on the device]). ``1.0``: all of them. Below 1, not supported yet: DTensor
      parameters, parameters streamed by `stream_parameters`, ``max_grad_norm``. The default
      ``bucket_bytes`` is then computed from the host part alone.
    - ``step_ahead``: `step()` returns once every bucket is queued, and the host step goes on
      while the next forward runs: inside ``model``'s forward (given to `OffloadedOptimizer`),
      the first op that reads a parameter still being stepped waits for it (Note: [Stepping
      ahead]). Parameters must not be read outside that forward before the next `step()`,
      `synchronize()` or any other call of the optimizer, which all finish the step.
    - ``master_dtype``: the dtype of the host master of a bfloat16 parameter.
      ``torch.float32`` (the default): an fp32 master, rounded to the parameter after each
      step. ``torch.bfloat16``: the parameter's own bits are its master (2 bytes a parameter
      on the host instead of 4, its host gradient too, and bf16 crosses the link both ways
      with no conversion anywhere); the optimizer class then steps bf16 tensors, so it must
      keep the updates that bf16 rounding would lose, and say so with a class attribute
      ``supports_bf16_master = True`` (`LowPrecisionAdamW`, `AdamW8bit`: stochastic rounding
      or a compensation term, Note: [Updating a bf16 parameter]). float32 parameters keep
      their fp32 masters; float16 parameters are refused. Not supported yet with
      ``offload_fraction`` < 1, nor with ``max_grad_norm`` over parameters of several dtypes.
    """

    bucket_bytes: int | None = None
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    overlap: bool = True
    pin_memory: bool = True
    use_streams: bool = True
    host_threads: int | None = None
    step_ahead: bool = False
    convert_on: str = "device"
    offload_fraction: float = 1.0
    master_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.master_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"master_dtype must be torch.float32 or torch.bfloat16, got {self.master_dtype!r}"
            )
        check_number("offload_fraction", self.offload_fraction, maximum=1.0)
        if self.convert_on not in ("device", "host"):
            raise ValueError(f"convert_on must be 'device' or 'host', got {self.convert_on!r}")
        if self.host_threads is not None:
            check_int("host_threads", self.host_threads, minimum=1)
        if self.bucket_bytes is not None:
            check_int("bucket_bytes", self.bucket_bytes, minimum=1)
        if self.max_grad_norm is not None and self.max_grad_norm != float("inf"):
            check_number("max_grad_norm", self.max_grad_norm)
        if self.norm_type != float("inf"):
            check_number("norm_type", self.norm_type, positive=True)
        for name in ("overlap", "pin_memory", "use_streams", "step_ahead"):
            check_bool(name, getattr(self, name))


@dataclass(frozen=True)
class OptimizerStats:
    """What an `OffloadedOptimizer` did. Times are of the last `step()`; bytes are totals.

    ``host_step_ms``: worker time converting gradients (with ``convert_on="host"``), clipping
    and stepping (the host work). ``host_step_ms_after_call``: the part of it that ran after
    `step()` was called, i.e. was not hidden behind backward. ``step_wait_ms``: how long
    `step()` blocked its caller. ``overlap``: the fraction of ``host_step_ms`` hidden behind
    backward. ``device_params``/``device_state_bytes``:
    trainable parameters stepped on the device (``offload_fraction`` < 1) and the device bytes
    of their fp32 masters and optimizer state. ``recalled``: buckets whose gradients were
    brought back to the device (a read of a moved gradient, a second backward), in total:
    each such bucket loses its overlap."""

    steps: int
    buckets: int
    pinned_bytes: int
    state_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    host_step_ms: float
    host_step_ms_after_call: float
    step_wait_ms: float
    overlap: float
    grad_norm: float | None
    device_params: int = 0
    device_state_bytes: int = 0
    recalled: int = 0
