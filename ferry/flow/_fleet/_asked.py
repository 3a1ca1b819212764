"""A fleet engine's ear for the requests of clients (`flow.connect`, docs/adr/0125): LISTEN on
the store's channel of requests (`_inbox.ASKED_SQL`) from a thread, as `_listener` does for
settled flows."""

from __future__ import annotations

import logging
import os
import selectors
import threading
from collections.abc import Callable
from typing import Any

import trio

from .._store import _inbox

_log = logging.getLogger("ferry.flow")


class Listen:
    """The PostgreSQL listen thread: LISTEN on the store's channel of requests
    (`_inbox.ASKED_SQL`) on one connection of its own, and a wake-up of the engine's task per
    notification (and once per reconnection, since what came in between was not heard)."""

    def __init__(self, dsn: str, owner: str, tell: Callable[[], bool]) -> None:
        self._dsn = dsn
        self._owner = owner
        self._tell = tell
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(
            target=self._run, name=f"ferry.flow request listener of {owner!r}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        from ferry.projected._postgres import connect

        pause = 0.05
        while not self._stop.is_set():
            try:
                conn = connect(
                    self._dsn,
                    autocommit=True,
                    connect_timeout=10,
                    application_name="ferry.flow request listener",
                )
            except Exception as exc:
                _log.warning(
                    "flow engine %r could not listen for clients' requests: %r",
                    self._owner,
                    exc,
                    extra={"owner": self._owner},
                )
                if self._stop.wait(pause):
                    return
                pause = min(2.0, pause * 2)
                continue
            pause = 0.05
            try:
                from psycopg import sql

                row = conn.execute(f"SELECT {_inbox.ASKED_SQL}").fetchone()
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(row[0])))
                if not self._tell():  # what came before the LISTEN
                    return
                with selectors.DefaultSelector() as selector:
                    selector.register(conn.fileno(), selectors.EVENT_READ)
                    selector.register(self._wake_r, selectors.EVENT_READ)
                    while not self._stop.is_set():
                        if any(True for _ in conn.notifies(timeout=0)) and not self._tell():
                            return
                        selector.select()
            except Exception as exc:
                _log.warning(
                    "flow engine %r: the connection listening for requests failed: %r",
                    self._owner,
                    exc,
                    extra={"owner": self._owner},
                )
            finally:
                try:
                    conn.close()
                except Exception as exc:
                    _log.debug("closing the request listener's connection: %r", exc)


class Heard:
    """A client's ear on PostgreSQL: one connection of its own (autocommit) LISTENing on the
    store's channel given as an SQL expression (`_inbox.ANSWERED_SQL`: requests answered;
    `_notify.CHANNEL_SQL`: flows settled), read on the trio loop (``wait_readable`` on its
    socket: no timer, no thread but the connect's)."""

    def __init__(self, dsn: str, channel_sql: str | tuple[str, ...]) -> None:
        self._dsn = dsn
        # one channel, or several (a client's readers of events and streams hear two)
        self._channels = (channel_sql,) if isinstance(channel_sql, str) else channel_sql
        self._conn: Any = None

    async def open(self) -> None:
        self._conn = await trio.to_thread.run_sync(self._connect)

    def _connect(self) -> Any:
        from psycopg import sql

        from ferry.projected._postgres import connect

        conn = connect(
            self._dsn,
            autocommit=True,
            connect_timeout=10,
            application_name="ferry.flow client",
        )
        try:
            for channel_sql in self._channels:
                (channel,) = conn.execute(f"SELECT {channel_sql}").fetchone()
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            conn.close()
            raise
        return conn

    async def next(self) -> None:
        """Until a notification arrives (those that came already count)."""
        conn = self._conn
        assert conn is not None
        while True:
            if any(True for _ in conn.notifies(timeout=0)):
                return
            await trio.lowlevel.wait_readable(conn.fileno())

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            trio.lowlevel.notify_closing(conn.fileno())
        except Exception as exc:  # a connection closed already has no descriptor
            _log.debug("closing a client's listening connection: %r", exc)
        try:
            conn.close()
        except Exception as exc:
            _log.debug("closing a client's listening connection: %r", exc)
