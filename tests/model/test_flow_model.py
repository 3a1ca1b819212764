"""The flow's model check on the default bounds, its planted bugs, and its store's fidelity."""

from __future__ import annotations

import sqlite3
from typing import Any

import attrs
import pytest

from ferry.flow._model import _invariants, _values
from ferry.flow._model import _machine as fm
from ferry.flow._model._types import CONTINUE, State, park
from ferry.flow._model._values import EMPTY_MAILBOX, Flow, Message, Received, Shape, Transition
from ferry.flow._store import _batch, _op, _schema
from ferry.flow._store import _store as store
from tests.flow._helpers import _InlineTx
from tests.model.checker import Counterexample
from tests.model.configs import (
    ABANDON,
    CLOSES,
    CLOSES_SLOW,
    FLOW_DEFAULT,
    FLOW_SLOW,
    PLAN_MISSING,
)
from tests.model.fleet import NAMES
from tests.model.flow import FlowChecker, FlowConfig, FlowProtocol, S, Write
from tests.model.planted_flow import (
    AbandonRunsTheCompensation,
    AbandonSkipsTooLittle,
    CloseLetsGoOfARunThatBegan,
    CompensateOldestFirst,
    ParkIgnoresQueue,
    RecoveryBumpsEveryAttempt,
    RecoveryForgetsTimers,
    RecoveryReusesTheAttempt,
    RetryOnceTooOften,
    TimerWithoutRevisionCheck,
    WakeForgetsSeen,
    WriteRevisionFromCopy,
    WriteWithoutRevisionCheck,
)

BASE, DUPLICATE, LOST = FLOW_DEFAULT

# What every default bound must reach (so a property is not vacuous): every history event kind,
# every end, every delivery but DUPLICATE, a refused write, a timer that fires and one that finds
# the park over, a wake queued before the park and taken by it, recovery from every state.
REACHED = {
    *("step", "parked", "woken", "timed_out", "cancelled", "compensated", "completed"),
    *("failed", "blocked", "resumed"),
    *("end COMPLETED", "end FAILED", "end BLOCKED"),
    *("wake QUEUED", "wake RESUMED", "wake STALE", "cancel True", "cancel False", "resume True"),
    *("write refused", "timer fires", "timer finds nothing", "queued wake taken"),
    *(f"restart {s}" for s in ("RUNNING", "PARKED", "COMPENSATING", "BLOCKED", "FAILED")),
}
EXTRA = {DUPLICATE.name: {"wake DUPLICATE"}, LOST.name: {"answer lost"}}


@pytest.mark.parametrize("config", FLOW_DEFAULT, ids=lambda c: c.name)
def test_flow_model_check(config: FlowConfig) -> None:
    checker = FlowChecker(config)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert report.states > 10_000  # the bounds really branch
    missing = (REACHED | EXTRA.get(config.name, set())) - checker.coverage
    assert not missing, f"the bound never reaches {sorted(missing)}"


@pytest.mark.long
@pytest.mark.parametrize("config", FLOW_SLOW, ids=lambda c: c.name)
def test_flow_model_check_larger_bounds(config: FlowConfig) -> None:
    report = FlowChecker(config).run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")


def _counterexample(
    config: FlowConfig, protocol: FlowProtocol, *, check_machine: bool = True
) -> Counterexample:
    return FlowChecker(config, protocol, check_machine=check_machine).find()


# ---- the four required planted bugs --------------------------------------------------------------


def test_catches_a_wake_before_the_park_that_is_lost() -> None:
    found = _counterexample(BASE, ParkIgnoresQueue())
    assert "parked with messages queued: ['m1']" in found.message  # `check_invariants`
    alone = _counterexample(BASE, ParkIgnoresQueue(), check_machine=False)
    assert alone.message.startswith("parked with accepted wakes ['m1'] untaken")
    assert alone.trace == found.trace
    assert len(found.trace) == 5
    assert "wake 'm1' #0 while RUNNING 'charge'" in found.trace[3]
    assert "PARKED" in found.trace[4]


