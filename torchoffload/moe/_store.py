"""The host store of the experts: every expert tensor's bytes, as the model had them, in one
exact-size (pinned) host buffer per layer, and the placeholders that stand for those tensors
in the model while they stream (the `_hosted.HostStore` protocol: See Note: [Placeholders
never answer] in _hosted.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchoffload import _hosted
from torchoffload._pool import pinned_buffer
from torchoffload.moe._layout import ExpertLayout

__all__ = ["ExpertStore"]


class ExpertStore:
    """Built from a layout: copies each expert tensor into the host buffers and makes it a
    placeholder on ``device``. ``on_write(layer, experts)`` is called, under the runtime's
    lock, before a write of the store changes those experts' bytes; it raises
    `_hosted.HostedError` to refuse the write."""

    def __init__(
        self,
        layout: ExpertLayout,
        device: torch.device,
        pin: bool,
        lock: Any,
        on_write: Callable[[int, range], None],
    ):
        self.layout = layout
        self.device = device
        self._lock = lock
        self._on_write = on_write
        self.removed = False
        self.pinned = pin
        self.hosts = [pinned_buffer(layer.host_bytes, pin=pin) for layer in layout.layers]
        self.sources: dict[tuple[int, int, int, int], torch.Tensor] = {}  # `source`'s
        with torch.inference_mode(False), torch.no_grad():
            for host, layer in zip(self.hosts, layout.layers, strict=True):
                for p in layer.pieces:
                    src = p.tensor.detach().reshape(-1).view(torch.uint8)
                    host[p.host_offset : p.host_offset + p.nbytes].copy_(src)
            for li, layer in enumerate(layout.layers):
                for pi, p in enumerate(layer.pieces):
                    t = p.tensor
                    ref = _hosted.Ref(self, (li, pi), 0, p.size, p.stride, p.dtype, p.name, type(t))
                    t.data = torch.empty(0, dtype=p.dtype, device=device)  # frees the original
                    _hosted.register(t, ref)

    def source(self, layer: int, piece: int, offset: int, nbytes: int) -> torch.Tensor:
        """Host bytes [offset, offset + nbytes) of a piece (uint8)."""
        start = self.layout.layers[layer].pieces[piece].host_offset + offset
        return self.hosts[layer][start : start + nbytes]

    def expert_source(self, layer: int, piece: int, offset: int, nbytes: int) -> torch.Tensor:
        """`source` of one expert's member, made once and kept (the source of a copy at every
        miss of the expert; made outside inference mode, as it is read in and out of it)."""
        key = (layer, piece, offset, nbytes)
        t = self.sources.get(key)
        if t is None:
            with torch.inference_mode(False):
                t = self.sources[key] = self.source(layer, piece, offset, nbytes)
        return t

    def host_value(self, layer: int, piece: int) -> torch.Tensor:
        """A host copy of a piece's tensor (for state_dict)."""
        p = self.layout.layers[layer].pieces[piece]
        data = self.source(layer, piece, 0, p.nbytes).clone()
        return _typed(data, p)

    # -- _hosted.HostStore --------------------------------------------------------------------

    def read_piece(self, key: Any) -> torch.Tensor:
        """The piece's bytes on the compute device (the host store changes only under the
        runtime's lock, between blocks)."""
        with self._lock:
            self._check_live()
            li, pi = key
            data = self.source(li, pi, 0, self.layout.layers[li].pieces[pi].nbytes)
            if self.device.type == "cpu":
                return data.clone()
            out = torch.empty(data.numel(), dtype=torch.uint8, device=self.device)
            out.copy_(data)
            return out

    def write_piece(self, key: Any, data: torch.Tensor, written: list[tuple[int, int]]) -> None:
        with self._lock:
            self._check_live()
            li, pi = key
            layer = self.layout.layers[li]
            touched: set[int] = set()
            for lo, hi in written:
                touched.update(layer.experts_of_piece(pi, lo, hi))
            experts = range(0) if not touched else range(min(touched), max(touched) + 1)
            self._on_write(li, experts)  # may refuse; waits for copies that read the bytes
            n = layer.pieces[pi].nbytes
            with torch.no_grad():
                self.source(li, pi, 0, n).copy_(data)

    def fill_piece(self, key: Any, read: Callable[[torch.Tensor], None]) -> None:
        """``read`` writes a piece's bytes in place (a checkpoint's entry: see `_hosted.fill`),
        after every copy that read them and with their experts forgotten by the cache, as
        before a write back."""
        with self._lock:
            self._check_live()
            li, pi = key
            n = self.layout.layers[li].pieces[pi].nbytes
            self._on_write(li, self.layout.layers[li].experts_of_piece(pi, 0, n))
            read(self.source(li, pi, 0, n))

    def _check_live(self) -> None:
        if self.removed:
            raise _hosted.HostedError(
                "this expert tensor's ExpertStreamHandle was removed: the tensor is a leftover "
                "view of it; take it from the model again"
            )

    # -- remove ---------------------------------------------------------------------------------

    def restore(self) -> None:
        """Every expert tensor back on its device with its values (identity kept)."""
        with torch.inference_mode(False), torch.no_grad():
            for li, layer in enumerate(self.layout.layers):
                for pi, p in enumerate(layer.pieces):
                    t = p.tensor
                    _hosted.unregister(t)
                    data = self.source(li, pi, 0, p.nbytes)
                    copy = data.clone() if p.device.type == "cpu" else data.to(p.device)
                    t.data = torch.empty(0, dtype=t.dtype, device=p.device)
                    t.set_(copy.untyped_storage(), 0, p.size, p.stride)
        self.removed = True
        self.hosts = []
        self.sources = {}


def _typed(data: torch.Tensor, p: Any) -> torch.Tensor:
    out = torch.empty(0, dtype=p.dtype)
    return out.set_(data.untyped_storage(), 0, p.size, p.stride)
