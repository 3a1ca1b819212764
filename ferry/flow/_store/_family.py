"""The store half of child flows (ADR 0139): the tables ``flow_spawns`` and ``flow_children``,
and the synchronous reads and writes of a family that the runtime calls inside one transaction.

Synchronous, like `_store`: each function runs inside a store transaction (a
`ferry.projected.Tx`) on the store's thread; no trio, no clock (times come in the rows). The
decisions are the pure transitions of `_model._family`; this module stores and finds their rows
(`Brood`, `Kid`), with one write done here in SQL because it is the hot one: a child's end
(`record_end`), O(1) statements whatever the spawn's size, the rule of `_family.child_ended`
for an end outside the parent's compensation of its children.

Not wired yet: `create_tables` is called by its tests, not by `_store.create_schema` (the next
round adds `ddl` there, and the flows table's ``parent`` and ``deadline`` columns to its
``_ADDED_COLUMNS``: `FLOWS_ADDED_COLUMNS`).

Tables
------
- ``flow_spawns``: one row per spawn, primary key ``(parent, step_index)``, the columns of
  `Brood` (``stop_then`` is `Brood.then`: ``then`` is an SQL keyword).
- ``flow_children``: one row per child, primary key ``(parent, step_index, idx)``, unique
  ``flow_id``, the columns of `Kid` (``child_key`` is `Kid.key`, ``stack`` a JSON list,
  ``undone`` 0 or 1). Partial indexes: the active children of a spawn (what a stop cancels)
  and its completed children not yet compensated, by their place in the order of ends (the
  next one to compensate, docs/adr/0140, one index probe).

Locks (PostgreSQL; the order of ADR 0139): the engines' lease rows, then the spawn rows
(`lock_spawns`: ``FOR UPDATE``, in ``(parent, step_index)`` order), then the flow rows
(`_batch.write_batch`, in flow id order: a parent before its children). The spawn row guards its
``flow_children`` rows: every function here that writes them takes it first. A write that also
writes flow rows calls `lock_spawns` (or `write_spawn`) before `_batch.write_batch`. On SQLite
(one writer) the same statements run, without ``FOR UPDATE``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Final, cast

import attrs

from ferry.projected import Tx

from .._model._children import OnFailure, parent_of
from .._model._family import ACTIVE, KEPT, STOPPING, UNDOING, WAITING, Brood, Kid, Move
from .._model._family_rows import ENDED
from .._model._values import COMPLETED, FAILED, Flow, Mailbox, Transition
from . import _batch, _dialect, _schema, _sql, _store
from ._dialect import Dialect
from ._op import Change, Changed, Create, Op, Result
from ._schema import family_ddl

__all__ = [
    "CHILDREN",
    "FLOWS_ADDED_COLUMNS",
    "SPAWNS",
    "End",
    "NotSpawned",
    "children",
    "create_tables",
    "ddl",
    "latest_brood",
    "load_brood",
    "lock_spawns",
    "next_to_compensate",
    "record_end",
    "snapshot_of",
    "to_cancel",
    "to_compensate",
    "write_rows",
    "write_spawn",
]

SPAWNS: Final = _schema.SPAWNS
CHILDREN: Final = _schema.CHILDREN

#: What the flows table gains for families (ADR 0139), for `_store._ADDED_COLUMNS` once wired:
#: a child's parent (None for a top-level flow) and a whole flow's deadline.
FLOWS_ADDED_COLUMNS: Final = (
    (_sql.FLOWS, "parent", "TEXT"),
    (_sql.FLOWS, "deadline", "DOUBLE PRECISION"),
)

#: A completed child's status in its row.
_DONE: Final = ENDED[COMPLETED]

_BROOD: Final = (
    "parent, step_index, total, max_running, on_failure, active, next_kept, ended, phase,"
    " stop_then, reason, undoing"
)
_KID: Final = "idx, child_key, flow_id, plan, version, status, data, error, ended, stack, undone"

# ------------------------------------------------------------------------------------- schema


def ddl(dialect: Dialect) -> list[str]:
    """The statements that create the family's tables and indexes, each idempotent; the same
    text on both dialects (`dialect` is taken, for the day they differ). Part of the store's
    schema (`_schema.family_ddl`)."""
    del dialect
    return family_ddl()


def create_tables(tx: Tx) -> None:
    """Create the family's tables and indexes if missing. Called by its tests until
    `_store.create_schema` runs `ddl` with the rest of the schema (and its schema lock)."""
    for statement in ddl(_dialect.of(tx)):
        tx.execute(statement)


# ---------------------------------------------------------------------------------- the rows


def _brood(row: Sequence[Any]) -> Brood:
    return Brood(
        parent=row[0],
        step_index=row[1],
        total=row[2],
        max_running=row[3],
        on_failure=cast(OnFailure, row[4]),
        active=row[5],
        next_kept=row[6],
        ended=row[7],
        phase=row[8],
        then=cast(OnFailure | None, row[9]),
        reason=row[10],
        undoing=row[11],
    )


def _brood_values(b: Brood) -> list[Any]:
    return [
        b.parent,
        b.step_index,
        b.total,
        b.max_running,
        b.on_failure,
        b.active,
        b.next_kept,
        b.ended,
        b.phase,
        b.then,
        b.reason,
        b.undoing,
    ]


def _kid(row: Sequence[Any]) -> Kid:
    return Kid(
        index=row[0],
        key=row[1],
        flow_id=row[2],
        plan=row[3],
        version=row[4],
        status=row[5],
        data=row[6],
        error=row[7],
        ended=row[8],
        stack=tuple(json.loads(row[9])),
        undone=bool(row[10]),
    )


def _kid_values(k: Kid) -> list[Any]:
    stack = json.dumps(list(k.stack), separators=(",", ":"))
    return [
        k.index,
        k.key,
        k.flow_id,
        k.plan,
        k.version,
        k.status,
        k.data,
        k.error,
        k.ended,
        stack,
        int(k.undone),
    ]


def _for_update(tx: Tx) -> str:
    return _dialect.of(tx).for_update


# -------------------------------------------------------------------------------------- reads


def load_brood(tx: Tx, parent: str, step_index: int) -> Brood | None:
    """The spawn's row, or None (no lock: see `lock_spawns`)."""
    rows = tx.execute(
        f"SELECT {_BROOD} FROM {SPAWNS} WHERE parent = ? AND step_index = ?", (parent, step_index)
    )
    return _brood(rows[0]) if rows else None


