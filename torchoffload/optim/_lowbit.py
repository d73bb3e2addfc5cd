"""Number formats of low-precision optimizer state: a moment in 8 bits a value (blockwise, with
an fp32 scale per block), and a bfloat16 parameter written without losing the updates smaller
than half its last bit (stochastic rounding, or a compensation term). Functions over chunks of
flat tensors, on any device; `_adamw` steps with them.

Note: [8-bit optimizer state]
A moment is kept as one uint8 code per element and one fp32 scale per block of `BLOCK` (256)
consecutive elements of the flattened parameter: value = scale * MAP[code], the scale being
the block's largest magnitude and the code the nearest value of MAP to value / scale. So
1 + 4/256 bytes an element, 2.03 for AdamW's two moments against fp32's 8. MAP is the
dynamic-exponent map of Dettmers et al. ("8-bit Optimizers via Block-wise Quantization",
arXiv 2110.02861), the format of bitsandbytes' blockwise 8-bit Adam and of torchao's
AdamW8bit, both also with blocks of 256: a power of ten from 1e-6 to 1 and a linear fraction
between 0.1 and 1 at that power, with more fraction steps at the larger powers; 0 and 1 are
exact. It keeps a relative precision of a few percent down to 1e-3 of the block's largest value
and a coarser one down to 1e-6, where a linear map would round everything below 1/256 of it to
zero; the first moment uses the signed map, the second (never negative) the unsigned one,
which spends the sign bit on one more fraction bit. A block is scaled by its own largest value,
so one outlier coarsens only its 255 neighbours. The step dequantizes a chunk of blocks to
fp32, updates the moments and the parameter in fp32 with those values, and quantizes the new
moments (as those libraries do: the quantization error enters the next step, not this one).
The last block of a parameter whose size is not a multiple of 256 is padded with zeros, which
change neither its scale nor any other value.

Note: [Updating a bf16 parameter]
A bf16 parameter has 8 significant bits: an AdamW update smaller than half the spacing of bf16
values around it (lr 1e-5 on a weight of 0.02 is about 1/16 of that spacing) rounds back to the
same value when written with round-to-nearest, so a long run of small updates is lost, which is
why bf16 training keeps an fp32 master. Two ways keep those updates with a bf16 master; both
compute the new value in fp32 and differ in how it is written:
- stochastic rounding: round up with the probability of the fraction that bf16 drops (the low
  16 bits of the fp32 value over 2**16), else down, so the written value is the fp32 one on
  average and small updates accumulate in expectation (no extra bytes). The random bits come
  from a hash of (seed, step, element index, the fp32 value's bits): the same inputs give the
  same bits on any device, thread count, chunking or order of the parameters in the optimizer
  (so the host step of an `OffloadedOptimizer` matches the class on plain tensors bit for
  bit, and a run is reproducible and resumable from its state dict), with no generator state
  to keep.
- Kahan compensation: a second bf16 tensor holds what rounding dropped, added back before the
  next update (the pair keeps about 16 significant bits), at 2 more bytes a parameter:
  deterministic, the same bytes as an fp32 master, less precise than it.
Round-to-nearest ("nearest") is offered for comparison: it loses the small updates.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

BLOCK = 256  # elements per block of 8-bit state, each with an fp32 scale
CHUNK = 1 << 20  # the most elements a chunk of the step takes


def chunk_elements() -> int:
    """Elements per chunk of the step: 64 Ki (a multiple of BLOCK) per intra-op thread, at
    least 4 and at most CHUNK in all, so that each thread's share of the step's dozen fp32
    temporaries stays near its cache (on a 2-core CPU, 256 Ki took a step of `AdamW8bit` on
    bf16 parameters 20% less time than 1 Mi). The bits do not depend on it."""
    return min(CHUNK, max(4, torch.get_num_threads()) * (1 << 16))


_lock = threading.Lock()
_tables: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_TOP = 16  # a code is looked up by the top 32 - _TOP bits of a value (sign, exponent, fraction)
# ... of a magnitude clamped to [2**-24, 2): a table of 2 x 3200 entries (25 KiB) in L1
_LOW, _HIGH = (127 - 24) << 7, (127 << 7) | 127


def dynamic_map(signed: bool) -> list[float]:
    """The 256 values of the dynamic map, ascending: 0, 1, and for each power of ten p from
    1e-6 to 1, the midpoints of an even cut of [0.1 p, p] into 2**e pieces (signed, and their
    negatives) or 2**(e+1) pieces (unsigned), e = 0 .. 6 from the smallest power. See Note:
    [8-bit optimizer state]."""
    values = [0.0, 1.0]
    for e in range(7):
        pieces = 2**e if signed else 2 ** (e + 1)
        edges = [0.1 + 0.9 * k / pieces for k in range(pieces + 1)]
        power = 10.0 ** (e - 6)
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            values.append((a + b) / 2 * power)
            if signed:
                values.append(-(a + b) / 2 * power)
    assert len(values) == 256
    return sorted(values)


def _table(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The map's values (fp32); the midpoints between consecutive ones, then +inf; and, for
    each pattern of an fp32's top 20 bits, the number of midpoints below every value with
    those bits but the largest, from which the nearest code is that or one more (checked)."""
    key = (signed, device)
    found = _tables.get(key)
    if found is None:
        found = tuple(t.to(device) for t in _build_table(signed))
        with _lock:
            found = _tables.setdefault(key, found)
    return found


