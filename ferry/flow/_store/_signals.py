"""The tables of events and streams out of running flows (SPEC 5.10), their writes in a batch's
transaction and their reads.

Tables (`ddl`):

- ``flow_events(flow_id, name, value, revision)`` (on SQLite ``WITHOUT ROWID``,
  `_dialect.Dialect.keyed_table`): each key (``name``) a flow set, with its
  latest value (JSON text) and the revision of the flow's write that set it; primary key
  ``(flow_id, name)``.
- ``flow_stream(flow_id, last, first, value, revision)``: a flow's stream in chunks, one row
  per step's values (at most `CHUNK_VALUES`) at offsets ``first`` to ``last`` (1, 2, 3, ...
  per flow), ``value`` their JSON texts one a line (canonical JSON never holds a newline: one
  is escaped in a string), so a step's values cost one row, as the same bytes in ``ctx.data``
  do (docs/adr/0179); primary key ``(flow_id, last)``. The runner gives the offsets
  (`_model._signals`); `record` checks that they follow the stream's last, so a stream is
  never written with a gap or twice. On SQLite a rowid table, its key a second B-tree: a row
  of a step's values is large, appended at the table's end, where in the key's own B-tree
  (``WITHOUT ROWID``) it would split pages in the middle of it, one more page a commit
  (docs/adr/0181). Stores an earlier engine made keep the key's B-tree; either serves.

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
#: Values one row of the stream holds, at most (a step's values go in rows of this many).
CHUNK_VALUES: Final = 1000
#: Values one stream read returns, at most (a reader asks again for the rest).
PAGE: Final = 1000


def ddl(d: _dialect.Dialect) -> list[str]:
    """The two tables, each idempotent; on SQLite stored in their key's B-tree."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {EVENTS} (
            flow_id TEXT NOT NULL,
            name TEXT NOT NULL,
            value TEXT NOT NULL,
            revision BIGINT NOT NULL,
            PRIMARY KEY (flow_id, name)){d.keyed_table}""",
        f"""CREATE TABLE IF NOT EXISTS {STREAM} (
            flow_id TEXT NOT NULL,
            last BIGINT NOT NULL,
            first BIGINT NOT NULL,
            value TEXT NOT NULL,
            revision BIGINT NOT NULL,
            PRIMARY KEY (flow_id, last))""",
    ]


_COLUMNS: Final = "(flow_id, last, first, value, revision)"
#: A step's first chunk, inserted only if the stream's last offset is the one it follows.
_FOLLOWING: Final = (
    f"INSERT INTO {STREAM} {_COLUMNS}"
    " SELECT ?, CAST(? AS BIGINT), CAST(? AS BIGINT), ?, CAST(? AS BIGINT)"
    f" WHERE (SELECT COALESCE(MAX(last), 0) FROM {STREAM} WHERE flow_id = ?) = ?"
    " RETURNING last"
)


def _rows(n: int) -> str:
    return ", ".join(["(?, ?, ?, ?)"] * n)


def record(tx: Tx, ops: Sequence[Op], results: Sequence[Result]) -> None:
    """Insert the events and stream values of the ops whose transitions were written (in this
    transaction, after the batch's writer), and notify readers elsewhere of them (PostgreSQL,
    `_notify.announce_signals`). Raises `StreamGap` (the batch fails and is split, and the op
    is refused alone, ADR 0063) for values whose first offset does not follow the stream's
    last. Cost: nothing for a batch without any; else one statement per 200 events, per step
    one statement per `CHUNK_VALUES` values (the first also checks that its offsets follow),
    and one notification statement."""
    events: dict[tuple[str, str], tuple[str, int]] = {}
    chunks: list[tuple[str, int, tuple[str, ...], int]] = []
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
        if s.values:
            chunks.append((fid, s.first, s.values, revision))
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
    for fid, first, texts, revision in chunks:
        for i in range(0, len(texts), CHUNK_VALUES):
            part = texts[i : i + CHUNK_VALUES]
            at = first + i
            row = (fid, at + len(part) - 1, at, "\n".join(part), revision)
            if i:  # follows the chunk this statement's first inserted
                tx.execute(f"INSERT INTO {STREAM} {_COLUMNS} VALUES (?, ?, ?, ?, ?)", row)
                continue
            # Inserted only if it follows the stream's last (the runner's offsets must go on
            # from the stream's): the check and the row in one statement.
            if not tx.execute(_FOLLOWING, (*row, fid, first - 1)):
                raise StreamGap(
                    f"flow {fid!r}: a step's values at offsets {first}.. do not follow its"
                    f" stream of {length(tx, fid)}"
                )
    _notify.announce_signals(tx, written)


class StreamGap(ValueError):
    """A step's values do not follow its flow's stream (the runner's count was wrong): its
    write is refused, never stored with a gap or twice."""


def length(tx: Tx, flow_id: str) -> int:
    """How many values the flow's stream holds (its last offset). One index lookup."""
    rows = tx.execute(f"SELECT MAX(last) FROM {STREAM} WHERE flow_id = ?", (flow_id,))
    return int(rows[0][0] or 0)


def _values(rows: Sequence[Sequence[Any]]) -> list[tuple[int, str]]:
    """The (offset, JSON text) of each value of the chunk rows ``(first, value)``."""
    out: list[tuple[int, str]] = []
    for first, text in rows:
        out += enumerate(text.split("\n"), int(first))
    return out


def events_of(tx: Tx, flow_id: str) -> dict[str, str]:
    """Every key the flow set, with its latest value's JSON text, in key order."""
    rows = tx.execute(
        f"SELECT name, value FROM {EVENTS} WHERE flow_id = ? ORDER BY name", (flow_id,)
    )
    return {r[0]: r[1] for r in rows}


def stream_of(tx: Tx, flow_id: str, after: int, limit: int = PAGE) -> list[tuple[int, str]]:
    """The flow's values at offsets > `after`, in order, at most `limit`: (offset, JSON text).
    Reads the chunks that hold them, a few at a time (an index range each)."""
    out: list[tuple[int, str]] = []
    last = after
    while len(out) < limit:
        rows = tx.execute(
            f"SELECT first, value, last FROM {STREAM} WHERE flow_id = ? AND last > ?"
            " ORDER BY last LIMIT 8",
            (flow_id, last),
        )
        out += [v for v in _values([(r[0], r[1]) for r in rows]) if v[0] > after]
        if len(rows) < 8:
            break
        last = int(rows[-1][2])
    return out[: int(limit)]


def last_of(tx: Tx, flow_id: str, n: int) -> list[tuple[int, str]]:
    """The flow's last `n` values, oldest first (the inspector's and the dashboard's)."""
    rows = tx.execute(
        f"SELECT first, value FROM {STREAM} WHERE flow_id = ? ORDER BY last DESC LIMIT {int(n)}",
        (flow_id,),
    )
    return _values(list(reversed(rows)))[-int(n) :] if n > 0 else []


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
