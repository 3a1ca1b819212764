"""The one retry rule (ADR 0061): the store saying "not now" (busy, locked, a serialization
failure, a lost connection) is retried with its own delays and logged; anything else is raised
at once; a batch the database rolled back, or one past the call timeout, is run again."""

from __future__ import annotations

import itertools
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import Failed, flow
from ferry.flow._runtime import _retry


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
