"""A parent's compensation undoes its children (ADR 0140): `compensating` holds a parent that
compensates past its spawn while its completed children are compensated, the last ended first;
`undo_next` starts the next one's, or lets the parent go on below the spawn.

PURE, like `_machine`; split from `_family` (its module doc tells the whole) by concern.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs

from . import _rows as fr
from ._family_rows import (
    LEAVES,
    OVER,
    UNDOING,
    UNDONE,
    Brood,
    Kid,
    Move,
    ShapeOf,
    merged,
    next_undo,
)
from ._values import COMPENSATING, EMPTY_MAILBOX, FAILED, Flow, Shape, Transition

__all__ = ["UNDONE_BECAUSE", "compensating", "undo_next", "undone"]

#: How the error of a child its parent's compensation compensated begins (`undone`).
UNDONE_BECAUSE: Final = "compensated because its parent "


def undone(flow: Flow) -> bool:
    """Is `flow` a child that its parent's compensation compensated (it had ended
    `COMPLETED`; its error says so)? For counting a child's end once (`FlowStatistics`)."""
    return flow.parent is not None and (flow.error or "").startswith(UNDONE_BECAUSE)


# ------------------------------------------------ the parent's compensation undoes its children


def compensating(
    t: Transition,
    brood: Brood,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    shape: Shape,
    shape_of: ShapeOf,
    now: float,
) -> Move:
    """The parent's transition `t` (any: a later step failed, a park timed out, a cancel, a
    compensation done) leaves it compensating or failed: if that passes the spawning step
    (its next compensation is below it, or none is left) while completed children of the spawn
    are not yet compensated, the parent waits at the spawning step (`UNDOING`) and the child
    that ended last starts compensating; the spawning step's own compensation runs after the
    last of them. Any other `t` is returned as it is. Cost: O(1) (the next child to compensate
    is the completed one with the highest `Kid.ended` not yet undone: an index in the store).

    A parent with several spawns: the store asks this for its spawns from the highest step
    index down, each on the transition the one above left (the `Move.parent` of the write that
    ended the last undo of a spawn leaves the parent below it, for the next spawn to hold)."""
    new = t.flow
    s = brood.step_index
    if brood.phase != OVER or new.state not in (COMPENSATING, FAILED):
        return Move(t, brood)
    if new.state is COMPENSATING and new.step_index > s:
        return Move(t, brood)
    if next_undo(kids) is None:
        return Move(t, attrs.evolve(brood, phase=UNDONE))
    assert new.error is not None
    events = tuple(e for e in t.events if e.kind != "failed")
    # `fan_in` marks the parent as waiting for its children's undo: no engine runs it meanwhile.
    leaves = {**LEAVES, "fan_in": s}
    held = attrs.evolve(
        new, state=COMPENSATING, step_index=s, step=shape.steps[s], attempt=1, **leaves
    )
    t = attrs.evolve(t, flow=held, events=events)
    b = attrs.evolve(brood, phase=UNDOING, reason=new.error)
    return undo_next(b, kids, children, held, shape, None, shape_of, now, parent_t=t)


def undo_next(
    brood: Brood,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    parent: Flow,
    shape: Shape,
    done: Kid | None,
    shape_of: ShapeOf,
    now: float,
    *,
    parent_t: Transition | None = None,
) -> Move:
    """The next completed child is compensated for its parent (`done`: the one whose
    compensation just ended, recorded), or, none left, the parent goes on below the spawn.
    A child whose stack is empty (nothing of it to compensate) ends `FAILED` in this write."""
    assert brood.reason is not None
    changed: list[Kid] = [] if done is None else [done]
    kids = merged(kids, changed)
    moved: list[Transition] = []
    error = f"{UNDONE_BECAUSE}{brood.parent!r} compensates: {brood.reason}"
    while (kid := next_undo(kids)) is not None:
        row = children[kid.index]
        assert row is not None
        reopened = fr.bump(row, now, error=error, stack=kid.stack)
        log = [fr.event(reopened, now, "undone_by_parent", None, None, {"parent": brood.parent})]
        reopened = fr.compensate(row, shape_of(kid.plan, kid.version), reopened, error, now, log)
        moved.append(Transition(reopened, EMPTY_MAILBOX, row.revision, events=tuple(log)))
        if reopened.state is COMPENSATING:
            return Move(
                parent_t, attrs.evolve(brood, undoing=kid.index), tuple(changed), tuple(moved)
            )
        kid = attrs.evolve(kid, status="failed", data=reopened.data, undone=True)
        changed = [k for k in changed if k.index != kid.index] + [kid]
        kids = merged(kids, [kid])
    b = attrs.evolve(brood, phase=UNDONE, undoing=None)
    held = parent if parent_t is None else parent_t.flow
    base = parent.revision if parent_t is None else parent_t.expected
    events = [] if parent_t is None else list(parent_t.events)
    new = held if parent_t is not None else fr.bump(held, now)
    error_of_parent = held.error or brood.reason
    new = fr.compensate(held, shape, new, error_of_parent, now, events)
    t = Transition(new, EMPTY_MAILBOX, base, events=tuple(events))
    return Move(t, b, tuple(sorted(changed, key=lambda k: k.index)), tuple(moved))
