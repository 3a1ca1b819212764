"""Observability is never part of the outcome (docs/adr/0113): a span processor that raises in
``on_start`` or ``on_end``, an observer that raises, a metrics collector that raises: flows run
exactly as they would without them (one body run per attempt, the same end state), `start`,
`wake` and `publish` answer as they would, and each failure is logged as a WARNING with the
exception, rate limited (many failures, a few lines).

Real parts: the OpenTelemetry SDK's TracerProvider with a processor of the test's own, the
metrics collector of `ferry.metrics` in a real prometheus_client registry, SQLite.

Before the guards, the span processor raising in ``on_end`` made every attempt's park void
("raised"), the flow ended FAILED after three runs of its step, `start` raised although the flow
was stored and the wake that completed a flow raised to its caller; an observer raising ended
the engine's block."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from opentelemetry.context import Context as OtelContext
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from prometheus_client import CollectorRegistry

from ferry import flow, metrics
from ferry.flow._runtime import _observe

FLOWS = 20


@pytest.fixture(autouse=True)
def fresh_rate_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warnings' rate limit is the process's; each test starts with none logged yet."""
    monkeypatch.setattr(_observe, "_complaints", _observe._Complaints())


class Broken(RuntimeError):
    """What the planted observability code raises."""


class RaisingProcessor(SpanProcessor):
    """A span processor that raises where it is told to (``start``, ``end``), counting calls."""

    def __init__(self, where: set[str]) -> None:
        self.where = where
        self.calls: Counter[str] = Counter()

    def on_start(self, span: Span, parent_context: OtelContext | None = None) -> None:
        self.calls["start"] += 1
        if "start" in self.where:
            raise Broken("on_start")

    def on_end(self, span: ReadableSpan) -> None:
        self.calls["end"] += 1
        if "end" in self.where:
            raise Broken("on_end")


class RaisingObserver(flow.Observer):
    """A `flow.Observer` that raises at every call."""

    def __init__(self) -> None:
        self.calls = 0

    def step_ran(self, step: flow.StepRun) -> None:
        self.calls += 1
        raise Broken("step_ran")

    def flow_ended(self, end: flow.FlowEnd) -> None:
        self.calls += 1
        raise Broken("flow_ended")

    def engine_opened(self, engine: flow.Engine) -> None:
        self.calls += 1
        raise Broken("engine_opened")

    def engine_closed(self, engine: flow.Engine) -> None:
        self.calls += 1
        raise Broken("engine_closed")


def order_plan(runs: Counter[str]) -> flow.Plan:
    """reserve -> confirm (parks until woken, or 60 s: then it goes on) -> ship, each body
    counting its runs by (step, flow)."""
    plan = flow.Plan("order", version=1)

    @plan.step
    async def reserve(ctx: flow.Context) -> None:
        runs[f"reserve {ctx.flow_id}"] += 1

    @plan.step
    async def confirm(ctx: flow.Context) -> flow.Outcome:
        runs[f"confirm {ctx.flow_id}"] += 1
        return flow.park(timeout=60, on_timeout="continue")

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        runs[f"ship {ctx.flow_id}"] += 1

    return plan


async def parked(engine: flow.Engine, flow_id: str) -> None:
    with trio.fail_after(600):
        while (snap := await engine.get(flow_id)) is None or snap.state is not flow.State.PARKED:  # noqa: ASYNC110
            await trio.sleep(0.01)


Attach = Callable[[flow.Engine], None]


async def run_orders(
    path: Path, tracer_provider: object | None = None, attach: Attach | None = None
) -> tuple[Counter[str], list[flow.Snapshot], list[object]]:
    """FLOWS orders: started (half through `publish`), parked, then woken (half by `wake`,
    some by `publish`) or timed out; the step runs, the end snapshots and the answers."""
    runs: Counter[str] = Counter()
    plan = order_plan(runs)
    answers: list[object] = []
    async with flow.open_engine(str(path), plans=[plan], tracer_provider=tracer_provider) as e:
        if attach is not None:
            attach(e)
        e.on("ordered", lambda ev: flow.Start(plan, flow_id=ev["id"]))
        e.on("paid", lambda ev: flow.Wake(ev["id"], payload="paid", message_id=ev["m"]))
        ids = [f"o{i}" for i in range(FLOWS)]
        for i, fid in enumerate(ids):
            if i % 2:
                answers.append(await e.publish("ordered", {"id": fid}))
            else:
                answers.append(await e.start(plan, flow_id=fid))
        for fid in ids:
            await parked(e, fid)
        for i, fid in enumerate(ids):
            if i % 4 == 0:
                answers.append(await e.wake(fid, "paid", message_id=f"m{i}"))
            elif i % 4 == 1:
                answers.append(await e.publish("paid", {"id": fid, "m": f"m{i}"}))
            # the others time out after 60 s and go on
        ends = [await e.wait(fid, timeout=600) for fid in ids]
    return runs, ends, answers


