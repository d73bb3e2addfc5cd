"""Asynchronous, pooled activation offloading: a drop-in for ``save_on_cpu``.

::

    with torchoffload.offload_activations() as ctx:
        loss = model(x).sum()
    loss.backward()
    print(ctx.stats())

Every tensor autograd saves for backward inside the block goes through a pack hook. Eligible
ones (on the compute device, at least ``min_bytes``, not a parameter or buffer, not inside
`no_offload`) are copied into a pinned host pool on a copy stream while compute continues; the
device copy is dropped once the copy is done. In backward, each unpack reloads its tensor (or
finds it already prefetched) and issues reloads of the tensors saved just before it, so copies
overlap the backward compute. The machinery is the saved-tensor runtime (`torchoffload._saved`)
with its `BytePolicy`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from torchoffload._pool import PinnedPool
from torchoffload._saved import (
    PARAMS,
    ActivationStats,
    BytePolicy,
    SavedTensorEngine,
    Session,
    no_offload,
)
from torchoffload._validate import check_int

__all__ = ["ActivationStats", "no_offload", "offload_activations"]


class offload_activations:
    """Offload the tensors autograd saves inside this block to host memory, asynchronously.

    A drop-in for ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` that does not stall the
    GPU: copies run on side streams into a reusable pinned pool, and backward prefetches.
    Gradients are bitwise identical to running without it.

    Args:
        min_bytes: offload only tensors whose storage has at least this many bytes.
        pool: the `PinnedPool` to copy into (shareable); default: the process-wide pool.
        pin_memory: use page-locked host memory for the default pool (only where an
            accelerator exists; on a CPU-only machine copies go to ordinary memory).
        use_streams: copy on dedicated copy streams (overlapping compute). ``False`` queues
            copies on the compute stream.
        on_pool_exhausted: ``"fallback"`` (allocate outside the pool, with one warning) or
            ``"raise"`` (`PoolExhaustedError`).
        prefetch_bytes: in backward, reloads are issued ahead while fewer than this many bytes
            of them wait for their use (so the lookahead is at least one storage; device memory
            held for it is at most this plus the largest saved storage). More hides more of the
            link latency at the cost of that much device memory.
        max_inflight_bytes: in forward, how many bytes of device tensors may be held while their
            copies are in flight; past it, compute waits on the oldest copy (no host sync). What
            is still in flight when forward ends stays on the device for backward to use.
        device: the compute device; default: the current accelerator, else the CPU.

    The same object can be entered again (one block at a time); `stats()` accumulates.
    """

    def __init__(
        self,
        *,
        min_bytes: int = 1 << 16,
        pool: PinnedPool | None = None,
        pin_memory: bool = True,
        use_streams: bool = True,
        on_pool_exhausted: Literal["fallback", "raise"] = "fallback",
        prefetch_bytes: int = 32 << 20,
        max_inflight_bytes: int = 256 << 20,
        device: torch.device | str | int | None = None,
    ) -> None:
        check_int("prefetch_bytes", prefetch_bytes, minimum=0)
        check_int("max_inflight_bytes", max_inflight_bytes, minimum=0)
        self._engine = SavedTensorEngine(
            min_bytes=min_bytes,
            pool=pool,
            pin_memory=pin_memory,
            use_streams=use_streams,
            on_pool_exhausted=on_pool_exhausted,
            device=device,
        )
        self.prefetch_bytes = prefetch_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self._session: Session | None = None
        self._hooks: Any = None

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def pool(self) -> PinnedPool:
        return self._engine.pool

    @property
    def min_bytes(self) -> int:
        return self._engine.min_bytes

    @property
    def on_pool_exhausted(self) -> str:
        return self._engine.on_pool_exhausted

    def stats(self) -> ActivationStats:
        return self._engine.stats()

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def _policy(self, session: Session) -> BytePolicy:
        return BytePolicy(
            session,
            prefetch_bytes=self.prefetch_bytes,
            max_inflight_bytes=self.max_inflight_bytes,
        )

    def __enter__(self) -> offload_activations:
        if self._session is not None:
            raise RuntimeError("this offload_activations block is already active")
        session = Session(self._engine, self._policy)
        hooks = session.saved_tensors_hooks()
        hooks.__enter__()
        PARAMS.acquire()
        self._session, self._hooks = session, hooks
        return self

    def __exit__(self, *exc: object) -> None:
        session, hooks = self._session, self._hooks
        if session is None:
            raise RuntimeError("this offload_activations block was not entered")
        self._session = self._hooks = None
        try:
            hooks.__exit__(*exc)
        finally:
            PARAMS.release()
            session.end_forward()

    def __repr__(self) -> str:
        return (
            f"offload_activations(device={self.device}, min_bytes={self.min_bytes}, "
            f"pool={self.pool!r})"
        )
