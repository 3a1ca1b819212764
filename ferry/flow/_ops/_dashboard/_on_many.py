"""The dashboard's actions on a filter (``/flows/bulk``): the confirmation page (GET: how many
flows the action would be tried on) and the action on each flow the filter matches (POST), each
in its own call, through `_bulk` like the inspector's.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..._model._errors import StoreLocked
from ..._store import _query
from .. import _bulk
from . import _session
from ._acts import Unopened, refuse, with_client
from ._guard import BodyTooLarge, read_form, who_sent
from ._pages import FILTER_FIELDS
from ._reads import Unavailable

if TYPE_CHECKING:
    from ._app import Dashboard

_log = logging.getLogger("ferry.flow")

LOCKED = (
    "an engine was opening this SQLite file at that moment (on SQLite one engine holds the"
    " file): nothing was done; try again once it serves it"
)

#: The most flows one action on a filter acts on (newest first; the page says so).
BULK_MAX = 10_000

#: The actions on a filter, and the flows each applies to.
ACTIONS = {
    "cancel": "running or parked flows (they compensate their completed steps)",
    "resume": "BLOCKED flows (they run again from where they were blocked)",
    "abandon": "BLOCKED flows (they end FAILED without running the compensations left)",
}


def describe(fields: Mapping[str, str]) -> str:
    """The filter as the form gave it: ``state=BLOCKED plan=order`` (``every flow``)."""
    return " ".join(f"{k}={v}" for k, v in fields.items() if v) or "every flow"


def filter_of(
    dash: Dashboard, values: Mapping[str, str]
) -> tuple[dict[str, str], _query.FlowFilter | None, str | None]:
    """The filter's fields, the filter (None if they are wrong) and what is wrong."""
    fields = {k: values.get(k, "") for k in FILTER_FIELDS}
    try:
        return fields, _query.FlowFilter.from_text(now=dash.clock(), **fields), None
    except (ValueError, TypeError) as exc:
        return fields, None, str(exc)


async def confirm(dash: Dashboard, request: Request) -> Response:
    """GET ``/flows/bulk?action=...&<filters>``: how many flows the action would be tried
    on, and the form (reason, token) that does it. Nothing is done here."""
    action = request.query_params.get("action", "")
    fields, flt, problem = filter_of(dash, request.query_params)
    if action not in ACTIONS:
        problem = f"no action {action!r} on many flows: cancel, resume or abandon"
    if flt is None or problem is not None:
        return dash.render("bulk.html", 400, action=action, fields=fields, problem=problem)
    try:
        matches = await dash.reader.read(lambda tx: _query.count_upto(tx, flt, dash.bulk_max))
    except Unavailable as why:
        return dash.unavailable("Act on many flows", why)
    return dash.render(
        "bulk.html",
        action=action,
        fields=fields,
        problem=None,
        matches=matches,
        cap=dash.bulk_max,
        applies=ACTIONS[action],
        query=urllib.parse.urlencode({k: v for k, v in fields.items() if v}),
        results=None,
    )


@attrs.frozen
class _Asked:
    """A POST's action on a filter, checked: nothing is acted on before it is whole."""

    action: str
    fields: dict[str, str]
    flt: _query.FlowFilter
    reason: str
    who: str


async def _asked(dash: Dashboard, request: Request) -> _Asked | Response:
    """The POST's action, filter and reason, or the answer that refuses it (403 for a
    read-only dashboard, before the body is read, or a refused POST; 413, 400)."""
    if dash.read_only:  # before the body is read
        return refuse(dash, "bulk", None, "this dashboard is read-only: actions are refused")
    try:
        form = await read_form(request)
    except BodyTooLarge as exc:
        return PlainTextResponse(exc.detail, exc.status_code)
    action = form.get("action", "")
    refused = _session.allowed(request, form, token=dash.token, sessions=dash.sessions)
    if refused is not None:
        return refuse(dash, f"bulk {action}", None, refused)
    fields, flt, problem = filter_of(dash, form)
    reason = form.get("reason", "").strip()
    if action not in ACTIONS:
        problem = f"no action {action!r} on many flows: cancel, resume or abandon"
    elif action == "abandon" and not reason:
        problem = "abandon needs a reason (what was done by hand instead): nothing was done"
    if flt is None or problem is not None:
        return dash.render("bulk.html", 400, action=action, fields=fields, problem=problem)
    return _Asked(action, fields, flt, reason, who_sent(request))


