"""The metrics collector lets closed engines go (docs/adr/0114): an engine whose block ended
leaves the gauges (``ferry_flow_flows``), its counters stay in the totals (a counter never goes
down because an engine closed), and the collector holds no reference to it.

Read back through prometheus_client's own text format, after real engines on real SQLite files
opened, ran flows and closed. Before the fix every engine ever added stayed in the collector:
with all of them closed, ``ferry_flow_flows{state="running"}`` still counted the flows their
steps had been running when they closed."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry

from ferry import flow, metrics
from tests.flow.test_metrics import scrape, value

ENGINES = 30
FLOWS = 2  # per engine: running (a step that never returns) when the engine closes


def forever_plan() -> flow.Plan:
    plan = flow.Plan("forever", version=1)

    @plan.step
    async def hold(ctx: flow.Context) -> None:
        await trio.sleep_forever()

    return plan


async def test_closed_engines_leave_the_gauges_and_keep_their_counts(
    tmp_path: Path, autojump_clock: object
) -> None:
    registry = CollectorRegistry()
    collector = metrics.register(registry=registry)
    plan = forever_plan()
    refs: list[weakref.ref[flow.Engine]] = []
    running_while_open: list[float] = []
    writes = 0.0
    for i in range(ENGINES):
        async with flow.open_engine(str(tmp_path / f"e{i}.db"), plans=[plan]) as engine:
            collector.add_engine(engine)
            for j in range(FLOWS):
                await engine.start(plan, flow_id=f"f{j}")
            while engine.statistics().steps_run < FLOWS:  # noqa: ASYNC110
                await trio.sleep(0.01)
            running_while_open.append(value(scrape(registry), "ferry_flow_flows", state="running"))
            refs.append(weakref.ref(engine))
        after = scrape(registry)
        # Closed: none of its flows is counted as running, and its writes still are.
        assert value(after, "ferry_flow_flows", state="running") == 0
        assert value(after, "ferry_flow_writes_total") >= writes + FLOWS
        writes = value(after, "ferry_flow_writes_total")
        del engine

    assert running_while_open == [FLOWS] * ENGINES
    final = scrape(registry)
    assert value(final, "ferry_flow_flows", state="running") == 0
    assert value(final, "ferry_flow_flows", state="parked") == 0
    assert value(final, "ferry_flow_writes_total") == writes
    gc.collect()
    assert [r for r in refs if r() is not None] == []  # the collector keeps none of them
    collector.unregister()


async def test_a_closed_engine_cannot_be_added(tmp_path: Path) -> None:
    async with flow.open_engine(str(tmp_path / "flows.db"), plans=[forever_plan()]) as engine:
        pass
    collector = metrics.register(registry=CollectorRegistry())
    with pytest.raises(ValueError, match="is closed"):
        collector.add_engine(engine)
    with pytest.raises(ValueError, match="is closed"):
        metrics.register(engine, registry=CollectorRegistry())
