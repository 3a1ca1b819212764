"""The engine under `MockClock(autojump_threshold=0)` on real SQLite.

Most tests open engines as users do, ``flow.open_engine(path)``: under a mock clock the SQLite
store runs its transactions on the trio thread, so time moves only when every task waits for time
(docs/adr/0066). A `PlantedStore` (see _helpers) plants a store outage or a slow store; the
tests at the end run on the threaded `SqliteStore` and on PostgreSQL.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import ferry
from ferry import flow
from ferry.flow._store import _batch, _op, _store
from ferry.projected import PostgresStore, SqliteStore, Store
from tests import pg, switches

from ._helpers import PlantedStore

Log = list[tuple[Any, ...]]


PARKED_THEN_WOKEN = ["started", "step", "step", "parked", "woken", "step", "completed"]


@pytest.fixture
def store(tmp_path: Path) -> str:
    """The path of the engine's SQLite file (each engine opens it, and closes it at the end)."""
    return str(tmp_path / "flows.db")


@pytest.fixture
def planted(tmp_path: Path) -> PlantedStore:
    return PlantedStore(str(tmp_path / "flows.db"))


@asynccontextmanager
async def engine_on(store: Any, *plans: flow.Plan, **options: Any) -> AsyncIterator[flow.Engine]:
    async with switches.open_engine(store, plans=list(plans), **options) as engine:
        yield engine


def order_plan(
    log: Log,
    *,
    name: str = "order",
    version: int = 1,
    park_timeout: float | None = None,
    on_timeout: str = "compensate",
) -> flow.Plan:
    """reserve (compensated) -> charge (compensated, parks) -> ship."""
    plan = flow.Plan(name, version=version)

    async def release(ctx: flow.Context) -> None:
        log.append(("release", ctx.attempt, ctx.error, ctx.idempotency_key))

    async def refund(ctx: flow.Context) -> None:
        log.append(("refund", ctx.attempt, ctx.error))

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        log.append(("reserve", ctx.attempt))
        ctx.data["reserved"] = True

    @plan.step(compensate=refund)
    async def charge(ctx: flow.Context) -> flow.Outcome:
        log.append(("charge", ctx.attempt))
        return flow.park(timeout=park_timeout, on_timeout=on_timeout)  # type: ignore[arg-type]

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        log.append(("ship", ctx.wake, ctx.timed_out))
        ctx.data["shipped"] = True

    return plan


def simple_plan(
    *steps: Callable[[flow.Context], Any],
    name: str = "p",
    version: int = 1,
    compensations: dict[int, Any] | None = None,
    attempts: int = 3,
) -> flow.Plan:
    plan = flow.Plan(name, version=version)
    for i, fn in enumerate(steps):
        plan.step(name=f"s{i}", compensate=(compensations or {}).get(i), attempts=attempts)(fn)
    return plan


async def kinds(engine: flow.Engine, fid: str) -> list[str]:
    return [e.kind for e in await engine.history(fid)]


def runner_tasks(engine: flow.Engine) -> int:
    """Tasks the engine runs besides its timer loop, its retention task and its requests task."""
    nursery = engine._parts.nursery
    assert nursery is not None
    loops = ("Timers.run", "Retention.run", "_served.serve")
    return sum(1 for task in nursery.child_tasks if not task.name.endswith(loops))


async def settle(engine: flow.Engine, flow_id: str) -> flow.Snapshot:
    """`wait` with a day's timeout: a test whose flow never settles fails at once (MockClock)."""
    return await engine.wait(flow_id, timeout=86400)


async def count_rows(store: Any) -> dict[flow.State, int]:
    """How many flows the store holds in each state (`store`: a path, or an open store)."""
    if isinstance(store, str):
        async with SqliteStore(store) as reader:
            return await count_rows(reader)
    counts: dict[flow.State, int] = await store.transact(_store.count_states)
    return counts


# ------------------------------------------------------------------------------ steps and data


