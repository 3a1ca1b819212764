"""The dashboard's app, called as ASGI (httpx's transport, no browser and no socket): the pages,
the token and read-only rules, escaping, a store that is briefly unavailable, the SQLite engine
lock, ``/metrics``, and the ``serve`` command itself (one process, one request).

The store is filled as the inspector's tests fill it (`populate`: flows in every state), plus a
flow whose id and data hold markup. The browser test is tests/flow/test_dashboard_browser.py.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ferry import flow
from ferry.flow._model import _machine as m
from ferry.flow._model._values import Flow
from ferry.flow._ops._dashboard._app import Dashboard, loopback_hosts
from ferry.flow._ops._dashboard._reads import Reader, Unavailable, page_overview
from ferry.flow._ops._dashboard._render import chart
from ferry.flow._store import _batch, _op, _store

from ._helpers import _InlineTx
from .test_inspect import ORDER, ROOT, T0, populate

TOKEN = "t0ken-for-the-tests-0123456789"
XSS = "<img src=x onerror=alert(1)>"
XSS_DATA = '{"note":"</pre><script>alert(2)</script>"}'


def fill(path: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN")
    tx = _InlineTx(conn)
    populate(tx)
    _batch.write_batch(tx, [_op.Create(m.start(ORDER, XSS, XSS_DATA, T0 + 6))])
    conn.execute("COMMIT")
    conn.close()


def row(path: str, fid: str) -> tuple[Flow, int]:
    """The flow's row and how many history events it has."""
    conn = sqlite3.connect(path)
    try:
        tx = _InlineTx(conn)
        f = _store.load(tx, fid)
        events = _store.load_history(tx, fid)
    finally:
        conn.close()
    assert f is not None and events is not None
    return f, len(events)


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")
    fill(path)
    return path


