"""The flow store's reads, the plans it holds and the engines' leases.

Everything here is synchronous and runs inside one store transaction on a worker thread (a
`ferry.projected.Tx` of the same `SqliteStore`/`PostgresStore` that `ProjectedWrite` uses): no
trio, and no host's clock: times come in as arguments, and the one clock read here is the
database's, for leases (`lease_clock`, docs/adr/0110). Every statement is built once per
dialect in `_sql`, which also holds, in one `Dialect` record each, everything SQLite and
PostgreSQL say differently. Decisions are not taken here: a write runs a pure transition of
`_machine` on the row it holds, and records what the transition says (docs/adr/0021).

The tables are `_schema`'s; the batched compare-and-set write is `_batch`'s.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ferry._text import canonical_json
from ferry.projected import Tx

from .._model import _limits
from .._model._types import Event, Json, State
from .._model._values import Flow, Mailbox, Message, Shape
from . import _dialect, _sql
from ._sql import ENGINES, FLOWS, IN_ACTIVE, STATES, to_flow

#: A limit that is none (``LIMIT ?`` takes a number in both dialects).
_NO_LIMIT = 2**62

# -------------------------------------------------------------------------------------- reads


def _statements(tx: Tx) -> _sql.Statements:
    return _sql.statements(tx.dialect)


def load(tx: Tx, flow_id: str) -> Flow | None:
    """The flow's row, or None."""
    rows = tx.execute(_statements(tx).select, (flow_id,))
    return to_flow(rows[0]) if rows else None


def load_history(tx: Tx, flow_id: str) -> list[Event] | None:
    """Every event of the flow, in order (revision, then position); None for an unknown flow."""
    rows = tx.execute(_statements(tx).select_history, (flow_id,))
    if not rows and load(tx, flow_id) is None:
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


def load_mailbox(tx: Tx, flow_id: str) -> Mailbox:
    """The flow's whole mailbox: queued messages in arrival order, every id seen."""
    rows = tx.execute(_statements(tx).select_mailbox, (flow_id,))
    queued = tuple(Message(r[0], r[1]) for r in rows if r[2] == "QUEUED")
    return Mailbox(queued, frozenset(r[0] for r in rows))


def load_active(tx: Tx, *, limit: int | None = None, owner: str | None = None) -> list[Flow]:
    """Flows that are active (`_machine.ACTIVE`: recovery's work list), oldest write first;
    with `owner`, only those leased to that owner."""
    q = _statements(tx)
    n = _NO_LIMIT if limit is None else int(limit)
    if owner is None:
        rows = tx.execute(q.select_active, (n,))
    else:
        rows = tx.execute(q.select_active_owned, (owner, n))
    return [to_flow(r) for r in rows]


_CHUNK = 500


def load_many(tx: Tx, flow_ids: Sequence[str]) -> list[Flow]:
    """The rows of those of `flow_ids` that exist (in no particular order)."""
    d = _dialect.of(tx)
    flows: list[Flow] = []
    for i in range(0, len(flow_ids), _CHUNK):
        chunk = flow_ids[i : i + _CHUNK]
        rows = tx.execute(_select_many(d, len(chunk)), d.list_params(chunk))
        flows.extend(to_flow(r) for r in rows)
    return flows


@functools.lru_cache(maxsize=16)
def _select_many(d: _dialect.Dialect, n: int) -> str:
    return f"SELECT {_sql.COLUMNS} FROM {FLOWS} WHERE {d.in_list('flow_id', n)}"


@functools.lru_cache(maxsize=64)
def _of_plans(base: str, d: _dialect.Dialect, plans: int | None, tail: str) -> str:
    """`base`, narrowed to `plans` (plan, version)s if not None, then `tail`."""
    return base + ("" if plans is None else " AND " + d.in_plans("f", plans)) + tail


def load_deadlines(
    tx: Tx, *, before: float | None = None, plans: Sequence[tuple[str, int]] | None = None
) -> list[tuple[float, str, int]]:
    """``(deadline, flow_id, revision)`` of every parked flow with a deadline (at or before
    `before`, if given; of the given (plan, version)s, if `plans` is given), earliest first.
    Uses the deadline index."""
    if plans is not None and not plans:
        return []
    d = _dialect.of(tx)
    n = None if plans is None else len(plans)
    sql = _of_plans(_statements(tx).select_deadlines, d, n, " ORDER BY park_deadline")
    params = [math.inf if before is None else before]
    if plans is not None:
        params += d.plans_params(plans)
    return [(r[0], r[1], r[2]) for r in tx.execute(sql, params)]


