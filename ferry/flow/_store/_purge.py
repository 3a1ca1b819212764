"""The purge's SQL: one batch of finished flows deleted, with their history and mailbox rows,
in one transaction (`purge_batch`), and how many there are (`count_finished`).

Retention (`_runtime._retention`, an engine's task) and the inspector's ``purge
--finished-before`` (`_ops._inspect_act`) both delete with it, one batch per transaction, and
pause between batches as `pause_after` says (docs/adr/0085, 0135). Why it is safe beside
running engines and concurrent purges is in `_runtime._retention`'s docstring.

Everything here is synchronous and runs inside one store transaction on a worker thread: no
trio, no clock.
"""

from __future__ import annotations

from typing import Final

import attrs

from ferry.projected import Tx

from . import _batch, _dialect, _schema, _signals, _sql

FINISHED_STATES: Final = ("COMPLETED", "FAILED")
#: Flows deleted per transaction, at most.
BATCH: Final = 500
#: The shortest pause between two batches (seconds); a batch that took longer pauses as long.
PAUSE_MIN: Final = 0.05
#: Free pages an SQLite purge batch gives back to the file system, at most (4 KiB each).
RECLAIM_PAGES: Final = 4096
# As the index of finished flows says it; a child goes only with its whole tree (ADR 0139).
_FINISHED: Final = f"state {_sql.IN_FINISHED} AND parent IS NULL"


def pause_after(took: float) -> float:
    """How long a purge pauses after a batch that took `took` seconds before the next one:
    at least `PAUSE_MIN`, and as long as the batch took, so that a concurrent writer gets the
    store at least half of the time."""
    return max(PAUSE_MIN, took)


@attrs.frozen
class Only:
    """Which finished flows a purge may delete: of this plan (its name), in this state
    (``"COMPLETED"`` or ``"FAILED"``) and the flow of this id (a top-level one, with its tree:
    the inspector's ``purge --flow``); None is any."""

    plan: str | None = None
    state: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(FINISHED_STATES))
    )
    flow_id: str | None = None

    def sql(self) -> tuple[str, tuple[str, ...]]:
        """The extra ``WHERE`` terms (each starting with AND) and their parameters."""
        terms, params = "", []
        if self.plan is not None:
            terms += " AND plan = ?"
            params.append(self.plan)
        if self.state is not None:
            terms += " AND state = ?"
            params.append(self.state)
        if self.flow_id is not None:
            terms += " AND flow_id = ?"
            params.append(self.flow_id)
        return terms, tuple(params)


ANY: Final = Only()


def reclaim(tx: Tx, pages: int = RECLAIM_PAGES) -> int:
    """Where the dialect can (SQLite), give free pages back to the file system in this
    transaction (the file shrinks), at most `pages`; how many. Only a file in incremental
    auto-vacuum mode (what `SqliteStore` makes of a new file) can; in another one, and on
    PostgreSQL (autovacuum makes the space reusable, not smaller), this does nothing."""
    if not _dialect.of(tx).shrinks or tx.execute("PRAGMA auto_vacuum")[0][0] != 2:
        return 0
    free = min(int(tx.execute("PRAGMA freelist_count")[0][0]), pages)
    for _ in range(free):  # Python's sqlite3 steps the pragma once: one page per statement
        tx.execute("PRAGMA incremental_vacuum(1)")
    return free


def purge_batch(
    tx: Tx,
    before: float,
    *,
    limit: int = BATCH,
    guard: float | None = None,
    only: Only = ANY,
) -> list[str]:
    """Delete at most `limit` finished top-level flows whose last write is earlier than
    `before` (and that `only` admits), with their history and mailbox rows and their whole
    trees of child flows (a child never goes alone, `_trees`), in this transaction; the ids
    deleted (oldest first). Where the dialect can, the pages freed go back to the file system
    (`reclaim`). `guard`: see `_batch.guard_locks`.

    Safe against concurrent purges and writes: the batch is chosen skipping the rows another
    transaction holds (PostgreSQL), each ``DELETE`` checks the state and age again, and the
    history and mailbox rows go only for the flows this transaction deleted. Cost: one index
    range scan for the batch, and one ``DELETE`` per table keyed by flow id."""
    _batch.guard_locks(tx, guard)
    d = _dialect.of(tx)
    flows = _sql.FLOWS
    terms, params = only.sql()
    pick = (
        f"SELECT flow_id FROM {flows} WHERE {_FINISHED} AND updated_at < ?{terms}"
        f" ORDER BY updated_at LIMIT {int(limit)}{d.skip_locked}"
    )
    ids = [r[0] for r in tx.execute(pick, (before, *params))]
    if not ids:
        return []
    deleted = [
        r[0]
        for r in tx.execute(
            f"DELETE FROM {flows} WHERE {d.in_list('flow_id', len(ids))} AND {_FINISHED}"
            " AND updated_at < ? RETURNING flow_id",
            (*d.list_params(ids), before),
        )
    ]
    if deleted:
        _rows_of(tx, deleted)
        _trees(tx, deleted)
        reclaim(tx)
    order = {fid: i for i, fid in enumerate(ids)}
    return sorted(deleted, key=order.__getitem__)


def _rows_of(tx: Tx, ids: list[str]) -> None:
    """Delete the history, mailbox, event and stream rows of the flows `ids` (deleted)."""
    d = _dialect.of(tx)
    some = d.in_list("flow_id", len(ids))
    for table in (_sql.HISTORY, _sql.MAILBOX, _signals.EVENTS, _signals.STREAM):
        tx.execute(f"DELETE FROM {table} WHERE {some}", d.list_params(ids))


def _trees(tx: Tx, parents: list[str]) -> None:
    """Delete the trees below the flows `parents` (deleted): their spawns' rows, and their
    children's flow rows (found by ``parent``), level by level. A parent ends only after every
    child it started has ended (SPEC 5.7), so a finished top-level flow's tree has ended."""
    d = _dialect.of(tx)
    level = parents
    while level:
        below: list[str] = []
        for i in range(0, len(level), BATCH):  # at most BATCH parameters a statement
            some = level[i : i + BATCH]
            where, params = d.in_list("parent", len(some)), d.list_params(some)
            tx.execute(f"DELETE FROM {_schema.SPAWNS} WHERE {where}", params)
            tx.execute(f"DELETE FROM {_schema.CHILDREN} WHERE {where}", params)
            sql = f"DELETE FROM {_sql.FLOWS} WHERE {where} RETURNING flow_id"
            gone = [r[0] for r in tx.execute(sql, params)]
            if gone:
                _rows_of(tx, gone)
            below += gone
        level = below


def count_finished(tx: Tx, before: float, only: Only = ANY) -> int:
    """How many finished top-level flows (that `only` admits) have their last write earlier
    than `before` (the index); their children go with them."""
    terms, params = only.sql()
    rows = tx.execute(
        f"SELECT COUNT(*) FROM {_sql.FLOWS} WHERE {_FINISHED} AND updated_at < ?{terms}",
        (before, *params),
    )
    return int(rows[0][0])
