"""Differential fuzzer: hypothesis draws a small model (`fuzz_models.py`), an engine at a
random budget and prefetch depth, and a sequence of what users do between calls and steps
(dtype conversion, in-place edits, reads for logging, state_dict save and load, both forms of
zero_grad, accumulation, param groups, an LR scheduler, deepcopy, remove() and apply again);
every output, loss, gradient and trained weight is compared bitwise (torch.equal) with the
same program run on a twin model without torchoffload. Where torchoffload refuses, the error
must be its own (raised in the package, a RuntimeError, ValueError or TypeError) and nothing
may have changed.

One state machine per engine (``make fuzz FUZZ_ENGINE=stream_weights`` runs one). The
"ci" profile (default) is small and derandomized; ``make fuzz`` runs the "fuzz" profile:
``FUZZ_EXAMPLES`` examples per engine (default 500), no deadline, random seeds, failures kept
in ``.hypothesis/``. ``KNOWN_BROKEN`` lists what issue 38 found and is being fixed: generation
skips those operations (``FUZZ_KNOWN_BROKEN=1`` draws them too; ``FUZZ_NO_SHRINK=1`` reports
the first failure as drawn, quickly). ``FUZZ_OPTIMIZERS=adamw8bit,lowprec_kahan`` draws only
those optimizer classes (keys of ``OPTIMIZERS``); the summary line counts the classes built.
The findings themselves are the corpus at the end of this file, each an ``xfail(strict=True)``
case of the same checks.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
import time
import traceback
from dataclasses import replace

import pytest
import torch
from fuzz_models import (
    MoESpec,
    SGDWritesGrad,
    Spec,
    build,
    build_moe,
    experts_517,
    loss_of,
    moe_specs,
    skips_sentinel,
    specs,
    tokens,
)
from hypothesis import HealthCheck, Phase, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import torchoffload as to
from torchoffload._hosted import HOSTED
from torchoffload.weights._syncs import HostReadInCapture

# - Profiles

FUZZ = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "fuzz"
_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
    print_blob=True,
)  # fmt: skip
if os.environ.get("FUZZ_NO_SHRINK"):  # while debugging: the first failure, as drawn
    _COMMON.update(phases=[Phase.explicit, Phase.reuse, Phase.generate], report_multiple_bugs=False)
CI = settings(derandomize=True, database=None, stateful_step_count=6, **_COMMON)
LONG = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "500")), stateful_step_count=14, **_COMMON
)


def profile(ci_examples: int) -> settings:
    return LONG if FUZZ else settings(CI, max_examples=ci_examples)


# - The device. The machines run on the CPU (CI, `make fuzz`); test_fuzz_gpu (`make fuzz-gpu`)
# runs them on a GPU, its copy streams slowed or not: both twins compute there under
# deterministic algorithms, the engines copy through pinned memory on their own streams (real
# CUDA graphs, events, the host step's overlap), and where the offloaded side steps with
# OffloadedOptimizer the reference steps host copies of the parameters with the plain class
# (``MasterRef(host=True)``), as the host step does: CUDA's and the CPU's kernels round apart.
DEVICE = torch.device("cpu")  # set by test_fuzz_gpu


def on_gpu() -> bool:
    return DEVICE.type != "cpu"


def inputs(spec, batch: int, seq: int, seed: int) -> torch.Tensor:
    return tokens(spec, batch, seq, seed).to(DEVICE)


# - Operations known broken and being fixed: (engine, operation) -> issue 38 item (negative:
# the fuzzer's NEW-n). Generation skips these until the fix merges; the corpus below holds each
# as an xfail(strict=True) case.
KNOWN_BROKEN: dict[tuple[str, str], int] = {}
if os.environ.get("FUZZ_KNOWN_BROKEN"):
    KNOWN_BROKEN = {}


EXAMPLES: dict[str, int] = {}  # examples run per engine, printed by `make fuzz`
OPERATIONS: dict[str, int] = {}  # operations compared (both sides ran, or a refusal checked)
REFUSED: dict[str, int] = {}
DRAWN: dict[str, dict[str, int]] = {}  # per engine, the optimizers built on both sides


def count(table: dict[str, int], engine: str) -> None:
    table[engine] = table.get(engine, 0) + 1


def broken(engine: str, op: str) -> bool:
    return (engine, op) in KNOWN_BROKEN or (engine, "*") in KNOWN_BROKEN


# - The checks


_PACKAGE = os.path.dirname(to.__file__) + os.sep


def clear_error(e: BaseException) -> bool:
    """A refusal: torchoffload's own RuntimeError, ValueError or TypeError, raised in the
    package (not an internal KeyError, nor torch failing on an empty placeholder)."""
    if not isinstance(e, (RuntimeError, ValueError, TypeError)):
        return False
    if "an earlier graph call of stream_experts routed" in str(e):
        return False  # a report (Note: [Routed outside a layer]): only `routed_outside` expects one
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE)


def assert_same(a, b, what: str) -> None:
    """Bitwise: dtype, shape and every element (torch.equal), through dicts, lists, tuples."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{what}: keys {a.keys()} vs {b}"
        for k in a:
            assert_same(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{what}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{what}: tensor vs {type(b).__name__}"
        if a.device != b.device:  # on a GPU, a host store's values against the device's
            a, b = a.cpu(), b.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{what}: plain {a.dtype}{list(a.shape)} vs offloaded {b.dtype}{list(b.shape)}"
        )
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            raise AssertionError(
                f"{what}: {int((a != b).sum())} of {a.numel()} elements differ, max abs diff "
                f"{diff.max().item():.6g}"
            )
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def values(model: torch.nn.Module) -> dict[str, object]:
    """Each tensor's values (of a tensor on meta, which has none: its dtype, shape and
    strides)."""
    return {k: (v.dtype, tuple(v.shape), v.stride()) if v.is_meta else v.detach().clone()
            for k, v in model.state_dict().items()}  # fmt: skip


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient (None where there is none; 'moved' where an OffloadedOptimizer
    took it to the host, which cannot be read)."""
    from torchoffload.optim import MovedGradError

    out: dict[str, object] = {}
    for name, p in model.named_parameters():
        try:
            out[name] = None if p.grad is None else p.grad.detach().clone()
        except MovedGradError:
            out[name] = "moved"
    return out


def same_grads(ref: dict, off: dict, what: str) -> None:
    assert ref.keys() == off.keys()
    for k in ref:
        if isinstance(off[k], str) or isinstance(ref[k], str):
            continue  # moved to the host by an OffloadedOptimizer: its step shows it
        a, b = ref[k], off[k]
        assert (a is None) == (b is None), f"{what} {k}: plain {a is None=}, offloaded {b is None=}"
        if a is not None:
            assert_same(a, b, f"{what} {k}")


def taken_by_the_worker(opt: to.OffloadedOptimizer) -> None:
    """Wait until the host step has taken every bucket sent to it: whether a step taken
    during backward wrote its gradients is then settled (Note: [Written gradients brought
    back]), not left to the worker's timing, and a drawn example that a later operation
    refuses is refused every time it runs (hypothesis requires the same draws)."""
    for bucket in opt._runtime.buckets:
        assert not bucket.dispatched or bucket.handled.wait(60), "the host step hangs"


def fails_alike(plain, error: BaseException) -> bool:
    """``plain()`` (the plain twin's side of an operation) raises ``error``'s type and message:
    torch's own refusal, as without torchoffload. Seen on a GPU: Adagrad built over a bf16
    model that was then converted (its state keeps bf16) fails in torch's foreach kernels, the
    default there, on both twins."""
    try:
        plain()
    except Exception as e:
        return type(e) is type(error) and str(e) == str(error)
    return False


class Refused(Exception):
    """The offloaded side refused the operation clearly and changed nothing."""


@contextlib.contextmanager
def refusal_allowed(snapshot):
    """Run the offloaded side's operation: a clear error leaves ``snapshot()`` as it was and
    becomes `Refused`; any other error is a finding."""
    before = snapshot()
    try:
        yield
    except Exception as e:
        if not clear_error(e):
            raise
        after = snapshot()
        assert_same(before, after, f"state after a refusal ({type(e).__name__}: {e})")
        raise Refused(str(e)) from e


# - Optimizers: the plain class, or for bf16 the class on fp32 masters as OffloadedOptimizer
# documents (the step is bitwise what the class computes on fp32 copies of the parameters).

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    # L2 weight decay added into p.grad in place (Note: [A class that writes its gradients]):
    # drawn where the offloaded side is an OffloadedOptimizer
    "sgd_writes_grad": (SGDWritesGrad, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    # low-precision state (the native host step: Note: [The native host step]), every tensor
    # in 8 bits; with a bf16 model, also on bf16 masters (``master_dtype``, drawn)
    "adamw8bit": (to.optim.AdamW8bit, dict(lr=1e-2, weight_decay=0.1, min_8bit_numel=1)),
    "lowprec_kahan": (
        to.optim.LowPrecisionAdamW,
        dict(lr=1e-2, weight_decay=0.1, bf16_rounding="kahan"),
    ),  # fmt: skip
}
WRITES_GRADS = {"sgd_writes_grad"}
# drawn where the offloaded side is an OffloadedOptimizer, for float32 and bfloat16 models
LOW_PRECISION = {"adamw8bit", "lowprec_kahan"}


def param_groups(model: torch.nn.Module, params, split: bool) -> list[dict]:
    """One group, or two (the blocks at another lr, the rest); ``params`` in the order of
    ``model.parameters()``."""
    params = list(params)
    if not split:
        return [{"params": params}]
    ids = {id(p) for p in model.blocks.parameters()}
    inside = [id(p) in ids for p in model.parameters()]
    blocks = [p for p, b in zip(params, inside, strict=True) if b]
    rest = [p for p, b in zip(params, inside, strict=True) if not b]
    return [g for g in ({"params": blocks, "lr": 0.02}, {"params": rest}) if g["params"]]


class MasterRef:
    """The plain class stepping fp32 copies of a bf16 model's parameters, rounded back into
    them, with torch.optim's API. A master is read again from its parameter after a write of
    that parameter outside the optimizer, as a user's loop over fp32 masters would. Views that
    ``model.to(dtype)`` gave storages of their own still share one version counter, so a
    counter that moved does not say which of them was written: the rules say it (`wrote`),
    and the counters check that none was left out (NEW-8: ``gate.mul_`` moved ``shift``'s
    counter, and the reference read ``shift``'s master again from its rounded value).

    Where the offloaded side cannot tell either, a counter shared by several parameters that
    are not streamed there (``twin``: the offloaded model), a parameter written is read again
    only if its bytes changed (Note: [Parameters that share a storage]): a write that left
    every byte as it was is no write there, and its fp32 master is kept."""

    def __init__(self, model, cls, kw, split, max_grad_norm=None, by_model=False, twin=None,
                 host=False, dtype=torch.float32):  # fmt: skip
        self.params = list(model.parameters())
        self.twin = None if twin is None else list(twin.parameters())
        # ``host``: masters in host memory (on a GPU, as the host step keeps them); ``dtype``:
        # theirs (bf16 masters: the parameters' own bits)
        self.masters = [p.detach().to("cpu" if host else p.device, dtype, copy=True)
                        for p in self.params]  # fmt: skip
        self.opt = cls(param_groups(model, self.masters, split), **kw)
        self.shared = shared_counters(self.params)
        self.versions = [p._version for p in self.params]
        self.written: set[int] = set()
        self.max_grad_norm = max_grad_norm
        self.by_model = by_model

    @property
    def param_groups(self):
        return self.opt.param_groups

    def told_apart(self, i: int) -> bool:
        """The offloaded side knows whether parameter ``i`` itself was written: it is alone on
        its version counter, or streamed there (its host store counts the writes of it)."""
        return len(self.shared[i]) == 1 or (self.twin is not None and self.twin[i] in HOSTED)

    def wrote(self, params) -> None:
        """``params`` were written outside the optimizer: their masters are read again."""
        self.written.update(id(p) for p in params)

    def follow(self):
        """Read again the master of every parameter written since the last step."""
        for i, (m, p) in enumerate(zip(self.masters, self.params, strict=True)):
            if id(p) in self.written:
                if not self.told_apart(i) and same_bytes(p.detach().cpu(), m.to(p.dtype).cpu()):
                    continue
                m.copy_(p.detach())
            elif p._version != self.versions[i]:
                assert self.shared[i] & self.written, (
                    f"parameter {i} was written outside the optimizer by a rule that did not "
                    "call MasterRef.wrote"
                )
        self.versions = [p._version for p in self.params]
        self.written.clear()

    def step(self):
        self.follow()
        for m, p in zip(self.masters, self.params, strict=True):
            m.grad = None if p.grad is None else p.grad.to(m.device, m.dtype)
        if self.max_grad_norm is not None:
            given = [m for g in self.opt.param_groups for m in g["params"]]
            order = self.masters if self.by_model else given
            torch.nn.utils.clip_grad_norm_(order, self.max_grad_norm)
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params, strict=True):
                p.copy_(m)
        self.versions = [p._version for p in self.params]  # after all: views share a counter

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self):
        """The masters too, as OffloadedOptimizer's state dict holds them: read again first
        from a parameter written outside, as the next step would (they round to the
        parameters)."""
        self.follow()
        return {"opt": self.opt.state_dict(), "masters": [m.clone() for m in self.masters]}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["opt"])
        for m, saved in zip(self.masters, sd["masters"], strict=True):
            m.copy_(saved)
        self.versions = [p._version for p in self.params]
        self.written.clear()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


def shared_counters(params: list[torch.Tensor]) -> list[set[int]]:
    """For each parameter, the ids of the parameters that share its version counter (itself
    included), found by bumping each counter (no value changes)."""
    out = []
    for p in params:
        before = [q._version for q in params]
        torch.autograd.graph.increment_version(p)
        out.append({id(q) for q, b in zip(params, before, strict=True) if q._version != b})
    return out


class PlainRef:
    """torch.optim's class, with clip_grad_norm_ before the step where asked: over the
    parameters in the order the optimizer was given them, or (``by_model``: an
    OffloadedOptimizer given ``model=``) in ``model.parameters()`` order (Note: [The order of
    the clipping norm])."""

    def __init__(self, model, cls, kw, split, max_grad_norm=None, by_model=False):
        self.model = model
        self.opt = cls(param_groups(model, model.parameters(), split), **kw)
        self.max_grad_norm = max_grad_norm
        self.by_model = by_model

    @property
    def param_groups(self):
        return self.opt.param_groups

    def step(self):
        if self.max_grad_norm is not None:
            given = [p for g in self.param_groups for p in g["params"]]
            order = self.model.parameters() if self.by_model else given
            torch.nn.utils.clip_grad_norm_(order, self.max_grad_norm)
        self.opt.step()

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd)


def residents(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """Resident patterns that match something in ``model``."""
    names = set(model.state_dict())
    pats = [("emb",), ("head",), ("blocks.0",), ("blocks.0", "norm"), ("norm",)]
    return [()] + [p for p in pats if all(any(f"{q}." in f".{n}." for n in names) for q in p)]


def least_parameter_budget(model, unit, resident) -> int:
    """stream_parameters' minimum (its largest unit), from its own refusal of 1 byte."""
    import re

    try:
        to.stream_parameters(copy.deepcopy(model), budget_bytes=1, unit=unit, device=DEVICE,
                             resident=resident).remove()  # fmt: skip
    except ValueError as e:
        found = re.search(r"\((\d+) bytes", str(e))
        if found:
            return int(found.group(1))
    return 1


# - Training engines


class Side:
    def __init__(self, model):
        self.model = model
        self.handle = None
        self.opt = None
        self.sched = None
        self.context = contextlib.nullcontext


class TrainingMachine(RuleBasedStateMachine):
    """Training with one engine on the offloaded twin, an optimizer on each side."""

    ENGINE = ""
    DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16")
    OFFLOADED_OPTIMIZER = False  # the offloaded side steps with OffloadedOptimizer

    def op_ok(self, op: str) -> bool:
        return not broken(self.ENGINE, op)

    def can(self, op: str) -> bool:
        """Rule ``op`` may run: the example goes on, no conversion waits for its step, and
        ``op`` is not known broken for this engine."""
        return not self.stopped and not self.pending and self.op_ok(op)

    # -- setup
    @initialize(data=st.data())
    def setup(self, data):
        EXAMPLES[self.ENGINE] = EXAMPLES.get(self.ENGINE, 0) + 1
        self.opt_config = {}
        self.writes_grads = False  # the optimizer class writes its gradients
        self.touched = False  # parameters changed outside the optimizer since its last step
        self.raised = False  # the last forward and backward was refused (NEW-11)
        self.stopped = False
        self.pending = False  # a conversion whose effect the next step shows
        self.steps = 0
        self.final_pending = False
        self.backed = False  # a backward since the last step(), for the `step` rule
        self.copies = []
        spec: Spec = data.draw(specs(dtypes=self.DTYPES, dropout=True), label="spec")
        self.spec = spec
        self.ref, self.off = Side(build(spec).to(DEVICE)), Side(build(spec).to(DEVICE))
        self.data = data
        self.draw_engine(data)
        try:
            with refusal_allowed(lambda: values(self.off.model)):
                self.apply_engine()
        except Refused:
            self.stopped = True
            return
        names = [n for n in sorted(OPTIMIZERS) if self.OFFLOADED_OPTIMIZER or n not in WRITES_GRADS]
        if not self.OFFLOADED_OPTIMIZER or spec.dtype not in ("float32", "bfloat16"):
            names = [n for n in names if n not in LOW_PRECISION]
        if os.environ.get("FUZZ_OPTIMIZERS"):  # e.g. "adamw8bit,lowprec_kahan": only those
            names = [n for n in names if n in os.environ["FUZZ_OPTIMIZERS"].split(",")]
            assume(names)
        name = data.draw(st.sampled_from(names), label="optimizer")
        cls, kw = OPTIMIZERS[name]
        self.opt_cls, self.opt_kw = cls, kw
        self.writes_grads = name in WRITES_GRADS
        self.low_precision = name in LOW_PRECISION
        self.split = data.draw(st.booleans(), label="param groups")
        self.max_grad_norm = None
        self.by_model = False  # the OffloadedOptimizer is given model=
        self.build_optimizers(data)
        if self.stopped:
            return
        if data.draw(st.booleans(), label="scheduler"):
            for side in (self.ref, self.off):
                opt = side.opt.opt if isinstance(side.opt, (PlainRef, MasterRef)) else side.opt
                side.sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    def draw_engine(self, data):
        pass

    def apply_engine(self):
        pass

    def remove_engine(self):
        if self.off.handle is not None:
            self.off.handle.remove()
            self.off.handle = None

    @property
    def bf16_masters(self) -> bool:
        return self.opt_config.get("master_dtype") == torch.bfloat16

    def ref_optimizer(self):
        dtype = self.spec.torch_dtype
        if self.OFFLOADED_OPTIMIZER and on_gpu():
            return MasterRef(self.ref.model, self.opt_cls, self.opt_kw, self.split,
                             self.max_grad_norm, self.by_model, self.off.model, host=True,
                             dtype=dtype if self.bf16_masters else torch.float32)  # fmt: skip
        if self.OFFLOADED_OPTIMIZER and dtype == torch.bfloat16 and not self.bf16_masters:
            return MasterRef(self.ref.model, self.opt_cls, self.opt_kw, self.split,
                             self.max_grad_norm, self.by_model, self.off.model)  # fmt: skip
        return PlainRef(self.ref.model, self.opt_cls, self.opt_kw, self.split, self.max_grad_norm,
                        self.by_model)  # fmt: skip

    def off_optimizer(self):
        if not self.OFFLOADED_OPTIMIZER:
            return PlainRef(self.off.model, self.opt_cls, self.opt_kw, self.split)
        m = self.off.model
        cfg = dict(self.opt_config)
        if self.by_model:
            cfg["model"] = m
        return to.OffloadedOptimizer(param_groups(m, m.parameters(), self.split), self.opt_cls,
                                     **self.opt_kw, **cfg)  # fmt: skip

    def build_optimizers(self, data):
        self.opt_config = {}
        if self.OFFLOADED_OPTIMIZER:
            self.opt_config = data.draw(self.optimizer_configs(), label="offload config")
            self.max_grad_norm = self.opt_config.get("max_grad_norm")
            # model= is needed by step_ahead, and sets the order of the clipping norm
            self.by_model = bool(self.opt_config.get("step_ahead")) or (
                self.max_grad_norm is not None and data.draw(st.booleans(), label="model=")
            )
            if self.max_grad_norm is not None and not self.op_ok("clip_group_order"):
                self.split = False
            if (self.spec.shared_storage and self.spec.dtype == "bfloat16"
                    and not self.op_ok("split_bf16_views")):  # fmt: skip
                self.opt_config.pop("offload_fraction", None)
                self.opt_config["bucket_bytes"] = None
            if (self.low_precision and self.spec.dtype == "bfloat16"
                    and data.draw(st.booleans(), label="bf16 masters")):  # fmt: skip
                # the plain class steps the bf16 parameters themselves (PlainRef)
                self.opt_config["master_dtype"] = torch.bfloat16
                self.opt_config.pop("offload_fraction", None)  # refused with bf16 masters
        self.ref.opt = self.ref_optimizer()
        try:
            with refusal_allowed(lambda: values(self.off.model)):
                self.off.opt = self.off_optimizer()
        except Refused:
            self.stopped = True
            return
        drawn = DRAWN.setdefault(self.ENGINE, {})
        name = self.opt_cls.__name__ + (" bf16 masters" if self.bf16_masters else "")
        drawn[name] = drawn.get(name, 0) + 1

    def optimizer_configs(self):
        return st.fixed_dictionaries(
            {"bucket_bytes": st.sampled_from([None, 64, 1024, 1 << 20])},
            optional={"overlap": st.booleans(), "convert_on": st.sampled_from(["device", "host"])},
        )

    # -- helpers
    def read_state(self, side: Side) -> dict:
        if (side is self.off and self.step_ahead and side.opt is not None
                and broken(self.ENGINE, "step_ahead_read")):  # fmt: skip
            side.opt.synchronize()
        return values(side.model)

    @property
    def step_ahead(self) -> bool:
        return bool(self.OFFLOADED_OPTIMIZER and self.opt_config.get("step_ahead"))

    def snapshot(self):
        # the values; not the gradients: a backward that raises keeps those it accumulated,
        # as in plain PyTorch
        return self.read_state(self.off)

    def both(self, fn, what: str):
        """``fn(side)`` on the offloaded side first, then (unless it refused) on the plain one;
        their results must be the same."""
        if self.step_ahead and self.off.opt is not None and broken(self.ENGINE, "step_ahead_read"):
            self.off.opt.synchronize()  # item 6: reads outside forward do not finish the step
        count(OPERATIONS, self.ENGINE)
        try:
            with refusal_allowed(self.snapshot):
                got = fn(self.off)
        except Refused:
            count(REFUSED, self.ENGINE)
            if self.pending:
                self.stopped = True  # the plain twin converted: the two have parted
            return None
        except Exception as e:
            if not fails_alike(lambda: fn(self.ref), e):
                raise
            self.stopped = True  # plain PyTorch raises the same error: the example ends
            return None
        want = fn(self.ref)
        assert_same(want, got, what)
        return want

    def forward(self, side: Side, x, seed: int, accumulate: bool):
        torch.manual_seed(seed)
        ctx = side.context()
        acc = (side.opt.accumulating() if accumulate and isinstance(side.opt, to.OffloadedOptimizer)
               else contextlib.nullcontext())  # fmt: skip
        with acc:
            with ctx:
                out = side.model(x)
                loss = loss_of(out, x)
            try:
                loss.backward()
            finally:
                if self.writes_grads and isinstance(side.opt, to.OffloadedOptimizer):
                    taken_by_the_worker(side.opt)
        return out.detach(), loss.detach()

    def draw_input(self, data):
        batch = data.draw(st.integers(1, 3), label="batch")
        seq = data.draw(st.integers(1, 5), label="seq")
        return inputs(self.spec, batch, seq, data.draw(st.integers(0, 99), label="input seed"))

    # -- rules
    def live(self) -> bool:
        return not self.stopped

    @precondition(lambda self: self.stopped)
    @rule()
    def refused(self):
        """A clear refusal ended the example (the twins have parted)."""

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def train_step(self, data):
        x = self.draw_input(data)
        seed = data.draw(st.integers(0, 99), label="rng")
        self.raised = self.both(lambda s: self.forward(s, x, seed, False), "output, loss") is None
        if self.raised:
            return
        self.pending = False
        same_grads(grads(self.ref.model), grads(self.off.model), "gradient")
        self.step_and_zero(data)

    @precondition(lambda self: self.live() and not self.pending and self.backed
                  and not self.raised)  # fmt: skip
    @rule(data=st.data())
    def step(self, data):
        """`step()` right after a backward, its gradients unread, whatever came between (an
        edit, a read, a schedule): Note: [Written after its gradient left]. Not after a
        backward that raised: a second backward over streamed parameters is refused part-way,
        after some gradients accumulated (a known gap), and the plain twin did not run it."""
        self.step_and_zero(data)

    def step_and_zero(self, data):
        self.backed = False
        if self.both(lambda s: s.opt.step(), "step") is None and self.stopped:
            return
        self.steps += 1
        self.touched = False
        forms = ["set_to_none"]
        if self.op_ok("zero_grad_zeros"):
            forms.append("zeros")
        if self.op_ok("skip_zero_grad"):
            forms.append("skip")
        form = data.draw(st.sampled_from(forms), label="zero_grad")
        if form != "skip":
            self.both(lambda s: s.opt.zero_grad(set_to_none=form == "set_to_none"), "zero_grad")

    @precondition(lambda self: self.live() and not self.pending)
    @rule(data=st.data())
    def accumulate(self, data):
        """A backward whose gradients are accumulated by the next (inside accumulating())."""
        x = self.draw_input(data)
        seed = data.draw(st.integers(0, 99), label="rng")
        out = self.both(lambda s: self.forward(s, x, seed, True), "accumulated output, loss")
        self.raised = out is None
        self.backed = not self.raised

    @precondition(lambda self: self.live() and not self.pending)
    @rule(data=st.data())
    def backward(self, data):
        """A plain backward that the next one accumulates into (no accumulating(): how
        torchao's tests and accelerate accumulate; issue 40)."""
        x = self.draw_input(data)
        seed = data.draw(st.integers(0, 99), label="rng")
        out = self.both(lambda s: self.forward(s, x, seed, False), "plain backward")
        self.raised = out is None
        self.backed = not self.raised

    @precondition(lambda self: self.live() and not self.pending)
    @rule(data=st.data())
    def zero_grad(self, data):
        forms = [True] + ([False] if self.op_ok("zero_grad_zeros") else [])
        set_to_none = data.draw(st.sampled_from(forms), label="set_to_none")
        self.backed = False
        self.both(lambda s: s.opt.zero_grad(set_to_none=set_to_none), "zero_grad")

    @precondition(lambda self: self.live() and not self.pending)
    @rule()
    def lr_schedule(self):
        if self.ref.sched is not None:
            self.both(lambda s: s.sched.step(), "scheduler")

    @precondition(lambda self: self.can("edit"))
    @rule(data=st.data())
    def edit(self, data):
        """In-place edits of a parameter under no_grad, as manual weight decay or clamping do."""
        if self.raised and not self.op_ok("write_after_failed_backward"):
            return
        names = [n for n, _ in self.ref.model.named_parameters()]
        if (self.spec.shared_storage and self.spec.dtype == "bfloat16"
                and not self.op_ok("edit_shared_counter")):  # fmt: skip
            names = [n for n in names if not n.endswith((".gate", ".shift"))
                     or self.off.model.get_parameter(n) in HOSTED]  # fmt: skip
        name = data.draw(st.sampled_from(names), label="parameter")
        how = data.draw(st.sampled_from(["mul", "clamp", "add", "copy"]), label="edit")

        def fn(side):
            p = side.model.get_parameter(name)
            with torch.no_grad():
                if how == "mul":
                    p.mul_(0.9)
                elif how == "clamp":
                    p.clamp_(-0.2, 0.2)
                elif how == "add":
                    p.add_(0.01)
                else:
                    p.copy_(torch.full(p.shape, 0.125, dtype=p.dtype, device=p.device))
            if isinstance(side.opt, MasterRef):
                side.opt.wrote([p])

        self.touched = True
        self.both(fn, f"edit {how} {name}")

    @precondition(lambda self: self.can("set_grad"))
    @rule(data=st.data())
    def set_grad(self, data):
        """``p.grad = None`` (a parameter skipped this step) or ``p.grad = <a tensor>`` between
        a backward and `step()`, without reading the gradient (Note: [A gradient set after it
        left])."""
        names = [n for n, _ in self.ref.model.named_parameters()]
        name = data.draw(st.sampled_from(names), label="parameter")
        how = data.draw(st.sampled_from(["none", "replace"]), label="grad")

        def fn(side):
            p = side.model.get_parameter(name)
            p.grad = (None if how == "none"
                      else torch.full(p.shape, 0.01, dtype=p.dtype, device=p.device))  # fmt: skip

        self.both(fn, f"{name}.grad = {how}")

    @precondition(lambda self: self.can("read"))
    @rule()
    def read(self):
        """What logging reads: each parameter's norm, and the sum of squares (an L2 term)."""

        def fn(side):
            with torch.no_grad():
                return [p.float().norm() for p in side.model.parameters()]

        self.both(fn, "p.norm()")

    @precondition(lambda self: self.live() and not self.pending)
    @rule(data=st.data())
    def save_and_load(self, data):
        """torch.save of the state_dict, torch.load, load_state_dict; the optimizer's too."""
        optimizer_too = data.draw(st.booleans(), label="optimizer state too")
        if self.raised and not self.op_ok("write_after_failed_backward"):
            return

        self.touched = True

        def fn(side):
            buf = io.BytesIO()
            torch.save(side.model.state_dict(), buf)
            buf.seek(0)
            side.model.load_state_dict(torch.load(buf))
            if isinstance(side.opt, MasterRef):
                side.opt.wrote(side.model.parameters())

        self.both(fn, "save and load")
        if optimizer_too and not self.stopped:  # on its own: a refusal here skips only this
            self.both(lambda s: s.opt.load_state_dict(copy.deepcopy(s.opt.state_dict())),
                      "the optimizer's state_dict saved and loaded")  # fmt: skip

    @precondition(lambda self: self.steps == 0 and self.can("convert"))
    @rule(data=st.data())
    def convert(self, data):
        """model.to(dtype) before the first step (an optimizer built over the parameters)."""
        others = [
            d for d in (torch.float32, torch.float64, torch.bfloat16) if d != self.spec.torch_dtype
        ]
        dtype = data.draw(st.sampled_from(others), label="dtype")
        self.pending = True
        self.both(lambda s: s.model.to(dtype) and None, f"to({dtype})")

    @precondition(lambda self: self.can("deepcopy_step_ahead" if self.step_ahead else "deepcopy"))
    @rule(data=st.data())
    def deepcopy(self, data):
        """copy.deepcopy(model) (an EMA copy): a plain copy with the real values, or refused."""
        x = self.draw_input(data)

        def fn(side):
            c = copy.deepcopy(side.model)
            torch.manual_seed(0)
            with torch.no_grad():
                out = c(x)
            side.copies = [*getattr(side, "copies", []), (c, x)]
            return values(c), out

        self.both(fn, "deepcopy")

    @precondition(lambda self: self.live() and not self.pending)
    @rule()
    def remove_and_apply_again(self):
        if self.touched and self.spec.dtype == "bfloat16" and not self.op_ok("stale_master"):
            return  # NEW-5: the old optimizer's state_dict() holds the masters before the edit

        def fn(side):
            if side is self.off:
                self.reapply()
            for c, x in getattr(side, "copies", []):  # copies made before run on their own
                torch.manual_seed(0)
                with torch.no_grad():
                    c(x)

        self.both(fn, "remove() and apply again")

    def reapply(self):
        self.remove_engine()
        self.apply_engine()

    def load_or_stop(self, sd):
        """A refused load leaves a new optimizer without the old state: the twins part."""
        try:
            self.off.opt.load_state_dict(sd)
        except Exception:
            self.stopped = True
            raise

    @invariant()
    def same_state(self):
        if self.stopped or self.pending or not hasattr(self, "ref"):
            return
        assert_same(self.read_state(self.ref), self.read_state(self.off), "state")

    def teardown(self):
        with contextlib.suppress(Exception):
            if isinstance(getattr(self.off, "opt", None), to.OffloadedOptimizer):
                self.off.opt.remove()
        with contextlib.suppress(Exception):
            self.remove_engine()


class Activations(TrainingMachine):
    ENGINE = "activations"

    def draw_engine(self, data):
        kw = data.draw(st.fixed_dictionaries({
            "min_bytes": st.sampled_from([0, 64, 1 << 16]),
            "use_streams": st.booleans(),
            "prefetch_bytes": st.sampled_from([1, 256, 32 << 20]),
            "max_inflight_bytes": st.sampled_from([1, 1024, 256 << 20]),
        }), label="offload_activations")  # fmt: skip
        self.off.context = lambda: to.offload_activations(**kw)


class Layers(TrainingMachine):
    ENGINE = "layers"

    def draw_engine(self, data):
        n = self.spec.layers
        self.layer_config = to.ActivationOffloadConfig(
            prefetch_layers=data.draw(st.integers(0, n + 1), label="prefetch_layers"),
            defer_layers=data.draw(st.integers(0, n + 1), label="defer_layers"),
            skip_last_layers=data.draw(st.integers(0, n), label="skip_last_layers"),
            max_offload_bytes=data.draw(st.sampled_from([None, 0, 64, 4096]), label="budget"),
            min_bytes=data.draw(st.sampled_from([0, 64, 1 << 16]), label="min_bytes"),
            budget_policy=data.draw(st.sampled_from(["spread", "largest", "earliest"])),
            offload_outside_layers=data.draw(st.booleans(), label="outside layers"),
        )

    def apply_engine(self):
        m = self.off.model
        self.off.handle = to.apply_activation_offloading(m, layers=m.blocks,
                                                         config=self.layer_config)  # fmt: skip


_PLANS: dict[Spec, to.Plan] = {}


class Plans(TrainingMachine):
    """A plan traced once for the model, with random per-layer decisions (keep, offload,
    recompute, recompute+offload, or a "stream" plan) and prefetch/defer depths."""

    ENGINE = "plan"
    DTYPES = ("float32", "bfloat16")

    def draw_engine(self, data):
        spec = self.spec
        if spec not in _PLANS:
            if len(_PLANS) > 64:
                _PLANS.clear()
            x = tokens(spec, 2, 4, 0)
            m = build(spec)
            _PLANS[spec] = to.plan(m, (x,), budget_bytes=None, layers=m.blocks, min_bytes=0,
                                   loss_fn=lambda o: o.float().sum(), optimizer_state="device",
                                   parameters="device")  # fmt: skip
        base = _PLANS[spec]
        n = spec.layers
        if data.draw(st.booleans(), label="stream plan"):
            decisions = ("stream",) * n
        else:
            choice = st.sampled_from(["keep", "offload", "recompute", "recompute+offload"])
            decisions = tuple(data.draw(st.lists(choice, min_size=n, max_size=n)))
        prefetch = data.draw(st.integers(0, n + 1), label="prefetch")
        defer = data.draw(st.integers(0, n + 1), label="defer")
        self.plan = replace(base, decisions=decisions, prefetch_layers=prefetch, defer_layers=defer)

    def apply_engine(self):
        m = self.off.model
        self.off.handle = self.plan.apply(m, layers=m.blocks)


class Optimizer(TrainingMachine):
    """OffloadedOptimizer against torch.optim's class (on fp32 masters for bf16)."""

    ENGINE = "optimizer"
    OFFLOADED_OPTIMIZER = True
    DTYPES = ("float32", "bfloat16", "float32", "bfloat16", "float64")  # float64: refused

    def optimizer_configs(self):
        clip = st.sampled_from([None, 0.05, 1.0])
        host = st.fixed_dictionaries(
            {
                "bucket_bytes": st.sampled_from([None, 64, 1024]),
                "max_grad_norm": clip,
                "step_ahead": st.booleans(),
            },
            optional={"overlap": st.booleans(), "convert_on": st.sampled_from(["device", "host"])},
        )
        if on_gpu():  # a device part steps with CUDA's kernels, the reference on the host's
            return host
        return st.one_of(
            host,
            st.fixed_dictionaries({"offload_fraction": st.sampled_from([0.25, 0.5, 0.75]),
                                   "bucket_bytes": st.sampled_from([None, 64, 1024]),
                                   "step_ahead": st.booleans()}),
        )  # fmt: skip

    def reapply(self):
        """opt.remove(), then a new OffloadedOptimizer loaded with the old one's state."""
        sd = self.off.opt.state_dict()
        self.off.opt.remove()
        self.off.opt = None  # until the new one is built (a refusal ends the example)
        self.stopped = True  # unless the new optimizer is built and loaded
        self.off.opt = self.off_optimizer()
        self.load_or_stop(sd)
        self.stopped = False
        if self.off.sched is not None:
            self.off.sched.optimizer = self.off.opt

    @precondition(lambda self: self.ENGINE == "optimizer" and self.live() and not self.pending)
    @rule(data=st.data())
    def freeze(self, data):
        """requires_grad turned off or on after the optimizer was built (freezing a layer,
        BitFit): torch.optim steps whatever has a gradient (issue 40)."""
        names = [n for n, _ in self.ref.model.named_parameters()]
        name = data.draw(st.sampled_from(names), label="parameter")
        on = data.draw(st.booleans(), label="requires_grad")

        def fn(side):
            side.model.get_parameter(name).requires_grad_(on)

        self.both(fn, f"requires_grad_({on}) {name}")

    @precondition(lambda self: self.can("edit_groups"))
    @rule(data=st.data())
    def edit_groups(self, data):
        """``optimizer.param_groups`` edited as a loop might: assigned a new list of the
        groups with another lr (followed), or a parameter dropped from a group or a group
        deleted (torch.optim no longer steps them; refused from the next backward, step() or
        zero_grad() on: Note: [The param groups the host steps]). Made right after a
        backward, an edit races the host's steps taken during it (a deleted group failed one
        with an IndexError)."""
        how = data.draw(st.sampled_from(["new lr", "drop", "delete group"]),
                        label="param_groups edit")  # fmt: skip
        if how == "delete group":
            if len(self.ref.opt.param_groups) < 2:
                return
            g = data.draw(st.integers(0, len(self.ref.opt.param_groups) - 1), label="group")
        if how == "drop":  # from a group that has a parameter left (an earlier drop emptied some)
            full = [i for i, group in enumerate(self.ref.opt.param_groups) if group["params"]]
            if not full:
                return
            g = data.draw(st.sampled_from(full), label="group")
            k = data.draw(st.integers(0, len(self.ref.opt.param_groups[g]["params"]) - 1),
                          label="parameter")  # fmt: skip

        def fn(side):
            opt = side.opt.opt if isinstance(side.opt, (PlainRef, MasterRef)) else side.opt
            if how == "new lr":
                opt.param_groups = [{**group, "lr": group["lr"] * 0.5}
                                    for group in opt.param_groups]  # fmt: skip
            elif how == "delete group":
                del opt.param_groups[g]
            else:
                opt.param_groups[g]["params"].pop(k)

        self.both(fn, f"param_groups: {how}")


class StreamParameters(Optimizer):
    """stream_parameters with an OffloadedOptimizer, against the resident model and
    torch.optim's class."""

    ENGINE = "stream_parameters"

    def draw_engine(self, data):
        m = self.off.model
        kinds = ["blocks", "leaves"] if self.spec.layers > 1 else ["leaves"]
        if self.spec.norm == "rms" and self.spec.residual and not self.op_ok("rms_norm_leaves"):
            kinds = [k for k in kinds if k == "blocks"]
        if self.spec.transposed and not self.op_ok("foreign_read"):
            kinds = [k for k in kinds if k == "blocks"]
        assume(kinds)
        unit = data.draw(st.sampled_from(kinds), label="unit")
        resident = data.draw(st.sampled_from(residents(m)), label="resident")
        largest = least_parameter_budget(m, unit, resident)
        total = sum(p.numel() * p.element_size() for p in m.parameters())
        frac = data.draw(st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0]), label="budget")
        self.stream_kw = dict(
            budget_bytes=int(largest + frac * max(total - largest, 0)), unit=unit,
            prefetch_depth=data.draw(st.integers(0, 3), label="prefetch_depth"),
            resident=resident, use_streams=data.draw(st.booleans(), label="use_streams"),
        )  # fmt: skip

    def optimizer_configs(self):
        return st.fixed_dictionaries(
            {"bucket_bytes": st.sampled_from([None, 64, 1024]),
             "max_grad_norm": st.sampled_from([None, 0.05, 1.0])},
            optional={"overlap": st.booleans()},
        )  # fmt: skip

    def apply_engine(self):
        self.off.handle = to.stream_parameters(self.off.model, device=DEVICE, **self.stream_kw)

    def reapply(self):
        sd = self.off.opt.state_dict()
        self.off.opt.remove()
        self.off.opt = None  # until the new one is built (a refusal ends the example)
        self.stopped = True  # unless the engine is applied again and the optimizer loaded
        self.remove_engine()
        self.apply_engine()
        self.off.opt = self.off_optimizer()
        self.load_or_stop(sd)
        self.stopped = False
        if self.off.sched is not None:
            self.off.sched.optimizer = self.off.opt