def latest_brood(tx: Tx, parent: str) -> Brood | None:
    """The parent's latest spawn (the highest step index), or None: what `_family.waits`,
    `runnable` and `cancel` are asked with. One probe of the primary key."""
    rows = tx.execute(
        f"SELECT {_BROOD} FROM {SPAWNS} WHERE parent = ? ORDER BY step_index DESC LIMIT 1",
        (parent,),
    )
    return _brood(rows[0]) if rows else None


def lock_spawns(tx: Tx, spawns: Iterable[tuple[str, int]]) -> dict[tuple[str, int], Brood]:
    """Hold the rows of `spawns` (``(parent, step_index)`` each) until the transaction ends, in
    ``(parent, step_index)`` order whatever the order given (the lock order of ADR 0139: two
    writers cannot wait for each other in a cycle), one statement each; their rows, by key (a
    spawn with no row is left out). Call it before `_batch.write_batch` in a write that also
    changes flow rows."""
    lock = _for_update(tx)
    out: dict[tuple[str, int], Brood] = {}
    for parent, step_index in sorted(set(spawns)):
        rows = tx.execute(
            f"SELECT {_BROOD} FROM {SPAWNS} WHERE parent = ? AND step_index = ?{lock}",
            (parent, step_index),
        )
        if rows:
            out[(parent, step_index)] = _brood(rows[0])
    return out


def children(tx: Tx, parent: str, step_index: int) -> list[Kid]:
    """Every child row of the spawn, in spawn order (``_family.results`` makes
    ``ctx.children`` of them; `Snapshot.children`)."""
    rows = tx.execute(
        f"SELECT {_KID} FROM {CHILDREN} WHERE parent = ? AND step_index = ? ORDER BY idx",
        (parent, step_index),
    )
    return [_kid(r) for r in rows]


def to_cancel(tx: Tx, parent: str, step_index: int) -> list[Kid]:
    """The spawn's active children (what a stop cancels), in flow id order (the order
    `_batch.write_batch` locks their rows in). Call with the spawn row held (`lock_spawns`):
    no child starts or ends meanwhile. One statement on the partial index of the active ones."""
    rows = tx.execute(
        f"SELECT {_KID} FROM {CHILDREN} WHERE parent = ? AND step_index = ? AND status = ?",
        (parent, step_index, ACTIVE),
    )
    return sorted((_kid(r) for r in rows), key=lambda k: k.flow_id)


_COMPENSABLE: Final = (
    f"SELECT {_KID} FROM {CHILDREN} WHERE parent = ? AND step_index = ? AND status = ?"
    " AND undone = 0 ORDER BY ended DESC"
)


def to_compensate(tx: Tx, parent: str, step_index: int) -> list[Kid]:
    """The spawn's completed children not yet compensated for their parent, the last ended
    first (the order its compensation undoes them in, docs/adr/0140)."""
    rows = tx.execute(_COMPENSABLE, (parent, step_index, _DONE))
    return [_kid(r) for r in rows]


