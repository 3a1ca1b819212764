"""OpenTelemetry traces of flows (ADR 0086), with the SDK's in-memory exporter.

One flow is one trace: its start span is a child of the caller's span, and every run of its
steps and compensations is a child of the start span, also after the flow parked, the engine
closed, and another engine (a reopen) woke it. Traces are off, and OpenTelemetry is not even
imported, unless the application gave or set a provider (checked in a subprocess).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from ferry import flow
from ferry.projected import PostgresStore
from tests import pg

ROOT = Path(__file__).resolve().parents[2]


def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def order_plan() -> flow.Plan:
    """reserve (compensated by release) -> flaky (raises on its first attempt) -> confirm
    (parks until woken) -> ship (fails if the wake says "no")."""
    plan = flow.Plan("order", version=3)

    async def release(ctx: flow.Context) -> None:
        pass

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        pass

    @plan.step
    async def flaky(ctx: flow.Context) -> None:
        if ctx.attempt == 1:
            raise ValueError("the carrier timed out")

    @plan.step
    async def confirm(ctx: flow.Context) -> flow.Outcome:
        return flow.park()

    @plan.step
    async def ship(ctx: flow.Context) -> flow.Outcome | None:
        return flow.fail("declined") if ctx.wake == "no" else None

    return plan


async def parked(engine: flow.Engine, flow_id: str) -> None:
    """Let the (mock) clock run until the flow has parked (after its retried step)."""
    with trio.fail_after(3600):
        while (snap := await engine.get(flow_id)) is None or snap.state is not flow.State.PARKED:  # noqa: ASYNC110
            await trio.sleep(0.05)


def attrs_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_one_flow_is_one_trace_across_a_park_and_a_reopen(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    provider, exporter = traced()
    tracer = provider.get_tracer("the application")
    path = tmp_path / "t.db"
    plan = order_plan()
    async with flow.open_engine(path, plans=[plan], tracer_provider=provider) as engine:
        with tracer.start_as_current_span("POST /orders") as request:
            await engine.start(plan, flow_id="o-1")
        await parked(engine, "o-1")
    # Closed, reopened (another engine), woken: the rest joins the same trace.
    async with flow.open_engine(path, plans=[plan], tracer_provider=provider) as engine:
        assert await engine.wake("o-1", "yes") is flow.Delivery.RESUMED
        assert (await engine.wait("o-1", timeout=60)).state is flow.State.COMPLETED
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert [s.name for s in spans] == [
        "POST /orders",
        "start order",
        "step order.reserve",
        "step order.flaky",
        "step order.flaky",
        "step order.confirm",
        "wake order",
        "step order.ship",
        "end order",  # the flow's end (test_trace_of_a_flows_end)
    ]
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}
    start = spans[1]
    assert start.parent is not None and start.parent.span_id == request.get_span_context().span_id
    assert attrs_of(start) == {
        "workflow.name": "order",
        "workflow.id": "o-1",
        "workflow.version": 3,
    }
    assert spans[6].parent is not None and spans[6].parent.span_id == start.context.span_id
    steps = spans[2:6] + spans[7:8]
    assert spans[8].parent is not None and spans[8].parent.span_id == start.context.span_id
    assert all(s.parent is not None and s.parent.span_id == start.context.span_id for s in steps)
    expected = [
        ("reserve", 1, "continue"),
        ("flaky", 1, "raised"),
        ("flaky", 2, "continue"),
        ("confirm", 1, "park"),
        ("ship", 1, "continue"),
    ]
    for span, (step, attempt, outcome) in zip(steps, expected, strict=True):
        assert attrs_of(span) == {
            "workflow.name": "order",
            "workflow.id": "o-1",
            "workflow.version": 3,
            "workflow.task.name": step,
            "workflow.task.kind": "step",
            "workflow.task.attempt": attempt,
            "workflow.task.outcome": outcome,
            **({"error.type": "ValueError"} if outcome == "raised" else {}),
        }
    raised = steps[1]
    assert raised.status.status_code is StatusCode.ERROR
    assert raised.status.description == "ValueError: the carrier timed out"
    assert [e.name for e in raised.events] == ["exception"]
    assert all(s.status.status_code is StatusCode.UNSET for s in steps if s is not raised)


async def test_a_failed_flow_traces_its_compensation_and_a_start_without_a_span_is_a_root(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    provider, exporter = traced()
    plan = order_plan()
    async with flow.open_engine(tmp_path / "t.db", plans=[plan], tracer_provider=provider) as e:
        await e.start(plan, flow_id="o-2")  # no current span: a new trace
        await parked(e, "o-2")
        await e.wake("o-2", "no")
        assert (await e.wait("o-2", timeout=60)).state is flow.State.FAILED
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time or 0)
    start = spans[0]
    assert start.name == "start order" and start.parent is None
    assert {s.context.trace_id for s in spans} == {start.context.trace_id}
    ship, release, end = spans[-3:]
    assert end.name == "end order" and attrs_of(end)["workflow.end"] == "failed"
    assert ship.name == "step order.ship"
    assert attrs_of(ship)["workflow.task.outcome"] == "fail"
    assert ship.status.status_code is StatusCode.ERROR
    assert ship.status.description == "declined"
    assert release.name == "compensate order.reserve"
    assert attrs_of(release)["workflow.task.kind"] == "compensation"
    assert attrs_of(release)["workflow.task.outcome"] == "compensated"
    assert release.parent is not None and release.parent.span_id == start.context.span_id


def wait_plan() -> flow.Plan:
    """hold (parks for a wake, an hour at most, then runs on) -> after."""
    plan = flow.Plan("waits", version=2)

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Outcome:
        return flow.park(timeout=3600, on_timeout="continue")

    @plan.step
    async def after(ctx: flow.Context) -> None:
        ctx.data["woken_by"] = "timeout" if ctx.timed_out else ctx.wake

    return plan


async def test_a_wake_a_published_wake_and_a_park_timeout_are_spans_of_the_flows_trace(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Each is a span in the flow's own trace (a child of its start span), named for what it
    was, with the step the flow was at; a wake says its delivery and links to its caller's span
    (the caller's trace stays its own). A wake to no such flow traces nothing."""
    provider, exporter = traced()
    tracer = provider.get_tracer("the application")
    plan = wait_plan()
    async with flow.open_engine(tmp_path / "t.db", plans=[plan], tracer_provider=provider) as e:
        e.on("paid", lambda ev: flow.Wake(ev["flow"], "paid", message_id=ev["id"]))
        starts = {}
        for fid in ("by-wake", "by-publish", "by-timeout"):
            with tracer.start_as_current_span(f"POST /{fid}") as request:
                await e.start(plan, flow_id=fid)
            starts[fid] = request.get_span_context().trace_id
        for fid in starts:
            await parked(e, fid)
        with tracer.start_as_current_span("POST /confirm") as confirm:
            assert await e.wake("by-wake", "ok") is flow.Delivery.RESUMED
        assert await e.wake("nobody", "ok") is flow.Delivery.UNKNOWN
        with tracer.start_as_current_span("consume paid") as consume:
            event = {"flow": "by-publish", "id": "evt-1"}
            assert await e.publish("paid", event) == [flow.Delivery.RESUMED]
        for fid, why in (("by-wake", "ok"), ("by-publish", "paid"), ("by-timeout", "timeout")):
            assert (await e.wait(fid, timeout=7200)).data == {"woken_by": why}
        assert await e.publish("paid", event) == [flow.Delivery.DUPLICATE]  # no caller span
    spans = exporter.get_finished_spans()
    moved = [s for s in spans if not s.name.startswith(("POST", "consume", "start", "step", "end"))]
    assert sorted(s.name for s in moved) == [
        "timeout waits",
        "wake waits",
        "wake waits",
        "wake waits",
    ]
    by_id = {
        sid: next(s for s in spans if s.name == "start waits" and s.context.trace_id == tid)
        for sid, tid in starts.items()
    }
    deliveries = []
    for span in moved:
        fid = attrs_of(span)["workflow.id"]
        start = by_id[fid]
        assert span.context.trace_id == starts[fid]
        assert span.parent is not None and span.parent.span_id == start.context.span_id
        assert span.start_time is not None and span.end_time is not None
        assert start.end_time is not None and start.end_time <= span.start_time <= span.end_time
        attributes = attrs_of(span)
        delivery = attributes.pop("workflow.wake.delivery", None)
        at = attributes.pop("workflow.task.name", None)  # none once the flow has completed
        assert attributes == {"workflow.name": "waits", "workflow.id": fid, "workflow.version": 2}
        links = [link.context.span_id for link in span.links]
        deliveries.append((fid, span.name, at, delivery, links))
    assert sorted(deliveries, key=str) == [
        ("by-publish", "wake waits", "hold", "RESUMED", [consume.get_span_context().span_id]),
        ("by-publish", "wake waits", None, "DUPLICATE", []),
        ("by-timeout", "timeout waits", "hold", None, []),
        ("by-wake", "wake waits", "hold", "RESUMED", [confirm.get_span_context().span_id]),
    ]
    # The callers' own spans stay in their own traces.
    assert confirm.get_span_context().trace_id not in starts.values()
    assert consume.get_span_context().trace_id not in starts.values()


