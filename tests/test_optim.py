"""OffloadedOptimizer on the CPU: the step is bitwise the optimizer class's own on fp32 host
tensors (same gradients in), with accumulation, clipping, schedulers, state dicts, faults and
bad input."""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import threading
import time
import warnings

import pytest
import torch
from fuzz_models import SGDWritesGrad  # tests/ is on sys.path
from torch import nn

import torchoffload as to
from torchoffload.optim import MovedGradError, OptimizerOffloadConfig


def model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)
    ).to(dtype)


def batch(i, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 16, generator=g).to(dtype)


def loss_of(m, x):
    return m(x).float().square().mean()


class Reference:
    """The plain optimizer class on fp32 CPU copies of a twin model's parameters: the twin
    computes the gradients, the copies are stepped, the twin receives them rounded."""

    def __init__(self, twin, cls, *, max_grad_norm=None, groups=None, **kw):
        self.twin = twin
        self.masters = [p.detach().float().clone().requires_grad_() for p in twin.parameters()]
        params = self.masters if groups is None else groups(self.masters)
        self.opt = cls(params, **kw)
        self.max_grad_norm = max_grad_norm
        self.norm = None

    def backward(self, x):
        loss_of(self.twin, x).backward()

    def step(self):
        for m, p in zip(self.masters, self.twin.parameters(), strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        if self.max_grad_norm is not None:
            self.norm = torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm)
        self.opt.step()
        self.twin.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.masters, self.twin.parameters(), strict=True):
                p.copy_(m)


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def same_state(opt, ref):
    """The offloaded optimizer's state entries are bitwise the reference's plain class's."""
    assert_state_equal(opt.state_dict(), ref.opt.state_dict(), extra=False)
    return True


MASTER = "torchoffload_master"  # the key of a parameter's fp32 master in its state entry


def masters_of(sd):
    """The fp32 masters in a state dict of OffloadedOptimizer, by index."""
    return {i: s[MASTER] for i, s in sd["state"].items() if MASTER in s}


def class_state(sd):
    """A state dict's entries without the masters: the optimizer class's own state."""
    out = {i: {k: v for k, v in s.items() if k != MASTER} for i, s in sd["state"].items()}
    return {i: s for i, s in out.items() if s}


def assert_state_equal(mine, theirs, extra=True):
    """Two state dicts of one optimizer class: the same entries of the class's state, bitwise;
    with ``extra`` (two of OffloadedOptimizer), also the same masters and the keys besides
    "state" and "param_groups"."""
    mine_state, their_state = class_state(mine), class_state(theirs)
    assert mine_state.keys() == their_state.keys()
    for i, entries in mine_state.items():
        assert entries.keys() == their_state[i].keys()
        for k, v in entries.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(their_state[i][k])), (i, k)
    if extra:
        a, b = masters_of(mine), masters_of(theirs)
        assert a.keys() == b.keys()
        assert all(torch.equal(v, b[i]) for i, v in a.items())
    for key in (mine.keys() - {"state", "param_groups"}) if extra else ():
        for i, v in mine[key].items():
            assert torch.equal(v, theirs[key][i]), (key, i)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw-fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "sgd-momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
}


@pytest.mark.parametrize(
    "dtype,convert_on",
    [(torch.float32, "device"), (torch.bfloat16, "device"), (torch.bfloat16, "host")],
    ids=["fp32", "bf16", "bf16-host-converts"],
)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
def test_step_is_bitwise_the_optimizer_class_on_fp32_host_copies(dtype, convert_on, name, overlap):
    cls, kw = OPTIMIZERS[name]
    a = model(dtype)
    ref = Reference(copy.deepcopy(a), cls, **kw)
    opt = to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=2048, overlap=overlap,
                                convert_on=convert_on, **kw)  # fmt: skip
    assert len(opt._runtime.buckets) > 2
    for i in range(4):
        loss_of(a, batch(i, dtype)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(i, dtype))
        ref.step()
        assert same_params(a, ref.twin), i
    assert same_state(opt, ref)
    masters = masters_of(opt.state_dict())
    assert "master_params" not in opt.state_dict()
    if dtype == torch.float32:
        assert masters == {}
    else:
        assert all(torch.equal(masters[i], m) for i, m in enumerate(ref.masters))
    stats = opt.stats()
    numel = sum(p.numel() for p in a.parameters())
    # over the link: fp32 when the copies convert, else the parameters' dtype
    crossing = 4 if convert_on == "device" else dtype.itemsize
    assert stats.steps == 4 and stats.d2h_bytes == stats.h2d_bytes == 4 * numel * crossing
    staging = numel * dtype.itemsize if convert_on == "host" and dtype != torch.float32 else 0
    assert stats.pinned_bytes >= 8 * numel + staging  # master and gradient, staging
    assert stats.pinned_bytes < 8 * numel + staging + 64 * 2 * len(list(a.parameters()))
    assert 0.0 <= stats.overlap <= 1.0 and stats.host_step_ms > 0
    opt.remove()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_copies_that_convert_in_chunks_are_bitwise_the_host_conversion(dtype, monkeypatch):
    """A chunk of 100 elements cuts every tensor (16 x 32 = 512: five full chunks and a partial
    one) on the way down and up; the bits are those of a host conversion."""
    import torchoffload._transfer as transfer

    monkeypatch.setattr(transfer, "CAST_CHUNK", 100)
    a, b = model(dtype), model(dtype)
    opts = [
        to.OffloadedOptimizer(
            m.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048, convert_on=where
        )
        for m, where in ((a, "device"), (b, "host"))
    ]
    for i in range(3):
        for m, opt in zip((a, b), opts, strict=True):
            loss_of(m, batch(i, dtype)).backward()
            opt.step()
            opt.zero_grad()
        assert same_params(a, b), i
    for x, y in zip(*(o._runtime.records for o in opts), strict=True):
        assert torch.equal(x.master, y.master) and torch.equal(x.grad, y.grad)
    with pytest.raises(ValueError, match="convert_on must be 'device' or 'host'"):
        to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, convert_on="gpu")


def test_gradient_accumulation_keeps_gradients_on_the_device_until_the_last_backward():
    a = model(torch.bfloat16)
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    for step in range(3):
        for micro in range(3):
            x = batch(10 * step + micro, torch.bfloat16)
            if micro < 2:
                with opt.accumulating():
                    loss_of(a, x).backward()
                assert all(type(p.grad) is torch.Tensor for p in a.parameters())
            else:
                loss_of(a, x).backward()
                assert all(type(p.grad) is to.optim.MovedGrad for p in a.parameters())
            ref.backward(x)
        opt.step()
        opt.zero_grad()
        ref.step()
        assert all(p.grad is None for p in a.parameters())
        assert same_params(a, ref.twin)
    assert same_state(opt, ref)


def test_step_after_only_accumulating_backwards_takes_the_gradients_at_step():
    a = model()
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    with opt.accumulating():
        loss_of(a, batch(0)).backward()
        loss_of(a, batch(1)).backward()
    opt.step()
    opt.zero_grad()
    ref.backward(batch(0))
    ref.backward(batch(1))
    ref.step()
    assert same_params(a, ref.twin)


@pytest.mark.parametrize(
    "dtype,convert_on",
    [(torch.float32, "device"), (torch.bfloat16, "device"), (torch.bfloat16, "host")],
    ids=["fp32", "bf16", "bf16-host-converts"],
)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_backwards_without_accumulating_accumulate_as_torch_optim(dtype, convert_on, overlap,
                                                                   name):  # fmt: skip
    """Issue 40: several plain backward() calls before step() (how torchao's tests and
    accelerate accumulate) accumulate exactly: a bucket whose gradients left the device in
    the first comes back and its step is undone (Note: [A second backward]); the number of
    backwards per step changes along the way."""
    cls, kw = {"sgd": (torch.optim.SGD, dict(lr=0.1)), "adamw": (torch.optim.AdamW,
                                                                dict(lr=1e-2))}[name]  # fmt: skip
    a = model(dtype)
    ref = Reference(copy.deepcopy(a), cls, **kw)
    opt = to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=2048, overlap=overlap,
                                convert_on=convert_on, **kw)  # fmt: skip
    rt = opt._runtime
    recalled = []
    for step, micro_batches in enumerate([2, 2, 2, 1, 3, 2]):
        for micro in range(micro_batches):
            x = batch(10 * step + micro, dtype)
            loss_of(a, x).backward()
            ref.backward(x)
            if micro == 0 and step == 0:
                assert all(type(p.grad) is to.optim.MovedGrad for p in a.parameters())
                for b in rt.buckets:  # the worker has taken (and maybe stepped) each
                    assert b.handled.wait(10)
        opt.step()
        opt.zero_grad()
        ref.step()
        assert same_params(a, ref.twin), step
        recalled.append(rt.recalls.recalled)
    assert same_state(opt, ref)
    # Step 0 brings every bucket back; step 1 predicts the second backward (nothing comes
    # back); step 4's third backward comes as a surprise again.
    n = len(rt.buckets)
    assert recalled[0] == n and recalled[2] == n and recalled[3] == n and recalled[4] > n


def test_a_second_backward_recalls_a_bucket_the_worker_has_not_taken_yet(monkeypatch):
    """The worker has not taken the first backward's buckets when the second backward
    starts: they are skipped, and the second's gradients accumulate on the device."""
    a = model()
    ref = Reference(copy.deepcopy(a), torch.optim.SGD, lr=0.1)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.1, bucket_bytes=2048)
    rt = opt._runtime
    arrive = rt.stepper.arrive
    gate = threading.Event()

    def slow_arrive(bucket, event):
        gate.wait()
        arrive(bucket, event)

    monkeypatch.setattr(rt.stepper, "arrive", slow_arrive)
    loss_of(a, batch(0)).backward()  # the worker blocks in its first bucket
    threading.Timer(0.2, gate.set).start()  # the second backward waits for that one only
    loss_of(a, batch(1)).backward()  # every other bucket is recalled before it was taken
    opt.step()
    opt.zero_grad()
    ref.backward(batch(0))
    ref.backward(batch(1))
    ref.step()
    assert same_params(a, ref.twin)
    assert rt.recalls.recalled == len(rt.buckets)


@pytest.mark.parametrize("max_norm", [1e-3, 1e3], ids=["clipped", "not-clipped"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clipping_is_clip_grad_norm_on_the_host_gradients(max_norm, norm_type):
    a = model(torch.bfloat16)
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2, max_grad_norm=max_norm)
    ref_norm = []
    orig = torch.nn.utils.clip_grad_norm_

    def clip(params, m):
        return orig(params, m, norm_type=norm_type)

    opt = to.OffloadedOptimizer(
        a.parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        config=OptimizerOffloadConfig(
            bucket_bytes=2048, max_grad_norm=max_norm, norm_type=norm_type
        ),
    )
    for i in range(3):
        loss_of(a, batch(i, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(i, torch.bfloat16))
        for m, p in zip(ref.masters, ref.twin.parameters(), strict=True):
            m.grad = p.grad.float()
        ref_norm.append(clip(ref.masters, max_norm))
        ref.opt.step()
        ref.twin.zero_grad()
        with torch.no_grad():
            for m, p in zip(ref.masters, ref.twin.parameters(), strict=True):
                p.copy_(m)
        assert torch.equal(opt.grad_norm, ref_norm[-1])
        assert same_params(a, ref.twin)
    assert opt.stats().grad_norm == float(ref_norm[-1])


class ClipOnTheModel(Reference):
    """A plain loop that clips with clip_grad_norm_ on the model (its gradients, of its
    dtype) before the plain class steps fp32 copies."""

    def __init__(self, twin, cls, max_norm, **kw):
        super().__init__(twin, cls, **kw)
        self.max_norm = max_norm

    def backward(self, x, k=1.0):
        (loss_of(self.twin, x) * k).backward()

    def step(self):
        self.norm = torch.nn.utils.clip_grad_norm_(self.twin.parameters(), self.max_norm)
        super().step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
def test_clip_grad_norm_on_the_model_is_the_plain_loop_bitwise(dtype, overlap):
    """Issue 40: clip_grad_norm_ on the model between backward and step() reads and scales
    the real gradients (Note: [Reading a moved gradient]): the norm it returns and the step
    are the plain loop's; some steps clip, some do not."""
    a = model(dtype)
    ref = ClipOnTheModel(copy.deepcopy(a), torch.optim.AdamW, 0.3, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                overlap=overlap)  # fmt: skip
    clipped = []
    for i in range(4):
        x, k = batch(i, dtype), (10.0 if i % 2 else 0.1)  # small gradients: no clipping
        (loss_of(a, x) * k).backward()
        assert all(type(p.grad) is to.optim.MovedGrad for p in a.parameters())
        norm = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.3)
        opt.step()
        opt.zero_grad()
        ref.backward(x, k)
        ref.step()
        assert torch.equal(norm, ref.norm), i
        assert same_params(a, ref.twin), i
        clipped.append(bool(ref.norm > 0.3))
    assert same_state(opt, ref)
    assert clipped == [False, True, False, True]


def test_a_moved_gradient_is_read_with_its_real_values_until_step_consumes_it():
    a = model()
    twin = copy.deepcopy(a)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.1)
    loss_of(a, batch(0)).backward()
    loss_of(twin, batch(0)).backward()
    assert "MovedGrad" in repr(a[0].weight.grad)
    assert torch.equal(a[0].weight.grad.sum(), twin[0].weight.grad.sum())
    assert type(a[0].weight.grad) is torch.Tensor  # it came back
    opt.step()
    with pytest.raises(MovedGradError, match="consumed by OffloadedOptimizer.step"):
        torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)  # after step(): refused
    opt.zero_grad()
    assert all(p.grad is None for p in a.parameters())


def test_lr_scheduler_and_param_groups_reach_the_host_step():
    a = model()
    twin = copy.deepcopy(a)

    def groups(ps):
        return [{"params": ps[:2], "lr": 0.05}, {"params": ps[2:], "weight_decay": 0.0}]

    ref = Reference(twin, torch.optim.AdamW, lr=1e-2, groups=groups)
    ps = list(a.parameters())
    opt = to.OffloadedOptimizer(groups(ps), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=1, gamma=0.5)
    for i in range(4):
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ref.backward(batch(i))
        ref.step()
        ref_sched.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.opt.param_groups]
        assert same_params(a, ref.twin), i
    assert opt.param_groups[0]["lr"] == 0.05 / 16
    assert same_state(opt, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_dict_round_trip_continues_bitwise(dtype):
    a = model(dtype)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    for i in range(2):
        loss_of(a, batch(i, dtype)).backward()
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    b = copy.deepcopy(a)
    opt_b = to.OffloadedOptimizer(b.parameters(), torch.optim.AdamW, lr=0.5, bucket_bytes=4096)
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]["lr"] == 1e-2
    for i in range(2, 5):
        for m, o in ((a, opt), (b, opt_b)):
            loss_of(m, batch(i, dtype)).backward()
            o.step()
            o.zero_grad()
    assert same_params(a, b)
    sa, sb = opt.state_dict(), opt_b.state_dict()
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k])


