"""The fleet at its edges, in one process: names and leases checked in the user's
words, a loop that wakes after its lease lapsed, statistics, rolling deploys, the warnings.

Most tests run the fleet's code on one SQLite file under `MockClock(autojump_threshold=0)`, as
tests/flow/test_leases.py does (its helpers are shared). A *frozen loop* is the mock clock jumped
from the test task (`MockClock.jump`): no task of the run gets a turn while time moves on, as
when a step's synchronous code holds the loop or the process is stopped. The PostgreSQL cases
(the store's own errors) run on the suite's server. The process tests (a real frozen loop, a
SIGSTOP, the same owner name in two processes, connections killed) are in tests/fleet.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

import ferry
from ferry import flow
from ferry.flow._store import _store
from ferry.projected import PostgresStore
from tests import pg

from ._helpers import PlantedStore
from .test_leases import LEASE, Log, fleet_engine, path, row, saga, until

__all__ = ["path"]  # the fixture, shared

# ------------------------------------------------------------------ names and leases, in words


@pytest.mark.parametrize(
    ("owner", "words"),
    [
        ("", "must not be empty"),
        ("a\x00b", "printable"),
        ("eu-1\ud800", "printable"),
        ("x" * 201, "at most 200 characters"),
        (5, "must be a str"),
    ],
    ids=["empty", "nul", "lone-surrogate", "201-chars", "not-a-str"],
)
async def test_an_owner_name_the_store_cannot_hold_is_refused_in_the_users_words(
    path: str, owner: Any, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        async with flow.open_engine(path, [saga([])], owner=owner):
            pytest.fail("opened")  # pragma: no cover


async def test_the_longest_and_plainest_owner_names_are_accepted(path: str) -> None:
    for owner in ("x" * 200, "orders eu-west/2 (blue)", "Zürich-1"):
        async with flow.open_engine(path, [saga([])], owner=owner) as engine:
            assert await engine.get("nothing") is None


@pytest.mark.parametrize(
    "lease", [1e-9, 0.49, 86_400.5, 8.6e6, 1e308, math.inf, math.nan, -1.0, True, "30"]
)
async def test_a_lease_outside_what_the_store_can_enforce_is_refused(path: str, lease: Any) -> None:
    with pytest.raises(ValueError, match="lease must be"):
        async with flow.open_engine(path, [saga([])], lease=lease):
            pytest.fail("opened")  # pragma: no cover


async def test_the_lease_range_holds_on_postgres_at_both_ends(pg_server: pg.PgServer) -> None:
    """At 0.5 s and at one day, a fleet engine's writes go through (the guard on idle
    transactions, a quarter of the lease in ms, fits PostgreSQL's setting)."""
    dsn = pg_server.fresh_schema_dsn("lease")
    for lease in (0.5, 86_400):
        async with (
            PostgresStore(dsn) as store,
            flow.open_engine(store, [saga([])], lease=lease) as engine,
        ):
            fid = await engine.start(engine._plans[("order", 1)])
            assert (await engine.wait(fid, timeout=30)).state is flow.State.COMPLETED


# ---------------------------------------------------------------- a loop that wakes up lapsed


def slow_plan(log: Log, hold: float) -> flow.Plan:
    """One step that logs, awaits `hold` seconds (a cancellable await), then logs again."""
    plan = flow.Plan("slow")

    @plan.step
    async def work(ctx: flow.Context) -> None:
        log.append(("before", ctx.flow_id, ctx.attempt))
        await trio.sleep(hold)
        log.append(("after", ctx.flow_id, ctx.attempt))

    return plan


