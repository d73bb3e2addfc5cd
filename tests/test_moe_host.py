"""Cold experts on the host (`stream_experts(host_compute=...)`, Note: [Cold experts on the
host]) on the CPU, where the host runs the device's kernels: outputs bitwise the resident
model's; which experts ran where (the policy's choice, nothing copied or cached for a host
expert); the sum in the resident loop's order (a planted wrong order is caught); the worker
waits for the copy of its rows (a planted missing wait is caught); errors, bad options."""

from __future__ import annotations

import pytest
import torch

import torchoffload as to
from torchoffload._transfer import InjectedCopyError
from torchoffload.moe import HostCompute, HostPolicy, _host
from torchoffload.moe._host import split
from torchoffload.testing import failing_copies

transformers = pytest.importorskip("transformers")

# equal rates: a split gives the host half the misses (the fewer half when odd)
EVEN = HostCompute(max_tokens=8, link_bytes_per_s=1.0, host_bytes_per_s=1.0)


def qwen3(dtype=torch.float32, top_k=4, layers=2):
    """Top 4 of 8: a token's output sums four experts, so the order of the sum shows."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=top_k, max_position_embeddings=64,
        experts_implementation="eager",
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg).to(dtype).eval()


def ids(batch, seq, seed):
    return torch.randint(1, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def routed(model):
    """Forward hooks on a resident model's experts: each block call's routed experts, sorted."""
    calls = []
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            m.register_forward_hook(
                lambda mod, a, out: calls.append(sorted(set(a[1].flatten().tolist())))
            )
    return calls


def stream(model, slots, host_compute, **kw):
    least = to.minimum_cache_bytes(model)
    cache = {"least": least, "middle": 5 * least // 4, "all": 1 << 30}[slots]
    return to.stream_experts(model, "cpu", cache_bytes=cache, pin_memory=False,
                             host_compute=host_compute, **kw)  # fmt: skip


GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("host_compute", [True, EVEN, "auto"], ids=["all", "split", "auto"])
@pytest.mark.parametrize("slots", ["least", "middle", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_bitwise_and_counted(host_compute, slots, dtype):
    """A prefill (10 tokens: every miss copied) then decode steps of 2 tokens (misses on the
    host by the policy): tokens and logits bitwise; every routed expert counted once, as a
    hit, a copy or a host expert; only copies cross the link."""
    ref, model = qwen3(dtype), qwen3(dtype)
    uses = routed(ref)
    want = ref.generate(ids(2, 5, 1), **GEN)
    with torch.no_grad():
        want_logits = [ref(ids(1, s, 10 + s)).logits for s in (1, 3, 9)]
    h = stream(model, slots, host_compute)
    assert torch.equal(model.generate(ids(2, 5, 1), **GEN), want)
    with torch.no_grad():
        for s, w in zip((1, 3, 9), want_logits, strict=True):
            assert torch.equal(model(ids(1, s, 10 + s)).logits, w)
    st = h.stats()
    assert st.hits + st.misses + st.host_computed == sum(len(u) for u in uses)
    assert sum(layer.host_computed for layer in st.layers) == st.host_computed
    assert st.h2d_bytes == st.misses * st.layers[0].expert_bytes and st.unused == 0
    assert st.hit_rate == st.hits / (st.hits + st.misses + st.host_computed)
    if slots != "all" and host_compute != "auto":  # (all: the prefill cached every expert;
        # auto on the CPU: a tiny expert's host round trip is measured slower than its copy)
        assert st.host_computed > 0
    h.remove()
    assert torch.equal(model.generate(ids(2, 5, 1), **GEN), want)


def test_split():
    assert [split(m, 1.0, 1.0) for m in range(6)] == [0, 0, 1, 1, 2, 2]
    assert split(8, 1.0, 3.0) == 2  # max(6, 6): a host expert costs three copies
    assert split(8, 1.0, 1e9) == 0 and split(8, 1e9, 1.0) == 8
    assert split(3, 2.0, 1.0) == 2  # max(2, 2) against max(4, 1)
    # a host job's fixed cost is paid once, whatever its experts
    assert split(8, 1.0, 1.0, 2.0) == 3  # max(5, 2 + 3) against max(4, 2 + 4)
    assert split(8, 1.0, 1.0, 8.0) == 0  # the host never beats the link's 8
    assert split(8, 1.0, 3.0, 0.0) == split(8, 1.0, 3.0) == 2


@pytest.mark.parametrize("policy", ["all", "split"])
def test_which_experts_run_where(policy, monkeypatch):
    """An empty cache that holds every expert: a token's first call misses its routed experts
    (all on the host, or the last half by equal rates), and the same token's second call hits
    the copied ones and computes the rest on the host again: a host expert is never copied
    nor cached."""
    host_compute = True if policy == "all" else EVEN
    ref, model = qwen3(), qwen3()
    uses = routed(ref)
    x = ids(1, 1, 3)
    with torch.no_grad():
        want = ref(x).logits
    h = stream(model, "all", host_compute)
    on_host = []
    start = _host.HostExperts.start

    def recording(self, li, act_fn, inputs, out_dtype):
        on_host.append((li, [e for e, _, _ in inputs]))
        return start(self, li, act_fn, inputs, out_dtype)

    monkeypatch.setattr(_host.HostExperts, "start", recording)
    with torch.no_grad():
        assert torch.equal(model(x).logits, want)
        first = list(on_host)
        on_host.clear()
        assert torch.equal(model(x).logits, want)
    r = uses[:2]  # each layer's routed experts (the same in both calls)
    if policy == "all":
        assert first == on_host == [(0, r[0]), (1, r[1])]
        assert h.cached() == [] and h.stats().h2d_bytes == 0
        assert h.stats().host_computed == 16
        return
    assert first == [(0, r[0][2:]), (1, r[1][2:])]  # 4 misses: the last 2 on the host
    assert on_host == [(0, r[0][3:]), (1, r[1][3:])]  # 2 misses: the last one
    names = h.layers
    assert h.cached() == sorted((names[li], e) for li in (0, 1) for e in r[li][:3])
    st = h.stats()
    assert (st.hits, st.misses, st.host_computed) == (4, 6, 6)
    h.remove()


class _HostLast(_host._InOrder):
    """A planted bug: host experts' outputs added after every device expert's."""

    def host(self, token_idx, i):
        self.late = [*getattr(self, "late", []), (token_idx, i)]

    def finish(self):
        for token_idx, i in getattr(self, "late", []):
            self.final.index_add_(0, token_idx, self.job.result(i))


def _experts_outputs(model):
    """Each experts module's outputs, in call order (a list filled by forward hooks)."""
    outs = []
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            m.register_forward_hook(lambda mod, a, out: outs.append(out.clone()))
    return outs


