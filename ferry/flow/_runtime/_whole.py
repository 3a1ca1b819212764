"""A whole flow's deadline (`start(deadline=...)`, SPEC 5.7, docs/adr/0151): its entry in the
timer heap and what it does when it comes.

The heap's entries are ``(deadline, flow id, revision)``; a whole flow's deadline is one with
the revision `WHOLE`, which no row has: it is never stale, and it cancels the flow with reason
``"deadline"`` (the write path's cancel, so that a parent waiting for its children stops its
spawn and cascades: `_store._kin`) instead of timing a park out. Armed when the start is
committed (`created`) and at open (`_recovery.recover`).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Final

from .._model import _checks, _ops
from .._model._values import Flow
from .._store import _op
from . import _retry

if TYPE_CHECKING:
    from ._writes import Writes

__all__ = ["WHOLE", "arm", "created", "passed"]

_log = logging.getLogger("ferry.flow")

#: The revision of a whole flow's deadline in the timer heap.
WHOLE: Final = -1


def arm(writes: Writes, flow_id: str, deadline: float) -> None:
    """Arm the whole flow's `deadline` (if this engine fires timers: a serving one)."""
    if writes._serve:
        writes._arm(deadline, flow_id, WHOLE)


def created(writes: Writes, flow: Flow, epoch: int) -> None:
    """A start was committed (`Writes._applied`): memory follows it (`Writes.track`), and its
    whole deadline, if it has one, is armed."""
    writes.track(None, flow, True, epoch=epoch)
    if flow.deadline is not None:
        arm(writes, flow.flow_id, flow.deadline)


async def passed(writes: Writes, flow_id: str, deadline: float) -> None:
    """A whole flow's deadline came: cancel it with reason ``"deadline"``, wherever it is
    (running, parked, waiting for its children: its children too). A flow that ended,
    compensates or is blocked is left as it is. Unavailability is retried."""
    now = max(writes._clock.now(), deadline)
    holder = writes.holders.rule(outside=True)
    op = _op.Change(flow_id, _ops.Cancel("deadline", now, known=writes._own), holder=holder)
    what = f"cancelling flow {flow_id!r} at its deadline"
    result = await _retry.retrying(
        partial(writes.write_answered, op), what=what, extra={"flow_id": flow_id}
    )
    if isinstance(result, _op.Rejected):
        _log.warning("%s: the database refused it: %s", what, _checks.describe(result.error))
