"""The dashboard's pages (GET): the overview, the flows list, one flow's page, ``/metrics``.

Each is a function of the `Dashboard` and the request, routed by `Dashboard.app`; reads go
through its `Reader` (read-only transactions), and nothing here writes.
"""

from __future__ import annotations

import math
import time
import urllib.parse
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..._model import _values
from ..._store import _query, _triage
from .. import _trace_url
from ._reads import SPANS, Unavailable, page_flow, page_flows, page_overview
from ._render import ERROR_GROUPS, REFRESH, chart

if TYPE_CHECKING:
    from ._app import Dashboard

FILTER_FIELDS = (
    "state",
    "plan",
    "version",
    "step",
    "updated_after",
    "updated_before",
    "created_after",
    "created_before",
    "id_prefix",
    "error",
    "parent",
)

DONE = {
    "wake-RESUMED": "woken: it was parked and runs its next step",
    "wake-QUEUED": "woken: the message is kept in its mailbox for its next park",
    "wake-DUPLICATE": "not woken again: this message id was delivered before",
    "cancel": "cancelled: it compensates its completed steps",
    "resume": "resumed",
    "abandon": "abandoned: it ended FAILED without running the compensations left",
}
#: What happens now, by who applied the action (the redirect's ``via``).
VIA = {
    "engine": "accepted and applied by the engine serving the store, which runs what follows now",
    "here": "no engine serves the store: the dashboard applied it, and what follows waits for"
    " the next engine to open the store",
}


async def overview(dash: Dashboard, request: Request) -> Response:
    now = dash.clock()
    began = time.monotonic()
    span = request.query_params.get("span") or "1h"
    plan = request.query_params.get("plan") or None
    if span not in SPANS:
        span = "1h"  # (a bookmark of another version: the default rather than an error)
    try:
        o, errors = await dash.reader.read(
            lambda tx: (
                page_overview(tx, now=now, span=span, plan=plan),
                _triage.failure_groups(tx, limit=ERROR_GROUPS),
            )
        )
    except Unavailable as why:
        return dash.unavailable("Overview", why)
    # A store so big that the counts take long is asked less often (at most a tenth of the
    # time spent counting).
    refresh = max(REFRESH, math.ceil(10 * (time.monotonic() - began)))
    return dash.render(
        "overview.html",
        refresh=refresh,
        o=o,
        chart=chart(o.series),
        spans=list(SPANS),
        errors=errors,
    )


async def flows(dash: Dashboard, request: Request) -> Response:
    q = request.query_params
    fields = {k: q.get(k, "") for k in FILTER_FIELDS}
    after = q.get("after") or None
    before = q.get("before") or None
    try:
        flt = _query.FlowFilter.from_text(now=dash.clock(), **fields)
    except (ValueError, TypeError) as exc:
        return dash.render("flows.html", 400, fields=fields, page=None, problem=str(exc))
    try:
        page = await dash.reader.read(
            lambda tx: page_flows(
                tx, flt, after=after, before=before, limit=dash.page_size, cap=dash.count_cap
            )
        )
    except ValueError as exc:  # a cursor that is not ours
        return dash.render("flows.html", 400, fields=fields, page=None, problem=str(exc))
    except Unavailable as why:
        return dash.unavailable("Flows", why)
    keep = {k: v for k, v in fields.items() if v}
    nxt = None if page.next is None else "?" + urllib.parse.urlencode({**keep, "after": page.next})
    prev = (
        None if page.prev is None else "?" + urllib.parse.urlencode({**keep, "before": page.prev})
    )
    # (no "first page" link on the first page, reached back through "previous")
    back = (after or before) and (page.prev is not None or not page.flows)
    first = "?" + urllib.parse.urlencode(keep) if back else None
    return dash.render(
        "flows.html",
        fields=fields,
        page=page,
        problem=None,
        next=nxt,
        prev=prev,
        first=first,
        by_id=flt.by_id,
        query=urllib.parse.urlencode(keep),
    )


async def flow(dash: Dashboard, request: Request) -> Response:
    done = DONE.get(request.query_params.get("done") or "")
    via = VIA.get(request.query_params.get("via") or "")
    notice = None if done is None else done if via is None else f"{done}; {via}"
    return await flow_page(dash, request.query_params.get("id", ""), notice=notice)


async def flow_page(
    dash: Dashboard,
    fid: str,
    *,
    notice: str | None = None,
    problem: str | None = None,
    status: int = 200,
) -> Response:
    """The page of the flow `fid` (404 if there is none), with `notice` or `problem` said
    at the top and answered with `status`."""
    if not fid:
        return dash.render("missing.html", 404, flow_id=fid)
    try:
        p = await dash.reader.read(lambda tx: page_flow(tx, fid))
    except Unavailable as why:
        return dash.unavailable("Flow", why)
    if p is None:
        return dash.render("missing.html", 404, flow_id=fid)
    trace_id = _values.trace_id(p.flow.trace)
    trace = None
    if trace_id is not None:
        url = None if dash.trace_url is None else _trace_url.link(dash.trace_url, trace_id)
        trace = (trace_id, url)
    return dash.render("flow.html", status, p=p, notice=notice, problem=problem, trace=trace)


async def metrics(dash: Dashboard, request: Request) -> Response:
    try:
        import prometheus_client
    except ImportError:
        return PlainTextResponse(
            "/metrics needs prometheus_client: pip install prometheus_client\n", 404
        )
    from ._metrics import scrape

    try:
        body = await dash.reader.read(lambda tx: scrape(tx))
    except Unavailable as why:
        return PlainTextResponse(f"the store is unavailable: {why}\n", 503)
    return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)
