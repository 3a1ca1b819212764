"""The flow store: schema, the batched compare-and-set write, and the reads.

Everything here is synchronous and runs inside one store transaction on a worker thread (a
`ferry.projected.Tx` of the same `SqliteStore`/`PostgresStore` that `ProjectedWrite` uses): no
trio, no clock. The SQL is the common dialect of SQLite >= 3.35 and PostgreSQL, with ``?``
placeholders; the two differences (the mailbox's sequence column, and ``FOR UPDATE``) are picked
by `Tx.dialect`. Decisions are not taken here: a write runs a pure transition of `_machine` on the
row it holds, and records what the transition says (docs/adr/0021).

Tables, for a namespace ``ns`` (default ``flow``):

- ``ns_flows``: one row per flow (`_machine.Flow`'s fields, plus ``start_data``). ``revision``
  is the compare-and-set token of every write; ``owner`` (the engine that runs an active flow)
  and ``lease_until`` (when it let it go) are for a fleet. ``trace`` is the W3C trace context
  the flow's spans join (`_tracing`). Partial indexes: the active flows (``RUNNING``/
  ``COMPENSATING``, for recovery), the parked flows by deadline (for timers) and the finished
  flows by their last write (for retention, `_retention`, and the dashboard); the operators'
  filters and their order (`_query`).
- ``ns_history(flow_id, revision, n, at, kind, step, attempt, detail)``: every durable transition,
  primary key ``(flow_id, revision, n)``.
- ``ns_mailbox(seq, flow_id, message_id, payload, status, at)``: one row per accepted message,
  unique ``(flow_id, message_id)`` (the `DUPLICATE` check); ``status`` is ``QUEUED`` (kept for the
  next park) or ``TAKEN``; a partial index on the queued ones, in arrival (``seq``) order.
- ``ns_engines(owner, lease_until, started_at)``: a fleet's engines and their leases (one row per
  engine, its heartbeat); an active flow is held while the engine its ``owner`` names holds its
  lease (`_orphan`, docs/adr/0040). A partial index on the active flows' ``owner``.
- ``ns_plans(plan, version, shape, registered_at)``: the shape of every plan version an engine
  registered, for processes without the plans (an operator's engine, docs/adr/0044).

Concurrency: every write first holds its flow's row (the compare-and-set ``UPDATE``, or ``SELECT
... FOR UPDATE`` on PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` already serializes writers) and only
then reads the mailbox, so a wake and a park of one flow are serialized and a wake is never lost
between them. No statement is allowed to fail on a race (PostgreSQL would abort the whole
transaction, and the other flows of the batch with it): a stale revision is a row count of 0
(`Conflict`), a concurrent start is ``INSERT ... ON CONFLICT DO NOTHING`` followed by a read.
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import attrs

from ferry.projected import Tx, canonical_json

from . import _notify
from ._machine import (
    ACTIVE,
    EMPTY_MAILBOX,
    Flow,
    Mailbox,
    Message,
    Received,
    Shape,
    Transition,
    parse_stack,
    stack_text,
)
from ._types import Event, State

_NAMESPACE = re.compile(r"[a-z_][a-z0-9_]{0,40}")
_STATES = {s.value: s for s in State}
# The active states (`_machine.ACTIVE`) as an SQL list, in `State`'s order, written once: the
# partial indexes and the queries that use them must say it the same way.
_ACTIVE = "(" + ", ".join(f"'{s.value}'" for s in State if s in ACTIVE) + ")"

# The row's columns as `_machine.Flow` has them, in the order of `_values` and `_to_flow`.
_FIELDS = (
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
    "owner",
    "lease_until",
    "trace",
)
# What a write changes (never flow_id, plan, version, created_at, trace).
_MUTABLE = _FIELDS[4:-1]


def check_namespace(ns: str) -> str:
    """`ns` if it is a valid table prefix; else `ValueError`."""
    if not isinstance(ns, str) or not _NAMESPACE.fullmatch(ns):
        raise ValueError(f"namespace must match {_NAMESPACE.pattern}, got {ns!r}")
    return ns


def _to_flow(row: Sequence[Any]) -> Flow:
    blocked_from = row[18]
    return Flow(
        flow_id=row[0],
        plan=row[1],
        version=row[2],
        created_at=row[3],
        state=_STATES[row[4]],
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
        blocked_from=None if blocked_from is None else _STATES[blocked_from],
        owner=row[19],
        lease_until=row[20],
        trace=row[21],
    )


def _mutable_values(f: Flow) -> tuple[Any, ...]:
    return (
        f.state.value,
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
        None if f.blocked_from is None else f.blocked_from.value,
        f.owner,
        f.lease_until,
    )


# ------------------------------------------------------------------------------------- schema


def ddl(ns: str, dialect: str) -> list[str]:
    """The schema's statements, each idempotent."""
    seq = (
        "seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"
        if dialect == "postgres"
        else "seq INTEGER PRIMARY KEY"
    )
    return [
        f"""CREATE TABLE IF NOT EXISTS {ns}_flows (
            flow_id TEXT PRIMARY KEY,
            plan TEXT NOT NULL,
            version BIGINT NOT NULL,
            state TEXT NOT NULL,
            step_index BIGINT NOT NULL,
            step TEXT,
            attempt BIGINT NOT NULL,
            data TEXT NOT NULL,
            revision BIGINT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            error TEXT,
            park_deadline DOUBLE PRECISION,
            on_timeout TEXT,
            wake TEXT,
            timed_out INTEGER NOT NULL,
            stack TEXT NOT NULL,
            blocked TEXT,
            blocked_from TEXT,
            owner TEXT,
            lease_until DOUBLE PRECISION,
            start_data TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            trace TEXT)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_flows_active ON {ns}_flows (state)"
        f" WHERE state IN {_ACTIVE}",
        f"CREATE INDEX IF NOT EXISTS {ns}_flows_deadline ON {ns}_flows (park_deadline)"
        " WHERE state = 'PARKED' AND park_deadline IS NOT NULL",
        f"CREATE INDEX IF NOT EXISTS {ns}_flows_owner ON {ns}_flows (owner)"
        f" WHERE state IN {_ACTIVE}",
        # The operators' filters and their order, newest first (`_query`, docs/adr/0080).
        f"CREATE INDEX IF NOT EXISTS {ns}_flows_created ON {ns}_flows (created_at, flow_id)",
        f"CREATE INDEX IF NOT EXISTS {ns}_flows_state_created ON {ns}_flows"
        " (state, created_at, flow_id)",
        f"CREATE INDEX IF NOT EXISTS {ns}_flows_plan_created ON {ns}_flows"
        " (plan, version, created_at, flow_id)",
        # Finished flows by when they ended (a finished flow is never written again): retention
        # (`_retention`) and the dashboard's counts of finished flows.
        f"CREATE INDEX IF NOT EXISTS {ns}_flows_ended ON {ns}_flows (updated_at, state)"
        " WHERE state IN ('COMPLETED', 'FAILED')",
        *(
            [f'CREATE INDEX IF NOT EXISTS {ns}_flows_id_c ON {ns}_flows (flow_id COLLATE "C")']
            if dialect == "postgres"
            else []
        ),
        f"""CREATE TABLE IF NOT EXISTS {ns}_engines (
            owner TEXT PRIMARY KEY,
            lease_until DOUBLE PRECISION NOT NULL,
            started_at DOUBLE PRECISION NOT NULL,
            incarnation TEXT,
            host TEXT,
            pid BIGINT,
            plans TEXT)""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_plans (
            plan TEXT NOT NULL,
            version BIGINT NOT NULL,
            shape TEXT NOT NULL,
            registered_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (plan, version))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_history (
            flow_id TEXT NOT NULL,
            revision BIGINT NOT NULL,
            n INTEGER NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            kind TEXT NOT NULL,
            step TEXT,
            attempt BIGINT,
            detail TEXT,
            PRIMARY KEY (flow_id, revision, n))""",
        f"""CREATE TABLE IF NOT EXISTS {ns}_mailbox (
            {seq},
            flow_id TEXT NOT NULL,
            message_id TEXT NOT NULL,
            payload TEXT NOT NULL,
            status TEXT NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            UNIQUE (flow_id, message_id))""",
        f"CREATE INDEX IF NOT EXISTS {ns}_mailbox_queued ON {ns}_mailbox (flow_id, seq)"
        " WHERE status = 'QUEUED'",
    ]


_OBJECT = re.compile(r"IF NOT EXISTS (\w+)")

# Columns of ``ns_flows`` added after stores existed: ``ALTER TABLE`` adds them to an older
# store when an engine opens it (they are in `ddl`'s ``CREATE TABLE`` for a new one).
_ADDED_COLUMNS = (("trace", "TEXT"),)


def create_schema(tx: Tx, ns: str = "flow") -> None:
    """Create the flow tables, indexes and added columns if missing (safe to run concurrently).

    On PostgreSQL, objects that exist are found in the catalog and not touched: a ``CREATE
    INDEX IF NOT EXISTS`` would still take a share lock on its table, and an engine that opens
    while others write would deadlock with them. Missing ones are made under an advisory lock
    (concurrent ``CREATE ... IF NOT EXISTS`` can race). An index added to an existing store is
    built by the first engine that opens it (on PostgreSQL, writes to the table wait while it
    is built)."""
    statements = ddl(check_namespace(ns), tx.dialect)
    if tx.dialect != "postgres":
        for statement in statements:
            tx.execute(statement)
        _add_columns(tx, ns)
        return

    def missing() -> list[str]:
        named = [(_OBJECT.search(st), st) for st in statements]
        exists = tx.execute(
            "SELECT " + ", ".join("to_regclass(?) IS NOT NULL" for _ in named),
            [m.group(1) if m else "" for m, _st in named],
        )[0]
        return [st for (_m, st), there in zip(named, exists, strict=True) if not there]

    if missing():
        tx.execute("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(f"{ns}_flows".encode()),))
        for statement in missing():
            tx.execute(statement)
    _add_columns(tx, ns)


#: Columns of ``ns_engines`` added after its first version (an engine's incarnation, where it
#: runs, the plan versions it has); added to an older table at open.
_ENGINE_COLUMNS = (("incarnation", "TEXT"), ("host", "TEXT"), ("pid", "BIGINT"), ("plans", "TEXT"))


def _add_columns(tx: Tx, ns: str) -> None:
    """Add the columns an older ``ns_flows`` or ``ns_engines`` lacks (`_ADDED_COLUMNS`,
    `_ENGINE_COLUMNS`). Looked up first: on PostgreSQL an ``ALTER TABLE`` takes its table's
    strongest lock even when there is nothing to do."""
    pg = tx.dialect == "postgres"

    def lacking(table: str, columns: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        if pg:
            sql = "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(?)"
            rows = tx.execute(sql, (table,))
        else:
            rows = tx.execute(f"SELECT name FROM pragma_table_info('{table}')")
        have = {r[0] for r in rows}
        return [(name, kind) for name, kind in columns if name not in have]

    tables = ((f"{ns}_flows", _ADDED_COLUMNS), (f"{ns}_engines", _ENGINE_COLUMNS))

    def todo() -> list[tuple[str, str, str]]:
        return [(t, name, kind) for t, columns in tables for name, kind in lacking(t, columns)]

    if not todo():
        return
    if pg:  # concurrent openings: look again under the lock
        tx.execute("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(f"{ns}_flows".encode()),))
    for table, name, kind in todo():
        tx.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _orphan(ns: str, row: str) -> str:
    """SQL: the active flow `row` is nobody's at the time given twice as parameters: it has no
    owner, or its owner let it go (``lease_until`` earlier), or its owner's engine lease (in
    ``ns_engines``) lapsed or is unknown."""
    return (
        f"({row}.owner IS NULL OR {row}.lease_until < ? OR NOT EXISTS (SELECT 1 FROM"
        f" {ns}_engines e WHERE e.owner = {row}.owner AND e.lease_until >= ?))"
    )


@attrs.frozen
class _Sql:
    """The statements of one namespace and dialect, formatted once."""

    insert: str
    existing: str
    update: str
    update_orphan: str
    update_blind: str
    lock_engine: str
    hold_blind: str
    select: str
    select_locked: str
    hold: str
    revision: str
    seen: str
    head: str
    receive: str
    take: str
    history: str

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(ns: str, dialect: str) -> _Sql:
        flows = f"{ns}_flows"
        cols = ", ".join(_FIELDS)
        sets = ", ".join(f"{c} = ?" for c in _MUTABLE)
        marks = ", ".join("?" * (len(_FIELDS) + 1))
        pg = dialect == "postgres"
        lock = " FOR UPDATE" if pg else ""
        if pg:
            hold = f"SELECT 1 FROM {flows} WHERE flow_id = ? AND revision = ? FOR UPDATE"
        else:
            hold = (
                f"UPDATE {flows} SET revision = revision WHERE flow_id = ? AND revision = ?"
                " RETURNING 1"
            )
        blind_sets = ", ".join(
            "revision = revision + 1" if c == "revision" else f"{c} = ?" for c in _MUTABLE
        )
        if pg:
            hold_blind = f"SELECT 1 FROM {flows} WHERE flow_id = ? FOR UPDATE"
        else:
            hold_blind = f"UPDATE {flows} SET revision = revision WHERE flow_id = ? RETURNING 1"
        return _Sql(
            insert=f"INSERT INTO {flows} ({cols}, start_data) VALUES ({marks})"
            " ON CONFLICT (flow_id) DO NOTHING RETURNING flow_id",
            existing=f"SELECT {cols}, start_data FROM {flows} WHERE flow_id = ?",
            update=f"UPDATE {flows} SET {sets} WHERE flow_id = ? AND revision = ?"
            " RETURNING revision",
            update_orphan=f"UPDATE {flows} SET {sets} WHERE flow_id = ? AND revision = ?"
            f" AND {_orphan(ns, flows)} RETURNING revision",
            update_blind=f"UPDATE {flows} SET {blind_sets} WHERE flow_id = ? RETURNING revision",
            lock_engine=f"SELECT 1 FROM {ns}_engines WHERE owner = ? FOR SHARE",
            hold_blind=hold_blind,
            select=f"SELECT {cols} FROM {flows} WHERE flow_id = ?",
            select_locked=f"SELECT {cols} FROM {flows} WHERE flow_id = ?{lock}",
            hold=hold,
            revision=f"SELECT revision, owner FROM {flows} WHERE flow_id = ?",
            seen=f"SELECT 1 FROM {ns}_mailbox WHERE flow_id = ? AND message_id = ?",
            head=f"SELECT message_id, payload FROM {ns}_mailbox"
            " WHERE flow_id = ? AND status = 'QUEUED' ORDER BY seq LIMIT 1",
            receive=f"INSERT INTO {ns}_mailbox (flow_id, message_id, payload, status, at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (flow_id, message_id) DO NOTHING",
            take=f"UPDATE {ns}_mailbox SET status = 'TAKEN'"
            " WHERE flow_id = ? AND message_id = ? AND status = 'QUEUED'",
            history=f"INSERT INTO {ns}_history"
            " (flow_id, revision, n, at, kind, step, attempt, detail)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )


# ------------------------------------------------------------------------------------- writes


@attrs.frozen
class Create:
    """Insert a new flow (the `_machine.start` transition), idempotently by flow id."""

    transition: Transition


Apply: TypeAlias = Callable[[Flow, Mailbox], Transition]


@attrs.frozen
class Change:
    """Change one flow by a pure transition, ``apply(flow, mailbox) -> Transition``.

    - With `flow` (the caller's copy, e.g. the runner's): a compare-and-set on ``flow.revision``;
      the row is not read. Without it: the row is read and held (then `expected`, if given, must
      match its revision).
    - `message_id`: look it up in the mailbox (the mailbox passed to `apply` has it in ``seen``
      if it is known). `head`: pass the first queued message (a park or a resume needs it).
    - `lapsed_at` (with `flow`): the write also requires that no engine holds the flow at this
      time (`_orphan`): a takeover (`_machine.take_over`), which must lose to the owner's
      renewal of its engine lease as much as to another writer.
    - `fenced=False` is for tests only: a write from `flow` that does not compare-and-set (the
      row is overwritten whatever its revision, which becomes the stored one + 1), to show that
      the fleet's oracle catches an engine without fencing.

    The transition's row is written iff it changed (`Transition.written`), as a compare-and-set
    on the revision it started from; its mailbox writes are applied either way.
    """

    flow_id: str
    apply: Apply
    flow: Flow | None = None
    expected: int | None = None
    message_id: str | None = None
    head: bool = False
    lapsed_at: float | None = None
    fenced: bool = True


Op: TypeAlias = Create | Change


@attrs.frozen
class Created:
    """The flow was inserted."""

    transition: Transition


@attrs.frozen
class Existing:
    """A flow with this id exists: `same` if it has the same plan name and start data."""

    flow: Flow
    same: bool


@attrs.frozen
class Changed:
    """The transition ran on the held row and was recorded (if ``transition.written``);
    `before` is the row it ran on."""

    transition: Transition
    before: Flow


@attrs.frozen
class Conflict:
    """The compare-and-set failed: the flow is at another revision (or owner) than expected.

    Nothing was written for this op; the other ops of the batch are not affected."""

    flow_id: str
    expected: int | None
    revision: int | None  # what the store holds (None: no such flow any more)
    owner: str | None


@attrs.frozen
class Missing:
    """No flow has this id."""

    flow_id: str


@attrs.frozen
class Refused:
    """The op's transition raised (a bug in the caller's transition, never a race): nothing was
    written for it, and the other ops of the batch are not affected."""

    flow_id: str
    error: Exception = attrs.field(eq=False)


@attrs.frozen
class Rejected:
    """The database refused this op's row (its transaction failed with `error` while the others
    of the batch committed without it: `_apart.write_apart`). Nothing was written for it."""

    flow_id: str
    error: Exception = attrs.field(eq=False)


@attrs.frozen
class Unwritten:
    """The store became unavailable (`error`) while a batch was being split: this op was not
    written, and may be tried again."""

    flow_id: str
    error: Exception = attrs.field(eq=False)


Result: TypeAlias = (
    Created | Existing | Changed | Conflict | Missing | Refused | Rejected | Unwritten
)


class _Batch:
    """One batch's statements; history rows are collected and inserted in one go at the end."""

    __slots__ = ("history", "sql", "tx")

    def __init__(self, tx: Tx, sql: _Sql) -> None:
        self.tx = tx
        self.sql = sql
        self.history: list[tuple[Any, ...]] = []

    def record(self, t: Transition) -> None:
        fid = t.flow.flow_id
        for n, e in enumerate(t.events):
            detail = None if e.detail is None else canonical_json(e.detail)
            self.history.append((fid, e.revision, n, e.at, e.kind, e.step, e.attempt, detail))

    def messages(self, t: Transition) -> None:
        fid = t.flow.flow_id
        for w in t.messages:
            msg = w.message
            if isinstance(w, Received):
                status = "TAKEN" if w.taken else "QUEUED"
                params = (fid, msg.message_id, msg.payload, status, w.at)
                self.tx.execute(self.sql.receive, params)
            else:
                self.tx.execute(self.sql.take, (fid, msg.message_id))

    def cas(
        self,
        t: Transition,
        lapsed_at: float | None = None,
        holder: str | None = None,
    ) -> bool:
        """Write the transition's row if the stored revision is still ``t.expected`` (and no
        lease holds it at `lapsed_at`, where given: a takeover of a flow its copy shows held by
        `holder`).

        On PostgreSQL a takeover first locks `holder`'s lease row (``FOR SHARE``), so that the
        lease it reads is the one committed when it writes: a renewal of that lease in flight
        either waits for this takeover to commit, or makes it wait and refuses it. Without the
        lock, a takeover whose statement began before the renewal committed could still find
        the lease lapsed after the renewed engine had read the flow as its own (ADR 0048)."""
        values = _mutable_values(t.flow)
        fid = t.flow.flow_id
        if lapsed_at is not None:
            if holder is not None and self.tx.dialect == "postgres":
                self.tx.execute(self.sql.lock_engine, (holder,))
            rows = self.tx.execute(
                self.sql.update_orphan, (*values, fid, t.expected, lapsed_at, lapsed_at)
            )
        else:
            rows = self.tx.execute(self.sql.update, (*values, fid, t.expected))
        return bool(rows)

    def blind(self, t: Transition) -> Transition | None:
        """Tests only (``fenced=False``): overwrite the row whatever its revision; `t` with the
        revision that was stored (its events renumbered), or None if there is no such row."""
        values = [v for c, v in zip(_MUTABLE, _mutable_values(t.flow), strict=True)]
        del values[_MUTABLE.index("revision")]
        rows = self.tx.execute(self.sql.update_blind, (*values, t.flow.flow_id))
        if not rows:
            return None
        revision = rows[0][0]
        events = tuple(attrs.evolve(e, revision=revision) for e in t.events)
        return attrs.evolve(t, flow=attrs.evolve(t.flow, revision=revision), events=events)

    def conflict(self, flow_id: str, expected: int | None) -> Conflict | Missing:
        rows = self.tx.execute(self.sql.revision, (flow_id,))
        if not rows:
            return Missing(flow_id)
        return Conflict(flow_id, expected, rows[0][0], rows[0][1])

    def create(self, op: Create) -> Result:
        t = op.transition
        f = t.flow
        values = (
            f.flow_id,
            f.plan,
            f.version,
            f.created_at,
            *_mutable_values(f),
            f.trace,
            f.data,
        )
        if self.tx.execute(self.sql.insert, values):
            self.record(t)
            return Created(t)
        row = self.tx.execute(self.sql.existing, (f.flow_id,))[0]
        stored = _to_flow(row)
        return Existing(stored, stored.plan == f.plan and row[len(_FIELDS)] == f.data)

    def change(self, op: Change) -> Result:
        sql, tx = self.sql, self.tx
        known = op.flow
        if known is not None and op.message_id is None and not op.head:
            try:
                t = op.apply(known, EMPTY_MAILBOX)
            except Exception as exc:
                return Refused(op.flow_id, exc)
            if t.written:
                if not op.fenced:
                    blind = self.blind(t)
                    if blind is None:
                        return Missing(op.flow_id)
                    t = blind
                elif not self.cas(t, op.lapsed_at, known.owner):
                    return self.conflict(op.flow_id, t.expected)
                self.record(t)
            self.messages(t)
            return Changed(t, known)
        if known is not None:
            if not op.fenced:
                held = tx.execute(sql.hold_blind, (op.flow_id,))
            else:
                held = tx.execute(sql.hold, (op.flow_id, known.revision))
            if not held:
                return self.conflict(op.flow_id, known.revision)
            flow = known
        else:
            rows = tx.execute(sql.select_locked, (op.flow_id,))
            if not rows:
                return Missing(op.flow_id)
            flow = _to_flow(rows[0])
            if op.expected is not None and flow.revision != op.expected:
                return Conflict(op.flow_id, op.expected, flow.revision, flow.owner)
        queued: tuple[Message, ...] = ()
        seen: frozenset[str] = frozenset()
        if op.message_id is not None and tx.execute(sql.seen, (op.flow_id, op.message_id)):
            seen = frozenset((op.message_id,))
        if op.head:
            head = tx.execute(sql.head, (op.flow_id,))
            if head:
                queued = (Message(head[0][0], head[0][1]),)
        try:
            t = op.apply(flow, Mailbox(queued, seen) if queued or seen else EMPTY_MAILBOX)
        except Exception as exc:  # nothing was changed yet: the held row is as it was
            return Refused(op.flow_id, exc)
        if t.written:
            if not op.fenced:
                blind = self.blind(t)
                assert blind is not None  # the row is held
                t = blind
            elif not self.cas(t):  # cannot happen while the row is held; never write blind
                return self.conflict(op.flow_id, t.expected)
            self.record(t)
        self.messages(t)
        return Changed(t, flow)


