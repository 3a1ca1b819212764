"""Schedules through the engine's public API (SPEC 5.9, docs/adr/0153-0155), on SQLite under a
MockClock: a month of daily ticks; a restart on the same file (no tick started twice, none
lost, one closed over a tick starts it late); a frozen host and an engine closed 78 minutes
(DBOS #803: at most one tick, the rest missed and counted, whatever `catchup`); a wall clock
that jumps while the engine sleeps (the real clock: seen at the next tick's deadline);
Europe/Warsaw across both changes of 2026; the overlap rules end to end (a waiting tick
started by the end of the flow before it, or at the next open if that end was not seen);
trigger, pause, unpause, unschedule and backfill; the checks of `open_engine(schedules=...)`;
the same calls through `flow.connect`.

Each fails on an engine that gets its part wrong (checked by planting each): the month with a
timer that fires only at open; the restart with a declaration that sets the next tick from now
at every open (the tick closed over, 4:00, is lost); the jump and the downtime with a firing
that starts the oldest missed tick and goes on from the one after it (a burst, one a firing);
the queue test with no end hook (the waiting tick starts only at the next tick); the waiting
tick after a kill with an open that does not look for waiting ticks; the burst of three claims
with a slice whose flows are never made live (one of 1,001 ran)."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from ferry.flow._store import _schedules, _sql
from ferry.projected import SqliteStore
from tests import switches

BASE = 1_796_169_600.0  # 2026-12-02T00:00:00Z
MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0

report = flow.Plan("report", version=1)


@report.step
async def write(ctx: flow.Context) -> None:
    pass


slow = flow.Plan("slow", version=1)


@slow.step
async def wait_for_a_wake(ctx: flow.Context) -> flow.Outcome:
    return flow.park()


@slow.step
async def done(ctx: flow.Context) -> None:
    pass


class Ticks(flow.Observer):
    """Every `ScheduleTick` an engine tells."""

    def __init__(self) -> None:
        self.seen: list[flow.ScheduleTick] = []
        self.changed = trio.Event()

    def schedule_ticked(self, tick: flow.ScheduleTick) -> None:
        self.seen.append(tick)
        self.changed.set()
        self.changed = trio.Event()

    def started(self) -> int:
        return sum(t.started for t in self.seen)

    def missed(self) -> int:
        return sum(t.missed for t in self.seen)


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Wall:
    """The host's wall clock of a test: `base` at the trio time the test began, then trio's
    clock (a MockClock's), plus `jumped` (a step of the host's clock)."""

    def __init__(self, base: float) -> None:
        self.base = base - trio.current_time()
        self.jumped = 0.0

    def __call__(self) -> float:
        return self.base + trio.current_time() + self.jumped


@asynccontextmanager
async def engine_at(
    path: Path, wall: Callable[[], float], schedules: Sequence[flow.Schedule], **options: Any
) -> AsyncIterator[flow.Engine]:
    plans = options.pop("plans", [report, slow])
    async with switches.open_engine(
        str(path), plans, schedules=schedules, wall_clock=wall, retain=None, **options
    ) as engine:
        yield engine


async def stored(path: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every flow of the file: id -> (state, data)."""
    async with SqliteStore(str(path)) as st:
        rows = await st.transact(
            lambda tx: tx.execute(f"SELECT flow_id, state, data FROM {_sql.FLOWS} ORDER BY 1")
        )
    return {r[0]: (r[1], json.loads(r[2])) for r in rows}


async def row(path: Path, name: str) -> Any:
    async with SqliteStore(str(path)) as st:
        got = await st.transact(lambda tx: _schedules.stored(tx, name))
    assert got is not None
    return got.row


# ----------------------------------------------------------------------------- the timer