async def client_of(dash: Dashboard, host: str = "127.0.0.1") -> httpx.AsyncClient:
    app: Any = dash.app(hosts=loopback_hosts("127.0.0.1"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}")


@pytest.fixture
async def web(db: str) -> AsyncIterator[httpx.AsyncClient]:
    dash = Dashboard(reader=Reader(path=db), store=db, where=repr(db), token=TOKEN, page_size=3)
    async with await client_of(dash) as client:
        yield client


def text_of(html: str, element_id: str) -> str:
    m_ = re.search(rf'id="{element_id}"[^>]*>(.*?)</', html, re.S)
    assert m_ is not None, element_id
    return m_.group(1).strip()


def flow_url(fid: str) -> str:
    return "/flow?id=" + urllib.parse.quote(fid, safe="")


# -------------------------------------------------------------------------------------- pages


async def test_overview_counts_and_refreshes(web: httpx.AsyncClient) -> None:
    r = await web.get("/")
    assert r.status_code == 200
    counts = {
        k: int(n) for k, n in re.findall(r'id="count-(\w+)">\s*<span class="n">(\d+)', r.text)
    }
    # populate's flows, plus the markup flow (running)
    assert counts == {
        "RUNNING": 3,
        "PARKED": 2,
        "COMPENSATING": 0,
        "COMPLETED": 1,
        "FAILED": 1,
        "BLOCKED": 2,
        "QUEUED": 0,  # flow control's state (SPEC 5.8)
    }
    assert '<meta http-equiv="refresh" content="5">' in r.text
    assert "<svg" in r.text and "polyline" in r.text
    assert "parked-old" not in r.text  # no deadline: counted, not listed
    assert ">parked</a>" in r.text  # the parked flow with a deadline
    assert r.headers["content-security-policy"].startswith("default-src 'none'")


async def test_flows_filters_and_pages(web: httpx.AsyncClient) -> None:
    r = await web.get("/flows", params={"state": "blocked"})
    assert r.status_code == 200
    assert re.findall(r'<td class="id"><a [^>]*>([^<]*)</a>', r.text) == ["blocked-2", "blocked"]
    # three per page here: follow the "next" links through all nine flows
    seen: list[str] = []
    url: str | None = "/flows"
    while url is not None:
        r = await web.get(url)
        ids = re.findall(r'<td class="id"><a [^>]*>([^<]*)</a>', r.text)
        assert 1 <= len(ids) <= 3
        seen += ids
        nxt = re.search(r'href="(/flows\?[^"]*)" id="next"', r.text)
        url = None if nxt is None else nxt.group(1).replace("&amp;", "&")
    assert len(seen) == len(set(seen)) == 9
    r = await web.get("/flows", params={"version": "two"})
    assert r.status_code == 400 and "version must be a whole number" in r.text
    r = await web.get("/flows", params={"after": "garbage"})
    assert r.status_code == 400 and "not a cursor of this listing" in r.text


async def test_a_flow_page(web: httpx.AsyncClient) -> None:
    r = await web.get(flow_url("blocked"))
    assert r.status_code == 200
    kinds = re.findall(r'<span class="kind">([a-z_]+)</span>', r.text)
    assert kinds == ["started", "step", "step", "blocked"]  # reserve done, charge declined
    assert "refund down" in text_of(r.text, "error")
    assert 'id="resume"' in r.text and 'id="cancel"' not in r.text
    r = await web.get(flow_url("nope"))
    assert r.status_code == 404 and "No flow has the id" in r.text


async def test_markup_in_ids_and_data_is_text(web: httpx.AsyncClient) -> None:
    for url in ("/flows", flow_url(XSS), "/"):
        r = await web.get(url)
        assert "<img" not in r.text and "<script" not in r.text, url
    r = await web.get(flow_url(XSS))
    assert "&lt;img src=x onerror=alert(1)&gt;" in r.text
    assert "&lt;/pre&gt;&lt;script&gt;alert(2)&lt;/script&gt;" in r.text


# ------------------------------------------------------------------------------------ actions


async def test_an_action_needs_the_token(web: httpx.AsyncClient, db: str) -> None:
    before = row(db, "blocked")
    for form in ({"id": "blocked"}, {"id": "blocked", "token": "wrong" + TOKEN}):
        r = await web.post("/flow/resume", data=form)
        assert r.status_code == 403
        assert "token" in text_of(r.text, "problem")
        assert row(db, "blocked") == before  # nothing written
    r = await web.post("/flow/resume", data={"id": "blocked", "token": TOKEN})
    assert r.status_code == 303
    assert r.headers["location"] == "/flow?id=blocked&done=resume&via=here"  # no engine serves it
    after, events = row(db, "blocked")
    # blocked while compensating: the compensation runs again (the next engine to open runs it)
    assert after.state is flow.State.COMPENSATING and events == before[1] + 1
    r = await web.get(r.headers["location"])
    assert text_of(r.text, "notice").startswith("resumed; no engine serves the store")
    assert text_of(r.text, "state") == "COMPENSATING"


async def test_actions_report_what_did_not_apply(web: httpx.AsyncClient, db: str) -> None:
    r = await web.post("/flow/resume", data={"id": "done", "token": TOKEN})
    assert r.status_code == 409 and "only a BLOCKED flow" in r.text
    r = await web.post("/flow/wake", data={"id": "parked", "token": TOKEN, "payload": "{x"})
    assert r.status_code == 400 and "the payload is not JSON" in r.text
    assert row(db, "parked")[0].state is flow.State.PARKED
    r = await web.post("/flow/wake", data={"id": "parked", "token": TOKEN, "payload": '{"ok": 1}'})
    assert r.status_code == 303 and r.headers["location"].endswith("done=wake-RESUMED&via=here")
    assert row(db, "parked")[0].state is flow.State.RUNNING
    r = await web.post("/flow/cancel", data={"id": "parked-old", "token": TOKEN})
    assert r.status_code == 303
    assert row(db, "parked-old")[0].state is flow.State.COMPENSATING


async def test_read_only_shows_no_buttons_and_refuses_posts(db: str) -> None:
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, read_only=True)
    async with await client_of(dash) as web:
        r = await web.get(flow_url("blocked"))
        assert "<form" not in r.text.split("<main>")[1].split("</main>")[0].replace(
            '<form class="filters"', ""
        )
        assert 'id="no-actions"' in r.text
        before = row(db, "blocked")
        r = await web.post("/flow/resume", data={"id": "blocked", "token": TOKEN})
        assert r.status_code == 403 and "read-only" in text_of(r.text, "problem")
        assert row(db, "blocked") == before


async def test_a_file_held_by_what_answers_no_request_is_explained(db: str) -> None:
    """An operator's engine holds the file (it serves no requests): pages work, and an action
    is stored and answered 504 once its wait ran out, nothing applied."""
    before = row(db, "blocked")
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, answer_within=0.2)
    async with await client_of(dash) as web, flow.open_engine(db, [], serve=False):
        for url in ("/", "/flows", flow_url("blocked")):  # the pages take no lock
            assert (await web.get(url)).status_code == 200, url
        r = await web.post("/flow/resume", data={"id": "blocked", "token": TOKEN})
    assert r.status_code == 504 and "the request is stored" in r.text
    assert row(db, "blocked") == before