# History rows go in as one multi-row INSERT per 500 (not `executemany`: psycopg pipelines
# that, and a client frozen mid-pipeline holds its locks beyond any idle-in-transaction timeout,
# which only starts once the server has answered a whole request).
_HISTORY_CHUNK = 500
_HISTORY_ROW = "(?, ?, ?, ?, ?, ?, ?, ?)"


@functools.lru_cache(maxsize=_HISTORY_CHUNK)
def _more_rows(n: int) -> str:
    """The VALUES tail of a history insert of `n` rows (its first row is in `_Sql.history`)."""
    return ", " + ", ".join([_HISTORY_ROW] * (n - 1)) if n > 1 else ""


def op_flow_id(op: Op) -> str:
    """The id of the flow `op` writes."""
    return op.flow_id if isinstance(op, Change) else op.transition.flow.flow_id


def guard_locks(tx: Tx, seconds: float | None) -> None:
    """On PostgreSQL, have the server end this transaction (and its session) if its client
    goes quiet inside it for `seconds`: a process frozen mid-transaction (SIGSTOP, a long pause)
    must not hold row locks that stall every other engine of a fleet for as long as it sleeps.
    Its locks go at once; its writes roll back; it finds its connection closed when it wakes.
    One statement; nothing on SQLite (one engine per file) or with None."""
    if seconds is not None and tx.dialect == "postgres":
        ms = max(1, int(seconds * 1000))
        tx.execute(f"SET LOCAL idle_in_transaction_session_timeout = {ms}")


