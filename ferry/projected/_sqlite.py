"""The SQLite store: stdlib `sqlite3`, one file, WAL mode, writers serialized by BEGIN IMMEDIATE.

Each connection is used by one worker thread at a time (see `_pool`), so it is opened with
``check_same_thread=False``. `interrupt()` is SQLite's own thread-safe way to stop a statement.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from collections.abc import Sequence
from typing import Any, TypeVar, final

from ._pool import ConnectionPool, PooledStore, _Use
from ._types import Tx

T = TypeVar("T")

_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


class _SqliteTx:
    __slots__ = ("_conn", "_use")
    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection, use: _Use) -> None:
        self._conn = conn
        self._use = use

    @property
    def connection(self) -> sqlite3.Connection:
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._use.check()
        cur = self._conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._use.check()
        self._conn.executemany(sql, rows)


class _SqliteDriver:
    dialect = "sqlite"
    discard_after_cancel = False
    inline_under_mock_clock = True  # a local file: a transaction is short and cannot hang

    def __init__(self, path: str, busy_timeout: float, synchronous: str, create: bool) -> None:
        self._path = path
        # Without create: the file's absolute path (fixed now) as a URI opened read-write only,
        # so that a file removed meanwhile is an error, not a new empty database.
        self._uri = None if create else f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=rw"
        self._busy_timeout = busy_timeout
        self._synchronous = synchronous
        self._query_only: set[int] = set()  # ids of connections in a read transaction

    def connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self._path if self._uri is None else self._uri,
            timeout=self._busy_timeout,
            isolation_level=None,
            check_same_thread=False,
            uri=self._uri is not None,
        )
        # A new (empty) file is made in incremental auto-vacuum mode, so that what a purge
        # deletes can be given back (`PRAGMA incremental_vacuum`); set before WAL, which writes
        # the header. An existing file is left as it is (the pragma would wait for its lock).
        if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        return conn

    def begin(self, conn: sqlite3.Connection, read_only: bool) -> None:
        if read_only:
            conn.execute("PRAGMA query_only=ON")  # until the transaction ends (`_end`)
            self._query_only.add(id(conn))
            conn.execute("BEGIN DEFERRED")
        else:
            conn.execute("BEGIN IMMEDIATE")

    def commit(self, conn: sqlite3.Connection) -> None:
        conn.execute("COMMIT")
        self._end(conn)

    def rollback(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        self._end(conn)

    def _end(self, conn: sqlite3.Connection) -> None:
        if id(conn) in self._query_only:
            self._query_only.discard(id(conn))
            conn.execute("PRAGMA query_only=OFF")

    def make_tx(self, conn: sqlite3.Connection, use: _Use) -> Tx:
        return _SqliteTx(conn, use)

    def interrupt(self, conn: sqlite3.Connection) -> None:
        conn.interrupt()

    def close(self, conn: sqlite3.Connection) -> None:
        conn.close()


@final
class SqliteStore(PooledStore):
    """A journal store in one SQLite file: the embedded default, zero set-up.

    ``SqliteStore(path, *, connections=2, busy_timeout=10.0, synchronous="FULL", create=True)``.
    Nothing is opened until first use. ``create=False`` never creates the file: a connection to
    a path where there is no file (gone, a symlink to nowhere) fails with
    `sqlite3.OperationalError` instead of making a new empty database there. Every transaction
    starts with ``BEGIN IMMEDIATE`` (writers queue on SQLite's lock, waiting up to
    `busy_timeout` seconds), runs on a trio worker thread, and is interrupted with
    ``Connection.interrupt()`` when its call is cancelled. `synchronous` is the
    SQLite pragma: ``"FULL"`` (default) survives power loss, ``"NORMAL"`` only process crashes.
    ``transact(fn, read_only=True)`` runs a read transaction (``BEGIN DEFERRED``, writes refused):
    in WAL mode it neither waits for a writer nor delays one. While the current trio clock is a
    `trio.testing.MockClock`, transactions run on the trio thread (so that the clock's autojump
    never moves time while one is in flight; a test's hour-long timeouts then take milliseconds).
    Several processes may share the file. Use as ``async with SqliteStore(path) as store:`` or
    call `aclose()`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        connections: int = 2,
        busy_timeout: float = 10.0,
        synchronous: str = "FULL",
        create: bool = True,
    ) -> None:
        if sqlite3.sqlite_version_info < (3, 35, 0):  # pragma: no cover - depends on the build
            raise RuntimeError(f"SQLite >= 3.35 is needed (RETURNING); {sqlite3.sqlite_version}")
        if synchronous.upper() not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {_SYNCHRONOUS}, got {synchronous!r}")
        if not busy_timeout >= 0:
            raise ValueError(f"busy_timeout must be >= 0, got {busy_timeout!r}")
        if not isinstance(create, bool):
            raise TypeError(f"create must be a bool, got {create!r}")
        self.path = os.fspath(path)
        self.create = create
        self._pool = ConnectionPool(
            _SqliteDriver(self.path, busy_timeout, synchronous.upper(), create), connections
        )

    dialect = "sqlite"