@pytest.mark.parametrize("check_machine", [True, False])
def test_catches_a_step_recorded_twice(check_machine: bool) -> None:
    # The runner's UPDATE does not compare the revision; its write commits, the answer is lost,
    # and the engine sends the same write again.
    found = _counterexample(LOST, WriteWithoutRevisionCheck(), check_machine=check_machine)
    assert found.message == "the outcome of step 'reserve' recorded twice"
    assert len(found.trace) == 3
    assert "answer lost" in found.trace[1]


def test_catches_a_stale_write_without_revision_check_after_cancel() -> None:
    # The same bug without lost answers: the runner's stale write undoes a cancel.
    found = _counterexample(BASE, WriteWithoutRevisionCheck(), check_machine=False)
    assert found.message == "the flow compensated or failed, then went RUNNING"
    assert found.trace[1].startswith("cancel while RUNNING 'reserve'")


def test_catches_compensations_out_of_order() -> None:
    found = _counterexample(BASE, CompensateOldestFirst())
    assert "holds a step at or after the current one" in found.message  # `check_invariants`
    alone = _counterexample(BASE, CompensateOldestFirst(), check_machine=False)
    assert alone.message.startswith("compensation of 'reserve' recorded out of order")
    assert "next should be 'charge'" in alone.message
    assert len(alone.trace) == 7


@pytest.mark.parametrize("check_machine", [True, False])
def test_catches_a_timeout_after_a_wake_was_accepted(check_machine: bool) -> None:
    found = _counterexample(BASE, TimerWithoutRevisionCheck(), check_machine=check_machine)
    assert found.message == "the park timed out after a wake was accepted for it"
    assert len(found.trace) == 7
    assert "RESUMED" in found.trace[4] and "timer for revision 3 fires" in found.trace[6]


# ---- more planted bugs: each remaining property can fail ----------------------------------------


def test_catches_a_step_run_more_often_than_allowed() -> None:
    found = _counterexample(BASE, RetryOnceTooOften(), check_machine=False)
    assert found.message.startswith("step 'reserve' ran 3 times; allowed 2")


def test_catches_a_revision_that_does_not_grow_by_one() -> None:
    found = _counterexample(BASE, WriteRevisionFromCopy(), check_machine=False)
    assert found.message == "revision went from 2 to 2, not +1"


def test_catches_a_duplicate_wake_accepted_again() -> None:
    found = _counterexample(DUPLICATE, WakeForgetsSeen(), check_machine=False)
    assert found.message == "wake answered Delivery.QUEUED, expected Delivery.DUPLICATE"


def test_catches_a_parked_flow_stranded_by_recovery() -> None:
    found = _counterexample(BASE, RecoveryForgetsTimers())
    assert found.message == "the flow stays PARKED at 'charge' until 10.0"
    assert found.trace[-2:] == [
        "engine 0 crashes",
        "engine 0 restarts, recovers PARKED at 'charge' until 10.0",
    ]


def test_catches_a_rerun_that_repeats_an_attempt_number() -> None:
    found = _counterexample(BASE, RecoveryReusesTheAttempt(), check_machine=False)
    assert found.message == "step 'reserve' ran as attempt 1 again (attempts never repeat)"
    assert found.trace[1].startswith("engine 0 crashes (step 'reserve' ran")


# ---- recovery and a graceful close: attempt numbers count runs that began (ADR 0064) ---------

CLOSE_REACHED = {
    *("let go", "let go refused", "close done", "close ready", "close without a runner"),
    *("rerun bumps the attempt", "rerun keeps the attempt", "end COMPLETED", "end FAILED"),
}


def test_flow_model_check_with_a_graceful_close() -> None:
    checker = FlowChecker(CLOSES)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    missing = CLOSE_REACHED - checker.coverage
    assert not missing, f"the bound never reaches {sorted(missing)}"


@pytest.mark.long
def test_flow_model_check_with_a_graceful_close_and_a_crash() -> None:
    checker = FlowChecker(CLOSES_SLOW)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert checker.coverage >= CLOSE_REACHED