def write_batch(
    tx: Tx, ops: Sequence[Op], *, ns: str = "flow", guard: float | None = None
) -> list[Result]:
    """Apply `ops` in this transaction; one result per op, in the order of `ops`. `guard`: see
    `guard_locks`.

    Ops run in flow id order (the ops of one flow in the order given), so that concurrent
    batches take row locks in one global order and cannot deadlock on PostgreSQL. Each op's
    compare-and-set is checked on its own: an op that finds another revision gets `Conflict`
    (or `Missing`) and writes nothing, and the others are applied; an op whose transition raises
    gets `Refused`. Raises only on a database error (the caller's transaction then rolls back,
    and every op fails with it). Cost: a few statements per op plus one multi-row insert for all
    history rows, and a sort of the batch.
    """
    guard_locks(tx, guard)
    batch = _Batch(tx, _Sql.of(ns, tx.dialect))
    results: list[Result | None] = [None] * len(ops)
    order = sorted(range(len(ops)), key=lambda i: op_flow_id(ops[i]))
    for i in order:
        op = ops[i]
        results[i] = batch.change(op) if isinstance(op, Change) else batch.create(op)
    rows = batch.history
    for i in range(0, len(rows), _HISTORY_CHUNK):
        chunk = rows[i : i + _HISTORY_CHUNK]
        tx.execute(batch.sql.history + _more_rows(len(chunk)), [v for r in chunk for v in r])
    _notify.announce(tx, [r.transition for r in results if isinstance(r, Changed | Created)], ns=ns)
    return results  # type: ignore[return-value]  # every slot is filled


