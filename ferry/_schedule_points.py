"""The one place `ferry` reads a private attribute of trio: a task's count of schedule points.

Why: `await f(x)` must be a checkpoint, a cancel point and a schedule point. A direct call
(a caller that claimed an idle key and runs the batch call itself) usually makes its schedule
point inside the call; adding one more after it is a whole extra pass of trio's scheduler per
call. trio counts each task's schedule points in `Task._schedule_points` (what
`trio.testing.assert_checkpoints` reads; trio's own comment there considers exposing it), so
the shell reads the count before and after the call and adds a schedule point only if the call
made none (ADR 0032).

The fallback: if a trio version has no such counter, `reader` returns None and the shell adds
the schedule point after every direct call, which is always correct and a little slower. The
check runs once, at import; tests/ferry/test_ferry.py runs the shell with the fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from types import MemberDescriptorType

import trio

_ATTRIBUTE = "_schedule_points"


def reader(task_class: type = trio.lowlevel.Task) -> Callable[[trio.lowlevel.Task], int] | None:
    """A function from a task to its count of schedule points, or None if `task_class` keeps no
    such count (a slot of that name). The function is C code (`operator.attrgetter`): about as
    cheap as reading the attribute inline."""
    if isinstance(getattr(task_class, _ATTRIBUTE, None), MemberDescriptorType):
        return attrgetter(_ATTRIBUTE)
    return None
