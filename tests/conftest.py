from __future__ import annotations

import copy
import os
import threading

import pytest

# CPU compiles in the suite (Inductor's C++ kernels, AOTInductor's wrapper) build with gcc on
# CI's two cores, about 600 s of a run. Scalar kernels and an unoptimized wrapper build faster
# (test_compile_package.py and test_compile_streamed.py from a cold cache: 241 s against 272 s);
# what the tests check, our passes and engines around the compiled code, does not depend on
# whether Inductor vectorizes, and each comparison's two sides compile under the same settings.
# Read when Inductor's config is imported: set before torch.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")

import torch  # noqa: E402

from torchoffload.models import GPT, GPTConfig  # noqa: E402

# cuBLAS reads this when its first handle is created: deterministic GEMMs for GPU parity tests.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

SMALL = GPTConfig(hidden=64, layers=2, heads=2, vocab=128, max_seq=33)


class EmbedResidual(torch.nn.Module):
    """Issue 38's model, ``emb -> h + fc2(relu(fc1(ln(h)))) -> head``: Inductor computes the
    embedding gather again inside the kernel of the residual add, after the MLP's probes."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.ln = torch.nn.LayerNorm(32)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 50, bias=False)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc2(torch.relu(self.fc1(self.ln(h))))
        return self.head(h)


def train_steps(model, batches, ctx_factory=None, lr=1e-2, autocast=None):
    """Train ``model`` on ``batches``; return per-step losses and grads and the final params."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for tokens in batches:
        ctx = ctx_factory() if ctx_factory is not None else None
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            if ctx is not None:
                with ctx:
                    loss = model.loss(tokens)
            else:
                loss = model.loss(tokens)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a, b):
    la, ga, pa = a
    lb, gb, pb = b
    for x, y in zip(la, lb, strict=True):
        assert torch.equal(x, y), (x, y)
    for step_a, step_b in zip(ga, gb, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(x, y)


def in_threads(work, args) -> list[BaseException]:
    """Run ``work(a)`` on a thread of its own for each ``a`` in ``args``, all at once; returns
    what they raised (an assertion inside ``work`` included)."""
    errors: list[BaseException] = []

    def run(a):
        try:
            work(a)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.fixture
def gpu_deterministic():
    """GPU parity tests: deterministic kernels and the deterministic (math) attention backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True)
    with sdpa_kernel(SDPBackend.MATH):
        yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def op_pool():
    """A small host pool for the graph ops (torchoffload.compile), reset around each test."""
    import torchoffload
    import torchoffload.compile as toc

    p = torchoffload.PinnedPool(8 << 20, slab_bytes=1 << 20, pin_memory=False)
    toc.set_op_pool(p)
    toc.reset_op_stats()
    yield p
    toc.discard_in_flight()
    toc.set_op_pool(None)
    p.release()


@pytest.fixture
def gpu_pool():
    from torchoffload import PinnedPool

    return PinnedPool(1 << 30, slab_bytes=64 << 20)


@pytest.fixture
def small_gpt():
    def make(dtype=torch.float32, config=SMALL):
        torch.manual_seed(0)
        return GPT(config).to(dtype)

    return make


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, SMALL.vocab, (4, 33), generator=g) for _ in range(3)]


def clone_model(m):
    return copy.deepcopy(m)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say what the deselected tests are: by default (pyproject's addopts) the GPU ones."""
    deselected = len(terminalreporter.stats.get("deselected", []))
    if deselected and "not gpu" in (config.getoption("markexpr") or ""):
        terminalreporter.write_line(
            f"{deselected} deselected tests need a GPU (markers gpu, multi_gpu): run them with "
            "`make gpu-test` on a machine with CUDA (PYTHONPATH=. python3 -m pytest -m gpu)"
        )


def pytest_collection_finish(session):
    """The subprocesses the selected tests wait on start now (background.py)."""
    if not session.config.option.collectonly:
        import background

        background.schedule(session.items)


def pytest_sessionfinish(session, exitstatus):
    import background

    background.stop()
