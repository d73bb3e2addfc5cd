"""`torchoffload.verify`: equal for every engine where it is bitwise, names the first tensor
that differs (planted differences in an output, a gradient, a weight), leaves the user's
model, inputs and random state as they were, and refuses bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchoffload as to


class Net(nn.Module):
    """A block stack with dropout (random), a buffer, a tuple output."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3)
        )
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + self.drop(b(h))
        return self.head(h) * self.scale, h.sum()


def net():
    torch.manual_seed(0)
    return Net()


X = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])


def loss(out):
    return out[0].pow(2).mean()


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def offloaded_adamw(m):
    return to.OffloadedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)


class Handle:
    """A fake engine's handle: ``remove()`` undoes ``undo``."""

    def __init__(self, undo):
        self.undo = undo

    def remove(self):
        self.undo()


def test_activation_offloading_training_with_dropout_is_equal():
    report = to.verify(
        net(), X, context=lambda: to.offload_activations(min_bytes=0), loss=loss,
        optimizer=adamw, steps=2,
    )  # fmt: skip
    assert report.equal and report.first_difference is None, str(report)
    assert report.compared > 20 and "equal" in str(report)


def test_layer_aware_offloading_with_a_budget_is_equal():
    config = to.ActivationOffloadConfig(min_bytes=0, max_offload_bytes=256, skip_last_layers=0)
    report = to.verify(
        net(), X, loss=loss, optimizer=adamw, steps=2,
        apply=lambda m: to.apply_activation_offloading(m, layers=m.blocks, config=config),
    )  # fmt: skip
    assert report.equal, str(report)


def test_stream_weights_inference_is_equal():
    model = net().eval()
    budget = to.minimum_budget(model, prefetch_depth=1)
    report = to.verify(
        model, X, steps=3,
        apply=lambda m: to.stream_weights(m, "cpu", budget_bytes=budget, prefetch_depth=1),
    )  # fmt: skip
    assert report.equal, str(report)
    assert not hasattr(model, "_torchoffload_weights") and all(
        p.numel() for p in model.parameters()
    )


def test_stream_parameters_with_the_offloaded_optimizer_is_equal():
    report = to.verify(
        net(), X, loss=loss, steps=2, optimizer=offloaded_adamw,
        apply=lambda m: to.stream_parameters(m, budget_bytes=1 << 20),
    )  # fmt: skip
    assert report.equal, str(report)
    assert any("gradients" in why for why in report.not_compared)


def test_offloaded_optimizer_against_the_plain_class_is_equal():
    report = to.verify(
        net(), X, loss=loss, steps=3, optimizer=offloaded_adamw, reference_optimizer=adamw
    )
    assert report.equal, str(report)
    n_state = len(net().state_dict())
    assert (
        report.compared == 3 * 3 + 2 * n_state
    )  # 2 outputs and a loss a step, the state applied and removed


def test_a_planted_weight_change_is_named():
    def perturb(m):
        with torch.no_grad():
            m.blocks[1][1].weight[2, 3] += 0.25

        def undo():
            with torch.no_grad():
                m.blocks[1][1].weight[2, 3] -= 0.25

        return Handle(undo)

    def keep(m):  # a planted change that stays: the parameters after the run differ too
        with torch.no_grad():
            m.blocks[1][1].weight[2, 3] += 0.25

    report = to.verify(net().eval(), X, apply=keep)
    assert not report.equal
    first = report.first_difference
    assert (first.kind, first.name, first.step) == ("output", "output[0]", 0)
    params = [d for d in report.differences if d.kind == "parameter"]
    assert [(d.name, d.differing, d.max_abs_diff) for d in params] == [
        ("blocks.1.1.weight", 1, 0.25)
    ]
    assert "blocks.1.1.weight" in str(report) and "1 of 64 elements differ" in str(report)
    assert [d.kind for d in report.differences][-2:] == ["parameter", "parameter after remove"]
    assert str(report.differences[-1]).startswith("parameter 'blocks.1.1.weight' after remove()")
    # Undone by the handle's remove(): the state after it is the same.
    report = to.verify(net().eval(), X, apply=perturb)
    assert [d.kind for d in report.differences] == ["output", "output", "parameter"]