def test_state_dict_is_the_plain_class_format_both_ways():
    a = model()
    plain_model = copy.deepcopy(a)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    for i in range(2):
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())  # CPU state is shared, not copied, by load_state_dict
    plain_model.load_state_dict(a.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain.load_state_dict(sd)
    back = to.OffloadedOptimizer(
        copy.deepcopy(plain_model).parameters(), torch.optim.AdamW, lr=1e-2
    )
    back.load_state_dict(copy.deepcopy(plain.state_dict()))
    for i in range(2, 4):
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
        loss_of(plain_model, batch(i)).backward()
        plain.step()
        plain.zero_grad()
    assert same_params(a, plain_model)  # fp32 on the CPU: the plain class is the reference


def test_load_state_dict_refuses_masters_that_do_not_match_the_model():
    a = model(torch.bfloat16)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2)
    loss_of(a, batch(0, torch.bfloat16)).backward()
    opt.step()
    opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    fresh = model(torch.bfloat16, seed=1)
    other = to.OffloadedOptimizer(fresh.parameters(), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="same checkpoint"):
        other.load_state_dict(sd)
    with pytest.raises(ValueError, match="number of parameter groups"):
        other.load_state_dict({"state": {}, "param_groups": []})
    fresh.load_state_dict(a.state_dict())
    other.load_state_dict(sd)


def _steps(m, opt, steps):
    for i in steps:
        loss_of(m, batch(i, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()


def _resumed(cls, kw, save, load, fraction=1.0):
    """A bf16 model trained 4 steps, and one resumed after 2 from what ``save(model, opt)``
    gave (loaded by ``load(model, opt, saved)`` into a fresh model and optimizer, this one
    with ``offload_fraction=fraction``) and trained 2 more."""
    whole = model(torch.bfloat16)
    opt = to.OffloadedOptimizer(whole.parameters(), cls, bucket_bytes=2048, **kw)
    _steps(whole, opt, range(4))
    opt.remove()
    a = model(torch.bfloat16)
    opt = to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=2048, **kw)
    _steps(a, opt, range(2))
    saved = copy.deepcopy(save(a, opt))
    opt.remove()
    b = model(torch.bfloat16, seed=3)
    b.load_state_dict(a.state_dict())
    opt = to.OffloadedOptimizer(b.parameters(), cls, bucket_bytes=4096,
                                offload_fraction=fraction, **kw)  # fmt: skip
    load(b, opt, saved)
    _steps(b, opt, range(2, 4))
    opt.remove()
    return whole, b


def _dcp(flatten):
    """Save and load through torch.distributed.checkpoint's get/set_optimizer_state_dict
    (keys by name; with ``flatten``, one key a state tensor, put back together by the keys of
    ``opt.state[p]``, as torchtitan saves)."""
    from torch.distributed.checkpoint import state_dict as dsd

    options = dsd.StateDictOptions(flatten_optimizer_state_dict=flatten)

    def save(m, opt):
        return dsd.get_optimizer_state_dict(m, opt, options=options)

    def load(m, opt, saved):
        dsd.set_optimizer_state_dict(m, opt, saved, options=options)

    return save, load


def _state_only(m, opt):
    """What a tool that keeps only "state" and "param_groups" keeps of a state dict."""
    sd = opt.state_dict()
    return {"state": sd["state"], "param_groups": sd["param_groups"]}


def _load(m, opt, saved):
    opt.load_state_dict(saved)


RESUMED = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.3)),  # keeps no state: the master is all the entry
}


@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["host", "split"])
@pytest.mark.parametrize("name", list(RESUMED))
@pytest.mark.parametrize("how", ["state-only", "dcp", "dcp-flat"])
def test_masters_travel_in_the_state_entries(how, name, fraction):
    """A bf16 parameter's fp32 master is in its state entry (``state[i][MASTER]``), so a tool
    that keeps only "state" and "param_groups" (torch.distributed.checkpoint's
    get/set_optimizer_state_dict, flattened or not) keeps it: resumed after 2 steps, 2 more
    end bitwise where 4 uninterrupted ones do. As a top-level "master_params" they were
    dropped by such tools and rebuilt from the bf16 parameters: every parameter differed."""
    save, load = {"state-only": (_state_only, _load), "dcp": _dcp(False),
                  "dcp-flat": _dcp(True)}[how]  # fmt: skip
    cls, kw = RESUMED[name]
    whole, resumed = _resumed(cls, kw, save, load, fraction)
    assert same_params(whole, resumed)


def test_masters_in_the_state_entries_of_bf16_parameters_only():
    """The state dict's format: the master of every bf16 parameter (one stepped by a
    stateless class too), none for an fp32 one (its own master) and no top-level
    "master_params"; ``opt.state[p]`` shows it too, and a master saved in the old format
    (top-level "master_params", checkpoints of earlier versions) still loads."""
    a = model(torch.bfloat16)
    a[0].float()  # fp32: its own master (it takes fp32 inputs, gives bf16 outputs)
    a[0].register_forward_hook(lambda mod, args, out: out.bfloat16())
    cls, kw = RESUMED["sgd"]
    opt = to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=2048, **kw)
    for i in range(2):
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    assert "master_params" not in sd and sd.keys() == {"state", "param_groups"}
    params = list(a.parameters())
    assert sorted(sd["state"]) == [i for i, p in enumerate(params) if p.dtype == torch.bfloat16]
    for i, entry in sd["state"].items():
        assert entry.keys() == {MASTER} and entry[MASTER].dtype == torch.float32
        assert torch.equal(entry[MASTER].bfloat16(), params[i].detach())
        assert not torch.equal(entry[MASTER], params[i].detach().float())  # low bits kept
        assert torch.equal(opt.state[params[i]][MASTER], entry[MASTER])
    assert dict(opt.state[params[0]]) == {}
    opt.remove()

    def old_format(m, opt):
        sd = opt.state_dict()
        masters = {i: s.pop(MASTER) for i, s in sd["state"].items() if MASTER in s}
        sd["state"] = {i: s for i, s in sd["state"].items() if s}
        assert masters
        return {**sd, "master_params": masters}

    for name in RESUMED:
        whole, resumed = _resumed(*RESUMED[name], old_format, _load)
        assert same_params(whole, resumed), name


def test_our_state_dict_in_the_plain_class_and_back():
    """The plain class loads our state dict: it casts the extra master to the parameter's
    dtype (its values, then) and keeps it, unread by its step, which stays torch's; loaded
    back from the plain class's state dict, a master of the parameter's own dtype carries
    nothing the parameter does not and is not read (it went stale as the plain class
    stepped): the masters are rebuilt from the parameters, as from any plain state dict."""
    a = model(torch.bfloat16)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    _steps(a, opt, range(2))
    sd = copy.deepcopy(opt.state_dict())
    opt.remove()
    plain_model = copy.deepcopy(a)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(sd))  # each its own "step" tensors (not cast)
    twin = copy.deepcopy(plain_model)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    reference.load_state_dict({**sd, "state": {i: {k: v for k, v in s.items() if k != MASTER}
                                               for i, s in sd["state"].items()}})  # fmt: skip
    for p in plain_model.parameters():
        assert plain.state[p][MASTER].dtype == torch.bfloat16
        assert torch.equal(plain.state[p][MASTER], p.detach())
    _steps(plain_model, plain, range(2, 4))
    _steps(twin, reference, range(2, 4))
    assert same_params(plain_model, twin)  # the extra key changes nothing of its step
    saved = plain.state_dict()
    assert all(s[MASTER].dtype == torch.bfloat16 for s in saved["state"].values())
    models, opts = [], []
    for state in (saved["state"], {i: {k: v for k, v in s.items() if k != MASTER}
                                   for i, s in saved["state"].items()}):  # fmt: skip
        models.append(copy.deepcopy(plain_model))
        opts.append(to.OffloadedOptimizer(models[-1].parameters(), torch.optim.AdamW, lr=1e-2))
        opts[-1].load_state_dict(copy.deepcopy({**saved, "state": state}))  # stale: not read
        _steps(models[-1], opts[-1], range(4, 6))
        opts[-1].remove()
    assert same_params(*models)


@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["host", "split"])
def test_a_master_that_is_its_parameters_bits_is_left_out(fraction):
    """A master read from its parameter and not stepped since is the parameter's bits:
    state_dict() and opt.state leave it out (a load rebuilds it, the same bits), so that
    accelerate's AcceleratedOptimizer, which moves the whole state dict to the device when it
    wraps the optimizer, moves no master before the first step (it moved every one: 4 bytes
    a parameter on the device at once). Stepped, loaded or rebuilt, each comes and goes as
    it holds more than its parameter; every resume is bitwise."""
    a = model(torch.bfloat16)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                offload_fraction=fraction)  # fmt: skip
    n = len(list(a.parameters()))
    assert opt.state_dict()["state"] == {} and len(opt.state) == 0
    assert all(opt.state[p] == {} for p in a.parameters())
    fresh = copy.deepcopy((a.state_dict(), opt.state_dict()))
    _steps(a, opt, range(2))
    stepped = copy.deepcopy((a.state_dict(), opt.state_dict()))
    assert sorted(masters_of(stepped[1])) == list(range(n))
    assert all(MASTER in opt.state[p] for p in a.parameters())
    # a plain state dict (no masters): rebuilt from the parameters, left out again
    plain = {**stepped[1], "state": class_state(stepped[1])}
    ends = []
    for m_sd, o_sd, left_out in ((fresh[0], fresh[1], True), (stepped[0], stepped[1], False),
                                 (stepped[0], plain, True)):  # fmt: skip
        b = model(torch.bfloat16)
        b.load_state_dict(m_sd)
        o = to.OffloadedOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                  offload_fraction=fraction)  # fmt: skip
        o.load_state_dict(copy.deepcopy(o_sd))
        assert (masters_of(o.state_dict()) == {}) == left_out
        _steps(b, o, range(2, 4))
        assert sorted(masters_of(o.state_dict())) == list(range(n))
        ends.append((b, o))
    _steps(a, opt, range(2, 4))
    assert same_params(a, ends[1][0])  # resumed with its masters: bitwise
    assert same_params(ends[0][0], ends[0][0])
    for _, o in ends:
        o.remove()
    opt.remove()


def test_parameters_changed_outside_the_optimizer_are_read_again():
    a = model(torch.bfloat16)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    loss_of(a, batch(0, torch.bfloat16)).backward()
    opt.step()
    opt.zero_grad()
    a.load_state_dict(model(torch.bfloat16, seed=7).state_dict())  # a checkpoint, loaded late
    fresh = model(torch.bfloat16, seed=7)
    ref = Reference(fresh, torch.optim.AdamW, lr=1e-2)
    ref.opt.load_state_dict(
        {
            "state": copy.deepcopy(opt.state_dict()["state"]),
            "param_groups": ref.opt.state_dict()["param_groups"],
        }
    )
    for i in range(1, 3):
        loss_of(a, batch(i, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(i, torch.bfloat16))
        ref.step()
        assert same_params(a, ref.twin)


def test_unused_and_frozen_parameters_are_not_stepped():
    a = model()
    a[0].weight.requires_grad_(False)
    unused = nn.Parameter(torch.ones(3))
    params = list(a.parameters()) + [unused]
    opt = to.OffloadedOptimizer(params, torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    frozen = a[0].weight.clone()
    loss_of(a, batch(0)).backward()
    opt.step()
    assert torch.equal(a[0].weight, frozen) and torch.equal(unused, torch.ones(3))
    assert a[0].weight.grad is None and unused.grad is None
    assert type(a[2].weight.grad) is to.optim.ConsumedGrad
    opt.zero_grad()
    assert a[2].weight.grad is None


class Branchy(nn.Module):
    """A body and two heads, one of which each call uses: the other is unused in that step."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(16, 32)
        self.a = nn.Linear(32, 8)
        self.b = nn.Linear(32, 8)
        self.to(dtype)

    def forward(self, x, use_b=False):
        h = torch.nn.functional.gelu(self.body(x))
        return self.b(h) if use_b else self.a(h)


class PlainLoop(Reference):
    """`Reference` that leaves the twin's gradients to the loop, as torch.optim does: the
    loop's zero_grad (either form) acts on them, and a zero gradient is stepped."""

    def backward(self, x, use_b=False):
        self.twin(x, use_b).float().square().mean().backward()

    def step(self):
        for m, p in zip(self.masters, self.twin.parameters(), strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.twin.parameters(), strict=True):
                p.copy_(m)


def same_grads(a, b):
    """Both None, or equal values (a `MovedGrad` is neither)."""
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            return False
        if p.grad is not None and not torch.equal(p.grad, q.grad):
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["overlap", "at-step", "ahead", "split"])
@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_zero_grad_set_to_none_false_steps_unused_parameters_with_zeros(dtype, mode, name):
    """Issue 38 item 4: with zero_grad(set_to_none=False), a parameter unused in a step has a
    zero gradient and is stepped with it (weight decay, momentum), and ``param.grad`` holds
    zeros, bitwise as torch.optim on fp32 copies."""
    cls, kw = OPTIMIZERS[name]
    a = Branchy(dtype)
    ref = PlainLoop(copy.deepcopy(a), cls, **kw)
    extra = {
        "overlap": {},
        "at-step": dict(overlap=False),
        "ahead": dict(step_ahead=True, model=a),
        "split": dict(offload_fraction=0.5),
    }[mode]
    opt = to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=512, **extra, **kw)
    uses = [True, False, False, True, False]
    for i, use_b in enumerate(uses):
        x = batch(i, dtype)
        a(x, use_b).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        ref.backward(x, use_b)
        ref.step()
        ref.twin.zero_grad(set_to_none=False)
        opt.synchronize()
        assert same_params(a, ref.twin), i
        assert same_grads(a, ref.twin), i  # zeros where torch.optim has zeros, else None
    assert a.a.weight.grad is not None and torch.count_nonzero(a.a.weight.grad) == 0
    assert same_state(opt, ref)
    # and set_to_none=True drops them again, unused parameters are then not stepped
    opt.zero_grad()
    ref.twin.zero_grad()
    a(batch(9, dtype)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    ref.backward(batch(9, dtype))
    ref.step()
    ref.twin.zero_grad()
    opt.synchronize()
    assert same_params(a, ref.twin) and same_state(opt, ref)
    opt.remove()


def test_zero_grad_set_to_none_false_is_refused_for_streamed_parameters():
    """Outside its unit a streamed parameter has no shape for the zeros to take: refused
    before anything changes, naming zero_grad()."""
    from torchoffload.models import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(hidden=32, layers=2, heads=4, vocab=64, max_seq=16))
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    handle = to.stream_parameters(m, 10 << 20, unit="blocks", device="cpu")
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)
    m.loss(x).backward()
    opt.step()
    kinds = [type(p.grad) for p in m.parameters()]
    with pytest.raises(ValueError, match=r"set_to_none=True"):
        opt.zero_grad(set_to_none=False)
    assert [type(p.grad) for p in m.parameters()] == kinds
    opt.zero_grad()
    m.loss(x).backward()
    opt.step()
    opt.zero_grad()
    opt.remove()
    handle.remove()


