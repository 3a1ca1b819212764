"""The dashboard's ``/schedules`` (SPEC 5.9), called as ASGI (httpx's transport): each stored
schedule with its plan, cron, zone, next and last tick, paused, missed and skipped, a link to
its last flow's page and one to the list of its flows (``id_prefix=NAME@``); a name with markup
escaped; a store with none says so; every page's menu links to it."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

from ferry import flow
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader

from .test_dashboard import TOKEN, client_of

report = flow.Plan("report", version=1)


@report.step
async def write(ctx: flow.Context) -> None:
    pass


MARKUP = "<b>x</b>"


async def test_the_schedules_page_lists_them_and_links_to_their_flows(tmp_path: Path) -> None:
    db = str(tmp_path / "app.db")
    schedules = [
        flow.Schedule("nightly", report, cron="0 3 * * *", timezone="Europe/Warsaw"),
        flow.Schedule(MARKUP, report, cron="*/5 * * * *"),
    ]
    async with flow.open_engine(db, [report], schedules=schedules) as engine:
        fid = await engine.trigger("nightly")
        await engine.pause(MARKUP)
    assert fid is not None
    dash = Dashboard(reader=Reader(path=db), store=db, where=repr(db), token=TOKEN)
    async with await client_of(dash) as web:
        r = await web.get("/schedules")
        home = await web.get("/")
    assert r.status_code == 200
    assert '<a href="/schedules">Schedules</a>' in home.text
    html = r.text
    assert MARKUP not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    rows = re.findall(r'<tr id="schedule-\d+"[^>]*>(.*?)</tr>', html, re.S)
    assert len(rows) == 2
    paused, nightly = rows  # by name: "<" sorts before "n"
    assert "<strong>paused</strong>" in paused and "<strong>paused</strong>" not in nightly
    assert "Europe/Warsaw" in nightly and "<code>0 3 * * *</code>" in nightly
    assert f'href="/flow?id={urllib.parse.quote(fid, safe="")}"' in nightly
    assert 'href="/flows?id_prefix=nightly%40"' in nightly
    async with await client_of(dash) as web:
        listed = await web.get("/flows?id_prefix=nightly%40")
    assert fid in listed.text


async def test_a_store_without_schedules_says_so(tmp_path: Path) -> None:
    db = str(tmp_path / "app.db")
    async with flow.open_engine(db, [report]):
        pass
    dash = Dashboard(reader=Reader(path=db), store=db, where=repr(db), token=TOKEN)
    async with await client_of(dash) as web:
        r = await web.get("/schedules")
    assert r.status_code == 200 and 'id="no-schedules"' in r.text
