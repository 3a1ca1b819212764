"""The admission rule of flow control, pure: which queued flows may become active now (SPEC 5.8).

How the store makes it exact is docs/adr/0141; this module is what every transaction that takes
or gives back a slot computes, once the plan's budget row is held (so on a fleet one transaction
at a time per plan computes it, on the counts the last one left):

- `Usage`: a plan's budget: its active flows in all and per key (the counter rows), the times
  of its admissions still within the rate window (oldest first), and its fair-queue clock
  (`Usage.turn`, the turn of the latest admission).
- **Who holds a slot** is decided by the state alone (`holds_slot`): `RUNNING`, `PARKED`,
  `COMPENSATING`. Every write computes its slot change from the row's state before and after
  (`slot_change`), in the write's own transaction, whatever the path (an end, a block, a cancel's
  compensation, a resume, an admission): no path has its own release to forget. A takeover, a
  crash, a lost lease or a retried write change who runs a flow, never its state's slot; a purge
  deletes only ended flows, which hold none.
- `take` / `release`: one slot, in all and for the flow's key, and (take) one admission time in
  the window. Both refuse what would break the budget (`BudgetError`: a take over a limit, a
  release of a slot nobody holds): a bug, never a user's mistake.
- **The order** (`order`): lower priority first, then the fair-queue turn (start-time fair
  queueing: a flow queued for key ``k`` gets turn ``max(Usage.turn, k's last queued turn + 1)``,
  `turn_for`, so that a key with a backlog of n flows has them at n successive turns and a key
  that arrives later is served at the next turn, never after the backlog), then first come first
  served (`Waiting.seq`, the order of the queue's inserts).
- `admit`: the flows that may leave the queue now, in order, as many as the limits allow, and
  the usage after them; `first_by_heads` finds its first as the store's indexes do (the first of
  the heads of the keys with room). `waits_for` says why a queued flow waits (which limit, or
  its time); `next_wake` the time at which time alone can free one (a flow's `not_before`, the
  window's oldest admission leaving it): the one timer an engine arms for the plan. A slot given
  back wakes nothing: the transaction that gives it back calls `admit` itself.

Cost: this is the rule, written for clarity: `admit` looks at every queued flow it is given
(O(n) per admission). The store gives it the few the indexes of ADR 0141 name (the first ready
key's head, O(log n)); the model check (`tests/model/admission.py`) runs it on whole queues.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, final

import attrs

from ._limits import Limits
from ._types import State

#: The state of a started flow waiting for admission.
QUEUED: Final = State.QUEUED

#: The states that hold a slot: started, not ended, not queued, not blocked.
SLOT_STATES: Final = frozenset({State.RUNNING, State.PARKED, State.COMPENSATING})

#: Why a queued flow waits (`waits_for`).
CONCURRENCY, PER_KEY, RATE, TIME = "concurrency", "per_key", "rate", "time"


class BudgetError(AssertionError):
    """A take over a limit or a release of a slot nobody holds: the budget would be wrong."""


def holds_slot(state: State | str | None) -> bool:
    """Does a flow in `state` hold a slot of its plan? (None: no such flow, as after a purge.)"""
    return state in SLOT_STATES


def slot_change(before: State | str | None, after: State | str | None) -> int:
    """+1 (a take), -1 (a release) or 0: what a write from `before` to `after` does to its
    plan's budget. None is a flow that does not exist (before its start, after its purge)."""
    return int(holds_slot(after)) - int(holds_slot(before))


@final
@attrs.frozen
class Usage:
    """One plan's budget. Invariants: `active` is the sum of `keys`' counts plus the flows with
    no key; no count in `keys` is 0 (a key with no active flow is not listed); `window` is
    sorted and holds only admissions within the rate window of the last `prune`."""

    active: int = 0
    keys: tuple[tuple[str, int], ...] = ()  # (key, active flows of it), sorted by key
    window: tuple[float, ...] = ()  # admission times, oldest first
    turn: int = 0

    def of(self, key: str | None) -> int:
        """Active flows of `key` (0 for None: a plan without a key function)."""
        if key is None:
            return 0
        for k, n in self.keys:
            if k == key:
                return n
        return 0


EMPTY: Final = Usage()


@final
@attrs.frozen
class Waiting:
    """A queued flow as the queue's index holds it."""

    flow_id: str
    seq: int  # first come first served: the order of the queue's inserts
    key: str | None = None
    priority: int = 0
    turn: int = 0
    not_before: float | None = None  # None: due at once


def order(w: Waiting) -> tuple[int, int, int]:
    """The queue's order: priority, then fair-queue turn, then first come first served."""
    return (w.priority, w.turn, w.seq)


def turn_for(usage: Usage, queue: Iterable[Waiting], key: str | None) -> int:
    """The fair-queue turn of a flow queued now for `key`: the turn after its key's last queued
    one, and never before the turn being served (`Usage.turn`)."""
    if key is None:
        return usage.turn
    last = max((w.turn for w in queue if w.key == key), default=None)
    return usage.turn if last is None else max(usage.turn, last + 1)


def prune(limits: Limits, usage: Usage, now: float) -> Usage:
    """`usage` with the admissions that left the rate window by `now` dropped: a window of
    `per` seconds holds the admissions at times ``t`` with ``now - per < t``."""
    rate = limits.rate
    if not usage.window:
        return usage
    if rate is None:
        return attrs.evolve(usage, window=())
    edge = now - rate.per
    kept = tuple(t for t in usage.window if t > edge)
    return usage if len(kept) == len(usage.window) else attrs.evolve(usage, window=kept)


