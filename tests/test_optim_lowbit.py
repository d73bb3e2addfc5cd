"""Low-precision optimizer state on the CPU: the number formats (8-bit blockwise moments, bf16
stochastic and compensated rounding), `LowPrecisionAdamW`/`AdamW8bit` against a float64
AdamW, their determinism and state dicts, and `OffloadedOptimizer` with them and with
``master_dtype=torch.bfloat16``: bitwise the same class stepping plain host tensors."""

from __future__ import annotations

import copy
import io
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torchoffload as to
from torchoffload._hosted import MANAGED
from torchoffload.optim import (
    AdamW8bit,
    LowPrecisionAdamW,
    OptimizerOffloadConfig,
    host_bytes_per_param,
    link_bytes_per_param,
)
from torchoffload.optim import _lowbit as lowbit

BF16 = torch.bfloat16


# - Number formats


def test_dynamic_map_values():
    for signed in (True, False):
        values = lowbit.dynamic_map(signed)
        assert len(values) == 256 and values == sorted(values) and len(set(values)) == 256
        assert 0.0 in values and values[-1] == 1.0
        negatives = [v for v in values if v < 0]
        assert len(negatives) == (127 if signed else 0)
        positive = [v for v in values if v > 0]
        # smallest: the middle of [0.1, 1] x 1e-6 cut in 1 (signed) or 2 pieces
        assert positive[0] == pytest.approx(0.55e-6 if signed else 0.325e-6)
        # the largest decade has 64 (signed) or 128 steps between 0.1 and 1
        top = [v for v in positive if 0.1 <= v < 1.0]
        assert len(top) == (64 if signed else 128)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_codes_are_the_nearest_map_values(signed):
    g = torch.Generator().manual_seed(0)
    n = 64 * lowbit.BLOCK
    x = torch.randn(n, generator=g) * torch.logspace(-9, 2, n)[torch.randperm(n, generator=g)]
    x[: lowbit.BLOCK] = 0.0  # an all-zero block
    x[lowbit.BLOCK] = 1e30  # an outlier coarsens its own block only
    x = x if signed else x.abs()
    codes = torch.empty(n, dtype=torch.uint8)
    scales = torch.empty(n // lowbit.BLOCK)
    lowbit.quantize_(codes, scales, x, signed)
    blocks = x.view(-1, lowbit.BLOCK)
    assert torch.equal(scales, blocks.abs().amax(1))
    # the oracle: the nearest value by searching the midpoints, over every element
    values = torch.tensor(lowbit.dynamic_map(signed))
    mids = (values[1:] + values[:-1]) / 2
    normalized = (blocks / scales.clamp(min=1e-38)[:, None]).view(-1)
    assert torch.equal(codes, torch.bucketize(normalized, mids).to(torch.uint8))
    back = lowbit.dequantize(codes, scales, signed)
    assert torch.equal(back[: lowbit.BLOCK], torch.zeros(lowbit.BLOCK))
    half_gap = (values[1:] - values[:-1]).max() / 2 + 1e-6  # (-1 maps to the lowest value)
    assert bool(((back - x).abs() <= half_gap * scales.repeat_interleave(256)).all())


def _neighbours(x):
    """The two bf16 values around fp32 ``x``: toward zero and away from it."""
    bits = x.view(torch.int32)
    low = (bits & -65536).view(torch.float32)
    high = ((bits & -65536) + 65536).view(torch.float32)
    return low, high


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    x = torch.randn(n, generator=g)
    low, high = _neighbours(x)
    out = torch.empty(n, dtype=BF16)
    total = torch.zeros(n, dtype=torch.float64)
    draws = 64
    for step in range(draws):
        lowbit.round_stochastic_(out, x, lowbit.round_key(0, step), 0)
        y = out.float()
        assert bool(((y == low) | (y == high)).all())
        total += y.double()
    # the average over draws is x within the statistics of draws coin flips per element:
    # the mean of the signed error over every element is near zero...
    err = (total / draws - x.double()) / (high - low).abs().double()
    assert abs(float(err.mean())) < 1e-3
    # ...and a fraction f goes up with probability f, for every element alike
    frac = torch.full((n,), 1.0 + 0.3 * 2**-7)  # 0.3 of the way to the next bf16
    lowbit.round_stochastic_(out, frac, lowbit.round_key(7, 3), 0)
    assert abs(float((out.float() > 1.0).double().mean()) - 0.3) < 0.003  # 6 sigma
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 2.0])
    out = torch.empty(6, dtype=BF16)
    lowbit.round_stochastic_(out, special, 123, 0)
    assert out[0].isnan() and torch.equal(out[1:], special[1:].to(BF16))


def test_compensated_rounding_keeps_what_rounding_dropped():
    p = torch.ones(1000, dtype=BF16)
    c = torch.zeros(1000, dtype=BF16)
    plain = torch.ones(1000, dtype=BF16)
    for _ in range(1000):  # 1e-4 a step: below half the bf16 step at 1.0 (2**-8)
        x = p.float() + c.float() + 1e-4
        lowbit.round_compensated_(p, c, x)
        plain = (plain.float() + 1e-4).to(BF16)
    assert torch.equal(plain, torch.ones(1000, dtype=BF16))  # round-to-nearest lost them all
    # the pair drops at most half a bf16 step of the compensation (|c| < 2**-8, so 2**-17) a
    # step: within 1000 * 2**-17 of the 0.1 added
    assert float((p.double() + c.double() - 1.1).abs().max()) < 1000 * 2**-17


# - The optimizer classes against torch.optim.AdamW and a float64 AdamW