async def test_a_provider_that_is_not_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="tracer_provider must be an OpenTelemetry TracerProvider"):
        async with flow.open_engine(tmp_path / "t.db", plans=[order_plan()], tracer_provider=42):
            pass  # pragma: no cover


_SCRIPT = textwrap.dedent(
    """
    import sys, trio
    from ferry import flow

    def otel():
        return sorted(m for m in sys.modules if m.startswith("opentelemetry"))

    plan = flow.Plan("p")

    @plan.step
    async def only(ctx):
        pass

    async def run(path, fid):
        async with flow.open_engine(path, plans=[plan]) as engine:
            await engine.start(plan, flow_id=fid)
            await engine.wait(fid, timeout=30)

    print("after import", otel())
    trio.run(run, sys.argv[1], "a")
    print("after a flow", otel())

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    trace.get_tracer_provider()  # the API's proxy: traces stay off
    trio.run(run, sys.argv[1], "b")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # the application's global provider: traces on
    trio.run(run, sys.argv[1], "c")
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time)
    print("spans", [(s.name, s.attributes["workflow.id"]) for s in spans])
    """
)


def test_opentelemetry_is_not_imported_unless_the_application_uses_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "t.db")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "after import []",
        "after a flow []",
        "spans [('start p', 'c'), ('step p.only', 'c'), ('end p', 'c')]",
    ]


