"""A bad argument to `park()` or `fail()` in a step is a mistake in the step's code: the flow fails
at once, without the retries meant for a flaky step; `park()` takes a `timedelta` too. `Engine`
is made by `open_engine` only."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow


def plan_whose_step_returns(make: Any, runs: list[int]) -> flow.Plan:
    plan = flow.Plan("p")

    @plan.step(attempts=3)
    async def only(ctx: flow.Context) -> Any:
        runs.append(ctx.attempt)
        return make()

    return plan


BAD: Any = {"text": "soon", "later": "later", "number": 42}


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: flow.park(timeout=BAD["text"]), "TypeError"),
        (lambda: flow.park(timeout=-1.0), "ValueError"),
        (lambda: flow.park(timeout=datetime.timedelta(seconds=-1)), "ValueError"),
        (lambda: flow.park(on_timeout=BAD["later"]), "ValueError"),
        (lambda: flow.fail(reason=BAD["number"]), "TypeError"),
    ],
)
async def test_a_bad_outcome_argument_fails_the_flow_at_once(
    tmp_path: Path, make: Any, error: str
) -> None:
    runs: list[int] = []
    plan = plan_whose_step_returns(make, runs)
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="f1", data={})
        snap = await engine.wait("f1", timeout=30)
    assert runs == [1], "the step ran again although the same code makes the same mistake"
    assert snap.state is flow.State.FAILED
    assert snap.error is not None
    assert snap.error.startswith(f"step 'only' raised {error}(")
    assert "not retried" in snap.error
    assert "_Outcome" not in snap.error


async def test_park_takes_a_timedelta(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    runs: list[int] = []
    plan = plan_whose_step_returns(
        lambda: flow.park(timeout=datetime.timedelta(hours=2), on_timeout="continue"), runs
    )

    @plan.step
    async def after(ctx: flow.Context) -> None:
        ctx.data["timed_out"] = ctx.timed_out

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="f1", data={})
        parked = await engine.get("f1")
        while parked is None or parked.state is not flow.State.PARKED:
            await trio.sleep(1)
            parked = await engine.get("f1")
        at = [e.at for e in await engine.history("f1") if e.kind == "parked"]
        assert parked.park_deadline is not None
        assert parked.park_deadline - at[0] == pytest.approx(7200, abs=1)
        snap = await engine.wait("f1", timeout=3 * 3600)
    assert runs == [1]
    assert snap.state is flow.State.COMPLETED
    assert snap.data == {"timed_out": True}


def test_park_names_the_bad_timeout() -> None:
    with pytest.raises(TypeError, match=r"datetime.timedelta or None, got 'soon'"):
        flow.park(timeout="soon")  # type: ignore[arg-type]


def test_the_engine_has_no_public_constructor() -> None:
    with pytest.raises(TypeError, match=r"ferry.flow.Engine has no public constructor"):
        flow.Engine()  # type: ignore[call-arg]