SHAPES = [(64, 100), (5000,), (300,)]  # 8-bit with a short last block; 8-bit; fp32 moments


def _problem(steps):
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) * 0.02 for s in SHAPES]
    target = [torch.randn(s, generator=g) * 0.02 for s in SHAPES]
    curvature = [torch.rand(s, generator=g) * 10 for s in SHAPES]
    noise = [[torch.randn(s, generator=g) * 0.01 for s in SHAPES] for _ in range(steps)]

    def grad(k, p, t):  # of 0.5 * curvature * (p - target)**2, plus noise
        p = p.double()
        return curvature[k].double() * (p - target[k].double()) + noise[t][k].double()

    return start, grad


def _adamw64(start, grad, steps, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    out = []
    for k, p0 in enumerate(start):
        p, m, v = p0.double().clone(), torch.zeros_like(p0.double()), torch.zeros_like(p0.double())
        for t in range(1, steps + 1):
            g = grad(k, p, t - 1)
            p.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - betas[0])
            v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            denom = (v.sqrt() / math.sqrt(1 - betas[1] ** t)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - betas[0] ** t))
        out.append(p)
    return out


def _train(cls, start, grad, steps, dtype, **kw):
    params = [p.to(dtype).clone().requires_grad_() for p in start]
    opt = cls(params, **kw)
    for t in range(steps):
        for k, p in enumerate(params):
            p.grad = grad(k, p.detach(), t).to(dtype)
        opt.step()
    return params, opt


def test_fp32_moments_on_fp32_parameters_are_torch_adamw_bitwise():
    start, grad = _problem(5)
    mine, opt = _train(LowPrecisionAdamW, start, grad, 5, torch.float32, lr=1e-2,
                       weight_decay=0.1)  # fmt: skip
    theirs, ref = _train(torch.optim.AdamW, start, grad, 5, torch.float32, lr=1e-2,
                         weight_decay=0.1)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    for a, b in zip(mine, theirs, strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][key], ref.state[b][key])


# (state_bits, parameter dtype, bf16_rounding) -> the largest relative distance to the float64
# AdamW, |p - p64| / |p64 - p0| per tensor after 200 steps, at lr 1e-3 and at lr 1e-5 (where a
# bf16 update is about 1/12 of a bf16 step). About twice what was measured (torch 2.13, CPU),
# except "nearest" at 1e-5, which must lose most of the movement.
TOLERANCE = {
    (32, torch.float32, "stochastic"): (1e-3, 1e-3),
    (32, BF16, "stochastic"): (0.012, 0.35),
    (32, BF16, "kahan"): (0.004, 0.05),
    (32, BF16, "nearest"): (0.025, None),
    (8, torch.float32, "stochastic"): (0.04, 0.1),
    (8, BF16, "stochastic"): (0.04, 0.35),
    (8, BF16, "kahan"): (0.04, 0.1),
    (8, BF16, "nearest"): (0.05, None),
}


@pytest.mark.parametrize("lr", [1e-3, 1e-5])
@pytest.mark.parametrize("config", list(TOLERANCE), ids=lambda c: f"{c[0]}bit-{c[1]}-{c[2]}")
def test_against_a_float64_adamw(config, lr):
    bits, dtype, rounding = config
    steps = 200
    start, grad = _problem(steps)
    reference = _adamw64(start, grad, steps, lr)
    params, opt = _train(LowPrecisionAdamW, start, grad, steps, dtype, lr=lr, state_bits=bits,
                         bf16_rounding=rounding)  # fmt: skip
    moved = [float((p.detach().double() - r).norm() / (r - s.double()).norm())
             for p, r, s in zip(params, reference, start, strict=True)]  # fmt: skip
    tolerance = TOLERANCE[config][0 if lr == 1e-3 else 1]
    if tolerance is None:  # round-to-nearest: the small updates are lost
        assert min(moved) > 0.8, moved
    else:
        assert max(moved) < tolerance, moved
    quantized = {k for k, p in enumerate(params) if "exp_avg_codes" in opt.state[p]}
    assert quantized == ({0, 1} if bits == 8 else set())


def _run(seed=0, order=1, steps=3, **kw):
    start, grad = _problem(steps)
    params = [p.to(BF16).clone().requires_grad_() for p in start]
    opt = AdamW8bit(params[::order], lr=1e-4, seed=seed, **kw)
    for t in range(steps):
        for k, p in enumerate(params):
            p.grad = grad(k, p.detach(), t).to(BF16)
        opt.step()
    return params, opt


def test_same_seed_same_bits_whatever_the_threads_chunks_and_order(monkeypatch):
    params, opt = _run()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread, _ = _run()
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(lowbit, "chunk_elements", lambda: 4 * lowbit.BLOCK)
    small_chunks, _ = _run()
    reversed_order, _ = _run(order=-1)
    for other in (one_thread, small_chunks, reversed_order):
        assert all(torch.equal(a, b) for a, b in zip(params, other, strict=True))
    reseeded, _ = _run(seed=1)
    assert not torch.equal(params[0], reseeded[0])


