"""The cost model: what a plan does to a traced step's memory and time.

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

Note: [The planning margin]
A plan promises to fit its budget as measured (`torch.cuda.max_memory_allocated`), so the
search keeps a margin free below the budget: it chooses decisions whose predicted peak is at
most the budget minus ``Hardware.margin(budget)`` = ``margin_bytes`` + ``margin_fraction`` x
budget (32 MiB + 1% by default). The margin covers what the trace does not see: the caching
allocator's rounding (each block to 512 bytes), workspaces that kernels allocate inside
themselves (cuBLAS beyond ``workspace_bytes``, attention backward), and ops that differ between
the CPU kernels traced and the CUDA ones run. Measured prediction errors (measured minus
predicted peak, H100 and H200, benchmarks/README.md "Planner accuracy" (its two tables), and
issue 38):
- GPT h2048, 12 layers, batch 8, seq 2048, bf16, AdamW, the plan for 75% of the measured
  no-offload peak, on an H100: predicted 11.824 GiB, measured 11.889 GiB, budget 11.855 GiB:
  +65 MiB, 34 MiB over the budget (the worst measured; its cause is not found yet);
- `BlockStack` h2048 L12 b8 s2048, whole-model stream plan: 3.16 GiB predicted, 3.19 measured
  (+1.0%, about 30 MiB); h1024 L16 b8 s1024, 1.13 predicted, 1.14 measured (+1.2%, about
  14 MiB); training-state plans within +20 MiB (8.02 predicted, 8.04 measured).
32 MiB + 1% of the budget is 153 MiB at the 11.855 GiB budget (2.4x the worst error), and at
least 2.2x each of the others at their budgets (67 MiB at 3.46 GiB, 44 MiB at 1.15 GiB). A
budget below the predicted peak plus the margin is refused (`InfeasibleBudgetError` says so).
``Hardware(margin_bytes=0, margin_fraction=0.0)`` plans to the byte, as before; a larger margin
buys certainty where the model is known to miss more. `Plan` reports the predicted peak, the
margin and the budget; tests/test_planner_gpu.py measures plans of the issue's GPT against
their budgets on the GPU.

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

Note: [Optimizer state on the host]
With the optimizer state on the host (`OffloadedOptimizer`), the device holds no optimizer
state, and each gradient leaves as backward finishes it: the trace's live bytes lose the
gradients accumulated so far (`Profile.grad_events`) except the last two buckets, which may be
in flight, and gain the conversion scratch of both copy streams (`CAST_CHUNK` fp32 elements
each, or the largest parameter's: Note: [Copies that convert]). The host steps the buckets
while backward runs (fused fp32 AdamW at ``host_adam_params_per_s``); gradients go down and
parameters up over the link in fp32, converted on the device (the optimizer's default, Note:
[Where the conversions run]).
The step then takes forward + max(backward, host step, link) plus one bucket's upload: what
`step()` does today, which does not overlap the host step with the next forward.

Note: [A fraction of the state on the host]
With ``offload_fraction=f`` below 1 (`OffloadedOptimizer`, Note: [Which parameters stay on
the device]), the host part is the parameters whose gradients backward finishes first, about f
of the trainable bytes: only those gradients leave, and the device keeps the other 1 - f of
the gradients through backward plus fp32 masters (for parameters that are not fp32) and fp32
state for them, and at the step one gradient converted to fp32. The host step and the link
carry f of the work; the device part steps after backward at the memory bandwidth, while the
host finishes its part and uploads it. The planner tries f in `HOST_FRACTIONS` and keeps the
fastest that fits (the most on the host among equals): a host-bound step trades device memory
for host time (measured: run K in benchmarks/log/2026-11-23-optimizer-on-host.md, 1085 ->
768 ms a step at f = 0.5).

Note: [Parameters on the host]
With the parameters streamed from the host too (`stream_parameters`, which needs the optimizer
on the host), the device holds, instead of every parameter, a working set: the parameters
outside the layers (the embedding and a tied head are held through backward) plus 2 +
``prefetch`` layers' parameters (the layer computing, the one whose backward may still hold
them, and the prefetch); that is also the budget the plan gives `stream_parameters`. Every
parameter goes up once for forward and once for backward: each pass takes at least its
parameters' bytes over the link, on the H2D direction, beside the gradients going down. The
host writes the new values into its store, so the step has no upload tail.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torchoffload._transfer import CAST_CHUNK
from torchoffload.optim import default_bucket_bytes, host_state_bytes
from torchoffload.planner._hardware import Hardware
from torchoffload.planner._trace import Profile

_log = logging.getLogger(__name__)

# The fractions of the optimizer state a plan may put on the host with the parameters on the
# device (Note: [A fraction of the state on the host]).
HOST_FRACTIONS = (1.0, 0.75, 0.5, 0.25)


# -- predictions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    offloaded_bytes: int  # per step, each way


class Decision(str, enum.Enum):
    """What a plan does with a layer's activations (strings with these values are accepted
    wherever a decision is)."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    BOTH = "recompute+offload"  # recompute, with the layer's input offloaded
    STREAM = "stream"  # the whole model under `offload_activations` (every layer at once)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


