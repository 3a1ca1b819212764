"""examples/ledger.py runs small, as a user would run it, on SQLite and PostgreSQL; a planted
projection bug makes its verification fail and its exit code non-zero."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from examples import ledger as demo
from examples import ledger_domain
from ferry.projected import Record, Tx
from tests import pg
from tests.fleet._fleet import Service

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("--ops", "800", "--clients", "60", "--accounts", "12", "--seed", "7")


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script("ledger.py", *args)


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
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


def test_demo_summary_has_a_legend_and_json_has_the_same_figures(tmp_path: Path) -> None:
    tiny = ("--ops", "200", "--clients", "20", "--accounts", "6", "--seed", "7", "--quiet")
    table = run_demo(*tiny, "--ops", "20", "--db", str(tmp_path / "t.db"))
    assert table.returncode == 0, table.stdout + table.stderr
    legend = table.stdout.split("\n  legend\n")[1]
    for word in ("ok", "refused", "committed", "id_reused", "gave_up", "rejected", "failed"):
        assert f"{word} (" in legend, word
    for word in ("written:", "replayed:", "fence conflicts:", "injected faults:"):
        assert word in legend, word

    done = run_demo(*tiny, "--json", "--faults", "0.2", "--db", str(tmp_path / "j.db"))
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)  # stdout is the JSON object and nothing else
    assert summary["inputs"] == 200 and summary["verification"] == {"ok": True, "problems": []}
    assert sum(summary["outcomes"].values()) == 200
    assert summary["retries"]["failed"] > 0 and summary["journal"]["injected_faults"] > 0
    assert set(summary["latency_ms"]) == {"p50", "p95", "p99"}
    assert "ledger: 200 inputs" in done.stderr  # the header went to stderr


def test_demo_with_no_inputs_prints_no_nan(tmp_path: Path) -> None:
    for extra in ([], ["--json"]):
        done = run_demo("--ops", "0", "--quiet", *extra, "--db", str(tmp_path / f"{len(extra)}.db"))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "nan" not in done.stdout.lower()
    summary = json.loads(done.stdout)
    assert summary["latency_ms"] == {"p50": None, "p95": None, "p99": None}


async def test_service_help_shows_the_protocol_and_a_client_command_that_works(
    pg_server: pg.PgServer, tmp_path: Path
) -> None:
    help_text = run_script("ledger_service.py", "--help").stdout
    for outcome in ("ok", "refused", "committed", "rejected", "failed", "closed", "id_reused"):
        assert f"``{outcome}``" in help_text
    command = help_text.split("python examples/ledger_service.py --dsn")[-1].split("&\n", 1)[1]
    assert command.lstrip().startswith("echo '{")

    service = Service(0, pg_server.fresh_database_dsn("svc"), tmp_path, [])
    await service.start()
    try:
        shell = command.replace("7000", str(service.port))
        shell = shell.replace("python -c", f"{sys.executable} -c")
        done = await trio.run_process(["bash", "-c", shell], capture_stdout=True, check=True)
        reply = json.loads(done.stdout)
        assert reply["id"] == "c1-1" and reply["outcome"] == "ok", reply
    finally:
        service.stop()
