"""The inspector's reading side: which store a STORE argument names, its read transactions, how
flows and errors are rendered, and the reading commands ``list``, ``show`` and ``stats``.

Nothing here writes to a store: a path that is no flow store is refused before it is opened
(opening an SQLite file would switch it to WAL mode), and every read is one read-only
transaction that neither waits for an engine's writes nor delays them. `Problem` (one line for
the operator, exit status 1) and `PROG` are defined here, at the bottom of the inspector's
modules, because everything above them raises or names them.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ferry._text import masked, shown
from ferry.projected import PostgresStore, SqliteStore

from .._model import _times, _values
from .._model._errors import FlowError
from .._model._types import Json, State
from .._model._values import Flow
from .._store import _inbox, _queue_view, _schema, _store, _triage
from .._store._sqlite_file import SQLITE_HEADER, ReadOnlyTx, check_path, read_header
from . import _bulk

PROG = "python -m ferry.flow"


class Problem(Exception):
    """What went wrong, in one line for the operator (exit status 1)."""


# ------------------------------------------------------------------------------------ stores


def is_dsn(spec: str) -> bool:
    return spec.startswith(("postgres://", "postgresql://")) or (
        "=" in spec and not spec.startswith("file:") and not os.path.exists(spec)
    )


_NO_FLOWS = "{where} holds no flows (no flow engine has opened it)"
_NO_ENGINE = (
    "no engine serves {where} now (no live heartbeat): nothing runs its flows; an action is"
    " applied by the command itself, and what it makes runnable waits for the next engine"
)


def _postgres(spec: str, where: str) -> PostgresStore:
    """The store of DSN `spec`, not connected yet; `PostgresStore` checks the DSN (psycopg
    installed, the DSN readable) as `open_engine`'s caller's store does."""
    try:
        return PostgresStore(spec, connections=1, connect_timeout=5.0)
    except ImportError:
        raise Problem(
            f"{where} looks like a PostgreSQL DSN, and PostgreSQL needs psycopg:"
            " pip install 'stm-ferry[postgres]'"
        ) from None
    except ValueError as exc:
        raise Problem(
            f"{where} is neither an SQLite file (there is no such file) nor a PostgreSQL DSN:"
            f" {masked(_first_line(exc))}"
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
        found = _schema.has_tables(ReadOnlyTx(conn))
    finally:
        conn.close()
    if not found:
        raise Problem(_NO_FLOWS.format(where=where))


def open_store(spec: str) -> SqliteStore | PostgresStore:
    """The store `spec` names (nothing is connected yet). Raises `Problem` for a path that is
    no flow store, or a DSN that does not parse."""
    where = shown(spec)
    if is_dsn(spec):
        return _postgres(spec, where)
    _check_sqlite(spec, where)
    return SqliteStore(spec, create=False)  # a file removed meanwhile is an error, never made


async def read_store(
    store: SqliteStore | PostgresStore, where: str, fn: Callable[[Any], Any]
) -> Any:
    """Run ``fn(tx)`` in one read transaction (no write lock: it neither waits for an engine's
    writes nor delays them), after checking that the store has flow tables."""

    def both(tx: Any) -> Any:
        if not _schema.has_tables(tx):
            raise Problem(_NO_FLOWS.format(where=where))
        return fn(tx)

    return await store.transact(both, read_only=True)


# ------------------------------------------------------------------------------------ output


def when(t: float | None) -> str:
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


def deadline_text(t: float, now: float) -> str:
    return f"{when(t)} ({_left(t, now)})"


def detail_text(detail: Any, now: float) -> str:
    """An event's detail as JSON, whole, with a deadline shown as a time and how far it is."""
    if isinstance(detail, dict) and isinstance(detail.get("deadline"), int | float):
        detail = {**detail, "deadline": deadline_text(detail["deadline"], now)}
    return json.dumps(detail, ensure_ascii=False).replace("\n", " ")


def safe(value: object) -> str:
    """`value` as text that cannot break a line or a column, nor drive the terminal: as it is if
    every character is printable, else escaped and quoted as `repr` does (a newline, a tab, an
    ANSI escape, a bidirectional override). ``--json`` output is exact instead."""
    text = str(value)
    return text if text.isprintable() else repr(text)


def cut(text: str, width: int = 60) -> str:
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


def step_text(f: Flow) -> str:
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
        "parent": f.parent,
        "trace_id": _values.trace_id(f.trace),
        "data": snap.data,
    }


#: How much of a flow's error `list` shows (``--json`` and `show` give the whole).
ERROR_WIDTH = 60


