"""The fleet's leases (ADR 0040) under `MockClock(autojump_threshold=0)`.

Several engines share one real SQLite file here, each through its own `PlantedStore` (a public
`SqliteStore` wrapped, see _helpers, so no engine lock), with the fleet's leases forced on
(`fleet=True`, tests/switches.py): the same code that runs on PostgreSQL, deterministic. A
"frozen" engine is one
whose store is held (`gate`): its transactions wait, as a SIGSTOPped process's would, while the
clock runs on for the others.
Every engine's wall clock is ``T0 + trio.current_time()``, so their leases compare exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from ferry.flow._model import _machine as m
from ferry.flow._model._values import Flow
from ferry.flow._store import _batch, _op, _schema, _store
from tests import switches

from ._helpers import PlantedStore

T0 = 1_700_000_000.0
LEASE = 30.0
Log = list[tuple[Any, ...]]


def wall() -> float:
    return T0 + trio.current_time()


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "fleet.db")


@asynccontextmanager
async def fleet_engine(
    store: PlantedStore, *plans: flow.Plan, owner: str, **options: Any
) -> AsyncIterator[flow.Engine]:
    options.setdefault("lease", LEASE)
    async with switches.open_engine(
        store, plans=list(plans), owner=owner, fleet=True, wall_clock=wall, **options
    ) as engine:
        yield engine


async def row(store: PlantedStore, flow_id: str) -> Flow:
    f = await store.transact(partial(_store.load, flow_id=flow_id))
    assert f is not None
    return f


async def kinds(store: PlantedStore, flow_id: str) -> list[str]:
    events = await store.transact(partial(_store.load_history, flow_id=flow_id))
    assert events is not None
    return [e.kind for e in events]


async def until(predicate: Any, *, step: float = 0.5, limit: float = 3600.0) -> None:
    """Let the (mock) clock run until `predicate()` holds; fail after `limit` seconds."""
    with trio.fail_after(limit):
        while not await predicate():  # noqa: ASYNC110 (the state is in another engine's store)
            await trio.sleep(step)


def saga(log: Log, gates: dict[str, trio.Event] | None = None, *, park: float | None = None):
    """reserve (compensated: release) -> charge (compensated: refund; waits for its gate, or
    parks with timeout `park` if given) -> ship. Each body logs (name, engine, attempt)."""
    plan = flow.Plan("order")

    async def release(ctx: flow.Context) -> None:
        log.append(("release", ctx.data.get("by"), ctx.attempt))

    async def refund(ctx: flow.Context) -> None:
        log.append(("refund", ctx.data.get("by"), ctx.attempt))

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        log.append(("reserve", ctx.flow_id, ctx.attempt))

    @plan.step(compensate=refund)
    async def charge(ctx: flow.Context) -> flow.Outcome | None:
        log.append(("charge", ctx.flow_id, ctx.attempt))
        if park is not None:
            return flow.park(timeout=park)
        if gates is not None:
            gate = gates.setdefault(f"{ctx.flow_id}/{ctx.attempt}", trio.Event())
            await gate.wait()
        return None

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        log.append(("ship", ctx.flow_id, ctx.attempt, ctx.wake))

    return plan


# ------------------------------------------------------------------------------ leases, renewal


async def engine_lease(store: PlantedStore, owner: str) -> float | None:
    for name, until, _started, _held in await store.transact(_store.load_engines):
        if name == owner:
            return until
    return None


async def test_a_running_flow_is_held_by_its_engine_whose_lease_is_renewed(
    path, autojump_clock
) -> None:
    gates: dict[str, trio.Event] = {}
    store = PlantedStore(path)
    async with fleet_engine(store, saga([], gates), owner="a") as a:
        await a.start(a._plans[("order", 1)], flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        f = await row(store, "f")
        assert (f.state, f.step, f.owner, f.lease_until) == (
            flow.State.RUNNING,
            "charge",
            "a",
            None,
        )
        assert await engine_lease(store, "a") == pytest.approx(wall() + LEASE)
        revision = f.revision
        await trio.sleep(LEASE * 3)  # nine renewals later
        until = await engine_lease(store, "a")
        assert until is not None and until > wall() + LEASE / 2
        assert (await row(store, "f")).revision == revision  # a renewal writes no flow row
        assert a.statistics().renewals >= 8 and a.statistics().lost == 0
        gates["f/1"].set()
        assert (await a.wait("f", timeout=60)).state is flow.State.COMPLETED
        done = await row(store, "f")
        assert done.owner is None and done.lease_until is None  # a finished flow is nobody's
    until = await engine_lease(store, "a")
    assert until is not None and until <= wall()  # closing ended the engine's lease


# ----------------------------------------------------------------- takeover and the frozen owner


@pytest.mark.parametrize("fencing", [True, False], ids=["fenced", "unfenced"])
async def test_a_frozen_owner_cannot_advance_a_flow_taken_over(
    path, autojump_clock, fencing: bool
) -> None:
    """Engine a runs the charge step and freezes (its store is held) past its lease; engine b
    takes the flow over and runs it to the end. When a thaws, its step returns and its write
    fails: it advanced nothing, and says so in `lost`. Without fencing (planted), a's stale
    write goes through: the charge outcome is recorded twice, the flow is rewound."""
    log: Log = []
    gates: dict[str, trio.Event] = {}
    plan = saga(log, gates)
    store_a, store_b = PlantedStore(path), PlantedStore(path)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(fleet_engine(store_a, plan, owner="a", fencing=fencing))
        b = await stack.enter_async_context(fleet_engine(store_b, plan, owner="b", fencing=fencing))
        await a.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        assert ("charge", "f", 1) in log and (await row(store_b, "f")).owner == "a"
        store_a.gate = trio.Event()  # a freezes: nothing it sends reaches the database
        gates["f/1"].set()  # ... while its charge step finishes and its write waits

        async def taken_over() -> bool:
            return ("charge", "f", 2) in log

        await until(taken_over)
        assert (await row(store_b, "f")).owner == "b"
        assert b.statistics().claimed == 1
        gates["f/2"].set()
        assert (await b.wait("f", timeout=60)).state is flow.State.COMPLETED
        history = await kinds(store_b, "f")
        store_a.gate.set()  # a thaws: its write of the charge outcome goes out now
        store_a.gate = None
        await trio.sleep(LEASE)
        stats = a.statistics()
        steps = [k for k in await kinds(store_b, "f") if k == "step"]
    if fencing:
        assert await kinds(store_b, "f") == history  # a advanced nothing
        assert steps == ["step", "step", "step"]
        assert stats.lost == 1 and stats.running == 0
        assert [e for e in log if e[0] == "ship"] == [("ship", "f", 1, None)]
    else:
        assert len(steps) > 3  # the charge outcome recorded twice: the oracle would see it


@pytest.mark.parametrize("fencing", [True, False], ids=["fenced", "unfenced"])
async def test_an_orphan_is_claimed_by_exactly_one_engine(
    path, autojump_clock, fencing: bool
) -> None:
    """A flow whose engine died (its lease lapsed) is seen by three engines' scans at the same
    moment; the takeover is a compare-and-set, so exactly one runs it. A takeover without the
    compare-and-set (planted) lets all of them run it."""
    log: Log = []
    plan = saga(log)
    stores = [PlantedStore(path) for _ in range(3)]
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(fleet_engine(s, plan, owner=f"e{i}", fencing=fencing))
            for i, s in enumerate(stores)
        ]
        dead = m.start(plan._close(), "f", "{}", wall() - 100, owner="dead")  # no engine row
        await stores[0].transact(partial(_batch.write_batch, ops=[_op.Create(dead)]))
        await trio.sleep(LEASE)
        claims = [e.statistics().claimed for e in engines]
        snap = await engines[0].get("f")
    assert snap is not None and snap.state is flow.State.COMPLETED
    if fencing:
        assert sorted(claims) == [0, 0, 1]
        assert [e[0] for e in log] == ["reserve", "charge", "ship"]
        assert log[0] == ("reserve", "f", 2)  # the dead engine may have run it: attempt + 1
    else:
        assert sum(claims) == 3 and [e[0] for e in log].count("reserve") == 3


def gone_pid() -> int:
    """The id of a process of this host that is gone (it ran, exited and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def _as_if_killed(store: PlantedStore, owner: str, until: float, pid: int) -> None:
    """The engine row of `owner` as a killed engine leaves it: its lease still runs, and it
    names the process `pid`."""

    def write(tx: Any) -> None:
        tx.execute(
            "UPDATE flow_engines SET lease_until = ?, pid = ? WHERE owner = ?", (until, pid, owner)
        )

    await store.transact(write)


async def test_a_restart_under_the_same_name_resumes_at_once_when_the_old_process_is_gone(
    path, autojump_clock
) -> None:
    log: Log = []
    gates: dict[str, trio.Event] = {}
    plan = saga(log, gates)
    store = PlantedStore(path)
    async with fleet_engine(store, plan, owner="a") as a:
        await a.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        until = await engine_lease(store, "a")
    assert until is not None
    await _as_if_killed(store, "a", until, gone_pid())
    async with fleet_engine(PlantedStore(path), plan, owner="a") as again:
        await trio.testing.wait_all_tasks_blocked()
        assert ("charge", "f", 2) in log and trio.current_time() < LEASE / 10
        assert again.statistics().recovered == 1
        gates["f/2"].set()
        await again.wait("f", timeout=60)


async def test_a_second_engine_under_a_live_name_is_refused_until_the_lease_lapses(
    path, autojump_clock
) -> None:
    log: Log = []
    gates: dict[str, trio.Event] = {}
    plan = saga(log, gates)
    store = PlantedStore(path)
    async with fleet_engine(store, plan, owner="a") as a:
        await a.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(flow.StoreLocked, match=r"owner 'a'.*one live engine per owner name"):
            async with fleet_engine(PlantedStore(path), plan, owner="a"):
                pytest.fail("a second engine opened under a live owner name")  # pragma: no cover
        assert [e for e in log if e[0] == "charge"] == [("charge", "f", 1)]  # nothing ran twice
        until = await engine_lease(store, "a")
    assert until is not None
    # As if `a` had been frozen or cut off, in a process that still exists (this one): its
    # lease runs, so a restart under the name must wait for it to lapse.
    await _as_if_killed(store, "a", until, os.getpid())
    with pytest.raises(flow.StoreLocked):
        async with fleet_engine(PlantedStore(path), plan, owner="a"):
            pass  # pragma: no cover
    await trio.sleep(until - wall() + 0.01)
    async with fleet_engine(PlantedStore(path), plan, owner="a") as again:
        await trio.testing.wait_all_tasks_blocked()
        assert ("charge", "f", 2) in log and again.statistics().recovered == 1
        gates["f/2"].set()
        assert (await again.wait("f", timeout=60)).state is flow.State.COMPLETED


async def test_closing_ends_the_leases_so_another_engine_takes_over_at_its_next_scan(
    path, autojump_clock
) -> None:
    log: Log = []
    gates: dict[str, trio.Event] = {}
    plan = saga(log, gates)
    async with fleet_engine(PlantedStore(path), plan, owner="b") as b:
        async with fleet_engine(PlantedStore(path), plan, owner="a") as a:
            await a.start(plan, flow_id="f")
            await trio.testing.wait_all_tasks_blocked()
        closed_at = trio.current_time()

        async def taken() -> bool:
            return ("charge", "f", 2) in log

        await until(taken, step=0.1)
        assert trio.current_time() - closed_at <= LEASE / 3 + 0.2  # not a whole lease
        gates["f/2"].set()
        assert (await b.wait("f", timeout=60)).state is flow.State.COMPLETED


async def test_a_scan_takes_no_more_than_the_engine_has_room_for(path, autojump_clock) -> None:
    gates: dict[str, trio.Event] = {}
    plan = saga([], gates)
    store = PlantedStore(path)
    await store.transact(_schema.create_schema)
    shape = plan._close()
    ops = [_op.Create(m.start(shape, f"f{i}", "{}", T0, owner="dead")) for i in range(5)]
    await store.transact(partial(_batch.write_batch, ops=ops))
    async with fleet_engine(PlantedStore(path), plan, owner="a", max_running=2) as a:
        await trio.testing.wait_all_tasks_blocked()
        assert a.statistics().claimed == 2 and a.statistics().running == 2
        owners = [(await row(store, f"f{i}")).owner for i in range(5)]
        assert owners.count("a") == 2 and owners.count("dead") == 3


async def test_an_engine_leaves_orphans_of_a_version_it_lacks_to_one_that_has_it(
    path, autojump_clock
) -> None:
    log: Log = []
    v1 = saga(log, park=None)
    v2 = flow.Plan("order", version=2)
    v2.step(name="reserve")(_noop)
    store = PlantedStore(path)
    await store.transact(_schema.create_schema)
    dead = m.start(v1._close(), "f", "{}", T0, owner="dead")
    await store.transact(partial(_batch.write_batch, ops=[_op.Create(dead)]))
    async with fleet_engine(PlantedStore(path), v2, owner="new") as new:
        await trio.sleep(LEASE)
        assert new.statistics().claimed == 0 and log == []
        assert (await row(store, "f")).state is flow.State.RUNNING  # not blocked: others may run it
        async with fleet_engine(PlantedStore(path), v1, owner="old") as old:
            assert (await old.wait("f", timeout=600)).state is flow.State.COMPLETED


async def _noop(ctx: flow.Context) -> None:
    pass


# ------------------------------------------------------------------ wakes, timers and cancels


async def test_a_wake_through_another_engine_leases_the_flow_to_that_engine(
    path, autojump_clock
) -> None:
    log: Log = []
    plan = saga(log, park=3600)
    store_a, store_b = PlantedStore(path), PlantedStore(path)
    async with (
        fleet_engine(store_a, plan, owner="a") as a,
        fleet_engine(store_b, plan, owner="b") as b,
    ):
        await a.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        assert (await row(store_b, "f")).state is flow.State.PARKED
        assert await b.wake("f", "paid", message_id="m1") is flow.Delivery.RESUMED
        assert await a.wake("f", "paid", message_id="m1") is flow.Delivery.DUPLICATE
        assert (await a.wait("f", timeout=60)).state is flow.State.COMPLETED  # a polls
        assert log[-1] == ("ship", "f", 1, "paid")
        assert b.statistics().steps_run == 1 and a.statistics().steps_run == 2


async def test_a_parked_flows_timeout_fires_exactly_once_across_the_fleet(
    path, autojump_clock
) -> None:
    """Every engine arms the timer (the parking engine at once, the others from their scans);
    all fire at the deadline, one takes it, and only that one runs the compensations."""
    log: Log = []
    plan = saga(log, park=100)
    stores = [PlantedStore(path) for _ in range(3)]
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(fleet_engine(s, plan, owner=f"e{i}"))
            for i, s in enumerate(stores)
        ]
        await engines[1].start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(99)
        assert all("f" in e._parts.timers.armed for e in engines)  # each one learned of the park
        snap = await engines[0].wait("f", timeout=600)
        assert snap.state is flow.State.FAILED
        assert (await kinds(stores[0], "f")).count("timed_out") == 1
        compensations = [e.statistics().compensations_run for e in engines]
    assert sorted(compensations) == [0, 0, 2]
    assert [e[0] for e in log] == ["reserve", "charge", "refund", "release"]


