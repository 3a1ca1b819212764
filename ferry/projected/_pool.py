"""A tiny pool of blocking DB-API connections, driven from trio through worker threads.

Design
------
Each store (SQLite, PostgreSQL) is a `_Driver` (how to connect, begin, commit, roll back and
interrupt one connection) plus this pool. `transact(fn)` checks a connection out, runs
``fn(tx)`` inside one transaction on a worker thread, and checks the connection back in *from the
worker thread's completion*, never earlier: a connection is never handed to a second task while a
thread may still be using it.

Why not `trio.to_thread.run_sync(..., abandon_on_cancel=True, limiter=CapacityLimiter(1))`: when
it raises `Cancelled` we cannot tell whether the thread was started (cancelled while acquiring the
limiter) or abandoned mid-flight, so we could not know who checks the connection back in; and by
the time our `except Cancelled` runs, the thread may have finished and the connection may be
someone else's, so interrupting it could hit an innocent statement. Parking with
`wait_task_rescheduled(abort_fn)` and starting the thread with `start_thread_soon` removes both
races: `abort_fn` runs on the trio thread while the connection is certainly ours, and the single
completion callback (also on the trio thread, via `run_sync_soon`) checks it in. The connection
itself is the capacity limit of one: only its owner may start a thread on it.

Cancellation: `abort_fn` sets the use's `cancelled` flag (every later statement of `fn` raises
before it runs, and the commit is skipped) and interrupts the statement in progress
(``sqlite3.Connection.interrupt``, psycopg ``cancel_safe`` in a helper thread). The transaction
then rolls back on the worker thread, so a cancelled call leaves all of its transaction or none of
it (it may have committed if the cancel came during COMMIT: the outcome is unknown, never partial).
A PostgreSQL connection that saw a cancel request is closed rather than reused, because a late
cancel could hit the next user's statement.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

import outcome
import trio
import trio.testing

from ._types import Tx

T = TypeVar("T")
C = TypeVar("C")


class CancelledInThread(Exception):
    """Raised on the worker thread when a statement starts after its call was cancelled."""


class _Use:
    """One checkout of a connection. `cancelled` is read by the worker thread, written by trio."""

    __slots__ = ("abandoned", "cancelled")

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.abandoned = False  # trio thread only

    def check(self) -> None:
        if self.cancelled.is_set():
            raise CancelledInThread("the call that owns this transaction was cancelled")


class _Driver(Protocol[C]):
    dialect: str
    discard_after_cancel: bool

    #: May transactions run on the trio thread under a `trio.testing.MockClock`?
    inline_under_mock_clock: bool

    def connect(self) -> C: ...
    def begin(self, conn: C, read_only: bool) -> None: ...
    def commit(self, conn: C) -> None: ...
    def rollback(self, conn: C) -> None: ...
    def make_tx(self, conn: C, use: _Use) -> Tx: ...
    def interrupt(self, conn: C) -> None:
        """Called on the trio thread; must not block."""
        ...

    def close(self, conn: C) -> None: ...


class _Slot(Generic[C]):
    __slots__ = ("broken", "conn")

    def __init__(self) -> None:
        self.conn: C | None = None  # opened lazily, on a worker thread
        self.broken = False


class ConnectionPool(Generic[C]):
    """`size` connections, opened on first use, each used by one thread at a time."""

    def __init__(self, driver: _Driver[C], size: int) -> None:
        if size < 1:
            raise ValueError(f"connections must be >= 1, got {size!r}")
        self._driver = driver
        self._size = size
        self._free: list[_Slot[C]] = [_Slot() for _ in range(size)]
        self._available = trio.Semaphore(size, max_value=size)
        self._closed = False

    @trio.lowlevel.enable_ki_protection
    async def transact(self, fn: Callable[[Tx], T], *, read_only: bool = False) -> T:
        """Run ``fn(tx)`` in one transaction on a worker thread; commit if it returns.

        Always a checkpoint. Waits for a free connection. If `fn` raises, the transaction is
        rolled back and the exception propagates. If the call is cancelled, the transaction is
        interrupted and rolled back on its thread (unless it was already committing) and
        `trio.Cancelled` propagates at once; the connection comes back when the thread is done.
        Raises `trio.ClosedResourceError` after `aclose`. `read_only`: the driver's read
        transaction (no write lock; a write in it raises).

        Under a `trio.testing.MockClock`, a driver that allows it (`inline_under_mock_clock`)
        runs the transaction on the trio thread instead: waiting for a thread counts as blocked,
        and the clock's autojump would move time while a transaction is in flight
        (docs/adr/0066). Then the call is a checkpoint before the transaction and nothing after.

        KeyboardInterrupt-protected: a Ctrl-C never lands between taking a connection and parking
        (trio raises it at the park instead, whose abort_fn hands the connection back when the
        thread is done). Unprotected, it could leave the connection taken forever (`aclose`
        then waits for it: a hang) or leave the thread's completion rescheduling a task that
        never parked (an error inside trio itself, `trio.TrioInternalError`).
        """
        if self._closed:
            raise trio.ClosedResourceError("this store is closed")
        await self._available.acquire()
        slot = self._free.pop()
        use = _Use()
        if self._driver.inline_under_mock_clock and _mock_clock():
            try:
                return self._work(slot, use, fn, read_only)
            finally:
                self._checkin(slot, use)
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def back(result: outcome.Outcome[T]) -> None:  # trio thread
            self._checkin(slot, use)
            if not use.abandoned:
                trio.lowlevel.reschedule(task, result)

        def deliver(result: outcome.Outcome[T]) -> None:  # worker thread
            try:
                token.run_sync_soon(back, result)
            except trio.RunFinishedError:  # pragma: no cover - trio run already gone
                self._close_quietly(slot)

        def abort(_: Any) -> trio.lowlevel.Abort:  # trio thread, slot still ours
            use.abandoned = True
            use.cancelled.set()
            conn = slot.conn
            if conn is not None:
                self._driver.interrupt(conn)
            return trio.lowlevel.Abort.SUCCEEDED

        trio.lowlevel.start_thread_soon(partial(self._work, slot, use, fn, read_only), deliver)
        result: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return result

    def _work(
        self, slot: _Slot[C], use: _Use, fn: Callable[[Tx], T], read_only: bool
    ) -> T:  # worker thread (the trio thread under a mock clock)
        use.check()
        if slot.conn is None:
            slot.conn = self._driver.connect()
        conn = slot.conn
        tx = self._driver.make_tx(conn, use)
        try:
            self._driver.begin(conn, read_only)
            result = fn(tx)
            use.check()
            self._driver.commit(conn)
        except BaseException:
            try:
                self._driver.rollback(conn)
            except BaseException:
                slot.broken = True
            raise
        return result

    def _checkin(self, slot: _Slot[C], use: _Use) -> None:  # trio thread
        if slot.conn is not None and (
            slot.broken or self._closed or (use.abandoned and self._driver.discard_after_cancel)
        ):
            conn, slot.conn = slot.conn, None
            slot.broken = False
            trio.lowlevel.start_thread_soon(partial(self._driver.close, conn), lambda _: None)
        self._free.append(slot)
        self._available.release()

    def _close_quietly(self, slot: _Slot[C]) -> None:
        conn, slot.conn = slot.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # best effort at shutdown
                self._driver.close(conn)

    async def aclose(self) -> None:
        """Wait for every connection to come back, then close them all. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            for _ in range(self._size):
                await self._available.acquire()
            slots, self._free = self._free, []
            inline = self._driver.inline_under_mock_clock and _mock_clock()
            for slot in slots:
                if inline:
                    self._close_quietly(slot)
                else:
                    await trio.to_thread.run_sync(self._close_quietly, slot)


def _mock_clock() -> bool:
    """Is the current trio run's clock a `trio.testing.MockClock`?"""
    return isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)


class PooledStore:
    """What both stores share: transactions on a `ConnectionPool`, and closing it."""

    _pool: ConnectionPool[Any]

    async def transact(self, fn: Callable[[Tx], T], *, read_only: bool = False) -> T:
        """Run ``fn(tx)`` in one transaction on a worker thread (see `Store.transact`).

        `read_only=True`: a read transaction, which takes no write lock and so never waits for
        writers nor delays them (SQLite: ``BEGIN DEFERRED`` with ``PRAGMA query_only``;
        PostgreSQL: ``READ ONLY``); a statement that writes raises the driver's error."""
        return await self._pool.transact(fn, read_only=read_only)

    async def aclose(self) -> None:
        """Wait for in-flight transactions, close every connection. Idempotent."""
        await self._pool.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
