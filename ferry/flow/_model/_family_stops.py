"""What stops a spawn from outside (ADR 0139): its timeout (`timed_out`), a cancel of the
waiting parent (`cancel_waiting`), and `cancel`, the one cancel of a flow that may have a spawn.

PURE, like `_machine`; split from `_family` (its module doc tells the whole) by concern.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from . import _machine as fm
from . import _rows as fr
from ._family_rows import STOPPING, WAITING, Brood, Kid, Move, ShapeOf, waits
from ._family_spawn import maybe_on, stop
from ._family_undo import compensating
from ._values import EMPTY_MAILBOX, PARKED, Flow, Shape, Transition

__all__ = ["cancel", "cancel_waiting", "timed_out"]


# ------------------------------------------------------------- from outside: timeout, cancel


def timed_out(
    brood: Brood,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    parent: Flow,
    shape: Shape,
    shape_of: ShapeOf,
    now: float,
    *,
    expected: int | None = None,
    nested: Collection[int] = (),
) -> Move:
    """The spawn's timeout has come (the parent's park deadline, armed for revision
    `expected`): the spawn stops with reason ``"timeout"`` and then acts as `on_failure` says.
    Nothing (``done=False``) unless the parent still waits for its children at that deadline."""
    if (
        brood.phase != WAITING
        or parent.state is not PARKED
        or parent.park_deadline is None
        or now < parent.park_deadline
        or (expected is not None and parent.revision != expected)
    ):
        return Move(Transition(parent, EMPTY_MAILBOX, parent.revision, done=False), brood)
    b, stopped, cancels = stop(
        brood, kids, children, brood.on_failure, "timeout", shape_of, now, nested
    )
    detail = {"deadline": parent.park_deadline, "on_failure": brood.on_failure}
    event = fr.event(parent, now, "timed_out", parent.step, None, detail)
    return maybe_on(b, kids, children, parent, shape, shape_of, now, stopped, cancels, event)


def cancel_waiting(
    brood: Brood,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    parent: Flow,
    shape: Shape,
    reason: str,
    shape_of: ShapeOf,
    now: float,
    *,
    nested: Collection[int] = (),
) -> Move:
    """`cancel` of a parent that waits for its children: it cancels every active child (each
    compensates; a child in `nested`, one that waits for children of its own, is cancelled
    the same way in a later write of its own: `cascade_due`), starts no kept one, and
    compensates once the last has ended. A spawn already stopped by a timeout
    with ``"continue"`` now compensates. ``done=False`` if the parent is not waiting or was
    cancelled already."""
    if parent.state is not PARKED or brood.phase not in (WAITING, STOPPING):
        return Move(Transition(parent, EMPTY_MAILBOX, parent.revision, done=False), brood)
    if brood.phase == STOPPING and brood.then == "compensate":
        return Move(Transition(parent, EMPTY_MAILBOX, parent.revision, done=False), brood)
    b, stopped, cancels = stop(brood, kids, children, "compensate", reason, shape_of, now, nested)
    event = fr.event(parent, now, "cancelled", parent.step, None, {"reason": reason})
    return maybe_on(b, kids, children, parent, shape, shape_of, now, stopped, cancels, event)


def cancel(
    parent: Flow,
    brood: Brood | None,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    shape: Shape,
    reason: str,
    shape_of: ShapeOf,
    now: float,
    *,
    nested: Collection[int] = (),
) -> Move | Transition:
    """`engine.cancel` (and a whole flow's deadline, with reason ``"deadline"``) of a flow that
    may have a spawn (`brood`, its latest): `cancel_waiting` if it waits for its children; else
    the machine's `cancel`, held by `compensating` if it compensates past the spawn. A flow with
    no spawn gets the machine's `Transition` as it is."""
    if brood is not None and waits(parent, brood):
        return cancel_waiting(
            brood, kids, children, parent, shape, reason, shape_of, now, nested=nested
        )
    t = fm.cancel(parent, shape, reason, now)
    if brood is None or not t.done:
        return t
    return compensating(t, brood, kids, children, shape, shape_of, now)