class Undone(Exception):
    """`write_all` rolled its transaction back: one op could not be applied as asked (a
    `Refused` transition, a start whose id is taken by another flow); `results` says which."""

    def __init__(self, results: list[Result]) -> None:
        super().__init__("one op of an all-or-nothing batch was not applied: nothing was")
        self.results = results


def write_all(
    tx: Tx, ops: Sequence[Op], *, ns: str = "flow", guard: float | None = None
) -> list[Result]:
    """`write_batch`, all or nothing (one `publish`): raises `Undone` (so the transaction rolls
    back) if any op is `Refused` or is a `Create` that found another flow under its id."""
    results = write_batch(tx, ops, ns=ns, guard=guard)
    if any(isinstance(r, Refused) or (isinstance(r, Existing) and not r.same) for r in results):
        raise Undone(results)
    return results


# -------------------------------------------------------------------------------------- reads


def load(tx: Tx, flow_id: str, *, ns: str = "flow") -> Flow | None:
    """The flow's row, or None."""
    rows = tx.execute(_Sql.of(ns, tx.dialect).select, (flow_id,))
    return _to_flow(rows[0]) if rows else None


def load_history(tx: Tx, flow_id: str, *, ns: str = "flow") -> list[Event] | None:
    """Every event of the flow, in order (revision, then position); None for an unknown flow."""
    rows = tx.execute(
        f"SELECT revision, at, kind, step, attempt, detail FROM {ns}_history"
        " WHERE flow_id = ? ORDER BY revision, n",
        (flow_id,),
    )
    if not rows and load(tx, flow_id, ns=ns) is None:
        return None
    return [
        Event(
            revision=r[0],
            at=r[1],
            kind=r[2],
            step=r[3],
            attempt=r[4],
            detail=None if r[5] is None else json.loads(r[5]),
        )
        for r in rows
    ]


