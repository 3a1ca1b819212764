"""examples/orders.py runs as a script, as a user would run it: on SQLite, with a SIGKILL of
its engine process mid-run, on the suite's PostgreSQL, and with bad flags."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import pg

ROOT = Path(__file__).resolve().parents[2]


def orders(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "orders.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )


def summary(*args: str) -> dict[str, Any]:
    done = orders("--json", *args)
    assert done.returncode == 0, done.stderr + done.stdout
    report: dict[str, Any] = json.loads(done.stdout)
    print(json.dumps({k: v for k, v in report.items() if k != "legend"}))
    assert report["audit"] == {"ok": True, "problems": []}
    started = report["orders"].pop("started")
    assert sum(report["orders"].values()) == started
    assert set(report["orders"]) <= {"COMPLETED", "FAILED"}
    assert set(report["legend"]) >= {k for k in report if k != "legend"}  # it explains itself
    assert not [k for k in keys(report) if not k.replace("_", "").isalnum()]  # snake_case
    return report


def keys(value: object) -> list[str]:
    """Every key of a JSON value, nested ones included."""
    if isinstance(value, dict):
        return [k for k, v in value.items() for k in [k, *keys(v)]]
    if isinstance(value, list):
        return [k for v in value for k in keys(v)]
    return []


def test_the_default_run_audits_clean_and_explains_its_summary(tmp_path: Path) -> None:
    done = orders("--db", str(tmp_path / "orders.db"))
    assert done.returncode == 0, done.stderr
    assert "audit             OK" in done.stdout
    db = tmp_path / "orders.db"
    assert f"store             {db} (kept: python -m ferry.flow {db} list" in done.stdout
    assert "legend:" in done.stdout and "repeats absorbed" in done.stdout
    assert done.stdout.startswith("orders: 200 orders arriving over 1.3 s (150/s), SQLite ")
    assert "settled" in done.stderr  # the progress line
    assert "auditing 200 orders ..." in done.stderr  # and what comes after it
    # the legend explains the lines shown, and only those: no --metrics-port, no --trace, no note
    summary, legend = done.stdout.split("\n  legend:\n")
    named = {line[4:22].strip() for line in legend.splitlines() if line[4:5] != " "}
    shown = {line[2:20].strip() for line in summary.splitlines()[1:] if line[2:3] != " "}
    assert named == shown - {""}, (named, shown)
    assert not {"metrics", "trace", "note"} & named


def test_the_store_is_kept_with_db_and_the_inspector_finds_its_orders(tmp_path: Path) -> None:
    """What the README tells a newcomer: after the demo, ``python -m ferry.flow orders.db list``."""
    db = tmp_path / "orders.db"
    report = summary("--db", str(db), "--orders", "20", "--quiet")
    assert report["store"] == {"kind": "sqlite", "path": str(db), "kept": True}
    listed = subprocess.run(
        [sys.executable, "-m", "ferry.flow", str(db), "list", "--json", "--limit", "100"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=True,
    )
    assert listed.stdout.count('"plan": "order"') == 20


def test_without_db_the_summary_says_the_store_is_gone() -> None:
    report = summary("--orders", "5", "--quiet")
    assert report["store"]["kept"] is False
    assert not Path(report["store"]["path"]).exists()


def test_make_demo_keeps_the_orders_store_where_the_readme_looks() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "examples/orders.py --db orders.db" in makefile
    assert "python -m ferry.flow orders.db" in (ROOT / "README.md").read_text()


def test_metrics_port_serves_the_engines_metrics_while_it_runs() -> None:
    """The run scrapes its own endpoint once at the end: what it counted is what the engine
    did (the step attempts), and the server was on 127.0.0.1."""
    report = summary("--orders", "20", "--quiet", "--metrics-port", "0")
    served = report["metrics"]
    assert served["url"].startswith("http://127.0.0.1:") and served["url"].endswith("/metrics")
    assert served["families"] >= 10
    assert served["steps_total"] == report["steps"]["run"] > 0


def test_the_summary_counts_every_kind_of_wake(tmp_path: Path) -> None:
    report = summary("--db", str(tmp_path / "orders.db"), "--quiet")
    wakes = report["wakes"]
    assert wakes["RESUMED"] > 0 and wakes["QUEUED"] > 0 and wakes["DUPLICATE"] > 0
    assert report["compensations"] > 0 and report["crash"]["kills"] == 0
    assert report["writes"]["boundaries"] >= report["writes"]["transactions"]


def test_the_audit_holds_after_a_sigkill_of_the_engine(tmp_path: Path) -> None:
    """The kill lands right after one order's charge, before its step returned: the restarted
    engine charges it again and the repeat is absorbed; the progress line's counts, across the
    restart, end where the summary's do."""
    done = orders("--db", str(tmp_path / "orders.db"), "--crash", "--seed", "2")
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    assert "was just charged, and its charge step had not returned" in out
    assert "audit             OK" in out
    assert "crash             kills 1" in out
    absorbed = int(re.search(r"repeats absorbed  ([\d,]+)", out)[1].replace(",", ""))  # type: ignore[index]
    assert absorbed >= 1
    completed = re.search(r"COMPLETED ([\d,]+)   FAILED ([\d,]+)", out)
    assert completed is not None
    last = done.stderr.strip().splitlines()
    progress = [line for line in last if "settled" in line][-1]
    assert f"completed {int(completed[1].replace(',', '')):>4}" in progress, progress
    assert f"failed {int(completed[2].replace(',', '')):>4}" in progress, progress
    assert progress.lstrip().startswith("200/200 settled")