# - Inference engines


class InferenceMachine(RuleBasedStateMachine):
    """stream_weights on the offloaded twin (eagerly, or through handle.cuda_graph), calls
    under no_grad or inference_mode with other shapes in between."""

    ENGINE = "stream_weights"
    last_refusal: BaseException | None = None  # the cause of the last Refused

    def op_ok(self, op: str) -> bool:
        return not broken(self.ENGINE, op)

    def can(self, op: str) -> bool:
        """Rule ``op`` may run: the example goes on, no conversion waits for its step, and
        ``op`` is not known broken for this engine."""
        return not self.stopped and not self.pending and self.op_ok(op)

    @initialize(data=st.data())
    def setup(self, data):
        EXAMPLES[self.ENGINE] = EXAMPLES.get(self.ENGINE, 0) + 1
        self.stopped = False
        self.pending = False
        spec = data.draw(specs(), label="spec")
        self.spec = spec
        self.handle = None
        self.ref, self.off = build(spec).eval().to(DEVICE), build(spec).eval()  # off: host
        depth = data.draw(st.integers(0, 3), label="prefetch_depth")
        units = [None, "blocks", "leaves"] if spec.layers > 1 else [None, "leaves"]
        if spec.transposed and not self.op_ok("foreign_read"):
            units = ["blocks"] if spec.layers > 1 else []
        assume(units)
        unit = data.draw(st.sampled_from(units), label="unit")
        resident = data.draw(st.sampled_from(residents(self.off)), label="resident")
        try:
            with refusal_allowed(lambda: values(self.off)):
                least = to.minimum_budget(self.off, prefetch_depth=depth, resident=resident,
                                          unit=unit)  # fmt: skip
        except Refused:
            self.stopped = True
            return
        total = sum(t.numel() * t.element_size() for t in self.off.state_dict().values())
        frac = data.draw(st.sampled_from([0.0, 0.05, 0.3, 1.0, 3.0]), label="budget")
        self.kw = dict(budget_bytes=int(least + frac * max(total - least, 0)),
                       prefetch_depth=depth, unit=unit, resident=resident,
                       use_streams=data.draw(st.booleans(), label="use_streams"))  # fmt: skip
        self.load = {}  # what the first apply reads its weights from
        source = data.draw(st.sampled_from(["model", "model", "checkpoint", "partial checkpoint",
                                            "checkpoint, on meta"]), label="weights")  # fmt: skip
        if source != "model":
            self.from_checkpoint(data, meta=source.endswith("meta"), partial="partial" in source)
        self.start()

    def from_checkpoint(self, data, *, meta: bool, partial: bool):
        """``stream_weights(checkpoint=)``: the plain model's weights saved as safetensors, read
        into the offloaded twin built on meta, or real with other values (every one must be
        overwritten); a checkpoint without one tensor of a real model is refused (strict), or
        with ``strict=False`` that tensor keeps its own values, as torch's load does."""
        import tempfile

        from test_weights_checkpoint import save, unique_state

        state = {k: v.detach().cpu().clone() for k, v in unique_state(self.ref).items()}
        if partial:
            dropped = data.draw(st.sampled_from(sorted(state)), label="left out")
            state.pop(dropped)
        path = save(state, os.path.join(tempfile.mkdtemp(prefix="fuzz-ckpt-"), "m.safetensors"))
        if meta:
            with torch.device("meta"):
                self.off = build(self.spec).eval()
        else:
            with torch.no_grad():
                for t in self.off.state_dict().values():
                    t.copy_(torch.full_like(t, 3))
        self.load = dict(checkpoint=path)
        if partial and data.draw(st.booleans(), label="strict=False"):
            self.load["strict"] = False
            with torch.no_grad():  # the plain twin takes the checkpoint as torch loads it
                for t in self.ref.state_dict().values():
                    t.copy_(torch.full_like(t, 3))
                self.ref.load_state_dict(state, strict=False)

    def stream_kw(self) -> dict:
        """The engine's arguments; the checkpoint is read by the first apply only (a later one
        streams the model as it is then)."""
        kw, self.load = {**self.kw, **self.load}, {}
        return kw

    def start(self):
        """Apply the engine; a clear refusal ends the example (nothing changed)."""
        try:
            with refusal_allowed(lambda: values(self.off)):
                self.apply()
        except Refused:
            self.stopped = True

    def apply(self):
        self.handle = to.stream_weights(self.off, DEVICE, **self.stream_kw())
        self.call = self.off

    def live(self):
        return not self.stopped

    @precondition(lambda self: self.stopped)
    @rule()
    def refused(self):
        """A clear refusal ended the example."""

    def both(self, fn, what):
        count(OPERATIONS, self.ENGINE)
        try:
            with refusal_allowed(lambda: values(self.off)):
                got = fn(self.off, self.call)
        except Refused as e:
            count(REFUSED, self.ENGINE)
            self.last_refusal = e.__cause__
            if self.pending:
                self.stopped = True
            return None
        want = fn(self.ref, self.ref)
        assert_same(want, got, what)
        return want

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def call_model(self, data):
        batch = data.draw(st.integers(1, 3), label="batch")
        seq = data.draw(st.integers(1, 5), label="seq")
        x = inputs(self.spec, batch, seq, data.draw(st.integers(0, 99), label="input seed"))
        mode = torch.inference_mode if data.draw(st.booleans()) else torch.no_grad

        def fn(model, call):
            with mode():
                return call(x).clone()

        if self.both(fn, f"output {list(x.shape)}") is not None:
            self.pending = False

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def call_model_again(self, data):
        """(Calls twice as often as other operations.)"""
        self.call_model(data)

    @precondition(lambda self: self.can("edit"))
    @rule(data=st.data())
    def edit(self, data):
        """An in-place write (``mul_``), ``p.set_`` or ``torch.ops.aten.set_`` to a new
        storage, or a fused optimizer's step (its kernel bumps no version counter): computed
        with the new values, or refused clearly with nothing changed."""
        names = [n for n, _ in self.ref.named_parameters()]
        name = data.draw(st.sampled_from(names), label="parameter")
        how = data.draw(st.sampled_from(["mul_", "mul_", "set_", "aten.set_", "fused SGD step"]),
                        label="edit")  # fmt: skip

        def fn(model, call):
            p = model.get_parameter(name)
            with torch.no_grad():
                if how == "mul_":
                    p.mul_(0.5)
                elif how == "set_":
                    p.set_((p * 0.5).detach().clone())
                elif how == "aten.set_":
                    torch.ops.aten.set_.source_Tensor(p, (p * 0.5).detach().clone())
            if how == "fused SGD step":
                p.grad = torch.ones(p.shape, dtype=p.dtype, device=p.device)
                torch.optim.SGD([p], lr=0.5, fused=True).step()
                p.grad = None

        self.both(fn, f"edit {how} {name}")

    @precondition(lambda self: self.can("read"))
    @rule()
    def read(self):

        def fn(model, call):
            with torch.no_grad():
                return [p.float().norm() for p in model.parameters()]

        self.both(fn, "p.norm()")

    @precondition(lambda self: self.live() and not self.pending and self.op_ok("assign"))
    @rule(data=st.data())
    def load_assign(self, data):
        """``load_state_dict(assign=True)``: new tensors for the module's, or a clear refusal
        that changes nothing."""
        scale = data.draw(st.sampled_from([1.0, 0.5]), label="scale")

        def fn(model, call):
            sd = {k: (v * scale).detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(sd, assign=True)

        self.both(fn, "load_state_dict(assign=True)")

    @precondition(lambda self: self.live() and not self.pending and self.op_ok("assign"))
    @rule(data=st.data())
    def assign_parameter(self, data):
        """``module.weight = nn.Parameter(...)``: the module computes with the new tensor, or
        its next use is refused clearly."""
        names = [n for n, _ in self.ref.named_parameters()]
        name = data.draw(st.sampled_from(names), label="parameter")
        owner, _, attr = name.rpartition(".")

        def fn(model, call):
            old = model.get_parameter(name)
            with torch.no_grad():
                new = (old * 0.5).detach().clone()
            setattr(model.get_submodule(owner), attr,
                    torch.nn.Parameter(new, requires_grad=old.requires_grad))  # fmt: skip

        self.both(fn, f"{name} = nn.Parameter(...)")

    @precondition(lambda self: self.live() and not self.pending)
    @rule(data=st.data())
    def save_and_load(self, data):
        scale = data.draw(st.sampled_from([1.0, 0.5]), label="scale")

        def fn(model, call):
            buf = io.BytesIO()
            torch.save({k: v * scale for k, v in model.state_dict().items()}, buf)
            buf.seek(0)
            model.load_state_dict(torch.load(buf))

        self.both(fn, "save and load")

    @precondition(lambda self: self.can("convert"))
    @rule(data=st.data())
    def convert(self, data):
        others = [
            d for d in (torch.float32, torch.float64, torch.bfloat16) if d != self.spec.torch_dtype
        ]
        dtype = data.draw(st.sampled_from(others), label="dtype")
        self.pending = True
        self.both(lambda m, c: m.to(dtype) and None, f"to({dtype})")

    @precondition(lambda self: self.live() and not self.pending)
    @rule()
    def deepcopy(self):
        def fn(model, call):
            c = copy.deepcopy(model)
            return values(c)

        self.both(fn, "deepcopy")

    @precondition(lambda self: self.live() and not self.pending)
    @rule()
    def remove_and_apply_again(self):
        def fn(model, call):
            if model is self.off:
                self.handle.remove()
                try:
                    self.apply()
                except Exception:
                    # refused: the offloaded twin no longer streams (on a GPU its tensors are
                    # back on the host, the plain twin's on the device): the two have parted
                    self.stopped = True
                    raise

        self.both(fn, "remove() and apply again")

    @invariant()
    def same_state(self):
        if self.stopped or self.pending or not hasattr(self, "ref"):
            return
        assert_same(values(self.ref), values(self.off), "state")

    def teardown(self):
        if self.handle is not None:
            with contextlib.suppress(Exception):
                self.handle.remove()


class CudaGraph(InferenceMachine):
    """handle.cuda_graph(model): the CPU path runs the same bookkeeping without a graph."""

    ENGINE = "cuda_graph"

    def apply(self):
        kw = self.stream_kw()
        if on_gpu():  # a graph needs them there (refused clearly otherwise, by cuda_graph)
            kw.update(use_streams=True, pin_memory=True)
        self.handle = to.stream_weights(self.off, DEVICE, **kw)
        self.call = self.handle.cuda_graph(self.off)


class Experts(InferenceMachine):
    """stream_experts on a random ModuleList mixture of experts (top-k routing, biases or
    not, a dense first block or not), at a random cache between the least and every expert,
    LRU or LFU: calls of batch 1, one token and new shapes, and every user operation of the
    inference machine, compared bitwise."""

    ENGINE = "stream_experts"

    @initialize(data=st.data())
    def setup(self, data, spec=None):
        EXAMPLES[self.ENGINE] = EXAMPLES.get(self.ENGINE, 0) + 1
        self.stopped = False
        self.pending = False
        self.spec = spec = spec or data.draw(moe_specs(), label="spec")
        self.handle = None
        self.ref, self.off = build_moe(spec).eval().to(DEVICE), build_moe(spec).eval()
        try:
            with refusal_allowed(lambda: values(self.off)):
                least = to.minimum_cache_bytes(self.off)
        except Refused:
            self.stopped = True
            return
        experts = sum(len(b.experts) for b in self.off.blocks if hasattr(b, "experts"))
        frac = data.draw(st.sampled_from([0.0, 0.3, 1.0, 2.0]), label="cache")
        slot = least // min(spec.top_k, experts)
        cache = least + int(frac * max(experts * slot - least, 0))
        self.kw = dict(cache_bytes=cache - data.draw(st.sampled_from([0, 0, 0, 1]), label="less"),
                       policy=data.draw(st.sampled_from(["lru", "lfu"]), label="policy"),
                       use_streams=data.draw(st.booleans(), label="use_streams"))  # fmt: skip
        self.load = {}
        self.draw_weights(data)
        self.start()

    def draw_weights(self, data):
        """Where the first apply reads the weights from: the model's own (stream_experts
        takes no checkpoint)."""

    def apply(self):
        self.handle = to.stream_experts(self.off, DEVICE, pin_memory=on_gpu(), **self.kw)
        self.call = self.off


class FusedMoE(torch.nn.Module):
    """Embedding, ``layers`` x (norm, transformers' Qwen3-MoE sparse block: a router and fused
    experts, residual), a head: the fused layout that `stream_experts`' graph mode serves."""

    def __init__(self, dim, width, experts, top_k, norm_topk, layers, dtype, seed,
                 impl="eager"):  # fmt: skip
        super().__init__()
        import transformers
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        impl, _, loop = impl.partition(" ")  # "eager 5.17": transformers 5.17's loop
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=32, hidden_size=dim, moe_intermediate_size=width, num_experts=experts,
            num_experts_per_tok=top_k, norm_topk_prob=norm_topk, experts_implementation=impl,
        )  # fmt: skip
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(32, dim)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))
        self.blocks = torch.nn.ModuleList(Qwen3MoeSparseMoeBlock(cfg) for _ in range(layers))
        if loop:
            for block in self.blocks:
                block.experts.__class__ = experts_517(type(block.experts))
        self.head = torch.nn.Linear(dim, 32)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3)
        self.to(dtype)

    def forward(self, x):
        h = self.emb(x)
        for norm, block in zip(self.norms, self.blocks, strict=True):
            h = h + block(norm(h))
        return self.head(h)


