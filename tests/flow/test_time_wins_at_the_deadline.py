"""Time wins at the deadline: a wake at a parked flow's deadline meets the timeout first, at open
as well as in a running engine, and a wake to a flow already compensating is stale."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
import trio.testing

from ferry import flow
from ferry.flow._model import _machine as m
from ferry.flow._model._values import EMPTY_MAILBOX, Flow, Message, Shape


def _parked(on_timeout: str) -> tuple[Flow, Shape]:
    shape = Shape(name="p", version=1, steps=("a", "b"), compensable=(True, False), attempts=(3, 3))
    started = m.start(shape, "f", "{}", 0.0).flow
    park = flow.park(timeout=10.0, on_timeout=on_timeout)  # type: ignore[arg-type]
    parked = m.step_done(started, EMPTY_MAILBOX, shape, park, "{}", 0.0).flow
    assert parked.state is flow.State.PARKED and parked.park_deadline == 10.0
    return parked, shape


@pytest.mark.parametrize(
    ("on_timeout", "state", "delivery"),
    [
        ("compensate", flow.State.COMPENSATING, flow.Delivery.STALE),
        ("continue", flow.State.RUNNING, flow.Delivery.QUEUED),
    ],
)
def test_a_wake_at_the_deadline_meets_the_timeout_first(
    on_timeout: str, state: flow.State, delivery: flow.Delivery
) -> None:
    parked, shape = _parked(on_timeout)
    message = Message("evt-1", '{"ok":1}')
    before = m.wake(parked, EMPTY_MAILBOX, message, shape, 9.999)
    assert before.delivery is flow.Delivery.RESUMED  # just before: the wake wins
    at = m.wake(parked, EMPTY_MAILBOX, message, shape, 10.0)
    assert at.delivery is delivery
    assert at.flow.state is state and at.flow.revision == parked.revision + 1
    assert at.flow.wake is None  # not resumed by the wake
    assert at.events[0].kind == "timed_out"
    kept = [mm.message_id for mm in at.mailbox.queued]
    assert kept == (["evt-1"] if delivery is flow.Delivery.QUEUED else [])


async def test_time_wins_at_open_over_the_first_wake(tmp_path: Path) -> None:
    """Flows parked with a short timeout, the engine closed and reopened after their deadlines:
    a wake as the first call resumed one of them (the others timed out). Now time wins: all
    time out."""
    path = str(tmp_path / "flows.db")
    plan = flow.Plan("deadline", version=1)
    refunded: list[str] = []

    async def refund(ctx: flow.Context) -> None:
        refunded.append(ctx.flow_id)

    @plan.step(compensate=refund)
    async def charge(ctx: flow.Context) -> flow.Park:
        return flow.park(timeout=0.2)

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        ctx.data["shipped"] = True

    ids = [f"o-{i}" for i in range(5)]
    async with flow.open_engine(path, plans=[plan]) as engine:
        for fid in ids:
            await engine.start(plan, flow_id=fid)
        for fid in ids:
            while (snap := await engine.get(fid)) is None or snap.state is not flow.State.PARKED:
                await trio.testing.wait_all_tasks_blocked()
        deadline = max(
            s.park_deadline for s in [await engine.get(f) for f in ids] if s and s.park_deadline
        )
    # the deadlines pass while no engine is open (wall-clock time: what a restart sees)
    await trio.sleep(max(0.0, deadline - time.time()) + 0.01)
    assert time.time() > deadline
    async with flow.open_engine(path, plans=[plan]) as engine:
        assert await engine.wake("o-0", {"paid": True}) is flow.Delivery.STALE
        snaps = [await engine.wait(fid, timeout=5) for fid in ids]
    assert [s.state for s in snaps] == [flow.State.FAILED] * 5
    assert all(s.error == "step 'charge' timed out while parked" for s in snaps)
    # each refunded; under load the first engine may have timed a flow out and begun its
    # compensation before it closed, and a compensation is at least once across a close
    assert set(refunded) == set(ids)


async def test_a_wake_to_a_compensating_flow_is_stale(tmp_path: Path) -> None:
    plan = flow.Plan("comp", version=1)
    undoing = trio.Event()
    release = trio.Event()

    async def undo(ctx: flow.Context) -> None:
        undoing.set()
        await release.wait()

    @plan.step(compensate=undo)
    async def first(ctx: flow.Context) -> None:
        pass

    @plan.step
    async def second(ctx: flow.Context) -> flow.Fail:
        return flow.fail("no stock")

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="c")
        await undoing.wait()
        assert (await engine.get("c")).state is flow.State.COMPENSATING  # type: ignore[union-attr]
        assert await engine.wake("c", {"late": True}, message_id="m-1") is flow.Delivery.STALE
        release.set()
        snap = await engine.wait("c")
        assert snap.state is flow.State.FAILED and snap.error == "no stock"
        # the message was not kept: the same id again is STALE, not DUPLICATE
        assert await engine.wake("c", None, message_id="m-1") is flow.Delivery.STALE
