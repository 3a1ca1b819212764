"""Flow control in the batch (SPEC 5.8, docs/adr/0141, 0147, 0165): after a batch's ops are
written, every flow of a limited plan whose state change touches its plan's budget is queued,
given back its slot or taken out of the queue, in the same transaction (`settle`).

A flow counts in its plan's budget iff its row has a ``queue_key`` (`Flow.queue_key`, set by
its start under limits and never changed), so the batch needs no plan and no extra read for a
plan without limits: those pay nothing. What each write does follows from its row's state
before and after alone (`_admission.slot_change`), whichever path wrote it:

- a start written `QUEUED` (a `Create`): `_admission.enqueue`, with the op's priority and time;
- a resume written `QUEUED` (from `BLOCKED`): `enqueue` again, keeping its priority;
- a queued flow written out of the queue by anything but an admission (a cancel: `FAILED`):
  `unqueue`;
- a write that leaves a slot state (an end, a block, a compensation's end): `release`;
- a queued flow's row held and not moved (a wake queuing a message for it): `admit`. Another
  transaction's admission passes a locked queued head over (``SKIP LOCKED``, ADR 0141), so the
  transaction that held it admits at its own commit what that one could not (ADR 0170).

Each of them admits what its change lets go, in itself; the admitted flows are read back and
set on the op's result (`Created.admitted`, `Changed.admitted`) for the engine to run. The
calls go in plan order (one budget row after another in plan order: ADR 0141's lock order),
after every flow row of the batch is written; within a plan its ends first, then its due fresh
starts, each kind settled together when it is more than one (`_admission_batch`), then the
rest in flow id order, each plan's budget row written once (ADR 0182). The limits a budget enforces
are the ones its row holds (`_admission.limits_of`: what the engines registered at open), so
an operator's process without the plan keeps the same budget.

Synchronous, inside the batch's transaction; no trio, no clock (`now`: the write's own time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs

from ferry.projected import Tx

from .._model import _admission as adm
from .._model._limits import Limits, StartOptions
from .._model._types import State
from .._model._values import Flow
from . import _admission, _budgets, _dialect
from . import _admission_batch as many
from ._op import Changed, Create, Created, Op, Result
from ._sql import COLUMNS, FLOWS, to_flow

_QUEUED: Final = State.QUEUED
_BLOCKED: Final = State.BLOCKED

#: What one write asks of its plan's budget: (plan, flow id, what, the op's result's path).
_Call = tuple[str, str, str, tuple[int, ...]]


def _asks(op: Op | None, r: Result) -> tuple[str, Flow] | None:
    """What the write `r` (of `op`) asks of its plan's budget, and the row it wrote; None."""
    if isinstance(r, Created):
        f = r.transition.flow
        return ("enqueue", f) if f.queue_key is not None and f.state is _QUEUED else None
    if not isinstance(r, Changed):
        return None
    after = r.transition.flow
    if after.queue_key is None:
        return None
    if not r.transition.written:  # its row held, not moved (a wake queuing a message for it)
        return ("admit", after) if after.state is _QUEUED else None
    before = r.before.state
    if after.state is _QUEUED:
        return ("requeue", after) if before is not _QUEUED else None
    if before is _QUEUED:
        return "unqueue", after
    change = adm.slot_change(before, after.state)
    if change < 0:
        return "release", after
    if change > 0:
        raise adm.BudgetError(
            f"flow {after.flow_id!r} took a slot by a write from {before} to {after.state}:"
            " only an admission takes one"
        )
    return None


def _walk(
    ops: Sequence[Op | None], results: Sequence[Result], path: tuple[int, ...], out: list[_Call]
) -> None:
    for i, (op, r) in enumerate(zip(ops, results, strict=True)):
        asked = _asks(op, r)
        if asked is not None:
            what, f = asked
            out.append((f.plan, f.flow_id, what, (*path, i)))
        if isinstance(r, Changed) and r.more:
            _walk([o for o, _r in r.more], [m for _o, m in r.more], (*path, i), out)


