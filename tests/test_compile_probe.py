"""Weight probes on CPU: the probe op, the probe pass on an exported program, and the runner
that serves probes from the weight engine (parity with the resident program)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchoffload.compile as toc
from torchoffload.models import GPT, GPTConfig

probe = torch.ops.torchoffload.probe


def exported(layers=3):
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden=64, layers=layers, heads=2, vocab=128, max_seq=32)).eval()
    tokens = torch.randint(0, 128, (2, 16))
    return model, tokens, torch.export.export(model, (tokens,))


def test_opcheck_and_outside_a_runner():
    w = torch.randn(8, 4)
    torch.library.opcheck(probe, (w, 3))
    out = probe(w, 3)  # no runner: a copy of the weight
    assert torch.equal(out, w) and out.data_ptr() != w.data_ptr()


def test_every_use_of_every_weight_is_probed():
    model, tokens, ep = exported()
    gm = ep.module()
    n_uses = sum(
        1
        for node in gm.graph.nodes
        if node.op == "call_function"
        for a in dict.fromkeys(node.all_input_nodes)
        if a.op == "get_attr"
    )
    names = toc.insert_weight_probes(gm)
    assert len(names) == n_uses > 0
    probes = [n for n in gm.graph.nodes if n.target is probe.default]
    assert [p.args[1] for p in probes] == list(range(len(names)))  # ids in graph order
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in names:
            assert all(u.target is probe.default for u in node.users)
    for p in probes:  # right before its single use
        (user,) = p.users
        assert p.next is user or p.next.target is probe.default
    assert torch.equal(gm(tokens), ep.module()(tokens))  # probes outside a runner: copies


def test_probes_survive_inductor():
    from torch._inductor.utils import run_and_get_code

    _, tokens, ep = exported(layers=1)
    gm = ep.module()
    names = toc.insert_weight_probes(gm)
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(gm, backend="inductor"), tokens)
    assert "\n".join(codes).count("torchoffload.probe") >= len(names)
    torch._dynamo.reset()
    assert torch.equal(out, torch.compile(ep.module(), backend="inductor")(tokens))


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_runner_matches_the_resident_program(depth):
    model, tokens, ep = exported()
    ref = ep.module()(tokens)
    budget = 300_000  # of 641 kB of weights
    runner = toc.stream_exported_weights(ep, "cpu", budget_bytes=budget, prefetch_depth=depth)
    for _ in range(3):
        assert torch.equal(runner(tokens), ref)
    s = runner.handle.stats()
    # the tied embedding / head weight: one name, two probes, one unit
    assert s.units == len(set(runner.probe_names)) == len(runner.probe_names) - 1
    assert s.peak_device_bytes <= budget and s.calls == 3
    if depth:
        assert s.prefetch_issued > 0
    other = torch.randint(0, 128, (2, 16))
    assert torch.equal(runner(other), ep.module()(other))
    runner.remove()


def test_runner_errors():
    _, tokens, ep = exported()
    with pytest.raises(ValueError, match="budget"):
        toc.stream_exported_weights(ep, "cpu", budget_bytes=1000, prefetch_depth=2)
    with pytest.raises(TypeError, match="ExportedProgram"):
        toc.stream_exported_weights(torch.nn.Linear(2, 2), "cpu", budget_bytes=1 << 20)
    runner = toc.stream_exported_weights(ep, "cpu", budget_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="probe id 999"):
        runner._server.serve(999)


class _ViewedLater(nn.Module):
    """``a`` is read through a view (``a.t()``) after ``b``'s probe: the view node itself
    reads nothing."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(16, 16))
        self.b = nn.Parameter(torch.randn(16, 16))
        self.c = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        at = self.a.t()
        y = x @ self.b
        return (y @ at) @ self.c


def test_a_weight_read_through_a_view_is_held_until_the_read():
    """Finishing ``a`` at ``b``'s probe (after the view, before the read) let ``b``'s copy
    overwrite it: a wrong result at the one-unit budget. Now ``a`` is held to its read, and a
    budget that cannot hold both says so."""
    torch.manual_seed(0)
    model = _ViewedLater().eval()
    x = torch.randn(4, 16)
    ep = torch.export.export(model, (x,))
    with torch.no_grad():
        expected = model(x)
    runner = toc.stream_exported_weights(ep, "cpu", budget_bytes=2048, prefetch_depth=0)
    assert torch.equal(runner(x), expected)
    runner = toc.stream_exported_weights(ep, "cpu", budget_bytes=1024, prefetch_depth=0)
    with pytest.raises(RuntimeError, match="no room in the"):
        runner(x)


class _ViewsOfOneStorage(nn.Module):
    """``a`` and ``b`` are views of one storage (they share a version counter), read by one
    node: their units are held at once."""

    def __init__(self):
        super().__init__()
        base = torch.randn(2, 8, 8)
        self.a = nn.Parameter(base[0])
        self.b = nn.Parameter(base[1])

    def forward(self, x):
        return x @ (self.a + self.b)


def test_views_of_one_storage_in_two_units_held_at_once():
    """Note: [A version counter of its own]: binding ``b`` moved the counter ``a`` shares, and
    the first call raised "'0.w' was modified in place". The runner is bitwise the program,
    and the model's tensors keep their versions."""
    torch.manual_seed(0)
    model, x = _ViewsOfOneStorage().eval(), torch.randn(3, 8)
    ep = torch.export.export(model, (x,))
    versions = [model.a._version, model.b._version]
    with torch.no_grad():
        expected = model(x)
    runner = toc.stream_exported_weights(ep, "cpu", budget_bytes=1024, prefetch_depth=0,
                                         pin_memory=False)  # fmt: skip
    for _ in range(2):
        assert torch.equal(runner(x), expected)
    assert [model.a._version, model.b._version] == versions
    runner.remove()
