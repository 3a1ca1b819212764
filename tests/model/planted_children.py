"""Children protocols with one planted bug each, on the wired engine's rule for an ordinary end
(`children_wired.WiredProtocol`): the children model check must catch every one."""

from __future__ import annotations

from typing import Any

import attrs

from ferry.flow._model import _family as fam
from ferry.flow._model import _machine as fm
from ferry.flow._model._family import Move
from ferry.flow._model._values import TERMINAL, Flow, Shape, Transition
from ferry.flow._store import _family as sf
from tests.model.children import NOW, C, shape_of
from tests.model.children_wired import WiredProtocol


class RecoveryStartsTheChildrenAgain(WiredProtocol):
    """(1) Recovery does not trust the spawn's write: it starts again every child the spawn
    says is active and that has not ended, so a child that was running is started twice."""

    def recover(self, m: C) -> Move | None:
        if m.brood is None or m.brood.phase != fam.WAITING:
            return None
        starts = tuple(
            fm.start(shape_of(k.plan, k.version), k.flow_id, k.data, NOW)
            for k, row in zip(m.kids, m.children, strict=True)
            if k.status == fam.ACTIVE and row is not None and row.state not in TERMINAL
        )
        return Move(None, m.brood, (), starts)


class ResumesWhenNoneIsActive(WiredProtocol):
    """(2) The last end is taken to be "no child active any more": the test forgets the kept
    children, so with ``max_running=1`` the first end resumes the parent (before the kept child
    has even started, let alone ended)."""

    def child_ended(self, m: C, shape: Shape, index: int, before: Flow, after: Transition) -> Move:
        moved = super().child_ended(m, shape, index, before, after)
        b = m.brood
        assert b is not None
        if b.phase != fam.WAITING or b.active != 1 or moved.parent is not None:
            return moved
        done = moved.kids[0]
        assert done.index == index
        ended = attrs.evolve(b, active=0, ended=b.ended + 1)
        kids = (*m.kids[:index], done, *m.kids[index + 1 :])
        children = (*m.children[:index], after.flow, *m.children[index + 1 :])
        return fam.go_on(ended, kids, children, m.parent, shape, shape_of, NOW, changed=(done,))


class UndoHangsOffTheSpawnsCompensation(WiredProtocol):
    """(3) The children are compensated only as part of the spawning step's own compensation:
    a spawning step without one (or a parent whose stack is empty) leaves its completed
    children as they are."""

    def compensating(self, m: C, shape: Shape, t: Transition) -> Move:
        assert m.brood is not None
        if not shape.compensable[m.brood.step_index]:
            return Move(t, m.brood)
        return super().compensating(m, shape, t)


class UndoForgetsItsEnd(WiredProtocol):
    """(4) The end of a child's compensation for its parent is not written to its row of
    ``flow_children`` (only the spawn's row moves on): the child still reads as completed and
    not undone, so the parent's next pick compensates it again."""

    def child_ended(self, m: C, shape: Shape, index: int, before: Flow, after: Transition) -> Move:
        moved = super().child_ended(m, shape, index, before, after)
        b = m.brood
        assert b is not None
        if b.phase != fam.UNDOING or b.undoing != index:
            return moved
        kept = tuple(k for k in moved.kids if k.index != index)
        return attrs.evolve(moved, kids=kept)


class ResumesOneEndEarly(WiredProtocol):
    """(2b) The last end is counted against ``total - 1``: the parent runs its next step while
    its last child is still running."""

    def child_ended(self, m: C, shape: Shape, index: int, before: Flow, after: Transition) -> Move:
        moved = super().child_ended(m, shape, index, before, after)
        b = moved.brood
        if moved.parent is not None or b.phase != fam.WAITING or b.ended != b.total - 1:
            return moved
        kids = list(m.kids)
        for k in moved.kids:
            kids[k.index] = k
        children = (*m.children[:index], after.flow, *m.children[index + 1 :])
        on = fam.go_on(attrs.evolve(b, active=0), kids, children, m.parent, shape, shape_of, NOW)
        return Move(on.parent, attrs.evolve(on.brood, active=b.active), moved.kids, moved.children)


# ---- bugs planted in the wired rule's SQL (`record_end`, docs/adr/0163) ----------------------


class WiredEndForgetsTheKept(WiredProtocol):
    """(2w) `record_end` takes "no child active" for the last end and starts no kept child:
    with ``max_running=1`` the first end resumes the parent before the kept child started."""

    def record_end(self, tx: Any, child: Flow, stack: tuple[int, ...]) -> sf.End:
        end = super().record_end(tx, child, stack)
        if end.start is None:
            return end
        b = attrs.evolve(end.brood, active=end.brood.active - 1, next_kept=end.brood.total)
        return attrs.evolve(end, brood=b, start=None, last=b.active == 0)


class WiredEndStartsTheKeptAgain(WiredProtocol):
    """(1w) `record_end` starts the next kept child but leaves it kept (its row's status and
    ``next_kept`` not moved on): the next end starts the same child again."""

    def record_end(self, tx: Any, child: Flow, stack: tuple[int, ...]) -> sf.End:
        end = super().record_end(tx, child, stack)
        if end.start is None:
            return end
        b = attrs.evolve(end.brood, next_kept=end.brood.next_kept - 1)
        return attrs.evolve(end, brood=b, start=attrs.evolve(end.start, status=fam.KEPT))
