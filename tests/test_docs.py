"""The design document's index lists every named Note in the code (and nothing else)."""

from __future__ import annotations

import re
from pathlib import Path

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
