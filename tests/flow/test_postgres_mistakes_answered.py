"""What a newcomer to the fleet trips on: a PostgreSQL engine pointed at the wrong place, or
opened twice under one name, answers at once and in the user's words.

Each test here failed before its fix. They run on the suite's throwaway PostgreSQL server.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

import ferry
from ferry import flow
from ferry.projected import PostgresStore
from tests import pg


def plan() -> flow.Plan:
    p = flow.Plan("trip")

    @p.step
    async def book(ctx: flow.Context) -> None:
        return None

    return p


def closed_port() -> int:
    """A local port nobody listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wrong_dsns(server: pg.PgServer) -> list[tuple[str, str]]:
    """DSNs that cannot work, each with a word of the driver's error the message must carry."""
    return [
        (f"host=127.0.0.1 port={server.port} user=postgres dbname=no_such_db", "no_such_db"),
        (f"host=127.0.0.1 port={server.port} user=no_such_role dbname=postgres", "no_such_role"),
        (f"host=127.0.0.1 port={closed_port()} user=postgres dbname=postgres", "refused"),
    ]


async def test_an_engine_on_a_database_it_cannot_reach_fails_at_once_saying_what_to_check(
    pg_server: pg.PgServer,
) -> None:
    """A wrong database, role or port (or a server that is down) is `ferry.Failed` at open,
    naming the database (password masked), the driver's reason and what to do; the driver's
    error is its cause. Before: psycopg's OperationalError as it was, after a 30-line
    traceback through the engine's internals."""
    for dsn, word in wrong_dsns(pg_server):
        secret = f"{dsn} password=hunter2"
        async with PostgresStore(secret, connect_timeout=5) as store:
            with pytest.raises(ferry.Failed) as info:
                async with flow.open_engine(store, [plan()], owner="eu-1"):
                    pytest.fail("opened")  # pragma: no cover
        text = str(info.value)
        assert word in text
        assert "hunter2" not in text and "password=***" in text
        assert "open_engine could not reach its PostgreSQL database" in text
        assert "open it again" in text  # what to do: a server that is down comes up later
        assert type(info.value.__cause__).__name__ == "OperationalError"


async def test_an_engine_opens_once_the_server_that_was_down_is_up(pg_server: pg.PgServer) -> None:
    """The advice holds: the same store object, opened again after a `ferry.Failed` at open,
    serves once the database is there."""
    import psycopg

    name = f"late_{closed_port()}"
    dsn = f"host=127.0.0.1 port={pg_server.port} user=postgres dbname={name}"
    async with PostgresStore(dsn) as store:
        with pytest.raises(ferry.Failed):
            async with flow.open_engine(store, [plan()]):
                pytest.fail("opened")  # pragma: no cover
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        p = plan()
        async with flow.open_engine(store, [p]) as engine:
            fid = await engine.start(p)
            assert (await engine.wait(fid, timeout=30)).state is flow.State.COMPLETED


@pytest.mark.parametrize(
    "dsn", ["not a dsn", "host=127.0.0.1 port=5432 dbname='unclosed", "postgresql://[::1"]
)
def test_a_malformed_dsn_is_a_value_error_when_the_store_is_made(dsn: str) -> None:
    """Before: accepted, and a psycopg ProgrammingError at the first use (inside open_engine)."""
    with pytest.raises(ValueError, match="PostgresStore got a DSN psycopg cannot read"):
        PostgresStore(dsn)


