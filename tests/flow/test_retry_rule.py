"""The engine at its edges (issue 15): one flow's problems stay its own, the one retry rule,
time wins at the deadline, attempts count runs, publish is all or nothing, keys never collide."""

from __future__ import annotations

import enum
import itertools
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import ferry
from ferry import Failed, flow
from ferry.flow import _machine as m
from ferry.flow import _retry
from ferry.flow._values import EMPTY_MAILBOX, Flow, Message, Shape
from ferry.projected import PostgresStore
from tests import pg


def _sqlite_error(code: int, text: str) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(text)
    exc.sqlite_errorcode = code
    return exc


def _failed(cause: BaseException) -> Failed:
    exc = Failed("the batch failed")
    exc.__cause__ = cause
    return exc


def test_unavailable_is_the_store_saying_not_now() -> None:
    import psycopg.errors as pg

    busy = _sqlite_error(5, "database is locked")
    assert _retry.unavailable(busy)
    assert _retry.unavailable(_sqlite_error(6, "database table is locked"))
    assert _retry.unavailable(_sqlite_error(10 | (3 << 8), "disk I/O error"))  # an extended code
    assert _retry.unavailable(_failed(busy))
    assert _retry.unavailable(sqlite3.OperationalError("database is locked"))  # no code: the text
    assert _retry.unavailable(pg.SerializationFailure())
    assert _retry.unavailable(pg.DeadlockDetected())
    assert _retry.unavailable(pg.AdminShutdown())
    assert _retry.unavailable(pg.OperationalError("the connection is lost"))
    assert _retry.unavailable(_failed(pg.OperationalError("consuming input failed")))
    idle = pg.IdleInTransactionSessionTimeout()
    assert _retry.unavailable(ExceptionGroup("writes", [_failed(idle), _failed(busy)]))
    # Not unavailability: raised at once.
    assert not _retry.unavailable(_sqlite_error(19, "UNIQUE constraint failed"))
    assert not _retry.unavailable(sqlite3.IntegrityError("UNIQUE constraint failed"))
    assert not _retry.unavailable(sqlite3.OperationalError("no such table: flow_flows"))
    assert not _retry.unavailable(pg.UniqueViolation())
    assert not _retry.unavailable(pg.QueryCanceled())
    assert not _retry.unavailable(KeyError("state"))
    assert _retry.unavailable(_failed(trio.TooSlowError("the call ran longer than call_timeout")))
    assert not _retry.unavailable(trio.TooSlowError("a user's own timeout"))
    assert not _retry.unavailable(UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates"))
    assert not _retry.unavailable(_failed(KeyError("state")))
    assert not _retry.unavailable(Failed("no cause"))
    assert not _retry.unavailable(ExceptionGroup("writes", [_failed(busy), KeyError("state")]))


async def test_retrying_retries_unavailability_with_its_own_delays(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    calls: list[float] = []

    async def call() -> str:
        calls.append(trio.current_time())
        if len(calls) <= 6:
            raise _sqlite_error(5, "database is locked")
        return "done"

    caplog.set_level(logging.WARNING, logger="ferry.flow")
    assert (
        await _retry.retrying(call, what="writing flow 'o-1'", extra={"flow_id": "o-1"}) == "done"
    )
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(calls)]
    assert gaps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6]
    records = [r for r in caplog.records if r.name == "ferry.flow"]
    assert len(records) == 6
    assert all(r.levelno == logging.WARNING for r in records)
    assert "writing flow 'o-1'" in records[0].getMessage()
    assert "0.05 s" in records[0].getMessage()
    assert records[0].__dict__["flow_id"] == "o-1"


