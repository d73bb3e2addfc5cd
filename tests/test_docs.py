"""The docs: the design document's index lists every named Note in the code (and nothing
else), every Python block of README.md and docs/ runs, and their links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_every_note_is_in_the_design_index():
    notes = set()
    for path in (ROOT / "torchoffload").rglob("*.py"):
        for m in re.finditer(r"^\s*(?:# |\"\"\")?Note: \[([^\]]+)\]", path.read_text(), re.M):
            notes.add((m.group(1), path.relative_to(ROOT).as_posix()))
    index = ROOT / "docs" / "design.md"
    rows = set(re.findall(r"^\| (.+?) \| `(torchoffload/[^`]+)` \|$", index.read_text(), re.M))
    assert notes, "no Notes found: the pattern is wrong"
    assert notes - rows == set(), "Notes missing from the index in docs/design.md"
    assert rows - notes == set(), "index rows without a Note in the code"


# - The Python blocks of README.md and the docs pages run, in order, one namespace per page.
#   A block that cannot run on a CPU-only machine without a download is marked with an HTML
#   comment on the line before its fence, `<!-- skip: the reason -->`.

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(`{3,})(\w*)")
_SKIP = re.compile(r"^<!-- skip: (\S.*?) -->$")


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """The ```python blocks of a Markdown file: (line of the fence, code, skip reason)."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, end = i, i + 1
        while not lines[end].startswith(m.group(1)):
            end += 1
        if m.group(2) == "python":
            before = next((line for line in reversed(lines[:start]) if line.strip()), "")
            skip = _SKIP.match(before)
            if before.startswith("<!-- skip") and not skip:
                raise AssertionError(f"{path}:{start}: a skip marker needs a reason: {before}")
            code = "\n".join(lines[start + 1 : end])
            blocks.append((start + 1, code, skip.group(1) if skip else None))
        i = end + 1
    return blocks


def test_skipped_blocks_are_few_and_say_why():
    skipped = [(p.name, n, why) for p in PAGES for n, _, why in python_blocks(p) if why]
    assert all(why for _, _, why in skipped)
    assert len(skipped) <= 8, skipped


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if python_blocks(p)],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a block writes (checkpoints, plots) land here
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__docs__"}
    for line, code, skip in python_blocks(page):
        if skip:
            continue
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)
        except ModuleNotFoundError as e:
            if e.name in OPTIONAL:
                pytest.skip(f"{e.name} is not installed")
            raise


OPTIONAL = {"transformers", "safetensors", "matplotlib"}


def test_links_to_repository_files_resolve():
    """Relative links in README.md and docs/ point at files that exist (MkDocs checks links
    between pages and their anchors; this covers README.md and links out of docs/)."""
    broken = []
    for page in PAGES:
        in_code = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in re.findall(r"\]\(([^)\s#:]+)(?:#[^)\s]*)?\)", line):
                if not (page.parent / target).exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