async def test_other_hosts_are_refused(db: str) -> None:
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
    async with await client_of(dash, host="evil.example") as web:
        assert (await web.get("/")).status_code == 400
    async with await client_of(dash, host="localhost") as web:
        assert (await web.get("/")).status_code == 200


def test_a_short_token_is_refused(db: str) -> None:
    with pytest.raises(ValueError, match="at least 16 characters"):
        Dashboard(reader=Reader(path=db), store=db, where="x", token="short")


# ------------------------------------------------------------------------ an unavailable store


async def test_a_missing_database_is_said_and_recovers(web: httpx.AsyncClient, db: str) -> None:
    os.rename(db, db + ".away")
    for url in ("/", "/flows", flow_url("blocked")):
        r = await web.get(url)
        assert r.status_code == 503, url
        assert "The database is unavailable" in r.text
        assert '<meta http-equiv="refresh" content="5">' in r.text
    os.rename(db + ".away", db)
    assert (await web.get("/")).status_code == 200


async def test_a_slow_database_is_said(db: str) -> None:
    """A writer holding an exclusive lock (no WAL readers then) makes reads wait: the page says
    so after the reader's timeout instead of hanging."""
    reader = Reader(path=db, timeout=0.3)
    dash = Dashboard(reader=reader, store=db, where="x", token=TOKEN)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA locking_mode = EXCLUSIVE")
    conn.execute("BEGIN EXCLUSIVE")
    try:
        async with await client_of(dash) as web:
            r = await web.get("/")
            assert r.status_code == 503 and "unavailable" in r.text
    finally:
        conn.execute("COMMIT")
        conn.close()
    async with await client_of(dash) as web:
        assert (await web.get("/")).status_code == 200


# ------------------------------------------------------------------------------------ metrics


async def test_metrics_scrape(web: httpx.AsyncClient) -> None:
    r = await web.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    lines = dict(
        line.rsplit(" ", 1) for line in r.text.splitlines() if line and not line.startswith("#")
    )
    assert float(lines['ferry_flow_store_flows{state="blocked"}']) == 2
    assert float(lines['ferry_flow_store_flows{state="completed"}']) == 1
    plan_flows = "ferry_flow_store_plan_flows"
    assert float(lines[f'{plan_flows}{{plan="refund",state="running",version="2"}}']) == 1
    assert float(lines[f'{plan_flows}{{plan="order",state="blocked",version="1"}}']) == 2
    assert not any("completed" in k for k in lines if k.startswith(plan_flows))


# ------------------------------------------------------------------------------ the command