def _same_bits(a, b):
    """Bitwise equal, any NaN taken for any other (their payloads are not kept)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan() & b.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=bool)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(((a.view(ints) == b.view(ints)) | nan).all())


def _special_problem(n, dtype, seed):
    """A parameter and gradients of every magnitude AdamW meets, with zeros of both signs,
    infinities and NaNs among them."""
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 2, (n,), generator=g)).to(dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3e38])
    if n >= 64:
        p[17:24] = special.to(dtype)

    def grad(step):
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-12, 3, (n,), generator=gen)
        if n >= 64 and step == 1:
            x[40:47] = special
        return x.to(dtype)

    return p, grad


# (parameter dtype, state_bits, bf16_rounding, a kept Kahan compensation left behind)
NATIVE_FORMATS = (
    [(torch.float32, 8, "stochastic", False)]
    + [
        (BF16, bits, rounding, False)
        for bits in (8, 32)
        for rounding in ("stochastic", "kahan", "nearest")
    ]
    + [(BF16, 8, "stochastic", True)]
)


@pytest.mark.parametrize(
    "fmt", NATIVE_FORMATS, ids=lambda f: f"{f[0]}-{f[1]}bit-{f[2]}{'-kept' if f[3] else ''}"
)
def test_the_native_step_is_bitwise_the_per_op_step(fmt, monkeypatch):
    """Note: [The native host step]: the C kernel and the per-op step give the same bits, over
    short last blocks, special values, thread counts and splits across threads."""
    from torchoffload.optim import _native

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the per-op step is the only one here")
    assert _native.kernel() is not None, "this machine has a C compiler: the kernel must build"
    dtype, bits, rounding, kept = fmt
    sizes = (1, 255, 257, 5000, 64 * 256 * 2 + 3)  # the last one is split across threads
    kw = dict(lr=1e-3, weight_decay=0.1, state_bits=bits, bf16_rounding=rounding, seed=7,
              min_8bit_numel=1)  # fmt: skip

    def run(native, threads):
        monkeypatch.setenv("TORCHOFFLOAD_NATIVE", "1" if native else "0")
        problems = [_special_problem(n, dtype, k) for k, n in enumerate(sizes)]
        params = [p.clone().requires_grad_() for p, _ in problems]
        opt = LowPrecisionAdamW(params, **kw)
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for step in range(3):
                for p, (_, grad) in zip(params, problems, strict=True):
                    p.grad = grad(step)
                    if kept and step == 1:  # left by a Kahan run: added in once, then dropped
                        noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
                        opt.state[p]["compensation"] = (noise * 1e-4).to(BF16)
                opt.step()
        finally:
            torch.set_num_threads(saved)
        return params, opt

    reference, ref_opt = run(native=False, threads=2)
    for threads in (1, 2, 3):
        params, opt = run(native=True, threads=threads)
        for a, b in zip(params, reference, strict=True):
            assert _same_bits(a.detach(), b.detach()), (a.numel(), threads)
            for key, value in ref_opt.state[b].items():
                assert _same_bits(opt.state[a][key], value), (a.numel(), key, threads)
            assert opt.state[a].keys() == ref_opt.state[b].keys()


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_continues_bitwise_and_keeps_dtypes():
    params, opt = _run(bf16_rounding="kahan")
    sd = _save_load(opt.state_dict())
    twin = [p.detach().clone().requires_grad_() for p in params]
    opt2 = AdamW8bit(twin, lr=0.5, bf16_rounding="stochastic")
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-4 and opt2.param_groups[0]["bf16_rounding"] == "kahan"
    state = opt2.state[twin[0]]
    assert state["exp_avg_codes"].dtype == torch.uint8
    assert state["exp_avg_scales"].dtype == torch.float32  # torch.optim would make it bf16
    assert state["compensation"].dtype == BF16
    start, grad = _problem(6)
    for t in range(3, 6):
        for ps, o in ((params, opt), (twin, opt2)):
            for k, p in enumerate(ps):
                p.grad = grad(k, p.detach(), t).to(BF16)
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin, strict=True))


def test_state_dicts_move_between_torch_adamw_and_8bit_moments():
    start, grad = _problem(3)
    theirs, ref = _train(torch.optim.AdamW, start, grad, 3, torch.float32, lr=1e-3)
    mine = [p.detach().clone().requires_grad_() for p in theirs]
    opt = AdamW8bit(mine, lr=1e-3)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    big = opt.state[mine[1]]
    exp_avg = ref.state[theirs[1]]["exp_avg"]
    codes = torch.empty_like(big["exp_avg_codes"])
    scales = torch.empty_like(big["exp_avg_scales"])
    lowbit.quantize_(codes, scales, lowbit.padded(exp_avg), True)
    assert torch.equal(big["exp_avg_codes"], codes) and torch.equal(big["exp_avg_scales"], scales)
    small = opt.state[mine[2]]  # below min_8bit_numel: fp32, as saved
    assert torch.equal(small["exp_avg"], ref.state[theirs[2]]["exp_avg"])
    # and back: 8-bit moments into fp32 ones, by the loaded groups' state_bits (as torch.optim,
    # the loaded hyperparameters replace the optimizer's)
    back = [p.detach().clone().requires_grad_() for p in mine]
    plain = LowPrecisionAdamW(back, lr=1e-3)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["state_bits"] == 8
    sd["param_groups"][0]["state_bits"] = 32
    plain.load_state_dict(sd)
    dequantized = lowbit.dequantize(big["exp_avg_codes"], big["exp_avg_scales"], True)[:5000]
    assert torch.equal(plain.state[back[1]]["exp_avg"], dequantized)


def test_bad_input_is_refused_before_anything_changes():
    p = torch.zeros(10, requires_grad=True)
    for kwargs, error, match in [
        (dict(state_bits=4), ValueError, "state_bits must be 8 or 32"),
        (dict(bf16_rounding="up"), ValueError, "bf16_rounding must be one of"),
        (dict(seed=-1), ValueError, "seed must be >= 0"),
        (dict(lr=-1.0), ValueError, "lr must be >= 0"),
        (dict(betas=(1.0, 0.9)), ValueError, r"betas\[0\] must be < 1"),
        (dict(betas=0.9), TypeError, "betas must be a pair"),
    ]:
        with pytest.raises(error, match=match):
            AdamW8bit([p], **kwargs)
    with pytest.raises(ValueError, match="parameter 0 is torch.float16"):
        AdamW8bit([torch.zeros(10, dtype=torch.float16, requires_grad=True)])
    opt = AdamW8bit([p])
    with pytest.raises(ValueError, match="bf16_rounding"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], "bf16_rounding": 1})
    assert len(opt.param_groups) == 1
    a, b = torch.ones(8, requires_grad=True), torch.ones(8, requires_grad=True)
    opt = AdamW8bit([a, b], lr=0.1)
    a.grad, b.grad = torch.ones(8), torch.ones(8)
    b.data = b.data.half()  # converted after the optimizer was built
    b.grad = torch.ones(8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="is now torch.float16"):
        opt.step()
    assert torch.equal(a, torch.ones(8)) and not opt.state  # nothing stepped
    sd = AdamW8bit([torch.ones(8, requires_grad=True)]).state_dict()
    sd["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad=True"):
        AdamW8bit([torch.ones(8, requires_grad=True)]).load_state_dict(sd)
    adam = torch.optim.Adam([torch.ones(8, requires_grad=True)], weight_decay=0.1).state_dict()
    with pytest.raises(ValueError, match="is Adam's"):
        AdamW8bit([torch.ones(8, requires_grad=True)]).load_state_dict(adam)


def test_leaving_kahan_adds_the_compensation_in_once_and_drops_it():
    params, opt = _run(bf16_rounding="kahan")
    state = opt.state[params[0]]
    kept = state["compensation"].float().clone()
    before = params[0].detach().float() + kept
    assert bool((kept != 0).any())
    opt.param_groups[0]["bf16_rounding"] = "nearest"
    opt.param_groups[0]["lr"] = 0.0  # the step changes nothing but the rounding
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert "compensation" not in state
    assert torch.equal(params[0].detach(), before.to(BF16))


# - OffloadedOptimizer with them


def model(dtype=BF16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 70), nn.GELU(), nn.Linear(70, 8)
    ).to(dtype)  # two 8-bit weights (one with a short last block), fp32 moments for the rest


def batch(i, dtype=BF16):
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(100 + i)).to(dtype)


def loss_of(m, x):
    return m(x).float().square().mean()


class Reference:
    """The class on plain host tensors: copies of a twin's parameters in the masters' dtype
    (fp32, or the parameter's own with bf16 masters), stepped with its gradients."""

    def __init__(self, twin, cls, master_dtype=torch.float32, max_grad_norm=None, **kw):
        self.twin = twin
        self.masters = [
            p.detach().to(p.dtype if p.dtype == master_dtype else torch.float32)
            .clone().requires_grad_()
            for p in twin.parameters()
        ]  # fmt: skip
        self.opt = cls(self.masters, **kw)
        self.max_grad_norm = max_grad_norm

    def step(self, x):
        loss_of(self.twin, x).backward()
        for m, p in zip(self.masters, self.twin.parameters(), strict=True):
            m.grad = p.grad.to(m.dtype)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm)
        self.opt.step()
        self.twin.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.masters, self.twin.parameters(), strict=True):
                p.copy_(m)


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


