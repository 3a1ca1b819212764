"""A fleet engine's lease renewal on a thread of its own (docs/adr/0072).

Why a thread: the lease must not depend on the trio loop. A step whose synchronous code holds
the loop for a few seconds (a slow library call, a long computation) stops every task of the
run, the engine's renewals with them; with a lease shorter than that, another engine takes the
flows over and runs their steps again while the first one's steps are still going. A plain
thread keeps running while the loop is held (Python switches threads every few milliseconds even
under CPU-bound code), so it renews on time.

`Keeper` owns one connection of its own, in autocommit (not one of the store's pool, which may
all be busy with batches or dead after a network fault) and, every third of the lease, extends
the incarnation's lease (`_store.renew_lease`). It renews only a lease that still runs: past the
margin the renewal is the engine's own, through the store, with the re-read of the flows it runs
(ADR 0047); that is also what a process frozen as a whole (SIGSTOP) sees when it thaws, since
the thread froze with it. A lease row gone missing (lost by the database, or pruned) is the
engine's own renewal's too: the thread's is refused and it waits, and the engine writes the row
again (docs/adr/0107); only a row of another incarnation makes the thread give up
(`superseded`). A renewal that fails is tried again at once on a fresh connection, then after
short pauses, until the margin; each failure is a WARNING. `held_until` is read by the engine on
the trio thread (`Lease.lapsing`), and `Trust`, a trio instrument, moves the deadlines of the
steps the engine runs with it before trio fires any expired deadline: a loop that was held past
the lease wakes up with its steps cancelled, not resumed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import trio

from ferry.projected import PostgresStore, Store

from . import _store

T = TypeVar("T")

_log = logging.getLogger("ferry.flow")
_FIRST_PAUSE = 0.05  # seconds, after the retry at once on a fresh connection; doubles


class _ConnTx:
    """A `ferry.projected.Tx` on one psycopg connection, for `_store`'s functions."""

    dialect = "postgres"

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    @property
    def connection(self) -> Any:
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = self._conn.execute(sql.replace("%", "%%").replace("?", "%s"), params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        for row in rows:
            self.execute(sql, row)


class Keeper:
    """Renews one engine incarnation's lease from a thread, on a connection of its own.

    `held_until` is how long the lease is known to run, on `clock` (the engine's view of its
    lease: trio's clock, read from this thread, docs/adr/0110): raised by the thread's renewals
    (the time a renewal began plus the lease: the database granted no less) and by the engine's
    own (`extend`). `superseded` is set once another
    incarnation holds the name. `renewals` and `failures` count the thread's work.
    """

    def __init__(
        self,
        dsn: str,
        *,
        owner: str,
        incarnation: str,
        lease: float,
        margin: float,
        held_until: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dsn = dsn
        self._owner = owner
        self._incarnation = incarnation
        self._lease = lease
        self._margin = margin
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conn: Any = None
        self._thread: threading.Thread | None = None
        self.held_until = held_until
        self.superseded = False
        self.renewals = 0
        self.failures = 0
        # The first failed renewal since the last one that went through (monotonic seconds),
        # and how many failed since: the INFO line that says the store is back names both.
        self._failing_since: float | None = None
        self._failed_since = 0

    def extend(self, until: float) -> None:
        """The lease runs at least until `until` (a renewal that went through: the thread's,
        or the engine's own). Any thread. After failed renewals, logs once that it is back."""
        with self._lock:
            if until > self.held_until:
                self.held_until = until
            since, failed = self._failing_since, self._failed_since
            self._failing_since, self._failed_since = None, 0
        if since is not None:
            took = time.monotonic() - since
            _log.info(
                "flow engine %r renewed its lease again, %.1f s after its first failed renewal"
                " (%d failed tries by its lease thread): its store is reachable again",
                self._owner,
                took,
                failed,
                extra={"owner": self._owner, "outage": took, "failed": failed},
            )

    def _failed(self) -> None:
        with self._lock:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            self._failed_since += 1

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"ferry.flow lease of {self._owner!r}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread and close its connection; waits for it (a statement in flight ends
        within its statement timeout, a quarter of the lease). A checkpoint; not cancellable."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join)

    # --------------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._lease / 3):
                self._renew()
        except BaseException:  # a bug: the lease lapses, the engine lets its flows go
            _log.exception("flow engine %r: its lease thread stopped", self._owner)
            raise
        finally:
            self._close()

    def _renew(self) -> None:
        """One renewal, retried (at once on a fresh connection, then after short pauses) while
        the lease still runs by more than the margin."""
        pause = _FIRST_PAUSE
        tries = 0
        while not self._stop.is_set():
            if self._clock() >= self.held_until - self._margin:
                return  # lapsing: the engine renews itself, re-reading its flows
            until = self._clock() + self._lease
            try:
                renewed = self._transact(
                    partial(
                        _store.renew_lease,
                        owner=self._owner,
                        incarnation=self._incarnation,
                        lease=self._lease,
                        margin=self._margin,
                    )
                )
            except _store.Superseded:
                self.superseded = True
                _log.warning(
                    "flow engine %r: another engine opened under the same owner name after this"
                    " one's lease lapsed; this one runs no flow any more",
                    self._owner,
                    extra={"owner": self._owner},
                )
                return
            except Exception as exc:
                self._close()
                self.failures += 1
                self._failed()
                tries += 1
                delay = 0.0 if tries == 1 else pause
                _log.warning(
                    "flow engine %r: renewing its lease failed: %r; retry %d in %.2f s%s",
                    self._owner,
                    exc,
                    tries,
                    delay,
                    " on a fresh connection" if tries == 1 else "",
                    extra={"owner": self._owner, "retry": tries, "delay": delay},
                )
                if tries > 1:
                    pause = min(pause * 2, self._lease / 10)
                    self._stop.wait(delay)
                continue
            if renewed is not None:
                self.extend(until)
                self.renewals += 1
            return

    def _transact(self, fn: Callable[[_ConnTx], T]) -> T:
        if self._conn is None:
            from ferry.projected._postgres import connect

            guard = max(1, int(self._lease * 250))  # ms: a quarter of the lease
            # Autocommit: each statement commits on its own, so a process frozen between two
            # statements holds no lock on its lease row (a takeover of its flows locks that
            # row, ADR 0048, and would wait for as long as the process sleeps).
            # A renewal sent into a connection that died without a word gives up after a
            # lease, not after the system's default (minutes), so that reconnecting can begin.
            conn = connect(
                self._dsn,
                autocommit=True,
                connect_timeout=max(2, round(self._lease / 4)),
                tcp_user_timeout=max(1000, round(self._lease * 1000)),
            )
            conn.execute(f"SET statement_timeout = {guard}")
            self._conn = conn
        return fn(_ConnTx(self._conn))

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # closing a dead connection: nothing left to release
                _log.debug("flow engine %r: closing the lease connection: %r", self._owner, exc)


def keeper_for(store: Store) -> str | None:
    """The DSN a `Keeper` connects with, for a store that can have one (PostgreSQL); None for
    the others (one SQLite file has one engine and no lease to keep)."""
    return store.dsn if isinstance(store, PostgresStore) else None


class Trust(trio.abc.Instrument):
    """A trio instrument: before trio fires expired deadlines (``after_io_wait``), let the
    engine move its steps' deadlines to what its lease now allows (`on_wake`). Cheap: one call
    of a method that compares two floats, once per turn of the scheduler."""

    def __init__(self, on_wake: Callable[[], None]) -> None:
        self._on_wake = on_wake

    def after_io_wait(self, timeout: float) -> None:
        self._on_wake()
