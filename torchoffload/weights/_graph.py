"""A streamed call replayed as a CUDA graph, its weight copies captured in it.

```python
handle = torchoffload.stream_weights(model, "cuda", budget_bytes=4 << 30)
step = handle.cuda_graph(lambda ids, pos: model(ids, cache_position=pos, ...).logits)
for _ in range(n):
    logits = step(ids, pos)   # 1st call of a shape: eager; 2nd: captured; then replayed
```

Note: [Captured calls by signature]
A graph is captured per *signature* of the arguments: for a tensor its shape, stride, dtype,
device, whether it is an inference tensor and whether it requires grad; for anything else its
type and value (hashable objects by their own equality, so an object such as a KV cache is
matched by identity, and the graph keeps it alive). The first call of a signature runs eagerly
(a warm-up: lazy initialization, the weight schedule, kept units), the second is captured and
replayed, later ones are replayed. Each call runs the function's work once. Tensor arguments
are copied into the graph's static inputs before a replay (but those it writes in place: Note:
[Arguments written in place]); the outputs are the graph's static outputs, overwritten by its
next replay (clone to keep them), as with any CUDA graph. A new signature captures a new graph,
up to ``max_graphs``; beyond that calls run eagerly (``stats().eager_calls``). Control flow that
depends on tensor values is fixed at capture, as in any CUDA graph: such a function must be
captured per branch by the caller. Weights are never stale: ring weights are copied from the
host store in every replay and kept units are checked before it (Note: [Weights in a
captured graph] in _capture.py).

On the CPU (no CUDA graphs) a "replay" runs the function again with the runtime in capture
mode, so the bookkeeping (static inputs and outputs, the ring reset, kept units, counters)
is tested without a GPU; the run that stands for the capture refuses what a capture would
(Note: [Host reads in a captured call] in _syncs.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchoffload._transfer import CopyEngine
from torchoffload._validate import check_bool, check_callable, check_int
from torchoffload.weights._arena import Counters
from torchoffload.weights._capture import Primes
from torchoffload.weights._syncs import HostReadCheck, is_compiled

__all__ = ["GraphRuntime", "GraphStats", "StreamedGraph"]

_log = logging.getLogger(__name__)
# An inference tensor argument this large may be state the function writes (a KV cache), which
# the graph cannot see: warned at capture (Note: [Arguments written in place]).
_WARN_INFERENCE_BYTES = 1 << 20


@dataclass(frozen=True)
class GraphStats:
    """What a `StreamedGraph` did since it was made."""

    graphs: int  # signatures captured
    captures: int
    replays: int
    eager_calls: int  # warm-ups and calls beyond max_graphs
    h2d_bytes_per_replay: tuple[int, ...]  # per graph, in capture order
    primed_units: tuple[int, ...]  # per graph: first units its previous replay copied
    prime_loads: int  # replays whose primes were copied eagerly first (not left by a replay)


# Note: [Arguments written in place]
# A tensor argument is copied into a static input of the graph before a replay. An argument that
# the function writes in place (a KV cache passed as a tensor) must not be: the writes would go to
# the copy, the caller's tensor would never see them, and the next call would copy the stale tensor
# over them (a CPU test saw a counter stay at 1 over four calls). Such an argument is found by its
# version counter (``Tensor._version``, which every in-place op and a compiled function's write of
# an input bump) across the warm-up call, and the graph then reads and writes that tensor itself:
# later calls must pass the same tensor there (the same memory: a new view of it will do), and
# another one is refused before anything runs. A write the warm-up did not show is seen the same
# way at the capture (on the CPU, at each run), on the static copies: that graph is dropped (on the
# CPU, where the call ran, the write is copied back to the caller's tensor) and the next call
# captures the argument in place. Not seen: a write to a tensor made under `torch.inference_mode`,
# which has no counter (make such state outside it, as a KV cache usually is; a capture under
# inference mode warns about an inference tensor argument of 1 MiB or more), and, under inference
# mode, a write the warm-up did not show to an inference tensor argument (its static copy is one:
# Note: [Static inputs mirror their arguments]). Not used, though it would see those: a
# dispatch mode that records writes (Dynamo does not compile a function called under one, so
# `cuda_graph(torch.compile(model))` would run eagerly: seen on the CPU).

# Note: [Static inputs mirror their arguments]
# A static input is made as its argument was: a normal tensor for a normal one, even under
# `torch.inference_mode`, and requiring grad only if the argument does. Dynamo guards a compiled
# function's tensor inputs on their dispatch keys and ``requires_grad``; a static input made
# otherwise than the warm-up call's argument (a prompt made outside inference mode, decoded
# inside it) fails those guards, so the capture compiles the function again, and Inductor's
# compile syncs the host (constant folding calls ``.item()``), which a capture forbids (seen on
# an H200: `handle.cuda_graph` of a `compile_streamed` program failed its first capture with
# "operation not permitted when stream is capturing"). One exception, for correctness: an
# inference tensor argument called outside inference mode gets a normal static input, whose
# version counter shows a write the warm-up could not (Note: [Arguments written in place]); a
# compiled function then compiles again at the capture, which raises rather than misleads. A
# static inference tensor is written, at a replay outside inference mode, inside it (the only
# place it may be). Whether an argument is an inference tensor, and whether it requires grad,
# are part of a graph's signature (Note: [Captured calls by signature]): a normal tensor
# passed where the capture saw an inference one gets its own warm-up, which sees its writes,
# and its own static input, rather than a copy into a static input that has no version
# counter.

# Note: [A capture that fails]
# A function that does something a capture forbids (a host sync such as ``.item()``, an event
# query) fails inside the capture, and CUDA then fails the end of the capture as well. Two things
# follow in PyTorch (2.11): the error that reaches the caller is the second one ("operation failed
# due to a previous error during capture"), which hides the cause; and `CUDAGraph.capture_end`
# raises before it takes the device's random generators out of capture mode, so every later random
# op on that device raises "Offset increment outside graph capture encountered unexpectedly" (seen
# on an H100: a failed capture broke the next test's `torch.randint`). So the function's own error
# is raised (the capture's is added as a note), and after a capture whose end raised, an empty
# capture on the same stream, whose start and end run the generators' capture prologue and
# epilogue, restores them (harmless where PyTorch keeps generator state per capture). The capture
# is begun and ended here rather than with `torch.cuda.graph`, whose exit skips restoring the
# caller's current stream when the end of the capture raises. Not undone: in PyTorch 2.11 the same
# early raise also skips ending the caching allocator's allocation to the capture's memory pool,
# and the pool is never released (fixed in later releases: PyTorch PRs 180395 and 190348), so
# the allocator keeps some memory and behaves as if a capture were still running (it defers
# freeing blocks used on other streams). Nothing is held by the graph after a failed capture, and
# its signature is captured again at its next call, which fails the same way: fix the function
# rather than retry it.

# Note: [Nothing collected during a capture]
# Destroying a CUDA graph (`CUDAGraph.reset`, run when its Python object is freed) calls
# `cudaGraphDestroy`, which CUDA forbids on the capturing thread while a capture runs: it fails
# with "operation not permitted when stream is capturing" (printed as a warning, "(function
# reset)") and invalidates the capture, whose first kernel then fails with "operation failed due
# to a previous error during capture". Python's cyclic collector runs whenever allocations cross
# its threshold, so any graph that only a reference cycle keeps (a failed capture's graph, held
# by its exception's traceback; a handle the caller dropped) can be freed inside an unrelated
# capture: seen as a flaky expert-graph fuzz run on an H200, a capture failing at its first
# kernel after refused captures. The collector is off while any capture runs (on any thread;
# restored as it was before the first), and a graph whose capture failed is reset at once,
# outside any capture. `torch.cuda.graph` collects before its capture but not during it.


class GraphRuntime(Protocol):
    """What a `StreamedGraph` needs of the runtime whose copies it captures: `WeightRuntime`
    (stream_weights) and the expert runtime's driver (stream_experts) implement it."""

    device: torch.device
    engine: Any  # the eager copy engine (its test instruments are shared with the graph's)

    @property
    def removed(self) -> bool: ...

    def graph_ready(self) -> bool:
        """Whether a signature's next call may be captured (else it runs as a warm-up)."""
        ...

    def graph_state(self) -> Any:
        """What a captured graph relies on (a graph captured under another state is captured
        again); passed back to `graph_replaying`."""
        ...

    def primes(self) -> Primes: ...

    def prepare_capture(self, primes: Primes = ()) -> None: ...

    def start_capture(self, engine: Any, primes: Primes = ()) -> None: ...

    def finish_capture(self) -> Primes: ...

    def end_capture(self, keep: Primes = ()) -> Counters: ...

    def graph_replaying(self, state: Any, primes: Primes = ()) -> Any:
        """A context manager around a replay's launch, yielding an object with ``loaded``
        (units copied eagerly first) and ``primes`` (left loaded for the next replay)."""
        ...

    def count_replay(self, delta: Counters) -> None: ...


