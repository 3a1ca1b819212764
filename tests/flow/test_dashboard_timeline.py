"""A flow's page on the dashboard tells its story: every failed attempt in the timeline with its
error and a collapsible traceback, each dot coloured by the event's outcome (a step that raised
is red, never green), the time between events, ISO 8601 times (no epoch float in a detail),
counts with thousands separators, and an Abandon button on a BLOCKED flow that asks for a reason
and records who did it.

Checked to fail before the timeline showed outcomes (every ``step`` was a green dot, a failed
attempt a grey one without its error), before durations and ISO details (a parked event said
``"deadline": 1700003600.0``) and before there was an abandon action (404).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from ferry import flow
from ferry.flow._model import _machine as m
from ferry.flow._model._types import CONTINUE, park
from ferry.flow._model._values import Flow, Mailbox, Transition
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader
from ferry.flow._ops._dashboard._shown import count, duration, iso
from ferry.flow._store import _batch, _op

from ._helpers import _InlineTx
from .test_dashboard import TOKEN, client_of, flow_url, row, text_of
from .test_inspect import ORDER, T0, populate

FAILURE = {
    "error": "ConnectionError('db down')",
    "type": "ConnectionError",
    "traceback": 'Traceback (most recent call last):\n  File "app.py", line 3\nConnectionError',
}


def fill(path: str) -> None:
    """`populate`'s flows, and "shaky": reserve raised once then went on 1.5 s later, charge
    raised on its last attempt a minute later, and the compensation of reserve failed an hour
    after that (BLOCKED); "waits": parked with a deadline an hour on."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN")
    tx = _InlineTx(conn)
    populate(tx)

    def change(f: Flow, fn: object) -> Flow:
        (r,) = _batch.write_batch(tx, [_op.Change(f.flow_id, fn, flow=f, first_queued=True)])  # type: ignore[arg-type]
        assert isinstance(r, _op.Changed)
        return r.transition.flow

    def created(fid: str) -> Flow:
        (r,) = _batch.write_batch(tx, [_op.Create(m.start(ORDER, fid, "{}", T0, owner="svc"))])
        assert isinstance(r, _op.Created)
        return r.transition.flow

    def done(at: float, outcome: object = CONTINUE) -> object:
        def apply(fl: Flow, box: Mailbox) -> Transition:
            return m.step_done(fl, box, ORDER, outcome, fl.data, at)  # type: ignore[arg-type]

        return apply

    f = created("shaky")
    f = change(f, lambda fl, _b: m.next_attempt(fl, T0 + 0.25, FAILURE))
    f = change(f, done(T0 + 1.75))
    f = change(
        f, lambda fl, _b: m.step_failed(fl, ORDER, "ValueError('bad card')", T0 + 61.75, "TB-1")
    )
    change(f, lambda fl, _b: m.compensation_failed(fl, "refund down", T0 + 3661.75, ORDER))
    f = change(created("waits"), done(T0))
    change(f, done(T0, park(3600)))
    conn.execute("COMMIT")
    conn.close()


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")
    fill(path)
    return path


@pytest.fixture
async def web(db: str) -> AsyncIterator[httpx.AsyncClient]:
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
    async with await client_of(dash) as client:
        yield client


def events_of(html: str) -> list[tuple[str, str]]:
    """(kind, tone) of each event of the timeline."""
    return re.findall(r'<li class="event kind-([a-z_]+) tone-([a-z]+)">', html)


async def test_failed_attempts_are_in_the_timeline_coloured_by_outcome(
    web: httpx.AsyncClient,
) -> None:
    r = await web.get(flow_url("shaky"))
    assert r.status_code == 200
    assert events_of(r.text) == [
        ("started", "run"),
        ("attempt_failed", "error"),
        ("step", "ok"),
        ("step", "error"),  # raised on its last attempt: red, not green
        ("blocked", "error"),
    ]
    history = r.text.split('id="history"')[1]
    assert "ConnectionError: ConnectionError(&#39;db down&#39;)" not in history  # said once
    assert "ConnectionError(&#39;db down&#39;)" in history
    assert "ValueError(&#39;bad card&#39;)" in history
    tracebacks = re.findall(
        r'<details class="traceback"><summary>traceback</summary><pre>(.*?)</pre>', history, re.S
    )
    assert tracebacks == [
        "Traceback (most recent call last):\n  File &#34;app.py&#34;, line 3\nConnectionError",
        "TB-1",
    ]


