"""An `OffloadedOptimizer`'s state dict across its host part (a `HostStepRuntime`) and its
device part (a `DeviceStep`, ``offload_fraction`` < 1), in the plain optimizer class's format
with each fp32 master in its parameter's state entry (Note: [The fp32 master in the state
dict]); and its stats."""

from __future__ import annotations

from typing import Any

import torch

from torchoffload.optim._config import OptimizerStats
from torchoffload.optim._device import DeviceStep
from torchoffload.optim._params import as_local, as_saved, hyper, shape_of, value_of
from torchoffload.optim._runtime import HostStepRuntime

# Note: [The fp32 master in the state dict]
# A parameter whose fp32 master is not the parameter itself (a bf16 or fp16 one; not an fp32
# one, nor a bf16 one with ``master_dtype=torch.bfloat16``) has its master in its own state
# entry, ``state[i][MASTER]``, as the DTensor its other state is for a DTensor parameter
# (Note: [The state of a DTensor parameter]); its entry holds the master alone when the class
# keeps no state of it (SGD without momentum steps the master all the same). Anything that
# keeps "state" keeps it: torch.distributed.checkpoint keeps only "state" and "param_groups",
# and flattens the state by the keys of ``optimizer.state[p]``, so `HostStateView` shows it too.
# The masters were a top-level ``"master_params"``, which DCP dropped: they were rebuilt from
# the bf16 parameters on load and a resumed run diverged silently. `load_state_dict` still
# takes that format (checkpoints of earlier versions); `state_dict()` no longer writes it,
# since a second copy would double the masters' bytes in every checkpoint (4 bytes a
# parameter) for readers of earlier versions only, which rebuild the masters from the
# parameters without it. A master of the parameter's own dtype carries nothing the parameter
# does not and is not read: the plain class casts every floating state tensor but "step" to
# its parameter's dtype when it loads a state dict, so one that loaded ours keeps the master
# as the parameter's value at that load, unread by its step (whose own keys are unchanged)
# and stale after it, and writes it in its state dicts; loaded back, the masters are rebuilt
# from the parameters, as from any plain state dict. That costs the plain class one copy of
# the parameters; a class whose step reads every key of a state entry (none of torch.optim's)
# would need the key dropped before it loads. A plain class's entry that is only this key
# (a parameter with no state of its own) makes torch.optim's Adam-like classes fail, not
# diverge, if that parameter is stepped later. The key is namespaced (no dot: DCP's flattened
# keys are dotted paths) so that no optimizer class's own state can take it.
MASTER = "torchoffload_master"


def state_dict_of(
    rt: HostStepRuntime,
    dev: DeviceStep | None,
    host_index: list[int],
    param_groups: list[dict[str, Any]],
) -> dict[str, Any]:
    """The state dict of an idle optimizer: ``host_index`` is each host parameter's index in
    the optimizer's order. A parameter changed in place since the last step has its master
    read again first, as the next step would."""
    rt.host.follow()
    if dev is not None:
        dev.follow()
    gidx = host_index
    packed_groups, index = [], 0
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        packed_groups.append(packed)
    state = {}
    for bucket in rt.buckets:
        for rec in bucket.records:
            # with its master, DTensors for a DTensor parameter (`entry_of`)
            s = entry_of(bucket.optimizer.state.get(rec.master), rec.param, host_master(rec))
            if s:
                state[gidx[rec.entry.index]] = s
    if dev is not None:
        for k, master in enumerate(dev.masters):
            s = entry_of(dev.optimizer.state.get(master), dev.params[k], device_master(dev, k))
            if s:
                state[dev.index[k]] = s
    return {"state": dict(sorted(state.items())), "param_groups": packed_groups}


# Note: [A master that is its parameter's bits]
# A master read from its parameter (at the build, again after an in-place write, or rebuilt by
# a `load_state_dict` without one) and not stepped since holds the parameter's value exactly
# (bf16 and fp16 widen to fp32 without rounding), so it carries nothing the parameter does not,
# and `state_dict()` and `opt.state` leave it out: a load rebuilds it from the parameter, the
# same bits. Written out, it cost a device its size at the wrong time: accelerate's
# `AcceleratedOptimizer` (under Trainer and `accelerator.prepare`) moves the whole state dict
# to the device and loads it back when it wraps the optimizer, before any step, which put
# every fp32 master on the device at once (4 bytes a parameter: 12.8 GB at the Llama-3.2-3B
# shape, more than the offloaded step's own peak at 8B). "Stepped" is counted per bucket (a
# step of the class may move any of its masters); a step undone does not make its masters
# fresh again (kept: correct, at most their bytes).


