"""Schedules in the store (SPEC 5.9, docs/adr/0144, 0146): the table ``flow_schedules``, and
every write of a schedule's row as one synchronous function over a `Tx`.

- `ddl`: the table and its partial index on the next tick of the schedules not paused
  (``flow_schedules_due``), made by `_schema.create_schema` with the flow tables.
- `declare`: the rows of `open_engine(schedules=[...])`: a new schedule's next tick is the
  first after now, the same definition writes nothing, a changed one replaces the stored one
  (its next tick from now, paused as it was).
- `claim` + `fire` (or both in one: `fire_due`): the firing. `claim` holds a bounded batch of
  the due schedules, oldest tick first, by a range of the index (PostgreSQL: ``FOR UPDATE SKIP
  LOCKED``, so that the engines of a fleet split them; SQLite: its one writer holds the file):
  never a scan of every schedule. `fire` holds the rows it is given, checks each revision
  (the compare-and-set: another engine fired it, or it changed), decides by
  `_schedule.fire`, and writes in the same transaction the tick's flow (a `Create` of the
  store's batch, `_batch.write_batch`, the same start as `Engine.start`'s) and the row's next
  tick: the tick's start and the next tick are one write. A second start of the same tick id
  is `Existing(same=True)`: it runs nothing.
- `trigger`, `pause`, `unpause`, `unschedule`, `backfill`, `start_waiting` (``overlap=
  "queue"``'s waiting tick, once the flow before it has ended), and the reads `stored`,
  `stored_all`, `next_due`.

The pure rules are `_model/_schedule.py`'s (the transitions of a `Row`) and `_cron.py`'s (the
rule, rebuilt from the definition read in the transaction, never from a copy). Times are
arguments. The cost of one tick: its share of one claim (an index range), one read of its
row, one read of its previous flow, its flow's insert and one row update, in statements whose
number depends on the batch's size (at most `CLAIM`), never on how many schedules there are.

No trio, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, final

import attrs

from ferry._text import canonical_json
from ferry.projected import Tx

from .._model import _limits, _machine, _schedule
from .._model._schedule import Fired, Row
from .._model._values import Shape
from . import _batch, _dialect, _op, _schema, _sql
from ._cron import CronRule, Schedule

#: The table of schedules, one row per schedule, and the partial index of the due ones (the
#: next tick of those not paused): named with the schema's statements.
SCHEDULES: Final = _schema.SCHEDULES
DUE_INDEX: Final = _schema.DUE_INDEX
#: At most this many schedules are claimed (and fired) by one transaction.
CLAIM: Final = 500

#: The row's columns, in the order of `_stored`.
_COLUMNS: Final = (
    "name",
    "definition",
    "revision",
    "next_tick",
    "last_tick",
    "last_flow",
    "waiting_tick",
    "paused",
    "missed",
    "skipped",
)
_SELECT: Final = ", ".join(_COLUMNS)


def ddl(d: _dialect.Dialect) -> list[str]:
    """The table's and its index's statements, each idempotent (the same in both dialects):
    part of the store's schema (`_schema.schedules_ddl`, where they live so that the schema
    needs none of this module)."""
    del d  # no difference yet: both have partial indexes and DOUBLE PRECISION
    return _schema.schedules_ddl()


# ------------------------------------------------------------------------------------- reads


@final
@attrs.frozen(kw_only=True)
class Stored:
    """A stored schedule: its `definition` (`Schedule.definition()`, as stored) and its `row`."""

    definition: dict[str, Any]
    row: Row

    @property
    def plan(self) -> tuple[str, int]:
        return (str(self.definition["plan"]), int(self.definition["version"]))

    def rule(self) -> CronRule:
        """The definition's rule (rebuilt from what was read; cached by `_cron`)."""
        zone = _schedule.check_timezone(self.definition["timezone"])
        return CronRule(str(self.definition["cron"]), zone)


def _stored(r: Sequence[Any]) -> Stored:
    row = Row(
        name=r[0],
        revision=int(r[2]),
        next_tick=r[3],
        last_tick=r[4],
        last_flow=r[5],
        waiting_tick=r[6],
        paused=bool(r[7]),
        missed=int(r[8]),
        skipped=int(r[9]),
    )
    return Stored(definition=json.loads(r[1]), row=row)


