"""Multi-process workers for the distributed tests (FSDP2 and tensor parallel).

`spawn` starts ``world`` processes (gloo on CPU, NCCL on CUDA), runs a worker in each and
returns what each rank returned. Workers live in this module so that spawned children can import
them; the tests in test_distributed.py (CPU) and test_distributed_gpu.py (two GPUs) assert on
the results.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torchoffload
from torchoffload.models import GPT, GPTConfig


def spawn(worker, world: int, device: str = "cpu", **kwargs: Any) -> list[Any]:
    """Run ``worker(rank, world, device, **kwargs)`` in ``world`` fresh processes (gloo on
    ``device="cpu"``, NCCL and one GPU each on ``"cuda"``); return what each rank returned."""
    if device == "cuda" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} ranks on CUDA need {world} GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, device, tmp, worker, kwargs), nprocs=world, join=True)
        results = []
        for rank in range(world):
            result = torch.load(os.path.join(tmp, f"rank{rank}.pt"), weights_only=False)
            if isinstance(result, dict) and "error" in result:
                raise RuntimeError(f"rank {rank} failed:\n{result['error']}")
            results.append(result)
        return results


def loopback_env() -> dict[str, str]:
    """Gloo on the loopback interface: CI containers may have a hostname that does not resolve."""
    import socket

    names = {name for _, name in socket.if_nameindex()}
    return {"GLOO_SOCKET_IFNAME": "lo"} if "lo" in names else {}


def _entry(rank: int, world: int, device: str, tmp: str, worker, kwargs) -> None:
    cuda = device == "cuda"
    if not cuda:
        for key, value in loopback_env().items():
            os.environ.setdefault(key, value)
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{os.path.join(tmp, 'store')}",
        rank=rank,
        world_size=world,
        **({"device_id": torch.device("cuda", rank)} if cuda else {}),
    )
    try:
        result = worker(rank, world, device, **kwargs)
    except Exception:
        result = {"error": traceback.format_exc()}
    finally:
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))


# -- FSDP2 --------------------------------------------------------------------------------------

CPU_GPT = GPTConfig(hidden=64, layers=3, heads=2, vocab=128, max_seq=33)
GPU_GPT = GPTConfig(hidden=256, layers=4, heads=4, vocab=512, max_seq=257)


def _fsdp_model(config: GPTConfig, device: str, mixed: bool) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(config).to(device)
    kw = {}
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().cpu().clone()


def fsdp_scenario(
    rank: int,
    world: int,
    device: str,
    mode: str,
    *,
    steps: int,
    config: GPTConfig,
    batch: int,
    mixed: bool = False,
    min_bytes: int = 0,
    keep_grads: tuple[int, ...] = (0, 1, 2),
) -> dict[str, Any]:
    """Train a GPT under FSDP2 for ``steps`` steps with offloading applied as ``mode`` says:
    "none", "after" (fully_shard, then apply_activation_offloading), "before" (the other
    order) or "context" (offload_activations around forward)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    pool = torchoffload.PinnedPool(256 << 20, slab_bytes=16 << 20, pin_memory=device == "cuda")
    cfg = torchoffload.ActivationOffloadConfig(min_bytes=min_bytes, skip_last_layers=1)
    handle = None
    if mode == "before":
        torch.manual_seed(0)
        model = GPT(config).to(device)
        handle = torchoffload.apply_activation_offloading(model, config=cfg, pool=pool)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = _fsdp_model(config, device, mixed)
        if mode == "after":
            handle = torchoffload.apply_activation_offloading(model, config=cfg, pool=pool)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    out: dict[str, Any] = {
        "losses": [],
        "grads": {},
        "comm": None,
        "pool": [],
        "device_mem": [],
        "syncs": [],
    }
    ctx_stats = []
    for step in range(steps):
        tokens = torch.randint(0, config.vocab, (batch, config.max_seq), generator=gen).to(device)
        comm = CommDebugMode() if step == 1 else contextlib.nullcontext()
        with comm, _count_syncs(device) as syncs:
            if mode == "context":
                with torchoffload.offload_activations(min_bytes=min_bytes, pool=pool) as ctx:
                    loss = model.loss(tokens)
            else:
                loss = model.loss(tokens)
            loss.backward()
        out["syncs"].append(len(syncs))
        if step == 1:
            out["comm"] = {str(k): v for k, v in comm.get_comm_counts().items()}
        if mode == "context":
            ctx_stats.append(ctx.stats())
        out["losses"].append(loss.detach().cpu())
        if step in keep_grads:
            out["grads"][step] = [_local(p.grad) for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        ps = pool.stats()
        out["pool"].append((ps.used_bytes, ps.reserved_bytes))
        if device == "cuda":
            torch.cuda.synchronize()
            out["device_mem"].append(torch.cuda.memory_allocated())
    out["params"] = [_local(p) for p in model.parameters()]
    if handle is not None:
        s = handle.stats()
        out["offloaded_bytes_per_step"] = s.offloaded_bytes // steps
        out["skip_reasons"] = s.skip_reasons
        handle.remove()
    elif ctx_stats:
        out["offloaded_bytes_per_step"] = ctx_stats[-1].offloaded_bytes
        out["skip_reasons"] = ctx_stats[-1].skip_reasons
    return out


@contextlib.contextmanager
def _count_syncs(device: str):
    """The host syncs CUDA reports inside the block (``set_sync_debug_mode("warn")``)."""
    caught: list[Any] = []
    if device != "cuda":
        yield caught
        return
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")
    caught.extend(str(x.message) for x in w if "synchroniz" in str(x.message))


def plain_offloaded_bytes(config: GPTConfig, device: str, batch: int, mode: str) -> int:
    """Bytes one step offloads on an unsharded copy of the model (what FSDP runs should match)."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    pool = torchoffload.PinnedPool(256 << 20, slab_bytes=16 << 20, pin_memory=device == "cuda")
    tokens = torch.randint(0, config.vocab, (batch, config.max_seq)).to(device)
    if mode == "context":
        with torchoffload.offload_activations(min_bytes=0, pool=pool) as ctx:
            loss = model.loss(tokens)
        loss.backward()
        return ctx.stats().offloaded_bytes
    cfg = torchoffload.ActivationOffloadConfig(min_bytes=0, skip_last_layers=1)
    with torchoffload.apply_activation_offloading(model, config=cfg, pool=pool) as handle:
        model.loss(tokens).backward()
        return handle.stats().offloaded_bytes


def fsdp_worker(rank: int, world: int, device: str, *, steps: int = 50) -> dict[str, Any]:
    """Every FSDP2 scenario in one process group (spawning is the slow part)."""
    gpu = device == "cuda"
    config = GPU_GPT if gpu else CPU_GPT
    batch = 4 if gpu else 2
    kw = dict(steps=steps, config=config, batch=batch, min_bytes=0)
    results: dict[str, Any] = {}
    deterministic = _deterministic() if gpu else contextlib.nullcontext()
    with deterministic:
        results["none"] = fsdp_scenario(rank, world, device, "none", **kw)
        if gpu:  # the baseline against itself first: is the GPU run deterministic at all?
            results["none_again"] = fsdp_scenario(rank, world, device, "none", **kw)
        for mode in ("after", "before", "context"):
            results[mode] = fsdp_scenario(rank, world, device, mode, **kw)
        mixed = dict(kw, mixed=True, steps=3)
        results["mixed_none"] = fsdp_scenario(rank, world, device, "none", **mixed)
        results["mixed_after"] = fsdp_scenario(rank, world, device, "after", **mixed)
        if gpu:  # positive control: the sync counter does see a host sync
            with _count_syncs(device) as syncs:
                torch.ones(1, device=device).item()
            results["sync_control"] = len(syncs)
        results["plain_bytes"] = {
            mode: plain_offloaded_bytes(config, device, batch, mode)
            for mode in ("after", "context")
        }
    return results


@contextlib.contextmanager
def _deterministic():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(False)


# -- tensor parallel ------------------------------------------------------------------------------


class FeedForward(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No residual: the next layer's input is then the row-parallel output itself, which
        # is an AsyncCollectiveTensor (see Note: [Async collective results are waited on
        # before they are read] in _flatten.py).
        return self.down(torch.relu(self.up(x)))


class FeedForwardStack(nn.Module):
    def __init__(self, hidden: int = 32, inner: int = 128, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(FeedForward(hidden, inner) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def tp_worker(rank: int, world: int, device: str) -> dict[str, Any]:
    """Column- then row-parallel linears; with and without offloading, both layouts of the
    row-parallel output (a local tensor, or a DTensor kept distributed)."""
    from torch.distributed.device_mesh import init_device_mesh

    with _deterministic() if device == "cuda" else contextlib.nullcontext():
        return _tp_scenarios(device, init_device_mesh(device, (world,)))


def _tp_scenarios(device: str, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    hidden, inner, layers, batch = 32, 128, 3, 8
    results: dict[str, Any] = {}
    for local_output in (True, False):
        for mode in ("none", "layers", "context"):
            torch.manual_seed(0)
            model = FeedForwardStack(hidden, inner, layers).to(device)
            plan = {}
            for i in range(layers):
                plan[f"layers.{i}.up"] = ColwiseParallel()
                plan[f"layers.{i}.down"] = RowwiseParallel(use_local_output=local_output)
            parallelize_module(model, mesh, plan)
            x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(5)).to(device)
            pool = torchoffload.PinnedPool(
                64 << 20, slab_bytes=8 << 20, pin_memory=device == "cuda"
            )
            cfg = torchoffload.ActivationOffloadConfig(min_bytes=0, skip_last_layers=0)
            stats = None
            if mode == "layers":
                with torchoffload.apply_activation_offloading(model, config=cfg, pool=pool) as h:
                    y = model(x)
                    y = y.full_tensor() if isinstance(y, DTensor) else y
                    y.square().sum().backward()
                    stats = h.stats()
            elif mode == "context":
                with torchoffload.offload_activations(min_bytes=0, pool=pool) as ctx:
                    y = model(x)
                y = y.full_tensor() if isinstance(y, DTensor) else y
                y.square().sum().backward()
                stats = ctx.stats()
            else:
                y = model(x)
                y = y.full_tensor() if isinstance(y, DTensor) else y
                y.square().sum().backward()
            results[(local_output, mode)] = {
                "out": y.detach().cpu(),
                "grads": [_local(p.grad) for p in model.parameters()],
                "stats": None if stats is None else stats.as_dict(),
            }
    results["shapes"] = {"hidden": hidden, "inner": inner, "layers": layers, "batch": batch}
    return results


# -- OffloadedOptimizer under FSDP2 -------------------------------------------------------------


class _ShardsOnHost:
    """The reference on CUDA: the plain optimizer class steps fp32 host copies of this rank's
    local shards (the same tensors `OffloadedOptimizer` steps), and the shards receive the
    results. On CPU the plain class steps the shards themselves."""

    def __init__(self, params: list[torch.Tensor], cls, **kw: Any) -> None:
        self.params = params
        self.masters = [_shard(p).detach().float().cpu() for p in params]
        self.opt = cls(self.masters, **kw)

    def step(self) -> None:
        for m, p in zip(self.masters, self.params, strict=True):
            m.grad = _shard(p.grad).float().cpu()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params, strict=True):
                _shard(p).copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's local part of ``t`` (itself if it is not a DTensor), sharing its storage."""
    return t.to_local() if hasattr(t, "to_local") else t


def offloaded_optimizer_worker(rank: int, world: int, device: str, *, steps: int = 4) -> dict:
    """The same FSDP2 GPT (fp32) trained with plain AdamW and with OffloadedOptimizer (AdamW on
    the host over this rank's shards), with a gradient accumulation of two micro-batches and
    clip_grad_norm_ before each step. Plain AdamW steps the shards on CPU and fp32 host copies
    of them on CUDA (`_ShardsOnHost`: the GPU's AdamW kernels round differently from the host's).
    Returns losses and local parameters."""
    out: dict[str, Any] = {}
    kw = dict(lr=1e-2, weight_decay=0.1)
    for mode in ("plain", "host"):
        model = _fsdp_model(CPU_GPT if device == "cpu" else GPU_GPT, device, mixed=False)
        params = list(model.parameters())
        if mode == "host":
            opt = torchoffload.OffloadedOptimizer(  # one thread, as the process (_entry)
                params, torch.optim.AdamW, **kw, bucket_bytes=4096, host_threads=1
            )
            out["host_numel"] = sum(r.entry.numel for r in opt._runtime.records)
        elif device == "cpu":
            opt = torch.optim.AdamW(params, **kw, foreach=False)
        else:
            opt = _ShardsOnHost(params, torch.optim.AdamW, **kw, foreach=False)
        out["local_numel"] = sum(_local(p).numel() for p in params)
        g = torch.Generator().manual_seed(rank)
        cfg = CPU_GPT if device == "cpu" else GPU_GPT
        losses = []
        with _deterministic() if device == "cuda" else contextlib.nullcontext():
            for _ in range(steps):
                for micro in range(2):
                    x = torch.randint(0, cfg.vocab, (2, 32), generator=g).to(device)
                    loss = model.loss(x)
                    losses.append(loss.detach().cpu())
                    if micro == 0 and mode == "host":
                        with opt.accumulating():
                            loss.backward()
                    else:
                        loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                opt.zero_grad()
        out[mode] = {"losses": losses, "params": [_local(p) for p in params]}
        if mode == "host":
            out["stats"] = opt.stats()
            opt.remove()
    return out


# -- torch.distributed.checkpoint with OffloadedOptimizer under FSDP2 ------------------------------

EVEN_GPT = GPTConfig(hidden=64, layers=2, heads=2, vocab=128, max_seq=32)  # every shard even


def _dcp_build(mode: str, device: str, kw: dict[str, Any]) -> tuple[nn.Module, Any]:
    model = _fsdp_model(EVEN_GPT, device, mixed=False)
    if mode == "plain":
        return model, torch.optim.AdamW(model.parameters(), **kw, foreach=False)
    opt = torchoffload.OffloadedOptimizer(
        model.parameters(), torch.optim.AdamW, **kw, bucket_bytes=4096, host_threads=1
    )
    return model, opt


def _dcp_train(model: nn.Module, opt: Any, g: torch.Generator, steps: int) -> None:
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randint(0, EVEN_GPT.vocab, (2, 32), generator=g).to(device)
        model.loss(x).backward()
        opt.step()
        opt.zero_grad()


def dcp_worker(rank: int, world: int, device: str, *, steps: int = 2) -> dict[str, Any]:
    """Train an FSDP2 GPT ``steps`` steps, save model and optimizer with
    `torch.distributed.checkpoint` (``get_model_state_dict``/``get_optimizer_state_dict``,
    ``dcp.save``), load them into a fresh model and optimizer (``dcp.load``,
    ``set_*_state_dict``: the fresh optimizer is stepped once with zero gradients by DCP; then
    the same state again from a per-rank torch.save of its state_dict()) and
    train ``steps`` more; with plain AdamW and with OffloadedOptimizer. Returns each one's
    final local parameters, the full (gathered) optimizer state dict at the save and the types
    of the saved state's tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder)
    out: dict[str, Any] = {}
    kw = dict(lr=1e-2, weight_decay=0.1)
    full = sd.StateDictOptions(full_state_dict=True)
    for mode in ("plain", "host"):
        g = torch.Generator().manual_seed(rank)
        path = os.path.join(holder[0], mode)
        model, opt = _dcp_build(mode, device, kw)
        _dcp_train(model, opt, g, steps)
        osd = sd.get_optimizer_state_dict(model, opt)
        per_rank = io.BytesIO()  # a per-rank checkpoint of the same state too
        torch.save(opt.state_dict(), per_rank)
        dcp.save({"model": sd.get_model_state_dict(model), "optim": osd}, checkpoint_id=path)
        out[mode] = {
            "types": sorted({type(v).__name__ for s in osd["state"].values() for v in s.values()}),
            "full": sd.get_optimizer_state_dict(model, opt, options=full)["state"],
        }
        if mode == "host":
            opt.remove()
        model, opt = _dcp_build(mode, device, kw)
        state = {
            "model": sd.get_model_state_dict(model),
            "optim": sd.get_optimizer_state_dict(model, opt),
        }
        dcp.load(state, checkpoint_id=path)
        sd.set_model_state_dict(model, state["model"])
        sd.set_optimizer_state_dict(model, opt, state["optim"])
        per_rank.seek(0)
        opt.load_state_dict(torch.load(per_rank, weights_only=False))  # the same state again
        _dcp_train(model, opt, g, steps)
        out[mode]["params"] = [_local(p) for p in model.parameters()]
        if mode == "host":
            opt.remove()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(holder[0])
    return out


def _bf16_build(device: str) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(EVEN_GPT).to(device, torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torchoffload.OffloadedOptimizer(  # fp32 masters of the bf16 shards on the host
        model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=4096, host_threads=1
    )
    return model, opt


def dcp_bf16_worker(rank: int, world: int, device: str, *, steps: int = 2) -> dict[str, Any]:
    """A bf16 FSDP2 GPT with OffloadedOptimizer (fp32 masters on the host) trained 2 * ``steps``
    steps, and again resumed after ``steps`` from a `torch.distributed.checkpoint` of model
    and optimizer (nested and flattened optimizer state dicts): the final local parameters of
    each. The checkpoint holds only "state" and "param_groups": the masters must be there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder)
    model, opt = _bf16_build(device)
    g = torch.Generator().manual_seed(rank)
    _dcp_train(model, opt, g, 2 * steps)
    out: dict[str, Any] = {"whole": [_local(p) for p in model.parameters()]}
    opt.remove()
    for flatten in (False, True):
        options = sd.StateDictOptions(flatten_optimizer_state_dict=flatten)
        path = os.path.join(holder[0], f"bf16-{flatten}")
        model, opt = _bf16_build(device)
        g = torch.Generator().manual_seed(rank)
        _dcp_train(model, opt, g, steps)
        state = {"model": sd.get_model_state_dict(model),
                 "optim": sd.get_optimizer_state_dict(model, opt, options=options)}  # fmt: skip
        dcp.save(state, checkpoint_id=path)
        opt.remove()
        model, opt = _bf16_build(device)
        state = {"model": sd.get_model_state_dict(model),
                 "optim": sd.get_optimizer_state_dict(model, opt, options=options)}  # fmt: skip
        dcp.load(state, checkpoint_id=path)
        sd.set_model_state_dict(model, state["model"])
        sd.set_optimizer_state_dict(model, opt, state["optim"], options=options)
        _dcp_train(model, opt, g, steps)
        out["flat" if flatten else "nested"] = [_local(p) for p in model.parameters()]
        opt.remove()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(holder[0])
    return out


# -- every CPU worker in one spawn ----------------------------------------------------------------

CPU_PARTS = ("fsdp", "tp", "optimizer", "dcp", "dcp_bf16")


def cpu_worker(rank: int, world: int, device: str) -> dict[str, Any]:
    """`fsdp_worker`, `tp_worker` and `offloaded_optimizer_worker` one after the other in one
    process group: on CPU, starting the processes (each imports torch) costs about 5 s a spawn,
    as much as the tensor-parallel work. Each part's result, or its error, under its name; the
    ranks agree after each part whether to go on (a part that failed on one rank would leave
    the other in a different collective)."""
    workers = {
        "fsdp": fsdp_worker,
        "tp": tp_worker,
        "optimizer": offloaded_optimizer_worker,
        "dcp": dcp_worker,
        "dcp_bf16": dcp_bf16_worker,
    }
    out: dict[str, Any] = {}
    for name in CPU_PARTS:
        try:
            out[name] = workers[name](rank, world, device)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        failed = torch.tensor([int(isinstance(out[name], dict) and "error" in out[name])])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            for later in CPU_PARTS[len(out) :]:
                out[later] = {"error": f"not run: part {name!r} failed on a rank"}
            break
    return out
