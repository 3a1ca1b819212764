"""The state machine of one flow: its pure transitions.

PURE: this module never imports trio, never reads a clock and does no I/O. Time comes in as the
`now` argument (wall-clock seconds). The store runs a transition inside the database transaction
that records it; the engine decides which transition to ask for; the model check (tests) drives
them directly. What a flow may become is decided here, and nowhere else.

The values it works on (`Flow`, `Shape`, `Mailbox`, `Transition`, ...) are in `_values`; the
invariants those values keep are checked by `_invariants`.

States and transitions (who asks for each)
------------------------------------------
::

    start ---------------------------------------> RUNNING(step 0, attempt 1), or QUEUED for
                                                   a plan with limits (the store admits it)
    QUEUED --cancel--> FAILED (never ran: nothing to compensate)
    BLOCKED --resume--> QUEUED (keeping blocked_from) for a plan with limits
    RUNNING --step_done(CONTINUE)--> RUNNING(next step) | COMPLETED (after the last step)
    RUNNING --step_done(COMPLETE)--> COMPLETED
    RUNNING --step_done(park)------> PARKED, or at once RUNNING(next) if a message is queued
    RUNNING --step_done(fail) / step_failed / cancel--> COMPENSATING(top of stack) | FAILED
    RUNNING, COMPENSATING --next_attempt--> same, attempt + 1 (a retry; a re-run after a crash)
    PARKED --wake--> RUNNING(next step, ctx.wake) | COMPLETED | BLOCKED (plan missing; queued)
    PARKED --timeout--> COMPENSATING | FAILED ("compensate") or RUNNING(next, timed_out)
    PARKED --cancel--> COMPENSATING | FAILED
    COMPENSATING --compensated--> COMPENSATING(next compensation) | FAILED
    COMPENSATING --compensation_failed--> BLOCKED
    RUNNING, PARKED, COMPENSATING --block--> BLOCKED (the plan version is missing)
    BLOCKED --resume--> the state it left (a running step or compensation: attempt + 1; a park
                        takes a queued message at once)
    any --wake--> DUPLICATE (seen id; before anything else), STALE (terminal or compensating),
                  QUEUED (running, blocked: the message is kept, the row does not change)
    PARKED past its deadline --wake--> the timeout first (same write), then the wake meets what
                  it left: STALE (compensating, failed) or QUEUED (running on, blocked)

Who holds an active flow (the fleet's `owner` and `released_at`, `take_over`, `rerun`,
`let_go`, `assign_holder`) is in `_holders`; the row edits the transitions share (`bump`,
`compensate`, the history events) in `_rows`. This module re-exports the holder transitions, so
that `_machine` stays the one name for "what a flow may become".

`step_done`, `step_failed`, `next_attempt`, `compensated` and `compensation_failed` are asked by
the one task that runs the flow and raise `InvalidTransition` in a state where they cannot
happen. `wake`, `timeout`, `cancel`, `resume` and `block` come from outside at any time and
answer with ``done=False`` (nothing written) when they do not apply. Every transition that
writes bumps `revision` by exactly 1 and lists its history `events`; a wake that is only queued
changes the mailbox, not the row.
"""

from __future__ import annotations

from ._rows import COMPLETE_DETAIL, CONTINUE_DETAIL, DETAILS
from ._rows import advance as _advance
from ._rows import bump as _bump
from ._rows import compensate as _compensate
from ._rows import completed_events as _completed_events
from ._rows import ended as _ended
from ._rows import event as _event
from ._rows import no_change as _no_change
from ._rows import pushed as _pushed
from ._rows import require as _require
from ._types import Delivery, Fail, Json, Outcome, Park, _Complete, _Continue
from ._values import (
    ACTIVE,
    BLOCKED,
    COMPENSATING,
    COMPLETED,
    EMPTY_MAILBOX,
    FAILED,
    PARKED,
    QUEUED,
    RUNNING,
    TERMINAL,
    Flow,
    InvalidTransition,
    Mailbox,
    Message,
    Received,
    Shape,
    Taken,
    Transition,
    mismatch,
)

__all__ = [
    "DETAILS",
    "block",
    "cancel",
    "compensated",
    "compensation_failed",
    "next_attempt",
    "resume",
    "start",
    "step_done",
    "step_failed",
    "step_name",
    "timeout",
    "wake",
]


# -------------------------------------------------------------------- transitions of the runner


