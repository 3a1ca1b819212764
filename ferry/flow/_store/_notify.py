"""The store's side of `wait` on a fleet: a notification from every batch that settles flows.

A `wait` in one engine for a flow that another engine runs learns that the flow settled from a
PostgreSQL notification instead of reading the row again and again: the transaction of a batch
(`_batch.write_batch`) that leaves flows `COMPLETED`, `FAILED` or `BLOCKED` also sends
``pg_notify`` on the store's channel, naming those flows and their new revisions (`announce`).
PostgreSQL delivers it to every listening connection when, and only if, the transaction
commits. `_listener` listens, and `_waiters` reads the rows its waits need (docs/adr/0096).

Only settling is announced: it is all a `wait` needs (the other changes of a flow another engine
runs are that engine's business), and it keeps the traffic at one statement per batch that
ends flows. Nothing is sent on SQLite: one engine writes a file, and its waits follow its memory.

Payload: JSON text, ``[[flow_id, revision], ...]``, ASCII (anything else is escaped), each
shorter than PostgreSQL's limit of 8,000 bytes; a batch that names more flows sends several
notifications, in the same one statement. A flow id too long to fit a payload of its own is
announced as `EVERYONE` (``"*"``: some flow settled, read every flow you wait for).

Channel (`CHANNEL_SQL`): ``ferry_flow_`` and 24 hex digits of the SHA-256 of
``<schema>.<namespace>``, where the schema is the connection's ``current_schema()`` (where the
tables are): fixed per store, and two stores in two schemas of one database do not hear each
other. It is computed by the database on both sides, so they cannot disagree.

Synchronous and pure but for `announce`'s one statement: no trio, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from ferry.projected import Tx

from .._model._values import BLOCKED, COMPLETED, FAILED, Transition
from . import _dialect

#: The states a `wait` returns in.
SETTLED = frozenset({COMPLETED, FAILED, BLOCKED})

#: The payload that names no flow: "a flow settled: read every flow you wait for".
EVERYONE = "*"

#: Bytes a payload may take (PostgreSQL refuses 8,000 or more).
LIMIT = 7900

#: The channel's name, as an SQL expression: one per schema (the store's tables are in the
#: connection's current schema), so stores in two schemas of one database do not hear each other.
CHANNEL_SQL = (
    "'ferry_flow_' || left(encode(sha256(convert_to(current_schema() || '.flow', 'UTF8')),"
    " 'hex'), 24)"
)


#: The channel of the flows whose events or stream a batch wrote (SPEC 5.10, docs/adr/0177):
#: apart from `CHANNEL_SQL`, so that a wait never hears of them (nor does an older engine).
SIGNALS_CHANNEL_SQL = (
    "'ferry_flow_s_' || left(encode(sha256(convert_to(current_schema() || '.flow', 'UTF8')),"
    " 'hex'), 24)"
)


def announce_signals(tx: Tx, written: Iterable[tuple[str, int]]) -> None:
    """In the batch's transaction, on PostgreSQL: notify `SIGNALS_CHANNEL_SQL` of the flows
    (and revisions) whose events or stream values it wrote. One statement, and only if there
    is any; nothing on SQLite."""
    pairs = list(written)
    if pairs and _dialect.of(tx).notifies:
        tx.execute(
            f"SELECT pg_notify({SIGNALS_CHANNEL_SQL}, p) FROM unnest(?::text[]) AS p",
            (payloads(pairs),),
        )


def announce(tx: Tx, transitions: Iterable[Transition]) -> None:
    """In the batch's transaction, on PostgreSQL: notify the store's channel of the flows that
    these (committed-with-the-batch) transitions left settled. One statement, and only if
    there is any; nothing on SQLite."""
    if not _dialect.of(tx).notifies:
        return
    ended = [(t.flow.flow_id, t.flow.revision) for t in transitions if _settles(t)]
    if ended:
        tx.execute(
            f"SELECT pg_notify({CHANNEL_SQL}, p) FROM unnest(?::text[]) AS p",
            (payloads(ended),),
        )


def _settles(t: Transition) -> bool:
    return t.written and t.flow.state in SETTLED


def payloads(ended: Iterable[tuple[str, int]]) -> list[str]:
    """``(flow_id, revision)`` pairs as payloads, each at most `LIMIT` bytes (in order; a
    pair too long for a payload of its own is `EVERYONE`, once)."""
    out: list[str] = []
    items: list[str] = []
    size = 2  # the brackets
    everyone = False
    for fid, revision in ended:
        item = json.dumps([fid, revision])  # ASCII: one byte per character
        if len(item) + 2 > LIMIT:
            everyone = True
            continue
        if items and size + 1 + len(item) > LIMIT:
            out.append("[" + ",".join(items) + "]")
            items, size = [], 2
        size += len(item) + (1 if items else 0)
        items.append(item)
    if items:
        out.append("[" + ",".join(items) + "]")
    if everyone:
        out.append(EVERYONE)
    return out


def parse(payload: str) -> list[tuple[str, int]] | None:
    """The ``(flow_id, revision)`` pairs a payload names; None for `EVERYONE`, and for a
    payload this module did not write (read everything rather than miss a flow)."""
    if payload == EVERYONE:
        return None
    try:
        items = json.loads(payload)
        pairs = [(fid, rev) for fid, rev in items]
    except (ValueError, TypeError):
        return None
    if all(isinstance(fid, str) and type(rev) is int for fid, rev in pairs):
        return pairs
    return None