def load_mailbox(tx: Tx, flow_id: str, *, ns: str = "flow") -> Mailbox:
    """The flow's whole mailbox: queued messages in arrival order, every id seen."""
    rows = tx.execute(
        f"SELECT message_id, payload, status FROM {ns}_mailbox WHERE flow_id = ? ORDER BY seq",
        (flow_id,),
    )
    queued = tuple(Message(r[0], r[1]) for r in rows if r[2] == "QUEUED")
    return Mailbox(queued, frozenset(r[0] for r in rows))


def load_active(
    tx: Tx, *, ns: str = "flow", limit: int | None = None, owner: str | None = None
) -> list[Flow]:
    """Flows that are `RUNNING` or `COMPENSATING` (recovery's work list), oldest write first;
    with `owner`, only those leased to that owner."""
    cols = ", ".join(_FIELDS)
    sql = f"SELECT {cols} FROM {ns}_flows WHERE state IN {_ACTIVE}"
    params: tuple[Any, ...] = ()
    if owner is not None:
        sql += " AND owner = ?"
        params = (owner,)
    sql += " ORDER BY updated_at, flow_id"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    return [_to_flow(r) for r in tx.execute(sql, params)]


def load_deadlines(
    tx: Tx,
    *,
    ns: str = "flow",
    before: float | None = None,
    plans: Sequence[tuple[str, int]] | None = None,
) -> list[tuple[float, str, int]]:
    """``(deadline, flow_id, revision)`` of every parked flow with a deadline (at or before
    `before`, if given; of the given (plan, version)s, if `plans` is given), earliest first.
    Uses the deadline index."""
    sql = (
        f"SELECT park_deadline, flow_id, revision FROM {ns}_flows"
        " WHERE state = 'PARKED' AND park_deadline IS NOT NULL"
    )
    params: list[Any] = []
    if before is not None:
        sql += " AND park_deadline <= ?"
        params.append(before)
    if plans is not None:
        if not plans:
            return []
        sql += " AND (" + " OR ".join("(plan = ? AND version = ?)" for _ in plans) + ")"
        for name, version in plans:
            params += [name, version]
    rows = tx.execute(sql + " ORDER BY park_deadline", params)
    return [(r[0], r[1], r[2]) for r in rows]


