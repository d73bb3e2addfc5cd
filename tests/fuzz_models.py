"""Random small models for the differential fuzzer (`tests/test_fuzz.py`), built from parts
real models have: an embedding (tied to the head or not), blocks with norms before or after,
residuals, two parameters that are views of one storage, a weight also read transposed, a
parameter used twice, a buffer, a branch on the input's shape (a parameter only one-token
inputs use), a final norm and a head, in float32, float64 or bfloat16. Also an optimizer class
that writes its gradients (`SGDWritesGrad`), for both sides of the fuzzer and for
tests/test_optim.py."""

from __future__ import annotations

import linecache
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Spec:
    vocab: int
    dim: int
    hidden: int
    layers: int
    tied: bool
    norm: str  # "layer", "rms" or "none"
    post_norm: bool  # the norm after the residual (post-LN) rather than before the MLP
    residual: bool
    shared_storage: bool  # the MLP's gate and scale are views of one parameter storage
    transposed: bool  # the block reads fc1's weight again, transposed (outside fc1's forward)
    used_twice: bool  # a gain vector multiplies the block's input and its output
    buffer: bool
    branch: bool  # one-token inputs add a projection that other inputs never use
    final_norm: bool
    head_bias: bool
    dropout: float
    dtype: str
    seed: int
    # two pieces of one storage (unsafe_chunk: a version counter each), each written in place
    # and then saved for backward
    chunk_writes: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def specs(*, dtypes=tuple(DTYPES), dropout: bool = False, max_layers: int = 3):
    return st.builds(
        Spec,
        vocab=st.integers(5, 40),
        dim=st.sampled_from([4, 8, 16]),
        hidden=st.sampled_from([8, 16, 32]),
        layers=st.integers(1, max_layers),
        tied=st.booleans(),
        norm=st.sampled_from(["layer", "rms", "none"]),
        post_norm=st.booleans(),
        residual=st.booleans(),
        shared_storage=st.booleans(),
        transposed=st.booleans(),
        used_twice=st.booleans(),
        chunk_writes=st.booleans(),
        buffer=st.booleans(),
        branch=st.booleans(),
        final_norm=st.booleans(),
        head_bias=st.booleans(),
        dropout=st.sampled_from([0.0, 0.25]) if dropout else st.just(0.0),
        dtype=st.sampled_from(dtypes),
        seed=st.integers(0, 2**16),
    )


def _norm(kind: str, dim: int) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(dim)
    if kind == "rms":
        return nn.RMSNorm(dim)
    return nn.Identity()


