"""Child flows, the pure transitions of a family: a parent, its spawn, its children (ADR 0139).

PURE, like `_machine`: no trio, no clock, no I/O; time comes in as `now`. A child is an ordinary
flow, driven by `_machine` like any other; this module adds what ties it to its parent. Each
function here is ONE write of the store (one transaction): it takes the rows that transaction
reads and returns every row it writes (`Move`). The next round wires them into the store and the
runner; until then only the model check (tests/model/children.py) drives them.

The rows (one table each; docs/adr/0139 gives their columns and keys)
--------------------------------------------------------------------
- the parent: its `Flow` row, `PARKED` at the spawning step from the spawn until its last child
  ends (`park_deadline` the spawn's timeout, `on_timeout` its `on_failure`);
- `Brood`: the spawn's own row (``flow_spawns``, keyed by parent and step index): the count of
  children still active, the index of the first kept one, the count that ended, the phase. A
  child's end changes only this row's counters and its own `Kid` row: O(1), never a read of
  its brothers;
- `Kid`: one row per child (``flow_children``, keyed by parent, step index and child index): its
  status, and from its end its data, error, place in the order of ends and the compensation
  stack it ended with (what its parent's compensation runs);
- each child's own `Flow` row (none while it is kept).

Phases of a spawn (`Brood.phase`) and the functions that move them
-----------------------------------------------------------------
::

    spawned --------------------------------> WAITING (the first `max_running` children started)
    WAITING --child_ended-------------------> WAITING (the next kept child started), or, the last
                                              one ended: OVER (the parent runs its next step)
    WAITING --child_ended(FAILED, compensate)
            --timed_out / cancel_waiting----> STOPPING (the active children cancelled, no kept
                                              one starts)
    STOPPING --child_ended (the last)-------> OVER (the parent compensates, or, a timeout with
                                              on_failure="continue", runs its next step)
    OVER --compensating (the parent compensates past the spawn)
                                           -> UNDOING (its completed children compensated, the
                                              last ended first, one at a time) | UNDONE (none)
    UNDOING --child_ended (the child being undone)
                                           -> UNDOING (the next one) | UNDONE (the parent goes
                                              on: the spawning step's own compensation, or the
                                              steps below it, or FAILED)

While a spawn is UNDOING its parent's row is `COMPENSATING` at the spawning step and runs
nothing (`runnable`): the store reads the spawn row with the parent's (one key lookup). Its
stack may then lack the spawning step (a spawning step without a compensation of its own):
`_invariants.check_invariants` holds for the parent at every other moment, and `check_family`
states the rules of a family at every moment.

From outside: `cancel` (the one cancel of a flow that may have a spawn, also for a whole flow's
deadline), `cascade_due` (a child that waits for children of its own, left by a stop for its
own cancel), `wake_waiting` (a wake for a waiting parent is queued for its next park), and
`results` (``ctx.children``). A child that BLOCKS has not ended: its parent waits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import attrs

from . import _machine as fm
from ._children import ChildResult, OnFailure, child_id
from ._types import Delivery, Event, Json, Park
from ._values import (
    COMPENSATING,
    COMPLETED,
    EMPTY_MAILBOX,
    FAILED,
    PARKED,
    RUNNING,
    TERMINAL,
    Flow,
    InvariantError,
    Mailbox,
    Message,
    Received,
    Shape,
    Transition,
)

__all__ = [
    "ACTIVE",
    "KEPT",
    "OVER",
    "STOPPING",
    "UNDOING",
    "UNDONE",
    "WAITING",
    "Brood",
    "Kid",
    "Move",
    "cancel",
    "cancel_waiting",
    "cascade_due",
    "check_family",
    "child_ended",
    "child_stack",
    "compensating",
    "go_on",
    "results",
    "runnable",
    "spawned",
    "timed_out",
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


def _event(flow: Flow, now: float, kind: str, step: str | None, detail: Json = None) -> Event:
    return Event(revision=flow.revision, at=now, kind=kind, step=step, attempt=None, detail=detail)


def _bump(flow: Flow, now: float, **changes: Any) -> Flow:
    return attrs.evolve(flow, revision=flow.revision + 1, updated_at=now, **changes)


_LEAVES: Final[dict[str, Any]] = {
    "wake": None,
    "timed_out": False,
    "park_deadline": None,
    "on_timeout": None,
    "blocked": None,
    "blocked_from": None,
}


def _compensate_from(flow: Flow, shape: Shape, error: str, now: float, events: list[Event]) -> Flow:
    """`flow` (bumped) compensates the top of its stack, or has failed once it is empty (the
    rule of `_machine`'s compensation, for a parent whose children are compensated)."""
    if flow.stack:
        top = flow.stack[-1]
        return attrs.evolve(
            flow,
            state=COMPENSATING,
            step_index=top,
            step=shape.steps[top],
            attempt=1,
            error=error,
            **_LEAVES,
        )
    failed = attrs.evolve(flow, state=FAILED, step=None, error=error, **_LEAVES)
    events.append(_event(failed, now, "failed", None, {"error": error}))
    return failed


def child_stack(before: Flow, after: Flow, shape: Shape) -> tuple[int, ...]:
    """The compensation stack a child ended `COMPLETED` with: the stack of its last running
    row `before`, and its last step if that has a compensation (the machine empties the stack
    of a completed flow; the parent's compensation needs it)."""
    if after.state is not COMPLETED:
        return ()
    i = before.step_index
    return (*before.stack, i) if shape.compensable[i] and i not in before.stack else before.stack


def _kid_at(kids: Sequence[Kid], index: int) -> Kid:
    kid = kids[index]
    assert kid.index == index
    return kid


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
) -> Move:
    """The spawning step returned a spawn of `children` (key, the child's plan, its data as
    canonical JSON text) with the parent's data now `data`: ONE write of the step's outcome
    (the parent `PARKED`, its deadline the spawn's `timeout`), the spawn's row, every child's
    `Kid` row and the first rows of those `max_running` lets start (held by `owner`, the
    engine that writes). A wake queued for the parent stays queued (it is for its next park).
    Cost: O(children)."""
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
        fid = child_id(parent.flow_id, s, key)
        if i < first:
            starts.append(fm.start(child_shape, fid, child_data, now, owner=owner))
        status = ACTIVE if i < first else KEPT
        kids.append(Kid(i, key, fid, child_shape.name, child_shape.version, status, child_data))
    brood = Brood(parent.flow_id, s, n, max_running, on_failure, active=first, next_kept=first)
    return Move(t, brood, tuple(kids), tuple(starts))


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
    kid = _kid_at(kids, index)
    children = (*children[:index], end, *children[index + 1 :])  # as this write leaves it
    if brood.phase == UNDOING and brood.undoing == index:
        done = attrs.evolve(
            kid, status=ENDED[end.state], data=end.data, error=end.error, undone=True
        )
        return _undo_next(brood, kids, children, parent, parent_shape, done, shape_of, now)
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
        b, stopped, moved = _stop(
            b, _merged(kids, changed), children, "compensate", reason, shape_of, now, nested
        )
        changed += stopped
    elif b.phase == WAITING and b.next_kept < b.total:
        nxt = _kid_at(kids, b.next_kept)
        moved.append(fm.start(shape_of(nxt.plan, nxt.version), nxt.flow_id, nxt.data, now))
        changed.append(attrs.evolve(nxt, status=ACTIVE))
        b = attrs.evolve(b, active=b.active + 1, next_kept=b.next_kept + 1)
    return _maybe_on(b, kids, children, parent, parent_shape, shape_of, now, changed, moved)


