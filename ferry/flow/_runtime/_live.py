"""What every part of the engine shares: a live flow's record, the counters, and how to name a
flow in a log line.

A flow that is `RUNNING` or `COMPENSATING` in this engine is *live*: a `Live` record in the write
path's map (`_writes.Writes.live`), driven by one runner task or waiting for a runner slot. The
record is the engine's copy of the flow's latest committed row; whoever changes the row (a runner,
a cancel, a takeover) changes the copy in commit order (`Writes.track`).
"""

from __future__ import annotations

import logging

import trio

from .._model._family_undo import undone
from .._model._types import Delivery, State
from .._model._values import Flow
from ._observe import Bound

_log = logging.getLogger("ferry.flow")

COUNTERS = (
    "completed",
    "failed",
    "blocked",
    "steps_run",
    "step_retries",
    "compensations_run",
    "writes",
    "write_batches",
    "conflicts",
    "recovered",
    "claimed",
    "lost",
    "renewals",
    "children_started",
    "children_ended",
)


class Live:
    """A flow that is running or compensating in this engine (or waiting for a runner slot)."""

    __slots__ = ("began", "emitted", "epoch", "flow", "scope")

    def __init__(self, flow: Flow, epoch: int) -> None:
        self.flow = flow  # the latest committed row this engine knows
        # The runner task's cancel scope while a step or compensation of this flow runs in it
        # (None the rest of the time): cancelling it voids that run.
        self.scope: trio.CancelScope | None = None
        # The revision of the row whose run (of its step or compensation) began in this engine:
        # a flow whose current row's run has not begun is let go at close
        # (`_recovery.let_go_unbegun`).
        self.began = 0
        # The fleet: the write path's `epoch` when the write or read that gave `flow` began. A
        # copy from an older epoch is not trusted until it is read again (see `_lease`).
        self.epoch = epoch
        # The length of the flow's stream as this engine wrote it: (the revision it is true
        # at, the count), or None: not known yet (`_emits`).
        self.emitted: tuple[int, int] | None = None


class Tally:
    """The engine's counters (`FlowStatistics`) and its observers (`flow.Observer`).

    `stats` holds the counters named in `COUNTERS`; `wakes` counts deliveries by kind; `parked`
    and `blocked` are the numbers of parked and blocked flows in the store as this engine knows
    them (counted at open, then kept by the rows it writes and reads; in a fleet the store's,
    read again at every scan: docs/adr/0128). Plain integers: read from any thread by
    `Engine._statistics`."""

    __slots__ = ("blocked", "observers", "parked", "queued", "stats", "wakes")

    def __init__(self) -> None:
        self.stats = dict.fromkeys(COUNTERS, 0)
        self.wakes = dict.fromkeys(Delivery, 0)
        self.parked = 0
        self.blocked = 0
        self.queued = 0  # as `parked`: the flows waiting in their plans' queues (SPEC 5.8)
        # `flow.Observer`s and the engine's traces (their end spans); empty: nothing is observed
        self.observers: tuple[Bound, ...] = ()


def kin_counted(tally: Tally, before: State | None, flow: Flow) -> None:
    """This engine wrote a row of the child flow `flow` (its state was `before`, None: none):
    count a child started (its first row) or ended (`COMPLETED` or `FAILED`; not again when
    its parent's compensation undid it after it completed, `_family_undo.undone`)."""
    if before is None:
        tally.stats["children_started"] += 1
    elif (flow.state is State.COMPLETED or flow.state is State.FAILED) and not undone(flow):
        tally.stats["children_ended"] += 1


def named(flow: Flow) -> str:
    """The flow, its plan, step and attempt, for a log line or an error."""
    return (
        f"flow {flow.flow_id!r} (plan {flow.plan!r} v{flow.version}, step {flow.step_index}"
        f" {flow.step!r}, attempt {flow.attempt}, {flow.state.name})"
    )


def about(flow: Flow) -> dict[str, object]:
    """The `extra=` of a log record about the flow."""
    return {
        "flow_id": flow.flow_id,
        "plan": flow.plan,
        "step": flow.step,
        "attempt": flow.attempt,
    }


LOGGED = frozenset({State.FAILED, State.BLOCKED})


def log_ended(before: Flow, after: Flow) -> None:
    """INFO: this engine's write left the flow `FAILED` or `BLOCKED` (an operator may act)."""
    why = after.blocked if after.state is State.BLOCKED else after.error
    _log.info(
        "flow %r (plan %r v%d) is %s at step %r (attempt %d): %s",
        after.flow_id,
        after.plan,
        after.version,
        after.state.name,
        before.step,
        before.attempt,
        why,
        extra={
            "flow_id": after.flow_id,
            "plan": after.plan,
            "step": before.step,
            "attempt": before.attempt,
            "state": after.state.name,
            "error": why,
        },
    )
