"""What the optimizer reads of a parameter (a DTensor's local shard, a streamed one's host
store, the parameters that share its storage) and of a param group (its hyperparameters)."""

from __future__ import annotations

from typing import Any

import torch

from torchoffload._hosted import HOSTED

# Note: [Parameters that share a storage]
# Parameters that are views of one storage (`nn.Parameter(base[0])`, `nn.Parameter(base[1])`)
# share its version counter: the optimizer's write of one (an upload, the device part's
# rounding) moves the version of the others, which then look changed outside the optimizer
# (`check_record`), and a bf16 one's fp32 master would be read again from its rounded value,
# losing the low bits the plain class keeps in its fp32 master. And uploading one during
# backward, while autograd still holds another saved for its backward, fails autograd's
# version check. So the parameters of one storage are kept together: in one part of an
# ``offload_fraction`` split (Note: [Which parameters stay on the device]) and in one bucket,
# whose upload starts once all their gradients are final (so backward no longer reads any of
# them: Note: [Uploading while backward runs]). After the optimizer writes a bucket (or the
# device part its parameters), every parameter of a storage it wrote is recorded as in sync:
# each was in sync before (checked when the bucket was dispatched, or by the device part's
# `check`), and, as for every parameter, nothing but the optimizer writes it between its
# final backward and `step()`. Views that ``module.to(dtype)`` gave storages of their own
# still share one version counter (``to`` sets ``param.data``): one family too
# (`storage_families` finds them by bumping each counter, which changes no value).
# A counter that moved outside the optimizer says that a member of its family was written, not
# which (``gate.mul_`` moves ``shift``'s too). So in a family of several parameters, a member
# whose counter moved on the same storage has its master read again only when its bytes are
# no longer the master rounded to its dtype, compared bit for bit (`follow_written`): the
# member written is read again whole, as a loop over fp32 masters reads again the master of
# the parameter it wrote, and the others keep their fp32 masters, as that loop does (reading
# a bf16 one's master again from its rounded value loses its low bits). The two differ in one
# case: a write that left every byte of the member it wrote as it was (a clamp that clamped
# nothing) cannot be told from no write, and the master is kept where the loop would read it
# again. A parameter alone on its counter is read again after any move of it, and a streamed
# one after a write of its bytes in the host store (``Hosted.version``), which says which
# parameter was written. The comparison runs only for a family whose counter moved; the
# device part's is queued on the compute stream (a 0-d condition, no host sync).


