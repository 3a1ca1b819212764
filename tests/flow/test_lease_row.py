"""A fleet engine whose lease row vanished from the engines table (a database that lost its last
commits in a crash, with ``synchronous_commit = off``; a restore; a prune after a lapse) is not
superseded: nobody else holds its name. It writes the row again and goes on as after a lapse,
re-reading its flows. Only a row of another incarnation ends it (tests/fleet,
tests/flow/test_postgres_mistakes_answered.py).

The first two tests failed before the fix: the engine's next renewal found no row of its
incarnation, took itself for superseded ("lost its lease for good") and ran nothing more, for
ever. The third checks the race the fix opens (another incarnation's claim wins the name while
the row is missing: superseded). They run on the suite's throwaway PostgreSQL server, through the
public API.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest
import trio

from ferry import flow
from ferry.projected import PostgresStore
from tests import pg

_REWRITTEN = "its lease row was missing from the engines table"
_FOR_GOOD = "lost its lease for good"  # what the engine said before the fix
_WAIT = 20.0  # seconds: generous bounds for a loaded machine, never reached when it works


class _Heard(logging.Handler):
    """Sets a threading.Event when a record on ferry.flow says one of `words` (any thread)."""

    def __init__(self, *words: str) -> None:
        super().__init__(logging.INFO)
        self.words = words
        self.heard = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if any(words in record.getMessage() for words in self.words):
            self.heard.set()


@pytest.fixture
def heard(caplog: pytest.LogCaptureFixture) -> Any:
    """The engine's answer to a missing row (the WARNING that it was written again; before the
    fix, that the lease was lost for good), as a `_Heard` on ferry.flow."""
    caplog.set_level(logging.INFO, logger="ferry.flow")
    handler = _Heard(_REWRITTEN, _FOR_GOOD)
    log = logging.getLogger("ferry.flow")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


def _sql(dsn: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []


def _lost(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "lost its lease" in r.getMessage()]


async def _heard(handler: _Heard) -> bool:
    return await trio.to_thread.run_sync(handler.heard.wait, _WAIT)


def _plan(runs: list[tuple[str, str, str]], who: str, hold: Any = None) -> flow.Plan:
    """Plan "trip" (one, two): each run is recorded as ``(who, flow_id, step)``; `hold`, if
    given, is awaited by step one of the first flow this engine runs."""
    p = flow.Plan("trip")

    @p.step
    async def one(ctx: flow.Context) -> None:
        first = not any(r[0] == who for r in runs)
        runs.append((who, ctx.flow_id, "one"))
        if hold is not None and first:
            await hold(ctx)

    @p.step
    async def two(ctx: flow.Context) -> None:
        runs.append((who, ctx.flow_id, "two"))

    return p


async def test_an_engine_whose_lease_row_vanished_writes_it_again_and_goes_on(
    pg_server: pg.PgServer, caplog: pytest.LogCaptureFixture, heard: _Heard
) -> None:
    """The row is deleted under a running engine (what a crash that lost the last commits
    leaves): the engine's renewal writes it again (WARNING), renewals go on, the row names the
    engine again, and a flow started after that runs to completion. Before: "lost its lease for
    good" and nothing ran any more."""
    dsn = pg_server.fresh_schema_dsn("leaserow")
    runs: list[tuple[str, str, str]] = []
    p = _plan(runs, "solo")
    async with (
        PostgresStore(dsn) as store,
        flow.open_engine(store, [p], owner="solo", lease=0.6) as engine,
    ):
        before = await engine.start(p)
        assert (await engine.wait(before, timeout=_WAIT)).state is flow.State.COMPLETED
        ((incarnation,),) = _sql(dsn, "SELECT incarnation FROM flow_engines WHERE owner = 'solo'")
        await trio.to_thread.run_sync(_sql, dsn, "DELETE FROM flow_engines WHERE owner = 'solo'")
        assert await _heard(heard), "the engine did not notice the missing row"
        renewed = engine.statistics().renewals
        after = await engine.start(p)
        assert (await engine.wait(after, timeout=_WAIT)).state is flow.State.COMPLETED
        with trio.fail_after(_WAIT):
            # A counter with no event to wait on: looked at every 50 ms, bounded.
            while engine.statistics().renewals <= renewed:  # noqa: ASYNC110
                await trio.sleep(0.05)
        ((again, until),) = _sql(
            dsn, "SELECT incarnation, lease_until FROM flow_engines WHERE owner = 'solo'"
        )
    assert again == incarnation  # the same incarnation, not a new claim
    assert until > time.time() - 60
    assert [r for r in runs if r[1] == after] == [("solo", after, "one"), ("solo", after, "two")]
    assert _lost(caplog) == []
    (warning,) = [r for r in caplog.records if _REWRITTEN in r.getMessage()]
    assert warning.levelno == logging.WARNING and "written again" in warning.getMessage()


