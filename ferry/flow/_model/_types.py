"""The value types of `ferry.flow`: states, deliveries, outcomes, `Context`, `Snapshot`, `Event`,
the choreography decisions and the statistics record. No trio, no I/O.
"""

from __future__ import annotations

import enum
import json
import json.encoder
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, NoReturn, TypeAlias, final

import attrs

if TYPE_CHECKING:
    from ._children import ChildResult, Spawn
    from ._plan import Plan

#: A value that survives a JSON round trip: None, bool, int, float, str, lists and str-keyed dicts.
Json: TypeAlias = Any


class State(enum.Enum):
    """Where a flow is. `COMPLETED` and `FAILED` are terminal; `BLOCKED` waits for an operator;
    `QUEUED` waits for its plan's flow control (`Limits`, a delayed start)."""

    RUNNING = "RUNNING"
    PARKED = "PARKED"
    COMPENSATING = "COMPENSATING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    BLOCKED = "BLOCKED"
    # Started, waiting for its plan's limits or its start time (SPEC 5.8): not active, holds
    # no slot and no task; admission moves it to RUNNING (or the state a resume left it for).
    QUEUED = "QUEUED"

    # A member is equal only to itself: its identity hash does as well as `Enum`'s (a Python
    # call hashing the name), and `state in ACTIVE` on every write stays in C.
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"State.{self.name}"


class Delivery(enum.Enum):
    """What became of a wake (`Engine.wake`)."""

    RESUMED = "RESUMED"  # the flow was parked and now runs its next step with this payload
    QUEUED = "QUEUED"  # kept in the mailbox; the flow's next park takes it at once
    DUPLICATE = "DUPLICATE"  # this message_id was delivered to this flow before
    STALE = "STALE"  # the flow is completed, failed or compensating (it will not park again)
    UNKNOWN = "UNKNOWN"  # no such flow

    def __repr__(self) -> str:
        return f"Delivery.{self.name}"


# ------------------------------------------------------------------------------------ outcomes


@final
class _Continue:
    __slots__ = ()

    def __repr__(self) -> str:
        return "flow.CONTINUE"


@final
class _Complete:
    __slots__ = ()

    def __repr__(self) -> str:
        return "flow.COMPLETE"


#: Go on with the next step (after the last step: the flow is completed). Same as returning None.
CONTINUE: Final = _Continue()
#: Skip the remaining steps: the flow is completed.
COMPLETE: Final = _Complete()

OnTimeout: TypeAlias = Literal["compensate", "continue"]


@final
@attrs.frozen
class Park:
    """Persist the flow and stop until a wake; made by `park()`, which checks its values."""

    timeout: float | None
    on_timeout: OnTimeout


@final
@attrs.frozen
class Fail:
    """Stop and compensate the completed steps; made by `fail()`, which checks its reason."""

    reason: str


#: What a step returns (None means `CONTINUE`).
if TYPE_CHECKING:
    Outcome: TypeAlias = _Continue | _Complete | Park | Fail | Spawn
else:  # `Spawn` is `_children`'s, which imports this module: its `Outcome` is the whole union
    Outcome = _Continue | _Complete | Park | Fail  # at run time, and `flow.Outcome` is that one


class MisusedOutcome(Exception):
    """Marks an error raised by `park()` or `fail()` for a bad argument: a mistake in the step's
    code, which the same code makes again on every attempt. The runner fails the flow at once
    instead of retrying the step (SPEC 5.3.2: a flow's mistake is answered at once). `park()`,
    `fail()` and the check of a returned `Park`/`Fail` are in `_checks` (`checked_outcome`)."""


# ------------------------------------------------------------------------------------- context


def _read_only(instance: object, attribute: attrs.Attribute[Any], value: object) -> NoReturn:
    raise AttributeError(
        f"ctx.{attribute.name} is read-only: a step may change only ctx.data (saved with its"
        " outcome)"
    )


_FROZEN = _read_only


