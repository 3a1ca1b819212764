"""Schedules, the pure part (SPEC 5.9, docs/adr/0143, 0144): the checks of a definition, tick
ids, the catch-up rule after downtime and the overlap decision. No trio, no clock, no store.

The cron grammar is not here: the library that parses it (cronsim) is no import the model may
make (docs/adr/0120), so a compiled expression reaches these functions as a `Rule`, made by
`ferry/flow/_store/_cron.py`, the one module that imports the library (and home of the public
`Schedule`). Everything here takes times as wall-clock seconds since the epoch, as arguments:
the caller says what "now" is.

The rules, in one place:

- A tick is a whole second ``T``; its flow's id is ``f"{name}@{T}"`` with ``T`` in UTC as
  ``YYYY-MM-DDTHH:MM:SSZ`` (`tick_id`), its data the schedule's data with ``scheduled_at``
  set to the same text (`tick_data`): a second start of one tick is the same start, which the
  engine's idempotent `start` answers without running anything again.
- **Catch-up** (`catch_up`): when the engine comes to a schedule whose stored next tick is
  due, it starts at most one tick: the oldest one missed by at most ``max(catchup, ON_TIME)``
  seconds (a tick at most `ON_TIME` late is on time, whatever ``catchup`` says). Every other
  tick up to now is counted as missed, and the next tick becomes the first one after now. A
  wall clock that jumps 78 minutes, a laptop asleep a week, an engine closed a year: one start
  per schedule, never a burst, and the schedule is back on its times at once (a paced replay
  would keep it late for good).
- **Overlap** (`admit`): ``"skip"`` skips a tick while the schedule's previous flow is active,
  ``"allow"`` always starts, ``"queue"`` keeps one tick waiting for the previous flow's end (a
  tick that finds one waiting is skipped: the waiting one is older).
- **The row** (`Row`) and its transitions (`declared`, `fire`, `trigger`, `ended`, `pause`,
  `unpause`): what the store's one write per firing records, a `Fired` (the row to write and
  the one tick whose flow starts in the same write), docs/adr/0144.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import zoneinfo
from collections.abc import Iterator
from datetime import UTC, tzinfo
from typing import Protocol, final

import attrs

from ._checks import describe, finite, json_object_text, text_problem
from ._times import iso
from ._types import Json

#: The overlap policies, as `Schedule(overlap=...)` takes them.
OVERLAPS = ("skip", "allow", "queue")

#: A tick that the engine comes to at most this many seconds late is on time, whatever
#: `catchup` says (a busy loop, a slow commit, 10,000 schedules due on one minute): only a tick
#: later than ``max(catchup, ON_TIME)`` is missed.
ON_TIME = 60.0

#: The longest schedule name: it is a prefix of every flow id the schedule starts.
MAX_NAME = 200

#: At most this many missed ticks are counted one by one after a downtime; past that the
#: count stops (`CatchUp.counted_all` is False) and the rest are passed over unseen, so that
#: an every-minute schedule after a year closed costs a bounded catch-up (each tick is one
#: call of the cron library, 7 to 75 microseconds).
MAX_COUNTED = 1_000

#: At most this many ticks are started by one backfill (`backfill_ticks`).
MAX_BACKFILL = 10_000

#: The data key that carries a tick's time: the schedule's own data may not hold it.
SCHEDULED_AT = "scheduled_at"


class Rule(Protocol):
    """A compiled cron expression in its schedule's time zone (made outside the model)."""

    def after(self, t: float) -> float | None:
        """The first tick strictly after `t` (wall-clock seconds), a whole second; None if the
        expression has no tick after `t` (within the library's horizon of 50 years)."""
        ...


# ---------------------------------------------------------------------------------------------
# The checks of a definition: TypeError / ValueError naming the field, at the call.


def check_name(value: object) -> str:
    """A schedule's name: a non-empty str of printable characters that can be stored, with no
    ``@`` (its flows' ids are ``name@T``: a name with ``@`` would make one schedule's ids a
    prefix match of another's), no space at either end, at most `MAX_NAME` characters."""
    if not isinstance(value, str):
        raise TypeError(f"a schedule's name must be a str, got {describe(value, 200)}")
    if not value:
        raise ValueError("a schedule's name must not be empty")
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(f"a schedule's name {value!r} cannot be stored: {problem}")
    if not value.isprintable():
        bad = next(ch for ch in value if not ch.isprintable())
        raise ValueError(
            f"a schedule's name must be printable, got {value!r} (it holds {bad!r} at index"
            f" {value.index(bad)}): it is shown by the inspector and is part of flow ids"
        )
    if value != value.strip():
        raise ValueError(f"a schedule's name must not begin or end with a space, got {value!r}")
    if "@" in value:
        raise ValueError(
            f"a schedule's name must not hold '@', got {value!r}: its flows are named"
            " NAME@TIME (for example nightly@2026-12-02T02:00:00Z)"
        )
    if len(value) > MAX_NAME:
        raise ValueError(
            f"a schedule's name must be at most {MAX_NAME} characters, got {len(value)}"
        )
    return value


