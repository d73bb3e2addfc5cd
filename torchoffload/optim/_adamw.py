"""AdamW with low-precision state: `LowPrecisionAdamW` (moments in fp32 or 8 bits, bf16
parameters written by stochastic rounding or with a compensation term) and `AdamW8bit` (the
same, 8-bit moments by default). Plain `torch.optim.Optimizer` classes, for any device: stepped
on the host by an `OffloadedOptimizer`, or on their own."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import torch

from torchoffload._validate import check_int, check_number
from torchoffload.optim import _lowbit, _native
from torchoffload.optim._lowbit import (
    BLOCK,
    blocks_of,
    dequantize,
    native_tables,
    padded,
    quantize_,
    round_compensated_,
    round_key,
    round_stochastic_,
    sqrt_exact,
)

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (name, signed map)


class Bf16Rounding(str, enum.Enum):
    """How a bf16 parameter takes its new value (Note: [Updating a bf16 parameter])."""

    STOCHASTIC = "stochastic"
    KAHAN = "kahan"  # a bf16 compensation term in the state
    NEAREST = "nearest"  # loses updates below half a bf16 step: for comparison

    @classmethod
    def parse(cls, value: object) -> Bf16Rounding:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(c.value) for c in cls)
            raise ValueError(f"bf16_rounding must be one of {choices}, got {value!r}") from None


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (`torch.optim.AdamW`'s update: decoupled weight decay, bias-corrected moments)
    for float32 and bfloat16 parameters, with low-precision state:

    - ``state_bits``: the two moments in fp32 (32: 8 bytes a parameter) or 8 bits (8: 2.03
      bytes a parameter, blockwise with an fp32 scale per 256 values, as bitsandbytes' and
      torchao's 8-bit AdamW: Note: [8-bit optimizer state]). Parameters of fewer than
      ``min_8bit_numel`` elements keep fp32 moments either way.
    - ``bf16_rounding``: how a bfloat16 parameter takes its new value, computed in fp32 (Note:
      [Updating a bf16 parameter]): ``"stochastic"`` (reproducible, from ``seed``; no extra
      bytes), ``"kahan"`` (a bf16 compensation term, 2 bytes a parameter) or ``"nearest"``
      (loses the updates below half a bf16 step; for comparison). float32 parameters are
      stepped in fp32: with ``state_bits=32`` bitwise `torch.optim.AdamW` (single-tensor).

    Every option is also a param-group key. A parameter's moments take their format at its
    first step; `load_state_dict` takes this class's state dicts and `torch.optim.AdamW`'s,
    converting the moments to the format of the loaded groups (whose values replace this
    optimizer's, as in torch.optim). The step is elementwise per parameter, so its bits do not
    depend on the order or grouping of the parameters, the thread count or the chunking:
    `OffloadedOptimizer(params, LowPrecisionAdamW, master_dtype=torch.bfloat16)` steps bf16
    host masters bitwise as this class on plain tensors does (``supports_bf16_master``).
    """

    # An OffloadedOptimizer may give this class bf16 masters (master_dtype=torch.bfloat16)
    supports_bf16_master = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_bits: int = 32,
        bf16_rounding: str = "stochastic",
        seed: int = 0,
        min_8bit_numel: int = 4096,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_bits=state_bits,
            bf16_rounding=bf16_rounding, seed=seed, min_8bit_numel=min_8bit_numel,
        )  # fmt: skip
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers = [_Hyper(group) for group in self.param_groups]  # refuse before anything
        for group in self.param_groups:  # changes
            for p in group["params"]:
                _check_param(p, p.grad)
                if p.grad is not None and self.state.get(p):
                    _check_state(p, self.state[p])
        fn = _native.kernel()
        native = None if fn is None else _native.Steps(fn)
        queued: set[int] = set()
        for group, hyper in zip(self.param_groups, hypers, strict=True):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if native is not None and id(p) in queued:
                    # a parameter listed twice (torch.optim only warns) is stepped twice, in
                    # order: its first step runs before the second reads it
                    native.run(native_tables())
                    queued.clear()
                queued.add(id(p))
                state = self.state[p]
                if not state:
                    _init_state(p, state, hyper)
                state["step"] += 1
                _step_param(p, p.grad, state, hyper, native)
        if native is not None:
            native.run(native_tables())
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of `torch.optim.AdamW`. Each state tensor keeps
        its dtype (torch.optim would cast it to the parameter's), and the moments are
        converted to the format of the loaded group (8-bit or fp32) for the parameter. Checked
        whole before anything changes."""
        saved, saved_groups = state_dict["state"], state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer "
                f"{len(self.param_groups)}"
            )
        adopted: dict[torch.Tensor, dict[str, Any]] = {}
        for k, (theirs, mine) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            for flag in ("amsgrad", "maximize"):
                if theirs.get(flag):
                    raise ValueError(
                        f"loaded group {k} has {flag}=True, which LowPrecisionAdamW does not "
                        "implement"
                    )
            if theirs.get("decoupled_weight_decay") is False and theirs.get("weight_decay"):
                raise ValueError(
                    f"loaded group {k} is Adam's (weight decay added to the gradient), not AdamW's"
                )
            if len(theirs["params"]) != len(mine["params"]):
                raise ValueError(
                    f"loaded group {k} has {len(theirs['params'])} parameters, this "
                    f"optimizer's {len(mine['params'])}"
                )
            merged = {**self.defaults, **theirs, "params": []}
            _check_group(merged)
            hyper = _Hyper(merged)
            for i, p in zip(theirs["params"], mine["params"], strict=True):
                if i in saved:
                    adopted[p] = _adopt(p, saved[i], hyper, i)
        super().load_state_dict({**state_dict, "state": {}})
        for group in self.param_groups:  # keys a torch.optim.AdamW state dict lacks
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            _check_group(group)
        for p, state in adopted.items():
            self.state[p] = state


class AdamW8bit(LowPrecisionAdamW):
    """`LowPrecisionAdamW` with 8-bit moments by default (``state_bits=8``): 2.03 bytes a
    parameter of state against AdamW's 8 (Note: [8-bit optimizer state])."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_bits: int = 8,
        bf16_rounding: str = "stochastic",
        seed: int = 0,
        min_8bit_numel: int = 4096,
    ):
        super().__init__(
            params, lr, betas, eps, weight_decay, state_bits=state_bits,
            bf16_rounding=bf16_rounding, seed=seed, min_8bit_numel=min_8bit_numel,
        )  # fmt: skip


