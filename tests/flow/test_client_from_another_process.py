"""A client in one process acts on a store an engine of another process serves (`flow.connect`,
docs/adr/0125), and the store says whether an engine serves it (the heartbeat, ADR 0126).

The service is a child process (`tests/flow/_served.py`); the test is the second process, with
the client and with the CLI (``python -m ferry.flow``), where an operator or a web worker would
be. Before the client existed each of these failed: there was no `flow.connect`, the CLI's
actions were refused ("a flow engine is serving ... right now") while the service held the
file, and the overview said "No engine has recorded a lease" whether or not an engine served
it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ferry import flow
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader
from ferry.projected import PostgresStore
from tests import pg

from . import _served

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t" * 32


@pytest.fixture
def db(tmp_path: Path) -> str:
    """A store an engine made (and closed, in this process): no engine serves it."""
    path = str(tmp_path / "app.db")

    async def make() -> None:
        async with flow.open_engine(path, plans=[_served.order, _served.stuck]):
            pass

    trio.run(make)
    return path


@pytest.fixture
def service(db: str) -> Iterator[subprocess.Popen[str]]:
    child = _served.start(db, "svc")
    try:
        yield child
    finally:
        if child.poll() is None:
            _served.stop(child)


def requests_stored(path: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM flow_requests").fetchone()[0])
    finally:
        conn.close()


def pending(path: str) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT request_id FROM flow_requests WHERE answer IS NULL")
        return [r[0] for r in rows]
    finally:
        conn.close()


def cli(path: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferry.flow", path, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


# ---------------------------------------------------------------------- a served SQLite store


def test_every_request_is_applied_by_the_engine_serving_the_file(
    db: str, service: subprocess.Popen[str]
) -> None:
    async def main() -> None:
        async with flow.connect(db) as client:
            assert await client.start("order", flow_id="o1", data={"sku": "A1"}) == "o1"
            assert client.last is not None and client.last.served
            assert client.last.applied_by == "svc"
            await _parked(client, "o1")
            assert await client.wake("o1", {"paid": 30}) is flow.Delivery.RESUMED
            done = await client.wait("o1", timeout=30)
            assert done.state is flow.State.COMPLETED and done.data["shipped"] == {"paid": 30}
            assert [e.kind for e in await client.history("o1")][-1] == "completed"

            await client.start(flow.Plan("order", version=1), flow_id="o2")
            assert await client.cancel("o2", "customer changed their mind") is True
            assert (await client.wait("o2", timeout=30)).state is flow.State.FAILED

            await client.start("order", flow_id="o3")
            await _parked(client, "o3")
            assert await client.publish("paid", {"order": "o3", "id": "evt-1"}) == [
                flow.Delivery.RESUMED
            ]
            assert await client.publish("paid", {"order": "o3", "id": "evt-1"}) == [
                flow.Delivery.DUPLICATE
            ]

            await client.start("stuck", flow_id="s1")
            assert (await client.wait("s1", timeout=30)).state is flow.State.BLOCKED
            assert await client.resume("s1") is True  # the compensation runs again, and fails
            assert (await client.wait("s1", timeout=30)).state is flow.State.BLOCKED
            assert await client.abandon("s1", reason="refunded by hand", by="ops") is True
            after = await client.get("s1")
            assert after is not None and after.state is flow.State.FAILED

            # what the engine refuses is the answer, raised as the engine's own error
            with pytest.raises(flow.UnknownPlan, match="no plan 'nope'"):
                await client.start("nope")
            with pytest.raises(flow.IdReused):
                await client.start("order", flow_id="o1", data={"sku": "B2"})
            assert await client.resume("o1") is False

    trio.run(main)


def test_the_cli_acts_on_a_served_file_and_says_which_engine_applied_it(
    db: str, service: subprocess.Popen[str]
) -> None:
    async def park(fid: str = "o1") -> None:
        async with flow.connect(db) as client:
            await client.start("order", flow_id=fid)
            await _parked(client, fid)

    async def park2() -> None:
        await park("o2")

    trio.run(park)
    bulk = cli(db, "cancel", "--state", "PARKED", "--yes")  # the service runs: through it
    assert bulk.returncode == 0, bulk.stderr
    assert bulk.stdout.startswith(
        f"accepted: the serving engine 'svc', pid {service.pid} on {socket.gethostname()}"
        " applied it: cancel: 1 flow, 1 cancelled\n"
    ), bulk.stdout
    trio.run(park2)
    done = cli(db, "wake", "o2", "--payload", '{"paid": 1}')
    assert done.returncode == 0, done.stderr
    engine = f"engine 'svc', pid {service.pid} on {socket.gethostname()}"
    assert done.stdout in (  # the engine may have run the next step already, or not yet
        f"accepted: the serving {engine} applied it: RESUMED: it was parked and runs its next"
        f" step: the serving {engine} runs it now\n",
        f"accepted: the serving {engine} applied it: RESUMED: it was parked, and the serving"
        " engine ran it on: COMPLETED\n",
    ), done.stdout
    stats = json.loads(cli(db, "stats", "--json").stdout)
    assert stats["serving"] is True
    (engine,) = stats["engines"]
    assert (engine["owner"], engine["pid"], engine["alive"]) == ("svc", service.pid, True)
    text = cli(db, "stats").stdout
    assert f"{service.pid}@{socket.gethostname()}" in text and "no engine serves" not in text

    _served.stop(service)  # a clean close removes the heartbeat
    stats = json.loads(cli(db, "stats", "--json").stdout)
    assert stats["serving"] is False and stats["engines"] == []
    assert f"no engine serves {db!r} now" in cli(db, "stats").stdout


def test_the_overview_shows_the_serving_engine_or_that_none_serves(db: str) -> None:
    async def overview() -> str:
        dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
        transport = httpx.ASGITransport(app=dash.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as web:
            r = await web.get("/")
            assert r.status_code == 200
            return r.text

    page = trio.run(overview)
    assert 'id="no-engine"' in page and "No engine serves this store now" in page
    child = _served.start(db, "svc")
    try:
        page = trio.run(overview)
        assert 'id="no-engine"' not in page
        assert f"{child.pid}@{socket.gethostname()}" in page and "alive" in page
    finally:
        _served.stop(child)


# ------------------------------------------------------------------------- no engine serving


def test_with_no_engine_serving_the_client_acts_itself_and_a_start_waits_for_the_next(
    db: str,
) -> None:
    async def before() -> None:
        async with flow.connect(db) as client:
            assert await client.start("order", flow_id="o1") == "o1"
            assert client.last is not None and client.last.pending  # no engine has the plan
            assert await client.get("o1") is None
            # a wake of an unknown flow, answered here: no engine is needed for it
            assert await client.wake("nobody") is flow.Delivery.UNKNOWN
            assert client.last is not None and not client.last.served
            assert client.last.applied_by is not None
            assert client.last.applied_by.startswith("client (pid")

    async def after() -> None:
        async with flow.connect(db) as client:
            snap = await client.get("o1")  # the next engine started it
            assert snap is not None and snap.state is flow.State.PARKED
            # and now no engine serves the file again: the client wakes it itself, the flow
            # runs when an engine next opens the file
            assert await client.wake("o1", "paid") is flow.Delivery.RESUMED
            assert client.last is not None and not client.last.served
            woken = await client.get("o1")
            assert woken is not None and woken.state is flow.State.RUNNING

    trio.run(before)
    child = _served.start(db, "svc")
    try:
        trio.run(lambda: _wait_state(db, "o1", flow.State.PARKED))  # applied at the engine's open
    finally:
        _served.stop(child)
    trio.run(after)


async def _parked(client: flow.Client, fid: str) -> None:
    """Until the flow parked (in the other process: read until it is, at most 30 s)."""
    with trio.fail_after(30):
        # another process writes it: no event of this one to wait on
        while (snap := await client.get(fid)) is None or snap.state is not flow.State.PARKED:  # noqa: ASYNC110
            await trio.sleep(0.01)


async def _wait_state(path: str, fid: str, state: flow.State) -> None:
    async with flow.connect(path) as client:
        with trio.fail_after(30):
            while (snap := await client.get(fid)) is None or snap.state is not state:  # noqa: ASYNC110
                await trio.sleep(0.01)


# ---------------------------------------------------------- the serving engine dies, a retry


def test_a_request_pending_when_the_engine_died_is_applied_once_by_the_next(db: str) -> None:
    child = _served.start(db, "svc")

    async def park() -> None:
        async with flow.connect(db) as client:
            await client.start("order", flow_id="o1")
            await _parked(client, "o1")

    trio.run(park)
    os.kill(child.pid, signal.SIGSTOP)  # it holds the file and answers nothing

    async def ask(within: float) -> flow.Delivery:
        async with flow.connect(db, timeout=within) as client:
            return await client.wake("o1", {"paid": 1}, request_id="r-1")

    try:
        with pytest.raises(trio.TooSlowError, match="the request is stored"):
            trio.run(ask, 0.3)
    finally:
        _served.kill(child)
    assert requests_stored(db) == 2 and pending(db) == ["r-1"]  # the start, answered; the wake
    child = _served.start(db, "svc-2")  # applies the pending wake at its open
    try:
        assert trio.run(ask, 30.0) is flow.Delivery.RESUMED  # the retry finds its answer

        async def check() -> None:
            async with flow.connect(db) as client:
                done = await client.wait("o1", timeout=30)
                assert done.state is flow.State.COMPLETED
                kinds = [e.kind for e in await client.history("o1")]
                assert kinds.count("woken") == 1, kinds
                # the same request id again: its stored answer, nothing applied again
                again = await client.wake("o1", {"paid": 1}, request_id="r-1")
                assert again is flow.Delivery.RESUMED and client.last is not None
                assert client.last.applied_by == "svc-2"

        trio.run(check)
    finally:
        _served.stop(child)


def test_a_request_id_used_for_other_arguments_is_refused_and_nothing_stored(
    db: str, service: subprocess.Popen[str]
) -> None:
    async def main() -> None:
        async with flow.connect(db) as client:
            await client.start("order", flow_id="o1", request_id="r-1")
            n = requests_stored(db)
            with pytest.raises(ValueError, match="request_id 'r-1' was used for another"):
                await client.start("order", flow_id="o2", request_id="r-1")
            with pytest.raises(ValueError, match="was used for another"):
                await client.cancel("o1", request_id="r-1")
            assert requests_stored(db) == n and await client.get("o2") is None

    trio.run(main)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c: c.wake(42), TypeError, "flow_id must be a str"),
        (lambda c: c.wake("o1", {1, 2}), TypeError, "payload must be JSON"),
        (lambda c: c.wake("o1", "\ud800"), ValueError, "payload"),
        (lambda c: c.wake("o1", _deep(70)), ValueError, "nested deeper than 64"),
        (lambda c: c.wake("o1", message_id=""), ValueError, "message_id must not be empty"),
        (lambda c: c.start(3), TypeError, "plan must be a flow.Plan or a plan's name"),
        (lambda c: c.start("order", data=[1]), TypeError, "data must be a JSON object"),
        (lambda c: c.start("order", flow_id="\udfff"), ValueError, "flow_id"),
        (lambda c: c.cancel("o1", reason=b"x"), TypeError, "reason must be a str"),
        (lambda c: c.abandon("o1", reason=" "), ValueError, "reason must say something"),
        (lambda c: c.publish(1, {}), TypeError, "event_type must be a str"),
        (lambda c: c.resume("o1", request_id=""), ValueError, "request_id must say"),
        (lambda c: c.resume("o1", request_id=7), TypeError, "request_id must be a str"),
    ],
)
def test_a_malformed_request_is_refused_at_the_call_and_never_stored(
    db: str, call: Any, error: type[Exception], message: str
) -> None:
    before = requests_stored(db)

    async def main() -> None:
        async with flow.connect(db) as client:
            with pytest.raises(error, match=message):
                await call(client)

    trio.run(main)
    assert requests_stored(db) == before


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def test_connect_refuses_what_is_no_flow_store(tmp_path: Path) -> None:
    async def main(path: object, **options: Any) -> None:
        async with flow.connect(path, **options):  # type: ignore[arg-type]
            pass

    with pytest.raises(FileNotFoundError, match="never creates one"):
        trio.run(main, str(tmp_path / "missing.db"))
    assert not (tmp_path / "missing.db").exists()
    sqlite3.connect(tmp_path / "other.db").close()
    with pytest.raises(ValueError, match="no flow engine has opened it"):
        trio.run(main, str(tmp_path / "other.db"))
    with pytest.raises(TypeError, match="store must be a path"):
        trio.run(main, 42)
    with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
        trio.run(partial_main(main, str(tmp_path / "other.db"), timeout=0))


def partial_main(fn: Any, *args: Any, **kwargs: Any) -> Any:
    async def run() -> None:
        await fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------------------- PostgreSQL


def test_on_postgres_a_served_store_applies_the_clients_requests(pg_server: pg.PgServer) -> None:
    dsn = pg_server.fresh_schema_dsn()
    _served.stop(_served.start(dsn, "maker"))

    async def without_engine() -> None:
        async with PostgresStore(dsn, connections=1) as store, flow.connect(store) as client:
            assert await client.start("order", flow_id="o1") == "o1"
            assert client.last is not None and client.last.pending

    trio.run(without_engine)
    child = _served.start(dsn, "svc")
    try:

        async def served() -> None:
            async with PostgresStore(dsn, connections=1) as store, flow.connect(store) as client:
                await _parked(client, "o1")  # started by the engine at its open
                assert await client.wake("o1", "paid") is flow.Delivery.RESUMED
                assert client.last is not None and client.last.served
                assert client.last.applied_by == "svc"
                assert (await client.wait("o1", timeout=30)).state is flow.State.COMPLETED
                await client.start("order", flow_id="o2")
                assert await client.cancel("o2") is True
                with pytest.raises(flow.UnknownPlan):
                    await client.start("nope")

        trio.run(served)
    finally:
        _served.stop(child)


# ------------------------------------------------------------------ told, not polled (SQLite)


def test_a_request_and_its_answer_are_noticed_by_the_file_changing_not_by_a_timer(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every timer that could stand in for the notice is an hour long here: the engine's
    heartbeat (its watch thread's only timed wake-up), the client's look at the store once a
    second and its look at whether the engine went away. The engine (in this process, which
    changes nothing: the client reads the file) applies each request, and the client reads
    each answer, within seconds all the same: the file's writes (inotify) and its
    data_version told them. (Checked: with the -wal left unwatched it fails after 20 s.)"""
    from ferry.flow._engine import _client
    from ferry.flow._engine import _served as served

    monkeypatch.setattr(served, "RENEW", 3600.0)
    monkeypatch.setattr(_client, "_LOOK_AGAIN", 3600.0)
    monkeypatch.setattr(_client, "_RETRY_DIRECT", 3600.0)
    # A commit is visible (the wal-index: no event) a moment after its -wal write (the event):
    # who noticed the write reads data_version for at most SETTLE seconds after it. Under load
    # (two runs of the flow tests on 2 cores) the writing thread was once kept off the CPU for
    # longer than the 0.1 s default, and with every other look an hour away the answer was
    # never seen (TooSlowError). A long window costs nothing when the commit shows at once,
    # and it opens only at an event of the file: no timer stands in for the notice.
    monkeypatch.setattr(served, "SETTLE", 10.0)

    async def main() -> None:
        async with flow.open_engine(db, plans=[_served.order, _served.stuck], owner="svc"):
            async with flow.connect(db, timeout=3600) as client:
                with trio.fail_after(20):
                    for i in range(5):
                        assert await client.cancel(f"nobody-{i}") is False
                        assert client.last is not None and client.last.applied_by == "svc"

    trio.run(main)