class _Schedules(trio.abc.Instrument):
    """Counts the times trio schedules one task (each wake-up and each checkpoint of it)."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


async def test_a_waiter_wakes_when_its_flow_settles_not_at_every_step(
    store, autojump_clock
) -> None:
    """`wait` on a flow of 30 steps is woken by the write that settles it, not by each of the
    30 writes before (each wake-up is a task switch and a rerun of its transaction): the waiting
    task is scheduled a few times (its checkpoints, the one wake-up), not once per step.

    The waiting task's own schedules are counted, not the process's stm wake-ups: the ferry's
    worker (the engine's group commit) wakes 10 to 22 times for one such flow, with the order in
    which trio runs the tasks that are ready, so a waited flow's count minus an unwaited one's
    swung from -7 to +10. With a watch that shows every row to its waits (`_put` setting the
    TVar at each write) this counts 30 schedules instead of 1."""

    async def step(ctx: flow.Context) -> None:
        ctx.data[ctx.step] = True

    plan = simple_plan(*[step] * 30)
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        schedules = _Schedules(trio.lowlevel.current_task())
        trio.lowlevel.add_instrument(schedules)
        try:
            snap = await engine.wait(fid)
        finally:
            trio.lowlevel.remove_instrument(schedules)
        assert snap.state is flow.State.COMPLETED and snap.revision == 31
        assert schedules.count < 5, schedules.count


async def test_steps_run_in_order_and_the_flow_completes(store, autojump_clock) -> None:
    seen: list[flow.Context] = []
    plan = flow.Plan("three")

    @plan.step
    async def first(ctx: flow.Context) -> None:
        seen.append(ctx)
        ctx.data["n"] += 1

    @plan.step(name="second")
    async def second_fn(ctx: flow.Context) -> flow.Outcome:
        seen.append(ctx)
        ctx.data["n"] *= 10
        return flow.CONTINUE

    @plan.step
    async def third(ctx: flow.Context) -> None:
        seen.append(ctx)
        ctx.data["done"] = True

    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan, data={"n": 1})
        assert len(fid) == 32  # a uuid4 hex
        snap = await settle(engine, fid)
        assert snap.state is flow.State.COMPLETED and snap.step is None
        assert snap.data == {"n": 20, "done": True} and snap.revision == 4 and snap.error is None
        assert await engine.get(fid) == snap
        assert [c.step for c in seen] == ["first", "second", "third"]
        assert [c.step_index for c in seen] == [0, 1, 2]
        c = seen[1]
        assert (c.flow_id, c.plan, c.version, c.attempt, c.wake, c.timed_out, c.error) == (
            fid,
            "three",
            1,
            1,
            None,
            False,
            None,
        )
        assert c.idempotency_key == f"{fid}/1/second"
        assert await kinds(engine, fid) == ["started", "step", "step", "step", "completed"]
        stats = engine.statistics()
        assert stats.completed == 1 and stats.steps_run == 3 and stats.running == 0


async def test_complete_skips_the_remaining_steps(store, autojump_clock) -> None:
    ran = []

    async def a(ctx: flow.Context) -> flow.Outcome:
        ran.append("a")
        return flow.COMPLETE

    async def b(ctx: flow.Context) -> None:
        ran.append("b")

    plan = simple_plan(a, b)
    async with engine_on(store, plan) as engine:
        snap = await settle(engine, await engine.start(plan))
    assert snap.state is flow.State.COMPLETED and ran == ["a"]


async def test_a_step_gets_a_copy_of_data_and_changes_are_discarded_if_it_raises(
    store, autojump_clock
) -> None:
    runs: list[dict[str, Any]] = []

    async def flaky(ctx: flow.Context) -> None:
        runs.append(dict(ctx.data))
        ctx.data["junk"] = len(runs)
        if len(runs) < 3:
            raise RuntimeError("try again")

    plan = simple_plan(flaky)
    async with engine_on(store, plan) as engine:
        snap = await settle(engine, await engine.start(plan, data={"k": 1}))
    assert runs == [{"k": 1}, {"k": 1}, {"k": 1}]  # the failed attempts' changes are gone
    assert snap.data == {"k": 1, "junk": 3}


# --------------------------------------------------------------------------------- park / wake


async def test_park_then_wake_resumes_with_the_payload(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log)
    async with engine_on(store, plan) as engine:
        await engine.start(plan, flow_id="o1", data={"sku": "A"})
        await trio.testing.wait_all_tasks_blocked()
        snap = await engine.get("o1")
        assert snap is not None and snap.state is flow.State.PARKED and snap.step == "charge"
        assert snap.park_deadline is None and snap.revision == 3
        # a parked flow holds no task and no coroutine
        assert runner_tasks(engine) == 0 and engine.statistics().running == 0
        assert engine.statistics().parked == 1
        assert (
            await engine.wake("o1", {"payment": "ok"}, message_id="evt-1") is flow.Delivery.RESUMED
        )
        done = await settle(engine, "o1")
        assert done.state is flow.State.COMPLETED and done.data["shipped"]
        assert await kinds(engine, "o1") == PARKED_THEN_WOKEN
        stats = engine.statistics()
        assert stats.parked == 0 and stats.wakes[flow.Delivery.RESUMED] == 1
    assert log == [("reserve", 1), ("charge", 1), ("ship", {"payment": "ok"}, False)]


async def test_a_wake_before_the_park_is_queued_and_taken_by_the_park(
    store, autojump_clock
) -> None:
    gate = trio.Event()
    woke: list[Any] = []

    async def work(ctx: flow.Context) -> flow.Outcome:
        await gate.wait()
        return flow.park(timeout=60)

    async def after(ctx: flow.Context) -> None:
        woke.append(ctx.wake)

    plan = simple_plan(work, after)
    async with engine_on(store, plan) as engine:
        await engine.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        assert await engine.wake("f", "paid", message_id="early") is flow.Delivery.QUEUED
        snap = await engine.get("f")
        assert snap is not None and snap.state is flow.State.RUNNING and snap.revision == 1
        gate.set()
        done = await settle(engine, "f")
        assert done.state is flow.State.COMPLETED and woke == ["paid"]
        events = await engine.history("f")
        assert [(e.revision, e.kind) for e in events] == [
            (1, "started"),
            (2, "step"),
            (2, "parked"),
            (2, "woken"),
            (3, "step"),
            (3, "completed"),
        ]
        assert engine.statistics().wakes[flow.Delivery.QUEUED] == 1


async def test_duplicate_stale_and_unknown_wakes(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log)
    async with engine_on(store, plan) as engine:
        await engine.start(plan, flow_id="o1")
        await trio.testing.wait_all_tasks_blocked()
        assert await engine.wake("o1", 1, message_id="m1") is flow.Delivery.RESUMED
        await settle(engine, "o1")
        assert await engine.wake("o1", 1, message_id="m1") is flow.Delivery.DUPLICATE
        assert await engine.wake("o1", 2, message_id="m2") is flow.Delivery.STALE
        assert await engine.wake("o1") is flow.Delivery.STALE
        assert await engine.wake("nobody", message_id="m1") is flow.Delivery.UNKNOWN
        wakes = engine.statistics().wakes
        assert [wakes[d] for d in flow.Delivery] == [1, 0, 1, 2, 1]
    assert log.count(("ship", 1, False)) == 1


async def test_duplicate_of_a_queued_wake(store, autojump_clock) -> None:
    gate = trio.Event()

    async def work(ctx: flow.Context) -> None:
        await gate.wait()

    plan = simple_plan(work)
    async with engine_on(store, plan) as engine:
        await engine.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        assert await engine.wake("f", message_id="x") is flow.Delivery.QUEUED
        assert await engine.wake("f", message_id="x") is flow.Delivery.DUPLICATE
        gate.set()
        await settle(engine, "f")


# --------------------------------------------------------------------------------- timeouts


async def test_a_park_timeout_compensates_in_reverse_order(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log, park_timeout=3600)
    async with engine_on(store, plan) as engine:
        t0 = trio.current_time()
        fid = await engine.start(plan)
        snap = await settle(engine, fid)
        assert trio.current_time() - t0 == pytest.approx(3600)
        assert (
            snap.state is flow.State.FAILED and snap.error == "step 'charge' timed out while parked"
        )
        assert await kinds(engine, fid) == [
            "started",
            "step",
            "step",
            "parked",
            "timed_out",
            "compensated",
            "compensated",
            "failed",
        ]
    error = "step 'charge' timed out while parked"
    assert log == [
        ("reserve", 1),
        ("charge", 1),
        ("refund", 1, error),  # the step that parked had completed: compensated first
        ("release", 1, error, f"{fid}/0-compensate/reserve"),
    ]


async def test_a_park_timeout_can_continue(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log, park_timeout=10, on_timeout="continue")
    async with engine_on(store, plan) as engine:
        snap = await settle(engine, await engine.start(plan))
    assert snap.state is flow.State.COMPLETED and log[-1] == ("ship", None, True)


async def test_a_wake_before_the_deadline_disarms_the_timeout(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log, park_timeout=100)
    async with engine_on(store, plan) as engine:
        await engine.start(plan, flow_id="o")
        await trio.sleep(50)
        assert await engine.wake("o", "ok") is flow.Delivery.RESUMED
        assert (await settle(engine, "o")).state is flow.State.COMPLETED
        await trio.sleep(100)  # the deadline passes; the stale timer does nothing
        assert await kinds(engine, "o") == PARKED_THEN_WOKEN
        assert engine.statistics().conflicts == 0


async def test_wait_timeout(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log)
    async with engine_on(store, plan) as engine:
        await engine.start(plan, flow_id="o")
        t0 = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await engine.wait("o", timeout=5)
        assert trio.current_time() - t0 == pytest.approx(5)
        assert engine._waiters._watches == {}  # nothing left registered
        with pytest.raises(flow.UnknownFlow):
            await engine.wait("nope", timeout=5)


async def test_timers_survive_a_reopen(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log, park_timeout=3600)
    async with engine_on(store, plan) as engine:
        await engine.start(plan, flow_id="o")
        await trio.sleep(1000)
    async with engine_on(store, order_plan(log, park_timeout=3600)) as engine:
        assert engine.statistics().parked == 1
        t0 = trio.current_time()
        snap = await settle(engine, "o")
        # measured on the wall clock the engine derives from trio's: the park started in the
        # first engine, so the second waits for what is left of the hour (plus the real time
        # between the two opens, a few milliseconds)
        assert trio.current_time() - t0 == pytest.approx(3600, abs=5)
        assert snap.state is flow.State.FAILED


async def test_an_overdue_park_times_out_at_open(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log, park_timeout=60)
    async with engine_on(store, plan) as engine:
        await engine.start(plan, flow_id="o")
        await trio.testing.wait_all_tasks_blocked()
    import time

    later = partial(lambda: time.time() + 7200)
    async with engine_on(store, order_plan(log, park_timeout=60), wall_clock=later) as engine:
        t0 = trio.current_time()
        snap = await settle(engine, "o")
        assert trio.current_time() == t0 and snap.state is flow.State.FAILED


# -------------------------------------------------------------------------------- retries


async def test_retries_back_off_from_a_tenth_of_a_second(store, autojump_clock) -> None:
    times: list[float] = []
    attempts: list[int] = []

    async def flaky(ctx: flow.Context) -> None:
        times.append(trio.current_time())
        attempts.append(ctx.attempt)
        if len(times) < 4:
            raise ValueError("not yet")

    plan = simple_plan(flaky, attempts=4)
    async with engine_on(store, plan) as engine:
        snap = await settle(engine, await engine.start(plan))
        stats = engine.statistics()
    assert snap.state is flow.State.COMPLETED
    assert attempts == [1, 2, 3, 4]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == pytest.approx([0.1, 0.2, 0.4])
    assert stats.step_retries == 3 and stats.steps_run == 4
    assert snap.revision == 5  # each retry's attempt number was written before it ran


async def test_a_step_that_keeps_raising_compensates(store, autojump_clock) -> None:
    undone: list[str] = []

    async def ok(ctx: flow.Context) -> None:
        pass

    async def undo(ctx: flow.Context) -> None:
        undone.append(ctx.error or "")

    async def broken(ctx: flow.Context) -> None:
        raise KeyError("sku")

    plan = simple_plan(ok, broken, compensations={0: undo, 1: undo}, attempts=2)
    async with engine_on(store, plan) as engine:
        snap = await settle(engine, await engine.start(plan))
    assert snap.state is flow.State.FAILED
    assert snap.error == "step 's1' raised KeyError('sku') on attempt 2 (2 of 2 tries)"
    assert undone == [snap.error]  # only the completed step is compensated


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda ctx: 42, "step 's0' returned 42, which is not an outcome"),
        (lambda ctx: "done", "step 's0' returned 'done', which is not an outcome"),
        (lambda ctx: ctx.data.update(x={1}), "step 's0' left data that is not JSON"),
        (lambda ctx: ctx.data.update(x=(1, 2)), "step 's0' left data that is not JSON"),
    ],
)
async def test_a_defective_step_fails_without_retries(store, autojump_clock, bad, message) -> None:
    calls = []

    async def step(ctx: flow.Context) -> Any:
        calls.append(1)
        return bad(ctx)

    plan = simple_plan(step, attempts=3)
    async with engine_on(store, plan) as engine:
        snap = await settle(engine, await engine.start(plan))
    assert snap.state is flow.State.FAILED and snap.error is not None
    assert snap.error.startswith(message) and calls == [1]
    assert snap.data == {}


# --------------------------------------------------------------------- cancel, block, resume


async def test_cancel_a_running_flow(store, autojump_clock) -> None:
    log: list[str] = []
    cancelled = []

    async def first(ctx: flow.Context) -> None:
        log.append("first")

    async def undo_first(ctx: flow.Context) -> None:
        log.append(f"undo first: {ctx.error}")

    async def forever(ctx: flow.Context) -> None:
        ctx.data["half"] = True
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(True)
            raise

    async def undo_forever(ctx: flow.Context) -> None:
        log.append("undo forever")  # must not run: that step never completed

    plan = simple_plan(first, forever, compensations={0: undo_first, 1: undo_forever})
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        await trio.testing.wait_all_tasks_blocked()
        assert await engine.cancel(fid, "customer changed their mind")
        snap = await settle(engine, fid)
        assert snap.state is flow.State.FAILED and snap.error == "customer changed their mind"
        assert "half" not in snap.data
        assert not await engine.cancel(fid)  # terminal
        assert not await engine.cancel("nope")
        assert await kinds(engine, fid) == ["started", "step", "cancelled", "compensated", "failed"]
    assert cancelled == [True]
    assert log == ["first", "undo first: customer changed their mind"]


async def test_a_step_that_cancels_its_own_flow_is_void_and_the_compensations_run(
    store, autojump_clock
) -> None:
    """A cancel that lands after a step's last checkpoint (here the step cancels its own flow
    and returns without another): the step is void all the same, and the compensations run to
    the end, checkpoints and all (the runner goes on in a fresh cancel scope: a cancelled one
    would void every body after it)."""
    log: list[str] = []
    engine_box: list[flow.Engine] = []

    async def first(ctx: flow.Context) -> None:
        log.append("first")

    async def undo_first(ctx: flow.Context) -> None:
        await trio.sleep(1)
        await trio.lowlevel.checkpoint()
        log.append(f"undo first: {ctx.error}")

    async def second(ctx: flow.Context) -> None:
        ctx.data["second"] = True
        assert await engine_box[0].cancel(ctx.flow_id, "cancelled by its own step")
        log.append("second returned")

    plan = simple_plan(first, second, compensations={0: undo_first})
    async with engine_on(store, plan) as engine:
        engine_box.append(engine)
        fid = await engine.start(plan)
        snap = await settle(engine, fid)
        assert snap.state is flow.State.FAILED and snap.error == "cancelled by its own step"
        assert "second" not in snap.data
        assert await kinds(engine, fid) == ["started", "step", "cancelled", "compensated", "failed"]
        again = await engine.start(plan)  # the engine runs on, in fresh scopes
        assert (await settle(engine, again)).state is flow.State.FAILED
    assert log == [
        "first",
        "second returned",
        "undo first: cancelled by its own step",
        "first",
        "second returned",
        "undo first: cancelled by its own step",
    ]


async def test_a_cancel_of_a_step_with_its_own_tasks_is_void_and_the_flow_compensates(
    store, autojump_clock
) -> None:
    """A step whose body runs tasks of its own: a cancel reaches it as a group of
    `trio.Cancelled` out of its nursery, which voids the step like a bare one."""
    log: list[str] = []
    cancelled = trio.Event()

    async def first(ctx: flow.Context) -> None:
        log.append("first")

    async def undo_first(ctx: flow.Context) -> None:
        await trio.sleep(1)
        log.append(f"undo first: {ctx.error}")

    async def fan_out(ctx: flow.Context) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                nursery.start_soon(trio.sleep_forever)
                await trio.sleep_forever()
        except BaseExceptionGroup:
            cancelled.set()
            raise

    plan = simple_plan(first, fan_out, compensations={0: undo_first})
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        await trio.testing.wait_all_tasks_blocked()
        assert await engine.cancel(fid, "stop the fan-out")
        snap = await settle(engine, fid)
        assert cancelled.is_set()
        assert snap.state is flow.State.FAILED and snap.error == "stop the fan-out"
        assert await kinds(engine, fid) == ["started", "step", "cancelled", "compensated", "failed"]
    assert log == ["first", "undo first: stop the fan-out"]


async def test_cancel_a_parked_flow_compensates_the_parked_step(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log, park_timeout=3600)
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        await trio.testing.wait_all_tasks_blocked()
        assert await engine.cancel(fid)
        snap = await settle(engine, fid)
        assert snap.state is flow.State.FAILED
        assert engine.statistics().parked == 0
        await trio.sleep(7200)  # the armed timer finds nothing to do
        assert (await engine.get(fid)) == snap
    assert [entry[0] for entry in log] == ["reserve", "charge", "refund", "release"]


async def test_a_compensation_that_keeps_failing_blocks_and_resume_finishes_it(
    store, autojump_clock
) -> None:
    broken = True
    order: list[str] = []

    async def step(ctx: flow.Context) -> None:
        pass

    async def undo_a(ctx: flow.Context) -> None:
        order.append(f"a{ctx.attempt}")

    async def undo_b(ctx: flow.Context) -> None:
        order.append(f"b{ctx.attempt}")
        if broken:
            raise ConnectionError("refund service down")

    async def boom(ctx: flow.Context) -> flow.Outcome:
        return flow.fail("out of stock")

    plan = simple_plan(step, step, boom, compensations={0: undo_a, 1: undo_b}, attempts=2)
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        snap = await settle(engine, fid)
        assert snap.state is flow.State.BLOCKED and snap.step == "s1"
        assert snap.error == (
            "compensation of step 's1' failed: ConnectionError('refund service down')"
            " on attempt 2 (2 of 2 tries)"
        )
        assert engine.statistics().blocked == 1
        assert not await engine.cancel(fid)  # blocked: cancel does nothing
        assert await engine.wake(fid, message_id="late") is flow.Delivery.QUEUED
        broken = False
        assert await engine.resume(fid)
        snap = await settle(engine, fid)
        assert snap.state is flow.State.FAILED and snap.error == "out of stock"
        stats = engine.statistics()
        assert (stats.compensations_run, stats.blocked, stats.failed) == (4, 1, 1)
        assert (stats.steps_run, stats.step_retries, stats.running, stats.parked) == (3, 0, 0, 0)
        assert not await engine.resume(fid)
        assert not await engine.resume("nope")
    assert order == ["b1", "b2", "b3", "a1"]  # reverse order; the resumed run is attempt 3


async def test_versions_fail_closed_and_resume_after_the_version_is_back(
    store, autojump_clock
) -> None:
    log: Log = []
    async with engine_on(store, order_plan(log)) as engine:
        await engine.start(engine._plans[("order", 1)], flow_id="o")
        await trio.testing.wait_all_tasks_blocked()
    # deployed: only version 2 is registered; the parked v1 flow blocks when woken
    async with engine_on(store, order_plan(log, version=2)) as engine:
        assert await engine.wake("o", "paid", message_id="m") is flow.Delivery.QUEUED
        snap = await settle(engine, "o")
        assert snap.state is flow.State.BLOCKED
        assert snap.error == "plan 'order' version 1 is not registered with this engine"
        assert not await engine.resume("o")  # still missing: nothing changes
    # version 1 back (drain-and-switch): resume takes the queued wake
    async with engine_on(store, order_plan(log), order_plan(log, version=2)) as engine:
        assert await engine.resume("o")
        snap = await settle(engine, "o")
        assert snap.state is flow.State.COMPLETED
    assert log[-1] == ("ship", "paid", False)


async def test_a_cancel_through_an_engine_without_the_plan_compensates_once_it_is_back(
    store, autojump_clock
) -> None:
    log: Log = []
    async with engine_on(store, order_plan(log)) as engine:
        await engine.start(engine._plans[("order", 1)], flow_id="o")
        await trio.testing.wait_all_tasks_blocked()
    async with engine_on(store, order_plan(log, version=2)) as engine:
        assert await engine.cancel("o", "customer")
        snap = await settle(engine, "o")  # it cannot run the compensation: fails closed
        assert snap.state is flow.State.BLOCKED and snap.step is None and snap.step_index == 1
        assert "version 1 is not registered" in str(snap.error)
    async with engine_on(store, order_plan(log)) as engine:
        assert await engine.resume("o")
        snap = await settle(engine, "o")
        assert snap.state is flow.State.FAILED and snap.error == "customer"
        assert (await kinds(engine, "o"))[-6:] == [
            "cancelled",
            "blocked",
            "resumed",
            "compensated",
            "compensated",
            "failed",
        ]
    assert [entry[0] for entry in log] == ["reserve", "charge", "refund", "release"]
    assert log[-2] == ("refund", 2, "customer")  # attempt 2: the blocked drive counted as one


async def test_a_running_flow_whose_step_was_renamed_blocks_at_open(store, autojump_clock) -> None:
    async def hang(ctx: flow.Context) -> None:
        await trio.sleep_forever()

    async with engine_on(store, simple_plan(hang)) as engine:
        fid = await engine.start(engine._plans[("p", 1)])
        await trio.testing.wait_all_tasks_blocked()
    renamed = flow.Plan("p")
    renamed.step(name="other")(hang)
    async with engine_on(store, renamed) as engine:
        snap = await settle(engine, fid)
        assert snap.state is flow.State.BLOCKED
        assert snap.error == (
            "plan 'p' version 1 has step 'other' at index 0, but the flow is at step 's0'"
        )
        assert engine.statistics().recovered == 0 and engine.statistics().blocked == 1


# ------------------------------------------------------------------------- close and recovery


async def test_close_cancels_running_steps_and_they_rerun_as_the_next_attempt(
    store, autojump_clock
) -> None:
    attempts: list[int] = []
    release = trio.Event()

    async def slow(ctx: flow.Context) -> None:
        attempts.append(ctx.attempt)
        ctx.data["tries"] = ctx.attempt
        if ctx.attempt == 1:
            await trio.sleep_forever()
        await release.wait()

    async with engine_on(store, simple_plan(slow)) as engine:
        fid = await engine.start(engine._plans[("p", 1)])
        await trio.testing.wait_all_tasks_blocked()
    snap_rows = await count_rows(store)
    assert snap_rows == {flow.State.RUNNING: 1}
    async with engine_on(store, simple_plan(slow)) as engine:
        assert engine.statistics().recovered == 1
        release.set()
        snap = await settle(engine, fid)
    assert attempts == [1, 2] and snap.data == {"tries": 2}


async def test_close_during_a_compensation_reruns_it_at_the_next_open(
    store, autojump_clock
) -> None:
    attempts: list[int] = []

    async def step(ctx: flow.Context) -> None:
        pass

    async def undo(ctx: flow.Context) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            await trio.sleep_forever()

    async def boom(ctx: flow.Context) -> flow.Outcome:
        return flow.fail("no")

    async with engine_on(store, simple_plan(step, boom, compensations={0: undo})) as engine:
        fid = await engine.start(engine._plans[("p", 1)])
        await trio.testing.wait_all_tasks_blocked()
        assert (await engine.get(fid)).state is flow.State.COMPENSATING  # type: ignore[union-attr]
    async with engine_on(store, simple_plan(step, boom, compensations={0: undo})) as engine:
        snap = await settle(engine, fid)
        assert engine.statistics().recovered == 1
    assert snap.state is flow.State.FAILED and attempts == [1, 2]


async def test_calls_after_close_raise_closed(store, autojump_clock) -> None:
    plan = simple_plan(_noop)
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        await settle(engine, fid)
    calls: list[Callable[[], Any]] = [
        partial(engine.start, plan),
        partial(engine.wake, fid),
        partial(engine.publish, "e", {}),
        partial(engine.wait, fid),
        partial(engine.get, fid),
        partial(engine.cancel, fid),
        partial(engine.resume, fid),
        partial(engine.history, fid),
    ]
    for call in calls:
        with pytest.raises(ferry.Closed):
            await call()
    with pytest.raises(ferry.Closed):
        engine.on("e", lambda e: None)
    engine.statistics()  # still readable


async def _noop(ctx: flow.Context) -> None:
    pass


async def test_a_waiter_gets_closed_when_the_engine_closes(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log)
    outcome: list[BaseException] = []

    async def waiter(engine: flow.Engine) -> None:
        try:
            await settle(engine, "o")
        except ferry.Closed as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        async with engine_on(store, plan) as engine:
            await engine.start(plan, flow_id="o")
            nursery.start_soon(waiter, engine)
            await trio.testing.wait_all_tasks_blocked()
    assert len(outcome) == 1


# ----------------------------------------------------------------------------- choreography


async def test_choreography_wakes_and_starts(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log)
    async with engine_on(store, plan) as engine:
        engine.on(
            "payment.confirmed",
            lambda e: flow.Wake(e["order"], {"paid": e["amount"]}, message_id=e["id"]),
        )
        engine.on("order.placed", lambda e: flow.Start(plan, e["order"], {"sku": e["sku"]}))
        engine.on("order.placed", lambda e: flow.IGNORE)
        engine.on("order.placed", lambda e: None)
        assert await engine.publish("order.placed", {"order": "o9", "sku": "B"}) == [
            "o9",
            None,
            None,
        ]
        assert await engine.publish("order.placed", {"order": "o9", "sku": "B"}) == [
            "o9",
            None,
            None,
        ]
        await trio.testing.wait_all_tasks_blocked()
        event = {"order": "o9", "amount": 30, "id": "evt-1"}
        assert await engine.publish("payment.confirmed", event) == [flow.Delivery.RESUMED]
        assert await engine.publish("payment.confirmed", event) == [flow.Delivery.DUPLICATE]
        assert await engine.publish("nobody.listens", {}) == []
        snap = await settle(engine, "o9")
        assert snap.state is flow.State.COMPLETED and snap.data["sku"] == "B"
    assert log.count(("reserve", 1)) == 1 and log[-1] == ("ship", {"paid": 30}, False)


async def test_publish_checks_every_decision_before_applying_any(store, autojump_clock) -> None:
    log: Log = []
    plan = order_plan(log)
    other = order_plan(log, name="unregistered")
    async with engine_on(store, plan) as engine:
        engine.on("e", lambda e: flow.Start(plan, "new-1"))
        engine.on("e", lambda e: 42)
        with pytest.raises(TypeError, match="returned 42: a mapper must return"):
            await engine.publish("e", {})
        engine._mappers.clear()
        engine.on("e", lambda e: flow.Start(plan, "new-2"))
        engine.on("e", lambda e: flow.Start(other, "new-3"))
        with pytest.raises(flow.UnknownPlan):
            await engine.publish("e", {})
        engine._mappers.clear()
        engine.on("e", lambda e: flow.Start(plan, "new-4"))
        engine.on("e", lambda e: flow.Wake("new-4", {1, 2}))
        with pytest.raises(TypeError, match=r"Wake\.payload must be JSON"):
            await engine.publish("e", {})
        assert await count_rows(store) == {}  # nothing was applied

        async def async_mapper(e: Any) -> None:
            return None

        with pytest.raises(TypeError, match="plain function"):
            engine.on("e", async_mapper)
        with pytest.raises(TypeError):
            engine.on("e", "not callable")  # type: ignore[arg-type]


async def test_a_call_that_raises_cancelled_did_not_happen(planted, autojump_clock) -> None:
    store = planted
    plan = simple_plan(_noop)
    async with engine_on(store, plan) as engine:
        calls: list[Callable[[], Any]] = [
            partial(engine.start, plan, flow_id="c"),
            partial(engine.wake, "c", message_id="m"),
            partial(engine.cancel, "c"),
            partial(engine.resume, "c"),
            partial(engine.publish, "e", {}),
        ]
        engine.on("e", lambda e: flow.Start(plan, "d"))
        for call in calls:
            with trio.CancelScope() as scope:
                scope.cancel()
                await call()
            assert scope.cancelled_caught
        assert await count_rows(store) == {}
        # a call cancelled once its write is under way waits for it and returns its result
        store.gate = trio.Event()
        got: list[str] = []

        async def starter(scope: trio.CancelScope, task_status: Any) -> None:
            with scope:
                task_status.started()
                got.append(await engine.start(plan, flow_id="c"))

        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            await nursery.start(starter, scope)
            await trio.testing.wait_all_tasks_blocked()  # its write waits in the store
            scope.cancel()
            store.gate.set()
        assert got == ["c"]
        assert (await settle(engine, "c")).state is flow.State.COMPLETED


async def test_a_cancelled_call_whose_write_waited_for_a_batch_did_not_happen(
    planted, autojump_clock
) -> None:
    """API calls write without a cancel scope of their own: a call cancelled while its write
    waits behind a batch in flight raises `Cancelled` and nothing of it is written; one
    cancelled while its write is in the batch waits for it and returns its answer, an error
    included (here `IdReused`), and one that wrote a wake returns the delivery."""
    store = planted
    plan = simple_plan(_noop)
    async with engine_on(store, plan) as engine:
        await settle(engine, await engine.start(plan, flow_id="x", data={"a": 1}))
        store.gate = trio.Event()
        outcomes: dict[str, object] = {}

        async def call(name: str, fn: Callable[[], Any], scope: trio.CancelScope) -> None:
            with scope:
                try:
                    outcomes[name] = await fn()
                except flow.IdReused as exc:
                    outcomes[name] = exc
            if scope.cancelled_caught:
                outcomes[name] = "cancelled"

        async with trio.open_nursery() as nursery:
            first, reused = trio.CancelScope(), trio.CancelScope()
            nursery.start_soon(call, "first", partial(engine.start, plan, flow_id="a"), first)
            nursery.start_soon(
                call, "reused", partial(engine.start, plan, flow_id="x", data={"a": 2}), reused
            )
            await trio.testing.wait_all_tasks_blocked()  # their batch waits in the store
            queued = trio.CancelScope()
            nursery.start_soon(call, "queued", partial(engine.start, plan, flow_id="q"), queued)
            await trio.testing.wait_all_tasks_blocked()  # behind the batch in flight
            for scope in (first, reused, queued):
                scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == {"queued": "cancelled"}
            store.gate.set()
        assert outcomes["first"] == "a"
        assert isinstance(outcomes["reused"], flow.IdReused)
        assert await engine.get("q") is None
        assert (await settle(engine, "a")).state is flow.State.COMPLETED
        assert engine._parts.writes._requested == {}  # nothing left behind


# ------------------------------------------------------------------------ idempotent start


async def test_start_is_idempotent(store, autojump_clock) -> None:
    runs = []

    async def step(ctx: flow.Context) -> None:
        runs.append(ctx.flow_id)

    plan = simple_plan(step)
    other = simple_plan(step, name="q")
    async with engine_on(store, plan, other) as engine:
        assert await engine.start(plan, flow_id="x", data={"a": 1}) == "x"
        await settle(engine, "x")
        assert await engine.start(plan, flow_id="x", data={"a": 1}) == "x"
        with pytest.raises(flow.IdReused, match="'x' is already used"):
            await engine.start(plan, flow_id="x", data={"a": 2})
        with pytest.raises(flow.IdReused):
            await engine.start(other, flow_id="x", data={"a": 1})
        await trio.testing.wait_all_tasks_blocked()
        assert await kinds(engine, "x") == ["started", "step", "completed"]
    assert runs == ["x"]


# ------------------------------------------------------------------------------- bad input


async def test_bad_input_is_refused_and_nothing_is_stored(store, autojump_clock) -> None:
    plan = simple_plan(_noop)
    stranger = simple_plan(_noop, name="stranger")
    async with engine_on(store, plan) as engine:
        cases: list[tuple[type[BaseException], Callable[[], Any]]] = [
            (TypeError, partial(engine.start, plan, data=[1])),  # type: ignore[arg-type]
            (TypeError, partial(engine.start, plan, data={"s": {1}})),
            (TypeError, partial(engine.start, plan, data={"f": float("nan")})),
            (TypeError, partial(engine.start, plan, data={1: "int key"})),  # type: ignore[dict-item]
            (TypeError, partial(engine.start, plan, flow_id=7)),  # type: ignore[arg-type]
            (ValueError, partial(engine.start, plan, flow_id="")),
            (flow.UnknownPlan, partial(engine.start, stranger)),
            (TypeError, partial(engine.start, "p")),  # type: ignore[arg-type]
            (TypeError, partial(engine.wake, "x", {1, 2})),
            (TypeError, partial(engine.wake, "x", message_id=5)),  # type: ignore[arg-type]
            (TypeError, partial(engine.wake, 5)),  # type: ignore[arg-type]
            (TypeError, partial(engine.cancel, "x", reason=3)),  # type: ignore[arg-type]
            (ValueError, partial(engine.wait, "x", timeout=-1)),
            (flow.UnknownFlow, partial(engine.wait, "x")),
            (flow.UnknownFlow, partial(engine.history, "x")),
            (TypeError, partial(engine.publish, 5, {})),  # type: ignore[arg-type]
        ]
        for error, call in cases:
            with pytest.raises(error):
                await call()
        assert issubclass(flow.UnknownPlan, ValueError) and issubclass(flow.IdReused, ValueError)
        assert issubclass(flow.UnknownFlow, LookupError)
        assert await count_rows(store) == {}
        assert await engine.get("x") is None


async def test_definition_errors_are_raised_as_they_are(store) -> None:
    with pytest.raises(TypeError, match="async"):
        flow.Plan("p").step(lambda ctx: None)  # type: ignore[type-var]
    with pytest.raises(TypeError, match="compensate"):
        flow.Plan("p").step(compensate=lambda ctx: None)  # type: ignore[arg-type,return-value]
    plan = flow.Plan("p")
    plan.step(name="a")(_noop)
    with pytest.raises(ValueError, match="already has a step named 'a'"):
        plan.step(name="a")(_noop)
    with pytest.raises(ValueError, match="attempts"):
        plan.step(attempts=0)
    with pytest.raises(ValueError, match="no steps"):
        async with engine_on(store, flow.Plan("empty")):
            pass
    for bad in ({"max_running": 0}, {"lease": 0}, {"owner": ""}):
        with pytest.raises(ValueError):
            async with engine_on(store, plan, **bad):
                pass
    with pytest.raises(ValueError, match="two plans"):
        async with engine_on(store, plan, simple_plan(_noop, name="p")):
            pass
    with pytest.raises(TypeError):
        async with flow.open_engine(42, plans=[plan]):  # type: ignore[arg-type]
            pass
    async with engine_on(store, plan):
        pass
    with pytest.raises(ValueError, match="already registered"):
        plan.step(name="late")(_noop)


# ---------------------------------------------------------------------------- scheduling


async def test_max_running_bounds_running_flows_first_come_first_served(
    store, autojump_clock
) -> None:
    started: list[str] = []
    gates: dict[str, trio.Event] = {}

    async def step(ctx: flow.Context) -> None:
        started.append(ctx.flow_id)
        gates[ctx.flow_id] = trio.Event()
        await gates[ctx.flow_id].wait()

    plan = simple_plan(step)
    async with engine_on(store, plan, max_running=2) as engine:
        for i in range(5):
            await engine.start(plan, flow_id=f"f{i}")
        await trio.testing.wait_all_tasks_blocked()
        assert started == ["f0", "f1"] and engine.statistics().running == 5
        gates["f1"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert started == ["f0", "f1", "f2"]
        for fid in ("f0", "f2"):
            gates[fid].set()
        await trio.testing.wait_all_tasks_blocked()
        assert started == ["f0", "f1", "f2", "f3", "f4"]
        for gate in gates.values():
            gate.set()
        for i in range(5):
            await settle(engine, f"f{i}")
        assert runner_tasks(engine) == 0 and engine._parts.runner.slots.running == 0


# --------------------------------------------------------------------- store trouble, fencing


async def test_a_failed_write_is_retried_and_a_failed_call_raises(
    planted, autojump_clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the flow's writes (`write_batch`) take the planted failures: the engine's retention
    round, which may run at any point here, took one of them when any transaction could."""
    store = planted
    store.fail_kind = "write_batch"
    plan = simple_plan(_noop, _noop)
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        store.fail_next = 2  # the first step's write fails twice, then goes through
        with caplog.at_level(logging.WARNING, logger="ferry.flow"):
            snap = await settle(engine, fid)
        assert snap.state is flow.State.COMPLETED and snap.revision == 3
        # each failed try is logged with its delay, the runner's first try too
        retries = [r for r in caplog.records if r.name == "ferry.flow" and "retry" in r.__dict__]
        assert [(r.__dict__["retry"], r.__dict__["delay"]) for r in retries] == [
            (1, 0.05),
            (2, 0.1),
        ]
        assert all(f"writing flow {fid!r}" in r.getMessage() for r in retries)
        assert all(r.__dict__["flow_id"] == fid for r in retries)
        store.fail_next = 1
        with pytest.raises(ferry.Failed) as info:
            await engine.start(plan, flow_id="y")
        assert "unavailable" in str(info.value.__cause__)
        assert await engine.get("y") is None


