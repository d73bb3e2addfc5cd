"""Cold experts on the host (`stream_experts(host_compute=...)`): in a small block call, a routed
expert missing from the device cache may compute on the CPU from the host store's bytes, while
the device computes the other experts and copies the other misses, instead of crossing the link.

Note: [Cold experts on the host]
Which experts, in a block call of at most ``max_tokens`` tokens (`HostCompute`): among the
routed experts the cache lacks when the block routes (its *misses*, in expert order), policy
"all" computes every one on the host; "split" the last ``h`` of ``m``, with ``h`` minimizing
``max((m - h) * link_s, fixed_s + h * host_s)`` (``fixed_s`` only when ``h`` > 0; the fewest
among equals), where ``link_s`` is an expert's bytes over the link rate, ``host_s`` over the
host rate and ``fixed_s`` a host job's own cost, whatever its experts (staging the rows,
waking the worker, copying the outputs back: `split`). The link copies misses in expert
order, so the last ones would arrive last: those go to the host. The rates are given or
measured once at setup (`measure`: jobs of one and of several experts, so that the fixed
cost is not charged to each expert), so the choice is a function of the routing and the
cache, the same in every run of a handle. Larger blocks copy every miss.
The stream order, per block call (C: the compute stream, read at the call; D: the D2H copy
stream; W: the worker thread):
- The host experts' input rows and routing weights are gathered on C (``hidden_states[
  token_idx]``, ``top_k_weights[token_idx, top_k_pos, None]``: the resident loop's tensors)
  and copied by D, after C, into a pinned staging buffer allocated once at setup (exact
  sizes, each tensor 512-aligned as a fresh allocation), one "stored" event after the last
  copy (Note: [D2H protocol]). The gathered device tensors stay referenced until the block
  ends, after "stored" completed.
- W waits on "stored" (an event synchronize on W; the caller never synchronizes the device),
  then computes each host expert in expert order with the resident loop's operations
  (`expert_output`) on the staged rows and the host store's bytes (views of the expert's
  slices, in their dtype), into the staging's output rows.
- Meanwhile C computes the device experts in expert order (their copies queued by ``route``
  before the first one: Note: [Routed experts and the copy stream]). Every output is added
  into the block's output in expert order (`_InOrder`): a device expert's is held until every
  expert before it was added; a host expert's once W has finished it (the caller waits on W
  there, on the host, while C runs what was queued), copied to a tensor allocated on C by a
  copy queued on C. So the sum runs in the resident loop's order, and the copy of a host
  result is ordered before the ``index_add`` that reads it by C's own order.
- The staging is rewritten only after every read of it: W has finished a block's experts
  before the block returns (also when it fails), and the next block's D2H waits on C, where
  this block's result copies were queued, so that D2H and W's next writes (after its
  "stored") both come after those copies ran. A held device output is at most a small
  block's rows: the memory stays bounded.
- W touches no runtime state (the caller holds the runtime's lock through the block) and
  reads the host store only inside a block call, which writes of the store are refused in
  (Note: [Routed experts and the copy stream]).
Results: a device expert's output is bitwise the resident loop's and the sum order is its
order, so only the host experts' values differ, by the CPU kernels' rounding (on a CPU
device, the same kernels: bitwise). A host-computed expert is not copied, so it does not enter
the cache, and its use is not counted by the policy ("lfu"): at decode, the cache keeps what
the link brought. Graph calls (`cuda_graph`) never compute on the host.
"""

from __future__ import annotations

import concurrent.futures
import enum
import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from torchoffload._pool import pinned_buffer
from torchoffload._validate import check_int, check_number
from torchoffload.moe._layout import ExpertLayout, LayoutKind, implementation, round_up
from torchoffload.moe._outside import check_loop, loop_mask

__all__ = [
    "HostCompute",
    "HostExperts",
    "HostPolicy",
    "check_host_layout",
    "expert_output",
    "host_forward",
    "split",
]

