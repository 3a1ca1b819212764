"""Shared pieces of the flow tests.

The engine tests open engines the way users do, ``flow.open_engine(path)`` under
`MockClock(autojump_threshold=0)`: while the clock is a mock clock the public `SqliteStore` runs
its transactions on the trio thread, so time moves only when every task waits for time
(docs/adr/0066). What a path cannot give a test -- a store outage on demand, a slow store, two
fleet engines on one SQLite file -- comes from `PlantedStore`, a thin wrapper around a public
`SqliteStore` of the same file (so it takes no engine lock: it is not an `SqliteStore`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from ferry.projected import SqliteStore, Tx

T = TypeVar("T")


class _InlineTx:
    """A `Tx` over a plain `sqlite3` connection (to fill or read a file outside any store)."""

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


def planted_busy(text: str) -> sqlite3.OperationalError:
    """A planted "the store is unavailable now": SQLite's SQLITE_BUSY, which the engine retries
    (any other error ends the engine's block, docs/adr/0061)."""
    busy = sqlite3.OperationalError(text)
    busy.sqlite_errorcode = 5  # SQLITE_BUSY
    return busy


class PlantedStore:
    """A public `SqliteStore` of `path` with trouble a test plants in it.

    `fail_next` makes the next `n` transactions raise SQLite's busy error before they run (a
    database that is briefly unavailable: `planted_busy`); with `fail_kind` set, only those of
    that kind (`kind`: ``"write_batch"``, ...), so that an engine's background transactions (its
    retention round, say) cannot take a failure planted for one write. While `gate` is an unset
    `trio.Event`, transactions wait for it (a slow database). `transactions` counts committed
    transactions. Not an `SqliteStore`, so an engine on it takes no engine lock: two fleet
    engines may share a file.
    """

    dialect = "sqlite"

    def __init__(self, path: str) -> None:
        self.path = path
        self._store = SqliteStore(path, connections=1, synchronous="OFF")
        self.fail_next = 0
        self.fail_kind: str | None = None
        self.gate: trio.Event | None = None
        self.transactions = 0

    async def transact(self, fn: Callable[[Tx], T]) -> T:
        await trio.lowlevel.checkpoint()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next and self.fail_kind in (None, kind(fn)):
            self.fail_next -= 1
            raise planted_busy("database is unavailable (planted by the test)")
        result = await self._store.transact(fn)
        self.transactions += 1
        return result

    async def aclose(self) -> None:
        await self._store.aclose()


#: The name the tests of other branches knew it by.
InlineSqliteStore = PlantedStore


def kind(fn: Callable[..., Any]) -> str:
    """The name of the store function a transaction runs (``write_batch``, ``renew``, ...; an
    engine's lease transaction on the lease clock, ``renew_on_clock``, is a ``renew``)."""
    return getattr(getattr(fn, "func", fn), "__name__", repr(fn)).removesuffix("_on_clock")


class _Waiting:
    __slots__ = ("answer", "fail", "fn", "go")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.go = trio.Event()
        self.fail = False
        self.answer: trio.Event | None = None


class ValveStore(PlantedStore):
    """A `PlantedStore` whose transactions a test lets through one at a time.

    A transaction of a *held* kind (the name of the store function it runs, `kind`; ``"*"``
    holds every kind) waits before it runs until the test lets it through (`let_through`),
    as the database calls of a process that stalls or freezes would; the wait is cancellable,
    and a transaction cancelled while it waits never ran. A transaction let through with
    ``answer=False`` commits at once but its answer waits until `answer` (a reply that comes
    back late: what it read or wrote may be stale by then). `hold_after(trigger, *kinds)` holds
    `kinds` from the moment a transaction of kind `trigger` has committed (between two
    transactions of one task, where a test cannot step in). Deterministic under
    `MockClock(autojump_threshold=0)`: what waits here is blocked, and goes on only when the test
    says so.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.held: set[str] = set()
        self._after: dict[str, set[str]] = {}
        self._waiting: list[_Waiting] = []
        self._unanswered: list[_Waiting] = []

    def hold_after(self, trigger: str, *kinds: str) -> None:
        self._after[trigger] = set(kinds)

    def waiting(self, name: str) -> list[Callable[..., Any]]:
        """The waiting transactions of kind `name`, oldest first."""
        return [w.fn for w in self._waiting if kind(w.fn) == name]

    def let_through(
        self,
        name: str,
        where: Callable[[Callable[..., Any]], bool] = lambda fn: True,
        *,
        fail: bool = False,
        answer: bool = True,
    ) -> None:
        """The oldest waiting transaction of kind `name` (for which `where` holds) goes on; with
        `fail`, it raises instead, as a transaction the database failed would (nothing of it
        was written); without `answer`, it commits but its caller waits for `answer`. Raises
        `LookupError` if none waits."""
        for w in self._waiting:
            if kind(w.fn) == name and where(w.fn):
                self._waiting.remove(w)
                w.fail = fail
                if not answer:
                    w.answer = trio.Event()
                    self._unanswered.append(w)
                w.go.set()
                return
        raise LookupError(f"no {name} transaction waits")

    def answer(self, name: str) -> None:
        """The oldest committed transaction of kind `name` whose answer waits gets it."""
        for w in self._unanswered:
            if kind(w.fn) == name:
                self._unanswered.remove(w)
                assert w.answer is not None
                w.answer.set()
                return
        raise LookupError(f"no {name} answer waits")

    def open(self) -> None:
        """Hold nothing any more, and let every waiting transaction through."""
        self.held.clear()
        self._after.clear()
        for w in self._waiting:
            w.go.set()
        self._waiting.clear()
        for w in self._unanswered:
            assert w.answer is not None
            w.answer.set()
        self._unanswered.clear()

    async def transact(self, fn: Callable[[Tx], T]) -> T:
        name = kind(fn)
        if name in self.held or "*" in self.held:
            w = _Waiting(fn)
            self._waiting.append(w)
            try:
                await w.go.wait()
            finally:
                if w in self._waiting:
                    self._waiting.remove(w)
            if w.fail:
                raise planted_busy(f"{name} failed (planted by the test)")
            result = await super().transact(fn)
            if w.answer is not None:
                await w.answer.wait()
        else:
            result = await super().transact(fn)
        self.held |= self._after.pop(name, set())
        return result