@pytest.mark.parametrize("mode", ["overlap", "ahead", "split"])
def test_a_loop_without_zero_grad_is_refused_before_anything_changes(mode):
    """Issue 38 item 4: torch.optim accumulates the next backward into the last step's
    gradients (and a second step() steps with them again); their gradients left the device,
    so the backward, the accumulating backward, the second step() and a read are refused,
    naming zero_grad(), with parameters and optimizer state unchanged."""
    a = Branchy()
    extra = {
        "overlap": {},
        "ahead": dict(step_ahead=True, model=a),
        "split": dict(offload_fraction=0.5),
    }[mode]
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=512,
                                **extra)  # fmt: skip
    a(batch(0)).float().square().mean().backward()
    opt.step()
    opt.synchronize()
    before, state = Branchy(), copy.deepcopy(opt.state_dict())
    before.load_state_dict(a.state_dict())
    assert all(type(p.grad) is to.optim.ConsumedGrad for p in a.parameters() if p.grad is not None)
    with pytest.raises(RuntimeError, match=r"step\(\) after step\(\) without zero_grad"):
        opt.step()
    with pytest.raises((RuntimeError, MovedGradError), match="zero_grad"):
        a(batch(1), use_b=True).float().square().mean().backward()  # b: unused before
    with pytest.raises(MovedGradError, match="zero_grad"), opt.accumulating():
        a(batch(1)).float().square().mean().backward()
    with pytest.raises(MovedGradError, match="zero_grad"):
        a.a.weight.grad.norm()
    with pytest.raises(MovedGradError, match=r"model.zero_grad\(\) \(set_to_none=True\)"):
        a.zero_grad(set_to_none=False)
    opt.synchronize()
    assert same_params(a, before)
    after = opt.state_dict()
    assert all(torch.equal(after["state"][i]["exp_avg"], s["exp_avg"])
               for i, s in state["state"].items())  # fmt: skip
    assert not any(b.dispatched or b.stepped for b in opt._runtime.buckets)
    a.zero_grad()  # the model's own zero_grad is seen too
    ref = Reference(before, torch.optim.AdamW, lr=1e-2)
    ref.opt.load_state_dict(copy.deepcopy(state))
    a(batch(2)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    ref.twin(batch(2)).float().square().mean().backward()
    ref.step()
    opt.synchronize()
    assert same_params(a, ref.twin)
    opt.remove()


class FailingSGD(torch.optim.SGD):
    calls = 0
    fail_at = None

    def step(self, closure=None):
        FailingSGD.calls += 1
        if FailingSGD.calls == FailingSGD.fail_at:
            FailingSGD.failed = self
            raise ValueError("injected optimizer failure")
        return super().step(closure)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
def test_an_exception_mid_step_leaves_each_parameter_old_or_new(overlap):
    a = model()
    before = copy.deepcopy(a)
    ref = Reference(copy.deepcopy(a), torch.optim.SGD, lr=0.1, momentum=0.9)
    opt = to.OffloadedOptimizer(
        a.parameters(), FailingSGD, lr=0.1, momentum=0.9, bucket_bytes=2048, overlap=overlap
    )
    n = len(opt._runtime.buckets)
    FailingSGD.calls, FailingSGD.fail_at = 0, 2
    loss_of(a, batch(0)).backward()
    with pytest.raises(RuntimeError, match=rf"{n - 1} of {n} buckets were stepped") as info:
        opt.step()
    assert "injected optimizer failure" in str(info.value)
    ref.backward(batch(0))
    ref.step()
    failed = next(b for b in opt._runtime.buckets if b.optimizer is FailingSGD.failed).records
    for i, (p, old, new) in enumerate(
        zip(a.parameters(), before.parameters(), ref.twin.parameters(), strict=True)
    ):
        want = old if any(r.entry.index == i for r in failed) else new
        assert torch.equal(p, want), i
        assert torch.equal(opt._runtime.records[i].master, want.float())
    # As after a failed torch.optim step, the gradients are still there for it
    assert all(type(p.grad) is to.optim.ConsumedGrad for p in a.parameters())
    opt.zero_grad()
    FailingSGD.fail_at = None
    loss_of(a, batch(1)).backward()  # the optimizer goes on
    opt.step()
    opt.zero_grad()


def first_step_without_a_scaler(m, opt):
    """Until a first step() without a GradScaler, the host steps at step() only (Note: [Loss
    scaling]); afterwards buckets are stepped during backward."""
    loss_of(m, batch(99)).backward()
    opt.step()
    opt.zero_grad()
    assert opt._runtime.stepper.steps_early() == opt.config.overlap


def test_zero_grad_after_a_final_backward_undoes_the_steps_taken_during_it():
    a = model()
    before = copy.deepcopy(a)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.1, overlap=False)
    loss_of(a, batch(0)).backward()
    opt.zero_grad()  # nothing was stepped: at-step mode steps only in step()
    assert same_params(a, before)
    assert all(p.grad is None for p in a.parameters())
    opt2 = to.OffloadedOptimizer(before.parameters(), torch.optim.AdamW, lr=0.1)
    first_step_without_a_scaler(before, opt2)
    kept = copy.deepcopy(before)
    state = copy.deepcopy(opt2.state_dict())
    speculated = opt2._runtime.stepper.speculated
    loss_of(before, batch(0)).backward()
    for b in opt2._runtime.buckets:  # the worker has taken (and stepped) each
        assert b.handled.wait(10)
    assert opt2._runtime.stepper.speculated > speculated  # stepped during backward
    opt2.zero_grad()  # torch.optim: nothing changes
    assert same_params(before, kept)
    assert_state_equal(opt2.state_dict(), state)
    for p, rec in zip(before.parameters(), opt2._runtime.records, strict=True):
        assert torch.equal(p, rec.master)  # device and host agree


class ScaledReference(Reference):
    """torch.amp.GradScaler over the twin, as a plain loop uses it: the twin's gradients
    (of its dtype) are unscaled and checked by the scaler, then the plain class steps fp32
    copies unless one was not finite."""

    def __init__(self, twin, cls, **kw):
        super().__init__(twin, cls, **kw)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
        self.holder = torch.optim.SGD(twin.parameters(), lr=0.0)  # what the scaler unscales

    def backward(self, x):
        self.scaler.scale(loss_of(self.twin, x)).backward()

    def step(self):
        self.scaler.unscale_(self.holder)
        found = sum(v.item() for v in self.scaler._found_inf_per_device(self.holder).values())
        if found:
            self.twin.zero_grad()
        else:
            super().step()
        self.scaler.update()
        return bool(found)


def scaled_batch(i, dtype=torch.float32):
    x = batch(i, dtype)
    if i == 2:  # a non-finite gradient: the scaler skips this step and backs off
        x[0, 0] = float("inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["overlap", "at-step", "ahead", "split", "clip"])
def test_grad_scaler_unscales_and_skips_on_the_host_bitwise(dtype, mode):
    """Issue 38 item 5: scaler.step(opt) unscales the moved gradients on the host and skips
    the step when one is not finite, before any value is written: bitwise the plain class
    on fp32 copies under the same scaler, whose scale follows the same path."""
    a = model(dtype)
    clip = dict(max_grad_norm=0.5) if mode == "clip" else {}
    ref = ScaledReference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, **clip)
    extra = {
        "overlap": {},
        "at-step": dict(overlap=False),
        "ahead": dict(step_ahead=True, model=a),
        "split": dict(offload_fraction=0.5),
        "clip": clip,
    }[mode]
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                bucket_bytes=2048, **extra)  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    skipped = []
    for i in range(5):
        x = scaled_batch(i, dtype)
        scaler.scale(loss_of(a, x)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref.backward(x)
        skipped.append(ref.step())
        opt.synchronize()
        assert same_params(a, ref.twin), i
        assert scaler.get_scale() == ref.scaler.get_scale(), i
    assert skipped == [False, False, True, False, False]
    assert same_state(opt, ref)
    assert opt.stats().steps == 4
    opt.remove()


def test_grad_scaler_unscale_then_clip_then_step():
    """unscale_ first (to clip on the host, with max_grad_norm), then scaler.step: the scaler
    does not unscale twice, and the step is the plain one."""
    a = model()
    ref = ScaledReference(copy.deepcopy(a), torch.optim.SGD, lr=0.1, momentum=0.9,
                          max_grad_norm=0.1)  # fmt: skip
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
                                max_grad_norm=0.1, bucket_bytes=2048)  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    for i in range(3):
        scaler.scale(loss_of(a, batch(i))).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref.backward(batch(i))
        ref.step()
        assert same_params(a, ref.twin), i
    opt.remove()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
def test_a_grad_scaler_first_used_after_steps_without_one(overlap):
    """The host steps during backward once steps went without a scaler: a scaler that
    appears later finds buckets stepped with the scaled gradients, undoes those steps
    (Note: [Steps taken during backward]) and the result is the plain loop's, bitwise."""
    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                overlap=overlap)  # fmt: skip
    first_step_without_a_scaler(a, opt)
    twin = model()
    twin.load_state_dict(a.state_dict())
    ref = ScaledReference(twin, torch.optim.AdamW, lr=1e-2)
    ref.opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    for i in range(4):
        scaler.scale(loss_of(a, scaled_batch(i))).backward()
        if i == 0 and overlap:
            while not any(b.stepped for b in opt._runtime.buckets):  # stepped during backward
                time.sleep(0.001)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref.backward(scaled_batch(i))
        ref.step()
        assert same_params(a, ref.twin), i
    assert same_state(opt, ref)
    assert (opt._runtime.stepper.undone > 0) == overlap
    opt.remove()


def test_remove_restores_plain_gradients_and_refuses_further_use():
    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.1)
    opt.remove()
    loss_of(a, batch(0)).backward()
    assert all(type(p.grad) is torch.Tensor for p in a.parameters())
    with pytest.raises(RuntimeError, match="removed"):
        opt.step()
    again = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.1)  # no longer managed
    again.remove()