async def test_a_cancel_through_another_engine_leaves_the_flow_with_its_runner(
    path, autojump_clock
) -> None:
    """One step at a time across the fleet: b's cancel does not start the compensations while
    a's step runs; a learns of it at its next renewal, stops its step and compensates."""
    log: Log = []
    gates: dict[str, trio.Event] = {}
    plan = saga(log, gates)
    store_a, store_b = PlantedStore(path), PlantedStore(path)
    async with (
        fleet_engine(store_a, plan, owner="a") as a,
        fleet_engine(store_b, plan, owner="b") as b,
    ):
        await a.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        assert await b.cancel("f", "customer")
        f = await row(store_b, "f")
        assert (f.state, f.owner) == (flow.State.COMPENSATING, "a")
        await trio.testing.wait_all_tasks_blocked()
        assert [e[0] for e in log] == ["reserve", "charge"]  # nothing runs beside the step
        snap = await b.wait("f", timeout=60)
        assert trio.current_time() <= LEASE / 3 + 1  # a noticed at its next renewal
        assert snap.state is flow.State.FAILED and snap.error == "customer"
        assert [e[0] for e in log] == ["reserve", "charge", "release"]
        assert b.statistics().compensations_run == 0 and a.statistics().lost == 0


# ------------------------------------------------------------------------ the operator's engine


