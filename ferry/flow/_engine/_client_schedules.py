"""A client's calls on the schedules of a store (`flow.Client`, SPEC 5.9): the same as
`Engine.trigger`, `pause`, `unpause`, `unschedule` and `backfill`, asked of the engine that
serves the store as the client's other requests are (`_client`, docs/adr/0125), or, with no
engine serving, applied by the client itself through an operator's engine (a trigger's or a
backfill's flows then run in the next engine to open the store)."""

from __future__ import annotations

import math
from typing import Any

from .._model import _schedule
from .._model._checks import describe
from .._model._types import Json


def _time(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"backfill's {what} must be wall-clock seconds, got {describe(value, 100)}")
    if not math.isfinite(value):
        raise ValueError(f"backfill's {what} must be a finite time, got {value!r}")
    return float(value)


class ScheduleCalls:
    """The schedule calls of `flow.Client` (its `_ask` sends one request and returns its
    answer, or raises the engine's error)."""

    __slots__ = ()

    async def _ask(self, kind: str, body: dict[str, Json], request_id: object) -> Any:
        raise NotImplementedError  # `Client._ask`

    async def trigger(self, name: str, *, request_id: str | None = None) -> str | None:
        """`Engine.trigger`: the id of the flow started now, or None (the overlap rule did
        not start it). `UnknownSchedule`."""
        body: dict[str, Json] = {"name": _schedule.check_name(name)}
        result = await self._ask("trigger", body, request_id)
        return None if result is None else str(result)

    async def pause(self, name: str, *, request_id: str | None = None) -> None:
        """`Engine.pause`. `UnknownSchedule`."""
        await self._ask("pause", {"name": _schedule.check_name(name)}, request_id)

    async def unpause(self, name: str, *, request_id: str | None = None) -> None:
        """`Engine.unpause`. `UnknownSchedule`."""
        await self._ask("unpause", {"name": _schedule.check_name(name)}, request_id)

    async def unschedule(self, name: str, *, request_id: str | None = None) -> None:
        """`Engine.unschedule`. `UnknownSchedule`."""
        await self._ask("unschedule", {"name": _schedule.check_name(name)}, request_id)

    async def backfill(
        self, name: str, start: float, end: float, *, request_id: str | None = None
    ) -> int:
        """`Engine.backfill`: how many flows it started. `UnknownSchedule`."""
        first, last = _time(start, "start"), _time(end, "end")
        if first > last:
            raise ValueError(f"backfill's start ({start!r}) is after its end ({end!r})")
        body: dict[str, Json] = {"name": _schedule.check_name(name), "start": first, "end": last}
        return int(await self._ask("backfill", body, request_id))
