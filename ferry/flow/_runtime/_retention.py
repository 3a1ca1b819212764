"""Retention: finished flows are deleted, with their history and mailbox, once old enough.

A flow that ended (`COMPLETED` or `FAILED`) is never written again, so its last write
(``updated_at``) is when it ended. An engine opened with ``retain=SECONDS`` deletes the flows
that ended more than that long ago (`Retention`, a task of the engine); the inspector's
``purge --finished-before`` does the same by hand (`purge`). `BLOCKED` flows are kept: they wait
for an operator. Each round also deletes the clients' requests answered that long ago
(`_inbox.prune`, docs/adr/0125; a pending one is kept).

Design (docs/adr/0085):

- Small batches. One transaction deletes at most `BATCH` flows (and their history and mailbox
  rows), then the purge pauses at least as long as that transaction took before the next one.
  No lock is held longer than one batch takes, and a concurrent writer (an engine's group
  commit, on SQLite the same file's single writer lock) gets the store at least half of the
  time. The batch is found through the partial index of finished flows by ``updated_at``.
- Any engine of a fleet may purge, at the same time as others. On PostgreSQL the batch is
  chosen with ``FOR UPDATE SKIP LOCKED``, so two purges take disjoint batches instead of queueing
  on each other's rows. Every ``DELETE`` of a flow checks its state and age again in its own
  ``WHERE`` (a row that changed since it was chosen is left alone), and history and mailbox rows
  are deleted only for the flows this very transaction deleted (``RETURNING``): a flow deleted
  by another purge is not counted twice, and an id started again after a purge keeps its new
  history.
- After a purge, the id is unknown: a wake is `Delivery.UNKNOWN`, `get` is None, and `start`
  with that id starts a new flow.

Only a store that is unavailable now is retried (`_retry`, the engine's one retry rule, with a
WARNING per retry); any other error ends the engine's ``async with`` block with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Final

import attrs
import trio

from ferry.projected import Store, Tx

from .._model import _checks, _times
from .._store import _batch, _inbox, _sql
from . import _retry

_log = logging.getLogger("ferry.flow")

#: How long an engine keeps a finished flow unless told otherwise (``open_engine(retain=)``).
DEFAULT_RETAIN: Final = 30 * 86400.0
#: Flows deleted per transaction, at most.
BATCH: Final = 500
#: The shortest pause between two batches (seconds); a batch that took longer pauses as long.
PAUSE_MIN: Final = 0.05
#: How often an engine purges: every ``retain / 4``, within these bounds (seconds).
EVERY_MIN: Final = 0.05
EVERY_MAX: Final = 600.0
_FINISHED = f"state {_sql.IN_FINISHED}"  # as the index of finished flows says it


def check_retain(retain: object) -> float | None:
    """`retain` as seconds (a finite number > 0), or None (keep every flow); else `ValueError`."""
    if retain is None:
        return None
    if (
        isinstance(retain, bool)
        or not isinstance(retain, int | float)
        or not (_checks.finite(retain) and retain > 0)
    ):
        raise ValueError(
            f"retain must be a finite number of seconds > 0 (how long a finished flow is kept,"
            f" e.g. 30 * 86400), or None to keep every flow; got {_checks.shown_number(retain)}"
        )
    return float(retain)


# ------------------------------------------------------------------------ the SQL (one batch)


FINISHED_STATES: Final = ("COMPLETED", "FAILED")
#: Free pages an SQLite purge batch gives back to the file system, at most (4 KiB each).
RECLAIM_PAGES: Final = 4096


@attrs.frozen
class Only:
    """Which finished flows a purge may delete: of this plan (its name) and in this state
    (``"COMPLETED"`` or ``"FAILED"``); None is any."""

    plan: str | None = None
    state: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(FINISHED_STATES))
    )

    def sql(self) -> tuple[str, tuple[str, ...]]:
        """The extra ``WHERE`` terms (each starting with AND) and their parameters."""
        terms, params = "", []
        if self.plan is not None:
            terms += " AND plan = ?"
            params.append(self.plan)
        if self.state is not None:
            terms += " AND state = ?"
            params.append(self.state)
        return terms, tuple(params)


ANY: Final = Only()


def reclaim(tx: Tx, pages: int = RECLAIM_PAGES) -> int:
    """On SQLite, give free pages back to the file system in this transaction (the file
    shrinks), at most `pages`; how many. Only a file in incremental auto-vacuum mode (what
    `SqliteStore` makes of a new file) can; in another one, and on PostgreSQL (autovacuum
    makes the space reusable, not smaller), this does nothing."""
    if tx.dialect != "sqlite" or tx.execute("PRAGMA auto_vacuum")[0][0] != 2:
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
    """Delete at most `limit` finished flows whose last write is earlier than `before` (and
    that `only` admits), with their history and mailbox rows, in this transaction; the ids
    deleted (oldest first). On SQLite the pages freed go back to the file system (`reclaim`).

    Safe against concurrent purges and writes (see the module doc). Cost: one index range scan
    for the batch, and one ``DELETE`` per table keyed by flow id."""
    _batch.guard_locks(tx, guard)
    flows = _sql.FLOWS
    terms, params = only.sql()
    pick = (
        f"SELECT flow_id FROM {flows} WHERE {_FINISHED} AND updated_at < ?{terms}"
        f" ORDER BY updated_at LIMIT {int(limit)}"
    )
    if tx.dialect == "postgres":
        ids = [r[0] for r in tx.execute(pick + " FOR UPDATE SKIP LOCKED", (before, *params))]
        if not ids:
            return []
        deleted = [
            r[0]
            for r in tx.execute(
                f"DELETE FROM {flows} WHERE flow_id = ANY(?) AND {_FINISHED}"
                " AND updated_at < ? RETURNING flow_id",
                (ids, before),
            )
        ]
        if deleted:
            tx.execute(f"DELETE FROM {_sql.HISTORY} WHERE flow_id = ANY(?)", (deleted,))
            tx.execute(f"DELETE FROM {_sql.MAILBOX} WHERE flow_id = ANY(?)", (deleted,))
    else:
        ids = [r[0] for r in tx.execute(pick, (before, *params))]
        if not ids:
            return []
        marks = ", ".join("?" * len(ids))
        deleted = [
            r[0]
            for r in tx.execute(
                f"DELETE FROM {flows} WHERE flow_id IN ({marks}) AND {_FINISHED}"
                " AND updated_at < ? RETURNING flow_id",
                (*ids, before),
            )
        ]
        if deleted:
            marks = ", ".join("?" * len(deleted))
            tx.execute(f"DELETE FROM {_sql.HISTORY} WHERE flow_id IN ({marks})", deleted)
            tx.execute(f"DELETE FROM {_sql.MAILBOX} WHERE flow_id IN ({marks})", deleted)
            reclaim(tx)
    order = {fid: i for i, fid in enumerate(ids)}
    return sorted(deleted, key=order.__getitem__)


def count_finished(tx: Tx, before: float, only: Only = ANY) -> int:
    """How many finished flows (that `only` admits) have their last write earlier than
    `before` (the index)."""
    terms, params = only.sql()
    rows = tx.execute(
        f"SELECT COUNT(*) FROM {_sql.FLOWS} WHERE {_FINISHED} AND updated_at < ?{terms}",
        (before, *params),
    )
    return int(rows[0][0])


# ------------------------------------------------------------------------------ the purge


async def purge(
    store: Store,
    before: float,
    *,
    batch: int = BATCH,
    guard: float | None = None,
    on_batch: Callable[[int], object] | None = None,
    only: Only = ANY,
) -> int:
    """Delete every finished flow whose last write is earlier than `before` (wall-clock
    seconds) and that `only` admits, one batch of at most `batch` flows per transaction,
    pausing between batches (at least `PAUSE_MIN`, and as long as the last batch took); how
    many this call deleted.

    A checkpoint. Cancelled between batches, it stops there (what was deleted stays deleted);
    `on_batch(n)` is called after each committed batch. A store error is raised as it is."""
    total = 0
    while True:
        began = trio.current_time()
        deleted = await store.transact(
            partial(purge_batch, before=before, limit=batch, guard=guard, only=only)
        )
        n = len(deleted)
        total += n
        if n:
            if on_batch is not None:
                on_batch(n)
            if _log.isEnabledFor(logging.DEBUG):
                _log.debug(
                    "purge: deleted %d finished flows in one transaction (%d so far)",
                    n,
                    total,
                    extra={"purged": n},
                )
        if n < batch:
            await trio.lowlevel.checkpoint()
            return total
        await trio.sleep(max(PAUSE_MIN, trio.current_time() - began))


class Retention:
    """An engine's retention task: every ``retain / 4`` (within `EVERY_MIN`..`EVERY_MAX`) it
    purges the flows that finished more than `retain` seconds ago (`purge`), from its open on.
    `purged` counts what it deleted (`FlowStatistics.purged`)."""

    __slots__ = ("_guard", "_now", "_retain", "_store", "every", "purged")

    def __init__(
        self, store: Store, retain: float, now: Callable[[], float], guard: float | None
    ) -> None:
        self._store = store
        self._retain = retain
        self._now = now  # the engine's wall clock (a MockClock's under one: `_clock`)
        self._guard = guard
        self.every = min(max(retain / 4, EVERY_MIN), EVERY_MAX)
        self.purged = 0

    def _count(self, n: int) -> None:
        self.purged += n

    async def run(self) -> None:
        """Purge, then sleep `every`, for ever. While the store is unavailable the purge is
        tried again (`_retry.Backoff`: a WARNING each time); any other error is raised."""
        backoff: _retry.Backoff | None = None
        while True:
            before = self._now() - self._retain
            try:
                n = await purge(self._store, before, guard=self._guard, on_batch=self._count)
                # clients' requests answered before `before` (docs/adr/0125): one statement
                await self._store.transact(partial(_inbox.prune, before=before))
            except Exception as exc:
                if backoff is None:
                    backoff = _retry.Backoff("purging finished flows (retention)")
                await backoff.pause(exc)  # raises `exc` unless the store is unavailable
                continue
            backoff = None
            if n:
                _log.info(
                    "retention: deleted %d finished flows that ended before %s",
                    n,
                    _times.iso(before),
                    extra={"purged": n},
                )
            await trio.sleep(self.every)


# ------------------------------------------------------------------- times for the inspector


def parse_before(text: str, now: float) -> float:
    """A time given by an operator, as wall-clock seconds: ISO 8601 (``2026-11-01``,
    ``2026-11-01T12:00:00Z``; without a zone, UTC) or an age before `now` (``7d``, ``12h``,
    ``30m``, ``90s``, ``2w``). `ValueError` naming both forms otherwise."""
    when = _times.read(text, now, units="smhdw")
    if when is None:
        raise ValueError(
            f"{_checks.shown_number(text)} is not a time: give an ISO 8601 date or time"
            " (2026-11-01, 2026-11-01T12:00:00Z; UTC unless it says otherwise) or an age such as"
            " 7d, 12h, 30m, 90s, 2w"
        )
    return when


def describe(before: float, now: float) -> dict[str, Any]:
    """``before`` for the inspector's output: ISO 8601 and how long ago."""
    return {"before": _times.iso(before), "age_seconds": round(now - before, 3)}
