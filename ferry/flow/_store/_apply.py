"""What both batch writers (`_row_by_row`, SQLite's; `_arrays`, PostgreSQL's) do with an op
alike, written once: whether the row the store holds fits the op (`stale`), the mailbox its
transition reads (`mailbox`), running the transition a write's record names (`run`, the one
function that runs them), an existing flow's answer (`existing`), and the rows a transition
writes (`message_rows`, `history_rows`, `add_history`). The writers differ only in how many
statements they read and write these with.

Everything here is synchronous and pure: no statement is run here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Final

from ferry._text import canonical_json

from .._model import _holders, _ops
from .._model import _machine as m
from .._model._machine import DETAILS
from .._model._ops import Unseen
from .._model._types import Json
from .._model._values import EMPTY_MAILBOX, Flow, Mailbox, Message, Received, Transition
from ._op import Change, Conflict, Existing, Missing, Refused


def reads_mailbox(op: Change) -> bool:
    """Does the op's transition read the flow's mailbox (a wake's seen ids, the first queued
    message)? Then it runs on the row held in the transaction, not on the caller's copy alone."""
    return op.message_id is not None or op.first_queued


def stale(op: Change, revision: int | None, owner: str | None) -> Conflict | Missing | None:
    """The op's answer if the row the store holds (at `revision`, held by `owner`; None: no
    such row) does not fit it: the caller's copy must be at the stored revision, and so must
    `expected` where given. None: the op runs (on its copy, else on the stored row)."""
    if revision is None:
        return Missing(op.flow_id)
    expected = op.flow.revision if op.flow is not None else op.expected
    if expected is not None and revision != expected:
        return Conflict(op.flow_id, expected, revision, owner)
    return None


def mailbox(op: Change, seen: Collection[tuple[str, str]], first: Mapping[str, Message]) -> Mailbox:
    """What the op's transition reads of its flow's mailbox, from what the writer read for its
    ops: the (flow id, message id) pairs the mailbox holds, and each flow's first queued
    message."""
    fid = op.flow_id
    queued = (first[fid],) if op.first_queued and fid in first else ()
    m = op.message_id
    ids = frozenset((m,)) if m is not None and (fid, m) in seen else frozenset()
    return Mailbox(queued, ids) if queued or ids else EMPTY_MAILBOX


def run(op: Change, flow: Flow, box: Mailbox = EMPTY_MAILBOX) -> Transition | Refused | Unseen:
    """The transition `op` asks for on `flow` (the row, or the writer's copy of it) with what it
    read of the flow's mailbox (`box`), and who holds the flow after it (`op.holder`): the one
    function that runs a write's record (`_model._ops`, docs/adr/0130). `Unseen` (nothing run)
    for an outside request whose flow's plan version it did not know of; `Refused` if the
    transition raised (a bug in the caller's transition, never a race: nothing was written yet,
    the held row is as it was).

    A record that is not one of `_ops` is a function ``apply(flow, mailbox)`` given by hand
    (the store's own tests write arbitrary transitions so); the engine writes records only."""
    move = op.apply
    try:
        if isinstance(move, _ops.Request):
            known = move.known
            shape = known.shapes.get((flow.plan, flow.version))
            if shape is None and not known.complete:
                return _ops.Unseen(op.flow_id, flow.plan, flow.version)
            if isinstance(move, _ops.Wake):
                t = m.wake(flow, box, move.message, shape, move.now)
            elif isinstance(move, _ops.TimeOut):
                t = m.timeout(flow, shape, move.now, expected=move.revision)
            elif isinstance(move, _ops.Cancel):
                t = m.cancel(flow, shape, move.reason, move.now)
            elif isinstance(move, _ops.Resume):
                t = m.resume(flow, box, shape, move.now)
            else:
                assert isinstance(move, _ops.Abandon), move
                t = m.abandon(flow, shape, move.reason, move.by, move.now)
        elif isinstance(move, _ops.StepDone):
            t = m.step_done(flow, box, move.shape, move.outcome, move.data, move.now)
        elif isinstance(move, _ops.NextAttempt):
            t = m.next_attempt(flow, move.now, move.failure)
        elif isinstance(move, _ops.StepFailed):
            t = m.step_failed(flow, move.shape, move.problem, move.now, move.traceback)
        elif isinstance(move, _ops.Compensated):
            t = m.compensated(flow, move.shape, move.data, move.now)
        elif isinstance(move, _ops.CompensationFailed):
            t = m.compensation_failed(flow, move.problem, move.now, move.shape, move.traceback)
        elif isinstance(move, _ops.Block):
            t = m.block(flow, move.reason, move.now)
        elif isinstance(move, _ops.Rerun):
            t = _holders.rerun(flow, move.now)
        elif isinstance(move, _ops.TakeOver):
            t = _holders.take_over(flow, move.owner, move.now)
        elif isinstance(move, _ops.LetGo):
            t = _holders.let_go(flow, move.now)
        else:
            t = move(flow, box)
        holder = op.holder
        if holder is None:
            return t
        writer = holder.writer
        if holder.elsewhere and (flow.plan, flow.version) in holder.elsewhere:
            writer = None
        return _holders.assign_holder(t, flow, writer, keep_runner=holder.keep_runner)
    except Exception as exc:
        return Refused(op.flow_id, exc)


def existing(stored: Flow, start_data: str, f: Flow) -> Existing:
    """The answer of a start of `f` that found `stored` (started with `start_data`)."""
    return Existing(stored, stored.plan == f.plan and start_data == f.data)


def message_rows(t: Transition) -> tuple[list[tuple[Any, ...]], list[tuple[str, str]]]:
    """The mailbox rows `t` writes: the messages received, (flow id, message id, payload,
    status, at) in the order of `Statements.receive`; the messages taken, (flow id, message
    id) in the order of `Statements.take`."""
    received: list[tuple[Any, ...]] = []
    taken: list[tuple[str, str]] = []
    fid = t.flow.flow_id
    for w in t.messages:
        msg = w.message
        if isinstance(w, Received):
            status = "TAKEN" if w.taken else "QUEUED"
            received.append((fid, msg.message_id, msg.payload, status, w.at))
        else:
            taken.append((fid, msg.message_id))
    return received, taken


#: The text of each history detail that `_machine` makes once for every flow (`_machine.DETAILS`,
#: never changed), by identity: encoded here once, not per event.
_DETAIL_TEXT: Final = {id(d): canonical_json(d) for d in DETAILS}


def _detail_text(detail: Json) -> str | None:
    if detail is None:
        return None
    text = _DETAIL_TEXT.get(id(detail))
    return canonical_json(detail) if text is None else text


def history_rows(t: Transition) -> list[tuple[Any, ...]]:
    """The history rows of `t` (PostgreSQL's writer: they become columns)."""
    fid = t.flow.flow_id
    return [
        (fid, e.revision, n, e.at, e.kind, e.step, e.attempt, _detail_text(e.detail))
        for n, e in enumerate(t.events)
    ]


#: The values of one history row (`history_rows`, `add_history`).
HISTORY_WIDTH: Final = 8


def add_history(values: list[Any], t: Transition) -> None:
    """Append the history rows of `t` to `values`, one after the other, each `HISTORY_WIDTH`
    values in the order of `Statements.history` (SQLite's writer: no tuple per row)."""
    fid = t.flow.flow_id
    for n, e in enumerate(t.events):
        values += (fid, e.revision, n, e.at, e.kind, e.step, e.attempt, _detail_text(e.detail))
