"""Retention: finished flows are deleted, with their history and mailbox, once old enough.

A flow that ended (`COMPLETED` or `FAILED`) is never written again, so its last write
(``updated_at``) is when it ended. An engine opened with ``retain=SECONDS`` deletes the flows
that ended more than that long ago (`Retention`, a task of the engine); the inspector's
``purge --finished-before`` does the same by hand. Both delete with the store's
`_purge.purge_batch`, one batch per transaction. `BLOCKED` flows are kept: they wait
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
from typing import Final

import trio

from ferry.projected import Store

from .._model import _checks, _times
from .._store import _inbox, _purge
from . import _retry

_log = logging.getLogger("ferry.flow")

#: How long an engine keeps a finished flow unless told otherwise (``open_engine(retain=)``).
DEFAULT_RETAIN: Final = 30 * 86400.0
#: How often an engine purges: every ``retain / 4``, within these bounds (seconds).
EVERY_MIN: Final = 0.05
EVERY_MAX: Final = 600.0


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


# ------------------------------------------------------------------------------ the purge


async def purge(
    store: Store,
    before: float,
    *,
    batch: int = _purge.BATCH,
    guard: float | None = None,
    on_batch: Callable[[int], object] | None = None,
    only: _purge.Only = _purge.ANY,
) -> int:
    """Delete every finished flow whose last write is earlier than `before` (wall-clock
    seconds) and that `only` admits, one batch of at most `batch` flows per transaction
    (`_purge.purge_batch`), pausing between batches (`_purge.pause_after`); how many this call
    deleted.

    A checkpoint. Cancelled between batches, it stops there (what was deleted stays deleted);
    `on_batch(n)` is called after each committed batch. A store error is raised as it is."""
    total = 0
    while True:
        began = trio.current_time()
        deleted = await store.transact(
            partial(_purge.purge_batch, before=before, limit=batch, guard=guard, only=only)
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
        await trio.sleep(_purge.pause_after(trio.current_time() - began))


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
