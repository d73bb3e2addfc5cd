"""Concurrency on CUDA: threads each training their own model on one GPU, and two GPUs
(`cuda:0`, `cuda:1`) offloading from one process, activations and weights, bitwise against
each model alone."""

from __future__ import annotations

import threading

import pytest
import torch
from test_concurrency import CFG, GPT, data, make, run_threads, train  # tests/ is on sys.path

from torchoffload import (
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    minimum_budget,
    offload_activations,
    stream_weights,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kinds", [("layers", "layers"), ("layers", "context", "layers")])
def test_threads_each_training_their_own_model_on_one_gpu(kinds, gpu_deterministic):
    run_threads(kinds, "cuda:0", steps=10)


def _train_on(device, kind, steps=8, model=None):
    """``model``: made by the caller when several threads train (make() seeds the global RNG,
    which threads share)."""
    model = make(0, device) if model is None else model
    pool = PinnedPool(64 << 20, slab_bytes=1 << 20)
    if kind == "layers":
        cfg = ActivationOffloadConfig(min_bytes=0, skip_last_layers=0)
        handle = apply_activation_offloading(model, config=cfg, pool=pool, device=device)
        out = train(model, data(0, steps, device))
        stats = handle.stats()
        handle.remove()
    else:
        ctx = offload_activations(min_bytes=0, pool=pool, device=device)
        out = train(model, data(0, steps, device), lambda: ctx)
        stats = ctx.stats()
    return out, stats


@two_gpus
@pytest.mark.multi_gpu
@pytest.mark.parametrize("kind", ["layers", "context"])
def test_second_gpu_offloads_while_the_first_is_current(kind, gpu_deterministic):
    """A model on cuda:1 offloaded with device="cuda:1" while cuda:0 is the current device:
    its copies run on cuda:1's streams; results bitwise equal to cuda:1 alone."""
    torch.cuda.set_device(0)
    ref = train(make(0, "cuda:1"), data(0, 8, "cuda:1"))
    (losses, params), stats = _train_on("cuda:1", kind)
    assert stats.offloaded_tensors > 0 and stats.reloaded_tensors > 0
    assert all(torch.equal(a, b) for a, b in zip(ref[0], losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref[1], params, strict=True))
    assert all(p.device == torch.device("cuda:1") for p in params)


@two_gpus
@pytest.mark.multi_gpu
def test_two_gpus_from_two_threads_activations_and_weights(gpu_deterministic):
    """Thread A trains on cuda:0 and thread B on cuda:1 under activation offloading, while
    thread C serves a streamed model on cuda:1; every result bitwise equal to its model alone."""
    refs = {d: train(make(0, d), data(0, 8, d)) for d in ("cuda:0", "cuda:1")}
    torch.manual_seed(5)
    served_ref = GPT(CFG).to("cuda:1").eval()
    served = GPT(CFG).eval()
    served.load_state_dict(served_ref.state_dict())
    served.to("cuda:1")
    xs = data(9, 6, "cuda:1")
    with torch.no_grad():
        expect = [served_ref(x) for x in xs]
    handle = stream_weights(
        served, "cuda:1", budget_bytes=minimum_budget(served, unit="blocks"), unit="blocks"
    )
    results, errors = {}, []
    models = {d: make(0, d) for d in ("cuda:0", "cuda:1")}

    def trainer(device):
        try:
            torch.cuda.set_device(device)
            results[device] = _train_on(device, "layers", model=models[device])
        except BaseException as e:
            errors.append((device, repr(e)))

    def server():
        try:
            with torch.no_grad():
                results["served"] = [served(x) for x in xs for _ in range(3)][::3]
        except BaseException as e:
            errors.append(("served", repr(e)))

    threads = [threading.Thread(target=trainer, args=(d,)) for d in ("cuda:0", "cuda:1")]
    threads.append(threading.Thread(target=server))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handle.remove()
    assert not errors, errors
    for d in ("cuda:0", "cuda:1"):
        (losses, params), stats = results[d]
        assert stats.offloaded_tensors > 0
        assert all(torch.equal(a, b) for a, b in zip(refs[d][0], losses, strict=True)), d
        assert all(torch.equal(a, b) for a, b in zip(refs[d][1], params, strict=True)), d
    assert all(torch.equal(a, b) for a, b in zip(expect, results["served"], strict=True))
