"""Recovery that strands nothing: PostgreSQL goes down in the middle of an engine's
recovery and comes back; every flow still runs to its end, none stays pending for ever.

The engine opens on a database holding hundreds of orphaned flows (running, held by an engine
that is gone) and takes them over a hundred at a time (`max_running`), so its recovery spans
several scans. Once it has taken some, the server is halted (as a crash: connections drop) for
longer than a lease, and started again. The same run with an engine whose scan loop gives up on
the first database error (planted) strands flows: the test can fail.

Runs on a throwaway server of its own (tests/pg.py), which it halts; the session's server is
not touched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import pytest
import trio

from ferry import flow
from ferry.flow._fleet import _fleet
from ferry.flow._model import _machine as m
from ferry.flow._model._values import Shape
from ferry.flow._store import _batch, _op, _schema, _store
from ferry.projected import PostgresStore
from tests import pg

FLOWS = 600
LEASE = 1.5


@pytest.fixture(scope="module")
def server() -> Iterator[pg.PgServer]:
    bindir = pg.find_binaries()
    if bindir is None:
        pytest.skip(pg.SKIP_REASON)
    srv = pg.start(bindir)
    try:
        yield srv
    finally:
        srv.stop()


def plan(gate: trio.Event | None = None) -> flow.Plan:
    """Three steps of 10 ms; with `gate`, each waits for it first (the steps the engine took
    before the outage are still running when it comes, however fast or slow the machine)."""
    p = flow.Plan("order")

    async def work(ctx: flow.Context) -> None:
        if gate is not None:
            await gate.wait()
        await trio.sleep(0.01)

    for name in ("reserve", "charge", "ship"):
        p.step(name=name)(work)
    return p


async def orphans(store: PostgresStore, shape: Shape) -> None:
    """`FLOWS` flows running their first step, held by an engine that is gone."""
    await store.transact(_schema.create_schema)
    now = time.time()
    ops: list[_op.Op] = [
        _op.Create(m.start(shape, f"o{i:04d}", "{}", now, owner="gone")) for i in range(FLOWS)
    ]
    await store.transact(partial(_batch.write_batch, ops=ops))


async def unfinished(dsn: str) -> int:
    async with PostgresStore(dsn, connections=1) as store:
        counts = await store.transact(_store.count_states)
    return sum(n for state, n in counts.items() if state is not flow.State.COMPLETED)


async def recover_through_an_outage(
    srv: pg.PgServer, *, patience: float
) -> tuple[int, dict[str, int]]:
    """Run the scenario; (flows not completed after `patience` s, the engine's statistics)."""
    dsn = srv.fresh_database_dsn("restart")
    outage = trio.Event()
    p = plan(outage)
    async with PostgresStore(dsn) as setup:
        await orphans(setup, p._close())
    async with PostgresStore(dsn, connect_timeout=2) as store:
        async with flow.open_engine(store, [p], owner="a", lease=LEASE, max_running=100) as e:
            with trio.fail_after(60):
                while e.statistics().claimed < 50:  # noqa: ASYNC110 (a statistic, no event)
                    await trio.sleep(0.01)
            await trio.to_thread.run_sync(srv.halt)  # mid-recovery: most flows not taken yet
            outage.set()
            await trio.sleep(2 * LEASE)
            await trio.to_thread.run_sync(srv.resume)
            deadline = trio.current_time() + patience
            left = FLOWS
            while trio.current_time() < deadline:
                await trio.sleep(0.5)
                try:
                    left = await unfinished(dsn)
                except Exception:  # the server may still be starting
                    continue
                if left == 0:
                    break
            stats = e.statistics()
    return left, {"claimed": stats.claimed, "lost": stats.lost, "completed": stats.completed}


async def test_postgres_down_during_recovery_strands_no_flow(server: pg.PgServer) -> None:
    left, stats = await recover_through_an_outage(server, patience=60)
    print(f"\n{stats}")
    assert left == 0
    # The outage came mid-recovery: the engine had taken some flows, lost them when its lease
    # could not be renewed, and took them (and the rest) over once the database was back.
    assert stats["lost"] > 0 and stats["claimed"] >= FLOWS


async def test_a_recovery_that_gives_up_on_an_error_strands_flows(
    server: pg.PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: the scan loop ends at the first database error, as a one-shot recovery would."""

    async def gives_up(self: _fleet.Rounds) -> None:
        while True:
            await trio.sleep(self.interval)
            await self.scan()

    async def quietly(self: _fleet.Rounds) -> None:
        try:
            await gives_up(self)
        except Exception:
            return

    monkeypatch.setattr(_fleet.Rounds, "scan_loop", quietly)
    left, _stats = await recover_through_an_outage(server, patience=4 * LEASE)
    assert left > 0


async def test_the_dashboard_says_the_database_is_down_and_recovers(server: pg.PgServer) -> None:
    """The dashboard over PostgreSQL while the server crashes and comes back: the pages answer
    503 "unavailable" (and reload themselves), then the flows again, with nothing restarted."""
    import httpx

    from ferry.flow._ops._dashboard._serve import open_dashboard

    dsn = server.fresh_schema_dsn()
    async with PostgresStore(dsn, connections=1) as store:
        await orphans(store, plan()._close())
    async with open_dashboard(dsn, where="db", is_dsn=True, token="t" * 20) as dash:
        transport = httpx.ASGITransport(app=dash.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as web:
            r = await web.get("/flows?state=RUNNING")
            assert r.status_code == 200 and r.text.count('class="flow"') == 50, r.text[-1500:]
            await trio.to_thread.run_sync(server.halt)
            try:
                for url in ("/", "/flows", "/flow?id=o0001"):
                    r = await web.get(url)
                    assert r.status_code == 503, url
                    assert "The database is unavailable" in r.text
                    assert 'http-equiv="refresh"' in r.text
            finally:
                await trio.to_thread.run_sync(server.resume)
            # (the server of these tests commits asynchronously: a crash may lose the last
            # commits, so what the list holds now is not checked, only that it answers)
            for url in ("/", "/flows?state=RUNNING"):
                r = await web.get(url)
                assert r.status_code == 200 and "unavailable" not in r.text, url