def test_bad_input_is_refused_with_the_argument_named():
    a = model()
    ps = list(a.parameters())
    with pytest.raises(TypeError, match="optimizer_class"):
        to.OffloadedOptimizer(ps, "adamw")
    with pytest.raises(TypeError, match="optimizer_class"):
        to.OffloadedOptimizer(ps, to.OffloadedOptimizer)
    with pytest.raises(ValueError, match="LBFGS.step needs a closure"):  # issue 39 item 5
        to.OffloadedOptimizer(ps, torch.optim.LBFGS)
    with pytest.raises(ValueError, match="SparseAdam steps sparse gradients only"):
        to.OffloadedOptimizer(ps, torch.optim.SparseAdam)  # it failed at the first step
    with pytest.raises(ValueError, match="appears twice"):
        to.OffloadedOptimizer(ps + ps[:1], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="empty"):
        to.OffloadedOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="meta"):
        to.OffloadedOptimizer([nn.Parameter(torch.ones(2, device="meta"))], torch.optim.SGD)
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        to.OffloadedOptimizer([torch.ones(2, dtype=torch.int64)], torch.optim.SGD)
    with pytest.raises(ValueError, match="leaf"):
        to.OffloadedOptimizer([ps[0] * 2], torch.optim.SGD)
    with pytest.raises(ValueError, match="bucket_bytes"):
        to.OffloadedOptimizer(ps, torch.optim.SGD, lr=0.1, bucket_bytes=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        to.OffloadedOptimizer(ps, torch.optim.SGD, lr=0.1, max_grad_norm=-1.0)
    with pytest.raises(TypeError, match="in config"):
        to.OffloadedOptimizer(ps, torch.optim.SGD, config=OptimizerOffloadConfig(), overlap=False)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # the class's own check
        to.OffloadedOptimizer(ps, torch.optim.SGD, lr=-1.0)
    # capturable=True: torch refuses it for CPU tensors at the first step, after the backward
    with pytest.raises(ValueError, match=r"capturable=True \(param group 0\)"):
        to.OffloadedOptimizer(ps, torch.optim.AdamW, lr=0.1, capturable=True)
    with pytest.raises(ValueError, match=r"capturable=True \(param group 1\)"):
        to.OffloadedOptimizer([{"params": ps[:1]}, {"params": ps[1:], "capturable": True}],
                              torch.optim.Adam, lr=0.1)  # fmt: skip
    opt = to.OffloadedOptimizer(ps, torch.optim.SGD, lr=0.1)  # nothing was left hooked
    opt.remove()
    # ... nor through a plain optimizer's state dict, or a group edited in place
    plain = torch.optim.Adam(ps, lr=0.1, capturable=True)
    opt = to.OffloadedOptimizer(ps, torch.optim.Adam, lr=0.1)
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"capturable=True \(param group 0\)"):
        opt.load_state_dict(plain.state_dict())
    assert opt.state_dict()["param_groups"] == before["param_groups"]  # nothing changed
    opt.param_groups[0]["capturable"] = True
    with pytest.raises(RuntimeError, match=r"capturable=True \(param group 0\)"):
        loss_of(a, batch(0)).backward()
    opt.param_groups[0]["capturable"] = False
    opt.zero_grad()
    opt.remove()
    opt = to.OffloadedOptimizer(ps, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="already managed"):
        to.OffloadedOptimizer(ps[1:], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(RuntimeError, match="param group"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    with pytest.raises(TypeError, match="pickled"):
        import pickle

        pickle.dumps(opt)
    a.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="after converting"):
        loss_of(a, batch(0, torch.bfloat16)).backward()  # the hook finds the dtype changed
    opt.remove()


class Tied(nn.Module):
    """The root's forward reads a child's parameter directly (a tied output head)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.to(dtype)

    def forward(self, x):
        return self.blocks(self.embed(x)) @ self.embed.weight.T


class SlowAdamW(torch.optim.AdamW):
    """Each bucket's step takes 20 ms, so the next forward runs while buckets are stepped."""

    def step(self, closure=None):
        import time

        time.sleep(0.02)
        return super().step(closure)


def tied_batch(i):
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("backwards", [1, 2])
def test_stepping_ahead_keeps_the_next_backward_overlapped(backwards):
    """Note: [Stepping ahead]: the first gradient of the next backward finishes the step still
    running on the host; that backward's buckets are then stepped as they arrive, as without
    step_ahead. Found on an H100 (benchmarks/log/2026-11-27-clip-on-the-host.md, run T14):
    finishing the step counted the backwards again from zero after the running one had been
    counted, so every later gradient of it was taken for one the next backward accumulates
    into and nothing was stepped during backward. A loop of two backwards a step keeps its
    prediction: the first backward's buckets wait, and nothing is undone."""
    a, twin = Tied(torch.float32), Tied(torch.float32)
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                step_ahead=True, model=a)  # fmt: skip
    rt = opt._runtime
    for i in range(4):
        if i == 1:  # the first step learned how many backwards a step has
            undone = rt.stepper.undone
        for j in range(backwards):
            x = tied_batch(backwards * i + j)
            before = rt.stepper.speculated
            a(x).float().square().mean().backward()
            if j == backwards - 1:  # the worker has taken each, the first step's too: a step
                for b in rt.buckets:  # it took during that backward is counted before step()
                    assert b.handled.wait(10)  # (one still running was counted in the next)
            if i and j == backwards - 1:  # from the second step (Note: [Loss scaling])
                assert rt.stepper.speculated - before == len(rt.buckets), (i, j)
            elif i:
                assert rt.stepper.speculated == before, (i, j)  # predicted: another follows
            twin(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref.step()
    assert rt.stepper.undone == undone
    opt.synchronize()
    assert same_params(a, twin)
    assert same_state(opt, ref)
    opt.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_ahead_forward_waits_for_parameters_still_being_stepped(dtype):
    a, twin = Tied(dtype), Tied(dtype)
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(
        a.parameters(), SlowAdamW, lr=1e-2, bucket_bytes=2048, step_ahead=True, model=a
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=1, gamma=0.5)
    waited = 0
    for i in range(4):
        loss = a(tied_batch(i)).float().square().mean()
        ref_loss = twin(tied_batch(i)).float().square().mean()
        assert torch.equal(loss, ref_loss), i  # the forward read the stepped parameters
        loss.backward()
        opt.step()
        waited += len(opt._runtime.waiting) > 0  # still stepping when step() returned
        opt.zero_grad()  # does not wait
        sched.step()  # changes lr while the host still steps with the old one
        ref_loss.backward()
        ref.step()
        ref_sched.step()
    assert waited >= 3
    opt.synchronize()
    assert same_params(a, twin)
    assert same_state(opt, ref)
    opt.remove()


def test_step_ahead_needs_the_model():
    with pytest.raises(ValueError, match="model="):
        to.OffloadedOptimizer(model().parameters(), torch.optim.SGD, lr=0.1, step_ahead=True)
    with pytest.raises(TypeError, match="model must be"):
        to.OffloadedOptimizer(model().parameters(), torch.optim.SGD, lr=0.1, model="m")


def _snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


READS = {
    "state_dict": lambda m: m.state_dict(),
    "submodule_state_dict": lambda m: m.blocks.state_dict(),
    "named_parameters": lambda m: {n: p.detach().clone() for n, p in m.named_parameters()},
    "norm": lambda m: {n: p.float().norm() for n, p in m.named_parameters()},
    "data": lambda m: {n: p.data for n, p in m.named_parameters()},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("read", list(READS))
def test_step_ahead_reading_the_model_after_step_sees_the_new_values(dtype, read):
    """Issue 38 item 6: right after step() with step_ahead, the host step is held (so it is
    certainly still running); reading the model's values (its state_dict, a submodule's,
    named_parameters' values, a norm for logging, .data) waits for it and sees the stepped
    values, bitwise; zero_grad(), a scheduler and metadata reads do not wait."""
    from torchoffload import testing

    a, twin = Tied(dtype), Tied(dtype)
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                step_ahead=True, model=a)  # fmt: skip
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=1, gamma=0.5)
    for i in range(3):
        with testing.held_host_step(opt) as hooks:
            a(tied_batch(i)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            metadata = [(p.shape, p.dtype, p.size(), p.grad) for p in a.parameters()]
            assert all(grad is None for *_, grad in metadata)
            assert hooks.waits == 0 and opt._runtime.waiting  # still stepping
            got = READS[read](a)
            got = {k: v.clone() for k, v in got.items()}
        opt.synchronize()  # a read through the mode waited for its buckets only
        twin(tied_batch(i)).float().square().mean().backward()
        ref.step()
        ref_sched.step()
        want = READS[read](twin)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (i, k)
    opt.synchronize()
    assert same_params(a, twin) and same_state(opt, ref)
    opt.remove()


def test_step_ahead_load_state_dict_after_step_is_not_overwritten_by_the_step():
    """Issue 38 item 6: a checkpoint loaded into the model right after step() is what the
    parameters hold afterwards (the step is finished first, not uploaded over it), and the
    next step starts from it."""
    from torchoffload import testing

    a = Tied()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                step_ahead=True, model=a)  # fmt: skip
    ckpt = _snapshot(Tied())
    with testing.held_host_step(opt):
        a(tied_batch(0)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        a.load_state_dict(ckpt)
    opt.synchronize()
    for k, v in a.state_dict().items():
        assert torch.equal(v, ckpt[k]), k
    twin = Tied()
    twin.load_state_dict(ckpt)
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    ref.opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    a(tied_batch(1)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    twin(tied_batch(1)).float().square().mean().backward()
    ref.step()
    opt.synchronize()
    assert same_params(a, twin)
    opt.remove()


def test_step_ahead_under_a_user_mode_finishes_the_step_in_step():
    """Note: [Reading the model while stepping ahead]: under a user's TorchFunctionMode,
    step() does not push the read mode above it (its exit would pop ours): it finishes the
    step itself, and the mode stack is left as it was."""
    from torch.overrides import BaseTorchFunctionMode

    from torchoffload import testing

    a = Tied()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                step_ahead=True, model=a)  # fmt: skip
    depth = torch._C._len_torch_function_stack()
    with testing.held_host_step(opt) as hooks:
        a(tied_batch(0)).float().square().mean().backward()
        with BaseTorchFunctionMode() as mode:
            opt.step()
            assert hooks.waits >= 1 and not opt._runtime.waiting
            assert torch.overrides._get_current_function_mode() is mode
    assert torch._C._len_torch_function_stack() == depth
    opt.remove()


def test_hyperparameters_changed_between_backward_and_step_are_the_ones_stepped_with():
    """Buckets stepped during backward with lr 1e-2 are undone and stepped again with the
    values of the step() call, as torch.optim steps with them."""
    a = model()
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    for i in range(3):
        # The first layer's backward, the last to run, lingers: the worker steps the later
        # layers' buckets meanwhile, with the old lr.
        h = a[0].register_full_backward_pre_hook(lambda *args: time.sleep(0.05))
        loss_of(a, batch(i).requires_grad_()).backward()
        h.remove()
        ref.backward(batch(i))
        for g in (*opt.param_groups, *ref.opt.param_groups):
            g["lr"] = 1e-2 / (i + 2)
        opt.step()
        opt.zero_grad()
        ref.step()
        assert same_params(a, ref.twin), i
    assert same_state(opt, ref)
    assert opt._runtime.stepper.undone > 0


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in the main thread, as Ctrl-C does in a terminal, however
    pytest was started. Python installs that handler at startup only if SIGINT is not ignored
    then, and a shell without job control (a script, ``bash -c``) starts a command put in the
    background with ``&`` with SIGINT ignored (POSIX): the signal was dropped, step() returned
    normally and the test failed, "DID NOT RAISE KeyboardInterrupt", in a pytest started that
    way to run beside another (taken for a failure under load)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_during_step_finishes_the_step_then_raises(sigint_raises):
    """Ctrl-C while step() waits for the host: the step completes (nothing half-done, the
    worker and the caller stay in step), then KeyboardInterrupt is raised. (The worker polls
    the caller's frame with the collector paused: Note: [Another thread's frame without a
    collection]; with sys._current_frames() alone a full run hung here once.)"""
    import signal
    import threading
    import time

    from torchoffload._calls import current_frame

    main = threading.main_thread().ident
    sent = []

    class InterruptingAdamW(SlowAdamW):
        """The first bucket's step (on the worker) sends Ctrl-C once the caller waits in
        step(): a timer could fire before step() or after it returned on a loaded machine."""

        def step(self, closure=None):
            if not sent:
                while current_frame(main).f_code.co_name not in ("wait", "wait_for"):
                    time.sleep(0.001)
                signal.pthread_kill(main, signal.SIGINT)
                sent.append(True)
            return super().step(closure)

    a = model()
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), InterruptingAdamW, lr=1e-2, bucket_bytes=2048,
                                overlap=False)  # fmt: skip
    loss_of(a, batch(0)).backward()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    opt.zero_grad()
    assert sent
    ref.backward(batch(0))
    ref.step()
    assert same_params(a, ref.twin)
    for i in range(1, 3):
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(i))
        ref.step()
        assert same_params(a, ref.twin), i


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_requires_grad_changed_after_the_build_is_stepped_as_torch_optim(overlap, dtype):
    """Issue 40: freezing a layer after the optimizer was built (no gradient: not stepped) and
    unfreezing one frozen at the build (BitFit, gradual unfreezing: stepped once it has a
    gradient), bitwise the plain class (Note: [requires_grad changed after the build])."""
    a = model(dtype)
    a[2].weight.requires_grad_(False)  # frozen at the build
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                bucket_bytes=2048, overlap=overlap)  # fmt: skip
    changes = {2: [(0, False)], 4: [(2, True)], 6: [(0, True), (4, False)]}
    for i in range(8):
        for layer, on in changes.get(i, []):
            for m in (a, ref.twin):
                m[layer].weight.requires_grad_(on)
        loss_of(a, batch(i, dtype)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(i, dtype))
        ref.step()
        assert same_params(a, ref.twin), i
    assert same_state(opt, ref)
    opt.remove()


def test_misuse_between_backward_and_step_is_refused():
    a = model()
    a[0].weight.requires_grad_(False)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.1, bucket_bytes=2048)
    loss_of(a, batch(0)).backward()
    with pytest.raises(RuntimeError, match="between the final backward and step"):
        opt.state_dict()
    opt.step()
    opt.zero_grad()
    opt.remove()
    a = model()
    a[0].weight.requires_grad_(False)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.1, offload_fraction=0.5)
    a[0].weight.requires_grad_(True)  # unfrozen after the build, with a device part
    before = copy.deepcopy(a)
    with pytest.raises(RuntimeError, match="requires_grad was False"):
        loss_of(a, batch(1)).backward()
        opt.step()
    assert same_params(a, before)  # refused before anything changed


def test_writes_through_data_are_read_again_on_request():
    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.SGD, lr=0.0)
    loss_of(a, batch(0)).backward()
    opt.step()
    opt.zero_grad()
    a[0].weight.data.mul_(0)  # bypasses the version counter
    opt.reload_parameters()
    loss_of(a, batch(1)).backward()
    opt.step()
    opt.zero_grad()
    assert torch.count_nonzero(a[0].weight) == 0


def _steps_with_a_tensor_lr_and_a_scheduler():
    """Three steps ahead with a tensor lr halved by a scheduler after each step(), and the
    same with torch.optim.AdamW: the parameters must agree."""
    a, twin = Tied(), Tied()
    ref = Reference(twin, torch.optim.AdamW, lr=torch.tensor(1e-2))
    opt = to.OffloadedOptimizer(a.parameters(), SlowAdamW, lr=torch.tensor(1e-2),
                                bucket_bytes=2048, step_ahead=True, model=a)  # fmt: skip
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=1, gamma=0.5)
    for i in range(3):
        a(tied_batch(i)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()  # fill_ on the tensor lr while the host still steps
        twin(tied_batch(i)).float().square().mean().backward()
        ref.step()
        ref_sched.step()
    opt.synchronize()
    assert same_params(a, twin)


def test_a_tensor_lr_is_snapshotted_not_aliased():
    _steps_with_a_tensor_lr_and_a_scheduler()


def test_a_scheduler_step_while_the_worker_reads_the_values_changes_nothing(monkeypatch):
    """A bucket the worker steps during backward reads the live hyperparameters; if step()
    took its snapshot and returned, and a scheduler changed lr, before that read ended, the
    bucket used the new lr and the step raised "param_groups changed" (a flaky CI failure).
    The worker's read is slowed here to widen that window."""
    import threading
    import time

    import torchoffload.optim._step as step  # where the worker reads them

    hyper = step.hyper

    def slow_in_the_worker(group):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)
        return hyper(group)

    monkeypatch.setattr(step, "hyper", slow_in_the_worker)
    _steps_with_a_tensor_lr_and_a_scheduler()


def test_step_ahead_under_torch_compile_finishes_the_step_before_the_forward():
    torch._dynamo.reset()
    a, twin = Tied(), Tied()
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), SlowAdamW, lr=1e-2, bucket_bytes=2048,
                                step_ahead=True, model=a)  # fmt: skip
    compiled = torch.compile(a, backend="eager")
    for i in range(3):
        loss = compiled(tied_batch(i)).float().square().mean()
        ref_loss = twin(tied_batch(i)).float().square().mean()
        assert torch.equal(loss, ref_loss), i
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss.backward()
        ref.step()
    opt.remove()


# -- offload_fraction: part of the state stays on the device ----------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ahead", [False, True], ids=["at-step", "ahead"])
def test_offload_fraction_keeps_the_first_parameters_on_the_device_bitwise(dtype, ahead):
    """Half the trainable bytes on the host (the last parameters, whose gradients come first),
    the rest stepped on the device (the CPU here) at step(): with param groups, an LR
    scheduler and gradient accumulation, bitwise the class on fp32 copies; the device part's
    gradients are not moved."""
    a = model(dtype)

    def groups(ps):
        return [{"params": ps[:2], "lr": 0.05}, {"params": ps[2:], "weight_decay": 0.0}]

    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2, groups=groups)
    ps = list(a.parameters())
    kw = dict(step_ahead=True, model=a) if ahead else {}
    opt = to.OffloadedOptimizer(groups(ps), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                offload_fraction=0.5, **kw)  # fmt: skip
    kept = {id(p) for p in opt._device.params}
    host = [p for p in ps if id(p) not in kept]
    pos = {id(p): i for i, p in enumerate(ps)}
    assert kept and host and pos[id(host[0])] > max(pos[k] for k in kept)
    nbytes = sum(p.numel() for p in ps)
    assert 0.5 * nbytes <= sum(p.numel() for p in host) < nbytes
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=1, gamma=0.5)
    for i in range(4):
        with opt.accumulating():
            loss_of(a, batch(10 + i, dtype)).backward()
        loss_of(a, batch(i, dtype)).backward()
        assert all(type(p.grad) is torch.Tensor for p in opt._device.params)
        assert all(type(p.grad) is to.optim.MovedGrad for p in host)
        opt.step()
        opt.zero_grad()
        sched.step()
        ref.backward(batch(10 + i, dtype))
        ref.backward(batch(i, dtype))
        ref.step()
        ref_sched.step()
        opt.synchronize()
        assert same_params(a, ref.twin), i
    assert same_state(opt, ref)
    stats = opt.stats()
    assert stats.device_params == len(kept)
    n = sum(p.numel() for p in opt._device.params)
    masters = 0 if dtype == torch.float32 else 4 * n
    expected = masters + 8 * n  # AdamW's two fp32 moments, plus a scalar step per parameter
    assert expected <= stats.device_state_bytes <= expected + 8 * len(kept)
    assert "kept on the device" in repr(opt)
    opt.remove()


