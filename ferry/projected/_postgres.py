"""The PostgreSQL store: psycopg 3's blocking API on trio worker threads, a small own pool.

psycopg's async API needs asyncio, so each connection is driven from a worker thread like the
SQLite store. Statements are written with ``?`` placeholders (shared with SQLite) and rewritten to
psycopg's ``%s`` once per statement text. A call cancelled mid-statement sends a cancel request
(``cancel_safe``, on a helper thread so the trio thread never blocks) and the connection is closed
afterwards instead of reused: a cancel request that arrives late could otherwise hit the next
user's statement.

Every connection the package opens to PostgreSQL (the store's, and a flow engine's lease and
listener connections) goes through `connect`, which asks the kernel to watch it (`KEEPALIVE`): a
peer that vanished without a word (a NAT or a firewall that forgot the connection, a host that
lost power) is noticed within about a minute instead of the system's default of hours, and the
caller's usual retry takes over.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, Final, TypeVar, final

import trio

from .._text import masked
from ._pool import ConnectionPool, PooledStore, _Use
from ._types import Tx

T = TypeVar("T")


#: libpq options every connection gets unless its DSN sets them (docs/adr/0106): a TCP keepalive
#: probe after 30 s of silence, every 10 s, 3 unanswered ones and the connection is dead (about
#: 60 s); data sent and not acknowledged for 60 s kills it too (``tcp_user_timeout``, in ms; a
#: statement that merely runs long is acknowledged, and is not affected). Over a Unix socket the
#: kernel ignores them.
KEEPALIVE: Final[dict[str, int]] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}


def connect(dsn: str, **options: Any) -> Any:
    """``psycopg.connect(dsn, **options)``, with `KEEPALIVE` for each option neither the DSN nor
    `options` sets. The one way this package connects to PostgreSQL."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    given = conninfo_to_dict(dsn)
    defaults: dict[str, Any] = {
        k: v for k, v in KEEPALIVE.items() if k not in given and k not in options
    }
    return psycopg.connect(dsn, **defaults, **options)


def check_dsn(dsn: object) -> None:
    """Raise, in the user's words, if psycopg is missing or cannot read `dsn` (a connection
    string ``host=... dbname=...`` or a URI ``postgresql://user@host/db``)."""
    if not isinstance(dsn, str):
        raise TypeError(f"PostgresStore takes a DSN str, got {type(dsn).__name__}")
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        raise ImportError(
            "PostgresStore needs psycopg 3: pip install 'stm-ferry[postgres]'"
        ) from None
    try:
        conninfo_to_dict(dsn)
    except Exception as exc:
        reason = masked(" ".join(str(exc).split()))
        raise ValueError(
            f"PostgresStore got a DSN psycopg cannot read ({reason}); give"
            " 'host=db.example port=5432 dbname=orders user=ops' or"
            " 'postgresql://ops@db.example:5432/orders'"
        ) from None


@functools.lru_cache(maxsize=512)
def _to_pyformat(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


class _PgTx:
    __slots__ = ("_conn", "_use")
    dialect = "postgres"

    def __init__(self, conn: Any, use: _Use) -> None:
        self._conn = conn
        self._use = use

    @property
    def connection(self) -> Any:
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._use.check()
        cur = self._conn.execute(_to_pyformat(sql), params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._use.check()
        with self._conn.cursor() as cur:
            cur.executemany(_to_pyformat(sql), rows)


class _PgDriver:
    dialect = "postgres"
    discard_after_cancel = True
    inline_under_mock_clock = False  # a network round trip may hang: never on the trio thread

    def __init__(self, dsn: str, connect_timeout: float) -> None:
        self._dsn = dsn
        self._connect_timeout = connect_timeout

    def connect(self) -> Any:
        return connect(
            self._dsn, autocommit=False, connect_timeout=max(1, round(self._connect_timeout))
        )

    def begin(self, conn: Any, read_only: bool) -> None:
        # psycopg opens a transaction with the first statement
        if read_only:
            conn.execute("SET TRANSACTION READ ONLY")

    def commit(self, conn: Any) -> None:
        conn.commit()

    def rollback(self, conn: Any) -> None:
        conn.rollback()

    def make_tx(self, conn: Any, use: _Use) -> Tx:
        return _PgTx(conn, use)

    def interrupt(self, conn: Any) -> None:
        def cancel() -> None:
            with contextlib.suppress(Exception):  # the connection is discarded anyway
                conn.cancel_safe(timeout=5.0)

        trio.lowlevel.start_thread_soon(cancel, lambda _: None)

    def close(self, conn: Any) -> None:
        conn.close()


@final
class PostgresStore(PooledStore):
    """A journal store in PostgreSQL, for a fleet of processes sharing one database.

    ``PostgresStore(dsn, *, connections=4, connect_timeout=10.0)``: at most `connections`
    connections, opened on first use, each driven by one trio worker thread at a time. Needs
    ``psycopg`` 3 (the ``postgres`` extra). Transactions run at READ COMMITTED; the journal logic
    takes the key's row lock first, so that is enough. Use as ``async with PostgresStore(dsn) as
    store:`` or call `aclose()`.
    """

    def __init__(self, dsn: str, *, connections: int = 4, connect_timeout: float = 10.0) -> None:
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0, got {connect_timeout!r}")
        check_dsn(dsn)
        self.dsn = dsn
        self._pool = ConnectionPool(_PgDriver(dsn, connect_timeout), connections)

    dialect = "postgres"
