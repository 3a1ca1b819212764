"""The inspector's filters and bulk actions, through its command line (``list``, ``cancel``,
``resume``, ``wake`` with ``--state``, ``--plan``, ``--since``, ... and ``--yes``), on the store
of tests/flow/test_inspect.py (flows in every state, written through the store module)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from ferry.flow._model._types import State

from .test_inspect import T0, run, run_json, state
from .test_inspect import db as db  # the fixture

Capsys = pytest.CaptureFixture[str]


@pytest.fixture
def answer(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``answer("y")``: what the operator types at the question (stdin)."""

    def typed(text: str) -> None:
        monkeypatch.setattr("sys.stdin", io.StringIO(text))

    typed("")  # no answer at all unless a test gives one: EOF reads as no
    return typed


def ids(capsys: Capsys, db: str, *filters: str) -> list[str]:
    return [f["flow_id"] for f in run_json(capsys, db, "list", *filters)["flows"]]


def test_list_filters(db: str, capsys: Capsys) -> None:
    assert ids(capsys, db, "--state", "parked") == ["parked", "parked-old"]
    assert ids(capsys, db, "--plan", "order", "--state", "BLOCKED") == ["blocked-2", "blocked"]
    assert ids(capsys, db, "--version", "2") == ["orphan"]
    assert ids(capsys, db, "--step", "charge") == ["parked", "parked-old"]
    assert ids(capsys, db, "--id-prefix", "parked") == ["parked", "parked-old"]  # by id
    assert ids(capsys, db, "--id-prefix", "b", "--limit", "1") == ["blocked"]
    started = "2023-11-14T22:13:23Z"  # T0 + 3
    assert T0 == 1_700_000_000.0  # 2023-11-14T22:13:20Z
    assert ids(capsys, db, "--started-since", started) == ["running", "orphan", "parked"]
    assert ids(capsys, db, "--started-until", started, "--state", "parked") == ["parked-old"]
    assert ids(capsys, db, "--since", "2023-11-14T22:13:25") == ["running"]  # UTC if no zone
    assert ids(capsys, db, "--since", "2023-11-14T23:13:25+01:00") == ["running"]
    assert ids(capsys, db, "--since", "1h") == []  # relative to now: all are from 2023
    assert ids(capsys, db, "--until", "1h", "--state", "failed") == ["failed"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["list", "--since", "yesterday"], "argument --since: 'yesterday' is neither a time"),
        (["list", "--until", "2h", "--since", "1h"], "--until is earlier than --since"),
        (["list", "--version", "0"], "argument --version: '0' is not a plan version"),
        (["list", "--state", "asleep"], "argument --state: no state 'asleep'"),
        (["list", "--plan", ""], "argument --plan: must not be empty"),
        (["cancel"], "cancel: give FLOW_ID, or filters (--state, --plan, ...) to cancel every"),
        (["resume", "blocked", "--state", "blocked"], "resume: give FLOW_ID or filters, not both"),
        (["wake", "--started-since", "5x"], "argument --started-since: '5x' is neither"),
    ],
)
def test_a_bad_filter_is_one_line(argv: list[str], message: str, capsys: Capsys) -> None:
    code, out, err = run(capsys, "x.db", *argv)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and message in err, err
    assert err.startswith("python -m ferry.flow") and err.endswith(" --help)\n")


def test_cancel_by_filter_shows_the_count_asks_and_cancels_each(
    db: str, capsys: Capsys, answer: Any
) -> None:
    answer("y\n")
    code, out, err = run(capsys, db, "cancel", "--state", "parked")
    assert code == 0, err
    assert err == ("2 flows match --state PARKED. Cancel each of the 2, one write per flow? [y/N] ")
    assert out.startswith("cancel: 2 flows, 2 cancelled\n")
    for fid in ("parked", "parked-old"):
        assert state(db, fid).state is State.COMPENSATING  # its engine compensates it
    assert state(db, "running").state is State.RUNNING  # no other flow was touched


def test_no_means_nothing_is_done(db: str, capsys: Capsys, answer: Any) -> None:
    for typed in ("n\n", "\n", ""):  # no, just Enter, end of input
        answer(typed)
        code, out, err = run(capsys, db, "cancel", "--plan", "order", "--state", "parked")
        assert (code, out) == (1, "")
        assert err.endswith("error: not confirmed: no flow was cancelled\n"), err
    assert state(db, "parked").state is State.PARKED


def test_yes_does_not_ask_and_json_reports_each_flow(db: str, capsys: Capsys) -> None:
    code, out, err = run(capsys, db, "resume", "--state", "blocked", "--yes", "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert (report["action"], report["matched"], report["acted"]) == ("resume", 2, 2)
    assert report["filters"] == "--state BLOCKED"
    assert [(r["flow_id"], r["acted"], r["result"]) for r in report["results"]] == [
        ("blocked-2", True, "resumed"),
        ("blocked", True, "resumed"),
    ]
    assert {r["state"] for r in report["results"]} == {"COMPENSATING"}
    assert report["outcomes"] == {"resumed": 2}


def test_a_flow_that_cannot_take_the_action_is_reported_and_the_rest_go_on(
    db: str, capsys: Capsys
) -> None:
    code, out, _ = run(capsys, db, "cancel", "--plan", "order", "--yes", "--json")
    assert code == 0
    results = {r["flow_id"]: r for r in json.loads(out)["results"]}
    assert results["parked"]["acted"] and results["running"]["acted"]
    assert results["done"] == {
        "flow_id": "done",
        "acted": False,
        "result": "not cancelled: not running or parked",
        "state": "COMPLETED",
    }


def test_wake_by_filter_and_limit(db: str, capsys: Capsys, answer: Any) -> None:
    answer("yes\n")
    code, out, err = run(
        capsys, db, "wake", "--state", "parked", "--limit", "1", "--payload", '{"ok": 1}'
    )
    assert code == 0
    assert err.startswith("2 flows match --state PARKED (the first 1: --limit 1). Wake it,")
    assert out.splitlines()[:2] == ["wake: 1 flow, 1 woken or queued", "       1  RESUMED"]
    assert state(db, "parked").state is State.RUNNING
    assert state(db, "parked-old").state is State.PARKED


def test_nothing_matches(db: str, capsys: Capsys) -> None:
    code, out, _ = run(capsys, db, "cancel", "--plan", "nope")
    assert (code, out) == (0, "no flow matches --plan nope: nothing to cancel\n")
