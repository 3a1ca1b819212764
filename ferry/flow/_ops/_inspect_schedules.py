"""The inspector's schedules (SPEC 5.9): ``schedules`` lists every stored schedule (name, plan,
cron and time zone, next tick, last tick and its flow, paused, the ticks missed after downtime
and skipped by the overlap rule), read from the store without an engine; ``schedule pause |
unpause | trigger NAME`` acts through a client (`flow.connect`), as the flow actions do
(`_inspect_act`): the engine serving the store applies it, or, with none, this command does.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import trio

from ferry.projected import PostgresStore, SqliteStore

from .._engine._client import connect
from .._model import _times
from .._model._errors import UnknownSchedule
from .._model._types import Json
from .._store import _schedules
from ._inspect_act import _accepted, _engine_of
from ._inspect_read import Problem, output, read_store, table

ACTIONS = ("pause", "unpause", "trigger")


def add_commands(sub: Any, common: argparse.ArgumentParser, text: Any, seconds: Any) -> None:
    """The two commands, on the inspector's subcommand parser `sub` (`common`: ``--json``;
    `text`, `seconds`: its argument types for a name and for ``--timeout``)."""
    summary = (
        "List the schedules: plan, cron, time zone, next and last tick, paused, the ticks"
        " missed after downtime and skipped by the overlap rule."
    )
    sub.add_parser("schedules", parents=[common], help=summary, description=summary)
    summary = (
        "Pause or unpause a schedule, or trigger one run of it now (Engine.pause, unpause,"
        " trigger), through the engine serving the store."
    )
    act = sub.add_parser("schedule", parents=[common], help=summary, description=summary)
    act.add_argument("action", choices=ACTIONS)
    act.add_argument("name", metavar="NAME", type=text)
    act.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=seconds,
        default=10.0,
        help="how long to wait for the answer of the engine serving the store (default 10)",
    )


def _when(t: float | None) -> str | None:
    return None if t is None else _times.iso(t)


def schedule_json(s: _schedules.Stored) -> dict[str, Json]:
    """One stored schedule, as ``schedules --json`` shows it (and the dashboard)."""
    d, r = s.definition, s.row
    return {
        "name": r.name,
        "plan": d["plan"],
        "version": d["version"],
        "cron": d["cron"],
        "timezone": d["timezone"],
        "overlap": d["overlap"],
        "catchup": d["catchup"],
        "paused": r.paused,
        "next_tick": _when(r.next_tick),
        "last_tick": _when(r.last_tick),
        "last_flow": r.last_flow,
        "waiting_tick": _when(r.waiting_tick),
        "missed": r.missed,
        "skipped": r.skipped,
    }


async def do_schedules(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    found = await read_store(store, args.where, _schedules.stored_all)
    shown = [schedule_json(s) for s in found]
    if not shown:
        output(args, f"no schedule is stored in {args.where}", {"schedules": []})
        return
    headers = ["NAME", "PLAN", "CRON", "TIMEZONE", "NEXT TICK", "LAST TICK", "LAST FLOW"]
    headers += ["PAUSED", "MISSED", "SKIPPED"]
    rows = [
        [
            s["name"],
            f"{s['plan']} v{s['version']}",
            s["cron"],
            s["timezone"],
            "paused" if s["paused"] else s["next_tick"],
            s["last_tick"],
            s["last_flow"],
            "yes" if s["paused"] else "no",
            s["missed"],
            s["skipped"],
        ]
        for s in shown
    ]
    output(args, table(headers, rows), {"schedules": shown})


async def do_schedule(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    """``schedule pause|unpause|trigger NAME``: through a client, its answer reported."""
    await read_store(store, args.where, lambda tx: None)  # a store without flows: say so
    try:
        async with connect(store, timeout=args.timeout) as client:
            result = await getattr(client, args.action)(args.name)
            receipt = client.last
    except UnknownSchedule:
        raise Problem(f"no schedule named {args.name!r} is stored in {args.where}") from None
    except trio.TooSlowError as exc:
        raise Problem(str(exc)) from None
    args.served_by = await _engine_of(store, receipt)
    data: dict[str, Json] = {"schedule": args.name, "action": args.action}
    if args.action == "trigger":
        data["flow_id"] = result
        said = (
            f"triggered: flow {result}"
            if result is not None
            else "triggered: its overlap rule started nothing now (skipped, or waiting for"
            " the schedule's running flow to end)"
        )
    elif args.action == "pause":
        said = "paused: no tick starts until it is unpaused (trigger still runs it)"
    else:
        said = "unpaused: it ticks from its next tick after now"
    data["at"] = _times.iso(time.time())
    output(args, _accepted(args, said), data)
