"""The property test's oracle catches planted bugs (tests/flow/test_properties.py).

Each planted test runs one fixed scenario of the property test's state machine (as an
``@example`` would) with one function of the engine monkeypatched to a wrong behaviour, and
expects the oracle's check that names the problem to fail. The same scenarios pass on the
engine as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest

from ferry.flow import _machine

from .test_properties import (
    Act,
    CompAct,
    PlanSpec,
    PropertyFailure,
    StartCall,
    StepSpec,
    run_scenario,
)

# A step that raises once, then goes on: its second run must be attempt 2.
RETRIED = PlanSpec(
    "order",
    (
        StepSpec("reserve", 1, (Act("return", "none", "good", {"sku": "A1"}),), (CompAct("ok"),)),
        StepSpec("pay", 2, (Act("raise"), Act("return", "complete", "good")), None),
    ),
)


def run_retried() -> None:
    run_scenario([RETRIED], lambda m: m.do_start([StartCall(0, "o-1", {"sku": "A1"}, True)]))


def test_a_retried_step_passes_the_oracle() -> None:
    run_retried()


def test_the_oracle_catches_a_retry_that_repeats_its_attempt_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real: Callable[..., _machine.Transition] = _machine.next_attempt

    def same_attempt(flow: _machine.Flow, now: float) -> _machine.Transition:
        t = real(flow, now)
        return attrs.evolve(t, flow=attrs.evolve(t.flow, attempt=flow.attempt))

    monkeypatch.setattr(_machine, "next_attempt", same_attempt)
    with pytest.raises(PropertyFailure, match=r"not where it would be alone: .*'runs'"):
        run_retried()
