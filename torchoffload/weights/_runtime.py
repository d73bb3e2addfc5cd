"""The weight runtime: the host store, the arena, the schedule and the call protocol, built from
a `Layout`. Eager module hooks, the exported-program runner and compiled programs drive it
through one package-internal API:

- ``begin_call(frame)`` / ``end_call(ok)`` bracket one call of the whole program;
- ``enter(i, frame)`` / ``exit(i, output)`` bracket the use of unit ``i``'s weights (a unit
  entered outside a call makes a call of its own);
- ``host_value`` / ``write_host`` read and write the real values of streamed tensors;
- ``prepare_capture`` / ``start_capture`` / ``finish_capture`` / ``end_capture`` around a
  captured call and ``replaying(kept)`` around each replay.

`WeightRuntime` builds its parts from the layout and the config and hands each the others it
uses: the host store (_store.py), the binding of the model's tensors (_binding.py), the unit
pipeline over the arena and the schedule (_pipeline.py), the call protocol (_call.py) and
capture and replay (_capture.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from torchoffload._flatten import is_composite
from torchoffload._pool import pinned_buffer
from torchoffload._transfer import WaitTimer, copy_engine
from torchoffload._validate import check_bool, check_int, physical_memory
from torchoffload.weights._arena import Arena, Counters, UnitState
from torchoffload.weights._binding import STREAMED, Binding
from torchoffload.weights._call import Calls
from torchoffload.weights._capture import Capture, Primes
from torchoffload.weights._checkpoint import Checkpoint
from torchoffload.weights._layout import Layout, Slot
from torchoffload.weights._pipeline import Pipeline
from torchoffload.weights._schedule import Schedule
from torchoffload.weights._store import HostStore, fill_host, fill_hosted, read_plan

__all__ = ["STREAMED", "StreamConfig", "WeightRuntime"]


@dataclass(frozen=True)
class StreamConfig:
    """The settings of one weight runtime (`stream_weights` documents each)."""

    device: torch.device
    budget_bytes: int
    prefetch_depth: int = 2
    use_streams: bool = True
    pin_memory: bool = True
    time_waits: bool = False

    def __post_init__(self) -> None:
        total, what = _device_memory(self.device)
        check_int("budget_bytes", self.budget_bytes, minimum=1, maximum=total, limit=what)
        check_int("prefetch_depth", self.prefetch_depth, minimum=0)
        for name in ("use_streams", "pin_memory", "time_waits"):
            check_bool(name, getattr(self, name))


def _device_memory(device: torch.device) -> tuple[int | None, str]:
    """The most bytes an arena on ``device`` could take, and what that limit is."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"the memory of {device}"
    if device.type == "cpu":
        return physical_memory(), "this host's physical memory"
    return None, ""