# Note: [The model a graph was captured with]
# A captured graph reads every tensor of the model at the address it had at the capture: a
# resident tensor's storage, a streamed tensor's through the arena its unit binds. The user
# may still change what the model holds, as on the resident model: assign a new tensor
# (``module.weight = nn.Parameter(w)``, ``load_state_dict(assign=True)`` of resident keys), a
# resident tensor's storage (``p.data = x``, ``p.set_(x)``), or a submodule. The eager call
# then computes with the new tensors (Note: [Placeholders never answer] for streamed ones),
# but a replay would read the old addresses: outputs silently those of the old model (found by
# the fuzzer on an H100: stream_experts' graph after ``model.emb.weight = nn.Parameter(...)``,
# 0.52 off; a freed tensor's memory may even hold other bytes by then). So a capture records
# what every module holds (`_Bindings`: each parameter, buffer and submodule slot, and a
# plain tensor's data pointer; an engine's tensors by identity), and a call whose model no
# longer holds it is captured again: the new graph reads the new tensors, as the eager call
# does. In-place writes keep the address and need nothing. Before each replay the plain
# tensors' data pointers are compared; the slots are walked only when a parameter, buffer or
# submodule was registered on some module since (torch's global registration hooks count
# them, and ``module.x = ...`` and ``load_state_dict(assign=True)`` register): walking every
# slot took 0.6 us a slot on a loaded 2-core CPU host. The pointers alone, on an H200
# machine's host: 21 us for the demo GPT's 163 slots, 25 us for a Llama-3.1-8B shape's 940,
# 47 us for a Qwen3-30B-A3B shape's 1404, every tensor resident (a streamed one is not
# read); the demo's streamed decode replayed at 1.16 ms a token with the check, 1.15 without
# (benchmarks/log/2026-11-27-session23-gpu-fuzzer.md). A write into a module's
# ``_parameters`` dict itself registers nothing and is not seen.


