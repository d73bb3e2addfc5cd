"""The host store of `stream_parameters` and the device storage of each of its pieces: a piece
(a source storage, stored once however many parameters view it) is loaded into its device
storage for a unit's forward or backward and dropped after, and its host bytes are what a host
optimizer steps and what the placeholders read and write.

Note: [Training parameters keep their storage]
Autograd saves what backward needs when forward runs, and for a weight that is often a view of
it (``F.linear`` saves ``weight.t()``), which holds the weight's storage object, not the
parameter. Rebinding the parameter to other memory before backward (as inference does with its
arena) would leave that view on the old bytes. So each host piece (a source storage, stored
once however many parameters view it) has one device storage object for the whole session:
loading resizes it to its bytes (allocated by the caching allocator on the compute stream) and
copies into it; dropping resizes it to 0 bytes. Every view autograd saved shares that storage
object and reads the bytes loaded again before backward. The parameters themselves are set to
their full geometry while loaded and to 0 elements otherwise (so stray reads fail with a shape
error), with their version counters preserved (the bytes are the same values).

Note: [Streams of a training load]
A load allocates on the compute stream, records an event there, and copies on the copy stream
after it (protocol rule 3); every use makes the compute stream wait on the copy's "ready"
event. A drop first makes the compute stream wait on that event too (a prefetch never used
must not be overwritten by a later allocation on the compute stream while its copy runs), then
frees: the caching allocator reuses the bytes only for work queued later on the compute
stream, after every kernel that read them.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchoffload import _hosted
from torchoffload._hosted import HOSTED, MANAGED, Hosted
from torchoffload._pool import pinned_buffer
from torchoffload._transfer import copy_engine
from torchoffload.weights import _layout
from torchoffload.weights._binding import STREAMED

if TYPE_CHECKING:
    from torchoffload.weights._runtime import StreamConfig


class Piece:
    __slots__ = ("key", "nbytes", "storage", "host", "leaves", "holders", "ready", "last_copy",
                 "stale")  # fmt: skip

    def __init__(self, key: Any, nbytes: int, storage: torch.UntypedStorage, host: torch.Tensor):
        self.key = key
        self.nbytes = nbytes
        self.storage = storage  # Note: [Training parameters keep their storage]
        self.host = host  # uint8 view of the host store
        self.leaves: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]] = []
        self.holders: set[int] = set()  # units using it or prefetched into it
        self.ready: Any = None  # event after its last copy (None: not loaded, or on the CPU)
        self.last_copy: Any = None  # the same event, kept after a drop (Hosted.before_write)
        self.stale = False  # the host bytes changed since the load

    @property
    def loaded(self) -> bool:
        return self.storage.nbytes() > 0


class PieceStore:
    """The pinned host store of one `stream_parameters` model, its pieces and their device
    storages, under the runtime's ``lock``. Setup moves the parameters' values into it and
    makes each streamed parameter a placeholder of it (Note: [Placeholders never answer]),
    registered as ``owner``'s."""

    def __init__(self, layout: _layout.Layout, config: StreamConfig, lock: threading.RLock,
                 owner: Any):  # fmt: skip
        self.config = config
        self.device = config.device
        self.layout = layout
        self.lock = lock
        self.engine = copy_engine(config.device, use_streams=config.use_streams)
        pin = config.pin_memory and config.device.type != "cpu" and torch.cuda.is_available()
        self.host = pinned_buffer(layout.host_bytes, pin=pin)
        self.removed = False
        # - Host store and one device storage per piece
        self.pieces: dict[Any, Piece] = {}
        by_key: dict[Any, list[_layout.Leaf]] = {}
        for leaf in layout.leaves:
            by_key.setdefault(leaf.key, []).append(leaf)
        for key, (lo, hi, off) in layout.pieces.items():
            src = by_key[key][0].source
            raw = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src.untyped_storage())
            host = self.host[off : off + hi - lo]
            host.copy_(raw[lo:hi])
            storage = torch.empty(0, dtype=torch.uint8, device=self.device).untyped_storage()
            piece = Piece(key, hi - lo, storage, host)
            for leaf in by_key[key]:
                piece.leaves.append((leaf.source, (leaf.start - lo) // leaf.source.element_size(),
                                     leaf.size, leaf.stride))  # fmt: skip
            self.pieces[key] = piece
        names = {id(leaf.source): leaf.name for leaf in layout.leaves}
        # - The parameters now hold the (empty) device storages; the originals are released
        for piece in self.pieces.values():
            bind(piece, full=False)
        self.hosted: list[tuple[torch.Tensor, Hosted]] = []
        for key, piece in self.pieces.items():
            lo, _, off = layout.pieces[key]
            for leaf in by_key[key]:
                v = torch.empty(0, dtype=leaf.dtype)
                v.set_(self.host.untyped_storage(), (off + leaf.start - lo) // v.element_size(),
                       leaf.size, leaf.stride)  # fmt: skip
                hosted = Hosted(v, _before_write(self, piece))
                HOSTED[leaf.source] = hosted
                self.hosted.append((leaf.source, hosted))
            for t, offset, size, stride in piece.leaves:
                STREAMED[t] = owner
                # See Note: [Placeholders never answer]
                _hosted.register(t, _hosted.Ref(self, key, offset, size, stride, t.dtype,
                                                names[id(t)], nn.Parameter))  # fmt: skip
        # - Counters
        self.loaded_bytes = 0
        self.loads = self.prefetched = self.on_demand = self.over_budget = 0
        self.h2d_bytes = self.peak_loaded_bytes = 0

    # -- loading and dropping (Note: [Streams of a training load]) ----------------------------

    def load(self, piece: Piece, ahead: bool) -> None:
        if piece.loaded and not piece.stale:
            return
        if not piece.loaded:
            piece.storage.resize_(piece.nbytes)  # on the compute stream
            self.loaded_bytes += piece.nbytes
            if not ahead and self.loaded_bytes > self.config.budget_bytes:
                self.over_budget += 1
            self.peak_loaded_bytes = max(self.peak_loaded_bytes, self.loaded_bytes)
        piece.stale = False
        dst = torch.empty(0, dtype=torch.uint8, device=self.device).set_(piece.storage)
        piece.ready = piece.last_copy = self.engine.load(
            [(dst, piece.host)], after=[self.engine.record()]
        )
        self.loads += 1
        self.h2d_bytes += piece.nbytes
        if ahead:
            self.prefetched += 1
        else:
            self.on_demand += 1

    def drop(self, piece: Piece) -> None:
        if not piece.loaded:
            return
        self.engine.wait(piece.ready)
        piece.ready = None
        bind(piece, full=False)
        piece.storage.resize_(0)
        self.loaded_bytes -= piece.nbytes

    def hold(self, index: int, pieces: list[Piece]) -> None:
        """Load unit ``index``'s ``pieces`` (or find them loaded), bind them (a prefetched
        piece stays a placeholder until then) and make the compute stream wait for them."""
        for piece in pieces:
            self.load(piece, ahead=False)
            piece.holders.add(index)
            bind(piece, full=True)
        for piece in pieces:
            self.engine.wait(piece.ready)

    def release(self, index: int, pieces: list[Piece]) -> None:
        """Unit ``index`` no longer needs ``pieces``: those no other unit holds are dropped."""
        for piece in pieces:
            piece.holders.discard(index)
            if not piece.holders:
                self.drop(piece)

    def unbind_all(self) -> bool:
        """Every piece unbound (its parameters placeholders) and held by no unit, its device
        bytes kept (Note: [A backward that raised]); whether one is still loaded."""
        loaded = False
        for piece in self.pieces.values():
            piece.holders.clear()
            if piece.loaded:
                bind(piece, full=False)
                loaded = True
        return loaded

    def drop_all(self) -> None:
        for piece in self.pieces.values():
            piece.holders.clear()
            self.drop(piece)

    def before_write(self, piece: Piece) -> None:
        """Hosted.before_write: the host bytes of ``piece`` are about to change."""
        with self.lock:
            piece.stale = piece.loaded  # a device copy made before the write is old
            event = piece.last_copy
        if event is not None:
            event.synchronize()  # on the optimizer's worker, not the training thread

    # -- the host store of placeholders (Note: [Placeholders never answer]) ------------------

    def read_piece(self, key: Any) -> torch.Tensor:
        """_hosted.HostStore: the piece's current bytes on the device (a host step still
        running for one of its parameters is finished first)."""
        with self.lock:
            piece = self._piece(key)
            _settle(piece)
            if self.device.type == "cpu":
                return piece.host.clone()
            out = torch.empty(piece.nbytes, dtype=torch.uint8, device=self.device)
            out.copy_(piece.host)  # on the compute stream, synchronous for the host
            return out

    def write_piece(self, key: Any, data: torch.Tensor, written: list[tuple[int, int]]) -> None:
        """_hosted.HostStore: write the piece's bytes into the host store. A device copy made
        before is stale (loaded again at its next use); a host optimizer reads again the
        masters of the parameters whose bytes were written (``Hosted.version``): a parameter
        that only shares the storage keeps its fp32 master, as in a loop over fp32 masters
        that reads again the master of the parameter it wrote (a bf16 view's master read
        again from its rounded value after an edit of its sibling loses its low bits)."""
        with self.lock:
            piece = self._piece(key)
            _settle(piece)
            self.before_write(piece)
            with torch.no_grad():
                piece.host.copy_(data)
            for t, offset, size, stride in piece.leaves:
                item = t.element_size()
                extent = 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
                lo, hi = offset * item, (offset + extent) * item
                if any(a < hi and lo < b for a, b in written):
                    HOSTED[t].version += 1

    def _piece(self, key: Any) -> Piece:
        if self.removed:
            raise _hosted.HostedError(
                "this streamed parameter's ParameterStreamHandle was removed: the tensor is a "
                "leftover view of it; take it from the model again"
            )
        return self.pieces[key]

    # -- remove ------------------------------------------------------------------------------

    def restore(self) -> None:
        """Every parameter back on the device with its current values; the host store freed.
        Holds the lock."""
        for piece in self.pieces.values():
            piece.holders.clear()
            self.load(piece, ahead=False)
            self.engine.wait(piece.ready)
        for piece in self.pieces.values():
            bind(piece, full=True)
        for t, _ in self.hosted:
            HOSTED.pop(t, None)
            STREAMED.pop(t, None)
            _hosted.unregister(t)
        self.removed = True
        self.pieces = {}
        self.host = None  # type: ignore[assignment]


