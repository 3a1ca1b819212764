"""The schedules of an engine (SPEC 5.9, docs/adr/0144, 0146, 0153): declaring them at open,
the one timer task that fires them, the waiting ticks that ends start, and the calls
`Engine.trigger`, `pause`, `unpause`, `unschedule` and `backfill`.

Every write is one transaction of the store's `_schedules` functions, which start a tick's
flow and move the schedule's next tick together (exactly once across restarts and a fleet).
What this part adds is when to call them, and what memory follows:

- **One timer.** One number sits in a `stm.TVar`: the earliest next tick of the schedules of
  this engine's plans (`_schedules.next_due`, one indexed read). The task sleeps in
  ``retry(deadline=...)`` until it (on the engine's `Clock`: a MockClock drives it in tests),
  at most `_schedule.ON_TIME` of trio time: trio's clock stands still while a host sleeps, so
  a wall clock that jumped is seen within a minute (compared with the number in memory; no
  query on one file). Under a MockClock, whose wall clock is virtual time, only the ticks.
  When due it fires in claims (`_schedules.fire_due`) until a claim comes back short, then
  reads the number again. In a fleet it wakes every ``scan_interval`` too, and reads it again
  then (one indexed read; the claim and the waiting ticks' read only when there is a schedule):
  another engine may have declared, unpaused or fired a schedule.
  A call that can move a tick earlier (`unpause`) and an end that frees a waiting tick poke it.
- **The flows a firing starts** go where a start's go: `Writes.track` makes them live (this
  engine runs them; a fleet's names this engine their holder).
- **Waiting ticks** (``overlap="queue"``): a firing that leaves one behind a flow remembers that
  flow; when this engine's write ends it (`ended`, from the write path), the task starts the
  waiting tick (`_schedules.start_waiting`). At open, and at each of a fleet's wake-ups, the
  ones whose flow ended without this engine hearing of it (a SIGKILL between, another engine's
  end) are started too (`_schedules.waiting_ready`).
- **Observers** are told of every firing that started or passed over a tick (`ScheduleTick`).

Only the store's unavailability is retried by the task (`_retry`); any other error ends the
engine's block.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Final, TypeVar

import trio

import stm
from ferry.projected import Store, Tx

from .._model import _checks, _schedule
from .._model._errors import UnknownPlan, UnknownSchedule
from .._model._observed import ScheduleTick
from .._model._values import Flow, Shape
from .._store import _op, _schedules, _store
from . import _observe, _queues, _read, _retry
from ._clock import Clock
from ._config import Config
from ._live import Tally
from ._mode import Mode
from ._writes import Writes

T = TypeVar("T")

_log = logging.getLogger("ferry.flow")

Shapes = Mapping[tuple[str, int], Shape]

#: The operators' calls refused inside the transaction (before it wrote anything).
_REFUSED: Final = (LookupError, ValueError)


class _Refused:
    """A refusal raised inside a call's transaction, carried out of it (`_guarded`)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _guarded(fn: Callable[[Tx], T]) -> Callable[[Tx], T | _Refused]:
    def run(tx: Tx) -> T | _Refused:
        try:
            return fn(tx)
        except _REFUSED as exc:  # raised before the call wrote anything
            return _Refused(exc)

    return run