@pytest.mark.parametrize("check_machine", [True, False])
def test_catches_the_old_recovery_rule_that_counts_a_run_that_never_began(
    check_machine: bool,
) -> None:
    found = _counterexample(CLOSES, RecoveryBumpsEveryAttempt(), check_machine=check_machine)
    assert found.message.startswith("step 'reserve' ran as attempt 2 as its first run")
    assert found.trace == [
        "engine 0 closes, lets go of RUNNING 'reserve' attempt 1: revision 2",
        "engine 0 restarts, recovers RUNNING 'reserve' attempt 1: revision 3,"
        " RUNNING 'reserve' attempt 2",
        "engine 0 runs step 'reserve', attempt 2  <-- fails here",
    ]


def test_catches_a_close_that_lets_go_of_a_run_that_began() -> None:
    found = _counterexample(CLOSES, CloseLetsGoOfARunThatBegan(), check_machine=False)
    assert found.message == "step 'reserve' ran as attempt 1 again (attempts never repeat)"
    assert found.trace[1].startswith("engine 0 closes, lets go of RUNNING 'reserve' attempt 1")


def test_unplanted_protocol_flags_are_on() -> None:
    p = FlowProtocol()
    assert p.runner_cas and p.blind_write_bumps_stored_revision
    assert p.timer_checks_revision and p.recovery_arms_timers and p.recovery_bumps_attempt
    assert p.close_lets_go_of_unbegun_runs_only


# ---- a machine bug the model found (fixed, ADR 0046): a cancel through an engine that lacked the
# flow's plan version compensated under the wrong step name, and `resume` then refused the flow.


def test_flow_model_check_with_a_plan_version_missing() -> None:
    checker = FlowChecker(PLAN_MISSING)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert {"resume True", "resume False", "end BLOCKED", "cancel True"} <= checker.coverage


CONFIRM_SHAPE = Shape("order", 1, ("reserve", "confirm", "ship"), (True, False, False), (1, 1, 1))


@pytest.mark.parametrize("parked", [True, False], ids=["parked", "running"])
def test_cancel_without_the_plan_version_keeps_the_flow_resumable(parked: bool) -> None:
    flow = fm.start(CONFIRM_SHAPE, "f", "{}", 0.0).flow
    flow = fm.step_done(flow, EMPTY_MAILBOX, CONFIRM_SHAPE, CONTINUE, "{}", 0.0).flow
    if parked:
        flow = fm.step_done(flow, EMPTY_MAILBOX, CONFIRM_SHAPE, park(10), "{}", 0.0).flow
    assert flow.step == "confirm" and flow.stack == (0,)
    t = fm.cancel(flow, None, "cancelled", 1.0)  # an engine that lacks ("order", 1)
    _invariants.check_invariants(t.flow, t.mailbox, CONFIRM_SHAPE)
    if t.flow.state is not State.BLOCKED:
        t = fm.block(t.flow, "the plan is missing", 2.0)
    assert _values.mismatch(t.flow, CONFIRM_SHAPE) is None  # resumable once the plan is back
    assert fm.resume(t.flow, t.mailbox, CONFIRM_SHAPE, 3.0).done


# ---- fidelity: the model's store is the real store ---------------------------------------------


