"""FSDP2 and tensor parallelism on two GPUs (NCCL): the CPU tests' workers, on CUDA.

Run on a machine with two GPUs: ``PYTHONPATH=. python3 -m pytest -m multi_gpu``. Deterministic
settings (deterministic algorithms, cuBLAS workspace, math attention) are set inside each rank;
the baseline is first compared with itself, so a nondeterministic kernel would show up there
rather than as an offloading failure.
"""

from __future__ import annotations

import pytest
import torch
from dist_workers import (
    dcp_bf16_worker,
    dcp_worker,
    fsdp_worker,
    offloaded_optimizer_worker,
    spawn,
    tp_worker,
)
from test_distributed import (
    STEPS,
    check_fsdp_parity,
    check_offloaded_bytes_match_unsharded,
    check_offloaded_optimizer_parity,
    check_resumed_from_dcp,
    check_tp_parity,
    tp_local_shard_bytes,
)

pytestmark = [
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

WORLD = 2


@pytest.fixture(scope="module")
def fsdp_results():
    return spawn(fsdp_worker, WORLD, "cuda")


def test_fsdp_baseline_is_deterministic(fsdp_results):
    check_fsdp_parity(fsdp_results, modes=("none_again",))


def test_fsdp_parity_either_order_and_context(fsdp_results):
    check_fsdp_parity(fsdp_results)
    check_fsdp_parity(fsdp_results, modes=("mixed_after",), base="mixed_none")


def test_fsdp_offloads_activations_only(fsdp_results):
    check_offloaded_bytes_match_unsharded(fsdp_results)


def test_fsdp_no_extra_collective_and_no_host_sync(fsdp_results):
    for r in fsdp_results:
        assert r["sync_control"] > 0  # the counter sees a .item()
        base = r["none"]
        assert base["comm"] and sum(base["comm"].values()) > 0
        for mode in ("after", "before", "context"):
            assert r[mode]["comm"] == base["comm"], mode
            # CUDA's sync debug mode, from the third step on (the first steps grow the pool):
            # offloading adds no host sync to what FSDP itself does
            assert sum(r[mode]["syncs"][2:]) == sum(base["syncs"][2:]), mode


def test_fsdp_memory_flat_over_steps(fsdp_results):
    """50 steps: pinned pool and device memory stop growing after the first steps."""
    for r in fsdp_results:
        for mode in ("none", "after", "before", "context"):
            pool = r[mode]["pool"]
            mem = r[mode]["device_mem"]
            assert len(mem) == STEPS
            assert len(set(mem[2:])) == 1, (mode, sorted(set(mem)))
            if mode != "none":
                assert all(used == 0 for used, _ in pool), mode
                assert len({res for _, res in pool[1:]}) == 1, mode


@pytest.fixture(scope="module")
def tp_results():
    return spawn(tp_worker, WORLD, "cuda")


@pytest.mark.parametrize("local_output", [True, False])
@pytest.mark.parametrize("mode", ["layers", "context"])
def test_tp_parity_and_local_shards(tp_results, local_output, mode):
    check_tp_parity(tp_results, local_output, mode)
    for r in tp_results:
        expected = tp_local_shard_bytes(r["shapes"])
        assert r[(local_output, mode)]["stats"]["offloaded_bytes"] == expected


def test_offloaded_optimizer_under_fsdp2_nccl():
    """Each rank offloads its own shards' state over NCCL; training is bitwise AdamW stepping
    fp32 host copies of the same shards (gradient accumulation, clip_grad_norm_ before step)."""
    check_offloaded_optimizer_parity(spawn(offloaded_optimizer_worker, WORLD, "cuda"))


def test_offloaded_optimizer_resumes_from_a_distributed_checkpoint_nccl():
    """A bf16 FSDP2 model resumed from torch.distributed.checkpoint over NCCL (its state held
    as DTensors over host tensors, the fp32 masters in the state entries) ends bitwise where
    the uninterrupted run does, nested and flattened, on both ranks."""
    check_resumed_from_dcp(spawn(dcp_bf16_worker, WORLD, "cuda"))


def test_offloaded_optimizer_state_dict_gathers_over_nccl():
    """The state of a CUDA DTensor parameter is DTensors over host tensors: DCP saves and
    loads it, and a full (gathered) state dict holds what plain AdamW's holds, by key and
    shape (their values differ: plain AdamW steps on the GPU here, the host on the CPU)."""
    for rank, r in enumerate(spawn(dcp_worker, WORLD, "cuda")):
        assert r["host"]["types"] == r["plain"]["types"], rank
        plain, host = r["plain"]["full"], r["host"]["full"]
        assert plain.keys() == host.keys(), rank
        for key, state in plain.items():
            assert state.keys() == host[key].keys(), (rank, key)
            for name, value in state.items():
                assert tuple(host[key][name].shape) == tuple(value.shape), (rank, key, name)
