"""The fault set of test_faults.py on CUDA: real out-of-memory errors, copies in flight on
slowed copy streams, a real refusal to pin, and device bytes checked flat after each fault."""

from __future__ import annotations

import pytest
import torch
from test_faults import (  # tests/ is on sys.path
    ACTIVATION_FAULTS,
    ACTIVATION_MODES,
    WEIGHT_FAULTS,
    batches,
    hook_counts,
    make,
    run_activation_fault,
    run_weight_fault,
)

from torchoffload import stream_weights
from torchoffload.weights._runtime import STREAMED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("fault", list(ACTIVATION_FAULTS))
@pytest.mark.parametrize("mode", ACTIVATION_MODES)
def test_activation_fault_on_cuda(mode, fault, monkeypatch, gpu_deterministic):
    run_activation_fault(mode, fault, "cuda", monkeypatch)


@pytest.mark.parametrize("fault", list(WEIGHT_FAULTS))
def test_weight_fault_on_cuda(fault, gpu_deterministic):
    run_weight_fault(fault, "cuda")


def test_cuda_host_register_refused_leaves_the_model_untouched(monkeypatch):
    """cudaHostRegister refuses the weight store: stream_weights raises before any weight is
    emptied or any hook is installed; the model runs as before and streams once it can."""
    ref = make("cuda").eval()
    model = make("cuda").eval()
    counts = hook_counts(model)
    real = torch.cuda.cudart()

    class Refusing:
        def cudaHostRegister(self, ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    with pytest.raises(RuntimeError, match="could not page-lock"):
        stream_weights(model, "cuda", budget_bytes=1 << 22)
    monkeypatch.undo()
    assert hook_counts(model) == counts
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q) and STREAMED.get(p) is None
    x = batches(1, "cuda")[0]
    with stream_weights(model, "cuda", budget_bytes=1 << 22), torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_weight_remove_with_copies_in_flight(gpu_deterministic):
    """remove() right after a call whose weight copies are still queued on the slowed copy
    stream: the weights come back bitwise and the model runs resident as before."""
    from test_faults import Weights

    from torchoffload import testing

    w = Weights("cuda")
    x = batches(1, "cuda")[0]
    with testing.slow_copies("cuda", cycles=20_000_000), torch.no_grad():
        for _ in range(3):
            w.model(x)
        w.handle.remove()  # copies of this call may still be running
    w.close()  # every parameter bitwise equal to the reference, none streamed
    with torch.no_grad():
        assert torch.equal(w.model(x), w.ref(x))


@pytest.mark.parametrize("mode", ["layers", "stream"])
def test_activation_remove_with_copies_in_flight(mode, gpu_deterministic):
    """remove() between forward and backward while the slowed D2H copies still run: backward
    is bitwise, and every pool and device byte is returned once they end."""
    import gc

    from test_faults import Activations, hooks_installed

    from torchoffload import testing

    h = Activations(mode, "cuda")
    h.step(batches(1, "cuda", seed=3)[0])
    h.assert_clean()
    tokens = batches(1, "cuda")[0]
    with testing.slow_copies("cuda", cycles=20_000_000):
        loss = h.forward(tokens)
        h.handle.remove()
        assert h.pool.stats().used_bytes > 0
        loss.backward()
    ref = h.ref.loss(tokens)
    ref.backward()
    assert torch.equal(loss, ref)
    for p, q in zip(h.model.parameters(), h.ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    del loss, ref, tokens
    h.opt.zero_grad(set_to_none=True)
    h.ref_opt.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    assert h.pool.stats().used_bytes == 0 and not hooks_installed()
    assert torch.cuda.memory_allocated() == h.device_bytes
