"""Schedules on a PostgreSQL fleet (SPEC 5.9, docs/adr/0144, 0154): two engines declare and fire
one every-minute schedule; each tick starts once, whichever engine's timer comes first.

The real trio clock, with the engines' wall clock a test switch (tests/switches.py) that the
test steps a minute at a time; both engines wake every ``scan_interval`` (0.05 s) and fire
what is due, so both race for every tick (each engine starts some of them, run to run). Fails
on a fleet's engine that does not look again at the schedules between their ticks (planted: the
step of the wall clock is seen a minute later, `trio.TooSlowError`); the exactly-once of one
firing is the store's claim and compare-and-set, whose planted bugs
tests/flow/test_schedule_store.py catches."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from ferry import flow
from ferry.flow._store import _sql
from ferry.projected import PostgresStore
from tests import pg, switches

from .test_schedules_engine import BASE, MINUTE, Ticks, iso, report

ROUNDS = 6


@asynccontextmanager
async def fleet_engine(
    dsn: str, owner: str, schedule: flow.Schedule, wall: list[float], ticks: Ticks
) -> AsyncIterator[flow.Engine]:
    async with PostgresStore(dsn, connections=2) as store:
        async with switches.open_engine(
            store,
            [report],
            owner=owner,
            schedules=[schedule],
            observers=[ticks],
            wall_clock=lambda: time.time() + wall[0],
            scan_interval=0.05,
            retain=None,
        ) as engine:
            yield engine


async def test_two_engines_start_each_tick_of_one_schedule_once(pg_server: pg.PgServer) -> None:
    dsn = pg_server.fresh_schema_dsn()
    wall = [BASE + 1 - time.time()]
    every = flow.Schedule("every", report, cron="* * * * *", overlap="allow")
    ticks = {"a": Ticks(), "b": Ticks()}

    def started() -> int:
        return sum(t.started() for t in ticks.values())

    with trio.fail_after(30):
        async with AsyncExitStack() as stack:
            for owner, seen in ticks.items():
                await stack.enter_async_context(fleet_engine(dsn, owner, every, wall, seen))
            for minute in range(1, ROUNDS + 1):
                wall[0] += MINUTE
                while started() < minute:  # noqa: ASYNC110 (the engines' timers fire)
                    await trio.sleep(0.01)
            await trio.sleep(0.2)  # both engines wake again: nothing more starts
    assert started() == ROUNDS
    async with PostgresStore(dsn, connections=1) as store:
        rows = await store.transact(
            lambda tx: tx.execute(f"SELECT flow_id FROM {_sql.FLOWS} ORDER BY flow_id")
        )
    assert [r[0] for r in rows] == [f"every@{iso(BASE + m * MINUTE)}" for m in range(1, ROUNDS + 1)]