_ALIGN = 512  # where a staged tensor starts, as a fresh allocation would (caching allocator)
_MAX_TOKENS = 64  # the staging grows with max_tokens: host compute serves small batches
_REPEATS = 5  # timed runs of each measurement at setup (the first is a warm-up)


class HostPolicy(str, enum.Enum):
    """Which misses of a small block compute on the host (Note: [Cold experts on the host])."""

    ALL = "all"  # every one
    SPLIT = "split"  # the last ones, as many as balance the host against the link

    @classmethod
    def parse(cls, value: object) -> HostPolicy:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"policy must be 'all' or 'split', got {value!r}") from None


@dataclass(frozen=True)
class HostCompute:
    """How `stream_experts` computes cold experts on the host (``host_compute=``; See Note:
    [Cold experts on the host]).

    In a block call of at most ``max_tokens`` tokens, the routed experts missing from the
    device cache compute on the CPU from the host store (``policy="all"``), or the last of
    them, as many as balance the host's time against the link's (``"split"``): an expert
    costs ``expert_bytes / link_bytes_per_s`` on the link and ``expert_bytes /
    host_bytes_per_s`` on the host, and the two run at once. A rate left None is measured at
    setup (the link: copies of an expert into the cache; the host: an expert of
    ``max_tokens`` rows from the copy of its rows to the host to its output back on the
    device, the slowest case the policy serves, in jobs of one and of several experts).
    ``host_fixed_s``: a host job's cost beside its experts' (staging, the worker's wake-up,
    the copy back), measured with the host rate, else 0. ``"all"`` uses no rates.
    ``host_threads``:
    the intra-op threads of the worker that computes them (`torch.set_num_threads` on its
    thread, Note: [Host threads] in optim/_worker.py); None keeps the process's setting (on a
    CPU device, the setting under which the results are the device's, bitwise).
    """

    max_tokens: int = 4
    policy: HostPolicy | str = HostPolicy.SPLIT
    link_bytes_per_s: float | None = None
    host_bytes_per_s: float | None = None
    host_threads: int | None = None
    host_fixed_s: float | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, minimum=1, maximum=_MAX_TOKENS)
        if self.host_threads is not None:
            check_int("host_threads", self.host_threads, minimum=1)
        object.__setattr__(self, "policy", HostPolicy.parse(self.policy))
        for name in ("link_bytes_per_s", "host_bytes_per_s"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name))
        if self.host_fixed_s is not None:
            check_number("host_fixed_s", self.host_fixed_s, positive=False)

    @classmethod
    def parse(cls, value: object) -> HostCompute | None:
        """``host_compute`` as `stream_experts` takes it: False (off), True (every miss of a
        small block on the host), ``"auto"`` (split by rates measured at setup) or a
        `HostCompute`."""
        if value is False:
            return None
        if value is True:
            return cls(policy=HostPolicy.ALL)
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value == "auto":
                return cls()
            raise ValueError(f"host_compute must be False, True, 'auto' or a HostCompute, got "
                             f"{value!r}")  # fmt: skip
        raise TypeError(
            f"host_compute must be False, True, 'auto' or a HostCompute, got {type(value).__name__}"
        )

    @property
    def measures(self) -> bool:
        """Whether setup measures a rate."""
        return self.policy is HostPolicy.SPLIT and (
            self.link_bytes_per_s is None or self.host_bytes_per_s is None
        )


def check_host_layout(layout: ExpertLayout) -> None:
    """Refuse, before anything changes, experts that host compute cannot serve."""
    for layer in layout.layers:
        if layer.kind is not LayoutKind.FUSED:
            raise ValueError(
                f"host_compute serves fused experts modules (transformers' layout), whose "
                f"forward stream_experts computes; {layer.name!r} is a ModuleList of expert "
                "modules, which its block calls and adds up itself. Stream it without "
                "host_compute"
            )
        check_host_implementation(layer)


HOST_GROUPED = (
    "host_compute serves the experts' eager implementation (the per-expert loop); {name!r} "
    "runs transformers' {impl}, whose sum of the routed experts' outputs host results "
    "cannot join. Set model.set_experts_implementation('eager') (and compare with that), or "
    "stream without host_compute"
)


