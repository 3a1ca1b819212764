"""A schedule's ticks (SPEC 5.9): the next tick after a time in the schedule's time zone across
both daylight saving changes of 2026 in Europe/Warsaw (a month of daily ticks over each, a day
with no 02:30 and a day with two), every-15-minutes and hourly schedules in real time through
them, tick ids; the catch-up rule after downtime (a wall clock that jumps 78 minutes starts at
most one tick; a year closed costs a bounded catch-up) and the overlap decision.

The catch-up and overlap tests use a fixed-interval rule written here, not the cron library:
the model's rules hold for any `Rule`. Nothing here needs an engine, so a month of daily ticks
is a loop of 31 calls (the engine under `MockClock` comes with the firing)."""

from __future__ import annotations

import datetime
import itertools
import math
from zoneinfo import ZoneInfo

import cronsim
import pytest

from ferry.flow._model import _schedule
from ferry.flow._model._schedule import Admit, admit, catch_up
from ferry.flow._store._cron import CronRule

WARSAW = ZoneInfo("Europe/Warsaw")
UTC = datetime.UTC


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:
    return datetime.datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp()


def local(t: float) -> str:
    """`t` as Warsaw's wall clock with its offset: ``03-29 03:00+0200``."""
    return datetime.datetime.fromtimestamp(t, WARSAW).strftime("%m-%d %H:%M%z")


def chain(rule: CronRule, after: float, n: int) -> list[float]:
    found = []
    for _ in range(n):
        t = rule.after(after)
        assert t is not None
        found.append(t)
        after = t
    return found


# --- Time zones and daylight saving time ------------------------------------------------------


@pytest.mark.parametrize(
    ("month", "change", "before", "after"),
    [
        (3, 29, datetime.timedelta(hours=1), datetime.timedelta(hours=2)),  # CET -> CEST
        (10, 25, datetime.timedelta(hours=2), datetime.timedelta(hours=1)),  # CEST -> CET
    ],
)
def test_a_month_of_daily_ticks_is_at_local_time_across_a_change(
    month: int, change: int, before: datetime.timedelta, after: datetime.timedelta
) -> None:
    """03:00 in Warsaw on each of the 31 days: 02:00 UTC in winter time (UTC+1), 01:00 UTC in
    summer time (UTC+2), the new offset from the day of the change on."""
    rule = CronRule("0 3 * * *", WARSAW)
    ticks = chain(rule, utc(2026, month, 1) - 3 * 3600, 31)
    assert [local(t)[6:11] for t in ticks] == ["03:00"] * 31
    days = [datetime.datetime.fromtimestamp(t, UTC) for t in ticks]
    assert [d.day for d in days] == list(range(1, 32))
    offsets = [datetime.timedelta(hours=3) - datetime.timedelta(hours=d.hour) for d in days]
    assert offsets == [before] * (change - 1) + [after] * (31 - change + 1)


def test_a_day_with_no_0230_ticks_once_at_the_end_of_the_gap() -> None:
    """29 March 2026: Warsaw's clocks go from 02:00 to 03:00. A daily 02:30 runs that day, at
    03:00 summer time (01:00 UTC), and at 02:30 on the days around it."""
    rule = CronRule("30 2 * * *", WARSAW)
    ticks = chain(rule, utc(2026, 3, 27, 12), 3)
    assert [local(t) for t in ticks] == ["03-28 02:30+0100", "03-29 03:00+0200", "03-30 02:30+0200"]
    assert ticks[1] == utc(2026, 3, 29, 1)


def test_a_day_with_two_0230s_ticks_once_at_the_first() -> None:
    """25 October 2026: Warsaw's clocks go from 03:00 back to 02:00, so 02:30 comes twice
    (00:30 and 01:30 UTC). A daily 02:30 runs once, at the first."""
    rule = CronRule("30 2 * * *", WARSAW)
    ticks = chain(rule, utc(2026, 10, 23, 12), 3)
    assert ticks == [utc(2026, 10, 24, 0, 30), utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]
    assert [local(t) for t in ticks] == ["10-24 02:30+0200", "10-25 02:30+0200", "10-26 02:30+0100"]