def switch_routers(model) -> torch.Tensor:
    """Every block's router of ``model`` (a `FusedMoE`) behind a switch read on the device (a
    captured graph replays it): ``layer * 2**20 + index + 1`` routes that layer's first place
    to expert ``index``; -1 (as set up), none. With the switch off the routing is bitwise the
    router's own."""
    switch = torch.full((), -1, dtype=torch.int64, device=DEVICE)
    for li, block in enumerate(model.blocks):
        router = block.gate
        routed = router.forward

        def forward(h, routed=routed, li=li):
            logits, weights, experts = routed(h)
            on = (switch >= 0) & (switch // (1 << 20) == li)
            first = torch.where(on, switch % (1 << 20) - 1, experts[..., :1])
            return logits, weights, torch.cat([first, experts[..., 1:]], -1)

        router.forward = forward
    return switch


class ExpertGraph(Experts):
    """stream_experts' handle.cuda_graph on fused experts (Note: [Routed experts in a CUDA
    graph]): one-token calls are captured and replayed with the routing, the cache's map and
    the copies on the (CPU-emulated) device; other shapes run eagerly the first time and are
    refused at their capture. Or the model called eagerly (its one-token calls too, replayed as
    block graphs or not: Note: [Block calls replayed as graphs]). Every inference operation
    between calls, compared bitwise."""

    ENGINE = "expert_graph"
    # "eager 5.17": transformers 5.17's per-expert loop, which fails on the sentinel index
    IMPLS = ("eager", "eager 5.17", "grouped_mm", "batched_mm")
    BLOCKS: bool | None = None  # block_graphs forced, the model called eagerly; None: drawn

    @initialize(data=st.data())
    def setup(self, data):
        EXAMPLES[self.ENGINE] = EXAMPLES.get(self.ENGINE, 0) + 1
        pytest.importorskip("transformers")
        self.stopped = False
        self.pending = False
        dims = dict(
            dim=data.draw(st.sampled_from([16, 32]), label="dim"),
            width=data.draw(st.sampled_from([8, 16, 32]), label="width"),
            experts=data.draw(st.integers(2, 8), label="experts"),
            norm_topk=data.draw(st.booleans(), label="norm_topk"),
            # three: two whole-layer regions and experts cached beside them (Note: [Whole
            # layers for large calls])
            layers=data.draw(st.integers(1, 3), label="layers"),
            dtype=data.draw(st.sampled_from([torch.float32, torch.bfloat16]), label="dtype"),
            seed=data.draw(st.integers(0, 99), label="seed"),
            # the per-expert loop, or transformers' grouped or batched GEMMs (Note: [Grouped
            # experts, one group at a time])
            impl=data.draw(st.sampled_from(self.IMPLS), label="impl"),
        )
        dims["top_k"] = data.draw(st.integers(1, min(3, dims["experts"])), label="top_k")
        self.spec = MoESpec(vocab=32, dim=dims["dim"], hidden=dims["width"], layers=1,
                            experts=dims["experts"], top_k=dims["top_k"], bias=False,
                            norm_topk=dims["norm_topk"], dense_first=False,
                            dtype=str(dims["dtype"]).removeprefix("torch."), seed=0)  # fmt: skip
        self.handle = None
        self.ref, self.off = FusedMoE(**dims).eval().to(DEVICE), FusedMoE(**dims).eval()
        self.impl, self.experts = dims["impl"], dims["experts"]
        self.switches = [switch_routers(self.ref), switch_routers(self.off)]
        least = to.minimum_cache_bytes(self.off)
        slot = least // dims["top_k"]
        total = dims["experts"] * dims["layers"]
        # up to every expert plus a graph's stage (top_k slots), and one past the cap; or a
        # few, where a large call stages its layer in chunks (Note: [Layers in chunks])
        slots = data.draw(st.one_of(st.integers(dims["top_k"], total + dims["top_k"] + 1),
                                    st.integers(dims["top_k"], 3 * dims["top_k"])),
                          label="slots")  # fmt: skip
        self.kw = dict(
            cache_bytes=slots * slot,
            policy=data.draw(st.sampled_from(["lru", "lfu"]), label="policy"),
            # off, the default count, or at most 1 to top_k experts copied ahead a call
            prefetch=data.draw(
                st.one_of(st.booleans(), st.integers(1, dims["top_k"])), label="prefetch"
            ),  # fmt: skip
        )
        # the model called eagerly rather than through cuda_graph
        self.eager = data.draw(st.booleans(), label="eager")
        # eager one-token calls on the device tables (Note: [Block calls replayed as graphs]):
        # the default (off on the CPU, on where a GPU graphs them), forced on, or off
        graphs = data.draw(st.sampled_from([None, True, False]), label="block_graphs")
        if self.BLOCKS is not None:
            self.eager, graphs = True, self.BLOCKS
        if graphs is not None and self.ENGINE != "expert_host":
            self.kw["block_graphs"] = graphs
        # the cache cut into parts of at most GROUP_LIMIT slots (the grouped GEMM's groups,
        # 1023 on CUDA), each its layers' window with its own stage (Note: [Parts of the
        # cache]): one part here, or parts of the stage alone, one slot more or k + 1 more
        from torchoffload.moe import _layout

        self.group_limit = _layout.GROUP_LIMIT
        k = dims["top_k"]
        _layout.GROUP_LIMIT = data.draw(st.sampled_from([1023, k, k + 1, 2 * k + 1]),
                                        label="group_limit")  # fmt: skip
        self.start()

    def teardown(self):
        from torchoffload.moe import _layout

        _layout.GROUP_LIMIT = getattr(self, "group_limit", _layout.GROUP_LIMIT)
        super().teardown()

    def apply(self):
        self.handle = to.stream_experts(self.off, DEVICE, pin_memory=on_gpu(), **self.kw)
        self.call = self.off if self.eager else self.handle.cuda_graph(self.off)

    def both(self, fn, what):
        try:
            return super().both(fn, what)
        finally:  # a refusal for a host read would be the graphed path's own: a finding
            assert not isinstance(self.last_refusal, HostReadInCapture), self.last_refusal

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def decode_step(self, data):
        """One token: the graph's call (twice as often as other shapes)."""
        x = inputs(self.spec, 1, 1, data.draw(st.integers(0, 99), label="input seed"))

        def fn(model, call):
            with torch.inference_mode():
                return call(x).clone()

        self.both(fn, "one token")

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def decode_step_again(self, data):
        self.decode_step(data)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def long_call(self, data):
        """A prompt of 8 to 16 tokens: at least 2 rows per expert, so a grouped_mm layer is
        copied whole where the cache holds two (Note: [Whole layers for large calls]), else in
        chunks (Note: [Layers in chunks])."""
        batch = data.draw(st.integers(1, 2), label="batch")
        seq = data.draw(st.integers(8, 16), label="seq")
        x = inputs(self.spec, batch, seq, data.draw(st.integers(0, 99), label="input seed"))

        def fn(model, call):
            with torch.inference_mode():
                return call(x).clone()

        self.both(fn, f"long call {list(x.shape)}")

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def routed_outside(self, data):
        """One token whose router routes its first place, at one layer, to an expert index
        outside the layer: -1, the expert count n or n + 1 (Note: [Routed outside a layer]).
        Where the plain model serves it (transformers' per-expert loop skips n) the two are
        compared bitwise. Elsewhere the offloaded call raises now (a clear error), or returns
        and the handle's next call raises naming the layer (a replay: only the device saw the
        routing), once: a report anywhere else is a finding (`clear_error`). The plain model
        is not compared there (it raises, indexes another expert, or leaves rows unwritten)."""
        li = data.draw(st.integers(0, len(self.off.blocks) - 1), label="layer")
        index = data.draw(st.sampled_from([-1, self.experts, self.experts + 1]), label="index")
        x = inputs(self.spec, 1, 1, data.draw(st.integers(0, 99), label="input seed"))

        def fn(model, call):
            with torch.inference_mode():
                return call(x).clone()

        name = f"blocks.{li}.experts"
        for sw in self.switches:
            sw.fill_(li * (1 << 20) + (index + 1))
        try:
            if index == self.experts and skips_sentinel(self.ref.blocks[li].experts):
                self.both(fn, f"one token routed to expert {index} (the loop's sentinel)")
                return
            count(OPERATIONS, self.ENGINE)
            try:
                with refusal_allowed(lambda: values(self.off)):
                    fn(self.off, self.call)
            except Refused:
                count(REFUSED, self.ENGINE)
                return
            except RuntimeError as e:  # reported inside this call, by a later block call
                if f"routed '{name}' to an expert index outside" not in str(e):
                    raise
                count(REFUSED, self.ENGINE)
                return
        finally:
            for sw in self.switches:
                sw.fill_(-1)
        # it returned: a device-routed call, which the next reports once the device has run it
        if on_gpu():
            torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=f"routed '{name}' to an expert index outside"):
            fn(self.off, self.call)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def long_call_again(self, data):
        """As often as a decode step: a cache of fewer slots than two layers stages a
        grouped_mm layer in chunks (Note: [Layers in chunks])."""
        self.long_call(data)


