"""The admission model check on its default bounds, its planted bugs, and the pure rule's order.

`tests/model/admission.py` explores every interleaving of two engines' transactions on flows of
one limited plan (crash, lapsed lease, cancel, block and resume, a delayed start, a rate); each
planted bug of `planted_admission.py` is caught with its shortest trace, so each property can
fail. The rule's own examples (priority, fair turns, the sliding window) fail if `_admission`'s
order, `turn_for` or window is changed.
"""

from __future__ import annotations

import attrs
import pytest

from ferry.flow._model import _admission as adm
from ferry.flow._model._admission import Usage, Waiting
from ferry.flow._model._limits import Limits, Rate
from ferry.flow._model._types import State
from tests.model.admission import (
    ADMISSION_DEFAULT,
    ADMISSION_SLOW,
    AdmissionChecker,
    AdmissionConfig,
)
from tests.model.checker import Counterexample
from tests.model.planted_admission import (
    AdmissionFromACopy,
    BlockKeepsItsSlot,
    CompensationEndAdmitsNothing,
    LockedRowNotifiesNothing,
    NoScanAfterALapse,
    ParkGivesItsSlotBack,
)

PER_KEY, ORDERED, LOCKED, RATED = ADMISSION_DEFAULT

# What each default bound must reach, so that no property holds for want of a case.
REACHED = {"starts", "completes", "admitted", "crashes", "restarts", "takes", "admits"}
WORLD = {"blocks", "resumes", "compensated", "cancels queued", "cancels RUNNING"}
EXTRA = {
    PER_KEY.name: {
        *WORLD,
        *("parks", "wakes", "cancels PARKED", "lease lapsed"),
        *("waits for per_key", "waits for concurrency"),
    },
    ORDERED.name: {*WORLD, "timer", "waits for time", "waits for concurrency"},
    LOCKED.name: {"locks", "commits", "waits for None", "waits for per_key"},
    RATED.name: {*WORLD, "timer", "waits for rate", "waits for time", "waits for per_key"},
}


@pytest.mark.parametrize("config", ADMISSION_DEFAULT, ids=lambda c: c.name)
def test_admission_model_check(config: AdmissionConfig) -> None:
    checker = AdmissionChecker(config)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert report.states > 1000  # the bounds really branch
    missing = (REACHED | EXTRA[config.name]) - checker.coverage
    assert not missing, f"the bound never reaches {sorted(missing)}"


@pytest.mark.long
@pytest.mark.parametrize("config", ADMISSION_SLOW, ids=lambda c: c.name)
def test_admission_model_check_larger_bounds(config: AdmissionConfig) -> None:
    report = AdmissionChecker(config).run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")


# ---- the planted bugs ------------------------------------------------------------------------


def test_catches_a_slot_not_given_back_on_one_path() -> None:
    found = AdmissionChecker(PER_KEY, BlockKeepsItsSlot()).find()
    assert found.message == (
        "the budget counts 1 active {'a': 1}, the flows are 0 {}: a slot leaked or doubled"
    )
    assert found.trace == ["E0 starts 0", "E0 blocks 0"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (PER_KEY, "2 active flows of key 'a', more than per_key=1"),
        (ORDERED, "2 active flows, more than concurrency=1"),
    ],
    ids=["per_key", "concurrency"],
)
def test_catches_two_engines_admitting_into_one_slot(config: AdmissionConfig, message: str) -> None:
    found = AdmissionChecker(config, AdmissionFromACopy()).find()
    assert found.message == message
    assert found.trace[-2:] == ["E0 claims ['0']", "E1 claims ['1']"]
    assert "E1 looks: admits ['1']" in found.trace


def test_catches_a_queued_flow_never_admitted_while_a_slot_is_free() -> None:
    found = AdmissionChecker(PER_KEY, CompensationEndAdmitsNothing()).find()
    assert found.message == (
        "queued flow 1 may be admitted at 0.0 (a slot is free) and nothing will admit it"
    )
    assert found.trace[-2:] == ["E0 cancels RUNNING 0", "E0 compensated 0"]


def test_the_stuck_queue_is_also_caught_at_the_end_alone() -> None:
    # The terminal check on its own (the state check's rule taken out): the flow stays queued.
    class EndOnly(AdmissionChecker):
        def _check_state(self, m: object) -> None:
            pass

    with pytest.raises(Counterexample, match="flow 1 left QUEUED"):
        EndOnly(attrs.evolve(PER_KEY, crashes=0), CompensationEndAdmitsNothing()).run()


def test_catches_a_parked_flow_that_gives_its_slot_back() -> None:
    # The model counts active flows by SPEC 5.8's own list, not by the rule it checks.
    found = AdmissionChecker(PER_KEY, ParkGivesItsSlotBack()).find()
    assert found.message == (
        "the budget counts 0 active {}, the flows are 1 {'a': 1}: a slot leaked or doubled"
    )
    assert found.trace == ["E0 starts 0", "E0 parks 0"]


