"""A fleet engine's ear for settled flows: LISTEN on the store's channel, from a thread.

`Listener` owns one psycopg connection of its own (autocommit, outside the store's pool, like
the lease thread's, `_heartbeat`) and one plain thread. The thread connects, LISTENs on the
store's channel (`_notify.CHANNEL_SQL`) and then sleeps in a selector on two things: the
connection's socket and a wake-up pipe of its own. When the socket has data it takes what
arrived (``conn.notifies(timeout=0)``), parses the payloads (`_notify.parse`) and hands the
flows to the trio thread (`on_flows`, through ``TrioToken.run_sync_soon``, the only way in).
No timer runs: an idle listener costs nothing but the connection.

When the connection fails (the server restarted, the backend was terminated, the network went),
the thread logs a WARNING, tells the trio side (``on_state(False)``: waits then read the store
on their own, as they would without notifications) and connects again: at once, then, while
connecting fails, after a pause (50 ms, doubling up to 2 s), with a WARNING per failed attempt.
Every time it is listening again it says so
(``on_state(True)``): what was announced in between is lost, and the waits catch up with one
read. A connection that dies without a word (no reset ever arrives: a NAT that forgot it) is
noticed by the kernel's keepalive probes (`ferry.projected._postgres.connect`), within about a
minute; meanwhile the waits' fallback read, once per lease, bounds what it costs.

`stop` writes to the wake-up pipe and joins the thread: it returns at once, or after the
connect in progress gives up (at most its timeout). Nothing of it outlives `stop`.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
from collections.abc import Callable
from typing import Any

import trio

from .._runtime import _retry
from .._store import _notify

_log = logging.getLogger("ferry.flow")

APPLICATION_NAME = "ferry.flow wait listener"  # in pg_stat_activity


class Listener:
    """Listens on the store's notification channel from a thread until `stop`.

    `on_flows(pairs)` gets the ``(flow_id, revision)`` pairs of each notification (None: read
    every flow you wait for) on `channels` (the settled flows' by default; the readers of
    events and streams listen on the signals' channel too, `_notify.SIGNALS_CHANNEL_SQL`);
    `on_state(listening)` is told each time the listening starts or stops. Both are called
    on the trio thread of the run that called `start`, in order.
    `connects` counts the connections made (the first and every reconnection).
    """

    def __init__(
        self,
        dsn: str,
        *,
        on_flows: Callable[[list[tuple[str, int]] | None], None],
        on_state: Callable[[bool], None],
        connect_timeout: float,
        owner: str,
        channels: tuple[str, ...] = (_notify.CHANNEL_SQL,),
    ) -> None:
        self._dsn = dsn
        self._channels = channels  # SQL expressions of the channels listened on
        self._on_flows = on_flows
        self._on_state = on_state
        self._connect_timeout = connect_timeout
        self._owner = owner
        self._stop = threading.Event()
        self._wake_r = self._wake_w = -1  # the wake-up pipe, made by `start`
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.connects = 0

    def start(self) -> None:
        """Start the thread (trio thread; not a checkpoint)."""
        self._token = trio.lowlevel.current_trio_token()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(
            target=self._run, name=f"ferry.flow wait listener of {self._owner!r}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread and wait for it (shielded); its connection is closed by then.
        Idempotent. A checkpoint."""
        if not self._stop.is_set():
            self._stop.set()
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")
        thread = self._thread
        with trio.CancelScope(shield=True):
            if thread is not None:
                await trio.to_thread.run_sync(thread.join)
            else:
                await trio.lowlevel.checkpoint()
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    # --------------------------------------------------------------------- the thread

    def _tell(self, fn: Callable[..., None], *args: Any) -> bool:
        """Call `fn(*args)` on the trio thread; False once the run is gone."""
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            return False
        return True

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    conn = self._connect()
                except Exception as exc:
                    failures += 1
                    pause = _retry.STORE.delay(failures)  # the engine's store calls' delays
                    _log.warning(
                        "flow engine %r: could not listen for settled flows: %r; waits on flows"
                        " of other engines read the store meanwhile; retry %d in %.2f s",
                        self._owner,
                        exc,
                        failures,
                        pause,
                        extra={"owner": self._owner, "retry": failures, "delay": pause},
                    )
                    if self._stop.wait(pause):
                        return
                    continue
                failures = 0
                try:
                    if not self._tell(self._on_state, True):
                        return
                    self._receive(conn)
                except Exception as exc:
                    _log.warning(
                        "flow engine %r: the connection listening for settled flows failed: %r;"
                        " waits on flows of other engines read the store until it is back",
                        self._owner,
                        exc,
                        extra={"owner": self._owner},
                    )
                    if not self._tell(self._on_state, False):
                        return
                finally:
                    _close(conn, self._owner)
        except BaseException:  # a bug: waits read the store on their own from now on
            _log.exception("flow engine %r: its wait listener stopped", self._owner)
            self._tell(self._on_state, False)
            raise

    def _connect(self) -> Any:
        from psycopg import sql

        from ferry.projected._postgres import connect

        conn = connect(
            self._dsn,
            autocommit=True,
            connect_timeout=max(1, round(self._connect_timeout)),
            application_name=APPLICATION_NAME,
        )
        try:
            for channel_sql in self._channels:
                row = conn.execute(f"SELECT {channel_sql}")
                (channel,) = row.fetchone() or ("",)
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            _close(conn, self._owner)
            raise
        self.connects += 1
        return conn

    def _receive(self, conn: Any) -> None:
        """Hand on what arrives on `conn` until `stop` (returns) or the connection fails
        (raises)."""
        with selectors.DefaultSelector() as selector:
            selector.register(conn.fileno(), selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                # First what psycopg may hold already (it keeps what arrives with a statement's
                # answer, as with the LISTEN's), then what the socket has.
                for note in conn.notifies(timeout=0):
                    if not self._tell(self._on_flows, _notify.parse(note.payload)):
                        return
                selector.select()
                if self._stop.is_set():
                    return


def _close(conn: Any, owner: str) -> None:
    try:
        conn.close()
    except Exception as exc:  # closing a dead connection: nothing left to release
        _log.debug("flow engine %r: closing the wait listener's connection: %r", owner, exc)