def next_to_compensate(tx: Tx, parent: str, step_index: int) -> Kid | None:
    """The first of `to_compensate` (`_family`'s next undo), one probe of its partial index."""
    rows = tx.execute(f"{_COMPENSABLE} LIMIT 1", (parent, step_index, _DONE))
    return _kid(rows[0]) if rows else None


# ------------------------------------------------------------------------------------- writes


class NotSpawned(Exception):
    """`write_spawn` wrote nothing (its transaction rolls back as this leaves it): `why`, and
    the results of the parent's compare-and-set and the children's starts, if they ran."""

    def __init__(self, why: str, results: Sequence[Result] = ()) -> None:
        super().__init__(why)
        self.results = list(results)


def write_spawn(
    tx: Tx, before: Flow, move: Move, *, guard: float | None = None, owner: str | None = None
) -> list[Result]:
    """Write a spawn (`_family.spawned`'s `move`, computed from the parent's row `before`, the
    runner's copy) in this transaction: the spawn's row, the parent's compare-and-set, the
    first rows of the children `max_running` lets start and every child's row (kept ones too).
    The results of `_batch.write_all` for the parent, then the children's starts.

    All or nothing: a spawn of this step that exists (a second run of the step), a parent that
    is no longer at ``before.revision`` (a takeover), a child's id taken by another flow, each
    raises `NotSpawned` (or `_batch.Undone`) with nothing written once the transaction rolls
    back. The spawn's row is written first: the lock order of ADR 0139 (spawn rows, then flow
    rows). Cost: O(children): the children's rows in one ``executemany``."""
    t = move.parent
    b = move.brood
    if t is None or t.flow.flow_id != before.flow_id or t.expected != before.revision:
        raise ValueError(
            "write_spawn(move) must carry the parent's transition from `before`, got"
            f" {None if t is None else (t.flow.flow_id, t.expected)!r} for"
            f" {(before.flow_id, before.revision)!r}"
        )
    if len(move.kids) != b.total:
        raise ValueError(f"write_spawn(move) has {len(move.kids)} children rows for {b.total}")
    marks = ", ".join("?" * 12)
    made = tx.execute(
        f"INSERT INTO {SPAWNS} ({_BROOD}) VALUES ({marks}) ON CONFLICT DO NOTHING RETURNING parent",
        _brood_values(b),
    )
    if not made:
        raise NotSpawned(f"the spawn of {b.parent!r} at step {b.step_index} was written already")

    def apply(_flow: Flow, _mailbox: Mailbox) -> Transition:
        return t

    ops: list[Op] = [Change(before.flow_id, apply, flow=before)]
    ops += [Create(c) for c in move.children]
    results = _batch.write_all(tx, ops, guard=guard, owner=owner)
    if not isinstance(results[0], Changed):
        raise NotSpawned(f"the parent {b.parent!r} is not at revision {before.revision}", results)
    kid_marks = ", ".join("?" * 13)
    tx.executemany(
        f"INSERT INTO {CHILDREN} (parent, step_index, {_KID}) VALUES ({kid_marks})",
        [[b.parent, b.step_index, *_kid_values(k)] for k in move.kids],
    )
    return results


@attrs.frozen
class End:
    """What `record_end` wrote and what the write must still do.

    `brood` is the spawn's row as the end leaves it, `kid` the ended child's row. `start`: the
    next kept child, now active, whose first row the same write inserts (`_machine.start` of
    its plan, a `_batch.Create`). `stopped`: this end (a failure with ``on_failure=
    "compensate"``) stopped the spawn; the same write cancels `to_cancel`'s children
    (`_family`'s stop). `last`: no child is active any more and none starts: the same write
    moves the parent on (`_family.go_on`, with `children`)."""

    brood: Brood
    kid: Kid
    start: Kid | None
    stopped: bool
    last: bool


