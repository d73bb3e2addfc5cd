"""Weight streaming with Hugging Face models built from a config (random weights, no download).

Skipped when transformers is not installed (it is an optional extra: ``pip install .[hf]``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from torchoffload import stream_weights

transformers = pytest.importorskip("transformers")

GEN = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)


def llama(tie=False, layers=4):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def prompt(batch=2, seq=7):
    return torch.randint(1, 256, (batch, seq), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "factory, unit, resident",
    [
        (llama, None, ()),
        (llama, "blocks", ("embed_tokens", "lm_head")),
        (lambda: llama(tie=True), "leaves", ()),
        (lambda: llama(tie=True), "blocks", ("embed_tokens",)),
        (gpt2, None, ()),
    ],
)
def test_generate_same_tokens(factory, unit, resident):
    model = factory()
    x = prompt()
    expected = model.generate(x, **GEN)
    h = stream_weights(
        model, "cpu", budget_bytes=500_000, unit=unit, resident=resident, pin_memory=False
    )
    assert torch.equal(model.generate(x, **GEN), expected)
    assert torch.equal(
        model.generate(prompt(1, 11), **GEN), factory().generate(prompt(1, 11), **GEN)
    )
    st = h.stats()
    # one call for the prompt, then one per new token; the schedule held for all of them
    assert st.calls == 2 * GEN["max_new_tokens"] and st.schedule_rerecords == 0
    assert st.peak_device_bytes <= 500_000
    h.remove()
    assert torch.equal(model.generate(x, **GEN), expected)


def test_forward_logits_bitwise_and_device_property():
    model = llama()
    x = prompt(3, 9)
    with torch.no_grad():
        expected = model(x).logits
    h = stream_weights(model, "cpu", budget_bytes=300_000, pin_memory=False)
    assert model.device.type == "cpu"  # placeholders stay on the compute device
    with torch.inference_mode():
        assert torch.equal(model(x).logits, expected)
    h.remove()


@pytest.mark.parametrize("tie", [False, True])
def test_save_pretrained_while_streaming_round_trips(tmp_path, tie):
    """save_pretrained of a streamed model writes the real weights (from the host store);
    from_pretrained of that checkpoint is bitwise the original, tied weights included."""
    ref = llama(tie=tie)
    model = llama(tie=tie)
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    handle.remove()
    for (name, a), b in zip(ref.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(loaded(prompt()).logits, ref(prompt()).logits)


@contextlib.contextmanager
def parameters_on_meta():
    """Parameters created on the meta device, buffers real: what accelerate's
    init_empty_weights(include_buffers=False) does (accelerate is not a test dependency)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # a tied weight is assigned again
            p = module._parameters[name]
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), p.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@pytest.mark.parametrize("tie", [False, True])
def test_meta_llama_streams_from_a_sharded_save_pretrained_checkpoint(tmp_path, tie):
    """The checkpoint-larger-than-the-GPU path: a Llama built with its parameters on meta
    streams from a sharded safetensors checkpoint written by save_pretrained; logits bitwise
    equal to the materialized model."""
    ref = llama(tie=tie)
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    with parameters_on_meta():
        model = transformers.LlamaForCausalLM(ref.config).eval()
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    handle = stream_weights(
        model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=tmp_path
    )
    with torch.no_grad():
        assert torch.equal(model(prompt()).logits, ref(prompt()).logits)
        out = model.generate(prompt(), **GEN)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(out, ref.generate(prompt(), **GEN))


def test_meta_buffers_missing_from_the_checkpoint_are_named(tmp_path):
    ref = llama()
    ref.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(ref.config).eval()
    with pytest.raises(ValueError, match=r"inv_freq.*init_empty_weights\(include_buffers=False\)"):
        stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=tmp_path)
