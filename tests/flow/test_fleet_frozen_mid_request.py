"""A process frozen in the middle of a request holds its flow rows for as long as it sleeps,
and the server's guard on idle transactions does not see it (docs/adr/0158): an engine that
takes over the frozen engine's flows ends that session first.

The frozen session is a real one: a connection that holds an orphan's row (``FOR UPDATE``) and
then waits inside ``COPY ... FROM STDIN`` for data its client never sends, which is how the
server sees a client stopped while it was sending a statement (``state = 'active'``,
``wait_event = 'ClientRead'``). The same run with the session left alone (planted) strands the
flow: the test can fail.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import psycopg
import pytest
import trio

from ferry import flow
from ferry.flow._model import _machine as m
from ferry.flow._store import _batch, _op, _schema, _store
from ferry.projected import PostgresStore
from tests import pg

LEASE = 1.0


def one_step() -> flow.Plan:
    plan = flow.Plan("order")

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        pass

    return plan


def hold_mid_request(dsn: str, holding: threading.Event, done: threading.Event) -> list[str]:
    """Hold flow 'f' and wait mid-request until `done` (or until the server ends the session);
    what the session's end said, if it was ended."""
    ended: list[str] = []
    with psycopg.connect(dsn, application_name="a frozen engine") as conn:
        conn.execute("CREATE TEMP TABLE sink (x text)")
        conn.execute("SELECT 1 FROM flow_flows WHERE flow_id = 'f' FOR UPDATE")
        try:
            with conn.cursor().copy("COPY sink FROM STDIN"):
                holding.set()
                done.wait(60)
        except psycopg.Error as exc:  # the server ended the session
            ended.append(type(exc).__name__)
    return ended


async def owner_of(dsn: str, flow_id: str) -> str:
    def read() -> str:
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT owner FROM flow_flows WHERE flow_id = %s", (flow_id,))
            return str(row.fetchone()[0])  # type: ignore[index]

    return await trio.to_thread.run_sync(read)


@pytest.mark.parametrize("planted", [False, True], ids=["ended", "planted-left-alone"])
async def test_a_session_frozen_mid_request_on_an_orphan_is_ended_and_the_flow_taken_over(
    pg_server: pg.PgServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    planted: bool,
) -> None:
    caplog.set_level(logging.WARNING, logger="ferry.flow")
    if planted:
        monkeypatch.setattr(_store, "end_frozen_holders", lambda tx, seconds: [])
    dsn = pg_server.fresh_schema_dsn("midrequest")
    plan = one_step()
    async with PostgresStore(dsn, connections=1) as store:
        await store.transact(_schema.create_schema)
        dead = m.start(plan._close(), "f", "{}", time.time() - 100, owner="dead")  # no engine row
        await store.transact(partial(_batch.write_batch, ops=[_op.Create(dead)]))
    holding, done = threading.Event(), threading.Event()
    ended: list[str] = []

    def frozen() -> None:
        ended.extend(hold_mid_request(dsn, holding, done))

    thread = threading.Thread(target=frozen, daemon=True)
    thread.start()
    done_at: list[float] = []
    try:
        assert await trio.to_thread.run_sync(holding.wait, 30)
        await trio.sleep(LEASE * 1.2)  # mid-request for longer than a lease

        async def serve() -> None:
            async with (
                PostgresStore(dsn) as store,
                flow.open_engine(store, [plan], owner="b", lease=LEASE) as engine,
            ):
                snap = await engine.wait("f", timeout=60)
                assert snap.state is flow.State.COMPLETED
                done_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            if planted:  # the engine's takeover waits on the frozen session's lock
                await trio.sleep(2 * LEASE)
                assert done_at == [] and await owner_of(dsn, "f") == "dead"
                done.set()  # the frozen process wakes: then it goes on
    finally:
        done.set()
        await trio.to_thread.run_sync(thread.join, 30)
    assert len(done_at) == 1
    assert bool(ended) is not planted, ended
    said = [r.getMessage() for r in caplog.records if "a frozen engine" in r.getMessage()]
    if not planted:  # the operator is told which session went, and why
        assert len(said) == 1 and "'b' ended 1 database session" in said[0], said
        assert "more than a lease (1.0 s; a frozen engine)" in said[0], said
    else:
        assert said == []
