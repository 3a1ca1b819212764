"""``purge`` keeps what it is told to keep and gives the space back: a cutoff in the future is
refused (it would delete every finished flow, also those that end from now on), ``--plan`` and
``--state`` narrow what is deleted (failed flows kept longer than completed ones), and on
SQLite the file shrinks by what was deleted."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
import trio

from ferry import flow
from ferry.flow._model import _times

from ._helpers import _InlineTx
from .test_inspect import T0, populate, run, run_json
from .test_inspect_purge import ALL, ids


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    populate(_InlineTx(conn))
    conn.execute("COMMIT")
    conn.close()
    return path


@pytest.mark.parametrize("when", ["2999-01-01", "2999-01-01T00:00:00Z"])
def test_a_cutoff_in_the_future_is_refused(
    db: str, when: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, db, "purge", "--finished-before", when, "--yes")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "is in the future" in err
    assert ids(db) == ALL


def test_state_and_plan_narrow_the_purge(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = _times.iso(T0 + 1)
    report = run_json(
        capsys, db, "purge", "--finished-before", before, "--state", "FAILED", "--yes"
    )
    assert (report["matched"], report["deleted"], report["state"]) == (1, 1, "FAILED")
    assert ids(db) == [fid for fid in ALL if fid != "failed"]
    code, out, _ = run(capsys, db, "purge", "--finished-before", before, "--plan", "refund")
    assert (code, out) == (
        0,
        f"no finished flow of plan 'refund' ended before {before}: nothing to delete\n",
    )
    code, out, _ = run(capsys, db, "purge", "--finished-before", before, "--plan", "order", "--yes")
    assert (code, out) == (
        0,
        f"deleted 1 finished flows of plan 'order' that ended before {before}\n",
    )
    assert ids(db) == [fid for fid in ALL if fid not in ("failed", "done")]


def test_a_bad_state_is_one_line(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, db, "purge", "--finished-before", "7d", "--state", "BLOCKED")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "invalid choice: 'BLOCKED'" in err
    assert ids(db) == ALL


def size(path: str) -> int:
    return os.path.getsize(path)


def pages(path: str) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        count = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    finally:
        conn.close()
    return count, free


async def test_the_sqlite_file_shrinks_by_what_a_purge_deletes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "app.db")
    plan = flow.Plan("bulky")

    @plan.step
    async def only(ctx: flow.Context) -> None:
        ctx.data["blob"] = "x" * 8000

    async with flow.open_engine(path, plans=[plan]) as engine:
        for i in range(300):
            await engine.start(plan, flow_id=f"f{i}", data={})
        for i in range(300):
            await engine.wait(f"f{i}", timeout=60)
    full, _ = pages(path)
    size_full = size(path)
    code, _out, err = await trio.to_thread.run_sync(
        run, capsys, path, "purge", "--finished-before", "0s", "--yes"
    )
    assert code == 0, err
    emptied, free = pages(path)
    assert free == 0
    assert emptied < full / 5, (full, emptied)
    assert size(path) < size_full / 5
