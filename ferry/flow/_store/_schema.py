"""The flow store's schema: its tables (`ddl`), made or brought up to date by `create_schema`.

Tables:

- ``flow_flows``: one row per flow (`_machine.Flow`'s fields, plus ``start_data``). ``revision``
  is the compare-and-set token of every write; ``owner`` (the engine that runs an active flow)
  and ``lease_until`` (when it let it go) are for a fleet. ``trace`` is the W3C trace context
  the flow's spans join (`_tracing`). Partial indexes: the active flows (``RUNNING``/
  ``COMPENSATING``, `_machine.ACTIVE`, for recovery), the parked flows by deadline (for timers)
  and the finished flows by their last write (for retention, `_retention`, and the dashboard);
  the operators' filters and their order (`_query`).
- ``flow_history(flow_id, revision, n, at, kind, step, attempt, detail)``: every durable
  transition, primary key ``(flow_id, revision, n)``.
- ``flow_mailbox(seq, flow_id, message_id, payload, status, at)``: one row per accepted message,
  unique ``(flow_id, message_id)`` (the `DUPLICATE` check); ``status`` is ``QUEUED`` (kept for
  the next park) or ``TAKEN``; a partial index on the queued ones, in arrival (``seq``) order.
- ``flow_engines(owner, lease_until, started_at, ...)``: a fleet's engines and their leases (one
  row per engine, its heartbeat); an active flow is held while the engine its ``owner`` names
  holds its lease (`_sql.orphan`, docs/adr/0040). A partial index on the active flows' owner.
- ``flow_requests(request_id, kind, body, at, answer, answered_at, answered_by)``: what a
  client of another process asked the serving engine to do, and its answer (`_inbox`,
  docs/adr/0125); a partial index on the ones not answered yet.
- ``flow_spawns``, ``flow_children``: the spawns of child flows and their children (ADR 0139,
  `_family`); the flows table's ``parent`` (a child's), ``deadline`` (a whole flow's) and
  ``fan_in`` (the spawn whose results the current step reads, docs/adr/0148).
- ``flow_budgets``, ``flow_keys``, ``flow_admissions``: flow control's budget rows, key rows
  and rate windows (`_admission`, docs/adr/0141, 0147); the flows table's queue columns
  (``queue_key, priority, turn, seq, not_before, due``) and their partial indexes.
- ``flow_plans(plan, version, shape, registered_at)``: the shape of every plan version an engine
  registered, for processes without the plans (an operator's engine, docs/adr/0044).
- ``flow_events``, ``flow_stream``: the events and streams out of running flows (`_signals`,
  SPEC 5.10).
- ``flow_schedules``: one row per schedule (`_schedules`, docs/adr/0144), a partial index on
  the next tick of those not paused.
"""

from __future__ import annotations

import re
import zlib
from typing import Final

from ferry.projected import Tx

from . import _admission, _dialect, _inbox, _signals
from ._sql import ENGINES, FLOWS, HISTORY, IN_ACTIVE, IN_FINISHED, MAILBOX, PLANS

SPAWNS = "flow_spawns"
CHILDREN = "flow_children"

# ------------------------------------------------------------------------------------- schema


def _in_byte_order(d: _dialect.Dialect) -> list[str]:
    """The index of the flow ids in byte order, where the collation may not be one (`_query`'s
    id prefixes)."""
    if not d.bytewise:
        return []
    return [f"CREATE INDEX IF NOT EXISTS {FLOWS}_id_c ON {FLOWS} (flow_id{d.bytewise})"]


