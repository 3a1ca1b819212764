"""Unit tests of the pure flow machine (`ferry.flow._model._machine`): no trio, no clock, no
store."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferry.flow._model import _holders as h
from ferry.flow._model import _invariants, _values
from ferry.flow._model import _machine as m
from ferry.flow._model._checks import fail, park
from ferry.flow._model._types import COMPLETE, CONTINUE, Delivery, Event, Outcome, State
from ferry.flow._model._values import (
    EMPTY_MAILBOX,
    Flow,
    InvalidTransition,
    InvariantError,
    Mailbox,
    Message,
    Received,
    Shape,
    Taken,
    Transition,
)

SHAPE = Shape(
    name="order",
    version=1,
    steps=("reserve", "charge", "ship"),
    compensable=(True, True, False),
    attempts=(3, 3, 3),
)
T0 = 1000.0


def started(data: str = '{"a":1}') -> Flow:
    t = m.start(SHAPE, "f1", data, T0)
    _invariants.check_invariants(t.flow, t.mailbox, SHAPE)
    return t.flow


def run_to(flow: Flow, index: int) -> Flow:
    """Continue steps until the flow runs step `index`."""
    while flow.step_index < index:
        flow = m.step_done(flow, EMPTY_MAILBOX, SHAPE, CONTINUE, flow.data, T0).flow
    return flow


def parked(at: int = 1, timeout: float | None = 60.0, on_timeout: str = "compensate") -> Flow:
    flow = run_to(started(), at)
    t = m.step_done(flow, EMPTY_MAILBOX, SHAPE, park(timeout, on_timeout), flow.data, T0)  # type: ignore[arg-type]
    assert t.flow.state is State.PARKED
    return t.flow


def kinds(t: Transition) -> list[str]:
    return [e.kind for e in t.events]


def test_start() -> None:
    t = m.start(SHAPE, "f1", "{}", T0, owner="e1")
    f = t.flow
    assert (f.state, f.step_index, f.step, f.attempt, f.revision) == (
        State.RUNNING,
        0,
        "reserve",
        1,
        1,
    )
    assert f.owner == "e1" and t.expected == 0 and t.written
    assert kinds(t) == ["started"]
    assert t.events[0].revision == 1 and t.events[0].at == T0


def test_continue_through_every_step_completes_and_stacks_compensable_steps() -> None:
    f = started()
    t1 = m.step_done(f, EMPTY_MAILBOX, SHAPE, None, '{"a":2}', T0 + 1)
    assert (t1.flow.step, t1.flow.stack, t1.flow.data, t1.flow.revision) == (
        "charge",
        (0,),
        '{"a":2}',
        2,
    )
    assert kinds(t1) == ["step"] and t1.events[0].step == "reserve"
    t2 = m.step_done(t1.flow, EMPTY_MAILBOX, SHAPE, CONTINUE, t1.flow.data, T0 + 2)
    assert t2.flow.stack == (0, 1) and t2.flow.step == "ship" and t2.flow.attempt == 1
    t3 = m.step_done(t2.flow, EMPTY_MAILBOX, SHAPE, CONTINUE, t2.flow.data, T0 + 3)
    assert t3.flow.state is State.COMPLETED and t3.flow.step is None and t3.flow.stack == ()
    assert kinds(t3) == ["step", "completed"]
    assert t3.flow.revision == 4 and all(e.revision == 4 for e in t3.events)
    _invariants.check_invariants(t3.flow, EMPTY_MAILBOX, SHAPE)


def test_complete_skips_the_rest() -> None:
    t = m.step_done(started(), EMPTY_MAILBOX, SHAPE, COMPLETE, '{"x":1}', T0)
    assert t.flow.state is State.COMPLETED and t.flow.data == '{"x":1}'
    assert kinds(t) == ["step", "completed"]


def test_park_then_wake_runs_the_next_step_with_the_payload() -> None:
    p = parked(at=1, timeout=60)
    assert p.park_deadline == T0 + 60 and p.on_timeout == "compensate"
    assert p.step == "charge" and p.stack == (0, 1)  # a step that parked has completed
    t = m.wake(p, EMPTY_MAILBOX, Message("m1", '{"ok":true}'), SHAPE, T0 + 5)
    assert t.delivery is Delivery.RESUMED and t.written
    f = t.flow
    assert (f.state, f.step, f.wake, f.park_deadline, f.attempt) == (
        State.RUNNING,
        "ship",
        '{"ok":true}',
        None,
        1,
    )
    assert t.messages == (Received(Message("m1", '{"ok":true}'), taken=True, at=T0 + 5),)
    assert t.mailbox.seen == {"m1"} and t.mailbox.queued == ()
    assert kinds(t) == ["woken"]
    _invariants.check_invariants(f, t.mailbox, SHAPE)
    # the wake is the current step's: it stays for a retry of that step
    assert m.next_attempt(f, T0).flow.wake == '{"ok":true}'
    # and is gone once that step is done
    done = m.step_done(f, t.mailbox, SHAPE, CONTINUE, f.data, T0)
    assert done.flow.wake is None and done.flow.state is State.COMPLETED


def test_wake_before_the_park_is_queued_then_taken_by_the_park() -> None:
    f = run_to(started(), 1)
    q = m.wake(f, EMPTY_MAILBOX, Message("early", '"paid"'), SHAPE, T0)
    assert q.delivery is Delivery.QUEUED
    assert (
        not q.written and q.flow == f
    )  # the row does not change: the running step is not disturbed
    assert q.messages == (Received(Message("early", '"paid"'), taken=False, at=T0),)
    assert q.mailbox == Mailbox((Message("early", '"paid"'),), frozenset({"early"}))
    t = m.step_done(f, q.mailbox, SHAPE, park(3600), f.data, T0 + 1)
    assert t.flow.state is State.RUNNING and t.flow.step == "ship" and t.flow.wake == '"paid"'
    assert t.messages == (Taken(Message("early", '"paid"')),)
    assert t.mailbox.queued == () and t.mailbox.seen == {"early"}
    assert kinds(t) == ["step", "parked", "woken"]
    _invariants.check_invariants(t.flow, t.mailbox, SHAPE)


def test_second_queued_message_stays_for_the_next_park() -> None:
    f = started()
    box = EMPTY_MAILBOX
    for mid in ("a", "b"):
        box = m.wake(f, box, Message(mid, "1"), SHAPE, T0).mailbox
    t = m.step_done(f, box, SHAPE, park(), f.data, T0)
    assert t.flow.step == "charge" and t.mailbox.queued == (Message("b", "1"),)
    t2 = m.step_done(t.flow, t.mailbox, SHAPE, park(), f.data, T0)
    assert t2.flow.step == "ship" and t2.mailbox.queued == ()


def test_park_on_the_last_step_then_wake_completes() -> None:
    p = parked(at=2, timeout=None)
    assert p.park_deadline is None
    t = m.wake(p, EMPTY_MAILBOX, Message("m", "null"), SHAPE, T0)
    assert t.delivery is Delivery.RESUMED and t.flow.state is State.COMPLETED
    assert kinds(t) == ["woken", "completed"]


def test_duplicate_comes_before_stale() -> None:
    p = parked(at=2)
    t = m.wake(p, EMPTY_MAILBOX, Message("m", "null"), SHAPE, T0)
    assert t.flow.state is State.COMPLETED
    again = m.wake(t.flow, t.mailbox, Message("m", "null"), SHAPE, T0)
    assert again.delivery is Delivery.DUPLICATE and not again.done and not again.messages
    other = m.wake(t.flow, t.mailbox, Message("n", "null"), SHAPE, T0)
    assert other.delivery is Delivery.STALE and not other.done and not other.messages
    # a duplicate of a queued message, while running
    f = started()
    q = m.wake(f, EMPTY_MAILBOX, Message("x", "1"), SHAPE, T0)
    assert m.wake(f, q.mailbox, Message("x", "2"), SHAPE, T0).delivery is Delivery.DUPLICATE


def test_timeout_compensates_including_the_parked_step() -> None:
    p = parked(at=1, timeout=60)
    assert not m.timeout(p, SHAPE, T0 + 59.9).done
    assert not m.timeout(p, SHAPE, T0 + 60, expected=p.revision - 1).done
    t = m.timeout(p, SHAPE, T0 + 60, expected=p.revision)
    assert t.flow.state is State.COMPENSATING
    assert t.flow.step == "charge" and t.flow.step_index == 1 and t.flow.stack == (0, 1)
    assert t.flow.error is not None and "timed out" in t.flow.error
    assert t.flow.park_deadline is None and kinds(t) == ["timed_out"]
    _invariants.check_invariants(t.flow, None, SHAPE)


def test_timeout_continue_runs_the_next_step_timed_out() -> None:
    p = parked(at=1, timeout=5, on_timeout="continue")
    t = m.timeout(p, SHAPE, T0 + 5)
    assert t.flow.state is State.RUNNING and t.flow.step == "ship" and t.flow.timed_out
    assert t.flow.wake is None


def test_a_timer_never_fires_after_a_wake_was_accepted() -> None:
    p = parked(at=1, timeout=60)
    woken = m.wake(p, EMPTY_MAILBOX, Message("m", "1"), SHAPE, T0 + 1).flow
    late = m.timeout(woken, SHAPE, T0 + 120, expected=p.revision)
    assert not late.done and late.flow == woken
    assert not m.timeout(woken, SHAPE, T0 + 120).done  # not parked: nothing either way


def test_fail_compensates_completed_steps_in_reverse_order() -> None:
    shape = Shape("p", 1, ("a", "b", "c", "d"), (True, False, True, True), (1, 1, 1, 1))
    f = m.start(shape, "f", "{}", T0).flow
    for _ in range(3):
        f = m.step_done(f, EMPTY_MAILBOX, shape, None, "{}", T0).flow
    assert f.step == "d" and f.stack == (0, 2)
    t = m.step_done(f, EMPTY_MAILBOX, shape, fail("no stock"), '{"why":1}', T0)
    assert t.flow.state is State.COMPENSATING and t.flow.error == "no stock"
    assert t.flow.data == '{"why":1}'  # a returned fail() is an outcome: its data is kept
    order = []
    f = t.flow
    while f.state is State.COMPENSATING:
        order.append(f.step)
        _invariants.check_invariants(f, None, shape)
        f = m.compensated(f, shape, f.data, T0).flow
    assert order == ["c", "a"]  # "d" failed (not completed); "b" has no compensation
    assert f.state is State.FAILED and f.error == "no stock" and f.stack == ()


def test_fail_with_nothing_to_compensate_fails_at_once() -> None:
    t = m.step_done(started(), EMPTY_MAILBOX, SHAPE, fail("x"), "{}", T0)
    assert t.flow.state is State.FAILED and kinds(t) == ["step", "failed"]


def test_step_failed_discards_the_data_and_compensates() -> None:
    f = run_to(started('{"v":0}'), 1)
    t = m.step_failed(f, SHAPE, "boom", T0)
    assert t.flow.state is State.COMPENSATING and t.flow.step == "reserve"
    assert t.flow.data == f.data and t.flow.error == "boom"
    assert t.events[0].detail == {"outcome": "error", "error": "boom"}


def test_compensation_failure_blocks_and_resume_reruns_it() -> None:
    f = run_to(started(), 1)
    c = m.step_failed(f, SHAPE, "boom", T0).flow
    b = m.compensation_failed(c, "refund down", T0)
    assert b.flow.state is State.BLOCKED and b.flow.blocked_from is State.COMPENSATING
    assert _values.snapshot(b.flow).error == "compensation of step 'reserve' failed: refund down"
    assert b.flow.stack == (0,)  # nothing is lost
    _invariants.check_invariants(b.flow, None, SHAPE)
    r = m.resume(b.flow, EMPTY_MAILBOX, SHAPE, T0)
    assert r.done and r.flow.state is State.COMPENSATING and r.flow.attempt == c.attempt + 1
    assert r.flow.error == "boom"  # the saga's reason survives the block
    assert kinds(r) == ["resumed"]


def test_cancel() -> None:
    f = run_to(started(), 1)
    t = m.cancel(f, SHAPE, "customer", T0)
    assert t.done and t.flow.state is State.COMPENSATING and t.flow.step == "reserve"
    assert kinds(t) == ["cancelled"] and t.flow.error == "customer"
    p = parked(at=1)
    tp = m.cancel(p, SHAPE, "x", T0)
    assert tp.flow.state is State.COMPENSATING and tp.flow.step == "charge"  # the parked step
    assert tp.flow.park_deadline is None
    t0 = m.cancel(started(), SHAPE, "x", T0)
    assert t0.flow.state is State.FAILED and kinds(t0) == ["cancelled", "failed"]
    for flow in (t.flow, t0.flow, m.block(f, "why", T0).flow):
        nope = m.cancel(flow, SHAPE, "again", T0)
        assert not nope.done and not nope.written


CONFIRM = Shape("order", 1, ("reserve", "confirm", "ship"), (True, False, False), (1, 1, 1))


@pytest.mark.parametrize("at_park", [True, False], ids=["parked", "running"])
def test_a_cancel_without_the_plan_is_recorded_and_compensates_under_the_plan(
    at_park: bool,
) -> None:
    """Found by the model check (flow-model): a cancel through an engine that lacks the flow's
    plan version used to name the top of the stack after the current step, so no plan could
    drive or resume the flow any more. Now the compensation waits for its name."""
    f = m.start(CONFIRM, "f", "{}", T0).flow
    f = m.step_done(f, EMPTY_MAILBOX, CONFIRM, CONTINUE, "{}", T0).flow
    if at_park:
        f = m.step_done(f, EMPTY_MAILBOX, CONFIRM, park(10), "{}", T0).flow
    assert f.step == "confirm" and f.stack == (0,)
    t = m.cancel(f, None, "cancelled", T0 + 1)  # no plan: an operator, or a drained version
    assert t.done and kinds(t) == ["cancelled"] and t.events[0].step == "confirm"
    c = t.flow
    assert (c.state, c.step_index, c.step, c.error) == (State.COMPENSATING, 0, None, "cancelled")
    _invariants.check_invariants(c, t.mailbox, CONFIRM)
    assert _values.mismatch(c, CONFIRM) is None and m.step_name(c, CONFIRM) == "reserve"
    assert _values.mismatch(c, None) is not None  # an engine without the plan still fails closed
    # an engine with the plan runs it: the event is named by the plan
    done = m.compensated(c, CONFIRM, "{}", T0 + 2)
    assert [(e.kind, e.step) for e in done.events] == [("compensated", "reserve"), ("failed", None)]
    # an engine without it blocks it; the plan back, resume re-drives it
    b = m.block(c, str(_values.mismatch(c, None)), T0 + 2)
    _invariants.check_invariants(b.flow, b.mailbox, CONFIRM)
    assert not m.resume(b.flow, EMPTY_MAILBOX, None, T0 + 3).done
    r = m.resume(b.flow, EMPTY_MAILBOX, CONFIRM, T0 + 3)
    assert r.done and r.flow.state is State.COMPENSATING and r.flow.attempt == 2
    failed = m.compensation_failed(r.flow, "boom", T0 + 4, CONFIRM)
    assert failed.flow.blocked == "compensation of step 'reserve' failed: boom"
    # another plan whose index 0 has no compensation cannot drive it
    other = Shape("order", 1, ("a", "b", "c"), (False, False, False), (1, 1, 1))
    assert "no compensation at index 0" in str(_values.mismatch(c, other))


def test_versions_fail_closed() -> None:
    p = parked(at=1)
    v2 = attrs.evolve(SHAPE, version=2)
    assert "version 1 is not registered" in str(_values.mismatch(p, v2))
    renamed = attrs.evolve(SHAPE, steps=("reserve", "pay", "ship"))
    assert "has step 'pay' at index 1, but the flow is at step 'charge'" in str(
        _values.mismatch(p, renamed)
    )
    t = m.wake(p, EMPTY_MAILBOX, Message("m", "1"), None, T0)
    assert t.delivery is Delivery.QUEUED and t.flow.state is State.BLOCKED
    assert t.flow.blocked_from is State.PARKED and t.mailbox.queued == (Message("m", "1"),)
    _invariants.check_invariants(t.flow, t.mailbox, None)
    # a blocked flow keeps further wakes in its mailbox
    t2 = m.wake(t.flow, t.mailbox, Message("n", "2"), None, T0)
    assert t2.delivery is Delivery.QUEUED and not t2.written
    assert not m.resume(t2.flow, t2.mailbox, None, T0).done  # still not registered
    r = m.resume(t2.flow, t2.mailbox, SHAPE, T0)
    assert r.done and r.flow.state is State.RUNNING and r.flow.wake == "1"
    assert r.messages == (Taken(Message("m", "1")),) and r.mailbox.queued == (Message("n", "2"),)
    assert kinds(r) == ["resumed", "woken"]
    assert not m.resume(r.flow, r.mailbox, SHAPE, T0).done  # not blocked


def test_block_and_resume_a_running_flow() -> None:
    f = run_to(started(), 2)
    b = m.block(f, "plan missing", T0)
    assert b.flow.state is State.BLOCKED and b.flow.blocked_from is State.RUNNING
    assert _values.snapshot(b.flow).error == "plan missing"
    r = m.resume(b.flow, EMPTY_MAILBOX, SHAPE, T0)
    assert r.flow.state is State.RUNNING and r.flow.attempt == 2 and r.flow.step == "ship"
    assert not m.block(m.step_done(r.flow, EMPTY_MAILBOX, SHAPE, None, "{}", T0).flow, "x", T0).done


def test_next_attempt_and_invalid_transitions() -> None:
    f = started()
    t = m.next_attempt(f, T0)
    assert t.flow.attempt == 2 and t.flow.revision == 2 and t.events == ()
    p = parked()
    calls: list[Callable[[], object]] = [
        lambda: m.next_attempt(p, T0),
        lambda: m.step_done(p, EMPTY_MAILBOX, SHAPE, None, "{}", T0),
        lambda: m.step_failed(p, SHAPE, "x", T0),
        lambda: m.compensated(p, SHAPE, "{}", T0),
        lambda: m.compensation_failed(p, "x", T0),
        lambda: m.step_done(f, EMPTY_MAILBOX, SHAPE, "nope", "{}", T0),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidTransition):
            call()


def test_snapshot() -> None:
    p = parked(at=1, timeout=10)
    s = _values.snapshot(p)
    assert (s.flow_id, s.plan, s.version, s.state, s.step, s.step_index) == (
        "f1",
        "order",
        1,
        State.PARKED,
        "charge",
        1,
    )
    assert s.data == {"a": 1} and s.park_deadline == T0 + 10 and s.revision == p.revision
    assert s.error is None


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda f: attrs.evolve(f, stack=(1, 0)), "not strictly increasing"),
        (lambda f: attrs.evolve(f, stack=(0, 1, 2)), "at or after the current one"),
        (lambda f: attrs.evolve(f, state=State.COMPLETED, step=None), "compensations left"),
        (lambda f: attrs.evolve(f, wake="1"), "outside a running step"),
        (
            lambda f: attrs.evolve(
                f, state=State.FAILED, step=None, stack=(), park_deadline=None, on_timeout=None
            ),
            "without an error",
        ),
        (lambda f: attrs.evolve(f, revision=0), "revision 0"),
    ],
)
def test_check_invariants_catches_broken_states(bad, message) -> None:
    p = parked(at=1)
    _invariants.check_invariants(p, EMPTY_MAILBOX, SHAPE)
    with pytest.raises(InvariantError, match=message):
        _invariants.check_invariants(bad(p), None, None)


def test_check_invariants_catches_a_wake_left_queued_by_a_park() -> None:
    p = parked(at=1)
    with pytest.raises(InvariantError, match="wake before the park"):
        _invariants.check_invariants(p, Mailbox((Message("m", "1"),), frozenset({"m"})))


def test_stack_text_round_trips() -> None:
    for stack in [(), (0,), (0, 3, 11)]:
        assert _values.parse_stack(_values.stack_text(stack)) == stack


# A random walk over every transition, checking the invariants and the revision discipline at
# each step (the exhaustive model check lives elsewhere; this is its quick cousin).
ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "continue",
                "complete",
                "park",
                "park_continue",
                "fail",
                "raise",
                "retry",
                "wake",
                "wake_dup",
                "timeout",
                "cancel",
                "compensated",
                "compensation_failed",
                "block",
                "resume",
            ]
        ),
        st.floats(0, 100),
    ),
    max_size=40,
)


@given(ACTIONS)
def test_random_walk_keeps_the_invariants(actions) -> None:
    flow = started()
    box = EMPTY_MAILBOX
    now = T0
    n = 0
    history: list[Event] = []
    for action, dt in actions:
        now += dt
        t: Transition | None = None
        if action in ("continue", "complete", "park", "park_continue", "fail"):
            if flow.state is State.RUNNING:
                outcomes: dict[str, Outcome] = {
                    "continue": CONTINUE,
                    "complete": COMPLETE,
                    "park": park(50),
                    "park_continue": park(50, "continue"),
                    "fail": fail("f"),
                }
                t = m.step_done(flow, box, SHAPE, outcomes[action], flow.data, now)
        elif action == "raise":
            if flow.state is State.RUNNING:
                t = m.step_failed(flow, SHAPE, "boom", now)
        elif action == "retry":
            if flow.state in (State.RUNNING, State.COMPENSATING):
                t = m.next_attempt(flow, now)
        elif action in ("wake", "wake_dup"):
            n += action == "wake"
            t = m.wake(flow, box, Message(f"m{n}", str(n)), SHAPE, now)
        elif action == "timeout":
            t = m.timeout(flow, SHAPE, now)
        elif action == "cancel":
            t = m.cancel(flow, SHAPE, "c", now)
        elif action == "compensated":
            if flow.state is State.COMPENSATING:
                t = m.compensated(flow, SHAPE, flow.data, now)
        elif action == "compensation_failed":
            if flow.state is State.COMPENSATING:
                t = m.compensation_failed(flow, "x", now)
        elif action == "block":
            t = m.block(flow, "b", now)
        else:
            t = m.resume(flow, box, SHAPE, now)
        if t is None:
            continue
        assert t.expected == flow.revision
        assert t.flow.revision == flow.revision + (1 if t.written else 0)
        # every write but an attempt bump records history; nothing else records any
        assert t.written == bool(t.events) or (action == "retry" and t.written)
        assert all(e.revision == t.flow.revision for e in t.events)
        if flow.state in (State.COMPLETED, State.FAILED):
            assert not t.written  # terminal is final
        flow, box = t.flow, t.mailbox
        history.extend(t.events)
        _invariants.check_invariants(flow, box, SHAPE)
    compensated = [e.step for e in history if e.kind == "compensated"]
    # steps are compensated in reverse order of completion: charge before reserve
    assert compensated == sorted(compensated, key=SHAPE.steps.index, reverse=True)
    assert len(set(compensated)) == len(compensated)


# ------------------------------------------------------------------------- leases (the fleet)


def test_take_over_reruns_the_step_as_the_next_attempt_if_someone_may_have_run_it() -> None:
    f = attrs.evolve(run_to(started(), 1), owner="dead", released_at=None)
    t = h.take_over(f, "b", T0 + 5)
    assert t.written and t.events == () and t.expected == f.revision
    assert (t.flow.owner, t.flow.released_at, t.flow.attempt) == ("b", None, f.attempt + 1)
    nobodys = attrs.evolve(f, owner=None)  # an operator made it runnable: nobody ran it yet
    assert h.take_over(nobodys, "b", T0).flow.attempt == f.attempt
    with pytest.raises(InvalidTransition):
        h.take_over(parked(), "b", T0)


def test_assign_holder_gives_a_flow_to_its_writer_keeps_a_runner_frees_a_parked_one() -> None:
    f = attrs.evolve(run_to(started(), 1), owner="a")
    step = m.step_done(f, EMPTY_MAILBOX, SHAPE, CONTINUE, f.data, T0)
    assert h.assign_holder(step, f, "a", keep_runner=False).flow.owner == "a"
    # a cancel through b of a flow a runs leaves it with a (a's step must stop first) ...
    cancel = m.cancel(f, SHAPE, "x", T0)
    assert h.assign_holder(cancel, f, "b", keep_runner=True).flow.owner == "a"
    # ... one engine per file (keep_runner off) or an operator's engine: the writer's, or nobody's
    assert h.assign_holder(cancel, f, "b", keep_runner=False).flow.owner == "b"
    ops = h.assign_holder(m.cancel(f, SHAPE, "x", T0), f, None, keep_runner=True)
    assert ops.flow.owner == "a"
    p = attrs.evolve(parked(), owner="a", released_at=T0)
    woken = m.wake(p, EMPTY_MAILBOX, Message("m", "1"), SHAPE, T0)
    assert (
        h.assign_holder(woken, p, "b", keep_runner=True).flow.owner == "b"
    )  # b accepted it: b runs it
    assert (
        h.assign_holder(woken, p, None, keep_runner=True).flow.owner is None
    )  # an operator's: the fleet's
    parks = m.step_done(f, EMPTY_MAILBOX, SHAPE, park(60), f.data, T0)
    left = h.assign_holder(parks, f, "a", keep_runner=False).flow
    assert (left.state, left.owner, left.released_at) == (State.PARKED, None, None)
    assert h.assign_holder(m.block(left, "r", T0), left, "a", keep_runner=False).flow.owner is None
    queued = m.wake(f, EMPTY_MAILBOX, Message("q", "1"), SHAPE, T0)  # the row does not change
    assert not queued.written and h.assign_holder(queued, f, "z", keep_runner=False) is queued