async def test_a_write_behind_the_engines_back_makes_its_runner_follow_the_store(
    store, autojump_clock
) -> None:
    gate = trio.Event()
    undone = []

    async def first(ctx: flow.Context) -> None:
        pass

    async def undo(ctx: flow.Context) -> None:
        undone.append(ctx.error)

    async def second(ctx: flow.Context) -> None:
        await gate.wait()

    plan = simple_plan(first, second, compensations={0: undo})
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        await trio.testing.wait_all_tasks_blocked()
        shape = engine._shapes[("p", 1)]
        from ferry.flow._model import _machine as m

        # another writer (say, an operator's tool) cancels the flow directly in the store
        op = _op.Change(fid, lambda f, _b: m.cancel(f, shape, "by hand", 0.0))
        async with SqliteStore(store) as tool:  # not an engine: it takes no engine lock
            await tool.transact(partial(_batch.write_batch, ops=[op]))
        gate.set()  # the step finishes; its write loses the compare-and-set
        snap = await settle(engine, fid)
        assert snap.state is flow.State.FAILED and snap.error == "by hand"
        assert engine.statistics().conflicts == 1
    assert undone == ["by hand"]


# ------------------------------------------------------------------- threaded stores, the lock


async def test_sqlite_file_is_served_by_one_engine_at_a_time(tmp_path: Path) -> None:
    plan = simple_plan(_noop)
    path = tmp_path / "one.db"
    async with engine_on(str(path), plan) as engine:
        with pytest.raises(flow.StoreLocked, match="another flow engine is serving"):
            async with engine_on(str(path), simple_plan(_noop)):
                pass
        async with SqliteStore(path) as other:
            with pytest.raises(flow.StoreLocked):
                async with engine_on(other, simple_plan(_noop)):
                    pass
        await settle(engine, await engine.start(plan))
    async with engine_on(str(path), simple_plan(_noop)) as engine:  # released on close
        assert await count_rows(engine._store) == {flow.State.COMPLETED: 1}


