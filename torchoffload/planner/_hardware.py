"""The machine the cost model prices: link, matmul and memory rates and host costs, measured
on this machine's GPU (`Hardware.detect`) or the defaults of one H200."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchoffload._validate import check_number
from torchoffload.planner._trace import ATTENTION, MATMUL, MEMORY, trace

_log = logging.getLogger(__name__)

# -- the machine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What the time model needs; see Note: [How a plan changes time]. The defaults are what
    `detect` measured on one H200 of the GPU machine (torch 2.11, CUDA 13): pinned copies
    55.4 GB/s each way, a bf16 8192^3 matmul at 801 TFLOP/s, an elementwise add at 4223 GB/s,
    and the host times of tiny blocks (planner validation run 5,
    benchmarks/log/2026-11-21-planner-validation-h200.md; the host times of two machines of
    that kind differed by up to 2x).
    The three efficiencies are the shares of those rates that a training step's matmuls,
    attention kernels and memory-bound ops reached there, read from `torch.profiler`'s
    per-kernel times of the GPT steps in `benchmarks/planner.py`; ``kernel_us`` is what the
    measured baseline steps of those shapes took beyond the roofline, per kernel (fitted, not
    measured by `detect`). The ``host_us_*`` fields are the CPU time that eager PyTorch spends
    launching work (per op, and what checkpointing and the engine add), which bounds a step
    of small kernels."""

    link_gbps: float = 55.4
    compute_tflops: float = 801.0
    hbm_gbps: float = 4223.0
    efficiency: float = 0.9  # matmuls, of compute_tflops
    attention_efficiency: float = 0.45  # fused attention kernels, of compute_tflops
    memory_efficiency: float = 0.7  # memory-bound ops, of hbm_gbps
    kernel_us: float = 9.0  # device time per launched kernel beyond its roofline (fitted)
    host_us_fwd: float = 16.3  # per forward op (Python modules, dispatcher, launch)
    host_us_bwd: float = 11.1  # per backward op (the autograd engine, in C++)
    host_us_saved: float = 324.0  # per storage the layer-aware engine offloads (hooks, copies)
    host_us_layer: float = 295.0  # per layer and step, the layer-aware engine's hooks
    host_us_checkpoint_fwd: float = 48.5  # per storage a checkpointed layer saves, in forward
    host_us_checkpoint_bwd: float = 75.7  # and in backward, beyond replaying its ops
    workspace_bytes: int = 64 << 20  # cuBLAS/attention workspaces the allocator holds
    # What a plan keeps free below its budget for what the model does not count: Note:
    # [The planning margin] (measured prediction errors, not measured by `detect`).
    margin_bytes: int = 32 << 20
    margin_fraction: float = 0.01  # of the budget
    # The host optimizer (OffloadedOptimizer): a fused fp32 AdamW step on the H100 machine's 16
    # cores took 754-921 ms over 3.21 B parameters, and a host fp32 triad moved 75-94 GB/s
    # (benchmarks/optim.py, two machines). Not measured by `detect`.
    host_adam_params_per_s: float = 3.5e9
    host_memory_gbps: float = 75.0
    source: str = "defaults (one H200)"

    def __post_init__(self) -> None:
        for name in ("link_gbps", "compute_tflops", "hbm_gbps"):
            check_number(f"Hardware.{name}", getattr(self, name))
        for name in ("efficiency", "attention_efficiency", "memory_efficiency"):
            check_number(f"Hardware.{name}", getattr(self, name), maximum=1.0)
        for name in (
            "kernel_us", "host_us_fwd", "host_us_bwd", "host_us_saved", "host_us_layer",
            "host_us_checkpoint_fwd", "host_us_checkpoint_bwd", "workspace_bytes", "margin_bytes",
        ):  # fmt: skip
            check_number(f"Hardware.{name}", getattr(self, name), positive=False)
        for name in ("host_adam_params_per_s", "host_memory_gbps"):
            check_number(f"Hardware.{name}", getattr(self, name), positive=False)
        check_number("Hardware.margin_fraction", self.margin_fraction, positive=False,
                     maximum=0.5)  # fmt: skip

    def margin(self, budget_bytes: int) -> int:
        """The bytes a plan keeps free below ``budget_bytes``: Note: [The planning margin]."""
        return int(self.margin_bytes + self.margin_fraction * budget_bytes)

    @property
    def flops_per_s(self) -> float:
        return self.compute_tflops * 1e12 * self.efficiency

    def op_seconds(self, ops: Sequence[tuple[int, int, int]], flops: int = 0) -> float:
        """Device time of traced ops, each at the slower of its FLOPs and its memory traffic
        (a roofline per op, at the rate of its kind); ``flops`` alone at the matmul rate when
        no ops were traced (a synthetic profile)."""
        if not ops:
            return flops / self.flops_per_s
        peak = self.compute_tflops * 1e12
        rates = {MATMUL: peak * self.efficiency, ATTENTION: peak * self.attention_efficiency}
        rates[MEMORY] = rates[MATMUL]
        bw = self.hbm_gbps * 1e9 * self.memory_efficiency
        kernels = sum(1 for f, b, _ in ops if f or b)  # views and allocations launch nothing
        return sum(max(f / rates[k], b / bw) for f, b, k in ops) + kernels * self.kernel_us * 1e-6

    @classmethod
    def detect(
        cls, link_gbps: float | None = None, compute_tflops: float | None = None
    ) -> Hardware:
        """Measured on this machine's GPU when there is one (about a second), else the
        defaults; explicit values win. The efficiencies keep their defaults."""
        measured: dict[str, float] = {}
        source = "defaults (one H200)"
        if torch.cuda.is_available():
            measured = measure_cuda()
            measured.update(measure_host(torch.device("cuda", torch.cuda.current_device())))
            source = f"measured on {torch.cuda.get_device_name()}"
        if link_gbps is not None:
            measured["link_gbps"] = link_gbps
        if compute_tflops is not None:
            measured["compute_tflops"] = compute_tflops
        return cls(**measured, source=source)


