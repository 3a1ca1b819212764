"""A cancel through an engine without the flow's plan version (ADR 0046) can be finished once
the version is back: a finding of the flow's model check (tests/model/flow.py, ADR 0050), on
the real engine."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import trio
import trio.testing

from ferry import flow

# The bug the model check found (fixed, ADR 0046): `cancel` through an engine that lacked the
# flow's plan version compensated and named the top of the stack after the current step; once the
# version was back, `resume` refused the blocked flow for ever.


def reserve_confirm_ship(log: list[str], version: int) -> flow.Plan:
    """reserve (compensated) -> confirm (parks; no compensation) -> ship."""
    plan = flow.Plan("order", version=version)

    async def release(ctx: flow.Context) -> None:
        log.append("release")

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        log.append("reserve")

    @plan.step
    async def confirm(ctx: flow.Context) -> flow.Outcome:
        return flow.park(timeout=3600)

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        log.append("ship")

    return plan


async def cancel_without_the_version(path: str) -> tuple[bool, object, object, list[str]]:
    """Park a v1 flow, cancel it through an engine that has only v2, then bring v1 back and let
    an operator finish it (resume if it is blocked, cancel again if it is parked)."""
    store = path
    log: list[str] = []
    v1, v2 = reserve_confirm_ship(log, 1), reserve_confirm_ship(log, 2)
    async with flow.open_engine(store, plans=[v1]) as engine:
        await engine.start(v1, flow_id="o")
        await trio.testing.wait_all_tasks_blocked()
        parked = await engine.get("o")
    assert parked is not None and parked.state is flow.State.PARKED and parked.step == "confirm"
    async with flow.open_engine(store, plans=[v2]) as engine:
        await engine.cancel("o")
        await trio.testing.wait_all_tasks_blocked()
    async with flow.open_engine(store, plans=[v1, v2]) as engine:
        snap = await engine.get("o")
        assert snap is not None
        blocked = snap if snap.state is flow.State.BLOCKED else None
        resumed = blocked is None or await engine.resume("o")
        if resumed:
            snap = await engine.get("o")
            if snap is not None and snap.state is flow.State.PARKED:
                await engine.cancel("o")
            snap = await engine.wait("o", timeout=86400)
    return resumed, blocked, snap, log


def test_a_cancel_without_the_plan_version_can_be_finished_once_it_is_back(
    tmp_path: Path,
) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    run = partial(cancel_without_the_version, str(tmp_path / "flows.db"))
    resumed, blocked, snap, log = trio.run(run, clock=clock)
    # With the bug, the v2 engine's cancel made the flow COMPENSATING at index 0 but step
    # 'confirm', it blocked it, and with v1 back `resume` refused it (the step name differed).
    assert resumed, f"resume refused the flow blocked at {blocked}"
    assert isinstance(snap, flow.Snapshot) and snap.state is flow.State.FAILED
    assert log == ["reserve", "release"]
