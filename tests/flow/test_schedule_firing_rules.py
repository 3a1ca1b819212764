"""The pure transitions of a schedule's row (`fire`, `trigger`, `ended`, `pause`, `unpause`,
`declared`, docs/adr/0144), driven at random by hypothesis: a wall clock that steps by seconds,
minutes, 78 minutes or a day, flows that end, every overlap policy and a few catchups. After each
step: every tick passed by a firing is accounted once (started, queued, missed or skipped),
no flow id is started twice, one firing starts at most one flow and leaves the next tick after
now, a started tick was at most ``max(catchup, ON_TIME)`` late, ``skip`` and ``queue`` never have
two of the schedule's flows active, a paused schedule fires nothing.

The same machine with a planted burst (the next tick after the one started instead of after
now), a planted double count, or a waiting tick started while the flow before it runs, fails:
the checks can fail. The rule is one tick a minute,
written here: the transitions hold for any `Rule`."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ferry.flow._model import _schedule
from ferry.flow._model._schedule import Fired, Row

T0 = 1_796_169_600.0  # 2026-12-02T00:00:00Z
EVERY = 60.0


class Minutely:
    def after(self, t: float) -> float | None:
        return (math.floor(t / EVERY) + 1) * EVERY


RULE = Minutely()


def ticks_in(lo: float, hi: float | None) -> int:
    """How many ticks T with lo <= T < hi."""
    if hi is None:
        return 0
    return max(0, math.ceil(hi / EVERY) - math.ceil(lo / EVERY))


class Firing(RuleBasedStateMachine):
    """A schedule's row and its flows, moved only by the model's transitions."""

    def __init__(self) -> None:
        super().__init__()
        self.now = T0 + 30.5
        row = _schedule.declared("nightly", RULE, self.now, None, changed=False)
        assert row is not None and row.next_tick == T0 + 60
        self.row: Row = row
        self.active: dict[str, bool] = {}  # flow id -> still active
        self.offered: set[float] = set()  # the regular ticks a firing or an end started
        self.overlap = "skip"
        self.catchup = 0.0

    @initialize(overlap=st.sampled_from(_schedule.OVERLAPS), catchup=st.sampled_from([0, 90, 3600]))
    def policy(self, overlap: str, catchup: float) -> None:
        self.overlap = overlap
        self.catchup = float(catchup)

    def _last_active(self) -> bool:
        return self.row.last_flow is not None and self.active.get(self.row.last_flow, False)

    def _take(self, fired: Fired, *, regular: bool = False) -> None:
        """Write what `fired` says, as the store would: its flow is created unless a flow of
        that id exists (a trigger in the second of a tick, or of another trigger: the id makes
        it the same start, which runs nothing again)."""
        if fired.row is None:
            assert fired.start is None
            return
        assert fired.row.revision == self.row.revision + 1
        if fired.start is not None:
            fid = fired.flow_id
            assert fid is not None
            assert fired.row.last_flow == fid and fired.row.last_tick == fired.start
            if regular:
                assert fired.start not in self.offered, f"the tick {fid} offered twice"
                self.offered.add(fired.start)
            self.active.setdefault(fid, True)
        self.row = fired.row

    @rule(seconds=st.sampled_from([1, 13, 59, 60, 61, 600, 78 * 60 + 20, 86400]))
    def time_passes(self, seconds: int) -> None:
        self.now += seconds

    @precondition(lambda self: self.row.next_tick is not None and self.row.next_tick <= self.now)
    @rule()
    def timer_fires(self) -> None:
        before = self.row
        fired = _schedule.fire(
            before,
            RULE,
            self.now,
            overlap=self.overlap,
            catchup=self.catchup,
            last_active=self._last_active(),
        )
        if before.paused:
            assert fired.row is None, "a paused schedule fired"
            return
        assert fired.row is not None
        after = fired.row
        assert after.next_tick is not None and after.next_tick > self.now, "a burst to come"
        assert before.next_tick is not None
        passed = ticks_in(before.next_tick, after.next_tick)
        started_new = fired.start is not None and fired.start != before.waiting_tick
        queued_new = after.waiting_tick is not None and after.waiting_tick != before.waiting_tick
        accounted = (
            (after.missed - before.missed)
            + (after.skipped - before.skipped)
            + int(started_new)
            + int(queued_new)
        )
        if fired.counted_all:
            assert accounted == passed, (passed, before, after, fired.start)
        else:  # a long downtime: the count stopped, and says so
            assert after.missed - before.missed >= _schedule.MAX_COUNTED
            assert accounted < passed
        if started_new:
            assert fired.start is not None
            assert self.now - fired.start <= max(self.catchup, _schedule.ON_TIME)
        self._take(fired, regular=fired.start is not None and fired.start % EVERY == 0)

    @rule()
    def timer_fires_early(self) -> None:
        """A stale timer (another engine fired meanwhile): a tick not due writes nothing."""
        if self.row.next_tick is not None and self.row.next_tick > self.now:
            fired = _schedule.fire(
                self.row,
                RULE,
                self.now,
                overlap=self.overlap,
                catchup=self.catchup,
                last_active=self._last_active(),
            )
            assert fired == Fired(row=None)

    @rule()
    def triggered(self) -> None:
        before = self.row
        fired = _schedule.trigger(
            before, self.now, overlap=self.overlap, last_active=self._last_active()
        )
        if fired.row is not None:
            assert fired.row.next_tick == before.next_tick
        self._take(fired)

    @precondition(lambda self: any(self.active.values()))
    @rule(data=st.data())
    def a_flow_ends(self, data: st.DataObject) -> None:
        fid = data.draw(st.sampled_from(sorted(f for f, a in self.active.items() if a)))
        self.active[fid] = False
        if fid == self.row.last_flow:
            self._take(_schedule.ended(self.row))

    @rule()
    def paused(self) -> None:
        new = _schedule.pause(self.row)
        assert (new is None) == self.row.paused
        if new is not None:
            self.row = new

    @rule()
    def unpaused(self) -> None:
        new = _schedule.unpause(self.row, RULE, self.now)
        assert (new is None) == (not self.row.paused)
        if new is not None:
            assert new.next_tick is not None and new.next_tick > self.now
            self.row = new

    @invariant()
    def one_at_a_time_unless_allowed(self) -> None:
        if self.overlap != "allow":
            assert sum(self.active.values()) <= 1, "two of the schedule's flows active"
        if self.overlap == "skip":
            assert self.row.waiting_tick is None

    @invariant()
    def a_waiting_tick_waits_for_an_active_flow(self) -> None:
        if self.row.waiting_tick is not None:
            assert self._last_active(), "a tick waits for a flow that has ended"


QUICK = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_the_firing_rules_hold_at_random() -> None:
    run_state_machine_as_test(Firing, settings=QUICK)


def _burst(rule: _schedule.Rule, due: float, now: float, catchup: float) -> _schedule.CatchUp:
    """Planted: the next tick is the one after the tick started, not the first after now."""
    got = _real_catch_up(rule, due, now, catchup)
    if got.start is None:
        return got
    return attrs.evolve(got, next=rule.after(got.start), skipped=0)


def _double_count(
    rule: _schedule.Rule, due: float, now: float, catchup: float
) -> _schedule.CatchUp:
    """Planted: a missed tick counted twice."""
    got = _real_catch_up(rule, due, now, catchup)
    return attrs.evolve(got, skipped=2 * got.skipped)


def _eager(row: Row, last_active: bool) -> tuple[Row, float | None, bool]:
    """Planted: a waiting tick starts while the flow before it still runs."""
    return _real_settled(row, False)


_real_catch_up = _schedule.catch_up
_real_settled = _schedule._settled


@pytest.mark.parametrize(
    ("name", "planted"),
    [("catch_up", _burst), ("catch_up", _double_count), ("_settled", _eager)],
)
def test_a_planted_bug_is_found(
    name: str, planted: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_schedule, name, planted)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            Firing,
            settings=settings(
                QUICK,
                max_examples=200,
                phases=[Phase.generate],  # found is enough: no shrinking
                report_multiple_bugs=False,
                database=None,
                print_blob=False,
            ),
        )


def test_a_declaration_sets_the_next_tick_from_now_and_keeps_a_pause() -> None:
    now = T0 + 30.5
    new = _schedule.declared("nightly", RULE, now, None, changed=False)
    assert new == Row(name="nightly", next_tick=T0 + 60)
    stored = attrs.evolve(new, revision=7, paused=True, next_tick=T0 - 600, missed=3)
    assert _schedule.declared("nightly", RULE, now, stored, changed=False) is None
    again = _schedule.declared("nightly", RULE, now, stored, changed=True)
    assert again == attrs.evolve(stored, revision=8, next_tick=T0 + 60)  # no old tick caught up


def test_a_firing_of_a_schedule_that_has_no_more_ticks_or_is_paused_writes_nothing() -> None:
    row = Row(name="nightly", next_tick=None)
    fired = _schedule.fire(row, RULE, T0, overlap="skip", catchup=0, last_active=False)
    assert fired == Fired(row=None)
    paused = Row(name="nightly", next_tick=T0, paused=True)
    fired = _schedule.fire(paused, RULE, T0 + 1, overlap="skip", catchup=0, last_active=False)
    assert fired == Fired(row=None)
    triggered = _schedule.trigger(paused, T0 + 1.5, overlap="skip", last_active=False)
    assert triggered.flow_id == "nightly@2026-12-02T00:00:01Z"  # a trigger runs while paused