def measure_cuda() -> dict[str, float]:
    """Link, matmul and memory rates, and host time per op, on the current GPU."""
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(n, dtype=torch.uint8, device=dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    x = buf.view(torch.bfloat16)
    y, z = torch.empty_like(x), torch.empty_like(x)

    def timed(fn, reps: int) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    h2d = timed(lambda: buf.copy_(host, non_blocking=True), 4)
    d2h = timed(lambda: host.copy_(buf, non_blocking=True), 4)
    mm = timed(lambda: a @ a, 10)
    add = timed(lambda: torch.add(x, y, out=z), 10)  # reads two, writes one
    out = {
        "link_gbps": n / max(h2d, d2h) / 1e9,
        "compute_tflops": 2 * 8192**3 / mm / 1e12,
        "hbm_gbps": 3 * n / add / 1e9,
    }
    return out


class _TinyBlock(nn.Module):
    """A pre-norm transformer block (attention, then a GELU MLP): the ops of the layers the
    cost model prices, at a size whose kernels take less time than their launch."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class _TinyStack(nn.Module):
    def __init__(self, hidden: int, layers: int, heads: int):
        super().__init__()
        self.layers = nn.ModuleList(_TinyBlock(hidden, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def measure_host(dev: torch.device, *, reps: int = 30, rounds: int = 3) -> dict[str, float]:
    """CPU time of a step of tiny blocks, whose kernels take less time than their launch: per
    forward and backward op, what the layer-aware engine adds per layer and per offloaded
    storage, and what checkpointing adds per saved storage (the median of ``rounds`` rounds
    of ``reps`` steps each)."""
    import statistics
    import time

    from torchoffload._modules import checkpointed
    from torchoffload._pool import PinnedPool
    from torchoffload.layers import ActivationOffloadConfig, apply_activation_offloading

    torch.manual_seed(0)
    model = _TinyStack(64, 12, heads=2).to(dev)
    x = torch.randn(2, 16, 64, device=dev)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean()

    profile = trace(model, (x,), layers=model.layers, loss_fn=loss_fn, optimizer="none")
    n_fwd = sum(len(layer.fwd_ops) for layer in profile.layers) + len(profile.outside_fwd_ops)
    n_bwd = sum(len(layer.bwd_ops) for layer in profile.layers) + len(profile.outside_bwd_ops)

    warm = 5
    nlayers = len(model.layers)
    pool = PinnedPool(64 << 20, slab_bytes=16 << 20, pin_memory=dev.type == "cuda")
    hooks_only = ActivationOffloadConfig(skip_last_layers=nlayers, time_waits=False)
    offload_all = ActivationOffloadConfig(min_bytes=0, skip_last_layers=0, time_waits=False)
    counted: list[float] = []

    @contextlib.contextmanager
    def engine(cfg: ActivationOffloadConfig) -> Iterator[None]:
        with apply_activation_offloading(model, layers=model.layers, config=cfg, pool=pool) as h:
            yield
            if cfg is offload_all:  # storages offloaded per step
                st = h.stats()
                counted.append((st.offloaded_tensors - st.shared_storage_tensors) / (warm + reps))

    configs = {
        "none": contextlib.nullcontext,
        "hooks": lambda: engine(hooks_only),  # the engine on every layer, nothing offloaded
        "offload": lambda: engine(offload_all),  # every storage of every layer offloaded
        "checkpoint": lambda: checkpointed(model.layers),  # every layer checkpointed
    }

    sync = torch.get_device_module(dev.type).synchronize

    def step_times() -> tuple[float, float]:
        fwd, bwd = [], []
        for _ in range(warm + reps):
            sync(dev)
            t0 = time.perf_counter()
            loss = loss_fn(model(x))
            sync(dev)
            t1 = time.perf_counter()
            loss.backward()
            model.zero_grad(set_to_none=True)
            sync(dev)
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
        return statistics.median(fwd[warm:]), statistics.median(bwd[warm:])

    # Round-robin, median over rounds: the host's speed drifts by up to a fifth within a run.
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    try:
        for _ in range(rounds):
            for key, ctx in configs.items():
                with ctx():
                    times[key].append(step_times())
    finally:
        pool.release()
    med = {key: [statistics.median(t[k] for t in ts) for k in (0, 1)] for key, ts in times.items()}
    (f0, b0), (fh, bh), (fo, bo), (fc, bc) = (
        med[key] for key in ("none", "hooks", "offload", "checkpoint")
    )
    storages = statistics.median(counted)
    # checkpointing: what it costs beyond replaying the ops, per storage the layers save
    replay = sum(x.recompute_ops for x in profile.layers) * f0 / n_fwd
    saved = max(sum(len(x.saved_tensors) for x in profile.layers), 1)
    return {
        "host_us_fwd": f0 / n_fwd * 1e6,
        "host_us_bwd": b0 / n_bwd * 1e6,
        "host_us_layer": max((fh + bh - f0 - b0) / nlayers * 1e6, 0.0),
        "host_us_saved": max((fo + bo - fh - bh) / max(storages, 1) * 1e6, 0.0),
        "host_us_checkpoint_fwd": max((fc - f0) / saved * 1e6, 0.0),
        "host_us_checkpoint_bwd": max((bc - b0 - replay) / saved * 1e6, 0.0),
    }
