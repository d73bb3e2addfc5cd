"""The part of an `OffloadedOptimizer` that stays on the device (``offload_fraction`` < 1).

Note: [Which parameters stay on the device]
With ``offload_fraction=f`` the host steps the trainable parameters last in the optimizer's
parameter order (its param groups, concatenated), about ``f`` of the trainable bytes; for a
model's ``parameters()`` those are the last layers, whose gradients backward finishes first.
The rest, the first layers and typically the embedding, are stepped on the device at
`step()`; frozen parameters stay there too, without a copy. The host step binds a
host-placed step (benchmarks/log/2026-11-23-optimizer-on-host.md: a fused fp32 AdamW over
3.2 B parameters took 0.6-1.2 s of host time against 0.52 s of forward and backward), and
what the host steps during backward is hidden; the device steps the rest in a few
milliseconds but keeps its
fp32 masters, gradients and state (16 bytes a bf16 parameter with AdamW). So ``f`` trades
device memory for host time. The parameters the host takes are those whose gradients arrive
first, so its step starts as early in backward as it can; those the device keeps are those
the next forward reads first. Parameters that are views of one storage go together, where
the last of them goes (Note: [Parameters that share a storage] in _params.py).

The device part is what a resident fp32-master recipe does: fp32 masters (a parameter that is
fp32 is its own master), the optimizer class over them on the device, the new values rounded
into the parameters, all on the compute stream (queued, no host sync); the step consumes the
gradients, as the host part's have left the device. Its step is bitwise the
class's on those device tensors; the host part's is bitwise the class's on host tensors (CPU
and CUDA kernels of one class may round differently).
"""

from __future__ import annotations

from typing import Any

import torch

from torchoffload.optim._grads import ConsumedGrad
from torchoffload.optim._params import follow_written, hyper, shared_families
from torchoffload.optim._step import step_unhooked


class DeviceStep:
    """Masters, the optimizer class and its state on the device, for ``params`` (with the
    user group of each in ``group_of``, ``index``, their indices in the optimizer's
    parameter order, and ``families``, their `storage_families` keys)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        index: list[int],
        group_of: list[int],
        user_groups: list[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        families: list[int],
    ):
        self.params = params
        self.index = index
        self.position = {id(p): k for k, p in enumerate(params)}  # id(parameter) -> k
        shared = shared_families(families)
        self.shared = [key in shared for key in families]  # shares its version counter
        self.trainable = [p.requires_grad for p in params]
        self.built = [(p.dtype, tuple(p.shape), p.device) for p in params]
        self.user_groups = user_groups
        # A frozen parameter is its own "master": never stepped, no fp32 copy on the device.
        self.masters = [
            p if p.dtype == torch.float32 or not p.requires_grad else p.detach().float()
            for p in params
        ]
        self.synced = [(p._version, p.data_ptr()) for p in params]
        # each master read from its parameter and not stepped since (Note: [A master that is
        # its parameter's bits] in _state.py)
        self.fresh = [True] * len(params)
        by_group: dict[int, list[torch.Tensor]] = {}
        for master, g in zip(self.masters, group_of, strict=True):
            by_group.setdefault(g, []).append(master)
        self.groups = list(by_group)
        self.optimizer = optimizer_class(
            [{**hyper(user_groups[g]), "params": ms} for g, ms in by_group.items()],
            **optimizer_kwargs,
        )

    def check(self) -> None:
        """Refuse what the host part refuses (Note: [When a gradient is final] and `_check`);
        re-read a master whose parameter was changed outside the optimizer."""
        message = self.refusal()
        if message is not None:
            raise RuntimeError(message)
        for k, p in enumerate(self.params):
            if not self.trainable[k] and self.masters[k] is p and p.dtype != torch.float32 \
                    and p.grad is not None:  # fmt: skip
                raise RuntimeError(
                    f"parameter {self.index[k]} was frozen when the optimizer was built and has "
                    "a gradient now (zero_grad(set_to_none=False) keeps one): torch.optim "
                    f"would step it, on an fp32 master that this optimizer keeps only for "
                    f"parameters trainable at the build; set its .grad to None first"
                )
        self.follow()

    def refusal(self) -> str | None:
        """Why a step would be refused now (None: it would not); metadata only."""
        for k, p in enumerate(self.params):
            if p.requires_grad != self.trainable[k]:
                return (
                    f"parameter {self.index[k]}: requires_grad was {self.trainable[k]} when the "
                    f"optimizer was built and is {p.requires_grad} now: build the "
                    "OffloadedOptimizer after freezing or unfreezing parameters"
                )
            if (p.dtype, tuple(p.shape), p.device) != self.built[k]:
                dtype, shape, device = self.built[k]
                return (
                    f"parameter {self.index[k]} is now {p.dtype} {tuple(p.shape)} on "
                    f"{p.device}, was {dtype} {shape} on {device} when the optimizer was built: "
                    "build the OffloadedOptimizer after converting the model"
                )
        return None

    def follow(self) -> None:
        """Re-read the master of every parameter changed in place since it was last read or
        written (one whose dtype, shape or device changed is left to `check`)."""
        for k, p in enumerate(self.params):
            changed = (p._version, p.data_ptr()) != self.synced[k]
            if (
                changed
                and self.masters[k] is not p
                and self.built[k] == (p.dtype, tuple(p.shape), p.device)
            ):
                if self.shared[k] and p.data_ptr() == self.synced[k][1]:
                    # See Note: [Parameters that share a storage] in _params.py
                    with torch.no_grad():
                        follow_written(self.masters[k], p.detach())
                    self.synced[k] = (p._version, p.data_ptr())
                else:
                    self.reload(k)

    def reload(self, k: int) -> None:
        master, p = self.masters[k], self.params[k]
        if master is not p:
            with torch.no_grad():
                master.copy_(p)
        self.synced[k] = (p._version, p.data_ptr())
        self.fresh[k] = True

    @torch.no_grad()
    def step(self, hyper: list[dict[str, Any]]) -> None:
        """Step with the hyperparameters ``hyper`` (one dict per user group), on the compute
        stream."""
        self.check()
        for group, g in zip(self.optimizer.param_groups, self.groups, strict=True):
            group.update(hyper[g])
        stepped = [p.grad is not None for p in self.params]
        try:
            for master, p in zip(self.masters, self.params, strict=True):
                if master is not p and p.grad is not None:
                    # fp32 gradient in, the parameter's dropped at once (the peak holds one
                    # parameter's both, not every one's)
                    master.grad = p.grad.float()
                    p.grad = None
            step_unhooked(self.optimizer)
        finally:
            for master, p in zip(self.masters, self.params, strict=True):
                if master is not p:
                    master.grad = None
        for k, (master, p) in enumerate(zip(self.masters, self.params, strict=True)):
            if master is not p and stepped[k]:
                p.copy_(master)
                self.fresh[k] = False
            # The step consumes the gradient, as the host part's left the device (Note: [The
            # gradient after step()]).
            p.grad = ConsumedGrad(p) if stepped[k] else None
        # After every write: a write moves the version of the other views of its storage
        # (Note: [Parameters that share a storage] in _params.py).
        for k, p in enumerate(self.params):
            self.synced[k] = (p._version, p.data_ptr())

    def state_bytes(self) -> int:
        """Device bytes of masters (those that are not the parameter) and optimizer state."""
        masters = sum(m.numel() * 4 for m, p in zip(self.masters, self.params, strict=True)
                      if m is not p)  # fmt: skip
        device = self.params[0].device if self.params else None
        state = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.device == device
        )
        return masters + state
