"""The activation pass on CPU: its decisions on small graphs (layers, views, budget, the
placement of waits and reloads by node order), and compiled parity with Inductor."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchoffload
import torchoffload.compile as toc
from torchoffload.models import GPT, GPTConfig

ops = torch.ops.torchoffload


@pytest.fixture(autouse=True)
def fresh_compile():
    """Compile every time: a cache hit would skip the partitioner (and its report)."""
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    torch._dynamo.reset()
    with fconfig.patch(enable_autograd_cache=False), iconfig.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x):
        h = torch.relu(self.a(x))  # relu's output is saved (for relu and for b)
        return x + self.b(h)


class Stack(nn.Module):
    def __init__(self, d=32, n=4, layer=Layer):
        super().__init__()
        self.layers = nn.ModuleList(layer(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture
def deterministic():
    """Inductor's CPU embedding backward adds into the gradient with atomics from several
    threads, so two runs of the same compiled model can differ in the last bits (seen once in
    12 runs of this file on 2 cores); deterministic algorithms make it fall back to
    aten's serial index_put."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def aot(partition_fn, captured=None):
    """A torch.compile backend: dynamo (which records module paths) and AOTAutograd with
    ``partition_fn``, running the graphs as they are (no Inductor)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(name):
        def compiler(gm, _):
            if captured is not None:
                captured[name] = gm
            return make_boxed_func(gm)

        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=partition_fn)


def graphs(model, x, config):
    """Run one step with the pass and no compiler: (fw graph, bw graph, report)."""
    captured = {}
    part = toc.ActivationPartitioner(config)
    torch.compile(model, backend=aot(part, captured))(x).sum().backward()
    return captured["fw"], captured["bw"], part.reports[-1]


def order(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def calls(gm, op):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == op.default]


def test_config_is_validated():
    with pytest.raises(ValueError, match="prefetch_layers"):
        toc.ActivationPassConfig(prefetch_layers=-1)
    with pytest.raises(TypeError, match="max_offload_bytes"):
        toc.ActivationPassConfig(max_offload_bytes=1.5)
    with pytest.raises(ValueError, match="budget_policy"):
        toc.ActivationPassConfig(budget_policy="biggest")
    with pytest.raises(TypeError, match="ActivationPassConfig"):
        toc.ActivationPartitioner({"prefetch_layers": 1})
    # One config type for eager and compiled; the eager runtime's knobs are refused here.
    assert toc.ActivationPassConfig is torchoffload.ActivationOffloadConfig
    with pytest.raises(ValueError, match="does not support use_streams"):
        toc.ActivationPartitioner(toc.ActivationPassConfig(use_streams=False))


def test_layers_last_layer_and_min_bytes(op_pool):
    model, x = Stack(), torch.randn(16, 32, requires_grad=True)
    fw, bw, report = graphs(model, x, toc.ActivationPassConfig(min_bytes=0, skip_last_layers=1))
    assert report.layers == ["layers.0", "layers.1", "layers.2", "layers.3"]
    by_layer = {}
    for d in report.decisions:
        by_layer.setdefault(d.layer, []).append(d)
    assert all(
        d.offloaded for layer in ("layers.0", "layers.1", "layers.2") for d in by_layer[layer]
    )
    assert not any(d.offloaded for d in by_layer["layers.3"])
    assert all("last 1 layer" in d.reason for d in by_layer["layers.3"])
    assert all(not d.offloaded and "graph input" in d.reason for d in by_layer[None])
    # relu's output and the layer's output (the next layer's input; layer 3's is the model's)
    assert [len(by_layer[f"layers.{i}"]) for i in range(4)] == [2, 2, 2, 1]
    assert len(calls(fw, ops.offload)) == len(calls(bw, ops.reload)) == len(report.offloaded) == 6
    # min_bytes: relu's output is 16 x 64 x 4 = 4096 bytes
    _, _, report = graphs(Stack(), x, toc.ActivationPassConfig(min_bytes=4097))
    assert not report.offloaded
    assert sum("min_bytes" in d.reason for d in report.decisions) == 6  # layers 0-2


@pytest.mark.parametrize(
    ("policy", "budget", "layers"),
    [
        # relu's output is 4096 bytes, the layer's output 2048; layers 0-2 are eligible
        ("earliest", 2 * (4096 + 2048), ["layers.0", "layers.0", "layers.1", "layers.1"]),
        # layers 0-1 share the budget (layer 2 comes back as backward starts); layer 0's
        # 5120 takes relu's output, and the 1024 it leaves passes to layer 1
        ("spread", 2 * 4096 + 2048, ["layers.0", "layers.1", "layers.1"]),
        # the three relu outputs first (ties: earlier layers), then what still fits
        ("largest", 2 * 4096 + 2048, ["layers.0", "layers.0", "layers.1"]),
    ],
)
def test_budget_policies(op_pool, policy, budget, layers):
    x = torch.randn(16, 32, requires_grad=True)
    config = toc.ActivationPassConfig(min_bytes=0, max_offload_bytes=budget, budget_policy=policy)
    _, _, report = graphs(Stack(), x, config)
    assert [d.layer for d in report.offloaded] == layers
    assert report.offloaded_bytes <= budget
    assert any("max_offload_bytes" in d.reason for d in report.decisions)
    at_peak = [d.layer for d in report.decisions if "backward starts" in d.reason]
    assert at_peak == (["layers.2", "layers.2"] if policy == "spread" else [])


class SmallThenLarge(nn.Module):
    """Saves, in graph order, a storage of n elements, then 2n, then n (the layer's output,
    saved by the next layer): matmul outputs, which the partitioner does not recompute."""

    def __init__(self, d=32):
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, 2 * d, bias=False)
        self.c = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_spread_budget_takes_each_layers_largest_storages_first(op_pool):
    x = torch.randn(16, 32, requires_grad=True)
    _, _, full = graphs(Stack(layer=SmallThenLarge), x, toc.ActivationPassConfig(min_bytes=0))
    sizes = {}
    for d in full.offloaded:
        sizes.setdefault(d.layer, []).append(d.nbytes)
    largest = max(sizes["layers.0"])
    assert sizes["layers.0"][0] < largest  # a smaller storage comes first in the graph
    # each of layers 0-1 gets exactly its largest storage's bytes (layer 2 is left out)
    config = toc.ActivationPassConfig(min_bytes=0, max_offload_bytes=2 * largest)
    _, _, report = graphs(Stack(layer=SmallThenLarge), x, config)
    assert [(d.layer, d.nbytes) for d in report.offloaded] == [
        ("layers.0", largest),
        ("layers.1", largest),
    ]
    # with prefetch_layers=2 the last two eligible layers are left out: layer 0 takes it all
    config = toc.ActivationPassConfig(min_bytes=0, max_offload_bytes=2 * largest, prefetch_layers=2)
    _, _, report = graphs(Stack(layer=SmallThenLarge), x, config)
    assert {d.layer for d in report.offloaded} == {"layers.0"}
    assert report.offloaded_bytes <= 2 * largest


@pytest.mark.parametrize("defer", [0, 1, 2])
def test_forward_waits_are_deferred_by_layers(op_pool, defer):
    fw, _, report = graphs(
        Stack(),
        torch.randn(16, 32, requires_grad=True),
        toc.ActivationPassConfig(min_bytes=0, defer_layers=defer, skip_last_layers=0),
    )
    pos = order(fw)
    addmms = [n for n in fw.graph.nodes if n.target == torch.ops.aten.addmm.default]  # 2 per layer
    layer = {f"offload_{d.root}": int(d.layer.split(".")[1]) for d in report.offloaded}
    for off in calls(fw, ops.offload):
        i = layer[off.name]
        (wait,) = [u for u in off.users if u.target == ops.wait.default]
        src = off.args[0]
        assert wait.kwargs["keepalive"] is src  # src stays live in the graph until the wait
        last_use = max(pos[u] for u in src.users if u.op != "output" and u is not wait)
        assert pos[wait] > last_use  # never before the last use of the tensor
        layer_end = pos[addmms[min(2 * (i + defer) + 1, len(addmms) - 1)]]
        assert pos[wait] >= layer_end  # not before the end of layer i + defer
        if i + defer + 1 < 4 and last_use < pos[addmms[2 * (i + defer + 1)]]:
            assert pos[wait] < pos[addmms[2 * (i + defer + 1)]]  # and before the next layer


def _is_view(n):
    target = n.target
    return isinstance(target, torch._ops.OpOverload) and any(
        r.alias_info is not None for r in target._schema.returns[:1]
    )


def _through_views(nodes):
    """``nodes`` and, through view ops (whose outputs alias their input), their users."""
    out, todo = [], list(nodes)
    while todo:
        n = todo.pop()
        out.append(n)
        if _is_view(n):
            todo += list(n.users)
    return out


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_reloads_are_moved_earlier_by_layers(op_pool, prefetch):
    """Note: [Where reloads go]: layer i's reloads go into the backward of layer
    a = i + prefetch, after a has released half of its saved bytes (at a's start when a keeps
    its tensors, or with prefetch 0), in order of first use; each wait right before its use."""
    _, bw, report = graphs(
        Stack(n=5),
        torch.randn(16, 32, requires_grad=True),
        toc.ActivationPassConfig(min_bytes=0, prefetch_layers=prefetch),
    )
    pos = order(bw)
    reloads = calls(bw, ops.reload)  # layers 0..3 (layer 4 is the last, kept), 2 per layer
    assert len(reloads) == 8
    layer = {f"offload_{d.root}": int(d.layer.split(".")[1]) for d in report.offloaded}
    start, first_use, last_use = {}, {}, {}  # start: per layer, its first use
    for r in reloads:
        (wait,) = [u for u in r.users if u.target == ops.wait.default]
        users = [u for u in r.users if u is not wait]
        first_use[r] = min(pos[u] for u in users)
        last_use[r] = max(pos[u] for u in _through_views(users))
        assert pos[r] < pos[wait] < first_use[r] and all(pos[u] > pos[wait] for u in users)
        i = layer[r.args[0].name]
        start[i] = min(start.get(i, first_use[r]), first_use[r])
    free = {}  # per layer: where its backward has released half of its bytes
    for i in range(4):
        # (the layer's output is released before its backward starts: by layer i + 1)
        rel = sorted(
            (last_use[r], r.meta["val"].nbytes)
            for r in reloads
            if layer[r.args[0].name] == i and last_use[r] > start[i]
        )
        total, done = sum(b for _, b in rel), 0
        for at, nbytes in rel:
            done += nbytes
            if 2 * done >= total:
                free[i] = at
                break
    kept = [d for d in report.decisions if d.layer == "layers.4"]
    bw_inputs = {p.name: p for p in bw.graph.find_nodes(op="placeholder")}
    start[4] = min(pos[u] for d in kept for u in bw_inputs[d.root].users)
    assert sorted(start, key=start.__getitem__) == [4, 3, 2, 1, 0]  # layers in reverse
    for r in reloads:
        i = layer[r.args[0].name]
        a = min(i + prefetch, 4)
        if a == 4 or a == i:  # at the start of layer a's backward
            assert pos[r] <= start[a]
            if a + 1 <= 4:
                assert pos[r] > start[a + 1]  # and not earlier
        else:  # right after layer a released half of its bytes, before layer a - 1 starts
            assert free[a] < pos[r] < start[a - 1]
            nodes = list(bw.graph.nodes)
            between = nodes[free[a] + 1 : pos[r]]  # only other transfers (and saved views)
            assert all(
                n.target in (ops.reload.default, ops.wait.default) or _is_view(n) for n in between
            ), between
    for i in range(4):
        mine = sorted((r for r in reloads if layer[r.args[0].name] == i), key=pos.__getitem__)
        assert [first_use[r] for r in mine] == sorted(first_use[r] for r in mine)


class ViewLayer(nn.Module):
    """Saves its input twice: as it is (for sin) and as the 2-D view the matmul saves."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x) * torch.sin(x)


