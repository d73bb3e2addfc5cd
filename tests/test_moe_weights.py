"""`stream_experts` composed with `stream_weights` on the CPU (Note: [Tensors hosted by another
engine]): the experts stream with stream_experts, applied first, and the dense parts with
stream_weights over what it left. A small Qwen3-MoE and a ModuleList mixture of experts give
tokens bitwise equal to the resident model at the least budget and cache and larger ones;
the experts count in no unit and no budget; the other order of setup and of remove() is
refused, changing nothing; removing in order restores the model bitwise."""

from __future__ import annotations

import pytest
import torch
from fuzz_models import tokens  # tests/ is on sys.path
from safetensors.torch import save_file
from test_moe import GEN, SPEC, inputs, moe, prompt, qwen3, same, snapshot
from torch import nn

import torchoffload as to
from torchoffload import stream_experts, stream_parameters, stream_weights
from torchoffload._hosted import HostedError
from torchoffload.weights import CheckpointError


def dense_bytes(model) -> int:
    """Bytes of the model's tensors outside its experts, each storage once."""
    seen = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if ".experts" not in name:
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def identities(model):
    """Each tensor object, its class and device (remove() keeps identity)."""
    return [(name, t, type(t), t.device) for name, t in
            [*model.named_parameters(), *model.named_buffers()]]  # fmt: skip


def same_identities(a, b) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] is y[1] and x[2] is y[2] and x[3] == y[3]
        for x, y in zip(a, b, strict=True)
    )


def compose(model, cache="least", budget="least", **kw):
    least_cache = to.minimum_cache_bytes(model)
    cache_bytes = {"least": least_cache, "all": 1 << 30}[cache]
    he = stream_experts(model, "cpu", cache_bytes=cache_bytes, pin_memory=False)
    least = to.minimum_budget(model, **kw)
    budget_bytes = {"least": least, "all": 1 << 30}[budget]
    hw = stream_weights(model, "cpu", budget_bytes=budget_bytes, pin_memory=False, **kw)
    return he, hw


def check_experts_left_alone(model, hw):
    """No unit binds an expert tensor; streamed bytes are the dense parts'."""
    bound = [leaf.name for u in hw._runtime.layout.units for leaf, _ in u.binds]
    assert bound and not [n for n in bound if ".experts" in n]
    assert hw.stats().streamed_bytes + hw.stats().resident_bytes == dense_bytes(model)
    hosted = [s.name for s in hw._runtime.layout.hosted]
    assert hosted and all(".experts" in n for n in hosted)