def test_catches_a_locked_row_whose_commit_wakes_nothing() -> None:
    # The admission after flow 0's end skipped flow 1's row, locked by a wake for it.
    found = AdmissionChecker(LOCKED, LockedRowNotifiesNothing()).find()
    assert found.message == (
        "queued flow 1 may be admitted at 0.0 (a slot is free) and nothing will admit it"
    )
    assert found.trace[-3:] == [
        "E0 locks queued 1 (a wake for it)",
        "E0 completes 0",
        "E0 commits its wake of queued 1",
    ]


def test_catches_a_lapse_that_wakes_no_admission() -> None:
    # The wake's transaction rolled back with its engine: no commit, no notification.
    found = AdmissionChecker(LOCKED, NoScanAfterALapse()).find()
    assert found.message.endswith("(a slot is free) and nothing will admit it")
    assert found.trace[-2:] == ["E0 completes 0", "E0 crashes"]


# ---- the rule's order, fairness and window ------------------------------------------------------


def _key(data: object) -> str:
    return "k"


def test_lower_priority_first_then_first_come_first_served() -> None:
    limits = Limits(concurrency=1)
    queue = [Waiting("late", 2), Waiting("first", 1), Waiting("urgent", 3, priority=-5)]
    taken, usage = adm.admit(limits, adm.EMPTY, queue, 0.0)
    assert [w.flow_id for w in taken] == ["urgent"]
    taken, _ = adm.admit(limits, adm.release(usage, None), queue[:2], 0.0)
    assert [w.flow_id for w in taken] == ["first"]


def test_a_key_with_a_backlog_never_starves_a_key_that_comes_later() -> None:
    limits = Limits(concurrency=1, key=_key)
    usage = adm.EMPTY
    queue: list[Waiting] = []
    for n in range(5):  # key a queues five flows: turns 0..4
        queue.append(Waiting(f"a{n}", n, "a", turn=adm.turn_for(usage, queue, "a")))
    assert [w.turn for w in queue] == [0, 1, 2, 3, 4]
    served = []
    for _ in range(2):
        (w,), usage = adm.admit(limits, usage, queue, 0.0)
        served.append(w.flow_id)
        queue.remove(w)
        usage = adm.release(usage, "a")
    queue.append(Waiting("b0", 9, "b", turn=adm.turn_for(usage, queue, "b")))
    (w,), usage = adm.admit(limits, usage, queue, 0.0)
    assert served == ["a0", "a1"] and w.flow_id == "b0"  # at the next turn, not after a4


def test_a_rate_is_a_sliding_window_and_says_when_it_frees() -> None:
    limits = Limits(rate=Rate(2, per=10.0))
    usage = adm.take(limits, adm.take(limits, adm.EMPTY, None, 0.0), None, 4.0)
    queue = [Waiting("q", 0)]
    assert adm.waits_for(limits, usage, queue[0], 9.0) == adm.RATE
    assert adm.next_wake(limits, usage, queue, 9.0) == 10.0  # when the admission at 0 leaves
    taken, usage = adm.admit(limits, usage, queue, 10.0)
    assert [w.flow_id for w in taken] == ["q"] and usage.window == (4.0, 10.0)
    assert adm.next_wake(limits, usage, [Waiting("r", 1)], 10.0) == 14.0


def test_a_delayed_flow_waits_for_its_time_and_wakes_then() -> None:
    limits = Limits(concurrency=5)
    queue = [Waiting("later", 0, not_before=30.0)]
    assert adm.admit(limits, adm.EMPTY, queue, 29.0)[0] == ()
    assert adm.waits_for(limits, adm.EMPTY, queue[0], 29.0) == adm.TIME
    assert adm.next_wake(limits, adm.EMPTY, queue, 29.0) == 30.0
    assert [w.flow_id for w in adm.admit(limits, adm.EMPTY, queue, 30.0)[0]] == ["later"]


def test_the_slot_follows_the_state_and_the_budget_refuses_a_wrong_count() -> None:
    assert [adm.slot_change(None, s) for s in (adm.QUEUED, State.RUNNING)] == [0, 1]
    assert adm.slot_change(State.PARKED, State.BLOCKED) == -1
    assert adm.slot_change(State.BLOCKED, adm.QUEUED) == 0
    assert adm.slot_change(State.COMPENSATING, State.FAILED) == -1
    assert adm.slot_change(State.COMPLETED, None) == 0  # a purge
    assert adm.slot_change(State.RUNNING, State.RUNNING) == 0  # a takeover, a retried write
    limits = Limits(concurrency=1, key=_key, per_key=1)
    one = adm.take(limits, adm.EMPTY, "a", 0.0)
    assert one == Usage(active=1, keys=(("a", 1),))
    with pytest.raises(adm.BudgetError, match="no room"):
        adm.take(limits, one, "b", 0.0)
    with pytest.raises(adm.BudgetError, match="none is held"):
        adm.release(adm.EMPTY, "a")
    with pytest.raises(adm.BudgetError, match="key 'b'"):
        adm.release(one, "b")
