"""The engine's gauge of flows by state (`ferry_flow_flows{state}`, lower-case states), in a real
prometheus_client scrape: a flow that blocks counts in ``state="blocked"`` at once, and stops
counting when it is resumed or abandoned, by this engine or (in a fleet) by another one; a
compensating flow counts as ``compensating``, not ``running``; an engine that opens on a store
with blocked flows counts them. Before the gauge had these states, ``blocked`` was missing from
the scrape (a `KeyError` here) and only ``ferry_flow_ended_total{state="blocked"}``, which never
goes down, said anything."""

from __future__ import annotations

from pathlib import Path

import trio
from prometheus_client import CollectorRegistry

from ferry import flow, metrics
from ferry.projected import PostgresStore
from tests import pg

from .test_metrics import scrape, value


def refund_plan(
    closed: list[bool], inside: trio.Event | None = None, go: trio.Event | None = None
) -> flow.Plan:
    """reserve -> charge (its refund raises while ``closed[0]``) -> ship (always raises): a
    flow blocks in charge's compensation until the account opens again. With `inside` and
    `go`, the first refund sets `inside` and waits for `go` (a flow caught compensating)."""
    plan = flow.Plan("order")

    async def refund(ctx: flow.Context) -> None:
        if inside is not None and go is not None and not inside.is_set():
            inside.set()
            await go.wait()
        if closed[0]:
            raise ConnectionError("the account is closed")

    @plan.step
    async def reserve(ctx: flow.Context) -> None:
        pass

    @plan.step(compensate=refund, attempts=1)
    async def charge(ctx: flow.Context) -> None:
        pass

    @plan.step(attempts=1)
    async def ship(ctx: flow.Context) -> None:
        raise RuntimeError("the carrier lost it")

    return plan


def flows(registry: CollectorRegistry, state: str) -> float:
    return value(scrape(registry), "ferry_flow_flows", state=state)


async def test_blocked_goes_up_when_a_flow_blocks_and_down_when_resumed_or_abandoned(
    tmp_path: Path,
) -> None:
    closed = [True]
    plan = refund_plan(closed)
    registry = CollectorRegistry()
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        metrics.register(engine, registry=registry)
        assert flows(registry, "blocked") == 0
        for fid in ("o1", "o2", "o3"):
            await engine.start(plan, flow_id=fid, data={})
            assert (await engine.wait(fid, timeout=10)).state is flow.State.BLOCKED
        assert flows(registry, "blocked") == 3
        assert value(scrape(registry), "ferry_flow_ended_total", state="blocked") == 3

        assert await engine.abandon("o1", reason="refunded by hand", by="ana")
        assert (await engine.wait("o1", timeout=10)).state is flow.State.FAILED
        assert flows(registry, "blocked") == 2

        closed[0] = False  # the account opens: a resume's compensation now succeeds
        assert await engine.resume("o2")
        assert (await engine.wait("o2", timeout=10)).state is flow.State.FAILED
        assert flows(registry, "blocked") == 1
        # The counter of flows written BLOCKED never goes down: it is not the number to alert on.
        assert value(scrape(registry), "ferry_flow_ended_total", state="blocked") == 3

    # A new engine on the same file counts the blocked flow it finds there.
    registry = CollectorRegistry()
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        metrics.register(engine, registry=registry)
        assert flows(registry, "blocked") == 1
        assert flows(registry, "running") == 0


async def test_a_compensating_flow_counts_as_compensating_not_running(tmp_path: Path) -> None:
    inside, go = trio.Event(), trio.Event()
    plan = refund_plan([False], inside, go)
    registry = CollectorRegistry()
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        metrics.register(engine, registry=registry)
        await engine.start(plan, flow_id="o1", data={})
        await inside.wait()  # the refund runs, held until ship raised
        assert flows(registry, "compensating") == 1
        assert flows(registry, "running") == 0
        go.set()
        assert (await engine.wait("o1", timeout=10)).state is flow.State.FAILED
        assert flows(registry, "compensating") == 0


async def test_a_fleet_engine_stops_counting_a_flow_another_engine_resumed(
    pg_server: pg.PgServer,
) -> None:
    """On PostgreSQL the store's blocked flows are nobody's: engine A counts the flow it
    blocked, engine B resumes it, and A's next scan reads the store's count again."""
    closed = [True]
    plan = refund_plan(closed)
    dsn = pg_server.fresh_schema_dsn("blocked")
    registry = CollectorRegistry()
    async with (
        PostgresStore(dsn) as sa,
        PostgresStore(dsn) as sb,
        flow.open_engine(sa, plans=[plan], owner="a", lease=3.0) as a,
        flow.open_engine(sb, plans=[plan], owner="b", lease=3.0) as b,
    ):
        metrics.register(a, registry=registry)
        await a.start(plan, flow_id="o1", data={})
        assert (await a.wait("o1", timeout=10)).state is flow.State.BLOCKED
        assert flows(registry, "blocked") == 1
        closed[0] = False
        assert await b.resume("o1")
        assert (await b.wait("o1", timeout=10)).state is flow.State.FAILED
        with trio.fail_after(10):
            while flows(registry, "blocked") != 0:  # noqa: ASYNC110 (a scan of engine a)
                await trio.sleep(0.05)