def start(
    shape: Shape,
    flow_id: str,
    data: str,
    now: float,
    *,
    owner: str | None = None,
    trace: str | None = None,
    parent: str | None = None,
    deadline: float | None = None,
    queue_key: str | None = None,
    not_before: float | None = None,
) -> Transition:
    """A new flow at its first step, attempt 1, revision 1; `data` is canonical JSON text.
    `owner`: the engine that runs it, holding it (None: whichever engine takes it over);
    `trace`: the trace its steps' spans join (`Flow.trace`); `parent`: a child's parent;
    `deadline`: a whole flow's deadline (wall-clock seconds). A plan with limits
    (`Shape.limits`) starts its flows `QUEUED` with their `queue_key` ('' by default), held by
    nobody: the store admits them (SPEC 5.8); so does any plan a start with a `not_before`
    (a delayed start: its plan's queue keeps the time, docs/adr/0180)."""
    limited = shape.limits is not None or not_before is not None
    if limited:
        queue_key = "" if queue_key is None else queue_key
        owner = None
    elif queue_key is not None:
        raise ValueError(f"plan {shape.name!r} has no limits: its flows have no queue key")
    flow = Flow(
        flow_id=flow_id,
        plan=shape.name,
        version=shape.version,
        state=QUEUED if limited else RUNNING,
        step_index=0,
        step=shape.steps[0],
        attempt=1,
        data=data,
        revision=1,
        updated_at=now,
        owner=owner,
        released_at=None,
        created_at=now,
        trace=trace,
        parent=parent,
        deadline=deadline,
        queue_key=queue_key,
        not_before=not_before,
    )
    detail = {"plan": shape.name, "version": shape.version}
    return Transition(
        flow, EMPTY_MAILBOX, 0, events=(_event(flow, now, "started", None, None, detail),)
    )


def next_attempt(flow: Flow, now: float, failure: Json = None) -> Transition:
    """The step or compensation in progress runs again as attempt + 1 (a retry after an exception,
    or a re-run after a crash or close: written before it runs, so every re-run counts). A retry
    gives the `failure` of the attempt that raised (`_checks.failure`), recorded as an
    ``attempt_failed`` event of that attempt."""
    _require(flow.state in ACTIVE, flow, "next_attempt")
    new = _bump(flow, now, attempt=flow.attempt + 1)
    if failure is None:
        return Transition(new, EMPTY_MAILBOX, flow.revision)
    events = (_event(new, now, "attempt_failed", flow.step, flow.attempt, failure),)
    return Transition(new, EMPTY_MAILBOX, flow.revision, events=events)


def step_done(
    flow: Flow,
    mailbox: Mailbox,
    shape: Shape,
    outcome: Outcome | None,
    data: str,
    now: float,
) -> Transition:
    """The current step returned `outcome` (None = CONTINUE) with the flow's data now `data`.

    A park takes the first queued message at once (the flow runs on with it as `ctx.wake`), else
    parks with its deadline (``now + timeout``). `fail` compensates the completed steps.
    """
    _require(flow.state is RUNNING, flow, "step_done")
    step, attempt = flow.step, flow.attempt
    if outcome is None or isinstance(outcome, _Continue):
        new = _bump(
            flow, now, data=data, **_advance(flow, shape, _pushed(flow, shape), None, False)
        )
        events = (
            _event(new, now, "step", step, attempt, CONTINUE_DETAIL),
            *_completed_events(new, now),
        )
        return Transition(new, mailbox, flow.revision, events=events)
    if isinstance(outcome, _Complete):
        new = _bump(flow, now, data=data, step_index=flow.step_index, **_ended(COMPLETED))
        events = (
            _event(new, now, "step", step, attempt, COMPLETE_DETAIL),
            _event(new, now, "completed", None, None),
        )
        return Transition(new, mailbox, flow.revision, events=events)
    if isinstance(outcome, Park):
        stack = _pushed(flow, shape)
        deadline = None if outcome.timeout is None else now + outcome.timeout
        detail = {"outcome": "park", "timeout": outcome.timeout, "on_timeout": outcome.on_timeout}
        parked_detail = {"deadline": deadline, "on_timeout": outcome.on_timeout}
        if mailbox.queued:
            message = mailbox.queued[0]
            new = _bump(
                flow, now, data=data, **_advance(flow, shape, stack, message.payload, False)
            )
            events = (
                _event(new, now, "step", step, attempt, detail),
                _event(new, now, "parked", step, attempt, parked_detail),
                _event(new, now, "woken", step, None, {"message_id": message.message_id}),
                *_completed_events(new, now),
            )
            rest = Mailbox(mailbox.queued[1:], mailbox.seen)
            return Transition(new, rest, flow.revision, events=events, messages=(Taken(message),))
        new = _bump(
            flow,
            now,
            data=data,
            state=PARKED,
            stack=stack,
            wake=None,
            timed_out=False,
            park_deadline=deadline,
            on_timeout=outcome.on_timeout,
        )
        events = (
            _event(new, now, "step", step, attempt, detail),
            _event(new, now, "parked", step, attempt, parked_detail),
        )
        return Transition(new, mailbox, flow.revision, events=events)
    if isinstance(outcome, Fail):
        new = _bump(flow, now, data=data)
        log = [
            _event(new, now, "step", step, attempt, {"outcome": "fail", "reason": outcome.reason})
        ]
        new = _compensate(flow, shape, new, outcome.reason, now, log)
        return Transition(new, mailbox, flow.revision, events=tuple(log))
    raise InvalidTransition(f"step_done got {outcome!r}, which is not an outcome")


