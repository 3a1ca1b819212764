"""What the engine logs (logger "ferry.flow"): open, close, a failed or blocked flow, and steps."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ferry import flow


async def test_the_engine_logs_open_close_failed_blocked_and_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="ferry.flow")
    plan = flow.Plan("logged", version=1)

    async def broken_undo(ctx: flow.Context) -> None:
        raise RuntimeError("refund service down")

    @plan.step(compensate=broken_undo, attempts=1)
    async def reserve(ctx: flow.Context) -> None:
        pass

    @plan.step
    async def charge(ctx: flow.Context) -> flow.Fail:
        return flow.fail(f"card declined for {ctx.flow_id}")

    other = flow.Plan("plain", version=1)

    @other.step
    async def refuse(ctx: flow.Context) -> flow.Fail:
        return flow.fail("no stock")

    path = str(tmp_path / "f.db")
    async with flow.open_engine(path, plans=[plan, other]) as engine:
        await engine.start(plan, flow_id="b-1")
        await engine.start(other, flow_id="f-1")
        assert (await engine.wait("b-1")).state is flow.State.BLOCKED
        assert (await engine.wait("f-1")).state is flow.State.FAILED
    records = [r for r in caplog.records if r.name == "ferry.flow"]
    info = [r for r in records if r.levelno == logging.INFO]
    messages = [r.getMessage() for r in info]
    assert "opened on SQLite file" in messages[0] and "0 flows recovered" in messages[0]
    assert "closed" in messages[-1]
    failed = [r for r in info if getattr(r, "state", None) == "FAILED"]
    assert [(r.flow_id, r.plan, r.step, r.attempt) for r in failed] == [  # type: ignore[attr-defined]
        ("f-1", "plain", "refuse", 1)
    ]
    assert "no stock" in failed[0].getMessage()
    blocked = [r for r in info if getattr(r, "state", None) == "BLOCKED"]
    assert [(r.flow_id, r.step) for r in blocked] == [("b-1", "reserve")]  # type: ignore[attr-defined]
    assert "refund service down" in blocked[0].getMessage()
    debug = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert any("running step 'charge', attempt 1" in d for d in debug)
    assert any("running compensation of step 'reserve', attempt 1" in d for d in debug)
