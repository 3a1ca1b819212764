"""Shared pieces of the store tests: store factories, a store wrapper that cancels at statement k,
and projections that fail on purpose."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from examples import ledger_domain as ledger
from ferry.projected import Record, Store, Tx

T = TypeVar("T")


class CountingTx:
    """Counts statements; at statement `at` it cancels `scope` and gives trio time to notice."""

    def __init__(self, tx: Tx, owner: CancellingStore, token: trio.lowlevel.TrioToken) -> None:
        self._tx = tx
        self._owner = owner
        self._token = token

    @property
    def dialect(self) -> str:
        return self._tx.dialect

    @property
    def connection(self) -> Any:
        return self._tx.connection

    def _tick(self) -> None:
        self._owner.count += 1
        if self._owner.count == self._owner.at and self._owner.scope is not None:
            self._token.run_sync_soon(self._owner.scope.cancel)
            time.sleep(0.03)  # let trio deliver the cancellation before the statement runs

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._tick()
        return self._tx.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._tick()
        self._tx.executemany(sql, rows)


class CancellingStore:
    """Wraps a store; cancels `scope` when the `at`-th statement (counted over all transactions
    since `arm`) is about to run."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.at = 0
        self.count = 0
        self.scope: trio.CancelScope | None = None

    def arm(self, at: int, scope: trio.CancelScope) -> None:
        self.at, self.count, self.scope = at, 0, scope

    @property
    def dialect(self) -> str:
        return self.inner.dialect

    async def transact(self, fn: Callable[[Tx], T]) -> T:
        token = trio.lowlevel.current_trio_token()
        return await self.inner.transact(lambda tx: fn(CountingTx(tx, self, token)))

    async def aclose(self) -> None:
        await self.inner.aclose()


class SwitchableProjection:
    """The ledger projection, which can be told to raise, or to fail some rows."""

    def __init__(self) -> None:
        self.broken: BaseException | None = None
        self.bad_amounts: set[int] = set()
        self.calls = 0
        self.seen: list[tuple[str, int]] = []

    def __call__(
        self, view: Tx, key: str, records: Sequence[Record]
    ) -> list[BaseException | None] | None:
        self.calls += 1
        if self.broken is not None:
            raise self.broken
        ledger.project(view, key, records)
        self.seen.extend((key, r.seq) for r in records)
        if not self.bad_amounts:
            return None
        return [
            ValueError(f"cannot project {r.id}")
            if r.kind == "input" and r.content["amount"] in self.bad_amounts
            else None
            for r in records
        ]
