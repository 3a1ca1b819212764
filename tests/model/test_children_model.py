"""The children model check on its default bounds, and the planted bugs it must catch: a child
started twice after a crash, a parent resumed before its last child ended, a completed child
not compensated when its parent compensates, a child compensated twice (`planted_children.py`);
and the family's transitions one write at a time: the spawn, a wake for a waiting parent, a
timeout with ``on_failure="continue"`` and what the next step reads of its children, a cancel
that cascades to a grandchild level by level."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from ferry.flow._model import _family as fam
from ferry.flow._model import _machine as fm
from ferry.flow._model._children import ChildResult
from ferry.flow._model._types import Delivery
from ferry.flow._model._values import (
    COMPENSATING,
    EMPTY_MAILBOX,
    FAILED,
    PARKED,
    RUNNING,
    Message,
    Received,
    Shape,
)
from tests.model.checker import Counterexample
from tests.model.children import CHILD, ChildrenChecker, ChildrenConfig, ChildrenProtocol
from tests.model.children_wired import WiredProtocol
from tests.model.planted_children import (
    RecoveryStartsTheChildrenAgain,
    ResumesOneEndEarly,
    ResumesWhenNoneIsActive,
    UndoForgetsItsEnd,
    UndoHangsOffTheSpawnsCompensation,
    WiredEndForgetsTheKept,
    WiredEndStartsTheKeptAgain,
)

ALL_AT_ONCE = ChildrenConfig("both at once, compensate", crashes=2, child_cancel=True)
ONE_AT_A_TIME = ChildrenConfig(
    "one at a time, continue, a spawning step without a compensation",
    max_running=1,
    on_failure="continue",
    spawn_compensates=False,
    crashes=2,
    child_cancel=True,
)
ONE_AT_A_TIME_COMPENSATE = ChildrenConfig(
    "one at a time, compensate", max_running=1, crashes=1, child_cancel=True
)
DEFAULT = (ALL_AT_ONCE, ONE_AT_A_TIME, ONE_AT_A_TIME_COMPENSATE)
# Three children: a kept child behind two running ones, and one at a time with crashes (each
# about 15 s on one core; three at once is 750,000 states, minutes).
LARGER = (
    ChildrenConfig(
        "three, two at a time, a spawning step without a compensation",
        children=3,
        max_running=2,
        spawn_compensates=False,
        child_cancel=True,
    ),
    ChildrenConfig(
        "three, one at a time, continue",
        children=3,
        max_running=1,
        on_failure="continue",
        crashes=2,
        child_cancel=True,
    ),
)

# What every default bound must reach, so that no property holds for want of a case.
REACHED = {
    *("end COMPLETED", "end FAILED", "a child undone", "undone_by_parent", "children_ended"),
    *("crash", "write refused", "timeout", "timed_out", "cancel a child"),
    *("cancel waiting True", "cancel True", "cancel False"),
}


@pytest.mark.parametrize("config", DEFAULT, ids=lambda c: c.name)
def test_children_model_check(config: ChildrenConfig) -> None:
    checker = ChildrenChecker(config)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert report.states > 1_000  # the bounds really branch
    missing = REACHED - checker.coverage
    assert not missing, f"the bound never reaches {sorted(missing)}"


@pytest.mark.long
@pytest.mark.parametrize("config", LARGER, ids=lambda c: c.name)
def test_children_model_check_larger_bounds(config: ChildrenConfig) -> None:
    checker = ChildrenChecker(config)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    missing = REACHED - checker.coverage
    assert not missing, f"the bound never reaches {sorted(missing)}"


def _counterexample(config: ChildrenConfig, protocol: ChildrenProtocol) -> Counterexample:
    return ChildrenChecker(config, protocol).find()


def test_catches_a_child_started_twice_after_a_crash() -> None:
    found = _counterexample(ALL_AT_ONCE, RecoveryStartsTheChildrenAgain())
    assert "started twice" in found.message
    assert any("crashes" in step for step in found.trace)


def test_catches_a_parent_resumed_before_its_last_child_ended() -> None:
    found = _counterexample(ONE_AT_A_TIME, ResumesWhenNoneIsActive())
    assert "the parent went on" in found.message
    assert "kept" in found.message
    # Without the family's own rule, the history shows it: the next step ran, a child was left.
    found = ChildrenChecker(ONE_AT_A_TIME, ResumesWhenNoneIsActive(), check_family=False).find()
    assert "never started, and nothing stopped the spawn" in found.message


def test_catches_a_parent_resumed_while_its_last_child_runs() -> None:
    found = _counterexample(ALL_AT_ONCE, ResumesOneEndEarly())
    assert "the parent went on in phase over with children active" in found.message
    quiet = attrs.evolve(ALL_AT_ONCE, cancel=False, child_cancel=False)
    found = ChildrenChecker(quiet, ResumesOneEndEarly(), check_family=False).find()
    assert "the parent ran its next step while child" in found.message
    # A cancel of the last child finds the parent gone on: the family's own assertion.
    found = ChildrenChecker(ALL_AT_ONCE, ResumesOneEndEarly(), check_family=False).find()
    assert "does not wait for its spawn" in found.message


def test_catches_a_completed_child_not_compensated_when_its_parent_compensates() -> None:
    found = _counterexample(ONE_AT_A_TIME, UndoHangsOffTheSpawnsCompensation())
    assert "the failed parent compensated children []" in found.message


def test_catches_a_child_compensated_twice() -> None:
    found = ChildrenChecker(ONE_AT_A_TIME, UndoForgetsItsEnd(), check_family=False).find()
    assert "compensated twice" in found.message
    # The family's own rule sees the forgotten end sooner, in the write that forgets it.
    found = _counterexample(ALL_AT_ONCE, UndoForgetsItsEnd())
    assert "undone, with a completed child not compensated" in found.message


def test_the_model_check_makes_the_ordinary_ends_with_the_engines_sql() -> None:
    """The default protocol is the wired engine's (`children_wired`): each distinct ordinary end
    the search reaches is `record_end` on a database, checked against the pure rule."""
    checker = ChildrenChecker(ONE_AT_A_TIME_COMPENSATE)
    checker.run()
    assert isinstance(checker.protocol, WiredProtocol) and checker.protocol.wired_ends > 5


def test_catches_an_end_whose_sql_resumes_the_parent_before_a_kept_child() -> None:
    found = ChildrenChecker(ONE_AT_A_TIME, WiredEndForgetsTheKept()).find()
    assert "the wired end writes" in found.message  # the SQL against the pure rule
    # Without that cross-check, the family's rule sees it, and without that, the history.
    found = ChildrenChecker(ONE_AT_A_TIME, WiredEndForgetsTheKept(cross_check=False)).find()
    assert "kept children [1], the first kept one is 2" in found.message
    quiet = WiredEndForgetsTheKept(cross_check=False)
    found = ChildrenChecker(ONE_AT_A_TIME, quiet, check_family=False).find()
    assert "children ['b'] never started, and nothing stopped the spawn" in found.message


def test_catches_an_end_whose_sql_leaves_a_started_child_kept() -> None:
    found = ChildrenChecker(ONE_AT_A_TIME, WiredEndStartsTheKeptAgain()).find()
    assert "the wired end writes" in found.message
    found = ChildrenChecker(ONE_AT_A_TIME, WiredEndStartsTheKeptAgain(cross_check=False)).find()
    assert "counts 1 active children" in found.message


# ---- the family's pure transitions, one write each (what the model check composes) ----------


def _spawn(n: int, max_running: int | None, on_failure: str = "compensate") -> tuple[Any, ...]:
    shape = ChildrenConfig("unit", on_failure=on_failure).shape
    parent = fm.start(shape, "order", "{}", 0.0).flow
    move = fam.spawned(
        parent,
        shape,
        [(f"box-{i}", CHILD, f'{{"box":{i}}}') for i in range(n)],
        max_running=max_running,
        timeout=60.0,
        on_failure="continue" if on_failure == "continue" else "compensate",
        data='{"boxes":3}',
        now=10.0,
    )
    return shape, move


def test_a_spawn_is_one_write_of_the_outcome_and_the_first_children() -> None:
    _, move = _spawn(3, max_running=2)
    assert move.parent is not None and move.parent.written
    parent = move.parent.flow
    assert (parent.state, parent.step_index, parent.park_deadline) == (PARKED, 0, 70.0)
    assert parent.on_timeout == "compensate" and parent.data == '{"boxes":3}'
    assert move.parent.events[0].detail == {
        "outcome": "spawn",
        "children": 3,
        "max_running": 2,
        "timeout": 60.0,
        "on_failure": "compensate",
    }
    assert [t.flow.flow_id for t in move.children] == ["order/0/box-0", "order/0/box-1"]
    assert all(t.expected == 0 and t.flow.state is RUNNING for t in move.children)
    assert [k.status for k in move.kids] == [fam.ACTIVE, fam.ACTIVE, fam.KEPT]
    assert move.kids[2].data == '{"box":2}'  # a kept child keeps the data it was given
    assert (move.brood.active, move.brood.next_kept, move.brood.ended) == (2, 2, 0)
    fam.check_family(parent, move.brood, move.kids, (*(t.flow for t in move.children), None))


def test_a_wake_for_a_parent_waiting_for_its_children_is_queued_for_its_next_park() -> None:
    _, move = _spawn(2, max_running=None)
    assert move.parent is not None
    parent = move.parent.flow
    assert fam.waits(parent, move.brood) and not fam.runnable(parent, move.brood)
    t = fam.wake_waiting(parent, EMPTY_MAILBOX, Message("m1", '"go"'), 11.0)
    assert t.delivery is Delivery.QUEUED and not t.written and t.flow is parent
    assert t.messages == (Received(Message("m1", '"go"'), taken=False, at=11.0),)
    again = fam.wake_waiting(parent, t.mailbox, Message("m1", '"go"'), 12.0)
    assert again.delivery is Delivery.DUPLICATE and not again.done and not again.messages


def test_a_timeout_with_continue_shows_the_kept_children_as_not_started() -> None:
    shape, move = _spawn(3, max_running=1, on_failure="continue")
    assert move.parent is not None
    parent, brood, kids = move.parent.flow, move.brood, move.kids
    children = (move.children[0].flow, None, None)
    early = fam.timed_out(brood, kids, children, parent, shape, lambda p, v: CHILD, 69.0)
    assert early.parent is not None and not early.parent.done  # not yet at the deadline
    m = fam.timed_out(brood, kids, children, parent, shape, lambda p, v: CHILD, 70.0)
    assert m.brood.phase == fam.OVER and m.parent is not None  # box-0 had nothing to undo
    assert [e.kind for e in m.parent.events] == ["timed_out", "children_ended"]
    assert m.parent.flow.state is RUNNING and m.parent.flow.step == "invoice"
    assert m.parent.flow.revision == parent.revision + 1  # one write, one revision
    kids = tuple({**{k.index: k for k in kids}, **{k.index: k for k in m.kids}}.values())
    seen = fam.results(m.brood, kids)
    assert list(seen) == ["box-0", "box-1", "box-2"]  # spawn order
    assert seen["box-0"].state is FAILED and seen["box-0"].error == "timeout"
    assert seen["box-2"] == ChildResult("order/0/box-2", FAILED, {"box": 2}, seen["box-2"].error)
    assert "not started" in (seen["box-2"].error or "")


REGION = Shape("region", 1, ("split", "report"), (True, False), (1, 1))


def _shapes(plan: str, version: int) -> Shape:
    return {"box": CHILD, "region": REGION}[plan]


def test_a_cancel_cascades_to_a_grandchild_level_by_level() -> None:
    """A child that waits for children of its own is not cancelled (and so compensated) while
    they run: it is left to its own cancel, which the spawn above asks for until it is done."""
    shape = ChildrenConfig("unit").shape
    top = fm.start(shape, "order", "{}", 0.0).flow
    m1 = fam.spawned(
        top,
        shape,
        [("r1", REGION, "{}")],
        max_running=None,
        timeout=None,
        on_failure="compensate",
        data="{}",
        now=1.0,
    )
    assert m1.parent is not None
    parent, region = m1.parent.flow, m1.children[0].flow
    m2 = fam.spawned(
        region,
        REGION,
        [("b1", CHILD, "{}")],
        max_running=None,
        timeout=None,
        on_failure="compensate",
        data="{}",
        now=2.0,
    )
    assert m2.parent is not None
    region, box = m2.parent.flow, m2.children[0].flow
    assert box.flow_id == "order/0/r1/0/b1"

    m3 = fam.cancel_waiting(
        m1.brood, m1.kids, (region,), parent, shape, "cancelled", _shapes, 3.0, nested={0}
    )
    assert m3.parent is not None and m3.parent.flow.state is PARKED  # it waits for its child
    assert m3.children == () and m3.brood.phase == fam.STOPPING  # the child is left for later
    assert fam.cascade_due(m3.brood, region, m2.brood)
    parent = m3.parent.flow

    m4 = fam.cancel_waiting(m2.brood, m2.kids, (box,), region, REGION, "cancelled", _shapes, 4.0)
    assert [t.flow.state for t in m4.children] == [FAILED]  # the grandchild: nothing to undo
    assert m4.parent is not None
    region = m4.parent.flow
    assert (region.state, region.step) == (COMPENSATING, "split")  # its own compensation next
    assert m4.brood.phase == fam.UNDONE and fam.runnable(region, m4.brood)
    assert not fam.cascade_due(m3.brood, region, m4.brood)  # done: not asked again

    done = fm.compensated(region, REGION, region.data, 5.0)
    assert done.flow.state is FAILED
    m5 = fam.child_ended(m3.brood, m1.kids, (region,), parent, shape, 0, region, done, _shapes, 5.0)
    assert m5.parent is not None and m5.parent.flow.state is COMPENSATING  # the top compensates
    assert m5.brood.phase == fam.UNDONE and [k.status for k in m5.kids] == ["failed"]