def _build_table(signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = torch.tensor(dynamic_map(signed), dtype=torch.float32)
    mids = (values[1:] + values[:-1]) / 2
    top = torch.arange(1 << (32 - _TOP), dtype=torch.int64) << _TOP
    ends = []
    for low_bits in (0, (1 << _TOP) - 1):  # the two ends of each pattern's values
        bits = top | low_bits
        ends.append(torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32))
    a, b = (e.view(torch.float32) for e in ends)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    below = torch.bucketize(lo, mids, out_int32=True)
    finite = lo.isfinite() & hi.isfinite()
    spread = torch.bucketize(hi, mids, out_int32=True) - below
    assert int(spread[finite].max()) <= 1, "a pattern spans two midpoints"
    # the patterns of magnitudes from 2**-24 to below 2: those below take the smallest's
    # entry, as no midpoint is that near zero; those above (only NaN: a value over its
    # block's scale is at most 1) the largest's
    assert float(mids.abs().min()) >= 2.0**-23
    kept = torch.arange(_LOW, _HIGH + 1)
    below = below[torch.cat([kept, kept | (1 << 15)])].contiguous()
    return values, torch.cat([mids, mids.new_full((1,), float("inf"))]), below


def _codes_below(y: torch.Tensor, below: torch.Tensor) -> torch.Tensor:
    """The entry of ``below`` for each fp32 ``y``: its top 16 bits, the magnitude clamped to
    [2**-24, 2), as `_lowbit_step.c` looks it up."""
    bits = y.view(torch.int32)
    top = bits.bitwise_right_shift(_TOP).bitwise_and_(0x7FFF).clamp_(_LOW, _HIGH).sub_(_LOW)
    top.add_(bits.lt(0).int().mul_(_HIGH - _LOW + 1))
    return below.index_select(0, top)