def step_failed(
    flow: Flow, shape: Shape | None, error: str, now: float, traceback: str | None = None
) -> Transition:
    """The current step failed for good (raised on its last attempt, returned a non-outcome, or
    left data that is not JSON): its changes are discarded and the flow compensates. The
    `traceback` of a last attempt that raised is kept in the step's event."""
    _require(flow.state is RUNNING, flow, "step_failed")
    new = _bump(flow, now)
    detail: dict[str, Json] = {"outcome": "error", "error": error}
    if traceback is not None:
        detail["traceback"] = traceback
    events = [_event(new, now, "step", flow.step, flow.attempt, detail)]
    new = _compensate(flow, shape, new, error, now, events)
    return Transition(new, EMPTY_MAILBOX, flow.revision, events=tuple(events))


def step_name(flow: Flow, shape: Shape | None) -> str | None:
    """The name of the flow's current step: `flow.step`, or, for a compensation whose cancel came
    without the plan (``step`` None), the plan's name for that index (None without a plan)."""
    if flow.step is not None or shape is None or not 0 <= flow.step_index < len(shape.steps):
        return flow.step
    return shape.steps[flow.step_index]


def compensated(flow: Flow, shape: Shape | None, data: str, now: float) -> Transition:
    """The compensation at the top of the stack succeeded (its data changes are kept): the next
    one runs, or the flow has failed once the stack is empty."""
    _require(flow.state is COMPENSATING and bool(flow.stack), flow, "compensated")
    stack = flow.stack[:-1]
    new = _bump(flow, now, data=data, stack=stack)
    events = [_event(new, now, "compensated", step_name(flow, shape), flow.attempt)]
    new = _compensate(flow, shape, new, flow.error or "compensating", now, events)
    return Transition(new, EMPTY_MAILBOX, flow.revision, events=tuple(events))


def compensation_failed(
    flow: Flow, error: str, now: float, shape: Shape | None = None, traceback: str | None = None
) -> Transition:
    """The compensation in progress raised on its last attempt: the flow is `BLOCKED` (an operator
    fixes the cause and calls `resume`). Nothing is lost: the stack is kept. `shape` names the
    step if the flow does not (see `step_name`)."""
    _require(flow.state is COMPENSATING, flow, "compensation_failed")
    name = step_name(flow, shape)
    reason = f"compensation of step {name!r} failed: {error}"
    new = _bump(flow, now, state=BLOCKED, blocked=reason, blocked_from=COMPENSATING)
    detail: dict[str, Json] = {"reason": reason}
    if traceback is not None:
        detail["traceback"] = traceback
    events = (_event(new, now, "blocked", name, flow.attempt, detail),)
    return Transition(new, EMPTY_MAILBOX, flow.revision, events=events)


# ---------------------------------------------------------------- transitions asked from outside