@final
@attrs.define(kw_only=True)
class Context:
    """What a step (or a compensation) gets. Only `data` may be changed.

    - `flow_id`, `plan` (the plan's name), `version`, `step` (name), `step_index` (from 0).
    - `attempt`: 1 on the first run of this step (or compensation), +1 on every re-run, including
      re-runs after a crash or a close.
    - `data`: a copy of the flow's JSON object. Changes are saved with the step's outcome, in the
      same transaction, and discarded if the step raises. Keep it JSON (str keys, no NaN).
    - `wake`: the payload of the wake that resumed the flow, for the step after a park; else None.
    - `timed_out`: True for the step after a park that timed out with ``on_timeout="continue"``.
    - `error`: in a compensation, why the flow is compensating; else None.
    - `children`: for the step after a spawn, key -> `flow.ChildResult` of every child, in spawn
      order; else empty.
    - `idempotency_key`: ``f"{flow_id}/{step_index}/{step}"``, and for a compensation
      ``f"{flow_id}/{step_index}-compensate/{step}"``; the same on every attempt, and never the
      same for two (flow, step or compensation): hand it to external calls so that a re-run
      after a crash does not repeat their effect.

    Out of a running flow (SPEC 5.10): `set_event(key, value)` and `emit(value)`, saved with
    the outcome like `data` (and, like it, discarded if the body raises).
    """

    flow_id: str = attrs.field(on_setattr=_FROZEN)
    plan: str = attrs.field(on_setattr=_FROZEN)
    version: int = attrs.field(on_setattr=_FROZEN)
    step: str = attrs.field(on_setattr=_FROZEN)
    step_index: int = attrs.field(on_setattr=_FROZEN)
    attempt: int = attrs.field(on_setattr=_FROZEN)
    data: dict[str, Json]
    wake: Json = attrs.field(on_setattr=_FROZEN)
    timed_out: bool = attrs.field(on_setattr=_FROZEN)
    error: str | None = attrs.field(on_setattr=_FROZEN)
    idempotency_key: str = attrs.field(on_setattr=_FROZEN)
    children: Mapping[str, ChildResult] = attrs.field(factory=dict, on_setattr=_FROZEN)
    # What `set_event` and `emit` left (`_signals`), read by the runner: the events as JSON
    # text; the values as JSON text, or while `_raw` holds, as they were given (every one an
    # ASCII str, encoded at once when the step ends: `emitted`).
    _events: dict[str, str] = attrs.field(init=False, factory=dict, repr=False, eq=False)
    _values: list[str] = attrs.field(init=False, factory=list, repr=False, eq=False)
    _raw: bool = attrs.field(init=False, default=True, repr=False, eq=False)

    def set_event(self, key: str, value: Json) -> None:
        """Set the flow's event `key` (a str) to `value` (JSON), saved with the step's outcome:
        `Engine.get_event` then returns it, and a later set replaces it. The value is taken as
        it is now. `TypeError`/`ValueError` here for a key that is not a non-empty str of at
        most 256 characters or a value that is not JSON, and nothing is recorded for this call;
        a value larger than the engine's `max_data_bytes` fails the flow with the outcome.
        Not a checkpoint."""
        from . import _signals

        key = _signals.event_key(key)
        text = _signals.value_text(value, f"ctx.set_event({key!r})'s value")
        events = self._events
        if key not in events and len(events) >= _signals.MAX_KEYS_PER_STEP:
            raise ValueError(
                f"ctx.set_event({key!r}): a step sets at most {_signals.MAX_KEYS_PER_STEP} keys"
            )
        events[key] = text

    def emit(self, value: Json) -> None:
        """Append `value` (JSON) to the flow's stream, saved with the step's outcome at the
        next offset (1, 2, 3, ... per flow): `Engine.stream` yields it. The value is taken as
        it is now. `TypeError`/`ValueError` here for a value that is not JSON, and nothing is
        recorded for this call; a value larger than the engine's `max_data_bytes`, or a
        stream longer than 100,000 values, fails the flow with the outcome. Not a
        checkpoint."""
        if type(value) is str and value.isascii():  # the common case: kept as it is
            if self._raw:
                self._values.append(value)
            else:
                self._values.append(_encode_str(value))
            return
        text = _value_text(value, "ctx.emit's value")  # raises: nothing recorded
        if self._raw:
            self._values[:] = map(_encode_str, self._values)
            self._raw = False
        self._values.append(text)

    def _emitted(self) -> list[str]:
        """The JSON texts of the values emitted, in order (the runner's, once the body
        returned)."""
        if self._raw:
            return list(map(_encode_str, self._values))
        return self._values


#: A str's JSON text, as `ferry._text.canonical_json` makes it (its encoder's ``ensure_ascii``
#: is off), without the encoder's dispatch.
_encode_str: Final = json.encoder.encode_basestring


def _value_text(value: Json, what: str) -> str:
    """`_signals.value_text` (imported on first use: `_signals` imports this module)."""
    from ._signals import value_text

    return value_text(value, what)


# -------------------------------------------------------------------------------- what is read


