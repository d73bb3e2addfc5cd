"""Know before you run: trace one training step under fake tensors, then choose per layer
between keeping, offloading, recomputing, and recomputing with the input offloaded, to meet a
memory budget at the least predicted step time.

::

    plan = torchoffload.plan(model, (tokens,), budget_bytes=40 << 30)
    print(plan)                                   # per layer: bytes, FLOPs, decision; predictions
    handle = torchoffload.apply_activation_offloading(model, plan=plan)
    plan.plot("memory.png")                       # memory over one step, baseline vs plan

Nothing is allocated: parameters, inputs and every intermediate are fake tensors (shapes,
dtypes and storages without memory), so a 70B-parameter model traces on a laptop.

The trace is in `torchoffload._trace` (Note: [What the trace records]).

Note: [How a plan changes memory]
Offloading layer i removes its eligible saved storages from the device from the end of layer
i + defer_layers' forward until the backward of layer i + prefetch_layers starts (where the
layer-aware engine frees and reloads them). Recomputing layer i removes every storage it saved,
except its input, from the end of its forward until its backward starts. "recompute+offload"
also offloads that input: non-reentrant checkpointing saves a layer's inputs through the
saved-tensor hooks outside it, which are the engine's, so the input leaves and comes back in
the offloading window. Between two markers the live bytes of the baseline trace are shifted by
what the plan removes there, so the predicted peak is the largest shifted value; it takes one
pass over the markers, not a new trace.

Note: [How a plan changes time]
Each traced op takes the slower of its FLOPs at the rate of its kind (matmul or attention) and
its bytes at the achieved memory bandwidth, plus ``kernel_us`` per launched kernel (the gaps
and small-tile losses a roofline misses). The host launches the ops (``host_us_*`` per op, per
checkpointed storage, per copied storage, and per layer while the layer-aware engine is
installed) and runs ahead of the device, which cannot finish a layer before the host has
launched it: the device's clock after layer j is max(its clock before plus the layer's device
time, the host's clock after launching layer j). Small layers are so bound by the host; a
layer with spare device time absorbs the host time of its neighbours. Copies take bytes over
``link_gbps``. Forward: layer j cannot start until the copies of layer j - defer_layers - 1 are
done (the engine's deferred release waits on them). Backward: the reloads of layer i are
issued when the backward of layer i + prefetch_layers starts, wait for the compute issued
before them (the engine orders each reload after the compute stream), and layer i's backward
waits for them; a recomputed layer adds the forward ops up to its last saved tensor (where
non-reentrant checkpointing stops). The optimizer step streams parameters, gradients and state
at the memory bandwidth; the code outside the layers is kept as traced.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from torchoffload._trace import ATTENTION, MATMUL, MEMORY, LayerProfile, Profile, trace

__all__ = [
    "Hardware",
    "InfeasibleBudgetError",
    "LayerProfile",
    "Plan",
    "Prediction",
    "Profile",
    "plan",
    "plan_from_profile",
    "synthetic_profile",
    "trace",
]

_log = logging.getLogger(__name__)

# -- the machine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What the time model needs; see Note: [How a plan changes time]. The defaults are what
    `detect` measured on one H200 of the GPU machine (torch 2.11, CUDA 13): pinned copies
    55.4 GB/s each way, a bf16 8192^3 matmul at 801 TFLOP/s, an elementwise add at 4223 GB/s,
    and the host times of tiny blocks (benchmarks/RESULTS.md, planner validation, run 5;
    the host times of two machines of that kind differed by up to 2x).
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
    source: str = "defaults (one H200)"

    def __post_init__(self) -> None:
        for name in (
            "link_gbps", "compute_tflops", "hbm_gbps", "efficiency", "attention_efficiency",
            "memory_efficiency",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"Hardware.{name} must be a positive number, got {value!r}")
        for name in (
            "kernel_us", "host_us_fwd", "host_us_bwd", "host_us_saved", "host_us_layer",
            "host_us_checkpoint_fwd", "host_us_checkpoint_bwd", "workspace_bytes",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(f"Hardware.{name} must be a number >= 0, got {value!r}")

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
            measured = _measure_cuda()
            measured.update(_measure_host(torch.device("cuda", torch.cuda.current_device())))
            source = f"measured on {torch.cuda.get_device_name()}"
        if link_gbps is not None:
            measured["link_gbps"] = link_gbps
        if compute_tflops is not None:
            measured["compute_tflops"] = compute_tflops
        return cls(**measured, source=source)


def _measure_cuda() -> dict[str, float]:
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


def _measure_host(dev: torch.device) -> dict[str, float]:
    """CPU time of a step of tiny blocks, whose kernels take less time than their launch: per
    forward and backward op, what the layer-aware engine adds per layer and per offloaded
    storage, and what checkpointing adds per saved storage."""
    import statistics
    import time

    from torchoffload._modules import checkpointed
    from torchoffload._pool import PinnedPool
    from torchoffload.layers import ActivationOffloadConfig, apply_activation_offloading
    from torchoffload.models import BlockStack

    torch.manual_seed(0)
    model = BlockStack(64, 12, heads=2).to(dev)
    x = torch.randn(2, 16, 64, device=dev)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean()

    profile = trace(model, (x,), layers=model.layers, loss_fn=loss_fn, optimizer="none")
    n_fwd = sum(len(layer.fwd_ops) for layer in profile.layers) + len(profile.outside_fwd_ops)
    n_bwd = sum(len(layer.bwd_ops) for layer in profile.layers) + len(profile.outside_bwd_ops)

    warm, reps, rounds = 5, 30, 3
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

    # Round-robin, median over rounds: the host's speed drifts (benchmarks/RESULTS.md).
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


# -- predictions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    offloaded_bytes: int  # per step, each way


KEEP, OFFLOAD, RECOMPUTE, BOTH = "keep", "offload", "recompute", "recompute+offload"
DECISIONS = (KEEP, OFFLOAD, RECOMPUTE, BOTH)
STREAM = "stream"  # the whole model under `offload_activations` (every layer at once)


class _Model:
    """A profile prepared for fast what-ifs. See Notes: [How a plan changes memory] and
    [How a plan changes time]."""

    def __init__(self, profile: Profile, hw: Hardware, defer: int, prefetch: int):
        self.p, self.hw, self.defer, self.prefetch = profile, hw, defer, prefetch
        n = len(profile.layers)
        self.n = n
        marks = profile.step_marks
        self.bwd_end = marks["backward_end"]
        # Steady state: the optimizer state of earlier steps is live during forward and backward.
        extra = hw.workspace_bytes
        steady = [v + profile.optimizer_bytes + extra for v in profile.timeline[: self.bwd_end + 1]]
        self.opt_peak = max(profile.timeline[self.bwd_end :]) + extra if profile.timeline else 0
        self.steady = steady
        last = len(steady)
        # per layer and decision: (from, to, bytes) the decision removes between two markers
        self.removals: list[dict[str, list[tuple[int, int, int]]]] = []
        self.moved: list[dict[str, int]] = []  # bytes copied each way
        cuts = {0, last}
        for i, layer in enumerate(profile.layers):
            release = profile.fwd_end[i + defer] if i + defer < n else marks["forward_end"]
            reload = profile.bwd_start[min(i + prefetch, n - 1)]
            off = (min(release, last), min(reload, last))
            rec = (min(profile.fwd_end[i], last), min(profile.bwd_start[i], last))
            r = {
                KEEP: [],
                OFFLOAD: [(*off, layer.offloadable_bytes)],
                RECOMPUTE: [(*rec, layer.recompute_bytes)],
                BOTH: [(*rec, layer.recompute_bytes), (*off, layer.input_offloadable_bytes)],
            }
            r = {d: [w for w in ws if w[1] > w[0] and w[2]] for d, ws in r.items()}
            for ws in r.values():
                for a, b, _ in ws:
                    cuts.update((a, b))
            self.removals.append(r)
            self.moved.append(
                {KEEP: 0, OFFLOAD: layer.offloadable_bytes, RECOMPUTE: 0,
                 BOTH: layer.input_offloadable_bytes}
            )  # fmt: skip
        self.cuts = sorted(cuts)
        self.pos = {c: k for k, c in enumerate(self.cuts)}
        self.seg_max = [
            max(steady[a:b]) if b > a else -(1 << 62)
            for a, b in zip(self.cuts, self.cuts[1:], strict=False)
        ]
        gpu, us = hw.op_seconds, 1e-6
        layers = profile.layers
        # Device and host (launch) time of each layer's forward, backward and recomputation;
        # see Note: [How a plan changes time] for how they overlap.
        self.host_f = [len(x.fwd_ops) * hw.host_us_fwd * us for x in layers]
        self.host_b = [len(x.bwd_ops) * hw.host_us_bwd * us for x in layers]
        self.gpu_f = [gpu(x.fwd_ops, x.fwd_flops) for x in layers]
        self.gpu_b = [gpu(x.bwd_ops, x.bwd_flops) for x in layers]
        # what recomputation replays (all of the forward when not traced) and checkpointing's
        # own host time per saved storage, in forward and in backward
        self.gpu_r = [gpu(x.fwd_ops[: x.recompute_ops]) if x.fwd_ops else self.gpu_f[i]
                      for i, x in enumerate(layers)]  # fmt: skip
        self.host_r = [
            (x.recompute_ops * hw.host_us_fwd + len(x.saved_tensors) * hw.host_us_checkpoint_bwd)
            * us
            for x in layers
        ]
        self.ckpt_f = [len(x.saved_tensors) * hw.host_us_checkpoint_fwd * us for x in layers]
        # the offloading engine's host time per storage it copies, half in each direction
        per_copy = hw.host_us_saved * us / 2
        self.hooks = [
            {KEEP: 0.0, RECOMPUTE: 0.0, BOTH: per_copy if x.input_offloadable_bytes else 0.0,
             OFFLOAD: per_copy * sum(1 for _, b in x.saved_tensors if b >= profile.min_bytes)}
            for x in layers
        ]  # fmt: skip
        self.engine_layer = hw.host_us_layer * us / 2  # per layer and pass, once installed
        self.gpu_out_f = gpu(profile.outside_fwd_ops, profile.outside_fwd_flops)
        self.gpu_out_b = gpu(profile.outside_bwd_ops, profile.outside_bwd_flops)
        self.host_out_f = len(profile.outside_fwd_ops) * hw.host_us_fwd * us
        self.host_out_b = len(profile.outside_bwd_ops) * hw.host_us_bwd * us
        moved = profile.param_bytes * 2 + profile.grad_bytes + profile.optimizer_bytes * 2
        bw = hw.hbm_gbps * 1e9 * hw.memory_efficiency
        self.t_opt = moved / bw if profile.optimizer_bytes else 0.0
        self.bw = hw.link_gbps * 1e9

    def peak(self, decisions: Sequence[str]) -> int:
        diff = [0] * (len(self.cuts) + 1)
        for i, d in enumerate(decisions):
            for a, b, amount in self.removals[i][d]:
                diff[self.pos[a]] -= amount
                diff[self.pos[b]] += amount
        best, run = self.opt_peak, 0
        for k, seg in enumerate(self.seg_max):
            run += diff[k]
            best = max(best, seg + run)
        return best

    def timeline(self, decisions: Sequence[str]) -> list[int]:
        """The predicted live bytes after each traced event (forward and backward)."""
        diff = [0] * (len(self.steady) + 1)
        for i, d in enumerate(decisions):
            for a, b, amount in self.removals[i][d]:
                diff[a] -= amount
                diff[b] += amount
        out, run = [], 0
        for k, v in enumerate(self.steady):
            run += diff[k]
            out.append(v + run)
        return out

    def time(self, decisions: Sequence[str]) -> tuple[float, float, float]:
        n, defer, prefetch, bw = self.n, self.defer, self.prefetch, self.bw
        d = [self.moved[i][x] / bw for i, x in enumerate(decisions)]
        # the layer-aware engine is installed only when some layer offloads
        engine = self.engine_layer if any(x in (OFFLOAD, BOTH) for x in decisions) else 0.0
        hook = [self.hooks[i][x] + engine for i, x in enumerate(decisions)]
        rec = [x in (RECOMPUTE, BOTH) for x in decisions]
        # forward: layer j cannot start until the copies of layer j - defer - 1 are done
        host = gpu = copy_free = 0.0
        d2h_end = [0.0] * n
        for j in range(n):
            host += self.host_f[j] + hook[j] + (self.ckpt_f[j] if rec[j] else 0.0)
            start = gpu
            if j - defer - 1 >= 0:
                start = max(start, d2h_end[j - defer - 1])
            if d[j]:
                copy_free = max(copy_free, start) + d[j]
            d2h_end[j] = copy_free
            gpu = max(start + self.gpu_f[j], host)
        host += self.host_out_f
        forward = max(gpu + self.gpu_out_f, host, copy_free)  # the model's end waits for copies
        # backward: head and loss first, then the layers in reverse
        host += self.host_out_b
        end_of = {n: max(forward + self.gpu_out_b, host)}  # device done with layers >= k
        h2d_free = 0.0
        for i in range(n - 1, -1, -1):
            issue = end_of[min(i + prefetch + 1, n)]
            ready = 0.0
            if d[i]:
                h2d_free = max(h2d_free, issue) + d[i]
                ready = h2d_free
            host += self.host_b[i] + hook[i] + (self.host_r[i] if rec[i] else 0.0)
            work = self.gpu_b[i] + (self.gpu_r[i] if rec[i] else 0.0)
            end_of[i] = max(max(end_of[i + 1], ready) + work, host)
        backward = end_of[0] - forward
        return forward, backward, self.t_opt

    def stream(
        self, prefetch_bytes: int = 32 << 20, inflight_bytes: int = 256 << 20
    ) -> tuple[Prediction, list[int]]:
        """`offload_activations` around the whole model: every eligible storage saved in the
        model's forward leaves after its save and comes back just before the op that frees it
        in backward, with ``inflight_bytes`` held in forward and ``prefetch_bytes`` ahead in
        backward; copies bound the step when they take longer than compute. Returns the
        prediction and the timeline."""
        p = self.p
        last = len(self.steady)
        fwd_end = p.step_marks["forward_end"]
        diff = [0] * (last + 1)
        moved = count = 0
        for _, nbytes, saved_at, freed_at, in_model in p.saved_storages:
            if not in_model or nbytes < max(p.min_bytes, 1):
                continue
            moved += nbytes
            count += 1
            a, b = min(saved_at + 1, last), min(max(freed_at - 1, 0), last)
            if b > a:
                diff[a] -= nbytes
                diff[b] += nbytes
        hooks = count * self.hw.host_us_saved * 1e-6 / 2
        copies = moved / self.bw
        fwd = max(sum(self.gpu_f) + self.gpu_out_f, sum(self.host_f) + hooks + self.host_out_f)
        bwd = max(sum(self.gpu_b) + self.gpu_out_b, sum(self.host_b) + hooks + self.host_out_b)
        # Forward holds what is still being copied: up to the in-flight window when the copies
        # are slower than compute, else about one layer's worth. Backward holds the prefetch
        # window plus one storage issued ahead of it (the largest, at worst).
        largest = max(
            (b for _, b, _, _, m in p.saved_storages if m and b >= p.min_bytes), default=0
        )
        layer_bytes = max((x.offloadable_bytes for x in p.layers), default=0)
        behind = inflight_bytes if copies > fwd else min(inflight_bytes, layer_bytes)
        ahead = prefetch_bytes + largest
        timeline, run = [], 0
        for k, v in enumerate(self.steady):
            run += diff[k]
            window = behind if k <= fwd_end else ahead  # at most what is away
            timeline.append(v + run + min(window, -run))
        peak = max([self.opt_peak, *timeline])
        f, b = max(fwd, copies), max(bwd, copies)
        return Prediction(peak, f + b + self.t_opt, f, b, self.t_opt, moved), timeline

    def predict(self, decisions: Sequence[str]) -> Prediction:
        f, b, o = self.time(decisions)
        moved = sum(self.moved[i][x] for i, x in enumerate(decisions))
        return Prediction(self.peak(decisions), f + b + o, f, b, o, moved)


# -- choosing -----------------------------------------------------------------------------------


class InfeasibleBudgetError(ValueError):
    """No plan of keep/offload/recompute per layer meets the budget."""


def _choose(model: _Model, budget: int, allowed: Sequence[str] = DECISIONS) -> list[str]:
    """Greedy: from all-keep, apply the change (among ``allowed``) with the least predicted
    time per byte of peak it removes until the peak fits; then undo changes that are no
    longer needed. The result may not fit when no change helps any more."""
    n = model.n
    decisions = [KEEP] * n
    current = model.predict(decisions)
    moves = {KEEP: (OFFLOAD, RECOMPUTE, BOTH), OFFLOAD: (RECOMPUTE, BOTH), RECOMPUTE: (BOTH,),
             BOTH: ()}  # fmt: skip
    moves = {k: tuple(o for o in v if o in allowed) for k, v in moves.items()}
    while current.peak_bytes > budget:
        best = None
        for i in range(n):
            for option in moves[decisions[i]]:
                trial = decisions.copy()
                trial[i] = option
                pred = model.predict(trial)
                gain = current.peak_bytes - pred.peak_bytes
                if gain <= 0:
                    continue
                cost = max(pred.step_s - current.step_s, 0.0)
                # fewest seconds per byte; among free moves, the one that removes most
                key = (cost / gain, -gain, i)
                if best is None or key < best[0]:
                    best = (key, trial, pred)
        if best is None:
            break
        _, decisions, current = best
    # Undo what the budget no longer needs, latest layers first (they cost the most to move).
    lighter = {KEEP: (), OFFLOAD: (KEEP,), RECOMPUTE: (KEEP, OFFLOAD),
               BOTH: (KEEP, OFFLOAD, RECOMPUTE)}  # fmt: skip
    changed = True
    while changed:
        changed = False
        for i in range(n - 1, -1, -1):
            for option in lighter[decisions[i]]:
                trial = decisions.copy()
                trial[i] = option
                pred = model.predict(trial)
                if pred.peak_bytes <= budget and pred.step_s <= current.step_s:
                    decisions, current, changed = trial, pred, True
                    break
    return decisions


def _least_peak(model: _Model) -> tuple[list[str], int]:
    """The decisions with the least predicted peak, ignoring time: the best uniform plan
    (which wins depends on the windows: offloaded bytes come back a layer early, recomputed
    ones keep the layer's input unless it is offloaded too), then improved one layer at a time
    until no single change lowers the peak."""
    n = model.n
    best = min(([d] * n for d in DECISIONS), key=model.peak)
    peak = model.peak(best)
    improved = True
    while improved:
        improved = False
        for i in range(n):
            for option in DECISIONS:
                if option == best[i]:
                    continue
                trial = best.copy()
                trial[i] = option
                trial_peak = model.peak(trial)
                if trial_peak < peak:
                    best, peak, improved = trial, trial_peak, True
    return best, peak


def _human(nbytes: int) -> str:
    """Bytes in GiB, or MiB below 1 GiB."""
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Plan:
    """A per-layer choice between keeping, offloading and recomputing activations, with what it
    is predicted to cost. Apply it with ``apply_activation_offloading(model, plan=plan)``."""

    profile: Profile = field(repr=False)
    hardware: Hardware
    budget_bytes: int | None
    decisions: tuple[str, ...]
    prefetch_layers: int
    defer_layers: int
    predicted: Prediction
    baseline: Prediction

    @property
    def stream(self) -> bool:
        """Every tensor the model saves is offloaded as with `offload_activations` (reloaded
        one by one in backward): the least memory, at the link's speed."""
        return bool(self.decisions) and self.decisions[0] == STREAM

    @property
    def offload_layers(self) -> frozenset[int]:
        """Layers whose saved activations are offloaded (for "recompute+offload": its input)."""
        return frozenset(i for i, d in enumerate(self.decisions) if d in (OFFLOAD, BOTH, STREAM))

    @property
    def recompute_layers(self) -> frozenset[int]:
        return frozenset(i for i, d in enumerate(self.decisions) if d in (RECOMPUTE, BOTH))

    def __str__(self) -> str:
        mib = 2**20
        gib = 2**30 if self.baseline.peak_bytes >= 2**30 else 2**20
        unit = "GiB" if gib == 2**30 else "MiB"
        p, hw = self.profile, self.hardware
        lines = [
            f"torchoffload plan for {p.description}: {len(p.layers)} layers"
            + (f", {p.tokens} tokens per step" if p.tokens else ""),
            f"hardware: link {hw.link_gbps:.1f} GB/s each way, {hw.compute_tflops:.0f} TFLOP/s x "
            f"{hw.efficiency:.2f} efficiency ({hw.source})",
            "",
            f"{'layer':>5}  {'saved MiB':>10}  {'offloadable':>11}  {'fwd GFLOP':>10}  "
            f"{'bwd GFLOP':>10}  decision",
        ]
        for layer, decision in zip(p.layers, self.decisions, strict=True):
            lines.append(
                f"{layer.index:>5}  {layer.saved_bytes / mib:>10.1f}  "
                f"{layer.offloadable_bytes / mib:>11.1f}  {layer.fwd_flops / 1e9:>10.1f}  "
                f"{layer.bwd_flops / 1e9:>10.1f}  {decision}"
            )
        b, q = self.baseline, self.predicted
        lines += [
            "",
            f"static: parameters {p.param_bytes / gib:.2f} {unit}, gradients "
            f"{p.grad_bytes / gib:.2f} {unit}, optimizer state "
            f"{p.optimizer_bytes / gib:.2f} {unit}",
            f"saved activations: {p.saved_bytes / gib:.2f} {unit} per step "
            f"({p.outside_saved_bytes / gib:.2f} outside the layers)",
            f"{'':<14}{'peak ' + unit:>10}{'step ms':>10}{'fwd ms':>9}{'bwd ms':>9}{'opt ms':>9}"
            f"{'offloaded ' + unit:>15}",
        ]
        for name, pr in (("no plan", b), ("this plan", q)):
            lines.append(
                f"{name:<14}{pr.peak_bytes / gib:>10.2f}{pr.step_s * 1e3:>10.1f}"
                f"{pr.forward_s * 1e3:>9.1f}{pr.backward_s * 1e3:>9.1f}{pr.optimizer_s * 1e3:>9.1f}"
                f"{pr.offloaded_bytes / gib:>15.2f}"
            )
        if self.budget_bytes is not None:
            lines.append(f"budget {self.budget_bytes / gib:.2f} {unit}")
        counts = {d: self.decisions.count(d) for d in (*DECISIONS, STREAM)}
        lines.append(
            f"decisions: keep {counts[KEEP]}, offload {counts[OFFLOAD]}, recompute "
            f"{counts[RECOMPUTE]}, recompute+offload {counts[BOTH]}"
            + (
                " (stream: the whole model under offload_activations)"
                if self.stream
                else f" (prefetch {self.prefetch_layers}, defer {self.defer_layers})"
            )
        )
        return "\n".join(lines)

    def memory_timelines(self) -> tuple[list[int], list[int]]:
        """Predicted live bytes over forward and backward: (no plan, this plan)."""
        model = _Model(self.profile, self.hardware, self.defer_layers, self.prefetch_layers)
        base = model.timeline([KEEP] * len(self.decisions))
        return base, model.stream()[1] if self.stream else model.timeline(self.decisions)

    def plot(self, path: str) -> None:
        """Write a PNG of memory over one step, without a plan and with this one (needs
        matplotlib: ``pip install torchoffload[bench]``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("plot() needs matplotlib: pip install matplotlib") from e
        base, planned = self.memory_timelines()
        gib = 2**30
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot(
            [v / gib for v in base],
            label=f"no plan (peak {self.baseline.peak_bytes / gib:.1f} GiB)",
        )
        ax.plot(
            [v / gib for v in planned],
            label=f"plan (peak {self.predicted.peak_bytes / gib:.1f} GiB)",
        )
        if self.budget_bytes is not None:
            ax.axhline(self.budget_bytes / gib, color="grey", linestyle="--", label="budget")
        ax.axvline(self.profile.step_marks["forward_end"], color="grey", linewidth=0.5)
        ax.set_xlabel("allocation events in one step (forward | backward)")
        ax.set_ylabel("device GiB")
        ax.set_title(f"{self.profile.description}: memory over one training step")
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def plan_from_profile(
    profile: Profile,
    budget_bytes: int | None,
    *,
    hardware: Hardware | None = None,
    prefetch_layers: int = 1,
    defer_layers: int = 1,
) -> Plan:
    """Choose decisions for a traced (or synthetic) profile. Raises `InfeasibleBudgetError`,
    naming the least peak and what it is made of, when nothing fits."""
    hw = hardware or Hardware()
    model = _Model(profile, hw, defer_layers, prefetch_layers)
    keep = [KEEP] * model.n
    baseline = model.predict(keep)
    if budget_bytes is None or baseline.peak_bytes <= budget_bytes:
        decisions = keep
    else:
        least, least_peak = _least_peak(model)
        stream, _ = model.stream()
        options = []
        if least_peak <= budget_bytes:
            # Offloading any layer installs the engine's hooks on all of them, which the greedy
            # step by step cannot weigh: so also try recomputation alone.
            for allowed in (DECISIONS, (KEEP, RECOMPUTE)):
                decisions = _choose(model, budget_bytes, allowed)
                pred = model.predict(decisions)
                if pred.peak_bytes <= budget_bytes:
                    options.append((pred.step_s, decisions))
            if not options:  # the greedy got stuck; the least-peak decisions fit
                options.append((model.predict(least).step_s, least))
        if profile.saved_storages and stream.peak_bytes <= budget_bytes:
            options.append((stream.step_s, [STREAM] * model.n))
        if not options:
            g = _human
            raise InfeasibleBudgetError(
                f"budget {g(budget_bytes)} is too small: this step needs at least "
                f"{g(min(least_peak, stream.peak_bytes if profile.saved_storages else least_peak))}"
                " even with every layer offloaded or "
                "recomputed. "
                f"Parameters, gradients and optimizer state alone take "
                f"{g(profile.static_bytes)} (parameters {g(profile.param_bytes)}, "
                f"gradients {g(profile.grad_bytes)}, optimizer {g(profile.optimizer_bytes)}), "
                f"the device's workspaces {g(hw.workspace_bytes)}; "
                f"without a plan the peak is {g(baseline.peak_bytes)}."
            )
        decisions = min(options, key=lambda o: o[0])[1]
    for i, d in enumerate(decisions):
        _log.debug("layer %d: %s", i, d)
    return Plan(
        profile=profile,
        hardware=hw,
        budget_bytes=budget_bytes,
        decisions=tuple(decisions),
        prefetch_layers=prefetch_layers,
        defer_layers=defer_layers,
        predicted=model.stream()[0] if decisions[0] == STREAM else model.predict(decisions),
        baseline=baseline,
    )


def plan(
    model: nn.Module,
    example_inputs: Sequence[Any] | dict[str, Any],
    *,
    budget_bytes: int | None,
    link_gbps: float | None = None,
    compute_tflops: float | None = None,
    layers: nn.ModuleList | list[nn.Module] | str = "auto",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: Literal["adamw", "sgd", "none"] = "adamw",
    min_bytes: int = 1 << 16,
    prefetch_layers: int = 1,
    defer_layers: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Trace one training step of ``model`` under fake tensors (`trace`) and choose, per layer,
    whether to keep, offload or recompute its activations so that the predicted peak stays
    within ``budget_bytes`` at the least predicted step time.

    ``link_gbps`` and ``compute_tflops``: None measures them on this machine's GPU, or takes
    the defaults of one H200 on a machine without one. See Notes: [How a plan changes memory]
    and [How a plan changes time]; `print(plan)` shows the decisions and predictions.
    """
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise ValueError(f"budget_bytes must be a positive int or None, got {budget_bytes!r}")
    profile = trace(
        model,
        example_inputs,
        layers=layers,
        loss_fn=loss_fn,
        optimizer=optimizer,
        min_bytes=min_bytes,
        progress=progress,
    )
    hw = Hardware.detect(link_gbps, compute_tflops)
    return plan_from_profile(
        profile, budget_bytes, hardware=hw, prefetch_layers=prefetch_layers,
        defer_layers=defer_layers,
    )  # fmt: skip


def synthetic_profile(
    *,
    layers: int,
    saved_bytes: int,
    fwd_flops: int,
    static_bytes: int = 0,
    input_bytes: int = 0,
) -> Profile:
    """A profile of ``layers`` identical layers without tracing: each saves ``saved_bytes`` in
    forward (freed in its backward) and does ``fwd_flops`` forward, twice that backward. For
    tests and what-ifs."""
    timeline = [static_bytes]
    live = static_bytes
    fwd_end = []
    for _ in range(layers):
        live += saved_bytes
        timeline.append(live)
        fwd_end.append(len(timeline) - 1)
    forward_end = len(timeline) - 1
    bwd_start = [0] * layers
    for i in range(layers - 1, -1, -1):
        bwd_start[i] = len(timeline) - 1
        live -= saved_bytes
        timeline.append(live)
    backward_end = len(timeline) - 1
    layer_profiles = tuple(
        LayerProfile(i, f"layers.{i}", saved_bytes, saved_bytes, saved_bytes - input_bytes,
                     input_bytes, input_bytes if i else 0, (), fwd_flops, 2 * fwd_flops)
        for i in range(layers)
    )  # fmt: skip
    return Profile(
        layers=layer_profiles,
        timeline=tuple(timeline),
        fwd_end=tuple(fwd_end),
        bwd_start=tuple(bwd_start),
        step_marks={
            "forward_end": forward_end,
            "backward_end": backward_end,
            "step_end": backward_end,
        },
        param_bytes=static_bytes,
        grad_bytes=0,
        optimizer_bytes=0,
        outside_fwd_flops=0,
        outside_bwd_flops=0,
        outside_saved_bytes=0,
        tokens=None,
        description="synthetic",
    )