def test_postgres(pg_server: pg.PgServer) -> None:
    report = summary("--postgres", pg_server.fresh_schema_dsn("orders"), "--orders", "100")
    assert report["orders"]["COMPLETED"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--orders", "many"], "argument --orders: expected an integer, got 'many'"),
        (["--orders", "0"], "argument --orders: must be between 1 and 100000, got 0"),
        (["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
        (["--rate", "0"], "argument --rate: must be between 1 and 1e+06, got 0"),
        (["--timeout", "x"], "argument --timeout: expected a number, got 'x'"),
        (["--db", "x.db", "--postgres", "host=127.0.0.1 port=1"], "not allowed with argument"),
        (["--postgres", "host=127.0.0.1 port=1"], "argument --postgres: cannot connect"),
        (["--postgres", "nonsense=1"], "--postgres: not a connection string"),
        (["--db", "/nonexistent/dir/orders.db"], "no such directory"),
        (["--db", str(ROOT)], "is a directory: give a file's path"),
        (["--worker"], "--worker is the engine process that --crash starts: use --crash"),
    ],
)
def test_a_bad_flag_is_a_one_line_error(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In this process (the script's `main`, as `python examples/orders.py` calls it; the
    first case also as a script, below): a process each would cost a second apiece."""
    from examples import orders as demo

    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / "orders.py")])  # the error's name
    with pytest.raises(SystemExit) as exit_:
        demo.main(args)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith("orders.py: error: ") and message in line, line


def test_a_bad_flag_given_to_the_script_is_a_one_line_error() -> None:
    done = orders("--bogus")
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line == "orders.py: error: unrecognized arguments: --bogus (see --help)", line


def test_a_database_another_engine_serves_is_a_one_line_error(tmp_path: Path) -> None:
    db = tmp_path / "orders.db"
    fd = os.open(db, os.O_RDWR | os.O_CREAT, 0o644)  # the lock is on the database file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as an engine serving the file does
        done = orders("--db", str(db), "--orders", "1", "--quiet")
    finally:
        os.close(fd)
    assert (done.returncode, done.stdout.count("\n")) == (2, 1)  # the header line only
    (line,) = done.stderr.splitlines()
    assert line == (
        f"orders.py: error: another engine is serving {db} right now (another orders.py?): wait"
        " for it to finish, or give another --db"
    )


def test_the_summary_notes_when_the_machine_could_not_keep_up() -> None:
    from examples import orders as demo

    made = demo.make_orders(100, seed=1, run="r", rate=100.0)
    by_design = sum(1 for o in made if o.gateway in ("never", "late"))
    shop = demo.Shop(None, "r", {o.order_id: o for o in made}, 1.5, 0.0)  # type: ignore[arg-type]
    checked = demo.Audit()
    checked.reasons["no_answer"] = by_design
    assert demo.overload(shop, checked) == {}
    checked.reasons["no_answer"] = by_design + 7
    (note,) = demo.overload(shop, checked).values()
    assert note.startswith(
        f"7 more orders timed out than the gateway left unanswered ({by_design})"
    )
    assert "try a lower --rate or a longer --timeout" in note
