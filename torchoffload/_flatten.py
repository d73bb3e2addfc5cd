"""How a tensor maps onto the bytes of its storage, and how to rebuild it from a copy.

A saved tensor is often a view (a transpose, a slice of a fused QKV projection). torchoffload
copies the whole storage once, however many views of it were saved, and rebuilds each view with
its exact dtype, size, stride and storage offset, so kernels see the same layout (and give the
same bits) as without offloading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ViewMeta", "storage_bytes"]


@dataclass(frozen=True, slots=True)
class ViewMeta:
    """The geometry of a strided tensor over its storage."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    conj: bool
    neg: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> ViewMeta:
        return cls(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.is_conj(), t.is_neg())

    def rebuild(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """A tensor with this geometry over ``storage`` (a copy of the original's storage)."""
        out = torch.empty(0, dtype=self.dtype, device=storage.device)
        out.set_(storage, self.offset, self.size, self.stride)
        if self.conj:
            out = out.conj()
        if self.neg:
            out = torch._neg_view(out)
        return out

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.size)}"


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over all bytes of ``t``'s storage (no copy)."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))