def test_a_planted_output_change_is_named_with_its_size():
    def engine(m):
        def call(x):
            a, b = m(x)
            return a, b + 1.5

        return call

    report = to.verify(net(), X, apply=engine, loss=loss)
    assert not report.equal
    d = report.first_difference
    assert (d.kind, d.name, d.step, d.differing, d.numel) == ("output", "output[1]", 0, 1, 1)
    assert d.max_abs_diff == pytest.approx(1.5, rel=1e-6)
    assert len(report.differences) == 1  # the loss, gradients and parameters are the same


def test_a_planted_gradient_change_is_named():
    def engine(m):
        hook = m.head.bias.register_hook(lambda g: g * 2)
        return Handle(hook.remove)

    report = to.verify(net(), X, apply=engine, loss=loss, steps=2)
    d = report.first_difference
    assert (d.kind, d.name, d.step) == ("gradient", "head.bias", 0)
    assert d.differing == 4 and d.max_abs_diff > 0
    with pytest.raises(to.VerificationError, match="gradient 'head.bias' at step 0") as e:
        to.verify(net(), X, apply=engine, loss=loss, raise_on_difference=True)
    assert isinstance(e.value, AssertionError) and not e.value.report.equal


def test_nan_where_the_plain_run_has_nan_is_equal_and_nan_against_a_number_is_inf():
    class Nan(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.0, float("nan")]))

        def forward(self, x):
            return self.w * x

    assert to.verify(Nan(), torch.ones(2)).equal

    def engine(m):
        return lambda x: torch.nan_to_num(m(x))

    d = to.verify(Nan(), torch.ones(2), apply=engine).first_difference
    assert (d.differing, d.max_abs_diff) == (1, float("inf"))


def test_a_shape_or_dtype_difference_is_reported_not_compared_elementwise():
    d = to.verify(net(), X, apply=lambda m: lambda x: (m(x)[0].double(), m(x)[1])).first_difference
    assert d.name == "output[0]" and "float64" in d.detail and "float32" in d.detail


def test_the_users_model_inputs_and_random_state_are_unchanged():
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    x = X.clone()
    rng = torch.get_rng_state()
    was = torch.are_deterministic_algorithms_enabled()
    to.verify(
        model, x, loss=loss, optimizer=offloaded_adamw,
        apply=lambda m: to.stream_parameters(m, budget_bytes=1 << 20),
    )  # fmt: skip
    assert list(model.parameters()) == params and all(p.grad is None for p in params)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(x, X) and torch.equal(torch.get_rng_state(), rng)
    assert torch.are_deterministic_algorithms_enabled() == was
    assert not model._forward_hooks and not model._forward_pre_hooks
    # The model streams on its own afterwards, as it would have without verify.
    to.stream_parameters(model, budget_bytes=1 << 20).remove()


def test_an_error_in_the_offloaded_run_propagates_and_its_engine_is_removed():
    model = net()
    removed = []

    def engine(m):
        m.blocks[0].register_forward_hook(lambda *a: 1 / 0)
        return Handle(lambda: removed.append(True))

    with pytest.raises(ZeroDivisionError):
        to.verify(model, X, apply=engine)
    assert removed == [True] and not model.blocks[0]._forward_hooks


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        to.verify(lambda x: x, X)
    with pytest.raises(ValueError, match="steps"):
        to.verify(net(), X, steps=0)
    with pytest.raises(TypeError, match="apply must be callable"):
        to.verify(net(), X, apply=3)
    with pytest.raises(ValueError, match="needs loss="):
        to.verify(net(), X, optimizer=adamw)


def test_report_is_frozen():
    report = to.verify(net().eval(), X)
    with pytest.raises(AttributeError):
        report.equal = False  # type: ignore[misc]


