"""Faults as a set, for every mode: each leaves nothing behind (pool bytes, saved-tensor hooks,
module hooks; device bytes on the GPU) and the model trains or serves exactly as before.

The harness is device-generic: test_faults_gpu.py runs the same faults on CUDA, with real
out-of-memory errors and the copy streams slowed so that copies are in flight.
"""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
from torch import nn

from torchoffload import (
    ActivationOffloadConfig,
    PinnedPool,
    PoolExhaustedError,
    apply_activation_offloading,
    minimum_budget,
    offload_activations,
    stream_weights,
    testing,
)
from torchoffload._saved import PARAMS
from torchoffload.models import GPT, GPTConfig
from torchoffload.testing import InjectedCopyError
from torchoffload.weights._runtime import STREAMED

CFG = GPTConfig(hidden=64, layers=4, heads=2, vocab=128, max_seq=33)
ACTIVATION_MODES = ["context", "layers", "stream"]


@pytest.fixture(autouse=True, scope="module")
def frozen_heap():
    """The tests here run gc.collect() four times each (nothing may be left behind), and each
    full collection walks every object alive, most of them torch's and earlier tests' (0.2 s
    a collection, most of this module's time). Collect once, then freeze what is alive: later
    collections walk only the objects created after, which hold everything a test makes."""
    import torch._dynamo  # noqa: F401  (imported by the first handle otherwise: walked after)

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def make(device="cpu"):
    """The test GPT with a `testing.Fault` inside layer 1 (an identity until armed)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    model.layers[1].ln2 = nn.Sequential(model.layers[1].ln2, testing.Fault())
    return model.to(device)


def batches(n, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (2, 33), generator=g).to(device) for _ in range(n)]


def hooks_installed() -> bool:
    """Whether saved-tensor hooks are pushed on this thread."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def in_flight(device):
    """Copies stay in flight: slowed copy streams on CUDA, D2H events held "not done" on CPU."""
    if torch.device(device).type == "cuda":
        return testing.slow_copies(device, cycles=5_000_000)
    return testing.simulated_async_copies()


def oom(device):
    """What `testing.Fault` is armed with for an out-of-memory error: on CUDA a request for
    more device memory than there is (the caching allocator's own error), else an injected
    one."""
    if torch.device(device).type != "cuda":
        return torch.OutOfMemoryError("injected")
    return lambda: torch.empty(1 << 46, dtype=torch.uint8, device="cuda")


