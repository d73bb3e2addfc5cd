"""The host step's rate on this machine: parameters a second of one step of an optimizer class
over host tensors, as the host worker of an `OffloadedOptimizer` runs it. The planner takes it
as ``Hardware.host_adam_params_per_s``; the host state's bytes come from
`host_bytes_per_param`."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from torchoffload._validate import check_int


def measure_host_step(
    optimizer_class: type = torch.optim.AdamW,
    *,
    master_dtype: torch.dtype = torch.float32,
    numel: int = 1 << 24,
    tensors: int = 4,
    steps: int = 3,
    threads: int | None = None,
    **kwargs: Any,
) -> float:
    """Parameters a second that one step of ``optimizer_class(params, **kwargs)`` takes on this
    machine's CPU over ``numel`` parameters in ``tensors`` equal host tensors of
    ``master_dtype`` (the host masters: fp32, or bf16 ones with ``master_dtype=torch.bfloat16``
    and a class that steps them, such as `AdamW8bit`), gradients of that dtype: the median of
    ``steps`` steps after one that builds the state, on a thread of its own with ``threads``
    intra-op threads (default: this process's), as the host worker runs it. Pass the class's
    options as an `OffloadedOptimizer` would get them (``fused=True`` for torch's AdamW).

    For the planner: ``dataclasses.replace(Hardware.detect(),
    host_adam_params_per_s=measure_host_step(...))``, with ``host_bytes_per_param`` for the
    bytes. About 0.1-2 s at the default size on a 16-core host; the memory it takes is
    ``numel`` times the state's bytes a parameter, once."""
    check_int("numel", numel, minimum=1)
    check_int("tensors", tensors, minimum=1)
    check_int("steps", steps, minimum=1)
    if threads is not None:
        check_int("threads", threads, minimum=1)
    if tensors > numel:
        raise ValueError(f"tensors ({tensors}) must be at most numel ({numel})")
    if master_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"master_dtype must be torch.float32 or bfloat16, got {master_dtype}")
    if master_dtype == torch.bfloat16 and not getattr(optimizer_class, "supports_bf16_master",
                                                      False):  # fmt: skip
        raise ValueError(
            f"{optimizer_class.__name__} does not step bf16 masters (an OffloadedOptimizer "
            "refuses it with master_dtype=torch.bfloat16): use AdamW8bit or LowPrecisionAdamW"
        )
    g = torch.Generator().manual_seed(0)
    sizes = [numel // tensors + (k < numel % tensors) for k in range(tensors)]
    params = [(torch.randn(n, generator=g) * 0.02).to(master_dtype).requires_grad_()
              for n in sizes]  # fmt: skip
    for p in params:
        p.grad = (torch.randn(p.numel(), generator=g) * 1e-3).to(master_dtype)
    opt = optimizer_class(params, **kwargs)
    times: list[float] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            if threads is not None:
                torch.set_num_threads(threads)  # this thread's, as the host worker sets it
            opt.step()  # the state
            for _ in range(steps):
                start = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - start)
        except BaseException as e:  # raised again on the caller's thread
            failed.append(e)

    worker = threading.Thread(target=run, name="torchoffload-measure-host-step")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return numel / sorted(times)[len(times) // 2]
