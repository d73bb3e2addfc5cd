"""The house's shape: imports run down the layers (no circle, no arrow back up), and no class
or function grows past what a reader holds in their head (issue 39)."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchoffload"

# Each part of the package (a top-level module or a subpackage) and its layer: a part may
# import only parts of lower layers. Imports inside functions and under TYPE_CHECKING count
# too (an arrow is an arrow, whenever it is followed). A new module must be placed here.
LAYERS: dict[str, int] = {
    # foundations: checks, module walking, flattening, call plumbing
    "_validate": 0,
    "_modules": 0,
    "_flatten": 0,
    "_calls": 0,
    # memory and copies: the pinned pool, the copy engine, placement rules, hosted tensors
    "_pool": 1,
    "_transfer": 1,
    "_placement": 1,
    "_hosted": 1,
    # the saved-tensor engine under activation offloading
    "_saved": 2,
    # the engines
    "activations": 3,
    "layers": 3,
    "weights": 3,
    "optim": 3,
    # compiled programs and expert streaming are built on the weight engine's layers
    "compile": 4,
    "moe": 4,
    # above the engines: the planner, the user check, test helpers, example models
    "planner": 5,
    "verify": 5,
    "integrations": 5,
    "testing": 5,
    "models": 5,
    # entry points
    "cli": 6,
    "__main__": 7,
    "__init__": 7,
}


def part(module: str) -> str:
    """The part of ``torchoffload.a.b`` is ``a``; of ``torchoffload`` itself, ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_arrows() -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        source = part(".".join(p for p in rel.parts if p != "__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import (the house uses absolute ones)")
            if isinstance(node, ast.ImportFrom) and node.module == "torchoffload":
                targets = [f"torchoffload.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torchoffload."
            ):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("torchoffload.")]
            else:
                continue
            for target in targets:
                if part(target) != source:
                    arrows[source].add(part(target))
    return arrows


def test_every_part_has_a_layer():
    parts = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")
    }
    assert parts - set(LAYERS) == set(), "place the new module in LAYERS"


def test_imports_run_down_the_layers():
    arrows = import_arrows()
    assert arrows["layers"], "no arrows found: the walk is wrong"
    up = sorted(
        f"{a} (layer {LAYERS[a]}) imports {b} (layer {LAYERS[b]})"
        for a, targets in arrows.items()
        for b in targets
        if LAYERS[b] >= LAYERS[a]
    )
    assert up == [], "arrows that do not run down the layers:\n" + "\n".join(up)


def test_the_check_sees_a_circle(tmp_path, monkeypatch):
    """The check above can fail: an engine importing the planner is an arrow up."""
    fake = tmp_path / "torchoffload"
    (fake / "planner").mkdir(parents=True)
    (fake / "planner" / "__init__.py").write_text("from torchoffload.layers import x\n")
    (fake / "layers.py").write_text("def f():\n    from torchoffload.planner import Plan\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    arrows = import_arrows()
    assert arrows == {"planner": {"layers"}, "layers": {"planner"}}


# A reader holds a class of about 250 lines, or a function of about 120, in their head; past
# that, split it by role (issue 39).
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 120


def test_no_class_or_function_outgrows_a_reader():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = (
                MAX_CLASS_LINES
                if isinstance(node, ast.ClassDef)
                else MAX_FUNCTION_LINES
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else None
            )
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                lines = node.end_lineno - node.lineno + 1
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert too_long == [], "split by role:\n" + "\n".join(too_long)