def _flow_rows(flows: Sequence[Flow]) -> list[list[object]]:
    rows: list[list[object]] = []
    for f in flows:
        error = _triage.error_of(f)
        rows.append(
            [
                f.flow_id,
                f"{f.plan}@{f.version}",
                f.state.name,
                step_text(f),
                f.revision,
                when(f.updated_at),
                f.owner,
                None if error is None else cut(safe(error), ERROR_WIDTH),
            ]
        )
    return rows


_FLOW_HEADERS = ("FLOW", "PLAN", "STATE", "STEP", "REV", "UPDATED", "OWNER", "ERROR")


def output(args: argparse.Namespace, text: str, data: object) -> None:
    if args.json:
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        print(text)


# ---------------------------------------------------------------------------------- commands


async def do_list(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    try:
        flows, cursor = await read_store(
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
    output(args, text, data)


#: What the terms of `stats` mean (the legend under its tables names those shown).
STATS_LEGEND = {
    "orphans": "running or compensating flows no live engine holds: the next engine to scan"
    " or open the store runs them",
    "PLAN": "a plan's name@version",
    "SINCE": "when the flow parked (its last write)",
    "DEADLINE": "when its park times out (-: never; it waits for a wake)",
    "ERROR": "failed and blocked flows grouped by their error, with numbers, hex ids, uuids,"
    " quoted values and the flow's own id folded (<n>, <hex>, <uuid>, '<s>', <flow>)",
    "E.G.": "a few flows of the group: `show` one, fix the cause, then `resume` a blocked one"
    " (list --state STATE --error TEXT lists them all)",
    "FIRST": "(errors) the earliest last write of the group's flows; LAST: the latest",
    "LEASE": (
        "alive while the engine renews its lease or heartbeat (UNTIL); gone: it closed or"
        " died (an SQLite engine removes its row at close; the fleet forgets it about 100"
        " leases later, once it holds no flow)"
    ),
    "FLOWS": "(engines) the running or compensating flows the engine holds",
    "LIMITS": "(flow control) a limited plan's limits, as the engines registered them",
    "ACTIVE": "(flow control) its flows holding a slot (running, parked, compensating);"
    " QUEUED: waiting for one (a limit, or their start time); BUSY KEYS: keys with a flow"
    " active; IN WINDOW: flows started within the rate's window",
}


async def do_stats(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    now = time.time()

    def read(tx: Any) -> dict[str, Any]:
        at = _store.lease_clock(tx, now)  # leases go by the database's clock: docs/adr/0110
        return {
            "clock": at,
            "plans": _store.count_plans(tx),
            "parked": _store.oldest_parked(tx, limit=args.oldest),
            "errors": _triage.failure_groups(tx, limit=args.limit),
            "engines": _store.load_engines(tx),
            "beats": {b["owner"]: b for b in _inbox.heartbeats(tx)},
            "orphans": _store.count_orphans(tx, at),
            "registered": _store.load_plans(tx),
            "queues": _queue_view.plan_queues(tx, at),
        }

    r = await read_store(store, args.where, read)
    by_state = dict.fromkeys((s.name for s in State), 0)
    by_plan: dict[str, dict[str, int]] = {}
    for plan, version, state, n in r["plans"]:
        by_state[state.name] += n
        by_plan.setdefault(f"{plan}@{version}", dict.fromkeys((s.name for s in State), 0))
        by_plan[f"{plan}@{version}"][state.name] += n
    data = _stats_json(r, by_state, by_plan, args.limit)
    parts = [*_stats_tables(r, by_state, by_plan), *_queue_table(r["queues"])]
    legend = ["orphans", *(["PLAN"] if by_plan else [])]
    legend += ["LIMITS", "ACTIVE"] if r["queues"] else []
    legend += ["SINCE", "DEADLINE"] if r["parked"] else []
    legend += ["ERROR", "FIRST", "E.G."] if r["errors"].groups else []
    legend += ["LEASE", "FLOWS"] if r["engines"] else []
    if not data["serving"]:
        parts.append(f"\n{_NO_ENGINE.format(where=args.where)}")
    width = max(len(k) for k in legend)
    parts.append("\nlegend\n" + "\n".join(f"  {k:<{width}}  {STATS_LEGEND[k]}" for k in legend))
    output(args, "\n".join(parts), data)


def _stats_json(
    r: dict[str, Any], by_state: dict[str, int], by_plan: dict[str, dict[str, int]], limit: int
) -> dict[str, Json]:
    """What ``stats --json`` prints, from what `do_stats` read."""
    return {
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
        "errors": _errors_json(r["errors"], limit),
        "engines": [
            {
                "owner": o,
                "pid": r["beats"].get(o, {}).get("pid"),
                "host": r["beats"].get(o, {}).get("host"),
                "lease_until": until,
                "alive": until >= r["clock"],
                "started_at": at,
                "flows": n,
            }
            for o, until, at, n in r["engines"]
        ],
        "serving": any(until >= r["clock"] for _o, until, _at, _n in r["engines"]),
        "registered_plans": [
            {"plan": sh.name, "version": sh.version, "steps": list(sh.steps), "at": at}
            for sh, at in r["registered"]
        ],
        "flow_control": [q.json() for q in r["queues"]],
    }


def _queue_table(queues: Sequence[_queue_view.PlanQueue]) -> list[str]:
    """``stats``' table of flow control: each limited plan's limits and usage (none: none)."""
    if not queues:
        return []
    rows = [
        [
            q.plan,
            _queue_view.limits_text(q.limits),
            q.active,
            q.queued,
            q.busy_keys if q.limits.get("key") else "-",
            "-" if q.in_window is None else q.in_window,
        ]
        for q in queues
    ]
    head = ("PLAN", "LIMITS", "ACTIVE", "QUEUED", "BUSY KEYS", "IN WINDOW")
    return ["\nflow control\n" + table(head, rows)]


def _stats_tables(
    r: dict[str, Any], by_state: dict[str, int], by_plan: dict[str, dict[str, int]]
) -> list[str]:
    """The tables ``stats`` prints, from what `do_stats` read: states, plans, the oldest
    parked flows, errors by group, engines (each table only when it has a row)."""
    states = [s.name for s in State]
    parts = [
        table(("STATE", "FLOWS"), [[s, by_state[s]] for s in states]),
        f"\nrunning flows no engine holds (orphans): {r['orphans']}",
    ]
    if by_plan:
        rows = [[p, *(counts[s] for s in states)] for p, counts in by_plan.items()]
        parts.append("\n" + table(("PLAN", *states), rows))
    if r["parked"]:
        rows = [
            [
                f.flow_id,
                f"{f.plan}@{f.version}",
                f.step,
                when(f.updated_at),
                when(f.park_deadline),
            ]
            for f in r["parked"]
        ]
        parts.append(
            "\noldest parked\n" + table(("FLOW", "PLAN", "STEP", "SINCE", "DEADLINE"), rows)
        )
    groups: _triage.Groups = r["errors"]
    if groups.groups:
        rows = [
            [
                g.flows,
                g.state,
                when(g.first),
                when(g.last),
                ", ".join(g.examples),
                cut(g.error, 100),
            ]
            for g in groups.groups
        ]
        parts.append(
            "\nfailed and blocked, by error\n"
            + table(("FLOWS", "STATE", "FIRST", "LAST", "E.G.", "ERROR"), rows)
        )
        parts += _left_out(groups)
    if r["engines"]:
        rows = []
        for o, until, at, n in r["engines"]:
            beat = r["beats"].get(o, {})
            where = "-" if beat.get("pid") is None else f"{beat['pid']}@{beat['host']}"
            alive = "alive" if until >= r["clock"] else "gone"
            rows.append([o, where, when(at), alive, when(until), n])
        parts.append(
            "\nengines\n"
            + table(("ENGINE", "PID@HOST", "STARTED", "LEASE", "UNTIL", "FLOWS"), rows)
        )
    return parts


def _errors_json(groups: _triage.Groups, limit: int) -> dict[str, Json]:
    return {
        "groups": [
            {
                "state": g.state,
                "error": g.error,
                "flows": g.flows,
                "first_seen": g.first,
                "last_seen": g.last,
                "examples": list(g.examples),
                "match": g.match,
            }
            for g in groups.groups
        ],
        "limit": limit,
        "total_groups": groups.total_groups,
        "groups_left_out": groups.groups_left_out,
        "flows_left_out": groups.flows_left_out,
        "flows_not_grouped": groups.flows_not_grouped,
    }


def _left_out(groups: _triage.Groups) -> list[str]:
    """The lines that say what the table of errors does not show."""
    lines = []
    if groups.groups_left_out:
        lines.append(
            f"({groups.groups_left_out} more group(s) of {groups.flows_left_out} flow(s) left"
            f" out: --limit N shows more)"
        )
    if groups.flows_not_grouped:
        lines.append(
            f"({groups.flows_not_grouped} flow(s) not grouped: their errors are past the"
            f" {_triage.SCAN} most common distinct texts read; list --state FAILED --error TEXT"
            " finds them)"
        )
    return lines


def _first_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def one_line(error: BaseException, spec: str) -> str:
    """What went wrong: a `Problem` as it is; anything else (an unreachable store, a refusal)
    named by its type, not as a traceback; a DSN's password never shown."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if isinstance(error, Problem):
        return str(error)
    if isinstance(error, FlowError | ValueError | TypeError):  # the engine refused an argument
        return masked(_first_line(error))
    what = "the PostgreSQL database" if is_dsn(spec) else "the SQLite file"
    text = masked(cut(_first_line(error), 300))
    return f"cannot use {what} {shown(spec)}: {type(error).__name__}: {text}"
