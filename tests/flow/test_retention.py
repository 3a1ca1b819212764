"""Retention of finished flows (ADR 0085): ``open_engine(retain=)`` and the purge behind it.

The rule (docs/adr/0085): a `COMPLETED` or `FAILED` flow is deleted, with its history and its
mailbox, `retain` seconds after it ended; parked, running, compensating and blocked flows are
kept whatever their age; the deletes go in transactions of at most 500 flows, from any engine of
a fleet at once. The rule itself is tested through ``open_engine(path)`` under
`MockClock(autojump_threshold=0)` (deterministic); both real stores, an older store's schema,
two engines purging at once on PostgreSQL, and a purge of many flows beside a busy writer run on
the real stores, with the old flows written straight into the tables (`seed`).
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from ferry.flow._runtime import _retention
from ferry.flow._store import _purge, _schema
from ferry.projected import PostgresStore, SqliteStore
from tests import pg

from ._helpers import PlantedStore, _InlineTx

T0 = 1_700_000_000.0
DAY = 86400.0


def plan_of(name: str = "order") -> flow.Plan:
    """reserve -> confirm (parks until woken, unless data says "no_park"; fails if data says
    "fail") -> ship. `refund` compensates reserve."""
    plan = flow.Plan(name)

    async def refund(ctx: flow.Context) -> None:
        pass

    @plan.step(compensate=refund)
    async def reserve(ctx: flow.Context) -> None:
        pass

    @plan.step
    async def confirm(ctx: flow.Context) -> flow.Outcome | None:
        if ctx.data.get("fail"):
            return flow.fail("declined")
        if ctx.wake is None and not ctx.data.get("no_park"):
            return flow.park()
        return None

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        pass

    return plan


def file_counts(path: Path, flow_id: str) -> tuple[int, int, int]:
    """(flows, history rows, mailbox rows) of `flow_id` in the SQLite file, read beside the
    engine through a connection of its own."""
    conn = sqlite3.connect(path)
    try:
        return table_counts_of(_InlineTx(conn), flow_id)
    finally:
        conn.close()


def table_counts_of(tx: Any, flow_id: str) -> tuple[int, int, int]:
    def n(table: str) -> int:
        sql = f"SELECT COUNT(*) FROM flow_{table} WHERE flow_id = ?"
        return int(tx.execute(sql, (flow_id,))[0][0])

    return n("flows"), n("history"), n("mailbox")


# ------------------------------------------------------------------------------ the option


@pytest.mark.parametrize("retain", [0, -1.0, math.inf, math.nan, "30", True, [1]])
async def test_retain_must_be_a_finite_number_of_seconds_or_none(
    tmp_path: Path, retain: Any
) -> None:
    with pytest.raises(ValueError, match=r"retain must be a finite number of seconds > 0"):
        async with flow.open_engine(tmp_path / "r.db", plans=[plan_of()], retain=retain):
            pass  # pragma: no cover
    assert not (tmp_path / "r.db").exists()  # refused before anything was opened


# --------------------------------------------------------------------------------- the rule


async def test_finished_flows_go_retain_seconds_after_they_ended_and_the_rest_stay(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Completed and failed flows (with history and mailbox) go once `retain` has passed since
    they ended, not before; parked and blocked flows stay, however old. Afterwards the id is
    unknown (a wake is UNKNOWN) and may be started again, as a new flow."""
    path = tmp_path / "r.db"
    plan, other = plan_of(), plan_of("other")
    retain = 3600.0
    async with flow.open_engine(path, plans=[plan, other], retain=retain) as engine:
        await engine.start(plan, flow_id="done")
        await engine.start(plan, flow_id="failed", data={"fail": True})
        await engine.start(plan, flow_id="parked")
        await engine.start(other, flow_id="blocked")
        await engine.wait("failed", timeout=60)
        await trio.testing.wait_all_tasks_blocked()
        assert await engine.wake("done", {"ok": 1}, message_id="m1") is flow.Delivery.RESUMED
        assert (await engine.wait("done", timeout=60)).state is flow.State.COMPLETED
    # "blocked": reopened without its plan, the flow blocks at its wake.
    async with flow.open_engine(path, plans=[plan], retain=retain) as e:
        assert await e.wake("blocked", message_id="b1") is flow.Delivery.QUEUED
        assert file_counts(path, "done") == (1, 7, 1)
        # Not yet (a margin for the real time between the two engines' opens: an engine's
        # wall clock is the real time at its open plus the mock clock's time since).
        await trio.sleep(retain - 60)
        assert file_counts(path, "done") == (1, 7, 1)
        assert e.statistics().purged == 0
        await trio.sleep(60 + 2 * _retention.EVERY_MAX)
        assert e.statistics().purged == 2
        for fid in ("done", "failed"):
            assert file_counts(path, fid) == (0, 0, 0)
            assert await e.get(fid) is None
            assert await e.wake(fid, message_id="m1") is flow.Delivery.UNKNOWN
        parked, blocked = await e.get("parked"), await e.get("blocked")
        assert parked is not None and parked.state is flow.State.PARKED
        assert blocked is not None and blocked.state is flow.State.BLOCKED
        assert file_counts(path, "blocked")[2] == 1  # its queued wake is kept
        # The id is free again: a new flow, from revision 1, with a history of its own.
        await e.start(plan, flow_id="done", data={"no_park": True})
        snap = await e.wait("done", timeout=60)
        assert snap.state is flow.State.COMPLETED and snap.data == {"no_park": True}
        first = (await e.history("done"))[0]
        assert first.kind == "started" and first.revision == 1