def bind(piece: Piece, full: bool) -> None:
    """Point the piece's parameters at its device storage: their full geometry, or 0 elements.

    Note: [Binding through .data] ``param.data = view`` shares the view's storage object and
    keeps the parameter's version counter and its gradient accumulator (same dtype and
    device). ``set_`` would make a new accumulator at every load, so a parameter used in two
    units (tied weights) or by a unit called twice would have its gradient accumulated, and
    its post-accumulate-grad hooks run, once per load: an optimizer would step a partial
    gradient."""
    for t, offset, size, stride in piece.leaves:
        _hosted.bound(t)  # a plain parameter while bound (Note: [Placeholders never answer])
        v = torch.empty(0, dtype=t.dtype, device=piece.storage.device)
        if full:
            v.set_(piece.storage, offset, size, stride)
        else:
            v.set_(piece.storage, 0, (0,), (1,))
        t.data = v
        if not full:
            _hosted.unbound(t)


def _settle(piece: Piece) -> None:
    """Finish a host step still running for a parameter of ``piece`` (its host values are
    about to be read or written)."""
    for t, _, _, _ in piece.leaves:
        rt = MANAGED.get(t)
        if rt is not None:
            rt.settle()


def _before_write(store: PieceStore, piece: Piece) -> Any:
    ref = weakref.ref(store)

    def before_write() -> None:
        s = ref()
        if s is not None:
            s.before_write(piece)

    return before_write
