"""FSDP2 and tensor parallelism on CPU: two processes on gloo, with and without offloading.

One spawn runs every FSDP2 scenario (dist_workers.fsdp_worker), then the tensor-parallel ones
(tp_worker) and the offloaded optimizer under FSDP2 (offloaded_optimizer_worker), in the same
two processes (dist_workers.cpu_worker: a spawn costs about 5 s); the tests below assert on what
the ranks returned. The spawn runs in a subprocess started as soon as the tests are collected,
beside the other modules' tests (background.py). The same workers run on two GPUs in
test_distributed_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from background import TESTS, Job, output

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")

WORLD = 2
STEPS = 50


def check_fsdp_parity(results, modes=("after", "before", "context"), base="none"):
    for rank, r in enumerate(results):
        ref = r[base]
        for mode in modes:
            got = r[mode]
            for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
                assert torch.equal(a, b), (rank, mode, step, a, b)
            for step, grads in ref["grads"].items():
                for i, (a, b) in enumerate(zip(grads, got["grads"][step], strict=True)):
                    assert torch.equal(a, b), (rank, mode, step, i)
            for a, b in zip(ref["params"], got["params"], strict=True):
                assert torch.equal(a, b), (rank, mode)


def check_offloaded_bytes_match_unsharded(results):
    for r in results:
        for mode in ("after", "context"):
            assert r[mode]["offloaded_bytes_per_step"] > 0
            assert r[mode]["offloaded_bytes_per_step"] == r["plain_bytes"][mode], mode


def check_tp_parity(results, local_output, mode):
    for r in results:
        ref, got = r[(local_output, "none")], r[(local_output, mode)]
        assert torch.equal(ref["out"], got["out"])
        for a, b in zip(ref["grads"], got["grads"], strict=True):
            assert torch.equal(a, b)


def tp_local_shard_bytes(shapes):
    """See test_tp_offloads_local_shards."""
    return shapes["layers"] * shapes["batch"] * (shapes["hidden"] + shapes["inner"] // WORLD) * 4


BACKGROUND = {
    "cpu_results": Job(
        ("-c", "import sys, torch; from dist_workers import cpu_worker, spawn; "
               f"torch.save(spawn(cpu_worker, {WORLD}, 'cpu'), sys.argv[1])", "{out}"),
        pythonpath=(TESTS.parent, TESTS), timeout=600, enabled=dist.is_available(),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def cpu_results():
    """What each rank's dist_workers.cpu_worker returned."""
    result = output(__name__, "cpu_results")
    assert result.code == 0, result.stdout + result.stderr
    return torch.load(result.out, weights_only=False)


def part(cpu_results, name):
    """What each rank's ``name`` worker returned (see dist_workers.cpu_worker)."""
    for rank, r in enumerate(cpu_results):
        if isinstance(r[name], dict) and "error" in r[name]:
            raise RuntimeError(f"rank {rank} failed in {name}:\n{r[name]['error']}")
    return [r[name] for r in cpu_results]


@pytest.fixture(scope="module")
def fsdp_results(cpu_results):
    return part(cpu_results, "fsdp")


def test_fsdp_parity_either_order_and_context(fsdp_results):
    """50 AdamW steps: losses at every step, gradients (local shards) at steps 0-2 and the final
    parameters equal those without offloading, bitwise, on both ranks."""
    check_fsdp_parity(fsdp_results)
    # the ranks saw different data: the test would notice a rank that silently did nothing
    first = [r["none"]["losses"][0] for r in fsdp_results]
    assert not torch.equal(first[0], first[1])


def test_fsdp_mixed_precision_parity(fsdp_results):
    check_fsdp_parity(fsdp_results, modes=("mixed_after",), base="mixed_none")


def test_fsdp_offloads_activations_only(fsdp_results):
    """Per step, each rank offloads exactly the bytes an unsharded copy of the model offloads
    on the same batch: FSDP's unsharded parameters (all-gather outputs) are never copied."""
    check_offloaded_bytes_match_unsharded(fsdp_results)
    for r in fsdp_results:
        for mode in ("after", "context"):
            assert r[mode]["skip_reasons"].get("parameter", 0) > 0  # they were seen, and kept


def test_fsdp_no_extra_collective(fsdp_results):
    for r in fsdp_results:
        base = r["none"]["comm"]
        assert base and sum(base.values()) > 0
        for mode in ("after", "before", "context"):
            assert r[mode]["comm"] == base, mode