class StoreMirror(FlowChecker):
    """The model, with every write it makes also sent to the real store (`_batch.write_batch`
    on SQLite, from the model's state, then rolled back); both must agree on the result, the
    row, the mailbox and the history."""

    def __init__(self, config: FlowConfig, *, drift: bool = False) -> None:
        super().__init__(config)
        self.tx = _InlineTx(sqlite3.connect(":memory:", isolation_level=None))
        self.tx.execute("BEGIN")
        _schema.create_schema(self.tx)
        self.tx.execute("COMMIT")
        self.writes = 0
        self.drift = drift  # a model that forgets the mailbox's head (the check must see it)

    def _write(self, m: S, w: Write) -> Transition | None:
        t = super()._write(m, self._drifted(w) if self.drift else w)
        tx = self.tx
        tx.execute("BEGIN")
        try:
            self._load(m)
            lapsed_at = m.now if w.orphan else None
            op = _op.Change(
                "f",
                w.apply,
                flow=w.copy,
                message_id=w.message_id,
                first_queued=w.first_queued,
                lapsed_at=lapsed_at,
            )
            (result,) = _batch.write_batch(tx, [op])
            if t is None:
                assert w.copy is not None
                refused = _op.Conflict("f", w.copy.revision, m.row.revision, m.row.owner)
                _agree("a refused write", result, refused)
                _agree("the row", store.load(tx, "f"), m.row)
            else:
                before = m.row if w.copy is None else w.copy
                _agree("the transition", result, _op.Changed(t, before))
                _agree("the row", store.load(tx, "f"), t.flow if t.written else m.row)
                _agree("the history", store.load_history(tx, "f"), list(t.events))
                box = store.load_mailbox(tx, "f")
                after = self._record(m, t, "mirror").mailbox
                _agree("the mailbox ids", box.seen, after.seen)
                _agree("the queue", box.queued, after.queued)
        finally:
            tx.execute("ROLLBACK")
        self.writes += 1
        return t

    def _drifted(self, w: Write) -> Write:
        """The write as a drifting model makes it: without the mailbox's head."""
        return attrs.evolve(w, first_queued=False) if w.first_queued else w

    def _load(self, m: S) -> None:
        """Put the model's row, mailbox and (in a fleet) engine leases in the (empty) tables."""
        for table in ("flows", "history", "mailbox", "engines"):
            self.tx.execute(f"DELETE FROM flow_{table}")
        for e, held in enumerate(m.leases):  # held: until well after now; lapsed: well before
            until = m.now + (100.0 if held else -100.0)
            store.heartbeat(self.tx, NAMES[e], until, m.now)
        (created,) = _batch.write_batch(self.tx, [_op.Create(Transition(m.row, EMPTY_MAILBOX, 0))])
        assert isinstance(created, _op.Created)
        payloads = {q.message_id: q.payload for q in m.mailbox.queued}
        received = tuple(
            Received(Message(mid, payloads.get(mid, "null")), taken=status == "taken")
            for mid, _, status in m.ghost.ledger
        )

        def mailbox(flow: Flow, box: Any) -> Transition:
            return Transition(flow, box, flow.revision, messages=received)

        _batch.write_batch(self.tx, [_op.Change("f", mailbox, flow=m.row)])


def _agree(what: str, real: object, model: object) -> None:
    if real != model:
        raise AssertionError(f"the store and the model disagree on {what}: {real!r} != {model!r}")


MIRRORED = attrs.evolve(BASE, name="mirrored", wakes=("m1", "m1"), crashes=0)


def test_the_model_store_behaves_as_the_real_store() -> None:
    mirror = StoreMirror(MIRRORED)
    report = mirror.run()
    print(f"\n{report.states} states, {mirror.writes} writes mirrored, {report.seconds:.2f}s")
    assert mirror.writes > 1000
    every_write = {"write refused", "timer fires", "timer finds nothing", "queued wake taken"}
    every_write |= {"wake QUEUED", "wake RESUMED", "wake DUPLICATE", "wake STALE", "cancel True"}
    every_write |= {"resume True", "blocked", "failed", "completed", "timed_out"}
    assert every_write <= mirror.coverage, sorted(every_write - mirror.coverage)


def test_the_store_mirror_sees_a_model_that_drifts() -> None:
    found = StoreMirror(MIRRORED, drift=True).find()
    assert found.message.startswith("the store and the model disagree on the transition")


# ---- an operator's abandon of a blocked flow -----------------------------------------------------


def test_flow_model_check_with_an_abandon() -> None:
    checker = FlowChecker(ABANDON)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert {"abandoned", "abandon True", "end FAILED", "end BLOCKED"} <= checker.coverage


@pytest.mark.parametrize(
    ("protocol", "says"),
    [
        (AbandonRunsTheCompensation, "abandoned, then COMPENSATING"),
        (AbandonSkipsTooLittle, "abandon says it skipped"),
    ],
)
def test_catches_an_abandon_that_is_not_one(protocol: type[FlowProtocol], says: str) -> None:
    found = _counterexample(ABANDON, protocol())
    assert says in str(found)
