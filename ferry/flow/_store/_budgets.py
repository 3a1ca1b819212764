"""A plan's budget row (``flow_budgets``, `_admission`'s table) as a record, its lock and its
write, and `Budgets`: one transaction's rows, each locked and read once and written once
(docs/adr/0182).

The lock is ``FOR UPDATE`` on PostgreSQL (empty on SQLite, where the one writer holds the
file), taken in ADR 0141's order: after the flow rows the caller wrote, before any key row.
Everything here is synchronous, inside one store transaction.
"""

from __future__ import annotations

from typing import Final, final

import attrs

from ferry.projected import Tx

from . import _dialect

BUDGETS: Final = "flow_budgets"


@attrs.frozen
class Budget:
    """A budget row's counters (`_admission` says what each counts)."""

    active: int
    seq: int
    turn: int
    in_window: int


@final
class Budgets:
    """One transaction's budget rows: each locked and read once (at its first use, in the lock
    order of `lock`), changed in memory by every call given it, written once by `write`
    (`_queue.settle`: a batch's calls for one plan cost one lock and one write, not one of
    each per call; docs/adr/0182)."""

    __slots__ = ("_now", "_read")

    def __init__(self) -> None:
        self._read: dict[str, Budget] = {}
        self._now: dict[str, Budget] = {}

    def get(self, tx: Tx, d: _dialect.Dialect, plan: str) -> Budget:
        b = self._now.get(plan)
        if b is None:
            b = self._read[plan] = self._now[plan] = lock(tx, d, plan)
        return b

    def put(self, plan: str, b: Budget) -> None:
        self._now[plan] = b

    def write(self, tx: Tx) -> None:
        """Write each budget row that changed since it was read (or last written)."""
        for plan, b in self._now.items():
            if b != self._read[plan]:
                write_one(tx, plan, b)
                self._read[plan] = b


def get(tx: Tx, d: _dialect.Dialect, plan: str, budgets: Budgets | None) -> Budget:
    return lock(tx, d, plan) if budgets is None else budgets.get(tx, d, plan)


def put(tx: Tx, plan: str, before: Budget, b: Budget, budgets: Budgets | None) -> None:
    if budgets is not None:
        budgets.put(plan, b)
    elif b != before:
        write_one(tx, plan, b)


def lock(tx: Tx, d: _dialect.Dialect, plan: str) -> Budget:
    rows = tx.execute(
        f"SELECT active, seq, turn, in_window FROM {BUDGETS} WHERE plan = ?{d.for_update}", (plan,)
    )
    if not rows:
        raise ValueError(f"plan {plan!r} has no budget row: register it with its limits first")
    return Budget(*(int(v) for v in rows[0]))


def write_one(tx: Tx, plan: str, b: Budget) -> None:
    tx.execute(
        f"UPDATE {BUDGETS} SET active = ?, seq = ?, turn = ?, in_window = ? WHERE plan = ?",
        (b.active, b.seq, b.turn, b.in_window, plan),
    )
