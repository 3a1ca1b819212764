"""The fleet's trust after a lapse (ADR 0047, 0052): a renewal after a lapse trusts no flow taken
over, a copy from before a lapse is read again before a body runs on it, a flow taken back is
not released while its engine runs it. Findings of the fleet's model check (tests/model/fleet.py),
on the real engine."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from tests import switches

from ._helpers import PlantedStore, ValveStore

# Two engines share one SQLite file, each through its own connection, with the fleet's leases
# forced on (`fleet=True`, tests/switches.py), as in test_leases.py. Engine a's store is a
# `ValveStore`: the test lets its transactions through one by one, so that a's tasks stall
# exactly where a frozen or cut-off process's would, while its other tasks (a runner waiting for
# its slot under `max_running=1`) are scheduled after the renewal, as the model's shortest traces
# have them.

T0 = 1_700_000_000.0
LEASE = 30.0
NEVER = 10.0**6  # a scan interval: this engine scans only at open (or when the test says so)


def wall() -> float:
    return T0 + trio.current_time()


def two_steps(log: list[tuple[str, str, int]], gates: dict[str, trio.Event]) -> flow.Plan:
    """reserve (compensated by release) -> ship. A body logs (name, flow, attempt) and waits
    for the gate named ``name/flow/attempt`` if the test made one."""
    plan = flow.Plan("order")

    async def gated(name: str, ctx: flow.Context) -> None:
        log.append((name, ctx.flow_id, ctx.attempt))
        gate = gates.get(f"{name}/{ctx.flow_id}/{ctx.attempt}")
        if gate is not None:
            await gate.wait()

    async def release(ctx: flow.Context) -> None:
        await gated("release", ctx)

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        await gated("reserve", ctx)

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        await gated("ship", ctx)

    return plan


def fleet_engine(store: object, plan: flow.Plan, owner: str, **options: Any) -> Any:
    return switches.open_engine(
        store, plans=[plan], owner=owner, lease=LEASE, fleet=True, wall_clock=wall, **options
    )


async def until(predicate: Callable[[], bool], *, step: float = 0.5) -> None:
    with trio.fail_after(3600):
        while not predicate():  # noqa: ASYNC110 (the clock drives the engines' loops)
            await trio.sleep(step)


async def test_a_renewal_after_a_lapse_does_not_trust_a_flow_taken_over(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The model's first finding (7 steps), on the real engine. Engine a (one runner slot) runs
    g's reserve while f waits for the slot; a's heartbeat stalls in its check of the flows it
    holds (a database call that does not come back), so a neither renews nor lets go, past its
    lease; engine b takes both flows over and runs f. Then a's check fails, its next renewal
    gets through, g's body returns and f gets a's slot before a's next check: with the bug, a
    trusted f again on the strength of the renewal and ran reserve beside b's run of it."""
    log: list[tuple[str, str, int]] = []
    gates = {"reserve/g/1": trio.Event(), "reserve/g/2": trio.Event()}
    plan = two_steps(log, gates)
    path = str(tmp_path / "fleet.db")
    store_a, store_b = ValveStore(path), PlantedStore(path)
    async with (
        fleet_engine(store_b, plan, "b") as b,
        fleet_engine(store_a, plan, "a", max_running=1, scan_interval=NEVER) as a,
    ):
        # a's first renewal goes through; its check right after it does not come back.
        store_a.hold_after("renew", "load_active")
        await a.start(plan, flow_id="g")
        await a.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        assert log == [("reserve", "g", 1)]  # f waits for a's only slot
        await until(lambda: ("reserve", "f", 2) in log)  # b took both over when a's lease lapsed
        assert b.statistics().claimed == 2 and a.statistics().renewals == 1
        assert trio.current_time() > LEASE + LEASE / 3
        store_a.let_through("load_active", fail=True)  # a's stalled check fails at last
        await until(lambda: a.statistics().renewals == 2)  # a renewal after the lapse
        assert store_a.waiting("load_active")  # ... and the check after it stalls again
        # The renewal re-read both flows and dropped them (g's body is cancelled), before a
        # trusted its lease again.
        assert a.statistics().lost == 2
        gates["reserve/g/1"].set()  # g's body returns (if it still runs): f gets the slot
        await trio.testing.wait_all_tasks_blocked()
        runs_of_f = [entry for entry in log if entry[:2] == ("reserve", "f")]
        store_a.open()
        gates["reserve/g/2"].set()
        assert (await b.wait("g", timeout=600)).state is flow.State.COMPLETED
        assert (await b.wait("f", timeout=600)).state is flow.State.COMPLETED
        stats = a.statistics()
    assert runs_of_f == [("reserve", "f", 2)], f"engine a ran f beside engine b: {runs_of_f}"
    assert stats.lost == 2 and stats.running == 0