class ExpertBlockGraphs(ExpertGraph):
    """stream_experts(block_graphs=True) called eagerly (Note: [Block calls replayed as
    graphs]): its one-token calls on the device tables (replayed graphs on a GPU), its other
    calls routed on the host, the map handed between them, every inference operation between
    calls compared bitwise."""

    ENGINE = "expert_block_graphs"
    BLOCKS = True


class ExpertHost(ExpertGraph):
    """stream_experts(host_compute=...) on fused experts (Note: [Cold experts on the host]): a
    small call's misses computed on the host by a drawn policy, rates and token limit, the
    model called eagerly or through handle.cuda_graph (whose replays never compute on the
    host). Every inference operation between calls, compared bitwise: on the CPU the host
    runs the device's kernels."""

    ENGINE = "expert_host"
    IMPLS = ("eager", "eager 5.17")  # host compute refuses grouped_mm (tests/test_moe.py)

    @initialize(data=st.data())
    def setup(self, data):
        from torchoffload.moe import HostCompute

        self.graph = data.draw(st.booleans(), label="graph")
        self.host = HostCompute(
            max_tokens=data.draw(st.integers(1, 6), label="max_tokens"),
            policy=data.draw(st.sampled_from(["all", "split"]), label="host policy"),
            link_bytes_per_s=data.draw(st.sampled_from([1.0, 3.0]), label="link rate"),
            host_bytes_per_s=data.draw(st.sampled_from([1.0, 3.0]), label="host rate"),
            host_fixed_s=data.draw(st.sampled_from([None, 0.0, 1e3, 1e12]), label="host job cost"),
        )
        ExpertGraph.setup(self, data)

    def apply(self):
        self.handle = to.stream_experts(self.off, "cpu", pin_memory=False, host_compute=self.host,
                                        **self.kw)  # fmt: skip
        self.call = self.handle.cuda_graph(self.off) if self.graph else self.off