def _no_database() -> bool:
    try:
        return not zoneinfo.available_timezones()
    except Exception:  # an unreadable tzdata package: say so below rather than here
        return True


def check_timezone(value: object) -> tzinfo:
    """The zone named `value`, an IANA name such as ``"Europe/Warsaw"`` (``"UTC"`` needs no
    time zone database). A name the database does not have, or a file name that is no zone
    (``"localtime"``: the host's own zone would make a fleet's engines disagree), is a
    `ValueError` naming the field."""
    if not isinstance(value, str):
        raise TypeError(f"timezone must be a str (an IANA name), got {describe(value, 200)}")
    if value == "UTC":
        return UTC
    if value in ("localtime", "posixrules", "Factory"):
        raise ValueError(
            f"timezone {value!r} is no zone: name one, such as 'Europe/Warsaw' or 'UTC' (the"
            " host's own zone would make the engines of a fleet disagree)"
        )
    try:
        return zoneinfo.ZoneInfo(value)
    except (ValueError, zoneinfo.ZoneInfoNotFoundError, OSError):
        pass
    hint = (
        ": this Python finds no time zone database (install the tzdata package, or the"
        " system's tzdata)"
        if _no_database()
        else ": give an IANA name such as 'Europe/Warsaw', 'America/New_York' or 'UTC'"
    )
    raise ValueError(f"timezone {describe(value, 100)} is not a known time zone{hint}") from None


def check_overlap(value: object) -> str:
    """One of `OVERLAPS`."""
    if not isinstance(value, str):
        raise TypeError(f"overlap must be a str, one of {OVERLAPS}, got {describe(value, 200)}")
    if value not in OVERLAPS:
        raise ValueError(f"overlap must be 'skip' (the default), 'allow' or 'queue', got {value!r}")
    return value


def check_catchup(value: object) -> float:
    """Seconds, a finite number >= 0 (int or float, not bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"catchup must be a number of seconds, got {describe(value, 200)}")
    if not finite(value) or value < 0:
        raise ValueError(
            f"catchup must be a finite number of seconds >= 0 (how late a missed tick may"
            f" still start), got {describe(value, 40)}"
        )
    return float(value)


def check_data(value: object) -> str:
    """The canonical JSON text of a schedule's data: None (no data) or a JSON object that does
    not hold ``scheduled_at`` (each tick sets it)."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise TypeError(
            f"a schedule's data must be None or a JSON object (a dict), got {describe(value, 200)}"
        )
    text = json_object_text(value, "a schedule's data")
    if SCHEDULED_AT in value:
        raise ValueError(
            f"a schedule's data must not hold {SCHEDULED_AT!r}: each tick sets it to the"
            " tick's time"
        )
    return text


# ---------------------------------------------------------------------------------------------
# Ticks


def tick_text(t: float) -> str:
    """The tick `t` as its flows write it: UTC to the second, ``2026-12-02T02:00:00Z``."""
    return _second_text(math.floor(t))


@functools.lru_cache(maxsize=1024)
def _second_text(second: int) -> str:
    """`iso` of a whole second, remembered: the schedules due on one minute share a few ticks,
    each written several times a firing (its flow id, its data, the row's last flow)."""
    return iso(second)


def tick_id(name: str, t: float) -> str:
    """The flow id of the tick `t` of the schedule `name`: ``name@2026-12-02T02:00:00Z``."""
    return f"{name}@{tick_text(t)}"


def tick_data(data_text: str, t: float) -> dict[str, Json]:
    """The data a tick's flow starts with: the schedule's data (its canonical JSON text) with
    ``scheduled_at`` the tick's time, the same text as in its id."""
    data: dict[str, Json] = json.loads(data_text)
    data[SCHEDULED_AT] = tick_text(t)
    return data


def ticks(rule: Rule, after: float) -> Iterator[float]:
    """The ticks of `rule` after `after`, in order (ends where the rule has no more)."""
    t: float | None = rule.after(after)
    while t is not None:
        yield t
        t = rule.after(t)