def check_host_implementation(layer: Any, setup: bool = True) -> None:
    """Refuse host compute for a fused experts module that runs ``grouped_mm``."""
    impl = implementation(layer.container, layer.name)
    if impl != "eager":
        raise (ValueError if setup else RuntimeError)(HOST_GROUPED.format(name=layer.name,
                                                                          impl=impl))  # fmt: skip


def split(misses: int, link_s: float, host_s: float, fixed_s: float = 0.0) -> int:
    """How many of a block's ``misses`` the host computes: the ``h`` minimizing ``max((misses -
    h) * link_s, fixed_s + h * host_s)`` (no ``fixed_s`` for ``h`` = 0), the fewest among
    equals."""

    def cost(h: int) -> tuple[float, int]:
        return max((misses - h) * link_s, (fixed_s if h else 0.0) + h * host_s), h

    return min(range(misses + 1), key=cost)


def expert_output(act_fn: Any, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  current_state: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One expert's output: the operations of the resident loop (transformers' eager
    Qwen3MoeExperts), in its order."""
    gate, up = F.linear(current_state, gate_up_proj).chunk(2, dim=-1)
    current = act_fn(gate) * up
    current = F.linear(current, down_proj)
    return current * weights


class HostExperts:
    """The host side of one runtime's host compute (Note: [Cold experts on the host]): the
    pinned staging, the worker thread and the policy with its rates (``config``, measured at
    setup where not given)."""

    def __init__(self, rt: Any, config: HostCompute):
        layout = rt.layout
        self.rt = rt
        self.max_tokens = config.max_tokens
        # - Staging: a block's host experts hold at most max_tokens * top_k rows, each staged
        #   as input, routing weight and output, each tensor 512-aligned
        rows = config.max_tokens * layout.top_k
        hidden = max(layer.members[0].size[-1] for layer in layout.layers)
        item = max(4, *(m.dtype.itemsize for layer in layout.layers for m in layer.members))
        self.nbytes = rows * ((2 * hidden + 1) * item + 3 * _ALIGN)
        self._buffer = pinned_buffer(self.nbytes + _ALIGN, pin=rt.store.pinned)
        start = -self._buffer.data_ptr() % _ALIGN
        self.staging = self._buffer[start : start + self.nbytes]
        # - The worker: made at the first host expert, shut down by close()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.closed = False
        self.config = config
        if config.measures:
            try:
                link, host, fixed = measure(self, config.max_tokens)
            finally:  # Note: [The host experts' worker]: started again at the first use
                self._stop()
            self.config = replace(
                config,
                link_bytes_per_s=config.link_bytes_per_s or link,
                host_bytes_per_s=config.host_bytes_per_s or host,
                host_fixed_s=(
                    config.host_fixed_s
                    if config.host_bytes_per_s or config.host_fixed_s is not None
                    else fixed
                ),
            )

    def serves(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> bool:
        """Whether this block call may compute misses on the host: at most ``max_tokens``
        tokens."""
        return (
            not self.closed
            and hidden_states.dim() == 2
            and top_k_index.dim() == 2
            and hidden_states.shape[0] == top_k_index.shape[0] <= self.max_tokens
        )

    def choose(self, li: int, misses: list[int], counts: list[int], hidden: int,
               dtypes: tuple[torch.dtype, torch.dtype]) -> list[int]:  # fmt: skip
        """The misses (ascending) the host computes, by the policy, as many of the last as
        the staging holds (``counts``: each expert's tokens; ``dtypes``: of the hidden states
        and of the routing weights)."""
        if not misses:
            return []
        h = len(misses)
        cfg = self.config
        if cfg.policy is HostPolicy.SPLIT:
            b = self.rt.layout.layers[li].expert_bytes
            h = split(len(misses), b / cfg.link_bytes_per_s, b / cfg.host_bytes_per_s,
                      cfg.host_fixed_s or 0.0)  # fmt: skip
        room, chosen = self.nbytes, []
        for e in reversed(misses[len(misses) - h :]):
            need = sum(n for _, n in _pieces(counts[e], hidden, dtypes))
            if need > room:
                break
            room -= need
            chosen.append(e)
        return chosen[::-1]

    def start(self, li: int, act_fn: Any, inputs: list[tuple[int, torch.Tensor, torch.Tensor]],
              out_dtype: torch.dtype) -> _Job:  # fmt: skip
        """Copy each ``(expert, rows, routing weights)``'s device tensors to the staging and
        queue the experts on the worker, in order."""
        if self._pool is None:
            n = self.config.host_threads
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="torchoffload-host-experts",
                initializer=None if n is None else torch.set_num_threads, initargs=(n,),
            )  # fmt: skip
        return _Job(self, li, act_fn, inputs, out_dtype)

    def close(self) -> None:
        """Stop the worker for good (no block runs: every job was waited for)."""
        self.closed = True
        self._stop()

    def _stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


Shaped = tuple[tuple[int, int], int]  # a staged tensor: its shape, its bytes aligned


# Note: [The host experts' worker]
# A thread that has run a parallel CPU op keeps an OpenMP team of its own; while it lives, the
# CPU ops of every other thread run slower where the teams together outnumber the cores
# (libgomp then stops spinning between parallel regions: an idle worker that had run one op
# made a (16, 256) x (256, 512) bf16 product of the main thread 2.6 times slower on a 2-core
# machine, and nothing did once it was stopped or had one thread). So the worker starts at the
# first host expert, not at setup (the rates' measurement stops the one it used), and lives
# until remove(); ``host_threads=1`` gives it a team of one. A GPU run's main thread launches
# kernels and runs few parallel CPU ops.


def _pieces(rows: int, hidden: int, dtypes: tuple[torch.dtype, torch.dtype]) -> list[Shaped]:
    """An expert's staged tensors: input rows, routing weights, output rows (shape, bytes
    with the alignment)."""
    x, w = dtypes
    return [
        ((rows, hidden), round_up(rows * hidden * x.itemsize, _ALIGN)),
        ((rows, 1), round_up(rows * w.itemsize, _ALIGN)),
        ((rows, hidden), round_up(rows * hidden * x.itemsize, _ALIGN)),
    ]


def _view(staging: torch.Tensor, at: int, shape: tuple[int, int],
          dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return staging[at : at + shape[0] * shape[1] * dtype.itemsize].view(dtype).view(shape)


class _Job:
    """One block call's host experts in flight (Note: [Cold experts on the host])."""

    def __init__(self, host: HostExperts, li: int, act_fn: Any,
                 inputs: list[tuple[int, torch.Tensor, torch.Tensor]],
                 out_dtype: torch.dtype) -> None:  # fmt: skip
        rt = host.rt
        self.device = rt.device
        self.keep = [t for _, x, w in inputs for t in (x, w)]  # until "stored" completed
        pairs, outs, off = [], [], 0
        for _, x, w in inputs:
            (xs, xn), (ws, wn), (shape, on) = _pieces(x.shape[0], x.shape[1], (x.dtype, w.dtype))
            hx = _view(host.staging, off, xs, x.dtype)
            hw = _view(host.staging, off + xn, ws, w.dtype)
            pairs += [(hx, x), (hw, w)]
            outs.append((hx, hw, off + xn + wn, shape))
            off += xn + wn + on
        self.stored, _ = rt.engine.offload_many(pairs)
        self.futures = [
            host._pool.submit(_compute, self.stored, act_fn, rt.store, rt.layout.layers[li],
                              li, e, x, w, host.staging, at, shape, out_dtype)
            for (e, _, _), (x, w, at, shape) in zip(inputs, outs, strict=True)
        ]  # fmt: skip

    def done(self, i: int) -> bool:
        return self.futures[i].done()

    def result(self, i: int) -> torch.Tensor:
        """Host expert ``i``'s output on the device: waits for the worker, then queues its copy
        on the compute stream (where the ``index_add`` that reads it runs next)."""
        out = self.futures[i].result()
        dst = torch.empty(out.shape, dtype=out.dtype, device=self.device)  # on the compute stream
        dst.copy_(out, non_blocking=True)
        return dst

    def close(self) -> None:
        """Wait for the worker to finish this job (an interrupt does not cut the wait: it is
        raised after), then drop the device sources, their copies complete."""
        interrupted = None
        for f in self.futures:
            while True:
                try:
                    concurrent.futures.wait([f])
                    break
                except BaseException as exc:
                    interrupted = interrupted or exc
        if self.stored is not None:
            self.stored.synchronize()  # complete already unless no expert ran
        self.keep.clear()
        if interrupted is not None:
            raise interrupted