@final
@attrs.frozen(kw_only=True)
class Snapshot:
    """A flow's durable state. `data` is a copy; `park_deadline` is wall-clock seconds.

    `step`/`step_index`: the step running, parked at, or being compensated; `step` is None once
    the flow is completed or failed. `revision` is 1 after `start` and +1 on every accepted write.
    `deadline`: the whole flow's deadline (wall-clock seconds, `start(deadline=...)`) or None.
    `children`: the child flow ids of its latest spawn, in spawn order (started or kept), as
    `get` reads them; the snapshots `start` and `wait` return leave it empty (they come from
    the engine's memory, with no read of the family's rows): `get` the flow to list them.
    `not_before`: the start time a delayed start gave it (``start(delay=|at=)``, wall-clock
    seconds; a restart keeps it) or None.
    """

    flow_id: str
    plan: str
    version: int
    state: State
    step: str | None
    step_index: int
    data: dict[str, Json]
    error: str | None
    park_deadline: float | None
    revision: int
    deadline: float | None = None
    children: tuple[str, ...] = ()
    not_before: float | None = None


@final
@attrs.frozen(kw_only=True)
class Event:
    """One entry of a flow's history: a durable transition, written in the write of `revision`.

    `kind` is one of ``started step attempt_failed parked woken timed_out compensated completed
    failed blocked cancelled resumed abandoned``; `at` is wall-clock seconds; `step`/`attempt`
    name the step concerned (None when none is); `detail` is a JSON object with the particulars,
    or None. An ``attempt_failed`` event is an attempt of a step or compensation that raised and
    was retried: ``{"error": repr, "type": qualified name, "traceback": text}``, the traceback
    cut to about 4,000 characters; the last attempt's traceback is in its ``step`` (or
    ``blocked``) event.
    """

    revision: int
    at: float
    kind: str
    step: str | None
    attempt: int | None
    detail: Json


# -------------------------------------------------------------------------------- choreography


@final
@attrs.frozen
class Wake:
    """A mapper's decision: wake `flow_id` with `payload` (deduplicated by `message_id`)."""

    flow_id: str
    payload: Json = None
    message_id: str | None = None


@final
@attrs.frozen
class Start:
    """A mapper's decision: start a flow of `plan` with id `flow_id` (idempotent) and `data`."""

    plan: Plan
    flow_id: str
    data: Json = None


@final
class _Ignore:
    __slots__ = ()

    def __repr__(self) -> str:
        return "flow.IGNORE"


#: A mapper's decision: this event concerns no flow (returning None means the same).
IGNORE: Final = _Ignore()


# ---------------------------------------------------------------------------------- statistics


@final
@attrs.frozen(kw_only=True)
class FlowStatistics:
    """What an engine holds now and has done since it opened (`Engine.statistics`).

    Gauges: `running` flows this engine runs or has queued to run (steps or compensations), of
    which `compensating` run their compensations; `parked` and `blocked_now`: the flows parked
    and blocked in the store as this engine knows it (counted at open, then kept up to date by
    the rows this engine writes and reads; in a fleet read again at every scan, so a flow that
    another engine or an operator resumed or abandoned stops counting within one scan).

    Counters since open: flows this engine `completed`, `failed` and `blocked`; `steps_run`
    (step attempts started), `step_retries` (attempts after an exception), `compensations_run`
    (compensation attempts started); `wakes`, by `Delivery`; `writes` (boundary writes accepted
    by the store), `write_batches` (store transactions that carried them), `conflicts` (writes
    refused by the revision check), `recovered` (running or compensating flows resumed at open).

    The fleet (PostgreSQL): `claimed` (active flows whose lease had lapsed, taken over
    by this engine, at open or by its periodic scan), `lost` (flows this engine was running and
    let go: another engine holds them now, or this engine's own lease ran out before it could
    renew it; their step or compensation was cancelled and its changes discarded), `renewals`
    (renewals of the engine's lease: one row, whatever the number of flows).

    Flow control (SPEC 5.8): `queued`, the flows `QUEUED` in their plans' queues as this engine
    knows them (counted at open, then kept by the rows it writes and reads, as `parked`).

    Retention: `purged` (finished flows this engine deleted because they ended more than
    ``open_engine(retain=)`` seconds ago; in a fleet, each engine counts its own).

    Child flows (SPEC 5.7): `children_started` (child flows whose first row this engine wrote:
    a spawn's first children, and a kept child started by a sibling's end) and
    `children_ended` (child flows this engine wrote `COMPLETED` or `FAILED`, each end once: a
    completed child that its parent's compensation undoes later is not counted again). They
    are also in `completed` and `failed`, as any flow.
    """

    running: int
    parked: int
    completed: int
    failed: int
    blocked: int
    steps_run: int
    step_retries: int
    compensations_run: int
    wakes: Mapping[Delivery, int]
    writes: int
    write_batches: int
    conflicts: int
    recovered: int
    claimed: int = 0
    lost: int = 0
    renewals: int = 0
    purged: int = 0
    compensating: int = 0
    blocked_now: int = 0
    children_started: int = 0
    children_ended: int = 0
    queued: int = 0