MASTER = "torchoffload_master"  # an fp32 master in its parameter's state entry


def masters_of(sd):
    """The fp32 masters in a state dict of OffloadedOptimizer, by index."""
    return {i: s[MASTER] for i, s in sd["state"].items() if MASTER in s}


def class_state(sd):
    """A state dict's entries without the masters: the optimizer class's own state."""
    out = {i: {k: v for k, v in s.items() if k != MASTER} for i, s in sd["state"].items()}
    return {i: s for i, s in out.items() if s}


CLASSES = {
    "8bit-stochastic": (AdamW8bit, {}),
    "8bit-kahan": (AdamW8bit, dict(bf16_rounding="kahan")),
    "fp32-moments-stochastic": (LowPrecisionAdamW, {}),
    "8bit-nearest": (AdamW8bit, dict(bf16_rounding="nearest")),
}


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("master_dtype", [BF16, torch.float32], ids=["bf16-masters", "fp32"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at-step"])
@pytest.mark.parametrize("convert_on", ["device", "host"])
def test_the_host_step_is_bitwise_the_class_on_plain_host_tensors(
    name, master_dtype, overlap, convert_on
):
    cls, kw = CLASSES[name]
    a = model()
    ref = Reference(copy.deepcopy(a), cls, master_dtype, lr=1e-3, **kw)
    opt = to.OffloadedOptimizer(a.parameters(), cls, lr=1e-3, bucket_bytes=8192,
                                master_dtype=master_dtype, overlap=overlap,
                                convert_on=convert_on, **kw)  # fmt: skip
    assert len(opt._runtime.buckets) > 2
    for i in range(4):
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
        ref.step(batch(i))
        assert same_params(a, ref.twin), i
    mine, theirs = class_state(opt.state_dict()), ref.opt.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for i in mine:
        assert mine[i].keys() == theirs[i].keys()
        assert all(torch.equal(mine[i][k], theirs[i][k]) for k in mine[i])
    stats = opt.stats()
    numel = sum(p.numel() for p in a.parameters())
    bf16_masters = master_dtype == BF16
    crossing = 2 if bf16_masters or convert_on == "host" else 4
    assert stats.d2h_bytes == stats.h2d_bytes == 4 * numel * crossing
    # what the planner prices the link at
    assert crossing == link_bytes_per_param(BF16, master_dtype=master_dtype, convert_on=convert_on)
    per = 4 if bf16_masters else 8 + (2 if convert_on == "host" else 0)  # master, grad, staging
    assert per * numel <= stats.pinned_bytes < per * numel + 3 * 64 * 6
    masters = masters_of(opt.state_dict())
    assert "master_params" not in opt.state_dict()
    assert (masters == {}) == bf16_masters
    assert all(torch.equal(m, ref.masters[i]) for i, m in masters.items())
    assert len(masters) in (0, len(ref.masters))
    opt.remove()


def test_host_bytes_per_param_is_what_the_host_holds():
    big = nn.Linear(4096, 256, bias=False).to(BF16)  # 1 M elements: 8-bit moments
    for master_dtype, cls, kw in [
        (torch.float32, torch.optim.AdamW, {}),
        (torch.float32, AdamW8bit, {}),
        (BF16, AdamW8bit, {}),
        (BF16, AdamW8bit, dict(bf16_rounding="kahan")),
        (BF16, LowPrecisionAdamW, {}),
    ]:
        m = copy.deepcopy(big)
        opt = to.OffloadedOptimizer(m.parameters(), cls, master_dtype=master_dtype, **kw)
        for _ in range(3):
            loss_of(m, torch.ones(2, 4096, dtype=BF16)).backward()
            opt.step()
            opt.zero_grad()
        stats, n = opt.stats(), m.weight.numel()
        held = (stats.pinned_bytes + stats.state_bytes - 4) / n  # less the state's "step"
        state_bits = 8 if cls is AdamW8bit else 32
        steady = host_bytes_per_param(BF16, master_dtype=master_dtype, state_bits=state_bits,
                                      overlap=False, **kw)  # fmt: skip
        assert held == pytest.approx(steady, abs=1e-3), (cls, master_dtype, kw)
        # a bucket stepped during backward keeps its master and state aside (whether one was
        # depends on the worker's timing): at most what overlap=True counts
        aside = sum(b.undo.nbytes for b in opt._runtime.buckets)
        most = host_bytes_per_param(BF16, master_dtype=master_dtype, state_bits=state_bits,
                                    **kw) - steady  # fmt: skip
        assert aside in (0, pytest.approx(most * n + 4, abs=n * 1e-3)), (aside / n, most)
        opt.remove()
    assert host_bytes_per_param(overlap=False) == 16 and host_bytes_per_param() == 28
    assert host_bytes_per_param(convert_on="host", overlap=False) == 18
    assert host_bytes_per_param(master_dtype=BF16, state_bits=8, overlap=False) == 6.03125
    # The Llama-3.1-8B shape's 8.03 B parameters, all of the state on the host: 120 GiB with
    # fp32 masters and AdamW, 45 GiB with bf16 masters and 8-bit moments (75 with overlap)
    assert 8.03e9 * host_bytes_per_param(overlap=False) / 2**30 > 119
    lowest = host_bytes_per_param(master_dtype=BF16, state_bits=8, overlap=False)
    assert 8.03e9 * lowest / 2**30 < 46
    assert 8.03e9 * host_bytes_per_param(master_dtype=BF16, state_bits=8) / 2**30 < 76


def test_bf16_masters_state_dict_round_trip_continues_bitwise():
    a = model()
    opt = to.OffloadedOptimizer(a.parameters(), AdamW8bit, lr=1e-3, bucket_bytes=8192,
                                master_dtype=BF16)  # fmt: skip
    for i in range(2):
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
    sd = _save_load(opt.state_dict())
    assert masters_of(sd) == {}  # the parameters are the masters
    b = copy.deepcopy(a)
    opt_b = to.OffloadedOptimizer(b.parameters(), AdamW8bit, lr=0.5, master_dtype=BF16)
    opt_b.load_state_dict(sd)
    for i in range(2, 5):
        for m, o in ((a, opt), (b, opt_b)):
            loss_of(m, batch(i)).backward()
            o.step()
            o.zero_grad()
    assert same_params(a, b)
    # a checkpoint of fp32 masters loads into bf16 masters (rounded: the parameters' values)
    c = copy.deepcopy(a)
    fp32 = to.OffloadedOptimizer(c.parameters(), AdamW8bit, lr=1e-3)
    loss_of(c, batch(5)).backward()
    fp32.step()
    fp32.zero_grad()
    d = copy.deepcopy(c)
    opt_d = to.OffloadedOptimizer(d.parameters(), AdamW8bit, lr=1e-3, master_dtype=BF16)
    opt_d.load_state_dict(fp32.state_dict())
    assert same_params(c, d)
    for rec in opt_d._runtime.records:
        assert torch.equal(rec.master, rec.param)
    for o in (opt, opt_b, fp32, opt_d):
        o.remove()


@pytest.mark.parametrize("master_dtype", [BF16, torch.float32], ids=["bf16-masters", "fp32"])
def test_loaded_groups_lacking_a_key_take_the_class_default_as_the_plain_class(master_dtype):
    """A torch.optim.AdamW state dict has no state_bits nor bf16_rounding: loaded into groups
    that set their own, the plain class takes its defaults for them (the loaded groups replace
    the optimizer's); so does the OffloadedOptimizer, which kept the groups' own before (fp32
    moments and Kahan for the first layer where the plain class quantizes: other bits)."""
    a = model()

    def groups(m, masters=None):
        if masters is None:
            first, rest = [m[0].weight, m[0].bias], [*m[2].parameters(), *m[4].parameters()]
        else:
            first, rest = masters[:2], masters[2:]
        return [{"params": first, "state_bits": 32, "bf16_rounding": "kahan"}, {"params": rest}]

    adamw = to.OffloadedOptimizer([{"params": g["params"]} for g in groups(a)], torch.optim.AdamW,
                                  lr=1e-3, bucket_bytes=8192)  # fmt: skip
    for i in range(2):
        loss_of(a, batch(i)).backward()
        adamw.step()
        adamw.zero_grad()
    sd = _save_load(adamw.state_dict())
    adamw.remove()
    b = copy.deepcopy(a)
    ref = Reference(copy.deepcopy(a), AdamW8bit, master_dtype, lr=1e-3)
    ref.opt = AdamW8bit(groups(None, ref.masters), lr=1e-3)
    with torch.no_grad():
        for i, m in enumerate(ref.masters):
            if m.dtype == torch.float32 and i in masters_of(sd):
                m.copy_(masters_of(sd)[i])
    ref.opt.load_state_dict(copy.deepcopy({**sd, "state": class_state(sd)}))
    opt = to.OffloadedOptimizer(groups(b), AdamW8bit, lr=1e-3, bucket_bytes=8192,
                                master_dtype=master_dtype)  # fmt: skip
    opt.load_state_dict(copy.deepcopy(sd))
    for mine, theirs in zip(opt.param_groups, ref.opt.param_groups, strict=True):
        assert (mine["state_bits"], mine["bf16_rounding"]) == (8, "stochastic")
        assert {k: v for k, v in mine.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"
        }
    for i in range(2, 5):
        loss_of(b, batch(i)).backward()
        opt.step()
        opt.zero_grad()
        ref.step(batch(i))
        assert same_params(b, ref.twin), i
    mine, theirs = class_state(opt.state_dict()), ref.opt.state_dict()["state"]
    for i in theirs:
        assert mine[i].keys() == theirs[i].keys()
        assert all(torch.equal(mine[i][k], theirs[i][k]) for k in theirs[i])
    opt.remove()


@pytest.mark.parametrize("max_norm", [1e-3, 1e3], ids=["clipped", "not-clipped"])
def test_bf16_masters_clip_like_clip_grad_norm_on_the_bf16_gradients(max_norm):
    a = model()
    ref = Reference(copy.deepcopy(a), AdamW8bit, BF16, max_grad_norm=max_norm, lr=1e-3)
    opt = to.OffloadedOptimizer(a.parameters(), AdamW8bit, lr=1e-3, bucket_bytes=8192,
                                master_dtype=BF16, max_grad_norm=max_norm, model=a)  # fmt: skip
    for i in range(3):
        loss_of(a, batch(i)).backward()
        opt.step()
        opt.zero_grad()
        ref.step(batch(i))
        assert same_params(a, ref.twin), i
    opt.remove()


def test_bf16_masters_refuse_what_they_cannot_take_before_anything_changes():
    def refused(params, cls, match, **kw):
        params = list(params)
        with pytest.raises(ValueError, match=match):
            to.OffloadedOptimizer(params, cls, **kw)
        assert not any(p in MANAGED for p in params)

    mixed = model()
    mixed[0].half()
    refused(mixed.parameters(), AdamW8bit, "parameter 0 is torch.float16", master_dtype=BF16)
    refused(model(torch.float32).parameters(), AdamW8bit, "no parameter is bfloat16",
            master_dtype=BF16)  # fmt: skip
    refused(model().parameters(), torch.optim.AdamW, "AdamW would step the bf16 masters",
            master_dtype=BF16)  # fmt: skip
    refused(model().parameters(), AdamW8bit, "not supported yet with offload_fraction",
            master_dtype=BF16, offload_fraction=0.5)  # fmt: skip
    partly = model()
    partly[4].float()
    refused(partly.parameters(), AdamW8bit, "max_grad_norm is not supported yet over",
            master_dtype=BF16, max_grad_norm=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="master_dtype must be torch.float32 or torch.bfloat16"):
        OptimizerOffloadConfig(master_dtype=torch.float16)
    # a model of bf16 and fp32 parameters: the fp32 ones keep fp32 masters
    opt = to.OffloadedOptimizer(partly.parameters(), AdamW8bit, master_dtype=BF16)
    assert [r.master.dtype for r in opt._runtime.records] == [BF16] * 4 + [torch.float32] * 2
    opt.remove()


def test_bf16_masters_of_streamed_parameters_are_stepped_in_the_host_store_bitwise():
    from torchoffload.models import GPT, GPTConfig

    cfg = GPTConfig(hidden=64, layers=2, heads=4, vocab=64, max_seq=16)

    def gpt():
        torch.manual_seed(0)
        return GPT(cfg).to(BF16)

    def tokens(i):
        return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i))

    resident, streamed = gpt(), gpt()
    handle = to.stream_parameters(streamed, budget_bytes=1 << 20)
    opts = [to.OffloadedOptimizer(m.parameters(), AdamW8bit, lr=1e-3, master_dtype=BF16)
            for m in (resident, streamed)]  # fmt: skip
    for i in range(3):
        for m, opt in zip((resident, streamed), opts, strict=True):
            m.loss(tokens(i)).backward()
            opt.step()
            opt.zero_grad()
    for opt in opts:
        opt.remove()
    handle.remove()
    assert same_params(resident, streamed)


