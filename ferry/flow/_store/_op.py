"""The ops of a batch of flow writes and their results (the batch: `_batch.write_batch`).

An op is a `Create` (insert a started flow, idempotently by id) or a `Change` (run a pure
transition of `_machine` on the flow's row and record what it says, docs/adr/0021). Each op is
answered by one `Result`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import attrs

from .._model._ops import HolderRule, Move, Unseen
from .._model._signals import Signals
from .._model._values import Flow, Mailbox, Transition


@attrs.frozen
class Create:
    """Insert a new flow (the `_machine.start` transition), idempotently by flow id. A flow of a
    plan with limits (written `QUEUED`) is queued with its `priority` and `not_before` (a
    wall-clock time; None: at once), SPEC 5.8."""

    transition: Transition
    priority: int = 0
    not_before: float | None = None


Apply: TypeAlias = Callable[[Flow, Mailbox], Transition]


@attrs.frozen
class Change:
    """Change one flow by a pure transition: `apply` names it (a record of `_model._ops`, run by
    `_apply.run`), `holder` says who holds the flow after it (None: as it says).

    - With `flow` (the caller's copy, e.g. the runner's): a compare-and-set on ``flow.revision``;
      the row is not read. Without it: the row is read and held (then `expected`, if given, must
      match its revision).
    - `message_id`: look it up in the mailbox (the mailbox passed to `apply` has it in ``seen``
      if it is known). `first_queued`: pass the first queued message (a park or a resume needs
      it).
    - `lapsed_at` (with `flow`): the write also requires that no engine holds the flow at this
      time (`_sql.orphan`): a takeover (`_holders.take_over`), which must lose to the owner's
      renewal of its engine lease as much as to another writer.

    The transition's row is written iff it changed (`Transition.written`), as a compare-and-set
    on the revision it started from; its mailbox writes are applied either way. `signals`: a
    step's events and stream values, written with its row (`_signals.record`), or None.
    """

    flow_id: str
    apply: Move | Apply
    flow: Flow | None = None
    expected: int | None = None
    message_id: str | None = None
    first_queued: bool = False
    lapsed_at: float | None = None
    holder: HolderRule | None = None
    signals: Signals | None = None

    def __repr__(self) -> str:
        at = "" if self.flow is None else f", rev={self.flow.revision}"
        if self.expected is not None:
            at += f", expected={self.expected}"
        return f"Change({self.flow_id!r}, {self.apply!r}{at})"


Op: TypeAlias = Create | Change


@attrs.frozen
class Created:
    """The flow was inserted. `admitted`: the queued flows of limited plans that this write let
    go, as the same transaction wrote them (perhaps this one: `_queue.settle`)."""

    transition: Transition
    admitted: tuple[Flow, ...] = ()
    # (plan, when): the time at which time alone may let a queued flow of the plan go, as the
    # same transaction found it (`_queue.settle`): the engine arms its timer there.
    wakes: tuple[tuple[str, float], ...] = ()


@attrs.frozen
class Existing:
    """A flow with this id exists: `same` if it has the same plan name and start data."""

    flow: Flow
    same: bool


@attrs.frozen
class Changed:
    """The transition ran on the held row and was recorded (if ``transition.written``);
    `before` is the row it ran on. `more`: the writes of child flows the same transaction made
    because of it (a child's end recorded for its parent, the next kept child started, the
    parent moved on: `_kin`), each op with its result, for memory to follow them too."""

    transition: Transition
    before: Flow
    more: tuple[tuple[Op, Result], ...] = ()
    admitted: tuple[Flow, ...] = ()  # as `Created.admitted`
    wakes: tuple[tuple[str, float], ...] = ()  # as `Created.wakes`


@attrs.frozen
class Conflict:
    """The compare-and-set failed: the flow is at another revision (or owner) than expected.

    Nothing was written for this op; the other ops of the batch are not affected."""

    flow_id: str
    expected: int | None
    revision: int | None  # what the store holds (None: no such flow any more)
    owner: str | None


@attrs.frozen
class Missing:
    """No flow has this id."""

    flow_id: str


@attrs.frozen
class Refused:
    """The op's transition raised (a bug in the caller's transition, never a race): nothing was
    written for it, and the other ops of the batch are not affected."""

    flow_id: str
    error: Exception = attrs.field(eq=False)


@attrs.frozen
class Rejected:
    """The database refused this op's row (its transaction failed with `error` while the others
    of the batch committed without it: `_apart.write_apart`). Nothing was written for it."""

    flow_id: str
    error: Exception = attrs.field(eq=False)


@attrs.frozen
class Unwritten:
    """The store became unavailable (`error`) while a batch was being split: this op was not
    written, and may be tried again."""

    flow_id: str
    error: Exception = attrs.field(eq=False)


Result: TypeAlias = (
    Created | Existing | Changed | Conflict | Missing | Refused | Rejected | Unwritten | Unseen
)


def op_flow_id(op: Op) -> str:
    """The id of the flow `op` writes."""
    return op.flow_id if isinstance(op, Change) else op.transition.flow.flow_id
