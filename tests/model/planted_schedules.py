"""Firing protocols with one planted bug each: the schedules model check must catch every one
(`tests/model/test_schedules_model.py`)."""

from __future__ import annotations

from ferry.flow._model import _schedule
from ferry.flow._model._schedule import Fired, Row
from tests.model.schedules import RULE, SchedulesProtocol


class TwoTransactions(SchedulesProtocol):
    """(1) The row (its next tick) is written in one transaction and the tick's flow in a
    second one: an engine that dies between the two has moved past a tick it never started."""

    split_write = True


class Replays(SchedulesProtocol):
    """(2) The next tick is set to the one after the tick started, and the tick started is the
    oldest due: after downtime every missed tick starts, one firing after another (a burst)."""

    def fire(self, row: Row, now: float, overlap: str, catchup: float, last_active: bool) -> Fired:
        if row.paused or row.next_tick is None or row.next_tick > now:
            return Fired(row=None)
        return _schedule.fire(
            row, RULE, row.next_tick, overlap=overlap, catchup=catchup, last_active=last_active
        )


class NoRevisionCheck(SchedulesProtocol):
    """(3) The commit does not compare the revision it read: two engines that read the same
    due row both write, the later overwriting the earlier with what it decided from its own
    (older) read."""

    check_revision = False
