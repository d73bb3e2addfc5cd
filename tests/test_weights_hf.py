"""Weight streaming with Hugging Face models built from a config (random weights, no download).

Skipped when transformers is not installed (it is an optional extra: ``pip install .[hf]``).
"""

from __future__ import annotations

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