async def test_an_engine_refused_at_open_logs_that_it_did_not_open_with_the_whole_advice(
    pg_server: pg.PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The second engine under a live name logs one INFO line saying it did not open and why,
    the advice whole. Before: 'closed by StoreLocked(...' cut at 200 characters, before the
    advice, for an engine that never opened."""
    dsn = pg_server.fresh_schema_dsn("twice")
    caplog.set_level(logging.INFO, logger="ferry.flow")
    async with (
        PostgresStore(dsn) as first_store,
        flow.open_engine(first_store, [plan()], owner="eu-1"),
        PostgresStore(dsn) as second_store,
    ):
        with pytest.raises(flow.StoreLocked) as info:
            async with flow.open_engine(second_store, [plan()], owner="eu-1"):
                pytest.fail("opened")  # pragma: no cover
        said = [r.getMessage() for r in caplog.records if "did not open" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert str(info.value) in said[0]
        assert not any("closed by" in r.getMessage() for r in caplog.records)


def test_an_engine_on_postgres_under_an_autojumping_mock_clock_is_refused_saying_what_to_do(
    pg_server: pg.PgServer,
) -> None:
    """flow.md's testing recipe (MockClock(autojump_threshold=0)) tried on PostgreSQL: the
    clock jumps while a statement runs on a worker thread, so every batch ran past its
    call_timeout and the engine retried it forever, one WARNING each, and the test failed
    with ferry.Failed. Refused at open now, before anything is written, saying what to do."""
    dsn = pg_server.fresh_schema_dsn("mock")

    async def main() -> None:
        async with PostgresStore(dsn) as store:
            with pytest.raises(ValueError, match="MockClock") as info:
                async with flow.open_engine(store, [plan()]):
                    pytest.fail("opened")  # pragma: no cover
            assert "SQLite" in str(info.value) and "real clock" in str(info.value)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # Nothing was created: the refusal came first.
    import psycopg

    with psycopg.connect(dsn) as conn:
        (tables,) = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()"
        ).fetchone() or (None,)
        assert tables == 0


def test_a_mock_clock_that_does_not_jump_on_its_own_is_allowed_on_postgres(
    pg_server: pg.PgServer,
) -> None:
    """Only autojump is refused: a MockClock moved by hand (or at a rate) never moves while a
    statement is in flight unless the test says so."""
    dsn = pg_server.fresh_schema_dsn("mockrate")
    p = plan()

    async def main() -> None:
        async with PostgresStore(dsn) as store, flow.open_engine(store, [p]) as engine:
            fid = await engine.start(p)
            assert (await engine.wait(fid, timeout=30)).state is flow.State.COMPLETED

    trio.run(main, clock=trio.testing.MockClock(rate=1.0))


async def test_a_takeover_log_line_says_whose_flows_it_took(
    pg_server: pg.PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine 'a' closes with two flows mid-step; engine 'b' takes them over at its next scan,
    and its INFO line says from whom. Before: 'took over 2 flow(s) no live engine held', with
    no word of whose (an operator after a crash wants to know which engine's flows moved)."""
    dsn = pg_server.fresh_schema_dsn("took")
    release = trio.Event()
    p = flow.Plan("trip")

    @p.step
    async def book(ctx: flow.Context) -> None:
        if ctx.attempt == 1:
            await release.wait()  # never set: 'a' closes with the step in flight

    caplog.set_level(logging.INFO, logger="ferry.flow")
    async with (
        PostgresStore(dsn) as store_b,
        flow.open_engine(store_b, [p], owner="b", lease=0.6) as b,
    ):
        async with (
            PostgresStore(dsn) as store_a,
            flow.open_engine(store_a, [p], owner="a", lease=0.6) as a,
        ):
            fids = [await a.start(p) for _ in range(2)]
        for fid in fids:
            assert (await b.wait(fid, timeout=30)).state is flow.State.COMPLETED
    said = [r.getMessage() for r in caplog.records if "'b' took over" in r.getMessage()]
    assert said and all("from 'a'" in s for s in said), said
    assert sum(int(s.split(" flow(s)")[0].rsplit(" ", 1)[1]) for s in said) == 2


@pytest.fixture(scope="module")
def own_server() -> Iterator[pg.PgServer]:
    """A throwaway server of this module's own, which a test halts (the session's is not).
    Its commits are synchronous: the suite's default (``synchronous_commit=off``) loses the
    last commits in a crash, here the engine's lease row, which the engine then writes again
    with a WARNING of its own (docs/adr/0107, tests/flow/test_lease_row.py)."""
    bindir = pg.find_binaries()
    if bindir is None:
        pytest.skip(pg.SKIP_REASON)
    server = pg.start(bindir, ["synchronous_commit=on"])
    try:
        yield server
    finally:
        server.stop()


class _Heard(logging.Handler):
    """Sets a threading.Event when a record on ferry.flow says `words` (from any thread)."""

    def __init__(self, words: str) -> None:
        super().__init__(logging.INFO)
        self.words = words
        self.heard = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.messages.append(record.getMessage())
            self.heard.set()


@pytest.mark.slow
async def test_an_engine_says_when_its_store_is_back_after_an_outage(
    own_server: pg.PgServer,
) -> None:
    """The server goes down under a serving engine and comes back: the WARNINGs of each failed
    renewal are followed by one INFO line saying the store is reachable again, after how long.
    Before: a run of WARNINGs and then silence (an operator could not tell from the log when,
    or whether, the engine had its store back)."""
    log = logging.getLogger("ferry.flow")
    failed, back = _Heard("renewing its lease failed"), _Heard("renewed its lease again")
    for handler in (failed, back):
        log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        async with (
            PostgresStore(own_server.fresh_schema_dsn("outage")) as store,
            flow.open_engine(store, [plan()], owner="eu-1", lease=3.0),
        ):
            await trio.to_thread.run_sync(own_server.halt)
            assert await trio.to_thread.run_sync(failed.heard.wait, 60)
            await trio.to_thread.run_sync(own_server.resume)
            assert await trio.to_thread.run_sync(back.heard.wait, 60)
    finally:
        for handler in (failed, back):
            log.removeHandler(handler)
        log.setLevel(old_level)
    (said,) = back.messages
    assert said.startswith("flow engine 'eu-1' renewed its lease again, ")
    assert "failed tries by its lease thread): its store is reachable again" in said


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://ops:hunter2@db.example:5432/orders",
        "postgres://ops@db.example/orders",
        "host=db.example port=5432 dbname=orders user=ops password=hunter2",
        "dbname=orders",
    ],
)
async def test_a_dsn_given_to_open_engine_as_a_path_is_refused_saying_use_postgres_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dsn: str
) -> None:
    """A newcomer to the fleet passes the DSN where the docs pass a store. Before: a URL was
    'no such directory: .../postgresql:'; a key=value DSN silently made an SQLite file of that
    name in the working directory, and every "fleet" engine ran alone on its own file."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="looks like a PostgreSQL DSN") as info:
        async with flow.open_engine(dsn, [plan()]):
            pytest.fail("opened")  # pragma: no cover
    assert "PostgresStore(dsn)" in str(info.value) and "hunter2" not in str(info.value)
    assert os.listdir(tmp_path) == []  # no file made


async def test_a_url_of_another_scheme_is_refused_as_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'postgress://...' (a typo) or 'sqlite:///x.db' is not a file path either."""
    monkeypatch.chdir(tmp_path)
    for url in ("postgress://ops@db.example/orders", "sqlite:///orders.db"):
        with pytest.raises(ValueError, match="looks like a URL"):
            async with flow.open_engine(url, [plan()]):
                pytest.fail("opened")  # pragma: no cover
    assert os.listdir(tmp_path) == []


