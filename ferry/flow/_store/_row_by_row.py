"""SQLite's batch writer (`_batch.write_batch`): a few multi-row statements for the ops of the
flows with one op in the batch, a statement at a time for the others (docs/adr/0094).

Everything here is synchronous and runs inside one store transaction on a worker thread: no
trio, no clock.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

from ferry.projected import Tx

from .._model._ops import Unseen
from .._model._values import Flow, Message, Transition
from . import _sql
from ._apply import (
    HISTORY_WIDTH,
    add_history,
    existing,
    mailbox,
    message_rows,
    reads_mailbox,
    run,
    stale,
)
from ._op import (
    Change,
    Changed,
    Conflict,
    Create,
    Created,
    Missing,
    Op,
    Refused,
    Result,
    op_flow_id,
)
from ._sql import FIELDS, Statements, changed_write, mutable_values, row_values, to_flow

#: The compare-and-sets of a batch that set the same columns (`RowByRow.update_rows`): the
#: indexes of their ops, and their parameters one row after the other (per row the values of
#: the columns, `_sql.changed_write`, then the flow id and the expected revision).
_Group: TypeAlias = tuple[list[int], list[Any]]

_REVISION: Final = FIELDS.index("revision")
_OWNER: Final = FIELDS.index("owner")
#: The values of one received message's row (`_apply.message_rows`).
_RECEIVED_WIDTH: Final = 5


class RowByRow:
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
        if not t.messages:
            return
        received, taken = message_rows(t)
        for row in received:
            self.received += row
        for pair in taken:
            self.tx.execute(self.sql.take, pair)

    def insert_received(self) -> None:
        """Insert the messages `later` kept, in a few statements, in the order kept."""
        values = self.received
        width = _RECEIVED_WIDTH
        for start, n in _sql.chunks(len(values) // width):
            whole = start == 0 and n * width == len(values)
            chunk = values if whole else values[start * width : (start + n) * width]
            self.tx.connection.execute(_sql.receive_rows(n), chunk)

    def messages(self, t: Transition) -> None:
        """Apply the mailbox writes of `t` now (an op written on its own)."""
        if not t.messages:
            return
        received, taken = message_rows(t)
        for row in received:
            self.tx.execute(self.sql.receive, row)
        for pair in taken:
            self.tx.execute(self.sql.take, pair)

    def changes(self, sql: str, params: Sequence[Any]) -> int:
        """Run one write statement; how many rows it changed. A compare-and-set or an insert
        that may be ignored is answered by this count, without a ``RETURNING`` row to build
        and fetch (the driver's own cursor: `RowByRow` is SQLite's writer). It skips
        `Tx.execute`'s check for a cancelled call; the store checks again before it commits,
        and interrupts a statement in progress, so a cancelled batch still writes nothing."""
        return int(self.tx.connection.execute(sql, params).rowcount)

    def rows(self, sql: str, params: Sequence[Any]) -> set[str]:
        """Run one multi-row write that returns flow ids; those ids (the driver's own cursor,
        as in `changes`)."""
        return {r[0] for r in self.tx.connection.execute(sql, params)}

    def cas(self, t: Transition, before: Flow, lapsed_at: float | None = None) -> bool:
        """Write the transition's row if the stored revision is still ``t.expected`` (and no
        lease holds it at `lapsed_at`, where given: a takeover). `before` is the row the
        transition ran on (the caller's copy or the held row): only the columns it changes
        are written (`_sql.changed_write`)."""
        fid = t.flow.flow_id
        if lapsed_at is not None:
            orphan = (*mutable_values(t.flow), fid, t.expected, lapsed_at, lapsed_at)
            return bool(self.tx.execute(self.sql.update_orphan, orphan))
        columns, params = changed_write(before, t.flow)
        params += (fid, t.expected)
        return self.changes(_sql.update_columns(columns), params) == 1

    def conflict(self, flow_id: str, expected: int | None) -> Conflict | Missing:
        """The op's answer when its compare-and-set did not match: the row as it is now."""
        rows = self.tx.execute(self.sql.revision, (flow_id,))
        if not rows:
            return Missing(flow_id)
        return Conflict(flow_id, expected, rows[0][0], rows[0][1])

    # ------------------------------------------------------------------ an op at a time

    def create(self, op: Create) -> Result:
        t = op.transition
        if self.changes(self.sql.insert, row_values(t.flow)):
            add_history(self.history, t)
            return Created(t)
        row = self.tx.execute(self.sql.existing, (t.flow.flow_id,))[0]
        return existing(to_flow(row), row[len(FIELDS)], t.flow)

    def change(self, op: Change) -> Result:
        """Write one op on its own: a takeover, or one of several ops of its flow."""
        sql, tx = self.sql, self.tx
        fid = op.flow_id
        flow = op.flow
        if flow is not None and not reads_mailbox(op):
            t = run(op, flow)
            if isinstance(t, Refused | Unseen):
                return t
            if t.written:
                if not self.cas(t, flow, op.lapsed_at):
                    return self.conflict(fid, t.expected)
                add_history(self.history, t)
            self.messages(t)
            return Changed(t, flow)
        if flow is not None:
            if not tx.execute(sql.hold, (fid, flow.revision)):
                return self.conflict(fid, flow.revision)
        else:
            rows = tx.execute(sql.existing, (fid,))
            answer = stale(op, *((rows[0][_REVISION], rows[0][_OWNER]) if rows else (None, None)))
            if answer is not None:
                return answer
            flow = to_flow(rows[0])
        seen: set[tuple[str, str]] = set()
        if op.message_id is not None and tx.execute(sql.seen, (fid, op.message_id)):
            seen.add((fid, op.message_id))
        first: dict[str, Message] = {}
        if op.first_queued and (queued := tx.execute(sql.first_queued, (fid,))):
            first[fid] = Message(queued[0][0], queued[0][1])
        t = run(op, flow, mailbox(op, seen, first))
        if isinstance(t, Refused | Unseen):
            return t
        if t.written:
            if not self.cas(t, flow):  # cannot happen while the row is held; never write blind
                return self.conflict(fid, t.expected)
            add_history(self.history, t)
        self.messages(t)
        return Changed(t, flow)

    # ------------------------------------------------------------ a statement for many

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
                    add_history(self.history, t)
                    results[i] = Created(t)
                else:
                    row = self.tx.execute(self.sql.existing, (t.flow.flow_id,))[0]
                    results[i] = existing(to_flow(row), row[len(FIELDS)], t.flow)

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
                    add_history(self.history, t)
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
            elif op.flow is None or reads_mailbox(op):
                boxed.append((i, op))
            else:
                t = run(op, op.flow)
                if isinstance(t, Refused | Unseen):
                    results[i] = t
                else:
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

    def read(
        self, ops: list[Change]
    ) -> tuple[dict[str, Sequence[Any]], set[tuple[str, str]], dict[str, Message]]:
        """What `ops` read, in a few statements for all of them: their rows, the (flow id,
        message id) pairs seen, the first queued messages."""
        conn = self.tx.connection
        ids = [op.flow_id for op in ops]
        rows: dict[str, Sequence[Any]] = {}
        for start, n in _sql.chunks(len(ids)):
            for r in conn.execute(_sql.select_rows(n), ids[start : start + n]):
                rows[r[0]] = r
        pairs = [v for op in ops if op.message_id is not None for v in (op.flow_id, op.message_id)]
        seen: set[tuple[str, str]] = set()
        for start, n in _sql.chunks(len(pairs) // 2):
            params = pairs[start * 2 : (start + n) * 2]
            seen.update((r[0], r[1]) for r in conn.execute(_sql.seen_rows(n), params))
        firsts = [op.flow_id for op in ops if op.first_queued]
        first: dict[str, Message] = {}
        for start, n in _sql.chunks(len(firsts)):
            for r in conn.execute(_sql.first_queued_rows(n), firsts[start : start + n]):
                first[r[0]] = Message(r[1], r[2])
        return rows, seen, first

    def read_and_apply(
        self,
        boxed: list[tuple[int, Change]],
        writes: dict[tuple[int, ...], _Group],
        results: list[Result | None],
    ) -> None:
        """Run the transitions of `boxed` (changes of a flow's row as it is stored, or of a copy
        that read its mailbox; each its flow's only op in the batch) with what they read, read
        for all of them at once (`read`): a copy's revision must still be the row's, as a held
        row's is. Their rows are then written with the plain ones (`writes`), as
        compare-and-sets."""
        rows, seen, first = self.read([op for _i, op in boxed])
        for i, op in boxed:
            row = rows.get(op.flow_id)
            answer = stale(op, *((row[_REVISION], row[_OWNER]) if row else (None, None)))
            if answer is not None:
                results[i] = answer
                continue
            assert row is not None  # `stale` answers Missing for no row
            flow = op.flow if op.flow is not None else to_flow(row)
            t = run(op, flow, mailbox(op, seen, first))
            if isinstance(t, Refused | Unseen):
                results[i] = t
            else:
                self.applied(i, t, flow, writes, results)

    def write(self, ops: Sequence[Op], order: Sequence[int]) -> list[Result]:
        results: list[Result | None] = [None] * len(ops)
        for i in self.plain(ops, order, results):
            op = ops[i]
            results[i] = self.change(op) if isinstance(op, Change) else self.create(op)
        _insert_history(self.tx, self.sql, self.history)
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


def _insert_history(tx: Tx, sql: Statements, values: list[Any]) -> None:
    """Insert the history rows whose values `add_history` put one after the other in
    `values`."""
    step = _HISTORY_CHUNK * HISTORY_WIDTH
    for i in range(0, len(values), step):
        chunk = values if i == 0 and len(values) <= step else values[i : i + step]
        tx.execute(sql.history + _more_rows(len(chunk) // HISTORY_WIDTH), chunk)
