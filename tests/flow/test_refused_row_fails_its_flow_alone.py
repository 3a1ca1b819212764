"""A row the database refuses is its flow's alone (ADR 0063), on SQLite (a trigger that refuses
one row) and on PostgreSQL (where a failed statement aborts the whole transaction): a refused
start fails at its call alone, a refused step write fails that flow alone."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import trio
import trio.testing

import ferry
from ferry import flow
from ferry.projected import PostgresStore
from tests import pg


def _refuse_poison(path: str) -> None:
    """Triggers that make SQLite refuse any flow row whose data holds "poison" (a constraint of
    the database's own, which no check of the engine knows about)."""
    with sqlite3.connect(path) as conn:
        for event in ("INSERT", "UPDATE"):
            conn.execute(
                f"CREATE TRIGGER refuse_{event.lower()} BEFORE {event} ON flow_flows"
                " WHEN NEW.data LIKE '%poison%' BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
            )


async def test_a_start_the_database_refuses_fails_no_neighbour(tmp_path: Path) -> None:
    path = str(tmp_path / "flows.db")
    plan = flow.Plan("refused", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    errors: dict[str, BaseException] = {}

    async def start(fid: str, data: dict[str, object]) -> None:
        try:
            await engine.start(plan, flow_id=fid, data=data)
        except Exception as exc:
            errors[fid] = exc

    async with flow.open_engine(path, plans=[plan]) as engine:
        _refuse_poison(path)
        async with trio.open_nursery() as nursery:
            for i in range(40):
                data: dict[str, object] = {"poison": True} if i == 20 else {"i": i}
                nursery.start_soon(start, f"f-{i}", data)
        assert list(errors) == ["f-20"]
        assert isinstance(errors["f-20"], ferry.Failed)
        assert "poisoned row" in str(errors["f-20"])
        assert await engine.get("f-20") is None
        for i in range(40):
            if i != 20:
                assert (await engine.wait(f"f-{i}")).state is flow.State.COMPLETED


async def test_a_step_write_the_database_refuses_fails_that_flow_alone(tmp_path: Path) -> None:
    path = str(tmp_path / "flows.db")
    plan = flow.Plan("refused", version=1)
    undone: list[str] = []
    go = trio.Event()

    async def undo(ctx: flow.Context) -> None:
        undone.append(ctx.flow_id)

    @plan.step(compensate=undo)
    async def first(ctx: flow.Context) -> None:
        await go.wait()  # every flow's first write waits: they share batches

    @plan.step
    async def second(ctx: flow.Context) -> None:
        if ctx.flow_id == "bad":
            ctx.data["note"] = "poison"

    ids = [f"good-{i}" for i in range(10)] + ["bad"] + [f"good-{i}" for i in range(10, 20)]
    with trio.fail_after(10):
        async with flow.open_engine(path, plans=[plan]) as engine:
            _refuse_poison(path)
            for fid in ids:
                await engine.start(plan, flow_id=fid)
            await trio.testing.wait_all_tasks_blocked()
            go.set()
            bad = await engine.wait("bad")
            assert bad.state is flow.State.FAILED
            assert bad.error is not None
            assert "refused the write of step 'second'" in bad.error
            assert "poisoned row" in bad.error
            for fid in ids:
                if fid != "bad":
                    assert (await engine.wait(fid)).state is flow.State.COMPLETED
    assert undone == ["bad"]


_PG_POISON = """
CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.data LIKE '%poison%' THEN
        RAISE EXCEPTION 'poisoned row' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_poison BEFORE INSERT OR UPDATE ON flow_flows
    FOR EACH ROW EXECUTE FUNCTION refuse_poison();
"""


async def test_on_postgres_a_refused_row_fails_its_flow_alone(pg_server: pg.PgServer) -> None:
    """The same on PostgreSQL, where a failed statement aborts the whole transaction: a start
    the database refuses fails at its call alone, a refused step write fails its flow alone."""
    plan = flow.Plan("refused", version=1)
    go = trio.Event()

    @plan.step
    async def first(ctx: flow.Context) -> None:
        await go.wait()

    @plan.step
    async def second(ctx: flow.Context) -> None:
        if ctx.flow_id == "bad":
            ctx.data["note"] = "poison"

    errors: dict[str, BaseException] = {}

    async def start(fid: str, data: dict[str, object]) -> None:
        try:
            await engine.start(plan, flow_id=fid, data=data)
        except Exception as exc:
            errors[fid] = exc

    async with PostgresStore(pg_server.fresh_schema_dsn()) as store:
        with trio.fail_after(20):
            async with flow.open_engine(store, plans=[plan]) as engine:
                await store.transact(lambda tx: tx.execute(_PG_POISON))
                async with trio.open_nursery() as nursery:
                    for i in range(20):
                        data: dict[str, object] = {"poison": 1} if i == 10 else {}
                        nursery.start_soon(start, f"s-{i}", data)
                    nursery.start_soon(start, "bad", {})
                assert list(errors) == ["s-10"]
                assert isinstance(errors["s-10"], ferry.Failed)
                assert "poisoned row" in str(errors["s-10"])
                await trio.testing.wait_all_tasks_blocked()
                go.set()
                bad = await engine.wait("bad")
                assert bad.state is flow.State.FAILED
                assert bad.error is not None and "poisoned row" in bad.error
                for i in range(20):
                    if i != 10:
                        assert (await engine.wait(f"s-{i}")).state is flow.State.COMPLETED
