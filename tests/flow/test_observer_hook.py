"""The public observer hook (docs/adr/0138), used as an application would: an observer of its
own given to `flow.open_engine(observers=[...])` or `Engine.add_observer` is told of every step
attempt (`flow.StepRun`), every flow the engine ends (`flow.FlowEnd`), the engine's open and its
close, with public values only; something that is not an observer is a `TypeError` at the call
that was given it, naming it, before anything is opened.

Real parts: SQLite files, the engine's own runner and writes, prometheus_client's registry for
the collector given at open. Each test fails without the hook (``open_engine`` took no
``observers``, `Engine` had no `add_observer`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

import ferry
from ferry import flow, metrics
from ferry.flow._runtime import _observe


class Journal(flow.Observer):
    """An application's observer: it writes down what it is told, in order."""

    def __init__(self) -> None:
        self.told: list[tuple[str, object]] = []

    def step_ran(self, step: flow.StepRun) -> None:
        self.told.append(("step", step))

    def flow_ended(self, end: flow.FlowEnd) -> None:
        self.told.append(("end", end))

    def engine_opened(self, engine: flow.Engine) -> None:
        self.told.append(("opened", engine))

    def engine_closed(self, engine: flow.Engine) -> None:
        self.told.append(("closed", engine.statistics()))

    def steps(self) -> list[flow.StepRun]:
        return [x for kind, x in self.told if isinstance(x, flow.StepRun)]

    def ends(self) -> list[flow.FlowEnd]:
        return [x for kind, x in self.told if isinstance(x, flow.FlowEnd)]


async def until_parked(engine: flow.Engine, flow_id: str) -> None:
    """Until the flow is parked (read from the store; under the mock clock, no wall time)."""
    with trio.fail_after(60):
        while (snap := await engine.get(flow_id)) is None or snap.state is not flow.State.PARKED:  # noqa: ASYNC110
            await trio.sleep(0.01)


def order_plan(tries: dict[str, int]) -> flow.Plan:
    """reserve (compensated) -> pay (raises once, then parks) -> ship (fails if told to)."""
    plan = flow.Plan("order", version=3)

    async def release(ctx: flow.Context) -> None:
        pass

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        pass

    @plan.step(attempts=3)
    async def pay(ctx: flow.Context) -> flow.Outcome:
        tries[ctx.flow_id] = tries.get(ctx.flow_id, 0) + 1
        if tries[ctx.flow_id] == 1:
            raise RuntimeError("card reader busy")
        return flow.park(timeout=3600)

    @plan.step
    async def ship(ctx: flow.Context) -> flow.Outcome | None:
        return flow.fail("no carrier") if ctx.data.get("fail") else None

    return plan


