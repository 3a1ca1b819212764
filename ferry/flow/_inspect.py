"""The flow inspector: ``python -m ferry.flow STORE COMMAND``, for operators.

It looks at the flows of a store (an SQLite file or a PostgreSQL DSN) -- ``list``, ``show``,
``stats`` -- and acts on one flow, or on every flow a filter matches (`_bulk`) -- ``wake``,
``cancel``, ``resume`` -- through the engine API,
with an operator's engine (``open_engine(store, [], serve=False)``): it needs none of the
application's plans (it reads the plan shapes that engines recorded in the store), it runs no
step and holds no lease. What its action makes runnable is left to the engines that serve the
store: on PostgreSQL the next scan of any of them takes it over; on SQLite, where one engine at a
time holds the file (an OS-level lock), the operator's engine needs that lock too, so while a
service engine holds the file the actions are refused with a clear error (make the call through
that engine's API, or stop it first) and the next engine to open the file runs what the action
made runnable. The reading commands take no lock and work while engines run.

``purge --finished-before TIME`` deletes finished flows by hand, as ``open_engine(retain=)``
does (`_retention.purge`: batches of 500, safe beside running engines, on SQLite too: a
finished flow is never written again). It counts them and asks first, unless ``--yes``.

Output is a readable table, or JSON with ``--json``. Errors are one line on stderr: exit status
2 for bad arguments, 1 for everything else that went wrong (an unknown flow, an action that did
not apply, an unreachable store).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sqlite3
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import trio

from ferry.projected import PostgresStore, SqliteStore

from . import _bulk, _query, _retention, _store, _times, _values
from ._errors import FlowError, StoreLocked
from ._open import open_engine
from ._sqlite_file import SQLITE_HEADER, ReadOnlyTx, check_path, read_header
from ._types import Delivery, Json, State
from ._values import ACTIVE, Flow

PROG = "python -m ferry.flow"


class Problem(Exception):
    """What went wrong, in one line for the operator (exit status 1)."""


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (and a pointer to ``--help``), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return n


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave it out for no deduplication)")
    return text


def _json_value(text: str) -> Json:
    try:
        value: Json = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    return value


def _before(text: str) -> float:
    try:
        return _retention.parse_before(text, time.time())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Look at the flows of a ferry.flow store, and wake, cancel or resume one.",
        epilog="STORE is an SQLite file, or a PostgreSQL DSN"
        " ('postgresql://user@host/db' or 'host=... dbname=...').",
    )
    p.add_argument("store", metavar="STORE", help="an SQLite file or a PostgreSQL DSN")
    p.add_argument(
        "--json", dest="json_first", action="store_true", help="the same as COMMAND --json"
    )
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=summary, description=summary)

    ls = command(
        "list", "List flows, newest started first (in id order with --id-prefix), and filter them."
    )
    _bulk.add_filters(ls, "to list")
    ls.add_argument(
        "--limit", metavar="N", type=_count, default=50, help="at most this many (default 50)"
    )
    ls.add_argument(
        "--after",
        metavar="CURSOR",
        help="the page after this cursor (list prints it when more flows match than --limit)",
    )
    show = command("show", "One flow: its state, and its history as a table.")
    show.add_argument("flow_id", metavar="FLOW_ID")
    stats = command(
        "stats",
        "Counts by state and plan, the oldest parked flows, why flows are blocked, the engines.",
    )
    stats.add_argument(
        "--oldest", type=_count, default=10, help="how many parked flows to list (default 10)"
    )
    bulk = (
        "Give FLOW_ID for one flow, or filters for every flow they match: the count is shown and"
        " confirmed (y/N on stdin; --yes skips the question), then each flow is acted on in its"
        " own write."
    )

    def one_or_many(name: str, summary: str, what: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, parents=[common], help=summary, description=f"{summary} {bulk}")
        c.add_argument("flow_id", metavar="FLOW_ID", nargs="?", help="one flow (or use filters)")
        _bulk.add_filters(c, what)
        c.add_argument("--limit", metavar="N", type=_count, help="act on at most this many matches")
        c.add_argument("--yes", action="store_true", help="do not ask: act on every match")
        return c

    wake = one_or_many("wake", "Put a message in a flow's mailbox (Engine.wake).", "to wake")
    wake.add_argument("--payload", type=_json_value, default=None, help="JSON (default null)")
    wake.add_argument(
        "--message-id",
        type=_nonempty,
        help="deduplicates: a repeat is reported DUPLICATE",
    )
    cancel = one_or_many(
        "cancel", "Stop a running or parked flow; it compensates (Engine.cancel).", "to cancel"
    )
    cancel.add_argument("--reason", default="cancelled by an operator", help="recorded as why")
    one_or_many("resume", "Re-drive a BLOCKED flow (Engine.resume).", "to resume")
    purge = command(
        "purge",
        "Delete finished (COMPLETED or FAILED) flows that ended before a time, with their"
        " history and mailbox, as open_engine(retain=) does; after it asks (see --yes).",
    )
    purge.add_argument(
        "--finished-before",
        metavar="TIME",
        type=_before,
        required=True,
        help="ISO 8601 (2026-11-01, 2026-11-01T12:00:00Z; UTC unless it says otherwise) or an"
        " age: 7d, 12h, 30m, 90s, 2w",
    )
    purge.add_argument("--yes", action="store_true", help="delete without asking")
    what = (
        "Serve the dashboard, a web page of the flows with wake, cancel and resume buttons"
        " (needs: pip install 'stm-ferry[dashboard]')."
    )
    serve = sub.add_parser("serve", help=what, description=what)  # no --json: it prints no table
    serve.set_defaults(json=False)
    serve.add_argument(
        "--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine)"
    )
    serve.add_argument("--port", type=_port, default=8080, help="the port (default 8080)")
    serve.add_argument(
        "--read-only", action="store_true", help="show no buttons and refuse every action"
    )
    return p


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535; 0: any free one)")
    return n


# ------------------------------------------------------------------------------------ stores


def _is_dsn(spec: str) -> bool:
    return spec.startswith(("postgres://", "postgresql://")) or (
        "=" in spec and not spec.startswith("file:") and not os.path.exists(spec)
    )


_NO_FLOWS = "{where} holds no flows (no flow engine has opened it)"
_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)|(://[^:/@\s]*:)([^@\s]*)(@)")


def shown(spec: str) -> str:
    """`spec` as the inspector prints it (quoted), with a DSN's password masked."""
    return repr(_PASSWORD.sub(_mask, spec))


