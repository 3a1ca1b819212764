"""Schedules on a fleet of three engine processes on PostgreSQL, one SIGKILLed (SPEC 5.9,
docs/adr/0144, 0154): every tick of an every-minute schedule over a simulated hour is started
exactly once, whichever engine fires it, through the kill (the hour under ``-m long``; the
default run covers 9 minutes, one engine killed after 3).

The engines' wall clock is a file the test writes (`_schedule_engine.FileClock`, through the
tests' switches): it steps a minute at a time, and the test waits for the minute's flow before
the next step, so no tick is late however slow the machine; after a third of the run one
engine is SIGKILLed (whatever it was doing: a firing not committed is fired by another). The
oracle is the database: exactly one flow ``every@T`` per minute, and the survivors' starts
are at most that many and at least the minutes after the kill (a killed engine cannot say how
many it started).
Fails on a fleet engine that does not look again at the schedules between ticks (a step of the
clock is not seen for a minute: the wait for a tick times out)."""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from tests import pg

from ._flows import query
from ._processes import EngineProcess, spawning, until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process tests: Linux signals")

BASE = 1_796_169_630.0  # 2026-12-02T00:00:30Z: half a minute before the first tick


class Engine(EngineProcess):
    def __init__(self, workdir: Path, dsn: str, owner: str) -> None:
        args = [dsn, "--owner", owner, "--clock", str(workdir / "clock")]
        super().__init__(workdir, owner, "tests.fleet._schedule_engine", args)


@pytest.fixture
def dsn(pg_server: pg.PgServer) -> str:
    return pg_server.fresh_database_dsn("sched")


@pytest.fixture
def engines(tmp_path: Path, dsn: str) -> Iterator[Callable[[str], Engine]]:
    with spawning(partial(Engine, tmp_path, dsn)) as spawn:
        yield spawn


def set_clock(path: Path, t: float) -> None:
    staged = path.with_suffix(".new")
    staged.write_text(repr(t))
    os.replace(staged, path)  # every engine reads the whole number or the one before


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def has_flow(dsn: str, flow_id: str) -> bool:
    return bool(query(dsn, "SELECT 1 FROM flow_flows WHERE flow_id = %s", (flow_id,)))


def tick_flows(dsn: str) -> list[str]:
    return [r[0] for r in query(dsn, "SELECT flow_id FROM flow_flows ORDER BY flow_id")]


@pytest.mark.parametrize("minutes", [9, pytest.param(60, marks=pytest.mark.long)])
def test_three_engines_one_killed_start_every_tick_once(
    tmp_path: Path, dsn: str, engines: Callable[[str], Engine], minutes: int
) -> None:
    clock = tmp_path / "clock"
    set_clock(clock, BASE)
    fleet = [engines(owner) for owner in ("a", "b", "c")]
    for e in fleet:
        e.ready()
    for minute in range(1, minutes + 1):
        set_clock(clock, BASE + minute * 60)
        tick = f"every@{iso(BASE - 30 + minute * 60)}"
        until(partial(has_flow, dsn, tick), f"flow {tick}", timeout=20)
        if minute == minutes // 3:
            fleet[1].kill()
    survivors = [fleet[0].stop()["started"], fleet[2].stop()["started"]]
    expected = [f"every@{iso(BASE - 30 + m * 60)}" for m in range(1, minutes + 1)]
    assert tick_flows(dsn) == expected
    assert minutes - minutes // 3 <= sum(survivors) <= minutes
