"""The flow docs hold: their links resolve and lead to the fleet page and the inspector, and
docs/flow-fleet.md's PostgreSQL saga test runs as it is written there."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests import pg

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_lead_to_the_fleet_page_and_the_inspector() -> None:
    guide = (ROOT / "docs" / "flow.md").read_text()
    assert "](flow-fleet.md)" in guide and "python -m ferry.flow orders.db list" in guide
    readme = (ROOT / "README.md").read_text()
    assert "python -m ferry.flow orders.db list" in " ".join(readme.split())  # after the tour
    assert "[docs/flow-fleet.md](docs/flow-fleet.md)" in readme
    assert "[docs/operating.md](docs/operating.md)" in readme and "](operating.md" in guide
    for page in ("flow.md", "flow-fleet.md", "operating.md"):  # every relative link resolves
        text = (ROOT / "docs" / page).read_text()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (ROOT / "docs" / target).exists(), f"{page} links {target}, which is missing"


def test_the_docs_postgres_saga_test(
    pg_server: pg.PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/flow-fleet.md's "Testing your sagas on PostgreSQL", run as it is written there
    against the suite's server (TEST_DSN), on the real clock."""
    text = (ROOT / "docs" / "flow-fleet.md").read_text()
    section = text.split("## Testing your sagas on PostgreSQL\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    monkeypatch.setenv("TEST_DSN", pg_server.dsn)
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(code, "docs/flow-fleet.md", "exec"), namespace)
    tests = sorted(name for name in namespace if name.startswith("test_"))
    assert tests == ["test_a_confirmation_ships_the_order", "test_no_confirmation_refunds"]
    for name in tests:
        namespace[name]()
