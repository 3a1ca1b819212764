"""The children model check on its default bounds, and the planted bugs it must catch: a child
started twice after a crash, a parent resumed before its last child ended, a completed child
not compensated when its parent compensates, a child compensated twice (`planted_children.py`).
"""

from __future__ import annotations

import pytest

from tests.model.checker import Counterexample
from tests.model.children import ChildrenChecker, ChildrenConfig, ChildrenProtocol
from tests.model.planted_children import (
    RecoveryStartsTheChildrenAgain,
    ResumesWhenNoneIsActive,
    UndoForgetsItsEnd,
    UndoHangsOffTheSpawnsCompensation,
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


def test_catches_a_completed_child_not_compensated_when_its_parent_compensates() -> None:
    found = _counterexample(ONE_AT_A_TIME, UndoHangsOffTheSpawnsCompensation())
    assert "the failed parent compensated children []" in found.message


def test_catches_a_child_compensated_twice() -> None:
    found = ChildrenChecker(ONE_AT_A_TIME, UndoForgetsItsEnd(), check_family=False).find()
    assert "compensated twice" in found.message
    # The family's own rule sees the forgotten end sooner, in the write that forgets it.
    found = _counterexample(ALL_AT_ONCE, UndoForgetsItsEnd())
    assert "undone, with a completed child not compensated" in found.message
