from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import pg


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pg.PgServer]:
    server = pg.acquire()
    if server is None:
        pytest.skip(pg.SKIP_REASON)
    try:
        yield server
    finally:
        pg.release()
