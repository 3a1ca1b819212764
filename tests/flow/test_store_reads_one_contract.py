"""Every store read of the trio side meets one error contract (`_runtime/_read.py`,
docs/adr/0134): a broken store, a locked database, a lost connection and a closed store are
each `ferry.Failed` naming what was read, the driver's error its cause, never the driver's
exception as it is; `_retry.unavailable` says which of them the engine retries.

The client's reads (`flow.connect`'s `get`, `history`) raised the driver's exception as it was
before they read through it: `test_a_clients_read_of_a_broken_store_is_failed` failed then.
"""

from __future__ import annotations

import sqlite3
from functools import partial
from pathlib import Path

import pytest
import trio

from ferry import Failed, flow
from ferry.flow._runtime import _read, _retry
from ferry.flow._store import _schema, _sql, _store
from ferry.projected import PostgresStore, SqliteStore
from tests import pg


async def _made(path: Path) -> None:
    """An SQLite file with the flow tables, as an engine leaves it."""
    async with SqliteStore(path) as store:
        await store.transact(_schema.create_schema)


async def test_a_clients_read_of_a_broken_store_is_failed(tmp_path: Path) -> None:
    path = tmp_path / "flows.db"
    await _made(path)
    with sqlite3.connect(path) as conn:
        conn.execute(f"DROP TABLE {_sql.HISTORY}")
    async with flow.connect(str(path)) as client:
        with pytest.raises(Failed, match="reading the history of 'f'") as raised:
            await client.history("f")
        assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
        assert not _retry.unavailable(raised.value)  # a missing table: raised, not retried
        assert await client.get("f") is None  # the flows table is there


async def test_a_locked_database_is_failed_and_unavailable(tmp_path: Path) -> None:
    """Another connection holds the file's write lock: the read cannot begin (no busy wait)."""
    path = tmp_path / "flows.db"
    await _made(path)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        async with SqliteStore(path, busy_timeout=0) as store:
            with pytest.raises(Failed, match="reading flow 'f'") as raised:
                await _read.read(store, partial(_store.load, flow_id="f"), "reading flow 'f'")
            assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
            assert _retry.unavailable(raised.value)  # the engine's own reads retry it
            holder.execute("ROLLBACK")
            assert await _read.read(store, partial(_store.load, flow_id="f"), "again") is None
    finally:
        holder.close()


async def test_a_closed_store_is_failed_and_not_retried(tmp_path: Path) -> None:
    path = tmp_path / "flows.db"
    await _made(path)
    store = SqliteStore(path)
    async with store:
        pass
    with pytest.raises(Failed, match="reading flow 'f'") as raised:
        await _read.read(store, partial(_store.load, flow_id="f"), "reading flow 'f'")
    assert isinstance(raised.value.__cause__, trio.ClosedResourceError)
    assert not _retry.unavailable(raised.value)


async def test_a_lost_connection_is_failed_and_unavailable(pg_server: pg.PgServer) -> None:
    """The server ends the store's session (a network fault, an operator's
    pg_terminate_backend): the next read on it fails, and says it may be retried."""
    import psycopg

    async with PostgresStore(pg_server.fresh_schema_dsn(), connections=1) as store:
        await store.transact(_schema.create_schema)
        (pid,) = (await store.transact(lambda tx: tx.execute("SELECT pg_backend_pid()")))[0]
        with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        with pytest.raises(Failed, match="reading flow 'f'") as raised:
            await _read.read(store, partial(_store.load, flow_id="f"), "reading flow 'f'")
        assert isinstance(raised.value.__cause__, psycopg.OperationalError)
        assert _retry.unavailable(raised.value)
        assert await _read.read(store, partial(_store.load, flow_id="f"), "again") is None