def _options(tx: Tx, op: Op | None, f: Flow, limits: Limits) -> StartOptions:
    key = None if limits.key is None else f.queue_key
    if isinstance(op, Create):
        return StartOptions(op.priority, op.not_before, key)
    rows = tx.execute(f"SELECT priority FROM {FLOWS} WHERE flow_id = ?", (f.flow_id,))
    priority = 0 if not rows or rows[0][0] is None else int(rows[0][0])
    return StartOptions(priority, f.not_before, key)  # a resume keeps its start's time


def _at(ops: Sequence[Op | None], results: Sequence[Result], path: tuple[int, ...]) -> Op | None:
    op: Op | None = None
    for n, i in enumerate(path):
        op, r = ops[i], results[i]
        if n + 1 < len(path):
            assert isinstance(r, Changed)
            ops, results = [o for o, _r in r.more], [m for _o, m in r.more]
    return op


def _with(
    results: list[Result],
    path: tuple[int, ...],
    admitted: tuple[Flow, ...] = (),
    wakes: tuple[tuple[str, float], ...] = (),
) -> None:
    """Add `admitted` and `wakes` to the result at `path` (nested in `Changed.more`), in
    place."""
    i = path[0]
    r = results[i]
    if len(path) == 1:
        assert isinstance(r, Created | Changed)
        results[i] = attrs.evolve(r, admitted=(*r.admitted, *admitted), wakes=(*r.wakes, *wakes))
        return
    assert isinstance(r, Changed)
    more = [m for _o, m in r.more]
    _with(more, path[1:], admitted, wakes)
    results[i] = attrs.evolve(
        r, more=tuple((o, m) for (o, _r), m in zip(r.more, more, strict=True))
    )


def settle(tx: Tx, ops: Sequence[Op], results: list[Result], owner: str | None) -> None:
    """Queue, release and unqueue what the batch's written `results` (of `ops`, nested
    family writes too) ask of their plans' budgets, admitting what may go (held by `owner`,
    the writing engine; None: nobody, taken over by a serving engine); each admission is set
    on the result that let it go. In place; nothing for a batch of plans without limits."""
    calls: list[_Call] = []
    _walk(ops, results, (), calls)
    if not calls:
        return
    calls.sort(key=lambda c: (c[0], c[1]))
    limits: dict[str, Limits] = {}
    timed: dict[str, tuple[tuple[int, ...], float]] = {}  # plans whose timer may move
    budgets = _budgets.Budgets()  # each plan's row locked and written once (ADR 0182)
    admitted: list[tuple[tuple[int, ...], list[str]]] = []
    by_plan: dict[str, list[_Call]] = {}
    for call in calls:
        by_plan.setdefault(call[0], []).append(call)
    for plan, mine in by_plan.items():
        what0 = mine[0][2]
        read = _admission.limits_or_time if what0 == "enqueue" else _admission.limits_of
        lim = limits[plan] = read(tx, plan)
        # A plan's ends first (the room they give back goes to its queue before new starts),
        # then its due fresh starts, each kind together when it is more than one (ADR 0182);
        # the rest one by one, in flow id order.
        seen = {c[3]: (_at(ops, results, c[3]), _time(results, c[3])) for c in mine}  # op, now
        ends: list[_Call] = []
        fresh: list[_Call] = []
        rest: list[_Call] = []
        for c in mine:
            op, now = seen[c[3]]
            if c[2] == "release":
                ends.append(c)
            elif c[2] == "enqueue" and isinstance(op, Create) and _due(op, now):
                fresh.append(c)
            else:
                rest.append(c)
        if len(ends) > 1:
            path = ends[-1][3]
            now = max(seen[c[3]][1] for c in ends)
            ids = [c[1] for c in ends]
            taken = many.release_many(tx, plan, lim, ids, now, owner or "", budgets)
            if taken:
                admitted.append((path, [a.flow_id for a in taken]))
            ends = []
        if len(fresh) > 1:
            got = _starts(tx, results, seen, plan, lim, fresh, owner or "", budgets)
            if got is not None:
                admitted += got
                fresh = []
        for _plan, fid, what, path in [*ends, *fresh, *rest]:
            op, now = seen[path]
            if what in ("enqueue", "requeue"):
                f = _flow_at(results, path)
                taken = _admission.enqueue(
                    tx, plan, lim, fid, _options(tx, op, f, lim), now, owner or "", budgets
                )
            elif what == "unqueue":
                taken = _admission.unqueue(tx, plan, lim, fid, now, owner or "", budgets)
            elif what == "admit":
                taken = _admission.admit(tx, plan, lim, _op_time(op, now), owner or "", budgets)
            else:
                taken = _admission.release(tx, plan, lim, fid, now, owner or "", budgets)
            if taken:
                admitted.append((path, [a.flow_id for a in taken]))
        for _plan, _fid, _what, path in mine:
            op, now = seen[path]
            delayed = isinstance(op, Create) and op.not_before is not None
            if lim.rate is not None or delayed or plan in timed:
                timed[plan] = (path, now)
    budgets.write(tx)
    rows = {f.flow_id: f for f in read_admitted(tx, [i for _p, ids in admitted for i in ids])}
    for path, ids in admitted:
        _with(results, path, tuple(rows[i] for i in ids if i in rows))
    for plan, (path, now) in timed.items():
        wake = _admission.next_wake(tx, plan, limits[plan], now)
        if wake is not None:
            _with(results, path, wakes=((plan, wake),))


