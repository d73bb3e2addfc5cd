"""Reading a safetensors checkpoint straight into the weight engine's pinned host store.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": ..}``)
and the raw bytes, each tensor contiguous in C order. A sharded checkpoint adds an index
(``model.safetensors.index.json``: ``{"weight_map": {name: file}}``). Both are parsed here
without the ``safetensors`` package: the bytes are read with ``readinto`` into the host store
itself, so a checkpoint is never held twice (Note: [Reading into the host store]).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Checkpoint", "CheckpointError", "Entry", "write_safetensors"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
}  # fmt: skip
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_CHUNK = 64 << 20  # bytes per readinto call

# Note: [Reading into the host store]
# The pinned host store is allocated first (one exact-size buffer, Note: [Exact-size pinned
# buffers]); each checkpoint tensor is then read with ``readinto`` into its byte range of the
# store, files in order and tensors by file offset, so the kernel copies page-cache pages
# straight into pinned memory. No other buffer holds the checkpoint: peak host memory is the
# store plus the page cache. Everything that can be checked without reading bytes (names,
# dtypes, shapes, sizes, file lengths) is checked first, so a bad checkpoint fails before
# anything is read or any model tensor changed. One exception to reading in place: a tensor
# whose elements are one dense block in another order than C (a transposed weight, which
# keeps its strides as torch's load_state_dict does) is read into a buffer of its own size
# and its bytes copied into place, one such tensor at a time.


class CheckpointError(ValueError):
    """A checkpoint that does not match the model, or is malformed."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: where its bytes are."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute offset of its first byte in the file
    nbytes: int


class Checkpoint:
    """The catalog of a safetensors checkpoint: one file, a sharded index, or a directory
    holding either. ``entries``: name -> `Entry`."""

    def __init__(self, entries: dict[str, Entry], source: Path):
        self.entries = entries
        self.source = source

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"checkpoint must be a path, got {type(path).__name__}")
        p = Path(path)
        if p.is_dir():
            if (p / _INDEX).is_file():
                p = p / _INDEX
            elif (p / _SINGLE).is_file():
                p = p / _SINGLE
            else:
                raise CheckpointError(f"{p} holds neither {_SINGLE} nor {_INDEX}")
        if not p.is_file():
            raise CheckpointError(f"checkpoint {p} does not exist")
        entries: dict[str, Entry] = {}
        if p.name.endswith(".json"):
            try:
                weight_map = json.loads(p.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{p} is not a safetensors index ({e})") from None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise CheckpointError(f"{p}: weight_map must map tensor names to file names")
            root = p.parent.resolve()
            for file in sorted(set(weight_map.values())):
                shard_path = (p.parent / file).resolve()
                if shard_path.parent != root:
                    raise CheckpointError(f"{p} names a shard outside its directory: {file!r}")
                if not shard_path.is_file():
                    raise CheckpointError(f"{p} names a shard that does not exist: {file!r}")
                shard = _read_header(shard_path)
                for name, entry in shard.items():
                    if weight_map.get(name) == file:
                        entries[name] = entry
            missing = sorted(set(weight_map) - set(entries))
            if missing:
                raise CheckpointError(
                    f"{p} maps {len(missing)} tensors to shards that do not hold them "
                    f"(first: {missing[0]!r})"
                )
        else:
            entries = _read_header(p)
        return cls(entries, p)

    def find(self, names: list[str]) -> Entry | None:
        """The entry of the first of ``names`` (a tensor's names: tied weights have several)
        that the checkpoint holds. Where it holds several of them, they must be equal: a
        checkpoint whose copies of one tied tensor differ is refused (the model cannot hold
        both), after comparing their bytes."""
        found = [self.entries[n] for n in names if n in self.entries]
        if not found:
            return None
        first = found[0]
        for other in found[1:]:
            if (other.dtype, other.shape, other.nbytes) != (first.dtype, first.shape, first.nbytes):
                raise CheckpointError(
                    f"{self.source}: {first.name!r} and {other.name!r} are one tied tensor in "
                    f"the model but {list(first.shape)} {first.dtype} and {list(other.shape)} "
                    f"{other.dtype} in the checkpoint"
                )
            if (other.path, other.offset) != (first.path, first.offset) and not _same_bytes(
                first, other
            ):
                raise CheckpointError(
                    f"{self.source}: {first.name!r} and {other.name!r} are one tied tensor in "
                    "the model but hold different values in the checkpoint: is it this "
                    "model's checkpoint?"
                )
        return first

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def read_into(self, pieces: list[tuple[Entry, torch.Tensor]]) -> None:
        """Read each entry's bytes into its destination (a 1-D uint8 CPU tensor of exactly
        ``entry.nbytes`` bytes, contiguous): files in order, entries by offset."""
        by_file: dict[Path, list[tuple[Entry, torch.Tensor]]] = {}
        for entry, dst in pieces:
            if dst.dtype != torch.uint8 or dst.numel() != entry.nbytes or not dst.is_contiguous():
                raise AssertionError(f"bad destination for {entry.name}")
            by_file.setdefault(entry.path, []).append((entry, dst))
        for path, items in by_file.items():
            items.sort(key=lambda item: item[0].offset)
            with open(path, "rb", buffering=0) as f:
                for entry, dst in items:
                    f.seek(entry.offset)
                    _readinto(f, dst, entry)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> dict[str, Entry]:
    """Write ``tensors`` (each dense, C order once made contiguous) to a safetensors file, one
    tensor at a time (no second copy of the whole set in memory), and return the file's
    entries. Tensors on an accelerator are copied to the host one by one."""
    names = {dt: code for code, dt in _DTYPES.items()}
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in names:
            raise TypeError(f"cannot write {name!r}: safetensors has no dtype {t.dtype}")
        if t.is_meta:
            raise ValueError(f"cannot write {name!r}: it is on the meta device (no values)")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}  # fmt: skip
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    p = Path(path)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors.values():
            host = t.detach().to("cpu").contiguous()
            n = host.numel() * host.element_size()
            if n:
                f.write(memoryview((ctypes.c_char * n).from_address(host.data_ptr())).cast("B"))
    return _read_header(p)


def _same_bytes(a: Entry, b: Entry, chunk: int = 64 << 20) -> bool:
    with open(a.path, "rb") as fa, open(b.path, "rb") as fb:
        fa.seek(a.offset)
        fb.seek(b.offset)
        left = a.nbytes
        while left:
            n = min(chunk, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def _readinto(f, dst: torch.Tensor, entry: Entry) -> None:
    done, total, ptr = 0, entry.nbytes, dst.data_ptr()
    while done < total:
        n = min(_CHUNK, total - done)
        view = memoryview((ctypes.c_char * n).from_address(ptr + done)).cast("B")
        got = f.readinto(view)
        if not got:
            raise CheckpointError(f"{entry.path} ended inside {entry.name!r} (truncated file)")
        done += got


def _read_header(path: Path) -> dict[str, Entry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise CheckpointError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    base = 8 + n
    entries = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if not all(_is_count(d) for d in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: bad header entry for {name!r}: {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise CheckpointError(
                f"{path}: {name!r} is {list(shape)} {dtype} ({numel * dtype.itemsize} bytes) "
                f"but its data_offsets span {end - begin} bytes"
            )
        if base + end > size:
            raise CheckpointError(
                f"{path} is truncated: {name!r} ends at byte {base + end}, the file has {size}"
            )
        entries[name] = Entry(name, path, dtype, shape, base + begin, end - begin)
        spans.append((begin, end, name))
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise CheckpointError(f"{path}: the bytes of {a!r} and {b!r} overlap")
    return entries


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
