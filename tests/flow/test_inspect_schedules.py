"""The inspector's ``schedules`` and ``schedule pause|unpause|trigger NAME`` (SPEC 5.9), as a
table and as JSON: the list read from the file without an engine; the actions through a client
(`flow.connect`: here no engine serves the file, so the command applies them itself through an
operator's engine, which triggers with the plan shapes the store recorded, and the next engine
runs the triggered flow); an unknown name is one line and exit status 1, an unknown action a
usage error (2); a store without schedules says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from ferry import flow
from ferry.flow._ops import _inspect

report = flow.Plan("report", version=1)


@report.step
async def write(ctx: flow.Context) -> None:
    pass


NIGHTLY = flow.Schedule("nightly", report, cron="0 3 * * *", timezone="Europe/Warsaw")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = _inspect.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_schedules_are_listed_paused_unpaused_and_triggered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "app.db")

    async def declare() -> None:
        async with flow.open_engine(db, [report], schedules=[NIGHTLY]):
            pass

    trio.run(declare)
    code, out, _ = run(capsys, db, "schedules")
    assert code == 0
    assert out.splitlines()[0].split() == [
        "NAME",
        "PLAN",
        "CRON",
        "TIMEZONE",
        "NEXT",
        "TICK",
        "LAST",
        "TICK",
        "LAST",
        "FLOW",
        "PAUSED",
        "MISSED",
        "SKIPPED",
    ]
    assert "nightly  report v1  0 3 * * *  Europe/Warsaw" in out
    (listed,) = run_json(capsys, db, "schedules")["schedules"]
    assert listed["next_tick"].endswith(("T02:00:00Z", "T01:00:00Z"))  # 03:00 Warsaw
    assert listed["last_flow"] is None and not listed["paused"]
    assert (listed["missed"], listed["skipped"], listed["overlap"]) == (0, 0, "skip")

    paused = run_json(capsys, db, "schedule", "pause", "nightly")
    assert paused["action"] == "pause"
    assert run_json(capsys, db, "schedules")["schedules"][0]["paused"] is True
    code, out, _ = run(capsys, db, "schedule", "unpause", "nightly")
    assert code == 0 and "unpaused" in out
    assert run_json(capsys, db, "schedules")["schedules"][0]["paused"] is False

    triggered = run_json(capsys, db, "schedule", "trigger", "nightly")
    fid = triggered["flow_id"]
    assert fid.startswith("nightly@")
    assert run_json(capsys, db, "schedules")["schedules"][0]["last_flow"] == fid
    code, out, _ = run(capsys, db, "show", fid)
    assert code == 0 and "RUNNING" in out, "no engine serves the file: it has not run yet"

    async def runs_it() -> flow.Snapshot:  # the next engine to open the file runs it
        async with flow.open_engine(db, [report], schedules=[NIGHTLY]) as engine:
            return await engine.wait(fid, timeout=10)

    assert trio.run(runs_it).state is flow.State.COMPLETED


def test_an_unknown_schedule_is_one_line_and_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "app.db")

    async def made() -> None:
        async with flow.open_engine(db, [report]):
            pass

    trio.run(made)
    code, out, err = run(capsys, db, "schedules")
    assert (code, out.strip()) == (0, f"no schedule is stored in {db!r}")
    for action in ("pause", "unpause", "trigger"):
        code, out, err = run(capsys, db, "schedule", action, "nope")
        assert code == 1 and out == ""
        assert err.strip() == (
            f"python -m ferry.flow: error: no schedule named 'nope' is stored in {db!r}"
        )
    code, _, err = run(capsys, db, "schedule", "stop", "nightly")
    assert code == 2 and "invalid choice" in err