async def test_on_postgres_another_engine_of_the_fleet_continues_the_trace(
    pg_server: pg.PgServer,
) -> None:
    """Engine "a" starts the flow, which parks; engine "b" (another store connection, another
    owner) wakes and finishes it: its spans join the trace that "a" began."""
    provider, exporter = traced()
    dsn = pg_server.fresh_schema_dsn()
    plan = order_plan()
    async with PostgresStore(dsn, connections=2) as sa, PostgresStore(dsn, connections=2) as sb:
        async with flow.open_engine(sa, plans=[plan], owner="a", tracer_provider=provider) as a:
            await a.start(plan, flow_id="o-3")
            with trio.fail_after(30):
                await parked(a, "o-3")
        async with flow.open_engine(sb, plans=[plan], owner="b", tracer_provider=provider) as b:
            assert await b.wake("o-3", "yes") is flow.Delivery.RESUMED
            assert (await b.wait("o-3", timeout=30)).state is flow.State.COMPLETED
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert [s.name for s in spans][-2:] == ["step order.ship", "end order"]
    start = spans[0]
    assert start.context is not None
    assert {s.context.trace_id for s in spans if s.context is not None} == {start.context.trace_id}
    assert all(
        s.parent is not None and s.parent.span_id == start.context.span_id for s in spans[1:]
    )
