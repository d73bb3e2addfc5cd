"""What each module-level operation does while activation offloading is applied (the contract
table for the activation modes in docs/contract.md), on CPU. The data-carrying rows run on the
GPU in test_activations_contract_gpu.py."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
from conftest import assert_bitwise, clone_model, train_steps
from torch import nn

from torchoffload import (
    ActivationOffloadConfig,
    PinnedPool,
    apply_activation_offloading,
    find_layers,
    offload_activations,
    plan,
)
from torchoffload.models import GPT, GPTConfig

CFG = GPTConfig(hidden=64, layers=4, heads=2, vocab=128, max_seq=33)
MODES = ["layers", "stream", "recompute"]


def make():
    torch.manual_seed(0)
    return GPT(CFG)


def data(n=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab, (2, 33), generator=g) for _ in range(n)]


def pool():
    return PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=False)


def attach(model, mode):
    """A handle of each kind that `apply_activation_offloading` returns."""
    if mode == "layers":
        return apply_activation_offloading(
            model, config=ActivationOffloadConfig(min_bytes=0), pool=pool(), device="cpu"
        )
    p = plan(model, (data(1)[0][:, :-1],), budget_bytes=None, min_bytes=0)
    p = dataclasses.replace(p, decisions=(mode,) * CFG.layers)
    return p.apply(model, pool=pool(), device="cpu")


def hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def offloaded(handle):
    return handle.stats().offloaded_tensors


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_parameters_and_load_are_the_models_own(mode):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    handle = attach(model, mode)
    sd = model.state_dict()
    assert sd.keys() == before.keys() and all(torch.equal(sd[k], before[k]) for k in sd)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    other = make()
    for p in other.parameters():
        torch.nn.init.normal_(p)
    model.load_state_dict(other.state_dict())
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    ref = train_steps(clone_model(model), data())
    assert_bitwise(ref, train_steps(model, data()))  # the optimizer sees the same parameters
    handle.remove()


@pytest.mark.parametrize("mode", MODES)
def test_dtype_conversion_keeps_offloading_exact(mode):
    model = make()
    handle = attach(model, mode)
    model.double()
    ref = train_steps(make().double(), data())
    got = train_steps(model, data())
    assert_bitwise(ref, got)
    if mode != "recompute":
        assert offloaded(handle) > 0
    handle.remove()


@pytest.mark.parametrize("mode", MODES)
def test_deepcopy_gives_a_plain_copy_and_leaves_the_original_offloading(mode):
    model = make()
    handle = attach(model, mode)
    ema = copy.deepcopy(model)  # an EMA copy, as training loops make
    n = offloaded(handle)
    ref = train_steps(make(), data())
    assert_bitwise(ref, train_steps(ema, data()))
    assert offloaded(handle) == n  # the copy does not drive the original's handle
    if mode == "recompute":  # the copy's checkpointed layers run the copy's own weights
        with torch.no_grad():
            ema.layers[0].fc1.weight.zero_()
        x = data(1)[0][:, :-1]
        assert not torch.equal(ema(x), model(x))
    assert_bitwise(ref, train_steps(model, data()))
    if mode != "recompute":
        assert offloaded(handle) > n
    handle.remove()
    assert hook_counts(model) == hook_counts(make())


@pytest.mark.parametrize("mode", MODES)
def test_pickle_and_torch_save_of_the_model_round_trip(mode):
    model = make()
    handle = attach(model, mode)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    again = pickle.loads(pickle.dumps(model))
    ref = train_steps(make(), data())
    assert_bitwise(ref, train_steps(loaded, data()))
    assert_bitwise(ref, train_steps(again, data()))
    handle.remove()


@pytest.mark.parametrize("mode", MODES)
def test_a_second_handle_on_the_model_or_a_part_of_it_is_refused(mode):
    model = make()
    handle = attach(model, mode)
    counts = hook_counts(model)
    block = model.layers[0]
    for target, layers in [(model, "auto"), (block, [block.fc1, block.fc2])]:
        with pytest.raises(RuntimeError, match="already applied .* remove"):
            apply_activation_offloading(target, layers=layers, device="cpu")
    wrapper = nn.Sequential(model)
    with pytest.raises(RuntimeError, match="to its submodule GPT"):
        apply_activation_offloading(wrapper, layers=model.layers, device="cpu")
    assert hook_counts(model) == counts
    handle.remove()
    apply_activation_offloading(model, device="cpu").remove()  # after remove(): accepted


@pytest.mark.parametrize("mode", MODES)
def test_eval_and_train_switches(mode):
    model = make()
    handle = attach(model, mode)
    x = data(1)[0][:, :-1]
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, make().eval()(x))
    model.train()
    assert_bitwise(train_steps(make(), data()), train_steps(model, data()))
    handle.remove()


@pytest.mark.parametrize("mode", MODES)
def test_hooks_added_after_ours_see_the_real_outputs(mode):
    model = make()
    handle = attach(model, mode)
    seen = []
    model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    model.layers[1].register_forward_hook(lambda m, a, o: seen.append(o.clone()))
    ref_seen = []
    ref = make()
    ref.layers[1].register_forward_pre_hook(lambda m, a: ref_seen.append(a[0].clone()))
    ref.layers[1].register_forward_hook(lambda m, a, o: ref_seen.append(o.clone()))
    assert_bitwise(train_steps(ref, data()), train_steps(model, data()))
    assert len(seen) == len(ref_seen) and all(
        torch.equal(a, b) for a, b in zip(seen, ref_seen, strict=True)
    )
    handle.remove()


def test_torch_compile_of_a_model_with_a_handle_matches_the_compiled_model():
    torch._dynamo.reset()
    ref = torch.compile(make())
    base = train_steps(ref, data())
    model = make()
    handle = attach(model, "layers")
    got = train_steps(torch.compile(model), data())
    assert_bitwise(base, got)
    assert offloaded(handle) > 0
    handle.remove()
    torch._dynamo.reset()


def test_offload_activations_around_a_compiled_model():
    torch._dynamo.reset()
    base = train_steps(torch.compile(make()), data())
    ctx = offload_activations(min_bytes=0, pool=pool(), device="cpu")
    got = train_steps(torch.compile(make()), data(), lambda: ctx)
    assert_bitwise(base, got)
    assert ctx.stats().offloaded_tensors > 0
    torch._dynamo.reset()


def test_find_layers_refuses_to_guess_between_equal_lists():
    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.decoder = nn.Module()
            self.decoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    with pytest.raises(ValueError, match=r"model\.encoder\.layers, model\.decoder\.layers"):
        find_layers(EncoderDecoder())


def test_hugging_face_save_and_load_with_a_handle_attached(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    handle = apply_activation_offloading(
        model, config=ActivationOffloadConfig(min_bytes=0), pool=pool(), device="cpu"
    )
    x = torch.randint(0, 128, (2, 16))
    model(x, labels=x).loss.backward()
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert offloaded(handle) > 0
    handle.remove()


def test_a_handle_dropped_without_remove_does_not_keep_the_model_alive():
    import gc
    import weakref

    model = make()
    attach(model, "layers")
    train_steps(model, data(1))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
