"""Flow control on a fleet (SPEC 5.8, ADR 0170), two engines on one PostgreSQL: a slot given
back on one engine admits a flow queued through the other at once (the release's own
transaction, held and run by the engine that wrote it: no scan, no notification waited for);
a queued head that another transaction held while a slot was given back (a wake queuing a
message for it) is admitted by that transaction at its commit; a delayed start whose engine
closed starts at its time on the engine left, which saw the other leave at its scan.

Seen to fail with `_queue._asks`' ``admit`` taken out (a1 stayed QUEUED with the slot free), and
with `_queues.when_engines_leave` not firing (the delayed flow waited past its time:
`TooSlowError`), and, for a plan without limits, with its scan firing only limited plans.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import trio

from ferry import flow
from ferry.flow._model import _ops
from ferry.flow._model._limits import Limits, StartOptions
from ferry.flow._model._values import Message
from ferry.flow._store import _admission as sa
from ferry.flow._store import _batch, _op, _schema, _store
from ferry.flow._store._sql import FLOWS
from ferry.projected import PostgresStore
from tests import pg, switches

from .test_admission_store import T0, Db, PgTx, insert_queued, states


def held(tx: Any, fid: str) -> tuple[str, str | None]:
    rows = tx.execute(f"SELECT state, owner FROM {FLOWS} WHERE flow_id = ?", (fid,))
    return str(rows[0][0]), rows[0][1]


def mail() -> flow.Plan:
    plan = flow.Plan("mail", limits=flow.Limits(concurrency=1))

    @plan.step
    async def send(ctx: flow.Context) -> flow.Outcome:
        return flow.park() if ctx.wake is None else flow.COMPLETE

    return plan


async def until(engine: flow.Engine, fid: str, want: flow.State, within: float) -> None:
    with trio.fail_after(within):
        while (s := await engine.get(fid)) is None or s.state is not want:  # noqa: ASYNC110
            await trio.sleep(0.005)


async def test_a_slot_given_back_on_one_engine_admits_a_flow_queued_through_the_other(
    pg_server: pg.PgServer,
) -> None:
    dsn = pg_server.fresh_schema_dsn("fcfleet")
    plan = mail()
    async with (
        PostgresStore(dsn) as sa_,
        PostgresStore(dsn) as sb,
        flow.open_engine(sa_, [plan], owner="a", lease=30.0) as a,
        flow.open_engine(sb, [plan], owner="b", lease=30.0) as b,
    ):
        await a.start(plan, flow_id="f1")
        await until(a, "f1", flow.State.PARKED, 10)
        await b.start(plan, flow_id="f2")
        assert await sa_.transact(partial(held, fid="f2")) == ("QUEUED", None)
        assert await a.wake("f1", "go") is flow.Delivery.RESUMED
        assert (await a.wait("f1", timeout=10)).state is flow.State.COMPLETED
        # A scan is 10 s away: only the end's own transaction can have let f2 go this soon.
        await until(b, "f2", flow.State.PARKED, 5)
        state, owner = await sa_.transact(partial(held, fid="f2"))
        assert state == "PARKED" and owner is None  # parked: nobody's, as any parked flow


@pytest.fixture
def pg_db(request: pytest.FixtureRequest) -> Iterator[tuple[Db, Callable[[], Any]]]:
    import psycopg

    server: pg.PgServer = request.getfixturevalue("pg_server")
    dsn = server.fresh_schema_dsn("fclock")

    def connect() -> Any:
        return psycopg.connect(dsn, autocommit=False)

    db = Db(lambda: PgTx(connect()))
    db.transaction(_schema.create_schema)
    yield db, connect
    db.close()


def test_a_wake_that_held_a_passed_over_queued_head_admits_it_at_its_commit(
    pg_db: tuple[Db, Callable[[], Any]],
) -> None:
    db, connect = pg_db
    limits = Limits(concurrency=1)
    plan = "p"
    db.transaction(partial(sa.register, plan=plan, limits=limits))
    for fid in ("x", "a1"):

        def start(tx: Any, fid: str = fid) -> None:
            insert_queued(tx, plan, fid)
            tx.execute(f"UPDATE {FLOWS} SET step = 's', queue_key = '' WHERE flow_id = ?", (fid,))
            sa.enqueue(tx, plan, limits, fid, StartOptions(0, None, None), T0, "e1")

        db.transaction(start)
    assert db.transaction(partial(states, plan=plan)) == {"x": "RUNNING", "a1": "QUEUED"}
    with connect() as wake:
        wake.execute(f"SELECT 1 FROM {FLOWS} WHERE flow_id = 'a1' FOR UPDATE")
        with connect() as conn:
            conn.execute("SET lock_timeout = '5s'")
            tx = PgTx(conn)
            tx.execute(f"UPDATE {FLOWS} SET state = 'COMPLETED' WHERE flow_id = 'x'")
            assert sa.release(tx, plan, limits, "x", T0 + 1, "e1") == []  # a1 passed over
            conn.commit()
        message = _ops.Wake(Message("m-1", "1"), T0 + 2, known=_ops.Known({}))
        (result,) = _batch.write_batch(PgTx(wake), [_op.Change("a1", message)], owner="e2")
        wake.commit()
    assert isinstance(result, _op.Changed) and not result.transition.written
    assert [f.flow_id for f in result.admitted] == ["a1"]
    assert db.transaction(partial(held, fid="a1")) == ("RUNNING", "e2")


def reminder() -> flow.Plan:
    """`mail`'s step on a plan without limits: its delayed starts alone give it a queue."""
    plan = flow.Plan("reminder")

    @plan.step
    async def send(ctx: flow.Context) -> flow.Outcome:
        return flow.park() if ctx.wake is None else flow.COMPLETE

    return plan


@pytest.mark.parametrize("make", [mail, reminder], ids=["limited", "without-limits"])
async def test_a_delayed_start_whose_engine_closed_starts_on_the_engine_left(
    pg_server: pg.PgServer, make: Callable[[], flow.Plan]
) -> None:
    """Without limits too (docs/adr/0180): the engine left was open before the plan had a
    queue, so only its scan can see that the plan has one to fire."""
    dsn = pg_server.fresh_schema_dsn("fcleft")
    plan = make()
    async with (
        PostgresStore(dsn) as sa_,
        switches.open_engine(sa_, [plan], owner="a", lease=30.0, scan_interval=0.2) as a,
    ):
        async with (
            PostgresStore(dsn) as sb,
            flow.open_engine(sb, [plan], owner="b", lease=30.0) as b,
        ):
            await b.start(plan, flow_id="later", delay=1.0)
        # b closed: its timer went with it; a's scan sees it gone and reads the queue's time.
        await until(a, "later", flow.State.PARKED, 10)
        assert (await sa_.transact(_store.count_waiting))[2] == 0
