"""The values of the flow machine: states, a plan's shape, a flow's row, its mailbox, a transition.

PURE, like `_machine`: frozen records, how a row reads against a plan (`mismatch`) and to the
user (`snapshot`), and the text a stack is stored as; no trio, no clock, no
I/O. The transitions that make and change these values are in `_machine`; the invariants that
every value reachable by a correct run keeps are checked by `_invariants`.

- `Shape`: what the machine needs of a plan: its name, version, step names, which steps have a
  compensation, and their attempts.
- `Flow`: one flow's durable row. `revision` is 1 after `start` and +1 on every accepted write.
  `stack` holds the indexes of the completed steps that have a compensation, oldest first: it is
  the compensation stack (popped from the end). `attempt` is the attempt number of the step or
  compensation in progress (or the last one started). `wake`/`timed_out` belong to the current
  step (the one after a park). `error` is why the flow compensates (or failed); `blocked` is why
  it is `BLOCKED`, and `blocked_from` the state it left (`resume` returns there).
- `Mailbox`: a flow's durable mailbox: `queued` (messages kept for the next park, in arrival
  order) and `seen` (every message id ever accepted: the `DUPLICATE` check). A transition reads
  only ``message_id in seen`` and ``queued[:1]``, so a store may pass a partial mailbox holding
  just those (and applies `Transition.messages` to its tables).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Final

import attrs

from ._limits import Limits
from ._types import Delivery, Event, Snapshot, State

__all__ = [
    "ACTIVE",
    "BLOCKED",
    "COMPENSATING",
    "COMPLETED",
    "EMPTY_MAILBOX",
    "FAILED",
    "PARKED",
    "QUEUED",
    "RUNNING",
    "TERMINAL",
    "Flow",
    "InvalidTransition",
    "InvariantError",
    "Mailbox",
    "Message",
    "Received",
    "Shape",
    "Taken",
    "Transition",
    "mismatch",
    "parse_stack",
    "snapshot",
    "stack_text",
]

RUNNING: Final = State.RUNNING
PARKED: Final = State.PARKED
COMPENSATING: Final = State.COMPENSATING
COMPLETED: Final = State.COMPLETED
FAILED: Final = State.FAILED
BLOCKED: Final = State.BLOCKED
QUEUED: Final = State.QUEUED
TERMINAL: Final = frozenset({COMPLETED, FAILED})
ACTIVE: Final = frozenset({RUNNING, COMPENSATING})


class InvalidTransition(Exception):
    """A transition that only the flow's own runner asks for was asked in the wrong state."""


class InvariantError(AssertionError):
    """`check_invariants` found a state that no correct run can reach."""


@attrs.frozen
class Shape:
    """What the machine needs of a plan (made by `Plan`; a model check may make its own)."""

    name: str
    version: int
    steps: tuple[str, ...]
    compensable: tuple[bool, ...]
    attempts: tuple[int, ...]
    # The plan's flow control (SPEC 5.8): its flows start `QUEUED` and count in its budget.
    limits: Limits | None = None

    def __attrs_post_init__(self) -> None:
        n = len(self.steps)
        assert n >= 1 and len(self.compensable) == n and len(self.attempts) == n


@attrs.frozen
class Message:
    """One wake in a mailbox: its id (given, or made unique by the engine) and JSON payload text."""

    message_id: str
    payload: str


@attrs.frozen
class Mailbox:
    """A flow's durable mailbox (or the part of it a transition reads; see the module doc)."""

    queued: tuple[Message, ...] = ()
    seen: frozenset[str] = frozenset()


EMPTY_MAILBOX: Final = Mailbox()


@attrs.frozen
class Flow:
    """One flow's durable row (see the module doc for what each field means)."""

    flow_id: str
    plan: str
    version: int
    state: State
    step_index: int
    step: str | None
    attempt: int
    data: str  # canonical JSON text of the flow's data object
    revision: int
    updated_at: float
    error: str | None = None
    park_deadline: float | None = None
    on_timeout: str | None = None
    wake: str | None = None  # JSON text of the payload that resumed the current step
    timed_out: bool = False
    stack: tuple[int, ...] = ()
    blocked: str | None = None
    blocked_from: State | None = None
    owner: str | None = None
    # When the owner let the flow go (the database's clock, docs/adr/0110); None while it holds
    # it. Stored in the flows table's ``lease_until`` column (docs/adr/0136).
    released_at: float | None = None
    created_at: float = 0.0  # when it was started (wall-clock seconds); never changes
    # The W3C ``traceparent`` of the span that started the flow (None: traces were off then):
    # every step's span joins its trace. Set by `start`, never changed; the machine ignores it.
    trace: str | None = None
    # A child's parent (its flow id; None for a top-level flow) and a top-level flow's whole
    # deadline (wall-clock seconds; None: none), set by its start and never changed (ADR 0139).
    parent: str | None = None
    deadline: float | None = None
    # The step index of the spawn whose children's results the current step reads
    # (``ctx.children``): set by the write that resumes a parent after its last child ended,
    # cleared by the next move past the step (docs/adr/0148).
    fan_in: int | None = None
    # The flow's key in its plan's queue (`Limits.key`'s answer; '' for a plan without a key
    # function), set by `start` iff the plan had limits: the flow then counts in its plan's
    # budget all its life (SPEC 5.8, docs/adr/0165). Never changed; None: no flow control.
    queue_key: str | None = None
    # A delayed start's time (``start(delay=|at=)``, wall-clock seconds), set by `start` and
    # never changed; None: at once.
    not_before: float | None = None


