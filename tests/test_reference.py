"""docs/reference.md is what the code makes now (`tests/reference.py`): a public name added,
removed or re-documented without the page fails here, with the command that mends it."""

from __future__ import annotations

import difflib
from pathlib import Path

from tests import reference

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


def test_the_reference_page_is_what_the_code_makes() -> None:
    made = reference.render()
    kept = PAGE.read_text(encoding="utf-8")
    diff = "".join(
        difflib.unified_diff(
            kept.splitlines(keepends=True), made.splitlines(keepends=True), "docs", "code", n=1
        )
    )
    assert made == kept, (
        "docs/reference.md disagrees with the code; run"
        f" `python -m tests.reference > docs/reference.md`:\n{diff[:4000]}"
    )


def test_the_reference_names_every_public_call_with_its_keywords() -> None:
    made = reference.render()
    assert "`async Engine.start(plan: Plan, *, flow_id: str | None = None" in made
    assert "### `ferry.flow.Snapshot` (record)" in made
    assert "| `park_deadline` | `float \\| None` |  |" in made
    assert "### `stm.TVar` (class)" in made
    assert "(no docstring)" not in made
