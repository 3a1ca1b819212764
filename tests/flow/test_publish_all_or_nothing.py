"""A publish applies all of its decisions or none."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from ferry import flow


async def test_a_publish_applies_all_of_its_decisions_or_none(tmp_path: Path) -> None:
    """A Wake, then a Start whose id is taken: the wake was applied (the flow completed) and the
    caller got IdReused, unable to tell what happened. Now neither is, and once the id is free
    both are, in one go."""
    plan = flow.Plan("chore", version=1)

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Park:
        return flow.park()

    @plan.step
    async def done(ctx: flow.Context) -> None:
        ctx.data["paid"] = ctx.wake

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="o-1")
        await engine.start(plan, flow_id="taken", data={"other": True})
        while (snap := await engine.get("o-1")) is None or snap.state is not flow.State.PARKED:
            await trio.testing.wait_all_tasks_blocked()
        engine.on("paid", lambda e: flow.Wake("o-1", {"amount": e["amount"]}, message_id=e["id"]))
        start_id = ["taken"]
        engine.on("paid", lambda e: flow.Start(plan, start_id[0], data={}))
        with pytest.raises(flow.IdReused, match="taken"):
            await engine.publish("paid", {"id": "evt-1", "amount": 30})
        snap = await engine.get("o-1")
        assert snap is not None and snap.state is flow.State.PARKED and snap.revision == 2
        assert engine.statistics().wakes[flow.Delivery.RESUMED] == 0
        # the same event once the conflict is gone: both applied, in one go
        start_id[0] = "new"
        assert await engine.publish("paid", {"id": "evt-1", "amount": 30}) == [
            flow.Delivery.RESUMED,
            "new",
        ]
        assert (await engine.wait("o-1")).data == {"paid": {"amount": 30}}