def _decode_matches(model, ref, n=8):
    """Whether ``n`` one- and two-token calls after a prefill give the resident logits and,
    in every block, the resident experts' outputs (a last bit lost in a sum can vanish in
    the residual stream of a small random model: the blocks' outputs show it)."""
    got, want = _experts_outputs(model), _experts_outputs(ref)
    same = []
    with torch.no_grad():
        for m in (model, ref):
            m(ids(2, 8, 0))
        for i in range(n):
            x = ids(1 + i % 2, 1, 100 + i)
            same.append(torch.equal(model(x).logits, ref(x).logits))
    same += [torch.equal(a, b) for a, b in zip(got, want, strict=True)]
    return all(same)


def test_the_order_of_the_sum_is_the_resident_loops(monkeypatch):
    """Hits and copies after a host expert in expert order: its output is added between
    theirs, as the resident loop adds it; added last (planted), the float32 sums round
    differently."""
    ref, model = qwen3(), qwen3()
    h = stream(model, "middle", True)
    assert _decode_matches(model, ref)
    assert h.stats().host_computed > 0 and h.stats().hits > 0
    h.remove()
    monkeypatch.setattr(_host, "_InOrder", _HostLast)
    ref, model = qwen3(), qwen3()
    h = stream(model, "middle", True)
    assert not _decode_matches(model, ref)
    h.remove()


class _Deferred:
    """A D2H that lands only when its event is waited on: rows read before the wait are
    the staging's stale bytes."""

    def __init__(self, pairs):
        self.pairs = [(dst, src.clone()) for dst, src in pairs]
        self.waits = 0

    def synchronize(self):
        self.waits += 1
        for dst, src in self.pairs:
            dst.copy_(src)
        self.pairs = []