def load_orphans(
    tx: Tx,
    now: float,
    *,
    ns: str = "flow",
    limit: int = 1000,
    plans: Sequence[tuple[str, int]] | None = None,
) -> list[Flow]:
    """At most `limit` active flows that no engine holds at `now` (`_orphan`), of the given
    (plan, version)s if `plans` is given, least recently written first. Cost: a pass over the
    active flows (the partial index), each checked against the small engines table."""
    cols = ", ".join(f"f.{c}" for c in _FIELDS)
    sql = f"SELECT {cols} FROM {ns}_flows f WHERE f.state IN {_ACTIVE} AND {_orphan(ns, 'f')}"
    params: list[Any] = [now, now]
    if plans is not None:
        if not plans:
            return []
        sql += " AND (" + " OR ".join("(f.plan = ? AND f.version = ?)" for _ in plans) + ")"
        for name, version in plans:
            params += [name, version]
    rows = tx.execute(sql + f" ORDER BY f.updated_at, f.flow_id LIMIT {int(limit)}", params)
    return [_to_flow(r) for r in rows]


def heartbeat(tx: Tx, owner: str, until: float, now: float, *, ns: str = "flow") -> None:
    """Record that engine `owner` holds its flows until `until` (its engine lease; an `until`
    in the past lets them all go at once), whatever incarnation holds the name (for tests and
    tools; an engine claims its name with `claim` and renews with `renew`/`renew_lease`). One
    row per engine, nothing else is written."""
    tx.execute(
        f"INSERT INTO {ns}_engines (owner, lease_until, started_at) VALUES (?, ?, ?)"
        " ON CONFLICT (owner) DO UPDATE SET lease_until = excluded.lease_until",
        (owner, until, now),
    )


class Superseded(Exception):
    """Another incarnation holds this engine's owner name now: the lease is no longer this
    engine's to renew (`renew`, `renew_lease`). Raised inside the transaction, which then
    writes nothing."""


@attrs.frozen
class Holder:
    """The incarnation that holds an owner name (`claim`): when its lease runs out, where it
    runs (a host identity and a process id), when it opened."""

    owner: str
    incarnation: str | None
    lease_until: float
    host: str | None
    pid: int | None
    started_at: float


def claim(
    tx: Tx,
    owner: str,
    incarnation: str,
    until: float,
    now: float,
    *,
    host: str,
    pid: int,
    plans: Sequence[tuple[str, int]],
    gone: Callable[[str | None, int | None], bool],
    ns: str = "flow",
) -> Holder | None:
    """Open a new incarnation of engine `owner`: its lease row now names `incarnation`, runs
    until `until`, and lists the plan versions it has. Refused (the holder is returned, nothing
    is written) while another incarnation's lease runs at `now`, unless ``gone(host, pid)``
    proves that one's process gone. On PostgreSQL the row is locked first, so that a claim and
    the old incarnation's renewal cannot both win; of two first claims of a new name, one
    inserts and the other is refused (``ON CONFLICT DO NOTHING``). Two statements."""
    lock = " FOR UPDATE" if tx.dialect == "postgres" else ""
    select = (
        f"SELECT owner, incarnation, lease_until, host, pid, started_at FROM {ns}_engines"
        " WHERE owner = ?"
    )
    rows = tx.execute(select + lock, (owner,))
    text = canonical_json(sorted([name, version] for name, version in plans))
    if rows:
        holder = Holder(*rows[0])
        if (
            holder.incarnation != incarnation
            and holder.lease_until >= now
            and not gone(holder.host, holder.pid)
        ):
            return holder
        tx.execute(
            f"UPDATE {ns}_engines SET lease_until = ?, started_at = ?, incarnation = ?, host = ?,"
            " pid = ?, plans = ? WHERE owner = ?",
            (until, now, incarnation, host, pid, text, owner),
        )
        return None
    inserted = tx.execute(
        f"INSERT INTO {ns}_engines (owner, lease_until, started_at, incarnation, host, pid,"
        " plans) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (owner) DO NOTHING RETURNING owner",
        (owner, until, now, incarnation, host, pid, text),
    )
    if inserted:
        return None
    return Holder(*tx.execute(select, (owner,))[0])


def renew_lease(
    tx: Tx, owner: str, incarnation: str, until: float, *, margin: float, ns: str = "flow"
) -> float | None:
    """The heartbeat thread's renewal (`_heartbeat`): extend the lease of incarnation
    `incarnation` to `until`, only while it still runs for more than `margin` seconds by the
    database's clock (a renewal after the lease may have lapsed is the engine's own, which
    re-reads its flows: `renew`). The lease now, or None if refused because it may have lapsed;
    raises `Superseded` if another incarnation holds the name. PostgreSQL only; one statement
    (two when refused)."""
    rows = tx.execute(
        f"UPDATE {ns}_engines SET lease_until = GREATEST(lease_until, ?)"
        " WHERE owner = ? AND incarnation = ?"
        " AND lease_until - ? > EXTRACT(EPOCH FROM clock_timestamp())"
        " RETURNING lease_until",
        (until, owner, incarnation, margin),
    )
    if rows:
        return float(rows[0][0])
    mine = f"SELECT 1 FROM {ns}_engines WHERE owner = ? AND incarnation = ?"
    if not tx.execute(mine, (owner, incarnation)):
        raise Superseded(owner)
    return None


