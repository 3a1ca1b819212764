"""The flow store's SQL facts, each written once: table and column names, the row codec, the
active states, the orphan rule, and the statements of each dialect.

Every statement of the store (`_store`, `_batch`) is built here once per dialect, at import, and
looked up by `Tx.dialect` (`statements`): no statement is formatted per call. Placeholders are
``?`` in both dialects (the PostgreSQL store rewrites them). What differs between the two
dialects is in `_dialect.Dialect` and nowhere else.

No trio, no clock.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from itertools import compress
from operator import is_not
from typing import Any, Final

import attrs

from .._model._types import State
from .._model._values import ACTIVE, Flow, parse_stack, stack_text
from ._dialect import DIALECTS, Dialect

#: The tables (docs in `_store`).
FLOWS: Final = "flow_flows"
HISTORY: Final = "flow_history"
MAILBOX: Final = "flow_mailbox"
ENGINES: Final = "flow_engines"
PLANS: Final = "flow_plans"

STATES: Final = {s.value: s for s in State}
#: Each state's stored text, and None's: `State.value` is a Python-level descriptor in 3.11 (an
#: `enum.property`), a call per read; a dict lookup is none.
STATE_TEXT: Final[dict[State | None, str | None]] = {s: s.value for s in State}
STATE_TEXT[None] = None

#: The active states (`_machine.ACTIVE`) as an SQL list, in `State`'s order: the partial indexes
#: and the queries that use them must say it the same way.
IN_ACTIVE: Final = "IN (" + ", ".join(f"'{s.value}'" for s in State if s in ACTIVE) + ")"
#: The finished states, for the index of finished flows.
IN_FINISHED: Final = "IN ('COMPLETED', 'FAILED')"

#: The row's columns as `_machine.Flow` has them, in the order of `to_flow`.
FIELDS: Final = (
    "flow_id",
    "plan",
    "version",
    "created_at",
    "state",
    "step_index",
    "step",
    "attempt",
    "data",
    "revision",
    "updated_at",
    "error",
    "park_deadline",
    "on_timeout",
    "wake",
    "timed_out",
    "stack",
    "blocked",
    "blocked_from",
    "fan_in",
    "owner",
    "lease_until",
    "trace",
    "parent",
    "deadline",
    "queue_key",
    "not_before",
)
#: The `Flow` field a column of `FIELDS` holds, where its name is not the column's: the column
#: ``lease_until`` holds `Flow.released_at` (docs/adr/0136).
ATTRIBUTE: Final = {"lease_until": "released_at"}
#: `FIELDS` as a select list.
COLUMNS: Final = ", ".join(FIELDS)
#: What a write changes (never flow_id, plan, version, created_at, trace, parent, deadline,
#: queue_key, not_before), in the order of `mutable_values`.
MUTABLE: Final = FIELDS[4:-5]
#: The PostgreSQL type of each column of `FIELDS` (the arrays of a batch are cast to them).
PG_TYPES: Final = {
    "flow_id": "text",
    "plan": "text",
    "version": "bigint",
    "created_at": "double precision",
    "state": "text",
    "step_index": "bigint",
    "step": "text",
    "attempt": "bigint",
    "data": "text",
    "revision": "bigint",
    "updated_at": "double precision",
    "error": "text",
    "park_deadline": "double precision",
    "on_timeout": "text",
    "wake": "text",
    "timed_out": "integer",
    "stack": "text",
    "blocked": "text",
    "blocked_from": "text",
    "fan_in": "bigint",
    "owner": "text",
    "lease_until": "double precision",
    "trace": "text",
    "parent": "text",
    "deadline": "double precision",
    "queue_key": "text",
    "not_before": "double precision",
    "start_data": "text",
}


def to_flow(row: Sequence[Any]) -> Flow:
    """The `Flow` of a row selected as `COLUMNS` (further columns are ignored)."""
    blocked_from = row[18]
    return Flow(
        flow_id=row[0],
        plan=row[1],
        version=row[2],
        created_at=row[3],
        state=STATES[row[4]],
        step_index=row[5],
        step=row[6],
        attempt=row[7],
        data=row[8],
        revision=row[9],
        updated_at=row[10],
        error=row[11],
        park_deadline=row[12],
        on_timeout=row[13],
        wake=row[14],
        timed_out=bool(row[15]),
        stack=parse_stack(row[16]),
        blocked=row[17],
        blocked_from=None if blocked_from is None else STATES[blocked_from],
        fan_in=row[19],
        owner=row[20],
        released_at=row[21],  # the column keeps its name: docs/adr/0136
        trace=row[22],
        parent=row[23],
        deadline=row[24],
        queue_key=row[25],
        not_before=row[26],
    )


def mutable_values(f: Flow) -> tuple[Any, ...]:
    """The values of `MUTABLE` for `f`."""
    state_text = STATE_TEXT
    return (
        state_text[f.state],
        f.step_index,
        f.step,
        f.attempt,
        f.data,
        f.revision,
        f.updated_at,
        f.error,
        f.park_deadline,
        f.on_timeout,
        f.wake,
        int(f.timed_out),
        stack_text(f.stack),
        f.blocked,
        state_text[f.blocked_from],
        f.fan_in,
        f.owner,
        f.released_at,
    )


#: The index in `MUTABLE` of the one column a write may find changed at the revision it expects
#: (a release sets ``lease_until`` alone, `_store.release`): `changed_write` always writes it.
_LEASE_UNTIL: Final = MUTABLE.index("lease_until")
assert MUTABLE[-1] == "lease_until"  # `changed_write` appends it last


#: A `Flow`'s values of `MUTABLE` as the row holds them (a `State`, a bool, a tuple: not yet
#: converted as `mutable_values` converts them), read in one call.
_unconverted: Final = operator.attrgetter(*(ATTRIBUTE.get(c, c) for c in MUTABLE))
_ALL: Final = range(len(MUTABLE))


#: How `mutable_values` converts each column of `MUTABLE` (None: stored as it is).
_CONVERTED: Final[dict[str, Callable[[Any], Any]]] = {
    "state": STATE_TEXT.__getitem__,
    "timed_out": int,
    "stack": stack_text,
    "blocked_from": STATE_TEXT.__getitem__,
}
_STORED: Final = tuple(_CONVERTED.get(name) for name in MUTABLE)


def changed_write(before: Flow, after: Flow) -> tuple[tuple[int, ...], list[Any]]:
    """What a write from `before` to `after` must set: the indexes in `MUTABLE` of its
    columns, and their values as `mutable_values` gives them. A column is set if its value or
    type differs (``1`` and ``1.0`` are stored differently), and ``lease_until`` always: a
    release changes it without a new revision, so the stored row may hold another value than
    `before` does. A transition copies the fields it leaves alone (`_machine._bump`), so only
    the fields that are not the same object are compared, and only the set ones converted."""
    b = _unconverted(before)
    a = _unconverted(after)
    columns = [
        i
        for i in compress(_ALL, map(is_not, b, a))
        if (x := b[i]) != (y := a[i]) or type(x) is not type(y)
    ]
    if not columns or columns[-1] != _LEASE_UNTIL:  # the last column of MUTABLE
        columns.append(_LEASE_UNTIL)
    return tuple(columns), [a[i] if (c := _STORED[i]) is None else c(a[i]) for i in columns]


@functools.lru_cache(maxsize=256)
def update_columns(columns: tuple[int, ...]) -> str:
    """SQL: the compare-and-set UPDATE of the columns `MUTABLE[i]` for `i` in `columns` (their
    values, then the flow id and the expected revision); answered by the count of rows it
    changed (SQLite's writer, `_row_by_row.RowByRow`). Cached: a handful of column sets occur."""
    sets = ", ".join(f"{MUTABLE[i]} = ?" for i in columns)
    return f"UPDATE {FLOWS} SET {sets} WHERE flow_id = ? AND revision = ?"


#: The row counts of `update_rows` and `insert_rows` statements: a batch's rows go in chunks of
#: these sizes (its count in binary, capped at the largest), so that few statement texts occur
#: and each is prepared once; the largest keeps a chunk under SQLite's 32,766 parameters.
CHUNKS: Final = (512, 256, 128, 64, 32, 16, 8, 4, 2, 1)


def chunks(n: int) -> list[tuple[int, int]]:
    """`n` rows as ``(start, size)`` chunks, every size one of `CHUNKS`."""
    out = []
    start = 0
    for size in CHUNKS:
        while n - start >= size:
            out.append((start, size))
            start += size
    return out


@functools.lru_cache(maxsize=256)
def update_rows(columns: tuple[int, ...], n: int) -> str:
    """SQL: the compare-and-set of `n` rows in one statement (SQLite), each setting the columns
    `MUTABLE[i]` for `i` in `columns`: per row, those values, then its flow id and expected
    revision. It returns the flow id of each row it matched; a row it does not return was at
    another revision (or is gone) and is that row's conflict alone."""
    row = "(" + ", ".join(["?"] * (len(columns) + 2)) + ")"
    sets = ", ".join(f"{MUTABLE[c]} = v.column{j + 1}" for j, c in enumerate(columns))
    k = len(columns)
    return (
        f"UPDATE {FLOWS} SET {sets} FROM (VALUES {', '.join([row] * n)}) AS v"
        f" WHERE {FLOWS}.flow_id = v.column{k + 1} AND {FLOWS}.revision = v.column{k + 2}"
        f" RETURNING {FLOWS}.flow_id"
    )


@functools.lru_cache(maxsize=len(CHUNKS))
def insert_rows(n: int) -> str:
    """SQL: insert `n` new flows in one statement (SQLite; `row_values` of each, one after the
    other), skipping an id that exists; it returns the ids it inserted."""
    row = "(" + ", ".join(["?"] * (len(FIELDS) + 1)) + ")"
    return (
        f"INSERT INTO {FLOWS} ({COLUMNS}, start_data) VALUES {', '.join([row] * n)}"
        " ON CONFLICT (flow_id) DO NOTHING RETURNING flow_id"
    )


def _marks(n: int, width: int = 1) -> str:
    """``n`` rows of `width` placeholders: ``?, ?`` or ``(?, ?), (?, ?)``."""
    if width == 1:
        return ", ".join(["?"] * n)
    return ", ".join(["(" + ", ".join(["?"] * width) + ")"] * n)


@functools.lru_cache(maxsize=len(CHUNKS))
def select_rows(n: int) -> str:
    """SQL: the rows (`COLUMNS`) of `n` flow ids, in one statement (SQLite)."""
    return f"SELECT {COLUMNS} FROM {FLOWS} WHERE flow_id IN ({_marks(n)})"


@functools.lru_cache(maxsize=len(CHUNKS))
def seen_rows(n: int) -> str:
    """SQL: which of `n` (flow id, message id) pairs, one after the other, are in the mailbox
    (SQLite); it returns those pairs. (``CROSS JOIN`` keeps the pairs the outer loop, each
    looked up in the mailbox's unique index: as ``(flow_id, message_id) IN (VALUES ...)``
    SQLite scans the whole mailbox.)"""
    return (
        f"SELECT m.flow_id, m.message_id FROM (VALUES {_marks(n, 2)}) AS v"
        f" CROSS JOIN {MAILBOX} AS m ON m.flow_id = v.column1 AND m.message_id = v.column2"
    )


@functools.lru_cache(maxsize=len(CHUNKS))
def first_queued_rows(n: int) -> str:
    """SQL: the first queued message (flow id, message id, payload) of each of `n` flows that
    has one (SQLite: a bare column beside ``MIN`` comes from the row with the least ``seq``)."""
    return (
        f"SELECT flow_id, message_id, payload, MIN(seq) FROM {MAILBOX}"
        f" WHERE flow_id IN ({_marks(n)}) AND status = 'QUEUED' GROUP BY flow_id"
    )


@functools.lru_cache(maxsize=len(CHUNKS))
def receive_rows(n: int) -> str:
    """SQL: `n` new messages (flow id, message id, payload, status, arrival time each) in one
    statement (SQLite), in that order (their ``seq``); a message id its flow has is skipped."""
    return (
        f"INSERT INTO {MAILBOX} (flow_id, message_id, payload, status, at)"
        f" VALUES {_marks(n, 5)} ON CONFLICT (flow_id, message_id) DO NOTHING"
    )


def row_values(f: Flow) -> tuple[Any, ...]:
    """The values of `FIELDS` and ``start_data`` for a new flow `f` (its data is its start
    data)."""
    return (
        f.flow_id,
        f.plan,
        f.version,
        f.created_at,
        *mutable_values(f),
        f.trace,
        f.parent,
        f.deadline,
        f.queue_key,
        f.not_before,
        f.data,
    )


def orphan(row: str, at: str = "?") -> str:
    """SQL: the active flow `row` is nobody's at the time `at` (an SQL expression; as a
    placeholder it is given twice): it has no owner, or its owner let it go (``lease_until``
    earlier), or its owner's engine lease (in the engines table) lapsed or is unknown. The one
    statement of the rule: `load_orphans`, `count_orphans`, `holder` and a takeover's write use
    it."""
    return (
        f"({row}.owner IS NULL OR {row}.lease_until < {at} OR NOT EXISTS (SELECT 1 FROM"
        f" {ENGINES} e WHERE e.owner = {row}.owner AND e.lease_until >= {at}))"
    )


# ------------------------------------------------------------------------------- statements


def _pg_arrays(names: Sequence[str]) -> str:
    """``unnest(?::t1[], ?::t2[], ...)``: one array parameter per column of `names`."""
    return "unnest(" + ", ".join(f"?::{PG_TYPES[n]}[]" for n in names) + ")"


@attrs.frozen
class Statements:
    """The store's statements in one dialect, formatted once (`statements`)."""

    d: Dialect
    # writes, a row at a time
    insert: str
    existing: str
    update_orphan: str
    hold: str
    revision: str
    seen: str
    first_queued: str
    receive: str
    take: str
    history: str
    # writes, a batch at a time (PostgreSQL: `_batch`)
    lock_leases: str
    lock_rows: str
    insert_rows: str
    update_rows: str
    seen_rows: str
    first_queued_rows: str
    receive_rows: str
    take_rows: str
    history_rows: str
    # reads
    select: str
    select_history: str
    select_mailbox: str
    select_active: str
    select_active_owned: str
    select_deadlines: str
    select_orphans: str
    count_waiting: str
    count_states: str
    count_plans: str
    oldest_parked: str
    count_orphans: str
    holder: str
    select_engines: str
    prune_engines: str
    select_plans: str
    register_plan: str
    live_plans: str
    # the engines' leases
    heartbeat: str
    claim_select: str
    claim_update: str
    claim_insert: str
    renew: str
    renew_lease: str
    incarnation_of: str
    end_lease: str

    @classmethod
    def build(cls, d: Dialect) -> Statements:
        return cls(d, **_row_writes(d), **_array_writes(d), **_reads(), **_leases())


def _row_writes(d: Dialect) -> dict[str, str]:
    """The writes of a row at a time (SQLite's writer)."""
    lock = d.for_update
    sets = ", ".join(f"{c} = ?" for c in MUTABLE)
    marks = ", ".join("?" * (len(FIELDS) + 1))
    return dict(
        insert=f"INSERT INTO {FLOWS} ({COLUMNS}, start_data) VALUES ({marks})"
        " ON CONFLICT (flow_id) DO NOTHING",
        existing=f"SELECT {COLUMNS}, start_data FROM {FLOWS} WHERE flow_id = ?{lock}",
        update_orphan=f"UPDATE {FLOWS} SET {sets} WHERE flow_id = ? AND revision = ?"
        f" AND {orphan(FLOWS)} RETURNING revision",
        hold=f"SELECT 1 FROM {FLOWS} WHERE flow_id = ? AND revision = ?{lock}",
        revision=f"SELECT revision, owner FROM {FLOWS} WHERE flow_id = ?",
        seen=f"SELECT 1 FROM {MAILBOX} WHERE flow_id = ? AND message_id = ?",
        first_queued=f"SELECT message_id, payload FROM {MAILBOX}"
        " WHERE flow_id = ? AND status = 'QUEUED' ORDER BY seq LIMIT 1",
        receive=f"INSERT INTO {MAILBOX} (flow_id, message_id, payload, status, at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (flow_id, message_id) DO NOTHING",
        take=f"UPDATE {MAILBOX} SET status = 'TAKEN'"
        " WHERE flow_id = ? AND message_id = ? AND status = 'QUEUED'",
        history=f"INSERT INTO {HISTORY} (flow_id, revision, n, at, kind, step, attempt,"
        " detail) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    )


def _array_writes(d: Dialect) -> dict[str, str]:
    """The writes of a batch at a time, every parameter an array (PostgreSQL's writer)."""
    lock = d.for_update
    v_sets = ", ".join(f"{c} = v.{c}" for c in MUTABLE)
    update_names = ("flow_id", "revision", *MUTABLE, "lease_until")
    update_cols = ", ".join(("flow_id", "expected", *MUTABLE, "lapsed_at"))
    history_pg = (
        "unnest(?::text[], ?::bigint[], ?::integer[], ?::double precision[], ?::text[],"
        " ?::text[], ?::bigint[], ?::text[])"
    )
    return dict(
        lock_leases=f"SELECT 1 FROM {ENGINES} WHERE owner = ANY(?)"
        ' ORDER BY owner COLLATE "C" FOR SHARE',
        lock_rows=f"SELECT {COLUMNS}, start_data FROM {FLOWS} WHERE flow_id = ANY(?)"
        f' ORDER BY flow_id COLLATE "C"{lock}',
        insert_rows=f"INSERT INTO {FLOWS} ({COLUMNS}, start_data)"
        f" SELECT * FROM {_pg_arrays((*FIELDS, 'start_data'))}"
        " ON CONFLICT (flow_id) DO NOTHING RETURNING flow_id",
        update_rows=f"UPDATE {FLOWS} f SET {v_sets}"
        f" FROM {_pg_arrays(update_names)} AS v({update_cols})"
        " WHERE f.flow_id = v.flow_id AND f.revision = v.expected"
        f" AND (v.lapsed_at IS NULL OR {orphan('f', 'v.lapsed_at')}) RETURNING f.flow_id",
        seen_rows=f"SELECT m.flow_id, m.message_id FROM {MAILBOX} m"
        " JOIN unnest(?::text[], ?::text[]) AS s(flow_id, message_id)"
        " ON m.flow_id = s.flow_id AND m.message_id = s.message_id",
        first_queued_rows=f"SELECT DISTINCT ON (flow_id) flow_id, message_id, payload"
        f" FROM {MAILBOX} WHERE flow_id = ANY(?) AND status = 'QUEUED'"
        " ORDER BY flow_id, seq",
        receive_rows=f"INSERT INTO {MAILBOX} (flow_id, message_id, payload, status, at)"
        " SELECT flow_id, message_id, payload, status, at FROM unnest(?::text[],"
        " ?::text[], ?::text[], ?::text[], ?::double precision[]) WITH ORDINALITY"
        " AS r(flow_id, message_id, payload, status, at, n) ORDER BY n"
        " ON CONFLICT (flow_id, message_id) DO NOTHING",
        take_rows=f"UPDATE {MAILBOX} m SET status = 'TAKEN'"
        " FROM unnest(?::text[], ?::text[]) AS t(flow_id, message_id)"
        " WHERE m.flow_id = t.flow_id AND m.message_id = t.message_id"
        " AND m.status = 'QUEUED'",
        history_rows=f"INSERT INTO {HISTORY} (flow_id, revision, n, at, kind, step, attempt,"
        f" detail) SELECT * FROM {history_pg}",
    )


def _reads() -> dict[str, str]:
    """The reads (and the plans' and engines' rows the operators see)."""
    active = f"state {IN_ACTIVE}"
    return dict(
        select=f"SELECT {COLUMNS} FROM {FLOWS} WHERE flow_id = ?",
        select_history=f"SELECT revision, at, kind, step, attempt, detail FROM {HISTORY}"
        " WHERE flow_id = ? ORDER BY revision, n",
        select_mailbox=f"SELECT message_id, payload, status FROM {MAILBOX}"
        " WHERE flow_id = ? ORDER BY seq",
        select_active=f"SELECT {COLUMNS} FROM {FLOWS} WHERE {active}"
        " ORDER BY updated_at, flow_id LIMIT ?",
        select_active_owned=f"SELECT {COLUMNS} FROM {FLOWS} WHERE {active} AND owner = ?"
        " ORDER BY updated_at, flow_id LIMIT ?",
        select_deadlines=f"SELECT park_deadline, flow_id, revision FROM {FLOWS} f"
        " WHERE state = 'PARKED' AND park_deadline IS NOT NULL AND park_deadline <= ?",
        select_orphans=f"SELECT {', '.join(f'f.{c}' for c in FIELDS)} FROM {FLOWS} f"
        f" WHERE f.{active} AND {orphan('f')}",
        count_waiting=f"SELECT state, COUNT(*) FROM {FLOWS}"
        " WHERE state IN ('PARKED', 'BLOCKED') GROUP BY state",
        count_states=f"SELECT state, COUNT(*) FROM {FLOWS} GROUP BY state",
        count_plans=f"SELECT plan, version, state, COUNT(*) FROM {FLOWS}"
        " GROUP BY plan, version, state ORDER BY plan, version, state",
        oldest_parked=f"SELECT {COLUMNS} FROM {FLOWS} WHERE state = 'PARKED'"
        " ORDER BY updated_at, flow_id LIMIT ?",
        count_orphans=f"SELECT COUNT(*) FROM {FLOWS} f WHERE f.{active} AND {orphan('f')}",
        holder=f"SELECT f.lease_until, e.lease_until, {orphan('f')} FROM {FLOWS} f"
        f" LEFT JOIN {ENGINES} e ON e.owner = f.owner WHERE f.flow_id = ?"
        f" AND f.owner IS NOT NULL AND f.{active}",
        select_engines=f"SELECT e.owner, e.lease_until, e.started_at, (SELECT COUNT(*)"
        f" FROM {FLOWS} f WHERE f.owner = e.owner AND f.{active}) FROM {ENGINES} e"
        " ORDER BY e.owner",
        prune_engines=f"DELETE FROM {ENGINES} WHERE lease_until < ? AND NOT EXISTS"
        f" (SELECT 1 FROM {FLOWS} f WHERE f.owner = {ENGINES}.owner AND f.{active})"
        " RETURNING owner",
        select_plans=f"SELECT plan, version, shape, registered_at FROM {PLANS}"
        " ORDER BY plan, version",
        register_plan=f"INSERT INTO {PLANS} (plan, version, shape, registered_at)"
        " VALUES (?, ?, ?, ?) ON CONFLICT (plan, version) DO UPDATE SET"
        " shape = excluded.shape, registered_at = excluded.registered_at",
        live_plans=f"SELECT plans FROM {ENGINES} WHERE lease_until > ? AND plans IS NOT NULL",
    )


def _leases() -> dict[str, str]:
    """The engines' leases."""
    return dict(
        heartbeat=f"INSERT INTO {ENGINES} (owner, lease_until, started_at) VALUES (?, ?, ?)"
        " ON CONFLICT (owner) DO UPDATE SET lease_until = excluded.lease_until",
        claim_select="SELECT owner, incarnation, lease_until, host, pid, started_at"
        f" FROM {ENGINES} WHERE owner = ?",
        claim_update=f"UPDATE {ENGINES} SET lease_until = ?, started_at = ?, incarnation = ?,"
        " host = ?, pid = ?, plans = ? WHERE owner = ?",
        claim_insert=f"INSERT INTO {ENGINES} (owner, lease_until, started_at, incarnation,"
        " host, pid, plans) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (owner) DO NOTHING"
        " RETURNING owner",
        renew=f"UPDATE {ENGINES} SET lease_until = ? WHERE owner = ? AND incarnation = ?"
        " RETURNING owner",
        renew_lease=f"UPDATE {ENGINES} SET lease_until = GREATEST(lease_until,"
        " EXTRACT(EPOCH FROM clock_timestamp())::float8 + ?)"
        " WHERE owner = ? AND incarnation = ?"
        " AND lease_until - ? > EXTRACT(EPOCH FROM clock_timestamp())"
        " RETURNING lease_until",
        incarnation_of=f"SELECT incarnation FROM {ENGINES} WHERE owner = ?",
        end_lease=f"UPDATE {ENGINES} SET lease_until = ? WHERE owner = ? AND incarnation = ?"
        " AND lease_until > ?",
    )


_STATEMENTS: Final = {name: Statements.build(d) for name, d in DIALECTS.items()}


def statements(dialect: str) -> Statements:
    """The statements of `dialect` (``Tx.dialect``)."""
    return _STATEMENTS[dialect]