class _DeferringEngine:
    def __init__(self, engine):
        self._engine = engine
        self.events = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def offload_many(self, pairs):
        self.events.append(_Deferred(pairs))
        return self.events[-1], None


@pytest.mark.parametrize("wait", [True, False])
def test_the_worker_reads_its_rows_after_their_copy(wait, monkeypatch):
    """The worker waits on the "stored" event of the block's D2H before it reads the rows;
    without the wait (planted) it computes from stale staging."""
    ref, model = qwen3(), qwen3()
    h = stream(model, "least", True)
    rt = h._runtime
    rt.engine = eng = _DeferringEngine(rt.engine)
    if not wait:
        compute = _host._compute
        monkeypatch.setattr(_host, "_compute", lambda stored, *a: compute(None, *a))
    assert _decode_matches(model, ref, n=4) == wait
    assert eng.events and all(ev.waits >= 1 for ev in eng.events)  # closed blocks wait too
    h.remove()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_large_calls_copy_and_graph_calls_do_not_compute_on_the_host():
    ref, model = qwen3(), qwen3()
    h = stream(model, "middle", HostCompute(max_tokens=2, policy="all"))
    with torch.no_grad():
        assert torch.equal(model(ids(1, 3, 0)).logits, ref(ids(1, 3, 0)).logits)
        assert h.stats().host_computed == 0 and h.stats().misses > 0
        assert torch.equal(model(ids(1, 2, 0)).logits, ref(ids(1, 2, 0)).logits)
        assert h.stats().host_computed > 0
    from test_moe_graph import decode

    counts = []

    def counted(step):
        graphed = h.cuda_graph(step)

        def call(*args):
            out = graphed(*args)
            counts.append(h.stats().host_computed)
            return out

        return call

    x = ids(1, 5, 2)
    got, _ = decode(model, x, 6, wrap=counted)
    assert torch.equal(got, decode(ref, x, 6)[0])
    # the first step of a signature runs eagerly (on the host: counted), the others replay
    assert len(counts) == 5 and counts == [counts[0]] * 5
    h.remove()


def test_a_failing_host_expert_leaves_a_usable_model(monkeypatch):
    ref, model = qwen3(), qwen3()
    h = stream(model, "least", True)
    x = ids(1, 1, 5)
    compute = _host._compute

    def fail(*a):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(_host, "_compute", fail)
    with torch.no_grad(), pytest.raises(ZeroDivisionError, match="planted"):
        model(x)
    monkeypatch.setattr(_host, "_compute", compute)
    with (
        torch.no_grad(),
        failing_copies("cpu", kinds=("offload",)),
        pytest.raises(InjectedCopyError),
    ):
        model(x)
    rt = h._runtime
    assert not any(b.active for b in rt.blocks) and all(s.pins == 0 for s in rt.cache.slots)
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    h.remove()
    assert rt.host.closed and rt.host._pool is None


def test_recorded_routing_holds_the_host_experts():
    ref, model = qwen3(), qwen3()
    uses = routed(ref)
    h = stream(model, "least", True)
    with h.record_routing() as rec, torch.no_grad():
        model(ids(1, 1, 7))
        ref(ids(1, 1, 7))
    assert [list(c.experts) for c in rec.profile().calls] == uses
    h.remove()


def workers():
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("torchoffload-host")]