def end_lease(tx: Tx, owner: str, incarnation: str, now: float, *, ns: str = "flow") -> None:
    """At close: incarnation `incarnation` of `owner` ends its lease at `now`, so that other
    engines take its flows at their next scan and a restart under the name claims it at once.
    Nothing if another incarnation holds the name by now."""
    tx.execute(
        f"UPDATE {ns}_engines SET lease_until = ? WHERE owner = ? AND incarnation = ?"
        " AND lease_until > ?",
        (now, owner, incarnation, now),
    )


def live_plans(tx: Tx, now: float, *, ns: str = "flow") -> list[Shape]:
    """The shapes of the plan versions that an engine whose lease runs at `now` has (a rolling
    deploy: an engine without a version leaves its flows to one with it). Two small reads: the
    live engines' lists, then the registered shapes."""
    have: set[tuple[str, int]] = set()
    rows = tx.execute(
        f"SELECT plans FROM {ns}_engines WHERE lease_until > ? AND plans IS NOT NULL", (now,)
    )
    for (text,) in rows:
        have.update((name, version) for name, version in json.loads(text))
    return [shape for shape, _at in load_plans(tx, ns=ns) if (shape.name, shape.version) in have]


def renew(
    tx: Tx,
    owner: str,
    until: float,
    now: float,
    *,
    let_go: Sequence[tuple[str, int]] = (),
    reread: Sequence[str] | None = None,
    incarnation: str | None = None,
    ns: str = "flow",
) -> list[Flow]:
    """An engine's renewal, in this one transaction: its lease is renewed (with `incarnation`,
    only while that incarnation holds the name, else `Superseded` is raised and nothing is
    written; without it, as `heartbeat`), the flows in `let_go` (``(flow_id, revision it let
    go at)``) are released (`release`), and the rows of the flows in `reread` are read
    (`load_many`) and returned (``[]`` without it).

    The lease row comes first: a takeover locks it (`_Batch.cas`), so on PostgreSQL a takeover
    either committed before this renewal took the row, and the rows read here show it, or it
    waits for this renewal to commit and is refused (docs/adr/0048). An engine whose lease may
    have lapsed re-reads what it runs in this transaction before it trusts it again (ADR 0047).
    Cost: one statement for the lease, one per 500 flows released or read."""
    if incarnation is None:
        heartbeat(tx, owner, until, now, ns=ns)
    elif not tx.execute(
        f"UPDATE {ns}_engines SET lease_until = ? WHERE owner = ? AND incarnation = ?"
        " RETURNING owner",
        (until, owner, incarnation),
    ):
        raise Superseded(owner)
    if let_go:
        release(tx, owner, let_go, now, ns=ns)
    return [] if reread is None else load_many(tx, reread, ns=ns)


_CHUNK = 500


def release(
    tx: Tx, owner: str, flows: Sequence[tuple[str, int]], at: float, *, ns: str = "flow"
) -> int:
    """`owner` lets go those of `flows` (``(flow_id, revision)``) it still holds at that very
    revision (no new revision): any engine may take them over from `at` on. A flow written
    since (taken over, or given back to this engine by a wake, a timer or a cancel) is left as
    it is. How many were released."""
    released = 0
    ordered = sorted(flows)
    active = f"state IN {_ACTIVE}"
    for i in range(0, len(ordered), _CHUNK):
        chunk = ordered[i : i + _CHUNK]
        if tx.dialect == "postgres":
            rows = tx.execute(
                f"UPDATE {ns}_flows f SET lease_until = ? FROM unnest(?::text[], ?::bigint[])"
                " AS l(flow_id, revision) WHERE f.flow_id = l.flow_id"
                f" AND f.revision = l.revision AND f.owner = ? AND f.{active}"
                " RETURNING f.flow_id",
                (at, [fid for fid, _r in chunk], [r for _f, r in chunk], owner),
            )
        else:
            pairs = ", ".join(["(?, ?)"] * len(chunk))
            rows = tx.execute(
                f"UPDATE {ns}_flows SET lease_until = ? WHERE (flow_id, revision) IN"
                f" (VALUES {pairs}) AND owner = ? AND {active} RETURNING flow_id",
                (at, *(v for pair in chunk for v in pair), owner),
            )
        released += len(rows)
    return released


def prune_engines(tx: Tx, before: float, *, ns: str = "flow") -> int:
    """Forget engines whose lease lapsed before `before` and that hold no active flow; how
    many."""
    rows = tx.execute(
        f"DELETE FROM {ns}_engines WHERE lease_until < ? AND NOT EXISTS (SELECT 1 FROM"
        f" {ns}_flows f WHERE f.owner = {ns}_engines.owner"
        f" AND f.state IN {_ACTIVE}) RETURNING owner",
        (before,),
    )
    return len(rows)


def load_engines(tx: Tx, *, ns: str = "flow") -> list[tuple[str, float, float, int]]:
    """``(owner, lease_until, started_at, active flows it holds)`` of every known engine."""
    rows = tx.execute(
        f"SELECT e.owner, e.lease_until, e.started_at, (SELECT COUNT(*) FROM {ns}_flows f"
        f" WHERE f.owner = e.owner AND f.state IN {_ACTIVE})"
        f" FROM {ns}_engines e ORDER BY e.owner"
    )
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def load_many(tx: Tx, flow_ids: Sequence[str], *, ns: str = "flow") -> list[Flow]:
    """The rows of those of `flow_ids` that exist (in no particular order)."""
    cols = ", ".join(_FIELDS)
    flows: list[Flow] = []
    for i in range(0, len(flow_ids), _CHUNK):
        chunk = list(flow_ids[i : i + _CHUNK])
        if tx.dialect == "postgres":
            rows = tx.execute(f"SELECT {cols} FROM {ns}_flows WHERE flow_id = ANY(?)", (chunk,))
        else:
            marks = ", ".join("?" * len(chunk))
            rows = tx.execute(f"SELECT {cols} FROM {ns}_flows WHERE flow_id IN ({marks})", chunk)
        flows.extend(_to_flow(r) for r in rows)
    return flows