def _mask(match: re.Match[str]) -> str:
    if match.group(1) is not None:
        return f"{match.group(1)}***"
    return f"{match.group(3)}***{match.group(5)}"


def _check_dsn(spec: str, where: str) -> None:
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        raise Problem(
            f"{where} looks like a PostgreSQL DSN, and PostgreSQL needs psycopg:"
            " pip install 'stm-ferry[postgres]'"
        ) from None
    try:
        conninfo_to_dict(spec)
    except Exception as exc:
        raise Problem(
            f"{where} is neither an SQLite file (there is no such file) nor a PostgreSQL DSN"
            f" ({_PASSWORD.sub(_mask, _first_line(exc))})"
        ) from None


def _check_sqlite(spec: str, where: str) -> None:
    """Refuse, without writing to it, a path that is no flow store: what `open_engine` refuses
    (`check_path`: an empty path, ``:memory:``, a URI, a directory), no file, an empty file, a
    file of another kind, or an SQLite database no flow engine has opened. (An `SqliteStore`
    switches a database to WAL mode: that would change somebody else's file.)"""
    try:
        check_path(spec, who=PROG)
    except (ValueError, OSError) as exc:
        raise Problem(str(exc)) from None
    if not os.path.isfile(spec):
        raise Problem(
            f"no such SQLite file: {where} (give the path of an engine's SQLite file, or a"
            " PostgreSQL DSN)"
        )
    header = read_header(spec)
    if not header:
        raise Problem(_NO_FLOWS.format(where=where) + ": the file is empty")
    if not header.startswith(SQLITE_HEADER):
        raise Problem(f"{where} is not an SQLite database: give the path of an engine's file")
    if header[18] == 2:
        return  # in WAL mode already, as every engine leaves its file: opening it changes nothing
    # A rollback-journal database: look at it read-only first.
    conn = sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(spec))}?mode=ro", uri=True)
    try:
        found = _store.has_tables(ReadOnlyTx(conn))
    finally:
        conn.close()
    if not found:
        raise Problem(_NO_FLOWS.format(where=where))