async def test_a_loop_that_wakes_after_its_lease_lapsed_cancels_its_steps_first(
    path: str, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.flow")
    log: Log = []
    plan = slow_plan(log, hold=LEASE / 2)
    store = PlantedStore(path)
    async with fleet_engine(store, plan, owner="a") as a:
        for i in range(3):
            await a.start(plan, flow_id=f"f{i}")
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(log) == [("before", f"f{i}", 1) for i in range(3)]
        autojump_clock.jump(2 * LEASE)  # the loop was held past the lease: nothing ran
        await trio.testing.wait_all_tasks_blocked()
        # Every body was cancelled at its await, before it went on, and nothing was recorded.
        assert [e for e in log if e[0] == "after"] == []
        stats = a.statistics()
        assert stats.lost == 3 and stats.running == 0
        for i in range(3):
            f = await row(store, f"f{i}")
            assert (f.revision, f.step) == (1, "work")  # nothing recorded for the cancelled runs
        lost = [r for r in caplog.records if "lost its lease" in r.getMessage()]
        assert len(lost) == 1 and lost[0].levelno == logging.WARNING
        assert getattr(lost[0], "lost", None) == 3
        # Once it renewed, the flows it let go are taken over again and run as attempt 2.
        for i in range(3):
            assert (await a.wait(f"f{i}", timeout=10 * LEASE)).state is flow.State.COMPLETED
    assert sorted(e for e in log if e[0] == "after") == [("after", f"f{i}", 2) for i in range(3)]


async def test_a_renewal_that_fails_is_retried_at_once_and_logged(
    path: str, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ferry.flow")
    gates: dict[str, trio.Event] = {}
    plan = saga([], gates)
    store = PlantedStore(path)
    async with fleet_engine(store, plan, owner="a", scan_interval=1e9) as a:
        await a.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        store.fail_next = 1  # the next renewal's transaction fails (the database is busy)
        renewals = a.statistics().renewals
        await until(lambda: _true(a.statistics().renewals > renewals), step=1.0)
        # ... and its retry went through at once: same moment, nothing let go.
        assert a.statistics().lost == 0
        retries = [r for r in caplog.records if "renewing the lease of" in r.getMessage()]
        assert len(retries) == 1 and getattr(retries[0], "delay", None) == 0.0
        gates["f/1"].set()


async def _true(value: bool) -> bool:
    return value


# --------------------------------------------------------------------------- statistics


async def test_parked_is_never_negative_and_is_the_fleets_count_after_a_scan(
    path: str, autojump_clock: trio.testing.MockClock
) -> None:
    log: Log = []
    plan = saga(log, park=None)
    parking = flow.Plan("order", version=2)

    @parking.step
    async def wait_for_it(ctx: flow.Context) -> flow.Outcome:
        return flow.park() if ctx.wake is None else flow.COMPLETE

    async with (
        fleet_engine(PlantedStore(path), plan, parking, owner="b") as b,
        fleet_engine(PlantedStore(path), plan, parking, owner="a") as a,
    ):
        for i in range(5):
            await a.start(parking, flow_id=f"p{i}")
        await trio.testing.wait_all_tasks_blocked()
        assert a.statistics().parked == 5
        for i in range(3):  # woken through b, which never counted them
            assert await b.wake(f"p{i}", "go") is flow.Delivery.RESUMED
        await trio.testing.wait_all_tasks_blocked()
        assert b.statistics().parked >= 0
        await trio.sleep(LEASE / 3 + 0.1)  # a scan of each: the fleet's count
        assert a.statistics().parked == b.statistics().parked == 2
        for name in ("running", "completed", "failed", "blocked"):
            assert getattr(a.statistics(), name) >= 0 and getattr(b.statistics(), name) >= 0


# -------------------------------------------------------------------------- rolling deploys


def versions(log: Log, *, timeout: float | None = None) -> tuple[flow.Plan, flow.Plan]:
    """ "order" v1 (one step) and v2: a step that parks (with `timeout`), then one after it;
    each body logs (step, flow, owner in data or None)."""
    v1 = flow.Plan("order", version=1)

    @v1.step
    async def only(ctx: flow.Context) -> None:
        log.append(("v1", ctx.flow_id, None))

    v2 = flow.Plan("order", version=2)

    @v2.step
    async def hold(ctx: flow.Context) -> flow.Outcome:
        return flow.park(timeout=timeout, on_timeout="continue")

    @v2.step
    async def after(ctx: flow.Context) -> None:
        log.append(("after", ctx.flow_id, ctx.wake if not ctx.timed_out else "timed out"))

    return v1, v2


@asynccontextmanager
async def both(
    path: str, v1: flow.Plan, v2: flow.Plan
) -> AsyncIterator[tuple[flow.Engine, flow.Engine]]:
    """Engine "new" with versions 1 and 2, engine "old" with version 1 only."""
    async with (
        fleet_engine(PlantedStore(path), v1, v2, owner="new") as new,
        fleet_engine(PlantedStore(path), v1, owner="old") as old,
    ):
        yield new, old


async def test_a_wake_through_an_engine_without_the_version_runs_on_one_with_it(
    path: str, autojump_clock: trio.testing.MockClock
) -> None:
    log: Log = []
    v1, v2 = versions(log)
    store = PlantedStore(path)
    async with both(path, v1, v2) as (new, old):
        await new.start(v2, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        assert (await row(store, "f")).state is flow.State.PARKED
        assert await old.wake("f", "paid", message_id="m1") is flow.Delivery.RESUMED
        f = await row(store, "f")
        assert f.state is flow.State.RUNNING and f.owner is None  # left to an engine with v2
        assert (await new.wait("f", timeout=LEASE)).state is flow.State.COMPLETED
        assert log == [("after", "f", "paid")]
        assert old.statistics().blocked == 0 and old.statistics().running == 0


async def test_timers_of_a_version_wait_for_an_engine_with_it(
    path: str, autojump_clock: trio.testing.MockClock
) -> None:
    log: Log = []
    v1, v2 = versions(log, timeout=60.0)
    store = PlantedStore(path)
    async with fleet_engine(PlantedStore(path), v1, owner="old"):
        async with fleet_engine(PlantedStore(path), v1, v2, owner="new") as new:
            await new.start(v2, flow_id="f")
            await trio.testing.wait_all_tasks_blocked()
        # Only "old" (without v2) is up when the park times out: it fires nothing, blocks nothing.
        await trio.sleep(120.0)
        assert (await row(store, "f")).state is flow.State.PARKED
        assert log == []
        async with fleet_engine(PlantedStore(path), v1, v2, owner="new") as back:
            # ... and the flow goes on by itself once an engine with v2 is up.
            assert (await back.wait("f", timeout=LEASE)).state is flow.State.COMPLETED
    assert log == [("after", "f", "timed out")]


async def test_a_version_no_live_engine_has_still_fails_closed(
    path: str, autojump_clock: trio.testing.MockClock
) -> None:
    log: Log = []
    v1, v2 = versions(log)
    async with fleet_engine(PlantedStore(path), v1, v2, owner="new") as new:
        await new.start(v2, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
    async with fleet_engine(PlantedStore(path), v1, owner="old") as old:
        assert await old.wake("f", "paid") is flow.Delivery.QUEUED
        snap = await old.wait("f", timeout=LEASE)
        assert snap.state is flow.State.BLOCKED
        assert snap.error == "plan 'order' version 2 is not registered with this engine"


# ------------------------------------------------------------------- the store's own errors


async def _kill_connections(dsn: str) -> int:
    """End every other session of the test's database (as a network fault or an operator's
    pg_terminate_backend would); how many."""

    def kill() -> int:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'"
            ).fetchall()
        return len(rows)

    return await trio.to_thread.run_sync(kill)


async def test_a_dead_connection_reaches_reads_as_failed_and_wait_retries(
    pg_server: pg.PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ferry.flow")
    dsn = pg_server.fresh_database_dsn("dead")
    gates: dict[str, trio.Event] = {}
    plan = saga([], gates)
    async with (
        PostgresStore(dsn) as store,
        PostgresStore(dsn, connections=1) as ops_store,
        flow.open_engine(store, [plan], lease=30.0) as engine,
        flow.open_engine(ops_store, [], serve=False) as ops,
    ):
        await engine.start(plan, flow_id="f")
        # Every read of the operator's engine runs on a connection that was just killed.
        failures: list[BaseException] = []
        for call in (partial(ops.get, "f"), partial(ops.history, "f")):
            assert await ops.get("f") is not None  # (re)opens the operator's one connection
            await _kill_connections(dsn)
            try:
                await call()
            except Exception as exc:
                failures.append(exc)
            else:  # pragma: no cover - the pool's one connection was dead
                pytest.fail("a read on a killed connection went through")
        assert all(type(exc) is ferry.Failed for exc in failures), failures
        # `wait` reads the store (an operator's engine runs no flow: every flow is elsewhere),
        # its listener's connection is killed too (it reads 50 ms apart, doubling, meanwhile):
        # reads on killed connections are retried until the flow ends.
        async with trio.open_nursery() as nursery:

            async def kill_then_finish() -> None:
                for _ in range(8):
                    await _kill_connections(dsn)
                    await trio.sleep(0.1)
                gates["f/1"].set()

            nursery.start_soon(kill_then_finish)
            snap = await ops.wait("f", timeout=60)
        assert snap.state is flow.State.COMPLETED
        polls = [r for r in caplog.records if "while waiting for flow 'f'" in r.getMessage()]
        assert polls and all(r.levelno == logging.WARNING for r in polls)


async def test_parked_is_not_negative_on_postgres_either(pg_server: pg.PgServer) -> None:
    """The reported figure (-200, ADR 0075) came from two PostgreSQL engines: one parks, the
    other wakes."""
    dsn = pg_server.fresh_schema_dsn("parked")
    parking = flow.Plan("hold")

    @parking.step
    async def wait_for_it(ctx: flow.Context) -> flow.Outcome:
        return flow.park() if ctx.wake is None else flow.COMPLETE

    async with (
        PostgresStore(dsn) as sa,
        PostgresStore(dsn) as sb,
        flow.open_engine(sa, [parking], lease=3.0) as a,
        flow.open_engine(sb, [parking], lease=3.0) as b,
    ):
        for i in range(20):
            await a.start(parking, flow_id=f"p{i}")
        with trio.fail_after(30):
            while (await sa.transact(_store.count_waiting))[0] < 20:  # noqa: ASYNC110
                await trio.sleep(0.01)
        for i in range(20):
            assert await b.wake(f"p{i}", "go") is flow.Delivery.RESUMED
        for i in range(20):
            await b.wait(f"p{i}", timeout=30)
        assert b.statistics().parked >= 0 and a.statistics().parked >= 0


# ------------------------------------------------------------------------- incarnations


async def test_an_incarnation_whose_name_was_taken_runs_nothing_more(
    path: str, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine x is cut off from the database (its store held) past its lease; a new opening
    under the name x claims it (the lease lapsed) and resumes the flow as attempt 2. When the
    old incarnation is back, its renewal finds the name taken: it runs nothing more and says
    so, and only the new one's run counts."""
    caplog.set_level(logging.WARNING, logger="ferry.flow")
    log: Log = []
    gates: dict[str, trio.Event] = {}
    plan = saga(log, gates)
    old_store = PlantedStore(path)
    async with fleet_engine(old_store, plan, owner="x") as old:
        await old.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        old_store.gate = trio.Event()  # cut off: nothing it sends reaches the database
        await trio.sleep(LEASE * 1.5)  # its lease lapsed
        async with fleet_engine(PlantedStore(path), plan, owner="x") as new:
            await trio.testing.wait_all_tasks_blocked()
            assert ("charge", "f", 2) in log and new.statistics().recovered == 1
            old_store.gate.set()  # the old incarnation is back
            old_store.gate = None
            await trio.sleep(LEASE)  # its renewals meet the name taken
            assert old.statistics().running == 0
            gates["f/2"].set()
            assert (await new.wait("f", timeout=60)).state is flow.State.COMPLETED
            gates["f/1"].set()  # (its run, if it still went on, would return now)
            await trio.sleep(LEASE)
            assert old.statistics().running == 0
    assert [e for e in log if e[0] == "ship"] == [("ship", "f", 1, None)]
    said = [r.getMessage() for r in caplog.records]
    assert any("lost its lease" in m and "same owner name" in m for m in said), said


async def test_a_version_that_came_up_since_the_last_scan_is_read_before_a_wake_decides(
    path: str, autojump_clock: trio.testing.MockClock
) -> None:
    """Engine "old" (v1) opened first and has not scanned since "new" (v1, v2) came up: its
    list of the fleet's versions is stale. A wake of a v2 flow through it reads the live
    versions again instead of blocking the flow."""
    log: Log = []
    v1, v2 = versions(log)
    store = PlantedStore(path)
    async with fleet_engine(PlantedStore(path), v1, owner="old", scan_interval=1e9) as old:
        async with fleet_engine(PlantedStore(path), v1, v2, owner="new") as new:
            await new.start(v2, flow_id="f")
            await trio.testing.wait_all_tasks_blocked()
            assert old._parts.versions.fleet_known == {}  # (what its last scan saw: no v2 anywhere)
            assert await old.wake("f", "paid") is flow.Delivery.RESUMED
            assert (await row(store, "f")).owner is None
            assert (await new.wait("f", timeout=LEASE)).state is flow.State.COMPLETED
    assert log == [("after", "f", "paid")]