async def test_a_copy_from_before_a_lapse_is_read_again_before_a_body_runs_on_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The first finding's other face: a copy that reaches the engine only after its renewal
    (here the answer to a `start` that committed just before a's heartbeat stalled) is not
    among the flows that renewal re-read. Engine b took the flow over meanwhile; a must read
    the row again before it runs a body on that copy (`Lease.confirm`)."""
    log: list[tuple[str, str, int]] = []
    plan = two_steps(log, {})
    path = str(tmp_path / "fleet.db")
    store_a, store_b = ValveStore(path), PlantedStore(path)
    async with (
        trio.open_nursery() as nursery,
        fleet_engine(store_b, plan, "b") as b,
        fleet_engine(store_a, plan, "a", scan_interval=NEVER) as a,
    ):
        store_a.hold_after("renew", "load_active")  # a's heartbeat stalls in its next check
        await until(lambda: bool(store_a.waiting("load_active")))
        store_a.held.add("write_batch")
        nursery.start_soon(partial(a.start, plan, flow_id="h"))
        await trio.testing.wait_all_tasks_blocked()
        store_a.let_through("write_batch", answer=False)  # h is a's; a does not know it yet
        await until(lambda: ("reserve", "h", 2) in log)  # b took h over once a's lease lapsed
        store_a.let_through("load_active", fail=True)
        await until(lambda: a.statistics().renewals == 2)  # a renewal after the lapse
        store_a.answer("write_batch")  # the start's answer: h, as a wrote it before the lapse
        await trio.testing.wait_all_tasks_blocked()
        runs_of_h = [entry for entry in log if entry[:2] == ("reserve", "h")]
        store_a.open()
        assert (await b.wait("h", timeout=600)).state is flow.State.COMPLETED
    assert runs_of_h == [("reserve", "h", 2)], f"engine a ran h beside engine b: {runs_of_h}"


def cancel_op(fn: Callable[..., Any]) -> bool:
    """Is this write batch a cancel's (a write on the held row, not from a runner's copy)?"""
    return any(op.flow is None for op in fn.keywords["ops"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("in_flight", [False, True], ids=["before-the-renewal", "during-it"])
async def test_a_flow_taken_back_is_not_released_while_its_engine_runs_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, in_flight: bool
) -> None:
    """The model's second finding (11 steps), on the real engine. Engine a (one runner slot)
    loses its database while ship's outcome is on its way: at the margin it lets f go, to
    be released with its next renewal. A cancel through a then gives f back to a (its runner
    slot is still taken by the write in flight, so f waits for it), and a's renewal gets
    through before its runner starts the compensation. With the bug, that renewal released f,
    which a then compensated while engine b took it over and compensated it too.

    The cancel lands before the renewal is sent (the model's order: forgetting the release
    when f comes back is enough), or while it is in flight, its release already decided (only
    a release made at the revision let go leaves f alone)."""
    log: list[tuple[str, str, int]] = []
    gates = {"ship/f/1": trio.Event(), "release/f/1": trio.Event()}
    plan = two_steps(log, gates)
    path = str(tmp_path / "fleet.db")
    store_a, store_b = ValveStore(path), PlantedStore(path)
    async with trio.open_nursery() as nursery:
        async with (
            fleet_engine(store_b, plan, "b", scan_interval=NEVER) as b,
            fleet_engine(
                store_a, plan, "a", max_running=1, scan_interval=NEVER, group_commit=False
            ) as a,
        ):
            await a.start(plan, flow_id="f")
            await trio.testing.wait_all_tasks_blocked()
            store_a.held.add("*")  # a's database is gone ...
            gates["ship/f/1"].set()  # ... as ship returns: its outcome's write waits
            await trio.sleep(LEASE - LEASE / 10 + 1)  # a cannot renew: it lets f go
            assert a.statistics().lost == 1 and store_a.waiting("write_batch")
            cancelled: list[bool] = []

            async def cancel() -> None:
                cancelled.append(await a.cancel("f", "by a"))

            async def given_back() -> None:
                nursery.start_soon(cancel)
                await trio.testing.wait_all_tasks_blocked()
                store_a.let_through("write_batch", cancel_op)  # the cancel gives f back to a
                await trio.testing.wait_all_tasks_blocked()
                assert cancelled == [True]

            if not in_flight:
                await given_back()
            store_a.let_through("load_active")  # a's heartbeat: its check, then a renewal
            await until(lambda: bool(store_a.waiting("renew")))
            if in_flight:
                await given_back()
            store_a.let_through("renew")
            await trio.testing.wait_all_tasks_blocked()
            assert a.statistics().renewals == 1
            store_a.open()  # the rest: ship's write fails, a's runner compensates f
            await trio.testing.wait_all_tasks_blocked()
            assert ("release", "f", 1) in log, "engine a let go of the flow it was given back"
            await trio.sleep(1)
            # with the bug, f was released: b took it over, compensated
            await b._parts.mode.rounds.scan()
            await trio.testing.wait_all_tasks_blocked()
            releases = [entry for entry in log if entry[0] == "release"]
            claimed = b.statistics().claimed
            gates["release/f/1"].set()
            snap = await a.wait("f", timeout=600)
    assert releases == [("release", "f", 1)], f"f compensated by both engines: {releases}"
    assert claimed == 0  # a kept the flow it was given back: nothing to take over
    assert snap.state is flow.State.FAILED and snap.error == "by a"