def open_store(spec: str) -> SqliteStore | PostgresStore:
    """The store `spec` names (nothing is connected yet). Raises `Problem` for a path that is
    no flow store, or a DSN that does not parse."""
    where = shown(spec)
    if _is_dsn(spec):
        _check_dsn(spec, where)
        return PostgresStore(spec, connections=1, connect_timeout=5.0)
    _check_sqlite(spec, where)
    return SqliteStore(spec)


async def _read(store: SqliteStore | PostgresStore, where: str, fn: Callable[[Any], Any]) -> Any:
    """Run ``fn(tx)`` in one read transaction (no write lock: it neither waits for an engine's
    writes nor delays them), after checking that the store has flow tables."""

    def both(tx: Any) -> Any:
        if not _store.has_tables(tx):
            raise Problem(_NO_FLOWS.format(where=where))
        return fn(tx)

    return await store.transact(both, read_only=True)


# ------------------------------------------------------------------------------------ output


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return _times.iso(t)


def _left(t: float, now: float) -> str:
    """How far `t` is from `now`: ``in 59m 58s``, ``3h 2m ago``."""
    d = t - now
    s = abs(d)
    if s < 60:
        span = f"{s:.0f}s"
    elif s < 3600:
        span = f"{int(s // 60)}m {int(s % 60)}s"
    elif s < 86400:
        span = f"{int(s // 3600)}h {int(s % 3600 // 60)}m"
    else:
        span = f"{int(s // 86400)}d {int(s % 86400 // 3600)}h"
    return f"in {span}" if d >= 0 else f"{span} ago"


def _deadline(t: float, now: float) -> str:
    return f"{_when(t)} ({_left(t, now)})"


def _detail(detail: Any, now: float) -> str:
    """An event's detail as JSON, whole, with a deadline shown as a time and how far it is."""
    if isinstance(detail, dict) and isinstance(detail.get("deadline"), int | float):
        detail = {**detail, "deadline": _deadline(detail["deadline"], now)}
    return json.dumps(detail, ensure_ascii=False).replace("\n", " ")


def safe(value: object) -> str:
    """`value` as text that cannot break a line or a column, nor drive the terminal: as it is if
    every character is printable, else escaped and quoted as `repr` does (a newline, a tab, an
    ANSI escape, a bidirectional override). ``--json`` output is exact instead."""
    text = str(value)
    return text if text.isprintable() else repr(text)


