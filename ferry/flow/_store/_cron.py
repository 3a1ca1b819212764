"""The cron grammar, and the public `Schedule` (SPEC 5.9, docs/adr/0143).

The one module that imports the cron library, cronsim (docs/adr/0143 says why that one). It
sits in the store's folder, not the model's: the model imports the standard library, attrs and
pyrsistent only (docs/adr/0120), the store is the lowest folder that may import a library, and
the store's one write that starts a tick computes the schedule's next tick inside its
transaction (docs/adr/0144), from the definition it has just read. The pure rules (ids,
catch-up, overlap, the checks of the other fields) are `_model/_schedule.py`; a `CronRule` is
the `_schedule.Rule` they take.

Daylight saving time, as Debian's cron does it (cronsim follows it, docs/adr/0143):

- An expression whose minute and hour fields are both fixed (neither starts with ``*``: ``30
  2 * * *``, ``0 9-17 * * 1-5``) ticks at a time of day, once a day. On a day that has no such
  local time (02:30 on 2026-03-29 in Europe/Warsaw: the clocks go from 02:00 to 03:00) it ticks
  at the first local time after the gap (03:00, 01:00 UTC); on a day that has it twice (02:30 on
  2026-10-25: 00:30 and 01:30 UTC) it ticks at the first one only.
- Any other expression (``*/15 * * * *``, ``30 * * * *``: a minute or hour field that starts
  with ``*``) ticks in real time: a local time that does not exist has no tick, one that exists
  twice has two, so an every-15-minutes schedule ticks every 900 seconds through both changes.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import final

import cronsim

from .._model import _limits, _schedule
from .._model._checks import describe
from .._model._plan import Plan
from .._model._types import Json

#: An expression with no tick in the 50 years (cronsim's search horizon) from here has none.
_REFERENCE = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC).timestamp()


def _check_cron(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"cron must be a str (five fields), got {describe(value, 200)}")
    fields = value.split()
    if len(fields) != 5:
        raise ValueError(
            f"cron must have 5 fields (minute hour day-of-month month day-of-week, for example"
            f" '0 3 * * *'), got {value!r} with {len(fields)}"
        )
    return " ".join(fields)


#: How many (expression, zone, time) answers `CronRule.after` remembers.
_REMEMBERED = 4096


def _library_next(
    expression: str, zone: datetime.tzinfo, after: datetime.datetime
) -> datetime.datetime | None:
    try:
        return next(cronsim.CronSim(expression, after.astimezone(zone)))
    except StopIteration:
        return None


@functools.lru_cache(maxsize=_REMEMBERED)
def _after(expression: str, zone: datetime.tzinfo, t: float) -> float | None:
    when = datetime.datetime.fromtimestamp(t, datetime.UTC)
    while True:
        found = _library_next(expression, zone, when)
        if found is None:
            return None
        tick = found.timestamp()
        if tick > t:
            return tick
        when = found.astimezone(datetime.UTC)


@final
class CronRule:
    """A cron expression of five fields, compiled, in a time zone: `after` is the first tick
    strictly after a time (`_schedule.Rule`). A bad expression, or one that never ticks (30
    February), is a `ValueError` naming ``cron`` and what the library said."""

    __slots__ = ("expression", "zone")

    def __init__(self, expression: str, zone: datetime.tzinfo) -> None:
        self.expression = _check_cron(expression)
        self.zone = zone
        try:
            first = _after(self.expression, zone, _REFERENCE)
        except cronsim.CronSimError as exc:
            raise ValueError(
                f"cron {expression!r} is not a cron expression: {exc} (five fields: minute"
                " 0-59, hour 0-23, day-of-month 1-31, month 1-12 or JAN-DEC, day-of-week 0-7"
                " or SUN-SAT)"
            ) from None
        if first is None:
            raise ValueError(f"cron {expression!r} never ticks (no such day in 50 years)")

    def after(self, t: float) -> float | None:
        """The first tick strictly after `t`, a whole second (None: none in 50 years).

        The library is asked from `t`'s local time; in the hour that a change back to winter
        time repeats, its answer for a fixed time of day can be the first pass of that hour,
        before `t`: such an answer is stepped over, so that the ticks strictly increase.
        Remembered for the last `_REMEMBERED` questions: the schedules due on one minute mostly
        share a few expressions and zones, so 10,000 of them ask the library a few times."""
        return _after(self.expression, self.zone, t)

    def __repr__(self) -> str:
        return f"CronRule({self.expression!r}, {self.zone!s})"


@final
class Schedule:
    """Start a flow of `plan` at every tick of a cron expression (SPEC 5.9).

    ``Schedule(name, plan, *, cron, timezone="UTC", data=None, overlap="skip", catchup=0)``:
    `name` names the schedule and its flows (``name@2026-12-02T02:00:00Z``); `cron` is five
    fields, read in `timezone` (an IANA name) across daylight saving time; each tick's flow
    starts with `data` (a JSON object) and ``scheduled_at``; `overlap` is ``"skip"``,
    ``"allow"`` or ``"queue"``; `catchup` is how many seconds late a missed tick may still
    start after downtime (at most one per schedule). Every field is checked here: a bad one is a
    `TypeError` or `ValueError` naming it. A value: equal definitions are equal.
    """

    __slots__ = ("_data", "catchup", "cron", "name", "overlap", "plan", "rule", "timezone")

    def __init__(
        self,
        name: str,
        plan: Plan,
        *,
        cron: str,
        timezone: str = "UTC",
        data: dict[str, Json] | None = None,
        overlap: str = "skip",
        catchup: float = 0,
    ) -> None:
        self.name = _schedule.check_name(name)
        if not isinstance(plan, Plan):
            raise TypeError(f"a schedule's plan must be a flow.Plan, got {describe(plan, 200)}")
        self.plan = plan
        zone = _schedule.check_timezone(timezone)
        self.timezone: str = timezone
        self.rule = CronRule(cron, zone)
        self.cron: str = self.rule.expression
        self._data = _schedule.check_data(data)
        self.overlap = _schedule.check_overlap(overlap)
        self.catchup = _schedule.check_catchup(catchup)
        _key_of_ticks(self, plan)

    @property
    def data(self) -> dict[str, Json]:
        """The data every tick's flow starts with (before ``scheduled_at``): a new dict."""
        loaded: dict[str, Json] = json.loads(self._data)
        return loaded

    def definition(self) -> dict[str, Json]:
        """What the store keeps of it (a changed one replaces the stored one): the plan by name
        and version, and every other field."""
        return {
            "plan": self.plan.name,
            "version": self.plan.version,
            "cron": self.cron,
            "timezone": self.timezone,
            "data": self.data,
            "overlap": self.overlap,
            "catchup": self.catchup,
        }

    def next_tick(self, after: float) -> float | None:
        """The first tick strictly after `after` (wall-clock seconds); None if none."""
        return self.rule.after(after)

    def tick_id(self, t: float) -> str:
        """The id of the flow that the tick `t` starts."""
        return _schedule.tick_id(self.name, t)

    def tick_data(self, t: float) -> dict[str, Json]:
        """The data the flow of the tick `t` starts with."""
        return _schedule.tick_data(self._data, t)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self.name == other.name and self.definition() == other.definition()

    def __hash__(self) -> int:
        return hash((self.name, self.plan.name, self.plan.version, self.cron, self.timezone))

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, {self.plan.name!r} v{self.plan.version},"
            f" cron={self.cron!r}, timezone={self.timezone!r}, overlap={self.overlap!r},"
            f" catchup={self.catchup!r})"
        )


def _key_of_ticks(schedule: Schedule, plan: Plan) -> None:
    """A plan whose limits have a key function (SPEC 5.8): the key of the schedule's ticks,
    computed at each tick from its data, is computed here once on a tick's data (its time the
    next tick's, or none), so that a key function that cannot give the ticks one is refused at
    the definition, naming the schedule, not at a firing (docs/adr/0168)."""
    limits = plan.limits
    if limits is None or limits.key is None:
        return
    t = schedule.rule.after(0.0)
    try:
        _limits.flow_key(limits, plan.name, schedule.tick_data(0.0 if t is None else t))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"schedule {schedule.name!r}: {exc}") from exc