_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)  # subclasses: by identity
_REGISTRATIONS = [0, False]  # parameters, buffers and submodules registered; hooks installed


def _count_registration(*_: Any) -> None:
    _REGISTRATIONS[0] += 1


def _registrations() -> int:
    """How many parameters, buffers and submodules were registered on any module since the
    hooks were installed (by the first call)."""
    if not _REGISTRATIONS[1]:
        from torch.nn.modules import module

        module.register_module_parameter_registration_hook(_count_registration)
        module.register_module_buffer_registration_hook(_count_registration)
        module.register_module_module_registration_hook(_count_registration)
        _REGISTRATIONS[1] = True
    return _REGISTRATIONS[0]


class _Bindings:
    """What every module of ``model`` holds at a capture (Note: [The model a graph was captured
    with]); `held()` says whether it still does."""

    __slots__ = ("slots", "plain", "ptrs", "seen")

    def __init__(self, model: Any) -> None:
        from torchoffload._hosted import HOSTED
        from torchoffload.weights._binding import STREAMED

        self.seen = _registrations()
        self.slots: list[tuple[dict, str, Any]] = []
        self.plain: list[torch.Tensor] = []
        self.ptrs: list[int] = []
        if model is None:
            return
        for m in model.modules():
            for held in (m._parameters, m._buffers, m._modules):
                for name, x in held.items():
                    self.slots.append((held, name, x))
                    # an engine's tensor is bound to other bytes at each call, and its storage
                    # cannot be set (Note: [Placeholders never answer]): its identity only
                    if type(x) in _PLAIN and x not in STREAMED and x not in HOSTED:
                        self.plain.append(x)
        self.ptrs = list(map(torch.Tensor.data_ptr, self.plain))

    def held(self) -> bool:
        now = _REGISTRATIONS[0]
        if now != self.seen:  # something was registered somewhere: every slot checked
            for held, name, x in self.slots:
                if held.get(name) is not x:
                    return False
            self.seen = now
        # every replay reads it: one list compare (437 tensors of a 48-layer model: ~40 us
        # against ~110 for a generator of comparisons)
        return list(map(torch.Tensor.data_ptr, self.plain)) == self.ptrs


