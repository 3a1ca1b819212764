"""Exhaustive model check of a schedule's firing (SPEC 5.9, docs/adr/0144, 0146): one stored
schedule, two engines that fire it and die, an operator who triggers, pauses, unpauses and
backfills it, flows that end, a wall clock that steps a minute at a time and jumps 78 minutes.

The store is the model's: one row (`_schedule.Row`) and a table of flows by id, where a start is
the store's idempotent `Create` (a second start of one id is the same start: it creates
nothing). Each engine's firing is a read and a commit, in two steps of the search: the read
takes a snapshot of the row (and of whether its previous flow has ended) and decides by the
protocol's pure transition (`_schedule.fire`, `ended`); the commit is atomic (one
transaction) and compares the revision it read (the store's compare-and-set, `_schedules.fire`
in the real store, where the row is also held in between). An engine may die between its read
and its commit (its decision is lost; it reads again); time may pass and the other engine and
the operator may act in between. The operator's writes (trigger, pause, unpause, backfill) are
one transaction each, as `_store/_schedules.py` makes them.

The rule is the tests' own, one tick a minute on the minute (no cron library: docs/adr/0143);
the clock is always at half past a minute, so a trigger's tick (the current whole second) is
never a regular tick's, and a regular tick is told by its time.

In every reachable state (`SchedulesChecker._check_state`) and at every commit (`_commit`):

1. no regular tick is started twice (by two commits), no flow id is created twice;
2. every tick the row's next tick moved past is exactly one of: started, missed, skipped or
   the one waiting: ``passed + skipped triggers == started + missed + skipped + waiting``
   (an engine's second transaction still to come counts as done: only a death loses it);
3. no burst: one firing starts at most one regular tick, the next tick it writes is after the
   time it fired at, and a tick it starts is at most ``max(catchup, ON_TIME)`` late;
4. the next tick never moves back but by an unpause (from now);
5. ``"skip"`` and ``"queue"``: never two of the schedule's flows active at once (a backfill's
   flows apart: a backfill starts whatever the overlap says); a waiting tick starts only once
   the flow before it has ended; a paused schedule starts a regular tick only as the waiting
   one;
6. a backfill starts each tick of its span at most once and says how many it started; it
   leaves the row as it was.

`SchedulesProtocol` is the real transitions; `tests/model/planted_schedules.py` plants one bug
each (the next tick written in a second transaction, a firing that replays every due tick, the
revision check dropped) and `tests/model/test_schedules_model.py` checks that each is caught.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import attrs

from ferry.flow._model import _schedule
from ferry.flow._model._schedule import Fired, Row
from tests.model.checker import Search, _step_violation

T0 = 1_796_169_600.0  # 2026-12-02T00:00:00Z, on the minute
EVERY = 60.0
NAME = "every"
JUMP = 78 * 60.0


class Every:
    """One tick a minute, on the minute."""

    def after(self, t: float) -> float | None:
        return (math.floor(t / EVERY) + 1) * EVERY


RULE = Every()


def regular(t: float) -> bool:
    return t % EVERY == 0


def ticks_in(lo: float | None, hi: float | None) -> int:
    """How many ticks T with lo <= T < hi (0 if either is None or hi <= lo)."""
    if lo is None or hi is None:
        return 0
    return max(0, math.ceil(hi / EVERY) - math.ceil(lo / EVERY))


@attrs.frozen
class SchedulesConfig:
    """Bounds of one check: the overlap rule, `catchup`, the clock's minutes (`minutes`) and
    jumps, each actor's budget."""

    name: str
    overlap: str = "skip"
    catchup: float = 0.0
    minutes: int = 3
    jumps: int = 1
    crashes: int = 1
    triggers: int = 1
    pauses: int = 1
    backfills: int = 0
    engines: int = 2


class SchedulesProtocol:
    """The transitions the engines use: the real ones. Subclass to plant a bug."""

    #: the row written in one transaction and the tick's flow in a second one
    split_write = False
    #: the commit compares the revision it read
    check_revision = True

    def fire(self, row: Row, now: float, overlap: str, catchup: float, last_active: bool) -> Fired:
        return _schedule.fire(
            row, RULE, now, overlap=overlap, catchup=catchup, last_active=last_active
        )

    def ended(self, row: Row) -> Fired:
        return _schedule.ended(row)

    def trigger(self, row: Row, now: float, overlap: str, last_active: bool) -> Fired:
        return _schedule.trigger(row, now, overlap=overlap, last_active=last_active)


class Pending(NamedTuple):
    """An engine's firing between its read and its commit."""

    what: str  # "fire" or "waiting"
    revision: int  # the revision it read
    read: Row  # the row it read
    now: float  # when it read
    fired: Fired
    second: float | None = None  # split_write: the tick whose flow is still to be written


class S(NamedTuple):
    """One state: the store, the clock, the engines and the ghost counts the checks use."""

    now: float
    row: Row
    flows: tuple[tuple[str, bool, bool], ...]  # (flow id, active, by a backfill), sorted
    engines: tuple[Pending | None, ...]
    passed: int  # ticks the row's next tick moved past
    trigger_skips: int  # triggers the overlap rule skipped (counted in `skipped` too)
    fired: frozenset[float]  # the regular ticks the row's commits started
    minutes: int
    jumps: int
    crashes: int
    triggers: int
    pauses: int
    backfills: int