@pytest.mark.parametrize("name", ["8bit-stochastic", "8bit-kahan"])
def test_bf16_masters_undo_steps_taken_during_backward_bitwise(name):
    """Plain second backwards before step() (a bucket stepped during the first is recalled and
    its step undone) and clipping (a step taken before the coefficient was known is undone):
    the redone step is bitwise the class's single step, stochastic rounding included."""
    cls, kw = CLASSES[name]
    a = model()
    twin = copy.deepcopy(a)
    ref = Reference(twin, cls, BF16, max_grad_norm=0.05, lr=1e-3, **kw)
    opt = to.OffloadedOptimizer(a.parameters(), cls, lr=1e-3, bucket_bytes=8192,
                                master_dtype=BF16, max_grad_norm=0.05, model=a,
                                **kw)  # fmt: skip
    for step, micro_batches in enumerate([2, 1, 3]):
        xs = [batch(10 * step + k) for k in range(micro_batches)]
        for x in xs:
            loss_of(a, x).backward()
        opt.step()
        opt.zero_grad()
        for x in xs[:-1]:
            loss_of(twin, x).backward()
        ref.step(xs[-1])
        assert same_params(a, twin), step
    opt.remove()


def test_measure_host_step_times_the_class_on_host_tensors_and_refuses_bad_input():
    from torchoffload.optim import measure_host_step

    for cls, master in ((torch.optim.AdamW, torch.float32), (AdamW8bit, BF16),
                        (LowPrecisionAdamW, BF16)):  # fmt: skip
        rate = measure_host_step(cls, master_dtype=master, numel=1 << 14, steps=1, threads=1)
        assert math.isfinite(rate) and rate > 0
    for kw, message in (
        (dict(numel=0), "numel"),
        (dict(numel=2, tensors=3), "tensors (3) must be at most numel (2)"),
        (dict(master_dtype=torch.float16), "master_dtype must be"),
        (dict(master_dtype=BF16), "AdamW does not step bf16 masters"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            measure_host_step(torch.optim.AdamW, **kw)
    with pytest.raises(TypeError):  # the class's own refusal, raised on the caller's thread
        measure_host_step(torch.optim.AdamW, numel=4, bogus=1)


def test_a_native_step_that_cannot_build_warns_once_and_steps_per_op(monkeypatch, tmp_path):
    from torchoffload.optim import _native

    monkeypatch.setattr(_native, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TORCHOFFLOAD_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="native low-precision host step is not available"):
        assert _native.kernel() is None
    assert _native.kernel() is None  # once: the failure is kept
    p = torch.ones(300, dtype=BF16, requires_grad=True)
    p.grad = torch.full_like(p, 0.5)
    AdamW8bit([p], lr=0.1, min_8bit_numel=1).step()
    assert bool((p < 1).all())


def test_fp32_moments_of_a_parameter_over_one_chunk_load_into_8bit_ones(monkeypatch):
    """`_adopt` quantizes loaded fp32 moments chunk by chunk: a parameter of several chunks
    gets the codes of one whole pass (once a RuntimeError: the chunk size became a tensor)."""
    n = 5 * lowbit.BLOCK + 7
    p = nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    ref = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(n, generator=torch.Generator().manual_seed(1))
    ref.step()
    whole = AdamW8bit([p], min_8bit_numel=1)
    whole.load_state_dict(copy.deepcopy(ref.state_dict()))
    monkeypatch.setattr(lowbit, "chunk_elements", lambda: 2 * lowbit.BLOCK)
    chunked = AdamW8bit([p], min_8bit_numel=1)
    chunked.load_state_dict(copy.deepcopy(ref.state_dict()))
    for key, value in whole.state[p].items():
        assert torch.equal(chunked.state[p][key], value), key


@pytest.mark.parametrize("change", ["strided codes", "float64 scales"])
def test_loaded_8bit_state_of_another_layout_steps_as_its_values(change, monkeypatch):
    """The native kernel reads the state by address: a loaded state dict whose codes are a
    strided view, or whose scales are float64, is stepped as its values say, as per op."""
    from torchoffload.optim import _native

    if _native.kernel() is None:
        pytest.skip("no C compiler: the per-op step is the only one here")
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(1000, generator=gen))
    opt = AdamW8bit([p], lr=1e-2, min_8bit_numel=1)
    p.grad = torch.randn(1000, generator=gen)
    opt.step()
    grad = torch.randn(1000, generator=gen)
    sd = copy.deepcopy(opt.state_dict())
    for name in ("exp_avg", "exp_avg_sq"):
        if change == "strided codes":
            codes = sd["state"][0][f"{name}_codes"]
            wide = torch.zeros(2 * codes.numel(), dtype=torch.uint8)
            wide[::2] = codes
            sd["state"][0][f"{name}_codes"] = wide[::2]
        else:
            sd["state"][0][f"{name}_scales"] = sd["state"][0][f"{name}_scales"].double()
    stepped = []
    for native in ("1", "0"):
        monkeypatch.setenv("TORCHOFFLOAD_NATIVE", native)
        q = nn.Parameter(p.detach().clone())
        twin = AdamW8bit([q], lr=1e-2, min_8bit_numel=1)
        twin.load_state_dict(copy.deepcopy(sd))
        q.grad = grad.clone()
        twin.step()
        stepped.append(q.detach())
    assert _same_bits(stepped[0], stepped[1])
    # and as the optimizer that saved it
    p.grad = grad.clone()
    opt.step()
    assert _same_bits(stepped[0], p.detach())


def test_a_loaded_compensation_of_another_size_is_refused():
    p = nn.Parameter(torch.randn(1000).to(BF16))
    opt = LowPrecisionAdamW([p], bf16_rounding="kahan")
    p.grad = torch.randn(1000).to(BF16)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["compensation"] = sd["state"][0]["compensation"][:10].clone()
    twin = LowPrecisionAdamW([nn.Parameter(p.detach().clone())], bf16_rounding="kahan")
    with pytest.raises(ValueError, match="compensation does not fit it"):
        twin.load_state_dict(sd)


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("bits", [8, 32])
def test_a_state_that_no_longer_fits_its_parameter_is_refused_before_anything_changes(
    native, bits, monkeypatch
):
    """A parameter whose data was replaced by a larger one after its first step: refused with
    nothing changed (per op the step failed part way; the native kernel stepped the new size
    over the old state's memory: out of bounds, a crash)."""
    monkeypatch.setenv("TORCHOFFLOAD_NATIVE", native)
    gen = torch.Generator().manual_seed(0)
    first, p = (nn.Parameter(torch.randn(300, generator=gen).to(BF16)) for _ in range(2))
    opt = LowPrecisionAdamW([first, p], state_bits=bits, min_8bit_numel=1)
    for q in (first, p):
        q.grad = torch.randn(300, generator=gen).to(BF16)
    opt.step()
    p.data = torch.randn(300_000, generator=gen).to(BF16)
    p.grad = torch.randn(300_000, generator=gen).to(BF16)
    before = copy.deepcopy(opt.state_dict()), first.detach().clone(), p.detach().clone()
    with pytest.raises(RuntimeError, match="was the parameter's data replaced"):
        opt.step()
    after = opt.state_dict(), first.detach(), p.detach()
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])
    for k in (0, 1):
        for key, value in before[0]["state"][k].items():
            assert torch.equal(after[0]["state"][k][key], value), key