class _Captured:
    __slots__ = (
        "graph", "inputs", "positions", "outputs", "delta", "fn_args", "arena", "primes",
        "written", "held", "bindings",
    )  # fmt: skip

    def __init__(self, written: frozenset[int] = frozenset()) -> None:
        self.graph: Any = None  # torch.cuda.CUDAGraph, or None before the capture
        self.inputs: list[torch.Tensor] = []  # static copies of the tensor arguments
        self.positions: list[int] = []  # where they are among the flattened arguments
        # Note: [Arguments written in place]: positions written, and the memory the graph holds
        self.written: frozenset[int] = written
        self.held: list[tuple[int, Any, int]] = []  # (position, storage, data_ptr)
        self.outputs: Any = None
        self.delta = Counters()
        self.fn_args: Any = None  # (args, kwargs) over the static inputs (the CPU replay)
        self.arena: Any = None  # the runtime's `graph_state()` at capture
        self.primes: Primes = ()  # units a replay finds loaded (Note: [Primed replays])
        self.bindings = _Bindings(None)  # Note: [The model a graph was captured with]


class StreamedGraph:
    """``fn`` (which calls the streamed model) replayed as CUDA graphs, one per argument
    signature (Note: [Captured calls by signature]). Made by `WeightStreamHandle.cuda_graph`
    (and `ExpertStreamHandle.cuda_graph`); ``handle`` is the handle that made it, whose
    ``remove()`` undoes the engine the graph replays (`verify` removes it after its run)."""

    def __init__(self, runtime: GraphRuntime, fn: Any, *, max_graphs: int = 8, prime: bool = True,
                 handle: Any = None, model: Any = None):  # fmt: skip
        check_callable("fn", fn, optional=False)
        check_int("max_graphs", max_graphs, minimum=1)
        check_bool("prime", prime)
        self.prime = prime
        self._rt = runtime
        self._fn = fn
        self.handle = handle
        self._model = model  # Note: [The model a graph was captured with]
        self.max_graphs = max_graphs
        self.device = runtime.device
        self._cuda = self.device.type == "cuda"
        self._graphs: dict[Any, _Captured] = {}
        self._engine: CopyEngine | None = None  # the graphs' own copy stream
        self._stream: Any = None  # the capture stream
        self._captures = 0
        self._replays = 0
        self._eager = 0
        self._prime_loads = 0
        self._lock = threading.RLock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # static inputs and outputs are shared: one call at a time
            return self._call(args, kwargs)

    def _call(self, args: Any, kwargs: Any) -> Any:
        rt = self._rt
        if rt.removed:
            raise RuntimeError("the handle of this graph was removed")
        leaves, spec = tree_flatten((args, kwargs))
        cuda = self.device if self._cuda else None
        key = (spec, tuple(_describe(i, x, cuda) for i, x in enumerate(leaves)))
        entry = self._graphs.get(key)
        if entry is None or not rt.graph_ready():  # a warm-up (stream_weights: no schedule yet)
            versions = _versions(leaves)
            out = self._eagerly(args, kwargs)
            if entry is None and len(self._graphs) < self.max_graphs:
                # after it returned: a failed one is no warm-up
                entry = self._graphs[key] = _Captured()
            if entry is not None:  # Note: [Arguments written in place]
                entry.written |= _bumped(leaves, versions, range(len(leaves)))
            return out
        for i, _storage_kept, ptr in entry.held if entry.graph is not None else ():
            if leaves[i].data_ptr() != ptr:  # the memory captured: a new view of it will do
                raise ValueError(
                    f"argument {i} of the graphed call is written in place by the function, so "
                    "its graph reads and writes the tensor it was captured with: pass that "
                    "same tensor at every call of this signature (Note: [Arguments written in "
                    "place])"
                )
        with torch.no_grad():
            if entry.graph is not None and (
                entry.arena != rt.graph_state() or not entry.bindings.held()
            ):  # kept units moved, or the model holds other tensors: capture again
                entry = self._graphs[key] = _Captured(entry.written)
            if entry.graph is None:
                self._capture(entry, leaves, spec)
            else:
                for i, static in zip(entry.positions, entry.inputs, strict=True):
                    if leaves[i] is not static:
                        _write(static, leaves[i])
            self._replay(entry, leaves)
        if entry.graph is None:  # a write seen only now: captured again in place next call
            self._graphs[key] = _Captured(entry.written)
        return entry.outputs

    def stats(self) -> GraphStats:
        done = [e for e in self._graphs.values() if e.graph is not None]
        return GraphStats(
            graphs=len(done),
            captures=self._captures,
            replays=self._replays,
            eager_calls=self._eager,
            h2d_bytes_per_replay=tuple(e.delta.h2d_bytes for e in done),
            primed_units=tuple(len(e.primes) for e in done),
            prime_loads=self._prime_loads,
        )

    def reset(self) -> None:
        """Drop every captured graph (and its memory); the next call of each signature is
        a warm-up again."""
        with self._lock:
            self._graphs.clear()

    def __repr__(self) -> str:
        s = self.stats()
        return f"StreamedGraph({s.graphs} graphs, {s.replays} replays, on {self.device})"

    # -- internals -----------------------------------------------------------------------------

    def _eagerly(self, args: Any, kwargs: Any) -> Any:
        self._eager += 1
        with torch.no_grad():
            return self._fn(*args, **kwargs)

    def _capture(self, entry: _Captured, leaves: list[Any], spec: Any) -> None:
        statics = list(leaves)
        entry.positions, entry.inputs, entry.held = [], [], []  # a failed capture left nothing
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and i in entry.written:
                # Note: [Arguments written in place]: its storage kept alive, its address
                entry.held.append((i, x.untyped_storage(), x.data_ptr()))
            elif isinstance(x, torch.Tensor):
                big = x.nbytes >= _WARN_INFERENCE_BYTES
                if big and x.is_inference() and torch.is_inference_mode_enabled():
                    warnings.warn(
                        f"argument {i} of the graphed call is an inference tensor of "
                        f"{x.nbytes / 2**20:.1f} MiB: if the function "
                        "writes it in place (a KV cache), the graph cannot see that (an "
                        "inference tensor has no version counter) and its writes go to the "
                        "graph's copy. Make such state outside torch.inference_mode (Note: "
                        "[Arguments written in place])",
                        stacklevel=4,
                    )
                statics[i] = s = _static_like(x)
                entry.positions.append(i)
                entry.inputs.append(s)
        entry.arena = self._rt.graph_state()
        entry.bindings = _Bindings(self._model)
        args, kwargs = tree_unflatten(statics, spec)
        entry.fn_args = (args, kwargs)
        primes = self._rt.primes() if self.prime else ()  # Note: [Primed replays]
        if not self._cuda:
            entry.graph = "host"  # its first replay sets the outputs
            entry.primes = primes
            self._captures += 1
            return
        if self._engine is None:
            self._engine = CopyEngine(self.device)
            self._stream = torch.cuda.Stream(self.device)
        versions = _versions(entry.inputs)
        graph, outputs, delta, end = self._capture_once(args, kwargs, primes)
        written = _bumped(entry.inputs, versions, entry.positions)
        if written:  # Note: [Arguments written in place]: nothing ran; capture it in place
            graph.reset()
            entry.written |= written
            self._capture(entry, leaves, spec)
            return
        if end != primes:  # not expected: the capture places them; never trusted
            _log.warning("a primed capture left %s, not %s: captured unprimed", end, primes)
            graph.reset()
            primes = ()
            graph, outputs, delta, _ = self._capture_once(args, kwargs, ())
        entry.graph, entry.outputs, entry.delta, entry.primes = graph, outputs, delta, primes

    def _capture_once(self, args: Any, kwargs: Any, primes: Primes) -> tuple:
        out = _capture_once(self._rt, self._fn, self._engine, self._stream, args, kwargs, primes)
        self._captures += 1
        return out

    def _run_on_host(self, entry: _Captured) -> Any:
        """The CPU stand-in for a capture and for a replay: the call run in capture mode (see
        the module doc). Returns its output; ``entry.delta`` is what it counted."""
        rt = self._rt
        args, kwargs = entry.fn_args
        rt.prepare_capture(entry.primes)
        end: Primes = ()
        check = entry.outputs is None and not is_compiled(self._fn)  # the capture's stand-in
        try:
            rt.start_capture(rt.engine, entry.primes)
            with HostReadCheck() if check else contextlib.nullcontext():
                out = self._fn(*args, **kwargs)  # Note: [Host reads in a captured call]
            end = rt.finish_capture()
        finally:
            entry.delta = rt.end_capture(keep=end)
        if end != entry.primes:  # as `_capture` does: the unprimed call from now on
            _log.warning("a primed call left %s, not %s: unprimed", end, entry.primes)
            entry.primes = ()
        return out

    def _replay(self, entry: _Captured, leaves: list[Any]) -> None:
        with self._rt.graph_replaying(entry.arena, entry.primes) as r:
            self._prime_loads += r.loaded > 0
            if self._cuda:
                entry.graph.replay()
            else:
                versions = _versions(entry.inputs)
                try:
                    out = self._run_on_host(entry)
                except BaseException:
                    if entry.outputs is None:  # its first run, as a failed capture: none
                        entry.graph = None
                    raise
                written = _bumped(entry.inputs, versions, entry.positions)
                if written:  # Note: [Arguments written in place]: this call's writes kept
                    entry.written |= written
                    entry.graph = None  # first: a failed copy below still recaptures
                    for i, static in zip(entry.positions, entry.inputs, strict=True):
                        if i in written:
                            _write(leaves[i], static)
                r.primes = entry.primes
                outs, spec = tree_flatten(out)
                if entry.outputs is None:
                    entry.outputs = tree_unflatten(
                        [x.clone() if isinstance(x, torch.Tensor) else x for x in outs], spec
                    )
                else:
                    for static, x in zip(tree_flatten(entry.outputs)[0], outs, strict=True):
                        if isinstance(static, torch.Tensor):
                            _write(static, x)  # made under inference mode, maybe
        self._rt.count_replay(entry.delta)
        self._replays += 1