async def test_retain_none_keeps_every_flow(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "r.db"
    plan = plan_of()
    async with flow.open_engine(path, plans=[plan], retain=None) as e:
        await e.start(plan, flow_id="done", data={"no_park": True})
        await e.wait("done", timeout=60)
        await trio.sleep(365 * DAY)
        assert file_counts(path, "done") == (1, 5, 0)
        assert e.statistics().purged == 0


class BusyStore(PlantedStore):
    """A planted store whose next `busy` transactions find the database locked (SQLite's
    SQLITE_BUSY: the store is unavailable now, which the engine retries)."""

    busy = 0

    async def transact(self, fn: Any) -> Any:
        if self.busy:
            self.busy -= 1
            await trio.lowlevel.checkpoint()
            raise sqlite3.OperationalError("database is locked")
        return await super().transact(fn)


async def test_an_unavailable_store_is_retried_with_a_warning(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = BusyStore(str(tmp_path / "r.db"))
    plan = plan_of()
    retain = 60.0
    try:
        async with flow.open_engine(store, plans=[plan], retain=retain) as e:
            await e.start(plan, flow_id="done", data={"no_park": True})
            await e.wait("done", timeout=60)
            await trio.testing.wait_all_tasks_blocked()
            with caplog.at_level(logging.WARNING, logger="ferry.flow"):
                store.busy = 1  # the next transaction is the retention task's
                await trio.sleep(retain + 4 * _retention.EVERY_MAX)
            assert e.statistics().purged == 1
            warned = [r for r in caplog.records if "(retention)" in r.getMessage()]
            assert len(warned) == 1 and warned[0].levelno == logging.WARNING
            assert "flow store unavailable while purging finished flows" in warned[0].getMessage()
    finally:
        await store.aclose()


# --------------------------------------------------------------------- the real stores


def _series(dialect: str, n: int) -> str:
    """SQL: a row source of ``i`` from 1 to `n`."""
    if dialect == "postgres":
        return f"generate_series(1, {int(n)}) AS s(i)"
    return (
        "(WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s"
        f" WHERE i < {int(n)}) SELECT i FROM s)"
    )


def seed(tx: Any, prefix: str, n: int, state: str, at: float) -> None:
    """`n` flows ``{prefix}{i}`` of plan "order" in `state`, last written at `at`, each with
    three history rows and one mailbox row, written straight into the tables."""
    _schema.create_schema(tx)
    step = "NULL" if state in ("COMPLETED", "FAILED") else "'confirm'"
    blocked = "'a reason'" if state == "BLOCKED" else "NULL"
    blocked_from = "'PARKED'" if state == "BLOCKED" else "NULL"
    tx.execute(
        "INSERT INTO flow_flows (flow_id, plan, version, state, step_index, step, attempt, data,"
        " revision, updated_at, error, park_deadline, on_timeout, wake, timed_out, stack,"
        " blocked, blocked_from, owner, lease_until, start_data, created_at)"
        f" SELECT ? || i, 'order', 1, ?, 1, {step}, 1, '{{}}', 3, ?, NULL, NULL, NULL, NULL, 0,"
        f" '', {blocked}, {blocked_from}, NULL, NULL, '{{}}', ? FROM {_series(tx.dialect, n)}",
        (prefix, state, at, at),
    )
    for kind in ("started", "step", "completed"):
        tx.execute(
            "INSERT INTO flow_history (flow_id, revision, n, at, kind, step, attempt, detail)"
            f" SELECT flow_id, 1, {('started', 'step', 'completed').index(kind)}, updated_at, ?,"
            " NULL, NULL, NULL FROM flow_flows WHERE flow_id LIKE ?",
            (kind, f"{prefix}%"),
        )
    tx.execute(
        "INSERT INTO flow_mailbox (flow_id, message_id, payload, status, at)"
        " SELECT flow_id, 'm', 'null', 'TAKEN', updated_at FROM flow_flows WHERE flow_id LIKE ?",
        (f"{prefix}%",),
    )


def totals(tx: Any, prefix: str) -> tuple[int, int, int]:
    """(flows, history rows, mailbox rows) of the flows whose id starts with `prefix`."""
    like = (f"{prefix}%",)
    return (
        int(tx.execute("SELECT COUNT(*) FROM flow_flows WHERE flow_id LIKE ?", like)[0][0]),
        int(tx.execute("SELECT COUNT(*) FROM flow_history WHERE flow_id LIKE ?", like)[0][0]),
        int(tx.execute("SELECT COUNT(*) FROM flow_mailbox WHERE flow_id LIKE ?", like)[0][0]),
    )


async def until_purged(engines: list[flow.Engine], n: int, limit: float = 120.0) -> None:
    """Wait (polling the engines' counters) until they purged `n` flows between them."""
    with trio.fail_after(limit):
        while sum(e.statistics().purged for e in engines) < n:  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_both_stores_purge_old_finished_flows_and_nothing_else(make_store: Any) -> None:
    store = make_store()
    old = time.time() - 2 * DAY
    await store.transact(partial(seed, prefix="done-", n=1200, state="COMPLETED", at=old))
    await store.transact(partial(seed, prefix="failed-", n=30, state="FAILED", at=old))
    await store.transact(partial(seed, prefix="parked-", n=20, state="PARKED", at=old))
    await store.transact(partial(seed, prefix="blocked-", n=20, state="BLOCKED", at=old))
    await store.transact(partial(seed, prefix="new-", n=10, state="COMPLETED", at=time.time()))
    async with flow.open_engine(store, plans=[plan_of()], retain=DAY) as engine:
        await until_purged([engine], 1230)
        for prefix, left in [
            ("done-", 0),
            ("failed-", 0),
            ("parked-", 20),
            ("blocked-", 20),
            ("new-", 10),
        ]:
            assert await store.transact(partial(totals, prefix=prefix)) == (left, 3 * left, left)
        assert engine.statistics().purged == 1230
        assert await engine.wake("done-1") is flow.Delivery.UNKNOWN


def old_schema(tx: Any) -> None:
    """The flow tables as stores made before retention and traces have them."""
    for statement in _schema.ddl(tx.dialect):
        if "_flows_ended" not in statement:
            tx.execute(statement.replace(",\n            trace TEXT)", ")"))


def has_trace_and_ended_index(tx: Any) -> tuple[bool, bool]:
    if tx.dialect == "postgres":
        row = tx.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('flow_flows')"
            " AND attname = 'trace'), to_regclass('flow_flows_ended') IS NOT NULL"
        )[0]
        return bool(row[0]), bool(row[1])
    columns = {r[1] for r in tx.execute("PRAGMA table_info(flow_flows)")}
    index = tx.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'flow_flows_ended'"
    )
    return "trace" in columns, bool(index)