def _due(op: Create, now: float) -> bool:
    """Is the start `op` due at `now` (no time to wait for)?"""
    return op.not_before is None or op.not_before <= now


def _starts(
    tx: Tx,
    results: Sequence[Result],
    seen: dict[tuple[int, ...], tuple[Op | None, float]],
    plan: str,
    limits: Limits,
    fresh: Sequence[_Call],
    owner: str,
    budgets: _budgets.Budgets,
) -> list[tuple[tuple[int, ...], list[str]]] | None:
    """`many.start_many` for the due fresh starts `fresh` of `plan`: each admitted flow with
    the path of its own start; None if they cannot all go straight in (nothing written)."""
    starts = []
    for _plan, fid, _what, path in fresh:
        f = _flow_at(results, path)
        starts.append((fid, _options(tx, seen[path][0], f, limits), f.revision))
    now = max(seen[c[3]][1] for c in fresh)
    taken = many.start_many(tx, plan, limits, starts, now, owner, budgets)
    if taken is None:
        return None
    return [(c[3], [a.flow_id]) for c, a in zip(fresh, taken, strict=True)]


def _op_time(op: Op | None, row_time: float) -> float:
    """When `op` was asked (an outside request's own time: its row, not written, keeps an older
    one), else `row_time`."""
    at = getattr(getattr(op, "apply", None), "now", None)
    return float(at) if isinstance(at, int | float) else row_time


def _flow_at(results: Sequence[Result], path: tuple[int, ...]) -> Flow:
    r: Result = results[path[0]]
    for i in path[1:]:
        assert isinstance(r, Changed)
        r = r.more[i][1]
    assert isinstance(r, Created | Changed)
    return r.transition.flow


def _time(results: Sequence[Result], path: tuple[int, ...]) -> float:
    return _flow_at(results, path).updated_at


def read_admitted(tx: Tx, flow_ids: list[str]) -> tuple[Flow, ...]:
    """The rows of the flows an admission just wrote, in the order given."""
    d = _dialect.of(tx)
    rows: dict[str, Flow] = {}
    for lo in range(0, len(flow_ids), 500):
        part = flow_ids[lo : lo + 500]
        for r in tx.execute(
            f"SELECT {COLUMNS} FROM {FLOWS} WHERE {d.in_list('flow_id', len(part))}",
            d.list_params(part),
        ):
            rows[r[0]] = to_flow(r)
    return tuple(rows[f] for f in flow_ids if f in rows)
