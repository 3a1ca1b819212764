"""The flow inspector, ``python -m ferry.flow STORE COMMAND`` (ADR 0044): each subcommand, as a
table and as JSON, on SQLite (and a read and an action on PostgreSQL); operator actions through an
operator's engine (no plans); what happens while a service engine holds an SQLite file; bad
arguments as one-line errors.

The stores are filled through the store module (`populate`), with flows in every state.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from ferry.flow._model import _holders
from ferry.flow._model import _machine as m
from ferry.flow._model._checks import fail, park
from ferry.flow._model._types import CONTINUE, State
from ferry.flow._model._values import Flow, Mailbox, Shape, Transition
from ferry.flow._ops import _inspect, _inspect_read
from ferry.flow._store import _batch, _op, _schema, _store
from ferry.projected import PostgresStore
from tests import pg

from ._helpers import _InlineTx

T0 = 1_700_000_000.0
PARK_FOR = 2_000_000_000.0  # seconds: the "parked" flow's deadline is after 2080
ORDER = Shape("order", 1, ("reserve", "charge", "ship"), (True, True, False), (3, 3, 3))
REFUND = Shape("refund", 2, ("pay",), (False,), (1,))
ROOT = Path(__file__).resolve().parents[2]


def populate(tx: Any) -> None:
    """Flows in every state: running, parked (two, one older), completed, failed, blocked (twice,
    one reason), and a running flow of another plan held by a gone engine (an orphan)."""
    _schema.create_schema(tx)
    _store.register_plans(tx, [ORDER, REFUND], T0)
    _store.heartbeat(tx, "svc", T0 + 10**9, T0)  # a service engine, alive

    def write(*ops: _op.Op) -> list[_op.Result]:
        return _batch.write_batch(tx, ops)

    def started(fid: str, at: float, shape: Shape = ORDER, owner: str | None = "svc") -> Flow:
        (r,) = write(_op.Create(m.start(shape, fid, '{"sku":"A1"}', at, owner=owner)))
        assert isinstance(r, _op.Created)
        return r.transition.flow

    def step(f: Flow, outcome: Any, at: float) -> Flow:
        def apply(flow: Flow, box: Mailbox) -> Transition:
            return _holders.assign_holder(
                m.step_done(flow, box, ORDER, outcome, flow.data, at),
                flow,
                "svc",
                keep_runner=False,
            )

        (r,) = write(_op.Change(f.flow_id, apply, flow=f, first_queued=True))
        assert isinstance(r, _op.Changed)
        return r.transition.flow

    started("running", T0 + 5)
    # a deadline decades ahead: a wake at or after it would meet the timeout first
    step(step(started("parked", T0 + 3), CONTINUE, T0 + 3), park(PARK_FOR), T0 + 3)
    step(step(started("parked-old", T0 + 1), CONTINUE, T0 + 1), park(None), T0 + 1)
    done = step(step(started("done", T0), CONTINUE, T0), CONTINUE, T0)
    step(done, CONTINUE, T0)
    step(started("failed", T0), fail("no stock"), T0)
    for fid in ("blocked", "blocked-2"):
        f = step(started(fid, T0 + 2), CONTINUE, T0 + 2)
        f = step(f, fail("declined"), T0 + 2)
        (r,) = write(
            _op.Change(fid, lambda fl, _b: m.compensation_failed(fl, "refund down", T0 + 2))
        )
        assert isinstance(r, _op.Changed)
    started("orphan", T0 + 4, REFUND, owner="gone")


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    populate(_InlineTx(conn))
    conn.execute("COMMIT")
    conn.close()
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = _inspect.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def state(path: str, fid: str) -> Flow:
    conn = sqlite3.connect(path)
    try:
        f = _store.load(_InlineTx(conn), fid)
    finally:
        conn.close()
    assert f is not None
    return f


# ------------------------------------------------------------------------------------ reading


def test_list(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, db, "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "FLOW",
        "PLAN",
        "STATE",
        "STEP",
        "REV",
        "UPDATED",
        "OWNER",
        "ERROR",
    ]
    assert lines[2].split()[:4] == ["running", "order@1", "RUNNING", "0:reserve"]  # newest
    assert len(lines) == 2 + 8
    parked = run_json(capsys, db, "list", "--state", "parked")["flows"]
    assert [f["flow_id"] for f in parked] == ["parked", "parked-old"]
    assert parked[0]["step"] == "charge" and parked[0]["park_deadline"] == T0 + 3 + PARK_FOR
    refund = run_json(capsys, db, "list", "--plan", "refund")["flows"]
    assert [f["flow_id"] for f in refund] == ["orphan"]
    assert len(run_json(capsys, db, "list", "--limit", "2")["flows"]) == 2
    assert run(capsys, db, "list", "--plan", "nope")[1] == "no flows match\n"


def test_show(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, db, "show", "blocked")
    assert code == 0
    assert "state     BLOCKED" in out
    assert "compensation of step 'reserve' failed: refund down" in out
    history = out.split("\n\n")[1].splitlines()
    assert history[0].split() == ["REV", "AT", "KIND", "STEP", "ATTEMPT", "DETAIL"]
    assert [line.split()[2] for line in history[2:]] == [
        "started",
        "step",
        "step",
        "blocked",
    ]
    shown = run_json(capsys, db, "show", "orphan")
    assert shown["flow"]["state"] == "RUNNING" and shown["held"] is None  # SQLite: no leases
    assert [e["kind"] for e in shown["history"]] == ["started"]
    text = run(capsys, db, "show", "orphan")[1]
    assert "engine    the engine that holds the file runs it" in text and "lapsed" not in text
    code, out, err = run(capsys, db, "show", "nope")
    assert (code, out) == (1, "")
    assert err == f"python -m ferry.flow: error: no flow has id 'nope' in {db!r}\n"


def test_show_gives_deadlines_as_times_with_the_time_left_and_whole_details(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's complaints: raw epoch seconds, and a DETAIL column cut at 60 characters."""
    code, out, _ = run(capsys, db, "show", "parked")
    assert code == 0
    deadline = T0 + 3 + PARK_FOR  # decades ahead (a wake before it resumes the flow)
    when = datetime.fromtimestamp(deadline, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    (line,) = [line for line in out.splitlines() if line.startswith("deadline")]
    assert line.startswith(f"deadline  {when} (in ") and line.endswith(
        "); then compensate (on timeout)"
    )
    (parked,) = [line for line in out.splitlines() if " parked " in line]
    assert f'"deadline": "{when} (' in parked and str(deadline) not in parked
    code, out, _ = run(capsys, db, "show", "blocked")
    (blocked,) = [line for line in out.splitlines() if " blocked " in line]
    detail = json.dumps({"reason": state(db, "blocked").blocked})
    assert len(detail) > 60 and detail in blocked and "…" not in blocked


def test_left_reads_like_a_clock() -> None:
    assert _inspect_read._left(100.0, 40.0) == "in 1m 0s"
    assert _inspect_read._left(0.0, 7322.0) == "2h 2m ago"
    assert _inspect_read._left(3 * 86400 + 7200, 0.0) == "in 3d 2h"
    assert _inspect_read._left(5.4, 0.0) == "in 5s"


def test_stats(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, db, "stats")
    assert code == 0
    assert "running flows no engine holds (orphans): 0" in out  # SQLite: one engine holds all
    assert "oldest parked" in out and out.index("parked-old") < out.index("parked ")
    assert "compensation of step 'reserve' failed: refund down" in out
    legend = out.split("\nlegend\n")[1].splitlines()
    assert [line.split()[0] for line in legend] == [
        "orphans",
        "PLAN",
        "SINCE",
        "DEADLINE",
        "ERROR",
        "FIRST",
        "E.G.",
        "LEASE",
        "FLOWS",
    ]
    s = run_json(capsys, db, "stats", "--oldest", "1")
    assert s["states"] == {
        "RUNNING": 2,
        "PARKED": 2,
        "COMPENSATING": 0,
        "COMPLETED": 1,
        "FAILED": 1,
        "BLOCKED": 2,
        "QUEUED": 0,  # flow control's state (SPEC 5.8)
    }
    assert s["plans"]["refund@2"]["RUNNING"] == 1 and s["orphans"] == 0
    assert [p["flow_id"] for p in s["oldest_parked"]] == ["parked-old"]
    assert s["errors"]["groups"] == [
        {
            "state": "BLOCKED",
            "error": "compensation of step 'reserve' failed: refund down",
            "flows": 2,
            "first_seen": T0 + 2,
            "last_seen": T0 + 2,
            "examples": ["blocked", "blocked-2"],
            "match": "compensation of step 'reserve' failed: refund down",
        },
        {
            "state": "FAILED",
            "error": "no stock",
            "flows": 1,
            "first_seen": T0,
            "last_seen": T0,
            "examples": ["failed"],
            "match": "no stock",
        },
    ]
    assert s["errors"]["groups_left_out"] == 0 == s["errors"]["flows_not_grouped"]
    assert s["engines"][0]["owner"] == "svc" and s["engines"][0]["alive"]
    assert [(p["plan"], p["version"]) for p in s["registered_plans"]] == [
        ("order", 1),
        ("refund", 2),
    ]


# ------------------------------------------------------------------------------------ actions


def test_wake(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, db, "wake", "parked", "--payload", '{"ok": true}', "--message-id", "m1"
    )
    assert code == 0
    assert out == (
        "RESUMED: it was parked and runs its next step: the next engine to open the file runs it\n"
    )
    f = state(db, "parked")
    assert (f.state, f.step, f.owner, json.loads(f.wake or "null")) == (
        State.RUNNING,
        "ship",
        None,
        {"ok": True},
    )
    again = run_json(capsys, db, "wake", "parked", "--message-id", "m1")
    assert again == {"flow_id": "parked", "delivery": "DUPLICATE", "state": "RUNNING"}
    assert run_json(capsys, db, "wake", "running")["delivery"] == "QUEUED"
    assert run_json(capsys, db, "wake", "done")["delivery"] == "STALE"
    code, _, err = run(capsys, db, "wake", "nope")
    assert code == 1 and err.count("\n") == 1 and "no flow has id 'nope'" in err
    code, _, err = run(capsys, db, "wake", "")  # the engine's own refusal, as it words it
    assert (code, err) == (1, "python -m ferry.flow: error: flow_id must not be empty\n")


def test_cancel(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, db, "cancel", "parked", "--reason", "customer")
    assert (code, out) == (
        0,
        "cancelled: it compensates; the next engine to open the file runs it\n",
    )
    f = state(db, "parked")
    assert (f.state, f.step, f.error, f.owner) == (State.COMPENSATING, "charge", "customer", None)
    running = run_json(capsys, db, "cancel", "running")
    assert running == {"flow_id": "running", "cancelled": True, "state": "FAILED"}
    code, _, err = run(capsys, db, "cancel", "done")
    assert code == 1 and "not cancelled: flow 'done' is COMPLETED" in err


def test_resume(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, db, "resume", "blocked")
    assert (code, out) == (0, "resumed: the next engine to open the file runs it\n")
    f = state(db, "blocked")
    assert (f.state, f.step, f.attempt) == (State.COMPENSATING, "reserve", 2)
    code, _, err = run(capsys, db, "resume", "running")
    assert code == 1 and "only a BLOCKED flow can be resumed" in err


@pytest.fixture
def service_lock(db: str) -> Iterator[None]:
    """Holds the file's engine lock, as a service engine serving it would."""
    fd = os.open(db, os.O_RDWR)  # the lock is on the database file itself
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        yield
    finally:
        os.close(fd)


def test_while_the_file_is_held_by_what_answers_no_request_an_action_is_stored_and_says_so(
    db: str, service_lock: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lock holder that serves no requests (the action's own wait is bounded by --timeout):
    the request is stored, the command says so in one line, and reads work meanwhile."""
    for action in (["wake", "parked"], ["cancel", "parked"], ["resume", "blocked"]):
        code, out, err = run(capsys, db, *action, "--timeout", "0.2")
        assert (code, out) == (1, "")
        assert "has not answered" in err and "the request is stored" in err, err
        assert err.count("\n") == 1
    assert state(db, "parked").state is State.PARKED  # nothing changed yet
    assert run(capsys, db, "list")[0] == 0
    assert run(capsys, db, "stats")[0] == 0


# --------------------------------------------------------------------------- bad arguments, help


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: STORE"),
        (["x.db"], "the following arguments are required: COMMAND"),
        (["x.db", "explode"], "invalid choice: 'explode'"),
        (["x.db", "list", "--state", "sleeping"], "no state 'sleeping'; one of RUNNING"),
        (["x.db", "list", "--limit", "0"], "'0' is not a whole number >= 1"),
        (["x.db", "wake", "f", "--payload", "{oops"], "not JSON"),
        (["x.db", "show"], "the following arguments are required: FLOW_ID"),
        (["x.db", "wake", "f", "--message-id", ""], "--message-id: must not be empty"),
    ],
)
def test_bad_arguments_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and message in err and "--help" in err


def test_a_store_that_is_not_there_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, str(tmp_path / "missing.db"), "list")
    assert code == 1 and err.count("\n") == 1 and "no such SQLite file" in err
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    code, _, err = run(capsys, str(empty), "stats")
    assert code == 1 and "holds no flows (no flow engine has opened it)" in err
    code, _, err = run(capsys, "host=127.0.0.1 port=1 dbname=nope connect_timeout=1", "list")
    assert code == 1 and err.count("\n") == 1 and "OperationalError" in err


def test_a_file_that_is_no_flow_store_is_one_line_and_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    (tmp_path / "empty.db").touch()
    (tmp_path / "notes.txt").write_text("not a database")
    cases = {
        str(other): "holds no flows (no flow engine has opened it)",
        str(
            tmp_path / "empty.db"
        ): "holds no flows (no flow engine has opened it): the file is empty",
        str(tmp_path / "notes.txt"): "is not an SQLite database",
        str(tmp_path): "is a directory",
    }
    for spec, message in cases.items():
        for command in ("list", "stats", "wake"):
            code, out, err = run(capsys, spec, command, *(["f"] if command == "wake" else []))
            assert (code, out) == (1, "")
            assert err.startswith(f"python -m ferry.flow: error: {spec!r} {message}"), err
            assert err.count("\n") == 1
    assert other.read_bytes() == before  # still in rollback-journal mode: not switched to WAL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db", "notes.txt", "other.db"]
    assert (tmp_path / "empty.db").read_bytes() == b""


def test_a_dsn_password_is_never_shown(capsys: pytest.CaptureFixture[str]) -> None:
    for dsn, shown in [
        ("host=127.0.0.1 port=1 password=hunter2 connect_timeout=1", "password=***"),
        ("postgresql://bob:hunter2@127.0.0.1:1/db?connect_timeout=1", "bob:***@"),
        ("postgresql://bob:hunter2@[::1", "bob:***@"),
    ]:
        code, _, err = run(capsys, dsn, "list")
        assert code == 1 and err.count("\n") == 1
        assert shown in err and "hunter2" not in err
    code, _, err = run(capsys, "a=b.db", "list")
    assert code == 1
    assert "'a=b.db' is neither an SQLite file (there is no such file) nor a PostgreSQL DSN" in err


def test_list_says_when_more_flows_match_than_it_shows(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, db, "list", "--limit", "3")
    assert code == 0 and len(out.splitlines()) == 2 + 3 + 1
    assert "(the first 3; more match: --limit N shows more, --after " in out
    assert "more match" not in run(capsys, db, "list", "--limit", "8")[1]  # exactly 8 flows
    # JSON is an object that says so, with the cursor of the next page; the pages add up.
    seen: list[str] = []
    cursor: list[str] = []
    for expected in (3, 3, 2):
        page = run_json(capsys, db, "list", "--limit", "3", *cursor)
        assert (page["count"], page["limit"], page["more"]) == (expected, 3, expected == 3)
        seen += [f["flow_id"] for f in page["flows"]]
        cursor = ["--after", page["next"]] if page["more"] else []
    assert page["next"] is None and len(seen) == len(set(seen)) == 8
    code, _, err = run(capsys, db, "list", "--after", "bogus")
    assert code == 2 and "argument --after: not a cursor of this listing" in err


def test_json_first_the_store_second_and_a_closed_pipe(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "--json", db, "list", "--limit", "1")
    assert code == 0 and len(json.loads(out)["flows"]) == 1
    code, out, _ = run(capsys, db, "--json", "stats")
    assert code == 0 and json.loads(out)["orphans"] == 0
    code, out, err = run(capsys, "show", db, "blocked")
    assert (code, out) == (2, "")
    assert err == (
        "python -m ferry.flow: error: the store comes first: python -m ferry.flow"
        f" {db} show ... (see python -m ferry.flow --help)\n"
    )
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written (as `| head` that quit)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ferry.flow", db, "list"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            check=False,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, "")


@pytest.mark.parametrize("command", [None, "list", "show", "stats", "wake", "cancel", "resume"])
def test_help_everywhere(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--help"] if command is None else ["x.db", command, "--help"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and out.startswith("usage: python -m ferry.flow")
    if command is not None:
        assert "--json" in out


def test_the_module_runs_as_a_command(db: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ferry.flow", db, "list", "--state", "BLOCKED"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[2:]] == ["blocked-2", "blocked"]


# ---------------------------------------------------------------------------------- PostgreSQL


def test_on_postgres_reads_and_an_action_leave_the_flow_to_the_fleet(
    pg_server: pg.PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = pg_server.fresh_schema_dsn()

    async def fill() -> None:
        async with PostgresStore(dsn, connections=1) as store:
            await store.transact(populate)

    async def svc(until: float) -> None:
        # `populate`'s live lease row names no engine that would answer a request: lapsed for
        # the action (no engine serves the store: the command applies it), alive again after
        async with PostgresStore(dsn, connections=1) as store:
            await store.transact(partial(_store.heartbeat, owner="svc", until=until, now=T0))

    trio.run(fill)
    listed = run_json(capsys, dsn, "list", "--state", "BLOCKED")["flows"]
    assert [f["flow_id"] for f in listed] == ["blocked-2", "blocked"]
    trio.run(svc, T0)
    code, out, _ = run(capsys, dsn, "wake", "parked", "--message-id", "m1")
    trio.run(svc, T0 + 10**9)
    assert (code, out) == (
        0,
        "RESUMED: it was parked and runs its next step: the next scan of an engine serving the"
        " store runs it\n",
    )
    shown = run_json(capsys, dsn, "show", "parked")
    assert shown["flow"]["state"] == "RUNNING" and shown["flow"]["owner"] is None
    assert run_json(capsys, dsn, "stats")["orphans"] == 2  # the gone engine's, and this one
    # `show` follows the rule `stats` counts with
    assert run_json(capsys, dsn, "show", "orphan")["held"]["lapsed"] is True
    assert run_json(capsys, dsn, "show", "running")["held"]["lapsed"] is False
    assert "(held)" in run(capsys, dsn, "show", "running")[1]


def test_on_postgres_a_schema_without_flows_is_one_line_and_stays_empty(
    pg_server: pg.PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = pg_server.fresh_schema_dsn()
    for command in (["list"], ["stats"], ["show", "f"], ["wake", "f"], ["cancel", "f"]):
        code, out, err = run(capsys, dsn, *command)
        assert (code, out) == (1, "")
        assert err.endswith("holds no flows (no flow engine has opened it)\n")

    async def tables() -> bool:
        async with PostgresStore(dsn, connections=1) as store:
            found: bool = await store.transact(_schema.has_tables)
        return found

    assert not trio.run(tables)  # nothing was created