class WeightRuntime:
    """One model's streamed weights. Construct it from a layout; drive it through the API in
    the module docstring."""

    def __init__(
        self,
        layout: Layout,
        config: StreamConfig,
        checkpoint: Checkpoint | None = None,
        *,
        strict: bool = True,
    ):
        """``checkpoint``: read the values of the tensors it holds from it (the model may be
        on the meta device; Note: [Reading into the host store] in _checkpoint.py). A tensor
        it lacks is an error, or with ``strict=False`` keeps its own values (Note: [Tensors a
        checkpoint lacks] in _store.py)."""
        dev = config.device
        self.config = config
        self.device = dev
        self.layout = layout
        # - Copies and counters
        self.engine = copy_engine(dev, use_streams=config.use_streams)
        self.counters = Counters()
        self.waits = WaitTimer()
        self.time_waits = config.time_waits and dev.type == "cuda"
        for slot in layout.resident:  # checked before anything changes
            if is_composite(slot.tensor) and slot.tensor.device != dev:
                raise ValueError(
                    f"resident {slot.name!r} is a {type(slot.tensor).__qualname__} on "
                    f"{slot.tensor.device}: move it to {dev} before stream_weights"
                )
        # - Host store: every streamed storage once, in the pieces of the layout
        reads, resident_values, hosted = read_plan(layout, checkpoint, strict=strict)
        pin = config.pin_memory and torch.accelerator.is_available() and dev.type != "cpu"
        host = pinned_buffer(layout.host_bytes, pin=pin)
        fill_host(host, layout, checkpoint, reads)
        # - Units, the arena and the parts that move them
        self.units = [UnitState(u, i, host) for i, u in enumerate(layout.units)]
        arena = Arena(layout.arena_bytes(config.budget_bytes), dev, self.engine, self.counters)
        self.schedule = Schedule()
        self.binding = Binding(layout, dev)
        self.pipeline = Pipeline(dev, config.prefetch_depth, self.units, arena, self.schedule,
                                 self.engine, self.counters, self.binding, self.waits,
                                 self.time_waits)  # fmt: skip
        self.calls = Calls(self.pipeline)  # Note: [One call at a time]
        self.capture = Capture(self.pipeline, self.calls)
        self.store = HostStore(layout, host, self.calls, self.pipeline)
        # - Module state changed until `restore()`
        self.resident_bytes = self.binding.setup(self, self.store, arena.storage, self.units,
                                                 resident_values)  # fmt: skip
        self.resident_names = [q for s in layout.resident for _, _, q in s.where]
        # See Note: [Checkpoint entries of tensors another engine hosts] in _store.py
        fill_hosted(checkpoint, hosted)
        if dev.type != "cpu":
            torch.get_device_module(dev.type).synchronize(dev)

    # -- state the handle, the graphs and tests read -----------------------------------------

    @property
    def arena(self) -> Arena | None:
        return self.pipeline.arena

    @property
    def host(self) -> torch.Tensor | None:
        """The pinned host store (None once removed)."""
        return self.store.host

    @property
    def removed(self) -> bool:
        return self.calls.removed

    @property
    def capturing(self) -> bool:
        """A call is being captured (Note: [Weights in a captured graph])."""
        return self.pipeline.state.capturing

    @property
    def _lock(self) -> Any:
        return self.calls.lock

    @property
    def _call(self) -> Any:
        return self.calls.current

    def _check_live(self) -> None:
        self.calls.check_live()

    # -- calls (Note: [One call at a time]) ----------------------------------------------------

    def begin_call(self, frame: FrameType | None) -> None:
        self.calls.begin_call(frame)

    def end_call(self, ok: bool) -> None:
        self.calls.end_call(ok)

    def enter(self, index: int, frame: FrameType | None) -> None:
        self.calls.enter(index, frame)

    def exit(self, index: int, output: Any) -> None:
        self.calls.exit(index, output)

    # -- CUDA graphs (Note: [Weights in a captured graph]) ------------------------------------

    def prepare_capture(self, primes: Primes = ()) -> None:
        self.capture.prepare(primes)

    def start_capture(self, engine: Any, primes: Primes = ()) -> None:
        self.capture.start(engine, primes)

    def finish_capture(self) -> Primes:
        return self.capture.finish()

    def end_capture(self, keep: Primes = ()) -> Counters:
        return self.capture.end(keep)

    def replaying(self, kept: list[int], primes: Primes = ()):
        return self.capture.replaying(kept, primes)

    # - the `GraphRuntime` protocol of `StreamedGraph` (the rest is above)
    def graph_ready(self) -> bool:
        return self.schedule.order is not None  # the first call made the schedule

    def graph_state(self) -> Any:
        """The arena's split into ring and kept places, which a captured graph relies on (a
        capture keeps nothing new: this holds until replays)."""
        kept = tuple((u.index, u.fixed) for u in self.units if u.fixed is not None)
        return self.arena.ring_cap, kept

    def graph_replaying(self, state: Any, primes: Primes = ()):
        return self.replaying([index for index, _ in state[1]], primes)

    def primes(self) -> Primes:
        return self.capture.primes()

    def count_replay(self, delta: Counters) -> None:
        self.capture.count_replay(delta)

    # -- the real values (state_dict, load_state_dict) -----------------------------------------

    def copies_for(self, destination: Any) -> dict[Any, torch.Tensor]:
        return self.store.copies_for(destination)

    def host_value(self, slot: Slot, cache: dict[Any, torch.Tensor]) -> torch.Tensor:
        return self.store.host_value(slot, cache)

    def write_host(self, slot: Slot, value: Any) -> str | None:
        return self.store.write_host(slot, value)

    # -- remove ----------------------------------------------------------------------------

    def restore(self, keep_values: bool = True) -> None:
        """Put every tensor back where it was (its device, dtype and values; parameters keep
        their identity) and free the arena and the host store. Idempotent. ``keep_values=False``
        frees without copying the values back (tensors nobody else holds)."""
        with self.calls.lock:
            if self.calls.removed:
                return
            self.calls.wait_idle("remove()")
            self.calls.removed = True
            self.pipeline.sync()
            self.binding.unregister()  # plain tensors again before they are rebound
            if keep_values:
                with torch.inference_mode(False), torch.no_grad():
                    self.binding.restore(self.store.host)
            for slot in self.layout.streamed:
                STREAMED.pop(slot.tensor, None)
            self.pipeline.forget()
            self.pipeline.arena = None  # type: ignore[assignment]
            self.store.host = None  # type: ignore[assignment]
            for unit in self.units:
                unit.segments.clear()