def blocks_of(numel: int) -> int:
    return -(-numel // BLOCK)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of whole blocks: ``codes`` (uint8, ``len(scales) * BLOCK`` long) and
    their ``scales``. A new tensor."""
    values = _table(signed, codes.device)[0]
    out = values.index_select(0, codes.int()).view(-1, BLOCK)
    return out.mul_(scales.view(-1, 1)).view(-1)


def quantize_(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, signed: bool) -> None:
    """Write fp32 ``x`` (whole blocks; ``signed``: of either sign, else never negative) into
    ``codes`` and ``scales``: each block's largest magnitude, and for each element the code of
    the map value nearest to it over that (`torch.bucketize` over the midpoints, computed from
    a table of the value's top bits: the same codes, several times faster on a CPU)."""
    _, mids, below = _table(signed, x.device)
    blocks = x.view(-1, BLOCK)
    torch.amax(blocks.abs(), dim=1, out=scales)  # NaN if any value is; never -0.0
    # An all-zero block: scale 0, every value 0 (its codes are those of 0)
    y = blocks.div(scales.clamp(min=torch.finfo(torch.float32).tiny).view(-1, 1)).view(-1)
    code = _codes_below(y, below)
    code.add_(mids.index_select(0, code) < y)
    codes.copy_(code)


@functools.cache
def native_tables() -> tuple[torch.Tensor, ...]:
    """The tables of `_lowbit_step.c`: for the signed map, then the unsigned one, on the CPU:
    the values, the codes below each pattern of top bits and the midpoint above them."""
    found: tuple[torch.Tensor, ...] = ()
    for signed in (True, False):
        values, mids, below = _table(signed, torch.device("cpu"))
        found += (values, below, mids[below])
    return found


def sqrt_exact(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of fp32 ``x``, a new tensor. On a CPU, ATen's float32
    `sqrt` of a long tensor goes through MKL's vector math, which is not correctly rounded
    (measured: 637 of 100003 values a bit off); float64's is within a bit of float64, which
    rounds to the correct float32 (a float32's square root is never that near the middle of
    two float32s)."""
    return x.sqrt() if x.device.type == "cuda" else x.double().sqrt_().float()


def padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` (flat) padded with zeros to whole blocks (``x`` itself when it is)."""
    extra = -x.numel() % BLOCK
    return F.pad(x, (0, extra)) if extra else x


# - bf16 rounding (Note: [Updating a bf16 parameter])

_MASK32 = 0xFFFFFFFF


def _signed32(v: int) -> int:
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def _fmix(h: int) -> int:
    """MurmurHash3's 32-bit finalizer, on a Python int."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def round_key(seed: int, step: int) -> int:
    """The key of one step's stochastic rounding."""
    return _fmix((_fmix(seed & _MASK32) ^ (step * 0x9E3779B9)) & _MASK32)


_GOLDEN = _signed32(0x9E3779B9)
_M1, _M2 = _signed32(0x85EBCA6B), _signed32(0xC2B2AE35)
_ramps: dict[torch.device, torch.Tensor] = {}


def _ramp(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n) * golden`` in int32 (wrapping), n at most CHUNK."""
    ramp = _ramps.get(device)
    if ramp is None:
        ramp = torch.arange(CHUNK, dtype=torch.int32, device=device).mul_(_GOLDEN)
        with _lock:
            ramp = _ramps.setdefault(device, ramp)
    return ramp[:n]


def _random16(bits: torch.Tensor, key: int, offset: int) -> torch.Tensor:
    """16 random bits (int32 in [0, 2**16)) per element: a hash of ``key``, the element's
    index (``offset`` + its place) and its fp32 ``bits``. Int32 arithmetic wraps."""
    h = _ramp(bits.numel(), bits.device).add(_signed32(offset * 0x9E3779B9 + key))
    h.bitwise_xor_(bits)
    for shift, mul in ((16, _M1), (13, _M2)):
        h.bitwise_xor_(h.bitwise_right_shift(shift).bitwise_and_((1 << (32 - shift)) - 1))
        h.mul_(mul)
    h.bitwise_xor_(h.bitwise_right_shift(16).bitwise_and_(0xFFFF))
    return h.bitwise_and_(0xFFFF)


def round_stochastic_(out: torch.Tensor, x: torch.Tensor, key: int, offset: int) -> None:
    """Write fp32 ``x`` into bf16 ``out`` (both flat), rounded up with the probability of the
    dropped fraction; ``offset``: the index of ``x``'s first element in its parameter."""
    bits = x.view(torch.int32)
    # adding 0 <= r < 2**16 to the low half carries into the kept half with probability
    # fraction / 2**16, on the magnitude for either sign; then the low half is cut
    rounded = _random16(bits, key, offset).add_(bits).bitwise_and_(-65536)
    rounded = torch.where(x.isnan(), x, rounded.view(torch.float32))
    out.copy_(rounded)  # exact: the low 16 bits are zero


def round_compensated_(out: torch.Tensor, compensation: torch.Tensor, x: torch.Tensor) -> None:
    """Write fp32 ``x`` (the parameter plus its old compensation, updated) into bf16 ``out``
    rounded to nearest, and what that dropped into bf16 ``compensation``. ``x`` is consumed."""
    out.copy_(x)
    compensation.copy_(x.sub_(out))
