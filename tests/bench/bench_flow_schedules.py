"""Schedules through the engine (SPEC 5.9, issue 30's targets; docs/adr/0174): on SQLite (WAL,
``synchronous=FULL``, the path form) and on PostgreSQL with one engine.

The engines are opened with tests/switches.py's wall clock (no public option): the host's
wall clock stands still at `D` seconds before a daily tick while the engine opens (declaring
its schedules), then runs on with real time from the moment the engine is open, so the tick
comes `D` seconds later and the engine's one timer fires it as on any host.

- **a burst**: `BURST` schedules of one daily expression, all due on the same minute; seconds
  from the tick to the last tick's flow running (its step's body entered: created, made live,
  given a runner). Per tick, against `SMALL` schedules (the same, 100). Target on SQLite: at
  most 1.5x per tick (the cost of one tick does not grow with the number of schedules).
  Reported with it: the whole figure, and the store's half alone (`_schedules.fire_due` in
  claims until one comes back short, no engine) on the same number, as its baseline.
- **a few due among many**: `SMALL` due among `BURST` (the others due an hour later) against
  `SMALL` alone, seconds to all running. Target on SQLite: at most 1.5x (the schedules not due
  cost the firing nothing).
- **idle**: the process's CPU (every thread) over `QUIET` seconds of an open engine with
  `BURST` schedules not due, against an engine with none. Target: at most 1.5x (one timer
  sleeping, no work per schedule between ticks).
- **PostgreSQL**: the burst's figure, reported.

The sizes are module constants (`tests/test_bench_builds.py` runs it tiny); ``BENCH_ROUNDS``
(default 3) rounds of each burst, ``BENCH_QUIET`` (default 5) seconds of each idle engine.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from ferry import flow
from ferry.flow._store import _schedules, _schema
from ferry.projected import PostgresStore, SqliteStore, Store
from tests import pg, switches
from tests.bench._harness import Row

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
QUIET = float(os.environ.get("BENCH_QUIET", "5"))
BURST = 10_000
SMALL = 100
DURABLE = ("fsync=on", "synchronous_commit=on", "full_page_writes=on")

TICK = 1_796_180_400.0  # 2026-12-02T03:00:00Z, the daily tick of "0 3 * * *"
D = 0.5  # seconds from the engine being open to the tick

tick = flow.Plan("bench-tick")


class _Count:
    """The bodies entered in one round, and when the `want`-th one was."""

    def __init__(self) -> None:
        self.want = 0
        self.entered = 0
        self.all = trio.Event()
        self.at = 0.0

    def reset(self, want: int) -> None:
        self.want, self.entered, self.all, self.at = want, 0, trio.Event(), 0.0


count = _Count()


@tick.step
async def run(ctx: flow.Context) -> None:
    count.entered += 1
    if count.entered == count.want:
        count.at = time.perf_counter()
        count.all.set()


class Wall:
    """The host's wall clock of a round: still at `D` before the tick until `go`, then real
    time on from there (the tick `D` seconds after `go`)."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.began: float | None = None

    def go(self) -> float:
        """Let the wall clock run; the perf_counter time of the tick."""
        self.began = time.perf_counter()
        return self.began + (TICK - self.at)

    def __call__(self) -> float:
        began = self.began
        return self.at + (0.0 if began is None else time.perf_counter() - began)


Where = Callable[[], Any]  # a fresh store for one round: an SQLite path or "pg:" and a DSN


@asynccontextmanager
async def _store(where: Any) -> AsyncIterator[Store]:
    if isinstance(where, str) and where.startswith("pg:"):
        async with PostgresStore(where[3:], connections=4) as store:
            yield store
    else:
        async with SqliteStore(where) as store:
            yield store


@asynccontextmanager
async def engine_at(
    where: Any, schedules: list[flow.Schedule], wall: Callable[[], float]
) -> AsyncIterator[flow.Engine]:
    if isinstance(where, str) and where.startswith("pg:"):
        async with _store(where) as store:
            async with switches.open_engine(
                store, [tick], schedules=schedules, wall_clock=wall, retain=None
            ) as engine:
                yield engine
        return
    async with switches.open_engine(
        where, [tick], schedules=schedules, wall_clock=wall, retain=None
    ) as engine:
        yield engine


def _schedules_of(due: int, later: int) -> list[flow.Schedule]:
    """`due` schedules of the tick at 03:00, `later` of one at 04:00."""
    return [flow.Schedule(f"s{i}", tick, cron="0 3 * * *") for i in range(due)] + [
        flow.Schedule(f"l{i}", tick, cron="0 4 * * *") for i in range(later)
    ]


