"""What the dashboard's pages show, read from the store without getting in the engines' way.

`Reader.read(fn)` runs ``fn(tx)`` in one read-only transaction. On SQLite that is a connection
of its own opened read-only (``mode=ro``) in a worker thread: a reader of a WAL database never
blocks the engine's writer and never takes the write lock (an `SqliteStore` transaction begins
``IMMEDIATE``, which would queue behind the engine and make it queue behind the page). On
PostgreSQL it is a ``READ ONLY`` transaction of a small `PostgresStore` with a statement
timeout. Either way a read that cannot finish in `timeout` seconds raises `Unavailable`, as does
any database error: the page then says the database is unavailable and retries by itself.

The ``page_*`` functions are synchronous and take a `Tx` (they are what runs in the
transaction); they return plain records for the templates.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import TypeVar

import attrs
import trio

from ferry.projected import PostgresStore, Tx

from ..._model import _values
from ..._model._types import Event, State
from ..._model._values import ACTIVE, Flow
from ..._store import (
    _dialect,
    _inbox,
    _lineage,
    _query,
    _queue_view,
    _schema,
    _signals,
    _sql,
    _store,
)
from ..._store._sqlite_file import ReadOnlyTx

T = TypeVar("T")
_log = logging.getLogger("ferry.flow")


class Unavailable(Exception):
    """The store could not be read (down, locked, too slow, or holds no flow tables yet)."""


class Reader:
    """Read-only transactions on the store named by `path` (SQLite) or `store` (PostgreSQL)."""

    def __init__(
        self,
        *,
        path: str | None = None,
        store: PostgresStore | None = None,
        timeout: float = 5.0,
    ) -> None:
        assert (path is None) != (store is None)
        self._uri = (
            None if path is None else f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
        )
        self._store = store
        self.timeout = timeout

    @property
    def dialect(self) -> str:
        return "sqlite" if self._store is None else "postgres"

    async def read(self, fn: Callable[[Tx], T]) -> T:
        """``fn(tx)`` in one read-only transaction; a checkpoint. Raises `Unavailable` if the
        store cannot be read within `timeout` (or has no flow tables), and what `fn` raises
        (`ValueError` for a bad cursor)."""

        def checked(tx: Tx) -> T:
            if not _schema.has_tables(tx):
                raise Unavailable("no flow engine has opened this store yet (no flow tables)")
            return fn(tx)

        try:
            with trio.fail_after(self.timeout):
                if self._store is not None:
                    return await self._store.transact(partial_pg(checked, self.timeout))
                return await self._read_sqlite(checked)
        except (Unavailable, ValueError):
            raise
        except trio.TooSlowError:
            why = f"no answer within {self.timeout:g} s"
        except Exception as exc:  # a database error: down, locked, a file gone
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        _log.warning("dashboard: the store is unavailable (%s); the page retries by itself", why)
        raise Unavailable(why)

    async def _read_sqlite(self, fn: Callable[[Tx], T]) -> T:
        """`fn` on a read-only connection in a worker thread. Cancelled (the time limit), the
        statement in progress is interrupted and the thread left to close its connection."""
        assert self._uri is not None
        uri, timeout = self._uri, self.timeout
        opened: list[sqlite3.Connection] = []
        gone = threading.Event()

        def work() -> T:  # worker thread
            conn = sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None)
            opened.append(conn)
            try:
                if gone.is_set():
                    raise trio.TooSlowError  # abandoned before it began
                conn.execute("BEGIN")  # one snapshot for the whole page
                return fn(ReadOnlyTx(conn))
            finally:
                conn.close()

        try:
            return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        except trio.Cancelled:
            gone.set()
            for conn in opened:
                conn.interrupt()  # thread-safe; the thread's statement raises and it closes
            raise


def partial_pg(fn: Callable[[Tx], T], timeout: float) -> Callable[[Tx], T]:
    """`fn` in a read-only PostgreSQL transaction whose statements give up after `timeout`."""

    def run(tx: Tx) -> T:
        tx.execute("SET TRANSACTION READ ONLY")
        tx.execute(f"SET LOCAL statement_timeout = {max(1, int(timeout * 1000))}")
        return fn(tx)

    return run


# ------------------------------------------------------------------------------------ pages


@attrs.frozen
class Series:
    """Flows started, completed and failed in each bucket of `step` seconds over the chart's
    span (oldest first; the last bucket holds now); `plan` the plan they are of (None: all)."""

    start: float  # the first bucket's start
    started: tuple[int, ...]
    completed: tuple[int, ...]
    failed: tuple[int, ...]
    step: float = 60.0
    span: str = "1h"
    plan: str | None = None


#: The chart's spans: (buckets, seconds a bucket).
SPANS = {"1h": (60, 60), "24h": (96, 900), "7d": (84, 7200)}


@attrs.frozen
class Overview:
    states: dict[str, int]
    total: int
    plans: list[tuple[str, int, dict[str, int]]]  # (plan, version, unfinished by state)
    deadlines: list[Flow]  # parked flows with a deadline, soonest first
    parked_forever: int  # parked flows without a deadline
    engines: list[tuple[str, float, float, int]]
    series: Series
    now: float
    beats: dict[str, str] = attrs.Factory(dict)  # owner -> "pid@host" (its heartbeat row)
    queues: list[_queue_view.PlanQueue] = attrs.Factory(list)  # limited plans' limits, usage

    @property
    def serving(self) -> bool:
        """Does an engine serve the store now (a lease or heartbeat that runs)?"""
        return any(until >= self.now for _o, until, _at, _n in self.engines)


MINUTES = 60


def _indexed_by(tx: Tx, index: str) -> str:
    """SQLite: use this index (its planner, with or without ``ANALYZE``, may prefer a range
    over the state index that reads every finished flow); PostgreSQL chooses well by itself.
    Nothing if the index is missing (a store no engine of this version has opened yet)."""
    d = _dialect.of(tx)
    if d.index_exists is None:
        return ""
    return d.indexed_by.format(index) if tx.execute(d.index_exists, (index,)) else ""


#: The states whose flows are counted per plan (the finished are counted only by state: there
#: are usually many of them, and counting them per plan reads every row).
UNFINISHED = ("QUEUED", "RUNNING", "PARKED", "COMPENSATING", "BLOCKED")


def count_unfinished_plans(tx: Tx) -> list[tuple[str, int, str, int]]:
    """``(plan, version, state, flows)`` of the unfinished flows. Cost: the state index's range
    of each unfinished state, and a row read per unfinished flow."""
    marks = ", ".join(f"'{s}'" for s in UNFINISHED)
    rows = tx.execute(
        f"SELECT plan, version, state, COUNT(*) FROM {_sql.FLOWS}"
        f"{_indexed_by(tx, 'flow_flows_state_created')} WHERE state IN ({marks})"
        " GROUP BY plan, version, state ORDER BY plan, version, state"
    )
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def count_by_state(tx: Tx) -> dict[str, int]:
    """Flows in each state (every state, 0 if none). Cost: one pass over the state index."""
    counts = dict.fromkeys((s.name for s in State), 0)
    for state, n in tx.execute(f"SELECT state, COUNT(*) FROM {_sql.FLOWS} GROUP BY state"):
        counts[state] = n
    return counts


def page_overview(
    tx: Tx, *, now: float, deadlines: int = 15, span: str = "1h", plan: str | None = None
) -> Overview:
    """Counts by state, the unfinished flows by plan version, the parked flows by deadline, the
    engines, and the per-minute series. Cost: a pass over the state index (the counts), a row
    per unfinished flow, and index ranges for the rest (about a second at a million flows)."""
    states = count_by_state(tx)
    plans: dict[tuple[str, int], dict[str, int]] = {}
    for name, version, state, n in count_unfinished_plans(tx):
        plans.setdefault((name, version), dict.fromkeys(UNFINISHED, 0))[state] = n
    cols = ", ".join(_sql.FIELDS)
    soon = [
        _sql.to_flow(r)
        for r in tx.execute(
            f"SELECT {cols} FROM {_sql.FLOWS} WHERE state = 'PARKED'"
            f" AND park_deadline IS NOT NULL ORDER BY park_deadline LIMIT {int(deadlines)}"
        )
    ]
    with_deadline = tx.execute(
        f"SELECT COUNT(*) FROM {_sql.FLOWS} WHERE state = 'PARKED' AND park_deadline IS NOT NULL"
    )[0][0]
    return Overview(
        states=states,
        total=sum(states.values()),
        plans=[(p, v, c) for (p, v), c in sorted(plans.items())],
        deadlines=soon,
        parked_forever=states["PARKED"] - int(with_deadline),
        engines=_store.load_engines(tx),
        series=_series(tx, now, span, plan),
        now=now,
        beats={
            b["owner"]: f"{b['pid']}@{b['host']}"
            for b in _inbox.heartbeats(tx)
            if b["pid"] is not None
        },
        queues=_queue_view.plan_queues(tx, now),
    )


def _series(tx: Tx, now: float, span: str = "1h", plan: str | None = None) -> Series:
    """The chart's buckets over `span` (a key of `SPANS`), of the flows of `plan` (None: all).
    Cost: the index ranges of the flows started and ended in the span (a row read per flow
    with a plan given)."""
    buckets, step = SPANS[span]
    start = (math.floor(now / step) - (buckets - 1)) * float(step)
    started = [0] * buckets
    completed = [0] * buckets
    failed = [0] * buckets
    # The bucket since `start` (t >= start): SQLite's CAST truncates, PostgreSQL's rounds.
    bucket = _dialect.of(tx).whole_part.format(f"(t - ?) / {int(step)}")
    only, more = ("", ()) if plan is None else (" AND plan = ?", (plan,))
    rows = tx.execute(
        f"SELECT {bucket.replace('t', 'created_at')}, COUNT(*) FROM {_sql.FLOWS}"
        f" WHERE created_at >= ?{only} GROUP BY 1",
        (start, start, *more),
    )
    for b, n in rows:
        if 0 <= b < buckets:
            started[b] = n
    rows = tx.execute(
        f"SELECT state, {bucket.replace('t', 'updated_at')}, COUNT(*) FROM {_sql.FLOWS}"
        f"{_indexed_by(tx, 'flow_flows_ended')}"
        f" WHERE state {_sql.IN_FINISHED} AND updated_at >= ?{only} GROUP BY 1, 2",
        (start, start, *more),
    )
    for state, b, n in rows:
        if 0 <= b < buckets:
            (completed if state == "COMPLETED" else failed)[b] = n
    return Series(start, tuple(started), tuple(completed), tuple(failed), float(step), span, plan)


@attrs.frozen
class Message:
    message_id: str
    payload: str  # pretty JSON
    status: str
    at: float


@attrs.frozen
class FlowPage:
    flow: Flow
    data: str  # pretty JSON
    error: str | None
    history: list[Event]
    mailbox: list[Message]
    held: tuple[str, float | None, bool] | None  # (engine, until, lapsed) of an active flow
    created_at: float
    events: int  # in its whole history (`history` holds the last `HISTORY` of them)
    family: _lineage.Family | None = None  # its parent, its spawns and their children
    waits: _queue_view.Waits | None = None  # a queued flow's reason to wait (SPEC 5.8)
    # Its events (key, pretty JSON), its stream's length and last values (SPEC 5.10).
    signals: list[tuple[str, str]] = attrs.field(factory=list)
    stream_length: int = 0
    stream_last: list[tuple[int, str]] = attrs.field(factory=list)


#: The most history events a flow's page shows (the latest).
HISTORY = 500


def pretty(text: str) -> str:
    """JSON text indented for reading (as it is, if it is not JSON)."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=True)
    except ValueError:
        return text


