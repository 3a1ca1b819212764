"""A wait whose flow is deleted before the waiting engine reads how it ended (a fleet flow that
ended and was purged, by retention or the inspector's `purge`) answers at once with
`flow.UnknownFlow`, as `wait` of an unknown id does, instead of waiting to its timeout saying
the flow is "still PARKED" (with no timeout, for ever). Each engine's reads of the flows it waits
for (`_store.load_many`) are held back by the test until the purge is through, so that the purge
always comes first. Both tests waited to their timeout before the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from ferry.flow._runtime import _retention
from ferry.flow._store import _store
from ferry.projected import PostgresStore
from tests import pg

from ._helpers import PlantedStore
from .test_wait import idle

LATER = 1e12  # wall-clock seconds: every finished flow ended before it


def _parking() -> flow.Plan:
    plan = flow.Plan("parks-then-ends")

    @plan.step
    async def park(ctx: flow.Context) -> flow.Outcome:
        return flow.park()

    @plan.step
    async def end(ctx: flow.Context) -> None:
        pass

    return plan


def _hold_reads(monkeypatch: pytest.MonkeyPatch, store: Any) -> tuple[trio.Event, trio.Event]:
    """From now on the waits' shared reads through `store` wait for the first event returned;
    the second is set once one of them is waiting."""
    gate, held = trio.Event(), trio.Event()
    transact = store.transact

    async def holding(fn: Callable[[Any], Any], **options: Any) -> Any:
        if getattr(fn, "func", fn) is _store.load_many:
            held.set()
            await gate.wait()
        return await transact(fn, **options)

    monkeypatch.setattr(store, "transact", holding)
    return gate, held


async def test_on_postgres_a_wait_on_a_flow_purged_before_it_was_read_answers_at_once(
    pg_server: pg.PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines: b runs the flow, a waits for it; the flow parks, is woken, ends, and is
    purged before a's read (for the notification of its end) is answered."""
    plan = _parking()
    dsn = pg_server.fresh_schema_dsn()
    async with (
        PostgresStore(dsn, connections=2) as store_a,
        PostgresStore(dsn, connections=2) as store_b,
        flow.open_engine(store_b, [plan], owner="b") as b,
        flow.open_engine(store_a, [plan], owner="a") as a,
    ):
        await b.start(plan, flow_id="f")
        raised: list[BaseException] = []
        answered = trio.Event()

        async def waiter() -> None:
            with pytest.raises(flow.UnknownFlow) as caught:
                await a.wait("f", timeout=20)
            raised.append(caught.value)
            answered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await idle(a, "f")  # a read the flow PARKED, and listens
            gate, held = _hold_reads(monkeypatch, store_a)
            # RESUMED, or QUEUED if it has not parked yet: it then parks and goes on at once
            assert await b.wake("f") in (flow.Delivery.RESUMED, flow.Delivery.QUEUED)
            assert (await b.wait("f", timeout=10)).state is flow.State.COMPLETED
            with trio.fail_after(10):
                await held.wait()
            assert await _retention.purge(store_b, LATER) == 1
            gate.set()
            with trio.fail_after(5):  # before the fix: to the wait's timeout, "still PARKED"
                await answered.wait()
        assert "no flow has id 'f'" in str(raised[0]) and "purged" in str(raised[0])
        with pytest.raises(flow.UnknownFlow):  # and a wait from now on, as before
            await a.wait("f", timeout=1)


async def test_on_sqlite_a_wait_on_a_flow_purged_while_it_waits_answers_at_once(
    tmp_path: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fleet engines on one SQLite file (no notifications: a's wait polls): b runs the flow,
    it ends and is purged while a waits; a's next poll finds no row."""
    from .test_leases import fleet_engine  # the fleet on SQLite, under the mock clock

    plan = _parking()
    path = str(tmp_path / "fleet.db")
    store_a, store_b = PlantedStore(path), PlantedStore(path)
    async with fleet_engine(store_b, plan, owner="b") as b:
        async with fleet_engine(store_a, plan, owner="a") as a:
            await b.start(plan, flow_id="f")
            await trio.testing.wait_all_tasks_blocked()
            assert (await b.get("f")).state is flow.State.PARKED  # type: ignore[union-attr]
            raised: list[BaseException] = []
            answered = trio.Event()

            async def waiter() -> None:
                with pytest.raises(flow.UnknownFlow) as caught:
                    await a.wait("f", timeout=3600)
                raised.append(caught.value)

            answered.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                gate, held = _hold_reads(monkeypatch, store_a)
                await held.wait()  # a's first poll
                assert await b.wake("f") is flow.Delivery.RESUMED
                assert (await b.wait("f", timeout=60)).state is flow.State.COMPLETED
                assert await _retention.purge(store_b, LATER) == 1
                began = trio.current_time()
                gate.set()
                await answered.wait()
                assert trio.current_time() - began < 5  # its next poll, not its timeout
            assert "no flow has id 'f'" in str(raised[0])