async def test_an_older_store_gets_the_trace_column_and_the_index(make_store: Any) -> None:
    store = make_store()
    await store.transact(old_schema)
    assert await store.transact(has_trace_and_ended_index) == (False, False)
    plan = plan_of()
    async with flow.open_engine(store, plans=[plan], retain=DAY) as engine:
        assert await store.transact(has_trace_and_ended_index) == (True, True)
        await engine.start(plan, flow_id="a", data={"no_park": True})
        assert (await engine.wait("a", timeout=30)).state is flow.State.COMPLETED
    async with flow.open_engine(make_store(), plans=[plan]) as engine:  # and again: no change
        assert (await engine.get("a")) is not None


async def test_two_engines_of_a_fleet_purge_at_once_nothing_twice_nothing_unfinished(
    pg_server: pg.PgServer,
) -> None:
    """Two engines on one PostgreSQL database purge 3,000 old finished flows at once: between
    them they delete each exactly once (their counts add up to it), and no parked or blocked
    flow goes, however old. Their batches are chosen with SKIP LOCKED: they do not queue on
    each other's rows."""
    dsn = pg_server.fresh_schema_dsn()
    seeding = PostgresStore(dsn, connections=1)
    old = time.time() - 2 * DAY
    try:
        await seeding.transact(partial(seed, prefix="done-", n=3000, state="COMPLETED", at=old))
        await seeding.transact(partial(seed, prefix="parked-", n=50, state="PARKED", at=old))
        await seeding.transact(partial(seed, prefix="blocked-", n=50, state="BLOCKED", at=old))
        stores = [PostgresStore(dsn, connections=2), PostgresStore(dsn, connections=2)]
        engines: list[flow.Engine] = []
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def serve(store: PostgresStore, owner: str) -> None:
                async with flow.open_engine(store, plans=[plan_of()], owner=owner, retain=DAY) as e:
                    engines.append(e)
                    await done.wait()

            nursery.start_soon(serve, stores[0], "a")
            nursery.start_soon(serve, stores[1], "b")
            with trio.fail_after(120):
                while len(engines) < 2:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            await until_purged(engines, 3000)
            await trio.sleep(0.2)  # a double count would show in the counters by now
            counts = [e.statistics().purged for e in engines]
            done.set()
        assert sum(counts) == 3000, counts
        assert await seeding.transact(partial(totals, prefix="done-")) == (0, 0, 0)
        assert await seeding.transact(partial(totals, prefix="parked-")) == (50, 150, 50)
        assert await seeding.transact(partial(totals, prefix="blocked-")) == (50, 150, 50)
        for s in stores:
            await s.aclose()
    finally:
        await seeding.aclose()