def _cut(text: str, width: int = 60) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: a header row, a rule, then the rows; columns as wide as needed. Cells
    are shown `safe`."""
    cells = [[str(h) for h in headers], *[["-" if c is None else safe(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _step(f: Flow) -> str:
    return (
        "-"
        if f.step is None and f.state.name in ("COMPLETED", "FAILED")
        else f"{f.step_index}:{f.step}"
    )


def flow_json(f: Flow) -> dict[str, Json]:
    snap = _values.snapshot(f)
    return {
        "flow_id": f.flow_id,
        "plan": f.plan,
        "version": f.version,
        "state": f.state.name,
        "step": f.step,
        "step_index": f.step_index,
        "attempt": f.attempt,
        "revision": f.revision,
        "updated_at": f.updated_at,
        "error": snap.error,
        "park_deadline": f.park_deadline,
        "owner": f.owner,
        "data": snap.data,
    }


def _flow_rows(flows: Sequence[Flow]) -> list[list[object]]:
    return [
        [
            f.flow_id,
            f"{f.plan}@{f.version}",
            f.state.name,
            _step(f),
            f.revision,
            _when(f.updated_at),
            f.owner,
        ]
        for f in flows
    ]


_FLOW_HEADERS = ("FLOW", "PLAN", "STATE", "STEP", "REV", "UPDATED", "OWNER")


def _print(args: argparse.Namespace, text: str, data: object) -> None:
    if args.json:
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        print(text)


# ---------------------------------------------------------------------------------- commands


async def do_list(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    try:
        flows, cursor = await _read(
            store,
            args.where,
            partial(_bulk.matching, flt=args.filter, limit=args.limit, after=args.after),
        )
    except ValueError as exc:  # a cursor that is not one of this listing
        raise Problem(f"--after: {exc}") from None
    text = table(_FLOW_HEADERS, _flow_rows(flows)) if flows else "no flows match"
    if cursor is not None:
        text += (
            f"\n(the first {len(flows)}; more match: --limit N shows more, --after {cursor}"
            " the next page)"
        )
    data = {
        "flows": [flow_json(f) for f in flows],
        "count": len(flows),
        "limit": args.limit,
        "more": cursor is not None,
        "next": cursor,
    }
    _print(args, text, data)


async def do_show(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    now = time.time()

    def read(tx: Any) -> tuple[Flow | None, Any, Any, Any, bool]:
        f = _store.load(tx, args.flow_id)
        if f is None:
            return None, None, None, None, False
        events = _store.load_history(tx, args.flow_id) or []
        box = _store.load_mailbox(tx, args.flow_id)
        return f, events, box, _store.holder(tx, args.flow_id, now), _store.leased(tx)

    f, events, box, hold, leased = await _read(store, args.where, read)
    if f is None:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    held = None
    if hold is not None:
        until, orphaned = hold
        held = {"owner": f.owner, "until": until if until > -math.inf else None, "lapsed": orphaned}
    data = {
        "flow": flow_json(f),
        "held": held,
        "queued": [
            {"message_id": q.message_id, "payload": json.loads(q.payload)} for q in box.queued
        ],
        "history": [
            {
                "revision": e.revision,
                "at": e.at,
                "kind": e.kind,
                "step": e.step,
                "attempt": e.attempt,
                "detail": e.detail,
            }
            for e in events
        ],
    }
    snap = _values.snapshot(f)
    lines = [
        f"flow      {safe(f.flow_id)}",
        f"plan      {safe(f.plan)} version {f.version}",
        f"state     {f.state.name}",
        f"step      {safe(_step(f))} (attempt {f.attempt})",
        f"revision  {f.revision}, last written {_when(f.updated_at)}",
    ]
    if snap.error is not None:
        what = "blocked" if f.state is State.BLOCKED else "error"
        lines.append(f"{what:<9} {safe(snap.error)}")
    if f.park_deadline is not None:
        lines.append(
            f"deadline  {_deadline(f.park_deadline, now)}; then {safe(f.on_timeout)} (on timeout)"
        )
    if held is not None:
        status = "lapsed: any engine may take it over" if held["lapsed"] else "held"
        lines.append(f"engine    {safe(f.owner)}, until {_when(held['until'])} ({status})")
    elif f.state in ACTIVE and not leased:
        lines.append(
            "engine    the engine that holds the file runs it (with none open, the next engine"
            " to open the file)"
        )
    elif f.state in ACTIVE:
        lines.append("engine    none: the next engine to scan the store runs it")
    if box.queued:
        lines.append(f"queued    {', '.join(safe(q.message_id) for q in box.queued)}")
    lines.append(f"data      {safe(_cut(json.dumps(snap.data, ensure_ascii=False), 200))}")
    rows = [
        [
            e.revision,
            _when(e.at),
            e.kind,
            e.step,
            e.attempt,
            "" if e.detail is None else _detail(e.detail, now),
        ]
        for e in events
    ]
    lines += ["", table(("REV", "AT", "KIND", "STEP", "ATTEMPT", "DETAIL"), rows)]
    _print(args, "\n".join(lines), data)


#: What the terms of `stats` mean (the legend under its tables names those shown).
STATS_LEGEND = {
    "orphans": "running or compensating flows no live engine holds: the next engine to scan"
    " or open the store runs them",
    "PLAN": "a plan's name@version",
    "SINCE": "when the flow parked (its last write)",
    "DEADLINE": "when its park times out (-: never; it waits for a wake)",
    "E.G.": "one flow blocked for that reason: `show` it, fix the cause, then `resume` it",
    "LEASE": "alive while the engine renews its lease (UNTIL); gone: it closed or died",
    "FLOWS": "(engines) the running or compensating flows the engine holds",
}


async def do_stats(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    now = time.time()

    def read(tx: Any) -> dict[str, Any]:
        return {
            "plans": _store.count_plans(tx),
            "parked": _store.oldest_parked(tx, limit=args.oldest),
            "blocked": _store.blocked_reasons(tx),
            "engines": _store.load_engines(tx),
            "orphans": _store.count_orphans(tx, now),
            "registered": _store.load_plans(tx),
        }

    r = await _read(store, args.where, read)
    by_state = dict.fromkeys((s.name for s in State), 0)
    by_plan: dict[str, dict[str, int]] = {}
    for plan, version, state, n in r["plans"]:
        by_state[state.name] += n
        by_plan.setdefault(f"{plan}@{version}", dict.fromkeys((s.name for s in State), 0))
        by_plan[f"{plan}@{version}"][state.name] += n
    data = {
        "states": by_state,
        "plans": by_plan,
        "orphans": r["orphans"],
        "oldest_parked": [
            {
                "flow_id": f.flow_id,
                "plan": f.plan,
                "version": f.version,
                "step": f.step,
                "since": f.updated_at,
                "deadline": f.park_deadline,
            }
            for f in r["parked"]
        ],
        "blocked": [{"reason": why, "flows": n, "example": fid} for why, n, fid in r["blocked"]],
        "engines": [
            {"owner": o, "lease_until": until, "alive": until >= now, "started_at": at, "flows": n}
            for o, until, at, n in r["engines"]
        ],
        "registered_plans": [
            {"plan": sh.name, "version": sh.version, "steps": list(sh.steps), "at": at}
            for sh, at in r["registered"]
        ],
    }
    states = [s.name for s in State]
    parts = [
        table(("STATE", "FLOWS"), [[s, by_state[s]] for s in states]),
        f"\nrunning flows no engine holds (orphans): {r['orphans']}",
    ]
    legend = ["orphans"]
    if by_plan:
        legend.append("PLAN")
        rows = [[p, *(counts[s] for s in states)] for p, counts in by_plan.items()]
        parts.append("\n" + table(("PLAN", *states), rows))
    if r["parked"]:
        rows = [
            [
                f.flow_id,
                f"{f.plan}@{f.version}",
                f.step,
                _when(f.updated_at),
                _when(f.park_deadline),
            ]
            for f in r["parked"]
        ]
        parts.append(
            "\noldest parked\n" + table(("FLOW", "PLAN", "STEP", "SINCE", "DEADLINE"), rows)
        )
        legend += ["SINCE", "DEADLINE"]
    if r["blocked"]:
        rows = [[n, fid, _cut(why, 80)] for why, n, fid in r["blocked"]]
        parts.append("\nblocked, by reason\n" + table(("FLOWS", "E.G.", "REASON"), rows))
        legend.append("E.G.")
    if r["engines"]:
        rows = [
            [o, "alive" if until >= now else "gone", _when(until), n]
            for o, until, _at, n in r["engines"]
        ]
        parts.append("\nengines\n" + table(("ENGINE", "LEASE", "UNTIL", "FLOWS"), rows))
        legend += ["LEASE", "FLOWS"]
    width = max(len(k) for k in legend)
    parts.append("\nlegend\n" + "\n".join(f"  {k:<{width}}  {STATS_LEGEND[k]}" for k in legend))
    _print(args, "\n".join(parts), data)


async def _act(
    args: argparse.Namespace, store: SqliteStore | PostgresStore, call: Callable[[Any], Any]
) -> tuple[Any, Flow | None]:
    """Run ``call(engine)`` with an operator's engine; its result, and the flow's row after."""
    await _read(store, args.where, lambda tx: None)  # a store without flows: say so
    try:
        async with open_engine(store, [], serve=False) as engine:
            result = await call(engine)
            after = await store.transact(partial(_store.load, flow_id=args.flow_id))
    except StoreLocked:
        raise Problem(_locked(args)) from None
    return result, after


def _runs_next(args: argparse.Namespace) -> str:
    if _is_dsn(args.store):
        return "the next scan of an engine serving the store runs it"
    return "the next engine to open the file runs it"


async def do_bulk(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    """`wake`, `cancel` or `resume` on every flow the filters match (see `_bulk`)."""
    flt = args.filter

    def read(tx: Any) -> tuple[int, list[Flow]]:  # one snapshot: the count and the matches
        flows, _ = _bulk.matching(tx, flt, limit=args.limit)
        return _query.count(tx, flt), flows

    total, flows = await _read(store, args.where, read)
    ids = [f.flow_id for f in flows]
    which = _bulk.describe(args)
    data: dict[str, Any] = {"action": args.command, "filters": which, "matched": total}
    if not ids:
        data.update(acted=0, results=[])
        _print(args, f"no flow matches {which}: nothing to {args.command}", data)
        return
    some = f" (the first {len(ids)}: --limit {args.limit})" if len(ids) < total else ""
    question = (
        f"{total} flow{'s' if total != 1 else ''} match {which}{some}."
        f" {args.command.capitalize()} {'it' if len(ids) == 1 else f'each of the {len(ids)}'},"
        " one write per flow? [y/N] "
    )
    if not args.yes and not await _bulk.confirm(question):
        raise Problem(f"not confirmed: no flow was {_DONE[args.command]}")
    try:
        results = await _bulk.act(store, ids, _bulk.one_for(args))
    except StoreLocked:
        raise Problem(_locked(args)) from None
    counts = _bulk.tally(results)
    acted = sum(1 for r in results if r["acted"])
    data.update(acted=acted, outcomes=counts, results=results)
    flows = f"{len(ids)} flow" + ("s" if len(ids) != 1 else "")
    lines = [f"{args.command}: {flows}, {acted} {_DONE[args.command]}"]
    lines += [f"  {n:>6}  {what}" for what, n in sorted(counts.items(), key=lambda c: -c[1])]
    if acted and any(r["state"] in ("RUNNING", "COMPENSATING") for r in results):
        lines.append(f"what runs now: {_runs_next(args)}")
    _print(args, "\n".join(lines), data)


_DONE = {"cancel": "cancelled", "resume": "resumed", "wake": "woken or queued"}


def _locked(args: argparse.Namespace) -> str:
    return (
        f"a flow engine is serving {args.where} right now: on SQLite one engine holds the"
        " file, so make the call through that engine's API (Engine.wake/cancel/resume) or"
        " stop it first (list, show and stats work meanwhile)"
    )


async def do_wake(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    if args.flow_id is None:
        return await do_bulk(args, store)
    delivery, after = await _act(
        args,
        store,
        lambda e: e.wake(args.flow_id, args.payload, message_id=args.message_id),
    )
    if delivery is Delivery.UNKNOWN:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    notes = {
        Delivery.RESUMED: f"it was parked and runs its next step: {_runs_next(args)}",
        Delivery.QUEUED: "kept in its mailbox: its next park takes it",
        Delivery.DUPLICATE: "this message id was delivered before: nothing changed",
        Delivery.STALE: "the flow has ended: nothing changed",
    }
    if after is not None and after.state is State.BLOCKED:
        notes[Delivery.QUEUED] = "kept in its mailbox: the flow is BLOCKED (resume it)"
    _print(
        args,
        f"{delivery.name}: {notes[delivery]}",
        {
            "flow_id": args.flow_id,
            "delivery": delivery.name,
            "state": None if after is None else after.state.name,
        },
    )


async def do_cancel(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    if args.flow_id is None:
        return await do_bulk(args, store)
    done, after = await _act(args, store, lambda e: e.cancel(args.flow_id, args.reason))
    if after is None:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    if not done:
        raise Problem(
            f"not cancelled: flow {args.flow_id!r} is {after.state.name} (only a running or"
            " parked flow can be cancelled)"
        )
    if after.state is State.FAILED:
        text = "cancelled: it had nothing to compensate, and has FAILED"
    elif after.owner is not None:
        text = f"cancelled: engine {after.owner} stops its step and compensates"
    else:
        text = f"cancelled: it compensates; {_runs_next(args)}"
    _print(args, text, {"flow_id": args.flow_id, "cancelled": True, "state": after.state.name})


async def do_resume(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    if args.flow_id is None:
        return await do_bulk(args, store)
    done, after = await _act(args, store, lambda e: e.resume(args.flow_id))
    if after is None:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    if not done:
        why = (
            f"plan {after.plan!r} version {after.version} still cannot drive it ({after.blocked})"
            if after.state is State.BLOCKED
            else f"it is {after.state.name} (only a BLOCKED flow can be resumed)"
        )
        raise Problem(f"not resumed: flow {args.flow_id!r}: {why}")
    where = _runs_next(args) if after.state in ACTIVE else f"it is {after.state.name} again"
    _print(
        args,
        f"resumed: {where}",
        {"flow_id": args.flow_id, "resumed": True, "state": after.state.name},
    )


def _confirm(question: str) -> bool:
    """Ask on the terminal (stderr, stdin); True for yes."""
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        answer = input()
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


async def do_purge(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    """Count, ask, then delete in batches (the engine's purge: safe while engines serve the
    store, on SQLite too, since a finished flow is never written again)."""
    before = args.finished_before
    when = _times.iso(before)
    matched = await _read(store, args.where, partial(_retention.count_finished, before=before))
    data: dict[str, Json] = {"finished_before": when, "matched": matched, "deleted": 0}
    if not matched:
        _print(args, f"no finished flow ended before {when}: nothing to delete", data)
        return
    question = (
        f"delete {matched} finished flow{'s' * (matched != 1)} (COMPLETED or FAILED) that ended"
        f" before {when}, with their history and mailbox, from {args.where}?"
    )
    if not args.yes and not sys.stdin.isatty():
        raise Problem(
            f"{matched} finished flows ended before {when}; nothing was deleted: stdin is not a"
            " terminal to ask on, so add --yes to delete them"
        )
    if not args.yes and not await trio.to_thread.run_sync(
        _confirm, question, abandon_on_cancel=True
    ):
        _print(args, "nothing deleted", data)
        return
    data["deleted"] = await _retention.purge(store, before)
    _print(args, f"deleted {data['deleted']} finished flows that ended before {when}", data)


async def do_serve(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    try:
        from ._dashboard._serve import CannotListen, run_command
    except ImportError as exc:
        raise Problem(
            f"the dashboard needs its extra ({(exc.name or '?').split('.')[0]} is missing):"
            " pip install 'stm-ferry[dashboard]'"
        ) from None
    try:
        await run_command(
            args.store,
            where=args.where,
            is_dsn=_is_dsn(args.store),
            host=args.host,
            port=args.port,
            read_only=args.read_only,
        )
    except CannotListen as exc:
        raise Problem(str(exc)) from None


COMMANDS = {
    "serve": do_serve,
    "list": do_list,
    "show": do_show,
    "stats": do_stats,
    "wake": do_wake,
    "cancel": do_cancel,
    "resume": do_resume,
    "purge": do_purge,
}


async def run(args: argparse.Namespace) -> None:
    store = open_store(args.store)
    try:
        await COMMANDS[args.command](args, store)
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


def _first_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _one_line(error: BaseException, spec: str) -> str:
    """What went wrong: a `Problem` as it is; anything else (an unreachable store, a refusal)
    named by its type, not as a traceback; a DSN's password never shown."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if isinstance(error, Problem):
        return str(error)
    if isinstance(error, FlowError | ValueError | TypeError):  # the engine refused an argument
        return _PASSWORD.sub(_mask, _first_line(error))
    what = "the PostgreSQL database" if _is_dsn(spec) else "the SQLite file"
    text = _PASSWORD.sub(_mask, _cut(_first_line(error), 300))
    return f"cannot use {what} {shown(spec)}: {type(error).__name__}: {text}"


