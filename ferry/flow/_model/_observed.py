"""What an engine tells its observers (`flow.Observer`, docs/adr/0138): one public record per
kind of thing that happened. No trio, no I/O.

Each record is frozen and keyword-only, so that a later field (with a default) breaks no
observer that reads the fields it knows.
"""

from __future__ import annotations

from typing import final

import attrs

from ._types import State


@final
@attrs.frozen(kw_only=True)
class StepRun:
    """One attempt of a step, or of a step's compensation, that an engine ran
    (`Observer.step_ran`).

    `flow_id`, `plan`, `version`: the flow; `step`, `attempt`: the step and its attempt (1 the
    first time); `compensating`: it was the step's compensation. `result`: what the body
    returned (None, `CONTINUE`, `COMPLETE`, a `Park`, a `Fail`, or something that is not an
    outcome; None when it raised); `error`: what it raised (None when it returned); `seconds`:
    how long it ran (NaN when it was cancelled before it returned). `void`: someone else moved
    the flow meanwhile (a cancel, a takeover) and the attempt counts for nothing."""

    flow_id: str
    plan: str
    version: int
    step: str
    attempt: int
    compensating: bool
    result: object
    error: BaseException | None
    seconds: float
    void: bool


@final
@attrs.frozen(kw_only=True)
class FlowEnd:
    """A flow this engine wrote `COMPLETED`, `FAILED` or `BLOCKED` (`Observer.flow_ended`), as
    of that write.

    `state`: the state it ended in; `how`: ``"completed"``, ``"failed"``, ``"blocked"``, or
    ``"cancelled"`` (a cancel ended it at once) or ``"abandoned"`` (an operator gave up on it:
    `Engine.abandon`); `step`: the step it was at before that write (None if none);
    `error`: why it failed or is blocked (None for a completed flow); `started_at`, `ended_at`:
    wall-clock seconds of its start and of this write; `traceparent`: the W3C trace context of
    its start span (None: traces were off when it started); for a child flow (SPEC 5.7) the
    span of its parent's spawn. `parent`: a child flow's parent's id (None: a top-level
    flow)."""

    flow_id: str
    plan: str
    version: int
    state: State
    how: str
    step: str | None
    error: str | None
    started_at: float
    ended_at: float
    traceparent: str | None
    parent: str | None = None


@final
@attrs.frozen(kw_only=True)
class ScheduleTick:
    """One firing of a schedule by this engine (`Observer.schedule_ticked`): a regular tick,
    ``overlap="queue"``'s waiting tick once the flow before it ended, a trigger or a backfill.

    `schedule`: its name; `how`: ``"tick"``, ``"waiting"``, ``"trigger"`` or ``"backfill"``;
    `flow_id`: the flow this write started (None: it started none); `started`: how many flows
    it started (a backfill: one per new tick; else 0 or 1); `skipped`: ticks passed over by
    the overlap rule; `missed`: ticks passed over after downtime (later than ``catchup``);
    `at`: wall-clock seconds of the write."""

    schedule: str
    how: str
    flow_id: str | None
    started: int
    skipped: int
    missed: int
    at: float
