"""Events and streams for operators (SPEC 5.10): the inspector's ``show`` lists a flow's events
and its stream's last values (``--json`` too); the dashboard's flow page shows them and links to
the live page of the stream, which writes each value as the flow's steps emit it (one response,
no script) and ends once the flow has ended. On SQLite files an engine made.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ferry import flow
from ferry.flow._ops import _inspect
from ferry.flow._ops._dashboard._app import Dashboard, loopback_hosts
from ferry.flow._ops._dashboard._reads import Reader
from ferry.flow._ops._dashboard._serve import serve

TOKEN = "t0ken-for-the-tests-0123456789"


def counting(gate: trio.Event | None = None) -> flow.Plan:
    plan = flow.Plan("counting")

    @plan.step
    async def count(ctx: flow.Context) -> None:
        for n in range(12):
            ctx.emit({"n": n, "note": "<b>not markup</b>"})
        ctx.set_event("status", "counted")
        ctx.set_event("<i>", 12)

    @plan.step
    async def more(ctx: flow.Context) -> None:
        if gate is not None:
            await gate.wait()
        ctx.emit("last")

    return plan


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")

    async def make() -> None:
        plan = counting()
        async with flow.open_engine(path, plans=[plan]) as engine:
            await engine.start(plan, flow_id="c-1")
            await engine.wait("c-1")

    trio.run(make)
    return path


def test_show_lists_the_events_and_the_last_values(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _inspect.main([db, "show", "c-1"]) == 0
    out = capsys.readouterr().out
    assert 'events    {"<i>": 12, "status": "counted"}' in out
    stream = next(line for line in out.splitlines() if line.startswith("stream"))
    assert stream.startswith("stream    13 values; the last 10: 4 {")
    assert stream.endswith('| 13 "last"')
    assert _inspect.main([db, "show", "c-1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["events"] == {"<i>": 12, "status": "counted"}
    assert shown["stream"]["length"] == 13
    assert [n for n, _v in shown["stream"]["last"]] == list(range(4, 14))
    assert shown["stream"]["last"][-1] == [13, "last"]


async def test_the_flow_page_shows_them_and_the_live_page_the_rest(db: str) -> None:
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
    app: Any = dash.app(hosts=loopback_hosts("127.0.0.1"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
    ) as client:
        page = (await client.get("/flow", params={"id": "c-1"})).text
        assert 'id="events"' in page and "&lt;i&gt;" in page and "<i>" not in page
        assert "13 values; the last 10" in page
        assert "&lt;b&gt;not markup&lt;/b&gt;" in page
        assert 'href="/flow/stream?id=c-1&amp;after=3"' in page
        live = await client.get("/flow/stream", params={"id": "c-1", "after": "11"})
        assert live.status_code == 200
        rows = live.text.split('<tr class="value">')[1:]
        assert [r.split("</th>")[0].removeprefix("<th>") for r in rows] == ["12", "13"]
        assert "The flow has ended: 2 values shown." in live.text
        gone = await client.get("/flow/stream", params={"id": "nobody"})
        assert "no flow has id &#39;nobody&#39;" in gone.text
        assert (
            await client.get("/flow/stream", params={"id": "c-1", "after": "x"})
        ).status_code == 404


async def test_the_live_page_writes_each_value_as_it_is_emitted(tmp_path: Path) -> None:
    path = str(tmp_path / "live.db")
    gate = trio.Event()
    plan = counting(gate)
    async with flow.open_engine(path, plans=[plan]) as engine, trio.open_nursery() as nursery:
        await engine.start(plan, flow_id="c-2")
        await engine.get_event("c-2", "status")
        dash = Dashboard(reader=Reader(path=path), store=path, where="x", token=TOKEN)
        url = await nursery.start(partial(serve, dash, port=0))
        seen = ""
        with trio.fail_after(20):
            async with (
                httpx.AsyncClient(base_url=url) as client,
                client.stream("GET", "/flow/stream", params={"id": "c-2", "after": "10"}) as r,
            ):
                chunks = r.aiter_text()
                while "<th>12</th>" not in seen:  # written before the flow went on
                    seen += await chunks.__anext__()
                assert "ended" not in seen.split("<th>12</th>")[1]
                gate.set()
                async for chunk in chunks:
                    seen += chunk
        assert "<th>13</th>" in seen and "The flow has ended: 3 values shown." in seen
        nursery.cancel_scope.cancel()
