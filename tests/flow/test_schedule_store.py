"""Schedules in the store (`_store/_schedules.py`, docs/adr/0144, 0146), against SQLite and the
suite's PostgreSQL: the table and its index; declaring (new, the same, replaced: a pause kept);
the firing transaction (the tick's flow and the next tick in one write, a second start of one
tick running nothing, a stale claim writing nothing, a rolled-back firing leaving nothing);
exactly once when two connections fire one due schedule at once; 10,000 schedules due on one
minute fired in claims of 500 with the statements per tick the same as for 100; a wall clock
that jumps 78 minutes starting one tick; pause, unpause, trigger, unschedule, backfill, the
overlap rules and the skipped/missed counters.

Each test fails on a store that gets its part wrong (checked by planting each): the
exactly-once test with rows read but not held (no ``FOR UPDATE``, no ``SKIP LOCKED``: both
transactions fire the tick), the statement count with a firing that reads every stored schedule, the
clock jump with a firing whose next tick is the one after the tick started (a burst)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import pytest
import trio

from ferry import flow
from ferry.flow._model import _machine, _schedule
from ferry.flow._model._values import Shape
from ferry.flow._store import _batch, _op, _schema, _sql
from ferry.flow._store import _schedules as sch
from ferry.flow._store import _store as s
from ferry.flow._store._cron import Schedule
from ferry.projected import PostgresStore, Store, Tx
from tests.stores.conftest import StoreFactory

T = TypeVar("T")

report = flow.Plan("report", version=1)


@report.step
async def write(ctx: flow.Context) -> None:
    pass


SHAPE: Shape = report._close()
SHAPES = {(SHAPE.name, SHAPE.version): SHAPE}
MINUTE0 = 1_796_169_600.0  # 2026-12-02T00:00:00Z


def minutely(name: str = "every", **kwargs: Any) -> Schedule:
    return Schedule(name, report, cron="* * * * *", **kwargs)


@pytest.fixture
async def store(make_store: StoreFactory) -> Store:
    st = make_store()
    await st.transact(_schema.create_schema)
    return st


async def tx(store: Store, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    return await store.transact(lambda t: fn(t, *args, **kwargs))


def run(t: Tx, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    return t.execute(sql, params)


async def flow_ids(store: Store) -> list[str]:
    rows = await tx(store, lambda t: t.execute(f"SELECT flow_id FROM {_sql.FLOWS} ORDER BY 1"))
    return [r[0] for r in rows]


async def row(store: Store, name: str) -> _schedule.Row:
    got = await tx(store, sch.stored, name)
    assert got is not None
    return got.row


async def end_flow(store: Store, flow_id: str) -> None:
    await tx(
        store,
        lambda t: t.execute(
            f"UPDATE {_sql.FLOWS} SET state = 'COMPLETED' WHERE flow_id = ?", (flow_id,)
        ),
    )


# ---------------------------------------------------------------------------- table, declare


async def test_the_table_is_created_once_with_its_index_on_the_next_tick(store: Store) -> None:
    await tx(store, _schema.create_schema)
    await tx(store, _schema.create_schema)
    assert await tx(store, sch.stored_all) == []
    assert await tx(store, sch.next_due, [("report", 1)]) is None


async def test_declaring_stores_a_new_schedule_keeps_the_same_and_replaces_a_changed_one(
    store: Store,
) -> None:
    now = MINUTE0 + 10
    said = await tx(store, sch.declare, [minutely(), minutely("other")], now)
    assert said == {"every": "new", "other": "new"}
    first = await row(store, "every")
    assert (first.revision, first.next_tick, first.paused) == (1, MINUTE0 + 60, False)
    assert await tx(store, sch.declare, [minutely()], now + 100) == {"every": "same"}
    assert await row(store, "every") == first
    await tx(store, sch.pause, "every", now + 100)
    changed = Schedule("every", report, cron="*/5 * * * *", data={"k": 1})
    assert await tx(store, sch.declare, [changed], now + 200) == {"every": "replaced"}
    replaced = await tx(store, sch.stored, "every")
    assert replaced is not None
    assert replaced.definition == changed.definition()
    assert replaced.row.paused, "a replaced schedule that was paused stays paused"
    assert replaced.row.next_tick == MINUTE0 + 300
    assert replaced.row.revision == first.revision + 2
    assert [x.row.name for x in await tx(store, sch.stored_all)] == ["every", "other"]


# ------------------------------------------------------------------------------------- firing


async def test_a_firing_starts_the_ticks_flow_and_moves_the_next_tick_in_one_write(
    store: Store,
) -> None:
    await tx(store, sch.declare, [minutely(data={"kind": "x"})], MINUTE0 - 30)
    assert await tx(store, sch.fire_due, MINUTE0 - 1, SHAPES) == [], "not due yet"
    (out,) = await tx(store, sch.fire_due, MINUTE0 + 0.5, SHAPES, owner="e1")
    assert out.created and out.flow_id == "every@2026-12-02T00:00:00Z"
    started = await tx(store, s.load, out.flow_id)
    assert started is not None and started.owner == "e1"
    assert json.loads(started.data) == {"kind": "x", "scheduled_at": "2026-12-02T00:00:00Z"}
    r = await row(store, "every")
    assert (r.next_tick, r.last_tick, r.last_flow, r.revision) == (
        MINUTE0 + 60,
        MINUTE0,
        out.flow_id,
        2,
    )
    assert await tx(store, sch.fire_due, MINUTE0 + 0.5, SHAPES) == [], "fired already"
    assert await tx(store, sch.next_due, [("report", 1)]) == MINUTE0 + 60
    assert await tx(store, sch.next_due, [("other", 1)]) is None


async def test_a_stale_claim_writes_nothing_and_a_second_start_of_a_tick_runs_nothing(
    store: Store,
) -> None:
    await tx(store, sch.declare, [minutely()], MINUTE0 - 30)
    claims = await tx(store, sch.claim, MINUTE0, [("report", 1)])
    assert claims == [sch.Claim(name="every", revision=1)]
    (first,) = await tx(store, sch.fire, claims, MINUTE0, SHAPES)
    (again,) = await tx(store, sch.fire, claims, MINUTE0, SHAPES)
    assert first.written and first.created
    assert not again.written and again.result is None
    assert await flow_ids(store) == ["every@2026-12-02T00:00:00Z"]
    # A trigger in the second of the next tick started its flow: the tick is the same start.
    await end_flow(store, "every@2026-12-02T00:00:00Z")
    trig = await tx(store, sch.trigger, "every", MINUTE0 + 60.2, SHAPES)
    assert trig is not None and trig.created
    await end_flow(store, "every@2026-12-02T00:01:00Z")
    (tick,) = await tx(store, sch.fire_due, MINUTE0 + 60.7, SHAPES)
    assert isinstance(tick.result, _op.Existing) and tick.result.same
    assert (await row(store, "every")).next_tick == MINUTE0 + 120


async def test_a_rolled_back_firing_leaves_nothing(store: Store) -> None:
    await tx(store, sch.declare, [minutely()], MINUTE0 - 30)
    before = await row(store, "every")

    def fire_then_fail(t: Tx) -> None:
        (out,) = sch.fire_due(t, MINUTE0 + 1, SHAPES)
        assert out.created
        raise RuntimeError("the process died before the commit")

    with pytest.raises(RuntimeError, match="died"):
        await store.transact(fire_then_fail)
    assert await row(store, "every") == before
    assert await flow_ids(store) == []
    (out,) = await tx(store, sch.fire_due, MINUTE0 + 1, SHAPES)
    assert out.created, "the next firing starts the tick"


async def test_a_wall_clock_that_jumps_78_minutes_starts_at_most_one_tick(store: Store) -> None:
    await tx(store, sch.declare, [minutely()], MINUTE0 - 30)
    (first,) = await tx(store, sch.fire_due, MINUTE0 + 1, SHAPES)
    assert first.created and first.flow_id is not None
    await end_flow(store, first.flow_id)
    jumped = MINUTE0 + 1 + 78 * 60
    outs = await tx(store, sch.fire_due, jumped, SHAPES)
    assert [o.flow_id for o in outs] == ["every@2026-12-02T01:18:00Z"]
    assert await tx(store, sch.fire_due, jumped, SHAPES) == []
    r = await row(store, "every")
    assert r.next_tick == MINUTE0 + 79 * 60
    assert r.missed == 77, "the ticks 00:01 .. 01:17 are counted as missed"
    assert len(await flow_ids(store)) == 2


# --------------------------------------------------------------------- exactly once, at once


def _on_postgres(store: Store) -> None:
    if not isinstance(store, PostgresStore):
        pytest.skip("two connections at once: a PostgreSQL store (SQLite has one writer)")


async def test_two_connections_firing_one_due_schedule_at_once_start_it_once(
    make_store: StoreFactory,
) -> None:
    """Two transactions on two connections (two worker threads) each claim and fire the due
    schedule at the same moment, again and again; one of them starts each tick. Both the
    claim-and-fire in one (`fire_due`, the second skips the held row) and the two-step fire of
    one claim read by both (`fire`, the second waits for the row and finds a new revision)."""
    st = make_store()
    _on_postgres(st)
    await st.transact(_schema.create_schema)
    await tx(st, sch.declare, [minutely(overlap="allow")], MINUTE0 - 30)
    created = 0
    for minute in range(6):
        now = MINUTE0 + 60 * minute + 1
        barrier = threading.Barrier(2, timeout=10)
        claims = await tx(st, sch.claim, now, [("report", 1)])

        def at_once(
            t: Tx,
            two_step: bool,
            now: float = now,
            b: threading.Barrier = barrier,
            c: Sequence[sch.Claim] = claims,
        ) -> list[sch.Outcome]:
            b.wait()
            return sch.fire(t, c, now, SHAPES) if two_step else sch.fire_due(t, now, SHAPES)

        results: list[list[sch.Outcome]] = []

        async def one(two_step: bool, results: list[list[sch.Outcome]] = results) -> None:
            results.append(await st.transact(partial(at_once, two_step=two_step)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, minute % 2 == 1)
            nursery.start_soon(one, minute % 2 == 1)
        wrote = [o for outs in results for o in outs if o.written]
        assert len(wrote) == 1, (minute, results)
        assert wrote[0].created and wrote[0].flow_id == _schedule.tick_id("every", now - 1)
        created += 1
    assert len(await flow_ids(st)) == created == 6


# ------------------------------------------------------------------------ 10,000 on one minute


class Counting:
    """A `Tx` that counts the statements it sends (an `executemany` row by row)."""

    def __init__(self, tx: Tx) -> None:
        self.tx = tx
        self.n = 0

    @property
    def dialect(self) -> str:
        return self.tx.dialect

    @property
    def connection(self) -> Any:
        return self.tx.connection

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.n += 1
        return self.tx.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.n += len(rows)
        self.tx.executemany(sql, rows)


@contextmanager
def counted(t: Tx) -> Iterator[Counting]:
    """Count the statements the transaction runs: on SQLite every statement the library runs
    (its trace: the batch's writer also runs some on the connection), on PostgreSQL every one
    sent through the `Tx` (all of them)."""
    c = Counting(t)
    conn = t.connection
    if not hasattr(conn, "set_trace_callback"):
        yield c
        return
    c.execute, c.executemany = t.execute, t.executemany  # type: ignore[method-assign]

    def traced(_sql: str) -> None:
        c.n += 1

    conn.set_trace_callback(traced)
    try:
        yield c
    finally:
        conn.set_trace_callback(None)


async def fire_all(store: Store, now: float) -> tuple[int, int, int]:
    """Fire every due schedule as the engine will: claims of `CLAIM` until one comes back
    short. (ticks started, transactions, statements)."""
    started = claims = statements = 0
    while True:

        def one(t: Tx) -> tuple[int, int]:
            with counted(t) as c:
                outs = sch.fire_due(c, now, SHAPES)
            return sum(o.created for o in outs), c.n

        got, n = await store.transact(one)
        claims += 1
        started += got
        statements += n
        if got < sch.CLAIM:
            return started, claims, statements


async def per_tick_costs(st: Store, sizes: Sequence[int]) -> list[float]:
    """For each of `sizes`: that many schedules (two expressions) due on one minute, every
    tick started in claims of `CLAIM`; the statements per tick."""
    await st.transact(_schema.create_schema)
    per_tick = []
    for n in sizes:
        for table in (sch.SCHEDULES, _sql.FLOWS, _sql.HISTORY):
            await tx(st, run, f"DELETE FROM {table}")
        crons = ("* * * * *", "*/2 * * * *")
        schedules = [Schedule(f"s{i}", report, cron=crons[i % 2]) for i in range(n)]
        await tx(st, sch.declare, schedules, MINUTE0 - 30)
        began = time.perf_counter()
        started, claims, statements = await fire_all(st, MINUTE0 + 1)
        took = time.perf_counter() - began
        print(f"\n{n} due: {claims} claims, {statements / n:.2f} statements a tick, {took:.2f} s")
        assert (started, claims) == (n, n // sch.CLAIM + 1)
        assert len(await flow_ids(st)) == n
        per_tick.append(statements / n)
    return per_tick


async def test_schedules_due_on_one_minute_fire_in_claims_at_a_constant_cost(
    make_store: StoreFactory,
) -> None:
    """100 and then 10,000 schedules (2,000 on PostgreSQL: the 10,000 are the long test's) due
    on one minute: every tick starts, in claims of 500, and the statements per tick are at
    most 1.5x of 100's (a claim per schedule, or a scan per claim, would grow them)."""
    st = make_store()
    big = 2_000 if isinstance(st, PostgresStore) else 10_000
    small, large = await per_tick_costs(st, (100, big))
    assert large <= 1.5 * small, (small, large)


@pytest.mark.long
async def test_ten_thousand_schedules_due_on_one_minute_on_postgresql(
    make_store: StoreFactory,
) -> None:
    st = make_store()
    if not isinstance(st, PostgresStore):
        pytest.skip("SQLite's 10,000 are the default test's")
    small, large = await per_tick_costs(st, (100, 10_000))
    assert large <= 1.5 * small, (small, large)


async def test_the_claim_reads_an_index_range_not_every_schedule(store: Store) -> None:
    """100 due among 10,000 whose next tick is a day away: one claim fires the 100, and on
    SQLite the claim's plan is a search of the index of due ticks (a range, not a scan)."""
    later = [Schedule(f"daily{i}", report, cron="0 0 * * *") for i in range(10_000)]
    await tx(store, sch.declare, later, MINUTE0 + 1)
    await tx(store, sch.declare, [minutely(f"m{i}") for i in range(100)], MINUTE0 - 30)
    started, claims, _statements = await fire_all(store, MINUTE0 + 1)
    assert (started, claims) == (100, 1)

    if isinstance(store, PostgresStore):
        return

    def plan(t: Tx) -> str:
        sql = (
            f"EXPLAIN QUERY PLAN SELECT s.name FROM {sch.SCHEDULES} AS s INDEXED BY"
            f" {sch.DUE_INDEX} WHERE s.paused = 0 AND s.next_tick <= ? ORDER BY s.next_tick"
            " LIMIT 500"
        )
        return " ".join(str(r[-1]) for r in t.execute(sql, (MINUTE0,)))

    text = await store.transact(plan)
    assert f"SEARCH s USING INDEX {sch.DUE_INDEX} (next_tick<?)" in text, text


# ------------------------------------------------------------- pause, trigger, overlap, rest


async def test_a_paused_schedule_fires_only_by_trigger_and_unpausing_counts_no_miss(
    store: Store,
) -> None:
    await tx(store, sch.declare, [minutely()], MINUTE0 - 30)
    paused = await tx(store, sch.pause, "every", MINUTE0 - 10)
    assert paused is not None and paused.paused
    assert await tx(store, sch.fire_due, MINUTE0 + 600, SHAPES) == []
    assert await tx(store, sch.next_due, [("report", 1)]) is None
    trig = await tx(store, sch.trigger, "every", MINUTE0 + 600.4, SHAPES)
    assert trig is not None and trig.flow_id == "every@2026-12-02T00:10:00Z" and trig.created
    again = await tx(store, sch.trigger, "every", MINUTE0 + 600.9, SHAPES)
    assert again is not None and not again.written, "a second trigger in that second"
    unpaused = await tx(store, sch.unpause, "every", MINUTE0 + 3600 + 5)
    assert unpaused is not None and not unpaused.paused
    assert unpaused.next_tick == MINUTE0 + 3660 and unpaused.missed == 0
    assert await tx(store, sch.pause, "nope", MINUTE0) is None
    assert await tx(store, sch.trigger, "nope", MINUTE0, SHAPES) is None


async def test_skip_counts_a_tick_while_the_flow_runs_and_queue_keeps_one_waiting(
    store: Store,
) -> None:
    await tx(store, sch.declare, [minutely("skip"), minutely("queue", overlap="queue")], 0.0)
    await tx(store, lambda t: t.execute(f"UPDATE {sch.SCHEDULES} SET next_tick = ?", (MINUTE0,)))
    assert len(await tx(store, sch.fire_due, MINUTE0 + 1, SHAPES)) == 2
    outs = await tx(store, sch.fire_due, MINUTE0 + 61, SHAPES)
    assert [o.created for o in outs] == [False, False]
    assert (await row(store, "skip")).skipped == 1
    assert (await row(store, "queue")).waiting_tick == MINUTE0 + 60
    await tx(store, sch.fire_due, MINUTE0 + 121, SHAPES)
    assert (await row(store, "queue")).skipped == 1, "a second waiting tick is skipped"
    assert await tx(store, sch.waiting_ready) == []
    nothing = await tx(store, sch.start_waiting, "queue", MINUTE0 + 122, SHAPES)
    assert nothing is not None and not nothing.written, "its flow still runs"
    await end_flow(store, "queue@2026-12-02T00:00:00Z")
    assert await tx(store, sch.waiting_ready) == ["queue"]
    waited = await tx(store, sch.start_waiting, "queue", MINUTE0 + 123, SHAPES)
    assert waited is not None and waited.flow_id == "queue@2026-12-02T00:01:00Z" and waited.created
    assert (await row(store, "queue")).waiting_tick is None


async def backfilled(store: Store, start: float, end: float, now: float) -> int:
    results = await tx(store, sch.backfill, "every", start, end, now, SHAPES)
    assert results is not None
    return sum(isinstance(r, _op.Created) for r in results)


async def test_backfill_starts_each_tick_of_its_span_once_and_leaves_the_row(
    store: Store,
) -> None:
    await tx(store, sch.declare, [minutely()], MINUTE0 + 3600)
    before = await row(store, "every")
    assert await backfilled(store, MINUTE0, MINUTE0 + 600, MINUTE0 + 3600) == 11
    assert await backfilled(store, MINUTE0, MINUTE0 + 900, MINUTE0 + 3600) == 5
    assert await row(store, "every") == before
    assert len(await flow_ids(store)) == 16
    with pytest.raises(ValueError, match="more than"):
        await tx(store, sch.backfill, "every", 0.0, MINUTE0, MINUTE0, SHAPES)
    assert await tx(store, sch.backfill, "nope", 0.0, 1.0, MINUTE0, SHAPES) is None


async def test_unschedule_removes_the_row_and_keeps_its_flows(store: Store) -> None:
    await tx(store, sch.declare, [minutely()], MINUTE0 - 30)
    await tx(store, sch.fire_due, MINUTE0 + 1, SHAPES)
    assert await tx(store, sch.unschedule, "every")
    assert not await tx(store, sch.unschedule, "every")
    assert await tx(store, sch.stored, "every") is None
    assert await flow_ids(store) == ["every@2026-12-02T00:00:00Z"]
    assert await tx(store, sch.declare, [minutely()], MINUTE0 + 5) == {"every": "new"}


async def test_a_tick_whose_id_another_flow_holds_is_not_started_and_the_row_moves_on(
    store: Store,
) -> None:
    """A flow started by hand under the tick's id with other data: the firing starts nothing
    (the batch answers `Existing(same=False)`) and says so; an engine without the schedule's
    plan neither claims nor fires it."""
    await tx(store, sch.declare, [minutely()], MINUTE0 - 30)
    taken = _op.Create(
        _machine.start(SHAPE, "every@2026-12-02T00:00:00Z", '{"mine":true}', MINUTE0 - 5)
    )
    await tx(store, _batch.write_batch, [taken])
    other = Shape("other", 1, ("a",), (False,), (1,))
    assert await tx(store, sch.fire_due, MINUTE0 + 1, {("other", 1): other}) == []
    claims = await tx(store, sch.claim, MINUTE0 + 1, [("report", 1)])
    (lacking,) = await tx(store, sch.fire, claims, MINUTE0 + 1, {("other", 1): other})
    assert not lacking.written
    (out,) = await tx(store, sch.fire, claims, MINUTE0 + 1, SHAPES)
    assert isinstance(out.result, _op.Existing) and not out.result.same and not out.created
    assert (await row(store, "every")).next_tick == MINUTE0 + 60