async def burst(where: Any, due: int, later: int = 0) -> tuple[float, float]:
    """Seconds from the tick to the last of `due` ticks' flows running (`later` schedules
    stored beside them, not due), and the CPU seconds of this process (every thread) from the
    engine being open until then (a figure a loaded machine disturbs less)."""
    count.reset(due)
    wall = Wall(TICK - D)
    async with engine_at(where, _schedules_of(due, later), wall):
        cpu = time.process_time()
        at = wall.go()
        with trio.fail_after(600):
            await count.all.wait()
        cpu = time.process_time() - cpu
    return count.at - at, cpu


async def store_half(where: Any, due: int) -> float:
    """Seconds the store's half alone takes to fire `due` schedules due on one minute: claims
    of `_schedules.CLAIM` until one comes back short, no engine."""
    shapes = {(shape.name, shape.version): shape for shape in [tick._close()]}
    async with _store(where) as store:
        await store.transact(_schema.create_schema)
        declared = _schedules_of(due, 0)
        await store.transact(lambda tx: _schedules.declare(tx, declared, TICK - D))
        began = time.perf_counter()
        fired = 0
        while True:
            got = await store.transact(lambda tx: _schedules.fire_due(tx, TICK + 0.1, shapes))
            fired += sum(o.created for o in got)
            if len(got) < _schedules.CLAIM:
                break
        took = time.perf_counter() - began
    assert fired == due, (fired, due)
    return took


async def idle(where: Any, schedules: int) -> float:
    """CPU seconds of this process (every thread) over `QUIET` seconds of an open engine with
    `schedules` schedules, none due."""
    wall = Wall(TICK - 3600 - D)
    async with engine_at(where, _schedules_of(0, schedules), wall):
        wall.go()
        await trio.sleep(min(1.0, QUIET))  # the open's own work settles
        began = time.process_time()
        await trio.sleep(QUIET)
        return time.process_time() - began


def _burst_rows(label: str, fresh: Where, targets: bool) -> Iterator[Row]:
    big, small, alone, cpu = [], [], [], []
    for _ in range(ROUNDS):
        small.append(trio.run(burst, fresh(), SMALL)[0])
        took, used = trio.run(burst, fresh(), BURST)
        big.append(took)
        cpu.append(used)
        alone.append(trio.run(store_half, fresh(), BURST))
    many, few, half = min(big), min(small), min(alone)
    yield Row(
        f"schedules {label}: {BURST:,} due on one minute, s per tick to running / {SMALL} due",
        many / BURST,
        few / SMALL,
        1.5 if targets else float("inf"),
        unit="us/tick",
        note=f"all {BURST:,} running {many:.2f} s after the tick (rounds: "
        + ", ".join(f"{b:.2f}" for b in big)
        + f"; CPU {min(cpu):.2f} s)",
    )
    yield Row(
        f"schedules {label}: {BURST:,} due, the tick to all running / the store's half alone",
        many,
        half,
        float("inf"),
        unit="s",
        note=f"the store alone fires {BURST:,} in {half:.2f} s",
    )


def _sqlite_rows(fresh: Where) -> Iterator[Row]:
    yield from _burst_rows("sqlite", fresh, True)
    among, alone = [], []
    for _ in range(ROUNDS):
        alone.append(trio.run(burst, fresh(), SMALL)[0])
        among.append(trio.run(burst, fresh(), SMALL, BURST - SMALL)[0])
    yield Row(
        f"schedules sqlite: {SMALL} due among {BURST:,}, the tick to all running / {SMALL} alone",
        min(among),
        min(alone),
        1.5,
        unit="s",
    )
    busy, none = [], []
    for _ in range(max(1, ROUNDS - 1)):
        none.append(trio.run(idle, fresh(), 0))
        busy.append(trio.run(idle, fresh(), BURST))
    yield Row(
        f"schedules sqlite: idle engine's CPU over {QUIET:g} s, {BURST:,} schedules / none",
        min(busy),
        min(none),
        1.5,
        unit="s",
        note="CPU of every thread, none due",
    )


def benchmarks() -> Iterator[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-schedules-") as name:
        tmp = Path(name)
        counter = iter(range(1_000_000))
        yield from _sqlite_rows(lambda: str(tmp / f"r{next(counter)}.db"))
    bindir = pg.find_binaries()
    if bindir is None:
        print(f"PostgreSQL rows skipped: {pg.SKIP_REASON}")
        return
    server = pg.start(bindir, DURABLE)
    try:
        fresh = lambda: "pg:" + server.fresh_schema_dsn("s")  # noqa: E731
        yield from _burst_rows("postgres, 1 engine", fresh, False)
    finally:
        server.stop()
