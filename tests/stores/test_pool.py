"""The stores' transactions: rollback on error, interruption on cancel, and a connection is only
reused once its thread is done."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from ferry.projected import PostgresStore, SqliteStore, Tx

from .conftest import StoreFactory

LONG = {
    "sqlite": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"
    " SELECT max(x) FROM c",
    "postgres": "SELECT pg_sleep(30)",
}


def create(tx: Tx) -> None:
    tx.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")


def count(tx: Tx) -> int:
    n: int = tx.execute("SELECT count(*) FROM t")[0][0]
    return n


async def test_an_exception_rolls_back(make_store: StoreFactory) -> None:
    store = make_store()
    await store.transact(create)

    def insert_then_fail(tx: Tx) -> None:
        tx.execute("INSERT INTO t (x) VALUES (1)")
        raise KeyError("boom")

    with pytest.raises(KeyError):
        await store.transact(insert_then_fail)
    assert await store.transact(count) == 0


async def test_cancel_interrupts_a_long_statement(make_store: StoreFactory) -> None:
    store = make_store()
    await store.transact(create)

    def insert_then_long(tx: Tx) -> None:
        tx.execute("INSERT INTO t (x) VALUES (1)")
        tx.execute(LONG[tx.dialect])

    start = time.monotonic()
    with trio.move_on_after(0.2) as scope:
        await store.transact(insert_then_long)
    assert scope.cancelled_caught
    # every connection is free again only once the interrupted thread rolled back
    for _ in range(3):
        assert await store.transact(count) == 0
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_connection_reused_only_after_its_thread_is_done(
    kind: str, tmp_path: object, request: pytest.FixtureRequest
) -> None:
    if kind == "sqlite":
        store: SqliteStore | PostgresStore = SqliteStore(f"{tmp_path}/x.db", connections=1)
    else:
        store = PostgresStore(request.getfixturevalue("pg_server").dsn, connections=1)
    first_done = threading.Event()
    seen_by_second: list[bool] = []

    def slow(tx: Tx) -> None:
        time.sleep(0.3)  # no statement: nothing to interrupt, the thread runs on
        first_done.set()

    def second(tx: Tx) -> None:
        seen_by_second.append(first_done.is_set())

    with trio.move_on_after(0.05):
        await store.transact(slow)
    assert not first_done.is_set()  # the caller was released at once
    await store.transact(second)
    assert seen_by_second == [True]
    await store.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await store.transact(second)


async def test_postgres_connection_is_replaced_after_a_cancel(
    request: pytest.FixtureRequest,
) -> None:
    store = PostgresStore(request.getfixturevalue("pg_server").dsn, connections=1)

    def pid(tx: Tx) -> int:
        p: int = tx.execute("SELECT pg_backend_pid()")[0][0]
        return p

    before = await store.transact(pid)
    assert await store.transact(pid) == before
    with trio.move_on_after(0.1):
        await store.transact(lambda tx: tx.execute("SELECT pg_sleep(30)"))
    assert await store.transact(pid) != before
    await store.aclose()