def wake(
    flow: Flow, mailbox: Mailbox, message: Message, shape: Shape | None, now: float
) -> Transition:
    """A message for the flow's mailbox; `delivery` says what became of it.

    DUPLICATE (its id was seen) comes before STALE (terminal, or compensating: it will not park
    again). A parked flow whose plan version is missing becomes BLOCKED and keeps the message
    (QUEUED). Time wins at the deadline: a wake at or after a parked flow's deadline (`now` >=
    `park_deadline`) does not resume it; the timeout runs first, in the same write, and the wake
    then meets the flow the timeout left (STALE if it compensates or ended, QUEUED if it runs
    on with ``on_timeout="continue"`` or blocks).
    """
    if message.message_id in mailbox.seen:
        return _no_change(flow, mailbox, Delivery.DUPLICATE)
    if flow.state in TERMINAL or flow.state is COMPENSATING:
        return _no_change(flow, mailbox, Delivery.STALE)
    if flow.state is PARKED and flow.park_deadline is not None and now >= flow.park_deadline:
        timed_out = timeout(flow, shape, now)
        after = wake(timed_out.flow, mailbox, message, shape, now)
        return Transition(
            after.flow,
            after.mailbox,
            flow.revision,
            events=(*timed_out.events, *after.events),
            messages=after.messages,
            delivery=after.delivery,
        )
    seen = mailbox.seen | {message.message_id}
    if flow.state is PARKED:
        reason = mismatch(flow, shape)
        if reason is None:
            assert shape is not None
            new = _bump(flow, now, **_advance(flow, shape, flow.stack, message.payload, False))
            events = (
                _event(new, now, "woken", flow.step, None, {"message_id": message.message_id}),
                *_completed_events(new, now),
            )
            return Transition(
                new,
                Mailbox(mailbox.queued, seen),
                flow.revision,
                events=events,
                messages=(Received(message, taken=True, at=now),),
                delivery=Delivery.RESUMED,
            )
        new = _bump(flow, now, state=BLOCKED, blocked=reason, blocked_from=PARKED)
        events = (_event(new, now, "blocked", flow.step, None, {"reason": reason}),)
    else:
        new, events = flow, ()
    return Transition(
        new,
        Mailbox((*mailbox.queued, message), seen),
        flow.revision,
        events=events,
        messages=(Received(message, taken=False, at=now),),
        delivery=Delivery.QUEUED,
    )


def timeout(
    flow: Flow, shape: Shape | None, now: float, *, expected: int | None = None
) -> Transition:
    """The park's deadline has come: compensate, or run the next step with `timed_out` set.

    Does nothing (``done=False``) unless the flow is parked with a deadline at or before `now`
    and, if given, still at revision `expected` (the revision the timer was armed for): a timer
    never fires after a wake was accepted. A missing plan version blocks the flow instead.
    """
    if (
        flow.state is not PARKED
        or flow.park_deadline is None
        or now < flow.park_deadline
        or (expected is not None and flow.revision != expected)
    ):
        return _no_change(flow, EMPTY_MAILBOX)
    detail = {"deadline": flow.park_deadline, "on_timeout": flow.on_timeout}
    reason = mismatch(flow, shape)
    if reason is not None:
        new = _bump(flow, now, state=BLOCKED, blocked=reason, blocked_from=PARKED)
        blocked = (_event(new, now, "blocked", flow.step, None, {"reason": reason}),)
        return Transition(new, EMPTY_MAILBOX, flow.revision, events=blocked)
    assert shape is not None
    if flow.on_timeout == "continue":
        new = _bump(flow, now, **_advance(flow, shape, flow.stack, None, True))
        events = (
            _event(new, now, "timed_out", flow.step, None, detail),
            *_completed_events(new, now),
        )
        return Transition(new, EMPTY_MAILBOX, flow.revision, events=events)
    error = f"step {flow.step!r} timed out while parked"
    new = _bump(flow, now, park_deadline=None, on_timeout=None)
    log = [_event(new, now, "timed_out", flow.step, None, detail)]
    new = _compensate(flow, shape, new, error, now, log)
    return Transition(new, EMPTY_MAILBOX, flow.revision, events=tuple(log))


def cancel(flow: Flow, shape: Shape | None, reason: str, now: float) -> Transition:
    """Stop a running or parked flow and compensate its completed steps (the running step, if
    any, did not complete: its changes are discarded and its compensation does not run).
    ``done=False`` for a flow that is terminal, compensating or blocked.

    Needs no plan: without `shape` (an engine that lacks the flow's version, or an operator) the
    cancel is recorded all the same, and the flow compensates from the top of its stack with that
    step not yet named (``step`` None): the first engine with the plan runs it under the plan's
    name (`step_name`), and an engine without the plan blocks it, resumable once the plan is
    back. The stack holds indexes, so nothing else needs the plan.

    A `QUEUED` flow that never ran ends `FAILED` at once with the reason (no step ran, nothing
    to compensate, SPEC 5.8); one queued by a resume (it ran before it was blocked) is left as
    a blocked one is (``done=False``)."""
    if flow.state is QUEUED and flow.blocked_from is None:
        ended = _bump(flow, now, error=reason, **_ended(FAILED))
        gone = (
            _event(ended, now, "cancelled", flow.step, None, {"reason": reason}),
            _event(ended, now, "failed", None, None, {"error": reason}),
        )
        return Transition(ended, EMPTY_MAILBOX, flow.revision, events=gone)
    if flow.state not in (RUNNING, PARKED):
        return _no_change(flow, EMPTY_MAILBOX)
    new = _bump(flow, now)
    events = [_event(new, now, "cancelled", flow.step, None, {"reason": reason})]
    new = _compensate(flow, shape, new, reason, now, events)
    return Transition(new, EMPTY_MAILBOX, flow.revision, events=tuple(events))


