"""Shared pieces of the flow tests.

`InlineSqliteStore` is a real SQLite store (the same SQL, the same file format, BEGIN IMMEDIATE
transactions) that runs each transaction on the trio thread instead of a worker thread. Why:
under `MockClock(autojump_threshold=0)` a task waiting for a worker thread counts as blocked, so
the clock would jump to the next deadline (a park's timeout, a `wait` timeout) while a write is
still in flight, and timing tests would race. Inline, a transaction is a checkpoint followed by
synchronous work, so time moves only when every task waits for time. The threaded stores
(`SqliteStore`, `PostgresStore`) run the store contract suite and the engine tests marked as such.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from ferry.projected import Tx

T = TypeVar("T")


class _InlineTx:
    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    @property
    def connection(self) -> sqlite3.Connection:
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = self._conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)


class InlineSqliteStore:
    """A real SQLite store whose transactions run on the trio thread (see the module doc).

    `fail_next` makes the next `n` transactions raise `sqlite3.OperationalError` before they run
    (a database that is briefly unavailable); while `gate` is an unset `trio.Event`, transactions
    wait for it (a slow database). `transactions` counts committed transactions.
    """

    dialect = "sqlite"

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self.fail_next = 0
        self.gate: trio.Event | None = None
        self.transactions = 0

    async def transact(self, fn: Callable[[Tx], T]) -> T:
        await trio.lowlevel.checkpoint()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise sqlite3.OperationalError("database is unavailable (planted by the test)")
        if self._conn is None:
            self._conn = sqlite3.connect(self.path, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=OFF")
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(_InlineTx(conn))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self.transactions += 1
        return result

    async def aclose(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
