"""A small GPT used by the demo, the tests and the benchmarks (no downloads, no extras).

Pre-norm blocks: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, causal scaled-dot-product
attention and a GELU MLP. `GPT` adds token and position embeddings and a tied LM head;
`BlockStack` is the bare stack on hidden states, as the benchmarks use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "BlockStack", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 1024
    max_seq: int = 512
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "vocab", "max_seq", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class BlockStack(nn.Module):
    """``layers`` blocks applied to hidden states ``[batch, seq, hidden]``."""

    def __init__(self, hidden: int, layers: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, heads, mlp_ratio) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.hidden)
        self.pos = nn.Embedding(config.max_seq, config.hidden)
        self.layers = nn.ModuleList(
            Block(config.hidden, config.heads, config.mlp_ratio) for _ in range(config.layers)
        )
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