def waits_for(limits: Limits, usage: Usage, w: Waiting, now: float) -> str | None:
    """Why `w` may not become active at `now` (`TIME`, `CONCURRENCY`, `PER_KEY`, `RATE`), or
    None if nothing holds it (it may still wait for a flow ahead of it in `order`)."""
    if w.not_before is not None and w.not_before > now:
        return TIME
    if limits.concurrency is not None and usage.active >= limits.concurrency:
        return CONCURRENCY
    if limits.per_key is not None and usage.of(w.key) >= limits.per_key:
        return PER_KEY
    rate = limits.rate
    if rate is not None and len(prune(limits, usage, now).window) >= rate.count:
        return RATE
    return None


def _counted(keys: tuple[tuple[str, int], ...], key: str, by: int) -> tuple[tuple[str, int], ...]:
    counts = dict(keys)
    n = counts.get(key, 0) + by
    if n < 0:
        raise BudgetError(f"key {key!r}'s slot released while none is held")
    if n:
        counts[key] = n
    else:
        counts.pop(key, None)
    return tuple(sorted(counts.items()))


def take(limits: Limits, usage: Usage, key: str | None, now: float, turn: int = 0) -> Usage:
    """`usage` after one flow of `key` becomes active at `now` (a turn's admission moves the
    fair-queue clock to it). `BudgetError` if a limit has no room: the caller asked `waits_for`."""
    usage = prune(limits, usage, now)
    why = waits_for(limits, usage, Waiting("", 0, key), now)
    if why is not None:
        raise BudgetError(f"a slot taken with no room ({why}): {usage}")
    window = usage.window
    if limits.rate is not None:
        # On a fleet the engines' clocks differ: a time is never before the window's last one.
        window = (*window, max(now, window[-1]) if window else now)
    keys = usage.keys if key is None else _counted(usage.keys, key, 1)
    return Usage(usage.active + 1, keys, window, max(usage.turn, turn))


def release(usage: Usage, key: str | None) -> Usage:
    """`usage` after one active flow of `key` ends, blocks or is queued again (the window keeps
    its admission: a rate counts starts, not flows in flight)."""
    if usage.active < 1:
        raise BudgetError("a slot released while none is held")
    keys = usage.keys if key is None else _counted(usage.keys, key, -1)
    return attrs.evolve(usage, active=usage.active - 1, keys=keys)


def apply(
    limits: Limits,
    usage: Usage,
    key: str | None,
    before: State | str | None,
    after: State | str | None,
    now: float,
) -> Usage:
    """`usage` after a write that moves a flow of `key` from `before` to `after`: the one rule
    every write path follows (`slot_change`)."""
    change = slot_change(before, after)
    if change > 0:
        return take(limits, usage, key, now)
    if change < 0:
        return release(usage, key)
    return usage


def admit(
    limits: Limits, usage: Usage, queue: Sequence[Waiting], now: float
) -> tuple[tuple[Waiting, ...], Usage]:
    """The queued flows that become active at `now`, in the order they are taken, and the usage
    after them: the first in `order` with nothing holding it (`waits_for`), again and again."""
    usage = prune(limits, usage, now)
    left = sorted(queue, key=order)
    taken: list[Waiting] = []
    while True:
        first = next((w for w in left if waits_for(limits, usage, w, now) is None), None)
        if first is None:
            break
        usage = take(limits, usage, first.key, now, first.turn)
        taken.append(first)
        left.remove(first)
    return tuple(taken), usage


def heads(queue: Iterable[Waiting], now: float) -> dict[str | None, Waiting]:
    """Each key's head: its first due queued flow in `order` (a key's queue index, ADR 0141)."""
    first: dict[str | None, Waiting] = {}
    for w in queue:
        if w.not_before is not None and w.not_before > now:
            continue
        head = first.get(w.key)
        if head is None or order(w) < order(head):
            first[w.key] = w
    return first


def first_by_heads(
    limits: Limits, usage: Usage, queue: Sequence[Waiting], now: float
) -> Waiting | None:
    """The next flow to admit as the store finds it (ADR 0141): nothing if the plan's budget
    is full (concurrency, rate); else the first, in `order`, of the heads of the keys with room
    under `per_key` (the "open" keys' index). The same flow as `admit`'s first."""
    usage = prune(limits, usage, now)
    if limits.concurrency is not None and usage.active >= limits.concurrency:
        return None
    if limits.rate is not None and len(usage.window) >= limits.rate.count:
        return None
    open_heads = [
        w
        for key, w in heads(queue, now).items()
        if limits.per_key is None or usage.of(key) < limits.per_key
    ]
    return min(open_heads, key=order, default=None)


def next_wake(limits: Limits, usage: Usage, queue: Sequence[Waiting], now: float) -> float | None:
    """The earliest time after `now` at which time alone may let a queued flow of `queue` go:
    its `not_before`, or (the window full) when the window's oldest admission leaves it; None if
    only a slot given back can (or nothing waits)."""
    if not queue:
        return None
    times = [w.not_before for w in queue if w.not_before is not None and w.not_before > now]
    rate = limits.rate
    window = prune(limits, usage, now).window
    if rate is not None and len(window) >= rate.count:
        times.append(window[len(window) - rate.count] + rate.per)
    return min(times, default=None)
