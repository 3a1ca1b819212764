"""A step's events and stream values on their way to its write (SPEC 5.10; the readers are
`_feeds`').

After a body returned, the runner turns what it left on its `Context` (`set_event`, `emit`,
as JSON text) into the `_signals.Signals` record of its write (`left`), its values at the
offsets after the flow's stream as it is: the length the runner knows (`Live.emitted`, the
revision it is true at and the count), else read once from the store (`_store._signals.length`,
its unavailability retried). After the write is accepted the runner notes the new length
(`noted`). Trust (docs/adr/0175): on one file every write is this engine's and only runners
emit, so a count kept by this `Live` stays true; in a fleet it is true only at the revision it
was noted at (another engine may have run steps since). A wrong count cannot write a stream
twice: the primary key refuses a taken offset, and the flow fails with the refusal.
"""

from __future__ import annotations

from functools import partial
from typing import Final

from .._model import _signals
from .._model._signals import Signals
from .._model._types import Context
from .._store import _signals as _stored
from . import _read, _retry
from ._live import Live, about, named
from ._mode import Mode
from ._writes import Writes

#: `left`'s problem when the flow moved on (someone else wrote it) while the stream's length
#: was read: the attempt is void, as one whose flow moved while its body ran.
MOVED: Final = "moved on meanwhile"


async def left(
    writes: Writes, mode: Mode, live: Live, ctx: Context, what: str, max_bytes: int
) -> tuple[Signals | None, str | None]:
    """The record of what the body that ran with `ctx` left (None: nothing), or why it cannot
    be stored (the flow fails: not retried), or `MOVED`. A checkpoint only when it reads the
    stream's length."""
    events, values = ctx._events, ctx._emitted()
    if not events and not values:
        return None, None
    flow = live.flow
    shared = mode.shared
    emitted = 0
    if values:
        known = live.emitted
        if known is not None and (not shared or known[0] == flow.revision):
            emitted = known[1]
        else:
            emitted = await _retry.retrying(
                partial(_read.own, writes._store, partial(_stored.length, flow_id=flow.flow_id)),
                what=lambda: f"reading the stream's length of {named(flow)}",
                extra=partial(about, flow),
            )
    if live.flow is not flow:
        return None, MOVED
    problem = _signals.problem(events, values, emitted, max_bytes=max_bytes, what=what)
    if problem is not None:
        return None, problem
    return _signals.signals(events, values, emitted), None


def noted(live: Live, before: int, signals: Signals | None) -> None:
    """The write from revision `before` was accepted with `signals`: the stream's length at
    the revision it made. No checkpoint."""
    if signals is not None and signals.values:
        live.emitted = (before + 1, signals.first + len(signals.values) - 1)
    elif live.emitted is not None and live.emitted[0] == before:
        live.emitted = (before + 1, live.emitted[1])
