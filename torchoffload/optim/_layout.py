"""Where an offloaded optimizer keeps each parameter's host copies, and how parameters are cut
into buckets: pure functions of the parameters' shapes and dtypes.

Per parameter the host holds, in exact-size buffers allocated once:
- ``master``: the fp32 values the optimizer steps (also the source of the upload, which the
  copy converts on the device: Note: [Copies that convert] in _transfer.py); with
  ``master_dtype=torch.bfloat16``, a bf16 parameter's master is bf16, its own bits;
- ``grad``: the gradient the optimizer reads, of the master's dtype (the target of the
  download, converted on the device when the parameter's dtype differs);
- ``staging``: only with conversions on the host (``staging=True``), for a parameter that is
  not fp32, a buffer of its own dtype that first receives its gradient from the device and
  then, after the step, its new value for the device.
The optimizer's own state (AdamW: two fp32 moments) is allocated by the optimizer class on the
host and is not counted here; `host_state_bytes` estimates it from ``state_floats``.

A bucket is a run of consecutive parameters, in reverse order (the order in which backward
usually finishes their gradients), of about ``bucket_bytes`` parameter bytes: its gradients
leave the device together and its step runs as one call of the optimizer class. Parameters
that are views of one storage go into one bucket, that of the last of them (Note:
[Parameters that share a storage] in _params.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 64  # bytes: every host tensor starts on a cache line


@dataclass(frozen=True)
class Entry:
    """One parameter's place: ``index`` in the optimizer's parameter order, its ``bucket``,
    byte offsets into the master, grad and staging buffers (staging -1: none), and the dtype
    of its master and gradient."""

    index: int
    bucket: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    master: int
    grad: int
    staging: int
    master_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class HostLayout:
    entries: tuple[Entry, ...]  # in parameter order
    buckets: tuple[tuple[int, ...], ...]  # parameter indices per bucket, in bucket order
    master_bytes: int
    grad_bytes: int
    staging_bytes: int

    @property
    def pinned_bytes(self) -> int:
        return self.master_bytes + self.grad_bytes + self.staging_bytes


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def default_bucket_bytes(param_bytes: int) -> int:
    """The bucket size `OffloadedOptimizer` uses by default for parameters of ``param_bytes``
    bytes in all: about 50 buckets, between 32 and 256 MiB each. Each bucket costs the worker a
    call of the optimizer class and its Python (which waits for the GIL while backward's
    hooks and recomputation hold it, a likely cause not measured); each bucket more is overlap
    gained. Measured for a Llama-3.2-3B shape (runs I and J in
    benchmarks/log/2026-11-23-optimizer-on-host.md): on one H100 machine 128 MiB buckets took
    a step from 1617 to 1256 ms (32 MiB before), on another all sizes from 32 to 128 MiB were
    within 5%."""
    return min(max(param_bytes // 50, 32 << 20), 256 << 20)


def plan_layout(
    shapes: list[tuple[tuple[int, ...], torch.dtype]],
    bucket_bytes: int,
    staging: bool = False,
    *,
    families: list[int] | None = None,
    master_dtype: torch.dtype = torch.float32,
) -> HostLayout:
    """The host layout of parameters given as ``(shape, dtype)`` in the optimizer's order;
    ``staging``: a staging buffer for each parameter whose dtype is not its master's (host
    conversions); ``families``: for each parameter, a key shared by the parameters that must
    be in one bucket (views of one storage), placed with the last of them; ``master_dtype``:
    the master of a parameter of that dtype is of it (bf16), every other master fp32."""
    sizes = [(torch.Size(s).numel(), dtype) for s, dtype in shapes]
    family: dict[int, list[int]] = {}
    for i, key in enumerate(range(len(sizes)) if families is None else families):
        family.setdefault(key, []).append(i)
    buckets: list[list[int]] = []
    filled = 0
    placed: set[int] = set()
    for i in reversed(range(len(sizes))):
        if i in placed:
            continue
        together = family[i if families is None else families[i]]
        nbytes = sum(sizes[j][0] * sizes[j][1].itemsize for j in together)
        if not buckets or (filled and filled + nbytes > bucket_bytes):
            buckets.append([])
            filled = 0
        buckets[-1].extend(sorted(together, reverse=True))
        placed.update(together)
        filled += nbytes
    bucket_of = {i: b for b, members in enumerate(buckets) for i in members}
    entries = []
    master = grad = staged = 0
    for i, ((shape, dtype), (numel, _)) in enumerate(zip(shapes, sizes, strict=True)):
        own = dtype if dtype == master_dtype else torch.float32
        stage = -1
        if staging and dtype != own:
            stage = staged
            staged = _round_up(staged + numel * dtype.itemsize, _ALIGN)
        entries.append(Entry(i, bucket_of[i], tuple(shape), dtype, numel, master, grad, stage, own))
        master = _round_up(master + numel * own.itemsize, _ALIGN)
        grad = _round_up(grad + numel * own.itemsize, _ALIGN)
    return HostLayout(tuple(entries), tuple(tuple(b) for b in buckets), master, grad, staged)


def host_state_bytes(
    numel: int, nbytes: int, state_floats: int = 2, convert_on: str = "device"
) -> int:
    """Host bytes for ``numel`` parameter elements of ``nbytes`` bytes (without a layout's
    alignment): fp32 master and gradient, staging with ``convert_on="host"`` unless fp32, and
    ``state_floats`` fp32 values of optimizer state per element."""
    staging = nbytes if convert_on == "host" and nbytes != 4 * numel else 0
    return numel * 4 * (2 + state_floats) + staging


def host_bytes_per_param(
    param_dtype: torch.dtype = torch.bfloat16,
    *,
    master_dtype: torch.dtype = torch.float32,
    state_bits: int = 32,
    bf16_rounding: str = "stochastic",
    state_tensors: int = 2,
    convert_on: str = "device",
    overlap: bool = True,
) -> float:
    """Host bytes an `OffloadedOptimizer` spends per trainable element of a parameter of
    ``param_dtype``: its master and gradient (fp32; with ``master_dtype=torch.bfloat16`` a
    bf16 parameter's are bf16), a staging copy with ``convert_on="host"`` when the parameter's
    dtype is not its master's, and ``state_tensors`` moments (AdamW: 2) of ``state_bits`` (32:
    4 bytes; 8: 1 + 4/256, `AdamW8bit`: Note: [8-bit optimizer state]), plus the compensation
    term of a bf16 master with ``bf16_rounding="kahan"``. With ``overlap`` (the optimizer's
    default) a bucket stepped during backward also keeps a copy of its master and state, to
    undo that step if the loop asks for another (Note: [Steps taken during backward]): counted
    here for every parameter, the most it takes. For large tensors: a tensor below 4096
    elements keeps fp32 moments, and each host tensor is aligned to 64 bytes.

    The planner takes it (``plan(..., host_bytes_per_param=...)``). For bf16 parameters with
    AdamW, without ``overlap`` (with it): 16 bytes (28) with fp32 masters and moments, 10.03
    (16.06) with 8-bit moments, 12 (22) with bf16 masters (stochastic rounding) and fp32
    moments, 6.03 (10.06) with bf16 masters and 8-bit moments, 8.03 (14.06) with a Kahan term
    besides."""
    from torchoffload.optim._adamw import Bf16Rounding

    if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"param_dtype must be float32, bfloat16 or float16, got {param_dtype}")
    if master_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"master_dtype must be torch.float32 or bfloat16, got {master_dtype}")
    if state_bits not in (8, 32) or isinstance(state_bits, bool):
        raise ValueError(f"state_bits must be 8 or 32, got {state_bits!r}")
    if convert_on not in ("device", "host"):
        raise ValueError(f"convert_on must be 'device' or 'host', got {convert_on!r}")
    rounding = Bf16Rounding.parse(bf16_rounding)
    own = param_dtype if param_dtype == master_dtype else torch.float32
    staging = param_dtype.itemsize if convert_on == "host" and param_dtype != own else 0
    compensation = 2 if own == torch.bfloat16 and rounding is Bf16Rounding.KAHAN else 0
    moment = 4.0 if state_bits == 32 else 1 + 4 / 256
    master_and_state = own.itemsize + compensation + state_tensors * moment
    aside = master_and_state if overlap else 0
    return master_and_state + own.itemsize + staging + aside


def link_bytes_per_param(
    param_dtype: torch.dtype = torch.bfloat16,
    *,
    master_dtype: torch.dtype = torch.float32,
    convert_on: str = "device",
) -> int:
    """Bytes an `OffloadedOptimizer` moves over the link per trainable element of a parameter
    of ``param_dtype``, in each direction (its gradient down, its new value up): the master's
    dtype where the copies convert on the device (the default, Note: [Where the conversions
    run]: a bf16 parameter with an fp32 master crosses as 4 bytes each way), the parameter's
    own with ``convert_on="host"``, and 2 for a bf16 parameter with a bf16 master
    (``master_dtype=torch.bfloat16``). The planner takes it (``plan(...,
    link_bytes_per_param=...)``)."""
    if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"param_dtype must be float32, bfloat16 or float16, got {param_dtype}")
    if master_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"master_dtype must be torch.float32 or bfloat16, got {master_dtype}")
    if convert_on not in ("device", "host"):
        raise ValueError(f"convert_on must be 'device' or 'host', got {convert_on!r}")
    own = param_dtype if param_dtype == master_dtype else torch.float32
    return (param_dtype if convert_on == "host" else own).itemsize