def _describe(i: int, x: Any, device: torch.device | None) -> Any:
    """Argument ``i``'s part of a call's signature (Note: [Captured calls by signature]);
    ``device``: the CUDA device a graph reads tensors on (None on the CPU)."""
    if isinstance(x, torch.Tensor):
        if device is not None and x.device != device:
            raise ValueError(
                f"argument {i} of the graphed call is on {x.device}: tensors a CUDA graph "
                f"reads must be on {device} (a host value would be baked in)"
            )
        # inference-ness and requires_grad too: a static input mirrors them (Note: [Static
        # inputs mirror their arguments]), so another kind of tensor is another graph
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device, x.is_inference(),
                x.requires_grad)  # fmt: skip
    try:
        hash(x)
    except TypeError:
        raise TypeError(
            f"argument {i} of the graphed call is a {type(x).__name__}, which is neither a "
            "tensor nor hashable: a graph is keyed by its arguments (Note: [Captured calls "
            "by signature])"
        ) from None
    return (type(x), x)


def _capture_once(rt: GraphRuntime, fn: Any, engine: CopyEngine, stream: Any, args: Any,
                  kwargs: Any, primes: Primes, pool: Any = None) -> tuple:  # fmt: skip
    """One capture of ``fn(*args, **kwargs)`` on ``stream``, its copies on ``engine``, started
    with ``primes`` loaded, its memory from ``pool`` (a `torch.cuda.graph_pool_handle`; None:
    its own); returns the graph, its outputs, what a replay counts and the units it leaves
    loaded (Note: [Primed replays], Note: [A capture that fails])."""
    device = rt.device
    engine.testing = rt.engine.testing  # the test instruments of the shared one
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(device))
    rt.prepare_capture(primes)
    end: Primes = ()
    raised: BaseException | None = None  # what fn raised, if it did
    ended_in_error = False  # the end of the capture raised (Note: [A capture that fails])
    reraise: BaseException | None = None
    torch.cuda.empty_cache()  # as torch.cuda.graph does: the capture allocates in its own pool
    with _no_collection():  # Note: [Nothing collected during a capture]
        try:
            # not torch.cuda.graph: its exit leaves the capture stream current when the end of
            # the capture raises (Note: [A capture that fails])
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    rt.start_capture(engine, primes)
                    try:
                        outputs = fn(*args, **kwargs)
                    except BaseException as e:
                        raised = e
                        raise
                    finally:  # joined even when fn raises: the capture ends with its error
                        end = rt.finish_capture()
                finally:
                    try:
                        graph.capture_end()
                    except BaseException:
                        ended_in_error = True
                        raise
        except BaseException as e:  # Note: [A capture that fails]
            _reset_quietly(graph)  # Note: [Nothing collected during a capture]
            if ended_in_error:
                _restore_generators(stream)
            if raised is None or e is raised:
                raise
            if hasattr(raised, "add_note"):  # Python 3.11+
                raised.add_note(f"(raised while handle.cuda_graph captured the call; then "
                                f"{type(e).__name__}: {e})")  # fmt: skip
            reraise = raised  # raised below, outside this handler: its own context kept
        finally:  # a capture runs nothing: the primes loaded before it are still there
            delta = rt.end_capture(keep=primes if end == primes else ())
    if reraise is not None:
        raise reraise
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, outputs, delta, end