async def test_an_observer_given_at_open_sees_steps_and_ends_with_public_values(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    journal = Journal()
    plan = order_plan({})
    async with flow.open_engine(tmp_path / "o.db", plans=[plan], observers=[journal]) as engine:
        assert journal.told == [("opened", engine)]  # before anything ran
        await engine.start(plan, flow_id="ok", data={})
        await engine.start(plan, flow_id="bad", data={"fail": True})
        await engine.start(plan, flow_id="gone", data={})
        for fid in ("ok", "bad", "gone"):
            await until_parked(engine, fid)
        await engine.wake("ok", "paid")
        await engine.wake("bad", "paid")
        await engine.cancel("gone", reason="changed my mind")
        for fid in ("ok", "bad", "gone"):
            await engine.wait(fid, timeout=60)
        ran = {(s.flow_id, s.step, s.attempt, s.compensating): s for s in journal.steps()}
    assert journal.told[-1] == ("closed", engine.statistics())  # last, with the final counts

    busy = ran[("ok", "pay", 1, False)]
    assert isinstance(busy.error, RuntimeError) and busy.result is None and not busy.void
    parked = ran[("ok", "pay", 2, False)]
    assert isinstance(parked.result, flow.Park) and parked.error is None
    assert (parked.plan, parked.version) == ("order", 3)
    assert not math.isnan(parked.seconds) and parked.seconds >= 0
    assert ran[("ok", "ship", 1, False)].result is None
    assert isinstance(ran[("bad", "ship", 1, False)].result, flow.Fail)
    assert ("bad", "reserve", 1, True) in ran  # its compensation ran
    assert ("gone", "reserve", 1, True) in ran

    ends = {e.flow_id: e for e in journal.ends()}
    assert sorted(ends) == ["bad", "gone", "ok"]
    ok, bad, gone = ends["ok"], ends["bad"], ends["gone"]
    assert (ok.state, ok.how, ok.step) == (flow.State.COMPLETED, "completed", "ship")
    assert ok.error is None
    assert ok.started_at <= ok.ended_at and ok.traceparent is None  # traces off
    assert (bad.state, bad.how) == (flow.State.FAILED, "failed")
    assert bad.error is not None and "no carrier" in bad.error
    assert (gone.state, gone.how) == (flow.State.FAILED, "failed")  # it compensated first
    assert gone.error is not None and "changed my mind" in gone.error
    assert len(journal.ends()) == 3  # each end told once


async def test_a_cancel_that_ends_a_flow_at_once_is_told_as_cancelled(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    journal = Journal()
    plan = flow.Plan("wait", version=1)

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Outcome:
        return flow.park(timeout=3600)

    async with flow.open_engine(tmp_path / "c.db", plans=[plan], observers=[journal]) as engine:
        await engine.start(plan, flow_id="w")
        await until_parked(engine, "w")
        assert await engine.cancel("w")
        await engine.wait("w", timeout=10)
    [end] = journal.ends()
    assert (end.state, end.how, end.step) == (flow.State.FAILED, "cancelled", "hold")


async def test_an_object_with_some_of_the_methods_is_an_observer(tmp_path: Path) -> None:
    """Not a subclass, one method of the protocol: it is told of ends, nothing else is asked."""
    seen: list[flow.FlowEnd] = []

    class Ends:
        def flow_ended(self, end: flow.FlowEnd) -> None:
            seen.append(end)

    plan = flow.Plan("one", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    async with flow.open_engine(tmp_path / "d.db", plans=[plan], observers=[Ends()]) as engine:  # type: ignore[list-item]
        await engine.start(plan, flow_id="x")
        await engine.wait("x", timeout=10)
    assert [(e.flow_id, e.plan, e.state) for e in seen] == [("x", "one", flow.State.COMPLETED)]


async def test_an_observer_added_later_sees_what_follows_until_removed(tmp_path: Path) -> None:
    plan = flow.Plan("one", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    journal = Journal()
    async with flow.open_engine(tmp_path / "l.db", plans=[plan]) as engine:
        await engine.start(plan, flow_id="before")
        await engine.wait("before", timeout=10)
        engine.add_observer(journal)
        with pytest.raises(ValueError, match="already observes"):
            engine.add_observer(journal)
        with pytest.raises(TypeError, match="not an observer"):
            engine.add_observer(object())  # type: ignore[arg-type]
        await engine.start(plan, flow_id="during")
        await engine.wait("during", timeout=10)
        assert engine.remove_observer(journal)
        assert not engine.remove_observer(journal)
        await engine.start(plan, flow_id="after")
        await engine.wait("after", timeout=10)
    with pytest.raises(ferry.Closed):
        engine.add_observer(Journal())
    assert [s.flow_id for s in journal.steps()] == ["during"]
    assert [e.flow_id for e in journal.ends()] == ["during"]
    assert not [kind for kind, _ in journal.told if kind in ("opened", "closed")]


class NotQuite:
    """Has the old, private method names, none of the protocol's."""

    def ran(self, *args: object) -> None: ...

    def ended(self, *args: object) -> None: ...


class Misspelt(flow.Observer):
    step_ran = 3  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("observers", "error", "says"),
    [
        ([object()], TypeError, r"observers\[0\] is <object object .*not an observer"),
        ([Journal(), NotQuite()], TypeError, r"observers\[1\] is .*NotQuite.*not an observer"),
        ([Journal], TypeError, r"observers\[0\] is the class Journal.*pass an instance"),
        (["metrics"], TypeError, r"observers\[0\] is 'metrics'"),
        ([Misspelt()], TypeError, r"observers\[0\] is .*whose step_ran is 3"),
        (Journal(), TypeError, "observers must be a list"),
        ("observer", TypeError, "observers must be a list"),
    ],
)
async def test_something_that_is_not_an_observer_is_refused_at_open(
    tmp_path: Path, observers: object, error: type[Exception], says: str
) -> None:
    plan = flow.Plan("one", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    with pytest.raises(error, match=says):
        async with flow.open_engine(tmp_path / "x.db", plans=[plan], observers=observers):  # type: ignore[arg-type]
            pass
    assert not (tmp_path / "x.db").exists()  # refused before anything was made


async def test_the_same_observer_twice_is_refused_at_open(tmp_path: Path) -> None:
    plan = flow.Plan("one", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    journal = Journal()
    with pytest.raises(ValueError, match=r"observers\[1\] is observers\[0\] again"):
        async with flow.open_engine(tmp_path / "x.db", plans=[plan], observers=[journal, journal]):
            pass


async def test_the_metrics_collector_given_at_open_exposes_the_engine(tmp_path: Path) -> None:
    """The collector is an observer like any other: given at open, it adds the engine as it
    opens (its gauges and counters) and sees its steps from the first."""
    plan = flow.Plan("one", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    registry = CollectorRegistry()
    collector = metrics.register(registry=registry)
    async with flow.open_engine(tmp_path / "m.db", plans=[plan], observers=[collector]) as engine:
        await engine.start(plan, flow_id="x")
        await engine.wait("x", timeout=10)
        text = generate_latest(registry).decode()
        assert 'ferry_flow_steps_total{outcome="ok",plan="one"} 1.0' in text
        assert 'ferry_flow_flow_duration_seconds_count{plan="one",state="completed"} 1.0' in text
        assert 'ferry_flow_ended_total{state="completed"} 1.0' in text  # its statistics
    text = generate_latest(registry).decode()
    assert 'ferry_flow_ended_total{state="completed"} 1.0' in text  # kept after its close
    assert not engine.remove_observer(collector)  # it let go at the close


async def test_a_blocked_flow_and_its_abandon_are_told_with_their_reasons(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    journal = Journal()
    plan = flow.Plan("refund", version=1)

    async def undo(ctx: flow.Context) -> None:
        raise RuntimeError("account closed")

    @plan.step(compensate=undo)
    async def pay(ctx: flow.Context) -> None:
        pass

    @plan.step
    async def ship(ctx: flow.Context) -> flow.Outcome:
        return flow.fail("no carrier")

    async with flow.open_engine(tmp_path / "b.db", plans=[plan], observers=[journal]) as engine:
        await engine.start(plan, flow_id="r")
        assert (await engine.wait("r", timeout=600)).state is flow.State.BLOCKED
        assert await engine.abandon("r", reason="refunded by hand", by="ops")
        await engine.wait("r", timeout=10)
    blocked, abandoned = journal.ends()
    assert (blocked.state, blocked.how, blocked.step) == (flow.State.BLOCKED, "blocked", "pay")
    assert blocked.error is not None and "account closed" in blocked.error
    assert (abandoned.state, abandoned.how) == (flow.State.FAILED, "abandoned")
    assert abandoned.error is not None and "refunded by hand" in abandoned.error
    undone = [s for s in journal.steps() if s.compensating]
    assert undone and all(isinstance(s.error, RuntimeError) for s in undone)


class Raising(flow.Observer):
    """Every method raises."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def step_ran(self, step: flow.StepRun) -> None:
        self.calls.append("step_ran")
        raise RuntimeError("step_ran")

    def flow_ended(self, end: flow.FlowEnd) -> None:
        self.calls.append("flow_ended")
        raise RuntimeError("flow_ended")

    def engine_opened(self, engine: flow.Engine) -> None:
        self.calls.append("engine_opened")
        raise RuntimeError("engine_opened")

    def engine_closed(self, engine: flow.Engine) -> None:
        self.calls.append("engine_closed")
        raise RuntimeError("engine_closed")


async def test_an_observer_given_at_open_that_raises_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its open and close raise too, and the one after it is still told everything."""
    # The warnings' rate limit is the process's: start with none logged yet.
    monkeypatch.setattr(_observe, "_complaints", _observe._Complaints())
    raising, journal = Raising(), Journal()
    plan = flow.Plan("one", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    path = tmp_path / "r.db"
    async with flow.open_engine(path, plans=[plan], observers=[raising, journal]) as engine:
        await engine.start(plan, flow_id="x")
        assert (await engine.wait("x", timeout=10)).state is flow.State.COMPLETED
    assert raising.calls == ["engine_opened", "step_ran", "flow_ended", "engine_closed"]
    assert [kind for kind, _ in journal.told] == ["opened", "step", "end", "closed"]
    warned = [r for r in caplog.records if r.name == "ferry.flow" and "observer" in r.getMessage()]
    assert warned and all(r.levelname == "WARNING" for r in warned)
