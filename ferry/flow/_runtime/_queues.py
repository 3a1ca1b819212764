"""The engine's side of flow control (SPEC 5.8, docs/adr/0141, 0147, 0165-0167): the budget
rows registered at open, the queues admitted then, and one timer per plan with a queue (a
limited plan's, or a plan's whose delayed starts gave it one: docs/adr/0180).

- **At open** (`at_open`): the limits of every plan version this engine has are checked
  against those the store holds for the same (plan, version) (`_limits.same_as_registered`:
  the later engine's `open_engine` raises naming both); each limited plan's budget row is
  registered with its newest version's limits (every version shares the one budget: ADR 0166);
  then, if this engine serves, what the time passed while no engine ran lets go is admitted
  (`_admission.came_due`) and each plan's timer armed.
- **The timer** (`fire`, `arm`): one deadline per plan in the engine's deadline heap, under a
  flow id no flow can have (`timer_id`): at `_admission.next_wake` (a delayed flow's time, the
  rate window's oldest admission leaving it). At it, one transaction marks the delayed flows
  due and admits (`_admission.came_due`), and reads the next wake. The batch's own writes
  re-arm it (`_op.Created.wakes`, `_queue.settle`); nothing polls the flows.

The admitted flows are followed as the engine's own writes (`Writes.admitted`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Final

from ferry.projected import Store, Tx

from .._model import _limits
from .._model._limits import Limits
from .._model._types import State
from .._model._values import Flow
from .._store import _admission, _op, _queue, _store
from . import _retry
from ._clock import Clock
from ._versions import Versions

if TYPE_CHECKING:
    from ._writes import Writes

_log = logging.getLogger("ferry.flow")

#: The revision of a plan queue's timer in the deadline heap: never stale.
QUEUE_TIMER: Final = -2
#: The prefix of a plan timer's entry in the deadline heap (a NUL: no flow id holds one).
PREFIX: Final = "\x00queue:"


def timer_id(plan: str) -> str:
    """The heap's flow id of the timer of `plan`'s queue."""
    return PREFIX + plan


def plan_of(timer: str) -> str | None:
    """The plan whose queue's timer `timer` is, or None for a flow's id."""
    return timer[len(PREFIX) :] if timer.startswith(PREFIX) else None


def plan_limits(versions: Versions) -> dict[str, Limits]:
    """Each limited plan of this engine and the limits of its newest version that has any."""
    out: dict[str, tuple[int, Limits]] = {}
    for (name, version), shape in versions.shapes.items():
        if shape.limits is not None and (name not in out or out[name][0] < version):
            out[name] = (version, shape.limits)
    return {name: lim for name, (_v, lim) in sorted(out.items())}


def _check_and_register(tx: Tx, versions: Versions) -> None:
    """Refuse a (plan, version) registered with other limits; register each plan's budget."""
    for shape, _at in _store.load_plans(tx):
        ours = versions.shapes.get((shape.name, shape.version))
        if ours is not None:
            theirs = _limits.stored(shape.limits)
            _limits.same_as_registered(
                shape.name, shape.version, ours.limits, theirs, "an engine of this store"
            )
    for name, lim in plan_limits(versions).items():
        _admission.register(tx, name, lim)


async def check_and_register(store: Store, versions: Versions) -> None:
    """`at_open`'s first half, before the engine registers its plan shapes."""
    if versions.shapes:
        await store.transact(partial(_check_and_register, versions=versions))


def _admit_due(
    tx: Tx, plan: str, now: float, owner: str | None
) -> tuple[tuple[Flow, ...], float | None]:
    lim = _admission.limits_of(tx, plan)
    taken = _admission.came_due(tx, plan, lim, now, owner or "")
    flows = _queue.read_admitted(tx, [a.flow_id for a in taken]) if taken else ()
    return flows, _admission.next_wake(tx, plan, lim, now)


async def fire(writes: Writes, plan: str, deadline: float) -> None:
    """The plan's timer came (or the engine opened): admit what time lets go, arm the next.
    The store's unavailability is retried."""
    now = max(writes._clock.now(), deadline)
    owner = writes.admits_as
    flows, wake = await _retry.retrying(
        partial(writes._store.transact, partial(_admit_due, plan=plan, now=now, owner=owner)),
        what=f"admitting the queued flows of plan {plan!r} whose time came",
        extra={"plan": plan},
    )
    admitted(writes, flows, writes.epoch)
    if wake is not None:
        arm(writes, plan, wake)


async def with_queues(writes: Writes, versions: Versions) -> list[str]:
    """This engine's plans that have a queue: its limited plans, and those without limits
    that delayed starts gave one (docs/adr/0180; one read of the store's budget rows)."""
    ours = {name for name, _version in versions.shapes}
    queued = await writes._store.transact(_admission.budget_plans)
    return sorted(set(plan_limits(versions)) | (ours & set(queued)))


async def at_open(writes: Writes, clock: Clock, versions: Versions) -> None:
    """A serving engine's first admission of each of its plans that has a queue (`fire` at
    now)."""
    for name in await with_queues(writes, versions):
        await fire(writes, name, clock.now())


def arm(writes: Writes, plan: str, when: float) -> None:
    """Arm the timer of `plan`'s queue at `when` (a serving engine's), unless one as early is
    armed and not yet fired."""
    armed = writes.queue_timers.get(plan)
    if not writes._serve or (armed is not None and armed <= when):
        return
    writes.queue_timers[plan] = when
    writes._arm(when, timer_id(plan), QUEUE_TIMER)


def admitted(writes: Writes, flows: Sequence[Flow], epoch: int) -> None:
    """Queued flows a committed write admitted (their rows as it left them): followed as the
    engine's own writes, so that it runs those it holds."""
    for flow in flows:
        writes.track(State.QUEUED, flow, True, epoch=epoch)


def follow(writes: Writes, result: _op.Created | _op.Changed, epoch: int) -> None:
    """What a committed result says of its plans' queues: the flows it admitted, the timers."""
    admitted(writes, result.admitted, epoch)
    for plan, when in result.wakes:
        arm(writes, plan, when)


def started(writes: Writes, result: _op.Created, epoch: int) -> None:
    """A start this engine committed outside its write path (a schedule's tick): memory follows
    it as `Writes._applied` does, its queue's admissions and timers too."""
    writes.track(None, result.transition.flow, True, epoch=epoch)
    follow(writes, result, epoch)


async def when_engines_leave(
    writes: Writes, clock: Clock, versions: Versions, since: float | None
) -> float:
    """A fleet engine's scan: if an engine's lease ended since the last scan (`since`, by the
    lease clock: it closed, or it lapsed: killed or frozen), each of this engine's plans that
    has a queue (`with_queues`: a plan without limits has one once a delayed start gave it
    one, perhaps after this engine opened) is admitted and its timer read again (`fire`): the
    room a killed transaction of it left (a queued head it held, passed over by another's
    admission) and the delayed starts and rate windows whose timer was its own (docs/adr/0170,
    0180). An engine that lived between two scans counts too. One read per scan (and one more
    when an engine left); the lease clock's time, for the next."""
    read = partial(_store.engines_left_on_clock, now=clock.now(), since=since)
    at, left = await writes._store.transact(read)
    if left:
        for name in await with_queues(writes, versions):
            await fire(writes, name, clock.now())
    return at
