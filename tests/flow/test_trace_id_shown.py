"""The trace id where an operator looks: ``show --json`` (and ``show``) and the dashboard's
flow page, a link when ``serve --trace-url TEMPLATE`` is given (checked when given; the address
escaped on the page). A stored ``traceparent`` that is not a valid one is never shown. Before,
neither said the trace id (``trace_id`` missing from the JSON, no trace row on the page)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan

from ferry import flow
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader

from .test_dashboard import TOKEN, client_of, flow_url, text_of
from .test_inspect import run, run_json
from .test_tracing import attrs_of, traced

XSS_TRACE = '00-<script>alert(1)</script>-"><img src=x>-01'


def started(db: str) -> str:
    """Two flows on `db`: "traced" started under an SDK provider, "tampered" with a stored
    traceparent that is not one. Returns the trace id (hex) of "traced"'s start span."""
    provider, exporter = traced()
    plan = flow.Plan("order")

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Outcome:
        return flow.park()

    async def main() -> None:
        async with flow.open_engine(db, plans=[plan], tracer_provider=provider) as engine:
            for fid in ("traced", "tampered"):
                await engine.start(plan, flow_id=fid)

    trio.run(main)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE flow_flows SET trace = ? WHERE flow_id = 'tampered'", (XSS_TRACE,))
    conn.close()
    spans: tuple[ReadableSpan, ...] = exporter.get_finished_spans()
    start = next(
        s for s in spans if s.name == "start order" and attrs_of(s)["workflow.id"] == "traced"
    )
    assert start.context is not None
    return f"{start.context.trace_id:032x}"


@pytest.fixture
def db(tmp_path: Path) -> tuple[str, str]:
    path = str(tmp_path / "flows.db")
    return path, started(path)


def test_show_says_the_trace_id(db: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    path, trace_id = db
    assert run_json(capsys, path, "show", "traced")["flow"]["trace_id"] == trace_id
    code, out, err = run(capsys, path, "show", "traced")
    assert code == 0, err
    assert f"trace     {trace_id}" in out.splitlines()
    assert run_json(capsys, path, "show", "tampered")["flow"]["trace_id"] is None
    code, out, _ = run(capsys, path, "show", "tampered")
    assert "trace " not in out and "script" not in out
    listed = run_json(capsys, path, "list")["flows"]
    assert {f["flow_id"]: f["trace_id"] for f in listed} == {"traced": trace_id, "tampered": None}


async def page(path: str, fid: str, trace_url: str | None) -> str:
    dash = Dashboard(
        reader=Reader(path=path), store=path, where=repr(path), token=TOKEN, trace_url=trace_url
    )
    async with await client_of(dash) as web:
        r: httpx.Response = await web.get(flow_url(fid))
    assert r.status_code == 200
    return r.text


async def test_the_flow_page_shows_the_trace_id_and_links_it_when_configured(
    db: tuple[str, str],
) -> None:
    path, trace_id = db
    plain = await page(path, "traced", None)
    assert text_of(plain, "trace") == f"<code>{trace_id}"
    assert "<a href" not in plain.split('id="trace"')[1].split("</td>")[0]
    template = "https://grafana.example/explore?left=tempo&traceId={trace_id}"
    linked = await page(path, "traced", template)
    cell = linked.split('id="trace"')[1].split("</td>")[0]
    # The address is escaped (& as &amp;), and it holds the trace id and nothing else of the row.
    assert f'<a href="https://grafana.example/explore?left=tempo&amp;traceId={trace_id}"' in cell
    assert f"<code>{trace_id}</code>" in cell
    tampered = await page(path, "tampered", template)
    assert 'id="trace"' not in tampered  # not a traceparent: no trace row, no link
    assert "<script>alert(1)" not in tampered


@pytest.mark.parametrize(
    "template",
    [
        "https://jaeger.example/trace/",  # no {trace_id}
        "https://jaeger.example/{trace_id}/{trace_id}",
        "https://jaeger.example/{trace_id}?q={other}",
        "javascript:alert(1)//{trace_id}",
        "https:///{trace_id}",
        'https://jaeger.example/"><script>/{trace_id}',
        "https://jaeger.example/ x/{trace_id}",
    ],
)
def test_a_trace_url_template_that_is_not_one_is_refused_at_the_call(
    template: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "flows.db")
    with pytest.raises(ValueError, match="trace URL template"):
        Dashboard(reader=Reader(path=path), store=path, where="x", token=TOKEN, trace_url=template)
    code, _, err = run(capsys, path, "serve", "--trace-url", template)
    assert code == 2 and "trace URL template" in err, err
    assert not Path(path).exists(), "the store was opened before the template was checked"