class Views(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(ViewLayer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_views_offload_their_storage_once(op_pool):
    """With PyTorch's default partitioner (which saves a tensor and its views side by side) and
    the pass used on its own: each storage is copied once, its saved views are rebuilt from
    the reload, and the step's bits are those of the same partitioner without the pass."""
    from functorch.compile import default_partition

    reports = []

    def with_pass(gm, joint_inputs, **kwargs):
        fw, bw = default_partition(gm, joint_inputs, **kwargs)
        config = toc.ActivationPassConfig(min_bytes=0)
        reports.append(
            toc.offload_activations_pass(fw, bw, config, num_fwd_outputs=kwargs["num_fwd_outputs"])
        )
        return fw, bw

    torch.manual_seed(0)
    model, ref = Views(), None
    ref = copy.deepcopy(model)
    x = torch.randn(4, 4, 32, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    captured = {}
    a = torch.compile(model, backend=aot(with_pass, captured))(x)
    b = torch.compile(ref, backend=aot(default_partition))(xr)
    a.sum().backward()
    b.sum().backward()
    assert torch.equal(a, b) and torch.equal(x.grad, xr.grad)
    assert all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    report = reports[-1]
    multi = [d for d in report.offloaded if len(d.members) > 1]
    assert multi, str(report)  # a storage saved as itself and as a view
    assert any(d.root not in d.members for d in report.offloaded)  # only a view of it saved
    offloaded = [n.args[0] for n in calls(captured["fw"], ops.offload)]
    assert len(set(offloaded)) == len(offloaded) == len(report.offloaded)  # one copy per storage
    s = toc.op_stats()
    assert s.reloaded_tensors == len(report.offloaded) and s.in_flight == 0


def test_decisions_are_logged(op_pool, caplog):
    with caplog.at_level(logging.DEBUG, logger="torchoffload.compile._pass"):
        graphs(
            Stack(), torch.randn(16, 32, requires_grad=True), toc.ActivationPassConfig(min_bytes=0)
        )
    text = caplog.text
    assert "offload" in text and "in the last 1 layer" in text and "graph input" in text


# -- through torch.compile with Inductor --------------------------------------------------------


def gpt_step(model, tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


GPT_CONFIG = GPTConfig(hidden=64, layers=4, heads=2, vocab=128, max_seq=32)
# What plain Inductor gives for the model below, per step: (loss, accumulated gradients). The
# same for every parametrization (same seed, tokens and settings), so computed once, by the
# first test that needs it, under that test's fixtures (fresh compile, deterministic).
_PLAIN_STEPS: dict[str, object] = {}


def gpt_model_and_tokens():
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    return model, torch.randint(0, 128, (2, 17))


def plain_inductor_steps(model, tokens, steps):
    """Per step, plain Inductor's loss and gradients for a copy of ``model`` (which must be the
    model `gpt_model_and_tokens` builds: checked, so a cached result is never compared with
    another model's)."""
    initial = [p.detach().clone() for p in model.parameters()]
    if not _PLAIN_STEPS:
        ref = copy.deepcopy(model)
        plain = torch.compile(ref, backend="inductor")
        results = []
        for _ in range(steps):
            loss = gpt_step(plain, tokens)
            results.append((loss, [q.grad.clone() for q in ref.parameters()]))
        _PLAIN_STEPS.update(initial=initial, tokens=tokens.clone(), results=results)
    assert len(_PLAIN_STEPS["initial"]) == len(initial)
    assert all(torch.equal(a, b) for a, b in zip(_PLAIN_STEPS["initial"], initial, strict=True))
    assert torch.equal(_PLAIN_STEPS["tokens"], tokens)
    assert len(_PLAIN_STEPS["results"]) == steps
    return _PLAIN_STEPS["results"]


@pytest.mark.parametrize(
    "config",
    [
        toc.ActivationPassConfig(min_bytes=0),
        # the layer options and a budget in one compile (each compile of the pair is about 10
        # CPU-s on CI's two cores)
        toc.ActivationPassConfig(
            min_bytes=0, prefetch_layers=2, defer_layers=0, skip_last_layers=0,
            max_offload_bytes=40_000,
        ),
    ],
)  # fmt: skip
def test_compiled_gpt_matches_compiled_without_offloading(op_pool, deterministic, config):
    """Inductor on CPU with the pass gives the bits Inductor gives without it (two steps, so the
    host blocks are reused), and every offloaded tensor came back."""
    from torch._inductor.utils import run_and_get_code

    model, tokens = gpt_model_and_tokens()
    plain = plain_inductor_steps(model, tokens, steps=2)
    be = toc.backend(config)
    compiled = torch.compile(model, backend=be)
    for step, (b, b_grads) in enumerate(plain):
        if step == 0:
            a, codes = run_and_get_code(gpt_step, compiled, tokens)
            code = "\n".join(codes)
        else:
            a = gpt_step(compiled, tokens)
        assert torch.equal(a, b)
        for p, q in zip(model.parameters(), b_grads, strict=True):
            assert torch.equal(p.grad, q)
    report = be.reports[-1]
    assert report.offloaded
    for name in ("offload", "reload", "wait"):
        assert f"torchoffload.{name}" in code, name
    assert code.count("torchoffload.wait") >= 2 * len(report.offloaded)
    assert "atomic_add" not in code  # the deterministic fallback (see the fixture)
    s = toc.op_stats()
    assert (
        s.offloaded_tensors == s.reloaded_tensors == 2 * len(report.offloaded) and s.in_flight == 0
    )
    assert op_pool.stats().used_bytes == 0
    if config.max_offload_bytes is not None:
        assert report.offloaded_bytes <= config.max_offload_bytes


def test_backend_turns_off_inductor_memory_features_that_fight_the_pass():
    """Note in `backend`: peak-memory reordering and buffer reuse are off unless asked for."""
    patches = toc.backend().config_patches
    assert patches["reorder_for_peak_memory"] is False
    assert patches["allow_buffer_reuse"] is False
    assert isinstance(patches["custom_partitioner_fn"], toc.ActivationPartitioner)
    assert toc.backend(allow_buffer_reuse=True).config_patches["allow_buffer_reuse"] is True


class Checkpointed(nn.Module):
    def __init__(self, n=3, d=32):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = (
                torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
                if i == 0
                else layer(x)
            )
        return x


def compiled_parity(model, x, config):
    """One step of ``model`` compiled with the pass and of a copy compiled without it: outputs
    and gradients bitwise equal. Returns the pass's report."""
    ref = copy.deepcopy(model)
    be = toc.backend(config)
    a = torch.compile(model, backend=be)(x)
    b = torch.compile(ref, backend="inductor")(x)
    a.sum().backward()
    b.sum().backward()
    assert torch.equal(a, b)
    assert all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return be.reports[-1]


def test_composes_with_checkpointing(op_pool):
    """A checkpointed layer saves only its input; what it recomputes is never offloaded."""
    torch.manual_seed(0)
    config = toc.ActivationPassConfig(min_bytes=0, skip_last_layers=0)
    report = compiled_parity(Checkpointed(), torch.randn(16, 32), config)
    layer0 = [d for d in report.decisions if d.layer == "layers.0"]
    layer1 = [d for d in report.decisions if d.layer == "layers.1"]
    assert len(layer1) == 2 and all(d.offloaded for d in layer1)  # relu's output, its input
    assert not layer0  # layer 0 recomputes relu's output: nothing of it is saved


@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint.CheckpointPolicy, "MUST_CPU_OFFLOAD"),
    reason="this torch has no CheckpointPolicy.MUST_CPU_OFFLOAD",
)
def test_sac_must_cpu_offload_is_honoured(op_pool):
    """A tensor tagged MUST_CPU_OFFLOAD is offloaded although it is in the last layer."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.relu.default:
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.PREFER_SAVE

    class Tagged(Stack):
        def forward(self, x):
            for layer in self.layers:
                x = torch.utils.checkpoint.checkpoint(
                    layer,
                    x,
                    use_reentrant=False,
                    context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
                )
            return x

    torch.manual_seed(0)
    config = toc.ActivationPassConfig(min_bytes=1 << 30, skip_last_layers=2)
    offloaded = compiled_parity(Tagged(n=2), torch.randn(16, 32), config).offloaded
    assert len(offloaded) == 2 and all(d.reason == "tagged MUST_CPU_OFFLOAD" for d in offloaded)
