"""The requests of clients in other processes (`flow.connect`, docs/adr/0125), and the
heartbeat of an engine that serves an SQLite file (docs/adr/0126). Synchronous SQL, each
function inside the caller's one transaction.

``flow_requests``: one row per request, keyed by the client's request id. ``kind`` is the call
(start, wake, cancel, resume, abandon, publish), ``body`` its canonical JSON arguments, ``answer``
the JSON the engine wrote once it applied it (``{"value": ...}`` or ``{"error": type, "message":
...}``), NULL while pending. A request is inserted once (a retry with the same id finds the row)
and answered once (the update takes only a pending row).
"""

from __future__ import annotations

import json
from typing import Any, Final

from ferry.projected import Tx

from . import _dialect
from ._sql import ENGINES

REQUESTS: Final = "flow_requests"

DDL: Final = (
    f"""CREATE TABLE IF NOT EXISTS {REQUESTS} (
        request_id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        body TEXT NOT NULL,
        at DOUBLE PRECISION NOT NULL,
        answer TEXT,
        answered_at DOUBLE PRECISION,
        answered_by TEXT)""",
    f"CREATE INDEX IF NOT EXISTS {REQUESTS}_pending ON {REQUESTS} (at) WHERE answer IS NULL",
)


def _channel(what: str) -> str:
    """A PostgreSQL channel of the store, as an SQL expression: one per schema, as
    `_notify.CHANNEL_SQL` (stores in two schemas of one database do not hear each other)."""
    return (
        f"'ferry_flow_{what}_' || left(encode(sha256(convert_to(current_schema() || '.{what}',"
        " 'UTF8')), 'hex'), 24)"
    )


#: The PostgreSQL channels: a request was stored, a request was answered (payload: its id).
ASKED_SQL: Final = _channel("asked")
ANSWERED_SQL: Final = _channel("answered")


def put(tx: Tx, request_id: str, kind: str, body: str, now: float) -> tuple[str, str, Any]:
    """Store the request unless its id is stored already; ``(kind, body, answer)`` of the row
    with that id (the answer parsed, None while pending). On PostgreSQL a notification on
    `ASKED_SQL` goes with the commit."""
    tx.execute(
        f"INSERT INTO {REQUESTS} (request_id, kind, body, at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (request_id) DO NOTHING",
        (request_id, kind, body, now),
    )
    if _dialect.of(tx).notifies:
        tx.execute(f"SELECT pg_notify({ASKED_SQL}, ?)", (request_id,))
    row = tx.execute(
        f"SELECT kind, body, answer FROM {REQUESTS} WHERE request_id = ?", (request_id,)
    )[0]
    return row[0], row[1], None if row[2] is None else json.loads(row[2])


def answer_of(tx: Tx, request_id: str) -> Any:
    """The parsed answer of a request, None while it is pending (or unknown)."""
    rows = tx.execute(f"SELECT answer FROM {REQUESTS} WHERE request_id = ?", (request_id,))
    return None if not rows or rows[0][0] is None else json.loads(rows[0][0])


def pending(tx: Tx, limit: int) -> list[tuple[str, str, str]]:
    """``(request_id, kind, body)`` of the requests not answered yet, oldest first."""
    rows = tx.execute(
        f"SELECT request_id, kind, body FROM {REQUESTS} WHERE answer IS NULL"
        " ORDER BY at, request_id LIMIT ?",
        (limit,),
    )
    return [(r[0], r[1], r[2]) for r in rows]


def answer(tx: Tx, request_id: str, text: str, by: str, now: float) -> bool:
    """Write the answer of a pending request; False if it was answered already (by another
    engine, or by a client that acted itself). On PostgreSQL a notification on `ANSWERED_SQL`."""
    rows = tx.execute(
        f"UPDATE {REQUESTS} SET answer = ?, answered_at = ?, answered_by = ?"
        " WHERE request_id = ? AND answer IS NULL RETURNING request_id",
        (text, now, by, request_id),
    )
    if rows and _dialect.of(tx).notifies:
        tx.execute(f"SELECT pg_notify({ANSWERED_SQL}, ?)", (request_id,))
    return bool(rows)


def prune(tx: Tx, before: float) -> int:
    """Delete the requests answered before `before` (retention's, with the finished flows);
    how many. A pending request is never deleted."""
    rows = tx.execute(
        f"DELETE FROM {REQUESTS} WHERE answer IS NOT NULL AND answered_at < ? RETURNING request_id",
        (before,),
    )
    return len(rows)


def has_requests(tx: Tx) -> bool:
    """Does the store hold the requests table (an engine of this version opened it)?"""
    return bool(tx.execute(_dialect.of(tx).table_exists, (REQUESTS,))[0][0])


def create(tx: Tx) -> None:
    """Create the requests table if missing (a client on a store an older engine made)."""
    for statement in DDL:
        tx.execute(statement)


# ------------------------------------------------------------- an SQLite engine's heartbeat


def beat(
    tx: Tx,
    owner: str,
    until: float,
    started: float,
    *,
    incarnation: str,
    host: str,
    pid: int,
    plans: str,
) -> None:
    """Record (or renew) the heartbeat of the engine serving an SQLite file: its row in
    ``flow_engines``, alive until `until`."""
    tx.execute(
        f"INSERT INTO {ENGINES} (owner, lease_until, started_at, incarnation, host, pid, plans)"
        " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (owner) DO UPDATE SET"
        " lease_until = excluded.lease_until, started_at = excluded.started_at,"
        " incarnation = excluded.incarnation, host = excluded.host, pid = excluded.pid,"
        " plans = excluded.plans",
        (owner, until, started, incarnation, host, pid, plans),
    )


def end_beat(tx: Tx, owner: str, incarnation: str) -> None:
    """Remove the heartbeat row at a clean close (only this incarnation's)."""
    tx.execute(f"DELETE FROM {ENGINES} WHERE owner = ? AND incarnation = ?", (owner, incarnation))


def heartbeats(tx: Tx) -> list[dict[str, Any]]:
    """Every engine row with where it runs: owner, pid, host, started, lease_until."""
    rows = tx.execute(
        f"SELECT owner, pid, host, started_at, lease_until FROM {ENGINES} ORDER BY owner"
    )
    return [
        {"owner": r[0], "pid": r[1], "host": r[2], "started_at": r[3], "lease_until": r[4]}
        for r in rows
    ]