class Activations:
    """One model under one activation offloading mode, and the same model's reference."""

    def __init__(self, mode, device="cpu", on_pool_exhausted="fallback"):
        self.mode, self.device = mode, torch.device(device)
        self.model = make(device)
        self.ref = make(device)
        pin = self.device.type == "cuda"
        self.pool = PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=pin)
        cfg = ActivationOffloadConfig(min_bytes=0, on_pool_exhausted=on_pool_exhausted)
        self.ctx = None
        self.handle = None
        self.device_bytes = None
        if mode == "context":
            self.ctx = offload_activations(
                min_bytes=0, pool=self.pool, device=device, on_pool_exhausted=on_pool_exhausted
            )
        elif mode == "layers":
            self.handle = apply_activation_offloading(
                self.model, config=cfg, pool=self.pool, device=device
            )
        else:  # a "stream" plan: the handle runs offload_activations' policy per forward
            from torchoffload.layers import ActivationOffloadHandle, Mode, resolve_layers

            self.handle = ActivationOffloadHandle(
                self.model,
                resolve_layers(self.model, "auto"),
                cfg,
                self.pool,
                device,
                mode=Mode.STREAM,
            )
        self.counts = hook_counts(self.model)
        gc.collect()  # handles other tests dropped release the parameter hook when collected
        self.params_users = PARAMS._users  # the layer mode's handle holds one
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=1e-2)

    def forward(self, tokens):
        with self.ctx if self.ctx is not None else contextlib.nullcontext():
            return self.model.loss(tokens)

    def offloaded(self):
        return (self.ctx or self.handle).stats().offloaded_tensors

    def step(self, tokens):
        """One training step of the model and of the reference; both losses and gradients
        must be bitwise equal."""
        loss = self.forward(tokens)
        loss.backward()
        ref = self.ref.loss(tokens)
        ref.backward()
        assert torch.equal(loss, ref)
        for (name, p), q in zip(self.model.named_parameters(), self.ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
        self.opt.step()
        self.ref_opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ref_opt.zero_grad(set_to_none=True)

    def assert_clean(self):
        """Nothing left behind by a failed step: every pool byte back, no saved-tensor hooks
        pushed, the handle's module hooks as they were, the parameter hook's users as they
        were, no gradient left on a parameter (set_to_none clears what a failed backward
        accumulated)."""
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        assert not hooks_installed()
        assert hook_counts(self.model) == self.counts
        assert PARAMS._users == self.params_users
        s = self.pool.stats()
        assert s.used_bytes == 0 and s.pending_bytes == 0, s
        if self.device.type == "cuda":  # device bytes as after the first good step
            now = torch.cuda.memory_allocated(self.device)
            if self.device_bytes is None:
                self.device_bytes = now
            assert now == self.device_bytes, (now, self.device_bytes)

    def assert_usable(self, steps=2):
        before = self.offloaded()
        for i in range(steps):
            self.step(batches(steps, self.device, seed=7)[i])
        assert self.offloaded() > before
        self.assert_clean()

    def close(self):
        if self.handle is not None:
            self.handle.remove()


# -- activation faults: each returns after the faulted step, having checked its error ---------


def fault_oom(h):
    """Device memory runs out inside layer 1's forward while earlier layers' copies are in
    flight."""
    with in_flight(h.device):
        testing.Fault.armed = oom(h.device)
        with pytest.raises(torch.OutOfMemoryError):
            h.forward(batches(1, h.device)[0])


def fault_pool_cap(h):
    """The pool's capacity is hit mid-forward under on_pool_exhausted="raise"."""
    held = []
    with contextlib.suppress(PoolExhaustedError):  # someone else holds the whole pool
        while True:
            held.append(h.pool.allocate(4 << 20, on_exhausted="raise"))
    with contextlib.suppress(PoolExhaustedError):
        while True:
            held.append(h.pool.allocate(4096, on_exhausted="raise"))
    try:
        with pytest.raises(PoolExhaustedError):
            h.forward(batches(1, h.device)[0])
    finally:
        for block in held:
            h.pool.free(block)


def fault_pinning_refused(h, monkeypatch):
    """Pinning a new slab is refused (cudaHostAlloc fails) mid-forward."""
    refuse_pinning(h.pool, monkeypatch)
    with pytest.raises(RuntimeError):
        h.forward(batches(1, h.device)[0])
    monkeypatch.undo()


def fault_offload_copy(h):
    """A device-to-host copy fails to queue in the middle of forward."""
    fail = testing.failing_copies(h.device, at=5, kinds=("offload",))
    with in_flight(h.device), fail, pytest.raises(InjectedCopyError):
        h.forward(batches(1, h.device)[0])


def fault_reload_copy(h):
    """A host-to-device copy fails in the middle of backward: backward raises, the graph is
    dropped."""
    loss = h.forward(batches(1, h.device)[0])
    fail = testing.failing_copies(h.device, at=3, kinds=("reload",))
    with fail, pytest.raises(InjectedCopyError):
        loss.backward()


def fault_interrupt_between(h):
    """Ctrl-C after forward, before backward: the graph goes with the exception."""
    with in_flight(h.device), pytest.raises(KeyboardInterrupt):
        loss = h.forward(batches(1, h.device)[0])
        assert loss.requires_grad
        raise KeyboardInterrupt


def fault_no_backward(h):
    """Forwards whose backward never runs (the loss is dropped), three in a row."""
    with in_flight(h.device):
        for tokens in batches(3, h.device):
            h.forward(tokens)


def fault_interrupt_in_forward(h):
    """Ctrl-C inside layer 1's forward (a BaseException skips always_call hooks)."""
    with in_flight(h.device):
        testing.Fault.armed = KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            h.forward(batches(1, h.device)[0])
    if h.handle is not None:
        h.forward(batches(1, h.device)[0])  # the next forward recovers the interrupted one


ACTIVATION_FAULTS = {
    "oom": fault_oom,
    "pool_cap": fault_pool_cap,
    "pinning_refused": fault_pinning_refused,
    "offload_copy": fault_offload_copy,
    "reload_copy": fault_reload_copy,
    "interrupt_between": fault_interrupt_between,
    "no_backward": fault_no_backward,
    "interrupt_in_forward": fault_interrupt_in_forward,
}


def refuse_pinning(pool, monkeypatch):
    """The pool's next slab cannot be pinned: on CUDA a real refusal (the host allocator asked
    for 64 TiB of page-locked memory), on CPU an injected one."""

    def grow(span):
        if torch.cuda.is_available():
            torch.empty(1 << 46, dtype=torch.uint8, pin_memory=True)
        raise RuntimeError("CUDA error: cudaHostAlloc refused (injected)")

    monkeypatch.setattr(pool, "_grow", grow)


def run_activation_fault(mode, fault, device, monkeypatch):
    h = Activations(mode, device, on_pool_exhausted="raise" if fault == "pool_cap" else "fallback")
    try:
        h.step(batches(1, device, seed=3)[0])  # a good step first: the pool has slabs
        h.assert_clean()
        if fault == "pinning_refused":
            h.pool.release()  # no slab left: the next forward must pin one
            fault_pinning_refused(h, monkeypatch)
        else:
            ACTIVATION_FAULTS[fault](h)
        if mode == "context" and fault == "interrupt_in_forward":
            # offload_activations' __exit__ runs for a BaseException too: nothing to recover
            pass
        h.assert_clean()
        h.assert_usable()
    finally:
        testing.Fault.armed = None
        h.close()


@pytest.mark.parametrize("fault", list(ACTIVATION_FAULTS))
@pytest.mark.parametrize("mode", ACTIVATION_MODES)
def test_activation_fault_leaves_nothing_and_the_model_trains_on(mode, fault, monkeypatch):
    run_activation_fault(mode, fault, "cpu", monkeypatch)


@pytest.mark.parametrize("mode", ["layers", "stream"])
def test_remove_with_copies_in_flight_then_backward(mode):
    """remove() between forward and backward, its copies still in flight: backward still
    runs on the saved tensors, bitwise, and everything is returned once the copies end."""
    h = Activations(mode)
    tokens = batches(1)[0]
    with in_flight(h.device) as hooks:
        loss = h.forward(tokens)
        assert h.pool.stats().used_bytes > 0
        h.handle.remove()
        assert hook_counts(h.model) == hook_counts(make())
        loss.backward()
        ref = h.ref.loss(tokens)
        ref.backward()
        for p, q in zip(h.model.parameters(), h.ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        del loss
        hooks.complete_events()
    gc.collect()
    assert h.pool.stats().used_bytes == 0 and not hooks_installed()
    assert PARAMS._users == h.params_users - (1 if mode == "layers" else 0)


# -- weight streaming faults ------------------------------------------------------------------


class Weights:
    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.ref = make(device).eval()
        self.model = make(device).eval()
        self.handle = stream_weights(
            self.model,
            device,
            budget_bytes=minimum_budget(self.model, unit="blocks"),
            unit="blocks",
            pin_memory=self.device.type == "cuda",
        )
        self.counts = hook_counts(self.model)

    def call(self, tokens):
        with torch.no_grad():
            return self.model(tokens)

    def assert_usable(self):
        """Serves bitwise; afterwards, device bytes as after the first check. (An interrupted
        call is recovered by the next one: until then its frame, and the input it holds, stay
        referenced, so bytes are compared after the calls.)"""
        with torch.no_grad():
            for i in range(3):
                x = batches(3, self.device, seed=11)[i]
                assert torch.equal(self.model(x), self.ref(x))
            del x
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            now = torch.cuda.memory_allocated(self.device)
            if getattr(self, "device_bytes", None) is None:
                self.device_bytes = now
            assert now == self.device_bytes, (now, self.device_bytes)
        rt = self.handle._runtime
        assert rt._call is None and not any(u.busy for u in rt.units)
        assert hook_counts(self.model) == self.counts

    def close(self):
        self.handle.remove()
        for p, q in zip(self.model.parameters(), self.ref.parameters(), strict=True):
            assert torch.equal(p, q)
        assert not any(STREAMED.get(p) is not None for p in self.model.parameters())


def weight_fault_oom(w):
    with in_flight(w.device):
        testing.Fault.armed = oom(w.device)
        with pytest.raises(torch.OutOfMemoryError):
            w.call(batches(1, w.device)[0])


def weight_fault_load_copy(w):
    fail = testing.failing_copies(w.device, at=3, kinds=("load",))
    with in_flight(w.device), fail, pytest.raises(InjectedCopyError):
        w.call(batches(1, w.device)[0])


def weight_fault_interrupt(w):
    with in_flight(w.device):
        testing.Fault.armed = KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            w.call(batches(1, w.device)[0])


WEIGHT_FAULTS = {
    "oom": weight_fault_oom,
    "load_copy": weight_fault_load_copy,
    "interrupt_in_forward": weight_fault_interrupt,
}


def run_weight_fault(fault, device):
    w = Weights(device)
    try:
        w.assert_usable()
        WEIGHT_FAULTS[fault](w)
        w.assert_usable()
    finally:
        testing.Fault.armed = None
        w.close()


@pytest.mark.parametrize("fault", list(WEIGHT_FAULTS))
def test_weight_fault_leaves_a_usable_model(fault):
    run_weight_fault(fault, "cpu")


def test_pinning_refused_at_stream_weights_leaves_the_model_untouched(monkeypatch):
    import torchoffload.weights._runtime as runtime

    ref = make().eval()
    model = make().eval()
    counts = hook_counts(model)

    def refuse(nbytes, *, pin):
        raise RuntimeError("could not page-lock 0.01 GiB of host memory (injected)")

    monkeypatch.setattr(runtime, "pinned_buffer", refuse)
    with pytest.raises(RuntimeError, match="page-lock"):
        stream_weights(model, "cpu", budget_bytes=1 << 22, pin_memory=False)
    monkeypatch.undo()
    assert hook_counts(model) == counts
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q) and STREAMED.get(p) is None
    x = batches(1)[0]
    with stream_weights(model, "cpu", budget_bytes=1 << 22, pin_memory=False), torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_model_copies_are_independent_of_faults():
    """A deepcopy taken before a fault is unaffected by it (sanity of the harness itself)."""
    h = Activations("layers")
    snapshot = copy.deepcopy(h.model)
    fault_oom(h)
    h.assert_clean()
    for p, q in zip(h.model.parameters(), snapshot.parameters(), strict=True):
        assert torch.equal(p, q)
    h.close()