def storage_families(params: list[torch.Tensor]) -> list[int]:
    """For each parameter, the index of the first of ``params`` that is a view of the same
    storage (its own index when none is; a streamed parameter's values are its host store's):
    Note: [Parameters that share a storage]."""
    first: dict[tuple[torch.device, int], int] = {}
    out = []
    for i, p in enumerate(params):
        if p in HOSTED:
            out.append(i)
            continue
        t = local(p)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        out.append(first.setdefault(key, i) if storage.nbytes() else i)
    # Views that ``module.to(dtype)`` gave storages of their own (it sets ``param.data``) still
    # share the version counter: found by bumping each counter (no value changes)
    probe = [i for i, p in enumerate(params) if p not in HOSTED]
    before = [local(params[i])._version for i in probe]
    for i in probe:
        torch.autograd.graph.increment_version(local(params[i]))
    shared = [i for i, b in zip(probe, before, strict=True) if local(params[i])._version > b + 1]
    for i in shared:
        seen = [local(params[j])._version for j in shared]
        torch.autograd.graph.increment_version(local(params[i]))
        together = [j for j, v in zip(shared, seen, strict=True) if local(params[j])._version != v]
        key = min(out[j] for j in together)
        old = {out[j] for j in together}
        out = [key if k in old else k for k in out]
    return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def follow_written(master: torch.Tensor, value: torch.Tensor) -> None:
    """Read ``master`` (fp32) again from ``value`` (a parameter of a family whose counter moved,
    on the master's device) unless ``value``'s bytes are ``master`` rounded to its dtype:
    Note: [Parameters that share a storage]. Queued: no host sync."""
    bits = _BITS[value.element_size()]
    written = (value.view(bits) != master.to(value.dtype).view(bits)).any()
    master.copy_(torch.where(written, value.to(master.dtype), master))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` (one dtype, one device) hold the same bytes (``torch.equal`` takes
    -0.0 for 0.0)."""
    bits = _BITS[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def shared_families(families: list[int]) -> set[int]:
    """The keys of ``families`` (`storage_families`) that more than one parameter has."""
    seen: set[int] = set()
    shared: set[int] = set()
    for key in families:
        (shared if key in seen else seen).add(key)
    return shared


def shape_of(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape (a DTensor's local shard; a streamed one's host store view)."""
    hosted = HOSTED.get(p)
    return tuple(hosted.host.shape if hosted is not None else local(p).shape)


def value_of(p: torch.Tensor) -> torch.Tensor:
    """The parameter's current values (a streamed one's in the host store)."""
    hosted = HOSTED.get(p)
    return hosted.host if hosted is not None else local(p).detach()


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank's host holds), else the tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


# Note: [The param groups the host steps]
# The host steps the parameters of each param group the optimizer was built with: their
# records, buckets and host optimizers are fixed then, and a bucket's optimizer takes its
# group's hyperparameters from ``param_groups[g]`` by index. torch.optim reads
# ``param_groups`` at every step, so a loop that edits a group's ``"params"`` (drops one to stop
# stepping it, appends one, swaps two groups' lists) or adds or deletes a group in the list
# changes what the plain class steps. Here such an edit was silently ignored: the build's
# parameters were stepped, with the hyperparameters of whichever group now sat at their index
# (an appended parameter never stepped, a dropped one stepped on). It is refused, naming the
# group, before anything changes: at the first hook of a backward (Note: [Refused before a
# backward accumulates]), at `step()`, `zero_grad()`, `state_dict()` and `load_state_dict()`
# (`GroupsCheck`, which compares the parameters of each group with the build's by
# identity). Putting the groups back, or `remove()`, goes on. What keeps each group's
# parameters is followed: a group's dict replaced by another (new hyperparameters), and
# ``optimizer.param_groups = [...]`` (`GroupsInPlace` keeps the list the runtime reads and
# replaces its contents; the runtime read the list it was built with, so a scheduler-like
# reassignment's hyperparameters were silently not used).


class GroupsInPlace:
    """``OffloadedOptimizer.param_groups``: one list for the optimizer's life; an assignment
    replaces its contents (Note: [The param groups the host steps])."""

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__["_param_groups"]
        except KeyError:
            raise AttributeError("param_groups") from None

    def __set__(self, obj: Any, value: Any) -> None:
        groups = obj.__dict__.get("_param_groups")
        if groups is None:  # torch.optim.Optimizer.__init__'s []
            obj.__dict__["_param_groups"] = value
        else:
            groups[:] = list(value)


def hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters, tensors copied, those in a tuple or list too (a scheduler
    updates a tensor lr in place; a loop may so update a tensor of ``betas``)."""
    return {k: _copied(v) for k, v in group.items() if k != "params"}


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (tuple, list):
        return type(value)(_copied(v) for v in value)
    return value


# Note: [The state of a DTensor parameter]
# The host steps a DTensor parameter's local shard, so the optimizer class's state of it (and
# its fp32 master) are plain host tensors of the local shape. The plain class, stepping the
# DTensor, holds DTensors: `state_dict()` and `state` give them as such (the host tensor
# wrapped, as FSDP2's CPUOffloadPolicy makes DTensors on the host; copied where it starts
# inside its storage, since torch.save cannot write a DTensor whose local tensor has a storage
# offset), so that `torch.distributed.checkpoint` saves each rank's shard where it goes and
# reads back this rank's (plain tensors were saved as if every rank held the same one: one
# rank's shard was written, and every rank loaded it as its own), a full state dict gathers
# them, and a norm of one is the global norm. The fp32 masters, in the same state entries
# (Note: [The fp32 master in the state dict]), are DTensors over this rank's host masters
# too. `load_state_dict` takes a DTensor laid out as its parameter (its local tensor) or a
# plain tensor of the local shape (a state dict saved per rank before), and refuses one laid
# out otherwise.


def as_saved(value: Any, param: torch.Tensor) -> Any:
    """``value`` (a state tensor of ``param`` on the host) as the plain class holds it: a
    DTensor laid out as ``param`` when ``param`` is one and ``value`` has its local shape
    (Note: [The state of a DTensor parameter]); else ``value``."""
    if not (is_dtensor(param) and isinstance(value, torch.Tensor) and value.dim() > 0):
        return value
    if tuple(value.shape) != tuple(param._local_tensor.shape):
        return value
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if value.storage_offset() != 0:  # torch.save fails on such a DTensor
        value = value.clone()
    spec = param._spec
    meta = TensorMeta(param.shape, make_contiguous_strides_for(param.shape), value.dtype)
    return DTensor(value, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta),
                   requires_grad=False)  # fmt: skip


def as_local(value: Any, param: torch.Tensor, what: str) -> Any:
    """A loaded state tensor ``value`` of ``param`` as the host steps it: a DTensor's local
    tensor, refused unless it is laid out as ``param`` (Note: [The state of a DTensor
    parameter]); anything else as it is."""
    if not is_dtensor(value):
        return value
    if not is_dtensor(param) or (
        (value.device_mesh, tuple(value.placements), value.shape)
        != (param.device_mesh, tuple(param.placements), param.shape)
    ):
        laid = (
            f"{tuple(param.placements)} on {param.device_mesh} of shape {tuple(param.shape)}"
            if is_dtensor(param)
            else "a plain tensor"
        )
        raise ValueError(
            f"load_state_dict: {what} is a DTensor {tuple(value.placements)} on "
            f"{value.device_mesh} of shape {tuple(value.shape)}, its parameter {laid}: load "
            "it laid out as the parameter (torch.distributed.checkpoint's "
            "set_optimizer_state_dict redistributes it)"
        )
    return value._local_tensor