class Composed:
    """stream_experts' and stream_weights' handles of one model, removed in order."""

    def __init__(self, experts, weights):
        self.experts = experts
        self.weights = weights

    def remove(self):
        self.weights.remove()
        self.experts.remove()


class ExpertsWeights(Experts):
    """stream_experts, then stream_weights over the dense parts at a random budget from the
    least up, prefetch depth and cut (Note: [Tensors hosted by another engine]): every
    operation of the inference machine, remove() of both in order and apply again, and
    stream_experts' remove() first, which must be refused changing nothing. The weights
    may come from a checkpoint that stream_weights reads, experts included (Note:
    [Checkpoint entries of tensors another engine hosts]), into a real model with other values
    (a model on meta cannot stream its experts), whole or lacking one tensor."""

    ENGINE = "experts_weights"

    @initialize(data=st.data())
    def setup(self, data):
        spec = data.draw(moe_specs(), label="spec")
        units = [None, "leaves"] + (["blocks"] if spec.layers > 1 and not spec.dense_first else [])
        self.weights_kw = dict(
            prefetch_depth=data.draw(st.integers(0, 3), label="prefetch_depth"),
            unit=data.draw(st.sampled_from(units), label="unit"),
        )
        self.budget_frac = data.draw(st.sampled_from([0.0, 0.3, 1.0, 3.0]), label="budget")
        Experts.setup(self, data, spec=spec)

    def draw_weights(self, data):
        source = data.draw(st.sampled_from(["model", "model", "checkpoint", "partial checkpoint"]),
                           label="weights")  # fmt: skip
        if source != "model":
            self.from_checkpoint(data, meta=False, partial="partial" in source)

    def apply(self):
        experts = to.stream_experts(self.off, DEVICE, pin_memory=on_gpu(), **self.kw)
        try:
            least = to.minimum_budget(self.off, **self.weights_kw)
            dense = sum(t.numel() * t.element_size() for n, t in self.ref.state_dict().items()
                        if ".experts." not in n)  # fmt: skip
            budget = int(least + self.budget_frac * max(dense - least, 0))
            load, self.load = self.load, {}  # the first apply only
            weights = to.stream_weights(self.off, DEVICE, budget_bytes=budget,
                                        pin_memory=on_gpu(),
                                        use_streams=self.kw["use_streams"], **load,
                                        **self.weights_kw)  # fmt: skip
        except BaseException:
            experts.remove()
            raise
        self.handle = Composed(experts, weights)
        self.call = self.off

    @precondition(lambda self: self.live() and not self.pending)
    @rule()
    def remove_experts_first(self):
        def fn(model, call):
            if model is self.off:
                self.handle.experts.remove()

        self.both(fn, "stream_experts' remove() before stream_weights'")
        assert not self.handle.experts.removed, "stream_experts' remove() first was not refused"