def load_orphans(
    tx: Tx, now: float, *, limit: int = 1000, plans: Sequence[tuple[str, int]] | None = None
) -> list[Flow]:
    """At most `limit` active flows that no engine holds at `now` (`_sql.orphan`), of the given
    (plan, version)s if `plans` is given, least recently written first. Cost: a pass over the
    active flows (the partial index), each checked against the small engines table."""
    if plans is not None and not plans:
        return []
    d = _dialect.of(tx)
    n = None if plans is None else len(plans)
    sql = _of_plans(
        _statements(tx).select_orphans, d, n, " ORDER BY f.updated_at, f.flow_id LIMIT ?"
    )
    params: list[Any] = [now, now]
    if plans is not None:
        params += d.plans_params(plans)
    return [to_flow(r) for r in tx.execute(sql, [*params, int(limit)])]


def count_waiting(tx: Tx) -> tuple[int, int, int]:
    """How many flows are parked, blocked and queued (a fleet engine's `parked`, `blocked` and
    `queued`, read at every scan)."""
    counts = {r[0]: int(r[1]) for r in tx.execute(_statements(tx).count_waiting)}
    return counts.get("PARKED", 0), counts.get("BLOCKED", 0), counts.get("QUEUED", 0)


def count_states(tx: Tx) -> dict[State, int]:
    """How many flows are in each state."""
    return {STATES[r[0]]: r[1] for r in tx.execute(_statements(tx).count_states)}


# ------------------------------------------------------------------------ reads for operators


def count_plans(tx: Tx) -> list[tuple[str, int, State, int]]:
    """``(plan, version, state, flows)`` for every plan version and state that has flows."""
    return [(r[0], r[1], STATES[r[2]], r[3]) for r in tx.execute(_statements(tx).count_plans)]


def oldest_parked(tx: Tx, *, limit: int = 10) -> list[Flow]:
    """The parked flows that have waited longest (since their last write), at most `limit`."""
    return [to_flow(r) for r in tx.execute(_statements(tx).oldest_parked, (int(limit),))]


def leased(tx: Tx) -> bool:
    """Are the store's active flows held by leases (a fleet, PostgreSQL)? On SQLite one engine
    at a time holds the whole file (its engine lock) and runs every active flow: no lease rows,
    so no flow there is ever an orphan (`count_orphans`, `holder`)."""
    return _dialect.of(tx).leases


def count_orphans(tx: Tx, now: float) -> int:
    """How many active flows no engine holds at `now` (`_sql.orphan`): engines of a fleet take
    them over at their next scan. 0 on a store without leases (`leased`)."""
    if not leased(tx):
        return 0
    return int(tx.execute(_statements(tx).count_orphans, (now, now))[0][0])


def holder(tx: Tx, flow_id: str, now: float) -> tuple[float, bool] | None:
    """Who holds the active flow `flow_id` at `now`, by the rule `count_orphans` counts with
    (`_sql.orphan`): ``(until, orphaned)`` where `until` is when its hold ends (the earlier of
    the flow's own ``lease_until`` and its owner's engine lease; -inf if it has neither). None if
    the flow is not active or has no owner, or on a store without leases (`leased`)."""
    if not leased(tx):
        return None
    rows = tx.execute(_statements(tx).holder, (now, now, flow_id))
    if not rows:
        return None
    own, engine, orphaned = rows[0]
    until = min(math.inf if own is None else own, -math.inf if engine is None else engine)
    return until, bool(orphaned)


# ------------------------------------------------------------------------------------- plans


def _shape_json(shape: Shape) -> str:
    d: dict[str, Json] = {
        "steps": list(shape.steps),
        "compensable": list(shape.compensable),
        "attempts": list(shape.attempts),
    }
    if shape.limits is not None:
        d["limits"] = shape.limits.stored()
    return canonical_json(d)


def register_plans(tx: Tx, shapes: Sequence[Shape], now: float) -> None:
    """Record what each plan version looks like (its `Shape`), so that a process without the
    plans (an operator's tool) can still ask the machine for transitions. A registration of a
    known (name, version) replaces it: the last engine opened wins; engines still check their
    own plan before they run anything (versions fail closed)."""
    sql = _statements(tx).register_plan
    for shape in shapes:
        tx.execute(sql, (shape.name, shape.version, _shape_json(shape), now))


def load_plans(tx: Tx) -> list[tuple[Shape, float]]:
    """Every registered plan version, with when it was last registered, by name and version."""
    plans = []
    for name, version, text, at in tx.execute(_statements(tx).select_plans):
        d = json.loads(text)
        limits = d.get("limits")
        shape = Shape(
            name,
            version,
            tuple(d["steps"]),
            tuple(d["compensable"]),
            tuple(d["attempts"]),
            None if limits is None else _limits.from_stored(limits),
        )
        plans.append((shape, at))
    return plans


