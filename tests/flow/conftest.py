from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ferry.projected import PostgresStore
from tests import pg

# The store contract suite runs on both stores, on fresh databases, like tests/stores.
from tests.stores.conftest import make_store as make_store

__all__ = ["make_store", "where"]


@pytest.fixture(params=["sqlite", "postgres"])
async def where(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """What an engine opens, once on each store: an SQLite file's path (not yet made), or
    one open PostgreSQL store on a fresh schema of the suite's server (3 connections), closed
    after the test."""
    if request.param == "sqlite":
        yield str(tmp_path / "flows.db")
        return
    server: pg.PgServer = request.getfixturevalue("pg_server")
    store = PostgresStore(server.fresh_schema_dsn(), connections=3)
    try:
        yield store
    finally:
        await store.aclose()
