"""The shell's protocol model check on the default bounds, its planted bugs, and its fidelity."""

from __future__ import annotations

import random
from typing import Any

import pytest

from ferry import _lanes as core
from ferry._lanes import Admission, Item, Limits
from ferry._room import Room
from tests.model.checker import Counterexample
from tests.model.configs import SHELL_DEFAULT, SHELL_SLOW
from tests.model.planted_shell import (
    AbortKeepsInput,
    AdmitRingsOnlyForReady,
    AnswerIgnoresTask,
    BellReadAfterCheckpoint,
    CancelledWorkerForgetsCallers,
    CloseWaitsBeforeCancellingDirectCalls,
    ReleaseForgetsToRing,
    ReleaseIgnoresTheBound,
    TakeNeverRings,
)
from tests.model.shell import ShellChecker, ShellConfig, ShellProtocol

DIRECT, WEIGHTS, DELAY, RANKED, BOUND_DIRECT, BOUND_DELAY, PLAIN, HANG, NEVER_CLOSED = SHELL_DEFAULT


# Under `-m long` (some 10 s of the default run's budget), each checked in the default run by
# its twin: DIRECT by `test_take_ring_is_not_needed_for_wakeups[direct]` (the same configuration,
# the take's ring left out), BOUND_DIRECT by the lanes model's own "at most 2 calls in flight".
_TWINNED = (DIRECT, BOUND_DIRECT)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(c, id=c.name, marks=[pytest.mark.long] if c in _TWINNED else [])
        for c in SHELL_DEFAULT
    ],
)
def test_shell_model_check(config: ShellConfig) -> None:
    report = ShellChecker(config).run()
    assert report.states > 1000  # the bounds really branch
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")


@pytest.mark.long
@pytest.mark.parametrize("config", SHELL_SLOW, ids=lambda c: c.name)
def test_shell_model_check_larger_bounds(config: ShellConfig) -> None:
    report = ShellChecker(config).run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")


def _counterexample(
    config: ShellConfig, protocol: ShellProtocol, wakeups: str = "oversleep"
) -> Counterexample:
    with pytest.raises(Counterexample) as info:
        ShellChecker(config, protocol, wakeups=wakeups).run()
    print(f"\n{info.value}")
    return info.value


# ---- planted bugs ------------------------------------------------------------------------------


def test_catches_release_that_forgets_to_ring_stuck() -> None:
    found = _counterexample(DIRECT, ReleaseForgetsToRing(), wakeups="stuck")
    assert found.message.startswith("lost wake-up: a lane ready at 0.0, every worker asleep")
    assert found.trace == [
        "caller 0 (a) admits at 0.0: CLAIMED",
        "caller 2 (a) admits at 0.0: ADMITTED",
        "worker 0 takes nothing, sleeps until None",
        "worker 1 takes nothing, sleeps until None",
        "direct call 0 (a) returns; key released",
    ]


def test_catches_release_that_forgets_to_ring_oversleep() -> None:
    # With batches only (no direct calls) the releasing worker takes the lane itself, so nothing
    # is stuck; but the other worker sleeps through the ready lane while it could serve it.
    found = _counterexample(DELAY, ReleaseForgetsToRing())
    assert "oversleeps" in found.message
    assert any("releas" in step or "returns" in step for step in found.trace)


def test_catches_lost_wakeup_at_quiescence() -> None:
    # Without the wake-up properties, the never-closed bound ends with a caller never answered.
    found = _counterexample(NEVER_CLOSED, AdmitRingsOnlyForReady(), wakeups="off")
    assert "never got an outcome: parked" in found.message


def test_catches_admission_that_rings_only_for_ready_lanes() -> None:
    found = _counterexample(DELAY, AdmitRingsOnlyForReady(), wakeups="stuck")
    assert found.message.startswith("lost wake-up: a lane due at 1.0")
    assert found.trace == [
        "worker 0 takes nothing, sleeps until None",
        "worker 1 takes nothing, sleeps until None",
        "caller 0 (a) admits at 0.0: ADMITTED",
    ]


def test_catches_bell_read_after_a_checkpoint() -> None:
    found = _counterexample(DELAY, BellReadAfterCheckpoint(), wakeups="stuck")
    assert found.message.startswith("lost wake-up: a lane ready at 0.0")
    assert found.trace[-2:] == [
        "worker 0 reads the bell, sleeps until None",
        "worker 1 reads the bell, sleeps until None",
    ]


@pytest.mark.parametrize("config", [DIRECT, DELAY, PLAIN], ids=["direct", "delay", "plain"])
def test_catches_abort_that_leaves_the_input_waiting(config: ShellConfig) -> None:
    found = _counterexample(config, AbortKeepsInput())
    assert "still waits in the room, its caller: cancelled" in found.message
    assert found.trace[-1].endswith("cancelled: stops waiting")


def test_catches_worker_answering_a_caller_that_stopped_waiting() -> None:
    found = _counterexample(DELAY, AnswerIgnoresTask())
    assert found.message == "caller 0 answered twice (('done', 'cancelled'), then result)"
    assert found.trace == [
        "caller 0 (a) admits at 0.0: ADMITTED",
        "caller 2 (a) admits at 0.0: ADMITTED",
        "worker 0 takes a:[0, 2] at 0.0",
        "caller 0 (a) cancelled: stops waiting",
        "worker 0 call a:[0, 2] returns  <-- fails here",
    ]


def test_catches_cancelled_worker_that_forgets_its_callers() -> None:
    found = _counterexample(DELAY, CancelledWorkerForgetsCallers())
    assert found.message == "caller 0 is parked but its input is in 0 places"
    assert found.trace[-2:] == ["close begins", "worker 0 call a:[0, 2] is cancelled"]