def test_offload_fraction_state_dict_moves_between_placements():
    """A state dict saved with part of the state on the device loads into an optimizer with
    all of it on the host, and that one's into a third with another split, continuing
    bitwise."""
    a = model(torch.bfloat16)
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2,
                                offload_fraction=0.3)  # fmt: skip
    for i in range(2):
        loss_of(a, batch(i, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(i, torch.bfloat16))
        ref.step()
    for step, fraction in ((5, 1.0), (6, 0.6)):
        saved = opt.state_dict()
        assert len(masters_of(saved)) == len(list(a.parameters()))
        opt.remove()
        b = model(torch.bfloat16, seed=3)
        b.load_state_dict(a.state_dict())
        opt = to.OffloadedOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2,
                                    offload_fraction=fraction)  # fmt: skip
        opt.load_state_dict(saved)
        loss_of(b, batch(step, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(step, torch.bfloat16))
        ref.step()
        assert same_params(b, ref.twin), fraction
        assert same_state(opt, ref)
        a = b
    opt.remove()


def test_offload_fraction_refusals():
    a = model()
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="offload_fraction"):
            to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, offload_fraction=bad)
    with pytest.raises(ValueError, match="offload_fraction < 1: not supported yet with max_gr"):
        to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, offload_fraction=0.5,
                              max_grad_norm=1.0)  # fmt: skip
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, offload_fraction=0.5)
    with pytest.raises(ValueError, match="already managed"):  # a device-part parameter too
        to.OffloadedOptimizer([a[0].weight], torch.optim.AdamW)
    a[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="parameter 0: requires_grad was True"):
        loss_of(a, batch(0)).backward()  # before it accumulates anything
    assert all(p.grad is None for p in a.parameters())
    with pytest.raises(RuntimeError, match="parameter 0: requires_grad was True"):
        opt.step()
    opt.remove()
    to.OffloadedOptimizer([a[0].bias], torch.optim.AdamW).remove()  # released by remove()
    # Messages name parameters in the optimizer's order, for the host part too.
    b = model()
    opt = to.OffloadedOptimizer(b.parameters(), torch.optim.AdamW, offload_fraction=0.5)
    first_step_without_a_scaler(b, opt)
    b[4].bias.requires_grad_(False)  # parameter 5, stepped on the host
    before = copy.deepcopy(b)
    with pytest.raises(RuntimeError, match="parameter 5: requires_grad was True"):
        loss_of(b, batch(0)).backward()
        opt.step()
    assert same_params(b, before)  # refused before any bucket was stepped for good
    opt.remove()


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_a_backward_the_step_would_refuse_is_refused_before_it_accumulates(fraction):
    """Note: [Refused before a backward accumulates]: no gradient of the refused backward is
    left behind, the device part's included; torch.autograd.grad is not refused."""
    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.Adagrad, lr=0.1,
                                offload_fraction=fraction)  # fmt: skip
    a.to(torch.float64)
    x = batch(0, torch.float64)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="after converting the model"):
            loss_of(a, x).backward()
        assert all(p.grad is None for p in a.parameters())
    grads = torch.autograd.grad(loss_of(a, x), list(a.parameters()))
    assert all(g.dtype == torch.float64 for g in grads)
    assert all(p.grad is None for p in a.parameters())
    with pytest.raises(RuntimeError, match="after converting the model"):
        opt.step()
    opt.remove()
    loss_of(a, x).backward()  # a plain model again
    assert all(p.grad is not None for p in a.parameters())


def test_a_device_part_parameter_frozen_at_the_build_with_a_gradient_is_refused():
    """torch.optim steps a frozen parameter that has a gradient (zeros kept by
    zero_grad(set_to_none=False)); the device part keeps no fp32 master for a bf16 parameter
    frozen at the build, so the step is refused, before anything changes (found by the
    differential fuzzer)."""
    a = model(torch.bfloat16)
    loss_of(a, batch(0, torch.bfloat16)).backward()
    a[0].weight.requires_grad_(False)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2,
                                offload_fraction=0.5)  # fmt: skip
    assert any(p is a[0].weight for p in opt._device.params)
    before = copy.deepcopy(a)
    with pytest.raises(RuntimeError, match="parameter 0 was frozen when the optimizer was built"):
        opt.step()
    assert same_params(a, before)
    a[0].weight.grad = None
    opt.step()
    assert torch.equal(a[0].weight, before[0].weight)
    opt.remove()


def test_offload_fraction_keeps_no_copy_of_frozen_parameters():
    a = model(torch.bfloat16)
    a[0].weight.requires_grad_(False)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2,
                                offload_fraction=0.5)  # fmt: skip
    assert any(p is a[0].weight for p in opt._device.params)
    loss_of(a, batch(0, torch.bfloat16)).backward()
    opt.step()
    opt.zero_grad()
    trainable = [p for p in opt._device.params if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    # fp32 masters and AdamW's two moments of the trainable ones (plus a scalar step each)
    assert 12 * n <= opt.stats().device_state_bytes <= 12 * n + 8 * len(trainable)
    opt.remove()


class Strided(nn.Module):
    """A channels_last conv and a transposed weight: gradients and parameters that are not
    contiguous."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
        self.w = nn.Parameter(torch.randn(16, 8).t())

    def forward(self, x):
        x = x.view(-1, 4, 2, 2).repeat(1, 1, 2, 2).to(memory_format=torch.channels_last)
        return self.conv(x).mean((2, 3)) @ self.w


@pytest.mark.parametrize("convert_on", ["device", "host"])
def test_strided_parameters_are_converted_bitwise(convert_on):
    a = Strided().to(torch.bfloat16)
    assert not a.conv.weight.is_contiguous() and not a.w.is_contiguous()
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2,
                                convert_on=convert_on)  # fmt: skip
    for i in range(3):
        loss_of(a, batch(i, torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(i, torch.bfloat16))
        ref.step()
        assert same_params(a, ref.twin), i
    assert not a.conv.weight.is_contiguous()  # the layout survives the upload
    opt.remove()


# -- Findings of the differential fuzzer (NEW-1, 2, 3, 5), each reduced to its case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_ahead_a_copy_of_the_model_is_a_plain_model_of_the_stepped_values(dtype):
    """NEW-1: copy.deepcopy(model) (an EMA copy) raised "cannot pickle '_thread.lock'" from
    step_ahead's hooks on the model. A copy (deepcopy, pickle) taken while the step still runs
    holds the stepped values; its hooks are inert: its forward and state_dict do not touch
    the optimizer, which goes on bitwise."""
    from torchoffload import testing

    a, twin = Tied(dtype), Tied(dtype)
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                step_ahead=True, model=a)  # fmt: skip
    copies = []
    for i in range(3):
        with testing.held_host_step(opt):
            a(tied_batch(i)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            assert opt._runtime.waiting  # still stepping
            copies.append(copy.deepcopy(a) if i < 2 else pickle.loads(pickle.dumps(a)))
        twin(tied_batch(i)).float().square().mean().backward()
        ref.step()
        assert same_params(copies[-1], twin), i
    for c in copies:
        assert not any(p in opt._runtime._index for p in c.parameters())
        before = copy.deepcopy(c.state_dict())
        c(tied_batch(7)).float().square().mean().backward()
        assert all(type(p.grad) is torch.Tensor for p in c.parameters())  # not moved
        assert all(torch.equal(v, before[k]) for k, v in c.state_dict().items())
    for i in range(3, 5):
        a(tied_batch(i)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        twin(tied_batch(i)).float().square().mean().backward()
        ref.step()
    opt.synchronize()
    assert same_params(a, twin) and same_state(opt, ref)
    opt.remove()


@pytest.mark.parametrize("given", [True, False], ids=["model", "no-model"])
def test_clipping_sums_the_norm_in_the_model_order_with_param_groups_in_another(given):
    """NEW-2: with param groups listed in another order than the model's, ``max_grad_norm``
    summed the norms in group order; clip_grad_norm_(model.parameters()) (Trainer,
    accelerate) sums them in the model's, and the clip coefficient differed in its last bits.
    With ``model=`` the norm is the model's; without it, that of the parameters in the order
    given (Note: [The order of the clipping norm])."""

    def groups(m):
        return [
            {"params": list(m[1:].parameters()), "lr": 0.02},
            {"params": list(m[0].parameters())},
        ]

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(31, 8), nn.Linear(8, 8), nn.Linear(8, 31))

    def first_grads(x):
        m = build()
        m(x).float().pow(2).mean().mul(100).backward()
        return [p.grad for p in m.parameters()], [p.grad for g in groups(m) for p in g["params"]]

    # an input at whose first step the two orders round differently (which one depends on the
    # CPU's kernels): a real test of the order
    for seed in range(200):
        x = torch.randint(0, 30, (3, 3), generator=torch.Generator().manual_seed(seed))
        grads, by_group = first_grads(x)
        if not torch.equal(torch.nn.utils.get_total_norm(grads),
                           torch.nn.utils.get_total_norm(by_group)):  # fmt: skip
            break
    ref, a = build(), build()
    opt = to.OffloadedOptimizer(groups(a), torch.optim.Adagrad, lr=1e-2, max_grad_norm=1.0,
                                model=a if given else None)  # fmt: skip
    plain = torch.optim.Adagrad(groups(ref), lr=1e-2)
    for i in range(2):
        for m in (ref, a):
            m(x + i).float().pow(2).mean().mul(100).backward()
        in_groups = [p for g in groups(ref) for p in g["params"]]
        grads = [p.grad for p in ref.parameters()]
        by_group = [p.grad for p in in_groups]
        # at the first step the two orders round differently: a real test of the order
        differ = not torch.equal(torch.nn.utils.get_total_norm(grads),
                                 torch.nn.utils.get_total_norm(by_group))  # fmt: skip
        assert differ or i > 0
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters() if given else in_groups, 1.0)
        plain.step()
        plain.zero_grad()
        opt.step()
        opt.zero_grad()
        assert torch.equal(opt.grad_norm, norm), i
        assert same_params(a, ref), i
    opt.remove()


class Views(nn.Module):
    """Two bf16 parameters that are views of one storage (the halves of one tensor) and a
    weight, registered in ``order``; ``b`` is unused at every third step."""

    def __init__(self, order):
        super().__init__()
        torch.manual_seed(0)
        base = torch.randn(2, 16).to(torch.bfloat16)
        tensors = {"a": base[0], "b": base[1], "w": torch.randn(16, 16).to(torch.bfloat16)}
        for name in order:
            setattr(self, name, nn.Parameter(tensors[name]))

    def loss(self, i):
        out = (self.a * (1 + 0.1 * i)) @ self.w
        if i % 3 != 1:
            out = out * self.b
        return out.float().square().mean()


@pytest.mark.parametrize(
    "order, fraction, bucket_bytes",
    [("abw", 0.5, None), ("awb", 0.5, None), ("awb", 1.0, 64), ("abw", 1.0, 32)],
    ids=["split-device", "split-between", "buckets-between", "buckets-apart"],
)
@pytest.mark.parametrize("convert_on", ["device", "host"])
def test_parameters_that_share_a_storage_are_stepped_bitwise(order, fraction, bucket_bytes,
                                                             convert_on):  # fmt: skip
    """NEW-3: with offload_fraction < 1, bf16 parameters that are views of one storage were
    not the plain class on fp32 masters: the device part's write of one moved the version of
    the other, whose master was then read again from its rounded value. With buckets that
    separated them, the overlap's upload of one failed autograd's version check of the other
    in backward. The parameters of a storage now stay in one part and one bucket, and the
    optimizer's own writes do not count as changes (Note: [Parameters that share a
    storage])."""
    a, twin = Views(order), Views(order)
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, convert_on=convert_on,
                                offload_fraction=fraction, bucket_bytes=bucket_bytes)  # fmt: skip
    rt = opt._runtime
    placed = {n: rt.layout.entries[rt._index[id(p)]].bucket if id(p) in rt._index else "device"
              for n, p in a.named_parameters()}  # fmt: skip
    assert placed["a"] == placed["b"]
    for i in range(7):
        a.loss(i).backward()
        opt.step()
        opt.zero_grad()
        twin.loss(i).backward()
        ref.step()
        assert same_params(a, twin), i
    assert same_state(opt, ref)
    opt.remove()


@pytest.mark.parametrize("bucket_bytes", [32, 64], ids=["apart", "between"])
def test_views_given_storages_of_their_own_by_to_dtype_are_stepped_bitwise(bucket_bytes):
    """NEW-3 (fuzzer): views of one fp32 storage converted by ``module.to(torch.bfloat16)``
    get storages of their own but keep one version counter (``to`` sets ``param.data``), so
    the upload of one in its bucket moved the other's version, whose fp32 master was then read
    again from its rounded value. They are now one family, as views of one storage are."""

    def build():
        m = Views("abw")
        torch.manual_seed(0)
        base = torch.randn(2, 16)
        m.a, m.b = nn.Parameter(base[0]), nn.Parameter(base[1])
        return m.to(torch.bfloat16)

    a, twin = build(), build()
    assert a.a.untyped_storage().data_ptr() != a.b.untyped_storage().data_ptr()
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2,
                                bucket_bytes=bucket_bytes)  # fmt: skip
    for i in range(4):
        a.loss(i).backward()
        opt.step()
        opt.zero_grad()
        twin.loss(i).backward()
        ref.step()
        assert same_params(a, twin), i
    opt.remove()


@pytest.mark.parametrize("fraction", [1.0, 0.1], ids=["host", "split"])
def test_state_dict_after_an_in_place_edit_holds_the_masters_of_the_edited_values(fraction):
    """NEW-5: after an in-place edit of a bf16 parameter between steps (manual weight decay),
    state_dict() held the stale fp32 master, and loading the checkpoint into a fresh model
    and optimizer was refused ("does not round to parameter 0's current value"). The masters
    are read again first, as the next step reads them: the resumed run continues bitwise.
    (With 0.1 the weight is stepped on the device, the bias on the host.)"""

    def build():
        torch.manual_seed(0)
        return nn.Linear(8, 4).to(torch.bfloat16)

    def x(i):
        return torch.randn(2, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)

    m = build()
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2,
                                offload_fraction=fraction)  # fmt: skip
    assert (opt._device is not None) == (fraction < 1)
    m(x(0)).float().sum().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        m.weight.mul_(0.9)  # manual weight decay between steps
        m.bias.add_(0.01)
    checkpoint = copy.deepcopy((m.state_dict(), opt.state_dict()))
    # read again from the edited values, each master is its parameter's bits: left out, and
    # rebuilt from the parameters by the load (Note: [A master that is its parameter's bits])
    assert masters_of(checkpoint[1]) == {}
    resumed = build()
    resumed.load_state_dict(checkpoint[0])
    opt2 = to.OffloadedOptimizer(resumed.parameters(), torch.optim.AdamW, lr=1e-2,
                                 offload_fraction=fraction)  # fmt: skip
    opt2.load_state_dict(checkpoint[1])
    for mm, o in ((m, opt), (resumed, opt2)):
        for i in range(1, 3):
            mm(x(i)).float().sum().backward()
            o.step()
            o.zero_grad()
    assert same_params(m, resumed)
    opt.remove()
    opt2.remove()


@pytest.mark.parametrize(
    "cls,kw",
    [(torch.optim.AdamW, dict(fused=True)), (torch.optim.AdamW, dict(foreach=True)),
     (torch.optim.Adam, dict(foreach=False)), (torch.optim.SGD, dict(momentum=0.9, lr=0.1)),
     (torch.optim.Adagrad, dict())],
    ids=["adamw-fused", "adamw-foreach", "adam-single", "sgd-momentum", "adagrad"],
)  # fmt: skip
def test_a_copy_aside_made_ahead_is_made_again_for_what_changed_since(cls, kw):
    """Note: [Copies aside made ahead]: `Undo.save` skips a tensor copied ahead only while its
    version counter says nothing wrote it; each optimizer class's kernels, a write through a
    view and a replaced state tensor are seen."""
    from torchoffload.optim._undo import Undo

    master = torch.randn(1000)
    opt = cls([master], **kw)

    def step(seed):
        master.grad = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
        opt.step()
        master.grad = None

    def snapshot():
        state = opt.state[master]
        return [master.clone()] + [state[k].clone() for k in sorted(state)
                                   if isinstance(state[k], torch.Tensor)]  # fmt: skip

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    step(0)
    undo = Undo()
    steps = 1  # as `HostStep` counts a bucket's steps
    for change in ("a step", "nothing", "a view", "a replaced tensor"):
        undo.prepare(opt, steps)
        assert undo.prepared
        if change == "a step":  # a fused kernel moves no version counter: the count says it
            step(1)
            steps += 1
        elif change == "a view":
            with torch.no_grad():
                master[:10].mul_(2)
        elif change == "a replaced tensor":
            state = opt.state[master]
            key = next(k for k in sorted(state) if isinstance(state[k], torch.Tensor))
            state[key] = state[key] + 1
        before = snapshot()
        undo.save(opt, steps)
        assert not undo.prepared
        step(2)
        steps += 1
        assert not same(snapshot(), before)
        undo.restore(opt)
        assert same(snapshot(), before), change


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_steps_undone_after_copies_aside_made_ahead_are_torch_optim(dtype):
    """Note: [Copies aside made ahead]: the worker copies aside, while idle, the buckets it
    stepped during the last backward; undoing a step taken with those copies (zero_grad(), a
    second backward) restores what the step overwrote, also after the parameters were
    written in place since (their masters read again)."""
    a = model(dtype)
    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2,
                                bucket_bytes=1024)  # fmt: skip
    rt = opt._runtime
    x = batch(0, dtype)

    def backward(xb, taken=True):
        loss_of(a, xb).backward()
        for b in rt.buckets:  # the worker has taken (and stepped) each: all are hinted
            assert not taken or b.handled.wait(10)

    for step in range(6):
        if step > 0:  # every bucket was stepped during the last backward: copied ahead
            wait_until(lambda: all(b.undo.prepared for b in rt.buckets))
        if step == 2:  # zero_grad() after a final backward: every speculative step undone
            undone = rt.stepper.undone
            backward(x)
            opt.zero_grad()
            assert rt.stepper.undone == undone + len(rt.buckets)
            wait_until(lambda: all(b.undo.prepared for b in rt.buckets))
        if step == 3:  # written in place after the copies ahead (the masters are read again
            with torch.no_grad():  # at dispatch), then a second backward undoes the steps
                for p, q in zip(a.parameters(), ref.twin.parameters(), strict=True):
                    p.mul_(0.5)
                    q.mul_(0.5)
            for m, q in zip(ref.masters, ref.twin.parameters(), strict=True):
                m.data.copy_(q.float())
            undone = rt.stepper.undone
            backward(x)
            ref.backward(x)
        # After step 3's two backwards, the runtime expects two (Note: [A second backward]):
        # step 4's one keeps its gradients on the device until step()
        backward(batch(step, dtype), taken=step != 4)
        if step == 3:
            assert rt.stepper.undone == undone + len(rt.buckets)
        ref.backward(batch(step, dtype))
        opt.step()
        opt.zero_grad()
        ref.step()
        for p, q in zip(a.parameters(), ref.twin.parameters(), strict=True):
            assert torch.equal(p, q), step
    assert rt.recalls.recalled > 0
    opt.remove()


def test_an_optimizer_finalized_on_its_own_worker_thread_closes():
    """Note: [Closing from a thread of our own]: the garbage collector may run the finalizer
    of an optimizer dropped without remove() on its worker thread; it closes on a thread of
    its own instead of failing to join itself."""
    from torchoffload.optim._runtime import close_soon

    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2)
    loss_of(a, batch(0)).backward()
    opt.step()
    opt.zero_grad()
    rt = opt._runtime
    ran = []

    class OnTheWorker:  # a job the worker runs on its own thread, as it runs an unscale
        def run(self, stepper):
            ran.append(threading.current_thread() is rt.worker._thread)
            close_soon(rt)

    rt.worker._queue.put(("unscale", OnTheWorker()))
    wait_until(lambda: rt.closed and not rt.worker._thread.is_alive())
    assert ran == [True] and not rt.stepper.errors
    loss_of(a, batch(1)).backward()  # a plain model again: its hooks are gone
    assert all(type(p.grad) is torch.Tensor for p in a.parameters())


class _Boom(torch.autograd.Function):
    """Raises in backward when ``fire`` is set (an OOM, a NaN check in a hook)."""

    fire = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _Boom.fire:
            raise RuntimeError("boom")
        return g


@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulating", "plain"])
def test_a_backward_that_raised_leaves_the_next_one_checked(accumulate):
    """Note: [Refused before a backward accumulates]: each backward is told apart by its
    autograd graph task, so one that raised after the check (found by a review: the check
    was then off for good) does not let the next converted one accumulate."""
    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.Adagrad, lr=0.1,
                                offload_fraction=0.25)  # fmt: skip

    def loss(x):
        h = _Boom.apply(a[0](x))
        return a[4](a[3](a[2](a[1](h)))).float().square().mean()

    _Boom.fire = True
    try:
        acc = opt.accumulating() if accumulate else contextlib.nullcontext()
        with acc, pytest.raises(RuntimeError, match="boom"):
            loss(batch(0)).backward()
    finally:
        _Boom.fire = False
    opt.zero_grad()
    a.to(torch.float64)
    with pytest.raises(RuntimeError, match="after converting the model"):
        loss(batch(1, torch.float64)).backward()
    assert all(p.grad is None for p in a.parameters())
    opt.remove()


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "step_ahead"])
@pytest.mark.parametrize("clip", ["no clip", "clip"])
def test_a_class_that_writes_its_gradients_is_exact_or_refused(clip, ahead):
    """Note: [A class that writes its gradients]: the norms are taken before the class
    writes the gradients (found by a review: they raced with the step taken during
    backward); a step taken during backward that must be taken again is refused, by step()
    also with step_ahead (it came out of a later call); with overlap=False every step is the
    plain loop's."""
    for overlap in (True, False):
        a = model()
        twin = copy.deepcopy(a)
        ref = SGDWritesGrad(twin.parameters())
        loss_of(twin, batch(0)).backward()
        norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e9)
        max_norm = float(norm) * (0.5 if clip == "clip" else 1.001)
        opt = to.OffloadedOptimizer(a.parameters(), SGDWritesGrad, max_grad_norm=max_norm,
                                    overlap=overlap, bucket_bytes=1024, step_ahead=ahead,
                                    model=a)  # fmt: skip
        loss_of(a, batch(0)).backward()
        for b in opt._runtime.buckets if overlap else ():  # each stepped during backward
            assert b.handled.wait(10)
        if overlap and clip == "clip":  # taken during backward, must be taken again
            with pytest.raises(RuntimeError, match="wrote the gradients of bucket .* nothing"):
                opt.step()
            assert same_params(a, twin)  # a refusal: nothing was stepped
            assert all(not st for b in opt._runtime.buckets for st in b.optimizer.state.values())
            opt.remove()
            continue
        torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
        ref.step()
        opt.step()
        assert torch.equal(opt.grad_norm, norm)
        assert same_params(a, twin)
        assert opt._runtime.stepper.grads_written == overlap
        assert not opt._runtime.stepper.steps_early()  # from now on (or never: at-step)
        opt.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("second", ["whole model", "first layer", "autograd.grad"])
