"""Edits of a flow's row that the transitions share: its next revision, the changes that end
it, move it past a step or start its compensation, its history events.

PURE, like `_machine` (its one user, with `_holders`): no trio, no clock, no I/O. Split from the
machine by concern so that each transition module reads as the rule it is; the names here are
the machine's building blocks, not a public face.
"""

from __future__ import annotations

import operator
from typing import Any, Final

import attrs

from ._types import Delivery, Event, Json, State
from ._values import (
    COMPENSATING,
    COMPLETED,
    FAILED,
    RUNNING,
    Flow,
    InvalidTransition,
    Mailbox,
    Shape,
    Transition,
)

__all__ = [
    "COMPLETE_DETAIL",
    "CONTINUE_DETAIL",
    "DETAILS",
    "advance",
    "bump",
    "compensate",
    "completed_events",
    "ended",
    "event",
    "no_change",
    "pushed",
    "replace",
    "require",
]

#: The details of the history events that are the same for every flow: one object each, shared
#: by every event that has it (never changed), so that a store may encode each once.
CONTINUE_DETAIL: Final[dict[str, Json]] = {"outcome": "continue"}
COMPLETE_DETAIL: Final[dict[str, Json]] = {"outcome": "complete"}
DETAILS: Final = (CONTINUE_DETAIL, COMPLETE_DETAIL)


def event(
    flow: Flow, now: float, kind: str, step: str | None, attempt: int | None, detail: Json = None
) -> Event:
    return Event(
        revision=flow.revision, at=now, kind=kind, step=step, attempt=attempt, detail=detail
    )


def require(cond: bool, flow: Flow, what: str) -> None:
    if not cond:
        raise InvalidTransition(f"{what} is not possible for flow {flow.flow_id!r} in {flow.state}")


def no_change(flow: Flow, mailbox: Mailbox, delivery: Delivery | None = None) -> Transition:
    return Transition(flow, mailbox, flow.revision, delivery=delivery, done=False)


# `attrs.evolve` looks every field up by name on every call; a transition's copy of the row is
# made here instead from the fields in their order, positionally (about half the cost). Flow's
# fields are all plain `__init__` arguments of their own name, in this order.
_FLOW_FIELDS: Final = tuple(a.name for a in attrs.fields(Flow))
assert all(a.init and a.alias == a.name for a in attrs.fields(Flow))
_flow_values: Final = operator.attrgetter(*_FLOW_FIELDS)
_FLOW_INDEX: Final = {name: i for i, name in enumerate(_FLOW_FIELDS)}
_REVISION: Final = _FLOW_INDEX["revision"]
_UPDATED_AT: Final = _FLOW_INDEX["updated_at"]


def replace(flow: Flow, **changes: Any) -> Flow:
    """`attrs.evolve(flow, **changes)` for `Flow`, cheaper; a name Flow lacks raises KeyError."""
    values = list(_flow_values(flow))
    for name, value in changes.items():
        values[_FLOW_INDEX[name]] = value
    return Flow(*values)


def bump(flow: Flow, now: float, **changes: Any) -> Flow:
    """`flow` at its next revision, written at `now`, with `changes`."""
    values = list(_flow_values(flow))
    values[_REVISION] = flow.revision + 1
    values[_UPDATED_AT] = now
    for name, value in changes.items():
        values[_FLOW_INDEX[name]] = value
    return Flow(*values)


def ended(state: State) -> dict[str, Any]:
    return {
        "state": state,
        "step": None,
        "stack": (),
        "wake": None,
        "timed_out": False,
        "park_deadline": None,
        "on_timeout": None,
        "blocked": None,
        "blocked_from": None,
        "fan_in": None,
    }


def advance(
    flow: Flow, shape: Shape, stack: tuple[int, ...], wake: str | None, timed_out: bool
) -> dict[str, Any]:
    """The changes that move a flow past its current step (to the next one, or to completed)."""
    i = flow.step_index + 1
    if i >= len(shape.steps):
        return {**ended(COMPLETED), "step_index": flow.step_index}
    return {
        "state": RUNNING,
        "step_index": i,
        "step": shape.steps[i],
        "attempt": 1,
        "stack": stack,
        "wake": wake,
        "timed_out": timed_out,
        "park_deadline": None,
        "on_timeout": None,
        "blocked": None,
        "blocked_from": None,
        "fan_in": None,
    }


def completed_events(new: Flow, now: float) -> tuple[Event, ...]:
    return (event(new, now, "completed", None, None),) if new.state is COMPLETED else ()


def compensate(
    flow: Flow,
    shape: Shape | None,
    new: Flow,
    error: str,
    now: float,
    events: list[Event],
) -> Flow:
    """`new` (already bumped) starts compensating its stack, or fails at once if it is empty.
    Appends the `failed` event when it fails."""
    if new.stack:
        top = new.stack[-1]
        # Without the plan (a cancel through an engine or operator that lacks its version) the
        # top's name is unknown: it stays None until an engine with the plan runs it.
        step = shape.steps[top] if shape is not None and top < len(shape.steps) else None
        return replace(
            new,
            state=COMPENSATING,
            step_index=top,
            step=step,
            attempt=1,
            error=error,
            wake=None,
            timed_out=False,
            park_deadline=None,
            on_timeout=None,
            blocked=None,
            blocked_from=None,
            fan_in=None,
        )
    failed = replace(new, error=error, **ended(FAILED))
    events.append(event(failed, now, "failed", None, None, {"error": error}))
    return failed


def pushed(flow: Flow, shape: Shape) -> tuple[int, ...]:
    """The stack once the current step has completed."""
    i = flow.step_index
    return (*flow.stack, i) if shape.compensable[i] else flow.stack