# - Compiled engines: the program at a random budget against the same program with every unit
# kept (compiled code is not bitwise eager code).


def least_budget(make) -> int:
    """The least budget ``make(budget_bytes)`` takes, read from its refusal of 1 byte (raised
    before anything is compiled or loaded)."""
    with pytest.raises(ValueError, match="minimum budget is") as e:
        make(1)
    return int(str(e.value).split("(")[-1].split(" bytes")[0])


class CompiledMachine(RuleBasedStateMachine):
    ENGINE = "compile_streamed"

    @initialize(data=st.data())
    def setup(self, data):
        EXAMPLES[self.ENGINE] = EXAMPLES.get(self.ENGINE, 0) + 1
        spec = data.draw(specs(dtypes=("float32", "bfloat16"), max_layers=2), label="spec")
        self.spec = spec
        model = build(spec).eval()
        depth = data.draw(st.integers(0, 3), label="prefetch_depth")
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        frac = data.draw(st.sampled_from([0.0, 0.2, 1.0]), label="budget")
        self.seq = data.draw(st.integers(1, 4), label="seq")
        self.batch = data.draw(st.integers(1, 2), label="batch")
        x = tokens(spec, self.batch, self.seq, 0)
        self.program, self.kept = self.build(model, x, frac, depth, total)

    @staticmethod
    def budget(make, frac: float, total: int) -> int:
        # The program's own least budget: `minimum_budget` is stream_weights', whose units
        # (blocks or leaves) need not be the program's, and may exceed the weights' bytes.
        least = least_budget(make)
        return int(least + frac * max(0, total - least))

    def build(self, model, x, frac, depth, total):
        import torchoffload.compile as toc

        def make(budget):
            return toc.compile_streamed(model, (x,), budget_bytes=budget, device="cpu",
                                        pin_memory=False, prefetch_depth=depth)  # fmt: skip

        return make(self.budget(make, frac, total)), make(16 * total + (1 << 20))

    @rule(seed=st.integers(0, 99))
    def call(self, seed):
        count(OPERATIONS, self.ENGINE)
        x = tokens(self.spec, self.batch, self.seq, seed)
        with torch.no_grad():
            assert_same(self.kept(x).clone(), self.program(x).clone(), "output")

    def teardown(self):
        for p in (getattr(self, "program", None), getattr(self, "kept", None)):
            if p is not None:
                with contextlib.suppress(Exception):
                    p.remove()


class Package(CompiledMachine):
    ENGINE = "package"

    def build(self, model, x, frac, depth, total):
        import tempfile

        import torchoffload.compile as toc

        d = tempfile.mkdtemp(prefix="fuzz-pkg-")
        toc.save_streamed_package(model, (x,), f"{d}/m.pt2", weights=f"{d}/m.safetensors",
                                  device="cpu")  # fmt: skip

        def make(budget):
            return toc.load_streamed_package(f"{d}/m.pt2", f"{d}/m.safetensors", "cpu",
                                             budget_bytes=budget, pin_memory=False,
                                             prefetch_depth=depth)  # fmt: skip

        return make(self.budget(make, frac, total)), make(16 * total + (1 << 20))


# - One test per engine. CI sizes keep the whole file under a minute on two cores.

ENGINES = {
    "activations": (Activations, 6),
    "layers": (Layers, 6),
    "plan": (Plans, 3),
    "optimizer": (Optimizer, 15),
    "stream_parameters": (StreamParameters, 10),
    "stream_weights": (InferenceMachine, 15),
    "cuda_graph": (CudaGraph, 10),
    "stream_experts": (Experts, 15),
    "expert_graph": (ExpertGraph, 10),
    "expert_block_graphs": (ExpertBlockGraphs, 12),
    "expert_host": (ExpertHost, 10),
    "experts_weights": (ExpertsWeights, 10),
    "compile_streamed": (CompiledMachine, 0),
    "package": (Package, 0),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_fuzz(engine):
    run_machine(engine)


# The machines whose engines have a GPU path of their own (plan: its decisions are those of
# the activation and parameter machines; expert_host: on a GPU its cold experts round as the
# CPU's kernels, not bitwise; the compiled machines compile for each example).
GPU_ENGINES = ["activations", "layers", "optimizer", "stream_parameters", "stream_weights",
               "cuda_graph", "stream_experts", "expert_graph", "expert_block_graphs",
               "experts_weights"]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("slow", [False, True], ids=["copies", "slowed-copies"])
@pytest.mark.parametrize("engine", GPU_ENGINES)
def test_fuzz_gpu(engine, slow, gpu_deterministic, monkeypatch):
    """The machine on the GPU (Note at DEVICE), its copy streams slowed or not: a copy that
    compute does not wait for, or a slot reused before its reader finished, reads other
    bytes there."""
    from torchoffload import testing

    monkeypatch.setattr(sys.modules[__name__], "DEVICE", torch.device("cuda"))
    with testing.slow_copies(cycles=2_000_000) if slow else contextlib.nullcontext():
        run_machine(engine, f"{engine} on cuda{', copies slowed' if slow else ''}")


def run_machine(engine: str, name: str | None = None) -> None:
    machine, ci_examples = ENGINES[engine]
    if broken(engine, "*"):
        pytest.skip(f"issue 38 item {KNOWN_BROKEN[engine, '*']}: in KNOWN_BROKEN")
    if not FUZZ and ci_examples == 0:
        pytest.skip("compiles for each example: `make fuzz` runs it")
    for table in (EXAMPLES, OPERATIONS, REFUSED, DRAWN):
        table.pop(engine, None)
    start = time.perf_counter()
    machine.TestCase.settings = profile(ci_examples)
    machine.TestCase().runTest()
    if FUZZ:
        took = time.perf_counter() - start
        print(
            f"\nfuzz {name or engine}: {EXAMPLES.get(engine, 0)} examples, "
            f"{OPERATIONS.get(engine, 0)} "
            f"operations compared ({REFUSED.get(engine, 0)} clear refusals) in {took:.1f} s"
            + (
                f"; optimizers built: {dict(sorted(DRAWN[engine].items()))}"
                if engine in DRAWN
                else ""
            )  # fmt: skip
        )


# - The corpus: issue 38's findings and the fuzzer's, each the same checks on a fixed case.
# Each check is the fuzzer's: bitwise against the plain program, or a clear error (raised by
# torchoffload) with nothing changed. Cases marked xfail(strict=True) fail on the code they
# were found in; drop the mark when the fix merges (and the entry from KNOWN_BROKEN).


def item(n: int, what: str = ""):
    return pytest.mark.xfail(strict=True, reason=f"issue 38 item {n}{': ' + what if what else ''}")


def new(n: int, what: str):
    return pytest.mark.xfail(strict=True, reason=f"fuzzer finding NEW-{n}: {what}")


SPEC = Spec(vocab=20, dim=8, hidden=16, layers=2, tied=True, norm="layer", post_norm=False,
            residual=True, shared_storage=False, transposed=False, used_twice=False,
            buffer=True, branch=True, final_norm=True, head_bias=False, dropout=0.0,
            dtype="float32", seed=0)  # fmt: skip
X = tokens(SPEC, 2, 4, 0)


def refused_or_same(off_fn, ref_fn, snapshot, what: str) -> bool:
    """``off_fn()`` against ``ref_fn()``: equal, or a clear error leaving ``snapshot()`` as it
    was (True: it refused, and ``ref_fn`` was not run)."""
    try:
        with refusal_allowed(snapshot):
            got = off_fn()
    except Refused:
        return True
    assert_same(ref_fn(), got, what)
    return False


def stream_params(m, **kw):
    return to.stream_parameters(m, budget_bytes=1 << 20, **kw)


def stream_weights(m):
    return to.stream_weights(m, "cpu", budget_bytes=1 << 20, prefetch_depth=1)


# -- item 2: dtype conversion while streaming


def check_convert(apply, dtype, train=False):
    ref, off = build(SPEC), build(SPEC)
    handle = apply(off)
    before = values(off)
    mode = torch.enable_grad if train else torch.no_grad

    def run(m):
        m.to(dtype)
        with mode():
            return m(X).detach()

    if refused_or_same(lambda: run(off), lambda: run(ref), lambda: before, f"to({dtype})"):
        handle.remove()  # refused: the model is as it was, every tensor in its dtype
        assert_same(before, values(off), "after the refusal and remove()")
        return
    handle.remove()
    assert_same(values(ref), values(off), "after remove()")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_new4_convert_under_stream_weights_leaves_buffers_converted(dtype):
    check_convert(stream_weights, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_item2_convert_under_stream_parameters(dtype):
    check_convert(stream_params, dtype, train=True)


# -- item 3 and the hosting layer: a streamed tensor outside its unit


def check_outside_unit(apply, op):
    ref, off = build(SPEC), build(SPEC)
    handle = apply(off)
    opt_off = opt_ref = None
    if apply is stream_params:
        opt_off = to.OffloadedOptimizer(off.parameters(), torch.optim.SGD, lr=0.1)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)

    def run(m, opt):
        name = "blocks.0.fc1.weight"
        p = m.get_parameter(name)
        if op == "norm":  # what logging reads
            with torch.no_grad():
                return p.norm()
        if op == "mul":  # manual weight decay
            with torch.no_grad():
                p.mul_(0.9)
        elif op == "clamp":
            with torch.no_grad():
                p.clamp_(-0.1, 0.1)
        if op == "l2":  # an L2 penalty over model.parameters()
            loss = loss_of(m(X), X) + 1e-2 * sum(q.pow(2).sum() for q in m.parameters())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return values(m)
        with torch.no_grad():
            return m(X), values(m)

    try:
        refused_or_same(lambda: run(off, opt_off), lambda: run(ref, opt_ref),
                        lambda: values(off), op)  # fmt: skip
    finally:
        if opt_off is not None:
            opt_off.remove()
        handle.remove()


@pytest.mark.parametrize("op", ["norm", "mul", "clamp", "l2"])
def test_item3_outside_unit_stream_parameters(op):
    check_outside_unit(stream_params, op)


@pytest.mark.parametrize("op", ["norm", "mul", "clamp"])
def test_item3_outside_unit_stream_weights(op):
    check_outside_unit(stream_weights, op)


@pytest.mark.parametrize("engine", ["stream_parameters", "stream_weights"])
def test_item3_weight_read_by_its_parent_module(engine):
    """Item 3's hosting layer: a weight read by its parent module under unit='leaves' (torch's
    shape error on the empty tensor before) is served with its real values."""
    spec = replace(SPEC, transposed=True, buffer=False)  # a block reads fc1.weight itself
    ref, off = build(spec), build(spec)
    if engine == "stream_weights":
        handle = to.stream_weights(off, "cpu", budget_bytes=1 << 20, unit="leaves")
    else:
        handle = to.stream_parameters(off, budget_bytes=1 << 20, unit="leaves")
    try:
        with torch.no_grad():
            refused_or_same(lambda: off(X), lambda: ref(X), lambda: values(off), "output")
    finally:
        handle.remove()


# -- item 4: zero_grad(set_to_none=False), unused parameters, no zero_grad


def check_optimizer_loop(zero_grad, steps_inputs, make_opt=None):
    """Plain AdamW and OffloadedOptimizer(AdamW) over the same loop; ``zero_grad``: "none",
    "zeros" or "skip"."""
    ref, off = build(SPEC), build(SPEC)
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), **kw)
    opt_off = (make_opt or (lambda ps: to.OffloadedOptimizer(ps, torch.optim.AdamW, **kw)))(
        off.parameters()
    )
    from torchoffload.optim import MovedGradError

    try:
        for i, x in enumerate(steps_inputs):
            if zero_grad == "skip" and i > 0:
                # The off side's gradients were refused to reads ('moved' below); the backward
                # that would accumulate into them must be refused too, with nothing changed.
                before = values(off)
                with pytest.raises(MovedGradError):
                    loss_of(off(x), x).backward()
                assert_same(before, values(off), "parameters after the refused backward")
                return
            for m, opt in ((ref, opt_ref), (off, opt_off)):
                loss_of(m(x), x).backward()
                opt.step()
                if zero_grad != "skip":
                    opt.zero_grad(set_to_none=zero_grad == "none")
            assert_same(values(ref), values(off), "parameters")
            got = grads(off)
            if zero_grad == "skip":  # a read after step() is refused: MovedGradError
                assert all(v == "moved" for v in got.values() if isinstance(v, str)), got
                got = {k: grads(ref)[k] if v == "moved" else v for k, v in got.items()}
            assert_same(grads(ref), got, "gradients")
    finally:
        opt_off.remove()


