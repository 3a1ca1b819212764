"""`stm.statistics()`: process-wide counters, as one frozen record."""

from __future__ import annotations

from typing import final

import attrs

from . import _txn


@final
@attrs.frozen(kw_only=True)
class STMStatistics:
    """Counters since the process started (all TVars, all threads).

    - `commits`: writing transactions committed.
    - `read_only_commits`: transactions that finished having written nothing.
    - `conflicts`: attempts rerun because another commit invalidated what they read.
    - `retries`: attempts that ended in `retry` (the transaction blocked, or raised WouldBlock).
    - `wakeups`: blocked transactions woken by a commit (including one that landed between the
      attempt and its registration, so it reran without blocking). Deadlines are not wakeups.
    - `irrevocable_runs`: attempts run holding the commit lock after too many conflicts.
    - `waiters`: waiter registrations live right now, summed over all TVars (exact).

    `commits` and `waiters` are exact. The others are bumped without a lock and may undercount a
    little when threads race; within one thread (any number of trio tasks) they are exact.
    """

    commits: int
    read_only_commits: int
    conflicts: int
    retries: int
    wakeups: int
    irrevocable_runs: int
    waiters: int


def statistics() -> STMStatistics:
    """A snapshot of the counters. Takes the commit lock briefly; O(1)."""
    commits, read_only, conflicts, retries, wakeups, irrevocable, waiters = _txn.counters()
    return STMStatistics(
        commits=commits,
        read_only_commits=read_only,
        conflicts=conflicts,
        retries=retries,
        wakeups=wakeups,
        irrevocable_runs=irrevocable,
        waiters=waiters,
    )