def _held(tx: Tx, names: Sequence[str]) -> dict[str, Stored]:
    """The rows of `names` (those stored), held to the end of the transaction, in name order
    (two transactions holding overlapping sets cannot deadlock)."""
    d = _dialect.of(tx)
    found: dict[str, Stored] = {}
    for start in range(0, len(names), CLAIM):
        part = sorted(names[start : start + CLAIM])
        sql = (
            f"SELECT {_SELECT} FROM {SCHEDULES} WHERE {d.in_list('name', len(part))}"
            f" ORDER BY name{d.for_update}"
        )
        for r in tx.execute(sql, d.list_params(part)):
            found[r[0]] = _stored(r)
    return found


def stored(tx: Tx, name: str) -> Stored | None:
    """The schedule `name`, or None."""
    return _held(tx, [name]).get(name)


def stored_all(tx: Tx) -> list[Stored]:
    """Every stored schedule, by name (the inspector's list); none in a store that an engine
    of an older version made (no table yet)."""
    if not tx.execute(_dialect.of(tx).table_exists, (SCHEDULES,))[0][0]:
        return []
    rows = tx.execute(f"SELECT {_SELECT} FROM {SCHEDULES} ORDER BY name")
    return [_stored(r) for r in rows]


def _due_from(tx: Tx) -> str:
    d = _dialect.of(tx)
    return f"{SCHEDULES} AS s{d.indexed_by.format(DUE_INDEX)}"


def next_due(tx: Tx, plans: Sequence[tuple[str, int]]) -> float | None:
    """The earliest next tick of the schedules not paused of `plans` (what the engine's one
    timer sleeps on), or None: the first row of the index range that is of one of them."""
    if not plans:
        return None
    d = _dialect.of(tx)
    sql = (
        f"SELECT s.next_tick FROM {_due_from(tx)} WHERE s.paused = 0 AND s.next_tick IS NOT NULL"
        f" AND {d.in_plans('s', len(plans))} ORDER BY s.next_tick LIMIT 1"
    )
    rows = tx.execute(sql, d.plans_params(plans))
    return float(rows[0][0]) if rows else None


def previous_ended(tx: Tx, flow_ids: Sequence[str]) -> dict[str, bool]:
    """For each of `flow_ids`: has it ended (finished, or no longer stored: retention deleted
    it)? One statement per `CLAIM` ids."""
    d = _dialect.of(tx)
    ended = dict.fromkeys(flow_ids, True)
    ids = sorted(set(flow_ids))
    for start in range(0, len(ids), CLAIM):
        part = ids[start : start + CLAIM]
        sql = (
            f"SELECT flow_id FROM {_sql.FLOWS} WHERE {d.in_list('flow_id', len(part))}"
            f" AND state NOT {_sql.IN_FINISHED}"
        )
        for (fid,) in tx.execute(sql, d.list_params(part)):
            ended[fid] = False
    return ended


# ----------------------------------------------------------------------------------- declare


def _definition_text(schedule: Schedule) -> str:
    return canonical_json(schedule.definition())


_INSERT: Final = (
    f"INSERT INTO {SCHEDULES} (name, definition, plan, version, revision, next_tick, paused,"
    " missed, skipped, declared_at, updated_at) VALUES (?, ?, ?, ?, 1, ?, 0, 0, 0, ?, ?)"
    " ON CONFLICT (name) DO NOTHING"
)
_REPLACE: Final = (
    f"UPDATE {SCHEDULES} SET definition = ?, plan = ?, version = ?, revision = ?,"
    " next_tick = ?, declared_at = ?, updated_at = ? WHERE name = ? AND revision = ?"
)


def declare(tx: Tx, schedules: Sequence[Schedule], now: float) -> dict[str, str]:
    """Store `schedules` (names unique: the caller checked): ``{name: "new" | "same" |
    "replaced"}``. New: next tick the first after now. The same definition: nothing written.
    Another: replaced, its next tick from now (a tick of the old expression is not caught up by
    the new one), paused as it was. A stored schedule not in `schedules` is left alone. Two
    declarations of one new name at once: the first insert wins, the other writes nothing."""
    held = _held(tx, [s.name for s in schedules])
    inserts: list[tuple[Any, ...]] = []
    replaces: list[tuple[Any, ...]] = []
    said: dict[str, str] = {}
    for s in schedules:
        text = _definition_text(s)
        old = held.get(s.name)
        changed = old is not None and canonical_json(old.definition) != text
        row = _schedule.declared(
            s.name, s.rule, now, None if old is None else old.row, changed=changed
        )
        said[s.name] = "new" if old is None else "replaced" if changed else "same"
        if row is None:
            continue
        if old is None:
            inserts.append((s.name, text, s.plan.name, s.plan.version, row.next_tick, now, now))
        else:
            params = (text, s.plan.name, s.plan.version, row.revision, row.next_tick, now, now)
            replaces.append((*params, s.name, old.row.revision))
    if inserts:
        tx.executemany(_INSERT, inserts)
    if replaces:
        tx.executemany(_REPLACE, replaces)
    return said