def test_a_stored_request_that_is_no_request_is_answered_with_its_error(db: str) -> None:
    """Rows written by something other than a client (a body that is not JSON, not an object,
    an unknown kind) are answered with what is wrong with them, and the engine serves on.
    (Checked: a body that is not JSON ended the engine's block with a JSONDecodeError.)"""
    conn = sqlite3.connect(db)
    for rid, kind, body in (
        ("junk-1", "wake", "not json"),
        ("junk-2", "cancel", "[1, 2]"),
        ("junk-3", "explode", "{}"),
        ("junk-4", "resume", "{}"),
    ):
        conn.execute(
            "INSERT INTO flow_requests (request_id, kind, body, at) VALUES (?, ?, ?, 0)",
            (rid, kind, body),
        )
    conn.commit()

    async def main() -> None:
        async with flow.open_engine(db, plans=[_served.order], owner="svc"):
            async with flow.connect(db) as client:
                assert await client.cancel("nobody") is False  # it serves on
                assert client.last is not None and client.last.applied_by == "svc"

    trio.run(main)
    answers = dict(
        conn.execute("SELECT request_id, answer FROM flow_requests WHERE request_id LIKE 'junk%'")
    )
    conn.close()
    errors = {rid: json.loads(text)["error"] for rid, text in answers.items()}
    assert errors == {
        "junk-1": "JSONDecodeError",
        "junk-2": "ValueError",
        "junk-3": "ValueError",
        "junk-4": "KeyError",
    }


def test_retention_deletes_answered_requests_and_keeps_pending_ones(db: str) -> None:
    """Requests answered longer ago than `retain` go with the finished flows; a pending one
    stays, whatever its age. (Checked: nothing deleted them before.)"""
    conn = sqlite3.connect(db)
    conn.executemany(
        "INSERT INTO flow_requests (request_id, kind, body, at, answer, answered_at)"
        " VALUES (?, 'cancel', '{}', 0, ?, ?)",
        [("old", '{"value": false}', 0.0), ("pending", None, None)],
    )
    conn.commit()

    async def main() -> None:
        async with flow.open_engine(db, plans=[_served.order], retain=3600):
            with trio.fail_after(20):
                while requests_stored(db) > 1:  # noqa: ASYNC110 (retention's first round)
                    await trio.sleep(0.01)

    trio.run(main)
    assert [r[0] for r in conn.execute("SELECT request_id FROM flow_requests")] == ["pending"]
    conn.close()