def test_from_inside_the_repeated_hour_the_next_tick_is_never_before_the_time_asked() -> None:
    """From 01:15 UTC on 25 October (02:15 the second time) the library, asked in local time,
    answers 02:30 the first time, 45 minutes before: the rule steps over it. From every five
    minutes of both change days, the next tick is after the time asked and no later than the
    first tick after it."""
    for expr in ("30 2 * * *", "0,30 2 * * *", "*/30 2 * * *", "59 2 * * *", "0 3 * * *"):
        rule = CronRule(expr, WARSAW)
        for day in (utc(2026, 3, 28, 20), utc(2026, 10, 24, 20)):
            all_ticks = chain(rule, day - 86400, 12)
            for k in range(12 * 12):
                t = day + 300 * k
                expected = next(x for x in all_ticks if x > t)
                assert rule.after(t) == expected, (expr, local(t))
    assert CronRule("30 2 * * *", WARSAW).after(utc(2026, 10, 25, 1, 15)) == utc(
        2026, 10, 26, 1, 30
    )


def _matches(expr: str, wall: datetime.datetime) -> bool:
    """Does the naive wall-clock minute `wall` match `expr`? (The library on naive times: the
    calendar alone, no time zone.)"""
    return cronsim.CronSim(expr, wall - datetime.timedelta(seconds=1)).__next__() == wall


def _oracle(expr: str, lo: float, hi: float) -> list[float]:
    """Every tick in [lo, hi) by Debian's rule, walked a minute at a time with zoneinfo: a
    fixed time of day once a day (a missing one at the end of its gap, a repeated one at its
    first pass), anything else at each real minute whose local time matches."""
    fields = expr.split()
    fixed = not fields[0].startswith("*") and not fields[1].startswith("*")
    minute = datetime.timedelta(minutes=1)
    found: set[float] = set()
    if not fixed:
        t = lo
        while t < hi:
            wall = datetime.datetime.fromtimestamp(t, WARSAW).replace(tzinfo=None)
            if _matches(expr, wall):
                found.add(t)
            t += 60
        return sorted(found)
    wall = datetime.datetime.fromtimestamp(lo, WARSAW).replace(tzinfo=None, minute=0)
    end = datetime.datetime.fromtimestamp(hi, WARSAW).replace(tzinfo=None)
    while wall < end:
        if _matches(expr, wall):
            real = wall
            while (
                real.replace(tzinfo=WARSAW).astimezone(UTC).astimezone(WARSAW).replace(tzinfo=None)
                != real
            ):  # a local time that does not exist: the first one after the gap
                real += minute
            t = real.replace(tzinfo=WARSAW, fold=0).timestamp()
            if lo <= t < hi:
                found.add(t)
        wall += minute
    return sorted(found)


@pytest.mark.parametrize(
    "expr", ["30 2 * * *", "0,30 2 * * *", "15 1-3 * * *", "*/20 * * * *", "30 * * * *"]
)
def test_the_next_tick_is_the_one_a_minute_by_minute_walk_finds(expr: str) -> None:
    """Against an oracle that knows nothing of the library's handling of time zones: from every
    10 minutes of both change nights, the next tick is the oracle's."""
    rule = CronRule(expr, WARSAW)
    for night in (utc(2026, 3, 28, 22), utc(2026, 10, 24, 21)):
        ticks = _oracle(expr, night - 3600, night + 30 * 3600)
        for k in range(6 * 8):
            t = night + 600 * k
            assert rule.after(t) == next(x for x in ticks if x > t), (expr, local(t))


@pytest.mark.parametrize("day", [(2026, 3, 28, 20), (2026, 10, 24, 20)])
def test_every_15_minutes_ticks_every_900_seconds_through_a_change(
    day: tuple[int, int, int, int],
) -> None:
    """An expression with a ``*`` minute or hour ticks in real time: no gap, no repeat."""
    rule = CronRule("*/15 * * * *", WARSAW)
    ticks = chain(rule, utc(*day), 4 * 12)
    assert {b - a for a, b in itertools.pairwise(ticks)} == {900.0}


def test_an_hourly_schedule_has_no_tick_in_the_gap_and_two_in_the_repeated_hour() -> None:
    rule = CronRule("30 * * * *", WARSAW)
    spring = chain(rule, utc(2026, 3, 28, 23), 4)
    assert [local(t) for t in spring] == [
        "03-29 00:30+0100",
        "03-29 01:30+0100",
        "03-29 03:30+0200",
        "03-29 04:30+0200",
    ]
    autumn = chain(rule, utc(2026, 10, 24, 22), 4)
    assert [local(t) for t in autumn] == [
        "10-25 00:30+0200",
        "10-25 01:30+0200",
        "10-25 02:30+0200",
        "10-25 02:30+0100",
    ]
    assert {b - a for a, b in itertools.pairwise(autumn)} == {3600.0}


