"""Child flows as observers see them (SPEC 5.6, 5.7; docs/adr/0160): `FlowStatistics` and
``ferry.metrics`` count the children an engine started and ended (each end once: a completed
child that its parent's compensation undoes is not counted again); `flow.FlowEnd` names a
child's parent; a child's spans are below its parent's spawn span (``spawn {plan}``, in the
parent's trace), a kept child started later by a sibling's end too, and a child's end span
names its parent.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from ferry import flow, metrics

from .test_metrics import scrape, value
from .test_tracing import attrs_of, traced


def plans() -> tuple[flow.Plan, flow.Plan]:
    """``order``: reserve, ship_all (a spawn of ``box`` children, one at a time), invoice;
    ``box``: pack (compensated by unpack), which fails when its data says so."""
    box = flow.Plan("box")

    async def unpack(ctx: flow.Context) -> None:
        pass

    @box.step(compensate=unpack)
    async def pack(ctx: flow.Context) -> flow.Outcome | None:
        return flow.fail("no box") if ctx.data.get("fail") else None

    order = flow.Plan("order")

    @order.step
    async def reserve(ctx: flow.Context) -> None:
        pass

    @order.step
    async def ship_all(ctx: flow.Context) -> flow.Outcome:
        boxes = ctx.data["boxes"]
        kids = [flow.Child(box, key=f"b{i}", data=b) for i, b in enumerate(boxes)]
        return flow.spawn(kids, max_running=1)

    @order.step
    async def invoice(ctx: flow.Context) -> None:
        pass

    return order, box


class Ends(flow.Observer):
    def __init__(self) -> None:
        self.parents: dict[str, str | None] = {}

    def flow_ended(self, end: flow.FlowEnd) -> None:
        self.parents[end.flow_id] = end.parent


async def test_statistics_and_metrics_count_children_started_and_ended(tmp_path: Path) -> None:
    order, box = plans()
    registry = CollectorRegistry()
    ends = Ends()
    async with flow.open_engine(tmp_path / "f.db", plans=[order, box], observers=[ends]) as e:
        metrics.register(e, registry=registry)
        await e.start(order, flow_id="o", data={"boxes": [{}, {}, {}]})  # two start kept
        assert (await e.wait("o", timeout=30)).state is flow.State.COMPLETED
        # b0 completes, b1 fails: the parent compensates and undoes b0, which ends FAILED
        await e.start(order, flow_id="bad", data={"boxes": [{}, {"fail": True}]})
        assert (await e.wait("bad", timeout=30)).state is flow.State.FAILED
        b0 = await e.get("bad/1/b0")
        assert b0 is not None and b0.state is flow.State.FAILED  # undone: a second end
        stats = e.statistics()
        assert (stats.children_started, stats.children_ended) == (5, 5)
        samples = scrape(registry)
        assert value(samples, "ferry_flow_children_started_total") == 5
        assert value(samples, "ferry_flow_children_ended_total") == 5
    assert {k: v for k, v in ends.parents.items() if k.startswith("o")} == {
        "o/1/b0": "o",
        "o/1/b1": "o",
        "o/1/b2": "o",
        "o": None,
    }
    assert ends.parents["bad/1/b1"] == "bad" and ends.parents["bad"] is None


async def test_a_childs_spans_are_below_its_parents_spawn_span(tmp_path: Path) -> None:
    provider, exporter = traced()
    order, box = plans()
    async with flow.open_engine(
        tmp_path / "f.db", plans=[order, box], tracer_provider=provider
    ) as e:
        await e.start(order, flow_id="o", data={"boxes": [{}, {}]})  # b1 kept, started by b0's end
        assert (await e.wait("o", timeout=30)).state is flow.State.COMPLETED
    spans = exporter.get_finished_spans()
    (start,) = [s for s in spans if s.name == "start order"]
    (spawn,) = [s for s in spans if s.name == "spawn order"]
    assert start.context is not None and spawn.context is not None
    assert spawn.parent is not None and spawn.parent.span_id == start.context.span_id
    a = attrs_of(spawn)
    assert (a["workflow.id"], a["workflow.task.name"], a["workflow.spawn.children"]) == (
        "o",
        "ship_all",
        2,
    )
    packs = {str(attrs_of(s)["workflow.id"]): s for s in spans if s.name == "step box.pack"}
    assert set(packs) == {"o/1/b0", "o/1/b1"}
    for fid, span in packs.items():
        assert span.context is not None and span.context.trace_id == start.context.trace_id, fid
        assert span.parent is not None and span.parent.span_id == spawn.context.span_id, fid
    child_ends = [s for s in spans if s.name == "end box"]
    assert sorted(str(attrs_of(s)["workflow.id"]) for s in child_ends) == ["o/1/b0", "o/1/b1"]
    assert {attrs_of(s)["workflow.parent.id"] for s in child_ends} == {"o"}
    (parent_end,) = [s for s in spans if s.name == "end order"]
    assert "workflow.parent.id" not in attrs_of(parent_end)
