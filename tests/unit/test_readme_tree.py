"""The README's "Where things live" block names every package under libs/, services/ and tools/, and only those.

A newcomer reads the tree there before the tree on disk; a package added or removed without its line
makes the two disagree, which this test reports by name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def listed(readme: str, folder: str) -> dict[str, str]:
    """{package: its one-line description} for the `folder/` block of the "Where things live" section."""
    section = readme.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    out: dict[str, str] = {}
    inside = False
    for line in block.splitlines():
        if re.match(r"^\S", line):
            inside = line.startswith(f"{folder}/")
            continue
        m = re.match(r"^  ([a-z0-9_-]+)/\s+(\S.*)$", line)
        if inside and m:
            out[m.group(1)] = m.group(2)
    return out


def on_disk(folder: str) -> set[str]:
    return {p.parent.name for p in (REPO / folder).glob("*/pyproject.toml")}


def test_the_reader_finds_the_lines_of_a_block() -> None:
    text = (
        "## Where things live\n\n```\nlibs/    shared\n  a/     does A\n  b/     does B\nservices/  x\n  c/   C\n```\n"
    )
    assert listed(text, "libs") == {"a": "does A", "b": "does B"}
    assert listed(text, "services") == {"c": "C"}


@pytest.mark.parametrize("folder", ["libs", "services", "tools"])
def test_every_package_has_its_line(folder: str) -> None:
    lines = listed((REPO / "README.md").read_text(), folder)
    packages = on_disk(folder)
    assert len(packages) >= (3 if folder == "tools" else 7)
    assert sorted(packages - lines.keys()) == [], f"{folder}/ packages missing from the README"
    assert sorted(lines.keys() - packages) == [], f"README lines for {folder}/ packages that do not exist"