async def test_two_purges_at_once_take_disjoint_batches(pg_server: pg.PgServer) -> None:
    """The purge itself, twice at once in small batches on two connections: every flow is
    deleted by exactly one of them."""
    dsn = pg_server.fresh_schema_dsn()
    a, b = PostgresStore(dsn, connections=1), PostgresStore(dsn, connections=1)
    try:
        await a.transact(partial(seed, prefix="done-", n=2000, state="COMPLETED", at=T0))
        await a.transact(partial(seed, prefix="parked-", n=10, state="PARKED", at=T0))
        seen: dict[str, list[int]] = {"a": [], "b": []}
        async with trio.open_nursery() as nursery:
            for name, store in (("a", a), ("b", b)):
                nursery.start_soon(
                    partial(_retention.purge, store, T0 + 1, batch=50, on_batch=seen[name].append)
                )
        assert sum(seen["a"]) + sum(seen["b"]) == 2000
        assert max(seen["a"] + seen["b"]) <= 50
        assert seen["a"] and seen["b"]  # both purged, at once (each of 40 batches pauses)
        assert await a.transact(partial(totals, prefix="parked-")) == (10, 30, 10)
    finally:
        await a.aclose()
        await b.aclose()


# -------------------------------------------------------------------- no long lock


async def purge_beside_a_writer(
    store: Any, n: int, caplog: pytest.LogCaptureFixture
) -> tuple[list[int], list[float], int]:
    """An engine purges `n` old finished flows while a task starts (and runs) new flows as fast
    as the engine takes them. Returns the purge's batch sizes (from its DEBUG log), the writer's
    gaps between two accepted starts during the purge, and the flows started meanwhile."""
    await store.transact(
        partial(seed, prefix="old-", n=n, state="COMPLETED", at=time.time() - 2 * DAY)
    )
    plan = plan_of()
    gaps: list[float] = []
    started = 0
    with caplog.at_level(logging.DEBUG, logger="ferry.flow"):
        async with flow.open_engine(store, plans=[plan], retain=DAY) as engine:
            async with trio.open_nursery() as nursery:

                async def writer() -> None:
                    nonlocal started
                    last = trio.current_time()
                    i = 0
                    while True:
                        i += 1
                        await engine.start(plan, flow_id=f"new-{i}", data={"no_park": True})
                        now = trio.current_time()
                        if engine.statistics().purged < n:
                            gaps.append(now - last)
                            started += 1
                        last = now

                nursery.start_soon(writer)
                await until_purged([engine], n, limit=600)
                nursery.cancel_scope.cancel()
    batches = [
        r.__dict__["purged"] for r in caplog.records if r.getMessage().startswith("purge: deleted")
    ]
    return batches, gaps, started


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_purge_is_small_transactions_and_a_writer_goes_on(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    """1,600 old flows go in transactions of at most 500 flows each, while an engine's starts
    go on between them."""
    n = 1600
    if kind == "sqlite":
        store: Any = SqliteStore(tmp_path / "r.db", synchronous="NORMAL")
    else:
        server: pg.PgServer = request.getfixturevalue("pg_server")
        store = PostgresStore(server.fresh_schema_dsn(), connections=4)
    try:
        batches, gaps, started = await purge_beside_a_writer(store, n, caplog)
    finally:
        await store.aclose()
    assert sum(batches) == n and max(batches) <= _purge.BATCH
    assert started >= len(batches) // 2, (started, len(batches))
    print(
        f"{kind}: {len(batches)} batches, {started} starts meanwhile, longest gap {max(gaps):.3f} s"
    )


@pytest.mark.long
async def test_a_purge_of_100k_flows_never_stalls_a_writer_for_long(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """100,000 old flows on SQLite (one writer at a time: the worst case for a long lock): the
    longest wait between two of a writer's starts during the purge stays far below what one
    transaction of every flow would take (a generous bound for a loaded machine)."""
    store = SqliteStore(tmp_path / "r.db", synchronous="NORMAL")
    try:
        batches, gaps, started = await purge_beside_a_writer(store, 100_000, caplog)
    finally:
        await store.aclose()
    assert sum(batches) == 100_000 and max(batches) <= _purge.BATCH
    assert started >= len(batches) // 2
    assert max(gaps) < 2.0, max(gaps)
    print(
        f"100k: {len(batches)} batches, {started} starts meanwhile, longest gap {max(gaps):.3f} s"
    )