def test_a_second_backward_after_the_class_wrote_its_gradients_is_refused_before_it_accumulates(
    dtype, second
):
    """Note: [Written gradients brought back]: a second backward that brings back moved
    gradients, after a step taken during backward wrote the gradients of its bucket, is
    refused at its first hook, before anything accumulates (found by a review: refused by
    the recall of that bucket, mid-backward, after other buckets were brought back and
    accumulated into, and step() then stepped the written gradients), also where it does not
    reach the written ones (which those are is a matter of timing); step() then steps the
    first backward's gradients, as torch.optim does without the refused backward.
    torch.autograd.grad brings nothing back (it was refused the same way)."""
    # Written: the first layer's (reached last), or the last layer's (not reached at all)
    decayed = {4, 5} if second == "first layer" else {0, 1}

    def groups(params):
        params = list(params)
        return [{"params": [p for i, p in enumerate(params) if i in decayed]},
                {"params": [p for i, p in enumerate(params) if i not in decayed],
                 "weight_decay": 0.0}]  # fmt: skip

    a = model(dtype)
    twin = copy.deepcopy(a)
    ref = Reference(twin, SGDWritesGrad, groups=groups)
    opt = to.OffloadedOptimizer(groups(a.parameters()), SGDWritesGrad, bucket_bytes=1024)
    rt = opt._runtime
    ref.backward(batch(0, dtype))
    loss_of(a, batch(0, dtype)).backward()
    for b in rt.buckets:  # each taken; those of the decayed parameters stepped and written
        assert b.handled.wait(10)
    written = [b for b in rt.buckets if b.grads_written]
    ids = {id(p) for i, p in enumerate(a.parameters()) if i in decayed}
    assert written and any(id(r.param) in ids for r in written[0].records)
    before = [p.detach().clone() for p in a.parameters()]
    moved = [p.grad for p in a.parameters()]
    x = batch(1, dtype)
    if second == "autograd.grad":  # returns its gradients, accumulates nothing
        got = torch.autograd.grad(loss_of(a, x), list(a.parameters()))
        want = torch.autograd.grad(loss_of(twin, x), list(twin.parameters()))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    else:
        with pytest.raises(RuntimeError, match="wrote the gradients of bucket .* this backward"):
            if second == "whole model":
                loss_of(a, x).backward()
            else:
                a[0](x).float().square().mean().backward()
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before, strict=True))
    assert all(p.grad is g for p, g in zip(a.parameters(), moved, strict=True))
    assert rt.recalls.recalled == 0 and all(b.pending for b in written)
    opt.step()
    ref.step()
    assert same_params(a, twin)
    opt.zero_grad()
    for m in (a, twin):  # and on: nothing is stepped during backward from now on
        loss_of(m, batch(2, dtype)).backward()
    opt.step()
    ref.step()
    assert same_params(a, twin) and not rt.stepper.steps_early()
    opt.remove()


@pytest.mark.parametrize("then", ["backward", "step_ahead"])
def test_the_step_the_worker_is_taking_is_waited_for_before_a_refusal(then):
    """Notes: [Written gradients brought back], [A class that writes its gradients]: the
    worker is held inside the class's step of the first bucket it took when a second
    backward starts, or step() with step_ahead and clipping is called; the check waits for
    that step (which writes its gradients) and refuses then, not later; the buckets the
    worker had not taken are not stepped during backward from then on."""
    from torchoffload import testing

    a = model()
    twin = copy.deepcopy(a)
    ref = Reference(twin, SGDWritesGrad, max_grad_norm=1e-3)
    opt = to.OffloadedOptimizer(a.parameters(), SGDWritesGrad, bucket_bytes=1024,
                                max_grad_norm=1e-3, step_ahead=True, model=a)  # fmt: skip
    rt = opt._runtime
    with testing.held_host_step(opt) as hooks:
        loss_of(a, batch(0)).backward()
        wait_until(lambda: any(b.steps for b in rt.buckets))  # held in the class's step
        first = next(b for b in rt.buckets if b.steps)
        assert not first.handled.is_set() and not rt.stepper.grads_written
        if then == "backward":
            with pytest.raises(RuntimeError, match="this backward would accumulate"):
                loss_of(a, batch(1)).backward()
            assert rt.recalls.recalled == 0 and first.pending and first.grads_written
            others = [b for b in rt.buckets if b is not first]
            assert all(b.held or b.taken for b in others)  # held or waited for
        else:
            with pytest.raises(RuntimeError, match="nothing was stepped"):
                opt.step()
            assert not rt.ahead.running
        assert hooks.waits > 0
    for b in rt.buckets:
        assert not b.dispatched or b.handled.wait(10)
    assert sum(b.grads_written for b in rt.buckets) <= 1  # none stepped during backward after
    assert same_params(a, twin)  # nothing stepped
    opt.zero_grad()
    for m in (a, twin):  # and on: nothing is stepped during backward
        loss_of(m, batch(2)).backward()
    opt.step()
    ref.step()
    assert same_params(a, twin)
    opt.remove()


@pytest.mark.parametrize("op", ["norm", "clip_grad_norm_", "unscale", "to"])
def test_what_would_bring_back_gradients_the_class_wrote_is_refused_before_anything_changes(op):
    """Note: [Written gradients brought back]: an operation on a moved gradient and a
    GradScaler unscale are refused before the written gradients come back or their step is
    undone (found by the differential fuzzer: the recall undid the step, and step() then
    stepped the written gradients); model.to() turns them into placeholders that refuse
    reads, and converted back, the step is torch.optim's."""
    a = model()
    twin = copy.deepcopy(a)
    ref = Reference(twin, SGDWritesGrad)
    opt = to.OffloadedOptimizer(a.parameters(), SGDWritesGrad, bucket_bytes=1024)
    rt = opt._runtime
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # the same gradients
    ref.backward(batch(0))
    scaler.scale(loss_of(a, batch(0))).backward()
    for b in rt.buckets:  # each taken, the first stepped and written
        assert b.handled.wait(10)
    written = [b for b in rt.buckets if b.grads_written]
    w = next(r.param for r in written[0].records)
    moved = [p.grad for p in a.parameters()]
    if op == "to":
        a.double()
        assert type(w.grad) is to.optim.MovedGrad and w.grad.dtype == torch.float64
        with pytest.raises(MovedGradError, match="this operation reads them"):
            w.grad.sum()
        with pytest.raises(RuntimeError, match="after converting the model"):
            loss_of(a, batch(1, torch.float64)).backward()
        with pytest.raises(RuntimeError, match="after converting the model"):
            opt.step()  # its bucket was sent, its parameter converted since
        a.float()
    else:
        with pytest.raises(MovedGradError, match="GradScaler" if op == "unscale" else "reads"):
            if op == "norm":
                w.grad.norm()
            elif op == "clip_grad_norm_":
                torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
            else:
                scaler.unscale_(opt)
        # clip_grad_norm_ reads them one by one on the CPU: those read before came back
        # (the same values), the written one did not
        kept = [p.grad is g for p, g in zip(a.parameters(), moved, strict=True)]
        assert kept[[p is w for p in a.parameters()].index(True)]
        assert all(kept) or op == "clip_grad_norm_"
    assert all(b.pending for b in written)  # its step not undone
    opt.step()
    ref.step()
    assert same_params(a, twin)
    opt.remove()