def page_flow(tx: Tx, flow_id: str) -> FlowPage | None:
    """One flow with its history, mailbox, holder and family (`_lineage.family_of`: its
    parent, its spawns and their first children); None if there is no such flow."""
    f = _store.load(tx, flow_id)
    if f is None:
        return None
    history = _store.load_history(tx, flow_id) or []
    events = len(history)
    history = history[-HISTORY:]
    rows = tx.execute(
        f"SELECT message_id, payload, status, at FROM {_sql.MAILBOX}"
        " WHERE flow_id = ? ORDER BY seq",
        (flow_id,),
    )
    created = tx.execute(f"SELECT created_at FROM {_sql.FLOWS} WHERE flow_id = ?", (flow_id,))
    held = None
    if f.owner is not None and f.state in ACTIVE:
        until = f.released_at
        if until is None:
            lease = tx.execute(
                f"SELECT lease_until FROM {_sql.ENGINES} WHERE owner = ?", (f.owner,)
            )
            until = lease[0][0] if lease else None
        now = _store.lease_clock(tx, time.time())  # the database's: docs/adr/0110
        held = (f.owner, until, until is None or until < now)
    snap = _values.snapshot(f)
    signals, length, last = _signals.shown(tx, flow_id)
    return FlowPage(
        flow=f,
        data=json.dumps(snap.data, indent=2, ensure_ascii=False, sort_keys=True),
        error=snap.error,
        history=history,
        mailbox=[Message(r[0], pretty(r[1]), r[2], r[3]) for r in rows],
        held=held,
        created_at=created[0][0] if created else f.updated_at,
        events=events,
        family=_lineage.family_of(tx, f),
        waits=_queue_view.waiting(tx, f, time.time()),
        signals=[(k, pretty(v)) for k, v in signals.items()],
        stream_length=length,
        stream_last=last,  # as stored: compact JSON text, one line a value
    )