def backfill_ticks(
    rule: Rule, start: float, end: float, *, limit: int = MAX_BACKFILL
) -> list[float]:
    """Every tick T with ``start <= T <= end``, oldest first; a `ValueError` if there are more
    than `limit` (a backfill of a year of minutes is a mistake to say, not to run)."""
    for what, value in (("start", start), ("end", end)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
            raise ValueError(f"backfill's {what} must be a finite time, got {describe(value, 40)}")
    if start > end:
        raise ValueError(f"backfill's start {iso(start)} is after its end {iso(end)}")
    found: list[float] = []
    for t in ticks(rule, math.ceil(start) - 1):
        if t > end:
            break
        if len(found) == limit:
            raise ValueError(
                f"backfill from {iso(start)} to {iso(end)} covers more than {limit} ticks:"
                " give a shorter span"
            )
        found.append(t)
    return found


@final
@attrs.frozen(kw_only=True)
class CatchUp:
    """What to do with a schedule whose stored next tick `due` has come (`catch_up`).

    `start`: the one tick to start now, or None (every tick up to now was missed); `skipped`:
    how many ticks up to now are passed over (to add to the schedule's skipped count);
    `counted_all`: False when more than `MAX_COUNTED` were missed and the count stopped there;
    `next`: the schedule's next tick from now on, the first one after now (None: the rule has
    no more ticks)."""

    start: float | None
    skipped: int
    counted_all: bool
    next: float | None


def first_from(rule: Rule, t: float) -> float | None:
    """The first tick at or after `t` (ticks are whole seconds)."""
    return rule.after(math.ceil(t) - 1)


def catch_up(rule: Rule, due: float, now: float, catchup: float) -> CatchUp:
    """The catch-up rule (the module's docstring): of the ticks from `due` to `now`, start the
    oldest one at most ``max(catchup, ON_TIME)`` seconds old, skip the others, and go on from
    the first tick after `now`. A `due` still in the future changes nothing.

    Cost: one `rule.after` per tick from `due` to `now`, at most `MAX_COUNTED` of them: past
    that the rest are passed over in one jump each (to the window's first tick, then past
    `now`), uncounted."""
    if due > now:
        return CatchUp(start=None, skipped=0, counted_all=True, next=due)
    window_start = now - max(catchup, ON_TIME)
    start: float | None = None
    skipped = 0
    counted_all = True
    t: float | None = due
    while t is not None and t <= now:
        if start is None and t >= window_start:
            start = t
            t = rule.after(t)
            continue
        skipped += 1
        following = rule.after(t)
        if skipped >= MAX_COUNTED and following is not None and following <= now:
            jump = first_from(rule, window_start) if start is None else rule.after(now)
            if jump != following:
                counted_all = False
                following = jump
        t = following
    return CatchUp(start=start, skipped=skipped, counted_all=counted_all, next=t)


# ---------------------------------------------------------------------------------------------
# Overlap


@final
class Admit(enum.Enum):
    """What a tick (or a trigger) does, by the schedule's overlap rule (`admit`)."""

    START = "start"  # start its flow now
    SKIP = "skip"  # start nothing; count it as skipped
    QUEUE = "queue"  # keep it as the schedule's one waiting tick; start it when the flow ends


def admit(overlap: str, *, active: bool, waiting: bool) -> Admit:
    """The overlap decision for a tick of a schedule whose previous flow is `active` (not
    ended) and that has a tick `waiting` (``"queue"`` only) or not. A backfill asks nothing:
    it starts every tick it covers."""
    if not active or overlap == "allow":
        return Admit.START
    if overlap == "queue" and not waiting:
        return Admit.QUEUE
    return Admit.SKIP


# ---------------------------------------------------------------------------------------------
# The row and its transitions: what the store's one write per firing records (docs/adr/0144).


@final
@attrs.frozen(kw_only=True)
class Row:
    """A schedule's stored row (``flow_schedules``), as the transitions see it.

    `revision`: the compare-and-set token, +1 at every write; `next_tick`: the stored next tick
    (None: the rule has no more); `last_tick`, `last_flow`: the last tick started, regular or
    triggered, and its flow's id; `waiting_tick`: ``overlap="queue"``'s one tick waiting for
    `last_flow` to end; `missed`: ticks passed over after downtime; `skipped`: ticks passed over
    by the overlap rule."""

    name: str
    revision: int = 1
    next_tick: float | None
    last_tick: float | None = None
    last_flow: str | None = None
    waiting_tick: float | None = None
    paused: bool = False
    missed: int = 0
    skipped: int = 0


@final
@attrs.frozen(kw_only=True)
class Fired:
    """What one transition says: the `row` to write (None: nothing to write, the row is as it
    was), and the tick whose flow to start in the same write (`start`, None for none), with its
    flow id (`flow_id`). `counted_all`: False when a firing after a long downtime stopped
    counting the missed ticks at `MAX_COUNTED` (the row's `missed` is then a floor: say so)."""

    row: Row | None
    start: float | None = None
    counted_all: bool = True

    @property
    def flow_id(self) -> str | None:
        if self.start is None or self.row is None:
            return None
        return tick_id(self.row.name, self.start)


def declared(name: str, rule: Rule, now: float, stored: Row | None, *, changed: bool) -> Row | None:
    """The row after `open_engine(schedules=[...])` declares `name`: a new row whose next tick
    is the first after now; for a stored one, None if its definition is the same (nothing to
    write), else the same row (paused as it was) with its next tick from now."""
    if stored is None:
        return Row(name=name, next_tick=rule.after(now))
    if not changed:
        return None
    return attrs.evolve(stored, revision=stored.revision + 1, next_tick=rule.after(now))


def _settled(row: Row, last_active: bool) -> tuple[Row, float | None, bool]:
    """A waiting tick whose flow before it has ended starts first: (row, started, active)."""
    if row.waiting_tick is None or last_active:
        return row, None, last_active
    t = row.waiting_tick
    row = attrs.evolve(row, waiting_tick=None, last_tick=t, last_flow=tick_id(row.name, t))
    return row, t, True


def _admitted(
    row: Row, t: float, overlap: str, active: bool, started: float | None
) -> tuple[Row, float | None]:
    """Tick `t` by the overlap rule, after `_settled` (`started`: the waiting tick it started).
    One start per write: a tick admitted just after a waiting one started (``"allow"`` now,
    ``"queue"`` when it was stored) waits behind it."""
    decision = admit(overlap, active=active, waiting=row.waiting_tick is not None)
    if decision is Admit.START and started is None:
        return attrs.evolve(row, last_tick=t, last_flow=tick_id(row.name, t)), t
    if decision is not Admit.SKIP:
        return attrs.evolve(row, waiting_tick=t), started
    return attrs.evolve(row, skipped=row.skipped + 1), started


def fire(
    row: Row, rule: Rule, now: float, *, overlap: str, catchup: float, last_active: bool
) -> Fired:
    """The firing of a schedule whose stored next tick has come (the store holds its row; the
    revision it was read at is the write's compare-and-set). `last_active`: is `last_flow`
    still active. Nothing to write if it is paused or not due. Else: a waiting tick whose flow
    before it ended starts first; then `catch_up` picks the one tick this firing may start,
    `admit` starts, queues or skips it, the missed ones are counted, and the next tick is the
    first after now. At most one flow starts per firing: never a burst."""
    if row.paused or row.next_tick is None or row.next_tick > now:
        return Fired(row=None)
    caught = catch_up(rule, row.next_tick, now, catchup)
    new, started, active = _settled(row, last_active)
    if caught.start is not None:
        new, started = _admitted(new, caught.start, overlap, active, started)
    new = attrs.evolve(
        new, revision=row.revision + 1, next_tick=caught.next, missed=new.missed + caught.skipped
    )
    return Fired(row=new, start=started, counted_all=caught.counted_all)


def trigger(row: Row, now: float, *, overlap: str, last_active: bool) -> Fired:
    """`engine.trigger(name)`: a tick at the current whole second, paused or not, under the
    overlap rule; the next tick stays. A trigger within the same second as the last tick
    started names the same flow: nothing new to start (the id makes it so in the store)."""
    t = float(math.floor(now))
    new, started, active = _settled(row, last_active)
    if started is None and new.last_tick == t:
        return Fired(row=None)
    new, started = _admitted(new, t, overlap, active, started)
    return Fired(row=attrs.evolve(new, revision=row.revision + 1), start=started)


def ended(row: Row) -> Fired:
    """`last_flow` has ended: the waiting tick, if any, starts now (and nothing else)."""
    new, started, _active = _settled(row, False)
    if started is None:
        return Fired(row=None)
    return Fired(row=attrs.evolve(new, revision=row.revision + 1), start=started)


def pause(row: Row) -> Row | None:
    """`engine.pause(name)`: None if it is paused already."""
    return None if row.paused else attrs.evolve(row, revision=row.revision + 1, paused=True)


def unpause(row: Row, rule: Rule, now: float) -> Row | None:
    """`engine.unpause(name)`: its next tick from now on, the first after now: the ticks of the
    pause are neither started nor counted as missed (a pause is not downtime). None if it is
    not paused."""
    if not row.paused:
        return None
    return attrs.evolve(row, revision=row.revision + 1, paused=False, next_tick=rule.after(now))