def _one(asked: _Asked) -> Callable[[Any, str], Awaitable[_bulk.Done]]:
    """The action on one flow, through a client, as `_bulk` does it for the inspector."""
    if asked.action == "cancel":
        return partial(
            _bulk.cancel_one, reason=asked.reason or "cancelled by an operator (dashboard)"
        )
    if asked.action == "resume":
        return _bulk.resume_one
    return partial(_bulk.abandon_one, reason=asked.reason, by=asked.who)


async def _each(
    dash: Dashboard, asked: _Asked, ids: list[str], results: list[tuple[str, bool, str]]
) -> tuple[int, str | None]:
    """The action on each of `ids`, one call each, appending ``(id, acted, what)`` to
    `results` as it goes: the page's status and its problem (None: all were tried)."""
    one = _one(asked)

    async def each(client: Any) -> None:
        for fid in ids:
            acted, what, _state = await one(client, fid)
            results.append((fid, acted, what))

    try:
        async with dash.acting:
            await with_client(dash, each)
    except trio.TooSlowError as exc:
        return 504, " ".join(str(exc).split())
    except StoreLocked:
        return 409, LOCKED
    except Unopened as why:
        return 503, f"the store is unavailable, nothing was done: {why.reason}"
    except Exception as exc:  # the store: said on the page with what was done, and logged
        _log.warning(
            "dashboard: bulk %s failed after %d flows", asked.action, len(results), exc_info=True
        )
        return 503, (
            f"the store failed after {len(results)} flow(s), the rest untouched:"
            f" {type(exc).__name__}: {' '.join(str(exc).split())}"
        )
    return 200, None


async def act(dash: Dashboard, request: Request) -> Response:
    """POST ``/flows/bulk``: the action on each flow the filter matches (at most
    `BULK_MAX`, newest first), each in its own call, with the operator's engine; the page
    says what became of them (a flow that moved on meanwhile is not acted on)."""
    asked = await _asked(dash, request)
    if not isinstance(asked, _Asked):
        return asked
    action, fields, flt, who = asked.action, asked.fields, asked.flt, asked.who
    try:
        ids = await dash.reader.read(
            lambda tx: [f.flow_id for f in _bulk.matching(tx, flt, limit=dash.bulk_max)[0]]
        )
    except Unavailable as why:
        return dash.unavailable("Act on many flows", why)
    results: list[tuple[str, bool, str]] = []
    status, problem = await _each(dash, asked, ids, results)
    acted = sum(1 for r in results if r[1])
    if results:
        _log.info(
            "dashboard: bulk %s by %s: acted on %d of %d flows (%s)",
            action,
            who,
            acted,
            len(results),
            describe(fields),
            extra={
                "action": f"bulk {action}",
                "by": who,
                "acted": acted,
                "tried": len(results),
                "filter": describe(fields),
            },
        )
    tally: dict[str, int] = {}
    for _fid, _done, what in results:
        tally[what] = tally.get(what, 0) + 1
    return dash.render(
        "bulk.html",
        status,
        action=action,
        fields=fields,
        problem=problem,
        matches=len(ids),
        cap=dash.bulk_max,
        applies=ACTIONS[action],
        query=urllib.parse.urlencode({k: v for k, v in fields.items() if v}),
        results=results,
        acted=acted,
        tally=sorted(tally.items(), key=lambda kv: -kv[1]),
    )
