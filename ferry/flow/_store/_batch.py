"""A batch of flow writes in one store transaction: the ops, their results, and the writer.

An op is a `Create` (insert a started flow, idempotently by id) or a `Change` (run a pure
transition of `_machine` on the flow's row and record what it says, docs/adr/0021). Each op's
compare-and-set is its own: an op that finds another revision is answered `Conflict` (or
`Missing`) and writes nothing, and the other ops of the batch are applied. No statement is
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

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias

import attrs

from ferry.projected import Tx, canonical_json

from .._model._machine import DETAILS
from .._model._ops import HolderRule, Move, Unseen
from .._model._types import Json
from .._model._values import EMPTY_MAILBOX, Flow, Mailbox, Message, Received, Transition
from . import _notify, _sql
from ._sql import (
    FIELDS,
    MUTABLE,
    Statements,
    changed_write,
    mutable_values,
    row_values,
    to_flow,
    update_columns,
)
from ._transition import transition


@attrs.frozen
class Create:
    """Insert a new flow (the `_machine.start` transition), idempotently by flow id."""

    transition: Transition


Apply: TypeAlias = Callable[[Flow, Mailbox], Transition]


@attrs.frozen
class Change:
    """Change one flow by a pure transition: `apply` names it (a record of `_model._ops`, run by
    `_transition.transition`), `holder` says who holds the flow after it (None: as it says).

    - With `flow` (the caller's copy, e.g. the runner's): a compare-and-set on ``flow.revision``;
      the row is not read. Without it: the row is read and held (then `expected`, if given, must
      match its revision).
    - `message_id`: look it up in the mailbox (the mailbox passed to `apply` has it in ``seen``
      if it is known). `first_queued`: pass the first queued message (a park or a resume needs
      it).
    - `lapsed_at` (with `flow`): the write also requires that no engine holds the flow at this
      time (`_sql.orphan`): a takeover (`_machine.take_over`), which must lose to the owner's
      renewal of its engine lease as much as to another writer.

    The transition's row is written iff it changed (`Transition.written`), as a compare-and-set
    on the revision it started from; its mailbox writes are applied either way.
    """

    flow_id: str
    apply: Move | Apply
    flow: Flow | None = None
    expected: int | None = None
    message_id: str | None = None
    first_queued: bool = False
    lapsed_at: float | None = None
    holder: HolderRule | None = None

    def __repr__(self) -> str:
        at = "" if self.flow is None else f", rev={self.flow.revision}"
        if self.expected is not None:
            at += f", expected={self.expected}"
        return f"Change({self.flow_id!r}, {self.apply!r}{at})"


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
    Created | Existing | Changed | Conflict | Missing | Refused | Rejected | Unwritten | Unseen
)


def op_flow_id(op: Op) -> str:
    """The id of the flow `op` writes."""
    return op.flow_id if isinstance(op, Change) else op.transition.flow.flow_id


#: The text of each history detail that `_machine` makes once for every flow (`_machine.DETAILS`,
#: never changed), by identity: encoded here once, not per event.
_DETAIL_TEXT: Final = {id(d): canonical_json(d) for d in DETAILS}


def _detail_text(detail: Json) -> str | None:
    if detail is None:
        return None
    text = _DETAIL_TEXT.get(id(detail))
    return canonical_json(detail) if text is None else text


def _history_rows(t: Transition) -> list[tuple[Any, ...]]:
    """The history rows of `t` (PostgreSQL's writer: they become columns)."""
    fid = t.flow.flow_id
    return [
        (fid, e.revision, n, e.at, e.kind, e.step, e.attempt, _detail_text(e.detail))
        for n, e in enumerate(t.events)
    ]


def _add_history(values: list[Any], t: Transition) -> None:
    """Append the history rows of `t` to `values`, one after the other, each `_HISTORY_WIDTH`
    values in the order of `Statements.history` (SQLite's writer: no tuple per row)."""
    fid = t.flow.flow_id
    for n, e in enumerate(t.events):
        values += (fid, e.revision, n, e.at, e.kind, e.step, e.attempt, _detail_text(e.detail))


def _existing(row: Sequence[Any], f: Flow) -> Existing:
    """`Existing` for a start of `f` that found `row` (selected with its start data)."""
    stored = to_flow(row)
    return Existing(stored, stored.plan == f.plan and row[len(FIELDS)] == f.data)


# --------------------------------------------------------------------------- a row at a time


class _RowByRow:
    """One batch's statements (SQLite: in process, a statement costs a few microseconds).

    The ops of the flows that have only that op in the batch go in multi-row statements, a few
    per batch (`plain`): the starts; the compare-and-sets from a copy; and the ops that read
    the row or the mailbox (a wake, a park), whose rows, message ids seen and first queued
    messages are read for all of them at once (`read_and_apply`). A write returns the ids of
    the rows it wrote, so each op still learns its own answer (a row it did not write is that
    op's `Conflict` alone). A takeover, and the ops of a flow with several in the batch (each
    must see the writes of the one before), go an op at a time, in flow id order. History rows
    and new messages are collected and inserted at the end."""

    __slots__ = ("history", "received", "sql", "tx")

    def __init__(self, tx: Tx, sql: Statements) -> None:
        self.tx = tx
        self.sql = sql
        self.history: list[Any] = []  # the history rows' values, one row after the other
        self.received: list[Any] = []  # the new messages of `plain`'s ops, likewise

    def later(self, t: Transition) -> None:
        """Apply the mailbox writes of `t`, an op of `plain`: a new message is inserted with the
        others of the batch (`received`), a taken one now. (A flow with one op in the batch:
        nothing else of the batch reads or writes its mailbox.)"""
        fid = t.flow.flow_id
        for w in t.messages:
            msg = w.message
            if isinstance(w, Received):
                status = "TAKEN" if w.taken else "QUEUED"
                self.received += (fid, msg.message_id, msg.payload, status, w.at)
            else:
                self.tx.execute(self.sql.take, (fid, msg.message_id))

    def insert_received(self) -> None:
        """Insert the messages `later` kept, in a few statements, in the order kept."""
        values = self.received
        width = 5
        for start, n in _sql.chunks(len(values) // width):
            whole = start == 0 and n * width == len(values)
            chunk = values if whole else values[start * width : (start + n) * width]
            self.tx.connection.execute(_sql.receive_rows(n), chunk)

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

    def changes(self, sql: str, params: Sequence[Any]) -> int:
        """Run one write statement; how many rows it changed. A compare-and-set or an insert
        that may be ignored is answered by this count, without a ``RETURNING`` row to build
        and fetch (the driver's own cursor: `_RowByRow` is SQLite's writer). It skips
        `Tx.execute`'s check for a cancelled call; the store checks again before it commits,
        and interrupts a statement in progress, so a cancelled batch still writes nothing."""
        return int(self.tx.connection.execute(sql, params).rowcount)

    def cas(
        self,
        t: Transition,
        before: Flow,
        lapsed_at: float | None = None,
        holder: str | None = None,
    ) -> bool:
        """Write the transition's row if the stored revision is still ``t.expected`` (and no
        lease holds it at `lapsed_at`, where given: a takeover of a flow its copy shows held by
        `holder`). `before` is the row the transition ran on (the caller's copy or the held
        row): only the columns it changes are written (`_sql.changed_write`).

        Where leases exist (PostgreSQL) a takeover first locks `holder`'s lease row (``FOR
        SHARE``), so that the lease it reads is the one committed when it writes: a renewal of
        that lease in flight either waits for this takeover to commit, or makes it wait and
        refuses it (ADR 0048)."""
        fid = t.flow.flow_id
        if lapsed_at is not None:
            if holder is not None and self.sql.d.leases:
                self.tx.execute(self.sql.lock_lease, (holder,))
            rows = self.tx.execute(
                self.sql.update_orphan,
                (*mutable_values(t.flow), fid, t.expected, lapsed_at, lapsed_at),
            )
            return bool(rows)
        columns, params = changed_write(before, t.flow)
        params += (fid, t.expected)
        return self.changes(update_columns(columns), params) == 1

    def conflict(self, flow_id: str, expected: int | None) -> Conflict | Missing:
        rows = self.tx.execute(self.sql.revision, (flow_id,))
        if not rows:
            return Missing(flow_id)
        return Conflict(flow_id, expected, rows[0][0], rows[0][1])

    def create(self, op: Create) -> Result:
        t = op.transition
        if self.changes(self.sql.insert, row_values(t.flow)):
            _add_history(self.history, t)
            return Created(t)
        return _existing(self.tx.execute(self.sql.existing, (t.flow.flow_id,))[0], t.flow)

    def change(self, op: Change) -> Result:
        sql, tx = self.sql, self.tx
        known = op.flow
        if known is not None and not _reads_mailbox(op):
            try:
                t = transition(op, known, EMPTY_MAILBOX)
            except Exception as exc:
                return Refused(op.flow_id, exc)
            if isinstance(t, Unseen):
                return t
            if t.written:
                if not self.cas(t, known, op.lapsed_at, known.owner):
                    return self.conflict(op.flow_id, t.expected)
                _add_history(self.history, t)
            self.messages(t)
            return Changed(t, known)
        if known is not None:
            if not tx.execute(sql.hold, (op.flow_id, known.revision)):
                return self.conflict(op.flow_id, known.revision)
            flow = known
        else:
            rows = tx.execute(sql.existing, (op.flow_id,))
            if not rows:
                return Missing(op.flow_id)
            flow = to_flow(rows[0])
            if op.expected is not None and flow.revision != op.expected:
                return Conflict(op.flow_id, op.expected, flow.revision, flow.owner)
        queued: tuple[Message, ...] = ()
        seen: frozenset[str] = frozenset()
        if op.message_id is not None and tx.execute(sql.seen, (op.flow_id, op.message_id)):
            seen = frozenset((op.message_id,))
        if op.first_queued:
            first = tx.execute(sql.first_queued, (op.flow_id,))
            if first:
                queued = (Message(first[0][0], first[0][1]),)
        try:
            t = transition(op, flow, Mailbox(queued, seen) if queued or seen else EMPTY_MAILBOX)
        except Exception as exc:  # nothing was changed yet: the held row is as it was
            return Refused(op.flow_id, exc)
        if isinstance(t, Unseen):
            return t
        if t.written:
            if not self.cas(t, flow):  # cannot happen while the row is held; never write blind
                return self.conflict(op.flow_id, t.expected)
            _add_history(self.history, t)
        self.messages(t)
        return Changed(t, flow)

    def rows(self, sql: str, params: Sequence[Any]) -> set[str]:
        """Run one multi-row write that returns flow ids; those ids (the driver's own cursor,
        as in `changes`)."""
        return {r[0] for r in self.tx.connection.execute(sql, params)}

    def create_rows(
        self, creates: list[tuple[int, Transition]], results: list[Result | None]
    ) -> None:
        """Insert the flows of `creates` in a few statements; an id that exists is read."""
        for start, n in _sql.chunks(len(creates)):
            chunk = creates[start : start + n]
            params = [v for _i, t in chunk for v in row_values(t.flow)]
            inserted = self.rows(_sql.insert_rows(n), params)
            for i, t in chunk:
                if t.flow.flow_id in inserted:
                    _add_history(self.history, t)
                    results[i] = Created(t)
                else:
                    row = self.tx.execute(self.sql.existing, (t.flow.flow_id,))[0]
                    results[i] = _existing(row, t.flow)

    def update_rows(
        self, columns: tuple[int, ...], group: _Group, results: list[Result | None]
    ) -> None:
        """Write the rows of `group`, which all set `columns`, in a few statements; each op of
        it is answered `Changed` already, and becomes its `conflict` if its row is not
        written."""
        indexes, params = group
        width = len(columns) + 2
        for start, n in _sql.chunks(len(indexes)):
            whole = start == 0 and n == len(indexes)
            chunk = params if whole else params[start * width : (start + n) * width]
            matched = self.rows(_sql.update_rows(columns, n), chunk)
            for i in indexes[start : start + n]:
                t = results[i].transition  # type: ignore[union-attr]  # Changed, see `plain`
                if t.flow.flow_id in matched:
                    _add_history(self.history, t)
                    self.later(t)
                else:
                    results[i] = self.conflict(t.flow.flow_id, t.expected)

    def plain(
        self, ops: Sequence[Op], order: Sequence[int], results: list[Result | None]
    ) -> list[int]:
        """Write the ops of the flows that have one op in `ops` (a takeover aside) in multi-row
        statements, answering them in `results`; the indexes of the ops left to write one at
        a time, in `order`."""
        per_flow = Counter(op_flow_id(op) for op in ops)
        creates: list[tuple[int, Transition]] = []
        writes: dict[tuple[int, ...], _Group] = {}
        boxed: list[tuple[int, Change]] = []
        rest: list[int] = []
        for i in order:
            op = ops[i]
            if per_flow[op_flow_id(op)] > 1:  # its ops see each other's writes: one at a time
                rest.append(i)
            elif isinstance(op, Create):
                creates.append((i, op.transition))
            elif op.lapsed_at is not None:  # a takeover: its own statement (`cas`)
                rest.append(i)
            elif op.flow is None or _reads_mailbox(op):
                boxed.append((i, op))
            else:
                try:
                    t = transition(op, op.flow, EMPTY_MAILBOX)
                except Exception as exc:
                    results[i] = Refused(op.flow_id, exc)
                    continue
                if isinstance(t, Unseen):
                    results[i] = t
                    continue
                self.applied(i, t, op.flow, writes, results)
        if creates:
            self.create_rows(creates, results)
        if boxed:
            self.read_and_apply(boxed, writes, results)
        for columns, group in writes.items():
            self.update_rows(columns, group, results)
        self.insert_received()
        return rest

    def applied(
        self,
        i: int,
        t: Transition,
        before: Flow,
        writes: dict[tuple[int, ...], _Group],
        results: list[Result | None],
    ) -> None:
        """Op `i`'s transition `t` ran on `before`: answer it, and add its row to `writes`
        if it changed (the answer becomes a conflict if `update_rows` does not write it)."""
        results[i] = Changed(t, before)
        if not t.written:
            self.later(t)
            return
        columns, values = changed_write(before, t.flow)
        group = writes.get(columns)
        if group is None:
            group = writes[columns] = ([], [])
        indexes, params = group
        indexes.append(i)
        params += values
        params += (t.flow.flow_id, t.expected)

    def read_and_apply(
        self,
        boxed: list[tuple[int, Change]],
        writes: dict[tuple[int, ...], _Group],
        results: list[Result | None],
    ) -> None:
        """Run the transitions of `boxed` (changes of a flow's row as it is stored, or of a copy
        that read its mailbox; each its flow's only op in the batch) with what they read read
        in a few statements for all of them: the rows (for a copy: its revision must still be
        the row's, as a held row's is), the message ids seen, the first queued messages. Their
        rows are then written with the plain ones (`writes`), as compare-and-sets."""
        conn = self.tx.connection
        ids = [op.flow_id for _i, op in boxed]
        rows: dict[str, Sequence[Any]] = {}
        for start, n in _sql.chunks(len(ids)):
            for r in conn.execute(_sql.select_rows(n), ids[start : start + n]):
                rows[r[0]] = r
        pairs = [
            v for _i, op in boxed if op.message_id is not None for v in (op.flow_id, op.message_id)
        ]
        seen: set[tuple[str, str]] = set()
        for start, n in _sql.chunks(len(pairs) // 2):
            params = pairs[start * 2 : (start + n) * 2]
            seen.update((r[0], r[1]) for r in conn.execute(_sql.seen_rows(n), params))
        firsts = [op.flow_id for _i, op in boxed if op.first_queued]
        first: dict[str, Message] = {}
        for start, n in _sql.chunks(len(firsts)):
            for r in conn.execute(_sql.first_queued_rows(n), firsts[start : start + n]):
                first[r[0]] = Message(r[1], r[2])
        for i, op in boxed:
            fid = op.flow_id
            row = rows.get(fid)
            if row is None:
                results[i] = Missing(fid)
                continue
            flow = op.flow
            if flow is not None:
                if row[_REVISION] != flow.revision:
                    results[i] = Conflict(fid, flow.revision, row[_REVISION], row[_OWNER])
                    continue
            else:
                flow = to_flow(row)
                if op.expected is not None and flow.revision != op.expected:
                    results[i] = Conflict(fid, op.expected, flow.revision, flow.owner)
                    continue
            queued = (first[fid],) if op.first_queued and fid in first else ()
            m = op.message_id
            ids_seen = frozenset((m,)) if m is not None and (fid, m) in seen else frozenset()
            box = Mailbox(queued, ids_seen) if queued or ids_seen else EMPTY_MAILBOX
            try:
                t = transition(op, flow, box)
            except Exception as exc:  # nothing was changed yet
                results[i] = Refused(fid, exc)
                continue
            if isinstance(t, Unseen):
                results[i] = t
                continue
            self.applied(i, t, flow, writes, results)

    def write(self, ops: Sequence[Op], order: Sequence[int]) -> list[Result]:
        results: list[Result | None] = [None] * len(ops)
        for i in self.plain(ops, order, results):
            op = ops[i]
            results[i] = self.change(op) if isinstance(op, Change) else self.create(op)
        _insert_history(self.tx, self.sql, self.history)
        return results  # type: ignore[return-value]  # every slot is filled


#: The compare-and-sets of a batch that set the same columns (`_RowByRow.update_rows`): the
#: indexes of their ops, and their parameters one row after the other (per row the values of
#: the columns, `_sql.changed_write`, then the flow id and the expected revision).
_Group: TypeAlias = tuple[list[int], list[Any]]


_REVISION: Final = FIELDS.index("revision")
_OWNER: Final = FIELDS.index("owner")


def _reads_mailbox(op: Change) -> bool:
    """Does the op's transition read the flow's mailbox (a wake's seen ids, the first queued
    message)? Then it runs on the row held in the transaction, not on the caller's copy alone."""
    return op.message_id is not None or op.first_queued


# ------------------------------------------------------------------------ a batch at a time


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """`rows` as `width` arrays, one per column (the parameters of an ``unnest``)."""
    return [[r[c] for r in rows] for c in range(width)]


class _Arrays:
    """One batch in a fixed number of statements whatever its size (PostgreSQL: each statement
    is a round trip, docs/adr/0094): every parameter is an array, every statement's text is
    the same for every batch (prepared once by the driver).

    1. The lease rows of the engines the batch's takeovers take from, ``FOR SHARE``, in owner
       order (ADR 0048: a lease row before any flow row, as a renewal does).
    2. Every flow row the batch touches, ``FOR UPDATE``, in flow id order (bytewise): the one
       lock order of every writer, so two batches cannot deadlock. The rows are read as they
       are locked; no other writer can change them before this transaction ends.
    3. Then the ops in rounds: round k holds the k-th op of each flow (almost every batch is
       one round), so that an op sees what the ops of its flow before it wrote. Per round, at
       most: one multi-row insert of the started flows, one read of the messages seen, one of
       the first queued messages, one ``UPDATE ... FROM unnest(...)`` of every row written
       (each row's compare-and-set on its revision, and a takeover's "nobody holds it", are
       checked in its ``WHERE``: a row it does not return is that op's `Conflict` alone), one
       insert of received messages and one update of taken ones.
    4. One insert of every history row.

    For a batch of compare-and-sets from copies (a runner's boundaries), that is three
    statements after `guard_locks`: the lock, the update, the history."""

    __slots__ = ("history", "rows", "sql", "start_data", "tx")

    def __init__(self, tx: Tx, sql: Statements) -> None:
        self.tx = tx
        self.sql = sql
        self.history: list[tuple[Any, ...]] = []
        self.rows: dict[str, Flow] = {}  # what each held row holds now
        self.start_data: dict[str, str] = {}

    def conflict(self, flow_id: str, expected: int | None) -> Conflict | Missing:
        """The op's answer when its compare-and-set did not match the held row."""
        row = self.rows.get(flow_id)
        if row is None:
            return Missing(flow_id)
        return Conflict(flow_id, expected, row.revision, row.owner)

    def hold(self, flow_ids: list[str]) -> None:
        """Lock the rows of `flow_ids` in flow id order and read them."""
        for r in self.tx.execute(self.sql.lock_rows, (flow_ids,)):
            self.rows[r[0]] = to_flow(r)
            self.start_data[r[0]] = r[len(FIELDS)]

    def existing(self, f: Flow) -> Existing:
        row = self.rows[f.flow_id]
        return Existing(row, row.plan == f.plan and self.start_data[f.flow_id] == f.data)

    def lock(self, ops: Sequence[Op]) -> None:
        holders = {
            op.flow.owner
            for op in ops
            if isinstance(op, Change) and op.lapsed_at is not None and op.flow is not None
        }
        owners = sorted(o for o in holders if o is not None)
        if owners:
            self.tx.execute(self.sql.lock_leases, (owners,))
        self.hold(sorted({op_flow_id(op) for op in ops}))

    def create(self, round_: list[tuple[int, Create]], results: list[Result | None]) -> None:
        new: list[tuple[int, Transition]] = []
        for i, op in round_:
            if op.transition.flow.flow_id in self.rows:
                results[i] = self.existing(op.transition.flow)
            else:
                new.append((i, op.transition))
        if not new:
            return
        values = _columns([row_values(t.flow) for _i, t in new], len(FIELDS) + 1)
        inserted = {r[0] for r in self.tx.execute(self.sql.insert_rows, values)}
        lost = [t.flow.flow_id for _i, t in new if t.flow.flow_id not in inserted]
        if lost:  # started by another transaction since the lock: read it, held
            self.hold(lost)
        for i, t in new:
            if t.flow.flow_id in inserted:
                self.history += _history_rows(t)
                self.rows[t.flow.flow_id] = t.flow
                self.start_data[t.flow.flow_id] = t.flow.data
                results[i] = Created(t)
            else:
                results[i] = self.existing(t.flow)

    def change(self, round_: list[tuple[int, Change]], results: list[Result | None]) -> None:
        writes: list[tuple[int, Transition, Flow, float | None]] = []
        done: list[tuple[int, Transition, Flow]] = []
        boxed: list[tuple[int, Change, Flow]] = []
        for i, op in round_:
            known = op.flow
            row = self.rows.get(op.flow_id)
            if known is not None and not _reads_mailbox(op):
                try:
                    t = transition(op, known, EMPTY_MAILBOX)
                except Exception as exc:
                    results[i] = Refused(op.flow_id, exc)
                    continue
                if isinstance(t, Unseen):
                    results[i] = t
                    continue
                if t.written:
                    writes.append((i, t, known, op.lapsed_at))
                else:
                    done.append((i, t, known))
            elif known is not None:
                if row is None or row.revision != known.revision:
                    results[i] = self.conflict(op.flow_id, known.revision)
                else:
                    boxed.append((i, op, known))
            elif row is None:
                results[i] = Missing(op.flow_id)
            elif op.expected is not None and row.revision != op.expected:
                results[i] = Conflict(op.flow_id, op.expected, row.revision, row.owner)
            else:
                boxed.append((i, op, row))
        boxes = self.mailboxes([op for _i, op, _f in boxed]) if boxed else {}
        for i, op, flow in boxed:
            try:
                t = transition(op, flow, boxes.get(op.flow_id, EMPTY_MAILBOX))
            except Exception as exc:  # nothing was changed yet: the held row is as it was
                results[i] = Refused(op.flow_id, exc)
                continue
            if isinstance(t, Unseen):
                results[i] = t
                continue
            if t.written:
                writes.append((i, t, flow, None))
            else:
                done.append((i, t, flow))
        done += self.update(writes, results)
        self.messages(done, results)

    def update(
        self, writes: list[tuple[int, Transition, Flow, float | None]], results: list[Result | None]
    ) -> list[tuple[int, Transition, Flow]]:
        """Write the rows of `writes` in one statement; those it matched."""
        if not writes:
            return []
        values = [
            (t.flow.flow_id, t.expected, *mutable_values(t.flow), at) for _i, t, _f, at in writes
        ]
        matched = {
            r[0] for r in self.tx.execute(self.sql.update_rows, _columns(values, len(MUTABLE) + 3))
        }
        done = []
        for i, t, before, _at in writes:
            fid = t.flow.flow_id
            if fid in matched:
                self.history += _history_rows(t)
                self.rows[fid] = t.flow
                done.append((i, t, before))
            else:
                results[i] = self.conflict(fid, t.expected)
        return done

    def messages(
        self, done: list[tuple[int, Transition, Flow]], results: list[Result | None]
    ) -> None:
        """Answer `done` and write their mailboxes: at most two statements."""
        received: list[tuple[Any, ...]] = []
        taken: list[tuple[str, str]] = []
        for i, t, before in sorted(done, key=lambda d: d[0]):
            results[i] = Changed(t, before)
            fid = t.flow.flow_id
            for w in t.messages:
                if isinstance(w, Received):
                    status = "TAKEN" if w.taken else "QUEUED"
                    received.append((fid, w.message.message_id, w.message.payload, status, w.at))
                else:
                    taken.append((fid, w.message.message_id))
        if received:
            self.tx.execute(self.sql.receive_rows, _columns(received, 5))
        if taken:
            self.tx.execute(self.sql.take_rows, _columns(taken, 2))

    def mailboxes(self, ops: list[Change]) -> dict[str, Mailbox]:
        """What each of `ops` asks of its flow's mailbox (its message id seen? the first
        queued message?), in at most two statements for all of them."""
        pairs = [(op.flow_id, op.message_id) for op in ops if op.message_id is not None]
        firsts = [op.flow_id for op in ops if op.first_queued]
        seen: set[tuple[str, str]] = set()
        if pairs:
            seen = {(r[0], r[1]) for r in self.tx.execute(self.sql.seen_rows, _columns(pairs, 2))}
        first: dict[str, Message] = {}
        if firsts:
            rows = self.tx.execute(self.sql.first_queued_rows, (firsts,))
            first = {r[0]: Message(r[1], r[2]) for r in rows}
        boxes = {}
        for op in ops:
            queued = (first[op.flow_id],) if op.first_queued and op.flow_id in first else ()
            ids = frozenset(
                m for m in (op.message_id,) if m is not None and (op.flow_id, m) in seen
            )
            if queued or ids:
                boxes[op.flow_id] = Mailbox(queued, ids)
        return boxes

    def write(self, ops: Sequence[Op], order: Sequence[int]) -> list[Result]:
        results: list[Result | None] = [None] * len(ops)
        if not ops:
            return []
        self.lock(ops)
        rounds: list[list[int]] = []
        nth: dict[str, int] = {}
        for i in order:
            fid = op_flow_id(ops[i])
            k = nth.get(fid, 0)
            nth[fid] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(i)
        for round_ in rounds:
            creates = [(i, op) for i in round_ if isinstance(op := ops[i], Create)]
            changes = [(i, op) for i in round_ if isinstance(op := ops[i], Change)]
            self.create(creates, results)
            self.change(changes, results)
        if self.history:
            self.tx.execute(self.sql.history_rows, _columns(self.history, 8))
        return results  # type: ignore[return-value]  # every slot is filled


# History rows go in as one multi-row INSERT per 500 (not `executemany`: psycopg pipelines
# that, and a client frozen mid-pipeline holds its locks beyond any idle-in-transaction timeout,
# which only starts once the server has answered a whole request; ADR 0043).
_HISTORY_CHUNK = 500
_HISTORY_ROW = "(?, ?, ?, ?, ?, ?, ?, ?)"


@functools.lru_cache(maxsize=_HISTORY_CHUNK)
def _more_rows(n: int) -> str:
    """The VALUES tail of a history insert of `n` rows (its first row is in `history`)."""
    return ", " + ", ".join([_HISTORY_ROW] * (n - 1)) if n > 1 else ""


_HISTORY_WIDTH = 8


def _insert_history(tx: Tx, sql: Statements, values: list[Any]) -> None:
    """Insert the history rows whose values `_add_history` put one after the other in
    `values`."""
    step = _HISTORY_CHUNK * _HISTORY_WIDTH
    for i in range(0, len(values), step):
        chunk = values if i == 0 and len(values) <= step else values[i : i + step]
        tx.execute(sql.history + _more_rows(len(chunk) // _HISTORY_WIDTH), chunk)


# ---------------------------------------------------------------------------------- the batch


def guard_locks(tx: Tx, seconds: float | None) -> None:
    """On PostgreSQL, have the server end this transaction (and its session) if its client
    goes quiet inside it for `seconds`: a process frozen mid-transaction (SIGSTOP, a long pause)
    must not hold row locks that stall every other engine of a fleet for as long as it sleeps.
    Its locks go at once; its writes roll back; it finds its connection closed when it wakes.
    One statement; nothing on SQLite (one engine per file) or with None."""
    if seconds is not None and _sql.DIALECTS[tx.dialect].leases:
        ms = max(1, int(seconds * 1000))
        tx.execute(f"SET LOCAL idle_in_transaction_session_timeout = {ms}")


def write_batch(tx: Tx, ops: Sequence[Op], *, guard: float | None = None) -> list[Result]:
    """Apply `ops` in this transaction; one result per op, in the order of `ops`. `guard`: see
    `guard_locks`.

    Ops run in flow id order (the ops of one flow in the order given), so that concurrent
    batches take row locks in one global order and cannot deadlock on PostgreSQL. Each op's
    compare-and-set is checked on its own: an op that finds another revision gets `Conflict`
    (or `Missing`) and writes nothing, and the others are applied; an op whose transition raises
    gets `Refused`. Raises only on a database error (the caller's transaction then rolls back,
    and every op fails with it). Cost: on PostgreSQL a fixed number of statements whatever the
    batch's size (`_Arrays`: three for a batch of compare-and-sets); on SQLite a few multi-row
    statements for the ops of the flows with one op in the batch (a takeover aside), a few
    statements per other op, and one multi-row insert per 500 history rows (`_RowByRow`); and a
    sort of the batch.
    """
    guard_locks(tx, guard)
    order = sorted(range(len(ops)), key=lambda i: op_flow_id(ops[i]))
    sql = _sql.statements(tx.dialect)
    writer = _Arrays(tx, sql) if sql.d.arrays else _RowByRow(tx, sql)
    results = writer.write(ops, order)
    # A wait in another engine hears of the flows this batch settles (PostgreSQL only).
    _notify.announce(tx, [r.transition for r in results if isinstance(r, Changed | Created)])
    return results


class Undone(Exception):
    """`write_all` rolled its transaction back: one op could not be applied as asked (a
    `Refused` transition, a start whose id is taken by another flow); `results` says which."""

    def __init__(self, results: list[Result]) -> None:
        super().__init__("one op of an all-or-nothing batch was not applied: nothing was")
        self.results = results


def write_all(tx: Tx, ops: Sequence[Op], *, guard: float | None = None) -> list[Result]:
    """`write_batch`, all or nothing (one `publish`): raises `Undone` (so the transaction rolls
    back) if any op is `Refused` or `Unseen`, or is a `Create` that found another flow under its
    id."""
    results = write_batch(tx, ops, guard=guard)
    if any(
        isinstance(r, Refused | Unseen) or (isinstance(r, Existing) and not r.same) for r in results
    ):
        raise Undone(results)
    return results
