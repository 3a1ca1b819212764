"""The one function that runs a write's transition on the flow's row (the batch writer calls it
inside the transaction, on the store's thread): the op's record (`_model._ops`) turned into its
`_machine` transition, then who holds the flow after it (`_ops.HolderRule`).

Synchronous and pure: no trio, no clock, no SQL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._model import _machine as m
from .._model import _ops
from .._model._values import Flow, Mailbox, Transition

if TYPE_CHECKING:
    from ._batch import Change


def transition(op: Change, flow: Flow, mailbox: Mailbox) -> Transition | _ops.Unseen:
    """The transition `op` asks for on `flow` (the row, or the writer's copy of it) with what it
    read of the flow's `mailbox`; or `Unseen` (nothing run) for an outside request whose flow's
    plan version it did not know of. Raises what the transition raises (a bug: the batch
    answers that op `Refused`).

    A record that is not one of `_ops` is a function ``apply(flow, mailbox)`` given by hand
    (the store's own tests write arbitrary transitions so); the engine writes records only."""
    move = op.apply
    if isinstance(move, _ops.Request):
        known = move.known
        shape = known.shapes.get((flow.plan, flow.version))
        if shape is None and not known.complete:
            return _ops.Unseen(op.flow_id, flow.plan, flow.version)
        if isinstance(move, _ops.Wake):
            t = m.wake(flow, mailbox, move.message, shape, move.now)
        elif isinstance(move, _ops.TimeOut):
            t = m.timeout(flow, shape, move.now, expected=move.revision)
        elif isinstance(move, _ops.Cancel):
            t = m.cancel(flow, shape, move.reason, move.now)
        elif isinstance(move, _ops.Resume):
            t = m.resume(flow, mailbox, shape, move.now)
        else:
            assert isinstance(move, _ops.Abandon), move
            t = m.abandon(flow, shape, move.reason, move.by, move.now)
    elif isinstance(move, _ops.StepDone):
        t = m.step_done(flow, mailbox, move.shape, move.outcome, move.data, move.now)
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
        t = m.rerun(flow, move.now)
    elif isinstance(move, _ops.TakeOver):
        t = m.take_over(flow, move.owner, move.now)
    elif isinstance(move, _ops.LetGo):
        t = m.let_go(flow, move.now)
    else:
        t = move(flow, mailbox)
    holder = op.holder
    if holder is None:
        return t
    writer = holder.writer
    if holder.elsewhere and (flow.plan, flow.version) in holder.elsewhere:
        writer = None
    return m.assign_holder(t, flow, writer, keep_runner=holder.keep_runner)
