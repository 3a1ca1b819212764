"""The tables of events and streams out of running flows (SPEC 5.10), their writes in a batch's
transaction and their reads.

Tables (`ddl`, the same text in both dialects):

- ``flow_events(flow_id, name, value, revision)``: each key (``name``) a flow set, with its
  latest value (JSON text) and the revision of the flow's write that set it; primary key
  ``(flow_id, name)``.
- ``flow_stream(flow_id, pos, value, revision)``: a flow's stream, one row per value at its
  offset ``pos`` (1, 2, 3, ...); primary key ``(flow_id, pos)``, which refuses a second value at
  an offset (the runner gives them, `_model._signals`): a stream is never written twice.

`record` runs in `_batch.write_batch`'s transaction after the writer: the rows of every op
whose transition was written (a compare-and-set that lost writes none), so a step's events and
values commit with its outcome or not at all. Rows go with their flow (`_purge._rows_of`).

Everything here is synchronous and runs inside one store transaction: no trio, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from ferry.projected import Tx

from . import _dialect, _notify, _sql
from ._op import Change, Changed, Op, Result

EVENTS: Final = "flow_events"
STREAM: Final = "flow_stream"
#: Rows per insert statement, at most (4 parameters a row).
_CHUNK: Final = 200
#: Values one stream read returns, at most (a reader asks again for the rest).
PAGE: Final = 1000


def ddl() -> list[str]:
    """The two tables, each idempotent, the same on both dialects."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {EVENTS} (
            flow_id TEXT NOT NULL,
            name TEXT NOT NULL,
            value TEXT NOT NULL,
            revision BIGINT NOT NULL,
            PRIMARY KEY (flow_id, name))""",
        f"""CREATE TABLE IF NOT EXISTS {STREAM} (
            flow_id TEXT NOT NULL,
            pos BIGINT NOT NULL,
            value TEXT NOT NULL,
            revision BIGINT NOT NULL,
            PRIMARY KEY (flow_id, pos))""",
    ]


def _rows(n: int) -> str:
    return ", ".join(["(?, ?, ?, ?)"] * n)


def record(tx: Tx, ops: Sequence[Op], results: Sequence[Result]) -> None:
    """Insert the events and stream values of the ops whose transitions were written (in this
    transaction, after the batch's writer), and notify readers elsewhere of them (PostgreSQL,
    `_notify.announce_signals`). Cost: nothing for a batch without any; else one statement per
    200 rows of each table, and one notification statement."""
    events: dict[tuple[str, str], tuple[str, int]] = {}
    values: list[Any] = []
    written: list[tuple[str, int]] = []
    for op, result in zip(ops, results, strict=True):
        if not isinstance(op, Change) or op.signals is None:
            continue
        if not isinstance(result, Changed) or not result.transition.written:
            continue
        s = op.signals
        fid = op.flow_id
        revision = result.transition.flow.revision
        written.append((fid, revision))
        for key, text in s.events:
            events[(fid, key)] = (text, revision)
        for n, text in enumerate(s.values):
            values += (fid, s.first + n, text, revision)
    if events:
        rows = [(fid, key, text, rev) for (fid, key), (text, rev) in events.items()]
        for i in range(0, len(rows), _CHUNK):
            chunk = rows[i : i + _CHUNK]
            tx.execute(
                f"INSERT INTO {EVENTS} (flow_id, name, value, revision) VALUES {_rows(len(chunk))}"
                " ON CONFLICT (flow_id, name) DO UPDATE SET value = excluded.value,"
                " revision = excluded.revision",
                [v for row in chunk for v in row],
            )
    step = _CHUNK * 4
    for i in range(0, len(values), step):
        chunk = values[i : i + step]
        tx.execute(
            f"INSERT INTO {STREAM} (flow_id, pos, value, revision) VALUES {_rows(len(chunk) // 4)}",
            chunk,
        )
    _notify.announce_signals(tx, written)


def length(tx: Tx, flow_id: str) -> int:
    """How many values the flow's stream holds (its last offset). One index lookup."""
    rows = tx.execute(f"SELECT MAX(pos) FROM {STREAM} WHERE flow_id = ?", (flow_id,))
    return int(rows[0][0] or 0)


def events_of(tx: Tx, flow_id: str) -> dict[str, str]:
    """Every key the flow set, with its latest value's JSON text, in key order."""
    rows = tx.execute(
        f"SELECT name, value FROM {EVENTS} WHERE flow_id = ? ORDER BY name", (flow_id,)
    )
    return {r[0]: r[1] for r in rows}


def stream_of(tx: Tx, flow_id: str, after: int, limit: int = PAGE) -> list[tuple[int, str]]:
    """The flow's values at offsets > `after`, in order, at most `limit`: (offset, JSON text)."""
    rows = tx.execute(
        f"SELECT pos, value FROM {STREAM} WHERE flow_id = ? AND pos > ? ORDER BY pos"
        f" LIMIT {int(limit)}",
        (flow_id, after),
    )
    return [(int(r[0]), r[1]) for r in rows]


def last_of(tx: Tx, flow_id: str, n: int) -> list[tuple[int, str]]:
    """The flow's last `n` values, oldest first (the inspector's and the dashboard's)."""
    rows = tx.execute(
        f"SELECT pos, value FROM {STREAM} WHERE flow_id = ? ORDER BY pos DESC LIMIT {int(n)}",
        (flow_id,),
    )
    return [(int(r[0]), r[1]) for r in reversed(rows)]


def state_of(tx: Tx, flow_id: str) -> str | None:
    """The flow's state as stored (None: no such flow)."""
    rows = tx.execute(f"SELECT state FROM {_sql.FLOWS} WHERE flow_id = ?", (flow_id,))
    return None if not rows else str(rows[0][0])


def read_feed(
    tx: Tx, flow_id: str, after: int, events: bool, limit: int
) -> tuple[str | None, dict[str, str] | None, list[tuple[int, str]]]:
    """One read for the readers of a flow, in one transaction: its state (None: no such flow),
    its events (if asked), its values after `after` (at most `limit`; none for 0)."""
    state = state_of(tx, flow_id)
    if state is None:
        return None, None, []
    got = events_of(tx, flow_id) if events else None
    return state, got, stream_of(tx, flow_id, after, limit) if limit else []


#: The last values the operators' tools show of a stream.
SHOWN: Final = 10


def shown(
    tx: Tx, flow_id: str, n: int = SHOWN
) -> tuple[dict[str, str], int, list[tuple[int, str]]]:
    """What the inspector's ``show`` and the dashboard's flow page show: the flow's events, its
    stream's length and its last `n` values (nothing, in a store an older engine made that has
    no such tables yet: the operators' tools never change a store)."""
    if not tx.execute(_dialect.of(tx).table_exists, (STREAM,))[0][0]:
        return {}, 0, []
    return events_of(tx, flow_id), length(tx, flow_id), last_of(tx, flow_id, n)
