"""The rows of a family (ADR 0139) and what reads them: `Kid`, `Brood`, `Move`, the phases, and
the questions the store and the engine ask of a spawn (`waits`, `runnable`, `cascade_due`,
`results`), with the small helpers the family's writes share.

PURE, like `_machine`. Split from `_family` (which keeps the module doc of the whole and
re-exports every public name) by concern: the rows here, the spawn and a child's end in
`_family_spawn`, the stops from outside in `_family_stops`, the parent's compensation of its
children in `_family_undo`, the rules of a family in `_family_check`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from ._children import ChildResult, OnFailure
from ._types import Delivery
from ._values import (
    COMPENSATING,
    COMPLETED,
    FAILED,
    PARKED,
    RUNNING,
    Flow,
    Mailbox,
    Message,
    Received,
    Shape,
    Transition,
)

__all__ = [
    "ACTIVE",
    "ENDED",
    "KEPT",
    "LEAVES",
    "OVER",
    "STOPPING",
    "UNDOING",
    "UNDONE",
    "WAITING",
    "Brood",
    "Kid",
    "Move",
    "ShapeOf",
    "cascade_due",
    "child_stack",
    "kid_at",
    "merged",
    "merged_changes",
    "next_undo",
    "results",
    "runnable",
    "waits",
    "wake_waiting",
]

# A child's status in its `Kid` row: kept (no flow row yet), active, or how it ended.
KEPT: Final = "kept"
ACTIVE: Final = "active"
ENDED: Final = {COMPLETED: "completed", FAILED: "failed"}

WAITING: Final = "waiting"
STOPPING: Final = "stopping"
OVER: Final = "over"
UNDOING: Final = "undoing"
UNDONE: Final = "undone"

#: What the parent gets of a child: the child's plan, by name and version (the store's registry).
ShapeOf = Callable[[str, int], Shape]


@attrs.frozen
class Kid:
    """One child's row in ``flow_children`` (see the module doc).

    `status` is `KEPT`, `ACTIVE`, ``"completed"`` or ``"failed"``; `data` is the data it was
    given until it ends, then its data at its end; `ended` its place in the order of ends (1 for
    the first; 0 while it has not ended); `stack` the steps its compensation runs (those that
    completed with a compensation) for a completed child, else empty; `undone` True once its
    parent's compensation compensated it (never twice).
    """

    index: int
    key: str
    flow_id: str
    plan: str
    version: int
    status: str
    data: str
    error: str | None = None
    ended: int = 0
    stack: tuple[int, ...] = ()
    undone: bool = False


@attrs.frozen
class Brood:
    """A spawn's row in ``flow_spawns`` (see the module doc).

    `active` children have a row and have not ended; `next_kept` is the index of the first kept
    child (`total` when none is kept); `ended` children have ended; `then` (STOPPING) is what
    the parent does once the last active one has ended, ``"compensate"`` or ``"continue"``, and
    `reason` why it stopped; `undoing` (UNDOING) the index of the child its parent's
    compensation is compensating. Invariant: ``ended + active + (total - next_kept) == total``.
    """

    parent: str
    step_index: int
    total: int
    max_running: int | None
    on_failure: OnFailure
    active: int
    next_kept: int
    ended: int = 0
    phase: str = WAITING
    then: OnFailure | None = None
    reason: str | None = None
    undoing: int | None = None


@attrs.frozen
class Move:
    """What one write of a family writes: the parent's row (a `Transition`, a compare-and-set
    on its revision, or None), the spawn's row, the `Kid` rows it changed (by index), and the
    children's rows (`Transition`s: a start has ``expected`` 0)."""

    parent: Transition | None
    brood: Brood
    kids: tuple[Kid, ...] = ()
    children: tuple[Transition, ...] = ()


# --------------------------------------------------------------------------------- helpers


#: What a row leaves behind when it moves past a park (with `_rows.ended` for an end).
LEAVES: Final[dict[str, Any]] = {
    "wake": None,
    "timed_out": False,
    "park_deadline": None,
    "on_timeout": None,
    "blocked": None,
    "blocked_from": None,
    "fan_in": None,
}


