"""Attempts count runs that began (ADR 0064): an operator's wake or a close before a run began
does not spend an attempt."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from ferry import flow


async def test_after_an_operators_wake_the_next_step_runs_as_attempt_1(tmp_path: Path) -> None:
    """The operator's engine (the inspector's) wakes a parked flow; the engine that opens next
    ran its next step as attempt 2, though no run of it had begun. Now it runs as attempt 1."""
    path = str(tmp_path / "flows.db")
    attempts: list[tuple[str, int]] = []
    plan = flow.Plan("operated", version=1)

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Park:
        attempts.append((ctx.step, ctx.attempt))
        return flow.park()

    @plan.step
    async def after(ctx: flow.Context) -> None:
        attempts.append((ctx.step, ctx.attempt))

    async with flow.open_engine(path, plans=[plan]) as engine:
        await engine.start(plan, flow_id="f")
        while (snap := await engine.get("f")) is None or snap.state is not flow.State.PARKED:
            await trio.testing.wait_all_tasks_blocked()
    async with flow.open_engine(path, plans=[], serve=False) as operator:
        assert await operator.wake("f", {"by": "hand"}) is flow.Delivery.RESUMED
    async with flow.open_engine(path, plans=[plan]) as engine:
        assert (await engine.wait("f", timeout=5)).state is flow.State.COMPLETED
    assert attempts == [("hold", 1), ("after", 1)]


async def test_a_flow_whose_run_had_not_begun_at_close_keeps_its_attempt(tmp_path: Path) -> None:
    """One runner slot: `a` runs (and is cut short by the close), `b` waits for the slot. At
    the next open `a` runs again as attempt 2 (a run began) and `b` first runs as attempt 1."""
    path = str(tmp_path / "flows.db")
    runs: list[tuple[str, int]] = []
    running = trio.Event()
    plan = flow.Plan("slots", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        runs.append((ctx.flow_id, ctx.attempt))
        if ctx.flow_id == "a" and ctx.attempt == 1:
            running.set()
            await trio.sleep_forever()

    async with flow.open_engine(path, plans=[plan], max_running=1) as engine:
        await engine.start(plan, flow_id="a")
        await running.wait()
        await engine.start(plan, flow_id="b")
    assert runs == [("a", 1)]
    async with flow.open_engine(path, plans=[plan]) as engine:
        assert (await engine.wait("a", timeout=5)).state is flow.State.COMPLETED
        assert (await engine.wait("b", timeout=5)).state is flow.State.COMPLETED
    assert sorted(runs) == [("a", 1), ("a", 2), ("b", 1)]
