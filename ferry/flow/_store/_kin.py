"""Child flows in the batch (ADR 0139, 0145; the wiring: docs/adr/0148): what a batch of flow
writes does for families, in the same transaction.

Synchronous, inside the batch's transaction (`_batch.write_batch` calls `before` and `after`);
no trio, no clock: times come in the rows and the ops. The decisions are the pure transitions
of `_model._family`; the hot write (a child's end) is `_family.record_end`'s SQL on counters.

- `before` (only for the ops that may concern a parent: a wake, a timeout, a cancel, a step
  that fails, a compensation done; one probe of the spawns' primary key each): a wake for a
  parent that waits for its children is queued (`WakeWaiting`); a timeout or a cancel of a
  waiting parent stops its spawn (`_family.timed_out`, `cancel_waiting`); a transition that
  compensates a parent past a spawn with completed children holds it there while they are
  undone (`_family.compensating`). Such an op is rewritten to record the transition computed
  here (`Fixed`), with the family's rows to write once it is written.
- `after`: a written transition that ends a child records the end for its parent
  (`record_end`, O(1)), starts the next kept child, and, for the end that stops the spawn or is
  its last, cancels the other active children or moves the parent on (`_family.stop`,
  `maybe_on`, `go_on`); an end of a child that its parent's compensation undoes starts the
  next one's (`_family.child_ended`). The flow rows those write are one more `write_batch` in
  the same transaction (so an end they make, the parent's, is recorded for its own parent in
  turn), and their results ride on the result of the op that caused them (`Changed.more`).
- A child that waits for children of its own when its spawn stops is cancelled in the same
  transaction, level by level (`_cascade`): a tree of any depth is stopped in one commit.

Every family write holds the spawn row first (`lock_spawns`); a flow row it must write that
another transaction moved meanwhile (PostgreSQL) rolls the whole transaction back as a
serialization failure (`Raced`), which the engine runs again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, TypeAlias, cast

import attrs

from ferry.projected import Tx

from .._model import _family, _ops
from .._model import _machine as fm
from .._model._children import ChildResult, parent_of
from .._model._family import ACTIVE, Brood, Kid, Move
from .._model._family_spawn import go_on, maybe_on, stop
from .._model._types import Fail
from .._model._values import (
    COMPENSATING,
    FAILED,
    PARKED,
    TERMINAL,
    Flow,
    Mailbox,
    Shape,
    Transition,
)
from . import _apply, _signals, _sql, _store
from . import _family as sf
from ._op import Change, Changed, Create, Created, Op, Result

__all__ = [
    "Fixed",
    "Raced",
    "Registry",
    "WakeWaiting",
    "after",
    "before",
    "concerns",
    "merged",
    "results_of",
    "whole_deadlines",
    "write_spawn",
]

WriteBatch: TypeAlias = Callable[[Tx, Sequence[Op]], list[Result]]
Done: TypeAlias = list[tuple[Op, Result]]


class Raced(Exception):
    """A family write found a flow row moved by another transaction since it read it: the whole
    transaction is rolled back and run again (SQLSTATE 40001, as a serialization failure)."""

    sqlstate: Final = "40001"


class Registry:
    """The plan shapes every engine registered (``flow_plans``), read once per transaction when
    a family write needs one (a kept child's start, a parent moved on)."""

    __slots__ = ("_shapes", "_tx")

    def __init__(self, tx: Tx) -> None:
        self._tx = tx
        self._shapes: dict[tuple[str, int], Shape] | None = None

    def get(self, name: str, version: int) -> Shape | None:
        if self._shapes is None:
            self._shapes = {(s.name, s.version): s for s, _at in _store.load_plans(self._tx)}
        return self._shapes.get((name, version))

    def shape(self, name: str, version: int) -> Shape:
        """The shape of plan `name` at `version`; KeyError if no engine registered it."""
        shape = self.get(name, version)
        if shape is None:
            raise KeyError(f"plan {name!r} version {version} is not registered in the store")
        return shape


@attrs.frozen
class Fixed:
    """A transition computed before the writer ran (`apply` of a `Change`): recorded as it is.

    `recorded`: the end it makes (a child's) was recorded for its parent by the family write
    that made it. `moves`: the family rows to write once it is written (their flow rows but the
    op's own are written then too). `nested`: the children that wait for children of their own,
    to cancel in the same transaction once it is written (`reason`)."""

    t: Transition
    recorded: bool = False
    moves: tuple[Move, ...] = ()
    nested: tuple[str, ...] = ()
    reason: str = "cancelled"

    def __call__(self, flow: Flow, mailbox: Mailbox) -> Transition:
        return self.t


@attrs.frozen
class WakeWaiting:
    """A wake for a flow whose latest spawn is `brood`: queued if the flow waits for its
    children (`_family.wake_waiting`), else the machine's wake (`op`, the original)."""

    op: Change
    brood: Brood

    def __call__(self, flow: Flow, mailbox: Mailbox) -> Transition:
        move = self.op.apply
        assert isinstance(move, _ops.Wake)
        if _family.waits(flow, self.brood):
            return _family.wake_waiting(flow, mailbox, move.message, move.now)
        # `Refused` or `Unseen` are the writer's answers as they are (`_apply.run`, no holder).
        return cast(Transition, _apply.run(self.op, flow, mailbox))


def concerns(op: Op) -> bool:
    """May `op` concern a parent's family (so that `before` must look at it)? Cheap: its type."""
    if not isinstance(op, Change):
        return False
    m = op.apply
    if isinstance(m, _ops.Wake | _ops.TimeOut | _ops.Cancel | _ops.StepFailed | _ops.Compensated):
        return True
    return isinstance(m, _ops.StepDone) and isinstance(m.outcome, Fail)


# ------------------------------------------------------------------------------ reads


def _rows(tx: Tx, kids: Sequence[Kid]) -> list[Flow | None]:
    """The children's flow rows, by index (None for a kept one)."""
    found = {f.flow_id: f for f in _store.load_many(tx, [k.flow_id for k in kids])}
    return [found.get(k.flow_id) for k in kids]


def _nested(tx: Tx, kids: Sequence[Kid], rows: Sequence[Flow | None]) -> list[int]:
    """The active children (by index) that wait for children of their own."""
    out = []
    for k in kids:
        row = rows[k.index]
        if (
            k.status == ACTIVE
            and row is not None
            and row.state is PARKED
            and _family.waits(row, sf.latest_brood(tx, row.flow_id))
        ):
            out.append(k.index)
    return out


def _writer(op: Op) -> str | None:
    return op.holder.writer if isinstance(op, Change) and op.holder is not None else None


# ------------------------------------------------------------------------------ before


def before(tx: Tx, ops: Sequence[Op], again: WriteBatch) -> tuple[list[Op], list[Result | None]]:
    """The ops of `ops` that concern a waiting or compensating parent, rewritten (see the
    module doc): a wake for the writer (returned with the ops left), the others written here
    at once, each with its family's writes (`again`), before the rest of the batch, whose ops
    computed from an older copy of a child then find it moved (a cancelled child's step is
    void). Returns the ops left for the writer and, per op of `ops`, its result if written
    here (None: left)."""
    left: list[Op] = []
    done: list[Result | None] = [None] * len(ops)
    reg: Registry | None = None
    for i, op in enumerate(ops):
        if not concerns(op):
            left.append(op)
            continue
        assert isinstance(op, Change)
        brood = sf.latest_brood(tx, op.flow_id)
        if brood is None:
            left.append(op)
        elif isinstance(op.apply, _ops.Wake):
            left.append(attrs.evolve(op, apply=WakeWaiting(op, brood), holder=None))
        else:
            reg = reg or Registry(tx)
            new = _rewrite(tx, op, brood, reg)
            if new is None:
                left.append(op)
            else:  # a step's events and stream values go with its rewritten write
                (done[i],) = again(tx, [attrs.evolve(new, signals=op.signals)])
    return left, done


def merged(done: list[Result | None], results: Sequence[Result]) -> list[Result]:
    """The results of a batch: those `before` wrote, the writer's in the places left."""
    rest = iter(results)
    out = [next(rest) if r is None else r for r in done]
    assert next(rest, None) is None
    return out


def _rewrite(tx: Tx, op: Change, brood: Brood, reg: Registry) -> Change | None:
    move = op.apply
    row = op.flow if op.flow is not None else _store.load(tx, op.flow_id)
    if row is None:
        return None
    if isinstance(move, _ops.Request):
        shape = move.known.shapes.get((row.plan, row.version))
    else:
        assert isinstance(move, _ops.StepDone | _ops.StepFailed | _ops.Compensated)
        shape = move.shape
    if shape is None or shape.name != row.plan or shape.version != row.version:
        return None  # the machine's answer (blocked, unseen) as it is
    expected = None if op.flow is not None else row.revision
    if isinstance(move, _ops.TimeOut | _ops.Cancel) and _family.waits(row, brood):
        s = brood.step_index
        brood = sf.lock_spawns(tx, [(row.flow_id, s)])[(row.flow_id, s)]
        kids = sf.children(tx, row.flow_id, s)
        rows = _rows(tx, kids)
        nested = _nested(tx, kids, rows)
        if isinstance(move, _ops.TimeOut):
            reason = "timeout"
            m = _family.timed_out(
                brood, kids, rows, row, shape, reg.shape, move.now, expected=move.revision,
                nested=nested,
            )  # fmt: skip
        else:
            reason = move.reason
            m = _family.cancel_waiting(
                brood, kids, rows, row, shape, reason, reg.shape, move.now, nested=nested
            )
        assert m.parent is not None
        if not m.parent.done:  # not the machine's then: a stopping spawn's parent stays put
            return Change(op.flow_id, Fixed(m.parent), flow=op.flow, expected=expected)
        ids = tuple(kids[i].flow_id for i in nested)
        fixed = Fixed(m.parent, moves=(m,), nested=ids, reason=reason)
        return Change(op.flow_id, fixed, flow=op.flow, expected=expected, holder=op.holder)
    ran = _apply.run(op, row)
    if not isinstance(ran, Transition) or not ran.written:
        return None
    t, moves = _hold_past(tx, ran, shape, reg)
    if not moves:
        return None
    fixed = Fixed(t, moves=moves)
    return Change(op.flow_id, fixed, flow=op.flow, expected=expected, holder=op.holder)


def _hold_past(
    tx: Tx, t: Transition, shape: Shape, reg: Registry
) -> tuple[Transition, tuple[Move, ...]]:
    """`t` held by the parent's spawns whose completed children it must undo first (from the
    latest spawn down, `_family.compensating`), and the spawns' writes."""
    flow = t.flow
    if flow.state is not COMPENSATING and flow.state is not FAILED:
        return t, ()
    moves: list[Move] = []
    spawns = tx.execute(
        f"SELECT step_index FROM {sf.SPAWNS} WHERE parent = ? AND phase = 'over'"
        " ORDER BY step_index DESC",
        (flow.flow_id,),
    )
    for (s,) in spawns:
        brood = sf.lock_spawns(tx, [(flow.flow_id, s)])[(flow.flow_id, s)]
        kids = sf.children(tx, flow.flow_id, s)
        m = _family.compensating(t, brood, kids, _rows(tx, kids), shape, reg.shape, flow.updated_at)
        if m.brood == brood:
            continue
        moves.append(m)
        assert m.parent is not None
        t = m.parent
        if m.brood.phase == _family.UNDOING:
            break
    return t, tuple(moves)


# ------------------------------------------------------------------------------- after


def after(tx: Tx, ops: Sequence[Op], results: list[Result], again: WriteBatch) -> None:
    """The family's writes that the written `results` of `ops` call for, in this transaction
    (see the module doc); each op's are set on its result (`Changed.more`)."""
    reg: Registry | None = None
    for i, r in enumerate(results):
        if not isinstance(r, Changed):
            continue
        t = r.transition
        op = ops[i]
        fixed = op.apply if isinstance(op, Change) and isinstance(op.apply, Fixed) else None
        ends = t.flow.parent is not None and t.flow.state in TERMINAL
        if not t.written or (fixed is None and not ends):
            continue
        reg = reg or Registry(tx)
        writer = _writer(op)
        done: Done = []
        if fixed is not None:
            for m in fixed.moves:
                done += _write_move(tx, attrs.evolve(m, parent=None), writer, again)
            for fid in fixed.nested:
                done += _cascade(tx, fid, fixed.reason, t.flow.updated_at, writer, reg, again)
        if ends and not (fixed is not None and fixed.recorded):
            done += _ended(tx, r.before, t, writer, reg, again)
        if done:
            results[i] = attrs.evolve(r, more=tuple(done))


def _write_move(tx: Tx, m: Move, writer: str | None, again: WriteBatch) -> Done:
    """Store the family rows of `m` and write its flow rows (the parent's, then the
    children's) with `again`, in this transaction."""
    sf.write_rows(tx, m)
    ops: list[Op] = []
    if m.parent is not None and m.parent.written:
        p = m.parent
        # A parent another engine holds (it waits at its spawning step while its children are
        # undone, COMPENSATING) stays with that engine, as on an outside request: a child's end
        # written by another engine must not move it over its holder's lease (docs/adr/0162).
        rule = _ops.HolderRule(writer, keep_runner=True)
        ops.append(Change(p.flow.flow_id, Fixed(p), expected=p.expected, holder=rule))
    for c in m.children:
        if c.expected == 0:
            if writer is not None and c.flow.owner is None:
                c = attrs.evolve(c, flow=attrs.evolve(c.flow, owner=writer))
            ops.append(Create(c))
        elif c.written:
            rule = _ops.HolderRule(writer, keep_runner=True)
            fixed = Fixed(c, recorded=True)
            ops.append(Change(c.flow.flow_id, fixed, expected=c.expected, holder=rule))
    if not ops:
        return []
    results = again(tx, ops)
    for r in results:
        if not isinstance(r, Changed | Created):
            raise Raced(f"a family write found a flow moved meanwhile: {r!r}")
    return list(zip(ops, results, strict=True))


def _ended(
    tx: Tx, before: Flow, t: Transition, writer: str | None, reg: Registry, again: WriteBatch
) -> Done:
    """`t` ended the child `before` was: record it for its parent (see the module doc)."""
    child = t.flow
    found = parent_of(child.flow_id)
    if found is None:
        return []
    pid, s, _key = found
    brood = sf.lock_spawns(tx, [(pid, s)]).get((pid, s))
    if brood is None:
        return []
    now = child.updated_at
    if brood.phase == _family.UNDOING:
        kids = sf.children(tx, pid, s)
        index = next((k.index for k in kids if k.flow_id == child.flow_id), None)
        if index is None or brood.undoing != index:
            return []
        parent = _store.load(tx, pid)
        assert parent is not None
        pshape = reg.shape(parent.plan, parent.version)
        m = _family.child_ended(
            brood, kids, _rows(tx, kids), parent, pshape, index, before, t, reg.shape, now
        )
        return _write_move(tx, m, writer, again)
    if brood.phase not in (_family.WAITING, _family.STOPPING):
        return []
    stack = _family.child_stack(before, child, reg.shape(child.plan, child.version))
    end = sf.record_end(tx, child, stack)
    done: Done = []
    if end.start is not None:
        k = end.start
        first = fm.start(
            reg.shape(k.plan, k.version), k.flow_id, k.data, now, owner=writer, parent=pid,
            trace=child.trace,  # the spawn's span, as every child of it (`_family.spawned`)
        )  # fmt: skip
        ops: list[Op] = [Create(first)]
        done += zip(ops, again(tx, ops), strict=True)
    if not (end.stopped or end.last):
        return done
    b = end.brood
    parent = _store.load(tx, pid)
    assert parent is not None
    pshape = reg.shape(parent.plan, parent.version)
    if not end.stopped and (b.phase == _family.WAITING or b.then == "continue"):
        # The parent runs its next step: `go_on` needs the counters and how many failed (one
        # probe of an index), no child's row: O(1) in the spawn's size (docs/adr/0173).
        m = go_on(b, (), (), parent, pshape, reg.shape, now, failed=sf.failed(tx, pid, s))
        return done + _write_move(tx, m, writer, again)
    # A stop, or a last end that compensates: the rule reads the kid rows and the children's.
    kids = sf.children(tx, pid, s)
    rows = _rows(tx, kids)
    nested: list[int] = []
    if end.stopped:
        b = end.brood
        assert b.reason is not None
        nested = _nested(tx, kids, rows)
        b, stopped, cancels = stop(b, kids, rows, "compensate", b.reason, reg.shape, now, nested)
        m = maybe_on(b, kids, rows, parent, pshape, reg.shape, now, stopped, cancels)
    else:
        m = go_on(end.brood, kids, rows, parent, pshape, reg.shape, now)
    done += _write_move(tx, m, writer, again)
    reason = end.brood.reason or "cancelled"
    for i in nested:
        done += _cascade(tx, kids[i].flow_id, reason, now, writer, reg, again)
    return done


def _cascade(
    tx: Tx,
    flow_id: str,
    reason: str,
    now: float,
    writer: str | None,
    reg: Registry,
    again: WriteBatch,
) -> Done:
    """Cancel `flow_id`, a child whose spawn stopped and which waits for children of its own
    (`_family.cancel_waiting`), and, in turn, its children that wait for theirs."""
    row = _store.load(tx, flow_id)
    brood = sf.latest_brood(tx, flow_id)
    if row is None or brood is None or not _family.waits(row, brood):
        return []
    s = brood.step_index
    brood = sf.lock_spawns(tx, [(flow_id, s)])[(flow_id, s)]
    kids = sf.children(tx, flow_id, s)
    rows = _rows(tx, kids)
    nested = _nested(tx, kids, rows)
    shape = reg.shape(row.plan, row.version)
    now = max(now, row.updated_at)
    m = _family.cancel_waiting(brood, kids, rows, row, shape, reason, reg.shape, now, nested=nested)
    if m.parent is None or not m.parent.done:
        return []
    done = _write_move(tx, m, writer, again)
    for i in nested:
        done += _cascade(tx, kids[i].flow_id, reason, now, writer, reg, again)
    return done


# ------------------------------------------------------------------------ the runtime's


def write_spawn(
    tx: Tx,
    *,
    ops: Sequence[Op],
    guard: float | None,
    before: Flow,
    move: Move,
    owner: str | None = None,
) -> list[Result]:
    """`_family.write_spawn` as a batch's write function (`ops`, the runtime's copy of the
    ops it writes, for memory: the parent's change, then the children's starts; `owner`: who
    holds the queued children it admits); the step's events and stream values go with it
    (`_signals.record`)."""
    results = sf.write_spawn(tx, before, move, guard=guard, owner=owner)
    if ops and isinstance(ops[0], Change) and ops[0].signals is not None:
        _signals.record(tx, ops[:1], results[:1])
    return results


def results_of(tx: Tx, parent: str, step_index: int) -> dict[str, ChildResult]:
    """``ctx.children`` of the step after the spawn of `parent` at `step_index`: one read of
    the spawn's row and one of its children's (once per fan-in, not per end)."""
    brood = sf.load_brood(tx, parent, step_index)
    if brood is None:
        return {}
    return _family.results(brood, sf.children(tx, parent, step_index))


def whole_deadlines(tx: Tx) -> list[tuple[str, float]]:
    """The flows with a whole flow's deadline (`start(deadline=...)`) that have not ended, and
    their deadlines: the timers an engine arms at open (a partial index on them)."""
    rows = tx.execute(
        f"SELECT flow_id, deadline FROM {_sql.FLOWS} WHERE deadline IS NOT NULL"
        f" AND state NOT {_sql.IN_FINISHED}"
    )
    return [(r[0], r[1]) for r in rows]
