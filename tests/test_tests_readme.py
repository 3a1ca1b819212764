"""tests/README.md names every test file, so that the map from behaviour to file stays whole."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_file_has_a_row_in_the_tests_readme() -> None:
    text = (TESTS / "README.md").read_text(encoding="utf-8")
    files = sorted(p.relative_to(TESTS) for p in TESTS.rglob("test_*.py"))
    assert len(files) > 50
    missing = [str(f) for f in files if f.name not in text]
    assert missing == [], "add a row for each to tests/README.md"