@attrs.frozen
class Received:
    """A new message for the mailbox: kept for the next park, or `taken` at once (RESUMED)."""

    message: Message
    taken: bool
    at: float = 0.0  # when it arrived (wall-clock seconds)


@attrs.frozen
class Taken:
    """A queued message taken by a park (or a resume back to a park)."""

    message: Message


@attrs.frozen
class Transition:
    """What a transition did: the new row and mailbox, what must be written, what it answers.

    `expected` is the revision the flow had before (0 for `start`); the row changed (and must be
    written, with `events`, as a compare-and-set on `expected`) iff `written`. `messages` are
    mailbox writes, to be applied even when the row did not change (a queued wake). `delivery`
    answers a wake; `done` is False when an outside request did not apply (nothing to write).
    """

    flow: Flow
    mailbox: Mailbox
    expected: int
    events: tuple[Event, ...] = ()
    messages: tuple[Received | Taken, ...] = ()
    delivery: Delivery | None = None
    done: bool = True

    @property
    def written(self) -> bool:
        """True if the row changed: a new revision, to be written with `events`."""
        return self.flow.revision != self.expected


# --------------------------------------------------------------------------------------- helpers


# ------------------------------------------------------------------------- reading a flow


def mismatch(flow: Flow, shape: Shape | None) -> str | None:
    """Why `shape` cannot drive `flow` (versions fail closed), or None if it can. O(stack)."""
    if shape is None or shape.name != flow.plan or shape.version != flow.version:
        return f"plan {flow.plan!r} version {flow.version} is not registered with this engine"
    state = flow.blocked_from if flow.state is BLOCKED else flow.state
    if state not in (RUNNING, PARKED, COMPENSATING):
        return None
    i = flow.step_index
    have = shape.steps[i] if 0 <= i < len(shape.steps) else None
    unnamed = state is COMPENSATING and flow.step is None  # named by the plan (see `cancel`)
    if have is None or (have != flow.step and not unnamed):
        found = "no step" if have is None else f"step {have!r}"
        return (
            f"plan {flow.plan!r} version {flow.version} has {found} at index {i}, but the flow"
            f" is at step {flow.step!r}"
        )
    for j in flow.stack:
        if not (0 <= j < len(shape.steps) and shape.compensable[j]):
            return (
                f"plan {flow.plan!r} version {flow.version} has no compensation at index {j},"
                " which the flow's compensation stack needs"
            )
    return None


_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def trace_id(traceparent: str | None) -> str | None:
    """The trace id (32 lower-case hex digits) in a flow's stored W3C ``traceparent``
    (`Flow.trace`), for an operator to look the trace up; None when none is stored or the text
    is not a valid one (version ``ff``, an all-zero id, anything else: never shown)."""
    if traceparent is None:
        return None
    m = _TRACEPARENT.fullmatch(traceparent)
    if m is None or m[1] == "ff" or m[2] == "0" * 32:
        return None
    return m[2]


def snapshot(flow: Flow, children: tuple[str, ...] = ()) -> Snapshot:
    """The public view of a row (a fresh copy of its data), with the child ids of its latest
    spawn (`children`, read by the caller). Cost: one JSON parse."""
    return Snapshot(
        flow_id=flow.flow_id,
        plan=flow.plan,
        version=flow.version,
        state=flow.state,
        step=flow.step,
        step_index=flow.step_index,
        data=json.loads(flow.data),
        error=flow.blocked if flow.state is BLOCKED else flow.error,
        park_deadline=flow.park_deadline,
        revision=flow.revision,
        deadline=flow.deadline,
        children=children,
        not_before=flow.not_before,
    )


# ---------------------------------------------------------------------------- stored text


def stack_text(stack: Sequence[int]) -> str:
    """The stack as stored: ``"0,2,3"``."""
    return ",".join(map(str, stack))


def parse_stack(text: str) -> tuple[int, ...]:
    """Inverse of `stack_text`."""
    return tuple(int(x) for x in text.split(",")) if text else ()
