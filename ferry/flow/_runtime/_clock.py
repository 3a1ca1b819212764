"""The engine's clock for durable times: the host's wall clock, or a MockClock's virtual one.

Durable times (when a flow was created and last written, its park deadline, its history's and
its mailbox's times, `Event.at`) are wall-clock seconds since the epoch by the clock of the host
that writes them (docs/adr/0110). With trio's own clock, `Clock.now` reads the host's wall clock
each time, so an NTP step of the host (forward or back) reaches the times written after it.
Under `trio.testing.MockClock` (SPEC 5.3.3, docs/adr/0066) it is the wall clock read once at
construction plus the virtual time elapsed since, so that an hour-long park takes no real time
in a test. `trio_time` maps such a time to trio's clock, for a deadline (a timer armed before a
step of the wall clock fires after the time it was armed for, not at the new wall time).

Leases are not decided here: in a fleet the database's clock decides them, and an engine's own
view of its lease runs on trio's clock (`_lease`).
"""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing


class Clock:
    """Wall-clock seconds by `wall_clock()` (read at each call), or, under a MockClock, from
    `wall_clock()` at construction on, advancing with the mock."""

    __slots__ = ("_mock", "_t0_trio", "_t0_wall", "_wall")

    def __init__(self, wall_clock: Callable[[], float]) -> None:
        self._wall = wall_clock
        self._mock = isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)
        self._t0_wall = wall_clock()
        self._t0_trio = trio.current_time()

    @property
    def virtual(self) -> bool:
        """Is it a MockClock's virtual time (no host's clock can step it)?"""
        return self._mock

    def now(self) -> float:
        """Wall-clock seconds now: the host's (its steps included), or the mock's."""
        if self._mock:
            return self._t0_wall + (trio.current_time() - self._t0_trio)
        return self._wall()

    def trio_time(self, wall: float) -> float:
        """The trio time at which `now()` reaches `wall` (if the wall clock is not stepped
        meanwhile)."""
        if self._mock:
            return self._t0_trio + (wall - self._t0_wall)
        return trio.current_time() + (wall - self._wall())
