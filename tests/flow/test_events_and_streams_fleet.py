"""Events and streams on a PostgreSQL fleet (SPEC 5.10, docs/adr/0177): a reader on one engine
of a flow another engine runs is woken by a notification, not by polling (the fallback read
comes only after a lease, 30 s), and reads once per write; its listener goes with its engine.
Two in-process engines on the suite's PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from ferry.projected import PostgresStore
from tests import pg


@pytest.fixture
def dsn(pg_server: pg.PgServer) -> str:
    return pg_server.fresh_schema_dsn()


def gated(gates: dict[str, trio.Event], steps: int = 3) -> flow.Plan:
    """`steps` steps; each waits for its gate ``f"{flow_id}/{i}"``, then emits i and sets
    ``"at"`` to it."""
    plan = flow.Plan("gated-stream")
    for i in range(steps):

        async def step(ctx: flow.Context, i: int = i) -> None:
            await gates.setdefault(f"{ctx.flow_id}/{i}", trio.Event()).wait()
            ctx.emit(i)
            ctx.set_event("at", i)

        plan.step(name=f"s{i}")(step)
    return plan


@asynccontextmanager
async def engines(dsn: str, plan: flow.Plan, *owners: str) -> AsyncIterator[list[flow.Engine]]:
    async with AsyncExitStack() as stack:
        opened = []
        for owner in owners:
            store = await stack.enter_async_context(PostgresStore(dsn, connections=2))
            opened.append(
                await stack.enter_async_context(flow.open_engine(store, [plan], owner=owner))
            )
        yield opened


def listener_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ferry.flow wait listener")]


async def listening(engine: flow.Engine) -> None:
    """Until the feeds' listener of `engine` is listening (it reads every feed once then)."""
    feeds = engine._parts.feeds
    with trio.fail_after(10):
        while feeds.listener is None or feeds.listener.connects == 0:  # noqa: ASYNC110 - a thread
            await trio.sleep(0.01)


async def test_a_reader_of_another_engines_flow_is_woken_by_a_notification(dsn: str) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated(gates)
    async with engines(dsn, plan, "a", "b") as (a, b):
        await b.start(plan, flow_id="f")
        assert "f" in b._live  # b runs it; a only reads
        got: list[tuple[int, Any]] = []
        events: list[Any] = []
        arrived = [trio.Event() for _ in range(3)]
        async with trio.open_nursery() as nursery:

            async def follow() -> None:
                async for item in a.stream("f"):
                    got.append(item)
                    arrived[len(got) - 1].set()

            async def at_two() -> None:
                events.append(await a.get_event("f", "at", timeout=20))

            nursery.start_soon(follow)
            await listening(a)
            await trio.sleep(0.3)  # b still runs the flow: a poll would have read by now
            feeds = a._parts.feeds
            before = feeds.reads
            assert before <= 2  # the first read, and the one when the listening began
            await trio.sleep(0.3)
            assert feeds.reads == before
            with trio.fail_after(10):  # the fallback read comes only after a lease (30 s)
                for i in range(3):
                    gates.setdefault(f"f/{i}", trio.Event()).set()  # its step may not run yet
                    await arrived[i].wait()
            nursery.start_soon(at_two)
        assert got == [(1, 0), (2, 1), (3, 2)]
        assert events == [2]
        # per write of the flow a read, or two (a write's two notifications, a step's and
        # the settling one, may land on both sides of a read); never a poll
        assert feeds.reads - before <= 2 * 4 + 1
        assert listener_threads()
    assert not [t for t in listener_threads() if t.is_alive()]


async def test_many_readers_on_another_engine_read_each_write_once(dsn: str) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated(gates, steps=2)
    async with engines(dsn, plan, "a", "b") as (a, b):
        await b.start(plan, flow_id="g")
        results: list[list[tuple[int, Any]]] = []
        async with trio.open_nursery() as nursery:

            async def follow() -> None:
                results.append([item async for item in a.stream("g")])

            for _ in range(100):
                nursery.start_soon(follow)
            await listening(a)
            await trio.sleep(0.2)
            before = a._parts.feeds.reads
            for i in range(2):
                gates.setdefault(f"g/{i}", trio.Event()).set()
        assert results == [[(1, 0), (2, 1)]] * 100
        assert a._parts.feeds.reads - before <= 2 * 3 + 1  # not 100 per write