async def test_an_operator_engine_without_plans_leaves_the_work_to_the_fleet(
    path, autojump_clock
) -> None:
    log: Log = []
    plan = saga(log, park=3600)
    store = PlantedStore(path)
    async with fleet_engine(store, plan, owner="a") as a:
        for fid in ("w", "c"):
            await a.start(plan, flow_id=fid)
        await trio.testing.wait_all_tasks_blocked()
        async with fleet_engine(PlantedStore(path), owner="ops", serve=False) as ops:
            assert await ops.wake("w", "by hand", message_id="ops-1") is flow.Delivery.RESUMED
            assert await ops.cancel("c", "by an operator")
            for fid in ("w", "c"):
                assert (await row(store, fid)).owner is None  # nobody's: the fleet's
            assert ops.statistics().steps_run == 0
            assert (await ops.wait("w", timeout=60)).state is flow.State.COMPLETED
            assert (await ops.wait("c", timeout=60)).state is flow.State.FAILED
            with pytest.raises(flow.UnknownPlan):
                await ops.start(plan)
    assert ("ship", "w", 1, "by hand") in log
    assert a.statistics().claimed == 2  # taken by a's scan
    assert [e[0] for e in log if e[0] in ("release", "refund")] == ["refund", "release"]


async def test_an_operator_resumes_a_blocked_flow_for_the_fleet(path, autojump_clock) -> None:
    calls = {"n": 0}
    broken = flow.Plan("order")

    async def flaky_release(ctx: flow.Context) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("stock service down")

    broken.step(name="reserve", compensate=flaky_release, attempts=1)(_failing_step_0)
    broken.step(name="charge")(_fail)
    store = PlantedStore(path)
    async with fleet_engine(store, broken, owner="a") as a:
        await a.start(broken, flow_id="f")
        snap = await a.wait("f", timeout=60)
        assert snap.state is flow.State.BLOCKED and "stock service down" in str(snap.error)
        async with fleet_engine(PlantedStore(path), serve=False, owner="ops") as ops:
            assert await ops.resume("f")
            assert (await ops.wait("f", timeout=60)).state is flow.State.FAILED
    assert calls["n"] == 2