def ddl(dialect: str) -> list[str]:
    """The schema's statements, each idempotent."""
    d = _dialect.DIALECTS[dialect]
    return [
        f"""CREATE TABLE IF NOT EXISTS {FLOWS} (
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
            fan_in BIGINT, parent TEXT, deadline DOUBLE PRECISION,
            queue_key TEXT, priority BIGINT, turn BIGINT, seq BIGINT, not_before DOUBLE PRECISION,
            due INTEGER,
            trace TEXT)""",
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_active ON {FLOWS} (state) WHERE state {IN_ACTIVE}",
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_deadline ON {FLOWS} (park_deadline)"
        " WHERE state = 'PARKED' AND park_deadline IS NOT NULL",
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_owner ON {FLOWS} (owner) WHERE state {IN_ACTIVE}",
        # The operators' filters and their order, newest first (`_query`, docs/adr/0080).
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_created ON {FLOWS} (created_at, flow_id)",
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_state_created ON {FLOWS} (state, created_at, flow_id)",
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_plan_created ON {FLOWS}"
        " (plan, version, created_at, flow_id)",
        # Finished flows by when they ended (never written again): retention, the dashboard.
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_ended ON {FLOWS} (updated_at, state)"
        f" WHERE state {IN_FINISHED}",
        *_in_byte_order(d),
        f"""CREATE TABLE IF NOT EXISTS {ENGINES} (
            owner TEXT PRIMARY KEY,
            lease_until DOUBLE PRECISION NOT NULL,
            started_at DOUBLE PRECISION NOT NULL,
            incarnation TEXT,
            host TEXT, pid BIGINT,
            plans TEXT)""",
        f"""CREATE TABLE IF NOT EXISTS {PLANS} (
            plan TEXT NOT NULL,
            version BIGINT NOT NULL,
            shape TEXT NOT NULL,
            registered_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (plan, version))""",
        f"""CREATE TABLE IF NOT EXISTS {HISTORY} (
            flow_id TEXT NOT NULL,
            revision BIGINT NOT NULL,
            n INTEGER NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            kind TEXT NOT NULL,
            step TEXT,
            attempt BIGINT,
            detail TEXT,
            PRIMARY KEY (flow_id, revision, n))""",
        f"""CREATE TABLE IF NOT EXISTS {MAILBOX} (
            {d.seq_column},
            flow_id TEXT NOT NULL,
            message_id TEXT NOT NULL,
            payload TEXT NOT NULL,
            status TEXT NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            UNIQUE (flow_id, message_id))""",
        f"CREATE INDEX IF NOT EXISTS {MAILBOX}_queued ON {MAILBOX} (flow_id, seq)"
        " WHERE status = 'QUEUED'",
        *_later_tables(d),
    ]


def _later_tables(d: _dialect.Dialect) -> list[str]:
    """The tables of the parts added since: the inbox, schedules, child flows, flow control,
    events and streams."""
    return [*_inbox.DDL, *schedules_ddl(), *family_ddl(), *_admission.ddl(), *_signals.ddl(d)]


SCHEDULES: Final = "flow_schedules"
#: The partial index of the next tick of the schedules not paused (the timer's one read).
DUE_INDEX: Final = f"{SCHEDULES}_due"