async def test_a_flow_taken_over_while_the_row_was_missing_is_not_run_twice(
    pg_server: pg.PgServer, caplog: pytest.LogCaptureFixture, heard: _Heard
) -> None:
    """Engine 'a' runs step one of a flow when its row vanishes; engine 'b' sees the flow as
    nobody's and takes it over to completion. 'a''s step then returns: its write is refused
    (the flow moved on), and its renewal, writing the row again, re-reads the flow and lets it
    go. Each step is recorded once, and 'a' goes on running new flows itself.

    'a''s renewal is held at its write of the row by a transaction of the test that inserted
    a row of the same name and has not committed (invisible to 'b', which takes the flow),
    until 'b' is done: the takeover comes first, deterministically."""
    dsn = pg_server.fresh_schema_dsn("leaserow")
    runs: list[tuple[str, str, str]] = []
    entered, release = trio.Event(), trio.Event()

    async def hold(ctx: flow.Context) -> None:
        entered.set()
        await release.wait()

    pa, pb = _plan(runs, "a", hold), _plan(runs, "b")
    async with (
        PostgresStore(dsn) as store_b,
        flow.open_engine(store_b, [pb], owner="b", lease=0.6) as b,
        PostgresStore(dsn) as store_a,
        flow.open_engine(store_a, [pa], owner="a", lease=3.0) as a,
    ):
        fid = await a.start(pa)
        with trio.fail_after(_WAIT):
            await entered.wait()
        blocker = await trio.to_thread.run_sync(_hide_row, dsn, "a")
        try:
            assert (await b.wait(fid, timeout=_WAIT)).state is flow.State.COMPLETED
            release.set()  # 'a''s step returns with the flow taken: its write is refused
        finally:
            await trio.to_thread.run_sync(blocker.rollback)
            await trio.to_thread.run_sync(blocker.close)
        assert await _heard(heard), "the engine did not notice the missing row"
        later = await a.start(pa)
        assert (await a.wait(later, timeout=_WAIT)).state is flow.State.COMPLETED
        history = await a.history(fid)
        rows = _sql(dsn, "SELECT owner FROM flow_engines ORDER BY owner")
    assert [r for r in runs if r[1] == fid] == [
        ("a", fid, "one"),
        ("b", fid, "one"),
        ("b", fid, "two"),
    ]
    done = [(e.step, e.detail) for e in history if e.kind == "step"]
    assert [step for step, _detail in done] == ["one", "two"], history
    assert [r for r in runs if r[1] == later] == [("a", later, "one"), ("a", later, "two")]
    assert rows == [("a",), ("b",)]
    assert _lost(caplog) == []


def _hide_row(dsn: str, owner: str) -> psycopg.Connection[Any]:
    """Delete `owner`'s engine row (committed) and insert one of the same name in a transaction
    left open, so that the engine's write of its row waits for it while the others see no row.
    If the engine wrote its row again between the two (its renewal came just then), again."""
    conn = psycopg.connect(dsn)
    while True:
        conn.execute("DELETE FROM flow_engines WHERE owner = %s", (owner,))
        conn.commit()
        held = conn.execute(
            "INSERT INTO flow_engines (owner, lease_until, started_at) VALUES (%s, 0, 0)"
            " ON CONFLICT (owner) DO NOTHING RETURNING owner",
            (owner,),
        ).fetchall()
        if held:
            return conn
        conn.rollback()


async def test_a_claim_that_wins_the_name_while_the_row_is_missing_supersedes_the_engine(
    pg_server: pg.PgServer, caplog: pytest.LogCaptureFixture, heard: _Heard
) -> None:
    """The engine's renewal, writing its missing row again, loses the race to another
    incarnation's claim of the name (``ON CONFLICT DO NOTHING`` inserts nothing): that one holds
    the name, and the engine is superseded, as when it finds that row at once. The claim here is
    the test's, committed once the engine's insert waits for it; the row stays the claimant's."""
    dsn = pg_server.fresh_schema_dsn("leaserow")
    runs: list[tuple[str, str, str]] = []
    p = _plan(runs, "solo")
    async with (
        PostgresStore(dsn) as store,
        flow.open_engine(store, [p], owner="solo", lease=3.0),
    ):
        claim = await trio.to_thread.run_sync(_hide_row, dsn, "solo")
        try:
            await trio.to_thread.run_sync(
                claim.execute,
                "UPDATE flow_engines SET incarnation = 'elsewhere', lease_until = %s"
                " WHERE owner = 'solo'",
                (time.time() + 600,),
            )
            with trio.fail_after(_WAIT):
                # The engine's insert of its row, waiting for the claim's (no event to wait on).
                while not await trio.to_thread.run_sync(_insert_waits, dsn):  # noqa: ASYNC110
                    await trio.sleep(0.05)
            await trio.to_thread.run_sync(claim.commit)
        finally:
            await trio.to_thread.run_sync(claim.close)
        assert await _heard(heard)
    ((incarnation,),) = _sql(dsn, "SELECT incarnation FROM flow_engines WHERE owner = 'solo'")
    assert incarnation == "elsewhere"
    assert [m for m in _lost(caplog) if "for good" in m], caplog.text
    assert not [r for r in caplog.records if _REWRITTEN in r.getMessage()]


def _insert_waits(dsn: str) -> bool:
    """Is a session's insert into the engines table waiting for a lock?"""
    rows = _sql(
        dsn,
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE 'INSERT INTO flow_engines%%'",
    )
    return bool(rows)
