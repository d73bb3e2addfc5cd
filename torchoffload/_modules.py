"""Finding the structure of a model: its repeated blocks, and modules by name pattern."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

__all__ = ["checkpointed", "find_layers", "held", "matches"]


@contextlib.contextmanager
def checkpointed(layers: Iterable[nn.Module]) -> Iterator[None]:
    """These layers under plain non-reentrant `torch.utils.checkpoint` until the block ends
    (for measuring checkpointing itself; `apply_activation_offloading` has its own, undone by
    ``remove()``)."""
    from torch.utils.checkpoint import checkpoint

    layers = list(layers)
    for layer in layers:
        layer.forward = lambda *a, _f=layer.forward, **k: checkpoint(
            _f, *a, use_reentrant=False, **k
        )
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def find_layers(
    model: nn.Module, skip: Callable[[nn.ModuleList], bool] | None = None
) -> nn.ModuleList:
    """The largest `nn.ModuleList` in ``model`` whose entries all have one type (the repeated
    blocks of a transformer), leaving out lists for which ``skip`` is true. Raises ValueError
    if there is none, or if two lists tie (an encoder and a decoder): which layers to offload
    is then the caller's choice."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        if skip is not None and skip(module):
            continue
        found.append((name, module))
    if not found:
        raise ValueError(
            f"found no repeated layers in {type(model).__name__} (no nn.ModuleList of two or "
            "more modules of one type); pass layers= explicitly, e.g. layers=model.blocks"
        )
    longest = max(len(m) for _, m in found)
    best = [(name, m) for name, m in found if len(m) == longest]
    if len(best) > 1:
        names = ", ".join(f"model.{name}" for name, _ in best)
        raise ValueError(
            f"found {len(best)} lists of {longest} repeated layers in {type(model).__name__} "
            f"({names}); pass layers= explicitly: one of them, or all of them in the order "
            f"the forward runs them, e.g. layers=[*{'model.' + best[0][0]}, "
            f"*{'model.' + best[1][0]}]"
        )
    return best[0][1]


def matches(name: str, patterns: Iterable[str]) -> str | None:
    """The first pattern that matches the dotted ``name`` or one of its prefixes, else None.

    A pattern is an `fnmatch` pattern over dotted names that may match the whole name or any
    dotted suffix of it: ``"lm_head"`` matches ``"lm_head.weight"``, ``"embed_tokens"`` matches
    ``"model.embed_tokens.weight"``, ``"layers.0.*"`` matches ``"model.layers.0.mlp.weight"``.
    """
    parts = name.split(".")
    for pattern in patterns:
        for end in range(len(parts), 0, -1):
            for start in range(end):
                if fnmatch.fnmatchcase(".".join(parts[start:end]), pattern):
                    return pattern
    return None


def held(module: nn.Module, attr: str) -> torch.Tensor | None:
    """The tensor ``module`` holds under ``attr`` now (a parameter or a buffer), or None: an
    engine that streams a tensor tells by it whether the module still holds that tensor or one
    assigned since (``module.weight = nn.Parameter(w)``)."""
    t = module._parameters.get(attr)
    return t if t is not None else module._buffers.get(attr)