def host_master(rec: Any) -> torch.Tensor | None:
    """A host record's master when it is not the parameter's own bits (bf16 masters stepped
    since they were read: Note: [A master that is its parameter's bits])."""
    return rec.master if rec.master.dtype != rec.entry.dtype and not rec.fresh else None


def device_master(dev: DeviceStep, k: int) -> torch.Tensor | None:
    """The device part's ``k``-th master when it is not the parameter itself, nor its bits."""
    return dev.masters[k] if dev.masters[k] is not dev.params[k] and not dev.fresh[k] else None


def entry_of(
    state: dict[str, Any] | None, param: torch.Tensor, master: torch.Tensor | None
) -> dict[str, Any]:
    """``param``'s state entry as `state_dict()` and `HostStateView` give it: the class's
    ``state`` of it and its ``master`` (None: the parameter is its own) under `MASTER`, as the
    plain class holds them (Notes: [The fp32 master in the state dict], [The state of a
    DTensor parameter])."""
    out = {k: as_saved(v, param) for k, v in (state or {}).items()}
    if master is not None:
        out[MASTER] = as_saved(master, param)  # this rank's, as loaded
    return out


def load_state(
    rt: HostStepRuntime,
    dev: DeviceStep | None,
    host_index: list[int],
    param_groups: list[dict[str, Any]],
    state_dict: dict[str, Any],
    defaults: dict[str, Any],
) -> None:
    """Load ``state_dict`` (of `state_dict_of`, of an earlier version's with
    ``"master_params"``, or of the plain class) into an idle optimizer, after checking it all:
    its groups' sizes and that its masters round to the parameters.
    ``defaults``: the class's, for a group that no instance of the class holds."""
    saved = state_dict.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(param_groups):
        raise ValueError(
            "loaded state dict has a different number of parameter groups "
            f"({len(saved) if isinstance(saved, list) else saved!r}, expected "
            f"{len(param_groups)})"
        )
    for g, (mine, theirs) in enumerate(zip(param_groups, saved, strict=True)):
        if len(theirs.get("params", ())) != len(mine["params"]):
            raise ValueError(
                f"loaded state dict's group {g} has {len(theirs.get('params', ()))} "
                f"parameters, this optimizer's has {len(mine['params'])}"
            )
    order = [i for group in saved for i in group["params"]]  # saved id of each parameter
    every = [(host_index[k], rec.param) for k, rec in enumerate(rt.records)]
    if dev is not None:
        every += list(zip(dev.index, dev.params, strict=True))
    state, masters = _local_state(state_dict, every, order)
    _check_masters(every, order, masters)
    # Each instance of the class loads the saved groups' values as they are, and the groups
    # become what the class made of them, as with the plain class: a key the saved groups
    # lack (a torch.optim.AdamW state dict has no state_bits) takes the class's value (its
    # default), not the one this optimizer's group had before
    theirs = [{k: v for k, v in g.items() if k != "params"} for g in saved]
    loaded = _load_host(rt, host_index, order, state, theirs)
    if dev is not None:
        loaded.update(_load_device(dev, order, state, masters, theirs))
    for g, mine in enumerate(param_groups):
        found = loaded.get(g)
        values = hyper(found) if found is not None else {**defaults, **theirs[g]}
        kept = {k: mine[k] for k in ("params", "param_names") if k in mine}
        mine.clear()
        mine.update({**values, **kept})
    for k, rec in enumerate(rt.records):
        m = masters.get(order[host_index[k]])
        if m is not None:
            rt.host.load_master(rec, m)
        else:
            rt.host.refresh(rec)


def _local_state(state_dict: dict[str, Any], every, order) -> tuple[dict, dict]:
    """The saved state (the class's keys) and masters of ``every`` (index, parameter) as the
    host steps them: DTensors as their local tensors (Note: [The state of a DTensor
    parameter]); the masters from the state entries (`MASTER`) or from ``"master_params"``
    (the earlier format), those of the parameter's own dtype left out (Note: [The fp32 master
    in the state dict])."""
    state = dict(state_dict.get("state", {}))
    older = state_dict.get("master_params", {})
    masters = {}
    for i, param in every:
        key = order[i]
        entry = state.get(key)
        if isinstance(entry, dict):
            entry = {k: as_local(v, param, f"state[{key!r}][{k!r}]") for k, v in entry.items()}
            m = entry.pop(MASTER, None)
            if m is not None:
                masters[key] = m
            if entry:
                state[key] = entry
            else:  # the master alone: the class has no state of it
                del state[key]
        if key in older:
            m = as_local(older[key], param, f"master_params[{key!r}]")
            if key in masters and not same_values(masters[key], m):
                raise ValueError(
                    f"load_state_dict: parameter {key!r} has two different masters, in "
                    f"state[{key!r}][{MASTER!r}] and in master_params[{key!r}]"
                )
            masters[key] = m
        m = masters.get(key)
        if isinstance(m, torch.Tensor) and m.dtype == value_of(param).dtype:
            del masters[key]  # a plain class's cast of it: nothing the parameter lacks
    return state, masters