def observability_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name.startswith("ferry") and r.levelno == logging.WARNING and r.exc_info
    ]


def what_it_would_be(tmp_path: Path) -> tuple[Counter[str], list[object], list[object]]:
    runs, ends, answers = trio.run(
        run_orders, tmp_path / "clean.db", clock=trio.testing.MockClock(autojump_threshold=0)
    )
    return runs, [(s.state, s.step) for s in ends], answers


@pytest.mark.parametrize("where", [{"start"}, {"end"}, {"start", "end"}])
def test_a_raising_span_processor_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: set[str]
) -> None:
    """Fails without the guards: with ``end`` the parks are void and every flow FAILED after
    three runs of ``confirm`` (and `start` raised); with ``start`` `start` raised at once."""
    clean_runs, clean_ends, clean_answers = what_it_would_be(tmp_path)
    assert set(clean_runs.values()) == {1} and len(clean_runs) == 3 * FLOWS

    processor = RaisingProcessor(where)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    caplog.set_level(logging.WARNING)
    runs, ends, answers = trio.run(
        run_orders,
        tmp_path / "traced.db",
        provider,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert runs == clean_runs  # one body run per step, as without traces
    assert [(s.state, s.step) for s in ends] == clean_ends
    assert all(s.state is flow.State.COMPLETED for s in ends)
    assert answers == clean_answers
    # Every span was begun (starts, steps, wakes, timeouts): the processor was called a lot...
    assert processor.calls["start"] >= 4 * FLOWS
    # ... and said so, as warnings with the exception, but only a few lines of them.
    logged = observability_warnings(caplog)
    assert 1 <= len(logged) <= 5, [r.getMessage() for r in logged]
    assert any(isinstance(r.exc_info[1], Broken) for r in logged if r.exc_info)


def test_a_raising_observer_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails without the guards: the observer's exception ended the engine's block."""
    clean_runs, clean_ends, clean_answers = what_it_would_be(tmp_path)
    observer = RaisingObserver()

    def attach(engine: flow.Engine) -> None:
        engine.add_observer(observer)

    caplog.set_level(logging.WARNING)
    runs, ends, answers = trio.run(
        run_orders,
        tmp_path / "observed.db",
        None,
        attach,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert runs == clean_runs
    assert [(s.state, s.step) for s in ends] == clean_ends
    assert answers == clean_answers
    assert observer.calls >= 4 * FLOWS  # every attempt, every end: called, and raised
    logged = observability_warnings(caplog)
    assert 1 <= len(logged) <= 5, [r.getMessage() for r in logged]
    assert all(isinstance(r.exc_info[1], Broken) for r in logged if r.exc_info)


def test_a_raising_metrics_collector_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector whose bookkeeping raises (planted: its `step_ran` and `flow_ended`). Fails
    without the guards: the engine's block ended with the collector's exception."""
    clean_runs, clean_ends, clean_answers = what_it_would_be(tmp_path)

    def broken(self: metrics.Metrics, *args: object) -> None:
        raise Broken("the collector")

    monkeypatch.setattr(metrics.Metrics, "step_ran", broken)
    monkeypatch.setattr(metrics.Metrics, "flow_ended", broken)
    registry = CollectorRegistry()

    def attach(engine: flow.Engine) -> None:
        metrics.register(engine, registry=registry)

    caplog.set_level(logging.WARNING)
    runs, ends, answers = trio.run(
        run_orders,
        tmp_path / "metered.db",
        None,
        attach,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert runs == clean_runs
    assert [(s.state, s.step) for s in ends] == clean_ends
    assert answers == clean_answers
    logged = observability_warnings(caplog)
    assert 1 <= len(logged) <= 5, [r.getMessage() for r in logged]


def test_the_warnings_are_rate_limited_per_kind_and_count_what_they_kept_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first failure of a kind is logged at once, the next ones of that kind within a
    minute are counted and said by the first line after it; another kind has its own limit."""
    now = [0.0]
    complaints = _observe._Complaints(clock=lambda: now[0])
    caplog.set_level(logging.WARNING)
    for _ in range(100):
        complaints.report(_observe.TRACING, "ending a span", Broken("on_end"))
    complaints.report(_observe.OBSERVER, "told of an attempt", Broken("ran"))
    now[0] = 59.0
    complaints.report(_observe.TRACING, "ending a span", Broken("on_end"))
    now[0] = 61.0
    complaints.report(_observe.TRACING, "ending a span", Broken("on_end"))
    lines = [r.getMessage() for r in caplog.records if r.name == "ferry.flow"]
    assert len(lines) == 3, lines
    assert lines[0].startswith("OpenTelemetry") and "more failures" not in lines[0]
    assert lines[1].startswith("an observer")
    assert lines[2].startswith("OpenTelemetry") and "100 more failures of it" in lines[2]
    assert all(r.exc_info is not None for r in caplog.records if r.name == "ferry.flow")
