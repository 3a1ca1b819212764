"""examples/ledger.py runs small, as a user would run it, on SQLite and PostgreSQL; a planted
projection bug makes its verification fail and its exit code non-zero."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from examples import ledger as demo
from examples import ledger_domain
from ferry.projected import Record, Tx
from tests import pg

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("--ops", "800", "--clients", "60", "--accounts", "12", "--seed", "7")


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ledger.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        check=False,
    )


def test_demo_on_sqlite_with_faults_verifies(tmp_path: Path) -> None:
    done = run_demo(*SMALL, "--faults", "0.2", "--db", str(tmp_path / "l.db"))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "verification  OK" in out
    assert "all 800 acknowledged inputs are in the journal exactly once" in out
    failed = int(re.search(r"failed (\d+)", out.split("retries")[1]).group(1))  # type: ignore[union-attr]
    assert failed > 0  # the fault injection made clients retry, and nothing was lost or doubled
    assert re.search(r"p50 [\d.]+ ms", out)
    assert "inputs" in done.stderr  # progress lines (not a TTY: one plain line a second)


def test_demo_on_postgres_verifies(pg_server: pg.PgServer) -> None:
    done = run_demo(*SMALL, "--postgres", pg_server.fresh_database_dsn("demo"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verification  OK" in done.stdout


async def test_demo_fails_verification_on_a_planted_projection_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    right = ledger_domain.project

    def double_credits(view: Tx, key: str, records: Sequence[Record]) -> None:
        right(view, key, [*records, *(r for r in records if r.kind == "posting")])

    monkeypatch.setattr(ledger_domain, "project", double_credits)
    args = ["--ops", "300", "--clients", "20", "--accounts", "5", "--quiet", "--faults", "0"]
    code = await demo.main([*args, "--db", str(tmp_path / "bad.db")])
    out = capsys.readouterr().out
    assert code == 1
    assert "verification  FAILED" in out
    assert "fold of the journal" in out
