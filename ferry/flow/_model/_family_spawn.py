"""A family's spawn and its children's ends (ADR 0139): `spawned` writes the spawn, `child_ended`
records an end for its parent, `go_on` moves the parent on after the last; `stop` (the spawn
stops) and `maybe_on` are what the stops of `_family_stops` share with them.

PURE, like `_machine`; split from `_family` (its module doc tells the whole) by concern.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs

from . import _machine as fm
from . import _rows as fr
from ._children import OnFailure, child_id
from ._family_rows import (
    ACTIVE,
    ENDED,
    KEPT,
    OVER,
    STOPPING,
    UNDOING,
    WAITING,
    Brood,
    Kid,
    Move,
    ShapeOf,
    child_stack,
    kid_at,
    merged,
    merged_changes,
)
from ._family_undo import compensating, undo_next
from ._types import Event, Json, Park
from ._values import (
    COMPLETED,
    EMPTY_MAILBOX,
    FAILED,
    PARKED,
    TERMINAL,
    Flow,
    Shape,
    Transition,
)

__all__ = ["child_ended", "go_on", "maybe_on", "spawned", "stop"]


# ------------------------------------------------------------------------------- the spawn


def spawned(
    parent: Flow,
    shape: Shape,
    children: Sequence[tuple[str, Shape, str]],
    *,
    max_running: int | None,
    timeout: float | None,
    on_failure: OnFailure,
    data: str,
    now: float,
    owner: str | None = None,
    trace: str | None = None,
) -> Move:
    """The spawning step returned a spawn of `children` (key, the child's plan, its data as
    canonical JSON text) with the parent's data now `data`: ONE write of the step's outcome
    (the parent `PARKED`, its deadline the spawn's `timeout`), the spawn's row, every child's
    `Kid` row and the first rows of those `max_running` lets start (held by `owner`, the
    engine that writes; in the trace `trace`, the spawn's span: a kept child started later
    takes the trace of the sibling whose end starts it, the same). A wake queued for the
    parent stays queued (it is for its next park). Cost: O(children)."""
    n = len(children)
    assert n >= 1
    t = fm.step_done(parent, EMPTY_MAILBOX, shape, Park(timeout, on_failure), data, now)
    s = parent.step_index
    step, parked = t.events
    assert step.kind == "step" and parked.kind == "parked"
    detail = {
        "outcome": "spawn",
        "children": n,
        "max_running": max_running,
        "timeout": timeout,
        "on_failure": on_failure,
    }
    t = attrs.evolve(t, events=(attrs.evolve(step, detail=detail), parked))
    first = n if max_running is None else min(n, max_running)
    kids: list[Kid] = []
    starts: list[Transition] = []
    for i, (key, child_shape, child_data) in enumerate(children):
        if child_shape.limits is not None and child_shape.limits.key is not None:
            raise ValueError(
                f"children of plan {child_shape.name!r} cannot be spawned yet: its limits have a"
                " key function, and a kept child is started where no key function runs"
                " (give the child plan limits without key=)"
            )
        fid = child_id(parent.flow_id, s, key)
        if i < first:
            starts.append(
                fm.start(
                    child_shape,
                    fid,
                    child_data,
                    now,
                    owner=owner,
                    parent=parent.flow_id,
                    trace=trace,
                )
            )
        status = ACTIVE if i < first else KEPT
        kids.append(Kid(i, key, fid, child_shape.name, child_shape.version, status, child_data))
    brood = Brood(parent.flow_id, s, n, max_running, on_failure, active=first, next_kept=first)
    return Move(t, brood, tuple(kids), tuple(starts))


# ------------------------------------------------------------------------ a child's end


def child_ended(
    brood: Brood,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    parent: Flow,
    parent_shape: Shape,
    index: int,
    before: Flow,
    after: Transition,
    shape_of: ShapeOf,
    now: float,
    *,
    nested: Collection[int] = (),
) -> Move:
    """Child `index` ended (`after`, its last transition from its row `before`, ends it
    `COMPLETED` or `FAILED`): what the same write records for its family.

    Its `Kid` row and the spawn's counters; with ``on_failure="compensate"`` a failure stops
    the spawn (cancels the other active children; no kept one starts); else the next kept child
    starts. The last end moves the parent on (`go_on`). The end of a child that its parent's
    compensation compensated (UNDOING) starts the next one's, or moves the parent on.

    Reads the ending `Kid`, the next kept one and, to stop the spawn, the active children's rows
    (`children`, by index: only those are read); the parent's row is written only by the last
    end. Cost: O(1), or O(active) for the end that stops the spawn.
    """
    end = after.flow
    assert end.state in TERMINAL, end
    kid = kid_at(kids, index)
    children = (*children[:index], end, *children[index + 1 :])  # as this write leaves it
    if brood.phase == UNDOING and brood.undoing == index:
        done = attrs.evolve(
            kid, status=ENDED[end.state], data=end.data, error=end.error, undone=True
        )
        return undo_next(brood, kids, children, parent, parent_shape, done, shape_of, now)
    assert kid.status == ACTIVE, kid
    ended = brood.ended + 1
    stack = child_stack(before, end, shape_of(kid.plan, kid.version))
    done = attrs.evolve(
        kid, status=ENDED[end.state], data=end.data, error=end.error, ended=ended, stack=stack
    )
    changed = [done]
    moved: list[Transition] = []
    b = attrs.evolve(brood, active=brood.active - 1, ended=ended)
    if b.phase == WAITING and end.state is FAILED and b.on_failure == "compensate":
        reason = f"child {kid.key!r} failed: {end.error}"
        b, stopped, moved = stop(
            b, merged(kids, changed), children, "compensate", reason, shape_of, now, nested
        )
        changed += stopped
    elif b.phase == WAITING and b.next_kept < b.total:
        nxt = kid_at(kids, b.next_kept)
        nxt_shape = shape_of(nxt.plan, nxt.version)
        start = fm.start(
            nxt_shape, nxt.flow_id, nxt.data, now, parent=brood.parent, trace=end.trace
        )
        moved.append(start)
        changed.append(attrs.evolve(nxt, status=ACTIVE))
        b = attrs.evolve(b, active=b.active + 1, next_kept=b.next_kept + 1)
    return maybe_on(b, kids, children, parent, parent_shape, shape_of, now, changed, moved)


def maybe_on(
    b: Brood,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    parent: Flow,
    shape: Shape,
    shape_of: ShapeOf,
    now: float,
    changed: Sequence[Kid],
    moved: Sequence[Transition],
    event: Event | None = None,
) -> Move:
    """The write goes on with `changed` kids and `moved` children; if no child is active any
    more (none kept, or the spawn stopped) the parent moves on in it too (`go_on`), with
    `event` (what this write did to the parent: a cancel, a timeout) first in its history."""
    if b.active == 0 and (b.next_kept == b.total or b.phase == STOPPING):
        after = list(children)
        for t in moved:
            i = next(k.index for k in kids if k.flow_id == t.flow.flow_id)
            after[i] = t.flow
        m = go_on(b, merged(kids, changed), after, parent, shape, shape_of, now)
        assert m.parent is not None
        if event is not None:
            e = attrs.evolve(event, revision=m.parent.flow.revision)
            m = attrs.evolve(m, parent=attrs.evolve(m.parent, events=(e, *m.parent.events)))
        return Move(m.parent, m.brood, merged_changes(changed, m.kids), (*moved, *m.children))
    if event is None:
        return Move(None, b, tuple(changed), tuple(moved))
    new = (
        fr.bump(parent, now, park_deadline=None)
        if event.kind == "timed_out"
        else fr.bump(parent, now)
    )
    e = attrs.evolve(event, revision=new.revision)
    t = Transition(new, EMPTY_MAILBOX, parent.revision, events=(e,))
    return Move(t, b, tuple(changed), tuple(moved))


def stop(
    brood: Brood,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    then: OnFailure,
    reason: str,
    shape_of: ShapeOf,
    now: float,
    nested: Collection[int] = (),
) -> tuple[Brood, list[Kid], list[Transition]]:
    """The spawn stops: every active child is cancelled with `reason`; no kept one starts.
    A cancelled child compensates and ends as a failed child (`child_ended`), or, with nothing
    to compensate, ends in this write (recorded here). The children in `nested` (by index)
    wait for children of their own: each is cancelled by its own `cancel_waiting`, in a later
    write (`cascade_due` finds them), so that a tree of any depth is cancelled level by level
    in bounded writes. A blocked or compensating child is left to end as it will."""
    b = attrs.evolve(brood, phase=STOPPING, then=then, reason=reason)
    changed: list[Kid] = []
    cancels: list[Transition] = []
    for kid in kids:
        row = children[kid.index]
        if kid.status != ACTIVE or row is None or kid.index in nested:
            continue
        t = fm.cancel(row, shape_of(kid.plan, kid.version), reason, now)
        if not t.done:
            continue
        cancels.append(t)
        end = t.flow
        if end.state in TERMINAL:
            ended = b.ended + 1
            changed.append(
                attrs.evolve(
                    kid, status=ENDED[end.state], data=end.data, error=end.error, ended=ended
                )
            )
            b = attrs.evolve(b, active=b.active - 1, ended=ended)
    return b, changed, cancels


def go_on(
    brood: Brood,
    kids: Sequence[Kid],
    children: Sequence[Flow | None],
    parent: Flow,
    shape: Shape,
    shape_of: ShapeOf,
    now: float,
    *,
    changed: tuple[Kid, ...] = (),
    moved: tuple[Transition, ...] = (),
) -> Move:
    """Every child has ended (none active, none kept, or the spawn stopped): the parent, parked
    at the spawning step, runs its next step (or is completed after its last), reading the
    results in ``ctx.children``, or compensates (a child failed, a cancel, a timeout with
    ``on_failure="compensate"``; its completed children first, `compensating`)."""
    assert parent.state is PARKED and parent.step_index == brood.step_index, (
        f"the parent {parent.flow_id!r} is {parent.state} at step {parent.step_index}: it does"
        f" not wait for its spawn at step {brood.step_index}"
    )
    assert brood.active == 0 and brood.phase in (WAITING, STOPPING), brood
    failed = sum(1 for k in kids if k.status == "failed")
    detail: dict[str, Json] = {"ended": brood.ended, "failed": failed}
    if brood.phase == STOPPING:
        detail["stopped"] = brood.reason
    b = attrs.evolve(brood, phase=OVER)
    if brood.phase == WAITING or brood.then == "continue":
        new = fr.bump(parent, now, **fr.advance(parent, shape, parent.stack, None, False))
        if new.state is not COMPLETED:  # the next step reads the results (`ctx.children`)
            new = fr.replace(new, fan_in=brood.step_index)
        events = [fr.event(new, now, "children_ended", parent.step, None, detail)]
        events.extend(fr.completed_events(new, now))
        t = Transition(new, EMPTY_MAILBOX, parent.revision, events=tuple(events))
        return Move(t, b, changed, moved)
    assert brood.reason is not None
    t = fm.cancel(parent, shape, brood.reason, now)
    assert t.done
    first, *rest = t.events
    t = attrs.evolve(t, events=(attrs.evolve(first, kind="children_ended", detail=detail), *rest))
    kids_now = merged(kids, changed)
    m = compensating(t, b, kids_now, children, shape, shape_of, now)
    return Move(m.parent, m.brood, merged_changes(changed, m.kids), (*moved, *m.children))
