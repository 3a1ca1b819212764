"""A flow's end is in its trace: the engine that writes a flow COMPLETED, FAILED or BLOCKED
makes a span ``end {plan}`` in the flow's trace (a child of its start span) that says how it
ended (``workflow.end``: completed, failed, blocked, cancelled, abandoned) and, when it went
wrong, the error (``workflow.error`` and the status ERROR). Checked with the SDK's in-memory
exporter; before, no span marked the end (the ``end`` spans were missing)."""

from __future__ import annotations

from pathlib import Path

import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from ferry import flow

from .test_tracing import attrs_of, traced


def plan_of() -> flow.Plan:
    """hold (parks at once unless data says go) -> charge (compensated by a refund that raises
    when data says so) -> ship (fails when data says so)."""
    plan = flow.Plan("order", version=2)

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Outcome | None:
        return None if ctx.data.get("go") or ctx.wake is not None else flow.park()

    async def refund(ctx: flow.Context) -> None:
        if ctx.data.get("closed"):
            raise ConnectionError("the account is closed")

    @plan.step(compensate=refund, attempts=1)
    async def charge(ctx: flow.Context) -> None:
        pass

    @plan.step(attempts=1)
    async def ship(ctx: flow.Context) -> None:
        if ctx.data.get("lost"):
            raise RuntimeError("the carrier lost it")

    return plan


def ends(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {str(attrs_of(s)["workflow.id"]): s for s in spans if s.name == "end order"}


async def test_the_end_span_says_how_each_flow_ended(tmp_path: Path) -> None:
    provider, exporter = traced()
    plan = plan_of()
    async with flow.open_engine(
        str(tmp_path / "f.db"), plans=[plan], tracer_provider=provider
    ) as engine:
        await engine.start(plan, flow_id="ok", data={"go": True})
        await engine.start(plan, flow_id="lost", data={"go": True, "lost": True})
        await engine.start(plan, flow_id="stuck", data={"go": True, "lost": True, "closed": True})
        await engine.start(plan, flow_id="gone", data={"go": True, "lost": True, "closed": True})
        await engine.start(plan, flow_id="parked", data={})
        for fid in ("ok", "lost", "stuck", "gone"):
            await engine.wait(fid, timeout=10)
        with trio.fail_after(10):
            while (await engine.get("parked")).state is not flow.State.PARKED:  # type: ignore[union-attr]  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert await engine.abandon("gone", reason="refunded by hand", by="ana")
        assert await engine.cancel("parked", reason="the customer changed their mind")
        for fid in ("gone", "parked"):
            assert (await engine.wait(fid, timeout=10)).state is flow.State.FAILED
    spans = exporter.get_finished_spans()
    end = ends(spans)
    assert set(end) == {"ok", "lost", "stuck", "gone", "parked"}
    starts = {str(attrs_of(s)["workflow.id"]): s for s in spans if s.name == "start order"}
    for fid, span in end.items():
        start = starts[fid]
        assert span.context is not None and start.context is not None
        assert span.context.trace_id == start.context.trace_id, "the end is in the flow's trace"
        assert span.parent is not None and span.parent.span_id == start.context.span_id
        a = attrs_of(span)
        assert (a["workflow.name"], a["workflow.version"]) == ("order", 2)
    got = {
        fid: (attrs_of(s)["workflow.state"], attrs_of(s)["workflow.end"]) for fid, s in end.items()
    }
    assert got == {
        "ok": ("completed", "completed"),
        "lost": ("failed", "failed"),
        "stuck": ("blocked", "blocked"),
        "gone": ("failed", "abandoned"),
        "parked": ("failed", "cancelled"),
    }
    assert end["ok"].status.status_code is StatusCode.UNSET
    assert "workflow.error" not in attrs_of(end["ok"])
    assert attrs_of(end["ok"])["workflow.task.name"] == "ship"
    lost = attrs_of(end["lost"])["workflow.error"]
    assert isinstance(lost, str) and "the carrier lost it" in lost
    stuck = attrs_of(end["stuck"])["workflow.error"]
    assert isinstance(stuck, str) and "the account is closed" in stuck
    assert end["stuck"].status.status_code is StatusCode.ERROR
    assert end["stuck"].status.description == stuck
    gone = attrs_of(end["gone"])["workflow.error"]
    assert isinstance(gone, str) and gone.endswith(": refunded by hand")
    assert attrs_of(end["parked"])["workflow.error"] == "the customer changed their mind"
    assert attrs_of(end["parked"])["workflow.task.name"] == "hold"
    # BLOCKED is an end that an operator may undo: "gone" ended twice, blocked then abandoned.
    gone_ends = [
        attrs_of(s)["workflow.end"]
        for s in spans
        if s.name == "end order" and attrs_of(s)["workflow.id"] == "gone"
    ]
    assert gone_ends == ["blocked", "abandoned"]
