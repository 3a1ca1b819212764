"""A batch of flow writes in one store transaction (`write_batch`, `write_all`).

The ops and their results are `_op`'s; the writers are `_row_by_row` (SQLite) and `_arrays`
(PostgreSQL), which do what they do alike with `_apply`. Each op's compare-and-set is its
own: an op that finds another revision is answered `Conflict` (or `Missing`) and writes
nothing, and the other ops of the batch are applied. No statement is
allowed to fail on a race (PostgreSQL would abort the whole transaction, and every flow of the
batch with it): a stale revision is a row the write did not match, a concurrent start is
``INSERT ... ON CONFLICT DO NOTHING`` followed by a read.

Concurrency: every op first holds its flow's row and only then reads the mailbox, so a wake and
a park of one flow are serialized and a wake is never lost between them. Rows are held in flow
id order, so that concurrent batches cannot deadlock on PostgreSQL.

Everything here is synchronous and runs inside one store transaction on a worker thread: no
trio, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferry.projected import Tx

from .._model._ops import Unseen
from . import _dialect, _kin, _notify, _queue, _signals, _sql
from ._arrays import Arrays
from ._op import Change, Changed, Created, Existing, Op, Refused, Result, op_flow_id
from ._row_by_row import RowByRow


def guard_locks(tx: Tx, seconds: float | None) -> None:
    """On PostgreSQL, have the server end this transaction (and its session) if its client
    goes quiet inside it for `seconds`: a process frozen mid-transaction (SIGSTOP, a long pause)
    must not hold row locks that stall every other engine of a fleet for as long as it sleeps.
    Its locks go at once; its writes roll back; it finds its connection closed when it wakes.
    One statement; nothing on SQLite (one engine per file) or with None."""
    if seconds is not None and _dialect.of(tx).leases:
        ms = max(1, int(seconds * 1000))
        tx.execute(f"SET LOCAL idle_in_transaction_session_timeout = {ms}")


def write_batch(
    tx: Tx,
    ops: Sequence[Op],
    *,
    guard: float | None = None,
    owner: str | None = None,
    nested: bool = False,
) -> list[Result]:
    """Apply `ops` in this transaction; one result per op, in the order of `ops`. `guard`: see
    `guard_locks`. Then flow control (`_queue.settle`): the flows of limited plans it queues,
    releases or unqueues, and those admitted (held by `owner`, the writing engine), after every
    flow row (`nested`: a family's writes inside a batch, settled by that batch).

    Ops run in flow id order (the ops of one flow in the order given), so that concurrent
    batches take row locks in one global order and cannot deadlock on PostgreSQL. Each op's
    compare-and-set is checked on its own: an op that finds another revision gets `Conflict`
    (or `Missing`) and writes nothing, and the others are applied; an op whose transition raises
    gets `Refused`. Raises only on a database error (the caller's transaction then rolls back,
    and every op fails with it). Cost: on PostgreSQL a fixed number of statements whatever the
    batch's size (`Arrays`: three for a batch of compare-and-sets); on SQLite a few multi-row
    statements for the ops of the flows with one op in the batch (a takeover aside), a few
    statements per other op, and one multi-row insert per 500 history rows (`RowByRow`); and a
    sort of the batch.
    """
    if not nested:
        guard_locks(tx, guard)
    done: list[Result | None] | None = None
    given = ops
    if any(map(_kin.concerns, ops)):  # a wake, a timeout, a cancel, a failure: a parent's?
        ops, done = _kin.before(tx, ops, _nested)
    order = sorted(range(len(ops)), key=lambda i: op_flow_id(ops[i]))
    sql = _sql.statements(tx.dialect)
    writer = Arrays(tx, sql) if sql.d.arrays else RowByRow(tx, sql)
    results = writer.write(ops, order)
    if any(isinstance(op, Change) and op.signals is not None for op in ops):
        _signals.record(tx, ops, results)  # a step's events and stream values, with its row
    _kin.after(tx, ops, results, _nested)  # a child's end, recorded for its parent
    # A wait in another engine hears of the flows this batch settles (PostgreSQL only).
    _notify.announce(tx, [r.transition for r in results if isinstance(r, Changed | Created)])
    if done is not None:
        results = _kin.merged(done, results)
    if not nested:
        _queue.settle(tx, given, results, owner)
    return results


def _nested(tx: Tx, ops: Sequence[Op]) -> list[Result]:
    """A family's writes inside a batch (`_kin`): settled with the batch's own."""
    return write_batch(tx, ops, nested=True)


class Undone(Exception):
    """`write_all` rolled its transaction back: one op could not be applied as asked (a
    `Refused` transition, a start whose id is taken by another flow); `results` says which."""

    def __init__(self, results: list[Result]) -> None:
        super().__init__("one op of an all-or-nothing batch was not applied: nothing was")
        self.results = results


def write_all(
    tx: Tx, ops: Sequence[Op], *, guard: float | None = None, owner: str | None = None
) -> list[Result]:
    """`write_batch`, all or nothing (one `publish`): raises `Undone` (so the transaction rolls
    back) if any op is `Refused` or `Unseen`, or is a `Create` that found another flow under its
    id."""
    results = write_batch(tx, ops, guard=guard, owner=owner)
    if any(
        isinstance(r, Refused | Unseen) or (isinstance(r, Existing) and not r.same) for r in results
    ):
        raise Undone(results)
    return results