def test_catches_close_that_waits_before_cancelling_direct_calls() -> None:
    found = _counterexample(HANG, CloseWaitsBeforeCancellingDirectCalls())
    assert found.message == "caller 0 never got an outcome: direct"
    assert found.trace[0] == "caller 0 (a) admits at 0.0: CLAIMED"
    assert found.trace[-1] == "close drains"


def test_catches_a_release_that_does_not_tell_workers_the_bound_held_back() -> None:
    # Direct calls fill the bound; the next key waits, ready; a direct call ends and nobody comes.
    found = _counterexample(BOUND_DIRECT, ReleaseIgnoresTheBound(), wakeups="stuck")
    assert found.message.startswith("lost wake-up: a lane ready"), found.message
    assert found.trace[-1].endswith("key released")
    # With batches only, the releasing worker takes the lane itself, but the other one, held
    # back by the bound, sleeps on while it could serve it.
    found = _counterexample(BOUND_DELAY, ReleaseIgnoresTheBound())
    assert "oversleeps" in found.message, found.message


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(DIRECT, id="direct"),
        # The other two shapes under `-m long`: some 13 s of the default run's budget for a
        # finding (not a guard against a bug) that the direct shape already shows.
        pytest.param(DELAY, id="delay", marks=pytest.mark.long),
        pytest.param(PLAIN, id="plain", marks=pytest.mark.long),
    ],
)
def test_take_ring_is_not_needed_for_wakeups(config: ShellConfig) -> None:
    """A finding, not a bug: every worker asleep when a take leaves lanes ready was already
    rung (the lane became ready by a ringing admit or release) or is due (the take promoted lanes
    whose deadline every sleeper's own deadline precedes). The ring only wakes them sooner."""
    ShellChecker(config, TakeNeverRings()).run()


def test_unplanted_shell_protocol_flags_are_on() -> None:
    p = ShellProtocol()
    assert p.abort_drops_input and p.answer_checks_task and p.cancelled_worker_answers
    assert p.peek_without_checkpoint and p.close_cancels_direct_calls


# ---- the model's ring conditions are the shell's ------------------------------------------------


def test_ring_conditions_mirror_the_real_shell() -> None:
    """Random walks through the real `Room` transactions: the bell rings exactly when the
    model's predicates say so (and never on cancel), both ways seen for every transaction.

    (With direct calls and zero delay an admission never rings: a new key is claimed and a busy
    lane is not queued; in the plain room a release never rings: its lane stays queued.)
    """
    seen: set[tuple[str, bool]] = set()
    for limits in (
        Limits(max_batch_size=2, direct_calls=True),
        Limits(max_batch_size=2, direct_calls=True, max_in_flight=2),
        Limits(max_batch_size=2, max_batch_delay=1.0),
        Limits(max_batch_size=2, max_batch_delay=1.0, max_in_flight=1),
        Limits(max_batch_size=3, max_batch_delay=0.5, one_in_flight=False),
    ):
        _walk(limits, seen)
    for txn in ("admit", "take", "release"):
        assert (txn, True) in seen and (txn, False) in seen, (txn, seen)


def test_mirror_check_sees_a_wrong_ring_condition() -> None:
    with pytest.raises(AssertionError):
        _walk(Limits(max_batch_size=2, direct_calls=True), set(), ReleaseForgetsToRing())
    with pytest.raises(AssertionError):
        _walk(Limits(max_batch_size=2, max_batch_delay=1.0), set(), AdmitRingsOnlyForReady())


def _walk(limits: Limits, seen: set[tuple[str, bool]], proto: ShellProtocol | None = None) -> None:
    """The room is trio-free with time passed in: no trio run, no clock, only `now`."""
    proto = proto or ShellProtocol()
    plain = not limits.one_in_flight
    keys: list[Any] = [None] if plain else ["a", "b", "c"]
    room: Room[Any, int] = Room(limits)
    state, bell = room.state, room.bell
    rnd = random.Random(1234)
    held: list[Any] = []  # keys with a call in flight (batch or direct)
    waiting: list[tuple[Any, Item[int]]] = []
    now = 0.0

    def rung(before: int) -> bool:
        return bell.peek() != before

    for n in range(3000):
        op = rnd.choice(["admit", "admit", "take", "release", "cancel", "tick"])
        old, b0 = state.peek(), bell.peek()
        if op == "admit":
            key = rnd.choice(keys)
            got = room.admit(key, n, 1.0, None, now)
            assert rung(b0) == proto.admit_rings(old, state.peek())
            seen.add(("admit", rung(b0)))
            if got is Admission.CLAIMED:
                held.append(key)
            elif type(got) is Item:
                waiting.append((key, got))
            else:
                assert got in (Admission.REJECTED, Admission.CLOSED), got
        elif op == "take":
            batch = room.take(now)
            if batch is None:
                assert state.peek() is old and not rung(b0)
                continue
            assert rung(b0) == proto.take_rings(state.peek())
            seen.add(("take", rung(b0)))
            held.append(batch.key)
        elif op == "release" and held:
            key = held.pop(rnd.randrange(len(held)))
            room.release(key, now, False)
            assert rung(b0) == proto.release_rings(old, state.peek())
            seen.add(("release", rung(b0)))
        elif op == "cancel" and waiting:
            key, item = waiting.pop(rnd.randrange(len(waiting)))
            room.cancel(key, item)
            assert not rung(b0)
        elif op == "tick":
            now += 0.25
        core.check_invariants(state.peek())
