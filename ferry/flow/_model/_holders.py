"""Who holds a flow: the fleet's bookkeeping of an active flow's engine.

PURE, like `_machine`, which re-exports these. An active flow is run by the engine named in
`owner`, for as long as that engine's own lease runs (one row per engine, renewed by the engine:
no flow row is written to renew it). `released_at` is None while the owner holds the flow,
and the time it let it go once it has (then any engine may take it over). `assign_holder` is the
one rule for who holds a flow after a write (the writer, nobody after an operator's write, or
the engine that runs it kept); `take_over` is how an engine takes an active flow that its owner
no longer holds (a compare-and-set on the revision and on the owner's lease having lapsed,
checked by the store; attempt + 1 if someone may have run the step); `rerun` and `let_go` are
recovery at open and an engine's close. Non-active flows are nobody's.
"""

from __future__ import annotations

import attrs

from ._rows import bump, replace, require
from ._values import ACTIVE, EMPTY_MAILBOX, Flow, Mailbox, Transition

# `assign_holder` copies a `Transition`, and `_machine` a `Mailbox`, positionally (`attrs.evolve`
# looks every field up by name, about half the cost of a small copy): their fields, in order.
assert [a.name for a in attrs.fields(Transition)] == [
    "flow",
    "mailbox",
    "expected",
    "events",
    "messages",
    "delivery",
    "done",
]
assert [a.name for a in attrs.fields(Mailbox)] == ["queued", "seen"]

__all__ = ["assign_holder", "let_go", "rerun", "take_over"]


def take_over(flow: Flow, owner: str, now: float) -> Transition:
    """`owner` takes over an active flow that no engine holds: a write (revision + 1, no event),
    to be made as a compare-and-set on the revision the taker read *and* on the flow still
    being nobody's (its owner's lease lapsed, or it let the flow go, or it never had one):
    the store checks that, since an owner's renewal writes no flow row.

    Its step or compensation runs again: attempt + 1 if the flow had an owner, who may have run
    it (as recovery after a crash); the same attempt if it had none (an operator made it
    runnable: nobody ran it yet). Raises `InvalidTransition` unless the flow is active."""
    require(flow.state in ACTIVE, flow, "take_over")
    new = bump(flow, now, owner=owner, released_at=None, attempt=_next_run(flow))
    return Transition(new, EMPTY_MAILBOX, flow.revision)


def _next_run(flow: Flow) -> int:
    """The attempt number of the next run of an active flow's step or compensation, taken up
    by an engine that did not make the last write: one more if an engine held the flow (it may
    have begun a run that recorded nothing), the same if nobody did (an operator's write, or an
    engine that let the flow go before its run began: `let_go`)."""
    return flow.attempt + 1 if flow.owner is not None else flow.attempt


def rerun(flow: Flow, now: float) -> Transition:
    """Recovery at open: the active flow runs again in the engine that opens, as attempt + 1 if
    a run may have begun (`_next_run`), else as the same attempt (attempts count runs that
    began). Raises `InvalidTransition` unless the flow is active."""
    require(flow.state in ACTIVE, flow, "rerun")
    new = bump(flow, now, attempt=_next_run(flow))
    return Transition(new, EMPTY_MAILBOX, flow.revision)


def let_go(flow: Flow, now: float) -> Transition:
    """An engine that closes lets go of an active flow whose current run had not begun (it
    waited for a runner, or for its retry's backoff): nobody holds it, so the engine that runs
    it next keeps its attempt number. Raises `InvalidTransition` unless the flow is active."""
    require(flow.state in ACTIVE, flow, "let_go")
    new = bump(flow, now, owner=None, released_at=None)
    return Transition(new, EMPTY_MAILBOX, flow.revision)


def assign_holder(
    t: Transition, before: Flow | None, writer: str | None, *, keep_runner: bool
) -> Transition:
    """Who holds the flow after a write: `t` with its row's `owner`/`released_at` set.

    - A flow that the write leaves active is held by `writer` (the engine that made the write
      runs it; an operator's engine passes None and leaves it to whichever engine takes it
      over) -- except, with `keep_runner`, when `before` was active and held by another engine:
      an outside request (a cancel) on a flow another engine runs leaves it with that engine,
      whose step must stop before anything else runs (one step at a time, across a fleet too).
      If that engine is gone, the flow is an orphan like its others, and is taken over as one.
    - A flow that is not active is nobody's (owner and lease None): a parked flow holds nothing.

    Unwritten transitions are returned as they are. No cost beyond a copy of the row and of `t`,
    both positional.
    """
    if not t.written:
        return t
    flow = t.flow
    holder = writer
    if flow.state in ACTIVE:
        if (
            keep_runner
            and before is not None
            and before.state in ACTIVE
            and before.owner is not None
            and before.owner != writer
        ):
            holder = before.owner
    else:
        holder = None
    if flow.owner == holder and flow.released_at is None:
        return t
    held = replace(flow, owner=holder, released_at=None)
    return Transition(held, t.mailbox, t.expected, t.events, t.messages, t.delivery, t.done)