def _check_group(group: dict[str, Any]) -> None:
    lr = group["lr"]
    if not (isinstance(lr, torch.Tensor) and lr.numel() == 1):
        check_number("lr", lr, positive=False)
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"betas must be a pair of numbers, got {betas!r}")
    for k, beta in enumerate(betas):
        check_number(f"betas[{k}]", beta, positive=False, maximum=1.0)
        if beta == 1.0:
            raise ValueError(f"betas[{k}] must be < 1, got {beta!r}")
    check_number("eps", group["eps"], positive=False)
    check_number("weight_decay", group["weight_decay"], positive=False)
    if group["state_bits"] not in (8, 32) or isinstance(group["state_bits"], bool):
        raise ValueError(f"state_bits must be 8 or 32, got {group['state_bits']!r}")
    group["bf16_rounding"] = Bf16Rounding.parse(group["bf16_rounding"]).value
    check_int("seed", group["seed"], minimum=0)
    check_int("min_8bit_numel", group["min_8bit_numel"], minimum=0)
    for i, p in enumerate(group["params"]):
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"params: parameter {i} is {p.dtype}; LowPrecisionAdamW steps float32 and "
                "bfloat16 parameters (keep float32 masters of float16 parameters)"
            )


def _check_param(p: torch.Tensor, grad: torch.Tensor | None) -> None:
    if p.dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(
            f"a parameter is now {p.dtype}; LowPrecisionAdamW steps float32 and bfloat16 parameters"
        )
    if grad is not None and (grad.is_sparse or grad.layout != torch.strided):
        raise RuntimeError("LowPrecisionAdamW does not support sparse gradients")
    if grad is not None and (grad.dtype != p.dtype or grad.shape != p.shape):
        raise RuntimeError(
            f"a gradient is {grad.dtype} {tuple(grad.shape)}, its parameter {p.dtype} "
            f"{tuple(p.shape)}"
        )