def record_end(tx: Tx, child: Flow, stack: tuple[int, ...]) -> End:
    """Record the end of `child` (its row as this write leaves it, `COMPLETED` or `FAILED`;
    `stack` what `_family.child_stack` says it ended with) for its parent, in this write:
    the spawn's counters and the child's row, and the next kept child marked active, as
    `_family.child_ended` says for an end while the spawn waits or stops.

    O(1): four statements at most (the spawn row held, the child's row, the next kept one's,
    the counters), whatever the spawn's size; no brother is read. An end while the parent
    compensates its children (phase ``undoing``) is `_family.child_ended`'s, written by
    `write_rows`. Raises ValueError for a row that has not ended, is no child, or whose spawn
    does not wait for it."""
    if child.state not in ENDED:
        raise ValueError(f"record_end(child) must have ended, got {child.flow_id!r} {child.state}")
    found = parent_of(child.flow_id)
    if found is None:
        raise ValueError(f"record_end(child): {child.flow_id!r} is not a child's flow id")
    parent, step_index, _key = found
    brood = lock_spawns(tx, [(parent, step_index)]).get((parent, step_index))
    if brood is None:
        raise ValueError(f"record_end(child): no spawn of {parent!r} at step {step_index}")
    if brood.phase not in (WAITING, STOPPING):
        raise ValueError(
            f"record_end(child): the spawn of {parent!r} at step {step_index} is {brood.phase}"
            " (an end while the parent compensates its children is _family.child_ended's)"
        )
    b = attrs.evolve(brood, active=brood.active - 1, ended=brood.ended + 1)
    stack_text = json.dumps(list(stack), separators=(",", ":"))
    rows = tx.execute(
        f"UPDATE {CHILDREN} SET status = ?, data = ?, error = ?, ended = ?, stack = ?"
        f" WHERE flow_id = ? AND status = ? RETURNING {_KID}",
        (ENDED[child.state], child.data, child.error, b.ended, stack_text, child.flow_id, ACTIVE),
    )
    if not rows:
        raise ValueError(f"record_end(child): {child.flow_id!r} is not an active child")
    kid = _kid(rows[0])
    start: Kid | None = None
    stopped = b.phase == WAITING and child.state is FAILED and b.on_failure == "compensate"
    if stopped:
        reason = f"child {kid.key!r} failed: {child.error}"
        b = attrs.evolve(b, phase=STOPPING, then="compensate", reason=reason)
    elif b.phase == WAITING and b.next_kept < b.total:
        rows = tx.execute(
            f"UPDATE {CHILDREN} SET status = ? WHERE parent = ? AND step_index = ? AND idx = ?"
            f" AND status = ? RETURNING {_KID}",
            (ACTIVE, parent, step_index, b.next_kept, KEPT),
        )
        assert rows, f"the spawn of {parent!r} at {step_index} lost its kept child {b.next_kept}"
        start = _kid(rows[0])
        b = attrs.evolve(b, active=b.active + 1, next_kept=b.next_kept + 1)
    _update_brood(tx, b)
    last = b.active == 0 and (b.next_kept == b.total or b.phase == STOPPING)
    return End(b, kid, start, stopped, last)


def _update_brood(tx: Tx, b: Brood) -> None:
    tx.execute(
        f"UPDATE {SPAWNS} SET active = ?, next_kept = ?, ended = ?, phase = ?, stop_then = ?,"
        " reason = ?, undoing = ? WHERE parent = ? AND step_index = ?",
        (
            b.active,
            b.next_kept,
            b.ended,
            b.phase,
            b.then,
            b.reason,
            b.undoing,
            b.parent,
            b.step_index,
        ),
    )


def write_rows(tx: Tx, move: Move) -> None:
    """Write the family's rows of `move` (any `_family` write but the spawn: a stop, a timeout,
    the last end's `go_on`, the parent's compensation of its children): the spawn's row and the
    children's rows it changed. Its flow rows (`Move.parent`, `Move.children`) are the same
    write's `_batch.write_batch`. Call with the spawn row held (`lock_spawns`). Cost: one
    statement, and one per changed child."""
    b = move.brood
    if b.phase == UNDOING and b.undoing is None:
        raise ValueError(f"write_rows(move): the spawn of {b.parent!r} undoes no child")
    _update_brood(tx, b)
    for k in move.kids:
        stack = json.dumps(list(k.stack), separators=(",", ":"))
        tx.execute(
            f"UPDATE {CHILDREN} SET status = ?, data = ?, error = ?, ended = ?, stack = ?,"
            " undone = ? WHERE parent = ? AND step_index = ? AND idx = ?",
            (
                k.status,
                k.data,
                k.error,
                k.ended,
                stack,
                int(k.undone),
                b.parent,
                b.step_index,
                k.index,
            ),
        )


def snapshot_of(tx: Tx, flow_id: str) -> tuple[Flow, tuple[str, ...]] | None:
    """The flow's row and the child ids of its latest spawn in spawn order (`Snapshot.children`,
    empty if it never spawned), or None: two reads (the row, then its latest spawn's children's
    ids by the primary key)."""
    flow = _store.load(tx, flow_id)
    if flow is None:
        return None
    rows = tx.execute(
        f"SELECT flow_id FROM {CHILDREN} WHERE parent = ? AND step_index ="
        f" (SELECT MAX(step_index) FROM {SPAWNS} WHERE parent = ?) ORDER BY idx",
        (flow_id, flow_id),
    )
    return flow, tuple(r[0] for r in rows)