def test_a_zero_of_the_other_sign_is_a_difference():
    """Bitwise means the sign of a zero too (``1 / x`` is -inf for one and inf for the other):
    ``a == b`` took -0.0 for 0.0, and an engine that flipped the sign of zeros passed."""

    class Negative(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([0.0, 1.0, -2.0]))

        def forward(self, x):
            return self.w * x  # -0.0 at [0] for x = -1

    def engine(m):
        return lambda x: m(x) + 0.0  # -0.0 + 0.0 is 0.0

    x = -torch.ones(3)
    assert to.verify(Negative(), x).equal
    d = to.verify(Negative(), x, apply=engine).first_difference
    assert (d.kind, d.name, d.differing, d.max_abs_diff) == ("output", "output", 1, 0.0)
    assert "sign" in str(d)


def test_outputs_in_a_dataclass_or_as_python_numbers_are_compared():
    """A dataclass output (not a pytree node) and a Python number were not compared at all: an
    engine that changed them was reported equal."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        total: float
        extra: object = None

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = net().eval()

        def forward(self, x):
            a, b = self.inner(x)
            return Out(a, b.item(), extra=object())

    assert to.verify(Wrapped(), X).equal
    for change in ("logits", "total"):

        def engine(m, change=change):
            def call(x):
                out = m(x)
                return dataclasses.replace(out, **{change: getattr(out, change) + 1})

            return call

        report = to.verify(Wrapped(), X, apply=engine)
        assert not report.equal and report.first_difference.name == f"output.{change}", change
    assert "output.extra: an object" in str(to.verify(Wrapped(), X).not_compared)

    # an output left uncompared does not excuse a gradient missing from one run
    def frozen(m):
        m.inner.head.bias.requires_grad_(False)

    report = to.verify(Wrapped(), X, apply=frozen, loss=lambda out: out.logits.pow(2).mean())
    assert not report.equal
    assert [(d.kind, d.name) for d in report.differences][:1] == [("gradient", "inner.head.bias")]


def test_a_non_persistent_buffer_changed_by_the_engine_is_named():
    """A non-persistent buffer (a rotary table) is a buffer the model computes with but not in
    ``state_dict()``: an engine that leaves it changed after ``remove()`` (a restore that
    zeroes it) is a difference. Only ``state_dict()`` was read, so it passed as equal."""

    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("table", torch.arange(8.0), persistent=False)

        def forward(self, x):
            return self.lin(x) + self.table

    def zero_on_remove(m):
        def undo():
            m.table.zero_()

        return Handle(undo)

    torch.manual_seed(0)
    model = WithTable().eval()
    x = torch.randn(2, 8)
    report = to.verify(model, x, apply=zero_on_remove)
    assert not report.equal
    assert [(d.kind, d.name, d.differing) for d in report.differences] == [
        ("buffer after remove", "table", 7)
    ]

    def zero_while_applied(m):
        table = m.table.clone()
        m.table.zero_()

        def undo():
            m.table.copy_(table)

        return Handle(undo)

    report = to.verify(model, x, apply=zero_while_applied)
    assert [(d.kind, d.name) for d in report.differences] == [
        ("output", "output"), ("buffer", "table")
    ]  # fmt: skip
    assert to.verify(model, x, apply=lambda m: Handle(lambda: None)).compared == 7


def test_a_graphed_call_returned_by_apply_is_called_and_its_engine_removed():
    """``apply`` may return ``handle.cuda_graph(fn)`` (callable, called in place of the model;
    on the CPU its bookkeeping runs without a graph): the engine it replays is removed after
    the run, as a handle returned by ``apply`` is. It was left applied to the run's copy (hooks,
    host store and placeholders), so the state compared "after remove()" was the streamed one."""
    model = net().eval()
    budget = to.minimum_budget(model, prefetch_depth=1)
    copies = []

    def graphed(m):
        copies.append(m)
        return to.stream_weights(m, "cpu", budget_bytes=budget, prefetch_depth=1).cuda_graph(m)

    report = to.verify(model, X, steps=3, apply=graphed)
    assert report.equal, str(report)
    [m] = copies
    assert not hasattr(m, "_torchoffload_weights")
    assert all(type(t) in (torch.Tensor, nn.Parameter) and t.numel() for t in m.state_dict(
        keep_vars=True).values())  # fmt: skip