# -------------------------------------------------------------------------------------- fire


@final
@attrs.frozen(kw_only=True)
class Claim:
    """A due schedule as `claim` read it: the revision its firing compares and sets."""

    name: str
    revision: int


def claim(
    tx: Tx, now: float, plans: Sequence[tuple[str, int]], *, limit: int = CLAIM
) -> list[Claim]:
    """At most `limit` schedules of `plans`, not paused, whose next tick is at or before `now`,
    oldest tick first, held to the end of the transaction (PostgreSQL skips those another
    transaction holds: another engine is firing them). One statement, an index range."""
    if not plans:
        return []
    d = _dialect.of(tx)
    sql = (
        f"SELECT s.name, s.revision FROM {_due_from(tx)} WHERE s.paused = 0"
        f" AND s.next_tick <= ? AND {d.in_plans('s', len(plans))}"
        f" ORDER BY s.next_tick LIMIT ?{d.skip_locked}"
    )
    rows = tx.execute(sql, [now, *d.plans_params(plans), limit])
    return [Claim(name=r[0], revision=int(r[1])) for r in rows]


@final
@attrs.frozen(kw_only=True)
class Outcome:
    """What one firing (`fire`, `trigger`, `start_waiting`) did to one schedule.

    `written`: the row was written (False: not stored, another revision, paused, not due or of
    a plan this engine lacks: nothing was); `row`: the row as it now is (None: not stored);
    `flow_id` and `result`: the tick whose flow this write started and the store's answer
    (`Created`: new; `Existing(same=True)`: a trigger or backfill had started it, nothing runs
    again; `Existing(same=False)`: another flow holds the id, the tick is not started);
    `counted_all`: False when the missed ticks were counted up to `_schedule.MAX_COUNTED` only;
    `missed`, `skipped`: how many ticks this write added to the row's counts."""

    name: str
    written: bool
    row: Row | None
    flow_id: str | None = None
    result: _op.Result | None = None
    counted_all: bool = True
    missed: int = 0
    skipped: int = 0

    @property
    def created(self) -> bool:
        return isinstance(self.result, _op.Created)


_UPDATE: Final = (
    f"UPDATE {SCHEDULES} SET revision = ?, next_tick = ?, last_tick = ?, last_flow = ?,"
    " waiting_tick = ?, paused = ?, missed = ?, skipped = ?, updated_at = ?"
    " WHERE name = ? AND revision = ?"
)


def _update_params(new: Row, old: Row, now: float) -> tuple[Any, ...]:
    return (
        new.revision,
        new.next_tick,
        new.last_tick,
        new.last_flow,
        new.waiting_tick,
        int(new.paused),
        new.missed,
        new.skipped,
        now,
        new.name,
        old.revision,
    )


def _tick_create(held: Stored, t: float, now: float, shape: Shape, owner: str | None) -> _op.Create:
    """A tick's start, as `Engine.start`'s: a plan with limits queues it (priority 0, at once)
    under the key its key function gives the tick's data (SPEC 5.8, docs/adr/0168)."""
    tick = _schedule.tick_data(canonical_json(held.definition["data"]), t)
    data = canonical_json(tick)
    fid = _schedule.tick_id(held.row.name, t)
    key = _limits.flow_key(shape.limits, shape.name, tick)
    return _op.Create(_machine.start(shape, fid, data, now, owner=owner, queue_key=key))


def _record(
    tx: Tx,
    decided: Sequence[tuple[Stored, Fired]],
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    owner: str | None,
) -> list[Outcome]:
    """Write what each decision says, in this transaction: the ticks' flows (one batch) and the
    rows (one statement), so a tick's start and its row move together."""
    creates: list[_op.Op] = []
    for held, fired in decided:
        if fired.row is not None and fired.start is not None:
            creates.append(_tick_create(held, fired.start, now, shapes[held.plan], owner))
    results = iter(_batch.write_batch(tx, creates, owner=owner) if creates else [])
    updates = []
    outcomes = []
    for held, fired in decided:
        if fired.row is None:
            outcomes.append(Outcome(name=held.row.name, written=False, row=held.row))
            continue
        updates.append(_update_params(fired.row, held.row, now))
        result = next(results) if fired.start is not None else None
        outcomes.append(
            Outcome(
                name=held.row.name,
                written=True,
                row=fired.row,
                flow_id=fired.flow_id,
                result=result,
                counted_all=fired.counted_all,
                missed=fired.row.missed - held.row.missed,
                skipped=fired.row.skipped - held.row.skipped,
            )
        )
    _update_rows(tx, updates)
    return outcomes


