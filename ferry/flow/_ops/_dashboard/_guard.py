"""The dashboard's guards around every request (docs/adr/0081, 0115): the security headers on
every response, a request body bounded before it is read, the loopback ``Host`` names; and the
two things every POST reads first, its form and who sent it.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import MutableMapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

_log = logging.getLogger("ferry.flow")

CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self';"
    " frame-ancestors 'none'; base-uri 'none'"
)
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")

#: The most bytes a request's body may have (a dashboard form holds an id, the token and at
#: most a wake's payload and message id): 413 beyond it, before it is read (docs/adr/0115).
MAX_BODY = 64 * 1024


class Headers:
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
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    # (same-origin: never to another site; with no-referrer, Chrome sends
                    # "Origin: null" with the dashboard's own forms, which _session.allowed refuses)
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


class Bounded:
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
        declared = content_length(scope)
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


def content_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` (None if it has none; the server has checked it is a
    number)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def who_sent(request: Request) -> str:
    """Who made the request, as the audit log and an abandon record it: the dashboard and the
    client's address (the dashboard has no user accounts; the token is shared)."""
    client = request.client
    return f"dashboard ({client.host if client else 'unknown address'})"


async def read_form(request: Request) -> dict[str, str]:
    """The POST's urlencoded form (the last value of each field); parsed here, so that the
    dashboard needs no multipart parser. The body is at most the dashboard's limit (`Bounded`
    raises `BodyTooLarge` past it)."""
    body = await request.body()
    pairs = urllib.parse.parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
    return dict(pairs)


def loopback_hosts(host: str) -> list[str] | None:
    """The ``Host`` names accepted when bound to `host`: the loopback names (with any port) for
    a loopback address; None (any) otherwise, where the operator chose to be reachable."""
    if host in LOOPBACK or host.startswith("127."):
        return [*LOOPBACK, host]
    return None