class Block(nn.Module):
    def __init__(self, s: Spec):
        super().__init__()
        self.s = s
        self.norm = _norm(s.norm, s.dim)
        self.fc1 = nn.Linear(s.dim, s.hidden)
        self.fc2 = nn.Linear(s.hidden, s.dim, bias=False)
        self.drop = nn.Dropout(s.dropout)
        if s.shared_storage:
            base = torch.randn(2, s.hidden) * 0.5
            self.gate = nn.Parameter(base[0])  # views of one storage
            self.shift = nn.Parameter(base[1])
        if s.used_twice:
            self.gain = nn.Parameter(1 + 0.1 * torch.randn(s.dim))
        if s.buffer:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, s.dim))
        if s.branch:
            self.one = nn.Linear(s.dim, s.dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = self.s
        x = h if s.post_norm else self.norm(h)
        if s.used_twice:
            x = x * self.gain
        u = self.fc1(x)
        if s.shared_storage:
            u = u * torch.sigmoid(self.gate) + self.shift
        a = F.gelu(u)
        if s.chunk_writes:  # each piece saved after its own write: a storage whose pieces
            p, q = (a * 1).unsafe_chunk(2, dim=-1)  # are saved at different versions
            p.mul_(2)
            sp = p.sin()
            q.mul_(3)
            a = a + 0.1 * torch.cat([sp, q.sin()], dim=-1)
        out = self.fc2(a)
        if s.transposed:
            out = out + 0.1 * (a @ self.fc1.weight)  # (hidden, dim): fc1's weight, transposed use
        if s.used_twice:
            out = out * self.gain
        if s.buffer:
            out = out * self.scale
        if s.branch and h.shape[1] == 1:
            out = out + self.one(x)
        out = self.drop(out)
        if s.residual:
            out = h + out
        return self.norm(out) if s.post_norm else out


class Model(nn.Module):
    def __init__(self, s: Spec):
        super().__init__()
        torch.manual_seed(s.seed)
        self.s = s
        self.emb = nn.Embedding(s.vocab, s.dim)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = _norm(s.norm if s.final_norm else "none", s.dim)
        self.head = nn.Linear(s.dim, s.vocab, bias=s.head_bias)
        if s.tied:
            self.head.weight = self.emb.weight  # one Parameter in two modules, as HF ties
        self.to(s.torch_dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def build(s: Spec) -> Model:
    return Model(s)


def tokens(s: Spec, batch: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, s.vocab, (batch, seq), generator=g)


def loss_of(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), x.roll(-1, 1).flatten())


class SGDWritesGrad(torch.optim.Optimizer):
    """SGD, with momentum, whose L2 weight decay is added into ``p.grad`` in place, as some
    optimizers do (torch.optim's classes only read it): a class that writes its gradients
    (Note: [A class that writes its gradients]). Where a group's ``weight_decay`` is 0 it only
    reads them. Deterministic: the same bits on the plain side and on the host."""

    def __init__(self, params, lr=0.1, momentum=0.0, weight_decay=0.5):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["weight_decay"]:
                    p.grad.add_(p, alpha=group["weight_decay"])
                d = p.grad
                if group["momentum"]:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = d.clone()
                    else:
                        state["momentum_buffer"].mul_(group["momentum"]).add_(d)
                    d = state["momentum_buffer"]
                p.add_(d, alpha=-group["lr"])


# - Mixture-of-experts models (stream_experts): a router and a ModuleList of experts per block.


@dataclass(frozen=True)
class MoESpec:
    vocab: int
    dim: int
    hidden: int
    layers: int
    experts: int
    top_k: int
    bias: bool  # the experts' linears have biases
    norm_topk: bool  # routing weights renormalized over the top k
    dense_first: bool  # the first block is a plain MLP (no experts), as DeepSeek's
    dtype: str
    seed: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def moe_specs(*, dtypes=tuple(DTYPES)):
    return st.builds(
        MoESpec,
        vocab=st.integers(5, 40),
        dim=st.sampled_from([4, 8, 16]),
        hidden=st.sampled_from([8, 12, 32]),
        layers=st.integers(1, 3),
        experts=st.integers(2, 8),
        top_k=st.integers(1, 3),
        bias=st.booleans(),
        norm_topk=st.booleans(),
        dense_first=st.booleans(),
        dtype=st.sampled_from(dtypes),
        seed=st.integers(0, 2**16),
    )


class Expert(nn.Module):
    """A SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEBlock(nn.Module):
    """Pre-norm residual block whose MLP routes each token to ``top_k`` of its experts."""

    def __init__(self, s: MoESpec):
        super().__init__()
        self.top_k = min(s.top_k, s.experts)
        self.norm_topk = s.norm_topk
        self.norm = nn.RMSNorm(s.dim)
        self.gate = nn.Linear(s.dim, s.experts, bias=False)
        self.experts = nn.ModuleList(Expert(s.dim, s.hidden, s.bias) for _ in range(s.experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, pos = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(flat[token]) * weights[token, pos, None])
        return h + out.view_as(h)


class MoEModel(nn.Module):
    def __init__(self, s: MoESpec):
        super().__init__()
        torch.manual_seed(s.seed)
        self.s = s
        self.emb = nn.Embedding(s.vocab, s.dim)
        blocks: list[nn.Module] = [MoEBlock(s) for _ in range(s.layers)]
        if s.dense_first:
            blocks[0] = nn.Sequential(nn.RMSNorm(s.dim), Expert(s.dim, s.hidden, s.bias))
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(s.dim, s.vocab)
        self.to(s.torch_dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h) if isinstance(b, MoEBlock) else h + b(h)
        return self.head(h)


def build_moe(s: MoESpec) -> MoEModel:
    return MoEModel(s)


_EXPERTS_517: dict[type, type] = {}


def experts_517(cls: type) -> type:
    """A subclass of transformers 5.24's fused experts class ``cls`` (Qwen3MoeExperts) whose
    forward is 5.17's per-expert loop: 5.24's with ``one_hot(..., num_classes=
    self.num_experts)`` (no padding class, so an index of the expert count fails instead of
    being skipped). The GPU machine has 5.17, the CPU's package index 5.24."""
    import inspect
    import textwrap

    if cls not in _EXPERTS_517:
        fn = cls.forward
        src = textwrap.dedent(inspect.getsource(getattr(fn, "__wrapped__", fn)))
        src = "\n".join(line for line in src.splitlines() if not line.startswith("@"))
        old = "num_classes=self.num_experts + 1)"
        if old not in src and "num_classes=self.num_experts)" in src:
            return cls  # transformers 5.17's own
        assert src.count(old) == 1, "transformers' loop changed: update experts_517"
        ns: dict = {}
        # the imports of transformers' module: a call on an imported module's attribute
        # compiles differently from one on a global (torchoffload compares the code)
        text = "import torch\nfrom torch import nn\n" + src.replace(
            old, "num_classes=self.num_experts)"
        )
        name = f"<experts_517 of {cls.__qualname__}>"
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)  # inspect reads it
        exec(compile(text, name, "exec"), ns)
        _EXPERTS_517[cls] = type(f"{cls.__name__}517", (cls,), {"forward": ns["forward"]})
    return _EXPERTS_517[cls]


def skips_sentinel(experts) -> bool:
    """Whether the plain fused ``experts`` serve the index of their expert count: transformers
    5.24's per-expert loop skips it (its mask has a padding class); 5.17's one_hot fails on it
    (on a GPU with a device assert) and its grouped_mm and batched_mm leave or index it."""
    import inspect

    if getattr(experts.config, "_experts_implementation", "eager") not in (None, "eager"):
        return False
    fn = type(experts).forward
    return "num_classes=self.num_experts + 1)" in inspect.getsource(getattr(fn, "__wrapped__", fn))