KEEP, OFFLOAD, RECOMPUTE, BOTH, STREAM = (
    Decision.KEEP, Decision.OFFLOAD, Decision.RECOMPUTE, Decision.BOTH, Decision.STREAM,
)  # fmt: skip
DECISIONS = (KEEP, OFFLOAD, RECOMPUTE, BOTH)  # per layer (STREAM applies to the whole model)


class CostModel:
    """A profile prepared for fast what-ifs. See Notes: [How a plan changes memory] and
    [How a plan changes time]."""

    def __init__(
        self,
        profile: Profile,
        hw: Hardware,
        defer: int,
        prefetch: int,
        host_optimizer: bool = False,
        host_params: bool = False,
        host_fraction: float = 1.0,
        link_bytes: float = 4.0,
    ):
        self.p, self.hw, self.defer, self.prefetch = profile, hw, defer, prefetch
        self.host_optimizer = host_optimizer
        self.host_params = host_params
        if not 0.0 < host_fraction <= 1.0 or (host_fraction < 1.0 and host_params):
            raise ValueError(f"host_fraction must be in (0, 1] (1 with host_params), got "
                             f"{host_fraction!r}")  # fmt: skip
        # Note: [A fraction of the state on the host]
        f = self.host_fraction = host_fraction if host_optimizer else 0.0
        self.param_working_bytes = param_working_bytes(profile)
        n = len(profile.layers)
        self.n = n
        marks = profile.step_marks
        self.bwd_end = marks["backward_end"]
        # Steady state: the optimizer state of earlier steps is live during forward and backward.
        extra = hw.workspace_bytes
        if host_optimizer:  # See Note: [Optimizer state on the host]
            on_device = device_part_bytes(profile, f)
            steady = _without_gradients(profile, extra + _cast_scratch(profile) + on_device, f)
            self.opt_peak = (steady[-1] if steady else 0) + (
                _device_step_scratch(profile) if f < 1.0 else 0
            )
        else:
            timeline = profile.timeline[: self.bwd_end + 1]
            steady = [v + profile.optimizer_bytes + extra for v in timeline]
            self.opt_peak = max(profile.timeline[self.bwd_end :]) + extra if profile.timeline else 0
        if host_params:  # Note: [Parameters on the host]
            away = max(profile.param_bytes - self.param_working_bytes, 0)
            steady = [v - away for v in steady]
            self.opt_peak -= away
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
        (self.t_opt, self.bw, self.t_host, self.t_link, self.t_tail, self.t_params) = (
            _optimizer_times(profile, hw, f, host_optimizer, host_params, link_bytes)
        )

    def exposed_optimizer(self, backward: float) -> float:
        """The optimizer's time not hidden by a backward of ``backward`` seconds."""
        if not self.host_optimizer:
            return self.t_opt
        if not self.p.trainable_numel:
            return 0.0
        beside = max(self.t_host, self.t_link)
        # the device part steps on the GPU while the host finishes its part and uploads it
        return max(beside - min(backward, beside) + self.t_tail, self.t_opt)

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
        backward = max(end_of[0] - forward, self.t_params)
        forward = max(forward, self.t_params)
        return forward, backward, self.exposed_optimizer(backward)

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
        f, b = max(fwd, copies, self.t_params), max(bwd, copies, self.t_params)
        o = self.exposed_optimizer(b)
        return Prediction(peak, f + b + o, f, b, o, moved), timeline

    def predict(self, decisions: Sequence[str]) -> Prediction:
        f, b, o = self.time(decisions)
        moved = sum(self.moved[i][x] for i, x in enumerate(decisions))
        return Prediction(self.peak(decisions), f + b + o, f, b, o, moved)


def _optimizer_times(
    profile: Profile, hw: Hardware, f: float, host_optimizer: bool, host_params: bool,
    link_bytes: float,
) -> tuple[float, float, float, float, float, float]:  # fmt: skip
    """The optimizer's times (device step, link bytes a second, host step, link, upload tail,
    parameters over the link): on the device (memory-bound), or the host optimizer's work
    beside backward, its link time and its upload tail. Gradients and new values cross as
    ``link_bytes`` an element each way: 4 where they convert on the device (Note: [Where the
    conversions run]), 2 for bf16 masters (`torchoffload.optim.link_bytes_per_param`)."""
    moved = profile.param_bytes * 2 + profile.grad_bytes + profile.optimizer_bytes * 2
    bw = hw.hbm_gbps * 1e9 * hw.memory_efficiency
    t_opt = moved / bw if profile.optimizer_bytes else 0.0
    link = hw.link_gbps * 1e9
    numel = profile.trainable_numel
    hosted = numel * f if host_optimizer else numel
    t_host = hosted / hw.host_adam_params_per_s
    t_link = link_bytes * hosted / link
    tail = 2 * bucket_bytes(profile) * link_bytes / 4  # a bf16 bucket's upload in fp32
    t_tail = min(link_bytes * hosted, tail) / link
    if host_optimizer:  # the device part's step (fp32 masters and state), memory-bound
        t_opt = (1.0 - f) * numel * _device_step_bytes_per_param(profile) / bw
    t_params = profile.param_bytes / link if host_params else 0.0
    if host_params:
        t_tail = 0.0
        # the new values are rounded into the host store: fp32 read, the dtype written
        written = 0 if _fp32(profile) else profile.trainable_bytes
        t_host += (4 * numel + written) / (hw.host_memory_gbps * 1e9) if written else 0
    return t_opt, link, t_host, t_link, t_tail, t_params