def test_a_utc_schedule_ticks_at_utc_and_a_tick_is_a_whole_second_after_the_time() -> None:
    rule = CronRule("0 3 * * *", _schedule.check_timezone("UTC"))
    assert rule.after(utc(2026, 3, 29)) == utc(2026, 3, 29, 3)
    assert rule.after(utc(2026, 3, 29, 3)) == utc(2026, 3, 30, 3)  # strictly after
    assert rule.after(utc(2026, 3, 29, 3) - 0.25) == utc(2026, 3, 29, 3)
    every = CronRule("* * * * *", _schedule.check_timezone("UTC"))
    assert every.after(utc(2026, 3, 29, 3) + 0.5) == utc(2026, 3, 29, 3, 1)


def test_tick_ids_are_the_name_and_the_tick_in_utc() -> None:
    rule = CronRule("0 3 * * *", WARSAW)
    ticks = chain(rule, utc(2026, 10, 24), 2)
    assert [_schedule.tick_id("nightly-report", t) for t in ticks] == [
        "nightly-report@2026-10-24T01:00:00Z",
        "nightly-report@2026-10-25T02:00:00Z",
    ]
    assert _schedule.tick_data('{"kind":"daily"}', ticks[1]) == {
        "kind": "daily",
        "scheduled_at": "2026-10-25T02:00:00Z",
    }


# --- Backfill ---------------------------------------------------------------------------------


def test_backfill_covers_every_tick_between_its_ends_inclusive() -> None:
    rule = CronRule("0 * * * *", _schedule.check_timezone("UTC"))
    got = _schedule.backfill_ticks(rule, utc(2026, 12, 1), utc(2026, 12, 2))
    assert got == [utc(2026, 12, 1) + 3600 * h for h in range(25)]
    assert _schedule.backfill_ticks(rule, utc(2026, 12, 1, 0, 0, 1), utc(2026, 12, 1, 1)) == [
        utc(2026, 12, 1, 1)
    ]
    daily = CronRule("30 2 * * *", WARSAW)  # one tick on the day with two 02:30s
    assert _schedule.backfill_ticks(daily, utc(2026, 10, 24, 23), utc(2026, 10, 25, 23)) == [
        utc(2026, 10, 25, 0, 30)
    ]


def test_a_backfill_too_long_or_backwards_or_not_finite_is_refused() -> None:
    rule = CronRule("* * * * *", _schedule.check_timezone("UTC"))
    with pytest.raises(ValueError, match="more than 100 ticks"):
        _schedule.backfill_ticks(rule, 0, 101 * 60, limit=100)
    assert len(_schedule.backfill_ticks(rule, 60, 100 * 60, limit=100)) == 100
    with pytest.raises(ValueError, match="after its end"):
        _schedule.backfill_ticks(rule, 120, 60)
    with pytest.raises(ValueError, match="end must be a finite time"):
        _schedule.backfill_ticks(rule, 0, math.inf)


# --- Catch-up ---------------------------------------------------------------------------------


class Every:
    """A rule of one tick every `seconds` seconds from the epoch, counting its calls."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0

    def after(self, t: float) -> float | None:
        self.calls += 1
        return float((math.floor(t / self.seconds) + 1) * self.seconds)


T0 = utc(2026, 12, 2)  # a whole minute, hour and day


def test_a_tick_come_on_time_is_started_and_the_next_is_the_following() -> None:
    got = catch_up(Every(60), T0, T0 + 0.2, catchup=0)
    assert got == _schedule.CatchUp(start=T0, skipped=0, counted_all=True, next=T0 + 60)
    late = catch_up(Every(86400), T0, T0 + 45, catchup=0)  # a busy engine: on time still
    assert (late.start, late.skipped, late.next) == (T0, 0, T0 + 86400)


def test_a_tick_not_yet_due_changes_nothing() -> None:
    assert catch_up(Every(60), T0, T0 - 1, catchup=0) == _schedule.CatchUp(
        start=None, skipped=0, counted_all=True, next=T0
    )


@pytest.mark.parametrize(
    ("catchup", "started"), [(0, T0 + 78 * 60), (3600, T0 + 19 * 60), (10 * 3600, T0)]
)
def test_a_wall_clock_that_jumps_78_minutes_starts_at_most_one_tick(
    catchup: float, started: float
) -> None:
    """An every-minute schedule whose engine's clock jumps 78 minutes and 20 seconds (a host
    asleep): 79 ticks are due. One starts, the oldest within `catchup` (or within a minute,
    on time, when `catchup` is 0); the other 78 are skipped and counted, and the next tick is
    the first one after now: the engine's next look starts nothing more."""
    now = T0 + 78 * 60 + 20
    rule = Every(60)
    got = catch_up(rule, T0, now, catchup=catchup)
    assert (got.start, got.skipped, got.counted_all, got.next) == (started, 78, True, T0 + 79 * 60)
    assert got.next is not None
    again = catch_up(rule, got.next, now, catchup=catchup)  # the engine looks again at once
    assert again.start is None and again.skipped == 0