async def test_a_file_whose_name_has_an_equals_sign_still_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only names that read as a DSN are refused: 'run=3.db' is a file like any other."""
    monkeypatch.chdir(tmp_path)
    p = plan()
    async with flow.open_engine("run=3.db", [p]) as engine:
        fid = await engine.start(p)
        assert (await engine.wait(fid, timeout=30)).state is flow.State.COMPLETED


def test_the_inspector_given_a_mistyped_postgres_url_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: 'no such directory: .../postgress:/ops@db.example', create the directory first."""
    from ferry.flow._ops import _inspect

    monkeypatch.chdir(tmp_path)
    code = _inspect.main(["postgress://ops:hunter2@db.example/orders", "stats"])
    err = capsys.readouterr().err
    assert code != 0
    assert "looks like a URL (scheme 'postgress')" in err and "postgresql://" in err
    assert "hunter2" not in err and "directory" not in err


def test_the_inspector_says_a_wake_ended_a_flow_parked_at_its_last_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flow whose last step parked completes with the wake itself. Before: the inspector said
    'RESUMED: it was parked and runs its next step: the next scan of an engine serving the
    store runs it' (there is no next step; the flow was COMPLETED already)."""
    from ferry.flow._ops import _inspect

    p = flow.Plan("trip")

    @p.step
    async def book(ctx: flow.Context) -> flow.Outcome:
        return flow.park()

    db = str(tmp_path / "trip.db")

    async def main() -> str:
        async with flow.open_engine(db, [p]) as engine:
            fid = await engine.start(p)
            await trio.testing.wait_all_tasks_blocked()
            snap = await engine.get(fid)
            assert snap is not None and snap.state is flow.State.PARKED
            return fid

    fid = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    code = _inspect.main([db, "wake", fid, "--message-id", "ops-1"])
    out = capsys.readouterr().out
    assert code == 0
    assert (
        out.strip() == "RESUMED: it was parked at its last step, and the wake ended it: COMPLETED"
    )