#: PostgreSQL: the rows' updates of one firing in one statement, as arrays (docs/adr/0094's way).
_UPDATE_ARRAYS: Final = (
    f"UPDATE {SCHEDULES} AS s SET revision = v.revision, next_tick = v.next_tick,"
    " last_tick = v.last_tick, last_flow = v.last_flow, waiting_tick = v.waiting_tick,"
    " paused = v.paused, missed = v.missed, skipped = v.skipped, updated_at = v.updated_at"
    " FROM unnest(?::bigint[], ?::float8[], ?::float8[], ?::text[], ?::float8[], ?::int[],"
    " ?::bigint[], ?::bigint[], ?::float8[], ?::text[], ?::bigint[]) AS v(revision, next_tick,"
    " last_tick, last_flow, waiting_tick, paused, missed, skipped, updated_at, name, old)"
    " WHERE s.name = v.name AND s.revision = v.old"
)


def _update_rows(tx: Tx, updates: Sequence[tuple[Any, ...]]) -> None:
    """Write the rows `_update_params` made: one statement on PostgreSQL (arrays), an
    `executemany` on SQLite (in process: no round trips)."""
    if not updates:
        return
    if _dialect.of(tx).arrays:
        tx.execute(_UPDATE_ARRAYS, [list(column) for column in zip(*updates, strict=True)])
    else:
        tx.executemany(_UPDATE, updates)


def _last_active(tx: Tx, rows: Sequence[Stored]) -> dict[str, bool]:
    """Is each row's `last_flow` still active? Asked only where the answer matters: a waiting
    tick, or an overlap rule other than ``"allow"``."""
    ask = [
        s.row.last_flow
        for s in rows
        if s.row.last_flow is not None
        and (s.row.waiting_tick is not None or s.definition["overlap"] != "allow")
    ]
    ended = previous_ended(tx, ask) if ask else {}
    return {fid: not e for fid, e in ended.items()}


def fire(
    tx: Tx,
    claims: Sequence[Claim],
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    *,
    owner: str | None = None,
) -> list[Outcome]:
    """Fire the claimed schedules, in this transaction: hold each row; one whose revision is
    not the claim's, paused, not due, or of a plan not in `shapes` writes nothing; for the
    others `_schedule.fire` decides and `_record` writes each tick's flow (owned by `owner`)
    together with its row. One `Outcome` per claim (not stored: ``row=None``), in the order of
    `claims`."""
    held = _held(tx, [c.name for c in claims])
    rows = [held[c.name] for c in claims if c.name in held]
    active = _last_active(tx, rows)
    decided: list[tuple[Stored, Fired]] = []
    for c in claims:
        h = held.get(c.name)
        if h is None:
            continue
        if h.row.revision != c.revision or h.plan not in shapes:
            decided.append((h, Fired(row=None)))
            continue
        fired = _schedule.fire(
            h.row,
            h.rule(),
            now,
            overlap=h.definition["overlap"],
            catchup=float(h.definition["catchup"]),
            last_active=active.get(h.row.last_flow or "", False),
        )
        decided.append((h, fired))
    outcomes = {o.name: o for o in _record(tx, decided, now, shapes, owner)}
    return [outcomes.get(c.name, Outcome(name=c.name, written=False, row=None)) for c in claims]


def fire_due(
    tx: Tx,
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    *,
    owner: str | None = None,
    limit: int = CLAIM,
) -> list[Outcome]:
    """`claim` and `fire` in one transaction: at most `limit` due schedules fired. The engine
    calls it again while it comes back full (`limit` outcomes)."""
    return fire(tx, claim(tx, now, list(shapes), limit=limit), now, shapes, owner=owner)


# -------------------------------------------------------------------- the rest of the API