def live_plans(tx: Tx, now: float) -> list[Shape]:
    """The shapes of the plan versions that an engine whose lease runs at `now` has (a rolling
    deploy: an engine without a version leaves its flows to one with it). Two small reads: the
    live engines' lists, then the registered shapes."""
    have: set[tuple[str, int]] = set()
    for (text,) in tx.execute(_statements(tx).live_plans, (now,)):
        have.update((name, version) for name, version in json.loads(text))
    return [shape for shape, _at in load_plans(tx) if (shape.name, shape.version) in have]


# ---------------------------------------------------------------------------- engine leases


def lease_clock(tx: Tx, now: float) -> float:
    """The time by the clock that decides leases, read in this transaction (docs/adr/0110): on
    a store a fleet shares (PostgreSQL) the database's (``now()``: the transaction's start, the
    same for every statement of it), whatever `now` says; on a store without a clock of its own
    (SQLite), `now`, the engine's. One statement on PostgreSQL, none on SQLite.

    The functions below take their times as arguments (a test or a tool gives its own); an
    engine's lease transactions read this clock first and give its time (the `..._on_clock`
    functions), so that no host's clock decides who holds a flow."""
    sql = _dialect.of(tx).clock
    return now if sql is None else float(tx.execute(sql)[0][0])


def claim_on_clock(
    tx: Tx, *, lease: float, now: float, **options: Any
) -> tuple[Holder | None, float]:
    """`claim` of a lease of `lease` seconds on the lease clock (`lease_clock`), and the time
    it read on it (the holder's lease is compared with that time, and the new one runs from
    it)."""
    at = lease_clock(tx, now)
    return claim(tx, until=at + lease, now=at, **options), at


def renew_on_clock(tx: Tx, *, lease: float, now: float, **options: Any) -> list[Flow]:
    """`renew` for `lease` seconds on the lease clock (`lease_clock`): the lease runs `lease`
    seconds from the time read, and the flows it lets go are released at that time."""
    at = lease_clock(tx, now)
    return renew(tx, until=at + lease, now=at, **options)


def end_lease_on_clock(tx: Tx, *, now: float, **options: Any) -> None:
    """`end_lease` at the lease clock's time (`lease_clock`)."""
    end_lease(tx, now=lease_clock(tx, now), **options)


def release_on_clock(tx: Tx, *, now: float, **options: Any) -> int:
    """`release` at the lease clock's time (`lease_clock`)."""
    return release(tx, at=lease_clock(tx, now), **options)


def orphans_on_clock(
    tx: Tx, *, now: float, frozen_after: float | None = None, **options: Any
) -> tuple[float, list[Flow], list[tuple[int, str]]]:
    """`load_orphans` at the lease clock's time (`lease_clock`), and that time (a takeover of
    one of them requires that the flow is still nobody's at that time: `Change.lapsed_at`).
    With `frozen_after` and orphans found, `end_frozen_holders` clears the way for their
    takeover; the sessions it ended come third."""
    at = lease_clock(tx, now)
    orphans = load_orphans(tx, at, **options)
    ended = end_frozen_holders(tx, frozen_after) if orphans and frozen_after is not None else []
    return at, orphans, ended


def end_frozen_holders(tx: Tx, seconds: float) -> list[tuple[int, str]]:
    """End the database sessions that hold flow rows and have waited on their client in the
    middle of a request for longer than `seconds` (a lease): a process stopped (SIGSTOP, a
    paused VM) while it was sending a statement, or while rows were coming back to it, holds
    its locks for as long as it sleeps, and the server's guard on idle transactions does not
    see it (the session is not idle: it waits for the rest of the request). Its engine's lease
    has lapsed by then; its transaction rolls back and it finds its connection closed when it
    wakes (docs/adr/0158). ``(pid, application_name)`` of each session ended. Nothing on
    SQLite. Cost: one read of the server's session list."""
    sql = _dialect.of(tx).end_frozen
    if sql is None:
        return []
    return [(int(r[0]), str(r[1] or "")) for r in tx.execute(sql, (float(seconds),))]


def live_plans_on_clock(tx: Tx, *, now: float) -> list[Shape]:
    """`live_plans` of the engines whose lease runs at the lease clock's time (`lease_clock`)."""
    return live_plans(tx, lease_clock(tx, now))


def prune_engines_on_clock(tx: Tx, *, now: float, after: float) -> int:
    """`prune_engines` of the engines whose lease lapsed `after` seconds before the lease
    clock's time (`lease_clock`)."""
    return prune_engines(tx, lease_clock(tx, now) - after)