def test_a_write_through_data_after_state_dict_is_kept_by_an_undo():
    """Note: [Copies aside made ahead]: `state_dict()` hands out the live state, and a
    write through ``.data`` moves no version counter: taking the state dict drops the copies
    made ahead (found by a review: an undo restored the value from before the write)."""
    a = model()
    twin = copy.deepcopy(a)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2,
                                bucket_bytes=1024)  # fmt: skip
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    rt = opt._runtime
    for m, o in ((a, opt), (twin, ref)):
        loss_of(m, batch(0)).backward()
        for b in rt.buckets if o is opt else ():  # each stepped during backward: each is
            assert b.handled.wait(10)  # copied ahead after
        o.step()
        o.zero_grad()
    wait_until(lambda: all(b.undo.prepared for b in rt.buckets))
    for o in (opt, ref):
        for state in o.state_dict()["state"].values():
            state["exp_avg_sq"].data.zero_()
    loss_of(a, batch(1)).backward()
    for b in rt.buckets:
        assert b.handled.wait(10)
    assert rt.stepper.speculated > 0
    opt.zero_grad()  # undoes the steps taken during that backward
    loss_of(twin, batch(1)).backward()
    ref.zero_grad()
    for m, o in ((a, opt), (twin, ref)):
        loss_of(m, batch(2)).backward()
        o.step()
        o.zero_grad()
    assert same_params(a, twin)
    opt.remove()


def test_a_host_step_of_one_thread_on_a_host_of_several_cores_is_warned():
    """Note: [Host threads]: torchrun sets OMP_NUM_THREADS=1 in each of several processes, and
    the host step then runs on one thread (2567 ms against 634 with 16 threads a rank, two
    H200s); the warning names host_threads. Not warned when host_threads is given."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("a host of one core")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.warns(UserWarning, match=r"1 intra-op thread .* host_threads="):
            to.OffloadedOptimizer(model().parameters(), torch.optim.SGD, lr=0.1).remove()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = to.OffloadedOptimizer(model().parameters(), torch.optim.SGD, lr=0.1,
                                        host_threads=1)  # fmt: skip
            opt.remove()
    finally:
        torch.set_num_threads(threads)
    if threads > 1:  # and not with the process's own threads
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            to.OffloadedOptimizer(model().parameters(), torch.optim.SGD, lr=0.1).remove()


def adamw_in_mode(dtype, mode):
    """A model, its `Reference` (AdamW) and an `OffloadedOptimizer` of it in one of the modes
    "overlap", "at-step", "clip" (``max_grad_norm`` 0.05) or "ahead" (``step_ahead``)."""
    a = model(dtype)
    cls, kw = OPTIMIZERS["adamw"]
    clip = 0.05 if mode == "clip" else None
    ref = Reference(copy.deepcopy(a), cls, max_grad_norm=clip, **kw)
    extra = {"overlap": {}, "at-step": dict(overlap=False), "clip": dict(max_grad_norm=clip),
             "ahead": dict(step_ahead=True, model=a)}[mode]  # fmt: skip
    return a, ref, to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=1024, **extra, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["overlap", "at-step", "ahead", "clip"])
def test_a_parameter_written_after_its_gradient_left_is_stepped_from_the_written_value(dtype, mode):
    """Note: [Written after its gradient left]: a parameter written in place between the
    backward that sent its gradient to the host and `step()` is stepped from the value
    written, as torch.optim steps it (found by a helper: the write was lost in every mode,
    the step taken from the master read at the dispatch; up to 0.22 off with SGD at lr 0.1).
    The master follows the parameter as after any write outside the optimizer: it is read
    again from it (the reference does the same with its fp32 copy)."""
    a, ref, opt = adamw_in_mode(dtype, mode)
    twin = ref.twin
    n = len(list(a.parameters()))
    for i in range(4):
        x = batch(i, dtype)
        loss_of(a, x).backward()
        ref.backward(x)
        for b in opt._runtime.buckets:  # each bucket's gradients left (and, with the
            assert b.handled.wait(10)  # overlap, it was stepped) before the write
        k = (3 * i) % n
        with torch.no_grad():
            for m in (a, twin):
                list(m.parameters())[k].mul_(0.5).add_(0.25)
            ref.masters[k].copy_(list(twin.parameters())[k].float())
        opt.step()
        opt.zero_grad()
        ref.step()
        opt.synchronize()
        assert same_params(a, twin), i
    assert same_state(opt, ref)
    opt.remove()


def test_a_write_after_a_step_that_wrote_its_gradients_is_refused_before_anything_changes():
    """Note: [Written after its gradient left]: taking the step again from the written value
    needs the gradients as backward produced them, which the class overwrote: `step()` is
    refused, nothing changes, and `zero_grad()` goes on from there."""
    a = model()
    twin = copy.deepcopy(a)
    ref = Reference(twin, SGDWritesGrad, lr=0.1)
    opt = to.OffloadedOptimizer(a.parameters(), SGDWritesGrad, lr=0.1, bucket_bytes=1024)
    loss_of(a, batch(0)).backward()  # each bucket stepped during backward, its gradients written
    for b in opt._runtime.buckets:
        assert b.handled.wait(10)
    written = [b for b in opt._runtime.buckets if b.grads_written]  # the first stepped
    assert written
    k = written[0].records[0].entry.index
    with torch.no_grad():
        list(a.parameters())[k].mul_(0.5)
        list(twin.parameters())[k].mul_(0.5)
        ref.masters[k].copy_(list(twin.parameters())[k])
    before = copy.deepcopy(a)
    with pytest.raises(RuntimeError, match="written in place since its gradient left"):
        opt.step()
    assert same_params(a, before)
    opt.zero_grad()  # undoes what was stepped during backward; torch.optim: nothing stepped
    twin.zero_grad()
    for i in (1, 2):  # the masters follow the written value at the next backward's dispatch
        loss_of(a, batch(i)).backward()
        ref.backward(batch(i))
        opt.step()
        opt.zero_grad()
        ref.step()
    opt.synchronize()
    assert same_params(a, twin)
    opt.remove()


def test_a_refused_step_leaves_the_device_part_unstepped():
    """Note: [A class that writes its gradients]: with ``offload_fraction`` < 1 a `step()`
    that the host part refuses (a step taken during backward wrote its gradients and the
    learning rate changed since) is refused before the device part steps: found by the
    differential fuzzer once it could call `step()` right after a plain backward (the device
    part had stepped, 0.0038 off)."""
    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), SGDWritesGrad, lr=0.1, bucket_bytes=1024,
                                offload_fraction=0.5)  # fmt: skip
    loss_of(a, batch(0)).backward()
    for b in opt._runtime.buckets:
        assert b.handled.wait(10)
    assert opt._runtime.stepper.grads_written
    for group in opt.param_groups:
        group["lr"] = 0.05  # the step taken during backward must be taken again
    before = copy.deepcopy(a)
    with pytest.raises(RuntimeError, match="wrote the gradients"):
        opt.step()
    assert same_params(a, before)
    opt.zero_grad()
    opt.remove()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
def test_a_write_of_zero_over_minus_zero_after_backward_is_stepped(overlap):
    """Note: [Written after its gradient left]: whether a written parameter changed is told
    by its bits (a review found -0.0 taken for 0.0 by a comparison of values, and the old -0.0
    stepped)."""
    p = nn.Parameter(torch.tensor([-0.0, 1.0, 2.0, -3.0]))
    master = p.detach().clone().requires_grad_()
    ref = torch.optim.SGD([master], lr=0.1)
    opt = to.OffloadedOptimizer([p], torch.optim.SGD, lr=0.1, overlap=overlap)
    (p * torch.tensor([0.0, 1.0, 1.0, 1.0])).sum().backward()  # element 0's gradient: +0.0
    for b in opt._runtime.buckets:
        assert b.handled.wait(10)
    with torch.no_grad():
        p.add_(0.0)  # -0.0 becomes +0.0
        master.copy_(p)
    master.grad = torch.tensor([0.0, 1.0, 1.0, 1.0])
    opt.step()
    ref.step()
    opt.synchronize()
    assert torch.equal(p.detach().view(torch.int32), master.detach().view(torch.int32))
    opt.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["overlap", "at-step", "ahead", "clip"])
@pytest.mark.parametrize("action", ["drop", "replace"])
def test_a_gradient_dropped_or_replaced_after_it_left_is_stepped_as_set(dtype, mode, action):
    """Note: [A gradient set after it left]: ``p.grad = None`` (or another tensor) between
    the final backward and `step()`, without reading the moved gradient, is what torch.optim
    steps: no step (not even weight decay) for a dropped one, the new tensor for a replaced
    one (found by a helper: the moved gradients were stepped, 0.003 off after one AdamW step;
    a loop dropping every gradient to skip a step had every parameter stepped)."""
    a, ref, opt = adamw_in_mode(dtype, mode)
    twin = ref.twin
    n = len(list(a.parameters()))
    for i in range(4):
        x = batch(i, dtype)
        loss_of(a, x).backward()
        ref.backward(x)
        for b in opt._runtime.buckets:  # each bucket's gradients left (and, with the
            assert b.handled.wait(10)  # overlap, it was stepped) before the gradient is set
        # one parameter in some steps, every one in the last (a loop skipping a step)
        chosen = range(n) if i == 3 else [(3 * i) % n, (3 * i + 1) % n]
        for k in chosen:
            for m in (a, twin):
                p = list(m.parameters())[k]
                p.grad = None if action == "drop" else torch.full_like(p, 0.01 * (i + 1))
        opt.step()
        opt.zero_grad()
        ref.step()
        opt.synchronize()
        assert same_params(a, twin), i
    assert same_state(opt, ref)
    opt.remove()


def test_a_gradient_set_after_a_step_that_wrote_its_gradients_is_refused():
    """Note: [A gradient set after it left]: stepping the bucket again without the dropped
    gradient needs the others as backward produced them, which the class overwrote: `step()`
    is refused before anything changes, and `zero_grad()` goes on from there."""
    a = model()
    twin = copy.deepcopy(a)
    ref = Reference(twin, SGDWritesGrad, lr=0.1)
    opt = to.OffloadedOptimizer(a.parameters(), SGDWritesGrad, lr=0.1, bucket_bytes=1 << 20)
    loss_of(a, batch(0)).backward()  # one bucket, stepped during backward: gradients written
    for b in opt._runtime.buckets:
        assert b.handled.wait(10)
    assert [b.grads_written for b in opt._runtime.buckets] == [True]
    list(a.parameters())[0].grad = None
    before = copy.deepcopy(a)
    with pytest.raises(RuntimeError, match=r"dropped or replaced \(param.grad set\)"):
        opt.step()
    assert same_params(a, before)
    opt.zero_grad()
    twin.zero_grad()
    for i in (1, 2):  # nothing is stepped during backward any more: served from here
        loss_of(a, batch(i)).backward()
        ref.backward(batch(i))
        for m in (a, twin):
            list(m.parameters())[0].grad = None
        opt.step()
        opt.zero_grad()
        ref.step()
    opt.synchronize()
    assert same_params(a, twin)
    opt.remove()


def test_a_gradient_set_beside_a_streamed_one_that_left_is_refused():
    """Note: [A gradient set after it left]: a streamed parameter's gradient cannot come back
    to the device, so a bucket that holds one and a gradient dropped since it left cannot be
    stepped again: `step()` is refused before anything changes, `zero_grad()` goes on; a
    bucket whose every gradient was dropped needs nothing back and is not stepped."""
    from torchoffload.models import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(hidden=32, layers=2, heads=4, vocab=64, max_seq=16))
    twin = copy.deepcopy(m)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    handle = to.stream_parameters(m, 10 << 20, unit="blocks", device="cpu")
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=1 << 20)
    m.loss(x).backward()
    for b in opt._runtime.buckets:
        assert b.handled.wait(10)
    bucket = next(b for b in opt._runtime.buckets if len(b.records) > 1)
    bucket.records[0].param.grad = None
    with pytest.raises(RuntimeError, match=r"streamed by stream_parameters: .*Nothing was"):
        opt.step()
    opt.zero_grad()
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    dropped = {r.entry.index for r in bucket.records}  # all of the bucket's: stepped as set
    for _ in range(2):
        for model_, step in ((m, opt), (twin, ref)):
            model_.loss(x).backward()
            for k, p in enumerate(model_.parameters()):
                if k in dropped:
                    p.grad = None
            step.step()
            step.zero_grad()
    opt.remove()
    handle.remove()
    assert same_params(m, twin)


@pytest.mark.parametrize("mode", ["overlap", "at-step", "clip"])
def test_a_step_skipped_with_the_models_zero_grad_steps_the_next_backwards_gradients(mode):
    """Note: [A gradient set after it left]: a loop that skips a step with
    ``model.zero_grad()`` (which sets every ``.grad`` to None behind the optimizer's back)
    and runs the next backward: torch.optim steps that backward's gradients only (the
    buckets, sent in the skipped backward, were stepped with the old ones: 0.005 off)."""
    a = model()
    twin = copy.deepcopy(a)
    cls, kw = OPTIMIZERS["adamw"]
    clip = 0.05 if mode == "clip" else None
    ref = Reference(twin, cls, max_grad_norm=clip, **kw)
    extra = {"overlap": {}, "at-step": dict(overlap=False),
             "clip": dict(max_grad_norm=clip)}[mode]  # fmt: skip
    opt = to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=1024, **extra, **kw)
    for i in range(4):
        loss_of(a, batch(i)).backward()
        ref.backward(batch(i))
        if i % 2 == 0:  # skipped, once each bucket sent was stepped (with the overlap)
            for b in opt._runtime.buckets:
                assert not b.dispatched or b.handled.wait(10)
            a.zero_grad()
            twin.zero_grad()
            continue
        opt.step()
        a.zero_grad()
        ref.step()
        assert same_params(a, twin), i
    opt.remove()


@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["host", "split"])
def test_state_is_a_read_only_view_of_the_host_state(fraction):
    """``opt.state`` was an empty dict that the host never read: a loop resetting the state
    (``opt.state.clear()``) was silently ignored (0.010 off two steps later), logging a moment
    raised KeyError, and `torch.distributed.checkpoint`'s ``get_optimizer_state_dict``, which
    takes an empty ``state`` for an optimizer never stepped, stepped it once more with zero
    gradients (AdamW's step count and moments moved: 0.0034 off). Now it holds what the plain
    class's holds, read-only; a reset goes through `load_state_dict()`."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    a = model()
    twin = copy.deepcopy(a)
    cls, kw = OPTIMIZERS["adamw"]
    ref = torch.optim.AdamW(twin.parameters(), **kw)
    opt = to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=1024,
                                offload_fraction=fraction, **kw)  # fmt: skip
    assert not opt.state and len(opt.state) == 0
    first = next(a.parameters())
    assert dict(opt.state[first]) == {}  # as torch.optim's defaultdict
    for i in range(4):
        for m, o in ((a, opt), (twin, ref)):
            loss_of(m, batch(i)).backward()
            if i == 1 and o is opt:
                with pytest.raises(RuntimeError, match="between the final backward and step"):
                    len(o.state)
            o.step()
            o.zero_grad()
            _init_optim_state(o)  # what get_optimizer_state_dict runs first: nothing here
        assert len(opt.state) == len(ref.state) == len(list(a.parameters()))
        for p, q in zip(a.parameters(), twin.parameters(), strict=True):
            assert opt.state[p].keys() == ref.state[q].keys()
            for k, v in ref.state[q].items():
                assert torch.equal(opt.state[p][k].cpu(), v), (i, k)
        if i == 1:  # a reset: refused on the view, done by load_state_dict
            for what in (lambda: opt.state.clear(), lambda: setattr(opt, "state", {}),
                         lambda: opt.state.__setitem__(first, {})):  # fmt: skip
                with pytest.raises(RuntimeError, match="read-only view"):
                    what()
            with pytest.raises(TypeError):
                opt.state[first]["step"] = 0
            ref.state.clear()
            sd = opt.state_dict()
            sd["state"] = {}
            opt.load_state_dict(sd)
            assert len(opt.state) == 0
    opt.synchronize()
    assert same_params(a, twin)
    opt.remove()