def test_options(monkeypatch):
    model = qwen3()
    running = len(workers())
    h = stream(model, "least", "auto")
    hc = h.host_compute
    assert hc.policy is HostPolicy.SPLIT and hc.max_tokens == 4 and hc.host_threads is None
    assert hc.link_bytes_per_s > 0 and hc.host_bytes_per_s > 0  # measured at setup
    assert hc.host_fixed_s >= 0  # with the host rate: jobs of one and of several experts
    # Note: [The host experts' worker]: the measurement's worker is stopped
    assert len(workers()) == running
    h.remove()
    threads = []
    compute = _host._compute

    def counted(*a):
        threads.append(torch.get_num_threads())
        return compute(*a)

    monkeypatch.setattr(_host, "_compute", counted)
    h = stream(model, "least", HostCompute(policy="all", host_threads=1))
    with torch.no_grad():
        model(ids(1, 1, 0))
    assert threads and set(threads) == {1} and len(workers()) == running + 1
    h.remove()
    assert len(workers()) == running
    h = stream(model, "least", True)
    assert h.host_compute == HostCompute(policy="all")
    h.remove()
    given = HostCompute(link_bytes_per_s=2e10, host_bytes_per_s=1e10)
    h = stream(model, "least", given)
    assert h.host_compute == given  # nothing measured: no fixed cost unless given
    h.remove()
    h = stream(model, "least", HostCompute(host_bytes_per_s=1e10))
    assert h.host_compute.host_fixed_s is None and h.host_compute.link_bytes_per_s > 0
    h.remove()
    h = stream(model, "least", False)
    assert h.host_compute is None and h._runtime.host is None
    h.remove()


def test_the_measured_host_rate_leaves_out_a_jobs_fixed_cost(monkeypatch):
    """Host compute "auto" times jobs of one and of several experts: the fixed cost (staging, the
    worker's wake-up, the copy back) is measured apart, not charged to each expert."""
    jobs = []

    def timed(host, layer, experts, dtype):
        jobs.append(len(experts))
        return 0.010 + 0.002 * len(experts)

    monkeypatch.setattr(_host, "_job_seconds", timed)
    model = qwen3()
    h = stream(model, "least", "auto")
    hc, expert = h.host_compute, h._runtime.layout.layers[0].expert_bytes
    assert jobs[0] == 1 and jobs[1] > 1
    assert hc.host_fixed_s == pytest.approx(0.010)
    assert hc.host_bytes_per_s == pytest.approx(expert / 0.002)
    h.remove()


def test_bad_options_are_refused_changing_nothing():
    from test_moe import moe, same, snapshot

    model = qwen3()
    before = snapshot(model)
    bad = [
        (
            "yes",
            ValueError,
            r"host_compute must be False, True, 'auto' or a HostCompute, got 'yes'",
        ),
        (1, TypeError, "host_compute must be False, True, 'auto' or a HostCompute, got int"),
        (None, TypeError, "got NoneType"),
    ]
    for value, exc, match in bad:
        with pytest.raises(exc, match=match):
            stream(model, "least", value)
    for kw, exc, match in [
        (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
        (dict(max_tokens=65), ValueError, "max_tokens must be <= 64"),
        (dict(max_tokens=2.0), TypeError, "max_tokens must be an int"),
        (dict(host_threads=0), ValueError, "host_threads must be >= 1"),
        (dict(policy="some"), ValueError, "policy must be 'all' or 'split', got 'some'"),
        (dict(link_bytes_per_s=0), ValueError, "link_bytes_per_s must be > 0"),
        (dict(host_bytes_per_s=float("nan")), ValueError, "host_bytes_per_s must be finite"),
        (dict(host_bytes_per_s="fast"), TypeError, "host_bytes_per_s must be a number"),
        (dict(host_fixed_s=-1e-3), ValueError, "host_fixed_s must be >= 0"),
    ]:
        with pytest.raises(exc, match=match):
            HostCompute(**kw)
    assert same(snapshot(model), before) and not hasattr(model, "_torchoffload_experts")
    listed = moe()
    before = snapshot(listed)
    with pytest.raises(
        ValueError, match=r"host_compute serves fused experts.*'blocks\.0\.experts'"
    ):
        to.stream_experts(listed, "cpu", cache_bytes=1 << 20, pin_memory=False,
                          host_compute=True)  # fmt: skip
    assert same(snapshot(listed), before) and not hasattr(listed, "_torchoffload_experts")


def test_a_failed_measurement_at_setup_changes_nothing(monkeypatch):
    from test_moe import same, snapshot

    model = qwen3()
    before, running = snapshot(model), len(workers())

    def fail(*a):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(_host, "_compute", fail)
    with pytest.raises(ZeroDivisionError, match="planted"):
        stream(model, "least", "auto")
    assert len(workers()) == running  # the worker it started was stopped
    assert same(snapshot(model), before) and not hasattr(model, "_torchoffload_experts")