def test_fsdp_no_leak_over_steps(fsdp_results):
    """Every host block is back in the pool after each step, and the pool stops growing after
    the first step."""
    for r in fsdp_results:
        for mode in ("after", "before", "context"):
            pool = r[mode]["pool"]
            assert len(pool) == STEPS
            assert all(used == 0 for used, _ in pool), mode
            reserved = {res for _, res in pool[1:]}
            assert len(reserved) == 1 and pool[0][1] > 0, (mode, sorted(reserved))


@pytest.fixture(scope="module")
def tp_results(cpu_results):
    return part(cpu_results, "tp")


@pytest.mark.parametrize("local_output", [True, False])
@pytest.mark.parametrize("mode", ["layers", "context"])
def test_tp_parity(tp_results, local_output, mode):
    check_tp_parity(tp_results, local_output, mode)


@pytest.mark.parametrize("local_output", [True, False])
def test_tp_offloads_local_shards(tp_results, local_output):
    """DTensor activations are taken apart and only their local shards are copied.

    Per layer, the activations that are not parameters are: the layer input x (replicated, so
    its local tensor is the full [batch, hidden]) and the ReLU output (sharded on the inner
    dimension: [batch, inner / world] per rank), which both the ReLU and the row-parallel
    linear save. A copy of whole DTensors would move [batch, inner] for the second."""
    for r in tp_results:
        expected = tp_local_shard_bytes(r["shapes"])
        for mode in ("layers", "context"):
            stats = r[(local_output, mode)]["stats"]
            assert stats["composite_tensors"] > 0
            assert stats["offloaded_bytes"] == expected, (mode, stats)


def test_offloaded_optimizer_under_fsdp2_two_ranks(cpu_results):
    """Each rank offloads its own shards' state; training is bitwise the plain AdamW on the
    same FSDP2 model (fp32, gradient accumulation, clip_grad_norm_ before step)."""
    check_offloaded_optimizer_parity(part(cpu_results, "optimizer"))


def check_offloaded_optimizer_parity(results):
    """Each rank stepped its own shards only, and its losses and shards are bitwise the plain
    optimizer's (dist_workers.offloaded_optimizer_worker)."""
    for rank, r in enumerate(results):
        assert r["host_numel"] == r["local_numel"]  # its shards only
        for a, b in zip(r["plain"]["losses"], r["host"]["losses"], strict=True):
            assert torch.equal(a, b), rank
        for a, b in zip(r["plain"]["params"], r["host"]["params"], strict=True):
            assert torch.equal(a, b), rank
        assert r["stats"].steps == 4
    total = sum(r["local_numel"] for r in results)
    assert results[0]["local_numel"] < total  # sharded: no rank holds everything


def test_offloaded_optimizer_distributed_checkpoint(cpu_results):
    """torch.distributed.checkpoint under FSDP2: the optimizer state dict holds DTensors, as
    the plain class's does (plain tensors of local shards were saved as if replicated: each
    rank loaded shards of the other's state); the gathered state is the plain AdamW's, and
    training resumed from the checkpoint ends bitwise where plain AdamW's does."""
    check_distributed_checkpoint(part(cpu_results, "dcp"))


def check_distributed_checkpoint(results) -> None:
    for rank, r in enumerate(results):
        assert r["host"]["types"] == r["plain"]["types"], rank
        plain, host = r["plain"]["full"], r["host"]["full"]
        assert plain.keys() == host.keys()
        for key, state in plain.items():
            for name, value in state.items():
                assert torch.equal(value, host[key][name]), (rank, key, name)
        for a, b in zip(r["plain"]["params"], r["host"]["params"], strict=True):
            assert torch.equal(a, b), rank


def test_offloaded_optimizer_distributed_checkpoint_keeps_the_fp32_masters(cpu_results):
    """A bf16 FSDP2 model's OffloadedOptimizer keeps fp32 masters; resumed from a
    torch.distributed.checkpoint (which keeps only "state" and "param_groups", nested or
    flattened) after 2 of 4 steps, it ends bitwise where the uninterrupted run does, on every
    rank. With the masters in a top-level "master_params" DCP dropped them, they were rebuilt
    from the bf16 parameters, and every parameter differed on both ranks."""
    check_resumed_from_dcp(part(cpu_results, "dcp_bf16"))


def check_resumed_from_dcp(results) -> None:
    """Each rank's parameters resumed from DCP (nested and flattened) are bitwise the
    uninterrupted run's."""
    for rank, r in enumerate(results):
        for how in ("nested", "flat"):
            for i, (a, b) in enumerate(zip(r["whole"], r[how], strict=True)):
                assert a.dtype == torch.bfloat16
                assert torch.equal(a, b), (rank, how, i)