def heartbeat(tx: Tx, owner: str, until: float, now: float) -> None:
    """Record that engine `owner` holds its flows until `until` (its engine lease; an `until`
    in the past lets them all go at once), whatever incarnation holds the name (for tests and
    tools; an engine claims its name with `claim` and renews with `renew`/`renew_lease`). One
    row per engine, nothing else is written."""
    tx.execute(_statements(tx).heartbeat, (owner, until, now))


class Superseded(Exception):
    """Another incarnation holds this engine's owner name now: the lease is no longer this
    engine's to renew (`renew`, `renew_lease`). Raised inside the transaction, which then
    writes nothing."""


class RowMissing(Exception):
    """No row of the engines table names this engine's owner at all (`renew`): the database
    lost it (a crash with ``synchronous_commit = off``, a restore from a backup) or another
    engine pruned it after the lease lapsed (`prune_engines`). Nobody else holds the name; the
    lease lapsed as far as any other engine knows. Raised inside the transaction, which then
    writes nothing: the engine renews again with `Registration`, which writes the row again."""


@attrs.frozen
class Registration:
    """What an engine's lease row says besides its lease (`claim`), to write it again when it
    is missing (`renew`): where the incarnation runs, when it opened, its plan versions."""

    host: str
    pid: int
    started_at: float
    plans: Sequence[tuple[str, int]]


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
) -> Holder | None:
    """Open a new incarnation of engine `owner`: its lease row now names `incarnation`, runs
    until `until`, and lists the plan versions it has. Refused (the holder is returned, nothing
    is written) while another incarnation's lease runs at `now`, unless ``gone(host, pid)``
    proves that one's process gone. The row is held first (``FOR UPDATE`` on PostgreSQL), so
    that a claim and the old incarnation's renewal cannot both win; of two first claims of a new
    name, one inserts and the other is refused (``ON CONFLICT DO NOTHING``). Two statements."""
    q = _statements(tx)
    rows = tx.execute(q.claim_select + q.d.for_update, (owner,))
    text = canonical_json(sorted([name, version] for name, version in plans))
    if rows:
        holder = Holder(*rows[0])
        if (
            holder.incarnation != incarnation
            and holder.lease_until >= now
            and not gone(holder.host, holder.pid)
        ):
            return holder
        tx.execute(q.claim_update, (until, now, incarnation, host, pid, text, owner))
        return None
    if tx.execute(q.claim_insert, (owner, until, now, incarnation, host, pid, text)):
        return None
    return Holder(*tx.execute(q.claim_select, (owner,))[0])


def renew_lease(
    tx: Tx, owner: str, incarnation: str, lease: float, *, margin: float
) -> float | None:
    """The heartbeat thread's renewal (`_heartbeat`): extend the lease of incarnation
    `incarnation` to `lease` seconds from now by the database's clock, only while it still runs
    for more than `margin` seconds by that clock (a renewal after the lease may have lapsed is
    the engine's own, which re-reads its flows: `renew`). The lease's end now (the database's
    clock), or None if refused because it may have lapsed or because the name has no row at
    all (the engine's own renewal writes it again: `renew`); raises `Superseded` if another
    incarnation holds the name. PostgreSQL only; one statement (two when refused)."""
    q = _statements(tx)
    rows = tx.execute(q.renew_lease, (lease, owner, incarnation, margin))
    if rows:
        return float(rows[0][0])
    if _held_by_another(tx, owner, incarnation):
        raise Superseded(owner)
    return None


def _held_by_another(tx: Tx, owner: str, incarnation: str) -> bool:
    """Does a row name `owner` with an incarnation other than `incarnation`? (No row at all is
    not another incarnation: `RowMissing`.)"""
    rows = tx.execute(_statements(tx).incarnation_of, (owner,))
    return bool(rows) and rows[0][0] != incarnation


def end_lease(tx: Tx, owner: str, incarnation: str, now: float) -> None:
    """At close: incarnation `incarnation` of `owner` ends its lease at `now`, so that other
    engines take its flows at their next scan and a restart under the name claims it at once.
    Nothing if another incarnation holds the name by now."""
    tx.execute(_statements(tx).end_lease, (now, owner, incarnation, now))


