"""PostgreSQL's batch writer (`_batch.write_batch`): one batch in a fixed number of statements
whatever its size, every parameter an array (docs/adr/0094).

Everything here is synchronous and runs inside one store transaction on a worker thread: no
trio, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferry.projected import Tx

from .._model._ops import Unseen
from .._model._values import EMPTY_MAILBOX, Flow, Mailbox, Message, Transition
from ._apply import (
    HISTORY_WIDTH,
    existing,
    history_rows,
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
    Existing,
    Missing,
    Op,
    Refused,
    Result,
    op_flow_id,
)
from ._sql import FIELDS, MUTABLE, Statements, mutable_values, row_values, to_flow

#: An op of a round whose transition ran: (its index, the transition, the row it ran on).
_Ran = tuple[int, Transition, Flow]


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """`rows` as `width` arrays, one per column (the parameters of an ``unnest``)."""
    return [[r[c] for r in rows] for c in range(width)]


class Arrays:
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
        return existing(self.rows[f.flow_id], self.start_data[f.flow_id], f)

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
                self.history += history_rows(t)
                self.rows[t.flow.flow_id] = t.flow
                self.start_data[t.flow.flow_id] = t.flow.data
                results[i] = Created(t)
            else:
                results[i] = self.existing(t.flow)

    def change(self, round_: list[tuple[int, Change]], results: list[Result | None]) -> None:
        """Run the round's changes on the held rows (or the callers' copies) and write them."""
        ran: list[tuple[int, Change, Flow, float | None]] = []  # a copy's lapse: a takeover
        boxed: list[tuple[int, Change, Flow]] = []
        for i, op in round_:
            known = op.flow
            if known is not None and not reads_mailbox(op):
                ran.append((i, op, known, op.lapsed_at))
                continue
            row = self.rows.get(op.flow_id)
            answer = stale(op, *((row.revision, row.owner) if row else (None, None)))
            if answer is not None:
                results[i] = answer
                continue
            flow = known if known is not None else row
            assert flow is not None  # `stale` answers Missing for no row
            boxed.append((i, op, flow))
        boxes = self.mailboxes([op for _i, op, _f in boxed]) if boxed else {}
        ran += [(i, op, flow, None) for i, op, flow in boxed]
        writes: list[tuple[int, Transition, Flow, float | None]] = []
        done: list[_Ran] = []
        for i, op, flow, at in ran:
            t = run(op, flow, boxes.get(op.flow_id, EMPTY_MAILBOX))
            if isinstance(t, Refused | Unseen):
                results[i] = t
            elif t.written:
                writes.append((i, t, flow, at))
            else:
                done.append((i, t, flow))
        done += self.update(writes, results)
        self.messages(done, results)

    def update(
        self, writes: list[tuple[int, Transition, Flow, float | None]], results: list[Result | None]
    ) -> list[_Ran]:
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
                self.history += history_rows(t)
                self.rows[fid] = t.flow
                done.append((i, t, before))
            else:
                results[i] = self.conflict(fid, t.expected)
        return done

    def messages(self, done: list[_Ran], results: list[Result | None]) -> None:
        """Answer `done` and write their mailboxes: at most two statements."""
        received: list[tuple[Any, ...]] = []
        taken: list[tuple[str, str]] = []
        for i, t, before in sorted(done, key=lambda d: d[0]):
            results[i] = Changed(t, before)
            if t.messages:
                more, gone = message_rows(t)
                received += more
                taken += gone
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
        return {op.flow_id: mailbox(op, seen, first) for op in ops}

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
            self.tx.execute(self.sql.history_rows, _columns(self.history, HISTORY_WIDTH))
        return results  # type: ignore[return-value]  # every slot is filled