async def test_a_month_of_daily_ticks_runs_each_tick_once_in_virtual_time(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    daily = flow.Schedule("nightly", report, cron="0 3 * * *", data={"kind": "daily"})
    db = tmp_path / "app.db"
    began = time.monotonic()
    async with engine_at(db, Wall(BASE), [daily]) as engine:
        await trio.sleep(31 * DAY)
        assert engine.statistics().completed == 31
    assert time.monotonic() - began < 5
    ticks = [BASE + d * DAY + 3 * HOUR for d in range(31)]
    flows = await stored(db)
    assert list(flows) == [f"nightly@{iso(t)}" for t in ticks]
    for t in ticks:
        state, data = flows[f"nightly@{iso(t)}"]
        assert (state, data) == ("COMPLETED", {"kind": "daily", "scheduled_at": iso(t)})
    got = await row(db, "nightly")
    assert (got.next_tick, got.last_tick, got.missed, got.skipped) == (
        BASE + 31 * DAY + 3 * HOUR,
        ticks[-1],
        0,
        0,
    )


async def test_a_restart_on_the_same_file_starts_no_tick_twice_and_loses_none(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Open 3.5 minutes, closed over the tick at 4:00, open again at 4:10 (that tick is 10 s
    late: on time, it starts), closed and opened again at once, on to 7:30."""
    every = flow.Schedule("minutely", report, cron="* * * * *")
    db = tmp_path / "app.db"
    wall = Wall(BASE)
    ticks = Ticks()
    async with engine_at(db, wall, [every], observers=[ticks]):
        await trio.sleep(3.5 * MINUTE)
    await trio.sleep(40)
    async with engine_at(db, wall, [every], observers=[ticks]):
        await trio.sleep(MINUTE)
    async with engine_at(db, wall, [every], observers=[ticks]):
        await trio.sleep(2.5 * MINUTE)
    assert list(await stored(db)) == [f"minutely@{iso(BASE + m * MINUTE)}" for m in range(1, 8)]
    assert ticks.started() == 7, "a tick started again after a restart"
    got = await row(db, "minutely")
    assert (got.missed, got.skipped, got.next_tick) == (0, 0, BASE + 8 * MINUTE)


async def test_a_burst_of_several_claims_starts_every_tick_once_in_slices(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,001 schedules due on one minute are three claims; with a slice of one claim (the
    engine makes a round's flows live together, at most `_TOGETHER` ticks at a time) every
    tick's flow still runs once, in the slices and at the round's end."""
    from ferry.flow._runtime import _schedule_loop

    monkeypatch.setattr(_schedule_loop, "_TOGETHER", _schedules.CLAIM)
    many = [flow.Schedule(f"s{i}", report, cron="0 3 * * *") for i in range(1001)]
    db = tmp_path / "app.db"
    ticks = Ticks()
    async with engine_at(db, Wall(BASE), many, observers=[ticks]) as engine:
        await trio.sleep(3 * HOUR + 1)
        assert engine.statistics().completed == 1001
    assert ticks.started() == 1001
    flows = await stored(db)
    assert sorted(flows) == sorted(f"s{i}@{iso(BASE + 3 * HOUR)}" for i in range(1001))
    assert {state for state, _data in flows.values()} == {"COMPLETED"}


@pytest.mark.parametrize("catchup", [0, 3600])
async def test_a_frozen_host_starts_at_most_one_missed_tick(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, catchup: float
) -> None:
    """DBOS #803: the loop does not run for 78 minutes (trio's clock jumps past every
    deadline at once): one tick starts, the others are missed and counted, whatever
    `catchup`; then the schedule is on its times again."""
    every = flow.Schedule("minutely", report, cron="* * * * *", catchup=catchup)
    db = tmp_path / "app.db"
    ticks = Ticks()
    async with engine_at(db, Wall(BASE), [every], observers=[ticks]):
        await trio.sleep(2.5 * MINUTE)
        assert ticks.started() == 2
        autojump_clock.jump(78 * MINUTE)  # now 80:30
        await trio.sleep(1)
        assert ticks.started() == 3, "a burst of missed ticks, or none"
        assert ticks.missed() == 77
        await trio.sleep(MINUTE)
        assert ticks.started() == 4
    flows = list(await stored(db))
    late = 80 if catchup == 0 else 21  # the oldest tick at most max(catchup, 60 s) late
    minutes = [1, 2, late, 81]
    assert flows == sorted(f"minutely@{iso(BASE + m * MINUTE)}" for m in minutes)
    assert (await row(db, "minutely")).missed == 77


@pytest.mark.parametrize(("catchup", "late"), [(0, None), (600, 69), (7200, 1)])
async def test_an_engine_closed_78_minutes_starts_at_most_one_tick_at_open(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, catchup: float, late: int | None
) -> None:
    """Closed from 0:30 to 78:30 (a deploy, a laptop asleep with the engine): with catchup 0
    the tick at 78:00 is 30 s late, on time (at most 60 s), and starts; with catchup=600 the
    oldest within ten minutes (69:00); with two hours, the first one missed (1:00). One start,
    the rest missed."""
    every = flow.Schedule("minutely", report, cron="* * * * *", catchup=catchup)
    db = tmp_path / "app.db"
    wall = Wall(BASE)
    ticks = Ticks()
    async with engine_at(db, wall, [every], observers=[ticks]):
        await trio.sleep(30)
    await trio.sleep(78 * MINUTE)
    async with engine_at(db, wall, [every], observers=[ticks]):
        await trio.sleep(1)
    assert ticks.started() == 1
    assert ticks.missed() == 77
    minute = 78 if late is None else late
    assert list(await stored(db)) == [f"minutely@{iso(BASE + minute * MINUTE)}"]


async def test_a_wall_clock_that_jumps_while_the_engine_sleeps_starts_one_tick(
    tmp_path: Path,
) -> None:
    """The real clock: trio's stands still while the host's wall clock steps 78 minutes (a
    laptop asleep). The engine sleeps until the next tick's deadline (a second away) and then
    sees the wall clock: one tick starts, the others are missed."""
    offset = [BASE + MINUTE - 1.0 - time.time()]
    ticks = Ticks()
    every = flow.Schedule("minutely", report, cron="* * * * *")
    async with switches.open_engine(
        str(tmp_path / "app.db"),
        [report],
        schedules=[every],
        wall_clock=lambda: time.time() + offset[0],
        observers=[ticks],
        retain=None,
    ):
        await trio.testing.wait_all_tasks_blocked(0.05)  # the engine sleeps till the tick
        assert not ticks.seen
        offset[0] += 78 * MINUTE
        with trio.fail_after(10):
            while not ticks.started():
                await ticks.changed.wait()
    assert ticks.started() == 1
    assert ticks.missed() in (77, 78)


# -------------------------------------------------------------------------- time zones


def utc(text: str) -> float:
    return datetime.datetime.fromisoformat(text).replace(tzinfo=datetime.UTC).timestamp()


@pytest.mark.parametrize(
    ("start", "nightly"),
    [
        # 29 March: 02:00 -> 03:00. No 02:30 that night: the nightly tick runs at 03:00 CEST.
        ("2026-03-28T22:00:00", ["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]),
        # 25 October: 03:00 -> 02:00. Two 02:30s that night: the nightly tick runs at the first.
        ("2026-10-24T22:00:00", ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]),
    ],
)
async def test_a_warsaw_schedule_ticks_at_local_time_across_the_dst_change(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    start: str,
    nightly: list[str],
) -> None:
    """`30 2 * * *` in Europe/Warsaw ticks once a night at 02:30 local time (at 03:00 on the
    night without 02:30, at the first of the two 02:30s); `30 * * * *` ticks every 3600 s of
    real time through both changes (no tick in the gap, two in the repeated hour)."""
    zone = "Europe/Warsaw"
    schedules = [
        flow.Schedule("nightly", report, cron="30 2 * * *", timezone=zone),
        flow.Schedule("hourly", report, cron="30 * * * *", timezone=zone),
    ]
    db = tmp_path / "app.db"
    async with engine_at(db, Wall(utc(start)), schedules):
        await trio.sleep(30 * HOUR)
    flows = await stored(db)
    assert sorted(f for f in flows if f.startswith("nightly@")) == [f"nightly@{t}" for t in nightly]
    hourly = [utc(start) + 30 * MINUTE + h * HOUR for h in range(30)]
    assert sorted(f for f in flows if f.startswith("hourly@")) == [
        f"hourly@{iso(t)}" for t in hourly
    ]


# ------------------------------------------------------------------------------- overlap


@pytest.mark.parametrize("overlap", ["skip", "queue", "allow"])
async def test_the_overlap_rule_decides_a_tick_while_the_last_flow_runs(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, overlap: str
) -> None:
    """Ticks at 1:00, 2:00 and 3:00 of a flow that parks until woken: ``"skip"`` starts only
    the first (two skipped); ``"queue"`` keeps 2:00 waiting (3:00 skipped) and starts it the
    moment the first flow ends (woken at 3:30); ``"allow"`` starts all three."""
    every = flow.Schedule("minutely", slow, cron="* * * * *", overlap=overlap)
    db = tmp_path / "app.db"
    first = f"minutely@{iso(BASE + MINUTE)}"
    second = f"minutely@{iso(BASE + 2 * MINUTE)}"
    async with engine_at(db, Wall(BASE), [every]) as engine:
        await trio.sleep(3.5 * MINUTE)
        await engine.pause("minutely")
        assert await engine.wake(first) is flow.Delivery.RESUMED
        assert (await engine.wait(first, timeout=10)).state is flow.State.COMPLETED
        await trio.testing.wait_all_tasks_blocked()
        second_now = await engine.get(second)
    names = list(await stored(db))
    got = await row(db, "minutely")
    if overlap == "skip":
        assert names == [first] and got.skipped == 2 and second_now is None
    elif overlap == "queue":
        assert names == [first, second] and got.skipped == 1 and got.waiting_tick is None
        assert second_now is not None and second_now.state is flow.State.PARKED
    else:
        assert len(names) == 3 and got.skipped == 0


# ------------------------------------------------------------------------------ the calls


async def test_trigger_pause_unpause_backfill_and_unschedule(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    hourly = flow.Schedule("hourly", report, cron="0 * * * *", data={"n": 1})
    db = tmp_path / "app.db"
    ticks = Ticks()
    async with engine_at(db, Wall(BASE + 10 * MINUTE), [hourly], observers=[ticks]) as engine:
        fid = await engine.trigger("hourly")
        assert fid == f"hourly@{iso(BASE + 10 * MINUTE)}"
        assert await engine.trigger("hourly") == fid, "the same second: the same flow"
        snap = await engine.wait(fid, timeout=10)
        assert snap.data == {"n": 1, "scheduled_at": iso(BASE + 10 * MINUTE)}
        await engine.pause("hourly")
        await engine.pause("hourly")  # paused already: no change
        await trio.sleep(2 * HOUR)  # 1:00 and 2:00 pass while paused
        paused = await engine.trigger("hourly")  # a trigger runs while paused
        assert paused == f"hourly@{iso(BASE + 130 * MINUTE)}"
        await engine.unpause("hourly")
        await trio.sleep(HOUR)  # 3:00 ticks
        started = await engine.backfill("hourly", BASE, BASE + 3 * HOUR)
        assert started == 3, "0:00, 1:00, 2:00 (3:00 ran)"
        assert await engine.backfill("hourly", BASE, BASE + 3 * HOUR) == 0
        await engine.unschedule("hourly")
        with pytest.raises(flow.UnknownSchedule, match="'hourly'"):
            await engine.unschedule("hourly")
        for call in (engine.trigger, engine.pause, engine.unpause):
            with pytest.raises(flow.UnknownSchedule):
                await call("hourly")
        with pytest.raises(LookupError):
            await engine.backfill("hourly", BASE, BASE + HOUR)
        await trio.sleep(2 * HOUR)  # no more ticks
    hours = [0, 1, 2, 3]
    expected = {f"hourly@{iso(BASE + h * HOUR)}" for h in hours} | {fid, paused}
    assert set(await stored(db)) == expected, "a paused or unscheduled schedule ticked"
    assert ticks.missed() == 0, "the ticks of a pause are not missed"
    assert [t.how for t in ticks.seen] == ["trigger", "trigger", "tick", "backfill"]


async def test_bad_calls_are_refused_at_the_call(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    hourly = flow.Schedule("hourly", report, cron="0 * * * *")
    async with engine_at(tmp_path / "app.db", Wall(BASE), [hourly]) as engine:
        with pytest.raises(TypeError, match="name"):
            await engine.trigger(3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="'@'"):
            await engine.pause("a@b")
        with pytest.raises(TypeError, match="start"):
            await engine.backfill("hourly", "yesterday", BASE)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="after its end"):
            await engine.backfill("hourly", BASE + 10, BASE)
        with pytest.raises(ValueError, match="more than 10000"):
            await engine.backfill("hourly", 0, BASE)
        with pytest.raises(ValueError, match="finite"):
            await engine.backfill("hourly", float("nan"), BASE)


async def test_open_engine_checks_its_schedules_before_it_opens(tmp_path: Path) -> None:
    other = flow.Plan("other", version=1)

    @other.step
    async def one(ctx: flow.Context) -> None:
        pass

    twin = flow.Plan("report", version=1)
    twin.step(write)
    db = str(tmp_path / "app.db")
    every = flow.Schedule("every", report, cron="* * * * *")
    cases: list[tuple[Any, type[Exception], str]] = [
        (every, TypeError, "a list of flow.Schedule"),
        (["every"], TypeError, r"schedules\[0\]"),
        ([every, flow.Schedule("every", report, cron="0 * * * *")], ValueError, "two schedules"),
        ([flow.Schedule("o", other, cron="* * * * *")], flow.UnknownPlan, "'other'"),
        ([flow.Schedule("t", twin, cron="* * * * *")], flow.UnknownPlan, "not a plan given"),
    ]
    for given, error, words in cases:
        with pytest.raises(error, match=words):
            async with flow.open_engine(db, [report], schedules=given):
                pass
    assert not (tmp_path / "app.db").exists(), "nothing is opened before the checks"
    async with flow.open_engine(db, [report]):
        pass
    with pytest.raises(ValueError, match="operator's engine"):
        async with flow.open_engine(db, [report], serve=False, schedules=[every]):
            pass


async def test_a_client_of_another_process_triggers_pauses_and_backfills(tmp_path: Path) -> None:
    """`flow.connect` asks the engine serving the file (its requests table, the watch thread
    that sees the file change), as another process would; with no engine serving, the client
    applies the call itself and the next engine runs what it started."""
    hourly = flow.Schedule("hourly", report, cron="0 * * * *")
    db = str(tmp_path / "app.db")
    with trio.fail_after(30):
        async with flow.open_engine(db, [report], schedules=[hourly], retain=None) as engine:
            async with flow.connect(db) as client:
                fid = await client.trigger("hourly")
                assert fid is not None and fid.startswith("hourly@")
                assert client.last is not None and client.last.served
                await client.pause("hourly")
                assert await client.backfill("hourly", BASE, BASE + 2 * HOUR) == 3
                with pytest.raises(flow.UnknownSchedule):
                    await client.unpause("nope")
                await engine.wait(f"hourly@{iso(BASE + 2 * HOUR)}", timeout=10)
        async with flow.connect(db) as client:  # no engine serves the file
            await client.unpause("hourly")
            assert client.last is not None and not client.last.served
            assert await client.backfill("hourly", BASE + 3 * HOUR, BASE + 3 * HOUR) == 1
        async with flow.open_engine(db, [report], schedules=[hourly], retain=None) as engine:
            done = await engine.wait(f"hourly@{iso(BASE + 3 * HOUR)}", timeout=10)
            assert done.state is flow.State.COMPLETED
    assert not (await row(tmp_path / "app.db", "hourly")).paused


async def test_a_waiting_tick_whose_flow_ended_unseen_starts_at_the_next_open(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A SIGKILL between a flow's end and its waiting tick's start (written here as the end
    alone, in the file): the next engine to open starts the waiting tick."""
    every = flow.Schedule("minutely", slow, cron="* * * * *", overlap="queue")
    db = tmp_path / "app.db"
    wall = Wall(BASE)
    first = f"minutely@{iso(BASE + MINUTE)}"
    second = f"minutely@{iso(BASE + 2 * MINUTE)}"
    async with engine_at(db, wall, [every]) as engine:
        await trio.sleep(2.5 * MINUTE)
        await engine.pause("minutely")
    assert (await row(db, "minutely")).waiting_tick == BASE + 2 * MINUTE
    async with SqliteStore(str(db)) as st:
        await st.transact(
            lambda tx: tx.execute(
                f"UPDATE {_sql.FLOWS} SET state = 'COMPLETED' WHERE flow_id = ?", (first,)
            )
        )
    async with engine_at(db, wall, [every]) as engine:
        await trio.testing.wait_all_tasks_blocked()
        snap = await engine.get(second)
    assert snap is not None and snap.state is flow.State.PARKED
    assert (await row(db, "minutely")).waiting_tick is None