def _check_state(p: torch.Tensor, state: dict[str, Any]) -> None:
    """Refuse a state that no longer fits ``p`` (its data replaced by one of another size or
    device after its first step, or the state edited): per op the step would fail part way
    through the parameters, the native kernel read and write out of bounds."""
    n = p.numel()
    expected: dict[str, tuple[torch.dtype, int]] = {}
    for name, _ in _MOMENTS:
        if f"{name}_codes" in state:
            expected[f"{name}_codes"] = (torch.uint8, blocks_of(n) * BLOCK)
            expected[f"{name}_scales"] = (torch.float32, blocks_of(n))
        else:
            expected[name] = (torch.float32, n)
    if "compensation" in state and p.dtype == torch.bfloat16:
        expected["compensation"] = (torch.bfloat16, n)
    for key, (dtype, numel) in expected.items():
        t = state.get(key)
        found = (t.dtype, t.numel(), t.device) if isinstance(t, torch.Tensor) else None
        if found != (dtype, numel, p.device):
            raise RuntimeError(
                f"the optimizer state {key!r} of a parameter of {n} elements on {p.device} is "
                f"{found}, not ({dtype}, {numel}, {p.device}): was the parameter's data "
                "replaced after its first step?"
            )


class _Hyper:
    """A group's values, as the step reads them."""

    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay", "state_bits", "rounding",
                 "seed", "min_8bit_numel")  # fmt: skip

    def __init__(self, group: dict[str, Any]):
        lr = group["lr"]
        self.lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
        self.beta1, self.beta2 = (float(b) for b in group["betas"])
        self.eps = float(group["eps"])
        self.weight_decay = float(group["weight_decay"])
        self.state_bits = group["state_bits"]
        self.rounding = Bf16Rounding.parse(group["bf16_rounding"])
        self.seed = group["seed"]
        self.min_8bit_numel = group["min_8bit_numel"]

    def quantizes(self, p: torch.Tensor) -> bool:
        return self.state_bits == 8 and p.numel() >= self.min_8bit_numel


def _init_state(p: torch.Tensor, state: dict[str, Any], hyper: _Hyper) -> None:
    state["step"] = torch.tensor(0.0)
    for name, _ in _MOMENTS:
        if hyper.quantizes(p):
            n = blocks_of(p.numel())
            state[f"{name}_codes"] = torch.zeros(n * BLOCK, dtype=torch.uint8, device=p.device)
            state[f"{name}_scales"] = torch.zeros(n, dtype=torch.float32, device=p.device)
        else:
            state[name] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)


def _step_param(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], h: _Hyper,
                native: _native.Steps | None) -> None:  # fmt: skip
    """One AdamW step of ``p``: fp32 moments of an fp32 parameter as `torch.optim.AdamW`
    (single-tensor) steps them, bit for bit; any other format by `_step_lowbit` (given to
    ``native`` to run, for a contiguous CPU parameter and gradient)."""
    work = p if p.is_contiguous() else p.contiguous()
    flat, g = work.view(-1), grad.reshape(-1)
    step = float(state["step"])
    if p.dtype == torch.bfloat16 or "exp_avg_codes" in state:
        native_ok = work is p and g.is_contiguous() and p.device.type == "cpu"
        _step_lowbit(flat, g, state, h, step, p.shape, native if native_ok else None)
    else:
        _step_fp32(flat, g, state, h, step)
    if work is not p:
        p.copy_(work)


def _step_fp32(flat: torch.Tensor, g: torch.Tensor, state: dict[str, Any], h: _Hyper,
               step: float) -> None:  # fmt: skip
    """`torch.optim.AdamW`'s single-tensor update, chunk by chunk, in place."""
    step_size = h.lr / (1 - h.beta1**step)
    bias_correction2_sqrt = (1 - h.beta2**step) ** 0.5
    m, v = (state[n].view(-1) for n, _ in _MOMENTS)
    chunk = _lowbit.chunk_elements()
    for lo in range(0, flat.numel(), chunk):
        x, gc, mc, vc = (t[lo : lo + chunk] for t in (flat, g, m, v))
        if h.weight_decay != 0:
            x.mul_(1 - h.lr * h.weight_decay)
        mc.lerp_(gc, 1 - h.beta1)
        vc.mul_(h.beta2).addcmul_(gc, gc, value=1 - h.beta2)
        denom = (vc.sqrt() / bias_correction2_sqrt).add_(h.eps)
        x.addcdiv_(mc, denom, value=-step_size)