async def test_retrying_makes_a_lazy_name_only_for_a_retry(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """`what` and `extra` given as functions are called only when a retry is logged (a
    runner's every write passes them; formatting them each time was a cost of every write)."""
    made: list[str] = []

    def what() -> str:
        made.append("what")
        return "writing flow 'o-2'"

    def extra() -> dict[str, str]:
        made.append("extra")
        return {"flow_id": "o-2"}

    async def ok() -> int:
        return 1

    assert await _retry.retrying(ok, what=what, extra=extra) == 1
    assert made == []
    fails = [_sqlite_error(5, "database is locked")]

    async def once() -> int:
        if fails:
            raise fails.pop()
        return 2

    caplog.set_level(logging.WARNING, logger="ferry.flow")
    assert await _retry.retrying(once, what=what, extra=extra) == 2
    assert made == ["what", "extra"]
    (record,) = [r for r in caplog.records if r.name == "ferry.flow"]
    assert "writing flow 'o-2'" in record.getMessage()
    assert record.__dict__["flow_id"] == "o-2"


async def test_retrying_caps_the_delay_and_raises_anything_else() -> None:
    store = [_retry.STORE.delay(n) for n in (1, 2, 3, 6, 7, 20, 10_000)]
    assert store == [0.05, 0.1, 0.2, 1.6, _retry.MAX_DELAY, _retry.MAX_DELAY, _retry.MAX_DELAY]
    renewal = [_retry.LEASE_RENEWAL.delay(n) for n in (1, 2, 3, 4, 5, 6, 7, 10_000)]
    assert renewal == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert _retry.STORE.retries is None and _retry.LEASE_RENEWAL.retries is None

    async def broken() -> None:
        raise KeyError("state")

    with pytest.raises(KeyError):
        await _retry.retrying(broken, what="reading flow 'x'")


async def test_a_schedule_with_a_limit_raises_after_its_last_retry(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """`ROLLBACK` (a batch the database rolled back on its own) tries 3 more times, 0.01 s times
    the retry apart, and then raises; each retry is logged, and only what `when` accepts is
    retried."""
    caplog.set_level(logging.WARNING, logger="ferry.flow")
    tries: list[float] = []

    async def deadlocked() -> None:
        tries.append(trio.current_time())
        raise _sqlite_error(5, "database is locked")

    start = trio.current_time()
    with pytest.raises(sqlite3.OperationalError):
        await _retry.retrying(deadlocked, what="writing a batch", schedule=_retry.ROLLBACK)
    assert [round(t - start, 6) for t in tries] == [0.0, 0.01, 0.03, 0.06]
    logged = [r for r in caplog.records if r.name == "ferry.flow"]
    assert [getattr(r, "retry", None) for r in logged] == [1, 2, 3]
    tries.clear()
    with pytest.raises(sqlite3.OperationalError):
        await _retry.retrying(deadlocked, what="x", schedule=_retry.ROLLBACK, when=lambda e: False)
    assert len(tries) == 1


async def test_a_batch_the_database_rolled_back_is_run_again_and_each_retry_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """A batch the database rolls back on its own (a deadlock: SQLSTATE class 40; nothing of it
    was written) is run again by the write path, up to 3 times, 0.01 s times the retry apart,
    with a WARNING each time (`_retry.ROLLBACK`); the flow goes on as if nothing happened."""
    import psycopg.errors as pg

    from tests.flow._helpers import PlantedStore, kind

    class Deadlocking(PlantedStore):
        deadlocks = 0

        async def transact(self, fn: Callable[..., Any]) -> Any:
            if self.deadlocks and kind(fn) == "write_batch":
                self.deadlocks -= 1
                await trio.lowlevel.checkpoint()
                raise pg.DeadlockDetected("deadlock detected (planted by the test)")
            return await super().transact(fn)

    plan = flow.Plan("deadlock", version=1)

    @plan.step
    async def first(ctx: flow.Context) -> None:
        ctx.data["first"] = True
        store.deadlocks = 3  # the write of this step's outcome is rolled back three times

    @plan.step
    async def second(ctx: flow.Context) -> None:
        ctx.data["second"] = True

    caplog.set_level(logging.WARNING, logger="ferry.flow")
    store = Deadlocking(str(tmp_path / "flows.db"))
    try:
        async with flow.open_engine(store, plans=[plan]) as engine:
            await engine.start(plan, flow_id="f")
            snap = await engine.wait("f", timeout=600)
    finally:
        await store.aclose()
    assert snap.state is flow.State.COMPLETED
    assert snap.data == {"first": True, "second": True}
    assert store.deadlocks == 0
    retries = [r for r in caplog.records if "rolled back by the database" in r.getMessage()]
    assert [(getattr(r, "retry", None), getattr(r, "delay", None)) for r in retries] == [
        (1, 0.01),
        (2, 0.02),
        (3, 0.03),
    ]


async def test_a_write_past_the_call_timeout_is_retried_not_fatal(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A batch that runs past the write ferry's call timeout (a store that does not answer, a
    process frozen for longer than that) is cancelled and comes back as `Failed` caused by
    `TooSlowError`; the runner retries its compare-and-set instead of ending the engine (it
    used to end the whole `async with`, and a frozen fleet engine died on thaw)."""
    from tests.flow._helpers import PlantedStore

    class Stalling(PlantedStore):
        stall_next = False

        async def transact(self, fn: Callable[..., Any]) -> Any:
            if self.stall_next:
                self.stall_next = False
                await trio.sleep(61)  # past the 60 s call timeout: cancelled
            return await super().transact(fn)

    plan = flow.Plan("stall", version=1)
    reached = trio.Event()

    @plan.step
    async def first(ctx: flow.Context) -> None:
        ctx.data["first"] = True
        store.stall_next = True  # the write of this step's outcome stalls
        reached.set()

    @plan.step
    async def second(ctx: flow.Context) -> None:
        ctx.data["second"] = True

    store = Stalling(str(tmp_path / "flows.db"))
    try:
        async with flow.open_engine(store, plans=[plan]) as engine:
            await engine.start(plan, flow_id="f")
            snap = await engine.wait("f", timeout=600)
    finally:
        await store.aclose()
    assert reached.is_set()
    assert snap.state is flow.State.COMPLETED
    assert snap.data == {"first": True, "second": True}


# ----------------------------------------------------------------- a bug ends the engine's block


async def test_a_corrupted_row_ends_the_engine_block_instead_of_spinning(tmp_path: Path) -> None:
    """A runner that finds its row moved on re-reads it; a state column that names no state is
    a bug to be seen: the `async with` ends with that error (it was retried for ever)."""
    path = str(tmp_path / "flows.db")
    gate = trio.Event()
    began = trio.Event()
    plan = flow.Plan("corrupt", version=1)

    @plan.step
    async def first(ctx: flow.Context) -> None:
        began.set()
        await gate.wait()

    with trio.fail_after(10), pytest.raises(KeyError, match="BOGUS"):
        async with flow.open_engine(path, plans=[plan]) as engine:
            await engine.start(plan, flow_id="f")
            await began.wait()
            with sqlite3.connect(path) as conn:  # someone writes a state no engine knows
                conn.execute(
                    "UPDATE flow_flows SET state = 'BOGUS', revision = revision + 1"
                    " WHERE flow_id = 'f'"
                )
            gate.set()
            await trio.sleep_forever()


async def test_the_blocks_own_error_is_kept_beside_an_engine_tasks(tmp_path: Path) -> None:
    """A task of the engine fails (the corrupted row above) and the block, cancelled by it,
    raises an error of its own while it unwinds: the block ends with both, neither lost."""
    path = str(tmp_path / "flows.db")
    gate = trio.Event()
    began = trio.Event()
    plan = flow.Plan("corrupt", version=1)

    @plan.step
    async def first(ctx: flow.Context) -> None:
        began.set()
        await gate.wait()

    with trio.fail_after(10), pytest.raises(ExceptionGroup) as caught:
        async with flow.open_engine(path, plans=[plan]) as engine:
            await engine.start(plan, flow_id="f")
            await began.wait()
            with sqlite3.connect(path) as conn:
                conn.execute(
                    "UPDATE flow_flows SET state = 'BOGUS', revision = revision + 1"
                    " WHERE flow_id = 'f'"
                )
            gate.set()
            try:
                await trio.sleep_forever()
            finally:
                raise RuntimeError("the block's own cleanup failed")
    block, task = caught.value.exceptions
    assert isinstance(block, RuntimeError) and "cleanup" in str(block)
    assert isinstance(task, KeyError) and "BOGUS" in str(task)


# ------------------------------------------------------------------------------ plan definitions


@pytest.mark.parametrize("name", ["", "pay/0/charge", "a/b", "x\udc80", "nul\x00"])
def test_a_step_name_that_is_empty_or_holds_a_slash_is_refused_at_definition(name: str) -> None:
    plan = flow.Plan("names", version=1)

    async def step(ctx: flow.Context) -> None:
        pass

    with pytest.raises(ValueError, match="name"):
        plan.step(name=name)(step)
    assert plan.steps == ()


@pytest.mark.parametrize("version", [0, -1, 2**31, 2**63])
def test_a_version_outside_a_32_bit_int_is_refused_at_the_plan(version: int) -> None:
    with pytest.raises(ValueError, match=r"1\.\.2147483647"):
        flow.Plan("versions", version=version)


def test_the_largest_version_is_a_version_and_a_bool_is_not() -> None:
    assert flow.Plan("versions", version=2**31 - 1).version == 2**31 - 1
    with pytest.raises(TypeError, match="int"):
        flow.Plan("versions", version=True)


# ---------------------------------------------------------- a flow's bad outcome or data: its own


def _deep(levels: int) -> dict[str, object]:
    """A dict nested `levels` levels deep in all (itself counted)."""
    value: dict[str, object] = {}
    for _ in range(levels - 1):
        value = {"d": value}
    return value


class _NotJson:
    pass


def _set_data(key: str, value: object) -> object:
    def change(ctx: flow.Context) -> None:
        ctx.data[key] = value

    return change


# case: (what the bad step returns, how it changes ctx.data, words in the flow's error)
_BAD: dict[str, tuple[object, object, str]] = {
    "park timeout a str": (flow.Park("60", "continue"), None, "timeout"),  # type: ignore[arg-type]
    "park timeout nan": (flow.Park(float("nan"), "compensate"), None, "timeout"),
    "park timeout < 0": (flow.Park(-1.0, "compensate"), None, "timeout"),
    "park on_timeout unknown": (flow.Park(1.0, "explode"), None, "on_timeout"),  # type: ignore[arg-type]
    "fail reason an exception": (flow.Fail(RuntimeError("x")), None, "reason must be a str"),  # type: ignore[arg-type]
    "fail reason a surrogate": (flow.Fail("bad \udc80"), None, "surrogate"),
    "not an outcome": (42, None, "not an outcome"),
    "data with a lone surrogate": (None, _set_data("x", "\udc80"), "surrogate"),
    "data with a surrogate key": (None, _set_data("\udc80", 1), "surrogate"),
    "data 5000 levels deep": (None, _set_data("d", _deep(5000)), "deeper than 64"),
    "data 65 levels deep": (None, _set_data("d", _deep(64)), "deeper than 64"),
    "data that is not JSON": (None, _set_data("s", _NotJson()), "must be JSON"),
    "data too big": (None, _set_data("s", "x" * 2000), "max_data_bytes=1000"),
}


@pytest.mark.parametrize("case", list(_BAD))
async def test_a_bad_outcome_or_data_fails_that_flow_alone(tmp_path: Path, case: str) -> None:
    """The bad flow compensates and ends FAILED naming the step and the problem; the good flows
    that shared its batches complete; the engine goes on; a reopen does not run it again."""
    returned, change, words = _BAD[case]
    path = str(tmp_path / "flows.db")
    ran: list[str] = []
    undone: list[str] = []
    plan = flow.Plan("edges", version=1)

    async def undo(ctx: flow.Context) -> None:
        undone.append(ctx.flow_id)

    @plan.step(compensate=undo)
    async def reserve(ctx: flow.Context) -> None:
        ctx.data["reserved"] = True

    @plan.step
    async def decide(ctx: flow.Context) -> object:
        if ctx.data.get("bad"):
            ran.append(ctx.flow_id)
            if callable(change):
                change(ctx)
            return returned
        return flow.CONTINUE

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        ctx.data["shipped"] = True

    good = [f"good-{i}" for i in range(20)]
    with trio.fail_after(10):
        async with flow.open_engine(path, plans=[plan], max_data_bytes=1000) as engine:
            async with trio.open_nursery() as nursery:
                for fid in good[:10]:
                    nursery.start_soon(partial(engine.start, plan, flow_id=fid))
                nursery.start_soon(partial(engine.start, plan, flow_id="bad", data={"bad": 1}))
                for fid in good[10:]:
                    nursery.start_soon(partial(engine.start, plan, flow_id=fid))
            snap = await engine.wait("bad")
            assert snap.state is flow.State.FAILED
            assert snap.error is not None
            assert "'decide'" in snap.error
            assert words in snap.error
            for fid in good:
                assert (await engine.wait(fid)).state is flow.State.COMPLETED
            # the engine keeps running flows after it
            await engine.start(plan, flow_id="after")
            assert (await engine.wait("after")).state is flow.State.COMPLETED
        assert undone == ["bad"]
        async with flow.open_engine(path, plans=[plan], max_data_bytes=1000) as engine:
            assert (await engine.wait("bad")).state is flow.State.FAILED
    assert ran == ["bad"]


# ------------------------------------------------------------------------ bad input at the call


async def test_a_bad_start_is_refused_at_its_call_and_fails_no_neighbour(tmp_path: Path) -> None:
    """One start with a lone surrogate among 40 concurrent ones: it alone raises ValueError
    (it was ferry.Failed, and so were the others of its batch); nothing is stored for it."""
    plan = flow.Plan("calls", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    refused: list[BaseException] = []
    started: list[str] = []

    async def start(fid: str, data: dict[str, object]) -> None:
        try:
            started.append(await engine.start(plan, flow_id=fid, data=data))
        except (TypeError, ValueError, ferry.Failed) as exc:
            refused.append(exc)

    async with flow.open_engine(str(tmp_path / "flows.db"), plans=[plan]) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(40):
                data: dict[str, object] = {"x": "\udc80"} if i == 20 else {"i": i}
                nursery.start_soon(start, f"f-{i}", data)
        assert len(refused) == 1
        assert isinstance(refused[0], ValueError)
        assert "surrogate" in str(refused[0])
        assert sorted(started) == sorted(f"f-{i}" for i in range(40) if i != 20)
        assert await engine.get("f-20") is None


@pytest.mark.parametrize(
    ("data", "error", "words"),
    [
        (_deep(10_000), ValueError, "deeper than 64"),
        (_deep(65), ValueError, "deeper than 64"),
        ({"x": "y" * 1000}, ValueError, "max_data_bytes=1000"),
        ({"x": {1, 2}}, TypeError, "must be JSON"),
        ({1: "x"}, TypeError, "round trip"),
        ({"x": [[1, (2, 3)]]}, TypeError, "round trip"),  # a tuple deep inside
        ({"x": {"y": {2: "z"}}}, TypeError, "round trip"),  # a non-str key deep inside
        ({"x": "\u00e9" * 600}, ValueError, "1208 bytes"),  # counted in UTF-8 bytes, not chars
    ],
)
async def test_bad_start_data_is_a_clear_error(
    tmp_path: Path, data: dict[str, object], error: type[Exception], words: str
) -> None:
    plan = flow.Plan("calls", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    path = str(tmp_path / "f.db")
    async with flow.open_engine(path, plans=[plan], max_data_bytes=1000) as engine:
        with pytest.raises(error, match=words):
            await engine.start(plan, flow_id="f", data=data)
        assert await engine.get("f") is None
        assert await engine.start(plan, flow_id="ok", data=_deep(64)) == "ok"  # 64 levels in all


async def test_start_data_that_json_gives_back_equal_is_stored(tmp_path: Path) -> None:
    """Subclasses of JSON's types (an IntEnum, a str subclass, a dict subclass) are not JSON's
    own, but survive a round trip equal: stored as plain JSON, as before the check was cheap."""

    class Level(enum.IntEnum):
        HIGH = 3

    class Name(str):
        pass

    class Doc(dict):  # type: ignore[type-arg]
        pass

    plan = flow.Plan("calls", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    data = {"level": Level.HIGH, "name": Name("n"), "doc": Doc(a=[1.5, None, True])}
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.wait(await engine.start(plan, flow_id="f", data=data))
        snap = await engine.get("f")
        assert snap is not None
        assert snap.data == {"level": 3, "name": "n", "doc": {"a": [1.5, None, True]}}
        assert type(snap.data["level"]) is int and type(snap.data["doc"]) is dict


async def test_bad_wakes_and_publishes_are_refused_at_their_call(tmp_path: Path) -> None:
    plan = flow.Plan("calls", version=1)

    @plan.step
    async def wait_here(ctx: flow.Context) -> flow.Park:
        return flow.park()

    @plan.step
    async def after(ctx: flow.Context) -> None:
        ctx.data["woken"] = ctx.wake

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="p")
        with pytest.raises(ValueError, match="surrogate"):
            await engine.wake("p", {"x": "\udc80"})
        with pytest.raises(ValueError, match="deeper"):
            await engine.wake("p", _deep(100))
        with pytest.raises(ValueError, match="message_id"):
            await engine.wake("p", None, message_id="evt-\udc80")
        with pytest.raises(ValueError, match="flow_id"):
            await engine.wake("p\x00", None)
        engine.on("bad", lambda event: flow.Start(plan, "s", data={"x": "\udc80"}))
        with pytest.raises(ValueError, match="surrogate"):
            await engine.publish("bad", {})
        assert await engine.get("s") is None
        assert await engine.wake("p", {"ok": 1}) is flow.Delivery.RESUMED
        snap = await engine.wait("p")
        assert snap.state is flow.State.COMPLETED and snap.data == {"woken": {"ok": 1}}


# ------------------------------------------------------------------------ time wins at the deadline


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
    """Issue 15 item 7: flows parked with a short timeout, the engine closed and reopened after
    their deadlines; a wake as the first call resumed one of them, the others timed out."""
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
    assert sorted(refunded) == ids


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


# ------------------------------------------------------------------------------ idempotency keys


async def test_no_compensation_key_is_another_flows_step_key(tmp_path: Path) -> None:
    """Flow `a`, step `1` at index 0, compensated; flow `a/0`, step `compensate` at index 1:
    their keys were both `a/0/1/compensate`."""
    keys: dict[str, tuple[str, str]] = {}

    def record(kind: str) -> Callable[[flow.Context], Awaitable[None]]:
        async def run(ctx: flow.Context) -> None:
            assert keys.setdefault(ctx.idempotency_key, (ctx.flow_id, kind)) == (
                ctx.flow_id,
                kind,
            ), f"{ctx.idempotency_key!r} given twice"

        return run

    first = flow.Plan("first", version=1)
    first.step(name="1", compensate=record("undo 1"))(record("step 1"))

    @first.step
    async def refuse(ctx: flow.Context) -> flow.Fail:
        return flow.fail("no")

    second = flow.Plan("second", version=1)
    second.step(name="x")(record("step x"))
    second.step(name="compensate")(record("step compensate"))

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[first, second]) as engine:
        await engine.start(first, flow_id="a")
        await engine.start(second, flow_id="a/0")
        assert (await engine.wait("a")).state is flow.State.FAILED
        assert (await engine.wait("a/0")).state is flow.State.COMPLETED
    assert keys == {
        "a/0/1": ("a", "step 1"),
        "a/0-compensate/1": ("a", "undo 1"),
        "a/0/0/x": ("a/0", "step x"),
        "a/0/1/compensate": ("a/0", "step compensate"),
    }


# ------------------------------------------------------------------------- attempts count runs


async def test_after_an_operators_wake_the_next_step_runs_as_attempt_1(tmp_path: Path) -> None:
    """Issue 15 item 8: the operator's engine (the inspector's) wakes a parked flow; the engine
    that opens next ran its next step as attempt 2, though no run of it had begun."""
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


# ---------------------------------------------------------------------- publish: all or nothing


async def test_a_publish_applies_all_of_its_decisions_or_none(tmp_path: Path) -> None:
    """Issue 15 item 9: a Wake, then a Start whose id is taken: the wake was applied (the flow
    completed) and the caller got IdReused, unable to tell what happened."""
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


# ------------------------------------------------------- a row the database refuses: its own


def _refuse_poison(path: str) -> None:
    """Triggers that make SQLite refuse any flow row whose data holds "poison" (a constraint of
    the database's own, which no check of the engine knows about)."""
    with sqlite3.connect(path) as conn:
        for event in ("INSERT", "UPDATE"):
            conn.execute(
                f"CREATE TRIGGER refuse_{event.lower()} BEFORE {event} ON flow_flows"
                " WHEN NEW.data LIKE '%poison%' BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
            )


async def test_a_start_the_database_refuses_fails_no_neighbour(tmp_path: Path) -> None:
    path = str(tmp_path / "flows.db")
    plan = flow.Plan("refused", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    errors: dict[str, BaseException] = {}

    async def start(fid: str, data: dict[str, object]) -> None:
        try:
            await engine.start(plan, flow_id=fid, data=data)
        except Exception as exc:
            errors[fid] = exc

    async with flow.open_engine(path, plans=[plan]) as engine:
        _refuse_poison(path)
        async with trio.open_nursery() as nursery:
            for i in range(40):
                data: dict[str, object] = {"poison": True} if i == 20 else {"i": i}
                nursery.start_soon(start, f"f-{i}", data)
        assert list(errors) == ["f-20"]
        assert isinstance(errors["f-20"], ferry.Failed)
        assert "poisoned row" in str(errors["f-20"])
        assert await engine.get("f-20") is None
        for i in range(40):
            if i != 20:
                assert (await engine.wait(f"f-{i}")).state is flow.State.COMPLETED


async def test_a_step_write_the_database_refuses_fails_that_flow_alone(tmp_path: Path) -> None:
    path = str(tmp_path / "flows.db")
    plan = flow.Plan("refused", version=1)
    undone: list[str] = []
    go = trio.Event()

    async def undo(ctx: flow.Context) -> None:
        undone.append(ctx.flow_id)

    @plan.step(compensate=undo)
    async def first(ctx: flow.Context) -> None:
        await go.wait()  # every flow's first write waits: they share batches

    @plan.step
    async def second(ctx: flow.Context) -> None:
        if ctx.flow_id == "bad":
            ctx.data["note"] = "poison"

    ids = [f"good-{i}" for i in range(10)] + ["bad"] + [f"good-{i}" for i in range(10, 20)]
    with trio.fail_after(10):
        async with flow.open_engine(path, plans=[plan]) as engine:
            _refuse_poison(path)
            for fid in ids:
                await engine.start(plan, flow_id=fid)
            await trio.testing.wait_all_tasks_blocked()
            go.set()
            bad = await engine.wait("bad")
            assert bad.state is flow.State.FAILED
            assert bad.error is not None
            assert "refused the write of step 'second'" in bad.error
            assert "poisoned row" in bad.error
            for fid in ids:
                if fid != "bad":
                    assert (await engine.wait(fid)).state is flow.State.COMPLETED
    assert undone == ["bad"]


# --------------------------------------------------------------------------------------- logging


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


_PG_POISON = """
CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.data LIKE '%poison%' THEN
        RAISE EXCEPTION 'poisoned row' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_poison BEFORE INSERT OR UPDATE ON flow_flows
    FOR EACH ROW EXECUTE FUNCTION refuse_poison();
"""


async def test_on_postgres_a_refused_row_fails_its_flow_alone(pg_server: pg.PgServer) -> None:
    """The same on PostgreSQL, where a failed statement aborts the whole transaction: a start
    the database refuses fails at its call alone, a refused step write fails its flow alone."""
    plan = flow.Plan("refused", version=1)
    go = trio.Event()

    @plan.step
    async def first(ctx: flow.Context) -> None:
        await go.wait()

    @plan.step
    async def second(ctx: flow.Context) -> None:
        if ctx.flow_id == "bad":
            ctx.data["note"] = "poison"

    errors: dict[str, BaseException] = {}

    async def start(fid: str, data: dict[str, object]) -> None:
        try:
            await engine.start(plan, flow_id=fid, data=data)
        except Exception as exc:
            errors[fid] = exc

    async with PostgresStore(pg_server.fresh_schema_dsn()) as store:
        with trio.fail_after(20):
            async with flow.open_engine(store, plans=[plan]) as engine:
                await store.transact(lambda tx: tx.execute(_PG_POISON))
                async with trio.open_nursery() as nursery:
                    for i in range(20):
                        data: dict[str, object] = {"poison": 1} if i == 10 else {}
                        nursery.start_soon(start, f"s-{i}", data)
                    nursery.start_soon(start, "bad", {})
                assert list(errors) == ["s-10"]
                assert isinstance(errors["s-10"], ferry.Failed)
                assert "poisoned row" in str(errors["s-10"])
                await trio.testing.wait_all_tasks_blocked()
                go.set()
                bad = await engine.wait("bad")
                assert bad.state is flow.State.FAILED
                assert bad.error is not None and "poisoned row" in bad.error
                for i in range(20):
                    if i != 10:
                        assert (await engine.wait(f"s-{i}")).state is flow.State.COMPLETED


async def test_a_cancel_reason_that_cannot_be_stored_is_refused_at_the_call(
    tmp_path: Path,
) -> None:
    plan = flow.Plan("calls", version=1)

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Park:
        return flow.park()

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="p")
        while (snap := await engine.get("p")) is None or snap.state is not flow.State.PARKED:
            await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ValueError, match="surrogate"):
            await engine.cancel("p", reason="bad \udc80")
        assert (await engine.get("p")).state is flow.State.PARKED  # type: ignore[union-attr]
        assert await engine.cancel("p", reason="customer") is True
