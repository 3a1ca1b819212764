"""The dashboard's live page of a flow's stream (``GET /flow/stream?id=...&after=N``, SPEC 5.10):
one HTML response written as the flow's steps emit, with no script (the dashboard's
Content-Security-Policy allows none): the page's head, then a row per value as it arrives, then
its end once the flow has ended (or after `LIVE_MINUTES`; the page links to where to follow
on). The values come from a client of the store (`flow.connect`: told of the store's changes,
never polling, docs/adr/0177); every value goes through Jinja2's autoescape (the page is
rendered once with markers, and cut at them). A browser that goes away ends the response.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..._engine._client import connect
from ..._model._errors import UnknownFlow

if TYPE_CHECKING:
    from ._app import Dashboard

#: How long one live page follows a stream (a flow may stay parked for days).
LIVE_MINUTES = 10
_ROWS = "\x00rows\x00"
_TAIL = "\x00tail\x00"


async def stream_page(dash: Dashboard, request: Request) -> Response:
    fid = request.query_params.get("id", "")
    try:
        after = int(request.query_params.get("after") or 0)
    except ValueError:
        after = -1
    if not fid or after < 0:
        return dash.render("missing.html", 404, flow_id=fid)
    page = dash.render(
        "stream.html", flow_id=fid, after=after, minutes=LIVE_MINUTES, rows=_ROWS, tail=_TAIL
    )
    return _Live(dash, fid, after, bytes(page.body).decode())


class _Live(Response):
    """The page, written as its values come (chunked), by a client of the store."""

    def __init__(self, dash: Dashboard, flow_id: str, after: int, page: str) -> None:
        super().__init__(media_type="text/html")
        self._dash = dash
        self._flow_id = flow_id
        self._after = after
        self._head, rest = page.split(_ROWS, 1)
        self._between, self._foot = rest.split(_TAIL, 1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/html; charset=utf-8")]  # no length: chunked
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._chunk(send, self._head)
        end = await self._follow(send)
        await self._chunk(send, self._between + end + self._foot, more=False)

    async def _chunk(self, send: Send, text: str, *, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": text.encode(), "more_body": more})

    async def _follow(self, send: Send) -> str:
        """Write a row per value until the flow ended (or the time is up); the end's text."""
        env, dash, fid = self._dash.env, self._dash, self._flow_id
        row, end = env.get_template("stream_row.html"), env.get_template("stream_end.html")
        last, count = self._after, 0
        said: dict[str, Any] = {"flow_id": fid, "minutes": LIVE_MINUTES, "ended": False}
        try:
            async with connect(dash.store, timeout=dash.answer_within) as client:
                values = client.stream(fid, after=self._after)
                with trio.move_on_after(LIVE_MINUTES * 60) as timer:
                    async for offset, value in values:
                        text = json.dumps(value, ensure_ascii=False, sort_keys=True)
                        await self._chunk(send, row.render(offset=offset, value=text))
                        last, count = offset, count + 1
        except UnknownFlow:
            return end.render(**said, problem=f"no flow has id {fid!r}", last=last, count=count)
        except (OSError, ValueError) as exc:  # the store: missing, not a flow store, a disk error
            problem = f"{type(exc).__name__}: {exc}"
            return end.render(**said, problem=problem, last=last, count=count)
        said["ended"] = not timer.cancelled_caught
        return end.render(**said, problem=None, count=count, last=last)