def child_stack(before: Flow, after: Flow, shape: Shape) -> tuple[int, ...]:
    """The compensation stack a child ended `COMPLETED` with: the stack of its last running
    row `before`, and its last step if that has a compensation (the machine empties the stack
    of a completed flow; the parent's compensation needs it)."""
    if after.state is not COMPLETED:
        return ()
    i = before.step_index
    return (*before.stack, i) if shape.compensable[i] and i not in before.stack else before.stack


def kid_at(kids: Sequence[Kid], index: int) -> Kid:
    """The `Kid` row of child `index` (the rows are kept in spawn order)."""
    kid = kids[index]
    assert kid.index == index
    return kid


def merged(kids: Sequence[Kid], changed: Sequence[Kid]) -> tuple[Kid, ...]:
    """`kids` as a write that changed `changed` leaves them."""
    out = list(kids)
    for k in changed:
        out[k.index] = k
    return tuple(out)


def merged_changes(first: Sequence[Kid], then: Sequence[Kid]) -> tuple[Kid, ...]:
    """The rows changed by `first` then `then` (the later change of a row wins), by index."""
    out = {k.index: k for k in first}
    out.update({k.index: k for k in then})
    return tuple(out[i] for i in sorted(out))


def next_undo(kids: Sequence[Kid]) -> Kid | None:
    """The completed child not yet compensated for its parent that ended last, if any."""
    best: Kid | None = None
    for k in kids:
        if k.status == "completed" and not k.undone and (best is None or k.ended > best.ended):
            best = k
    return best


# ---------------------------------------------------------------------------------- reading


def wake_waiting(flow: Flow, mailbox: Mailbox, message: Message, now: float) -> Transition:
    """A wake for a parent whose spawn waits for its children (`waits`): `QUEUED` for its next
    park (the row does not change), or `DUPLICATE` if its id was seen. The store asks this
    instead of `_machine.wake`, which would resume a parked flow with it."""
    if message.message_id in mailbox.seen:
        return Transition(flow, mailbox, flow.revision, delivery=Delivery.DUPLICATE, done=False)
    return Transition(
        flow,
        Mailbox((*mailbox.queued, message), mailbox.seen | {message.message_id}),
        flow.revision,
        messages=(Received(message, taken=False, at=now),),
        delivery=Delivery.QUEUED,
    )


def waits(parent: Flow, brood: Brood | None) -> bool:
    """Does the parent wait for the children of `brood` (parked at the spawning step)?"""
    return (
        brood is not None
        and brood.phase in (WAITING, STOPPING)
        and parent.state is PARKED
        and parent.step_index == brood.step_index
    )


def runnable(parent: Flow, brood: Brood | None) -> bool:
    """May an engine run the parent's step or compensation now? Not while its spawn waits for
    its children or compensates them."""
    if parent.state not in (RUNNING, COMPENSATING):
        return False
    return brood is None or brood.phase not in (WAITING, STOPPING, UNDOING)


def cascade_due(stopping: Brood, child: Flow, own: Brood | None) -> bool:
    """Must `child`, an active child of the spawn `stopping`, still be cancelled by its own
    `cancel_waiting` write? True while the spawn stops and the child waits for children of its
    own (`own`) that nothing has stopped to compensate yet: what the engine asks right after
    the write that stopped the spawn, and recovery and the fleet's scan after a crash between
    the two."""
    if stopping.phase != STOPPING or not waits(child, own):
        return False
    assert own is not None
    return not (own.phase == STOPPING and own.then == "compensate")


def results(brood: Brood, kids: Sequence[Kid]) -> dict[str, ChildResult]:
    """``ctx.children`` for the step after the spawn: key -> `ChildResult`, in spawn order; a
    kept child that never started (the spawn stopped) is a failed one with its given data."""
    out: dict[str, ChildResult] = {}
    for k in kids:
        if k.status == "completed":
            out[k.key] = ChildResult(k.flow_id, COMPLETED, json.loads(k.data), None)
        elif k.status == "failed":
            out[k.key] = ChildResult(k.flow_id, FAILED, json.loads(k.data), k.error)
        else:
            assert k.status == KEPT and brood.phase != WAITING, k
            why = f"not started: the spawn stopped ({brood.reason})"
            out[k.key] = ChildResult(k.flow_id, FAILED, json.loads(k.data), why)
    return out