def _usage(p: argparse.ArgumentParser, message: str) -> int:
    """Report bad arguments as argparse does (one line); the exit status, 2."""
    try:
        p.error(message)
    except SystemExit as done:
        return int(done.code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; its exit status (0, 1 for a problem, 2 for bad arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    if argv and argv[0] in COMMANDS and not os.path.exists(argv[0]):
        rest = " ".join(argv[1:]) or "STORE"
        return _usage(p, f"the store comes first: {PROG} {rest.split()[0]} {argv[0]} ...")
    try:
        args = p.parse_args(argv)
    except SystemExit as done:
        return int(done.code or 0)
    args.json = args.json or args.json_first
    args.where = shown(args.store)
    if args.command in ("list", "wake", "cancel", "resume"):
        try:
            args.filter = _bulk.flow_filter(args)
        except ValueError as exc:
            return _usage(p, str(exc))
    if args.command in ("wake", "cancel", "resume"):
        if args.flow_id is not None and _bulk.has_filters(args):
            return _usage(p, f"{args.command}: give FLOW_ID or filters, not both")
        if args.flow_id is None and not _bulk.has_filters(args):
            return _usage(
                p,
                f"{args.command}: give FLOW_ID, or filters (--state, --plan, ...) to"
                f" {args.command} every flow they match",
            )
    try:
        trio.run(run, args)
    except KeyboardInterrupt:
        if args.command == "serve":  # how a server is stopped
            return 0
        raise
    except Exception as error:
        if _broken_pipe(error):  # the reader went away (`| head`): nothing to say to anyone
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        print(f"{PROG}: error: {_one_line(error, args.store)}", file=sys.stderr)
        return 1
    return 0


def _broken_pipe(error: BaseException) -> bool:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return isinstance(error, BrokenPipeError)
