"""Several threads, each training its own model under activation offloading in one process:
each result is what it is alone. (One streamed model served from several threads is in
test_weights_contract.py; two devices from one process in test_concurrency_gpu.py.)"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from torchoffload import (
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    default_pool,
    offload_activations,
)
from torchoffload._saved import PARAMS
from torchoffload.models import GPT, GPTConfig

CFG = GPTConfig(hidden=64, layers=4, heads=2, vocab=128, max_seq=33)


def make(seed, device):
    torch.manual_seed(seed)
    return GPT(CFG).to(device)


def data(seed, n, device):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (2, 33), generator=g).to(device) for _ in range(n)]


def train(model, batches, ctx=None):
    """Losses and final parameters of plain SGD steps (``ctx``: a factory of a context manager
    around each forward)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches:
        if ctx is None:
            loss = model.loss(tokens)
        else:
            with ctx():
                loss = model.loss(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


def attach(kind, model, pool, device):
    """Returns (handle or None, ctx factory or None)."""
    if kind == "layers":
        cfg = ActivationOffloadConfig(min_bytes=0, skip_last_layers=0)
        return apply_activation_offloading(model, config=cfg, pool=pool, device=device), None
    ctx = offload_activations(min_bytes=0, pool=pool, device=device)
    return None, lambda: ctx


def run_threads(kinds, device, steps=12, shared_pool=False):
    """One thread per entry of ``kinds``, each training its own model (seeded by its index)
    under that kind of offloading, all at once; checked against each model trained alone."""
    pin = torch.device(device).type == "cuda"
    common = default_pool() if shared_pool else None
    refs = [train(make(i, device), data(i, steps, device)) for i in range(len(kinds))]
    models = [make(i, device) for i in range(len(kinds))]  # the global RNG: made here
    results: list = [None] * len(kinds)
    errors: list = []
    stats: list = [None] * len(kinds)
    start = threading.Barrier(len(kinds))

    def worker(i, kind):
        try:
            model = models[i]
            pool = common or PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=pin)
            handle, ctx = attach(kind, model, pool, device)
            start.wait()
            results[i] = train(model, data(i, steps, device), ctx)
            stats[i] = (handle or ctx()).stats()
            if handle is not None:
                handle.remove()
        except BaseException as e:  # reported by the main thread
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i, k)) for i, k in enumerate(kinds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (ref, got) in enumerate(zip(refs, results, strict=True)):
        for a, b in zip(ref[0], got[0], strict=True):
            assert torch.equal(a, b), (i, kinds[i])
        for a, b in zip(ref[1], got[1], strict=True):
            assert torch.equal(a, b), (i, kinds[i])
        assert stats[i].offloaded_tensors > 0 and stats[i].prefetch_misses >= 0
    return stats


@pytest.mark.parametrize(
    "kinds", [("layers", "layers"), ("layers", "context"), ("context", "context", "layers")]
)
def test_threads_each_training_their_own_model(kinds):
    gc.collect()  # handles dropped by other tests release the parameter hook when collected
    users = PARAMS._users
    run_threads(kinds, "cpu")
    assert PARAMS._users == users


def test_threads_share_the_default_pool():
    pool = default_pool(False)
    before = pool.stats().used_bytes
    run_threads(("layers", "context", "layers", "context"), "cpu", steps=8, shared_pool=True)
    assert pool.stats().used_bytes == before


class Meet(torch.nn.Module):
    """Waits at ``barrier`` (when set) in the middle of a layer's forward: two threads calling
    one model are then both inside it at once, as DataParallel's replicas are."""

    def __init__(self):
        super().__init__()
        self.barrier: threading.Barrier | None = None

    def forward(self, x):
        if self.barrier is not None:
            self.barrier.wait(timeout=30)
        return x


@pytest.mark.parametrize("mode", ["layers", "stream"])
def test_one_model_called_from_two_threads_at_once(mode):
    # One session for the handle made the second thread's call look nested in the first: its
    # layers saved past the hooks, and it popped hooks from its own empty stack (a torch
    # internal assert), leaving the handle stuck in "forward".
    import dataclasses

    from torchoffload import plan
    from torchoffload.models import BlockStack

    torch.manual_seed(0)
    model = BlockStack(hidden=64, layers=4, heads=2).requires_grad_(False)
    meet = Meet()
    model.layers[1].ln2 = torch.nn.Sequential(meet, model.layers[1].ln2)
    xs = [torch.randn(2, 32, 64) for _ in range(2)]

    def grad(x):  # of the input: the parameters, shared by the threads, are frozen
        x = x.clone().requires_grad_()
        model(x).pow(2).mean().backward()
        return x.grad

    refs = [grad(x) for x in xs]
    pool = PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=False)
    if mode == "layers":
        cfg = ActivationOffloadConfig(min_bytes=0, skip_last_layers=0)
        handle = apply_activation_offloading(model, config=cfg, pool=pool, device="cpu")
    else:
        p = plan(model, (xs[0].clone().requires_grad_(),), budget_bytes=None, min_bytes=0)
        p = dataclasses.replace(p, decisions=("stream",) * 4)
        handle = p.apply(model, pool=pool, device="cpu")
    results: list = [None, None]
    errors: list = []

    def worker(i):
        try:
            results[i] = grad(xs[i])
        except BaseException as e:  # reported by the main thread
            errors.append((i, repr(e)))

    meet.barrier = threading.Barrier(2)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    meet.barrier = None
    assert not errors, errors
    assert all(torch.equal(a, b) for a, b in zip(refs, results, strict=True))
    both = handle.stats().offloaded_tensors
    handle.reset_stats()
    assert torch.equal(grad(xs[0]), refs[0])
    assert both == 2 * handle.stats().offloaded_tensors > 0  # each thread's forward offloaded
    handle.remove()  # nothing left in a forward
