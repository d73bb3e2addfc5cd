from __future__ import annotations

import pytest
import torch
from conftest import in_threads

from torchoffload import PinnedPool, PoolExhaustedError


class FakeEvent:
    """An event that completes only when the test says so."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def make_pool(capacity: int = 1 << 20, slab: int = 1 << 16, **kw) -> PinnedPool:
    return PinnedPool(capacity, slab_bytes=slab, pin_memory=False, **kw)


def test_blocks_are_exact_size_and_64_byte_aligned():
    pool = make_pool()
    blocks = [pool.allocate(n) for n in (1, 3, 100, 4097, 65)]
    for b, n in zip(blocks, (1, 3, 100, 4097, 65), strict=True):
        assert b.nbytes == n and b.tensor.numel() == n and b.tensor.dtype == torch.uint8
        assert b.tensor.data_ptr() % 64 == 0
    assert pool.stats().used_bytes == 1 + 3 + 100 + 4097 + 65
    ranges = sorted((b.tensor.data_ptr(), b.tensor.data_ptr() + b.nbytes) for b in blocks)
    assert all(
        a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:], strict=False)
    )


def test_block_address_without_its_tensor_and_after_free():
    """`data_ptr()` needs no tensor (the graph ops' hot path); it is the tensor's address once
    one is made; both are refused after the block is released."""
    pool = make_pool()
    first, second = pool.allocate(100), pool.allocate(300)
    assert second.data_ptr() == first.data_ptr() + 128  # 100 bytes rounded up to 64-byte units
    ptr = second.data_ptr()
    assert second.tensor.data_ptr() == ptr and second.tensor.numel() == 300
    pool.free(second)
    with pytest.raises(RuntimeError, match="freed"):
        second.data_ptr()
    with pytest.raises(RuntimeError, match="freed"):
        second.tensor  # noqa: B018


def test_mixed_dtypes_share_one_slab_without_overlap():
    pool = make_pool()
    values = [
        torch.randn(7, dtype=torch.float64),
        torch.randn(5).to(torch.bfloat16),
        torch.arange(3, dtype=torch.int8),
        torch.randn(9, dtype=torch.complex64),
        torch.randn(11).half(),
    ]
    blocks = []
    for v in values:
        b = pool.allocate(v.numel() * v.element_size())
        b.tensor.view(v.dtype).copy_(v)
        blocks.append(b)
    assert pool.stats().slabs == 1
    for v, b in zip(values, blocks, strict=True):
        assert torch.equal(b.tensor.view(v.dtype), v)


def test_free_coalesces_and_reuses_space():
    pool = make_pool(capacity=1 << 16, slab=1 << 16)
    a, b, c = (pool.allocate(1 << 14) for _ in range(3))
    pool.free(b)
    pool.free(a)
    big = pool.allocate(1 << 15)  # needs a and b merged
    assert big.tensor.data_ptr() == pool._slabs[0].tensor.data_ptr()
    pool.free(big)
    pool.free(c)
    s = pool.stats()
    assert s.used_bytes == 0 and s.slabs == 1
    assert pool._slabs[0].starts == [0] and pool._slabs[0].sizes == {0: 1 << 16}


def test_block_is_not_reused_before_its_event_completes():
    pool = make_pool(capacity=1 << 16, slab=1 << 16)
    a = pool.allocate(1 << 16)
    ev = FakeEvent()
    pool.free(a, after=ev)
    s = pool.stats()
    assert s.used_bytes == 1 << 16 and s.pending_bytes == 1 << 16
    ev.done = True
    s = pool.stats()
    assert s.used_bytes == 0 and s.pending_bytes == 0
    assert pool.allocate(1 << 16).tensor.data_ptr() == pool._slabs[0].tensor.data_ptr()


def test_full_pool_waits_on_pending_event_instead_of_growing():
    pool = make_pool(capacity=1 << 16, slab=1 << 16)
    a = pool.allocate(1 << 16)
    ev = FakeEvent()
    pool.free(a, after=ev)
    b = pool.allocate(1 << 15)  # only reachable by waiting for `ev`
    assert ev.waited == 1
    assert b.tensor.data_ptr() == pool._slabs[0].tensor.data_ptr()
    s = pool.stats()
    assert s.event_waits == 1 and s.slabs == 1 and s.fallback_allocs == 0


class CountingEvent(FakeEvent):
    def __init__(self, counter: list[int]) -> None:
        super().__init__()
        self.counter = counter

    def query(self) -> bool:
        self.counter[0] += 1
        return self.done


def test_an_allocation_reclaims_a_bounded_number_of_pending_blocks():
    # A backward frees every block with an event still running; the next step's first
    # allocation must not pay for all of them at once (Note: [Bounded reclaim]).
    from torchoffload._pool import _RECLAIM_PER_ALLOC

    pool = make_pool(capacity=1 << 20, slab=1 << 20)
    queries = [0]
    blocks = [pool.allocate(1 << 12) for _ in range(100)]
    events = [CountingEvent(queries) for _ in blocks]
    for b, ev in zip(reversed(blocks), events, strict=True):
        pool.free(b, after=ev)
    for ev in events:
        ev.done = True
    queries[0] = 0
    again = [pool.allocate(1 << 12)]
    assert queries[0] == _RECLAIM_PER_ALLOC
    again += [pool.allocate(1 << 12) for _ in range(99)]
    assert queries[0] == 100  # each pending block queried once, spread over the allocations
    assert pool._pending_bytes == 0 and pool.stats().slabs == 1  # drained, no growth
    for b in again:
        pool.free(b)
    assert pool.stats().used_bytes == 0


def test_an_allocation_that_does_not_fit_reclaims_every_completed_block():
    pool = make_pool(capacity=1 << 16, slab=1 << 16)
    blocks = [pool.allocate(1 << 12) for _ in range(16)]  # the whole slab
    events = [FakeEvent() for _ in blocks]
    for b, ev in zip(blocks, events, strict=True):
        pool.free(b, after=ev)
    for ev in events[:-1]:
        ev.done = True
    big = pool.allocate(15 << 12)  # needs the 15 completed blocks merged, not the last one
    s = pool.stats()
    assert big.nbytes == 15 << 12 and s.slabs == 1 and s.event_waits == 0
    assert s.pending_bytes == 1 << 12 and not events[-1].waited


def test_peak_counts_live_blocks_not_blocks_waiting_on_their_copies():
    pool = make_pool(capacity=1 << 20, slab=1 << 20)
    a = pool.allocate(1 << 12)
    pool.free(a, after=FakeEvent())  # pending until the pool queries it done
    pool.reset_peak()
    b = pool.allocate(1 << 12)
    s = pool.stats()
    assert s.used_bytes == 2 << 12 and s.pending_bytes == 1 << 12 and s.peak_bytes == 1 << 12
    pool.free(b)


def test_pool_grows_by_slabs_up_to_capacity():
    pool = make_pool(capacity=3 << 16, slab=1 << 16)
    blocks = [pool.allocate(1 << 16) for _ in range(3)]
    s = pool.stats()
    assert s.slabs == 3 and s.reserved_bytes == 3 << 16 and s.peak_bytes == 3 << 16
    for b in blocks:
        pool.free(b)
    assert pool.stats().peak_bytes == 3 << 16


def test_request_larger_than_slab_gets_its_own_slab():
    pool = make_pool(capacity=1 << 20, slab=1 << 12)
    b = pool.allocate(100_000)
    assert b.nbytes == 100_000
    assert pool.stats().reserved_bytes == 100_032  # rounded to 64 bytes, not a power of two


def test_exhaustion_raise_policy():
    pool = make_pool(capacity=1 << 16, slab=1 << 16, on_exhausted="raise")
    pool.allocate(1 << 16)
    with pytest.raises(PoolExhaustedError, match="capacity 65536"):
        pool.allocate(1)
    assert pool.stats().used_bytes == 1 << 16


def test_exhaustion_fallback_warns_once_and_counts():
    pool = make_pool(capacity=1 << 16, slab=1 << 16)
    pool.allocate(1 << 16)
    with pytest.warns(RuntimeWarning, match="outside the pool"):
        extra = [pool.allocate(1000)]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extra.append(pool.allocate(2000))
    s = pool.stats()
    assert s.fallback_allocs == 2 and s.fallback_bytes == 3000 and s.used_bytes == (1 << 16) + 3000
    for b in extra:
        pool.free(b)
    assert pool.stats().used_bytes == 1 << 16


def test_per_call_policy_overrides_pool_policy():
    pool = make_pool(capacity=1 << 16, slab=1 << 16)
    pool.allocate(1 << 16)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(10, on_exhausted="raise")


def test_double_free_is_an_error():
    pool = make_pool()
    b = pool.allocate(10)
    pool.free(b)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(b)


def test_reserve_preallocates_and_release_frees():
    pool = make_pool(capacity=1 << 20, slab=1 << 16)
    pool.reserve(3 << 16)
    assert pool.stats().reserved_bytes == 3 << 16
    b = pool.allocate(10)
    with pytest.raises(RuntimeError, match="in use"):
        pool.release()
    pool.free(b)
    pool.release()
    assert pool.stats().reserved_bytes == 0


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"capacity_bytes": 0}, ValueError),
        ({"capacity_bytes": 1.5}, TypeError),
        ({"capacity_bytes": True}, TypeError),
        ({"capacity_bytes": 1 << 20, "slab_bytes": 1}, ValueError),
        ({"capacity_bytes": 1 << 20, "on_exhausted": "drop"}, ValueError),
        ({"capacity_bytes": 1 << 20, "pin_memory": "yes"}, TypeError),
    ],
)
def test_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        PinnedPool(**kwargs)


def test_bad_allocation_size():
    pool = make_pool()
    with pytest.raises(ValueError):
        pool.allocate(0)
    with pytest.raises(TypeError):
        pool.allocate(3.0)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only error")
def test_pinning_without_accelerator_is_a_clear_error():
    with pytest.raises(ValueError, match="needs an accelerator"):
        PinnedPool(1 << 20, pin_memory=True)


def test_concurrent_allocate_and_free():
    pool = make_pool(capacity=1 << 22, slab=1 << 18)

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        held = []
        for _ in range(300):
            n = int(torch.randint(1, 5000, (1,), generator=g))
            b = pool.allocate(n)
            b.tensor.fill_(seed)
            held.append(b)
            if len(held) > 8:
                old = held.pop(0)
                assert bool((old.tensor == seed).all())
                pool.free(old)
        for b in held:
            pool.free(b)

    errors = in_threads(work, range(4))
    assert not errors
    assert pool.stats().used_bytes == 0


def test_sizes_beyond_what_exists_are_refused_at_the_entry():
    with pytest.raises(ValueError, match="capacity_bytes must be <="):
        PinnedPool(capacity_bytes=2**70, pin_memory=False)
    pool = PinnedPool(capacity_bytes=1 << 20, slab_bytes=1 << 20, pin_memory=False)
    with pytest.raises(ValueError, match="nbytes must be <= 1048576"):
        pool.reserve(2 << 20)
    pool.reserve(1 << 20)  # exactly the capacity: reserved, not silently skipped
    assert pool.stats().reserved_bytes == 1 << 20
    with pytest.raises(ValueError, match="on_exhausted must be 'fallback' or 'raise'"):
        PinnedPool(1 << 20, pin_memory=False, on_exhausted="drop")
