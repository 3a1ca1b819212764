"""Child flows (SPEC 5.7, issue 28's targets; docs/adr/0164): fan-out and fan-in, on SQLite
(WAL, ``synchronous=FULL``, the path form) and on PostgreSQL with one engine.

- **fan-out**: `PARENTS` parents, each spawning `CHILDREN` children of a 1-step plan (all at
  once), started together; seconds per child from the first start to the last parent's end.
  Baseline: `PARENTS` x `CHILDREN` independent flows of the same 1-step plan, started and waited
  for together, in the same run (alternating rounds). Target on SQLite: children per second at
  least 0.8x the flows per second (seconds per child at most 1.25x); on PostgreSQL, reported.
- **fan-in cost**: one parent of `FAN_IN` children of the 1-step plan against one of `FEW`:
  once every other child has ended (its end written), the last one is let go; the time from
  its body returning to the parent's next step's body beginning (that child's end written,
  recorded for its parent, the parent moved on and run). Target on
  SQLite: at most 2x (a child's end costs its parent O(1): no re-read of all children per end);
  on PostgreSQL, reported.

The sizes are module constants (`tests/test_bench_builds.py` runs it tiny); ``BENCH_ROUNDS``
(default 3) rounds of the fan-out, ``BENCH_FANIN_ROUNDS`` (default 3) of each fan-in size.
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
from ferry.projected import PostgresStore
from tests import pg
from tests.bench._harness import Row

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
FANIN_ROUNDS = int(os.environ.get("BENCH_FANIN_ROUNDS", "3"))
PARENTS = 100
CHILDREN = 100
FAN_IN = 10_000
FEW = 10
DURABLE = ("fsync=on", "synchronous_commit=on", "full_page_writes=on")

#: times the bodies note (perf_counter): the last child body's return, the next step's start
marks: dict[str, float] = {}

item = flow.Plan("bench-item")


#: the fan-in's last child waits for this (set once every other child's end is written)
gate: list[trio.Event] = []
returned: list[int] = [0]


@item.step
async def work(ctx: flow.Context) -> None:
    if ctx.data.get("last"):
        await gate[0].wait()
        marks["child"] = time.perf_counter()
    returned[0] += 1


fan = flow.Plan("bench-fan")


@fan.step
async def spawn(ctx: flow.Context) -> flow.Outcome:
    n, last = ctx.data["n"], ctx.data.get("last", False)
    return flow.spawn(
        [flow.Child(item, key=f"k{i}", data={"last": last and i == n - 1}) for i in range(n)]
    )


@fan.step
async def gather(ctx: flow.Context) -> None:
    marks.setdefault("next", time.perf_counter())  # the first run of the next step
    assert len(ctx.children) == ctx.data["n"]


Where = Callable[[], Any]  # a fresh store for one round: an SQLite path or a PostgreSQL DSN


@asynccontextmanager
async def engine_at(where: Any) -> AsyncIterator[flow.Engine]:
    if isinstance(where, str) and where.startswith("pg:"):
        async with PostgresStore(where[3:], connections=4) as store:
            async with flow.open_engine(store, plans=[fan, item]) as engine:
                yield engine
        return
    async with flow.open_engine(where, plans=[fan, item]) as engine:
        yield engine


async def _together(engine: flow.Engine, plan: flow.Plan, n: int, data: dict[str, Any]) -> None:
    async def one(i: int) -> None:
        snap = await engine.wait(await engine.start(plan, flow_id=f"f{i}", data=data))
        assert snap.state is flow.State.COMPLETED, snap.error

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)


async def fan_out(where: Any) -> float:
    """Seconds per child: `PARENTS` parents of `CHILDREN` children each, all to their end."""
    async with engine_at(where) as engine:
        t0 = time.perf_counter()
        await _together(engine, fan, PARENTS, {"n": CHILDREN})
        return (time.perf_counter() - t0) / (PARENTS * CHILDREN)


async def independent(where: Any) -> float:
    """Seconds per flow: as many independent flows of the child's plan, all to their end."""
    async with engine_at(where) as engine:
        t0 = time.perf_counter()
        await _together(engine, item, PARENTS * CHILDREN, {})
        return (time.perf_counter() - t0) / (PARENTS * CHILDREN)


async def fan_in(where: Any, n: int) -> float:
    """Seconds from the last of `n` children's body returning to the parent's next step: the
    other children have all ended (their ends written) before the last one is let go."""
    marks.clear()
    gate[:] = [trio.Event()]
    returned[0] = 0
    async with engine_at(where) as engine:
        await engine.start(fan, flow_id="p", data={"n": n, "last": True})
        while returned[0] < n - 1:  # noqa: ASYNC110 (the bodies count; no event per child)
            await trio.sleep(0.01)
        async with trio.open_nursery() as nursery:
            for i in range(n - 1):
                nursery.start_soon(engine.wait, f"p/0/k{i}")
        gate[0].set()
        snap = await engine.wait("p")
        assert snap.state is flow.State.COMPLETED, snap.error
    return marks["next"] - marks["child"]


def _rows(label: str, fresh: Where, targets: bool) -> Iterator[Row]:
    outs, ins = [], []
    for _ in range(ROUNDS):
        ins.append(trio.run(independent, fresh()))
        outs.append(trio.run(fan_out, fresh()))
    out, alone = min(outs), min(ins)
    yield Row(
        f"children {label}: fan-out {PARENTS}x{CHILDREN}, s per child / per independent flow",
        out,
        alone,
        1.25 if targets else float("inf"),
        note=f"{1 / out:,.0f} children/s, {1 / alone:,.0f} flows/s (target >= 0.8x)",
    )
    many, few = [], []
    for _ in range(FANIN_ROUNDS):
        few.append(trio.run(fan_in, fresh(), FEW))
        many.append(trio.run(fan_in, fresh(), FAN_IN))
    yield Row(
        f"children {label}: fan-in, last end to next step, {FAN_IN:,} children / {FEW}",
        min(many),
        min(few),
        2.0 if targets else float("inf"),
        unit="us/fan-in",
    )


def benchmarks() -> Iterator[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-children-") as name:
        tmp = Path(name)
        count = iter(range(1_000_000))
        yield from _rows("sqlite", lambda: str(tmp / f"r{next(count)}.db"), True)
    bindir = pg.find_binaries()
    if bindir is None:
        print(f"PostgreSQL rows skipped: {pg.SKIP_REASON}")
        return
    server = pg.start(bindir, DURABLE)
    try:
        yield from _rows("postgres, 1 engine", lambda: "pg:" + server.fresh_schema_dsn("c"), False)
    finally:
        server.stop()
