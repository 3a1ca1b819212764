"""The dashboard's actions on one flow (POST ``/flow/wake``, ``cancel``, ``resume``,
``abandon``), each through a client of the store opened for it and closed after it
(docs/adr/0044, 0125), allowed by `_session.allowed` first and logged with who and what.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

from ..._engine._client import connect
from ..._model._checks import shown_number
from ..._model._errors import FlowError
from ..._model._types import Delivery
from . import _session
from ._guard import BodyTooLarge, read_form, who_sent
from ._pages import flow_page

if TYPE_CHECKING:
    from ._app import Dashboard

_log = logging.getLogger("ferry.flow")


class Unopened(Exception):
    """The operator's engine could not be opened: the store is gone or is no store (503)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def refuse(dash: Dashboard, action: str, fid: str | None, why: str) -> Response:
    """403: the POST was refused before anything was looked up (the flow may not exist)."""
    if action.startswith("bulk"):
        _log.warning("dashboard: %s refused: %s", action, why)
    else:
        _log.warning(
            "dashboard: %s of flow %r refused: %s", action, fid, why, extra={"flow_id": fid}
        )
    return dash.render("refused.html", 403, flow_id=fid or "", problem=why)


async def act(dash: Dashboard, request: Request) -> Response:
    action = request.path_params["action"]
    if dash.read_only:  # before the body is read
        return refuse(dash, action, None, "this dashboard is read-only: actions are refused")
    try:
        form = await read_form(request)
    except BodyTooLarge as exc:
        return PlainTextResponse(exc.detail, exc.status_code)
    refused = _session.allowed(request, form, token=dash.token, sessions=dash.sessions)
    if refused is not None:
        return refuse(dash, action, form.get("id"), refused)
    fid = form.get("id", "")
    if not fid:
        return PlainTextResponse("which flow? the form has no id\n", 400)
    try:
        call = _call(action, fid, form, who_sent(request))
    except ValueError as exc:
        return await flow_page(dash, fid, problem=str(exc), status=400)
    try:
        async with dash.acting:
            outcome, served = await with_client(dash, call)
    except trio.TooSlowError as exc:
        return await flow_page(dash, fid, status=504, problem=" ".join(str(exc).split()))
    except Unopened as why:  # gone, a directory, not a store: the page says unavailable
        _log.warning(
            "dashboard: %s of flow %r refused: the store cannot be opened (%s)",
            action,
            fid,
            why.reason,
            extra={"flow_id": fid},
        )
        return await flow_page(
            dash,
            fid,
            status=503,
            problem=f"the store is unavailable, nothing was done: {why.reason}",
        )
    except (FlowError, ValueError, TypeError) as exc:
        return await flow_page(dash, fid, problem=f"refused: {exc}", status=409)
    except Exception as exc:  # the store: said on the page, and logged
        _log.warning(
            "dashboard: %s of flow %r failed",
            action,
            fid,
            exc_info=True,
            extra={"flow_id": fid},
        )
        return await flow_page(
            dash,
            fid,
            status=503,
            problem=f"the store is unavailable, nothing was done: {type(exc).__name__}:"
            f" {' '.join(str(exc).split())}",
        )
    key = _outcome_key(action, outcome)
    who = who_sent(request)
    _log.info(
        "dashboard: %s of flow %r by %s: %s",
        action,
        fid,
        who,
        key or "did not apply",
        extra={"flow_id": fid, "action": action, "by": who, "outcome": key or "did not apply"},
    )
    if key is None:
        return await flow_page(
            dash, fid, status=409, problem=f"{action} did not apply: {_NOT_DONE[action]}"
        )
    via = "engine" if served else "here"
    return RedirectResponse(
        f"/flow?id={urllib.parse.quote(fid, safe='')}&done={key}&via={via}", 303
    )


# ------------------------------------------------------------------- actions on a filter


async def with_client(dash: Dashboard, call: Callable[[Any], Awaitable[Any]]) -> tuple[Any, bool]:
    """``call(client)`` with a client of the store (`flow.connect`, which never creates the
    store's file): its result, and whether the engine serving the store applied it (False:
    no engine serves it, the client applied it itself). `Unopened` if the store could not
    be opened."""
    opened = False
    try:
        async with connect(dash.store, timeout=dash.answer_within) as client:
            opened = True
            result = await call(client)
            return result, client.last is not None and client.last.served
    except Exception as exc:
        if opened:
            raise
        raise Unopened(f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc


_NOT_DONE = {
    "wake": "the flow has ended (or is unknown)",
    "cancel": "only a running or parked flow can be cancelled",
    "resume": "only a BLOCKED flow whose plan version is known can be resumed",
    "abandon": "only a BLOCKED flow can be abandoned",
}


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
