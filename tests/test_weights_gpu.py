"""Weight streaming on a GPU: parity, memory, races, no host sync, Hugging Face generate."""

from __future__ import annotations

import pytest
import torch
from test_weights import QuantStack  # tests/ is on sys.path, as for conftest
from torch import nn

from torchoffload import stream_weights, testing
from torchoffload.models import GPT, GPTConfig
from torchoffload.testing import GroupedTensor, QuantizedTensor, weight_test_hooks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]

CFG = GPTConfig(hidden=512, layers=8, heads=8, vocab=4096, max_seq=256)
_A = 512


def make(dtype=torch.float32, device="cuda"):
    torch.manual_seed(0)
    return GPT(CFG).to(dtype).to(device).eval()


def block_bytes(dtype=torch.float32):
    b = GPT(GPTConfig(hidden=CFG.hidden, layers=1, heads=CFG.heads)).to(dtype).layers[0]
    return sum((p.numel() * p.element_size() + _A - 1) // _A * _A for p in b.parameters())


def inputs(n=4):
    g = torch.Generator().manual_seed(1)
    shapes = [(2, 64), (1, 200), (4, 17), (2, 64)][:n]
    return [torch.randint(0, CFG.vocab, s, generator=g).cuda() for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("source", ["cuda", "cpu"])
@pytest.mark.parametrize("unit, budget_blocks", [(None, 3), ("leaves", 2), (None, 6)])
def test_parity_bitwise(dtype, source, unit, budget_blocks):
    ref = make(dtype)
    xs = inputs()
    with torch.no_grad():
        expected = [ref(x) for x in xs]
    del ref
    model = make(dtype, source)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    h = stream_weights(model, "cuda", budget_bytes=budget_blocks * block_bytes(dtype) + 4096)
    with torch.inference_mode():
        for rep in range(3):
            if rep == 2:  # the first calls record the schedule and place the kept units
                h.reset_stats()
            for x, e in zip(xs, expected, strict=True):
                assert torch.equal(model(x), e)
    st = h.stats()
    assert st.misses == 0 and st.hits == len(xs) * len(h.units), st
    h.remove()
    for n, p in model.named_parameters():
        assert p.device.type == source and torch.equal(p, values[n])


def _requested(which: str) -> int:
    # Bytes requested from the caching allocator: unlike allocated bytes, these do not depend
    # on which cached block (up to 1 MiB larger) happened to serve a request.
    return torch.cuda.memory_stats()[f"requested_bytes.all.{which}"]


def test_peak_memory_within_budget_plus_activations():
    dtype = torch.bfloat16
    x = torch.randint(0, CFG.vocab, (8, 256), device="cuda")
    ref = make(dtype)
    weights = sum(p.numel() * p.element_size() for p in ref.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = _requested("current")
    with torch.inference_mode():
        expected = ref(x)
    activations = _requested("peak") - base  # includes the output
    del ref
    model = make(dtype, "cpu")
    torch.cuda.synchronize()
    base = _requested("current")  # x and expected
    budget = 3 * block_bytes(dtype) + 4096
    torch.cuda.reset_peak_memory_stats()
    h = stream_weights(model, "cuda", budget_bytes=budget)
    with torch.inference_mode():
        for _ in range(3):
            out = model(x)
            del out  # one output alive at a time, as in the resident run
        out = model(x)
    torch.cuda.synchronize()
    peak = _requested("peak") - base
    st = h.stats()
    print(
        f"\nweights {weights / 2**20:.2f} MiB, budget {budget / 2**20:.2f} MiB, arena "
        f"{st.arena_bytes / 2**20:.2f} MiB, activations {activations / 2**20:.2f} MiB, "
        f"streamed peak {peak / 2**20:.2f} MiB, h2d {st.h2d_bytes / 2**20:.1f} MiB"
    )
    assert torch.equal(out, expected)
    assert st.arena_bytes <= budget and st.peak_device_bytes <= budget
    assert peak <= budget + activations
    assert budget < weights / 2
    h.remove()


class _SlowCompute:
    """A pre-hook on every unit that spins the compute stream before the unit's kernels."""

    def __init__(self, model, handle, cycles):
        self.handles = [
            u.layout.module.register_forward_pre_hook(lambda *_: torch.cuda._sleep(cycles))
            for u in handle._runtime.units
        ]

    def remove(self):
        for hook in self.handles:
            hook.remove()


def _run(model, xs, expected):
    with torch.inference_mode():
        outs = [model(x) for x in xs for _ in range(2)]
    torch.cuda.synchronize()
    twice = [e for e in expected for _ in range(2)]
    return all(torch.equal(o, e) for o, e in zip(outs, twice, strict=True))


def _race(slow: str, dropped: frozenset = frozenset()) -> bool:
    """Stream a GPT with the copy stream, the compute stream or both slowed; return whether
    every output equals the resident model's. ``dropped`` removes waits (tests only)."""
    ref = make()
    xs = inputs(3)
    with torch.no_grad():
        expected = [ref(x) for x in xs]
    model = make()
    h = stream_weights(model, "cuda", budget_bytes=3 * block_bytes() + 4096, unit="blocks")
    weight_test_hooks(h, skip=dropped)
    hooks = None
    try:
        if slow in ("compute", "both"):
            hooks = _SlowCompute(model, h, 4_000_000)
        with testing.slow_copies(cycles=2_000_000 if slow in ("copies", "both") else 0):
            return _run(model, xs, expected)
    finally:
        if hooks:
            hooks.remove()
        h.remove()


@pytest.mark.parametrize("slow", ["copies", "compute", "both"])
def test_race_slowed_streams(slow):
    assert _race(slow)


@pytest.mark.parametrize("dropped, slow", [("ready", "copies"), ("done", "compute")])
def test_race_test_catches_a_missing_wait(dropped, slow):
    """The race test above can fail: without the wait it guards, results are wrong."""
    assert not _race(slow, frozenset({dropped}))


def test_steady_state_has_no_host_sync():
    model = make(torch.bfloat16)
    x = torch.randint(0, CFG.vocab, (2, 64), device="cuda")
    h = stream_weights(model, "cuda", budget_bytes=3 * block_bytes(torch.bfloat16) + 4096)
    with torch.inference_mode():
        model(x)
        model(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                model(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert h.stats().prefetch_issued > 0
    h.remove()


def test_stall_time_is_measured():
    model = make(torch.bfloat16)
    x = torch.randint(0, CFG.vocab, (1, 8), device="cuda")  # tiny compute: copies dominate
    h = stream_weights(
        model, "cuda", budget_bytes=3 * block_bytes(torch.bfloat16) + 4096, time_waits=True
    )
    with torch.inference_mode():
        for _ in range(3):
            model(x)
    st = h.stats()
    print(f"\nstall {st.stall_ms:.3f} ms over {st.calls} calls, h2d {st.h2d_bytes / 2**20:.1f} MiB")
    assert st.stall_ms is not None and st.stall_ms > 0
    h.remove()


# -- composite weights that start on the host ------------------------------------------------


def _to_cuda(model):
    for layer in model.layers:
        w = layer.weight
        layer.weight = nn.Parameter(
            QuantizedTensor(w.qdata.cuda(), w.scale.cuda(), w.dtype), requires_grad=False
        )
        layer.bias.data = layer.bias.data.cuda()
    g = model.experts.grouped
    model.experts.grouped = GroupedTensor([b.cuda() for b in g.buffers], g.scales.cuda())
    return model


def test_composite_weights_from_the_host():
    x = torch.randn(16, 256, device="cuda")
    with torch.no_grad():
        expected = _to_cuda(QuantStack(256, 6))(x)
    model = QuantStack(256, 6)  # on the host, as a model too large for the GPU would be
    originals = [layer.weight for layer in model.layers]
    h = stream_weights(model, "cuda", budget_bytes=2 << 20, prefetch_depth=2, unit="leaves")
    assert all(w.device.type == "cuda" for w in (layer.weight for layer in model.layers))
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), expected)
    h.remove()
    assert [layer.weight for layer in model.layers] == originals
    assert originals[0].qdata.device.type == "cpu" and originals[0].qdata.numel() == 256 * 256
    with torch.no_grad():
        assert torch.allclose(_to_cuda(model)(x), expected)


# -- Hugging Face ------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_hf_llama_generates_the_same_tokens(tie):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    ref = transformers.LlamaForCausalLM(cfg).eval().cuda()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()  # same weights, on the host
    x = torch.randint(1, 1024, (2, 12), device="cuda", generator=None)
    gen = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = ref.generate(x, **gen)
    block = sum(p.numel() * 4 for p in ref.model.layers[0].parameters())
    h = stream_weights(model, "cuda", budget_bytes=4 * block, prefetch_depth=2)
    assert model.device.type == "cuda"
    out = model.generate(x, **gen)
    st = h.stats()
    print(f"\nunits {len(h.units)} ({h.unit_kind}), {st}")
    assert torch.equal(out, expected)
    assert st.schedule_rerecords == 0 and st.calls == gen["max_new_tokens"]
    h.remove()


def test_host_copy_is_pinned_at_its_exact_size():
    """One page-locked host buffer of exactly the streamed bytes, outside PyTorch's caching host
    allocator (which would round 24.1 GiB up to 32)."""
    model = make(torch.bfloat16, "cpu")
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    h = stream_weights(model, "cuda", budget_bytes=3 * block_bytes(torch.bfloat16) + 4096)
    host = h._runtime.host
    assert host.is_pinned()
    unique = {id(p): p for p in model.parameters()}
    assert host.numel() >= h.stats().streamed_bytes
    assert host.numel() - h.stats().streamed_bytes < 512 * len(unique)  # alignment only
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    h.remove()
