"""The Triton kernels of routed experts in a CUDA graph (Note: [Routed experts in a CUDA graph]
in _graphed.py): `copy_routed` copies each routed expert's members from addresses it reads on
the device (the host store through its mapped address, or a cache slot) into the stage, and a
miss into its cache slot too; `route_call` routes a call and plans its copies
(Note: [One routing kernel per call]). Imported only on CUDA.

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
device memory) with ``DEVICE_PROGRAMS``: the compute stream waits for those copies before the
block's experts, so they are on a step's critical path (batched_mm and eager experts stage
every hit; grouped_mm experts, computed in their slots, none: Note: [Parts of the cache] in
_layout.py). Measured before the cache had parts, when a grouped_mm step staged about 5 of 6
hits (48 layers at the Qwen3-30B-A3B shape, every expert cached in 6152 slots, replayed): a
step took 17.5 ms with 64 programs and 16.6 with 128 in one process (the resident model in a
graph of its own: 12.7);
in another, 256 and 512 took no less than 128 (18.1 ms each, before the routing kernel skipped
the victim search of a call without a miss; H200, torch 2.11, 2026-11-29). Hopper's bulk
tensor copies (TMA, through Triton 3.6's tensor descriptors) read the link no faster: 48-51
GB/s for tiles of 16-64 x 128-256 words, 2 or 4 stages, 32-132 programs, against 51 for these
loads and 53.8 for the copy engine, on another H200 lease (a probe, 2026-11-28,
benchmarks/log/2026-11-28-moe-grouped-mm.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["DEVICE_PROGRAMS", "LINK_PROGRAMS", "copy_routed", "route_call"]

_BLOCK = 4096  # 32-bit words a program copies per step (16 KiB)
LINK_PROGRAMS = 32
DEVICE_PROGRAMS = 128
ROUTE_BLOCK = 4096  # cache slots `_route` scores at a time (Note: [One routing kernel per call])


@triton.jit
def _copy_routed(src_ptr, stage_ptr, copy_ptr, dst_ptr, write_ptr, words_ptr, ROWS, M, PROGRAMS,
                 BLOCK: tl.constexpr, PLACES: tl.constexpr):  # fmt: skip
    p = tl.program_id(0)
    # every place's flag in one load: a launch that copies nothing (every expert a hit) ends
    # after it, where reading the flags row by row took 3.5 us (H200, 2026-11-29)
    at = tl.arange(0, PLACES)
    flags = tl.load(copy_ptr + at, mask=at < ROWS // M, other=0).to(tl.int32)
    if tl.max(flags, 0) != 0:
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
                              programs, BLOCK=_BLOCK, PLACES=_pow2(places, 2),
                              num_warps=8)  # fmt: skip


# Note: [One routing kernel per call]
# A graph call's routing (`DeviceTables._admit` and `route`, or `plan_prefetch`), its copy plan
# (`Stage.derive`) and the grouped GEMM's row order and group offsets (`DeviceTables.call`) take
# about 90 tensor operations of a few elements each, each a kernel node the graph runs one
# after the other (1-3 us each). `_route` does the same in one program of one kernel: the same
# tables, updated the same way, and the same plan, element for element (a GPU test runs both
# on a random walk of calls and compares them). Invariants:
# - Every table is read before any is written (a barrier between): a call's hits, victims and
#   misses come from the map as the call found it, as in the tensor version.
# - Victims: the ``K`` unpinned slots of least score, found one minimum at a time over chunks
#   of ``ROUTE_BLOCK`` slots merged with the best so far. Unpinned scores are unique (stamps
#   are), so they are `torch.topk`'s victims. A pinned slot (score ``BIG``) is never given to
#   a miss (``rank < free``), so ties among pinned slots change nothing. A call without a miss
#   takes no victim and does not search: the search reads every slot, the rest ``K`` entries.
# - A table entry is read and written by one thread of the one program (Triton stores each
#   element from the thread that owns it), so the counters' read-add-write is not a race.
# Measured (H200, torch 2.11, 2026-11-29, Qwen3-30B-A3B shape, every expert cached, decode
# replayed in a graph; benchmarks/log/2026-11-29-moe-routing-kernel.md): 8 layers, 1615
# kernels a step with the tensor operations against 727 with the kernel (839 for the resident
# model captured in a graph of its own), 6.78-7.16 ms a step against 5.26-5.28 in one process;
# 48 layers (`benchmarks/moe.py`), 20.82 / 20.35 ms a step against 31.11 / 30.02 on another
# lease earlier that day. The kernel took 12.4 us a call under the profiler.


@triton.jit
def _victims(stamp_ptr, key_of_ptr, uses_ptr, held_slot, pinned, LO, HI, BIG, PAD, CAP,
             K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, LFU: tl.constexpr,
             STAMP_BITS: tl.constexpr):  # fmt: skip
    """The ``K`` unpinned slots of least score in [LO, HI), ascending (Note: [One routing
    kernel per call]), and the count of pinned slots there (those in ``held_slot`` or
    ``pinned``)."""
    kk = tl.arange(0, KP)
    best = tl.full((KP,), PAD, tl.int64)
    best_at = tl.full((KP,), 0, tl.int64)
    npinned = tl.sum(tl.zeros((KP,), tl.int32), 0)
    for c in range(LO, HI, BLOCK):
        s = c + tl.arange(0, BLOCK)
        sm = s < HI
        score = tl.load(stamp_ptr + s, mask=sm, other=0)
        if LFU:
            owner = tl.load(key_of_ptr + s, mask=sm, other=-1)
            uses = tl.load(uses_ptr + owner, mask=sm & (owner >= 0), other=0)
            score = tl.where(owner >= 0, tl.minimum(uses, CAP) * (1 << STAMP_BITS) + score, score)
        is_pinned = tl.sum(((s[:, None] == held_slot[None, :]) | (s[:, None] == pinned[None, :]))
                           .to(tl.int32), 1) > 0  # fmt: skip
        npinned += tl.sum((is_pinned & sm).to(tl.int32), 0)
        score = tl.where(is_pinned, BIG, score)
        score = tl.where(sm, score, PAD)
        new = tl.full((KP,), PAD, tl.int64)
        new_at = tl.full((KP,), 0, tl.int64)
        bb = tl.arange(0, BLOCK)
        for t in tl.static_range(K):  # the least of the chunk and the best so far, K times
            m1, p1 = tl.min(score, 0, return_indices=True)
            m2, p2 = tl.min(best, 0, return_indices=True)
            from_chunk = m1 < m2
            at2 = tl.sum(tl.where(kk == p2, best_at, 0), 0)
            new = tl.where(kk == t, tl.minimum(m1, m2), new)
            new_at = tl.where(kk == t, tl.where(from_chunk, c + p1.to(tl.int64), at2), new_at)
            score = tl.where((bb == p1) & from_chunk, PAD, score)
            best = tl.where((kk == p2) & ~from_chunk, PAD, best)
        best = new
        best_at = new_at
    return best_at, npinned


@triton.jit(do_not_specialize=["FIRST_KEY", "N", "LO", "HI", "TRASH", "CACHE_BASE", "WINDOW",
                               "WSLOTS", "LI", "AHEAD"])  # fmt: skip
def _route(index_ptr, slot_of_ptr, key_of_ptr, stamp_ptr, uses_ptr, clock_ptr, counts_ptr,
           used_ptr, host_ptr, region_ptr, stage_ptr, flags_ptr, addrs_ptr, perms_ptr, offs_ptr,
           score_ptr, FIRST_KEY, N, LO, HI, TRASH, CACHE_BASE, SLOT_BYTES, WINDOW, WSLOTS, LI, BIG,
           PAD, CAP, AHEAD, K: tl.constexpr, KP: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
           BLOCK: tl.constexpr, WBLOCK: tl.constexpr, LFU: tl.constexpr,
           PREFETCH: tl.constexpr, DIRECT: tl.constexpr, STAMP_BITS: tl.constexpr):  # fmt: skip
    j = tl.arange(0, KP)  # a place, in the sorted order of its expert
    jm = j < K
    # the token's experts sorted, with their places in the router's order (stable)
    raw = tl.load(index_ptr + j, mask=jm, other=0)
    raw = tl.where((raw >= 0) & (raw < N), raw, N)  # outside the layer: none (and keys >= 0)
    keyed = tl.sort(tl.where(jm, raw * KP + j, PAD), 0)
    expert = keyed // KP
    place = keyed % KP
    valid = jm & (expert >= 0) & (expert < N)
    key = tl.where(valid, expert + FIRST_KEY, 0)
    slot = tl.where(valid, tl.load(slot_of_ptr + key, mask=valid, other=-1), -1)
    hit = slot >= 0
    miss = valid & ~hit
    if PREFETCH:  # the AHEAD misses of most score (the earlier place first among equals)
        pinned = tl.load(used_ptr + j, mask=jm, other=-1)
        w = tl.load(score_ptr + place, mask=jm, other=0).to(tl.float32)
        w = tl.where(w == w, w, float("-inf"))  # NaN last: the order stays total, ranks unique
        ahead = (w[None, :] > w[:, None]) | ((w[None, :] == w[:, None]) &
                                             (place[None, :] < place[:, None]))  # fmt: skip
        rank = tl.sum((ahead & miss[None, :]).to(tl.int32), 1)  # the misses ahead of each
        chosen = miss & (rank < AHEAD)
    else:
        pinned = tl.full((KP,), -1, tl.int64)
        chosen = miss
        rank = tl.cumsum(miss.to(tl.int32), 0) - 1  # misses before each place, itself too, less 1
    held_slot = tl.where(hit, slot, -1)
    # victims only for a call with a miss: the search reads every slot, the rest reads K
    best_at = tl.full((KP,), 0, tl.int64)
    npinned = tl.sum(tl.zeros((KP,), tl.int32), 0)
    if tl.sum(miss.to(tl.int32), 0) > 0:
        best_at, npinned = _victims(stamp_ptr, key_of_ptr, uses_ptr, held_slot, pinned, LO, HI,
                                    BIG, PAD, CAP, K, KP, BLOCK, LFU, STAMP_BITS)  # fmt: skip
    kk = tl.arange(0, KP)
    nv = tl.minimum(HI - LO, K)
    free = tl.minimum(HI - LO - npinned, nv)
    write = chosen & (rank < free)
    rk = tl.minimum(tl.maximum(rank, 0), tl.maximum(nv - 1, 0))
    vslot = tl.sum(tl.where(rk[:, None] == kk[None, :], best_at[None, :], 0), 1)
    old = tl.load(key_of_ptr + vslot, mask=write, other=-1)
    clock = tl.load(clock_ptr)
    tl.debug_barrier()  # every table read before any write
    tl.store(slot_of_ptr + old, tl.full((KP,), -1, tl.int64), mask=write & (old >= 0))
    tl.store(slot_of_ptr + key, vslot, mask=write)
    tl.store(key_of_ptr + vslot, key, mask=write)
    jj = j.to(tl.int64)
    if PREFETCH:
        tl.store(stamp_ptr + vslot, clock + jj, mask=write)
        tl.store(counts_ptr + LI * 5 + 4,
                 tl.load(counts_ptr + LI * 5 + 4) + tl.sum(write.to(tl.int64), 0))  # fmt: skip
        tl.store(clock_ptr, clock + K)
    else:
        used = tl.where(hit, slot, tl.where(write, vslot, TRASH))
        if HI > LO:  # no cache slot: no clock (as the tensor version)
            tl.store(stamp_ptr + used, clock + jj, mask=jm & (used < TRASH))
            tl.store(used_ptr + j, used, mask=jm)
            tl.store(clock_ptr, clock + K)
        u = tl.load(uses_ptr + key, mask=valid, other=0)
        tl.store(uses_ptr + key, u + 1, mask=valid)
        row = counts_ptr + LI * 5
        tl.store(row, tl.load(row) + 1)
        tl.store(row + 1, tl.load(row + 1) + 1)
        tl.store(row + 2, tl.load(row + 2) + tl.sum((valid & hit).to(tl.int64), 0))
        tl.store(row + 3, tl.load(row + 3) + tl.sum(miss.to(tl.int64), 0))
    # the plan: per place and member, source, first destination, cache destination
    mm = tl.arange(0, MP)
    pm = jm[:, None] & (mm < M)[None, :]
    region = tl.load(region_ptr + mm, mask=mm < M, other=0)
    hrow = tl.where(valid, expert, N)
    host = tl.load(host_ptr + hrow[:, None] * M + mm[None, :], mask=pm, other=0)
    stage = tl.load(stage_ptr + j[:, None] * M + mm[None, :], mask=pm, other=0)
    cached = CACHE_BASE + tl.maximum(slot, 0)[:, None] * SLOT_BYTES + region[None, :]
    dst = CACHE_BASE + vslot[:, None] * SLOT_BYTES + region[None, :]
    src = tl.where(miss[:, None], host, cached)
    if PREFETCH:
        src = host
    at = tl.where(hit, slot, tl.where(write, vslot, HI + jj))  # the part's stage: from HI
    if DIRECT:  # noqa: SIM108 (a constexpr branch, for Triton)
        inside = at >= WINDOW
    else:
        inside = tl.zeros((KP,), tl.int1)
    first = tl.where((inside & write)[:, None], dst, stage)
    also = write & ~inside
    held = valid & ~miss & ~inside
    a = addrs_ptr + j[:, None] * M + mm[None, :]
    tl.store(a, src, mask=pm)
    tl.store(a + K * M, first, mask=pm)
    tl.store(a + 2 * K * M, dst, mask=pm)
    tl.store(flags_ptr + j, valid, mask=jm)
    tl.store(flags_ptr + K + j, miss, mask=jm)
    tl.store(flags_ptr + 2 * K + j, held, mask=jm)
    tl.store(flags_ptr + 3 * K + j, also, mask=jm)
    tl.store(flags_ptr + 4 * K + j, write, mask=jm)
    tl.store(flags_ptr + 5 * K + j, inside, mask=jm)
    tl.store(flags_ptr + 6 * K + place, ~valid, mask=jm)  # in the router's order
    # permutations: the sort's (``place``), its inverse, and for each of the router's places
    # its row among the rows sorted by the slot it computes in (``back``); the window's group
    # offsets
    tl.store(perms_ptr + j, place, mask=jm)
    tl.store(perms_ptr + K + place, jj, mask=jm)
    if DIRECT:
        comp = tl.where(inside, at, HI + jj)
        comp_m = tl.where(jm, comp, PAD)
        back = tl.sum(((comp_m[None, :] < comp[:, None]) & jm[None, :]).to(tl.int64), 1)
        tl.store(perms_ptr + 2 * K + place, back, mask=jm)
        for w0 in range(0, WSLOTS, WBLOCK):
            w = w0 + tl.arange(0, WBLOCK)
            n_le = tl.sum(((comp_m[None, :] <= WINDOW + w[:, None]) & jm[None, :])
                          .to(tl.int32), 1)  # fmt: skip
            tl.store(offs_ptr + w, n_le, mask=w < WSLOTS)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def route_call(index: torch.Tensor, tables: tuple, host: torch.Tensor, region: torch.Tensor,
               stage: torch.Tensor, *, first_key: int, experts: int, lo: int, hi: int,
               trash: int, cache_base: int, slot_bytes: int, window: int, layer: int, big: int,
               cap: int, stamp_bits: int, lfu: bool, prefetch: bool, direct: bool,
               ahead: int = 0, score: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """One graph call's routing, table updates and plan in one kernel (Note: [One routing
    kernel per call]); ``tables``: (slot_of, key_of, stamp, uses, clock, counts, used); the
    layer's part's cache slots [``lo``, ``hi``), its stage from ``hi``, the tables' trash
    entry ``trash`` (Note: [Parts of the cache] in _layout.py); an LFU score is the uses
    (at most ``cap``) shifted left by ``stamp_bits``, plus the stamp. A ``prefetch`` writes
    at most ``ahead`` misses, those of most ``score`` (per place of ``index``) first.
    Returns flags (7, K) bool: valid, miss, held, also, write, inside, and ``dead`` (not
    valid, in the router's order); addresses (3, K, M) int64: source, first destination, cache
    destination; permutations (3, K) int64: the sort's, its inverse, and per place of the
    router's order its row among those sorted by slot (``direct``); the window's group offsets
    (int32, ``direct``). Queued on the current stream."""
    k = index.numel()
    m = region.numel()
    dev = index.device
    flags = torch.empty(7, k, dtype=torch.bool, device=dev)
    addrs = torch.empty(3, k, m, dtype=torch.int64, device=dev)
    perms = torch.empty(3, k, dtype=torch.int64, device=dev)
    wslots = hi + k - window if direct else 0
    offs = torch.empty(max(wslots, 1), dtype=torch.int32, device=dev)
    block = min(ROUTE_BLOCK, _pow2(hi - lo))
    if score is None:  # read by a prefetch only
        score = index
    _route[(1,)](index, *tables, host, region, stage, flags, addrs, perms, offs, score,
                 first_key, experts, lo, hi, trash, cache_base, slot_bytes, window, wslots,
                 layer, big, (1 << 63) - 1, cap, ahead, K=k, KP=_pow2(k, 2), M=m,
                 MP=_pow2(m, 2), BLOCK=block, WBLOCK=min(1024, _pow2(wslots)), LFU=lfu,
                 PREFETCH=prefetch, DIRECT=direct, STAMP_BITS=stamp_bits,
                 num_warps=8 if block >= 2048 else 4)  # fmt: skip
    return flags, addrs, perms, offs[:wslots] if direct else None