def _flow(m: S, fid: str) -> tuple[str, bool, bool] | None:
    return next((f for f in m.flows if f[0] == fid), None)


def _active(m: S, fid: str | None) -> bool:
    f = None if fid is None else _flow(m, fid)
    return f is not None and f[1]


def _created(m: S, fid: str, by_backfill: bool = False) -> tuple[S, bool]:
    """The store's idempotent create: (state, was it new)."""
    if _flow(m, fid) is not None:
        return m, False
    return m._replace(flows=tuple(sorted((*m.flows, (fid, True, by_backfill))))), True


class SchedulesChecker(Search):
    """Breadth-first search of every interleaving for one `SchedulesConfig`."""

    def __init__(self, config: SchedulesConfig, protocol: SchedulesProtocol | None = None) -> None:
        self.config = config
        self.protocol = protocol or SchedulesProtocol()
        self.name = config.name
        self.coverage: set[str] = set()

    def initial(self) -> S:
        now = T0 + 30
        row = _schedule.declared(NAME, RULE, now, None, changed=False)
        assert row is not None
        c = self.config
        return S(
            now=now,
            row=row,
            flows=(),
            engines=(None,) * c.engines,
            passed=0,
            trigger_skips=0,
            fired=frozenset(),
            minutes=c.minutes,
            jumps=c.jumps,
            crashes=c.crashes,
            triggers=c.triggers,
            pauses=c.pauses,
            backfills=c.backfills,
        )

    def canon(self, m: S) -> Any:
        return m

    # ---------------------------------------------------------------------------- steps

    def successors(self, m: S) -> Iterator[tuple[str, S]]:
        if m.minutes:
            yield "a minute passes", m._replace(now=m.now + EVERY, minutes=m.minutes - 1)
        if m.jumps:
            yield "the wall clock jumps 78 minutes", m._replace(now=m.now + JUMP, jumps=m.jumps - 1)
        for fid, active, _b in m.flows:
            if active:
                yield f"{fid} ends", self._end(m, fid)
        for e, pending in enumerate(m.engines):
            if pending is None:
                yield from self._reads(m, e)
                continue
            yield self._commit(m, e, pending)
            if m.crashes:
                self.coverage.add("crash")
                dead = m._replace(engines=_set(m.engines, e, None), crashes=m.crashes - 1)
                yield f"engine {e} dies before its commit", dead
        yield from self._operator(m)

    def _end(self, m: S, fid: str) -> S:
        flows = tuple((f, False if f == fid else a, b) for f, a, b in m.flows)
        return m._replace(flows=flows)

    def _reads(self, m: S, e: int) -> Iterator[tuple[str, S]]:
        """Engine `e` reads the row: a firing if it is due, a waiting tick's start if the flow
        before it has ended."""
        row = m.row
        c = self.config
        last_active = _active(m, row.last_flow)
        if not row.paused and row.next_tick is not None and row.next_tick <= m.now:
            fired = self.protocol.fire(row, m.now, c.overlap, c.catchup, last_active)
            pending = Pending("fire", row.revision, row, m.now, fired)
            yield f"engine {e} reads the due row at {_t(m.now)}", self._pend(m, e, pending)
        if row.waiting_tick is not None and not last_active:
            fired = self.protocol.ended(row)
            pending = Pending("waiting", row.revision, row, m.now, fired)
            yield f"engine {e} reads a waiting tick", self._pend(m, e, pending)

    def _pend(self, m: S, e: int, pending: Pending) -> S:
        return m._replace(engines=_set(m.engines, e, pending))

    # ---------------------------------------------------------------------------- commit

    def _commit(self, m: S, e: int, p: Pending) -> tuple[str, S]:
        label = f"engine {e} commits its {p.what} (read at revision {p.revision})"
        engines = _set(m.engines, e, None)
        if p.second is not None:  # split_write: the flow's own transaction
            m2, _new = _created(m, _schedule.tick_id(NAME, p.second))
            return f"engine {e} writes its tick's flow", m2._replace(engines=engines)
        if self.protocol.check_revision and m.row.revision != p.revision:
            self.coverage.add("conflict")
            return label + ": another revision, nothing written", m._replace(engines=engines)
        new = p.fired.row
        if new is None:
            return label + ": nothing to write", m._replace(engines=engines)
        self._check_commit(label, m, p, new)
        passed = m.passed
        if p.what == "fire":
            passed += ticks_in(m.row.next_tick, new.next_tick)
            self.coverage.add(f"fired {self.config.overlap}")
        m = m._replace(row=new, passed=passed, engines=engines)
        start = p.fired.start
        if start is None:
            return label, m
        fired = m.fired | {start} if regular(start) else m.fired
        m = m._replace(fired=fired)
        if self.protocol.split_write:
            return label + " (the row)", m._replace(
                engines=_set(engines, e, p._replace(second=start))
            )
        m, _new = _created(m, _schedule.tick_id(NAME, start))
        return label + f": starts {_t(start)}", m

    def _check_commit(self, label: str, m: S, p: Pending, new: Row) -> None:
        start = p.fired.start
        old = m.row
        if start is not None and regular(start) and start in m.fired:
            raise _step_violation(label, f"the tick {_t(start)} is started twice")
        if p.what != "fire":
            if start is not None and _active(m, old.last_flow):
                raise _step_violation(label, "a waiting tick started while the flow before runs")
            return
        if (
            old.next_tick is not None
            and new.next_tick is not None
            and new.next_tick < old.next_tick
        ):
            raise _step_violation(label, "the next tick moved back")
        if new.next_tick is not None and new.next_tick <= p.now:
            raise _step_violation(label, "a burst: after a firing the next tick is already due")
        if start is None:
            return
        late = p.now - start
        if start != old.waiting_tick and late > max(self.config.catchup, _schedule.ON_TIME):
            raise _step_violation(label, f"a tick started {late:.0f} s late: a catch-up burst")
        if old.paused and start != old.waiting_tick:
            raise _step_violation(label, "a paused schedule started a regular tick")
        if start == old.waiting_tick and _active(m, old.last_flow):
            raise _step_violation(label, "a waiting tick started while the flow before runs")

    # -------------------------------------------------------------------------- operator

    def _operator(self, m: S) -> Iterator[tuple[str, S]]:
        c = self.config
        row = m.row
        if m.triggers:
            fired = self.protocol.trigger(row, m.now, c.overlap, _active(m, row.last_flow))
            yield self._triggered(m, fired)
        if m.pauses and not row.paused:
            new = _schedule.pause(row)
            assert new is not None
            yield "the operator pauses it", m._replace(row=new, pauses=m.pauses - 1)
        if row.paused:
            new = _schedule.unpause(row, RULE, m.now)
            assert new is not None
            self.coverage.add("unpaused")
            yield "the operator unpauses it", m._replace(row=new)
        if m.backfills:
            yield self._backfill(m)

    def _triggered(self, m: S, fired: Fired) -> tuple[str, S]:
        label = f"the operator triggers it at {_t(m.now)}"
        m = m._replace(triggers=m.triggers - 1)
        if fired.row is None:
            return label + ": nothing to write", m
        skips = m.trigger_skips + (fired.row.skipped - m.row.skipped)
        m = m._replace(row=fired.row, trigger_skips=skips)
        if fired.start is None:
            self.coverage.add("trigger held back")
            return label + ": held back by the overlap rule", m
        if regular(fired.start):  # a waiting regular tick started first
            m = m._replace(fired=m.fired | {fired.start})
        self.coverage.add("triggered")
        m, _new = _created(m, _schedule.tick_id(NAME, fired.start))
        return label + f": starts {_t(fired.start)}", m

    def _backfill(self, m: S) -> tuple[str, S]:
        span = _schedule.backfill_ticks(RULE, m.now - 2 * EVERY, m.now)  # the last two ticks
        absent = [t for t in span if _flow(m, _schedule.tick_id(NAME, t)) is None]
        before = m.row
        n = 0
        for t in span:
            m, new = _created(m, _schedule.tick_id(NAME, t), by_backfill=True)
            n += new
        if n != len(absent) or m.row != before:
            raise _step_violation("backfill", f"backfill said {n}, started {len(absent)}")
        self.coverage.add("backfill")
        return f"the operator backfills {len(span)} ticks ({n} new)", m._replace(
            backfills=m.backfills - 1
        )

    # --------------------------------------------------------------------------- checks

    def _check_state(self, m: S) -> None:
        ids = [f for f, _a, _b in m.flows]
        assert len(ids) == len(set(ids)), "a flow id created twice"
        row = m.row
        in_flight = sum(
            1 for p in m.engines if p is not None and p.second is not None and regular(p.second)
        )
        waiting = int(row.waiting_tick is not None and regular(row.waiting_tick))
        started = (
            sum(1 for t in m.fired if _flow(m, _schedule.tick_id(NAME, t)) is not None) + in_flight
        )
        accounted = started + row.missed + row.skipped + waiting
        assert m.passed + m.trigger_skips == accounted, (
            f"ticks lost or counted twice: {m.passed} passed (+{m.trigger_skips} triggers"
            f" skipped), {started} started, {row.missed} missed, {row.skipped} skipped,"
            f" {waiting} waiting"
        )
        if self.config.overlap != "allow":
            running = [f for f, a, b in m.flows if a and (not b or f == row.last_flow)]
            assert len(running) <= 1, f"two of the schedule's flows active at once: {running}"
        if row.waiting_tick is not None:
            self.coverage.add("queued")
        if row.missed:
            self.coverage.add("missed")
        if row.skipped:
            self.coverage.add("skipped")

    def _check_terminal(self, m: S) -> None:
        assert all(p is None for p in m.engines), "an engine left with a write to make"


def _set(t: tuple[Any, ...], i: int, v: Any) -> tuple[Any, ...]:
    return (*t[:i], v, *t[i + 1 :])


def _t(t: float) -> str:
    return _schedule.tick_text(t)[11:19]