def _one(
    tx: Tx,
    name: str,
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    owner: str | None,
    decide: Any,
) -> Outcome | None:
    """Hold `name`'s row, decide by ``decide(stored, last_active) -> Fired``, record it."""
    h = stored(tx, name)
    if h is None:
        return None
    if h.plan not in shapes:
        raise LookupError(
            f"schedule {name!r} starts plan {h.plan[0]!r} version {h.plan[1]}, which this"
            " engine was not opened with"
        )
    last_active = _last_active(tx, [h]).get(h.row.last_flow or "", False)
    (outcome,) = _record(tx, [(h, decide(h, last_active))], now, shapes, owner)
    return outcome


def trigger(
    tx: Tx,
    name: str,
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    *,
    owner: str | None = None,
) -> Outcome | None:
    """`engine.trigger(name)`: a tick at the current whole second, paused or not, under the
    overlap rule; the next tick stays (`_schedule.trigger`). None: no such schedule."""

    def decide(h: Stored, last_active: bool) -> Fired:
        return _schedule.trigger(
            h.row, now, overlap=h.definition["overlap"], last_active=last_active
        )

    return _one(tx, name, now, shapes, owner, decide)


def start_waiting(
    tx: Tx,
    name: str,
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    *,
    owner: str | None = None,
) -> Outcome | None:
    """``overlap="queue"``: start the waiting tick if the flow before it has ended
    (`_schedule.ended`); nothing while it runs. None: no such schedule."""

    def decide(h: Stored, last_active: bool) -> Fired:
        return Fired(row=None) if last_active else _schedule.ended(h.row)

    return _one(tx, name, now, shapes, owner, decide)


def waiting_ready(tx: Tx) -> list[str]:
    """The schedules with a waiting tick whose previous flow has ended (a SIGKILL between that
    end and `start_waiting`): what a scan or an open starts."""
    rows = tx.execute(
        f"SELECT s.name FROM {SCHEDULES} AS s LEFT JOIN {_sql.FLOWS} AS f"
        " ON f.flow_id = s.last_flow WHERE s.waiting_tick IS NOT NULL"
        f" AND (f.flow_id IS NULL OR f.state {_sql.IN_FINISHED}) ORDER BY s.name"
    )
    return [r[0] for r in rows]


def _set_row(tx: Tx, old: Row, new: Row, now: float) -> None:
    tx.execute(_UPDATE, _update_params(new, old, now))


def pause(tx: Tx, name: str, now: float) -> Row | None:
    """`engine.pause(name)`: the row as it now is (paused); None: no such schedule."""
    h = stored(tx, name)
    if h is None:
        return None
    new = _schedule.pause(h.row)
    if new is None:
        return h.row
    _set_row(tx, h.row, new, now)
    return new


def unpause(tx: Tx, name: str, now: float) -> Row | None:
    """`engine.unpause(name)`: its next tick the first after now (the ticks of the pause are
    neither started nor missed); the row as it now is; None: no such schedule."""
    h = stored(tx, name)
    if h is None:
        return None
    new = _schedule.unpause(h.row, h.rule(), now)
    if new is None:
        return h.row
    _set_row(tx, h.row, new, now)
    return new


def unschedule(tx: Tx, name: str) -> bool:
    """`engine.unschedule(name)`: delete the row (its flows stay). Was it stored?"""
    rows = tx.execute(f"DELETE FROM {SCHEDULES} WHERE name = ? RETURNING name", (name,))
    return bool(rows)


def backfill(
    tx: Tx,
    name: str,
    start: float,
    end: float,
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    *,
    owner: str | None = None,
) -> list[_op.Result] | None:
    """`engine.backfill(name, start, end)`: every tick with ``start <= T <= end``
    (`_schedule.backfill_ticks`, a `ValueError` past `_schedule.MAX_BACKFILL`) started whatever
    the overlap rule says, in batches of `CLAIM`; the row is not written. The store's answer
    to each tick's start, oldest first (`Created`: new; `Existing`: the tick had its flow);
    None: no such schedule."""
    h = stored(tx, name)
    if h is None:
        return None
    shape = shapes.get(h.plan)
    if shape is None:
        raise LookupError(
            f"schedule {name!r} starts plan {h.plan[0]!r} version {h.plan[1]},"
            " which this engine was not opened with"
        )
    ticks = _schedule.backfill_ticks(h.rule(), start, end)
    results: list[_op.Result] = []
    for at in range(0, len(ticks), CLAIM):
        ops: list[_op.Op] = [_tick_create(h, t, now, shape, owner) for t in ticks[at : at + CLAIM]]
        results += _batch.write_batch(tx, ops, owner=owner)
    return results