def schedules_ddl() -> list[str]:
    """The schedules' table and its index (`_schedules`, docs/adr/0144), each idempotent, the
    same in both dialects (partial indexes and DOUBLE PRECISION are in both)."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {SCHEDULES} (
            name TEXT PRIMARY KEY,
            definition TEXT NOT NULL,
            plan TEXT NOT NULL,
            version BIGINT NOT NULL,
            revision BIGINT NOT NULL,
            next_tick DOUBLE PRECISION,
            last_tick DOUBLE PRECISION,
            last_flow TEXT,
            waiting_tick DOUBLE PRECISION,
            paused INTEGER NOT NULL,
            missed BIGINT NOT NULL,
            skipped BIGINT NOT NULL,
            declared_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {DUE_INDEX} ON {SCHEDULES} (next_tick) WHERE paused = 0",
    ]


def family_ddl() -> list[str]:
    """The tables and indexes of child flows (ADR 0139, `_family`), each idempotent; the same
    text on both dialects."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {SPAWNS} (
            parent TEXT NOT NULL,
            step_index BIGINT NOT NULL,
            total BIGINT NOT NULL,
            max_running BIGINT,
            on_failure TEXT NOT NULL,
            active BIGINT NOT NULL,
            next_kept BIGINT NOT NULL,
            ended BIGINT NOT NULL,
            phase TEXT NOT NULL,
            stop_then TEXT,
            reason TEXT,
            undoing BIGINT,
            PRIMARY KEY (parent, step_index))""",
        f"""CREATE TABLE IF NOT EXISTS {CHILDREN} (
            parent TEXT NOT NULL,
            step_index BIGINT NOT NULL,
            idx BIGINT NOT NULL,
            child_key TEXT NOT NULL,
            flow_id TEXT NOT NULL UNIQUE,
            plan TEXT NOT NULL,
            version BIGINT NOT NULL,
            status TEXT NOT NULL,
            data TEXT NOT NULL,
            error TEXT,
            ended BIGINT NOT NULL,
            stack TEXT NOT NULL,
            undone INTEGER NOT NULL,
            PRIMARY KEY (parent, step_index, idx))""",
        f"CREATE INDEX IF NOT EXISTS {CHILDREN}_active ON {CHILDREN} (parent, step_index)"
        " WHERE status = 'active'",
        f"CREATE INDEX IF NOT EXISTS {CHILDREN}_undo ON {CHILDREN} (parent, step_index, ended)"
        " WHERE status = 'completed' AND undone = 0",
        # The failed ones, counted by the last end of a spawn (`_family.failed`): O(failures).
        f"CREATE INDEX IF NOT EXISTS {CHILDREN}_failed ON {CHILDREN} (parent, step_index)"
        " WHERE status = 'failed'",
        f"CREATE INDEX IF NOT EXISTS {SPAWNS}_stopping ON {SPAWNS} (parent)"
        " WHERE phase = 'stopping'",
    ]


#: Indexes on added columns (`_ADDED_COLUMNS`): made after those are added to an older store.
_LATE = (
    f"CREATE INDEX IF NOT EXISTS {FLOWS}_parent ON {FLOWS} (parent) WHERE parent IS NOT NULL",
    f"CREATE INDEX IF NOT EXISTS {FLOWS}_whole ON {FLOWS} (deadline) WHERE deadline IS NOT NULL"
    f" AND state NOT {IN_FINISHED}",
    *_admission.flow_indexes(),
)


_OBJECT = re.compile(r"IF NOT EXISTS (\w+)")
_SCHEMA_LOCK_KEY = zlib.crc32(FLOWS.encode())

# Columns added after stores existed: an engine that opens an older store adds them with
# ``ALTER TABLE`` (they are in `ddl`'s ``CREATE TABLE`` for a new one). The flows' trace
# context; an engine's incarnation, where it runs, the plan versions it has.
_ADDED_COLUMNS = (
    (FLOWS, "trace", "TEXT"),
    (ENGINES, "incarnation", "TEXT"),
    (ENGINES, "host", "TEXT"),
    (ENGINES, "pid", "BIGINT"),
    (ENGINES, "plans", "TEXT"),
    (FLOWS, "fan_in", "BIGINT"),
    (FLOWS, "parent", "TEXT"),
    (FLOWS, "deadline", "DOUBLE PRECISION"),
    *((FLOWS, name, kind) for name, kind in _admission.FLOW_COLUMNS),
)


def create_schema(tx: Tx) -> None:
    """Create the flow tables, indexes and added columns if missing (safe to run concurrently).

    Objects that exist are found in the catalog and not touched: on PostgreSQL a ``CREATE
    INDEX IF NOT EXISTS`` would still take a share lock on its table, and an engine that opens
    while others write would deadlock with them; an ``ALTER TABLE`` takes its table's strongest
    lock even when there is nothing to do. Missing ones are made under the dialect's schema lock
    (PostgreSQL: an advisory lock, concurrent ``CREATE ... IF NOT EXISTS`` can race), looked up
    again under it. An index added to an existing store is built by the first engine that opens
    it (on PostgreSQL, writes to the table wait while it is built)."""
    d = _dialect.of(tx)
    statements = ddl(tx.dialect)

    def missing() -> list[str]:
        todo = []
        for statement in statements:
            m = _OBJECT.search(statement)
            assert m is not None
            if not tx.execute(d.table_exists, (m.group(1),))[0][0]:
                todo.append(statement)
        return todo

    def lacking() -> list[tuple[str, str, str]]:
        have: dict[str, set[str]] = {}
        for table, _name, _kind in _ADDED_COLUMNS:
            if table not in have:
                have[table] = {r[0] for r in tx.execute(d.columns_of, (table,))}
        return [(t, name, kind) for t, name, kind in _ADDED_COLUMNS if name not in have[t]]

    if d.schema_lock is None:
        for statement in statements:
            tx.execute(statement)
    elif missing() or lacking():
        tx.execute(d.schema_lock, (_SCHEMA_LOCK_KEY,))
        for statement in missing():
            tx.execute(statement)
    for table, name, kind in lacking():
        tx.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    statements = list(_LATE)
    late = statements if d.schema_lock is None else missing()
    if late and d.schema_lock is not None:
        tx.execute(d.schema_lock, (_SCHEMA_LOCK_KEY,))
        late = missing()
    for statement in late:
        tx.execute(statement)


def has_tables(tx: Tx) -> bool:
    """Does the store hold the flow tables (has an engine ever opened it)?"""
    d = _dialect.of(tx)
    return bool(tx.execute(d.table_exists, (FLOWS,))[0][0])