def test_an_engine_that_wakes_on_and_off_time_starts_at_most_one_tick_a_wake() -> None:
    """A day of an every-minute schedule driven the way an engine would: wake at the stored next
    tick (late by 0-59 s, or by a frozen hour now and then), fire what `catch_up` says, store
    its next. Never two starts at one wake, every start within the window, every tick either
    started or counted once."""
    rule = Every(60)
    due: float | None = T0
    now = T0
    started: list[float] = []
    skipped = 0
    wakes = 0
    while due is not None and due < T0 + 86400:
        wakes += 1
        lag = 3600 + 7 if wakes % 97 == 0 else (wakes * 37) % 60  # a frozen hour, or seconds
        now = max(now, due + lag)
        got = catch_up(rule, due, now, catchup=0)
        assert got.next is not None and got.next > now
        if got.start is not None:
            assert now - got.start <= _schedule.ON_TIME
            started.append(got.start)
        skipped += got.skipped
        due = got.next
    assert started == sorted(set(started))
    assert due is not None
    assert len(started) + skipped == (due - T0) / 60  # each tick once, started or skipped
    assert skipped > 0 and len(started) < wakes + 1


def test_a_daily_tick_missed_within_catchup_starts_late_and_one_missed_longer_is_skipped() -> None:
    rule = Every(86400)
    within = catch_up(rule, T0, T0 + 1800, catchup=3600)
    assert (within.start, within.skipped, within.next) == (T0, 0, T0 + 86400)
    beyond = catch_up(rule, T0, T0 + 7200, catchup=3600)
    assert (beyond.start, beyond.skipped, beyond.next) == (None, 1, T0 + 86400)
    week = catch_up(rule, T0, T0 + 7 * 86400 + 10, catchup=0)  # a laptop asleep a week
    assert (week.start, week.skipped, week.next) == (T0 + 7 * 86400, 7, T0 + 8 * 86400)


def test_a_year_closed_costs_a_bounded_catch_up_and_says_the_count_stopped() -> None:
    """An every-minute schedule after a year closed: 525,600 missed ticks are not walked one by
    one; the count stops at `MAX_COUNTED` and says so."""
    rule = Every(60)
    now = T0 + 365 * 86400 + 5
    got = catch_up(rule, T0, now, catchup=0)
    assert got.start == T0 + 365 * 86400
    assert got.next == T0 + 365 * 86400 + 60
    assert not got.counted_all
    assert got.skipped == _schedule.MAX_COUNTED
    assert rule.calls <= _schedule.MAX_COUNTED + 5
    wide = Every(60)  # the window itself holds more than MAX_COUNTED ticks
    got = catch_up(wide, T0, now, catchup=30 * 86400)
    assert got.start == T0 + 335 * 86400 + 60  # the window's first tick
    assert got.next == T0 + 365 * 86400 + 60
    assert not got.counted_all and wide.calls <= 2 * _schedule.MAX_COUNTED + 5


def test_missed_ticks_below_the_limit_are_counted_exactly() -> None:
    got = catch_up(Every(60), T0, T0 + 500 * 60 + 1, catchup=0)
    assert (got.start, got.skipped, got.counted_all) == (T0 + 500 * 60, 500, True)


def test_catch_up_with_the_cron_rule_across_the_change_to_summer_time() -> None:
    """An engine closed over the night of 29 March: the daily 02:30, due at 03:00 summer time,
    is started late within an hour's catchup, and the next is 02:30 on 30 March."""
    rule = CronRule("30 2 * * *", WARSAW)
    due = rule.after(utc(2026, 3, 28, 12))
    assert due is not None and due == utc(2026, 3, 29, 1)
    got = catch_up(rule, due, utc(2026, 3, 29, 1, 40), catchup=3600)
    assert (got.start, got.skipped, got.next) == (due, 0, utc(2026, 3, 30, 0, 30))


# --- Overlap ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overlap", "active", "waiting", "decision"),
    [
        ("skip", False, False, Admit.START),
        ("skip", True, False, Admit.SKIP),
        ("allow", False, False, Admit.START),
        ("allow", True, False, Admit.START),
        ("allow", True, True, Admit.START),
        ("queue", False, False, Admit.START),
        ("queue", True, False, Admit.QUEUE),
        ("queue", True, True, Admit.SKIP),  # one waits at most: the older one
    ],
)
def test_the_overlap_decision(overlap: str, active: bool, waiting: bool, decision: Admit) -> None:
    assert admit(overlap, active=active, waiting=waiting) is decision
