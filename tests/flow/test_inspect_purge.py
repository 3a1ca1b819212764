"""The inspector's ``purge --finished-before TIME`` (ADR 0085): it counts, asks (or takes
``--yes``), deletes the finished flows that ended before TIME with their history and mailbox,
and reports the count as text or JSON; a time it cannot read is a one-line error. The store is
the inspector tests' (`populate`: flows in every state, written at T0 and a few seconds after).
"""

from __future__ import annotations

import io
import json
import sqlite3
import sys
from pathlib import Path

import pytest
import trio

from ferry import flow
from ferry.flow._model import _times
from ferry.projected import PostgresStore
from tests import pg

from ._helpers import _InlineTx
from .test_inspect import ROOT, T0, populate, run, run_json

ALL = ["blocked", "blocked-2", "done", "failed", "orphan", "parked", "parked-old", "running"]


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    populate(_InlineTx(conn))
    conn.execute("COMMIT")
    conn.close()
    return path


def ids(path: str) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [r[0] for r in conn.execute("SELECT flow_id FROM flow_flows ORDER BY flow_id")]
    finally:
        conn.close()


def rows_of(path: str, flow_id: str) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        return (
            conn.execute(
                "SELECT COUNT(*) FROM flow_history WHERE flow_id = ?", (flow_id,)
            ).fetchone()[0],
            conn.execute(
                "SELECT COUNT(*) FROM flow_mailbox WHERE flow_id = ?", (flow_id,)
            ).fetchone()[0],
        )
    finally:
        conn.close()


def test_purge_deletes_the_finished_flows_that_ended_before_the_time(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _times.iso(T0 + 1)
    # Nothing ended before T0: nothing to do, nothing asked.
    code, out, _ = run(capsys, db, "purge", "--finished-before", _times.iso(T0 - 60))
    assert (code, out) == (
        0,
        f"no finished flow ended before {_times.iso(T0 - 60)}: nothing to delete\n",
    )
    assert rows_of(db, "done")[0] > 0
    report = run_json(capsys, db, "purge", "--finished-before", before, "--yes")
    assert report == {
        "finished_before": before,
        "plan": None,
        "state": None,
        "matched": 2,
        "deleted": 2,
    }
    assert ids(db) == [fid for fid in ALL if fid not in ("done", "failed")]
    assert rows_of(db, "done") == rows_of(db, "failed") == (0, 0)
    # A relative age: everything finished is older than a day by now; there is nothing left.
    code, out, _ = run(capsys, db, "purge", "--finished-before", "1d", "--yes")
    assert code == 0 and out.startswith("no finished flow ended before ")


def test_purge_asks_first_and_deletes_nothing_unless_told_yes(
    db: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    code, out, err = run(capsys, db, "purge", "--finished-before", "2025-01-01")
    assert (code, out) == (0, "nothing deleted\n")
    assert (
        "delete 2 finished flows (COMPLETED or FAILED) that ended before 2025-01-01T00:00:00Z"
        in err
    )
    assert err.rstrip().endswith("[y/N]")
    assert ids(db) == ALL
    monkeypatch.setattr("sys.stdin", Terminal("y\n"))
    code, out, _ = run(capsys, db, "purge", "--finished-before", "2025-01-01")
    assert (code, out) == (0, "deleted 2 finished flows that ended before 2025-01-01T00:00:00Z\n")
    assert "done" not in ids(db)


def test_purge_without_a_terminal_needs_yes(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, db, "purge", "--finished-before", "7d")
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and "add --yes" in err
    assert ids(db) == ALL


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["purge"], "the following arguments are required: --finished-before"),
        (["purge", "--finished-before", "last tuesday"], "is not a time: give an ISO 8601"),
        (["purge", "--finished-before", "7y"], "or an age such as 7d"),
    ],
)
def test_a_bad_time_is_one_line(
    argv: list[str], message: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, db, *argv)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and message in err
    assert ids(db) == ALL


def test_purge_on_postgres(pg_server: pg.PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    dsn = pg_server.fresh_schema_dsn()

    async def fill() -> None:
        async with PostgresStore(dsn, connections=1) as store:
            await store.transact(populate)

    async def left() -> list[str]:
        async with PostgresStore(dsn, connections=1) as store:
            rows = await store.transact(lambda tx: tx.execute("SELECT flow_id FROM flow_flows"))
        return sorted(row[0] for row in rows)

    trio.run(fill)
    report = run_json(
        capsys, dsn, "purge", "--finished-before", "2025-01-01T00:00:00+00:00", "--yes"
    )
    assert report["deleted"] == 2
    assert trio.run(left) == [fid for fid in ALL if fid not in ("done", "failed")]


async def test_purge_beside_an_engine_that_serves_the_sqlite_file(tmp_path: Path) -> None:
    """The purge needs no engine lock: while an engine holds the file, a purge in another
    process deletes the finished flows, and the engine goes on writing."""
    path = tmp_path / "served.db"
    plan = flow.Plan("p")

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    async with flow.open_engine(path, plans=[plan], retain=None) as engine:
        for i in range(3):
            await engine.start(plan, flow_id=f"f{i}")
            await engine.wait(f"f{i}", timeout=30)
        purge = ["purge", "--finished-before", "0s", "--yes", "--json"]
        done = await trio.run_process(
            [sys.executable, "-m", "ferry.flow", str(path), *purge],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["deleted"] == 3
        assert await engine.get("f0") is None
        await engine.start(plan, flow_id="f0")  # the id is free, and the engine writes on
        assert (await engine.wait("f0", timeout=30)).state is flow.State.COMPLETED