# -- Hugging Face Qwen3-MoE ----------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["least", "all"])
@pytest.mark.parametrize("budget", ["least", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_moe_composed_generate_bitwise(cache, budget, dtype):
    ref, model = qwen3(dtype=dtype), qwen3(dtype=dtype)
    expected = [ref.generate(prompt(), **GEN), ref.generate(prompt(1, 3, 2), **GEN)]
    before, ids = snapshot(model), identities(model)
    he, hw = compose(model, cache, budget)
    check_experts_left_alone(model, hw)
    assert torch.equal(model.generate(prompt(), **GEN), expected[0])
    assert torch.equal(model.generate(prompt(1, 3, 2), **GEN), expected[1])
    assert hw.stats().calls == he.stats().calls == 2 * GEN["max_new_tokens"]
    assert same(snapshot(model), before)  # state_dict holds the real values of both
    hw.remove()
    he.remove()
    assert same(snapshot(model), before) and same_identities(identities(model), ids)
    assert "forward" not in model.model.layers[0].mlp.experts.__dict__
    assert torch.equal(model.generate(prompt(), **GEN), expected[0])


def test_qwen3_moe_least_budget_counts_no_expert():
    model = qwen3()
    alone = to.minimum_budget(model)
    he = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    least = to.minimum_budget(model)
    assert least < alone
    for unit in ("blocks", "leaves"):
        with pytest.raises(ValueError, match="the minimum budget is"):
            stream_weights(model, "cpu", budget_bytes=to.minimum_budget(model, unit=unit) - 1,
                           unit=unit, pin_memory=False)  # fmt: skip
        hw = stream_weights(model, "cpu", budget_bytes=to.minimum_budget(model, unit=unit),
                            unit=unit, pin_memory=False)  # fmt: skip
        assert hw.unit_kind == unit
        check_experts_left_alone(model, hw)
        hw.remove()
    he.remove()


def test_qwen3_moe_composed_reads_writes_and_state_dict():
    ref, model = qwen3(), qwen3()
    he, hw = compose(model, "least", "least")
    x = prompt()
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
        for m in (model, ref):  # dense and expert tensors written outside their units
            m.model.layers[1].mlp.experts.down_proj[3].mul_(0.5)
            m.model.layers[0].self_attn.q_proj.weight.mul_(0.5)
        assert torch.equal(model.model.layers[1].mlp.experts.down_proj.norm(),
                           ref.model.layers[1].mlp.experts.down_proj.norm())  # fmt: skip
        assert torch.equal(model(x).logits, ref(x).logits)
    sd = model.state_dict()
    assert same(sd, ref.state_dict())
    model.load_state_dict({k: v * 0.5 for k, v in sd.items()})
    ref.load_state_dict({k: v * 0.5 for k, v in ref.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    with pytest.raises(HostedError, match="would be converted from torch.float32"):
        model.to(torch.float64)
    hw.remove()
    he.remove()
    assert same(snapshot(model), snapshot(ref))


def test_cuda_graph_of_composed_model_is_refused():
    """Neither graph drives the other engine: stream_weights' would not load the routed
    experts, stream_experts' would meet stream_weights' units loading eagerly in its capture
    (on the CPU both would run their bookkeeping: refused there too)."""
    ref, model = qwen3(), qwen3()
    he, hw = compose(model)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"cuda_graph: 4 tensors .* stream with another engine"):
        hw.cuda_graph(model)
    with pytest.raises(RuntimeError, match=r"cuda_graph: stream_weights .* streams this model's"):
        he.cuda_graph(model)
    assert same(snapshot(model), before)
    with torch.no_grad():
        assert torch.equal(model(prompt()).logits, ref(prompt()).logits)
    hw.remove()
    he.remove()


# -- the order of setup and of remove() -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3", "list"])
def test_the_other_orders_are_refused_and_change_nothing(kind):
    ref = qwen3() if kind == "qwen3" else moe()
    model = qwen3() if kind == "qwen3" else moe()
    before, ids = snapshot(model), identities(model)
    hw = stream_weights(model, "cpu", budget_bytes=1 << 30, pin_memory=False)
    with pytest.raises(RuntimeError, match=r"apply stream_experts first.*then stream_weights"):
        stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    assert same(snapshot(model), before) and not hasattr(model, "_torchoffload_experts")
    hw.remove()
    assert same_identities(identities(model), ids)

    he, hw = compose(model)
    streamed = snapshot(model)
    with pytest.raises(RuntimeError, match=r"remove\(\) first, then this one's"):
        he.remove()
    with pytest.raises(RuntimeError, match=r"remove\(\) first, then this one's"), he:
        pass  # leaving the block removes: refused the same
    assert not he.removed and same(snapshot(model), streamed)
    x = prompt() if kind == "qwen3" else tokens(SPEC, 2, 3, 0)
    with torch.no_grad():
        out, want = model(x), ref(x)
    if kind == "qwen3":
        out, want = out.logits, want.logits
    assert torch.equal(out, want)
    hw.remove()
    he.remove()
    assert same(snapshot(model), before) and same_identities(identities(model), ids)


def test_stream_parameters_and_resident_experts_are_refused():
    model = moe()
    he = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    before = snapshot(model)
    with pytest.raises(ValueError, match="is already streamed"):
        stream_parameters(model, 1 << 30, device="cpu", pin_memory=False)
    with pytest.raises(ValueError, match=r"'experts' matches only tensors that stream with"):
        stream_weights(model, "cpu", budget_bytes=1 << 30, resident="experts", pin_memory=False)
    assert same(snapshot(model), before)
    hw = stream_weights(model, "cpu", budget_bytes=1 << 30, resident="emb", pin_memory=False)
    assert hw.resident == ["emb.weight"]
    check_experts_left_alone(model, hw)
    hw.remove()
    he.remove()


# -- a ModuleList mixture of experts --------------------------------------------------------------


def without_experts(model):
    for b in model.blocks:
        if hasattr(b, "experts"):
            b.experts = nn.ModuleList()
    return model


@pytest.mark.parametrize("unit", [None, "blocks", "leaves"])
@pytest.mark.parametrize("cache", ["least", "all"])
@pytest.mark.parametrize("budget", ["least", "all"])
def test_module_list_composed_bitwise(unit, cache, budget):
    """Three lists of 6 experts outnumber the 3 blocks: the blocks are still the blocks (a
    list whose tensors stream with stream_experts is not a candidate)."""
    ref, model = moe(), moe()
    xs = inputs()
    with torch.no_grad():
        expected = [ref(x) for x in xs]
    before, ids = snapshot(model), identities(model)
    he, hw = compose(model, cache, budget, unit=unit)
    check_experts_left_alone(model, hw)
    if unit == "blocks":
        assert hw.units == ["blocks.0", "blocks.1", "blocks.2", "emb", "head"]
    with torch.inference_mode():
        for x, e in zip(xs, expected, strict=True):
            assert torch.equal(model(x), e)
    st = he.stats()
    assert st.calls == len(xs) and hw.stats().calls == len(xs)
    assert same(snapshot(model), before)
    hw.remove()
    assert to.minimum_budget(model, unit=unit) == to.minimum_budget(
        without_experts(moe()), unit=unit
    )
    he.remove()
    assert same(snapshot(model), before) and same_identities(identities(model), ids)
    with torch.no_grad():
        assert torch.equal(model(xs[1]), expected[1])


def test_module_list_dense_first_block_given_units():
    """Blocks of two types (a dense first block) are no repeated blocks: given as units, each
    holds its own weights and, but the first, experts that stream with stream_experts."""
    ref, model = moe(dense_first=True, top_k=1), moe(dense_first=True, top_k=1)
    he, hw = compose(model, unit=list(model.blocks))
    assert hw.unit_kind == "given" and hw.units == ["blocks.0", "blocks.1", "blocks.2", "emb",
                                                    "head"]  # fmt: skip
    with torch.no_grad():
        for x in inputs():
            assert torch.equal(model(x), ref(x))
    hw.remove()
    he.remove()
    assert same(snapshot(model), snapshot(ref))


# -- a checkpoint read by stream_weights (Note: [Checkpoint entries of tensors another engine
# hosts] in weights/_store.py) -------------------------------------------------------------------


def other_values(model, path):
    """Save ``model``'s state dict with other values (each tensor + noise) to ``path``; return
    it."""
    gen = torch.Generator().manual_seed(7)
    sd = {k: (v + torch.randn(v.shape, generator=gen).to(v.dtype)).contiguous()
          for k, v in model.state_dict().items()}  # fmt: skip
    save_file(sd, str(path))
    return sd


def build(kind, dtype=torch.float32):
    return qwen3(dtype=dtype) if kind == "qwen3" else moe(dtype=str(dtype).split(".")[1])


def run(model, kind):
    x = prompt() if kind == "qwen3" else tokens(SPEC, 2, 5, 1)
    with torch.no_grad():
        out = model(x)
    return out.logits if kind == "qwen3" else out


@pytest.mark.parametrize("kind", ["qwen3", "list"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_entries_of_a_checkpoint_are_read_into_the_expert_store(tmp_path, kind, dtype):
    """The experts held their old values (logits 58 and 2455 off in float32)."""
    model, ref = build(kind, dtype), build(kind, dtype)
    sd = other_values(model, tmp_path / "model.safetensors")
    ref.load_state_dict(sd)
    he = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    with torch.no_grad():
        run(model, kind)  # every expert in the cache, with the old values
    hw = stream_weights(model, "cpu", budget_bytes=1 << 30, pin_memory=False,
                        checkpoint=tmp_path / "model.safetensors")  # fmt: skip
    assert torch.equal(run(model, kind), run(ref, kind))
    assert same(model.state_dict(), sd)
    hw.remove()
    he.remove()
    assert same(snapshot(model), snapshot(ref))


@pytest.mark.parametrize("kind", ["qwen3", "list"])
def test_a_checkpoint_lacking_an_expert_is_refused_unless_not_strict(tmp_path, kind):
    model, ref = build(kind), build(kind)
    sd = other_values(model, tmp_path / "full.safetensors")
    expert = next(k for k in sd if ".experts." in k)
    save_file({k: v for k, v in sd.items() if k != expert}, str(tmp_path / "part.safetensors"))
    he = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=rf"1 tensor of the model is not .*'{expert}'"):
        stream_weights(model, "cpu", budget_bytes=1 << 30, pin_memory=False,
                       checkpoint=tmp_path / "part.safetensors")  # fmt: skip
    assert same(snapshot(model), before) and not hasattr(model, "_torchoffload_weights")
    hw = stream_weights(model, "cpu", budget_bytes=1 << 30, pin_memory=False, strict=False,
                        checkpoint=tmp_path / "part.safetensors")  # fmt: skip
    ref.load_state_dict({k: v for k, v in sd.items() if k != expert}, strict=False)
    assert torch.equal(run(model, kind), run(ref, kind))
    assert same(model.state_dict(), ref.state_dict())
    hw.remove()
    he.remove()


def test_an_expert_entry_of_another_shape_is_refused_before_anything_changes(tmp_path):
    model = qwen3()
    sd = other_values(model, tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    sd[name] = sd[name][:, :, :-1].contiguous()
    save_file(sd, str(tmp_path / "model.safetensors"))
    he = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=rf"'{name}' is \[8, 32, 16\] torch.float32"):
        stream_weights(model, "cpu", budget_bytes=1 << 30, pin_memory=False,
                       checkpoint=tmp_path / "model.safetensors")  # fmt: skip
    assert same(snapshot(model), before)
    he.remove()


def test_a_meta_model_cannot_stream_its_experts():
    """stream_experts needs the experts' values at setup: experts on meta are refused (load
    the model first); stream_weights' checkpoint comes after it."""
    with torch.device("meta"):
        model = qwen3()
    with pytest.raises(
        ValueError, match="'model.layers.0.mlp.experts.gate_up_proj' is on the meta"
    ):
        stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)


def test_an_engine_whose_store_cannot_be_filled_is_refused(tmp_path, monkeypatch):
    from torchoffload.moe._store import ExpertStore

    model = moe()
    other_values(model, tmp_path / "model.safetensors")
    he = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    before = snapshot(model)
    monkeypatch.delattr(ExpertStore, "fill_piece")
    with pytest.raises(CheckpointError, match="'blocks.0.experts.0.w1.weight' streams with "):
        stream_weights(model, "cpu", budget_bytes=1 << 30, pin_memory=False,
                       checkpoint=tmp_path / "model.safetensors")  # fmt: skip
    assert same(snapshot(model), before)
    he.remove()