# ------------------------------------------------------------------------------------- plans


def _shape_json(shape: Shape) -> str:
    return canonical_json(
        {
            "steps": list(shape.steps),
            "compensable": list(shape.compensable),
            "attempts": list(shape.attempts),
        }
    )


def register_plans(tx: Tx, shapes: Sequence[Shape], now: float, *, ns: str = "flow") -> None:
    """Record what each plan version looks like (its `Shape`), so that a process without the
    plans (an operator's tool) can still ask the machine for transitions. A registration of a
    known (name, version) replaces it: the last engine opened wins; engines still check their
    own plan before they run anything (versions fail closed)."""
    for shape in shapes:
        tx.execute(
            f"INSERT INTO {ns}_plans (plan, version, shape, registered_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (plan, version) DO UPDATE SET shape = excluded.shape,"
            " registered_at = excluded.registered_at",
            (shape.name, shape.version, _shape_json(shape), now),
        )


def load_plans(tx: Tx, *, ns: str = "flow") -> list[tuple[Shape, float]]:
    """Every registered plan version, with when it was last registered, by name and version."""
    rows = tx.execute(
        f"SELECT plan, version, shape, registered_at FROM {ns}_plans ORDER BY plan, version"
    )
    plans = []
    for name, version, text, at in rows:
        d = json.loads(text)
        shape = Shape(
            name, version, tuple(d["steps"]), tuple(d["compensable"]), tuple(d["attempts"])
        )
        plans.append((shape, at))
    return plans


def count_parked(tx: Tx, *, ns: str = "flow") -> int:
    """How many flows are parked (a fleet engine's `parked`, read at every scan)."""
    return int(tx.execute(f"SELECT COUNT(*) FROM {ns}_flows WHERE state = 'PARKED'")[0][0])


def count_states(tx: Tx, *, ns: str = "flow") -> dict[State, int]:
    """How many flows are in each state."""
    rows = tx.execute(f"SELECT state, COUNT(*) FROM {ns}_flows GROUP BY state")
    return {_STATES[r[0]]: r[1] for r in rows}


# ------------------------------------------------------------------------ reads for operators


def has_tables(tx: Tx, *, ns: str = "flow") -> bool:
    """Does the store hold the flow tables (has an engine ever opened it)?"""
    if tx.dialect == "postgres":
        rows = tx.execute("SELECT to_regclass(?) IS NOT NULL", (f"{ns}_flows",))
        return bool(rows[0][0])
    rows = tx.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (f"{ns}_flows",)
    )
    return bool(rows)


def count_plans(tx: Tx, *, ns: str = "flow") -> list[tuple[str, int, State, int]]:
    """``(plan, version, state, flows)`` for every plan version and state that has flows."""
    rows = tx.execute(
        f"SELECT plan, version, state, COUNT(*) FROM {ns}_flows"
        " GROUP BY plan, version, state ORDER BY plan, version, state"
    )
    return [(r[0], r[1], _STATES[r[2]], r[3]) for r in rows]


def oldest_parked(tx: Tx, *, ns: str = "flow", limit: int = 10) -> list[Flow]:
    """The parked flows that have waited longest (since their last write), at most `limit`."""
    cols = ", ".join(_FIELDS)
    rows = tx.execute(
        f"SELECT {cols} FROM {ns}_flows WHERE state = 'PARKED'"
        f" ORDER BY updated_at, flow_id LIMIT {int(limit)}"
    )
    return [_to_flow(r) for r in rows]


def blocked_reasons(tx: Tx, *, ns: str = "flow", limit: int = 20) -> list[tuple[str, int, str]]:
    """``(reason, flows, one of them)`` of blocked flows, the most common reason first."""
    rows = tx.execute(
        f"SELECT blocked, COUNT(*), MIN(flow_id) FROM {ns}_flows WHERE state = 'BLOCKED'"
        f" GROUP BY blocked ORDER BY COUNT(*) DESC, blocked LIMIT {int(limit)}"
    )
    return [(r[0], r[1], r[2]) for r in rows]


def leased(tx: Tx) -> bool:
    """Are the store's active flows held by leases (a fleet, PostgreSQL)? On SQLite one engine
    at a time holds the whole file (its engine lock) and runs every active flow: no lease rows,
    so no flow there is ever an orphan (`count_orphans`, `orphaned`)."""
    return tx.dialect == "postgres"


def count_orphans(tx: Tx, now: float, *, ns: str = "flow") -> int:
    """How many active flows no engine holds at `now` (`_orphan`): engines of a fleet take them
    over at their next scan. 0 on a store without leases (`leased`)."""
    if not leased(tx):
        return 0
    rows = tx.execute(
        f"SELECT COUNT(*) FROM {ns}_flows f WHERE f.state IN {_ACTIVE} AND {_orphan(ns, 'f')}",
        (now, now),
    )
    return int(rows[0][0])


def holder(tx: Tx, flow_id: str, now: float, *, ns: str = "flow") -> tuple[float, bool] | None:
    """Who holds the active flow `flow_id` at `now`, by the rule `count_orphans` counts with
    (`_orphan`): ``(until, orphaned)`` where `until` is when its hold ends (the earlier of the
    flow's own ``lease_until`` and its owner's engine lease; -inf if it has neither). None if the
    flow is not active or has no owner, or on a store without leases (`leased`)."""
    if not leased(tx):
        return None
    rows = tx.execute(
        f"SELECT f.lease_until, e.lease_until, {_orphan(ns, 'f')} FROM {ns}_flows f"
        f" LEFT JOIN {ns}_engines e ON e.owner = f.owner WHERE f.flow_id = ?"
        f" AND f.owner IS NOT NULL AND f.state IN {_ACTIVE}",
        (now, now, flow_id),
    )
    if not rows:
        return None
    own, engine, orphaned = rows[0]
    until = min(math.inf if own is None else own, -math.inf if engine is None else engine)
    return until, bool(orphaned)