#: The most matches the flows list counts: past it, it says "10,000+" (a count is a pass over
#: the matching index entries; bounded, it costs what a page or two does).
COUNT_CAP = 10_000


@attrs.frozen
class FlowsPage:
    """One page of the flows list: the flows with their start times, the cursors of the pages
    after and before it (None: none), and how many flows match, counted up to ``cap + 1``."""

    flows: tuple[Flow, ...]
    created: tuple[float, ...]
    next: str | None
    prev: str | None
    matches: int
    cap: int

    @property
    def more(self) -> bool:
        """Do more than `cap` flows match (then the page says "cap+")?"""
        return self.matches > self.cap


def page_flows(
    tx: Tx,
    flt: _query.FlowFilter,
    *,
    after: str | None,
    limit: int,
    before: str | None = None,
    cap: int = COUNT_CAP,
) -> FlowsPage:
    """One page of the flows list (`_query.query_page`, or `_query.query_page_before` for the
    page `before` a cursor) and the bounded count of the matches."""
    prev: str | None
    if before is not None:
        page, prev = _query.query_page_before(tx, flt, limit=limit, before=before)
    else:
        page = _query.query_page(tx, flt, limit=limit, after=after)
        prev = None
        if after is not None and page.flows:  # the flow of `after` comes before this page
            prev = _query.cursor_of(page.flows[0], page.created[0], flt.by_id)
    matches = _query.count_upto(tx, flt, cap)
    return FlowsPage(page.flows, page.created, page.next, prev, matches, cap)