def test_serve_prints_the_token_and_serves_on_loopback(db: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferry.flow", db, "serve", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        token_line = proc.stdout.readline()
        url = re.search(r"on (http://127\.0\.0\.1:\d+)/", first)
        assert url is not None, first + (proc.stderr.read() if proc.stderr else "")
        token = token_line.rsplit(" ", 1)[1].strip()
        assert len(token) >= 32
        r = httpx.get(url.group(1) + "/flows?state=BLOCKED")
        assert r.status_code == 200 and "blocked-2" in r.text
        r = httpx.post(url.group(1) + "/flow/resume", data={"id": "blocked", "token": token})
        assert r.status_code == 303
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert row(db, "blocked")[0].state is flow.State.COMPENSATING


def test_serve_refuses_bad_arguments(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    from ferry.flow._ops._inspect import main

    assert main([db, "serve", "--port", "99999"]) == 2
    assert "'99999' is not a port" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([db, "serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err


async def test_import_ferry_flow_imports_no_web_toolkit() -> None:
    code = (
        "import sys, ferry.flow; bad = [m for m in sys.modules if m.split('.')[0] in"
        " ('starlette', 'jinja2', 'hypercorn', 'prometheus_client', 'httpx')]; print(bad)"
    )
    out = await trio.run_process([sys.executable, "-c", code], capture_stdout=True, cwd=ROOT)
    assert out.stdout.decode().strip() == "[]"


def test_overview_reads(db: str) -> None:
    """The overview's figures: unfinished flows by plan, and the per-minute series of the
    last hour (started by creation time, completed and failed by their last write)."""
    conn = sqlite3.connect(db)
    try:
        tx = _InlineTx(conn)
        o = page_overview(tx, now=T0 + 30)
        later = page_overview(tx, now=T0 + 3 * 3600)
    finally:
        conn.close()
    assert o.plans == [
        ("order", 1, {"RUNNING": 2, "PARKED": 2, "COMPENSATING": 0, "BLOCKED": 2}),
        ("refund", 2, {"RUNNING": 1, "PARKED": 0, "COMPENSATING": 0, "BLOCKED": 0}),
    ]
    assert o.total == 9 and o.parked_forever == 1 and [f.flow_id for f in o.deadlines] == ["parked"]
    assert len(o.series.started) == 60
    assert o.series.started[-1] == 9  # T0 .. T0 + 6 all fall in the minute of T0 + 30
    assert sum(o.series.completed) == 1 and sum(o.series.failed) == 1
    assert sum(later.series.started) == sum(later.series.completed) == 0
    drawn = chart(o.series)
    # (9 at most: the axis goes up to a round 10)
    assert drawn["top"] == 10 and all(len(p.split()) == 60 for _n, p, _t in drawn["lines"])


async def test_a_read_past_its_time_limit_is_interrupted(db: str) -> None:
    """A read that runs too long is said to be unavailable at the time limit, and its statement
    is interrupted: the worker thread ends instead of reading on (here: for ever)."""
    reader = Reader(path=db, timeout=0.2)
    ended = threading.Event()

    def forever(tx: Any) -> Any:
        try:
            return tx.execute(
                "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"
                " SELECT COUNT(*) FROM c"
            )
        finally:
            ended.set()

    with pytest.raises(Unavailable, match=r"no answer within 0\.2 s"):
        await reader.read(forever)
    assert await trio.to_thread.run_sync(ended.wait, 10.0)


async def test_actions_and_refusals_are_logged(
    web: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.flow")
    await web.post("/flow/resume", data={"id": "blocked", "token": "nope" * 5})
    await web.post("/flow/resume", data={"id": "blocked", "token": TOKEN})
    mine = [r for r in caplog.records if r.getMessage().startswith("dashboard:")]
    assert [(r.levelname, getattr(r, "flow_id", None)) for r in mine] == [
        ("WARNING", "blocked"),
        ("INFO", "blocked"),
    ]
    assert "wrong token" in mine[0].getMessage() and "resume" in mine[1].getMessage()


def test_the_screenshot_in_the_docs_is_a_png() -> None:
    """docs/dashboard.md and docs/flow.md show the flow page the browser test photographs."""
    doc = ROOT / "docs" / "img" / "dashboard-flow.png"
    assert doc.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc.stat().st_size > 10_000
    for page in ("dashboard.md", "flow.md"):
        assert "img/dashboard-flow.png" in (ROOT / "docs" / page).read_text()


def test_serve_without_the_extra_says_what_to_install(
    db: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry.flow._ops._inspect import main

    for name in ["hypercorn", *(n for n in sys.modules if n.startswith("hypercorn."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "ferry.flow._ops._dashboard._serve", raising=False)
    # (an address that cannot be bound: were the import to work, this ends, not serves)
    assert main([db, "serve", "--host", "256.1.1.1"]) == 1
    err = capsys.readouterr().err
    assert "the dashboard needs its extra (hypercorn is missing)" in err
    assert "pip install 'stm-ferry[dashboard]'" in err


async def test_pages_never_wait_for_the_writer(db: str) -> None:
    """An engine's write transaction in progress (SQLite's write lock held) does not hold a
    page up: the dashboard reads a snapshot and takes no write lock."""
    dash = Dashboard(reader=Reader(path=db, timeout=0.5), store=db, where="x", token=TOKEN)
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE flow_flows SET attempt = attempt + 1 WHERE flow_id = 'running'")
    try:
        async with await client_of(dash) as web:
            for url in ("/", "/flows", flow_url("running")):
                r = await web.get(url)
                assert r.status_code == 200, url
            assert "(attempt 1)" in r.text  # the last committed state, not the writer's
    finally:
        writer.execute("ROLLBACK")
        writer.close()


async def test_a_long_history_shows_its_latest_events(
    web: httpx.AsyncClient, db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry.flow._ops._dashboard import _reads

    monkeypatch.setattr(_reads, "HISTORY", 2)
    r = await web.get(flow_url("blocked"))
    assert re.findall(r'<span class="kind">([a-z_]+)</span>', r.text) == ["step", "blocked"]
    assert text_of(r.text, "history-cut") == "The last 2 of 4 events."