def _compute(stored: Any, act_fn: Any, store: Any, layer: Any, li: int, e: int,
             x: torch.Tensor, w: torch.Tensor, staging: torch.Tensor, at: int,
             shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """On the worker: expert ``e`` of layer ``li`` on the staged rows, from the host store,
    into the staging's output rows (returned)."""
    if stored is not None:
        stored.synchronize()
    with torch.no_grad():
        weights = []
        for m, member in enumerate(layer.members):
            piece, offset = layer.source(e, m)
            data = store.source(li, piece, offset, member.nbytes)
            t = torch.empty(0, dtype=member.dtype)
            weights.append(t.set_(data.untyped_storage(), data.storage_offset() // t.element_size(),
                                  member.size, member.stride))  # fmt: skip
        out = _view(staging, at, shape, dtype)
        out.copy_(expert_output(act_fn, *weights, x, w).to(dtype))
    return out


class _InOrder:
    """The block's outputs added in expert order (Note: [Cold experts on the host]): each
    once every expert before it was added, a host expert's once the worker has finished it."""

    def __init__(self, final: torch.Tensor, job: _Job | None):
        self.final = final
        self.job = job
        self.pending: deque[tuple[torch.Tensor, torch.Tensor | None, int]] = deque()

    def device(self, token_idx: torch.Tensor, current: torch.Tensor) -> None:
        self.pending.append((token_idx, current, -1))
        self._flush(wait=False)

    def host(self, token_idx: torch.Tensor, i: int) -> None:
        self.pending.append((token_idx, None, i))
        self._flush(wait=False)

    def finish(self) -> None:
        self._flush(wait=True)

    def _flush(self, wait: bool) -> None:
        final = self.final
        while self.pending:
            token_idx, current, i = self.pending[0]
            if current is None:
                if not wait and not self.job.done(i):
                    return
                current = self.job.result(i)
            final.index_add_(0, token_idx, current.to(final.dtype))
            self.pending.popleft()


def host_forward(rt: Any, li: int, module: Any, hidden_states: torch.Tensor,
                 top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The fused experts' forward of a small block call with its chosen misses on the host
    (Note: [Cold experts on the host]); otherwise `FusedForward.body`'s."""
    host = rt.host
    n = rt.layout.layers[li].experts
    with rt._lock:
        rt.begin(li, hidden_states.shape[0])
        job = None
        try:
            final_hidden_states = torch.zeros_like(hidden_states)
            with torch.no_grad():
                expert_mask = loop_mask(top_k_index, n)  # Note: [Routed outside a layer]
                counts = expert_mask.sum(dim=(-1, -2)).tolist()  # one host sync
            check_loop(rt.layout.layers[li], counts[n] > 0, counts[n + 1] > 0)
            counts = counts[:n]  # the sentinel n skipped
            routed = [e for e, c in enumerate(counts) if c]
            misses = [e for e in routed if rt.cache.lookup((li, e)) is None]
            dtypes = (hidden_states.dtype, top_k_weights.dtype)
            on_host = host.choose(li, misses, counts, hidden_states.shape[1], dtypes)
            place = {e: i for i, e in enumerate(on_host)}
            rt.route(li, [e for e in routed if e not in place])
            inputs, token_of = [], {}
            for e in on_host:
                top_k_pos, token_idx = torch.where(expert_mask[e])
                token_of[e] = token_idx
                inputs.append((e, hidden_states[token_idx],
                               top_k_weights[token_idx, top_k_pos, None]))  # fmt: skip
            if inputs:
                job = host.start(li, module.act_fn, inputs, final_hidden_states.dtype)
            adds = _InOrder(final_hidden_states, job)
            for e in routed:
                if e in place:  # counted and recorded; no slot, not a use for the policy
                    rt.recorder.enter(li, e, rt.blocks[li].order)
                    rt.counters[li].host_computed += 1
                    adds.host(token_of[e], place[e])
                    continue
                slot = rt.enter(li, e)
                gate_up_proj, down_proj = rt.views(li, e, slot)
                top_k_pos, token_idx = torch.where(expert_mask[e])
                current = expert_output(module.act_fn, gate_up_proj, down_proj,
                                        hidden_states[token_idx],
                                        top_k_weights[token_idx, top_k_pos, None])  # fmt: skip
                adds.device(token_idx, current)
                rt.exit(li, e)
            adds.finish()
        finally:
            try:
                if job is not None:
                    job.close()
            finally:
                rt.end(li)
    return final_hidden_states


def measure(host: HostExperts, tokens: int) -> tuple[float, float, float]:
    """(link bytes a second, host bytes a second, host job seconds) at setup, on the first
    layer's experts: the median of expert 0's copies into the cache's first slot (empty at
    setup), and of `_Job` runs of ``tokens`` rows of zeros through one expert and through
    ``k`` (up to 4), each from the copy of its rows to the host to its outputs on the device.
    The host's time per expert is the difference over ``k - 1`` experts, its fixed cost what
    is left of the one-expert job (with one expert in the layer: that job over its bytes)."""
    rt = host.rt
    layer = rt.layout.layers[0]
    nbytes = layer.expert_bytes
    slot = rt.cache.slots[0]
    data = rt.cache.data
    pairs = []
    for m, member in enumerate(layer.members):
        start = slot.offset + member.region + layer.shift(0, m)
        piece, offset = layer.source(0, m)
        pairs.append((data[start : start + member.nbytes],
                      rt.store.source(0, piece, offset, member.nbytes)))  # fmt: skip
    dtype = layer.members[0].dtype
    k = min(4, layer.experts, rt.layout.top_k)  # the staging holds top_k experts' rows
    with torch.inference_mode(False), torch.no_grad():
        x = torch.zeros(tokens, layer.members[0].size[-1], dtype=dtype, device=rt.device)
        w = torch.zeros(tokens, 1, dtype=dtype, device=rt.device)
        link = []
        for _ in range(_REPEATS):
            t0 = time.perf_counter()
            _complete(rt.engine.load(pairs, []))
            link.append(time.perf_counter() - t0)
        one, several = (_job_seconds(host, layer, [(e, x, w) for e in range(n)], dtype)
                        for n in (1, k))  # fmt: skip
    per = (several - one) / (k - 1) if k > 1 else 0.0
    if per <= 0.0:  # one expert, or noise larger than an expert's work: no fixed cost
        per, fixed = (several / k if k > 1 else one), 0.0
    else:
        fixed = max(one - per, 0.0)
    return nbytes / max(statistics.median(link[1:]), 1e-9), nbytes / max(per, 1e-9), fixed


def _job_seconds(host: HostExperts, layer: Any, experts: list, dtype: torch.dtype) -> float:
    """The median of `_REPEATS` - 1 timed runs (after one) of a host job over ``experts``."""
    times = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        job = host.start(0, layer.container.act_fn, experts, dtype)
        try:
            for i in range(len(experts)):
                job.result(i)
            _complete(host.rt.engine.record())
        finally:
            job.close()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _complete(event: Any) -> None:
    if event is not None:
        event.synchronize()