_COLLECTION = threading.Lock()
_PAUSED = {"depth": 0, "was_enabled": False}  # captures running on any thread


@contextlib.contextmanager
def _no_collection() -> Any:
    """The cyclic collector off while any capture runs, on any thread, and restored as it was
    before the first (Note: [Nothing collected during a capture])."""
    with _COLLECTION:
        if _PAUSED["depth"] == 0:
            _PAUSED["was_enabled"] = gc.isenabled()
            gc.disable()
        _PAUSED["depth"] += 1
    try:
        yield
    finally:
        with _COLLECTION:
            _PAUSED["depth"] -= 1
            if _PAUSED["depth"] == 0 and _PAUSED["was_enabled"]:
                gc.enable()


def _reset_quietly(graph: Any) -> None:
    """Free what a graph whose capture failed holds, now that no capture runs (Note: [Nothing
    collected during a capture]); its own failure is not the error to report."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph.reset()
    except Exception:
        _log.debug("reset of a failed capture's graph raised", exc_info=True)


def _restore_generators(stream: Any) -> None:
    """Note: [A capture that fails]: an empty capture on ``stream`` takes the device's CUDA
    random generators out of the capture mode that a failed capture left them in."""
    if torch.cuda.is_current_stream_capturing():
        return  # inside someone else's capture: nothing can be captured here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
                pass
            g.reset()
    except Exception:  # the capture's own error is the one to report
        _log.warning("could not restore the CUDA generators after a failed capture",
                     exc_info=True)  # fmt: skip


def _static_like(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in new memory of its layout, an inference tensor only if ``x`` is one
    and inference mode is on, requiring grad only if ``x`` does (Note: [Static inputs mirror
    their arguments])."""
    inference = x.is_inference() and torch.is_inference_mode_enabled()
    with torch.inference_mode(inference), torch.no_grad():
        s = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
    return s.requires_grad_() if x.requires_grad else s


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, inside inference mode if ``dst`` is an inference tensor (the only
    place it may be written): a static input before a replay, a static output after one on the
    CPU, a caller's tensor written back (Note: [Static inputs mirror their arguments])."""
    if dst.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            dst.copy_(src)
    else:
        dst.copy_(src)


def _versions(xs: list[Any]) -> list[int | None]:
    """Version counters of the tensors of ``xs`` (None: not a tensor, or an inference tensor,
    which has none)."""
    return [
        x._version if isinstance(x, torch.Tensor) and not x.is_inference() else None for x in xs
    ]


def _bumped(xs: list[Any], versions: list[int | None], positions: Any) -> frozenset[int]:
    """The positions of the tensors of ``xs`` written in place since ``versions`` was read."""
    return frozenset(
        p for p, x, v in zip(positions, xs, versions, strict=True)
        if v is not None and x._version != v
    )  # fmt: skip
