"""Numbers are range-checked where they come in: a huge whole number (``10**400``,
``99999999999999999999``), NaN, infinity or a negative number where none makes sense is refused
at the call, naming the field -- a `ValueError` from the API, a 400 from the dashboard, an
argument error (exit status 2) from the command line -- and never reaches the database.

Before, ``10**400`` had no float and raised a raw `OverflowError` (``open_engine(lease=,
retain=)``, ``Engine.wait(timeout=)``, ``flow.park(timeout=)``, a cursor), a version past 64
bits overflowed SQLite's integer (the dashboard answered 503 "database unavailable" and logged a
store warning; the inspector said "cannot use the SQLite file: OverflowError"), and a cursor
with NaN was taken for one.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import trio

from ferry import flow
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader
from ferry.flow._ops._inspect import main
from ferry.flow._store import _query

from .test_dashboard import TOKEN, client_of, fill, row

HUGE = 10**400
TWENTY_NINES = "99999999999999999999"  # past 64 bits


def short(value: object) -> str:
    """A test id: 10**400 as such, not as its 401 digits."""
    if isinstance(value, int) and abs(value) == HUGE:
        return "-10**400" if value < 0 else "10**400"
    return repr(value)


def cursor(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


BAD_CURSORS = {
    "10**400": cursor(f'["c",{HUGE},"x"]'),
    "NaN": cursor('["c",NaN,"x"]'),
    "Infinity": cursor('["c",-Infinity,"x"]'),
    "1e400": cursor('["c",1e400,"x"]'),
}


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")
    fill(path)
    return path


# ------------------------------------------------------------------------------ the dashboard


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"version": TWENTY_NINES}, "version"),
        ({"version": str(HUGE)}, "version"),
        ({"version": "0"}, "version"),
        ({"version": "-3"}, "version"),
        ({"version": "2147483648"}, "version"),
        ({"updated_after": "9" * 400 + "d"}, "updated_after"),
        ({"created_before": "1" + "0" * 400 + "s"}, "created_before"),
        *(({"after": c}, "not a cursor") for c in BAD_CURSORS.values()),
        ({"id_prefix": "a", "after": BAD_CURSORS["10**400"]}, "not a cursor"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
async def test_the_dashboards_list_refuses_numbers_out_of_range(
    db: str, params: dict[str, str], named: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ferry.flow")
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
    async with await client_of(dash) as web:
        r = await web.get("/flows", params=params)
    assert r.status_code == 400, r.text[:400]
    assert named in r.text
    assert not [rec for rec in caplog.records if "unavailable" in rec.getMessage()]


@pytest.mark.parametrize("payload", ["1e400", "-1e400", "[1, NaN]", '{"x": Infinity}'])
async def test_the_dashboards_wake_refuses_a_payload_out_of_range(db: str, payload: str) -> None:
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
    before = row(db, "parked")
    async with await client_of(dash) as web:
        r = await web.post("/flow/wake", data={"id": "parked", "token": TOKEN, "payload": payload})
    assert r.status_code == 400 and "the payload is not JSON" in r.text
    assert row(db, "parked") == before


@pytest.mark.parametrize("page_size", [0, -1, HUGE, 1001, 2.5], ids=short)
def test_the_dashboards_page_size_is_checked(db: str, page_size: Any) -> None:
    with pytest.raises(ValueError, match="page_size"):
        Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, page_size=page_size)


# ------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["list", "--version", TWENTY_NINES], "--version"),
        (["list", "--version", str(HUGE)], "--version"),
        (["list", "--version", "0"], "--version"),
        (["cancel", "--version", TWENTY_NINES], "--version"),
        (["list", "--limit", str(HUGE)], "--limit"),
        (["list", "--limit", "-1"], "--limit"),
        (["resume", "--state", "BLOCKED", "--limit", TWENTY_NINES], "--limit"),
        (["stats", "--oldest", TWENTY_NINES], "--oldest"),
        *((["list", "--after", c], "--after") for c in BAD_CURSORS.values()),
        (["list", "--since", "9" * 400 + "d"], "--since"),
        (["list", "--started-until", "1" + "0" * 400 + "h"], "--started-until"),
        (["purge", "--finished-before", "9" * 400 + "d", "--yes"], "--finished-before"),
        (["wake", "parked", "--payload", "1e400"], "--payload"),
        (["wake", "parked", "--payload", '{"x": -1e999}'], "--payload"),
    ],
    ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else "",
)
def test_the_command_line_refuses_numbers_out_of_range(
    db: str, argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = row(db, "parked")
    assert main([db, *argv]) == 2
    err = capsys.readouterr().err
    assert f"argument {named}" in err, err
    assert "OverflowError" not in err and len(err) < 600, err
    assert row(db, "parked") == before


# ------------------------------------------------------------------------------------ the API


def plan_that_parks(timeout: Any = None) -> flow.Plan:
    plan = flow.Plan("p")

    @plan.step
    async def one(ctx: flow.Context) -> flow.Outcome:
        return flow.park(timeout=timeout)

    return plan


@pytest.mark.parametrize("field", ["lease", "retain"])
@pytest.mark.parametrize("value", [HUGE, -HUGE, math.nan, math.inf, -1, 0], ids=short)
async def test_open_engine_refuses_numbers_out_of_range(
    tmp_path: Path, field: str, value: Any
) -> None:
    path = tmp_path / "flows.db"
    with pytest.raises(ValueError, match=f"^{field} must") as refused:
        async with flow.open_engine(str(path), [plan_that_parks()], **{field: value}):
            pass
    assert len(str(refused.value)) < 400
    assert not path.exists()  # refused before anything was made


@pytest.mark.parametrize("seconds", [HUGE, math.nan, -1, -HUGE], ids=short)
async def test_wait_refuses_a_timeout_out_of_range(tmp_path: Path, seconds: Any) -> None:
    plan = plan_that_parks()
    async with flow.open_engine(str(tmp_path / "flows.db"), [plan]) as engine:
        fid = await engine.start(plan)
        with pytest.raises(ValueError, match=r"^timeout must be") as refused:
            await engine.wait(fid, timeout=seconds)
        assert len(str(refused.value)) < 400
        with trio.move_on_after(0.01):  # None and inf are "for ever", as before
            await engine.wait(fid, timeout=math.inf)


@pytest.mark.parametrize("timeout", [HUGE, -HUGE, math.nan, math.inf, -1], ids=short)
def test_park_refuses_a_timeout_out_of_range(timeout: Any) -> None:
    with pytest.raises(ValueError, match=r"^park\(timeout=\.\.\.\) must be") as refused:
        flow.park(timeout=timeout)
    assert len(str(refused.value)) < 400


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("version", HUGE),
        ("version", 2**31),
        ("version", 0),
        ("created_after", HUGE),
        ("updated_before", -HUGE),
        ("updated_after", math.nan),
        ("created_before", math.inf),
    ],
    ids=short,
)
def test_a_flow_filter_refuses_numbers_out_of_range(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field} must") as refused:
        _query.FlowFilter(**{field: value})
    assert len(str(refused.value)) < 400


@pytest.mark.parametrize("after", BAD_CURSORS.values(), ids=BAD_CURSORS.keys())
def test_a_cursor_out_of_range_is_not_a_cursor(after: str) -> None:
    with pytest.raises(ValueError, match="not a cursor of this listing"):
        _query.page_sql(_query.FlowFilter(), "sqlite", after=after)
    with pytest.raises(ValueError, match="not a cursor of this listing"):
        _query.check_cursor(after)


@pytest.mark.parametrize("limit", [HUGE, 0, -1, 1001], ids=short)
def test_a_page_limit_out_of_range_is_refused(limit: int) -> None:
    with pytest.raises(ValueError, match=r"^limit must be between 1 and 1000") as refused:
        _query.page_sql(_query.FlowFilter(), "sqlite", limit=limit)
    assert len(str(refused.value)) < 400


def test_good_cursors_still_pass() -> None:
    assert _query.check_cursor(cursor('["c",1700000000.5,"x"]'))
    assert _query.check_cursor(cursor('["i","x"]'))
    assert json.loads(base64.urlsafe_b64decode(cursor('["i","x"]') + "==")) == ["i", "x"]
