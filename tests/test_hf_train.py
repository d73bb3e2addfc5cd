"""Training Hugging Face models with activation offloading: the one-line recipe.

Models are built from small configs with random weights (nothing is downloaded). Skipped when
transformers is not installed (an optional extra: ``pip install .[hf]``).
"""

from __future__ import annotations

import pytest
import torch

import torchoffload

transformers = pytest.importorskip("transformers")

VOCAB = 256


# Llama and Qwen2 take the same config fields.
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER))


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


FACTORIES = {"llama": llama, "qwen2": qwen2, "gpt2": gpt2}


def train(name, mode, steps=3, checkpointing=False):
    torch.manual_seed(0)
    model = FACTORIES[name]().train()
    if checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    pool = torchoffload.PinnedPool(64 << 20, slab_bytes=8 << 20, pin_memory=False)
    handle = None
    if mode == "layers":
        # The recipe: one line after building (and, for FSDP, after sharding) the model.
        handle = torchoffload.apply_activation_offloading(
            model, config=torchoffload.ActivationOffloadConfig(min_bytes=0), pool=pool
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    record = []
    ctx = None
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        if mode == "context":
            ctx = torchoffload.offload_activations(min_bytes=0, pool=pool, device="cpu")
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        record.append(loss.detach().clone())
        record.extend(p.grad.clone() for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = handle.stats() if handle is not None else (ctx.stats() if ctx else None)
    if handle is not None:
        assert handle.layers == list(torchoffload.find_layers(model))  # found the decoder layers
        handle.remove()
    return record, stats


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("mode", ["layers", "context"])
def test_hf_training_parity(name, mode):
    expected, _ = train(name, "none")
    got, stats = train(name, mode)
    assert stats.offloaded_bytes > 0 and stats.prefetch_misses < stats.reloaded_tensors
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_hf_gradient_checkpointing_composes():
    """HF's own gradient checkpointing plus offloading: checkpointed layers save only their
    inputs, which are offloaded and prefetched with their layer."""
    expected, _ = train("llama", "none", checkpointing=True)
    got, stats = train("llama", "layers", checkpointing=True)
    assert stats.offloaded_bytes > 0
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