async def _failing_step_0(ctx: flow.Context) -> None:
    pass


async def _fail(ctx: flow.Context) -> flow.Outcome:
    return flow.fail("declined")


# ------------------------------------------------------------- letting go strands nothing


async def test_flows_let_go_during_an_outage_are_released_with_the_next_renewal(
    path, autojump_clock
) -> None:
    """a loses its database for longer than its lease, while b cannot reach its scans either:
    a lets its flow go (it may not run it on a lapsed lease). Once the database is back, a's
    first renewal releases the flow in the same transaction, so b's scan takes it over even
    though a is alive again (a, whose scans are off here, does not take it back)."""
    log: Log = []
    gates: dict[str, trio.Event] = {}
    plan = saga(log, gates)
    store_a, store_b = PlantedStore(path), PlantedStore(path)
    async with fleet_engine(store_a, plan, owner="a", scan_interval=10**6) as a:
        async with fleet_engine(store_b, plan, owner="b") as b:
            await a.start(plan, flow_id="f")
            await trio.testing.wait_all_tasks_blocked()
            store_a.gate, store_b.gate = trio.Event(), trio.Event()  # the database is gone
            await trio.sleep(LEASE * 2)
            assert a.statistics().lost == 1 and a.statistics().running == 0
            store_a.gate.set()  # back for a first: it renews (and releases) before b scans
            store_a.gate = None
            await trio.sleep(LEASE / 3 + 1)
            assert (await row(store_a, "f")).lease_until is not None  # released, a alive
            store_b.gate.set()
            store_b.gate = None

            async def again() -> bool:
                return ("charge", "f", 2) in log

            await until(again)
            assert b.statistics().claimed == 1 and a.statistics().claimed == 0
            gates["f/2"].set()
            assert (await b.wait("f", timeout=600)).state is flow.State.COMPLETED


async def test_a_flow_held_but_not_run_is_adopted(path, autojump_clock) -> None:
    """A takeover whose answer was lost (its connection dropped during COMMIT) leaves a flow
    held under the engine's name that the engine does not run; seen so at two checks in a row,
    the engine adopts it (attempt + 1)."""
    log: Log = []
    plan = saga(log)
    store = PlantedStore(path)
    async with fleet_engine(store, plan, owner="a") as a:
        lost = m.start(plan._close(), "f", "{}", wall(), owner="a")  # "a" holds it, unknowingly
        await store.transact(partial(_batch.write_batch, ops=[_op.Create(lost)]))
        await trio.sleep(LEASE / 3 + 1)
        assert log == []  # one check: could be a write of its own not yet followed
        snap = await a.wait("f", timeout=600)
        assert snap.state is flow.State.COMPLETED and log[0] == ("reserve", "f", 2)
        assert a.statistics().claimed == 1