def same_values(a: Any, b: Any) -> bool:
    """Two saved masters hold the same values in the same dtype and shape."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and (a.dtype, a.shape) == (b.dtype, b.shape)
        and torch.equal(a.to(b.device), b)
    )


def _check_masters(every: list[tuple[int, torch.Tensor]], order: list[int], masters) -> None:
    """Every saved master of ``every`` (index, parameter) must round to the parameter."""
    for i, param in every:
        m = masters.get(order[i])
        if m is None:
            continue
        p = value_of(param)
        if tuple(m.shape) != shape_of(param):
            raise ValueError(
                f"the master of parameter {order[i]!r} has shape {tuple(m.shape)}, parameter "
                f"{i} {shape_of(param)}"
            )
        rounded = m.to(device=p.device, dtype=p.dtype)
        if not torch.equal(rounded, p):
            raise ValueError(
                f"the master of parameter {order[i]!r} does not round to parameter {i}'s "
                "current value: load the model's state dict from the same checkpoint first"
            )


def _load_host(rt: HostStepRuntime, gidx, order, state, theirs) -> dict[int, dict[str, Any]]:
    """Each bucket's instance of the optimizer class loads its parameters' saved state and
    the saved values of their groups (``theirs``); returns a loaded group of each user group
    it holds."""
    loaded: dict[int, dict[str, Any]] = {}
    for bucket in rt.buckets:
        local_groups, local_state, slot = [], {}, 0
        by_master = {id(r.master): r for r in bucket.records}
        for host_group in bucket.optimizer.param_groups:
            ids = []
            for master in host_group["params"]:
                rec = by_master[id(master)]
                key = order[gidx[rec.entry.index]]
                if key in state:
                    local_state[slot] = state[key]
                ids.append(slot)
                slot += 1
            local_groups.append({"params": ids})
        for host_group, g in zip(local_groups, bucket.groups, strict=True):
            host_group.update(theirs[g])
        bucket.optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        for host_group, g in zip(bucket.optimizer.param_groups, bucket.groups, strict=True):
            loaded.setdefault(g, host_group)
    return loaded


def _load_device(dev: DeviceStep, order, state, masters, theirs) -> dict[int, dict[str, Any]]:
    """`load_state_dict` for the device part: its state and masters from the saved ones, its
    groups' values from ``theirs``; returns its loaded group of each user group it holds."""
    local_state, local_groups, slot = {}, [], 0
    position = {id(m): k for k, m in enumerate(dev.masters)}
    for group, g in zip(dev.optimizer.param_groups, dev.groups, strict=True):
        ids = []
        for master in group["params"]:
            key = order[dev.index[position[id(master)]]]
            if key in state:
                local_state[slot] = state[key]
            ids.append(slot)
            slot += 1
        local_groups.append({**theirs[g], "params": ids})
    dev.optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
    for k, master in enumerate(dev.masters):
        m = masters.get(order[dev.index[k]])
        if m is not None and master is not dev.params[k]:
            master.copy_(m)
            dev.synced[k] = (dev.params[k]._version, dev.params[k].data_ptr())
            dev.fresh[k] = False
        else:
            dev.reload(k)
    return dict(zip(dev.groups, dev.optimizer.param_groups, strict=True))


def stats_of(rt: HostStepRuntime, dev: DeviceStep | None) -> OptimizerStats:
    """What the optimizer did (its last step finished)."""
    state_bytes = sum(
        t.numel() * t.element_size()
        for b in rt.buckets
        for s in b.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    step = rt.stepper
    host = step.last_host_ms
    return OptimizerStats(
        steps=rt.steps,
        buckets=len(rt.buckets),
        pinned_bytes=rt.layout.pinned_bytes,
        state_bytes=state_bytes,
        d2h_bytes=rt.dispatch.d2h_bytes,
        h2d_bytes=step.h2d_bytes,
        host_step_ms=host,
        host_step_ms_after_call=step.last_host_ms_after_call,
        step_wait_ms=rt.wait_ms,
        overlap=(1 - step.last_host_ms_after_call / host) if host > 0 else 0.0,
        grad_norm=None if step.grad_norm is None else float(step.grad_norm),
        device_params=0 if dev is None else sum(dev.trainable),
        device_state_bytes=0 if dev is None else dev.state_bytes(),
        recalled=rt.recalls.recalled,
    )