def _scalars(h: _Hyper, step: float) -> list[float]:
    """The step's scalars, in float64, in the order `_lowbit_step.c` takes them: each op rounds
    its scalar to fp32 as the C code's fp32 copy of them is rounded."""
    return [1 - h.lr * h.weight_decay, 1 - h.beta1, h.beta2, 1 - h.beta2,
            1 / (1 - h.beta2**step) ** 0.5, h.eps, -(h.lr / (1 - h.beta1**step))]  # fmt: skip


def _step_lowbit(flat: torch.Tensor, g: torch.Tensor, state: dict[str, Any], h: _Hyper,
                 step: float, shape: torch.Size, native: _native.Steps | None) -> None:  # fmt: skip
    """AdamW on 8-bit or fp32 moments and an fp32 or bf16 parameter: the update of
    `torch.optim.AdamW` in fp32 with each operation rounded on its own (no fused multiply-add,
    a correctly rounded square root), on dequantized moments and an fp32 copy of a bf16
    parameter, written back in the state's formats. On a CPU by the native kernel where it
    builds, else per op, chunk by chunk: the same bits (Note: [The native host step])."""
    bf16 = flat.dtype == torch.bfloat16
    rounding = h.rounding if bf16 else None
    # the compensation of a Kahan step: kept with "kahan", else added in once and dropped
    kept = state.get("compensation") if bf16 else None
    if rounding is Bf16Rounding.KAHAN and kept is None:
        kept = state["compensation"] = flat.new_zeros(shape)
    compensation = None if kept is None else kept.view(-1)
    key = round_key(h.seed, int(step)) if rounding is Bf16Rounding.STOCHASTIC else 0
    quantized = "exp_avg_codes" in state
    if quantized:
        moments = tuple(state[f"{n}_{part}"] for n, _ in _MOMENTS for part in ("codes", "scales"))
    else:
        moments = tuple(state[n].view(-1) for n, _ in _MOMENTS)
    if native is not None and all(t.is_contiguous() for t in moments):
        flags = ((_native.PARAM_BF16 if bf16 else 0) | (_native.QUANTIZED if quantized else 0)
                 | (_native.STOCHASTIC if rounding is Bf16Rounding.STOCHASTIC else 0)
                 | (_native.KAHAN if rounding is Bf16Rounding.KAHAN else 0)
                 | (_native.ADD_COMP if compensation is not None else 0))  # fmt: skip
        # (the state may drop the compensation before the task runs: `native` holds it)
        native.add(flags, flat, g, moments, compensation, _scalars(h, step), key)
    else:
        chunk = _lowbit.chunk_elements()
        for lo in range(0, flat.numel(), chunk):
            _step_chunk(flat, g, moments, compensation, h, step, rounding, key, lo,
                        min(lo + chunk, flat.numel()))  # fmt: skip
    if kept is not None and rounding is not Bf16Rounding.KAHAN:
        del state["compensation"]