async def test_the_timeline_says_durations_and_iso_times(web: httpx.AsyncClient) -> None:
    r = await web.get(flow_url("shaky"))
    since = re.findall(r'<span class="since"[^>]*>\+([^<]*)</span>', r.text)
    assert since == ["250 ms", "1.5 s", "1 min", "1 h"]
    assert '<time class="at" datetime="2023-11-14T22:13:20Z">2023-11-14T22:13:20Z</time>' in r.text
    r = await web.get(flow_url("waits"))
    history = r.text.split('id="history"')[1]
    assert "deadline</span> 2023-11-14T23:13:20Z" in history  # T0 + 1 h, not an epoch float
    assert "timeout</span> 1 h" in history
    assert not re.search(r"1700\d{6}", history)


async def test_counts_have_thousands_separators(db: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("BEGIN")
    tx = _InlineTx(conn)
    _batch.write_batch(
        tx, [_op.Create(m.start(ORDER, f"bulk-{i:05}", "{}", T0)) for i in range(1234)]
    )
    conn.execute("COMMIT")
    conn.close()
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
    async with await client_of(dash) as web:
        r = await web.get("/")
    assert re.search(r'id="count-RUNNING">\s*<span class="n">1,236</span>', r.text)
    assert re.search(r'id="count-total">1,244</span>', r.text)


def test_the_words_for_times_durations_and_counts() -> None:
    assert iso(T0) == "2023-11-14T22:13:20Z" and iso(None) == "-"
    assert [duration(s) for s in (0, 0.35, 4.2, 59, 185, 7800, 3 * 86400 + 4 * 3600)] == [
        "0 ms",
        "350 ms",
        "4.2 s",
        "59 s",
        "3 min 5 s",
        "2 h 10 min",
        "3 d 4 h",
    ]
    assert duration(-2) == "-2.0 s"
    assert count(0) == "0" and count(1234567) == "1,234,567"


# ------------------------------------------------------------------------------------ abandon


async def test_abandon_a_blocked_flow_from_its_page(
    web: httpx.AsyncClient, db: str, caplog: pytest.LogCaptureFixture
) -> None:
    r = await web.get(flow_url("shaky"))
    assert 'id="abandon-form"' in r.text and 'id="abandon-reason"' in r.text
    r = await web.get(flow_url("running"))
    assert 'id="abandon-form"' not in r.text  # only a BLOCKED flow
    before = row(db, "shaky")
    r = await web.post("/flow/abandon", data={"id": "shaky", "token": TOKEN, "reason": " "})
    assert r.status_code == 400 and "abandon needs a reason" in text_of(r.text, "problem")
    r = await web.post("/flow/abandon", data={"id": "shaky", "reason": "refunded by hand"})
    assert r.status_code == 403
    assert row(db, "shaky") == before
    r = await web.post(
        "/flow/abandon", data={"id": "shaky", "token": TOKEN, "reason": "refunded by hand"}
    )
    assert r.status_code == 303 and r.headers["location"] == "/flow?id=shaky&done=abandon&via=here"
    after, _events = row(db, "shaky")
    assert after.state is flow.State.FAILED
    r = await web.get(r.headers["location"])
    assert text_of(r.text, "notice").startswith("abandoned")
    assert events_of(r.text)[-2:] == [("abandoned", "error"), ("failed", "error")]
    assert "by</span> dashboard (127.0.0.1)" in r.text  # who, from the client's address
    assert "reason</span> refunded by hand" in r.text and "skipped</span> reserve" in r.text
    r = await web.post("/flow/abandon", data={"id": "shaky", "token": TOKEN, "reason": "again"})
    assert r.status_code == 409 and "only a BLOCKED flow can be abandoned" in r.text