def test_a_strided_8bit_state_is_stepped_per_op_not_read_by_address(monkeypatch):
    """State tensors set by hand (not through `load_state_dict`) as strided views: the native
    kernel would read them as contiguous; the step takes them per op, the same bits."""
    stepped = []
    for native in ("1", "0"):
        monkeypatch.setenv("TORCHOFFLOAD_NATIVE", native)
        gen = torch.Generator().manual_seed(0)
        p = nn.Parameter(torch.randn(1000, generator=gen))
        opt = AdamW8bit([p], lr=1e-2, min_8bit_numel=1)
        p.grad = torch.randn(1000, generator=gen)
        opt.step()
        codes = opt.state[p]["exp_avg_codes"]
        wide = torch.zeros(2 * codes.numel(), dtype=torch.uint8)
        wide[::2] = codes
        opt.state[p]["exp_avg_codes"] = wide[::2]
        p.grad = torch.randn(1000, generator=gen)
        opt.step()
        stepped.append((p.detach(), wide.clone()))
    assert _same_bits(stepped[0][0], stepped[1][0]) and torch.equal(stepped[0][1], stepped[1][1])


def test_a_parameter_listed_twice_is_stepped_twice_in_order(monkeypatch):
    """torch.optim only warns of a parameter listed twice in a group: per op it is stepped
    twice, one step after the other. The native steps of one call run at once, a block's two
    steps maybe on two threads: they must not be in one call."""
    from torchoffload.optim import _native

    if _native.kernel() is None:
        pytest.skip("no C compiler: the per-op step is the only one here")
    calls = []
    run = _native.Steps.run

    def recorded(self, tables):
        calls.append([task.param for task in self.tasks])
        run(self, tables)

    monkeypatch.setattr(_native.Steps, "run", recorded)
    stepped = []
    for native in ("1", "0"):
        monkeypatch.setenv("TORCHOFFLOAD_NATIVE", native)
        gen = torch.Generator().manual_seed(0)
        p = nn.Parameter(torch.randn(256 * 64 * 3, generator=gen).to(BF16))
        with pytest.warns(UserWarning, match="duplicate parameters"):
            opt = AdamW8bit([p, p], lr=1e-2)
        saved = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            for _ in range(2):
                p.grad = torch.randn(p.shape, generator=gen).to(BF16)
                opt.step()
        finally:
            torch.set_num_threads(saved)
        assert float(opt.state[p]["step"]) == 4
        stepped.append(p.detach())
    assert calls and all(len(set(c)) == len(c) for c in calls), calls
    assert _same_bits(stepped[0], stepped[1])


