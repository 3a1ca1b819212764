"""The dashboard's ASGI app (Starlette, Jinja2 with autoescape): pages and actions.

Pages (GET): ``/`` the overview, ``/flows`` the list (filters, a bounded count of the matches,
keyset pages both ways), ``/flow?id=`` one flow, ``/flows/bulk?action=`` the confirmation of an
action on a filter, ``/metrics`` (with prometheus_client), ``/static/...``. Actions (POST):
``/flow/wake``, ``/flow/cancel``, ``/flow/resume``, ``/flow/abandon`` (form fields ``id`` and the
credentials), ``/flows/bulk`` (an action on every flow a filter matches, at most `BULK_MAX`),
``/session/end``. Nothing here runs a step: reads go through a `Reader` (read-only
transactions), and actions through a client (`flow.connect`: the engine serving the store
applies them, or, with none serving, the client itself through an operator's engine), opened
for the action and closed after it, as the inspector's are (docs/adr/0044, 0125).

The safety rules (docs/adr/0081, 0115, 0129), each enforced in one place:

- Every request body is bounded before it is read (`_Bounded`, docs/adr/0115): a
  ``Content-Length`` over `MAX_BODY` (64 KiB by default) is answered 413 before a byte of the
  body is read, and a body without one (chunked) is cut off with a 413 as soon as it grows past
  the limit, so an unauthenticated client cannot make the server hold more than that.
- Every action is a POST allowed by `_allowed`: refused if its ``Origin`` is another site's;
  then the token in the form (a constant-time compare), which starts a session (the token is
  asked once per browser: an ``HttpOnly``, ``SameSite=Strict`` cookie, docs/adr/0129), or a
  live session's cookie with its CSRF token in the form. Anything else is refused (403) before
  anything is looked up, read or written, whether or not the flow exists. Each action carried
  out is logged at INFO with who (the client's address) and what, in ``extra=``.
- Read-only mode refuses every POST (403) before its body is read, and the templates show no
  forms.
- Every value reaches the page through Jinja2's autoescape; the one piece of markup made in
  Python, the chart, is built from numbers only. A Content-Security-Policy that allows no script
  at all is a second line.
- Requests whose ``Host`` is not the loopback name the server was bound to are refused, so a
  page on another site cannot read this one through DNS rebinding.
"""

from __future__ import annotations

import datetime
import hmac
import json
import logging
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from functools import partial
from importlib import resources
from typing import Any

import jinja2
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ferry.projected import Store

from ..._engine._client import connect
from ..._model import _values
from ..._model._checks import shown_number
from ..._model._errors import FlowError, StoreLocked
from ..._model._types import Delivery, State
from ..._store import _query, _triage
from .. import _bulk, _trace_url
from . import _session, _shown
from ._reads import (
    COUNT_CAP,
    SPANS,
    UNFINISHED,
    Reader,
    Series,
    Unavailable,
    page_flow,
    page_flows,
    page_overview,
)

_log = logging.getLogger("ferry.flow")

#: How often the overview reloads itself, and a page that found the store unavailable.
REFRESH = 5
PAGE = 50
_CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self';"
    " frame-ancestors 'none'; base-uri 'none'"
)
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")

#: The most bytes a request's body may have (a dashboard form holds an id, the token and at
#: most a wake's payload and message id): 413 beyond it, before it is read (docs/adr/0115).
MAX_BODY = 64 * 1024


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return ""
    d = t - now
    a = abs(d)
    text = (
        f"{a:.0f} s"
        if a < 120
        else f"{a / 60:.0f} min"
        if a < 7200
        else f"{a / 3600:.0f} h"
        if a < 172800
        else f"{a / 86400:.0f} d"
    )
    return f"in {text}" if d > 0 else f"{text} ago"


#: How much of an error the flows list and the overview show (the whole on hover, and on the
#: flow's page).
ERROR_WIDTH = 80
#: How many groups of failed and blocked flows the overview shows.
ERROR_GROUPS = 10


def _cut(text: str | None, width: int = ERROR_WIDTH) -> str:
    if text is None:
        return ""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _nice(top: int) -> int:
    """The least of 1, 2, 5, 10, 20, 50, ... at or above `top`."""
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= top:
                return m * scale
        scale *= 10


#: Where the x axis has a tick: seconds between ticks, and how a tick's time is written.
_TICKS = {"1h": (600, "%H:%M"), "24h": (4 * 3600, "%H:%M"), "7d": (86400, "%m-%d")}


