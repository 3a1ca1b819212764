from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from ferry.projected import PostgresStore, SqliteStore, Store
from tests import pg

StoreFactory = Callable[[], Store]


@pytest.fixture(params=["sqlite", "postgres"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreFactory]:
    """Makes stores on one fresh database (each store is like a separate process)."""
    made: list[Store] = []
    if request.param == "sqlite":
        path = tmp_path / "journal.db"

        def factory() -> Store:
            made.append(SqliteStore(path, synchronous="NORMAL"))
            return made[-1]
    else:
        server: pg.PgServer = request.getfixturevalue("pg_server")
        dsn = server.fresh_schema_dsn()

        def factory() -> Store:
            made.append(PostgresStore(dsn, connections=2))
            return made[-1]

    yield factory
    for store in made:
        await store.aclose()
