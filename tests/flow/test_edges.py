"""The engine at its edges (issue 15): one flow's problems stay its own, the one retry rule,
time wins at the deadline, attempts count runs, publish is all or nothing, keys never collide."""

from __future__ import annotations

import itertools
import logging
import sqlite3

import pytest
import trio
import trio.testing

from ferry import Failed
from ferry.flow import _retry


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
    # Not unavailability: raised at once.
    assert not _retry.unavailable(_sqlite_error(19, "UNIQUE constraint failed"))
    assert not _retry.unavailable(sqlite3.IntegrityError("UNIQUE constraint failed"))
    assert not _retry.unavailable(sqlite3.OperationalError("no such table: flow_flows"))
    assert not _retry.unavailable(pg.UniqueViolation())
    assert not _retry.unavailable(pg.QueryCanceled())
    assert not _retry.unavailable(KeyError("state"))
    assert not _retry.unavailable(UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates"))
    assert not _retry.unavailable(_failed(KeyError("state")))
    assert not _retry.unavailable(Failed("no cause"))


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


async def test_retrying_caps_the_delay_and_raises_anything_else() -> None:
    delay = _retry.FIRST_DELAY
    for _ in range(20):
        delay = _retry.next_delay(delay)
    assert delay == _retry.MAX_DELAY

    async def broken() -> None:
        raise KeyError("state")

    with pytest.raises(KeyError):
        await _retry.retrying(broken, what="reading flow 'x'")