def chart(series: Series, width: int = 640, height: int = 180) -> dict[str, Any]:
    """The overview's chart as numbers for the template's inline SVG: a polyline per series
    (started, completed and failed per bucket over the span), the y axis (flows per bucket,
    from 0 to a round number) and the x axis (UTC times at round ticks)."""
    n = len(series.started)
    top = _nice(max(1, *series.started, *series.completed, *series.failed))
    left, right, above, below = 44, 10, 10, 24
    inner_w, inner_h = width - left - right, height - above - below
    step = inner_w / max(1, n - 1)

    def x_of(i: float) -> float:
        return left + i * step

    def y_of(v: float) -> float:
        return above + inner_h - v * inner_h / top

    def points(values: tuple[int, ...]) -> str:
        return " ".join(f"{x_of(i):.1f},{y_of(v):.1f}" for i, v in enumerate(values))

    y_ticks = [(f"{y_of(v):.1f}", _shown.count(v)) for v in sorted({0, top // 2, top})]
    every, fmt = _TICKS.get(series.span, (600, "%H:%M"))
    end = series.start + (n - 1) * series.step
    x_ticks = []
    t = math.ceil(series.start / every) * every
    while t <= end:
        label = datetime.datetime.fromtimestamp(t, datetime.UTC).strftime(fmt)
        x_ticks.append((f"{x_of((t - series.start) / series.step):.1f}", label))
        t += every
    return {
        "width": width,
        "height": height,
        "top": top,
        "left": left,
        "right": width - right,
        "above": above,
        "bottom": above + inner_h,
        "y_ticks": y_ticks,
        "x_ticks": x_ticks,
        "per": _shown.duration(series.step),
        "span": series.span,
        "lines": [
            ("started", points(series.started), sum(series.started)),
            ("completed", points(series.completed), sum(series.completed)),
            ("failed", points(series.failed), sum(series.failed)),
        ],
    }


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ferry.flow._ops._dashboard", "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _shown.iso
    env.filters["num"] = _shown.count
    env.filters["duration"] = _shown.duration
    env.filters["compact"] = lambda v: json.dumps(v, ensure_ascii=False, sort_keys=True)
    env.filters["quote"] = lambda s: urllib.parse.quote(str(s), safe="")
    env.globals["ago"] = _ago
    env.globals["zip"] = zip
    env.globals["timeline"] = _shown.timeline
    env.globals["states"] = [s.name for s in State]
    env.globals["unfinished"] = UNFINISHED
    env.filters["error_of"] = _triage.error_of
    env.filters["cut"] = _cut
    return env


class _Headers:
    """Adds the security headers to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", _CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    # (same-origin: never to another site; with no-referrer, Chrome sends
                    # "Origin: null" with the dashboard's own forms, which _allowed refuses)
                    (b"referrer-policy", b"same-origin"),
                    (b"x-frame-options", b"DENY"),
                    (b"cache-control", b"no-store"),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class BodyTooLarge(HTTPException):
    """A request body over the dashboard's limit (413): raised where the body is read, as soon
    as it grows past the limit, so no more than the limit is ever held."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"the request body is over {limit} bytes, the most a dashboard form may hold:"
            " nothing was done\n",
        )


class _Unopened(Exception):
    """The operator's engine could not be opened: the store is gone or is no store (503)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Bounded:
    """Bounds every request body to `limit` bytes before it is read: a ``Content-Length`` over
    the limit is answered 413 at once (the body is never read; the server closes the
    connection), and the app's ``receive`` counts the bytes of a body without one and raises
    `BodyTooLarge` (413) the moment they pass the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            _log.warning(
                "dashboard: a %s of %s refused unread: its body of %d bytes is over the limit"
                " of %d",
                scope.get("method"),
                scope.get("path"),
                declared,
                self.limit,
            )
            exc = BodyTooLarge(self.limit)
            await PlainTextResponse(exc.detail, exc.status_code)(scope, receive, send)
            return
        seen = 0

        async def bounded() -> MutableMapping[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    _log.warning(
                        "dashboard: a %s of %s refused: its body grew past the limit of %d bytes",
                        scope.get("method"),
                        scope.get("path"),
                        self.limit,
                    )
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, bounded, send)


def _content_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` (None if it has none; the server has checked it is a
    number)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class Dashboard:
    """The pages and actions of one store. `store` is what the actions' client opens (an SQLite
    path or an open `PostgresStore`); `reader` does the reads; `where` names the store on the
    pages (a DSN's password masked); `answer_within`: seconds an action waits for the serving
    engine's answer (504 after it: the request stays stored)."""

    def __init__(
        self,
        *,
        reader: Reader,
        store: Store | str,
        where: str,
        token: str,
        read_only: bool = False,
        clock: Callable[[], float] = time.time,
        page_size: int = PAGE,
        max_body: int = MAX_BODY,
        trace_url: str | None = None,
        answer_within: float = 10.0,
    ) -> None:
        if trace_url is not None:
            _trace_url.check(trace_url)  # TypeError/ValueError naming what is wrong
        if not read_only and len(token) < 16:
            raise ValueError("the dashboard's token must be at least 16 characters")
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1024:
            raise ValueError(
                f"max_body must be a whole number of bytes >= 1024, got {shown_number(max_body)}"
            )
        if (
            isinstance(page_size, bool)
            or not isinstance(page_size, int)
            or not 1 <= page_size <= _query.MAX_LIMIT
        ):
            raise ValueError(
                f"page_size must be a whole number from 1 to {_query.MAX_LIMIT}, got"
                f" {shown_number(page_size)}"
            )
        self.reader = reader
        self.store = store
        self.where = where
        self._token = token
        self.read_only = read_only
        self.clock = clock
        self.page_size = page_size
        self.max_body = max_body
        self.trace_url = trace_url  # the link from a flow's page to its trace (None: no link)
        self.answer_within = answer_within  # seconds an action waits for the engine's answer
        self.env = _environment()
        self.sessions = _session.Sessions()
        self.count_cap = COUNT_CAP  # the most matches the list counts ("10,000+" past it)
        self.bulk_max = BULK_MAX  # the most flows one action on a filter acts on
        self._acting = trio.Lock()  # one operator engine at a time (SQLite: one engine lock)

    @property
    def token(self) -> str:
        """What an action's form must carry."""
        return self._token

    # ---------------------------------------------------------------------------- rendering

    def render(
        self, name: str, status: int = 200, *, refresh: int | None = None, **values: Any
    ) -> HTMLResponse:
        here = _session.current.get()
        session = None if here is None or here.ended else here.session
        html = self.env.get_template(name).render(
            where=self.where,
            read_only=self.read_only,
            csrf=None if session is None else session.csrf,
            refresh=refresh,
            now=self.clock(),
            **values,
        )
        return HTMLResponse(html, status_code=status)

    def unavailable(self, title: str, why: Unavailable) -> HTMLResponse:
        return self.render("unavailable.html", 503, refresh=REFRESH, title=title, reason=str(why))

    # -------------------------------------------------------------------------------- pages

    async def overview(self, request: Request) -> Response:
        now = self.clock()
        began = time.monotonic()
        span = request.query_params.get("span") or "1h"
        plan = request.query_params.get("plan") or None
        if span not in SPANS:
            span = "1h"  # (a bookmark of another version: the default rather than an error)
        try:
            o, errors = await self.reader.read(
                lambda tx: (
                    page_overview(tx, now=now, span=span, plan=plan),
                    _triage.failure_groups(tx, limit=ERROR_GROUPS),
                )
            )
        except Unavailable as why:
            return self.unavailable("Overview", why)
        # A store so big that the counts take long is asked less often (at most a tenth of the
        # time spent counting).
        refresh = max(REFRESH, math.ceil(10 * (time.monotonic() - began)))
        return self.render(
            "overview.html",
            refresh=refresh,
            o=o,
            chart=chart(o.series),
            spans=list(SPANS),
            errors=errors,
        )

    async def flows(self, request: Request) -> Response:
        q = request.query_params
        fields = {k: q.get(k, "") for k in _FILTER_FIELDS}
        after = q.get("after") or None
        before = q.get("before") or None
        try:
            flt = _query.FlowFilter.from_text(now=self.clock(), **fields)
        except (ValueError, TypeError) as exc:
            return self.render("flows.html", 400, fields=fields, page=None, problem=str(exc))
        try:
            page = await self.reader.read(
                lambda tx: page_flows(
                    tx, flt, after=after, before=before, limit=self.page_size, cap=self.count_cap
                )
            )
        except ValueError as exc:  # a cursor that is not ours
            return self.render("flows.html", 400, fields=fields, page=None, problem=str(exc))
        except Unavailable as why:
            return self.unavailable("Flows", why)
        keep = {k: v for k, v in fields.items() if v}
        nxt = (
            None
            if page.next is None
            else "?" + urllib.parse.urlencode({**keep, "after": page.next})
        )
        prev = (
            None
            if page.prev is None
            else "?" + urllib.parse.urlencode({**keep, "before": page.prev})
        )
        # (no "first page" link on the first page, reached back through "previous")
        back = (after or before) and (page.prev is not None or not page.flows)
        first = "?" + urllib.parse.urlencode(keep) if back else None
        return self.render(
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

    async def flow(self, request: Request) -> Response:
        done = _DONE.get(request.query_params.get("done") or "")
        via = _VIA.get(request.query_params.get("via") or "")
        notice = None if done is None else done if via is None else f"{done}; {via}"
        return await self.flow_page(request.query_params.get("id", ""), notice=notice)

    async def flow_page(
        self,
        fid: str,
        *,
        notice: str | None = None,
        problem: str | None = None,
        status: int = 200,
    ) -> Response:
        """The page of the flow `fid` (404 if there is none), with `notice` or `problem` said
        at the top and answered with `status`."""
        if not fid:
            return self.render("missing.html", 404, flow_id=fid)
        try:
            p = await self.reader.read(lambda tx: page_flow(tx, fid))
        except Unavailable as why:
            return self.unavailable("Flow", why)
        if p is None:
            return self.render("missing.html", 404, flow_id=fid)
        trace_id = _values.trace_id(p.flow.trace)
        trace = None
        if trace_id is not None:
            url = None if self.trace_url is None else _trace_url.link(self.trace_url, trace_id)
            trace = (trace_id, url)
        return self.render("flow.html", status, p=p, notice=notice, problem=problem, trace=trace)

    async def metrics(self, request: Request) -> Response:
        try:
            import prometheus_client
        except ImportError:
            return PlainTextResponse(
                "/metrics needs prometheus_client: pip install prometheus_client\n", 404
            )
        from ._metrics import scrape

        try:
            body = await self.reader.read(lambda tx: scrape(tx))
        except Unavailable as why:
            return PlainTextResponse(f"the store is unavailable: {why}\n", 503)
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------------------ actions

    def _allowed(self, request: Request, form: dict[str, str]) -> str | None:
        """Why this POST is refused, or None (docs/adr/0129). Nothing is looked up, read or
        written before this passes. A form from another site is refused; then the token in the
        form (which starts a session: the token is asked once per browser), or the session's
        cookie with its CSRF token in the form, lets it through."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers.raw}
        far = _session.cross_site(headers, request.url.scheme)
        if far is not None:
            return far
        here = _session.current.get()
        given = form.get("token", "")
        if given:
            if not hmac.compare_digest(given.encode(), self._token.encode()):
                return "wrong token: paste the token the serve command printed at start"
            if here is not None and here.session is None:
                here.session, here.started = self.sessions.start(_who(request)), True
            return None
        session = None if here is None else here.session
        csrf = form.get("csrf", "")
        if _session.csrf_ok(session, csrf):
            return None
        if csrf and session is None:
            return (
                "your session has ended (the dashboard restarted, or it lasted"
                f" {_session.TTL / 3600:g} h): paste the token the serve command printed again"
            )
        if csrf:
            return "this form does not belong to your session: reload the page and try again"
        return "no token: paste the token the serve command printed at start"

    async def end_session(self, request: Request) -> Response:
        """POST ``/session/end``: forget this browser's session (the token is asked again)."""
        form = await _form(request)
        refused = self._allowed(request, {"csrf": form.get("csrf", "")})
        here = _session.current.get()
        if refused is None and here is not None and here.session is not None:
            self.sessions.end(here.session.sid)
            here.ended = True
            _log.info(
                "dashboard: the session of %s ended",
                _who(request),
                extra={"action": "end session", "by": _who(request)},
            )
        return RedirectResponse("/", 303)

    def _refused(self, action: str, fid: str | None, why: str) -> Response:
        """403: the POST was refused before anything was looked up (the flow may not exist)."""
        if action.startswith("bulk"):
            _log.warning("dashboard: %s refused: %s", action, why)
        else:
            _log.warning(
                "dashboard: %s of flow %r refused: %s", action, fid, why, extra={"flow_id": fid}
            )
        return self.render("refused.html", 403, flow_id=fid or "", problem=why)

    async def act(self, request: Request) -> Response:
        action = request.path_params["action"]
        if self.read_only:  # before the body is read
            return self._refused(action, None, "this dashboard is read-only: actions are refused")
        try:
            form = await _form(request)
        except BodyTooLarge as exc:
            return PlainTextResponse(exc.detail, exc.status_code)
        refused = self._allowed(request, form)
        if refused is not None:
            return self._refused(action, form.get("id"), refused)
        fid = form.get("id", "")
        if not fid:
            return PlainTextResponse("which flow? the form has no id\n", 400)
        try:
            call = _call(action, fid, form, _who(request))
        except ValueError as exc:
            return await self.flow_page(fid, problem=str(exc), status=400)
        try:
            async with self._acting:
                outcome, served = await self._with_client(call)
        except trio.TooSlowError as exc:
            return await self.flow_page(fid, status=504, problem=" ".join(str(exc).split()))
        except _Unopened as why:  # gone, a directory, not a store: the page says unavailable
            _log.warning(
                "dashboard: %s of flow %r refused: the store cannot be opened (%s)",
                action,
                fid,
                why.reason,
                extra={"flow_id": fid},
            )
            return await self.flow_page(
                fid,
                status=503,
                problem=f"the store is unavailable, nothing was done: {why.reason}",
            )
        except (FlowError, ValueError, TypeError) as exc:
            return await self.flow_page(fid, problem=f"refused: {exc}", status=409)
        except Exception as exc:  # the store: said on the page, and logged
            _log.warning(
                "dashboard: %s of flow %r failed",
                action,
                fid,
                exc_info=True,
                extra={"flow_id": fid},
            )
            return await self.flow_page(
                fid,
                status=503,
                problem=f"the store is unavailable, nothing was done: {type(exc).__name__}:"
                f" {' '.join(str(exc).split())}",
            )
        key = _outcome_key(action, outcome)
        who = _who(request)
        _log.info(
            "dashboard: %s of flow %r by %s: %s",
            action,
            fid,
            who,
            key or "did not apply",
            extra={"flow_id": fid, "action": action, "by": who, "outcome": key or "did not apply"},
        )
        if key is None:
            return await self.flow_page(
                fid, status=409, problem=f"{action} did not apply: {_NOT_DONE[action]}"
            )
        via = "engine" if served else "here"
        return RedirectResponse(
            f"/flow?id={urllib.parse.quote(fid, safe='')}&done={key}&via={via}", 303
        )

    # ------------------------------------------------------------------- actions on a filter

    def _bulk_filter(
        self, values: Mapping[str, str]
    ) -> tuple[dict[str, str], _query.FlowFilter | None, str | None]:
        """The filter's fields, the filter (None if they are wrong) and what is wrong."""
        fields = {k: values.get(k, "") for k in _FILTER_FIELDS}
        try:
            return fields, _query.FlowFilter.from_text(now=self.clock(), **fields), None
        except (ValueError, TypeError) as exc:
            return fields, None, str(exc)

    async def bulk_confirm(self, request: Request) -> Response:
        """GET ``/flows/bulk?action=...&<filters>``: how many flows the action would be tried
        on, and the form (reason, token) that does it. Nothing is done here."""
        action = request.query_params.get("action", "")
        fields, flt, problem = self._bulk_filter(request.query_params)
        if action not in _BULK:
            problem = f"no action {action!r} on many flows: cancel, resume or abandon"
        if flt is None or problem is not None:
            return self.render("bulk.html", 400, action=action, fields=fields, problem=problem)
        try:
            matches = await self.reader.read(lambda tx: _query.count_upto(tx, flt, self.bulk_max))
        except Unavailable as why:
            return self.unavailable("Act on many flows", why)
        return self.render(
            "bulk.html",
            action=action,
            fields=fields,
            problem=None,
            matches=matches,
            cap=self.bulk_max,
            applies=_BULK[action],
            query=urllib.parse.urlencode({k: v for k, v in fields.items() if v}),
            results=None,
        )

    async def bulk(self, request: Request) -> Response:
        """POST ``/flows/bulk``: the action on each flow the filter matches (at most
        `BULK_MAX`, newest first), each in its own call, with the operator's engine; the page
        says what became of them (a flow that moved on meanwhile is not acted on)."""
        if self.read_only:  # before the body is read
            return self._refused("bulk", None, "this dashboard is read-only: actions are refused")
        try:
            form = await _form(request)
        except BodyTooLarge as exc:
            return PlainTextResponse(exc.detail, exc.status_code)
        action = form.get("action", "")
        refused = self._allowed(request, form)
        if refused is not None:
            return self._refused(f"bulk {action}", None, refused)
        fields, flt, problem = self._bulk_filter(form)
        reason = form.get("reason", "").strip()
        if action not in _BULK:
            problem = f"no action {action!r} on many flows: cancel, resume or abandon"
        elif action == "abandon" and not reason:
            problem = "abandon needs a reason (what was done by hand instead): nothing was done"
        if flt is None or problem is not None:
            return self.render("bulk.html", 400, action=action, fields=fields, problem=problem)
        who = _who(request)
        one: Callable[[Any, str], Awaitable[_bulk.Done]]
        if action == "cancel":
            one = partial(_bulk.cancel_one, reason=reason or "cancelled by an operator (dashboard)")
        elif action == "resume":
            one = _bulk.resume_one
        else:
            one = partial(_bulk.abandon_one, reason=reason, by=who)
        try:
            ids = await self.reader.read(
                lambda tx: [f.flow_id for f in _bulk.matching(tx, flt, limit=self.bulk_max)[0]]
            )
        except Unavailable as why:
            return self.unavailable("Act on many flows", why)
        results: list[tuple[str, bool, str]] = []

        async def each(client: Any) -> None:
            for fid in ids:
                acted, what, _state = await one(client, fid)
                results.append((fid, acted, what))

        problem = None
        status = 200
        try:
            async with self._acting:
                await self._with_client(each)
        except trio.TooSlowError as exc:
            status, problem = 504, " ".join(str(exc).split())
        except StoreLocked:
            status, problem = 409, _LOCKED
        except _Unopened as why:
            status, problem = 503, f"the store is unavailable, nothing was done: {why.reason}"
        except Exception as exc:  # the store: said on the page with what was done, and logged
            _log.warning(
                "dashboard: bulk %s failed after %d flows", action, len(results), exc_info=True
            )
            status = 503
            problem = (
                f"the store failed after {len(results)} flow(s), the rest untouched:"
                f" {type(exc).__name__}: {' '.join(str(exc).split())}"
            )
        acted = sum(1 for r in results if r[1])
        if results:
            _log.info(
                "dashboard: bulk %s by %s: acted on %d of %d flows (%s)",
                action,
                who,
                acted,
                len(results),
                _describe(fields),
                extra={
                    "action": f"bulk {action}",
                    "by": who,
                    "acted": acted,
                    "tried": len(results),
                    "filter": _describe(fields),
                },
            )
        tally: dict[str, int] = {}
        for _fid, _done, what in results:
            tally[what] = tally.get(what, 0) + 1
        return self.render(
            "bulk.html",
            status,
            action=action,
            fields=fields,
            problem=problem,
            matches=len(ids),
            cap=self.bulk_max,
            applies=_BULK[action],
            query=urllib.parse.urlencode({k: v for k, v in fields.items() if v}),
            results=results,
            acted=acted,
            tally=sorted(tally.items(), key=lambda kv: -kv[1]),
        )

    async def _with_client(self, call: Callable[[Any], Awaitable[Any]]) -> tuple[Any, bool]:
        """``call(client)`` with a client of the store (`flow.connect`, which never creates the
        store's file): its result, and whether the engine serving the store applied it (False:
        no engine serves it, the client applied it itself). `_Unopened` if the store could not
        be opened."""
        opened = False
        try:
            async with connect(self.store, timeout=self.answer_within) as client:
                opened = True
                result = await call(client)
                return result, client.last is not None and client.last.served
        except Exception as exc:
            if opened:
                raise
            raise _Unopened(f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc

    # -------------------------------------------------------------------------------- app

    def app(self, *, hosts: list[str] | None = None) -> ASGIApp:
        static = resources.files("ferry.flow._ops._dashboard") / "static"
        routes = [
            Route("/", self.overview),
            Route("/flows", self.flows),
            Route("/flow", self.flow),
            Route("/flow/{action:str}", self.act, methods=["POST"]),
            Route("/flows/bulk", self.bulk_confirm, methods=["GET"]),
            Route("/flows/bulk", self.bulk, methods=["POST"]),
            Route("/metrics", self.metrics),
            Route("/session/end", self.end_session, methods=["POST"]),
            Mount("/static", app=StaticFiles(directory=str(static)), name="static"),
        ]
        middleware = []
        if hosts is not None:
            middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=hosts))
        app = Starlette(routes=routes, middleware=middleware)
        return _Headers(_Bounded(_session.Middleware(app, self.sessions), self.max_body))


_FILTER_FIELDS = (
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
)

_LOCKED = (
    "an engine was opening this SQLite file at that moment (on SQLite one engine holds the"
    " file): nothing was done; try again once it serves it"
)

#: The most flows one action on a filter acts on (newest first; the page says so).
BULK_MAX = 10_000

#: The actions on a filter, and the flows each applies to.
_BULK = {
    "cancel": "running or parked flows (they compensate their completed steps)",
    "resume": "BLOCKED flows (they run again from where they were blocked)",
    "abandon": "BLOCKED flows (they end FAILED without running the compensations left)",
}


def _describe(fields: Mapping[str, str]) -> str:
    """The filter as the form gave it: ``state=BLOCKED plan=order`` (``every flow``)."""
    return " ".join(f"{k}={v}" for k, v in fields.items() if v) or "every flow"


_DONE = {
    "wake-RESUMED": "woken: it was parked and runs its next step",
    "wake-QUEUED": "woken: the message is kept in its mailbox for its next park",
    "wake-DUPLICATE": "not woken again: this message id was delivered before",
    "cancel": "cancelled: it compensates its completed steps",
    "resume": "resumed",
    "abandon": "abandoned: it ended FAILED without running the compensations left",
}
#: What happens now, by who applied the action (the redirect's ``via``).
_VIA = {
    "engine": "accepted and applied by the engine serving the store, which runs what follows now",
    "here": "no engine serves the store: the dashboard applied it, and what follows waits for"
    " the next engine to open the store",
}
_NOT_DONE = {
    "wake": "the flow has ended (or is unknown)",
    "cancel": "only a running or parked flow can be cancelled",
    "resume": "only a BLOCKED flow whose plan version is known can be resumed",
    "abandon": "only a BLOCKED flow can be abandoned",
}


def _who(request: Request) -> str:
    """Who made the request, as the audit log and an abandon record it: the dashboard and the
    client's address (the dashboard has no user accounts; the token is shared)."""
    client = request.client
    return f"dashboard ({client.host if client else 'unknown address'})"


async def _form(request: Request) -> dict[str, str]:
    """The POST's urlencoded form (the last value of each field); parsed here, so that the
    dashboard needs no multipart parser. The body is at most the dashboard's limit (`_Bounded`
    raises `BodyTooLarge` past it)."""
    body = await request.body()
    pairs = urllib.parse.parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
    return dict(pairs)


def _call(action: str, fid: str, form: dict[str, str], who: str) -> Callable[[Any], Awaitable[Any]]:
    """What the operator's engine is asked to do (`who` is recorded by an abandon);
    `ValueError` for a bad action or field."""
    if action == "wake":
        text = form.get("payload", "").strip() or "null"
        try:
            payload = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
        except ValueError as exc:
            raise ValueError(f"the payload is not JSON ({exc}): nothing was done") from None
        mid = form.get("message_id", "").strip() or None
        return lambda e: e.wake(fid, payload, message_id=mid)
    if action == "cancel":
        reason = form.get("reason", "").strip() or "cancelled by an operator (dashboard)"
        return lambda e: e.cancel(fid, reason)
    if action == "resume":
        return lambda e: e.resume(fid)
    if action == "abandon":
        why = form.get("reason", "").strip()
        if not why:
            raise ValueError(
                "abandon needs a reason (what was done by hand instead of the compensations"
                " it skips): nothing was done"
            )
        return lambda e: e.abandon(fid, reason=why, by=who)
    raise ValueError(f"no action {action!r}: wake, cancel, resume or abandon")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{shown_number(text)} is too big for a number")
    return value


def _outcome_key(action: str, outcome: Any) -> str | None:
    if action == "wake":
        if outcome in (Delivery.STALE, Delivery.UNKNOWN):
            return None
        return f"wake-{outcome.name}"
    return action if outcome else None


def loopback_hosts(host: str) -> list[str] | None:
    """The ``Host`` names accepted when bound to `host`: the loopback names (with any port) for
    a loopback address; None (any) otherwise, where the operator chose to be reachable."""
    if host in _LOOPBACK or host.startswith("127."):
        return [*_LOOPBACK, host]
    return None