def renew(
    tx: Tx,
    owner: str,
    until: float,
    now: float,
    *,
    let_go: Sequence[tuple[str, int]] = (),
    reread: Sequence[str] | None = None,
    incarnation: str | None = None,
    restore: Registration | None = None,
) -> list[Flow]:
    """An engine's renewal, in this one transaction: its lease is renewed (with `incarnation`,
    only while that incarnation holds the name, else `Superseded` is raised and nothing is
    written; without it, as `heartbeat`), the flows in `let_go` (``(flow_id, revision it let
    go at)``) are released (`release`), and the rows of the flows in `reread` are read
    (`load_many`) and returned (``[]`` without it).

    A name with no row at all is not superseded: `RowMissing` is raised (nothing written), or,
    given `restore`, the row of `incarnation` is written again (``ON CONFLICT DO NOTHING``: if
    another incarnation's claim got there first, that one holds the name, `Superseded`). The
    lease lapsed meanwhile as far as the others know, so a caller that restores re-reads what
    it runs (`reread`).

    The lease row comes first: a takeover locks it (`_batch`), so on PostgreSQL a takeover
    either committed before this renewal took the row, and the rows read here show it, or it
    waits for this renewal to commit and is refused (docs/adr/0048). An engine whose lease may
    have lapsed re-reads what it runs in this transaction before it trusts it again (ADR 0047).
    Cost: one statement for the lease, one per 500 flows released or read."""
    q = _statements(tx)
    if incarnation is None:
        heartbeat(tx, owner, until, now)
    elif not tx.execute(q.renew, (until, owner, incarnation)):
        if _held_by_another(tx, owner, incarnation):
            raise Superseded(owner)
        if restore is None:
            raise RowMissing(owner)
        text = canonical_json(sorted([name, version] for name, version in restore.plans))
        row = (owner, until, restore.started_at, incarnation, restore.host, restore.pid, text)
        if not tx.execute(q.claim_insert, row):
            raise Superseded(owner)
    if let_go:
        release(tx, owner, let_go, now)
    return [] if reread is None else load_many(tx, reread)


@functools.lru_cache(maxsize=16)
def _release_sql(d: _dialect.Dialect, n: int) -> str:
    if d.arrays:
        return (
            f"UPDATE {FLOWS} f SET lease_until = ? FROM unnest(?::text[], ?::bigint[])"
            " AS l(flow_id, revision) WHERE f.flow_id = l.flow_id"
            f" AND f.revision = l.revision AND f.owner = ? AND f.state {IN_ACTIVE}"
            " RETURNING f.flow_id"
        )
    pairs = ", ".join(["(?, ?)"] * n)
    return (
        f"UPDATE {FLOWS} SET lease_until = ? WHERE (flow_id, revision) IN (VALUES {pairs})"
        f" AND owner = ? AND state {IN_ACTIVE} RETURNING flow_id"
    )


def release(tx: Tx, owner: str, flows: Sequence[tuple[str, int]], at: float) -> int:
    """`owner` lets go those of `flows` (``(flow_id, revision)``) it still holds at that very
    revision (no new revision): any engine may take them over from `at` on. A flow written
    since (taken over, or given back to this engine by a wake, a timer or a cancel) is left as
    it is. How many were released."""
    d = _dialect.of(tx)
    released = 0
    ordered = sorted(flows)
    for i in range(0, len(ordered), _CHUNK):
        chunk = ordered[i : i + _CHUNK]
        if d.arrays:
            pairs: list[Any] = [[fid for fid, _r in chunk], [r for _f, r in chunk]]
        else:
            pairs = [v for pair in chunk for v in pair]
        released += len(tx.execute(_release_sql(d, len(chunk)), (at, *pairs, owner)))
    return released


def prune_engines(tx: Tx, before: float) -> int:
    """Forget engines whose lease lapsed before `before` and that hold no active flow; how
    many."""
    return len(tx.execute(_statements(tx).prune_engines, (before,)))


def load_engines(tx: Tx) -> list[tuple[str, float, float, int]]:
    """``(owner, lease_until, started_at, active flows it holds)`` of every known engine."""
    return [(r[0], r[1], r[2], r[3]) for r in tx.execute(_statements(tx).select_engines)]


def engines_left_on_clock(tx: Tx, now: float, since: float | None) -> tuple[float, bool]:
    """The lease clock's time (`lease_clock`), and whether an engine's lease ended at or after
    `since` (the last scan's time; None: the first scan) and before it: closed (its lease ended
    at its close) or lapsed (killed, frozen). An engine that opened and closed between two scans
    is seen too (`_queues.when_engines_leave`). One read of the engines' table (a row an engine)."""
    at = lease_clock(tx, now)
    if since is None:
        return at, False
    rows = tx.execute(
        f"SELECT 1 FROM {ENGINES} WHERE lease_until >= ? AND lease_until < ? LIMIT 1", (since, at)
    )
    return at, bool(rows)
