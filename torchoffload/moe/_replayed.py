"""Eager one-token block calls of fused experts replayed as one CUDA graph per layer: the
routing, the cache's map and the copies stay on the device, as in a `cuda_graph` call, with
no host read and one graph launch per block call.

Note: [Block calls replayed as graphs]
An eager block call that routes on the host reads the routing once (Note: [One host read per
block call]): the read waits for the device to finish what was queued, then the device idles
while the host queues the block's copies and experts, so at batch-1 decode the host's time per
block bounds the step. The device-routed path of a graph call (Note: [Routed experts in a
CUDA graph]) needs no read, but run eagerly its tens of small operations cost more host time
than the read saves. Captured once per layer and replayed, it costs the host three small input
copies, one graph launch and one output copy per block call, and the host runs ahead of the
device across blocks.
- Which calls: with ``block_graphs`` on, an eager call of a fused experts block on one token
  (``hidden_states`` of shape (1, hidden), ``top_k`` routed experts), gradients off, no
  routing recorder open, not inside a capture that is not the runtime's, and no Python that
  must run at every call inside the block (a hook on a module of the experts, such as its
  activation, a global module hook, a torch function or dispatch mode: a graph replays what its
  capture saw). Any other call (a prefill, a larger batch) routes on the host.
- Who owns the map: the device tables while replays run (`DeviceTables.push` before the first
  of a run of replays, after every eager copy and read of a slot); a call routed on the host
  reads it back first (`DeviceTables.pull`, after a device synchronize), so switching between
  a prefill and decode costs one synchronize and one push. A warm-up that raises midway empties
  the map (Note: [Routed experts in a CUDA graph]).
- Per signature (the layer, the experts implementation, the module and its activation, each
  input's dtype, shape and stride, and the settings that choose kernels: autocast, the
  deterministic mode, the matmul precision flags, the BLAS library): the first call runs the
  device-routed path eagerly (a warm-up: lazy initialization, the copy kernel compiled), the
  second is captured (`weights._graph._capture_once`: its errors, the caching allocator emptied
  and the collector paused, as for any capture) and replayed, later calls replay. A capture
  that raises is given up: that signature routes on the host from then on (logged). The inputs
  are copied into the graph's static inputs and the output is copied out of the graph's, which
  the layer's next replay rewrites. A layer keeps at most ``MAX_SIGNATURES`` graphs; a call of
  another signature beyond them routes on the host.
- Every layer's graph allocates from one memory pool (a one-token call's few intermediates). A
  graph's memory is used only while it replays (its output excepted, which no other capture
  reuses), and every call on this path, warm-up, capture or replay, is ordered after the last
  one: a call on another compute stream than the last first waits on that stream (the tables,
  the stage and the pool are shared by every layer).
- No prefetch inside a block's graph: a capture joins its copy streams before it ends, so a
  prefetch of the next block's experts would hold the next block's attention behind it.
- Each routed expert is copied to the stage, a hit from its cache slot (device to device):
  device time a host-routed call does not spend, small beside the host time it saves.
  grouped_mm experts compute in their slots instead where those are in the grouped GEMM's
  window (in _graphed.py, Note: [Experts computed in their slots]).
Outputs are bitwise the resident model's, as a graph call's. On the CPU no graph is captured:
every such call runs the device-routed path with the tables' updates and copies as tensor
operations, so the bookkeeping (map ownership both ways, counters, the stage) is tested
without a GPU.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from torchoffload.moe._graphed import ExpertGraphs, check_graphable, graphed_forward, tables_of
from torchoffload.moe._routing import NO_RECORDER

__all__ = ["MAX_SIGNATURES", "BlockGraphs"]

_log = logging.getLogger(__name__)

MAX_SIGNATURES = 4  # graphs kept per layer (a decode has one signature)


def _read(get: Any) -> Any:
    try:
        return get()
    except RuntimeError:  # a legacy precision flag read after the new API set it: the new
        return None  # API's own value, read too, tells the settings apart


def _settings(device: torch.device) -> tuple:
    """The global settings a captured kernel choice depends on: a graph captured under others
    would replay kernels the resident model no longer runs."""
    kind = device.type
    mm = torch.backends.cuda.matmul
    return (
        torch.is_autocast_enabled(kind),
        torch.get_autocast_dtype(kind),
        torch.are_deterministic_algorithms_enabled(),
        _read(torch.get_float32_matmul_precision),
        _read(lambda: mm.allow_tf32),
        _read(lambda: getattr(mm, "fp32_precision", None)),
        _read(lambda: getattr(torch.backends, "fp32_precision", None)),
        mm.allow_fp16_reduced_precision_reduction,
        mm.allow_bf16_reduced_precision_reduction,
        getattr(mm, "allow_fp16_accumulation", None),
        _read(torch.backends.cuda.preferred_blas_library),
    )


def _hooked(module: Any) -> bool:
    """Whether Python that must run at every call would run inside the block: hooks on a
    module of the experts (its activation), global module hooks, or a torch function or
    dispatch mode. A graph would replay what its capture saw."""
    from torch.nn.modules import module as modules

    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return True
    if modules._global_forward_hooks or modules._global_forward_pre_hooks:
        return True
    # the experts module's own hooks run around its call, replayed or not
    inner = (m for m in module.modules() if m is not module)
    return any(m._forward_hooks or m._forward_pre_hooks for m in inner)


class _Signature:
    __slots__ = ("graph", "inputs", "output", "keep", "failed")

    def __init__(self, keep: Any) -> None:
        self.graph: Any = None  # torch.cuda.CUDAGraph once captured
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.output: Any = None
        self.keep = keep  # the objects keyed by id: alive, so no other takes their id
        self.failed = False  # its capture raised: routed on the host from then on


class BlockGraphs:
    """The graphs of one runtime's block calls (Note: [Block calls replayed as graphs])."""

    def __init__(self, rt: Any):
        check_graphable(rt)
        self.rt = rt
        self.cuda = rt.device.type == "cuda"
        self.k = rt.layout.top_k
        self._graphs: dict[tuple, _Signature] = {}
        self._per_layer = [0] * len(rt.layout.layers)  # signatures kept per layer
        self._runtime = ExpertGraphs(rt)  # the capture protocol of a `cuda_graph` call
        self._pool: Any = None
        self._stream: Any = None  # the capture stream
        self._last: Any = None  # the compute stream of the last replay
        self.captures = 0
        self.replays = 0
        self.warm_ups = 0  # calls run eagerly on the device-routed path (every call on the CPU)

    def serves(self, li: int, impl: str, hidden_states: torch.Tensor,
               top_k_index: torch.Tensor) -> bool:  # fmt: skip
        """Whether this eager block call is one a block graph serves."""
        rt = self.rt
        if hidden_states.dim() != 2 or hidden_states.shape[0] != 1:
            return False
        if top_k_index.shape != (1, self.k) or torch.is_grad_enabled():
            return False
        if rt.recorder is not NO_RECORDER or rt.host is not None:
            return False
        if _hooked(rt.layout.layers[li].container):
            return False
        if self.cuda:
            if torch.cuda.is_current_stream_capturing():
                return False
            dtype = rt.layout.layers[li].members[0].dtype
            if impl == "grouped_mm" and dtype != torch.bfloat16:
                return False  # its grouped GEMM reads offsets on the host: `_graphed_kernels`
        return True

    def __call__(self, li: int, impl: str, module: Any, hidden_states: torch.Tensor,
                 top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        """The block call's output, or None where it routes on the host (a signature beyond
        the layer's graphs, or one whose capture failed)."""
        rt = self.rt
        inputs = (hidden_states, top_k_index, top_k_weights)
        act = getattr(module, "act_fn", None)
        key = (li, impl, id(module), id(act), _settings(rt.device),
               *((x.dtype, x.shape, x.stride(), x.device) for x in inputs))  # fmt: skip
        with rt._lock:
            rt._check_live()
            rt._reap()
            if rt.tables is not None:  # Note: [Routed outside a layer] in _outside.py
                rt.tables.outside.check()
            if rt.blocks[li].active:
                raise RuntimeError(
                    f"the block of {rt.layout.layers[li].name!r} was called inside itself"
                )
            entry = self._graphs.get(key)
            if entry is None and self._per_layer[li] >= MAX_SIGNATURES:
                return None
            if entry is not None and entry.failed:
                return None
            if self.cuda:  # every call of any layer in one stream order (the tables, the
                # stage and the pool are shared): a call on another stream waits for the last
                compute = torch.cuda.current_stream(rt.device)
                if self._last is not None and self._last != compute:
                    compute.wait_stream(self._last)
                self._last = compute
            if entry is None or not self.cuda:  # a warm-up; on the CPU, every call
                self._runtime.prepare_capture()  # the map to the tables, the kernel compiled
                self.warm_ups += 1
                with torch.no_grad():
                    out = graphed_forward(rt, li, module, *inputs, prefetch=False)
                if self.cuda:
                    self._graphs[key] = _Signature((module, act))
                    self._per_layer[li] += 1
                return out
            if entry.graph is None:
                try:
                    self._capture(entry, li, module, inputs)
                except Exception as e:  # Note: [A capture that fails] in weights/_graph.py
                    entry.failed = True
                    # torch 2.11 leaves a failed capture's pool recording: later captures into
                    # it fail ("already recording to mempool_id"); they take a new one
                    self._pool = torch.cuda.graph_pool_handle()
                    _log.warning(
                        "a block graph of %r could not be captured (%s: %s): its calls of this "
                        "signature route on the host", rt.layout.layers[li].name,
                        type(e).__name__, e,
                    )  # fmt: skip
                    return None
            else:
                tables_of(rt).push()  # no-op while the tables own the map
                for static, x in zip(entry.inputs, inputs, strict=True):
                    static.copy_(x)
            entry.graph.replay()
            self.replays += 1
            return entry.output.clone()

    def _capture(self, entry: _Signature, li: int, module: Any, inputs: tuple) -> None:
        from torchoffload.weights._graph import _capture_once, _static_like

        rt = self.rt
        if self._stream is None:
            self._stream = torch.cuda.Stream(rt.device)
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: written anywhere
            statics = tuple(_static_like(x) for x in inputs)

        def block(h: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return graphed_forward(rt, li, module, h, index, weights, prefetch=False)

        with torch.inference_mode(False), torch.no_grad():
            graph, output, _, _ = _capture_once(self._runtime, block, rt.engine, self._stream,
                                                statics, {}, (), pool=self._pool)  # fmt: skip
        entry.graph, entry.inputs, entry.output = graph, statics, output
        self.captures += 1

    def reset(self) -> None:
        """The counters to zero (the handle's ``reset_stats``)."""
        self.captures = self.replays = self.warm_ups = 0