async def run_mixed_flows(store: Store, n: int) -> flow.FlowStatistics:
    """n flows on a threaded store: steps, a park and a wake each, some failing; all settle."""
    log: Log = []
    plan = order_plan(log)

    async def bad(ctx: flow.Context) -> flow.Outcome:
        return flow.fail("no")

    failing = simple_plan(_noop, bad, name="failing")
    async with engine_on(store, plan, failing) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(partial(engine.start, plan, flow_id=f"o{i}"))
                nursery.start_soon(partial(engine.start, failing, flow_id=f"x{i}"))
        for i in range(n):
            delivery = await engine.wake(f"o{i}", i, message_id=f"m{i}")
            assert delivery in (flow.Delivery.RESUMED, flow.Delivery.QUEUED)
        for i in range(n):
            assert (await settle(engine, f"o{i}")).state is flow.State.COMPLETED
            assert (await settle(engine, f"x{i}")).state is flow.State.FAILED
        stats = engine.statistics()
    assert sorted(e for e in log if e[0] == "ship") == sorted(("ship", i, False) for i in range(n))
    return stats


async def test_group_commit_on_the_threaded_sqlite_store(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "g.db", synchronous="NORMAL") as st:
        stats = await run_mixed_flows(st, 40)
    # concurrent flows' boundaries shared transactions
    assert stats.write_batches < stats.writes / 2
    async with SqliteStore(tmp_path / "solo.db", synchronous="NORMAL") as st:
        async with engine_on(st, simple_plan(_noop, _noop), group_commit=False) as engine:
            fids = [await engine.start(engine._plans[("p", 1)]) for _ in range(5)]
            for fid in fids:
                await settle(engine, fid)
            solo = engine.statistics()
    assert solo.write_batches == solo.writes == 15


async def test_flows_on_postgres(pg_server: pg.PgServer) -> None:
    async with PostgresStore(pg_server.fresh_schema_dsn(), connections=3) as st:
        stats = await run_mixed_flows(st, 15)
    assert stats.completed == 15 and stats.failed == 15 and stats.write_batches < stats.writes
