"""The engine's clock: wall-clock seconds that advance with trio's clock.

Durable times (park deadlines, leases, `Event.at`) are wall-clock seconds, read as ``time.time()``
once at open plus `trio.current_time()` elapsed since, so that `trio.testing.MockClock` drives an
hour-long park in a test. `trio_time` maps such a time back to trio's clock, for a deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import trio


class Clock:
    """Wall-clock seconds from `wall_clock()` at construction on, advancing with trio's clock."""

    __slots__ = ("_t0_trio", "_t0_wall")

    def __init__(self, wall_clock: Callable[[], float]) -> None:
        self._t0_wall = wall_clock()
        self._t0_trio = trio.current_time()

    def now(self) -> float:
        """Wall-clock seconds, advancing with trio's clock."""
        return self._t0_wall + (trio.current_time() - self._t0_trio)

    def trio_time(self, wall: float) -> float:
        """The trio time at which `now()` reaches `wall`."""
        return self._t0_trio + (wall - self._t0_wall)