def bucket_bytes(profile: Profile) -> int:
    """The bucket size of an `OffloadedOptimizer` built with its defaults over the profile's
    trainable parameters."""
    return default_bucket_bytes(profile.trainable_bytes)


def _without_gradients(profile: Profile, extra: int, fraction: float = 1.0) -> list[int]:
    """The steady live bytes through backward when gradients leave the device as backward
    finishes them (two buckets may still be on it) and no optimizer state is on it; with a
    ``fraction`` below 1 only the gradients finished first, that fraction of their bytes, leave
    (Note: [A fraction of the state on the host])."""
    end = profile.step_marks["backward_end"]
    bucket = bucket_bytes(profile)
    done = [0] * (end + 2)
    events = profile.grad_events
    if fraction < 1.0:  # the first gradients finished, up to that fraction of the bytes
        leaving, events = int(fraction * sum(b for _, b in events)), []
        for at, nbytes in sorted(profile.grad_events):
            if leaving <= 0:
                break
            events.append((at, min(nbytes, leaving)))
            leaving -= nbytes
    for at, nbytes in events:
        done[min(at, end) + 1] += nbytes
    out, gone = [], 0
    for k, v in enumerate(profile.timeline[: end + 1]):
        gone += done[k]
        # a gradient finished at event k left after it; keep two buckets as in flight
        out.append(v + extra - max(gone - 2 * bucket, 0))
    return out


def _fp32(profile: Profile) -> bool:
    """The trainable parameters are fp32: their own masters, no conversions."""
    return profile.trainable_bytes == 4 * profile.trainable_numel


def _state_floats(profile: Profile) -> int:
    """Optimizer state values per trainable element (AdamW: 2), as traced."""
    nbytes = profile.trainable_bytes
    return round(profile.optimizer_bytes / nbytes) if nbytes else 0


def device_part_bytes(profile: Profile, host_fraction: float) -> int:
    """Device bytes of an `OffloadedOptimizer`'s device part (``offload_fraction`` =
    ``host_fraction``): fp32 masters of parameters that are not fp32, and fp32 state, for the
    other ``1 - host_fraction`` of the trainable parameters. Their gradients stay too (in the
    trace's timeline)."""
    numel = profile.trainable_numel
    if host_fraction >= 1.0 or not numel:
        return 0
    masters = 0 if _fp32(profile) else 4
    return int((1.0 - host_fraction) * numel * (masters + 4 * _state_floats(profile)))


def _device_step_bytes_per_param(profile: Profile) -> float:
    """Device memory traffic of the device part's step per parameter: the parameter and its
    gradient read, the new value written, the master and the state read and written."""
    numel = profile.trainable_numel
    if not numel:
        return 0.0
    masters = 0 if _fp32(profile) else 8
    return 3 * profile.trainable_bytes / numel + masters + 8 * _state_floats(profile)


def _device_step_scratch(profile: Profile) -> int:
    """The device part's step converts one gradient at a time to fp32 (parameters not fp32)."""
    if _fp32(profile):
        return 0
    return 4 * profile.largest_trainable_numel


def _cast_scratch(profile: Profile) -> int:
    """Device scratch of the copies that convert gradients and new values (one chunk per copy
    stream), when the trainable parameters are not fp32."""
    if _fp32(profile):
        return 0
    return 2 * 4 * min(CAST_CHUNK, profile.largest_trainable_numel)


def param_working_bytes(profile: Profile, prefetch: int = 1) -> int:
    """Device bytes of streamed parameters (Note: [Parameters on the host]): those outside the
    layers plus 2 + ``prefetch`` of the largest layer's."""
    in_layers = sum(x.param_bytes for x in profile.layers)
    largest = max((x.param_bytes for x in profile.layers), default=0)
    outside = max(profile.param_bytes - in_layers, 0)
    return min(profile.param_bytes, outside + (2 + prefetch) * largest)


def host_optimizer_bytes(
    profile: Profile, host_fraction: float = 1.0, bytes_per_param: float | None = None
) -> int:
    """Host bytes of an `OffloadedOptimizer` over the profile's trainable parameters (its host
    part's, ``host_fraction`` of them): ``bytes_per_param`` each (`host_bytes_per_param` of
    its options: bf16 masters, 8-bit moments), or by default fp32 masters and gradients and
    the traced optimizer state in fp32."""
    numel, nbytes = profile.trainable_numel, profile.trainable_bytes
    if not numel:
        return 0
    if bytes_per_param is not None:
        return int(numel * host_fraction * bytes_per_param)
    return host_state_bytes(
        int(numel * host_fraction), int(nbytes * host_fraction), _state_floats(profile)
    )
