"""Cold experts on the host on a GPU (Note: [Cold experts on the host]): each block call's
output equals a reference built from the resident weights, with the experts that ran on the
device computed there and the ones that ran on the host computed on the CPU, added in expert
order, bitwise; with the copy streams slowed, and a planted missing wait of the worker shows
as a wrong block."""

from __future__ import annotations

import pytest
import torch
from test_moe_gpu import qwen3  # tests/ is on sys.path

import torchoffload as to
from torchoffload import testing
from torchoffload.moe import _host

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_deterministic"),
]


def reference(ref_experts, hidden, index, weights, on_host):
    """The resident loop on ``hidden`` with the experts ``on_host`` computed on the CPU."""
    n = ref_experts.num_experts
    final = torch.zeros_like(hidden)
    mask = torch.nn.functional.one_hot(index, num_classes=n + 1).permute(2, 1, 0)
    for e in sorted(set(index.flatten().tolist()) - {n}):
        pos, tok = torch.where(mask[e])
        w = weights[tok, pos, None]
        gu, down = ref_experts.gate_up_proj[e], ref_experts.down_proj[e]
        if e in on_host:
            out = _host.expert_output(ref_experts.act_fn, gu.cpu(), down.cpu(),
                                      hidden[tok].cpu(), w.cpu())  # fmt: skip
            out = out.to(final.dtype).cuda()
        else:
            out = _host.expert_output(ref_experts.act_fn, gu, down, hidden[tok], w)
        final.index_add_(0, tok, out.to(final.dtype))
    return final


def run(dtype, host_compute, slots, cycles, monkeypatch):
    """Decode 12 tokens after a prompt with ``host_compute``; every block call's output
    against `reference` (bitwise): whether all match, and the stats."""
    ref = qwen3(dtype)
    model = qwen3(dtype)
    least = to.minimum_cache_bytes(model)
    h = to.stream_experts(model, "cuda", cache_bytes={"least": least, "middle": 3 * least}[slots],
                          host_compute=host_compute)  # fmt: skip
    on_host: list[list[int]] = []
    start = _host.HostExperts.start

    def recording(self, li, act_fn, inputs, out_dtype):
        on_host[-1] = [e for e, _, _ in inputs]
        return start(self, li, act_fn, inputs, out_dtype)

    monkeypatch.setattr(_host.HostExperts, "start", recording)
    calls = []
    for li, layer in enumerate(model.model.layers):

        def pre(mod, args, li=li):
            on_host.append([])

        def post(mod, args, out, li=li):
            calls.append((li, [a.clone() for a in args], out.clone(), on_host[-1]))

        layer.mlp.experts.register_forward_pre_hook(pre)
        layer.mlp.experts.register_forward_hook(post)
    x = torch.randint(1, 512, (1, 9), generator=torch.Generator().manual_seed(2)).cuda()
    with testing.slow_copies(cycles=cycles):
        model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    same = []
    with torch.no_grad():
        for li, args, out, hosted in calls:
            want = reference(ref.model.layers[li].mlp.experts, *args, set(hosted))
            same.append(torch.equal(out, want))
    st = h.stats()
    h.remove()
    return all(same), st


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("host_compute", [True, "auto"])
@pytest.mark.parametrize("slots", ["least", "middle"])
@pytest.mark.parametrize("cycles", [0, 5_000_000])
def test_blocks_match_the_reference(dtype, host_compute, slots, cycles, monkeypatch):
    same, st = run(dtype, host_compute, slots, cycles, monkeypatch)
    assert same
    assert st.hits + st.misses + st.host_computed == sum(layer.uses for layer in st.layers)
    assert st.h2d_bytes == st.misses * st.layers[0].expert_bytes
    if host_compute is True:
        assert st.host_computed > 0
    print(f"\n{dtype} {host_compute} {slots}: hits {st.hits}, copied {st.misses}, host "
          f"{st.host_computed}")  # fmt: skip


def test_a_missing_wait_of_the_worker_shows(monkeypatch):
    """The worker reads the staged rows without waiting for their (slowed) copy: some block
    computes from stale rows."""
    compute = _host._compute
    monkeypatch.setattr(_host, "_compute", lambda stored, *a: compute(None, *a))
    same, st = run(torch.float32, True, "least", 20_000_000, monkeypatch)
    assert st.host_computed > 0 and not same


def test_measured_rates_and_decode_time():
    """Prints the rates "auto" measures and decode ms per token with host compute off, on
    for every miss, and split (not asserted: the numbers to set the default by)."""
    import time

    for host_compute in (False, True, "auto"):
        model = qwen3(torch.bfloat16)
        h = to.stream_experts(model, "cuda", cache_bytes=to.minimum_cache_bytes(model),
                              host_compute=host_compute)  # fmt: skip
        x = torch.randint(1, 512, (1, 9), generator=torch.Generator().manual_seed(2)).cuda()
        model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=33, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 33 * 1e3
        print(f"\nhost_compute={host_compute!r}: {ms:.2f} ms/token, {h.stats().host_computed} "
              f"host experts; {h.host_compute}")  # fmt: skip
        h.remove()