ONE_TOKEN, FOUR_TOKENS = tokens(SPEC, 1, 1, 1), tokens(SPEC, 2, 4, 2)


def test_item4_zero_grad_to_zeros_and_an_unused_parameter():
    # blocks.*.one is used by one-token inputs only
    check_optimizer_loop("zeros", [ONE_TOKEN, FOUR_TOKENS, FOUR_TOKENS])


def test_item4_skipping_zero_grad_accumulates():
    check_optimizer_loop("skip", [FOUR_TOKENS, ONE_TOKEN, FOUR_TOKENS])


def test_the_optimizer_loop_check_passes_where_it_is_bitwise():
    check_optimizer_loop("none", [ONE_TOKEN, FOUR_TOKENS, FOUR_TOKENS])


# -- item 5: GradScaler


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_item5_grad_scaler(dtype):
    """Loss scaling: with fp32 parameters, bitwise the plain class under the same GradScaler
    (its unscale and inf/NaN skip run on the host gradients). With fp16 parameters GradScaler
    itself refuses ("Attempting to unscale FP16 gradients", as for any optimizer of fp16
    parameters) and nothing may have changed; were it to run, the reference is the plain class
    on fp32 masters (apex O2's recipe)."""
    half = dtype == "float16"
    ref, off = build(SPEC), build(SPEC)
    if half:
        ref, off = ref.half(), off.half()
    masters = [p.detach().float().clone() for p in ref.parameters()] if half else None
    opt_ref = torch.optim.AdamW(masters if half else ref.parameters(), lr=1e-2)
    opt_off = to.OffloadedOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=64)
    scaler_ref, scaler_off = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    before = values(off)
    try:
        for step in range(3):
            scale = 2.0**16 if step != 1 else float("inf")  # step 1 overflows: skipped
            scaler_off.scale(loss_of(off(X), X) * (scale / 2.0**16)).backward()
            try:
                scaler_off.step(opt_off)
            except Exception as e:
                opt_off.zero_grad()  # a loop that goes on (or a finally:) zeroes the gradients
                ours = clear_error(e) and "GradScaler" in str(e)
                torchs = half and "Attempting to unscale FP16 gradients" in str(e)
                assert ours or torchs, f"not a clear refusal: {e!r}"
                assert_same(before, values(off), "weights after the refusal")
                return
            scaler_off.update()
            opt_off.zero_grad()
            scaler_ref.scale(loss_of(ref(X), X) * (scale / 2.0**16)).backward()
            if half:
                for m, p in zip(masters, ref.parameters(), strict=True):
                    m.grad, p.grad = p.grad.float(), None
            scaler_ref.step(opt_ref)
            scaler_ref.update()
            opt_ref.zero_grad()
            if half:
                with torch.no_grad():
                    for m, p in zip(masters, ref.parameters(), strict=True):
                        p.copy_(m)
            assert scaler_ref.get_scale() == scaler_off.get_scale()
            assert_same(values(ref), values(off), "trained weights")
        assert not half, "fp16 parameters were expected to be refused by GradScaler"
    finally:
        opt_off.remove()


# -- item 6: step_ahead and a state read right after step()


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes a while (a large model's host step, at this model's size)."""

    def step(self, closure=None):
        time.sleep(0.2)
        return super().step(closure)


def test_item6_step_ahead_state_dict_right_after_step():
    ref, off = build(SPEC), build(SPEC)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_off = to.OffloadedOptimizer(off.parameters(), SlowSGD, lr=0.1, step_ahead=True,
                                    model=off)  # fmt: skip
    try:
        for m, opt in ((ref, opt_ref), (off, opt_off)):
            loss_of(m(X), X).backward()
            opt.step()
        assert_same(values(ref), values(off), "state_dict() right after step()")
    finally:
        opt_off.remove()


# -- item 7: deepcopy under stream_parameters


def test_item7_deepcopy_under_stream_parameters():
    ref, off = build(SPEC), build(SPEC)
    handle = stream_params(off)

    def copy_and_run(m):
        c = copy.deepcopy(m)
        return c, values(c)

    try:
        if refused_or_same(lambda: copy_and_run(off)[1], lambda: copy_and_run(ref)[1],
                           lambda: values(off), "the copy's state_dict"):  # fmt: skip
            return
        c, _ = copy_and_run(off)
    finally:
        handle.remove()
    with torch.no_grad():  # the copy lives on after the original's handle is removed
        assert_same(ref(X), c(X), "the copy's output after remove()")


# -- the fuzzer's own findings (NEW-n in KNOWN_BROKEN)


def test_new1_deepcopy_with_step_ahead():
    ref, off = build(SPEC), build(SPEC)
    opt = to.OffloadedOptimizer(off.parameters(), torch.optim.SGD, lr=0.1, step_ahead=True,
                                model=off)  # fmt: skip
    try:
        # TypeError: cannot pickle '_thread.lock' object (from copy, not a refusal)
        refused_or_same(lambda: values(copy.deepcopy(off)), lambda: values(copy.deepcopy(ref)),
                        lambda: values(off), "the copy")  # fmt: skip
    finally:
        opt.remove()


def test_new2_clip_with_param_groups_in_another_order():
    def groups(m):
        return [
            {"params": list(m[1:].parameters()), "lr": 0.02},
            {"params": list(m[0].parameters())},
        ]

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(31, 8), torch.nn.Linear(8, 8),
                                   torch.nn.Linear(8, 31))  # fmt: skip

    ref, off = model(), model()
    opt = to.OffloadedOptimizer(groups(off), torch.optim.Adagrad, lr=1e-2, max_grad_norm=1.0,
                                model=off)  # the norm in model.parameters() order  # fmt: skip
    plain = torch.optim.Adagrad(groups(ref), lr=1e-2)
    x = torch.tensor([[11, 28, 11], [13, 7, 29], [22, 5, 13]])
    try:
        for m in (ref, off):
            m(x).float().pow(2).mean().mul(100).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # what Trainer/accelerate do
        plain.step()
        opt.step()
        assert_same(values(ref), values(off), "parameters")
    finally:
        opt.remove()


def views_of_one_storage(dtype):
    torch.manual_seed(0)
    m = torch.nn.Module()
    base = torch.randn(2, 16).to(dtype)
    m.a = torch.nn.Parameter(base[0])  # two parameters, views of one storage
    m.b = torch.nn.Parameter(base[1])
    m.w = torch.nn.Parameter(torch.randn(16, 16).to(dtype))
    return m


def test_new3_bf16_views_of_one_storage_in_two_buckets():
    split = dict(offload_fraction=0.5)

    def loss(m):
        return (torch.sigmoid(m.a) @ m.w + m.b).float().square().sum()

    ref, off = views_of_one_storage(torch.bfloat16), views_of_one_storage(torch.bfloat16)
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    opt = to.OffloadedOptimizer(off.parameters(), torch.optim.SGD, **kw, **split)
    masters = [p.detach().float().clone() for p in ref.parameters()]  # the documented reference
    plain = torch.optim.SGD(masters, **kw)
    try:
        for _ in range(5):
            loss(off).backward()
            opt.step()
            opt.zero_grad()
            loss(ref).backward()
            for mm, p in zip(masters, ref.parameters(), strict=True):
                mm.grad, p.grad = p.grad.float(), None
            plain.step()
            with torch.no_grad():
                for mm, p in zip(masters, ref.parameters(), strict=True):
                    p.copy_(mm)
        assert_same(values(ref), values(off), "parameters")  # in one bucket: equal
    finally:
        opt.remove()


def test_new3_found_by_the_fuzzer_with_small_buckets():
    spec = Spec(vocab=25, dim=4, hidden=32, layers=2, tied=True, norm="rms", post_norm=False,
                residual=True, shared_storage=True, transposed=False, used_twice=False,
                buffer=True, branch=False, final_norm=False, head_bias=False, dropout=0.25,
                dtype="bfloat16", seed=5561)  # fmt: skip
    cls, kw = OPTIMIZERS["sgd"]
    ref, off = build(spec), build(spec)
    opt = to.OffloadedOptimizer(off.parameters(), cls, bucket_bytes=64, **kw)
    plain = MasterRef(ref, cls, kw, False)
    x = tokens(spec, 2, 3, 0)
    try:
        for i in range(2):
            for m, o in ((ref, plain), (off, opt)):
                torch.manual_seed(i)
                loss_of(m(x), x).backward()
                o.step()
                o.zero_grad()
        assert_same(values(ref), values(off), "parameters")  # bucket_bytes=None: equal
    finally:
        opt.remove()


class Pause(torch.autograd.Function):
    """Identity whose backward waits: the host steps the buckets already final meanwhile."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.3)
        return g


