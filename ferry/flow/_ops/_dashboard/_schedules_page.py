"""The dashboard's list of schedules (``/schedules``, SPEC 5.9): each stored schedule with its
plan, cron expression and time zone, next and last tick, paused, the ticks missed after downtime
and skipped by the overlap rule; its last flow links to that flow's page, and its name to the
list of its flows (their ids are ``NAME@TIME``). Read only: pausing and triggering are the
inspector's (``schedule pause|unpause|trigger NAME``) and the API's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from ..._store import _schedules
from ._reads import Unavailable

if TYPE_CHECKING:
    from ._app import Dashboard


async def schedules(dash: Dashboard, request: Request) -> Response:
    try:
        found = await dash.reader.read(_schedules.stored_all)
    except Unavailable as why:
        return dash.unavailable("Schedules", why)
    return dash.render("schedules.html", schedules=found)
