"""The copy kernel of routed experts in a CUDA graph (Note: [Routed experts in a CUDA graph] in
_graphed.py): a Triton kernel that copies each routed expert's members from addresses it reads
on the device (the host store through its mapped address, or a cache slot) into the stage, and
a miss into its cache slot too. Imported only on CUDA.

Note: [How many programs copy over the link]
A kernel that reads mapped host memory holds its SMs for the whole copy (each load waits on a
round trip over the link), and compute queued beside it runs on what is left. Measured on an
H200 (torch 2.11; `copy_routed` of 8 Qwen3-30B-A3B experts, 75.5 MB, beside a captured graph of
decode-sized GEMMs and elementwise kernels; benchmarks/moe_copy_programs.py, log
benchmarks/log/2026-11-27-moe-prefetch.md): over the link, 16 programs copy at 45.6 GB/s and
slow that compute 1.07x, 32 at 47.6 GB/s and 1.16x, 64 at 47.2 and 1.35x, 128 at 47.8 and
2.58x, 256 at 47.7 and 2.63x; between device addresses, 32 programs copy at 353 GB/s, 64 at
545 (slowing the compute 1.42x and 1.52x: they share its memory bandwidth). In a replayed
8-layer decode with ``prefetch=True``, where a prefetch ran 256 programs, GEMMs beside it took
47 us instead of 7.5; at the Qwen3-30B-A3B shape the same change took the prefetch rows from
1-17% slower than without prefetch to 2-14% faster. So a launch copies over the link with
``LINK_PROGRAMS`` programs whatever its size (each program loops over every row's chunks), the
fewest that keep the link's rate, and between device addresses (a hit's stage copy, bound by
device memory) with ``DEVICE_PROGRAMS``. Hopper's bulk tensor copies (TMA, through Triton 3.6's
tensor descriptors) read the link no faster: 48-51 GB/s for tiles of 16-64 x 128-256 words,
2 or 4 stages, 32-132 programs, against 51 for these loads and 53.8 for the copy engine, on
another H200 lease (a probe, 2026-11-28, benchmarks/log/2026-11-28-moe-grouped-mm.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["DEVICE_PROGRAMS", "LINK_PROGRAMS", "copy_routed"]

_BLOCK = 4096  # 32-bit words a program copies per step (16 KiB)
LINK_PROGRAMS = 32
DEVICE_PROGRAMS = 64


@triton.jit
def _copy_routed(src_ptr, stage_ptr, copy_ptr, dst_ptr, write_ptr, words_ptr, ROWS, M, PROGRAMS,
                 BLOCK: tl.constexpr):  # fmt: skip
    p = tl.program_id(0)
    for i in range(0, ROWS):  # row i: place r = i // M, member i % M
        r = i // M
        if tl.load(copy_ptr + r) != 0:
            n = tl.load(words_ptr + i % M)
            src = tl.multiple_of(tl.load(src_ptr + i).to(tl.pointer_type(tl.int32)), 16)
            stage = tl.multiple_of(tl.load(stage_ptr + i).to(tl.pointer_type(tl.int32)), 16)
            write = tl.load(write_ptr + r) != 0
            dst = tl.multiple_of(tl.load(dst_ptr + i).to(tl.pointer_type(tl.int32)), 16)
            for start in range(p * BLOCK, n, PROGRAMS * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                x = tl.load(src + offs, mask=mask)
                tl.store(stage + offs, x, mask=mask)
                if write:
                    tl.store(dst + offs, x, mask=mask)


_WORDS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def copy_routed(src: torch.Tensor, stage: torch.Tensor, copy: torch.Tensor, dst: torch.Tensor,
                write: torch.Tensor, sizes: list[int],
                programs: int = LINK_PROGRAMS) -> None:  # fmt: skip
    """For each place r with ``copy[r]``: member m's ``sizes[m]`` bytes from address
    ``src[r, m]`` to ``stage[r, m]``, and to ``dst[r, m]`` where ``write[r]``, by ``programs``
    programs (Note: [How many programs copy over the link]). Addresses are int64 tensors of
    shape (places, members), every one 16-byte aligned and every size a multiple of 16 (graph
    mode's members are multiples of 512 bytes). Queued on the current stream."""
    key = (src.device, tuple(sizes))
    words = _WORDS.get(key)
    if words is None:  # made outside a capture (the warm-up launches first)
        words = _WORDS[key] = torch.tensor([n // 4 for n in sizes], dtype=torch.int64,
                                           device=src.device)  # fmt: skip
    places, members = src.shape
    _copy_routed[(programs,)](src, stage, copy, dst, write, words, places * members, members,
                              programs, BLOCK=_BLOCK, num_warps=8)  # fmt: skip