@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["host", "split"])
def test_state_lookups_read_the_state_as_it_is_now(fraction):
    """``opt.state[p]`` after a step, a load_state_dict or a reset, through the same view
    object too: the state of that moment, as torch.optim's ``state`` holds it."""
    a = model()
    twin = copy.deepcopy(a)
    cls, kw = OPTIMIZERS["adamw"]
    ref = torch.optim.AdamW(twin.parameters(), **kw)
    opt = to.OffloadedOptimizer(a.parameters(), cls, bucket_bytes=1024,
                                offload_fraction=fraction, **kw)  # fmt: skip
    view = opt.state
    params, twins = list(a.parameters()), list(twin.parameters())

    def check():
        for p, q in zip(params, twins, strict=True):
            for got in (opt.state[p], view[p]):
                assert got.keys() == ref.state[q].keys()
                for k, v in ref.state[q].items():
                    assert torch.equal(got[k].cpu(), v), k

    check()  # nothing yet
    saved = []
    for i in range(3):
        for m, o in ((a, opt), (twin, ref)):
            loss_of(m, batch(i)).backward()
            o.step()
            o.zero_grad()
        check()
        saved.append((opt.state_dict(), ref.state_dict()))
    opt.load_state_dict(copy.deepcopy(saved[0][0]))
    ref.load_state_dict(copy.deepcopy(saved[0][1]))
    check()
    sd = opt.state_dict()
    sd["state"] = {}
    opt.load_state_dict(sd)
    ref.state.clear()
    check()
    assert all(dict(view[p]) == {} for p in params)
    opt.remove()


@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["host", "split"])
def test_a_state_lookup_does_not_rebuild_the_whole_state(fraction, monkeypatch):
    """``opt.state[p]`` built the mapping of every parameter's state on each lookup: a loop
    over the parameters reading their state was quadratic."""
    from torchoffload.optim._optimizer import HostStateView

    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, bucket_bytes=1024,
                                offload_fraction=fraction, lr=1e-3)  # fmt: skip
    loss_of(a, batch(0)).backward()
    opt.step()
    built = []
    whole = HostStateView._entries
    monkeypatch.setattr(HostStateView, "_entries", lambda self: built.append(1) or whole(self))
    params = list(a.parameters())
    for _ in range(3):
        for p in params:
            assert opt.state[p]["step"] == 1
    assert len(built) <= 1, len(built)
    opt.remove()


def test_state_dict_hooks_run_as_with_the_plain_class():
    """register_state_dict_pre/post_hook and register_load_state_dict_pre/post_hook: the
    plain class runs them around its state_dict()/load_state_dict(); ours overrode both and
    silently skipped them (a post-hook's added key was missing, a load pre-hook's edit of
    the groups was not loaded)."""
    a = model()
    twin = copy.deepcopy(a)
    opts = [to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2),
            torch.optim.AdamW(twin.parameters(), lr=1e-2)]  # fmt: skip
    calls = {id(o): [] for o in opts}
    for o in opts:
        seen = calls[id(o)]
        o.register_state_dict_pre_hook(lambda o: calls[id(o)].append("pre"))
        o.register_state_dict_post_hook(lambda o, sd: {**sd, "epoch": 7})
        o.register_load_state_dict_pre_hook(
            lambda o, sd: {**sd, "param_groups": [{**g, "lr": 0.5} for g in sd["param_groups"]]}
        )
        o.register_load_state_dict_post_hook(lambda o: calls[id(o)].append("loaded"))
        sd = o.state_dict()
        assert sd["epoch"] == 7
        o.load_state_dict(sd)
        assert o.param_groups[0]["lr"] == 0.5
        assert seen == ["pre", "loaded"]
    opts[0].remove()


def _edit_groups(opt, edit, extra):
    """Edit ``opt.param_groups``' parameters as a loop might (``extra``: a parameter it
    was not built with)."""
    groups = opt.param_groups
    if edit == "drop":
        groups[0]["params"].pop(0)
    elif edit == "append":
        groups[0]["params"].append(extra)
    elif edit == "swap":
        groups[0]["params"], groups[1]["params"] = groups[1]["params"], groups[0]["params"]
    elif edit == "new group":
        groups.append({**{k: v for k, v in groups[0].items() if k != "params"},
                       "params": [extra]})  # fmt: skip
    else:
        del groups[1]


EDITS = ["drop", "append", "swap", "new group", "delete group"]


def _two_groups(cls=torch.optim.AdamW, step_ahead=False, **kw):
    """A model, the plain class's `Reference` on its twin and an OffloadedOptimizer of ``cls``
    (``kw``: its options; ``step_ahead`` with the model), both over two param groups (the first
    with its own lr); a parameter neither was built with; the groups as built, to put back."""
    a = model()
    if step_ahead:
        kw.update(step_ahead=True, model=a)

    def groups(ps):
        return [{"params": ps[:3], "lr": 0.05}, {"params": ps[3:]}]

    ref = Reference(copy.deepcopy(a), torch.optim.AdamW, lr=1e-2, groups=groups)
    opt = to.OffloadedOptimizer(groups(list(a.parameters())), cls, lr=1e-2, bucket_bytes=2048,
                                **kw)  # fmt: skip
    saved = [dict(g, params=list(g["params"])) for g in opt.param_groups]
    return a, ref, opt, nn.Parameter(torch.ones(3)), saved


def _refused_then_put_back(opt, a, saved):
    """step() and zero_grad() refused with the groups edited, nothing changed; then the groups
    as built put back."""
    before = copy.deepcopy(a)
    for call in (opt.step, opt.zero_grad):
        with pytest.raises(RuntimeError, match="The param groups the host steps"):
            call()
    assert same_params(a, before)
    opt.param_groups[:] = [dict(g, params=list(g["params"])) for g in saved]


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
def test_param_groups_edited_after_the_build_are_refused_before_anything_changes(edit, overlap):
    """torch.optim steps the parameters its param_groups hold at each step; the host steps
    those it was built with. Edited groups were silently stepped as built (a dropped
    parameter stepped on, an appended one never stepped, swapped groups each stepped with
    the other's lr): refused at step(), zero_grad(), state_dict() and at the next backward,
    before anything changes; put back, the loop goes on bitwise the plain class."""
    a, ref, opt, extra, saved = _two_groups(overlap=overlap)
    loss_of(a, batch(0)).backward()
    ref.backward(batch(0))
    _edit_groups(opt, edit, extra)
    _refused_then_put_back(opt, a, saved)
    opt.step()
    opt.zero_grad()
    ref.step()
    assert same_params(a, ref.twin)
    sd = opt.state_dict()
    _edit_groups(opt, edit, extra)  # before a backward: refused before it accumulates
    for call in (opt.state_dict, lambda: opt.load_state_dict(sd),
                 lambda: loss_of(a, batch(1)).backward()):  # fmt: skip
        with pytest.raises(RuntimeError, match="The param groups the host steps"):
            call()
    assert all(p.grad is None for p in a.parameters())
    opt.remove()


@pytest.mark.parametrize("ahead", [False, True], ids=["", "step-ahead"])
@pytest.mark.parametrize("edit", EDITS)
def test_param_groups_edited_during_backward_are_refused_at_step_then_stepped_bitwise(edit, ahead):
    """A loop may edit ``param_groups`` while the host steps buckets during backward (here a
    hook on the last layer's input edits them after that layer's buckets may have stepped):
    a bucket stepped after the edit read the groups as edited (a deleted group failed it
    with an IndexError raised at the next step, seen as a flaky CI failure). It is stepped
    at step() instead: refused there while the edit stands; put back, bitwise the plain
    class. With ``step_ahead``, the next forward waits for those buckets' uploads (a bucket
    marked done when it was skipped let the forward read its old values)."""

    class Slow(torch.optim.AdamW):  # the host's step outlasts the forward after step()
        def step(self, closure=None):
            time.sleep(0.05)
            return super().step(closure)

    a, ref, opt, extra, saved = _two_groups(Slow, overlap=True, step_ahead=ahead)
    edited = []

    def edit_in_backward(module, args):
        args[0].register_hook(lambda g: edited.append(_edit_groups(opt, edit, extra)))

    handle = a[4].register_forward_pre_hook(edit_in_backward)
    loss_of(a, batch(0)).backward()
    handle.remove()
    assert len(edited) == 1
    buckets = opt._runtime.buckets  # the worker takes each while the edit stands
    deadline = time.monotonic() + 30
    while not all(b.handled.is_set() for b in buckets):
        assert time.monotonic() < deadline, "the worker did not take every bucket"
        time.sleep(0.001)
    ref.backward(batch(0))
    _refused_then_put_back(opt, a, saved)
    opt.step()
    if ahead:  # the forward right after step() reads every parameter as stepped
        with torch.no_grad():
            out = a(batch(1))
    opt.zero_grad()
    ref.step()
    if ahead:
        with torch.no_grad():
            assert torch.equal(out, ref.twin(batch(1)))
    assert same_params(a, ref.twin)
    opt.remove()


def test_param_groups_assigned_a_new_list_are_the_ones_stepped_with():
    """``opt.param_groups = [...]`` (the same parameters, another lr): the runtime read the
    list it was built with, so the new lr was silently not used (off after one step)."""
    a = model()
    twin = copy.deepcopy(a)
    ref = Reference(twin, torch.optim.AdamW, lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048)
    for i in range(3):
        if i == 1:
            for o in (opt, ref.opt):
                o.param_groups = [{**g, "lr": 0.3} for g in o.param_groups]
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
        ref.backward(batch(i))
        ref.step()
        assert same_params(a, ref.twin), i
    assert opt.param_groups[0]["lr"] == 0.3
    opt.remove()


@pytest.mark.parametrize("when", ["before step", "stepping ahead"])
def test_a_tensor_in_betas_changed_in_place_is_snapshotted_not_aliased(when):
    """Tensor betas (torch.optim takes them; an in-place fill_ changes them without a
    recompile) were copied by reference into the hyperparameters a bucket was stepped with:
    beta1 filled between backward and step() went unseen, so the steps taken during backward
    with the old beta1 were committed (off after one step), and filled after a step() still
    running ahead, it reached the buckets not yet stepped."""
    ahead = when == "stepping ahead"
    a, twin = Tied(), Tied()
    kw = dict(lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    ref = Reference(twin, torch.optim.AdamW, **copy.deepcopy(kw))
    opt = to.OffloadedOptimizer(a.parameters(), SlowAdamW if ahead else torch.optim.AdamW,
                                bucket_bytes=2048, step_ahead=ahead, model=a,
                                **copy.deepcopy(kw))  # fmt: skip
    for i in range(3):
        a(tied_batch(i)).float().square().mean().backward()
        twin(tied_batch(i)).float().square().mean().backward()
        for o in (opt, ref.opt):
            o.param_groups[0]["betas"][0].fill_(0.5 + 0.1 * i)
        opt.step()
        opt.zero_grad()
        ref.step()
        if ahead:  # while the host still steps
            for o in (opt, ref.opt):
                o.param_groups[0]["betas"][0].fill_(0.55 + 0.1 * i)
    opt.synchronize()
    assert same_params(a, twin)
    opt.remove()


@pytest.mark.parametrize(
    "overlap,fraction",
    [(True, 1.0), (False, 1.0), (True, 0.5)],
    ids=["overlap", "at-step", "split"],
)
def test_global_step_hooks_run_once_a_step_on_the_users_optimizer(overlap, fraction):
    """register_optimizer_step_pre_hook/_post_hook: torch.optim runs them around each step()
    of the user's optimizer. They also ran around every internal step of the class (each
    bucket's, on the worker, during backward; the device part's), over host masters: a
    global hook halving the gradients halved them twice (off after one step at-step; with
    overlap, refused as a class that writes its gradients). Note: [The class's step without
    step hooks]."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    seen = []

    def halve(o, args, kwargs):
        seen.append(type(o).__name__)
        for group in o.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)

    a = model()
    twin = copy.deepcopy(a)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    opt = to.OffloadedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=2048,
                                overlap=overlap, offload_fraction=fraction)  # fmt: skip
    handles = [register_optimizer_step_pre_hook(halve),
               register_optimizer_step_post_hook(lambda o, a, k: seen.append("post"))]  # fmt: skip
    try:
        for i in range(2):
            for m, o in ((a, opt), (twin, plain)):
                loss_of(m, batch(i)).backward()
                o.step()
                o.zero_grad()
            assert same_params(a, twin), i
    finally:
        for h in handles:
            h.remove()
        opt.remove()
    assert seen == ["OffloadedOptimizer", "post", "AdamW", "post"] * 2