def test_new6_views_of_one_storage_uploaded_during_backward():
    ref, off = views_of_one_storage(torch.float32), views_of_one_storage(torch.float32)
    opt = to.OffloadedOptimizer(off.parameters(), torch.optim.SGD, lr=0.05, bucket_bytes=64)
    plain = torch.optim.SGD(ref.parameters(), lr=0.05)

    def step(m, o):
        for _ in range(2):
            # b's gradient is final first: its bucket is stepped and uploaded while the
            # backward pauses, before the matmul's backward reads the saved a
            (Pause.apply(m.a @ m.w) * m.b).sum().backward()
            o.step()
            o.zero_grad()
        return values(m)

    try:
        refused_or_same(lambda: step(off, opt), lambda: step(ref, plain), lambda: values(off),
                        "parameters")  # fmt: skip
    finally:
        opt.remove()


def test_new5_checkpoint_after_an_in_place_edit():
    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(8, 4).to(torch.bfloat16)

    m = model()
    opt = to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    m(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        m.weight.mul_(0.9)  # manual weight decay between steps: read again before the next step
    checkpoint = copy.deepcopy((m.state_dict(), opt.state_dict()))
    opt.remove()
    resumed = model()
    resumed.load_state_dict(checkpoint[0])
    opt2 = to.OffloadedOptimizer(resumed.parameters(), torch.optim.AdamW, lr=1e-2)
    try:
        # ValueError: the master of parameter 0 does not round to parameter 0's current value
        opt2.load_state_dict(checkpoint[1])
    finally:
        opt2.remove()


class ResidualRMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.RMSNorm(4)
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc(self.norm(h))
        return self.head(h)


def test_new7_stream_parameters_leaves_rms_norm_gradients():
    ref, off = ResidualRMSNorm(), ResidualRMSNorm()
    handle = to.stream_parameters(off, budget_bytes=1 << 20, unit="leaves")
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 1, 2]])
    try:
        for m in (ref, off):
            m(x).square().mean().backward()
        assert_same(grads(ref), grads(off), "gradients")  # emb.weight: 3.7e-9 apart
    finally:
        handle.remove()


def test_new9_reference_masters_follow_an_edit_before_a_checkpoint():
    # The reference was wrong: MasterRef's state_dict() held the masters from before the
    # in-place edit and its load_state_dict() marked them current, so its next step lost the
    # edit (as torch.optim on the bf16 parameters would not); OffloadedOptimizer's masters are
    # read again first (its state_dict() docstring), in both parts of an offload_fraction split
    spec = Spec(vocab=5, dim=4, hidden=8, layers=1, tied=False, norm="layer", post_norm=False,
                residual=False, shared_storage=False, transposed=False, used_twice=False,
                buffer=False, branch=False, final_norm=False, head_bias=False, dropout=0.0,
                dtype="bfloat16", seed=0)  # fmt: skip
    cls, kw = OPTIMIZERS["adagrad"]
    ref, off = build(spec), build(spec)
    opt = to.OffloadedOptimizer(off.parameters(), cls, offload_fraction=0.25, **kw)
    plain = MasterRef(ref, cls, kw, False)
    x = tokens(spec, 1, 1, 0)
    try:
        for m, o in ((ref, plain), (off, opt)):
            with torch.no_grad():
                m.emb.weight.mul_(0.9)
            m.load_state_dict(copy.deepcopy(m.state_dict()))
            if o is plain:  # the rules' marks: the edit, then the load writes every parameter
                plain.wrote(list(m.parameters()))
            o.load_state_dict(copy.deepcopy(o.state_dict()))
            torch.manual_seed(0)
            loss_of(m(x), x).backward()
            o.step()
            o.zero_grad()
        assert_same(values(ref), values(off), "parameters")  # emb.weight: 0.21 apart
    finally:
        opt.remove()


@pytest.mark.parametrize("by_model", [False, True], ids=["params", "model"])
def test_new10_reference_clips_in_the_order_the_optimizer_sums(by_model):
    # The reference was wrong: it clipped clip_grad_norm_(model.parameters()) while the
    # machine built OffloadedOptimizer without model= (except with step_ahead), which sums the
    # norm in the order of its param groups (Note: [The order of the clipping norm]); with
    # the blocks' group first, emb.weight was 1 ulp apart
    spec = Spec(vocab=28, dim=4, hidden=8, layers=2, tied=False, norm="layer", post_norm=False,
                residual=False, shared_storage=False, transposed=True, used_twice=False,
                buffer=True, branch=False, final_norm=True, head_bias=True, dropout=0.0,
                dtype="float32", seed=228)  # fmt: skip
    cls, kw = OPTIMIZERS["adagrad"]
    ref, off = build(spec), build(spec)
    model = {"model": off} if by_model else {}
    opt = to.OffloadedOptimizer(param_groups(off, off.parameters(), True), cls,
                                max_grad_norm=0.05, **model, **kw)  # fmt: skip
    plain = PlainRef(ref, cls, kw, True, 0.05, by_model)
    x = tokens(spec, 1, 4, 0)
    try:
        for m, o in ((ref, plain), (off, opt)):
            torch.manual_seed(0)
            loss_of(m(x), x).backward()
            o.step()
            o.zero_grad()
        assert_same(values(ref), values(off), "parameters")
    finally:
        opt.remove()


NEW8 = Spec(vocab=5, dim=4, hidden=8, layers=1, tied=False, norm="layer", post_norm=False,
            residual=False, shared_storage=True, transposed=False, used_twice=False,
            buffer=False, branch=False, final_norm=False, head_bias=False, dropout=0.0,
            dtype="bfloat16", seed=0)  # fmt: skip


def train_with_an_edit(m, o, wrote=lambda p: None):
    """Two Adagrad steps with ``gate.mul_(0.9)`` between them; ``shift`` shares gate's version
    counter (views that ``model.to(bfloat16)`` gave storages of their own)."""
    x = tokens(NEW8, 1, 1, 0)
    for i in range(2):
        if i:
            gate = m.blocks[0].gate
            with torch.no_grad():
                gate.mul_(0.9)
            wrote(gate)
        torch.manual_seed(0)
        loss_of(m(x), x).backward()
        o.step()
        o.zero_grad()
    return values(m)


class PlainMasters:
    """The documented reference written out: torch.optim's class on fp32 copies of the
    parameters, rounded back after each step; the user reads again the master of the
    parameter they wrote."""

    def __init__(self, m, cls, kw):
        self.params = list(m.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = cls(self.masters, **kw)

    def wrote(self, p):
        self.masters[[id(q) for q in self.params].index(id(p))].copy_(p.detach().float())

    def step(self):
        for mm, p in zip(self.masters, self.params, strict=True):
            mm.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for mm, p in zip(self.masters, self.params, strict=True):
                p.copy_(mm)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def test_new8_reference_reads_again_only_the_parameter_written():
    # The reference was wrong: MasterRef read again the master of every parameter whose
    # version counter moved, and ``gate.mul_`` moves ``shift``'s too, so ``shift``'s fp32
    # master was replaced by its bf16 value; stream_parameters reads again the masters of the
    # parameters whose bytes were written (Hosted.version), as the user's loop does
    cls, kw = OPTIMIZERS["adagrad"]
    plain_model, ref, off = build(NEW8), build(NEW8), build(NEW8)
    plain = PlainMasters(plain_model, cls, kw)
    want = train_with_an_edit(plain_model, plain, plain.wrote)
    master_ref = MasterRef(ref, cls, kw, False)
    assert_same(want, train_with_an_edit(ref, master_ref, lambda p: master_ref.wrote([p])),
                "MasterRef")  # fmt: skip
    handle = to.stream_parameters(off, budget_bytes=1 << 20, unit="leaves", prefetch_depth=0,
                                  use_streams=False)  # fmt: skip
    opt = to.OffloadedOptimizer(off.parameters(), cls, **kw)
    try:
        assert_same(want, train_with_an_edit(off, opt), "stream_parameters")
    finally:
        opt.remove()
        handle.remove()


@pytest.mark.parametrize("part", ["host", "device"])
def test_new8_resident_optimizer_after_an_edit_of_a_view(part):
    # The counter gate.mul_ moved is shift's too: shift's master was read again from its bf16
    # value (1 ulp off after the next step); now a member of a family whose counter moved is
    # read again only if its bytes changed (Note: [Parameters that share a storage]). On the
    # device part (offload_fraction=0.5 keeps gate and shift there) as on the host part
    cls, kw = OPTIMIZERS["adagrad"]
    split = {"offload_fraction": 0.5} if part == "device" else {}
    plain_model, off = build(NEW8), build(NEW8)
    plain = PlainMasters(plain_model, cls, kw)
    want = train_with_an_edit(plain_model, plain, plain.wrote)
    opt = to.OffloadedOptimizer(off.parameters(), cls, **kw, **split)
    names = [n for n, _ in off.named_parameters()]
    kept = [names[i] for i in opt._device.index] if opt._device is not None else []
    assert ("blocks.0.shift" in kept) == (part == "device")
    try:
        assert_same(want, train_with_an_edit(off, opt), "parameters")  # blocks.0.shift
        # the masters a state_dict() holds after one more edit: shift's is still its own
        with torch.no_grad():
            for m in (plain_model, off):
                m.blocks[0].gate.mul_(0.9)
        plain.wrote(plain_model.blocks[0].gate)
        state = opt.state_dict()["state"]  # each master in its parameter's state entry
        masters = [state[i]["torchoffload_master"] for i in range(len(names))]
        assert_same(plain.masters, masters, "masters")
    finally:
        opt.remove()


NEW11 = replace(NEW8, shared_storage=False, dtype="float32")


def test_new11_edit_after_a_backward_that_raised():
    # stream_parameters drops what a backward loaded when the pass ends (a queued callback);
    # after a backward that raised (the callback never runs) the parameters stayed bound to
    # their device copies until the next forward, and an edit wrote the device copy only: the
    # host store kept the old values (found by the fuzzer after a refused
    # zero_grad(set_to_none=False) and a refused backward). Note: [A backward that raised]
    ref, off = build(NEW11), build(NEW11)
    handle = to.stream_parameters(off, budget_bytes=1 << 20, unit="leaves", prefetch_depth=0,
                                  use_streams=False)  # fmt: skip
    opt = to.OffloadedOptimizer(off.parameters(), torch.optim.SGD, lr=0.05)
    plain = torch.optim.SGD(ref.parameters(), lr=0.05)
    x = tokens(NEW11, 1, 2, 0)
    try:
        for m, o in ((ref, plain), (off, opt)):
            loss_of(m(x), x).backward()
            o.step()
        with pytest.raises(RuntimeError, match="consumed"):  # no zero_grad(): refused
            loss_of(off(x), x).backward()
        for m in (ref, off):
            with torch.no_grad():
                m.head.weight.mul_(0.9)  # the unit backward reached first
        assert_same(values(ref), values(off), "parameters")  # head.weight: the edit lost
    finally:
        opt.remove()
        handle.remove()


@pytest.mark.parametrize("op", ["read", "convert"])
def test_gradients_a_step_wrote_read_or_converted_before_step(op):
    # With a class that writes its gradients, after a plain backward whose step taken during
    # backward wrote them, the machine's read of the gradients (or model.to(float64)) brought
    # them back: the recall undid that step and raised mid-way, leaving the written gradients
    # for step() to step (or the model half converted). Found by the fuzzer once it drew
    # SGDWritesGrad. Note: [Written gradients brought back]
    ref, off = build(SPEC), build(SPEC)
    cls, kw = OPTIMIZERS["sgd_writes_grad"]
    opt = to.OffloadedOptimizer(off.parameters(), cls, bucket_bytes=64, **kw)
    plain = cls(ref.parameters(), **kw)
    try:
        for m in (ref, off):
            loss_of(m(X), X).backward()
        for bucket in opt._runtime.buckets:  # each sent taken: the first stepped wrote them
            assert not bucket.dispatched or bucket.handled.wait(10)
        assert any(b.grads_written for b in opt._runtime.buckets)
        if op == "read":  # those it cannot read back read as "moved"
            same_grads(grads(ref), grads(off), "gradient")
        else:
            for dtype in (torch.float64, torch.float32):
                refused = refused_or_same(lambda d=dtype: values(off.to(d)),
                                          lambda d=dtype: values(ref.to(d)),
                                          lambda: values(off), f"to({dtype})")  # fmt: skip
                assert not refused
        opt.step()
        plain.step()
        assert_same(values(ref), values(off), "after step()")
    finally:
        opt.remove()