def test_a_cached_kernel_cut_short_is_built_again(tmp_path):
    """A cached shared object cut short (a full disk, a crash) is built again, not loaded:
    dlopen maps it without a complaint and the first touch of its missing part kills the
    process with a SIGBUS (a child process here, so that the old behaviour fails the test
    rather than the run). $CC may hold arguments; a failed build leaves no temporary file."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler: the per-op step is the only one here")
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from torchoffload.optim import _native, AdamW8bit\n"
        "import torch\n"
        "assert _native.kernel() is not None\n"
        "p = torch.nn.Parameter(torch.ones(300)); p.grad = torch.ones(300)\n"
        "AdamW8bit([p], min_8bit_numel=1).step(); assert bool((p < 1).all())\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, TORCHOFFLOAD_CACHE=str(tmp_path), PYTHONPATH=root, CC=f"{cc} -w")
    env.pop("TORCHOFFLOAD_NATIVE", None)

    def child():
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=240)  # fmt: skip

    first = child()
    assert first.returncode == 0, first.stderr[-2000:]
    (built,) = tmp_path.glob("*.so")
    whole = built.read_bytes()
    # an empty file and one cut after its headers are not whole; the latter is built again by
    # a child (the empty one takes the same path: one build less, about 10 s of a CI core)
    from torchoffload.optim._native import _whole

    assert _whole(built)
    for cut in (0, 63, len(whole) // 2):
        built.write_bytes(whole[:cut])
        assert not _whole(built), cut
    again = child()
    assert again.returncode == 0, (again.returncode, again.stderr[-2000:])
    assert built.read_bytes() == whole
    env["CC"] = str(tmp_path / "no-such-cc")
    failed = child()
    assert "not available" in failed.stderr
    assert list(tmp_path.glob("tmp*")) == []
