"""Every attempt of a step or compensation that raised is in the flow's history (its error, type
and a bounded traceback) and logged at WARNING; the last one keeps its traceback too."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from ferry import flow
from ferry.flow._model import _checks


async def test_a_flaky_step_leaves_each_failed_attempt_in_the_history(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    plan = flow.Plan("shaky")
    tries: list[int] = []

    @plan.step(attempts=3)
    async def call_the_bank(ctx: flow.Context) -> None:
        tries.append(ctx.attempt)
        if ctx.attempt < 3:
            raise ConnectionError(f"reset by peer #{ctx.attempt}")

    caplog.set_level(logging.WARNING, "ferry.flow")
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="f1")
        snap = await engine.wait("f1", timeout=60)
        events = await engine.history("f1")
    assert snap.state is flow.State.COMPLETED and tries == [1, 2, 3]
    failed = [e for e in events if e.kind == "attempt_failed"]
    assert [(e.step, e.attempt) for e in failed] == [("call_the_bank", 1), ("call_the_bank", 2)]
    for e, n in zip(failed, (1, 2), strict=True):
        assert isinstance(e.detail, dict)
        assert e.detail["error"] == f"ConnectionError('reset by peer #{n}')"
        assert e.detail["type"] == "ConnectionError"
        tb = e.detail["traceback"]
        assert isinstance(tb, str)
        assert "in call_the_bank" in tb and tb.endswith(f"ConnectionError: reset by peer #{n}")
    revisions = [e.revision for e in events]
    assert revisions == sorted(revisions) and len(set(revisions)) >= 4  # no gap left unexplained
    warnings = [r for r in caplog.records if "runs again" in r.getMessage()]
    assert len(warnings) == 2
    assert warnings[0].__dict__["flow_id"] == "f1"
    assert warnings[0].__dict__["error_type"] == "ConnectionError"
    assert warnings[0].__dict__["attempt"] == 1
    assert "ConnectionError('reset by peer #1') on attempt 1 (1 of 3 tries)" in (
        warnings[0].getMessage()
    )


async def test_the_last_attempt_keeps_its_traceback(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plan = flow.Plan("broken")
    undone: list[int] = []

    async def undo(ctx: flow.Context) -> None:
        undone.append(ctx.attempt)
        raise KeyError("account 42 is closed")

    @plan.step(compensate=undo, attempts=2)
    async def reserve(ctx: flow.Context) -> None:
        pass

    @plan.step(attempts=2)
    async def charge(ctx: flow.Context) -> None:
        raise ValueError("declined")

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="f1")
        while True:
            snap = await engine.get("f1")
            if snap is not None and snap.state is flow.State.BLOCKED:
                break
            await trio.sleep(1)
        events = await engine.history("f1")
    kinds = [e.kind for e in events]
    assert kinds.count("attempt_failed") == 2  # one of the step, one of the compensation
    (last_step,) = [e for e in events if e.kind == "step" and e.step == "charge"]
    assert isinstance(last_step.detail, dict)
    assert "raise ValueError" in str(last_step.detail["traceback"])
    (blocked,) = [e for e in events if e.kind == "blocked"]
    assert isinstance(blocked.detail, dict)
    assert str(blocked.detail["traceback"]).endswith("KeyError: 'account 42 is closed'")
    assert undone == [1, 2]


def test_a_long_traceback_is_cut_in_the_middle_and_storable() -> None:
    cause: BaseException | None = None
    for layer in range(100):  # a long chain of causes: a long traceback
        try:
            raise RuntimeError(f"layer {layer}") from cause
        except RuntimeError as exc:
            cause = exc
    try:
        raise RuntimeError("bottom \ud800") from cause
    except RuntimeError as exc:
        tb = _checks.traceback_text(exc)
        record = _checks.failure(exc)
    assert len(tb) < _checks.TRACEBACK_CHARS + 100
    assert "characters left out" in tb
    assert tb.startswith("Traceback (most recent call last):")
    assert tb.endswith("RuntimeError: bottom \\ud800")
    assert _checks.text_problem(tb) is None
    assert record["type"] == "RuntimeError"
