"""The rules of a family at every moment (ADR 0139): `check_family`, what the children model
check asserts after every write, with `_invariants.check_invariants` for each row.

PURE, like `_machine`; split from `_family` (its module doc tells the whole) by concern.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._family_rows import (
    ACTIVE,
    ENDED,
    KEPT,
    STOPPING,
    UNDOING,
    UNDONE,
    WAITING,
    Brood,
    Kid,
    next_undo,
)
from ._values import COMPENSATING, PARKED, TERMINAL, Flow, InvariantError

__all__ = ["check_family"]


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
    if brood.phase == UNDONE and next_undo(kids) is not None:
        bad("undone, with a completed child not compensated")
