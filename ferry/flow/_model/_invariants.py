"""The invariants of a flow: what no correct run of the machine can break.

PURE, like `_machine`. The store's tests, the model check and the property test call
`check_invariants` on every value they see; the engine does not (its writes come from
`_machine`, whose transitions keep these by construction).

- A parked flow has an empty queue (a park takes a queued message at once): no wake is lost
  because it came before the park. Every queued id is in `seen`.
- The stack is strictly increasing, holds only steps with a compensation, and only steps before
  the current one (up to and including it when parked: a step that parked has completed). A
  compensating flow is at the top of its stack. Terminal flows have an empty stack.
- Only a running flow has `wake`/`timed_out`; only a parked flow has a deadline or `on_timeout`;
  only a blocked flow has `blocked`/`blocked_from`; terminal flows have no step, and every
  other flow has one, except a compensation that a cancel without the plan started (its name
  comes from the plan of the engine that runs it, `step_name`).
"""

from __future__ import annotations

import itertools

from ._values import (
    BLOCKED,
    COMPENSATING,
    FAILED,
    PARKED,
    QUEUED,
    RUNNING,
    TERMINAL,
    Flow,
    InvariantError,
    Mailbox,
    Shape,
    mismatch,
)

__all__ = ["check_invariants"]


def check_invariants(
    flow: Flow, mailbox: Mailbox | None = None, shape: Shape | None = None
) -> None:
    """Raise `InvariantError` naming the first broken invariant (module doc); None if all hold.

    With `mailbox`, also the mailbox's; with `shape`, also that the flow's position and stack fit
    the plan. Cost: O(stack + queue).
    """

    def bad(what: str) -> None:
        raise InvariantError(f"flow {flow.flow_id!r} ({flow.state}): {what}")

    if flow.revision < 1:
        bad(f"revision {flow.revision} < 1")
    if flow.attempt < 1:
        bad(f"attempt {flow.attempt} < 1")
    stack = flow.stack
    if any(b <= a for a, b in itertools.pairwise(stack)):
        bad(f"compensation stack {stack} is not strictly increasing")
    state = flow.state
    if state is QUEUED and flow.queue_key is None:
        bad("queued without a queue key (only a plan with limits queues)")
    if state is QUEUED and flow.blocked_from is not None:
        state = BLOCKED  # a resumed flow waiting for its slot: its row is as it was blocked
    limit = flow.step_index + (1 if state in (PARKED, COMPENSATING) else 0)
    if state is BLOCKED and flow.blocked_from in (PARKED, COMPENSATING):
        limit += 1
    compensating = state is COMPENSATING or (state is BLOCKED and flow.blocked_from is COMPENSATING)
    if state in TERMINAL:
        if flow.step is not None:
            bad("a terminal flow has a step")
        if stack:
            bad(f"a terminal flow has compensations left: {stack}")
    elif flow.step is None and not compensating:  # a compensation may await its name (`cancel`)
        bad("an unfinished flow has no step")
    if stack and (stack[0] < 0 or stack[-1] >= limit):
        bad(f"compensation stack {stack} holds a step at or after the current one")
    if state is COMPENSATING and (not stack or stack[-1] != flow.step_index):
        bad(f"compensating step {flow.step_index}, but the stack is {stack}")
    running = state is RUNNING or (state is BLOCKED and flow.blocked_from is RUNNING)
    if not running and (flow.wake is not None or flow.timed_out):
        bad("wake/timed_out set outside a running step")
    parked = state is PARKED or (state is BLOCKED and flow.blocked_from is PARKED)
    if not parked and (flow.park_deadline is not None or flow.on_timeout is not None):
        bad("a park deadline outside a park")
    if state is PARKED and flow.on_timeout not in ("compensate", "continue"):
        bad(f"parked with on_timeout {flow.on_timeout!r}")
    if (flow.state is BLOCKED) != (flow.blocked is not None) or (state is BLOCKED) != (
        flow.blocked_from is not None
    ):
        bad("blocked/blocked_from set iff the flow is blocked")
    if state is BLOCKED and flow.blocked_from not in (RUNNING, PARKED, COMPENSATING):
        bad(f"blocked from {flow.blocked_from}")
    if state in (COMPENSATING, FAILED) and flow.error is None:
        bad("compensating or failed without an error")
    if mailbox is not None:
        ids = [m.message_id for m in mailbox.queued]
        if len(set(ids)) != len(ids):
            bad(f"a message is queued twice: {ids}")
        if not set(ids) <= mailbox.seen:
            bad("a queued message id is not in `seen`")
        if state is PARKED and mailbox.queued:
            bad(f"parked with messages queued: {ids} (a wake before the park was not taken)")
    if shape is not None and state is not BLOCKED and mismatch(flow, shape) is not None:
        bad(str(mismatch(flow, shape)))
    if shape is not None and any(not shape.compensable[i] for i in stack if i < len(shape.steps)):
        bad(f"the stack {stack} holds a step without a compensation")