def _maybe_on(
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
        m = go_on(b, _merged(kids, changed), after, parent, shape, shape_of, now)
        assert m.parent is not None
        if event is not None:
            e = attrs.evolve(event, revision=m.parent.flow.revision)
            m = attrs.evolve(m, parent=attrs.evolve(m.parent, events=(e, *m.parent.events)))
        return Move(m.parent, m.brood, _merged_changes(changed, m.kids), (*moved, *m.children))
    if event is None:
        return Move(None, b, tuple(changed), tuple(moved))
    new = (
        _bump(parent, now, park_deadline=None) if event.kind == "timed_out" else _bump(parent, now)
    )
    e = attrs.evolve(event, revision=new.revision)
    t = Transition(new, EMPTY_MAILBOX, parent.revision, events=(e,))
    return Move(t, b, tuple(changed), tuple(moved))


def _stop(
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
        i = parent.step_index + 1
        if i >= len(shape.steps):
            new = _bump(parent, now, state=COMPLETED, step=None, stack=(), **_LEAVES)
            events = [_event(new, now, "children_ended", parent.step, detail)]
            events.append(_event(new, now, "completed", None))
        else:
            new = _bump(
                parent, now, state=RUNNING, step_index=i, step=shape.steps[i], attempt=1, **_LEAVES
            )
            events = [_event(new, now, "children_ended", parent.step, detail)]
        t = Transition(new, EMPTY_MAILBOX, parent.revision, events=tuple(events))
        return Move(t, b, changed, moved)
    assert brood.reason is not None
    t = fm.cancel(parent, shape, brood.reason, now)
    assert t.done
    first, *rest = t.events
    t = attrs.evolve(t, events=(attrs.evolve(first, kind="children_ended", detail=detail), *rest))
    kids_now = _merged(kids, changed)
    m = compensating(t, b, kids_now, children, shape, shape_of, now)
    return Move(m.parent, m.brood, _merged_changes(changed, m.kids), (*moved, *m.children))


def _merged(kids: Sequence[Kid], changed: Sequence[Kid]) -> tuple[Kid, ...]:
    out = list(kids)
    for k in changed:
        out[k.index] = k
    return tuple(out)


def _merged_changes(first: Sequence[Kid], then: Sequence[Kid]) -> tuple[Kid, ...]:
    out = {k.index: k for k in first}
    out.update({k.index: k for k in then})
    return tuple(out[i] for i in sorted(out))


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
    b, stopped, cancels = _stop(
        brood, kids, children, brood.on_failure, "timeout", shape_of, now, nested
    )
    detail = {"deadline": parent.park_deadline, "on_failure": brood.on_failure}
    event = _event(parent, now, "timed_out", parent.step, detail)
    return _maybe_on(b, kids, children, parent, shape, shape_of, now, stopped, cancels, event)


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
    b, stopped, cancels = _stop(brood, kids, children, "compensate", reason, shape_of, now, nested)
    event = _event(parent, now, "cancelled", parent.step, {"reason": reason})
    return _maybe_on(b, kids, children, parent, shape, shape_of, now, stopped, cancels, event)


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
    if _next_undo(kids) is None:
        return Move(t, attrs.evolve(brood, phase=UNDONE))
    assert new.error is not None
    events = tuple(e for e in t.events if e.kind != "failed")
    held = attrs.evolve(
        new, state=COMPENSATING, step_index=s, step=shape.steps[s], attempt=1, **_LEAVES
    )
    t = attrs.evolve(t, flow=held, events=events)
    b = attrs.evolve(brood, phase=UNDOING, reason=new.error)
    return _undo_next(b, kids, children, held, shape, None, shape_of, now, parent_t=t)


def _next_undo(kids: Sequence[Kid]) -> Kid | None:
    best: Kid | None = None
    for k in kids:
        if k.status == "completed" and not k.undone and (best is None or k.ended > best.ended):
            best = k
    return best


def _undo_next(
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
    kids = _merged(kids, changed)
    moved: list[Transition] = []
    error = f"compensated because its parent {brood.parent!r} compensates: {brood.reason}"
    while (kid := _next_undo(kids)) is not None:
        row = children[kid.index]
        assert row is not None
        reopened = _bump(row, now, error=error, stack=kid.stack)
        log = [_event(reopened, now, "undone_by_parent", None, {"parent": brood.parent})]
        reopened = _compensate_from(reopened, shape_of(kid.plan, kid.version), error, now, log)
        moved.append(Transition(reopened, EMPTY_MAILBOX, row.revision, events=tuple(log)))
        if reopened.state is COMPENSATING:
            return Move(
                parent_t, attrs.evolve(brood, undoing=kid.index), tuple(changed), tuple(moved)
            )
        kid = attrs.evolve(kid, status="failed", data=reopened.data, undone=True)
        changed = [k for k in changed if k.index != kid.index] + [kid]
        kids = _merged(kids, [kid])
    b = attrs.evolve(brood, phase=UNDONE, undoing=None)
    held = parent if parent_t is None else parent_t.flow
    base = parent.revision if parent_t is None else parent_t.expected
    events = [] if parent_t is None else list(parent_t.events)
    new = held if parent_t is not None else _bump(held, now)
    error_of_parent = held.error or brood.reason
    new = _compensate_from(new, shape, error_of_parent, now, events)
    t = Transition(new, EMPTY_MAILBOX, base, events=tuple(events))
    return Move(t, b, tuple(sorted(changed, key=lambda k: k.index)), tuple(moved))


# ---------------------------------------------------------------------------------- reading


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


def check_family(
    parent: Flow, brood: Brood, kids: Sequence[Kid], children: Sequence[Flow | None]
) -> None:
    """Raise `InvariantError` naming the first rule of a family that does not hold."""

    def bad(what: str) -> None:
        raise InvariantError(f"the spawn of {brood.parent!r} at {brood.step_index}: {what}")

    if len(kids) != brood.total or len(children) != brood.total:
        bad(f"{len(kids)} children rows for {brood.total} children")
    active = sum(1 for k in kids if k.status == ACTIVE)
    kept = [k.index for k in kids if k.status == KEPT]
    ended = sorted(k.ended for k in kids if k.status in ENDED.values())
    if active != brood.active:
        bad(f"counts {brood.active} active children, {active} are")
    if kept != list(range(brood.next_kept, brood.total)):
        bad(f"kept children {kept}, the first kept one is {brood.next_kept}")
    if ended != list(range(1, brood.ended + 1)):
        bad(f"places in the order of ends {ended} for {brood.ended} ends")
    if brood.max_running is not None and brood.phase == WAITING and active > brood.max_running:
        bad(f"{active} children active, more than max_running={brood.max_running}")
    for k, row in zip(kids, children, strict=True):
        if (row is None) != (k.status == KEPT):
            bad(f"child {k.key!r} is {k.status} with {'no' if row is None else 'a'} row")
        if row is None:
            continue
        if k.status == ACTIVE and row.state in TERMINAL:
            bad(f"child {k.key!r} ended {row.state} without its end recorded")
        undoing = brood.phase == UNDOING and brood.undoing == k.index
        if k.status in ENDED.values() and row.state not in TERMINAL and not undoing:
            bad(f"child {k.key!r} recorded as {k.status} but it is {row.state}")
        if k.undone and k.status != "failed":
            bad(f"child {k.key!r} compensated for its parent but recorded {k.status}")
    waiting = brood.phase in (WAITING, STOPPING)
    if waiting != (parent.state is PARKED and parent.step_index == brood.step_index):
        bad(f"the parent is {parent.state} at step {parent.step_index} in phase {brood.phase}")
    if not waiting and (active or (kept and brood.then is None)):
        bad(f"the parent went on in phase {brood.phase} with children active or kept")
    if brood.phase == UNDOING and (
        parent.state is not COMPENSATING or parent.step_index != brood.step_index
    ):
        bad(f"the parent is {parent.state} at {parent.step_index} while it undoes its children")
    if brood.phase == UNDONE and _next_undo(kids) is not None:
        bad("undone, with a completed child not compensated")