def _step_chunk(
    flat: torch.Tensor,
    g: torch.Tensor,
    moments: tuple[torch.Tensor, ...],
    compensation: torch.Tensor | None,
    h: _Hyper,
    step: float,
    rounding: Bf16Rounding | None,
    key: int,
    lo: int,
    hi: int,
) -> None:
    """Elements [lo, hi) of `_step_lowbit`, per op (``lo`` a multiple of BLOCK)."""
    decay, w1, beta2, w2, inv_bc2, eps, neg_step = _scalars(h, step)
    bf16 = flat.dtype == torch.bfloat16
    x = flat[lo:hi].float() if bf16 else flat[lo:hi]  # fp32: in place
    if compensation is not None:
        x.add_(compensation[lo:hi])
    gc = g[lo:hi].float()
    if len(moments) == 4:
        blocks = slice(lo // BLOCK, blocks_of(hi))
        codes = slice(blocks.start * BLOCK, blocks.stop * BLOCK)
        whole = [dequantize(moments[2 * k][codes], moments[2 * k + 1][blocks], signed)
                 for k, (_, signed) in enumerate(_MOMENTS)]  # fmt: skip
        m, v = (t[: hi - lo] for t in whole)
    else:
        m, v = (t[lo:hi] for t in moments)
    x.mul_(decay)
    m.add_(gc.sub(m).mul_(w1))
    v.mul_(beta2).add_(gc.mul(w2).mul_(gc))
    denom = sqrt_exact(v).mul_(inv_bc2).add_(eps)
    x.add_(m.div(denom).mul_(neg_step))
    if len(moments) == 4:
        for k, ((_, signed), t) in enumerate(zip(_MOMENTS, whole, strict=True)):
            t[hi - lo :] = 0  # the padding of a last short block
            quantize_(moments[2 * k][codes], moments[2 * k + 1][blocks], t, signed)
    if rounding is Bf16Rounding.STOCHASTIC:
        round_stochastic_(flat[lo:hi], x, key, lo)
    elif rounding is Bf16Rounding.KAHAN:
        assert compensation is not None
        round_compensated_(flat[lo:hi], compensation[lo:hi], x)
    elif bf16:
        flat[lo:hi].copy_(x)


def _adopt(p: torch.Tensor, saved: dict[str, Any], hyper: _Hyper, index: Any) -> dict[str, Any]:
    """A saved state (this class's or `torch.optim.AdamW`'s) for ``p``, its moments in the
    format ``hyper`` gives ``p``, on ``p``'s device; tensors keep their dtypes otherwise."""
    step = saved.get("step", 0.0)
    state: dict[str, Any] = {"step": torch.as_tensor(step, dtype=torch.float32).clone()}
    n = p.numel()
    for name, signed in _MOMENTS:
        if f"{name}_codes" in saved:
            # contiguous fp32 scales: the native step reads them by address (a float64 copy
            # of fp32 scales converts exactly)
            codes = saved[f"{name}_codes"].to(p.device).contiguous()
            scales = saved[f"{name}_scales"].to(p.device, torch.float32).contiguous()
            if (codes.dtype, codes.numel(), scales.numel()) != (torch.uint8, blocks_of(n) * BLOCK,
                                                                blocks_of(n)):  # fmt: skip
                raise ValueError(f"state of parameter {index}: {name}_codes does not fit it")
            if hyper.quantizes(p):
                state[f"{name}_codes"], state[f"{name}_scales"] = codes, scales
                continue
            values = dequantize(codes, scales, signed)[:n]
        elif name in saved:
            values = saved[name].to(p.device, torch.float32)
            if values.numel() != n:
                raise ValueError(f"state of parameter {index}: {name} does not fit it")
            values = values.reshape(-1)
        else:
            raise ValueError(f"state of parameter {index} has no {name}")
        if hyper.quantizes(p):
            nb = blocks_of(n)
            codes = torch.empty(nb * BLOCK, dtype=torch.uint8, device=p.device)
            scales = torch.empty(nb, dtype=torch.float32, device=p.device)
            chunk = _lowbit.chunk_elements()
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                blocks = slice(lo // BLOCK, blocks_of(hi))
                part = padded(values[lo:hi].contiguous())
                quantize_(codes[blocks.start * BLOCK : blocks.stop * BLOCK], scales[blocks],
                          part, signed)  # fmt: skip
            state[f"{name}_codes"], state[f"{name}_scales"] = codes, scales
        else:
            state[name] = values.reshape(p.shape).contiguous()
    if "compensation" in saved and p.dtype == torch.bfloat16:
        compensation = saved["compensation"]
        if compensation.numel() != n:
            raise ValueError(f"state of parameter {index}: compensation does not fit it")
        compensation = compensation.to(p.device, torch.bfloat16).reshape(p.shape)
        state["compensation"] = compensation.contiguous()
    return state
