"""The copy kernel of routed experts in a CUDA graph (Note: [Routed experts in a CUDA graph] in
_graphed.py): a Triton kernel that copies each routed expert's members from addresses it reads
on the device (the host store through its mapped address, or a cache slot) into the stage, and
a miss into its cache slot too. Imported only on CUDA."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["copy_routed"]

_BLOCK = 4096  # 32-bit words a program copies (16 KiB)


@triton.jit
def _copy_routed(src_ptr, stage_ptr, copy_ptr, dst_ptr, write_ptr, words_ptr, M, CHUNKS,
                 BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)  # place r, member m: i = r * M + m
    c = tl.program_id(1)
    r = i // M
    if tl.load(copy_ptr + r) != 0:
        n = tl.load(words_ptr + i % M)
        src = tl.multiple_of(tl.load(src_ptr + i).to(tl.pointer_type(tl.int32)), 16)
        stage = tl.multiple_of(tl.load(stage_ptr + i).to(tl.pointer_type(tl.int32)), 16)
        write = tl.load(write_ptr + r) != 0
        dst = tl.multiple_of(tl.load(dst_ptr + i).to(tl.pointer_type(tl.int32)), 16)
        for start in range(c * BLOCK, n, CHUNKS * BLOCK):  # a few programs loop: SMs stay free
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(src + offs, mask=mask)
            tl.store(stage + offs, x, mask=mask)
            if write:
                tl.store(dst + offs, x, mask=mask)


_WORDS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
# Programs per member: 16 of 16 KiB loads in flight per member keep the link busy (a read
# over it takes microseconds), and leave the SMs to the compute that overlaps the copy.
_CHUNKS = 16


def copy_routed(src: torch.Tensor, stage: torch.Tensor, copy: torch.Tensor, dst: torch.Tensor,
                write: torch.Tensor, sizes: list[int]) -> None:  # fmt: skip
    """For each place r with ``copy[r]``: member m's ``sizes[m]`` bytes from address
    ``src[r, m]`` to ``stage[r, m]``, and to ``dst[r, m]`` where ``write[r]``. Addresses are
    int64 tensors of shape (places, members), every one 16-byte aligned and every size a
    multiple of 16 (graph mode's members are multiples of 512 bytes). Queued on the current
    stream."""
    key = (src.device, tuple(sizes))
    words = _WORDS.get(key)
    if words is None:  # made outside a capture (the warm-up launches first)
        words = _WORDS[key] = torch.tensor([n // 4 for n in sizes], dtype=torch.int64,
                                           device=src.device)  # fmt: skip
    places, members = src.shape
    chunks = min(_CHUNKS, triton.cdiv(max(sizes) // 4, _BLOCK))
    grid = (places * members, chunks)
    _copy_routed[grid](src, stage, copy, dst, write, words, members, chunks, BLOCK=_BLOCK,
                       num_warps=8)  # fmt: skip
