"""The dashboard's ASGI app (Starlette, Jinja2 with autoescape): pages and actions.

Pages (GET): ``/`` the overview, ``/flows`` the list (filters and keyset pages), ``/flow?id=``
one flow, ``/metrics`` (with prometheus_client), ``/static/...``. Actions (POST):
``/flow/wake``, ``/flow/cancel``, ``/flow/resume``, each with the form fields ``id`` and
``token``. Nothing here runs a step: reads go through a `Reader` (read-only transactions), and
actions through a client (`flow.connect`: the engine serving the store applies them, or, with
none serving, the client itself through an operator's engine), opened for the
action and closed after it, as the inspector's are (docs/adr/0044).

The safety rules (docs/adr/0081), each enforced in one place:

- Every request body is bounded before it is read (`_Bounded`, docs/adr/0115): a
  ``Content-Length`` over `MAX_BODY` (64 KiB by default) is answered 413 before a byte of the
  body is read, and a body without one (chunked) is cut off with a 413 as soon as it grows past
  the limit, so an unauthenticated client cannot make the server hold more than that.
- Every action is a POST whose form carries the token (`_allowed`, a constant-time compare); a
  wrong or missing token is refused (403) before anything is looked up, read or written, whether
  or not the flow exists. The token is in the form, never in a cookie or a URL: another site
  cannot make a browser send it.
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
from collections.abc import Awaitable, Callable, MutableMapping
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
from ..._model._checks import shown_number
from ..._model._errors import FlowError
from ..._model._types import Delivery, State
from ..._store import _query
from ._reads import (
    MINUTES,
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


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


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


def chart(series: Series, width: int = 600, height: int = 140) -> dict[str, Any]:
    """The overview's chart as numbers for the template's inline SVG: a polyline per series
    (started, completed, failed per minute over the last hour) and the scale."""
    top = max(1, *series.started, *series.completed, *series.failed)
    pad = 4
    step = (width - 2 * pad) / (MINUTES - 1)

    def points(values: tuple[int, ...]) -> str:
        return " ".join(
            f"{pad + i * step:.1f},{height - pad - v * (height - 2 * pad) / top:.1f}"
            for i, v in enumerate(values)
        )

    return {
        "width": width,
        "height": height,
        "top": top,
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
    env.filters["when"] = _when
    env.filters["compact"] = lambda v: json.dumps(v, ensure_ascii=False, sort_keys=True)
    env.filters["quote"] = lambda s: urllib.parse.quote(str(s), safe="")
    env.globals["ago"] = _ago
    env.globals["zip"] = zip
    env.globals["states"] = [s.name for s in State]
    env.globals["unfinished"] = UNFINISHED
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
                    (b"referrer-policy", b"no-referrer"),
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
        answer_within: float = 10.0,
    ) -> None:
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
        self.answer_within = answer_within  # seconds an action waits for the engine's answer
        self.env = _environment()
        self._acting = trio.Lock()  # one operator engine at a time (SQLite: one engine lock)

    @property
    def token(self) -> str:
        """What an action's form must carry."""
        return self._token

    # ---------------------------------------------------------------------------- rendering

    def render(
        self, name: str, status: int = 200, *, refresh: int | None = None, **values: Any
    ) -> HTMLResponse:
        html = self.env.get_template(name).render(
            where=self.where,
            read_only=self.read_only,
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
        try:
            o = await self.reader.read(lambda tx: page_overview(tx, now=now))
        except Unavailable as why:
            return self.unavailable("Overview", why)
        # A store so big that the counts take long is asked less often (at most a tenth of the
        # time spent counting).
        refresh = max(REFRESH, math.ceil(10 * (time.monotonic() - began)))
        return self.render("overview.html", refresh=refresh, o=o, chart=chart(o.series))

    async def flows(self, request: Request) -> Response:
        q = request.query_params
        fields = {k: q.get(k, "") for k in _FILTER_FIELDS}
        after = q.get("after") or None
        try:
            flt = _query.FlowFilter.from_text(now=self.clock(), **fields)
        except (ValueError, TypeError) as exc:
            return self.render("flows.html", 400, fields=fields, page=None, problem=str(exc))
        try:
            page = await self.reader.read(
                lambda tx: page_flows(tx, flt, after=after, limit=self.page_size)
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
        first = "?" + urllib.parse.urlencode(keep) if after else None
        return self.render(
            "flows.html",
            fields=fields,
            page=page,
            problem=None,
            next=nxt,
            first=first,
            by_id=flt.by_id,
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
        return self.render("flow.html", status, p=p, notice=notice, problem=problem)

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

    def _allowed(self, form: dict[str, str]) -> str | None:
        """Why this POST is refused, or None. Nothing is looked up, read or written before
        this passes."""
        given = form.get("token", "")
        if not given:
            return "no token: paste the token the serve command printed at start"
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            return "wrong token: paste the token the serve command printed at start"
        return None

    def _refused(self, action: str, fid: str | None, why: str) -> Response:
        """403: the POST was refused before anything was looked up (the flow may not exist)."""
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
        refused = self._allowed(form)
        if refused is not None:
            return self._refused(action, form.get("id"), refused)
        fid = form.get("id", "")
        if not fid:
            return PlainTextResponse("which flow? the form has no id\n", 400)
        try:
            call = _call(action, fid, form)
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
        _log.info(
            "dashboard: %s of flow %r by an operator: %s",
            action,
            fid,
            key or "did not apply",
            extra={"flow_id": fid},
        )
        if key is None:
            return await self.flow_page(
                fid, status=409, problem=f"{action} did not apply: {_NOT_DONE[action]}"
            )
        via = "engine" if served else "here"
        return RedirectResponse(
            f"/flow?id={urllib.parse.quote(fid, safe='')}&done={key}&via={via}", 303
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
            Route("/metrics", self.metrics),
            Mount("/static", app=StaticFiles(directory=str(static)), name="static"),
        ]
        middleware = []
        if hosts is not None:
            middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=hosts))
        return _Headers(_Bounded(Starlette(routes=routes, middleware=middleware), self.max_body))


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
)

_DONE = {
    "wake-RESUMED": "woken: it was parked and runs its next step",
    "wake-QUEUED": "woken: the message is kept in its mailbox for its next park",
    "wake-DUPLICATE": "not woken again: this message id was delivered before",
    "cancel": "cancelled: it compensates its completed steps",
    "resume": "resumed",
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
}


async def _form(request: Request) -> dict[str, str]:
    """The POST's urlencoded form (the last value of each field); parsed here, so that the
    dashboard needs no multipart parser. The body is at most the dashboard's limit (`_Bounded`
    raises `BodyTooLarge` past it)."""
    body = await request.body()
    pairs = urllib.parse.parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
    return dict(pairs)


def _call(action: str, fid: str, form: dict[str, str]) -> Callable[[Any], Awaitable[Any]]:
    """What the operator's engine is asked to do; `ValueError` for a bad action or field."""
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
    raise ValueError(f"no action {action!r}: wake, cancel or resume")


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