def block(flow: Flow, reason: str, now: float) -> Transition:
    """The engine cannot drive this flow (its plan version or step is missing): `BLOCKED`, with
    `reason`, until `resume`. ``done=False`` unless running, parked or compensating."""
    if flow.state not in (RUNNING, PARKED, COMPENSATING):
        return _no_change(flow, EMPTY_MAILBOX)
    new = _bump(flow, now, state=BLOCKED, blocked=reason, blocked_from=flow.state)
    events = (_event(new, now, "blocked", flow.step, None, {"reason": reason}),)
    return Transition(new, EMPTY_MAILBOX, flow.revision, events=events)


def resume(flow: Flow, mailbox: Mailbox, shape: Shape | None, now: float) -> Transition:
    """Re-drive a `BLOCKED` flow from the state it left: a step or compensation runs again as
    attempt + 1; a park is restored (and takes a queued message at once). ``done=False`` (nothing
    changes) if the flow is not blocked or `shape` still cannot drive it."""
    if flow.state is not BLOCKED or flow.blocked_from is None or mismatch(flow, shape) is not None:
        return _no_change(flow, mailbox)
    assert shape is not None
    back = flow.blocked_from
    cleared = {"state": back, "blocked": None, "blocked_from": None}
    if flow.queue_key is not None:  # a limited plan's: it waits for a slot, as a start does
        attempt = flow.attempt if back is PARKED else flow.attempt + 1
        queued = _bump(flow, now, state=QUEUED, blocked=None, attempt=attempt)
        back_in = (_event(queued, now, "resumed", flow.step, None, {"queued": True}),)
        return Transition(queued, mailbox, flow.revision, events=back_in)
    if back is PARKED and mailbox.queued:
        message = mailbox.queued[0]
        new = _bump(flow, now, **_advance(flow, shape, flow.stack, message.payload, False))
        events = (
            _event(new, now, "resumed", flow.step, None),
            _event(new, now, "woken", flow.step, None, {"message_id": message.message_id}),
            *_completed_events(new, now),
        )
        rest = Mailbox(mailbox.queued[1:], mailbox.seen)
        return Transition(new, rest, flow.revision, events=events, messages=(Taken(message),))
    if back is PARKED:
        new = _bump(flow, now, **cleared)
    else:
        new = _bump(flow, now, attempt=flow.attempt + 1, **cleared)
    events = (_event(new, now, "resumed", flow.step, new.attempt if back is not PARKED else None),)
    return Transition(new, mailbox, flow.revision, events=events)


def abandon(flow: Flow, shape: Shape | None, reason: str, by: str | None, now: float) -> Transition:
    """An operator gives up on a `BLOCKED` flow: it ends `FAILED` at once, without running the
    compensations left on its stack (the one that kept failing among them). The `abandoned`
    event records who (`by`), why (`reason`), why it was blocked and which compensations were
    skipped (the steps' names where `shape` knows them, else ``#index``), in the order they would
    have run. ``done=False`` (nothing changes) if the flow is not blocked. Needs no plan."""
    if flow.state is not BLOCKED:
        return _no_change(flow, EMPTY_MAILBOX)
    names = shape.steps if shape is not None else ()
    skipped: list[Json] = [names[i] if i < len(names) else f"#{i}" for i in reversed(flow.stack)]
    who = "an operator" if by is None else by
    error = f"abandoned by {who} while blocked ({flow.blocked}): {reason}"
    new = _bump(flow, now, error=error, **_ended(FAILED))
    detail: dict[str, Json] = {
        "reason": reason,
        "by": by,
        "blocked": flow.blocked,
        "skipped": skipped,
    }
    events = (
        _event(new, now, "abandoned", flow.step, None, detail),
        _event(new, now, "failed", None, None, {"error": error}),
    )
    return Transition(new, EMPTY_MAILBOX, flow.revision, events=events)