class Schedules:
    """The schedules of one engine (the module docstring).

    Invariants: `_queued` maps a flow to the schedule whose waiting tick waits for it to end,
    as this engine last wrote or read that schedule's row; `_ends` holds schedules whose
    waiting tick may start now (their flow ended), for the task to try; the task reads the
    next due tick again after every firing round."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        writes: Writes,
        tally: Tally,
        shapes: Shapes,
        config: Config,
        mode: Mode,
    ) -> None:
        self._store = store
        self._clock = clock
        self._writes = writes
        self._tally = tally
        self._shapes = shapes
        self._serve = config.serve
        self._owner = config.owner if config.serve else None
        # Other engines write the store too (a fleet): they may declare, unpause or fire.
        self._shared = shared = mode.shared
        self._declared = config.schedules
        self._every = min(_schedule.ON_TIME, config.scan_interval) if shared else None
        self._due: stm.TVar[float | None] = stm.TVar(None)
        self._poke: stm.TVar[int] = stm.TVar(0)
        self._queued: dict[str, str] = {}
        self._ends: list[str] = []
        self.needed = False  # does this engine run the timer task (`open`)

    # ------------------------------------------------------------------------------- open

    async def open(self) -> None:
        """At open, a serving engine: declare its schedules (one transaction), then learn of
        the waiting ticks and the next due tick. The store's unavailability is retried."""
        now = self._clock.now()
        if self._declared:
            declare = partial(_schedules.declare, schedules=self._declared, now=now)
            said = await self._own(declare, "declaring the engine's schedules")
            _log.info(
                "flow engine %r declared %d schedules (%s)",
                self._owner,
                len(said),
                ", ".join(f"{n}: {how}" for n, how in sorted(said.items())),
                extra={"owner": self._owner},
            )
        stored = await self._own(_schedules.stored_all, "reading the schedules")
        for s in stored:
            self._remember(s.row)  # a waiting tick whose flow is not live: tried at once
        # One file: a schedule is stored only by an open, so with none there is no task. A
        # fleet's engine may fire what another declares later.
        self.needed = bool(stored) or self._shared
        self._poked()

    def _remember(self, row: _schedule.Row | None) -> None:
        """Follow a row this engine wrote or read: the flow its waiting tick waits for."""
        if row is not None and row.waiting_tick is not None and row.last_flow is not None:
            self._queued[row.last_flow] = row.name
            if row.last_flow not in self._writes.live:  # it may have ended already
                self._ends.append(row.name)
                self._poked()

    async def _own(self, fn: Callable[[Tx], T], what: str) -> T:
        """One transaction of the engine's own, retried while the store is unavailable."""
        return await _retry.retrying(partial(_read.own, self._store, fn), what=what)

    # --------------------------------------------------------------------------- the task

    def ended(self, flow: Flow) -> None:
        """This engine's write ended `flow` (the write path's hook; no checkpoint): if a
        waiting tick waits for it, the task starts it."""
        name = self._queued.pop(flow.flow_id, None)
        if name is not None:
            self._ends.append(name)
            self._poked()

    def _poked(self) -> None:
        stm.atomically_nowait(lambda: self._poke.set(self._poke.get() + 1))

    def _sleep(self, seen: int, until: float) -> None:
        if self._poke.get() != seen:
            return
        due = self._due.get()
        if due is not None:
            until = min(until, self._clock.trio_time(due))
        if trio.current_time() < until:
            stm.retry(deadline=None if math.isinf(until) else until)

    async def run(self) -> None:
        """The timer task (the module docstring). Runs until cancelled."""
        # Under a MockClock no host's clock can jump: no look but at the ticks (a month of
        # daily ticks is 31 wake-ups, not 44,640).
        every = math.inf if self._clock.virtual else _schedule.ON_TIME
        if self._every is not None:
            every = self._every
        fired_at = -1  # the poke count of the last firing round
        while True:
            seen = self._poke.peek()
            if self._ends:
                await self._start_waiting()
            due = self._due.peek()
            if self._shared:  # another engine may have declared, unpaused or fired one
                due = await self._read_due()
                if due is not None:
                    await self._waiting_ready()
            if seen != fired_at or (due is not None and self._clock.now() >= due):
                fired_at = seen
                await self._fire_due()
            await stm.atomically(self._sleep, seen, trio.current_time() + every)

    async def _fire_due(self) -> None:
        """Fire every due schedule, a claim at a time, then read the next due tick."""
        shapes = self._shapes
        while True:
            now = self._clock.now()
            epoch = self._writes.epoch
            fire = partial(_schedules.fire_due, now=now, shapes=shapes, owner=self._owner)
            outcomes = await self._own(fire, "firing the due schedules")
            for outcome in outcomes:
                self._took(outcome, epoch, now, "tick")
            if len(outcomes) < _schedules.CLAIM:
                break
        await self._read_due()

    async def _read_due(self) -> float | None:
        """Read the earliest next tick of this engine's schedules into memory (one indexed
        read)."""
        plans = list(self._shapes)
        due = await self._own(partial(_schedules.next_due, plans=plans), "reading the next tick")
        stm.atomically_nowait(self._due.set, due)
        return due

    async def _start_waiting(self) -> None:
        names, self._ends = sorted(set(self._ends)), []
        for name in names:
            now = self._clock.now()
            epoch = self._writes.epoch
            start = partial(
                _schedules.start_waiting, name=name, now=now, shapes=self._shapes, owner=self._owner
            )
            outcome = await self._own(_guarded(start), f"starting schedule {name!r}'s waiting tick")
            if isinstance(outcome, _schedules.Outcome):
                self._took(outcome, epoch, now, "waiting")

    async def _waiting_ready(self) -> None:
        """A fleet's wake-up: the waiting ticks whose flow ended elsewhere."""
        self._ends += await self._own(_schedules.waiting_ready, "reading the waiting ticks")
        if self._ends:
            await self._start_waiting()

    def _took(self, outcome: _schedules.Outcome, epoch: int, now: float, how: str) -> None:
        """Memory follows one committed outcome: its flow becomes live, a waiting tick is
        remembered, an id held by another flow is logged, the observers are told."""
        if not outcome.written:
            return
        result = outcome.result
        if isinstance(result, _op.Created):
            _queues.started(self._writes, result, epoch)
        elif isinstance(result, _op.Existing) and not result.same:
            _log.warning(
                "schedule %r did not start its tick: flow id %r is held by another flow (of plan"
                " %r, other data); the schedule went on to its next tick",
                outcome.name,
                outcome.flow_id,
                result.flow.plan,
                extra={"schedule": outcome.name, "flow_id": outcome.flow_id},
            )
        self._remember(outcome.row)
        started = int(isinstance(result, _op.Created))
        self._tell(outcome.name, how, outcome.flow_id if started else None, started, outcome, now)

    def _tell(
        self,
        name: str,
        how: str,
        flow_id: str | None,
        started: int,
        outcome: _schedules.Outcome | None,
        now: float,
    ) -> None:
        observers = self._tally.observers
        skipped = 0 if outcome is None else outcome.skipped
        missed = 0 if outcome is None else outcome.missed
        if observers and (started or skipped or missed):
            tick = ScheduleTick(
                schedule=name,
                how=how,
                flow_id=flow_id,
                started=started,
                skipped=skipped,
                missed=missed,
                at=now,
            )
            _observe.ticked(observers, tick)

    # ---------------------------------------------------------------------------- the calls

    async def _shapes_now(self) -> Shapes:
        """The plan versions a call may start flows of: a serving engine's own; an operator's,
        every version an engine recorded in the store."""
        if self._serve:
            return self._shapes
        stored = await _read.read(self._store, _store.load_plans, "reading the registered plans")
        return {(sh.name, sh.version): sh for sh, _at in stored}

    async def _call(self, name: str, fn: Callable[[Tx], T | None], what: str) -> T:
        """A call's one transaction: a cancel point first, then shielded (a call that raised
        `Cancelled` did not happen). `UnknownSchedule` for a name not stored; a plan this
        engine lacks is `UnknownPlan`; a store error `ferry.Failed`."""
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.CancelScope(shield=True):
            got = await _read.read(self._store, _guarded(fn), f"{what} schedule {name!r}")
        if isinstance(got, _Refused):
            error = got.error
            if isinstance(error, LookupError):
                raise UnknownPlan(str(error)) from None
            raise error
        if got is None or got is False:
            raise UnknownSchedule(f"no schedule named {name!r} is stored")
        return got

    async def trigger(self, name: str) -> str | None:
        """`Engine.trigger`."""
        name = _schedule.check_name(name)
        shapes = await self._shapes_now()
        now = self._clock.now()
        epoch = self._writes.epoch
        fn = partial(_schedules.trigger, name=name, now=now, shapes=shapes, owner=self._owner)
        outcome = await self._call(name, fn, "triggering")
        if not outcome.written:  # the same second as the last start: the same flow
            return _schedule.tick_id(name, now)
        self._took(outcome, epoch, now, "trigger")
        result = outcome.result
        if isinstance(result, _op.Created) or (isinstance(result, _op.Existing) and result.same):
            return outcome.flow_id
        return None

    async def pause(self, name: str) -> None:
        """`Engine.pause`."""
        name = _schedule.check_name(name)
        fn = partial(_schedules.pause, name=name, now=self._clock.now())
        await self._call(name, fn, "pausing")

    async def unpause(self, name: str) -> None:
        """`Engine.unpause`."""
        name = _schedule.check_name(name)
        fn = partial(_schedules.unpause, name=name, now=self._clock.now())
        await self._call(name, fn, "unpausing")
        self._poked()

    async def unschedule(self, name: str) -> None:
        """`Engine.unschedule`."""
        name = _schedule.check_name(name)
        await self._call(name, partial(_schedules.unschedule, name=name), "unscheduling")

    async def backfill(self, name: str, start: float, end: float) -> int:
        """`Engine.backfill`."""
        name = _schedule.check_name(name)
        for what, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(
                    f"backfill's {what} must be wall-clock seconds (a number), got"
                    f" {_checks.describe(value, 100)}"
                )
            if not math.isfinite(value):
                raise ValueError(f"backfill's {what} must be a finite time, got {value!r}")
        if start > end:
            raise ValueError(f"backfill's start ({start!r}) is after its end ({end!r})")
        shapes = await self._shapes_now()
        now = self._clock.now()
        epoch = self._writes.epoch
        fn = partial(
            _schedules.backfill,
            name=name,
            start=float(start),
            end=float(end),
            now=now,
            shapes=shapes,
            owner=self._owner,
        )
        results: Sequence[_op.Result] = await self._call(name, fn, "backfilling")
        started = 0
        for result in results:
            if isinstance(result, _op.Created):
                started += 1
                _queues.started(self._writes, result, epoch)
        self._tell(name, "backfill", None, started, None, now)
        return started
