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

The thread renews only while the trio loop is alive (docs/adr/0112): every tenth of the lease it
asks the loop to note the time (`TrioToken.run_sync_soon`, which wakes the loop whatever its
clock, a `MockClock` too), and it renews only if the loop did so within the last lease
(`_LOOP_BOUND`). A loop blocked for less than the lease (a slow library call) keeps its flows;
one blocked for longer (a `time.sleep(30)` in a step, a write to a pipe nobody reads) loses its
lease within about two leases, and another engine takes its flows over; when it thaws it runs
none of them (the lapse rule above, docs/adr/0073). The thread says so once per freeze (a
WARNING, at most one a minute), and again (INFO) when the loop runs again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import trio

from ferry.projected import PostgresStore, Store

from .._store import _store

T = TypeVar("T")

_log = logging.getLogger("ferry.flow")
_FIRST_PAUSE = 0.05  # seconds, after the retry at once on a fresh connection; doubles
# The loop counts as alive while it noted the time within this much of the lease: a block
# shorter than the lease never costs the lease (the last renewal the thread makes comes more
# than 0.57 of a lease into the block, a tick included, so the engine trusts its lease until
# 1.47 leases in, its margin included); a longer one lapses at most two leases after it began
# (docs/adr/0112).
_LOOP_BOUND = 1.0
_TICK = 0.1  # of the lease: how often the thread asks the loop to note the time
_WARN_EVERY = 60.0  # seconds: at most one WARNING about a frozen loop this often


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
        # The loop's last answer to the thread's tick (monotonic seconds; a float written by the
        # trio thread, read by this one), the trio run to ask, and the current freeze: since
        # when the thread has not renewed for it (monotonic), whether that was logged, and when
        # the last WARNING about one was (with the freezes left unlogged since).
        self._alive_at = time.monotonic()
        self._token: trio.lowlevel.TrioToken | None = None
        self._asked = False  # a tick is on its way to the loop, not answered yet
        self.frozen = 0  # renewals not made: the loop was silent for longer than the lease
        self._frozen_since: float | None = None
        self._frozen_logged = False
        self._warned_at = -math.inf
        self._unlogged = 0

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
        """Start the thread; called on the trio thread, whose loop it then watches."""
        self._token = trio.lowlevel.current_trio_token()
        self._alive_at = time.monotonic()
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
        every, tick = self._lease / 3, self._lease * _TICK
        try:
            self._tick()
            due = time.monotonic() + every
            while not self._stop.wait(max(0.0, min(tick, due - time.monotonic()))):
                if time.monotonic() >= due:
                    self._renew()
                    due = time.monotonic() + every
                self._tick()
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
            if self._loop_frozen():
                return  # the trio loop is blocked: its flows are to be taken over
            self._tick()  # (retries may take a while: the loop goes on being asked)
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

    # --------------------------------------------------------------- is the loop alive?

    def _tick(self) -> None:
        """Ask the trio loop to note the time at its next turn (from the thread; through the
        loop's wake-up socket, so whatever its clock). A run that ended is not asked."""
        token = self._token
        if token is None or self._asked:
            return  # (asked already: a blocked loop does not pile up one call per tick)
        self._asked = True
        try:
            token.run_sync_soon(self._noted)
        except trio.RunFinishedError:
            self._token = None

    def _noted(self) -> None:
        """On the trio thread, at a turn of its loop: it runs."""
        self._alive_at = time.monotonic()
        self._asked = False

    def _loop_frozen(self) -> bool:
        """Has the trio loop not answered for longer than the lease (`_LOOP_BOUND`)? Then the
        thread does not renew: a WARNING once per freeze (at most one every `_WARN_EVERY`
        seconds, counting those left unsaid); an INFO when the loop answers again after one
        that was logged."""
        now = time.monotonic()
        silent = now - self._alive_at
        if silent <= self._lease * _LOOP_BOUND:
            since, self._frozen_since = self._frozen_since, None
            if since is not None and self._frozen_logged:
                _log.info(
                    "flow engine %r: its trio loop runs again after about %.1f s blocked;"
                    " its lease thread renews again",
                    self._owner,
                    now - since + self._lease * _LOOP_BOUND,
                    extra={"owner": self._owner},
                )
            return False
        self.frozen += 1
        if self._frozen_since is None:
            self._frozen_since = now
            self._frozen_logged = now - self._warned_at >= _WARN_EVERY
            if not self._frozen_logged:
                self._unlogged += 1
                return True
            unlogged, self._unlogged, self._warned_at = self._unlogged, 0, now
            _log.warning(
                "flow engine %r: its trio loop has not run for %.1f s (longer than its lease"
                " of %g s: a step's synchronous code, or a write to a full pipe, blocks it), so"
                " its lease thread stops renewing: its flows lapse and another engine takes"
                " them over; when the loop runs again, it runs none of them%s",
                self._owner,
                silent,
                self._lease,
                f" ({unlogged} earlier freeze(s) not logged)" if unlogged else "",
                extra={"owner": self._owner, "blocked": silent, "unlogged": unlogged},
            )
        return True

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
