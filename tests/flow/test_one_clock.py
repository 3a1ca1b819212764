"""One clock for leases (docs/adr/0110), in one process: the fast twin of
tests/fleet/test_lease_clock.py, on the suite's throwaway PostgreSQL, through the tests'
wall-clock switch (tests/switches.py).

- A lease is written on the database's clock, whatever the engine's host clock says: an engine
  whose clock is 1,000 s ahead has a lease row that ends a lease after the database's now.
- An engine whose clock is 10 s ahead (five leases) opens beside a live engine that runs a flow
  and scans for orphans: it takes nothing over.
- The store's lease clock is the database's on PostgreSQL and the engine's own on SQLite.
- `Clock.now` follows a wall clock stepped after it was made (durable times follow the host's
  steps), and still follows the mock under a MockClock (SPEC 5.3.3).

Before the one clock the first four failed: the lease row ended 1,000 s late, the skewed
engine took the running flow over at open, the store had no lease clock, and the engine's clock
read the wall clock once. The last one passed then too (MockClock testing keeps working).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import psycopg
import pytest
import trio
import trio.testing

from ferry import flow
from ferry.flow._runtime._clock import Clock
from ferry.flow._store import _store
from ferry.projected import PostgresStore, SqliteStore
from tests import pg, switches

_WAIT = 20.0  # seconds: a generous bound for a loaded machine, never reached when it works


def _db_now(dsn: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        return float(row[0])


def _lease_until(dsn: str, owner: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT lease_until FROM flow_engines WHERE owner = %s", (owner,)
        ).fetchone()
        assert row is not None
        return float(row[0])


def _ahead(seconds: float) -> float:
    return time.time() + seconds


async def test_a_lease_is_written_on_the_databases_clock(pg_server: pg.PgServer) -> None:
    dsn = pg_server.fresh_schema_dsn("oneclock")
    plan = flow.Plan("noop")

    @plan.step
    async def s1(ctx: flow.Context) -> None:
        pass

    async with (
        PostgresStore(dsn) as store,
        switches.open_engine(
            store, [plan], owner="ahead", lease=2.0, wall_clock=partial(_ahead, 1000.0)
        ),
    ):
        until = await trio.to_thread.run_sync(_lease_until, dsn, "ahead")
        now = await trio.to_thread.run_sync(_db_now, dsn)
    # (a renewal of a loaded machine may come late: the lease may even have lapsed by now)
    assert now - 10.0 < until <= now + 2.0, f"the lease ends {until - now:.1f} s after now"


async def test_an_engine_whose_clock_is_ahead_takes_over_nothing(pg_server: pg.PgServer) -> None:
    dsn = pg_server.fresh_schema_dsn("oneclock")
    began = trio.Event()
    gate = trio.Event()
    runs: list[tuple[str, int]] = []
    plan = flow.Plan("held")

    @plan.step
    async def s1(ctx: flow.Context) -> None:
        runs.append((ctx.flow_id, ctx.attempt))
        began.set()
        await gate.wait()

    async with PostgresStore(dsn) as a_store, PostgresStore(dsn) as b_store:
        async with switches.open_engine(a_store, [plan], owner="a", lease=1.5) as a:
            fid = await a.start(plan)
            with trio.fail_after(_WAIT):
                await began.wait()
            async with switches.open_engine(
                b_store, [plan], owner="b", lease=1.5, wall_clock=partial(_ahead, 10.0)
            ) as b:
                with trio.fail_after(_WAIT):
                    # b renews and scans every half second: two renewals, two scans at least
                    while b.statistics().renewals < 2:  # noqa: ASYNC110 (a counter)
                        await trio.sleep(0.05)
                claimed = b.statistics().claimed
                gate.set()
                assert (await a.wait(fid, timeout=_WAIT)).state is flow.State.COMPLETED
    assert claimed == 0 and runs == [(fid, 1)], f"b took over a live engine's flow: {runs}"


async def test_the_lease_clock_is_the_databases_on_postgres_and_the_engines_on_sqlite(
    pg_server: pg.PgServer, tmp_path: Path
) -> None:
    dsn = pg_server.fresh_schema_dsn("oneclock")
    async with PostgresStore(dsn) as store:
        at = await store.transact(partial(_store.lease_clock, now=1.0))
    assert abs(at - time.time()) < 60
    async with SqliteStore(str(tmp_path / "one.db")) as sqlite:
        assert await sqlite.transact(partial(_store.lease_clock, now=1.0)) == 1.0


async def test_the_engines_clock_follows_a_wall_clock_stepped_after_it_was_made() -> None:
    step = [0.0]
    clock = Clock(lambda: 1_000_000.0 + step[0])
    assert clock.now() == pytest.approx(1_000_000.0, abs=1.0)
    step[0] = -30.0
    assert clock.now() == pytest.approx(999_970.0, abs=1.0)
    assert clock.trio_time(999_980.0) == pytest.approx(trio.current_time() + 10.0, abs=1.0)


def test_under_a_mock_clock_the_engines_clock_follows_the_mock() -> None:
    async def main() -> tuple[float, float]:
        clock = Clock(lambda: 1_000_000.0)
        await trio.sleep(3600)
        return clock.now(), clock.trio_time(1_000_000.0 + 7200) - trio.current_time()

    now, later = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert now == 1_003_600.0 and later == 3600.0
