"""The schedules model check (`tests/model/schedules.py`) on its default bounds: two engines
firing one schedule and dying between their read and their commit, an operator's trigger,
pause, unpause and backfill, flows that end, a minute at a time and a 78-minute jump, for
each overlap rule; and the three planted bugs it must catch (`planted_schedules.py`): the next
tick written in a second transaction, a firing that replays every due tick, the revision
check dropped."""

from __future__ import annotations

import pytest

from tests.model.checker import Counterexample
from tests.model.planted_schedules import NoRevisionCheck, Replays, TwoTransactions
from tests.model.schedules import SchedulesChecker, SchedulesConfig, SchedulesProtocol

SKIP = SchedulesConfig("skip, a jump, a trigger", overlap="skip", minutes=2, pauses=0)
QUEUE = SchedulesConfig("queue, a jump", overlap="queue", minutes=2, triggers=0, pauses=0)
QUEUE_TRIGGERED = SchedulesConfig(
    "queue, a trigger", overlap="queue", minutes=2, jumps=0, triggers=1, pauses=0
)
PAUSE = SchedulesConfig("skip, a pause and a trigger", overlap="skip", minutes=2, jumps=0)
BACKFILL = SchedulesConfig(
    "skip, a backfill", overlap="skip", minutes=2, jumps=0, triggers=0, pauses=0, backfills=1
)
ALLOW = SchedulesConfig(
    "allow, a catchup of 90 minutes, a jump, a trigger",
    overlap="allow",
    catchup=5400.0,
    minutes=2,
    pauses=0,
)
DEFAULT = (SKIP, QUEUE, QUEUE_TRIGGERED, PAUSE, BACKFILL, ALLOW)
# A jump, a trigger and a backfill (skip) or a jump and a trigger (queue) at once: 600,000
# and 140,000 states, 80 s and 15 s on one core.
LARGER = (
    SchedulesConfig("skip, a jump, a trigger, a backfill", minutes=2, pauses=0, backfills=1),
    SchedulesConfig("queue, a jump, a trigger", overlap="queue", minutes=2, pauses=0),
)


def reached(config: SchedulesConfig) -> set[str]:
    """What a bound must reach, so that no property holds for want of a case."""
    want = {"crash", "conflict", "missed", f"fired {config.overlap}"}
    if config.overlap != "allow":
        want.add("skipped")
    if config.overlap == "queue":
        want.add("queued")
    if config.triggers:
        want.add("triggered")
        if config.overlap != "allow":
            want.add("trigger held back")
    if config.pauses:
        want.add("unpaused")
    if config.backfills:
        want.add("backfill")
    return want


def check(config: SchedulesConfig) -> None:
    checker = SchedulesChecker(config)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert report.states > 1_000  # the bounds really branch
    missing = reached(config) - checker.coverage
    assert not missing, f"the bound never reaches {sorted(missing)}"


@pytest.mark.parametrize("config", DEFAULT, ids=lambda c: c.name)
def test_schedules_model_check(config: SchedulesConfig) -> None:
    check(config)


@pytest.mark.long
@pytest.mark.parametrize("config", LARGER, ids=lambda c: c.name)
def test_schedules_model_check_larger_bounds(config: SchedulesConfig) -> None:
    check(config)


def _found(config: SchedulesConfig, protocol: SchedulesProtocol) -> Counterexample:
    return SchedulesChecker(config, protocol).find()


def test_catches_the_next_tick_written_apart_from_the_ticks_flow() -> None:
    found = _found(SKIP, TwoTransactions())
    assert "ticks lost" in found.message
    assert any("dies" in step for step in found.trace)


def test_catches_a_burst_after_downtime() -> None:
    found = _found(ALLOW, Replays())
    assert "burst" in found.message
    assert any("jumps 78 minutes" in step for step in found.trace)


def test_catches_the_revision_check_dropped() -> None:
    """The shortest case: an engine's commit from a read made before another write (here the
    operator's trigger) overwrites it."""
    found = _found(PAUSE, NoRevisionCheck())
    read = next(i for i, step in enumerate(found.trace) if "reads" in step)
    engine = found.trace[read].split(" reads")[0]
    commit = next(i for i, s in enumerate(found.trace) if s.startswith(f"{engine} commits"))
    between = found.trace[read + 1 : commit]
    assert any("triggers" in s or "commits" in s for s in between), found.trace
