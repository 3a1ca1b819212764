"""The dashboard's sessions: the token is asked once per browser (docs/adr/0129).

An action whose form carries the right token starts a session: a random id in a cookie
(``HttpOnly``: no script can read it; ``SameSite=Strict``: no other site's page can make the
browser send it; ``Secure`` when the request came over https; ``Path=/``; no ``Max-Age``, so it
ends with the browser) and, kept on the server with it, a random CSRF token that the pages put
in a hidden field of every form. A POST is allowed with the token in its form (as before), or
with a live session's cookie *and* its CSRF token in the form (compared in constant time).
Before either is looked at, a POST whose ``Origin`` (or ``Sec-Fetch-Site``) says it came from
another site is refused.

Sessions live in the dashboard's memory: a restart (which makes a new token unless one is
given) ends them all. Each lasts at most `TTL` seconds; at most `MOST` are kept (the oldest
go first).
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ._guard import read_form, who_sent

_log = logging.getLogger("ferry.flow")

COOKIE = "ferry_flow_session"
#: How long a session lasts (seconds) and how many are kept at most.
TTL = 12 * 3600.0
MOST = 1000


@attrs.frozen
class Session:
    sid: str
    csrf: str
    who: str  # the address that started it
    until: float


@attrs.define
class InRequest:
    """The session of the request being answered: the cookie's (`session`), and whether the
    response starts a new one (`started`) or ends the cookie (`ended`)."""

    session: Session | None
    started: bool = False
    ended: bool = False


#: The session of the request being answered (set by `Middleware`).
current: contextvars.ContextVar[InRequest | None] = contextvars.ContextVar(
    "ferry_flow_dashboard_session", default=None
)


def _cookie(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, v = part.strip().partition("=")
                if key == COOKIE:
                    return v
    return None


class Middleware:
    """Finds the request's session by its cookie (`current`), and adds the ``Set-Cookie`` of
    a session the answer started (or ended) to the response's headers."""

    def __init__(self, app: ASGIApp, sessions: Sessions) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        here = InRequest(self.sessions.find(_cookie(scope.get("headers", []))))
        secure = scope.get("scheme") == "https"

        async def with_cookie(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start" and (here.started or here.ended):
                value = cookie_header(None if here.ended else here.session, secure=secure)
                headers = [*message.get("headers", []), (b"set-cookie", value.encode())]
                message = {**message, "headers": headers}
            await send(message)

        token = current.set(here)
        try:
            await self.app(scope, receive, with_cookie)
        finally:
            current.reset(token)


class Sessions:
    """The live sessions of one dashboard."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._clock = clock

    def start(self, who: str) -> Session:
        """A new session for the browser at `who` (the oldest dropped past `MOST`)."""
        s = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), who, self._clock() + TTL)
        self._by_id[s.sid] = s
        while len(self._by_id) > MOST:
            self._by_id.popitem(last=False)
        return s

    def find(self, sid: str | None) -> Session | None:
        """The live session of the cookie's value `sid` (None if none, or it has ended)."""
        if not sid:
            return None
        s = self._by_id.get(sid)
        if s is None:
            return None
        if s.until < self._clock():
            del self._by_id[sid]
            return None
        return s

    def end(self, sid: str) -> None:
        self._by_id.pop(sid, None)

    def __len__(self) -> int:
        return len(self._by_id)


def csrf_ok(session: Session | None, given: str) -> bool:
    """Does the form's CSRF token `given` belong to `session`?"""
    return (
        session is not None
        and bool(given)
        and hmac.compare_digest(given.encode(), session.csrf.encode())
    )


def cookie_header(session: Session | None, *, secure: bool) -> str:
    """The ``Set-Cookie`` value that starts `session` (or, for None, ends the cookie)."""
    value = "" if session is None else session.sid
    parts = [f"{COOKIE}={value}", "Path=/", "HttpOnly", "SameSite=Strict"]
    if session is None:
        parts.append("Max-Age=0")
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


def cross_site(headers: dict[str, str], scheme: str) -> str | None:
    """Why a POST with these (lower-case) headers came from another site, or None. Browsers
    send ``Origin`` with every form POST; it must be this dashboard's own (scheme and
    ``Host``). ``Sec-Fetch-Site: cross-site`` is refused too."""
    if headers.get("sec-fetch-site", "") == "cross-site":
        return "the form was sent from another site (Sec-Fetch-Site: cross-site)"
    origin = headers.get("origin")
    if origin is None:
        return None  # not a browser's form (curl, a script with the token): the token decides
    host = headers.get("host", "")
    if origin != f"{scheme}://{host}":
        return f"the form was sent from another origin ({origin!r}, this is {scheme}://{host})"
    return None


def allowed(
    request: Request, form: dict[str, str], *, token: str, sessions: Sessions
) -> str | None:
    """Why this POST is refused, or None (docs/adr/0129). Nothing is looked up, read or
    written before this passes. A form from another site is refused; then the token in the
    form (which starts a session: the token is asked once per browser), or the session's
    cookie with its CSRF token in the form, lets it through."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers.raw}
    far = cross_site(headers, request.url.scheme)
    if far is not None:
        return far
    here = current.get()
    given = form.get("token", "")
    if given:
        if not hmac.compare_digest(given.encode(), token.encode()):
            return "wrong token: paste the token the serve command printed at start"
        if here is not None and here.session is None:
            here.session, here.started = sessions.start(who_sent(request)), True
        return None
    session = None if here is None else here.session
    csrf = form.get("csrf", "")
    if csrf_ok(session, csrf):
        return None
    if csrf and session is None:
        return (
            "your session has ended (the dashboard restarted, or it lasted"
            f" {TTL / 3600:g} h): paste the token the serve command printed again"
        )
    if csrf:
        return "this form does not belong to your session: reload the page and try again"
    return "no token: paste the token the serve command printed at start"


async def end(request: Request, *, token: str, sessions: Sessions) -> Response:
    """POST ``/session/end``: forget this browser's session (the token is asked again)."""
    form = await read_form(request)
    refused = allowed(request, {"csrf": form.get("csrf", "")}, token=token, sessions=sessions)
    here = current.get()
    if refused is None and here is not None and here.session is not None:
        sessions.end(here.session.sid)
        here.ended = True
        _log.info(
            "dashboard: the session of %s ended",
            who_sent(request),
            extra={"action": "end session", "by": who_sent(request)},
        )
    return RedirectResponse("/", 303)
