"""Flow control (SPEC 5.8, issue 29's targets): what an admission costs, what limits cost, and
limits that bind, on SQLite (WAL, ``synchronous=FULL``) and PostgreSQL.

- **admission at depth**: a plan's queue of `DEEP` flows over ``DEEP // 100`` keys against one
  of `SHALLOW` (``Limits(concurrency=5, key=..., per_key=1)``, filled as the queue's own
  statements leave it); seconds per end that gives a slot back and admits the next flow (one
  transaction of the store's `release`, as the batch calls it), `ENDS` of them. Target on both:
  at most 1.5x (O(log n): index probes, never a scan).
- **limits that never bind**: `FLOWS` flows of a one-step plan started together and waited for
  through the engine, with ``Limits(concurrency=10**9)`` against the same plan without limits.
  Target on SQLite: seconds per flow at most 1.25x (at least 0.8x the flows/s).
- **concurrency=50 binding**: `FLOWS` flows of a plan whose step sleeps `HOLD` s, with
  ``concurrency=50``: the most step bodies in flight at once (must be exactly 50: a row of its
  own, target 1.0x of 50, and at least 50 is checked too) and the throughput, reported against
  the same plan without limits.
- **three engines, per_key=1** (PostgreSQL): `FLOWS` flows over 100 keys on three engines (each
  its own store, in one process) against one engine; flows/s reported, and the most flows of
  one key in flight at once (step bodies, counted in the process: 1 at most) checked.

The sizes are module constants (`tests/test_bench_builds.py` runs it tiny); ``BENCH_ROUNDS``
(default 3) rounds of each engine row.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ferry import flow
from ferry.flow._model._limits import Limits
from ferry.flow._store import _admission as sa
from ferry.flow._store import _schema
from ferry.flow._store._sql import FLOWS as TABLE
from ferry.projected import PostgresStore, SqliteStore, Store, Tx
from tests import pg
from tests.bench._harness import Row

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DEEP = 100_000
SHALLOW = 1_000
ENDS = 500
FLOWS = 2_000
HOLD = 0.005
BINDING = 50
KEYS = 100
DURABLE = ("fsync=on", "synchronous_commit=on", "full_page_writes=on")
T0 = 1_700_000_000.0

# ------------------------------------------------------------------ admission at depth (store)


def _key(data: Any) -> str:
    return str(data)


LIMITS = Limits(concurrency=5, key=_key, per_key=1)


def _numbers(tx: Tx) -> str:
    if tx.dialect == "postgres":  # its series is several times faster than a recursive CTE
        return "SELECT generate_series(0, ?) AS i"
    return (
        "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " SELECT i FROM n"
    )


def _fill(tx: Tx, plan: str, n: int) -> list[str]:
    """`n` due flows queued over ``n // 100`` keys as `enqueue` leaves them (as
    tests/flow/test_admission_store.py's `_bulk_queue`), then the first 5 admitted: their ids."""
    keys = max(1, n // 100)
    sa.register(tx, plan, LIMITS)
    tx.execute(
        f"INSERT INTO {TABLE} (flow_id, plan, version, state, step_index, step, attempt, data,"
        " revision, updated_at, timed_out, stack, start_data, created_at, queue_key, priority,"
        " turn, seq, not_before, due) SELECT ? || '-' || i, ?, 1, 'QUEUED', 0, 's', 1, '{}', 1,"
        f" ?, 0, '', '{{}}', ?, 'k' || (i % ?), 0, i / ?, i + 1, NULL, 1"
        f" FROM ({_numbers(tx)}) AS n",
        (plan, plan, T0, T0, keys, keys, n - 1),
    )
    tx.execute(f"UPDATE {sa.BUDGETS} SET seq = ? WHERE plan = ?", (n, plan))
    tx.execute(
        f"INSERT INTO {sa.KEYS} (plan, queue_key, active, queued, head_priority, head_turn,"
        " head_seq, open) SELECT plan, queue_key, 0, COUNT(*), 0, MIN(turn), MIN(seq), 1"
        f" FROM {TABLE} WHERE plan = ? GROUP BY plan, queue_key",
        (plan,),
    )
    return [a.flow_id for a in sa.admit(tx, plan, LIMITS, T0, "bench")]


def _end_one(tx: Tx, plan: str, fid: str, now: float) -> list[str]:
    """An end as the batch writes it: the row ``COMPLETED``, its slot given back, the next
    admitted (in this transaction)."""
    tx.execute(
        f"UPDATE {TABLE} SET state = 'COMPLETED', revision = revision + 1 WHERE flow_id = ?",
        (fid,),
    )
    return [a.flow_id for a in sa.release(tx, plan, LIMITS, fid, now, "bench")]


async def _ends(store: Store, plan: str, n: int) -> float:
    """Seconds per end that admits the next, on a queue of `n` flows (`ENDS` of them)."""
    await store.transact(_schema.create_schema)
    active = deque(await store.transact(partial(_fill, plan=plan, n=n)))
    if store.dialect == "postgres":
        await store.transact(lambda tx: tx.execute(f"ANALYZE {TABLE}, {sa.KEYS}"))
    t0 = time.perf_counter()
    for i in range(ENDS):
        fid = active.popleft()
        active.extend(await store.transact(partial(_end_one, plan=plan, fid=fid, now=T0 + i)))
    return (time.perf_counter() - t0) / ENDS


@asynccontextmanager
async def _store_at(where: Any) -> AsyncIterator[Store]:
    if isinstance(where, str) and where.startswith("pg:"):
        async with PostgresStore(where[3:], connections=2) as store:
            yield store
        return
    async with SqliteStore(where) as store:
        yield store


async def _depth(where: Any, n: int) -> float:
    async with _store_at(where) as store:
        return await _ends(store, f"p{n}", n)


# --------------------------------------------------------------------- through the engine

in_flight: Counter[str] = Counter()  # step bodies running now: "all", and per key
most: Counter[str] = Counter()  # the most at once


def _plan(name: str, limits: flow.Limits | None, hold: float) -> flow.Plan:
    plan = flow.Plan(name, limits=limits)

    @plan.step
    async def work(ctx: flow.Context) -> None:
        key = ctx.data.get("k", "")
        for k in ("all", f"k:{key}"):
            in_flight[k] += 1
            most[k] = max(most[k], in_flight[k])
        try:
            if hold:
                await trio.sleep(hold)
        finally:
            for k in ("all", f"k:{key}"):
                in_flight[k] -= 1

    return plan


@asynccontextmanager
async def _engines(where: Any, plan: flow.Plan, count: int) -> AsyncIterator[list[flow.Engine]]:
    async with AsyncExitStack() as stack:
        engines = []
        for i in range(count):
            if isinstance(where, str) and where.startswith("pg:"):
                store = await stack.enter_async_context(PostgresStore(where[3:], connections=4))
                engines.append(
                    await stack.enter_async_context(
                        flow.open_engine(store, plans=[plan], owner=f"bench-{i}")
                    )
                )
            else:
                engines.append(await stack.enter_async_context(flow.open_engine(where, [plan])))
        yield engines


async def _run(where: Any, plan: flow.Plan, count: int = 1, keyed: bool = False) -> float:
    """Seconds per flow: `FLOWS` flows started together over `count` engines, to their end."""
    in_flight.clear()
    most.clear()
    async with _engines(where, plan, count) as engines:

        async def one(i: int) -> None:
            engine = engines[i % len(engines)]
            data = {"k": f"k{i % KEYS}"} if keyed else {}
            fid = await engine.start(plan, flow_id=f"f{i}", data=data)
            snap = await engine.wait(fid)
            assert snap.state is flow.State.COMPLETED, snap.error

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(FLOWS):
                nursery.start_soon(one, i)
        return (time.perf_counter() - t0) / FLOWS


def _paired(subject: Callable[[], float], baseline: Callable[[], float]) -> tuple[float, float]:
    s, b = [], []
    for _ in range(ROUNDS):
        b.append(baseline())
        s.append(subject())
    return min(s), min(b)


def _engine_rows(label: str, fresh: Callable[[], Any], targets: bool) -> Iterator[Row]:
    free = _plan("bench-free", None, 0.0)
    roomy = _plan("bench-roomy", flow.Limits(concurrency=10**9), 0.0)
    limited, alone = _paired(
        lambda: trio.run(_run, fresh(), roomy), lambda: trio.run(_run, fresh(), free)
    )
    yield Row(
        f"flow control {label}: limits that never bind / none, s per flow ({FLOWS:,} flows)",
        limited,
        alone,
        1.25 if targets else float("inf"),
        note=f"{1 / limited:,.0f} flows/s against {1 / alone:,.0f} (target >= 0.8x)",
    )
    held = _plan("bench-held", None, HOLD)
    bound = _plan("bench-bound", flow.Limits(concurrency=BINDING), HOLD)
    peaks = []

    def binding() -> float:
        took = trio.run(_run, fresh(), bound)
        peaks.append(most["all"])
        return took

    tight, loose = _paired(binding, lambda: trio.run(_run, fresh(), held))
    yield Row(
        f"flow control {label}: concurrency={BINDING} binding / none, s per flow"
        f" ({HOLD * 1000:g} ms steps)",
        tight,
        loose,
        float("inf"),
        note=f"{1 / tight:,.0f} flows/s against {1 / loose:,.0f}",
    )
    yield Row(
        f"flow control {label}: concurrency={BINDING}, most step bodies in flight at once",
        float(max(peaks)),
        float(BINDING),
        1.0,
        unit="flows",
        note=f"exactly {BINDING}" if min(peaks) == max(peaks) == BINDING else f"peaks {peaks}",
    )


def _fleet_rows(fresh: Callable[[], Any]) -> Iterator[Row]:
    keyed = _plan("bench-keyed", flow.Limits(key=lambda d: d["k"], per_key=1), HOLD)
    peaks: list[int] = []

    def three() -> float:
        took = trio.run(partial(_run, fresh(), keyed, 3, keyed=True))
        peaks.append(max(n for k, n in most.items() if k.startswith("k:")))
        return took

    def one() -> float:
        took = trio.run(partial(_run, fresh(), keyed, 1, keyed=True))
        peaks.append(max(n for k, n in most.items() if k.startswith("k:")))
        return took

    fleet, single = _paired(three, one)
    yield Row(
        f"flow control postgres: 3 engines / 1, per_key=1 over {KEYS} keys, s per flow",
        fleet,
        single,
        float("inf"),
        note=f"{1 / fleet:,.0f} flows/s against {1 / single:,.0f}; most of one key at once:"
        f" {max(peaks)} (limit 1)",
    )


def _depth_row(label: str, fresh: Callable[[], Any]) -> Row:
    deep, shallow = _paired(
        lambda: trio.run(_depth, fresh(), DEEP), lambda: trio.run(_depth, fresh(), SHALLOW)
    )
    return Row(
        f"flow control {label}: an end that admits the next, {DEEP:,} queued / {SHALLOW:,}",
        deep,
        shallow,
        1.5,
    )


def benchmarks() -> Iterator[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-control-") as name:
        tmp = Path(name)
        count = iter(range(1_000_000))

        def fresh() -> str:
            return str(tmp / f"r{next(count)}.db")

        yield _depth_row("sqlite", fresh)
        yield from _engine_rows("sqlite", fresh, True)
    bindir = pg.find_binaries()
    if bindir is None:
        print(f"PostgreSQL rows skipped: {pg.SKIP_REASON}")
        return
    server = pg.start(bindir, DURABLE)
    try:

        def fresh_pg() -> str:
            return "pg:" + server.fresh_schema_dsn("fc")

        yield _depth_row("postgres", fresh_pg)
        yield from _engine_rows("postgres, 1 engine", fresh_pg, False)
        yield from _fleet_rows(fresh_pg)
    finally:
        server.stop()
