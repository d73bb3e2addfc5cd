"""Parameters whose values live in host memory: the contract between the engine that streams
them to the device for training (`torchoffload.stream_parameters`) and the host optimizer that
steps them (`torchoffload.OffloadedOptimizer`).

Note: [Hosted parameters]
A streamed training parameter keeps its identity (the `nn.Parameter` the optimizer holds) but
holds device bytes only while its unit runs forward or backward; the rest of the time it is an
empty tensor on the device and its real values are its ``host`` view in the pinned host store.
So the optimizer reads and writes that view instead of the device tensor:
- it reads a master from ``host`` (at construction, after ``version`` changed, and on
  `reload_parameters`);
- it writes the new value into ``host`` after its step (rounded to the parameter's dtype), after
  `before_write()`, which waits (on the host, on the optimizer's worker) for the last copy that
  read those bytes to the device. The next forward loads the new bytes.
Nothing else writes ``host`` while the optimizer may; a write from elsewhere (a
``load_state_dict`` of the model) bumps ``version``, so the optimizer reads it again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary


class Hosted:
    """The host side of one streamed training parameter (Note: [Hosted parameters])."""

    __slots__ = ("host", "version", "users", "_before_write", "__weakref__")

    def __init__(self, host: torch.Tensor, before_write: Callable[[], None]):
        self.host = host  # pinned host view: the parameter's dtype, shape and stride
        self.version = 0  # bumped by writes that do not come from the optimizer
        self.users = 0  # host optimizers stepping it (the streaming engine outlives them)
        self._before_write = before_write

    def before_write(self) -> None:
        """Wait until no copy to the device still reads ``host``."""
        self._before_write()


# parameter -> its Hosted, while a stream_parameters handle streams it
HOSTED: WeakIdKeyDictionary = WeakIdKeyDictionary()

# parameter -> the host optimizer runtime that steps it (an OffloadedOptimizer's)
MANAGED: WeakIdKeyDictionary = WeakIdKeyDictionary()
