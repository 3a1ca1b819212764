"""Operators see the queue (SPEC 5.8, ADR 0169), on SQLite and PostgreSQL: ``stats`` lists each
limited plan's limits and usage (active, queued, busy keys, flows in the rate's window; the same
in ``--json``), ``show`` says why a queued flow waits (its key's limit, the plan's concurrency,
its rate, its start time) and when a delayed one starts, ``list --state QUEUED`` lists the
queue; the engine's ``ferry_flow_flows{state="queued"}``; the dashboard's overview has the
plans' limits and usage and a queued flow's page why it waits.

Seen to fail with `_queue_view.plan_queues` counting only the keyed queues (bank's '' key left
out: stats said 0 queued) and with the engine's collector leaving out the queued gauge.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry

from ferry import flow, metrics
from ferry.flow._ops import _inspect
from ferry.flow._ops._dashboard._app import Dashboard, loopback_hosts
from ferry.flow._ops._dashboard._reads import Reader
from ferry.projected import PostgresStore
from tests import pg

from .test_metrics import scrape, value

TOKEN = "t0ken-for-the-tests-0123456789"


def plans() -> tuple[flow.Plan, flow.Plan]:
    mail = flow.Plan(
        "mail",
        limits=flow.Limits(
            concurrency=2, key=lambda d: d["user"], per_key=1, rate=flow.Rate(3, per=3600)
        ),
    )
    bank = flow.Plan("bank", limits=flow.Limits(rate=flow.Rate(1, per=3600)))
    for plan in (mail, bank):

        @plan.step
        async def hold(ctx: flow.Context) -> flow.Outcome:
            return flow.park()

    return mail, bank


async def fill(where: Any, registry: CollectorRegistry | None = None) -> None:
    """a (u1) and c (u2) active, b waits for its key, d for the concurrency, e for its time; in
    bank x active, y waits for the rate."""
    mail, bank = plans()
    async with flow.open_engine(where, plans=[mail, bank]) as engine:
        if registry is not None:
            metrics.register(engine, registry=registry)
        for fid, user in (("a", "u1"), ("b", "u1"), ("c", "u2"), ("d", "u3")):
            await engine.start(mail, flow_id=fid, data={"user": user})
        await engine.start(mail, flow_id="e", data={"user": "u4"}, delay=3600)
        await engine.start(bank, flow_id="x")
        await engine.start(bank, flow_id="y")
        with trio.fail_after(30):
            for fid in ("a", "c", "x"):
                while (s := await engine.get(fid)) is None or s.state is not flow.State.PARKED:  # noqa: ASYNC110
                    await trio.sleep(0.001)
        if registry is not None:
            assert value(scrape(registry), "ferry_flow_flows", state="queued") == 4
            assert value(scrape(registry), "ferry_flow_flows", state="parked") == 3


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert _inspect.main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.fixture(params=["sqlite", "postgres"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        path = str(tmp_path / "f.db")
        registry = CollectorRegistry()
        trio.run(fill, path, registry)
        yield path
        return
    server: pg.PgServer = request.getfixturevalue("pg_server")
    dsn = server.fresh_schema_dsn()

    async def on_pg() -> None:
        async with PostgresStore(dsn, connections=3) as store:
            await fill(store)

    trio.run(on_pg)
    yield dsn


def test_stats_show_and_list_see_the_queue(where: str, capsys: pytest.CaptureFixture[str]) -> None:
    stats = json.loads(run(capsys, where, "stats", "--json"))
    by_plan = {q["plan"]: q for q in stats["flow_control"]}
    assert by_plan["mail"] == {
        "plan": "mail",
        "limits": {"concurrency": 2, "key": True, "per_key": 1, "rate": [3, 3600.0]},
        "active": 2,
        "queued": 3,
        "busy_keys": 2,
        "in_window": 2,
    }
    assert (by_plan["bank"]["active"], by_plan["bank"]["queued"]) == (1, 1)
    assert by_plan["bank"]["in_window"] == 1 and by_plan["bank"]["busy_keys"] == 0
    assert stats["plans"]["mail@1"]["QUEUED"] == 3
    text = run(capsys, where, "stats")
    assert re.search(r"mail\s+concurrency 2, per key 1, rate 3 per 3600 s\s+2\s+3\s+2\s+2", text)
    assert re.search(r"bank\s+rate 1 per 3600 s\s+1\s+1\s+-\s+1", text)
    reasons: dict[str, Any] = {}
    for fid in ("a", "b", "d", "e", "y"):
        shown = json.loads(run(capsys, where, "show", fid, "--json"))
        reasons[fid] = None if shown["waits_for"] is None else shown["waits_for"]["reasons"]
    assert reasons == {
        "a": None,
        "b": ["concurrency", "per_key"],
        "d": ["concurrency"],
        "e": ["time", "concurrency"],
        "y": ["rate"],
    }
    assert "; its key 'u1': 1 of 1 active" in run(capsys, where, "show", "b")
    e = run(capsys, where, "show", "e")
    assert "waits for its start time" in e and "starts at " in e
    assert json.loads(run(capsys, where, "show", "e", "--json"))["not_before"] is not None
    listed = json.loads(run(capsys, where, "list", "--state", "QUEUED", "--json"))["flows"]
    assert sorted(f["flow_id"] for f in listed) == ["b", "d", "e", "y"]


async def test_the_dashboard_shows_the_limits_the_usage_and_why_a_flow_waits(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "f.db")
    await fill(path)
    dash = Dashboard(reader=Reader(path=path), store=path, where="x", token=TOKEN)
    app: Any = dash.app(hosts=loopback_hosts("127.0.0.1"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as web:
        r = await web.get("/")
        assert r.status_code == 200
        assert re.search(r'id="count-QUEUED">\s*<span class="n">4<', r.text)
        row = re.search(r'<tr class="queue" id="queue-mail">(.*?)</tr>', r.text, re.S)
        assert row is not None
        cells = [
            re.sub(r"<[^>]+>", "", c).strip()
            for c in re.findall(r"<td[^>]*>(.*?)</td>", row[1], re.S)
        ]
        assert cells == [
            "mail",
            "concurrency 2, per key 1, rate 3 per 3600 s",
            "2 of 2",
            "3",
            "2",
            "2 of 3",
        ]
        page = await web.get("/flow?id=" + urllib.parse.quote("d", safe=""))
        waits = re.search(r'id="waits">(.*?)</td>', page.text)
        assert waits is not None and waits[1] == "the plan&#39;s concurrency: 2 of 2 active"
        page = await web.get("/flow?id=e")
        assert 'id="not-before"' in page.text and "its start time" in page.text
        page = await web.get("/flow?id=a")
        assert 'id="waits"' not in page.text
