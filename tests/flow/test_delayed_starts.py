"""A delayed start of a plan without limits (SPEC 5.8: "send this reminder in 24 hours"),
through the public API, on SQLite and PostgreSQL: the flow is `QUEUED` with its `not_before`
and starts at its time, while the plan's other starts run at once, as many as are started; a
cancel ends it `FAILED` with nothing to undo; a time that passed while no engine ran starts it
at the next open; a later version with limits takes the plan's queue over (docs/adr/0180).

Seen to fail with `_machine.start`'s ``not_before is not None`` taken out (the flow ran at
once) and with `_queues.at_open`'s plans with a queue left to the limited ones (the flow due
while closed stayed `QUEUED` after the reopen: `TooSlowError`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import trio
import trio.testing

from ferry import flow
from tests import switches


def reminder(ran: list[str], version: int = 1, limits: flow.Limits | None = None) -> flow.Plan:
    plan = flow.Plan("remind", version=version, limits=limits)

    @plan.step
    async def send(ctx: flow.Context) -> None:
        ran.append(ctx.flow_id)

    return plan


async def test_a_plan_without_limits_keeps_a_delayed_start_and_runs_the_others_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    where = str(tmp_path / "flows.db")
    ran: list[str] = []
    plan = reminder(ran)
    async with flow.open_engine(where, plans=[plan]) as engine:
        before = time.time()
        await engine.start(plan, flow_id="later", delay=86400)
        snap = await engine.get("later")
        assert snap is not None and snap.state is flow.State.QUEUED
        assert snap.not_before is not None and snap.not_before >= before + 86400 - 5  # its clock
        assert engine.statistics().queued == 1
        for i in range(20):  # no limit: none of them waits for the delayed one or each other
            await engine.start(plan, flow_id=f"now-{i}")
        for i in range(20):
            assert (await engine.wait(f"now-{i}", timeout=60)).state is flow.State.COMPLETED
        assert "later" not in ran
        began = trio.current_time()
        done = await engine.wait("later", timeout=2 * 86400)
        assert done.state is flow.State.COMPLETED and ran.count("later") == 1
        assert trio.current_time() - began >= 86400 - 60
        assert engine.statistics().queued == 0


async def test_on_postgresql_a_delayed_start_runs_after_its_time(where: Any) -> None:
    """With the real clock (PostgreSQL refuses an autojumping MockClock): the step's time in
    the history, never a race with it, shows the flow waited."""
    ran: list[str] = []
    plan = reminder(ran)
    async with flow.open_engine(where, plans=[plan]) as engine:
        await engine.start(plan, flow_id="later", delay=1.0)
        await engine.start(plan, flow_id="now")
        assert (await engine.wait("now", timeout=60)).state is flow.State.COMPLETED
        snap = await engine.get("later")
        assert snap is not None and snap.not_before is not None
        assert (await engine.wait("later", timeout=60)).state is flow.State.COMPLETED
        steps = [e.at for e in await engine.history("later") if e.kind == "step"]
        assert len(steps) == 1 and steps[0] >= snap.not_before - 0.05  # the store's clock
        assert sorted(ran) == ["later", "now"]


async def test_a_delayed_start_of_a_plan_without_limits_can_be_cancelled(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    where = str(tmp_path / "flows.db")
    ran: list[str] = []
    plan = reminder(ran)
    async with flow.open_engine(where, plans=[plan]) as engine:
        await engine.start(plan, flow_id="later", at=time.time() + 3600)
        assert await engine.cancel("later", "not needed") is True
        snap = await engine.wait("later", timeout=10)
        assert snap.state is flow.State.FAILED and "not needed" in (snap.error or "")
        await trio.sleep(7200)
        assert ran == [] and engine.statistics().queued == 0


async def test_a_time_that_passed_while_closed_starts_the_flow_at_open(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = str(tmp_path / "flows.db")
    ran: list[str] = []
    plan = reminder(ran)
    async with flow.open_engine(path, plans=[plan]) as engine:
        await engine.start(plan, flow_id="later", delay=600)
    # No engine runs for an hour: the host's wall clock an hour on (the tests' switch).
    an_hour_on = switches.open_engine(path, [reminder(ran)], wall_clock=lambda: time.time() + 3600)
    async with an_hour_on as engine:
        began = trio.current_time()
        assert (await engine.wait("later", timeout=600)).state is flow.State.COMPLETED
        assert trio.current_time() - began < 60  # at open, not at a timer of its own
    assert ran == ["later"]


async def test_a_later_version_with_limits_takes_the_plans_queue_over(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = str(tmp_path / "flows.db")
    ran: list[str] = []
    plan = reminder(ran)
    async with flow.open_engine(path, plans=[plan]) as engine:
        await engine.start(plan, flow_id="v1-later", delay=600)
    limited = reminder(ran, version=2, limits=flow.Limits(concurrency=1))
    async with flow.open_engine(path, plans=[reminder(ran), limited]) as engine:
        await engine.start(limited, flow_id="v2-now")
        assert (await engine.wait("v2-now", timeout=60)).state is flow.State.COMPLETED
        assert (await engine.wait("v1-later", timeout=3600)).state is flow.State.COMPLETED
    assert sorted(ran) == ["v1-later", "v2-now"]
