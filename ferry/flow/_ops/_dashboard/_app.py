"""The dashboard's ASGI app (Starlette, Jinja2 with autoescape): pages and actions.

Pages (GET): ``/`` the overview, ``/flows`` the list (filters, a bounded count of the matches,
keyset pages both ways), ``/flow?id=`` one flow, ``/flows/bulk?action=`` the confirmation of an
action on a filter, ``/metrics`` (with prometheus_client), ``/schedules`` the stored schedules
(`_schedules_page`), ``/static/...``. Actions (POST):
``/flow/wake``, ``/flow/cancel``, ``/flow/resume``, ``/flow/abandon`` (form fields ``id`` and the
credentials), ``/flows/bulk`` (an action on every flow a filter matches, at most `BULK_MAX`),
``/session/end``. Nothing here runs a step: reads go through a `Reader` (read-only
transactions), and actions through a client (`flow.connect`: the engine serving the store
applies them, or, with none serving, the client itself through an operator's engine), opened
for the action and closed after it, as the inspector's are (docs/adr/0044, 0125).

This module holds `Dashboard` (what one store's dashboard is configured with, how a page is
rendered, the routes); the rest is split by concern: the pages (`_pages`), the actions on one
flow (`_acts`) and on a filter (`_on_many`), the session and the check of every POST
(`_session`), the guards around every request (`_guard`), the templates' environment and the
chart (`_render`).

The safety rules (docs/adr/0081, 0115, 0129), each enforced in one place:

- Every request body is bounded before it is read (`_guard.Bounded`, docs/adr/0115): a
  ``Content-Length`` over `MAX_BODY` (64 KiB by default) is answered 413 before a byte of the
  body is read, and a body without one (chunked) is cut off with a 413 as soon as it grows past
  the limit, so an unauthenticated client cannot make the server hold more than that.
- Every action is a POST allowed by `_session.allowed`: refused if its ``Origin`` is another
  site's; then the token in the form (a constant-time compare), which starts a session (the token is
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

import time
from collections.abc import Callable
from functools import partial
from importlib import resources
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import HTMLResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from ferry.projected import Store

from ..._model._checks import shown_number
from ..._store import _query
from .. import _trace_url
from . import _acts, _live, _on_many, _pages, _schedules_page, _session
from ._guard import MAX_BODY, Bounded, Headers
from ._guard import loopback_hosts as loopback_hosts
from ._reads import COUNT_CAP, Reader, Unavailable
from ._render import REFRESH, environment

__all__ = ["MAX_BODY", "PAGE", "Dashboard", "loopback_hosts"]

#: How many flows a page of the list shows, unless told.
PAGE = 50


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
        self.env = environment()
        self.sessions = _session.Sessions()
        self.count_cap = COUNT_CAP  # the most matches the list counts ("10,000+" past it)
        self.bulk_max = _on_many.BULK_MAX  # the most flows one action on a filter acts on
        self.acting = trio.Lock()  # one operator engine at a time (SQLite: one engine lock)

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

    def app(self, *, hosts: list[str] | None = None) -> ASGIApp:
        """The ASGI app: the routes of the pages and actions, inside the session's middleware
        and the guards (a body bounded before it is read, the security headers)."""
        static = resources.files("ferry.flow._ops._dashboard") / "static"
        routes = [
            Route("/", partial(_pages.overview, self)),
            Route("/flows", partial(_pages.flows, self)),
            Route("/flow", partial(_pages.flow, self)),
            Route("/flow/stream", partial(_live.stream_page, self)),
            Route("/flow/{action:str}", partial(_acts.act, self), methods=["POST"]),
            Route("/flows/bulk", partial(_on_many.confirm, self), methods=["GET"]),
            Route("/flows/bulk", partial(_on_many.act, self), methods=["POST"]),
            Route("/metrics", partial(_pages.metrics, self)),
            Route("/schedules", partial(_schedules_page.schedules, self)),
            Route(
                "/session/end",
                partial(_session.end, token=self._token, sessions=self.sessions),
                methods=["POST"],
            ),
            Mount("/static", app=StaticFiles(directory=str(static)), name="static"),
        ]
        middleware = []
        if hosts is not None:
            middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=hosts))
        app = Starlette(routes=routes, middleware=middleware)
        return Headers(Bounded(_session.Middleware(app, self.sessions), self.max_body))
